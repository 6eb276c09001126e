"""What the benchmarks stamp and print, on a tiny model and in child processes: a chunked prompt's time to
first token, what ran, the peers' own environment, llama-bench's JSON, and kernels that cannot be built."""

from __future__ import annotations

import importlib.util
import json
import textwrap

import pytest
from helpers import assert_all_blocks_free

from pagedllm import LLM, SamplingParams
from pagedllm.bench import flags, kernel, latency, linear, llama_bench, throughput
from pagedllm.bench.peers import DEFAULTED_THREADS, peer_env, run_script
from pagedllm.ops import native


def test_a_chunked_prompts_first_token_comes_after_its_last_chunk(tiny_llama_dir):
    """A 100-token prompt on a 16-token step budget is prefilled in 7 steps that give no token: the first
    token's time covers every one of them, and each later gap is one decode step."""
    llm = LLM(str(tiny_llama_dir), kv_cache_memory="4MiB", max_num_batched_tokens=16, max_num_seqs=1)
    steps = []  # (prefill tokens, seconds) of every step
    llm.engine.add_step_observer(
        lambda trace: steps.append((trace.prefill_tokens, sum(trace.seconds.values())))
    )
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    run = latency.timed_request(llm.engine, "chunked", list(range(1, 101)), params)
    prefills = [seconds for tokens, seconds in steps if tokens]
    assert [tokens for tokens, _ in steps if tokens] == [16] * 6 + [4]  # every chunk, then 4 decodes
    assert len(steps) == 7 + 4
    assert run.ttft_s >= sum(prefills)  # not the first chunk's step alone
    assert len(run.tokens) == 5 and len(run.itl_s) == 4  # the gaps after the first token: decodes only
    # the same tokens as the engine gives the prompt in one go
    (whole,) = LLM(str(tiny_llama_dir), kv_cache_memory="4MiB").generate([list(range(1, 101))], params)
    assert run.tokens == list(whole.outputs[0].token_ids)
    assert_all_blocks_free(llm)


def test_run_info_says_what_the_engine_runs(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), kv_cache_memory="4MiB")
    info = llm.engine.run_info()
    # 2 layers of q/k/v, o, gate/up, down projections (fused or not) and the LM head: every one counted
    assert sum(info.weight_kinds.values()) >= 2 * 4 + 1
    assert info.kv_token_bytes == 2 * 2 * 2 * 16 * 2  # K and V, 2 layers, 2 KV heads of 16, float16
    assert info.vocab_size == 384 and info.attention_backend in ("cpu", "sdpa")
    assert info.cpu_isa == (native.selected_isa() if native.unavailable_reason() is None else None)
    line = info.describe()
    assert line.startswith(f"attention {info.attention_backend}") and line.endswith(f"{info.threads} threads")
    assert f"linear {info.linear_method}: " in line and "K/V float16; " in line  # the CPU's default cache
    assert_all_blocks_free(llm)


def test_a_peer_runs_without_what_pagedllm_set_for_itself(tmp_path, monkeypatch):
    """The child sees neither pagedllm's OpenMP settings nor a thread count pagedllm chose; it gets what
    the peer is given, and the row's line names both."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv(DEFAULTED_THREADS, "2")
    monkeypatch.setenv("PAGEDLLM_ATTN_BACKEND", "sdpa")
    env = peer_env(VLLM_CPU_KVCACHE_SPACE="4")
    assert env.removed == sorted(
        ["OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", DEFAULTED_THREADS, "PAGEDLLM_ATTN_BACKEND"]
    )
    assert env.describe() == f"own process; removed {', '.join(env.removed)}; set VLLM_CPU_KVCACHE_SPACE=4"
    script = tmp_path / "child.py"
    script.write_text(
        textwrap.dedent(
            """
            import json, os, sys
            job = json.load(sys.stdin)
            names = ["OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "VLLM_CPU_KVCACHE_SPACE"]
            seen = {name: os.environ.get(name) for name in names}
            print("a peer's own logging on stdout")
            json.dump({"seen": seen, "modules": "pagedllm" in sys.modules}, open(job["result_path"], "w"))
            """
        )
    )
    result = run_script(script, {}, env, "test peer")
    assert result == {
        "seen": {
            "OMP_WAIT_POLICY": None,
            "GOMP_SPINCOUNT": None,
            "OMP_NUM_THREADS": None,
            "VLLM_CPU_KVCACHE_SPACE": "4",
        },
        "modules": False,
    }
    # a user's own thread count stays (pagedllm did not choose it)
    monkeypatch.delenv(DEFAULTED_THREADS)
    assert "OMP_NUM_THREADS" in peer_env().env


def test_a_failing_peer_names_itself_and_its_error(tmp_path):
    script = tmp_path / "child.py"
    script.write_text("import sys\nsys.exit('no model here')\n")
    with pytest.raises(RuntimeError, match="test peer child failed \\(exit 1\\):\nno model here"):
        run_script(script, {}, peer_env(), "test peer")


# llama-bench -o json on a CPU build: one object per test, each with every field of the format in llama.cpp's
# tools/llama-bench README ("JSON"); the tg test differs from the pp one in its counts and times.
_PP = {
    "build_commit": "b5c8ed3b", "build_number": 6132, "cpu_info": "AMD EPYC 9R14", "gpu_info": "",
    "backends": "CPU", "model_filename": "qwen2.5-coder-1.5b-instruct-q4_0.gguf",
    "model_type": "qwen2 1.5B Q4_0", "model_size": 1011884032, "model_n_params": 1543714304,
    "n_batch": 2048, "n_ubatch": 512, "n_threads": 2, "cpu_mask": "0x0", "cpu_strict": False, "poll": 50,
    "type_k": "f16", "type_v": "f16", "n_gpu_layers": 99, "split_mode": "layer", "main_gpu": 0,
    "no_kv_offload": False, "flash_attn": False, "tensor_split": "0.00", "use_mmap": True,
    "embeddings": False, "n_prompt": 512, "n_gen": 0, "n_depth": 0, "test_time": "2026-12-04T20:00:00Z",
    "avg_ns": 4140000000, "stddev_ns": 21000000, "avg_ts": 123.671498, "stddev_ts": 0.627301,
    "samples_ns": [4120000000, 4150000000, 4150000000], "samples_ts": [124.27, 123.37, 123.37],
}  # fmt: skip
_TG = {**_PP, "n_prompt": 0, "n_gen": 128, "test_time": "2026-12-04T20:00:13Z", "avg_ns": 6400000000,
       "stddev_ns": 40000000, "avg_ts": 20.000625, "stddev_ts": 0.125004,
       "samples_ns": [6360000000, 6400000000, 6440000000], "samples_ts": [20.13, 20.0, 19.88]}  # fmt: skip
LLAMA_BENCH_JSON = json.dumps([_PP, _TG], indent=2)


def test_llama_bench_json_gives_pp_and_tg_rates():
    pp, tg = llama_bench.parse(LLAMA_BENCH_JSON)
    assert (pp.test, pp.tokens_per_s, pp.stddev_tokens_per_s, pp.repetitions) == (
        "pp512",
        123.671498,
        0.627301,
        3,
    )
    assert (tg.test, tg.tokens_per_s, tg.threads, tg.type_k, tg.type_v) == (
        "tg128",
        20.000625,
        2,
        "f16",
        "f16",
    )
    assert pp.build == "b5c8ed3b (6132)" and pp.backends == "CPU" and pp.model_type == "qwen2 1.5B Q4_0"
    lines = llama_bench.report([pp, tg], peer_env())
    assert [line.split()[0] for line in lines[1:3]] == ["pp512", "tg128"]
    assert lines[-1].startswith("  ran: llama.cpp build b5c8ed3b (6132), CPU, qwen2 1.5B Q4_0, 2 threads")
    assert "own process; removed" in lines[-1]


def test_llama_bench_output_that_is_not_its_json_is_named():
    with pytest.raises(ValueError, match="llama-bench printed no JSON"):
        llama_bench.parse("| model | size |")
    with pytest.raises(ValueError, match="lacks 'avg_ts'"):
        llama_bench.parse(json.dumps([{"n_prompt": 512, "n_gen": 0}]))
    with pytest.raises(ValueError, match="neither pp nor tg"):
        llama_bench.parse(json.dumps([{"n_prompt": 16, "n_gen": 16}]))


def test_llama_bench_command_times_each_prompt_length_and_the_output(tmp_path):
    argv = llama_bench.command(tmp_path / "llama-bench", tmp_path / "m.gguf", [200, 1000], 128, 4, 5)
    assert argv[1:] == [
        "-m",
        str(tmp_path / "m.gguf"),
        "-p",
        "200,1000",
        "-n",
        "128",
        "-t",
        "4",
        "-r",
        "5",
    ] + [
        "-o",
        "json",
    ]
    with pytest.raises(FileNotFoundError, match="--llama-bench .*: no such file"):
        llama_bench.run(tmp_path / "llama-bench", tmp_path / "m.gguf", [8], 8, 1, peer_env())


def test_latency_llama_bench_needs_the_binary_and_a_gguf(tmp_path, capsys):
    with pytest.raises(SystemExit):
        latency.main(["--llama-bench", str(tmp_path / "missing")])
    assert f"--llama-bench {tmp_path / 'missing'}: no such file" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_throughput_vllm_needs_vllm():
    with pytest.raises(SystemExit, match="--vllm needs vLLM"):
        throughput.main(["--vllm", "--num-prompts", "1", "--layouts", "paged", "--output-len", "1"])


def _unbuildable(monkeypatch):
    """The cpu kernels as on a machine where they cannot be built (the real check, made to say why)."""
    monkeypatch.setattr(native, "unavailable_reason", lambda: "building the avx2 kernels failed: no compiler")


def test_kernel_bench_stops_naming_why_a_kernel_cannot_be_built(monkeypatch, capsys):
    _unbuildable(monkeypatch)
    with pytest.raises(SystemExit, match="--backends cpu cannot run here: building the avx2 kernels failed"):
        kernel.main(["--backends", "cpu", "--dtypes", "fp32", "--num-seqs", "1", "--reps", "1"])


def test_linear_bench_stops_naming_why_a_kernel_cannot_be_built(monkeypatch, capsys):
    _unbuildable(monkeypatch)
    with pytest.raises(SystemExit):
        linear.main(["--methods", "kernel fp32", "--rows", "1", "--layers", "1"])
    assert (
        "--methods 'kernel fp32' cannot run here: building the avx2 kernels failed" in capsys.readouterr().err
    )


def test_json_object_names_the_flag():
    assert flags.json_object("--x", '{"a": 1}') == {"a": 1} and flags.json_object("--x", None) is None
    with pytest.raises(ValueError, match="--x must be a JSON object"):
        flags.json_object("--x", "[1]")
    with pytest.raises(ValueError, match="--x is not JSON"):
        flags.json_object("--x", "{")
