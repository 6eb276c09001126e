"""Allocation of the paged KV cache: its logical shape is fixed, its memory order is chosen per device.

Every op reads a layer's cache as K and V views of shape [num_blocks, block_size, num_kv_heads, head_dim]
and addresses them through their strides. On the CPU the memory behind those views is head-major
([num_blocks, num_kv_heads, block_size, head_dim]: one KV head's rows of a block are contiguous, 4 KiB
for 16 fp32 tokens of dimension 64) and backed by transparent huge pages where Linux offers them, so
that paged attention streams each block it visits: with 4 KiB pages every randomly placed block costs a
TLB miss and a restart of the hardware prefetcher (docs/BENCHMARKS.md, paged attention). On other
devices the memory is slot-major and contiguous, the layout the Triton kernels index.
"""

from __future__ import annotations

import torch

from pagedllm.ops.memory import huge_page_zeros, huge_pages_available

KVCache = tuple[torch.Tensor, torch.Tensor]  # one layer's (k_cache, v_cache)


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
) -> list[KVCache]:
    """Per layer, zero-filled (k_cache, v_cache) views of shape [num_blocks, block_size, Hkv, head_dim].

    `touch=False` leaves a CPU cache's pages to be committed by first use (ops.memory.huge_page_zeros)."""
    device = torch.device(device)
    head_major = device.type == "cpu"
    inner = (num_kv_heads, block_size) if head_major else (block_size, num_kv_heads)
    shape = (2, num_layers, num_blocks, *inner, head_dim)
    memory = _zeros(shape, dtype, device, pin_memory, touch)
    if head_major:
        memory = memory.transpose(3, 4)  # the logical [.., block_size, Hkv, D] order over head-major memory
    return [(memory[0, layer], memory[1, layer]) for layer in range(num_layers)]
