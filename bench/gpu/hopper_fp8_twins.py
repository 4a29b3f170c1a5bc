#!/usr/bin/env python3
"""Fit the cost model's twins (cost.TWINS) on timed runs, and say how well the model then
ranks what the runs timed.

    python bench/gpu/hopper_fp8_twins.py RUN [RUN ...] [--write-cost PATH] [--min-pairs 6]

A RUN is a ``cached tune --json`` output (every candidate timed per M bucket: the
shapes' ``timed`` rows, any scheme) or a CSV of hopper_fp8_fit.py (--write-csv; per-tensor
FP8, every kernel of a wide or mid run). Twins are two tactics timed in one bucket that
differ only in their pdl launch, or only in their cluster (one of them 1x1, the other a
cluster that tiles the grid with no padded tile: cost.twin_value). Per (feature, value, M
regime) with at least --min-pairs pairs from two shapes or more, the median over pairs of:
for a cluster, time with / time without (pairs the model calls compute-bound: the factor
scales the compute part); for pdl, the microseconds the launch saves.

Printed: the figures; then, per (N, K) and over all, the model's first choice among the
timed candidates of each bucket and class (cost.rank_key) over the best timed one, with the
twins of the family's cost file, with none, fitted on every shape (in sample) and fitted
leaving that shape out (held out: what an unseen shape gets). --write-cost writes the
family's cost file with the twins fitted on every RUN.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses as dc
import functools
import json
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(REPO, "client"), REPO, os.path.dirname(__file__)]

from hopper_fp8_fit import expand  # noqa: E402

from cached.families.hopper_fp8 import cost as COST  # noqa: E402
from cached.families.hopper_fp8.tactic import (  # noqa: E402
    HopperFp8Tactic,
    tactic_from_params,
)

Bucket = tuple[str, int, int, int]  # (run, N, K, M)


def load(paths: list[str]) -> dict[Bucket, list[tuple[HopperFp8Tactic, float]]]:
    """{(run, N, K, M): [(tactic, us)]}: each run's timings, a bucket per run (runs on
    different cards or days are never compared with each other)."""
    out: dict[Bucket, list[tuple[HopperFp8Tactic, float]]] = collections.defaultdict(list)
    for path in paths:
        run = os.path.basename(path)
        if path.endswith(".csv"):
            with open(path) as f:
                next(f)
                for line in f:
                    m, n, k, key, us = line.strip().split(",")
                    if key.startswith("cublas"):
                        continue
                    try:
                        name = expand(key)
                    except ValueError:  # a tactic the space no longer has
                        continue
                    out[(run, int(n), int(k), int(m))].append((_by_name()[name], float(us)))
            continue
        with open(path) as f:
            res = json.load(f)
        for shape in res["shapes"]:
            for m, params, us in shape.get("timed", []):
                out[(f"{run}:{shape['scheme']}", shape["n"], shape["k"], m)].append(
                    (tactic_from_params(params), us))
    return out


@functools.cache
def _by_name() -> dict[str, HopperFp8Tactic]:
    """The family's tactics by name (the CSVs' kernels)."""
    from cached.families.hopper_fp8.space import tactic_space

    return {t.name: t for t in tactic_space()}


def pairs(buckets: dict) -> dict[tuple[str, str, int], list[tuple[float, tuple[int, int]]]]:
    """{(feature, value, regime): [(figure, (N, K))]} over every twin pair timed in one
    bucket: for a cluster, time with / time without where the model calls the one without
    compute-bound (the factor applies to the compute part); for pdl, the us it saves."""
    out: dict = collections.defaultdict(list)
    for (_run, n, k, m), timed in buckets.items():
        by = {t: us for t, us in timed}
        for t, us in by.items():
            feats = COST.twin_value(t, m, n)
            for feature, value in feats.items():
                base = (dc.replace(t, pdl=False) if feature == "pdl"
                        else dc.replace(t, cluster_m=1, cluster_n=1))
                if base not in by or COST.twin_value(base, m, n) != {
                        f: v for f, v in feats.items() if f != feature}:
                    continue
                if feature == "pdl":
                    figure = by[base] - us
                else:
                    compute, memory = COST.model_parts(base, m, n, k, 132)
                    if compute < memory:
                        continue
                    figure = us / by[base]
                out[(feature, value, COST._regime(m))].append((figure, (n, k)))
    return out


def fit(buckets: dict, min_pairs: int) -> dict[tuple[str, str, int], tuple[float, int]]:
    """{(feature, value, regime): (median figure, pairs)} where there are at least
    ``min_pairs`` pairs from two shapes or more."""
    return {key: (statistics.median(r for r, _ in v), len(v))
            for key, v in sorted(pairs(buckets).items())
            if len(v) >= min_pairs and len({nk for _, nk in v}) >= 2}


def first_over_best(buckets: dict, factors: dict) -> list[tuple[int, int, float]]:
    """[(N, K, first choice / best)] per bucket and class S: the first of its timed
    tactics of the class by rank_key with ``factors`` as the cost model's twin factors,
    over the fastest one of the class."""
    saved = dict(COST.cost_model()["TWINS"])
    COST.cost_model()["TWINS"] = {key: f for key, (f, _n) in factors.items()}
    try:
        out = []
        for (_run, n, k, m), timed in buckets.items():
            for s in {t.splits for t, _ in timed}:  # the plan ranks within one class
                cls = [tu for tu in timed if tu[0].splits == s]
                if len(cls) < 2:
                    continue
                first = min(cls, key=lambda tu: (COST.rank_key(tu[0], m, n, k, 132),
                                                 tu[0].name))
                out.append((n, k, first[1] / min(us for _, us in cls)))
        return out
    finally:
        COST.cost_model()["TWINS"] = saved


def report(buckets: dict, min_pairs: int) -> dict:
    """Print the fit and the ranking figures; return the factors fitted on every run."""
    fitted = fit(buckets, min_pairs)
    print("twins (median of pairs; cluster: compute-part factor, pdl: us saved), fitted on "
          "every run:")
    for (feature, value, regime), (f, npairs) in fitted.items():
        print(f"  {feature:8s} {value:4s} M {('<= 64', '<= 1024', '> 1024')[regime]:8s} "
              f"{f:.3f} ({npairs} pairs)")
    current = {key: (f, 0) for key, f in COST.cost_model()["TWINS"].items()}
    rows = {"none": first_over_best(buckets, {}), "cost file": first_over_best(buckets, current),
            "in sample": first_over_best(buckets, fitted), "held out": []}
    for nk in sorted({(n, k) for _r, n, k, _m in buckets}):
        train = {b: v for b, v in buckets.items() if b[1:3] != nk}
        test = {b: v for b, v in buckets.items() if b[1:3] == nk}
        rows["held out"] += first_over_best(test, fit(train, min_pairs))
    print("first choice among the timed tactics / the best timed, per (N, K): geomean (worst)")
    print("  N x K        " + "".join(f"{w:>16}" for w in rows))
    for nk in sorted({(n, k) for _r, n, k, _m in buckets}):
        cells = []
        for r in rows.values():
            q = [x for n, k, x in r if (n, k) == nk]
            cells.append(f"{statistics.geometric_mean(q):.3f} ({max(q):.2f})" if q else "-")
        print(f"  {nk[0]}x{nk[1]}".ljust(15) + "".join(f"{c:>16}" for c in cells))
    for w, r in rows.items():
        q = [x for _n, _k, x in r]
        if q:
            print(f"{w}: geomean {statistics.geometric_mean(q):.3f}, worst {max(q):.3f}, "
                  f"within 3 %: {sum(x <= 1.03 for x in q)} of {len(q)} buckets")
    return fitted


def write_cost(path: str, fitted: dict, runs: list[str]) -> None:
    """The family's cost file with its "twins" rows (and their provenance, "twins_about")
    replaced by ``fitted``, the rest of the file as it is; checked readable by
    cost.load_cost."""
    with open(COST.COST_FILE) as f:
        text = f.read()
    text = text[:text.index(',\n "twins_about"')] if '"twins_about"' in text \
        else text.rstrip().removesuffix("}").rstrip()
    about = ("[feature, value, M regime (M <= 64, <= 1024, larger), time with / without, "
             "pairs]: the median over twin pairs timed in one bucket, by "
             "bench/gpu/hopper_fp8_twins.py --write-cost from "
             + ", ".join(os.path.basename(r) for r in runs))
    rows = ",\n".join(f"  {json.dumps([f, v, r, round(x, 4), npairs])}"
                      for (f, v, r), (x, npairs) in fitted.items())
    text += f',\n "twins_about": {json.dumps(about)},\n "twins": [\n{rows}\n ]\n}}\n'
    json.loads(text)
    with open(path, "w") as f:
        f.write(text)
    COST.load_cost(path)
    print(f"wrote {path}: {len(fitted)} twin factors")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="cached tune --json outputs or fit CSVs")
    ap.add_argument("--min-pairs", type=int, default=6)
    ap.add_argument("--write-cost", metavar="PATH")
    a = ap.parse_args()
    buckets = load(a.runs)
    fitted = report(buckets, a.min_pairs)
    if a.write_cost:
        write_cost(a.write_cost, fitted, a.runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
