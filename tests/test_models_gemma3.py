"""The built-in Gemma 3 270M (GGUF: Q4_K/Q5_0/Q6_K/Q8_0 tensors) against Hugging Face's own GGUF load.

Reduced form: the Hugging Face load alone takes about a minute and 3 GB; two prompts, one longer than
the 512-token sliding window so that local and global layers differ.
"""

from __future__ import annotations

import pytest
import torch
from models_helpers import PagedCache, forward_chunks, greedy_generate, hf_greedy, hf_logits

from pagedllm.models import load_model
from pagedllm.models.loader import BUILTIN_MODELS
from pagedllm.ops import native

pytestmark = pytest.mark.slow

LONG_TEXT = (
    "The library keeps its oldest maps in a cold room under the east wing. Each map is numbered, "
    "wrapped in paper and stored flat in a wide drawer, and a card in the catalogue says who drew it, "
    "when, and which coast or valley it shows. "
)


@pytest.fixture(scope="module", params=["gguf", None], ids=["gguf-blocks", "float32"])
def gemma3(request):
    """The built-in file's own blocks (the default: Q5_0 / Q8_0 / Q4_K / Q6_K kept), and float32, each on
    its float32-exact paths: the blocks' bf16 path for a prefill's many rows (AVX512_BF16 CPUs) is held to
    HF's bf16 forward in test_models_smollm2.py, and the engine's default load to HF's greedy tokens below."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native, "bf16_matmul_available", lambda: False)
        return load_model("gemma3-270m", quantization=request.param)


@pytest.fixture(scope="module")
def hf_gemma3():
    from transformers import AutoModelForCausalLM

    path = BUILTIN_MODELS["gemma3-270m"]()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(gemma3):
    tok = gemma3.tokenizer
    long_ids = tok.encode(LONG_TEXT * 12 + "In short, the maps are")
    assert len(long_ids) > 512 + 16, "the long prompt must outgrow the sliding window"
    return [tok.encode("The capital of France is"), long_ids]


def test_config_and_tokenizer(gemma3, hf_gemma3, prompt_ids):
    cfg, hf_cfg = gemma3.config, hf_gemma3.config
    assert cfg.layer_types == hf_cfg.layer_types
    assert (
        (cfg.sliding_window, cfg.head_dim, cfg.num_kv_heads)
        == (512, 256, 1)
        == (
            hf_cfg.sliding_window,
            hf_cfg.head_dim,
            hf_cfg.num_key_value_heads,
        )
    )
    assert cfg.rope_local_theta == hf_cfg.rope_parameters["sliding_attention"]["rope_theta"]
    assert all(ids[0] == cfg.bos_token_id == 2 for ids in prompt_ids)
    assert gemma3.eos_token_ids == [1]


def test_prefill_logits_and_greedy_match_hf(gemma3, hf_gemma3, prompt_ids, int16_activations):
    model = gemma3.model
    cache = PagedCache.create(model.config, 64, 16, seed=2)
    logits = forward_chunks(model, cache, [(i, p, 0) for i, p in enumerate(prompt_ids)], tail=4)
    expected = torch.cat([hf_logits(hf_gemma3, p, tail=4) for p in prompt_ids])
    # The file's Q4_K / Q6_K blocks on their exact path multiply activations rounded to int16 with one scale
    # per 256 values (the default, llama.cpp's q8_K, rounds them to int8 per 256: logits moved up to 0.85 on
    # this prompt): logits move up to 8.8e-3 from float32 activations here.
    atol = 1e-2 if gemma3.linear_method == "gguf" else 2e-3
    torch.testing.assert_close(logits, expected, atol=atol, rtol=1e-4)
    got = greedy_generate(model, prompt_ids, 8)
    assert got == hf_greedy(hf_gemma3, prompt_ids, 8)
    assert "France" in gemma3.tokenizer.decode(
        got[0]
    )  # a base model: " the capital of the country of France."


def test_llm_generate_adds_bos_and_matches_hf(hf_gemma3, prompt_ids):
    """A text prompt is encoded the way vLLM does (Gemma's BOS included) and generates HF's tokens."""
    from helpers import assert_all_blocks_free

    from pagedllm import LLM, SamplingParams

    llm = LLM("gemma3-270m", kv_cache_memory="32MiB", max_model_len=1024)
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0))[0]
    assert out.prompt_token_ids == prompt_ids[0]
    assert out.outputs[0].token_ids == hf_greedy(hf_gemma3, prompt_ids[:1], 8)[0]
    assert "France" in out.outputs[0].text
    assert_all_blocks_free(llm)


def _readme_prompts(tokenizer, lengths: tuple[int, ...]) -> list[list[int]]:
    """Prompts of these lengths (BOS first) cut from different places of the README: varied English and
    code, so the sliding layers' window matters (a repeated text could be continued from any window)."""
    from pathlib import Path

    ids = tokenizer.encode((Path(__file__).parents[1] / "README.md").read_text())
    assert len(ids) > sum(lengths), "the README is too short for these prompts"
    prompts, start = [], 1
    for n in lengths:
        prompts.append(ids[:1] + ids[start : start + n - 1])
        start += n
    return prompts


def _engine_greedy(
    prompts: list[list[int]], hybrid: bool, max_tokens: int, kv_cache_memory: str
) -> tuple[list[list[int]], int]:
    """Greedy tokens of the float32 engine, prompts prefilled in 512-token chunks (so later chunks and
    every decode read tables whose early sliding-window entries were given back), and the most KV bytes
    a decode step found in use."""
    from helpers import assert_all_blocks_free

    from pagedllm import LLM, SamplingParams

    llm = LLM(
        "gemma3-270m",
        quantization=None,
        kv_cache_memory=kv_cache_memory,
        max_model_len=4200,
        max_num_batched_tokens=512,
        disable_hybrid_kv_cache_manager=not hybrid,
    )
    assert llm.engine.kv_groups.num_groups == (6 if hybrid else 1)
    engine, used = llm.engine, [0]

    def measure(trace) -> None:  # decode steps only: each holds more than the last
        if trace.prefill_tokens == 0:
            used.append(engine.num_kv_blocks - engine.stats().kv_usage.free_slots // engine.config.block_size)

    engine.add_step_observer(measure)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert_all_blocks_free(llm)
    used_bytes = max(used) * engine.kv_cache_bytes // engine.num_kv_blocks
    return [out.outputs[0].token_ids for out in outs], used_bytes


def _check_hybrid_equals_hf_and_full_history(
    hf_gemma3, lengths: tuple[int, ...], kv_cache_memory: str
) -> None:
    """`kv_cache_memory` fits every prompt at once with full history (else the hybrid cache, running more of
    them at a time, may hold more bytes at its busiest decode step)."""
    prompts = _readme_prompts(load_model("gemma3-270m").tokenizer, lengths)
    hybrid, hybrid_bytes = _engine_greedy(prompts, True, 64, kv_cache_memory)
    full, full_bytes = _engine_greedy(prompts, False, 64, kv_cache_memory)
    assert hybrid == full
    assert hybrid == [hf_greedy(hf_gemma3, [p], 64)[0] for p in prompts]
    # While decoding, the 15 sliding layers hold only their window: here about half of the KV bytes.
    assert hybrid_bytes < 0.55 * full_bytes


def test_hybrid_kv_cache_greedy_equals_hf_and_full_history_beyond_the_window(hf_gemma3):
    """Sliding layers that hold only their window give the same 64 greedy tokens as transformers and as
    the engine keeping every layer's full history, for prompts of 600 and 1,900 tokens (window 512)."""
    _check_hybrid_equals_hf_and_full_history(hf_gemma3, (600, 1900), "256MiB")


@pytest.mark.manual
def test_hybrid_kv_cache_greedy_equals_hf_and_full_history_on_long_prompts(hf_gemma3):
    _check_hybrid_equals_hf_and_full_history(hf_gemma3, (1000, 2600, 4000), "384MiB")
