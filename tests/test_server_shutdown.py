"""Graceful shutdown of a real `pagedllm serve` process: SIGTERM stops admitting, lets running requests
finish (or aborts them after --shutdown-timeout), frees every KV block and exits 0."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from serving import free_port, wait_for_health


def _serve(model, shutdown_timeout: float, log_path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "pagedllm.entrypoints.cli",
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
    ]
    argv += [
        "--kv-cache-memory",
        "16MiB",
        "--max-model-len",
        "4096",
        "--shutdown-timeout",
        str(shutdown_timeout),
    ]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open(log_path, "w"))
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(base, timeout=120)
    except AssertionError:
        process.kill()
        raise AssertionError(log_path.read_text()) from None
    return process, base


def _stream(base: str, max_tokens: int):
    body = {"prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True}
    request = urllib.request.Request(
        f"{base}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    return urllib.request.urlopen(request, timeout=120)


def _events(response) -> list[dict]:
    """The SSE events still to come, until [DONE] or the connection closes."""
    events = []
    for line in response:
        line = line.decode().strip()
        if line == "data: [DONE]":
            break
        if line.startswith("data: "):
            events.append(json.loads(line[6:]))
    return events


def _new_request_refused(base: str) -> bool:
    """After SIGTERM a new request is refused: the port is closed, or (while it closes) a 503."""
    try:
        urllib.request.urlopen(f"{base}/v1/models", timeout=10)
    except urllib.error.HTTPError as error:
        return error.code == 503 and "shutting down" in json.loads(error.read())["error"]["message"]
    except OSError:
        return True
    return False


@pytest.mark.parametrize(
    "max_tokens, timeout, finishes",
    [(300, 60.0, True), (4000, 0.5, False)],
    ids=["running-request-finishes", "past-the-timeout-it-is-aborted"],
)
def test_sigterm_drains_then_exits_zero(tiny_chat_model, tmp_path, max_tokens, timeout, finishes):
    log = tmp_path / "server.log"
    process, base = _serve(tiny_chat_model, timeout, log)
    try:
        response = _stream(base, max_tokens)
        first = _events_until_first(response)
        process.send_signal(signal.SIGTERM)
        assert _new_request_refused(base)
        events = [first, *_events(response)]
        assert process.wait(timeout=120) == 0, log.read_text()
    finally:
        process.kill()
    text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
    reasons = [e["choices"][0]["finish_reason"] for e in events if e.get("choices")]
    if finishes:
        assert reasons[-1] == "length" and events[-1]["usage"]["completion_tokens"] == max_tokens
    else:
        assert "length" not in reasons and len(text) > 0  # cut off mid-stream
        assert "timeout graceful shutdown exceeded" in log.read_text()
    assert "all " in log.read_text() and "KV blocks are free" in log.read_text()


def _events_until_first(response) -> dict:
    for line in response:
        line = line.decode().strip()
        if line.startswith("data: "):
            return json.loads(line[6:])
    raise AssertionError("the stream ended before its first event")
