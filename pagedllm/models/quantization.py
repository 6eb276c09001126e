"""Weight-only quantization: the LinearMethods that keep a layer's weight as int8 or int4 codes with
per-group scales, multiplied by pagedllm's C++ kernel (ops/csrc/linear.cpp) with float32 sums.

  int8   symmetric, one scale per output row (gpt-fast's int8 weight-only form): W = s_n * q, q in -127..127
  int4   asymmetric groups of 32 columns (Q4_1's form): W = s * q + m, q in 0..15, s and m float16;
         the LM head (and so a tied embedding) int8
  gguf   a GGUF file's own blocks (Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K), kept as the file stores them
         (the kernel unpacks them in registers: ops/csrc/quants.h); a fused projection's shards, which may
         differ in type, one after another in one buffer; the values multiplied are the file's, bit for bit

Why not torch's own weight-only ops: on this machine's CPU, `_weight_int8pack_mm` and
`_weight_int4pack_mm_for_cpu` run 1-2 GFLOP/s with float32 activations (unvectorised) and at one row
far below the memory bandwidth with bf16 ones; fbgemm's `quantized::linear_dynamic` is fast but
quantizes the activations too. `pagedllm bench linear` measures them all side by side.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType

from pagedllm.models.gguf_quants import KEPT_TYPES, GGUFBlocks
from pagedllm.models.linear import (
    KernelLinear,
    Linear,
    LinearMethod,
    StoredWeight,
    default_linear_method,
)
from pagedllm.models.parallel import LMHead
from pagedllm.ops import native

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("int8", "int4", "gguf")
INT4_GROUP = 32
# How a GGUF layer multiplies many rows: "fast" (the default), the many-row paths measured fastest (bf16 /
# AMX panels, float32 panels), whose rounding depends on the step's row count; "invariant", the blocks'
# integer path at every row count, a row's output bits the same whatever else the step computes (alone,
# batched, after preemption), as vLLM's VLLM_BATCH_INVARIANT opts in. Without AMX, "fast" with the default
# x already keeps the integer path of Q4_K / Q6_K and of the 32-value types at every row count
# (GGUFLinear.integer_tile_types), batch invariant: so "invariant" changes only AMX CPUs, Q5_K, and x rounded
# as the exact path does (docs/kernels.md, "The numeric contract of GGUF blocks").
GGUF_PATHS_ENV_VAR = "PAGEDLLM_GGUF_PATHS"
GGUF_PATHS = ("invariant", "fast")
# How the integer path rounds x: "int8" (the default), Q4_K / Q6_K's x to int8 with one scale per 256 values
# as llama.cpp's q8_K, the arithmetic behind every published GGUF perplexity, and the 32-value types' to int16
# per 256 (their batch-invariant contract); "int16", the exact path, whose greedy tokens follow the float32
# weights' (the transformers equality tests pin it): Q4_K / Q6_K's x int16 per 256, the others' per 32.
GGUF_ACTIVATIONS_ENV_VAR = "PAGEDLLM_GGUF_ACTIVATIONS"
GGUF_ACTIVATIONS = ("int8", "int16")


def _choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """$name, lower-cased (`default` where unset), or a ValueError naming it where it is not in choices."""
    value = os.environ.get(name, "").strip().lower() or default
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {list(choices)}")
    return value


@functools.cache
def gguf_paths() -> str:
    """$PAGEDLLM_GGUF_PATHS (default "fast"), read once a process."""
    return _choice(GGUF_PATHS_ENV_VAR, GGUF_PATHS, "fast")


@functools.cache
def gguf_activations() -> str:
    """$PAGEDLLM_GGUF_ACTIVATIONS (default "int8"), read once a process."""
    return _choice(GGUF_ACTIVATIONS_ENV_VAR, GGUF_ACTIVATIONS, "int8")


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0..15 -> [N, K / 2] uint8: in each run of 32 columns, byte i holds column i (low
    nibble) and column i + 16 (high nibble)."""
    n, k = q.shape
    runs = q.to(torch.uint8).reshape(n, k // 32, 2, 16)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(n, k // 2)


def quantize_int8(w: torch.Tensor) -> StoredWeight:
    """Symmetric per-row int8: scale = max |w| / 127."""
    w = w.float()
    scales = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w / scales).clamp(-127, 127).to(torch.int8)
    return StoredWeight(q, scales, None, w.shape[1])


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> StoredWeight:
    """Asymmetric int4 in groups of `group` columns: min and (max - min) / 15, stored as float16."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"int4 quantization needs in_features divisible by {group}, got {k}")
    groups = w.float().reshape(n, k // group, group)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales, mins = ((high - low) / 15).half(), low.half()
    step = torch.where(scales > 0, scales, 1).float()
    q = torch.round((groups - mins.float()[..., None]) / step[..., None]).clamp(0, 15)
    return StoredWeight(pack_int4(q.reshape(n, k)), scales, mins, group)


class Int8Linear(KernelLinear):
    name = "int8"

    def store(self, layer: Linear) -> StoredWeight:
        return quantize_int8(layer.weight.detach())


class Int4Linear(KernelLinear):
    """int4 decoder layers; the LM head (and so a tied embedding) int8, as llama.cpp's 4-bit files keep
    theirs at 6-8 bits."""

    name = "int4"

    def store(self, layer: Linear) -> StoredWeight:
        if isinstance(layer, LMHead):
            return quantize_int8(layer.weight.detach())
        return quantize_int4(layer.weight.detach())


class GGUFLinear(KernelLinear):
    """A GGUF file's quantized blocks, kept: each checkpoint shard is held as loaded (mapped from the file,
    not yet read), and when the layer is processed its shards' bytes are read once into one buffer, in
    row order, as the kernel reads them.

    With gguf_paths() "invariant" every call takes the blocks' integer path at any number of rows (the
    model runner sets it per step: bf16_gate), a row's bits independent of the rows beside it. By default
    ("fast"), on a CPU that multiplies bf16 (AVX512_BF16, an AVX-512 build), a call of at least `bf16_rows`
    rows (a prefill, a big batch) of a type without an integer tile has its weight dequantized into a shared
    bf16 scratch and multiplied by oneDNN's bf16 GEMM (csrc/linear.cpp bf16_blocks_linear): about twice the
    integer and float32 paths' speed there, at a bf16 model's rounding. Fewer rows keep the blocks' integer
    path, and so do the rows of a step that computes no prompt tokens, however many (takes_bf16). On a CPU
    with AMX (native.blocks_amx) the bf16 path instead dequantizes the weight panel by panel in cache and
    multiplies with AMX tiles into float32 sums (vnni_blocks_linear), for every type: from fewer rows
    (AMX_ROWS), and for decode steps too (takes_bf16)."""

    name = "gguf"
    STREAM_ROWS = 16  # csrc/linear.cpp kBlockStreamRows
    # Types whose integer path has a many-row tile (csrc/linear.cpp byte_tile) faster than bf16 where bf16
    # runs without AMX (AVX-512 VNNI): they keep it at every row count, batch invariant on the default path
    # (docs/JOURNAL.md, session 28).
    INTEGER_TILE_TYPES = frozenset({GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K})
    # The 32-value types, whose tile (csrc/linear.cpp pair_tile) runs slower than bf16 at the kernel but
    # keeps a row's bits at any row count with the default x: kept there too (one user's prefill measured
    # level with bf16's: docs/BENCHMARKS.md I23). With the exact path's x they switch to bf16 as Q5_K does,
    # as soon as their streamed path ends.
    PAIR_TILE_TYPES = frozenset(
        {
            GGMLQuantizationType.Q4_0,
            GGMLQuantizationType.Q4_1,
            GGMLQuantizationType.Q5_0,
            GGMLQuantizationType.Q5_1,
            GGMLQuantizationType.Q8_0,
        }
    )
    # On AMX, for every type (docs/JOURNAL.md, "GGUF blocks on AMX", "Session 10: the panel as brgemm's
    # A"): with no whole-weight scratch and the panel filled row-major the panels pass the integer path at
    # 8-10 rows.
    AMX_ROWS = 10

    def create_weights(self, layer: Linear) -> None:
        layer.params_dtype = layer.weight.dtype
        del layer.weight  # never materialised: the blocks arrive in load_weight
        layer.gguf_shards = {}

    def load_weight(self, layer: Linear, row: int, tensor) -> None:
        layer.gguf_shards[row] = tensor if isinstance(tensor, GGUFBlocks) else tensor.float()

    def store(self, layer: Linear) -> StoredWeight:
        shards = [layer.gguf_shards.pop(row) for row in sorted(layer.gguf_shards)]
        del layer.gguf_shards
        if not all(isinstance(s, GGUFBlocks) for s in shards):  # a float shard: the layer stays float, exact
            dense = [s.dequantize() if isinstance(s, GGUFBlocks) else s for s in shards]
            return StoredWeight(torch.cat(dense).to(layer.params_dtype))
        return blocks_storage(shards, self.bf16_rows(shards))

    def bf16_rows(self, shards: list[GGUFBlocks]) -> int:
        """The rows from which the layer is multiplied in bf16 (the largest of its shards' types), or 0:
        never, where the CPU does not multiply bf16 or the paths are "invariant"."""
        if gguf_paths() == "invariant" or not native.bf16_matmul_available():
            return 0
        if native.blocks_amx():
            return self.AMX_ROWS
        if all(s.qtype in self.integer_tile_types() for s in shards):
            return 0
        return self.STREAM_ROWS + 1

    @classmethod
    def integer_tile_types(cls) -> frozenset[GGMLQuantizationType]:
        """The types that keep their integer path at every row count on the default paths, without AMX."""
        if gguf_activations() == "int8":
            return cls.INTEGER_TILE_TYPES | cls.PAIR_TILE_TYPES
        return cls.INTEGER_TILE_TYPES


def gates_many_rows(model: torch.nn.Module) -> bool:
    """Whether the runner must set its thread's GGUF settings per step (bf16_gate, takes_bf16): where a GGUF
    layer of `model` has a many-row path whose sums for a row change with the rows beside it (with
    "invariant" paths every GGUF layer: the 32-value types' float panels; with "fast" the bf16 path,
    GGUFLinear.bf16_rows), or where x is rounded otherwise than the kernels' default (gguf_activations
    int16, which with the AVX2 kernels also takes the K types' float panels, csrc/linear.cpp
    kNarrowIntegerRows)."""
    layers = [m for m in model.modules() if isinstance(getattr(m, "method", None), GGUFLinear)]
    blocks = [m for m in layers if m.stored.format == "gguf"]
    if gguf_paths() == "invariant" or gguf_activations() != "int8":
        return bool(blocks)
    return any(m.stored.group_size > 0 for m in blocks)


def takes_bf16(computes_prompt: bool, max_query_len: int) -> bool:
    """Whether a step's GGUF layers may take their bf16 path (with AVX2 and int16 x, their K types' float
    panels) at many rows: never with "invariant" paths (gguf_paths); with "fast", a step that computes prompt
    tokens (a prefill, or a chunk of one beside decodes); on AMX (native.blocks_amx) also a decode step of one
    row a sequence, where the panels cost a batch less than the integer path from as many rows as a prompt's
    call (docs/JOURNAL.md, "GGUF blocks on AMX"). Never a step of decode rows with drafts: speculation's
    verify passes keep the blocks' integer path, so that its greedy tokens are those a sequence decoded alone
    (or in a batch below AMX_ROWS) gets."""
    if gguf_paths() == "invariant":
        return False
    return computes_prompt or (max_query_len == 1 and native.blocks_amx())


@contextlib.contextmanager
def bf16_gate(enabled: bool) -> Iterator[None]:
    """Within it, this thread's GGUF layers take their bf16 path at many rows only if `enabled`
    (takes_bf16), with "invariant" paths (gguf_paths) their integer path at every row count, and round x
    as gguf_activations says."""
    previous = native.set_blocks_bf16(enabled)
    previous_invariant = native.set_blocks_invariant(gguf_paths() == "invariant")
    previous_int8 = native.set_blocks_int8(gguf_activations() == "int8")
    try:
        yield
    finally:
        native.set_blocks_bf16(previous)
        native.set_blocks_invariant(previous_invariant)
        native.set_blocks_int8(previous_int8)


def gguf_kernels() -> str:
    """The GGUF blocks' paths on this CPU, in words (for the log line of linear_method_for)."""
    default_x = gguf_activations() == "int8"
    x = f"x as {gguf_activations()} per 256 values for Q4_K / Q6_K"
    if gguf_paths() == "invariant" or default_x:
        x += ", int16 per 256 for the 32-value types"
    if gguf_paths() == "invariant":
        return f"GGUF blocks: integer path at every row count ({x}, per 32 for Q5_K), batch invariant"
    x += ", int16 per 32 for the others"
    many = "float32 panels"
    if native.bf16_matmul_available():
        many = "AMX bf16 panels" if native.blocks_amx() else "bf16 oneDNN"
    tiles = ""
    if default_x and not native.blocks_amx():
        tiles = "; Q4_K / Q6_K and the 32-value types the integer path at every row count"
    return (
        f"GGUF blocks: integer path at few rows ({x}), {many} at many{tiles} "
        "(fast: the others' rounding depends on the batch)"
    )


@functools.cache
def log_linear_kernels(method: str) -> None:
    """Logs the linear kernels' choice once a process (per method chosen)."""
    detail = gguf_kernels() if method == "gguf" else f"{method} weights"
    logger.info("pagedllm: linear kernels: ISA %s; %s", native.selected_isa(), detail)


def blocks_storage(shards: list[GGUFBlocks], bf16_rows: int = 0) -> StoredWeight:
    """Row-stacked GGUF shards as the kernel's storage: their bytes one after another (uint8 [bytes], the
    file's size exactly), an int64 [shards, 2] table of (rows, ggml type) in place of scales, and as the
    group size the rows from which the kernel multiplies them in bf16 (0: never)."""
    for shard in shards:
        if shard.qtype not in KEPT_TYPES:
            raise ValueError(
                f"GGUF type {shard.qtype.name} is not kept quantized (kept: "
                f"{', '.join(sorted(t.name for t in KEPT_TYPES))}); load with quantization=None"
            )
    data = np.concatenate([s.raw.reshape(-1) for s in shards])  # a copy: each shard's map is let go
    layout = torch.tensor([[s.raw.shape[0], int(s.qtype)] for s in shards], dtype=torch.int64)
    return StoredWeight(torch.from_numpy(data), layout, group_size=bf16_rows)


_METHODS: dict[str, type[LinearMethod]] = {"int8": Int8Linear, "int4": Int4Linear, "gguf": GGUFLinear}


def linear_method_for(
    quantization: str | None,
    device: torch.device | str,
    dtype: torch.dtype,
    gguf: bool,
    max_num_seqs: int | None = None,
) -> LinearMethod:
    """The LinearMethod for a `quantization` setting: "auto" keeps a GGUF file's own blocks where the CPU
    kernels run (the weights a GGUF user chose) and leaves other checkpoints unquantized; None / "none"
    loads unquantized weights in `dtype` (default_linear_method, which weighs `max_num_seqs`); "int8" /
    "int4" quantize at load time; "gguf" keeps the blocks."""

    def unusable() -> str | None:
        """Why the quantized kernels cannot serve this device and dtype, or None."""
        if torch.device(device).type != "cpu":
            return f"they run on the CPU, not on {device!r}"
        if dtype not in (torch.float32, torch.bfloat16):
            return f"they take float32 or bfloat16 activations, not {dtype}"
        return native.unavailable_reason()

    if quantization == "auto":
        quantization = "gguf" if gguf and unusable() is None else None
    if quantization in (None, "none"):
        method = default_linear_method(device, dtype, max_num_seqs)
        if torch.device(device).type == "cpu":
            log_linear_kernels(method.name)
        return method
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be 'auto', None or one of {list(QUANTIZATIONS)}, got {quantization!r}"
        )
    if (reason := unusable()) is not None:
        raise ValueError(f"quantization={quantization!r} needs pagedllm's CPU kernels: {reason}")
    if quantization == "gguf" and not gguf:
        raise ValueError("quantization='gguf' keeps a GGUF file's blocks: the model must be a .gguf file")
    log_linear_kernels(quantization)
    return _METHODS[quantization]()
