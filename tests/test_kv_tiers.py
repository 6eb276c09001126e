"""The prefix cache tiers' bookkeeping (kv/tiers.py) under the paged allocator: what moves down, what
loads back, the bounds and LRU order, the host pool shared with swap, the disk tier's prefetch."""

from __future__ import annotations

import pytest

from pagedllm.kv import PagedAllocator
from pagedllm.kv.tiers import DISK, HOST, DiskTier, HostPool, Prefetch, PrefixTiers

BS = 2


def make(num_blocks: int, host: int, disk: int | None = None) -> tuple[PagedAllocator, PrefixTiers]:
    tiers = PrefixTiers(HostPool(host), DiskTier(disk) if disk is not None else None, BS)
    return PagedAllocator(num_blocks, BS, enable_prefix_caching=True, tiers=tiers), tiers


def run(alloc: PagedAllocator, seq_id: str, prompt: list[int]) -> int:
    """A step that admits a prompt, computes it whole and frees it (its full blocks stay cached: the step
    commits); returns its hit."""
    hit = alloc.allocate(seq_id, prompt, 1)
    alloc.free(seq_id)
    alloc.commit()
    return hit


def test_evicted_blocks_move_to_host_and_load_back_as_a_hit():
    alloc, tiers = make(num_blocks=4, host=3)
    a = list(range(1, 8))  # 7 tokens: 3 full blocks cached, the 4th partial
    assert run(alloc, "a", a) == 0
    assert tiers.take_moves().offload == []  # nothing evicted yet
    run(alloc, "b", list(range(10, 18)))  # 4 new blocks: a's 3 cached ones are evicted, copied down
    offload = tiers.take_moves().offload
    assert len(offload) == 3 and len({slot for _, slot in offload}) == 3
    assert len(tiers.host.cached) == 3
    hit = alloc.allocate("c", a, 1)  # a again: the device lost it, the host tier has it
    assert hit == 3 * BS
    moves = tiers.take_moves()
    assert sorted(slot for slot, _ in moves.load) == sorted(slot for _, slot in offload)
    assert {block for _, block in moves.load} <= set(alloc.block_table("c")[:3])
    # b's blocks evicted for c found the host pool full of blocks this step reads: they were dropped.
    assert len(tiers.host.cached) == 3 and moves.offload == []
    assert tiers.counters.host_hit_blocks == 3
    alloc.free("c")
    assert alloc.all_free()


def test_one_copy_per_hash_and_the_host_tier_is_bounded_lru():
    tiers = PrefixTiers(HostPool(2), block_size=BS)
    tiers.evicted(b"k1", 0)
    tiers.evicted(b"k2", 1)
    tiers.evicted(b"k1", 5)  # evicted again from another device block: touched, not copied twice
    assert tiers.take_moves().offload == [(0, 0), (1, 1)]  # (device block, host slot), lowest slot first
    tiers.evicted(b"k3", 2)  # full: the least recently used (k2, since k1 was touched) goes
    assert list(tiers.host.cached) == [b"k1", b"k3"]
    assert tiers.take_moves().offload == [(2, 1)]
    assert tiers.counters.offloaded_blocks == 3
    # Many prompts through a small device cache: the tier never outgrows its pool, a slot holds one key.
    alloc, tiers = make(num_blocks=3, host=2)
    for t in range(0, 60, 3):
        run(alloc, f"s{t}", [t, t + 1, t + 2, t + 1])
        tiers.take_moves()
        assert len(tiers.host.cached) <= 2
        assert len(set(tiers.host.cached.values())) == len(tiers.host.cached)
    assert tiers.counters.offloaded_blocks > 2
    assert alloc.all_free()


def test_lru_across_tiers_device_then_host_then_disk_each_within_its_size():
    # A prompt of 5 tokens caches 2 full blocks and takes 3: the device holds one prompt, the host 2, the
    # disk 4 (written through as each is computed).
    alloc, tiers = make(num_blocks=3, host=4, disk=8)
    prompts = [[10 * i + j for j in range(1, 6)] for i in range(6)]
    keys = []
    for i, prompt in enumerate(prompts):
        run(alloc, f"p{i}", prompt)
        keys.append([key for _, key in tiers.take_moves().persist])
        usage = tiers.usage()
        assert usage.host_cached_blocks <= usage.host_blocks == 4 and usage.host_used_blocks <= 4
        assert usage.disk_cached_blocks <= usage.disk_blocks == 8
    assert all(len(k) == 2 for k in keys)
    where = [
        [key in tiers.host.cached for key in k] + [key in tiers.disk for key in k] for k in keys
    ]  # per prompt: its 2 blocks in host memory, then on disk
    assert where[5] == [False, False, True, True]  # the newest: on the device (and on disk)
    assert where[4] == where[3] == [True] * 4  # the two evicted last: in host memory and on disk
    assert where[2] == [False, False, True, True]  # older: dropped by the host, still on disk
    assert where[1] == where[0] == [False] * 4  # the oldest: gone from every tier
    assert alloc.allocate("again", prompts[5], 1) == 2 * BS and tiers.take_moves().load == []  # device hit
    alloc.free("again")
    assert alloc.allocate("again", prompts[4], 1) == 2 * BS and len(tiers.take_moves().load) == 2  # host
    alloc.free("again")
    plan = alloc.plan_prefetch(prompts[2])  # on disk only: read into host blocks before it is admitted
    assert [key for key, _ in plan.reads] == keys[2]
    tiers.prefetched(plan.reads, [True, True])
    assert alloc.plan_prefetch(prompts[0]) == Prefetch()  # nowhere: recomputed
    tiers.take_moves()
    assert alloc.all_free()


def test_swap_out_takes_host_blocks_from_the_tier_evicting_cached_ones():
    alloc, tiers = make(num_blocks=4, host=3)
    run(alloc, "a", list(range(1, 8)))
    run(alloc, "b", list(range(10, 18)))
    tiers.take_moves()
    assert len(tiers.host.cached) == 3 and alloc.num_free_host_blocks == 3
    alloc.allocate("s", [50, 51, 52], 4)  # its blocks evict b's: copied down to host blocks this step
    assert alloc.num_free_host_blocks < 3  # (blocks this step writes are not taken before it is done)
    tiers.take_moves()
    copies = alloc.swap_out("s")  # 2 blocks: two cached host blocks make room
    assert len(copies) == 2 and len(tiers.host.cached) == 1
    assert alloc.num_free_host_blocks == 1
    alloc.swap_in("s")
    alloc.free("s")
    assert alloc.all_free()


def test_a_load_that_does_not_pay_is_recomputed():
    alloc, tiers = make(num_blocks=4, host=3)
    run(alloc, "a", list(range(1, 8)))
    run(alloc, "b", list(range(10, 18)))
    tiers.take_moves()
    tiers.observe_prefill(seconds=1.0, num_tokens=1000)  # 1 ms a token: 2 ms a block of 2
    tiers.observe_load(HOST, seconds=0.5, num_blocks=10)  # 50 ms a block: slower than recompute
    assert not tiers.load_pays(HOST)
    assert alloc.allocate("c", list(range(1, 8)), 1) == 0
    assert tiers.take_moves().load == []
    alloc.free("c")
    tiers.observe_load(HOST, seconds=0.0, num_blocks=1)  # the average comes down below 2 ms
    for _ in range(20):
        tiers.observe_load(HOST, seconds=0.0, num_blocks=1)
    assert tiers.load_pays(HOST)


def test_disk_tier_writes_through_is_bounded_and_prefetch_reports_bad_files():
    alloc, tiers = make(num_blocks=8, host=4, disk=3)
    run(alloc, "a", list(range(1, 10)))  # 4 full blocks cached: written through, the disk holds 3
    moves = tiers.take_moves()
    assert len(moves.persist) == 4 and len(moves.drop) == 1
    assert len(tiers.disk.keys) == 3 and moves.drop[0] not in tiers.disk
    assert alloc.plan_prefetch(list(range(1, 10))) == Prefetch()  # the device still has them all
    # A fresh allocator on the same files (a restart): the disk tier knows the keys, nothing else does.
    alloc2, tiers2 = make(num_blocks=8, host=4, disk=4)
    keys = [key for _, key in moves.persist]
    for key in keys[1:]:
        tiers2.disk.add(key)
    assert (
        alloc2.plan_prefetch(list(range(1, 10))) == Prefetch()
    )  # its first block is gone: no prefix on disk
    tiers2.disk.add(keys[0])
    plan = alloc2.plan_prefetch(list(range(1, 10)))
    assert [key for key, _ in plan.reads] == keys and plan.pending  # the 4 blocks before the last token
    # While they are read: the same prompt, or another sharing its prefix, waits and reads nothing twice.
    again = alloc2.plan_prefetch(list(range(1, 10)))
    assert again.reads == [] and again.pending and tiers2.usage().reading_blocks == len(keys)
    tiers2.prefetched(plan.reads, [True, False] + [True] * (len(plan.reads) - 2))  # the second file failed
    assert tiers2.reading == {}
    assert keys[1] not in tiers2.disk and tiers2.counters.disk_corrupt_blocks == 1
    assert alloc2.allocate("r", list(range(1, 10)), 1) == BS  # the hit stops before the bad block
    alloc2.free("r")
    tiers2.take_moves()
    assert alloc2.all_free()


def test_tiers_need_one_full_attention_group_with_prefix_caching():
    with pytest.raises(ValueError, match="prefix cache tiers"):
        PagedAllocator(8, BS, enable_prefix_caching=False, tiers=PrefixTiers(HostPool(2)))
    with pytest.raises(ValueError, match="prefix cache tiers"):
        PagedAllocator(8, BS, enable_prefix_caching=True, windows=(None, 4), tiers=PrefixTiers(HostPool(2)))
    assert DISK != HOST
