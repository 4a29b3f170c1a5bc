"""The core ops: what ``hello``, ``get``, ``prefetch``, ``plan``, ``stats``, ``zero_stats``,
``list``, ``report``, ``gc``, ``verify`` and ``flashinfer_artifacts`` do, in terms of the
scheduler and the store. Each handler takes its op's decoded request
(cached_client.protocol) and returns its reply type; blocking store work (hashing blobs,
eviction, verification) runs off the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from cached_client import protocol as p

from . import families
from .log import event
from .scheduler import PRIORITIES, Scheduler
from .server import Access, Handler, Peer
from .stats import Stats

log = logging.getLogger("cached.service")

FLASHINFER_FAMILIES = ("flashinfer.mm_fp4", "flashinfer.bi.bmm_fp8", "flashinfer.bi.mm_fp4",
                       "flashinfer.jit")
LIST_FIELDS = ("key", "family", "kernel_name", "arch", "sm_count", "max_active_clusters",
               "params", "size", "compile_seconds", "created", "last_used", "hits", "toolchain",
               "kind")


@functools.cache
def reduction_classes() -> dict[str, dict]:
    """``hello``'s ``reduction_classes``: every family's declared classes (no toolchain is
    imported: a family module's main-process half is light)."""
    return {name: families.get(name).reduction_info() for name in families.names()}


class Service:
    def __init__(self, scheduler: Scheduler, access: Access, stats: Stats,
                 snapshot: Callable[[], dict]) -> None:
        self.scheduler = scheduler
        self.store = scheduler.store
        self.access = access
        self.stats = stats
        self.snapshot = snapshot

    async def hello(self, m: p.Empty, peer: Peer) -> p.HelloReply:
        """Who the daemon is: its default toolchain's identity (``toolchain``, ``versions``,
        ``runtime_library``) and every registered toolchain (``toolchains``)."""
        default = self.scheduler.toolchains.default
        return p.HelloReply(
            v=p.PROTOCOL_VERSION, ops=sorted(p.OPS), capabilities=list(p.CAPABILITIES),
            families=families.names(), toolchain=default.fingerprint,
            versions=dict(default.versions),
            runtime_library=self.scheduler.toolchains.runtime_library(default.fingerprint),
            serve_only=self.scheduler.pool.size == 0, may_publish=self.access.may_publish(peer),
            reduction_classes=reduction_classes(),
            toolchains=[t.to_json() for t in self.scheduler.toolchains.items])

    async def get(self, m: p.GetRequest, peer: Peer) -> p.GetReply | tuple[p.GetReply, bytes]:
        """The artifact; its latency (decoded request to reply, seconds) goes into the
        ``hit_seconds`` or ``miss_seconds`` histogram of its family."""
        started = time.perf_counter()
        entry, origin = await self.scheduler.get(
            m.request, PRIORITIES[m.priority], m.deadline_ms / 1000, m.identity)
        reply: p.GetReply | tuple[p.GetReply, bytes]
        if m.transfer == "bytes":
            data = await asyncio.get_running_loop().run_in_executor(
                self.store.readers, self.store.read_library, entry)
            reply = p.GetReply(artifact=self.scheduler.artifact(entry, origin, False)), data
        else:
            reply = p.GetReply(artifact=self.scheduler.artifact(entry, origin))
        family = m.request.family
        self.stats.observe("hit_seconds" if origin == "hit" else "miss_seconds",
                           family, time.perf_counter() - started)
        self.stats.count("bytes_served", family, entry.row["size"])
        if origin in ("hit", "remote"):  # served without compiling anything for it
            self.stats.count("compiles_avoided", family)
        return reply

    async def prefetch(self, m: p.PrefetchRequest, peer: Peer) -> p.PrefetchReply:
        return p.PrefetchReply(**self.scheduler.prefetch(m.requests, m.identity))

    async def plan(self, m: p.PlanRequest, peer: Peer) -> p.PlanReply:
        wires = await self.scheduler.plan(m)
        requests = [p.Kernel()(w, "requests") for w in wires]
        family = families.get(m.family)
        return p.PlanReply(requests=requests,
                           classes=[family.reduction_class(r.params) for r in requests])

    async def stats_(self, m: p.Empty, peer: Peer) -> p.StatsReply:
        return p.StatsReply(stats=self.snapshot())

    async def zero_stats(self, m: p.Empty, peer: Peer) -> p.ZeroStatsReply:
        """The statistics as they were, then their counters started from zero (in one
        step of the event loop: nothing is counted in between)."""
        before = self.snapshot()
        zeroed_at = self.stats.zero()
        event(log, logging.INFO, "stats.zeroed", uid=peer.uid, pid=peer.pid)
        return p.ZeroStatsReply(stats=before, zeroed_at=zeroed_at)

    async def list_(self, m: p.Empty, peer: Peer) -> p.ListReply:
        return p.ListReply(entries=[{k: r[k] for k in LIST_FIELDS} for r in self.store.rows()])

    async def report(self, m: p.ReportRequest, peer: Peer) -> p.Empty:
        for family, count in m.fallbacks.items():
            self.stats.count("client_fallbacks", family, count)
        event(log, logging.WARNING, "client.fallbacks_reported", pid=peer.pid, uid=peer.uid,
              fallbacks=m.fallbacks)
        return p.Empty()

    async def gc(self, m: p.GcRequest, peer: Peer) -> p.GcReply:
        limits: dict[str, Any] = {k: v for k, v in (("max_bytes", m.max_bytes),
                                                    ("max_files", m.max_files),
                                                    ("grace", m.grace)) if v is not None}
        report = await asyncio.get_running_loop().run_in_executor(
            None, lambda: self.store.evict(**limits))
        entries, size = self.store.totals()
        budget = self.store.budget
        return p.GcReply(evicted=report["evicted"], freed_bytes=report["freed_bytes"],
                         blocked=report["blocked"], entries=entries, bytes=size,
                         max_bytes=limits.get("max_bytes", budget.max_bytes),
                         max_files=limits.get("max_files", budget.max_files))

    async def verify(self, m: p.Empty, peer: Peer) -> p.VerifyReply:
        report = await asyncio.get_running_loop().run_in_executor(None, self.store.verify)
        return p.VerifyReply(**report)

    async def flashinfer_artifacts(self, m: p.FamilyFilter,
                                   peer: Peer) -> p.FlashInferArtifactsReply:
        """Verified FlashInfer artifacts for ``cached export``: rows, meta and object paths."""
        rows = await asyncio.get_running_loop().run_in_executor(
            None, self._flashinfer_rows, m.family)
        return p.FlashInferArtifactsReply(
            artifacts=rows, toolchain=self.scheduler.toolchains.default.fingerprint)

    def _flashinfer_rows(self, wanted: str | None) -> list[dict]:
        out = []
        for row in self.store.rows():
            if row["family"] not in FLASHINFER_FAMILIES or (wanted and row["family"] != wanted):
                continue
            entry = self.store.lookup(row["key"])
            if entry is None:
                continue
            r = entry.row
            out.append({k: r[k] for k in ("key", "family", "kernel_name", "symbol", "arch",
                                          "toolchain", "source_sha256", "object_sha256",
                                          "created")}
                       | {"meta": json.loads(r["meta"] or "{}"), "params": json.loads(r["params"]),
                          "object_path": str(entry.object_path)})
        return out

    def ops(self) -> dict[str, Handler]:
        return {"hello": self.hello, "get": self.get, "prefetch": self.prefetch,
                "plan": self.plan, "stats": self.stats_, "zero_stats": self.zero_stats,
                "list": self.list_, "report": self.report, "gc": self.gc, "verify": self.verify,
                "flashinfer_artifacts": self.flashinfer_artifacts}
