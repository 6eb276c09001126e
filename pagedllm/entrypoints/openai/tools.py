"""A chat request's `tools`, `tool_choice` and `parallel_tool_calls`: what the chat template is given,
how the output is guided, and which parser reads the calls out of it.

- "auto" (the default with tools): the template shows the model the tools and the model decides; its
  Hermes `<tool_call>` blocks are parsed (HermesToolParser), so the template must use that format.
- "required" and a named function: the output is guided by a grammar (xgrammar, as `response_format`
  is) to a JSON array of calls whose arguments match each tool's schema, so every call parses; that is
  vLLM's approach, with the call objects shaped as the Hermes template shows them to the model.
- "none": the model is not shown the tools (vLLM's --exclude-tools-when-tool-choice-none) and answers
  in text.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass

from pagedllm.entrypoints.openai import protocol as p
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.tool_parser import HermesToolParser, JsonArrayToolParser, ToolParser
from pagedllm.sampling_params import GuidedDecodingParams

NO_ARGUMENTS = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    """What a chat request's tools mean for its prompt, its sampling and its output."""

    tools: list[dict] | None = None  # given to the chat template
    guided: GuidedDecodingParams | None = None  # required / named: the grammar of the calls
    parser: Callable[[], ToolParser] | None = None  # None: the output is content only

    def new_parser(self) -> ToolParser | None:
        """A parser for one choice's output (each choice has its own)."""
        return None if self.parser is None else self.parser()


def plan_tools(request: p.ChatCompletionRequest, chat_template: str | None) -> ToolPlan:
    """The request's ToolPlan; a combination the server cannot honour is an APIError naming the field."""
    tools = request.tools or []
    choice = request.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise APIError("tool_choice needs tools: the request has none", param="tool_choice")
        return ToolPlan()
    names = [tool.function.name for tool in tools]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise APIError(f"tools: each function needs its own name; repeated: {duplicates}", param="tools")
    if choice == "none":
        return ToolPlan()
    if not template_reads_tools(chat_template):
        what = "has no chat template" if chat_template is None else "has a chat template without tool support"
        raise APIError(
            f"tools: this model {what} (its template never reads `tools`), so it cannot be shown them",
            param="tools",
        )
    rendered = [tool.model_dump(exclude_none=True) for tool in tools]
    max_calls = None if request.parallel_tool_calls else 1
    if choice in (None, "auto"):
        if HermesToolParser.START not in chat_template:
            raise APIError(
                "tool_choice auto: this model's chat template does not use the Hermes <tool_call> format, "
                "the one pagedllm parses; use tool_choice required or a named function (guided)",
                param="tool_choice",
            )
        return ToolPlan(rendered, None, functools.partial(HermesToolParser, max_calls))
    if request.response_format is not None and request.response_format.type != "text":
        raise APIError(
            "response_format cannot be combined with tool_choice required or a named function: both "
            "guide the output",
            param="response_format",
        )
    if request.use_beam_search:
        raise APIError(
            "tool_choice required or a named function is not supported with use_beam_search",
            param="tool_choice",
        )
    chosen = tools
    if isinstance(choice, p.NamedToolChoice):
        chosen = [tool for tool in tools if tool.function.name == choice.function.name]
        if not chosen:
            raise APIError(
                f"tool_choice names the function {choice.function.name!r}, which is not in tools "
                f"(they are {names})",
                param="tool_choice",
            )
        max_calls = 1
    guided = GuidedDecodingParams(json=calls_schema(chosen, max_calls))
    return ToolPlan(rendered, guided, JsonArrayToolParser)


def calls_schema(tools: list[p.ChatTool], max_calls: int | None) -> dict:
    """A JSON array of 1 to max_calls calls `{"name": ..., "arguments": ...}` of these tools."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool.function.name},
                "arguments": tool.function.parameters or NO_ARGUMENTS,
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    return schema


@functools.lru_cache(maxsize=8)
def template_reads_tools(chat_template: str | None) -> bool:
    """Whether the chat template uses a `tools` variable (a template without it would drop them)."""
    if chat_template is None:
        return False
    from jinja2 import Environment, meta

    ast = Environment(extensions=["jinja2.ext.loopcontrols"]).parse(chat_template)
    return "tools" in meta.find_undeclared_variables(ast)


def template_messages(messages: list[p.ChatMessage]) -> list[dict]:
    """The messages as chat templates read them (as transformers and vLLM give them): text parts joined,
    absent fields left out, and a tool call's arguments as the object its JSON text holds."""
    rendered = []
    for i, message in enumerate(messages):
        item = message.model_dump(exclude_none=True)
        if isinstance(message.content, list):
            item["content"] = "".join(part.text for part in message.content)
        item.setdefault("content", "")  # e.g. an assistant turn that only called tools
        for j, call in enumerate(item.get("tool_calls", [])):
            try:
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
            except ValueError as error:
                raise APIError(
                    f"messages[{i}].tool_calls[{j}].function.arguments is not JSON: {error}",
                    param=f"messages.{i}.tool_calls.{j}.function.arguments",
                ) from error
        rendered.append(item)
    return rendered
