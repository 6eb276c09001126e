"""POST /v1/chat/completions: a conversation through the model's chat template, whole or streamed, with
the tools it may call (tools.py) and its calls parsed out of the output (tool_parser.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai import protocol as p
from pagedllm.entrypoints.openai.async_engine import RequestStream
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.logprobs import chat_logprobs
from pagedllm.entrypoints.openai.reasoning import (
    ReasoningDelta,
    ReasoningParser,
    check_parser_name,
    new_reasoning_parser,
)
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing, Outputs, close_all, remember, usage
from pagedllm.entrypoints.openai.streams import deltas, merge, sse
from pagedllm.entrypoints.openai.tool_parser import ParsedDelta, ToolParser
from pagedllm.entrypoints.openai.tools import ToolPlan, plan_tools, template_messages
from pagedllm.outputs import CompletionOutput, RequestOutput


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args, reasoning_parser: str | None = None):
        super().__init__(*args)
        self.reasoning_parser = check_parser_name(reasoning_parser)  # vLLM's --reasoning-parser

    async def create_chat_completion(
        self, request: p.ChatCompletionRequest, raw_request: Request | None = None
    ) -> p.ChatCompletionResponse | AsyncIterator[str]:
        """The whole response, or (request.stream) its server-sent events; a refusal raises APIError."""
        self.check_request(request)
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        self.limits.check_logprobs("top_logprobs", request.top_logprobs)
        num_top = (request.top_logprobs or 0) if request.logprobs else None
        plan = plan_tools(request, getattr(self.engine.tokenizer, "chat_template", None))
        if plan.guided is not None:
            guided = await self.compiled(plan.guided, "tools")
        else:
            guided = await self.guided_params(request)
        messages = template_messages(request.messages)
        response_id = p.random_id("chatcmpl")
        prompts: list[str] = []  # the rendered prompt, where the reasoning parser starts from

        def tokenize(engine: LLMEngine) -> list[list[int]]:
            model, prompt_end = engine.config.model, request.add_generation_prompt
            kwargs = request.chat_template_kwargs
            prompts.append(chat_text(engine.tokenizer, model, messages, prompt_end, plan.tools, kwargs))
            return [engine.tokenizer.encode(prompts[0], add_special_tokens=False)]

        streams = await self.add_requests(
            response_id,
            1,
            tokenize,
            request,
            request.max_completion_tokens or request.max_tokens,
            num_top,
            guided,
        )
        # A guided output is the grammar's from its first token: no reasoning to split off (vLLM guides
        # only the text after the reasoning, which pagedllm's grammars cannot).
        reasoning = None if guided is not None else self.reasoning_parser
        parsers = OutputParsers(plan, reasoning, prompts[0])
        outputs = merge(streams)
        if request.stream:
            return sse(self._chunks(request, response_id, outputs, streams, num_top, parsers))
        (final,) = await self.finals(outputs, streams, 1, raw_request)
        return self._response(response_id, final, num_top, parsers)

    def _response(
        self, response_id: str, final: RequestOutput, num_top: int | None, parsers: OutputParsers
    ) -> p.ChatCompletionResponse:
        tokenizer = self.engine.tokenizer
        choices = []
        for o in final.outputs:
            reasoning, parser = parsers.new()
            thought, text = (None, o.text) if reasoning is None else reasoning.parse(o.text)
            content, calls = (text, []) if parser is None else parser.parse(text)
            message = p.AssistantMessage(
                content=None if calls and not content else content,
                reasoning_content=thought,
                tool_calls=[
                    p.ToolCall(id=c.id, function=p.FunctionCall(name=c.name, arguments=c.arguments))
                    for c in calls
                ],
            )
            choices.append(
                p.ChatChoice(
                    index=o.index,
                    message=message,
                    logprobs=None
                    if num_top is None
                    else chat_logprobs(tokenizer, o.token_ids, o.logprobs, num_top),
                    finish_reason=_finish_reason(o, parser),
                    stop_reason=o.stop_reason,
                )
            )
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
        parsers: OutputParsers,
    ) -> AsyncIterator[p.ChatCompletionChunk]:
        """One chunk per choice that advanced. With tools or a reasoning parser, a delta that only fed
        the parsers (text held back at a possible `<tool_call>` or `</think>`, a call's name not yet
        complete) sends nothing; its tokens' logprobs go with the next chunk."""
        tokenizer, model = self.engine.tokenizer, self.models.model_name
        last: dict[int, RequestOutput] = {}
        choice_parsers: dict[int, tuple[ReasoningParser | None, ToolParser | None]] = {}
        tokens_sent: dict[int, int] = {}
        try:
            async for d in deltas(remember(outputs, last), request.n, request.stop):
                if d.index not in choice_parsers:
                    choice_parsers[d.index] = parsers.new()
                reasoning, parser = choice_parsers[d.index]
                finish_reason = d.output.finish_reason
                delta = p.DeltaMessage(role="assistant" if d.first else None, content=d.text)
                if reasoning is not None or parser is not None:
                    thought, parsed = _parsed_delta(reasoning, parser, d.text, bool(finish_reason))
                    delta.content, delta.tool_calls = _tool_delta(parsed)
                    delta.reasoning_content = thought or None
                    if not (d.first or finish_reason or thought or parsed.content or parsed.calls):
                        continue
                logprobs = None
                if num_top is not None:
                    new = slice(tokens_sent.get(d.index, 0), None)
                    logprobs = chat_logprobs(
                        tokenizer, d.output.token_ids[new], d.output.logprobs[new], num_top
                    )
                tokens_sent[d.index] = len(d.output.token_ids)
                choice = p.ChatChunkChoice(
                    index=d.index,
                    delta=delta,
                    logprobs=logprobs,
                    finish_reason=_finish_reason(d.output, parser) if finish_reason else None,
                    stop_reason=d.output.stop_reason,
                )
                yield p.ChatCompletionChunk(id=response_id, model=model, choices=[choice])
            if request.stream_options and request.stream_options.include_usage:
                usage_info = usage([last[0]])
                yield p.ChatCompletionChunk(id=response_id, model=model, choices=[], usage=usage_info)
        finally:
            await close_all(outputs, streams)


@dataclass
class OutputParsers:
    """How each choice's text is read: its reasoning split off first (a reasoning parser's name), then
    its tool calls parsed out of the rest (the ToolPlan's parser)."""

    plan: ToolPlan
    reasoning: str | None
    prompt: str  # the rendered prompt: whether it opened a `<think>` block

    def new(self) -> tuple[ReasoningParser | None, ToolParser | None]:
        """One choice's parsers (each choice has its own)."""
        reasoning = None if self.reasoning is None else new_reasoning_parser(self.reasoning, self.prompt)
        return reasoning, self.plan.new_parser()


def _parsed_delta(
    reasoning: ReasoningParser | None, parser: ToolParser | None, text: str, final: bool
) -> tuple[str, ParsedDelta]:
    """One delta of a choice's text through its parsers: the reasoning it added, and the content and
    tool calls of the rest; `final`: the choice's last delta, which closes the parsers."""
    thought = ReasoningDelta(content=text)
    if reasoning is not None:
        thought = reasoning.feed(text)
        if final:
            thought.add(reasoning.close())
    if parser is None:
        return thought.reasoning, ParsedDelta(content=thought.content)
    parsed = parser.feed(thought.content)
    if final:
        parsed.add(parser.close())
    return thought.reasoning, parsed


def _tool_delta(parsed: ParsedDelta) -> tuple[str | None, list[p.DeltaToolCall] | None]:
    """A parsed delta as the chunk's content and tool_calls (content null beside a call, as OpenAI's)."""
    if not parsed.calls:
        return parsed.content, None
    calls = [
        p.DeltaToolCall(
            index=c.index,
            id=c.id,
            type=None if c.id is None else "function",
            function=p.DeltaFunctionCall(name=c.name, arguments=c.arguments),
        )
        for c in parsed.calls
    ]
    return parsed.content or None, calls


def _finish_reason(output: CompletionOutput, parser: ToolParser | None) -> str | None:
    """ "tool_calls" where the model stopped by itself after calling tools (OpenAI's, vLLM's)."""
    if parser is not None and parser.called and output.finish_reason == "stop":
        return "tool_calls"
    return output.finish_reason


def chat_prompt(
    engine: LLMEngine, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None
) -> list[int]:
    """The conversation's token ids through the tokenizer's chat template (runs on the engine thread)."""
    text = chat_text(engine.tokenizer, engine.config.model, messages, add_generation_prompt, tools)
    return engine.tokenizer.encode(text, add_special_tokens=False)


def chat_text(
    tokenizer,
    model: str,
    messages: list[dict],
    add_generation_prompt: bool,
    tools: list[dict] | None,
    template_kwargs: dict | None = None,
) -> str:
    """The conversation rendered by `model`'s tokenizer's chat template, as text (`tools` passed as
    transformers does; `template_kwargs`: a request's chat_template_kwargs, such as enable_thinking)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError(f"model {model!r} has no chat template", param="messages")
    extra = (template_kwargs or {}) | ({} if tools is None else {"tools": tools})
    try:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
        )
    except Exception as error:  # the template's own checks (roles, order) raise jinja errors
        raise APIError(f"messages: the chat template refused them: {error}", param="messages") from error
