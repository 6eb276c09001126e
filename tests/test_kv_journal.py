"""The step journal (kv/journal.py): a failed step leaves nothing it was to write findable.

Each test runs steps as the engine does: the scheduler's allocator calls, the tiers' moves taken, then
`commit()` when the step succeeds or `rollback()` and the failed sequences freed (in either order) when
it raises. After a rollback a fresh sequence with the failed prompt gets no hit on the failed step's
blocks, blocks cached by earlier committed steps are still hits, the event log never names a rolled-back
block, the host and disk tiers hold none of the step's keys, and once every sequence is freed every
device and host block is back in its pool (the random interleavings: tests/test_kv_properties.py).
"""

from __future__ import annotations

import pytest

from pagedllm.kv import ContiguousAllocator, PagedAllocator
from pagedllm.kv.block_pool import block_hash_chain
from pagedllm.kv.events import BlockRemoved, BlockStored
from pagedllm.kv.tiers import DiskTier, HostPool, PrefixTiers, TierMoves

BS = 4
BASE = list(range(100, 100 + 2 * BS))  # two full blocks a committed step caches
FAILED = BASE + list(range(200, 200 + 2 * BS)) + [7]  # BASE then two more full blocks, in the failed step


def make(num_blocks: int = 16, host: int = 8, disk: int | None = 32) -> PagedAllocator:
    tiers = PrefixTiers(HostPool(host), DiskTier(disk) if disk is not None else None, BS)
    kv = PagedAllocator(num_blocks, BS, enable_prefix_caching=True, tiers=tiers)
    kv.enable_events().drain()
    return kv


def step_ok(kv: PagedAllocator) -> None:
    kv.take_tier_moves()  # the engine takes the step's moves after scheduling it
    kv.commit()


def stored_keys(kv: PagedAllocator) -> list[bytes]:
    return [h for e in kv.events.drain() if isinstance(e, BlockStored) for h in e.block_hashes]


def hit(kv: PagedAllocator, prompt: list[int]) -> int:
    """The prefix-cache hit of a fresh sequence with `prompt` (admitted and freed again, then committed)."""
    cached = kv.allocate("probe", prompt, 1, read_prefix_cache=True)
    kv.free("probe")
    kv.rollback()  # the probe's own blocks must not make later probes hit
    return cached


def tier_keys(kv: PagedAllocator) -> set[bytes]:
    return set(kv.tiers.host.cached) | set(kv.tiers.disk.keys if kv.tiers.disk else ())


@pytest.mark.parametrize("free_first", [False, True])
def test_a_failed_prefill_is_no_hit_and_the_committed_blocks_before_it_still_are(free_first):
    kv = make()
    kv.allocate("base", BASE + [1], 4)
    step_ok(kv)
    base_keys = block_hash_chain(BASE, BS)
    assert stored_keys(kv) == base_keys and tier_keys(kv) == set(base_keys)
    kv.append("base", 2)  # the committed sequence grows in the failed step too
    kv.cache_blocks("base", kv.num_tokens("base") - 1)
    assert kv.allocate("failed", FAILED, 4) == 2 * BS  # shares BASE's blocks, caches two more
    kv.fork("failed", "child")
    new_keys = block_hash_chain(FAILED, BS)[2:]
    assert all((0, key) in kv.pool.cached for key in new_keys) and tier_keys(kv) >= set(new_keys)
    kv.tiers.take_moves()  # the forward raises after the step's moves were taken
    failed = ["failed", "child", "base"]
    if free_first:
        for seq_id in failed:
            kv.free(seq_id)
    kv.rollback()
    if not free_first:
        for seq_id in failed:
            kv.free(seq_id)
    assert all((0, key) not in kv.pool.cached for key in new_keys)
    assert tier_keys(kv) == set(base_keys)
    assert stored_keys(kv) == []  # neither the rollback nor a later commit reports the failed blocks
    kv.commit()
    assert stored_keys(kv) == []
    assert kv.all_free() and kv.num_free_host_blocks == kv.num_host_blocks
    assert kv.tiers.take_moves().drop == new_keys  # their disk files, if written, go with the next step
    assert hit(kv, FAILED) == 2 * BS  # BASE's blocks only
    assert hit(kv, BASE + [3]) == 2 * BS
    assert kv.all_free()


def test_the_rolled_back_blocks_return_as_plain_blocks_and_a_retry_caches_them_again():
    kv = make(num_blocks=8, disk=None)
    kv.allocate("a", FAILED, 4)
    kv.rollback()
    states = kv.block_states()
    assert not any(states.cached)  # held blocks stay held, unhashed
    assert [b.ref_cnt for b in kv.pool.blocks if b.block_id in kv.block_table("a")] == [1] * 5
    kv.free("a")
    assert not kv.pool.cached and all(b.block_hash is None for b in kv.pool.blocks) and kv.all_free()
    assert kv.allocate("retry", FAILED, 4) == 0  # computed again, cached again, reported at its commit
    step_ok(kv)
    assert stored_keys(kv) == block_hash_chain(FAILED, BS)
    kv.free("retry")
    assert hit(kv, FAILED) == 4 * BS


def test_a_committed_block_evicted_by_the_failed_step_loses_its_host_copy_but_keeps_its_disk_file():
    kv = make(num_blocks=4, host=4, disk=32)
    kv.allocate("base", BASE + [1], 4)
    kv.free("base")
    step_ok(kv)
    base_keys = block_hash_chain(BASE, BS)
    other = list(range(300, 300 + 3 * BS)) + [5]
    kv.allocate("other", other, 4)  # takes every block: BASE's two cached ones are evicted to the host
    assert set(kv.tiers.host.cached) == set(base_keys) and kv.tiers.host.pinned
    removed = [h for e in kv.events.drain() if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(base_keys)  # the device really lost them: that is reported at once
    kv.rollback()  # failed before its moves were taken: the offload copies were never made
    assert kv.tiers.take_moves().offload == [] and not kv.tiers.host.pinned
    assert set(kv.tiers.host.cached) == set() and kv.tiers.counters.offloaded_blocks == 0
    assert set(kv.tiers.disk.keys) == set(base_keys)  # written through by the committed step
    kv.free("other")
    kv.commit()
    assert kv.all_free() and kv.num_free_host_blocks == kv.num_host_blocks
    assert hit(kv, BASE + [1]) == 0  # off the device and the host; its disk copy comes by prefetch
    assert kv.plan_prefetch(BASE + [1]).reads


def test_moves_planned_after_the_taken_ones_wait_for_the_next_steps_commit():
    """An eviction in a step's postprocessing plans a copy the next step makes: the commit of the step
    that planned it does not make it lasting, the next step's rollback forgets it."""
    kv = make(num_blocks=4, host=4, disk=None)
    kv.allocate("base", BASE + [1], 4)
    kv.free("base")
    step_ok(kv)
    kv.tiers.take_moves()  # step 2's forward ran; its postprocessing then evicts BASE's blocks
    kv.allocate("late", list(range(300, 300 + 3 * BS)) + [5], 4)
    kv.commit()
    assert len(kv.tiers.host.cached) == 2
    kv.rollback()  # step 3 fails with the copies in its moves
    assert len(kv.tiers.host.cached) == 0
    kv.free("late")
    assert kv.all_free() and kv.num_free_host_blocks == kv.num_host_blocks


def test_a_block_cached_and_evicted_within_one_step_moves_down_no_tier_and_is_never_reported():
    kv = make(num_blocks=4, host=4, disk=32)
    kv.allocate("a", BASE + [1], 4)
    kv.free("a")  # preempted in the same step, before its forward
    kv.allocate("b", list(range(300, 300 + 3 * BS)) + [5], 4)  # evicts a's blocks
    a_keys = block_hash_chain(BASE, BS)
    moves = kv.tiers.take_moves()
    assert not set(kv.tiers.host.cached) & set(a_keys) and moves.offload == []
    assert {key for _, key in moves.persist}.isdisjoint(a_keys) and not set(kv.tiers.disk.keys) & set(a_keys)
    kv.commit()
    events = kv.events.drain()
    assert not any(set(e.block_hashes) & set(a_keys) for e in events if hasattr(e, "block_hashes"))
    assert stored_keys(kv) == [] and len([e for e in events if isinstance(e, BlockStored)]) == 3
    kv.free("b")
    assert kv.all_free()


def test_accepted_drafts_cached_in_a_failed_step_are_no_hit():
    kv = make(disk=None)
    prompt = BASE + [1, 2]
    kv.allocate("s", prompt, 8)
    step_ok(kv)
    kv.reserve_lookahead("s", 3)  # the verify pass writes three drafts; two are accepted
    kv.append("s", 3)
    kv.append("s", 4)
    kv.release_lookahead("s")
    step_ok(kv)
    kv.cache_blocks("s", kv.num_tokens("s"), start=kv.num_tokens("s") - 1)  # the next step keys block 2
    tokens = prompt + [3, 4]
    assert (0, block_hash_chain(tokens, BS)[2]) in kv.pool.cached
    kv.rollback()
    kv.free("s")
    assert hit(kv, tokens + [9]) == 2 * BS and stored_keys(kv) == block_hash_chain(BASE, BS)
    assert kv.all_free()


def test_a_swap_in_of_the_failed_step_leaves_the_host_pool_whole():
    kv = make(num_blocks=8, host=8, disk=None)
    kv.allocate("s", FAILED, 4)
    step_ok(kv)
    kv.swap_out("s")
    step_ok(kv)
    kv.append("s", 6)
    kv.swap_in("s")
    kv.cache_blocks("s", kv.num_tokens("s"))
    kv.rollback()
    kv.free("s")
    assert kv.all_free() and kv.num_free_host_blocks == kv.num_host_blocks
    assert hit(kv, FAILED) == 4 * BS  # computed before the failed step: still cached on the device


def test_window_groups_unhash_every_group_and_free_whole():
    kv = PagedAllocator(24, BS, enable_prefix_caching=True, windows=(None, BS + 1), prefill_chunk=2 * BS)
    kv.allocate("base", BASE + [1], 4, num_computed=2 * BS)
    kv.cache_blocks("base", len(BASE) + 1, start=2 * BS)
    kv.commit()
    kv.allocate("failed", FAILED, 4, num_computed=3 * BS)
    kv.cache_blocks("failed", len(FAILED), start=3 * BS)
    cached_before = {key for key in kv.pool.cached}
    kv.rollback()
    kv.free("failed")
    kv.free("base")
    new_keys = block_hash_chain(FAILED, BS)[2:]
    assert all((g, key) in cached_before for g in (0, 1) for key in new_keys)
    assert not any((g, key) in kv.pool.cached for g in (0, 1) for key in new_keys)
    assert kv.all_free()
    assert kv.allocate("again", FAILED, 4, num_computed=2 * BS) == 2 * BS  # BASE's blocks
    kv.free("again")


def test_the_contiguous_layout_commits_and_rolls_back_nothing():
    kv = ContiguousAllocator(64, 32)
    kv.allocate("a", FAILED, 4)
    kv.rollback()
    assert kv.num_tokens("a") == len(FAILED)
    kv.commit()
    assert kv.take_tier_moves() == TierMoves()
    kv.free("a")
    assert kv.all_free()
