"""`slot_states()`, `block_states()` and `runs()`: the cache as pictures draw it, agreeing with usage()
and the block tables."""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis.stateful import invariant
from kv_helpers import slots
from test_kv_properties import CachingPagedMachine, OracleMachine, Pow2Machine

from pagedllm.kv import ContiguousAllocator, PagedAllocator, SlotRun, SlotState

L, R, T, F = SlotState.LIVE, SlotState.RESERVED, SlotState.TAIL, SlotState.FREE


def assert_counts_match_usage(kv) -> None:
    counts, u = Counter(kv.slot_states()), kv.usage()
    assert len(kv.slot_states()) == u.total_slots
    assert (counts[L], counts[R], counts[T], counts[F]) == (
        u.live_slots,
        u.reserved_slots,
        u.tail_slots,
        u.free_slots,
    )


def test_paged_blocks_are_live_up_to_their_tokens_then_tail():
    kv = PagedAllocator(4, block_size=4)
    kv.allocate("a", [1] * 6, 4)  # blocks 0, 1
    kv.allocate("b", [2] * 3, 4)  # block 2
    assert kv.slot_states() == [L] * 4 + [L, L, T, T] + [L, L, L, T] + [F] * 4
    kv.append("b", 3)
    kv.free("a")
    assert kv.slot_states() == [F] * 8 + [L] * 4 + [F] * 4
    assert_counts_match_usage(kv)


def test_paged_shared_blocks_count_once_and_copy_on_write_takes_a_free_block():
    kv = PagedAllocator(3, block_size=4)
    kv.allocate("p", [1] * 6, 4)
    kv.fork("p", "c")
    assert kv.slot_states() == [L] * 4 + [L, L, T, T] + [F] * 4
    kv.append("c", 5)  # copies the shared, partly filled last block into block 2
    assert kv.slot_states() == [L] * 4 + [L, L, T, T] + [L, L, L, T]
    assert_counts_match_usage(kv)


def test_paged_cached_blocks_no_sequence_holds_are_free():
    kv = PagedAllocator(2, block_size=2, enable_prefix_caching=True)
    kv.allocate("a", [1, 2, 3], 1)
    kv.free("a")
    assert kv.pool.cached and kv.slot_states() == [F] * 4
    assert_counts_match_usage(kv)


def test_paged_block_states_show_shared_and_cached_blocks():
    kv = PagedAllocator(4, block_size=2, enable_prefix_caching=True)
    kv.allocate("a", [1, 2, 3], 4)  # blocks 0 (full, cached), 1
    kv.fork("a", "b")
    states = kv.block_states()
    assert (states.ref_counts, states.num_tokens, states.cached) == (
        [2, 2, 0, 0],
        [2, 1, 0, 0],
        [True, False, False, False],
    )
    kv.free("a")
    kv.free("b")
    states = kv.block_states()
    assert (states.ref_counts, states.num_tokens, states.cached) == ([0] * 4, [0] * 4, [True] + [False] * 3)


def test_contiguous_runs_mark_gaps_too_small_for_the_refused_request_as_external():
    kv = ContiguousAllocator(20, max_model_len=16, reserve="pow2")
    kv.allocate("a", [1] * 3, 5)  # 8 slots: 0..7
    kv.allocate("b", [1] * 3, 1)  # 4 slots: 8..11
    kv.allocate("c", [1] * 3, 3)  # 8 slots: 12..19
    kv.free("b")
    assert not kv.can_allocate([1] * 5, 3)  # an 8-slot slab: the 4-slot gap is too small
    assert kv.runs() == [
        SlotRun(0, 8, "a", 3, False),
        SlotRun(8, 4, None, 0, True),
        SlotRun(12, 8, "c", 3, False),
    ]
    assert kv.usage().parts() == {"live": 6, "tail": 0, "reserved": 10, "external": 4, "free": 0}
    kv.free("a")
    assert kv.runs()[0] == SlotRun(0, 12, None, 0, False)


def test_contiguous_slabs_are_live_up_to_their_length_then_reserved():
    kv = ContiguousAllocator(20, max_model_len=8, reserve="max")
    kv.allocate("a", [1] * 3, 5)  # slots 0..7
    kv.allocate("b", [1] * 2, 6)  # slots 8..15
    kv.append("b", 0)
    assert kv.slot_states() == [L] * 3 + [R] * 5 + [L] * 3 + [R] * 5 + [F] * 4
    kv.free("a")
    assert kv.slot_states() == [F] * 8 + [L] * 3 + [R] * 5 + [F] * 4
    assert_counts_match_usage(kv)


class SlotStatesInvariant:
    """Mixed into the property machines: slot_states() agrees with usage() and with the slot mappings."""

    @invariant()
    def slot_states_agree(self):
        kv, states = self.kv, self.kv.slot_states()
        assert_counts_match_usage(kv)
        mapped = {slot for s in self.resident() for slot in slots(kv, s)}
        assert {i for i, state in enumerate(states) if state == L} == mapped
        if isinstance(kv, PagedAllocator):
            held = {b for s in self.resident() for b in kv.block_table(s)}
            assert {i // self.bs for i, state in enumerate(states) if state != F} == held
        else:
            gaps = {i for start, size in kv.gaps for i in range(start, start + size)}
            assert {i for i, state in enumerate(states) if state == F} == gaps


class PicturesInvariant(SlotStatesInvariant):
    """block_states() / runs() (what the dashboard draws) agree with the slot states and block tables."""

    @invariant()
    def pictures_agree(self):
        kv, states, usage = self.kv, self.kv.slot_states(), self.kv.usage()
        assert sum(usage.parts().values()) == usage.total_slots and min(usage.parts().values()) >= 0
        if isinstance(kv, PagedAllocator):
            blocks = kv.block_states()
            tables = Counter(b for s in self.resident() for b in kv.block_table(s))
            assert blocks.ref_counts == [tables[b] for b in range(kv.num_total_blocks)]
            live = [states[b * self.bs : (b + 1) * self.bs].count(L) for b in range(kv.num_total_blocks)]
            assert blocks.num_tokens == live
            assert {b for b, cached in enumerate(blocks.cached) if cached} == {
                block.block_id for block in kv.pool.cached.values()
            }
        else:
            runs = kv.runs()
            assert [r.start for r in runs] == [0] + [r.start + r.size for r in runs[:-1]]
            assert sum(r.size for r in runs) == usage.total_slots
            slabs = {r.seq_id: (r.size, r.num_tokens) for r in runs if r.seq_id is not None}
            assert {s: n for s, (_, n) in slabs.items()} == {s: kv.num_tokens(s) for s in self.resident()}
            assert [(r.start, r.size) for r in runs if r.seq_id is None] == kv.gaps
            assert sum(r.size for r in runs if r.external) == usage.external_frag_slots


class PagedSlotStates(PicturesInvariant, CachingPagedMachine):
    pass


class Pow2SlotStates(PicturesInvariant, Pow2Machine):
    pass


class OracleSlotStates(PicturesInvariant, OracleMachine):
    pass


TestPagedSlotStates = PagedSlotStates.TestCase
TestPow2SlotStates = Pow2SlotStates.TestCase
TestOracleSlotStates = OracleSlotStates.TestCase
for _case in (TestPagedSlotStates, TestPow2SlotStates, TestOracleSlotStates):
    _case.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)
del _case
