"""Allocation of the paged KV cache: its logical shape is fixed, its memory order is chosen per device.

Every op reads a layer's cache as K and V views of shape [num_blocks, block_size, num_kv_heads, head_dim]
and addresses them through their strides. On the CPU the memory behind those views is head-major
([num_blocks, num_kv_heads, block_size, head_dim]: one KV head's rows of a block are contiguous, 4 KiB
for 16 fp32 tokens of dimension 64) and backed by transparent huge pages where Linux offers them, so
that paged attention streams each block it visits: with 4 KiB pages every randomly placed block costs a
TLB miss and a restart of the hardware prefetcher (docs/BENCHMARKS.md, paged attention). On other
devices the memory is slot-major and contiguous, the layout the Triton kernels index.

Quantized caches (int8, and fp8 as torch.float8_e4m3fn) hold codes: each row of head_dim values (one
token, one KV head) is stored as codes with one float32 scale, value = code * scale, the scale being the
row's largest magnitude over the largest code (127; 448 for e4m3), so that no value is clipped and no
calibration is needed. A block's scales live in the same memory, right after its codes:

    block = [ codes: block_size x Hkv rows of head_dim bytes, in the view's memory order ]
            [ scales: one float32 per row, in the same row order ]

so the scale of the code row at byte offset o of its block is float o / head_dim after the codes, in
either memory order, and a block with its scales is one run of memory (kv_blocks) that attention reads as
one stream. The codes are the view every op receives: kv_scales gives the scales as a
[num_blocks, block_size, Hkv] view, and the C++ kernels find them by the same rule, so the ops and the
engine pass (k_cache, v_cache) as for any cache; swap and copy-on-write move each block's codes and
scales. Per layer, K or V: block_size x Hkv x (head_dim + 4) bytes, against float32's 4 x head_dim.

Keys are smoothed before they are quantized: a few of their channels are far larger than the rest (Qwen2.5's
and Gemma 3's keys), and one scale per row would give the small channels steps of the large ones' size. Each
layer's K cache holds, after its last block, a key smoothing (key_smoothing): per KV head and channel a mean
and a factor (SmoothAttention's per-channel division, with KIVI's observation that keys vary by channel), and
a key k is stored as the row (k - mean) / factor, quantized as above. Attention multiplies the query by the
factor and leaves the mean out: q . k = (q * factor) . row + q . mean, and the last term is the same for
every key of a query, which softmax does not see. The smoothing is the identity (mean 0, factor 1) until the
engine calibrates it from the keys of a forward pass (ModelRunner); it is the same for every block of a
layer, so blocks move, fork and are shared as they are. (V's layer has the same room, unused: K and V share
one geometry.)
"""

from __future__ import annotations

import torch

from pagedllm.ops.memory import huge_page_zeros, huge_pages_available

KVCache = tuple[torch.Tensor, torch.Tensor]  # one layer's (k_cache, v_cache)

# The quantized cache dtypes and the largest magnitude of their codes.
LARGEST_CODE = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_BYTES = 4  # a float32 scale per row of codes


def smoothing_bytes(num_kv_heads: int, head_dim: int) -> int:
    """Bytes of one layer's key smoothing: a float32 mean and factor per KV head and channel."""
    return 2 * num_kv_heads * head_dim * 4


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether a cache of this dtype holds codes with scales (int8, fp8 e4m3) rather than values."""
    return dtype in LARGEST_CODE


def kv_block_bytes(block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one layer's K (or V) block: its values, or its codes and their scales."""
    rows = block_size * num_kv_heads
    if is_quantized(dtype):
        return rows * (head_dim + SCALE_BYTES)
    return rows * head_dim * torch.empty((), dtype=dtype).element_size()


def _zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, pin: bool, touch: bool
) -> torch.Tensor:
    numel = 1
    for size in shape:
        numel *= size
    if device.type == "cpu" and not pin and numel > 0 and huge_pages_available():
        return huge_page_zeros(numel, dtype, touch).view(shape)
    return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    pin_memory: bool = False,
    touch: bool = True,
    head_major: bool | None = None,
) -> list[KVCache]:
    """Per layer, zero-filled (k_cache, v_cache) views of shape [num_blocks, block_size, Hkv, head_dim]
    (for a quantized dtype: the codes, their scales after each block's, all zero, and after the last
    block the identity key smoothing).

    `touch=False` leaves a CPU cache's pages to be committed by first use (ops.memory.huge_page_zeros).
    `head_major`: the memory order, by default the device's (head-major on the CPU, else slot-major)."""
    device = torch.device(device)
    head_major = device.type == "cpu" if head_major is None else head_major
    inner = (num_kv_heads, block_size) if head_major else (block_size, num_kv_heads)
    if is_quantized(dtype):
        block_bytes = kv_block_bytes(block_size, num_kv_heads, head_dim, dtype)
        blocks_end = num_blocks * block_bytes
        layers = _zeros(
            (2, num_layers, blocks_end + smoothing_bytes(num_kv_heads, head_dim)),
            torch.uint8, device, pin_memory, touch,
        )  # fmt: skip
        factors = layers[..., blocks_end:].view(torch.float32).unflatten(-1, (2, -1))[..., 1, :]
        factors.fill_(1.0)  # the identity smoothing
        blocks = layers[..., :blocks_end].unflatten(-1, (num_blocks, block_bytes))
        codes = block_size * num_kv_heads * head_dim
        memory = blocks[..., :codes].view(dtype).unflatten(-1, (*inner, head_dim))
    else:
        memory = _zeros((2, num_layers, num_blocks, *inner, head_dim), dtype, device, pin_memory, touch)
    if head_major:
        memory = memory.transpose(3, 4)  # the logical [.., block_size, Hkv, D] order over head-major memory
    return [(memory[0, layer], memory[1, layer]) for layer in range(num_layers)]


def _packed_geometry(cache: torch.Tensor) -> tuple[int, int]:
    """(bytes of a block's codes, bytes of a whole block) of a quantized cache view, checked to be one
    allocate_kv_caches made: dense rows of codes in either memory order, room for the scales after them."""
    num_blocks, block_size, heads, head_dim = cache.shape
    block_stride, slot_stride, head_stride, dim_stride = cache.stride()
    codes = block_size * heads * head_dim
    dense = dim_stride == 1 and (
        (slot_stride, head_stride) == (heads * head_dim, head_dim)
        or (slot_stride, head_stride) == (head_dim, block_size * head_dim)
    )
    if not dense or block_stride < codes + SCALE_BYTES * block_size * heads or block_stride % SCALE_BYTES:
        raise ValueError(
            f"a {cache.dtype} KV cache must be a view allocate_kv_caches made (each block's scales after its "
            f"codes), got shape {tuple(cache.shape)} with strides {cache.stride()}"
        )
    return codes, block_stride


def kv_blocks(cache: torch.Tensor) -> torch.Tensor:
    """The cache's blocks as they lie in memory, [num_blocks, block bytes] uint8 (a quantized block's
    codes and scales together); a copy of a block is a copy of its row."""
    if not is_quantized(cache.dtype):
        raise ValueError(f"kv_blocks is for quantized caches, got {cache.dtype}")
    _, block_stride = _packed_geometry(cache)
    return cache.view(torch.uint8).as_strided((cache.shape[0], block_stride), (block_stride, 1))


def kv_scales(cache: torch.Tensor) -> torch.Tensor | None:
    """A quantized cache's scales as a float32 [num_blocks, block_size, Hkv] view (None for a cache of
    values): the scale of code row [b, j, h] is kv_scales(cache)[b, j, h]."""
    if not is_quantized(cache.dtype):
        return None
    codes, block_stride = _packed_geometry(cache)
    floats = kv_blocks(cache).view(torch.float32)  # [num_blocks, block_stride / 4]
    head_dim = cache.shape[3]
    strides = (block_stride // SCALE_BYTES, cache.stride(1) // head_dim, cache.stride(2) // head_dim)
    return floats.as_strided(cache.shape[:3], strides, floats.storage_offset() + codes // SCALE_BYTES)


def key_smoothing(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A quantized K cache's smoothing, (mean, factor) float32 [Hkv, D] views of the memory after its last
    block: a key k is stored as the row (k - mean) / factor."""
    if not is_quantized(cache.dtype):
        raise ValueError(f"key_smoothing is for quantized caches, got {cache.dtype}")
    _, block_stride = _packed_geometry(cache)
    num_blocks, _, heads, head_dim = cache.shape
    raw = cache.view(torch.uint8)
    start, size = raw.storage_offset() + num_blocks * block_stride, smoothing_bytes(heads, head_dim)
    if start + size > raw.untyped_storage().nbytes():
        raise ValueError(
            f"a {cache.dtype} KV cache must be a view allocate_kv_caches made (its key smoothing after its "
            f"last block), got shape {tuple(cache.shape)} in {raw.untyped_storage().nbytes()} bytes"
        )
    floats = raw.as_strided((size,), (1,), start).view(torch.float32).view(2, heads, head_dim)
    return floats[0], floats[1]
