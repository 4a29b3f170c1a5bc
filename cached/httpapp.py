"""The HTTP endpoint: health and statistics as JSON, Prometheus metrics and an operator's
page. It serves no artifact bytes.

What HTTP may show: any local user can reach it (it has no peer credentials, and on
127.0.0.1 every user of the node is local), while the socket admits only the peers its
mode and ``allow_uid``/``allow_gid`` admit. So HTTP shows counts, states, sizes, versions
and family names; never filesystem paths, kernel keys or parameters, compiler messages, the
fleet tier's URL or key ids (:func:`public_stats`, an allowlist: a key added to the
snapshot stays off HTTP until it is added here). The socket's ``stats`` has everything.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from fastapi.responses import HTMLResponse
from starlette.routing import Route

PUBLIC_KEYS = (
    "entries", "bytes", "hits", "misses", "prewarm_hits", "prewarm_misses",
    "hit_seconds_mean", "miss_seconds_mean", "compiles", "failures", "persist_failures",
    "remote_hits",
    "compile_seconds", "in_flight", "queued", "running", "workers", "workers_alive",
    "workers_ready", "workers_idle", "worker_restarts", "connections", "errors", "families",
    "uptime_s", "started", "stats_zeroed_at", "version", "versions", "toolchain",
    "serve_only", "http", "max_bytes", "max_files", "evictions", "evicted_bytes",
    "over_budget", "client_fallbacks", "draining", "unknown_toolchain",
)
"""The snapshot's keys HTTP shows as they are (counts, states, versions, family names)."""
PUBLIC_REMOTE_KEYS = (
    "state", "since", "read_only", "hits", "misses", "rejected", "published", "errors",
    "skipped", "publish_queue", "publish_dropped", "bytes_in", "bytes_out",
    "compression_ratio", "retry_in_s",
)
"""The fleet tier's keys HTTP shows (not its URL, key ids or last error text)."""
REDACTED = ("paths, kernel keys and parameters, compiler messages and the fleet tier's "
            "address are shown over the socket only: cached stats")


PUBLIC_TOOLCHAIN_KEYS = ("name", "fingerprint", "versions", "families", "default", "workers")
"""Each registered toolchain's keys HTTP shows (not its interpreter's path)."""


def public_stats(snapshot: dict) -> dict:
    """What ``GET /stats`` and the page show of a ``Daemon.snapshot()``: the
    :data:`PUBLIC_KEYS`, the fleet tier's :data:`PUBLIC_REMOTE_KEYS`, each toolchain's
    :data:`PUBLIC_TOOLCHAIN_KEYS`, and of each kept failure its time and family only."""
    out = {k: snapshot[k] for k in PUBLIC_KEYS if k in snapshot}
    out["toolchains"] = [{k: t[k] for k in PUBLIC_TOOLCHAIN_KEYS if k in t}
                         for t in snapshot.get("toolchains", [])]
    remote = snapshot.get("remote") or {}
    out["remote"] = {k: remote[k] for k in PUBLIC_REMOTE_KEYS if k in remote}
    out["last_failures"] = [{"time": f.get("time"), "family": f.get("family")}
                            for f in snapshot.get("last_failures", [])]
    out["redacted"] = REDACTED
    return out


def make_app(stats_fn: Callable[[], dict], ready_fn: Callable[[], bool],
             metrics_app: Callable | None = None) -> FastAPI:
    """The endpoint's routes; ``metrics_app`` (an ASGI app, cached.metrics.make_metrics)
    answers ``/metrics``."""
    app = FastAPI(title="cached", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/healthz")
    def healthz() -> dict:
        return {"ok": ready_fn()}

    @app.get("/stats")
    def stats() -> dict:
        return public_stats(stats_fn())

    if metrics_app is not None:  # at /metrics itself (a mount would redirect to /metrics/)
        app.router.routes.append(Route("/metrics", _Asgi(metrics_app), methods=["GET"]))

    @app.get("/", response_class=HTMLResponse)
    def page() -> HTMLResponse:
        from .page import render

        return HTMLResponse(render(public_stats(stats_fn())),
                            headers={"Cache-Control": "no-store"})

    return app


class _Asgi:
    """An ASGI app that Starlette's ``Route`` calls as it is (a plain function would be
    taken for a request handler)."""

    def __init__(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        await self.app(scope, receive, send)
