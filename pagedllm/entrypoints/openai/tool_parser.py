"""Tool calls out of the model's text, as it streams: content deltas and OpenAI's tool-call deltas.

Two framings of the same call object, `{"name": "f", "arguments": {...}}`:
- `HermesToolParser`: the Hermes format that Qwen2.5's chat template asks for (tool_choice "auto"), each
  call between `<tool_call>` and `</tool_call>`, text around them is content;
- `JsonArrayToolParser`: a JSON array of call objects, what the grammar of tool_choice "required" or a
  named function makes the model write.

A call's arguments are streamed as the model writes them: the deltas are slices of the model's text, so
they add up to the arguments of the whole response exactly, and a response that is not streamed is
parsed by the same code in one feed. The call's name must come before its arguments for that (the order
the template shows the model and the grammar imposes); a call object in any other shape is held until
its end, then taken if it is valid JSON, else given back as content. Unlike vLLM's Hermes parser, which
re-serializes partial JSON (partial-json-parser) and streams the differences, nothing is parsed twice.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

# A call object's start, up to its arguments' first character; the name as a JSON string.
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)')


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class CallDelta:
    """New text of one call: its first delta carries the id and the name."""

    index: int  # the call's place among the response's calls
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class ParsedDelta:
    """What one piece of model text added: content, and deltas of calls (at most one per call)."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def add(self, other: ParsedDelta) -> None:
        self.content += other.content
        for delta in other.calls:
            last = self.calls[-1] if self.calls else None
            if last is not None and last.index == delta.index and delta.id is None:
                last.arguments += delta.arguments
            else:
                self.calls.append(delta)


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str


class _Nesting:
    """JSON's nesting depth outside strings, a character at a time: enough to find where a value ends."""

    def __init__(self):
        self.depth = 0
        self.in_string = self.escaped = False

    def closes(self, char: str) -> bool:
        """Whether `char` closes the outermost value."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
        elif char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
            return self.depth <= 0
        return False


class _CallObject:
    """One call object's text as it arrives: its name, where its arguments start and end, and whether
    its closing brace came."""

    def __init__(self, index: int):
        self.index = index
        self.text = ""
        self.object = _Nesting()
        self.closed = False
        self.id: str | None = None  # set once the name is known and the arguments began: streamed
        self.name: str | None = None
        self.args_start = self.args_end = 0
        self.args = _Nesting()
        self.args_done = False
        self.args_sent = 0  # of the arguments' characters
        self.announced = False  # its first delta (id and name) was given out

    def feed(self, text: str) -> tuple[ParsedDelta, str]:
        """The call's new deltas, and the text after its closing brace (which is not the call's)."""
        rest = ""
        for i, char in enumerate(text):
            if self.object.closes(char):
                self.closed, text, rest = True, text[: i + 1], text[i + 1 :]
                break
        self.text += text
        if self.id is None:
            self._read_header()
        return self._new_arguments(), rest

    def _read_header(self) -> None:
        match = _HEADER.match(self.text)
        if match is None or self.text[match.end()] != "{":
            return  # not (yet) a streamable call: decided at its end
        self.name, self.id = json.loads(match.group(1)), tool_call_id()
        self.args_start = self.args_end = match.end()

    def _new_arguments(self) -> ParsedDelta:
        if self.id is None:
            return ParsedDelta()
        while not self.args_done and self.args_end < len(self.text):
            self.args_done = self.args.closes(self.text[self.args_end])
            self.args_end += 1
        new = self.text[self.args_start + self.args_sent : self.args_end]
        self.args_sent = self.args_end - self.args_start
        if self.announced and not new:
            return ParsedDelta()
        delta = CallDelta(self.index, new)
        if not self.announced:
            delta.id, delta.name, self.announced = self.id, self.name, True
        return ParsedDelta(calls=[delta])

    def finish(self, raw: str) -> ParsedDelta:
        """The call's end: a streamed call is done; another is taken whole if it is a valid call object,
        else `raw` (its text as the model wrote it) is content."""
        if self.id is not None:
            return ParsedDelta()
        try:
            value = json.loads(self.text)
        except ValueError:
            value = None
        if not (isinstance(value, dict) and isinstance(value.get("name"), str) and "arguments" in value):
            return ParsedDelta(content=raw)
        arguments = value["arguments"]
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return ParsedDelta(calls=[CallDelta(self.index, text, tool_call_id(), value["name"])])


class ToolParser:
    """Feed the model's text delta by delta (`feed`), then `close` once; `parse` does both at once."""

    def __init__(self):
        self.num_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        raise NotImplementedError

    def close(self) -> ParsedDelta:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        """A whole response: its content and its calls."""
        delta = self.feed(text)
        delta.add(self.close())
        calls = [ParsedCall(d.id, d.name, d.arguments) for d in delta.calls]
        return delta.content, calls

    @property
    def called(self) -> bool:
        return self.num_calls > 0

    def _finish(self, call: _CallObject, raw: str, out: ParsedDelta) -> bool:
        """End `call`, adding what it gives to `out`; False where it was no call (its text is content)."""
        finished = call.finish(raw)
        if finished.content:
            self.num_calls -= 1
        out.add(finished)
        return not finished.content


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could be the start of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks in the text; the rest is content.
    The whitespace before a call, and at the end after one, is dropped (the template puts a newline
    before each call)."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, max_calls: int | None = None):
        super().__init__()
        self.max_calls = max_calls  # parallel_tool_calls=false: 1, the blocks after it are dropped
        self.pending = ""  # text not yet given out: a possible tag start, or whitespace before a call
        self.call: _CallObject | None = None
        self.in_call = False  # inside a block (its call is None when max_calls dropped it)
        self.block = ""  # the block's text so far, given back as content if it is no call
        self.gap = ""  # the whitespace before the block
        self.after_call = False  # a call came last: whitespace at the end is dropped

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        text = self.pending + text
        self.pending = ""
        while text:
            text = self._feed_call(text, out) if self.in_call else self._feed_content(text, out)
        return out

    def _feed_content(self, text: str, out: ParsedDelta) -> str:
        start = text.find(self.START)
        if start >= 0:
            before = text[:start]
            self._give(out, before.rstrip())
            self.gap = before[len(before.rstrip()) :]  # given back if the block is no call
            self.in_call, self.block, self.call = True, "", None
            if self.max_calls is None or self.num_calls < self.max_calls:
                self.call, self.num_calls = _CallObject(self.num_calls), self.num_calls + 1
            return text[start + len(self.START) :]
        held = _held_prefix(text, self.START)
        given = text[: len(text) - held].rstrip()  # trailing whitespace waits: dropped if a call follows
        self._give(out, given)
        self.pending = text[len(given) :]
        return ""

    def _give(self, out: ParsedDelta, content: str) -> None:
        if content:
            out.content += content
            self.after_call = False

    def _feed_call(self, text: str, out: ParsedDelta) -> str:
        end = text.find(self.END)
        if end < 0:
            held = _held_prefix(text, self.END)
            body, self.pending = text[: len(text) - held], text[len(text) - held :]
            self._feed_block(body, out)
            return ""
        self._feed_block(text[:end], out)
        self._end_block(out, self.START + self.block + self.END)
        return text[end + len(self.END) :]

    def _feed_block(self, text: str, out: ParsedDelta) -> None:
        self.block += text
        if self.call is not None and not self.call.closed:
            out.add(self.call.feed(text)[0])  # text after the object's closing brace is dropped

    def _end_block(self, out: ParsedDelta, raw: str) -> None:
        called = self.call is None or self._finish(self.call, self.gap + raw, out)  # None: dropped
        self.in_call, self.call, self.after_call = False, None, called

    def close(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.in_call:  # cut off inside a call (max_tokens)
            self._feed_block(self.pending, out)
            self._end_block(out, self.START + self.block)
        elif self.pending.strip() or not self.after_call:  # whitespace after the last call is dropped
            out.content += self.pending
        self.pending = ""
        return out


class JsonArrayToolParser(ToolParser):
    """`[{"name": ..., "arguments": ...}, ...]`, as guided decoding makes the model write it: the text
    between the call objects is the array's punctuation, never content. How many calls it may hold is
    the grammar's to enforce (maxItems)."""

    def __init__(self):
        super().__init__()
        self.call: _CallObject | None = None

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        while text:
            if self.call is None:
                start = text.find("{")
                if start < 0:
                    break
                self.call, self.num_calls, text = (
                    _CallObject(self.num_calls),
                    self.num_calls + 1,
                    text[start:],
                )
            delta, text = self.call.feed(text)
            out.add(delta)
            if self.call.closed:
                self.close_call(out)
        return out

    def close_call(self, out: ParsedDelta) -> None:
        self._finish(self.call, self.call.text, out)
        self.call = None

    def close(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.call is not None:  # cut off inside a call (max_tokens)
            self.close_call(out)
        return out
