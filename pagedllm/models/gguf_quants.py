"""GGUF's quantized blocks, kept: a checkpoint tensor still in its blocks, and the exact unpacking of a
block type into integer values with per-group scales and mins (what GGUFLinear repacks for the kernel).

Every supported type is an affine code per group of columns, W = scale * q + min (or scale * q):

  type   group  q                          scale        min
  Q4_0   32     0..15                      d            -8 d
  Q4_1   32     0..15                      d            m
  Q5_0   32     -16..15                    d            -
  Q5_1   32     0..31                      d            m
  Q8_0   32     -128..127                  d            -
  Q4_K   32     0..15 (8 per super-block)  d * sc_j     -dmin * m_j
  Q5_K   32     0..31                      d * sc_j     -dmin * m_j
  Q6_K   16     -32..31                    d * sc_j     -

d, m, dmin are float16 and sc_j, m_j small integers, so every scale and min is exact in float32 and
scale * q + min, rounded once (the kernel's fused multiply-add), equals the value llama.cpp and the
`gguf` package dequantize to.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType


@dataclass
class Unpacked:
    """A quantized tensor's values, one a byte: q [rows, cols] (uint8 for 4-bit codes, int8 otherwise),
    scales / mins [rows, cols / group] float32 (mins None for a pure scale)."""

    q: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None
    group: int
    bits: int  # 4: q in 0..15; 8: q in int8


def _f16(column: np.ndarray) -> np.ndarray:
    """[B, 2] bytes -> [B, 1] float32."""
    return np.ascontiguousarray(column).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[B, n] bytes -> [B, 2n]: the low nibbles, then the high ones (GGUF's 32-value block order)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """[B, 4] bytes holding one bit per value (little-endian uint32) -> [B, count] bits as uint8."""
    bits = np.ascontiguousarray(qh).view(np.uint32) >> np.arange(count, dtype=np.uint32)
    return (bits & 1).astype(np.uint8)


def _q4_0(b):
    d = _f16(b[:, 0:2])
    return _nibbles(b[:, 2:]), d, -8 * d, 32, 4


def _q4_1(b):
    return _nibbles(b[:, 4:]), _f16(b[:, 0:2]), _f16(b[:, 2:4]), 32, 4


def _q5_0(b):
    q = _nibbles(b[:, 6:]) | (_high_bits(b[:, 2:6], 32) << 4)
    return q.astype(np.int8) - 16, _f16(b[:, 0:2]), None, 32, 8


def _q5_1(b):
    q = _nibbles(b[:, 8:]) | (_high_bits(b[:, 4:8], 32) << 4)
    return q.astype(np.int8), _f16(b[:, 0:2]), _f16(b[:, 2:4]), 32, 8


def _q8_0(b):
    return np.ascontiguousarray(b[:, 2:]).view(np.int8), _f16(b[:, 0:2]), None, 32, 8


def _k_scales(b):
    """Q4_K / Q5_K: the eight 6-bit (scale, min) pairs -> scales d * sc and mins -dmin * m, [B, 8]."""
    from gguf.quants import Q4_K

    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    return _f16(b[:, 0:2]) * sc.astype(np.float32), -_f16(b[:, 2:4]) * m.astype(np.float32)


def _k_low(qs: np.ndarray) -> np.ndarray:
    """[B, 128] bytes -> [B, 8, 32]: in each 32-byte run, the low nibbles are one group, the high the next."""
    runs = qs.reshape(qs.shape[0], 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (runs & 15).reshape(qs.shape[0], 8, 32)


def _q4_k(b):
    scales, mins = _k_scales(b)
    return _k_low(b[:, 16:]).reshape(b.shape[0], 256), scales, mins, 32, 4


def _q5_k(b):
    scales, mins = _k_scales(b)
    high = (b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    q = _k_low(b[:, 48:]) | (high << 4)
    return q.reshape(b.shape[0], 256).astype(np.int8), scales, mins, 32, 8


def _q6_k(b):
    ql, qh = b[:, :128], b[:, 128:192]
    scales = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32) * _f16(b[:, 208:210])
    low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15
    high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    q = low.reshape(-1, 8, 32) | (high.reshape(-1, 8, 32) << 4)
    return q.reshape(b.shape[0], 256).astype(np.int8) - 32, scales, None, 16, 8


_UNPACK = {
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q5_0: _q5_0,
    GGMLQuantizationType.Q5_1: _q5_1,
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q5_K: _q5_k,
    GGMLQuantizationType.Q6_K: _q6_k,
}
KEPT_TYPES = frozenset(_UNPACK)


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

    def unpack(self) -> Unpacked:
        """The exact (q, scales, mins) form; ValueError for a block type not kept."""
        if self.qtype not in _UNPACK:
            raise ValueError(
                f"GGUF type {self.qtype.name} is not kept quantized (kept: "
                f"{', '.join(sorted(t.name for t in KEPT_TYPES))}); load with quantization=None"
            )
        rows = self.raw.shape[0]
        _, size = GGML_QUANT_SIZES[self.qtype]
        q, scales, mins, group, bits = _UNPACK[self.qtype](self.raw.reshape(-1, size))
        return Unpacked(
            q.reshape(rows, -1),
            scales.reshape(rows, -1),
            None if mins is None else mins.reshape(rows, -1),
            group,
            bits,
        )
