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
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from pagedllm.sampling_params import BeamSearchParams


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
