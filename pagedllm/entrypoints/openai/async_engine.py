"""AsyncEngine: one thread owns the LLMEngine and steps it; asyncio callers get each request's outputs.

The engine thread is where the compute happens, so the event loop's share of the machine is kept small:
after each step, all of that step's outputs cross to the event loop in one call (one wake-up per step,
not one per request).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pagedllm._runtime import release_openmp_threads
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.stats import EngineStats
from pagedllm.entrypoints.openai.errors import APIError, EngineDead, ShuttingDown
from pagedllm.entrypoints.openai.metrics import EngineMetrics, RequestTimes
from pagedllm.kv.events import KVEventLog
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    """Where one request's outputs go: an asyncio.Queue on the caller's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    times: RequestTimes
    num_generated: int = 0
    prefilled: bool = False  # its first output came: its prompt tokens are counted


class RequestStream:
    """A request's outputs, in order, until it finishes. `aclose()` aborts it if it is still running, so
    its KV blocks go back to the pool; every caller closes its streams when done or gone."""

    def __init__(self, engine: AsyncEngine, request_id: str, stream: _Stream):
        self.engine, self.request_id, self._stream = engine, request_id, stream
        self._finished = self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._finished:
            raise StopAsyncIteration
        item = await self._stream.queue.get()
        if isinstance(item, APIError):
            self._finished = True
            raise item
        if isinstance(item, BaseException):  # the engine failed it: a 500 (a 503 if no step can run now)
            self._finished = True
            status = 503 if self.engine.step_failure is not None else 500
            raise APIError(f"the engine failed the request: {type(item).__name__}: {item}", status) from item
        self._finished = item.finished
        return item

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self.engine.abort(self.request_id)


class AsyncEngine:
    """Every touch of the engine (add, abort, tokenizer, step) runs on the engine thread, in order."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.metrics = EngineMetrics()
        self.metrics.observe(engine)  # the KV pool's size from the first scrape (no engine thread yet)
        self._calls: list[Callable[[], None]] = []
        self._wakeup = threading.Condition()
        self._streams: dict[str, _Stream] = {}
        self._stopped = False
        self.death: str | None = None  # why the engine thread stopped stepping, if it died
        self._pending: set[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = set()  # run() calls waiting
        self._thread = threading.Thread(target=self._loop, name="pagedllm-engine", daemon=True)
        # Fixed at start-up, so read on any thread: what the routes need to render and check requests.
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.default_sampling = engine.default_sampling  # from generation_config.json
        self.num_kv_blocks = engine.num_kv_blocks

    @property
    def step_failure(self) -> str | None:
        """Why the engine can run no step (a tensor-parallel rank failed), or None; the engine thread's own
        death aside (its waiting requests get a 500, new ones a 503)."""
        return self.engine.failure

    @property
    def failure(self) -> str | None:
        """Why no request can be served now (the engine thread died, a tensor-parallel rank failed), or
        None while healthy."""
        return self.death or self.engine.failure

    def compile_grammar(self, guided) -> None:
        """Compile a guided-decoding spec (a bad one raises ValueError); thread-safe, cached."""
        self.engine.grammars.compile(guided)

    def start(self) -> None:
        """Start stepping on the engine thread; call it from the thread that built the engine."""
        release_openmp_threads()  # this thread's OpenMP threads would slow the engine thread's
        self._thread.start()

    def stop(self) -> EngineStats:
        """Abort whatever still runs, stop the thread; returns the engine's last stats (every KV block is
        free unless something leaked: `kv_all_free`)."""
        with self._wakeup:
            self._stopped = True
            self._wakeup.notify()
        if self._thread.is_alive():
            self._thread.join()
        self.engine.shutdown()
        stats = self.engine.stats()
        if stats.kv_all_free:
            logger.info("engine stopped: all %d KV blocks are free", self.num_kv_blocks)
        else:
            logger.error("engine stopped with KV blocks still held: %s", stats.kv_usage)
        return stats

    def enable_kv_events(self) -> KVEventLog:
        """The prefix cache's changes as vLLM's KV events (LLMEngine.enable_kv_events); before start()."""
        if self._thread.is_alive():
            raise RuntimeError("enable_kv_events must be called before the engine thread starts")
        return self.engine.enable_kv_events()

    @property
    def has_open_streams(self) -> bool:
        return bool(self._streams)

    def _submit(self, fn: Callable[[], None]) -> None:
        with self._wakeup:
            if self.death is not None:
                raise EngineDead(self.death)
            self._calls.append(fn)
            self._wakeup.notify()

    async def run(self, fn: Callable[[LLMEngine], object]) -> object:
        """fn(engine) on the engine thread, between steps; its exception is raised here."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        pending = (loop, future)

        def call() -> None:
            self._pending.discard(pending)
            try:
                result = fn(self.engine)
            except Exception as error:
                loop.call_soon_threadsafe(_settle, future, None, error)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

        self._pending.add(pending)
        try:
            self._submit(call)
        except EngineDead:
            self._pending.discard(pending)
            raise
        return await future

    async def add(
        self,
        request_ids: list[str],
        prepare: Callable[[LLMEngine], list[tuple[str | list[int], SamplingParams]]],
        lora_request: LoRARequest | None = None,
    ) -> list[RequestStream]:
        """prepare(engine) -> one (prompt, params) per request id, then add them all (under the LoRA
        adapter `lora_request`, if given): one call on the engine thread, so tokenizing, checking and
        admission cost no extra step. An exception from `prepare` or a refused prompt (ValueError) is
        raised here, and then no request was added."""
        loop, arrival = asyncio.get_running_loop(), time.monotonic()
        streams = [_Stream(loop, asyncio.Queue(), RequestTimes(arrival)) for _ in request_ids]

        def add(engine: LLMEngine) -> None:
            items = prepare(engine)
            added = []
            try:
                for request_id, (prompt, params), stream in zip(request_ids, items, streams, strict=True):
                    engine.add_request(request_id, prompt, params, lora_request=lora_request)
                    added.append(request_id)
                    self._streams[request_id] = stream
            except BaseException:
                for request_id in added:
                    self._abort(request_id)
                raise

        try:
            await self.run(add)
        except asyncio.CancelledError:  # the caller gave up: `add` may still run, so abort after it
            for request_id in request_ids:
                self.abort(request_id)
            raise
        return [RequestStream(self, rid, stream) for rid, stream in zip(request_ids, streams, strict=True)]

    def abort(self, request_id: str) -> None:
        """Stop a request (queued after anything submitted before, so after its own `add`); nothing to do
        once the engine thread has died (its requests were ended then)."""
        with contextlib.suppress(EngineDead):
            self._submit(lambda: self._abort(request_id))

    def _abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        self._streams.pop(request_id, None)
        self.metrics.observe(self.engine)

    def _loop(self) -> None:
        try:
            while True:
                with self._wakeup:
                    while not (self._calls or self._stopped or self.engine.has_unfinished_requests()):
                        self._wakeup.wait()
                    calls, self._calls = self._calls, []
                    stopped = self._stopped
                for call in calls:
                    _guarded(call)
                if stopped:
                    self._shutdown()
                    return
                if self.engine.has_unfinished_requests():
                    self._step()
        except BaseException as error:  # logged by _die: the thread ends here, its callers told why
            self._die(error)

    def _die(self, error: BaseException) -> None:
        """The engine thread cannot go on: say why (`failure`, /health), end every open stream and every
        waiting call with that reason (a 500, or an error event), free what the requests held as far as the
        engine still can, and refuse new work (EngineDead: 503)."""
        logger.critical("the engine thread died", exc_info=error)
        with self._wakeup:
            self.death = f"the engine thread died: {type(error).__name__}: {error}"
            self._calls.clear()
        dead = RuntimeError(self.death)  # in flight: a 500 (or an error event); new requests: EngineDead
        for request_id in self.engine.unfinished_request_ids():
            _guarded(lambda rid=request_id: self.engine.abort_request(rid))
        self._end_streams(list(self._streams), dead)
        for loop, future in list(self._pending):
            with contextlib.suppress(RuntimeError):  # the loop has closed
                loop.call_soon_threadsafe(_settle, future, None, dead)
        self._pending.clear()

    def _end_streams(self, request_ids: list[str], error: BaseException) -> None:
        """Each of these requests' streams raises `error` (after any output already delivered)."""
        for request_id in request_ids:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                _deliver(stream.loop, [(stream, error)])

    def _shutdown(self) -> None:
        self._fail_all(ShuttingDown("the server shut down: the request was aborted"))

    def abort_all(self, error: Exception) -> None:
        """Abort every request now; each caller's stream raises `error` (e.g. at the shutdown timeout)."""
        self._submit(lambda: self._fail_all(error))

    def _fail_all(self, error: Exception) -> None:
        request_ids = self.engine.unfinished_request_ids()
        if request_ids:
            logger.warning("aborting %d requests: %s", len(request_ids), error)
        for request_id in request_ids:
            _guarded(lambda rid=request_id: self.engine.abort_request(rid))
        self._end_streams(request_ids, error)
        self.metrics.observe(self.engine)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as error:  # the engine rolled the step back and ended the requests it touched
            live = set(self.engine.unfinished_request_ids())
            self._end_streams([rid for rid in self._streams if rid not in live], error)
            self.metrics.observe(self.engine)
            return
        try:
            self._deliver_outputs(outputs)
        except Exception as error:  # no stream may wait for outputs that will never come
            logger.exception("delivering a step's outputs failed")
            request_ids = [output.request_id for output in outputs]
            for request_id in request_ids:
                _guarded(lambda rid=request_id: self.engine.abort_request(rid))
            self._end_streams(request_ids, error)

    def _deliver_outputs(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if not stream.prefilled:  # counted once its prefill is done, as vLLM counts them
                stream.prefilled = True
                self.metrics.prompt_tokens.inc(len(output.prompt_token_ids))
            num_generated = self.metrics.num_generated(output)
            new_tokens = num_generated - stream.num_generated
            self.metrics.generation_tokens.inc(new_tokens)
            self.metrics.observe_output(stream.times, now, new_tokens, output.finished)
            stream.num_generated = num_generated
            if output.finished:
                del self._streams[output.request_id]
            batches.setdefault(stream.loop, []).append((stream, output))
        for loop, batch in batches.items():
            _deliver(loop, batch)
        self.metrics.observe(self.engine)


def _guarded(call: Callable[[], None]) -> None:
    """Run one call on the engine thread; an exception is logged, never the end of the thread."""
    try:
        call()
    except Exception:
        logger.exception("a call on the engine thread failed")


def _deliver(loop: asyncio.AbstractEventLoop, batch: list[tuple[_Stream, object]]) -> None:
    """Hand outputs (or an error) to their streams on the event loop: one thread-safe call per batch."""

    def put_all() -> None:
        for stream, item in batch:
            stream.queue.put_nowait(item)

    try:
        loop.call_soon_threadsafe(put_all)
    except RuntimeError:  # the loop has closed: nobody is listening any more
        pass


def _settle(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
