"""Scheduler decisions on a real allocator, without a model: the engine's forward pass and sampler are
stood in for by a token 7 for every sequence the step completes."""

from __future__ import annotations

import pytest

from pagedllm.engine.sampler import Sample
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.sequence import Sequence
from pagedllm.kv import PagedAllocator
from pagedllm.sampling_params import SamplingParams


def _seq(name: str, num_tokens: int, max_tokens: int = 32) -> Sequence:
    return Sequence(name, name, 0, list(range(1, num_tokens + 1)), SamplingParams(max_tokens=max_tokens))


def _run(scheduler: Scheduler, out) -> list[Sequence]:
    """What the engine does after the forward pass: a token for each sequence not still prefilling;
    returns those the scheduler finished."""
    return scheduler.update_from_output([(seq, Sample(7)) for _, seq in out.ready()])


@pytest.mark.parametrize(("watermark", "admitted"), [(0.0, True), (0.01, False)])
def test_admission_leaves_the_watermark_free(watermark, admitted):
    """100 blocks, 90 held by a running sequence: a 10-block prompt fits, but not above a 1% watermark."""
    allocator = PagedAllocator(100, block_size=16)
    scheduler = Scheduler(allocator, max_model_len=4096, watermark=watermark)
    scheduler.add(_seq("big", 90 * 16 - 1))
    first = scheduler.schedule()
    assert [s.seq_id for s in first.prefills] == ["big"]
    _run(scheduler, first)  # its sampled token fills block 90
    assert allocator.num_free_blocks == 10
    scheduler.add(_seq("small", 10 * 16))
    out = scheduler.schedule()
    assert [s.seq_id for s in out.decodes] == ["big"]
    assert [s.seq_id for s in out.prefills] == (["small"] if admitted else [])
    assert len(scheduler.waiting) == (0 if admitted else 1)
    for seq in list(scheduler.running):
        scheduler.finish(seq)
    assert allocator.all_free()


def test_a_lone_sequence_is_admitted_even_below_the_watermark():
    allocator = PagedAllocator(10, block_size=16)
    scheduler = Scheduler(allocator, max_model_len=4096, watermark=0.5)
    scheduler.add(_seq("only", 9 * 16))
    assert [s.seq_id for s in scheduler.schedule().prefills] == ["only"]
    scheduler.finish(scheduler.running[0])
    assert allocator.all_free()


def test_chunked_prefill_spends_the_budget_after_the_decodes():
    """vLLM v1's policy: decodes first, then the rest of max_num_batched_tokens on prompt chunks."""
    allocator = PagedAllocator(200, block_size=16)
    scheduler = Scheduler(allocator, max_model_len=4096, max_num_batched_tokens=40)
    for i in range(4):
        scheduler.add(_seq(f"d{i}", 5))
    _run(scheduler, scheduler.schedule())  # four short prompts in one step
    scheduler.add(_seq("long", 100))
    chunks = []
    while not chunks or chunks[-1] != 100 - sum(chunks[:-1]):
        out = scheduler.schedule()
        assert [s.seq_id for s in out.decodes] == ["d0", "d1", "d2", "d3"]  # never stalled
        assert [s.seq_id for s in out.prefills] == ["long"] and out.num_tokens <= 40
        chunks.append(out.num_new_tokens["long"])
        _run(scheduler, out)
    assert chunks == [36, 36, 28]
    long = next(s for s in scheduler.running if s.seq_id == "long")
    assert long.output_token_ids == [7] and long.num_cached_tokens == 100  # sampled after the last chunk
    assert [s.seq_id for s in scheduler.schedule().decodes] == ["d0", "d1", "d2", "d3", "long"]
    for seq in list(scheduler.running):
        scheduler.finish(seq)
    assert allocator.all_free()


def test_without_chunked_prefill_a_prompt_over_the_budget_waits_for_a_step_of_its_own():
    allocator = PagedAllocator(200, block_size=16)
    scheduler = Scheduler(allocator, 4096, max_num_batched_tokens=40, enable_chunked_prefill=False)
    scheduler.add(_seq("short", 5))
    _run(scheduler, scheduler.schedule())
    scheduler.add(_seq("long", 100))
    out = scheduler.schedule()
    assert [s.seq_id for s in out.decodes] == ["short"] and out.prefills == []
    scheduler.finish(scheduler.running[0])
    out = scheduler.schedule()
    assert [s.seq_id for s in out.prefills] == ["long"] and out.num_new_tokens["long"] == 100
    scheduler.finish(scheduler.running[0])
    assert allocator.all_free()


def test_a_newcomer_shares_the_prompt_blocks_computed_in_its_own_step():
    """With prefix caching a chunked prompt's blocks become findable as their chunks are scheduled:
    K/V is written before attention in every layer, so a prompt admitted in the same step may read them."""
    allocator = PagedAllocator(200, block_size=16, enable_prefix_caching=True)
    scheduler = Scheduler(allocator, 4096, max_num_batched_tokens=40)
    scheduler.add(_seq("a", 100))
    _run(scheduler, scheduler.schedule())  # a: tokens 0-39
    scheduler.add(_seq("b", 100))
    out = scheduler.schedule()  # a: tokens 40-79; no budget left for b
    assert out.num_new_tokens == {"a": 40}
    _run(scheduler, out)
    out = scheduler.schedule()  # a: tokens 80-99, then b with a's six full blocks cached
    assert out.num_new_tokens == {"a": 20, "b": 4}
    b = next(s for s in scheduler.running if s.seq_id == "b")
    assert b.num_prefix_hits == 96 and b.num_cached_tokens == 100  # its last 4 are computed now
    assert allocator.block_table("b")[:6] == allocator.block_table("a")[:6]
    assert (scheduler.prefix_cache_queries, scheduler.prefix_cache_hits) == (200, 96)
    for seq in list(scheduler.running):
        scheduler.finish(seq)
    assert allocator.all_free()


def test_a_new_token_gets_its_slot_in_the_step_that_sampled_it():
    allocator = PagedAllocator(10, block_size=4)
    scheduler = Scheduler(allocator, max_model_len=64)
    scheduler.add(_seq("a", 4))
    scheduler.add(_seq("b", 3, max_tokens=1))
    finished = _run(scheduler, scheduler.schedule())
    assert [(s.seq_id, s.finish_reason) for s in finished] == [("b", "length")]  # its one token
    (a,) = scheduler.running
    assert a.num_tokens == 5 and allocator.num_tokens("a") == 5 and len(allocator.block_table("a")) == 2
    assert "b" not in allocator
    out = scheduler.schedule()
    assert [s.seq_id for s in out.decodes] == ["a"] and out.num_new_tokens == {"a": 1}
    scheduler.finish(a)
    assert allocator.all_free()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_newest_sequence_is_preempted_when_a_new_token_finds_no_block(mode):
    """4 blocks of 4: a and b (4 tokens each) need a new block for their sampled tokens, c (2 tokens) has
    room in its own. a, the oldest, takes the free block; b preempts c, the newest, which in swap mode goes
    to the host pool with its new token's slot. c's preemption keeps the next step from admitting it back."""
    allocator = PagedAllocator(4, block_size=4)
    scheduler = Scheduler(allocator, max_model_len=64, preemption_mode=mode, watermark=0)
    for name, num_tokens in (("a", 4), ("b", 4), ("c", 2)):
        scheduler.add(_seq(name, num_tokens))
    assert _run(scheduler, scheduler.schedule()) == []
    c = next(seq for seq in scheduler.swapped or scheduler.waiting)
    assert (c.seq_id, scheduler.num_preemptions) == ("c", 1)
    assert [s.seq_id for s in scheduler.running] == ["a", "b"]
    assert all(allocator.num_tokens(s.seq_id) == s.num_tokens == 5 for s in scheduler.running)
    out = scheduler.schedule()
    assert [s.seq_id for s in out.decodes] == ["a", "b"] and out.prefills == [] and out.preempted == [c]
    assert out.swap_in == [] and len(out.swap_out) == (1 if mode == "swap" else 0)
    if mode == "swap":
        assert allocator.num_tokens("c") == 3 and c.num_cached_tokens == 2
        scheduler.update_from_output([(c, Sample(9))])  # e.g. a beam whose search chose its next token
        assert list(scheduler.swapped) == [c] and allocator.num_tokens("c") == 4  # slotted on swap-in
    for seq in [*scheduler.running, c]:
        scheduler.finish(seq)
    assert allocator.all_free()


def test_a_sequence_alone_in_a_cache_it_has_outgrown_finishes_with_length():
    allocator = PagedAllocator(2, block_size=4)
    scheduler = Scheduler(allocator, max_model_len=64, watermark=0)
    scheduler.add(_seq("a", 7))
    assert _run(scheduler, scheduler.schedule()) == []  # its token 8 fills the second block
    (a,) = _run(scheduler, scheduler.schedule())  # token 9 would need a third
    assert a.finish_reason == "length" and a.output_token_ids == [7, 7] and a.is_finished
    assert not scheduler.running and allocator.all_free()


def test_a_victim_swapped_before_its_new_token_had_a_slot_gets_it_when_it_comes_back():
    """4 blocks of 4, three 4-token prompts: each sampled token needs a new block. a takes the free one,
    b preempts c, whose token has no slot yet: swapped out, it gets one when it comes back."""
    allocator = PagedAllocator(4, block_size=4)  # and as many host blocks
    scheduler = Scheduler(allocator, max_model_len=64, preemption_mode="swap", watermark=0)
    for name in "abc":
        scheduler.add(_seq(name, 4))
    _run(scheduler, scheduler.schedule())
    (c,) = scheduler.swapped
    assert c.seq_id == "c" and allocator.num_tokens("c") == c.num_tokens == 5
    out = scheduler.schedule()
    assert [s.seq_id for s in out.decodes] == ["a", "b"] and len(out.swap_out) == 1
    for seq in list(scheduler.running):
        scheduler.finish(seq)
    out = scheduler.schedule()
    assert len(out.swap_in) == 1 and len(allocator.block_table("c")) == 2  # its new block: no copy
    assert out.decodes == [c] and out.num_new_tokens == {"c": 1}
    scheduler.finish(c)
    assert allocator.all_free()
