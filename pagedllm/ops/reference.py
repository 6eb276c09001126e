"""Torch reference for paged attention (gather through the block table, softmax in float32) and for the
fused elementwise ops of a decoder layer (RMSNorm, activation-and-multiply, rotary embedding).

Simple enough to trust; every other backend is tested against it. Backends without their own
elementwise kernels (sdpa, triton) use these.

Shapes (one layer):
  k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] views, any memory order; for a
                    quantized cache (int8, fp8 e4m3) the codes, each row's scale after its block's
                    codes and, for K, the layer's key smoothing after its blocks (kv_cache.py):
                    quantize() writes them, dequantize() reads them
  block_tables:     [num_seqs, max_blocks] int32, padded with any valid id
  context_lens:     [num_seqs] int32, tokens in the cache for each sequence, including this step's
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.ops.backend import AttentionArgs, FunctionBackend, LoRAWeights
from pagedllm.ops.kv_cache import LARGEST_CODE, is_quantized, key_smoothing, kv_scales

ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x (its last dim) as codes of `dtype` and one float32 scale each, x ~ codes * scale:
    symmetric, scale = max |row| / the largest code, codes rounded to nearest (even). An all-zero row has
    scale 0 and codes 0; a row holding a NaN or an infinity gets a NaN scale (it reads back as NaN)."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / LARGEST_CODE[dtype]
    scale = torch.where(torch.isfinite(scale), scale, torch.nan)
    scaled = torch.where(scale[..., None] > 0, x / scale[..., None], 0.0)
    codes = scaled.round().to(dtype) if dtype == torch.int8 else scaled.to(dtype)
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes [..., D] times their rows' scales [...], in float32."""
    return codes.float() * scale[..., None]


def fit_key_smoothing(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key smoothing (kv_cache.py) fitted to keys [N, Hkv, D]: per KV head and channel their mean, and
    their largest distance from it as the factor (1 where that is 0 or not finite)."""
    keys = keys.float()
    mean = keys.mean(dim=0)
    spread = (keys - mean).abs().amax(dim=0)
    return mean, torch.where((spread > 0) & spread.isfinite(), spread, 1.0)


def smooth_keys(key: torch.Tensor, k_cache: torch.Tensor) -> torch.Tensor:
    """Keys [..., Hkv, D] as the rows a quantized K cache stores, (k - mean) / factor (kv_cache.py)."""
    mean, factor = key_smoothing(k_cache)
    return (key.float() - mean) / factor


# The cpu kernels' decode over an int8 cache rounds its query to int16 codes of this largest magnitude
# (256 * 127 + 127: the two int8 halves they split each code into stay int8).
DECODE_QUERY_LARGEST = 127 * 257


def int8_decode_query(q: torch.Tensor, k_cache: torch.Tensor, scale: float) -> torch.Tensor:
    """q [S, H, D] as the cpu kernels' decode over an int8 cache meets the keys' codes in integers: each
    head's q * scale * its kv head's key smoothing factor rounded to int16 codes (one scale a head, max |x|
    / DECODE_QUERY_LARGEST, to nearest even), back in q's units (float32). Attention on it equals theirs up
    to float reordering and their rounding of each tile's weights to int16 codes."""
    factor = key_smoothing(k_cache)[1].repeat_interleave(q.shape[1] // k_cache.shape[2], dim=0)
    x = q.float() * scale * factor
    q_scale = x.abs().amax(dim=-1, keepdim=True) / DECODE_QUERY_LARGEST
    q_scale = torch.where(torch.isfinite(q_scale), q_scale, torch.nan)
    codes = torch.where(q_scale > 0, x / q_scale, 0.0).round()
    return codes * q_scale / (scale * factor)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new tokens' K/V ([T, Hkv, D]) into cache slots, quantized for a quantized cache (keys
    smoothed first); slot -1 means skip."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // k_cache.shape[1], slots % k_cache.shape[1]
    for new, cache in ((key[keep], k_cache), (value[keep], v_cache)):
        if is_quantized(cache.dtype):
            codes, scale = quantize(smooth_keys(new, cache) if cache is k_cache else new, cache.dtype)
            cache[blocks, offsets] = codes
            kv_scales(cache)[blocks, offsets] = scale
        else:
            cache[blocks, offsets] = new.to(cache.dtype)


def read_blocks(cache: torch.Tensor, ids: torch.Tensor, keys: bool) -> torch.Tensor:
    """Blocks `ids` of a K (`keys`) or V cache, [len(ids), block_size, Hkv, D]: in the cache's dtype, or
    dequantized to float32 for a quantized cache (keys unsmoothed: row * factor + mean)."""
    if not is_quantized(cache.dtype):
        return cache[ids]
    values = dequantize(cache[ids], kv_scales(cache)[ids])
    if keys:
        mean, factor = key_smoothing(cache)
        values = values * factor + mean
    return values


def gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, context_len: int, start: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's K and V from token `start` on, [context_len - start, Hkv, D], read through its block
    table (entries for blocks wholly before `start` are never read: a sliding window may have freed them)."""
    block_size = k_cache.shape[1]
    first, num_blocks = start // block_size, (context_len + block_size - 1) // block_size
    ids = block_table[first:num_blocks].long()
    skip, count = start - first * block_size, context_len - start
    k = read_blocks(k_cache, ids, keys=True).reshape(-1, *k_cache.shape[2:])[skip : skip + count]
    v = read_blocks(v_cache, ids, keys=False).reshape(-1, *v_cache.shape[2:])[skip : skip + count]
    return k, v


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    key_start: int = 0,
) -> torch.Tensor:
    """q [Q, H, D] at absolute positions q_positions against k/v [C, Hkv, D] at positions key_start.."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    k_positions = torch.arange(key_start, key_start + k.shape[0], device=q.device)
    allowed = k_positions[None, :] <= q_positions[:, None]
    if sliding_window is not None:
        allowed &= k_positions[None, :] > q_positions[:, None] - sliding_window
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)


def paged_attention(q: torch.Tensor, args: AttentionArgs) -> torch.Tensor:
    """Query rows q [T, H, D] of each sequence (args.query_start_loc), the last ones of its context: causal
    within the step, attending to all earlier tokens (e.g. a cached prefix) through the block table, each
    sequence gathered and attended on its own."""
    out = torch.empty_like(q)
    starts = args.query_start_loc.tolist()
    window = args.sliding_window
    for s, context_len in enumerate(args.context_lens.tolist()):
        lo, hi = starts[s], starts[s + 1]
        if hi == lo:
            continue
        first_pos = context_len - (hi - lo)
        key_start = 0 if window is None else max(0, first_pos + 1 - window)
        k, v = gather_kv(args.k_cache, args.v_cache, args.block_tables[s], context_len, key_start)
        pos = torch.arange(first_pos, context_len, device=q.device)
        out[lo:hi] = _attend(q[lo:hi], k, v, pos, args.scale, window, args.softcap, key_start)
    return out


def copy_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """Copy-on-write: copy block src to block dst for each (src, dst)."""
    swap_blocks(k_cache, v_cache, k_cache, v_cache, pairs)


def swap_blocks(
    src_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_k: torch.Tensor,
    dst_v: torch.Tensor,
    pairs: list[tuple[int, int]],
) -> None:
    """Copy block src of (src_k, src_v) to block dst of (dst_k, dst_v) for each (src, dst); the caches
    share a shape and dtype and may live on different devices, in different memory orders (swap-out to
    host, swap-in back). A quantized block moves with its scales: its codes (as bytes), then they."""
    if not pairs:
        return
    src = torch.tensor([p[0] for p in pairs], device=src_k.device)
    dst = torch.tensor([p[1] for p in pairs], device=dst_k.device)
    for s, d in ((src_k, dst_k), (src_v, dst_v)):
        if s.dtype != d.dtype:
            raise ValueError(f"cannot copy blocks of a {s.dtype} cache into a {d.dtype} one")
        for a, b in zip(_block_parts(s), _block_parts(d), strict=True):
            b.index_copy_(0, dst, a.index_select(0, src).to(b.device))


def _block_parts(cache: torch.Tensor) -> list[torch.Tensor]:
    """What a block of the cache is made of, each part indexed by block first: its values, or a quantized
    block's codes (as bytes) and scales."""
    if is_quantized(cache.dtype):
        return [cache.view(torch.uint8), kv_scales(cache)]
    return [cache]


def read_block_bytes(caches: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int]) -> torch.Tensor:
    """The blocks' K/V of every cache as bytes in the logical order ([len(block_ids), bytes] uint8 on the
    CPU, whatever the caches' memory order or device): what a file of a block holds."""
    rows = []
    index = torch.tensor(block_ids, device=caches[0][0].device)
    for cache in (part for kv in caches for c in kv for part in _block_parts(c)):
        rows.append(cache.index_select(0, index).cpu().reshape(len(block_ids), -1).view(torch.uint8))
    return torch.cat(rows, dim=1)


def write_block_bytes(
    caches: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int], data: torch.Tensor
) -> None:
    """Store rows of read_block_bytes into the blocks `block_ids` of caches of the same geometry."""
    index = torch.tensor(block_ids, device=caches[0][0].device)
    offset = 0
    for cache in (part for kv in caches for c in kv for part in _block_parts(c)):
        width = cache[0].numel() * cache.element_size()
        rows = data[:, offset : offset + width].contiguous().view(cache.dtype)
        cache.index_copy_(0, index, rows.reshape(len(block_ids), *cache.shape[1:]).to(cache.device))
        offset += width
    if offset != data.shape[1]:
        raise ValueError(f"block rows of {data.shape[1]} bytes for caches whose blocks take {offset}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """x / rms(x) * weight over the last dim, in float32 as Hugging Face computes it; Gemma scales by
    (1 + weight) before rounding to x's dtype, Llama rounds first."""
    normed = F.rms_norm(x.float(), weight.shape, eps=eps)
    if unit_offset:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


def act_and_mul(x: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up for x = [gate | up] ([T, 2I] -> [T, I])."""
    gate, up = x.chunk(2, dim=-1)
    return ACTIVATIONS[activation](gate) * up


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value (the first of ties; a NaN counts as largest)."""
    return x.argmax(dim=-1)


def rotary_embedding_(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Rotate x [T, H, D] in place by position, pairing dim i with i + D/2 (Hugging Face's rotate_half
    layout); cos_sin [max_positions, D] float32 holds cos of each pair's angle, then sin."""
    cos, sin = cos_sin[positions, None].chunk(2, dim=-1)
    x1, x2 = x.float().chunk(2, dim=-1)
    x.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))


def lora_add(y: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, weights: LoRAWeights) -> None:
    """y[t] += B (A x[t]) by adapter rows[t] (-1: none), in float32, y rounded once (backend.Backend.lora_add
    says how weights hold each adapter's a, b and spans)."""
    for adapter in range(len(weights) // 3):
        a, b, spans = weights[3 * adapter : 3 * adapter + 3]
        mine = (rows == adapter).nonzero().squeeze(1)
        if a is None or not len(mine):
            continue
        shrunk = x.index_select(0, mine).float() @ a.float().t()
        rank, column = b.shape[0], 0
        for piece, (first, count) in enumerate(spans.tolist()):
            delta = shrunk[:, piece * rank : (piece + 1) * rank] @ b[:, column : column + count].float()
            out = y[:, first : first + count]
            out.index_copy_(0, mine, (out.index_select(0, mine).float() + delta).to(y.dtype))
            column += count


# The `torch` backend. Backends without their own elementwise kernels keep its ones.
BACKEND = FunctionBackend(
    "torch", write_kv, paged_attention, rms_norm, act_and_mul, rotary_embedding_, argmax, lora_add
)
