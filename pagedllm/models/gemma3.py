"""Gemma 3 (text): sliding-window local layers with their own RoPE base, interleaved with global layers.

Versus Llama: embeddings scaled by sqrt(hidden), (1 + w) RMSNorm, QK-norm, GELU-tanh MLP, norms after
attention and MLP as well as before, attention scale query_pre_attn_scalar^-1/2.

Gemma 2 is the same layer without QK-norm, one RoPE base for every layer, and attention scores and final
logits soft-capped (cap * tanh(x / cap); config.attn_logit_softcapping, final_logit_softcapping).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from pagedllm.models.attention import AttentionMetadata
from pagedllm.models.config import ModelConfig
from pagedllm.models.layers import Attention, CausalLM, DecoderLayer, GatedMLP, RMSNorm, RotaryEmbedding
from pagedllm.models.parallel import SINGLE, TensorParallel


class Gemma3DecoderLayer(DecoderLayer):
    """Norms around both the attention's and the MLP's outputs, QK-norm (Gemma 3), soft-capped scores
    (Gemma 2)."""

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TensorParallel):
        super().__init__()
        norm = partial(RMSNorm, eps=config.rms_norm_eps, unit_offset=True)
        self.is_sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.input_layernorm = norm(config.hidden_size)
        scale = config.query_pre_attn_scalar**-0.5
        self.self_attn = Attention(config, layer_idx, scale, qk_norm=norm if config.qk_norm else None, tp=tp)
        self.post_attention_layernorm = norm(config.hidden_size)
        self.pre_feedforward_layernorm = norm(config.hidden_size)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp=tp)
        self.post_feedforward_layernorm = norm(config.hidden_size)

    def forward_ops(
        self, h: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, meta: AttentionMetadata
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(h), positions, rotary, meta)
        h = h + self.post_attention_layernorm(attn)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))

    def feedforward_norms(self) -> tuple[RMSNorm, RMSNorm]:
        return self.pre_feedforward_layernorm, self.post_feedforward_layernorm


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__(config, tp)
        max_pos = config.max_position_embeddings
        self.global_rotary = RotaryEmbedding(config.head_dim, max_pos, config.rope_theta, config.rope_scaling)
        self.local_rotary = self.global_rotary  # Gemma 2: one RoPE for all layers
        if config.rope_local_theta is not None:
            self.local_rotary = RotaryEmbedding(config.head_dim, max_pos, config.rope_local_theta, None)
        self.embed_scale = config.hidden_size**0.5
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=True)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """A flattened batch of [T] tokens from many sequences -> [T, hidden] final hidden states."""
        h = self.embed(input_ids)
        h = h * torch.tensor(self.embed_scale, dtype=h.dtype)  # rounded to the model dtype, as trained
        for layer in self.layers:
            h = layer(h, positions, self.rotary_of(layer), meta)
        return self.norm(h)

    def rotary_of(self, layer: Gemma3DecoderLayer) -> RotaryEmbedding:
        """Local layers (a sliding window) have a RoPE of their own (Gemma 3)."""
        return self.local_rotary if layer.is_sliding else self.global_rotary
