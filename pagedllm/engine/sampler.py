"""Turn each sequence's next-token logits into a token: greedy, or temperature / top-k / top-p / min-p.

In vLLM's order: log-probabilities (when asked for) come from the model's raw logits; then tokens that
may not come yet are banned, the presence / frequency / repetition penalties are applied, and the
token is chosen from what is left (greedy takes the penalized argmax too). A row that verifies a draft
token (speculative decoding) chooses by the rejection-sampling rule, which keeps the distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedllm import ops
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.engine.guided import Guide


@dataclass
class SampleRow:
    """What the sampler needs to know about one sequence."""

    params: SamplingParams
    generator: torch.Generator | None = None  # seeded requests sample reproducibly
    banned_token_ids: tuple[int, ...] = ()  # e.g. EOS before min_tokens is reached
    prompt_token_ids: Sequence[int] = ()  # read by the penalties only
    output_token_ids: Sequence[int] = ()
    guide: Guide | None = None  # guided decoding: only tokens its grammar allows next
    draft_token_id: int | None = None  # speculative decoding: the proposed token this row verifies
    draft_probs: torch.Tensor | None = None  # [vocab]: the q it was drawn from (None: one-hot, deterministic)


@dataclass
class Sample:
    token_id: int
    logprob: float | None = None  # of the chosen token under the model's distribution, if asked for
    top_logprobs: dict[int, float] | None = None


def _filtered_probs(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Temperature, then min-p, top-k and top-p masks (vLLM's order), applied to every row at once."""
    temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype, device=logits.device)
    # a penalty can leave logits at the dtype's largest value, which a temperature below 1 overflows:
    # +inf stays the largest finite value (two of them would make softmax's inf - inf a NaN)
    finfo = torch.finfo(logits.dtype)
    logits = (logits / temps[:, None]).nan_to_num_(nan=float("-inf"), posinf=finfo.max, neginf=float("-inf"))
    top_k = torch.tensor([r.params.top_k or logits.shape[1] for r in rows], device=logits.device)
    top_p = torch.tensor([r.params.top_p for r in rows], dtype=logits.dtype, device=logits.device)
    min_p = torch.tensor([r.params.min_p for r in rows], dtype=logits.dtype, device=logits.device)
    if (min_p > 0).any():
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(
            probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, float("-inf")
        )
    if (top_k < logits.shape[1]).any() or (top_p < 1).any():
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(logits.shape[1], device=logits.device)
        drop = rank[None, :] >= top_k[:, None]
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Keep the smallest head of the distribution whose mass reaches top_p (always the first token).
        drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]
        drop[:, 0] = False  # even a top_p too small for float32 (it rounds to 0) keeps the likeliest token
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits.softmax(dim=-1)


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """vLLM's penalties, in place: a token seen in the prompt or the output has its logit divided by
    repetition_penalty if positive, multiplied if not (Hugging Face's RepetitionPenaltyLogitsProcessor);
    then each output token loses frequency_penalty per occurrence and presence_penalty once (OpenAI)."""
    vocab, finfo = logits.shape[1], torch.finfo(logits.dtype)
    penalized = [(i, row) for i, row in enumerate(rows) if row.params.penalized]
    if not penalized:  # nothing to do: no pass over the whole [rows, vocab] logits
        return logits
    for i, row in penalized:
        params = row.params
        output = torch.tensor(row.output_token_ids, dtype=torch.int64, device=logits.device)
        counts = torch.bincount(output, minlength=vocab).to(logits.dtype)
        if params.repetition_penalty != 1.0:
            seen = counts > 0
            seen[torch.tensor(row.prompt_token_ids, dtype=torch.int64, device=logits.device)] = True
            # Any positive penalty is valid: keep it and its inverse representable in the logits' dtype.
            rp = min(max(params.repetition_penalty, finfo.tiny), finfo.max)
            penalty = torch.where(logits[i] > 0, 1.0 / rp, rp)
            logits[i] = torch.where(seen, logits[i] * penalty, logits[i])
        logits[i] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    # An extreme penalty can overflow a logit: +inf becomes the largest finite value (a certain token).
    return logits.nan_to_num_(nan=float("-inf"), posinf=finfo.max, neginf=float("-inf"))


def _draw(
    probs: torch.Tensor,
    draft: int | None,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """A token from `probs` (p). With a draft token drawn from q (`draft_probs`; None: proposed
    deterministically, a one-hot q), speculative sampling's rule: accept it with probability
    min(1, p(draft) / q(draft)), else draw from max(p - q, 0) renormalized; either way the token is
    distributed as p."""
    if draft is not None:
        q = draft_probs
        if q is None:
            q = torch.zeros_like(probs)
            q[draft] = 1.0
        if torch.rand((), generator=generator, device=probs.device) * q[draft] < probs[draft]:
            return torch.tensor(draft)
        residual = (probs - q).clamp_(min=0.0)
        probs = residual if residual.sum() > 0 else probs  # p <= q everywhere only by rounding
    return torch.multinomial(probs, 1, generator=generator)[0]


@torch.inference_mode()
def sample_drafts(logits: torch.Tensor, rows: list[SampleRow]) -> tuple[list[int], list[torch.Tensor | None]]:
    """A draft model's next tokens: a greedy row's argmax, any other row's drawn from the model's
    distribution q after the row's temperature and top-k / top-p / min-p (no penalties or bans: the
    target's verify pass applies those), returned with its q for the rejection rule."""
    logits = logits.float()
    chosen = ops.argmax(logits)
    probs: list[torch.Tensor | None] = [None] * len(rows)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random_rows:
        filtered = _filtered_probs(logits[random_rows], [rows[i] for i in random_rows])
        for j, i in enumerate(random_rows):
            chosen[i] = torch.multinomial(filtered[j], 1, generator=rows[i].generator)[0]
            probs[i] = filtered[j]
    return chosen.tolist(), probs


@torch.inference_mode()  # the logits may be the forward's own tensor (bans and penalties: in place)
def sample(logits: torch.Tensor, rows: list[SampleRow]) -> list[Sample]:
    """logits [num_seqs, vocab] (float32; bans and penalties modify it in place) -> one Sample per row."""
    logits = logits.float()
    for i, row in enumerate(rows):  # grammar masks first (vLLM applies them before its sampler)
        if row.guide is not None:
            row.guide.mask(logits[i : i + 1])
    # Log-probabilities only for the rows that asked: a full-vocabulary log-softmax per step is not free.
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    logprobs = logits[wanted].log_softmax(dim=-1) if wanted else None  # raw: before bans and penalties
    for i, row in enumerate(rows):
        if row.banned_token_ids:
            banned = list(row.banned_token_ids)
            allowed = logits[i, banned].clone()
            logits[i, banned] = float("-inf")
            if row.guide is not None and torch.isneginf(logits[i]).all():
                logits[i, banned] = allowed  # the grammar allows only what min_tokens bans: the grammar wins
    apply_penalties(logits, rows)
    chosen = ops.argmax(logits)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random_rows:
        probs = _filtered_probs(logits[random_rows], [rows[i] for i in random_rows])
        for j, i in enumerate(random_rows):
            chosen[i] = _draw(probs[j], rows[i].draft_token_id, rows[i].draft_probs, rows[i].generator)
    samples = [Sample(token_id) for token_id in chosen.tolist()]
    for j, i in enumerate(wanted):
        smp = samples[i]
        smp.logprob = logprobs[j, smp.token_id].item()
        values, ids = logprobs[j].topk(rows[i].params.logprobs)
        smp.top_logprobs = dict(zip(ids.tolist(), values.tolist(), strict=True))
        smp.top_logprobs[smp.token_id] = smp.logprob
    return samples
