"""Shared by the C++ kernel tests: the int16 / int8 rounding of activations the integer matmul paths do,
written independently of the kernels (the `kernels` fixture, one per instruction-set build, is in
conftest.py)."""

from __future__ import annotations

import torch

INT16, INT8 = 32767, 127  # the largest code of each rounding of x


def int_blocks(x: torch.Tensor, size: int = 32, largest: int = INT16) -> torch.Tensor:
    """x rounded as integer blocks of `size` columns, scale max |x| / `largest` each (float32 arithmetic); a
    row's last block may be shorter (its scale from its own columns)."""
    rows, cols = x.shape
    blocks = torch.nn.functional.pad(x.float(), (0, -cols % size)).reshape(rows, -1, size)
    d = blocks.abs().amax(dim=-1, keepdim=True) / largest
    inverse = torch.where(d > 0, 1 / d, 0)
    return (torch.round(blocks * inverse) * d).reshape(rows, -1)[:, :cols]
