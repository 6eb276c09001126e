"""Prompt log-probabilities (SamplingParams.prompt_logprobs) against Hugging Face's log-softmax of the same
tokens: whole prompts, prompts prefilled in chunks, beside the prefix cache, through preemption."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import FLOAT32_KV, assert_all_blocks_free
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams

TOL = 1e-4  # float32 weights on both sides


@pytest.fixture(scope="module")
def tiny_hf(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny_prompts():
    rng = random.Random(2)
    return [[rng.randrange(384) for _ in range(n)] for n in (1, 2, 16, 17, 40, 150)]


def hf_log_softmax(hf, token_ids: list[int]) -> torch.Tensor:
    """Row p: the log-probabilities of the token after position p."""
    with torch.inference_mode():
        return hf(torch.tensor([token_ids])).logits[0].float().log_softmax(dim=-1)


def assert_matches_hf(output, hf, k: int) -> None:
    """One entry per prompt token, the first None; each holds the token and the k most likely, as HF."""
    prompt = output.prompt_token_ids
    assert output.prompt_logprobs is not None and len(output.prompt_logprobs) == len(prompt)
    assert output.prompt_logprobs[0] is None
    expected = hf_log_softmax(hf, prompt)
    for position, (token, entry) in enumerate(zip(prompt[1:], output.prompt_logprobs[1:], strict=True)):
        row = expected[position]
        assert set(entry) == set(row.topk(k).indices.tolist()) | {token}, position
        for t, logprob in entry.items():
            assert logprob == pytest.approx(row[t].item(), abs=TOL), (position, t)


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


@pytest.mark.parametrize(
    "settings",
    [dict(), dict(enable_prefix_caching=False), dict(kv_layout="contiguous", contiguous_reserve="pow2")],
    ids=["prefix-caching", "no-prefix-caching", "contiguous"],
)
@pytest.mark.parametrize("budget", [8192, 7], ids=["whole", "chunks-of-7"])
def test_tiny_model_prompt_logprobs_are_hf_log_softmax(
    tiny_llama_dir, tiny_hf, tiny_prompts, settings, budget
):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=128, max_num_batched_tokens=budget, **settings, **FLOAT32_KV)
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2)
    outputs = generate(llm, tiny_prompts, params)
    for output in outputs:
        assert_matches_hf(output, tiny_hf, 2)
    # The generated tokens are the same as without prompt log-probabilities.
    plain = generate(llm, tiny_prompts, SamplingParams(max_tokens=3, temperature=0.0))
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
    assert all(o.prompt_logprobs is None for o in plain)
    assert_all_blocks_free(llm)


def test_zero_gives_the_prompt_tokens_alone_and_logprobs_stay_separate(tiny_llama_dir, tiny_hf, tiny_prompts):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=128, **FLOAT32_KV)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0, logprobs=1)
    for output in generate(llm, tiny_prompts, params):
        assert_matches_hf(output, tiny_hf, 0)
        assert all(len(entry) == 1 for entry in output.prompt_logprobs[1:])
        assert len(output.outputs[0].logprobs) == 2  # the sampled tokens' own, as before
    assert_all_blocks_free(llm)


def test_prefix_cache_is_not_read_for_prompt_logprobs_but_still_written(tiny_llama_dir, tiny_hf):
    """A request asking for prompt log-probabilities computes its whole prompt (the cache has no logits);
    the blocks it computes serve the next request that does not ask."""
    rng = random.Random(5)
    prompt = [rng.randrange(384) for _ in range(70)]
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=128, block_size=16, **FLOAT32_KV)
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    asking = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
    assert generate(llm, [prompt], greedy)[0].num_cached_tokens == 0
    first = generate(llm, [prompt], asking)[0]
    assert first.num_cached_tokens == 0
    assert_matches_hf(first, tiny_hf, 1)
    stats = llm.engine.stats()
    assert generate(llm, [prompt], greedy)[0].num_cached_tokens == 64  # 4 full blocks, the last recomputed
    # Only the requests that read the cache count as its queries.
    assert llm.engine.stats().prefix_cache_queries == stats.prefix_cache_queries + len(prompt)
    fresh = [rng.randrange(384) for _ in range(50)]
    generate(llm, [fresh], asking)
    assert generate(llm, [fresh], greedy)[0].num_cached_tokens == 48  # written by the request that asked
    assert_all_blocks_free(llm)


def test_parallel_samples_share_one_list_and_preemption_gathers_nothing_twice(tiny_llama_dir, tiny_hf):
    """n = 2 samples report the prompt's entries once each, and recomputed prompts (preempted to make room
    for others' decodes, part way through a chunked prefill or after it) give the same entries."""
    rng = random.Random(7)
    prompts = [[rng.randrange(384) for _ in range(n)] for n in (60, 45, 70, 33)]
    params = SamplingParams(n=2, max_tokens=40, temperature=1.0, seed=1, prompt_logprobs=1, ignore_eos=True)
    llm = LLM(
        str(tiny_llama_dir),
        num_kv_blocks=14,
        block_size=16,
        max_num_batched_tokens=24,
        watermark=0.0,
        **FLOAT32_KV,
    )
    outputs = generate(llm, prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    for output in outputs:
        assert len(output.outputs) == 2
        assert_matches_hf(output, tiny_hf, 1)
    assert_all_blocks_free(llm)


def test_real_model_prompt_logprobs_are_hf_log_softmax(smollm2_llm, hf_smollm2):
    """SmolLM2 in float32, whole and in chunks of 16, against transformers' own load of the same file."""
    tok = smollm2_llm.get_tokenizer()
    prompts = [
        tok.encode("The capital of France is Paris, and the capital of Italy is Rome."),
        tok.encode(" ".join(f"Step {i}: add {i} to the total." for i in range(8))),
    ]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=5)
    chunked = LLM(
        "smollm2-135m",
        kv_cache_memory="16MiB",
        max_model_len=512,
        quantization="none",
        max_num_batched_tokens=16,
        **FLOAT32_KV,
    )
    for llm in (smollm2_llm, chunked):
        for output in generate(llm, prompts, params):
            assert_matches_hf(output, hf_smollm2, 5)
        assert_all_blocks_free(llm)
