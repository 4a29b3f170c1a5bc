"""``cached tune``: time each M bucket's candidates of one reduction-order class on this
node's GPU and share the winners through the daemon (``autotune_put``).

The parts, in order (everything but the timing runs on a CPU; tests drive it with a real
daemon):

* :func:`shapes_to_tune`: the (N, K) of a manifest, of ``--shape`` arguments, or of what
  clients have planned on this node (the daemon's ``planned`` op).
* :func:`candidates`: per M bucket, the first ``top`` tactics of the daemon's
  batch-invariant plan (one class: the family's ``choose_split``), then the recorded winners
  of that class at that M on the ``near`` recorded shapes nearest in (log N, log K); every
  candidate of the plan's class, checked.
* :func:`pick`: the margin rule of bench/gpu/hopper_fp8_fit.py: the plan's first choice
  stays unless another candidate is faster by more than ``margin`` in every round.
* :func:`tune`: per shape, the buckets not yet published for (device, toolchain, class)
  (a restarted tune redoes nothing it finished), timed by a :class:`Timer`, each winner
  published as soon as its bucket is done; a budget in seconds per shape; progress through
  a callback (the terminal) and the daemon's log (``autotune.stored``, its journal).

The timing core (:class:`cached.tune_cuda.CudaTimer`: CUDA graphs, inputs rotated past
L2, interleaved rounds) needs torch and a GPU; it is imported only by the command. Never
run inside an inference process: timing takes the GPU for seconds per shape.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from cached_client import protocol as p
from cached_client.keys import KernelRequest

from .families.hopper_fp8 import tactic as T
from .families.hopper_fp8 import winners as WIN

FAMILY = T.FAMILY
ARCH = T.TARGET_ARCH
OP = "linear"
DTYPE = "fp8"
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
DEFAULT_TOP = 3
DEFAULT_NEAR = 2
DEFAULT_ROUNDS = 5
DEFAULT_MARGIN = 0.02  # a challenger must beat the plan's first choice by 2 % in every round
DEFAULT_BUDGET_S = 120.0
REFERENCE = "torch._scaled_mm"  # timed beside the candidates for the report, never a winner


class Timer(Protocol):
    """Times kernels of one (N, K) at one M on a device."""

    def time(self, n: int, k: int, m: int, kernels: Sequence[KernelRequest],
             rounds: int) -> dict[int, list[float]]:
        """{index into kernels: us per round}, interleaved rounds; a kernel that could not
        be loaded or gave wrong results is left out. May add REFERENCE-keyed entries under
        the key -1 (the competitor, timed in the same rounds)."""
        ...


@dataclass(frozen=True)
class Target:
    """What winners are keyed by, besides (N, K) and the bucket."""

    device: str  # e.g. "NVIDIA H200"
    sm_count: int
    toolchain: str  # the fingerprint of the stack the kernels were compiled by
    arch: str = ARCH
    ab_dtype: str = "e4m3"
    out_dtype: str = "bfloat16"


@dataclass
class BucketResult:
    m: int
    kernel: dict  # the winner's params
    time_us: float
    first_us: float  # the plan's first choice, same rounds
    reference_us: float | None
    timed: int  # candidates timed
    changed: bool  # the winner is not the plan's first choice


@dataclass
class ShapeResult:
    n: int
    k: int
    reduction_class: str
    buckets: list[BucketResult] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)  # buckets published before
    unfinished: list[int] = field(default_factory=list)  # out of budget or interrupted
    seconds: float = 0.0


def parse_shape(text: str) -> tuple[int, int]:
    """``"N,K"`` -> (N, K); ValueError with the text for anything else."""
    try:
        n, k = (int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"a shape is N,K (two integers), got {text!r}") from None
    if n < 1 or k < 1 or n % 16 or k % 16:
        raise ValueError(f"N and K must be positive multiples of 16, got {text!r}")
    return n, k


def shapes_to_tune(client: Any, shapes: Iterable[tuple[int, int]] = (),
                   manifest: str | None = None, planned: bool = False) -> list[tuple[int, int]]:
    """The (N, K) to tune, in order, each once: ``shapes``, then a manifest's (its
    tensor-parallel division applied), then what clients planned with ``FAMILY`` on this
    daemon (``planned``)."""
    out = list(shapes)
    if manifest:
        from .manifests import load

        out += [(n, k) for n, k in _manifest_nk(load(manifest))]
    if planned:
        out += [(r["n"], r["k"]) for r in client.planned(FAMILY, timeout=30)]
    return list(dict.fromkeys(out))


def _manifest_nk(manifest: Any) -> list[tuple[int, int]]:
    return list(dict.fromkeys((n, k) for _, (_, n, k) in manifest.shapes()))


def _nearest_recorded(n: int, k: int, sm_count: int, near: int) -> list[dict]:
    """The recorded winners ({S: rows}) of the ``near`` recorded (N, K) of this device
    nearest to (N, K) in (log N, log K), nearest first; (N, K) itself when recorded."""
    rec = WIN.recorded_winners()
    mine = [(nn, kk) for (sms, nn, kk) in rec if sms == sm_count]
    mine.sort(key=lambda s: (math.log(s[0] / n) ** 2 + math.log(s[1] / k) ** 2, s))
    return [rec[(sm_count, nn, kk)] for nn, kk in mine[:near]]


def candidates(client: Any, n: int, k: int, m: int, target: Target, top: int = DEFAULT_TOP,
               near: int = DEFAULT_NEAR) -> tuple[str, list[KernelRequest]]:
    """(class id, candidates) for bucket ``m``: the first ``top`` of the daemon's
    batch-invariant plan, then the nearest recorded shapes' winners of that class at that
    M bucket (see module doc); the plan's first choice is candidates[0]. Every candidate is
    of the one class (checked: ValueError otherwise)."""
    reply = client.plan_reply(FAMILY, (m, n, k), target.arch, target.sm_count,
                              {"batch_invariant": True, "ab_dtype": target.ab_dtype,
                               "out_dtype": target.out_dtype}, timeout=120)
    classes = set(reply.classes)
    if len(classes) != 1:
        raise ValueError(f"the batch-invariant plan of {n}x{k} at M={m} has classes {classes}")
    cls = classes.pop()
    splits = T.splits_of_class(cls)
    out = list(reply.requests[:top])
    # the plan lists its class's whole space: a neighbour's winner outside it (a pdl twin
    # the space does not list) is no candidate, since no client plan could run it
    in_plan = {_params_key(r.params): r for r in reply.requests}
    for per in _nearest_recorded(n, k, target.sm_count, near):
        row = per.get(splits)
        if not row:
            continue
        _, key, _ = next((r for r in row if r[0] >= m), row[-1])
        t = WIN.tactic_from_key(key, splits, target.out_dtype, target.ab_dtype)
        hit = in_plan.get(_params_key(t.to_params()))
        if hit is not None:
            out.append(hit)
    out = list(dict.fromkeys(out))
    for r in out:
        if T.tactic_from_params(r.params).reduction_class != cls:
            raise ValueError(f"candidate {r.params} is not of the class {cls}")
    return cls, out


def _params_key(params: Any) -> str:
    return json.dumps(params, sort_keys=True)


def pick(rounds_us: dict[int, list[float]], margin: float) -> int | None:
    """The winner's index: 0 (the plan's first choice) unless the candidate with the best
    median beats it by more than ``margin`` in every round; None when 0 was not timed and
    nothing was (the bucket has no winner). When 0 was not timed, the best median wins."""
    timed = {i: r for i, r in rounds_us.items() if i >= 0 and r}
    if not timed:
        return None
    best = min(timed, key=lambda i: (_median(timed[i]), i))
    if 0 not in timed or best == 0:
        return best
    q = [a / b for a, b in zip(timed[0], timed[best], strict=True)]
    return best if min(q) > 1 + margin else 0


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def published(client: Any, n: int, k: int, target: Target, cls: str) -> dict[int, dict]:
    """{bucket: row} of the winners already recorded for (N, K) on this target and class."""
    rows = client.autotune_get(p.AutotuneGetRequest(
        op_name=OP, n=n, k=k, dtype=DTYPE, arch=target.arch, device=target.device,
        toolchain=target.toolchain, reduction_class=cls), timeout=30)
    return {int(r["bucket"]): r for r in rows if r.get("kernel") == FAMILY}


Progress = Callable[[str], None]


def tune(client: Any, shapes: Sequence[tuple[int, int]], timer: Timer, target: Target, *,
         buckets: Sequence[int] = DEFAULT_BUCKETS, top: int = DEFAULT_TOP,
         near: int = DEFAULT_NEAR, rounds: int = DEFAULT_ROUNDS,
         margin: float = DEFAULT_MARGIN, budget_s: float = DEFAULT_BUDGET_S,
         force: bool = False, progress: Progress = lambda line: None,
         results: list[ShapeResult] | None = None) -> list[ShapeResult]:
    """Tune ``shapes`` (see module doc); the results per shape. A bucket whose winner is
    published for (device, toolchain, class) is skipped unless ``force``. Each winner is
    published when its bucket is done, so a KeyboardInterrupt loses at most the bucket
    being timed (the exception propagates; ``results``, when given, holds what was done);
    a shape gets at least one bucket, then none once ``budget_s`` is spent."""
    results = [] if results is None else results
    for n, k in shapes:
        started = time.monotonic()
        cls, _ = candidates(client, n, k, buckets[0], target, top=1, near=0)
        res = ShapeResult(n, k, cls)
        results.append(res)
        done = {} if force else published(client, n, k, target, cls)
        todo = [m for m in buckets if m not in done]
        res.skipped = [m for m in buckets if m in done]
        progress(f"{n}x{k} class {cls}: {len(todo)} of {len(buckets)} buckets to time"
                 + (f" ({len(res.skipped)} published before)" if res.skipped else ""))
        try:
            for i, m in enumerate(todo):
                if i and time.monotonic() - started > budget_s:  # one bucket at least
                    res.unfinished += todo[i:]
                    progress(f"{n}x{k}: budget of {budget_s:g} s spent; "
                             f"{len(res.unfinished)} buckets left for the next run")
                    break
                got = _tune_bucket(client, timer, n, k, m, target, cls, top, near, rounds,
                                   margin, progress)
                if got is None:
                    res.unfinished.append(m)
                else:
                    res.buckets.append(got)
        except KeyboardInterrupt:
            res.unfinished = [m for m in todo if m not in {b.m for b in res.buckets}]
            res.seconds = time.monotonic() - started
            progress(f"{n}x{k}: interrupted; {len(res.unfinished)} buckets left")
            raise
        res.seconds = time.monotonic() - started
        progress(f"{n}x{k}: {len(res.buckets)} buckets tuned in {res.seconds:.1f} s, "
                 f"{sum(b.changed for b in res.buckets)} changed from the plan's first choice")
    return results


def _tune_bucket(client: Any, timer: Timer, n: int, k: int, m: int, target: Target,
                 cls: str, top: int, near: int, rounds: int, margin: float,
                 progress: Progress) -> BucketResult | None:
    got_cls, cands = candidates(client, n, k, m, target, top, near)
    if got_cls != cls:  # the family's class depends on (N, K) and the device only
        raise ValueError(f"{n}x{k}: the plan's class changed with M ({cls} -> {got_cls})")
    times = timer.time(n, k, m, cands, rounds)
    win = pick(times, margin)
    ref = times.get(-1)
    if win is None:
        progress(f"  M<={m}: none of the {len(cands)} candidates could be timed (not in this "
                 "node's store, or wrong results); nothing published")
        return None
    us = _median(times[win])
    client.autotune_put(p.AutotunePutRequest(
        op_name=OP, n=n, k=k, dtype=DTYPE, arch=target.arch, device=target.device, bucket=m,
        kernel=FAMILY, tactic=dict(cands[win].params), time_us=max(us, 1e-6), replace=True,
        toolchain=target.toolchain, reduction_class=cls), timeout=30)
    first = _median(times[0]) if times.get(0) else float("nan")
    name = T.tactic_from_params(cands[win].params).name
    progress(f"  M<={m}: {name} {us:.1f} us (plan's first {first:.1f} us"
             + (f", {REFERENCE} {_median(ref):.1f} us" if ref else "")
             + f"; {len([i for i in times if i >= 0])} of {len(cands)} timed)")
    return BucketResult(m, dict(cands[win].params), us, first,
                        _median(ref) if ref else None, len([i for i in times if i >= 0]),
                        win != 0)
