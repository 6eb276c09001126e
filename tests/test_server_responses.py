"""POST /v1/responses and GET /v1/responses/{id} on the real server, driven by the official openai SDK
(and, on Qwen2.5-Coder-0.5B, by the OpenAI Agents SDK): the oracle is the chat completion of the same
conversation at temperature 0, which the Responses route must reproduce token for token."""

from __future__ import annotations

import json
import time

import openai
import pytest
from helpers import openai_client, running_server, wait_until_idle
from test_server_tools_qwen import WEATHER, qwen_gguf, run_weather_agent  # noqa: F401 (a fixture)

from pagedllm.bench import serve
from pagedllm.entrypoints.openai.responses_protocol import ResponseObject
from pagedllm.entrypoints.openai.server import build_app
from pagedllm.entrypoints.openai.serving_responses import ResponseStore, StoredResponse

MODEL = "smollm2-135m"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server():
    app = build_app(MODEL, kv_cache_memory="64MiB", max_model_len=1024)
    with running_server(app) as base:
        yield base, app.state.engine.engine


@pytest.fixture
def client(server):
    with openai_client(*server) as client:  # afterwards: nothing running, every KV block free
        yield client


def chat_text(client, messages: list[dict], **kwargs) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)


def test_a_response_is_the_chat_completion_of_its_input(client):
    """Plain text input, then instructions (a system turn): the text and usage of the chat completion."""
    response = client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=24)
    chat = chat_text(client, [{"role": "user", "content": QUESTION}], max_tokens=24)
    assert response.object == "response" and response.model == MODEL
    assert response.output_text == chat.choices[0].message.content
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg")
    assert item.content[0].type == "output_text"
    assert response.status == ("completed" if chat.choices[0].finish_reason == "stop" else "incomplete")
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens

    instructions = "You are a pirate. Answer in one sentence."
    items = [{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    pirate = client.responses.create(
        model=MODEL, instructions=instructions, input=items, temperature=0, max_output_tokens=24
    )
    system = [{"role": "system", "content": instructions}, {"role": "user", "content": QUESTION}]
    assert pirate.output_text == chat_text(client, system, max_tokens=24).choices[0].message.content
    assert pirate.instructions == instructions
    assert client.responses.retrieve(pirate.id).model_dump() == pirate.model_dump()


def test_max_output_tokens_leaves_the_response_incomplete(client):
    response = client.responses.create(
        model=MODEL, input="Count from 1 to 100.", temperature=0, max_output_tokens=3
    )
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3
    assert response.output[0].status == "incomplete"


def test_previous_response_id_continues_the_conversation(client):
    """The follow-up sees the first input and output, and not the first instructions (OpenAI's rule);
    what it answers is the chat completion of the whole conversation. GET returns each stored response."""
    first = client.responses.create(
        model=MODEL, instructions="Be brief.", input="Name a color.", temperature=0, max_output_tokens=16
    )
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input="Name another one.",
        temperature=0,
        max_output_tokens=16,
    )
    conversation = [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Name another one."},
    ]
    chat = chat_text(client, conversation, max_tokens=16)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text


def test_a_streamed_response_sends_its_events_in_order(client):
    """The typed events, numbered in order; the deltas join to the text of the whole response, and the
    SDK's own accumulator (responses.stream) arrives at the same response."""
    request = dict(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=24)
    whole = client.responses.create(**request)
    events = list(client.responses.create(stream=True, **request))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if whole.status == "completed" else "response.incomplete",
    ]
    final = events[-1].response
    assert "".join(deltas) == events[-4].text == final.output_text == whole.output_text
    assert final.usage == whole.usage
    assert client.responses.retrieve(final.id).output_text == whole.output_text
    with client.responses.stream(**request) as stream:
        assert stream.get_final_response().output_text == whole.output_text


def test_a_client_that_leaves_a_stream_aborts_it(server, monkeypatch):
    """Closing a stream after its first event aborts the request (the engine's own abort_request, wrapped
    to record it); openai_client then checks that every block is free."""
    base, engine = server
    aborted = []
    abort_request = engine.abort_request
    monkeypatch.setattr(engine, "abort_request", lambda rid: aborted.append(rid) or abort_request(rid))
    with openai_client(base, engine) as client:
        stream = client.responses.create(
            model=MODEL, input="Write a long story.", max_output_tokens=900, stream=True
        )
        assert next(iter(stream)).type == "response.created"
        stream.close()
        deadline = time.monotonic() + 5
        while not aborted and time.monotonic() < deadline:
            time.sleep(0.05)
    assert len(aborted) == 1


def test_text_format_json_schema_is_guided_as_response_format(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    response = client.responses.create(
        model=MODEL,
        input="Name a city in JSON.",
        temperature=0,
        max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema}},
    )
    chat = chat_text(
        client,
        [{"role": "user", "content": "Name a city in JSON."}],
        max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
    )
    assert response.output_text == chat.choices[0].message.content
    if response.status == "completed":
        assert isinstance(json.loads(response.output_text)["city"], str)
    assert response.text.format.type == "json_schema"


def test_bench_serve_drives_the_responses_route(server, capsys):
    """`pagedllm bench serve --endpoint-type responses`: every request streamed back whole, its output
    tokens counted from response.completed's usage (EOS ignored: exactly the length asked for)."""
    base, engine = server
    argv = ["--base-url", base, "--model", MODEL, "--endpoint-type", "responses", "--num-prompts", "4"]
    argv += ["--input-len", "5-20", "--output-len", "5", "--ignore-eos", "--request-rate", "50", "--json"]
    code = serve.main(argv)
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["summary"]["completed"] == 4
    assert report["summary"]["output_tokens"] == 20
    wait_until_idle(engine)


@pytest.mark.parametrize(
    ("extra", "param", "named"),
    [
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "item_reference"),
        ({"input": []}, "input", "no message"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
            "input",
            "input_image",
        ),
        ({"input": "hi", "tools": [{"type": "file_search"}]}, "tools", "file_search"),
        ({"input": "hi", "tool_choice": {"type": "file_search"}}, "tool_choice", "tool_choice"),
        ({"input": "hi", "background": True}, "background", "background"),
        ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include", "logprobs"),
        ({"input": "hi", "max_output_tokens": 5000}, "max_output_tokens", "max_model_len"),
        ({"input": "hi", "model": "gpt-4o"}, "model", "gpt-4o"),
    ],
)
def test_bad_input_is_refused_naming_it(client, extra, param, named):
    with pytest.raises(openai.APIStatusError) as refused:
        client.responses.create(**{"model": MODEL} | extra)
    error = refused.value
    assert error.status_code in (400, 404), error.body
    assert error.body["param"] == param and named in error.body["message"]


def test_unknown_ids_are_404(client):
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_nope")
    assert (
        missing.value.body["param"] == "previous_response_id" and "resp_nope" in missing.value.body["message"]
    )
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nope")
    unstored = client.responses.create(model=MODEL, input="hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_the_store_keeps_the_most_recently_used():
    store = ResponseStore(size=2)
    stored = [
        StoredResponse(
            ResponseObject(
                model="m", parallel_tool_calls=True, store=True, text={}, tool_choice="auto", tools=[]
            ),
            [],
        )
        for _ in range(3)
    ]
    store.put(stored[0])
    store.put(stored[1])
    store.get(stored[0].response.id)  # now the most recently used: stored[1] goes first
    store.put(stored[2])
    assert store.get(stored[0].response.id) is stored[0] and store.get(stored[2].response.id) is stored[2]
    with pytest.raises(Exception, match="older than the 2 responses"):
        store.get(stored[1].response.id)


# -- tools, on a real tool-calling model -------------------------------------------------------------

FLAT_WEATHER = {"type": "function", **WEATHER["function"]}


@pytest.fixture(scope="module")
def qwen_server(qwen_gguf):  # noqa: F811
    app = build_app(str(qwen_gguf), served_model_name="qwen", kv_cache_memory="128MiB", max_model_len=2048)
    with running_server(app) as base:
        yield base, app.state.engine.engine


@pytest.mark.slow
def test_a_function_tool_round_trip(qwen_server):
    """A named function's call (guided) as a function_call item, streamed alike; its output sent back as
    a function_call_output after previous_response_id: the answer is the chat completion of the whole
    conversation."""
    with openai_client(*qwen_server) as client:
        question = "What is the weather in Paris, in celsius?"
        request = dict(model="qwen", tools=[FLAT_WEATHER], temperature=0, max_output_tokens=80)
        named = {"type": "function", "name": "get_weather"}
        first = client.responses.create(input=question, tool_choice=named, **request)
        (call,) = first.output
        assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
        assert json.loads(call.arguments)["city"] == "Paris"
        chat = client.chat.completions.create(
            model="qwen",
            messages=[{"role": "user", "content": question}],
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            temperature=0,
            max_tokens=80,
        )
        assert call.arguments == chat.choices[0].message.tool_calls[0].function.arguments

        events = list(client.responses.create(input=question, tool_choice=named, stream=True, **request))
        arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert arguments == done[0].arguments == call.arguments

        result = {"type": "function_call_output", "call_id": call.call_id, "output": "22 degrees, sunny"}
        answer = client.responses.create(
            previous_response_id=first.id, input=[result], tool_choice="none", **request
        )
        assert answer.output[0].type == "message" and answer.output_text
        loop = [
            {"role": "user", "content": question},
            chat.choices[0].message.model_dump(exclude_none=True),
            {
                "role": "tool",
                "tool_call_id": chat.choices[0].message.tool_calls[0].id,
                "content": "22 degrees, sunny",
            },
        ]
        expected = client.chat.completions.create(
            model="qwen", messages=loop, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=80
        )
        assert answer.output_text == expected.choices[0].message.content


@pytest.mark.slow
def test_what_codex_sends_by_default_is_served_as_its_function_tools_alone(qwen_server):
    """Codex CLI 0.171's default request, as captured from it: developer turns, its session's
    client_metadata, include of encrypted reasoning, a hosted web_search and a namespace of sub-agent tools
    beside its function tools. Served as the same request with the function tools alone and none of those
    fields: the same output, the same prompt tokens."""
    with openai_client(*qwen_server) as client:
        turns = [
            {"role": "developer", "content": [{"type": "input_text", "text": "You are a coding agent."}]},
            {"role": "user", "content": [{"type": "input_text", "text": "What is the weather in Paris?"}]},
        ]
        plain = dict(model="qwen", input=turns, temperature=0, max_output_tokens=40, store=False)
        namespace = {
            "type": "namespace",
            "name": "agents",
            "description": "Sub-agents.",
            "tools": [FLAT_WEATHER],
        }
        codex = client.responses.create(
            **plain,
            tools=[FLAT_WEATHER, namespace, {"type": "web_search", "external_web_access": False}],
            tool_choice="auto",
            parallel_tool_calls=True,
            reasoning={"summary": "auto"},
            include=["reasoning.encrypted_content"],
            prompt_cache_key="session-1",
            extra_body={"client_metadata": {"session_id": "session-1", "turn_id": "1"}},
        )
        alone = client.responses.create(**plain, tools=[FLAT_WEATHER], tool_choice="auto")
        assert [item.model_dump(exclude={"id", "call_id"}) for item in codex.output] == [
            item.model_dump(exclude={"id", "call_id"}) for item in alone.output
        ]
        assert codex.usage.input_tokens == alone.usage.input_tokens


@pytest.mark.slow
def test_the_openai_agents_sdk_over_the_responses_api(qwen_server):
    """The Agents SDK's OpenAIResponsesModel runs the same tool loop as over chat completions."""
    agents = pytest.importorskip("agents")
    run_weather_agent(qwen_server, agents.OpenAIResponsesModel)
