"""POST /v1/messages and POST /v1/messages/count_tokens: Anthropic's Messages API, as vLLM serves it.

A Messages request is translated into a chat completions request and run through the chat handler (one
template render, one tool parser, one guided-decoding path, one way into the engine), whose response,
whole or streamed, is translated back: content blocks (thinking, text, tool_use), stop_reason and usage;
a stream becomes Anthropic's events (message_start, ping, content_block_start / _delta / _stop,
message_delta, message_stop). Any refusal is answered in Anthropic's error shape.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from pagedllm.entrypoints.openai import anthropic_protocol as a
from pagedllm.entrypoints.openai import protocol as p
from pagedllm.entrypoints.openai.errors import APIError, validation_message

TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # "tool": a named function
THE_PARAMS = {"response_format": "output_config.format", "stop": "stop_sequences"}  # chat's names -> ours


def chat_conversation(request: a.CountTokensRequest) -> dict:
    """The chat request's messages, tools, tool_choice and template variables for this conversation."""
    messages = [] if request.system is None else [{"role": "system", "content": _text(request.system)}]
    for message in request.messages:
        messages.extend(_chat_messages(message))
    chat = {"messages": messages}
    if request.tools:
        chat["tools"] = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.input_schema}
                | ({} if t.strict is None else {"strict": t.strict}),
            }
            for t in request.tools
        ]
    choice = request.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise APIError("tool_choice of type tool needs the tool's name", param="tool_choice.name")
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            chat["tool_choice"] = TOOL_CHOICES[choice.type]
        if choice.disable_parallel_tool_use:
            chat["parallel_tool_calls"] = False
    if request.thinking is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": request.thinking.type != "disabled"}
    return chat


def _text(content: str | list[a.TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(block.text for block in content)


def _chat_messages(message: a.Message) -> list[dict]:
    """One Anthropic turn as chat messages: a user turn's tool results become tool messages (in their
    order), an assistant turn's tool_use blocks its tool_calls; thinking blocks are dropped."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    out, text = [], []
    calls = []
    for block in message.content:
        if isinstance(block, a.TextBlock):
            text.append(block.text)
        elif isinstance(block, a.ToolUseBlock):
            function = {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}
            calls.append({"id": block.id, "type": "function", "function": function})
        elif isinstance(block, a.ToolResultBlock):
            if text:  # text before a result keeps its place
                out.append({"role": message.role, "content": "".join(text)})
                text = []
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _text(block.content)})
    if text or calls or not out:
        turn = {"role": message.role, "content": "".join(text) or None}
        out.append(turn | ({"tool_calls": calls} if calls else {}))
    return out


def chat_request(request: a.MessagesRequest) -> p.ChatCompletionRequest:
    """The Messages request as the chat handler's request."""
    chat = chat_conversation(request) | {
        "model": request.model,
        "max_tokens": request.max_tokens,
        "stop": request.stop_sequences,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "stream": request.stream,
        "stream_options": {"include_usage": True} if request.stream else None,
        "user": None if request.metadata is None else request.metadata.user_id,
    }
    output = request.output_config
    if output is not None and output.format is not None:
        schema = {"name": "output", "schema": output.format.schema_}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    return _as_chat(chat)


def _as_chat(chat: dict) -> p.ChatCompletionRequest:
    try:
        return p.ChatCompletionRequest.model_validate(chat)
    except ValidationError as error:  # a rule of the chat request's that the Messages one lacks
        raise _invalid(error) from error


def stop_reason(finish_reason: str | None, matched: int | str | None) -> tuple[a.StopReason, str | None]:
    """Anthropic's stop_reason and stop_sequence for a chat choice's finish_reason and stop_reason (the
    stop string it met, where one ended it)."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def message_response(chat: p.ChatCompletionResponse) -> a.MessagesResponse:
    choice = chat.choices[0]
    message = choice.message
    content: list = []
    if message.reasoning_content:
        content.append(a.ThinkingOut(thinking=message.reasoning_content))
    if message.content:
        content.append(a.TextOut(text=message.content))
    for call in message.tool_calls:
        arguments = _arguments(call.function.arguments)
        if arguments is None:  # cut off by max_tokens: given back as text, not lost
            content.append(a.TextOut(text=call.function.arguments))
        else:
            content.append(a.ToolUseOut(id=call.id, name=call.function.name, input=arguments))
    reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason)
    return a.MessagesResponse(
        id=a.random_id("msg"),
        model=chat.model,
        content=content,
        stop_reason=reason,
        stop_sequence=sequence,
        usage=a.Usage(input_tokens=chat.usage.prompt_tokens, output_tokens=chat.usage.completion_tokens),
    )


def _arguments(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


class MessageEvents:
    """Anthropic's stream events for one message, built from the chat stream's chunks: a content block
    opens at the first delta of its kind (or each new tool call) and closes at the next block's start."""

    def __init__(self, model: str):
        self.model = model
        self.index = -1  # the open block's index
        self.kind: str | None = None  # the open block's type
        self.stop: tuple[a.StopReason, str | None] = ("end_turn", None)

    def start(self) -> list[str]:
        message = a.MessagesResponse(
            id=a.random_id("msg"),
            model=self.model,
            content=[],
            stop_reason=None,
            usage=a.Usage(input_tokens=0, output_tokens=0),  # known at the end: message_delta has it
        )
        return [event("message_start", message=message.model_dump()), event("ping")]

    def chunk(self, chunk: dict) -> list[str]:
        """The events of one chat chunk (a dict, as the chat stream's JSON)."""
        if not chunk["choices"]:  # the usage chunk, last
            usage = {"input_tokens": chunk["usage"]["prompt_tokens"]}
            usage["output_tokens"] = chunk["usage"]["completion_tokens"]
            reason, sequence = self.stop
            return [
                *self._close(),
                event(
                    "message_delta",
                    delta={"stop_reason": reason, "stop_sequence": sequence},
                    usage=usage,
                ),
                event("message_stop"),
            ]
        choice = chunk["choices"][0]
        delta, out = choice["delta"], []
        if delta.get("reasoning_content"):
            out += self._open("thinking", {"thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            out += self._open("text", {"text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or []:
            if call.get("id"):  # a new call
                fields = {"id": call["id"], "name": call["function"]["name"], "input": {}}
                out += self._open("tool_use", fields)
            arguments = call["function"].get("arguments")
            if arguments:
                out.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        if choice.get("finish_reason"):
            self.stop = stop_reason(choice["finish_reason"], choice.get("stop_reason"))
        return out

    def _open(self, kind: str, fields: dict) -> list[str]:
        if self.kind == kind and kind != "tool_use":
            return []
        out = self._close()
        self.index, self.kind = self.index + 1, kind
        return [*out, event("content_block_start", index=self.index, content_block={"type": kind} | fields)]

    def _delta(self, delta: dict) -> str:
        return event("content_block_delta", index=self.index, delta=delta)

    def _close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [event("content_block_stop", index=self.index)]


def event(kind: str, **data) -> str:
    """One server-sent event as Anthropic sends them: its type twice, as the event's name and in its data."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind} | data, ensure_ascii=False)}\n\n"


async def message_events(chat_events: AsyncIterator[str], model: str) -> AsyncIterator[str]:
    """The chat stream's server-sent events as Anthropic's; an error event ends the stream as Anthropic's
    `error` event. Closing these events (a client that went away) closes the chat stream: it aborts."""
    events = MessageEvents(model)
    try:
        for item in events.start():
            yield item
        async for chat_event in chat_events:
            data = chat_event.removeprefix("data: ").strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                error = chunk["error"]
                yield event("error", error=a.error_body(error["message"], error["code"])["error"])
                break
            for item in events.chunk(chunk):
                yield item
    finally:
        await chat_events.aclose()


class AnthropicServingMessages:
    """The Messages routes' handlers over `serving`: anything with the chat_completions and tokenize of
    server.Serving (it, or the replicas' client)."""

    def __init__(self, serving):
        self.serving = serving

    async def create_message(
        self, request: a.MessagesRequest, raw_request: Request | None = None
    ) -> a.MessagesResponse | AsyncIterator[str]:
        result = await self.serving.chat_completions(chat_request(request), raw_request)
        if isinstance(result, p.ChatCompletionResponse):
            return message_response(result)
        return message_events(result, request.model)

    async def count_tokens(self, request: a.CountTokensRequest) -> a.CountTokensResponse:
        """The prompt's tokens as messages.create renders it (tool_choice none shows no tools, as there)."""
        chat = _as_chat(chat_conversation(request) | {"model": request.model})
        tools = None if chat.tool_choice == "none" else chat.tools
        kwargs = chat.chat_template_kwargs
        tokenize = p.TokenizeRequest(
            model=chat.model, messages=chat.messages, tools=tools, chat_template_kwargs=kwargs
        )
        return a.CountTokensResponse(input_tokens=(await self.serving.tokenize(tokenize)).count)


def messages_routes(serving) -> APIRouter:
    """POST /v1/messages and /v1/messages/count_tokens; their bodies are read here, not by FastAPI, so that
    a malformed one is refused in Anthropic's error shape (the OpenAI routes keep theirs)."""
    routes = APIRouter()
    handler = AnthropicServingMessages(serving)

    @routes.post("/v1/messages")
    async def messages(raw_request: Request):
        async def create():
            request = _parsed(a.MessagesRequest, await raw_request.body())
            result = await handler.create_message(request, raw_request)
            if isinstance(result, BaseModel):
                return result
            return StreamingResponse(result, media_type="text/event-stream")

        return await _answered(create())

    @routes.post("/v1/messages/count_tokens")
    async def count_tokens(raw_request: Request):
        async def count():
            return await handler.count_tokens(_parsed(a.CountTokensRequest, await raw_request.body()))

        return await _answered(count())

    return routes


def _parsed(model: type[BaseModel], body: bytes) -> BaseModel:
    try:
        return model.model_validate_json(body)
    except ValidationError as error:
        raise _invalid(error) from error


def _invalid(error: ValidationError) -> APIError:
    message, param = validation_message(error.errors())
    return APIError(message, param=param)


async def _answered(work):
    """The handler's answer; an APIError as Anthropic's error, its field named in the message."""
    try:
        return await work
    except APIError as error:
        message = str(error)
        param = THE_PARAMS.get(error.param, error.param)
        if param and param not in message:
            message = f"{param}: {message}"
        return JSONResponse(a.error_body(message, error.status), status_code=error.status)
