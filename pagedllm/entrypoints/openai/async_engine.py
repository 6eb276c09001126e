"""AsyncEngine: one thread owns the LLMEngine and steps it; asyncio callers get each request's outputs."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from pagedllm.engine.llm_engine import LLMEngine
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

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    """Every touch of the engine (add, abort, tokenizer, step) runs on the engine thread, in order."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.metrics = EngineMetrics()
        self._calls: list[Callable[[], None]] = []
        self._wakeup = threading.Condition()
        self._streams: dict[str, _Stream] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="pagedllm-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wakeup:
            self._stopped = True
            self._wakeup.notify()
        self._thread.join()

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

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs until finished; closing or cancelling the iterator aborts
        it, so its KV blocks go back to the pool. A bad prompt raises ValueError before any output."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), RequestTimes(time.monotonic()))

        def add(engine: LLMEngine) -> None:
            engine.add_request(request_id, prompt, params)
            self._streams[request_id] = stream
            self.metrics.prompt_tokens.inc(len(engine.requests[request_id].prompt_token_ids))

        try:
            await self.run(add)
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:  # queued after `add`, so it also catches a request added after its caller gave up
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
                if self._stopped:
                    return
                calls, self._calls = self._calls, []
            for call in calls:
                call()
            if self.engine.has_unfinished_requests():
                self._step()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as error:  # fail the running requests, keep serving the next ones
            logger.exception("engine step failed; aborting %d requests", len(self.engine.requests))
            for request_id in list(self.engine.requests):
                stream = self._streams.get(request_id)
                self._abort(request_id)
                if stream is not None:
                    stream.put(error)
            return
        now = time.monotonic()
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            num_generated = self.metrics.num_generated(output)
            new_tokens = num_generated - stream.num_generated
            self.metrics.generation_tokens.inc(new_tokens)
            self.metrics.observe_output(stream.times, now, new_tokens, output.finished)
            stream.num_generated = num_generated
            if output.finished:
                del self._streams[output.request_id]
            stream.put(output)
        self.metrics.observe(self.engine)


def _settle(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
