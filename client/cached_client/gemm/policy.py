"""Which GEMM kernel to use, and why: the batch-invariant policy (docs/integration.md).

``select(op, quant, arch, batch_invariant, backend=None)`` answers with a :class:`Selection`
(``kernel``, ``reason``, ``warnings``, and what it allows: ``tactics`` is ``"one"`` when a
single tactic must serve every M, ``"set"`` when several may). The rules follow vLLM's under
``VLLM_BATCH_INVARIANT=1`` (vLLM #62192):

- FP8 bmm/linear: FlashInfer's FP8 batch-invariant class (``flashinfer.bi.bmm_fp8``) where it
  serves the arch (SM100/SM103/SM107), else vLLM's pin, the ``cutlass`` backend; an explicit
  ``cutlass`` request is honoured; any other backend is overridden with a warning (``auto``
  tunes across cutlass, cuBLAS and cuDNN per M bucket, which changes rows between buckets).
  On Hopper (sm_90a): the project's FP8 family ``cached.hopper_fp8`` when the daemon has it.
- W4A16 NVFP4 linear: ``humming``; a warning when that overrides the requested backend.
- BF16 linear (unquantized layers, the lm_head, the MoE router): on Hopper (sm_90a) the
  project's family ``cached.hopper_bf16`` when the daemon has it, else vLLM's own
  batch-invariant matmul (``vllm``: Triton ``matmul_persistent``), which any other backend
  request is overridden by, with a warning.
- W4A4 NVFP4 linear: a batch-invariant class: ``flashinfer.bi.mm_fp4`` (or ``cutlass``, vLLM's
  batch-invariant CUTLASS kernel, when asked for); Hopper has no FP4 MMA, so W4A16 Humming.

Under batch invariance one (op, N, K, dtype, arch) has one reduction order for every M.
The families declare their reduction-order classes, and the daemon publishes them: ``hello``
(``reduction_classes``: family -> class ids, and whether a class's order is M-independent)
and ``plan`` (``classes``: the class of each planned tactic). A set of tactics is allowed
only within one class of a family that declares its classes M-independent, or where a
certification recorded in the daemon (``certifications`` op, written by ``cached certify``)
says 0 rows differ for that set on that device; otherwise one tactic. Without a daemon
nothing is declared, so one tactic. :func:`choose_tactics` picks the tactic per M bucket
for one (N, K): measured winners shared through the daemon (``autotune_get``) where they
belong to the plan's class, else the family's plan order; it refuses to mix classes
(:class:`MixedReductionClasses`). Without batch invariance: the requested (or default)
backend, with the best tactic per M bucket from the shared autotune results;
:func:`publish_autotune` is how the process that tuned shares its winners.

Importing this module imports nothing heavy; the daemon is asked only when a client is given.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import CachedError
from ..keys import KernelRequest
from ..protocol import (
    AutotuneGetRequest,
    AutotunePutRequest,
    HelloReply,
    PlanReply,
    PlanShapeReply,
    PlanShapeRequest,
)

if TYPE_CHECKING:
    from ..client import Client

logger = logging.getLogger("cached_client.policy")

OPS = ("linear", "bmm")
QUANTS = ("fp8", "nvfp4-w4a4", "nvfp4-w4a16", "bf16")
ARCHES = ("sm_90a", "sm_100a", "sm_103a", "sm_107a")
FLASHINFER_BI_ARCHES = ("sm_100a", "sm_103a", "sm_107a")
DEFAULT_BACKEND = {"fp8": "flashinfer", "nvfp4-w4a4": "flashinfer.mm_fp4",
                   "nvfp4-w4a16": "flashinfer-cutedsl", "bf16": "torch"}
BF16_FAMILY = "cached.hopper_bf16"
#: vLLM 0.33.0's own batch-invariant BF16 matmul (Triton matmul_persistent)
VLLM_BF16_BI = "vllm"
NO_PREFERENCE = (None, "", "auto")
KNOWN_KERNELS = frozenset({*DEFAULT_BACKEND.values(), "cutlass", "humming",
                           "flashinfer.bi.bmm_fp8", "flashinfer.bi.mm_fp4", "cached.hopper_fp8"})
"""The kernels and backends a selection may name without a daemon: the ones this module
itself chooses. A shared autotune result naming anything else (another peer's record) is
taken only when the daemon's ``hello`` lists it as a family it builds."""


class DaemonInfo(Protocol):
    """What the selection asks of a daemon (a :class:`~cached_client.client.Client` is one;
    tests pass a stand-in that answers these three)."""

    def hello(self, timeout: float | None = None) -> HelloReply: ...

    def certifications(self, family: str | None = None,
                       timeout: float | None = None) -> list[dict]: ...

    def autotune_get(self, request: AutotuneGetRequest,
                     timeout: float | None = None) -> list[dict]: ...


@dataclass
class Selection:
    kernel: str
    reason: str
    warnings: list[str] = field(default_factory=list)
    tactics: str = "one"  # "one": one tactic for every M; "set": several allowed
    per_bucket: dict[int, Any] = field(default_factory=dict)  # M bucket -> tuned tactic

    def to_dict(self) -> dict:
        return {"kernel": self.kernel, "reason": self.reason, "warnings": list(self.warnings)}


def _check(op: str, quant: str, arch: str) -> None:
    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {', '.join(QUANTS)}, got {quant!r}")
    if arch not in ARCHES:
        raise ValueError(f"arch must be one of {', '.join(ARCHES)}, got {arch!r}")
    if op == "bmm" and quant != "fp8":
        raise ValueError(f"bmm is served for fp8 only, not {quant}")


class MixedReductionClasses(ValueError):
    """A batch-invariant plan would run tactics of two reduction-order classes."""


def reduction_info(client: DaemonInfo | None, family: str) -> dict | None:
    """What the daemon's ``hello`` declares about ``family``'s reduction-order classes
    (``{"classes": [...], "m_independent": bool}``), or None: no daemon, or none declared."""
    if client is None:
        return None
    try:
        info = client.hello(timeout=5).reduction_classes.get(family)
    except CachedError:
        return None
    return info if isinstance(info, dict) else None


def daemon_families(client: DaemonInfo | None) -> list[str] | None:
    """The families the daemon builds, or None when there is no usable daemon."""
    if client is None:
        return None
    try:
        return list(client.hello(timeout=5).families)
    except CachedError:
        return None


def certifications(client: DaemonInfo | None, family: str | None = None) -> list[dict]:
    """Certifications recorded in the daemon (op ``certifications``); none when the daemon,
    or the op, is missing."""
    if client is None:
        return []
    try:
        return client.certifications(family or None, timeout=5)
    except CachedError:
        return []


def certified(client: DaemonInfo | None, family: str, n: int | None, k: int | None,
              device: str | None, tactics: Any = None) -> dict | None:
    """A certification of ``family`` at (N, K) on ``device`` with 0 differing rows (for the
    tactic set ``tactics`` when given), else None."""
    if n is None or k is None or device is None:
        return None
    for record in certifications(client, family):
        if (record.get("family") == family and record.get("n") == n and record.get("k") == k
                and record.get("device") == device and rows_all_zero(record.get("rows_differing"))
                and (tactics is None or _same(record.get("tactics"), tactics))):
            return record
    return None


def rows_all_zero(rows: Any) -> bool:
    """Whether a certification's ``rows_differing`` (a dict or list of counts, or one count)
    says no row differed: an empty count is no measurement, never "0 rows differ"."""
    if isinstance(rows, dict):
        return bool(rows) and all(v == 0 for v in rows.values())
    if isinstance(rows, list):
        return bool(rows) and all(v == 0 for v in rows)
    return type(rows) is int and rows == 0


def _same(a: Any, b: Any) -> bool:
    return sorted(map(str, a or [])) == sorted(map(str, b or []))


def tactic_rule(family: str, client: DaemonInfo | None = None, n: int | None = None,
                k: int | None = None, device: str | None = None) -> tuple[str, str]:
    """("set" | "one", why) for a family under batch invariance; "set" means several
    tactics of one reduction-order class."""
    info = reduction_info(client, family)
    if info is not None and info.get("m_independent"):
        classes = info.get("classes") or []
        return "set", (f"{family} declares its reduction order M-independent within each of "
                       f"its {len(classes)} reduction-order classes (daemon's hello); one "
                       "class for every M")
    record = certified(client, family, n, k, device)
    if record is not None:
        return "set", (f"certified on {device}: 0 rows differ for {family} at "
                       f"N={n} K={k} ({record.get('checked_at', '')})")
    why = "no daemon to ask" if client is None else "no M-independence declared or certified"
    return "one", f"{why}: one tactic for every M"


def select(op: str, quant: str, arch: str, batch_invariant: bool, backend: str | None = None,
           *, client: DaemonInfo | None = None, n: int | None = None, k: int | None = None,
           device: str | None = None) -> Selection:
    """The kernel for (op, quant, arch) with or without batch invariance; see the module doc."""
    _check(op, quant, arch)
    if batch_invariant:
        sel = _select_bi(op, quant, arch, backend, client)
        if "." in sel.kernel:  # a daemon family (backends are bare names: cutlass, humming)
            sel.tactics, why = tactic_rule(sel.kernel, client, n, k, device)
            sel.reason += f"; {why}"
        else:
            sel.tactics = "one"
            sel.reason += "; one pinned tactic for every M (no autotuning across buckets)"
        return sel
    return _select_tuned(op, quant, arch, backend, client, n, k, device)


def _override_warning(backend: str | None, kernel: str, why: str) -> list[str]:
    if backend in NO_PREFERENCE or backend == kernel:
        return []
    return [f"VLLM_BATCH_INVARIANT overrides backend={backend!r}; using {kernel!r} ({why})"]


def _select_bi(op: str, quant: str, arch: str, backend: str | None,
               client: DaemonInfo | None) -> Selection:
    if quant == "bf16":
        families = daemon_families(client) if arch == "sm_90a" else None
        if families is not None and BF16_FAMILY in families:
            return Selection(BF16_FAMILY, "the project's sm_90a BF16 family serves Hopper",
                             _override_warning(backend, BF16_FAMILY, "a batch-invariant family"))
        warnings = _override_warning(backend, VLLM_BF16_BI, "vLLM's batch-invariant matmul")
        if arch != "sm_90a":
            why = f"no daemon BF16 family for {arch} (cached.hopper_bf16 is sm_90a)"
        elif families is None:
            why = "no daemon to ask for cached.hopper_bf16"
            warnings.append(f"{why}; using vLLM's batch-invariant matmul")
        else:
            why = "the daemon does not build cached.hopper_bf16"
            warnings.append(f"{why}; using vLLM's batch-invariant matmul")
        return Selection(VLLM_BF16_BI, f"BF16 on vLLM's own batch-invariant matmul "
                         f"(matmul_persistent): {why}", warnings)
    if quant == "fp8":
        if backend == "cutlass":
            return Selection("cutlass", "FP8 bmm pinned to the cutlass backend under batch "
                             "invariance (vLLM #62192), as requested")
        if arch in FLASHINFER_BI_ARCHES:
            kernel = "flashinfer.bi.bmm_fp8"
            return Selection(kernel, f"FlashInfer's FP8 batch-invariant class serves {arch}",
                             _override_warning(backend, kernel, "a batch-invariant class"))
        families = daemon_families(client)
        if families is not None and "cached.hopper_fp8" in families:
            kernel = "cached.hopper_fp8"
            return Selection(kernel, "the project's sm_90a FP8 family serves Hopper",
                             _override_warning(backend, kernel, "a batch-invariant family"))
        warnings = _override_warning(backend, "cutlass", "vLLM's pin")
        if families is None:
            warnings.append("no daemon to ask for cached.hopper_fp8; using vLLM's cutlass pin")
        return Selection("cutlass", "FP8 pinned to the cutlass backend on sm_90a (vLLM "
                         "#62192): FlashInfer's FP8 batch-invariant class needs SM100+",
                         warnings)
    if quant == "nvfp4-w4a16":
        return Selection("humming", "W4A16 NVFP4 uses the Humming kernel under batch "
                         "invariance (vLLM #62192; the batch-invariant CUTLASS kernel is "
                         "W4A4-only)", _override_warning(backend, "humming",
                                                          "deterministic W4A16"))
    # nvfp4-w4a4
    if arch not in FLASHINFER_BI_ARCHES:
        return Selection("humming", f"{arch} has no FP4 MMA: no batch-invariant W4A4 NVFP4 "
                         "class; weights run W4A16 on Humming",
                         [f"W4A4 NVFP4 is not served on {arch}; activations stay 16-bit "
                          "(W4A16 Humming)"] + _override_warning(backend, "humming",
                                                                  "no W4A4 on this arch"))
    if backend == "cutlass":
        return Selection("cutlass", "W4A4 NVFP4 on vLLM's batch-invariant CUTLASS kernel, as "
                         "requested")
    kernel = "flashinfer.bi.mm_fp4"
    return Selection(kernel, f"W4A4 NVFP4 on FlashInfer's batch-invariant NVFP4 class ({arch})",
                     _override_warning(backend, kernel, "its autotuned tactics include "
                                       "split-K, whose reduction order changes with M"))


def _select_tuned(op: str, quant: str, arch: str, backend: str | None,
                  client: DaemonInfo | None,
                  n: int | None, k: int | None, device: str | None) -> Selection:
    kernel = backend if backend not in NO_PREFERENCE else DEFAULT_BACKEND[quant]
    if quant == "nvfp4-w4a4" and arch not in FLASHINFER_BI_ARCHES:
        return Selection("humming", f"{arch} has no FP4 MMA; W4A16 Humming",
                         [f"W4A4 NVFP4 is not served on {arch}"], "set")
    sel = Selection(kernel, "without batch invariance: the fastest tactic per M bucket",
                    tactics="set")
    if n is None or k is None or device is None:
        sel.reason += " (pass n, k and device to use the node's shared autotune results)"
        return sel
    results = autotune_results(client, op, n, k, quant, arch, device)
    known = KNOWN_KERNELS | {kernel} | set(daemon_families(client) or ())
    unknown = sorted({str(r.get("kernel"))[:40] for r in results if r.get("kernel") not in known})
    if unknown:
        sel.warnings.append(f"ignored shared autotune results naming {len(unknown)} kernel(s) "
                            f"neither this client nor the daemon knows "
                            f"({', '.join(map(repr, unknown[:3]))})")
    results = [r for r in results if r.get("kernel") in known]
    mine = [r for r in results if r.get("kernel") == kernel] or results
    if mine:
        sel.per_bucket = {int(r["bucket"]): r["tactic"] for r in mine}
        sel.kernel = mine[0]["kernel"] if backend in NO_PREFERENCE else kernel
        sel.reason += (f"; {len(mine)} bucket winner(s) tuned on this node, shared through "
                       "the daemon")
    else:
        sel.reason += "; no shared autotune results yet: tune here and publish_autotune()"
    return sel


def autotune_results(client: DaemonInfo | None, op: str, n: int, k: int, dtype: str,
                     arch: str, device: str, toolchain: str | None = None) -> list[dict]:
    """The node's shared winners for (op, N, K, dtype, arch, device) this process may be
    served (the daemon's trusted ones and its own trust group's), kept by
    :func:`keep_winners`."""
    if client is None:
        return []
    try:
        results = client.autotune_get(AutotuneGetRequest(
            op_name=op, n=n, k=k, dtype=dtype, arch=arch, device=device), timeout=5)
    except CachedError:
        return []
    return keep_winners(results, op, toolchain)


def keep_winners(results: Iterable[dict], op: str, toolchain: str | None) -> list[dict]:
    """The shared winners of ``op`` that may be taken: a winner that states no toolchain or
    no reduction-order class never is; with ``toolchain``, only those timed with kernels of
    that toolchain."""
    return [r for r in results if r.get("op") == op and r.get("toolchain")
            and r.get("reduction_class")
            and (toolchain is None or r.get("toolchain") == toolchain)]


def publish_autotune(client: Client, op: str, n: int, k: int, dtype: str, arch: str, device: str,
                     bucket: int, kernel: str, tactic: Any, time_us: float, *,
                     reduction_class: str, toolchain: str | None = None) -> bool:
    """Share one tuning winner with the other processes of this trust group on the node
    (the daemon's trusted group when root or the daemon's uid publishes); True when stored
    (a slower result than the one already recorded is not). ``reduction_class``: the
    tactic's reduction-order class; ``toolchain``: the stack that compiled the kernels timed
    (default: the daemon's, from ``hello``)."""
    return client.autotune_put(AutotunePutRequest(
        op_name=op, n=n, k=k, dtype=dtype, arch=arch, device=device, bucket=bucket,
        kernel=kernel, tactic=tactic, time_us=time_us, reduction_class=reduction_class,
        toolchain=toolchain or client.hello(timeout=10).toolchain), timeout=10)


# -- tactics per M bucket for one (N, K) -----------------------------------------------------


@dataclass(frozen=True)
class BucketChoice:
    """The tactic that serves M <= ``upper`` (above the previous bucket's upper; the last
    bucket serves every larger M too)."""

    upper: int
    request: KernelRequest
    reduction_class: str | None
    source: str  # "autotune" (a winner shared through the daemon) or "plan order"


@dataclass
class TacticChoice:
    """The tactic per M bucket for one (family, N, K, arch, device); see :func:`choose_tactics`."""

    family: str
    n: int
    k: int
    arch: str
    batch_invariant: bool
    buckets: list[BucketChoice]
    reduction_class: str | None
    reason: str
    warnings: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """One line: bucket upper -> tactic name (and where it came from)."""
        parts = [f"M<={b.upper}: {_tactic_name(b.request)}"
                 + (" [autotune]" if b.source == "autotune" else "") for b in self.buckets]
        return ", ".join(parts)


def _tactic_name(request: KernelRequest) -> str:
    p = request.params
    if "tile_m" in p:  # cached.hopper_fp8
        split = f" S={p['splits']}{p['split_mode'][0]}" if p.get("splits", 1) > 1 else ""
        kind = "".join(mark for mark, on in ((" swap", p.get("swap_ab")),
                                             (" wg2", p.get("wg_n", 1) == 2),
                                             (" pp", p.get("pingpong")),
                                             (" pdl", p.get("pdl"))) if on)
        return (f"{p['tile_m']}x{p['tile_n']} c{p['cluster_m']}x{p['cluster_n']} "
                f"r{p['raster']}{split}{kind}")
    knobs = p.get("knobs")
    return str(knobs.get("mma_tiler_mn", knobs)) if isinstance(knobs, dict) else str(p)


def one_class(choices: Any) -> str | None:
    """The one reduction-order class of ``choices`` (BucketChoice items, or (request, class)
    pairs); MixedReductionClasses names the classes when there are several."""
    classes: dict[str | None, list[str]] = {}
    for c in choices:
        request, cls = (c.request, c.reduction_class) if isinstance(c, BucketChoice) else c
        classes.setdefault(cls, []).append(_tactic_name(request))
    if len(classes) > 1:
        shown = "; ".join(f"{cls}: {', '.join(names[:3])}" for cls, names in classes.items())
        raise MixedReductionClasses(
            f"a batch-invariant plan must run one reduction-order class for every M, got "
            f"{len(classes)}: {shown}")
    return next(iter(classes), None)


def check_buckets(buckets: Sequence[int]) -> list[int]:
    """``buckets`` as a list; ValueError unless they are increasing positive M bounds."""
    ups = list(buckets)
    if not ups or any(not isinstance(u, int) or isinstance(u, bool) or u < 1 for u in ups) \
            or ups != sorted(set(ups)):
        raise ValueError(f"buckets must be increasing positive M bounds, got {buckets!r}")
    return ups


Planned = tuple[KernelRequest, "str | None"]
"""A planned tactic and its reduction-order class (None: the family declares none)."""


def choose_tactics(client: Client, family: str, n: int, k: int, arch: str, *,
                   buckets: Sequence[int], sm_count: int | None = None,
                   device: str | None = None, batch_invariant: bool = True,
                   options: dict | None = None, op: str = "linear",
                   dtype: str = "fp8", prefetch: bool = False) -> TacticChoice:
    """The tactic per M bucket (``buckets``: increasing M upper bounds) for ``family`` at
    (N, K) on ``arch``, asked of the daemon ``client``: one ``plan_shape`` request where the
    daemon has the op (which, with ``prefetch``, also queues the chosen kernels), else one
    ``plan`` per bucket. Either way the choice is :func:`pick_tactics`'s.

    Under batch invariance every bucket's plan is asked with ``batch_invariant: true``, so
    the family answers one reduction-order class for (N, K) (the same for every M; each
    planned tactic's class is known, and a plan of several classes is refused). A bucket
    runs the winner measured on this node and shared through the daemon (``autotune_get``
    for ``op``, N, K, ``dtype``, ``arch``, ``device``) when that winner is a tactic of the
    plan's class, else the plan's first tactic; a winner of another class is skipped with a
    warning. Without batch invariance each bucket runs the fastest of its shared winners
    that the plan (its scheme: scales, accumulation) lists, whatever its class, else the
    plan's first tactic; a winner of another scheme is never run. Raises
    MixedReductionClasses, ValueError for bad buckets, and the daemon's typed errors
    (CachedError)."""
    ups = check_buckets(buckets)
    opts = dict(options or {})
    if batch_invariant:
        opts["batch_invariant"] = True
    if client.supports("plan_shape"):
        reply = client.plan_shape(PlanShapeRequest(
            family=family, n=n, k=k, buckets=ups, arch=arch, sm_count=sm_count, options=opts,
            batch_invariant=batch_invariant, op_name=op, dtype=dtype, device=device,
            prefetch=prefetch), timeout=120)
        return choice_from_reply(family, n, k, arch, batch_invariant, reply)
    # each bucket's first tactic alone (limit 1: the whole space is hundreds of requests a
    # bucket); a bucket with a shared winner gets its whole reply, which says whether the
    # winner is a tactic of the plan
    firsts = {u: _planned(_plan(client, family, u, n, k, arch, sm_count, opts, 1))[0]
              for u in ups}
    found: list[dict] = []
    if device is not None:
        toolchain = client.hello(timeout=10).toolchain
        found = autotune_results(client, op, n, k, dtype, arch, device, toolchain)
    choice = pick_tactics(family, n, k, arch, ups, firsts, found, lambda u: _planned(
        _plan(client, family, u, n, k, arch, sm_count, opts, None)), batch_invariant)
    if prefetch:
        client.prefetch(list(dict.fromkeys(b.request for b in choice.buckets)), timeout=60)
    return choice


def pick_tactics(family: str, n: int, k: int, arch: str, ups: Sequence[int],
                 firsts: Mapping[int, Planned], found: Iterable[dict],
                 whole: Callable[[int], Sequence[Planned]],
                 batch_invariant: bool) -> TacticChoice:
    """The choice :func:`choose_tactics` describes, from what was planned: ``firsts`` (the
    plan's first tactic per bucket), ``found`` (the node's shared winners this process may
    take: :func:`autotune_results`' filter) and ``whole(u)`` (the whole plan at bucket u,
    asked only for a bucket with a winner of the family). The daemon's ``plan_shape`` runs
    this same function; MixedReductionClasses when the plan would mix classes."""
    class_of: dict[KernelRequest, str | None] = {r: c for r, c in firsts.values()}
    cls = one_class(class_of.items()) if batch_invariant else None
    # a bucket may hold one winner per class (each scheme's classes are its own): every
    # one of this family is a candidate, fastest first; the plan takes the first its reply
    # lists (a winner of another scheme or class is no tactic of this plan); under batch
    # invariance a winner filed under another class is no candidate (a warning names it)
    winners: dict[int, list[Any]] = {}
    foreign: dict[int, dict] = {}  # the fastest winner filed under another class
    for r in sorted(found, key=lambda r: float(r.get("time_us") or 0.0)):
        if r.get("kernel") != family:
            continue
        if batch_invariant and r.get("reduction_class") != cls:
            foreign.setdefault(int(r["bucket"]), r)
        else:
            winners.setdefault(int(r["bucket"]), []).append(r["tactic"])
    plans = {u: list(whole(u)) for u in ups if u in winners}
    for planned in plans.values():
        class_of.update(planned)
    if batch_invariant and plans:  # the whole plans' classes too
        one_class(class_of.items())
    chosen, warnings = [], []
    for u in ups:
        request, source = firsts[u][0], "plan order"
        if u in winners:
            by_params = {_params_key(r.params): r for r, _ in plans[u]}
            hit = next((by_params[key] for key in map(_params_key, winners[u])
                        if key in by_params), None)
            if hit is not None:
                request, source = hit, "autotune"
            elif batch_invariant:
                warnings.append(f"M<={u}: the shared autotune winner {winners[u][0]!r} is not "
                                f"a tactic of the class {cls}; using the plan's first")
        elif u in foreign:
            warnings.append(f"M<={u}: the shared autotune winner {foreign[u]['tactic']!r} is "
                            f"not a tactic of the class {cls} (it is filed under "
                            f"{foreign[u]['reduction_class']}); using the plan's first")
        chosen.append(BucketChoice(u, request, class_of.get(request), source))
    return _choice(family, n, k, arch, batch_invariant, chosen, cls, warnings)


def _choice(family: str, n: int, k: int, arch: str, batch_invariant: bool,
            chosen: list[BucketChoice], cls: str | None, warnings: list[str]) -> TacticChoice:
    if batch_invariant:
        one_class(chosen)
        tuned = sum(c.source == "autotune" for c in chosen)
        reason = (f"batch invariant: one reduction-order class ({cls}) for every M; "
                  f"{tuned} of {len(chosen)} buckets from autotune winners shared through the "
                  "daemon, the rest in the family's plan order")
    else:
        reason = "without batch invariance: the fastest tactic per M bucket"
    return TacticChoice(family, n, k, arch, batch_invariant, chosen, cls, reason, warnings)


def choice_from_reply(family: str, n: int, k: int, arch: str, batch_invariant: bool,
                      reply: PlanShapeReply) -> TacticChoice:
    """The daemon's ``plan_shape`` answer as a TacticChoice, checked again here: one
    reduction-order class for every M under batch invariance (MixedReductionClasses)."""
    chosen = [BucketChoice(b.upper, b.request, b.reduction_class, b.source)
              for b in reply.buckets]
    cls = one_class(chosen) if batch_invariant else None
    return _choice(family, n, k, arch, batch_invariant, chosen, cls, list(reply.warnings))


def _plan(client: Client, family: str, m: int, n: int, k: int, arch: str,
          sm_count: int | None, options: dict, limit: int | None) -> PlanReply:
    """The daemon's plan reply for (M, N, K), at most ``limit`` requests (None: all);
    ValueError when it plans nothing."""
    reply = client.plan_reply(family, (m, n, k), arch, sm_count, options, timeout=60,
                              limit=limit)
    if not reply.requests:
        raise ValueError(f"{family} plans no tactic for (M, N, K)=({m}, {n}, {k}) on {arch}")
    return reply


def _planned(reply: PlanReply) -> list[Planned]:
    """A plan reply's (request, class) pairs (class None where the family declares none)."""
    return list(zip(reply.requests, reply.classes or [None] * len(reply.requests),
                    strict=True))


def _params_key(params: Any) -> str:
    import json

    return json.dumps(params, sort_keys=True)
