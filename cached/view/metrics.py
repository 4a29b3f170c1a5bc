"""``GET /metrics``: the daemon's state for Prometheus, through prometheus_client.

One registry, :attr:`cached.view.stats.Stats.registry`: the counters and histograms the
components count into (``Stats``), plus what is added here: gauges read from the
components at scrape time (``set_function``), the counters the store, the pool and the
fleet tier keep themselves (one small collector: prometheus_client cannot set a counter),
one info series per registered toolchain and the process's own ``process_*`` metrics.
prometheus_client's ASGI app serves it, in the text format or, to a scraper whose
``Accept`` asks for it, OpenMetrics. Metric names and what to alert on are in
docs/operations.md.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

from cached_client.identity import VERSION_NAMES
from prometheus_client import Gauge, ProcessCollector, make_asgi_app
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

WORKER_STATES = ("idle", "busy", "starting", "down")
"""``cached_workers{state}``: a partition of the configured workers (they sum to it):
``idle`` ready and waiting for work, ``busy`` compiling, ``starting`` alive and importing
the toolchain, ``down`` not running (dead, being replaced)."""
REMOTE_STATES = ("connecting", "up", "down", "full")
VERSION_LABELS = ("python", *VERSION_NAMES)
"""The readable versions ``cached_build_info`` names (:func:`cached_client.identity.versions`),
each as a label of the same name (``-`` as ``_``), empty when a toolchain lacks it."""


def label(name: str) -> str:
    """A version's name as a Prometheus label (``nvidia-cutlass-dsl`` -> ``nvidia_cutlass_dsl``)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def worker_states(size: int, alive: int, ready: int, idle: int) -> dict[str, int]:
    """:data:`WORKER_STATES` from a pool's counts; each worker in one state, the states
    summing to ``size``."""
    alive = min(alive, size)
    ready = min(ready, alive)
    idle = min(idle, ready)
    return {"idle": idle, "busy": ready - idle, "starting": alive - ready,
            "down": size - alive}


class _Kept(Collector):
    """Counters the components keep themselves (store eviction, worker restarts, the fleet
    tier), rendered at scrape time."""

    def __init__(self, daemon: Any) -> None:
        self.daemon = daemon

    def collect(self) -> Iterator[Metric]:
        d = self.daemon
        yield CounterMetricFamily("cached_worker_restarts",
                                  "Workers replaced after dying or overrunning a job.",
                                  value=d.pool.restarts)
        store = d.store.snapshot()
        yield CounterMetricFamily("cached_store_evictions", "Entries evicted (LRU).",
                                  value=store.evictions)
        yield CounterMetricFamily("cached_store_evicted_bytes", "Bytes freed by eviction.",
                                  value=store.evicted_bytes)
        yield from _remote_counters(d)


def _remote_counters(d: Any) -> Iterator[Metric]:
    """The fleet tier's counters (cached/fleet/, docs/fleet.md); nothing when it is off."""
    if d.remote is None:
        return
    snap = d.remote.snapshot()
    _, by_family = d.stats.view(since_zero=False)
    hits = CounterMetricFamily("cached_remote_hits",
                               "Local misses answered from the fleet tier (not compiled).",
                               labels=["family"])
    for f, counts in sorted(by_family.items()):
        hits.add_metric([f], float(counts["remote_hits"]))
    yield hits
    ops = CounterMetricFamily("cached_remote_operations",
                              "Fleet tier operations by result.", labels=["result"])
    for result in ("hits", "misses", "rejected", "published", "errors", "skipped",
                   "publish_dropped", "records_published", "record_hits"):
        ops.add_metric([result], float(snap[result]))
    yield ops
    moved = CounterMetricFamily("cached_remote_bytes", "Bytes read from and written to "
                                "the fleet tier (stored, compressed).", labels=["direction"])
    moved.add_metric(["in"], float(snap["bytes_in"]))
    moved.add_metric(["out"], float(snap["bytes_out"]))
    yield moved


def _gauges(d: Any) -> None:
    """Gauges read from the components at scrape time, into the daemon's registry."""
    registry = d.stats.registry

    def gauge(name: str, doc: str, read: Callable[[], float]) -> None:
        Gauge(name, doc, registry=registry).set_function(read)

    gauge("cached_queue_depth", "Compilations waiting for a worker.",
          lambda: d.scheduler.snapshot().queued)
    gauge("cached_compilations_running", "Compilations on a worker now.",
          lambda: d.scheduler.snapshot().running)
    gauge("cached_in_flight", "Keys queued or compiling (each compiled once).",
          lambda: d.scheduler.snapshot().in_flight)
    workers = Gauge("cached_workers", "Compile workers by state: idle, busy (compiling), "
                    "starting (importing the toolchain), down (being replaced); each worker "
                    "in one state, summing to the configured count.", ["state"],
                    registry=registry)

    def state_of(state: str) -> Callable[[], float]:
        def read() -> float:
            pool = d.pool.snapshot()
            return worker_states(pool.size, pool.alive, pool.ready, pool.idle)[state]
        return read

    for state in WORKER_STATES:
        workers.labels(state).set_function(state_of(state))
    gauge("cached_workers_configured", "Compile workers configured (0: serve-only).",
          lambda: d.pool.size)
    gauge("cached_store_bytes", "Bytes of stored blobs (index).",
          lambda: d.store.snapshot().bytes)
    gauge("cached_store_entries", "Stored kernels.", lambda: d.store.snapshot().entries)
    gauge("cached_store_max_bytes", "Store budget in bytes (0: none).",
          lambda: d.store.snapshot().max_bytes)
    gauge("cached_store_max_files", "Store budget in blob files (0: none).",
          lambda: d.store.snapshot().max_files)
    gauge("cached_store_over_budget", "1 when eviction could not get under budget (all in "
          "use).", lambda: int(d.store.snapshot().over_budget))
    gauge("cached_connections", "Open client connections.", lambda: d.server.connections)
    gauge("cached_start_time_seconds", "Unix time the daemon started.", lambda: d.started)
    if d.remote is not None:
        state = Gauge("cached_remote_state", "1 for the fleet tier's current state "
                      "(down/full: local-only).", ["state"], registry=registry)
        for name in REMOTE_STATES:
            state.labels(name).set_function(
                lambda name=name: int(d.remote.snapshot()["state"] == name))
        gauge("cached_remote_publish_queue", "Publishes waiting to go out.",
              lambda: d.remote.snapshot()["publish_queue"])


def _build_info(d: Any) -> None:
    """``cached_build_info``: 1 per registered toolchain, the same label keys on each."""
    keys = ["version", "toolchain", "name", "default", *map(label, VERSION_LABELS)]
    info = Gauge("cached_build_info", "Always 1 per registered toolchain: cached's version, "
                 "the toolchain's digest (as cached stats shows it) and name, whether it is "
                 "the default, and its readable versions.", keys, registry=d.stats.registry)
    for t in d.toolchains.snapshot():
        versions = t.get("versions", {})
        info.labels(d.version, t["fingerprint"], t["name"], str(bool(t.get("default"))).lower(),
                    *(str(versions.get(v, "")) for v in VERSION_LABELS)).set(1)


def make_metrics(daemon: Any) -> Callable:
    """prometheus_client's ASGI app serving the daemon's registry: its counters, gauges and
    info series, and the process's own (``process_*``: CPU, memory, open files, start
    time)."""
    registry = daemon.stats.registry
    _gauges(daemon)
    _build_info(daemon)
    registry.register(_Kept(daemon))
    ProcessCollector(registry=registry)
    return make_asgi_app(registry, disable_compression=True)
