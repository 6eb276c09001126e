"""A GGUF file as a Hugging Face style folder (config.json, tokenizer, an index of the file's tensors), once.

The folder is cached under the cache root, keyed by the file's size and mtime, and holds no weights: the
loader reads them from the GGUF file itself (gguf_blocks), under Hugging Face names, quantized tensors
still in their blocks, each mapped from the file when it is read. Only where float weights are asked for
(quantization=None, or a tool that reads a Hugging Face folder) is a float32 copy written beside them,
once (write_float_weights): dequantized with the `gguf` package, undoing two llama.cpp conventions, the
Q/K row permutation of Llama-family models and Gemma's stored (1 + w) norm weights. Names follow
llama.cpp's (gguf-py's MODEL_TENSORS): Qwen2 and Qwen3 use Llama's, with q/k/v biases or q/k norms and no
Q/K permutation (NeoX-style RoPE, as Hugging Face's rotate_half); Mixtral is a Llama with experts; Phi-3
keeps q/k/v fused (attn_qkv) and gate/up fused in ffn_up, as Hugging Face's checkpoint does; Mixtral and
Qwen3-MoE stack each layer's experts in one 3-D tensor per projection (ffn_gate_exps: [experts, rows,
columns]), split here into one per expert. RoPE scaling the converter stores as tensors of per-pair
factors (Llama 3.1's rope_freqs, Phi-3's rope_factors_short / _long) becomes longrope parameters.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType

from pagedllm.models.gguf_quants import KEPT_TYPES, GGUFBlocks
from pagedllm.models.registry import gguf_architecture

logger = logging.getLogger(__name__)

CONVERTER_VERSION = 1  # bump when the conversion changes, to invalidate cached folders

_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",  # Gemma: pre_feedforward_layernorm
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # the MoE router
    "ffn_gate_exps": "mlp.experts.gate_proj",  # every expert's, stacked
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_GEMMA = ("gemma2", "gemma3")
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_NAME = re.compile(r"(\w+)\.(weight|bias)")


def cache_root() -> Path:
    """Where converted models live: $PAGEDLLM_CACHE_DIR, else ~/.cache/pagedllm."""
    return Path(os.environ.get("PAGEDLLM_CACHE_DIR", Path.home() / ".cache" / "pagedllm"))


def converted_folder(gguf_path: Path) -> Path:
    """The cached folder for a GGUF file (config, tokenizer, tensor index; no weights), made on first use."""
    stat = gguf_path.stat()
    key = f"{stat.st_size}-{stat.st_mtime_ns}-{CONVERTER_VERSION}"
    folder = cache_root() / f"{gguf_path.stem}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"
    if (folder / "config.json").exists():
        return folder
    logger.info("converting the metadata of %s into %s (first load only)", gguf_path, folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
    try:
        _convert(gguf_path, tmp)
        tmp.rename(folder)  # atomic: a half-written folder is never taken for a finished one
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (folder / "config.json").exists():  # else another process finished the same conversion
            raise
    return folder


FLOAT_WEIGHTS = "model.safetensors"


def write_float_weights(gguf_path: Path, folder: Path) -> None:
    """Write the file's weights, dequantized to float32, into `folder` as model.safetensors, unless there."""
    from gguf import GGUFReader
    from safetensors.torch import save_file

    target = folder / FLOAT_WEIGHTS
    if target.is_file():
        return
    logger.info("writing a float32 copy of %s into %s (first float load only)", gguf_path, folder)
    reader = GGUFReader(gguf_path)
    config = json.loads((folder / "config.json").read_text())
    tensors = dict(hf_tensors(*_architecture_and_tensors(reader), config))
    temporary = target.with_suffix(f".{os.getpid()}.tmp")
    try:
        save_file(tensors, temporary, metadata={"format": "pt"})
        os.replace(temporary, target)  # atomic: another process may write the same copy at once
    finally:
        temporary.unlink(missing_ok=True)


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: its GGUF name, ggml type and data (a view into the file's memory map)."""

    name: str
    tensor_type: GGMLQuantizationType
    data: np.ndarray


TENSOR_INDEX = "gguf_tensors.json"  # in the converted folder: where each tensor lies in the GGUF file


def gguf_blocks(gguf_path: Path, folder: Path) -> Iterator[tuple[str, Any]]:
    """A GGUF file's tensors under Hugging Face names, quantized ones still in their blocks (GGUFBlocks).

    Each tensor is its own memory map of the file (copy-on-write), made when the iterator reaches it: its
    pages are read only when its values are, and leave the process's memory with the last reference to
    it, so the whole file is never held mapped while a model's storage is built from it. Where each
    tensor lies comes from the index in the converted `folder` (keyed by the file's size and mtime); a
    folder without one (an older cache) gets it now. Only that needs GGUFReader, which parses every
    metadata field (Qwen2.5's 151,936-entry vocabulary included).
    """
    config = json.loads((folder / "config.json").read_text())
    index = _tensor_index(gguf_path, folder)
    tensors = (
        GGUFTensor(
            t["name"],
            GGMLQuantizationType(t["type"]),
            np.memmap(gguf_path, mode="c", offset=t["offset"], shape=t["bytes"], dtype=np.uint8)
            .view(t["dtype"])
            .reshape(t["shape"]),
        )
        for t in index["tensors"]
    )
    return hf_tensors(index["architecture"], tensors, config, keep_blocks=True)


def gguf_tensor_bytes(gguf_path: Path, folder: Path) -> int:
    """Bytes of the GGUF file's tensors (what its weights take in the file)."""
    return sum(t["bytes"] for t in _tensor_index(gguf_path, folder)["tensors"])


def _tensor_index(gguf_path: Path, folder: Path) -> dict[str, Any]:
    index_path = folder / TENSOR_INDEX
    if index_path.is_file():
        return json.loads(index_path.read_text())
    from gguf import GGUFReader

    index = tensor_index(GGUFReader(gguf_path))
    try:
        write_tensor_index(index, folder)
    except OSError as error:  # a read-only cache: every load parses the file
        logger.warning("could not keep the GGUF tensor index in %s: %s", folder, error)
    return index


def tensor_index(reader: Any) -> dict[str, Any]:
    """Where each tensor of a parsed GGUF file lies in it (see gguf_blocks)."""
    entries = [
        {
            "name": t.name,
            "type": int(t.tensor_type),
            "offset": t.data_offset,
            "bytes": t.data.nbytes,
            "dtype": t.data.dtype.str,
            "shape": list(t.data.shape),
        }
        for t in reader.tensors
    ]
    return {"architecture": _field(reader, "general.architecture"), "tensors": entries}


def write_tensor_index(index: dict[str, Any], folder: Path) -> None:
    temporary = (folder / TENSOR_INDEX).with_suffix(f".{os.getpid()}.tmp")
    temporary.write_text(json.dumps(index))
    os.replace(temporary, folder / TENSOR_INDEX)  # another process may write the same index at once


def _convert(gguf_path: Path, out: Path) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    config = hf_config(reader)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    write_tensor_index(tensor_index(reader), out)  # loading the blocks then needs no second parse
    if "tokenizer.ggml.model" in reader.fields:  # transformers rebuilds the tokenizer from the metadata
        gguf_tokenizer(gguf_path, config).save_pretrained(out)
    else:
        logger.warning("%s has no tokenizer; prompts must be token ids", gguf_path)


def gguf_tokenizer(gguf_path: Path, config: dict[str, Any]) -> Any:
    """transformers' tokenizer for the file. Where transformers maps the model type straight to a tokenizer
    class (Qwen2, Gemma 3, ...) that class is built from the file: it reads just the vocabulary and merges,
    while AutoTokenizer first parses the whole file once more with GGUFReader (every one of Qwen2.5's
    151,936 vocabulary entries) only to learn the model type. Other types (Llama's, whose class AutoTokenizer
    picks by what the vocabulary is) go through AutoTokenizer."""
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    config_class = type(AutoConfig.for_model(**config))
    tokenizer_class = TOKENIZER_MAPPING[config_class] if config_class in TOKENIZER_MAPPING else AutoTokenizer
    return tokenizer_class.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def _architecture_and_tensors(reader: Any) -> tuple[str, list[GGUFTensor]]:
    return _field(reader, "general.architecture"), [
        GGUFTensor(t.name, t.tensor_type, t.data) for t in reader.tensors
    ]


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def hf_config(reader: Any) -> dict[str, Any]:
    """A Hugging Face config.json dict from GGUF metadata (and tensor shapes where metadata is silent)."""
    arch = _field(reader, "general.architecture")
    architecture = gguf_architecture(arch)
    meta = lambda key, default=None: _field(reader, f"{arch}.{key}", default)
    if arch == "llama" and meta("expert_count"):  # llama.cpp writes Mixtral as a Llama with experts
        architecture = "MixtralForCausalLM"
    tensors = {t.name: t for t in reader.tensors}
    hidden, num_heads = meta("embedding_length"), meta("attention.head_count")
    num_kv_heads = meta("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):
        if len(set(num_kv_heads)) != 1:
            raise ValueError(f"per-layer KV head counts are not supported: {num_kv_heads}")
        num_kv_heads = num_kv_heads[0]
    head_dim = meta("attention.key_length") or hidden // num_heads
    rope_dim = meta("rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ValueError(f"partial rotary embeddings are not supported (rope dim {rope_dim} != {head_dim})")
    eos = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        token_id = _field(reader, key)
        if token_id is not None and token_id not in eos:
            eos.append(token_id)
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": _MODEL_TYPES[architecture],
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),
        "hidden_size": hidden,
        "intermediate_size": meta("feed_forward_length") or meta("expert_feed_forward_length"),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon"),
        "rope_theta": meta("rope.freq_base", 10000.0),
        "max_position_embeddings": meta("context_length"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }
    scaling = meta("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ValueError(f"unsupported GGUF RoPE scaling {scaling!r}")
        config["rope_scaling"] = {"rope_type": "linear", "factor": meta("rope.scaling.factor")}
    if factors := _rope_factors(tensors, meta):
        config["rope_scaling"] = factors
        if arch == "phi3":  # where transformers' Phi-3 looks for it too
            config["original_max_position_embeddings"] = factors["original_max_position_embeddings"]
    if meta("attention.sliding_window") and arch in ("phi3", "gemma2"):
        config["sliding_window"] = meta("attention.sliding_window")
    if arch == "gemma2":  # the sliding layers alternate with full ones, from the first (Gemma2Config's)
        config.update(
            # llama.cpp's rule, not stored: 27B (46 layers) scales by (hidden / heads)^-1/2, the others
            # by head_dim^-1/2.
            query_pre_attn_scalar=hidden // num_heads if meta("block_count") == 46 else head_dim,
            attn_logit_softcapping=meta("attn_logit_softcapping"),
            final_logit_softcapping=meta("final_logit_softcapping"),
            hidden_activation="gelu_pytorch_tanh",
        )
    if arch == "qwen3moe":  # every layer routes (llama.cpp's qwen3moe), the chosen weights renormalized
        config.update(
            num_experts=meta("expert_count"),
            num_experts_per_tok=meta("expert_used_count"),
            moe_intermediate_size=meta("expert_feed_forward_length"),
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    if architecture == "MixtralForCausalLM":
        config.update(num_local_experts=meta("expert_count"), num_experts_per_tok=meta("expert_used_count"))
    if arch == "gemma3":  # llama.cpp fixes these for Gemma 3 rather than storing them
        config.update(
            sliding_window=meta("attention.sliding_window"),
            sliding_window_pattern=6,
            rope_local_base_freq=10000.0,
            query_pre_attn_scalar=head_dim,
            hidden_activation="gelu_pytorch_tanh",
        )
    return config


ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")


def _rope_factors(tensors: dict[str, Any], meta: Callable[..., Any]) -> dict[str, Any] | None:
    """RoPE scaling that llama.cpp's converter stores as per-pair divisors of the inverse frequencies, as
    the longrope parameters that compute the same thing: Llama 3.1's llama3 scaling (rope_freqs, which
    the converter computes from the factor, the low / high frequency factors and the original context:
    one set, no attention factor) and Phi-3's longrope (rope_factors_short / _long, with
    rope.scaling.original_context_length and rope.scaling.attn_factor). None where there are none."""
    values = lambda name: [float(x) for x in tensors[name].data]
    if "rope_freqs.weight" in tensors:
        freqs = values("rope_freqs.weight")
        return {
            "rope_type": "longrope",
            "short_factor": freqs,
            "long_factor": freqs,
            "original_max_position_embeddings": meta("context_length"),
            "attention_factor": 1.0,
        }
    if "rope_factors_long.weight" not in tensors:
        return None
    scaling = {
        "rope_type": "longrope",
        "short_factor": values("rope_factors_short.weight"),
        "long_factor": values("rope_factors_long.weight"),
        "original_max_position_embeddings": meta("rope.scaling.original_context_length"),
    }
    if (attn_factor := meta("rope.scaling.attn_factor")) is not None:  # else transformers' default
        scaling["attention_factor"] = attn_factor
    return scaling


def hf_tensors(
    arch: str, tensors: list[GGUFTensor], config: dict[str, Any], keep_blocks: bool = False
) -> Iterator[tuple[str, Any]]:
    """float32 tensors of GGUF architecture `arch` under Hugging Face names; with keep_blocks, quantized
    2-D tensors of a kept type stay in their blocks (GGUFBlocks; rows reordered as the float ones are,
    which is exact). A stack of experts' tensors comes out as one tensor per expert."""
    for tensor in tensors:
        if tensor.name in ROPE_TENSORS:  # RoPE parameters, in config.json (_rope_factors)
            continue
        name = hf_tensor_name(tensor.name, arch)
        if ".experts." not in name:
            yield name, _hf_tensor(arch, name, tensor, config, keep_blocks)
            continue
        for expert, data in enumerate(tensor.data):  # [experts, rows, columns]
            one = GGUFTensor(tensor.name, tensor.tensor_type, data)
            yield (
                name.replace(".experts.", f".experts.{expert}."),
                _hf_tensor(arch, name, one, config, keep_blocks),
            )


def _hf_tensor(arch: str, name: str, tensor: GGUFTensor, config: dict[str, Any], keep_blocks: bool) -> Any:
    """One GGUF tensor as float32 (or GGUFBlocks, see hf_tensors), in Hugging Face's conventions."""
    from gguf.quants import dequantize

    permuted = arch in ("llama", "mistral")  # llama.cpp interleaves Q/K rows for its RoPE kernel
    blocks = keep_blocks and tensor.tensor_type in KEPT_TYPES and len(tensor.data.shape) == 2
    weights = (
        tensor.data if blocks else dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
    )
    if permuted and name.endswith("q_proj.weight"):
        weights = unpermute_rows(weights, config["num_attention_heads"])
    elif permuted and name.endswith("k_proj.weight"):
        weights = unpermute_rows(weights, config["num_key_value_heads"])
    elif arch in _GEMMA and name.endswith("norm.weight"):
        weights = weights - 1.0  # GGUF stores Gemma's (1 + w); Hugging Face stores w
    if blocks:
        return GGUFBlocks(np.ascontiguousarray(weights), tensor.tensor_type)
    return torch.from_numpy(np.array(weights, dtype=np.float32, order="C"))


def hf_tensor_name(gguf_name: str, arch: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (experts' stacks:
    `model.layers.3.mlp.experts.gate_proj.weight`, one per expert once split)."""
    if m := _LAYER_NAME.fullmatch(gguf_name):
        layer, part, kind = m.groups()
        if arch in _GEMMA and part == "ffn_norm":
            return f"model.layers.{layer}.pre_feedforward_layernorm.{kind}"
        if arch == "phi3" and part == "ffn_up":  # gate and up, fused
            return f"model.layers.{layer}.mlp.gate_up_proj.{kind}"
        if part in _LAYER_TENSORS:
            return f"model.layers.{layer}.{_LAYER_TENSORS[part]}.{kind}"
    elif (m := _GLOBAL_NAME.fullmatch(gguf_name)) and m.group(1) in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[m.group(1)]}.{m.group(2)}"
    raise ValueError(f"unknown GGUF tensor {gguf_name!r}")


def unpermute_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of Q/K projections (back to rotate_half order)."""
    rows = weights.shape[0]
    w = weights.reshape(num_heads, rows // num_heads // 2, 2, *weights.shape[1:])
    return w.swapaxes(1, 2).reshape(weights.shape)
