"""Request and response bodies of OpenAI's Responses API (the subset pagedllm serves), as pydantic models.

A request's fields pagedllm does not implement are refused by name (RequestModel); an input item, content
part or tool of a type it does not implement is refused naming the type, before pydantic's own checks.
What Codex CLI sends by default is accepted (found by running it against the server): its session's
`client_metadata`, `include` of encrypted reasoning, and the hosted / namespaced tools left out below.
"""

from __future__ import annotations

import logging
import time
from typing import Annotated, Literal

from pydantic import BaseModel, Field, field_validator

from pagedllm.entrypoints.openai.protocol import Int, RequestModel, random_id

INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
TEXT_PART_TYPES = ("input_text", "output_text")
# Tools the server cannot offer, left out of the prompt (logged), not refused: Codex sends them by default.
UNOFFERED_TOOLS = {
    "web_search": "a hosted tool (the server searches nothing)",
    "web_search_preview": "a hosted tool (the server searches nothing)",
    "namespace": "namespaced tools are called by their namespace, which no chat template renders",
}
# reasoning.encrypted_content: a client that stores nothing asks for its reasoning to carry back; pagedllm's
# reasoning items already carry their text (`content`), which the next request may send back as it is.
INCLUDABLE = ("reasoning.encrypted_content",)

logger = logging.getLogger(__name__)


class TextContent(RequestModel):
    """A text part of an input message (`output_text`: an assistant turn the client sends back)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list | None = None  # what an output_text part carries back; ignored
    logprobs: list | None = None


class MessageInput(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextContent]
    id: str | None = None
    status: str | None = None


class FunctionCallInput(RequestModel):
    """A call the model made (from an earlier response's output), sent back with its result."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text
    id: str | None = None
    status: str | None = None


class FunctionCallOutputInput(RequestModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextContent]
    id: str | None = None
    status: str | None = None


class ReasoningInput(RequestModel):
    """An earlier response's reasoning item sent back: accepted and left out of the prompt (the chat
    templates of reasoning models drop earlier turns' thinking too)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list = Field(default_factory=list)
    content: list | None = None
    encrypted_content: str | None = None
    status: str | None = None


InputItem = Annotated[
    MessageInput | FunctionCallInput | FunctionCallOutputInput | ReasoningInput, Field(discriminator="type")
]


class FunctionTool(RequestModel):
    """A function tool in the Responses shape (flat: no `function` object around the name)."""

    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class FunctionToolChoice(RequestModel):
    type: Literal["function"]
    name: str


TOOL_CHOICES = ("none", "auto", "required")


class TextFormat(RequestModel):
    """`text.format`: plain text, any JSON object, or JSON matching `schema` (guided decoding)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(RequestModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint: accepted, ignored


class ReasoningConfig(RequestModel):
    """Accepted and ignored: whether a model reasons is its chat template's and reasoning parser's."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(RequestModel):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: Annotated[Int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    client_metadata: dict | None = None  # what Codex sends of its session: accepted, not used
    user: str | None = None
    include: list[str] | None = None  # only INCLUDABLE: nothing else pagedllm could add is implemented
    truncation: Literal["disabled"] | None = None  # "auto" (drop old turns) is not implemented
    reasoning: ReasoningConfig | None = None
    prompt_cache_key: str | None = None  # a hint: the prefix cache needs none
    # vLLM's extras, passed to the chat request as they are
    top_k: Annotated[Int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, items):
        """An item or content part of a type pagedllm does not implement is refused by its type."""
        for i, item in enumerate(items if isinstance(items, list) else ()):
            if not isinstance(item, dict):
                continue
            kind = item.setdefault("type", "message") if "role" in item else item.get("type")
            if kind not in INPUT_ITEM_TYPES:
                raise ValueError(
                    f"input[{i}]: items of type {kind!r} are not supported, only {list(INPUT_ITEM_TYPES)}"
                )
            parts = item.get("content") if kind == "message" else item.get("output")
            for j, part in enumerate(parts if isinstance(parts, list) else ()):
                part_kind = part.get("type") if isinstance(part, dict) else None
                if part_kind not in TEXT_PART_TYPES:
                    raise ValueError(
                        f"input[{i}] content[{j}]: parts of type {part_kind!r} are not supported, only "
                        f"{list(TEXT_PART_TYPES)}"
                    )
        return items

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, tools):
        """Function tools; hosted ones and namespaces (UNOFFERED_TOOLS) are left out of the prompt, as the
        server can run no hosted tool; any other type is refused by name."""
        kept = []
        for i, tool in enumerate(tools if isinstance(tools, list) else ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind in UNOFFERED_TOOLS:
                logger.info(
                    "tools[%d] of type %r is not offered to the model: %s", i, kind, UNOFFERED_TOOLS[kind]
                )
                continue
            if kind != "function":
                raise ValueError(
                    f"tools[{i}]: tools of type {kind!r} are not supported, only 'function' (and "
                    f"{sorted(UNOFFERED_TOOLS)}, left out)"
                )
            kept.append(tool)
        return kept if isinstance(tools, list) else tools

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _one_tool_choice(cls, choice):
        """One error naming what tool_choice may be, not one per member of the union."""
        if isinstance(choice, dict) and choice.get("type") == "function":
            return FunctionToolChoice.model_validate(choice)
        if not (isinstance(choice, str) and choice in TOOL_CHOICES):
            raise ValueError("must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}")
        return choice

    @field_validator("include")
    @classmethod
    def _nothing_to_include(cls, include):
        bad = [item for item in include or () if item not in INCLUDABLE]
        if bad:
            raise ValueError(f"{bad} cannot be included: pagedllm implements none of them")
        return include


# -- the response ------------------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list = Field(default_factory=list)
    logprobs: list = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class MessageOutput(BaseModel):
    id: str = Field(default_factory=lambda: random_id("msg"))
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus = "in_progress"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningOutput(BaseModel):
    id: str = Field(default_factory=lambda: random_id("rs"))
    type: Literal["reasoning"] = "reasoning"
    status: ItemStatus = "in_progress"
    summary: list = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)


class FunctionCallOutput(BaseModel):
    id: str = Field(default_factory=lambda: random_id("fc"))
    type: Literal["function_call"] = "function_call"
    status: ItemStatus = "in_progress"
    call_id: str
    name: str
    arguments: str = ""


OutputItem = MessageOutput | ReasoningOutput | FunctionCallOutput


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # not counted: the prefix cache's hits are in /metrics


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # not counted apart from output_tokens


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    id: str = Field(default_factory=lambda: random_id("resp"))
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "in_progress"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    store: bool
    temperature: float | None = None
    top_p: float | None = None
    text: dict
    tool_choice: str | dict
    tools: list[dict]
    truncation: Literal["disabled"] = "disabled"
    user: str | None = None
    background: bool = False
