"""Hostile input: Schemathesis generates requests from the server's own OpenAPI schema, valid and invalid
(positive and negative modes), and sends them to the real server. No answer may be a 5xx, every 4xx body
must be OpenAI-shaped, and afterwards the server still serves and every KV block is free.

Schemathesis is driven through its Python API (`APIOperation.as_strategy` under Hypothesis's `@given`),
not its pytest plugin: the plugin writes pytest's private `Item._nodeid`, which pytest 9.2 removed, and
pyproject's `-p no:schemathesis` keeps the plugin from loading at all."""

from __future__ import annotations

import json

import openai
import pytest
import schemathesis
from helpers import running_server, wait_until_idle
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.entrypoints.openai.limits import ServerLimits
from pagedllm.entrypoints.openai.server import build_app

EXAMPLES_PER_OPERATION = 150


@pytest.fixture(scope="module")
def fuzz_server(tiny_chat_model):
    limits = ServerLimits(max_n=4, max_concurrent_requests=64)
    app = build_app(str(tiny_chat_model), served_model_name="tiny", limits=limits, max_model_len=64)
    with running_server(app) as base:
        yield base, app.state.engine.engine


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    base, _ = fuzz_server
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    schema.config.update(base_url=base)
    return schema


def any_mode_case(operation: schemathesis.APIOperation) -> st.SearchStrategy:
    """Requests for one operation, drawn from valid (positive) and invalid (negative) input alike."""
    return st.one_of([operation.as_strategy(generation_mode=mode) for mode in schemathesis.GenerationMode])


def check_answer(case: schemathesis.Case) -> None:
    """Send `case`; the answer must not be a 5xx, and a 4xx must carry the API's error body: Anthropic's
    on the Messages routes, OpenAI's on every other."""
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = "tiny"  # a random name is a 404 (tested elsewhere): reach the engine instead
    response = case.call(timeout=120)
    assert response.status_code < 500, (case.as_curl_command(), response.text[:500])
    if response.status_code < 400:
        return
    body = json.loads(response.text)
    error = body["error"]
    if case.operation.path.startswith("/v1/messages"):
        assert body["type"] == "error" and error["type"].endswith("_error"), response.text
        assert error["message"], response.text
    else:
        assert error["message"] and error["type"].endswith("Error"), response.text
        assert error["code"] == response.status_code


def test_no_request_gets_a_server_error(api_schema):
    operations = [result.ok() for result in api_schema.get_all_operations()]  # .ok() raises on a bad schema
    labels = {operation.label for operation in operations}
    assert {"POST /v1/completions", "POST /v1/chat/completions"} <= labels, labels
    for operation in operations:

        @given(case=any_mode_case(operation))
        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def fuzz(case):
            check_answer(case)

        fuzz()


def test_the_server_still_serves_after_the_fuzzing(fuzz_server):
    base, engine = fuzz_server
    wait_until_idle(engine, timeout=60)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    response = client.completions.create(
        model="tiny", prompt="hello", max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert response.usage.completion_tokens == 3
    wait_until_idle(engine)
