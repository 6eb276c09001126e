"""A request: its checked prompt, the sequences generated for it, and the RequestOutput reported of it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pagedllm.engine import detokenizer
from pagedllm.engine.beam_search import BeamSearchDriver
from pagedllm.engine.sequence import Sequence
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from pagedllm.engine.guided import Guide


def check_prompt(
    request_id: str,
    prompt: str | list[int],
    params: SamplingParams | BeamSearchParams,
    *,
    tokenizer,
    vocab_size: int,
    max_model_len: int,
    model: str,
) -> tuple[str | None, list[int]]:
    """The prompt's text (None for token ids) and token ids; a clear ValueError for what cannot run."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"model {model!r} has no tokenizer: pass prompt token ids")
        # With the tokenizer's special tokens (e.g. Gemma's BOS), as vLLM encodes a text prompt.
        text, token_ids = prompt, tokenizer.encode(prompt)
    else:
        text, token_ids = None, list(prompt)
    if not token_ids:
        raise ValueError(f"prompt is empty (request {request_id!r})")
    bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]!r} is out of range [0, {vocab_size})")
    bad = [t for t in getattr(params, "stop_token_ids", ()) if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids holds {bad[0]!r}, out of the vocabulary's range [0, {vocab_size})")
    if len(token_ids) >= max_model_len:
        raise ValueError(
            f"prompt has {len(token_ids)} tokens; max_model_len={max_model_len} leaves no room to generate"
        )
    return text, token_ids


@dataclass
class Request:
    """A prompt and the sequences generated from it: its n samples, or the running beams of a search."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # a beam search's: each beam's length limit (beam_sampling_params)
    generator: torch.Generator | None = None  # a seeded request's n samples draw from it in turn
    seqs: list[Sequence] = field(default_factory=list)  # in index order; a search's: its running beams
    beam_search: BeamSearchDriver | None = None
    first_seq: Sequence | None = None  # the prompt's own sequence (it counts the prefix cache's hits)
    num_created: int = 0  # sequences created so far (each gets the next index)
    lora_request: LoRARequest | None = None  # the adapter every sequence of it runs under (None: the base)
    prompt_logprobs: list[dict[int, float]] | None = field(init=False)  # its sequences' shared list

    def __post_init__(self) -> None:
        self.prompt_logprobs = [] if self.params.prompt_logprobs is not None else None

    def new_sequence(self, parent: Sequence | None = None, guide: Guide | None = None) -> Sequence:
        """The request's next sequence: its prompt alone, or a copy of `parent`'s tokens so far."""
        seq = Sequence(
            f"{self.request_id}#{self.num_created}",
            self.request_id,
            self.num_created,
            self.prompt_token_ids,
            self.params,
            guide=guide,
            prompt_logprobs=self.prompt_logprobs,
            lora_int_id=self.lora_request.lora_int_id if self.lora_request is not None else None,
        )
        self.num_created += 1
        if parent is not None:
            seq.output_token_ids = list(parent.output_token_ids)
            seq.cumulative_logprob = parent.cumulative_logprob
        detokenizer.start(seq)
        self.seqs.append(seq)
        self.first_seq = self.first_seq or seq
        return seq

    def fork_samples(self, seq: Sequence, fork: Callable[[Sequence], Sequence]) -> list[Sequence]:
        """Parallel sampling: once the first sequence's prompt is computed, its n - 1 siblings are forked
        from it (sharing the prompt's blocks), each to sample its own first token from the same logits.
        None for any other sequence, or later."""
        if seq is not self.first_seq or len(self.seqs) == self.params.n:
            return []
        return [fork(seq) for _ in range(1, self.params.n)]

    @property
    def finished(self) -> bool:
        if self.beam_search is not None:
            return self.beam_search.done
        return len(self.seqs) == self.params.n and all(seq.is_finished for seq in self.seqs)

    def output(self, tokenizer) -> RequestOutput:
        """Every sequence so far; a beam search reports its best finished beams (only once it is done)."""
        if self.beam_search is not None:
            skip = self.params.skip_special_tokens
            outputs = [
                CompletionOutput(
                    index=i,
                    text=tokenizer.decode(h.token_ids, skip_special_tokens=skip) if tokenizer else "",
                    token_ids=h.token_ids,
                    cumulative_logprob=h.cum_logprob,
                    finish_reason=h.finish_reason,
                )
                for i, h in enumerate(self.beam_search.search.finished)
            ]
        else:
            logprobs = self.params.logprobs is not None
            outputs = [
                CompletionOutput(
                    index=seq.index,
                    text=seq.text,
                    token_ids=list(seq.output_token_ids),
                    cumulative_logprob=seq.cumulative_logprob if logprobs else None,
                    logprobs=list(seq.output_logprobs) if logprobs else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
                for seq in self.seqs
            ]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            prompt_logprobs=None if self.prompt_logprobs is None else [None, *self.prompt_logprobs],
            num_cached_tokens=self.first_seq.num_prefix_hits,
        )
