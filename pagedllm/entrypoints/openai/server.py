"""The FastAPI app: OpenAI's /v1/completions and /v1/chat/completions over an AsyncEngine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import AsyncIterator, Callable, Iterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response

from pagedllm._runtime import usable_cpus
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.parallel.executor import WorkerFailure
from pagedllm.entrypoints.openai import dashboard
from pagedllm.entrypoints.openai import protocol as p
from pagedllm.entrypoints.openai.async_engine import AsyncEngine, RequestStream
from pagedllm.entrypoints.openai.errors import APIError, ShuttingDown, error_response, install_error_handlers
from pagedllm.entrypoints.openai.limits import Admission, LimitsMiddleware, ServerLimits
from pagedllm.entrypoints.openai.logprobs import chat_logprobs, completion_logprobs
from pagedllm.entrypoints.openai.streams import deltas, finals, merge, sse, until_disconnected
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import BeamSearchParams, GuidedDecodingParams, SamplingParams

logger = logging.getLogger(__name__)

# Unset in a request, these take the model's generation_config.json defaults (then SamplingParams').
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


TOKENS_PER_CPU = 256  # the server's step budget on the CPU grows with the CPUs, between these two:
MIN_CPU_BATCHED_TOKENS, MAX_CPU_BATCHED_TOKENS = 512, 2048  # 2048: vLLM's server default on the CPU


def server_cpu_batched_tokens(cpus: int | None = None) -> int:
    """The server's max_num_batched_tokens on the CPU: TOKENS_PER_CPU a usable CPU, within the bounds.

    A step's prefill chunk stalls every running stream and holds back the next prompts' first tokens, so
    it is sized to take about the same time on any CPU rather than vLLM's flat 2048 (its value for GPUs,
    where 2048 tokens take tens of milliseconds). On 2 cores (the only size measured), 512 against 2048 on
    16 prompts of 100-300 tokens arriving together: median time to first token 1.3 s against 2.8 s, ITL
    p99 0.66-0.68 s against 0.86-0.91 s, output tokens/s 1-6% lower (docs/BENCHMARKS.md, Serving).
    """
    cpus = usable_cpus() if cpus is None else cpus
    return min(MAX_CPU_BATCHED_TOKENS, max(MIN_CPU_BATCHED_TOKENS, TOKENS_PER_CPU * cpus))


def build_app(
    model: str = "smollm2-135m",
    served_model_name: str | None = None,
    limits: ServerLimits | None = None,
    **engine_kwargs,
) -> FastAPI:
    """An app serving `model`; engine_kwargs are EngineConfig fields (kv_cache_memory, max_model_len, ...).
    max_num_batched_tokens None or absent: server_cpu_batched_tokens() on the CPU with chunked prefill on,
    else EngineConfig's default."""
    if engine_kwargs.get("max_num_batched_tokens") is None:
        engine_kwargs.pop("max_num_batched_tokens", None)
        if engine_kwargs.get("device", "cpu") == "cpu" and engine_kwargs.get("enable_chunked_prefill", True):
            engine_kwargs["max_num_batched_tokens"] = server_cpu_batched_tokens()
    engine = AsyncEngine(LLMEngine(EngineConfig(model=model, **engine_kwargs)))
    limits = limits or ServerLimits()
    model_name = served_model_name or model
    max_model_len = engine.engine.max_model_len

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.stop()
        stats = engine.engine.stats()
        if stats.kv_all_free:
            logger.info("engine stopped: all %d KV blocks are free", engine.engine.num_kv_blocks)
        else:
            logger.error("engine stopped with KV blocks still held: %s", stats.kv_usage)

    app = FastAPI(title="pagedllm", lifespan=lifespan)
    app.state.engine = engine
    app.state.admission = Admission()
    app.add_middleware(LimitsMiddleware, limits=limits, admission=app.state.admission)
    install_error_handlers(app)
    app.include_router(dashboard.router(engine))  # GET /dashboard and GET /v1/kv

    @app.exception_handler(WorkerFailure)  # a tensor-parallel rank died or hung: no step can run
    async def engine_failed(request: Request, error: WorkerFailure) -> Response:
        return error_response(str(error), 503)

    @app.get("/health")
    async def health() -> Response:
        failure = engine.engine.failure
        if failure is not None:
            return error_response(failure, 503)
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> p.ModelList:
        return p.ModelList(data=[p.ModelCard(id=model_name, max_model_len=max_model_len)])

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    def check_model(request: p.SamplingRequest) -> None:
        if request.model is not None and request.model != model_name:
            raise APIError(f"The model `{request.model}` does not exist.", 404, "model")

    def checked_max_tokens(requested: int | None, num_prompt_tokens: int) -> int | None:
        """vLLM's rule: prompt + max_tokens must fit max_model_len; unset, it is what is left."""
        room = max_model_len - num_prompt_tokens
        if room < 1:
            raise APIError(
                f"the prompt has {num_prompt_tokens} tokens: this model's maximum context length "
                f"(max_model_len={max_model_len}) leaves no room to generate",
                param="prompt",
            )
        if requested is None:
            default = engine.engine.default_sampling.get("max_tokens")
            return min(room, default) if default else room
        if requested > room:
            raise APIError(
                f"this model's maximum context length is {max_model_len} tokens (max_model_len="
                f"{max_model_len}), but the request asks for {num_prompt_tokens + requested}: "
                f"{num_prompt_tokens} in the prompt and max_tokens={requested}; shorten the prompt or "
                "lower max_tokens",
                param="max_tokens",
            )
        return requested

    async def guided_params(request: p.SamplingRequest) -> GuidedDecodingParams | None:
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
        try:
            await asyncio.to_thread(engine.engine.grammars.compile, guided)
        except ValueError as error:
            raise APIError(str(error), param="response_format") from error
        return guided

    def request_params(
        request: p.SamplingRequest, max_tokens: int | None, logprobs: int | None, guided
    ) -> SamplingParams | BeamSearchParams:
        if not request.use_beam_search:
            return sampling_params(request, max_tokens, logprobs, guided)
        if guided is not None:
            raise APIError("response_format is not supported with use_beam_search", param="response_format")
        return beam_search_params(request, max_tokens or max_model_len, logprobs)

    def sampling_params(
        request: p.SamplingRequest, max_tokens: int | None, logprobs: int | None, guided
    ) -> SamplingParams:
        """The request's SamplingParams; unset sampling fields take the model's defaults."""
        given = {
            name: getattr(request, name) for name in SAMPLING_FIELDS if getattr(request, name) is not None
        }
        defaults = {k: v for k, v in engine.engine.default_sampling.items() if k in SAMPLING_FIELDS}
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
                guided_decoding=guided,
                **(defaults | given),
            )
        except ValueError as error:
            raise APIError(str(error), param=str(error).split(" ", 1)[0]) from error

    async def add_all(
        prefix: str,
        count: int,
        prompts: Callable[[LLMEngine], list[list[int]]],
        max_tokens,
        request,
        logprobs,
        guided,
    ) -> list[RequestStream]:
        """Tokenize, check and add one engine request per prompt in one call on the engine thread, so a
        request joins the very next step; a refusal of any prompt adds none."""

        def prepare(e: LLMEngine) -> list[tuple[list[int], SamplingParams]]:
            items = []
            for ids in prompts(e):
                limit = checked_max_tokens(max_tokens, len(ids))
                items.append((ids, request_params(request, limit, logprobs, guided)))
            return items

        try:
            return await engine.add([f"{prefix}-{i}" for i in range(count)], prepare)
        except ValueError as error:
            raise APIError(str(error), param=_param_of(str(error))) from error

    @app.post("/v1/completions")
    async def completions(request: p.CompletionRequest, raw: Request):
        check_model(request)
        limits.check_n(request.n)
        limits.check_logprobs("logprobs", request.logprobs)
        if request.echo and request.logprobs is not None:
            raise APIError(
                "echo with logprobs needs the prompt's log-probabilities, which pagedllm does not compute",
                param="echo",
            )
        guided = await guided_params(request)
        texts = (
            [request.prompt] if isinstance(request.prompt, str) or _is_ids(request.prompt) else request.prompt
        )
        response_id = p.random_id("cmpl")
        streams = await add_all(
            response_id,
            len(texts),
            lambda e: _tokenized(e, texts),
            request.max_tokens,
            request,
            request.logprobs,
            guided,
        )
        echoes = [_echo_text(engine.engine, t) for t in texts] if request.echo else []
        outputs = merge(streams)
        if request.stream:
            return sse(completion_chunks(request, response_id, outputs, streams, echoes))
        try:
            final = await until_disconnected(raw, finals(outputs, len(texts)))
        finally:
            await _close(outputs, streams)
        tokenizer = engine.engine.tokenizer
        choices = []
        for i, output in enumerate(final):
            for o in output.outputs:
                logprobs = None
                if request.logprobs is not None:
                    logprobs = completion_logprobs(tokenizer, o.token_ids, o.logprobs, request.logprobs)
                text = echoes[i] + o.text if request.echo else o.text
                choices.append(
                    p.CompletionChoice(
                        index=i * request.n + o.index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=o.finish_reason,
                        stop_reason=o.stop_reason,
                    )
                )
        return p.CompletionResponse(id=response_id, model=model_name, choices=choices, usage=usage(final))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: p.ChatCompletionRequest, raw: Request):
        check_model(request)
        limits.check_n(request.n)
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        limits.check_logprobs("top_logprobs", request.top_logprobs)
        num_top = (request.top_logprobs or 0) if request.logprobs else None
        guided = await guided_params(request)
        messages = [m.model_dump() for m in request.messages]
        response_id = p.random_id("chatcmpl")
        max_tokens = request.max_completion_tokens or request.max_tokens
        prompt = lambda e: [chat_prompt(e, messages, request.add_generation_prompt)]  # noqa: E731
        streams = await add_all(response_id, 1, prompt, max_tokens, request, num_top, guided)
        outputs = merge(streams)
        if request.stream:
            return sse(chat_chunks(request, response_id, outputs, streams, num_top))
        try:
            (final,) = await until_disconnected(raw, finals(outputs, 1))
        finally:
            await _close(outputs, streams)
        tokenizer = engine.engine.tokenizer
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
            id=response_id, model=model_name, choices=choices, usage=usage([final])
        )

    async def completion_chunks(request: p.CompletionRequest, response_id: str, outputs, streams, echoes):
        tokenizer, offsets = engine.engine.tokenizer, {}
        last: dict[int, RequestOutput] = {}
        try:
            async for d in deltas(_remember(outputs, last), request.n, request.stop):
                text = (echoes[d.index // request.n] if request.echo and d.first else "") + d.text
                logprobs = None
                if request.logprobs is not None:
                    new = slice(d.token_start, None)
                    logprobs = completion_logprobs(
                        tokenizer,
                        d.output.token_ids[new],
                        d.output.logprobs[new],
                        request.logprobs,
                        offsets.get(d.index, 0),
                    )
                offsets[d.index] = offsets.get(d.index, 0) + len(text)
                choice = p.CompletionChoice(
                    index=d.index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=d.output.finish_reason,
                    stop_reason=d.output.stop_reason,
                )
                yield p.CompletionResponse(id=response_id, model=model_name, choices=[choice])
            if request.stream_options and request.stream_options.include_usage:
                final = [last[i] for i in sorted(last)]
                yield p.CompletionResponse(id=response_id, model=model_name, choices=[], usage=usage(final))
        finally:
            await _close(outputs, streams)

    async def chat_chunks(request: p.ChatCompletionRequest, response_id: str, outputs, streams, num_top):
        tokenizer = engine.engine.tokenizer
        last: dict[int, RequestOutput] = {}
        try:
            async for d in deltas(_remember(outputs, last), request.n, request.stop):
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
                yield p.ChatCompletionChunk(id=response_id, model=model_name, choices=[choice])
            if request.stream_options and request.stream_options.include_usage:
                usage_info = usage([last[0]])
                yield p.ChatCompletionChunk(id=response_id, model=model_name, choices=[], usage=usage_info)
        finally:
            await _close(outputs, streams)

    return app


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


async def _remember(outputs, last: dict[int, RequestOutput]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """`outputs`, keeping each prompt's latest output in `last` (for the usage chunk)."""
    async for i, output in outputs:
        last[i] = output
        yield i, output


async def _close(outputs, streams: list[RequestStream]) -> None:
    await outputs.aclose()
    for stream in streams:
        await stream.aclose()


def _is_ids(prompt) -> bool:
    return isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int))


def _param_of(message: str) -> str:
    """The field an engine error names (its first word, e.g. 'stop_token_ids ...'), else the prompt."""
    first = message.split(" ", 1)[0]
    return first if first in p.CompletionRequest.model_fields else "prompt"


def _tokenized(engine: LLMEngine, prompts: list) -> list[list[int]]:
    """Token ids of each prompt: text through the tokenizer (with its special tokens, as the engine does)."""
    if engine.tokenizer is None and any(isinstance(prompt, str) for prompt in prompts):
        raise APIError(f"model {engine.config.model!r} has no tokenizer: send token ids", param="prompt")
    return [
        engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt) for prompt in prompts
    ]


def _echo_text(engine: LLMEngine, prompt: str | list[int]) -> str:
    if isinstance(prompt, str):
        return prompt
    return engine.tokenizer.decode(prompt) if engine.tokenizer is not None else ""


def chat_prompt(engine: LLMEngine, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """The conversation through the tokenizer's chat template (runs on the engine thread)."""
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


def usage(outputs: list[RequestOutput]) -> p.UsageInfo:
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
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
    limits: ServerLimits | None = None,
    shutdown_timeout: float = 30.0,
    **engine_kwargs,
) -> int:
    """Serve `model` with uvicorn until SIGINT/SIGTERM: then admit nothing new, let running requests
    finish for up to `shutdown_timeout` seconds, abort the rest, free every KV block and return 0."""
    app = build_app(model, served_model_name, limits, **engine_kwargs)
    # uvicorn's own timeout is the backstop: at shutdown_timeout the engine aborts what still runs, so
    # each stream ends with an error event and each connection closes cleanly before uvicorn would cut it.
    config = uvicorn.Config(
        app, host=host, port=port, log_level="info", timeout_graceful_shutdown=shutdown_timeout + 10
    )
    DrainingServer(config, app.state.admission, app.state.engine, shutdown_timeout).run()
    return 0 if app.state.engine.engine.stats().kv_all_free else 1


class DrainingServer(uvicorn.Server):
    """uvicorn's Server, but a shutdown signal first makes the app refuse new /v1 requests (503), and
    `shutdown_timeout` seconds later the engine aborts the requests still running."""

    def __init__(
        self, config: uvicorn.Config, admission: Admission, engine: AsyncEngine, shutdown_timeout: float
    ):
        super().__init__(config)
        self.admission, self.engine, self.shutdown_timeout = admission, engine, shutdown_timeout

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """SIGINT/SIGTERM start the graceful shutdown; unlike uvicorn's own, the signal is not raised
        again once it is done, so a server that drained cleanly exits 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig, frame) -> None:
        if not self.admission.draining:
            logger.info(
                "shutting down: admitting no new requests, giving running ones %gs to finish",
                self.shutdown_timeout,
            )
            timer = threading.Timer(self.shutdown_timeout, self._abort_running)
            timer.daemon = True
            timer.start()
        self.admission.draining = True
        super().handle_exit(sig, frame)

    def _abort_running(self) -> None:
        if self.engine.engine.has_unfinished_requests():
            logger.warning(
                "shutdown timeout (%gs) reached: aborting the running requests", self.shutdown_timeout
            )
        self.engine.abort_all(ShuttingDown(f"the server shut down: aborted after {self.shutdown_timeout:g}s"))
