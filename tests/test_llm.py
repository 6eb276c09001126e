"""LLM.generate on the real SmolLM2 model through the paged cache, against Hugging Face transformers."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_all_blocks_free
from models_helpers import hf_greedy

from pagedllm import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at",
    "List of planets in the solar system: Mercury,",
    "Translate to French: Good morning ->",
    "A",
]

GREEDY_32 = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_reference(hf_smollm2, smollm2_llm):
    tok = smollm2_llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    return ids, hf_greedy(hf_smollm2, ids, 32)


def test_batched_greedy_matches_hf(smollm2_llm, hf_reference):
    prompt_ids, expected = hf_reference
    outputs = smollm2_llm.generate(PROMPTS, GREEDY_32)
    assert [o.prompt for o in outputs] == PROMPTS
    assert [o.prompt_token_ids for o in outputs] == prompt_ids
    for out, want in zip(outputs, expected, strict=True):
        assert out.outputs[0].token_ids == want, out.prompt
        assert out.outputs[0].finish_reason == "length"
        assert out.finished
    text = outputs[0].outputs[0].text
    assert "Paris" in text
    assert text == smollm2_llm.get_tokenizer().decode(expected[0], skip_special_tokens=True)
    assert_all_blocks_free(smollm2_llm)


def test_contiguous_layout_generates_the_same_tokens(hf_reference):
    from pagedllm import LLM

    prompt_ids, expected = hf_reference
    llm = LLM(
        "smollm2-135m",
        kv_layout="contiguous",
        contiguous_reserve="pow2",
        kv_cache_memory="64MiB",
        max_model_len=512,
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], GREEDY_32)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert_all_blocks_free(llm)


def test_block_boundaries_and_mixed_lengths(smollm2_llm, hf_smollm2):
    """Prompts of exactly one block, one past it, one token, and ~500 tokens, in one batch."""
    tok = smollm2_llm.get_tokenizer()
    long_ids = tok.encode(" ".join(f"item {i}," for i in range(170)), add_special_tokens=False)[:500]
    base = tok.encode(PROMPTS[2] * 4, add_special_tokens=False)
    prompts = [base[:16], base[:17], base[:1], long_ids, base[:15]]
    outputs = smollm2_llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
    )
    expected = hf_greedy(hf_smollm2, prompts, 12)
    for prompt, out, want in zip(prompts, outputs, expected, strict=True):
        assert out.outputs[0].token_ids == want, len(prompt)
    assert_all_blocks_free(smollm2_llm)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_dtypes_generate(dtype):
    from pagedllm import LLM

    llm = LLM("smollm2-135m", dtype=dtype, kv_cache_memory="16MiB", max_model_len=256)
    assert llm.engine.runner.k_cache.dtype == getattr(torch, dtype)
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=4, temperature=0))[0]
    assert "Paris" in out.outputs[0].text
    assert_all_blocks_free(llm)
