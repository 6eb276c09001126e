"""LoRA adapters in PEFT's format, checked against a loaded model, and added to its projections' outputs.

A PEFT adapter (adapter_config.json + adapter_model.safetensors) changes a projection y = x W^T into
y = x W^T + scale * (x A^T) B^T, with A [r, in] and B [out, r] per targeted module and scale = alpha / r
(alpha / sqrt(r) with use_rslora). pagedllm fuses q/k/v and gate/up into one matmul: an adapter of q_proj
updates the fused layer's rows of q (the rows the base's q_proj weight was loaded into), and an adapter
of a checkpoint's own fused projection (Phi-3's qkv_proj) all of them.

The base matmul runs once for every row of a step, in whatever storage the base has (float, bf16, GGUF
blocks); then each adapter of the step adds its update to its rows alone (rows grouped by adapter, as
punica's SGMV groups them): one shrink with every piece's A stacked, one expand per piece's B.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pagedllm.models.linear import Linear, MergedLinear
from pagedllm.models.weights import module_name

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target: the attention's and the MLP's, separate or fused as checkpoints
# store them (the LM head and the embedding are not adapted).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_MODULES = ("qkv_proj", "gate_up_proj")
_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoRAConfig:
    """What adapter_config.json says of the update: its rank, alpha, and the modules it targets."""

    rank: int
    alpha: float
    use_rslora: bool = False
    target_modules: tuple[str, ...] | str = ()

    @property
    def scale(self) -> float:
        """PEFT's scaling: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


# PEFT options that change the update in ways pagedllm does not compute: refused by name when set.
_UNSUPPORTED = ("use_dora", "fan_in_fan_out", "modules_to_save", "rank_pattern", "alpha_pattern", "lora_bias")


def read_lora_config(folder: str | Path, max_rank: int) -> LoRAConfig:
    """The adapter's config, refused (ValueError naming the value) if pagedllm cannot apply it: missing
    files, not LoRA, a rank above `max_rank`, a target it does not adapt, a PEFT option it lacks."""
    folder = Path(folder)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise ValueError(f"LoRA adapter folder {str(folder)!r} has no {name}")
    try:
        raw = json.loads((folder / CONFIG_FILE).read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{folder / CONFIG_FILE} is not valid JSON: {error}") from None
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{folder / CONFIG_FILE}: peft_type {raw['peft_type']!r} is not 'LORA'")
    for key in _UNSUPPORTED:
        if raw.get(key):
            raise ValueError(f"{folder / CONFIG_FILE}: {key}={raw[key]!r} is not supported")
    if raw.get("bias", "none") != "none":
        raise ValueError(f"{folder / CONFIG_FILE}: bias={raw['bias']!r} is not supported (only 'none')")
    rank, alpha = raw.get("r"), raw.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{folder / CONFIG_FILE}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {str(folder)!r} has rank r={rank}, above max_lora_rank={max_rank}")
    if not isinstance(alpha, int | float):
        raise ValueError(f"{folder / CONFIG_FILE}: lora_alpha must be a number, got {alpha!r}")
    targets = raw.get("target_modules") or ()
    if not isinstance(targets, str):  # a string is a regular expression: the tensors are checked instead
        targets = tuple(targets)
        bad = [t for t in targets if t.rpartition(".")[2] not in TARGET_MODULES + FUSED_MODULES]
        if bad:
            raise ValueError(
                f"LoRA adapter {str(folder)!r} targets {bad[0]!r}; "
                f"pagedllm adapts only {list(TARGET_MODULES)}"
            )
    return LoRAConfig(rank, float(alpha), bool(raw.get("use_rslora", False)), targets)


@dataclass
class LoRALayer:
    """One adapter's update of one Linear: `a` stacks every piece's A ([sum of ranks, in]); a piece is
    (first output row, first column of its rank in the shrink's output, B [rows, r] times the scale)."""

    a: torch.Tensor
    pieces: list[tuple[int, int, torch.Tensor]]

    def update(self, y: torch.Tensor, x: torch.Tensor, rows: torch.Tensor) -> None:
        """y[rows] += the update of x[rows] (shrink once, then expand into each piece's output rows)."""
        shrunk = x.index_select(0, rows) @ self.a.t()
        for first_row, first_rank, b in self.pieces:
            delta = shrunk[:, first_rank : first_rank + b.shape[1]] @ b.t()
            y[:, first_row : first_row + b.shape[0]].index_add_(0, rows, delta)

    def tensors(self) -> list[torch.Tensor]:
        return [self.a, *(b for _, _, b in self.pieces)]


@dataclass
class LoRAModel:
    """A loaded adapter: its update of each Linear it targets, keyed by the Linear's module name."""

    name: str
    int_id: int
    path: str
    config: LoRAConfig
    layers: dict[str, LoRALayer] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for layer in self.layers.values() for t in layer.tensors())


@dataclass(frozen=True)
class _Place:
    """Where an adapter of a checkpoint module goes: rows [row, row + rows) of `linear`'s output."""

    linear_name: str
    linear: Linear
    row: int
    rows: int


def _places(model: nn.Module) -> dict[str, _Place]:
    """Checkpoint module name (layers.0.self_attn.q_proj) -> the rows of the Linear it was loaded into."""
    places = {}
    for name, module in model.named_modules():
        leaf = name.rpartition(".")[2]
        if not isinstance(module, Linear) or leaf not in TARGET_MODULES + FUSED_MODULES:
            continue
        places[name] = _Place(name, module, 0, module.out_features)
        if isinstance(module, MergedLinear):
            parent, row = name.rpartition(".")[0], 0
            for shard, rows in module.shards.items():
                places[f"{parent}.{shard}"] = _Place(name, module, row, rows)
                row += rows
    return places


def _adapter_tensor_names(name: str) -> tuple[str, str]:
    """`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` -> (layers.0.self_attn.q_proj, A)."""
    body = name.removeprefix(_PEFT_PREFIX)
    for which in ("A", "B"):
        suffix = f".lora_{which}.weight"
        if body.endswith(suffix):
            module = module_name(body.removesuffix(suffix) + ".weight")
            return (module or "").removesuffix(".weight"), which
    raise ValueError(f"adapter tensor {name!r} is not a LoRA A or B weight pagedllm applies")


def load_lora(
    name: str, int_id: int, folder: str | Path, model: nn.Module, max_rank: int, dtype: torch.dtype
) -> LoRAModel:
    """Read a PEFT adapter for `model`: every tensor's shape is checked against the base before any is
    loaded (ValueError naming the tensor and both shapes); B is stored times the scale, in `dtype`."""
    from safetensors import safe_open

    config = read_lora_config(folder, max_rank)
    places = _places(model)
    path = Path(folder) / WEIGHTS_FILE
    pairs: dict[str, dict[str, str]] = {}
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():
            module, which = _adapter_tensor_names(key)
            if module not in places:
                raise ValueError(f"adapter tensor {key!r} targets {module!r}, which the base model lacks")
            _check_shape(key, which, tuple(f.get_slice(key).get_shape()), places[module], config.rank)
            pairs.setdefault(module, {})[which] = key
        lora = LoRAModel(name, int_id, str(folder), config)
        pieces: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
        for module, keys in sorted(pairs.items()):
            if set(keys) != {"A", "B"}:
                missing = ({"A", "B"} - set(keys)).pop()
                raise ValueError(f"LoRA adapter {str(folder)!r} has no lora_{missing} for module {module!r}")
            place = places[module]
            a, b = f.get_tensor(keys["A"]).float(), f.get_tensor(keys["B"]).float() * config.scale
            pieces.setdefault(place.linear_name, []).append((place.row, a.to(dtype), b.to(dtype)))
    for linear_name, parts in pieces.items():
        parts.sort(key=lambda p: p[0])
        ranks = np.cumsum([0] + [a.shape[0] for _, a, _ in parts])
        lora.layers[linear_name] = LoRALayer(
            torch.cat([a for _, a, _ in parts]).contiguous(),
            [(row, int(first), b.contiguous()) for (row, _, b), first in zip(parts, ranks, strict=False)],
        )
    if not lora.layers:
        raise ValueError(f"LoRA adapter {str(folder)!r} holds no LoRA weights")
    return lora


def _check_shape(key: str, which: str, shape: tuple[int, ...], place: _Place, rank: int) -> None:
    """A is [r, in_features], B [the module's output rows, r] of the base's projection."""
    linear = place.linear
    expected = (rank, linear.in_features) if which == "A" else (place.rows, rank)
    if shape != expected:
        raise ValueError(
            f"adapter tensor {key!r} has shape {shape}, but the base model's {place.linear_name} "
            f"({linear.in_features} inputs, {place.rows} outputs for this module) at r={rank} "
            f"needs {expected}"
        )


class LoRAState:
    """The adapters of the step being run, each with the rows of the flattened batch it updates (empty
    between steps and in a step of the base alone); one per model, shared by its Linears."""

    def __init__(self) -> None:
        self.groups: list[tuple[LoRAModel, torch.Tensor]] = []

    def set_step(self, adapters: list[LoRAModel], token_adapters: np.ndarray, device: torch.device) -> None:
        """token_adapters[t]: the index in `adapters` of token t's adapter, -1 for the base."""
        self.groups = []
        for i, lora in enumerate(adapters):
            rows = np.flatnonzero(token_adapters == i)
            if len(rows):
                self.groups.append((lora, torch.from_numpy(rows).to(device)))

    def clear(self) -> None:
        self.groups = []


class LoRATarget:
    """A Linear's tie to its model's LoRAState: adds the step's adapters' updates to its output."""

    def __init__(self, state: LoRAState, name: str):
        self.state, self.name = state, name

    def add(self, y: torch.Tensor, x: torch.Tensor) -> None:
        for lora, rows in self.state.groups:
            layer = lora.layers.get(self.name)
            if layer is not None:
                layer.update(y, x, rows)


def attach_lora(model: nn.Module) -> LoRAState:
    """Tie every projection an adapter may target to the model's LoRAState (made once per model: engines
    sharing a loaded model share it, each step setting and clearing it around its forward)."""
    state = getattr(model, "lora_state", None)
    if state is not None:
        return state
    state = model.lora_state = LoRAState()
    for name, module in model.named_modules():
        if isinstance(module, Linear) and name.rpartition(".")[2] in TARGET_MODULES + FUSED_MODULES:
            module.lora = LoRATarget(state, name)
    for layer in getattr(model, "layers", ()):
        layer.lora_state = state
    return state
