"""Physical KV blocks: reference counts, a free queue in eviction order, and the prefix-cache index."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from pagedllm.kv.block import Block, CacheKey
from pagedllm.kv.interface import NoFreeBlocks
from pagedllm.kv.journal import StepJournal
from pagedllm.kv.tiers import PrefixTiers

if TYPE_CHECKING:
    from pagedllm.kv.events import KVEventLog


class FreeBlockQueue:
    """Free blocks as a doubly linked list, front first out: O(1) look at the front, push at either end,
    and remove."""

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

    def front(self) -> Block | None:
        return self._head.next if self._len else None

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


def hash_block(parent: bytes | None, token_ids: Sequence[int], lora_int_id: int | None = None) -> bytes:
    """SHA-256 chain key of a full block: its parent's key, its tokens, and the LoRA adapter its K/V was
    computed under (vLLM's extra key lora_int_id; None: the base, whose keys carry no extra)."""
    key = (parent, tuple(token_ids)) if lora_int_id is None else (parent, tuple(token_ids), (lora_int_id,))
    return hashlib.sha256(repr(key).encode()).digest()


def block_hash_chain(
    token_ids: Sequence[int], block_size: int, lora_int_id: int | None = None
) -> list[bytes]:
    """The hash chain of the full blocks of `token_ids` under a LoRA adapter (None: the base): the prefix
    cache's keys (and KV events' names)."""
    hashes: list[bytes] = []
    for i in range(len(token_ids) // block_size):
        block = token_ids[i * block_size : (i + 1) * block_size]
        hashes.append(hash_block(hashes[-1] if hashes else None, block, lora_int_id))
    return hashes


class BlockPool:
    """Owns every physical block; hands out free ones, evicting least recently used cached blocks first.

    A freed block that holds a cached full block goes to the back of the free queue (it stays findable
    by its hash until it reaches the front and is reused); a freed block with no hash goes to the front,
    so plain blocks are reused before any cached content is evicted. Also counts the live slots: tokens
    written in blocks that some sequence holds.

    Placement: a sequence's next block is the one right after its newest where that one is free (and
    plain, or cached but cold: in the older half of the free queue, when some cached block is evicted
    anyway), and the `room` such blocks after a newly taken one are set aside for it (handed to others
    only after every plain block), so that a sequence's K/V lies in long runs: a CPU reads a batch's K/V
    in runs ~1.6x as fast as in blocks scattered at random (docs/BENCHMARKS.md). Which cached content
    is evicted stays least recently used first, up to that choice among the older half.
    """

    def __init__(self, num_blocks: int, room: int = 0, tiers: PrefixTiers | None = None):
        self.tiers = tiers  # told of every block cached and evicted (one KV group only)
        self.events: KVEventLog | None = None  # told of the first KV group's evictions (kv/events.py)
        self.journal = StepJournal()  # the keys cached since the last commit (kv/journal.py)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.room_queue = FreeBlockQueue([])  # free blocks set aside for a run's growth, oldest first
        self.room = room
        self.cached: dict[CacheKey, Block] = {}
        self.live_slots = 0
        self.clock = 0  # cached blocks released so far

    @property
    def num_free(self) -> int:
        return len(self.free_queue) + len(self.room_queue)

    def allocate(self, after: Block | None = None) -> Block:
        """An empty block with ref count 1: the one right after `after` (a sequence's newest block) when
        it may extend that sequence's run, else the first of: a plain block of the free queue, a block set
        aside as room, the least recently used cached block (evicted from the cache)."""
        front = self.free_queue.front()
        if front is not None and front.block_hash is None:
            fallback = front  # a plain block
        else:
            fallback = self.room_queue.front() or front  # room set aside, else the least recently used
        if fallback is None:
            raise NoFreeBlocks("no free block")
        block = self._follower(after, evicting=fallback.block_hash is not None) or fallback
        self._unqueue(block)
        if block.block_hash is not None:
            self._evict(block)
        block.ref_cnt, block.num_tokens = 1, 0
        for following in self.blocks[block.block_id + 1 : block.block_id + 1 + self.room]:
            if not self._extends_runs(following, evicting=True):
                break
            if not following.room:
                self.free_queue.remove(following)
                following.room = True
                self.room_queue.append(following)
        return block

    def _evict(self, block: Block) -> None:
        """Drop a free block's content from the cache: a copy moves down a tier and its removal is an event,
        unless it was cached this step (its K/V may not be computed yet: nothing to keep or report)."""
        key, block.block_hash = block.block_hash, None
        del self.cached[key]
        if self.journal.evicted(key):
            if self.tiers is not None:
                self.tiers.uncached(key[1])
            return
        if self.tiers is not None:
            self.tiers.evicted(key[1], block.block_id)
        if self.events is not None and key[0] == 0:
            self.events.removed(key[1])

    def _follower(self, block: Block | None, evicting: bool) -> Block | None:
        """The block right after `block`, if it may extend a run."""
        if block is None or block.block_id + 1 == len(self.blocks):
            return None
        following = self.blocks[block.block_id + 1]
        return following if self._extends_runs(following, evicting) else None

    def _extends_runs(self, block: Block, evicting: bool) -> bool:
        """Free, and plain, or (when some cached block is evicted anyway) cached and released at least half
        the free queue's length of releases ago, i.e. in about its older half: taking it out of queue order
        evicts no recently used content."""
        if block.ref_cnt:
            return False
        if block.block_hash is None or block.room:
            return True
        return evicting and 2 * (self.clock - block.freed_at) >= len(self.free_queue)

    def _unqueue(self, block: Block) -> None:
        """Take a free block out of the queue it waits in."""
        if block.room:
            self.room_queue.remove(block)
            block.room = False
        else:
            self.free_queue.remove(block)

    def touch(self, block: Block) -> None:
        """One more table holds `block` (a cached one may be taken back out of the free queue)."""
        if block.ref_cnt == 0:
            self._unqueue(block)
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
                    block.freed_at, self.clock = self.clock, self.clock + 1
                    self.free_queue.append(block)

    def write(self, block: Block, num_tokens: int) -> None:
        """`num_tokens` more slots of a held block now hold tokens."""
        block.num_tokens += num_tokens
        self.live_slots += num_tokens

    def cache(self, block: Block, block_hash: CacheKey) -> bool:
        """Make a full block findable by its hash (an equal block already cached keeps its place); whether
        it was not cached before."""
        if block_hash in self.cached:
            return False
        self.cached[block_hash] = block
        block.block_hash = block_hash
        self.journal.cached(block_hash, block)
        if self.tiers is not None:
            self.tiers.cached(block_hash[1], block.block_id)
        return True

    def commit(self) -> None:
        """The step succeeded: what it cached stays findable (and is reported), its tier entries stay."""
        self.journal.commit(self.events)
        if self.tiers is not None:
            self.tiers.commit()

    def rollback(self) -> set[int]:
        """The step failed: every block it cached is unhashed (held blocks stay held; a free one moves to
        the front of the free queue, as a plain block does) and the tier entries it planned are forgotten.
        Returns the unhashed blocks' ids."""
        undone = set()
        for key, block in self.journal.rollback():
            del self.cached[key]
            block.block_hash = None
            undone.add(block.block_id)
            if block.ref_cnt == 0 and not block.room:
                self.free_queue.remove(block)
                self.free_queue.appendleft(block)
        if self.tiers is not None:
            self.tiers.rollback()
        return undone
