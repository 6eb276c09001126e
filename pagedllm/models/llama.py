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

from pagedllm import ops
from pagedllm.models.attention import AttentionMetadata
from pagedllm.models.config import ModelConfig
from pagedllm.models.layers import Attention, CausalLM, GatedMLP, RMSNorm, RotaryEmbedding
from pagedllm.models.linear import KernelLinear, OneDNNLinear
from pagedllm.models.moe import SparseMoE
from pagedllm.models.parallel import SINGLE, TensorParallel
from pagedllm.ops import cpu


class LlamaDecoderLayer(nn.Module):
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
        self.one_call: tuple | None = None  # set by use_one_call: the layer's arguments for cpu.decoder_layer

    def forward(
        self, h: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, meta: AttentionMetadata
    ) -> torch.Tensor:
        if self.one_call is not None:
            layer_idx = self.self_attn.attn.layer_idx
            k_cache, v_cache = meta.kv_caches[layer_idx]
            slot_mapping, block_tables = meta.group_of(layer_idx)
            return cpu.decoder_layer(
                h,
                positions,
                k_cache,
                v_cache,
                slot_mapping,
                block_tables,
                meta.query_start_loc,
                meta.context_lens,
                self.one_call,
            )
        # h + attn(norm(h)), then h + mlp(norm(h)): each residual add happens inside the projection.
        h = self.self_attn(self.input_layernorm(h), positions, rotary, meta, residual=h)
        return self.mlp(self.post_attention_layernorm(h), residual=h)

    def use_one_call(self, rotary: RotaryEmbedding) -> None:
        """After loading: where the CPU kernels run every op of this layer (the cpu backend, every weight
        in the kernel's storage or oneDNN's, one rank, no QK-norm, a dense MLP), run the layer as one C++
        call of the same kernels (cpu.decoder_layer), which spares the ~80 us of Python its ten op calls
        cost (a quarter of a one-row decode step on 4-bit weights)."""
        attn, mlp, norm = self.self_attn, self.mlp, self.input_layernorm
        if attn.q_norm is not None or not isinstance(mlp, GatedMLP):
            self.one_call = None
            return
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        usable = (
            ops.get_backend_name(norm.weight.device, norm.weight.dtype) == "cpu"
            and all(isinstance(linear.method, KernelLinear | OneDNNLinear) for linear in linears)
            and attn.o_proj.tp.size == 1
        )
        self.one_call = (
            cpu.decoder_layer_args(
                rotary.cos_sin,
                norm.weight,
                self.post_attention_layernorm.weight,
                [linear.method.kernel_args(linear) for linear in linears],
                norm.eps,
                attn.num_heads,
                attn.num_kv_heads,
                attn.attn.scale,
                attn.attn.sliding_window,
                mlp.act,
            )
            if usable
            else None
        )


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
            h = layer(h, positions, self.rotary, meta)
        return self.norm(h)

    def finish_loading(self) -> None:
        for layer in self.layers:
            layer.use_one_call(self.rotary)
