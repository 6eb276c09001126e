"""The FastAPI app: OpenAI's /v1/completions and /v1/chat/completions over an AsyncEngine."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai import dashboard
from pagedllm.entrypoints.openai import protocol as p
from pagedllm.entrypoints.openai.async_engine import AsyncEngine
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, kind: str = "BadRequestError", param=None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param


def error_body(message: str, status: int, kind: str, param: str | None = None) -> dict:
    return p.ErrorResponse(
        error=p.ErrorInfo(message=message, type=kind, param=param, code=status)
    ).model_dump()


def build_app(model: str = "smollm2-135m", served_model_name: str | None = None, **engine_kwargs) -> FastAPI:
    """An app serving `model`; engine_kwargs are EngineConfig fields (kv_cache_memory, max_model_len, ...)."""
    engine = AsyncEngine(LLMEngine(EngineConfig(model=model, **engine_kwargs)))
    model_name = served_model_name or model

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="pagedllm", lifespan=lifespan)
    app.state.engine = engine
    app.include_router(dashboard.router(engine))  # GET /dashboard and GET /v1/kv

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        body = error_body(str(error), error.status, error.kind, error.param)
        return JSONResponse(body, status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        errors = error.errors()
        where = [".".join(str(part) for part in e["loc"] if part != "body") for e in errors]
        message = "; ".join(
            f"{name}: not supported by pagedllm"
            if e["type"] == "extra_forbidden"
            else f"{name}: {e['msg']} (got {e.get('input')!r})"
            for name, e in zip(where, errors, strict=True)
        )
        return JSONResponse(error_body(message, 400, "BadRequestError", where[0]), status_code=400)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> p.ModelList:
        return p.ModelList(data=[p.ModelCard(id=model_name, max_model_len=engine.engine.max_model_len)])

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    def request_params(
        request: p.SamplingRequest, max_tokens: int | None, logprobs: int | None
    ) -> SamplingParams | BeamSearchParams:
        if not request.use_beam_search:
            return sampling_params(request, max_tokens, logprobs)
        return beam_search_params(request, max_tokens or engine.engine.max_model_len, logprobs)

    def check_model(request: p.SamplingRequest) -> None:
        if request.model is not None and request.model != model_name:
            raise APIError(f"The model `{request.model}` does not exist.", 404, "NotFoundError", "model")

    @app.post("/v1/completions")
    async def completions(request: p.CompletionRequest, raw: Request):
        check_model(request)
        if request.echo:
            raise APIError("echo=true is not supported", param="echo")
        if isinstance(request.prompt, list) and request.prompt and not isinstance(request.prompt[0], int):
            raise APIError(
                "several prompts in one completions request are not supported: send one request per prompt",
                param="prompt",
            )
        params = request_params(request, request.max_tokens, request.logprobs)
        outputs = engine.generate(p.random_id("cmpl"), request.prompt, params)
        response_id = p.random_id("cmpl")
        if request.stream:
            return sse(completion_chunks(request, response_id, await prefetched(outputs)))
        final = await until_disconnected(raw, last_output(outputs))
        choices = [completion_choice(o, logprobs_of(o, engine)) for o in final.outputs]
        return p.CompletionResponse(id=response_id, model=model_name, choices=choices, usage=usage(final))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: p.ChatCompletionRequest, raw: Request):
        check_model(request)
        if request.logprobs:
            raise APIError("logprobs are not supported for chat completions", param="logprobs")
        params = request_params(request, request.max_completion_tokens or request.max_tokens, None)
        messages = [m.model_dump() for m in request.messages]
        prompt = await engine.run(lambda e: chat_prompt(e, messages, request.add_generation_prompt))
        outputs = engine.generate(p.random_id("chatcmpl"), prompt, params)
        response_id = p.random_id("chatcmpl")
        if request.stream:
            return sse(chat_chunks(request, response_id, await prefetched(outputs)))
        final = await until_disconnected(raw, last_output(outputs))
        choices = [
            p.ChatChoice(
                index=o.index,
                message=p.AssistantMessage(content=o.text),
                finish_reason=o.finish_reason,
                stop_reason=o.stop_reason,
            )
            for o in final.outputs
        ]
        return p.ChatCompletionResponse(id=response_id, model=model_name, choices=choices, usage=usage(final))

    async def completion_chunks(request: p.CompletionRequest, response_id: str, outputs):
        async for index, delta, o, output in deltas(outputs, request.stop):
            final = output
            choice = p.CompletionChoice(
                index=index, text=delta, finish_reason=o.finish_reason, stop_reason=o.stop_reason
            )
            yield p.CompletionResponse(id=response_id, model=model_name, choices=[choice])
        if request.stream_options and request.stream_options.include_usage:
            yield p.CompletionResponse(id=response_id, model=model_name, choices=[], usage=usage(final))

    async def chat_chunks(request: p.ChatCompletionRequest, response_id: str, outputs):
        started: set[int] = set()
        async for index, delta, o, output in deltas(outputs, request.stop):
            final = output
            message = p.DeltaMessage(content=delta)
            if index not in started:
                started.add(index)
                message.role = "assistant"
            choice = p.ChatChunkChoice(
                index=index, delta=message, finish_reason=o.finish_reason, stop_reason=o.stop_reason
            )
            yield p.ChatCompletionChunk(id=response_id, model=model_name, choices=[choice])
        if request.stream_options and request.stream_options.include_usage:
            yield p.ChatCompletionChunk(id=response_id, model=model_name, choices=[], usage=usage(final))

    return app


def sampling_params(
    request: p.SamplingRequest, max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    """The request's SamplingParams; an unsupported or out-of-range value is an APIError naming it."""
    given = {
        name: getattr(request, name)
        for name in ("temperature", "top_p", "top_k", "min_p")
        if getattr(request, name) is not None
    }
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
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=request.repetition_penalty,
            **given,
        )
    except ValueError as error:
        raise APIError(str(error), param=str(error).split(" ", 1)[0]) from error


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


def beam_search_params(request: p.SamplingRequest, max_tokens: int, logprobs: int | None) -> BeamSearchParams:
    """vLLM's `use_beam_search`: `n` is the beam width; each beam comes back as one choice, best first."""
    if logprobs is not None:
        raise APIError("logprobs is not supported with use_beam_search", param="logprobs")
    for name, default in BEAM_SEARCH_REFUSES.items():
        if getattr(request, name) not in (default, []):
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


def chat_prompt(engine: LLMEngine, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """The conversation through the tokenizer's chat template (runs on the engine thread)."""
    tokenizer = engine.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"model {engine.config.model!r} has no chat template")
    for message in messages:
        if isinstance(message["content"], list):  # OpenAI content parts (text only: see protocol.py)
            message["content"] = "".join(part["text"] for part in message["content"])
    return list(
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )
    )


async def until_disconnected(raw: Request, work: Awaitable):
    """Await `work`, cancelling it (which aborts its request) if the client goes away first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    return await task


async def _wait_for_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def last_output(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    try:
        async for output in outputs:
            final = output
        return final
    except ValueError as error:
        raise APIError(str(error), param="prompt") from error


async def deltas(outputs: AsyncIterator[RequestOutput], stop: str | list[str] | None):
    """(index, new text, output, request output) per sequence that advanced. While a sequence runs, the
    last len(longest stop string) - 1 characters are held back: a stop string found later cuts them."""
    hold = max((len(s) for s in ([stop] if isinstance(stop, str) else stop or [])), default=1) - 1
    sent: dict[int, int] = {}
    done: set[int] = set()
    async for output in outputs:
        for o in output.outputs:
            start = sent.get(o.index, 0)
            end = len(o.text) if o.finish_reason else max(start, len(o.text) - hold)
            if o.index in done or (end == start and not o.finish_reason):
                continue
            sent[o.index] = end
            if o.finish_reason:
                done.add(o.index)
            yield o.index, o.text[start:end], o, output


async def prefetched(outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """`outputs` with its first item already awaited, so a bad prompt is a 400 before a stream starts."""
    try:
        first = await anext(outputs)
    except ValueError as error:
        raise APIError(str(error), param="prompt") from error

    async def replay() -> AsyncIterator[RequestOutput]:
        try:
            yield first
            async for output in outputs:
                yield output
        finally:
            await outputs.aclose()

    return replay()


def sse(chunks: AsyncIterator[BaseModel]) -> StreamingResponse:
    """Server-sent events `data: {...}` per chunk, then `data: [DONE]`; an engine error mid-stream is
    sent as an error event. A client that disconnects cancels the stream, which aborts the request."""

    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {chunk.model_dump_json()}\n\n"
        except Exception as error:
            yield f"data: {json.dumps(error_body(str(error), 500, 'InternalServerError'))}\n\n"
        finally:
            await chunks.aclose()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def completion_choice(o: CompletionOutput, logprobs: p.CompletionLogprobs | None) -> p.CompletionChoice:
    return p.CompletionChoice(
        index=o.index,
        text=o.text,
        logprobs=logprobs,
        finish_reason=o.finish_reason,
        stop_reason=o.stop_reason,
    )


def logprobs_of(o: CompletionOutput, engine: AsyncEngine) -> p.CompletionLogprobs | None:
    if o.logprobs is None:
        return None
    tokenizer = engine.engine.tokenizer
    out = p.CompletionLogprobs()
    offset = 0
    for token_id, top in zip(o.token_ids, o.logprobs, strict=True):
        token = tokenizer.decode([token_id])
        out.tokens.append(token)
        out.token_logprobs.append(top[token_id])
        out.top_logprobs.append({tokenizer.decode([t]): lp for t, lp in top.items()})
        out.text_offset.append(offset)
        offset += len(token)
    return out


def usage(output: RequestOutput) -> p.UsageInfo:
    prompt_tokens = len(output.prompt_token_ids)
    completion_tokens = sum(len(o.token_ids) for o in output.outputs)
    return p.UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def main(
    model: str = "smollm2-135m",
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    **engine_kwargs,
) -> int:
    """Serve `model` with uvicorn until interrupted."""
    import uvicorn

    app = build_app(model, served_model_name, **engine_kwargs)
    uvicorn.run(app, host=host, port=port, log_level="info")
    return 0
