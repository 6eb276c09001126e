"""The server's handlers called directly, without HTTP or uvicorn: the parsed request in, the response
model or the server-sent events out, refusals as APIError; the real SmolLM2 model behind an AsyncEngine,
the offline LLM as the oracle."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from helpers import assert_all_blocks_free, wait_until_idle

from pagedllm import LLM, SamplingParams
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai import protocol as p
from pagedllm.entrypoints.openai.async_engine import AsyncEngine
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.limits import ServerLimits
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels

MODEL = "smollm2-135m"
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def engine():
    engine = AsyncEngine(LLMEngine(EngineConfig(model=MODEL, kv_cache_memory="64MiB", max_model_len=1024)))
    engine.start()
    yield engine
    engine.stop()
    assert_all_blocks_free(engine.engine)


@pytest.fixture
def models(engine) -> OpenAIServingModels:
    return OpenAIServingModels(MODEL, engine.engine.max_model_len)


@pytest.fixture
def completion(engine, models):
    yield OpenAIServingCompletion(engine, models, ServerLimits(api_key=None))
    wait_until_idle(engine.engine)


@pytest.fixture
def chat(engine, models):
    yield OpenAIServingChat(engine, models, ServerLimits(api_key=None))
    wait_until_idle(engine.engine)


@pytest.fixture(scope="module")
def llm(engine):
    return LLM(MODEL, kv_cache_memory="64MiB", max_model_len=1024)  # shares the engine's loaded model


def parse_events(events: list[str]) -> list[dict]:
    """SSE `data: {...}` events as JSON, checking the framing and the closing `data: [DONE]`."""
    assert all(e.startswith("data: ") and e.endswith("\n\n") for e in events), events
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


async def collect(events: AsyncIterator[str]) -> list[str]:
    return [event async for event in events]


def test_models_lists_and_checks_the_served_name():
    models = OpenAIServingModels("tiny", 256)
    (card,) = models.show_available_models().data
    assert (card.id, card.max_model_len) == ("tiny", 256)
    models.check_model(None)
    models.check_model("tiny")
    with pytest.raises(APIError) as info:
        models.check_model("other")
    assert (info.value.status, info.value.param) == (404, "model") and "`other`" in str(info.value)


def test_completion(completion, llm):
    request = p.CompletionRequest(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    response = asyncio.run(completion.create_completion(request))
    expected = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))[0]
    assert isinstance(response, p.CompletionResponse) and response.model == MODEL
    (choice,) = response.choices
    assert (choice.text, choice.finish_reason) == (expected.outputs[0].text, "length")
    prompt_tokens = len(expected.prompt_token_ids)
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (prompt_tokens, 12)


def test_streamed_chat(chat, llm):
    request = p.ChatCompletionRequest(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )

    async def stream() -> list[str]:
        return await collect(await chat.create_chat_completion(request))

    chunks = parse_events(asyncio.run(stream()))
    expected = llm.chat(MESSAGES, SamplingParams(max_tokens=10, temperature=0))[0]
    *deltas, last = chunks
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert deltas[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["choices"][0]["delta"]["role"] is None for c in deltas[1:])
    assert "".join(c["choices"][0]["delta"]["content"] for c in deltas) == expected.outputs[0].text
    assert deltas[-1]["choices"][0]["finish_reason"] == expected.outputs[0].finish_reason
    assert last["choices"] == []
    assert last["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)
    assert last["usage"]["completion_tokens"] == len(expected.outputs[0].token_ids)


def test_closing_a_stream_aborts_its_request(completion, engine):
    request = p.CompletionRequest(prompt=PROMPT, max_tokens=1000, ignore_eos=True, stream=True)

    async def first_event() -> str:
        events = await completion.create_completion(request)
        try:
            return await anext(events)
        finally:
            await events.aclose()  # what the HTTP layer does when the client goes away

    event = asyncio.run(first_event())
    assert json.loads(event.removeprefix("data: "))["choices"][0]["finish_reason"] is None
    wait_until_idle(engine.engine)  # aborted long before 1000 tokens


@pytest.mark.parametrize(
    "kwargs, param, words",
    [  # the server's rule (prompt + max_tokens), then add_request's own check of the prompt's length
        (dict(prompt=PROMPT, max_tokens=1020), "max_tokens", "max_model_len=1024"),
        (dict(prompt="hello " * 1100), "prompt", "max_model_len=1024"),
        (dict(prompt=[PROMPT, "hello " * 1100], stream=True), "prompt", "max_model_len=1024"),
    ],
)
def test_bad_completion_is_a_400_and_adds_nothing(completion, engine, kwargs, param, words):
    request = p.CompletionRequest(model=MODEL, **kwargs)
    with pytest.raises(APIError) as info:
        asyncio.run(completion.create_completion(request))
    assert (info.value.status, info.value.param) == (400, param)
    assert words in str(info.value)
    assert not engine.engine.has_unfinished_requests()  # not even the first of two prompts stays


def test_bad_chat_is_a_400_before_the_engine(chat):
    request = p.ChatCompletionRequest(messages=MESSAGES, top_logprobs=2, stream=True)
    with pytest.raises(APIError) as info:
        asyncio.run(chat.create_chat_completion(request))
    assert (info.value.status, info.value.param) == (400, "top_logprobs")
    assert "needs logprobs=true" in str(info.value)
