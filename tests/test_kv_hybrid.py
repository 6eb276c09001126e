"""KV groups: a full-attention group and sliding-window groups over one block pool (kv/groups.py).

The property machine drives a PagedAllocator with one full and two window groups as the scheduler does:
a prompt is admitted, computed chunk by chunk (`cache_blocks` with the chunk's start), and grows by one
token once every token is computed. It writes each token into every slot it is given and checks after
every step that each group reads back exactly the tokens a query of the sequence may still read, that no
block is both free and in a table, that a window group holds nothing before its window, and that
nothing leaks once every sequence is freed.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import invariant, precondition, rule
from kv_helpers import free_order, group_slots
from test_kv_properties import PagedMachine, prompts

from pagedllm.kv import NO_BLOCK, NoFreeBlocks, PagedAllocator, kv_groups

WINDOW, BS, CHUNK = 3, 2, 3  # tokens


class HybridMachine(PagedMachine):
    """Groups: full, window 3, window 3 (block size 2, prompts computed 3 tokens a step at most); swap_in
    is PagedMachine's."""

    def make_allocator(self):
        self.computed: dict[int, int] = {}  # sequence -> its tokens computed (the next step's start)
        self.started: dict[int, int] = {}  # sequence -> the start of its last step the allocator was told
        return PagedAllocator(
            24,
            block_size=BS,
            enable_prefix_caching=True,
            num_host_blocks=16,
            windows=(None, WINDOW, WINDOW),
            prefill_chunk=CHUNK,
        )

    def write(self, seq_id: int, start: int) -> None:
        for g in range(self.kv.num_groups):
            for t, slot in group_slots(self.kv, seq_id, g, start):
                if slot is not None:
                    self.device[slot] = (t, self.tokens[seq_id][t])

    def computable(self) -> list[int]:
        return [s for s in self.resident() if self.computed[s] < len(self.tokens[s])]

    def grown(self) -> list[int]:
        return [s for s in self.tokens if self.computed[s] == len(self.tokens[s])]

    def speculable(self) -> list[int]:
        return self.growable()

    def tables(self, seq_id: int) -> list[list[int]]:
        return self.kv.block_tables(seq_id)

    def growable(self) -> list[int]:
        """Resident, prefilled, no lookahead slots held: what the engine appends to, forks or speculates."""
        return [s for s in self.grown() if s not in self.swapped and s not in self.drafts]

    @rule(prompt=prompts, whole=st.booleans())
    def allocate(self, prompt, whole):
        """Admitted as the scheduler admits (nothing computed yet), or computed whole if that fits a step."""
        whole = whole and len(prompt) <= CHUNK
        can, seq_id, before = self.kv.can_allocate(prompt, 4), self.next_id, self.snapshot()
        num_computed = None if whole else 0
        cached = self.refused(
            can, before, lambda: self.kv.allocate(seq_id, prompt, 4, num_computed=num_computed)
        )
        if cached is None:
            return
        self.next_id += 1
        assert 0 <= cached < len(prompt) and cached % BS == 0
        self.tokens[seq_id] = list(prompt)
        self.computed[seq_id] = len(prompt) if whole else cached
        self.started[seq_id] = cached
        self.write(seq_id, cached)

    @precondition(lambda self: self.computable())
    @rule(data=st.data())
    def cache_blocks(self, data):
        """One step of a sequence: a prompt chunk, or the token it grew by. A chunk within prefill_room never
        fails; a longer one may find no free block (NoFreeBlocks, having only given back what left the
        window of its start), as vLLM v1's admission by the first chunk allows."""
        seq_id = data.draw(st.sampled_from(self.computable()))
        start = self.computed[seq_id]
        left = len(self.tokens[seq_id]) - start
        end = data.draw(st.integers(start + 1, start + min(left, CHUNK)))
        fits = end - start <= self.kv.prefill_room(seq_id, start, left)
        try:
            self.kv.cache_blocks(seq_id, end, start=start)
        except NoFreeBlocks:
            assert not fits
            self.started[seq_id] = start
            return
        self.computed[seq_id], self.started[seq_id] = end, start
        self.write(seq_id, start)

    @precondition(lambda self: self.computable())
    @rule(data=st.data(), keep_free=st.integers(0, 6))
    def cache_blocks_by_room(self, data, keep_free):
        """A prompt chunk as long as prefill_room allows (the scheduler's way): never fails. With every group
        taking a prompt's blocks chunk by chunk, the room may be none (the scheduler then waits or
        preempts), but never while each group has a free block to take beyond keep_free."""
        seq_id = data.draw(st.sampled_from(self.computable()))
        start = self.computed[seq_id]
        left = len(self.tokens[seq_id]) - start
        room = self.kv.prefill_room(seq_id, start, left, keep_free=keep_free)
        assert 0 <= room <= left
        assert room > 0 or self.kv.num_free_blocks - keep_free < self.kv.num_groups
        if room == 0:
            return
        end = data.draw(st.integers(start + 1, start + room))
        self.kv.cache_blocks(seq_id, end, start=start)
        self.computed[seq_id], self.started[seq_id] = end, start
        self.write(seq_id, start)

    @precondition(lambda self: self.growable())
    @rule(data=st.data(), token=st.integers(0, 1))
    def append(self, data, token):
        seq_id = data.draw(st.sampled_from(self.growable()))
        can = self.kv.can_append(seq_id)
        copies = self.refused(can, self.snapshot(), self.kv.append, seq_id, token)
        if copies is None:
            return
        self.copy_blocks(copies, self.device, self.device)
        self.tokens[seq_id].append(token)
        self.write(seq_id, len(self.tokens[seq_id]) - 1)

    @precondition(lambda self: self.growable())
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.growable()))
        free_before = self.kv.num_free_blocks
        assert self.kv.fork(parent, self.next_id) == [] and self.kv.num_free_blocks == free_before
        self.tokens[self.next_id] = list(self.tokens[parent])
        self.computed[self.next_id] = self.computed[parent]
        self.started[self.next_id] = self.started[parent]
        self.next_id += 1

    @precondition(lambda self: self.settled())
    @rule(data=st.data())
    def swap_out(self, data):
        seq_id = data.draw(st.sampled_from(self.settled()))  # mid-prefill ones too
        held = sum(b != NO_BLOCK for table in self.kv.block_tables(seq_id) for b in table)
        copies = self.refused(held <= self.kv.num_free_host_blocks, self.snapshot(), self.kv.swap_out, seq_id)
        if copies is None:
            return
        assert len(copies) == held
        self.copy_blocks(copies, self.device, self.host)
        self.swapped.add(seq_id)
        self.host_blocks[seq_id] = held

    @precondition(lambda self: [s for s in self.grown() if s in self.swapped])
    @rule(data=st.data(), token=st.integers(0, 1))
    def append_swapped(self, data, token):
        seq_id = data.draw(st.sampled_from([s for s in self.grown() if s in self.swapped]))
        before = self.snapshot()
        assert self.kv.can_append(seq_id) and self.kv.append(seq_id, token) == []
        assert self.snapshot() == before
        self.unwritten.setdefault(seq_id, len(self.tokens[seq_id]))
        self.tokens[seq_id].append(token)

    def drop(self, seq_id: int) -> None:
        super().drop(seq_id)
        del self.computed[seq_id], self.started[seq_id]

    # -- invariants --------------------------------------------------------------------------------

    @invariant()
    def every_sequence_reads_back_its_tokens(self):
        """The full group reads back every computed token (a prompt's blocks come chunk by chunk)."""
        for seq_id in self.resident():
            computed = self.computed[seq_id]
            pairs = group_slots(self.kv, seq_id, 0)[:computed]
            expected = list(enumerate(self.tokens[seq_id]))[:computed]
            assert [self.device.get(slot) for _, slot in pairs] == expected
        for seq_id, toks in self.tokens.items():
            assert self.kv.num_tokens(seq_id) == len(toks) and seq_id in self.kv

    @invariant()
    def every_group_reads_back_what_its_queries_read(self):
        """Full group: every token. Window group: from the first key the next step's first query reads up
        to the tokens it has slots for, and nothing before the window of the last step it was told of."""
        for seq_id in self.resident():
            start, toks = self.computed[seq_id], self.tokens[seq_id]
            for g, window in enumerate(self.kv.windows):
                pairs = group_slots(self.kv, seq_id, g)
                first, told = 0, 0
                if window is not None:
                    first = max(0, start + 1 - window) // BS * BS
                    told = max(0, self.started[seq_id] + 1 - window) // BS * BS
                assert all(slot is None for _, slot in pairs[:told]), "held before the window"
                read = [(t, self.device.get(slot)) for t, slot in pairs[first:]]
                assert all(got == (t, toks[t]) for t, got in read)
                covered = len(toks) if start == len(toks) else start
                assert len(pairs) >= min(covered, len(toks)) and len(pairs) <= len(toks)
        for seq_id, toks in self.tokens.items():
            assert self.kv.num_tokens(seq_id) == len(toks)

    @invariant()
    def ref_counts_match_block_tables(self):
        """No block is both free and in a table (PagedMachine's check, over every group's tables)."""
        pool = self.kv.pool
        holders = [0] * len(pool.blocks)
        for seq_id in self.resident():
            for table in self.kv.block_tables(seq_id):
                for block_id in table:
                    if block_id != NO_BLOCK:
                        holders[block_id] += 1
        assert [b.ref_cnt for b in pool.blocks] == holders
        free = free_order(pool)
        assert set(free) == {i for i, n in enumerate(holders) if n == 0}
        assert self.kv.num_free_blocks == len(free) - sum(self.kv._seqs[s].promise for s in self.tokens)
        assert self.kv.num_free_blocks >= 0  # a promise is never more than the free blocks
        assert all(b.block_hash == key for key, b in pool.cached.items())
        assert self.kv.num_free_host_blocks + sum(self.host_blocks.values()) == self.kv.num_host_blocks

    @invariant()
    def usage_adds_up(self):
        u = self.kv.usage()
        assert u.live_slots + u.tail_slots + u.free_slots == u.total_slots
        held = [
            s
            for q in self.resident()
            for g in range(3)
            for _, s in group_slots(self.kv, q, g)
            if s is not None
        ]
        assert u.live_slots == len(set(held)) and u.shared_saved_slots == len(held) - len(set(held))


TestHybrid = HybridMachine.TestCase
TestHybrid.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_layers_are_grouped_by_window_in_equal_groups_full_attention_first():
    gemma3 = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]  # 15 sliding layers, 3 full
    groups = kv_groups(gemma3)
    assert groups.windows == (None, 512, 512, 512, 512, 512) and groups.layers_per_group == 3
    assert [i for i, g in enumerate(groups.layer_group) if g == 0] == [5, 11, 17]
    assert sorted(zip(groups.layer_group, groups.layer_slot, strict=True)) == [
        (g, j) for g in range(6) for j in range(3)
    ]
    assert kv_groups(gemma3, hybrid=False).windows == (None,)  # every token of every layer
    assert kv_groups([None] * 4).layer_slot == (0, 1, 2, 3) and kv_groups([8] * 4).windows == (8,)
    assert kv_groups([None, 8, 8, 8, 8, None]).layers_per_group == 2  # gcd: no group padded
    with pytest.raises(ValueError, match="positive integer or None, got 0"):
        kv_groups([None, 0])


def test_a_window_group_gives_back_blocks_that_left_the_window_and_they_count_as_free():
    kv = PagedAllocator(40, block_size=4, windows=(None, 8))
    kv.allocate("s", list(range(10)), 30)  # 3 blocks in each group
    assert [len(t) for t in kv.block_tables("s")] == [3, 3]
    for t in range(10, 30):
        kv.cache_blocks("s", t, start=t - 1)  # the step computes token t - 1: keys from t - 8 on
        kv.append("s", t)
    kv.cache_blocks("s", 30, start=29)  # keys 22..29: blocks 5..7 of the window group
    full, window = kv.block_tables("s")
    assert len(full) == 8 and window[:5] == [NO_BLOCK] * 5 and NO_BLOCK not in window[5:]
    u = kv.usage()
    assert u.live_slots == 30 + 8 + 2 and u.tail_slots == 2 + 2 and u.free_slots == (40 - 11) * 4
    assert kv.num_free_blocks == 40 - 11
    kv.free("s")
    assert kv.all_free()


def test_a_prefix_hit_needs_the_whole_prefix_in_full_groups_and_the_last_window_in_window_groups():
    kv = PagedAllocator(64, block_size=4, enable_prefix_caching=True, windows=(None, 6))
    prompt = list(range(32))
    kv.allocate("a", prompt, 4)
    kv.cache_blocks("a", 32, start=31)  # the window group gives back blocks 0..5, still cached
    kv.free("a")
    assert kv.allocate("b", prompt, 4) == 28  # every block but the last: both groups have them
    full, window = kv.block_tables("b")
    assert window[:5] == [NO_BLOCK] * 5 and len(full) == len(window) == 8  # keys from 22 on: blocks 5, 6
    kv.free("b")
    for h in kv.prefix.hashes(prompt)[5:7]:  # evict the window group's blocks 5 and 6
        kv.pool.cached.pop((1, h)).block_hash = None
    assert kv.allocate("c", prompt, 4) == 20  # blocks 3, 4 (keys 15..19) are still cached in both
    kv.free("c")
    assert kv.all_free()


def test_a_prompt_is_admitted_by_its_first_chunk_and_takes_every_groups_blocks_chunk_by_chunk():
    """Admission sets aside a window group's prefill only what it holds at once (its window and a chunk)
    and takes a full group's blocks as chunks are computed (vLLM v1's rule): three 100-token prompts take
    84 of 105 blocks, and a fourth is admitted into the rest and computed as far as it fits."""
    kv = PagedAllocator(3 * 25 + 3 * 10, block_size=4, windows=(None, 8), prefill_chunk=16)
    for seq_id in "abc":
        prompt = [ord(seq_id)] * 100
        assert kv.num_blocks_needed(prompt) == 4 + 7  # a first chunk: 16 tokens; window 8 + chunk 16: 7
        assert kv.can_allocate(prompt, 4)
        kv.allocate(seq_id, prompt, 4, num_computed=0)
        assert kv.block_tables(seq_id) == [[], []]
        for start in range(0, 100, 16):
            kv.cache_blocks(seq_id, min(100, start + 16), start=start)
            assert len(kv.block_tables(seq_id)[0]) == -(-min(100, start + 16) // 4)
            assert len([b for b in kv.block_tables(seq_id)[1] if b != NO_BLOCK]) <= 7
    assert kv.num_free_blocks == 105 - 3 * 25 - 3 * 3
    kv.allocate("d", [1] * 100, 4, num_computed=0)  # 7 promised, 14 free beyond it
    assert kv.prefill_room("d", 0, 100) == 40  # 10 blocks: 10 full, 7 from the promise and 3 free
    kv.cache_blocks("d", 40, start=0)
    assert kv.num_free_blocks == 1
    assert kv.prefill_room("d", 40, 60) == 16  # window blocks 0..7 left its window: 4 more blocks fit
    kv.cache_blocks("d", 56, start=40)
    assert kv.num_free_blocks == 0 and kv.prefill_room("d", 56, 44) == 0  # what goes back refills the promise
    with pytest.raises(NoFreeBlocks, match="needs 1 free blocks beyond its promise for its chunk, 0 free"):
        kv.cache_blocks("d", 60, start=56)
    for seq_id in "abcd":
        kv.free(seq_id)
    assert kv.all_free()
    assert not kv.can_allocate([1] * 400, 4)  # its lasting need is more than the whole pool


def test_prefill_room_is_the_longest_chunk_whose_blocks_fit():
    """Window 8, block 4, chunks of 4 promised (4 blocks: 7 keys back and 4 new tokens span at most 4): a
    prefill may compute as far as the free blocks (less keep_free) reach, its window group drawing on its
    promise first, and the blocks that left its window fund its next chunk."""
    kv = PagedAllocator(46, block_size=4, windows=(None, 8), prefill_chunk=4)
    kv.allocate("a", [1] * 60, 4, num_computed=0)  # 1 full block needed, 4 promised
    assert kv.prefill_room("a", 0, 60) == 60  # alone: all 15 blocks of each group fit
    kv.cache_blocks("a", 60, start=0)
    kv.allocate("b", [2] * 40, 4, num_computed=0)  # 4 promised: 12 free
    assert kv.num_free_blocks == 12
    assert kv.prefill_room("b", 0, 40) == 32  # 8 full blocks, 8 window ones (4 of them promised)
    assert kv.prefill_room("b", 0, 40, keep_free=1) == 28
    assert kv.prefill_room("b", 0, 40, keep_free=5) == 20
    assert kv.prefill_room("b", 0, 40, keep_free=12) == 0
    with pytest.raises(NoFreeBlocks, match="needs 14 free blocks beyond its promise for its chunk, 12 free"):
        kv.cache_blocks("b", 33, start=0)
    kv.cache_blocks("b", 32, start=0)
    assert kv.num_free_blocks == 0
    assert kv.prefill_room("b", 32, 8) == 8  # keys from 25 on: window blocks 0..5 go back, the rest fits
    kv.cache_blocks("b", 40, start=32)
    for seq_id in "ab":
        kv.free(seq_id)
    assert kv.all_free()


def test_a_prompt_part_way_through_its_prefill_cannot_grow_or_fork_or_skip_its_chunks():
    kv = PagedAllocator(64, block_size=4, windows=(None, 8), prefill_chunk=16)
    kv.allocate("s", [1] * 40, 4, num_computed=0)
    kv.cache_blocks("s", 16, start=0)
    with pytest.raises(ValueError, match="'s' is still being prefilled"):
        kv.append("s", 2)
    with pytest.raises(ValueError, match="'s' is still being prefilled"):
        kv.fork("s", "t")
    with pytest.raises(ValueError, match="computes 40 prompt tokens in one step, more than prefill_chunk=16"):
        kv.allocate("u", [1] * 40, 4)
    kv.free("s")
    assert kv.all_free()
