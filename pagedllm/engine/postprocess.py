"""What happens after a forward pass: the step's logits become each sequence's next tokens.

Prompt log-probabilities are taken out of the logits first; then each computed sequence's next token is
sampled (an n > 1 request's siblings are forked at its first token and sample from the same logits), a
speculating sequence's drafts are verified (its k + 1 rows sampled, the accepted run kept), and a beam's
token is chosen by its search once the round is complete. The tokens go to the scheduler's
`update_from_output`, the one owner of what follows (appends, KV slots, stops, frees).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedllm.engine import prompt_logprobs
from pagedllm.engine.beam_search import beam_tokens
from pagedllm.engine.request import Request
from pagedllm.engine.sampler import Sample, SampleRow, sample
from pagedllm.engine.scheduler import Scheduler, SchedulerOutput
from pagedllm.engine.sequence import Sequence
from pagedllm.engine.speculative import accepted_length

NewTokens = list[tuple[Sequence, Sample]]


@dataclass
class SpecCounters:
    """Speculative decoding so far: verify passes, draft tokens checked, and how many were accepted."""

    verifies: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


class Postprocessor:
    """Turns a step's logits into new tokens and hands them to the scheduler."""

    def __init__(
        self,
        requests: dict[str, Request],
        scheduler: Scheduler,
        eos_token_ids: set[int],
        fork: Callable[[Sequence], Sequence],
    ):
        self.requests, self.scheduler, self.eos_token_ids, self.fork = (
            requests,
            scheduler,
            eos_token_ids,
            fork,
        )
        self.spec = SpecCounters()

    def gather_prompt_logprobs(self, out: SchedulerOutput, num_logits, logits: torch.Tensor) -> torch.Tensor:
        """Take the prompt log-probabilities out of the step's logits (each sequence's last num_logits
        rows); returns each scheduled sequence's last row, which its next token needs."""
        ends = num_logits.cumsum()
        for seq, end, count in zip(out.scheduled, ends.tolist(), num_logits.tolist(), strict=True):
            cached = seq.num_cached_tokens
            wanted = prompt_logprobs.wanted_positions(seq, cached - out.num_new_tokens[seq.seq_id], cached)
            if wanted:
                prompt_logprobs.gather(seq, wanted, logits[end - count : end])
        if len(logits) == len(ends):
            return logits
        return logits[torch.from_numpy(ends - 1).to(logits.device)]

    def process(self, out: SchedulerOutput, logits: torch.Tensor | None, lap: Callable[[str], None]) -> list:
        """The step's new tokens, sampled or chosen by beam searches, go to the scheduler. Returns the
        requests that changed (a beam search only once it is done)."""
        new_tokens = []
        for seq in out.ignored:  # finished by the scheduler: they can never fit the cache
            search = self.requests[seq.request_id].beam_search
            if search is not None:  # the search goes on without the beam (which may end its round)
                new_tokens += search.drop(seq)
        ready = [seq for _, seq in out.ready()] if logits is not None else []
        if ready:
            new_tokens += self._next_tokens(out, logits, lap)
        for seq in self.scheduler.update_from_output(new_tokens):
            search = self.requests[seq.request_id].beam_search
            if search is not None:  # a beam outgrew the cache (it cannot end a round: all just moved)
                search.drop(seq)
        changed = [*out.ignored, *ready, *(seq for seq, _ in new_tokens)]  # the last: n > 1 forks too
        requests = {seq.request_id: self.requests[seq.request_id] for seq in changed}
        return [request for request in requests.values() if request.beam_search is None or request.finished]

    def _next_tokens(
        self, out: SchedulerOutput, logits: torch.Tensor, lap: Callable[[str], None]
    ) -> NewTokens:
        """Each computed sequence's next token: sampled, or, for a beam, its search's once the round is
        complete."""
        rows, seqs, beams = [], [], []
        for row, seq in out.ready():
            search = self.requests[seq.request_id].beam_search
            if search is None:
                rows.append(row)
                seqs.append(seq)
            else:
                beams.append((row, seq, search))
        for row, seq in list(zip(rows, seqs, strict=True)):
            for child in self.requests[seq.request_id].fork_samples(seq, self.fork):
                rows.append(row)
                seqs.append(child)
        new_tokens = self._sample(rows, seqs, logits, lap) if seqs else []
        if beams:
            beam_logits = logits[[row for row, _, _ in beams]]
            new_tokens += beam_tokens(beam_logits, [(seq, search) for _, seq, search in beams])
        return new_tokens

    def _sample(self, rows: list[int], seqs: list[Sequence], logits: torch.Tensor, lap) -> NewTokens:
        """Sample every sequence's rows at once and keep each verify pass's accepted run. A sequence with k
        draft tokens has k + 1 rows: row i verifies draft i (the last: the token after them)."""
        picked_rows, sample_rows = [], []
        for row, seq in zip(rows, seqs, strict=True):
            drafts = seq.draft_token_ids
            for i in range(len(drafts) + 1):
                picked_rows.append(row + i)
                draft = drafts[i] if i < len(drafts) else None
                q = seq.draft_probs[i] if draft is not None and seq.draft_probs is not None else None
                sample_rows.append(self._sample_row(seq, drafts[:i], draft, q))
        all_rows = picked_rows == list(range(len(logits)))
        picked = logits if all_rows else logits[picked_rows]  # all: no copy
        lap("rest")
        samples = iter(sample(picked, sample_rows))
        new_tokens = []
        for seq in seqs:
            run = [next(samples) for _ in range(len(seq.draft_token_ids) + 1)]
            num_new = accepted_length([smp.token_id for smp in run], seq.draft_token_ids)
            if seq.draft_token_ids:
                self.spec.verifies += 1
                self.spec.draft_tokens += len(seq.draft_token_ids)
                self.spec.accepted_tokens += num_new - 1
            new_tokens += [(seq, smp) for smp in run[:num_new]]
        lap("sample")
        return new_tokens

    def _sample_row(
        self,
        seq: Sequence,
        accepted: list[int] | None = None,
        draft: int | None = None,
        draft_probs: torch.Tensor | None = None,
    ) -> SampleRow:
        """What the sampler needs for seq's next token; for a verify pass's row, the next token after the
        drafts before it (`accepted`, as if already sampled), checking `draft` (drawn from `draft_probs`)."""
        params = seq.params
        output = seq.output_token_ids + accepted if accepted else seq.output_token_ids
        banned: tuple[int, ...] = ()
        if len(output) < params.min_tokens:
            banned = tuple(params.stop_token_ids) + (() if params.ignore_eos else tuple(self.eos_token_ids))
        generator = self.requests[seq.request_id].generator
        return SampleRow(
            params,
            generator,
            banned,
            seq.prompt_token_ids,
            output,
            guide=seq.guide,
            draft_token_id=draft,
            draft_probs=draft_probs,
        )
