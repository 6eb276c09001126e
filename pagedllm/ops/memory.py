"""Large CPU buffers on transparent huge pages.

Streaming reads of big buffers (model weights, the KV cache) are TLB-miss bound on 4 KiB pages (one core's
sequential reads run markedly faster on 2 MiB pages: commit 454fa7a measured it). Linux's THP is often
in `madvise` mode, so such buffers are private anonymous mappings advised to use huge pages.
"""

from __future__ import annotations

import mmap

import torch


def huge_pages_available() -> bool:
    """Whether this platform has private anonymous mappings (huge pages are then asked for where it can)."""
    return hasattr(mmap, "MAP_PRIVATE")


def huge_page_zeros(numel: int, dtype: torch.dtype, touch: bool = True) -> torch.Tensor:
    """A zero-filled flat CPU tensor in private anonymous memory advised to use transparent huge pages.

    `touch`: write every page now (the machine commits the memory here, a visible part of start-up on a
    fresh VM: docs/JOURNAL.md, "Start-up"), not during the first steps that use it; without, the kernel's
    zero-filled pages arrive on first use."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    memory = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(memory, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    flat = torch.frombuffer(memory, dtype=dtype, count=numel)  # keeps `memory` alive
    if touch:
        flat.zero_()
    return flat


def pack_on_huge_pages(tensors: list[torch.Tensor], alignment: int = 64) -> list[torch.Tensor]:
    """Copies of `tensors` laid out one after another in one huge-page buffer (each start aligned), in order.

    One buffer rather than one per tensor: a mapping smaller than 2 MiB gets no huge page, and a model's
    weights read in order become one sequential stream."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // alignment) * alignment
    arena = huge_page_zeros(total, torch.uint8, touch=False)  # the copies below write every page
    copies = []
    for t, offset in zip(tensors, offsets, strict=True):
        nbytes = t.numel() * t.element_size()
        copy = arena[offset : offset + nbytes].view(t.dtype).view(t.shape)
        copy.copy_(t)
        copies.append(copy)
    return copies
