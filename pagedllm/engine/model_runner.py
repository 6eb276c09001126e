"""Owns the model and its KV cache tensors; turns a scheduled step into one forward pass and logits."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from pagedllm import ops
from pagedllm.engine.scheduler import SchedulerOutput
from pagedllm.engine.sequence import Sequence
from pagedllm.models.attention import AttentionMetadata


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
    ):
        self.model = model
        self.device = torch.device(device)
        self.block_size = block_size
        cfg = model.config
        geometry = (block_size, cfg.num_kv_heads, cfg.head_dim, dtype)
        self.kv_caches = ops.allocate_kv_caches(cfg.num_layers, num_blocks, *geometry, self.device)
        self.host_kv_caches = (
            ops.allocate_kv_caches(
                cfg.num_layers, num_host_blocks, *geometry, "cpu", self.device.type == "cuda"
            )
            if num_host_blocks
            else []
        )

    def move_blocks(self, out: SchedulerOutput) -> None:
        """Swap-outs first (their device blocks may be reused this step), then swap-ins, then CoW copies."""
        for layer, (k, v) in enumerate(self.kv_caches):
            if out.swap_out:
                ops.swap_blocks(k, v, *self.host_kv_caches[layer], out.swap_out)
            if out.swap_in:
                ops.swap_blocks(*self.host_kv_caches[layer], k, v, out.swap_in)
            if out.copies:
                ops.copy_blocks(k, v, out.copies)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, block_tables: list[list[int]]) -> torch.Tensor:
        """Compute every scheduled sequence's new tokens; return float32 logits of each one's last
        computed token (the engine ignores those of a prompt whose prefill is not complete yet)."""
        self.move_blocks(out)
        num_new_tokens = [out.num_new_tokens[seq.seq_id] for seq in out.scheduled]
        input_ids, positions, meta, last_rows = self.prepare_inputs(
            out.scheduled, block_tables, num_new_tokens
        )
        hidden = self.model(input_ids, positions, meta)
        return self.model.compute_logits(hidden[last_rows])

    def prepare_inputs(
        self, seqs: list[Sequence], block_tables: list[list[int]], num_new_tokens: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """The flattened batch: token ids, positions, attention metadata, and each sequence's last row.

        Sequence s computes num_new_tokens[s] tokens from its num_cached_tokens on (all the rest, or one
        chunk of a long prompt); index arithmetic runs in numpy, one array operation per batch rather
        than one Python operation per token.
        """
        starts = np.fromiter((seq.num_cached_tokens for seq in seqs), np.int64, len(seqs))
        counts = np.asarray(num_new_tokens, np.int64)
        ends = starts + counts
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
                    seq.token_ids[start:end] for seq, start, end in zip(seqs, starts, ends, strict=True)
                ),
                np.int64,
                num_tokens,
            )
            owner = np.repeat(np.arange(len(seqs)), counts)  # which sequence each token belongs to
            positions = np.arange(num_tokens) - np.repeat(query_start_loc[:-1], counts) + starts[owner]
        bs = self.block_size
        slots = tables[owner, positions // bs].astype(np.int64) * bs + positions % bs
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            block_tables=self._tensor(tables),
            context_lens=self._tensor(ends.astype(np.int32)),
            query_start_loc=self._tensor(query_start_loc),
            max_query_len=int(counts.max()),
            kv_caches=self.kv_caches,
        )
        last_rows = self._tensor(query_start_loc[1:].astype(np.int64) - 1)
        return self._tensor(input_ids), self._tensor(positions), meta, last_rows

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)
