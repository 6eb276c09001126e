"""The built-in SmolLM2-135M (GGUF, dequantized by pagedllm) against Hugging Face's own GGUF load.

HF reads the same file with its own dequantizer, Q/K un-permutation and tokenizer conversion, so this
checks pagedllm's GGUF conversion end to end, not just the forward pass.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import smollm2_gguf_path
from models_helpers import PagedCache, forward_chunks, greedy_generate, hf_greedy, hf_logits

from pagedllm.bench.quality import EQUIVALENCE_PROMPTS
from pagedllm.models import load_model, quantization
from pagedllm.ops import native

PROMPTS = EQUIVALENCE_PROMPTS  # bench quality measures greedy agreement on the same prompts


@pytest.fixture(scope="module", params=["gguf", None], ids=["gguf-blocks", "float32"])
def smollm2(request):
    """The built-in file's own Q4_1 / Q8_0 blocks on their exact path (x int16 per 32 values), and float32:
    both must match HF. The default's x per 256 and the exact path's bf16 prefill (CPUs with AVX512_BF16)
    are compared below on their own; here every row count takes the integer and float32 paths."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native, "bf16_matmul_available", lambda: False)
        patch.setenv(quantization.GGUF_ACTIVATIONS_ENV_VAR, "int16")
        quantization.gguf_activations.cache_clear()
        previous = native.set_blocks_int8(False)
        yield load_model("smollm2-135m", quantization=request.param)
        native.set_blocks_int8(previous)
    quantization.gguf_activations.cache_clear()


def _prefill_against_hf(hf_smollm2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the load's prefill logits on PROMPTS, HF's float32 ones, HF's on the same weights in bfloat16)."""
    loaded = load_model("smollm2-135m")
    ids = [loaded.tokenizer.encode(p) for p in PROMPTS]
    cache = PagedCache.create(loaded.model.config, 64, 16, seed=1)
    logits = forward_chunks(loaded.model, cache, [(i, p, 0) for i, p in enumerate(ids)])
    expected = torch.cat([hf_logits(hf_smollm2, p) for p in ids])
    hf_bf16 = copy.deepcopy(hf_smollm2).to(torch.bfloat16)
    return logits, expected, torch.cat([hf_logits(hf_bf16, p) for p in ids])


def test_the_default_prefill_is_far_closer_to_hf_than_hfs_own_bf16(hf_smollm2):
    """The default load: the blocks' integer path at every row count, x int16 per 256 values (their batch
    invariant contract). Oracle: HF's float32 forward, and its bfloat16 one for scale: the logits stay
    within a sixteenth of bf16's largest distance (measured: 0.025 against 1.59) and pick float32's top
    token at least as often."""
    logits, expected, bf16 = _prefill_against_hf(hf_smollm2)
    assert (logits - expected).abs().max() <= (bf16 - expected).abs().max() / 16
    top = expected.argmax(-1)
    assert (logits.argmax(-1) == top).sum() >= (bf16.argmax(-1) == top).sum()


@pytest.mark.skipif(not native.bf16_matmul_available(), reason="the bf16 path needs AVX512_BF16")
def test_bf16_prefill_of_the_blocks_is_as_close_to_hf_as_hfs_own_bf16(hf_smollm2, int16_activations):
    """The exact path on this CPU: a prefill's matmuls dequantize the blocks to bf16 (x, W and each output
    rounded to bf16). Oracle: HF's forward on the same weights in bfloat16. The logits stay within twice
    its largest distance from HF's float32 ones, and pick float32's top token as often, less 3 positions
    of the 96."""
    logits, expected, bf16 = _prefill_against_hf(hf_smollm2)
    assert (logits - expected).abs().max() <= 2 * (bf16 - expected).abs().max()
    top = expected.argmax(-1)
    assert (logits.argmax(-1) == top).sum() >= (bf16.argmax(-1) == top).sum() - 3


@pytest.fixture(scope="module")
def prompt_ids(smollm2):
    return [smollm2.tokenizer.encode(p) for p in PROMPTS]


def test_tokenizer_and_chat_template_match_hf(smollm2):
    from transformers import AutoTokenizer

    path = smollm2_gguf_path()
    hf_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tok = smollm2.tokenizer
    chat = [{"role": "user", "content": "What is paged attention?"}]
    assert [tok.encode(p) for p in PROMPTS] == [hf_tok.encode(p) for p in PROMPTS]
    assert tok.decode(tok.encode(PROMPTS[2])) == PROMPTS[2]
    assert smollm2.chat_template == hf_tok.chat_template is not None
    assert tok.apply_chat_template(chat, add_generation_prompt=True) == hf_tok.apply_chat_template(
        chat, add_generation_prompt=True, return_dict=False
    )
    assert smollm2.eos_token_ids == [hf_tok.eos_token_id] == [tok.convert_tokens_to_ids("<|im_end|>")]


def test_config_matches_hf(smollm2, hf_smollm2):
    cfg, hf_cfg = smollm2.config, hf_smollm2.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        hf_cfg.num_hidden_layers,
        hf_cfg.hidden_size,
        hf_cfg.num_attention_heads,
        hf_cfg.num_key_value_heads,
        hf_cfg.head_dim,
    )
    assert cfg.rope_theta == hf_cfg.rope_parameters["rope_theta"]
    assert cfg.tie_word_embeddings and hf_cfg.tie_word_embeddings


def test_prefill_logits_match_hf(smollm2, hf_smollm2, prompt_ids):
    model = smollm2.model
    cache = PagedCache.create(model.config, 64, 16, seed=1)
    logits = forward_chunks(model, cache, [(i, p, 0) for i, p in enumerate(prompt_ids)])
    expected = torch.cat([hf_logits(hf_smollm2, p) for p in prompt_ids])
    torch.testing.assert_close(logits, expected, atol=2e-3, rtol=1e-4)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_greedy_batch_matches_hf_generate(smollm2, hf_smollm2, prompt_ids):
    expected = hf_greedy(hf_smollm2, prompt_ids, 32)
    got = greedy_generate(smollm2.model, prompt_ids, 32, block_size=16)
    assert got == expected
    assert " Paris" in smollm2.tokenizer.decode(got[0])
