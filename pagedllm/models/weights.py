"""Copy checkpoint tensors (Hugging Face names) into a model's parameters, fused projections included.

Under tensor parallelism a layer holds part of a checkpoint tensor: its `checkpoint_part(pname, shard)`
says which (models/parallel.py), and only that part is copied.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.models.linear import MergedLinear
from pagedllm.models.parallel import Part

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


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: rows [row, row + rows) of `param`, filled from `part` of the
    tensor (None: all of it). A None param: this rank holds none of it (a row-parallel bias off rank 0)."""

    param: torch.Tensor | None
    row: int = 0
    rows: int = 0
    part: Part | None = None

    def expected_shape(self) -> tuple[int, ...]:
        shape = [self.rows, *self.param.shape[1:]]
        if self.part is not None:
            shape[self.part.dim] = self.part.total
        return tuple(shape)


def _join(*names: str) -> str:
    return ".".join(name for name in names if name)


def _targets(model: nn.Module) -> dict[str, Target]:
    """Checkpoint-style name -> the Target it fills."""
    targets, seen = {}, set()
    for prefix, module in model.named_modules():
        part_of = getattr(module, "checkpoint_part", lambda pname, shard: None)
        for pname in getattr(module, "skipped", ()):
            targets[_join(prefix, pname)] = Target(None)
        for pname, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # a tied parameter is filled under its first name
                continue
            seen.add(id(param))
            if isinstance(module, MergedLinear):  # layers.0.self_attn.qkv_proj -> layers.0.self_attn.q_proj
                parent = prefix.rpartition(".")[0]
                row = 0
                for shard, rows in module.shards.items():
                    targets[_join(parent, shard, pname)] = Target(param, row, rows, part_of(pname, shard))
                    row += rows
            else:
                targets[_join(prefix, pname)] = Target(param, 0, param.shape[0], part_of(pname, None))
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
        target = targets[name]
        loaded.add(name)
        if target.param is None:
            continue
        if tuple(tensor.shape) != target.expected_shape():
            raise ValueError(
                f"checkpoint tensor {checkpoint_name!r} has shape {tuple(tensor.shape)}, "
                f"but the config implies {target.expected_shape()}"
            )
        if target.part is not None:
            tensor = target.part.take(tensor)
        with torch.no_grad():
            target.param[target.row : target.row + target.rows].copy_(tensor)
    missing = sorted(targets.keys() - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint is missing tensors: {shown}")
