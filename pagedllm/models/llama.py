"""Llama family: Llama 2/3, SmolLM2, TinyLlama; Qwen2 (bias on q/k/v), Mistral (sliding window), Qwen3
(QK-norm), Phi-3 (q/k/v and gate/up fused in the checkpoint) and Qwen3-MoE and Mixtral (experts in
place of the MLP).

The differences live in ModelConfig (qkv_bias, qk_norm, layer_types/sliding_window, moe_layers) and in the
loader (fused checkpoint tensors are split into the projections they hold), not here.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from pagedllm.models.attention import AttentionMetadata
from pagedllm.models.config import ModelConfig
from pagedllm.models.layers import Attention, CausalLM, DecoderLayer, GatedMLP, RMSNorm, RotaryEmbedding
from pagedllm.models.moe import SparseMoE
from pagedllm.models.parallel import SINGLE, TensorParallel


class LlamaDecoderLayer(DecoderLayer):
    """Pre-norm block: h + attn(norm(h)), then h + mlp(norm(h))."""

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TensorParallel):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        qk_norm = partial(RMSNorm, eps=config.rms_norm_eps) if config.qk_norm else None
        self.self_attn = Attention(config, layer_idx, config.head_dim**-0.5, qk_norm=qk_norm, tp=tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if layer_idx in config.moe_layers:
            self.mlp = SparseMoE(config, tp)
        else:
            self.mlp = GatedMLP(
                config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias, tp=tp
            )

    def forward_ops(
        self, h: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, meta: AttentionMetadata
    ) -> torch.Tensor:
        # h + attn(norm(h)), then h + mlp(norm(h)): each residual add happens inside the projection.
        h = self.self_attn(self.input_layernorm(h), positions, rotary, meta, residual=h)
        return self.mlp(self.post_attention_layernorm(h), residual=h)


class LlamaForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__(config, tp)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """A flattened batch of [T] tokens from many sequences -> [T, hidden] final hidden states."""
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h, positions, self.rotary_of(layer), meta)
        return self.norm(h)
