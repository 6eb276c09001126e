"""vLLM's small endpoints on the built-in SmolLM2: POST /tokenize (a prompt, or messages through the chat
template) and POST /detokenize against transformers' own tokenizer and the engine's prompt_tokens,
GET /version, the model card's fields, and the refusals (400 naming the field, 404, 401)."""

from __future__ import annotations

import openai
import pytest
from helpers import openai_client, running_server
from test_server_tools import template_ids

import pagedllm
from pagedllm.entrypoints.openai.limits import ServerLimits
from pagedllm.entrypoints.openai.server import build_app
from pagedllm.models.loader import resolve_checkpoint

MODEL = "smollm2-135m"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": [{"type": "text", "text": "Name "}, {"type": "text", "text": "a color."}]},
]
PLAIN = [MESSAGES[0], {"role": "user", "content": "Name a color."}]
TEXT = "The capital of France is Paris. Ünïcödé, 123."


@pytest.fixture(scope="module")
def server():
    app = build_app(MODEL, kv_cache_memory="32MiB", max_model_len=512, limits=ServerLimits(api_key=None))
    with running_server(app) as base:
        yield base, app.state.engine.engine


@pytest.fixture
def client(server):
    with openai_client(*server) as client:
        yield client.with_options(base_url=server[0])  # vLLM's routes: /tokenize, not /v1/tokenize


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_checkpoint(MODEL))


def post(client: openai.OpenAI, path: str, **body) -> dict:
    return client.post(path, body=body, cast_to=object)


def test_tokenize_a_prompt(client, hf_tokenizer):
    reply = post(client, "/tokenize", model=MODEL, prompt=TEXT, return_token_strs=True)
    expected = hf_tokenizer.encode(TEXT)
    assert reply == {
        "count": len(expected),
        "max_model_len": 512,
        "tokens": expected,
        "token_strs": hf_tokenizer.convert_ids_to_tokens(expected),
    }
    bare = post(client, "/tokenize", prompt=TEXT, add_special_tokens=False)
    assert (
        bare["tokens"] == hf_tokenizer.encode(TEXT, add_special_tokens=False) and bare["token_strs"] is None
    )


def test_tokenize_messages_is_the_chat_prompt(client, hf_tokenizer, server):
    """The ids the chat route would run: transformers' rendering of the template, the chat response's
    prompt_tokens; add_generation_prompt and add_special_tokens as vLLM reads them."""
    ids = post(client, "/tokenize", messages=MESSAGES)["tokens"]
    assert ids == template_ids(hf_tokenizer, PLAIN)
    chat = openai.OpenAI(base_url=f"{server[0]}/v1", api_key="none", max_retries=0)
    response = chat.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert response.usage.prompt_tokens == len(ids)
    text = hf_tokenizer.apply_chat_template(PLAIN, add_generation_prompt=False, tokenize=False)
    no_prompt = post(client, "/tokenize", messages=MESSAGES, add_generation_prompt=False)["tokens"]
    assert no_prompt == hf_tokenizer.encode(text, add_special_tokens=False) and len(no_prompt) < len(ids)
    special = post(client, "/tokenize", messages=MESSAGES, add_special_tokens=True)["tokens"]
    assert special == hf_tokenizer.encode(hf_tokenizer.decode(ids), add_special_tokens=True)


def test_detokenize(client, hf_tokenizer):
    ids = hf_tokenizer.encode(TEXT)
    assert post(client, "/detokenize", model=MODEL, tokens=ids) == {"prompt": hf_tokenizer.decode(ids)}
    template_ids = post(client, "/tokenize", messages=MESSAGES)["tokens"]  # special tokens are kept
    assert post(client, "/detokenize", tokens=template_ids)["prompt"].startswith("<|im_start|>system")
    assert post(client, "/detokenize", tokens=[]) == {"prompt": ""}


def test_version_and_the_model_card(client):
    assert client.get("/version", cast_to=object) == {"version": pagedllm.__version__}
    (card,) = client.get("/v1/models", cast_to=object)["data"]
    assert (card["id"], card["root"], card["max_model_len"], card["object"]) == (MODEL, MODEL, 512, "model")


@pytest.mark.parametrize(
    "path, body, param, words",
    [
        ("/tokenize", {}, None, "exactly one of prompt or messages"),
        ("/tokenize", {"prompt": "a", "messages": PLAIN}, None, "exactly one of prompt or messages"),
        ("/tokenize", {"messages": []}, "messages", "at least 1"),
        ("/tokenize", {"prompt": 5}, "prompt", "valid string"),
        ("/tokenize", {"prompt": "a", "tools": []}, None, "tools go with messages"),
        (
            "/tokenize",
            {"messages": PLAIN, "continue_final_message": True},
            "continue_final_message",
            "not supported",
        ),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages.0.content",
            "'image_url'",
        ),
        ("/tokenize", {"messages": [{"content": "hi"}]}, "messages.0.role", "required"),
        ("/detokenize", {"tokens": [1, -2]}, "tokens.1", "greater than or equal to 0"),
        ("/detokenize", {"tokens": [49152]}, "tokens", "49152 tokens"),
        ("/detokenize", {"tokens": "hello"}, "tokens", "valid list"),
        ("/detokenize", {}, "tokens", "required"),
    ],
)
def test_bad_requests_are_refused_by_name(client, path, body, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        post(client, path, **body)
    assert info.value.body["param"] == param, info.value.body
    assert words in info.value.body["message"]


def test_an_unknown_model_is_a_404(client):
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
        with pytest.raises(openai.NotFoundError, match="nope"):
            post(client, path, model="nope", **body)


def test_the_api_key_guards_tokenize_and_detokenize_too(tiny_chat_model):
    """They read request bodies like the /v1 routes, so the same door stands in front of them (vLLM
    leaves them open); /version stays open as /health does."""
    app = build_app(str(tiny_chat_model), limits=ServerLimits(api_key="k"), max_model_len=64)
    with running_server(app) as base:
        anonymous = openai.OpenAI(base_url=base, api_key="wrong", max_retries=0)
        for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
            with pytest.raises(openai.AuthenticationError):
                post(anonymous, path, **body)
        assert anonymous.get("/version", cast_to=object)["version"] == pagedllm.__version__
        keyed = openai.OpenAI(base_url=base, api_key="k", max_retries=0)
        assert post(keyed, "/tokenize", prompt="a")["count"] >= 1
