"""Prompt log-probabilities (SamplingParams.prompt_logprobs), taken from the prefill the engine runs anyway.

The logits at position p give the log-probability of token p + 1. For a sequence that asks, the step that
computes a stretch of its prompt also computes the logits at those positions (every other sequence has
only its last position's, the one its next token is sampled from), so a prompt prefilled in chunks is
scored chunk by chunk and nothing is run twice. The positions a sequence needs are always the last rows of
its span in the step's flattened batch: the model runner computes logits for each sequence's last
`num_logits` rows.

Prefix caching: the cache holds K/V, not logits, so a prompt served from it would have no log-probabilities
at its cached positions. As vLLM does, a sequence still missing some skips the cache lookup when it is
admitted (its whole prompt is computed); its blocks are still cached for other prompts, whose hits cost
nothing more.
"""

from __future__ import annotations

import torch

from pagedllm.engine.sequence import Sequence

ROWS_PER_SOFTMAX = 256  # log-softmax this many positions at a time: a full-vocabulary copy of each


def wanted_positions(seq: Sequence, start: int, end: int) -> range:
    """The positions in [start, end), computed this step, whose logits give a prompt token's
    log-probability that the sequence does not have yet (none if it did not ask)."""
    if seq.prompt_logprobs is None:
        return range(0)
    lo = max(start, len(seq.prompt_logprobs))
    return range(lo, max(lo, min(end, len(seq.prompt_token_ids) - 1)))


def num_logits(seq: Sequence, start: int, end: int) -> int:
    """How many of the last rows of the sequence's span [start, end) get logits: the wanted positions and
    the last one (which a wanted one may be), else the last one alone."""
    wanted = wanted_positions(seq, start, end)
    return end - wanted.start if wanted else 1


@torch.inference_mode()
def gather(seq: Sequence, wanted: range, logits: torch.Tensor) -> None:
    """Append to seq.prompt_logprobs the entries for the tokens after the `wanted` positions, whose logits
    are the first rows of `logits`: each token's log-probability and the prompt_logprobs most likely."""
    k = seq.params.prompt_logprobs
    targets = torch.tensor(seq.prompt_token_ids[wanted.start + 1 : wanted.stop + 1], device=logits.device)
    for first in range(0, len(wanted), ROWS_PER_SOFTMAX):
        rows = logits[first : min(first + ROWS_PER_SOFTMAX, len(wanted))].float().log_softmax(dim=-1)
        chosen = targets[first : first + len(rows)]
        values = rows.gather(1, chosen[:, None])[:, 0].tolist()
        top_values, top_ids = rows.topk(k) if k else (rows[:, :0], rows[:, :0].long())
        for token, logprob, ids, tops in zip(
            chosen.tolist(), values, top_ids.tolist(), top_values.tolist(), strict=True
        ):
            entry = dict(zip(ids, tops, strict=True))
            entry[token] = logprob
            seq.prompt_logprobs.append(entry)
