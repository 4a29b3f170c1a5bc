"""``cached tune``: time each M bucket's candidates of one reduction-order class on this
node's GPU and share the winners through the daemon (``autotune_put``), for each scheme
the family declares (``Family.tune_schemes``: for cached.hopper_fp8 per-tensor and
per-token scales with fast and exact accumulation, and block128), each filed under its
own class (the class id names the scheme, so winners of two schemes never mix); and for
cached.hopper_bf16 the scheme ``bf16`` (bf16 operands, no scales), its winners filed under
dtype ``bf16`` and its own ``k64`` classes, read by bf16 plans only. A scheme names its
family (:func:`scheme_family`: scheme names are unique across TUNED_FAMILIES), and the
tune of a scheme runs for that family's operands and winners (:func:`target_for`).

The parts, in order (everything but the timing runs on a CPU; tests drive it with a real
daemon):

* :func:`shapes_to_tune`: the (N, K) of a manifest, of ``--shape`` arguments, or of what
  clients have planned on this node (the daemon's ``planned`` op).
* :func:`candidates`: per M bucket and scheme, the first ``top`` tactics of the daemon's
  batch-invariant plan of that scheme (one class), then the family's neighbours
  (``Family.tune_neighbours``: for cached.hopper_fp8 the recorded winners of that class at
  that M on the ``near`` recorded shapes nearest in (log N, log K)) the plan lists; every
  candidate of the plan's class, checked.
* :func:`pick`: the margin rule of bench/gpu/hopper_fp8_fit.py: the plan's first choice
  stays unless another candidate is faster by more than ``margin`` in every round. Where
  the best candidate is short of the scheme's competitor (its time over the best's under
  WIDEN_UNDER), the bucket is timed again with ``widen`` more of the plan's candidates,
  each of a tactic kind the first ones lack (:func:`kind_of`;
  :func:`short_of_competitor`), and the winner picked from that wider timing.
* :func:`tune`: per scheme and shape, the buckets not yet published for (device,
  toolchain, class) (a restarted tune redoes nothing it finished), timed by a
  :class:`Timer`, each winner published as soon as its bucket is done; a budget in seconds
  per scheme and shape; progress through a callback (the terminal) and the daemon's log
  (``autotune.stored``, its journal). A candidate the timer leaves out is reported with
  why: not in this node's store, or wrong results (the error measured and the class's
  bound at that K, ``Family.tune_error_bound``), or not bitwise equal to its class.

The timing core (:class:`cached.tools.tune_cuda.CudaTimer`: CUDA graphs, inputs rotated past
L2, interleaved rounds) needs torch and a GPU; it is imported only by the command. Never
run inside an inference process: timing takes the GPU for seconds per shape.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from cached_client import protocol as p
from cached_client.errors import CachedError
from cached_client.keys import KernelRequest

from cached import families

if TYPE_CHECKING:
    from cached_client.client import Client

FAMILY = "cached.hopper_fp8"
BF16_FAMILY = "cached.hopper_bf16"
TUNED_FAMILIES = (FAMILY, BF16_FAMILY)  # the families cached tune tunes, in this order
ARCH = "sm_90a"
DEFAULT_SCHEME = "tensor-fast"
OP = "linear"
DTYPE = "fp8"
#: the autotune rows' dtype per family (what cached_client.gemm.plan asks for)
AUTOTUNE_DTYPE = {FAMILY: DTYPE, BF16_FAMILY: "bf16"}
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
DEFAULT_TOP = 3
DEFAULT_NEAR = 2
DEFAULT_ROUNDS = 5
DEFAULT_MARGIN = 0.02  # a challenger must beat the plan's first choice by 2 % in every round
DEFAULT_BUDGET_S = 120.0
DEFAULT_WIDEN = 6  # more of the plan's candidates where the best is short of the competitor
# the params two candidates of a widened timing may share a kind across (kind_of)
WIDEN_SAME = ("raster", "swizzle", "stages", "pdl")
# a widened timing also lists the plan's first tactic of each value of these params it
# lacks (e.g. a split class's 'cta' mode at an M where the model ranks it last)
WIDEN_EACH = ("split_mode",)
WIDEN_UNDER = 0.97  # short: the competitor's time over the best candidate's below this
REFERENCE = "torch._scaled_mm"  # timed beside the candidates for the report, never a winner


NOT_IN_STORE = "not in this node's store"
WRONG_RESULTS = "wrong results"
NOT_BITWISE = "not bitwise equal to its class"
NOT_LOADED = "could not be loaded"
LEFT_OUT_KINDS = (NOT_IN_STORE, WRONG_RESULTS, NOT_BITWISE, NOT_LOADED)


@dataclass
class Timing:
    """What a Timer measured: ``rounds`` {index into kernels: us per round} (the key -1:
    the scheme's competitor, timed in the same rounds, reported only) and ``left_out``
    {index: (kind, detail)} for each kernel not timed, kind one of LEFT_OUT_KINDS and
    detail what was found (the error measured and the bound, the daemon's message)."""

    rounds: dict[int, list[float]] = field(default_factory=dict)
    left_out: dict[int, tuple[str, str]] = field(default_factory=dict)
    competitor: str = ""  # what the key -1 is, e.g. "torch._scaled_mm fast"


class Timer(Protocol):
    """Times kernels of one (N, K) at one M on a device."""

    def time(self, n: int, k: int, m: int, kernels: Sequence[KernelRequest],
             rounds: int, reduction_class: str) -> Timing:
        """Interleaved rounds of every kernel that loads and computes right (the class's
        bound at K, ``Family.tune_error_bound``; then bitwise equal to the first correct
        one), the others left out with why."""
        ...


def left_out_summary(timing: Timing) -> str:
    """One clause per kind, e.g. "2 not in this node's store; 1 wrong results (rel err
    3.1e-01 over the bound 1.0e-02 ...)": the first detail of each kind."""
    by: dict[str, list[str]] = {}
    for kind, detail in timing.left_out.values():
        by.setdefault(kind, []).append(detail)
    return "; ".join(f"{len(v)} {kind}" + (f" ({v[0]})" if v[0] else "")
                     for kind, v in by.items())


def judge(err: float, reduction_class: str, k: int, floor: float, family: str = FAMILY
          ) -> tuple[str, str] | None:
    """None when a relative error ``err`` (against a float32 reference; NaN for an output
    holding NaN) is within the class's bound at K = ``k`` with output rounding ``floor``
    (Family.tune_error_bound), else (WRONG_RESULTS, the error and the bound)."""
    bound = families.get(family).tune_error_bound(reduction_class, k, floor)
    if err <= bound:
        return None
    return WRONG_RESULTS, (f"rel err {err:.2e} over the bound {bound:.2e} of "
                           f"{reduction_class} at K={k}, floor {floor:.2e}")


def load_failure(exc: CachedError) -> tuple[str, str]:
    """(kind, detail) of a candidate the daemon would not hand over: NOT_IN_STORE when a
    serve-only daemon lacks it (its CompileFailed says so), else NOT_LOADED with the
    daemon's code and message."""
    if exc.code == "compile_failed" and "not in the store" in str(exc):
        return NOT_IN_STORE, "a serve-only daemon compiles nothing: warm it on a build node"
    return NOT_LOADED, f"{exc.code}: {exc}"


@dataclass(frozen=True)
class Target:
    """What winners are keyed by, besides (N, K) and the bucket."""

    device: str  # e.g. "NVIDIA H200"
    sm_count: int
    toolchain: str  # the fingerprint of the stack the kernels were compiled by
    arch: str = ARCH
    ab_dtype: str = "e4m3"
    out_dtype: str = "bfloat16"
    family: str = FAMILY


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
    reduction_class: str  # "" when the scheme plans nothing for (N, K) (see not_planned)
    scheme: str = DEFAULT_SCHEME
    not_planned: str = ""  # why the scheme has no plan for (N, K) (e.g. block128, K % 128)
    buckets: list[BucketResult] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)  # buckets published before
    unfinished: list[int] = field(default_factory=list)  # out of budget or interrupted
    seconds: float = 0.0
    # every timing (candidates too, not only winners): (M, params, us median), for refits
    timed: list[tuple[int, dict, float]] = field(default_factory=list)


def parse_shape(text: str) -> tuple[int, int]:
    """``"N,K"`` -> (N, K); ValueError with the text for anything else."""
    try:
        n, k = (int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"a shape is N,K (two integers), got {text!r}") from None
    if n < 1 or k < 1 or n % 16 or k % 16:
        raise ValueError(f"N and K must be positive multiples of 16, got {text!r}")
    return n, k


def shapes_to_tune(client: Client, shapes: Iterable[tuple[int, int]] = (),
                   manifest: str | None = None, planned: bool = False) -> list[tuple[int, int]]:
    """The (N, K) to tune, in order, each once: ``shapes``, then a manifest's (its
    tensor-parallel division applied), then what clients planned with ``FAMILY`` on this
    daemon (``planned``)."""
    out = list(shapes)
    if manifest:
        from cached.tools.manifests import load

        out += [(n, k) for n, k in _manifest_nk(load(manifest))]
    if planned:
        out += planned_shapes(client, FAMILY)
    return list(dict.fromkeys(out))


def planned_shapes(client: Client, family: str) -> list[tuple[int, int]]:
    """The (N, K) clients planned with ``family`` on this daemon (its ``planned`` op), each
    once: a bf16 scheme tunes what bf16 plans asked for, an FP8 scheme what FP8 plans did."""
    return list(dict.fromkeys((r["n"], r["k"]) for r in client.planned(family, timeout=30)))


def by_family(schemes: Sequence[str]) -> dict[str, list[str]]:
    """{family: its schemes among ``schemes``}, in the order they first appear
    (scheme_family; ValueError for an unknown scheme)."""
    out: dict[str, list[str]] = {}
    for scheme in check_schemes(schemes):
        out.setdefault(scheme_family(scheme), []).append(scheme)
    return out


def _manifest_nk(manifest: Any) -> list[tuple[int, int]]:
    return list(dict.fromkeys((n, k) for _, (_, n, k) in manifest.shapes()))


def scheme_options(family: str = FAMILY) -> dict[str, dict[str, Any]]:
    """{scheme name: plan options} the family declares for tuning (Family.tune_schemes)."""
    return families.get(family).tune_schemes()


def all_schemes() -> dict[str, str]:
    """{scheme name: family} of every scheme of TUNED_FAMILIES, in their order; a name two
    families declare is a bug (RuntimeError)."""
    out: dict[str, str] = {}
    for fam in TUNED_FAMILIES:
        for name in scheme_options(fam):
            if name in out:
                raise RuntimeError(f"the tune scheme {name!r} is declared by {out[name]} "
                                   f"and {fam}")
            out[name] = fam
    return out


def scheme_family(scheme: str) -> str:
    """The family that declares ``scheme``; ValueError naming the known schemes."""
    known = all_schemes()
    if scheme not in known:
        raise ValueError(f"cached tune tunes the schemes {', '.join(known)} (or 'all'); "
                         f"got {scheme!r}")
    return known[scheme]


def target_for(target: Target, scheme: str) -> Target:
    """``target`` for the family of ``scheme``: itself when it is that family's, else the
    same device and toolchain with that family and its first operand type (bf16 for
    cached.hopper_bf16, e4m3 for cached.hopper_fp8)."""
    fam = scheme_family(scheme)
    if target.family == fam:
        return target
    return dataclasses.replace(target, family=fam, ab_dtype=families.get(fam).ab_dtypes[0])


def check_schemes(names: Sequence[str], family: str | None = None) -> list[str]:
    """``names`` in order, each once ("all": every scheme of ``family``, or of every
    family of TUNED_FAMILIES for None); ValueError naming the known schemes for any
    other."""
    known = scheme_options(family) if family else all_schemes()
    out: list[str] = []
    for name in names:
        for one in (list(known) if name == "all" else [name]):
            if one not in known:
                raise ValueError(f"{family or 'cached tune'} tunes the schemes "
                                 f"{', '.join(known)} (or 'all'); got {one!r}")
            if one not in out:
                out.append(one)
    return out


def candidates(client: Client, n: int, k: int, m: int, target: Target, top: int = DEFAULT_TOP,
               near: int = DEFAULT_NEAR, scheme: str = DEFAULT_SCHEME, widen: int = 0
               ) -> tuple[str, list[KernelRequest]]:
    """(class id, candidates) for bucket ``m`` of ``scheme``: the first ``top`` of the
    daemon's batch-invariant plan of the scheme, then ``widen`` more in the plan's order,
    each the first of a kind not yet listed (:func:`kind_of`: the params less WIDEN_SAME),
    and (widened) the plan's first tactic of each WIDEN_EACH value not yet listed, then
    the family's neighbours that plan lists (see module doc); the plan's first choice
    is candidates[0]. Every candidate is of the one class the daemon's reply names
    (checked: ValueError otherwise). The daemon's InvalidTactic when the scheme plans
    nothing for (N, K) (e.g. block128 at K % 128). ``target`` is taken for the scheme's
    family (target_for)."""
    target = target_for(target, scheme)
    fam = families.get(target.family)
    opts = scheme_options(target.family).get(scheme)
    if opts is None:
        raise ValueError(f"{target.family} has no tune scheme {scheme!r}")
    options = {"batch_invariant": True, "ab_dtype": target.ab_dtype,
               "out_dtype": target.out_dtype} | opts
    reply = client.plan_reply(target.family, (m, n, k), target.arch, target.sm_count,
                              options, timeout=120)
    classes = set(reply.classes)
    if len(classes) != 1:
        raise ValueError(f"the batch-invariant {scheme} plan of {n}x{k} at M={m} has "
                         f"classes {classes}")
    cls = classes.pop()
    out = list(reply.requests[:top])
    kinds, wide = {kind_of(r.params) for r in out}, widen > 0
    for r in reply.requests[top:]:
        if widen <= 0:
            break
        if kind_of(r.params) not in kinds:
            kinds.add(kind_of(r.params))
            out.append(r)
            widen -= 1
    if wide:  # a widened timing: the first of each WIDEN_EACH value too
        for key in WIDEN_EACH:
            seen = {dict(r.params).get(key) for r in out}
            for r in reply.requests:
                if dict(r.params).get(key) not in seen:
                    seen.add(dict(r.params).get(key))
                    out.append(r)
    # the plan lists its class's whole space: a neighbour outside it (a pdl twin the space
    # does not list) is no candidate, since no client plan could run it
    in_plan = {_params_key(r.params): r for r in reply.requests}
    for params in fam.tune_neighbours(n, k, m, target.sm_count, cls, options, near):
        hit = in_plan.get(_params_key(params))
        if hit is not None:
            out.append(hit)
    out = list(dict.fromkeys(out))
    for r in out:
        if fam.reduction_class(r.params) != cls:
            raise ValueError(f"candidate {r.params} is not of the class {cls}")
    return cls, out


def kind_of(params: Any) -> str:
    """The tactic kind a widened timing lists once: the params less WIDEN_SAME (canonical
    JSON), so the extra candidates are other tiles, clusters or split modes, not the
    raster, swizzle, stage or pdl twins of one already listed."""
    return _params_key({k: v for k, v in dict(params).items() if k not in WIDEN_SAME})


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


def short_of_competitor(rounds_us: dict[int, list[float]]) -> float | None:
    """The competitor's median over the best candidate's (< 1: the competitor is faster)
    when that is under WIDEN_UNDER, else None (also with no competitor or no candidate
    timed)."""
    ref = rounds_us.get(-1)
    timed = [_median(r) for i, r in rounds_us.items() if i >= 0 and r]
    if not ref or not timed:
        return None
    ratio = _median(ref) / min(timed)
    return ratio if ratio < WIDEN_UNDER else None


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def published(client: Client, n: int, k: int, target: Target, cls: str) -> dict[int, dict]:
    """{bucket: row} of the winners already recorded for (N, K) on this target and class."""
    rows = client.autotune_get(p.AutotuneGetRequest(
        op_name=OP, n=n, k=k, dtype=AUTOTUNE_DTYPE[target.family], arch=target.arch,
        device=target.device, toolchain=target.toolchain, reduction_class=cls), timeout=30)
    return {int(r["bucket"]): r for r in rows if r.get("kernel") == target.family}


Progress = Callable[[str], None]


def tune(client: Client, shapes: Sequence[tuple[int, int]], timer: Timer, target: Target, *,
         buckets: Sequence[int] = DEFAULT_BUCKETS, top: int = DEFAULT_TOP,
         near: int = DEFAULT_NEAR, rounds: int = DEFAULT_ROUNDS,
         margin: float = DEFAULT_MARGIN, budget_s: float = DEFAULT_BUDGET_S,
         force: bool = False, progress: Progress = lambda line: None,
         results: list[ShapeResult] | None = None,
         schemes: Sequence[str] = (DEFAULT_SCHEME,),
         widen: int = DEFAULT_WIDEN) -> list[ShapeResult]:
    """Tune ``shapes`` in each of ``schemes`` (see module doc); the results per scheme and
    shape, schemes outermost. A bucket whose winner is published for (device, toolchain,
    class) is skipped unless ``force``. Each winner is published when its bucket is done,
    so a KeyboardInterrupt loses at most the bucket being timed (the exception propagates;
    ``results``, when given, holds what was done); a (scheme, shape) gets at least one
    bucket, then none once ``budget_s`` is spent. A scheme that plans nothing for a shape
    (InvalidTactic: e.g. block128 at K % 128) is reported in ``not_planned``, not an
    error. Each scheme is tuned for its own family (target_for: a bf16 scheme with bf16
    operands, its winners under dtype bf16). ``widen``: how many more of the plan's
    candidates a bucket short of its competitor is timed with (0: never)."""
    results = [] if results is None else results
    names = check_schemes(schemes)
    for scheme in names:
        scheme_target = target_for(target, scheme)
        for n, k in shapes:
            _tune_shape(client, n, k, scheme, timer, scheme_target, buckets, top, near, rounds,
                        margin, budget_s, force, progress, results, widen)
    return results


def _tune_shape(client: Client, n: int, k: int, scheme: str, timer: Timer, target: Target,
                buckets: Sequence[int], top: int, near: int, rounds: int, margin: float,
                budget_s: float, force: bool, progress: Progress,
                results: list[ShapeResult], widen: int = 0) -> None:
    started = time.monotonic()
    try:
        cls, _ = candidates(client, n, k, buckets[0], target, top=1, near=0, scheme=scheme)
    except CachedError as exc:
        if exc.code != "invalid_tactic":
            raise
        results.append(ShapeResult(n, k, "", scheme, not_planned=str(exc)))
        progress(f"{n}x{k} {scheme}: not planned ({exc}); skipped")
        return
    res = ShapeResult(n, k, cls, scheme)
    results.append(res)
    done = {} if force else published(client, n, k, target, cls)
    todo = [m for m in buckets if m not in done]
    res.skipped = [m for m in buckets if m in done]
    progress(f"{n}x{k} {scheme} class {cls}: {len(todo)} of {len(buckets)} buckets to time"
             + (f" ({len(res.skipped)} published before)" if res.skipped else ""))
    try:
        for i, m in enumerate(todo):
            if i and time.monotonic() - started > budget_s:  # one bucket at least
                res.unfinished += todo[i:]
                progress(f"{n}x{k} {scheme}: budget of {budget_s:g} s spent; "
                         f"{len(res.unfinished)} buckets left for the next run")
                break
            got = _tune_bucket(client, timer, n, k, m, target, cls, scheme, top, near, rounds,
                               margin, progress, res, widen)
            if got is None:
                res.unfinished.append(m)
            else:
                res.buckets.append(got)
    except KeyboardInterrupt:
        res.unfinished = [m for m in todo if m not in {b.m for b in res.buckets}]
        res.seconds = time.monotonic() - started
        progress(f"{n}x{k} {scheme}: interrupted; {len(res.unfinished)} buckets left")
        raise
    res.seconds = time.monotonic() - started
    progress(f"{n}x{k} {scheme}: {len(res.buckets)} buckets tuned in {res.seconds:.1f} s, "
             f"{sum(b.changed for b in res.buckets)} changed from the plan's first choice")


def _tune_bucket(client: Client, timer: Timer, n: int, k: int, m: int, target: Target,
                 cls: str, scheme: str, top: int, near: int, rounds: int, margin: float,
                 progress: Progress, res: ShapeResult, widen: int = 0) -> BucketResult | None:
    got_cls, cands = candidates(client, n, k, m, target, top, near, scheme)
    if got_cls != cls:  # the family's class depends on (N, K) and the device only
        raise ValueError(f"{n}x{k}: the plan's class changed with M ({cls} -> {got_cls})")
    timing = timer.time(n, k, m, cands, rounds, cls)
    short = short_of_competitor(timing.rounds) if widen > 0 else None
    if short is not None:
        got_cls, wide = candidates(client, n, k, m, target, top, near, scheme, widen)
        if got_cls == cls and len(wide) > len(cands):
            progress(f"  M<={m}: the best of {len(cands)} is {short:.2f}x "
                     f"{timing.competitor or REFERENCE}; timing {len(wide)} candidates")
            cands, timing = wide, timer.time(n, k, m, wide, rounds, cls)
    times = timing.rounds
    for i, r in times.items():
        if i >= 0 and r:
            res.timed.append((m, dict(cands[i].params), _median(r)))
    win = pick(times, margin)
    ref = times.get(-1)
    why = left_out_summary(timing)
    if win is None:
        progress(f"  M<={m}: none of the {len(cands)} candidates could be timed: "
                 f"{why or 'the timer timed nothing'}; nothing published")
        return None
    us = _median(times[win])
    client.autotune_put(p.AutotunePutRequest(
        op_name=OP, n=n, k=k, dtype=AUTOTUNE_DTYPE[target.family], arch=target.arch,
        device=target.device, bucket=m,
        kernel=target.family, tactic=dict(cands[win].params), time_us=max(us, 1e-6),
        replace=True, toolchain=target.toolchain, reduction_class=cls), timeout=30)
    first = _median(times[0]) if times.get(0) else float("nan")
    ntimed = len([i for i in times if i >= 0])
    progress(f"  M<={m}: {_name(cands[win])} {us:.1f} us (plan's first {first:.1f} us"
             + (f", {timing.competitor or REFERENCE} {_median(ref):.1f} us" if ref else "")
             + f"; {ntimed} of {len(cands)} timed" + (f"; left out: {why}" if why else "")
             + ")")
    return BucketResult(m, dict(cands[win].params), us, first,
                        _median(ref) if ref else None, ntimed, win != 0)


def _name(request: KernelRequest) -> str:
    if request.family in TUNED_FAMILIES:
        from cached.families.hopper_fp8.tactic import tactic_from_params

        return tactic_from_params(request.params).name
    return _params_key(request.params)
