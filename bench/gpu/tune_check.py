"""Before and after one ``cached tune`` on the H200, as a second process sees it.

For each scheme (cached tune's names: cached.hopper_fp8's, and ``bf16``, cached.hopper_bf16's
bf16 operands; block128 is not checked here: its competitors are vLLM's) and (N, K): the
client's batch-invariant plan of that scheme (cached_client.gemm.plan.plan_gemm) twice from a
(serve-only) daemon: ``before`` without a
device name (the family's model alone: the plan order's first choice per M bucket) and
``after`` with it (the node's winners, published by ``cached tune`` in another process:
this one times nothing to choose). Then, before any timing: every bucket of ``after`` from
a winner; the after plan against a float32 reference on fresh data and the scheme's scales
(outputs poisoned with NaN first), within the class's bound at that K (cached.tools.tune.judge);
the seeds' method (rows of x[:M] differing bitwise from the first M rows of the M = 2048
output); eager equals CUDA-graph replay (bitwise, at M = 1, 77, 3001). Then per M bucket
bound (M = 1..8192): the two plans' kernels and the scheme's competitor
(cached.tools.tune_cuda.competitor: ``torch._scaled_mm`` per-tensor or rowwise, the scheme's
accumulation; ``torch.mm`` for bf16) inside CUDA graphs, inputs rotated past the L2, in interleaved
rounds (cached.tools.tune_cuda's graphs); µs medians and the ratios.

Usage (there): python tune_check.py --socket S --out DIR [--rounds R] [--schemes S,S]
    N,K [N,K ...]
Prints tables last; writes DIR/NAME.json (--name, default tune_check).
Again from the JSON: python tune_check.py summarize DIR/tune_check_*.json (one row per
scheme).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
from cached_client import Client
from cached_client.gemm.certify import SEED_MS, differing_rows
from cached_client.gemm.plan import buckets_up_to, plan_gemm

from cached.families import get as family
from cached.families.hopper_fp8 import tactic as T
from cached.tools import tune
from cached.tools.tune_cuda import (
    ROTATE_BYTES,
    competitor,
    data,
    operands,
    reference,
    rel_err,
    time_launches,
)

MAX_M = 8192


def call(g, a, b, sa, sb, out):
    """A loaded plan on one input: bf16 plans take no scales (``f(a, b)``)."""
    return g(a, b, out=out) if sa is None else g(a, b, sa, sb, out=out)


def check_shape(client: Client, n: int, k: int, props, rounds: int, scheme: str) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(n * 31 + k)
    fam = tune.scheme_family(scheme)
    opts = tune.scheme_options(fam)[scheme]
    kw = dict(arch="sm_90a", sm_count=props.multi_processor_count, max_m=MAX_M,
              prefetch=False)
    if fam == tune.BF16_FAMILY:
        scales, accum = "none", "fast"
        kw["ab_dtype"] = "bf16"
    else:
        scales, accum = opts.get("scales", "tensor"), opts.get("accumulation", "fast")
        kw |= dict(scales=scales, accumulation=accum)
    t0 = time.perf_counter()
    after = plan_gemm(client, n, k, device=props.name, **kw)
    t1 = time.perf_counter()
    before = plan_gemm(client, n, k, device=None, **kw)
    ga, gb = after.load(client, "cuda"), before.load(client, "cuda")
    cls = after.choice.reduction_class
    rec = {"n": n, "k": k, "scheme": scheme, "family": fam, "class": cls,
           "plan_ms": (t1 - t0) * 1e3,
           "after_sources": [b.source for b in after.choice.buckets],
           "after": after.describe(), "before": before.describe()}
    a_all, b = data(scales, MAX_M, k, gen), data(scales, n, k, gen)
    sa_all, sb = operands(scales, MAX_M, n, k, gen)

    def run(g, m: int) -> torch.Tensor:
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        return call(g, a_all[:m], b, sa_all[:m] if scales == "token" else sa_all, sb, out)

    errs = {}
    for m in (1, 7, 77, 1000, 3001, 8192):
        got = run(ga, m)
        ref = reference(a_all[:m], b, sa_all[:m] if scales == "token" else sa_all, sb, scales)
        floor = max(rel_err(ref.to(torch.bfloat16), ref), 1e-30)
        rel = rel_err(got, ref)
        errs[m] = {"rel": rel, "floor": floor,
                   "bound": family(fam).tune_error_bound(cls, k, floor),
                   "within": tune.judge(rel, cls, k, floor, fam) is None,
                   "nan_left": bool(torch.isnan(got).any())}
    rec["correct"] = errs
    full = run(ga, 2048)
    rec["seeds_rows_differing"] = {m: differing_rows(full, run(ga, m)) for m in SEED_MS}
    rec["eager_equals_graph"] = {m: eager_equals_graph(ga, a_all, b, sa_all, sb, scales, n, m)
                                 for m in (1, 77, 3001)}
    label, mm = competitor(scales, accum)
    rec["competitor"] = label
    perf = {}
    for m in buckets_up_to(MAX_M):
        per = (2 if scales == "none" else 1) * (m * k + n * k) + 2 * m * n
        nsets = max(2, min(16, -(-ROTATE_BYTES // per)))
        A = [data(scales, m, k, gen) for _ in range(nsets)]
        B = [data(scales, n, k, gen) for _ in range(nsets)]
        C = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in range(nsets)]
        sa = sa_all[:m] if scales == "token" else sa_all
        impls = {
            "before": lambda i, A=A, B=B, C=C, sa=sa: call(gb, A[i], B[i], sa, sb, C[i]),
            "after": lambda i, A=A, B=B, C=C, sa=sa: call(ga, A[i], B[i], sa, sb, C[i]),
            "fast": lambda i, A=A, B=B, sa=sa: mm(A[i], B[i], sa, sb),
        }
        got = time_launches(impls, nsets, rounds)
        med = {name: statistics.median(v) for name, v in got.items()}
        perf[m] = {**{f"{name}_us": v for name, v in med.items()},
                   "before_tactic": T.tactic_from_params(gb.tactic(m)).name,
                   "after_tactic": T.tactic_from_params(ga.tactic(m)).name,
                   "rounds_us": got}
    rec["perf"] = perf
    return rec


def eager_equals_graph(g, a_all, b, sa_all, sb, scales: str, n: int, m: int) -> bool:
    """The plan's output at M = ``m`` from a CUDA-graph replay equals its eager output,
    bitwise (outputs poisoned with NaN first)."""
    a = a_all[:m]
    sa = sa_all[:m] if scales == "token" else sa_all
    eager = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    call(g, a, b, sa, sb, eager)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call(g, a, b, sa, sb, out)  # warm
    torch.cuda.current_stream().wait_stream(s)
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(g, a, b, sa, sb, out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    return bool(torch.equal(eager.view(torch.int16), out.view(torch.int16)))


def _gm(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def summarize(paths: list[str]) -> None:
    """One markdown row per scheme over the runs' JSON (OUT/tune_check_*.json): geomean
    and min of competitor / ours before and after, points under 0.9x and 0.95x, and the
    checks (all within the bound, rows differing, eager = graph, buckets from winners)."""
    rows: dict[str, list[dict]] = {}
    device = ""
    for path in paths:
        with open(path) as f:
            run = json.load(f)
        device = run["device"]
        for r in run["shapes"]:
            rows.setdefault(f"{r['scheme']} vs {r['competitor']}", []).append(r)
    print(f"{device}\n")
    print("| scheme vs competitor | shapes | points | before: geomean (min), < 0.9, < 0.95 | "
          "after | within bound | rows differ | eager = graph | from winners |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, rs in rows.items():
        cells = []
        for when in ("before", "after"):
            xs = [p["fast_us"] / p[f"{when}_us"] for r in rs for p in r["perf"].values()]
            cells.append(f"{_gm(xs):.3f} ({min(xs):.2f}), {sum(x < 0.9 for x in xs)}, "
                         f"{sum(x < 0.95 for x in xs)}")
        npts = sum(len(r["perf"]) for r in rs)
        within = all(e["within"] for r in rs for e in r["correct"].values())
        differ = sum(sum(r["seeds_rows_differing"].values()) for r in rs)
        eager = all(all(r["eager_equals_graph"].values()) for r in rs)
        won = sum(r["after_sources"].count("autotune") for r in rs)
        total = sum(len(r["after_sources"]) for r in rs)
        shapes = ", ".join(f"{r['n']}x{r['k']}" for r in rs)
        print(f"| {name} | {shapes} | {npts} | {cells[0]} | {cells[1]} | {within} | {differ} "
              f"| {eager} | {won}/{total} |")


def main() -> None:
    import sys

    if sys.argv[1:2] == ["summarize"]:
        summarize(sys.argv[2:])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--schemes", default=tune.DEFAULT_SCHEME)
    ap.add_argument("--name", default="tune_check", help="writes OUT/NAME.json")
    ap.add_argument("shapes", nargs="+")
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    client = Client(args.socket, timeout=120, fallback=False)
    out = {"device": props.name, "sm_count": props.multi_processor_count,
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "shapes": []}
    for scheme in tune.check_schemes(args.schemes.split(",")):
        if scheme == "block128":
            print("block128: not checked here (its competitors are vLLM's)")
            continue
        for shape in args.shapes:
            n, k = (int(v) for v in shape.split(","))
            out["shapes"].append(check_shape(client, n, k, props, args.rounds, scheme))
            with open(f"{args.out}/{args.name}.json", "w") as f:
                json.dump(out, f, indent=1, default=str)
    print(f"\n{out['device']} ({out['sm_count']} SMs), torch {out['torch']}, {out['date']}")
    print("| scheme | N x K | class | from winners | plan ms | worst rel err (bound) | "
          "all within | NaN left | seeds rows | eager = graph |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in out["shapes"]:
        worst = max(r["correct"].values(), key=lambda e: e["rel"] / e["bound"])
        print(f"| {r['scheme']} | {r['n']}x{r['k']} | {r['class']} | "
              f"{r['after_sources'].count('autotune')}/{len(r['after_sources'])} | "
              f"{r['plan_ms']:.0f} | {worst['rel']:.2e} ({worst['bound']:.2e}) | "
              f"{all(e['within'] for e in r['correct'].values())} | "
              f"{any(e['nan_left'] for e in r['correct'].values())} | "
              f"{sum(r['seeds_rows_differing'].values())} | "
              f"{all(r['eager_equals_graph'].values())} |")
    print("\ncompetitor / ours (the scheme's competitor's time over the plan's)")
    print("| scheme | N x K | M | before tactic | before | after tactic | after | "
          "after/before time |")
    print("|---|---|---|---|---|---|---|---|")
    per_scheme: dict[str, tuple[list, list]] = {}
    for r in out["shapes"]:
        allb, alla = per_scheme.setdefault(f"{r['scheme']} ({r['competitor']})", ([], []))
        for m, p in r["perf"].items():
            rb, ra = p["fast_us"] / p["before_us"], p["fast_us"] / p["after_us"]
            allb.append(rb)
            alla.append(ra)
            print(f"| {r['scheme']} | {r['n']}x{r['k']} | {m} | {p['before_tactic']} | "
                  f"{rb:.2f} | {p['after_tactic']} | {ra:.2f} | "
                  f"{p['after_us'] / p['before_us']:.3f} |")
    for name, (allb, alla) in per_scheme.items():
        print(f"\n{name}:")
        for when, xs in (("before", allb), ("after", alla)):
            print(f"  {when + ':':<7} geomean {_gm(xs):.3f}, min {min(xs):.2f}, under 0.9: "
                  f"{sum(x < 0.9 for x in xs)}, under 0.95: {sum(x < 0.95 for x in xs)} "
                  f"of {len(xs)}")


if __name__ == "__main__":
    main()
