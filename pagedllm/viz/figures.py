"""The figures of `pagedllm viz`: memory map, usage over time, block tables (matplotlib, no pyplot)."""

from __future__ import annotations

import statistics
from pathlib import Path

import matplotlib
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from pagedllm.kv import USAGE_PARTS, KVUsage
from pagedllm.viz.memory_map import plot_memory_map
from pagedllm.viz.recording import Run, StepRecord

COLOUR = {
    "live": "#08306b",
    "tail": "#4f9bd0",
    "reserved": "#4f9bd0",
    "external": "#f4a582",
    "free": "#c6dbef",
}
LABEL = {
    "live": "live tokens",
    "tail": "empty tail of a block in use",
    "reserved": "reserved in a slab, empty",
    "external": "free gap too small for the waiting request",
    "free": "free",
}
SHARED, CACHED, RUNNING, WAITING = "#e6550d", "#2c7f6e", "#000000", "#d94801"


def shares(usage: KVUsage) -> str:
    """`61.2% live, 3.1% tail, 35.7% free`: every part that is not zero, and live and free always."""
    parts = usage.parts()
    return ", ".join(
        f"{usage.fraction(n):.1%} {part}" for part, n in parts.items() if n or part in ("live", "free")
    )


def summary(run: Run) -> str:
    last = run.steps[-1].snapshot["counters"]
    mean_live = statistics.mean(r.usage.live_fraction for r in run.steps)
    return (
        f"{run.label}: {len(run.steps)} steps, mean live {mean_live:.1%} of the KV slots, at most "
        f"{max(r.running for r in run.steps)} sequences running, {last['preemptions']} preemptions"
    )


def draw_all(runs: list[tuple[Run, StepRecord]], step: int, args, out: Path) -> list[Path]:
    """Write the three figures into `out`; returns their paths. SVG text stays text (searchable)."""
    paths = [out / f"{name}.{args.format}" for name in ("kv_memory_map", "kv_usage", "block_tables")]
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "pagedllm"}):
        memory_map(runs, step, paths[0])
        usage_over_time([run for run, _ in runs], step, paths[1])
        paged = next(record for run, record in runs if run.label == "paged")
        block_tables(paged, paths[2])
    return paths


def memory_map(runs: list[tuple[Run, StepRecord]], step: int, path: Path) -> None:
    """The seed lesson's figure: every slot of each layout's cache at `step`, in address order."""
    record = runs[0][1]
    snap = record.snapshot
    title = (
        f"KV memory map at step {step}: the same requests, {record.usage.total_slots:,} slots per layout "
        f"({snap['num_blocks']} blocks x {snap['block_size']} tokens), model {snap['model']}\n"
        "one cell = one token slot, in address order (left to right, top to bottom)"
    )
    plot_memory_map([(f"{run.label}, step {step}", r.states) for run, r in runs], path, title=title)


def usage_over_time(runs: list[Run], step: int, path: Path) -> None:
    """Each run's KV slots as stacked areas over its steps, with its running and waiting counts."""
    fig = Figure(figsize=(10, 7), layout="constrained")
    axes = fig.subplots(len(runs), 1, sharex=True)
    most = max(r.running + r.waiting for run in runs for r in run.steps)
    for ax, run in zip(axes, runs, strict=True):
        steps = [r.step for r in run.steps]
        series = [[r.usage.fraction(r.usage.parts()[p]) for r in run.steps] for p in USAGE_PARTS]
        ax.stackplot(steps, series, colors=[COLOUR[p] for p in USAGE_PARTS])
        ax.set_ylim(0, 1)
        ax.set_xlim(1, max(len(r.steps) for r in runs))
        ax.set_ylabel("share of KV slots")
        ax.axvline(step, color="k", linestyle=":", linewidth=1)
        counts = ax.twinx()
        counts.plot(steps, [r.running for r in run.steps], color=RUNNING, linewidth=1.2)
        counts.plot(steps, [r.waiting for r in run.steps], color=WAITING, linewidth=1.2, ls="--")
        counts.set_ylim(0, most * 1.1)
        counts.set_ylabel("sequences")
        at = run.at(step)
        mean_live = statistics.mean(r.usage.live_fraction for r in run.steps)
        ax.set_title(
            f"{run.label}: {len(run.steps)} steps, mean live {mean_live:.1%}\n"
            f"at step {step}: {shares(at.usage)}; {at.running} running, {at.waiting} waiting",
            fontsize=9,
            loc="left",
        )
    axes[-1].set_xlabel("engine step")
    fig.suptitle(
        f"KV cache over the run: the same requests, the same KV memory (dotted: step {step})", fontsize=10
    )
    handles = [Patch(facecolor=COLOUR[p], label=LABEL[p]) for p in ("live", "tail", "external", "free")]
    handles[1].set_label("empty: tail of a block in use (paged) / slab reserve (contiguous)")
    handles += [
        Line2D([], [], color=RUNNING, linewidth=1.2, label="running"),
        Line2D([], [], color=WAITING, linewidth=1.2, ls="--", label="waiting"),
    ]
    fig.legend(handles=handles, loc="outside lower center", ncol=3, fontsize=8, frameon=False)
    fig.savefig(path, dpi=100)


def _cell(ax, x: float, y: float, w: float, h: float, tokens: int, block_size: int, edge: str | None) -> None:
    """A block: live tokens from the left (dark), the rest of a held block its empty tail."""
    ax.add_patch(Rectangle((x, y), w, h, facecolor=COLOUR["tail"], linewidth=0, zorder=2))
    ax.add_patch(
        Rectangle((x, y), w * tokens / block_size, h, facecolor=COLOUR["live"], linewidth=0, zorder=2)
    )
    if edge:
        ax.add_patch(Rectangle((x, y), w, h, fill=False, edgecolor=edge, linewidth=2, zorder=3))


def block_tables(record: StepRecord, path: Path, max_rows: int = 4) -> None:
    """Block tables of a few paged sequences (logical -> physical) over the physical pool, at one step.

    Shown first: the sequences of a request with several samples, then those sharing blocks, then the
    rest. A block held by several tables has an orange edge and its reference count (x3).
    """
    snap, usage, bs = record.snapshot, record.usage, record.snapshot["block_size"]
    ref, tokens, cached = snap["blocks"]["ref"], snap["blocks"]["tokens"], snap["blocks"]["cached"]
    running = [s for s in snap["seqs"] if s["table"]]
    siblings = {s["request"]: sum(t["request"] == s["request"] for t in running) for s in running}
    rows = sorted(
        running, key=lambda s: (-siblings[s["request"]], -sum(ref[b] > 1 for b in s["table"]), s["id"])
    )[:max_rows]
    width = max([len(s["table"]) for s in rows] + [16]) * 1.15
    per_row = min(len(ref), 64)
    pool_rows = -(-len(ref) // per_row)
    fig = Figure(figsize=(10, 1.2 + 0.55 * len(rows) + 0.5 * pool_rows + 1.0), layout="constrained")
    ax = fig.subplots()
    top = 1.3 * len(rows) + 1.6 + 0.9 * pool_rows
    physical = {}  # block id -> (x centre, y top) in the pool
    pw = width / per_row
    for b in range(len(ref)):
        x, y = (b % per_row) * pw, (pool_rows - 1 - b // per_row) * 0.9
        physical[b] = (x + pw * 0.45, y + 0.7)
        if ref[b]:
            _cell(ax, x, y, pw * 0.9, 0.7, tokens[b], bs, SHARED if ref[b] > 1 else None)
        else:
            edge = CACHED if cached[b] else "none"
            ax.add_patch(
                Rectangle((x, y), pw * 0.9, 0.7, facecolor=COLOUR["free"], edgecolor=edge, linewidth=1.5)
            )
        if b % 8 == 0:
            ax.text(x, y - 0.05, str(b), fontsize=6, va="top", color="0.35")
    ax.text(-0.3, 0.35 + 0.45 * (pool_rows - 1), "physical\nblocks", ha="right", va="center", fontsize=8)
    for i, seq in enumerate(rows):
        y = top - 1.3 * (i + 1)
        ax.text(-0.3, y + 0.4, f"{seq['id']}\n{seq['tokens']} tokens", ha="right", va="center", fontsize=7)
        for logical, block in enumerate(seq["table"]):
            x = logical * 1.15
            filled = min(bs, seq["tokens"] - logical * bs)
            shared = ref[block] > 1
            _cell(ax, x, y, 1.0, 0.8, filled, bs, SHARED if shared else None)
            label = f"{block} ×{ref[block]}" if shared else str(block)
            ax.text(x + 0.5, y + 0.4, label, ha="center", va="center", fontsize=6.5, color="white")
            px, py = physical[block]
            ax.plot(
                [x + 0.5, px], [y, py], color=SHARED if shared else "0.55", linewidth=0.7, alpha=0.6, zorder=1
            )
    ax.set_xlim(-4.2, width)
    ax.set_ylim(-0.4, top + 0.2)
    ax.axis("off")
    shared_blocks = sum(r > 1 for r in ref)
    ax.set_title(
        f"paged block tables at step {record.step} (logical block -> physical block): {len(rows)} of "
        f"{len(running)} sequences shown\n{shared_blocks} blocks shared, saving {usage.shared_saved_slots:,} "
        f"slots; {shares(usage)}",
        fontsize=9,
        loc="left",
    )
    handles = [
        Patch(facecolor=COLOUR["live"], label="live tokens"),
        Patch(facecolor=COLOUR["tail"], label="empty tail"),
        Patch(facecolor="white", edgecolor=SHARED, linewidth=2, label="shared (×ref count)"),
        Patch(facecolor=COLOUR["free"], edgecolor=CACHED, linewidth=1.5, label="free, holds a cached prefix"),
        Patch(facecolor=COLOUR["free"], label="free"),
    ]
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=7, frameon=False)
    fig.savefig(path, dpi=100)
