"""Batch-invariant FP8 and BF16 GEMM plans: per weight shape, the tactic per M bucket,
loaded once.

A framework-free core for inference processes (the vLLM adapter is one caller):

* :func:`plan_gemm` asks the daemon, for one (op, N, K, dtype, arch, device), which tactic
  serves each M bucket (:func:`cached_client.gemm.policy.choose_tactics`: under batch invariance
  all of one reduction-order class; shared autotune winners of that class where present,
  else the family's plan order), and queues every tactic: one ``plan_shape`` request that
  also prefetches (a daemon without it: a ``plan`` per bucket, then **one** ``prefetch``).
* :meth:`GemmPlan.load` gets and loads each tactic (``Client.load_many``: one ``get_batch``
  after the connection's ``hello``) and allocates the split-K workspace once, for the
  largest M the plan serves. Planning and loading a shape: at most 3 round trips.
* Calling the loaded plan (:class:`HopperFp8Gemm`, :class:`HopperBf16Gemm`) picks the
  bucket of ``a.shape[0]`` on the host and launches: no daemon round trip, no host sync,
  no allocation beyond the output (none with ``out=``), so it can be captured in a CUDA
  graph.

Families: ``cached.hopper_fp8`` on sm_90a, and ``cached.hopper_bf16`` (``ab_dtype="bf16"``,
the same kernel machinery without scales; :class:`HopperBf16Gemm` is called ``f(a, b)``);
FlashInfer's FP8 batch-invariant class
(``flashinfer.bi.bmm_fp8``) on SM100+ where this environment's FlashInfer ships
``flashinfer.batch_invariant`` (:func:`flashinfer_bi_available`, checked without importing
FlashInfer). Importing this module imports nothing heavy.
"""

from __future__ import annotations

import bisect
import importlib.metadata
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..keys import DEFAULT_SM_COUNT, KernelRequest
from . import policy

if TYPE_CHECKING:
    from ..client import Client
    from ..protocol import PrefetchReply

DEFAULT_MAX_M = 8192
HOPPER_FAMILY = "cached.hopper_fp8"
#: bf16 operands on sm_90a (ab_dtype="bf16"): the same kernel machinery, no scales
HOPPER_BF16_FAMILY = "cached.hopper_bf16"
BF16 = "bf16"
FLASHINFER_BI_FAMILY = "flashinfer.bi.bmm_fp8"
FLASHINFER_BI_ARCHES = policy.FLASHINFER_BI_ARCHES
_OUT = {"bfloat16": "bf16", "float16": "f16"}
_BF16_OUT = ("bfloat16", "float16", "float32")
_AB = ("e4m3", "e5m2")
_SCALES = ("tensor", "token", "block128")
_ACCUMULATION = ("fast", "exact")
#: "fast" (the default) or "exact" (the wgmma accumulator promoted every K tile: the bf16
#: floor, slower): what the vLLM kernel plans its layers with
ACCUMULATION_ENV = "CACHED_FP8_ACCUMULATION"


def accumulation_from_env() -> str:
    """The accumulation ``$CACHED_FP8_ACCUMULATION`` asks for ("fast" when unset or empty);
    ValueError naming the variable for any other value."""
    import os

    mode = os.environ.get(ACCUMULATION_ENV, "") or "fast"
    if mode not in _ACCUMULATION:
        raise ValueError(f"{ACCUMULATION_ENV}={mode!r}: must be one of {', '.join(_ACCUMULATION)}")
    return mode


class PlanUnavailable(RuntimeError):
    """No family serves this (arch, dtype) in this environment; the message says why."""


# The hook installer of each family whose kernels an integration serves, by family:
# cached_client.integrations.flashinfer.cute_dsl registers FLASHINFER_BI_FAMILY's (its
# ``install``) when it is imported, so that this module, core, never imports an integration.
_INSTALLERS: dict[str, Callable[..., Any]] = {}


def register_installer(family: str, install: Callable[..., Any]) -> None:
    """Record ``install(client=...)`` as what loading a ``family`` plan calls first."""
    _INSTALLERS[family] = install


def buckets_up_to(max_m: int) -> tuple[int, ...]:
    """M bucket upper bounds: the powers of two below ``max_m``, then ``max_m``."""
    if not isinstance(max_m, int) or isinstance(max_m, bool) or max_m < 1:
        raise ValueError(f"max_m must be a positive int, got {max_m!r}")
    ups, m = [], 1
    while m < max_m:
        ups.append(m)
        m *= 2
    return (*ups, max_m)


def flashinfer_bi_available() -> tuple[bool, str]:
    """Whether this environment's FlashInfer has its batch-invariant classes, and a sentence
    saying which FlashInfer it is; FlashInfer is not imported (its import queries CUDA)."""
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or not spec.origin:
        return False, "FlashInfer is not installed"
    try:
        version = importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    where = Path(spec.origin).parent
    if (where / "batch_invariant" / "__init__.py").is_file():
        return True, f"FlashInfer {version} ({where}) has flashinfer.batch_invariant"
    return False, (f"FlashInfer {version} ({where}) has no flashinfer.batch_invariant "
                   "(0.7.4 and later have it)")


def family_for(arch: str, ab_dtype: str = "e4m3") -> str:
    """The family that serves batch-invariant GEMMs with operands ``ab_dtype`` (FP8 by
    default, or "bf16") on ``arch``; PlanUnavailable says why none does."""
    if ab_dtype == BF16:
        if arch == "sm_90a":
            return HOPPER_BF16_FAMILY
        raise PlanUnavailable(f"no batch-invariant bf16 family for {arch} (served: sm_90a "
                              f"with {HOPPER_BF16_FAMILY})")
    if arch == "sm_90a":
        return HOPPER_FAMILY
    if arch in FLASHINFER_BI_ARCHES:
        ok, why = flashinfer_bi_available()
        if not ok:
            raise PlanUnavailable(f"no batch-invariant FP8 class for {arch}: {why}")
        return FLASHINFER_BI_FAMILY
    raise PlanUnavailable(f"no batch-invariant FP8 family for {arch} (served: sm_90a with "
                          f"{HOPPER_FAMILY}, {', '.join(FLASHINFER_BI_ARCHES)} with "
                          f"{FLASHINFER_BI_FAMILY})")


@dataclass(frozen=True)
class PlanKey:
    """What one plan serves: C (M, N) = A (M, K) @ B (N, K)^T for every M."""

    op: str
    n: int
    k: int
    ab_dtype: str  # "e4m3" | "e5m2" | "bf16"
    out_dtype: str  # "bfloat16" | "float16" ("float32" for bf16 operands)
    arch: str
    sm_count: int
    device: str | None  # device name for shared autotune winners, e.g. "NVIDIA H200"
    scales: str = "tensor"  # "tensor" | "token" | "block128"; "none" for bf16 operands
    accumulation: str = "fast"  # "fast" | "exact" (promoted every K tile)


@dataclass
class GemmPlan:
    """The tactic per M bucket for one :class:`PlanKey`, as the daemon answered it."""

    key: PlanKey
    family: str
    choice: policy.TacticChoice
    max_m: int
    extra: tuple[KernelRequest, ...] = ()  # kernels the family also needs (split fixups)

    @property
    def requests(self) -> list[KernelRequest]:
        """Every kernel the plan loads, each once."""
        return list(dict.fromkeys([b.request for b in self.choice.buckets] + list(self.extra)))

    def describe(self) -> str:
        """One line for a log: shape, family, class, tactic per bucket, and why."""
        k = self.key
        return (f"N={k.n} K={k.k} {k.ab_dtype}->{k.out_dtype} on {k.arch}: {self.family} "
                f"class {self.choice.reduction_class}; {self.choice.describe()} "
                f"({self.choice.reason})")

    def prefetch(self, client: Client) -> PrefetchReply:
        """Queue every kernel of the plan in one ``prefetch``; the daemon's PrefetchReply."""
        return client.prefetch(self.requests, timeout=60)

    def load(self, client: Client, device: Any, timeout: float = 600.0
             ) -> HopperFp8Gemm | FlashInferBiGemm:
        """Get and load every kernel (``Client.load_many``: one ``get_batch`` where the
        daemon has it) and allocate the workspace on ``device`` (a CUDA device); the
        callable that runs the plan."""
        if self.family in (HOPPER_FAMILY, HOPPER_BF16_FAMILY):
            fns = client.load_many([b.request for b in self.choice.buckets], timeout)
            cls = HopperBf16Gemm if self.family == HOPPER_BF16_FAMILY else HopperFp8Gemm
            return cls(self, fns, device)
        return FlashInferBiGemm(self, client, device)


def plan_gemm(client: Client, n: int, k: int, *, arch: str, sm_count: int | None = None,
              device: str | None = None, out_dtype: str = "bfloat16", ab_dtype: str = "e4m3",
              batch_invariant: bool = True, max_m: int = DEFAULT_MAX_M,
              op: str = "linear", prefetch: bool = True, scales: str | None = None,
              accumulation: str | None = None) -> GemmPlan:
    """The plan for (op, N, K, dtype, arch, device), asked of the daemon ``client``, its
    kernels queued in one ``prefetch`` (unless ``prefetch=False``).

    ``ab_dtype``: "e4m3" / "e5m2" (FP8; ``scales`` "tensor" (None: the default), "token",
    "block128" and ``accumulation`` "fast", "exact" (None: "exact" for block128, its only
    mode, else "fast") pick the scheme, cached.hopper_fp8 only; FlashInfer's class is
    per-tensor and fast) or "bf16" (cached.hopper_bf16 on sm_90a: no scales, one
    accumulation mode, ``out_dtype`` "bfloat16", "float16" or "float32"; its loaded plan is
    called ``f(a, b)``). N and K must be multiples of 16. Raises PlanUnavailable,
    ValueError for bad arguments, MixedReductionClasses and the daemon's CachedErrors."""
    for name, v in (("n", n), ("k", k)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if n % 16 or k % 16:
        raise ValueError(f"N and K must be multiples of 16 (TMA 16-byte rows), got N={n}, "
                         f"K={k}")
    if ab_dtype == BF16:
        if out_dtype not in _BF16_OUT:
            raise ValueError(f"out_dtype must be one of {', '.join(_BF16_OUT)} for bf16 "
                             f"operands, got {out_dtype!r}")
        if scales not in (None, "none") or accumulation not in (None, "fast"):
            raise ValueError(f"bf16 operands have no scales and one accumulation mode; got "
                             f"scales={scales!r}, accumulation={accumulation!r} (leave both "
                             "unset)")
        scales, accumulation = "none", "fast"
    else:
        scales = "tensor" if scales is None else scales
        if out_dtype not in _OUT:
            raise ValueError(f"out_dtype must be one of {', '.join(_OUT)}, got {out_dtype!r}")
        if ab_dtype not in _AB:
            raise ValueError(f"ab_dtype must be one of {', '.join((*_AB, BF16))}, got "
                             f"{ab_dtype!r}")
        if accumulation is None:
            accumulation = "exact" if scales == "block128" else "fast"
        if scales not in _SCALES or accumulation not in _ACCUMULATION:
            raise ValueError(f"scales must be one of {', '.join(_SCALES)} and accumulation one "
                             f"of {', '.join(_ACCUMULATION)}, got {scales!r}, "
                             f"{accumulation!r}")
        if scales == "block128" and (accumulation != "exact" or k % 128):
            raise ValueError(f"scales 'block128' need accumulation 'exact' and K % 128 == 0 "
                             f"(the block scales go in at the promotion of every 128 of K), "
                             f"got accumulation {accumulation!r}, K = {k}")
    family = family_for(arch, ab_dtype)
    if family == FLASHINFER_BI_FAMILY and (scales, accumulation) != ("tensor", "fast"):
        raise PlanUnavailable(f"{family} serves per-tensor scales with fast accumulation "
                              f"only, not scales={scales!r} accumulation={accumulation!r}")
    sm = sm_count or DEFAULT_SM_COUNT[arch]
    key = PlanKey(op, n, k, ab_dtype, out_dtype, arch, sm, device, scales, accumulation)
    ups = buckets_up_to(max_m)
    if family in (HOPPER_FAMILY, HOPPER_BF16_FAMILY):
        options = {"out_dtype": out_dtype, "ab_dtype": ab_dtype}
        if family == HOPPER_FAMILY and (scales, accumulation) != ("tensor", "fast"):
            options |= {"scales": scales, "accumulation": accumulation}
        choice = policy.choose_tactics(
            client, family, n, k, arch, buckets=ups, sm_count=sm, device=device,
            batch_invariant=batch_invariant, options=options, op=op,
            dtype=BF16 if family == HOPPER_BF16_FAMILY else "fp8", prefetch=prefetch)
        return GemmPlan(key, family, choice, max_m)
    plan = _flashinfer_bi_plan(client, key, family, max_m)
    if prefetch:
        plan.prefetch(client)
    return plan


def _flashinfer_bi_plan(client: Client, key: PlanKey, family: str, max_m: int) -> GemmPlan:
    """FlashInfer's class for (N, K): the daemon's plan at max_m holds the configuration
    FlashInfer's dispatcher picks at each of its token buckets up to max_m (one class, as
    FlashInfer's R3 declares; checked), and the split fixup when the class is split."""
    reply = client.plan_reply(family, (max_m, key.n, key.k), key.arch, key.sm_count,
                              {"dtype": key.ab_dtype, "out_dtype": _OUT[key.out_dtype]},
                              timeout=120)
    if not reply.requests:
        raise PlanUnavailable(f"{family} plans nothing for N={key.n} K={key.k}")
    classes = reply.classes or [None] * len(reply.requests)
    cls = policy.one_class(zip(reply.requests, classes, strict=True))
    gemm = next(r for r in reply.requests if r.params.get("kind") == "gemm")
    choice = policy.TacticChoice(
        family, key.n, key.k, key.arch, True,
        [policy.BucketChoice(max_m, gemm, cls, "FlashInfer's dispatcher")], cls,
        f"batch invariant: FlashInfer's class {cls}; its dispatcher picks one of the "
        f"{len(reply.requests)} planned kernels per M within the class (every configuration "
        "computes the same bits)")
    return GemmPlan(key, family, choice, max_m, extra=tuple(reply.requests))


class HopperFp8Gemm:
    """A loaded ``cached.hopper_fp8`` plan: ``gemm(a, b, a_scale, b_scale, out=None)``.

    a (M, K) and b (N, K) FP8 (the plan's ab_dtype), K-major; a_scale, b_scale 1-element
    float32 CUDA tensors (per-token plans: M and N float32 values; block128 plans: a_scale
    (M, K/128) column-major and b_scale (ceil(N/128), K/128) row-major, cached_client.
    hopper_fp8.check_gemm_args); returns C (M, N) in the
    plan's out_dtype. M picks the bucket (the smallest upper bound >= M; the last bucket
    above). One workspace serves one launch at a time: GEMMs on concurrent streams need
    their own loaded plan.
    """

    def __init__(self, plan: GemmPlan, fns: list[Any], device: Any) -> None:
        import torch

        from .hopper_fp8 import MAX_WORKSPACE_ELEMS, counter_elems, workspace_bytes

        self.plan = plan
        self.out_dtype = getattr(torch, plan.key.out_dtype)
        buckets = plan.choice.buckets
        self._uppers = [b.upper for b in buckets]
        self._params = [dict(b.request.params) for b in buckets]
        self._fns = fns
        # the workspace of each bucket's tactic at its largest M; the last bucket at max_m
        tops = [max(b.upper, plan.max_m if i == len(buckets) - 1 else 0)
                for i, b in enumerate(buckets)]
        n = plan.key.n
        ws = max(workspace_bytes(p, m, n) for p, m in zip(self._params, tops, strict=True))
        cnt = max(counter_elems(p, m, n) for p, m in zip(self._params, tops, strict=True))
        if ws // 4 > MAX_WORKSPACE_ELEMS:
            raise ValueError(f"{plan.describe()}: the workspace of {ws} bytes is over the "
                             "kernel's limit; plan a smaller max_m")
        self.workspace = torch.empty(max(ws // 4, 1), dtype=torch.float32, device=device)
        self.counters = torch.zeros(max(cnt, 1), dtype=torch.int32, device=device)
        self.ab_dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}.get(
            plan.key.ab_dtype, torch.bfloat16)
        self._empty = torch.empty
        self._block = plan.key.scales == "block128"

    def bucket(self, m: int) -> int:
        """The index of the bucket that serves M rows."""
        return min(bisect.bisect_left(self._uppers, m), len(self._uppers) - 1)

    def tactic(self, m: int) -> dict:
        """The params of the tactic that runs M rows."""
        return self._params[self.bucket(m)]

    def __call__(self, a: Any, b: Any, a_scale: Any, b_scale: Any, out: Any = None) -> Any:
        from .hopper_fp8 import gemm

        i = self.bucket(a.shape[0])
        return gemm(self._fns[i], a, b, a_scale, b_scale, self.out_dtype, out,
                    params=self._params[i], workspace=self.workspace, counters=self.counters)

    def check(self, b: Any, b_scale: Any) -> None:
        """What :meth:`run` trusts of a weight, checked once (at a layer's load): ``b`` is
        the plan's (N, K) weight of its dtype, row-major, 16-byte aligned, on the
        workspace's CUDA device, and ``b_scale`` its scales as the plan's scheme reads them
        (1 value; N values; block128's (ceil(N/128), K/128) row-major; None for bf16).
        ValueError or TypeError naming what differs."""
        import torch

        from .hopper_fp8 import check_gemm_args

        key = self.plan.key
        if not isinstance(b, torch.Tensor) or tuple(b.shape) != (key.n, key.k) \
                or b.dtype != self.ab_dtype:
            got = (f"{tuple(b.shape)} {b.dtype}" if isinstance(b, torch.Tensor)
                   else type(b).__name__)
            raise ValueError(f"the plan for N={key.n} K={key.k} runs a ({key.n}, {key.k}) "
                             f"{self.ab_dtype} weight, got {got}")
        if b.device != self.workspace.device:
            raise ValueError(f"the weight is on {b.device}, the plan on "
                             f"{self.workspace.device}")
        probe = torch.empty((1, key.k), dtype=self.ab_dtype, device=b.device)
        a_scale = None if key.scales == "none" else torch.ones(
            (1, key.k // 128) if self._block else (1,), dtype=torch.float32, device=b.device)
        check_gemm_args(probe, b, a_scale, b_scale, self.out_dtype, None, key.scales)

    def run(self, a: Any, b: Any, a_scale: Any, b_scale: Any) -> Any:
        """``self(a, b, a_scale, b_scale)`` without its argument checks, for a caller that
        made them once (:meth:`check` of ``b`` and ``b_scale``) and passes an ``a`` of the
        plan's K, row-major on the weight's device, with ``a_scale`` as the scheme reads it
        (1 value; M values; block128's (M, K/128) column-major). Picks the bucket, allocates
        the output, launches; nothing else on the host. ``a`` of another dtype and M above
        max_m (which the workspace was sized for) take the checked path, which refuses what
        it cannot run (ValueError)."""
        m = a.shape[0]
        if m > self.plan.max_m or a.dtype != self.ab_dtype:
            return self(a, b, a_scale, b_scale)
        if self._block:  # the strides the kernel was compiled for (size-1 dims' are free)
            a_scale = a_scale.as_strided((m, a_scale.shape[1]), (1, m))
        out = self._empty((m, b.shape[0]), dtype=self.out_dtype, device=a.device)
        self._fns[self.bucket(m)](a, b, out, a_scale, b_scale, self.workspace, self.counters)
        return out


class HopperBf16Gemm(HopperFp8Gemm):
    """A loaded ``cached.hopper_bf16`` plan: ``f(a, b, out=None) -> out``.

    a (M, K) and b (N, K) bfloat16 CUDA tensors on one device, K contiguous (row-major),
    16-byte aligned; returns C = a @ b.T (M, N) in the plan's out_dtype (bfloat16, float16
    or float32), rounded once from the fp32 sum. No bias (add it to the result). M picks
    the bucket (the smallest upper bound >= M; the last bucket above). Allocates only the
    output (nothing with ``out=``, a contiguous (M, N) tensor of the out dtype), no host
    sync, on the current stream: CUDA-graph capturable. One workspace serves one launch at a
    time: GEMMs on concurrent streams need their own loaded plan.
    """

    def __init__(self, plan: GemmPlan, fns: list[Any], device: Any) -> None:

        super().__init__(plan, fns, device)
        self._scale_slot = self.workspace.narrow(0, 0, 1)  # the scale slots: never read

    def __call__(self, a: Any, b: Any, out: Any = None) -> Any:  # type: ignore[override]
        from .hopper_fp8 import gemm

        i = self.bucket(a.shape[0])
        return gemm(self._fns[i], a, b, None, None, self.out_dtype, out,
                    params=self._params[i], workspace=self.workspace, counters=self.counters)

    def run(self, a: Any, b: Any) -> Any:
        """``self(a, b)`` without its argument checks, for a caller that made them once: b
        is the (N, K) bfloat16 weight the plan was made for, on the plan's device, row-major,
        and a is a bfloat16 row-major (M, K) tensor on that device. Picks the bucket,
        allocates the output, launches; nothing else on the host (M above the plan's max_m,
        which the workspace was sized for, takes the checked path)."""
        m = a.shape[0]
        if m > self.plan.max_m:
            return self(a, b)
        out = self._empty((m, b.shape[0]), dtype=self.out_dtype, device=a.device)
        self._fns[self.bucket(m)](a, b, out, self._scale_slot, self._scale_slot,
                                  self.workspace, self.counters)
        return out


class FlashInferBiGemm:
    """A loaded FlashInfer batch-invariant FP8 plan (SM100+): FlashInfer's
    ``bmm_fp8_batch_invariant`` (its dispatcher picks the configuration per M, all of one
    class), its kernels from the daemon through
    :func:`cached_client.integrations.flashinfer.cute_dsl.install` (which this installs, as
    registered with :func:`register_installer`), the split
    class's workspace allocated once for max_m, and one run at each power-of-two M up to
    max_m at load, so that those kernels are loaded before any CUDA-graph capture. Not run
    on hardware here (the project's GPU is an H200)."""

    def __init__(self, plan: GemmPlan, client: Client, device: Any) -> None:
        import torch

        install = _INSTALLERS.get(FLASHINFER_BI_FAMILY)
        if install is None:
            raise PlanUnavailable(f"{FLASHINFER_BI_FAMILY}: no hook installer registered "
                                  "(import cached_client.integrations.flashinfer.cute_dsl first)")
        install(client=client)
        from flashinfer.gemm.batch_invariant.api import bmm_fp8_batch_invariant
        from flashinfer.gemm.batch_invariant.schedule import chunks_for

        self.plan = plan
        key = plan.key
        self._run = bmm_fp8_batch_invariant
        self.out_dtype = getattr(torch, key.out_dtype)
        self._uppers = list(buckets_up_to(plan.max_m))
        chunks = chunks_for(key.n, key.k, key.ab_dtype)
        self.workspace = (torch.empty(chunks * plan.max_m * key.n, dtype=torch.float32,
                                      device=device) if chunks > 1 else None)
        fp8 = torch.float8_e4m3fn if key.ab_dtype == "e4m3" else torch.float8_e5m2
        b = torch.zeros(key.n, key.k, dtype=fp8, device=device)
        one = torch.ones(1, dtype=torch.float32, device=device)
        for m in self._uppers:  # load every bucket's kernels now (FlashInfer picks per M)
            self(torch.zeros(m, key.k, dtype=fp8, device=device), b, one, one)

    def run(self, a: Any, b: Any, a_scale: Any, b_scale: Any) -> Any:
        """``self(a, b, a_scale, b_scale)`` (FlashInfer checks its own operands)."""
        return self(a, b, a_scale, b_scale)

    def __call__(self, a: Any, b: Any, a_scale: Any, b_scale: Any, out: Any = None) -> Any:
        import torch

        if out is None:
            out = torch.empty(a.shape[0], b.shape[0], dtype=self.out_dtype, device=a.device)
        self._run(a.unsqueeze(0), b.t().unsqueeze(0), a_scale, b_scale, self.out_dtype,
                  out.unsqueeze(0), workspace=self.workspace)
        return out
