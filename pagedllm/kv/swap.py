"""Swap preemption: a sequence's blocks copied to the host pool and back.

A swapped-out sequence may be appended to while there: its new tokens get their blocks when it comes back.
With prefix caching, its computed full blocks still cached on the device are reused when it comes back
instead of copied. With tiers (kv/tiers.py) the host pool is the host tier's: a swap-out may evict its
cached prefix blocks.
"""

from __future__ import annotations

from collections.abc import Hashable

from pagedllm.kv.block_pool import Block
from pagedllm.kv.interface import NoFreeBlocks
from pagedllm.kv.managers import held_alone
from pagedllm.kv.prefill import ChunkedPrefill
from pagedllm.kv.sequence import SeqBlocks
from pagedllm.kv.tables import BlockTables
from pagedllm.kv.tiers import HostPool


class HostSwap:
    """Moves sequences between device block tables and host blocks; `seqs` are every sequence's state
    (a swap-in's shared blocks may change other prefills' promises)."""

    def __init__(self, tables: BlockTables, prefill: ChunkedPrefill, host: HostPool, seqs: dict):
        self.tables, self.prefill, self.host, self.seqs = tables, prefill, host, seqs

    def swap_out(self, seq_id: Hashable, seq: SeqBlocks) -> list[tuple[int, int]]:
        """Move the sequence to host blocks; returns the (device block, host block) copies to do."""
        held = sum(block is not None for table in seq.tables for block in table)
        if held > self.host.num_reclaimable:
            raise NoFreeBlocks(
                f"sequence {seq_id!r} needs {held} host blocks, {self.host.num_reclaimable} free"
            )
        host = seq.host_blocks = []
        copies = []
        for table in seq.tables:
            host.append([None if block is None else self.host.take()[0] for block in table])
            copies += [(b.block_id, h) for b, h in zip(table, host[-1], strict=True) if b is not None]
        self.tables.resident_slots -= seq.slots_held()
        self.tables.release(seq)
        self.prefill.set_promise(seq)
        return copies

    def can_swap_in(self, seq: SeqBlocks) -> bool:
        hits = self._hits(seq)
        return self.tables.fits(hits, self._blocks(seq, hits))

    def swap_in(self, seq_id: Hashable, seq: SeqBlocks) -> list[tuple[int, int]]:
        """Bring the sequence back to device blocks; returns the (host block, device block) copies to do.
        A block of tokens appended while swapped out is new (their K/V is still to be computed)."""
        tables, hits = self.tables, self._hits(seq)
        num_new = self._blocks(seq, hits)
        if not tables.fits(hits, num_new):
            raise NoFreeBlocks(f"sequence {seq_id!r} needs {num_new} blocks to swap in")
        host_blocks, seq.host_blocks = seq.host_blocks, None
        copies = []
        tables.touch(hits)
        for g, group_hits in enumerate(hits):
            first = seq.released[g]
            seq.tables[g] = tables.take(g, group_hits, first)
            for i in range(first, len(group_hits)):
                if group_hits[i] is None:
                    if i < len(host_blocks[g]):
                        copies.append((host_blocks[g][i], seq.tables[g][i].block_id))
                    tables.fill(seq, g, i)
            self.host.give_back(h for h in reversed(host_blocks[g]) if h is not None)
        tables.resident_slots += seq.slots_held()
        self.prefill.set_promise(seq)
        self.prefill.refresh(self.seqs.values())
        return copies

    def free(self, seq: SeqBlocks) -> None:
        """Give back a swapped-out sequence's host blocks."""
        for host in seq.host_blocks:
            self.host.give_back(h for h in reversed(host) if h is not None)

    def _blocks(self, seq: SeqBlocks, hits: list[list[Block | None]]) -> int:
        """Blocks swap_in takes (besides reused cached ones), a prefill's promise included."""
        total, owned = 0, []
        for m, group in zip(self.prefill.managers, hits, strict=True):
            new = sum(block is None for block in group[seq.released[m.group] :])
            total += new
            if m.promised:
                total += held_alone(group)
                owned.append(new + sum(block is not None and block.ref_cnt == 0 for block in group))
        return total + self.prefill.promise(seq, owned)

    def _hits(self, seq: SeqBlocks) -> list[list[Block | None]]:
        """Per group, for each block the swapped sequence's tokens need, the device block still caching its
        content, if any (None also before a window group's window). Only blocks it computed count: one whose
        K/V is still to come is never shared (it is written)."""
        hits, cached = [], self.tables.pool.cached
        num_blocks = seq.window_blocks if self.prefill.chunked else seq.num_blocks(self.tables.block_size)
        for g, first in enumerate(seq.released):
            computed = seq.block_hashes[first : seq.num_cached_blocks]
            group_hits = [None] * first + [cached.get((g, h)) for h in computed]
            hits.append(group_hits + [None] * (num_blocks - len(group_hits)))
        return hits
