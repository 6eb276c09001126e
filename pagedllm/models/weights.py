"""Copy checkpoint tensors (Hugging Face names) into a model's parameters, fused projections included."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.models.linear import MergedLinear

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


def _targets(model: nn.Module) -> dict[str, tuple[torch.Tensor, int, int]]:
    """Checkpoint-style name -> (parameter, first row, rows) it fills."""
    targets, seen = {}, set()
    for prefix, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # a tied parameter is filled under its first name
                continue
            seen.add(id(param))
            if isinstance(module, MergedLinear):  # layers.0.self_attn.qkv_proj -> layers.0.self_attn.q_proj
                parent = prefix.rpartition(".")[0]
                row = 0
                for shard, rows in module.shards.items():
                    targets[f"{parent}.{shard}.{pname}"] = (param, row, rows)
                    row += rows
            else:
                targets[f"{prefix}.{pname}" if prefix else pname] = (param, 0, param.shape[0])
    return targets


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Fill every parameter from (checkpoint name, tensor) pairs; errors name the tensor at fault."""
    targets = _targets(model)
    tied = model.config.tie_word_embeddings
    loaded = set()
    for checkpoint_name, tensor in weights:
        name = module_name(checkpoint_name)
        if name is None:
            continue
        if tied and name == "lm_head.weight":  # some tied checkpoints store the shared matrix under this name
            name = "embed_tokens.weight"
        if name not in targets:
            raise ValueError(f"checkpoint tensor {checkpoint_name!r} has no place in {type(model).__name__}")
        param, row, rows = targets[name]
        expected = (rows, *param.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"checkpoint tensor {checkpoint_name!r} has shape {tuple(tensor.shape)}, "
                f"but the config implies {expected}"
            )
        with torch.no_grad():
            param[row : row + rows].copy_(tensor)
        loaded.add(name)
    missing = sorted(targets.keys() - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint is missing tensors: {shown}")
