"""Building blocks shared by the model families: norm, rotary embedding, fused linears, MLP, attention."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.models.attention import AttentionMetadata, PagedAttention
from pagedllm.models.config import ModelConfig

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class Linear(nn.Module):
    """y = x W^T (+ b). Like every parameter here, W starts uninitialised: the loader fills it."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    """Token id -> row of the (uninitialised until loaded) embedding table."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32. Gemma scales by (1 + weight) and rounds afterwards."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        if self.unit_offset:
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * normed.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequency of each rotated pair, with "linear" or "llama3" scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_context = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """float32 cos/sin tables for every position, computed once; forward looks up a batch's positions."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", angles.cos(), persistent=False)  # [max_positions, head_dim / 2]
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions -> (cos, sin), each [T, 1, head_dim / 2] in dtype, broadcasting over heads."""
        return self.cos[positions, None].to(dtype), self.sin[positions, None].to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, H, D] by position, pairing dim i with dim i + D/2 (Hugging Face's rotate_half layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class MergedLinear(Linear):
    """Several projections of the same input as one matmul (e.g. q, k, v); shards are stacked by rows.

    `shards` maps each checkpoint projection name to its output size, in order; the loader fills the rows.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool):
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shards = shards


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool = False):
        super().__init__()
        shards = {"gate_proj": intermediate_size, "up_proj": intermediate_size}
        self.gate_up_proj = MergedLinear(hidden_size, shards, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class Attention(nn.Module):
    """Self-attention over the paged cache: fused qkv, optional per-head QK-norm, RoPE, output projection."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        scale: float,
        qk_norm: Callable[[int], nn.Module] | None = None,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        shards = {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}
        self.qkv_proj = MergedLinear(config.hidden_size, shards, bias=config.qkv_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm = qk_norm(self.head_dim) if qk_norm else None
        self.k_norm = qk_norm(self.head_dim) if qk_norm else None
        self.attn = PagedAttention(layer_idx, scale, config.layer_sliding_window(layer_idx))

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens, num_heads, head_dim = x.shape[0], self.num_heads, self.head_dim
        qkv = self.qkv_proj(x)
        qk_size = (num_heads + self.num_kv_heads) * head_dim
        qk = qkv[:, :qk_size].view(num_tokens, num_heads + self.num_kv_heads, head_dim)
        v = qkv[:, qk_size:].view(num_tokens, self.num_kv_heads, head_dim)
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :num_heads]), self.k_norm(qk[:, num_heads:])), dim=1)
        qk = apply_rotary(qk, *rope)  # q and k heads together: one set of elementwise ops
        out = self.attn(qk[:, :num_heads], qk[:, num_heads:], v, meta)
        return self.o_proj(out.reshape(num_tokens, num_heads * head_dim))


class CausalLM(nn.Module):
    """What every family shares: token embedding, (possibly tied) LM head, float32 logits."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] final hidden states -> [N, vocab] float32 logits."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(hidden, weight).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
