"""Plain-text tables for the benchmarks' reports."""

from __future__ import annotations


def aligned(rows: list[list[str]]) -> list[str]:
    """Each row as one line, every column left-aligned to its widest cell."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
