"""The daemon: wires store, pool, scheduler, the ops, socket server and HTTP endpoint.

Start order: fleet keys checked, the store's lock checked (one daemon per store: a live
store stops it here), the HTTP port bound, the Unix socket claimed (a port or path that
cannot be used stops the daemon here with one line, nothing left behind), the toolchains
probed (one that cannot be used stops it likewise, before a store exists), the store's lock
taken and the store opened (index read into memory, evicted down to its budget), workers
spawned (they import the toolchain in the background), socket listening (hits are served at
once), the start-up scan and the HTTP endpoint serving. The daemon never touches a GPU:
device facts come from requests, and compilation is cross-compilation for the requested
arch.

Everything that can make the store unusable is found before anything is bound: a store
path that is not a writable directory, an index that is not this program's SQLite
database, a budget smaller than a kernel it holds, an unusable ``identity.json`` on a
serve-only node. Each is a :class:`config.ConfigError` (``cached serve`` prints one line
and exits 2).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import signal
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cached import families
from cached.node import sizing
from cached.node.lifecycle import Lifecycle
from cached.node.listeners import bind_http
from cached.toolchain import compiler_stack, identity, toolchains, trust

from .artifacts import Served
from .config import Settings
from .fleet.tier import Tier
from .log import event
from .ops.autotune import Autotune
from .ops.certifications import Certifications
from .ops.leases import Leases
from .ops.planning import ShapePlans
from .ops.uploads import Uploads
from .pool import Launcher, Pool
from .scheduler import Scheduler
from .server import Access, Limits, Server
from .service import QueueQuota, Service
from .stats import Stats
from .store import lock as storelock
from .store.store import Budget, Store, StoreError
from .view.metrics import make_metrics
from .view.snapshot import DaemonSnapshot, take

log = logging.getLogger("cached.daemon")

FLUSH_INTERVAL_S = 2.0
IN_USE_HINT = "stop that daemon first, or give this one another --store"


class Daemon:
    def __init__(self, settings: Settings,
                 reload_settings: Callable[[], Settings] | None = None) -> None:
        self.settings = settings
        self.started = time.time()
        self.version = compiler_stack.daemon_version()
        self.remote = _make_remote(settings)  # first: a bad key file stops us before any I/O
        self.lifecycle = Lifecycle(self, reload_settings)
        # One daemon per store (cached/store/lock.py): a live store stops us before we bind
        # anything (a second serve would otherwise first meet the first one's port); the
        # lock itself is taken when the store is opened (nothing is created before).
        storelock.check(Path(settings.store), "serve", IN_USE_HINT)
        self.store_lock: storelock.StoreLock | None = None
        self._http_sock = None
        try:
            # Then what we listen on, HTTP first: a port or path we cannot use stops the
            # daemon here, before its store is opened, and leaves no socket file behind.
            self._http_sock = bind_http(settings.http_address)
            self.socket_path = self.lifecycle.bind().path
            self._open(settings)
        except BaseException:
            if self._http_sock is not None:
                self._http_sock.close()
            self.lifecycle.release()
            if self.store_lock is not None:
                self.store_lock.release()
            raise

    def _open(self, settings: Settings) -> None:
        _raise_descriptor_limit()
        store_root = Path(settings.store)
        if not settings.serve_only:  # first: a refused toolchain leaves no store behind
            probed = identity.compute(list(settings.toolchain), settings.probe_timeout)
        self.store_lock = storelock.take(store_root, "serve", self.socket_path, IN_USE_HINT)
        self.store = Store(store_root, Budget(settings.max_bytes, settings.max_files,
                                              settings.evict_grace))
        _protect_store(store_root, *store_access(settings, self.socket_path))
        self.store.check_budget()
        if dropped := trust.drop_unattributed(self.store):
            event(log, logging.WARNING, "store.unattributed_dropped", entries=dropped)
        self.stats = Stats(families.names())
        if settings.serve_only:
            self.toolchains = identity.pinned(store_root)
            workers = 0
        else:
            self.toolchains = probed
            identity.save(store_root, self.toolchains)
            workers = sizing.worker_count(settings.workers)
        # the default toolchain's readable versions, fixed for the process's life
        self.versions = dict(self.toolchains.default.versions) or compiler_stack.versions()
        self.pool = Pool(workers, settings.job_timeout,
                         [] if settings.serve_only else _launchers(self.toolchains))
        self.stats.keep("worker_restarts", lambda: self.pool.restarts)
        self.scheduler = Scheduler(self.store, self.pool, self.stats, self.toolchains,
                                   remote=self.remote)
        self.store.protect(lambda: tuple(self.scheduler.inflight))
        self.store.evict()  # a budget lowered since the last start applies now, not later
        self.access = Access.from_settings(settings)
        self.quota = QueueQuota(self.scheduler, self.access, settings.max_queued_per_uid)
        served = Served(self.toolchains)
        self.leases = Leases(self.scheduler, self.access, self.stats, served,
                             settings.lease_max_hold)
        self.uploads = Uploads(self.leases, settings.upload_timeout)
        autotune = Autotune(self.store, self.remote, self.access)
        service = Service(self.scheduler, served, self.access, self.stats, self.snapshot,
                          self.quota, on_plan=autotune.note_plan)
        self.server = Server({**service.ops(), **self.leases.ops(), **self.uploads.ops(),
                              **autotune.ops(),
                              **ShapePlans(self.scheduler, service, autotune).ops(),
                              **Certifications(self.store, self.access).ops()},
                             self.access, self.stats, Limits.from_settings(settings))
        self.http_address = ""
        self._http: Any = None
        self._stop = asyncio.Event()

    def snapshot(self, since_zero: bool = True) -> DaemonSnapshot:
        """The daemon's one snapshot (:func:`cached.view.snapshot.take`), which ``cached
        stats``, ``GET /stats``, the page and ``/metrics`` render; counts since
        ``stats --zero`` (``since_zero``) or since the start."""
        return take(self, since_zero)

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            self.lifecycle.release()
            if self._http_sock is not None:
                self._http_sock.close()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        loop.add_signal_handler(signal.SIGHUP, self.lifecycle.reload)
        await self.pool.start()
        await self.scheduler.start()
        if self.remote is not None:
            self.remote.start()
        self.socket_path = await self.lifecycle.listen()
        event(log, logging.INFO, "daemon.listening", socket=self.socket_path,
              workers=self.pool.size, entries=self.store.totals()[0],
              toolchains={t.name: t.digest for t in self.toolchains.items})
        threading.Thread(target=self.store.scan, name="store-scan", daemon=True).start()
        self._start_http()
        flusher = loop.create_task(self._flush_loop())
        self.lifecycle.started()
        await self._stop.wait()
        event(log, logging.INFO, "daemon.stopping", in_flight=len(self.scheduler.inflight))
        flusher.cancel()
        await self.server.stop()
        self.lifecycle.release()  # a successor may take the socket path while we drain
        await self.lifecycle.drain()
        await self.scheduler.stop()
        await self.pool.stop()
        if self.remote is not None:  # queued publishes get a few seconds to go out
            await loop.run_in_executor(None, self.remote.close)
        if self._http is not None:
            self._http.should_exit = True
        await loop.run_in_executor(None, self.store.close)  # a locked index waits there
        if self.store_lock is not None:
            self.store_lock.release()
        event(log, logging.INFO, "daemon.stopped")

    def stop(self) -> None:
        self._stop.set()

    def healthy(self) -> bool:
        """Serving: a compile worker is alive, or this daemon is serve-only (no workers)."""
        return self.pool.size == 0 or self.pool.alive > 0

    async def _flush_loop(self) -> None:
        """Every FLUSH_INTERVAL_S: expire uploads, check the index file is still there
        (a vanished or replaced index is rebuilt, :meth:`Store.check_index`) and write
        batched counts and deletions, off the event loop."""
        while True:
            await asyncio.sleep(FLUSH_INTERVAL_S)
            self.uploads.expire()
            try:
                await asyncio.get_running_loop().run_in_executor(None, self.store.flush)
            except Exception as exc:  # noqa: BLE001 -- the next round tries again
                event(log, logging.ERROR, "store.flush_failed",
                      error=f"{type(exc).__name__}: {exc}"[:300])

    def _start_http(self) -> None:
        sock = self._http_sock
        if sock is None:
            return
        bound_host, bound_port = sock.getsockname()[:2]
        self.http_address = f"{bound_host}:{bound_port}"
        import uvicorn

        from .view.httpapp import make_app

        configured = self.settings.http_address
        names = ([configured[0]] if configured else []) + list(self.settings.http_allow_host)
        app = make_app(self.snapshot, self.healthy, make_metrics(self),
                       (bound_host, bound_port), names)
        from .view.httpguard import config_options

        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                                **config_options())
        self._http = uvicorn.Server(config)
        threading.Thread(target=self._http.run, kwargs={"sockets": [sock]}, name="http",
                         daemon=True).start()
        event(log, logging.INFO, "http.listening", address=self.http_address)


def _launchers(registry: toolchains.Toolchains) -> list[Launcher]:
    """One worker launcher per toolchain: its interpreter, with this code on its path, and
    the families it has (FlashInfer families only where its FlashInfer has them)."""
    code = toolchains.code_dir()
    out = []
    for t in registry.items:
        preload = [n for n in families.names() if not n.startswith("cached.test")
                   and (families.get(n).sources != "flashinfer" or n in t.sources)]
        out.append(Launcher(t.name, t.python, toolchains.environment(), str(code),
                            tuple(preload)))
    return out
def store_access(settings: Settings, socket_path: str) -> tuple[int, int | None]:
    """The store directory's mode and group: readable by exactly the users the socket
    admits. The allowlists when set (one ``allow_gid``, besides root and the daemon's own
    uid: 0750 with that group; any other list: 0700), else the socket file's own mode:
    others may connect, 0755; its group may, 0750 with that group; else 0700."""
    if settings.allow_uid or settings.allow_gid:
        others = set(settings.allow_uid) - {0, os.getuid()}
        if len(settings.allow_gid) == 1 and not others:
            return 0o750, settings.allow_gid[0]
        return 0o700, None
    try:
        st = os.stat(socket_path)
    except OSError:
        return 0o700, None
    if st.st_mode & 0o002:
        return 0o755, None
    if st.st_mode & 0o020:
        return 0o750, st.st_gid
    return 0o700, None


def _protect_store(root: Path, mode: int, gid: int | None) -> None:
    """Give the store directory ``mode`` and group ``gid``; a group this process may not
    give it leaves it 0700 (logged). A directory owned by another uid is left alone."""
    try:
        st = os.stat(root)
        if st.st_uid != os.getuid():
            event(log, logging.WARNING, "store.mode_unchanged", store=str(root),
                  owner=st.st_uid, reason="owned by another uid")
            return
        if gid is not None and st.st_gid != gid:
            try:
                os.chown(root, -1, gid)
            except OSError as exc:
                event(log, logging.WARNING, "store.group_refused", store=str(root), gid=gid,
                      error=exc.strerror, mode="0700")
                mode = 0o700
        if stat.S_IMODE(st.st_mode) != mode:
            os.chmod(root, mode)
    except OSError as exc:
        raise StoreError(f"store {root}: cannot set its mode to {mode:o} ({exc.strerror}); "
                         "the store must not be readable by users the socket refuses") from None


def _raise_descriptor_limit() -> None:
    """Lift the soft descriptor limit to the hard one: each connection holds one, and a
    reply passing descriptors two more while it is sent (server.py bounds both)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _make_remote(settings: Settings) -> Tier | None:
    """The fleet tier, or None; :class:`~cached.fleet.envelope.KeyFileError` (a
    ConfigError) for missing or unusable keys (an unsigned tier would push native code into
    every node)."""
    if not settings.remote:
        return None
    from .fleet.envelope import load_keys
    from .fleet.redis_tier import RedisTier

    keys = load_keys(settings.remote_signing_key, settings.remote_verify_keys,
                     settings.remote_read_only)
    return RedisTier(settings.remote, keys, timeout=settings.remote_timeout)


def serve(settings: Settings, reload_settings: Callable[[], Settings] | None = None) -> None:
    asyncio.run(Daemon(settings, reload_settings).run())
