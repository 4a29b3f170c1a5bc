"""Before and after one ``cached tune`` on the H200, as a second process sees it.

For each scheme (cached tune's names: cached.hopper_fp8's, and ``bf16``, cached.hopper_bf16's
bf16 operands) and (N, K): the client's batch-invariant plan of that scheme
(cached_client.gemm.plan.plan_gemm) twice from a (serve-only) daemon: ``before`` without a
device name (the family's model alone: the plan order's first choice per M bucket) and
``after`` with it (the node's winners, published by ``cached tune`` in another process:
this one times nothing to choose). Then, before any timing: every bucket of ``after`` from
a winner; the after plan against a float32 reference on fresh data and the scheme's scales
(outputs poisoned with NaN first), within the class's bound at that K (cached.tools.tune.judge);
the seeds' method (rows of x[:M] differing bitwise from the first M rows of the M = 2048
output); eager equals CUDA-graph replay (bitwise, at M = 1, 77, 3001). Then per M bucket
bound (M = 1..8192): the two plans' kernels and the scheme's competitors inside CUDA graphs,
inputs rotated past the L2, in interleaved rounds (cached.tools.tune_cuda.time_launches);
µs medians and the ratios against the faster competitor (``best`` per point).

Competitors: torch's (cached.tools.tune_cuda.competitor: ``torch._scaled_mm`` per-tensor or
rowwise, the scheme's accumulation; ``torch.mm`` for bf16) and, with ``--vllm-so`` (vLLM
0.33.0's _C_stable_libtorch.abi3.so), vLLM's CUTLASS ``cutlass_scaled_mm``
(bench/gpu/vllm_cutlass.py) for tensor-fast and token-fast beside torch's, and its blockwise
kernel for block128 (which torch lacks: without the .so block128 is not checked). vLLM's
output is checked against the same reference first (relative error within the bound of its
scheme's S = 1 class: one accumulator over K); a wrong call is left out of the timing, and
said (block128, with no other competitor, is then not timed). Without the .so everything
else runs as before.

Usage (there): python tune_check.py --socket S --out DIR [--rounds R] [--schemes S,S]
    [--vllm-so PATH --vllm-sha256 HEX] N,K [N,K ...]
Prints tables last; writes DIR/NAME.json (--name, default tune_check).
vLLM's op alone, first: python tune_check.py smoke --vllm-so PATH --vllm-sha256 HEX (relative
errors per scheme; run_tune.sh runs it before tune_check, which checks vLLM per shape too).
Again from the JSON: python tune_check.py summarize DIR/tune_check_*.json (one row per
scheme; older JSONs too: per-tensor fast against torch, no bound or graph check recorded).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from types import ModuleType

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
CHECK_MS = (1, 7, 77, 1000, 3001, 8192)
TORCH, VLLM = "torch", "vllm"  # the competitors' keys (a point's "best")
OLD_SCHEME, OLD_COMPETITOR = "tensor-fast", "torch._scaled_mm fast"  # JSONs before schemes


def call(g, a, b, sa, sb, out):
    """A loaded plan on one input: bf16 plans take no scales (``f(a, b)``)."""
    return g(a, b, out=out) if sa is None else g(a, b, sa, sb, out=out)


def rows_of(sa_all, m: int, scales: str):
    """The activation scales of the first ``m`` rows as a client passes them: per-token
    ``sa_all[:m]``; block128 the first ``m`` rows column-major, strides (1, m) (what the
    launcher and vLLM read); per-tensor (and bf16's None) ``sa_all`` itself."""
    if scales == "token":
        return sa_all[:m]
    if scales == "block128":
        return sa_all[:m].t().contiguous().t()
    return sa_all


def load_vllm(path: str | None, sha256: str | None) -> tuple[ModuleType | None, str]:
    """(bench/gpu/vllm_cutlass.py with vLLM's _C loaded from ``path``, "") or (None, why
    not). The library's bytes must hash to ``sha256`` (vllm_cutlass.load). The module,
    beside this script, is imported only when a path is given."""
    if not path:
        return None, "no --vllm-so given"
    import vllm_cutlass

    why = vllm_cutlass.load(path, sha256)
    return (None, why) if why else (vllm_cutlass, "")


def vllm_error(vllm: ModuleType, scales: str, accum: str, a, b, sa, sb, ref, floor: float
               ) -> dict:
    """vLLM's output on (a, b, sa, sb) (poisoned with NaN first) against ``ref``: its
    relative error, the floor, the bound of the scheme's S = 1 class at that K (vLLM's
    kernel walks K with one accumulator) and whether it is within."""
    k = a.shape[1]
    out = torch.full((a.shape[0], b.shape[0]), float("nan"), dtype=torch.bfloat16,
                     device=a.device)
    vllm.scaled_mm(a, b, sa, sb, out, scales)
    rel = rel_err(out, ref)
    bound = family(tune.FAMILY).tune_error_bound(T.reduction_class_id(1, accum, scales), k,
                                                 floor)
    return {"rel": rel, "floor": floor, "bound": bound, "within": rel <= bound}


def smoke(vllm: ModuleType, n: int = 2112, k: int = 7168) -> bool:
    """vLLM's op on each scheme it computes at M = 1 and 77 (N = 2112: a partial weight
    block) against the float32 reference, printed; whether all were within the bound."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    ok = True
    for (scales, accum), label in vllm.SCHEMES.items():
        for m in (1, 77):
            a, b = data(scales, m, k, gen), data(scales, n, k, gen)
            sa, sb = operands(scales, m, n, k, gen)
            ref = reference(a, b, sa, sb, scales)
            floor = max(rel_err(ref.to(torch.bfloat16), ref), 1e-30)
            try:
                e = vllm_error(vllm, scales, accum, a, b, sa, sb, ref, floor)
            except RuntimeError as exc:
                print(f"vLLM smoke {label} {scales} M={m} N={n} K={k}: FAILED {exc}")
                ok = False
                continue
            ok &= e["within"]
            print(f"vLLM smoke {label} {scales} M={m} N={n} K={k}: rel err {e['rel']:.3e} "
                  f"(floor {floor:.3e}, bound {e['bound']:.3e}) "
                  f"{'ok' if e['within'] else 'WRONG'}", flush=True)
    return ok


def check_shape(client: Client, n: int, k: int, props, rounds: int, scheme: str,
                vllm: ModuleType | None = None) -> dict:
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
        return call(g, a_all[:m], b, rows_of(sa_all, m, scales), sb, out)

    vrec = None
    if vllm is not None and (scales, accum) in vllm.SCHEMES:
        vrec = {"label": vllm.label(scales, accum), "correct": {}}
        if not vllm.covers(scales, accum, n, k):
            vrec["left_out"] = "vLLM takes its Triton fallback here (N or K % 16 != 0)"
        rec["vllm"] = vrec
    errs = {}
    for m in CHECK_MS:
        got = run(ga, m)
        sa = rows_of(sa_all, m, scales)
        ref = reference(a_all[:m], b, sa, sb, scales)
        floor = max(rel_err(ref.to(torch.bfloat16), ref), 1e-30)
        rel = rel_err(got, ref)
        errs[m] = {"rel": rel, "floor": floor,
                   "bound": family(fam).tune_error_bound(cls, k, floor),
                   "within": tune.judge(rel, cls, k, floor, fam) is None,
                   "nan_left": bool(torch.isnan(got).any())}
        if vrec is not None and "left_out" not in vrec:
            try:
                vrec["correct"][m] = vllm_error(vllm, scales, accum, a_all[:m], b, sa, sb,
                                                ref, floor)
            except RuntimeError as exc:
                vrec["left_out"] = f"the call failed at M={m}: {str(exc)[:300]}"
    rec["correct"] = errs
    if vrec is not None:
        bad = [(m, e) for m, e in vrec["correct"].items() if not e["within"]]
        if bad and "left_out" not in vrec:
            m, e = bad[0]
            vrec["left_out"] = (f"wrong results: rel err {e['rel']:.2e} over the bound "
                                f"{e['bound']:.2e} at M={m}")
        if "left_out" in vrec:
            print(f"{scheme} {n}x{k}: {vrec['label']} left out of the timing: "
                  f"{vrec['left_out']}", flush=True)
    full = run(ga, 2048)
    rec["seeds_rows_differing"] = {m: differing_rows(full, run(ga, m)) for m in SEED_MS}
    rec["eager_equals_graph"] = {m: eager_equals_graph(ga, a_all, b, sa_all, sb, scales, n, m)
                                 for m in (1, 77, 3001)}
    comps = {}  # key: (label, fn(a, b, a_scale, b_scale, out))
    torch_comp = competitor(scales, accum)
    if torch_comp is not None:
        comps[TORCH] = (torch_comp[0], lambda a, b, sa, sb, out, mm=torch_comp[1]: mm(a, b, sa, sb))
    if vrec is not None and "left_out" not in vrec:
        comps[VLLM] = (vrec["label"], lambda a, b, sa, sb, out: vllm.scaled_mm(
            a, b, sa, sb, out, scales))
    labels = {key: label for key, (label, _) in comps.items()}
    rec["competitor"] = (f"faster of {labels[TORCH]} and {labels[VLLM]}" if len(labels) == 2
                         else next(iter(labels.values()), None))
    if vrec is not None:
        rec["competitors"] = labels
    rec["perf"] = perf(ga, gb, comps, scales, n, k, rounds, sa_all, sb, gen) if comps else {}
    return rec


def perf(ga, gb, comps: dict, scales: str, n: int, k: int, rounds: int, sa_all, sb, gen
         ) -> dict:
    """Per M bucket bound: µs medians of the two plans and the competitors (torch's as
    ``fast_us``, vLLM's as ``vllm_us``; with vLLM, ``best`` names the faster one and
    ``best_us`` is its time), the plans' tactics, every round's figures."""
    out = {}
    for m in buckets_up_to(MAX_M):
        per = (2 if scales == "none" else 1) * (m * k + n * k) + 2 * m * n
        nsets = max(2, min(16, -(-ROTATE_BYTES // per)))
        A = [data(scales, m, k, gen) for _ in range(nsets)]
        B = [data(scales, n, k, gen) for _ in range(nsets)]
        C = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in range(nsets)]
        sa = rows_of(sa_all, m, scales)
        impls = {
            "before": lambda i, A=A, B=B, C=C, sa=sa: call(gb, A[i], B[i], sa, sb, C[i]),
            "after": lambda i, A=A, B=B, C=C, sa=sa: call(ga, A[i], B[i], sa, sb, C[i]),
        }
        for key, (_, fn) in comps.items():
            impls["fast" if key == TORCH else key] = (
                lambda i, fn=fn, A=A, B=B, C=C, sa=sa: fn(A[i], B[i], sa, sb, C[i]))
        got = time_launches(impls, nsets, rounds)
        med = {name: statistics.median(v) for name, v in got.items()}
        point = {**{f"{name}_us": v for name, v in med.items()},
                 "before_tactic": T.tactic_from_params(gb.tactic(m)).name,
                 "after_tactic": T.tactic_from_params(ga.tactic(m)).name,
                 "rounds_us": got}
        if VLLM in comps:
            point["best"], point["best_us"] = best_of(med)
        out[m] = point
    return out


def best_of(med: dict[str, float]) -> tuple[str, float]:
    """(key, µs) of the faster competitor among a point's medians (torch's under "fast",
    vLLM's under "vllm"; the plans' "before" and "after" are not competitors)."""
    times = {key: med[name] for key, name in ((TORCH, "fast"), (VLLM, VLLM)) if name in med}
    best = min(times, key=times.get)
    return best, times[best]


def eager_equals_graph(g, a_all, b, sa_all, sb, scales: str, n: int, m: int) -> bool:
    """The plan's output at M = ``m`` from a CUDA-graph replay equals its eager output,
    bitwise (outputs poisoned with NaN first)."""
    a = a_all[:m]
    sa = rows_of(sa_all, m, scales)
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


def competitor_us(p: dict) -> float:
    """A point's competitor time: the faster competitor's (``best_us``), else torch's (a
    run without vLLM, and every JSON before it)."""
    return p.get("best_us", p.get("fast_us"))


def winner(p: dict) -> str:
    """Which competitor a point's ratio is against: ``best``, else torch's."""
    return p.get("best", TORCH)


def _gm(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def _ratios(rs: list[dict], when: str) -> list[float]:
    return [competitor_us(p) / p[f"{when}_us"] for r in rs for p in r["perf"].values()]


def _all(values: list) -> bool | str:
    """all(values), or "n/a" when one of them was not recorded (None: an older JSON)."""
    return "n/a" if any(v is None for v in values) else all(values)


def summary_rows(runs: list[dict]) -> list[dict]:
    """One row per (scheme, competitor) over runs' JSON (tune_check's ``out``): the points'
    competitor / ours before and after, which competitor was faster per point, and the
    checks. Older JSONs (no scheme, no bound or graph check) count as per-tensor fast
    against torch, their unrecorded checks as "n/a"."""
    groups: dict[str, list[dict]] = {}
    for run in runs:
        for r in run["shapes"]:
            comp = r.get("competitor", OLD_COMPETITOR) or "no competitor"
            name = f"{r.get('scheme', OLD_SCHEME)} vs {comp}"
            groups.setdefault(name, []).append(r)
    rows = []
    for name, rs in groups.items():
        pts = [p for r in rs for p in r["perf"].values()]
        won: dict[str, int] = {}
        for p in pts:
            won[winner(p)] = won.get(winner(p), 0) + 1
        vllm = [e for r in rs for e in r.get("vllm", {}).get("correct", {}).values()]
        rows.append({
            "name": name, "shapes": [f"{r['n']}x{r['k']}" for r in rs], "points": len(pts),
            "before": _ratios(rs, "before"), "after": _ratios(rs, "after"), "won": won,
            "within": _all([e.get("within") for r in rs for e in r["correct"].values()]),
            "rows_differ": sum(sum(r["seeds_rows_differing"].values()) for r in rs),
            "eager": _all([all(r["eager_equals_graph"].values())
                           if "eager_equals_graph" in r else None for r in rs]),
            "from_winners": (sum(r["after_sources"].count("autotune") for r in rs),
                             sum(len(r["after_sources"]) for r in rs)),
            "vllm_worst_rel": max((e["rel"] for e in vllm), default=None),
            "vllm_left_out": [f"{r['n']}x{r['k']}: {r['vllm']['left_out']}" for r in rs
                              if "left_out" in r.get("vllm", {})]})
    return rows


def _cell(xs: list[float]) -> str:
    if not xs:
        return "no competitor timed"
    return (f"{_gm(xs):.3f} ({min(xs):.2f}), {sum(x < 0.9 for x in xs)}, "
            f"{sum(x < 0.95 for x in xs)}")


def summarize(paths: list[str]) -> None:
    """One markdown row per scheme over the runs' JSON (OUT/tune_check_*.json): geomean
    and min of competitor / ours before and after, points under 0.9x and 0.95x, which
    competitor was the faster per point, and the checks (all within the bound, rows
    differing, eager = graph, buckets from winners)."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    print(f"{runs[-1]['device'] if runs else ''}\n")
    print("| scheme vs competitor | shapes | points | before: geomean (min), < 0.9, < 0.95 | "
          "after | faster competitor | within bound | rows differ | eager = graph | "
          "from winners |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in summary_rows(runs):
        won = ", ".join(f"{k} {v}" for k, v in sorted(row["won"].items()))
        print(f"| {row['name']} | {', '.join(row['shapes'])} | {row['points']} | "
              f"{_cell(row['before'])} | {_cell(row['after'])} | {won or '-'} | "
              f"{row['within']} | {row['rows_differ']} | {row['eager']} | "
              f"{row['from_winners'][0]}/{row['from_winners'][1]} |")
    for row in summary_rows(runs):
        if row["vllm_worst_rel"] is not None or row["vllm_left_out"]:
            worst = row["vllm_worst_rel"]
            print(f"\n{row['name']}: vLLM's worst rel err "
                  f"{'-' if worst is None else f'{worst:.2e}'}"
                  + "".join(f"; left out {x}" for x in row["vllm_left_out"]))


def report(out: dict) -> None:
    """The run's tables (printed last): checks per shape, vLLM's errors, competitor / ours
    per point and per scheme."""
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
    vl = [r for r in out["shapes"] if "vllm" in r]
    if vl:
        print("\nvLLM's CUTLASS against the same reference (bound: its scheme's S = 1 class)")
        print("| scheme | N x K | worst rel err (bound) | all within | timed |")
        print("|---|---|---|---|---|")
        for r in vl:
            v = r["vllm"]
            es = list(v["correct"].values())
            worst = max(es, key=lambda e: e["rel"] / e["bound"]) if es else None
            print(f"| {r['scheme']} | {r['n']}x{r['k']} | " + (
                f"{worst['rel']:.2e} ({worst['bound']:.2e})" if worst else "-")
                + f" | {all(e['within'] for e in es) if es else '-'} | "
                f"{v.get('left_out', 'yes')} |")
    print("\ncompetitor / ours (the faster competitor's time over the plan's)")
    print("| scheme | N x K | M | before tactic | before | after tactic | after | "
          "after/before time | competitor |")
    print("|---|---|---|---|---|---|---|---|---|")
    per_scheme: dict[str, tuple[list, list, dict]] = {}
    for r in out["shapes"]:
        allb, alla, won = per_scheme.setdefault(f"{r['scheme']} ({r['competitor']})",
                                                ([], [], {}))
        for m, p in r["perf"].items():
            c = competitor_us(p)
            rb, ra = c / p["before_us"], c / p["after_us"]
            allb.append(rb)
            alla.append(ra)
            won[winner(p)] = won.get(winner(p), 0) + 1
            both = ("fast_us" in p and "vllm_us" in p)
            print(f"| {r['scheme']} | {r['n']}x{r['k']} | {m} | {p['before_tactic']} | "
                  f"{rb:.2f} | {p['after_tactic']} | {ra:.2f} | "
                  f"{p['after_us'] / p['before_us']:.3f} | {winner(p)}"
                  + (f" (torch {p['fast_us']:.1f}, vllm {p['vllm_us']:.1f} us)" if both
                     else "") + " |")
    for name, (allb, alla, won) in per_scheme.items():
        print(f"\n{name}:")
        if not allb:
            print("  no competitor timed")
            continue
        for when, xs in (("before", allb), ("after", alla)):
            print(f"  {when + ':':<7} geomean {_gm(xs):.3f}, min {min(xs):.2f}, under 0.9: "
                  f"{sum(x < 0.9 for x in xs)}, under 0.95: {sum(x < 0.95 for x in xs)} "
                  f"of {len(xs)}")
        print("  faster competitor: " + ", ".join(f"{k} at {v}" for k, v in sorted(won.items()))
              + f" of {len(allb)} points")


def main() -> None:
    if sys.argv[1:2] == ["summarize"]:
        summarize(sys.argv[2:])
        return
    if sys.argv[1:2] == ["smoke"]:
        ap = argparse.ArgumentParser(prog="tune_check.py smoke")
        ap.add_argument("--vllm-so", required=True)
        ap.add_argument("--vllm-sha256", required=True)
        sa = ap.parse_args(sys.argv[2:])
        vllm, why = load_vllm(sa.vllm_so, sa.vllm_sha256)
        if vllm is None:
            print(f"vLLM smoke: not run ({why})")
            sys.exit(2)
        sys.exit(0 if smoke(vllm) else 1)
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--schemes", default=tune.DEFAULT_SCHEME)
    ap.add_argument("--name", default="tune_check", help="writes OUT/NAME.json")
    ap.add_argument("--vllm-so", default=None,
                    help="vLLM's _C_stable_libtorch.abi3.so: its CUTLASS GEMM as a competitor")
    ap.add_argument("--vllm-sha256", default=None,
                    help="the sha256 --vllm-so's bytes must have (else it is not loaded)")
    ap.add_argument("shapes", nargs="+")
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    client = Client(args.socket, timeout=120, fallback=False)
    vllm, why = load_vllm(args.vllm_so, args.vllm_sha256)
    if vllm is None:
        print(f"vLLM's CUTLASS left out ({why}): tensor-fast and token-fast against torch's "
              f"competitor alone, block128 not checked")
    else:
        print(f"vLLM's CUTLASS from {args.vllm_so}: beside torch's competitor for "
              f"tensor-fast and token-fast, the competitor of block128")
    out = {"device": props.name, "sm_count": props.multi_processor_count,
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
           "vllm": {"so": args.vllm_so, "loaded": vllm is not None, "why_not": why},
           "shapes": []}
    for scheme in tune.check_schemes(args.schemes.split(",")):
        if scheme == "block128" and vllm is None:
            print(f"block128: not checked here (its competitor is vLLM's CUTLASS blockwise "
                  f"kernel: {why})")
            continue
        for shape in args.shapes:
            n, k = (int(v) for v in shape.split(","))
            if scheme == "block128" and k % T.BLOCK:
                print(f"block128 {n}x{k}: not checked (K % {T.BLOCK} != 0: no block128 plan)")
                continue
            out["shapes"].append(check_shape(client, n, k, props, args.rounds, scheme, vllm))
            with open(f"{args.out}/{args.name}.json", "w") as f:
                json.dump(out, f, indent=1, default=str)
    report(out)


if __name__ == "__main__":
    main()
