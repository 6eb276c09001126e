"""`triton` backend: GPU kernels for paged attention and the K/V store.

One attention kernel serves decode and prefill. A program owns one tile of BLOCK_Q query rows of one
sequence and one kv head; its M dimension packs (row, head of the GQA group), so K/V tiles are loaded
once for the whole group. Keys are gathered token by token through the block table (any block size,
1 included) in tiles of BLOCK_N, with an online softmax in fp32. Programs find their sequence by binary
search over cumulative tile counts, so the launch needs no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_N = 32  # keys per inner iteration
_PREFILL_BLOCK_Q = 16  # query rows per program when a sequence may have several


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kb,
    stride_ks,
    stride_kh,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Token t's [Hkv, D] K/V (contiguous in the source) to slot slot_mapping[t] of the strided caches."""
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        mask = offs < ROW
        src = token.to(tl.int64) * ROW + offs
        dst = (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_ks
        dst += (offs // HEAD_DIM) * stride_kh + offs % HEAD_DIM
        tl.store(k_cache_ptr + dst, tl.load(key_ptr + src, mask=mask), mask=mask)
        tl.store(v_cache_ptr + dst, tl.load(value_ptr + src, mask=mask), mask=mask)


@triton.jit
def _find_seq(tile_starts_ptr, tile, num_seqs):
    """Index s with tile_starts[s] <= tile < tile_starts[s + 1]."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(tile_starts_ptr + mid + 1) <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    tile_starts_ptr,
    context_lens_ptr,
    scale,
    window,  # 0: no sliding window
    num_seqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_bt,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    WIDEN: tl.constexpr,  # multiply in fp32 (Triton's interpreter mishandles bf16 tl.dot operands)
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    if tile < tl.load(tile_starts_ptr + num_seqs):
        seq = _find_seq(tile_starts_ptr, tile, num_seqs)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        context_len = tl.load(context_lens_ptr + seq)
        first_row = (tile - tl.load(tile_starts_ptr + seq)) * BLOCK_Q

        offs_m = tl.arange(0, BLOCK_Q * GROUP_PAD)
        row = first_row + offs_m // GROUP_PAD
        head = kv_head * GROUP + offs_m % GROUP_PAD
        m_valid = (row < q_len) & (offs_m % GROUP_PAD < GROUP)
        pos = context_len - q_len + row  # absolute position of each query row
        offs_d = tl.arange(0, BLOCK_D)
        d_valid = offs_d < HEAD_DIM
        q_off = (q_start + row)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptr + q_off, mask=m_valid[:, None] & d_valid[None, :], other=0.0)
        if WIDEN:
            q = q.to(tl.float32)

        m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_PAD, BLOCK_D], tl.float32)
        hi = context_len - q_len + tl.minimum(first_row + BLOCK_Q, q_len)
        lo = 0
        if window > 0:
            lo = tl.maximum(0, context_len - q_len + first_row + 1 - window)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_valid = offs_n < hi
            block_ids = tl.load(
                block_tables_ptr + seq * stride_bt + offs_n // BLOCK_SIZE, mask=n_valid, other=0
            )
            kv_off = (
                block_ids.to(tl.int64) * stride_kb + (offs_n % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
            )
            kv_mask = n_valid[:, None] & d_valid[None, :]
            k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            visible = n_valid[None, :] & (offs_n[None, :] <= pos[:, None])
            visible = visible & ((window <= 0) | (offs_n[None, :] > pos[:, None] - window))
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out_off = (q_start + row)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(
            out_ptr + out_off, acc.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & d_valid[None, :]
        )


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new tokens' K/V ([T, Hkv, D]) into cache slots; slot -1 means skip."""
    if key.shape[0] == 0:
        return
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1, "K/V caches must share strides"
    row = key.shape[1] * key.shape[2]
    _write_kv_kernel[(key.shape[0],)](
        key.to(k_cache.dtype).contiguous(),
        value.to(v_cache.dtype).contiguous(),
        k_cache,
        v_cache,
        slot_mapping.to(torch.int64),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=key.shape[2],
        ROW=row,
        BLOCK=triton.next_power_of_2(row),
    )


def _attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    block_q: int,
) -> torch.Tensor:
    """Launch with tiles of block_q rows per sequence (block_q == 1 only when every sequence has one row)."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_seqs = context_lens.shape[0]
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1 and q.stride(2) == 1
    query_start_loc = query_start_loc.to(torch.int32)
    block_tables = block_tables.to(torch.int32)
    tiles = (query_start_loc[1:] - query_start_loc[:-1] + block_q - 1) // block_q
    tile_starts = torch.zeros(num_seqs + 1, dtype=torch.int32, device=q.device)
    torch.cumsum(tiles, 0, out=tile_starts[1:])
    max_tiles = num_seqs if block_q == 1 else triton.cdiv(q.shape[0], block_q) + num_seqs
    # tl.dot needs M >= 16: pad the head group (decode) so that BLOCK_Q * GROUP_PAD >= 16.
    group_pad = max(triton.next_power_of_2(group), 16 // block_q)
    _paged_attention_kernel[(max_tiles, num_kv_heads)](
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        tile_starts,
        context_lens.to(torch.int32),
        scale,
        sliding_window or 0,
        num_seqs,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_Q=block_q,
        GROUP_PAD=group_pad,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=_BLOCK_N,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        WIDEN=triton.knobs.runtime.interpret,
    )
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Query rows of sequence s are the last rows of its context; causal; see reference.py."""
    return _attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        context_lens,
        scale,
        sliding_window,
        _PREFILL_BLOCK_Q,
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One query token per sequence: one program per (sequence, kv head)."""
    one_row_each = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return _attention(q, k_cache, v_cache, block_tables, one_row_each, context_lens, scale, sliding_window, 1)
