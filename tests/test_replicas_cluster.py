"""`pagedllm serve --data-parallel-size 2 --address ...` on a Ray cluster of two nodes, both on this
machine's loopback (`ray start --head` and `ray start --address`, one CPU each): each replica on its own
node, answers equal to one offline engine's, every block free after, a clean exit.

Manual (PAGEDLLM_MANUAL_TESTS=1): two Ray nodes and two engines take minutes on 2 shared cores. The Ray
processes are this test's own: each `ray start --block` leads a process group of its node's processes,
and the test ends those groups (never `ray stop`, which ends every Ray process on the machine).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("ray.serve")

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.bench.serve import free_port  # noqa: E402

pytestmark = pytest.mark.manual
RAY = [sys.executable, "-m", "ray.scripts.scripts"]
SLOW_START = {"RAY_agent_register_timeout_ms": "300000", "RAY_raylet_start_wait_time_s": "300"}
# Ray 2.60's `ray start --head` turns token authentication on, and a node joining without the token is
# refused; this cluster listens on the loopback only, so every process here runs without it.
NO_AUTH = {"RAY_AUTH_MODE": "disabled"}


def _ray_node(args: list[str], log_path) -> subprocess.Popen:
    """`ray start --block` of one node on the loopback, its output in `log_path`, once it says it runs."""
    env = os.environ | SLOW_START | NO_AUTH
    argv = [*RAY, "start", "--block", "--num-cpus", "1", "--node-ip-address", "127.0.0.1"]
    argv += ["--disable-usage-stats", *args]
    with open(log_path, "w") as log:
        node = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + 300
    while "Ray runtime started" not in log_path.read_text():
        assert node.poll() is None, f"ray start exited {node.returncode}: {log_path.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"ray start {args} did not start within 300 s"
        time.sleep(1)
    return node


def _stop_group(process: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            continue


def _get(url: str):
    with urllib.request.urlopen(url, timeout=60) as response:
        return json.loads(response.read())


def test_two_ray_nodes_on_loopback_each_run_a_replica(tiny_chat_model, tmp_path):
    head_port, port = free_port(), free_port()
    address = f"127.0.0.1:{head_port}"
    log = open(tmp_path / "serve.log", "w+")  # noqa: SIM115 (closed below)
    nodes: list[subprocess.Popen] = []
    serve = None
    try:
        head = ["--head", "--port", str(head_port), "--include-dashboard", "false"]
        nodes.append(_ray_node(head, tmp_path / "head.log"))
        nodes.append(_ray_node(["--address", address], tmp_path / "node.log"))
        deadline = time.monotonic() + 300
        argv = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--model", str(tiny_chat_model)]
        argv += ["--served-model-name", "tiny", "--port", str(port), "--data-parallel-size", "2"]
        argv += ["--cpus-per-replica", "1", "--address", address, "--max-model-len", "256"]
        argv += ["--kv-cache-memory", "8MiB", "--shutdown-timeout", "10"]
        env = os.environ | NO_AUTH
        serve = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        while True:
            assert serve.poll() is None, f"pagedllm serve exited with {serve.returncode}"
            assert time.monotonic() < deadline, "the replicas were not healthy within 300 s"
            try:
                if urllib.request.urlopen(f"{base}/health", timeout=10).status == 200:
                    break
            except OSError:
                pass
            time.sleep(2)
        prompts = [f"{word} " * 12 for word in ("alpha", "bravo", "delta", "omega")]

        def complete(prompt: str) -> str:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            request = urllib.request.Request(
                f"{base}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=120) as response:
                return json.loads(response.read())["choices"][0]["text"]

        with ThreadPoolExecutor(4) as pool:
            served = list(pool.map(complete, prompts))
        llm = LLM(str(tiny_chat_model), max_model_len=256, kv_cache_memory="8MiB")
        offline = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        assert served == [o.outputs[0].text for o in offline]
        replicas = _get(f"{base}/v1/kv")["replicas"]
        assert len({r["node"] for r in replicas}) == 2, replicas  # one replica on each node
        assert all(r["kv_all_free"] for r in replicas)
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(120) == 0
    finally:
        if serve is not None and serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
        for node in reversed(nodes):
            _stop_group(node)
        log.seek(0)
        print(log.read()[-3000:])
        log.close()
