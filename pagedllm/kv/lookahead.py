"""Lookahead slots for speculative decoding.

`reserve_lookahead` gives a sequence slots past its tokens, in every group's table, for the verify pass to
write draft K/V into; accepted tokens fill them by `append` (only then is a block keyed, by accepted
tokens) and `release_lookahead` gives back the rest, a block left holding no token returning to the pool
(a sequence holding lookahead slots is neither forked nor swapped out: both wait for the release).
"""

from __future__ import annotations

from collections.abc import Hashable

from pagedllm.kv.block_pool import Block
from pagedllm.kv.interface import NoFreeBlocks
from pagedllm.kv.sequence import SeqBlocks
from pagedllm.kv.tables import BlockTables


class LookaheadSlots:
    """Slots held past a sequence's last token in every group's table, for draft tokens."""

    def __init__(self, tables: BlockTables):
        self.tables = tables

    def blocks_needed(self, seq: SeqBlocks, num_slots: int) -> int:
        """Free blocks reserve(num_slots) takes: new ones, and copies of shared last blocks."""
        if num_slots < 0:
            raise ValueError(f"num_slots must be a non-negative integer, got {num_slots!r}")
        if num_slots == 0:
            return 0
        end = self._end(seq, num_slots)
        return sum(end - len(table) + self._last_block_shared(seq, table) for table in seq.tables)

    def reserve(self, seq_id: Hashable, seq: SeqBlocks, num_slots: int) -> list[tuple[int, int]]:
        """Hold `num_slots` more slots past the sequence's tokens in every group (for draft tokens the verify
        pass writes); returns the (src, dst) block copies to do first. Nothing is keyed for the prefix
        cache: the tokens that fill these slots come by `append`, once accepted."""
        needed = self.blocks_needed(seq, num_slots)
        if needed > self.tables.num_free:
            raise NoFreeBlocks(f"sequence {seq_id!r} needs {needed} blocks for {num_slots} lookahead slots")
        copies, end = [], self._end(seq, num_slots)
        for g, table in enumerate(seq.tables):
            if num_slots and self._last_block_shared(seq, table):
                copies.append(self.tables.copy_last_block(seq, g, table))
            while len(table) < end:
                block = self.tables.pool.allocate(after=table[-1])
                block.group = g
                table.append(block)
        seq.num_lookahead += num_slots
        return copies

    def take(self, seq: SeqBlocks) -> bool:
        """The next token takes a slot reserved for it (its K/V may be written already), if one is held."""
        if not seq.num_lookahead:
            return False
        seq.num_lookahead -= 1
        for table in seq.tables:
            self.tables.pool.write(table[len(seq.token_ids) // self.tables.block_size], 1)
        self.tables.resident_slots += len(seq.tables)
        return True

    def release(self, seq: SeqBlocks) -> None:
        """Give back the lookahead slots no token took (rejected drafts): a block left holding no token goes
        back to the pool."""
        keep = seq.num_blocks(self.tables.block_size)
        for table in seq.tables:
            self.tables.pool.release(reversed(table[keep:]))
            del table[keep:]
        seq.num_lookahead = 0

    def _end(self, seq: SeqBlocks, num_slots: int) -> int:
        """The blocks each table spans once `num_slots` more slots are held."""
        return -(-(len(seq.token_ids) + seq.num_lookahead + num_slots) // self.tables.block_size)

    def _last_block_shared(self, seq: SeqBlocks, table: list[Block | None]) -> bool:
        """The last block is partly filled and shared: a write to its free slots must copy it first."""
        held = len(seq.token_ids) + seq.num_lookahead
        return held % self.tables.block_size != 0 and table[-1].ref_cnt > 1
