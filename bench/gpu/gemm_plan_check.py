"""The client's batch-invariant GEMM plan core on the H200, as an inference process runs it.

For each (N, K): ``plan_gemm`` against a (serve-only) daemon (one ``prefetch``), ``load``,
then, with the tactic the plan picks per M bucket:

* correctness against a float64 reference on fresh Gaussian data, M ragged, outputs
  poisoned with NaN first;
* the seeds' method: rows of ``x[:M]`` differing bitwise from the first M rows of the
  M = 2048 output, M in {1, 2, 7, 16, 64, 128, 512, 2048} (and against M = 8192 for every
  bucket bound and a few M between buckets);
* eager against CUDA-graph replay, bitwise, at the same M;
* µs per GEMM inside CUDA graphs (inputs rotated past the 60 MB L2; CUDA-event medians),
  against ``torch._scaled_mm`` with fast accumulation on and off.

Usage (there): python gemm_plan_check.py --socket S --out DIR N,K [N,K ...]
Prints a table last; writes DIR/gemm_plan.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from cached_client import Client
from cached_client.gemm.certify import SEED_MS, differing_rows
from cached_client.gemm.plan import buckets_up_to, plan_gemm

MAX_M = 8192
PERF_MS = (1, 8, 32, 128, 512, 2048, 8192)
CORRECT_MS = (1, 7, 77, 1000, 3001, 8192)
SCALE_A, SCALE_B = 0.5, 0.25


def fp8(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(rows, cols, device="cuda", generator=gen).to(torch.float8_e4m3fn)


def poisoned(m: int, n: int) -> torch.Tensor:
    return torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")


def graph_time(launch, nsets: int, iters: int) -> float:
    """Median µs per launch over replays of a CUDA graph of ``iters`` launches cycling over
    ``nsets`` input sets."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(nsets):
            launch(i)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(iters):
            launch(i % nsets)
    g.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(7):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        samples.append(e0.elapsed_time(e1) * 1e3 / iters)
    del g
    return statistics.median(samples)


def tactic_name(p: dict) -> str:
    split = f"_s{p['splits']}{p['split_mode'][0]}" if p["splits"] > 1 else ""
    return f"{p['tile_m']}x{p['tile_n']}_c{p['cluster_m']}x{p['cluster_n']}_r{p['raster']}{split}"


def check_shape(client: Client, n: int, k: int, props, out: dict) -> None:
    gen = torch.Generator(device="cuda").manual_seed(n * 7 + k)
    t0 = time.perf_counter()
    plan = plan_gemm(client, n, k, arch="sm_90a", sm_count=props.multi_processor_count,
                     device=props.name, max_m=MAX_M, prefetch=False)
    t1 = time.perf_counter()
    prefetch = plan.prefetch(client)
    t2 = time.perf_counter()
    gemm = plan.load(client, "cuda")
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    rec = {"n": n, "k": k, "plan": plan.describe(), "class": plan.choice.reduction_class,
           "kernels": len(plan.requests), "plan_ms": (t1 - t0) * 1e3,
           "prefetch": prefetch.to_wire(), "prefetch_ms": (t2 - t1) * 1e3,
           "load_ms": (t3 - t2) * 1e3,
           "tactic_per_bucket": {b: tactic_name(gemm.tactic(b)) for b in buckets_up_to(MAX_M)}}
    print(f"{n}x{k}: {plan.describe()}", flush=True)
    a_all = fp8(MAX_M, k, gen)
    b = fp8(n, k, gen)
    sa = torch.tensor([SCALE_A], device="cuda")
    sb = torch.tensor([SCALE_B], device="cuda")

    def run(m: int) -> torch.Tensor:
        return gemm(a_all[:m], b, sa, sb, out=poisoned(m, n))

    # correctness against float64, ragged M
    errs = {}
    for m in CORRECT_MS:
        got = run(m)
        ref = (a_all[:m].double() @ b.double().T) * (SCALE_A * SCALE_B)
        nan = bool(torch.isnan(got).any())
        errs[m] = {"rel": float((got.double() - ref).norm() / ref.norm()), "nan_left": nan}
    rec["correct"] = errs
    rec["correct_ok"] = all(e["rel"] < 4e-3 and not e["nan_left"] for e in errs.values())
    # the seeds' method against M=2048, and every bucket bound (+ M between) against M=8192
    full = run(2048)
    rec["seeds_rows_differing"] = {m: differing_rows(full, run(m)) for m in SEED_MS}
    full8 = run(MAX_M)
    ms = sorted(set(buckets_up_to(MAX_M)) | {3, 5, 100, 700, 3000, 6000})
    rec["vs8192_rows_differing"] = {m: differing_rows(full8, run(m)) for m in ms}
    # scaled_mm for comparison on the seeds' method
    for fa in (True, False):
        def sm(m: int, fa=fa) -> torch.Tensor:
            return torch._scaled_mm(a_all[:m], b.t(), scale_a=sa, scale_b=sb,
                                    out_dtype=torch.bfloat16, use_fast_accum=fa)
        ref_full = sm(2048)
        rec[f"scaled_mm_fast{int(fa)}_seeds_rows_differing"] = sum(
            differing_rows(ref_full, sm(m)) for m in SEED_MS)
    # eager against CUDA-graph replay, bitwise
    graph = {}
    for m in (*SEED_MS, MAX_M):
        x = a_all[:m]
        eager = gemm(x, b, sa, sb, out=poisoned(m, n))
        gout = poisoned(m, n)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            gemm(x, b, sa, sb, out=gout)
        torch.cuda.current_stream().wait_stream(s)
        gout.fill_(float("nan"))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            gemm(x, b, sa, sb, out=gout)
        g.replay()
        g.replay()
        torch.cuda.synchronize()
        graph[m] = differing_rows(eager, gout)
        del g
    rec["graph_vs_eager_rows_differing"] = graph
    # throughput inside CUDA graphs
    perf = {}
    for m in PERF_MS:
        per = m * k + n * k + 2 * m * n
        nsets = max(2, min(16, -(-(200 << 20) // per)))
        A = [fp8(m, k, gen) for _ in range(nsets)]
        B = [fp8(n, k, gen) for _ in range(nsets)]
        C = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in range(nsets)]
        iters = 20 if m * n * k < (1 << 36) else 8
        row = {"tactic": tactic_name(gemm.tactic(m))}
        row["ours"] = graph_time(lambda i, A=A, B=B, C=C: gemm(A[i], B[i], sa, sb, out=C[i]),
                                 nsets, iters)
        for fa in (True, False):
            row[f"fast{int(fa)}"] = graph_time(
                lambda i, fa=fa, A=A, B=B: torch._scaled_mm(
                    A[i], B[i].t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                    use_fast_accum=fa), nsets, iters)
        perf[m] = row
    rec["perf"] = perf
    out["shapes"].append(rec)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("shapes", nargs="+")
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    client = Client(args.socket, timeout=120, fallback=False)
    out = {"device": props.name, "sm_count": props.multi_processor_count,
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "shapes": []}
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split(","))
        check_shape(client, n, k, props, out)
        with open(f"{args.out}/gemm_plan.json", "w") as f:
            json.dump(out, f, indent=1, default=str)
    out["daemon_stats"] = {k: client.stats()[k] for k in ("serve_only", "entries", "hits",
                                                          "misses", "compiles")}
    with open(f"{args.out}/gemm_plan.json", "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(f"\n{out['device']} ({out['sm_count']} SMs), torch {out['torch']}, {out['date']}; "
          f"daemon {out['daemon_stats']}")
    print("| N x K | class | M | tactic (plan) | ours µs | fast µs | ratio | exact µs | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in out["shapes"]:
        for m, p in r["perf"].items():
            print(f"| {r['n']}x{r['k']} | {r['class'].split('.')[2]} | {m} | {p['tactic']} | "
                  f"{p['ours']:.1f} | {p['fast1']:.1f} | {p['fast1'] / p['ours']:.2f} | "
                  f"{p['fast0']:.1f} | {p['fast0'] / p['ours']:.2f} |")
    print("\n| N x K | kernels | load ms | worst rel err | NaN left | seeds rows | vs 8192 rows "
          "| graph vs eager rows | scaled_mm seeds rows (fast/exact) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in out["shapes"]:
        worst = max(e["rel"] for e in r["correct"].values())
        nan = any(e["nan_left"] for e in r["correct"].values())
        print(f"| {r['n']}x{r['k']} | {r['kernels']} | {r['load_ms']:.0f} | {worst:.2e} | {nan} "
              f"| {sum(r['seeds_rows_differing'].values())} "
              f"| {sum(r['vs8192_rows_differing'].values())} "
              f"| {sum(r['graph_vs_eager_rows_differing'].values())} "
              f"| {r['scaled_mm_fast1_seeds_rows_differing']}/"
              f"{r['scaled_mm_fast0_seeds_rows_differing']} |")


if __name__ == "__main__":
    main()
