"""N engine replicas as Ray Serve deployments behind one OpenAI-compatible endpoint (data parallelism).

Shaped like Ray Serve LLM: an `Ingress` deployment (the FastAPI app: the same OpenAI routes as one
server, the API key and limits) calls the `EngineReplica` deployment through a DeploymentHandle; each
replica runs its own engine and the OpenAI handlers of `server.Serving`, and streams back either the
response object or its server-sent events. Ray places the replicas (each with `num_cpus` CPUs, on this
machine or any node of a Ray cluster), restarts one that dies, and routes each request with the
deployment's request router: by default `KVCacheAwareRouter` (kv_routing.py), which sends a request to
the replica whose prefix cache holds most of its prompt, as the replicas' KV cache events tell, unless
that replica is much busier; or Ray's own `PrefixCacheAffinityRouter` (the prompt text each replica was
sent). Every call carries a `RoutingKey` first: the prompt as text and its block hashes.

What the ingress adds to Ray: a request whose replica died before it sent anything back is retried on
another replica; a stream cut by a dying replica ends with an error event; /health, /metrics and /v1/kv
answer for every replica (Ray's `DeploymentHandle.broadcast`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from pagedllm.engine.config import EngineConfig
from pagedllm.entrypoints.openai import protocol as p
from pagedllm.entrypoints.openai.dashboard import kv_payload
from pagedllm.entrypoints.openai.errors import APIError, error_body, error_response, install_error_handlers
from pagedllm.entrypoints.openai.kv_routing import KVEventPublisher, PromptBlocks, RoutingKey
from pagedllm.entrypoints.openai.limits import Admission, LimitsMiddleware, ServerLimits
from pagedllm.entrypoints.openai.server import PROMETHEUS_TEXT, build_serving, openai_routes
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.entrypoints.openai.streams import until_disconnected
from pagedllm.models.loader import DEFAULT_MODEL

logger = logging.getLogger(__name__)

# Ray's PrefixCacheAffinityRouter by its defining module: the public ray.serve.llm.request_router also
# imports the KV-aware router, whose configuration module refuses to load without vLLM or SGLang.
PREFIX_ROUTER = "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router"
ROUTERS = {
    "kv": "pagedllm.entrypoints.openai.kv_routing.KVCacheAwareRouter",  # the replicas' KV cache events
    "prefix": f"{PREFIX_ROUTER}.PrefixCacheAffinityRouter",  # Ray's prefix-cache affinity
    "pow2": None,  # Serve's default: the less loaded of two random replicas
    "round-robin": f"{__name__}.RoundRobinRouter",  # the baseline a cache-blind balancer gives
}
QUEUE_LENGTH_DEADLINES = {
    "RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "1.0",
    "RAY_SERVE_MAX_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "5.0",
}
MAX_ATTEMPTS = 3  # replicas a request may be sent to when each dies before answering


def prompt_text(route: str, request: BaseModel | None) -> str:
    """The request's prompt as text (chat: its tools and messages as JSON, in the order the chat template
    renders them; token ids as digits); a request without one is keyed by its route."""
    text = ""
    if isinstance(request, p.ChatCompletionRequest | p.TokenizeRequest) and request.messages is not None:
        tools = [t.model_dump(exclude_none=True) for t in request.tools or []]
        text = json.dumps([tools, [m.model_dump(exclude_none=True) for m in request.messages]])
    elif getattr(request, "prompt", None) is not None:
        text = request.prompt if isinstance(request.prompt, str) else json.dumps(request.prompt)
    return text or route


class RoundRobinRouter(RequestRouter):
    """Each request to the next replica in turn, blind to caches and load: the baseline routing."""

    def initialize_state(self) -> None:
        self._turn = 0

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        self._turn += 1
        return [[ordered[self._turn % len(ordered)]]] if ordered else []


# -- the engine replica -------------------------------------------------------------------------------


class EngineReplica:
    """One engine and its OpenAI handlers in a Ray Serve replica (made a deployment by `build_replicas`)."""

    def __init__(
        self,
        model: str,
        served_model_name: str | None,
        limits: ServerLimits,
        num_cpus: int,
        kv_events: bool,
        **kw,
    ):
        import torch

        torch.set_num_threads(num_cpus)  # Ray reserved num_cpus CPUs for this replica: its matmuls use them
        self.serving = build_serving(model, served_model_name, limits, **kw)
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.publisher = None  # the KV cache events, for KVCacheAwareRouter
        if kv_events:
            log = self.serving.engine.enable_kv_events()
            self.publisher = KVEventPublisher(log, self.replica_id, context.app_name)
        self.serving.engine.start()
        logger.info("replica %s (pid %d) serves %s on %d CPUs", self.replica_id, os.getpid(), model, num_cpus)

    async def call(self, key: RoutingKey, route: str, request: BaseModel | None) -> AsyncIterator:
        """Serving.<route>(request): its response object, or its server-sent events one by one. Cancelled
        (the client went away), the request is aborted and its KV blocks are freed."""
        result = await (getattr(self.serving, route)(request) if request else getattr(self.serving, route)())
        if isinstance(result, BaseModel):
            yield result
            return
        try:
            async for event in result:
                yield event
        finally:
            await result.aclose()

    async def replica_stats(self, kv: bool = False) -> dict:
        """This replica's id, pid, Prometheus text and KV pool state (with the full snapshot if `kv`)."""
        engine = self.serving.engine

        def read(llm_engine) -> dict:
            stats = llm_engine.stats()
            found = {
                "replica": self.replica_id,
                "pid": os.getpid(),
                "node": ray.get_runtime_context().get_node_id(),
                "kv_all_free": stats.kv_all_free,
                "num_running": stats.num_running,
                "num_waiting": stats.num_waiting + stats.num_swapped,
                "metrics": engine.metrics.render().decode(),
            }
            if kv:
                found["kv"] = kv_payload(llm_engine, engine.metrics)
            return found

        return await engine.run(read)

    def check_health(self) -> None:
        """Ray's health check: a failed engine (a dead tensor-parallel rank) makes Ray replace the replica."""
        failure = self.serving.engine.failure
        if failure is not None:
            raise RuntimeError(failure)

    def __del__(self) -> None:  # Ray Serve's graceful shutdown of the replica
        if getattr(self, "publisher", None) is not None:
            self.publisher.stop()
        engine = getattr(getattr(self, "serving", None), "engine", None)
        if engine is not None:
            engine.stop()


# -- the ingress ----------------------------------------------------------------------------------------


class ReplicaFailure(APIError):
    def __init__(self, message: str):
        super().__init__(message, status=503)


class ReplicaClient:
    """server.Serving's five methods, each a call to an engine replica chosen by the request router."""

    def __init__(self, engines: DeploymentHandle, blocks: PromptBlocks | None = None):
        self.engines = engines.options(stream=True)
        self.blocks = blocks  # the prompt's block hashes, for a router that reads them
        self.failures = self.retries = 0  # calls a dead replica failed; of those, sent again elsewhere

    async def completions(self, request: p.CompletionRequest, raw_request: Request | None = None):
        return await self._call("completions", request, raw_request)

    async def chat_completions(self, request: p.ChatCompletionRequest, raw_request: Request | None = None):
        return await self._call("chat_completions", request, raw_request)

    async def tokenize(self, request: p.TokenizeRequest) -> p.TokenizeResponse:
        return await self._call("tokenize", request)

    async def detokenize(self, request: p.DetokenizeRequest) -> p.DetokenizeResponse:
        return await self._call("detokenize", request)

    async def show_models(self) -> p.ModelList:
        return await self._call("show_models", None)

    async def _call(self, route: str, request: BaseModel | None, raw_request: Request | None = None):
        """The replica's response object, or an SSE stream; a replica that dies before its first item is
        replaced by another (nothing was sent to the client yet), up to MAX_ATTEMPTS replicas."""
        text = prompt_text(route, request)
        key = self.blocks.key(text, request) if self.blocks is not None else RoutingKey(text)
        for attempt in range(1, MAX_ATTEMPTS + 1):
            events = self.engines.call.remote(key, route, request)
            try:
                first = events.__anext__()
                item = await (first if raw_request is None else until_disconnected(raw_request, first))
            except asyncio.CancelledError:  # the client went away: the replica aborts the request
                events.cancel()
                raise
            except RayActorError as error:
                self.failures += 1
                if attempt == MAX_ATTEMPTS:
                    raise ReplicaFailure(f"{attempt} replicas died serving this request: {error}") from error
                self.retries += 1
                logger.warning("a replica died before answering (%s); sending the request to another", error)
                continue
            except RayTaskError as error:  # the handler's own error (an APIError: 4xx naming the field)
                raise _cause(error) from None
            if isinstance(item, BaseModel):
                events.cancel()
                return item
            return self._stream(item, events)
        raise AssertionError("unreachable")

    async def _stream(self, first: str, events) -> AsyncIterator[str]:
        """The events after `first`; a replica that dies mid-stream ends it with an error event."""
        try:
            yield first
            async for event in events:
                yield event
        except RayActorError as error:
            self.failures += 1
            message = f"the replica serving this stream died; the response is incomplete: {error}"
            yield f"data: {json.dumps(error_body(message, 503))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            events.cancel()  # a client that left: the replica aborts the request


def _cause(error: RayTaskError) -> Exception:
    cause = error.cause
    return cause if isinstance(cause, Exception) else RuntimeError(str(error))


def build_ingress_app(
    engines: DeploymentHandle, limits: ServerLimits, app_name: str, blocks: PromptBlocks | None = None
) -> FastAPI:
    """The one endpoint in front of the replicas: OpenAI routes, limits, and every replica's state."""
    client = ReplicaClient(engines, blocks)
    app = FastAPI(title="pagedllm (replicas)")
    app.add_middleware(LimitsMiddleware, limits=limits, admission=Admission())
    install_error_handlers(app)
    app.include_router(openai_routes(client))

    async def replicas(kv: bool = False) -> list[dict]:
        return await engines.broadcast("replica_stats", kv=kv).results_async(timeout_s=30)

    async def deployment():
        """What Ray's controller says of the replicas (a blocking call: off the event loop, which serves
        every stream of the endpoint)."""
        status = await asyncio.to_thread(serve.status)
        return status.applications[app_name].deployments["EngineReplica"]

    def by_state(target) -> dict[str, int]:
        return {str(state): count for state, count in target.replica_states.items()}

    @app.get("/health")
    async def health() -> Response:
        """200 while every replica Ray should run is running; else 503 saying what Ray sees."""
        target = await deployment()
        found = by_state(target)
        if found.get("RUNNING", 0) and not set(found) - {"RUNNING"}:
            return Response(status_code=200)
        return error_response(f"replicas by state: {found} ({target.message or target.status})", 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        """Every replica's own metrics, labelled `replica`, and the ingress's count of replica failures."""
        found = await replicas()
        lines = [_labelled(r["metrics"], r["replica"]) for r in found]
        lines.append(_ingress_metrics(client, by_state(await deployment()), found))
        return Response(_merge_families(lines), media_type=PROMETHEUS_TEXT)

    @app.get("/v1/kv")
    async def kv() -> JSONResponse:
        """Each replica's KV snapshot (GET /v1/kv of one server), under its replica id."""
        found = await replicas(kv=True)
        return JSONResponse({"replicas": [{k: v for k, v in r.items() if k != "metrics"} for r in found]})

    return app


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (.*)$")


def _labelled(text: str, replica: str) -> str:
    """A replica's Prometheus text with `replica="id"` added to every sample."""
    out = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            out.append(line)
            continue
        name, labels, value = match.groups()
        inner = labels[1:-1] if labels else ""
        out.append(f'{name}{{replica="{replica}"{"," + inner if inner else ""}}} {value}')
    return "\n".join(out)


def _ingress_metrics(client: ReplicaClient, found_states: dict[str, int], found: list[dict]) -> str:
    lines = [
        "# HELP pagedllm:replicas Engine replicas by the state Ray Serve reports",
        "# TYPE pagedllm:replicas gauge",
        *(f'pagedllm:replicas{{state="{state}"}} {count}' for state, count in sorted(found_states.items())),
        "# HELP pagedllm:replica_failures_total Requests a dying replica failed (then retried, or a 503)",
        "# TYPE pagedllm:replica_failures_total counter",
        f"pagedllm:replica_failures_total {client.failures}",
        "# HELP pagedllm:replica_retries_total Requests sent again to another replica after one died",
        "# TYPE pagedllm:replica_retries_total counter",
        f"pagedllm:replica_retries_total {client.retries}",
        "# HELP pagedllm:kv_cache_all_free 1 where a replica's KV blocks are all in the free pool",
        "# TYPE pagedllm:kv_cache_all_free gauge",
        *(f'pagedllm:kv_cache_all_free{{replica="{r["replica"]}"}} {int(r["kv_all_free"])}' for r in found),
    ]
    return "\n".join(lines)


def _merge_families(texts: list[str]) -> str:
    """Prometheus texts joined with each metric's HELP and TYPE once, its samples together."""
    order: list[str] = []
    heads: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    family = ""
    for text in texts:
        for line in text.splitlines():
            if line.startswith("# "):
                family = line.split(" ", 3)[2]
                if family not in heads:
                    order.append(family)
                    heads[family], samples[family] = [], []
                if len(heads[family]) < 2:
                    heads[family].append(line)
            elif line:
                samples[family].append(line)
    return "".join("\n".join(heads[f] + samples[f]) + "\n" for f in order)


@dataclass(frozen=True)
class HashedPrompts:
    """What the ingress needs to hash prompts as the replicas' engines do: the model, the block size the
    engines resolve, and the LoRA adapters they serve by name (--lora-modules)."""

    model: str
    served_model_name: str
    block_size: int
    lora_modules: dict[str, str] | None = None


@serve.ingress()
class Ingress:
    """The HTTP endpoint (one replica unless told otherwise); the app is built in the replica."""

    def __init__(
        self, engines: DeploymentHandle, limits: ServerLimits, app_name: str, hashed: HashedPrompts | None
    ):
        """`hashed`: what the prompts' block hashes need, when the router reads them."""
        self.engines, self.limits, self.app_name = engines, limits, app_name
        self.blocks = None
        if hashed is not None:
            from pagedllm.models.loader import resolve_checkpoint
            from pagedllm.models.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(resolve_checkpoint(hashed.model))
            # the replicas' adapter names and ids, numbered as each replica's build_serving numbers them
            models = OpenAIServingModels(hashed.served_model_name, 0, lora_modules=hashed.lora_modules)
            self.blocks = PromptBlocks(tokenizer, hashed.model, hashed.block_size, models)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_ingress_app(self.engines, self.limits, self.app_name, self.blocks)


# -- building and running -----------------------------------------------------------------------------


@dataclass
class ReplicaSettings:
    """How many replicas, their CPUs, and how requests are routed to them."""

    num_replicas: int = 2
    cpus_per_replica: int = 1
    routing: str = "kv"
    imbalanced_threshold: float = 4  # prefix routing: queue-length gap beyond which load wins over cache
    load_tokens: float = 64  # kv routing: uncached prompt tokens one more request in flight is worth
    app_name: str = "pagedllm"

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.num_replicas!r}")
        if self.cpus_per_replica < 1:
            raise ValueError(f"cpus_per_replica must be >= 1, got {self.cpus_per_replica!r}")
        if self.routing not in ROUTERS:
            raise ValueError(f"routing must be one of {sorted(ROUTERS)}, got {self.routing!r}")

    def router_config(self) -> RequestRouterConfig:
        if ROUTERS[self.routing] is None:
            return RequestRouterConfig()
        kwargs = {
            "prefix": {"imbalanced_threshold": self.imbalanced_threshold},
            "kv": {"load_tokens": self.load_tokens},
        }.get(self.routing, {})
        return RequestRouterConfig(request_router_class=ROUTERS[self.routing], request_router_kwargs=kwargs)


def build_replicas(
    model: str = DEFAULT_MODEL,
    settings: ReplicaSettings | None = None,
    served_model_name: str | None = None,
    limits: ServerLimits | None = None,
    shutdown_timeout: float = 30.0,
    **engine_kwargs,
) -> serve.Application:
    """The Serve application: `settings.num_replicas` engines behind one ingress; run it with
    `serve.run(app, name=settings.app_name, route_prefix="/")`. engine_kwargs are EngineConfig fields."""
    settings = settings or ReplicaSettings()
    limits = limits or ServerLimits()
    kv_events = settings.routing == "kv"  # the replicas publish them, the ingress hashes the prompts
    if kv_events and (
        engine_kwargs.get("kv_layout") == "contiguous" or not engine_kwargs.get("enable_prefix_caching", True)
    ):
        raise ValueError(
            "routing 'kv' reads the replicas' prefix caches: it needs kv_layout='paged' and prefix caching"
        )
    engines = serve.deployment(
        EngineReplica,
        num_replicas=settings.num_replicas,
        ray_actor_options={"num_cpus": settings.cpus_per_replica},
        # the engine batches what it runs; more requests wait in Ray, where a dead replica cannot lose them
        max_ongoing_requests=engine_kwargs.get("max_num_seqs") or 256,
        request_router_config=settings.router_config(),
        graceful_shutdown_timeout_s=shutdown_timeout,
        health_check_period_s=2,
    ).bind(
        model, served_model_name, limits, settings.cpus_per_replica, settings.routing == "kv", **engine_kwargs
    )
    ingress = serve.deployment(
        Ingress,
        ray_actor_options={"num_cpus": 0},  # it forwards bytes; the CPUs are the engines'
        max_ongoing_requests=limits.max_concurrent_requests,
        graceful_shutdown_timeout_s=shutdown_timeout,
    )
    # the block size the replicas' engines resolve (the server fills a None max_num_batched_tokens later)
    lora_modules = engine_kwargs.get("lora_modules")
    settled = {k: v for k, v in engine_kwargs.items() if v is not None and k != "lora_modules"}
    hashed = None
    if kv_events:
        block_size = EngineConfig(model, **settled).block_size
        hashed = HashedPrompts(model, served_model_name or model, block_size, lora_modules)
    return ingress.bind(engines, limits, settings.app_name, hashed)


def main(
    model: str = DEFAULT_MODEL,
    host: str = "127.0.0.1",
    port: int = 8000,
    settings: ReplicaSettings | None = None,
    address: str | None = None,
    served_model_name: str | None = None,
    limits: ServerLimits | None = None,
    shutdown_timeout: float = 30.0,
    **engine_kwargs,
) -> int:
    """Serve the replicas on http://host:port until SIGINT/SIGTERM, on a Ray cluster of this machine's
    CPUs or the one at `address` (`ray start --head`); then let running requests finish for up to
    `shutdown_timeout` seconds, stop Serve (and the cluster it started) and return 0 if every
    replica's KV blocks were all free."""
    settings = settings or ReplicaSettings()
    # workers import the same pagedllm as this process, wherever it was installed from
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    # Routers ask each replica its queue length within 0.1 s by default; a replica whose engine thread
    # holds the CPU through a step misses that often, and the request then waits in backoff.
    env |= {name: os.environ.get(name, value) for name, value in QUEUE_LENGTH_DEADLINES.items()}
    runtime_env = {"env_vars": env}
    if address is None:
        _start_local_ray(settings.num_replicas * settings.cpus_per_replica, runtime_env)
    else:
        ray.init(address=address, runtime_env=runtime_env)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs handlers of its own
        signal.signal(sig, lambda *_: stop.set())
    all_free = False
    try:
        serve.start(http_options={"host": host, "port": port})
        app = build_replicas(model, settings, served_model_name, limits, shutdown_timeout, **engine_kwargs)
        serve.run(app, name=settings.app_name, route_prefix="/")
        logger.info("serving %d replicas of %s on http://%s:%d", settings.num_replicas, model, host, port)
        stop.wait()
        all_free = _drain(serve.get_deployment_handle("EngineReplica", settings.app_name), shutdown_timeout)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0 if all_free else 1


def _start_local_ray(cpus: int, runtime_env: dict) -> None:
    """A Ray node of `cpus` CPUs on this machine, started once more if it did not come up the first time
    (on a loaded machine Ray's agent can miss the raylet's deadline for its port; Ray gives up then)."""
    os.environ.setdefault("RAY_agent_register_timeout_ms", "300000")
    os.environ.setdefault("RAY_raylet_start_wait_time_s", "300")
    for attempt in (1, 2):
        try:
            # address "local": a new node even where `ray start` left a cluster that ray.init would join
            ray.init(address="local", num_cpus=cpus, include_dashboard=False, runtime_env=runtime_env)
            return
        except Exception as error:  # Ray raises a bare Exception when its node does not start
            if attempt == 2 or "timed out during startup" not in str(error):
                raise
            logger.warning("the local Ray node did not start (%s); starting it once more", error)
            ray.shutdown()


def _drain(engines: DeploymentHandle, timeout: float) -> bool:
    """Wait up to `timeout` s for the replicas to finish what runs; whether every KV block is then free."""
    deadline = time.monotonic() + timeout
    while True:
        found = engines.broadcast("replica_stats").results(timeout_s=30)
        busy = sum(r["num_running"] + r["num_waiting"] for r in found)
        if not busy or time.monotonic() > deadline:
            for r in found:
                level = logging.INFO if r["kv_all_free"] else logging.ERROR
                logger.log(level, "replica %s: KV blocks all free: %s", r["replica"], r["kv_all_free"])
            return all(r["kv_all_free"] for r in found)
        time.sleep(0.5)
