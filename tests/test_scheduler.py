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
    assert [s.seq_id for s in scheduler.schedule().prefills] == ["big"]
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
