"""Shared by the C++ kernel tests: the int16 rounding of activations the integer matmul path does, written
independently of the kernels (the `kernels` fixture, one per instruction-set build, is in conftest.py)."""

from __future__ import annotations

import torch


def int16_blocks(x: torch.Tensor, size: int = 32) -> torch.Tensor:
    """x rounded as int16 blocks of `size` columns, scale max |x| / 32767 each (float32 arithmetic)."""
    blocks = x.float().reshape(x.shape[0], -1, size)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 32767
    inverse = torch.where(d > 0, 1 / d, 0)
    return (torch.round(blocks * inverse) * d).reshape(x.shape)
