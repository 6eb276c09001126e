"""Attention that reads K/V through block tables, and the store of new K/V into slots.

Tensors in, tensors out: no engine concepts here. Attention and write_kv dispatch to a backend:
  torch   the reference (reference.py): gather + softmax in fp32, slow, trusted
  sdpa    pure PyTorch: per-sequence index_select + scaled_dot_product_attention
  cpu     C++ kernel reading K/V in place (csrc/), built on first use
  triton  GPU kernels (triton_ops.py)
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

from pagedllm.ops.reference import copy_blocks, swap_blocks

BACKENDS = {"torch": "reference", "sdpa": "sdpa", "cpu": "cpu", "triton": "triton_ops"}
ENV_VAR = "PAGEDLLM_ATTN_BACKEND"

__all__ = [
    "BACKENDS",
    "copy_blocks",
    "get_backend_name",
    "paged_decode_attention",
    "paged_prefill_attention",
    "reset_backend_cache",
    "swap_blocks",
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
) -> torch.Tensor:
    """q [S, H, D], one token per sequence (the last of its context) -> [S, H, D]."""
    return _backend(q.device.type, q.dtype).paged_decode_attention(
        q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window
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
) -> torch.Tensor:
    """q [T, H, D]; rows query_start_loc[s]:[s+1] are the last tokens of sequence s, causal -> [T, H, D]."""
    return _backend(q.device.type, q.dtype).paged_prefill_attention(
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, sliding_window
    )


def reset_backend_cache() -> None:
    """Forget the cached backend choice (after changing PAGEDLLM_ATTN_BACKEND)."""
    _resolve.cache_clear()
    _backend.cache_clear()
