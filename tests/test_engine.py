"""Scheduler behaviour on the real model: preemption, prefix caching, parallel sampling, stopping, errors."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import agreed_greedy_tokens, assert_all_blocks_free, batch_invariant_llm

from pagedllm import LLM, SamplingParams
from pagedllm.engine.config import EngineConfig

PROMPTS = [
    f"Write a short story about a {thing}."
    for thing in ("cat", "dog", "robot", "dragon", "teacher", "river", "cloud", "mountain")
]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
GREEDY_LOGPROBS = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def reference_outputs():
    """The same batch, on the same storage (the file's blocks, their bf16 path off), with a cache big enough
    that nothing is preempted."""
    llm = batch_invariant_llm("smollm2-135m", max_model_len=512)
    outputs = llm.generate(PROMPTS, GREEDY_LOGPROBS)
    assert llm.engine.stats().num_preemptions == 0
    assert_all_blocks_free(llm)
    return outputs


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_gives_the_same_tokens_as_no_preemption(mode, reference_outputs):
    """8 sequences of ~50 tokens need ~32 blocks of 16; 12 blocks force preemption. The same greedy tokens
    up to near-ties (agreed_greedy_tokens at 0.1 nats): steps then hold fewer rows, or a recompute's
    prefill many, which another kernel path sums in another order (0.001 nats apart on an AVX2 build)."""
    llm = batch_invariant_llm("smollm2-135m", num_kv_blocks=12, max_model_len=512, preemption_mode=mode)
    outputs = llm.generate(PROMPTS, GREEDY_LOGPROBS)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert agreed_greedy_tokens(reference_outputs, outputs, 0.1) >= len(PROMPTS) * 40 // 2
    if mode == "swap":  # blocks really went to the host pool and every one came back
        assert stats.num_blocks_swapped_out > 0
        assert stats.num_blocks_swapped_in == stats.num_blocks_swapped_out
    else:
        assert stats.num_blocks_swapped_out == stats.num_blocks_swapped_in == 0
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_sequence_outgrowing_the_whole_cache_ends_with_length(mode):
    """4 blocks of 16 hold 64 tokens: a lone 40-token prompt asking for 50 more stops at the cache's end.

    The KV of positions 0-63 fits; the token sampled from position 63's KV is the last one: 64 - 40 + 1.
    """
    llm = LLM("smollm2-135m", num_kv_blocks=4, block_size=16, max_model_len=512, preemption_mode=mode)
    out = llm.generate([list(range(100, 140))], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    completion = out[0].outputs[0]
    assert completion.finish_reason == "length"
    assert len(completion.token_ids) == 4 * 16 - 40 + 1
    assert_all_blocks_free(llm)


def test_a_prompt_larger_than_the_whole_cache_is_refused_naming_both_sizes():
    """4 blocks of 16 hold 64 tokens: an 80-token prompt could never be prefilled, so add_request says so
    (it used to wait, then end "length" with no token); a 64-token one still runs."""
    llm = LLM("smollm2-135m", num_kv_blocks=4, block_size=16, max_model_len=512)
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    too_big = r"prompt has 80 tokens, whose KV needs 5 blocks; the KV cache holds 4 blocks in all"
    with pytest.raises(ValueError, match=too_big + r" \(num_kv_blocks=4\)"):
        llm.generate([list(range(100, 180))], greedy)
    assert llm.engine.requests == {}
    assert len(llm.generate([list(range(100, 164))], greedy)[0].outputs[0].token_ids) == 1
    assert_all_blocks_free(llm)


def test_prefix_caching_is_on_by_default_and_keeps_outputs():
    system = "You are a helpful assistant who writes vivid, concise stories for children of all ages. " * 4
    prompts = [
        system + p for p in PROMPTS
    ]  # a shared prefix of several full blocks (72 tokens, blocks of 32)
    no_cache = LLM("smollm2-135m", kv_cache_memory="64MiB", max_model_len=512, enable_prefix_caching=False)
    uncached = no_cache.generate(prompts, GREEDY)
    assert all(o.num_cached_tokens == 0 for o in uncached)
    assert no_cache.engine.stats().prefix_cache_queries == 0  # no cache, nothing looked up
    llm = LLM("smollm2-135m", kv_cache_memory="64MiB", max_model_len=512)
    assert llm.engine.config.enable_prefix_caching
    first = llm.generate(prompts[:1], GREEDY)[0]
    assert first.num_cached_tokens == 0
    second = llm.generate(prompts, GREEDY)
    block = llm.engine.config.block_size
    full_blocks = (len(second[0].prompt_token_ids) - 1) // block * block
    assert second[0].num_cached_tokens == full_blocks  # the whole prompt but its last partial block
    assert all(o.num_cached_tokens >= block for o in second[1:])  # the shared system prompt
    assert [o.outputs[0].token_ids for o in second] == [o.outputs[0].token_ids for o in uncached]
    stats = llm.engine.stats()
    assert stats.prefix_cache_queries == sum(len(o.prompt_token_ids) for o in [first, *second])
    assert stats.prefix_cache_hits == sum(o.num_cached_tokens for o in second)
    assert_all_blocks_free(no_cache)
    assert_all_blocks_free(llm)


def test_contiguous_layout_parallel_sampling_copies_the_prompt(smollm2_llm):
    """A contiguous fork copies the prompt's KV into the child's slab: children match paged ones."""
    params = SamplingParams(n=3, max_tokens=16, temperature=0.8, seed=3, ignore_eos=True)
    paged = smollm2_llm.generate(PROMPTS[0], params)[0]
    llm = LLM(
        "smollm2-135m",
        kv_layout="contiguous",
        contiguous_reserve="pow2",
        kv_cache_memory="32MiB",
        max_model_len=512,
    )
    contiguous = llm.generate(PROMPTS[0], params)[0]
    assert [c.token_ids for c in contiguous.outputs] == [c.token_ids for c in paged.outputs]
    assert_all_blocks_free(llm)
    assert_all_blocks_free(smollm2_llm)


def test_a_contiguous_fork_that_finds_no_slab_waits_and_is_prefilled_later(smollm2_llm):
    """8 MiB holds one 128-slot slab: the second sample's fork cannot copy the slab, so the child waits
    and is prefilled with the prompt and its first token once the first sample's slab is free."""
    llm = LLM("smollm2-135m", kv_layout="contiguous", kv_cache_memory="8MiB", max_model_len=128)
    params = SamplingParams(n=2, max_tokens=20, temperature=0.0, ignore_eos=True)
    out = llm.generate(PROMPTS[0], params)[0]
    alone = smollm2_llm.generate(PROMPTS[0], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    assert [c.token_ids for c in out.outputs] == [alone[0].outputs[0].token_ids] * 2
    assert_all_blocks_free(llm)
    assert_all_blocks_free(smollm2_llm)


def test_parallel_sampling_forks_and_is_reproducible(smollm2_llm):
    params = SamplingParams(n=4, max_tokens=24, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    first = smollm2_llm.generate(PROMPTS[0], params)[0]
    again = smollm2_llm.generate(PROMPTS[0], params)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 24 for c in first.outputs)
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1  # the samples differ from each other
    assert_all_blocks_free(smollm2_llm)


def test_forked_sequences_share_prompt_blocks_copy_on_write(smollm2_llm):
    engine, block = smollm2_llm.engine, smollm2_llm.engine.config.block_size
    prompt = " ".join([PROMPTS[1]] * 5)
    params = SamplingParams(n=3, max_tokens=5, temperature=0.8, seed=1, ignore_eos=True)
    engine.add_request("fork", prompt, params)
    (out,) = engine.step()  # prefill, fork, and each sample's first token
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 1 for c in out.outputs)
    full = len(out.prompt_token_ids) // block * block
    assert full >= 2 * block
    # The three hold the prompt's full blocks once; its partial last block was copied for each child's token.
    assert engine.stats().kv_usage.shared_saved_slots == 2 * full
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(smollm2_llm)


def test_stop_conditions(smollm2_llm):
    tok = smollm2_llm.get_tokenizer()
    greedy = smollm2_llm.generate("The capital of France is", SamplingParams(max_tokens=20, temperature=0))
    text = greedy[0].outputs[0].text
    word = text.split()[1]  # a word the model will produce
    by_string = smollm2_llm.generate(
        "The capital of France is", SamplingParams(max_tokens=20, temperature=0, stop=[word])
    )[0].outputs[0]
    assert by_string.finish_reason == "stop" and by_string.stop_reason == word
    assert by_string.text == text[: text.index(word)]
    first_token = greedy[0].outputs[0].token_ids[2]
    by_token = smollm2_llm.generate(
        "The capital of France is", SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[first_token])
    )[0].outputs[0]
    assert by_token.finish_reason == "stop" and by_token.stop_reason == first_token
    greedy_ids = greedy[0].outputs[0].token_ids
    assert by_token.token_ids == greedy_ids[: greedy_ids.index(first_token) + 1]
    # The chat model ends its answer with EOS, which stays in token_ids but not in the text.
    chat = smollm2_llm.chat(
        [{"role": "user", "content": "Say hi."}], SamplingParams(max_tokens=200, temperature=0)
    )
    assert chat[0].outputs[0].finish_reason == "stop"
    assert chat[0].outputs[0].token_ids[-1] in smollm2_llm.engine.eos_token_ids
    assert tok.decode(chat[0].outputs[0].token_ids[-1:]) not in chat[0].outputs[0].text
    assert_all_blocks_free(smollm2_llm)


def test_min_tokens_bans_eos_and_stop_tokens_until_reached(smollm2_llm):
    """Where the free greedy run ends with EOS (or would hit a stop token), a run with min_tokens picks
    the best token that is not banned there, read from the free run's own logprobs."""
    chat = [{"role": "user", "content": "Say hi."}]
    free = smollm2_llm.chat(chat, SamplingParams(max_tokens=60, temperature=0, logprobs=5))[0].outputs[0]
    eos = set(smollm2_llm.engine.eos_token_ids)
    end = len(free.token_ids) - 1
    assert free.finish_reason == "stop" and free.token_ids[end] in eos

    def best_allowed(position: int, banned: set[int]) -> int:
        return max((t for t in free.logprobs[position] if t not in banned), key=free.logprobs[position].get)

    held = smollm2_llm.chat(chat, SamplingParams(max_tokens=60, temperature=0, min_tokens=end + 3))
    tokens = held[0].outputs[0].token_ids
    assert tokens[:end] == free.token_ids[:end]
    assert tokens[end] == best_allowed(end, eos)
    assert len(tokens) >= end + 3 and not eos & set(tokens[: end + 3])

    stop_token = free.token_ids[1]
    params = SamplingParams(max_tokens=4, temperature=0, min_tokens=3, stop_token_ids=[stop_token])
    tokens = smollm2_llm.chat(chat, params)[0].outputs[0].token_ids
    assert tokens[:2] == [free.token_ids[0], best_allowed(1, eos | {stop_token})]
    assert stop_token not in tokens[:3]
    assert_all_blocks_free(smollm2_llm)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ("", SamplingParams(), "empty"),
        ([1, 2, 10**9], SamplingParams(), "1000000000"),
        ([1] * 5000, SamplingParams(), "5000 tokens"),
    ],
)
def test_bad_prompts_are_rejected_without_leaking(smollm2_llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        smollm2_llm.generate(["fine prompt", prompt], params)
    assert_all_blocks_free(smollm2_llm)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"top_k": -5}, "top_k"),
    ],
)
def test_bad_sampling_params_name_the_value(kwargs, name):
    with pytest.raises(ValueError, match=f"{name} .*{list(kwargs.values())[0]}"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(("watermark", "first_step"), [(0.0, ["a", "b"]), (0.4, ["a"])])
def test_watermark_is_an_engine_setting(watermark, first_step):
    """12 blocks of 16, two 4-block prompts: after the first, 8 are free; admitting the second leaves 4,
    below a 40% watermark (4.8 blocks), so it waits until the first finishes."""
    llm = LLM("smollm2-135m", num_kv_blocks=12, block_size=16, max_model_len=512, watermark=watermark)
    engine = llm.engine
    for name in ("a", "b"):
        engine.add_request(name, list(range(1, 60)), SamplingParams(max_tokens=2, ignore_eos=True))
    assert [out.request_id for out in engine.step()] == first_step  # those admitted got a token
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(llm)


def test_bad_watermark_is_rejected_by_value():
    with pytest.raises(ValueError, match="watermark .*1.5"):
        EngineConfig(watermark=1.5)


def test_a_float32_cache_under_bfloat16_activations_is_refused_by_value():
    with pytest.raises(ValueError, match="kv_cache_dtype='float32' with dtype='bfloat16'"):
        EngineConfig(dtype="bfloat16", kv_cache_dtype="float32")
    assert EngineConfig(dtype="float32", kv_cache_dtype="bfloat16").kv_torch_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype='float16' with dtype='bfloat16'"):
        EngineConfig(dtype="bfloat16", kv_cache_dtype="float16")
    half = EngineConfig(dtype="float32", kv_cache_dtype="float16")
    assert half.kv_torch_dtype == torch.float16 and half.block_size == 32  # float32's 16 tokens' bytes


def test_a_float16_cache_gives_the_float32_caches_tokens_in_half_its_bytes(int16_activations):
    """llama.cpp's default cache: K/V rounded to float16 (10 mantissa bits) under float32 activations. On
    the GGUF blocks' exact path (int16 x, their bf16 path off) SmolLM2's greedy tokens follow the float32
    cache's, their log-probabilities within 0.01 (0.003 measured on Zen 3 and Zen 4), a token moving only
    where the float32 cache's top two were that close (one prompt in 8, at a tie of 0.00015: docs/JOURNAL.md
    session 23); its blocks hold 32 tokens in float32's 16 bytes. (Where the CPU multiplies bf16, the
    default's bf16 path for the 8 prompts' prefill rounds x to bf16 at every layer, which turns the float16
    rounding's last bits into whole bf16 steps: 0.06 apart on Zen 4, session 27.)"""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    outputs, token_bytes = {}, {}
    for kv in ("float32", "float16"):
        llm = batch_invariant_llm(
            "smollm2-135m", kv_cache_dtype=kv, kv_cache_memory="32MiB", max_model_len=256
        )
        outputs[kv] = llm.generate(PROMPTS, params)
        token_bytes[kv] = llm.engine.run_info().kv_token_bytes
        assert_all_blocks_free(llm)
    assert agreed_greedy_tokens(outputs["float32"], outputs["float16"], 0.01) >= len(PROMPTS) * 24 * 3 // 4
    assert token_bytes["float32"] == 2 * token_bytes["float16"] == 2 * 30 * 3 * 64 * 4


def test_abort_frees_blocks(smollm2_llm):
    engine = smollm2_llm.engine
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=50))
    engine.add_request("b", PROMPTS[1], SamplingParams(max_tokens=50))
    engine.step()
    engine.step()
    engine.abort_request("a")
    engine.abort_request("b")
    assert_all_blocks_free(smollm2_llm)


def test_memory_budget_gives_the_kv_cache_what_the_weights_leave(caplog):
    """At one total budget, the GGUF's own 4-bit blocks leave more KV blocks than float32 weights; both
    are reported at start-up."""
    budget = 768 * 2**20
    block_bytes = 2 * 30 * 3 * 64 * 2 * 32  # SmolLM2, float16 KV (the CPU's default), blocks of 32
    blocks = {}
    for quantization in ("gguf", None):
        with caplog.at_level(logging.INFO, logger="pagedllm"):
            llm = LLM("smollm2-135m", memory_budget="768MiB", quantization=quantization, max_model_len=256)
        engine = llm.engine
        assert engine.num_kv_blocks == (budget - engine.weight_bytes) // block_bytes
        assert (
            f"weights {engine.weight_bytes / 2**20:.1f} MiB ({engine.loaded_model.linear_method})"
            in caplog.text
        )
        assert f"{engine.num_kv_blocks} blocks of 32 tokens" in caplog.text
        out = llm.generate("The capital of France is", SamplingParams(max_tokens=4, temperature=0))[0]
        assert out.outputs[0].text.startswith(" Paris")
        assert_all_blocks_free(llm)
        blocks[quantization] = engine.num_kv_blocks
    assert blocks["gguf"] > blocks[None] + 500  # >= 420 MiB of float32 weights not held: >= 570 more blocks


def test_memory_budget_smaller_than_the_weights_is_refused():
    # float32 weights: 513 MiB, 621 MiB where oneDNN's packed LM head keeps its plain rows for the embedding
    with pytest.raises(ValueError, match=r"memory_budget='256MiB' .* the weights take (513|621)\.\d MiB"):
        LLM("smollm2-135m", memory_budget="256MiB", quantization=None)
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM("smollm2-135m", quantization="int3")
    with pytest.raises(ValueError, match="memory_budget must be a size"):
        LLM("smollm2-135m", memory_budget="lots")
