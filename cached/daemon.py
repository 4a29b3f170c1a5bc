"""The daemon: wires store, pool, scheduler, socket server and HTTP endpoint together.

Start order: store opened (index read into memory), workers spawned (they import the
toolchain in the background), socket listening (hits are served at once), the start-up
scan and the HTTP endpoint. The daemon never touches a GPU: device facts come from
requests, and compilation is cross-compilation for the requested arch.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import certifications, families, sizing, toolchain, writeback
from .identity import Identity
from .lifecycle import Lifecycle
from .log import event
from .metrics import DaemonStats, make_metrics
from .pool import Pool
from .scheduler import Scheduler
from .server import Access, Server
from .store import Store

log = logging.getLogger("cached.daemon")

FLUSH_INTERVAL_S = 2.0


@dataclass
class Settings:
    store: Path
    socket: str
    http_host: str = "127.0.0.1"
    http_port: int = 8377
    workers: int | None = None
    job_timeout: float = 300.0
    socket_mode: int = 0o660
    access: Access = field(default_factory=Access)
    serve_only: bool = False
    remote_url: str | None = None  # the fleet tier: redis://HOST:PORT/DB, redis+cluster://...
    remote_signing_key: Path | None = None  # Ed25519 private key (PEM): publishing nodes only
    remote_verify_keys: Path | None = None  # the fleet's Ed25519 public keys (PEM or base64 lines)
    remote_read_only: bool = False  # fetch from the tier, never publish (GPU nodes)
    remote_timeout: float = 2.0  # seconds per Redis operation before the tier counts as down
    max_bytes: int = 0  # store budget (0: none); LRU eviction, see Store.evict
    max_files: int = 0  # store budget in blob files, two per entry (0: none)
    evict_grace: float = 30.0  # an entry used this recently is never evicted
    drain_timeout: float = 30.0  # SIGTERM: seconds running compilations get to finish
    config: dict | None = None  # the effective configuration (cached/config.py)
    reload: Any = None  # SIGHUP: returns a fresh config.Effective


class Daemon:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.started = time.time()
        self.remote = _make_remote(settings)  # first: a bad key file stops us before any I/O
        self.store = Store(settings.store)
        self.stats = DaemonStats()
        if settings.serve_only:
            self.identity = Identity.pinned(settings.store)
            workers = 0
        else:
            self.identity = Identity.compute()
            self.identity.save(settings.store)
            workers = sizing.worker_count(settings.workers)
        preload = [n for n in families.names() if not n.startswith("cached.test")]
        self.pool = Pool(workers, settings.job_timeout, preload)
        self.scheduler = Scheduler(self.store, self.pool, self.stats, self.identity,
                                   remote=self.remote)
        self.server = Server(self.scheduler, self.snapshot, settings.access)
        certifications.register(self.server, self.store)
        writeback.register(self.server, self.scheduler, self.store)  # leases, publish
        self.lifecycle = Lifecycle(self)  # budget, report/gc/verify ops, systemd, drain
        self.http_address = ""
        self._http: Any = None
        self._stop = asyncio.Event()

    def snapshot(self) -> dict:
        """The statistics ``cached stats --json`` and ``GET /stats`` report."""
        entries, size = self.store.totals()
        c = self.stats.counters
        return {
            "entries": entries, "bytes": size, "hits": c["hits"], "misses": c["misses"],
            "compiles": c["compiles"], "failures": c["failures"],
            "remote_hits": c["remote_hits"],
            "remote": self.remote.snapshot() if self.remote else {"state": "disabled"},
            "compile_seconds": round(c["compile_seconds"], 3),
            "in_flight": len(self.scheduler.inflight), "queued": self.scheduler.queued,
            "running": self.scheduler.running, "workers": self.pool.size,
            "workers_alive": self.pool.alive, "workers_ready": self.pool.ready,
            "workers_idle": self.pool.idle,
            "worker_restarts": self.pool.restarts, "connections": self.server.connections,
            "errors": {k.split(".", 1)[1]: v for k, v in c.items() if k.startswith("errors.")},
            "families": {f: dict(v) for f, v in self.stats.by_family.items()},
            "last_failures": list(self.stats.failures),
            "uptime_s": round(time.time() - self.started, 1),
            "toolchain": toolchain.fingerprint_digest(self.identity.toolchain),
            "serve_only": self.settings.serve_only,
            "store": str(self.settings.store),
            "socket": self.settings.socket, "http": self.http_address,
            **self.lifecycle.snapshot(),
        }

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        loop.add_signal_handler(signal.SIGHUP, self.lifecycle.reload)
        await self.pool.start()
        await self.scheduler.start()
        if self.remote is not None:
            self.remote.start()
        await self.lifecycle.listen()  # a socket passed by systemd, else settings.socket
        event(log, logging.INFO, "daemon.listening", socket=self.settings.socket,
              workers=self.pool.size, entries=self.store.totals()[0],
              toolchain=toolchain.fingerprint_digest(self.identity.toolchain))
        threading.Thread(target=self.store.scan, name="store-scan", daemon=True).start()
        self._start_http()
        flusher = loop.create_task(self._flush_loop())
        self.lifecycle.started()
        await self._stop.wait()
        event(log, logging.INFO, "daemon.stopping", in_flight=len(self.scheduler.inflight))
        flusher.cancel()
        await self.server.stop()
        await self.lifecycle.drain()
        await self.scheduler.stop()
        await self.pool.stop()
        if self.remote is not None:  # queued publishes get a few seconds to go out
            await loop.run_in_executor(None, self.remote.close)
        if self._http is not None:
            self._http.should_exit = True
        self.store.close()
        try:
            if not self.lifecycle.inherited:  # systemd owns a socket it passed
                os.unlink(self.settings.socket)
        except FileNotFoundError:
            pass
        event(log, logging.INFO, "daemon.stopped")

    def stop(self) -> None:
        self._stop.set()

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_INTERVAL_S)
            await asyncio.get_running_loop().run_in_executor(None, self.store.flush)

    def _start_http(self) -> None:
        if self.settings.http_port < 0:
            return
        sock = socket.socket(socket.AF_INET6 if ":" in self.settings.http_host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.settings.http_host, self.settings.http_port))
        sock.listen(64)
        host, port = sock.getsockname()[:2]
        self.http_address = f"{host}:{port}"
        import uvicorn

        from .httpapp import make_app

        app = make_app(self.snapshot, lambda: self.pool.alive > 0, make_metrics(self))
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off")
        self._http = uvicorn.Server(config)
        threading.Thread(target=self._http.run, kwargs={"sockets": [sock]}, name="http",
                         daemon=True).start()
        event(log, logging.INFO, "http.listening", address=self.http_address)


def _make_remote(settings: Settings) -> Any:
    """The fleet tier, or None; :class:`remote.KeyFileError` for missing or unusable keys
    (an unsigned tier would push native code into every node)."""
    if not settings.remote_url:
        return None
    from .remote import Remote, load_keys

    keys = load_keys(settings.remote_signing_key, settings.remote_verify_keys,
                     settings.remote_read_only)
    return Remote(settings.remote_url, keys, timeout=settings.remote_timeout)


def serve(settings: Settings) -> None:
    asyncio.run(Daemon(settings).run())
