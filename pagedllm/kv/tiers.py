"""Prefix cache tiers under the device cache: host memory, then disk (bookkeeping only, pure Python).

A full cached block that the device pool evicts moves down to the host tier, keyed by its hash chain
(one copy per hash, however many prompts share it); a prompt whose next blocks are found below the
device cache gets them loaded back into device blocks before its prefill, and they count as prefix
hits. With a disk tier every block the device caches is also written to disk after the step that
computes it (write-through: a restarted process finds it), and a prompt's blocks found only on disk
are first read into host slots (prefetch: the engine reads them on a background thread, checks their
checksums, and the prompt waits in the queue while other requests step) and loaded from there.
Each tier is bounded by its size in blocks and evicts its least recently used block; swap
preemption takes its host blocks from the same host pool, evicting cached ones if it must.

Nothing here touches bytes: the allocator asks the tiers where a block is and records the copies to
make (TierMoves); the engine's runner makes them, the way swap preemption's copies are made. A host copy
or disk write planned is provisional until the step that makes it commits (kv/journal.py): a failed step's
`rollback` forgets those entries (their bytes may never have been written) and drops its pending copies.

Loads happen only when they pay: `load_pays(tier)` compares the measured seconds to load a block from
that tier with the seconds to prefill its tokens (the engine feeds both in as it runs: `observe_*`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

HOST, DISK = "host", "disk"


@dataclass
class TierMoves:
    """The copies a step needs, taken by the engine once per step (`PrefixTiers.take_moves`)."""

    offload: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot), pre-forward
    load: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block), after offload
    persist: list[tuple[int, bytes]] = field(default_factory=list)  # (device block, key), after the forward
    drop: list[bytes] = field(default_factory=list)  # keys whose files leave the disk tier


@dataclass
class TierCounters:
    """Blocks and bytes through each tier since start (what /metrics and stats() report)."""

    host_hit_blocks: int = 0  # blocks loaded from host memory into the device cache
    disk_hit_blocks: int = 0  # blocks read from disk (into host memory, then the device)
    offloaded_blocks: int = 0  # device -> host copies of evicted blocks
    persisted_blocks: int = 0  # device -> disk writes
    disk_evicted_blocks: int = 0  # files deleted to keep the disk tier within its size
    disk_corrupt_blocks: int = 0  # files that failed their checksum (deleted, recomputed)


@dataclass
class Prefetch:
    """A waiting prompt's disk-tier reads: the new ones to start, and whether it must wait for reads."""

    reads: list[tuple[bytes, int]] = field(default_factory=list)  # (key, host slot) to read it into
    pending: bool = False  # some of its next blocks are being read (these or earlier ones): not admitted yet


@dataclass
class _Planned:
    """Tier entries planned and not committed yet: host copies of evicted blocks, keys written to disk."""

    host: list[tuple[bytes, int]] = field(default_factory=list)  # (key, host slot)
    disk: list[bytes] = field(default_factory=list)

    def extend(self, other: _Planned) -> None:
        self.host += other.host
        self.disk += other.disk


@dataclass(frozen=True)
class TierUsage:
    """Each tier's size and what it holds now, in blocks, and the counters (`PrefixTiers.usage()`)."""

    host_blocks: int  # the host pool (swap preemption's blocks included)
    host_used_blocks: int  # of them not free: cached prefix blocks, swapped sequences', disk reads' slots
    host_cached_blocks: int  # prefix blocks held in host memory
    disk_blocks: int  # the disk tier's size (0: no disk tier)
    disk_cached_blocks: int  # prefix blocks in its files
    reading_blocks: int  # host slots that disk reads in flight are filling
    counters: TierCounters
    # The cost model's measurements (None: not measured yet): seconds to load a block, to prefill a token.
    host_load_seconds_per_block: float | None = None
    disk_load_seconds_per_block: float | None = None
    prefill_seconds_per_token: float | None = None


class HostPool:
    """The host blocks: free ones, blocks swapped-out sequences hold, and cached prefix blocks (LRU).

    A cached block is reclaimable: `take()` evicts the least recently used one when no block is free.
    Blocks this step's copies read or write are pinned (not evicted) until the step's moves are taken."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack, lowest id on top
        self.cached: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, least recently used first
        self.pinned: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_reclaimable(self) -> int:
        """Blocks `take()` may give: free ones and cached ones (pinned ones only after this step)."""
        pinned = sum(slot in self.pinned for slot in self.cached.values()) if self.pinned else 0
        return len(self._free) + len(self.cached) - pinned

    def take(self) -> tuple[int, bytes | None] | None:
        """A free block, else the least recently used unpinned cached one (and the key it drops)."""
        if self._free:
            return self._free.pop(), None
        for key, slot in self.cached.items():
            if slot not in self.pinned:
                del self.cached[key]
                return slot, key
        return None

    def give_back(self, slots: Iterable[int]) -> None:
        self._free.extend(slots)

    def cache(self, key: bytes, slot: int) -> None:
        self.cached[key] = slot

    def touch(self, key: bytes) -> None:
        self.cached.move_to_end(key)

    def forget(self, key: bytes) -> None:
        slot = self.cached.pop(key, None)
        if slot is not None:
            self._free.append(slot)


class DiskTier:
    """Keys of the blocks on disk, least recently used first, at most `num_blocks` of them."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.keys: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self.keys

    def add(self, key: bytes) -> list[bytes]:
        """Record a block written; returns the keys evicted to stay within the size."""
        self.keys[key] = None
        evicted = []
        while len(self.keys) > self.num_blocks:
            evicted.append(self.keys.popitem(last=False)[0])
        return evicted

    def touch(self, key: bytes) -> None:
        self.keys.move_to_end(key)

    def forget(self, key: bytes) -> None:
        self.keys.pop(key, None)


class PrefixTiers:
    """The host and disk tiers of one device prefix cache, the copies they plan, and their costs."""

    def __init__(self, host: HostPool, disk: DiskTier | None = None, block_size: int = 16):
        self.host = host
        self.disk = disk
        self.block_size = block_size
        self.counters = TierCounters()
        self._moves = TierMoves()
        self._planned = _Planned()  # entries whose copies are in self._moves (not taken yet)
        self._taken = _Planned()  # entries whose copies this step took (committed with it)
        self.reading: dict[bytes, int] = {}  # key -> host slot, for the disk reads in flight
        # Measured seconds: to load one block from each tier, and to prefill one token (None: not yet).
        self.load_seconds: dict[str, float | None] = {HOST: None, DISK: None}
        self.prefill_seconds_per_token: float | None = None

    # -- what the allocator asks ---------------------------------------------------------------

    def evicted(self, key: bytes, block_id: int) -> None:
        """The device cache dropped a computed block: keep a host copy (one per key)."""
        if key in self.host.cached:
            self.host.touch(key)
            return
        taken = self.host.take() if self.host.num_blocks else None
        if taken is None:
            return  # every host block is held by swapped sequences or this step's copies
        slot, _ = taken
        self.host.cache(key, slot)
        self.host.pinned.add(slot)  # written this step: no swap-out may take it before the copy is made
        self._moves.offload.append((block_id, slot))
        self._planned.host.append((key, slot))
        self.counters.offloaded_blocks += 1

    def cached(self, key: bytes, block_id: int) -> None:
        """A device block became findable by `key`: write it through to disk after its step's forward."""
        if self.disk is None:
            return
        if key in self.disk:
            self.disk.touch(key)
            return
        self._moves.persist.append((block_id, key))
        self._planned.disk.append(key)
        self.counters.persisted_blocks += 1
        for old in self.disk.add(key):
            self._moves.drop.append(old)
            self.counters.disk_evicted_blocks += 1

    def uncached(self, key: bytes) -> None:
        """A block cached this step left the device cache before its step ended: a write-through not yet
        made never will be (the block may be reused before the forward that would compute it)."""
        persist = [(block, k) for block, k in self._moves.persist if k != key]
        if len(persist) < len(self._moves.persist):
            self._moves.persist = persist
            self._planned.disk.remove(key)
            self.disk.forget(key)
            self.counters.persisted_blocks -= 1

    def host_run(self, keys: Iterable[bytes]) -> list[int]:
        """Host slots of the leading keys found in host memory (empty where loading them does not pay)."""
        slots = []
        for key in keys:
            slot = self.host.cached.get(key)
            if slot is None:
                break
            slots.append(slot)
        return slots if self.load_pays(HOST) else []

    def load(self, key: bytes, slot: int, block_id: int) -> None:
        """Plan the copy of a host-cached block into a device block (read before this step ends)."""
        self.host.touch(key)
        self.host.pinned.add(slot)
        self._moves.load.append((slot, block_id))
        self.counters.host_hit_blocks += 1

    def plan_prefetch(self, keys: list[bytes]) -> Prefetch:
        """For the leading keys found on disk (after a prompt's device and host hits): host slots to read
        the ones not read yet into, and whether the prompt waits for reads in flight."""
        plan = Prefetch()
        if self.disk is None or not self.load_pays(DISK):
            return plan
        for key in keys:
            if key in self.reading:
                plan.pending = True  # another prompt's read brings it
                continue
            if key in self.host.cached:  # a read landed since the caller looked
                self.host.touch(key)
                continue
            if key not in self.disk:
                break
            taken = self.host.take()  # a slot taken is neither free nor cached: no one else uses it
            if taken is None:
                break
            slot, _ = taken
            self.disk.touch(key)  # most recently used: the disk tier must not evict it while it is read
            self.reading[key] = slot
            plan.reads.append((key, slot))
        plan.pending = plan.pending or bool(plan.reads)
        return plan

    def prefetched(self, reads: list[tuple[bytes, int]], ok: list[bool]) -> None:
        """The engine read these files: good blocks are now host-cached, a failed one (missing,
        truncated, checksum wrong) leaves the disk tier and is recomputed."""
        for (key, slot), good in zip(reads, ok, strict=True):
            del self.reading[key]
            if good:
                self.host.cache(key, slot)
                self.disk.touch(key)
                self.counters.disk_hit_blocks += 1
            else:
                self.host.give_back([slot])
                if key in self.disk:  # else the disk tier dropped it while it was read: not corrupt
                    self.disk.forget(key)
                    self.counters.disk_corrupt_blocks += 1

    def take_moves(self) -> TierMoves:
        """The copies planned since the last call; this step's pins end with it."""
        moves, self._moves = self._moves, TierMoves()
        self._taken.extend(self._planned)
        self._planned = _Planned()
        self.host.pinned.clear()
        return moves

    def commit(self) -> None:
        """The step whose moves were taken succeeded: its host and disk entries stay (those planned since,
        whose copies the next step makes, wait for that step's commit)."""
        self._taken = _Planned()

    def rollback(self) -> None:
        """The step failed: forget the host and disk entries planned since the last commit (their slots go
        back to the free host blocks, their disk files, if written, are deleted with the next step's drops)
        and drop the copies not taken yet, and the pins."""
        drop = self._moves.drop
        for planned in (self._taken, self._planned):
            for key, slot in planned.host:
                if self.host.cached.get(key) == slot:  # else a later take() evicted it
                    self.host.forget(key)
            for key in planned.disk:
                self.disk.forget(key)
            drop += planned.disk
            self.counters.offloaded_blocks -= len(planned.host)
            self.counters.persisted_blocks -= len(planned.disk)
        self._moves = TierMoves(drop=drop)
        self._planned, self._taken = _Planned(), _Planned()
        self.host.pinned.clear()

    def usage(self) -> TierUsage:
        disk = self.disk
        return TierUsage(
            self.host.num_blocks,
            self.host.num_blocks - self.host.num_free,
            len(self.host.cached),
            disk.num_blocks if disk else 0,
            len(disk.keys) if disk else 0,
            len(self.reading),
            replace(self.counters),
            self.load_seconds[HOST],
            self.load_seconds[DISK],
            self.prefill_seconds_per_token,
        )

    # -- costs ---------------------------------------------------------------------------------

    def load_pays(self, tier: str) -> bool:
        """Whether loading a block from `tier` is faster than prefilling its tokens (True until measured)."""
        load, prefill = self.load_seconds[tier], self.prefill_seconds_per_token
        return load is None or prefill is None or load < prefill * self.block_size

    def observe_load(self, tier: str, seconds: float, num_blocks: int) -> None:
        self.load_seconds[tier] = _mean(self.load_seconds[tier], seconds / num_blocks)

    def observe_prefill(self, seconds: float, num_tokens: int) -> None:
        self.prefill_seconds_per_token = _mean(self.prefill_seconds_per_token, seconds / num_tokens)


def _mean(old: float | None, new: float) -> float:
    """An exponential moving average (the newest measurement weighs a quarter)."""
    return new if old is None else 0.75 * old + 0.25 * new
