"""Speculative decoding: a proposer guesses a sequence's next tokens, one forward pass verifies them all.

A sequence that decodes with k draft tokens computes 1 + k positions in one step (its newest token and
the drafts), and its logits at each position say what the model would have sampled there. The drafts
are accepted up to the first one the target rejects; the target's own token at that position (or,
when every draft is accepted, at the position after the last) comes for free. Two proposers, with one
face (`propose_batch`, `release`, `all_free`): n-gram prompt lookup here (vLLM's `ngram` method: the
longest suffix of the sequence, of prompt_lookup_min..prompt_lookup_max tokens, that occurred earlier in
it, and the tokens that followed its latest earlier occurrence), and a smaller draft model of the same
vocabulary (engine/draft_model.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from pagedllm.engine.sequence import Sequence as Seq

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative_config, as a dict: {"method": "ngram", "num_speculative_tokens": 4, ...}, or
    {"model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 3} (method "draft_model", inferred)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None  # the draft model: a built-in name, a folder or a .gguf file, as the target's
    # The draft's LM head over the vocabulary's first draft_vocab_size tokens and its special ones (FR-Spec,
    # engine/draft_model.py); None: the whole vocabulary.
    draft_vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {list(METHODS)}, got {self.method!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(
                f"speculative_config method {self.method!r} with model {self.model!r}: a draft model is "
                "method 'draft_model' (or no method) and needs 'model'; 'ngram' takes no model"
            )
        _check_positive("num_speculative_tokens", self.num_speculative_tokens)
        if self.draft_vocab_size is not None:
            _check_positive("draft_vocab_size", self.draft_vocab_size)
            if self.model is None:
                raise ValueError("speculative_config draft_vocab_size is a draft model's: it needs 'model'")
        # vLLM's defaults: either bound alone sets both; neither: 5.
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        lo, hi = (lo or hi or 5), (hi or lo or 5)
        _check_positive("prompt_lookup_min", lo)
        _check_positive("prompt_lookup_max", hi)
        if lo > hi:
            raise ValueError(f"speculative_config prompt_lookup_min {lo} exceeds prompt_lookup_max {hi}")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    @classmethod
    def from_dict(cls, config: dict) -> SpeculativeConfig:
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict, got {config!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: {sorted(known)}")
        if "model" in config:  # vLLM infers the method from the model's name; any plain model is a draft
            config = {"method": "draft_model", **config}
        if "method" not in config or "num_speculative_tokens" not in config:
            raise ValueError("speculative_config needs 'method' (or 'model') and 'num_speculative_tokens'")
        return cls(**config)


def _check_positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"speculative_config {name} must be a positive integer, got {value!r}")


@dataclass
class Draft:
    """A sequence's proposed tokens, and the distribution q each was drawn from ([len, vocab]; None: chosen
    deterministically, a one-hot q), which the rejection-sampling rule divides by."""

    token_ids: list[int]
    probs: torch.Tensor | None = None


class NgramProposer:
    """Prompt lookup: draft tokens copied from after an earlier occurrence of the sequence's suffix."""

    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose_batch(self, seqs: list[Seq], rooms: list[int], generators: list) -> list[Draft]:
        """Each sequence's drafts, at most its room (generators: unused, the lookup is deterministic)."""
        return [Draft(self.propose(seq.token_ids, room)) for seq, room in zip(seqs, rooms, strict=True)]

    def release(self, seq_id: str) -> None:
        """Nothing is kept per sequence."""

    def all_free(self) -> bool:
        return True

    def propose(self, token_ids: Sequence[int], max_tokens: int | None = None) -> list[int]:
        """Up to min(k, max_tokens) draft tokens to follow `token_ids` ([] when no suffix recurs)."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        tokens = np.asarray(token_ids)
        if k <= 0 or len(tokens) < self.min_n + 1:
            return []
        # Where an earlier token equals the last one, then how far back each such match extends.
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        lengths = np.ones(len(ends), np.int64)
        alive = np.ones(len(ends), bool)
        for n in range(2, self.max_n + 1):
            starts = ends - (n - 1)
            alive &= starts >= 0
            alive[alive] = tokens[starts[alive]] == tokens[len(tokens) - n]
            if not alive.any():
                break
            lengths[alive] = n
        if not len(ends) or lengths.max() < self.min_n:
            return []
        best = ends[lengths == lengths.max()][-1]  # the longest match, its latest occurrence
        return tokens[best + 1 : best + 1 + k].tolist()


def accepted_length(target_token_ids: Sequence[int], draft_token_ids: Sequence[int]) -> int:
    """How many tokens the verify pass yields: the drafts up to the first whose row chose another token,
    plus that row's token (or the row after the last draft's). target_token_ids has len(drafts) + 1."""
    for i, draft in enumerate(draft_token_ids):
        if target_token_ids[i] != draft:
            return i + 1
    return len(draft_token_ids) + 1


def propose_drafts(proposer, running: list, requests: dict, max_model_len: int) -> None:
    """Draft tokens for each running sequence that decodes next step (not a beam, not guided: their next
    tokens depend on more than the logits), at most one fewer than it may still generate."""
    seqs = [
        seq
        for seq in running
        if seq.num_tokens - seq.num_cached_tokens == 1
        and seq.guide is None
        and requests[seq.request_id].beam_search is None
    ]
    rooms = [seq.max_new_tokens(max_model_len) - 1 for seq in seqs]
    generators = [requests[seq.request_id].generator for seq in seqs]
    for seq, draft in zip(seqs, proposer.propose_batch(seqs, rooms, generators), strict=True):
        seq.draft_token_ids, seq.draft_probs = draft.token_ids, draft.probs
