"""What rank 0 broadcasts each step: a fixed header, then every StepInputs array in one int64 payload."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.engine.model_runner import StepInputs
from pagedllm.models.parallel import CommStats, TensorParallel

# run a step; exit; gather each rank's CommStats on rank 0; calibrate the key smoothing on the ids that follow
STEP, STOP, STATS, CALIBRATE = 1, 2, 3, 4
# op, num_tokens, num_seqs, max_blocks, max_query_len, swap-outs, swap-ins, copies, groups, computes_prompt
HEADER_LEN = 10


def _sizes(header: list[int]) -> dict[str, int]:
    """The payload's arrays, in order, and the length of each."""
    _, t, s, b, _, swap_out, swap_in, copies, g, _ = header
    return {
        "input_ids": t,
        "positions": t,
        "slot_mapping": g * t,
        "block_tables": g * s * b,
        "context_lens": s,
        "query_start_loc": s + 1,
        "num_logits": s,
        "swap_out": 2 * swap_out,
        "swap_in": 2 * swap_in,
        "copies": 2 * copies,
    }


def op_header(op: int, num_tokens: int = 0) -> torch.Tensor:
    """The header of a message without a step's payload (STOP, STATS; CALIBRATE: num_tokens ids follow)."""
    return torch.tensor([op, num_tokens] + [0] * (HEADER_LEN - 2), dtype=torch.int64)


def gather_stats(tp: TensorParallel) -> list[CommStats] | None:
    """Every rank calls this on STATS: rank 0 gets each rank's time in collectives so far, by rank."""
    mine = torch.tensor([[tp.comm.seconds, tp.comm.calls]], dtype=torch.float64)
    rows = tp.gather(mine, 2 * tp.size, counted=False, cpu=True)
    return None if rows is None else [CommStats(s, int(c)) for s, c in rows.view(tp.size, 2).tolist()]


def pack(step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) int64 tensors holding the whole step."""
    num_groups, num_seqs, max_blocks = step.block_tables.shape
    moves = (len(step.swap_out), len(step.swap_in), len(step.copies))
    header = [STEP, len(step.input_ids), num_seqs, max_blocks, step.max_query_len, *moves, num_groups]
    header.append(int(step.computes_prompt))
    arrays = [getattr(step, name).reshape(-1).astype(np.int64) for name in _sizes(header)]
    return torch.tensor(header, dtype=torch.int64), torch.from_numpy(np.concatenate(arrays))


def payload_len(header: torch.Tensor) -> int:
    return sum(_sizes(header.tolist()).values())


def unpack(header: torch.Tensor, payload: torch.Tensor) -> StepInputs:
    """The StepInputs `pack` was given."""
    header = header.tolist()
    t, s, b, max_query_len = header[1:5]
    g = header[8]
    flat, arrays, offset = payload.numpy(), {}, 0
    for name, n in _sizes(header).items():
        arrays[name] = flat[offset : offset + n]
        offset += n
    return StepInputs(
        input_ids=arrays["input_ids"],
        positions=arrays["positions"],
        slot_mapping=arrays["slot_mapping"].reshape(g, t),
        block_tables=arrays["block_tables"].reshape(g, s, b).astype(np.int32),
        context_lens=arrays["context_lens"].astype(np.int32),
        query_start_loc=arrays["query_start_loc"].astype(np.int32),
        max_query_len=max_query_len,
        num_logits=arrays["num_logits"].astype(np.int32),
        swap_out=arrays["swap_out"].reshape(-1, 2),
        swap_in=arrays["swap_in"].reshape(-1, 2),
        copies=arrays["copies"].reshape(-1, 2),
        computes_prompt=bool(header[9]),
    )
