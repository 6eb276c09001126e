"""Copy checkpoint tensors (Hugging Face names) into a model's parameters, fused projections included."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedllm.models.linear import Linear, MergedLinear, dense_tensor

# Prefixes of checkpoint names: the language model's own, and those of parts we do not run.
_LM_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")
_SKIPPED_PREFIXES = (
    "model.vision_tower.",
    "vision_tower.",
    "model.multi_modal_projector.",
    "multi_modal_projector.",
)


def module_name(checkpoint_name: str) -> str | None:
    """`model.layers.0.mlp.up_proj.weight` -> `layers.0.mlp.up_proj.weight`; None for tensors we skip."""
    if checkpoint_name.startswith(_SKIPPED_PREFIXES) or checkpoint_name.endswith("rotary_emb.inv_freq"):
        return None
    for prefix in _LM_PREFIXES:
        if checkpoint_name.startswith(prefix):
            return checkpoint_name[len(prefix) :]
    return checkpoint_name


@dataclass
class _Target:
    shape: tuple[int, ...]  # the shape the checkpoint tensor must have
    load: Callable[[Any], None]  # puts a checkpoint tensor in its place


def _copy_rows(param: torch.Tensor, row: int) -> Callable[[Any], None]:
    def load(tensor) -> None:
        tensor = dense_tensor(tensor)
        with torch.no_grad():
            param[row : row + tensor.shape[0]].copy_(tensor)

    return load


def _linear_weight(layer: Linear, row: int) -> Callable[[Any], None]:
    return lambda tensor: layer.method.load_weight(layer, row, tensor)


def _targets(model: nn.Module) -> dict[str, _Target]:
    """Checkpoint-style name -> where that tensor goes. A Linear's weight goes through its method (which
    may keep a quantized tensor as it is); fused projections take each shard's rows in turn."""
    targets = {}
    for prefix, module in model.named_modules():
        if isinstance(module, Linear):
            parts = [(prefix, module.out_features)]
            if isinstance(
                module, MergedLinear
            ):  # layers.0.self_attn.qkv_proj -> layers.0.self_attn.q_proj, ...
                parent = prefix.rpartition(".")[0]
                parts = [
                    (f"{parent}.{shard}" if parent else shard, rows) for shard, rows in module.shards.items()
                ]
            row = 0
            for name, rows in parts:
                targets[f"{name}.weight"] = _Target((rows, module.in_features), _linear_weight(module, row))
                if module.bias is not None:
                    targets[f"{name}.bias"] = _Target((rows,), _copy_rows(module.bias, row))
                row += rows
            continue
        for pname, param in module.named_parameters(recurse=False):
            targets[f"{prefix}.{pname}" if prefix else pname] = _Target(
                tuple(param.shape), _copy_rows(param, 0)
            )
    return targets


def load_weights(model: nn.Module, weights: Iterable[tuple[str, Any]]) -> None:
    """Fill every weight from (checkpoint name, tensor) pairs; errors name the tensor at fault. A tensor
    may be a torch tensor or a still-quantized one (with .shape and .dequantize(), e.g. GGUF blocks)."""
    targets = _targets(model)
    tied = model.config.tie_word_embeddings
    loaded = set()
    for checkpoint_name, tensor in weights:
        name = module_name(checkpoint_name)
        if name is None:
            continue
        if tied and name == "embed_tokens.weight":  # a tied model's table lives in its LM head
            name = "lm_head.weight"
        if name not in targets:
            raise ValueError(f"checkpoint tensor {checkpoint_name!r} has no place in {type(model).__name__}")
        target = targets[name]
        if tuple(tensor.shape) != target.shape:
            raise ValueError(
                f"checkpoint tensor {checkpoint_name!r} has shape {tuple(tensor.shape)}, "
                f"but the config implies {target.shape}"
            )
        target.load(tensor)
        loaded.add(name)
    missing = sorted(targets.keys() - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint is missing tensors: {shown}")
