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


def _text_of(chunk: dict) -> str:
    text = ""
    for choice in chunk.get("choices") or []:
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


def responses_chunk(event: dict) -> dict:
    """A Responses API stream event as the chat chunk that says the same (its text, usage or error)."""
    response = event.get("response") or {}
    if event["type"] == "response.failed":
        return {"error": response.get("error") or {"message": str(event)}}
    text = event["delta"] if event["type"] == "response.output_text.delta" else ""
    chunk = {"choices": [{"delta": {"content": text}}] if text else []}
    usage = response.get("usage")
    if usage:
        chunk["usage"] = {"completion_tokens": usage["output_tokens"]}
    return chunk


async def send_streaming(client, url: str, body: dict, prompt_len: int) -> Result:
    """POST one streamed request; time its chunks. Tokens come from the usage chunk (else one per chunk)."""
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
                if str(chunk.get("type")).startswith("response."):
                    chunk = responses_chunk(chunk)
                if "error" in chunk:
                    result.error = chunk["error"].get("message", str(chunk))
                    return result
                usage = chunk.get("usage") or usage
                if _text_of(chunk):
                    now = time.perf_counter()
                    if chunks_with_text == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks_with_text += 1
    except Exception as error:  # the client side of a failure: connection refused, reset, timeout
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.e2e = time.perf_counter() - start
    result.output_tokens = usage["completion_tokens"] if usage else chunks_with_text
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
