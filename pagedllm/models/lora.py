"""LoRA adapters in PEFT's format, checked against a loaded model, and added to its projections' outputs.

A PEFT adapter (adapter_config.json + adapter_model.safetensors) changes a projection y = x W^T into
y = x W^T + scale * (x A^T) B^T, with A [r, in] and B [out, r] per targeted module and scale = alpha / r
(alpha / sqrt(r) with use_rslora). pagedllm fuses q/k/v and gate/up into one matmul: an adapter of q_proj
updates the fused layer's rows of q (the rows the base's q_proj weight was loaded into), and an adapter
of a checkpoint's own fused projection (Phi-3's qkv_proj) all of them.

The base matmul runs once for every row of a step, in whatever storage the base has (float, bf16, GGUF
blocks); then one call (ops.lora_add; csrc/lora.cpp on the CPU) adds every row's update by its own
adapter, rows grouped by adapter as punica's SGMV groups them: a shrink with every piece's A stacked, an
expand into each piece's rows. A one-call decoder layer makes the same call after each of its projections.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pagedllm import ops
from pagedllm.models.linear import Linear, MergedLinear
from pagedllm.models.parallel import Part, RowParallelLinear
from pagedllm.models.weights import module_name

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target: the attention's and the MLP's, separate or fused as checkpoints
# store them (the LM head and the embedding are not adapted).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_MODULES = ("qkv_proj", "gate_up_proj")
_PEFT_PREFIX = "base_model.model."
_EXPERTS = ".experts."  # in the name of a mixture of experts' expert's projections


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
    """One adapter's update of one Linear as ops.lora_add takes it: `a` stacks every piece's A ([P * r,
    in]), `b` holds each piece's B transposed and times the scale, side by side ([r, N]), and `spans` each
    piece's first output row and its rows ([P, 2] int64)."""

    a: torch.Tensor
    b: torch.Tensor
    spans: torch.Tensor

    @classmethod
    def of_pieces(cls, pieces: list[tuple[int, torch.Tensor, torch.Tensor]]) -> LoRALayer:
        """From (first output row, A [r, in], B [rows, r] times the scale) per piece."""
        pieces = sorted(pieces, key=lambda p: p[0])
        return cls(
            torch.cat([a for _, a, _ in pieces]).contiguous(),
            torch.cat([b.t() for _, _, b in pieces], dim=1).contiguous(),
            torch.tensor([[row, b.shape[0]] for row, _, b in pieces], dtype=torch.int64),
        )

    def operands(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.a, self.b, self.spans


NOT_ADAPTED = (None, None, None)  # lora_add's operands of an adapter for a Linear it does not adapt


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
        """Its A and B (the spans' few integers aside)."""
        return sum(layer.a.nbytes + layer.b.nbytes for layer in self.layers.values())

    def operands(self, linear_name: str) -> tuple[torch.Tensor | None, ...]:
        """ops.lora_add's three operands for the Linear of this name (NOT_ADAPTED if it has no update)."""
        layer = self.layers.get(linear_name)
        return NOT_ADAPTED if layer is None else layer.operands()


@dataclass(frozen=True)
class _Place:
    """Where an adapter of one checkpoint module goes: rows [row, row + rows) of `linear`'s output. Under
    tensor parallelism a rank holds part of it, as of the base's weight: `b_parts` are its rows of B
    (one part per shard of the module, in checkpoint order: several for a fused checkpoint module), and
    `a_part` its input columns of A (a row-parallel projection: o, down)."""

    linear_name: str
    linear: Linear
    row: int
    rows: int
    b_parts: tuple[Part, ...]
    a_part: Part | None = None

    def full_shape(self, which: str, rank: int) -> tuple[int, int]:
        """The checkpoint's shape of A or B for this module."""
        if which == "A":
            return rank, self.linear.in_features if self.a_part is None else self.a_part.total
        return sum(part.total for part in self.b_parts), rank

    def local(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's A and B of the checkpoint's."""
        if self.a_part is not None:
            a = self.a_part.take(a)
        shards, start = [], 0
        for part in self.b_parts:
            shards.append(part.take(b[start : start + part.total]))
            start += part.total
        return a, torch.cat(shards)


def _b_part(linear: Linear, shard: str | None, rows: int) -> Part:
    part = linear.checkpoint_part("weight", shard) if hasattr(linear, "checkpoint_part") else None
    return part if part is not None and part.dim == 0 else Part(0, rows, rows)


def _adaptable(name: str, module: nn.Module) -> bool:
    """Whether adapters may update this module: a projection of the attention or a dense MLP (not a
    mixture of experts' expert, which sees only the tokens routed to it)."""
    leaf = name.rpartition(".")[2]
    return isinstance(module, Linear) and leaf in TARGET_MODULES + FUSED_MODULES and _EXPERTS not in name


def _places(model: nn.Module) -> dict[str, _Place]:
    """Checkpoint module name (layers.0.self_attn.q_proj) -> the rows of the Linear it was loaded into."""
    places = {}
    for name, module in model.named_modules():
        if not _adaptable(name, module):
            continue
        a_part = module.checkpoint_part("weight", None) if isinstance(module, RowParallelLinear) else None
        if not isinstance(module, MergedLinear):
            places[name] = _Place(
                name, module, 0, module.out_features, (_b_part(module, None, module.out_features),), a_part
            )
            continue
        parent, row = name.rpartition(".")[0], 0
        parts = {shard: _b_part(module, shard, rows) for shard, rows in module.shards.items()}
        for shard, rows in module.shards.items():
            places[f"{parent}.{shard}"] = _Place(name, module, row, rows, (parts[shard],))
            row += rows
        places[name] = _Place(name, module, 0, module.out_features, tuple(parts.values()))
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
            if _EXPERTS in module:
                raise ValueError(
                    f"adapter tensor {key!r} targets a mixture of experts' expert, not supported"
                )
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
            a, b = place.local(f.get_tensor(keys["A"]), f.get_tensor(keys["B"]))
            b = b.float() * config.scale
            pieces.setdefault(place.linear_name, []).append((place.row, a.to(dtype), b.to(dtype)))
    for linear_name, parts in pieces.items():
        lora.layers[linear_name] = LoRALayer.of_pieces(parts)
    if not lora.layers:
        raise ValueError(f"LoRA adapter {str(folder)!r} holds no LoRA weights")
    return lora


def _check_shape(key: str, which: str, shape: tuple[int, ...], place: _Place, rank: int) -> None:
    """A is [r, in_features], B [the module's output rows, r] of the base's projection (whole, as the
    checkpoint has it, whatever part of it this rank holds)."""
    expected = place.full_shape(which, rank)
    if shape != expected:
        a_in, b_rows = place.full_shape("A", rank)[1], place.full_shape("B", rank)[0]
        raise ValueError(
            f"adapter tensor {key!r} has shape {shape}, but the base model's {place.linear_name} "
            f"({a_in} inputs, {b_rows} outputs for this module) at r={rank} needs {expected}"
        )


class LoRAState:
    """The adapters of the step being run and each row's adapter (none between steps and in a step of the
    base alone); one per model, shared by its Linears and decoder layers."""

    def __init__(self) -> None:
        self.adapters: list[LoRAModel] = []
        self.rows = torch.empty(0, dtype=torch.int64)  # row t's index in `adapters`, -1 for the base

    @property
    def active(self) -> bool:
        return bool(self.adapters)

    def set_step(self, adapters: list[LoRAModel], token_adapters: np.ndarray, device: torch.device) -> None:
        """token_adapters[t]: the index in `adapters` of token t's adapter, -1 for the base."""
        self.clear()
        if adapters and (token_adapters >= 0).any():
            self.adapters = adapters
            self.rows = torch.from_numpy(token_adapters.astype(np.int64)).to(device)

    def clear(self) -> None:
        self.adapters = []

    def weights(self, linear_names: tuple[str, ...]) -> ops.LoRAWeights:
        """ops.lora_add's weights for these Linears' updates: per adapter, each Linear's three operands."""
        return [t for lora in self.adapters for name in linear_names for t in lora.operands(name)]


class LoRATarget:
    """A Linear's tie to its model's LoRAState: adds the step's adapters' updates to its output."""

    def __init__(self, state: LoRAState, name: str):
        self.state, self.name = state, name

    def add(self, y: torch.Tensor, x: torch.Tensor) -> None:
        if self.state.active:
            ops.lora_add(y, x, self.state.rows, self.state.weights((self.name,)))


def attach_lora(model: nn.Module) -> LoRAState:
    """Tie every projection an adapter may target to the model's LoRAState (made once per model: engines
    sharing a loaded model share it, each step setting and clearing it around its forward)."""
    state = getattr(model, "lora_state", None)
    if state is not None:
        return state
    state = model.lora_state = LoRAState()
    for name, module in model.named_modules():
        if _adaptable(name, module):
            module.lora = LoRATarget(state, name)
    for layer in getattr(model, "layers", ()):
        layer.lora_state = state
    return state
