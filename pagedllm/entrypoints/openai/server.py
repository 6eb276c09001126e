"""The FastAPI app: OpenAI's routes wired to their handlers (serving_*.py) over one AsyncEngine, and
`main`, which serves it with uvicorn and drains on SIGINT/SIGTERM."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from pagedllm import __version__
from pagedllm._runtime import usable_cpus
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.parallel.executor import WorkerFailure
from pagedllm.entrypoints.openai import dashboard
from pagedllm.entrypoints.openai import protocol as p
from pagedllm.entrypoints.openai.async_engine import AsyncEngine
from pagedllm.entrypoints.openai.errors import ShuttingDown, error_response, install_error_handlers
from pagedllm.entrypoints.openai.limits import Admission, LimitsMiddleware, ServerLimits
from pagedllm.entrypoints.openai.reasoning import check_parser_name
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_messages import messages_routes
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels, lora_routes
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses, ResponseStore
from pagedllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagedllm.models.loader import DEFAULT_MODEL

logger = logging.getLogger(__name__)

TOKENS_PER_CPU = 256  # the server's step budget on the CPU grows with the CPUs, between these two:
MIN_CPU_BATCHED_TOKENS, MAX_CPU_BATCHED_TOKENS = 512, 2048  # 2048: vLLM's server default on the CPU


def server_cpu_batched_tokens(cpus: int | None = None) -> int:
    """The server's max_num_batched_tokens on the CPU: TOKENS_PER_CPU a usable CPU, within the bounds.

    A step's prefill chunk stalls every running stream and holds back the next prompts' first tokens, so
    it is sized to take about the same time on any CPU rather than vLLM's flat 2048 (its value for GPUs,
    where a chunk that long is still a short step). A smaller chunk costs a little throughput (more steps,
    each reading all the weights again) for earlier first tokens and steadier streams when prompts arrive
    together; docs/BENCHMARKS.md (Serving) has the measurements.
    """
    cpus = usable_cpus() if cpus is None else cpus
    return min(MAX_CPU_BATCHED_TOKENS, max(MIN_CPU_BATCHED_TOKENS, TOKENS_PER_CPU * cpus))


@dataclass
class Serving:
    """One engine and its OpenAI handlers: what the routes call, in this process or in a replica."""

    engine: AsyncEngine
    models: OpenAIServingModels
    completion: OpenAIServingCompletion
    chat: OpenAIServingChat
    tokenization: OpenAIServingTokenization

    async def completions(self, request: p.CompletionRequest, raw_request: Request | None = None):
        return await self.completion.create_completion(request, raw_request)

    async def chat_completions(self, request: p.ChatCompletionRequest, raw_request: Request | None = None):
        return await self.chat.create_chat_completion(request, raw_request)

    async def tokenize(self, request: p.TokenizeRequest) -> p.TokenizeResponse:
        return await self.tokenization.tokenize(request)

    async def detokenize(self, request: p.DetokenizeRequest) -> p.DetokenizeResponse:
        return await self.tokenization.detokenize(request)

    async def show_models(self) -> p.ModelList:
        return self.models.show_available_models()


def build_serving(
    model: str = DEFAULT_MODEL,
    served_model_name: str | None = None,
    limits: ServerLimits | None = None,
    lora_modules: dict[str, str] | None = None,
    reasoning_parser: str | None = None,
    **engine_kwargs,
) -> Serving:
    """An engine serving `model` and its handlers (the engine thread not yet started); engine_kwargs are
    EngineConfig fields (kv_cache_memory, max_model_len, ...). max_num_batched_tokens None or absent:
    server_cpu_batched_tokens() on the CPU with chunked prefill on, else EngineConfig's default.
    lora_modules: LoRA adapters served by name (name -> folder; needs enable_lora); reasoning_parser:
    vLLM's --reasoning-parser (reasoning.py)."""
    if lora_modules and not engine_kwargs.get("enable_lora"):
        raise ValueError(f"lora_modules {sorted(lora_modules)} need enable_lora=True (--enable-lora)")
    check_parser_name(reasoning_parser)  # before the model loads
    if engine_kwargs.get("max_num_batched_tokens") is None:
        engine_kwargs.pop("max_num_batched_tokens", None)
        if engine_kwargs.get("device", "cpu") == "cpu" and engine_kwargs.get("enable_chunked_prefill", True):
            engine_kwargs["max_num_batched_tokens"] = server_cpu_batched_tokens()
    llm_engine = LLMEngine(EngineConfig(model=model, **engine_kwargs))
    limits = limits or ServerLimits()
    serving_models = OpenAIServingModels(
        served_model_name or model, llm_engine.max_model_len, model, lora_modules
    )
    for lora in serving_models.adapters.values():  # a bad adapter stops the start, as in vLLM
        llm_engine.add_lora(lora)
    engine = AsyncEngine(llm_engine)  # from here on, the engine is touched on its own thread only
    return Serving(
        engine,
        serving_models,
        OpenAIServingCompletion(engine, serving_models, limits),
        OpenAIServingChat(engine, serving_models, limits, reasoning_parser=reasoning_parser),
        OpenAIServingTokenization(engine, serving_models, limits),
    )


def openai_routes(serving: Serving) -> APIRouter:
    """The OpenAI and vLLM routes over `serving` (a Serving, or anything with its five methods, such as
    the replicas' ingress)."""
    routes = APIRouter()

    @routes.get("/version")
    async def version() -> p.VersionResponse:
        return p.VersionResponse(version=__version__)

    @routes.get("/v1/models")
    async def models() -> p.ModelList:
        return await serving.show_models()

    @routes.post("/tokenize")
    async def tokenize(request: p.TokenizeRequest) -> p.TokenizeResponse:
        return await serving.tokenize(request)

    @routes.post("/detokenize")
    async def detokenize(request: p.DetokenizeRequest) -> p.DetokenizeResponse:
        return await serving.detokenize(request)

    @routes.post("/v1/completions")
    async def completions(request: p.CompletionRequest, raw_request: Request):
        return _respond(await serving.completions(request, raw_request))

    @routes.post("/v1/chat/completions")
    async def chat_completions(request: p.ChatCompletionRequest, raw_request: Request):
        return _respond(await serving.chat_completions(request, raw_request))

    async def model_name() -> str:
        return (await serving.show_models()).data[0].id

    responses = OpenAIServingResponses(serving.chat_completions, model_name, ResponseStore())

    @routes.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw_request: Request):
        return _respond(await responses.create_response(request, raw_request))

    @routes.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        return responses.retrieve(response_id)

    routes.include_router(messages_routes(serving))  # Anthropic's, through chat_completions and tokenize
    return routes


def build_app(
    model: str = DEFAULT_MODEL,
    served_model_name: str | None = None,
    limits: ServerLimits | None = None,
    **engine_kwargs,
) -> FastAPI:
    """An app serving `model` in this process; the arguments are build_serving's."""
    limits = limits or ServerLimits()
    serving = build_serving(model, served_model_name, limits, **engine_kwargs)
    engine = serving.engine

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        app.state.final_stats = engine.stop()

    app = FastAPI(title="pagedllm", lifespan=lifespan)
    app.state.engine = engine
    app.state.admission = Admission()
    app.add_middleware(LimitsMiddleware, limits=limits, admission=app.state.admission)
    install_error_handlers(app)
    app.include_router(dashboard.router(engine))  # GET /dashboard and GET /v1/kv
    app.include_router(openai_routes(serving))
    app.include_router(lora_routes(serving.models, engine))  # POST /v1/load_lora_adapter, unload

    @app.exception_handler(WorkerFailure)  # a tensor-parallel rank died or hung: no step can run
    async def engine_failed(request: Request, error: WorkerFailure) -> Response:
        return error_response(str(error), 503)

    @app.get("/health")
    async def health() -> Response:
        failure = engine.failure
        if failure is not None:
            return error_response(failure, 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=PROMETHEUS_TEXT)

    return app


PROMETHEUS_TEXT = "text/plain; version=0.0.4"


def _respond(result: BaseModel | AsyncIterator[str]) -> BaseModel | StreamingResponse:
    """A handler's whole response as JSON, or its server-sent events as they come."""
    if isinstance(result, BaseModel):
        return result
    return StreamingResponse(result, media_type="text/event-stream")


def main(
    model: str = DEFAULT_MODEL,
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
    return 0 if app.state.final_stats.kv_all_free else 1


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
        if self.engine.has_open_streams:
            logger.warning(
                "shutdown timeout (%gs) reached: aborting the running requests", self.shutdown_timeout
            )
        self.engine.abort_all(ShuttingDown(f"the server shut down: aborted after {self.shutdown_timeout:g}s"))
