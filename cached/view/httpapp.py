"""The HTTP endpoint: health and statistics as JSON, Prometheus metrics and an operator's
page. It serves no artifact bytes.

What HTTP may show: any local user can reach it (it has no peer credentials, and on
127.0.0.1 every user of the node is local), while the socket admits only the peers its
mode and ``allow_uid``/``allow_gid`` admit. So HTTP shows counts, states, sizes, versions
and family names; never filesystem paths, kernel keys or parameters, compiler messages, the
fleet tier's URL or key ids (:func:`cached.view.snapshot.public_stats` of the daemon's one
snapshot, an allowlist: a key added to the snapshot stays off HTTP until it is added
there). The socket's ``stats`` has everything.

Only requests addressed to the endpoint itself are answered (:class:`HostCheck`): a page
in a browser on the node can make a name of its own resolve to 127.0.0.1 (DNS
rebinding) and read what it is served, but its requests carry that name in ``Host``. A
``Host`` whose name is not the listening address (an IP literal of it, ``localhost`` on
loopback, the configured host name, a name of ``http_allow_host``; on a wildcard address any
IP literal and this host's own names) gets ``421 Misdirected Request`` with a plain-text
body saying why. The port is not compared: a name decides a rebinding, and a port mapped
elsewhere (a container's ``-p 127.0.0.1:9000:8377``) must still be served.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse
from starlette.routing import Route

from .snapshot import DaemonSnapshot

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
                   Awaitable[None]]

def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def split_host(value: str) -> tuple[str, int | None] | None:
    """``Host``'s name (lower case, IPv6 without brackets, no trailing dot) and port (None
    when absent); None when it is not ``name[:port]`` or ``[v6][:port]``."""
    name, port = value.strip(), ""
    if name.startswith("["):
        close = name.find("]")
        if close < 0 or (close + 1 < len(name) and name[close + 1] != ":"):
            return None
        name, port = name[1:close], name[close + 2:]
    elif ":" in name:
        name, _, port = name.rpartition(":")
    if port and not (port.isdigit() and len(port) <= 5):
        return None
    name = name.lower().rstrip(".")
    return (name, int(port) if port else None) if name else None


class HostCheck:
    """ASGI middleware: answer only requests whose ``Host`` names the listening address
    ``(host, port)`` or one of ``names`` (the configured host name, ``http_allow_host``),
    see the module doc; others get 421 and why."""

    def __init__(self, app: ASGIApp, address: tuple[str, int], names: Iterable[str] = ()
                 ) -> None:
        self.app = app
        self.host, self.port = address
        bound = _ip(self.host)
        self.wildcard = bound is not None and bound.is_unspecified
        self.names = {n.lower().rstrip(".") for n in names if _ip(n) is None}
        self.ips = {ip for n in names if (ip := _ip(n)) is not None}
        """IP literals admitted besides the bound address (``http_allow_host``)."""
        if bound is None or bound.is_loopback or self.wildcard:
            self.names.add("localhost")
        if self.wildcard:
            self.names |= {n.lower().rstrip(".") for n in (socket.gethostname(),
                                                            socket.getfqdn()) if n}
        self.bound = bound

    def allowed(self, value: str) -> bool:
        """Whether a ``Host`` header value addresses this endpoint."""
        parsed = split_host(value)
        if parsed is None:
            return False
        name = parsed[0]
        ip = _ip(name)
        if ip is None:
            return name in self.names
        return self.wildcard or ip == self.bound or ip in self.ips

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        hosts = [v.decode("latin-1") for k, v in scope["headers"] if k == b"host"]
        if len(hosts) == 1 and self.allowed(hosts[0]):
            await self.app(scope, receive, send)
            return
        shown = f"[{self.host}]" if ":" in self.host else self.host
        told = repr(hosts[0][:100]) if len(hosts) == 1 else f"{len(hosts)} Host headers"
        body = (f"421 Misdirected Request: Host {told} is not this endpoint's address "
                f"({shown}:{self.port}). cached answers only requests addressed to it (a web "
                f"page reaching it through a name of its own, DNS rebinding, is refused); ask "
                f"http://{shown}:{self.port}/ instead, or admit the name with "
                f"--http-allow-host NAME (http_allow_host in the config file).\n").encode()
        await send({"type": "http.response.start", "status": 421, "headers": [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", str(len(body)).encode()), (b"cache-control", b"no-store")]})
        await send({"type": "http.response.body", "body": body})


def make_app(snapshot_fn: Callable[[], DaemonSnapshot], ready_fn: Callable[[], bool],
             metrics_app: Callable | None = None,
             address: tuple[str, int] | None = None, names: Iterable[str] = ()) -> FastAPI:
    """The endpoint's routes: ``/stats`` and ``/`` render :meth:`DaemonSnapshot.public` of
    the snapshot ``snapshot_fn`` takes per request; ``metrics_app`` (an ASGI app,
    cached.view.metrics.make_metrics) answers ``/metrics``; with ``address`` (the bound
    host and port) requests whose ``Host`` is neither that address nor one of ``names``
    are refused (:class:`HostCheck`)."""
    app = FastAPI(title="cached", docs_url=None, redoc_url=None, openapi_url=None)
    if address is not None:
        app.add_middleware(HostCheck, address=address, names=tuple(names))

    @app.get("/healthz")
    def healthz() -> dict:
        return {"ok": ready_fn()}

    @app.get("/stats")
    def stats() -> dict:
        return snapshot_fn().public()

    if metrics_app is not None:  # at /metrics itself (a mount would redirect to /metrics/)
        app.router.routes.append(Route("/metrics", _Asgi(metrics_app), methods=["GET"]))

    @app.get("/", response_class=HTMLResponse)
    def page() -> HTMLResponse:
        from .page import render

        return HTMLResponse(render(snapshot_fn().public()),
                            headers={"Cache-Control": "no-store"})

    return app


class _Asgi:
    """An ASGI app that Starlette's ``Route`` calls as it is (a plain function would be
    taken for a request handler)."""

    def __init__(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        await self.app(scope, receive, send)
