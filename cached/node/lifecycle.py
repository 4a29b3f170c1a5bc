"""Running under a service manager: listening-socket handoff, readiness, watchdog and
status, SIGHUP reload and the SIGTERM drain.

The daemon (daemon.py) calls in at fixed points: ``bind()`` before it opens its store
(after the HTTP port is bound), ``listen()`` once it can serve, ``started()`` once serving,
``release()`` and ``drain()`` on SIGTERM before the scheduler and pool stop, ``reload()``
on SIGHUP.

Drain: the listening socket is closed first and the socket path given up (its file
unlinked only if it is still the one this daemon created, then its lock released), so a
successor can start on the same path at once; connected clients keep their connections;
then :meth:`Scheduler.drain` stops starting jobs, tells waiters of queued jobs
``unavailable`` at once (a client then compiles in-process), gives running compilations
``drain_timeout`` seconds to finish and be stored, and tells whoever still waits after
that; then the workers stop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from cached import config
from cached.config import size_text
from cached.log import event
from cached.node.listeners import UnixListener
from cached.node.systemd import listen_fds, notify, watchdog_interval
from cached.server import Limits
from cached.store.store import Budget
from cached.view.snapshot import take

if TYPE_CHECKING:
    from cached.ops.uploads import Uploads
    from cached.pool import Pool
    from cached.scheduler import Scheduler
    from cached.server import Access, Server
    from cached.service import QueueQuota
    from cached.store.store import Store

log = logging.getLogger("cached.daemon")

STATUS_EVERY_S = 5.0


class Wired(Protocol):
    """What the lifecycle reads and changes of the daemon's components (cached.daemon)."""

    settings: config.Settings
    server: Server
    store: Store
    pool: Pool
    scheduler: Scheduler
    access: Access
    quota: QueueQuota
    uploads: Uploads


class Lifecycle:
    def __init__(self, daemon: Wired, reload_settings: Callable[[], config.Settings] | None
                 ) -> None:
        self.daemon = daemon
        self.reload_settings = reload_settings
        self.inherited = False
        self.listener: UnixListener | None = None
        self.draining = False
        self._tasks: set[asyncio.Task] = set()

    # -- hooks -------------------------------------------------------------------------

    def bind(self) -> UnixListener:
        """The Unix socket, before the store is opened: the one systemd passed (LISTEN_FDS)
        or the configured path, claimed under its lock (listeners.UnixListener.claim;
        StartRefused says why it cannot be)."""
        d = self.daemon
        sockets = listen_fds()
        if not sockets:
            self.listener = UnixListener.claim(d.settings.socket, d.settings.socket_mode)
            return self.listener
        for extra in sockets[1:]:
            extra.close()
        self.inherited = True
        self.listener = UnixListener.inherit(sockets[0])
        event(log, logging.INFO, "daemon.socket_inherited", socket=self.listener.path,
              passed=len(sockets))
        return self.listener

    async def listen(self) -> str:
        """Serve on the socket :meth:`bind` took; returns its path."""
        assert self.listener is not None
        self.listener.listen()
        await self.daemon.server.start(self.listener.sock)
        return self.listener.path

    def release(self) -> None:
        """Give the socket path up (stop listening, unlink what this daemon created, drop
        the lock): a successor may start on it while this daemon drains. Idempotent."""
        if self.listener is not None:
            self.listener.release()

    def started(self) -> None:
        """Tell the service manager we serve; keep STATUS and the watchdog going."""
        notify("READY=1", f"STATUS={self.status()}", f"MAINPID={os.getpid()}")
        if os.environ.get("NOTIFY_SOCKET"):
            self._spawn(self._notify_loop())

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def status(self) -> str:
        """The systemd ``STATUS=`` line, from the daemon's snapshot (counts since start)."""
        snap = take(self.daemon, since_zero=False)
        store, pool, jobs, served = snap.store, snap.pool, snap.jobs, snap.counts.hit_ratio
        budget = f" of {size_text(store.max_bytes)}" if store.max_bytes else ""
        ratio = f", hit ratio {100 * served:.0f}%" if served is not None else ""
        state = "draining" if self.draining else "serving"
        return (f"{state}: {store.entries} kernels ({size_text(store.bytes)}{budget}), "
                f"{pool.ready}/{pool.size} workers ready, {jobs.queued} queued, "
                f"{jobs.running} compiling{ratio}")

    async def _notify_loop(self) -> None:
        interval = watchdog_interval()
        period = min(interval, STATUS_EVERY_S) if interval else STATUS_EVERY_S
        while True:
            await asyncio.sleep(period)
            notify(f"STATUS={self.status()}", *(["WATCHDOG=1"] if interval else []))

    async def drain(self) -> dict:
        """Finish running compilations up to the drain deadline; tell every waiter."""
        d = self.daemon
        self.draining = True
        for task in list(self._tasks):
            task.cancel()
        timeout = d.settings.drain_timeout
        notify("STOPPING=1", f"STATUS=draining {d.scheduler.running} compilations "
               f"(up to {timeout:.0f}s)")
        report = await d.scheduler.drain(timeout)
        await asyncio.sleep(0.2)  # the error replies go out before the workers stop
        event(log, logging.WARNING if report["abandoned"] else logging.INFO, "daemon.drained",
              **report)
        return report

    def reload(self) -> None:
        """SIGHUP: resolve the settings again and apply what can change while running."""
        d = self.daemon
        now_us = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        notify("RELOADING=1", f"MONOTONIC_USEC={now_us}")
        try:
            if self.reload_settings is None:
                raise RuntimeError("this daemon was started without a configuration to reload")
            fresh = self.reload_settings()
        except Exception as exc:  # noqa: BLE001 -- a bad file leaves the running settings
            event(log, logging.ERROR, "daemon.reload_failed", error=str(exc))
            notify("READY=1", f"STATUS={self.status()}")
            return
        settings, applied, ignored = config.reload(d.settings, fresh)
        d.settings = settings
        logging.getLogger().setLevel(settings.log_level.upper())
        d.pool.job_timeout = settings.job_timeout
        d.store.set_budget(Budget(settings.max_bytes, settings.max_files, settings.evict_grace))
        d.access.update(settings.allow_uid, settings.allow_gid, settings.publish_uid,
                        settings.publish_gid, settings.trust_group, settings.writeback)
        d.server.limits = Limits.from_settings(settings)
        d.quota.limit = settings.max_queued_per_uid
        d.uploads.idle_s = settings.upload_timeout
        event(log, logging.INFO, "daemon.reloaded",
              applied={name: getattr(settings, name) for name in applied},
              file=str(settings.file) if settings.file else None)
        if ignored:
            event(log, logging.WARNING, "daemon.reload_needs_restart", options=ignored)
        self._spawn(self._evict_after_reload())

    async def _evict_after_reload(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.daemon.store.evict)
        notify("READY=1", f"STATUS={self.status()}")
