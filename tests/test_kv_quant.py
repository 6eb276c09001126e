"""The quantized KV cache (kv_cache_dtype "int8", "fp8"): codes against independent oracles, the memory
layout, blocks moving with their scales, the key smoothing, attention against float32's, and the engine
on SmolLM2.

The kernels themselves (every backend and C++ build, on the same quantized blocks as the reference) are
checked in test_ops_backends.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import agreed_greedy_tokens, assert_all_blocks_free, batch_invariant_llm
from models_helpers import PagedCache, forward_chunks
from oracles import dense_attention, dense_batch_attention
from test_llm import PROMPTS

from pagedllm import LLM, SamplingParams, ops
from pagedllm.engine.config import EngineConfig
from pagedllm.models import load_model
from pagedllm.ops import AttentionArgs, native, reference
from pagedllm.ops.kv_cache import allocate_kv_caches, key_smoothing, kv_block_bytes, kv_blocks, kv_scales
from pagedllm.ops.synthetic import random_paged_batch

INT8, FP8 = torch.int8, torch.float8_e4m3fn


def _rows(seed: int = 0) -> torch.Tensor:
    """Rows of 64 values over many magnitudes (1e-8 to 1e4), an all-zero row and a row with a -0.0."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(200, 64, generator=gen) * torch.logspace(-8, 4, 200)[:, None]
    x[7] = 0.0
    x[8, 3] = -0.0
    return x


def test_int8_codes_are_numpys_rounding_of_each_row_over_its_scale():
    x = _rows()
    codes, scale = reference.quantize(x, INT8)
    xs = x.numpy()
    expected_scale = np.abs(xs).max(axis=1) / np.float32(127)
    assert np.array_equal(scale.numpy(), expected_scale)
    divisor = np.where(expected_scale > 0, expected_scale, np.float32(1))[:, None]
    expected = np.where(expected_scale[:, None] > 0, np.rint(xs / divisor), 0).astype(np.int8)
    assert np.array_equal(codes.numpy(), expected)
    nonzero = scale > 0
    assert (codes[nonzero].abs().amax(dim=1) == 127).all() and not codes[~nonzero].any()
    error = (reference.dequantize(codes, scale) - x).abs()
    assert (error <= scale[:, None] * 0.5 * (1 + 1e-6)).all()  # half a step, whatever the magnitude


def _e4m3_codes_of(y: np.ndarray) -> np.ndarray:
    """Each float32 y (|y| <= 448) as the e4m3 code of the nearest value, a tie going to the even code;
    the values from the format's definition (4 exponent bits of bias 7, 3 mantissa bits, subnormals)."""
    code = np.arange(127)  # 0x00 .. 0x7e, the finite non-negative codes
    exponent, mantissa = code >> 3, code & 7
    values = np.where(exponent == 0, mantissa / 8 * 2.0**-6, (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    distance = np.abs(np.abs(y.astype(np.float64))[..., None] - values)
    nearest = distance.min(axis=-1, keepdims=True)
    ties = distance == nearest
    even = np.where(ties & (code % 2 == 0), code, 1000).min(axis=-1)  # a tie: the even code
    best = np.where(ties.sum(axis=-1) > 1, even, distance.argmin(axis=-1))
    return (best | np.where(np.signbit(y), 0x80, 0)).astype(np.uint8)


def test_fp8_codes_are_the_nearest_e4m3_value_of_each_row_over_its_scale():
    x = _rows(1)
    codes, scale = reference.quantize(x, FP8)
    xs, s = x.numpy(), scale.numpy()
    assert np.array_equal(s, np.abs(xs).max(axis=1) / np.float32(448))
    scaled = np.where(s[:, None] > 0, xs / np.where(s > 0, s, np.float32(1))[:, None], np.float32(0))
    assert np.array_equal(codes.view(torch.uint8).numpy(), _e4m3_codes_of(scaled))
    error = (reference.dequantize(codes, scale) - x).abs()  # half a step: 2^-4 relative, 2^-10 below 2^-6
    assert (error <= torch.maximum(x.abs() * 2.0**-4, scale[:, None] * 2.0**-10) * (1 + 1e-6)).all()


@pytest.mark.parametrize("kv_dtype", [INT8, FP8], ids=["int8", "fp8"])
def test_a_row_with_a_nan_or_an_infinity_reads_back_as_nan(kv_dtype):
    x = torch.ones(3, 16)
    x[0, 2], x[1, 5] = float("nan"), float("-inf")
    codes, scale = reference.quantize(x, kv_dtype)
    assert scale[:2].isnan().all() and scale[2] == 1 / reference.LARGEST_CODE[kv_dtype]
    read = reference.dequantize(codes, scale)
    assert read[:2].isnan().all() and torch.equal(read[2], x[2])


@pytest.mark.parametrize("head_major", [False, True], ids=["slot-major", "head-major"])
def test_a_block_is_its_codes_then_a_float32_scale_per_row(head_major):
    """In memory, block b of a layer's K is its codes (rows of D bytes in the view's memory order), then
    one float32 per row in the same order; the layers' K and V blocks do not overlap."""
    num_blocks, block_size, heads, d = 5, 4, 3, 16
    layers = allocate_kv_caches(2, num_blocks, block_size, heads, d, INT8, "cpu", head_major=head_major)
    k = layers[0][0]
    assert kv_block_bytes(block_size, heads, d, INT8) == block_size * heads * (d + 4) == kv_blocks(k).shape[1]
    key = torch.randn(1, heads, d)
    reference.write_kv(key, key, *layers[0], torch.tensor([2 * block_size + 1]))  # block 2, row 1
    block = kv_blocks(k)[2]
    codes, scale = reference.quantize(key[0], INT8)
    for h in range(heads):
        row = h * block_size + 1 if head_major else heads + h  # the row's place in memory order
        assert torch.equal(block[row * d : (row + 1) * d].view(INT8), codes[h])
        at = block_size * heads * d + 4 * row
        assert torch.equal(block[at : at + 4].view(torch.float32), scale[h : h + 1])
    assert torch.count_nonzero(block) == torch.count_nonzero(kv_blocks(layers[0][1])[2])
    assert torch.count_nonzero(kv_blocks(k)) == torch.count_nonzero(block)  # only block 2 was written
    assert not any(kv_blocks(c).any() for c in layers[1])


def test_a_cache_without_room_for_its_scales_is_refused():
    plain = torch.zeros(4, 4, 2, 16, dtype=INT8)  # codes only: no scales after the blocks
    with pytest.raises(ValueError, match="allocate_kv_caches"):
        kv_scales(plain)
    q = torch.randn(1, 2, 16)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    for isa in native.supported_isas():
        with pytest.raises(RuntimeError, match="allocate_kv_caches"):
            native.kernels(isa).paged_attention(
                torch.empty_like(q),
                q,
                plain,
                plain,
                tables,
                torch.arange(2, dtype=torch.int32),
                lens,
                1.0,
                0,
                0.0,
            )
        with pytest.raises(RuntimeError, match="allocate_kv_caches"):
            native.kernels(isa).write_kv(q, q, plain, plain, torch.zeros(1, dtype=torch.int64))


def _filled(num_blocks: int, head_major: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 layer whose every slot holds a token of random K/V (rows of many magnitudes: many scales)."""
    k, v = allocate_kv_caches(1, num_blocks, 4, 2, 16, INT8, "cpu", head_major=head_major)[0]
    gen = torch.Generator().manual_seed(seed)
    key, value = (
        torch.randn(num_blocks * 4, 2, 16, generator=gen)
        * torch.rand(num_blocks * 4, 2, 1, generator=gen)
        * 9
        for _ in "kv"
    )
    reference.write_kv(key, value, k, v, torch.arange(num_blocks * 4))
    return k, v


def _read(cache: torch.Tensor) -> torch.Tensor:
    """Every block's rows as stored, dequantized (a K cache's: still smoothed)."""
    return reference.read_blocks(cache, torch.arange(cache.shape[0]), keys=False)


def test_copy_on_write_copies_codes_and_scales():
    k, v = _filled(6, head_major=True, seed=0)
    before = [_read(c) for c in (k, v)]
    ops.copy_blocks(k, v, [(1, 4), (2, 5)])
    for cache, old in zip((k, v), before, strict=True):
        now = _read(cache)
        assert torch.equal(now[4], old[1]) and torch.equal(now[5], old[2]) and torch.equal(now[:4], old[:4])
        assert torch.equal(kv_blocks(cache)[4], kv_blocks(cache)[1])


def test_swap_out_and_in_moves_scales_between_memory_orders():
    """A GPU's slot-major blocks swap out to a head-major host pool, and back."""
    device_k, device_v = _filled(4, head_major=False, seed=1)
    host_k, host_v = allocate_kv_caches(1, 6, 4, 2, 16, INT8, "cpu", head_major=True)[0]
    original = [_read(c) for c in (device_k, device_v)]
    ops.swap_blocks(device_k, device_v, host_k, host_v, [(1, 5), (3, 0)])
    assert torch.equal(_read(host_k)[5], original[0][1]) and torch.equal(_read(host_v)[0], original[1][3])
    for cache in (device_k, device_v):
        kv_blocks(cache).zero_()
    ops.swap_blocks(host_k, host_v, device_k, device_v, [(5, 2), (0, 1)])
    assert torch.equal(_read(device_k)[2], original[0][1]) and torch.equal(_read(device_v)[1], original[1][3])
    assert not kv_blocks(device_k)[0].any() and not kv_blocks(device_k)[3].any()
    with pytest.raises(ValueError, match="float32"):
        ops.swap_blocks(device_k, device_v, torch.zeros(6, 4, 2, 16), torch.zeros(6, 4, 2, 16), [(0, 0)])


@pytest.mark.parametrize(
    ("kv_dtype", "max_abs", "max_rel"), [(INT8, 0.025, 0.02), (FP8, 0.15, 0.08)], ids=["int8", "fp8"]
)
def test_reference_attention_on_quantized_blocks_tracks_float32(kv_dtype, max_abs, max_rel):
    """Unit-normal K/V (D = 64), contexts of 30 to 2,000 tokens, decode rows and a 40-row prompt chunk:
    attention on the quantized blocks against float32 attention on the values before quantization (dense
    SDPA) is within max_abs of it and within max_rel of its norm (measured: int8 1.1e-2 and 0.8%, fp8
    6.6e-2 and 3.5%: e4m3's 3 mantissa bits round coarser than int8's steps of max / 127)."""
    b = random_paged_batch([30, 512, 2000, 70], [1, 1, 1, 40], 9, 3, 64, 16, seed=4, kv_dtype=kv_dtype)
    scale = 64**-0.5
    out = reference.paged_attention(b.q, b.args(scale))
    expected = dense_batch_attention(b, scale)
    error = out - expected
    assert error.abs().max() < max_abs and error.norm() / expected.norm() < max_rel


@pytest.mark.parametrize(
    ("kv_dtype", "max_rel", "gain"), [(INT8, 0.02, 4), (FP8, 0.08, 2)], ids=["int8", "fp8"]
)
def test_the_key_smoothing_takes_the_outlier_channels_error_away(kv_dtype, max_rel, gain):
    """Keys whose channels 5 and 37 sit at 40 and vary 4 times as much as the others (as Qwen2.5's
    bias-dominated channels do): stored through the smoothing fitted to them, decode attention is within
    the bound for plain unit-normal keys (test above: max_rel of its norm); through the identity smoothing
    (one scale a row, the small channels in steps of the large ones'), at least `gain` times further from
    float32's (measured: int8 1.0% against 10.3%, fp8 4.5% against 11.2%)."""
    gen = torch.Generator().manual_seed(5)
    num_blocks, block_size, heads, d, context = 40, 16, 3, 64, 600
    keys = torch.randn(context, heads, d, generator=gen)
    keys[..., [5, 37]] = keys[..., [5, 37]] * 4 + 40
    values = torch.randn(context, heads, d, generator=gen)
    q = torch.randn(2, 9, d, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen)[: context // block_size + 1].int()[None].expand(2, -1)
    lens = torch.tensor([context, context - 77], dtype=torch.int32)
    expected = torch.cat(
        [dense_attention(q[s : s + 1], keys[:n], values[:n], 0.125) for s, n in enumerate(lens.tolist())]
    )
    errors = []
    for fitted in (True, False):
        k_cache, v_cache = allocate_kv_caches(1, num_blocks, block_size, heads, d, kv_dtype, "cpu")[0]
        if fitted:
            for held, value in zip(key_smoothing(k_cache), reference.fit_key_smoothing(keys), strict=True):
                held.copy_(value)
        slots = (tables[0].long()[:, None] * block_size + torch.arange(block_size)).flatten()[:context]
        reference.write_kv(keys, values, k_cache, v_cache, slots)
        out = reference.paged_attention(q, AttentionArgs(k_cache, v_cache, tables, lens, 0.125))
        errors.append(((out - expected).norm() / expected.norm()).item())
    assert errors[0] < max_rel and errors[1] > gain * errors[0], errors


def test_kv_cache_dtype_names_and_their_block_bytes():
    for name, dtype in [("int8", INT8), ("fp8", FP8), ("fp8_e4m3", FP8), ("bfloat16", torch.bfloat16)]:
        assert EngineConfig(kv_cache_dtype=name).kv_torch_dtype == dtype
    with pytest.raises(ValueError, match="'int4'"):
        EngineConfig(kv_cache_dtype="int4")
    # SmolLM2's 3 KV heads of 64: int8 codes and scales take 68 / 256 of float32's bytes
    assert kv_block_bytes(16, 3, 64, INT8) * 256 == kv_block_bytes(16, 3, 64, torch.float32) * 68
    assert kv_block_bytes(16, 3, 64, FP8) == kv_block_bytes(16, 3, 64, INT8)


def test_the_default_block_size_holds_float32s_bytes_and_a_given_one_wins():
    """block_size unset: a block holds as many bytes of each value position as 16 float32 tokens do
    (kv.default_block_size), so a cache of narrower values gets more tokens a block; one given is kept."""
    tokens = {"auto": 32, "float32": 16, "float16": 32, "bfloat16": 32, "int8": 64, "fp8": 64, "fp8_e4m3": 64}
    for name, block_size in tokens.items():
        assert EngineConfig(kv_cache_dtype=name).block_size == block_size
        assert EngineConfig(kv_cache_dtype=name, block_size=8).block_size == 8
    assert EngineConfig(dtype="bfloat16").block_size == EngineConfig(dtype="float16").block_size == 32
    with pytest.raises(ValueError, match="block_size must be a positive integer, got 0"):
        EngineConfig(kv_cache_dtype="int8", block_size=0)


def _steps(model, kv_dtype: torch.dtype) -> list[torch.Tensor]:
    """Logits of a prefill of three prompts, then decode steps mixed with a later prompt's chunks, on a
    fresh quantized cache (handed out in shuffled order)."""
    cfg = model.config
    kv_caches = allocate_kv_caches(cfg.num_layers, 24, 8, cfg.num_kv_heads, cfg.head_dim, kv_dtype, "cpu")
    free = torch.randperm(24, generator=torch.Generator().manual_seed(3)).tolist()
    cache = PagedCache(kv_caches, 8, free, 24)
    gen = torch.Generator().manual_seed(4)
    seqs = [torch.randint(cfg.vocab_size, (n,), generator=gen).tolist() for n in (23, 30, 9)]
    logits = [forward_chunks(model, cache, [(i, s, 0) for i, s in enumerate(seqs)])]
    for step in range(3):
        logits.append(forward_chunks(model, cache, [(0, [step + 1], len(seqs[0]) + step)]))
        chunk = (3, [step + 5] * 7, 7 * step)  # a fourth prompt, 7 tokens a step
        logits.append(forward_chunks(model, cache, [(1, [step + 3], len(seqs[1]) + step), chunk]))
    return logits


@pytest.mark.parametrize("kv_dtype", [INT8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("isa", native.supported_isas() or [None])
def test_a_layer_in_one_call_equals_its_ops_one_by_one_on_a_quantized_cache(
    tiny_llama_dir, kv_dtype, isa, monkeypatch
):
    """csrc/decoder.cpp calls the same write_kv and attention kernels on the quantized cache: its logits
    are bit-identical to the layer's ops called from Python, on every C++ build."""
    if isa is None:
        pytest.skip(native.unavailable_reason() or "no C++ build for this CPU")
    monkeypatch.setattr(native, "selected_isa", lambda: isa)
    model = load_model(str(tiny_llama_dir), quantization="none", max_num_seqs=4).model
    assert all(layer.fused is not None for layer in model.layers)
    fused = _steps(model, kv_dtype)
    for layer in model.layers:
        layer.fused = None
    by_ops = _steps(model, kv_dtype)
    assert all(torch.equal(a, b) for a, b in zip(fused, by_ops, strict=True))
    assert not any(t.isnan().any() for t in fused)


GREEDY_LOGPROBS = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def fp32_greedy(smollm2_llm):
    return smollm2_llm.generate(PROMPTS, GREEDY_LOGPROBS)


@pytest.mark.parametrize(("kv_cache_dtype", "tol", "min_agreed"), [("int8", 0.2, 200), ("fp8", 0.5, 90)])
def test_a_quantized_cache_tracks_the_float32_cache(kv_cache_dtype, tol, min_agreed, fp32_greedy):
    """SmolLM2 (float32 weights), 32 greedy tokens on 8 prompts against a float32 cache's
    (agreed_greedy_tokens): at least min_agreed of the 256 tokens before any divergence (measured on an
    AVX-512 build, keys smoothed: int8 256, fp8 112, its prompts parting at near-ties). The same KV memory
    holds 256 / 68 times the float32 cache's tokens, in blocks of 64 (the default for a byte a value)."""
    llm = LLM(
        "smollm2-135m",
        quantization="none",
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_memory="16MiB",
        max_model_len=256,
    )
    cfg = llm.engine.model.config
    assert (
        llm.engine.runner.kv_caches[0][0].dtype == EngineConfig(kv_cache_dtype=kv_cache_dtype).kv_torch_dtype
    )
    assert llm.engine.config.block_size == llm.engine.allocator.block_size == 64
    block_bytes = 2 * cfg.num_layers * 64 * cfg.num_kv_heads * (cfg.head_dim + 4)
    assert llm.engine.allocator.num_total_blocks == 16 * 2**20 // block_bytes
    agreed = agreed_greedy_tokens(fp32_greedy, llm.generate(PROMPTS, GREEDY_LOGPROBS), tol)
    assert agreed >= min_agreed, agreed
    assert_all_blocks_free(llm)


def test_swap_preemption_and_forks_on_an_int8_cache_keep_the_tokens():
    """12 blocks of 16 tokens (given: a sequence of ~50 tokens never outgrows one block of int8's default 64)
    for 8 sequences of ~50 tokens and one request's n = 2 fork (copy-on-write): blocks swap out to the host
    pool with their scales and back, on the default storage (SmolLM2's GGUF blocks, a layer in one call).
    Against a cache big enough for all (agreed_greedy_tokens, 0.2 nats): steps of other batches round
    differently (1e-3 nats with a float32 cache), and int8 codes flipping at those roundings move logprobs
    by up to ~0.1 nats; a block that came back without its scales would move them by far more."""
    things = ("cat", "dog", "robot", "dragon", "river", "cloud", "sun", "mountain")
    prompts = [f"Write a short story about a {thing}." for thing in things]
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=5)] * 7
    params.append(SamplingParams(n=2, max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=5))
    roomy = LLM("smollm2-135m", kv_cache_dtype="int8", max_model_len=512, kv_cache_memory="64MiB")
    expected = roomy.generate(prompts, params)
    assert roomy.engine.scheduler.num_preemptions == 0
    assert_all_blocks_free(roomy)
    tight = LLM(
        "smollm2-135m",
        kv_cache_dtype="int8",
        num_kv_blocks=12,
        block_size=16,
        max_model_len=512,
        preemption_mode="swap",
    )
    got = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0 and tight.engine.scheduler.num_blocks_swapped_in > 0
    assert agreed_greedy_tokens(expected, got, 0.2) >= 0.9 * 9 * 40
    assert_all_blocks_free(tight)


@pytest.mark.parametrize(("block_size", "hit"), [(None, 128), (16, 144)])
def test_prefix_hits_on_an_int8_cache_are_whole_blocks(block_size, hit):
    """A 150-token prompt sent again: its full blocks come from the prefix cache, codes with their scales
    (the same greedy tokens, agreed_greedy_tokens at 0.15 nats: the tail's few rows take another kernel path
    than the whole prompt's, 0.03 nats apart on an AVX2 build). Hits are counted per full block: two blocks
    of int8's default 64 tokens (128), or with block_size=16 given, nine blocks of 16 (144)."""
    llm = batch_invariant_llm("smollm2-135m", kv_cache_dtype="int8", block_size=block_size, max_model_len=256)
    assert llm.engine.config.block_size == (block_size or 64)
    prompt = torch.randint(49152, (150,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
    (first,) = llm.generate([prompt], params)
    (second,) = llm.generate([prompt], params)
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, hit)
    assert agreed_greedy_tokens([first], [second], 0.15) >= 4
    assert_all_blocks_free(llm)


def test_two_ranks_on_int8_caches_generate_the_tokens_of_one(tiny_llama_dir):
    """Tensor parallelism: each rank quantizes its own KV heads (a row is one token's one head, so the
    codes are those of one rank's cache); swap preemption and an n = 2 fork move every rank's blocks."""
    settings = dict(
        kv_cache_dtype="int8", num_kv_blocks=12, block_size=8, max_model_len=128, preemption_mode="swap"
    )
    gen = torch.Generator().manual_seed(1)
    batch = [torch.randint(384, (n,), generator=gen).tolist() for n in (19, 33, 46, 25)]
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)] * 3
    params.append(SamplingParams(n=2, max_tokens=16, temperature=0, ignore_eos=True, logprobs=1))
    one = LLM(str(tiny_llama_dir), **settings)
    expected = one.generate(batch, params)
    two = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **settings)
    try:
        assert two.engine.runner.kv_caches[0][0].dtype == INT8
        got = two.generate(batch, params)
        assert two.engine.scheduler.num_preemptions > 0
        assert_all_blocks_free(two)
    finally:
        two.engine.shutdown()
    for want, have in zip(expected, got, strict=True):
        for a, b in zip(want.outputs, have.outputs, strict=True):
            assert b.token_ids == a.token_ids
            assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=1e-2)
    assert_all_blocks_free(one)
