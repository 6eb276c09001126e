"""`pagedllm bench memory --plot`: the KV memory map drawn from the replay's own slot states."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from PIL import Image

from pagedllm.bench import memory
from pagedllm.kv import SlotState
from pagedllm.viz.memory_map import GROUPS, plot_memory_map

SMALL = ["--num-requests", "200", "--num-blocks", "512", "--seed", "1"]


def rgb(hex_colour: str) -> tuple[int, ...]:
    return tuple(int(hex_colour[i : i + 2], 16) for i in (1, 3, 5))


def test_bench_plot_writes_a_png_of_snapshots_that_agree_with_usage(tmp_path, capsys):
    path = tmp_path / "map.png"
    assert memory.main([*SMALL, "--plot", str(path)]) == 0
    assert f"wrote {path}" in capsys.readouterr().err
    with Image.open(path) as image:
        assert image.format == "PNG" and image.width > 0 and image.height > 0
        image.load()

    info, rows, snapshots = memory.run(memory.build_parser().parse_args([*SMALL, "--plot", str(path)]))
    assert len(snapshots) == len(rows) == len(memory.LAYOUTS)
    for row, snap in zip(rows, snapshots, strict=True):
        counts, u = Counter(snap.states), snap.usage
        assert len(snap.states) == u.total_slots == info["num_slots"]
        assert counts[SlotState.LIVE] == u.live_slots > 0
        assert counts[SlotState.RESERVED] == u.reserved_slots
        assert counts[SlotState.TAIL] == u.tail_slots
        assert counts[SlotState.FREE] == u.free_slots
        assert info["snapshot_from"] <= snap.step < row.steps
    paged, cmax = snapshots[0].usage, snapshots[1].usage
    assert paged.live_slots > cmax.live_slots and cmax.reserved_slots > cmax.live_slots


def test_slots_are_drawn_in_address_order(tmp_path):
    path = tmp_path / "row.png"
    plot_memory_map([("half live", ["live"] * 32 + ["free"] * 32)], path)
    pixels = np.asarray(Image.open(path).convert("RGB"))
    live_x = np.nonzero((pixels == rgb(GROUPS[0][1])).all(-1))[1]
    free_x = np.nonzero((pixels == rgb(GROUPS[2][1])).all(-1))[1]
    assert len(live_x) > 100 and len(free_x) > 100
    assert live_x.max() < free_x.min()  # one row of 64 cells: the live half on the left
    assert abs(len(live_x) - len(free_x)) < 0.1 * len(live_x)  # and the two halves equally wide


def test_bad_rows_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match=r"unknown slot states \['busy'\]"):
        plot_memory_map([("x", ["live", "busy"])], tmp_path / "x.png")
    with pytest.raises(ValueError, match=r"rows \['empty'\] have no slots"):
        plot_memory_map([("empty", [])], tmp_path / "x.png")
    with pytest.raises(ValueError, match="at least one"):
        plot_memory_map([], tmp_path / "x.png")
