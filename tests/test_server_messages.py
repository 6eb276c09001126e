"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) on the real server, driven by the
official `anthropic` SDK. The oracles: the chat completions route on the same conversation (the Messages
route runs through it, so text, usage and finish must agree), transformers' apply_chat_template for the
prompt's tokens, jsonschema for guided output and tool inputs. SmolLM2-135M where no tools are needed;
Qwen2.5-Coder-0.5B (slow) for the tool round trip."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass

import anthropic
import jsonschema
import openai
import pytest
from helpers import running_server, wait_until_idle
from test_server_tools_qwen import WEATHER, qwen_gguf  # noqa: F401 (a fixture)

from pagedllm.entrypoints.openai.limits import ServerLimits
from pagedllm.entrypoints.openai.server import build_app

MODEL = "smollm2-135m"
KEY = "secret"
SYSTEM = "You are a helpful assistant who answers in one sentence."
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}  # the current SDK sends the sampling fields only in extra_body


@pytest.fixture(scope="module")
def server():
    app = build_app(MODEL, kv_cache_memory="32MiB", max_model_len=512, limits=ServerLimits(api_key=KEY))
    with running_server(app) as base:
        yield base, app.state.engine.engine


@pytest.fixture
def client(server):
    """The official Anthropic client (its key sent as x-api-key); afterwards every block is free."""
    base, engine = server
    yield anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0)
    wait_until_idle(engine)


def chat_oracle(base: str, **kwargs):
    """The same conversation through /v1/chat/completions, with the official openai client."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
    messages = [{"role": "system", "content": SYSTEM}, *QUESTION]
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs).choices


def test_create_answers_as_the_chat_route_does(client, server):
    message = client.messages.create(
        model=MODEL, max_tokens=24, system=SYSTEM, messages=QUESTION, extra_body=GREEDY
    )
    choices = chat_oracle(server[0], max_tokens=24)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == choices[0].message.content
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[choices[0].finish_reason]
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=QUESTION)
    assert message.usage.input_tokens == counted.input_tokens


def test_count_tokens_is_the_prompt_the_chat_template_renders(client):
    from transformers import AutoTokenizer

    from pagedllm.models.loader import resolve_checkpoint

    oracle = AutoTokenizer.from_pretrained(resolve_checkpoint(MODEL))
    conversation = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello! How can I help?"}]},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Name a colour.", "cache_control": {"type": "ephemeral"}}],
        },
    ]
    as_transformers = [{"role": "system", "content": SYSTEM}] + [
        {
            "role": m["role"],
            "content": m["content"] if isinstance(m["content"], str) else m["content"][0]["text"],
        }
        for m in conversation
    ]
    ids = oracle.apply_chat_template(as_transformers, add_generation_prompt=True)
    expected = len(ids["input_ids"] if hasattr(ids, "keys") else ids)
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]  # a hint: accepted
    counted = client.messages.count_tokens(model=MODEL, system=system, messages=conversation)
    assert counted.input_tokens == expected


def test_what_claude_code_sends_is_accepted(client):
    """Found by running Claude Code (2.1) against the server: a turn of role "system" inside `messages`
    (its reminders) reaches the template as a system message, and the beta `context_management` is
    accepted and ignored. transformers' apply_chat_template of the same conversation is the oracle."""
    from transformers import AutoTokenizer

    from pagedllm.models.loader import resolve_checkpoint

    conversation = [*QUESTION, {"role": "system", "content": "Answer in French."}]
    oracle = AutoTokenizer.from_pretrained(resolve_checkpoint(MODEL))
    ids = oracle.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, *conversation], add_generation_prompt=True
    )
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=conversation)
    assert counted.input_tokens == len(ids["input_ids"] if hasattr(ids, "keys") else ids)
    editing = {"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}
    message = client.messages.create(
        model=MODEL, max_tokens=4, system=SYSTEM, messages=conversation, extra_body=GREEDY | editing
    )
    assert message.usage.input_tokens == counted.input_tokens and message.usage.output_tokens == 4


def test_stream_events_add_up_to_the_whole_message(client):
    request = dict(model=MODEL, max_tokens=24, system=SYSTEM, messages=QUESTION, extra_body=GREEDY)
    whole = client.messages.create(**request)
    events = list(client.messages.create(stream=True, **request))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"] or kinds[:3] == [
        "message_start",
        "ping",
        "content_block_start",
    ]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[kinds.index("content_block_start") + 1 : -3]) == {"content_block_delta"}
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == whole.content[0].text
    delta = events[-2]
    assert delta.delta.stop_reason == whole.stop_reason
    assert (delta.usage.input_tokens, delta.usage.output_tokens) == (
        whole.usage.input_tokens,
        whole.usage.output_tokens,
    )
    with client.messages.stream(**request) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stop_sequences_and_max_tokens_give_their_stop_reasons(client):
    request = dict(model=MODEL, system=SYSTEM, messages=QUESTION, extra_body=GREEDY)
    long = client.messages.create(max_tokens=24, **request)
    text = long.content[0].text
    word = text.split()[2]
    stopped = client.messages.create(max_tokens=24, stop_sequences=[word], **request)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == text[: text.index(word)]
    short = client.messages.create(max_tokens=3, **request)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3


def test_output_config_format_guides_the_output_as_response_format_does(client, server):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    }
    message = client.messages.create(
        model=MODEL,
        max_tokens=40,
        system=SYSTEM,
        messages=QUESTION,
        output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "low"},
        metadata={"user_id": "u1"},
        extra_body=GREEDY,
    )
    jsonschema.validate(json.loads(message.content[0].text), schema)
    fmt = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    assert (
        message.content[0].text
        == chat_oracle(server[0], max_tokens=40, response_format=fmt)[0].message.content
    )


def test_a_client_that_leaves_a_stream_aborts_it(client, server):
    count = [{"role": "user", "content": "Count from 1 to 300, one number a line."}]
    request = dict(model=MODEL, max_tokens=400, messages=count, extra_body={"ignore_eos": True} | GREEDY)
    with pytest.raises(anthropic.BadRequestError, match="ignore_eos"):  # chat's extras are not Anthropic's
        client.messages.create(**request)
    request["extra_body"] = GREEDY
    with client.messages.stream(**request) as stream:
        for i, _ in enumerate(stream):
            if i == 3:
                break
    wait_until_idle(server[1])  # the engine aborted it: every block is back


@dataclass
class Reply:
    status_code: int
    body: dict


def post(base: str, path: str, body, headers: dict | None = None, raw: bytes | None = None) -> Reply:
    """A POST with the key as x-api-key unless `headers` says otherwise; `raw`: the body's bytes."""
    data = raw if raw is not None else json.dumps(body).encode()
    headers = {"x-api-key": KEY, "content-type": "application/json"} | (headers or {})
    request = urllib.request.Request(base + path, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return Reply(response.status, json.load(response))
    except urllib.error.HTTPError as error:
        return Reply(error.code, json.load(error))


def assert_anthropic_error(response: Reply, status: int, kind: str, *named: str) -> None:
    assert response.status_code == status, response.body
    body = response.body
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    for name in named:
        assert name in body["error"]["message"], (name, body)


def test_bad_input_is_refused_in_anthropics_shape_naming_the_field(server):
    base, engine = server
    ok = {"model": MODEL, "max_tokens": 8, "messages": QUESTION}
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    document = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}
    cases = [
        ({k: v for k, v in ok.items() if k != "max_tokens"}, "max_tokens"),
        (ok | {"messages": [{"role": "user", "content": [image]}]}, "'image'"),
        (ok | {"messages": [{"role": "user", "content": [document]}]}, "'document'"),
        (ok | {"container": "c1"}, "container"),
        (ok | {"tool_choice": {"type": "tool"}}, "tool_choice"),
        (ok | {"max_tokens": 100_000}, "max_tokens"),
        (ok | {"tools": [{"name": "f", "input_schema": {"type": "object"}}]}, "tools"),  # no tool template
        (ok | {"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
        (ok | {"temperature": -1}, "temperature"),
    ]
    for body, named in cases:
        assert_anthropic_error(post(base, "/v1/messages", body), 400, "invalid_request_error", named)
    assert_anthropic_error(
        post(base, "/v1/messages", ok | {"model": "claude"}), 404, "not_found_error", "claude"
    )
    bad_json = post(base, "/v1/messages", None, raw=b"{")
    assert_anthropic_error(bad_json, 400, "invalid_request_error", "JSON")
    count = post(
        base,
        "/v1/messages/count_tokens",
        {"model": MODEL, "messages": [{"role": "user", "content": [image]}]},
    )
    assert_anthropic_error(count, 400, "invalid_request_error", "'image'")
    # the OpenAI routes keep OpenAI's shape
    chat = post(base, "/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "bad": 1})
    assert chat.status_code == 400 and chat.body["error"]["param"] == "bad"
    wait_until_idle(engine)


def test_a_prompt_larger_than_the_kv_cache_is_a_400_naming_both_sizes():
    """Found by Claude Code: its 18,758-token prompt beside a cache of 18,720 tokens ended "max_tokens" with
    no text after it waited. 8 blocks hold 128 tokens, under max_model_len=512: a ~200-token prompt is
    refused at once, naming the prompt's size and the cache's; a short one is still served."""
    app = build_app(MODEL, num_kv_blocks=8, max_model_len=512)
    with running_server(app) as base:
        long = [{"role": "user", "content": "Count with me: " + " ".join(map(str, range(100)))}]
        refused = post(base, "/v1/messages", {"model": MODEL, "max_tokens": 8, "messages": long})
        assert_anthropic_error(refused, 400, "invalid_request_error", "tokens", "8 blocks", "num_kv_blocks=8")
        chat = post(base, "/v1/chat/completions", {"model": MODEL, "max_tokens": 8, "messages": long})
        assert chat.status_code == 400 and chat.body["error"]["param"] == "prompt", chat.body
        served = post(base, "/v1/messages", {"model": MODEL, "max_tokens": 8, "messages": QUESTION})
        assert served.status_code == 200 and served.body["usage"]["output_tokens"] >= 1, served.body
        wait_until_idle(app.state.engine.engine)


def test_the_api_key_as_x_api_key_or_bearer(server):
    base, engine = server
    body = {"model": MODEL, "max_tokens": 2, "messages": QUESTION}
    assert_anthropic_error(
        post(base, "/v1/messages", body, {"x-api-key": "wrong"}), 401, "authentication_error"
    )
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(**body)
    by_bearer = anthropic.Anthropic(base_url=base, auth_token=KEY, max_retries=0).messages.create(**body)
    assert by_bearer.usage.output_tokens == 2
    chat = post(base, "/v1/chat/completions", {"messages": QUESTION}, {"x-api-key": "wrong"})
    assert chat.status_code == 401 and chat.body["error"]["type"] == "AuthenticationError"  # OpenAI's
    wait_until_idle(engine)


# -- a tool round trip on a real tool-calling model (slow) ---------------------------------------------

WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "input_schema": WEATHER["function"]["parameters"],
}


@pytest.fixture(scope="module")
def qwen_server(qwen_gguf):  # noqa: F811 (the fixture imported above)
    app = build_app(str(qwen_gguf), served_model_name="qwen", kv_cache_memory="128MiB", max_model_len=2048)
    with running_server(app) as base:
        yield base, app.state.engine.engine


@pytest.mark.slow
def test_a_tool_round_trip_with_the_official_client(qwen_server, qwen_gguf):  # noqa: F811
    """tool_use (named: guided, so its input matches the schema), the same call streamed, the tool_result
    sent back and the final text; each prompt's tokens are transformers' rendering of the conversation."""
    from transformers import AutoTokenizer

    from pagedllm.models.gguf_loader import converted_folder

    oracle = AutoTokenizer.from_pretrained(converted_folder(qwen_gguf))
    base, engine = qwen_server
    client = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)
    question = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
    request = dict(model="qwen", max_tokens=80, tools=[WEATHER_TOOL], extra_body=GREEDY)
    first = client.messages.create(
        messages=question, tool_choice={"type": "tool", "name": "get_weather"}, **request
    )
    assert first.stop_reason == "tool_use"
    (call,) = [block for block in first.content if block.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(call.input, WEATHER_TOOL["input_schema"])

    with client.messages.stream(messages=question, tool_choice={"type": "any"}, **request) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert "input_json" in kinds and streamed.stop_reason == "tool_use"
    (streamed_call,) = [block for block in streamed.content if block.type == "tool_use"]
    assert (streamed_call.name, streamed_call.input) == (call.name, call.input)  # any: the one tool

    loop = [
        *question,
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": "22 degrees celsius, sunny"}
            ],
        },
    ]
    answer = client.messages.create(messages=loop, **request)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [block.type for block in answer.content] == ["text"] and answer.content[0].text
    as_transformers = [
        *question,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": call.name, "arguments": call.input}}],
        },
        {"role": "tool", "content": "22 degrees celsius, sunny"},
    ]
    ids = oracle.apply_chat_template(as_transformers, tools=[WEATHER], add_generation_prompt=True)
    expected = len(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert answer.usage.input_tokens == expected
    assert (
        client.messages.count_tokens(model="qwen", messages=loop, tools=[WEATHER_TOOL]).input_tokens
        == expected
    )
    wait_until_idle(engine)


def test_bench_serve_drives_the_messages_api(server, capsys):
    """`pagedllm bench serve --endpoint-type messages`: the same greedy requests as over chat, so the same
    tokens come back (the usage its stream reports); --ignore-eos, which the API lacks, is refused."""
    from pagedllm.bench import serve

    base, engine = server
    argv = [
        "--base-url",
        base,
        "--model",
        MODEL,
        "--api-key",
        KEY,
        "--num-prompts",
        "3",
        "--input-len",
        "5-12",
    ]
    argv += ["--output-len", "6", "--json"]
    reports = {}
    for endpoint in ("messages", "chat"):
        assert serve.main([*argv, "--endpoint-type", endpoint]) == 0
        reports[endpoint] = json.loads(capsys.readouterr().out)["summary"]
    assert reports["messages"]["completed"] == 3
    assert reports["messages"]["output_tokens"] == reports["chat"]["output_tokens"] > 0
    with pytest.raises(SystemExit):
        serve.main([*argv, "--endpoint-type", "messages", "--ignore-eos"])
    assert "--ignore-eos" in capsys.readouterr().err
    wait_until_idle(engine)
