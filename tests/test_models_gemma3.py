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

pytestmark = pytest.mark.slow

LONG_TEXT = (
    "The library keeps its oldest maps in a cold room under the east wing. Each map is numbered, "
    "wrapped in paper and stored flat in a wide drawer, and a card in the catalogue says who drew it, "
    "when, and which coast or valley it shows. "
)


@pytest.fixture(scope="module", params=["gguf", None], ids=["gguf-blocks", "float32"])
def gemma3(request):
    """The built-in file's own blocks (the default: Q5_0 / Q8_0 / Q4_K / Q6_K kept), and float32."""
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


def test_prefill_logits_and_greedy_match_hf(gemma3, hf_gemma3, prompt_ids):
    model = gemma3.model
    cache = PagedCache.create(model.config, 64, 16, seed=2)
    logits = forward_chunks(model, cache, [(i, p, 0) for i, p in enumerate(prompt_ids)], tail=4)
    expected = torch.cat([hf_logits(hf_gemma3, p, tail=4) for p in prompt_ids])
    torch.testing.assert_close(logits, expected, atol=2e-3, rtol=1e-4)
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
