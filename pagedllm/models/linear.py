"""Linear layers, and the methods that decide how a layer's weight is stored and multiplied.

A layer says what it computes (y = x W^T + b, optionally + a residual) and which checkpoint rows it
holds; a LinearMethod, chosen once when the model is loaded, decides the storage and the kernel:

  DenseLinear    the weight as loaded, torch's F.linear / addmm (any device and dtype; the reference)
  OneDNNLinear   CPU float32 / bfloat16: the weight reordered once into oneDNN's blocked layout, multiplied
                 by oneDNN through torch's mkldnn ops, the residual add fused into the matmul
  KernelLinear   CPU: the weight on huge pages, multiplied by pagedllm's C++ kernel (ops/csrc/linear.cpp):
                 float32 packed in panels of 48 columns under register tiles at any number of rows, bf16
                 kept row by row and streamed for the few rows of a decode step: one copy of the weight
  Int8Linear, Int4Linear, GGUFLinear (quantization.py): the same kernel on weight-only int8 / int4 storage

The loader hands each layer's checkpoint tensors to its method (load_weight), then lets the method turn
them into its storage (process). A tied LM head also serves the token embedding (embedding).
`PAGEDLLM_LINEAR_METHOD=dense|onednn|kernel` overrides the unquantized choice (for comparisons).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.ops import KernelWeight, native

logger = logging.getLogger(__name__)

LINEAR_METHOD_ENV_VAR = "PAGEDLLM_LINEAR_METHOD"


class OutputUpdate(Protocol):
    """What may add to a linear layer's output after its matmul (models/lora.py's LoRATarget)."""

    def add(self, y: torch.Tensor, x: torch.Tensor) -> None: ...


class Linear(nn.Module):
    """y = x W^T (+ b) (+ residual). W starts uninitialised: the loader fills it through the method, then
    the method prepares it (process) and multiplies by it (apply)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.method: LinearMethod = DenseLinear()
        self.serves_embedding = False  # a tied LM head: its weight is the token embedding table too
        self.lora: OutputUpdate | None = None  # where LoRA adapters may update the output (models/lora.py)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.matmul(x, residual)

    def matmul(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """x W^T (+ b) (+ residual) by the method, then the step's LoRA updates of their rows (if any)."""
        y = self.method.apply(self, x, residual)
        if self.lora is not None:
            self.lora.add(y, x)
        return y


class MergedLinear(Linear):
    """Several projections of the same input as one matmul (e.g. q, k, v); shards are stacked by rows.

    `shards` maps each checkpoint projection name to its output size, in order; the loader fills the rows.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool):
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shards = shards


class LinearMethod:
    """How a Linear layer's weight is loaded (load_weight), stored (process, once after loading) and
    multiplied (apply); `embedding` reads rows of it for a tied token embedding."""

    name = "base"

    def create_weights(self, layer: Linear) -> None:
        """Before loading: make the layer ready to receive checkpoint tensors (default: its dense weight)."""

    def load_weight(self, layer: Linear, row: int, tensor) -> None:
        """Copy a checkpoint tensor into the weight's rows [row, row + len(tensor)); a still-quantized one
        (GGUF blocks) is dequantized first."""
        tensor = dense_tensor(tensor)
        with torch.no_grad():
            layer.weight[row : row + tensor.shape[0]].copy_(tensor)

    def process(self, layer: Linear) -> None:
        """Turn the loaded layer into this method's storage."""

    def apply(self, layer: Linear, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def embedding(self, layer: Linear, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W (a tied LM head serving as the token embedding)."""
        return F.embedding(ids, layer.weight)

    def tensors(self, layer: Linear) -> list[torch.Tensor]:
        """The tensors holding the layer's weight in this method's storage (for memory accounting)."""
        return [layer.weight]

    def take_rows(self, layer: Linear, ids: torch.Tensor, into: Linear) -> None:
        """Give `into` rows `ids` of the processed layer's weight, in this method's storage."""
        into.weight = nn.Parameter(layer.weight.detach()[ids], requires_grad=False)

    def kernel_args(self, layer: Linear) -> KernelWeight | None:
        """The layer as the C++ kernels take it (a backend's one-call decoder layer); None: this method's
        storage is not theirs."""
        return None


def dense_tensor(tensor) -> torch.Tensor:
    """A checkpoint tensor as a torch tensor: a still-quantized one (with .dequantize(), e.g. GGUF blocks)
    dequantized."""
    return tensor if isinstance(tensor, torch.Tensor) else tensor.dequantize()


class DenseLinear(LinearMethod):
    """The weight as loaded, multiplied by torch (F.linear, or addmm when a residual is added)."""

    name = "dense"

    def apply(self, layer: Linear, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return dense_linear(x, layer.weight, layer.bias, residual)


def dense_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None
) -> torch.Tensor:
    """x W^T (+ bias) (+ residual) by torch."""
    if residual is None:
        return F.linear(x, weight, bias)
    if bias is None:
        return torch.addmm(residual, x, weight.t())
    return F.linear(x, weight, bias) + residual


class OneDNNLinear(LinearMethod):
    """oneDNN on a weight reordered once into its blocked layout (torch's mkldnn linear ops, as inductor's
    weight freezing uses them). A tied LM head keeps its plain weight too, for the embedding lookups."""

    name = "onednn"

    def process(self, layer: Linear) -> None:
        layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach())
        if not layer.serves_embedding:
            del layer.weight

    def apply(self, layer: Linear, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        x = x.contiguous()
        if residual is None:
            return torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, layer.bias, "none", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, layer.packed_weight, layer.bias, "add")

    def tensors(self, layer: Linear) -> list[torch.Tensor]:
        return [layer.packed_weight, *([layer.weight] if hasattr(layer, "weight") else [])]

    def take_rows(self, layer: Linear, ids: torch.Tensor, into: Linear) -> None:
        dense = layer.weight if hasattr(layer, "weight") else layer.packed_weight.to_dense()
        into.packed_weight = torch.ops.mkldnn._reorder_linear_weight(dense.detach()[ids].contiguous())

    def kernel_args(self, layer: Linear) -> KernelWeight:
        """The layer as the one-call decoder layer takes it (csrc/decoder.cpp): the packed weight and the
        bias, group size native.ONEDNN_PACKED."""
        return layer.packed_weight, None, None, native.ONEDNN_PACKED, layer.bias


@dataclass
class StoredWeight:
    """A weight as pagedllm's C++ linear kernel reads it (ops/csrc/linear.cpp): `data` is W [N, K] in
    float32 / bf16, or int8 [N, K], or int4 pairs in uint8 [N, K / 2]; quantized data has [N, K / group_size]
    scales (float32 or float16) and, for int4 or offset int8, mins. float32 in panels (native.pack_panels) is
    [ceil(N / 48), K, 48] with group_size = N. GGUF blocks are uint8 [bytes] with `scales` the int64
    [shards, 2] table of each shard's (rows, ggml type) and group_size the rows of x from which the kernel
    multiplies them in bf16 (0: never; quantization.GGUFLinear)."""

    data: torch.Tensor
    scales: torch.Tensor | None = None
    mins: torch.Tensor | None = None
    group_size: int = 0

    @property
    def format(self) -> str:
        if self.data.dim() == 1:
            return "gguf"
        return {torch.int8: "int8", torch.uint8: "int4"}.get(self.data.dtype, str(self.data.dtype)[6:])

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.data, self.scales, self.mins) if t is not None]

    def with_tensors(self, tensors: list[torch.Tensor]) -> StoredWeight:
        """The same weight with its tensors replaced (same order as tensors())."""
        it = iter(tensors)
        data = next(it)
        scales = next(it) if self.scales is not None else None
        mins = next(it) if self.mins is not None else None
        return StoredWeight(data, scales, mins, self.group_size)


class KernelLinear(LinearMethod):
    """The weight as a StoredWeight, multiplied by pagedllm's C++ kernel (ops/csrc/linear.cpp) at any
    number of rows. This class stores the float weight as it is, float32 packed in panels of 48 columns
    (register tiles of up to 8 rows by 48 columns, the panel streamed once from memory); subclasses
    quantize it (streamed once for a decode step's few rows, register tiles over a panel converted in
    cache for many). A tied LM head's embedding lookups read the same storage.

    bf16 weights at more rows than the kernel streams go to torch's matmul (oneDNN's AVX512-BF16 GEMM,
    on the same plain weight; the C++ op makes that choice), which float32 arithmetic cannot match."""

    name = "kernel"
    STREAM_ROWS = 4  # csrc/linear.cpp kStreamRows

    def store(self, layer: Linear) -> StoredWeight:
        """The layer's storage, built from its loaded weight."""
        return StoredWeight(layer.weight.detach())

    def process(self, layer: Linear) -> None:
        if hasattr(layer, "weight"):
            layer.params_dtype = layer.weight.dtype  # what the layer computes in: x and out, embedding rows
        stored = self.store(layer)
        if stored.data.dtype == torch.float32:  # in panels: register tiles at any number of rows
            stored = StoredWeight(native.pack_panels(stored.data), group_size=stored.data.shape[0])
        layer.stored = stored
        if hasattr(layer, "weight"):
            del layer.weight

    def apply(self, layer: Linear, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return native.linear(x, *self.kernel_args(layer), residual)

    def kernel_args(self, layer: Linear) -> KernelWeight:
        """(data, scales, mins, group_size, bias): the layer as the C++ kernel takes it."""
        w = layer.stored
        return w.data, w.scales, w.mins, w.group_size, layer.bias

    def embedding(self, layer: Linear, ids: torch.Tensor) -> torch.Tensor:
        w = layer.stored
        if w.data.dim() == 3:  # float32 panels: a strided gather, no copy of the table
            return native.panel_rows(w.data, ids)
        return native.dequantize_rows(
            w.data, w.scales, w.mins, w.group_size, ids, layer.params_dtype, cols=layer.in_features
        )

    def tensors(self, layer: Linear) -> list[torch.Tensor]:
        return layer.stored.tensors()

    def take_rows(self, layer: Linear, ids: torch.Tensor, into: Linear) -> None:
        w = layer.stored
        if w.format == "gguf":
            into.stored = _gguf_rows(w, ids, layer.in_features)
        elif w.data.dim() == 3:  # float32 panels
            into.stored = StoredWeight(
                native.pack_panels(native.panel_rows(w.data, ids)), group_size=len(ids)
            )
        else:  # one stored row per weight row, and its scales' and mins' rows
            into.stored = w.with_tensors([t[ids].contiguous() for t in w.tensors()])
        into.params_dtype = layer.params_dtype


def _gguf_rows(w: StoredWeight, ids: torch.Tensor, cols: int) -> StoredWeight:
    """Rows `ids` (ascending) of GGUF blocks: each shard's rows among them, still in its blocks."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    pieces, layout, first, offset = [], [], 0, 0
    for rows, qtype in w.scales.tolist():
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        row_bytes = cols // block * size
        mine = ids[(ids >= first) & (ids < first + rows)] - first
        if len(mine):
            pieces.append(w.data[offset : offset + rows * row_bytes].view(rows, row_bytes)[mine].reshape(-1))
            layout.append([len(mine), qtype])
        first, offset = first + rows, offset + rows * row_bytes
    return StoredWeight(torch.cat(pieces), torch.tensor(layout, dtype=torch.int64))


LINEAR_METHODS: dict[str, type[LinearMethod]] = {
    "dense": DenseLinear,
    "onednn": OneDNNLinear,
    "kernel": KernelLinear,
}


def default_linear_method(
    device: torch.device | str, dtype: torch.dtype, max_num_seqs: int | None = None
) -> LinearMethod:
    """For unquantized weights on the CPU: float32 on an AVX-512 CPU, pagedllm's kernel on its panels
    (its register tiles feed each loaded weight to several rows, which beats or matches oneDNN's
    prepacked GEMM at a batched decode's row counts and a prefill's); else oneDNN's prepacked GEMM, but
    where a decode step never holds more than KernelLinear.STREAM_ROWS sequences (`max_num_seqs`: one user
    chatting), the kernel, which streams a weight at one row at the memory's rate. Dense elsewhere;
    $PAGEDLLM_LINEAR_METHOD overrides. `pagedllm bench linear` measures each choice (docs/JOURNAL.md,
    "float32 in panels" and "One user")."""
    requested = os.environ.get(LINEAR_METHOD_ENV_VAR, "").strip().lower()
    if requested:
        if requested not in LINEAR_METHODS:
            raise ValueError(f"{LINEAR_METHOD_ENV_VAR}={requested!r} is not one of {sorted(LINEAR_METHODS)}")
        return LINEAR_METHODS[requested]()
    if torch.device(device).type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return DenseLinear()
    kernels = native.unavailable_reason() is None
    if kernels and (few_rows(max_num_seqs) or (dtype == torch.float32 and native.avx512_selected())):
        return KernelLinear()
    if dtype == torch.bfloat16 and not native.onednn_packs_bf16():  # torch's own bf16 matmul works, slowly
        logger.warning(
            "bfloat16 weights on a CPU without bf16 instructions for oneDNN: batched matmuls take torch's "
            "generic bf16 path, several times slower than float32 (dtype='float32' is faster here)"
        )
        return KernelLinear() if kernels else DenseLinear()
    return OneDNNLinear() if torch.backends.mkldnn.is_available() else DenseLinear()


def few_rows(max_num_seqs: int | None) -> bool:
    """Whether every decode step multiplies few enough rows for the kernel's streaming regime."""
    return max_num_seqs is not None and max_num_seqs <= KernelLinear.STREAM_ROWS


def take_rows(layer: Linear, ids: torch.Tensor) -> Linear:
    """A Linear computing outputs `ids` (ascending, distinct) of the processed `layer`: its weight's rows
    (and bias entries) in the layer's own storage, a quantized weight still quantized (a draft model's LM
    head over part of the vocabulary)."""
    if len(ids) == 0 or not bool((ids[1:] > ids[:-1]).all()) or ids[0] < 0 or ids[-1] >= layer.out_features:
        bound = layer.out_features
        raise ValueError(f"take_rows needs distinct ascending row ids in [0, {bound}), got {ids}")
    rows = Linear(layer.in_features, len(ids), bias=False)
    del rows.weight
    rows.method = layer.method
    if layer.bias is not None:
        rows.bias = nn.Parameter(layer.bias.detach()[ids], requires_grad=False)
    layer.method.take_rows(layer, ids, rows)
    return rows


def linear_layers(model: nn.Module) -> list[Linear]:
    return [m for m in model.modules() if isinstance(m, Linear)]


def set_linear_method(model: nn.Module, method: LinearMethod) -> None:
    """Before loading: every Linear of the model is stored and multiplied by `method`."""
    for layer in linear_layers(model):
        layer.method = method
        method.create_weights(layer)


PACK_BYTES = 64 << 20  # storage goes onto huge pages in buffers of at least this (held twice while filled)


def process_linear_layers(model: nn.Module, method: LinearMethod | None = None) -> None:
    """After loading: each Linear's method prepares its storage (`method`, if given, is set first), in
    model order. The C++ kernel's storage moves as it is made onto huge pages, layers one after another
    in buffers of at least PACK_BYTES, each batch's own copy freed before the next batch is made: a
    model's storage is never held twice (the allocator would keep the freed copies' pages)."""
    from pagedllm.ops.memory import huge_pages_available

    batch: list[Linear] = []
    for layer in linear_layers(model):
        if method is not None:
            layer.method = method
        layer.method.process(layer)
        if hasattr(layer, "stored") and huge_pages_available():
            batch.append(layer)
            if sum(t.nbytes for layer in batch for t in layer.stored.tensors()) >= PACK_BYTES:
                _move_to_huge_pages(batch)
                batch = []
    _move_to_huge_pages(batch)


def _move_to_huge_pages(layers: list[Linear]) -> None:
    """The layers' storage, copied into one huge-page buffer in order, replaces their own."""
    from pagedllm.ops.memory import pack_on_huge_pages

    if layers:
        copies = iter(pack_on_huge_pages([t for layer in layers for t in layer.stored.tensors()]))
        for layer in layers:
            layer.stored = layer.stored.with_tensors([next(copies) for _ in layer.stored.tensors()])


def weight_bytes(model: nn.Module) -> int:
    """Bytes of memory holding the model's weights: parameters, buffers and the linear methods' storage,
    each underlying buffer counted once (so a tied weight, or the shared huge-page buffer, counts once)."""
    tensors = [*model.parameters(), *model.buffers()]
    for layer in linear_layers(model):
        tensors += layer.method.tensors(layer)
    seen, total = set(), 0
    for t in tensors:
        if t.is_mkldnn:  # opaque: no storage to share
            total += t.numel() * t.element_size()
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total
