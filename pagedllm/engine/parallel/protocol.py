"""What rank 0 broadcasts each step: a fixed header, then every StepInputs array in one int64 payload."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import torch

from pagedllm.engine.model_runner import StepInputs
from pagedllm.lora_request import LoRARequest
from pagedllm.models.parallel import CommStats, TensorParallel

# run a step; exit; gather each rank's CommStats on rank 0; calibrate the key smoothing on the ids that
# follow; a LoRA adapter's name, id and folder follow (as JSON, num_tokens bytes)
STEP, STOP, STATS, CALIBRATE, LORA = 1, 2, 3, 4, 5
# op, num_tokens, num_seqs, max_blocks, max_query_len, swap-outs, swap-ins, copies, groups, computes_prompt,
# the step's LoRA adapters
HEADER_LEN = 11


def _sizes(header: list[int]) -> dict[str, int]:
    """The payload's arrays, in order, and the length of each."""
    _, t, s, b, _, swap_out, swap_in, copies, g, _, loras = header
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
        "lora_ids": loras,
        "token_loras": t if loras else 0,
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
    header += [int(step.computes_prompt), len(step.lora_ids)]
    arrays = [_flat(getattr(step, name)) for name in _sizes(header)]
    return torch.tensor(header, dtype=torch.int64), torch.from_numpy(np.concatenate(arrays))


def _flat(array) -> np.ndarray:
    """A StepInputs array (or list; None: the step has none) as one int64 row."""
    return np.zeros(0, np.int64) if array is None else np.asarray(array, dtype=np.int64).reshape(-1)


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
        lora_ids=arrays["lora_ids"].tolist(),
        token_loras=arrays["token_loras"] if header[10] else None,
    )


def lora_message(request: LoRARequest) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) naming an adapter to the workers (LORA)."""
    data = json.dumps(dataclasses.asdict(request)).encode()
    return op_header(LORA, len(data)), torch.frombuffer(bytearray(data), dtype=torch.uint8)


def read_lora(payload: torch.Tensor) -> LoRARequest:
    return LoRARequest(**json.loads(payload.numpy().tobytes()))
