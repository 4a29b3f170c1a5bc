"""Configuration precedence, `cached config`, and the shipped pre-warm manifests."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, DaemonProcess, run_cli

from cached import families
from cached.config import ConfigError, parse_size, size_text
from cached.tools import manifests


def test_sizes_mean_what_they_say_gb_is_decimal_gib_binary():
    assert parse_size("20 GB") == parse_size("20G") == parse_size("20gb") == 20 * 10**9
    assert parse_size("20 GiB") == parse_size("20Gi") == parse_size("20gib") == 20 * 2**30
    assert parse_size("500MB") == 500 * 10**6 and parse_size("500MiB") == 500 * 2**20
    assert parse_size("1.5GiB") == 3 * 2**29 and parse_size("1.5G") == 1_500_000_000
    assert parse_size("64kB") == 64_000 and parse_size("64KiB") == 65_536
    assert parse_size(4096) == 4096 and parse_size("0") == 0 and parse_size("512B") == 512
    for bad in ("lots", "5i", "-1", "1e3", "20 GiBB", True, -4096, 1 << 61):
        with pytest.raises(ConfigError, match="size"):
            parse_size(bad)
    # printed with the unit said, exact when it is a whole number of units
    assert size_text(20 * 10**9) == "20 GB" and size_text(20 * 2**30) == "20 GiB"
    assert size_text(58_513_584) == "55.8 MiB" and size_text(0) == "0 B"


def test_config_prints_sizes_with_their_unit_and_keeps_columns_aligned(tmp_path: Path):
    long_store = str(tmp_path / ("a-rather-long-directory-name-" * 4) / "store")
    args = ["--store", long_store, "--max-bytes", "20GB", "--remote",
            "redis://cache.example.internal:6379/0", "--allow-uid", "1000"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHED_")}
    doc = json.loads(subprocess.run([sys.executable, "-m", "cached", "config", "--json", *args],
                                    env=env, capture_output=True, text=True,
                                    check=True).stdout)
    text = subprocess.run([sys.executable, "-m", "cached", "config", *args], env=env,
                          capture_output=True, text=True, check=True).stdout.splitlines()
    rows = {r["name"]: r for r in doc["options"]}
    assert rows["max_bytes"]["value"] == 20 * 10**9
    assert any(re.match(r"max_bytes\s+20 GB \(20000000000 bytes\)\s+flag --max-bytes$", line)
               for line in text)
    starts = set()
    for row in doc["options"]:
        source = row["source"] + ("" if row["reloadable"] else "  (restart to change)")
        line = next(line for line in text if line.endswith(source) and (
            line.startswith(row["name"] + " ") or not line[0].strip()))
        starts.add(len(line) - len(source))
    assert len(starts) == 1, starts  # every source starts in one column
    assert any(line.startswith("store ") and line.endswith(long_store) for line in text)
    text_gib = run_cli("config", "--max-bytes", "20GiB").stdout
    assert re.search(r"^max_bytes\s+20 GiB \(21474836480 bytes\)", text_gib, re.M)


def test_flag_beats_env_beats_file_beats_default_and_config_says_which(tmp_path: Path):
    config = tmp_path / "cached.toml"
    config.write_text('max_bytes = "1G"\nworkers = 3\nlog-level = "debug"\n'
                      'drain_timeout = 12\n')
    env = {**os.environ, "CACHED_MAX_BYTES": "2G", "CACHED_LOG_LEVEL": "warning",
           "CACHED_CONFIG": str(config)}
    out = subprocess.run([sys.executable, "-m", "cached", "config", "--json",
                          "--max-bytes", "3GiB"], env=env, capture_output=True, text=True,
                         check=True).stdout
    doc = json.loads(out)
    rows = {r["name"]: r for r in doc["options"]}
    assert doc["file"] == str(config) and doc["file_source"] == "env CACHED_CONFIG"
    assert (rows["max_bytes"]["value"], rows["max_bytes"]["source"]) == (3 << 30,
                                                                         "flag --max-bytes")
    assert (rows["log_level"]["value"], rows["log_level"]["source"]) == (
        "warning", "env CACHED_LOG_LEVEL")
    assert (rows["workers"]["value"], rows["workers"]["source"]) == (3, f"file {config}")
    assert rows["drain_timeout"]["value"] == 12.0
    assert (rows["job_timeout"]["value"], rows["job_timeout"]["source"]) == (300.0, "default")
    assert rows["max_bytes"]["reloadable"] and not rows["store"]["reloadable"]
    text = run_cli("config", "--config", str(config)).stdout
    assert "max_bytes" in text and f"file {config}" in text


def test_a_typo_in_the_file_is_an_error_not_a_silent_default(tmp_path: Path):
    config = tmp_path / "cached.toml"
    config.write_text("max_byte = 10\n")
    result = run_cli("config", "--config", str(config), check=False)
    assert result.returncode == 2 and "unknown key 'max_byte'" in result.stderr


def test_shipped_manifests_name_known_families_and_targets():
    shipped = sorted((ROOT / "manifests").glob("*.toml"))
    assert {p.stem for p in shipped} >= {"llama-3.1-8b", "llama-3.3-70b", "qwen3-32b",
                                         "deepseek-v3-dense"}
    known = set(families.names())
    for path in shipped:
        m = manifests.load(path)
        assert len(m.shapes()) == len(m.layers) * len(m.m)
        built = {(b.family, t) for b in m.builds for t in b.targets}
        assert {("flashinfer.mm_fp4", "sm_100a"), ("flashinfer.mm_fp4", "sm_103a"),
                ("cached.hopper_fp8", "sm_90a"), ("flashinfer.bi.bmm_fp8", "sm_100a"),
                ("flashinfer.bi.bmm_fp8", "sm_103a")} <= built, path
        for family, target in built:
            assert family in known, (path, family)
            families.get(family).check_arch(target)
        assert not m.pending, path  # FP8 on SM100 is built (flashinfer.bi.bmm_fp8)
        for _, (_, n, k) in m.shapes():
            assert n % 8 == 0 and k % 64 == 0, (path, n, k)


def test_manifest_errors_say_where(tmp_path: Path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[model]\nname = "x"\nm = [1]\ntensor_parallel = 3\n'
                   '[[layer]]\nname = "qkv"\nn = 1024\nk = 64\nparallel = "column"\n'
                   '[[build]]\nfamily = "flashinfer.mm_fp4"\ntargets = ["sm_100a"]\n')
    with pytest.raises(manifests.ManifestError, match="does not divide by tensor_parallel 3"):
        manifests.load(bad)


HOPPER_MANIFEST = """
[model]
name = "hopper-two-ways"
m = [1, 64, 4096]
[[layer]]
name = "qkv"
n = 6144
k = 4096
[[build]]
family = "cached.hopper_fp8"
targets = ["sm_90a"]
{extra}
"""


def test_a_manifests_hopper_build_warms_the_plans_choice_unless_it_asks_for_all(tmp_path):
    """A serving node is asked for plan_gemm's tactic per M bucket (the code clients run),
    not the family's whole space (over 800 kernels per shape, about 17 minutes on 2 cores):
    a manifest's cached.hopper_fp8 build plans exactly those requests; `all_tactics = true`
    plans the space; a value that is not a boolean is refused, saying where."""
    from cached_client.gemm import plan as gemm_plan

    plain, every, bad = (tmp_path / f"{n}.toml" for n in ("plain", "every", "bad"))
    plain.write_text(HOPPER_MANIFEST.format(extra=""))
    every.write_text(HOPPER_MANIFEST.format(extra="all_tactics = true"))
    bad.write_text(HOPPER_MANIFEST.format(extra='all_tactics = "yes"'))
    with pytest.raises(manifests.ManifestError, match="build 0: all_tactics must be true or"):
        manifests.load(bad)
    d = DaemonProcess(tmp_path, workers=1)
    try:
        def planned(path: Path) -> list[dict]:
            out = json.loads(run_cli("warm", "--socket", d.socket, "--manifest", str(path),
                                     "--plan-only", "--json").stdout)
            return out["requests"]["cached.hopper_fp8@sm_90a"]

        expected = gemm_plan.plan_gemm(d.client(timeout=120), 6144, 4096, arch="sm_90a",
                                       max_m=4096, prefetch=False).requests
        assert planned(plain) == [r.to_wire() for r in dict.fromkeys(expected)]
        assert len(expected) <= len(gemm_plan.buckets_up_to(4096))
        assert len(planned(every)) > 300
    finally:
        d.stop()


def test_config_shows_the_running_daemons_settings_and_what_differs(tmp_path: Path):
    """cached config: what a new serve would use, then what the daemon on the socket runs
    with (its flags here), and the names that differ; none answering says so."""
    alone = run_cli("config", "--socket", str(tmp_path / "none.sock"))
    assert f"no daemon answers on {tmp_path / 'none.sock'}" in alone.stdout
    d = DaemonProcess(tmp_path, workers=1, ready_workers=0, extra_args=["--max-bytes", "10MB"])
    try:
        out = run_cli("config", "--socket", d.socket).stdout
        mine, running = out.split(f"\nthe daemon running on {d.socket}:\n")
        assert re.search(r"^max_bytes\s+0 \(no limit\)\s+default", mine, re.M), mine
        assert re.search(r"^max_bytes\s+10 MB \(10000000 bytes\)\s+flag", running, re.M), running
        assert re.search(rf"^store\s+{re.escape(str(d.store))}\s+flag", running, re.M)
        differ = re.search(r"^differs from a new serve: (.*)$", running, re.M).group(1)
        assert {"max_bytes", "store", "workers"} <= set(differ.split(", ")), differ
        assert "socket" not in differ.split(", ")  # the same --socket
        as_json = json.loads(run_cli("config", "--socket", d.socket, "--json").stdout)
        values = {r["name"]: r["value"] for r in as_json["running"]["options"]}
        assert values["max_bytes"] == 10**7 and values["store"] == str(d.store)
    finally:
        d.stop()


def _capacity_rows() -> dict[str, list[int]]:
    """docs/operations.md's Capacity table: the kernel count of each cell, by manifest."""
    text = (ROOT / "docs" / "operations.md").read_text()
    table = text[text.index("## Capacity"):text.index("## Pre-warm manifests")]
    rows = {}
    for line in table.splitlines():
        name = re.search(r"\(`([\w.-]+)`\)|\*\*(all four models together)\*\*", line)
        if line.startswith("| ") and name:
            cells = line.strip("|").split("|")[1:]
            rows[name.group(1) or "all"] = [int(re.search(r"\d+", c).group()) for c in cells]
    return rows


def test_capacity_table_is_what_plan_only_plans(tmp_path: Path):
    """The Llama-3.1-8B row is what `cached warm --manifest llama-3.1-8b --plan-only` plans
    now (bench/capacity.py prints every row); the union row is at least every row."""
    rows = _capacity_rows()
    assert set(rows) == {"llama-3.1-8b", "llama-3.3-70b", "qwen3-32b", "deepseek-v3-dense",
                         "all"}, rows
    for name, cells in rows.items():
        assert all(u >= c for u, c in zip(rows["all"], cells, strict=True)), name
    d = DaemonProcess(tmp_path, workers=1)
    try:
        plan = json.loads(run_cli("warm", "--socket", d.socket, "--manifest", "llama-3.1-8b",
                                  "--plan-only", "--json").stdout)["kernels"]
    finally:
        d.stop()
    assert rows["llama-3.1-8b"] == [plan["flashinfer.mm_fp4@sm_100a"],
                                    plan["flashinfer.mm_fp4@sm_103a"],
                                    plan["cached.hopper_fp8@sm_90a"],
                                    plan["flashinfer.bi.bmm_fp8@sm_100a"]], plan
    assert plan["flashinfer.bi.bmm_fp8@sm_103a"] == plan["flashinfer.bi.bmm_fp8@sm_100a"]
