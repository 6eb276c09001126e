"""`sdpa` backend: pure PyTorch fallback. Per sequence, gather its blocks with index_select and run
scaled_dot_product_attention with the GQA group folded into the query-length dimension."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from pagedllm.ops import reference
from pagedllm.ops.backend import AttentionArgs


def _visible_keys(
    first_pos: int, q_len: int, key_lo: int, context_len: int, sliding_window: int | None, device
) -> torch.Tensor:
    """[q_len, context_len - key_lo] bool: query at first_pos + r sees keys (pos - window, pos]."""
    q_pos = torch.arange(first_pos, first_pos + q_len, device=device)[:, None]
    k_pos = torch.arange(key_lo, context_len, device=device)[None, :]
    visible = k_pos <= q_pos
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    return visible


def paged_attention(q: torch.Tensor, args: AttentionArgs) -> torch.Tensor:
    """Query rows of sequence s are the last rows of its context; causal; see reference.py. SDPA cannot
    soft-cap scores: soft-capped attention goes to the reference."""
    if args.softcap is not None:
        return reference.paged_attention(q, args)
    out = torch.empty_like(q)
    num_heads, head_dim = q.shape[1:]
    block_size, num_kv_heads = args.k_cache.shape[1:3]
    group = num_heads // num_kv_heads
    window = args.sliding_window
    starts = args.query_start_loc.tolist()
    for s, context_len in enumerate(args.context_lens.tolist()):
        q_len = starts[s + 1] - starts[s]
        if q_len == 0:
            continue
        first_pos = context_len - q_len
        key_lo = 0 if window is None else max(0, first_pos + 1 - window)
        first_block, end_block = key_lo // block_size, -(-context_len // block_size)
        ids = args.block_tables[s, first_block:end_block]
        skip = key_lo - first_block * block_size
        k, v = (
            reference.read_blocks(cache, ids, keys)
            .flatten(0, 1)[skip : skip + context_len - key_lo]
            .transpose(0, 1)
            .to(q.dtype)
            for cache, keys in ((args.k_cache, True), (args.v_cache, False))
        )  # a cache stored in another dtype than q (kv_cache_dtype) is widened (or dequantized) here
        # [q_len, Hkv * G, D] -> [Hkv, q_len * G, D]: each kv head attends for its whole group at once.
        rows = q[starts[s] : starts[s + 1]].view(q_len, num_kv_heads, group, head_dim).transpose(0, 1)
        rows = rows.reshape(num_kv_heads, q_len * group, head_dim)
        mask = None
        if q_len > 1:
            mask = _visible_keys(first_pos, q_len, key_lo, context_len, window, q.device)
            mask = mask.repeat_interleave(group, dim=0)
        o = F.scaled_dot_product_attention(rows, k, v, attn_mask=mask, scale=args.scale)
        out[starts[s] : starts[s + 1]] = (
            o.view(num_kv_heads, q_len, group, head_dim).transpose(0, 1).flatten(1, 2)
        )
    return out


# The `sdpa` backend: the reference's ops, attention by scaled_dot_product_attention.
BACKEND = dataclasses.replace(reference.BACKEND, name="sdpa", paged_attention=paged_attention)
