"""ModelConfig: the architecture numbers a model family needs, read from a Hugging Face config."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass
class ModelConfig:
    """Plain numbers describing one decoder-only checkpoint (Hugging Face naming in comments)."""

    architecture: str  # architectures[0], e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int  # num_hidden_layers
    num_heads: int  # num_attention_heads
    num_kv_heads: int  # num_key_value_heads
    head_dim: int
    rms_norm_eps: float
    rope_theta: float  # base of the full-attention layers
    # {"rope_type": "linear" | "llama3" | "longrope", ...}; None for plain RoPE. longrope's also holds
    # "long" (which factor set: see for_context) and its resolved "attention_factor".
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    hidden_act: str = "silu"
    qkv_bias: bool = False  # Qwen2: bias on q/k/v only
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each q and k head before RoPE
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None  # window of the layers whose type is "sliding_attention"
    layer_types: list[str] = field(default_factory=list)  # "full_attention" | "sliding_attention"
    rope_local_theta: float | None = None  # Gemma 3: RoPE base of the sliding layers
    query_pre_attn_scalar: float | None = None  # Gemma 3: attention scale is its -1/2 power
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None  # Gemma 2: attention scores capped at +-this (tanh)
    # Mixture of experts (Qwen3-MoE, Mixtral): the layers whose MLP is `num_experts` experts of
    # moe_intermediate_size, a router picking num_experts_per_tok of them per token.
    moe_layers: list[int] = field(default_factory=list)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the chosen experts' router probabilities renormalized to sum to 1

    def for_context(self, max_model_len: int | None) -> ModelConfig:
        """This config for an engine of at most `max_model_len` tokens a sequence (None: the model's
        context). Only Phi-3's longrope depends on it: the long factors where that exceeds
        original_max_position_embeddings, else the short ones, for every position (see _longrope)."""
        scaling = self.rope_scaling
        if not scaling or scaling["rope_type"] != "longrope":
            return self
        context = max_model_len or self.max_position_embeddings
        long = context > scaling["original_max_position_embeddings"]
        return self if long == scaling["long"] else replace(self, rope_scaling={**scaling, "long": long})

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The attention window of one layer (None: full causal attention)."""
        return self.sliding_window if self.layer_types[layer_idx] == "sliding_attention" else None

    @classmethod
    def from_hf_dict(cls, config: dict[str, Any]) -> ModelConfig:
        """Build from a config.json dict; Hugging Face's config classes fill in the family's defaults."""
        from transformers import AutoConfig

        architectures = config.get("architectures") or []
        if not architectures or "model_type" not in config:
            raise ValueError("config.json needs 'architectures' and 'model_type' to pick a model family")
        try:
            hf = AutoConfig.for_model(**config)
        except ValueError as e:
            raise ValueError(f"unsupported model_type {config['model_type']!r}: {e}") from e
        text = hf.get_text_config()  # Gemma3ForConditionalGeneration nests the language model's config
        return cls._from_text_config(architectures[0], text, hf)

    @classmethod
    def _from_text_config(cls, architecture: str, text: Any, hf: Any) -> ModelConfig:
        get = lambda name, default=None: getattr(text, name, default)
        num_layers = text.num_hidden_layers
        rope = dict(text.rope_parameters or {})
        local_rope = None
        if "full_attention" in rope:  # per-layer-type RoPE (Gemma 3)
            local_rope = rope.get("sliding_attention")
            rope = dict(rope["full_attention"])
        for params in (rope, local_rope or {}):
            _check_rope(params)
        layer_types = list(get("layer_types") or [])
        if not layer_types:  # e.g. Mistral: one window for every layer, when it has one
            kind = "sliding_attention" if get("sliding_window") else "full_attention"
            layer_types = [kind] * num_layers
        attention_bias = bool(get("attention_bias", False))
        is_qwen2 = text.model_type == "qwen2"
        qk_norm = text.model_type in ("qwen3", "qwen3_moe", "gemma3_text")
        hidden_act = get("hidden_activation") or get("hidden_act") or "silu"
        if hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"unsupported activation {hidden_act!r}; supported: {SUPPORTED_ACTIVATIONS}")
        eos = get("eos_token_id", getattr(hf, "eos_token_id", None))
        return cls(
            architecture=architecture,
            vocab_size=text.vocab_size,
            hidden_size=text.hidden_size,
            intermediate_size=text.intermediate_size,
            num_layers=num_layers,
            num_heads=text.num_attention_heads,
            num_kv_heads=get("num_key_value_heads") or text.num_attention_heads,
            head_dim=get("head_dim") or text.hidden_size // text.num_attention_heads,
            rms_norm_eps=text.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            rope_scaling=_scaling(rope, text.max_position_embeddings),
            max_position_embeddings=text.max_position_embeddings,
            tie_word_embeddings=bool(get("tie_word_embeddings", getattr(hf, "tie_word_embeddings", False))),
            bos_token_id=get("bos_token_id", getattr(hf, "bos_token_id", None)),
            eos_token_ids=_as_list(eos),
            hidden_act=hidden_act,
            qkv_bias=attention_bias or is_qwen2,
            qk_norm=qk_norm,
            o_bias=attention_bias,
            mlp_bias=bool(get("mlp_bias", False)),
            sliding_window=get("sliding_window"),
            layer_types=layer_types,
            rope_local_theta=float(local_rope["rope_theta"]) if local_rope else None,
            query_pre_attn_scalar=get("query_pre_attn_scalar"),
            final_logit_softcapping=get("final_logit_softcapping"),
            attn_logit_softcapping=get("attn_logit_softcapping"),
            **_moe_fields(text),
        )


def _moe_fields(text: Any) -> dict[str, Any]:
    """The expert settings: Mixtral's layers are all sparse, experts of intermediate_size, the chosen
    weights renormalized; Qwen3-MoE's every decoder_sparse_step-th layer is, but mlp_only_layers."""
    if text.model_type == "mixtral":
        return dict(
            moe_layers=list(range(text.num_hidden_layers)),
            num_experts=text.num_local_experts,
            num_experts_per_tok=text.num_experts_per_tok,
            moe_intermediate_size=text.intermediate_size,
            norm_topk_prob=True,
        )
    num_experts = getattr(text, "num_experts", 0) or 0
    if not num_experts:
        return {}
    step, dense = text.decoder_sparse_step, set(text.mlp_only_layers)
    return dict(
        moe_layers=[i for i in range(text.num_hidden_layers) if (i + 1) % step == 0 and i not in dense],
        num_experts=num_experts,
        num_experts_per_tok=text.num_experts_per_tok,
        moe_intermediate_size=text.moe_intermediate_size,
        norm_topk_prob=bool(text.norm_topk_prob),
    )


def _scaling(rope: dict[str, Any], max_position_embeddings: int) -> dict[str, Any] | None:
    """The RoPE scaling parameters, None for plain RoPE; longrope's resolved by _longrope."""
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        return None
    return _longrope(rope, max_position_embeddings) if rope_type == "longrope" else rope


def _longrope(rope: dict[str, Any], max_position_embeddings: int) -> dict[str, Any]:
    """Phi-3's longrope as transformers computes it: inverse frequencies divided per pair by short_factor
    or long_factor, cos and sin multiplied by attention_factor (default sqrt(1 + ln(s) / ln(original)) for
    s = factor, else the context's ratio to original_max_position_embeddings, above 1).

    Transformers picks the factor set per forward by the longest position in it and recomputes the whole
    cache when a generation crosses original_max_position_embeddings. A paged cache keeps its keys, so
    pagedllm picks one set per engine, as vLLM and llama.cpp do: the long one where a sequence may grow
    past the original context (for_context); "long" here is that choice for the model's own context."""
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor")
    if factor is None:
        factor = max_position_embeddings / original
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {
        **rope,
        "attention_factor": attention_factor,
        "long": max_position_embeddings > original,
    }


def _check_rope(params: dict[str, Any]) -> None:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported RoPE scaling type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial rotary embeddings are not supported: {params['partial_rotary_factor']}")


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)
