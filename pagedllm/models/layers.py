"""Building blocks shared by the model families: norm, rotary embedding, MLP, attention, LM head.

The elementwise work goes through pagedllm.ops (fused C++ kernels on the CPU, PyTorch elsewhere); the
matmuls through Linear layers, whose LinearMethod decides how weights are stored and multiplied. Each
block holds this rank's part of a tensor-parallel group (models/parallel.py; all of it for one rank).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagedllm import ops
from pagedllm.models.attention import AttentionMetadata, PagedAttention
from pagedllm.models.config import ModelConfig
from pagedllm.models.parallel import (
    SINGLE,
    ColumnParallelLinear,
    LMHead,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    attention_heads,
    split,
)

if TYPE_CHECKING:
    from pagedllm.models.linear import Linear
    from pagedllm.models.lora import LoRAState


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32. Gemma scales by (1 + weight) and rounds afterwards."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, self.unit_offset)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequency of each rotated pair, with "linear", "llama3" or "longrope" scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "longrope":  # Phi-3: one factor per pair (config._longrope), written as transformers does
        factors = torch.tensor(scaling["long_factor" if scaling["long"] else "short_factor"])
        return 1.0 / (factors * theta**exponents)
    inv_freq = 1.0 / (theta**exponents)
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
    """A float32 table of every position's cos and sin, computed once; forward rotates q/k heads in place."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        # [max_positions, head_dim]: cos of each rotated pair's angle, then sin (both times longrope's
        # attention factor). A plain attribute rather than a buffer, so that casting the model to bf16
        # leaves it float32.
        self.cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
        if (scaling or {}).get("rope_type") == "longrope":
            self.cos_sin *= scaling["attention_factor"]

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> None:
        """Rotate [T, H, D] in place (pairing dim i with i + D/2, Hugging Face's rotate_half layout)."""
        ops.rotary_embedding_(x, positions, self.cos_sin)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up fused into one matmul; a rank holds a slice of the
    intermediate features (rows of gate and up, columns of down)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        act: str,
        bias: bool = False,
        tp: TensorParallel = SINGLE,
    ):
        super().__init__()
        part = split(intermediate_size, tp.size, tp.rank)
        self.gate_up_proj = ColumnParallelLinear(hidden_size, {"gate_proj": part, "up_proj": part}, bias=bias)
        self.down_proj = RowParallelLinear(part, hidden_size, tp, bias=bias)
        self.act = act

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP's output, plus `residual` if given (added inside the down projection)."""
        return self.down_proj(ops.act_and_mul(self.gate_up_proj(x), self.act), residual)


class Attention(nn.Module):
    """Self-attention over the paged cache: fused qkv, optional per-head QK-norm, RoPE, output projection.

    A rank computes its query heads and the KV heads they read (models/parallel.py: attention_heads).
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        scale: float,
        qk_norm: Callable[[int], nn.Module] | None = None,
        tp: TensorParallel = SINGLE,
    ):
        super().__init__()
        heads = attention_heads(config.num_heads, config.num_kv_heads, tp)
        self.num_heads, self.num_kv_heads = heads.q.size, heads.kv.size
        self.head_dim = d = config.head_dim
        parts = {"q_proj": heads.q.scaled(d), "k_proj": heads.kv.scaled(d), "v_proj": heads.kv.scaled(d)}
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, parts, bias=config.qkv_bias)
        self.o_proj = RowParallelLinear(heads.q.scaled(d), config.hidden_size, tp, bias=config.o_bias)
        self.q_norm = qk_norm(self.head_dim) if qk_norm else None
        self.k_norm = qk_norm(self.head_dim) if qk_norm else None
        window = config.layer_sliding_window(layer_idx)
        self.attn = PagedAttention(layer_idx, scale, window, config.attn_logit_softcapping)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        meta: AttentionMetadata,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The attention output, plus `residual` if given (added inside the output projection)."""
        num_tokens, num_heads, num_kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        heads = self.qkv_proj(x).view(num_tokens, num_heads + 2 * num_kv_heads, self.head_dim)
        qk, v = heads.split((num_heads + num_kv_heads, num_kv_heads), dim=1)
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :num_heads]), self.k_norm(qk[:, num_heads:])), dim=1)
        rotary(qk, positions)  # q and k heads together, in place
        q, k = qk.split((num_heads, num_kv_heads), dim=1)
        out = self.attn(q, k, v, meta)
        return self.o_proj(out.view(num_tokens, num_heads * self.head_dim), residual)


class DecoderLayer(nn.Module):
    """What every family's decoder layer shares: after loading, the whole layer in one call where the
    backend offers it (Backend.fused_decoder_layer: the cpu backend's C++ layer, equal to the bit to the
    ops one by one); else, or with `fused` None, the family's forward_ops.

    A family's layer has self_attn (Attention), mlp, input_layernorm and post_attention_layernorm, and
    says in feedforward_norms whether norms wrap its MLP (Gemma's (pre, post)). In a step with LoRA
    adapters, each projection's output gets their updates, in the one call as in the ops."""

    self_attn: Attention
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm
    lora_state: LoRAState | None = None  # set where adapters may run (models/lora.py: attach_lora)

    def __init__(self) -> None:
        super().__init__()
        self.fused: ops.FusedDecoderLayer | None = None  # set by fuse

    def forward(
        self, h: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, meta: AttentionMetadata
    ) -> torch.Tensor:
        if self.fused is None:
            return self.forward_ops(h, positions, rotary, meta)
        slot_mapping, args = self.self_attn.attn.paged_args(meta)
        lora = self.lora_state
        if lora is None or not lora.active:
            return self.fused(h, positions, slot_mapping, args)
        names = tuple(linear.lora.name for linear in self.projections())
        return self.fused(h, positions, slot_mapping, args, ops.LoRAOperands(lora.rows, lora.weights(names)))

    def forward_ops(
        self, h: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The layer's ops one by one."""
        raise NotImplementedError

    def feedforward_norms(self) -> tuple[RMSNorm, RMSNorm] | None:
        """The norms before and after the MLP, where they wrap it (Gemma); None: the MLP's output joins the
        residual as it is (Llama)."""
        return None

    def fuse(self, rotary: RotaryEmbedding) -> None:
        """After loading: run as one call from now on where the backend of the layer's weights offers it."""
        spec = self.decoder_layer_spec(rotary)
        weight = self.input_layernorm.weight
        self.fused = (
            None if spec is None else ops.get_backend(weight.device, weight.dtype).fused_decoder_layer(spec)
        )

    def projections(self) -> tuple[Linear, Linear, Linear, Linear]:
        """The linear layers a one-call layer runs, in its order: qkv, o, gate_up, down."""
        attn, mlp = self.self_attn, self.mlp
        return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj

    def decoder_layer_spec(self, rotary: RotaryEmbedding) -> ops.DecoderLayerSpec | None:
        """The layer as a backend's one call takes it; None where none can: a mixture of experts (tokens
        are routed between the ops) or several ranks (their outputs are summed between the ops)."""
        attn, mlp, norm = self.self_attn, self.mlp, self.input_layernorm
        if not isinstance(mlp, GatedMLP) or attn.o_proj.tp.size != 1:
            return None
        around_mlp = self.feedforward_norms()
        return ops.DecoderLayerSpec(
            projections=tuple(linear.method.kernel_args(linear) for linear in self.projections()),
            input_norm=norm.weight,
            post_attention_norm=self.post_attention_layernorm.weight,
            cos_sin=rotary.cos_sin,
            num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            activation=mlp.act,
            eps=norm.eps,
            unit_offset=norm.unit_offset,
            qk_norms=None if attn.q_norm is None else (attn.q_norm.weight, attn.k_norm.weight),
            feedforward_norms=None if around_mlp is None else tuple(n.weight for n in around_mlp),
        )


class CausalLM(nn.Module):
    """What every family shares: token embedding, LM head (tied to the embedding or not), float32 logits.

    Both hold the rank's slice of the vocabulary; `num_kv_heads` is what this rank's KV cache holds. A
    tied model has no embedding table of its own: the LM head's weight, stored however its LinearMethod
    stores it (quantized, say), serves the embedding lookups too.
    """

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.config = config
        self.tp = tp
        self.num_kv_heads = attention_heads(config.num_heads, config.num_kv_heads, tp).kv.size
        vocab = split(config.vocab_size, tp.size, tp.rank)
        tied = config.tie_word_embeddings
        self.embed_tokens = None if tied else VocabParallelEmbedding(vocab, config.hidden_size, tp)
        self.lm_head = LMHead(config.hidden_size, vocab, tp, serves_embedding=tied)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids -> embedding rows."""
        if self.embed_tokens is None:
            return self.lm_head.embed(input_ids)
        return self.embed_tokens(input_ids)

    layers: nn.ModuleList  # of DecoderLayer
    rotary: RotaryEmbedding

    def rotary_of(self, layer: DecoderLayer) -> RotaryEmbedding:
        """The RoPE a layer rotates q and k with (one for all layers, unless a family says otherwise)."""
        return self.rotary

    def finish_loading(self) -> None:
        """After the weights are loaded and every linear method has prepared its storage (load_model):
        each layer runs as one call from now on where the backend offers it."""
        for layer in self.layers:
            layer.fuse(self.rotary_of(layer))

    def compute_logits(self, hidden: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor | None:
        """[N, hidden] final hidden states -> [N, vocab] float32 logits (on rank 0; None on the others).
        `lm_head`: another head of one rank, over part of the vocabulary ([N, its rows]; a draft model's)."""
        logits = (lm_head or self.lm_head)(hidden).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits if lm_head is not None else self.tp.gather(logits, self.config.vocab_size)
