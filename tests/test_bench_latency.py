"""`pagedllm bench latency`, `bench quality` and `bench linear` on the real model: what they print, the
quality they measure (int8 within 2% of float32's perplexity), and llama.cpp as a peer where installed."""

from __future__ import annotations

import importlib.util
import json

import pytest

from pagedllm.bench import latency, linear, quality
from pagedllm.ops import native


def test_latency_reports_ttft_decode_rate_and_itl_per_system(capsys):
    argv = ["--prompt-lens", "9", "40", "--output-len", "5", "--quantization", "none", "auto", "--json"]
    assert latency.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    systems = {s["name"]: s for s in report["systems"]}
    # none: float32 through the kernel (one request at a time: max_num_seqs=1); auto: the GGUF's own blocks
    assert list(systems) == ["pagedllm kernel", "pagedllm gguf"]
    assert (
        systems["pagedllm gguf"]["ran"].startswith("attention ")
        and "linear gguf: " in systems["pagedllm gguf"]["ran"]
    )
    assert systems["pagedllm gguf"]["weight_mib"] < systems["pagedllm kernel"]["weight_mib"] / 4
    for system in systems.values():
        assert [run["prompt_len"] for run in system["runs"]] == [9, 40]
        for run in system["runs"]:
            assert len(run["tokens"]) == 5 and len(run["itl_s"]) == 4  # EOS ignored: every token comes
            assert run["ttft_s"] > 0 and all(gap > 0 for gap in run["itl_s"])
    # The same weights: the same greedy tokens where both sum float32 products of the same values. Where
    # the CPU multiplies bf16, the blocks take their bf16 path from 10 rows on (the 40-token prompt: a bf16
    # model's rounding, and these random prompts have near-ties): only the 9-token prompt is compared there.
    compared = 1 if native.bf16_matmul_available() else 2
    assert [r["tokens"] for r in systems["pagedllm gguf"]["runs"][:compared]] == [
        r["tokens"] for r in systems["pagedllm kernel"]["runs"][:compared]
    ]


def test_latency_table_and_errors(capsys):
    argv = [
        "--prompt-lens",
        "12",
        "--output-len",
        "4",
        "--quantization",
        "int4",
        "--kv-cache-dtype",
        "bfloat16",
        "int8",
    ]
    assert latency.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:4] == ["system", "weights", "MiB", "prompt"]
    cells = lines[2].split()  # a run per K/V dtype, named by it
    assert cells[:3] == ["pagedllm", "int4", "bfloat16"] and cells[4] == "12" and cells[-1] == "4"
    assert ", K/V bfloat16; linear int4: " in lines[3]
    assert lines[4].split()[:3] == ["pagedllm", "int4", "int8"] and ", K/V int8; " in lines[5]
    with pytest.raises(SystemExit):
        latency.main(["--output-len", "2"])


def test_llama_cpp_settings_are_every_combination_llama_cpp_runs():
    """A quantized V cache needs llama.cpp's flash attention: q8_0 without it is left out, and alone it
    is a parser error (before anything loads)."""
    args = latency.build_parser().parse_args(
        [
            "--llama-cpp-types",
            "file",
            "--llama-cpp-cache-types",
            "f16",
            "q8_0",
            "--llama-cpp-flash-attn",
            "off",
            "on",
        ]
    )
    assert latency.peer_settings(args) == [
        latency.PeerSettings("file", "f16", False),
        latency.PeerSettings("file", "f16", True),
        latency.PeerSettings("file", "q8_0", True),
    ]
    args.llama_cpp_cache_types = ["q8_0"]
    args.llama_cpp_flash_attn = ["off"]
    assert latency.peer_settings(args) == []


def test_a_q8_0_cache_alone_is_refused_before_anything_loads(capsys):
    argv = ["--llama-cpp-cache-types", "q8_0", "--llama-cpp-flash-attn", "off", "--llama-cpp"]
    with pytest.raises(SystemExit):
        latency.main(argv)
    assert "--llama-cpp-cache-types q8_0 needs --llama-cpp-flash-attn on" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is not None, reason="llama-cpp-python is installed")
def test_llama_cpp_peer_needs_llama_cpp_python(capsys):
    with pytest.raises(SystemExit):
        latency.main(["--llama-cpp"])
    assert "--llama-cpp needs llama-cpp-python" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_llama_cpp_runs_the_same_file_and_its_f32_copy(capsys):
    argv = ["--prompt-lens", "20", "--output-len", "8", "--quantization", "none", "--llama-cpp", "--json"]
    assert latency.main(argv) == 0
    systems = {s["name"]: s for s in json.loads(capsys.readouterr().out)["systems"]}
    assert set(systems) == {"pagedllm kernel", "llama-cpp-python F32", "llama-cpp-python Q4_1"}
    ours, f32 = systems["pagedllm kernel"]["runs"][0], systems["llama-cpp-python F32"]["runs"][0]
    assert "own process; removed" in systems["llama-cpp-python F32"]["ran"]
    assert ours["tokens"][:4] == f32["tokens"][:4]  # the same float32 weights, greedy


def test_quality_int8_stays_within_two_percent_of_float32():
    """Perplexity of the first 512 tokens of the shipped text, and greedy agreement on 2 prompts: int8
    within 2% of fp32; the GGUF's own blocks are fp32's weights exactly (only sums are ordered
    differently), multiplied in bf16 at a prefill's many rows where the CPU has AVX512_BF16."""
    text = quality.TEXT.read_text()
    bf16_path = native.bf16_matmul_available()
    configs = ["dequantized-f32", "int8", "gguf"] + (["dequantized-bf16"] if bf16_path else [])
    results = {r.config: r for r in quality.run("smollm2-135m", configs, text, 512, 8)[0]}
    fp32 = results["dequantized-f32"].perplexity
    assert 5 < fp32 < 50
    assert abs(results["int8"].perplexity / fp32 - 1) < 0.02
    if bf16_path:  # x, W and outputs rounded to bf16: held to the bf16 weights' agreement
        assert abs(results["gguf"].perplexity / fp32 - 1) < 0.01
        assert results["gguf"].greedy_same >= results["dequantized-bf16"].greedy_same
    else:
        assert results["gguf"].perplexity == pytest.approx(fp32, rel=1e-4)
        assert results["gguf"].greedy_same == len(quality.EQUIVALENCE_PROMPTS)
    assert results["int8"].weight_mib < results["dequantized-f32"].weight_mib / 3


def test_quality_of_a_quantized_kv_cache_against_the_float32_cache(capsys):
    """--kv-cache-dtype runs each config with each cache: the int8 cache holds a token in codes plus a
    float32 scale per layer, K or V and KV head (SmolLM2: 30 layers, 3 KV heads of 64), a quarter of
    float32's bytes and more; its perplexity moves (it is the cache the prefill read) by under 1%."""
    argv = ["--configs", "gguf", "--kv-cache-dtype", "float32", "int8", "--max-text-tokens", "256"]
    assert quality.main([*argv, "--max-tokens", "8", "--json"]) == 0
    float32, int8 = json.loads(capsys.readouterr().out)
    assert (float32["kv_cache_dtype"], int8["kv_cache_dtype"]) == ("float32", "int8")
    assert float32["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4
    assert int8["kv_bytes_per_token"] == 2 * 30 * 3 * (64 + 4)
    assert int8["perplexity"] != float32["perplexity"]
    assert abs(int8["perplexity"] / float32["perplexity"] - 1) < 0.01
    assert float32["greedy_same"] == 8 and float32["greedy_prefix"] == 8.0  # the first row: itself
    assert float32["kl_divergence"] == 0 and 0 < int8["kl_divergence"] < 0.01
    prefixes = [
        quality.first_difference(a, b) for a, b in zip(int8["tokens"], float32["tokens"], strict=True)
    ]
    assert int8["greedy_prefix"] == sum(prefixes) / 8
    assert int8["greedy_same"] == sum(a == b for a, b in zip(int8["tokens"], float32["tokens"], strict=True))


def test_linear_bench_prints_a_decode_pass_and_gflops(capsys):
    argv = ["--rows", "1", "3", "--layers", "1", "--reps", "1", "--methods", "kernel int4", "int8pack bf16"]
    assert linear.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("M = 1, every layer")
    assert out[2].split()[:2] == ["kernel", "int4"] and out[2].endswith("G weights/s")
    assert out[4].startswith("M = 3, GFLOP/s per shape") and out[4].split()[-5:] == [
        "qkv",
        "o",
        "gate_up",
        "down",
        "lm_head",
    ]
    assert len(out[5].split()) == 2 + 5


def test_speculative_reports_both_engines_acceptance_and_equal_tokens(capsys):
    from pagedllm.bench import speculative

    argv = ["--model", "smollm2-135m", "--output-len", "24", "--repeats", "1", "--kv-cache-memory", "32MiB"]
    assert speculative.main(argv) == 0
    out = capsys.readouterr().out
    rows = {line.split("  ")[0]: line for line in out.splitlines()[2:4]}
    assert set(rows) == {"no speculation", "speculative"}
    last = out.splitlines()[-1]
    assert last.startswith("speculative: speed-up ") and "acceptance rate" in last
    assert last.endswith("same tokens: True")
    with pytest.raises(SystemExit):
        speculative.main(["--speculative-config", "[3]"])
    assert "--speculative-config must be a JSON object" in capsys.readouterr().err


def test_speculative_with_a_draft_model_reports_each_k(capsys):
    """The target as its own draft, on the chat prompts: every draft accepted, the same tokens."""
    from pagedllm.bench import speculative

    argv = ["--model", "smollm2-135m", "--draft-model", "smollm2-135m", "--num-speculative-tokens", "2", "3"]
    argv += ["--output-len", "12", "--repeats", "1", "--kv-cache-memory", "32MiB"]
    assert speculative.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "general chat requests" in lines[0] and "draft model smollm2-135m" in lines[0]
    assert [line.split("  ")[0] for line in lines[2:5]] == ["no speculation", "draft k=2", "draft k=3"]
    for k, line in zip((2, 3), lines[5:], strict=True):
        assert line.startswith(f"draft k={k}: speed-up ") and line.endswith("same tokens: True")


def test_speculative_with_a_draft_vocabulary_reports_it_beside_the_whole_head(capsys):
    from pagedllm.bench import speculative

    argv = ["--model", "smollm2-135m", "--draft-model", "smollm2-135m", "--num-speculative-tokens", "2"]
    argv += ["--draft-vocab-size", "1024", "--output-len", "12", "--repeats", "1"]
    argv += ["--kv-cache-memory", "32MiB"]
    assert speculative.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    names = [line.split("  ")[0] for line in lines[2:5]]
    assert names == ["no speculation", "draft k=2", "draft k=2 vocab 1024"]
    assert lines[-1].startswith("draft k=2 vocab 1024: speed-up ") and lines[-1].endswith("same tokens: True")
