"""cached.hopper_fp8's recorded winners and cost tables are data files beside the family
(data/*.json), read on first use, written by bench/gpu/hopper_fp8_fit.py; a bad file is
a clear ValueError naming it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT

from cached.families.hopper_fp8 import cost as COST
from cached.families.hopper_fp8 import winners as WIN

FIT = ROOT / "bench" / "gpu" / "hopper_fp8_fit.py"


def test_tables_are_read_on_first_use_not_at_import():
    code = ("import json; from cached.families.hopper_fp8 import cost, space, winners; "
            "loaded = lambda: sorted(cost._loaded) + sorted(winners._loaded); "
            "before = loaded(); space.enumerate_tactics(64, 4096, 4096); "
            "print(json.dumps([before, loaded()]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    before, after = json.loads(out)
    assert before == []
    assert {"US_PER_K_TILE", "LAUNCH_US", "RECORDED_WINNERS"} <= set(after)


def test_module_attributes_are_the_files_and_no_table_is_code():
    raw = json.loads(WIN.WINNERS_FILE.read_text())
    assert len(WIN.recorded_winners()) == len(raw["shapes"]) >= 14
    one = raw["shapes"][0]
    per = WIN.recorded_winners()[(raw["sm_count"], one["n"], one["k"])]
    assert {str(s) for s in per} == set(one["classes"])
    cost = json.loads(COST.COST_FILE.read_text())
    assert COST.cost_model()["LAUNCH_US"] == cost["constants"]["launch_us"]
    tm, tn, regs = cost["us_per_k_tile"]["plain"][0]
    assert COST.cost_model()["US_PER_K_TILE"][(tm, tn)] == tuple(regs)
    package = ROOT / "cached" / "families" / "hopper_fp8"
    sources = sorted(package.glob("*.py"))
    assert {p.name for p in sources} >= {"tactic.py", "cost.py", "winners.py", "space.py"}
    for path in sources:
        source = path.read_text()
        assert "US_PER_K_TILE = {" not in source and "WINNERS = {" not in source, path
    assert not (package / "h200_winners.py").exists()


def test_bad_files_are_named_errors(tmp_path):
    good = json.loads(WIN.WINNERS_FILE.read_text())
    bad = dict(good, shapes=[{"n": 64, "k": 64, "classes": {"1": [[1, "77x99m", 1.0]]}}])
    path = tmp_path / "winners.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="winners.json: not a cached.hopper_fp8 winners file"):
        WIN.load_winners(path)
    cost = json.loads(COST.COST_FILE.read_text())
    cost["constants"]["launch_us"] = -1
    (tmp_path / "cost.json").write_text(json.dumps(cost))
    with pytest.raises(ValueError, match="cost.json: not a cached.hopper_fp8 cost file"):
        COST.load_cost(tmp_path / "cost.json")
    (tmp_path / "cut.json").write_text(COST.COST_FILE.read_text()[:100])
    with pytest.raises(ValueError, match="cut.json"):
        COST.load_cost(tmp_path / "cut.json")
    # the family's own data untouched
    assert COST.cost_model()["LAUNCH_US"] > 0 and WIN.recorded_winners()


def test_fit_script_writes_the_files_the_family_reads(tmp_path):
    runs = ROOT / "bench" / "results"
    table, cost = tmp_path / "w.json", tmp_path / "c.json"
    subprocess.run([sys.executable, str(FIT), str(runs / "h200_hopper_fp8_mid_split.csv"),
                    "--write-table", str(table)], check=True, capture_output=True, cwd=ROOT)
    written = WIN.load_winners(table)
    assert written and all(key[1:] == (2112, 7168) for key in written)
    subprocess.run([sys.executable, str(FIT), str(runs / "h200_hopper_fp8_mid_split.csv"),
                    "--per-k-tile", "--write-cost", str(cost)], check=True,
                   capture_output=True, cwd=ROOT)
    assert COST.load_cost(cost)["LAUNCH_US"] == COST.cost_model()["LAUNCH_US"]
    assert COST.load_cost(cost)["TWINS"] == COST.cost_model()["TWINS"]  # kept as they are


TWINS = ROOT / "bench" / "gpu" / "hopper_fp8_twins.py"


def test_the_family_twins_are_the_fit_of_the_runs_it_names_and_beat_none_held_out(tmp_path):
    """The cost file's twins are what bench/gpu/hopper_fp8_twins.py fits on the runs its
    twins_about names (kept in bench/results); the model ranks the timed candidates better
    with them than with none, on shapes held out of the fit (docs/benchmarks.md)."""
    raw = json.loads(COST.COST_FILE.read_text())
    names = raw["twins_about"].rsplit(" from ", 1)[1].split(", ")
    runs = [ROOT / "bench" / "results" / nm for nm in names]
    assert len(runs) >= 3 and all(r.exists() for r in runs)
    out = subprocess.run([sys.executable, str(TWINS), *map(str, runs), "--write-cost",
                          str(tmp_path / "c.json")], check=True, capture_output=True,
                         text=True, cwd=ROOT).stdout
    assert COST.load_cost(tmp_path / "c.json")["TWINS"] == COST.cost_model()["TWINS"]
    assert COST.load_cost(tmp_path / "c.json")["US_PER_K_TILE"] == COST.cost_model()[
        "US_PER_K_TILE"]
    geomean = {line.split(":")[0]: float(line.split("geomean ")[1].split(",")[0])
               for line in out.splitlines()
               if line.startswith(("none:", "cost file:", "in sample:", "held out:"))}
    assert geomean["held out"] < geomean["none"] - 0.01, out
    assert geomean["cost file"] == geomean["in sample"]


def test_a_cluster_scales_the_compute_part_only_where_it_pads_no_tile():
    """A cluster's twin factor scales the compute part of the model time where the
    cluster tiles the output grid exactly; a cluster with a padded, empty partner tile gets
    none (its cost is the padded work units)."""
    import dataclasses as dc

    from cached.families.hopper_fp8.tactic import tactic_from_params

    one = tactic_from_params({"tile_m": 128, "tile_n": 128})
    pair = dc.replace(one, cluster_m=2)
    factor = COST.cost_model()["TWINS"][("cluster", "2x1", 2)]
    assert factor < 1
    m, n, k = 4096, 8192, 8192  # 32 x 64 tiles: compute-bound, no padding
    compute, memory = COST.model_parts(one, m, n, k)
    assert compute > memory and COST.twin_value(pair, m, n) == {"cluster": "2x1"}
    launch = COST.cost_model()["LAUNCH_US"]
    assert COST.estimate_us(pair, m, n, k) == pytest.approx(compute * factor + launch)
    assert COST.estimate_us(one, m, n, k) == pytest.approx(compute + launch)
    assert COST.twin_value(pair, 2100, n) == {}  # 17 M tiles: the 9th cluster is half empty


def test_a_bad_twin_row_is_a_named_error_and_the_family_keeps_its_own(tmp_path):
    before = dict(COST.cost_model()["TWINS"])
    for row in (["pdl", "on", 0, 9.0, 3], ["cluster", "2x1", 5, 0.9, 3],
                ["swizzle", "2", 0, 0.9, 3], ["cluster", "2x1", 0, 0.9]):
        cost = json.loads(COST.COST_FILE.read_text())
        cost["twins"] = [row]
        (tmp_path / "t.json").write_text(json.dumps(cost))
        with pytest.raises(ValueError, match="t.json: not a cached.hopper_fp8 cost file"):
            COST.load_cost(tmp_path / "t.json")
    assert COST.cost_model()["TWINS"] == before and before
