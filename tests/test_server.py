"""The OpenAI-compatible server, run for real (uvicorn on loopback) and driven by the official client."""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from helpers import openai_client, running_server

from pagedllm import BeamSearchParams, SamplingParams
from pagedllm._runtime import usable_cpus
from pagedllm.entrypoints.openai.server import build_app, server_cpu_batched_tokens
from pagedllm.ops import native

MODEL = "smollm2-135m"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def server(request):
    """The server on one process, and as `pagedllm serve --tensor-parallel-size 2` runs it (a worker
    process holds half of the model: SmolLM2's 3 KV heads split 2 + 1); `llm` is always one process."""
    app = build_app(MODEL, kv_cache_memory="64MiB", max_model_len=1024, tensor_parallel_size=request.param)
    engine = app.state.engine.engine
    with running_server(app) as base:
        yield base, engine
    if engine.executor is not None:  # the server's shutdown stopped every worker
        assert all(proc.poll() is not None for proc in engine.executor.procs.values())


def test_the_servers_step_budget_on_the_cpu_follows_the_cpus(server):
    """Unset, max_num_batched_tokens is 256 tokens a usable CPU within [512, 2048] (vLLM's server default),
    not the engine's 8192."""
    assert server[1].config.max_num_batched_tokens == server_cpu_batched_tokens(usable_cpus())
    budgets = [server_cpu_batched_tokens(cpus) for cpus in (1, 2, 3, 4, 8, 64)]
    assert budgets == [512, 512, 768, 1024, 2048, 2048]


@pytest.fixture
def client(server):
    with openai_client(*server) as client:
        yield client


@pytest.fixture
def logprob_tolerance(server) -> float:
    """How far the server's logprobs may be from `llm`'s: on two ranks the row-parallel layers' partial
    sums are added in another order than one process's matmul (float32 rounding, ~1e-7 a value), and
    where that moves an activation across a rounding step of the int16 blocks the file's codes are
    multiplied with, the value moves by up to 1.5e-5 of its block's largest. Where a prompt's matmuls take
    the blocks' bf16 path (AVX512_BF16 CPUs, models/quantization.py), each rank's partial sums are rounded
    to bf16 (2^-9 of a value) before they are added, one process's only once: over 30 layers a logprob
    moves by up to ~0.025 here. The CPU's default float16 KV cache does the same to a K/V value whose last
    float32 bit differs, which can round to the next float16 (2^-11 of it): up to ~0.002 measured."""
    if server[1].executor is None:
        return 1e-5
    return 5e-2 if native.bf16_matmul_available() else 5e-3


@pytest.fixture(scope="module")
def llm(server):
    from pagedllm import LLM

    return LLM(MODEL, kv_cache_memory="64MiB", max_model_len=1024)  # shares the server's loaded model


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_greedy_matches_llm_generate(client, llm):
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    expected = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))[0]
    assert response.choices[0].text == expected.outputs[0].text
    assert response.choices[0].finish_reason == "length"
    prompt_tokens = len(expected.prompt_token_ids)
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (prompt_tokens, 12)
    assert response.usage.total_tokens == prompt_tokens + 12


def test_completion_of_token_ids_and_logprobs(client, llm):
    ids = llm.get_tokenizer().encode(PROMPT)
    response = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0, logprobs=2)
    expected = llm.generate(PROMPT, SamplingParams(max_tokens=5, temperature=0))[0].outputs[0]
    assert response.choices[0].text == expected.text
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    assert all(
        lp <= 0 and len(top) >= 2
        for lp, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True)
    )
    assert "".join(logprobs.tokens) == expected.text


def test_completion_stream_concatenates_to_the_full_text(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    full = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16


def test_stop_string_cuts_the_text_streamed_or_not(client, llm):
    text = llm.generate(PROMPT, SamplingParams(max_tokens=16, temperature=0))[0].outputs[0].text
    stop = text.strip()[3:6]  # a string the greedy text surely contains
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    response = client.completions.create(**kwargs)
    assert response.choices[0].text == text[: text.index(stop)]
    assert response.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True))
    assert streamed == response.choices[0].text


def test_n_with_seed_is_reproducible(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, n=2, seed=7)
    first, second = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.usage.completion_tokens == 16


def test_penalties_reach_the_sampler(client, llm):
    prompt = "List the days of the week: Monday, Tuesday,"
    params = dict(presence_penalty=0.5, frequency_penalty=1.5, repetition_penalty=1.2)
    response = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        presence_penalty=params["presence_penalty"],
        frequency_penalty=params["frequency_penalty"],
        extra_body={"repetition_penalty": params["repetition_penalty"]},
    )
    expected = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0, **params))[0].outputs[0]
    plain = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0))[0].outputs[0]
    assert response.choices[0].text == expected.text != plain.text


def test_beam_search_returns_every_beam_as_a_choice(client, llm):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=10, n=3, extra_body={"use_beam_search": True})
    response = client.completions.create(**kwargs)
    beams = llm.beam_search(PROMPT, BeamSearchParams(beam_width=3, max_tokens=10))[0].sequences
    prompt_len = len(llm.get_tokenizer().encode(PROMPT))
    tok = llm.get_tokenizer()
    expected = [tok.decode(b.tokens[prompt_len:], skip_special_tokens=True) for b in beams]
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert [c.text for c in response.choices] == expected
    assert response.usage.completion_tokens == sum(len(b.tokens) - prompt_len for b in beams)
    streamed = {}
    for chunk in client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(3)] == expected


@pytest.mark.parametrize(
    ("body", "name"),
    [
        ({"stop": ["."]}, "stop"),
        ({"logprobs": 2}, "logprobs"),
        ({"prompt_logprobs": 2}, "prompt_logprobs"),
        ({"echo": True, "logprobs": 2}, "logprobs"),
        ({"n": 0}, "n"),
        ({"presence_penalty": 1.0}, "presence_penalty"),
    ],
)
def test_beam_search_refuses_what_it_cannot_honour(client, body, name):
    with pytest.raises(openai.BadRequestError) as info:
        client.post(
            "/completions",
            body={"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "use_beam_search": True} | body,
            cast_to=object,
        )
    assert info.value.body["param"] == name


def test_chat_completion_and_stream(client, llm):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=10, temperature=0
    )
    expected = llm.chat(messages, SamplingParams(max_tokens=10, temperature=0))[0]
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected.outputs[0].text
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.choices[0].finish_reason in ("stop", "length")
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == response.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == response.choices[0].finish_reason


def test_concurrent_requests_all_complete(client, llm):
    prompts = [f"Count to {i}:" for i in range(8)]
    params = SamplingParams(max_tokens=8, temperature=0)
    expected = [o.outputs[0].text for o in llm.generate(prompts, params)]

    def complete(prompt: str) -> str:
        return (
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
        )

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(complete, prompts)) == expected


def test_abandoned_stream_is_aborted(client, server):
    _, engine = server
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1000, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    stream.close()  # the client goes away long before 1000 tokens: the server must abort the request
    deadline = time.monotonic() + 3
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs, error, names",
    [
        (dict(temperature=-1), openai.BadRequestError, "temperature"),
        (dict(max_tokens=0), openai.BadRequestError, "max_tokens"),
        (dict(top_p=1.5), openai.BadRequestError, "1.5"),
        (dict(model="no-such-model"), openai.NotFoundError, "no-such-model"),
        (dict(prompt="hello " * 1100), openai.BadRequestError, "max_model_len=1024"),
        (dict(stream=True, prompt="hello " * 1100), openai.BadRequestError, "max_model_len=1024"),
        (dict(n="two"), openai.BadRequestError, "two"),
        (dict(max_tokens=1020), openai.BadRequestError, "max_model_len=1024"),
        (dict(extra_body={"stop_token_ids": [10**6]}), openai.BadRequestError, "stop_token_ids"),
        (dict(seed=2**70), openai.BadRequestError, "seed"),
        (dict(presence_penalty=2.5), openai.BadRequestError, "presence_penalty"),
        (dict(extra_body={"repetition_penalty": 0}), openai.BadRequestError, "repetition_penalty"),
    ],
)
def test_bad_completion_requests(client, kwargs, error, names):
    request = dict(model=MODEL, prompt=PROMPT, max_tokens=4) | kwargs
    with pytest.raises(error) as info:
        client.completions.create(**request)
    assert names in info.value.body["message"]
    assert info.value.body["code"] == info.value.status_code


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


@pytest.mark.parametrize(
    "endpoint, kwargs, param",
    [  # the README's list of refused fields, then fields the server does not know at all
        ("completions", dict(stream=True, extra_body={"prompt_logprobs": 1}), "prompt_logprobs"),
        ("chat", dict(tools=[TOOL]), "tools"),
        ("chat", dict(response_format={"type": "regex"}), "response_format.type"),
        ("chat", dict(messages=[{"role": "user", "content": [IMAGE]}]), "messages.0.content"),
        ("chat", dict(messages=[{"role": "user", "content": "hi", "name": "bob"}]), "messages.0.name"),
        ("completions", dict(suffix="!"), "suffix"),
        ("completions", dict(best_of=2), "best_of"),
        ("completions", dict(logit_bias={"1": 5}), "logit_bias"),
        ("completions", dict(stream=True, stream_options={"continuous_usage_stats": True}), "stream_options"),
    ],
)
def test_unsupported_fields_are_refused_by_name(client, endpoint, kwargs, param):
    """A field pagedllm does not implement is a 400 naming it, never silently ignored."""
    if endpoint == "chat":
        create = client.chat.completions.create
        request = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4) | kwargs
    else:
        create, request = client.completions.create, dict(model=MODEL, prompt=PROMPT, max_tokens=4) | kwargs
    with pytest.raises(openai.BadRequestError) as info:
        create(**request)
    assert info.value.body["param"].startswith(param), info.value.body
    assert param.split(".")[-1] in info.value.body["message"]


def test_supported_request_shapes_still_pass(client, llm):
    """Zero penalties, echo=false, text content parts and a reply passed back as a message are accepted."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is 2 + 2?"}]}]
    first = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, presence_penalty=0, logprobs=False
    )
    plain = [{"role": "user", "content": "What is 2 + 2?"}]
    expected = llm.chat(plain, SamplingParams(max_tokens=6, temperature=0))
    assert first.choices[0].message.content == expected[0].outputs[0].text
    follow_up = [*messages, first.choices[0].message, {"role": "user", "content": "And 3 + 3?"}]
    second = client.chat.completions.create(model=MODEL, messages=follow_up, max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, echo=False, frequency_penalty=0.0, user="u1"
    )
    assert response.usage.completion_tokens == 3


def test_chat_without_messages_is_a_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL, messages=None)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.post("/chat/completions", body={"model": MODEL}, cast_to=object)


def test_metrics(client, server):
    base, engine = server
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    text = urllib.request.urlopen(f"{base}/metrics").read().decode()
    for name in (
        "pagedllm:num_requests_running",
        "pagedllm:num_requests_waiting",
        "pagedllm:kv_cache_usage_perc",
        "pagedllm:prompt_tokens_total",
        "pagedllm:generation_tokens_total",
        "pagedllm:num_preemptions_total",
    ):
        assert name in text
    generated = next(
        line for line in text.splitlines() if line.startswith("pagedllm:generation_tokens_total")
    )
    assert float(generated.split()[-1]) >= 3
    gauges = {
        line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("pagedllm:")
    }
    # Rank 0's: the model's GGUF blocks (< 100 MiB), about half of them on two ranks; 2 of 3 KV heads there.
    ranks = engine.config.tensor_parallel_size
    assert gauges["pagedllm:weight_memory_bytes"] == engine.weight_bytes
    assert 50 * 2**20 / ranks < engine.weight_bytes < 100 * 2**20 / ranks + 10 * 2**20
    block_bytes = 2 * 30 * engine.model.num_kv_heads * 64 * 2 * 32  # K and V, 30 layers, 32 float16 tokens
    assert engine.model.num_kv_heads == (3 if ranks == 1 else 2)
    assert (
        gauges["pagedllm:kv_cache_memory_bytes"]
        == engine.kv_cache_bytes
        == 64 * 2**20 // block_bytes * block_bytes
    )
    assert gauges["pagedllm:kv_cache_blocks"] == engine.num_kv_blocks
    assert gauges["pagedllm:kv_cache_block_size"] == engine.config.block_size == 32  # float16's default


def test_echo_puts_the_prompt_before_the_completion(client, llm):
    expected = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0))[0].outputs[0].text
    kwargs = dict(model=MODEL, max_tokens=6, temperature=0, echo=True)
    assert client.completions.create(prompt=PROMPT, **kwargs).choices[0].text == PROMPT + expected
    ids = llm.get_tokenizer().encode(PROMPT)
    assert client.completions.create(prompt=ids, **kwargs).choices[0].text == PROMPT + expected
    chunks = list(client.completions.create(prompt=PROMPT, stream=True, **kwargs))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in chunks) == PROMPT + expected


def test_echo_with_logprobs_scores_the_prompt(client, llm, logprob_tolerance):
    """echo with logprobs: the prompt's tokens first (the first with nulls, as OpenAI's), then the
    completion's; max_tokens 0 gives the prompt alone (lm-eval's request for a loglikelihood)."""
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(max_tokens=3, temperature=0, logprobs=2, prompt_logprobs=2)
    expected = llm.generate(PROMPT, params)[0]
    ids, completion = expected.prompt_token_ids, expected.outputs[0]
    tokens = [tokenizer.decode([t]) for t in ids + completion.token_ids]
    entries = expected.prompt_logprobs + completion.logprobs
    kwargs = dict(model=MODEL, prompt=PROMPT, temperature=0, echo=True, logprobs=2)
    for max_tokens in (0, 3):
        response = client.completions.create(max_tokens=max_tokens, **kwargs)
        choice, n = response.choices[0], len(ids) + max_tokens
        assert choice.text == PROMPT + (completion.text if max_tokens else "")
        assert (choice.finish_reason, response.usage.completion_tokens) == ("length", max_tokens)
        logprobs = choice.logprobs
        assert logprobs.tokens == tokens[:n]
        assert logprobs.text_offset == [sum(map(len, tokens[:i])) for i in range(n)]
        assert (logprobs.token_logprobs[0], logprobs.top_logprobs[0]) == (None, None)
        for token, got, top, entry in zip(
            (ids + completion.token_ids)[1:n],
            logprobs.token_logprobs[1:],
            logprobs.top_logprobs[1:],
            entries[1:n],
            strict=True,
        ):
            assert got == pytest.approx(entry[token], abs=logprob_tolerance)
            assert set(top) == {tokenizer.decode([t]) for t in entry}  # the top 2 and the token
        chunks = client.completions.create(max_tokens=max_tokens, stream=True, **kwargs)
        streamed = [chunk.choices[0] for chunk in chunks]
        assert streamed[0].text.startswith(PROMPT)  # the prompt's tokens come in the first chunk
        assert streamed[0].logprobs.tokens[: len(ids)] == tokens[: len(ids)]
        assert "".join(c.text for c in streamed) == choice.text
        assert sum((c.logprobs.tokens for c in streamed), []) == tokens[:n]
    # vLLM's prompt_logprobs: per prompt token its log-probability, rank and text, keyed by token id.
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    scored = response.choices[0].model_extra["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(ids)
    for token, got, entry in zip(ids[1:], scored[1:], expected.prompt_logprobs[1:], strict=True):
        assert {int(t) for t in got} == set(entry)
        assert got[str(token)]["logprob"] == pytest.approx(entry[token], abs=logprob_tolerance)
        assert got[str(token)]["decoded_token"] == tokenizer.decode([token])
        ranked = sorted(entry, key=lambda t: -entry[t])[:2]
        assert [got[str(t)]["rank"] for t in ranked] == [1, 2]


def test_several_prompts_give_choices_prompt_major(client, llm):
    """vLLM's order: choice i * n + j is the j-th completion of prompt i; usage counts every prompt."""
    prompts = [PROMPT, "def fib(n):", "1, 2, 3,"]
    params = SamplingParams(max_tokens=5, temperature=0)
    expected = llm.generate(prompts, params)
    kwargs = dict(model=MODEL, prompt=prompts, max_tokens=5, temperature=0, n=2)
    response = client.completions.create(**kwargs)
    assert [c.index for c in response.choices] == list(range(6))
    assert [c.text for c in response.choices] == [o.outputs[0].text for o in expected for _ in range(2)]
    assert response.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)
    assert response.usage.completion_tokens == 6 * 5
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(6)] == [c.text for c in response.choices]


def test_chat_logprobs_are_the_engines_streamed_or_not(client, llm, logprob_tolerance):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=3)
    # Each side computes the prompt once first: asked again, it is found in the prefix cache and its last
    # rows take the blocks' few-row path, where the first time a prefill of many rows may take their bf16
    # path (models/quantization.py). Compared after that, server and engine ran the same path.
    client.chat.completions.create(**kwargs)
    llm.chat(messages, params)
    response = client.chat.completions.create(**kwargs)
    expected = llm.chat(messages, params)[0].outputs[0]
    content = response.choices[0].logprobs.content
    tokenizer = llm.get_tokenizer()
    assert [e.token for e in content] == [tokenizer.decode([t]) for t in expected.token_ids]
    for entry, token_id, top in zip(content, expected.token_ids, expected.logprobs, strict=True):
        assert entry.logprob == pytest.approx(top[token_id], abs=logprob_tolerance)
        assert entry.bytes == list(entry.token.encode())
        best3 = sorted(top.values(), reverse=True)[:3]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(best3, abs=logprob_tolerance)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the likeliest
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = [e for c in chunks for e in (c.choices[0].logprobs.content if c.choices[0].logprobs else [])]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_response_format_constrains_the_output_to_json(client, llm):
    """Unconstrained, the model answers in prose; with response_format the text parses as the JSON asked
    for (json.loads and the schema's own rules are the oracle) and ends with the grammar ("stop")."""
    messages = [
        {
            "role": "user",
            "content": "Give me a JSON object describing a person called Ada: her name and her age.",
        }
    ]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=60, temperature=0)
    prose = client.chat.completions.create(**kwargs).choices[0].message.content
    with pytest.raises(json.JSONDecodeError):
        json.loads(prose)
    response = client.chat.completions.create(**kwargs, response_format={"type": "json_object"})
    assert isinstance(json.loads(response.choices[0].message.content), dict)
    assert response.choices[0].finish_reason == "stop"
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    response = client.chat.completions.create(**kwargs, response_format=schema_format)
    person = json.loads(response.choices[0].message.content)
    assert sorted(person) == ["age", "name"]
    assert isinstance(person["name"], str) and isinstance(person["age"], int)
    chunks = client.chat.completions.create(**kwargs, response_format=schema_format, stream=True)
    assert json.loads("".join(c.choices[0].delta.content or "" for c in chunks)) == person
    # The offline API takes the same grammar through SamplingParams and gives the same greedy text.
    from pagedllm import GuidedDecodingParams

    offline = llm.chat(
        messages,
        SamplingParams(max_tokens=60, temperature=0, guided_decoding=GuidedDecodingParams(json=PERSON)),
    )
    assert offline[0].outputs[0].text == response.choices[0].message.content


@pytest.mark.parametrize(
    "response_format, words",
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}, "foo"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema.schema"),
    ],
)
def test_unusable_response_format_is_a_bad_request(client, response_format, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={"response_format": response_format}
        )
    assert info.value.body["param"] == "response_format"
    assert words in info.value.body["message"]


def _post(base: str, path: str, body: bytes, content_type: str = "application/json") -> tuple[int, dict]:
    request = urllib.request.Request(f"{base}{path}", data=body, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.parametrize(
    "body, content_type, words",
    [
        (
            b'{"prompt": "hi", "max_tokens": ',
            "application/json",
            "not valid JSON: Expecting value at character 31",
        ),
        (b'{"prompt": "hi",}', "application/json", "not valid JSON: Expecting property name"),
        (b"[1, 2]", "application/json", "must be a JSON object"),
        (b'{"prompt": "hi"}', "text/plain", "must be a JSON object (Content-Type: application/json)"),
    ],
)
def test_malformed_bodies_are_explained_in_words(client, server, body, content_type, words):
    status, reply = _post(server[0], "/v1/completions", body, content_type)
    assert status == 400
    assert words in reply["error"]["message"], reply
    assert reply["error"]["code"] == 400 and reply["error"]["type"] == "BadRequestError"


def test_unknown_routes_answer_in_openai_shape(client, server):
    status, reply = _post(server[0], "/v1/nothing", b"{}")
    assert (
        status == 404
        and reply["error"]["type"] == "NotFoundError"
        and "/v1/nothing" in reply["error"]["message"]
    )
    try:
        urllib.request.urlopen(f"{server[0]}/v1/completions")
    except urllib.error.HTTPError as error:
        assert error.code == 405 and json.loads(error.read())["error"]["code"] == 405


def test_prefix_cache_metrics_count_a_repeated_prompt(client, server, llm):
    base, _ = server
    names = ("pagedllm:prefix_cache_queries_total", "pagedllm:prefix_cache_hits_total")

    def counters() -> list[float]:
        lines = urllib.request.urlopen(f"{base}/metrics").read().decode().splitlines()
        return [float(next(x for x in lines if x.startswith(name + " ")).split()[-1]) for name in names]

    prompt = "A prefix-cache test: the quick brown fox jumps over the lazy dog, twice. " * 6
    num_tokens = len(llm.get_tokenizer().encode(prompt))
    before = counters()
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    expected = [before[0] + 2 * num_tokens, before[1] + (num_tokens - 1) // 16 * 16]
    deadline = time.monotonic() + 5  # the engine thread updates /metrics right after the step
    while counters() != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    assert counters() == expected
