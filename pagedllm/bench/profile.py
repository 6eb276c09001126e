"""Where an engine run's time goes (`pagedllm bench throughput --profile`).

Three views of the same engine, all measured in the process that ran the benchmark:
  phases  wall time of each engine phase per step (schedule, building the step's inputs, the model
          forward, sampling, the rest: block tables, appending tokens, detokenizing, outputs), split
          into steps that prefill and decode-only steps; host work = everything but the forward
  ops     the engine's op profile (LLMEngine.profile_ops) of a few decode steps at the workload's batch
          size: matmuls by weight kind (time, bytes, GB/s, GFLOP/s), attention, the other ops and the
          host's work, against the read rate (a sum) and GEMM rate (torch.mm) this process measures;
          the top operators; the rate paged attention read K/V at
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

from pagedllm.engine.op_profile import OpProfile
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


def profile_decode(engine, prompts: list[list[int]], decode_steps: int = 3) -> OpProfile:
    """The engine's op profile (LLMEngine.profile_ops) of `decode_steps` decode steps of all the given
    prompts at once: their prefills run first, unprofiled, then the profiled steps, then the requests
    are aborted."""
    from pagedllm.sampling_params import SamplingParams

    max_model_len = engine.run_info().max_model_len
    room = max_model_len - decode_steps - 2  # the prefill's token and one step to finish chunks
    if any(len(prompt) > room for prompt in prompts):
        longest = max(len(prompt) for prompt in prompts)
        raise ValueError(
            f"max_model_len {max_model_len} leaves no room for {decode_steps} profiled steps "
            f"after a {longest}-token prompt"
        )
    ids = [f"profile-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        params = SamplingParams(max_tokens=max_model_len - len(prompt), temperature=0, ignore_eos=True)
        engine.add_request(request_id, prompt, params)
    while engine.stats().num_waiting:
        engine.step()
    while _one_step(engine).prefill_tokens:  # the last prompt's chunks
        pass
    with engine.profile_ops() as recording:
        for _ in range(decode_steps):
            engine.step()
    for request_id in ids:
        engine.abort_request(request_id)
    return recording.result


def _one_step(engine) -> StepTrace:
    """Run one step; its trace."""
    traces: list[StepTrace] = []
    engine.add_step_observer(traces.append)
    try:
        engine.step()
    finally:
        engine.remove_step_observer(traces.append)
    return traces[0]


def kv_bytes_read(engine, ops: OpProfile) -> int:
    """K/V bytes attention had to read over the profiled steps: every layer's context of each sequence."""
    return sum(trace.context_tokens for trace in ops.steps) * engine.run_info().kv_token_bytes


@dataclass(frozen=True)
class MachineRates:
    """What this process measures the machine does: a read of memory in order, and a large GEMM."""

    read_gb_s: float  # a sum over 512 MiB of float32
    gemm_gflop_s: dict[torch.dtype, float]  # torch.mm of two n x n matrices, per dtype
    gemm_n: dict[torch.dtype, int] = field(default_factory=dict)  # that n, where not GEMM_N

    @classmethod
    def measure(cls, dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)) -> MachineRates:
        from pagedllm.bench.kernel import read_bandwidth_gb_s

        sized = {d: gemm_gflop_s(d) for d in dtypes}
        rates = {d: rate for d, (rate, _) in sized.items()}
        smaller = {d: n for d, (_, n) in sized.items() if n != GEMM_N}
        return cls(read_bandwidth_gb_s(torch.device("cpu")), rates, smaller)


GEMM_N = 2048
GEMM_SECONDS = 1.0  # the longest one product of a smaller n may take


def gemm_gflop_s(dtype: torch.dtype, reps: int = 3) -> tuple[float, int]:
    """GFLOP/s of torch.mm on two n x n matrices of `dtype` (best of reps), and n: GEMM_N, or smaller where
    the next doubling of n would take over GEMM_SECONDS a product (a dtype the CPU has no instructions for,
    as bf16 on AVX2-only CPUs, runs oneDNN's reference loops: minutes a product at 2048)."""
    n = 256
    while True:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        torch.mm(a, b)
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
        if n == GEMM_N or best * 8 > GEMM_SECONDS:
            return 2.0 * n**3 / best / 1e9, n
        n *= 2


def step_breakdown(
    ops: OpProfile, rates: MachineRates, dtype: torch.dtype, unprofiled_step_s: float | None = None
) -> list[str]:
    """Where the profiled decode steps' time went: matmuls by weight kind (time, bytes, GB/s, GFLOP/s),
    attention, the other ops of the forward pass and the host's work, against the machine's rates."""
    steps = len(ops.steps)
    rows = sum(trace.decode_seqs for trace in ops.steps)  # activation rows of every matmul, all steps
    step_s = ops.step_seconds / steps
    unprofiled = f", {unprofiled_step_s * 1e3:.1f} unprofiled" if unprofiled_step_s else ""
    lines = [
        f"  {steps} decode steps profiled at batch {rows / steps:g}: {step_s * 1e3:.1f} ms a step "
        f"profiled{unprofiled}",
        f"    {'':<38} {'ms/step':>8} {'share':>6} {'MiB/step':>9} {'GB/s':>6} {'GFLOP/s':>8}",
    ]

    def line(name: str, seconds: float, nbytes: float | None = None, flops: float | None = None) -> str:
        per_step = seconds / steps
        cells = [f"    {name:<38} {per_step * 1e3:8.2f} {seconds / ops.step_seconds:6.1%}"]
        if nbytes is not None and seconds > 0:
            cells.append(
                f"{nbytes / 2**20:9.1f} {nbytes * steps / seconds / 1e9:6.1f} {flops / seconds / 1e9:8.0f}"
            )
        return " ".join(cells)

    for m in ops.matmuls:
        lines.append(
            line(
                f"matmul {m.kind} ({m.layers} layer{'s' if m.layers > 1 else ''})",
                m.seconds,
                m.weight_bytes,
                m.flops_per_row * rows,
            )
        )
    weight_bytes = sum(m.weight_bytes for m in ops.matmuls)
    flops = sum(m.flops_per_row for m in ops.matmuls) * rows
    if ops.unmatched_matmul_seconds:
        lines.append(line("matmuls not matched to layers", ops.unmatched_matmul_seconds))
    lines.append(line("matmuls, all", ops.matmul_seconds, weight_bytes, flops))
    lines.append(line(f"attention ({ops.attention_calls // steps} calls a step)", ops.attention_seconds))
    other = ops.forward_seconds - ops.matmul_seconds - ops.attention_seconds
    lines.append(line("other ops of the forward pass", other))
    lines.append(line("host: schedule, inputs, sample, rest", ops.step_seconds - ops.forward_seconds))
    gemm = " / ".join(
        f"{str(d)[6:]} {rate:.0f}" + (f" (n = {rates.gemm_n[d]})" if d in rates.gemm_n else "")
        for d, rate in rates.gemm_gflop_s.items()
    )
    lines.append(
        f"  this process measures: memory read {rates.read_gb_s:.1f} GB/s (a sum over 512 MiB); "
        f"GEMM {gemm} GFLOP/s (n x n x n, n = {GEMM_N} unless given)"
    )
    read = weight_bytes * steps / ops.matmul_seconds / 1e9
    compute = flops / ops.matmul_seconds / 1e9
    lines.append(
        f"  the matmuls read the weights at {read:.1f} GB/s = {read / rates.read_gb_s:.0%} of the read rate, "
        f"and compute {compute:.0f} GFLOP/s = {compute / rates.gemm_gflop_s[dtype]:.0%} of the "
        f"{str(dtype)[6:]} GEMM rate"
    )
    return lines


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


def report(
    engine, profile: PhaseProfile, ops: OpProfile, dtype: torch.dtype, rates: MachineRates
) -> list[str]:
    """The --profile section of `bench throughput`, as printed lines: the run's phases, its GEMM floor,
    and the profiled decode steps (profile_decode) op by op."""
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
    steps = len(ops.steps)
    lines.append("  top ops over the profiled decode steps (self CPU time):")
    lines += [
        f"    {name:<40} {seconds / ops.step_seconds:6.1%} {seconds * 1e3 / steps:8.2f} ms/step"
        for name, seconds in ops.top_ops[:8]
    ]
    if ops.attention_seconds:
        rate = kv_bytes_read(engine, ops) / ops.attention_seconds / 1e9
        lines.append(
            f"  paged attention over those steps read {rate:.1f} GB/s of K/V, "
            f"{rate / rates.read_gb_s:.0%} of the {rates.read_gb_s:.1f} GB/s a sum over 512 MiB reads here"
        )
    batch = ops.steps[0].decode_seqs
    same_batch = [sum(s.seconds.values()) for s in decode_steps if s.decode_seqs == batch]
    unprofiled = statistics.median(same_batch) if same_batch else None
    return lines + step_breakdown(ops, rates, dtype, unprofiled)
