"""POST /v1/chat/completions: a conversation through the model's chat template, whole or streamed."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai import protocol as p
from pagedllm.entrypoints.openai.async_engine import RequestStream
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.logprobs import chat_logprobs
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing, Outputs, close_all, remember, usage
from pagedllm.entrypoints.openai.streams import deltas, merge, sse
from pagedllm.outputs import RequestOutput


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(
        self, request: p.ChatCompletionRequest, raw_request: Request | None = None
    ) -> p.ChatCompletionResponse | AsyncIterator[str]:
        """The whole response, or (request.stream) its server-sent events; a refusal raises APIError."""
        self.check_request(request)
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        self.limits.check_logprobs("top_logprobs", request.top_logprobs)
        num_top = (request.top_logprobs or 0) if request.logprobs else None
        guided = await self.guided_params(request)
        messages = [m.model_dump() for m in request.messages]
        response_id = p.random_id("chatcmpl")
        streams = await self.add_requests(
            response_id,
            1,
            lambda engine: [chat_prompt(engine, messages, request.add_generation_prompt)],
            request,
            request.max_completion_tokens or request.max_tokens,
            num_top,
            guided,
        )
        outputs = merge(streams)
        if request.stream:
            return sse(self._chunks(request, response_id, outputs, streams, num_top))
        (final,) = await self.finals(outputs, streams, 1, raw_request)
        return self._response(response_id, final, num_top)

    def _response(
        self, response_id: str, final: RequestOutput, num_top: int | None
    ) -> p.ChatCompletionResponse:
        tokenizer = self.engine.engine.tokenizer
        choices = [
            p.ChatChoice(
                index=o.index,
                message=p.AssistantMessage(content=o.text),
                logprobs=None
                if num_top is None
                else chat_logprobs(tokenizer, o.token_ids, o.logprobs, num_top),
                finish_reason=o.finish_reason,
                stop_reason=o.stop_reason,
            )
            for o in final.outputs
        ]
        return p.ChatCompletionResponse(
            id=response_id, model=self.models.model_name, choices=choices, usage=usage([final])
        )

    async def _chunks(
        self,
        request: p.ChatCompletionRequest,
        response_id: str,
        outputs: Outputs,
        streams: list[RequestStream],
        num_top: int | None,
    ) -> AsyncIterator[p.ChatCompletionChunk]:
        tokenizer, model = self.engine.engine.tokenizer, self.models.model_name
        last: dict[int, RequestOutput] = {}
        try:
            async for d in deltas(remember(outputs, last), request.n, request.stop):
                logprobs = None
                if num_top is not None:
                    new = slice(d.token_start, None)
                    logprobs = chat_logprobs(
                        tokenizer, d.output.token_ids[new], d.output.logprobs[new], num_top
                    )
                choice = p.ChatChunkChoice(
                    index=d.index,
                    delta=p.DeltaMessage(role="assistant" if d.first else None, content=d.text),
                    logprobs=logprobs,
                    finish_reason=d.output.finish_reason,
                    stop_reason=d.output.stop_reason,
                )
                yield p.ChatCompletionChunk(id=response_id, model=model, choices=[choice])
            if request.stream_options and request.stream_options.include_usage:
                usage_info = usage([last[0]])
                yield p.ChatCompletionChunk(id=response_id, model=model, choices=[], usage=usage_info)
        finally:
            await close_all(outputs, streams)


def chat_prompt(engine: LLMEngine, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """The conversation's token ids through the tokenizer's chat template (runs on the engine thread)."""
    tokenizer = engine.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError(f"model {engine.config.model!r} has no chat template", param="messages")
    for message in messages:
        if isinstance(message["content"], list):  # OpenAI content parts (text only: see protocol.py)
            message["content"] = "".join(part["text"] for part in message["content"])
        elif message["content"] is None:  # e.g. an assistant turn without text
            message["content"] = ""
    try:
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )
    except Exception as error:  # the template's own checks (roles, order) raise jinja errors
        raise APIError(f"messages: the chat template refused them: {error}", param="messages") from error
    return list(ids)
