"""A picture of the KV cache: one band per layout, every slot a cell coloured by what it holds.

Slots run in address order, left to right and then top to bottom, wrapped into a grid when there are
many. Colours follow the seed lesson's figure: dark = a live token, medium = allocated but empty (a
contiguous slab's reserve beyond its sequence, or the unused tail of a paged sequence's last block),
light = free; orange = free but in a gap too small for the waiting request (external fragmentation),
for callers that mark such slots "external".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch

# (slot states, colour, legend label), darkest first; a state's code is its group's index
GROUPS = [
    (("live",), "#08306b", "live token"),
    (("reserved", "tail"), "#4f9bd0", "allocated, empty (slab reserve / last-block tail)"),
    (("free",), "#c6dbef", "free"),
    (("external",), "#f4a582", "free gap too small for the waiting request"),
]
CODES = {state: code for code, (states, _, _) in enumerate(GROUPS) for state in states}


def grid_columns(num_slots: int) -> int:
    """Slots per grid row: all of them up to 64, else a power of two giving bands about 4x wider than tall."""
    if num_slots <= 64:
        return num_slots
    return 2 ** round(math.log2(math.sqrt(4 * num_slots)))


def encode(states: Sequence[str]) -> np.ndarray:
    """Each slot's colour code (its group's index in GROUPS)."""
    unknown = set(states) - CODES.keys()
    if unknown:
        raise ValueError(f"unknown slot states {sorted(unknown)}; expected some of {sorted(CODES)}")
    return np.fromiter((CODES[s] for s in states), dtype=np.int8, count=len(states))


def wrap(codes: np.ndarray, columns: int) -> np.ma.MaskedArray:
    """The codes as a [rows, columns] grid, row after row; cells past the last slot are masked."""
    grid = np.full(-(-len(codes) // columns) * columns, -1, dtype=np.int8)
    grid[: len(codes)] = codes
    return np.ma.masked_equal(grid.reshape(-1, columns), -1)


def describe(label: str, codes: np.ndarray) -> str:
    """`label: 52.5% live, 34.4% allocated-empty, 13.1% free (65,536 slots)`, and the external gaps'
    share after the free one when there are any."""
    live, empty, free, external = (100 * c / len(codes) for c in np.bincount(codes, minlength=len(GROUPS)))
    gaps = f", {external:.1f}% in external gaps" if external else ""
    shares = f"{live:.1f}% live, {empty:.1f}% allocated-empty, {free:.1f}% free{gaps}"
    return f"{label}: {shares} ({len(codes):,} slots)"


def plot_memory_map(
    rows: list[tuple[str, Sequence[str]]], path: str | Path, *, title: str = "KV cache memory map"
) -> None:
    """Save a PNG with one band per (label, slot states) row, stacked top to bottom."""
    if not rows:
        raise ValueError("plot_memory_map needs at least one (label, slot states) row, got none")
    empty = [label for label, states in rows if len(states) == 0]
    if empty:
        raise ValueError(f"plot_memory_map: rows {empty} have no slots")
    codes = [encode(states) for _, states in rows]
    columns = grid_columns(max(map(len, codes)))
    grids = [wrap(c, columns) for c in codes]
    width = 10.0
    heights = [max(0.35, width * g.shape[0] / columns) for g in grids]
    fig = Figure(figsize=(width, sum(heights) + 0.45 * len(rows) + 1.1), layout="constrained")
    axes = fig.subplots(len(rows), 1, squeeze=False, gridspec_kw={"height_ratios": heights})[:, 0]
    cmap = ListedColormap([colour for _, colour, _ in GROUPS]).with_extremes(bad="white")
    for ax, grid, c, (label, _) in zip(axes, grids, codes, rows, strict=True):
        ax.imshow(grid, cmap=cmap, vmin=0, vmax=len(GROUPS) - 1, interpolation="nearest", aspect="auto")
        ax.set_title(describe(label, c), fontsize=9, loc="left")
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(title, fontsize=10)
    shown = set(np.concatenate(codes).tolist()) | {0, 1, 2}  # external only where some slot is
    handles = [
        Patch(facecolor=colour, edgecolor="0.5", label=text)
        for code, (_, colour, text) in enumerate(GROUPS)
        if code in shown
    ]
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.savefig(path, dpi=100)
