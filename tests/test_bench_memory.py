"""`pagedllm bench memory` at a small scale: the documented shape and the JSON schema."""

import json
import os
import statistics
import subprocess
import sys

import pytest

from pagedllm.bench import memory
from pagedllm.bench.trace import WORKLOADS, make_trace

SMALL = ["--num-requests", "600", "--num-blocks", "2048", "--seed", "1"]


def run_json(argv, capsys):
    assert memory.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_sharegpt_shows_the_papers_shape(capsys):
    out = run_json(SMALL, capsys)
    assert out["config"]["workload"] == "sharegpt" and out["config"]["num_slots"] == 2048 * 16
    rows = {(r["layout"], r["reserve"]): r for r in out["rows"]}
    assert list(rows) == [
        ("paged", None),
        ("contiguous", "max"),
        ("contiguous", "pow2"),
        ("contiguous", "oracle"),
    ]
    for r in rows.values():
        assert 0.0 <= r["live_fraction"] <= 1.0 and r["memory_bound_steps"] > 0
        parts = ["live_fraction", "reserved_fraction", "tail_fraction", "external_fraction", "idle_fraction"]
        assert sum(r[p] for p in parts) == pytest.approx(1.0)
    paged, cmax, pow2, oracle = rows.values()
    assert paged["live_fraction"] >= 0.96
    assert (
        cmax["live_fraction"]
        < pow2["live_fraction"]
        < oracle["live_fraction"]
        < 0.75 * paged["live_fraction"]
    )
    assert paged["reserved_fraction"] == 0 and paged["external_fraction"] == 0
    assert cmax["tail_fraction"] == 0 and cmax["reserved_fraction"] > 0.5
    assert oracle["external_fraction"] > 0  # first fit strands gaps even with exact reservations
    assert paged["mean_seqs"] > oracle["mean_seqs"] and paged["steps"] < oracle["steps"] < cmax["steps"]
    assert paged["preemptions"] > 0 and paged["recomputed_tokens"] > 0  # paged admits eagerly, then preempts
    assert all(r["preemptions"] == 0 for r in (cmax, pow2, oracle))


def test_pageds_live_share_is_printed_with_its_preemptions_and_recomputed_tokens(capsys):
    """The headline share is never printed without what the same replay paid for it."""
    out = run_json(SMALL, capsys)
    paged = out["rows"][0]
    assert memory.main(SMALL) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("paged: "))
    assert line.startswith(f"paged: {100 * paged['live_fraction']:.1f}% of slots live, with ")
    paid = f"{paged['preemptions']:,} preemptions that recomputed {paged['recomputed_tokens']:,} tokens"
    assert paid in line and paged["preemptions"] > 0


def test_alpaca_short_sequences_pay_more_block_tail(capsys):
    out = run_json(["--workload", "alpaca", "--num-requests", "1500", "--num-blocks", "512"], capsys)
    paged, cmax, pow2, oracle = out["rows"]
    assert paged["tail_fraction"] > 0.03  # ~40-token sequences leave a larger share of each last block empty
    assert paged["live_fraction"] > 1.5 * oracle["live_fraction"] and cmax["live_fraction"] < 0.1


def test_profile_reports_allocator_ops_per_second(capsys):
    out = run_json([*SMALL, "--num-requests", "100", "--profile"], capsys)
    for r in out["rows"]:
        assert r["alloc_ops"] > 100 * 2 and r["alloc_ops_per_s"] > 0 and r["replay_s"] > 0


def test_module_entry_point_prints_the_table():
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.run(
        [sys.executable, "-m", "pagedllm.bench.memory", *SMALL, "--num-requests", "100"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("pagedllm bench memory: sharegpt, 100 requests")
    assert [line.split()[:2] for line in lines[3:7]] == [
        ["paged", "-"],
        ["contiguous", "max"],
        ["contiguous", "pow2"],
        ["contiguous", "oracle"],
    ]


def test_a_cache_too_small_for_one_sequence_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        memory.main(["--num-blocks", "4", "--max-model-len", "2048"])
    assert exit_info.value.code == 2
    assert "64 KV slots cannot hold one sequence of max_model_len 2048" in capsys.readouterr().err


def test_traces_are_seeded_and_have_the_documented_means():
    trace = make_trace(WORKLOADS["sharegpt"], 20000, rate=4.0, seed=3, max_model_len=2048)
    assert trace == make_trace(WORKLOADS["sharegpt"], 20000, rate=4.0, seed=3, max_model_len=2048)
    assert statistics.fmean(r.prompt_len for r in trace) == pytest.approx(161.31, rel=0.05)
    assert statistics.fmean(r.output_len for r in trace) == pytest.approx(337.99, rel=0.05)
    assert trace[-1].arrival_step == pytest.approx(20000 / 4.0, rel=0.05)  # Poisson at `rate` per step
    arrivals = [r.arrival_step for r in trace]
    assert arrivals == sorted(arrivals)
    assert all(r.prompt_len >= 1 and r.output_len >= 1 and r.prompt_len + r.output_len <= 2048 for r in trace)
    alpaca = make_trace(WORKLOADS["alpaca"], 20000, rate=4.0, seed=3, max_model_len=2048)
    assert statistics.fmean(r.prompt_len for r in alpaca) == pytest.approx(19.31, rel=0.05)
    assert statistics.fmean(r.output_len for r in alpaca) == pytest.approx(58.45, rel=0.05)
