"""One physical KV block, and the key it is cached under: what the pool, the tables and the journal share."""

from __future__ import annotations

CacheKey = tuple[int, bytes]  # a cached block's KV group and hash: each group's blocks are cached apart


class Block:
    """One physical block of `block_size` token slots."""

    __slots__ = (
        "block_id",
        "ref_cnt",
        "num_tokens",
        "block_hash",
        "group",
        "room",
        "freed_at",
        "prev",
        "next",
    )

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0  # block tables holding this block
        self.num_tokens = 0  # slots written
        self.block_hash: CacheKey | None = None  # set while the block is findable in the prefix cache
        self.group = -1  # the KV group whose table took it last
        self.room = False  # free and set aside for the growth of the sequence just before it
        self.freed_at = 0  # BlockPool.clock when last released cached (its place in the release order)
        self.prev: Block | None = None  # neighbours in the free queue
        self.next: Block | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref_cnt={self.ref_cnt}, num_tokens={self.num_tokens})"
