"""Attention that reads K/V through block tables, the store of new K/V into slots, the fused elementwise
ops of a decoder layer (rms_norm, act_and_mul, rotary_embedding_), greedy sampling's argmax, LoRA adapters'
updates of a projection's output (lora_add), and a decoder layer in one call where the backend offers it.

Tensors in, tensors out: no engine concepts here. Every op goes to a backend (backend.Backend), an object
registered here by name:
  torch   the reference (reference.py): gather + softmax in fp32, slow, trusted
  sdpa    pure PyTorch: per-sequence index_select + scaled_dot_product_attention
  cpu     C++ kernels reading K/V in place (csrc/), built on first use for the CPU's instruction set
  triton  GPU kernels (triton_ops.py)
PAGEDLLM_ATTN_BACKEND picks one; otherwise CUDA tensors use triton (sdpa if Triton is missing), CPU
tensors use cpu for fp32/bf16 (sdpa for fp16, and, with one warning line, if the kernel cannot
be built), other devices sdpa.
The choice is made once per device type and dtype and cached (reset_backend_cache() forgets it).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from collections.abc import Callable

import torch

from pagedllm.ops import cpu, native, reference, sdpa
from pagedllm.ops.backend import (
    AttentionArgs,
    Backend,
    DecoderLayerSpec,
    FunctionBackend,
    FusedDecoderLayer,
    KernelWeight,
    LoRAOperands,
    LoRAWeights,
)
from pagedllm.ops.kv_cache import allocate_kv_caches, kv_block_bytes
from pagedllm.ops.reference import copy_blocks, read_block_bytes, swap_blocks, write_block_bytes

ENV_VAR = "PAGEDLLM_ATTN_BACKEND"

__all__ = [
    "BACKENDS",
    "AttentionArgs",
    "Backend",
    "DecoderLayerSpec",
    "FunctionBackend",
    "FusedDecoderLayer",
    "KernelWeight",
    "LoRAOperands",
    "LoRAWeights",
    "act_and_mul",
    "allocate_kv_caches",
    "argmax",
    "backend",
    "copy_blocks",
    "get_backend",
    "get_backend_name",
    "kv_block_bytes",
    "lora_add",
    "paged_attention",
    "read_block_bytes",
    "register_backend",
    "reset_backend_cache",
    "rms_norm",
    "rotary_embedding_",
    "swap_blocks",
    "write_block_bytes",
    "write_kv",
]


def _triton() -> Backend:
    from pagedllm.ops import triton_ops  # imported on first use: Triton may be missing

    return triton_ops.BACKEND


# The registry: each backend's name and what gives it (called once, on first use).
BACKENDS: dict[str, Callable[[], Backend]] = {
    "torch": lambda: reference.BACKEND,
    "sdpa": lambda: sdpa.BACKEND,
    "cpu": lambda: cpu.BACKEND,
    "triton": _triton,
}


def register_backend(name: str, make: Callable[[], Backend]) -> None:
    """Add a backend under `name` (PAGEDLLM_ATTN_BACKEND then names it); `make` gives it, on first use."""
    if name in BACKENDS:
        raise ValueError(f"a backend named {name!r} is already registered")
    BACKENDS[name] = make


@functools.cache
def backend(name: str) -> Backend:
    """The registered backend of this name (made once)."""
    if name not in BACKENDS:
        raise ValueError(f"no backend named {name!r}; registered: {sorted(BACKENDS)}")
    return BACKENDS[name]()


def _cpu_or_fallback() -> str:
    reason = native.unavailable_reason()
    if reason is None:
        return "cpu"
    logging.getLogger(__name__).warning(
        "pagedllm: C++ paged attention unavailable (%s); using the sdpa fallback", reason
    )
    return "sdpa"


def get_backend_name(device: torch.device | str, dtype: torch.dtype = torch.float32) -> str:
    """Name of the backend that serves tensors of this dtype on this device."""
    return _resolve(torch.device(device).type, dtype)


def get_backend(device: torch.device | str, dtype: torch.dtype = torch.float32) -> Backend:
    """The backend that serves tensors of this dtype on this device."""
    return _backend(torch.device(device).type, dtype)


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
def _backend(device_type: str, dtype: torch.dtype) -> Backend:
    return backend(_resolve(device_type, dtype))


def _of(x: torch.Tensor) -> Backend:
    return _backend(x.device.type, x.dtype)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new tokens' K/V ([T, Hkv, D]) into cache slots (slot_mapping [T] int64); -1 skips."""
    _of(key).write_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(q: torch.Tensor, args: AttentionArgs) -> torch.Tensor:
    """q [T, H, D] -> [T, H, D], attending through args' block tables (backend.AttentionArgs)."""
    return _of(q).paged_attention(q, args)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """x / rms(x) * weight over the last dim (Gemma: * (1 + weight)); float32 math, x's dtype out."""
    return _of(x).rms_norm(x, weight, eps, unit_offset)


def act_and_mul(x: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up for x = [gate | up], [T, 2I] -> [T, I]; activation "silu" or "gelu_pytorch_tanh"."""
    return _of(x).act_and_mul(x, activation)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) for x [rows, N] (greedy sampling over logits): [rows] int64, the first index of
    each row's largest value, a NaN counting as largest."""
    return _of(x).argmax(x)


def rotary_embedding_(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Rotate x [T, H, D] (e.g. the q and k heads of a fused projection) in place by each token's position;
    cos_sin [max_positions, D] float32 holds each rotated pair's cos, then sin."""
    _of(x).rotary_embedding_(x, positions, cos_sin)


def lora_add(y: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, weights: LoRAWeights) -> None:
    """y[t] += B (A x[t]) in place for a projection's input x and output y, by adapter rows[t] (-1: none);
    backend.Backend.lora_add says how `weights` holds each adapter's A and B."""
    _of(y).lora_add(y, x, rows, weights)


def reset_backend_cache() -> None:
    """Forget the cached backend choice (after changing PAGEDLLM_ATTN_BACKEND)."""
    _resolve.cache_clear()
    _backend.cache_clear()
