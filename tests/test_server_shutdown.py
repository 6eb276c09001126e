"""Graceful shutdown of a real `pagedllm serve` process: SIGTERM stops admitting, lets running requests
finish (or aborts them after --shutdown-timeout), frees every KV block and exits 0."""

from __future__ import annotations

import argparse
import json
import signal
import urllib.error
import urllib.request

import pytest

from pagedllm.bench.serve import ServerProcess


def _serve(model, shutdown_timeout: float) -> ServerProcess:
    """`pagedllm serve` as `bench serve` starts it: a subprocess on a free loopback port."""
    args = argparse.Namespace(
        model=str(model),
        kv_cache_memory="16MiB",
        max_num_seqs=8,
        max_model_len=4096,
        quantization="auto",
        kv_cache_dtype="auto",
    )
    args.api_key, args.serve_arg = None, ["--shutdown-timeout", str(shutdown_timeout)]
    server = ServerProcess(args)
    server.wait_ready(timeout=120)
    return server


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
def test_sigterm_drains_then_exits_zero(tiny_chat_model, max_tokens, timeout, finishes):
    server = _serve(tiny_chat_model, timeout)
    base = server.base_url
    try:
        response = _stream(base, max_tokens)
        first = _events_until_first(response)
        server.process.send_signal(signal.SIGTERM)
        assert _new_request_refused(base)
        events = [first, *_events(response)]
        assert server.process.wait(timeout=120) == 0, server.log_text()
    finally:
        server.stop()
    log = server.log_text(tail=None)
    text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
    reasons = [e["choices"][0]["finish_reason"] for e in events if e.get("choices")]
    if finishes:
        assert reasons[-1] == "length" and events[-1]["usage"]["completion_tokens"] == max_tokens
    else:  # cut off mid-stream, with an error event saying why, then [DONE]
        assert "length" not in reasons and len(text) > 0
        assert events[-1]["error"]["code"] == 503 and "shut down" in events[-1]["error"]["message"]
        assert "aborting 1 requests: the server shut down" in log
    assert "all " in log and "KV blocks are free" in log


def _events_until_first(response) -> dict:
    for line in response:
        line = line.decode().strip()
        if line.startswith("data: "):
            return json.loads(line[6:])
    raise AssertionError("the stream ended before its first event")
