#!/usr/bin/env python3
"""Check the split rule and the cost model of cached.hopper_fp8 against an H200 "wide" run.

    python bench/gpu/hopper_fp8_fit.py RESULT.json [--sms 132]

RESULT.json is $OUT/hopper_fp8.json of `hopper_fp8_check.py run` on a "wide" bundle (every
kernel timed at every shape and M). For each (N, K) it prints, per reduction-order class
S, the geometric mean and the minimum over M of cuBLAS(fast accumulation)'s time over the
best measured kernel of the class, and marks the S that `tactics.choose_split` picks.
Then, for the plan's class, how close the plan's first choice per M (`enumerate_tactics`,
the family's model) comes to the best measured kernel of that class; a first choice the
run did not time is listed as unmeasured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(REPO, "client"), REPO]

from cached.families.hopper_fp8 import tactics as T  # noqa: E402


def _gm(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def load(path: str):
    with open(path) as f:
        res = json.load(f)
    by = {}
    for row in res["perf"]:
        by.setdefault((row["n"], row["k"]), {}).setdefault(row["m"], {})[row["impl"]] = row["us"]
    names = {t.name: t for t in T.tactic_space()}
    extra = {}
    for row in res["perf"]:
        nm = row["impl"]
        if nm.startswith("cublas") or nm in names or nm in extra:
            continue
        extra[nm] = None
    return by, names


def splits_of(name: str) -> int:
    tail = name.rsplit("_", 1)[-1]
    return int(tail[1:-1]) if tail.startswith("k") and tail[-1] in "cs" else 1


def plain(name: str) -> bool:
    return "_e4m3_bfloat16" in name


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args()
    by, space = load(a.json)
    classes = T.SPLIT_CHOICES
    print("per (N, K): cuBLAS-fast / best-of-class, geomean over M (min); * = choose_split")
    print("  N x K        " + "".join(f"{'S=' + str(s):>14}" for s in classes) + "   best")
    lost = []
    for (n, k), bym in by.items():
        score = {}
        for s in classes:
            r = []
            for m, d in bym.items():
                ks = [x for x in d if not x.startswith("cublas") and plain(x) and splits_of(x) == s]
                if not ks:
                    break
                r.append(d["cublas_fast1"] / min(d[x] for x in ks))
            else:
                score[s] = (_gm(r), min(r))
        pick = T.choose_split(n, k, a.sms)
        best = max(score, key=lambda s: score[s][0])
        cells = "".join(
            (f"{score[s][0]:6.3f} ({score[s][1]:.2f})" + ("*" if s == pick else " ")).rjust(14)
            if s in score else f"{'-':>14}" for s in classes)
        print(f"  {n}x{k}".ljust(15) + cells + f"   S={best}")
        if pick in score:
            lost.append(score[pick][0] / score[best][0])
    print(f"choose_split vs the best class per shape: geomean of (rule's score / best score) "
          f"{_gm(lost):.3f}, worst {min(lost):.3f}")
    print()
    print("plan's first choice vs the best measured kernel of its class (time ratio >= 1)")
    ratios, unmeasured = [], []
    for (n, k), bym in by.items():
        s = T.choose_split(n, k, a.sms)
        for m, d in sorted(bym.items()):
            plan = T.enumerate_tactics(m, n, k, splits=s, num_sms=a.sms)
            first = plan[0].name
            ks = [x for x in d if not x.startswith("cublas") and plain(x) and splits_of(x) == s]
            if not ks:
                continue
            best = min(ks, key=d.get)
            if first not in d:
                unmeasured.append((m, n, k, first))
                # the best-ranked measured tactic stands in
                first = next((t.name for t in plan if t.name in d), None)
                if first is None:
                    continue
            ratios.append(d[first] / d[best])
            if a.verbose or d[first] / d[best] > 1.08:
                print(f"  {m:5d} {n}x{k}: plan {first} {d[first]:.1f} us, best {best} "
                      f"{d[best]:.1f} us ({d[first] / d[best]:.2f}x)")
    print(f"plan/best: geomean {_gm(ratios):.3f}, worst {max(ratios):.3f}, points {len(ratios)}; "
          f"first choices the run did not time: {len(unmeasured)}")
    for u in unmeasured[:20]:
        print("  unmeasured:", u)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
