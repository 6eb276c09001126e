"""Scenario tests of the paged KV allocator: block boundaries, copy-on-write, prefix caching, LRU, swap."""

import pytest
from kv_helpers import free_order, slots

from pagedllm.kv import KVUsage, NoFreeBlocks, PagedAllocator


def test_block_boundary_appends_take_a_block_only_when_the_last_is_full():
    kv = PagedAllocator(num_blocks=2, block_size=16)
    assert kv.allocate("s", list(range(15)), max_new_tokens=8) == 0
    assert len(kv.block_table("s")) == 1 and kv.num_free_blocks == 1
    assert kv.append("s", 15) == []  # token 15 fills block 0
    assert kv.num_tokens("s") == 16 and len(kv.block_table("s")) == 1
    assert kv.append("s", 16) == []  # token 16 opens block 1
    table = kv.block_table("s")
    assert len(table) == 2 and kv.num_free_blocks == 0
    assert slots(kv, "s")[15] == table[0] * 16 + 15 and slots(kv, "s", start=16) == [table[1] * 16]
    u = kv.usage()
    assert (u.live_slots, u.tail_slots, u.free_slots) == (17, 15, 0)


def test_append_without_a_free_block_raises_and_changes_nothing():
    kv = PagedAllocator(num_blocks=1, block_size=4)
    kv.allocate(0, [1, 2, 3, 4], 4)
    assert not kv.can_append(0)
    with pytest.raises(NoFreeBlocks, match="sequence 0"):
        kv.append(0, 5)
    assert kv.num_tokens(0) == 4 and kv.block_table(0) == [0] and kv.usage().live_slots == 4


def test_fork_shares_blocks_and_copies_only_on_the_first_divergent_append():
    kv = PagedAllocator(num_blocks=8, block_size=16)
    kv.allocate("p", list(range(18)), 8)
    free = kv.num_free_blocks
    assert kv.fork("p", "c") == []
    assert kv.block_table("c") == kv.block_table("p") and kv.num_free_blocks == free
    assert kv.usage().shared_saved_slots == 18
    last = kv.block_table("p")[1]
    copies = kv.append("c", 100)
    new = kv.block_table("c")[1]
    assert copies == [(last, new)] and new != last
    assert kv.block_table("c")[0] == kv.block_table("p")[0]  # the full block stays shared
    assert kv.append("c", 101) == []  # the child's block is its own now
    assert kv.append("p", 200) == []  # and the parent's last block is no longer shared
    assert kv.block_table("p")[1] == last
    u = kv.usage()
    assert u.live_slots == 16 + 3 + 4 and u.shared_saved_slots == 16  # block 0 is stored once


def test_fork_at_a_block_boundary_needs_no_copy():
    kv = PagedAllocator(num_blocks=8, block_size=4)
    kv.allocate("p", [1] * 8, 4)
    kv.fork("p", "c")
    assert kv.append("c", 2) == [] and kv.append("p", 3) == []
    assert kv.block_table("c")[:2] == kv.block_table("p")[:2]
    assert kv.block_table("c")[2] != kv.block_table("p")[2]


def test_copy_on_write_without_a_free_block_raises():
    kv = PagedAllocator(num_blocks=1, block_size=4)
    kv.allocate("p", [1, 2], 2)
    kv.fork("p", "c")
    assert not kv.can_append("c")
    with pytest.raises(NoFreeBlocks):
        kv.append("c", 3)
    kv.free("p")
    assert kv.can_append("c") and kv.append("c", 3) == []  # sole owner again: no copy


def test_prefix_cache_hit_counts():
    kv = PagedAllocator(num_blocks=16, block_size=16, enable_prefix_caching=True)
    prompt = list(range(40))
    assert kv.allocate("a", prompt, 8) == 0
    assert kv.allocate("b", prompt, 8) == 32
    assert kv.block_table("b")[:2] == kv.block_table("a")[:2]
    assert kv.block_table("b")[2] != kv.block_table("a")[2]  # the partial block is never shared
    assert kv.allocate("c", prompt[:32], 8) == 16  # never the whole prompt: its last token is computed
    assert kv.allocate("d", prompt[:20] + [999] + prompt[21:], 8) == 16  # diverges in block 1
    assert kv.allocate("f", prompt[:16], 8) == 0
    for seq_id in "abcdf":
        kv.free(seq_id)
    assert kv.all_free()  # cached blocks that nobody holds count as free
    assert kv.allocate("g", prompt, 8) == 32  # still findable after being freed


def test_a_block_filled_by_decode_becomes_cached_once_computed():
    """A sampled token's K/V is computed in the step after it is appended: its full block is findable
    only once cache_blocks says so."""
    kv = PagedAllocator(num_blocks=4, block_size=4, enable_prefix_caching=True)
    kv.allocate("a", [1, 2, 3], 4)
    kv.append("a", 4)
    assert kv.allocate("b", [1, 2, 3, 4, 9], 4, num_computed=0) == 0  # not computed yet either
    kv.cache_blocks("a", 4)
    assert kv.allocate("c", [1, 2, 3, 4, 9], 4) == 4
    assert kv.block_table("c")[0] == kv.block_table("a")[0]


def test_a_prompt_prefilled_in_chunks_is_findable_only_as_far_as_it_is_computed():
    """Chunked prefill: a block another prompt may reuse must already hold its K/V."""
    kv = PagedAllocator(num_blocks=16, block_size=4, enable_prefix_caching=True)
    prompt = list(range(20))
    kv.allocate("a", prompt, 4, num_computed=6)  # this step computes tokens 0-5: block 0 only
    assert kv.allocate("b", prompt, 4, num_computed=4) == 4  # b's own chunk starts at token 4 next step
    kv.cache_blocks("a", 14)  # the next chunk ends at token 14: blocks 1 and 2 are now computed
    assert kv.allocate("c", prompt, 4) == 12
    assert kv.block_table("c")[:3] == kv.block_table("a")[:3]
    kv.cache_blocks("a", 20)
    assert kv.allocate("d", prompt + [7], 4) == 20
    for seq_id in "abcd":
        kv.free(seq_id)
    assert kv.all_free()


def test_swapping_a_partly_computed_prompt_does_not_cache_its_uncomputed_blocks():
    kv = PagedAllocator(num_blocks=8, block_size=2, enable_prefix_caching=True)
    kv.allocate("s", [1, 2, 3, 4, 5, 6, 7], 2, num_computed=2)
    kv.swap_out("s")
    kv.swap_in("s")
    assert kv.allocate("t", [1, 2, 3, 4, 5, 6, 7], 2) == 2  # block 0 only: the rest was never computed
    kv.free("s")
    kv.free("t")
    assert kv.all_free()


def test_prefix_caching_off_reports_no_hits():
    kv = PagedAllocator(num_blocks=8, block_size=4)
    kv.allocate("a", list(range(9)), 4)
    assert kv.allocate("b", list(range(9)), 4) == 0
    assert set(kv.block_table("a")).isdisjoint(kv.block_table("b"))


def test_lru_eviction_evicts_tail_blocks_first_and_plain_blocks_before_cached_ones():
    kv = PagedAllocator(num_blocks=8, block_size=2, enable_prefix_caching=True)
    kv.allocate("a", [1, 2, 3, 4, 5], 4)  # a0 a1 full (cached), a2 partial (plain)
    kv.allocate("b", [7, 8, 9, 10], 4)  # b0 b1 full (cached)
    a0, a1, a2 = kv.block_table("a")
    b0, b1 = kv.block_table("b")
    kv.free("a")
    kv.free("b")
    # Plain blocks at the front; cached ones behind, least recently used first, a sequence's tail before
    # its head; the blocks after a's (5-7) are set aside as room for a run's growth.
    assert [b.block_id for b in kv.pool.free_queue] == [a2, a1, a0, b1, b0]
    assert [b.block_id for b in kv.pool.room_queue] == [5, 6, 7]
    kv.allocate("x", [0] * 9, 4)  # five blocks: the four plain ones, then evicts a1 (in address order)
    assert kv.block_table("x") == sorted([a2, 5, 6, 7, a1])
    assert kv.allocate("a'", [1, 2, 3, 4, 5], 4) == 2  # only a's head block survived
    assert kv.block_table("a'") == [a0, *sorted([b1, b0])]  # then b is evicted (the new blocks ascending)


def test_reusing_a_cached_block_makes_it_most_recently_used():
    kv = PagedAllocator(num_blocks=3, block_size=2, enable_prefix_caching=True)
    kv.allocate("a", [1, 2], 2)
    kv.allocate("b", [3, 4], 2)
    (a0,), (b0,) = kv.block_table("a"), kv.block_table("b")
    kv.free("a")
    kv.free("b")
    kv.allocate("a'", [1, 2, 0], 2)  # touches a0, takes the plain block
    kv.free("a'")
    assert [b.block_id for b in kv.pool.free_queue][-2:] == [b0, a0]


def test_allocate_that_does_not_fit_raises_and_changes_nothing():
    kv = PagedAllocator(num_blocks=3, block_size=4, enable_prefix_caching=True)
    kv.allocate("a", list(range(9)), 4)
    kv.free("a")  # three cached-or-free blocks
    kv.allocate("b", [5] * 5, 4)  # takes two blocks, evicting cached ones
    before = (kv.usage(), free_order(kv.pool), dict(kv.pool.cached))
    assert not kv.can_allocate(list(range(12)), 4)
    with pytest.raises(NoFreeBlocks, match="'c'"):
        kv.allocate("c", list(range(12)), 4)
    assert (kv.usage(), free_order(kv.pool), dict(kv.pool.cached)) == before
    assert "c" not in kv


def test_swap_round_trip_restores_every_token():
    kv = PagedAllocator(num_blocks=6, block_size=4, num_host_blocks=3)
    device: dict[int, int] = {}
    host: dict[int, int] = {}
    tokens = list(range(100, 110))
    kv.allocate("s", tokens, 8)
    for t, slot in enumerate(slots(kv, "s")):
        device[slot] = tokens[t]
    out = kv.swap_out("s")
    assert [d for d, _ in out] == [0, 1, 2] and len({h for _, h in out}) == 3
    assert kv.num_free_blocks == 6 and kv.num_free_host_blocks == 0
    for d, h in out:
        for o in range(4):
            host[h * 4 + o] = device.pop(d * 4 + o, None)
    with pytest.raises(ValueError, match="swapped out"):
        kv.fork("s", "child")
    kv.allocate("other", [0] * 8, 4)  # takes blocks 0 and 1: the sequence must come back elsewhere
    assert kv.can_swap_in("s")
    back = kv.swap_in("s")
    assert sorted(h for h, _ in back) == sorted(h for _, h in out)
    for h, d in back:
        for o in range(4):
            device[d * 4 + o] = host[h * 4 + o]
    assert [device[slot] for slot in slots(kv, "s")] == tokens
    assert kv.num_free_host_blocks == 3 and kv.num_tokens("s") == 10
    kv.free("s")
    kv.free("other")
    assert kv.all_free()


def test_swap_in_reuses_blocks_still_cached_on_the_device():
    kv = PagedAllocator(num_blocks=4, block_size=2, enable_prefix_caching=True)
    kv.allocate("s", [1, 2, 3, 4, 5], 2)
    table = kv.block_table("s")
    kv.swap_out("s")
    back = kv.swap_in("s")
    assert [d for _, d in back] == [kv.block_table("s")[2]]  # only the partial block is copied
    assert kv.block_table("s")[:2] == table[:2]


def test_swap_out_without_host_room_raises():
    kv = PagedAllocator(num_blocks=4, block_size=2, num_host_blocks=1)
    kv.allocate("s", [1, 2, 3], 2)
    with pytest.raises(NoFreeBlocks, match="host"):
        kv.swap_out("s")
    assert kv.num_tokens("s") == 3 and kv.num_free_host_blocks == 1 and len(kv.block_table("s")) == 2


def test_swap_in_without_device_room_raises():
    kv = PagedAllocator(num_blocks=2, block_size=2)
    kv.allocate("s", [1, 2, 3], 2)
    kv.swap_out("s")
    kv.allocate("t", [1, 2, 3, 4], 2)
    assert not kv.can_swap_in("s")
    with pytest.raises(NoFreeBlocks):
        kv.swap_in("s")
    kv.free("s")  # a swapped sequence can be freed directly: its host blocks come back
    kv.free("t")
    assert kv.all_free()


def test_bad_ids_and_arguments_raise_clear_errors():
    kv = PagedAllocator(num_blocks=4, block_size=2)
    kv.allocate("a", [1], 2)
    with pytest.raises(ValueError, match="'a' is already allocated"):
        kv.allocate("a", [1], 2)
    with pytest.raises(ValueError, match="'a' is already allocated"):
        kv.fork("a", "a")
    with pytest.raises(KeyError, match="'nope'"):
        kv.append("nope", 1)
    kv.free("a")
    with pytest.raises(KeyError, match="'a'"):
        kv.free("a")
    with pytest.raises(KeyError, match="'a'"):
        kv.append("a", 1)
    kv.allocate("b", [1], 2)
    with pytest.raises(ValueError, match="'b' is not swapped out"):
        kv.swap_in("b")
    with pytest.raises(ValueError, match="empty prompt"):
        kv.allocate("c", [], 2)
    with pytest.raises(ValueError, match="-1"):
        kv.can_allocate([1], -1)
    with pytest.raises(ValueError, match="block_size"):
        PagedAllocator(4, block_size=0)
    with pytest.raises(ValueError, match="num_blocks"):
        PagedAllocator(-3)


def test_usage_reports_each_kind_of_slot():
    kv = PagedAllocator(num_blocks=4, block_size=4)
    kv.allocate("a", [1] * 5, 4)
    kv.fork("a", "b")
    u = kv.usage()
    assert u == KVUsage(
        total_slots=16,
        live_slots=5,
        reserved_slots=0,
        tail_slots=3,
        free_slots=8,
        largest_free_run=8,
        external_frag_slots=0,
        shared_saved_slots=5,
    )
    assert u.live_fraction == 5 / 16


def test_growing_sequences_each_keep_one_run_of_blocks():
    """Blocks after a sequence's newest are set aside for it, so interleaved growth still gives each
    sequence consecutive block ids (one run of memory for the attention kernel to read)."""
    kv = PagedAllocator(num_blocks=64, block_size=16)
    kv.allocate("a", list(range(20)), 100)
    kv.allocate("b", list(range(20)), 100)
    for t in range(100):
        for seq_id in ("a", "b"):
            kv.append(seq_id, t)
    for seq_id in ("a", "b"):
        table = kv.block_table(seq_id)
        assert len(table) == 8 and table == list(range(table[0], table[0] + 8))
    kv.free("a")
    kv.free("b")
    assert kv.all_free()


def test_room_set_aside_is_still_handed_out_when_nothing_else_is_free():
    kv = PagedAllocator(num_blocks=8, block_size=16)
    kv.allocate("a", [1] * 16, 4)  # block 0; blocks 1-7 set aside as its room
    assert kv.num_free_blocks == 7 and len(kv.pool.room_queue) == 7
    kv.allocate("b", [2] * 100, 4)  # seven blocks: all the room
    assert kv.num_free_blocks == 0 and not kv.can_append("a")
    kv.free("a")
    kv.free("b")
    assert kv.all_free()


@pytest.mark.parametrize("b_freed_early", [True, False])
def test_a_run_grows_over_a_cached_block_only_if_it_is_cold(b_freed_early):
    """Extending a run may evict the cached block after it (out of least-recently-used order) only when a
    cached block is evicted anyway and that one sits in the older half of the free queue; recently used
    content stays findable."""
    kv = PagedAllocator(num_blocks=6, block_size=4, enable_prefix_caching=True)
    for seq_id, token in zip("abcdef", range(6), strict=True):
        kv.allocate(seq_id, [token] * 4, 4)
    assert [kv.block_table(s) for s in "abcdef"] == [[i] for i in range(6)]
    for seq_id in "cbdef" if b_freed_early else "cdebf":  # b's block 1: second or fourth of five
        kv.free(seq_id)
    kv.append("a", 9)  # a's block 0 is full: its follower is b's cached block 1; c's block 2 is oldest
    assert kv.block_table("a") == ([0, 1] if b_freed_early else [0, 2])
    assert kv.allocate("b", [1] * 4 + [5], 4) == (0 if b_freed_early else 4)  # b's block still cached?
    kv.free("a")
    kv.free("b")
    assert kv.all_free()


def test_swap_in_shares_no_block_whose_kv_it_has_not_computed():
    """A block its newest token filled is keyed but not computed: back from the host it stays its own,
    even when another sequence has computed and cached the same tokens meanwhile."""
    kv = PagedAllocator(num_blocks=8, block_size=2, enable_prefix_caching=True)
    kv.allocate("s", [1], 2)
    kv.append("s", 2)  # fills block 0
    kv.swap_out("s")
    kv.allocate("t", [1, 2, 3], 2)  # computes and caches the same block 0
    back = kv.swap_in("s")
    assert len(back) == 1 and kv.block_table("s")[0] != kv.block_table("t")[0]
    kv.free("s")
    kv.free("t")
    assert kv.all_free()


def test_a_swapped_out_sequence_may_grow_and_gets_the_new_blocks_when_it_is_back():
    """A token chosen while its sequence is swapped out takes no memory then: swap_in gives it its slot
    (its K/V is computed once the sequence is back), in a new block where the last is full (no copy)."""
    kv = PagedAllocator(num_blocks=4, block_size=2, num_host_blocks=3)
    kv.allocate("s", [1, 2, 3], 2)
    host = [h for _, h in kv.swap_out("s")]
    for token in (4, 5):
        assert kv.can_append("s") and kv.append("s", token) == []
    assert kv.num_tokens("s") == 5 and kv.num_free_host_blocks == 1 and kv.num_free_blocks == 4
    back = kv.swap_in("s")
    table = kv.block_table("s")
    assert back == [(host[0], table[0]), (host[1], table[1])] and len(table) == 3
    assert kv.usage().live_slots == 5 and kv.num_free_host_blocks == 3
    kv.free("s")
    assert kv.all_free()


def test_can_allocate_then_allocate_hash_the_prompt_once(monkeypatch):
    """The scheduler asks can_allocate, then allocate, of one prompt: its block hashes are computed once."""
    from pagedllm.kv import block_pool, paged

    calls = []
    for module in (paged, block_pool):  # a prompt's chain (block_pool) and a decode's next block (paged)
        monkeypatch.setattr(
            module, "hash_block", lambda parent, tokens, lora=None: calls.append(0) or bytes([len(calls)])
        )
    kv = PagedAllocator(num_blocks=8, block_size=4, enable_prefix_caching=True)
    prompt = list(range(10))  # two full blocks
    assert kv.can_allocate(prompt, 4) and kv.allocate("a", prompt, 4) == 0
    assert len(calls) == 2
    kv.append("a", 10)
    kv.append("a", 11)  # fills block 2: one more hash, on a's own list (not the kept prompt's)
    assert len(calls) == 3 and kv.allocate("b", prompt, 4) == 8 and len(calls) == 3
    kv.free("a")
    kv.free("b")
    assert kv.all_free()


def test_lookahead_slots_cross_into_a_block_that_the_rejection_gives_back():
    """Speculative decoding: 4 draft slots past the 5 tokens of blocks of 4 take block 1's last three slots
    and a new block; accepting one draft and releasing the rest returns that block (ahead of cached ones)."""
    kv = PagedAllocator(num_blocks=4, block_size=4, enable_prefix_caching=True)
    kv.allocate("s", [1, 2, 3, 4, 5], 8)
    assert kv.can_reserve_lookahead("s", 4) and kv.reserve_lookahead("s", 4) == []
    assert len(kv.block_table("s")) == 3 and kv.num_free_blocks == 1 and kv.num_tokens("s") == 5
    assert kv.usage().live_slots == 5  # reserved slots hold no accepted token
    assert not kv.can_reserve_lookahead("s", 8)
    table = kv.block_table("s")
    assert kv.append("s", 6) == []  # an accepted draft takes its reserved slot
    kv.release_lookahead("s")
    assert kv.block_table("s") == table[:2] and kv.num_free_blocks == 2
    assert free_order(kv.pool)[0] == table[2]  # an emptied block is plain: reused before cached ones
    assert kv.append("s", 7) == [] and kv.append("s", 8) == []  # the correction token, then a decode
    kv.cache_blocks("s", 8)
    assert kv.allocate("t", [1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == 8  # keyed by the accepted tokens


def test_a_rejected_draft_never_keys_a_block():
    kv = PagedAllocator(num_blocks=4, block_size=2, enable_prefix_caching=True)
    kv.allocate("s", [1], 8)
    kv.reserve_lookahead("s", 3)
    kv.cache_blocks("s", 4)  # even told its slots are computed, nothing past the accepted tokens is keyed
    kv.release_lookahead("s")
    assert kv.pool.cached == {} and kv.num_free_blocks == 3
    kv.append("s", 7)
    kv.cache_blocks("s", 2)
    assert kv.allocate("t", [1, 7, 0], 4) == 2 and kv.allocate("u", [1, 2, 0], 4) == 0


def test_lookahead_in_a_shared_last_block_copies_it_first():
    kv = PagedAllocator(num_blocks=4, block_size=4)
    kv.allocate("p", [1, 2, 3], 4)
    kv.fork("p", "c")
    shared = kv.block_table("p")[0]
    assert not kv.can_reserve_lookahead("p", 10)  # a copy and three new blocks: four, three free
    copies = kv.reserve_lookahead("p", 2)
    assert copies == [(shared, kv.block_table("p")[0])] and kv.block_table("c") == [shared]
    assert kv.usage().live_slots == 6
    with pytest.raises(ValueError, match="lookahead"):
        kv.fork("p", "d")
    with pytest.raises(ValueError, match="lookahead"):
        kv.swap_out("p")
    kv.release_lookahead("p")
    assert kv.fork("p", "d") == []
