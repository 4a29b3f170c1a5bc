#!/usr/bin/env python3
"""Check the split rule and the cost model of cached.hopper_fp8 against an H200 "wide" run.

    python bench/gpu/hopper_fp8_fit.py RESULT [RESULT ...] [--sms 132] [--model-only]
        [--write-table PATH] [--write-csv PATH] [--per-k-tile]

RESULT is $OUT/hopper_fp8.json of `hopper_fp8_check.py run` on a "wide" bundle (every
kernel timed at every shape and M) or a "mid" one (the N widths 80-160 and the cluster
variants at M = 128..2048), or its CSV form (--write-csv), kept as bench/results/
h200_hopper_fp8_swap_wide.csv (the wide run with the swap_ab tiles),
h200_hopper_fp8_mid.csv (the mid run) and h200_hopper_fp8_mid_split.csv (the split run:
the S = 2 class of 2112x7168); h200_hopper_fp8_wide.csv is the run before swap_ab.
Several RESULTs are merged in order (see load()): the recorded winners come from
`swap_wide.csv mid.csv mid_split.csv`. For
each (N, K) it prints, per reduction-order class S, the geometric mean and the minimum
over M of cuBLAS(fast accumulation)'s time over the best measured kernel of the class,
and marks the S that `space.choose_split` picks.
Then, for the plan's class, how close the plan's first choice per M (`enumerate_tactics`,
the family's model) comes to the best measured kernel of that class; a first choice the
run did not time is listed as unmeasured. --model-only ranks without the recorded
winners (winners.recorded_winners()), which is how the plan ranks an (N, K) nobody measured.
--per-k-tile prints the per-K-tile costs the model's tables hold, from the run.
--write-table writes those recorded winners (the best measured tactic per (N, K), M and
class S in 1, 2, 4) as cached/families/hopper_fp8/data/h200_winners.json. --update-table PATH
--margin F starts from the winners recorded in PATH instead and replaces one only where a
run timed it beside a tactic of its class faster by more than the margin (update_table);
with --per-round (JSON runs timed in rounds) faster by more than the margin in every round.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(REPO, "client"), REPO]

from cached.families.hopper_fp8 import cost as COST  # noqa: E402
from cached.families.hopper_fp8 import space as SPACE  # noqa: E402
from cached.families.hopper_fp8 import tactic as T  # noqa: E402
from cached.families.hopper_fp8 import winners as WIN  # noqa: E402


def _gm(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def compact(name: str) -> str:
    """'m64n128_c1x1_rm_s1_st8_e4m3_bfloat16_k4c' -> '64x128.m.c.4', with swap_ab
    ('..._k4c_sw') 'w64x128.m.c.4', with wg_n = 2 ('..._wn2') 'n64x80.m.s.1', with a
    cluster other than 1x1 a fifth field
    ('m128n64_c1x2_...' -> '128x64.m.s.1.c1x2'); cuBLAS rows as is. Only swizzle-1
    bf16/e4m3 kernels with the most stages that fit, which is what wide and mid runs time."""
    if name.startswith("cublas"):
        return name
    t = T.HopperFp8Tactic(*_fields(name)).normalized()
    assert t.name == name, (t.name, name)
    mode = "c" if t.split_mode == "cta" else "s"
    cluster = f".c{t.cluster_m}x{t.cluster_n}" if t.cluster_size > 1 else ""
    lead = "w" if t.swap_ab else ("n" if t.wg_n == 2 else ("p" if t.pingpong else ""))
    return (f"{lead}{t.tile_m}x{t.tile_n}.{t.raster}.{mode}.{t.splits}"
            f"{cluster}")


def _fields(name: str) -> tuple:
    pp = name.endswith("_pp")
    name = name.removesuffix("_pp")
    wg_n = 2 if name.endswith("_wn2") else 1
    name = name.removesuffix("_wn2")
    swap = name.endswith("_sw")
    parts = name.removesuffix("_sw").split("_")
    tm, tn = parts[0][1:].split("n")
    cm, cn = (int(x) for x in parts[1][1:].split("x"))
    assert parts[3] == "s1" and "e4m3_bfloat16" in name, name
    s, mode = 1, "serial"
    if parts[-1].startswith("k"):
        s, mode = int(parts[-1][1:-1]), {"c": "cta", "s": "serial"}[parts[-1][-1]]
    return (int(tm), int(tn), cm, cn, parts[2][1], 1, 0, "bfloat16", "e4m3", s, mode, swap,
            wg_n, pp)


def expand(key: str) -> str:
    if key.startswith("cublas"):
        return key
    swap = key.startswith("w")
    wg_n = 2 if key.startswith("n") else 1
    pp = key.startswith("p")
    tile, raster, mode, s, *cluster = key.lstrip("wnp").split(".")
    tm, tn = (int(x) for x in tile.split("x"))
    cm, cn = (int(x) for x in cluster[0][1:].split("x")) if cluster else (1, 1)
    return T.HopperFp8Tactic(tm, tn, cm, cn, raster, 1, 0, "bfloat16", "e4m3", int(s),
                             {"c": "cta", "s": "serial"}[mode], swap, wg_n, pp).normalized().name


def load(paths: list[str]):
    """{(N, K): {M: {kernel name: us}}} from runs' hopper_fp8.json or CSVs written by
    --write-csv (bench/results/h200_hopper_fp8_*.csv). Runs are taken in order: a later
    run's (N, K, M) cell replaces an earlier one's whole (one machine and run per cell,
    cuBLAS included, so ratios and winners never mix runs)."""
    by = {}
    for path in paths:
        one = {}
        if path.endswith(".csv"):
            with open(path) as f:
                next(f)
                gone = set()
                for line in f:
                    m, n, k, key, us = line.strip().split(",")
                    try:
                        name = expand(key)
                    except ValueError:  # a tactic the space no longer has (e.g. 128x176)
                        gone.add(key)
                        continue
                    one.setdefault((int(n), int(k)), {}).setdefault(int(m), {})[name] = \
                        float(us)
                if gone:
                    print(f"{os.path.basename(path)}: skipped {len(gone)} tactics no longer "
                          f"in the space", file=sys.stderr)
        else:
            with open(path) as f:
                res = json.load(f)
            for row in res["perf"]:
                cell = one.setdefault((row["n"], row["k"]), {}).setdefault(row["m"], {})
                cell[row["impl"]] = row["us"]
        for nk, bym in one.items():
            for m, new in bym.items():
                old = by.setdefault(nk, {}).setdefault(m, {})
                timed = {splits_of(x) for x in new if not x.startswith("cublas")}
                for x in [x for x in old if not x.startswith("cublas") and splits_of(x) in timed]:
                    del old[x]
                old.update(new)
    return by, SPACE.recordable_tactics()


def load_rounds(paths: list[str]) -> dict:
    """{(N, K, M, kernel name): [us per round]} from runs' hopper_fp8.json timed in rounds
    (`run --rounds R`); later runs replace earlier ones' cells as in load()."""
    rounds: dict = {}
    for path in paths:
        if path.endswith(".csv"):
            raise SystemExit(f"--per-round needs the runs' JSON (rounds_us), not {path}")
        with open(path) as f:
            res = json.load(f)
        for row in res["perf"]:
            if not row.get("rounds_us"):
                raise SystemExit(f"{path}: {row['n']}x{row['k']} M={row['m']} "
                                 f"{row['impl']} was not timed in rounds")
            rounds[(row["n"], row["k"], row["m"], row["impl"])] = row["rounds_us"]
    return rounds


def write_csv(by, path: str) -> None:
    with open(path, "w") as f:
        f.write("m,n,k,kernel,us\n")
        for (n, k), bym in by.items():
            for m, d in sorted(bym.items()):
                for name, us in d.items():
                    if name.startswith("cublas") or "_e4m3_bfloat16" in name:
                        f.write(f"{m},{n},{k},{compact(name)},{us:.4f}\n")


def splits_of(name: str) -> int:
    tail = name.removesuffix("_pp").removesuffix("_wn2").removesuffix("_sw").rsplit("_", 1)[-1]
    return int(tail[1:-1]) if tail.startswith("k") and tail[-1] in "cs" else 1


def plain(name: str) -> bool:
    return "_e4m3_bfloat16" in name


def write_table(by, space, path: str, sources: list[str]) -> None:
    """The best measured tactic of the family's space per (N, K), M and class S <= 4."""
    table: dict = {}
    for (n, k), bym in sorted(by.items()):
        for s in (1, 2, 4):
            row = []
            for m, d in sorted(bym.items()):
                ks = [x for x in d if x in space and space[x].splits == s]
                if not ks:
                    continue
                best = min(ks, key=d.get)
                row.append((m, WIN.recorded_key(space[best]), round(d[best], 1)))
            if row:
                table.setdefault((n, k), {})[s] = tuple(row)
    _emit(table, path, ["By bench/gpu/hopper_fp8_fit.py --write-table from",
                        *(f"    {os.path.basename(x)}" for x in sources),
                        "(runs of bench/gpu/hopper_fp8_check.py on an H200, 132 SMs, "
                        "2026-11-30; a later", "run's times of a class at an (N, K, M) "
                        "replace an earlier run's)."])


def update_table(by, space, path: str, sources: list[str], margin: float,
                 rounds: dict | None = None) -> None:
    """Start from the recorded winners in ``path`` and replace a (N, K, class S, M) winner
    only where the runs ``by`` timed it and the best tactic of its class in the same cell
    (one run, one machine) is faster by more than ``margin`` (0.05: 5 %). Cells the runs
    did not time, or whose recorded winner they did not time, are kept: times from two
    machines are never compared, and a win within the run-to-run spread changes nothing.
    With ``rounds`` (load_rounds), the best tactic (by median) must be faster than the
    winner by more than ``margin`` in every round of the cell, not only in the median."""
    with open(path) as f:
        head = json.load(f)["about"]  # the recorded file's own provenance
    recorded = WIN.load_winners(path)
    table: dict = {}
    changed = kept = 0
    for (_sms, n, k), per in recorded.items():
        for s, row in per.items():
            out = []
            for m, key, us in row:
                d = by.get((n, k), {}).get(m, {})
                old = WIN.tactic_from_key(key, s, "bfloat16", "e4m3").name
                ks = [x for x in d if x in space and space[x].splits == s]
                if old in d and ks:
                    best = min(ks, key=d.get)
                    if rounds is not None and best != old:
                        q = [a / b for a, b in zip(rounds[(n, k, m, old)],
                                                   rounds[(n, k, m, best)], strict=True)]
                        win = min(q) > 1 + margin
                        how = f", every round: {min(q):.3f}-{max(q):.3f}x"
                    else:
                        win, how = d[old] > d[best] * (1 + margin), ""
                    if best != old and win:
                        print(f"  {n}x{k} S={s} M={m}: {key} {d[old]:.1f} us -> "
                              f"{WIN.recorded_key(space[best])} {d[best]:.1f} us "
                              f"({d[old] / d[best]:.3f}x{how})")
                        out.append((m, WIN.recorded_key(space[best]), round(d[best], 1)))
                        changed += 1
                        continue
                    kept += 1
                out.append((m, key, us))
            table.setdefault((n, k), {})[s] = tuple(out)
    _emit(table, path, head + [f"then --update-table --margin {margin} from",
                               *(f"    {os.path.basename(x)}" for x in sources),
                               "(a winner replaced only where the same run timed it and a "
                               "tactic of its", f"class beat it by more than "
                               f"{margin * 100:.0f} %"
                               + (" in every round)." if rounds is not None else ").")])
    print(f"update: {changed} winners replaced, {kept} timed and kept")


def _emit(table: dict, path: str, how: list[str]) -> None:
    """Write recorded winners as JSON (the format winners.load_winners reads): provenance
    lines, the device, then per (N, K) and class S the rows [M, tactic key, us], one
    shape a line group so that diffs stay readable."""
    head = {"about": how, "device": "NVIDIA H200", "sm_count": 132,
            "format": "per (N, K) and reduction-order class S, per M bucket: [M, tactic key, "
                      "measured us]; a key is winners.recorded_key(t): 'w' swap_ab, 'n' wg_n = "
                      "2, 'p' ping-pong, tile, raster, for S > 1 the split mode, '@CMxCN' a "
                      "cluster, '+pdl' programmatic dependent launch"}
    text = json.dumps(head, indent=1)[:-2] + ',\n "shapes": [\n'
    shapes = []
    for (n, k), per in table.items():
        classes = ",\n".join(f'    "{s}": {json.dumps([list(r) for r in row])}'
                              for s, row in per.items())
        shapes.append(f'  {{"n": {n}, "k": {k}, "classes": {{\n{classes}\n  }}}}')
    text += ",\n".join(shapes) + "\n ]\n}\n"
    json.loads(text)  # well-formed
    with open(path, "w") as f:
        f.write(text)
    WIN.load_winners(path)  # and readable as the family reads it
    print(f"wrote {path}: {len(table)} shapes")


def write_cost(tables: dict, constants: dict, path: str, how: list[str]) -> None:
    """Write a cost file (the format cost.load_cost reads): per tile kind the per-K-tile
    rows [tile_m, tile_n, [M <= 64, M <= 1024, larger]] in us, and model_parts' constants;
    the family's twins (hopper_fp8_twins.py) carried over as they are."""
    head = {"about": how, "device": "NVIDIA H200", "sm_count": 132}
    text = json.dumps(head, indent=1)[:-2] + ',\n "us_per_k_tile": {\n'
    kinds = []
    for kind, rows in tables.items():
        body = ",\n".join(f"   [{tm}, {tn}, {json.dumps([round(x, 4) for x in per])}]"
                           for (tm, tn), per in sorted(rows.items()))
        kinds.append(f'  "{kind}": [\n{body}\n  ]')
    text += ",\n".join(kinds) + "\n },\n"
    text += f' "constants": {json.dumps(constants)}'
    with open(COST.COST_FILE) as f:
        current = json.load(f)  # the twins (bench/gpu/hopper_fp8_twins.py) as they are
    for key in ("twins_about", "twins"):
        if key in current:
            rows = ",\n".join(f"  {json.dumps(r)}" for r in current[key]) \
                if key == "twins" else None
            text += (f',\n "twins": [\n{rows}\n ]' if rows is not None
                     else f',\n "{key}": {json.dumps(current[key])}')
    text += "\n}\n"
    json.loads(text)
    with open(path, "w") as f:
        f.write(text)
    COST.load_cost(path)
    print(f"wrote {path}")


def spread(path_a: str, path_b: str, space) -> None:
    """How much a run-to-run change moves the ranking of two kernels: over every
    (N, K, M) cell and pair of tactics of one class that both runs timed, q = (t_x / t_y)
    in run b over the same in run a (1.0: the two runs agree on how much faster x is).
    Prints quantiles of max(q, 1/q), the margin update_table needs for a win to be
    taken only where it survives a change of machine."""
    import statistics

    a, _ = load([path_a])
    b, _ = load([path_b])
    qs = []
    for nk, bym in a.items():
        for m, da in bym.items():
            db = b.get(nk, {}).get(m, {})
            both = sorted(x for x in da if x in db and x in space)
            for i, x in enumerate(both):
                for y in both[i + 1:]:
                    if space[x].splits == space[y].splits:
                        q = (db[x] / db[y]) / (da[x] / da[y])
                        qs.append(max(q, 1 / q))
    cub = []
    for nk, bym in a.items():
        for m, da in bym.items():
            db = b.get(nk, {}).get(m, {})
            for x in da:
                if x in db and x in space and "cublas_fast1" in da and "cublas_fast1" in db:
                    q = (db["cublas_fast1"] / db[x]) / (da["cublas_fast1"] / da[x])
                    cub.append(max(q, 1 / q))
    for what, v in (("pairs of our kernels (same cell, same class)", qs),
                    ("cuBLAS fast / ours, same kernel", cub)):
        if not v:
            print(f"{what}: nothing timed in both runs")
            continue
        v.sort()
        print(f"{what}: {len(v)}; max(q, 1/q) median {statistics.median(v):.3f}, "
              f"80th {v[round(0.8 * (len(v) - 1))]:.3f}, 90th {v[round(0.9 * (len(v) - 1))]:.3f}, "
              f"95th {v[round(0.95 * (len(v) - 1))]:.3f}, max {v[-1]:.3f}")


def per_k_tile(by, space, sms: int, show: bool = True) -> dict:
    """Per tile shape of the S = 1 kernels and M regime (M <= 64, <= 1024, larger): the
    median over the run of (time - LAUNCH_US) / waves / K tiles, the model's
    US_PER_K_TILE, SWAP_US_PER_K_TILE, WG_N_US_PER_K_TILE and PINGPONG_US_PER_K_TILE
    (printed); returned as {kind: {(tile_m, tile_n): [3 medians or None]}}, kinds as in
    the cost file (plain, swap_ab, wg_n, pingpong)."""
    import statistics

    samples: dict = {}
    for (n, k), bym in by.items():
        for m, d in bym.items():
            for name, us in d.items():
                t = space.get(name)
                if t is None or t.splits != 1 or t.cluster_size != 1 or t.swizzle != 1 \
                        or t.raster != "m":
                    continue
                waves = -(-COST.work_units(t, m, n) // sms)
                kt = -(-k // T.TILE_K)
                reg = 0 if m <= 64 else (1 if m <= 1024 else 2)
                kind = "swap_ab" if t.swap_ab else ("wg_n" if t.wg_n == 2 else (
                    "pingpong" if t.pingpong else "plain"))
                samples.setdefault((kind, t.tile_m, t.tile_n), {}).setdefault(
                    reg, []).append((us - COST.cost_model()["LAUNCH_US"]) / waves / kt)
    fitted: dict = {}
    for kind, table in (("plain", "US_PER_K_TILE"), ("swap_ab", "SWAP_US_PER_K_TILE"),
                        ("wg_n", "WG_N_US_PER_K_TILE"),
                        ("pingpong", "PINGPONG_US_PER_K_TILE")):
        lines = [f"{table} = {{"]
        for (kd, tm, tn), regs in sorted(samples.items()):
            if kd != kind:
                continue
            med = [round(statistics.median(regs[r]), 3) if r in regs else None
                   for r in range(3)]
            fitted.setdefault(kind, {})[(tm, tn)] = med
            lines.append(f"    ({tm}, {tn}): ({', '.join(str(x) for x in med)}),")
        if show:
            print("\n".join(lines + ["}"]))
    return fitted


def merged_tables(fitted: dict, base: dict) -> dict:
    """The cost model's tables with ``fitted`` (per_k_tile) medians in place of ``base``'s
    (cost.load_cost's names); a cell the runs did not time keeps base's."""
    out = {}
    for kind, name in COST._COST_TABLES.items():
        table = dict(base[name])
        for tile, med in fitted.get(kind, {}).items():
            old = table.get(tile)
            table[tile] = tuple(m if m is not None else (old[i] if old else 1.0)
                                for i, m in enumerate(med))
        out[name] = table
    return out


def first_choice_ratios(by, shapes, sms: int) -> list[tuple]:
    """(N, K, M, first choice / best measured of the plan's class) at every cell of
    ``shapes`` in ``by``, the plan ranked by the model alone (no recorded winners); a
    first choice the runs did not time is stood in for by the best-ranked timed one, and
    flagged."""
    out = []
    saved = dict(WIN.recorded_winners())
    WIN.recorded_winners().clear()
    try:
        for n, k in shapes:
            s = SPACE.choose_split(n, k, sms)
            for m, d in sorted(by[(n, k)].items()):
                ks = [x for x in d if not x.startswith("cublas") and splits_of(x) == s
                      and x in SPACE.recordable_tactics()]
                if not ks:
                    continue
                best = min(ks, key=d.get)
                plan = SPACE.enumerate_tactics(m, n, k, splits=s, num_sms=sms)
                first = next((t.name for t in plan if t.name in d), None)
                if first is None:
                    continue
                out.append((n, k, m, d[first] / d[best], first == plan[0].name))
    finally:
        WIN.recorded_winners().update(saved)
    return out


def holdout(by, space, sms: int) -> None:
    """Leave one shape out: for each (N, K) the runs hold, refit the per-K-tile tables on
    the other shapes' cells (per_k_tile, merged over the family's tables), rank the held-out
    shape's cells by that model alone, and report the first choice's time over the best
    measured tactic of the plan's class; beside it the same with the tables fitted on every
    shape (in sample) and with the family's current tables."""
    shapes = sorted(by)
    base = {name: COST.cost_model()[name] for name in COST._COST_TABLES.values()}
    saved = dict(COST.cost_model())

    def use(tables: dict) -> None:
        COST._loaded.update(tables)

    rows = {"current": [], "in sample": [], "held out": []}
    try:
        use(base)
        rows["current"] = first_choice_ratios(by, shapes, sms)
        use(merged_tables(per_k_tile(by, space, sms, show=False), base))
        rows["in sample"] = first_choice_ratios(by, shapes, sms)
        for nk in shapes:
            train = {x: v for x, v in by.items() if x != nk}
            use(merged_tables(per_k_tile(train, space, sms, show=False), base))
            rows["held out"] += first_choice_ratios(by, [nk], sms)
    finally:
        COST._loaded.update(saved)
    print("first choice / best measured of the plan's class, model alone (no recorded "
          "winners), per shape: geomean (worst) over M")
    print("  N x K        " + "".join(f"{w:>18}" for w in rows))
    for n, k in shapes:
        cells = []
        for w in rows:
            r = [x[3] for x in rows[w] if x[:2] == (n, k)]
            cells.append(f"{_gm(r):.3f} ({max(r):.2f})" if r else "-")
        print(f"  {n}x{k}".ljust(15) + "".join(f"{c:>18}" for c in cells))
    for w, r in rows.items():
        q = [x[3] for x in r]
        print(f"{w}: geomean {_gm(q):.3f}, worst {max(q):.3f}, within 5 %: "
              f"{sum(x <= 1.05 for x in q)} of {len(q)}, over 1.2: {sum(x > 1.2 for x in q)}; "
              f"first choice untimed (stood in): {sum(not x[4] for x in r)}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("json", nargs="+", help="runs (JSON or CSV), later cells replace earlier")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--model-only", action="store_true")
    ap.add_argument("--write-table")
    ap.add_argument("--update-table", help="recorded winners to update from the runs "
                    "(see update_table), written back in place")
    ap.add_argument("--margin", type=float, default=0.05,
                    help="--update-table: a faster tactic replaces a winner only when the "
                         "winner's time over its is more than 1 + margin")
    ap.add_argument("--per-round", action="store_true",
                    help="--update-table from JSON runs timed in rounds: the margin must hold "
                         "in every round of a cell")
    ap.add_argument("--write-csv")
    ap.add_argument("--per-k-tile", action="store_true")
    ap.add_argument("--write-cost", metavar="PATH",
                    help="--per-k-tile: write the cost file (cost.load_cost's format) with "
                         "the runs' medians in place of the family's (cells they did not time "
                         "kept)")
    ap.add_argument("--holdout", action="store_true",
                    help="leave one shape out: the refitted model's first choice on shapes it "
                         "was not fitted on (see holdout)")
    ap.add_argument("--spread", action="store_true",
                    help="two runs: how far their relative times disagree (see spread)")
    a = ap.parse_args()
    if a.spread:
        spread(a.json[0], a.json[1], {t.name: t for t in SPACE.tactic_space()})
        return 0
    by, space = load(a.json)
    if a.holdout:
        holdout(by, space, a.sms)
        return 0
    if a.per_k_tile:
        fitted = per_k_tile(by, space, a.sms, show=not a.write_cost)
        if a.write_cost:
            base = {name: COST.cost_model()[name] for name in COST._COST_TABLES.values()}
            tables = merged_tables(fitted, base)
            with open(COST.COST_FILE) as f:
                constants = json.load(f)["constants"]
            write_cost({kind: tables[name] for kind, name in COST._COST_TABLES.items()},
                       constants, a.write_cost,
                       ["Per-K-tile costs of cached.hopper_fp8's cost model (cost."
                        "model_parts), by tile kind, (tile_m, tile_n) and M regime (M <= 64, "
                        "M <= 1024, larger): the median over H200 runs of (time - launch_us) / "
                        "waves / K tiles for S = 1, cluster 1x1, swizzle 1, raster m, by "
                        "bench/gpu/hopper_fp8_fit.py --per-k-tile --write-cost from",
                        *(f"    {os.path.basename(x)}" for x in a.json),
                        "(later runs' cells replace earlier ones'; a tile the runs did not "
                        "time keeps the previous file's figures). constants: model_parts' "
                        "fitted constants, unchanged."])
        return 0
    if a.write_csv:
        write_csv(by, a.write_csv)
        return 0
    if a.write_table:
        write_table(by, space, a.write_table, a.json)
        return 0
    if a.update_table:
        update_table(by, space, a.update_table, a.json, a.margin,
                     load_rounds(a.json) if a.per_round else None)
        return 0
    if a.model_only:
        WIN.recorded_winners().clear()
    classes = T.SPLIT_CHOICES
    print("per (N, K): cuBLAS-fast / best-of-class, geomean over M (min); * = choose_split")
    print("  N x K        " + "".join(f"{'S=' + str(s):>14}" for s in classes) + "   best")
    lost = []
    for (n, k), bym in by.items():
        score = {}
        for s in classes:
            r = []
            for d in bym.values():
                ks = [x for x in d if not x.startswith("cublas") and plain(x) and splits_of(x) == s]
                if not ks:
                    break
                r.append(d["cublas_fast1"] / min(d[x] for x in ks))
            else:
                score[s] = (_gm(r), min(r))
        pick = SPACE.choose_split(n, k, a.sms)
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
        s = SPACE.choose_split(n, k, a.sms)
        for m, d in sorted(bym.items()):
            plan = SPACE.enumerate_tactics(m, n, k, splits=s, num_sms=a.sms)
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
