"""A reasoning model's thinking split off its answer, as vLLM's `--reasoning-parser` does: the text between
`<think>` and `</think>` is the reasoning (`reasoning_content` on a chat message), the text after is the
content, which the tool parser then reads.

- `qwen3`: the output is content unless it opens with `<think>`, or the prompt already opened one (a
  template whose generation prompt ends in `<think>`, such as Qwen3-Thinking-2507's). With
  `chat_template_kwargs: {"enable_thinking": false}` Qwen3's template closes the block in the prompt, so
  the whole output is content.
- `deepseek_r1`: the output is reasoning until `</think>` (DeepSeek-R1 may leave out the opening tag).

The text is split as it streams: a tag cut across deltas is held back until it is whole or ruled out, so
the deltas add up to the whole response's split exactly (the same code splits both). Unlike vLLM, the
whitespace right after each tag is dropped (templates put a newline there) and a reasoning block cut off
by max_tokens stays reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.entrypoints.openai.tool_parser import _held_prefix  # the same hold-back as <tool_call>'s

START, END = "<think>", "</think>"


@dataclass
class ReasoningDelta:
    """What one piece of model text added to the reasoning and to the content."""

    reasoning: str = ""
    content: str = ""

    def add(self, other: ReasoningDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content


class ReasoningParser:
    """Feed the model's text delta by delta (`feed`), then `close` once; `parse` does both at once.
    States: "open" (the output's start: `<think>` may come), "reasoning", "content"."""

    def __init__(self, in_reasoning: bool):
        self.state = "open"
        self.in_reasoning = in_reasoning  # where the text goes while "open" and no tag came
        self.pending = ""  # text held back: a possible tag's start, or leading whitespace
        self.strip = True  # whitespace is dropped here (the output's start, right after a tag)

    def feed(self, text: str) -> ReasoningDelta:
        out = ReasoningDelta()
        text = self.pending + text
        self.pending = ""
        if self.strip:
            stripped = text.lstrip()
            if not stripped:
                return out  # only whitespace so far: whatever comes next decides
            text, self.strip = stripped, False
        if self.state == "open":
            if START.startswith(text) and len(text) < len(START):
                self.pending = text  # maybe `<think>`, cut across deltas
                return out
            if text.startswith(START):
                self.state, self.strip = "reasoning", True
                out.add(self.feed(text[len(START) :]))
                return out
            self.state = "reasoning" if self.in_reasoning else "content"
        if self.state == "content":
            out.content += text
            return out
        end = text.find(END)
        if end >= 0:
            out.reasoning += text[:end]
            self.state, self.strip = "content", True
            out.add(self.feed(text[end + len(END) :]))
            return out
        held = _held_prefix(text, END)
        out.reasoning += text[: len(text) - held]
        self.pending = text[len(text) - held :]
        return out

    def close(self) -> ReasoningDelta:
        """The text still held back: a tag's start that never completed is text of the part it was in."""
        text, self.pending = self.pending, ""
        in_reasoning = self.state == "reasoning" or (self.state == "open" and self.in_reasoning)
        return ReasoningDelta(reasoning=text) if in_reasoning else ReasoningDelta(content=text)

    def parse(self, text: str) -> tuple[str | None, str]:
        """A whole response: its reasoning (None where it had none) and its content."""
        out = self.feed(text)
        out.add(self.close())
        return out.reasoning or None, out.content


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether the rendered prompt ends inside a `<think>` block (its generation prompt opened one)."""
    return prompt.rfind(START) > prompt.rfind(END)


PARSERS = ("qwen3", "deepseek_r1")


def check_parser_name(name: str | None) -> str | None:
    if name is not None and name not in PARSERS:
        raise ValueError(f"reasoning_parser must be one of {list(PARSERS)}, got {name!r}")
    return name


def new_reasoning_parser(name: str, prompt: str) -> ReasoningParser:
    """A parser for one choice of a request whose rendered prompt is `prompt`."""
    return ReasoningParser(in_reasoning=name == "deepseek_r1" or prompt_opens_reasoning(prompt))
