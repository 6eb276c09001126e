"""OpenAIServing: what the completions and chat handlers share, from a parsed request to engine streams.

A handler checks its request, then `add_requests` tokenizes each prompt once, applies the max_model_len
rule and adds the engine requests, all in one call on the engine thread; it reads the outputs back
through `finals` (a whole response) or its own chunk generator (a stream). Errors are raised as APIError
for the app's handlers to answer, so a handler can be called, and tested, without HTTP.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from fastapi import Request

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai import protocol as p
from pagedllm.entrypoints.openai.async_engine import AsyncEngine, RequestStream
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.limits import ServerLimits
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.entrypoints.openai.streams import finals, until_disconnected
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import BeamSearchParams, GuidedDecodingParams, SamplingParams

# Unset in a request, these take the model's generation_config.json defaults (then SamplingParams').
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

# Fields that would change what a beam may produce or return: refused with use_beam_search (vLLM ignores
# them). The sampling-only ones (temperature, top_p, top_k, min_p, seed) are accepted and, as in vLLM,
# do not change the search.
BEAM_SEARCH_REFUSES = {
    "stop": None,
    "stop_token_ids": None,
    "min_tokens": 0,
    "include_stop_str_in_output": False,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
}

Tokenize = Callable[[LLMEngine], list[list[int]]]  # a request's prompts as token ids (engine thread)
Outputs = AsyncIterator[tuple[int, RequestOutput]]  # (prompt index, output), as streams.merge gives


class OpenAIServing:
    """The base of the completions and chat handlers: the engine, the served model and the limits."""

    def __init__(self, engine: AsyncEngine, models: OpenAIServingModels, limits: ServerLimits):
        self.engine, self.models, self.limits = engine, models, limits
        self.max_model_len = engine.max_model_len
        self.default_sampling = engine.default_sampling  # from generation_config.json

    def check_request(self, request: p.SamplingRequest) -> None:
        """The checks that need no engine: the model's name and the server's limit on n."""
        self.models.check_model(request.model)
        self.limits.check_n(request.n)

    async def add_requests(
        self,
        response_id: str,
        num_prompts: int,
        tokenize: Tokenize,
        request: p.SamplingRequest,
        max_tokens: int | None,
        logprobs: int | None,
        guided: GuidedDecodingParams | None,
        prompt_logprobs: int | None = None,
    ) -> list[RequestStream]:
        """One engine request per prompt, `{response_id}-{i}`: tokenized, checked and added in one call on
        the engine thread, so a request joins the very next step; a refusal of any prompt adds none."""

        def prepare(engine: LLMEngine) -> list[tuple[list[int], SamplingParams | BeamSearchParams]]:
            items = []
            for ids in tokenize(engine):
                limit = self.checked_max_tokens(max_tokens, len(ids))
                items.append((ids, self.request_params(request, limit, logprobs, guided, prompt_logprobs)))
            return items

        request_ids = [f"{response_id}-{i}" for i in range(num_prompts)]
        try:  # under the LoRA adapter the request's `model` names, if it names one
            return await self.engine.add(request_ids, prepare, self.models.lora_request(request.model))
        except ValueError as error:  # the engine refused a prompt or a parameter
            raise APIError(str(error), param=_param_of(str(error))) from error

    async def finals(
        self, outputs: Outputs, streams: list[RequestStream], num_prompts: int, raw_request: Request | None
    ) -> list[RequestOutput]:
        """Each prompt's last output; a client that goes away first (raw_request) aborts them all."""
        work = finals(outputs, num_prompts)
        try:
            return await (work if raw_request is None else until_disconnected(raw_request, work))
        finally:
            await close_all(outputs, streams)

    def checked_max_tokens(self, requested: int | None, num_prompt_tokens: int) -> int | None:
        """vLLM's rule: prompt + max_tokens must fit max_model_len; unset, max_tokens is what is left. A
        prompt that leaves no room at all is add_request's to refuse (its own check of the token ids)."""
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            return requested
        if requested is None:
            default = self.default_sampling.get("max_tokens")
            return min(room, default) if default else room
        if requested > room:
            raise APIError(
                f"this model's maximum context length is {self.max_model_len} tokens (max_model_len="
                f"{self.max_model_len}), but the request asks for {num_prompt_tokens + requested}: "
                f"{num_prompt_tokens} in the prompt and max_tokens={requested}; shorten the prompt or "
                "lower max_tokens",
                param="max_tokens",
            )
        return requested

    async def guided_params(self, request: p.SamplingRequest) -> GuidedDecodingParams | None:
        """response_format as guided decoding, compiled off the engine thread (the engine hits the cache)."""
        fmt = request.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            guided = GuidedDecodingParams(json_object=True)
        elif fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError(
                "response_format of type json_schema needs json_schema.schema", param="response_format"
            )
        else:
            guided = GuidedDecodingParams(json=fmt.json_schema.schema_)
        return await self.compiled(guided, "response_format")

    async def compiled(self, guided: GuidedDecodingParams, param: str) -> GuidedDecodingParams:
        """`guided`, its grammar compiled off the engine thread (the engine then hits the compiler's
        cache); a schema xgrammar cannot use is a 400 naming `param`."""
        try:
            await asyncio.to_thread(self.engine.compile_grammar, guided)
        except ValueError as error:
            raise APIError(str(error), param=param) from error
        return guided

    def request_params(
        self,
        request: p.SamplingRequest,
        max_tokens: int | None,
        logprobs: int | None,
        guided: GuidedDecodingParams | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams | BeamSearchParams:
        if not request.use_beam_search:
            return self.sampling_params(request, max_tokens, logprobs, guided, prompt_logprobs)
        if guided is not None:
            raise APIError("response_format is not supported with use_beam_search", param="response_format")
        if prompt_logprobs is not None and logprobs is None:  # with logprobs: refused for logprobs below
            raise APIError("prompt_logprobs is not supported with use_beam_search", param="prompt_logprobs")
        return beam_search_params(request, max_tokens or self.max_model_len, logprobs)

    def sampling_params(
        self,
        request: p.SamplingRequest,
        max_tokens: int | None,
        logprobs: int | None,
        guided: GuidedDecodingParams | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """The request's SamplingParams; unset sampling fields take the model's defaults."""
        given = {
            name: getattr(request, name) for name in SAMPLING_FIELDS if getattr(request, name) is not None
        }
        defaults = {k: v for k, v in self.default_sampling.items() if k in SAMPLING_FIELDS}
        try:
            return SamplingParams(
                n=request.n,
                max_tokens=max_tokens,
                seed=request.seed,
                stop=request.stop,
                stop_token_ids=request.stop_token_ids,
                ignore_eos=request.ignore_eos,
                min_tokens=request.min_tokens,
                include_stop_str_in_output=request.include_stop_str_in_output,
                skip_special_tokens=request.skip_special_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                presence_penalty=request.presence_penalty,
                frequency_penalty=request.frequency_penalty,
                guided_decoding=guided,
                **(defaults | given),
            )
        except ValueError as error:
            raise APIError(str(error), param=str(error).split(" ", 1)[0]) from error


def beam_search_params(request: p.SamplingRequest, max_tokens: int, logprobs: int | None) -> BeamSearchParams:
    """vLLM's `use_beam_search`: `n` is the beam width; each beam comes back as one choice, best first."""
    if logprobs is not None:
        raise APIError("logprobs is not supported with use_beam_search", param="logprobs")
    for name, default in BEAM_SEARCH_REFUSES.items():
        if getattr(request, name) not in (default, [], None):
            raise APIError(f"{name} is not supported with use_beam_search", param=name)
    try:
        return BeamSearchParams(
            beam_width=request.n,
            max_tokens=max_tokens,
            ignore_eos=request.ignore_eos,
            temperature=request.temperature or 0.0,
            length_penalty=request.length_penalty,
            skip_special_tokens=request.skip_special_tokens,
        )
    except ValueError as error:
        name = str(error).split(" ", 1)[0]
        raise APIError(str(error), param="n" if name == "beam_width" else name) from error


def usage(outputs: list[RequestOutput]) -> p.UsageInfo:
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return p.UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


async def remember(outputs: Outputs, last: dict[int, RequestOutput]) -> Outputs:
    """`outputs`, keeping each prompt's latest output in `last` (for the usage chunk)."""
    async for i, output in outputs:
        last[i] = output
        yield i, output


async def close_all(outputs: Outputs, streams: list[RequestStream]) -> None:
    """Close the merged outputs and every stream: a request still running is aborted."""
    await outputs.aclose()
    for stream in streams:
        await stream.aclose()


def _param_of(message: str) -> str:
    """The field an engine error names (its first word, e.g. 'stop_token_ids ...'), else the prompt."""
    first = message.split(" ", 1)[0]
    return first if first in p.CompletionRequest.model_fields else "prompt"
