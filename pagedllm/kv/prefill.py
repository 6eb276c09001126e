"""A prompt prefilled chunk by chunk beside sliding-window groups, and the window groups' promise.

With window groups every group takes a long prompt's blocks chunk by chunk as `cache_blocks` says each
chunk is computed, and admission asks only for the first chunk (vLLM v1's rule): a full group's blocks for
`prefill_chunk` tokens, and the window groups' promise (the window plus such a chunk: what they hold at
once). Later chunks take free blocks, as many as `prefill_room` says fit; when none is free the prompt
waits, and the scheduler preempts it when a decode needs a block.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from pagedllm.kv.interface import NoFreeBlocks
from pagedllm.kv.managers import GroupManager, held_alone
from pagedllm.kv.sequence import SeqBlocks
from pagedllm.kv.tables import BlockTables


class ChunkedPrefill:
    """The blocks a prompt's groups take chunk by chunk and the free blocks promised to its window groups
    until its prefill ends (nothing to do with one full-attention group: `chunked` is False)."""

    def __init__(self, tables: BlockTables, managers: list[GroupManager]):
        self.tables, self.managers = tables, managers
        self.windowed = [m for m in managers if m.promised]
        self.chunked = bool(self.windowed)

    def room(self, seq: SeqBlocks, start: int, num_tokens: int, keep_free: int) -> int:
        """How many of the `num_tokens` prompt tokens from `start` on one step can compute now: what the
        window groups' blocks fit, with the blocks no query from `start` on reads given back, leaving
        `keep_free` free blocks for others (the running sequences' next tokens) where it can. Never less
        than the sequence's promise covers (at least one token)."""
        if not self.chunked:
            return num_tokens
        given_back, owned = 0, []
        for m in self.windowed:
            table, released = seq.tables[m.group], seq.released[m.group]
            first = max(released, min(m.first_needed(start), len(table) - 1))
            given_back += held_alone(table[released:first])
            owned.append(held_alone(table[first:]))
        promise = self.promise(seq, owned)
        free = self.tables.pool.num_free + given_back - (self.tables.promised - seq.promise) - promise
        spare = min(free, max(0, free - keep_free))  # free blocks beyond the promise it may take now
        # b more logical blocks take b from each full group's free blocks and b from each window group's
        # promise, then free blocks: the most b with b * full + max(0, b * windows - promise) <= spare.
        num_full = len(self.managers) - len(self.windowed)
        more = (spare + promise) // len(self.managers)
        if num_full:
            more = min(more, spare // num_full)
        end = (seq.window_blocks + more) * self.tables.block_size
        return max(0, min(num_tokens, end - start))

    def release_behind(self, seq: SeqBlocks, start: int) -> None:
        """Give back each window group's blocks that no query from position `start` on reads."""
        for m in self.managers:
            self.tables.resident_slots -= m.release_behind(self.tables.pool, seq, start)
        self.set_promise(seq)

    def extend(self, seq_id: Hashable, seq: SeqBlocks, num_blocks: int) -> None:
        """Every group's table covers the first `num_blocks` logical blocks (the window groups' taken from
        their promise first)."""
        tables = self.tables
        if not self.chunked:  # one full group: every token has its slots from admission on
            seq.window_blocks = seq.num_blocks(tables.block_size)
            return
        if num_blocks <= seq.window_blocks:
            return
        full = sum(num_blocks - len(seq.tables[m.group]) for m in self.managers if not m.promised)
        windows = sum(num_blocks - len(seq.tables[m.group]) for m in self.windowed)
        needed = full + max(0, windows - seq.promise)  # the window groups draw on their promise first
        if needed > tables.num_free:
            raise NoFreeBlocks(
                f"sequence {seq_id!r} needs {needed} free blocks beyond its promise for its chunk, "
                f"{tables.num_free} free"
            )
        for g, table in enumerate(seq.tables):
            first = len(table)
            table[first:] = tables.take(g, table + [None] * (num_blocks - first), first)[first:]
            for i in range(first, num_blocks):
                tables.fill(seq, g, i)
                tables.resident_slots += table[i].num_tokens
        seq.window_blocks = num_blocks
        self.set_promise(seq)

    def set_promise(self, seq: SeqBlocks) -> None:
        """Set aside what the window groups of a prompt being prefilled may still take from the pool."""
        promise = 0
        if seq.host_blocks is None:
            owned = [held_alone(seq.tables[m.group][seq.released[m.group] :]) for m in self.windowed]
            promise = self.promise(seq, owned)
        self.tables.promised += promise - seq.promise
        seq.promise = promise

    def promise(self, seq: SeqBlocks, owned: list[int]) -> int:
        """The most a prompt's window groups may still draw from the pool while it is prefilled, given the
        blocks each holds alone (`owned`, in window-group order): each holds at most its peak at once, and
        a block it gives back returns to the pool only if no other table holds it."""
        if not seq.prefilling(self.tables.block_size):
            return 0
        n = len(seq.token_ids)
        return sum(m.promise(n, alone) for m, alone in zip(self.windowed, owned, strict=True))

    def refresh(self, seqs: Iterable[SeqBlocks]) -> None:
        """After blocks were shared: a prefill whose own block another table now holds may draw one more
        (the admission that shared it paid for that)."""
        for seq in seqs if self.chunked else ():
            if seq.prefilling(self.tables.block_size):
                self.set_promise(seq)
