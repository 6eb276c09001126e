"""Request and response bodies of the OpenAI API (the subset pagedllm serves), as pydantic models."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_serializer,
    model_validator,
)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


Int = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]  # what the engine's tensors hold


class RequestModel(BaseModel):
    """A request body: a field pagedllm does not implement is refused (HTTP 400 naming it), not ignored.
    Numbers must be finite (a NaN or infinite temperature is refused, not passed to the sampler)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(RequestModel):
    include_usage: bool = False


class JsonSchemaFormat(RequestModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    """`json_object`: any JSON object; `json_schema`: JSON matching the schema (guided decoding)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SamplingRequest(RequestModel):
    """Fields both endpoints share, with vLLM's extra sampling fields (top_k, min_p, ignore_eos, ...)."""

    model: str | None = None
    n: Annotated[Int, Field(ge=1)] = 1
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[Int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[Int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[Int, Field(ge=0)] = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None  # unset: generation_config's, else 1
    use_beam_search: bool = False  # vLLM's extra: beam search with n beams, one choice per beam
    length_penalty: float = 1.0  # beam search only
    user: str | None = None
    response_format: ResponseFormat | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[Int] | list[str] | list[list[Int]]  # one prompt, or several (choices prompt-major)
    max_tokens: Annotated[Int, Field(ge=0)] | None = 16  # 0: with echo only, the prompt scored alone
    logprobs: Annotated[Int, Field(ge=0)] | None = None
    echo: bool = False
    prompt_logprobs: Annotated[Int, Field(ge=0)] | None = None  # vLLM's extra: each choice's prompt_logprobs


class FunctionDefinition(RequestModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments; unset: no arguments
    strict: bool | None = None  # honoured where the call is guided (tool_choice required or named)


class ChatTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


TOOL_CHOICES = ("none", "auto", "required")
TEMPLATE_VARIABLES = {"messages", "tools", "add_generation_prompt", "tokenize", "chat_template"}


def _own_template_variables(kwargs: dict | None) -> dict | None:
    """The variables the server sets itself cannot be overridden (vLLM drops them; refused here)."""
    taken = sorted(set(kwargs or {}) & TEMPLATE_VARIABLES)
    if taken:
        raise ValueError(f"{taken} are set by the server, not by chat_template_kwargs")
    return kwargs


TemplateKwargs = Annotated[dict | None, AfterValidator(_own_template_variables)]
ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(RequestModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(RequestModel):
    """A call the model made: in a response, and in the assistant messages a client sends back."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class ChatMessage(RequestModel):
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool result: the call it answers
    reasoning_content: str | None = None  # an assistant turn's thinking, for templates that read it (Qwen3)

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content):
        """An image or audio part is refused by its type (not dropped, not a wall of union errors)."""
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"content parts of type {kind!r} are not supported, only 'text'")
        return content


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Annotated[Int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[Int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[Int, Field(ge=0)] | None = None
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None  # unset: "auto" with tools, "none" without (OpenAI's)
    parallel_tool_calls: bool = True
    chat_template_kwargs: TemplateKwargs = None  # vLLM's: more variables for the template (enable_thinking)

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _one_tool_choice(cls, choice):
        """One error naming what tool_choice may be, not one per member of the union."""
        if isinstance(choice, dict):
            return NamedToolChoice.model_validate(choice)
        if choice is not None and not (isinstance(choice, str) and choice in TOOL_CHOICES):
            raise ValueError(
                'must be \'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": ...}}'
            )
        return choice


class TokenizeRequest(RequestModel):
    """vLLM's POST /tokenize body: a `prompt` (TokenizeCompletionRequest) or `messages` through the chat
    template (TokenizeChatRequest), one model here so that a mistake is named by its field."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # unset: true for a prompt, false for messages (vLLM's)
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    chat_template_kwargs: TemplateKwargs = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt or messages")
        if self.prompt is not None and self.tools is not None:
            raise ValueError("tools go with messages, not with a prompt")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[Annotated[Int, Field(ge=0)]]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy shape; with echo the prompt's tokens come first, the very first with nulls."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's Logprob: `rank` (1 = the likeliest) is null for a prompt token outside the top
    prompt_logprobs, whose rank is not computed."""

    logprob: float
    rank: int | None
    decoded_token: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None  # as vLLM's, first entry null


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None: the turn is tool calls only
    reasoning_content: str | None = None  # with --reasoning-parser: the model's thinking (vLLM's field)
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _without_nones(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(BaseModel):
    """A streamed call: its first delta has id, type and name; the next ones add to its arguments, as
    OpenAI streams them (the absent keys are left out, not sent as null)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _without_nones(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str  # the model it was loaded from (a built-in name or a path), as vLLM's
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
