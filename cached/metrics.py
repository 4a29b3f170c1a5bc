"""``GET /metrics``: the daemon's state in Prometheus text format (prometheus-client).

Nothing is counted twice: a collector renders, at scrape time, the daemon's counters
(:class:`cached.stats.Stats`, monotonic whatever ``stats --zero`` did, with its compile
and get-latency histograms) for every registered family, its components' snapshots (store,
pool, scheduler) and the process's own ``process_*`` metrics. Metric names and what to
alert on are in docs/operations.md.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from .families import names as registered_families
from .stats import Stats

HISTOGRAM_METRICS = (
    ("cached_compile_duration_seconds", "Compile time of stored kernels, in the worker.",
     "compile_seconds"),
    ("cached_hit_duration_seconds", "Latency of get requests answered from the store: "
     "request decoded to reply ready.", "hit_seconds"),
    ("cached_miss_duration_seconds", "Latency of get requests that missed, until served: "
     "waiting for a compilation (its own or one in flight) or a fleet-tier fetch.",
     "miss_seconds"),
)
"""(metric, help, Stats histogram) of every histogram exported."""

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _Collector:
    def __init__(self, daemon: Any) -> None:
        self.daemon = daemon

    def collect(self) -> Iterator[Metric]:
        d = self.daemon
        stats: Stats = d.stats
        # monotonic since the start (stats --zero does not reset what Prometheus sees);
        # every registered family has its series, zero until it has traffic
        counters, by_family = stats.view(registered_families(), since_zero=False)
        names = sorted(by_family)

        def per_family(name: str, doc: str, counter: str) -> Metric:
            m = CounterMetricFamily(name, doc, labels=["family"])
            for f in names:
                m.add_metric([f], float(by_family[f][counter]))
            return m

        yield per_family("cached_hits", "Requests answered from the store.", "hits")
        yield per_family("cached_misses", "Requests that needed a compilation.", "misses")
        yield per_family("cached_compilations", "Compilations stored.", "compiles")
        yield per_family("cached_compile_failures",
                         "Compilations that failed (compiler error, worker died or overran).",
                         "failures")
        yield per_family("cached_persist_failures",
                         "Kernels compiled but not stored (disk full, budget): served to "
                         "their waiters unstored.", "persist_failures")
        yield per_family("cached_compiles_avoided",
                         "Artifacts served that nobody compiled for that request: get hits, "
                         "fleet-tier fetches, write-back hits.", "compiles_avoided")
        yield per_family("cached_published",
                         "Artifacts written back by clients (write-back families, and any "
                         "family of an environment the daemon has no toolchain for).",
                         "published")
        yield per_family("cached_served_bytes", "Bytes of the artifacts served (get answers "
                         "and write-back hits).", "bytes_served")
        yield per_family("cached_published_bytes", "Bytes of the artifacts written back.",
                         "bytes_published")
        yield per_family("cached_client_fallbacks",
                         "In-process compilations clients reported while the daemon was "
                         "unusable to them.", "client_fallbacks")
        for metric, doc, histogram in HISTOGRAM_METRICS:
            hist = HistogramMetricFamily(metric, doc, labels=["family"])
            for f in names:
                buckets, total = stats.histogram(f, histogram)
                hist.add_metric([f], buckets, total)
            yield hist
        errors = CounterMetricFamily("cached_errors", "Error replies by code.", labels=["code"])
        for key, value in sorted(counters.items()):
            if key.startswith("errors."):
                errors.add_metric([key.split(".", 1)[1]], float(value))
        yield errors

        jobs = d.scheduler.snapshot()
        yield GaugeMetricFamily("cached_queue_depth", "Compilations waiting for a worker.",
                                value=jobs.queued)
        yield GaugeMetricFamily("cached_compilations_running", "Compilations on a worker now.",
                                value=jobs.running)
        yield GaugeMetricFamily("cached_in_flight",
                                "Keys queued or compiling (each compiled once).",
                                value=jobs.in_flight)
        workers = GaugeMetricFamily("cached_workers", "Compile workers by state.",
                                    labels=["state"])
        pool = d.pool.snapshot()
        for state, value in (("configured", pool.size), ("alive", pool.alive),
                             ("ready", pool.ready), ("idle", pool.idle)):
            workers.add_metric([state], value)
        yield workers
        yield CounterMetricFamily("cached_worker_restarts",
                                  "Workers replaced after dying or overrunning a job.",
                                  value=pool.restarts)

        store = d.store.snapshot()
        yield GaugeMetricFamily("cached_store_bytes", "Bytes of stored blobs (index).",
                                value=store.bytes)
        yield GaugeMetricFamily("cached_store_entries", "Stored kernels.", value=store.entries)
        yield GaugeMetricFamily("cached_store_max_bytes", "Store budget in bytes (0: none).",
                                value=store.max_bytes)
        yield GaugeMetricFamily("cached_store_max_files",
                                "Store budget in blob files (0: none).", value=store.max_files)
        yield GaugeMetricFamily("cached_store_over_budget",
                                "1 when eviction could not get under budget (all in use).",
                                value=int(store.over_budget))
        yield CounterMetricFamily("cached_store_evictions", "Entries evicted (LRU).",
                                  value=store.evictions)
        yield CounterMetricFamily("cached_store_evicted_bytes", "Bytes freed by eviction.",
                                  value=store.evicted_bytes)
        yield GaugeMetricFamily("cached_connections", "Open client connections.",
                                value=d.server.connections)
        yield GaugeMetricFamily("cached_start_time_seconds",
                                "Unix time the daemon started.", value=d.started)
        yield from _remote_metrics(getattr(d, "remote", None), by_family)
        labels = {"version": d.version, "toolchain": d.toolchains.default.digest,
                  **{re.sub(r"[^a-zA-Z0-9_]", "_", k): v for k, v in d.versions.items()}}
        info = GaugeMetricFamily("cached_build_info", "Always 1: this daemon's version, the "
                                 "digest of its default toolchain (as in stats) and the "
                                 "versions in it.", labels=list(labels))
        info.add_metric(list(labels.values()), 1)
        yield info
        toolchains = GaugeMetricFamily("cached_toolchain_info", "Always 1 per registered "
                                       "toolchain: its name, digest and readable versions.",
                                       labels=["name", "toolchain", "flashinfer", "dsl",
                                               "tvm_ffi", "torch", "python"])
        for t in d.toolchains.snapshot():
            v = t.get("versions", {})
            toolchains.add_metric([t["name"], t["fingerprint"], v.get("flashinfer-python", ""),
                                   v.get("nvidia-cutlass-dsl", ""), v.get("apache-tvm-ffi", ""),
                                   v.get("torch", ""), v.get("python", "")], 1)
        yield toolchains


REMOTE_STATES = ("connecting", "up", "down", "full")


def _remote_metrics(remote: Any, by_family: dict[str, dict[str, float]]) -> Iterator[Metric]:
    """The fleet tier (cached/remote.py, docs/fleet.md); nothing when it is off."""
    if remote is None:
        return
    snap = remote.snapshot()
    state = GaugeMetricFamily("cached_remote_state",
                              "1 for the fleet tier's current state (down/full: local-only).",
                              labels=["state"])
    for name in REMOTE_STATES:
        state.add_metric([name], int(snap["state"] == name))
    yield state
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
    yield GaugeMetricFamily("cached_remote_publish_queue", "Publishes waiting to go out.",
                            value=snap["publish_queue"])
    moved = CounterMetricFamily("cached_remote_bytes", "Bytes read from and written to "
                                "the fleet tier (stored, compressed).", labels=["direction"])
    moved.add_metric(["in"], float(snap["bytes_in"]))
    moved.add_metric(["out"], float(snap["bytes_out"]))
    yield moved


def make_metrics(daemon: Any) -> Callable[[], bytes]:
    """A function that renders the daemon's metrics in the Prometheus text format, with
    the process's own (``process_*``: CPU, memory, open files, start time)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(daemon))
    ProcessCollector(registry=registry)
    return lambda: generate_latest(registry)
