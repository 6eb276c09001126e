"""Request and response bodies of Anthropic's Messages API (the subset pagedllm serves), as pydantic
models. As the OpenAI ones (protocol.py), a field pagedllm does not implement is refused, not ignored;
`cache_control` and `service_tier` are accepted and ignored (Anthropic documents them as hints)."""

from __future__ import annotations

import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, Field, field_validator

from pagedllm.entrypoints.openai.protocol import Int, RequestModel

# Anthropic's error types by HTTP status (what its SDK raises for each).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(message: str, status: int) -> dict:
    """Anthropic's error shape: `{"type": "error", "error": {"type": ..., "message": ...}}`."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def random_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class Block(RequestModel):
    cache_control: dict | None = None  # a prompt-caching hint: pagedllm caches prefixes by itself


class TextBlock(Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


class ToolResultBlock(Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content):
        return _checked_blocks(content, ("text",))


class ThinkingBlock(Block):
    """An earlier turn's thinking, sent back by the client: accepted, and not shown to the model again
    (as reasoning models' templates drop the reasoning of earlier turns)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")
]
BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking")


def _checked_blocks(content, allowed: tuple[str, ...]):
    """A block of another type (image, document, ...) is refused by its type, not by a wall of errors."""
    for block in content if isinstance(content, list) else ():
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in allowed:
            raise ValueError(f"content blocks of type {kind!r} are not supported, only {list(allowed)}")
    return content


class Message(RequestModel):
    # "system": Claude Code sends its reminders as turns of their own; the template gets system messages
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, content):
        return _checked_blocks(content, BLOCK_TYPES)


class Tool(RequestModel):
    """A client tool; Anthropic's server tools (web search, code execution, ...) are refused."""

    type: Literal["custom"] | None = None
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict
    cache_control: dict | None = None
    strict: bool | None = None


class ToolChoice(RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool": the tool to call
    disable_parallel_tool_use: bool | None = None


class Thinking(RequestModel):
    """Turns the chat template's `enable_thinking` on (every type but "disabled") or off; the budget and
    the display are accepted, not enforced (max_tokens bounds the whole output)."""

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Int | None = None
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(RequestModel):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(RequestModel):
    format: OutputFormat | None = None  # guided decoding, as response_format json_schema
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # accepted, no effect


class Metadata(RequestModel):
    user_id: str | None = None


class CountTokensRequest(RequestModel):
    """POST /v1/messages/count_tokens: what the prompt of these messages would hold."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: dict | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: Annotated[Int, Field(ge=1)]
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[Int, Field(ge=-1)] | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here: accepted, ignored
    # the beta context editing (Claude Code sends it): accepted, ignored; the prompt is run as sent
    context_management: dict | None = None


class TextOut(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseOut(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict


class ThinkingOut(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # Anthropic signs its thinking for later turns; pagedllm does not check it


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessagesResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextOut | ToolUseOut | ThinkingOut]
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: Usage


class CountTokensResponse(BaseModel):
    input_tokens: int
