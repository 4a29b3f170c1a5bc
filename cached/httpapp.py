"""The HTTP endpoint: health and statistics as JSON, Prometheus metrics and an operator's
page. It serves no artifact bytes."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response


def make_app(stats_fn: Callable[[], dict], ready_fn: Callable[[], bool],
             metrics_fn: Callable[[], bytes] | None = None) -> FastAPI:
    app = FastAPI(title="cached", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/healthz")
    def healthz() -> dict:
        return {"ok": ready_fn()}

    @app.get("/stats")
    def stats() -> dict:
        return stats_fn()

    if metrics_fn is not None:
        from .metrics import CONTENT_TYPE

        @app.get("/metrics")
        def metrics() -> Response:
            return Response(metrics_fn(), media_type=CONTENT_TYPE)

    @app.get("/", response_class=HTMLResponse)
    def page() -> HTMLResponse:
        from .page import render

        return HTMLResponse(render(stats_fn()), headers={"Cache-Control": "no-store"})

    return app
