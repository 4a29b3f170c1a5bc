"""Scale schemes and exact accumulation of cached.hopper_fp8 (issue 27): the tactic fields,
their classes, the plan options, the launcher's checks, and real sm_90a compiles through the
daemon. Correctness and speed on an H200: bench/gpu/hopper_fp8_schemes.py."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from conftest import ROOT

from cached.families.hopper_fp8 import space as SPACE
from cached.families.hopper_fp8 import tactic as T
from cached.families.hopper_fp8.tactic import HopperFp8Tactic, tactic_from_params

#: the canonical params keys of every tactic before the schemes existed (pdl only when on)
KEYS_BEFORE = ["tile_m", "tile_n", "cluster_m", "cluster_n", "raster", "swizzle", "stages",
               "out_dtype", "ab_dtype", "splits", "split_mode", "swap_ab", "wg_n", "pingpong"]


def test_per_tensor_fast_tactics_keep_their_params_names_and_classes():
    """The default scheme adds no key, no name suffix and no class: old keys stay."""
    for t in SPACE.tactic_space():
        p = t.to_params()
        assert list(p) == KEYS_BEFORE + (["pdl"] if t.pdl else [])
        assert not t.name.endswith(("_tok", "_ex"))
        assert t.reduction_class == f"k128.acc1.s{t.splits}.fixed"
        assert tactic_from_params({**p, "scales": "tensor", "accum": "fast"}).to_params() == p


def test_scheme_tactics_round_trip_with_their_classes():
    from cached.families.hopper_fp8.family import HopperFp8

    fam = HopperFp8()
    want = {("token", "fast"): "k128.acc1.s{s}.fixed.token",
            ("tensor", "exact"): "k128.prom128.s{s}.fixed",
            ("token", "exact"): "k128.prom128.s{s}.fixed.token",
            ("block128", "exact"): "k128.prom128.s{s}.fixed.block128"}
    assert set(want) == set(T.SCHEMES) - {("tensor", "fast")}
    for (scales, accum), pattern in want.items():
        space = SPACE.tactic_space(scales=scales, accum=accum)
        assert space and len({t.name for t in space}) == len(space)
        for t in space:
            p = json.loads(json.dumps(t.to_params()))
            assert p["scales" if scales != "tensor" else "accum"] in ("token", "block128",
                                                                      "exact")
            assert tactic_from_params(p) == t and fam.canonical_params(p, "sm_90a") == p
            cid = fam.reduction_class(p)
            assert cid == pattern.format(s=t.splits) == t.reduction_class
            assert T.class_scheme(cid) == (t.splits, accum, scales)
            assert cid in T.REDUCTION_CLASSES
    # exact: S = 1 and both split modes (each K range promoted on its own), only tiles with
    # room for the promoted sum (and a serial split's running sum: three copies)
    exact_all = SPACE.tactic_space(accum="exact")
    assert {t.splits for t in exact_all} == set(T.SPLIT_CHOICES)
    assert {t.split_mode for t in exact_all if t.splits > 1} == {"cta", "serial"}
    assert all((2 + (t.split_mode == "serial" and t.splits > 1)) * T.acc_regs_per_thread(
        t.tile_m, t.tile_n, t.swap_ab, t.wg_n, t.pingpong) <= T.MAX_ACC_REGS_PER_THREAD
        for t in exact_all)
    assert not [t for t in exact_all if (t.tile_m, t.tile_n) == (256, 192)]
    for s in (2, 4):
        split = SPACE.tactic_space(splits=s, accum="exact")
        assert split == [dataclasses.replace(t, accum="exact")
                         for t in SPACE.tactic_space(splits=s)
                         if (3 if t.split_mode == "serial" else 2) * T.acc_regs_per_thread(
                             t.tile_m, t.tile_n, t.swap_ab, t.wg_n, t.pingpong) <= 192]
        assert {t.reduction_class for t in split} == {f"k128.prom128.s{s}.fixed"}
        # a serial 128 x 128 tile (64 registers a copy) fits three copies, 128 x 256 not
        assert {(t.tile_m, t.tile_n) for t in split if t.split_mode == "serial"} >= {
            (128, 128), (64, 64)}
        assert not [t for t in split if (t.tile_m, t.tile_n) == (128, 256)
                    and t.split_mode == "serial"]
    exact = [t for t in exact_all if t.splits == 1]
    assert SPACE.tactic_space(splits=1, accum="exact") == exact
    # block128: the exact space in its scheme, less the tiles whose warpgroup width splits
    # a weight block unevenly (one scale per 8 columns), one class
    block = SPACE.tactic_space(scales="block128", accum="exact")
    assert {t.splits for t in block} == {1}
    assert ([dataclasses.replace(t, scales="tensor") for t in block]
            == [t for t in exact if SPACE.block_scale_shared(t)])
    assert {t.tile_n // t.wg_n for t in block if not t.swap_ab} == {32, 64, 128}
    assert ({t.tile_n for t in exact if not SPACE.block_scale_shared(t)}
            == {40, 48, 56, 80, 96, 112, 160, 192})
    assert T.class_scheme("k128.prom128.s1.fixed.block128") == (1, "exact", "block128")
    with pytest.raises(ValueError, match="unknown cached.hopper_fp8 reduction class"):
        T.class_scheme("k128.acc1.s1.fixed.block128")
    with pytest.raises(ValueError, match="needs accum='exact'"):
        SPACE.tactic_space(scales="block128")
    # per-token fast: every tactic of the space, in its scheme
    assert len(SPACE.tactic_space(scales="token")) == len(SPACE.tactic_space()) == 922


@pytest.mark.parametrize("params, words", [
    ({"scales": "channel"}, "scales must be one of"),
    ({"accum": "promoted"}, "accum must be one of"),
    ({"tile_m": 128, "tile_n": 256, "accum": "exact", "splits": 2}, r"128 x 3 \(a serial"),
    ({"accum": "exact", "splits": 2, "split_mode": "cta", "scales": "block128"},
     "block128 is not split"),
    ({"tile_m": 256, "tile_n": 128, "accum": "exact"}, "promoted sum"),
    ({"scales": 1}, "scales must be one of"),
    ({"scales": "block128"}, "needs accum='exact'"),
])
def test_bad_scheme_params_are_refused(params, words):
    from cached_client.errors import InvalidTactic

    from cached.families.hopper_fp8.family import HopperFp8

    with pytest.raises(ValueError, match=words):
        tactic_from_params(params)
    with pytest.raises(InvalidTactic, match=words):
        HopperFp8().canonical_params(params, "sm_90a")


def test_plan_options_pick_one_class_of_the_scheme_for_every_m():
    from cached.families.hopper_fp8.family import HopperFp8

    fam = HopperFp8()
    for n, k, s in ((2688, 4096, 1), (2112, 7168, 2), (1024, 16384, 4)):
        assert SPACE.choose_split(n, k, 132) == s
        for scales, accum, cid in (
                ("token", "fast", f"k128.acc1.s{s}.fixed.token"),
                ("tensor", "exact", f"k128.prom128.s{s}.fixed"),
                ("token", "exact", f"k128.prom128.s{s}.fixed.token"),
                ("block128", "exact", "k128.prom128.s1.fixed.block128")):
            classes = set()
            for m in (1, 64, 8192):
                reqs = fam.plan((m, n, k), "sm_90a", 132, {"batch_invariant": True,
                                                           "scales": scales,
                                                           "accumulation": accum})
                classes |= {tactic_from_params(r.params).reduction_class for r in reqs}
            assert classes == {cid}, (n, k, scales, accum)
    # an explicit class picks its scheme; the plan without options is per-tensor fast
    reqs = fam.plan((16, 4096, 4096), "sm_90a", 132,
                    {"reduction_class": "k128.prom128.s1.fixed.token"})
    assert {r.params.get("scales") for r in reqs} == {"token"}
    assert {r.params.get("accum") for r in reqs} == {"exact"}
    assert all("scales" not in r.params and "accum" not in r.params
               for r in fam.plan((16, 4096, 4096), "sm_90a", 132, {"batch_invariant": True}))


@pytest.mark.parametrize("options, words", [
    ({"scales": "block"}, "scales='block' is not one of"),
    ({"scales": "block128", "accumulation": "fast"}, "needs accum='exact'"),
    ({"reduction_class": "k128.acc1.s1.fixed.block128"}, "unknown cached.hopper_fp8 reduction"),
    ({"accumulation": True}, "accumulation=True is not one of"),
    ({"reduction_class": "k128.prom128.s2.fixed.block128"},
     "unknown cached.hopper_fp8 reduction class"),
    ({"reduction_class": "k128.acc1.s1.fixed.token", "scales": "tensor"},
     "contradicts reduction_class"),
    ({"reduction_class": "k128.acc1.s1.fixed", "accumulation": "exact"},
     "contradicts reduction_class"),
])
def test_plan_rejects_bad_scheme_options(options, words):
    from cached_client.errors import InvalidTactic

    from cached.families.hopper_fp8.family import HopperFp8

    with pytest.raises(InvalidTactic, match=words):
        HopperFp8().plan((16, 4096, 4096), "sm_90a", 132, options)


def test_block128_plans_take_the_exact_block_class_for_every_m():
    """scales=block128 defaults to exact and plans one class for every M; a K that is not
    a multiple of 128 is refused with the reason."""
    from cached_client.errors import InvalidTactic

    from cached.families.hopper_fp8.family import HopperFp8

    fam = HopperFp8()
    for m in (1, 64, 4096):
        for opts in ({"scales": "block128", "batch_invariant": True},
                     {"reduction_class": "k128.prom128.s1.fixed.block128"}):
            reqs = fam.plan((m, 4096, 7168), "sm_90a", 132, opts)
            assert reqs and {fam.reduction_class(r.params) for r in reqs} == {
                "k128.prom128.s1.fixed.block128"}
    with pytest.raises(InvalidTactic, match="K % 128 == 0.*K = 4160"):
        fam.plan((16, 4096, 4160), "sm_90a", 132, {"scales": "block128"})


def test_scheme_options_through_the_daemon_and_the_client_plan(daemon):
    """The daemon's hello publishes the new classes; gemm_plan asks for a scheme and gets
    one class of it for every bucket; a bad scheme is refused before the daemon is asked,
    and the daemon still answers afterwards."""
    from cached_client.gemm import plan as gemm_plan

    client = daemon.client()
    info = client.hello(timeout=10).reduction_classes["cached.hopper_fp8"]
    assert info["classes"] == list(T.REDUCTION_CLASSES) and info["m_independent"] is True
    plan = gemm_plan.plan_gemm(client, 4096, 4096, arch="sm_90a", sm_count=132,
                               max_m=256, prefetch=False, scales="token",
                               accumulation="exact")
    assert plan.choice.reduction_class == "k128.prom128.s1.fixed.token"
    assert plan.key.scales == "token" and plan.key.accumulation == "exact"
    # a plan's first requests alone (planned in a worker: the limit travels with the job)
    opts = {"batch_invariant": True, "scales": "token", "accumulation": "exact"}
    full = client.plan_reply("cached.hopper_fp8", (16, 4096, 4096), "sm_90a", 132, opts)
    assert client.plan_reply("cached.hopper_fp8", (16, 4096, 4096), "sm_90a", 132, opts,
                             limit=2).requests == full.requests[:2]
    assert {b.request.params["accum"] for b in plan.choice.buckets} == {"exact"}
    with pytest.raises(ValueError, match="scales must be one of"):
        gemm_plan.plan_gemm(client, 4096, 4096, arch="sm_90a", scales="block",
                            prefetch=False)
    again = gemm_plan.plan_gemm(client, 4096, 4096, arch="sm_90a", sm_count=132, max_m=16,
                                prefetch=False)
    assert again.choice.reduction_class == "k128.acc1.s1.fixed"
    blk = gemm_plan.plan_gemm(client, 4096, 7168, arch="sm_90a", sm_count=132, max_m=8192,
                              prefetch=False, scales="block128")
    assert blk.choice.reduction_class == "k128.prom128.s1.fixed.block128"
    assert blk.key.accumulation == "exact" and len(blk.choice.buckets) > 1
    assert {b.request.params["scales"] for b in blk.choice.buckets} == {"block128"}
    for bad, words in (({"accumulation": "fast"}, "accumulation 'fast'"),
                       ({"k": 4160}, "K = 4160")):
        with pytest.raises(ValueError, match=words):
            gemm_plan.plan_gemm(client, 4096, bad.pop("k", 7168), arch="sm_90a",
                                prefetch=False, scales="block128", **bad)


def test_accumulation_comes_from_the_environment(monkeypatch):
    from cached_client.gemm import plan as gemm_plan

    monkeypatch.delenv(gemm_plan.ACCUMULATION_ENV, raising=False)
    assert gemm_plan.accumulation_from_env() == "fast"
    monkeypatch.setenv(gemm_plan.ACCUMULATION_ENV, "exact")
    assert gemm_plan.accumulation_from_env() == "exact"
    monkeypatch.setenv(gemm_plan.ACCUMULATION_ENV, "promoted")
    with pytest.raises(ValueError, match="CACHED_FP8_ACCUMULATION='promoted'"):
        gemm_plan.accumulation_from_env()


def test_launcher_checks_per_token_scales_before_launch():
    torch = pytest.importorskip("torch")
    from cached_client.gemm.hopper_fp8 import gemm

    calls = []

    def fn(*args):
        calls.append(args)

    f8 = torch.float8_e4m3fn
    a, b = torch.empty(4, 64, dtype=f8), torch.empty(32, 64, dtype=f8)
    tok = {"tile_m": 128, "tile_n": 128, "scales": "token"}
    cases = [
        (torch.ones(1), torch.ones(32), tok, "a_scale must be a contiguous float32 tensor of 4"),
        (torch.ones(4, 1), torch.ones(16), tok, "b_scale must be a contiguous float32 tensor"),
        (torch.ones(4, dtype=torch.float64), torch.ones(32), tok, "of 4 elements"),
        (torch.ones(8)[::2], torch.ones(32), tok, "contiguous"),
        (torch.ones(4), torch.ones(32), {"tile_m": 128, "tile_n": 128}, "1-element"),
        (torch.ones(4), torch.ones(32), {**tok, "scales": "row"}, "scales must be one of"),
    ]
    for sa, sb, params, words in cases:
        with pytest.raises(ValueError) as e:
            gemm(fn, a, b, sa, sb, torch.bfloat16, params=params)
        assert words in str(e.value), (words, str(e.value))
    # valid per-token scales pass the scale checks and stop at the CPU tensors
    with pytest.raises(ValueError, match="CUDA"):
        gemm(fn, a, b, torch.ones(4, 1), torch.ones(32, 1), torch.bfloat16, params=tok)
    assert calls == []


def test_launcher_checks_block_scales_before_launch():
    torch = pytest.importorskip("torch")
    from cached_client.gemm.hopper_fp8 import gemm

    calls = []

    def fn(*args):
        calls.append(args)

    f8 = torch.float8_e4m3fn
    a, b = torch.empty(4, 256, dtype=f8), torch.empty(160, 256, dtype=f8)
    blk = {"tile_m": 128, "tile_n": 128, "scales": "block128", "accum": "exact"}
    col = torch.ones(2, 4).t()  # (4, 2) column-major, as vLLM's CUTLASS path passes it
    cases = [
        (torch.ones(4, 2), torch.ones(2, 2), "a_scale must have strides (1, 4)"),
        (col, torch.ones(2, 2).t().contiguous().t(), "b_scale must have strides (2, 1)"),
        (col, torch.ones(1, 2), "b_scale must be a float32 (2, 2) tensor"),
        (torch.ones(4), torch.ones(2, 2), "a_scale must be a float32 (4, 2) tensor"),
        (col.double(), torch.ones(2, 2), "float32"),
    ]
    for sa, sb, words in cases:
        with pytest.raises(ValueError) as e:
            gemm(fn, a, b, sa, sb, torch.bfloat16, params=blk)
        assert words in str(e.value), (words, str(e.value))
    a2, b2 = torch.empty(4, 208, dtype=f8), torch.empty(160, 208, dtype=f8)
    with pytest.raises(ValueError, match="K % 128 == 0.*K = 208"):
        gemm(fn, a2, b2, torch.ones(4, 2), torch.ones(2, 2), torch.bfloat16, params=blk)
    # valid block scales (N = 160: a partial last weight block) stop at the CPU tensors
    with pytest.raises(ValueError, match="CUDA"):
        gemm(fn, a, b, col, torch.ones(2, 2), torch.bfloat16, params=blk)
    assert calls == []


def _scheme_variants() -> list[HopperFp8Tactic]:
    """One of each code path the schemes touch: the register epilogue (swap_ab) with both,
    ping-pong with both (each warpgroup's own MMA slice), wg_n = 2 per-token, a 'cta' split
    per-token (the last unit's sum scaled), exact 'cta' splits on swap_ab per-token and on
    the TMA epilogue per-tensor (each unit's promoted sum is its partial), an exact serial
    split with three accumulator copies (128 x 128, and ping-pong) and one per-token in two wgmma
    accumulators (64 x 64), exact with two
    wgmma accumulators in turn (64 x 80, swap_ab; kernel.promoted_overlapped), the 128-row tile
    exact in e5m2 / fp16, and
    block128 on the TMA epilogue, swap_ab and ping-pong (the scale indices per path), and
    block128 on a 192-wide tile (one scale per 8 columns, loaded per K tile; outside the
    block space, served when a request names it)."""
    H = HopperFp8Tactic
    return [t.normalized() for t in (
        H(8, 64, swap_ab=True, scales="token", accum="exact"),
        H(64, 128, pingpong=True, scales="token", accum="exact"),
        H(64, 128, wg_n=2, scales="token"),
        H(64, 128, splits=4, split_mode="cta", scales="token"),
        H(16, 64, swap_ab=True, splits=4, split_mode="cta", scales="token", accum="exact"),
        H(64, 128, splits=2, split_mode="cta", accum="exact"),
        H(128, 128, splits=4, accum="exact"),
        H(64, 128, splits=2, pingpong=True, accum="exact"),
        H(64, 64, splits=4, scales="token", accum="exact"),
        H(64, 80, accum="exact"),
        H(128, 128, out_dtype="float16", ab_dtype="e5m2", accum="exact"),
        H(128, 128, scales="block128", accum="exact"),
        H(8, 64, swap_ab=True, scales="block128", accum="exact"),
        H(64, 128, pingpong=True, scales="block128", accum="exact"),
        H(128, 192, scales="block128", accum="exact"),
    )]


NVDISASM = ROOT / ".venv-jit" / "triton" / "backends" / "nvidia" / "bin" / "nvdisasm"


def wgmma_waits(path: str) -> dict[str, int]:
    """Counts in the SASS of the sm_90a cubin inside a served object or library: wgmma
    instructions (``GMMA``; ``bf16_wgmma``: those on bf16 operands, HGMMA ... F32.BF16),
    waits for all of them (``wait0``, WARPGROUP.DEPBAR.LE gsb0, 0x0), for all but one
    (``wait1``), and local-memory loads (``spills``)."""
    import re
    import subprocess
    import tempfile

    data = open(path, "rb").read()
    start = data.find(b"\x7fELF", 1)  # the device ELF embedded in the host one
    assert start > 0, f"no cubin inside {path}"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(data[start:])
        f.flush()
        sass = subprocess.run([str(NVDISASM), "-c", f.name], check=True, capture_output=True,
                              text=True).stdout
    waits = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x(\d)", sass)
    return {"GMMA": sass.count("GMMA"), "wait0": waits.count("0"), "wait1": waits.count("1"),
            "spills": len(re.findall(r"\bLDL", sass)),
            "bf16_wgmma": len(re.findall(r"HGMMA\.\S+\.F32\.BF16", sass))}


def test_scheme_tactics_compile_for_sm90a_through_the_daemon(daemon):
    """The variants above, compiled by the daemon's workers: each served as a real artifact
    whose metadata names its class. In the SASS: no spills (but in the one outside the
    spaces), no wgmma serialized by ptxas
    (at most one full wait per K tile's four wgmma), and the exact kernels that take two K
    tiles at a time (kernel.promoted_overlapped) wait for all but one."""
    from cached_client.keys import KernelRequest

    from cached.families.hopper_fp8.fragments import PREFETCH_REGS

    variants = _scheme_variants()
    spaces = {t.name for sc, acc in T.SCHEMES
              for od, ab in (("bfloat16", "e4m3"), ("float16", "e5m2"))
              for t in SPACE.tactic_space(od, ab, scales=sc, accum=acc)}
    assert [t.name for t in variants if t.name not in spaces] == [variants[-1].name]
    client = daemon.client()
    requests = [KernelRequest(family="cached.hopper_fp8", params=t.to_params(), arch="sm_90a",
                              sm_count=132, max_active_clusters=132 // t.cluster_size)
                for t in variants]
    client.prefetch(requests)
    for t, r in zip(variants, requests, strict=True):
        art = client.get(r, timeout=900)
        path = art.library_path or art.object_path
        assert path and os.path.getsize(path) > 1000
        got = wgmma_waits(path)
        # (the 192-wide block128 tile, outside every space, spills: docs/history.md)
        assert got["GMMA"] >= 4 and (got["spills"] == 0) == (t.name in spaces), (t.name, got)
        assert 4 * got["wait0"] <= got["GMMA"], (t.name, got)  # serialized: one per wgmma
        regs = T.acc_regs_per_thread(t.tile_m, t.tile_n, t.swap_ab, t.wg_n, t.pingpong)
        two_at_a_time = (t.accum == "exact" and t.scales != "block128" and (
            T.acc_sets(t.splits, t.split_mode, t.accum) + 1) * regs <= PREFETCH_REGS)
        if t.accum == "exact":
            assert (got["wait1"] > 0) == two_at_a_time, (t.name, got)
    listed = {e["kernel_name"]: e for e in client.list()}
    for t in variants:
        assert f"{t.name}_mac{132 // t.cluster_size}" in listed


def test_block_scale_sharing_keys_follow_the_wgmma_fragment_and_refuse_other_shapes():
    """The block128 promotion loads one scale per row key and per group key
    (kernel.fragment_keys); the H200 bench checks them against float64 on ragged shapes."""
    from cached.families.hopper_fp8.fragments import fragment_keys

    keys = fragment_keys(((2, 2, 16), 1, 1))  # a 64 x 128 wgmma: 64 values a thread
    assert len(keys) == 64
    assert len({k[0] for k in keys}) == 2  # rows r and r + 8
    assert len({k[1] for k in keys}) == 16  # 8-column groups
    assert len({k[2] for k in keys}) == 32  # columns
    # colexicographic: v = pair + 2 * half + 4 * group
    assert keys[1] == ((0, 0), (0, 0), (1, 0, 0)) and keys[2][0] == (1, 0)
    assert keys[4][1] == (1, 0)
    assert len(fragment_keys(((2, 2), 1, 1))) == 4  # N = 8 (swap_ab decode tiles)
    assert len({k[0] for k in fragment_keys(((2, 2, 8), 2, 1))}) == 4  # MMA_M = 2
    for bad in (((4, 2, 8), 1, 1), ((2, 2, 8), 1), (2, 2, 8, 1, 1)):
        with pytest.raises(ValueError, match="unexpected wgmma accumulator fragment"):
            fragment_keys(bad)


def test_block_pair_keys_share_one_scale_per_weight_block_where_the_fragment_allows():
    """A fragment W columns wide (N_atom x MMA_N) whose W divides 128 or is a multiple of
    it takes one b_scale per 128-column weight block (a 128-wide fragment: 2 products per
    K tile, not 32); any other width keeps one key per 8-column group, which never spans
    two blocks (kernel.block_pair_keys)."""
    from cached.families.hopper_fp8.fragments import block_pair_keys, fragment_keys

    def products(shape):
        return len(set(block_pair_keys(shape)))

    assert products(((2, 2, 16), 1, 1)) == 2  # 64 x 128: 2 rows x 1 block
    assert products(((2, 2, 32), 1, 1)) == 4  # 64 x 256: 2 rows x 2 blocks
    assert products(((2, 2, 8), 1, 1)) == 2  # 64 x 64: inside one block
    assert products(((2, 2, 8), 2, 2)) == 4  # 4 rows (MMA_M = 2) x two 64-wide atoms: 1 block
    assert products(((2, 2, 6), 1, 1)) == 12  # 48 wide: 6 groups, no sharing
    keys, full = block_pair_keys(((2, 2, 32), 1, 1)), fragment_keys(((2, 2, 32), 1, 1))
    for (rk, bk), (frk, gk, _) in zip(keys, full, strict=True):
        assert rk == frk and bk == (gk[0] * 8 // 128,)  # groups 0-15: block 0, 16-31: 1
    with pytest.raises(ValueError, match="unexpected wgmma accumulator fragment"):
        block_pair_keys(((4, 2, 8), 1, 1))
