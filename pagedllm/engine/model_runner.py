"""Owns the model and its KV cache tensors; turns a scheduled step into one forward pass and logits."""

from __future__ import annotations

import torch

from pagedllm import ops
from pagedllm.engine.scheduler import SchedulerOutput
from pagedllm.models.attention import AttentionMetadata


class ModelRunner:
    """Runs a flattened batch (prefill chunks and decode tokens together) through the paged KV cache.

    The cache is one K and one V tensor per layer, [num_blocks, block_size, num_kv_heads, head_dim];
    the contiguous layout uses the same memory as [num_slots, 1, num_kv_heads, head_dim].
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
        shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.kv_caches = [(self.k_cache[i], self.v_cache[i]) for i in range(cfg.num_layers)]
        host_shape = (cfg.num_layers, num_host_blocks, *shape[2:])
        pin = self.device.type == "cuda"
        self.host_k_cache = torch.zeros(host_shape, dtype=dtype, pin_memory=pin) if num_host_blocks else None
        self.host_v_cache = torch.zeros(host_shape, dtype=dtype, pin_memory=pin) if num_host_blocks else None

    def move_blocks(self, out: SchedulerOutput) -> None:
        """Swap-outs first (their device blocks may be reused this step), then swap-ins, then CoW copies."""
        for layer in range(len(self.kv_caches)):
            k, v = self.kv_caches[layer]
            if out.swap_out:
                ops.swap_blocks(k, v, self.host_k_cache[layer], self.host_v_cache[layer], out.swap_out)
            if out.swap_in:
                ops.swap_blocks(self.host_k_cache[layer], self.host_v_cache[layer], k, v, out.swap_in)
            if out.copies:
                ops.copy_blocks(k, v, out.copies)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, block_tables: list[list[int]]) -> torch.Tensor:
        """Compute every scheduled sequence's new tokens; return float32 logits of each one's last
        computed token (the engine ignores those of a prompt whose prefill is not complete yet)."""
        self.move_blocks(out)
        seqs = out.scheduled
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        context_lens: list[int] = []
        query_start_loc = [0]
        bs = self.block_size
        for seq, table in zip(seqs, block_tables, strict=True):
            start = seq.num_cached_tokens
            end = start + out.num_new_tokens[seq.seq_id]  # a prefill may be one chunk of the prompt
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += [table[t // bs] * bs + t % bs for t in range(start, end)]
            context_lens.append(end)
            query_start_loc.append(query_start_loc[-1] + end - start)
        max_blocks = max(len(t) for t in block_tables)
        padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, device=self.device)

        meta = AttentionMetadata(
            slot_mapping=tensor(slots, torch.int64),
            block_tables=tensor(padded, torch.int32),
            context_lens=tensor(context_lens, torch.int32),
            query_start_loc=tensor(query_start_loc, torch.int32),
            max_query_len=max(out.num_new_tokens.values()),
            kv_caches=self.kv_caches,
        )
        hidden = self.model(tensor(input_ids, torch.int64), tensor(positions, torch.int64), meta)
        last_rows = tensor(query_start_loc[1:], torch.int64) - 1
        return self.model.compute_logits(hidden[last_rows])
