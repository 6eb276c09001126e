"""GGUF's quantized blocks, kept: a checkpoint tensor still in its blocks, of one of the types the C++
kernel multiplies as the file stores them (ops/csrc/quants.h describes each type's layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

KEPT_TYPES = frozenset(
    GGMLQuantizationType[name] for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
)


@dataclass
class GGUFBlocks:
    """A 2-D GGUF tensor still in its blocks: raw [rows, bytes a row] uint8 of ggml type `qtype`; each row
    holds `cols` values (Hugging Face's [out_features, in_features] orientation)."""

    raw: np.ndarray
    qtype: GGMLQuantizationType

    @property
    def shape(self) -> tuple[int, int]:
        block, size = GGML_QUANT_SIZES[self.qtype]
        return self.raw.shape[0], self.raw.shape[1] // size * block

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols], as the `gguf` package dequantizes it."""
        from gguf.quants import dequantize

        return torch.from_numpy(np.ascontiguousarray(dequantize(self.raw, self.qtype), dtype=np.float32))

    def narrow(self, dim: int, start: int, length: int) -> GGUFBlocks | torch.Tensor:
        """Rows [start, start + length) (dim 0) or columns (dim 1) of the tensor: still in blocks where the
        columns are whole blocks, else dequantized (a tensor-parallel rank's part of a weight)."""
        if dim == 0:
            return GGUFBlocks(self.raw[start : start + length], self.qtype)
        block, size = GGML_QUANT_SIZES[self.qtype]
        if start % block or length % block:
            return self.dequantize().narrow(1, start, length)
        columns = self.raw[:, start // block * size : (start + length) // block * size]
        return GGUFBlocks(np.ascontiguousarray(columns), self.qtype)
