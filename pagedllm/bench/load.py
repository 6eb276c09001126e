"""The load generator of `bench serve` and its soak test: requests sent as a Poisson process with at most
so many in flight, and one streamed completion timed chunk by chunk."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field


@dataclass
class Request:
    """One request of the workload: a prompt (token ids, or text for chat) and the tokens asked for."""

    prompt: list[int] | str
    prompt_len: int
    output_len: int


@dataclass
class Result:
    """One request sent: whether it came back whole, its timings, or what went wrong."""

    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0  # seconds to the first chunk with text
    itl: list[float] = field(default_factory=list)  # seconds between chunks with text
    e2e: float = 0.0
    error: str = ""


def openai_event(chunk: dict) -> tuple[str, int | None]:
    """A completions or chat chunk's new text, and the output tokens its usage reports (the last one)."""
    text = ""
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        text += choice.get("text") or delta.get("content") or delta.get("reasoning_content") or ""
    usage = chunk.get("usage")
    return text, usage["completion_tokens"] if usage else None


def anthropic_event(event: dict) -> tuple[str, int | None]:
    """A Messages stream event's new text (a text, thinking or tool input delta), and the output tokens
    its usage reports (message_delta's, the last)."""
    delta = event.get("delta") or {}
    text = delta.get("text") or delta.get("thinking") or delta.get("partial_json") or ""
    usage = event.get("usage") if event.get("type") == "message_delta" else None
    return text, usage["output_tokens"] if usage else None


class StreamError(Exception):
    """A stream that reported a failure in its own event shape (a Responses API response.failed)."""


def responses_event(event: dict) -> tuple[str, int | None]:
    """A Responses API stream event's new text, and the output tokens response.completed's usage reports."""
    response = event.get("response") or {}
    if event.get("type") == "response.failed":
        raise StreamError((response.get("error") or {}).get("message", str(event)))
    text = event["delta"] if event.get("type") == "response.output_text.delta" else ""
    usage = response.get("usage")
    return text, usage["output_tokens"] if usage else None


async def send_streaming(client, url: str, body: dict, prompt_len: int, read=openai_event) -> Result:
    """POST one streamed request; time its events, which `read` gives as (new text, output tokens or
    None). Tokens come from the usage the stream reports (else one per event with text)."""
    result = Result(ok=False, prompt_len=prompt_len)
    start = last = time.perf_counter()
    chunks_with_text, usage = 0, None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"].get("message", str(chunk))
                    return result
                text, tokens = read(chunk)
                usage = usage if tokens is None else tokens
                if text:
                    now = time.perf_counter()
                    if chunks_with_text == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks_with_text += 1
    except StreamError as error:
        result.error = str(error)
        return result
    except Exception as error:  # the client side of a failure: connection refused, reset, timeout
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.e2e = time.perf_counter() - start
    result.output_tokens = chunks_with_text if usage is None else usage
    result.ok = True
    return result


async def run_load(
    requests: list, rate: float, concurrency: int | None, seed: int, send
) -> tuple[list, float, float]:
    """send(request) for every request: Poisson arrivals at `rate`/s, at most `concurrency` in flight.
    Returns the results in request order, the wall seconds and this process's CPU seconds."""
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    rng = random.Random(seed)

    async def one(request):
        if gate is None:
            return await send(request)
        async with gate:
            return await send(request)

    start, cpu = time.perf_counter(), time.process_time()
    tasks = []
    for request in requests:
        tasks.append(asyncio.ensure_future(one(request)))
        if math.isfinite(rate):
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start, time.process_time() - cpu
