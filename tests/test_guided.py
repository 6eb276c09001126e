"""Guided decoding (response_format): every finished output parses as the JSON asked for (json.loads and
the schema's rules are the oracle), on a tiny random model whose unconstrained text is noise."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import assert_all_blocks_free

from pagedllm import LLM, GuidedDecodingParams, SamplingParams
from pagedllm.engine.sampler import SampleRow, sample

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny_llm(tiny_chat_model):
    return LLM(str(tiny_chat_model), kv_cache_memory="16MiB", max_model_len=512)


def test_sampled_outputs_are_the_schemas_json(tiny_llm):
    params = SamplingParams(
        n=16, temperature=1.0, seed=0, max_tokens=200, guided_decoding=GuidedDecodingParams(json=SCHEMA)
    )
    free = tiny_llm.generate("x", SamplingParams(n=16, temperature=1.0, seed=0, max_tokens=200))[0].outputs
    assert not any(o.text.lstrip().startswith("{") for o in free)  # the model alone writes no JSON
    outputs = tiny_llm.generate("x", params)[0].outputs
    finished = [o for o in outputs if o.finish_reason == "stop"]
    assert finished, [o.text[:40] for o in outputs]
    for o in finished:
        value = json.loads(o.text)
        assert sorted(value) == ["a", "b"] and type(value["a"]) is int and type(value["b"]) is bool
    for o in outputs:  # a cut-off one is still the start of such an object
        assert o.text.startswith("{")
    assert_all_blocks_free(tiny_llm)


def test_a_bad_schema_is_refused_before_anything_runs(tiny_llm):
    bad = SamplingParams(guided_decoding=GuidedDecodingParams(json={"type": "no-such-type"}))
    with pytest.raises(ValueError, match="no-such-type"):
        tiny_llm.generate("x", bad)
    assert_all_blocks_free(tiny_llm)


def test_guided_params_need_exactly_one_grammar():
    with pytest.raises(ValueError, match="exactly one"):
        GuidedDecodingParams()
    with pytest.raises(ValueError, match="exactly one"):
        GuidedDecodingParams(json=SCHEMA, json_object=True)


def test_when_the_grammar_allows_only_eos_it_beats_min_tokens(tiny_llm):
    """After "{}" a JSON-object grammar allows only the end token, which min_tokens bans: the sampler
    keeps the end token (greedy and sampled) instead of sampling from an empty distribution."""
    engine = tiny_llm.engine
    eos = sorted(engine.eos_token_ids)
    for temperature in (0.0, 1.0):
        guide = engine.grammars.guide(GuidedDecodingParams(json_object=True))
        for token in tiny_llm.get_tokenizer().encode("{}"):
            assert guide.accept(token)
        params = SamplingParams(temperature=temperature, min_tokens=10)
        logits = torch.randn(1, engine.model.config.vocab_size)
        (smp,) = sample(
            logits, [SampleRow(params, torch.Generator().manual_seed(0), tuple(eos), guide=guide)]
        )
        assert smp.token_id in eos


def test_without_any_whitespace_the_json_is_json_dumps_text(tiny_llm):
    """any_whitespace=False: no whitespace but json.dumps' separators, where the default allows any."""
    tokenizer, grammars = tiny_llm.get_tokenizer(), tiny_llm.engine.grammars

    def accepts(text: str, any_whitespace: bool) -> bool:
        guide = grammars.guide(GuidedDecodingParams(json=SCHEMA, any_whitespace=any_whitespace))
        return all(guide.accept(token) for token in tokenizer.encode(text))

    assert accepts('{"a": 1, "b": true}', False) and accepts('{"a": 1, "b": true}', True)
    assert not accepts('{ "a": 1, "b": true}', False) and accepts('{ "a": 1, "b": true}', True)
    assert not accepts('{"a":\n1, "b": true}', False) and accepts('{"a":\n1, "b": true}', True)
    guided = GuidedDecodingParams(json=SCHEMA, any_whitespace=False)
    params = SamplingParams(n=8, temperature=1.0, seed=0, max_tokens=200, guided_decoding=guided)
    finished = [o for o in tiny_llm.generate("x", params)[0].outputs if o.finish_reason == "stop"]
    assert finished
    for o in finished:
        assert o.text == json.dumps(json.loads(o.text))
    assert_all_blocks_free(tiny_llm)
