"""`cpu` backend: the C++ kernel in csrc/paged_attention.cpp, built on first use and cached on disk.

The build goes through torch.utils.cpp_extension (cache under TORCH_EXTENSIONS_DIR, default
~/.cache/torch_extensions); it happens once per machine and is loaded once per process.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
# -fopenmp must also reach the linker, or at::parallel_for runs on one thread.
_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]


@functools.cache
def unavailable_reason() -> str | None:
    """Build and load the kernel once; None on success, else why it cannot be used."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"CPU lacks AVX2 (capability {torch.backends.cpu.get_cpu_capability()})"
    try:
        from torch.utils import cpp_extension

        cpp_extension.load(
            name="pagedllm_paged_attention",
            sources=[str(_SOURCE)],
            extra_cflags=_FLAGS,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
    except Exception as exc:  # compiler missing, build error, load error: all mean "use the fallback"
        return f"building {_SOURCE.name} failed: {type(exc).__name__}: {str(exc).strip().splitlines()[-1]}"
    return None


def _op(name: str):
    """The registered operator, building the kernel first if this process has not yet."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"the cpu attention backend is unavailable: {reason}")
    return getattr(torch.ops.pagedllm, name)


@functools.cache
def _one_row_each(num_seqs: int) -> torch.Tensor:
    """query_start_loc of a decode batch (never written to, so shared between calls)."""
    return torch.arange(num_seqs + 1, dtype=torch.int32)


def _as_int32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).contiguous()


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new tokens' K/V ([T, Hkv, D]) into cache slots; slot -1 means skip."""
    _op("write_kv")(
        key.to(k_cache.dtype).contiguous(),
        value.to(v_cache.dtype).contiguous(),
        k_cache,
        v_cache,
        slot_mapping.to(torch.int64).contiguous(),
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
    """Query rows of sequence s are the last rows of its context; causal; see reference.py."""
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    _op("paged_attention")(
        out,
        q.contiguous(),
        k_cache,
        v_cache,
        _as_int32(block_tables),
        _as_int32(query_start_loc),
        _as_int32(context_lens),
        scale,
        sliding_window or 0,
    )
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One query token per sequence: the prefill kernel with one row each."""
    return paged_prefill_attention(
        q, k_cache, v_cache, block_tables, _one_row_each(q.shape[0]), context_lens, scale, sliding_window
    )
