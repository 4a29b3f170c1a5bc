"""One typed snapshot of the daemon, taken in one place, that every operator view renders.

:func:`take` reads the daemon's parts once (store, pool, scheduler, counters, fleet tier,
toolchains, what clients reported) into a frozen :class:`DaemonSnapshot`; the views only
render it:

- the socket's ``stats``/``zero_stats`` (``cached stats`` and ``--json``):
  :meth:`DaemonSnapshot.to_wire`, counts since the last ``stats --zero``;
- ``GET /stats`` and the page at ``/``: :func:`public_stats` of that wire object, an
  allowlist (counts, states, versions, family names; never paths, kernel keys or
  parameters, compiler messages, the fleet tier's URL or key ids: a key added to the wire
  object stays off HTTP until it is added here);
- ``/metrics`` (cached.view.metrics): a snapshot with ``since_zero=False``, so that what it
  exports as counters is monotonic for the daemon's life;
- the systemd ``STATUS=`` line (cached.node.lifecycle), likewise since the start.

The derived numbers more than one view shows (hit ratio, mean compile time, errors split
into failures and client errors) are computed here, once. This module imports no component
at run time (their snapshot types only for annotations), so ``cached stats`` stays light.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from cached_client.errors import CLIENT_ERROR_CODES

if TYPE_CHECKING:
    from cached.toolchain.toolchains import Toolchains

    from ..config import Settings
    from ..fleet.tier import Tier
    from ..pool import Pool, PoolSnapshot
    from ..scheduler import Scheduler, SchedulerSnapshot
    from ..stats import Stats
    from ..store.store import Store, StoreSnapshot


class _Server(Protocol):
    connections: int


class _Lifecycle(Protocol):
    draining: bool


class Parts(Protocol):
    """What :func:`take` reads of a daemon (cached.daemon.Daemon has it all)."""

    store: Store
    pool: Pool
    scheduler: Scheduler
    stats: Stats
    toolchains: Toolchains
    remote: Tier | None
    server: _Server
    lifecycle: _Lifecycle
    settings: Settings
    started: float
    version: str
    versions: dict[str, str]
    socket_path: str
    http_address: str


@dataclass(frozen=True)
class Counts:
    """Daemon-wide counts over the snapshot's basis (:attr:`DaemonSnapshot.since_zero`).

    Requests and compilations are whole numbers; ``compile_seconds`` is summed compile time
    (seconds, rounded to milliseconds); the means are seconds over every family's serving
    gets, None before the first; ``errors`` maps an error code to its replies, non-zero
    codes only."""

    hits: float
    misses: float
    prewarm_hits: float
    prewarm_misses: float
    compiles: float
    failures: float
    persist_failures: float
    remote_hits: float
    compile_seconds: float
    client_fallbacks: float
    client_outside_kernels: float
    unknown_toolchain: float
    worker_restarts: float
    errors: Mapping[str, float]
    hit_seconds_mean: float | None
    miss_seconds_mean: float | None

    @property
    def hit_ratio(self) -> float | None:
        """Serving hits over serving requests, 0..1; None before the first."""
        return hit_ratio(self.hits, self.misses)


@dataclass(frozen=True)
class DaemonSnapshot:
    """The daemon at one instant (``taken_at``, Unix seconds).

    Counts (``counts``, ``families``) run from the last ``stats --zero`` when
    ``since_zero``, else from the start; ``last_failures`` (20 at most) always from the
    last zeroing, which forgets them; store, pool and job states are as they are
    now. ``families`` has a row for every registered family with every
    :data:`cached.stats.FAMILY_COUNTERS` key. ``remote`` is the fleet tier's own
    snapshot, None when it is off. ``toolchains`` are the registered toolchains with their
    workers' counts and, for one with none, why (``broken``: socket only)."""

    taken_at: float
    since_zero: bool
    store: StoreSnapshot
    pool: PoolSnapshot
    jobs: SchedulerSnapshot
    counts: Counts
    families: Mapping[str, Mapping[str, float]]
    remote: Mapping[str, Any] | None
    toolchains: tuple[Mapping[str, Any], ...]
    unknown_environments: tuple[Mapping[str, Any], ...]
    last_failures: tuple[Mapping[str, Any], ...]
    outside_kernels: tuple[Mapping[str, Any], ...]
    connections: int
    started: float
    stats_zeroed_at: float | None
    version: str
    versions: Mapping[str, str]
    toolchain: str
    serve_only: bool
    draining: bool
    store_path: str
    socket: str
    http: str
    settings: Mapping[str, Any]

    @property
    def uptime_s(self) -> float:
        """Seconds from the daemon's start to ``taken_at``."""
        return self.taken_at - self.started

    @property
    def worker_states(self) -> dict[str, int]:
        """The pool as :func:`worker_states` partitions it (summing to the configured size)."""
        p = self.pool
        return worker_states(p.size, p.alive, p.ready, p.idle)

    def to_wire(self) -> dict:
        """The ``stats`` op's object (``cached stats --json``): every key the protocol and
        operators know, with the same meaning (docs/operations.md)."""
        c, store, pool, jobs = self.counts, self.store, self.pool, self.jobs
        return {
            "entries": store.entries, "bytes": store.bytes, "hits": c.hits,
            "misses": c.misses, "prewarm_hits": c.prewarm_hits,
            "prewarm_misses": c.prewarm_misses,
            "hit_seconds_mean": c.hit_seconds_mean, "miss_seconds_mean": c.miss_seconds_mean,
            "compiles": c.compiles, "failures": c.failures,
            "persist_failures": c.persist_failures, "remote_hits": c.remote_hits,
            "remote": dict(self.remote) if self.remote is not None else {"state": "disabled"},
            "compile_seconds": c.compile_seconds,
            "in_flight": jobs.in_flight, "queued": jobs.queued, "running": jobs.running,
            "workers": pool.size, "workers_alive": pool.alive, "workers_ready": pool.ready,
            "workers_idle": pool.idle, "worker_restarts": c.worker_restarts,
            "connections": self.connections, "errors": dict(c.errors),
            "families": {f: dict(row) for f, row in self.families.items()},
            "last_failures": [dict(f) for f in self.last_failures],
            "uptime_s": round(self.uptime_s, 1),
            "started": round(self.started, 3), "stats_zeroed_at": self.stats_zeroed_at,
            "version": self.version, "versions": dict(self.versions),
            "toolchain": self.toolchain,
            "toolchains": [dict(t) for t in self.toolchains],
            "serve_only": self.serve_only, "store": self.store_path, "socket": self.socket,
            "http": self.http, "max_bytes": store.max_bytes, "max_files": store.max_files,
            "evictions": store.evictions, "evicted_bytes": store.evicted_bytes,
            "over_budget": store.over_budget, "client_fallbacks": c.client_fallbacks,
            "unknown_toolchain": c.unknown_toolchain,
            "unknown_environments": [dict(u) for u in self.unknown_environments],
            "client_outside_kernels": c.client_outside_kernels,
            "outside_kernels": [dict(k) for k in self.outside_kernels],
            "draining": self.draining, "settings": dict(self.settings),
        }

    def public(self) -> dict:
        """What HTTP shows of this snapshot (``GET /stats``, the page): :func:`public_stats`."""
        return public_stats(self.to_wire())


def take(d: Parts, since_zero: bool = True) -> DaemonSnapshot:
    """The daemon's snapshot now, counts since the last ``stats --zero`` (``since_zero``)
    or since the start. Reads each part once; call it on the event loop's thread or
    accept counts a moment apart (the HTTP endpoint's thread does)."""
    from .. import families

    store, pool, jobs = d.store.snapshot(), d.pool.snapshot(), d.scheduler.snapshot()
    counters, by_family = d.stats.view(families.names(), since_zero=since_zero)
    c = Counter(counters)
    counts = Counts(
        hits=c["hits"], misses=c["misses"], prewarm_hits=c["prewarm_hits"],
        prewarm_misses=c["prewarm_misses"], compiles=c["compiles"], failures=c["failures"],
        persist_failures=c["persist_failures"], remote_hits=c["remote_hits"],
        compile_seconds=round(c["compile_seconds"], 3),
        client_fallbacks=c["client_fallbacks"],
        client_outside_kernels=c["client_outside_kernels"],
        unknown_toolchain=c["unknown_toolchain"],
        worker_restarts=(d.stats.since_zero("worker_restarts") if since_zero
                         else pool.restarts),
        errors={k.split(".", 1)[1]: v for k, v in c.items() if k.startswith("errors.") and v},
        hit_seconds_mean=_mean(by_family, "hit_seconds"),
        miss_seconds_mean=_mean(by_family, "miss_seconds"))
    settings = d.settings
    return DaemonSnapshot(
        taken_at=time.time(), since_zero=since_zero, store=store, pool=pool, jobs=jobs,
        counts=counts, families=by_family,
        remote=d.remote.snapshot() if d.remote is not None else None,
        toolchains=tuple({**t, "workers": dict(pool.toolchains.get(t["name"], {})),
                          "broken": d.pool.broken.get(t["name"])}
                         for t in d.toolchains.snapshot()),
        unknown_environments=tuple(d.toolchains.unknown_snapshot()),
        last_failures=tuple(d.stats.failures),
        outside_kernels=tuple(d.stats.outside_kernels),
        connections=d.server.connections, started=d.started,
        stats_zeroed_at=d.stats.zeroed_at, version=d.version, versions=d.versions,
        toolchain=d.toolchains.default.digest, serve_only=settings.serve_only,
        draining=d.lifecycle.draining, store_path=settings.store, socket=d.socket_path,
        http=d.http_address,
        settings={"file": str(settings.file) if settings.file else None,
                  "file_source": settings.file_source, "options": settings.rows()})


def _mean(by_family: Mapping[str, Mapping[str, float]], name: str) -> float | None:
    """The mean of latency ``name`` (``hit_seconds``, ``miss_seconds``) over every family's
    serving gets, in seconds (rounded to microseconds); None before the first."""
    count = sum(c.get(f"{name}_count", 0) for c in by_family.values())
    return round(sum(c.get(name, 0) for c in by_family.values()) / count, 6) if count else None


# -- what more than one view derives ---------------------------------------------------

WORKER_STATES = ("idle", "busy", "starting", "down")
"""``cached_workers{state}``: a partition of the configured workers (they sum to it):
``idle`` ready and waiting for work, ``busy`` compiling, ``starting`` alive and importing
the toolchain, ``down`` not running (dead, being replaced)."""


def worker_states(size: int, alive: int, ready: int, idle: int) -> dict[str, int]:
    """:data:`WORKER_STATES` from a pool's counts; each worker in one state, the states
    summing to ``size``."""
    alive = min(alive, size)
    ready = min(ready, alive)
    idle = min(idle, ready)
    return {"idle": idle, "busy": ready - idle, "starting": alive - ready,
            "down": size - alive}


def hit_ratio(hits: float, misses: float) -> float | None:
    """``hits / (hits + misses)``, 0..1; None when there were none."""
    total = hits + misses
    return hits / total if total else None


def mean_compile_s(row: Mapping[str, float]) -> float | None:
    """A family row's mean compile time (seconds); None before its first compilation."""
    compiles = row.get("compiles", 0)
    return row.get("compile_seconds", 0) / compiles if compiles else None


def split_errors(errors: Mapping[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """Error replies by code, split into failures (the daemon could not serve a well-formed
    request) and client errors (:data:`cached_client.errors.CLIENT_ERROR_CODES`); zero
    counts left out, each sorted by code."""
    failures = {k: v for k, v in sorted(errors.items()) if v and k not in CLIENT_ERROR_CODES}
    client = {k: v for k, v in sorted(errors.items()) if v and k in CLIENT_ERROR_CODES}
    return failures, client


# -- what HTTP may show ---------------------------------------------------------------

PUBLIC_KEYS = (
    "entries", "bytes", "hits", "misses", "prewarm_hits", "prewarm_misses",
    "hit_seconds_mean", "miss_seconds_mean", "compiles", "failures", "persist_failures",
    "remote_hits",
    "compile_seconds", "in_flight", "queued", "running", "workers", "workers_alive",
    "workers_ready", "workers_idle", "worker_restarts", "connections", "errors", "families",
    "uptime_s", "started", "stats_zeroed_at", "version", "versions", "toolchain",
    "serve_only", "http", "max_bytes", "max_files", "evictions", "evicted_bytes",
    "over_budget", "client_fallbacks", "client_outside_kernels", "draining",
    "unknown_toolchain",
)
"""The wire object's keys HTTP shows as they are (counts, states, versions, family names)."""
PUBLIC_REMOTE_KEYS = (
    "state", "since", "read_only", "hits", "misses", "rejected", "published", "errors",
    "skipped", "publish_queue", "publish_dropped", "bytes_in", "bytes_out",
    "compression_ratio", "retry_in_s",
)
"""The fleet tier's keys HTTP shows (not its URL, key ids or last error text)."""
REDACTED = ("paths, kernel keys and parameters, compiler messages and the fleet tier's "
            "address are shown over the socket only: cached stats")
PUBLIC_UNKNOWN_KEYS = ("fingerprint", "versions", "families", "requests", "first_seen")
"""Each unknown environment's keys HTTP shows (not its interpreter's path or pid)."""
PUBLIC_TOOLCHAIN_KEYS = ("name", "fingerprint", "versions", "families", "default", "workers")
"""Each registered toolchain's keys HTTP shows (not its interpreter's path)."""


def public_stats(wire: dict) -> dict:
    """What ``GET /stats`` and the page show of a ``stats`` object
    (:meth:`DaemonSnapshot.to_wire`): the :data:`PUBLIC_KEYS`, the fleet tier's
    :data:`PUBLIC_REMOTE_KEYS`, each toolchain's :data:`PUBLIC_TOOLCHAIN_KEYS`, and of each
    kept failure its time and family only."""
    out = {k: wire[k] for k in PUBLIC_KEYS if k in wire}
    out["toolchains"] = [{k: t[k] for k in PUBLIC_TOOLCHAIN_KEYS if k in t}
                         for t in wire.get("toolchains", [])]
    remote = wire.get("remote") or {}
    out["remote"] = {k: remote[k] for k in PUBLIC_REMOTE_KEYS if k in remote}
    out["last_failures"] = [{"time": f.get("time"), "family": f.get("family")}
                            for f in wire.get("last_failures", [])]
    out["unknown_environments"] = [{k: u[k] for k in PUBLIC_UNKNOWN_KEYS if k in u}
                                   for u in wire.get("unknown_environments", [])]
    out["redacted"] = REDACTED
    return out
