"""Batch invariance of GGUF blocks with PAGEDLLM_GGUF_PATHS=invariant (models/quantization.py gguf_paths): a
row's output bits do not depend on the rows beside it.

Kernel level: with the invariant gate on (what the model runner sets for every step), each block type's
row is the same, bit for bit, in a call of 1, 7, 64 or 200 rows, on every instruction-set build this CPU
runs, and within its integer rounding of x of the gguf package's dequantized weight. Without it
(PAGEDLLM_GGUF_PATHS=fast: bf16 / AMX panels, float32 panels) the same rows differ, which the gate exists
for.

Engine level: SmolLM2 (Q4_1 blocks, a Q8_0 LM head) with its default storage, invariant paths, greedy: a
request alone, in a batch of many, and after swap and recompute preemption gets the same tokens, a
difference allowed only where the reference's top two log-probabilities are within NEAR_TIE (the
attention's prefill and decode kernels may still sum a context in another order).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from helpers import assert_all_blocks_free
from models_helpers import GGUF_TYPES, random_blocks
from ops_helpers import INT8, INT16, int_blocks

from pagedllm import LLM, SamplingParams
from pagedllm.models import quantization
from pagedllm.ops import native

pytestmark = pytest.mark.skipif(not native.supported_isas(), reason="the CPU kernels need AVX2")

ROWS = (1, 7, 64, 200)
# columns: K types three super-blocks; the 32-value types Qwen2.5-0.5B's width (a last chunk of 4 blocks)
# and 9,216 (36 chunks: several kSpanChunks spans, walked whole at 1 row and in spans at more)
COLS = {"K": (768, 9216), "small": (896, 9216)}
# group_size 10 asks for the bf16 path from 10 rows (AMX's), which the gate must override
GROUP_SIZES = (0, 10)


def blocks(name: str, cols: int, rows: int = 40) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bytes, layout, float64 W) of random blocks of one type."""
    part = random_blocks(GGMLQuantizationType[name], rows, cols, seed=cols)
    data = torch.from_numpy(part.raw.reshape(-1))
    layout = torch.tensor([[part.raw.shape[0], int(part.qtype)]])
    return data, layout, torch.from_numpy(dequantize(part.raw, part.qtype)).double()


def activations(rows: int, cols: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(cols)
    scale = torch.logspace(-2, 2, cols)[torch.randperm(cols, generator=gen)]  # blocks of mixed size
    return torch.randn(rows, cols, generator=gen) * scale


@pytest.fixture
def invariant(kernels):
    """The kernels with this thread's invariant gate on, restored after."""
    previous = kernels.set_blocks_invariant(True)
    yield kernels
    assert kernels.set_blocks_invariant(previous) is True


def _cases():
    for name in GGUF_TYPES:
        for cols in COLS["K" if name.endswith("_K") else "small"]:
            yield name, cols


@pytest.mark.parametrize("name,cols", list(_cases()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_are_the_same_in_a_call_of_any_rows(invariant, name, cols, dtype):
    data, layout, w = blocks(name, cols)
    x = activations(max(ROWS), cols).to(dtype)
    for group_size in GROUP_SIZES:
        first, last = {}, {}
        for rows in ROWS:
            first[rows] = invariant.linear(x[:rows], data, layout, None, group_size, None, None)[0]
            last[rows] = invariant.linear(x[-rows:], data, layout, None, group_size, None, None)[-1]
        for rows in ROWS[1:]:
            assert torch.equal(first[rows], first[1]), (name, cols, group_size, rows, "first row")
            assert torch.equal(last[rows], last[1]), (name, cols, group_size, rows, "last row")
    # and the integer path's product: x rounded per row in integer blocks (the K types' int8 by default, the
    # 32-value types' int16 per 256, Q5_K's int16 per 32), times the file's values
    k_type = name in {"Q4_K", "Q6_K"}
    out = invariant.linear(x, data, layout, None, 0, None, None)
    want = int_blocks(x.float(), 32 if name == "Q5_K" else 256, INT8 if k_type else INT16).double() @ w.T
    atol = 2e-6 * (x.double().abs() @ w.abs().T).max().item() + 1e-6
    if dtype == torch.bfloat16:  # the output rounded to bf16
        atol += 2**-8 * want.abs().max().item()
    torch.testing.assert_close(out.double(), want, atol=atol, rtol=0)


@pytest.mark.parametrize("types", [("Q5_0", "Q5_0", "Q8_0"), ("Q4_K", "Q4_K", "Q6_K")], ids="-".join)
def test_mixed_shards_with_bias_and_residual_in_a_call_of_any_rows(invariant, types):
    """Qwen2.5-Coder's fused q/k/v (0.5B and 1.5B's types), bias and residual added in the epilogue."""
    cols = 896 if types[0] == "Q5_0" else 512
    rows_each = (40, 8, 8)
    parts = [random_blocks(GGMLQuantizationType[t], rows_each[i], cols, seed=i) for i, t in enumerate(types)]
    data = torch.from_numpy(np.concatenate([p.raw.reshape(-1) for p in parts]))
    layout = torch.tensor([[p.raw.shape[0], int(p.qtype)] for p in parts])
    x, bias, residual = activations(max(ROWS), cols), torch.randn(56), torch.randn(max(ROWS), 56)
    alone = invariant.linear(x[:1], data, layout, None, 10, bias, residual[:1])
    for rows in ROWS[1:]:
        out = invariant.linear(x[:rows], data, layout, None, 10, bias, residual[:rows])
        assert torch.equal(out[:1], alone), (types, rows)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_K"])
def test_the_fast_paths_round_a_row_by_the_batch(kernels, name):
    """Without the gate (PAGEDLLM_GGUF_PATHS=fast), 200 rows from group_size 10 take the bf16 path, whose
    sums for row 0 differ from its sums alone: the variance the invariant paths remove."""
    data, layout, _ = blocks(name, 768)
    x = activations(200, 768)
    assert kernels.set_blocks_invariant(False) is False
    alone = kernels.linear(x[:1], data, layout, None, 10, None, None)
    assert not torch.equal(kernels.linear(x, data, layout, None, 10, None, None)[:1], alone)


def test_the_paths_setting_is_checked(monkeypatch):
    monkeypatch.setenv(quantization.GGUF_PATHS_ENV_VAR, "fastest")
    quantization.gguf_paths.cache_clear()
    with pytest.raises(ValueError, match="PAGEDLLM_GGUF_PATHS='fastest' is not one of"):
        quantization.gguf_paths()
    monkeypatch.delenv(quantization.GGUF_PATHS_ENV_VAR)
    quantization.gguf_paths.cache_clear()
    assert quantization.gguf_paths() == "fast"  # the default
    monkeypatch.setenv(quantization.GGUF_PATHS_ENV_VAR, "invariant")  # as the module's fixture left it
    quantization.gguf_paths.cache_clear()
    assert not quantization.takes_bf16(computes_prompt=True, max_query_len=200)


def test_int16_activations_are_applied_where_no_many_row_path_needs_the_gate(monkeypatch):
    """On a CPU without bf16 matmuls no GGUF layer has a many-row path to gate with int8 x (the AVX2 builds
    included: their K types' float panels are taken with int16 x only), yet PAGEDLLM_GGUF_ACTIVATIONS=int16
    must still reach the kernels each step (through bf16_gate)."""
    from pagedllm.models.loader import load_model

    monkeypatch.setattr(quantization.native, "bf16_matmul_available", lambda: False)
    monkeypatch.setenv(quantization.GGUF_PATHS_ENV_VAR, "fast")
    quantization.gguf_paths.cache_clear()
    model = load_model("smollm2-135m").model
    try:
        monkeypatch.setenv(quantization.GGUF_ACTIVATIONS_ENV_VAR, "int8")
        quantization.gguf_activations.cache_clear()
        assert not quantization.gates_many_rows(model)  # nothing to gate: no call per step
        monkeypatch.setenv(quantization.GGUF_ACTIVATIONS_ENV_VAR, "int16")
        quantization.gguf_activations.cache_clear()
        assert quantization.gates_many_rows(model)
    finally:
        monkeypatch.setenv(quantization.GGUF_PATHS_ENV_VAR, "invariant")  # as the module's fixture left it
        quantization.gguf_paths.cache_clear()
        monkeypatch.delenv(quantization.GGUF_ACTIVATIONS_ENV_VAR)
        quantization.gguf_activations.cache_clear()


def test_the_activations_setting_is_checked_and_names_the_rounding(monkeypatch):
    monkeypatch.setenv(quantization.GGUF_ACTIVATIONS_ENV_VAR, "int4")
    quantization.gguf_activations.cache_clear()
    try:
        with pytest.raises(ValueError, match="PAGEDLLM_GGUF_ACTIVATIONS='int4' is not one of"):
            quantization.gguf_activations()
        monkeypatch.setenv(quantization.GGUF_ACTIVATIONS_ENV_VAR, "INT16")
        quantization.gguf_activations.cache_clear()
        assert quantization.gguf_activations() == "int16"
        assert "x as int16 per 256" in quantization.gguf_kernels()
        monkeypatch.delenv(quantization.GGUF_ACTIVATIONS_ENV_VAR)
        quantization.gguf_activations.cache_clear()
        assert quantization.gguf_activations() == "int8"  # the default
    finally:
        quantization.gguf_activations.cache_clear()


@pytest.fixture(scope="module", autouse=True)
def invariant_paths():
    """This module's engines run PAGEDLLM_GGUF_PATHS=invariant (the default is "fast"); the rest of the
    suite gets the default back."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(quantization.GGUF_PATHS_ENV_VAR, "invariant")
        quantization.gguf_paths.cache_clear()
        yield
    quantization.gguf_paths.cache_clear()


# Engine level. Prompts of 6 to ~60 tokens, so that steps mix prefill rows (several sequences' chunks) with
# decode rows, and their row counts pass every threshold of the fast paths (10, 17, 64).
PROMPTS = [
    f"Question {i}: " + " ".join(["Explain why the sky looks blue at noon and red at dusk."] * (1 + i % 5))
    for i in range(32)
]
MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
NEAR_TIE = 1e-3
ALONE = (0, 9, 18, 31)  # prompts also generated alone


LOGPROB_SAME = 1e-4


def max_logprob_gap(reference, outputs) -> float:
    """The largest difference of a chosen token's log-probability between two runs, over each sequence's
    tokens up to their first difference."""
    gap = 0.0
    for want_out, got_out in zip(reference, outputs, strict=True):
        want, got = want_out.outputs[0], got_out.outputs[0]
        for i, (a, b) in enumerate(zip(want.token_ids, got.token_ids, strict=True)):
            if a != b:
                break
            gap = max(gap, abs(want.logprobs[i][a] - got.logprobs[i][b]))
    return gap


def assert_same_tokens(reference, outputs, label: str) -> int:
    """Each output's greedy tokens equal the reference's, up to a first difference where the reference's
    top two log-probabilities were within NEAR_TIE (then the rest of that sequence is not compared);
    returns the number of such near-tie differences."""
    near_ties = 0
    for want_out, got_out in zip(reference, outputs, strict=True):
        want, got = want_out.outputs[0], got_out.outputs[0]
        assert len(got.token_ids) == len(want.token_ids) == MAX_TOKENS
        for i, (a, b) in enumerate(zip(want.token_ids, got.token_ids, strict=True)):
            if a != b:
                top = want.logprobs[i]
                gap = top[a] - top[b] if b in top else float("inf")
                assert gap < NEAR_TIE, f"{label}: {want_out.prompt!r} token {i}: {a} -> {b}, {gap:.4f} apart"
                near_ties += 1
                break
    return near_ties


@pytest.fixture(scope="module")
def batch_outputs():
    """Every prompt in one batch, the default storage (GGUF blocks) with invariant paths, a cache with room
    for all of them."""
    llm = LLM("smollm2-135m", max_model_len=512)
    assert llm.engine.runner.gates_bf16  # the runner sets the invariant gate every step
    outputs = llm.generate(PROMPTS, GREEDY)
    assert llm.engine.stats().num_preemptions == 0
    alone = [llm.generate([PROMPTS[i]], GREEDY)[0] for i in ALONE]
    assert_all_blocks_free(llm)
    return outputs, alone


def test_a_request_alone_gets_its_tokens_in_a_batch(batch_outputs):
    outputs, alone = batch_outputs
    assert_same_tokens(alone, [outputs[i] for i in ALONE], "batch against alone")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_requests_get_their_tokens(batch_outputs, mode):
    """24 blocks of 16 tokens hold a few of the 32 sequences (~40-80 tokens each): most are preempted,
    then recomputed by a prefill, or swapped out and back in."""
    llm = LLM("smollm2-135m", num_kv_blocks=24, max_model_len=512, preemption_mode=mode)
    outputs = llm.generate(PROMPTS, GREEDY)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    if mode == "swap":
        assert stats.num_blocks_swapped_out > 0
    assert_same_tokens(batch_outputs[0], outputs, f"{mode} preemption against the batch")
    assert_all_blocks_free(llm)


@pytest.fixture
def fast_paths(monkeypatch):
    """The default paths (PAGEDLLM_GGUF_PATHS=fast) for one test; this module's invariant ones after it."""
    monkeypatch.setenv(quantization.GGUF_PATHS_ENV_VAR, "fast")
    quantization.gguf_paths.cache_clear()
    yield
    quantization.gguf_paths.cache_clear()


@pytest.fixture
def k_type_model(tmp_path):
    """A tiny Qwen2 whose every matrix is random Q4_K blocks (256 and 512 columns), as a GGUF: scales of
    weights ~0.1, so that logits spread as a trained model's and bf16's rounding would move some tokens."""
    from models_helpers import TINY, write_gguf
    from transformers import AutoModelForCausalLM, Qwen2Config

    shape = {**TINY, "hidden_size": 256, "intermediate_size": 512, "max_position_embeddings": 512}
    config = Qwen2Config(**shape, tie_word_embeddings=False)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    seeds = iter(range(1000))
    q4_k = GGMLQuantizationType.Q4_K
    path = tmp_path / "tiny-qwen2-q4_k.gguf"
    write_gguf(hf, path, "qwen2", q4_k, blocks=lambda w: random_blocks(q4_k, *w.shape, next(seeds), 1e-3).raw)
    return str(path)


def test_the_default_paths_keep_a_k_type_model_batch_invariant(fast_paths, k_type_model):
    """Without AMX, Q4_K / Q6_K keep their integer path at every row count by default (their many-row tile is
    the fastest path measured, bf16 included: GGUFLinear.INTEGER_TILE_TYPES), so a model of K types gets a
    request's tokens alone, in a batch whose steps pass every fast path's threshold, and after swap
    preemption, with no opt-in. (Where bf16 runs, the old default's bf16 path at 64 rows fails this.)"""
    if native.blocks_amx():
        pytest.skip("on AMX the default multiplies many rows in AMX panels, every type")
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 256 for j in range(6 + 2 * i)]} for i in range(32)]
    llm = LLM(k_type_model, max_model_len=512)
    assert not llm.engine.runner.gates_bf16  # no per-step gate: the default path itself
    batch = llm.generate(prompts, GREEDY)
    alone = [llm.generate([prompts[i]], GREEDY)[0] for i in ALONE]
    assert_all_blocks_free(llm)
    assert_same_tokens(alone, [batch[i] for i in ALONE], "default paths: batch against alone")
    swapped = LLM(k_type_model, num_kv_blocks=24, max_model_len=512, preemption_mode="swap")
    outputs = swapped.generate(prompts, GREEDY)
    assert swapped.engine.stats().num_blocks_swapped_out > 0
    assert_same_tokens(batch, outputs, "default paths: swap preemption against the batch")
    assert_all_blocks_free(swapped)


@pytest.mark.parametrize("model,prompts", [("smollm2-135m", 32), ("qwen2.5-coder-0.5b", 12)])
def test_the_default_paths_keep_the_32_value_types_batch_invariant(fast_paths, model, prompts):
    """Without AMX, the 32-value types (SmolLM2's Q4_1 / Q8_0, the 0.5B's Q5_0 / Q8_0 beside its Q4_K / Q6_K)
    keep their integer path at every row count by default, x int16 per 256 values (csrc/linear.cpp
    pair_rows), so a request gets its tokens alone, in a batch whose steps pass every fast path's threshold,
    and after recompute and swap preemption, with no opt-in. (The old default, bf16 at 17+ rows on
    AVX512_BF16 CPUs and float32 panels on AVX2, failed this on SmolLM2: issue 47.)"""
    if native.blocks_amx():
        pytest.skip("on AMX the default multiplies many rows in AMX panels, every type")
    llm = LLM(model, max_model_len=512)
    assert not llm.engine.runner.gates_bf16  # no per-step gate: the default path itself
    batch = llm.generate(PROMPTS[:prompts], GREEDY)
    alone = [llm.generate([PROMPTS[i]], GREEDY)[0] for i in ALONE if i < prompts]
    assert_all_blocks_free(llm)
    in_batch = [batch[i] for i in ALONE if i < prompts]
    assert_same_tokens(alone, in_batch, f"{model}: batch against alone")
    # and the chosen tokens' log-probabilities, where no near tie shows a difference: the same alone, in the
    # batch and after swapping (measured 0.0 on both models; the old default's bf16 rows moved SmolLM2's by
    # 0.069, the 0.5B's by 0.0026); a recompute's prefill sums attention in another order (0.0014 / 0.024)
    assert max_logprob_gap(alone, in_batch) <= LOGPROB_SAME
    for mode in ("recompute", "swap"):
        preempted = LLM(model, num_kv_blocks=24, max_model_len=512, preemption_mode=mode)
        outputs = preempted.generate(PROMPTS[:prompts], GREEDY)
        assert preempted.engine.stats().num_preemptions > 0
        assert_same_tokens(batch, outputs, f"{model}: {mode} preemption against the batch")
        if mode == "swap":
            assert max_logprob_gap(batch, outputs) <= LOGPROB_SAME
        assert_all_blocks_free(preempted)
