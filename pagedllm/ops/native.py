"""The C++ kernel library in csrc/, built on first use for the CPU's instruction set, cached on disk: the
weight kernels (linear, its panels and rows) that models/ calls, and the ops the `cpu` attention backend
(ops/cpu.py) wraps.

The same sources are compiled once per instruction set (`avx512`: AVX-512 F/BW/VL/DQ, 16 float lanes;
`avx2`: AVX2 + FMA, 8 lanes; `avx512_vnni` / `avx2_vnni` the same plus the VNNI byte dot product that
GGUF blocks' integer matmuls use), each build registering its ops under its own namespace
(torch.ops.pagedllm_avx512, ...), so that a binary never runs on a CPU that lacks its instructions and
tests can load the builds side by side. The best build the CPU can run is chosen at run time (torch's
CPU capability, which honours ATEN_CPU_CAPABILITY, and for VNNI the kernel's CPU flags in /proc/cpuinfo,
which torch does not report; PAGEDLLM_CPU_ISA names one explicitly); if it fails to build, the next one
is used, with one warning. The build goes through torch.utils.cpp_extension (cache under
TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions).
"""

from __future__ import annotations

import functools
import hashlib
import os
import warnings
from pathlib import Path

import torch

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [
    "attention.cpp", "decoder.cpp", "elementwise.cpp", "linear.cpp", "lora.cpp", "register.cpp",
    "sampling.cpp",
]  # fmt: skip
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c", "-DPAGEDLLM_AVX512"]
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
ISA_FLAGS = {
    "avx512_vnni": [*_AVX512, "-mavx512vnni", "-DPAGEDLLM_VNNI"],
    "avx512": _AVX512,
    "avx2_vnni": [*_AVX2, "-mavxvnni", "-DPAGEDLLM_VNNI"],
    "avx2": _AVX2,
}
_VNNI_FLAG = {"avx512_vnni": "avx512_vnni", "avx2_vnni": "avx_vnni"}  # /proc/cpuinfo's name for each
# -fopenmp must also reach the linker, or at::parallel_for runs on one thread. No FMA contraction: an
# a * b + c written as two ops rounds twice, as PyTorch's ops do.
_COMMON_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
ISA_ENV_VAR = "PAGEDLLM_CPU_ISA"
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}
ONEDNN_PACKED = -1  # decoder_layer's group size for a oneDNN-packed weight (csrc/decoder.cpp kOneDNNPacked)


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """The flags the kernel reports for the first CPU (empty where there is no /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def supported_isas() -> list[str]:
    """The instruction sets of ISA_FLAGS this CPU runs, best first."""
    capability = torch.backends.cpu.get_cpu_capability()
    base = {"AVX512": ["avx512", "avx2"], "AVX2": ["avx2"]}.get(capability, [])
    isas = []
    for isa in base:
        vnni = f"{isa}_vnni"
        if _VNNI_FLAG[vnni] in _cpu_flags():
            isas.append(vnni)
        isas.append(isa)
    return isas


@functools.cache
def selected_isa() -> str | None:
    """The build to use: $PAGEDLLM_CPU_ISA if set (it must be supported), else the best supported that
    builds (a better one that fails to build is named in one warning)."""
    supported = supported_isas()
    requested = os.environ.get(ISA_ENV_VAR, "").strip().lower()
    if requested:
        if requested not in ISA_FLAGS:
            raise ValueError(f"{ISA_ENV_VAR}={requested!r} is not one of {sorted(ISA_FLAGS)}")
        if requested not in supported:
            raise ValueError(
                f"{ISA_ENV_VAR}={requested!r}, but this CPU supports only {supported or 'neither'}"
            )
        return requested
    for isa in supported:
        if build_error(isa) is None:
            if isa != supported[0]:
                warnings.warn(f"using the {isa} kernels: {build_error(supported[0])}", stacklevel=2)
            return isa
    return supported[0] if supported else None  # none builds: unavailable_reason says why


def avx512_selected() -> bool:
    """Whether the build in use is one of the AVX-512 ones (16 float lanes)."""
    isa = selected_isa()
    return isa is not None and isa.startswith("avx512")


@functools.cache
def bf16_matmul_available() -> bool:
    """Whether the AVX-512 kernels run and the CPU multiplies bf16 in hardware (AVX512_BF16, which oneDNN's
    bf16 GEMM uses): then GGUF blocks are multiplied in bf16 at many rows (models/quantization.py)."""
    flags = _cpu_flags()
    return avx512_selected() and "avx512_bf16" in flags and onednn_packs_bf16()


def onednn_packs_bf16() -> bool:
    """Whether oneDNN packs and multiplies bf16 weights on this CPU (AVX-512 or AVX-NE-CONVERT; on AVX2-only
    CPUs it refuses to pack them)."""
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


@functools.cache
def blocks_amx() -> bool:
    """Whether the build in use multiplies GGUF blocks' many-row calls on AMX tiles (oneDNN's brgemm on bf16
    panels dequantized in cache, csrc/linear.cpp vnni_blocks_linear), not through the bf16 scratch."""
    return bf16_matmul_available() and kernels().blocks_amx()


@functools.cache
def _sources_digest() -> str:
    """A short hash of the kernel sources: builds of different versions get different cache folders."""
    digest = hashlib.sha256()
    for path in sorted(_CSRC.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:10]


@functools.cache
def build_error(isa: str) -> str | None:
    """Build and load the kernels for one instruction set, once; None on success, else why it failed."""
    try:
        from torch.utils import cpp_extension

        cpp_extension.load(
            name=f"pagedllm_cpu_{isa}_{_sources_digest()}",
            sources=[str(_CSRC / name) for name in _SOURCES],
            extra_cflags=_COMMON_FLAGS + ISA_FLAGS[isa] + [f"-DPAGEDLLM_NAMESPACE=pagedllm_{isa}"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
    except Exception as exc:  # compiler missing, build error, load error: all mean "use the fallback"
        return f"building the {isa} kernels failed: {type(exc).__name__}: {str(exc).strip().splitlines()[-1]}"
    return None


def built_isa() -> str | None:
    """The instruction set of the build in use, or None where the kernels cannot be used."""
    return selected_isa() if unavailable_reason() is None else None


def unavailable_reason() -> str | None:
    """None when the kernels for this CPU are built and loaded, else why they cannot be used."""
    isa = selected_isa()
    if isa is None:
        return f"CPU lacks AVX2 (capability {torch.backends.cpu.get_cpu_capability()})"
    return build_error(isa)


def kernels(isa: str | None = None):
    """The op namespace of one build (default: the selected one), building it first if needed."""
    return _namespace(isa or selected_isa())


@functools.cache
def _namespace(isa: str | None):
    """Cached: every op call goes through here, and a decode step makes hundreds of them."""
    reason = unavailable_reason() if isa is None else build_error(isa)
    if reason is not None:
        raise RuntimeError(f"the cpu kernels are unavailable: {reason}")
    return getattr(torch.ops, f"pagedllm_{isa}")


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor | None = None,
    mins: torch.Tensor | None = None,
    group_size: int = 0,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) (+ residual) for W stored row by row (see csrc/linear.cpp): float32 or
    bf16 [N, K]; int8 [N, K]; or int4 pairs in uint8 [N, K/2], with [N, K/group_size] scales (and mins);
    or float32 in panels (pack_panels), with group_size = N; or GGUF blocks, uint8 [bytes] with `scales`
    an int64 [shards, 2] table of (rows, ggml type) and group_size the rows from which they are
    dequantized to bf16 and multiplied by oneDNN (0: never)."""
    return kernels().linear(x, weight, scales, mins, group_size, bias, residual)


def set_blocks_bf16(enabled: bool) -> bool:
    """Whether this thread's matmuls on GGUF blocks may take the bf16 path at many rows (linear's
    group_size); returns the previous setting (True at start)."""
    return kernels().set_blocks_bf16(enabled)


def set_blocks_invariant(enabled: bool) -> bool:
    """Whether this thread's matmuls on GGUF blocks take their integer path at every row count, a row's
    output bits independent of the rows beside it (over group_size and set_blocks_bf16); returns the
    previous setting (False at start)."""
    return kernels().set_blocks_invariant(enabled)


def set_blocks_int8(enabled: bool) -> bool:
    """Whether this thread's matmuls on Q4_K / Q6_K blocks round x to int8 on their integer path (one scale
    per 256 values, llama.cpp's q8_K), else to int16; returns the previous setting (True at start)."""
    return kernels().set_blocks_int8(enabled)


PANEL_COLS = 48  # csrc/linear.cpp kPanelCols


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """A float32 W [N, K] as linear's panels: [ceil(N / 48), K, 48], panel p holding W's rows 48p ..
    48p + 47 side by side (zeros past N), one column of W after another."""
    n, k = weight.shape
    panels = -(-n // PANEL_COLS)
    if n % PANEL_COLS:  # a copy only where rows must be added
        weight = torch.nn.functional.pad(weight, (0, 0, 0, panels * PANEL_COLS - n))
    return weight.reshape(panels, PANEL_COLS, k).transpose(1, 2).contiguous()


def panel_rows(panels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the W that pack_panels packed, as a [len(ids), K] float32 tensor."""
    return panels[ids // PANEL_COLS, :, ids % PANEL_COLS]


def dequantize_rows(
    weight: torch.Tensor,
    scales: torch.Tensor | None,
    mins: torch.Tensor | None,
    group_size: int,
    ids: torch.Tensor,
    dtype: torch.dtype,
    cols: int | None = None,
) -> torch.Tensor:
    """Rows `ids` of W (stored as for linear) as a [len(ids), K] tensor of `dtype` (an embedding lookup);
    `cols` (K) is needed for GGUF blocks only."""
    if cols is None:
        cols = weight.shape[1] * (2 if weight.dtype == torch.uint8 else 1)
    out = torch.empty(ids.shape[0], cols, dtype=dtype)
    kernels().dequantize_rows(out, weight, scales, mins, group_size, ids.to(torch.int64).contiguous())
    return out
