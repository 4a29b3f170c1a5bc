"""``GET /metrics``: the daemon's state for Prometheus, through prometheus_client.

One registry, :attr:`cached.stats.Stats.registry`: the counters and histograms the
components count into (``Stats``), plus one collector (:class:`_Snapshot`) that renders the
daemon's one snapshot (:func:`cached.view.snapshot.take`, counts since the start: what it
exports as counters stays monotonic whatever ``stats --zero`` did), taken once per scrape:
the gauges (queue, workers by state, store against its budget, connections, fleet tier
state), the counters the store, the pool and the fleet tier keep themselves, and one info
series per registered toolchain; and the process's own ``process_*`` metrics.
prometheus_client's ASGI app serves it, in the text format or, to a scraper whose
``Accept`` asks for it, OpenMetrics. Metric names and what to alert on are in
docs/operations.md.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

from cached_client.identity import VERSION_NAMES
from prometheus_client import ProcessCollector, make_asgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .snapshot import WORKER_STATES, DaemonSnapshot, Parts, take

REMOTE_STATES = ("connecting", "up", "down", "full")
"""``cached_remote_state{state}``: 1 for the fleet tier's current state, 0 for the others."""
REMOTE_RESULTS = ("hits", "misses", "rejected", "published", "errors", "skipped",
                  "publish_dropped", "records_published", "record_hits")
"""``cached_remote_operations_total{result}``: the fleet tier's counters by result."""
VERSION_LABELS = ("python", *VERSION_NAMES)
"""The readable versions ``cached_build_info`` names (:func:`cached_client.identity.versions`),
each as a label of the same name (``-`` as ``_``), empty when a toolchain lacks it."""


def label(name: str) -> str:
    """A version's name as a Prometheus label (``nvidia-cutlass-dsl`` -> ``nvidia_cutlass_dsl``)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


class _Snapshot(Collector):
    """What the daemon's snapshot shows, rendered at scrape time from one snapshot."""

    def __init__(self, daemon: Parts) -> None:
        self.daemon = daemon

    def collect(self) -> Iterator[Metric]:
        snap = take(self.daemon, since_zero=False)
        yield from _gauges(snap)
        yield from _kept(snap)
        yield from _remote(snap)
        yield _build_info(snap)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _gauges(s: DaemonSnapshot) -> Iterator[Metric]:
    """The gauges: jobs, workers by state, the store against its budget, connections."""
    yield _gauge("cached_queue_depth", "Compilations waiting for a worker.", s.jobs.queued)
    yield _gauge("cached_compilations_running", "Compilations on a worker now.",
                 s.jobs.running)
    yield _gauge("cached_in_flight", "Keys queued or compiling (each compiled once).",
                 s.jobs.in_flight)
    workers = GaugeMetricFamily(
        "cached_workers", "Compile workers by state: idle, busy (compiling), starting "
        "(importing the toolchain), down (being replaced); each worker in one state, "
        "summing to the configured count.", labels=["state"])
    states = s.worker_states
    for state in WORKER_STATES:
        workers.add_metric([state], states[state])
    yield workers
    yield _gauge("cached_workers_configured", "Compile workers configured (0: serve-only).",
                 s.pool.size)
    store = s.store
    yield _gauge("cached_store_bytes", "Bytes of stored blobs (index).", store.bytes)
    yield _gauge("cached_store_entries", "Stored kernels.", store.entries)
    yield _gauge("cached_store_max_bytes", "Store budget in bytes (0: none).", store.max_bytes)
    yield _gauge("cached_store_max_files", "Store budget in blob files (0: none).",
                 store.max_files)
    yield _gauge("cached_store_over_budget", "1 when eviction could not get under budget "
                 "(all in use).", int(store.over_budget))
    yield _gauge("cached_connections", "Open client connections.", s.connections)
    yield _gauge("cached_start_time_seconds", "Unix time the daemon started.", s.started)


def _kept(s: DaemonSnapshot) -> Iterator[Metric]:
    """Counters the components keep themselves (store eviction, worker restarts)."""
    yield CounterMetricFamily("cached_worker_restarts",
                              "Workers replaced after dying or overrunning a job.",
                              value=s.counts.worker_restarts)
    yield CounterMetricFamily("cached_store_evictions", "Entries evicted (LRU).",
                              value=s.store.evictions)
    yield CounterMetricFamily("cached_store_evicted_bytes", "Bytes freed by eviction.",
                              value=s.store.evicted_bytes)


def _remote(s: DaemonSnapshot) -> Iterator[Metric]:
    """The fleet tier's state and counters (cached/fleet/, docs/fleet.md); nothing when it
    is off."""
    tier = s.remote
    if tier is None:
        return
    state = GaugeMetricFamily("cached_remote_state", "1 for the fleet tier's current state "
                              "(down/full: local-only).", labels=["state"])
    for name in REMOTE_STATES:
        state.add_metric([name], int(tier["state"] == name))
    yield state
    yield _gauge("cached_remote_publish_queue", "Publishes waiting to go out.",
                 tier["publish_queue"])
    hits = CounterMetricFamily("cached_remote_hits",
                               "Local misses answered from the fleet tier (not compiled).",
                               labels=["family"])
    for f, counts in sorted(s.families.items()):
        hits.add_metric([f], float(counts["remote_hits"]))
    yield hits
    ops = CounterMetricFamily("cached_remote_operations",
                              "Fleet tier operations by result.", labels=["result"])
    for result in REMOTE_RESULTS:
        ops.add_metric([result], float(tier[result]))
    yield ops
    moved = CounterMetricFamily("cached_remote_bytes", "Bytes read from and written to "
                                "the fleet tier (stored, compressed).", labels=["direction"])
    moved.add_metric(["in"], float(tier["bytes_in"]))
    moved.add_metric(["out"], float(tier["bytes_out"]))
    yield moved


def _build_info(s: DaemonSnapshot) -> Metric:
    """``cached_build_info``: 1 per registered toolchain, the same label keys on each."""
    info = GaugeMetricFamily(
        "cached_build_info", "Always 1 per registered toolchain: cached's version, the "
        "toolchain's digest (as cached stats shows it) and name, whether it is the default, "
        "and its readable versions.",
        labels=["version", "toolchain", "name", "default", *map(label, VERSION_LABELS)])
    for t in s.toolchains:
        versions = t.get("versions", {})
        info.add_metric([s.version, t["fingerprint"], t["name"],
                         str(bool(t.get("default"))).lower(),
                         *(str(versions.get(v, "")) for v in VERSION_LABELS)], 1)
    return info


def make_metrics(daemon: Parts) -> Callable:
    """prometheus_client's ASGI app serving the daemon's registry: the counters
    :class:`cached.stats.Stats` counts into, what one snapshot per scrape shows
    (gauges, kept counters, info series), and the process's own (``process_*``: CPU,
    memory, open files, start time)."""
    registry = daemon.stats.registry
    registry.register(_Snapshot(daemon))
    ProcessCollector(registry=registry)
    return make_asgi_app(registry, disable_compression=True)
