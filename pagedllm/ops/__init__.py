"""Attention that reads K/V through block tables, the store of new K/V into slots, the fused elementwise
ops of a decoder layer (rms_norm, act_and_mul, rotary_embedding_) and greedy sampling's argmax.

Tensors in, tensors out: no engine concepts here. Every op dispatches to a backend:
  torch   the reference (reference.py): gather + softmax in fp32, slow, trusted
  sdpa    pure PyTorch: per-sequence index_select + scaled_dot_product_attention
  cpu     C++ kernels reading K/V in place (csrc/), built on first use for the CPU's instruction set
  triton  GPU kernels (triton_ops.py)
A backend without its own elementwise kernels uses the reference ones.
PAGEDLLM_ATTN_BACKEND picks one; otherwise CUDA tensors use triton (sdpa if Triton is missing), CPU
tensors use cpu for fp32/bf16 (sdpa for fp16, and, with one warning line, if the kernel cannot
be built), other devices sdpa.
The choice is made once per device type and cached (reset_backend_cache() forgets it).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
from types import ModuleType

import torch

from pagedllm.ops import reference
from pagedllm.ops.kv_cache import allocate_kv_caches, kv_block_bytes
from pagedllm.ops.reference import copy_blocks, read_block_bytes, swap_blocks, write_block_bytes

BACKENDS = {"torch": "reference", "sdpa": "sdpa", "cpu": "cpu", "triton": "triton_ops"}
ENV_VAR = "PAGEDLLM_ATTN_BACKEND"

__all__ = [
    "BACKENDS",
    "argmax",
    "copy_blocks",
    "get_backend_name",
    "act_and_mul",
    "allocate_kv_caches",
    "kv_block_bytes",
    "paged_decode_attention",
    "paged_prefill_attention",
    "read_block_bytes",
    "reset_backend_cache",
    "rms_norm",
    "rotary_embedding_",
    "swap_blocks",
    "write_block_bytes",
    "write_kv",
]


def _cpu_or_fallback() -> str:
    from pagedllm.ops import cpu

    reason = cpu.unavailable_reason()
    if reason is None:
        return "cpu"
    logging.getLogger(__name__).warning(
        "pagedllm: C++ paged attention unavailable (%s); using the sdpa fallback", reason
    )
    return "sdpa"


def get_backend_name(device: torch.device | str, dtype: torch.dtype = torch.float32) -> str:
    """Name of the backend that serves tensors of this dtype on this device."""
    return _resolve(torch.device(device).type, dtype)


@functools.cache
def _resolve(device_type: str, dtype: torch.dtype) -> str:
    requested = os.environ.get(ENV_VAR, "").strip().lower()
    if requested and requested not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={requested!r} is not one of {sorted(BACKENDS)}")
    if requested == "cpu" or (not requested and device_type == "cpu"):
        if device_type != "cpu":
            raise ValueError(f"{ENV_VAR}=cpu cannot run on {device_type} tensors")
        if dtype not in (torch.float32, torch.bfloat16):
            return "sdpa"  # the C++ kernel covers fp32 and bf16
        return _cpu_or_fallback()
    if requested:
        return requested
    if device_type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "sdpa"


@functools.cache
def _backend(device_type: str, dtype: torch.dtype) -> ModuleType:
    return importlib.import_module(f"pagedllm.ops.{BACKENDS[_resolve(device_type, dtype)]}")


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new tokens' K/V ([T, Hkv, D]) into cache slots (slot_mapping [T] int64); -1 skips."""
    _backend(key.device.type, key.dtype).write_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [S, H, D], one token per sequence (the last of its context) -> [S, H, D]. `softcap`: scores
    capped at +-softcap (softcap * tanh(score / softcap), Gemma 2)."""
    return _attention_backend(q, softcap).paged_decode_attention(
        q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, softcap
    )


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [T, H, D]; rows query_start_loc[s]:[s+1] are the last tokens of sequence s, causal -> [T, H, D].
    `softcap` as in paged_decode_attention."""
    return _attention_backend(q, softcap).paged_prefill_attention(
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, sliding_window, softcap
    )


def _attention_backend(q: torch.Tensor, softcap: float | None) -> ModuleType:
    """The backend's attention; soft-capped scores need one that caps them: sdpa's SDPA call cannot, so
    the reference serves them there."""
    backend = _backend(q.device.type, q.dtype)
    if softcap is not None and backend.__name__ == "pagedllm.ops.sdpa":
        return reference
    return backend


def _elementwise(x: torch.Tensor, name: str):
    return _elementwise_op(x.device.type, x.dtype, name)


@functools.cache
def _elementwise_op(device_type: str, dtype: torch.dtype, name: str):
    backend = _backend(device_type, dtype)
    return getattr(backend, name) if hasattr(backend, name) else getattr(reference, name)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """x / rms(x) * weight over the last dim (Gemma: * (1 + weight)); float32 math, x's dtype out."""
    return _elementwise(x, "rms_norm")(x, weight, eps, unit_offset)


def act_and_mul(x: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up for x = [gate | up], [T, 2I] -> [T, I]; activation "silu" or "gelu_pytorch_tanh"."""
    return _elementwise(x, "act_and_mul")(x, activation)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) for x [rows, N] (greedy sampling over logits): [rows] int64, the first index of
    each row's largest value, a NaN counting as largest."""
    return _elementwise(x, "argmax")(x)


def rotary_embedding_(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Rotate x [T, H, D] (e.g. the q and k heads of a fused projection) in place by each token's position;
    cos_sin [max_positions, D] float32 holds each rotated pair's cos, then sin."""
    _elementwise(x, "rotary_embedding_")(x, positions, cos_sin)


def reset_backend_cache() -> None:
    """Forget the cached backend choice (after changing PAGEDLLM_ATTN_BACKEND)."""
    _resolve.cache_clear()
    _backend.cache_clear()
    _elementwise_op.cache_clear()
