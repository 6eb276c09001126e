"""`pagedllm bench kernel --decoder-layer`: the one-call layer's step time against its ops, on tiny random
checkpoints (a smoke test of the command and its checks; no timing is asserted)."""

from __future__ import annotations

import pytest
import torch
from models_helpers import TINY
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig

from pagedllm.bench import kernel
from pagedllm.models import load_model
from pagedllm.models.fused_timing import time_fused_decode
from pagedllm.ops import native

pytestmark = pytest.mark.skipif(native.unavailable_reason() is not None, reason="needs the C++ kernels")

SHAPE = {**TINY, "max_position_embeddings": 512}  # room for the command's 200 + 128 positions
CONFIGS = {
    "llama": lambda: LlamaConfig(**SHAPE),
    "gemma3": lambda: Gemma3TextConfig(
        **{**SHAPE, "num_key_value_heads": 1}, head_dim=32, sliding_window=9, query_pre_attn_scalar=24
    ),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def folder(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(CONFIGS[request.param](), dtype=torch.float32)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return path


def test_every_layer_runs_one_call_and_decodes_the_same_tokens(folder, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_LINEAR_METHOD", "kernel")
    model = load_model(str(folder), max_num_seqs=1).model
    timing = time_fused_decode(model, context=20, steps=6, rounds=2)
    assert timing.fused_layers == timing.layers == model.config.num_layers
    assert len(timing.fused_ms) == len(timing.by_ops_ms) == 2
    assert timing.backend == "cpu" and timing.speedup > 0
    assert all(layer.fused is not None for layer in model.layers)  # restored after the rounds


def test_a_model_without_one_call_layers_is_refused(folder, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_LINEAR_METHOD", "dense")  # torch's F.linear: no one call
    model = load_model(str(folder), max_num_seqs=1).model
    with pytest.raises(RuntimeError, match="no layer of this model runs as one call"):
        time_fused_decode(model, context=4, steps=2, rounds=1)


def test_the_bench_command_prints_the_ratio(folder, monkeypatch, capsys):
    monkeypatch.setenv("PAGEDLLM_LINEAR_METHOD", "kernel")
    assert kernel.main(["--decoder-layer", str(folder)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{folder} (kernel weights, cpu backend")
    assert out[1].startswith("one call   ms/step:") and out[2].startswith("op by op   ms/step:")
    assert out[3].startswith("one call is ") and out[3].endswith("x as fast (same tokens both ways)")
