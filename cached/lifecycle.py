"""Running under a service manager: listening-socket handoff, readiness, watchdog and
status, SIGHUP reload, the SIGTERM drain, the store budget and the operator ops.

The daemon (daemon.py) calls in at fixed points: ``listen()`` instead of creating the
socket itself, ``started()`` once serving, ``drain()`` on SIGTERM before the scheduler
and pool stop, ``reload()`` on SIGHUP. The ops registered here are ``report`` (clients
report in-process fallbacks), and ``gc`` and ``verify`` (publish permission: root and
the daemon's uid by default).

Drain: the listening socket is closed first (connected clients keep their
connections), the dispatcher stops starting jobs, queued jobs answer their waiters
``unavailable`` at once (a client then compiles in-process), running compilations get
``drain_timeout`` seconds to finish and be stored, and whatever is still waiting after
that is told ``unavailable`` too before the workers are stopped.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

from cached_client.errors import DaemonUnavailable, InvalidTactic

from .log import event
from .server import Access
from .systemd import listen_fds, notify, watchdog_interval

log = logging.getLogger("cached.daemon")

STATUS_EVERY_S = 5.0
RELOADABLE = ("log_level", "job_timeout", "max_bytes", "max_files", "evict_grace",
              "drain_timeout", "allow_uid", "allow_gid", "publish_uid", "publish_gid")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


class Lifecycle:
    def __init__(self, daemon: Any) -> None:
        self.daemon = daemon
        self.inherited = False
        self.draining = False
        self._tasks: set[asyncio.Task] = set()
        settings = daemon.settings
        store = daemon.store
        store.max_bytes = settings.max_bytes
        store.max_files = settings.max_files
        store.evict_grace = settings.evict_grace
        store.protected = lambda: tuple(daemon.scheduler.inflight)
        self.config = dict(settings.config or {})
        server = daemon.server
        server.register("report", self._report)
        server.register("gc", self._gc, publish=True)
        server.register("verify", self._verify, publish=True)

    # -- hooks -------------------------------------------------------------------------

    async def listen(self) -> None:
        """Serve on a socket systemd passed (LISTEN_FDS) or create ``settings.socket``."""
        d = self.daemon
        sockets = listen_fds()
        if not sockets:
            await d.server.start(d.settings.socket, mode=d.settings.socket_mode)
            return
        sock = sockets[0]
        for extra in sockets[1:]:
            extra.close()
        name = sock.getsockname()
        d.settings.socket = name.decode() if isinstance(name, bytes) else str(name)
        sock.setblocking(False)
        self.inherited = True
        await d.server.start(sock=sock)
        event(log, logging.INFO, "daemon.socket_inherited", socket=d.settings.socket,
              passed=len(sockets))

    def started(self) -> None:
        """Tell the service manager we serve; keep STATUS and the watchdog going."""
        notify("READY=1", f"STATUS={self.status()}", f"MAINPID={os.getpid()}")
        if os.environ.get("NOTIFY_SOCKET"):
            task = asyncio.get_running_loop().create_task(self._notify_loop())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def snapshot(self) -> dict:
        store = self.daemon.store
        return {
            "max_bytes": store.max_bytes, "max_files": store.max_files,
            "evictions": store.evictions, "evicted_bytes": store.evicted_bytes,
            "over_budget": store.over_budget,
            "client_fallbacks": self.daemon.stats.counters["client_fallbacks"],
            "draining": self.draining,
        }

    def status(self) -> str:
        d = self.daemon
        entries, size = d.store.totals()
        c = d.stats.counters
        total = c["hits"] + c["misses"]
        budget = f" of {_size(d.store.max_bytes)}" if d.store.max_bytes else ""
        ratio = f", hit ratio {100 * c['hits'] / total:.0f}%" if total else ""
        state = "draining" if self.draining else "serving"
        return (f"{state}: {entries} kernels ({_size(size)}{budget}), "
                f"{d.pool.ready}/{d.pool.size} workers ready, {d.scheduler.queued} queued, "
                f"{d.scheduler.running} compiling{ratio}")

    async def _notify_loop(self) -> None:
        interval = watchdog_interval()
        period = min(interval, STATUS_EVERY_S) if interval else STATUS_EVERY_S
        while True:
            await asyncio.sleep(period)
            notify(f"STATUS={self.status()}", *(["WATCHDOG=1"] if interval else []))

    async def drain(self) -> dict:
        """Finish running compilations up to the deadline; tell every waiter."""
        d = self.daemon
        s = d.scheduler
        self.draining = True
        for task in list(self._tasks):
            task.cancel()
        timeout = d.settings.drain_timeout
        notify("STOPPING=1", f"STATUS=draining {s.running} compilations (up to {timeout:.0f}s)")
        dispatcher = getattr(s, "_dispatcher", None)
        if dispatcher is not None:
            dispatcher.cancel()
        cancelled = 0
        for job in [j for j in s.inflight.values() if j.state == "queued"]:
            s.inflight.pop(job.key, None)
            job.state = "done"
            if not job.future.done():
                job.future.set_exception(DaemonUnavailable(
                    "the daemon is shutting down and had not started this compilation"))
                cancelled += 1
        running = s.running
        event(log, logging.INFO, "daemon.draining", running=running, queued_cancelled=cancelled,
              deadline_s=timeout)
        deadline = time.monotonic() + timeout
        while s.running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        abandoned = s.running
        for job in list(s.inflight.values()):
            if not job.future.done():
                job.future.set_exception(DaemonUnavailable(
                    f"the daemon is shutting down; this compilation did not finish within "
                    f"the {timeout:.0f}s drain deadline"))
        await asyncio.sleep(0.2)  # the error replies go out before the workers stop
        report = {"finished": running - abandoned, "abandoned": abandoned,
                  "queued_cancelled": cancelled}
        event(log, logging.WARNING if abandoned else logging.INFO, "daemon.drained", **report)
        return report

    def reload(self) -> None:
        """SIGHUP: read the configuration again and apply what can change while running."""
        d = self.daemon
        fn = d.settings.reload
        now_us = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        notify("RELOADING=1", f"MONOTONIC_USEC={now_us}")
        try:
            if fn is None:
                raise RuntimeError("this daemon was started without a configuration to reload")
            effective = fn()
        except Exception as exc:  # noqa: BLE001 -- a bad file leaves the running config
            event(log, logging.ERROR, "daemon.reload_failed", error=str(exc))
            notify("READY=1", f"STATUS={self.status()}")
            return
        new = effective.values
        changed = {k: new[k] for k in new if self.config.get(k) != new[k]}
        applied = {k: v for k, v in changed.items() if k in RELOADABLE}
        ignored = sorted(k for k in changed if k not in RELOADABLE)
        if "log_level" in applied:
            logging.getLogger().setLevel(new["log_level"].upper())
        if "job_timeout" in applied:
            d.pool.job_timeout = d.settings.job_timeout = new["job_timeout"]
        if "drain_timeout" in applied:
            d.settings.drain_timeout = new["drain_timeout"]
        d.store.max_bytes, d.store.max_files = new["max_bytes"], new["max_files"]
        d.store.evict_grace = new["evict_grace"]
        if {"allow_uid", "allow_gid", "publish_uid", "publish_gid"} & set(applied):
            d.server.access = Access(
                allow_uids=frozenset(new["allow_uid"]), allow_gids=frozenset(new["allow_gid"]),
                publish_uids=frozenset(new["publish_uid"] or {0, os.getuid()}),
                publish_gids=frozenset(new["publish_gid"]))
        for k in applied:
            self.config[k] = new[k]
        event(log, logging.INFO, "daemon.reloaded", applied=applied,
              file=str(effective.file) if effective.file else None)
        if ignored:
            event(log, logging.WARNING, "daemon.reload_needs_restart", options=ignored)
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._evict_after_reload())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _evict_after_reload(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.daemon.store.evict)
        notify("READY=1", f"STATUS={self.status()}")

    # -- ops ---------------------------------------------------------------------------

    async def _report(self, m: dict, peer: Any) -> tuple[dict, bytes | None]:
        fallbacks = m.get("fallbacks")
        if not isinstance(fallbacks, dict) or len(fallbacks) > 64:
            raise InvalidTactic("report needs 'fallbacks': {family: count}, at most 64")
        for family, count in fallbacks.items():
            if (not isinstance(count, int) or isinstance(count, bool)
                    or not 0 < count <= 1_000_000 or len(family) > 200):
                raise InvalidTactic(f"bad fallback count for {family[:200]!r}: {count!r}")
        for family, count in fallbacks.items():
            self.daemon.stats.count("client_fallbacks", family, count)
        event(log, logging.WARNING, "client.fallbacks_reported", pid=peer.pid, uid=peer.uid,
              fallbacks=fallbacks)
        return {"ok": True}, None

    async def _gc(self, m: dict, peer: Any) -> tuple[dict, bytes | None]:
        limits = {}
        for name in ("max_bytes", "max_files", "grace"):
            value = m.get(name)
            if value is not None:
                if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                    raise InvalidTactic(f"{name} must be a non-negative number")
                limits[name] = value if name == "grace" else int(value)
        store = self.daemon.store
        report = await asyncio.get_running_loop().run_in_executor(
            None, lambda: store.evict(**limits))
        entries, size = store.totals()
        return {"ok": True, **report, "entries": entries, "bytes": size,
                "max_bytes": limits.get("max_bytes", store.max_bytes),
                "max_files": limits.get("max_files", store.max_files)}, None

    async def _verify(self, m: dict, peer: Any) -> tuple[dict, bytes | None]:
        report = await asyncio.get_running_loop().run_in_executor(None, self.daemon.store.verify)
        return {"ok": True, **report}, None
