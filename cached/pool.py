"""The process pool: long-lived workers of every toolchain, one job each at a time.

Each worker belongs to one toolchain (cached/toolchain/toolchains.py) and is that toolchain's own
interpreter, started as a subprocess (cached/worker.py) with PYTHONPATH holding only this
package and the client package, and talking over a socketpair (not stdout: compilers print).

Invariants: a job runs on exactly one worker of the toolchain it names and is bounded by
its timeout; a worker that dies or overruns is killed and replaced, and only its own job
fails, with a :class:`WorkerFailed` that says why. One budget of ``size`` workers (cores,
memory, cgroup: cached/node/sizing.py) is shared by all toolchains: at start it is dealt out
round-robin, default toolchain first; a toolchain with work waiting and no idle worker gets
a new one while the budget allows, else the idle worker of a toolchain with nothing waiting
is retired for it. Blocking socket I/O runs on a private thread pool, never on the event
loop; processes are started from the event loop's thread (PR_SET_PDEATHSIG follows the
thread that started the child).

A worker that dies before it is ready is started again after a back-off (``retry``: from
1 s, doubling per failure of that toolchain up to 60 s, back to the start once one of its
workers is ready), and counted in ``restarts``. While a toolchain has no ready worker and
its last start failed it is *broken*: its waiters, and every :meth:`Pool.acquire` until a
worker of it is ready, get :class:`WorkerFailed` naming the cause at once (the exit status
and the last words the worker wrote on stderr, which is forwarded to the daemon's).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from cached_client.backoff import Backoff

from .log import event, one_line
from .worker import recv_frame, send_frame

log = logging.getLogger("cached.pool")

WORKER_MAIN = "from cached.worker import main; main()"
RETRY = (1.0, 60.0)
"""Seconds before a worker that died while starting is started again: the first, and the
most it doubles to."""
TAIL_BYTES = 4096
STDERR_BYTES = 64 << 10
"""Bytes of workers' stderr forwarded per toolchain per STDERR_WINDOW_S; the rest is read
(the worker never blocks on it) and dropped, and how much is logged once a window."""
STDERR_WINDOW_S = 10.0
_stderr_windows: dict[str, list[float]] = {}  # toolchain -> [window start, sent, dropped]


def _stderr_room(toolchain: str, n: int) -> int:
    """How many of ``n`` more bytes of ``toolchain``'s workers' stderr may be forwarded now;
    the first bytes dropped in a window are logged (``worker.stderr_dropped``, with what the
    window before dropped), once."""
    now = time.monotonic()
    window = _stderr_windows.get(toolchain)
    before = 0
    if window is None or now - window[0] >= STDERR_WINDOW_S:
        before = int(window[2]) if window is not None else 0
        window = _stderr_windows[toolchain] = [now, 0, 0]
    room = max(0, min(n, STDERR_BYTES - int(window[1])))
    if room < n and not window[2]:
        event(log, logging.WARNING, "worker.stderr_dropped", toolchain=toolchain,
              limit=f"{STDERR_BYTES} bytes a {STDERR_WINDOW_S:g} s",
              dropped_before=before, hint="the rest of this window's stderr is dropped")
    window[1] += room
    window[2] += n - room
    return room
"""How much of a worker's latest stderr is kept to say why it died."""


class WorkerFailed(Exception):
    """The worker running a job died or overran its timeout."""


class JobError(Exception):
    """The job raised inside a healthy worker (a compile error, say)."""

    def __init__(self, message: str, traceback: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.traceback = traceback


@dataclass(frozen=True)
class Launcher:
    """How to start a worker of one toolchain: its interpreter, environment, working
    directory and the families it preloads."""

    toolchain: str
    python: str
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    families: tuple[str, ...] = ()


class _Worker:
    """One worker process; started on the event loop's thread, whose loop forwards its
    stderr to the daemon's (at most STDERR_BYTES per STDERR_WINDOW_S per toolchain; keeping
    the last TAIL_BYTES to say why it died)."""

    def __init__(self, launcher: Launcher) -> None:
        self.toolchain = launcher.toolchain
        self.tail = b""
        self.sock, child = socket.socketpair()
        try:
            self.process = subprocess.Popen(
                [launcher.python, "-c", WORKER_MAIN, str(child.fileno()), str(os.getpid()),
                 json.dumps(list(launcher.families))],
                pass_fds=(child.fileno(),), env=dict(launcher.env) or None, cwd=launcher.cwd,
                stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
        except BaseException:
            self.sock.close()
            raise
        finally:
            child.close()
        self.pid = self.process.pid
        self.idle_since = time.monotonic()
        self._loop = asyncio.get_running_loop()
        self._stderr = self.process.stderr.fileno()
        os.set_blocking(self._stderr, False)
        self._loop.add_reader(self._stderr, self.forward_stderr)

    def forward_stderr(self) -> None:
        """Copy what the worker wrote on stderr to the daemon's; at its end, stop."""
        while True:
            try:
                data = os.read(self._stderr, 1 << 16)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._loop.remove_reader(self._stderr)
                self.process.stderr.close()
                return
            self.tail = (self.tail + data)[-TAIL_BYTES:]
            data = data[:_stderr_room(self.toolchain, len(data))]
            with contextlib.suppress(OSError):
                while data:
                    data = data[os.write(2, data):]

    def last_words(self) -> str:
        """What the worker last wrote on stderr, as one line (on the loop's thread, after
        it exited: all of it is in the pipe by then)."""
        if not self.process.stderr.closed:
            self.forward_stderr()
        said = one_line(self.tail, 600)
        return f"; it wrote: {said}" if said else "; it wrote nothing on stderr"

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self, timeout: float) -> None:
        self.sock.settimeout(timeout)
        try:
            recv_frame(self.sock)
        except TimeoutError:
            self.kill()
            raise WorkerFailed(f"worker {self.pid} did not become ready within {timeout:.0f}s"
                               ) from None
        except (EOFError, OSError, ValueError):
            raise WorkerFailed(f"worker {self.pid} exited while starting: {self.why()}") from None

    def call(self, kind: str, payload: dict, timeout: float) -> Any:
        self.sock.settimeout(timeout)
        try:
            send_frame(self.sock, {"kind": kind, "payload": payload})
            reply = recv_frame(self.sock)
        except TimeoutError:
            self.kill()
            raise WorkerFailed(f"worker {self.pid} exceeded the {timeout:.0f}s job timeout"
                               " and was killed") from None
        except (EOFError, OSError, ValueError):
            raise WorkerFailed(f"worker {self.pid} died during the job: {self.why()}") from None
        if "error" in reply:
            raise JobError(reply["error"]["message"], reply["error"].get("traceback", ""))
        return reply["ok"]

    def why(self) -> str:
        try:
            code = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "still running"
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self.sock.close()


@dataclass(frozen=True)
class PoolSnapshot:
    """Workers by state, for stats, metrics and the status page; ``toolchains`` has the
    same counts per toolchain name."""

    size: int
    alive: int
    ready: int
    idle: int
    busy: int
    restarts: int
    toolchains: Mapping[str, Mapping[str, int]] = field(default_factory=dict)


class Pool:
    def __init__(self, size: int, job_timeout: float, launchers: Sequence[Launcher],
                 startup_timeout: float = 300.0, retry: tuple[float, float] = RETRY) -> None:
        self.size = size
        self.job_timeout = job_timeout
        self.startup_timeout = startup_timeout
        self.launchers = {launcher.toolchain: launcher for launcher in launchers}
        self.restarts = 0
        self.busy = 0
        self._idle: dict[str, collections.deque[_Worker]] = {
            name: collections.deque() for name in self.launchers}
        self._waiters: dict[str, collections.deque[asyncio.Future]] = {
            name: collections.deque() for name in self.launchers}
        self._busy: collections.Counter[str] = collections.Counter()
        self._all: set[_Worker] = set()
        self._ready: set[_Worker] = set()
        self._threads = ThreadPoolExecutor(max_workers=size + 2, thread_name_prefix="pool-io")
        self._closing = False
        self._tasks: set[asyncio.Task] = set()
        self.retry = retry
        self._backoff = {name: Backoff(*self.retry) for name in self.launchers}
        self.broken: dict[str, str] = {}
        """Toolchain name -> why it has no worker (its last start failed, none is ready)."""

    @property
    def alive(self) -> int:
        return sum(1 for w in self._all if w.is_alive())

    @property
    def ready(self) -> int:
        """Workers that finished importing their toolchain and are still alive."""
        return sum(1 for w in self._ready if w.is_alive())

    @property
    def idle(self) -> int:
        return sum(len(q) for q in self._idle.values())

    def snapshot(self) -> PoolSnapshot:
        per = {name: {"alive": sum(1 for w in self._all if w.toolchain == name and w.is_alive()),
                      "ready": sum(1 for w in self._ready
                                   if w.toolchain == name and w.is_alive()),
                      "idle": len(self._idle[name]), "busy": self._busy[name]}
               for name in self.launchers}
        return PoolSnapshot(self.size, self.alive, self.ready, self.idle, self.busy,
                            self.restarts, per)

    async def start(self) -> None:
        """Deal the budget out to the toolchains round-robin and spawn; returns at once,
        workers join the pool as they get ready."""
        names = list(self.launchers)
        for i in range(self.size if names else 0):
            self._spawn(names[i % len(names)])

    def _spawn(self, name: str) -> None:
        if self._closing:
            return
        try:
            w = _Worker(self.launchers[name])
        except OSError as exc:
            self._start_failed(name, f"its interpreter could not be started: {exc}")
            return
        self._all.add(w)
        self._task(self._await_ready(w))

    @property
    def _retry_in(self) -> dict[str, float]:
        """Seconds before the next start of each toolchain's worker, should one fail now."""
        return {name: b.upcoming for name, b in self._backoff.items()}

    def _start_failed(self, name: str, reason: str, pid: int | None = None) -> None:
        """A worker of ``name`` died before it was ready: count it, start another after the
        back-off, and if none of ``name`` is ready, fail its waiters now with ``reason``."""
        self.restarts += 1
        delay = self._backoff[name].next()
        event(log, logging.ERROR, "worker.start_failed", pid=pid, toolchain=name,
              reason=reason, retry_in_s=delay)
        if not any(w.toolchain == name and w.is_alive() for w in self._ready):
            self.broken[name] = (f"toolchain {name}'s workers die while starting ({reason}); "
                                 f"starting another in {delay:g}s")
            for future in self._waiters[name]:
                if not future.done():
                    future.set_exception(WorkerFailed(self.broken[name]))
            self._waiters[name].clear()
        self._retry_later(name, delay)

    def _task(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _retry_later(self, name: str, delay: float) -> None:
        async def later() -> None:
            await asyncio.sleep(delay)
            self._spawn(name)

        if not self._closing:
            self._task(later())

    async def _await_ready(self, w: _Worker) -> None:
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._threads, w.wait_ready, self.startup_timeout)
        except WorkerFailed as exc:
            self._all.discard(w)
            w.kill()
            self._start_failed(w.toolchain, f"{exc}{w.last_words()}", w.pid)
            return
        event(log, logging.INFO, "worker.ready", pid=w.pid, toolchain=w.toolchain,
              seconds=round(time.monotonic() - started, 2))
        self._ready.add(w)
        self.broken.pop(w.toolchain, None)
        self._backoff[w.toolchain].reset()
        self._release(w)

    def _release(self, w: _Worker) -> None:
        """``w`` is free: to a waiter of its toolchain, else to a toolchain waiting with no
        worker coming (retired for it), else idle."""
        waiters = self._waiters[w.toolchain]
        while waiters:
            future = waiters.popleft()
            if not future.done():
                future.set_result(w)
                return
        w.idle_since = time.monotonic()
        self._idle[w.toolchain].append(w)
        self._rebalance()

    def _starting(self, name: str) -> int:
        return sum(1 for w in self._all if w.toolchain == name and w not in self._ready)

    def _rebalance(self) -> None:
        """Give every toolchain with a waiter and no worker starting a worker: from the
        budget, else by retiring an idle worker of a toolchain nobody waits for."""
        for name, waiters in self._waiters.items():
            if not any(not f.done() for f in waiters) or self._starting(name):
                continue
            if len(self._all) < self.size:
                self._spawn(name)
                continue
            donors = [w for other, idle in self._idle.items() if other != name
                      and not any(not f.done() for f in self._waiters[other]) for w in idle]
            if donors:
                victim = min(donors, key=lambda w: w.idle_since)
                self._idle[victim.toolchain].remove(victim)
                self._all.discard(victim)
                self._ready.discard(victim)
                victim.kill()
                event(log, logging.INFO, "worker.retired", pid=victim.pid,
                      toolchain=victim.toolchain, for_toolchain=name)
                self._spawn(name)

    async def acquire(self, name: str) -> _Worker:
        """An idle worker of toolchain ``name``, waiting (and asking for one) if none is;
        WorkerFailed at once while ``name`` is broken (see the module doc)."""
        idle = self._idle[name]
        if idle:
            return idle.popleft()
        if name in self.broken:
            raise WorkerFailed(self.broken[name])
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiters[name].append(future)
        self._rebalance()
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self._release(future.result())
            raise

    def release(self, w: _Worker) -> None:
        """Give back an acquired worker that ran nothing (its job went away or failed
        before it started)."""
        self._release(w)

    async def run_on(self, w: _Worker, kind: str, payload: dict,
                     timeout: float | None = None) -> Any:
        """Run one job on an acquired worker and give it back (or replace it)."""
        loop = asyncio.get_running_loop()
        self.busy += 1
        self._busy[w.toolchain] += 1
        try:
            result = await loop.run_in_executor(
                self._threads, w.call, kind, payload, timeout or self.job_timeout
            )
        except WorkerFailed as exc:
            w.kill()
            self._all.discard(w)
            self._ready.discard(w)
            self.restarts += 1
            event(log, logging.ERROR, "worker.lost", pid=w.pid, toolchain=w.toolchain,
                  reason=str(exc))
            self._spawn(w.toolchain)
            raise
        except JobError:
            self._release(w)
            raise
        finally:
            self.busy -= 1
            self._busy[w.toolchain] -= 1
        self._release(w)
        return result

    async def stop(self) -> None:
        self._closing = True
        for task in list(self._tasks):
            task.cancel()
        for waiters in self._waiters.values():
            for future in waiters:
                future.cancel()
        for w in list(self._all):
            w.kill()
        self._all.clear()
        self._ready.clear()
        self._threads.shutdown(wait=False, cancel_futures=True)
