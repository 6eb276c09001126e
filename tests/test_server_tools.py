"""Tool calling through the server, on tiny random models (fast): a Hermes chat template (the format of
Qwen2.5's) over SmolLM2's tokenizer for the plumbing, SmolLM2's own template (no tool support) for the
refusal. Transformers' apply_chat_template is the oracle of what the template is given; the whole
response is the oracle of the streamed one. What a real model's calls hold: test_server_tools_qwen.py.
"""

from __future__ import annotations

import json

import openai
import pytest
from helpers import openai_client, running_server, write_tiny_chat_model

from pagedllm.entrypoints.openai.server import build_app

# A Hermes tool template in ChatML (as Qwen2.5's: tools listed in the system turn, each call a
# <tool_call> block, tool results in a user turn), written for these tests.
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{{ messages[0]['content'] if messages[0]['role'] == 'system' else 'You are a helpful assistant.' }}

# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
For each call write <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif not (message.role == 'system' and loop.first) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}
TOOLS = [WEATHER, TIME]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
LOOP = [
    {"role": "system", "content": "You answer questions about the weather."},
    *QUESTION,
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees C, sunny"},
]


@pytest.fixture(scope="module")
def hermes_model(tmp_path_factory):
    folder = write_tiny_chat_model(tmp_path_factory.mktemp("tiny-hermes"))
    (folder / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    return folder


@pytest.fixture(scope="module")
def server(hermes_model):
    app = build_app(str(hermes_model), served_model_name="tiny", kv_cache_memory="32MiB", max_model_len=1024)
    with running_server(app) as base:
        yield base, app.state.engine.engine


@pytest.fixture
def client(server):
    with openai_client(*server) as client:  # afterwards: nothing running, every KV block free
        yield client


def chat(client: openai.OpenAI, **kwargs):
    request = dict(model="tiny", messages=QUESTION, tools=TOOLS, max_tokens=24, temperature=0) | kwargs
    return client.chat.completions.create(**request)


def tokenize(client: openai.OpenAI, **body) -> list[int]:
    """POST /tokenize (vLLM's route, beside /v1)."""
    root = client.with_options(base_url=str(client.base_url).removesuffix("/v1/"))
    return root.post("/tokenize", body={"model": "tiny"} | body, cast_to=object)["tokens"]


def template_ids(tokenizer, messages: list[dict], **kwargs) -> list[int]:
    """transformers' rendering with the generation prompt, tokenized (input_ids in transformers 5)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_the_template_gets_the_tools_the_calls_and_the_results_as_transformers_gives_them(
    client, hermes_model
):
    """The server's prompt (its /tokenize and the chat's prompt_tokens) is transformers' rendering of
    the same conversation: tools as given, a call's arguments as the object their JSON holds."""
    from transformers import AutoTokenizer

    oracle = AutoTokenizer.from_pretrained(hermes_model)
    as_transformers = [
        {**m, "tool_calls": [{**CALL, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
        if m.get("tool_calls")
        else {k: v for k, v in m.items() if v is not None}
        for m in LOOP
    ]
    expected = template_ids(oracle, as_transformers, tools=TOOLS)
    assert tokenize(client, messages=LOOP, tools=TOOLS) == expected
    text = oracle.decode(expected)
    assert '"arguments": {"city": "Paris"}' in text and "22 degrees C, sunny" in text
    assert json.dumps(WEATHER) in text
    response = chat(client, messages=LOOP, max_tokens=1)
    assert response.usage.prompt_tokens == len(expected)
    # tool_choice none: the model is not shown the tools, the conversation is rendered without them
    without = template_ids(oracle, as_transformers)
    assert chat(client, messages=LOOP, tool_choice="none", max_tokens=1).usage.prompt_tokens == len(without)


@pytest.mark.parametrize(
    "tool_choice, parallel",
    [
        ("required", True),
        ("required", False),
        ({"type": "function", "function": {"name": "get_time"}}, True),
        ("auto", True),
    ],
    ids=["required", "required-one", "named", "auto"],
)
def test_streamed_calls_reassemble_to_the_whole_response(client, tool_choice, parallel):
    """Greedy, so both runs write the same text: the chunks' content and call deltas add up to the whole
    response's message; each call's first delta has its id, type and name, the next ones arguments;
    the chunks that carry text or calls carry every token's logprob between them."""
    request = dict(tool_choice=tool_choice, parallel_tool_calls=parallel, logprobs=True)
    whole = chat(client, **request).choices[0]
    chunks = list(chat(client, stream=True, **request))
    content, calls, finish, logprobs = "", {}, None, []
    for chunk in chunks:
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        logprobs += choice.logprobs.content if choice.logprobs else []
        for delta in choice.delta.tool_calls or []:
            if delta.index not in calls:
                assert delta.id.startswith("call_") and delta.type == "function" and delta.function.name
                calls[delta.index] = [delta.function.name, ""]
            else:
                assert delta.id is None and delta.function.name is None
            calls[delta.index][1] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    made = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert (content, [tuple(calls[i]) for i in sorted(calls)]) == (whole.message.content or "", made)
    assert finish == whole.finish_reason
    assert [(t.token, t.logprob) for t in logprobs] == [(t.token, t.logprob) for t in whole.logprobs.content]
    if tool_choice == "auto":
        assert whole.message.content and not made  # random weights: text, no <tool_call>
        return
    # guided from the first token: no text, only calls of the given tools (the random model spends
    # max_tokens on the whitespace JSON allows, so how far it gets varies)
    allowed = {"get_time"} if isinstance(tool_choice, dict) else {"get_weather", "get_time"}
    assert not whole.message.content and {name for name, _ in made} <= allowed
    if isinstance(tool_choice, dict) or not parallel:
        assert len(made) <= 1
    assert whole.finish_reason in ("length", "tool_calls")
    assert made or whole.finish_reason == "length"


@pytest.mark.parametrize(
    "kwargs, param, words",
    [
        (dict(tool_choice="sometimes"), "tool_choice", "'required'"),
        (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice", "'nope'"),
        (dict(tool_choice={"type": "function"}), "tool_choice.function", "required"),
        (dict(tools=None, tool_choice="required"), "tool_choice", "needs tools"),
        (dict(tools=[WEATHER, WEATHER]), "tools", "repeated: ['get_weather']"),
        (dict(tools=[{"type": "retrieval"}]), "tools.0.type", "'function'"),
        (
            dict(tools=[{"type": "function", "function": {"description": "x"}}]),
            "tools.0.function.name",
            "required",
        ),
        (
            dict(tool_choice="required", response_format={"type": "json_object"}),
            "response_format",
            "both guide",
        ),
        (
            dict(tool_choice="required", extra_body={"use_beam_search": True}),
            "tool_choice",
            "use_beam_search",
        ),
        (
            dict(
                messages=[
                    *QUESTION,
                    {**LOOP[2], "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{"}}]},
                ]
            ),
            "messages.1.tool_calls.0.function.arguments",
            "not JSON",
        ),
        (
            dict(
                tool_choice="required",
                tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nothing"}}}],
            ),
            "tools",
            "JSON schema",
        ),
    ],
)
def test_tool_requests_the_server_cannot_honour_are_refused_by_name(client, kwargs, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, **kwargs)
    assert info.value.body["param"] == param, info.value.body
    assert words in info.value.body["message"]


@pytest.fixture(scope="module")
def smollm2_template_server(tiny_chat_model):
    app = build_app(str(tiny_chat_model), served_model_name="tiny", max_model_len=256)
    with running_server(app) as base:
        yield base, app.state.engine.engine


def test_tools_on_a_template_without_tool_support_are_refused(smollm2_template_server):
    """SmolLM2's template never reads `tools`: shown none, the model could only answer blind, so the
    request is refused rather than the tools silently dropped; tool_choice none needs no template."""
    with openai_client(*smollm2_template_server) as client:
        for call in (lambda: chat(client), lambda: tokenize(client, messages=QUESTION, tools=TOOLS)):
            with pytest.raises(openai.BadRequestError) as info:
                call()
            assert info.value.body["param"] == "tools" and "tool support" in info.value.body["message"]
        assert chat(client, tool_choice="none", max_tokens=2).choices[0].message.tool_calls == []
