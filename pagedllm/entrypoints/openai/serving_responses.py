"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API over the chat completions path.

A Responses request is translated into a chat completion request (its input items as chat messages, its
flat function tools as chat tools, `text.format` as `response_format`) and run by the same handler as
POST /v1/chat/completions (one chat template, one tool-call parser, one guided-decoding path); the chat
reply, whole or streamed, is translated back into output items and, streamed, into the Responses API's
typed events. Finished responses are kept in a bounded in-memory store (least recently used out first)
for `previous_response_id` and GET.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from fastapi import Request
from pydantic import BaseModel, TypeAdapter

from pagedllm.entrypoints.openai import protocol as p
from pagedllm.entrypoints.openai import responses_protocol as r
from pagedllm.entrypoints.openai.errors import APIError

RESPONSE_STORE_SIZE = 1000  # responses kept for previous_response_id and GET; the oldest used go first

ChatHandler = Callable[[p.ChatCompletionRequest, Request | None], Awaitable[BaseModel | AsyncIterator[str]]]

# The chat request's fields as the Responses request names them (in errors the chat handler raises).
PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
}
INPUT_ITEMS = TypeAdapter(list[r.InputItem])
VLLM_EXTRAS = ("top_k", "min_p", "repetition_penalty", "seed", "stop", "ignore_eos")


@dataclass
class StoredResponse:
    response: r.ResponseObject
    messages: list[p.ChatMessage]  # the conversation it continues, its input and its output (no instructions)


class ResponseStore:
    """The last `size` stored responses by id; reading one makes it the most recently used."""

    def __init__(self, size: int = RESPONSE_STORE_SIZE):
        self.size = size
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, stored: StoredResponse) -> None:
        self._items[stored.response.id] = stored
        self._items.move_to_end(stored.response.id)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response; an unknown (or evicted, or never stored) id is a 404 naming `param`."""
        stored = self._items.get(response_id)
        if stored is None:
            raise APIError(
                f"no response with id {response_id!r}: it was never stored (store=false), or it is older "
                f"than the {self.size} responses this server keeps",
                status=404,
                param=param,
            )
        self._items.move_to_end(response_id)
        return stored


class OpenAIServingResponses:
    """The Responses API over `chat` (a chat completions handler: Serving's, or the replicas' ingress')."""

    def __init__(self, chat: ChatHandler, model_name: Callable[[], Awaitable[str]], store: ResponseStore):
        self.chat, self.model_name, self.store = chat, model_name, store

    async def create_response(
        self, request: r.ResponsesRequest, raw_request: Request | None = None
    ) -> r.ResponseObject | AsyncIterator[str]:
        """The whole response, or (request.stream) its typed server-sent events; a refusal raises APIError."""
        history = []
        if request.previous_response_id is not None:
            history = self.store.get(request.previous_response_id, "previous_response_id").messages
        items = (
            [r.MessageInput(role="user", content=request.input)]
            if isinstance(request.input, str)
            else request.input
        )
        conversation = history + chat_messages(items)
        if not conversation:
            raise APIError("input: no message to answer (only reasoning items, or none)", param="input")
        chat_request = chat_completion_request(request, conversation)
        try:
            result = await self.chat(chat_request, raw_request)
        except APIError as error:
            error.param = PARAMS.get(error.param, error.param)
            raise
        response = r.ResponseObject(model=request.model or await self.model_name(), **echoed(request))
        if request.stream:
            return typed_sse(self._events(request, response, result, conversation))
        output = Output()
        (choice,) = result.choices
        output.feed(choice.message.model_dump())
        output.close(choice.finish_reason)
        self._finish(request, response, output, conversation, _usage(result.usage.model_dump()))
        return response

    def retrieve(self, response_id: str) -> r.ResponseObject:
        return self.store.get(response_id).response

    async def _events(
        self,
        request: r.ResponsesRequest,
        response: r.ResponseObject,
        chunks: AsyncIterator[str],
        conversation: list[p.ChatMessage],
    ) -> AsyncIterator[dict]:
        """The Responses API's events from the chat stream's chunks; closing them aborts the request."""
        yield {"type": "response.created", "response": response.model_dump()}
        yield {"type": "response.in_progress", "response": response.model_dump()}
        output, usage = Output(), None
        try:
            async for event in chunks:
                data = event.removeprefix("data: ").strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:  # the engine failed mid-stream (or the server shut down)
                    response.status = "failed"
                    response.error = r.ResponseError(code="server_error", message=chunk["error"]["message"])
                    yield {"type": "response.failed", "response": response.model_dump()}
                    return
                for choice in chunk["choices"]:
                    for e in output.feed(choice["delta"]):
                        yield e
                    if choice["finish_reason"]:
                        for e in output.close(choice["finish_reason"]):
                            yield e
                if chunk.get("usage"):
                    usage = _usage(chunk["usage"])
        finally:
            await chunks.aclose()
        self._finish(request, response, output, conversation, usage)
        kind = "response.completed" if response.status == "completed" else "response.incomplete"
        yield {"type": kind, "response": response.model_dump()}

    def _finish(
        self,
        request: r.ResponsesRequest,
        response: r.ResponseObject,
        output: Output,
        conversation: list[p.ChatMessage],
        usage: r.ResponseUsage | None,
    ) -> None:
        """The response's output, status and usage; stored (request.store) with its conversation."""
        response.output, response.usage = output.items, usage
        response.status = "incomplete" if output.truncated else "completed"
        if output.truncated:
            response.incomplete_details = r.IncompleteDetails(reason="max_output_tokens")
        if request.store:
            sent_back = INPUT_ITEMS.validate_python([item.model_dump() for item in output.items])
            self.store.put(StoredResponse(response, conversation + chat_messages(sent_back)))


def chat_completion_request(request: r.ResponsesRequest, conversation: list[p.ChatMessage]):
    """The chat completion request a Responses request runs as (instructions first, as a system turn)."""
    system = (
        [] if request.instructions is None else [p.ChatMessage(role="system", content=request.instructions)]
    )
    choice = request.tool_choice
    if isinstance(choice, r.FunctionToolChoice):
        choice = {"type": "function", "function": {"name": choice.name}}
    fmt = request.text.format if request.text else None
    response_format = None
    if fmt is not None:
        schema = None
        if fmt.type == "json_schema":
            schema = p.JsonSchemaFormat(
                name=fmt.name or "response",
                description=fmt.description,
                schema=fmt.schema_,
                strict=fmt.strict,
            )
        response_format = p.ResponseFormat(type=fmt.type, json_schema=schema)
    tools = [
        p.ChatTool(type="function", function=p.FunctionDefinition(**tool.model_dump(exclude={"type"})))
        for tool in request.tools
    ]
    return p.ChatCompletionRequest(
        model=request.model,
        messages=system + conversation,
        tools=tools or None,
        tool_choice=choice if tools or choice != "auto" else None,
        parallel_tool_calls=request.parallel_tool_calls,
        max_completion_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        user=request.user,
        response_format=response_format,
        stream=request.stream,
        stream_options=p.StreamOptions(include_usage=True) if request.stream else None,
        **{name: getattr(request, name) for name in VLLM_EXTRAS},
    )


def chat_messages(items: list[r.InputItem]) -> list[p.ChatMessage]:
    """Input items as chat messages: a function_call joins the assistant turn before it (one turn that
    says something and calls tools, as chat completions has it), its output is a tool message, reasoning
    is left out."""
    messages: list[p.ChatMessage] = []
    for item in items:
        if isinstance(item, r.MessageInput):
            role = "system" if item.role == "developer" else item.role
            messages.append(p.ChatMessage(role=role, content=_text(item.content)))
        elif isinstance(item, r.FunctionCallInput):
            call = p.ToolCall(
                id=item.call_id, function=p.FunctionCall(name=item.name, arguments=item.arguments)
            )
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(p.ChatMessage(role="assistant", tool_calls=[call]))
        elif isinstance(item, r.FunctionCallOutputInput):
            messages.append(p.ChatMessage(role="tool", tool_call_id=item.call_id, content=_text(item.output)))
    return messages


def _text(content: str | list[r.TextContent]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def echoed(request: r.ResponsesRequest) -> dict:
    """The request's settings a response repeats."""
    choice = request.tool_choice
    fmt = request.text.format if request.text and request.text.format else r.TextFormat(type="text")
    return dict(
        instructions=request.instructions,
        max_output_tokens=request.max_output_tokens,
        metadata=request.metadata,
        parallel_tool_calls=request.parallel_tool_calls,
        previous_response_id=request.previous_response_id,
        store=request.store,
        temperature=request.temperature,
        top_p=request.top_p,
        text={"format": fmt.model_dump(exclude_none=True, by_alias=True)},
        tool_choice=choice if isinstance(choice, str) else choice.model_dump(),
        tools=[tool.model_dump(exclude_none=True) for tool in request.tools],
        user=request.user,
    )


def _usage(chat_usage: dict) -> r.ResponseUsage:
    return r.ResponseUsage(
        input_tokens=chat_usage["prompt_tokens"],
        output_tokens=chat_usage["completion_tokens"],
        total_tokens=chat_usage["total_tokens"],
    )


@dataclass
class Output:
    """A response's output items, built from a chat assistant message as it comes: whole (one `feed`) or
    streamed (one `feed` a chunk's delta). Each step returns the stream events it makes; an item is done
    when the next one starts, or at `close`."""

    items: list[r.OutputItem] = field(default_factory=list)
    calls: dict[int, int] = field(default_factory=dict)  # a chat tool call's index -> its output index
    open: int | None = None  # the output index of the item still being written
    truncated: bool = False

    def feed(self, message: dict) -> list[dict]:
        """A chat message or delta: its reasoning (the reasoning parser's `reasoning_content`, where one
        runs), its text, then its tool calls."""
        events = []
        if message.get("reasoning_content"):
            events += self._text(r.ReasoningOutput, message["reasoning_content"])
        if message.get("content"):
            events += self._text(r.MessageOutput, message["content"])
        for i, call in enumerate(message.get("tool_calls") or []):
            events += self._call(call.get("index", i), call)
        return events

    def close(self, finish_reason: str | None) -> list[dict]:
        """The end: the last item done; `length` leaves it (and the response) incomplete."""
        self.truncated = finish_reason == "length"
        return self._done("incomplete" if self.truncated else "completed")

    def _text(self, kind: type[r.MessageOutput | r.ReasoningOutput], delta: str) -> list[dict]:
        events = []
        item = self.items[self.open] if self.open is not None else None
        if not isinstance(item, kind):
            events += self._start(kind())
            item = self.items[self.open]
            part = r.OutputText() if kind is r.MessageOutput else r.ReasoningText()
            item.content.append(part)
            events.append(
                self._event("response.content_part.added", self.open, content_index=0, part=part.model_dump())
            )
        item.content[0].text += delta
        prefix = _PREFIX[item.content[0].type]
        extra = {"logprobs": []} if kind is r.MessageOutput else {}
        return [*events, self._event(f"{prefix}.delta", self.open, content_index=0, delta=delta, **extra)]

    def _call(self, index: int, delta: dict) -> list[dict]:
        events = []
        function = delta.get("function") or {}
        if index not in self.calls:
            events += self._start(r.FunctionCallOutput(call_id=delta["id"], name=function["name"]))
            self.calls[index] = self.open
        arguments = function.get("arguments")
        if arguments:
            self.items[self.calls[index]].arguments += arguments
            events.append(
                self._event("response.function_call_arguments.delta", self.calls[index], delta=arguments)
            )
        return events

    def _start(self, item: r.OutputItem) -> list[dict]:
        events = self._done("completed")
        self.items.append(item)
        self.open = len(self.items) - 1
        events.append(
            {"type": "response.output_item.added", "output_index": self.open, "item": item.model_dump()}
        )
        return events

    def _done(self, status: str) -> list[dict]:
        """The open item's closing events."""
        if self.open is None:
            return []
        index, item = self.open, self.items[self.open]
        item.status = status
        if isinstance(item, r.FunctionCallOutput):
            done = {"name": item.name, "arguments": item.arguments}
            events = [self._event("response.function_call_arguments.done", index, **done)]
        else:
            part = item.content[0]
            logprobs = {"logprobs": []} if part.type == "output_text" else {}
            events = [
                self._event(f"{_PREFIX[part.type]}.done", index, content_index=0, text=part.text, **logprobs),
                self._event("response.content_part.done", index, content_index=0, part=part.model_dump()),
            ]
        events.append({"type": "response.output_item.done", "output_index": index, "item": item.model_dump()})
        self.open = None
        return events

    def _event(self, kind: str, index: int, **fields) -> dict:
        """An event about the item at output index `index`."""
        return {"type": kind, "item_id": self.items[index].id, "output_index": index, **fields}


_PREFIX = {"output_text": "response.output_text", "reasoning_text": "response.reasoning_text"}


async def typed_sse(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Server-sent events as the Responses API sends them: `event: <type>` and the event, numbered in
    order by `sequence_number` (no `[DONE]` at the end). Closing them closes `events`."""
    try:
        sequence_number = 0
        async for event in events:
            event["sequence_number"] = sequence_number
            sequence_number += 1
            yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
    finally:
        await events.aclose()
