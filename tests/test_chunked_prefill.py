"""Chunked prefill (vLLM v1's policy) gives the same tokens as prefilling every prompt whole."""

from __future__ import annotations

import random

import pytest
from helpers import assert_all_blocks_free

from pagedllm import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _generate_recording_chunks(llm: LLM, prompts, params) -> tuple[list[list[int]], int]:
    """Generate; also return the largest number of prompt chunks any sequence was prefilled in."""
    scheduler = llm.engine.scheduler
    schedule, chunks = scheduler.schedule, {}

    def recording():
        out = schedule()
        for seq in out.prefills:
            chunks[seq.seq_id] = chunks.get(seq.seq_id, 0) + 1
        return out

    scheduler.schedule = recording
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        del scheduler.schedule
    return [o.outputs[0].token_ids for o in outputs], max(chunks.values())


@pytest.mark.parametrize(
    "settings",
    [dict(), dict(enable_prefix_caching=False), dict(kv_layout="contiguous", contiguous_reserve="pow2")],
    ids=["prefix-caching", "no-prefix-caching", "contiguous"],
)
def test_tiny_model_chunked_equals_unchunked(tiny_llama_dir, settings):
    rng = random.Random(0)
    shared = [rng.randrange(384) for _ in range(40)]
    prompts = [[rng.randrange(384) for _ in range(n)] for n in (1, 15, 16, 17, 90, 300)]
    prompts += [shared + [1, 2, 3], shared + [4] * 30]  # a shared prefix across chunk boundaries
    whole = LLM(str(tiny_llama_dir), num_kv_blocks=128, enable_chunked_prefill=False)
    expected, max_chunks = _generate_recording_chunks(whole, prompts, GREEDY)
    assert max_chunks == 1
    for budget in (7, 32):
        llm = LLM(str(tiny_llama_dir), num_kv_blocks=128, max_num_batched_tokens=budget, **settings)
        tokens, max_chunks = _generate_recording_chunks(llm, prompts, GREEDY)
        assert tokens == expected, budget
        assert max_chunks >= 300 // budget  # the 300-token prompt really went in chunks
        assert_all_blocks_free(llm)
    assert_all_blocks_free(whole)


def test_real_model_chunked_equals_unchunked(smollm2_llm):
    tok = smollm2_llm.get_tokenizer()
    long = tok.encode(" ".join(f"Step {i}: add {i} to the total." for i in range(60)))[:600]
    prompts = [long] + [tok.encode(f"Question {i}: what is {i} plus {i}?") for i in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    expected, _ = _generate_recording_chunks(
        LLM("smollm2-135m", kv_cache_memory="32MiB", max_model_len=1024, enable_chunked_prefill=False),
        prompts,
        params,
    )
    llm = LLM("smollm2-135m", kv_cache_memory="32MiB", max_model_len=1024, max_num_batched_tokens=64)
    tokens, max_chunks = _generate_recording_chunks(llm, prompts, params)
    assert max_chunks >= 600 // 64
    assert tokens == expected
    assert_all_blocks_free(llm)
