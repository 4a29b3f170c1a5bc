"""The core ops: what ``hello``, ``get``, ``get_batch``, ``prefetch``, ``plan``, ``stats``,
``zero_stats``,
``list``, ``report``, ``gc``, ``verify`` and ``flashinfer_artifacts`` do, in terms of the
scheduler and the store. Each handler takes its op's decoded request
(cached_client.protocol) and returns its reply type; blocking store work (hashing blobs,
eviction, verification) runs off the event loop.

``get`` hands the library over as the request asks (cached.artifacts): open descriptors
of the blobs the client names (transfer ``fd``; opened without following links, checked to
be regular files of the indexed size, passed with SCM_RIGHTS, so an eviction after the
reply cannot break the client's load), the blobs' paths (``path``), or the library's bytes
streamed from its file after a digest check (``bytes``). :class:`QueueQuota` bounds the
compilations one uid without publish rights can have queued or running.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from cached_client import protocol as p
from cached_client.errors import CachedError, IntegrityError, Overloaded, UnknownFamily
from cached_client.keys import KernelRequest

from cached import families
from cached.toolchain import trust

from .artifacts import Served, open_blobs, open_checked_library
from .log import event
from .scheduler import PRIORITY_RANK, Scheduler
from .server import Access, Attachment, Handler, Peer, served_ops
from .stats import Stats
from .store.blobs import BadBlob
from .view.snapshot import DaemonSnapshot

log = logging.getLogger("cached.service")

REPORT_BUDGET = 1000
"""Counts one uid may add to one report counter of one family per REPORT_WINDOW_S."""
REPORT_WINDOW_S = 60.0
REPORT_LOG_S = 10.0


def _short_fields(value: Any) -> Any:
    """A reported field as logged: a family map's first 16 entries, names cut to 300."""
    if isinstance(value, dict):
        return {str(k)[:200]: v for k, v in list(value.items())[:16]}
    if isinstance(value, list):
        return [str(v)[:300] for v in value[:16]]
    return value


LIST_FIELDS = ("key", "family", "kernel_name", "arch", "sm_count", "max_active_clusters",
               "params", "size", "compile_seconds", "created", "last_used", "hits", "toolchain",
               "kind")
EXPORT_FIELDS = ("key", "family", "kernel_name", "symbol", "arch", "toolchain", "source_sha256",
                 "object_sha256", "created")
"""The row fields ``flashinfer_artifacts`` names (besides its parsed meta, params and path)."""


@functools.cache
def reduction_classes() -> dict[str, dict]:
    """``hello``'s ``reduction_classes``: every family's declared classes (no toolchain is
    imported: a family module's main-process half is light)."""
    return {name: families.get(name).reduction_info() for name in families.names()}


class QueueQuota:
    """Compilations and plan jobs each uid without publish rights may have queued or
    running: at most ``limit`` in all (0: no limit). A uid's count is the keys it caused to
    be queued that are still in flight (a key already queued by anyone costs nothing more)
    and its plan requests being answered. Peers allowed to publish (the operator's
    warm-ups) are not counted."""

    def __init__(self, scheduler: Scheduler, access: Access, limit: int) -> None:
        self.scheduler = scheduler
        self.access = access
        self.limit = limit
        self._keys: dict[int, set[str]] = {}
        self._plans: Counter[int] = Counter()

    def held(self, uid: int) -> int:
        keys = self._keys.get(uid)
        if keys:
            keys.intersection_update(self.scheduler.inflight)
        return len(keys or ()) + self._plans[uid]

    def admit(self, peer: Peer, keys: list[str | None]) -> list[bool]:
        """Which of ``keys`` (None: a request the scheduler will refuse anyway) ``peer`` may
        queue now, counting those that would start a compilation against its uid. Call it
        right before queueing, with no await in between: the count is of keys in flight."""
        if not self.limit or self.access.may_publish(peer):
            return [True] * len(keys)
        held = self.held(peer.uid)
        mine = self._keys.setdefault(peer.uid, set())
        out = []
        for key in keys:
            new = (key is not None and key not in mine and key not in self.scheduler.inflight
                   and not self.scheduler.store.contains(key))
            if new and held >= self.limit:
                out.append(False)
                continue
            if new:
                mine.add(key)
                held += 1
            out.append(True)
        return out

    @contextlib.contextmanager
    def planning(self, peer: Peer) -> Iterator[None]:
        """Count one plan request of ``peer`` against its limit while it is answered
        (Overloaded at once when the limit is reached)."""
        if not self.limit or self.access.may_publish(peer):
            yield
            return
        if self.held(peer.uid) >= self.limit:
            raise self.refusal(peer)
        self._plans[peer.uid] += 1
        try:
            yield
        finally:
            self._plans[peer.uid] -= 1
            if not self._plans[peer.uid]:
                del self._plans[peer.uid]

    def refusal(self, peer: Peer) -> Overloaded:
        return Overloaded(f"uid {peer.uid} has {self.limit} compilations or plans queued or "
                          "running, its limit (max_queued_per_uid); wait for them or ask an "
                          "operator")


class Service:
    def __init__(self, scheduler: Scheduler, served: Served, access: Access, stats: Stats,
                 snapshot: Callable[[], DaemonSnapshot], quota: QueueQuota | None = None,
                 on_plan: Callable[[p.PlanRequest, Peer], None] | None = None) -> None:
        self.on_plan = on_plan  # told of every answered plan (cached tune --planned)
        self.scheduler = scheduler
        self.served = served
        self.store = scheduler.store
        self.access = access
        self.stats = stats
        self.snapshot = snapshot
        self.quota = quota or QueueQuota(scheduler, access, 0)
        self._reported: dict[tuple[int, str, str], list[float]] = {}
        self._report_logged: dict[tuple[int, str], list[float]] = {}

    async def hello(self, m: p.Empty, peer: Peer) -> p.HelloReply:
        """Who the daemon is: its default toolchain's identity (``toolchain``, ``versions``,
        ``runtime_library``) and every registered toolchain (``toolchains``)."""
        default = self.scheduler.toolchains.default
        return p.HelloReply(
            v=p.PROTOCOL_VERSION, ops=sorted(served_ops()), capabilities=list(p.CAPABILITIES),
            families=families.names(), toolchain=default.fingerprint,
            versions=dict(default.versions),
            runtime_library=self.scheduler.toolchains.runtime_library(default.fingerprint),
            serve_only=self.scheduler.pool.size == 0, may_publish=self.access.may_publish(peer),
            reduction_classes=reduction_classes(),
            toolchains=[t.to_json() for t in self.scheduler.toolchains.items])

    async def get(self, m: p.GetRequest, peer: Peer
                  ) -> p.GetReply | tuple[p.GetReply, Attachment]:
        """The artifact, handed over as ``m.transfer`` asks; a serving request's latency
        (decoded request to reply, seconds) goes into the ``hit_seconds`` or
        ``miss_seconds`` histogram of its family (a pre-warm request's does not)."""
        started = time.perf_counter()
        reply = await self._get(m, peer)
        artifact = (reply[0] if isinstance(reply, tuple) else reply).artifact
        family = m.request.family
        if m.priority != "prewarm":
            self.stats.observe("hit_seconds" if artifact.origin == "hit" else "miss_seconds",
                               family, time.perf_counter() - started)
        self.stats.count("bytes_served", family, artifact.library_size + artifact.object_size)
        if artifact.origin in ("hit", "remote"):  # served without compiling anything for it
            self.stats.count("compiles_avoided", family)
        return reply

    async def _get(self, m: p.GetRequest, peer: Peer
                   ) -> p.GetReply | tuple[p.GetReply, Attachment]:
        admit = None
        if self.quota.limit and not self.access.may_publish(peer):
            admit = functools.partial(self._admit, peer)
        for attempt in range(3):
            entry, origin = await self.scheduler.get(
                m.request, PRIORITY_RANK[m.priority], m.deadline_ms / 1000, m.identity, admit,
                self.access.group(peer))
            if m.priority == "prewarm" and attempt == 0:
                self.served.prime(entry)
            if m.transfer == "path":  # a hit's reply encoded once per row version
                reply, encoded = self.served.get_reply(entry, origin, "path")
                return reply, Attachment(encoded=encoded)
            try:
                if m.transfer == "fd":
                    kinds = tuple(k for k in p.BLOB_KINDS if k in m.blobs)
                    fds = open_blobs(entry, list(kinds))
                    reply, encoded = self.served.get_reply(entry, origin, "fd", kinds)
                    return reply, Attachment(fds=fds, encoded=encoded)
                fd = await asyncio.get_running_loop().run_in_executor(
                    None, open_checked_library, self.store, entry)
                return (p.GetReply(artifact=self.served.artifact(entry, origin, False)),
                        Attachment(payload_fd=fd, payload_size=entry.row.library_size))
            except FileNotFoundError:  # evicted between the lookup and the open: again
                continue
            except BadBlob as exc:
                self.store.drop(entry.key, str(exc))
                if attempt == 2:
                    raise IntegrityError(f"the stored blobs of {entry.key[:12]} changed while "
                                         f"being sent ({exc}); they were dropped, and the next "
                                         "request rebuilds them") from None
        raise IntegrityError("the kernel's blobs kept vanishing before they could be sent "
                             "(a store budget smaller than the kernels asked for?); retry")

    async def get_batch(self, m: p.GetBatchRequest, peer: Peer
                        ) -> tuple[p.GetBatchReply, Attachment]:
        """Each request as its own ``get`` (concurrently: misses compile side by side), in
        one reply: an item per request, in order, with its artifact and the blobs whose
        descriptors follow (transfer ``fd``), or its typed error. The descriptors go in
        item order; none is leaked when one get fails or the reply is never sent."""
        gets = [p.GetRequest(request=r, deadline_ms=m.deadline_ms, priority=m.priority,
                             transfer=m.transfer, blobs=m.blobs, identity=m.identity)
                for r in m.requests]
        answers = await asyncio.gather(*(self.get(g, peer) for g in gets),
                                       return_exceptions=True)
        items, attachment = [], Attachment()
        try:
            for answer in answers:
                if isinstance(answer, CachedError):
                    items.append(p.GetBatchItem(error=answer.to_wire()))
                    continue
                if isinstance(answer, BaseException):
                    raise answer
                reply, fds = answer if isinstance(answer, tuple) else (answer, None)
                items.append(p.GetBatchItem(artifact=reply.artifact, fds=reply.fds))
                if fds is not None:
                    attachment.fds += fds.fds
                    fds.fds = []
        except BaseException:
            attachment.close()
            for answer in answers:
                if isinstance(answer, tuple):
                    answer[1].close()
            raise
        kinds = [kind for item in items for kind in item.fds]
        return p.GetBatchReply(items=items, fds=kinds), attachment

    def _key(self, request: Any, identity: p.Identity | None = None) -> str | None:
        """The store key of a request, or None when the scheduler will refuse it."""
        try:
            wire = request if isinstance(request, KernelRequest) else KernelRequest.from_wire(
                request)
            return self.scheduler.resolve(wire, identity)[2].key
        except CachedError:
            return None

    def _admit(self, peer: Peer, key: str) -> None:
        """The queued-compilation quota, right before a miss of ``peer``'s is queued."""
        if not self.quota.admit(peer, [key])[0]:
            raise self.quota.refusal(peer)

    async def prefetch(self, m: p.PrefetchRequest, peer: Peer) -> p.PrefetchReply:
        if not self.quota.limit or self.access.may_publish(peer):
            return p.PrefetchReply(**self.scheduler.prefetch(m.requests, m.identity))
        allowed = self.quota.admit(peer, [self._key(wire, m.identity) for wire in m.requests])
        indices = [i for i, ok in enumerate(allowed) if ok]
        refused = self.quota.refusal(peer).to_wire()
        report = self.scheduler.prefetch([m.requests[i] for i in indices], m.identity)
        for item in report["rejected"]:
            item["index"] = indices[item["index"]]
        report["rejected"] = sorted(
            report["rejected"] + [{"index": i, "error": refused}
                                  for i, ok in enumerate(allowed) if not ok],
            key=lambda r: r["index"])
        return p.PrefetchReply(**report)

    async def plan(self, m: p.PlanRequest, peer: Peer) -> p.PlanReply:
        """The family's tactic space for ``m`` (cached.scheduler.Scheduler.plan: a light
        family's in this process, another's in a worker); counted against the peer's queue
        limit while it waits (a plan whose requester hangs up is dropped from
        the queue: cached.server cancels its request)."""
        with self.quota.planning(peer):
            requests = await self.scheduler.plan(m)
        family = families.get(m.family)
        if self.on_plan is not None:
            self.on_plan(m, peer)
        return p.PlanReply(requests=requests,
                           classes=[family.reduction_class(r.params) for r in requests])

    async def stats_reply(self, m: p.Empty, peer: Peer) -> p.StatsReply:
        """The daemon's snapshot as the wire has it (:meth:`DaemonSnapshot.to_wire`)."""
        return p.StatsReply(stats=self.snapshot().to_wire())

    async def zero_stats(self, m: p.Empty, peer: Peer) -> p.ZeroStatsReply:
        """The statistics as they were, then their counters started from zero (in one
        step of the event loop: nothing is counted in between)."""
        before = self.snapshot().to_wire()
        zeroed_at = self.stats.zero()
        event(log, logging.INFO, "stats.zeroed", uid=peer.uid, pid=peer.pid)
        return p.ZeroStatsReply(stats=before, zeroed_at=zeroed_at)

    async def list_entries(self, m: p.Empty, peer: Peer) -> p.ListReply:
        return p.ListReply(entries=[{k: getattr(r, k) for k in LIST_FIELDS}
                                     for r in self.store.rows()])

    async def report(self, m: p.ReportRequest, peer: Peer) -> p.Empty:
        """Counts a client tells of its own process: ``fallbacks`` (kernels it compiled while
        this daemon was unusable to it) and ``outside`` (kernels it built or loaded outside
        this daemon while serving, cached_client.monitor). Families must be registered
        (UnknownFamily, nothing counted): the counters' rows stay bounded. Each uid adds at
        most REPORT_BUDGET to a counter of a family per REPORT_WINDOW_S (the rest is counted
        as ``reports_clipped``), and its report lines are logged at most once every
        REPORT_LOG_S (the next says how many were not)."""
        known = set(families.names())
        for name in ("fallbacks", "outside"):
            unknown = sorted(set(getattr(m, name)) - known)
            if unknown:
                raise UnknownFamily(f"report: {name} names families this daemon does not "
                                    f"have: {', '.join(f[:80] for f in unknown[:4])}; "
                                    f"nothing was counted")
        fallbacks = {f: self._budget(peer, "client_fallbacks", f, n)
                     for f, n in m.fallbacks.items()}
        outside = {f: self._budget(peer, "client_outside_kernels", f, n)
                   for f, n in m.outside.items()}
        for family, count in fallbacks.items():
            if count:
                self.stats.count("client_fallbacks", family, count)
        for family, count in outside.items():
            if count:
                self.stats.count("client_outside_kernels", family, count)
        if m.outside:
            self.stats.note_outside(peer.pid, m.outside_kernels)
        if m.fallbacks:
            self._log_report(peer, "client.fallbacks_reported", fallbacks=m.fallbacks)
        if m.outside:
            self._log_report(peer, "client.outside_kernels_reported", outside=m.outside,
                             kernels=m.outside_kernels)
        return p.Empty()

    def _budget(self, peer: Peer, counter: str, family: str, n: int) -> int:
        """How much of ``n`` the uid of ``peer`` may still add to ``counter`` of ``family``
        in this window; the rest is counted as ``reports_clipped``."""
        now = time.monotonic()
        key = (peer.uid, counter, family)
        window = self._reported.get(key)
        if window is None or now - window[0] >= REPORT_WINDOW_S:
            if len(self._reported) >= 4096:
                self._reported.clear()
            window = self._reported[key] = [now, 0]
        allowed = max(0, min(n, REPORT_BUDGET - int(window[1])))
        window[1] += allowed
        if allowed < n:
            self.stats.count("reports_clipped", None, n - allowed)
        return allowed

    def _log_report(self, peer: Peer, name: str, **fields: Any) -> None:
        """``name`` for ``peer``'s uid at most once every REPORT_LOG_S."""
        now = time.monotonic()
        key = (peer.uid, name)
        last = self._report_logged.get(key)
        if last is not None and now - last[0] < REPORT_LOG_S:
            last[1] += 1
            return
        if len(self._report_logged) >= 4096:
            self._report_logged.clear()
        dropped = last[1] if last is not None else 0
        self._report_logged[key] = [now, 0]
        event(log, logging.WARNING, name, pid=peer.pid, uid=peer.uid,
              **({"not_logged": dropped} if dropped else {}),
              **{k: _short_fields(v) for k, v in fields.items()})

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
            None, self._flashinfer_rows, m.family, self.access.group(peer))
        return p.FlashInferArtifactsReply(
            artifacts=rows, toolchain=self.scheduler.toolchains.default.fingerprint)

    def _flashinfer_rows(self, wanted: str | None, group: str | None) -> list[dict]:
        """The rows ``cached export`` writes into FlashInfer's cache: only those a peer of
        trust ``group`` may be served (cached/toolchain/trust.py)."""
        out, exported = [], families.flashinfer_kernels()
        for row in self.store.rows():
            if row.family not in exported or (wanted and row.family != wanted):
                continue
            if not trust.may_serve(row, group):
                continue
            entry = self.store.lookup(row.key)
            if entry is None:
                continue
            r = entry.row
            out.append({k: getattr(r, k) for k in EXPORT_FIELDS}
                       | {"meta": json.loads(r.meta or "{}"), "params": json.loads(r.params),
                          "object_path": str(entry.object_path)})
        return out

    def ops(self) -> dict[str, Handler]:
        return {"hello": self.hello, "get": self.get, "get_batch": self.get_batch,
                "prefetch": self.prefetch,
                "plan": self.plan, "stats": self.stats_reply, "zero_stats": self.zero_stats,
                "list": self.list_entries, "report": self.report, "gc": self.gc,
                "verify": self.verify, "flashinfer_artifacts": self.flashinfer_artifacts}
