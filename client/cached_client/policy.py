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
- W4A4 NVFP4 linear: a batch-invariant class: ``flashinfer.bi.mm_fp4`` (or ``cutlass``, vLLM's
  batch-invariant CUTLASS kernel, when asked for); Hopper has no FP4 MMA, so W4A16 Humming.

Under batch invariance one (op, N, K, dtype, arch) has one reduction order for every M: a
set of tactics is allowed only when the family declares its order M-independent
(:data:`M_INDEPENDENT`) or a certification recorded in the daemon (``certifications`` op,
written by ``cached certify``) says 0 rows differ for that set on that device; otherwise one
tactic. Without batch invariance: the requested (or default) backend, with the best tactic per
M bucket from the autotune results processes share through the daemon (``autotune_get``);
:func:`publish_autotune` is how the process that tuned shares its winners.

Importing this module imports nothing heavy; the daemon is asked only when a client is given.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from .errors import CachedError
from .protocol import AutotuneGetRequest, AutotunePutRequest

logger = logging.getLogger("cached_client.policy")

OPS = ("linear", "bmm")
QUANTS = ("fp8", "nvfp4-w4a4", "nvfp4-w4a16")
ARCHES = ("sm_90a", "sm_100a", "sm_103a", "sm_107a")
FLASHINFER_BI_ARCHES = ("sm_100a", "sm_103a", "sm_107a")
#: families whose reduction order does not depend on M or on the tactic (declared by the
#: family: FlashInfer's R3 for its classes; the K-loop of cached.hopper_fp8)
M_INDEPENDENT = {"flashinfer.bi.bmm_fp8": True, "flashinfer.bi.mm_fp4": True,
                 "cached.hopper_fp8": True}
#: backends vLLM's batch-invariant mode accepts as they are, per quantisation
BI_OK_BACKENDS = {"fp8": ("cutlass",), "nvfp4-w4a16": ("humming",),
                  "nvfp4-w4a4": ("cutlass",)}
DEFAULT_BACKEND = {"fp8": "flashinfer", "nvfp4-w4a4": "flashinfer.mm_fp4",
                   "nvfp4-w4a16": "flashinfer-cutedsl"}
NO_PREFERENCE = (None, "", "auto")


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


def daemon_families(client: Any) -> list[str] | None:
    """The families the daemon builds, or None when there is no usable daemon."""
    if client is None:
        return None
    try:
        return list(client.hello(timeout=5).families)
    except CachedError:
        return None


def certifications(client: Any, family: str | None = None) -> list[dict]:
    """Certifications recorded in the daemon (op ``certifications``); none when the daemon,
    or the op, is missing."""
    if client is None:
        return []
    try:
        return client.certifications(family or None, timeout=5)
    except CachedError:
        return []


def certified(client: Any, family: str, n: int | None, k: int | None,
              device: str | None, tactics: Any = None) -> dict | None:
    """A certification of ``family`` at (N, K) on ``device`` with 0 differing rows (for the
    tactic set ``tactics`` when given), else None."""
    if n is None or k is None or device is None:
        return None
    for record in certifications(client, family):
        if (record.get("family") == family and record.get("n") == n and record.get("k") == k
                and record.get("device") == device and _zero(record.get("rows_differing"))
                and (tactics is None or _same(record.get("tactics"), tactics))):
            return record
    return None


def _zero(rows: Any) -> bool:
    if isinstance(rows, dict):
        return all(v == 0 for v in rows.values())
    if isinstance(rows, list):
        return all(v == 0 for v in rows)
    return rows == 0


def _same(a: Any, b: Any) -> bool:
    return sorted(map(str, a or [])) == sorted(map(str, b or []))


def tactic_rule(family: str, client: Any = None, n: int | None = None, k: int | None = None,
                device: str | None = None) -> tuple[str, str]:
    """("set" | "one", why) for a family under batch invariance."""
    if M_INDEPENDENT.get(family):
        return "set", f"{family} declares its reduction order M-independent"
    record = certified(client, family, n, k, device)
    if record is not None:
        return "set", (f"certified on {device}: 0 rows differ for {family} at "
                       f"N={n} K={k} ({record.get('checked_at', '')})")
    return "one", "no M-independence declared or certified: one tactic for every M"


def select(op: str, quant: str, arch: str, batch_invariant: bool, backend: str | None = None,
           *, client: Any = None, n: int | None = None, k: int | None = None,
           device: str | None = None) -> Selection:
    """The kernel for (op, quant, arch) with or without batch invariance; see the module doc."""
    _check(op, quant, arch)
    if batch_invariant:
        sel = _select_bi(op, quant, arch, backend, client)
        if sel.kernel in M_INDEPENDENT or sel.kernel.startswith("cached."):
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


def _select_bi(op: str, quant: str, arch: str, backend: str | None, client: Any) -> Selection:
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


def _select_tuned(op: str, quant: str, arch: str, backend: str | None, client: Any,
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
    mine = [r for r in results if r.get("kernel") == kernel] or results
    if mine:
        sel.per_bucket = {int(r["bucket"]): r["tactic"] for r in mine}
        sel.kernel = mine[0]["kernel"] if backend in NO_PREFERENCE else kernel
        sel.reason += (f"; {len(mine)} bucket winner(s) tuned on this node, shared through "
                       "the daemon")
    else:
        sel.reason += "; no shared autotune results yet: tune here and publish_autotune()"
    return sel


def autotune_results(client: Any, op: str, n: int, k: int, dtype: str, arch: str,
                     device: str) -> list[dict]:
    if client is None:
        return []
    try:
        results = client.autotune_get(AutotuneGetRequest(
            op_name=op, n=n, k=k, dtype=dtype, arch=arch, device=device), timeout=5)
    except CachedError:
        return []
    return [r for r in results if r.get("op") == op]


def publish_autotune(client: Any, op: str, n: int, k: int, dtype: str, arch: str, device: str,
                     bucket: int, kernel: str, tactic: Any, time_us: float) -> bool:
    """Share one tuning winner with the other processes on the node; True when stored (a
    slower result than the one already recorded is not)."""
    return client.autotune_put(AutotunePutRequest(
        op_name=op, n=n, k=k, dtype=dtype, arch=arch, device=device, bucket=bucket,
        kernel=kernel, tactic=tactic, time_us=time_us), timeout=10)
