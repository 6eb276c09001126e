"""The server's door: API key, limits (each a 4xx naming the limit), generation_config defaults.

A tiny random model behind the real uvicorn server and the official client: what is checked here is
the HTTP layer, not the text.
"""

from __future__ import annotations

import json
import time
import urllib.request

import openai
import pytest
from helpers import assert_all_blocks_free, running_server, wait_until_idle, write_tiny_chat_model

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.openai.limits import ServerLimits
from pagedllm.entrypoints.openai.server import build_app

KEY = "sk-test-key"
LIMITS = ServerLimits(
    api_key=KEY, max_request_body_bytes=4000, max_concurrent_requests=2, max_n=4, max_logprobs=5
)


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    app = build_app(str(tiny_chat_model), served_model_name="tiny", limits=LIMITS, max_model_len=256)
    with running_server(app) as base:
        yield base, app.state.engine.engine


@pytest.fixture
def client(server):
    base, engine = server
    yield openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
    wait_until_idle(engine)


def _get(url: str, key: str | None = None) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers)) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


@pytest.mark.parametrize("key", [None, "sk-wrong"])
def test_v1_routes_need_the_api_key(server, key):
    base, _ = server
    status, body = _get(f"{base}/v1/models", key)
    assert status == 401
    error = json.loads(body)["error"]
    assert error["type"] == "AuthenticationError" and error["code"] == 401 and "API key" in error["message"]
    if key is not None:  # the official client refuses to send no key at all
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0).completions.create(
                model="tiny", prompt="hi", max_tokens=2
            )


def test_the_right_key_passes_and_health_metrics_stay_open(client, server):
    base, _ = server
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert _get(f"{base}/health")[0] == 200
    assert _get(f"{base}/metrics")[0] == 200


def test_api_key_from_the_environment(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_API_KEY", "from-env")
    assert ServerLimits().api_key == "from-env"
    assert ServerLimits(api_key="given").api_key == "given"


@pytest.mark.parametrize(
    "kwargs, param, words",
    [
        (dict(n=5), "n", "limit of 4 (--max-n)"),
        (dict(logprobs=6), "logprobs", "limit of 5 (--max-logprobs)"),
        (dict(extra_body={"prompt_logprobs": 6}), "prompt_logprobs", "limit of 5 (--max-logprobs)"),
        (dict(max_tokens=250, prompt="hi " * 10), "max_tokens", "max_model_len=256"),
        (dict(prompt=list(range(5, 300))), "prompt", "max_model_len=256"),
    ],
)
def test_limits_are_named(client, kwargs, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**(dict(model="tiny", prompt="hi", max_tokens=2) | kwargs))
    assert info.value.body["param"] == param
    assert words in info.value.body["message"]


def test_chat_top_logprobs_limit(client):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="limit of 5"):
        client.chat.completions.create(model="tiny", messages=messages, logprobs=True, top_logprobs=6)
    with pytest.raises(openai.BadRequestError, match="needs logprobs=true"):
        client.chat.completions.create(model="tiny", messages=messages, top_logprobs=2)


def test_body_size_limit(client):
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model="tiny", prompt="word " * 1000, max_tokens=2)
    assert info.value.status_code == 413
    assert "limit of 4000 bytes (--max-request-body-bytes)" in info.value.body["message"]


def test_concurrent_request_limit(client, server):
    """Two streams held open fill the limit of 2: a third request gets 429; once they close, it passes."""
    _, engine = server
    kwargs = dict(model="tiny", prompt="hi", max_tokens=200, stream=True, extra_body={"ignore_eos": True})
    held = [client.completions.create(**kwargs) for _ in range(2)]
    for stream in held:
        next(iter(stream))
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert "at most 2 at once (--max-concurrent-requests)" in info.value.body["message"]
    for stream in held:
        stream.close()
    deadline = time.monotonic() + 10
    while True:  # the server sees each disconnect on its next write
        try:
            client.completions.create(model="tiny", prompt="hi", max_tokens=2)
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    wait_until_idle(engine)


def test_generation_config_supplies_unset_sampling_fields(tmp_path):
    """The model folder's generation_config.json (temperature 0, max_new_tokens 7) fills what a request
    leaves unset, in the server and in LLM.generate without SamplingParams; `vllm` ignores the file."""
    folder = write_tiny_chat_model(tmp_path, generation_config={"temperature": 0.0, "max_new_tokens": 7})
    llm = LLM(str(folder), kv_cache_memory="8MiB", max_model_len=256)
    assert llm.engine.default_sampling == {"temperature": 0.0, "max_tokens": 7}
    greedy = llm.generate("hello there", SamplingParams(temperature=0, max_tokens=7))[0].outputs[0]
    default = llm.generate("hello there")[0].outputs[0]
    assert default.token_ids == greedy.token_ids and len(default.token_ids) == 7
    assert LLM(str(folder), kv_cache_memory="8MiB", generation_config="vllm").engine.default_sampling == {}
    messages = [{"role": "user", "content": "hello"}]
    expected = llm.chat(messages, SamplingParams(temperature=0, max_tokens=7))[0].outputs[0]
    app = build_app(str(folder), kv_cache_memory="8MiB", max_model_len=256)
    with running_server(app) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        replies = [client.chat.completions.create(model=str(folder), messages=messages) for _ in range(2)]
        assert [r.choices[0].message.content for r in replies] == [expected.text] * 2
        assert replies[0].usage.completion_tokens == 7
        sampled = client.chat.completions.create(
            model=str(folder), messages=messages, max_tokens=30, extra_body={"ignore_eos": True}
        )
        assert sampled.usage.completion_tokens == 30  # the request's own settings win
        wait_until_idle(app.state.engine.engine)
    assert_all_blocks_free(llm)
