"""One manager per KV group kind (vLLM v1's SingleTypeKVCacheManager): what differs between full attention
and sliding-window layers, behind one interface the PagedAllocator (kv/paged.py) coordinates.

A sliding-window group of window w gives a block back (to the pool, or to the prefix cache's least recently
used end) once no query of the sequence reads it: when every token in it is at least w before the first
token a step computes. Its table keeps the position (None; NO_BLOCK in the views), so the kernels, which
clamp a sliding layer's reads to its window, never see it. How a prompt's window groups take their blocks
chunk by chunk is kv/prefill.py's.

A new kind is one subclass of GroupManager, registered with `@register`: `handles` says which groups'
specs (a window, or None) it serves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from pagedllm.kv.block_pool import Block, BlockPool
from pagedllm.kv.sequence import SeqBlocks


def held_alone(blocks: Sequence[Block | None]) -> int:
    """Blocks one table holds alone: giving one back frees it; reusing a cached one may cost its holder."""
    return sum(block is not None and block.ref_cnt == 1 for block in blocks)


class GroupManager:
    """The rules of one KV group's block tables over the shared pool: which of a sequence's blocks its
    queries read, how many it holds at once while a prompt is prefilled, what admission takes for it, and
    how long a cached prefix it can serve. The base class is full attention's rules where they are simple."""

    kinds: ClassVar[list[type[GroupManager]]] = []  # registered kinds, asked in order (`@register`)
    promised: ClassVar[bool] = False  # a prefill's blocks for it are promised at admission (windows)

    def __init__(
        self, group: int, window: int | None, block_size: int, prefill_chunk: int | None, chunked: bool
    ):
        self.group, self.window, self.block_size = group, window, block_size
        self.prefill_chunk = prefill_chunk
        self.chunked = chunked  # every group takes a prompt's blocks chunk by chunk (window groups exist)

    @staticmethod
    def handles(window: int | None) -> bool:
        raise NotImplementedError

    def blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def first_needed(self, start: int) -> int:
        """The first logical block the group reads for queries from position `start` on."""
        return 0

    def peak(self, num_tokens: int) -> int:
        """The most blocks the group's table holds while a prompt of `num_tokens` is prefilled."""
        return self.blocks(num_tokens)

    def admission_blocks(self, num_tokens: int) -> int:
        """Blocks the group needs free to admit a prompt of `num_tokens`."""
        raise NotImplementedError

    def new_blocks(self, hits: list[Block | None], num_tokens: int, num_hit: int) -> int:
        """Blocks admission takes now or promises for the group, given its reused cached blocks."""
        raise NotImplementedError

    def longest_hit(self, pool: BlockPool, hashes: list[bytes], num_hit: int) -> int:
        """The most leading blocks, at most `num_hit`, of a prompt with `hashes` the group can serve."""
        raise NotImplementedError

    def hits(self, pool: BlockPool, hashes: list[bytes], num_hit: int) -> list[Block | None]:
        """The cached blocks a hit of `num_hit` blocks reuses (None before the group's window)."""
        first = self.first_needed(num_hit * self.block_size)
        return [None] * first + [pool.cached[(self.group, h)] for h in hashes[first:num_hit]]

    def release_behind(self, pool: BlockPool, seq: SeqBlocks, start: int) -> int:
        """Give back the blocks no query from position `start` on reads; returns their written slots."""
        return 0

    def promise(self, num_tokens: int, owned: int) -> int:
        """What a prompt of `num_tokens` may still draw from the pool for the group while it is prefilled,
        given the blocks its table holds alone."""
        return 0


def register(kind: type[GroupManager]) -> type[GroupManager]:
    GroupManager.kinds.append(kind)
    return kind


def make_manager(
    group: int, window: int | None, block_size: int, prefill_chunk: int | None, chunked: bool
) -> GroupManager:
    """The manager of the first registered kind that handles the group's window."""
    kind = next((kind for kind in GroupManager.kinds if kind.handles(window)), None)
    if kind is None:
        raise ValueError(f"no KV group kind handles window {window!r}")
    return kind(group, window, block_size, prefill_chunk, chunked)


@register
class FullAttentionManager(GroupManager):
    """Full attention: every query reads every key, so the group holds every block of the sequence."""

    @staticmethod
    def handles(window: int | None) -> bool:
        return window is None

    def admission_blocks(self, num_tokens: int) -> int:
        """Beside window groups its first chunk's blocks (the rest come chunk by chunk), alone all."""
        if self.chunked:
            return self.blocks(min(num_tokens, self.prefill_chunk or num_tokens))
        return self.peak(num_tokens)

    def new_blocks(self, hits: list[Block | None], num_tokens: int, num_hit: int) -> int:
        return min(self.admission_blocks(num_tokens), self.blocks(num_tokens) - num_hit)

    def longest_hit(self, pool: BlockPool, hashes: list[bytes], num_hit: int) -> int:
        cached = pool.cached
        return next((i for i, h in enumerate(hashes[:num_hit]) if (self.group, h) not in cached), num_hit)


@register
class SlidingWindowManager(GroupManager):
    """A sliding window of `window` tokens: a query reads only the keys of its window, so the group gives
    back the blocks behind it and holds at most a window and a chunk's blocks at once."""

    promised = True

    @staticmethod
    def handles(window: int | None) -> bool:
        return window is not None

    def first_needed(self, start: int) -> int:
        return max(0, start + 1 - self.window) // self.block_size

    def peak(self, num_tokens: int) -> int:
        """The blocks a step's keys and new tokens span: the window before its first token, and a chunk of
        prefill_chunk tokens (consecutive positions: at most ceil((span - 1) / block_size) + 1)."""
        if self.prefill_chunk is None:
            return self.blocks(num_tokens)
        span = self.window - 1 + self.prefill_chunk
        return min(self.blocks(num_tokens), self.blocks(span - 1) + 1)

    def admission_blocks(self, num_tokens: int) -> int:
        return self.peak(num_tokens)

    def new_blocks(self, hits: list[Block | None], num_tokens: int, num_hit: int) -> int:
        """The prefill's blocks beyond the hit are promised; a hit this table holds alone may cost its
        prefill one more block."""
        first = self.first_needed(num_hit * self.block_size)
        cold = sum(block.ref_cnt == 0 for block in hits[first:])  # this table's alone once reused
        return max(0, self.peak(num_tokens) - cold) + held_alone(hits)

    def longest_hit(self, pool: BlockPool, hashes: list[bytes], num_hit: int) -> int:
        """Only the hit's last window need be cached (vLLM's rule)."""
        run = [0]  # run[m]: cached blocks just before block m
        for h in hashes[:num_hit]:
            run.append(run[-1] + 1 if (self.group, h) in pool.cached else 0)
        satisfied = (m for m in range(num_hit, 0, -1) if run[m] >= m - self.first_needed(m * self.block_size))
        return next(satisfied, 0)

    def release_behind(self, pool: BlockPool, seq: SeqBlocks, start: int) -> int:
        g = self.group
        table, first = seq.tables[g], min(self.first_needed(start), len(seq.tables[g]) - 1)
        behind = [table[i] for i in range(seq.released[g], first) if table[i] is not None]
        pool.release(behind)  # oldest first: the older content is evicted first
        table[seq.released[g] : max(first, seq.released[g])] = [None] * max(0, first - seq.released[g])
        seq.released[g] = max(seq.released[g], first)
        return sum(block.num_tokens for block in behind)

    def promise(self, num_tokens: int, owned: int) -> int:
        return max(0, self.peak(num_tokens) - owned)
