"""`cpu` backend: attention, the layer ops and a decoder layer in one call, each a C++ kernel of the library
ops/native.py builds for this CPU."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedllm.ops.backend import AttentionArgs, DecoderLayerSpec, FunctionBackend, LoRAOperands, LoRAWeights
from pagedllm.ops.native import ACTIVATIONS, kernels


def _as_int32(t: torch.Tensor) -> torch.Tensor:
    """t as a contiguous int32 tensor (the model runner's already is: then t itself, without a call)."""
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new tokens' K/V ([T, Hkv, D], rows may be strided) into cache slots; slot -1 means skip."""
    kernels().write_kv(key, value, k_cache, v_cache, slot_mapping.to(torch.int64).contiguous())


def paged_attention(q: torch.Tensor, args: AttentionArgs) -> torch.Tensor:
    """Query rows of sequence s are the last rows of its context; causal; see reference.py."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype)
    kernels().paged_attention(out, q, *_attention_operands(args))
    return out


def _attention_operands(args: AttentionArgs) -> tuple:
    """args as the C++ attention takes them (after out and q)."""
    return (
        args.k_cache,
        args.v_cache,
        _as_int32(args.block_tables),
        _as_int32(args.query_start_loc),
        _as_int32(args.context_lens),
        args.scale,
        args.sliding_window or 0,
        args.softcap or 0.0,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """x / rms(x) * weight over the last dim (Gemma: * (1 + weight)); x may be a strided 2-D or 3-D view."""
    out = torch.empty(x.shape, dtype=x.dtype)
    kernels().rms_norm(out, x, weight, eps, unit_offset)
    return out


def act_and_mul(x: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up for x = [gate | up] ([T, 2I] -> [T, I])."""
    out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
    kernels().act_and_mul(out, x, ACTIVATIONS[activation])
    return out


def rotary_embedding_(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Rotate x [T, H, D] (a strided view is fine) in place by position; cos_sin [max_pos, D] float32."""
    kernels().rotary_embedding(x, positions, cos_sin)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) for [rows, N] float32 (the first index of each row's largest, a NaN largest)."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.stride(-1) != 1 or x.shape[1] == 0:
        return x.argmax(dim=-1)
    return kernels().argmax_rows(x)


def lora_add(y: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, weights: LoRAWeights) -> None:
    """y[t] += B (A x[t]) by adapter rows[t] (-1: none), all adapters' rows in one call (csrc/lora.cpp)."""
    kernels().lora_add(y, x, rows, weights)


class CpuDecoderLayer:
    """A decoder layer (backend.DecoderLayerSpec) as one call of csrc/decoder.cpp: the same kernels, in the
    same order, as the layer's ops called one by one from Python, which it spares (~80 us a layer at one
    decode row, a quarter of a step on 4-bit weights)."""

    def __init__(self, spec: DecoderLayerSpec):
        pre, post = spec.feedforward_norms or (None, None)
        q_norm, k_norm = spec.qk_norms or (None, None)
        norms = [spec.input_norm, spec.post_attention_norm, pre, post, q_norm, k_norm]
        weights = [t for data, scales, mins, _, bias in spec.projections for t in (data, scales, mins, bias)]
        group_sizes = [group_size for *_, group_size, _ in spec.projections]
        self.operands = (spec.cos_sin, norms, weights, group_sizes, spec.eps, spec.unit_offset)
        self.operands += (spec.num_heads, spec.num_kv_heads, ACTIVATIONS[spec.activation])
        # per build: the operands as its DecoderLayerWeights (made once) and its decoder_layer op's C++ entry
        self.built: dict[str, tuple[object, Callable]] = {}

    def __call__(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        args: AttentionArgs,
        lora: LoRAOperands | None = None,
    ) -> torch.Tensor:
        """The step's index tensors must already be what the runner builds (contiguous; int64 positions
        and slots, int32 tables and lengths): they are passed as they are (the C++ checks them)."""
        ops, a = kernels(), args
        built = self.built.get(ops.name)
        if built is None:  # the selected build's first call (tests switch builds after loading)
            layer = getattr(torch.classes, ops.name).DecoderLayerWeights(*self.operands)
            # The op's C++ entry itself: torch's Python wrapper of an op taking a custom class scans every
            # argument for a fake one (torch.compile's tracing) on each call, ~40 us a layer at one decode
            # row, a tenth of SmolLM2's step on 4-bit weights; nothing here is traced.
            built = self.built[ops.name] = layer, ops.decoder_layer.default._op
        layer, decoder_layer = built
        return decoder_layer(
            h, positions, a.k_cache, a.v_cache, slot_mapping, a.block_tables, a.query_start_loc,
            a.context_lens, layer, a.scale, a.sliding_window or 0, a.softcap or 0.0,
            None if lora is None else lora.rows, [] if lora is None else lora.weights,
        )  # fmt: skip


def fused_decoder_layer(spec: DecoderLayerSpec) -> CpuDecoderLayer | None:
    """The layer in one call where every projection is in the C++ kernel's storage or oneDNN's (not, say,
    a weight torch's F.linear multiplies)."""
    if any(projection is None for projection in spec.projections):
        return None
    return CpuDecoderLayer(spec)


# The `cpu` backend: every op a C++ kernel, and a decoder layer in one call of them.
BACKEND = FunctionBackend(
    "cpu",
    write_kv,
    paged_attention,
    rms_norm,
    act_and_mul,
    rotary_embedding_,
    argmax,
    lora_add,
    fused_decoder_layer,
)
