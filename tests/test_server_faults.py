"""The server under faults, driven by the official client: a failed step, a failing call on the engine
thread, and the engine thread killed on purpose. Each ends healthy or honestly unhealthy, and nothing
hangs: every request gets its answer or an error in OpenAI's shape, every KV block is free."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from helpers import assert_all_blocks_free, openai_client, running_server, wait_until_idle

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.openai.server import build_app

PROMPT = "Question: what is the capital of France? Answer in one word. " * 6


class InjectedFault(RuntimeError):
    pass


class EngineThreadKilled(BaseException):
    """Not an Exception: nothing on the engine thread may catch it and go on, as with a fatal bug."""


@pytest.fixture(scope="module")
def model(tiny_chat_model) -> str:
    return str(tiny_chat_model)


@pytest.fixture(scope="module")
def fresh_text(model) -> str:
    llm = LLM(model, enable_prefix_caching=False)
    text = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0))[0].outputs[0].text
    assert_all_blocks_free(llm)
    return text


def health(base: str) -> tuple[int, dict | None]:
    try:
        return urllib.request.urlopen(f"{base}/health").status, None
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def test_a_failed_step_ends_its_requests_and_the_server_serves_on(model, fresh_text, monkeypatch):
    app = build_app(model, max_model_len=1024)
    engine = app.state.engine.engine
    real_run, faults = engine._run, [0]

    def run(out, clock):
        if faults[0] and out.prefills:
            faults[0] -= 1
            raise InjectedFault("injected into a prefill")
        return real_run(out, clock)

    monkeypatch.setattr(engine, "_run", run)
    with running_server(app) as base, openai_client(base, engine) as client:
        faults[0] = 1
        with pytest.raises(openai.InternalServerError, match="injected into a prefill") as error:
            client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
        assert error.value.status_code == 500 and error.value.body["type"] == "InternalServerError"
        faults[0] = 1
        stream = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=8, temperature=0, stream=True
        )
        with pytest.raises(openai.APIError, match="injected into a prefill"):
            list(stream)
        wait_until_idle(engine)
        assert health(base)[0] == 200
        again = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
        assert again.choices[0].text == fresh_text  # nothing the failed steps were to write was read


def test_a_failing_call_does_not_stop_the_engine_thread(model, fresh_text):
    app = build_app(model, max_model_len=1024)
    async_engine = app.state.engine
    with running_server(app) as base, openai_client(base, async_engine.engine) as client:
        async_engine._submit(lambda: 1 / 0)  # logged, then the thread goes on
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
        assert out.choices[0].text == fresh_text
        assert health(base)[0] == 200 and async_engine.failure is None


def test_a_killed_engine_thread_ends_every_request_and_says_why(model, monkeypatch):
    app = build_app(model, max_model_len=1024)
    async_engine = app.state.engine
    engine = async_engine.engine
    real_step, kill = engine.step, threading.Event()

    def step():
        if kill.is_set():
            raise EngineThreadKilled("killed on purpose by the test")
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    with running_server(app) as base, ThreadPoolExecutor(2) as pool:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=30)
        stream = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=400, temperature=0, stream=True
        )
        chunks = iter(stream)
        next(chunks)  # generating
        waiting = pool.submit(client.completions.create, model=model, prompt=PROMPT, max_tokens=400)
        deadline = time.monotonic() + 20
        while engine.get_num_unfinished_requests() < 2:  # the non-streamed request is in the engine
            assert time.monotonic() < deadline
            time.sleep(0.01)
        kill.set()
        start = time.monotonic()
        with pytest.raises(openai.APIError, match="the engine thread died"):
            list(chunks)  # the open stream ends with an error event
        with pytest.raises(openai.InternalServerError, match="the engine thread died") as error:
            waiting.result(timeout=10)
        assert error.value.status_code == 500
        assert time.monotonic() - start < 10  # at once: nothing waits for a thread that is gone
        status, body = health(base)
        assert status == 503 and "EngineThreadKilled: killed on purpose" in body["error"]["message"]
        with pytest.raises(openai.InternalServerError, match="the engine thread died") as refused:
            client.completions.create(model=model, prompt=PROMPT, max_tokens=4)
        assert refused.value.status_code == 503
    assert_all_blocks_free(engine)  # the dying thread freed what its requests held
