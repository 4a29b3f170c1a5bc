#!/usr/bin/env python3
"""vLLM 0.33.0's own BF16 GEMM paths on the GPU (issue 36's baseline): bf16 x bf16 -> bf16,
y = x @ w.T with w (N, K) row-major as a linear layer holds it.

Methods (one process each, so each sees its own cuBLAS settings from the start):
  torch   torch.mm, cuBLAS as torch picks it by default (vLLM's default BF16 path).
  lt      torch.mm under vLLM's batch-invariant settings on SM90/SM100
          (``enable_batch_invariant_mode``): CUBLAS_WORKSPACE_CONFIG=:16:8 and
          CUBLASLT_WORKSPACE_SIZE=1 set before CUDA initializes, reduced-precision bf16
          reductions off, cuBLASLt as the preferred BLAS library.
  triton  vLLM's ``matmul_persistent`` (the kernel ``UnquantizedLinearMethod`` and the lm_head
          run under VLLM_BATCH_INVARIANT=1), from vLLM's own file through vllm_bi_shim.py,
          called as ``linear_batch_invariant`` calls it (b = weight.t()).

Per point: GPU time per call, the median of 5 CUDA-event-timed replays of a CUDA graph of
``iters`` calls cycling over input sets whose weights together pass 128 MiB (past L2); the
graph's last output equals an eager call's, bitwise. Per shape: the seeds' method (each M's
output against the first M rows of the largest M's, bitwise: rows differing) and the error
of 64 rows against float64.

  python bf16_baseline.py run --method torch|lt|triton --out FILE [--bi-dir DIR]
  python bf16_baseline.py warm --bi-dir DIR --shape N,K   (Triton: compile every M once)
  python bf16_baseline.py table FILE...                   (markdown tables)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

# (N, K): Llama-3.1-8B qkv, o, gate_up, down; Qwen2.5-7B qkv, o, gate_up, down; lm_heads
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
          (4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944),
          (128256, 4096), (152064, 3584)]
NAMES = {(6144, 4096): "L qkv", (4096, 4096): "L o", (28672, 4096): "L gate_up",
         (4096, 14336): "L down", (4608, 3584): "Q qkv", (3584, 3584): "Q o",
         (37888, 3584): "Q gate_up", (3584, 18944): "Q down", (128256, 4096): "L lm_head",
         (152064, 3584): "Q lm_head"}
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
ROTATE_BYTES = 128 << 20
TARGET_S = 2e-3  # GPU time a graph replay aims at
REPS = 5
LT_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "1"}


def _set_lt_env() -> None:
    if "torch" in sys.modules:
        raise SystemExit("lt: the cuBLAS settings must be set before torch is imported")
    os.environ.update(LT_ENV)


def _gemm(method: str, bi_dir: str | None):
    import torch

    if method in ("torch", "lt"):
        if method == "lt":
            # what enable_batch_invariant_mode does on SM90/SM100 beside the env
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = (False, False)
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = (False, False)
            torch.backends.cuda.preferred_blas_library(backend="cublaslt")
        return lambda x, w: torch.mm(x, w.t())
    if method == "triton":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import vllm_bi_shim

        bi = vllm_bi_shim.load(bi_dir or Path(__file__).resolve().parent / "vllm_bi")
        return lambda x, w: bi.matmul_persistent(x, w.t())
    raise SystemExit(f"method is torch, lt or triton, not {method!r}")


def _data(n: int, k: int, sets: int, seed: int):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    ws = [(torch.randn(n, k, device="cuda", generator=g) / math.sqrt(k)).to(torch.bfloat16)
          for _ in range(sets)]
    x = torch.randn(MS[-1], k, device="cuda", generator=g).to(torch.bfloat16)
    return ws, x


def _graph(launch, nsets: int, iters: int):
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(nsets):
            launch(i)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    out = []
    with torch.cuda.graph(g):
        for i in range(iters):
            y = launch(i % nsets)
        out.append(y)
    g.replay()
    torch.cuda.synchronize()
    return g, out[0]


def _replay_us(g, iters: int) -> float:
    import torch

    samples = []
    for _ in range(REPS):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        samples.append(e0.elapsed_time(e1) * 1e3 / iters)
    return statistics.median(samples)


def _rows_differ(a, b) -> int:
    return int((a != b).any(dim=1).sum().item())


def run(args: argparse.Namespace) -> None:
    if args.method == "lt":
        _set_lt_env()
    import torch

    gemm = _gemm(args.method, args.bi_dir)
    dev = torch.cuda.get_device_name()
    out = Path(args.out)
    shapes = [tuple(map(int, s.split(","))) for s in args.shapes] if args.shapes else SHAPES
    ms = [int(m) for m in args.ms.split(",")] if args.ms else MS
    with out.open("a") as f:
        for si, (n, k) in enumerate(shapes):
            t0 = time.perf_counter()
            wbytes = n * k * 2
            sets = max(2, math.ceil(ROTATE_BYTES / wbytes))
            ws, x = _data(n, k, sets, seed=si)
            # the seeds' method against the largest M, and the error of 64 rows vs float64
            full = gemm(x, ws[0])
            ref = (x[:64].double() @ ws[0].double().t())
            err = float(((full[:64].double() - ref).abs().max() / ref.abs().max()).item())
            diff = {m: _rows_differ(gemm(x[:m], ws[0]), full[:m]) for m in ms}
            del full, ref
            for m in ms:
                xs = [x[:m].clone() for _ in range(sets)]
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                gemm(xs[0], ws[0])
                e0.record()
                gemm(xs[1 % sets], ws[1 % sets])
                e1.record()
                e1.synchronize()
                est = e0.elapsed_time(e1) * 1e-3
                iters = min(256, max(sets, math.ceil(TARGET_S / max(est, 1e-6))))
                iters = math.ceil(iters / sets) * sets

                def launch(i: int, xs=xs, ws=ws):
                    return gemm(xs[i], ws[i])

                g, last = _graph(launch, sets, iters)
                us = _replay_us(g, iters)
                eq = bool(torch.equal(last, gemm(xs[(iters - 1) % sets], ws[(iters - 1) % sets])))
                del g, last, xs
                row = dict(method=args.method, device=dev, n=n, k=k, m=m, us=round(us, 3),
                           tflops=round(2 * m * n * k / us * 1e-6, 1), rows_differ=diff[m],
                           graph_eq_eager=eq, iters=iters, sets=sets,
                           err_vs_f64=err if m == ms[-1] else None)
                f.write(json.dumps(row) + "\n")
                f.flush()
            del ws, x
            torch.cuda.empty_cache()
            print(f"{args.method} {n}x{k}: {time.perf_counter() - t0:.1f} s, rows differing "
                  f"{sum(diff.values())} (M {[m for m, d in diff.items() if d]}), "
                  f"err {err:.2e}", flush=True)


def warm(args: argparse.Namespace) -> None:
    import torch

    gemm = _gemm("triton", args.bi_dir)
    n, k = map(int, args.shape.split(","))
    ws, x = _data(n, k, 1, seed=0)
    for m in MS:
        gemm(x[:m].clone(), ws[0])
    torch.cuda.synchronize()


def table(args: argparse.Namespace) -> None:
    rows = [json.loads(line) for p in args.files for line in Path(p).read_text().splitlines()
            if line.strip()]
    by = {(r["method"], r["n"], r["k"], r["m"]): r for r in rows}
    shapes = list(dict.fromkeys((r["n"], r["k"]) for r in rows))
    ms = sorted({r["m"] for r in rows})
    devs = sorted({r["device"] for r in rows})
    print(f"device: {', '.join(devs)}\n")
    head = "| N x K | " + " | ".join(str(m) for m in ms) + " |"
    sep = "|---|" + "---|" * len(ms)

    def grid(title: str, cell) -> None:
        print(f"{title}\n\n{head}\n{sep}")
        for n, k in shapes:
            cells = [cell(n, k, m) for m in ms]
            print(f"| {NAMES.get((n, k), '')} {n}x{k} | " + " | ".join(cells) + " |")
        print()

    def us(meth):
        return lambda n, k, m: (f"{by[(meth, n, k, m)]['us']:.1f}"
                                if (meth, n, k, m) in by else "-")

    def ratio(meth):
        def f(n, k, m):
            a, b = by.get(("torch", n, k, m)), by.get((meth, n, k, m))
            return f"{a['us'] / b['us']:.2f}" if a and b else "-"
        return f

    grid("torch.mm (cuBLAS default), us per call", us("torch"))
    for meth, what in (("lt", "cuBLASLt under vLLM's batch-invariant settings"),
                       ("triton", "vLLM's matmul_persistent")):
        grid(f"{what}: torch.mm time / its time (> 1 faster than torch.mm)", ratio(meth))
    print("rows differing by the seeds' method (x[:M] against the first M rows of "
          f"M={ms[-1]}), summed over M; the M that differ; graph replay == eager; error of "
          "64 rows against float64 (max |err| / max |ref|)\n")
    print("| N x K | torch.mm | cuBLASLt BI | matmul_persistent |\n|---|---|---|---|")
    for n, k in shapes:
        cells = []
        for meth in ("torch", "lt", "triton"):
            rs = [by[(meth, n, k, m)] for m in ms if (meth, n, k, m) in by]
            if not rs:
                cells.append("-")
                continue
            bad = [r["m"] for r in rs if r["rows_differ"]]
            eq = all(r["graph_eq_eager"] for r in rs)
            errs = [r["err_vs_f64"] for r in rs if r.get("err_vs_f64") is not None]
            cells.append(f"{sum(r['rows_differ'] for r in rs)} rows"
                         f"{' (M ' + ','.join(map(str, bad)) + ')' if bad else ''}; "
                         f"graph{'=' if eq else '!='}eager; "
                         f"{errs[0]:.1e}" if errs else "-")
        print(f"| {NAMES.get((n, k), '')} {n}x{k} | " + " | ".join(cells) + " |")
    for meth in ("lt", "triton"):
        rs = [ratio(meth)(n, k, m) for n, k in shapes for m in ms]
        vals = [float(v) for v in rs if v != "-"]
        if vals:
            gm = math.exp(sum(map(math.log, vals)) / len(vals))
            print(f"\n{meth}: geomean torch.mm/it {gm:.3f} over {len(vals)} points, "
                  f"min {min(vals):.2f}, max {max(vals):.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--method", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--bi-dir")
    r.add_argument("--shapes", nargs="*")
    r.add_argument("--ms")
    w = sub.add_parser("warm")
    w.add_argument("--bi-dir")
    w.add_argument("--shape", required=True)
    t = sub.add_parser("table")
    t.add_argument("files", nargs="+")
    args = p.parse_args()
    {"run": run, "warm": warm, "table": table}[args.cmd](args)


if __name__ == "__main__":
    main()
