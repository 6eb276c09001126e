"""Where an engine run's time goes (`pagedllm bench throughput --profile`).

Three views of the same engine, all measured in the process that ran the benchmark:
  phases  wall time of each engine phase per step (schedule, building the step's inputs, the model
          forward, sampling, the rest: block tables, appending tokens, detokenizing, outputs), split
          into steps that prefill and decode-only steps; host work = everything but the forward
  ops     torch.profiler's top operators over a few decode steps at the workload's batch size, and
          the rate paged attention read K/V at there against a read of memory in order (a sum)
  GEMMs   the model's own linear layers timed alone at the step's row counts: their sum is the floor
          a step cannot go below, and model FLOPs / time is the rate to hold against their rate
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from pagedllm.engine.stats import STEP_PHASES, StepTrace
from pagedllm.models.linear import Linear


@dataclass
class PhaseProfile:
    """Per-step phase times of one engine run."""

    steps: list[StepTrace] = field(default_factory=list)

    def totals(self, prefill: bool) -> tuple[int, dict[str, float]]:
        """Number of steps of one kind (with a prefill, or decode-only) and their summed phase seconds."""
        chosen = [s for s in self.steps if (s.prefill_tokens > 0) == prefill]
        summed = {p: sum(s.seconds[p] for s in chosen) for p in STEP_PHASES}
        return len(chosen), summed


@contextmanager
def record_phases(engine) -> Iterator[PhaseProfile]:
    """Record every engine step's phase times while the block runs (the engine's step observer)."""
    profile = PhaseProfile()
    engine.add_step_observer(profile.steps.append)
    try:
        yield profile
    finally:
        engine.remove_step_observer(profile.steps.append)


@dataclass
class OpProfile:
    """torch.profiler's view of a few decode steps."""

    ops: list[tuple[str, float, float]]  # the top operators: name, share of CPU time, ms per step
    attention_seconds: float  # self time of the paged attention op over the steps
    kv_bytes: int  # K/V bytes that attention had to read over the steps (every layer's context)


def top_ops(engine, prompts: list[list[int]], decode_steps: int = 3, limit: int = 8) -> OpProfile:
    """The top operators over a few decode steps of the given prompts (their prefill runs first,
    unprofiled), and what paged attention read in them."""
    from torch.profiler import ProfilerActivity, profile

    from pagedllm.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=decode_steps + 2, temperature=0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"profile-{i}", ids, params)
    while engine.stats().num_waiting:  # prefill every prompt first
        engine.step()
    token_bytes = engine.kv_cache_bytes // (engine.num_kv_blocks * engine.config.block_size)
    with record_phases(engine) as steps, profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(decode_steps):
            engine.step()
    context_tokens = sum(trace.context_tokens for trace in steps.steps)
    while engine.has_unfinished_requests():
        engine.step()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    attention = sum(e.self_cpu_time_total for e in events if e.key.endswith("::paged_attention")) / 1e6
    ops = [
        (e.key, e.self_cpu_time_total / total, e.self_cpu_time_total / 1e3 / decode_steps)
        for e in events[:limit]
    ]
    return OpProfile(ops, attention, context_tokens * token_bytes)


@dataclass
class GemmFloor:
    rows: int
    seconds: float  # every linear layer of the model once, back to back, at `rows` rows
    hot_seconds: float  # the same sum, each shape timed on one layer repeatedly (its weights in cache)
    flops: float

    @property
    def gflop_s(self) -> float:
        return self.flops / self.seconds / 1e9


def linear_layers(model: torch.nn.Module) -> list[Linear]:
    """The model's linear layers in order, LM head last."""
    layers = [m for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head]
    return [*layers, model.lm_head]


def gemm_floor(
    model: torch.nn.Module, rows: int, head_rows: int, dtype: torch.dtype, reps: int = 5
) -> GemmFloor:
    """What a step's matmuls cost here: every linear layer of the model once at `rows` rows (the LM head at
    `head_rows`), back to back with their own methods, as a step runs them: median of reps. Also the sum
    of per-shape times with each weight hot in the cache, the floor's floor."""
    layers = linear_layers(model)
    inputs = {}
    for layer in layers:
        m = head_rows if layer is model.lm_head else rows
        inputs.setdefault((m, layer.in_features), torch.randn(m, layer.in_features).to(dtype))
    feed = [
        (layer, inputs[(head_rows if layer is model.lm_head else rows, layer.in_features)])
        for layer in layers
    ]

    def one_pass() -> float:
        start = time.perf_counter()
        for layer, x in feed:
            layer(x)
        return time.perf_counter() - start

    def hot(layer: Linear, x: torch.Tensor) -> float:
        layer(x)
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            layer(x)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    with torch.inference_mode():
        one_pass()
        seconds = statistics.median(one_pass() for _ in range(reps))
        per_shape: dict[tuple, float] = {}
        for layer, x in feed:
            key = (x.shape[0], layer.in_features, layer.out_features)
            if key not in per_shape:
                per_shape[key] = hot(layer, x)
        hot_seconds = sum(per_shape[(x.shape[0], layer.in_features, layer.out_features)] for layer, x in feed)
    flops = sum(2.0 * x.shape[0] * layer.in_features * layer.out_features for layer, x in feed)
    return GemmFloor(rows, seconds, hot_seconds, flops)


def model_flops(model: torch.nn.Module, tokens: int, logit_rows: int) -> float:
    """FLOPs of the model's matmuls for `tokens` tokens with logits for `logit_rows` of them."""
    head = model.lm_head
    per_token = sum(2.0 * m.in_features * m.out_features for m in linear_layers(model) if m is not head)
    return per_token * tokens + 2.0 * head.in_features * head.out_features * logit_rows


def report(engine, profile: PhaseProfile, ops: OpProfile, dtype: torch.dtype) -> list[str]:
    """The --profile section of `bench throughput`, as printed lines."""
    model = engine.model
    lines = ["profile (paged):"]
    for prefill, label in ((True, "steps with a prefill"), (False, "decode-only steps")):
        count, phases = profile.totals(prefill)
        if not count:
            continue
        total = sum(phases.values())
        host = total - phases["forward"]
        shares = ", ".join(f"{p} {phases[p] / total:.1%}" for p in STEP_PHASES)
        lines.append(
            f"  {label}: {count} steps, {total:.2f} s ({total / count * 1e3:.1f} ms/step): {shares}; "
            f"host work {host / total:.1%}"
        )
    decode_steps = [s for s in profile.steps if s.prefill_tokens == 0 and s.decode_seqs]
    if decode_steps:
        batch = round(statistics.mean(s.decode_seqs for s in decode_steps))
        step_s = statistics.median(sum(s.seconds.values()) for s in decode_steps)
        floor = gemm_floor(model, batch, batch, dtype)
        lines.append(
            f"  decode step at batch ~{batch}: median {step_s * 1e3:.1f} ms; its GEMMs alone, back to back "
            f"{floor.seconds * 1e3:.1f} ms ({floor.gflop_s:.0f} GFLOP/s; each with its weights hot in the "
            f"cache {floor.hot_seconds * 1e3:.1f} ms): step / GEMMs = {step_s / floor.seconds:.2f}"
        )
    prefill_steps = [s for s in profile.steps if s.prefill_tokens > 0]
    if prefill_steps:
        tokens = sum(s.prefill_tokens for s in prefill_steps)
        seconds = sum(sum(s.seconds.values()) for s in prefill_steps)
        rows = max(s.prefill_tokens for s in prefill_steps)
        floor = gemm_floor(model, rows, 1, dtype, reps=3)
        rate = model_flops(model, tokens, 0) / seconds / 1e9
        lines.append(
            f"  prefill: {tokens:,} tokens in {seconds:.2f} s = {rate:.0f} GFLOP/s of matmuls; "
            f"the same GEMMs alone at {rows} rows: {floor.gflop_s:.0f} GFLOP/s ({rate / floor.gflop_s:.0%})"
        )
    all_tokens = sum(s.prefill_tokens + s.decode_seqs for s in profile.steps)
    logit_rows = sum(s.decode_seqs for s in profile.steps) + len(prefill_steps)
    seconds = sum(sum(s.seconds.values()) for s in profile.steps)
    lines.append(
        f"  whole run: {model_flops(model, all_tokens, logit_rows) / 1e12:.2f} TFLOP of matmuls in "
        f"{seconds:.1f} s = {model_flops(model, all_tokens, logit_rows) / seconds / 1e9:.0f} GFLOP/s"
    )
    lines.append("  top ops over decode steps (self CPU time):")
    lines += [f"    {name:<40} {share:6.1%} {ms:8.2f} ms/step" for name, share, ms in ops.ops]
    if ops.attention_seconds:
        from pagedllm.bench.kernel import read_bandwidth_gb_s

        rate, read = ops.kv_bytes / ops.attention_seconds / 1e9, read_bandwidth_gb_s(torch.device("cpu"))
        lines.append(
            f"  paged attention over those steps read {rate:.1f} GB/s of K/V, {rate / read:.0%} of the "
            f"{read:.1f} GB/s a sum over 512 MiB reads here"
        )
    return lines
