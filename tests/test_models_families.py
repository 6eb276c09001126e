"""Each model family against Hugging Face transformers on a tiny random checkpoint (fp32).

The checkpoint is written by transformers (save_pretrained, safetensors) and loaded by pagedllm's loader,
so the loader, the fused-weight mapping and the forward are all under test.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from helpers import FLOAT32_KV, assert_all_blocks_free, skip_unless_onednn_packs
from models_helpers import PagedCache, forward_chunks, greedy_generate, hf_greedy, hf_logits
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from pagedllm import LLM, SamplingParams
from pagedllm.models import load_model
from pagedllm.models.lora import LoRAConfig, LoRALayer, LoRAModel, attach_lora
from pagedllm.ops import native

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
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=32),
    # Phi-3's checkpoint holds q/k/v as one qkv_proj tensor and gate/up as one gate_up_proj.
    "phi3": lambda: Phi3Config(**COMMON, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "gemma2": lambda: Gemma2Config(
        **COMMON,
        head_dim=32,
        sliding_window=9,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=24,
        attn_logit_softcapping=1.5,  # small enough to bend these random models' scores
        final_logit_softcapping=5.0,
    ),
    # Layer 1 keeps a dense MLP (mlp_only_layers); the others route each token to 2 of 8 experts.
    "qwen3-moe": lambda: Qwen3MoeConfig(
        **COMMON,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
    # Mixtral's checkpoint names its experts' projections w1 (gate), w3 (up), w2 (down).
    "mixtral": lambda: MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
}
PROMPT_LENS = [1, 5, 16, 17, 40]


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Weights large enough for peaked logits; norms and biases away from their trivial init."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.add_(noise * 0.1) if "norm" in name else param.copy_(noise * 0.15)


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    """(HF model, the folder of its tiny random checkpoint)."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(FAMILIES[request.param](), dtype=torch.float32)
    randomize(hf)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return hf.eval(), folder


@pytest.fixture(scope="module")
def pair(checkpoint):
    """(HF model, pagedllm model) sharing one tiny random checkpoint."""
    hf, folder = checkpoint
    return hf, load_model(str(folder)).model


def prompts(lens: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lens]


@pytest.mark.parametrize("isa", native.supported_isas() or [None])
@pytest.mark.parametrize("block_size", [16, 5])
def test_prefill_logits_match_hf(pair, block_size, isa, monkeypatch):
    """On every C++ build this CPU runs (AVX-512 and AVX2 where both run): the whole model equals HF."""
    if isa is not None:
        monkeypatch.setattr(native, "selected_isa", lambda: isa)
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


def test_engine_batch_of_two_prompts_matches_hf_generate(checkpoint):
    """The whole engine (scheduler, paged KV blocks of 4 tokens, sampler) on the folder as a user names it:
    a batch of two prompts of different lengths, greedy, equal to HF's batched generate (float32 K/V: a
    random model's near-ties follow the float16 cache's rounding)."""
    hf, folder = checkpoint
    batch = prompts([3, 26], hf.config.vocab_size, seed=6)
    llm = LLM(str(folder), num_kv_blocks=32, block_size=4, **FLOAT32_KV)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], greedy)
    assert [out.outputs[0].token_ids for out in outputs] == hf_greedy(hf, batch, 12)
    assert_all_blocks_free(llm)


# Phi-3's longrope (Phi-3-mini-128k's form): per-pair factors, short below original_max_position_embeddings
# and long above, cos and sin times sqrt(1 + ln(1024 / 64) / ln 64) = 1.29.
LONGROPE_ORIGINAL = 64
LONGROPE = dict(
    rope_type="longrope",
    rope_theta=10000.0,
    short_factor=[1.0 + 0.3 * i for i in range(8)],  # head_dim 16: 8 rotated pairs
    long_factor=[1.5 + 2.0 * i for i in range(8)],
    original_max_position_embeddings=LONGROPE_ORIGINAL,
)


def longrope_config() -> Phi3Config:
    return Phi3Config(
        **COMMON,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        original_max_position_embeddings=LONGROPE_ORIGINAL,
        rope_parameters=LONGROPE,
    )


@pytest.fixture(scope="module")
def longrope_checkpoint(tmp_path_factory):
    """(HF model, folder) of a tiny Phi-3 with longrope RoPE."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(longrope_config(), dtype=torch.float32)
    randomize(hf)
    folder = tmp_path_factory.mktemp("phi3-longrope")
    hf.save_pretrained(folder)
    return hf.eval(), folder


@pytest.mark.parametrize(
    ("max_model_len", "prompt_lens"),
    [
        (LONGROPE_ORIGINAL, [5, 30, 64]),  # short factors: transformers' at every sequence of <= 64 tokens
        (None, [65, 90, 300]),  # long factors: transformers' once a sequence passes 64 tokens
    ],
)
def test_phi3_longrope_logits_and_greedy_match_hf(longrope_checkpoint, max_model_len, prompt_lens):
    """An engine of at most 64 tokens a sequence rotates by the short factors, one of the model's 1024 by
    the long ones (as vLLM and llama.cpp choose): both equal transformers where it uses the same set, i.e.
    on prompts (and generations) that stay below original_max_position_embeddings and ones past it."""
    hf, folder = longrope_checkpoint
    model = load_model(str(folder), max_model_len=max_model_len).model
    assert model.config.rope_scaling["long"] == (max_model_len is None)
    batch = prompts(prompt_lens, model.config.vocab_size, seed=8)
    cache = PagedCache.create(model.config, 64, 16, seed=1)
    logits = forward_chunks(model, cache, [(i, p, 0) for i, p in enumerate(batch)])
    torch.testing.assert_close(logits, torch.cat([hf_logits(hf, p) for p in batch]), atol=1e-4, rtol=1e-4)
    new_tokens = LONGROPE_ORIGINAL - max(prompt_lens[:2]) if max_model_len else 32  # 34 below: 30 + 34 = 64
    expected = hf_greedy(hf, batch[:2], new_tokens)
    assert greedy_generate(model, batch[:2], new_tokens) == expected


def test_phi3_longrope_engines_of_either_context_get_a_model_each(longrope_checkpoint):
    """Two engines in one process, of 64 and 1024 tokens, get a model each (the loaded-model cache keys on
    the factor set), and each generates transformers' tokens."""
    hf, folder = longrope_checkpoint
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    short, long = prompts([40], hf.config.vocab_size, seed=9), prompts([100], hf.config.vocab_size, seed=9)
    engines = [LLM(str(folder), num_kv_blocks=32, block_size=8, max_model_len=n) for n in (64, 1024)]
    assert engines[0].engine.model is not engines[1].engine.model
    for llm, batch in zip(engines, (short, long), strict=True):
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch], greedy)
        assert [out.outputs[0].token_ids for out in outputs] == hf_greedy(hf, batch, 20)
        assert_all_blocks_free(llm)


GGUF_ARCHITECTURES = {
    "llama": "llama",  # Llama 3.1's RoPE scaling as llama.cpp writes it: a rope_freqs tensor
    "qwen3": "qwen3",
    "phi3": "phi3",
    "gemma2": "gemma2",
    "qwen3-moe": "qwen3moe",
    "mixtral": "llama",  # llama.cpp's Llama with experts
}


@pytest.mark.parametrize("family", list(GGUF_ARCHITECTURES))
def test_gguf_in_llama_cpp_names_loads_in_place_and_matches_hf(
    family, tmp_path, monkeypatch, int16_activations
):
    """A Q8_0 GGUF written under llama.cpp's names (gguf-py's map; Phi-3's fused attn_qkv and ffn_up,
    Qwen3-MoE's and Mixtral's stacked experts, Gemma's (1 + w) norms and soft-capping metadata, Llama 3's
    rope_freqs) loads with its blocks kept, and its logits equal HF's on the same weights rounded through
    Q8_0 (the blocks' exact path: the default's x per 256 moves them by up to 8e-4)."""
    config = FAMILIES[family]()
    if family == "gemma2":  # a GGUF has no field for it: llama.cpp scales by head_dim^-1/2 (but on 27B)
        config.query_pre_attn_scalar = config.head_dim
    if family == "qwen3-moe":  # llama.cpp's qwen3moe routes in every layer
        config.mlp_only_layers = []
    check_gguf_against_hf(config, GGUF_ARCHITECTURES[family], tmp_path, monkeypatch, [5, 23])


def test_gguf_phi3_longrope_factors_load_and_match_hf(tmp_path, monkeypatch, int16_activations):
    """Phi-3's longrope in a GGUF (rope_factors_long / _short, the original context and attention factor
    as keys): past the original context the long factors, as transformers rotates those prompts."""
    check_gguf_against_hf(longrope_config(), "phi3", tmp_path, monkeypatch, [70, 100])


def check_gguf_against_hf(config, arch: str, tmp_path, monkeypatch, prompt_lens: list[int]) -> None:
    """A random HF model of `config` written as a Q8_0 GGUF of llama.cpp's `arch`: the loaded file keeps
    its blocks and its logits on prompts of `prompt_lens` tokens equal HF's on the rounded weights."""
    import copy

    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    from models_helpers import write_gguf

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    # float32 tolerances: the blocks' integer and float32 paths, not the bf16 one a prefill takes on
    # AVX512_BF16 CPUs (held to HF's own bf16 forward in test_models_smollm2.py)
    monkeypatch.setattr(native, "bf16_matmul_available", lambda: False)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(hf)
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(hf, path, arch=arch, qtype=GGMLQuantizationType.Q8_0)
    loaded = load_model(str(path))
    assert loaded.linear_method == "gguf"
    assert not [name for name, p in loaded.model.named_parameters() if p.dim() > 1]  # all still blocks
    rounded = copy.deepcopy(hf)
    with torch.no_grad():
        for param in rounded.parameters():
            if param.dim() > 1:
                q8 = quantize(param.numpy(), GGMLQuantizationType.Q8_0)
                param.copy_(torch.from_numpy(dequantize(q8, GGMLQuantizationType.Q8_0)))
    batch = prompts(prompt_lens, hf.config.vocab_size, seed=7)
    cache = PagedCache.create(loaded.config, 32, 8)
    got = forward_chunks(loaded.model, cache, [(i, p, 0) for i, p in enumerate(batch)])
    expected = torch.cat([hf_logits(rounded, p) for p in batch])
    # The kernel's integer path rounds activations to int16 blocks: a little more than float32's 1e-4.
    torch.testing.assert_close(got, expected, atol=3e-4, rtol=1e-3)


def fusable_layers(config) -> list[bool]:
    """Which layers run as one C++ call: every family's, QK-norm and Gemma's norms around the MLP included,
    but a mixture of experts' (its tokens are routed between the ops)."""
    return [i not in config.moe_layers for i in range(config.num_layers)]


def _mixed_steps(model, kv_dtype: torch.dtype) -> list[torch.Tensor]:
    """Logits of a prefill of three prompts, then decode steps of one and of several sequences mixed with
    a later prefill chunk, on a fresh cache of `kv_dtype`."""
    seqs = prompts([23, 30, 9], model.config.vocab_size, seed=4)
    cache = PagedCache.create(model.config, 32, 5, dtype=kv_dtype, seed=5)
    logits = [forward_chunks(model, cache, [(i, s, 0) for i, s in enumerate(seqs)])]
    for step in range(3):
        logits.append(forward_chunks(model, cache, [(0, [step + 1], len(seqs[0]) + step)]))
        chunk = [step + 2] * (step + 1)
        decode = [(1, [step + 3], len(seqs[1]) + step), (2, chunk, len(seqs[2]) + step * (step + 1) // 2)]
        logits.append(forward_chunks(model, cache, decode))
    return logits


@pytest.mark.parametrize(
    ("quantization", "dtype", "kv_dtype", "method"),
    [
        ("none", torch.float32, torch.float32, "kernel"),
        ("none", torch.bfloat16, torch.bfloat16, "kernel"),
        ("int8", torch.float32, torch.bfloat16, None),  # kv_cache_dtype=bfloat16 under float32 activations
        ("int4", torch.bfloat16, torch.bfloat16, None),
        ("none", torch.float32, torch.float32, "onednn"),  # oneDNN's packed weights: the AVX2 float32 default
        ("none", torch.bfloat16, torch.bfloat16, "onednn"),  # and bfloat16's above a few rows
    ],
)
@pytest.mark.parametrize("isa", native.supported_isas() or [None])
def test_a_layer_in_one_call_equals_its_ops_one_by_one(
    checkpoint, quantization, dtype, kv_dtype, method, isa, monkeypatch
):
    """Where every weight is in the C++ kernel's storage or oneDNN's, a layer of every family runs as one
    call of the same kernels (the cpu backend's fused_decoder_layer): its logits must be bit-identical to
    the layer's ops called from Python, on every C++ build this CPU runs."""
    if isa is None:
        pytest.skip(native.unavailable_reason() or "no C++ build for this CPU")
    monkeypatch.setattr(native, "selected_isa", lambda: isa)
    if method is not None:
        monkeypatch.setenv("PAGEDLLM_LINEAR_METHOD", method)
    if method == "onednn":
        skip_unless_onednn_packs(dtype)
    _, folder = checkpoint
    model = load_model(str(folder), dtype=dtype, quantization=quantization, max_num_seqs=4).model
    one_call = [layer.fused is not None for layer in model.layers]
    assert one_call == fusable_layers(model.config)
    fused = _mixed_steps(model, kv_dtype)
    for layer in model.layers:
        layer.fused = None
    by_ops = _mixed_steps(model, kv_dtype)
    assert all(torch.equal(a, b) for a, b in zip(fused, by_ops, strict=True))
    assert not any(t.isnan().any() for t in fused)


def random_adapters(model, seed: int, dtype: torch.dtype) -> list[LoRAModel]:
    """Two adapters of `model` (after attach_lora): one of every projection, fused ones in pieces of each
    shard (rank 8); one of q, v and down alone (rank 4), so that its qkv update has a gap at k."""
    gen = torch.Generator().manual_seed(seed)
    made = []
    for int_id, (rank, only) in enumerate([(8, None), (4, ("q_proj", "v_proj", "down_proj"))], start=1):
        lora = LoRAModel(f"random-{int_id}", int_id, "", LoRAConfig(rank, float(rank)))
        for name, module in model.named_modules():
            shards = getattr(module, "shards", None) or {
                name.rpartition(".")[2]: getattr(module, "out_features", 0)
            }
            if getattr(module, "lora", None) is None:
                continue
            pieces, row = [], 0
            for shard, rows in shards.items():
                if only is None or shard in only:
                    a = torch.randn(rank, module.in_features, generator=gen) / module.in_features**0.5
                    pieces.append(
                        (row, a.to(dtype), (torch.randn(rows, rank, generator=gen) / rank).to(dtype))
                    )
                row += rows
            if pieces:
                lora.layers[name] = LoRALayer.of_pieces(pieces)
        made.append(lora)
    return made


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", native.supported_isas() or [None])
def test_a_layer_in_one_call_with_adapters_equals_its_ops_one_by_one(checkpoint, dtype, isa, monkeypatch):
    """Steps mixing two adapters and the base (rows interleaved, prefill and decode): the one call adds
    each row's LoRA update after each projection as the ops do, to the bit; and the update is there."""
    if isa is None:
        pytest.skip(native.unavailable_reason() or "no C++ build for this CPU")
    monkeypatch.setattr(native, "selected_isa", lambda: isa)
    monkeypatch.setenv("PAGEDLLM_LINEAR_METHOD", "kernel")
    _, folder = checkpoint
    model = load_model(str(folder), dtype=dtype, quantization="none", max_num_seqs=4).model
    state = attach_lora(model)
    base = _mixed_steps(model, dtype)
    adapters = random_adapters(model, seed=3, dtype=dtype)
    model.register_forward_pre_hook(  # rows cycle through the base, the first adapter, the second
        lambda _, args: state.set_step(adapters, np.arange(len(args[0])) % 3 - 1, torch.device("cpu"))
    )
    fused = _mixed_steps(model, dtype)
    assert [layer.fused is not None for layer in model.layers] == fusable_layers(model.config)
    for layer in model.layers:
        layer.fused = None
    by_ops = _mixed_steps(model, dtype)
    assert all(torch.equal(a, b) for a, b in zip(fused, by_ops, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(fused, base, strict=True))


def test_a_layer_runs_one_call_only_where_the_kernels_run_every_op(checkpoint, monkeypatch):
    """torch's plain F.linear (the dense method) keeps the layer's ops one by one; oneDNN's prepacked
    weights and the kernel's storage take the one call."""
    _, folder = checkpoint
    monkeypatch.setenv("PAGEDLLM_LINEAR_METHOD", "dense")
    model = load_model(str(folder), quantization="none", max_num_seqs=64).model
    assert all(layer.fused is None for layer in model.layers)
    for method in ("onednn", "kernel"):
        monkeypatch.setenv("PAGEDLLM_LINEAR_METHOD", method)
        model = load_model(str(folder), quantization="none", max_num_seqs=64).model
        fused = [layer.fused is not None for layer in model.layers]
        assert fused == fusable_layers(model.config)
