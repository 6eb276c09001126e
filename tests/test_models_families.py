"""Each model family against Hugging Face transformers on a tiny random checkpoint (fp32).

The checkpoint is written by transformers (save_pretrained, safetensors) and loaded by pagedllm's loader,
so the loader, the fused-weight mapping and the forward are all under test.
"""

from __future__ import annotations

import random

import pytest
import torch
from models_helpers import PagedCache, forward_chunks, greedy_generate, hf_greedy, hf_logits
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)

from pagedllm.models import load_model
from pagedllm.ops import cpu

COMMON = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=50000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)
FAMILIES = {
    "llama": lambda: LlamaConfig(**COMMON, rope_parameters=LLAMA3_ROPE),
    "llama-linear-tied": lambda: LlamaConfig(
        **COMMON,
        tie_word_embeddings=True,
        rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=1e4),
    ),
    "qwen2": lambda: Qwen2Config(**COMMON),
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=7),
    "gemma3": lambda: Gemma3TextConfig(
        **{**COMMON, "num_key_value_heads": 1, "num_hidden_layers": 4},
        head_dim=32,
        sliding_window=9,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=24,
        final_logit_softcapping=5.0,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        },
    ),
}
PROMPT_LENS = [1, 5, 16, 17, 40]


def randomize(model: torch.nn.Module) -> None:
    """Weights large enough for peaked logits; norms and biases away from their trivial init."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.add_(noise * 0.1) if "norm" in name else param.copy_(noise * 0.15)


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, tmp_path_factory):
    """(HF model, pagedllm model) sharing one tiny random checkpoint."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(FAMILIES[request.param](), dtype=torch.float32)
    randomize(hf)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return hf.eval(), load_model(str(folder)).model


def prompts(lens: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lens]


@pytest.mark.parametrize("isa", cpu.supported_isas() or [None])
@pytest.mark.parametrize("block_size", [16, 5])
def test_prefill_logits_match_hf(pair, block_size, isa, monkeypatch):
    """On every C++ build this CPU runs (AVX-512 and AVX2 where both run): the whole model equals HF."""
    if isa is not None:
        monkeypatch.setattr(cpu, "selected_isa", lambda: isa)
    hf, model = pair
    batch = prompts(PROMPT_LENS, model.config.vocab_size)
    cache = PagedCache.create(model.config, 64, block_size, seed=block_size)
    logits = forward_chunks(model, cache, [(i, p, 0) for i, p in enumerate(batch)])
    expected = torch.cat([hf_logits(hf, p) for p in batch])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_mixed_prefill_chunks_and_decode_match_hf(pair):
    """Each step mixes first chunks, later chunks over a cached prefix, and single decode tokens."""
    hf, model = pair
    seqs = prompts([23, 30, 9], model.config.vocab_size, seed=1)
    splits = [[10, 1, 1, 11], [4, 20, 6], [1, 1, 7]]  # chunk lengths per sequence, one per step
    cache = PagedCache.create(model.config, 32, 16, seed=3)
    got: list[list[torch.Tensor]] = [[] for _ in seqs]
    done = [0] * len(seqs)
    for step in range(max(len(s) for s in splits)):
        chunks, owners = [], []
        for i, seq in enumerate(seqs):
            if step < len(splits[i]):
                n = splits[i][step]
                chunks.append((i, seq[done[i] : done[i] + n], done[i]))
                owners += [i] * n
                done[i] += n
        logits = forward_chunks(model, cache, chunks)
        for i in range(len(seqs)):
            got[i].append(logits[torch.tensor(owners) == i])
    for i, seq in enumerate(seqs):
        torch.testing.assert_close(torch.cat(got[i]), hf_logits(hf, seq), atol=1e-4, rtol=1e-4)


def test_greedy_32_tokens_match_hf_generate(pair):
    hf, model = pair
    batch = prompts([1, 7, 16, 33, 500], model.config.vocab_size, seed=2)
    expected = hf_greedy(hf, batch, 32)
    assert all(len(out) == 32 for out in expected)
    assert greedy_generate(model, batch, 32, block_size=16) == expected
    # A batch of one: each decode step writes a single token's K/V (a strided [1, Hkv, D] view).
    assert greedy_generate(model, batch[1:2], 32, block_size=16) == expected[1:2]
