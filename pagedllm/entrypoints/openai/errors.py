"""Every error the server answers, in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from pagedllm.entrypoints.openai import protocol as p

if TYPE_CHECKING:
    from fastapi import FastAPI

logger = logging.getLogger(__name__)

# OpenAI's error types by HTTP status (what the official client raises for each).
KINDS = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """Raised by a route: answered as `status` with an OpenAI-style body naming `param`."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


class ShuttingDown(APIError):
    """A request aborted because the server is stopping (503)."""

    def __init__(self, message: str):
        super().__init__(message, 503)


class EngineDead(APIError):
    """The engine thread died: no request can be served (503); its reason names why."""

    def __init__(self, message: str):
        super().__init__(message, 503)


def error_body(message: str, status: int, param: str | None = None) -> dict:
    kind = KINDS.get(status, "InternalServerError" if status >= 500 else "BadRequestError")
    return p.ErrorResponse(
        error=p.ErrorInfo(message=message, type=kind, param=param, code=status)
    ).model_dump()


def error_response(message: str, status: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status)


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """A pydantic/FastAPI validation failure in words, and the first field it names (None: the body)."""
    parts, params = [], []
    for e in errors:
        loc = [str(part) for part in e["loc"] if part != "body"]
        if e["type"] == "json_invalid":  # loc ends with the character offset of the syntax error
            reason = e.get("ctx", {}).get("error", "JSON decode error")
            parts.append(f"request body is not valid JSON: {reason} at character {loc[-1] if loc else 0}")
            params.append(None)
            continue
        name = ".".join(loc)
        params.append(name or None)
        if not name and e["type"] == "value_error":  # a rule across fields (model_validator)
            parts.append(e["msg"].removeprefix("Value error, "))
        elif not name:
            got = type(e.get("input")).__name__ if e.get("input") is not None else "nothing"
            parts.append(f"request body must be a JSON object (Content-Type: application/json), got {got}")
        elif e["type"] == "extra_forbidden":
            parts.append(f"{name}: not supported by pagedllm")
        elif e["type"] == "missing":
            parts.append(f"{name}: required")
        else:
            parts.append(f"{name}: {e['msg'].removeprefix('Value error, ')} (got {_short(e.get('input'))})")
    return "; ".join(parts), params[0] if params else None


def install_error_handlers(app: FastAPI) -> None:
    """Route errors, validation failures, unknown routes and bugs all answer in OpenAI's shape."""
    # Imported here, not above: the CLI imports this module for its limits' defaults, and every
    # `pagedllm generate` would otherwise wait for FastAPI's import, which it never uses.
    from fastapi.exceptions import RequestValidationError

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return error_response(str(error), error.status, error.param)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        message, param = validation_message(error.errors())
        return error_response(message, 400, param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {error.detail}"
        return error_response(message, error.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(f"internal error: {type(error).__name__}: {error}", 500)
