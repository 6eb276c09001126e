"""The tool-call parsers on crafted model output: Hermes `<tool_call>` blocks (tool_choice auto) and the
JSON array of guided decoding (required / named). No model: the oracle is the call objects the text
was built from (json.dumps of known names and arguments), and the whole text parsed at once is the
oracle of the same text fed in pieces."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.entrypoints.openai.tool_parser import (
    HermesToolParser,
    JsonArrayToolParser,
    ParsedDelta,
    ToolParser,
)

WEATHER = {"city": "Paris", "unit": "celsius"}


def hermes_block(name: str, arguments, **dumps) -> str:
    """A call as Qwen2.5's chat template writes one."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments, **dumps)}}}\n</tool_call>'


def calls_of(parsed: tuple[str, list]) -> tuple[str, list[tuple[str, object]]]:
    """(content, [(name, arguments as JSON)]) of a parse, ids left out."""
    content, calls = parsed
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def fed_in_pieces(parser: ToolParser, text: str, cuts: list[int]) -> ParsedDelta:
    """The text fed in pieces cut at `cuts`; every delta gathered."""
    total, start = ParsedDelta(), 0
    for cut in [*sorted(cuts), len(text)]:
        total.add(parser.feed(text[start:cut]))
        start = max(start, cut)
    total.add(parser.close())
    return total


def test_one_call():
    content, calls = HermesToolParser().parse(hermes_block("get_weather", WEATHER))
    assert content == "" and len(calls) == 1
    (call,) = calls
    assert call.name == "get_weather" and json.loads(call.arguments) == WEATHER
    assert call.arguments == json.dumps(WEATHER)  # as the model wrote it, not re-serialized
    assert call.id.startswith("call_") and len(call.id) > len("call_") + 16


def test_two_calls_get_their_own_ids_and_indices():
    text = hermes_block("a", {"x": 1}) + "\n" + hermes_block("b", {"y": [1, {"z": None}]})
    content, calls = calls_of(HermesToolParser().parse(text))
    assert (content, calls) == ("", [("a", {"x": 1}), ("b", {"y": [1, {"z": None}]})])
    deltas = fed_in_pieces(HermesToolParser(), text, list(range(len(text))))
    assert [d.index for d in deltas.calls if d.id is not None] == [0, 1]
    assert len({d.id for d in deltas.calls if d.id is not None}) == 2


def test_text_before_a_call_is_content():
    text = "Let me look that up.\n" + hermes_block("get_weather", WEATHER) + "\n"
    assert calls_of(HermesToolParser().parse(text)) == ("Let me look that up.", [("get_weather", WEATHER)])


def test_text_without_calls_is_content_as_written():
    for text in (
        "Paris is sunny today.  ",
        "",
        "a <tool",
        "x </tool_call> y",
        "<tool_calls> are tags",
        " \n",
    ):
        assert HermesToolParser().parse(text) == (text, [])


@pytest.mark.parametrize(
    "block",
    [
        '<tool_call>\n{"name": get_weather, "arguments": {}}\n</tool_call>',  # name not a string
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",}}\n</tool_call>',  # bad JSON
        "<tool_call>\nget_weather(city='Paris')\n</tool_call>",
        '<tool_call>\n{"name": "get_weather"}\n</tool_call>',  # no arguments
    ],
)
def test_a_block_that_is_no_call_object_is_content(block):
    """A call object whose name does not come first as a string is judged whole at its end; one that is
    not valid JSON, or has no name and arguments, is given back as the model wrote it (as vLLM's)."""
    text = "Checking. " + block + " Done."
    if '"arguments": {"city"' in block:  # name first: streamed as a call, its arguments as written
        content, calls = HermesToolParser().parse(text)
        assert content == "Checking. Done." and calls[0].arguments == '{"city": "Paris",}'
        return
    assert HermesToolParser().parse(text) == (text, [])


def test_a_call_with_arguments_first_is_taken_at_its_end():
    text = '<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}\n</tool_call>'
    assert calls_of(HermesToolParser().parse(text)) == ("", [("get_weather", {"city": "Paris"})])


def test_strings_holding_braces_do_not_end_the_arguments():
    arguments = {"code": 'if x: print("}{]")\n', "quote": '\\"', "nested": [{"a": "]"}]}
    assert calls_of(HermesToolParser().parse(hermes_block("run", arguments))) == ("", [("run", arguments)])


def test_the_first_end_tag_ends_the_block_even_inside_a_string():
    """As vLLM's parser (and the template's format) has it: the text after the first `</tool_call>` is
    outside the block, and the call keeps the arguments written before it."""
    text = hermes_block("run", {"tag": "</tool_call>!", "x": 1})
    content, calls = HermesToolParser().parse(text)
    assert calls[0].name == "run" and calls[0].arguments == '{"tag": "'
    assert content == '!", "x": 1}}\n</tool_call>'


def test_a_call_cut_off_by_max_tokens_keeps_its_arguments_so_far():
    text = hermes_block("get_weather", WEATHER)[:-25]
    content, calls = HermesToolParser().parse(text)
    assert content == "" and calls[0].name == "get_weather"
    assert json.dumps(WEATHER).startswith(calls[0].arguments) and calls[0].arguments


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = hermes_block("a", {"x": 1}) + "\n" + hermes_block("b", {"y": 2}) + "\nbye"
    assert calls_of(HermesToolParser(max_calls=1).parse(text)) == ("\nbye", [("a", {"x": 1})])


def test_unicode_and_escapes_in_arguments():
    arguments = {"city": "Zürich", "note": "line\nbreak \u2603 \\ end"}
    for ensure_ascii in (True, False):
        text = hermes_block("f", arguments, ensure_ascii=ensure_ascii)
        assert calls_of(HermesToolParser().parse(text)) == ("", [("f", arguments)])


def test_the_json_array_of_guided_decoding():
    calls = [{"name": "get_weather", "arguments": WEATHER}, {"name": "get_time", "arguments": {}}]
    text = json.dumps(calls, indent=2)
    assert calls_of(JsonArrayToolParser().parse(text)) == ("", [(c["name"], c["arguments"]) for c in calls])
    cut = JsonArrayToolParser().parse(text[: text.index("Paris")])  # max_tokens inside the first call
    assert cut[0] == "" and [(c.name, c.arguments) for c in cut[1]] == [("get_weather", '{\n      "city": "')]
    early = text[: text.index("arguments")]  # ... before its arguments: no call, the text as written
    assert JsonArrayToolParser().parse(early) == (early[early.index("{") :], [])


def test_the_first_delta_of_a_call_has_its_id_and_name_the_next_ones_arguments_only():
    text = "Sure." + hermes_block("get_weather", WEATHER)
    parser, deltas = HermesToolParser(), []
    for char in text:
        delta = parser.feed(char)
        deltas.extend(delta.calls)
        assert not (delta.content and delta.calls)
    deltas.extend(parser.close().calls)
    assert deltas[0].id is not None and deltas[0].name == "get_weather"
    assert all(d.id is None and d.name is None and d.arguments for d in deltas[1:])
    assert "".join(d.arguments for d in deltas) == json.dumps(WEATHER)
    assert len(deltas) > 5  # streamed as it came, not held to the end


# Strings without the tags: the first `</tool_call>` ends a block wherever it is (tested above).
untagged = st.text(max_size=8).filter(lambda s: "<tool_call>" not in s and "</tool_call>" not in s)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | untagged,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(untagged, inner, max_size=3),
    max_leaves=8,
)
names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True)
prose = st.text(max_size=20).filter(lambda s: "<tool_call>" not in s and "</tool_call>" not in s)


@settings(max_examples=150, deadline=None)
@given(
    before=prose,
    calls=st.lists(st.tuples(names, st.dictionaries(untagged, json_values, max_size=4)), max_size=3),
    indent=st.sampled_from([None, 2]),
    cuts=st.lists(st.integers(0, 400), max_size=30),
)
def test_any_calls_in_any_pieces_parse_to_what_was_written(before, calls, indent, cuts):
    """Hermes text built from known calls parses back to them, and fed in any pieces the deltas add up
    to exactly the whole text's parse: the streamed response reassembles to the one not streamed."""
    blocks = "\n".join(hermes_block(name, arguments, indent=indent) for name, arguments in calls)
    text = before + ("\n" + blocks if calls else "")
    content, parsed = HermesToolParser().parse(text)
    assert content == (before.rstrip() if calls else before)
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == calls
    pieces = fed_in_pieces(HermesToolParser(), text, cuts)
    assert pieces.content == content
    streamed: dict[int, list[str]] = {}
    for delta in pieces.calls:
        assert (delta.id is not None) == (delta.index not in streamed)  # the id comes first, once
        streamed.setdefault(delta.index, []).append(delta.arguments)
    assert ["".join(parts) for _, parts in sorted(streamed.items())] == [c.arguments for c in parsed]

    array = json.dumps([{"name": n, "arguments": a} for n, a in calls], indent=indent)
    assert [(c.name, json.loads(c.arguments)) for c in JsonArrayToolParser().parse(array)[1]] == calls
    pieces = fed_in_pieces(JsonArrayToolParser(), array, cuts)
    assert [(c.name, json.loads(c.arguments)) for c in JsonArrayToolParser().parse(array)[1]] == [
        (name, json.loads(args)) for name, args in _joined(pieces)
    ]


def _joined(delta: ParsedDelta) -> list[tuple[str, str]]:
    """Each call's name and whole arguments out of its deltas."""
    calls: dict[int, list] = {}
    for d in delta.calls:
        calls.setdefault(d.index, [d.name, ""])[1] += d.arguments
    return [tuple(calls[i]) for i in sorted(calls)]
