"""The per-forward attention inputs, and the attention layer every model family shares."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedllm import ops


@dataclass
class AttentionMetadata:
    """Where each token of a flattened batch reads and writes its K/V (built by the model runner).

    Tokens of sequence s occupy rows query_start_loc[s]:query_start_loc[s+1] of the batch; they are the
    last tokens of its context of context_lens[s] tokens (cached prefix + this step's tokens). Each KV
    group (kv/groups.py) has its own slots and block tables; a layer reads its group's.
    """

    slot_mapping: torch.Tensor  # [num_groups, num_tokens] int64, cache slot of each new token (-1: skip)
    block_tables: torch.Tensor  # [num_groups, num_seqs, max_blocks] int32
    context_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    max_query_len: int  # 1 means every sequence decodes one token (Triton then launches per sequence)
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k_cache, v_cache)
    layer_groups: Sequence[int] | None = None  # per layer its KV group (None: one group)

    def __post_init__(self) -> None:
        # each group's views, made once a step rather than by every layer (a decode step's layers each
        # paid two tensor indexings for them)
        groups = range(self.slot_mapping.shape[0])
        self._groups = [(self.slot_mapping[g], self.block_tables[g]) for g in groups]

    def group_of(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot mapping [T] and block tables [S, B] of the layer's KV group."""
        return self._groups[0 if self.layer_groups is None else self.layer_groups[layer_idx]]


class PagedAttention(torch.nn.Module):
    """Stores this step's K/V into the paged cache, then attends through the block tables."""

    def __init__(
        self,
        layer_idx: int,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ):
        super().__init__()
        self.layer_idx = layer_idx
        self.scale = scale
        self.sliding_window = sliding_window
        self.softcap = softcap  # scores capped at +-softcap (Gemma 2); None: not capped

    def paged_args(self, meta: AttentionMetadata) -> tuple[torch.Tensor, ops.AttentionArgs]:
        """This step's slot mapping for the layer's new K/V, and its attention's arguments."""
        k_cache, v_cache = meta.kv_caches[self.layer_idx]
        slot_mapping, block_tables = meta.group_of(self.layer_idx)
        args = ops.AttentionArgs(
            k_cache, v_cache, block_tables, meta.context_lens, self.scale,
            query_start_loc=meta.query_start_loc, max_query_len=meta.max_query_len,
            sliding_window=self.sliding_window, softcap=self.softcap,
        )  # fmt: skip
        return slot_mapping, args

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> [T, H, D]."""
        slot_mapping, args = self.paged_args(meta)
        ops.write_kv(k, v, args.k_cache, args.v_cache, slot_mapping)
        return ops.paged_attention(q, args)
