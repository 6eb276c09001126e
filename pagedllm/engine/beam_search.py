"""Beam search bookkeeping for one request, as Hugging Face transformers defines the search.

`generate(num_beams=k, do_sample=False, length_penalty=lp, early_stopping=es)` on a decoder-only
model, step by step: each running beam's next-token log-probabilities (log-softmax of the model's
logits) are added to its cumulative log-probability, and the best K = max(2, 1 + number of EOS ids) * k
continuations over all beams are ranked. A continuation that ends in EOS, or reaches max_tokens, is
finished: if it ranks among the first k it becomes a hypothesis scored cum_logprob / len ** lp (len =
generated tokens, the EOS included), and the k best hypotheses are kept. The k best unfinished
continuations are the next running beams. The search ends when every continuation is finished
(max_tokens), or once there are k hypotheses and early_stopping is True, or (False) the best running
beam's cum_logprob / its current length ** lp is no better than the worst hypothesis ("never": its
length at max_tokens when lp > 0).

vLLM's `LLM.beam_search` defines the score differently (the prompt counts in len, an EOS does not),
keeps every EOS continuation and never stops early; pagedllm follows Hugging Face.

`BeamSearch` is the search alone, on plain lists. `BeamSearchDriver` runs it for one request of the
engine, above the step loop: its running beams are ordinary sequences the scheduler computes alongside
every other request's, and the engine's postprocessing hands it each computed beam's best next tokens.
Once every running beam has its own it takes a step through two primitives of the engine: `fork` (a
beam chosen twice continues in a copy sharing its KV blocks copy-on-write) and `free` (a beam not
chosen gives its blocks back at once), and returns each beam's chosen token for the scheduler to append.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from pagedllm.engine.sampler import Sample
from pagedllm.engine.sequence import Sequence
from pagedllm.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class Hypothesis:
    """A finished beam."""

    token_ids: list[int]  # generated tokens, the EOS included
    cum_logprob: float
    score: float  # cum_logprob / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" (EOS) or "length"


@dataclass
class Continuation:
    """A running beam for the next step: beam `parent` of this step extended by `token_id`."""

    parent: int
    token_id: int
    cum_logprob: float


class BeamSearch:
    def __init__(self, params: BeamSearchParams, eos_token_ids: Collection[int], max_new_tokens: int):
        self.params = params
        self.eos_token_ids = set() if params.ignore_eos else set(eos_token_ids)
        self.max_new_tokens = max_new_tokens
        self.num_candidates = max(2, 1 + len(self.eos_token_ids)) * params.beam_width
        self.finished: list[Hypothesis] = []  # best first, at most beam_width
        self.done = False

    def step(
        self,
        beams: list[tuple[list[int], float]],
        top: list[tuple[list[float], list[int]]],
    ) -> list[Continuation]:
        """One step. beams: each running beam's (generated tokens, cum_logprob), all of one length;
        top: each beam's `num_candidates` best next tokens as (log-probabilities, token ids), best
        first. Returns the next running beams, best first (none once the search is done)."""
        k, length_penalty = self.params.beam_width, self.params.length_penalty
        length = len(beams[0][0]) + 1  # of every continuation
        ranked = sorted(
            (
                Continuation(b, token_id, cum + logprob)
                for b, ((_, cum), (logprobs, token_ids)) in enumerate(zip(beams, top, strict=True))
                for logprob, token_id in zip(logprobs, token_ids, strict=True)
            ),
            key=lambda c: -c.cum_logprob,
        )[: self.num_candidates]

        def ends(c: Continuation) -> bool:
            return c.token_id in self.eos_token_ids or length >= self.max_new_tokens

        for c in ranked[:k]:  # only the top k may finish; the rest are a reserve of running beams
            if ends(c):
                tokens = beams[c.parent][0] + [c.token_id]
                reason = "stop" if c.token_id in self.eos_token_ids else "length"
                self.finished.append(
                    Hypothesis(tokens, c.cum_logprob, c.cum_logprob / length**length_penalty, reason)
                )
        self.finished = sorted(self.finished, key=lambda h: -h.score)[:k]
        running = [c for c in ranked if not ends(c)][:k]
        self.done = not running or self._cannot_improve(running[0], length)
        return [] if self.done else running

    def _cannot_improve(self, best: Continuation, length: int) -> bool:
        """Hugging Face's stopping rule once beam_width hypotheses are finished."""
        if len(self.finished) < self.params.beam_width:
            return False
        if self.params.early_stopping is True:
            return True
        length_penalty = self.params.length_penalty
        if self.params.early_stopping == "never" and length_penalty > 0:
            length = self.max_new_tokens
        return best.cum_logprob / length**length_penalty <= self.finished[-1].score


def beam_sampling_params(params: BeamSearchParams) -> SamplingParams:
    """What the scheduler reads of each beam: its length limit. Stops are the search's business."""
    return SamplingParams(
        max_tokens=params.max_tokens,
        temperature=0.0,
        ignore_eos=True,
        skip_special_tokens=params.skip_special_tokens,
    )


class BeamSearchDriver:
    """One request's beam search over the engine's sequences (see the module's docstring)."""

    def __init__(
        self,
        params: BeamSearchParams,
        eos_token_ids: Collection[int],
        max_new_tokens: int,
        beams: list[Sequence],
        fork: Callable[[Sequence], Sequence],
        free: Callable[[Sequence], None],
    ):
        self.search = BeamSearch(params, eos_token_ids, max_new_tokens)
        self.beams = beams  # the running beams, best first (the request's own list, kept in place)
        self._fork, self._free = fork, free
        self._tops: dict[str, tuple[list[float], list[int]]] = {}  # this round's computed beams

    @property
    def done(self) -> bool:
        return self.search.done

    def computed(self, seq: Sequence, logprobs: list[float], token_ids: list[int]) -> None:
        """A beam's best next tokens (at least num_candidates, best first); it awaits the round's end."""
        num = self.search.num_candidates
        self._tops[seq.seq_id] = (logprobs[:num], token_ids[:num])
        seq.awaiting = True

    def drop(self, seq: Sequence) -> list[tuple[Sequence, Sample]]:
        """A beam that can never fit the KV cache: the search goes on without it."""
        self.beams.remove(seq)
        self._tops.pop(seq.seq_id, None)
        return self.advance()

    def advance(self) -> list[tuple[Sequence, Sample]]:
        """Once every running beam is computed, take a search step: returns each running beam's next token
        (none while a beam is still to compute: a preempted one may be a step behind its siblings)."""
        beams = list(self.beams)
        if not beams:  # every beam was dropped: nothing left to search
            self.search.done = True
        if not beams or any(seq.seq_id not in self._tops for seq in beams):
            return []
        tops = [self._tops.pop(seq.seq_id) for seq in beams]
        chosen = self.search.step([(seq.output_token_ids, seq.cumulative_logprob) for seq in beams], tops)
        extended: list[Sequence] = []
        kept: set[int] = set()
        for c in chosen:  # a parent chosen again continues in a fork; the others' blocks go back at once
            if c.parent in kept:
                extended.append(self._fork(beams[c.parent]))
            else:
                kept.add(c.parent)
                extended.append(beams[c.parent])
        for i, seq in enumerate(beams):
            if i not in kept:
                self._free(seq)
        self.beams[:] = extended
        for seq, c in zip(extended, chosen, strict=True):
            seq.cumulative_logprob = c.cum_logprob  # the search's own sum: its next step ranks by it
            seq.awaiting = False
        return [(seq, Sample(c.token_id)) for seq, c in zip(extended, chosen, strict=True)]


def beam_tokens(
    logits: torch.Tensor, beams: list[tuple[Sequence, BeamSearchDriver]]
) -> list[tuple[Sequence, Sample]]:
    """Hand each computed beam's best next tokens to its search (one log-softmax and top-k for all the
    rows of `logits`, one per beam), then advance every search: the next tokens of those that moved."""
    width = max(driver.search.num_candidates for _, driver in beams)
    logprobs, token_ids = logits.log_softmax(dim=-1).topk(width)
    for (seq, driver), lps, ids in zip(beams, logprobs.tolist(), token_ids.tolist(), strict=True):
        driver.computed(seq, lps, ids)
    searches = dict.fromkeys(driver for _, driver in beams)  # each once, in order
    return [token for driver in searches for token in driver.advance()]
