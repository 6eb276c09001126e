"""`pagedllm bench serve`: the load generator and the soak, against the real server (uvicorn) on a tiny
model; the bench starts `pagedllm serve` as a subprocess itself, or targets --base-url."""

from __future__ import annotations

import json

import pytest
from helpers import running_server, wait_until_idle

from pagedllm.bench import serve, soak
from pagedllm.entrypoints.openai.limits import ServerLimits
from pagedllm.entrypoints.openai.server import build_app


def _run_json(capsys, argv: list[str]) -> tuple[int, dict]:
    code = serve.main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_soak_of_1000_requests_with_faults_passes(capsys, tiny_chat_model):
    """The bounded soak: 1,000 requests at 32 in flight against max_num_seqs 8, a KV cache of 20 blocks of
    32 tokens (preemption), a quarter of them faults; every criterion must hold, the server must exit 0."""
    argv = ["--soak", "--model", str(tiny_chat_model), "--num-prompts", "1000", "--input-len", "20-120"]
    argv += ["--output-len", "8", "--kv-cache-memory", "160KiB", "--max-model-len", "256"]
    argv += ["--max-num-seqs", "8", "--max-concurrency", "32"]
    code, report = _run_json(capsys, argv)
    failed = [c for c in report["criteria"] if not c[1]]
    assert code == 0 and report["passed"], failed
    counts = report["counts"]
    assert sum(counts.values()) == 1000 and min(counts.values()) > 40, counts
    assert report["state"]["preemptions"] > 0  # the small KV cache really forced preemption
    assert any(name.startswith("graceful shutdown") and ok for name, ok, _ in report["criteria"])


def test_soak_criteria_fail_on_an_incomplete_answer():
    state = soak.ServerState(running=0, waiting=0, kv_usage=0.0, preemptions=3, healthy=True)
    outcomes = [soak.Outcome("ok", True), soak.Outcome("ok", False, "incomplete: 7/8 tokens")]
    rows = soak.criteria(soak.SoakReport(outcomes, 1.0, 0.1, state), exit_code=0)
    assert [ok for _, ok, _ in rows[:2]] == [False, True]
    state.kv_usage = 0.25
    rows = soak.criteria(soak.SoakReport(outcomes[:1], 1.0, 0.1, state), exit_code=1)
    assert {name: ok for name, ok, _ in rows} == {
        "every well-formed request answered completely": True,
        "every bad request refused with a 4xx and a message": True,
        "clients that disconnected mid-stream": True,
        "server alive after the traffic (/health)": True,
        "KV pool all free, nothing running or waiting (/metrics)": False,
        "graceful shutdown (SIGTERM -> exit 0)": False,
    }


def test_bench_serve_reports_and_compares_with_offline(capsys, tiny_chat_model):
    argv = [
        "--model",
        str(tiny_chat_model),
        "--num-prompts",
        "12",
        "--input-len",
        "10-40",
        "--output-len",
        "6",
    ]
    argv += ["--ignore-eos", "--max-concurrency", "4", "--kv-cache-memory", "8MiB", "--max-model-len", "256"]
    code, report = _run_json(capsys, [*argv, "--compare-offline"])
    s = report["summary"]
    assert code == 0 and (s["completed"], s["failed"]) == (12, 0)
    assert s["output_tokens"] == 12 * 6  # EOS ignored: exactly the length asked for
    assert 0 < s["ttft_ms"]["p50"] <= s["e2e_ms"]["p99"]
    assert s["itl_ms"]["p50"] <= s["itl_ms"]["p99"] and s["client_cpu_seconds"] > 0
    assert report["offline"]["output_tok_s"] > 0 and report["served_over_offline"] > 0
    # random prompts share no block, and the warm-up request left none of them cached
    assert s["prefix_cache"] == {"queries": s["prompt_tokens"], "hits": 0, "external_hits": 0}


def _tenants(model, num_prompts: int) -> list[str]:
    """6 tenants' 64-token system prompts (2 blocks of 32 float16 tokens, 8 KiB each) over a device cache of
    8 blocks: it keeps about one beside the 2 requests running."""
    argv = [
        "--model",
        str(model),
        "--num-prompts",
        str(num_prompts),
        "--input-len",
        "8-16",
        "--output-len",
        "4",
    ]
    argv += ["--shared-prefix-len", "64", "--num-shared-prefixes", "6", "--max-concurrency", "2"]
    return argv + ["--ignore-eos", "--kv-cache-memory", "64KiB", "--max-model-len", "256"]


def test_bench_serve_tenants_with_and_without_a_host_tier_side_by_side(capsys, tiny_chat_model):
    argv = _tenants(tiny_chat_model, 24)  # a host tier of 1 MiB keeps every tenant
    code, report = _run_json(capsys, [*argv, "--kv-offload-memory", "none", "1MiB"])
    without, with_tier = (run["summary"] for run in report["runs"])
    assert code == 0 and [run["kv_offload_memory"] for run in report["runs"]] == ["none", "1MiB"]
    assert without["completed"] == with_tier["completed"] == 24
    assert without["prompt_tokens"] == with_tier["prompt_tokens"]  # the same requests
    assert without["prefix_cache"]["external_hits"] == 0 < with_tier["prefix_cache"]["external_hits"]
    assert with_tier["prefix_cache"]["hits"] > without["prefix_cache"]["hits"]
    code = serve.main([*argv, "--kv-offload-memory", "none", "1MiB", "--num-prompts", "4"])
    table = capsys.readouterr().out
    assert code == 0 and "kv offload memory" in table and "\n              1MiB" in table


def test_bench_serve_setups_side_by_side_in_the_order_given(capsys, tiny_chat_model):
    argv = _tenants(tiny_chat_model, 16)  # a row's own --kv-cache-memory overrides the bench's
    setups = ["large cache: --kv-cache-memory 2MiB", "small: "]
    code, report = _run_json(capsys, [*argv, "--setups", *setups])
    assert code == 0 and [run["setup"] for run in report["runs"]] == ["large cache", "small"]
    large, small = (run["summary"] for run in report["runs"])
    assert large["completed"] == small["completed"] == 16
    assert large["prefix_cache"]["hits"] > small["prefix_cache"]["hits"]  # 2 MiB holds all 6 tenants
    with pytest.raises(SystemExit):
        serve.main([*argv, "--setups", "no label here"])
    assert "'LABEL: SERVE ARGS'" in capsys.readouterr().err


def test_runs_table_names_each_replicas_requests():
    stats = serve.Stats(1.0, 1.0, 1.0)
    summary = serve.Summary(10, 0, 2.0, 100, 40, 5.0, 20.0, 70.0, stats, stats, stats, stats, 0.1)
    summary.replicas = {"a": serve.ReplicaLoad(4, 50, 10), "b": serve.ReplicaLoad(6, 50, 30)}
    table = serve.format_runs(
        [("kv", summary, 0), ("one", serve.Summary(**vars(summary) | {"replicas": None}), 0)], "setup"
    )
    rows = table.splitlines()
    assert rows[1].endswith("6 / 4 (1.50x)") and rows[2].endswith("  -")


def test_bench_serve_on_a_given_server_with_a_key_over_chat(capsys, tiny_chat_model):
    app = build_app(str(tiny_chat_model), limits=ServerLimits(api_key="k"), max_model_len=256)
    with running_server(app) as base:
        argv = ["--base-url", base, "--model", str(tiny_chat_model), "--endpoint", "chat"]
        argv += ["--num-prompts", "6", "--input-len", "36-60", "--output-len", "4", "--ignore-eos"]
        code, report = _run_json(capsys, [*argv, "--api-key", "k", "--request-rate", "50"])
        assert code == 0 and report["summary"]["completed"] == 6
        assert report["summary"]["output_tokens"] == 24
        # the same prompts again against the same server: its prefix cache holds them now, and says so
        first = report["summary"]["prefix_cache"]
        code, report = _run_json(capsys, [*argv, "--api-key", "k", "--request-rate", "50"])
        again = report["summary"]["prefix_cache"]
        assert code == 0 and again["queries"] == first["queries"] and again["hits"] > first["hits"]
        # random token prompts (no chat template around them) share no block: a repeat is flagged
        raw = [arg for arg in argv if arg not in ("--endpoint", "chat")] + ["--api-key", "k", "--json"]
        for run in range(2):
            code = serve.main(raw)
            assert code == 0 and ("already held" in capsys.readouterr().err) == (run == 1)
        with pytest.raises(SystemExit) as info:  # without the key the server answers nothing
            serve.main(argv)
        assert info.value.code == 2 and "answered 401" in capsys.readouterr().err
        wait_until_idle(app.state.engine.engine)


@pytest.mark.parametrize("text", ["5", "9-3", "0-4", "a-b"])
def test_input_len_must_be_a_range(text, capsys):
    with pytest.raises(SystemExit):
        serve.main(["--input-len", text])
    assert "--input-len" in capsys.readouterr().err


def test_prefix_cache_counters_are_read_from_pagedllm_and_vllm_metrics():
    pagedllm_text = (
        "# HELP pagedllm:prefix_cache_hits_total Prompt tokens found in the prefix cache\n"
        "pagedllm:prefix_cache_queries_total 26272.0\npagedllm:prefix_cache_hits_total 320.0\n"
    )
    vllm_text = (
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 13275.0\n'
        'vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.796e+09\n'
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 128.0\n'
        'vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 7.0\n'
    )
    assert serve.prefix_cache_counters(pagedllm_text) == serve.PrefixCacheUse(26272.0, 320.0)
    assert serve.prefix_cache_counters(vllm_text) == serve.PrefixCacheUse(13275.0, 128.0, 7.0)
    assert serve.prefix_cache_counters("other_metric_total 3.0\n") is None
