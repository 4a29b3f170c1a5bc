"""The scheduler: from a request to a stored artifact, compiling each key at most once.

Invariants:
- single-flight: at most one job per key is queued or running, whatever the number of
  waiters or processes; every waiter gets that job's result or its error;
- priority: a job some client waits on (interactive) runs before pre-warm work, and a
  queued pre-warm job is promoted when a client starts waiting on it;
- a waiter's deadline bounds only its own wait; the job goes on and is stored;
- every failure of a job (its work directory cannot be made, the worker dies, the build
  fails) reaches every waiter as ``compile_failed``, is counted and logged, and gives the
  worker back;
- persistence is best effort: a kernel built but refused by the store (disk or inodes
  full, a budget smaller than the kernel) still reaches that job's waiters, origin
  ``unstored``, served from the job's work directory (kept ``UNSTORED_HOLD_S``);
- store lookups (blob hashing) run on the store's reader threads, never on the loop;
- identity: a request's key is built from the identity its client states, and a miss is
  compiled only by the registered toolchain that matches it (cached/toolchain/toolchains.py: its own
  queue and its own workers), else refused at once with ``unknown_toolchain``. A stored row
  names the toolchain and sources of its key, never the daemon's own in their place.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import logging
import shutil
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cached_client import protocol as p
from cached_client.errors import (
    CachedError,
    CompileFailed,
    DaemonUnavailable,
    DeadlineExceeded,
    InvalidArgument,
    InvalidTactic,
    Overloaded,
    UnknownToolchain,
)
from cached_client.keys import KernelRequest

from cached import families
from cached.toolchain import compiler_stack
from cached.toolchain.toolchains import Route, Toolchains
from cached.toolchain.trust import writeback_key

from .build import BuildResult
from .families.base import DEFAULT_SM_COUNT, Family
from .fleet.tier import Tier
from .log import event
from .pool import JobError, Pool, WorkerFailed
from .stats import Stats
from .store.rows import Entry, row_for
from .store.store import PersistFailed, Store

log = logging.getLogger("cached.scheduler")

PRIORITY_RANK = {name: rank for rank, name in enumerate(p.PRIORITIES)}
"""A request's priority name -> its rank in the queue (lower goes first)."""
INTERACTIVE, PREWARM = PRIORITY_RANK["interactive"], PRIORITY_RANK["prewarm"]
UNSTORED_HOLD_S = 120.0
"""How long the work directory of an unstored kernel outlives its job (seconds): its
waiters open the files by path within that time."""
PLAN_MEMO_MAX = 128
"""Plans of light families remembered (a whole one about 0.6 MB for cached.hopper_fp8's
454 tactics, a first tactic alone far less: at most about 80 MB)."""
RESOLVED_MAX = 4096
"""Resolved requests remembered (the oldest forgotten first): a hit does not canonicalise
its request or hash its key again."""


@dataclass
class Job:
    key: str
    family: Family
    request: KernelRequest | None
    priority: int
    future: asyncio.Future
    state: str = "queued"
    plan: dict | None = None  # a planning job (no key, no store) when set
    enqueued: float = field(default_factory=time.monotonic)
    origin: str = "compiled"  # "remote": from the fleet tier; "unstored": not persisted
    route: Route | None = None  # the key's toolchain and sources, and who compiles it
    toolchain: str = ""  # the name of the toolchain whose workers run it


@dataclass(frozen=True)
class SchedulerSnapshot:
    """Jobs by state, for stats, metrics and the status page."""

    in_flight: int
    queued: int
    running: int


class Scheduler:
    def __init__(self, store: Store, pool: Pool, stats: Stats, toolchains: Toolchains,
                 max_queue: int = 100_000, remote: Tier | None = None) -> None:
        self.store = store
        self.pool = pool
        self.remote = remote  # the fleet tier, or None
        self.toolchains = toolchains
        self.stats = stats
        self.max_queue = max_queue
        self.inflight: dict[str, Job] = {}
        self.running = 0
        names = [t.name for t in toolchains.items]
        self._heaps: dict[str, list[tuple[int, int, Job]]] = {n: [] for n in names}
        self._has_work = {n: asyncio.Event() for n in names}
        self._seq = itertools.count()
        self._plans: OrderedDict[tuple, list[KernelRequest]] = OrderedDict()
        self._dispatchers: list[asyncio.Task] = []
        self._tasks: set[asyncio.Task] = set()
        self._resolved: dict[tuple, tuple[Family, KernelRequest, Route]] = {}
        self._canonical: dict[tuple, tuple[Family, KernelRequest]] = {}

    @property
    def queued(self) -> int:
        return sum(1 for j in self.inflight.values() if j.state == "queued")

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._dispatchers = [loop.create_task(self._dispatch(name))
                             for name in self._heaps if name in self.pool.launchers]

    def snapshot(self) -> SchedulerSnapshot:
        return SchedulerSnapshot(len(self.inflight), self.queued, self.running)

    async def drain(self, timeout: float) -> dict:
        """Stop starting jobs; tell waiters of queued jobs at once; give running
        compilations ``timeout`` seconds to finish and be stored; then tell every waiter
        still waiting. Waiters hear ``unavailable`` (a client then compiles in-process)."""
        for dispatcher in self._dispatchers:
            dispatcher.cancel()
        cancelled = 0
        for job in [j for j in self.inflight.values() if j.state == "queued"]:
            self.inflight.pop(job.key, None)
            job.state = "done"
            if not job.future.done():
                job.future.set_exception(DaemonUnavailable(
                    "the daemon is shutting down and had not started this compilation"))
                cancelled += 1
        running = self.running
        event(log, logging.INFO, "daemon.draining", running=running, queued_cancelled=cancelled,
              deadline_s=timeout)
        deadline = time.monotonic() + timeout
        while self.running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        abandoned = self.running
        self._fail_all(f"the daemon is shutting down; this compilation did not finish "
                       f"within the {timeout:.0f}s drain deadline")
        return {"finished": running - abandoned, "abandoned": abandoned,
                "queued_cancelled": cancelled}

    async def stop(self) -> None:
        for dispatcher in self._dispatchers:
            dispatcher.cancel()
        self._fail_all("the daemon is shutting down")

    def _fail_all(self, why: str) -> None:
        for job in list(self.inflight.values()):
            if not job.future.done():
                job.future.set_exception(DaemonUnavailable(why))

    # -- requests ----------------------------------------------------------------------

    def resolve(self, request: KernelRequest, identity: p.Identity | None = None
                ) -> tuple[Family, KernelRequest, Route]:
        """Validate a request against its family; returns the family, the canonical request
        and its route (store key, and who compiles it) for the client's ``identity``.
        Remembered (RESOLVED_MAX): families, their sources and the toolchains are fixed for
        the daemon's life, so the same request and identity always resolve alike; the
        canonical request is remembered apart from the identity, so a new environment
        asking for a known kernel only routes it."""
        memo = _resolve_key(request, identity)
        resolved = self._resolved.get(memo) if memo is not None else None
        if resolved is None:
            asked = None if memo is None else memo[:-1]  # the request alone
            held = self._canonical.get(asked) if asked is not None else None
            if held is None:
                family = families.get(request.family)
                held = family, family.canonical_request(request)
                if asked is not None:
                    _remember(self._canonical, asked, held)
            family, canonical = held
            resolved = family, canonical, self.toolchains.route(family, canonical, identity)
            if memo is not None:
                _remember(self._resolved, memo, resolved)
        return resolved

    async def get(self, request: KernelRequest, priority: int = INTERACTIVE,
                  timeout: float = 60.0, identity: p.Identity | None = None,
                  admit: Callable[[str], None] | None = None,
                  trust_group: str | None = None) -> tuple[Entry, str]:
        """The stored entry for a request and whether it was a ``hit`` or ``compiled``
        (counted as ``hits``/``misses``, or ``prewarm_hits``/``prewarm_misses`` at pre-warm
        priority); UnknownToolchain at once for a miss no registered toolchain may compile.
        The key's own entry (trusted) first, then what ``trust_group`` (the asker's,
        cached/toolchain/trust.py; None: a trusted asker) wrote back for it. On a miss,
        ``admit(key)`` runs right before the compilation is queued (or joined), and may refuse it by
        raising."""
        family, request, route = self.resolve(request, identity)
        if family.bundle:
            raise InvalidArgument(f"{family.name} artifacts are bundles a client writes back: "
                                  "ask for them with lease")
        key = route.key
        entry = await self.lookup(key)
        if entry is None and trust_group is not None:
            entry = await self.lookup(writeback_key(key, trust_group))
        prewarm = "prewarm_" if priority == PREWARM else ""  # counted apart from serving
        if entry is not None:
            self.stats.count(f"{prewarm}hits", family.name)
            return entry, "hit"
        self.stats.count(f"{prewarm}misses", family.name)
        if route.compiler is None:
            self.stats.count("unknown_toolchain", family.name)
            raise UnknownToolchain(route.why)
        if admit is not None:
            admit(key)
        job = self._submit(route, family, request, priority)
        try:
            entry = await asyncio.wait_for(asyncio.shield(job.future), timeout)
            return entry, job.origin
        except TimeoutError:
            self.stats.count("deadline_exceeded", family.name)
            raise DeadlineExceeded(
                f"kernel {key[:16]} was not ready within {timeout:.1f}s (job {job.state}); "
                "it keeps compiling and a later request will find it"
            ) from None

    async def lookup(self, key: str) -> Entry | None:
        """The verified stored entry for ``key``. Blobs unchanged since their last digest
        check are only ``lstat``-ed here; any other is hashed on the store's reader threads
        (a FIFO, a link or a slow disk never stalls the event loop)."""
        if not self.store.contains(key):
            return None
        entry = self.store.lookup_unchanged(key)
        if entry is not None:
            return entry
        return await asyncio.get_running_loop().run_in_executor(
            self.store.readers, self.store.lookup, key)

    def prefetch(self, wires: list[Any], identity: p.Identity | None = None) -> dict:
        """Queue every request not stored or in flight as pre-warm work; answers at once.
        Stored ones count as ``prewarm_hits``, queued ones as ``prewarm_misses``."""
        report: dict[str, Any] = {"queued": 0, "cached": 0, "in_flight": 0, "rejected": []}
        for index, wire in enumerate(wires):
            try:
                family, request, route = self.resolve(KernelRequest.from_wire(wire), identity)
            except CachedError as exc:  # reported per request
                report["rejected"].append({"index": index, "error": exc.to_wire()})
                continue
            key = route.key
            if self.store.contains(key):
                report["cached"] += 1
                self.stats.count("prewarm_hits", family.name)
            elif key in self.inflight:
                report["in_flight"] += 1
            elif route.compiler is None:
                report["rejected"].append({"index": index,
                                           "error": UnknownToolchain(route.why).to_wire()})
            else:
                try:
                    self._submit(route, family, request, PREWARM)
                except CachedError as exc:  # reported per request
                    report["rejected"].append({"index": index, "error": exc.to_wire()})
                    continue
                report["queued"] += 1
                self.stats.count("prewarm_misses", family.name)
        return report

    async def plan(self, m: p.PlanRequest) -> list[KernelRequest]:
        """The family's tactic space for ``m`` (its first ``m.limit``), in its stable order:
        a light family's (``Family.light_planner``) planned in this process off the event
        loop and memoized (:data:`PLAN_MEMO_MAX` plans, least recently used forgotten
        first); any other's in a worker (it may need the toolchain), or here in a
        serve-only daemon."""
        family = families.get(m.family)
        family.check_arch(m.arch)
        family_name = m.family
        planner = self.toolchains.planner(family, m.identity)
        payload = {"family": m.family, "shape": list(m.shape), "arch": m.arch,
                   "sm_count": m.sm_count or DEFAULT_SM_COUNT[m.arch], "options": m.options,
                   "limit": m.limit}
        loop = asyncio.get_running_loop()
        if family.light_planner:
            first = m.limit == 1  # the family's first alone: the others never made
            memo_key = (m.family, tuple(m.shape), m.arch, payload["sm_count"],
                        json.dumps(m.options, sort_keys=True), first)
            requests = self._plans.get(memo_key)
            if requests is None:
                requests = await loop.run_in_executor(None, _plan_here, family, payload,
                                                      first)
                self._plans[memo_key] = requests
                while len(self._plans) > PLAN_MEMO_MAX:
                    self._plans.pop(next(iter(self._plans)))
            else:
                self._plans.move_to_end(memo_key)
            return requests[:m.limit]
        if self.pool.size == 0:
            requests = await loop.run_in_executor(None, _plan_here, family, payload)
            return requests[:m.limit]
        job = Job(f"plan:{next(self._seq)}", family, None, INTERACTIVE,
                  loop.create_future(), plan=payload, toolchain=planner.name)
        self._push(job)
        try:
            wires = await job.future
        except JobError as exc:
            raise InvalidTactic(f"planning {family_name} failed: {exc.message}") from None
        return [p.Kernel()(w, "requests") for w in wires]

    # -- jobs --------------------------------------------------------------------------

    def _submit(self, route: Route, family: Family, request: KernelRequest,
                priority: int) -> Job:
        key = route.key
        job = self.inflight.get(key)
        if job is not None:
            if priority < job.priority and job.state == "fetching":
                job.priority = priority  # pushed at this priority if the tier misses
            elif priority < job.priority and job.state == "queued":
                job.priority = priority
                self._push(job)
            return job
        if self.pool.size == 0 and self.remote is None:
            raise CompileFailed(f"{family.name} {_describe(request)} is not in the store and "
                                "this daemon is serve-only (no compiler); warm it on a build "
                                "node")
        if len(self.inflight) >= self.max_queue:
            raise Overloaded(f"{len(self.inflight)} compilations are already queued; retry later")
        future = asyncio.get_running_loop().create_future()
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        assert route.compiler is not None
        job = Job(key, family, request, priority, future, route=route,
                  toolchain=route.compiler.name)
        self.inflight[key] = job
        if self.remote is not None:
            job.state = "fetching"
            task = asyncio.get_running_loop().create_task(self._fetch_remote(job))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            self._push(job)
        return job

    async def _fetch_remote(self, job: Job) -> None:
        """Ask the fleet tier before compiling: one fetch per job, shared by its waiters. A
        verified entry is stored and answered as ``remote`` (not compiled); anything else
        (absent, rejected, tier down) queues the compilation."""
        started = time.monotonic()
        try:
            entry = await asyncio.get_running_loop().run_in_executor(
                self.remote.executor, self._adopt, job)
        except Exception as exc:  # noqa: BLE001 -- the tier must never fail a request
            event(log, logging.WARNING, "remote.adopt_failed", key=job.key[:16],
                  error=f"{type(exc).__name__}: {exc}"[:300])
            entry = None
        if job.future.done():  # the daemon is stopping
            return
        if entry is not None:
            job.state, job.origin = "done", "remote"
            self.inflight.pop(job.key, None)
            self.stats.count("remote_hits", job.family.name)
            event(log, logging.INFO, "remote.hit", family=job.family.name, key=job.key[:16],
                  kernel=entry.row.kernel_name, fetch_s=round(time.monotonic() - started, 4))
            job.future.set_result(entry)
        elif self.pool.size == 0:
            job.state = "done"
            self.inflight.pop(job.key, None)
            job.future.set_exception(CompileFailed(
                f"{job.family.name} {_describe(job.request)} is neither in the store nor in the "
                "fleet tier, and this daemon is serve-only (no compiler); warm it on a build node"))
        else:
            job.state = "queued"
            self._push(job)

    def _adopt(self, job: Job) -> Entry | None:
        """Fetch ``job``'s key from the tier (verified there) and store it; None on a miss.
        The row is this node's own (request, identity); the tier supplies only the blobs,
        the kernel's name and symbol, its compile time and meta."""
        request, route = job.request, job.route
        assert route is not None
        fetched = self.remote.fetch(job.key, {
            "family": request.family, "arch": request.arch,
            "toolchain": route.toolchain, "source_sha256": route.source_sha256})
        if fetched is None:
            return None
        signed, object_bytes, library_bytes = fetched
        workdir = self.store.workdir()
        try:
            (workdir / "remote.o").write_bytes(object_bytes)
            (workdir / "remote.so").write_bytes(library_bytes)
            meta = signed["meta"]
            row = row_for(job.key, request, kernel_name=str(signed["kernel_name"]),
                          symbol=str(signed["symbol"]), toolchain=route.toolchain,
                          source_sha256=route.source_sha256,
                          compile_seconds=float(signed["compile_seconds"]),
                          meta=json.loads(meta) if isinstance(meta, str) else meta)
            return self.store.publish(row, workdir / "remote.o", workdir / "remote.so")
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _push(self, job: Job) -> None:
        heapq.heappush(self._heaps[job.toolchain], (job.priority, next(self._seq), job))
        self._has_work[job.toolchain].set()

    def _top(self, name: str) -> Job | None:
        """The most urgent queued job of toolchain ``name`` (stale heap entries dropped)."""
        heap = self._heaps[name]
        while heap:
            priority, _, job = heap[0]
            if job.state == "queued" and job.priority == priority and not (
                    job.plan is not None and job.future.done()):  # a plan nobody awaits
                return job
            heapq.heappop(heap)
        return None

    async def _dispatch(self, name: str) -> None:
        """Toolchain ``name``'s jobs onto its workers: a worker is asked for only while a
        job waits, and the most urgent job then is the one it runs."""
        while True:
            while self._top(name) is None:
                self._has_work[name].clear()
                await self._has_work[name].wait()
            try:
                worker = await self.pool.acquire(name)
            except WorkerFailed as exc:  # the toolchain's workers die while starting
                self._fail_queued(name, str(exc))
                continue
            job = self._top(name)
            if job is None:  # drained meanwhile
                self.pool.release(worker)
                continue
            heapq.heappop(self._heaps[name])
            job.state = "running"
            run = self._run_plan if job.plan is not None else self._run
            task = asyncio.get_running_loop().create_task(run(worker, job))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _fail_queued(self, name: str, message: str) -> None:
        """Every queued job of toolchain ``name`` fails now with ``message`` (its workers
        cannot start): counted and logged like any failed compile, waiters told
        ``compile_failed``."""
        heap, self._heaps[name] = self._heaps[name], []
        for _, _, job in heap:
            if job.state != "queued":
                continue  # a stale entry: the job was pushed again or is done
            job.state = "done"
            if job.plan is None:
                self.inflight.pop(job.key, None)
                self.stats.count("failures", job.family.name)
                self.stats.fail({"time": time.time(), "family": job.family.name,
                                 "key": job.key, "params": dict(job.request.params),
                                 "message": message})
                event(log, logging.ERROR, "compile.failed", family=job.family.name,
                      key=job.key[:16], error=message[:500])
                what = f"{job.family.name} {_describe(job.request)}"
            else:
                what = f"planning {job.family.name}"
            if not job.future.done():
                job.future.set_exception(CompileFailed(f"{what}: {message}"))

    async def _run_plan(self, worker: Any, job: Job) -> None:
        try:
            result = await self.pool.run_on(worker, "plan", job.plan or {})
            if not job.future.done():  # its requester may have gone meanwhile
                job.future.set_result(result)
        except Exception as exc:  # noqa: BLE001 -- the planner hears why
            if not job.future.done():
                job.future.set_exception(exc)
        finally:
            job.state = "done"

    async def _run(self, worker: Any, job: Job) -> None:
        loop = asyncio.get_running_loop()
        name = job.family.name
        workdir: Path | None = None
        handed = False  # the worker went to run_on, which gives it back or replaces it
        self.running += 1
        started = time.monotonic()
        try:
            workdir = await loop.run_in_executor(None, self.store.workdir)
            handed = True
            result = BuildResult.from_wire(await self.pool.run_on(
                worker, "build", {"request": job.request.to_wire(), "workdir": str(workdir)}
            ))
            entry, job.origin = await loop.run_in_executor(None, self._publish, job, result)
        except Exception as exc:  # noqa: BLE001 -- every waiter must hear why, whatever broke
            if not handed:
                self.pool.release(worker)
            if isinstance(exc, (JobError, CompileFailed)):
                message = exc.message
            elif isinstance(exc, (WorkerFailed, OSError)):
                message = str(exc)
            else:
                message = f"internal error: {type(exc).__name__}: {exc}"
            if workdir is None:
                message = f"its work directory could not be made: {message}"
            self.stats.count("failures", name)
            self.stats.fail({"time": time.time(), "family": name, "key": job.key,
                             "params": dict(job.request.params), "message": message})
            event(log, logging.ERROR, "compile.failed", family=name, key=job.key[:16],
                  error=message[:500])
            if not job.future.done():  # (a drain may have answered already)
                job.future.set_exception(
                    CompileFailed(f"{name} {_describe(job.request)}: {message}"))
        else:
            self.stats.count("compiles", name)
            self.stats.count("compile_seconds", name, result.compile_seconds)
            event(log, logging.INFO, "compile.done", family=name, key=job.key[:16],
                  kernel=result.kernel_name, compile_s=result.compile_seconds,
                  wall_s=round(time.monotonic() - started, 3),
                  waited_s=round(started - job.enqueued, 3), origin=job.origin)
            if not job.future.done():
                job.future.set_result(entry)
            if self.remote is not None and job.origin == "compiled":  # background
                self.remote.publish(job.key, entry.row.columns(), entry.object_path,
                                   entry.library_path)
        finally:
            job.state = "done"
            self.running -= 1
            self.inflight.pop(job.key, None)
            if workdir is not None:
                self._remove_later(workdir, UNSTORED_HOLD_S if job.origin == "unstored" else 0)

    def _remove_later(self, workdir: Path, delay: float) -> None:
        """Remove a job's work directory now (off the loop) or after ``delay`` seconds."""
        loop = asyncio.get_running_loop()

        def remove() -> None:
            loop.run_in_executor(None, shutil.rmtree, workdir, True)

        if delay:
            loop.call_later(delay, remove)
        else:
            remove()

    def _publish(self, job: Job, result: BuildResult) -> tuple[Entry, str]:
        """Store the built kernel: (entry, ``compiled``); when the store cannot take it,
        (the unstored entry, ``unstored``), counted and logged."""
        route = job.route
        assert route is not None
        row = row_for(job.key, job.request, kernel_name=result.kernel_name,
                      symbol=result.symbol, toolchain=route.toolchain,
                      source_sha256=route.source_sha256,
                      compile_seconds=result.compile_seconds,
                      meta={**result.meta,
                            "runtime_library": compiler_stack.RUNTIME_LIBRARY_NAME,
                            "compiled_by": {"toolchain": job.toolchain,
                                            "python": result.python}})
        files = Path(result.object_path), Path(result.library_path)
        try:
            return self.store.publish(row, *files), "compiled"
        except PersistFailed as exc:
            entry = self.store.unstored(row, *files, exc)
            self.stats.count("persist_failures", job.family.name)
            event(log, logging.ERROR, "compile.unstored", family=job.family.name,
                  key=job.key[:16], kernel=result.kernel_name, error=exc.message[:300],
                  served_from=str(entry.library_path.parent),
                  hold_s=UNSTORED_HOLD_S)
            return entry, "unstored"


def _plan_here(family: Family, payload: dict, first: bool = False) -> list[KernelRequest]:
    """The whole plan, or with ``first`` its first request alone, in this process
    (serve-only daemons have no workers; light families)."""
    args = (tuple(payload["shape"]), payload["arch"], payload["sm_count"], payload["options"])
    try:
        if first:
            return [r for r in [family.plan_first(*args)] if r is not None]
        return family.plan(*args)
    except ImportError as exc:
        raise InvalidTactic(f"planning {family.name} needs its toolchain here: {exc}") from None


def _remember(memo: dict, key: tuple, value: object) -> None:
    """``memo[key] = value``, the oldest forgotten first beyond RESOLVED_MAX."""
    if len(memo) >= RESOLVED_MAX:
        del memo[next(iter(memo))]
    memo[key] = value


def _resolve_key(request: KernelRequest, identity: p.Identity | None) -> tuple | None:
    """What decides a resolution, with types kept apart (params as canonical JSON: ``true``
    is not ``1``, which KernelRequest's own equality does not tell apart); None for params
    JSON cannot hold."""
    try:
        params = request.params_json
    except (TypeError, ValueError):
        return None
    return (request.family, request.arch, request.sm_count, request.max_active_clusters,
            params, None if identity is None else (  # checked: str keys, str or None values
                identity.toolchain, tuple(sorted(identity.sources.items())),
                tuple(sorted(identity.runtime.items()))))


def _describe(request: KernelRequest) -> str:
    return f"{request.arch} {json.dumps(dict(request.params), sort_keys=True)}"
