"""Linear layers, and the methods that decide how a layer's weight is stored and multiplied.

A layer says what it computes (y = x W^T + b, optionally + a residual) and which checkpoint rows it
holds; a LinearMethod, chosen once when the model is loaded, decides the storage and the kernel:

  DenseLinear   the weight as loaded, torch's F.linear / addmm (any device and dtype; the reference)
  OneDNNLinear  CPU float32 / bfloat16: the weight reordered once into oneDNN's blocked layout, multiplied
                by oneDNN through torch's mkldnn ops, the residual add fused into the matmul

`PAGEDLLM_LINEAR_METHOD=dense|onednn` overrides the choice (for comparisons).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

LINEAR_METHOD_ENV_VAR = "PAGEDLLM_LINEAR_METHOD"


class Linear(nn.Module):
    """y = x W^T (+ b) (+ residual). W starts uninitialised: the loader fills it, then the method
    prepares it (process) and multiplies by it (apply)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.method: LinearMethod = DenseLinear()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.method.apply(self, x, residual)


class MergedLinear(Linear):
    """Several projections of the same input as one matmul (e.g. q, k, v); shards are stacked by rows.

    `shards` maps each checkpoint projection name to its output size, in order; the loader fills the rows.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool):
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shards = shards


class LinearMethod:
    """How a Linear layer's weight is stored (process, once after loading) and multiplied (apply)."""

    name = "base"

    def process(self, layer: Linear) -> None:
        """Turn the loaded layer.weight into this method's storage."""

    def apply(self, layer: Linear, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class DenseLinear(LinearMethod):
    """The weight as loaded, multiplied by torch (F.linear, or addmm when a residual is added)."""

    name = "dense"

    def apply(self, layer: Linear, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if residual is None:
            return F.linear(x, layer.weight, layer.bias)
        if layer.bias is None:
            return torch.addmm(residual, x, layer.weight.t())
        return F.linear(x, layer.weight, layer.bias) + residual


class OneDNNLinear(LinearMethod):
    """oneDNN on a weight reordered once into its blocked layout (torch's mkldnn linear ops, as inductor's
    weight freezing uses them). At decode batch sizes this is 1.3-1.9x plain F.linear here (BENCHMARKS.md)."""

    name = "onednn"

    def process(self, layer: Linear) -> None:
        # Replaces the parameter; a weight shared with the embedding (tied LM head) stays alive there.
        layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach())
        del layer.weight

    def apply(self, layer: Linear, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        x = x.contiguous()
        if residual is None:
            return torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, layer.bias, "none", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, layer.packed_weight, layer.bias, "add")


LINEAR_METHODS: dict[str, type[LinearMethod]] = {"dense": DenseLinear, "onednn": OneDNNLinear}


def default_linear_method(device: torch.device | str, dtype: torch.dtype) -> LinearMethod:
    """oneDNN for float32 / bfloat16 on a CPU with mkldnn, else dense; $PAGEDLLM_LINEAR_METHOD overrides."""
    requested = os.environ.get(LINEAR_METHOD_ENV_VAR, "").strip().lower()
    if requested:
        if requested not in LINEAR_METHODS:
            raise ValueError(f"{LINEAR_METHOD_ENV_VAR}={requested!r} is not one of {sorted(LINEAR_METHODS)}")
        return LINEAR_METHODS[requested]()
    onednn = torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available()
    if onednn and dtype in (torch.float32, torch.bfloat16):
        return OneDNNLinear()
    return DenseLinear()


def process_linear_layers(model: nn.Module, method: LinearMethod) -> None:
    """Hand every Linear of a loaded model to `method`, which prepares its weight."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.method = method
            method.process(module)
