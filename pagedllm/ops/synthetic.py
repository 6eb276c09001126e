"""Random paged-attention inputs with the same data also kept contiguous: for tests and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.ops.backend import AttentionArgs
from pagedllm.ops.kv_cache import allocate_kv_caches, is_quantized, key_smoothing, kv_scales
from pagedllm.ops.reference import fit_key_smoothing, quantize, smooth_keys


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, H, D], rows of sequence s at query_start_loc[s]:[s+1]
    # [num_blocks, block_size, Hkv, D]; slots no sequence owns hold NaN (a quantized cache: a NaN scale)
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [S, max_blocks] int32, physical blocks (shuffled or not), padded with 0
    query_start_loc: torch.Tensor  # [S + 1] int32
    context_lens: torch.Tensor  # [S] int32
    # per sequence [context_len, Hkv, D]: the same K, contiguous (of a quantized cache: before quantizing)
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    def args(
        self,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        decode: bool = False,
        **replaced: torch.Tensor,
    ) -> AttentionArgs:
        """The batch's attention arguments (`decode`: one query row per sequence, its last token);
        `replaced` swaps any of its tensors (k_cache=..., block_tables=...)."""
        tensors = dict(
            k_cache=self.k_cache,
            v_cache=self.v_cache,
            block_tables=self.block_tables,
            context_lens=self.context_lens,
            query_start_loc=None if decode else self.query_start_loc,
        )
        return AttentionArgs(**{**tensors, **replaced}, scale=scale, sliding_window=window, softcap=softcap)


def _quantized_copy(
    cache: torch.Tensor, dtype: torch.dtype, head_major: bool, device, smoothing: tuple | None = None
) -> torch.Tensor:
    """A cache of `dtype` codes on `device` (allocated as pagedllm allocates one, in the given memory
    order) holding `cache`'s values quantized, row by row, after the key smoothing (mean, factor) if given
    (a K cache); NaN rows get NaN scales."""
    ((codes, _),) = allocate_kv_caches(1, *cache.shape, dtype, device, head_major=head_major)
    rows = cache.to(codes.device)
    if smoothing is not None:
        for held, given in zip(key_smoothing(codes), smoothing, strict=True):
            held.copy_(given)
        rows = smooth_keys(rows, codes)
    values, scales = quantize(rows, dtype)
    codes.copy_(values)
    kv_scales(codes).copy_(scales)
    return codes


def random_paged_batch(
    context_lens: list[int],
    query_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
    head_major: bool = False,
    scattered: bool = True,
    kv_dtype: torch.dtype | None = None,
) -> PagedBatch:
    """Sequences whose blocks are scattered at random over a cache with spare (NaN-filled) blocks.

    scattered=False lays each sequence's blocks out consecutively, in order (sequence after sequence):
    the same q, K and V values as scattered=True with the same seed, stored as contiguous K/V.
    head_major=True stores the caches' memory head-major, as pagedllm allocates them on the CPU
    (ops/kv_cache.py, on huge pages there too): the same [num_blocks, block_size, Hkv, D] views and
    values, other strides.
    kv_dtype: a quantized dtype (int8, float8_e4m3fn) stores the caches as its codes and scales, the
    values above quantized (in the memory order head_major says, on any device), the keys through the
    key smoothing fitted to them (as the engine fits it to a forward pass's keys).
    """
    if len(context_lens) != len(query_lens) or any(
        q > c for q, c in zip(query_lens, context_lens, strict=True)
    ):
        raise ValueError(
            f"need one query length <= context length per sequence, got {query_lens} / {context_lens}"
        )
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    physical = torch.randperm(num_blocks, generator=gen).tolist()  # drawn either way: the same values
    if not scattered:
        physical = list(range(num_blocks - 1, -1, -1))  # popped from the end: 0, 1, 2, ...
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    block_tables = torch.zeros(len(context_lens), max(blocks_per_seq, default=1), dtype=torch.int32)
    keys, values = [], []
    for s, (context_len, n) in enumerate(zip(context_lens, blocks_per_seq, strict=True)):
        ids = [physical.pop() for _ in range(n)]
        block_tables[s, :n] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(context_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(context_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        for j, block in enumerate(ids):
            chunk = slice(j * block_size, min((j + 1) * block_size, context_len))
            k_cache[block, : chunk.stop - chunk.start] = k[chunk]
            v_cache[block, : chunk.stop - chunk.start] = v[chunk]
        keys.append(k.to(device))
        values.append(v.to(device))
    if kv_dtype is not None and is_quantized(kv_dtype):
        smoothing = fit_key_smoothing(torch.cat(keys).cpu())
        k_cache = _quantized_copy(k_cache, kv_dtype, head_major, device, smoothing)
        v_cache = _quantized_copy(v_cache, kv_dtype, head_major, device)
    elif head_major and torch.device(device).type == "cpu":  # the engine's own memory: huge pages too
        ((k_cache, v_cache),) = [
            (k.copy_(k_cache), v.copy_(v_cache))
            for k, v in allocate_kv_caches(1, num_blocks, block_size, num_kv_heads, head_dim, dtype, "cpu")
        ]
    elif head_major:
        k_cache, v_cache = (c.transpose(1, 2).contiguous().transpose(1, 2) for c in (k_cache, v_cache))
    starts = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(int(starts[-1]), num_heads, head_dim, generator=gen).to(dtype)
    return PagedBatch(
        q=q.to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        block_tables=block_tables.to(device),
        query_start_loc=starts.to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        keys=keys,
        values=values,
    )
