"""The process pool: spawned long-lived workers, one job each at a time.

Invariants: a job runs on exactly one worker and is bounded by its timeout; a worker
that dies or overruns is killed and replaced, and only its own job fails, with a
:class:`WorkerFailed` that says why. ``size`` workers exist except while a replacement
starts. Blocking pipe I/O runs on a private thread pool, never on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from . import worker as worker_main
from .log import event

log = logging.getLogger("cached.pool")


class WorkerFailed(Exception):
    """The worker running a job died or overran its timeout."""


class JobError(Exception):
    """The job raised inside a healthy worker (a compile error, say)."""

    def __init__(self, message: str, traceback: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.traceback = traceback


class _Worker:
    def __init__(self, ctx: Any, family_names: list[str]) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=worker_main.main, args=(child, os.getpid(), family_names),
            name="cached-worker", daemon=True,
        )
        self.process.start()
        child.close()
        self.pid = self.process.pid

    def wait_ready(self, timeout: float) -> None:
        if not self.conn.poll(timeout):
            self.kill()
            raise WorkerFailed(f"worker {self.pid} did not become ready within {timeout:.0f}s")
        try:
            self.conn.recv()
        except (EOFError, OSError):
            raise WorkerFailed(f"worker {self.pid} exited while starting: {self.why()}") from None

    def call(self, kind: str, payload: dict, timeout: float) -> Any:
        try:
            self.conn.send((kind, payload))
            if not self.conn.poll(timeout):
                self.kill()
                raise WorkerFailed(f"worker {self.pid} exceeded the {timeout:.0f}s job timeout"
                                   " and was killed")
            status, result = self.conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            raise WorkerFailed(f"worker {self.pid} died during the job: {self.why()}") from None
        if status == "error":
            raise JobError(result["message"], result.get("traceback", ""))
        return result

    def why(self) -> str:
        self.process.join(timeout=5)
        code = self.process.exitcode
        if code is None:
            return "still running"
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


@dataclass(frozen=True)
class PoolSnapshot:
    """Workers by state, for stats, metrics and the status page."""

    size: int
    alive: int
    ready: int
    idle: int
    busy: int
    restarts: int


class Pool:
    def __init__(self, size: int, job_timeout: float, family_names: list[str],
                 startup_timeout: float = 300.0) -> None:
        self.size = size
        self.job_timeout = job_timeout
        self.startup_timeout = startup_timeout
        self.family_names = family_names
        self.restarts = 0
        self.busy = 0
        self._ctx = multiprocessing.get_context("spawn")
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._all: set[_Worker] = set()
        self._ready: set[_Worker] = set()
        self._threads = ThreadPoolExecutor(max_workers=size + 2, thread_name_prefix="pool-io")
        self._closing = False
        self._tasks: set[asyncio.Task] = set()

    @property
    def alive(self) -> int:
        return sum(1 for w in self._all if w.process.is_alive())

    @property
    def ready(self) -> int:
        """Workers that finished importing the toolchain and are still alive."""
        return sum(1 for w in self._ready if w.process.is_alive())

    @property
    def idle(self) -> int:
        """Ready workers not running a job: those on the idle queue and the one the
        dispatcher has taken from it while it waits for a job to give it."""
        return max(0, self.ready - self.busy)

    def snapshot(self) -> PoolSnapshot:
        return PoolSnapshot(self.size, self.alive, self.ready, self.idle, self.busy,
                            self.restarts)

    async def start(self) -> None:
        """Spawn every worker; returns at once, workers join the pool as they get ready."""
        for _ in range(self.size):
            self._spawn()

    def _spawn(self) -> None:
        if self._closing:
            return
        w = _Worker(self._ctx, self.family_names)
        self._all.add(w)
        task = asyncio.get_running_loop().create_task(self._await_ready(w))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _await_ready(self, w: _Worker) -> None:
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._threads, w.wait_ready, self.startup_timeout)
        except WorkerFailed as exc:
            self._all.discard(w)
            event(log, logging.ERROR, "worker.start_failed", pid=w.pid, reason=str(exc))
            if not self._closing:
                await asyncio.sleep(2.0)
                self._spawn()
            return
        event(log, logging.INFO, "worker.ready", pid=w.pid,
              seconds=round(time.monotonic() - started, 2))
        self._ready.add(w)
        self._idle.put_nowait(w)

    async def acquire(self) -> _Worker:
        return await self._idle.get()

    def release(self, w: _Worker) -> None:
        """Give back an acquired worker that ran nothing (its job failed before starting)."""
        self._idle.put_nowait(w)

    async def run_on(self, w: _Worker, kind: str, payload: dict,
                     timeout: float | None = None) -> Any:
        """Run one job on an acquired worker and give it back (or replace it)."""
        loop = asyncio.get_running_loop()
        self.busy += 1
        try:
            result = await loop.run_in_executor(
                self._threads, w.call, kind, payload, timeout or self.job_timeout
            )
        except WorkerFailed as exc:
            w.kill()
            self._all.discard(w)
            self._ready.discard(w)
            self.restarts += 1
            event(log, logging.ERROR, "worker.lost", pid=w.pid, reason=str(exc))
            self._spawn()
            raise
        except JobError:
            self._idle.put_nowait(w)
            raise
        finally:
            self.busy -= 1
        self._idle.put_nowait(w)
        return result

    async def stop(self) -> None:
        self._closing = True
        for task in list(self._tasks):
            task.cancel()
        for w in list(self._all):
            w.kill()
        self._all.clear()
        self._ready.clear()
        self._threads.shutdown(wait=False, cancel_futures=True)
