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
