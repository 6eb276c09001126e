"""The independent attention oracle: dense SDPA over each sequence's contiguous K/V, with a tril mask."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.ops.synthetic import PagedBatch


def dense_attention(q, k, v, scale: float, window: int | None = None) -> torch.Tensor:
    """q [Q, H, D] = the last Q tokens of k/v [C, Hkv, D]; mask built with tril, unlike the backends."""
    q_len, num_heads, _ = q.shape
    context_len, num_kv_heads, _ = k.shape
    ones = torch.ones(q_len, context_len, dtype=torch.bool)
    mask = ones.tril(context_len - q_len)
    if window is not None:
        mask &= ~ones.tril(context_len - q_len - window)
    group = num_heads // num_kv_heads
    k, v = (x.repeat_interleave(group, dim=1).transpose(0, 1).float() for x in (k, v))
    out = F.scaled_dot_product_attention(q.transpose(0, 1).float(), k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def dense_batch_attention(b: PagedBatch, scale: float, window: int | None = None) -> torch.Tensor:
    """The oracle for every query row of a batch (float32)."""
    starts = b.query_start_loc.tolist()
    return torch.cat(
        [
            dense_attention(b.q[lo:hi], k, v, scale, window)
            for lo, hi, k, v in zip(starts[:-1], starts[1:], b.keys, b.values, strict=True)
        ]
    )
