"""Scenario tests of the contiguous-slab KV allocator: reservation policies, first fit, fragmentation."""

import pytest
from kv_helpers import slots

from pagedllm.kv import ContiguousAllocator, NoFreeBlocks


@pytest.mark.parametrize(
    ("reserve", "expected"),
    [("max", 64), ("pow2", 16), ("oracle", 13)],
)
def test_reservation_policies_size_the_slab(reserve, expected):
    kv = ContiguousAllocator(num_slots=100, max_model_len=64, reserve=reserve)
    assert kv.allocate("s", [1] * 10, max_new_tokens=5, true_output_len=3) == 0
    assert kv.slabs["s"].size == expected
    u = kv.usage()
    assert (u.live_slots, u.reserved_slots, u.free_slots) == (10, expected - 10, 100 - expected)
    assert kv.block_size == 1 and kv.block_table("s") == slots(kv, "s") == list(range(10))


def test_pow2_never_reserves_beyond_max_model_len():
    kv = ContiguousAllocator(num_slots=200, max_model_len=48, reserve="pow2")
    kv.allocate("s", [1] * 30, max_new_tokens=10)
    assert kv.slabs["s"].size == 48


def test_first_fit_fails_with_enough_total_free_space():
    kv = ContiguousAllocator(num_slots=100, max_model_len=40, reserve="oracle")
    for seq_id in "abc":
        kv.allocate(seq_id, [1] * 20, 10, true_output_len=10)  # slabs [0,30) [30,60) [60,90)
    kv.allocate("d", [1] * 5, 5, true_output_len=5)  # [90,100)
    kv.free("a")
    kv.free("c")
    assert kv.gaps == [(0, 30), (60, 30)] and kv.num_free_blocks == 60
    assert not kv.can_allocate([1] * 30, 10, true_output_len=10)  # needs 40 in one gap
    u = kv.usage()
    assert (u.free_slots, u.largest_free_run, u.external_frag_slots) == (60, 30, 60)
    with pytest.raises(NoFreeBlocks, match="40 slots"):
        kv.allocate("e", [1] * 30, 10, true_output_len=10)
    assert kv.gaps == [(0, 30), (60, 30)] and "e" not in kv
    kv.free("b")  # the three gaps merge into one
    assert kv.gaps == [(0, 90)]
    kv.allocate("e", [1] * 30, 10, true_output_len=10)
    assert kv.block_table("e")[0] == 0  # first fit: lowest address
    assert kv.usage().external_frag_slots == 0


def test_freed_slabs_merge_with_both_neighbours():
    kv = ContiguousAllocator(num_slots=30, max_model_len=10, reserve="max")
    for seq_id in "abc":
        kv.allocate(seq_id, [1], 1)
    kv.free("a")
    kv.free("c")
    assert kv.gaps == [(0, 10), (20, 10)]
    kv.free("b")
    assert kv.gaps == [(0, 30)] and kv.all_free()


def test_append_grows_inside_the_slab_and_fails_at_its_end():
    kv = ContiguousAllocator(num_slots=64, max_model_len=64, reserve="pow2")
    kv.allocate("s", [1, 2, 3], max_new_tokens=1)  # slab of 4
    assert kv.can_append("s") and kv.append("s", 4) == []
    assert kv.block_table("s") == [0, 1, 2, 3] and slots(kv, "s", start=3) == [3]
    assert not kv.can_append("s")
    with pytest.raises(NoFreeBlocks, match="'s' filled its slab of 4 slots"):
        kv.append("s", 5)
    assert kv.num_tokens("s") == 4


def test_fork_reserves_a_slab_and_reports_the_copies():
    kv = ContiguousAllocator(num_slots=20, max_model_len=8, reserve="max")
    kv.allocate("p", [1, 2, 3], 2)
    assert kv.fork("p", "c") == [(0, 8), (1, 9), (2, 10)]
    assert kv.block_table("c") == [8, 9, 10] and kv.usage().live_slots == 6
    with pytest.raises(NoFreeBlocks):
        kv.fork("p", "d")  # 4 slots left, the slab needs 8
    assert "d" not in kv and kv.gaps == [(16, 4)]


def test_bad_ids_and_arguments_raise_clear_errors():
    kv = ContiguousAllocator(num_slots=64, max_model_len=16, reserve="oracle")
    with pytest.raises(ValueError, match="true_output_len"):
        kv.allocate("a", [1], 4)
    with pytest.raises(ValueError, match="exceeds max_model_len 16"):
        kv.can_allocate([1] * 10, 7, true_output_len=7)
    kv.allocate("a", [1], 4, true_output_len=2)
    with pytest.raises(ValueError, match="'a' is already allocated"):
        kv.allocate("a", [1], 4, true_output_len=2)
    kv.free("a")
    with pytest.raises(KeyError, match="'a'"):
        kv.free("a")
    with pytest.raises(KeyError, match="'a'"):
        kv.append("a", 1)
    with pytest.raises(ValueError, match="'lifo'"):
        ContiguousAllocator(64, 16, reserve="lifo")
    with pytest.raises(ValueError, match="num_slots"):
        ContiguousAllocator(0, 16)


def test_the_contiguous_layout_cannot_swap_and_says_so():
    kv = ContiguousAllocator(num_slots=16, max_model_len=8)
    kv.allocate("a", [1], 2)
    assert not kv.supports_swap
    for op in (kv.swap_out, kv.can_swap_in, kv.swap_in):
        with pytest.raises(ValueError, match="cannot swap sequence 'a'"):
            op("a")
    assert kv.block_table("a") == list(range(1))


def test_lookahead_slots_come_from_the_slab_and_go_back_to_it():
    kv = ContiguousAllocator(num_slots=16, max_model_len=8)
    kv.allocate("s", [1, 2, 3], 4)
    assert kv.can_reserve_lookahead("s", 5) and not kv.can_reserve_lookahead("s", 6)
    assert kv.reserve_lookahead("s", 3) == [] and kv.block_table("s") == list(range(6))
    assert kv.usage().live_slots == 3
    with pytest.raises(ValueError, match="lookahead"):
        kv.fork("s", "t")
    kv.append("s", 4)
    kv.release_lookahead("s")
    assert kv.block_table("s") == list(range(4)) and kv.usage().reserved_slots == 4
    with pytest.raises(NoFreeBlocks, match="overflow its slab"):
        kv.reserve_lookahead("s", 5)
