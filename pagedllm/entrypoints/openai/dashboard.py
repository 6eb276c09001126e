"""The live KV dashboard: `GET /dashboard` (one page, shipped in the package) over `GET /v1/kv` (JSON).

The snapshot is taken on the engine thread between two steps, so it is consistent; the page polls it
twice a second and draws the cache the way the seed lesson does.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, JSONResponse, Response

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai.async_engine import AsyncEngine
from pagedllm.entrypoints.openai.metrics import EngineMetrics

STATIC = files(__package__) / "static"


def kv_payload(engine: LLMEngine, metrics: EngineMetrics) -> dict:
    """What GET /v1/kv returns: the KV snapshot, with the token counters (for tokens/s). Engine thread."""
    snapshot = engine.kv_snapshot()
    snapshot["counters"].update(metrics.token_totals())
    return snapshot


def router(engine: AsyncEngine) -> APIRouter:
    page = (STATIC / "dashboard.html").read_text()
    script = (STATIC / "dashboard.js").read_text()
    routes = APIRouter()

    @routes.get("/v1/kv")
    async def kv() -> JSONResponse:
        """The KV cache between two engine steps, and the token counters (for tokens/s)."""
        return JSONResponse(await engine.run(lambda llm_engine: kv_payload(llm_engine, engine.metrics)))

    @routes.get("/dashboard", response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page)

    @routes.get("/dashboard/dashboard.js")
    async def dashboard_js() -> Response:
        return Response(script, media_type="text/javascript")

    return routes
