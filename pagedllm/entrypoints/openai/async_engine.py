"""AsyncEngine: one thread owns the LLMEngine and steps it; asyncio callers get each request's outputs.

The engine thread is where the compute happens, so the event loop's share of the machine is kept small:
after each step, all of that step's outputs cross to the event loop in one call (one wake-up per step,
not one per request).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pagedllm._runtime import release_openmp_threads
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai.errors import ShuttingDown
from pagedllm.entrypoints.openai.metrics import EngineMetrics, RequestTimes
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
        if isinstance(item, BaseException):
            self._finished = True
            raise item
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
        self._thread = threading.Thread(target=self._loop, name="pagedllm-engine", daemon=True)

    def start(self) -> None:
        """Start stepping on the engine thread; call it from the thread that built the engine."""
        release_openmp_threads()  # this thread's OpenMP threads would slow the engine thread's
        self._thread.start()

    def stop(self) -> None:
        """Abort whatever still runs, stop the thread; afterwards every KV block is free."""
        with self._wakeup:
            self._stopped = True
            self._wakeup.notify()
        self._thread.join()
        self.engine.shutdown()

    def _submit(self, fn: Callable[[], None]) -> None:
        with self._wakeup:
            self._calls.append(fn)
            self._wakeup.notify()

    async def run(self, fn: Callable[[LLMEngine], object]) -> object:
        """fn(engine) on the engine thread, between steps; its exception is raised here."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def call() -> None:
            try:
                result = fn(self.engine)
            except Exception as error:
                loop.call_soon_threadsafe(_settle, future, None, error)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

        self._submit(call)
        return await future

    async def add(
        self,
        request_ids: list[str],
        prepare: Callable[[LLMEngine], list[tuple[str | list[int], SamplingParams]]],
    ) -> list[RequestStream]:
        """prepare(engine) -> one (prompt, params) per request id, then add them all: one call on the
        engine thread, so tokenizing, checking and admission cost no extra step. An exception from
        `prepare` or a refused prompt (ValueError) is raised here, and then no request was added."""
        loop, arrival = asyncio.get_running_loop(), time.monotonic()
        streams = [_Stream(loop, asyncio.Queue(), RequestTimes(arrival)) for _ in request_ids]

        def add(engine: LLMEngine) -> None:
            items = prepare(engine)
            added = []
            try:
                for request_id, (prompt, params), stream in zip(request_ids, items, streams, strict=True):
                    engine.add_request(request_id, prompt, params)
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
        """Stop a request (queued after anything submitted before, so after its own `add`)."""
        self._submit(lambda: self._abort(request_id))

    def _abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        self._streams.pop(request_id, None)
        self.metrics.observe(self.engine)

    def _loop(self) -> None:
        while True:
            with self._wakeup:
                while not (self._calls or self._stopped or self.engine.has_unfinished_requests()):
                    self._wakeup.wait()
                calls, self._calls = self._calls, []
                stopped = self._stopped
            for call in calls:
                call()
            if stopped:
                self._shutdown()
                return
            if self.engine.has_unfinished_requests():
                self._step()

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
            stream = self._streams.get(request_id)
            self._abort(request_id)
            if stream is not None:
                _deliver(stream.loop, [(stream, error)])

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as error:  # fail the running requests, keep serving the next ones
            num = self.engine.get_num_unfinished_requests()
            logger.exception("engine step failed; aborting %d requests", num)
            self._fail_all(error)
            return
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
