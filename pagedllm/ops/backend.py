"""What every backend implements (`Backend`), and the arguments its attention and its one-call decoder
layer take, written once here.

A backend is an object; pagedllm.ops keeps a registry of them by name and sends each op to the backend
chosen for the tensors' device and dtype. Each backend module makes its own as a FunctionBackend of its
functions (BACKEND); a new backend is any object that implements `Backend` (a FunctionBackend, or one
made from the reference's with dataclasses.replace, keeps it short) and one `ops.register_backend` call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

# One linear layer's weight as the C++ linear kernel reads it (csrc/linear.cpp; models/linear.py's
# LinearMethod.kernel_args): (data, scales, mins, group_size, bias).
KernelWeight = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, int, torch.Tensor | None]


@dataclass(slots=True)  # not frozen: each layer makes one a step, and a frozen init costs ~3 us more
class AttentionArgs:
    """Where one layer's queries read K/V through the block tables, and how they attend.

    Shapes (reference.py says more): caches [num_blocks, block_size, Hkv, D] views; block_tables
    [S, max_blocks] int32; context_lens [S] int32, the tokens in the cache for each sequence, this step's
    included. Query rows query_start_loc[s]:query_start_loc[s + 1] are the last tokens of sequence s's
    context, causal among themselves; None means one row per sequence (a decode step).
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    scale: float
    query_start_loc: torch.Tensor | None = None
    sliding_window: int | None = None  # a query sees the keys (pos - window, pos]
    softcap: float | None = None  # scores capped at +-softcap by softcap * tanh(score / softcap) (Gemma 2)
    max_query_len: int | None = None  # the most rows of one sequence, if known (1: a decode step)

    def __post_init__(self) -> None:
        if self.query_start_loc is None:
            one_row_each = torch.arange(
                self.context_lens.shape[0] + 1, dtype=torch.int32, device=self.context_lens.device
            )
            self.query_start_loc = one_row_each
            self.max_query_len = 1

    @property
    def decode(self) -> bool:
        """Whether every sequence has one query row."""
        return self.max_query_len == 1


@dataclass(frozen=True)
class DecoderLayerSpec:
    """One decoder layer as a backend may run it in one call (built once, after loading):

      x = input_norm(h); q, k, v = x Wqkv; q, k = qk_norms(q, k) if any; rotate q, k; store k, v
      a = attention(q) (AttentionArgs)
      without feedforward_norms (Llama): h = h + a Wo; x = post_attention_norm(h); h = h + mlp(x)
      with them, (pre, post) (Gemma):   h = h + post_attention_norm(a Wo); x = pre(h); h = h + post(mlp(x))
      mlp(x) = act_and_mul(x Wgate_up) Wdown

    Every norm is an RMSNorm of eps and unit_offset (Gemma's * (1 + weight)).
    """

    projections: tuple[KernelWeight | None, ...]  # qkv, o, gate_up, down; None: not in the kernel's storage
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    cos_sin: torch.Tensor  # the rotary table (layers.RotaryEmbedding)
    num_heads: int
    num_kv_heads: int
    activation: str  # "silu" or "gelu_pytorch_tanh"
    eps: float
    unit_offset: bool = False
    qk_norms: tuple[torch.Tensor, torch.Tensor] | None = None  # per-head norms of q and k (Qwen3, Gemma 3)
    feedforward_norms: tuple[torch.Tensor, torch.Tensor] | None = None  # Gemma's (pre, post) of the MLP


LoRAWeights = list[Tensor | None]  # per adapter, (a, b, spans) of each projection (Backend.lora_add)


@dataclass(slots=True)
class LoRAOperands:
    """A step's LoRA adapters as a one-call layer takes them: rows[t] is row t's adapter (-1: none), and
    weights holds, per adapter, (a, b, spans) of each of the layer's projections (qkv, o, gate_up, down;
    None where it does not adapt one)."""

    rows: torch.Tensor
    weights: LoRAWeights


class FusedDecoderLayer(Protocol):
    """A decoder layer in one call: h [T, hidden] -> the layer's output, storing this step's K/V, each
    projection's output updated by the step's adapters (if any) as Backend.lora_add updates it."""

    def __call__(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        args: AttentionArgs,
        lora: LoRAOperands | None = None,
    ) -> torch.Tensor: ...


@runtime_checkable
class Backend(Protocol):
    """The ops a backend runs. Tensors in, tensors out: no engine concepts."""

    name: str

    def write_kv(
        self, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
    ) -> None:
        """Scatter new tokens' K/V ([T, Hkv, D]) into cache slots (slot_mapping [T] int64); -1 skips."""

    def paged_attention(self, q: torch.Tensor, args: AttentionArgs) -> torch.Tensor:
        """q [T, H, D] -> [T, H, D], reading K/V through args' block tables."""

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
    ) -> torch.Tensor:
        """x / rms(x) * weight over the last dim (Gemma: * (1 + weight)); float32 math, x's dtype out."""

    def act_and_mul(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        """act(gate) * up for x = [gate | up], [T, 2I] -> [T, I]."""

    def rotary_embedding_(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
        """Rotate x [T, H, D] in place by each token's position (cos_sin [max_positions, D] float32)."""

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """x.argmax(dim=-1) for x [rows, N]: the first index of each row's largest, a NaN largest."""

    def lora_add(self, y: Tensor, x: Tensor, rows: Tensor, weights: LoRAWeights) -> None:
        """y[t] += B (A x[t]) in place, by adapter rows[t] ([T] int64; -1: none). Per adapter, weights
        holds a [P * r, in] (the A of each of its P pieces stacked), b [r, N] (each piece's B transposed,
        side by side, scaled) and spans [P, 2] int64 (each piece's first row of y and its rows), or
        three None where the adapter does not adapt this projection."""

    def fused_decoder_layer(self, spec: DecoderLayerSpec) -> FusedDecoderLayer | None:
        """The layer as one call, equal to the bit to its ops one by one on this backend; None where
        this backend cannot run it so."""


def no_fused_layer(spec: DecoderLayerSpec) -> None:
    """A backend without a one-call layer's answer: every layer runs its ops one by one."""
    return None


@dataclass(frozen=True)
class FunctionBackend:
    """A Backend made of a module's functions (each backend module's BACKEND); dataclasses.replace makes
    one that differs in some of them (sdpa and triton keep the reference's elementwise ops)."""

    name: str
    write_kv: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], None]
    paged_attention: Callable[[Tensor, AttentionArgs], Tensor]
    rms_norm: Callable[[Tensor, Tensor, float, bool], Tensor]
    act_and_mul: Callable[[Tensor, str], Tensor]
    rotary_embedding_: Callable[[Tensor, Tensor, Tensor], None]
    argmax: Callable[[Tensor], Tensor]
    lora_add: Callable[[Tensor, Tensor, Tensor, LoRAWeights], None]
    fused_decoder_layer: Callable[[DecoderLayerSpec], FusedDecoderLayer | None] = no_fused_layer
