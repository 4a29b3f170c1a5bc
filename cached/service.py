"""The core ops: what ``hello``, ``get``, ``prefetch``, ``plan``, ``stats``, ``list``,
``report``, ``gc``, ``verify`` and ``flashinfer_artifacts`` do, in terms of the scheduler
and the store. Each handler takes its op's decoded request (cached_client.protocol) and
returns its reply type; blocking store work (hashing blobs, eviction, verification) runs
off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
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
               "params", "size", "compile_seconds", "created", "last_used", "hits")


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
            toolchains=[t.to_json() for t in self.scheduler.toolchains.items])

    async def get(self, m: p.GetRequest, peer: Peer) -> p.GetReply | tuple[p.GetReply, bytes]:
        entry, origin = await self.scheduler.get(
            m.request, PRIORITIES[m.priority], m.deadline_ms / 1000, m.identity)
        if m.transfer == "bytes":
            data = await asyncio.get_running_loop().run_in_executor(
                None, self.store.read_library, entry)
            return p.GetReply(artifact=self.scheduler.artifact(entry, origin, False)), data
        return p.GetReply(artifact=self.scheduler.artifact(entry, origin))

    async def prefetch(self, m: p.PrefetchRequest, peer: Peer) -> p.PrefetchReply:
        return p.PrefetchReply(**self.scheduler.prefetch(m.requests, m.identity))

    async def plan(self, m: p.PlanRequest, peer: Peer) -> p.PlanReply:
        wires = await self.scheduler.plan(m)
        return p.PlanReply(requests=[p.Kernel()(w, "requests") for w in wires])

    async def stats_(self, m: p.Empty, peer: Peer) -> p.StatsReply:
        return p.StatsReply(stats=self.snapshot())

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
                "plan": self.plan, "stats": self.stats_, "list": self.list_,
                "report": self.report, "gc": self.gc, "verify": self.verify,
                "flashinfer_artifacts": self.flashinfer_artifacts}
