"""Async plumbing between engine outputs and HTTP: merging prompts' streams, text deltas, SSE, disconnects."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass

from fastapi import Request
from pydantic import BaseModel

from pagedllm.entrypoints.openai.errors import APIError, error_body
from pagedllm.outputs import CompletionOutput, RequestOutput

_DONE = object()


async def merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several requests' streams as they come; one stream needs no tasks."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                queue.put_nowait((i, output))
        except Exception as error:
            queue.put_nowait((i, error))
        finally:
            queue.put_nowait((i, _DONE))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def finals(outputs: AsyncIterator[tuple[int, RequestOutput]], num_prompts: int) -> list[RequestOutput]:
    """The last output of each prompt, in prompt order."""
    last: dict[int, RequestOutput] = {}
    async for i, output in outputs:
        last[i] = output
    return [last[i] for i in range(num_prompts)]


@dataclass
class Delta:
    """New text of one choice since the last delta, and the tokens generated meanwhile."""

    index: int  # the choice's index: prompt-major, n per prompt
    text: str
    output: CompletionOutput
    first: bool  # the choice's first delta
    token_start: int  # output.token_ids[token_start:] are new since the last delta


async def deltas(
    outputs: AsyncIterator[tuple[int, RequestOutput]], n: int, stop: str | list[str] | None
) -> AsyncIterator[Delta]:
    """One Delta per choice that advanced. While a choice runs, the last len(longest stop string) - 1
    characters are held back: a stop string found later cuts them."""
    hold = max((len(s) for s in ([stop] if isinstance(stop, str) else stop or [])), default=1) - 1
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    done: set[int] = set()
    async for prompt_index, output in outputs:
        for o in output.outputs:
            index = prompt_index * n + o.index
            start = sent_text.get(index, 0)
            end = len(o.text) if o.finish_reason else max(start, len(o.text) - hold)
            if index in done or (end == start and not o.finish_reason):
                continue
            first = index not in sent_text
            sent_text[index] = end
            token_start = sent_tokens.get(index, 0)
            sent_tokens[index] = len(o.token_ids)
            if o.finish_reason:
                done.add(index)
            yield Delta(index, o.text[start:end], o, first, token_start)


async def until_disconnected(raw: Request, work: Awaitable):
    """Await `work`, cancelling it (which aborts its requests) if the client goes away first."""
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


async def sse(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    """Server-sent events `data: {...}` per chunk, then `data: [DONE]`; an engine error mid-stream is
    sent as an error event. Closing the events early (a client that disconnects) closes `chunks`, which
    aborts the request."""
    try:
        async for chunk in chunks:
            yield f"data: {chunk.model_dump_json(exclude_unset=False)}\n\n"
    except APIError as error:  # e.g. aborted by a shutdown (503)
        yield f"data: {json.dumps(error_body(str(error), error.status, error.param))}\n\n"
    except Exception as error:
        yield f"data: {json.dumps(error_body(str(error), 500))}\n\n"
    finally:
        await chunks.aclose()
    yield "data: [DONE]\n\n"
