"""load_model: a built-in name, a Hugging Face folder or a .gguf file -> model + tokenizer + config."""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from torch import nn

from pagedllm.models.builtin import BUILTIN_MODELS
from pagedllm.models.config import ModelConfig
from pagedllm.models.gguf_loader import (
    cache_root,
    converted_folder,
    gguf_blocks,
    gguf_tensor_bytes,
    write_float_weights,
)
from pagedllm.models.linear import LinearMethod, process_linear_layers, set_linear_method, weight_bytes
from pagedllm.models.parallel import SINGLE, TensorParallel
from pagedllm.models.quantization import GGUFLinear, linear_method_for
from pagedllm.models.registry import model_class
from pagedllm.models.tokenizer import Tokenizer, load_tokenizer
from pagedllm.models.weights import load_weights

DEFAULT_MODEL = "smollm2-135m"

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: nn.Module  # forward(input_ids, positions, meta) -> hidden; compute_logits(hidden) -> logits
    tokenizer: Tokenizer | None  # None if the folder has none
    config: ModelConfig
    name: str  # what the caller asked for
    path: Path  # the Hugging Face style folder the weights came from (the cache folder for a GGUF)
    linear_method: str  # how the matmul weights are stored: dense, onednn, kernel, int8, int4, gguf
    weight_bytes: int  # memory holding the weights (models.linear.weight_bytes)

    @property
    def eos_token_ids(self) -> list[int]:
        """Token ids that end a generation (config.json plus generation_config.json)."""
        return self.config.eos_token_ids

    @property
    def chat_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None)


@dataclass(frozen=True)
class ResolvedModel:
    """A model as named once at start-up: the name given, its GGUF file (None for a folder), the Hugging
    Face style folder it loads from, and its config (read once)."""

    name: str
    gguf: Path | None
    folder: Path
    config: ModelConfig


def resolve_model(model: str | ResolvedModel) -> ResolvedModel:
    """A built-in name, a folder or a .gguf path, resolved (a GGUF converted once); a ResolvedModel as is."""
    if isinstance(model, ResolvedModel):
        return model
    gguf = gguf_file(model)
    folder = Path(model).expanduser() if gguf is None else converted_folder(gguf)
    return ResolvedModel(model, gguf, folder, read_config(folder))


def resolve_checkpoint(model: str, float_weights: bool = False) -> Path:
    """The Hugging Face style folder for a built-in name, a folder path or a .gguf path (converted once).

    A GGUF's folder holds its config and tokenizer but no weights (the loader reads them from the file);
    `float_weights` adds a float32 copy of them (once), for tools that read a Hugging Face folder."""
    gguf = gguf_file(model)
    if gguf is None:
        return Path(model).expanduser()
    folder = converted_folder(gguf)
    if float_weights:
        write_float_weights(gguf, folder)
    return folder


def gguf_file(model: str) -> Path | None:
    """The GGUF file behind a built-in name or a .gguf path; None for a folder. Errors for anything else."""
    if model in BUILTIN_MODELS:
        return BUILTIN_MODELS[model]()
    path = Path(model).expanduser()
    if path.is_dir():
        return None
    if path.is_file() and path.suffix == ".gguf":
        return path
    raise FileNotFoundError(
        f"model {model!r} is not a built-in name ({', '.join(BUILTIN_MODELS)}), "
        "an existing folder, or an existing .gguf file"
    )


CONFIG_CACHE_VERSION = 1  # bump when the parsing changes (a change of ModelConfig's fields is in the key)


def read_config(folder: Path) -> ModelConfig:
    """ModelConfig from config.json, with end-of-sequence ids from generation_config.json added.

    Parsing goes through transformers' config classes (they know each family's defaults), which costs
    over a second of imports; the result is cached under the cache root, keyed by the file's content
    and ModelConfig's fields (so a branch with other fields never reads another's entry).
    """
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {folder}")
    text = path.read_text()
    names = ",".join(f.name for f in fields(ModelConfig))
    key = hashlib.sha256(f"{CONFIG_CACHE_VERSION}:{names}:{text}".encode()).hexdigest()[:16]
    cached = cache_root() / "configs" / f"{key}.json"
    if cached.is_file():
        config = ModelConfig(**json.loads(cached.read_text()))
    else:
        config = ModelConfig.from_hf_dict(json.loads(text))
        _write_atomically(cached, json.dumps(asdict(config)))
    generation = folder / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        for token_id in [eos] if isinstance(eos, int) else eos or []:
            if token_id not in config.eos_token_ids:
                config.eos_token_ids.append(token_id)
    return config


def _write_atomically(path: Path, text: str) -> None:
    """Write via a temporary file and a rename, so a concurrent reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
        tmp.write(text)
    Path(tmp.name).replace(path)


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those its index names, else every *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / name for name in names]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"{index} names {file.name}, which does not exist")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    return files


def _read_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(
    model: str | ResolvedModel = DEFAULT_MODEL,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    linear_method: LinearMethod | None = None,
    quantization: str | None = "auto",
    tp: TensorParallel = SINGLE,
    max_num_seqs: int | None = None,
    max_model_len: int | None = None,
) -> LoadedModel:
    """Load weights, config and tokenizer, the model built for sequences of at most `max_model_len` tokens
    (None: the model's context; only Phi-3's longrope RoPE depends on it, ModelConfig.for_context). The
    linear method (default: the one `quantization` names, see quantization.linear_method_for: "auto" keeps
    a GGUF file's own blocks; unquantized weights for an engine of at most `max_num_seqs` sequences)
    receives every matmul weight and prepares its storage. The model is in eval mode with gradients off.

    With a tensor-parallel `tp`, the model holds rank tp.rank's part of every sharded weight."""
    resolved = resolve_model(model)
    gguf, folder = resolved.gguf, resolved.folder
    config = resolved.config.for_context(max_model_len)
    cls = model_class(config.architecture)
    with torch.device(device):
        module = cls(config, tp)  # parameters uninitialised (torch.empty): every one is loaded below
    module.to(dtype)
    method = linear_method or linear_method_for(
        quantization, device, dtype, gguf=gguf is not None, max_num_seqs=max_num_seqs
    )
    set_linear_method(module, method)
    if isinstance(method, GGUFLinear):
        weights = gguf_blocks(gguf, folder)
    else:
        if gguf is not None:
            write_float_weights(gguf, folder)
        weights = _read_weights(weight_files(folder))
    load_weights(module, weights)
    module.eval().requires_grad_(False)
    process_linear_layers(module)
    module.finish_loading()
    loaded = LoadedModel(
        module, load_tokenizer(folder), config, resolved.name, folder, method.name, weight_bytes(module)
    )
    if gguf is not None:
        in_file = gguf_tensor_bytes(gguf, folder)
        logger.info(
            "%s: weights %.1f MiB (%s) for the GGUF file's %.1f MiB of tensors (%.2fx)",
            resolved.name,
            loaded.weight_bytes / 2**20,
            method.name,
            in_file / 2**20,
            loaded.weight_bytes / in_file,
        )
    return loaded
