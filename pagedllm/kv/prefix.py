"""What a prompt finds in the prefix cache: the longest run of its full blocks every KV group can serve,
and the blocks after it in the host and disk tiers (kv/tiers.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedllm.kv.block_pool import Block, BlockPool, block_hash_chain
from pagedllm.kv.managers import GroupManager
from pagedllm.kv.tiers import HostPool, Prefetch, PrefixTiers


@dataclass
class Admission:
    """What admitting a prompt takes: its blocks' hashes, per group the cached blocks to reuse (None before
    a window group's window), the blocks to take now and promise (window groups' prefill), and the host
    slots of the blocks after the hit to load from the host tier (new blocks, counted in num_new)."""

    hashes: list[bytes]
    hits: list[list[Block | None]]
    num_new: int
    loads: list[int]


class PrefixLookup:
    """Looks prompts up in the device prefix cache (through every group's manager) and its tiers."""

    def __init__(
        self,
        pool: BlockPool,
        managers: list[GroupManager],
        enabled: bool,
        tiers: PrefixTiers | None,
        host: HostPool,
    ):
        self.pool, self.managers, self.enabled, self.tiers, self.host = pool, managers, enabled, tiers, host
        self.block_size = managers[0].block_size
        # the last prompt (with its LoRA adapter) and its block hashes
        self._hashed: tuple[tuple, list[bytes]] = ((), [])

    def plan(
        self, prompt: Sequence[int], read_cache: bool = True, lora_int_id: int | None = None
    ) -> Admission:
        bs, n = self.block_size, len(prompt)
        hashes: list[bytes] = []
        num_hit, loads = 0, []
        if self.enabled:
            hashes = self.hashes(prompt, lora_int_id)
            readable = hashes[: (n - 1) // bs if read_cache else 0]
            num_hit = self.num_hit_blocks(readable)
            if self.tiers is not None:
                loads = self.tiers.host_run(readable[num_hit:])
        hits = [m.hits(self.pool, hashes, num_hit) for m in self.managers]
        num_new = sum(m.new_blocks(group, n, num_hit) for m, group in zip(self.managers, hits, strict=True))
        return Admission(hashes, hits, num_new, loads)

    def prefetch(self, prompt: Sequence[int], lora_int_id: int | None = None) -> Prefetch:
        """With a disk tier: the prompt's blocks after its device and host hits that are on disk, each
        with a host slot to read it into before the prompt is admitted (then `tiers.prefetched`), and
        whether the prompt waits for reads in flight."""
        if self.tiers is None or self.tiers.disk is None:
            return Prefetch()
        hashes = self.hashes(prompt, lora_int_id)[: (len(prompt) - 1) // self.block_size]
        i = self.num_hit_blocks(hashes)
        while i < len(hashes) and hashes[i] in self.host.cached:
            self.host.touch(hashes[i])  # most recently used: the prefetch must not evict it
            i += 1
        return self.tiers.plan_prefetch(hashes[i:])

    def num_hit_blocks(self, hashes: list[bytes]) -> int:
        """The longest prefix of blocks every group can serve (a full group all of them, a window group the
        last window's), found as vLLM's hybrid coordinator finds it: each group shrinks the hit in turn
        until none does (the largest hit every group agrees to, whatever the order)."""
        num_hit = len(hashes)
        while True:
            agreed = num_hit
            for m in self.managers:
                agreed = m.longest_hit(self.pool, hashes, agreed)
            if agreed == num_hit:
                return num_hit
            num_hit = agreed

    def hashes(self, prompt: Sequence[int], lora_int_id: int | None = None) -> list[bytes]:
        """The hash chain of the prompt's full blocks under its LoRA adapter (a new list). The last
        prompt's is kept: a scheduler asks can_allocate and then allocate of the same prompt, and a
        waiting one again each step."""
        key = (lora_int_id, tuple(prompt))
        if self._hashed[0] != key:
            self._hashed = (key, block_hash_chain(prompt, self.block_size, lora_int_id))
        return list(self._hashed[1])
