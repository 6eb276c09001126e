"""KV groups: which layers share a block table (vLLM v1's KV cache groups, hybrid_kv_cache_manager.md).

A sliding-window layer never reads a token once it has left its window, so its blocks can go back to
the pool while a full-attention layer of the same sequence still needs every one. Layers of one
attention type share a block table; every group's tables map the same token positions. One pool
serves all groups, so every block must be the same size: each group holds the same number of layers
(the greatest common divisor of the per-type counts, so no group is padded with unused layers). The
cache is then that many buffers, each shared by one layer of every group (block b of buffer j is
layer j of whichever group holds block b).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroups:
    """The layers' grouping: per group its window, per layer its group and its buffer."""

    windows: tuple[int | None, ...]  # per group: its sliding window in tokens (None: full attention)
    layer_group: tuple[int, ...]  # per layer: the group whose block tables it reads
    layer_slot: tuple[int, ...]  # per layer: the cache buffer it uses (its place within its group)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def layers_per_group(self) -> int:
        """Layers in each group: the number of cache buffers, and the layers one block holds."""
        return len(self.layer_group) // self.num_groups


def kv_groups(layer_windows: Sequence[int | None], hybrid: bool = True) -> KVGroups:
    """Group layers by their sliding window (None: full attention), full attention first, in equal
    groups. `hybrid=False` (disable_hybrid_kv_cache_manager) keeps one group that holds every token of
    every layer: the kernels still clamp a sliding layer's reads to its window."""
    if not layer_windows:
        raise ValueError("a model needs at least one layer to group")
    for window in layer_windows:
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"a sliding window must be a positive integer or None, got {window!r}")
    num_layers = len(layer_windows)
    if not hybrid:
        return KVGroups((None,), (0,) * num_layers, tuple(range(num_layers)))
    kinds = sorted(set(layer_windows), key=lambda w: (w is not None, w or 0))  # full attention first
    by_kind = {kind: [i for i, w in enumerate(layer_windows) if w == kind] for kind in kinds}
    size = math.gcd(*(len(layers) for layers in by_kind.values()))
    windows, group, slot = [], [0] * num_layers, [0] * num_layers
    for kind, layers in by_kind.items():
        for start in range(0, len(layers), size):
            for j, layer in enumerate(layers[start : start + size]):
                group[layer], slot[layer] = len(windows), j
            windows.append(kind)
    return KVGroups(tuple(windows), tuple(group), tuple(slot))
