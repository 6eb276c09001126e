"""`pagedllm bench memory`: how much KV memory holds live tokens, paged vs contiguous (no model needed).

Replays one synthetic trace (see `pagedllm.bench.trace` for the length distributions) through the
paged layout and the contiguous layout under each reservation policy (max, pow2, oracle), all with
the same number of KV slots. Each step: requests that have arrived join the waiting queue; waiting
requests are admitted first come first served while the allocator accepts them (admission stands for
the prefill); then every running sequence appends one token, and a sequence that has produced its
output length is freed. A request's max_new_tokens is its true output length, so the contiguous
policies never overflow a slab. When the paged layout runs out of blocks mid-decode, the most
recently admitted sequence is preempted by recompute (freed, and put back at the head of the queue
with its generated tokens now part of its prompt), as vLLM does.

Usage is sampled after each step's appends, before finished sequences are freed. The memory figures
(live, reserved-empty, block tail, external fragmentation, idle free) are averaged over the steps in
which a request is still waiting, i.e. the steps in which KV memory is the bottleneck; concurrency
and steps-to-finish (the throughput proxy) cover the whole trace. The paged layout's live share is
printed with the preemptions and recomputed tokens of the same replay: the price of packing it so full.

`--plot FILE.png` also draws every layout's KV memory map (`pagedllm.viz.memory_map`): the state of
each slot at the first memory-bound step at or after half of the paged layout's memory-bound steps
(found by one extra paged replay), sampled where the usage is sampled.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

from pagedllm.bench import flags, kv_groups
from pagedllm.bench.table import aligned
from pagedllm.bench.trace import WORKLOADS, Request, make_trace
from pagedllm.kv import ContiguousAllocator, KVAllocator, KVUsage, NoFreeBlocks, PagedAllocator, SlotState
from pagedllm.viz import require_matplotlib

LAYOUTS = [("paged", None), ("contiguous", "max"), ("contiguous", "pow2"), ("contiguous", "oracle")]


@dataclass
class LayoutResult:
    """One row of the report; fractions are of all KV slots, averaged over memory-bound steps."""

    layout: str
    reserve: str | None
    live_fraction: float | None
    live_p50: float | None
    reserved_fraction: float | None
    tail_fraction: float | None
    external_fraction: float | None
    idle_fraction: float | None  # free slots the next request could use (or none is waiting)
    mean_seqs: float
    max_seqs: int
    steps: int
    memory_bound_steps: int
    preemptions: int
    recomputed_tokens: int  # KV tokens thrown away by preemptions (their prefill is redone)
    alloc_ops: int | None = None  # with --profile
    alloc_ops_per_s: float | None = None
    replay_s: float | None = None


@dataclass
class Snapshot:
    """Every slot's state at one memory-bound step of a replay, and usage() at that moment."""

    step: int
    states: list[SlotState]
    usage: KVUsage


class _Timed:
    """Forwards every allocator call, counting calls and the time spent inside them."""

    def __init__(self, allocator: KVAllocator):
        self._allocator = allocator
        self.ops = 0
        self.seconds = 0.0

    def __getattr__(self, name: str):
        method = getattr(self._allocator, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.ops += 1

        return timed


@dataclass
class _Active:
    request: Request
    generated: int = 0


def replay(
    allocator: KVAllocator, trace: list[Request], snapshot_from: int | None = None
) -> tuple[LayoutResult, Snapshot | None]:
    """Run the trace to completion through one allocator; returns its row (layout fields left blank).

    With `snapshot_from`, also the slot states at the first memory-bound step at or after that step.
    """
    pending = deque(trace)
    waiting: deque[_Active] = deque()
    running: list[_Active] = []
    step = preemptions = recomputed = 0
    seqs_per_step: list[int] = []
    samples = []  # KVUsage of each memory-bound step
    snapshot = None
    while pending or waiting or running:
        while pending and pending[0].arrival_step <= step:
            waiting.append(_Active(pending.popleft()))
        while waiting:  # admit first come first served
            active, req = waiting[0], waiting[0].request
            prompt = [0] * (req.prompt_len + active.generated)
            left = req.output_len - active.generated
            if not allocator.can_allocate(prompt, left, true_output_len=left):
                if not running:
                    raise ValueError(f"request {req.req_id} ({len(prompt) + left} tokens) can never fit")
                break
            allocator.allocate(req.req_id, prompt, left, true_output_len=left)
            running.append(waiting.popleft())
        queue, running, finished = deque(running), [], []
        while queue:  # decode one token each, preempting the newest when a block is missing
            active = queue.popleft()
            try:
                allocator.append(active.request.req_id, 0)  # raises NoFreeBlocks, changing nothing
            except NoFreeBlocks:
                victim = queue.pop() if queue else active
                recomputed += allocator.num_tokens(victim.request.req_id)
                allocator.free(victim.request.req_id)
                waiting.appendleft(victim)
                preemptions += 1
                if victim is not active:
                    queue.appendleft(active)  # try again
                continue
            active.generated += 1
            running.append(active)
            if active.generated == active.request.output_len:
                finished.append(active)
        seqs_per_step.append(len(running))
        if waiting:
            samples.append(allocator.usage())
            if snapshot is None and snapshot_from is not None and step >= snapshot_from:
                snapshot = Snapshot(step, allocator.slot_states(), samples[-1])
        for active in finished:
            allocator.free(active.request.req_id)
        if finished:
            running = [active for active in running if active.generated < active.request.output_len]
        step += 1
    assert allocator.all_free()
    return _summarise(samples, seqs_per_step, preemptions, recomputed), snapshot


def _summarise(samples, seqs_per_step: list[int], preemptions: int, recomputed: int) -> LayoutResult:
    def mean(field: str) -> float | None:
        return statistics.fmean(getattr(u, field) / u.total_slots for u in samples) if samples else None

    live = [u.live_fraction for u in samples]
    idle = (
        statistics.fmean((u.free_slots - u.external_frag_slots) / u.total_slots for u in samples)
        if samples
        else None
    )
    return LayoutResult(
        layout="",
        reserve=None,
        live_fraction=mean("live_slots"),
        live_p50=statistics.median(live) if live else None,
        reserved_fraction=mean("reserved_slots"),
        tail_fraction=mean("tail_slots"),
        external_fraction=mean("external_frag_slots"),
        idle_fraction=idle,
        mean_seqs=statistics.fmean(seqs_per_step),
        max_seqs=max(seqs_per_step),
        steps=len(seqs_per_step),
        memory_bound_steps=len(samples),
        preemptions=preemptions,
        recomputed_tokens=recomputed,
    )


def run(args: argparse.Namespace) -> tuple[dict, list[LayoutResult], list[Snapshot]]:
    """Build the trace and replay it through every layout; snapshots (one per layout) only with --plot."""
    num_slots = args.num_blocks * args.block_size
    if num_slots < args.max_model_len:
        raise ValueError(
            f"{num_slots} KV slots cannot hold one sequence of max_model_len {args.max_model_len}"
        )
    trace = make_trace(WORKLOADS[args.workload], args.num_requests, args.rate, args.seed, args.max_model_len)
    info = dict(
        workload=args.workload,
        num_requests=args.num_requests,
        prompt_mean=statistics.fmean(r.prompt_len for r in trace),
        output_mean=statistics.fmean(r.output_len for r in trace),
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        num_slots=num_slots,
        max_model_len=args.max_model_len,
        rate=args.rate,
        seed=args.seed,
    )
    snapshot_from = None
    if args.plot:  # half-way through paged's memory-bound steps: every layout is still memory-bound
        snapshot_from = replay(_allocator("paged", None, args), trace)[0].memory_bound_steps // 2
        info["snapshot_from"] = snapshot_from
    rows, snapshots = [], []
    for layout, reserve in LAYOUTS:
        allocator = _allocator(layout, reserve, args)
        timed = _Timed(allocator) if args.profile else None
        start = time.perf_counter()
        row, snapshot = replay(timed or allocator, trace, snapshot_from)
        row.layout, row.reserve = layout, reserve
        if args.plot and snapshot is None:
            raise ValueError(
                f"--plot: {_label(row)} has no memory-bound step from step {snapshot_from} on; "
                "raise --rate or lower --num-blocks"
            )
        if snapshot:
            snapshots.append(snapshot)
        if timed:
            row.replay_s = time.perf_counter() - start
            row.alloc_ops, row.alloc_ops_per_s = timed.ops, timed.ops / timed.seconds
        rows.append(row)
    return info, rows, snapshots


def _allocator(layout: str, reserve: str | None, args: argparse.Namespace) -> KVAllocator:
    if layout == "paged":
        return PagedAllocator(args.num_blocks, args.block_size)
    return ContiguousAllocator(args.num_blocks * args.block_size, args.max_model_len, reserve=reserve)


def _label(row: LayoutResult) -> str:
    return row.layout if row.reserve is None else f"{row.layout}/{row.reserve}"


def plot(info: dict, rows: list[LayoutResult], snapshots: list[Snapshot], path: Path) -> None:
    """Draw the layouts' memory maps (matplotlib is imported only here)."""
    from pagedllm.viz.memory_map import plot_memory_map

    bands = [(f"{_label(r)}, step {s.step}", s.states) for r, s in zip(rows, snapshots, strict=True)]
    title = (
        f"KV cache memory map, {info['workload']} trace of {info['num_requests']:,} requests: "
        f"{info['num_blocks']:,} blocks x {info['block_size']} = {info['num_slots']:,} slots per layout\n"
        f"at the first memory-bound step from step {info['snapshot_from']:,} on; one cell = one token slot, "
        "in address order (left to right, top to bottom)"
    )
    plot_memory_map(bands, path, title=title)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def format_table(info: dict, rows: list[LayoutResult]) -> str:
    lines = [
        f"pagedllm bench memory: {info['workload']}, {info['num_requests']} requests (prompt mean "
        f"{info['prompt_mean']:.1f}, output mean {info['output_mean']:.1f} tokens), {info['num_blocks']} "
        f"blocks x {info['block_size']} = {info['num_slots']} slots, max_model_len {info['max_model_len']}, "
        f"rate {info['rate']}/step, seed {info['seed']}",
        "memory columns: share of all KV slots, mean over memory-bound steps (a request waiting)",
    ]
    header = ["layout", "reserve", "live", "live p50", "reserved", "tail", "external", "idle", "mean seqs"]
    header += ["max seqs", "steps", "bound steps", "preempted", "recomputed"]
    if rows[0].alloc_ops is not None:
        header += ["alloc ops", "ops/s", "replay s"]
    table = [header]
    for r in rows:
        cells = [r.layout, r.reserve or "-", _pct(r.live_fraction), _pct(r.live_p50)]
        cells += [_pct(r.reserved_fraction), _pct(r.tail_fraction), _pct(r.external_fraction)]
        cells += [_pct(r.idle_fraction), f"{r.mean_seqs:.1f}", str(r.max_seqs), str(r.steps)]
        cells += [str(r.memory_bound_steps), str(r.preemptions), str(r.recomputed_tokens)]
        if r.alloc_ops is not None:
            cells += [str(r.alloc_ops), f"{r.alloc_ops_per_s:,.0f}", f"{r.replay_s:.2f}"]
        table.append(cells)
    lines += aligned(table)
    paged = rows[0]
    trace_tokens = round(info["num_requests"] * (info["prompt_mean"] + info["output_mean"]))
    lines.append(
        f"paged: {_pct(paged.live_fraction)} of slots live, with {paged.preemptions:,} preemptions that "
        f"recomputed {paged.recomputed_tokens:,} tokens ({paged.recomputed_tokens / trace_tokens:.1%} of the "
        f"trace's {trace_tokens:,} prompt and output tokens) in the same run"
    )
    for r in rows[1:]:
        if paged.live_fraction and r.live_fraction:
            lines.append(
                f"paged vs contiguous/{r.reserve}: {paged.live_fraction / r.live_fraction:.2f}x the live "
                f"tokens, {paged.mean_seqs / r.mean_seqs:.2f}x the mean batch, "
                f"{r.steps / paged.steps:.2f}x fewer steps"
            )
    if any(r.memory_bound_steps == 0 for r in rows):
        lines.append("note: some layout was never memory-bound; raise --rate or lower --num-blocks")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm bench memory", description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="sharegpt")
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--num-blocks", type=int, default=4096, help="KV capacity in blocks (both layouts)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--rate", type=float, default=32.0, help="Poisson arrivals per step")
    flags.add_seed(parser, help="seed of the trace")
    flags.add_json(parser, help="print JSON {config, rows} instead of a table")
    parser.add_argument("--profile", action="store_true", help="time every allocator call: ops per second")
    parser.add_argument("--plot", type=Path, metavar="FILE.png", help="also draw each layout's KV memory map")
    kv_groups.add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.hybrid:
        try:
            from pagedllm.models.loader import read_config, resolve_checkpoint

            print(kv_groups.run(args, read_config(resolve_checkpoint(args.model))))
        except (ImportError, ValueError) as error:
            parser.exit(2, f"pagedllm bench memory: error: {error}\n")
        return 0
    try:
        if args.plot:
            require_matplotlib()  # before the replay, not after it
        info, rows, snapshots = run(args)
    except (ImportError, ValueError) as error:
        parser.exit(2, f"pagedllm bench memory: error: {error}\n")
    if args.json:
        print(json.dumps({"config": info, "rows": [asdict(r) for r in rows]}, indent=2))
    else:
        print(format_table(info, rows))
    if args.plot:
        plot(info, rows, snapshots, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
