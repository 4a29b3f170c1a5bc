"""The HTTP endpoint: health and statistics as JSON. It serves no artifact bytes."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI


def make_app(stats_fn: Callable[[], dict], ready_fn: Callable[[], bool]) -> FastAPI:
    app = FastAPI(title="cached", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/healthz")
    def healthz() -> dict:
        return {"ok": ready_fn()}

    @app.get("/stats")
    def stats() -> dict:
        return stats_fn()

    return app
