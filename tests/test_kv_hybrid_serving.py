"""What the hybrid KV cache buys on Gemma 3 (15 sliding-window layers of 18): KV bytes per request and
requests running at once, without weights (`pagedllm bench memory --hybrid`'s scheduler replay), and
the same through a real server's /metrics (manual: eight 1,600-token prefills of the 270M model)."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest
import torch
from helpers import assert_all_blocks_free, running_server

from pagedllm.bench import memory
from pagedllm.bench.kv_groups import Geometry, request_bytes, serve_at_once
from pagedllm.models.loader import read_config, resolve_checkpoint

MiB = 2**20


@pytest.fixture(scope="module")
def gemma3_config():
    return read_config(resolve_checkpoint("gemma3-270m"))


def test_an_8k_request_holds_over_4x_less_kv_and_a_1k_one_its_full_groups_and_windows(gemma3_config):
    geometry = Geometry(gemma3_config, torch.float32)
    full, _ = request_bytes(geometry, False, 8192)
    hybrid, peak = request_bytes(geometry, True, 8192)
    token_bytes = 2 * 256 * 4  # one layer's K and V of a token, float32
    assert full == 8192 * 18 * token_bytes + 18 * 16 * token_bytes  # every layer, the decode's new block
    assert full / hybrid >= 4 and hybrid < peak < full
    small, _ = request_bytes(geometry, True, 1024)
    # 3 full layers hold 65 blocks; 15 sliding layers each the 33 blocks a 512-token window spans
    assert small == (3 * 65 + 15 * 33) * 16 * token_bytes


def test_at_128mib_eight_1600_token_requests_run_four_at_a_time_where_full_history_runs_two(gemma3_config):
    """The issue's /metrics check, replayed by the scheduler over the real allocator: float32 KV, 512-token
    prefill chunks (`pagedllm serve` on 2 CPUs)."""
    geometry = Geometry(gemma3_config, torch.float32, max_num_batched_tokens=512)
    full = serve_at_once(geometry, False, 128 * MiB, 8, 1600, 64)
    hybrid = serve_at_once(geometry, True, 128 * MiB, 8, 1600, 64)
    assert full.max_running == 2 and hybrid.max_running >= 4
    assert hybrid.steps < full.steps and full.preemptions == hybrid.preemptions == 0


def test_at_256mib_4k_token_requests_run_six_decoding_and_a_seventh_prefilling_where_full_history_runs_one(
    gemma3_config,
):
    """Admission asks a prompt's first chunk (vLLM v1's rule), and chunks take the blocks that are free:
    six 4k requests decode while a seventh fills the rest of the pool with its prompt, preempted when a
    decode needs a block, so the slots live while requests wait are nearly all of the pool."""
    geometry = Geometry(gemma3_config, torch.float32)
    full = serve_at_once(geometry, False, 256 * MiB, 8, 3840, 256)
    hybrid = serve_at_once(geometry, True, 256 * MiB, 8, 3840, 256)
    assert full.max_running == 1 and hybrid.max_running == 7 and full.preemptions == 0
    assert 0 < hybrid.preemptions <= 2  # the seventh, each time its partial prompt meets a decode's block
    # One 4k request decoding holds 256 + 5 * 34 of 2,730 blocks (hybrid), 256 of 455 (full history).
    assert full.live_share < 0.6 and hybrid.live_share > 0.94


def test_bench_memory_hybrid_prints_both_tables(capsys):
    argv = ["--hybrid", "--context-lens", "1024", "--hybrid-requests", "3", "--prompt-len", "600"]
    assert memory.main([*argv, "--output-len", "8", "--kv-cache-memory", "48MiB"]) == 0
    out = capsys.readouterr().out
    assert "1024     36.6          21.6" in out and "hybrid vs full history:" in out


def _max_running(base: str, prompts: list[list[int]]) -> int:
    """Send a completion of each prompt at once; the most /metrics ever showed running."""

    def send(prompt: list[int]) -> None:
        body = {"prompt": prompt, "max_tokens": 64, "ignore_eos": True, "temperature": 0}
        headers = {"Content-Type": "application/json"}
        request = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(), headers)
        urllib.request.urlopen(request, timeout=900).read()

    threads = [threading.Thread(target=send, args=(prompt,)) for prompt in prompts]
    for thread in threads:
        thread.start()
    most = 0
    while any(thread.is_alive() for thread in threads):
        text = urllib.request.urlopen(f"{base}/metrics").read().decode()
        line = next(line for line in text.splitlines() if line.startswith("pagedllm:num_requests_running "))
        most = max(most, int(float(line.split()[1])))
        time.sleep(0.1)
    return most


@pytest.mark.manual
@pytest.mark.parametrize(("disable", "expected"), [(False, 4), (True, 2)], ids=["hybrid", "full-history"])
def test_metrics_shows_the_running_requests_the_hybrid_cache_fits(disable, expected):
    from pagedllm.entrypoints.openai.server import build_app

    app = build_app(
        "gemma3-270m",
        kv_cache_memory="128MiB",
        kv_cache_dtype="float32",
        max_model_len=2048,
        max_num_batched_tokens=512,
        disable_hybrid_kv_cache_manager=disable,
    )
    # Eight different prompts (from their second token on): no prefix-cache hit shares their blocks.
    prompts = [[2] + [(17 * i + 1000 * r) % 20000 + 100 for i in range(1599)] for r in range(8)]
    with running_server(app) as base:
        most = _max_running(base, prompts)
        assert most >= expected if not disable else most == expected, most
        assert_all_blocks_free(app.state.engine.engine)
