"""The reasoning parser (`--reasoning-parser qwen3|deepseek_r1`): `<think>` blocks split off as they stream
(a tag cut across deltas, token by token with a real tokenizer's pieces), the tool parser reading what is
left, and the chat route's `reasoning_content` and `chat_template_kwargs` on a tiny model whose template
opens the block in its generation prompt (Qwen3-Thinking's), against /v1/completions on the prompt
transformers renders."""

from __future__ import annotations

import pytest
from helpers import openai_client, running_server, write_tiny_chat_model

from pagedllm.entrypoints.openai.reasoning import (
    ReasoningParser,
    new_reasoning_parser,
    prompt_opens_reasoning,
)
from pagedllm.entrypoints.openai.server import build_app
from pagedllm.entrypoints.openai.serving_chat import OutputParsers, _parsed_delta
from pagedllm.entrypoints.openai.tool_parser import HermesToolParser
from pagedllm.entrypoints.openai.tools import ToolPlan

# (text, parser starts in reasoning, expected reasoning, expected content)
CASES = [
    ("<think>\nLet me see: 2+2.\n</think>\n\nIt is 4.", False, "Let me see: 2+2.\n", "It is 4."),
    ("It is 4.", False, None, "It is 4."),
    ("  <think>a < b </thin</think>yes", False, "a < b </thin", "yes"),
    ("Let me see.\n</think>\n\nIt is 4.", True, "Let me see.\n", "It is 4."),
    ("<think>cut off by max_tokens </thi", False, "cut off by max_tokens </thi", ""),
    ("<thin", False, None, "<thin"),
    ("all reasoning, never closed", True, "all reasoning, never closed", ""),
    ("<think></think>answer <think>not again</think>", False, None, "answer <think>not again</think>"),
    ("\n\n", True, None, ""),
]


def streamed(parser: ReasoningParser, pieces: list[str]) -> tuple[str | None, str]:
    reasoning = content = ""
    for piece in pieces:
        delta = parser.feed(piece)
        reasoning, content = reasoning + delta.reasoning, content + delta.content
    delta = parser.close()
    return (reasoning + delta.reasoning) or None, content + delta.content


@pytest.mark.parametrize(("text", "in_reasoning", "reasoning", "content"), CASES)
def test_the_split_of_a_whole_response(text, in_reasoning, reasoning, content):
    assert ReasoningParser(in_reasoning).parse(text) == (reasoning, content)


@pytest.mark.parametrize(("text", "in_reasoning", "reasoning", "content"), CASES)
def test_every_cut_into_two_deltas_and_single_characters_split_the_same(
    text, in_reasoning, reasoning, content
):
    for cut in range(len(text) + 1):
        assert streamed(ReasoningParser(in_reasoning), [text[:cut], text[cut:]]) == (reasoning, content), cut
    assert streamed(ReasoningParser(in_reasoning), list(text)) == (reasoning, content)


@pytest.fixture(scope="module")
def tokenizer():
    from pagedllm.models.loader import resolve_checkpoint
    from pagedllm.models.tokenizer import load_tokenizer

    return load_tokenizer(resolve_checkpoint("smollm2-135m"))


def token_deltas(tokenizer, text: str) -> list[str]:
    """The text as a detokenizer streams it, token by token (SmolLM2's vocabulary cuts `<think>`)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    decoded = [tokenizer.decode(ids[:i]) for i in range(len(ids) + 1)]
    assert decoded[-1] == text
    return [b[len(a) :] for a, b in zip(decoded, decoded[1:], strict=False)]


@pytest.mark.parametrize(("text", "in_reasoning", "reasoning", "content"), CASES)
def test_token_by_token(tokenizer, text, in_reasoning, reasoning, content):
    pieces = token_deltas(tokenizer, text)
    for tag in ("<think>", "</think>"):
        assert not any(tag in piece for piece in pieces)  # each tag comes in several pieces
    assert streamed(ReasoningParser(in_reasoning), pieces) == (reasoning, content)


def test_the_tool_parser_reads_the_text_after_the_reasoning(tokenizer):
    """A `<tool_call>` inside the reasoning is thought, not a call; the one after `</think>` is parsed."""
    text = (
        '<think>\nI could write <tool_call>{"name": "f", "arguments": {}}</tool_call> here.\n</think>\n\n'
        'Calling.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    parsers = OutputParsers(ToolPlan(parser=HermesToolParser), "qwen3", "<|im_start|>assistant\n")
    pieces = token_deltas(tokenizer, text)
    reasoning, parser = parsers.new()
    thought, content, calls = "", "", {}
    for i, piece in enumerate(pieces):
        new_thought, parsed = _parsed_delta(reasoning, parser, piece, final=i == len(pieces) - 1)
        thought, content = thought + new_thought, content + parsed.content
        for call in parsed.calls:
            name, arguments = calls.get(call.index, (call.name, ""))
            calls[call.index] = (name, arguments + call.arguments)
    assert thought == 'I could write <tool_call>{"name": "f", "arguments": {}}</tool_call> here.\n'
    assert content == "Calling."
    assert calls == {0: ("get_weather", '{"city": "Paris"}')}
    assert parser.called


def test_where_each_parser_starts():
    """qwen3 starts in reasoning only where the prompt opened a block; deepseek_r1 always does."""
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")
    assert new_reasoning_parser("qwen3", "assistant\n").parse("plain") == (None, "plain")
    assert new_reasoning_parser("deepseek_r1", "assistant\n").parse("plain") == ("plain", "")
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        build_app("smollm2-135m", reasoning_parser="qwen")


# A Qwen3-Thinking-style template: the generation prompt opens `<think>` unless enable_thinking is false,
# where it writes an empty block (as Qwen3's own template does).
THINKING_TEMPLATE = """\
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""

QUESTION = [{"role": "user", "content": "What is 2+2?"}]
# sampled, seeded (the tiny model's greedy text is whitespace, which the parser drops)
SAMPLING = dict(model="tiny", max_tokens=12, temperature=1.0, seed=3)


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory):
    folder = write_tiny_chat_model(tmp_path_factory.mktemp("tiny-thinking"))
    (folder / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    return folder


@pytest.fixture(scope="module")
def server(thinking_model):
    app = build_app(
        str(thinking_model), served_model_name="tiny", max_model_len=256, reasoning_parser="qwen3"
    )
    with running_server(app) as base:
        yield base, app.state.engine.engine


def raw_completion(client, oracle, **template_kwargs) -> str:
    """The model's text for the prompt transformers renders, through /v1/completions (no parser)."""
    prompt = oracle.apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=False, **template_kwargs
    )
    ids = oracle.encode(prompt, add_special_tokens=False)
    return client.completions.create(prompt=ids, **SAMPLING).choices[0].text


def test_the_chat_route_splits_the_reasoning_and_takes_chat_template_kwargs(server, thinking_model):
    from transformers import AutoTokenizer

    oracle = AutoTokenizer.from_pretrained(thinking_model)
    with openai_client(*server) as client:
        request = dict(messages=QUESTION, **SAMPLING)
        thinking = client.chat.completions.create(**request)
        message = thinking.choices[0].message
        # the prompt opened the block and the tiny model never closes it: all of it is reasoning
        assert message.reasoning_content.strip()
        assert message.reasoning_content == raw_completion(client, oracle).lstrip()
        assert message.content == ""
        streamed = {"reasoning_content": "", "content": ""}
        for chunk in client.chat.completions.create(stream=True, **request):
            delta = chunk.choices[0].delta
            for field in streamed:
                streamed[field] += getattr(delta, field, None) or ""
        assert streamed == {"reasoning_content": message.reasoning_content, "content": ""}

        off = dict(chat_template_kwargs={"enable_thinking": False})
        plain = client.chat.completions.create(extra_body=off, **request).choices[0].message
        assert plain.content == raw_completion(client, oracle, enable_thinking=False).lstrip()
        assert getattr(plain, "reasoning_content", None) is None
        assert (
            thinking.usage.prompt_tokens
            < client.chat.completions.create(extra_body=off, **request).usage.prompt_tokens
        )

        with pytest.raises(Exception, match="chat_template_kwargs") as refused:
            client.chat.completions.create(extra_body={"chat_template_kwargs": {"tools": []}}, **request)
        assert refused.value.status_code == 400
