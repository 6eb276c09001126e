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


GREEDY_LOGPROBS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def fp32_greedy(smollm2_llm):
    return [o.outputs[0] for o in smollm2_llm.generate(PROMPTS, GREEDY_LOGPROBS)]


@pytest.mark.parametrize(
    ("dtype", "kv_cache_dtype", "tol"),
    [
        ("bfloat16", "auto", 0.3),
        ("float16", "auto", 0.1),
        ("float32", "bfloat16", 0.05),
        ("float32", "auto", 0.05),
    ],
)
def test_half_precision_dtypes_track_fp32(dtype, kv_cache_dtype, tol, fp32_greedy, smollm2_llm):
    """16 greedy tokens on 8 prompts against fp32: the same tokens with chosen-token logprobs within
    `tol` nats, until a divergence that must be a near-tie in fp32 (both tokens within `tol` there).
    A bf16 KV cache under an fp32 model holds twice the tokens in the same memory (in blocks of 32 tokens,
    the default for two bytes a value, against float32's 16), and so does the CPU's default for an fp32
    model, float16."""
    from pagedllm import LLM

    llm = LLM(
        "smollm2-135m", dtype=dtype, kv_cache_dtype=kv_cache_dtype, kv_cache_memory="16MiB", max_model_len=256
    )
    stored = kv_cache_dtype if kv_cache_dtype != "auto" else "float16" if dtype == "float32" else dtype
    assert llm.engine.runner.kv_caches[0][0].dtype == getattr(torch, stored)
    cfg = llm.engine.model.config
    block_size = 16 if stored == "float32" else 32
    assert llm.engine.config.block_size == block_size
    block_bytes = (
        2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * block_size * (4 if stored == "float32" else 2)
    )
    assert llm.engine.num_kv_blocks == 16 * 2**20 // block_bytes
    agreed = 0
    for ref, out in zip(fp32_greedy, llm.generate(PROMPTS, GREEDY_LOGPROBS), strict=True):
        half = out.outputs[0]
        for i, (want, got) in enumerate(zip(ref.token_ids, half.token_ids, strict=True)):
            if want != got:
                assert got in ref.logprobs[i], (out.prompt, i)  # among fp32's top 5
                assert ref.logprobs[i][want] - ref.logprobs[i][got] < tol, (out.prompt, i)
                break
            agreed += 1
            assert abs(half.logprobs[i][got] - ref.logprobs[i][want]) < tol, (out.prompt, i)
    assert agreed >= len(PROMPTS) * 16 // 2, agreed
    assert_all_blocks_free(llm)
    assert_all_blocks_free(smollm2_llm)


def test_logprobs_are_the_models_log_softmax(smollm2_llm, hf_smollm2):
    """Chosen and top logprobs (greedy and sampled) equal a log-softmax of HF's logits, before temperature."""
    prompt = "The three primary colors are"
    cases = [
        SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.8, top_k=20, seed=3, logprobs=3, ignore_eos=True),
    ]
    for params in cases:
        out = smollm2_llm.generate(prompt, params)[0]
        completion, prompt_ids = out.outputs[0], out.prompt_token_ids
        with torch.inference_mode():
            logits = hf_smollm2(torch.tensor([prompt_ids + completion.token_ids])).logits[0].float()
        expected = logits[len(prompt_ids) - 1 : -1].log_softmax(dim=-1)
        assert len(completion.logprobs) == len(completion.token_ids) == 6
        for row, token, top in zip(expected, completion.token_ids, completion.logprobs, strict=True):
            ids = row.topk(3).indices
            assert set(ids.tolist()) | {token} == set(top)
            for t, lp in top.items():
                assert lp == pytest.approx(row[t].item(), abs=2e-3)
        chosen = expected[torch.arange(6), torch.tensor(completion.token_ids)]
        assert completion.cumulative_logprob == pytest.approx(chosen.sum().item(), abs=1e-2)
    assert_all_blocks_free(smollm2_llm)
