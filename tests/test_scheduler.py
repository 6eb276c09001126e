"""Scheduler decisions on a real allocator, without a model."""

from __future__ import annotations

import pytest

from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.sequence import Sequence
from pagedllm.kv import PagedAllocator
from pagedllm.sampling_params import SamplingParams


def _seq(name: str, num_tokens: int) -> Sequence:
    return Sequence(name, name, 0, list(range(1, num_tokens + 1)), SamplingParams(max_tokens=32))


@pytest.mark.parametrize(("watermark", "admitted"), [(0.0, True), (0.01, False)])
def test_admission_leaves_the_watermark_free(watermark, admitted):
    """100 blocks, 90 held by a running sequence: a 10-block prompt fits, but not above a 1% watermark."""
    allocator = PagedAllocator(100, block_size=16)
    scheduler = Scheduler(allocator, max_model_len=4096, watermark=watermark)
    scheduler.add(_seq("big", 90 * 16 - 1))
    first = scheduler.schedule()
    assert [s.seq_id for s in first.prefills] == ["big"]
    scheduler.update_after_step(first)
    scheduler.running[0].output_token_ids.append(7)  # its sampled token, appended at the next step
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


def _run(scheduler: Scheduler, out) -> None:
    """What the engine does after the forward pass: count the computed tokens, sample one for each
    sequence that is not still prefilling."""
    for row in scheduler.update_after_step(out):
        out.scheduled[row].output_token_ids.append(7)


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
    assert b.num_cached_tokens == 96 and b.num_prefix_hits == 96
    assert allocator.block_table("b")[:6] == allocator.block_table("a")[:6]
    assert (scheduler.prefix_cache_queries, scheduler.prefix_cache_hits) == (200, 96)
    for seq in list(scheduler.running):
        scheduler.finish(seq)
    assert allocator.all_free()
