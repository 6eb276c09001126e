"""The block-table operations every part of the paged allocator shares, and the pictures of the cache."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.kv.block_pool import Block, BlockPool
from pagedllm.kv.interface import KVUsage, SlotState
from pagedllm.kv.sequence import SeqBlocks


@dataclass(frozen=True)
class BlockStates:
    """Every device block, indexed by block id (compact lists, for pictures of the cache)."""

    ref_counts: list[int]  # block tables holding the block (0: free; > 1: shared)
    num_tokens: list[int]  # tokens written in a held block (0 for a free one)
    cached: list[bool]  # findable in the prefix cache (a free cached block can be taken back)
    groups: list[int]  # KV group of a held or cached block (-1: a plain free block)


class BlockTables:
    """Sequences' block tables over the one pool: take new blocks for a group (in runs), hold reused cached
    ones, count a freshly taken block's tokens and cache it if computed, copy a shared last block, give a
    sequence's tables back; and the two counts kept across them."""

    def __init__(self, pool: BlockPool, block_size: int):
        self.pool, self.block_size = pool, block_size
        self.resident_slots = 0  # slots the tables of sequences on the device cover (shared: per table)
        self.promised = 0  # free blocks set aside for prefills in progress (the sum of their promises)

    @property
    def num_free(self) -> int:
        """Blocks a new allocation may take: those no sequence holds (cached-but-unreferenced blocks count
        as free), less those promised to prefills in progress."""
        return self.pool.num_free - self.promised

    def take(self, group: int, blocks: list[Block | None], first: int = 0) -> list[Block | None]:
        """`blocks` with each None from index `first` on replaced by a newly taken block of the group,
        placed right after the one before it where that one is free (one run of memory per table where the
        pool allows); the entries before `first` stay as they are (None: given back)."""
        taken, new = list(blocks[:first]), []
        for i in range(first, len(blocks)):
            block = blocks[i]
            if block is None:
                block = self.pool.allocate(after=taken[-1] if taken else None)
                block.group = group
                new.append(i)
            taken.append(block)
        for i, block in zip(new, sorted((taken[i] for i in new), key=lambda b: b.block_id), strict=True):
            taken[i] = block  # ascending: blocks evicted tail first come back as a forward run
        return taken

    def touch(self, tables: list[list[Block | None]]) -> None:
        for table in tables:
            for block in table:
                if block is not None:
                    self.pool.touch(block)

    def fits(self, reused: list[list[Block | None]], num_new: int) -> bool:
        """Reused cached blocks that no one holds leave the free queue too."""
        unheld = sum(block is not None and block.ref_cnt == 0 for group in reused for block in group)
        return num_new + unheld <= self.num_free

    def fill(self, seq: SeqBlocks, group: int, i: int) -> None:
        """Count the tokens of a freshly taken block i of a group as written; cache it if its K/V was
        computed."""
        bs, block = self.block_size, seq.tables[group][i]
        self.pool.write(block, min(bs, len(seq.token_ids) - i * bs))
        if i < seq.num_cached_blocks:
            self.cache(seq, group, i)

    def cache(self, seq: SeqBlocks, group: int, i: int) -> None:
        """Make block i of a group's table findable by its hash; a first-group block newly cached is an
        event of the log, if one is set, once the step commits (kv/journal.py)."""
        if (
            self.pool.cache(seq.tables[group][i], (group, seq.block_hashes[i]))
            and group == 0
            and self.pool.events is not None
        ):
            bs, parent = self.block_size, seq.block_hashes[i - 1] if i else None
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            self.pool.journal.stored(seq.block_hashes[i], parent, tokens, seq.lora_int_id)

    def copy_last_block(self, seq: SeqBlocks, group: int, table: list[Block | None]) -> tuple[int, int]:
        """Copy on write: replace the group's shared, partly filled last block by a copy of its own;
        returns the (src, dst) copy to make."""
        shared = table.pop()
        block = self.pool.allocate()
        block.group = group
        self.pool.write(block, len(seq.token_ids) - len(table) * self.block_size)
        self.pool.release([shared])
        table.append(block)
        return shared.block_id, block.block_id

    def release(self, seq: SeqBlocks) -> None:
        """Give back every held block of every group, each table tail first; the tables become empty."""
        for table in seq.tables:
            self.pool.release(block for block in reversed(table) if block is not None)
            table.clear()

    # -- pictures of the cache -------------------------------------------------------------------------

    def usage(self) -> KVUsage:
        pool, bs = self.pool, self.block_size
        free, total = pool.num_free * bs, len(pool.blocks) * bs
        return KVUsage(
            total_slots=total,
            live_slots=pool.live_slots,
            reserved_slots=0,
            tail_slots=total - free - pool.live_slots,
            free_slots=free,
            largest_free_run=free,  # any free block serves any sequence: no contiguity needed
            external_frag_slots=0,
            shared_saved_slots=self.resident_slots - pool.live_slots,
        )

    def block_states(self) -> BlockStates:
        blocks = self.pool.blocks
        return BlockStates(
            [block.ref_cnt for block in blocks],
            [block.num_tokens if block.ref_cnt else 0 for block in blocks],
            [block.block_hash is not None for block in blocks],
            [block.group if block.ref_cnt or block.block_hash is not None else -1 for block in blocks],
        )

    def slot_states(self) -> list[SlotState]:
        """Every device slot in address order: a held block is live up to its tokens, then tail."""
        bs, states = self.block_size, []
        for block in self.pool.blocks:
            if block.ref_cnt == 0:
                states += [SlotState.FREE] * bs
            else:
                states += [SlotState.LIVE] * block.num_tokens + [SlotState.TAIL] * (bs - block.num_tokens)
        return states
