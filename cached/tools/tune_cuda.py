"""The timing core of ``cached tune`` (cached.tools.tune.Timer) on a CUDA device; imports torch.

For one (N, K), M and reduction-order class (cached.hopper_fp8: its scheme, scales and
accumulation, is part of the class id; cached.hopper_bf16: the scheme ``"none"``, bf16
operands, no scales, :func:`scheme_of`): each candidate is loaded through the client
(``Client.load``: from the daemon's store; a serve-only daemon answers only what it holds,
and a candidate it lacks is left out as "not in this node's store"); its output on fresh
Gaussian data of the family's operand type (FP8 e4m3 or bf16, :func:`data`) and the
scheme's scales (:func:`operands`) is checked before any timing:
the first candidate against a float32 reference (:func:`reference`), relative error within
the class's bound at that K (``Family.tune_error_bound``, the output's own rounding of the
reference measured on the same data), every other one bitwise equal to the first correct
one (one reduction-order class computes the same bits). Each kernel, and the scheme's
competitor (:func:`competitor`, key -1), is captured in a CUDA graph of ``iters`` launches
cycling over input sets that together exceed the L2 (ROTATE_BYTES), then timed in
interleaved rounds: each round replays every graph once, in an order rotated by one per
round, timed by CUDA events; a round's figure is µs per launch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from cached_client.errors import CachedError
from cached_client.gemm.hopper_fp8 import alloc_workspace, gemm
from cached_client.keys import KernelRequest

from cached.families.hopper_fp8.tactic import BLOCK, NO_SCALES, bf16_class_splits, class_scheme
from cached.log import event

if TYPE_CHECKING:
    from cached_client.client import Client
from cached.tools.tune import NOT_BITWISE, Timing, judge, load_failure

log = logging.getLogger("cached.tune")

ROTATE_BYTES = 200 << 20  # input sets per graph cover this much (the H200's L2: 60 MB)
MAX_SETS = 16
SCALE_A, SCALE_B = 0.5, 0.25  # per-tensor scales
MIN_GRAPH_US = 2000.0  # a replay lasts at least this long (event resolution, launch noise)
MAX_ITERS = 50


def scheme_of(reduction_class: str) -> tuple[str, str]:
    """(accum, scales) of a class id of cached.hopper_fp8 or cached.hopper_bf16 (its
    classes: ("fast", "none")); ValueError naming the class for any other."""
    try:
        _, accum, scales = class_scheme(reduction_class)
        return accum, scales
    except ValueError:
        bf16_class_splits(reduction_class)  # ValueError when it is neither family's
        return "fast", NO_SCALES


def data(scales: str, rows: int, cols: int, gen: torch.Generator, dev: str = "cuda"
         ) -> torch.Tensor:
    """A (rows, cols) Gaussian operand of the scheme's type: bf16 for ``"none"`` (the bf16
    family), else float8_e4m3fn."""
    x = torch.randn(rows, cols, device=dev, generator=gen)
    return x.to(torch.bfloat16 if scales == NO_SCALES else torch.float8_e4m3fn)


def operands(scales: str, m: int, n: int, k: int, gen: torch.Generator, dev: str = "cuda"
             ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(a_scale, b_scale) of the scheme, float32 on ``dev`` (``gen``'s device): per-tensor
    SCALE_A / SCALE_B; per-token (M,) and (N,) in [0.5, 2); block128 (M, K/128)
    column-major and (ceil(N/128), K/128) row-major in [0.5, 2) (the launcher's layouts);
    (None, None) for ``"none"`` (bf16 operands read no scale)."""
    if scales == NO_SCALES:
        return None, None
    if scales == "tensor":
        return (torch.tensor([SCALE_A], device=dev), torch.tensor([SCALE_B], device=dev))
    if scales == "token":
        return (torch.rand(m, device=dev, generator=gen) * 1.5 + 0.5,
                torch.rand(n, device=dev, generator=gen) * 1.5 + 0.5)
    kb, nb = k // BLOCK, -(-n // BLOCK)
    return ((torch.rand(kb, m, device=dev, generator=gen) * 1.5 + 0.5).t(),
            torch.rand(nb, kb, device=dev, generator=gen) * 1.5 + 0.5)


def reference(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor | None,
              sb: torch.Tensor | None, scales: str) -> torch.Tensor:
    """The scheme's C = (a @ b^T) scaled (``"none"``: unscaled), in float32 (the operands'
    products are exact in float32, FP8 and bf16 alike)."""
    if scales == "block128":
        n, k = b.shape
        fa = a.float() * sa.repeat_interleave(BLOCK, dim=1)[:, :k]
        fb = b.float() * sb.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
        return fa @ fb.T
    c = a.float() @ b.float().T
    if scales == NO_SCALES:
        return c
    if scales == "token":
        return c * sa.reshape(-1, 1) * sb.reshape(1, -1)
    return c * (sa * sb)


def competitor(scales: str, accum: str, out_dtype: torch.dtype = torch.bfloat16
               ) -> tuple[str, Callable[..., torch.Tensor]] | None:
    """(label, fn(a, b, a_scale, b_scale)) of the scheme's competitor in torch: cuBLAS
    ``torch._scaled_mm`` per-tensor or rowwise, fast accumulation as the scheme's;
    ``torch.mm`` (cuBLAS, the scales ignored) for bf16 operands (``"none"``); None for
    block128 (torch has no 128x128 block kernel: its competitors are vLLM's)."""
    fast = accum == "fast"
    if scales == NO_SCALES:
        return ("torch.mm", lambda a, b, sa, sb: torch.mm(a, b.t()))
    if scales == "tensor":
        return (f"torch._scaled_mm {accum}", lambda a, b, sa, sb: torch._scaled_mm(
            a, b.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype, use_fast_accum=fast))
    if scales == "token":
        return (f"torch._scaled_mm rowwise {accum}", lambda a, b, sa, sb: torch._scaled_mm(
            a, b.t(), scale_a=sa.reshape(-1, 1), scale_b=sb.reshape(1, -1),
            out_dtype=out_dtype, use_fast_accum=fast))
    return None


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float32 (inf when out holds a NaN or an inf)."""
    err = float((out.float() - ref).norm() / ref.norm())
    return err if err == err else float("inf")


class CudaTimer:
    """cached.tools.tune.Timer on the current CUDA device, kernels loaded through ``client``."""

    def __init__(self, client: Client, reference: bool = True, seed: int = 0,
                 family: str = "cached.hopper_fp8") -> None:
        self.client = client
        self.reference = reference
        self.family = family
        self.gen = torch.Generator(device="cuda").manual_seed(seed)
        self.skipped: list[str] = []  # why candidates were left out, for the report

    def time(self, n: int, k: int, m: int, kernels: Sequence[KernelRequest],
             rounds: int, reduction_class: str) -> Timing:
        accum, scales = scheme_of(reduction_class)
        family = kernels[0].family if kernels else self.family
        sa, sb = operands(scales, m, n, k, self.gen)
        ab_bytes = 2 if scales == NO_SCALES else 1
        per = ab_bytes * (m * k + n * k) + 2 * m * n
        nsets = max(2, min(MAX_SETS, -(-ROTATE_BYTES // per)))
        A = [data(scales, m, k, self.gen) for _ in range(nsets)]
        B = [data(scales, n, k, self.gen) for _ in range(nsets)]
        C = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in range(nsets)]
        ref = reference(A[0], B[0], sa, sb, scales)
        floor = max(rel_err(ref.to(torch.bfloat16), ref), 1e-30)
        timing = Timing()
        launches: dict[int, Any] = {}
        first_out = None
        for i, r in enumerate(kernels):
            try:
                fn = self.client.load(r, timeout=120)
            except CachedError as exc:
                timing.left_out[i] = load_failure(exc)
                self.skipped.append(f"{n}x{k} M={m} {r.params}: {timing.left_out[i][0]} "
                                    f"({exc.code})")
                continue
            params = dict(r.params)
            ws, cnt = alloc_workspace([params], m, n, "cuda")

            def launch(j: int, fn=fn, params=params, ws=ws, cnt=cnt) -> None:
                gemm(fn, A[j], B[j], sa, sb, torch.bfloat16, C[j], params=params,
                     workspace=ws, counters=cnt)

            C[0].fill_(float("nan"))
            launch(0)
            out = C[0].clone()
            if first_out is None:
                wrong = judge(rel_err(out, ref), reduction_class, k, floor, family)
                if wrong is not None:
                    timing.left_out[i] = wrong
                    self.skipped.append(f"{n}x{k} M={m} {r.params}: {wrong[1]}")
                    continue
                first_out = out
            elif not torch.equal(out.view(torch.int16), first_out.view(torch.int16)):
                timing.left_out[i] = (NOT_BITWISE, "differs from the first correct candidate")
                self.skipped.append(f"{n}x{k} M={m} {r.params}: {NOT_BITWISE}")
                event(log, logging.WARNING, "tune.class_mismatch", n=n, k=k, m=m,
                      params=params)
                continue
            launches[i] = launch
        comp = competitor(scales, accum) if self.reference and launches else None
        if comp is not None:
            label, mm = comp
            try:
                mm(A[0], B[0], sa, sb)
            except RuntimeError as exc:  # this torch lacks the scheme's kernel
                self.skipped.append(f"{n}x{k} M={m} competitor {label}: {str(exc)[:120]}")
            else:
                timing.competitor = label
                launches[-1] = lambda j: mm(A[j], B[j], sa, sb)
        if not launches:
            return timing
        timing.rounds = time_launches(launches, nsets, rounds)
        return timing


def time_launches(launches: dict[Any, Callable[[int], Any]], nsets: int,
                  rounds: int) -> dict[Any, list[float]]:
    """Microseconds a launch, one figure a round for each of ``launches`` (``launch(j)`` runs
    on input set ``j`` of ``nsets``): each captured in a CUDA graph long enough to time
    (MIN_GRAPH_US), the graphs replayed in an order that rotates every round so none always
    runs first or last."""
    graphs = {i: _graph(f, nsets, _iters(f, nsets)) for i, f in launches.items()}
    order = list(graphs)
    out_us: dict[Any, list[float]] = {i: [] for i in graphs}
    for r in range(rounds):
        for i in order[r % len(order):] + order[:r % len(order)]:
            g, iters = graphs[i]
            e0 = torch.cuda.Event(enable_timing=True)
            e1 = torch.cuda.Event(enable_timing=True)
            e0.record()
            g.replay()
            e1.record()
            e1.synchronize()
            out_us[i].append(e0.elapsed_time(e1) * 1e3 / iters)
    return out_us


def _iters(launch: Any, nsets: int) -> int:
    """Launches per graph: enough that one replay lasts MIN_GRAPH_US (from one eager
    timing of a few launches), at least nsets, at most MAX_ITERS."""
    for j in range(nsets):
        launch(j)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for j in range(nsets):
        launch(j)
    e1.record()
    e1.synchronize()
    us = max(e0.elapsed_time(e1) * 1e3 / nsets, 1.0)
    return max(nsets, min(MAX_ITERS, int(MIN_GRAPH_US / us) + 1))


def _graph(launch: Any, nsets: int, iters: int) -> tuple[Any, int]:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for j in range(nsets):
            launch(j)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for j in range(iters):
            launch(j % nsets)
    g.replay()  # warm
    torch.cuda.synchronize()
    return g, iters
