"""Where the forward pass's time goes, op by op: the engine's profile switch (`LLMEngine.profile_ops`).

Inside `with engine.profile_ops() as recording:` torch's profiler records the steps run; on exit
`recording.result` holds an OpProfile: each step's phase times (the step observer's), every matmul's time
matched to its linear layer and summed by how the layer's weight is stored (a GGUF block type, or the
types of a fused projection's shards, "Q4_K+Q6_K"; bfloat16; float32; int8 ...), with the bytes and
FLOPs those layers hold, and paged attention's time. Nothing is added to a step for this: every kernel
already runs as a profiler range (each dispatcher op, and csrc/decoder.cpp marks the ops of a one-call
layer), which costs a check for registered callbacks while no profiler runs.

A forward pass calls the linear layers in model order (each decoder layer's qkv, o, gate_up, down), the
LM head last; the matmul calls are matched to the layers in that order, and only when their number is a
whole number of forward passes (a mixture of experts or a draft model's passes do not line up: their
matmul time is then reported unmatched).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from pagedllm.engine.stats import StepTrace
from pagedllm.models.linear import Linear, OneDNNLinear

MATMUL_OPS = ("aten::linear", "aten::addmm", "aten::mm", "aten::matmul", "mkldnn::_linear_pointwise")


def is_matmul(name: str) -> bool:
    """A profiler event that multiplies by a linear layer's weight: torch's and oneDNN's ops, and pagedllm's
    kernel (pagedllm_<isa>::linear)."""
    return name in MATMUL_OPS or (name.startswith("pagedllm_") and name.endswith("::linear"))


@dataclass(frozen=True)
class MatmulKind:
    """The linear layers whose weight is stored one way, and what the profiled steps spent in them."""

    kind: str  # "Q4_K", "Q4_K+Q6_K" (a fused projection's shards), "bfloat16 (oneDNN)", "float32", ...
    layers: int
    weight_bytes: int  # their storage, each byte read once by a forward pass
    flops_per_row: float  # 2 K N over the layers: FLOPs of one activation row through all of them
    calls: int  # matmul calls over the profiled steps
    seconds: float


@dataclass(frozen=True)
class OpProfile:
    """The profiled steps: phase times, matmuls by weight kind, attention, and the top ops."""

    steps: list[StepTrace]
    matmuls: list[MatmulKind]  # largest time first
    unmatched_matmul_seconds: float  # matmul calls that did not line up with the model's layers
    attention_seconds: float
    attention_calls: int
    top_ops: list[tuple[str, float]]  # (op, self CPU seconds over the steps), largest first

    @property
    def step_seconds(self) -> float:
        return sum(sum(s.seconds.values()) for s in self.steps)

    @property
    def forward_seconds(self) -> float:
        return sum(s.seconds["forward"] for s in self.steps)

    @property
    def matmul_seconds(self) -> float:
        return sum(m.seconds for m in self.matmuls) + self.unmatched_matmul_seconds


@dataclass
class OpRecording:
    """What `profile_ops` yields; `result` is set when the block ends."""

    result: OpProfile | None = None


def linears_in_call_order(model: torch.nn.Module) -> list[Linear]:
    """The model's linear layers in the order a forward pass calls them: model order, the LM head last."""
    head = model.lm_head
    return [*(m for m in model.modules() if isinstance(m, Linear) and m is not head), head]


def weight_kind(layer: Linear) -> str:
    """How a layer's weight is stored, as a name: GGUF block types ("+" between a fused projection's
    shards of different types), else the dtype or code format, with the multiplier where it is not
    pagedllm's kernel."""
    from gguf import GGMLQuantizationType

    stored = getattr(layer, "stored", None)
    if stored is not None:
        if stored.format != "gguf":
            return stored.format
        types = (GGMLQuantizationType(int(t)).name for t in stored.scales[:, 1].tolist())
        return "+".join(dict.fromkeys(types))
    if isinstance(layer.method, OneDNNLinear):
        return f"{str(layer.packed_weight.dtype)[6:]} (oneDNN)"
    return f"{str(layer.weight.dtype)[6:]} ({layer.method.name})"


def read_bytes(layer: Linear) -> int:
    """Bytes of the storage a matmul by the layer reads, its bias included (a tied LM head's plain copy
    kept for the embedding lookups beside oneDNN's packed one is not read by the matmul)."""
    stored = getattr(layer, "stored", None)
    if stored is not None:  # GGUF blocks: their bytes, not the table of each shard's rows and type
        tensors = [stored.data] if stored.format == "gguf" else stored.tensors()
    else:
        tensors = [layer.packed_weight if isinstance(layer.method, OneDNNLinear) else layer.weight]
    if layer.bias is not None:
        tensors.append(layer.bias)
    return sum(t.numel() * t.element_size() for t in tensors)


@contextmanager
def profile_ops(engine) -> Iterator[OpRecording]:
    """Profile the engine's steps run inside the block (see the module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    recording, steps = OpRecording(), []
    engine.add_step_observer(steps.append)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            yield recording
    finally:
        engine.remove_step_observer(steps.append)
    recording.result = summarize(engine.model, steps, prof.events())


def summarize(model: torch.nn.Module, steps: list[StepTrace], events) -> OpProfile:
    """The OpProfile of the profiled steps from the profiler's events (FunctionEvents)."""
    outermost = [e for e in events if is_matmul(e.name) and not _inside_matmul(e)]
    outermost.sort(key=lambda e: e.time_range.start)
    layers = linears_in_call_order(model)
    kinds = [weight_kind(layer) for layer in layers]
    seconds, calls = dict.fromkeys(kinds, 0.0), dict.fromkeys(kinds, 0)
    unmatched = 0.0
    if outermost and len(outermost) % len(layers) == 0:
        for i, event in enumerate(outermost):
            kind = kinds[i % len(layers)]
            seconds[kind] += event.cpu_time_total / 1e6
            calls[kind] += 1
    else:
        unmatched = sum(e.cpu_time_total for e in outermost) / 1e6
    groups: dict[str, list[Linear]] = {kind: [] for kind in kinds}
    for layer, kind in zip(layers, kinds, strict=True):
        groups[kind].append(layer)
    matmuls = [
        MatmulKind(
            kind,
            len(group),
            sum(read_bytes(layer) for layer in group),
            sum(2.0 * layer.in_features * layer.out_features for layer in group),
            calls[kind],
            seconds[kind],
        )
        for kind, group in groups.items()
    ]
    attention = [e for e in events if e.name.endswith("::paged_attention")]
    self_time: dict[str, float] = {}
    for e in events:
        self_time[e.name] = self_time.get(e.name, 0.0) + e.self_cpu_time_total / 1e6
    return OpProfile(
        list(steps),
        sorted(matmuls, key=lambda m: m.seconds, reverse=True),
        unmatched,
        sum(e.cpu_time_total for e in attention) / 1e6,
        len(attention),
        sorted(self_time.items(), key=lambda item: item[1], reverse=True),
    )


def _inside_matmul(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if is_matmul(parent.name):
            return True
        parent = parent.cpu_parent
    return False
