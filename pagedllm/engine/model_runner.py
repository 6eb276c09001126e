"""Owns the model and its KV cache tensors; turns a scheduled step into one forward pass and logits."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm import ops
from pagedllm.engine.scheduler import SchedulerOutput
from pagedllm.models.attention import AttentionMetadata


@dataclass
class StepInputs:
    """One step's work as plain arrays: the flattened batch's indices and the KV block moves before it.

    Built once by the engine's rank; under tensor parallelism every rank runs its shard on the same copy.
    """

    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    block_tables: np.ndarray  # [num_seqs, max_blocks] int32
    context_lens: np.ndarray  # [num_seqs] int32
    query_start_loc: np.ndarray  # [num_seqs + 1] int32
    max_query_len: int
    num_logits: np.ndarray  # [num_seqs] int32: logits rows wanted, of each sequence's last tokens
    swap_out: np.ndarray  # [n, 2] int64 (device block, host block)
    swap_in: np.ndarray  # [n, 2] int64 (host block, device block)
    copies: np.ndarray  # [n, 2] int64 copy-on-write (src, dst)


def _pairs(pairs: list[tuple[int, int]]) -> np.ndarray:
    return np.array(pairs, np.int64).reshape(-1, 2)


def logits_rows(query_start_loc: np.ndarray, num_logits: np.ndarray) -> np.ndarray:
    """The batch rows whose logits are wanted: the last num_logits[s] rows of each sequence s."""
    counts = num_logits.astype(np.int64)
    firsts = query_start_loc[1:].astype(np.int64) - counts
    starts = np.cumsum(counts) - counts
    return np.repeat(firsts - starts, counts) + np.arange(int(counts.sum()))


class ModelRunner:
    """Runs a flattened batch (prefill chunks and decode tokens together) through the paged KV cache.

    The cache is one K and one V view per layer, [num_blocks, block_size, num_kv_heads, head_dim]
    (ops.allocate_kv_caches picks the memory order for the device); the contiguous layout uses the same
    memory as [num_slots, 1, num_kv_heads, head_dim]. A host pool of the same shape holds swapped blocks.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        num_host_blocks: int = 0,
        prefault_kv_cache: bool = True,
    ):
        self.model = model
        self.device = torch.device(device)
        self.num_blocks, self.block_size, self.num_host_blocks = num_blocks, block_size, num_host_blocks
        self.kv_dtype, self.prefault_kv_cache = dtype, prefault_kv_cache
        cfg = model.config
        geometry = (block_size, model.num_kv_heads, cfg.head_dim, dtype)  # this rank's KV heads
        self.kv_caches = ops.allocate_kv_caches(
            cfg.num_layers, num_blocks, *geometry, self.device, touch=prefault_kv_cache
        )
        self.host_kv_caches = (
            ops.allocate_kv_caches(
                cfg.num_layers, num_host_blocks, *geometry, "cpu", self.device.type == "cuda"
            )
            if num_host_blocks
            else []
        )

    def move_blocks(self, step: StepInputs) -> None:
        """Swap-outs first (their device blocks may be reused this step), then copies (forks and copy on
        write, decided after the previous step: a source block freed since, by an abort, may be a swap-in's
        destination), then swap-ins."""
        swap_out, swap_in, copies = (pairs.tolist() for pairs in (step.swap_out, step.swap_in, step.copies))
        for layer, (k, v) in enumerate(self.kv_caches):
            if swap_out:
                ops.swap_blocks(k, v, *self.host_kv_caches[layer], swap_out)
            if copies:
                ops.copy_blocks(k, v, copies)
            if swap_in:
                ops.swap_blocks(*self.host_kv_caches[layer], k, v, swap_in)

    @torch.inference_mode()
    def execute_step(self, step: StepInputs) -> torch.Tensor | None:
        """Move blocks, run the forward pass; float32 logits of each sequence's last computed token, or of
        its last 1 + k with k draft tokens (None on a tensor-parallel rank other than 0)."""
        self.move_blocks(step)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(step.slot_mapping),
            block_tables=self._tensor(step.block_tables),
            context_lens=self._tensor(step.context_lens),
            query_start_loc=self._tensor(step.query_start_loc),
            max_query_len=step.max_query_len,
            kv_caches=self.kv_caches,
        )
        hidden = self.model(self._tensor(step.input_ids), self._tensor(step.positions), meta)
        if step.max_query_len > 1:  # some sequence computed several rows: keep each one's last
            hidden = hidden[self._tensor(logits_rows(step.query_start_loc, step.num_logits))]
        return self.model.compute_logits(hidden)

    def prepare_inputs(self, out: SchedulerOutput, block_tables: list[list[int]]) -> StepInputs:
        """The step's arrays for the scheduled sequences, whose KV blocks are given by `block_tables`.

        Sequence s computes its last out.num_new_tokens[s] tokens up to its num_cached_tokens (which the
        scheduler already counts them in): the rest of its tokens, or one chunk of a long prompt, or its
        newest token and its draft tokens. Index arithmetic runs in numpy, one array operation per batch
        rather than one Python operation per token.
        """
        seqs = out.scheduled
        ends = np.fromiter((seq.num_cached_tokens for seq in seqs), np.int64, len(seqs))
        counts = np.fromiter((out.num_new_tokens[seq.seq_id] for seq in seqs), np.int64, len(seqs))
        starts = ends - counts
        query_start_loc = np.zeros(len(seqs) + 1, np.int32)
        np.cumsum(counts, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        tables = np.zeros((len(seqs), max(len(t) for t in block_tables)), np.int32)
        for row, table in zip(tables, block_tables, strict=True):
            row[: len(table)] = table
        if num_tokens == len(seqs) and all(
            seq.num_tokens == end for seq, end in zip(seqs, ends, strict=True)
        ):
            # decode: one token per sequence, its last
            input_ids = np.fromiter((seq.token_ids[-1] for seq in seqs), np.int64, len(seqs))
            positions, owner = starts, np.arange(len(seqs))
        else:
            input_ids = np.fromiter(
                itertools.chain.from_iterable(
                    seq.token_ids[start:end] + seq.draft_token_ids
                    for seq, start, end in zip(seqs, starts, ends, strict=True)
                ),
                np.int64,
                num_tokens,
            )
            owner = np.repeat(np.arange(len(seqs)), counts)  # which sequence each token belongs to
            positions = np.arange(num_tokens) - np.repeat(query_start_loc[:-1], counts) + starts[owner]
        bs = self.block_size
        slots = tables[owner, positions // bs].astype(np.int64) * bs + positions % bs
        return StepInputs(
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slots,
            block_tables=tables,
            context_lens=ends.astype(np.int32),
            query_start_loc=query_start_loc,
            max_query_len=int(counts.max()),
            num_logits=np.fromiter((1 + len(seq.draft_token_ids) for seq in seqs), np.int32, len(seqs)),
            swap_out=_pairs(out.swap_out),
            swap_in=_pairs(out.swap_in),
            copies=_pairs(out.copies),
        )

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)
