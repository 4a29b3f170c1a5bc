"""``plan_shape``: one weight shape's tactic per M bucket in one request.

What a client would gather with a ``plan`` per bucket, an ``autotune_get`` and a
``hello`` (cached_client.gemm.policy.choose_tactics' per-bucket path), gathered here:
each bucket's first tactic and its class (:meth:`cached.scheduler.Scheduler.plan`: a light
family's in this process, memoized), the node's shared winners this peer may be served
(``autotune_get``'s rows for it) kept as the client keeps them
(cached_client.gemm.policy.autotune_results, with this daemon's default toolchain: the one
``hello`` names), and the whole plan at a bucket where a winner of the family is to be
found. The choice is then the client's own function, pick_tactics: one definition.

Invariants: the reply has one bucket per bucket asked, in order; under batch invariance
every bucket's tactic is of one reduction-order class, and a shared winner is taken only
when it is a tactic of that class's plan (else the plan's first, with a warning); a plan
that would mix classes is ``invalid_argument`` naming them; with ``prefetch`` the chosen
kernels are queued as the peer's own ``prefetch`` of them would be (its quota applies).
The plan request counts against the peer's queue limit while it is answered, as ``plan``.
"""

from __future__ import annotations

from cached_client import protocol as p
from cached_client.errors import InvalidArgument
from cached_client.gemm import policy

from .. import families
from ..scheduler import Scheduler
from ..server import Handler, Peer
from ..service import Service
from .autotune import Autotune


class ShapePlans:
    """The ``plan_shape`` op over the scheduler's plans, the autotune table and the
    service's prefetch."""

    def __init__(self, scheduler: Scheduler, service: Service, autotune: Autotune) -> None:
        self.scheduler = scheduler
        self.service = service
        self.autotune = autotune

    async def _plan(self, m: p.PlanShapeRequest, upper: int, limit: int | None
                    ) -> list[policy.Planned]:
        family = families.get(m.family)
        request = p.PlanRequest(family=m.family, shape=[upper, m.n, m.k], arch=m.arch,
                                sm_count=m.sm_count, options=m.options, identity=m.identity,
                                limit=limit)
        requests = await self.scheduler.plan(request)
        if not requests:
            raise InvalidArgument(f"{m.family} plans no tactic for (M, N, K)=({upper}, "
                                  f"{m.n}, {m.k}) on {m.arch}")
        return [(r, family.reduction_class(r.params)) for r in requests]

    async def plan_shape(self, m: p.PlanShapeRequest, peer: Peer) -> p.PlanShapeReply:
        """The tactic per bucket of ``m``; see the module doc."""
        with self.service.quota.planning(peer):
            firsts = {u: (await self._plan(m, u, 1))[0] for u in m.buckets}
            found: list[dict] = []
            if m.device is not None:
                rows = (await self.autotune.autotune_get(p.AutotuneGetRequest(
                    op_name=m.op_name, n=m.n, k=m.k, dtype=m.dtype, arch=m.arch,
                    device=m.device), peer)).results
                toolchain = self.scheduler.toolchains.default.fingerprint
                found = policy.keep_winners(rows, m.op_name, toolchain)
            wholes = {u: await self._plan(m, u, None) for u in m.buckets
                      if any(r.get("kernel") == m.family and int(r["bucket"]) == u
                             for r in found)}
            try:
                choice = policy.pick_tactics(m.family, m.n, m.k, m.arch, m.buckets, firsts,
                                             found, wholes.__getitem__, m.batch_invariant)
            except policy.MixedReductionClasses as exc:
                raise InvalidArgument(str(exc)) from None
        self.autotune.note_plan(p.PlanRequest(
            family=m.family, shape=[m.buckets[-1], m.n, m.k], arch=m.arch,
            sm_count=m.sm_count, options=m.options), peer)
        prefetched = None
        if m.prefetch:
            chosen = list(dict.fromkeys(b.request for b in choice.buckets))
            prefetched = await self.service.prefetch(p.PrefetchRequest(
                requests=[r.to_wire() for r in chosen], identity=m.identity), peer)
        return p.PlanShapeReply(
            buckets=[p.PlannedBucket(upper=b.upper, request=b.request,
                                     reduction_class=b.reduction_class, source=b.source)
                     for b in choice.buckets],
            warnings=choice.warnings, prefetch=prefetched)

    def ops(self) -> dict[str, Handler]:
        return {"plan_shape": self.plan_shape}
