"""POST /v1/completions: one prompt or several (text or token ids), whole or streamed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import Request

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai import protocol as p
from pagedllm.entrypoints.openai.async_engine import RequestStream
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.logprobs import completion_logprobs, prompt_logprobs
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing, Outputs, close_all, remember, usage
from pagedllm.entrypoints.openai.streams import deltas, merge, sse
from pagedllm.outputs import CompletionOutput, RequestOutput

Prompt = str | list[int]


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(
        self, request: p.CompletionRequest, raw_request: Request | None = None
    ) -> p.CompletionResponse | AsyncIterator[str]:
        """The whole response, or (request.stream) its server-sent events; a refusal raises APIError.
        Choices are prompt-major: choice i * n + j is the j-th completion of prompt i."""
        self.check_request(request)
        self.limits.check_logprobs("logprobs", request.logprobs)
        self.limits.check_logprobs("prompt_logprobs", request.prompt_logprobs)
        if request.max_tokens == 0 and not request.echo:
            raise APIError(
                "max_tokens 0 asks for no completion: it needs echo (the prompt scored)", param="max_tokens"
            )
        if request.prompt_logprobs is not None and request.stream:
            raise APIError(
                "prompt_logprobs is not available with stream (as in vLLM); echo with logprobs streams them",
                param="prompt_logprobs",
            )
        guided = await self.guided_params(request)
        prompts = prompts_of(request.prompt)
        response_id = p.random_id("cmpl")
        # As vLLM: max_tokens 0 runs one token (sampled from the prefill's last logits), then drops it.
        max_tokens = 1 if request.max_tokens == 0 else request.max_tokens
        streams = await self.add_requests(
            response_id,
            len(prompts),
            lambda engine: _tokenized(engine, prompts),
            request,
            max_tokens,
            request.logprobs,
            guided,
            _prompt_logprobs(request),
        )
        echoes = [self._echo_text(prompt) for prompt in prompts] if request.echo else []
        outputs = merge(streams) if request.max_tokens != 0 else _prompt_only(merge(streams))
        if request.stream:
            return sse(self._chunks(request, response_id, outputs, streams, echoes))
        final = await self.finals(outputs, streams, len(prompts), raw_request)
        return self._response(request, response_id, final, echoes)

    def _response(
        self, request: p.CompletionRequest, response_id: str, final: list[RequestOutput], echoes: list[str]
    ) -> p.CompletionResponse:
        tokenizer = self.engine.tokenizer
        choices = []
        for i, output in enumerate(final):
            scored = None
            if request.prompt_logprobs is not None:
                scored = prompt_logprobs(tokenizer, output.prompt_logprobs, request.prompt_logprobs)
            for o in output.outputs:
                logprobs = None
                if request.logprobs is not None:
                    logprobs = _logprobs(tokenizer, request, output, o)
                choices.append(
                    p.CompletionChoice(
                        index=i * request.n + o.index,
                        text=echoes[i] + o.text if request.echo else o.text,
                        logprobs=logprobs,
                        finish_reason=o.finish_reason,
                        stop_reason=o.stop_reason,
                        prompt_logprobs=scored,
                    )
                )
        model = self.models.model_name
        return p.CompletionResponse(id=response_id, model=model, choices=choices, usage=usage(final))

    async def _chunks(
        self,
        request: p.CompletionRequest,
        response_id: str,
        outputs: Outputs,
        streams: list[RequestStream],
        echoes: list[str],
    ) -> AsyncIterator[p.CompletionResponse]:
        tokenizer, model, offsets = self.engine.tokenizer, self.models.model_name, {}
        last: dict[int, RequestOutput] = {}
        try:
            async for d in deltas(remember(outputs, last), request.n, request.stop):
                echo = request.echo and d.first
                text = (echoes[d.index // request.n] if echo else "") + d.text
                logprobs = None
                if request.logprobs is not None:
                    new = slice(d.token_start, None)
                    token_ids, entries = d.output.token_ids[new], d.output.logprobs[new]
                    if echo:
                        token_ids, entries = _after_prompt(last[d.index // request.n], token_ids, entries)
                    logprobs = completion_logprobs(
                        tokenizer, token_ids, entries, request.logprobs, offsets.get(d.index, 0)
                    )
                offsets[d.index] = offsets.get(d.index, 0) + len(text)
                choice = p.CompletionChoice(
                    index=d.index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=d.output.finish_reason,
                    stop_reason=d.output.stop_reason,
                )
                yield p.CompletionResponse(id=response_id, model=model, choices=[choice])
            if request.stream_options and request.stream_options.include_usage:
                final = [last[i] for i in sorted(last)]
                yield p.CompletionResponse(id=response_id, model=model, choices=[], usage=usage(final))
        finally:
            await close_all(outputs, streams)

    def _echo_text(self, prompt: Prompt) -> str:
        """The prompt as echo puts it before the completion: token ids decoded, text as sent."""
        if isinstance(prompt, str):
            return prompt
        tokenizer = self.engine.tokenizer
        return tokenizer.decode(prompt) if tokenizer is not None else ""


def _prompt_logprobs(request: p.CompletionRequest) -> int | None:
    """How many top log-probabilities the engine keeps at each prompt position: echo with logprobs
    needs logprobs of them, prompt_logprobs its own number (as vLLM)."""
    wanted = [request.prompt_logprobs, request.logprobs if request.echo else None]
    return max((k for k in wanted if k is not None), default=None)


def _logprobs(
    tokenizer, request: p.CompletionRequest, output: RequestOutput, o: CompletionOutput
) -> p.CompletionLogprobs:
    """A choice's logprobs: its tokens', after (echo) the prompt's."""
    token_ids, entries = o.token_ids, o.logprobs
    if request.echo:
        token_ids, entries = _after_prompt(output, token_ids, entries)
    return completion_logprobs(tokenizer, token_ids, entries, request.logprobs)


def _after_prompt(output: RequestOutput, token_ids: list[int], entries: list) -> tuple[list[int], list]:
    """Echo with logprobs: the prompt's tokens and entries (the first None), then the completion's."""
    return output.prompt_token_ids + token_ids, output.prompt_logprobs + entries


async def _prompt_only(outputs: Outputs) -> Outputs:
    """max_tokens 0: each output without the one token generated for it (its prompt alone is wanted)."""
    try:
        async for i, output in outputs:
            empty = [
                replace(o, text="", token_ids=[], logprobs=[] if o.logprobs is not None else None)
                for o in output.outputs
            ]
            yield i, replace(output, outputs=empty)
    finally:
        await outputs.aclose()


def prompts_of(prompt: str | list) -> list[Prompt]:
    """The request's prompts: one text, one list of token ids, or a list of either."""
    is_ids = isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int))
    return [prompt] if isinstance(prompt, str) or is_ids else prompt


def _tokenized(engine: LLMEngine, prompts: list[Prompt]) -> list[list[int]]:
    """Token ids of each prompt: text through the tokenizer (with its special tokens, as the engine does)."""
    if engine.tokenizer is None and any(isinstance(prompt, str) for prompt in prompts):
        raise APIError(f"model {engine.config.model!r} has no tokenizer: send token ids", param="prompt")
    return [
        engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt) for prompt in prompts
    ]
