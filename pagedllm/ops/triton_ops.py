"""`triton` backend: GPU kernels for paged attention and the K/V store.

One attention kernel serves decode and prefill. A program owns one tile of BLOCK_Q query rows of one
sequence and one kv head; its M dimension packs (row, head of the GQA group), so K/V tiles are loaded
once for the whole group. Keys are gathered token by token through the block table (any block size,
1 included) in tiles of BLOCK_N, with an online softmax in fp32. Programs find their sequence by binary
search over cumulative tile counts, so the launch needs no host sync.

A quantized cache (int8 or fp8 e4m3 codes, a float32 scale per token and KV head after each block's
codes: kv_cache.py) is passed as its bytes (uint8), its scales' view and the K cache's key smoothing; the
kernels decode codes to float32 themselves, by integer arithmetic, so that they run alike on every GPU and
in the interpreter. Keys are stored smoothed, (k - mean) / factor: the store smooths them, attention
multiplies the query by the factor (the mean shifts every score of a query alike: softmax ignores it).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from pagedllm.ops import reference
from pagedllm.ops.backend import AttentionArgs
from pagedllm.ops.kv_cache import LARGEST_CODE, key_smoothing, kv_scales

_BLOCK_N = 32  # keys per inner iteration
_PREFILL_BLOCK_Q = 16  # query rows per program when a sequence may have several
# The cache's form, the kernels' FORM constexpr: values, or int8 / fp8 e4m3 codes with scales (the kernels
# compare FORM with the literals: a jitted function reads no plain module globals).
_VALUES, _INT8, _FP8 = 0, 1, 2
_FORMS = {torch.int8: _INT8, torch.float8_e4m3fn: _FP8}
_ROUNDING = tl.constexpr(12582912.0)  # 1.5 * 2^23: (x + it) - it rounds |x| < 2^22 to nearest even


@triton.jit
def _decode(codes, FORM: tl.constexpr):
    """uint8 codes as float32 values before their scale: int8 two's complement, or fp8 e4m3 moved into a
    half's bits (s.eeee.mmm -> s.0eeee.mmm0000000, 2^-8 times the value, subnormals included) times 2^8."""
    if FORM == 1:
        values = codes.to(tl.int8, bitcast=True).to(tl.float32)
    else:
        wide = codes.to(tl.uint16)
        half = ((wide & 0x80) << 8) | ((wide & 0x7F) << 7)
        values = half.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return values


@triton.jit
def _encode(x, FORM: tl.constexpr):
    """float32 x (|x| <= the largest code) as uint8 codes, rounded to nearest even as torch rounds: int8,
    or fp8 e4m3 (subnormals below 2^-6 in steps of 2^-9; above, the float's bits rounded to 3 mantissa
    bits and the exponent rebiased from 127 to 7)."""
    if FORM == 1:
        codes = ((x + _ROUNDING) - _ROUNDING).to(tl.int32).to(tl.uint8)
    else:
        magnitude = tl.abs(x)
        bits = magnitude.to(tl.int32, bitcast=True)
        subnormal = ((magnitude * 512.0 + _ROUNDING) - _ROUNDING).to(tl.int32)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)
        code = tl.minimum(tl.where(magnitude < 0.015625, subnormal, normal), 0x7E)
        sign = tl.where(x.to(tl.int32, bitcast=True) < 0, 0x80, 0)
        codes = (code | sign).to(tl.uint8)
    return codes


@triton.jit
def _store_row(
    src_ptr,
    cache_ptr,
    scale_ptr,
    mean_ptr,
    factor_ptr,
    src,
    dst,
    scale_dst,
    smoothing,
    head_valid,
    mask,
    largest,
    FORM: tl.constexpr,
    SMOOTH: tl.constexpr,
):
    """One token's [Hkv, D] values (src offsets) into the cache (dst offsets); into a quantized cache as
    codes, each head's row quantized as reference.quantize does, its scale to scale_dst; with SMOOTH (keys),
    each row (x - mean) / factor first (smoothing: the [Hkv, D] offsets of both)."""
    x = tl.load(src_ptr + src, mask=mask, other=0.0)
    if FORM == 0:
        tl.store(cache_ptr + dst, x, mask=mask)
    else:
        x = x.to(tl.float32)
        if SMOOTH:
            mean = tl.load(mean_ptr + smoothing, mask=mask, other=0.0)
            x = (x - mean) / tl.load(factor_ptr + smoothing, mask=mask, other=1.0)
        # A row with a NaN or an infinity gets a NaN scale and codes 0 (no NaN is made here: the
        # interpreter's numpy would warn).
        finite = tl.min(tl.where(tl.abs(x) < float("inf"), 1, 0), 1) > 0
        scale = tl.where(finite, tl.max(tl.abs(x), 1) / largest, float("nan"))
        positive = scale > 0
        scaled = tl.where(positive[:, None], x / tl.where(positive, scale, 1.0)[:, None], 0.0)
        tl.store(cache_ptr + dst, _encode(scaled, FORM), mask=mask)
        tl.store(scale_ptr + scale_dst, scale, mask=head_valid)


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    k_mean_ptr,
    k_factor_ptr,
    slot_ptr,
    largest,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_sb,
    stride_ss,
    stride_sh,
    BLOCK_SIZE: tl.constexpr,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FORM: tl.constexpr,
):
    """Token t's [Hkv, D] K/V (contiguous in the source) to slot slot_mapping[t] of the strided caches;
    into a quantized cache as codes (keys smoothed first), each head's scale to the scales' strided view."""
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)[None, :]
        head_valid = heads < HEADS
        mask = head_valid[:, None] & (dims < HEAD_DIM)
        src = token.to(tl.int64) * (HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims
        block, row = slot // BLOCK_SIZE, slot % BLOCK_SIZE
        dst = block * stride_kb + row * stride_ks + heads[:, None] * stride_kh + dims
        scale_dst = block * stride_sb + row * stride_ss + heads * stride_sh
        smoothing = heads[:, None] * HEAD_DIM + dims
        _store_row(
            key_ptr, k_cache_ptr, k_scale_ptr, k_mean_ptr, k_factor_ptr, src, dst, scale_dst, smoothing,
            head_valid, mask, largest, FORM, True,
        )  # fmt: skip
        _store_row(
            value_ptr, v_cache_ptr, v_scale_ptr, k_mean_ptr, k_factor_ptr, src, dst, scale_dst, smoothing,
            head_valid, mask, largest, FORM, False,
        )  # fmt: skip


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
    k_scale_ptr,
    v_scale_ptr,
    k_mean_ptr,
    k_factor_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    tile_starts_ptr,
    context_lens_ptr,
    scale,
    window,  # 0: no sliding window
    softcap,  # scores capped at +-softcap (Gemma 2); 0: not capped
    num_seqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_sb,
    stride_ss,
    stride_sh,
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
    FORM: tl.constexpr,  # the cache's: values, int8 or fp8 e4m3 codes (then scaled as they are loaded)
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
        # The keys' mean's share of each row's scores, which the smoothed keys leave out (the same for
        # every key: the softmax ignores it, a soft cap does not).
        shift = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
        if FORM != 0:  # the keys are stored divided by their kv head's smoothing factor
            mean = tl.load(k_mean_ptr + kv_head * HEAD_DIM + offs_d, mask=d_valid, other=0.0)
            shift = tl.sum(q.to(tl.float32) * mean[None, :], 1) * scale
            factor = tl.load(k_factor_ptr + kv_head * HEAD_DIM + offs_d, mask=d_valid, other=0.0)
            q = (q.to(tl.float32) * factor[None, :]).to(q.dtype)
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
            scale_off = (
                block_ids.to(tl.int64) * stride_sb + (offs_n % BLOCK_SIZE) * stride_ss + kv_head * stride_sh
            )
            k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0)
            if FORM != 0:
                k = _decode(k, FORM) * tl.load(k_scale_ptr + scale_off, mask=n_valid, other=0.0)[:, None]
            k = k.to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            if softcap > 0:  # softcap * tanh(s / softcap), as cap - 2 cap / (exp(2 s / cap) + 1)
                s = softcap - 2.0 * softcap / (tl.exp((s + shift[:, None]) * (2.0 / softcap)) + 1.0)
            visible = n_valid[None, :] & (offs_n[None, :] <= pos[:, None])
            visible = visible & ((window <= 0) | (offs_n[None, :] > pos[:, None] - window))
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0)
            if FORM != 0:
                v = _decode(v, FORM) * tl.load(v_scale_ptr + scale_off, mask=n_valid, other=0.0)[:, None]
            v = v.to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out_off = (q_start + row)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(
            out_ptr + out_off, acc.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & d_valid[None, :]
        )


def _cache_operands(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[tuple, tuple, tuple, int]:
    """What a kernel takes of the caches: (k data, v data, k scales, v scales), the K cache's smoothing
    (mean, factor), the scales' strides and the FORM. A quantized cache goes as its bytes, its scales' views
    and its smoothing; a cache of values as itself, the rest then stand-ins that are never read."""
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1, "K/V caches must share strides"
    form = _FORMS.get(k_cache.dtype, _VALUES)
    if form == _VALUES:
        return (k_cache, v_cache, k_cache, v_cache), (k_cache, k_cache), (0, 0, 0), form
    k_scales, v_scales = kv_scales(k_cache), kv_scales(v_cache)
    data = (k_cache.view(torch.uint8), v_cache.view(torch.uint8), k_scales, v_scales)
    return data, key_smoothing(k_cache), k_scales.stride(), form


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new tokens' K/V ([T, Hkv, D]) into cache slots (quantized for a quantized cache); slot -1
    means skip."""
    if key.shape[0] == 0:
        return
    caches, smoothing, scale_strides, form = _cache_operands(k_cache, v_cache)
    source = k_cache.dtype if form == _VALUES else torch.float32  # quantized from float32, as the reference
    num_kv_heads, head_dim = key.shape[1:]
    _write_kv_kernel[(key.shape[0],)](
        key.to(source).contiguous(),
        value.to(source).contiguous(),
        *caches,
        *smoothing,
        slot_mapping.to(torch.int64),
        LARGEST_CODE.get(k_cache.dtype, 0.0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        *scale_strides,
        BLOCK_SIZE=k_cache.shape[1],
        HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        FORM=form,
    )


def paged_attention(q: torch.Tensor, args: AttentionArgs) -> torch.Tensor:
    """Query rows of sequence s are the last rows of its context; causal; see reference.py. A decode step
    launches one program per (sequence, kv head), any other tiles of _PREFILL_BLOCK_Q rows."""
    block_q = 1 if args.decode else _PREFILL_BLOCK_Q
    k_cache, v_cache, context_lens = args.k_cache, args.v_cache, args.context_lens
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_seqs = context_lens.shape[0]
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    assert q.stride(2) == 1
    caches, smoothing, scale_strides, form = _cache_operands(k_cache, v_cache)
    query_start_loc = args.query_start_loc.to(torch.int32)
    block_tables = args.block_tables.to(torch.int32)
    tiles = (query_start_loc[1:] - query_start_loc[:-1] + block_q - 1) // block_q
    tile_starts = torch.zeros(num_seqs + 1, dtype=torch.int32, device=q.device)
    torch.cumsum(tiles, 0, out=tile_starts[1:])
    max_tiles = num_seqs if block_q == 1 else triton.cdiv(q.shape[0], block_q) + num_seqs
    # tl.dot needs M >= 16: pad the head group (decode) so that BLOCK_Q * GROUP_PAD >= 16.
    group_pad = max(triton.next_power_of_2(group), 16 // block_q)
    _paged_attention_kernel[(max_tiles, num_kv_heads)](
        out,
        q,
        *caches,
        *smoothing,
        block_tables,
        query_start_loc,
        tile_starts,
        context_lens.to(torch.int32),
        args.scale,
        args.sliding_window or 0,
        args.softcap or 0.0,
        num_seqs,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        *scale_strides,
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
        FORM=form,
    )
    return out


# The `triton` backend: the kernels above for the K/V store and attention, the reference's other ops.
BACKEND = dataclasses.replace(
    reference.BACKEND, name="triton", write_kv=write_kv, paged_attention=paged_attention
)
