"""What a server left running needs at its door: an API key, body and concurrency limits, draining.

`LimitsMiddleware` wraps the app (plain ASGI, so streaming responses pass through untouched) and
guards every `/v1/*` route and vLLM's `/tokenize` and `/detokenize` (which vLLM leaves open: they read
a request body too); `/health`, `/version`, `/metrics` and the OpenAPI schema stay open, as in vLLM.
Each refusal is an OpenAI-style error naming the limit and the option that sets it.
"""

from __future__ import annotations

import hmac
import json
import os
from dataclasses import dataclass

from pagedllm.entrypoints.openai.anthropic_protocol import error_body as anthropic_error
from pagedllm.entrypoints.openai.errors import APIError, error_body

GUARDED = ("/v1", "/tokenize", "/detokenize")  # the routes behind the door (path prefixes)


@dataclass
class ServerLimits:
    api_key: str | None = None  # None: no key needed (the server binds 127.0.0.1 unless told otherwise)
    max_request_body_bytes: int = 4 * 2**20
    max_concurrent_requests: int = 1024  # /v1 requests in flight at once (streams included)
    max_n: int = 128  # completions per prompt (OpenAI's own cap)
    max_logprobs: int = 20  # vLLM's --max-logprobs default; OpenAI's top_logprobs cap

    def __post_init__(self) -> None:
        if self.api_key is None:
            self.api_key = os.environ.get("PAGEDLLM_API_KEY") or None
        for name in ("max_request_body_bytes", "max_concurrent_requests", "max_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs!r}")

    def check_n(self, n: int) -> None:
        if n > self.max_n:
            raise APIError(f"n={n} is above this server's limit of {self.max_n} (--max-n)", param="n")

    def check_logprobs(self, name: str, value: int | None) -> None:
        if value is not None and value > self.max_logprobs:
            raise APIError(
                f"{name}={value} is above this server's limit of {self.max_logprobs} (--max-logprobs)",
                param=name,
            )


@dataclass
class Admission:
    """The door's state, shared by the middleware and whoever shuts the server down."""

    active: int = 0  # /v1 requests being served now
    draining: bool = False  # set on SIGTERM: finish what runs, admit nothing new


class LimitsMiddleware:
    """API key, body size, concurrent requests and shutdown draining for the GUARDED routes."""

    def __init__(self, app, limits: ServerLimits, admission: Admission):
        self.app = app
        self.limits = limits
        self.admission = admission

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(GUARDED):
            await self.app(scope, receive, send)
            return
        limits, admission = self.limits, self.admission
        if admission.draining:
            await _refuse(send, 503, "the server is shutting down and admits no new requests", scope["path"])
            return
        if limits.api_key is not None and not _authorized(scope, limits.api_key):
            message = "missing or incorrect API key: send the header `Authorization: Bearer <key>`"
            await _refuse(send, 401, message + " or `x-api-key: <key>`", scope["path"])
            return
        if admission.active >= limits.max_concurrent_requests:
            message = (
                f"too many concurrent requests: this server serves at most "
                f"{limits.max_concurrent_requests} at once (--max-concurrent-requests); retry later"
            )
            await _refuse(send, 429, message, scope["path"])
            return
        admission.active += 1
        try:
            body = await _read_body(scope, receive, limits.max_request_body_bytes)
            if body is None:
                await _refuse(send, 413, _too_large(limits.max_request_body_bytes), scope["path"])
                return
            await self.app(scope, _replay(body, receive), send)
        finally:
            admission.active -= 1


def _authorized(scope, api_key: str) -> bool:
    """`Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY` (Anthropic's)."""
    headers = dict(scope["headers"])
    bearer = headers.get(b"authorization", b"")
    return hmac.compare_digest(bearer, f"Bearer {api_key}".encode("latin-1")) or hmac.compare_digest(
        headers.get(b"x-api-key", b""), api_key.encode("latin-1")
    )


def _too_large(limit: int) -> str:
    return f"request body is larger than this server's limit of {limit} bytes (--max-request-body-bytes)"


async def _read_body(scope, receive, limit: int) -> bytes | None:
    """The whole request body, or None once it passes `limit` bytes (Content-Length is checked first)."""
    length = dict(scope["headers"]).get(b"content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        return None
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b""  # the app sees an empty body, then the disconnect
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive):
    """A receive() that hands the app the buffered body, then passes through (to see disconnects)."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _refuse(send, status: int, message: str, path: str = "") -> None:
    """The refusal in the route's API's error shape: Anthropic's on /v1/messages, else OpenAI's."""
    anthropic = path.startswith("/v1/messages")
    body = json.dumps(anthropic_error(message, status) if anthropic else error_body(message, status)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
