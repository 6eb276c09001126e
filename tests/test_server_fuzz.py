"""Hostile input: Schemathesis generates requests from the server's own OpenAPI schema, valid and invalid
(positive and negative modes), and sends them to the real server. No answer may be a 5xx, every 4xx body
must be OpenAI-shaped, and afterwards the server still serves and every KV block is free."""

from __future__ import annotations

import json

import openai
import pytest
import schemathesis
from helpers import running_server, wait_until_idle
from hypothesis import HealthCheck, settings

from pagedllm.entrypoints.openai.limits import ServerLimits
from pagedllm.entrypoints.openai.server import build_app


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
    schema.config.generation.update(modes=list(schemathesis.GenerationMode), max_examples=150)
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_no_request_gets_a_server_error(case):
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = "tiny"  # a random name is a 404 (tested elsewhere): reach the engine instead
    response = case.call(timeout=120)
    assert response.status_code < 500, (case.as_curl_command(), response.text[:500])
    if response.status_code >= 400:
        error = json.loads(response.text)["error"]
        assert error["message"] and error["type"].endswith("Error"), response.text
        assert error["code"] == response.status_code


def test_the_server_still_serves_after_the_fuzzing(fuzz_server):
    base, engine = fuzz_server
    wait_until_idle(engine, timeout=60)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    response = client.completions.create(
        model="tiny", prompt="hello", max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert response.usage.completion_tokens == 3
    wait_until_idle(engine)
