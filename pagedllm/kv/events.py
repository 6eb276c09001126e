"""The prefix cache's changes as vLLM's KV cache events (vllm/distributed/kv_events.py).

A router that knows which prefix blocks each engine holds can send a request where its prompt is cached.
vLLM publishes that knowledge as events: `BlockStored` when full blocks become findable by their hash
(with the parent block's hash and the blocks' tokens, so a reader can rebuild the chain), `BlockRemoved`
when cached blocks are evicted, `AllBlocksCleared` when the cache is emptied (here: once, when the log
starts, so a reader drops whatever an earlier engine of the same name held). The allocator appends them
on the engine thread; a publisher drains them from any thread (deque appends and pops are atomic).
Only the first KV group's blocks are reported: every group of a prompt caches the same hash chain.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[bytes]
    medium: str | None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventLog:
    """The events since the last `drain`, oldest first."""

    def __init__(self, block_size: int, medium: str = "CPU"):
        self.block_size, self.medium = block_size, medium
        self._events: deque[KVCacheEvent] = deque([AllBlocksCleared()])

    def stored(
        self, block_hash: bytes, parent: bytes | None, token_ids: Sequence[int], lora_id: int | None = None
    ) -> None:
        self._events.append(
            BlockStored([block_hash], parent, list(token_ids), self.block_size, lora_id, self.medium)
        )

    def removed(self, block_hash: bytes) -> None:
        self._events.append(BlockRemoved([block_hash], self.medium))

    def drain(self) -> list[KVCacheEvent]:
        events = []
        while self._events:
            events.append(self._events.popleft())
        return events
