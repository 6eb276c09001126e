"""`pagedllm viz`: figures of a real engine run whose numbers are usage() at the step they show."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import assert_all_blocks_free
from PIL import Image

from pagedllm.viz import recording, report

ARGS = ["--num-requests", "5", "--output-len", "6-14", "--num-blocks", "24", "--max-model-len", "128"]


def svg_text(path: Path) -> str:
    """Every text of a matplotlib SVG written with svg.fonttype 'none' (text kept as text)."""
    return " ".join(re.findall(r"<text[^>]*>([^<]*)</text>", path.read_text()))


def shares(text: str) -> dict[str, str]:
    """`61.2% live, 3.1% tail, 35.7% free` -> {"live": "61.2", ...}."""
    return {
        part: value for value, part in re.findall(r"(\d+\.\d)% (live|tail|reserved|external|free)\b", text)
    }


def expected_shares(usage) -> dict[str, str]:
    parts = usage.parts()
    return {p: f"{100 * n / usage.total_slots:.1f}" for p, n in parts.items() if n or p in ("live", "free")}


def replay(layout: str, arrivals, step: int):
    """The oracle: the same requests through a fresh engine, reading usage() and the queues at `step`."""
    args = report.build_parser().parse_args(["--out", "unused", *ARGS])
    engine = recording.make_engine(args, layout)
    pending, seen = list(arrivals), None
    while pending or engine.has_unfinished_requests():
        recording.add_due(engine, pending)
        engine.step()
        if engine.num_steps == step:
            scheduler = engine.scheduler
            seen = (
                engine.allocator.usage(),
                len(scheduler.running),
                len(scheduler.waiting) + len(scheduler.swapped),
            )
    assert_all_blocks_free(engine)
    return seen


def test_viz_figures_show_usage_at_their_step(tmp_path, capsys):
    assert report.main(["--out", str(tmp_path), "--format", "svg", *ARGS]) == 0
    printed = capsys.readouterr().out
    paths = {name: tmp_path / f"{name}.svg" for name in ("kv_memory_map", "kv_usage", "block_tables")}
    assert all(f"wrote {path}" in printed for path in paths.values())
    memory_map = svg_text(paths["kv_memory_map"])
    step = int(re.search(r"KV memory map at step (\d+)", memory_map).group(1))
    arrivals = recording.make_workload(5, (6, 14), 49152, 128, seed=0)  # the defaults; SmolLM2's vocabulary
    usage_text = svg_text(paths["kv_usage"])
    for label, layout in (("contiguous (pow2)", "contiguous"), ("paged", "paged")):
        usage, running, waiting = replay(layout, arrivals, step)
        # The memory map: one band per layout, its shares counted from the drawn slot states.
        band = re.search(rf"{re.escape(label)}, step {step}: ([^(]*)\((\S+) slots\)", memory_map)
        assert band and band.group(2) == f"{usage.total_slots:,}"
        drawn = {
            p: v for v, p in re.findall(r"(\d+\.\d)% (live|allocated-empty|free|in external gaps)", band[1])
        }
        total = usage.total_slots
        assert drawn.pop("live") == f"{100 * usage.live_slots / total:.1f}"
        assert (
            drawn.pop("allocated-empty") == f"{100 * (usage.tail_slots + usage.reserved_slots) / total:.1f}"
        )
        assert drawn.pop("free") == f"{100 * (usage.free_slots - usage.external_frag_slots) / total:.1f}"
        assert drawn.pop("in external gaps", "0.0") == f"{100 * usage.external_frag_slots / total:.1f}"
        # Usage over the run: the panel title's reading at the chosen step.
        at = re.search(
            rf"{re.escape(label)}: \d+ steps.*?at step {step}: (.*?); (\d+) running, (\d+) waiting",
            usage_text,
        )
        assert at and shares(at.group(1)) == expected_shares(usage)
        assert (int(at.group(2)), int(at.group(3))) == (running, waiting)
        if layout == "paged":
            tables = svg_text(paths["block_tables"])
            title = re.search(rf"block tables at step {step} .*? saving (\S+) slots; (.*?%[^;]*free)", tables)
            assert title and title.group(1) == f"{usage.shared_saved_slots:,}"
            assert shares(title.group(2)) == expected_shares(usage)
            assert usage.shared_saved_slots > 0  # the n = 3 fork and the shared system prompt
            assert "×" in tables  # shared blocks carry their reference count


def test_viz_writes_png_by_default_and_refuses_bad_options(tmp_path, capsys):
    small = ["--num-requests", "2", "--output-len", "3-5", "--num-blocks", "24", "--max-model-len", "128"]
    assert report.main(["--out", str(tmp_path), *small, "--step", "2"]) == 0
    for name in ("kv_memory_map", "kv_usage", "block_tables"):
        with Image.open(tmp_path / f"{name}.png") as image:
            assert image.format == "PNG" and image.width > 500
    with pytest.raises(SystemExit):
        report.main(["--out", str(tmp_path), *small, "--step", "999"])
    assert "--step 999 is outside the" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        report.main(["--out", str(tmp_path), "--output-len", "9-3"])
    assert "--output-len must be LO-HI" in capsys.readouterr().err


def allocator_states(engine) -> list[str]:
    """The oracle, from the allocator itself: its slot_states(), the slots of contiguous gaps too small
    for the refused request marked "external"."""
    allocator = engine.allocator
    states = [str(state) for state in allocator.slot_states()]
    for run in allocator.runs() if hasattr(allocator, "runs") else []:
        if run.external:
            states[run.start : run.start + run.size] = ["external"] * run.size
    return states


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_slot_states_read_from_the_kv_snapshot_are_the_allocators_own(layout):
    """After every step of a real run, the states the pictures draw (derived from kv_snapshot()) equal
    the allocator's; over the run (8 requests: a pow2 slab once finds only too-small gaps) every state
    of the layout shows up."""
    args = report.build_parser().parse_args(["--out", "unused", *ARGS, "--num-requests", "8"])
    arrivals = recording.make_workload(8, (6, 14), 49152, 128, seed=0)
    engine = recording.make_engine(args, layout)
    pending, seen = list(arrivals), set()
    while pending or engine.has_unfinished_requests():
        recording.add_due(engine, pending)
        engine.step()
        states = recording.slot_states(engine.kv_snapshot())
        assert states == allocator_states(engine), f"step {engine.stats().num_steps}"
        seen |= set(states)
    assert_all_blocks_free(engine)
    assert seen == (
        {"live", "tail", "free"} if layout == "paged" else {"live", "reserved", "free", "external"}
    )
