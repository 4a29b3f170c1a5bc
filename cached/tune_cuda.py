"""The timing core of ``cached tune`` (cached.tune.Timer) on a CUDA device; imports torch.

For one (N, K) and M: each candidate is loaded through the client (``Client.load``: from
the daemon's store; a serve-only daemon answers only what it holds, and a candidate it
lacks is left out); its output on fresh Gaussian FP8 data is checked (the first candidate
against a float32 reference, relative error under MAX_REL_ERR; every other one bitwise
equal to the first: one reduction-order class computes the same bits) before any timing.
Each kernel, and ``torch._scaled_mm`` with fast accumulation (the competitor, key -1), is
captured in a CUDA graph of ``iters`` launches cycling over input sets that together
exceed the L2 (ROTATE_BYTES), then timed in interleaved rounds: each round replays every
graph once, in an order rotated by one per round, timed by CUDA events; a round's figure
is µs per launch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from cached_client.errors import CachedError
from cached_client.gemm.hopper_fp8 import alloc_workspace, gemm
from cached_client.keys import KernelRequest

from .log import event

log = logging.getLogger("cached.tune")

ROTATE_BYTES = 200 << 20  # input sets per graph cover this much (the H200's L2: 60 MB)
MAX_SETS = 16
MAX_REL_ERR = 4e-3  # fast-accumulation grade (docs/design.md)
SCALE_A, SCALE_B = 0.5, 0.25
MIN_GRAPH_US = 2000.0  # a replay lasts at least this long (event resolution, launch noise)
MAX_ITERS = 50


class CudaTimer:
    """cached.tune.Timer on the current CUDA device, kernels loaded through ``client``."""

    def __init__(self, client: Any, reference: bool = True, seed: int = 0) -> None:
        self.client = client
        self.reference = reference
        self.gen = torch.Generator(device="cuda").manual_seed(seed)
        self.skipped: list[str] = []  # why candidates were left out, for the report

    def _fp8(self, rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, device="cuda", generator=self.gen).to(
            torch.float8_e4m3fn)

    def time(self, n: int, k: int, m: int, kernels: Sequence[KernelRequest],
             rounds: int) -> dict[int, list[float]]:
        sa = torch.tensor([SCALE_A], device="cuda")
        sb = torch.tensor([SCALE_B], device="cuda")
        per = m * k + n * k + 2 * m * n
        nsets = max(2, min(MAX_SETS, -(-ROTATE_BYTES // per)))
        A = [self._fp8(m, k) for _ in range(nsets)]
        B = [self._fp8(n, k) for _ in range(nsets)]
        C = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in range(nsets)]
        launches: dict[int, Any] = {}
        first_out = None
        for i, r in enumerate(kernels):
            try:
                fn = self.client.load(r, timeout=120)
            except CachedError as exc:
                self.skipped.append(f"{n}x{k} M={m} {r.params}: {exc.code}")
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
                ref = (A[0].float() @ B[0].float().T) * (SCALE_A * SCALE_B)
                err = float((out.float() - ref).norm() / ref.norm())
                if not err < MAX_REL_ERR:
                    self.skipped.append(f"{n}x{k} M={m} {r.params}: rel err {err:.2e}")
                    continue
                first_out = out
            elif not torch.equal(out.view(torch.int16), first_out.view(torch.int16)):
                self.skipped.append(f"{n}x{k} M={m} {r.params}: not bitwise equal to the "
                                    "first candidate of its class")
                event(log, logging.WARNING, "tune.class_mismatch", n=n, k=k, m=m,
                      params=params)
                continue
            launches[i] = launch
        if self.reference and launches:
            def ref_launch(j: int) -> None:
                torch._scaled_mm(A[j], B[j].t(), scale_a=sa, scale_b=sb,
                                 out_dtype=torch.bfloat16, use_fast_accum=True)

            launches[-1] = ref_launch
        if not launches:
            return {}
        graphs = {i: _graph(f, nsets, _iters(f, nsets)) for i, f in launches.items()}
        order = list(graphs)
        out: dict[int, list[float]] = {i: [] for i in graphs}
        for r in range(rounds):
            for i in order[r % len(order):] + order[:r % len(order)]:
                g, iters = graphs[i]
                e0 = torch.cuda.Event(enable_timing=True)
                e1 = torch.cuda.Event(enable_timing=True)
                e0.record()
                g.replay()
                e1.record()
                e1.synchronize()
                out[i].append(e0.elapsed_time(e1) * 1e3 / iters)
        del graphs
        return out


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
