"""The engine on a tiny random Gemma 3 (4 sliding-window layers of window 24, 2 full; block size 4):
sliding layers holding only their window give the tokens of the full-history engine
(disable_hybrid_kv_cache_manager) through chunked prefill, prefix caching, forks, beam search and both
kinds of preemption, and every block comes back."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import assert_all_blocks_free
from test_models_families import randomize

from pagedllm import LLM, BeamSearchParams, SamplingParams

LAYERS = ["sliding_attention", "sliding_attention", "full_attention"] * 2
SHARED = [random.Random(5).randrange(384) for _ in range(48)]  # a prefix twice the window
PROMPTS = [SHARED + [random.Random(i).randrange(384) for _ in range(n)] for i, n in enumerate((3, 20, 41))]
PROMPTS += [[random.Random(10 + i).randrange(384) for _ in range(n)] for i, n in enumerate((30, 57, 90))]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=len(LAYERS),
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=1024,
        sliding_window=24,
        layer_types=LAYERS,
        query_pre_attn_scalar=32,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model)
    folder = tmp_path_factory.mktemp("tiny-gemma3")
    model.save_pretrained(folder)
    return str(folder)


def _llm(model: str, hybrid: bool = True, **kwargs) -> LLM:
    settings = dict(block_size=4, max_model_len=256, max_num_batched_tokens=32, num_kv_blocks=2000)
    llm = LLM(model, disable_hybrid_kv_cache_manager=not hybrid, **{**settings, **kwargs})
    assert llm.engine.kv_groups.num_groups == (3 if hybrid else 1)  # full, two windows of 2 layers
    return llm


def _tokens(llm: LLM, params, prompts=PROMPTS) -> list[list[list[int]]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert_all_blocks_free(llm)
    return [[c.token_ids for c in out.outputs] for out in outputs]


@pytest.fixture(scope="module")
def full_history(tiny_gemma3):
    """The full-history engine's greedy tokens (no preemption: room for everything)."""
    llm = _llm(tiny_gemma3, hybrid=False)
    tokens = _tokens(llm, GREEDY)
    assert llm.engine.stats().num_preemptions == 0
    return tokens


def test_chunked_prefill_and_prefix_hits_give_the_full_history_tokens(tiny_gemma3, full_history):
    llm = _llm(tiny_gemma3)
    assert _tokens(llm, GREEDY) == full_history
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions == 0  # the shared prefix's last window
    llm = _llm(tiny_gemma3, enable_prefix_caching=False, enable_chunked_prefill=False)
    assert _tokens(llm, GREEDY) == full_history


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_gives_the_full_history_tokens(tiny_gemma3, full_history, mode):
    llm = _llm(tiny_gemma3, num_kv_blocks=150, preemption_mode=mode, enable_prefix_caching=False)
    assert _tokens(llm, GREEDY) == full_history
    assert llm.engine.stats().num_preemptions > 0


def test_forks_and_beams_give_the_full_history_tokens(tiny_gemma3):
    sampled = SamplingParams(n=3, max_tokens=20, temperature=1.0, seed=3, ignore_eos=True)
    assert _tokens(_llm(tiny_gemma3), sampled) == _tokens(_llm(tiny_gemma3, hybrid=False), sampled)
    beams = BeamSearchParams(beam_width=3, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[2:4]]
    got = []
    for hybrid in (True, False):
        llm = _llm(tiny_gemma3, hybrid=hybrid)
        got.append([[s.tokens for s in out.sequences] for out in llm.beam_search(prompts, beams)])
        assert_all_blocks_free(llm)
    assert got[0] == got[1]


def test_the_window_groups_hold_far_less_than_full_history(tiny_gemma3):
    """Decoding six 90-token prompts: each sliding layer holds its window's 7 or 8 blocks of 4 tokens, not
    all 25 (the full layers hold every one): about half the KV bytes."""
    prompts = [[random.Random(20 + i).randrange(384) for _ in range(90)] for i in range(6)]
    used = {}
    for hybrid in (True, False):
        llm = _llm(tiny_gemma3, hybrid=hybrid)
        most = _decode_kv_bytes(llm)
        _tokens(llm, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), prompts)
        used[hybrid] = max(most)
    assert used[True] < 0.6 * used[False]


def _decode_kv_bytes(llm: LLM) -> list[int]:
    """A list that gets the KV bytes in use after each decode step of the engine (each holds more)."""
    engine, most = llm.engine, [0]

    def measure(trace) -> None:
        if trace.prefill_tokens == 0:
            free = engine.stats().kv_usage.free_slots // engine.config.block_size
            most.append((engine.num_kv_blocks - free) * engine.kv_cache_bytes // engine.num_kv_blocks)

    engine.add_step_observer(measure)
    return most


def test_gemma2_alternating_windows_use_the_groups_and_match_hf_beyond_the_window(tmp_path):
    """Gemma 2 (sliding and full layers alternating, attention logits soft-capped): the same KV groups
    (a full group and a window group of 2 layers each), the window's blocks given back while it decodes,
    and greedy tokens equal to transformers' and to the full-history engine's, prompts 3-8x the window
    computed in chunks of 16."""
    from models_helpers import hf_greedy
    from transformers import AutoModelForCausalLM, Gemma2Config

    config = Gemma2Config(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        sliding_window=9,
        layer_types=["sliding_attention", "full_attention"] * 2,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=1.5,
        final_logit_softcapping=5.0,
    )
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(hf)
    hf.save_pretrained(tmp_path)
    prompts = [[random.Random(30 + i).randrange(384) for _ in range(n)] for i, n in enumerate((27, 40, 72))]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    got, held = {}, {}
    for hybrid in (True, False):
        llm = LLM(
            str(tmp_path),
            block_size=4,
            max_num_batched_tokens=16,
            num_kv_blocks=400,
            disable_hybrid_kv_cache_manager=not hybrid,
        )
        assert llm.engine.kv_groups.windows == ((None, 9) if hybrid else (None,))
        most = _decode_kv_bytes(llm)
        got[hybrid], held[hybrid] = [t[0] for t in _tokens(llm, params, prompts)], max(most)
    assert got[True] == got[False] == hf_greedy(hf, prompts, 16)
    assert held[True] < 0.7 * held[False]  # the sliding half of the layers holds 3-4 blocks, not up to 22
