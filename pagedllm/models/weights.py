"""Copy checkpoint tensors (Hugging Face names) into a model's parameters, fused projections included.

Under tensor parallelism a layer holds part of a checkpoint tensor: its `checkpoint_part(pname, shard)`
says which (models/parallel.py), and only that part is copied.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedllm.models.linear import Linear, MergedLinear, dense_tensor
from pagedllm.models.parallel import Part

# Prefixes of checkpoint names: the language model's own, and those of parts we do not run.
_LM_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")
_SKIPPED_PREFIXES = (
    "model.vision_tower.",
    "vision_tower.",
    "model.multi_modal_projector.",
    "multi_modal_projector.",
)


# Mixtral's names for its experts, as the modules call them (transformers renames them the same way).
_RENAMES = (
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),
    (re.compile(r"(\.experts\.\d+)\.w1\."), r"\1.gate_proj."),
    (re.compile(r"(\.experts\.\d+)\.w3\."), r"\1.up_proj."),
    (re.compile(r"(\.experts\.\d+)\.w2\."), r"\1.down_proj."),
)


def module_name(checkpoint_name: str) -> str | None:
    """`model.layers.0.mlp.up_proj.weight` -> `layers.0.mlp.up_proj.weight`; None for tensors we skip."""
    if checkpoint_name.startswith(_SKIPPED_PREFIXES) or checkpoint_name.endswith("rotary_emb.inv_freq"):
        return None
    for pattern, replacement in _RENAMES:
        checkpoint_name = pattern.sub(replacement, checkpoint_name)
    for prefix in _LM_PREFIXES:
        if checkpoint_name.startswith(prefix):
            return checkpoint_name[len(prefix) :]
    return checkpoint_name


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: rows [row, row + shape[0]) of `param`, or of `layer`'s weight
    (through its LinearMethod, which may keep a quantized tensor as it is), filled from `part` of the
    tensor (None: all of it). No shape: this rank holds none of it (a row-parallel bias off rank 0)."""

    shape: tuple[int, ...] | None = None  # this rank's rows of the tensor
    row: int = 0
    part: Part | None = None
    param: torch.Tensor | None = None
    layer: Linear | None = None
    keep_quantized: Callable[[Any], None] | None = None  # takes a still-quantized tensor instead of param

    def expected_shape(self) -> tuple[int, ...]:
        shape = list(self.shape)
        if self.part is not None:
            shape[self.part.dim] = self.part.total
        return tuple(shape)

    def fill(self, tensor) -> None:
        if self.part is not None and self.part.size != self.part.total:
            tensor = self.part.take(tensor)
        if self.layer is not None:
            self.layer.method.load_weight(self.layer, self.row, tensor)
            return
        if self.keep_quantized is not None and not isinstance(tensor, torch.Tensor):
            self.keep_quantized(tensor)
            return
        with torch.no_grad():
            self.param[self.row : self.row + self.shape[0]].copy_(dense_tensor(tensor))


def _join(*names: str) -> str:
    return ".".join(name for name in names if name)


def _targets(model: nn.Module) -> tuple[dict[str, Target], dict[str, list[str]]]:
    """Checkpoint-style name -> the Target it fills. A Linear's weight goes to its method (which may hold
    no dense weight); fused projections take each shard's rows in turn. Also: each fused projection's own
    name -> its shards' names, for checkpoints that store it fused (Phi-3's qkv_proj and gate_up_proj)."""
    targets, fused = {}, {}
    for prefix, module in model.named_modules():
        part_of = getattr(module, "checkpoint_part", lambda pname, shard: None)
        for pname in getattr(module, "skipped", ()):
            targets[_join(prefix, pname)] = Target()
        params = dict(module.named_parameters(recurse=False))
        if isinstance(module, Linear):
            params["weight"] = None  # the method's to fill, whatever it keeps
        for pname, param in params.items():
            where = {"param": param} if param is not None else {"layer": module}
            if param is not None and pname == "weight" and hasattr(module, "keep_quantized"):
                where["keep_quantized"] = module.keep_quantized  # e.g. an untied embedding's GGUF blocks
            width = tuple(param.shape[1:]) if param is not None else (module.in_features,)
            if isinstance(module, MergedLinear):  # layers.0.self_attn.qkv_proj -> layers.0.self_attn.q_proj
                parent = prefix.rpartition(".")[0]
                fused[_join(prefix, pname)] = [_join(parent, shard, pname) for shard in module.shards]
                row = 0
                for shard, rows in module.shards.items():
                    part = part_of(pname, shard)
                    targets[_join(parent, shard, pname)] = Target((rows, *width), row, part, **where)
                    row += rows
            else:
                rows = module.out_features if param is None else param.shape[0]
                targets[_join(prefix, pname)] = Target((rows, *width), 0, part_of(pname, None), **where)
    return targets, fused


def _unfused(
    name: str, tensor: Any, targets: dict[str, Target], fused: dict[str, list[str]]
) -> list[tuple[str, Any]]:
    """A checkpoint tensor as (name, tensor) pairs the targets take: a fused projection stored as one
    tensor (rows of q, then k, then v; of gate, then up) split into its projections' rows."""
    if name not in fused:
        return [(name, tensor)]
    pieces, row = [], 0
    for shard in fused[name]:
        rows = targets[shard].expected_shape()[0]
        pieces.append((shard, tensor.narrow(0, row, rows)))
        row += rows
    if tuple(tensor.shape)[0] != row:
        raise ValueError(
            f"fused checkpoint tensor {name!r} has {tensor.shape[0]} rows; the config implies {row}"
        )
    return pieces


def load_weights(model: nn.Module, weights: Iterable[tuple[str, Any]]) -> None:
    """Fill every weight from (checkpoint name, tensor) pairs; errors name the tensor at fault. A tensor
    may be a torch tensor or a still-quantized one (with .shape and .dequantize(), e.g. GGUF blocks)."""
    targets, fused = _targets(model)
    tied = model.config.tie_word_embeddings
    loaded = set()
    for checkpoint_name, checkpoint_tensor in weights:
        module = module_name(checkpoint_name)
        if module is None:
            continue
        if tied and module == "embed_tokens.weight":  # a tied model's table lives in its LM head
            module = "lm_head.weight"
        if module not in targets and module not in fused:
            raise ValueError(f"checkpoint tensor {checkpoint_name!r} has no place in {type(model).__name__}")
        for name, tensor in _unfused(module, checkpoint_tensor, targets, fused):
            target = targets[name]
            loaded.add(name)
            if target.shape is None:
                continue
            if tuple(tensor.shape) != target.expected_shape():
                what = checkpoint_name if tensor is checkpoint_tensor else f"{checkpoint_name}'s {name} rows"
                raise ValueError(
                    f"checkpoint tensor {what!r} has shape {tuple(tensor.shape)}, "
                    f"but the config implies {target.expected_shape()}"
                )
            target.fill(tensor)
    missing = sorted(targets.keys() - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint is missing tensors: {shown}")
