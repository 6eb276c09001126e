"""Tool calling on a real tool-calling model, Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, from its PyPI part
packages), through the server: the official openai client's tool loop and the OpenAI Agents SDK's.
Guided calls (tool_choice required or a named function) must parse and match each tool's JSON schema
(jsonschema is the oracle); transformers' apply_chat_template is the oracle of the prompts."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from helpers import openai_client, running_server
from test_server_tools import template_ids

from pagedllm.entrypoints.openai.server import build_app
from pagedllm.models.builtin import QWEN_CODER_05B
from pagedllm.models.gguf_loader import converted_folder

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}


@pytest.fixture(scope="session")
def qwen_gguf() -> Path:
    """The built-in model's GGUF, joined and checked once into pagedllm's cache by the loader's own code."""
    try:
        return QWEN_CODER_05B.path()
    except ModuleNotFoundError as missing:  # its part packages are not installed
        pytest.skip(str(missing))


@pytest.fixture(scope="module")
def server(qwen_gguf):
    app = build_app(str(qwen_gguf), served_model_name="qwen", kv_cache_memory="128MiB", max_model_len=2048)
    with running_server(app) as base:
        yield base, app.state.engine.engine


@pytest.fixture(scope="module")
def oracle(qwen_gguf):
    """transformers' tokenizer and chat template for the same converted folder."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(converted_folder(qwen_gguf))


def checked_calls(message) -> list[tuple[str, dict]]:
    """The message's calls, each one's arguments parsed and validated against its tool's schema."""
    calls = []
    for call in message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


def test_a_tool_loop_with_the_official_client(server, oracle):
    """A named function's call (guided: it parses and matches the schema), the same call streamed, the
    tool's result sent back, and the answer; then tool_choice required over two tools."""
    with openai_client(*server) as client:
        messages = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
        named = {"type": "function", "function": {"name": "get_weather"}}
        request = dict(model="qwen", messages=messages, tools=[WEATHER, TIME], temperature=0, max_tokens=80)
        first = client.chat.completions.create(tool_choice=named, **request).choices[0]
        assert first.finish_reason == "tool_calls" and first.message.content is None
        ((name, arguments),) = checked_calls(first.message)
        assert name == "get_weather" and arguments["unit"] == "celsius"

        streamed = {}
        for chunk in client.chat.completions.create(tool_choice=named, stream=True, **request):
            for delta in chunk.choices[0].delta.tool_calls or []:
                streamed[delta.index] = streamed.get(delta.index, "") + delta.function.arguments
        assert streamed == {0: first.message.tool_calls[0].function.arguments}

        call = first.message.tool_calls[0]
        result = {"role": "tool", "tool_call_id": call.id, "content": "22 degrees celsius, sunny"}
        loop = [*messages, first.message.model_dump(exclude_none=True), result]
        answer = client.chat.completions.create(**request | dict(messages=loop, tool_choice="none"))
        choice = answer.choices[0]
        assert choice.message.content and not choice.message.tool_calls
        assert choice.finish_reason in ("stop", "length")
        # the answer's prompt held the call (its arguments as an object) and the result, as transformers
        # renders them; tool_choice none showed the model no tools
        as_transformers = [
            *messages,
            {
                "role": "assistant",
                "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}],
            },
            result,
        ]
        assert answer.usage.prompt_tokens == len(template_ids(oracle, as_transformers))
        root = client.with_options(base_url=str(client.base_url).removesuffix("/v1/"))
        tokenized = root.post("/tokenize", body={"messages": loop, "tools": [WEATHER, TIME]}, cast_to=object)
        assert tokenized["tokens"] == template_ids(oracle, as_transformers, tools=[WEATHER, TIME])

        both = [{"role": "user", "content": "What are the weather and the local time in Rome?"}]
        required = client.chat.completions.create(**request | dict(messages=both, tool_choice="required"))
        required = required.choices[0]
        assert required.finish_reason == "tool_calls"
        assert {name for name, _ in checked_calls(required.message)} <= set(SCHEMAS)


def test_the_openai_agents_sdk_runs_a_tool(server):
    """The OpenAI Agents SDK over chat completions."""
    agents = pytest.importorskip("agents")
    run_weather_agent(server, agents.OpenAIChatCompletionsModel)


def run_weather_agent(server, model_class) -> None:
    """The OpenAI Agents SDK (offline: tracing off, the local server as its `model_class`: chat completions
    or Responses) calls the tool with the arguments the model chose, sends the result back and ends with
    the model's answer."""
    import agents
    import openai

    agents.set_tracing_disabled(True)
    cities = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        cities.append(city)
        return f"22 degrees celsius and sunny in {city}"

    base, engine = server
    model = model_class(
        model="qwen", openai_client=openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    )
    agent = agents.Agent(
        name="weather",
        instructions="You answer questions about the weather.",
        tools=[get_weather],
        model=model,
        # required on the first turn (guided); the SDK resets it to auto once the tool has run
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=48),
    )
    with openai_client(base, engine):  # afterwards: every KV block free
        result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    assert cities == ["Paris"]
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    assert isinstance(result.final_output, str) and result.final_output
