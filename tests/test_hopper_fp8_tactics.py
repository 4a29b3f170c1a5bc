"""The Hopper FP8 GEMM family on the CPU: tactic space, encoding, validation, launcher
checks, and real sm_90a cross-compilation of a few tactics."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cached.families.hopper_fp8 import tactics as T
from cached.families.hopper_fp8.tactics import (
    HopperFp8Tactic,
    enumerate_tactics,
    smem_bytes,
    tactic_from_params,
)

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    paths = [str(ROOT / "client"), str(ROOT)]
    old = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths + ([old] if old else []))}


# ---------------------------------------------------------------------- enumeration

def test_enumeration_size_and_budget():
    ts = enumerate_tactics(4096, 4096, 4096)
    # 11 feasible tiles (256x256 dropped) x 3 clusters x 2 rasters x 4 swizzles
    assert len(ts) == 264
    assert len({t.name for t in ts}) == len(ts)
    tiles = {(t.tile_m, t.tile_n) for t in ts}
    assert (256, 256) not in tiles and len(tiles) == 11
    for t in ts:
        assert T.MIN_STAGES <= t.stages <= T.MAX_STAGES
        assert smem_bytes(t) <= T.SMEM_CAPACITY_BYTES == 227 * 1024
        # one more stage would not fit, unless capped
        if t.stages < T.MAX_STAGES:
            bigger = T.smem_bytes_for(t.tile_m, t.tile_n, t.stages + 1, t.out_dtype)
            assert bigger > T.SMEM_CAPACITY_BYTES
        assert T.acc_regs_per_thread(t.tile_m, t.tile_n) <= T.MAX_ACC_REGS_PER_THREAD
        assert t.tile_k == 128
        assert t.reduction_order == T.REDUCTION_ORDER
        t.validate()


def test_reduction_order_constants():
    assert T.REDUCTION_ORDER_M_INDEPENDENT is True
    assert "k_tile=128" in T.REDUCTION_ORDER and "scale_after" in T.REDUCTION_ORDER
    assert T.TILE_K == 128


def test_enumeration_is_stable_and_shape_aware():
    a = enumerate_tactics(4096, 4096, 4096)
    b = enumerate_tactics(4096, 4096, 4096)
    assert a == b
    # decode-sized M: the smallest M tile; large M: a 128-row (two-warpgroup) tile
    assert enumerate_tactics(1, 4096, 4096)[0].tile_m == 64
    assert enumerate_tactics(8192, 14336, 4096)[0].tile_m >= 128
    for t in enumerate_tactics(7, 2688, 4096, out_dtype="float16"):
        assert t.out_dtype == "float16"
    assert {t.ab_dtype for t in enumerate_tactics(64, 256, 256, ab_dtype="e5m2")} == {"e5m2"}


def test_register_and_smem_feasibility():
    ok, why = T.tile_is_feasible(256, 256)
    assert not ok and "registers" in why
    assert T.tile_is_feasible(128, 256)[0]  # two warpgroups of 64 rows: 128 regs
    assert T.num_consumer_warpgroups(64) == 1 and T.num_consumer_warpgroups(256) == 2
    # the most that fit for 128x256: 4 stages of 48 KB
    assert T.max_stages_for(128, 256) == 4


# ---------------------------------------------------------------------- encoding

def test_params_round_trip():
    for t in enumerate_tactics(1000, 2688, 4096):
        p = t.to_params()
        assert list(p) == list(T.PARAM_KEYS)
        assert tactic_from_params(p) == t
        assert tactic_from_params(json.loads(json.dumps(p))) == t


def test_stages_default_to_most_that_fit():
    t = tactic_from_params({"tile_m": 128, "tile_n": 128})
    assert t.stages == T.max_stages_for(128, 128)
    assert tactic_from_params({"tile_m": 128, "tile_n": 128, "stages": 0}) == t
    assert tactic_from_params({"tile_m": 128, "tile_n": 128, "stages": 3}).stages == 3


@pytest.mark.parametrize(
    "params, words",
    [
        ({"tile_m": 96}, "tile_m"),
        ({"tile_n": 100}, "tile_n"),
        ({"tile_m": 256, "tile_n": 256}, "registers"),
        ({"tile_m": 128, "tile_n": 256, "stages": 5}, "stages must be in [2, 4]"),
        ({"stages": 1}, "stages"),
        ({"cluster_m": 2, "cluster_n": 2}, "cluster"),
        ({"raster": "x"}, "raster"),
        ({"swizzle": 3}, "swizzle"),
        ({"out_dtype": "float32"}, "out_dtype"),
        ({"ab_dtype": "e4m3fnuz"}, "ab_dtype"),
        ({"tile_m": True}, "int"),
        ({"tile_m": "128"}, "int"),
        ({"tile_k": 64}, "unknown"),
    ],
)
def test_validation_errors(params, words):
    with pytest.raises(ValueError) as e:
        tactic_from_params(params)
    assert words in str(e.value)


def test_frozen():
    t = enumerate_tactics(128, 4096, 4096)[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.tile_m = 64  # type: ignore[misc]


@pytest.mark.parametrize("mnk", [(0, 4096, 4096), (16, 4004, 4096), (16, 4096, 4100), (-1, 16, 16)])
def test_enumerate_rejects_bad_shapes(mnk):
    with pytest.raises(ValueError):
        enumerate_tactics(*mnk)


def test_tactics_module_imports_no_toolchain():
    code = ("import sys, cached.families.hopper_fp8.tactics as t; "
            "t.enumerate_tactics(1, 4096, 4096); "
            "bad = [m for m in ('cutlass', 'torch', 'tvm_ffi') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, env=_env(), timeout=120)


# ---------------------------------------------------------------------- launcher

def test_launcher_rejects_before_launch():
    torch = pytest.importorskip("torch")
    from cached_client.hopper_fp8 import gemm

    calls = []

    def fn(*args):
        calls.append(args)

    f8 = torch.float8_e4m3fn
    s = torch.ones(1)
    cases = [
        (torch.empty(0, 64, dtype=f8), torch.empty(32, 64, dtype=f8), "M = 0"),
        (torch.empty(4, 64, dtype=f8), torch.empty(40, 64, dtype=f8), "multiples of 16"),
        (torch.empty(4, 72, dtype=f8), torch.empty(32, 72, dtype=f8), "multiples of 16"),
        (torch.empty(4, 64, dtype=f8), torch.empty(32, 48, dtype=f8), "K differs"),
        (torch.empty(4, 64, dtype=torch.bfloat16), torch.empty(32, 64, dtype=f8), "float8"),
        (torch.empty(64, 4, dtype=f8).t(), torch.empty(32, 64, dtype=f8), "row-major"),
        (torch.empty(4, 64, dtype=f8), torch.empty(32, 64, dtype=f8), "CUDA"),
    ]
    for a, b, words in cases:
        with pytest.raises(ValueError) as e:
            gemm(fn, a, b, s, s, torch.bfloat16)
        assert words in str(e.value), (words, str(e.value))
    with pytest.raises(TypeError):
        gemm(fn, torch.empty(4, 64, dtype=f8), torch.empty(32, 64, dtype=f8), 1.0, 1.0,
             torch.bfloat16)
    assert calls == []


# ---------------------------------------------------------------------- real compile

@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None,
                    reason="nvidia-cutlass-dsl is not installed")
def test_compile_for_sm90a(tmp_path):
    """Cross-compile three tactics (1 and 2 consumer warpgroups, both cluster shapes,
    e5m2/fp16) for sm_90a on the CPU; check the objects and the exported symbol."""
    chosen = [
        HopperFp8Tactic(64, 128, 1, 1, "m", 1),
        HopperFp8Tactic(128, 256, 2, 1, "n", 8),
        HopperFp8Tactic(256, 128, 1, 2, "m", 2, 0, "float16", "e5m2"),
    ]
    jobs = [{"params": t.normalized().to_params(), "obj": str(tmp_path / f"t{i}.o"),
             "symbol": f"hopper_fp8_test_{i}", "mac": 132 // t.cluster_size}
            for i, t in enumerate(chosen)]
    code = (
        "import json, sys\n"
        "from cached.families.hopper_fp8.compile import compile_to_object\n"
        "from cached.families.hopper_fp8.tactics import tactic_from_params\n"
        "for j in json.loads(sys.argv[1]):\n"
        "    compile_to_object(tactic_from_params(j['params']), j['mac'], j['obj'], j['symbol'])\n"
    )
    env = {**_env(), "CUTE_DSL_ARCH": "sm_90a"}
    subprocess.run([sys.executable, "-c", code, json.dumps(jobs)], check=True, env=env,
                   timeout=540)
    for j in jobs:
        data = Path(j["obj"]).read_bytes()
        assert len(data) > 1000
        assert data[:4] == b"\x7fELF"
        assert j["symbol"].encode() in data


@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None,
                    reason="nvidia-cutlass-dsl is not installed")
def test_compile_refuses_other_arch(tmp_path):
    code = (
        "from cached.families.hopper_fp8.compile import compile_to_object\n"
        "from cached.families.hopper_fp8.tactics import HopperFp8Tactic\n"
        "try:\n"
        "    compile_to_object(HopperFp8Tactic(), 132, 'x.o', 'f')\n"
        "except ValueError as e:\n"
        "    assert 'sm_90a' in str(e)\n"
        "else:\n"
        "    raise SystemExit('no error')\n"
    )
    env = {**_env(), "CUTE_DSL_ARCH": "sm_100a"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120,
                   cwd=tmp_path)


# ---------------------------------------------------------------------- through the daemon

def test_every_tactic_compiles_for_sm90a_through_the_daemon(daemon):
    """The whole tactic space of one shape, planned and compiled by the daemon's workers."""
    import json as _json

    from conftest import run_cli

    out = run_cli("warm", "--socket", daemon.socket, "--family", "cached.hopper_fp8",
                  "--arch", "sm_90a", "--shape", "4096,4096,4096", "--json").stdout
    counts = _json.loads(out.strip().splitlines()[-1])
    assert counts["failed"] == 0 and counts["compiled"] == 264
    requests = daemon.client().plan("cached.hopper_fp8", (4096, 4096, 4096), "sm_90a")
    assert {r.max_active_clusters for r in requests} == {132, 66}
    entries = daemon.client().list()
    assert len({e["kernel_name"] for e in entries}) == 264
    params = [_json.loads(e["params"]) for e in entries]
    assert all(tactic_from_params(p).to_params() == p for p in params)
