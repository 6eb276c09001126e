"""The step journal: what a step makes findable in the device prefix cache stays provisional until it ends.

A prompt's full blocks become findable when the step that computes them is scheduled (other prompts of the
same step may share them at once), so their K/V is only real once that step's forward pass has run. The
engine ends every step with the allocator's `commit()` (the forward and its postprocessing succeeded) or
`rollback()` (it raised). The journal holds the keys cached since the last commit: a commit keeps them and
only then reports them to the KV event log (a replica's router never learns of a block whose K/V may not
exist); a rollback makes them unfindable again (the blocks stay where they are, as plain blocks). A key
cached and evicted within one step is dropped from the journal: nothing of it moves down a tier and no
event names it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.kv.block import Block, CacheKey
    from pagedllm.kv.events import KVEventLog


class StepJournal:
    """The prefix-cache keys cached since the last commit, in caching order, with their events' payloads."""

    def __init__(self) -> None:
        self.pending: dict[CacheKey, Block] = {}
        # first group: (parent, tokens, LoRA adapter)
        self._stored: dict[bytes, tuple[bytes | None, list[int], int | None]] = {}

    def cached(self, key: CacheKey, block: Block) -> None:
        self.pending[key] = block

    def stored(
        self, block_hash: bytes, parent: bytes | None, token_ids: Sequence[int], lora_id: int | None = None
    ) -> None:
        """The BlockStored event of a first-group key just cached, to emit at the commit."""
        self._stored[block_hash] = (parent, list(token_ids), lora_id)

    def evicted(self, key: CacheKey) -> bool:
        """The pool evicted `key`; whether it was cached this step (then it is forgotten here)."""
        if self.pending.pop(key, None) is None:
            return False
        if key[0] == 0:
            self._stored.pop(key[1], None)
        return True

    def commit(self, events: KVEventLog | None) -> None:
        """Every pending key stays: report the first group's as stored (in caching order)."""
        if events is not None:
            for block_hash, (parent, token_ids, lora_id) in self._stored.items():
                events.stored(block_hash, parent, token_ids, lora_id)
        self.pending.clear()
        self._stored.clear()

    def rollback(self) -> list[tuple[CacheKey, Block]]:
        """Forget every pending key; returns them with their blocks, for the pool to unhash."""
        undone = list(self.pending.items())
        self.pending.clear()
        self._stored.clear()
        return undone
