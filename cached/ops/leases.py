"""Write-back leases: one process on the node compiles a kernel the daemon will not compile.

Many FlashInfer CuTe-DSL kernels are built by ``build_and_load_cute_dsl_kernel`` from a
compile closure the daemon cannot rebuild (family ``flashinfer.jit``); and an environment no
registered toolchain matches gets ``unknown_toolchain`` for any family
(cached/toolchain/toolchains.py). For those, keyed under the publisher's own identity, the first
process that needs a key takes a *lease*, compiles, and publishes the exported object
(cached/ops/uploads.py); processes asking for the same key meanwhile wait on the lease instead
of compiling. A lease ends when its holder publishes or releases it, when its time-to-live
passes without a renewal (a stalled holder), or when its holder process is gone (watched
through a pidfd opened from SO_PEERCRED's pid, checked every ``POLL_S``: no /proc involved,
so it holds under systemd's ProtectProc=invisible and ProcSubset=pid, and a reused pid
cannot pass for the holder); the next waiter then gets it. A peer that may not publish is
told to compile locally instead of being handed a lease it could never fulfil. Ops:
``lease``, ``lease_renew``, ``lease_release``.

Trust (cached/toolchain/trust.py): a lease is the publisher's proof. It is taken on the key of the
peer's own trust group (:func:`cached.toolchain.trust.writeback_key`) and held by the peer that took
it (its pid and uid, from SO_PEERCRED): renewing, releasing and publishing need its token
*from that peer* while it holds (:meth:`Leases.holder`); anything else is ``not_allowed``.
A peer is served hits of its own group and trusted ones only. With ``writeback`` off
every op here is ``not_allowed``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import secrets
import select
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from cached_client import protocol as p
from cached_client.errors import InvalidTactic, NotAllowed
from cached_client.keys import KernelRequest

from cached.toolchain import trust
from cached.toolchain.toolchains import Route

from ..artifacts import Served
from ..families.base import Family
from ..log import event
from ..scheduler import Scheduler
from ..server import Access, Handler, Peer
from ..stats import Stats

log = logging.getLogger("cached.leases")

POLL_S = 0.25
ENDED_KEPT = 256
"""Replaced leases whose end reason is kept for their late holders."""


def watch(pid: int) -> int | None:
    """A pidfd of process ``pid`` (readable once it has exited), or None when there is none
    to watch (pid 0: a peer in another pid namespace; or the process is gone already)."""
    if pid <= 0:
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:  # gone, or no pidfd support: the time-to-live still ends the lease
        return None


@dataclass
class Lease:
    """One lease: its token and its holder (the pid and uid that took it)."""

    token: str
    pid: int
    uid: int
    pidfd: int | None
    ttl: float
    expires: float
    granted: float = field(default_factory=time.monotonic)
    limit: float = float("inf")
    """When it ends whatever its renewals (``granted`` + the daemon's lease_max_hold)."""

    def expired(self, now: float) -> str | None:
        """Why this lease is over (TTL passed, held to its limit, holder gone), or None while
        it holds."""
        if now >= self.expires:
            if self.expires >= self.limit:
                return (f"held {self.limit - self.granted:.0f}s, the daemon's "
                        "lease_max_hold")
            return f"not renewed within {self.ttl:.0f}s"
        if self.pidfd is not None:
            poll = select.poll()
            poll.register(self.pidfd, select.POLLIN)
            if poll.poll(0):
                return f"holder pid {self.pid} is gone"
        return None

    def close(self) -> None:
        """Stop watching the holder (the lease is over); idempotent."""
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


class Leases:
    """The leases in force, by store key, and the events their waiters sleep on."""

    def __init__(self, scheduler: Scheduler, access: Access, stats: Stats, served: Served,
                 max_hold_s: float = 3600.0) -> None:
        self.max_hold_s = max_hold_s
        """Seconds a lease may be held in all (``lease_max_hold``): no grant or renewal
        runs past ``granted + max_hold_s``, whatever TTL a peer asks for."""
        self.scheduler = scheduler
        self.served = served
        self.access = access
        self.stats = stats
        self.held: dict[str, Lease] = {}
        self.ended: OrderedDict[str, str] = OrderedDict()
        """Why the last ``ENDED_KEPT`` replaced leases ended, by token: a renewal or publish
        that arrives after its lease was granted again is told why, not only that."""
        self._changed: dict[str, asyncio.Event] = {}

    def resolve(self, wire_request: KernelRequest, identity: p.Identity | None
                ) -> tuple[Family, KernelRequest, Route]:
        """The canonical write-back request, its family and route (key under the publisher's
        identity). Written back: kernels no toolchain of the daemon may compile for that
        identity (``flashinfer.jit``'s always; any family's for an environment the daemon
        has no toolchain for)."""
        family, request, route = self.scheduler.resolve(wire_request, identity)
        if route.compiler is not None:
            raise InvalidTactic(f"{family.name} kernels of this environment are compiled by "
                                f"the daemon's toolchain {route.compiler.name} (use get)")
        return family, request, route

    def check_enabled(self) -> None:
        """NotAllowed while the operator has write-back off (setting ``writeback``)."""
        if not self.access.writeback:
            raise NotAllowed("write-back is off on this daemon (setting writeback = false): "
                             "compile this kernel in this process")

    def keys(self, route: Route, peer: Peer) -> tuple[str, list[str]]:
        """The key ``peer`` leases and publishes ``route``'s kernel under (its trust group's)
        and the keys of what it may be served, trusted first."""
        group = self.access.group(peer)
        own = trust.writeback_key(route.key, group)
        return own, [route.key] if group is None else [route.key, own]

    def holder(self, key: str, token: str, peer: Peer) -> Lease:
        """The lease on ``key`` if ``peer`` holds it with ``token`` now; NotAllowed when there
        is none, when another process took it, or when it ended (TTL, holder gone)."""
        if not token:
            raise NotAllowed("this request carries no lease token: publish, renew and release "
                             "need the token lease granted this process (a client "
                             "older than this daemon sends none: update it); nothing was "
                             "stored")
        lease = self.held.get(key)
        if lease is None:
            raise NotAllowed("no lease is held on this kernel: take one with lease first (and "
                             "publish before it expires); nothing was stored")
        if not hmac.compare_digest(lease.token.encode(), token.encode()):
            ended = self.ended.get(token)
            if ended is not None:
                raise NotAllowed(f"this lease has ended ({ended}) and was granted to pid "
                                 f"{lease.pid}; take a new one; nothing was stored")
            raise NotAllowed("this lease token is not the one in force on this kernel (the "
                             "lease ended and was granted again, or it was never this "
                             "process's); nothing was stored")
        if lease.uid != peer.uid or lease.pid != peer.pid:
            raise NotAllowed(f"this kernel's lease was taken by another process (pid "
                             f"{lease.pid}); only the process that took a lease may renew, "
                             "release or publish with it; nothing was stored")
        why = lease.expired(time.monotonic())
        if why:
            raise NotAllowed(f"the lease on this kernel has ended ({why}); take a new one; "
                             "nothing was stored")
        return lease

    def settle(self, key: str) -> None:
        """The key was published (or given up): end its lease and wake its waiters."""
        lease = self.held.pop(key, None)
        if lease is not None:
            lease.close()
        ev = self._changed.pop(key, None)
        if ev is not None:
            ev.set()

    def _grant(self, key: str, peer: Peer, ttl: float, reason: str = "") -> p.LeaseReply:
        now = time.monotonic()
        lease = Lease(secrets.token_hex(16), peer.pid, peer.uid, watch(peer.pid), ttl,
                      now + min(ttl, self.max_hold_s), granted=now,
                      limit=now + self.max_hold_s)
        old = self.held.pop(key, None)
        if old is not None:
            old.close()
            self.ended[old.token] = reason or "expired"
            while len(self.ended) > ENDED_KEPT:
                self.ended.popitem(last=False)
        self.held[key] = lease
        self.stats.count("writeback.leases_granted")
        event(log, logging.INFO, "writeback.lease_granted", key=key[:16], pid=peer.pid,
              uid=peer.uid, after=reason or "free")
        return p.LeaseReply(state="granted", lease=lease.token,
                            ttl_s=round(lease.expires - now, 3))

    # -- ops -------------------------------------------------------------------------

    async def lease(self, m: p.LeaseRequest, peer: Peer) -> p.LeaseReply:
        """A hit, a lease to compile and publish, or (after ``wait_ms``) ``wait``."""
        self.check_enabled()
        family, _, route = self.resolve(m.request, m.identity)
        key, served = self.keys(route, peer)
        group = self.access.group(peer)
        deadline = time.monotonic() + m.wait_ms / 1000
        may_publish = self.access.may_publish(peer)
        waited = False
        while True:
            entry = None
            for candidate in served:
                entry = await self.scheduler.lookup(candidate)
                if entry is not None and trust.may_serve(entry.row, group):
                    break
                entry = None
            if entry is not None:
                self.stats.count("writeback.hits_after_wait" if waited else "writeback.hits")
                self.stats.count("hits", family.name)
                self.stats.count("compiles_avoided", family.name)
                self.stats.count("bytes_served", family.name, entry.row.size)
                return p.LeaseReply(state="hit",
                                    artifact=self.served.artifact(entry, "hit"))
            if not may_publish:
                return p.LeaseReply(state="compile_locally",
                                    reason=f"uid {peer.uid} may not publish to this daemon")
            now = time.monotonic()
            current = self.held.get(key)
            why = current.expired(now) if current is not None else "free"
            if why:
                if current is not None:
                    self.stats.count("writeback.leases_expired")
                    event(log, logging.WARNING, "writeback.lease_expired", key=key[:16],
                          pid=current.pid, reason=why)
                self.stats.count("misses", family.name)
                return self._grant(key, peer, m.ttl_s, why if current else "")
            if now >= deadline:
                return p.LeaseReply(state="wait", holder_pid=current.pid,
                                    held_s=round(now - current.granted, 3))
            if not waited:
                self.stats.count("writeback.waits")
            waited = True
            ev = self._changed.setdefault(key, asyncio.Event())
            try:
                await asyncio.wait_for(ev.wait(), min(POLL_S, max(0.0, deadline - now)))
            except TimeoutError:
                pass

    async def lease_renew(self, m: p.LeaseRenewRequest, peer: Peer) -> p.LeaseRenewReply:
        self.check_enabled()
        key = self.keys(self.resolve(m.request, m.identity)[2], peer)[0]
        lease = self.holder(key, m.lease, peer)
        now, end = time.monotonic(), lease.limit
        if now >= end - 0.001:
            raise NotAllowed(f"lease_renew: this lease has been held {now - lease.granted:.0f}s,"
                             f" the daemon's lease_max_hold ({self.max_hold_s:.0f}s); it ends "
                             "at its expiry and the next waiter gets it")
        lease.ttl = m.ttl_s if m.ttl_s is not None else lease.ttl
        lease.expires = min(now + lease.ttl, end)
        return p.LeaseRenewReply(state="renewed", ttl_s=round(lease.expires - now, 3))

    async def lease_release(self, m: p.LeaseReleaseRequest, peer: Peer) -> p.StateReply:
        key = self.keys(self.resolve(m.request, m.identity)[2], peer)[0]
        lease = self.held.get(key)
        if (lease is not None and hmac.compare_digest(lease.token.encode(), m.lease.encode())
                and (lease.pid, lease.uid) == (peer.pid, peer.uid)):
            self.settle(key)
            event(log, logging.INFO, "writeback.lease_released", key=key[:16], pid=peer.pid,
                  reason=m.reason[:200])
        return p.StateReply(state="released")

    def ops(self) -> dict[str, Handler]:
        return {"lease": self.lease, "lease_renew": self.lease_renew,
                "lease_release": self.lease_release}
