"""What the KV tests read off an allocator through its public surface."""

from __future__ import annotations

from collections.abc import Hashable


def slots(kv, seq_id: Hashable, start: int = 0) -> list[int]:
    """The cache slot of each token from `start` on, by the protocol's rule:
    `block_table[t // block_size] * block_size + t % block_size`."""
    table, bs = kv.block_table(seq_id), kv.block_size
    return [table[t // bs] * bs + t % bs for t in range(start, kv.num_tokens(seq_id))]


def free_order(pool) -> list[int]:
    """The free blocks of a BlockPool as it queues them: the free queue front first, then the room."""
    return [block.block_id for block in pool.free_queue] + [block.block_id for block in pool.room_queue]


def group_slots(kv, seq_id: Hashable, group: int, start: int = 0) -> list[tuple[int, int | None]]:
    """(position, slot) of each token from `start` on that a KV group's table covers (slot None where the
    group gave the block back)."""
    table, bs = kv.block_tables(seq_id)[group], kv.block_size
    end = min(kv.num_tokens(seq_id), len(table) * bs)
    return [(t, None if table[t // bs] < 0 else table[t // bs] * bs + t % bs) for t in range(start, end)]
