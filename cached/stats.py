"""The daemon's counters: one :class:`Stats` every component counts into.

Bottom layer: imports nothing of the daemon. Every count goes, in one call, into two
views of the same events: the counters :meth:`Stats.view` reads (what ``cached stats``
shows, from the start or the last :meth:`Stats.zero`) and the prometheus_client counters
and histograms of :attr:`Stats.registry` (what ``/metrics`` exports, monotonic for the
daemon's life whatever ``stats --zero`` did). Per-family counters sit under ``by_family``;
the last failures are kept for operators. Metric names and what to alert on are in
docs/operations.md.

Serving and pre-warm are counted apart: ``hits``/``misses`` (and the latency histograms)
are requests a client waits on; ``prewarm_hits``/``prewarm_misses`` are pre-warm requests
(``cached warm``, manifests, ``prefetch``), so a warm-up leaves the hit ratio alone.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable

from cached_client.errors import CLIENT_ERROR_CODES

COMPILE_BUCKETS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0)
"""Upper bounds, in seconds, of the compile-time histogram's buckets."""
HIT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
               1.0)
"""Upper bounds, in seconds, of the hit-latency histogram (a get answered from the store)."""
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0,
                600.0)
"""Upper bounds, in seconds, of the miss-to-served histogram (a get that was not a hit)."""
HISTOGRAMS = {
    "compile_seconds": ("cached_compile_duration_seconds",
                        "Compile time of stored kernels, in the worker.", COMPILE_BUCKETS),
    "hit_seconds": ("cached_hit_duration_seconds",
                    "Latency of serving get requests answered from the store: request "
                    "decoded to reply ready.", HIT_BUCKETS),
    "miss_seconds": ("cached_miss_duration_seconds",
                     "Latency of serving get requests that missed, until served: waiting for "
                     "a compilation (its own or one in flight) or a fleet-tier fetch.",
                     WAIT_BUCKETS),
}
"""Every histogram by name: (metric, help, bucket bounds in seconds). ``compile_seconds`` is
observed by ``count`` (the counter of the same name is its sum); ``hit_seconds`` and
``miss_seconds`` by :meth:`Stats.observe`, which also counts their sums and
``<name>_count`` for ``cached stats``' means."""
FAMILY_METRICS = {
    "hits": ("cached_hits", "Serving requests (a client waits) answered from the store."),
    "misses": ("cached_misses", "Serving requests (a client waits) that needed a "
               "compilation."),
    "prewarm_hits": ("cached_prewarm_hits", "Pre-warm requests (cached warm, manifests, "
                     "prefetch) already stored."),
    "prewarm_misses": ("cached_prewarm_misses", "Pre-warm requests (cached warm, manifests, "
                       "prefetch) that queued a compilation."),
    "compiles": ("cached_compilations", "Compilations stored."),
    "failures": ("cached_compile_failures",
                 "Compilations that failed (compiler error, worker died or overran)."),
    "persist_failures": ("cached_persist_failures",
                         "Kernels compiled but not stored (disk full, budget): served to "
                         "their waiters unstored."),
    "compiles_avoided": ("cached_compiles_avoided",
                         "Artifacts served that nobody compiled for that request: get hits, "
                         "fleet-tier fetches, write-back hits."),
    "published": ("cached_published",
                  "Artifacts written back by clients (write-back families, and any family "
                  "of an environment the daemon has no toolchain for)."),
    "bytes_served": ("cached_served_bytes",
                     "Bytes of the artifacts served (get answers and write-back hits)."),
    "bytes_published": ("cached_published_bytes", "Bytes of the artifacts written back."),
    "client_fallbacks": ("cached_client_fallbacks",
                         "In-process compilations clients reported while the daemon was "
                         "unusable to them."),
    "client_outside_kernels": ("cached_client_outside_kernels",
                               "Kernels serving clients reported building or loading outside "
                               "the daemon (cached_client.monitor)."),
}
"""Per-family counters ``/metrics`` exports (``<metric>_total{family}``): counter name ->
(metric, help). Every registered family has each series from the start, zero until
counted."""
FAMILY_COUNTERS = (*FAMILY_METRICS, "compile_seconds", "remote_hits", "deadline_exceeded",
                   "hit_seconds", "hit_seconds_count", "miss_seconds", "miss_seconds_count")
"""Per-family counters every family reports, zero until counted. ``hits``/``misses``
count serving ``get`` answers and write-back ``lease`` answers (hit; granted: the asker
compiles); ``prewarm_hits``/``prewarm_misses`` pre-warm ``get`` and ``prefetch`` requests;
``compiles_avoided``: artifacts served that nobody compiled for that request (a ``get``
hit or fleet-tier fetch, a write-back hit); ``published``: entries written back by
clients; ``bytes_served``/``bytes_published``: their sizes; ``hit_seconds`` and
``miss_seconds``: summed latency of serving gets (seconds), ``*_count`` their number;
``client_fallbacks`` and ``client_outside_kernels``: what clients reported of their own
processes (``report``)."""
ERROR_METRICS = (
    ("cached_errors", "Error replies that are failures (the daemon could not serve a "
     "well-formed request: compile failed, overloaded, deadline, integrity, internal), "
     "by code."),
    ("cached_client_errors", "Error replies to what a client sent (malformed frame, "
     "unknown family, invalid argument or tactic, not allowed, unknown toolchain), by "
     "code."),
)
"""(metric, help) of the failures and of the client errors; which codes are client errors:
:data:`cached_client.errors.CLIENT_ERROR_CODES`."""


class Stats:
    """Counters by name (``hits``, ``errors.<code>``, ...) and by family; ``registry``: the
    same counts as prometheus_client metrics, every family of ``registered`` present from
    the start."""

    def __init__(self, registered: Iterable[str] = ()) -> None:
        self.counters: Counter[str] = Counter()
        self.by_family: defaultdict[str, Counter[str]] = defaultdict(Counter)
        self.failures: deque[dict] = deque(maxlen=20)
        self.outside_kernels: deque[dict] = deque(maxlen=20)
        self.zeroed_at: float | None = None
        self._lock = threading.Lock()
        self._base: Counter[str] = Counter()
        self._base_family: dict[str, Counter[str]] = {}
        # here, not at the top: the commands import this module's helpers without it
        from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics
        from prometheus_client import Counter as PromCounter

        disable_created_metrics()  # no <counter>_created series: start_time_seconds says it

        self.registry = CollectorRegistry(auto_describe=True)
        self._family_metrics = {
            name: PromCounter(metric, doc, ["family"], registry=self.registry)
            for name, (metric, doc) in FAMILY_METRICS.items()}
        self._histograms = {
            name: Histogram(metric, doc, ["family"], buckets=bounds, registry=self.registry)
            for name, (metric, doc, bounds) in HISTOGRAMS.items()}
        failures, client = (PromCounter(metric, doc, ["code"], registry=self.registry)
                            for metric, doc in ERROR_METRICS)
        self._errors = {"failure": failures, "client": client}
        self._children: dict[tuple[str, str], object] = {}
        self._kept: dict[str, Callable[[], float]] = {}
        self._kept_base: dict[str, float] = {}
        for family in registered:
            for name in (*FAMILY_METRICS, *HISTOGRAMS):
                self._child(name, family)

    def _child(self, name: str, family: str) -> object:
        """The prometheus_client child of ``name`` for ``family`` (made once), or None when
        ``name`` is not exported per family."""
        key = (name, family)
        child = self._children.get(key)
        if child is None:
            metric = self._family_metrics.get(name) or self._histograms.get(name)
            if metric is None:
                return None
            child = self._children[key] = metric.labels(family)
        return child

    def count(self, name: str, family: str | None = None, n: float = 1) -> None:
        with self._lock:
            self.counters[name] += n
            if family:
                self.by_family[family][name] += n
                child = self._child(name, family)
                if child is not None:
                    (child.observe if name == "compile_seconds" else child.inc)(n)
            elif name.startswith("errors."):
                code = name[7:]
                kind = "client" if code in CLIENT_ERROR_CODES else "failure"
                self._errors[kind].labels(code).inc(n)

    def observe(self, name: str, family: str, seconds: float) -> None:
        """One observation of histogram ``name`` (``hit_seconds`` or ``miss_seconds``):
        into its histogram, and into the counters ``name`` (summed seconds) and
        ``<name>_count`` of ``family``."""
        with self._lock:
            self._child(name, family).observe(seconds)  # type: ignore[attr-defined]
            counts = self.by_family[family]
            counts[name] += seconds
            counts[f"{name}_count"] += 1

    def keep(self, name: str, read: Callable[[], float]) -> None:
        """A monotonic count a component keeps itself (``read`` returns it), so that
        :meth:`since_zero` can tell it from the last :meth:`zero` like the others."""
        self._kept[name] = read

    def since_zero(self, name: str) -> float:
        """Kept count ``name`` (:meth:`keep`) since the last :meth:`zero` (or the start)."""
        return self._kept[name]() - self._kept_base.get(name, 0)

    def fail(self, record: dict) -> None:
        """Keep one failure (time, family, key, params, message) for ``stats``."""
        with self._lock:
            self.failures.append(record)

    def note_outside(self, pid: int, kernels: Iterable[str]) -> None:
        """Keep the names of kernels a serving client built outside the daemon (last 20)."""
        now = time.time()
        with self._lock:
            for name in kernels:
                self.outside_kernels.append({"time": now, "pid": pid, "kernel": name})

    def zero(self) -> float:
        """Start ``cached stats``' counts from zero now (the monotonic counters behind
        ``/metrics`` go on); forget the kept failures. Returns the time (Unix seconds)."""
        with self._lock:
            self._base = Counter(self.counters)
            self._base_family = {f: Counter(c) for f, c in self.by_family.items()}
            self._kept_base = {name: read() for name, read in self._kept.items()}
            self.failures.clear()
            self.zeroed_at = time.time()
            return self.zeroed_at

    def view(self, registered: Iterable[str] = (), since_zero: bool = True
             ) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
        """Counters and per-family counters since the last :meth:`zero` (or the start;
        since the start whatever the zeroing with ``since_zero=False``). Every family in
        ``registered`` has a row, with :data:`FAMILY_COUNTERS` at least."""
        empty: Counter[str] = Counter()
        with self._lock:
            base = self._base if since_zero else empty
            counters = {k: _less(v, base.get(k, 0)) for k, v in self.counters.items()}
            families = {}
            for f in sorted(set(registered) | set(self.by_family)):
                base = self._base_family.get(f, empty) if since_zero else empty
                row: dict[str, float] = dict.fromkeys(FAMILY_COUNTERS, 0)
                row.update({k: _less(v, base.get(k, 0))
                            for k, v in self.by_family.get(f, empty).items()})
                families[f] = row
            return counters, families


def _less(value: float, base: float) -> float:
    """``value - base``; float sums rounded to microseconds (no 1e-17 residues)."""
    diff = value - base
    return round(diff, 6) if isinstance(diff, float) else diff


def time_text(unix: float, seconds: bool = True) -> str:
    """A Unix time as local time with its zone, e.g. ``2026-12-02 05:40:12 UTC``."""
    return time.strftime("%Y-%m-%d %H:%M:%S %Z" if seconds else "%Y-%m-%d %H:%M %Z",
                         time.localtime(unix))


def duration_text(seconds: float) -> str:
    """A duration as people read it, two units at most: ``42s``, ``12m05s``, ``3h07m``,
    ``2d04h``; under ten seconds with a tenth (``3.4s``)."""
    if seconds < 10:
        return f"{max(0.0, seconds):.1f}s"
    s = int(seconds)
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{s:02d}s"
    return f"{s}s"
