"""Physical KV blocks: reference counts, a free queue in eviction order, and the prefix-cache index."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence

from pagedllm.kv.interface import NoFreeBlocks


class Block:
    """One physical block of `block_size` token slots."""

    __slots__ = ("block_id", "ref_cnt", "num_tokens", "block_hash", "prev", "next")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0  # block tables holding this block
        self.num_tokens = 0  # slots written
        self.block_hash: bytes | None = None  # set while the block is findable in the prefix cache
        self.prev: Block | None = None  # neighbours in the free queue
        self.next: Block | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref_cnt={self.ref_cnt}, num_tokens={self.num_tokens})"


class FreeBlockQueue:
    """Free blocks as a doubly linked list, front first out: O(1) pop, push at either end, and remove."""

    def __init__(self, blocks: Iterable[Block]):
        self._head = Block(-1)  # sentinels: the list never has to special-case its ends
        self._tail = Block(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Block]:
        block = self._head.next
        while block is not self._tail:
            yield block
            block = block.next

    def popleft(self) -> Block:
        if self._len == 0:
            raise NoFreeBlocks("the free block queue is empty")
        block = self._head.next
        self.remove(block)
        return block

    def append(self, block: Block) -> None:
        self._link(block, self._tail.prev, self._tail)

    def appendleft(self, block: Block) -> None:
        self._link(block, self._head, self._head.next)

    def remove(self, block: Block) -> None:
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self._len -= 1

    def _link(self, block: Block, prev: Block, nxt: Block) -> None:
        block.prev, block.next = prev, nxt
        prev.next = nxt.prev = block
        self._len += 1


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra_key: str | None) -> bytes:
    """SHA-256 chain key of a full block: its parent's key, its tokens and an optional salt."""
    return hashlib.sha256(repr((parent, tuple(token_ids), extra_key)).encode()).digest()


class BlockPool:
    """Owns every physical block; hands out free ones, evicting least recently used cached blocks first.

    A freed block that holds a cached full block goes to the back of the free queue (it stays findable
    by its hash until it reaches the front and is reused); a freed block with no hash goes to the front,
    so plain blocks are reused before any cached content is evicted. Also counts the live slots: tokens
    written in blocks that some sequence holds.
    """

    def __init__(self, num_blocks: int):
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, Block] = {}
        self.live_slots = 0

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self) -> Block:
        """An empty block with ref count 1, evicting the front of the free queue from the cache."""
        block = self.free_queue.popleft()
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_cnt, block.num_tokens = 1, 0
        return block

    def touch(self, block: Block) -> None:
        """One more table holds `block` (a cached one may be taken back out of the free queue)."""
        if block.ref_cnt == 0:
            self.free_queue.remove(block)
            self.live_slots += block.num_tokens
        block.ref_cnt += 1

    def release(self, blocks: Iterable[Block]) -> None:
        """One table fewer holds each block; pass a sequence's blocks tail first (they get evicted first)."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.live_slots -= block.num_tokens
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def write(self, block: Block, num_tokens: int) -> None:
        """`num_tokens` more slots of a held block now hold tokens."""
        block.num_tokens += num_tokens
        self.live_slots += num_tokens

    def cache(self, block: Block, block_hash: bytes) -> None:
        """Make a full block findable by its hash (an equal block already cached keeps its place)."""
        if block_hash not in self.cached:
            self.cached[block_hash] = block
            block.block_hash = block_hash
