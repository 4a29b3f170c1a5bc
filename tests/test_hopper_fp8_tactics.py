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

from cached.families.hopper_fp8 import cost as COST
from cached.families.hopper_fp8 import space as SPACE
from cached.families.hopper_fp8 import tactic as T
from cached.families.hopper_fp8 import winners as WIN
from cached.families.hopper_fp8.space import enumerate_tactics
from cached.families.hopper_fp8.tactic import HopperFp8Tactic, smem_bytes, tactic_from_params

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    paths = [str(ROOT / "client"), str(ROOT)]
    old = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths + ([old] if old else []))}


# ---------------------------------------------------------------------- enumeration

def test_enumeration_size_and_budget():
    with_twins = enumerate_tactics(4096, 4096, 4096, splits=1)
    assert len(with_twins) == 454  # + the 41 pdl twins (test_pdl_twins)
    every = [t for t in with_twins if not t.pdl]
    # 11 feasible tiles of the widths 64/128/192/256 (256x256 dropped) x 3 clusters x 2
    # rasters x 4 swizzles, 12 tiles of the widths 80/96/112/160 x 3 clusters x 2 rasters
    # (swizzle 1), the 8 swap_ab tiles, 8 wg_n=2 widths x 3 clusters, 6 ping-pong tiles
    # (64 x 3 widths, 128 x 3 widths) x 3 clusters x 2 rasters and the 3 narrow decode
    # tiles 64 x 40/48/56 x 3 clusters (raster m, swizzle 1)
    assert len(every) == 413 and len({t.name for t in every}) == 413
    swapped = [t for t in every if t.swap_ab]
    assert {(t.tile_m, t.tile_n) for t in swapped} == {
        (tm, tn) for tm in (8, 16, 32, 64) for tn in (64, 128)}
    for t in swapped:
        assert t.cluster_size == 1 and t.name.endswith("_sw")
        assert t.stages == min(T.SWAP_MAX_STAGES, T.max_stages_for(t.tile_m, t.tile_n,
                                                                   swap_ab=True))
        assert smem_bytes(t) <= T.SMEM_CAPACITY_BYTES
        # the weight rows are the wgmma M side: 64 -> one consumer warpgroup, 128 -> two
        assert t.consumer_warpgroups == (1 if t.tile_n == 64 else 2)
        assert t.reduction_class == "k128.acc1.s1.fixed"
    ts = [t for t in every if not t.swap_ab and t.wg_n == 1 and not t.pingpong]
    assert len(ts) == 345
    assert all(t.swizzle == 1 for t in ts if t.tile_n not in SPACE.SWIZZLED_TILE_N)
    assert len({t.name for t in ts}) == len(ts)
    tiles = {(t.tile_m, t.tile_n) for t in ts}
    assert (256, 256) not in tiles and len(tiles) == 26
    assert {tn for _, tn in tiles} == {40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 256}
    for t in ts:
        cap = T.SWAP_MAX_STAGES if t.tile_n in T.NARROW_TILE_N else T.MAX_STAGES
        assert T.MIN_STAGES <= t.stages <= cap
        assert smem_bytes(t) <= T.SMEM_CAPACITY_BYTES == 227 * 1024
        # one more stage would not fit, unless capped
        if t.stages < cap:
            bigger = T.smem_bytes_for(t.tile_m, t.tile_n, t.stages + 1, t.out_dtype)
            assert bigger > T.SMEM_CAPACITY_BYTES
        assert T.acc_regs_per_thread(t.tile_m, t.tile_n) <= T.MAX_ACC_REGS_PER_THREAD
        assert t.tile_k == 128
        assert t.reduction_order == T.REDUCTION_ORDER
        assert t.reduction_class == "k128.acc1.s1.fixed"
        t.validate()


def test_split_space():
    """S > 1: 'cta' on six decode tiles, 'serial' on eighteen tiles that fit two
    accumulators (the six wave tiles among them) and on six of them with clusters 1x2 and
    2x1 and both rasters, 'serial' on seven wg_n=2 tiles with clusters 1x1 and 2x1,
    'serial' ping-pong on 64 x (128, 192) with clusters 1x1 and 2x1 and both rasters, both
    modes on the eight swap_ab tiles; 86 per S, 757 tactics over the five classes. The wave
    width 144 is planned in the split classes only."""
    for s in T.SPLIT_CHOICES[1:]:
        ts = [t for t in SPACE.tactic_space(splits=s) if not t.pdl]  # twins: test_pdl_twins
        assert len(ts) == 86
        cta = [t for t in ts if t.split_mode == "cta" and not t.swap_ab]
        serial = [t for t in ts if t.split_mode == "serial" and not t.swap_ab
                  and t.wg_n == 1]
        wgn = [t for t in ts if t.wg_n == 2]
        pp = [t for t in serial if t.pingpong]
        assert len(cta) == 6 and len(serial) == 50 and len(wgn) == 14 and len(pp) == 8
        assert all(t.split_mode == "serial" and t.tile_m == 64 for t in wgn)
        assert {(t.tile_m, t.tile_n) for t in pp} == set(SPACE.PINGPONG_SPLIT_TILES)
        assert len([t for t in serial if t.cluster_size == 2 and not t.pingpong]) == 24
        assert {t.raster for t in serial if t.cluster_size == 2} == {"m", "n"}
        plain = {(t.tile_m, t.tile_n, t.raster) for t in serial if t.cluster_size == 1}
        assert set(SPACE.SPLIT_WAVE_TILES) <= plain
        assert {t.tile_n for t in wgn} >= {80, 112, 144}
        for mode in T.SPLIT_MODES:
            assert len([t for t in ts if t.swap_ab and t.split_mode == mode]) == 8
        assert all(t.splits == s for t in ts)
        assert all(t.cluster_size == 1 for t in ts if t.split_mode == "cta" or t.swap_ab)
        for t in serial:
            assert 2 * T.acc_regs_per_thread(t.tile_m, t.tile_n, pingpong=t.pingpong) \
                <= T.MAX_ACC_REGS_PER_THREAD
        for t in ts:
            t.validate()
    assert not {t for t in SPACE.tactic_space(splits=1) if t.tile_n in T.WAVE_TILE_N}
    space = SPACE.tactic_space()
    assert len([t for t in space if not t.pdl]) == 757
    assert len(space) == 922 == len({t.name for t in space})
    assert len(enumerate_tactics(4096, 4096, 4096)) == 922


def test_a_width_the_cost_file_lacks_is_interpolated_between_its_neighbours():
    """128 x 144 (unmeasured) costs, per M regime, the linear mix of 128 x 128 and 128 x 160
    at 1/2; wg_n = 2 at 112 lies between 96 and 128 at 1/2; a measured tile is its table
    entry; a width outside the measured ones scales with the operand bytes."""
    table = COST.cost_model()["US_PER_K_TILE"]
    wg = COST.cost_model()["WG_N_US_PER_K_TILE"]
    assert (128, 144) not in table and (64, 112) not in wg
    for m, r in ((16, 0), (512, 1), (4096, 2)):
        want = (table[(128, 128)][r] + table[(128, 160)][r]) / 2
        assert abs(COST._per_k_tile_us(128, 144, m) - want) < 1e-12
        want = (wg[(64, 96)][r] + wg[(64, 128)][r]) / 2
        assert abs(COST._per_k_tile_us(64, 112, m, wg_n=2) - want) < 1e-12
        assert COST._per_k_tile_us(128, 160, m) == table[(128, 160)][r]
    assert COST._per_k_tile_us(256, 256, 16) == 0.0032 * 512 * 4


def test_reduction_order_constants():
    assert T.REDUCTION_ORDER_M_INDEPENDENT is True
    assert "k_tile=128" in T.REDUCTION_ORDER and "scale_after" in T.REDUCTION_ORDER
    assert T.TILE_K == 128
    # the per-tensor fast ids first, as published before the scale schemes existed
    assert T.REDUCTION_CLASSES[:5] == ("k128.acc1.s1.fixed", "k128.acc1.s2.fixed",
                                       "k128.acc1.s4.fixed", "k128.acc1.s8.fixed",
                                       "k128.acc1.s16.fixed")
    assert T.REDUCTION_CLASSES[5:] == (
        "k128.acc1.s1.fixed.token", "k128.acc1.s2.fixed.token", "k128.acc1.s4.fixed.token",
        "k128.acc1.s8.fixed.token", "k128.acc1.s16.fixed.token",
        "k128.prom128.s1.fixed", "k128.prom128.s1.fixed.token",
        "k128.prom128.s1.fixed.block128",
        "k128.prom128.s2.fixed", "k128.prom128.s4.fixed", "k128.prom128.s8.fixed",
        "k128.prom128.s16.fixed", "k128.prom128.s2.fixed.token", "k128.prom128.s4.fixed.token",
        "k128.prom128.s8.fixed.token", "k128.prom128.s16.fixed.token")


def test_reduction_class_round_trips_through_canonical_params():
    from cached.families.hopper_fp8.family import HopperFp8

    fam = HopperFp8()
    for t in SPACE.tactic_space():
        cid = t.reduction_class
        assert cid == T.reduction_class_id(t.splits) and T.splits_of_class(cid) == t.splits
        params = fam.canonical_params(json.loads(json.dumps(t.to_params())), "sm_90a")
        assert params == t.to_params()
        assert fam.reduction_class(params) == cid
        assert tactic_from_params(params).reduction_class == cid
        # the mode is no part of the class: the same tile in the other mode, same class
        if t.splits > 1:
            assert "split_mode" in params and cid.endswith(f".s{t.splits}.fixed")
    # params written before split-K existed are S = 1
    assert fam.reduction_class({"tile_m": 128, "tile_n": 128}) == "k128.acc1.s1.fixed"
    # params written before swap_ab existed are unswapped; swapping the operands keeps the
    # class (bitwise equal on an H200: docs/history.md)
    assert tactic_from_params({"tile_m": 128, "tile_n": 128}).swap_ab is False
    for s in T.SPLIT_CHOICES:
        for mode in ("serial", "cta") if s > 1 else ("serial",):
            p = {"tile_m": 8, "tile_n": 64, "swap_ab": True, "splits": s, "split_mode": mode}
            canon = fam.canonical_params(p, "sm_90a")
            assert canon["swap_ab"] is True and fam.reduction_class(canon) == \
                T.reduction_class_id(s)
    with pytest.raises(ValueError, match="unknown cached.hopper_fp8 reduction class"):
        T.splits_of_class("k128.acc1.s3.fixed")
    from cached_client.errors import InvalidTactic

    with pytest.raises(InvalidTactic):
        fam.reduction_class({"splits": 3})


def test_family_base_declares_no_class():
    from cached.families.base import Family

    class NoClass(Family):
        name, arches = "x", ("sm_90a",)

        def canonical_params(self, params, arch):
            return dict(params)

        def source_sha256(self):
            return "0"

        def plan(self, shape, arch, sm_count, options):
            return []

        def build(self, request, workdir):
            raise NotImplementedError

    assert NoClass().reduction_class({"a": 1}) is None


def test_choose_split_depends_on_n_k_and_device_only():
    import inspect

    # no M: the class of a batch-invariant plan is fixed per (N, K, operand type, device)
    assert list(inspect.signature(SPACE.choose_split).parameters) == ["n", "k", "sm_count",
                                                                       "ab_dtype"]
    for n in (512, 1024, 2112, 2688, 4096, 4608, 7168, 8192, 14336, 28672, 57344):
        for k in (512, 1536, 2304, 4096, 7168, 14336, 28672):
            s = SPACE.choose_split(n, k, 132)
            assert s in T.SPLIT_CHOICES and s <= SPACE.SPLIT_MAX
            # every split walks at least 28 K tiles, and the decode CTAs (one per 64 weight
            # rows and split) fill at most half the SMs
            assert s == 1 or k >= SPACE.SPLIT_MIN_K_PER_SPLIT * s
            assert s == 1 or -(-n // SPACE.SPLIT_TILE_N) * s * SPACE.SPLIT_SM_SHARE <= 132
    # what the H200 wide run picked (docs/history.md): with the swap_ab decode tiles,
    # S = 1 but for the narrowest long-K projection
    assert [SPACE.choose_split(n, k, 132) for n, k in (
        (4096, 4096), (2688, 4096), (4608, 2688), (14336, 4096), (4096, 14336),
        (5120, 25600), (8192, 28672), (2112, 7168), (4096, 512))] == [1, 1, 1, 1, 1, 1, 1, 2, 1]
    # fewer SMs: fewer splits; a narrower N with a long K: more
    assert SPACE.choose_split(2112, 7168, 64) == 1
    assert SPACE.choose_split(1024, 28672, 132) == 4 and SPACE.choose_split(1024, 28672, 64) == 2
    for bad in ((0, 4096, 132), (4096, 4096, 0), (4096.0, 4096, 132), (4096, 4096, 132, "f8")):
        with pytest.raises(ValueError):
            SPACE.choose_split(*bad)
    # bf16 operands: K counted in bytes of an operand row (the same 128-byte K tiles)
    for n, k in ((2112, 7168), (1024, 28672), (1024, 14336), (4096, 4096)):
        assert SPACE.choose_split(n, k, 132, "bf16") == SPACE.choose_split(n, 2 * k, 132)


def test_enumeration_is_stable_and_shape_aware():
    a = enumerate_tactics(4096, 4096, 4096)
    b = enumerate_tactics(4096, 4096, 4096)
    assert a == b
    # the model (an (N, K) with no recorded winners); large M: a 128-row (two-warpgroup) tile
    assert (14336, 4160) not in {key[1:] for key in WIN.recorded_winners()}
    # memory-bound decode: a swap_ab tile of few tokens (more CTAs streaming the weight;
    # the measured winners at M = 1 are 8- and 16-token tiles)
    first = enumerate_tactics(1, 14336, 4160)[0]
    assert first.swap_ab and first.tile_m <= 16
    assert enumerate_tactics(8192, 14336, 4160)[0].tile_m >= 128
    for t in enumerate_tactics(7, 2688, 4096, out_dtype="float16"):
        assert t.out_dtype == "float16"
    assert {t.ab_dtype for t in enumerate_tactics(64, 256, 256, ab_dtype="e5m2")} == {"e5m2"}


def test_recorded_winners_come_first():
    """A recorded (device, N, K) ranks the measured winner of each class first, for the
    M bucket (the smallest recorded M >= M); another device or (N, K) uses the model."""
    per = WIN.recorded_winners()[(132, 4096, 14336)]
    assert set(per) == {1, 2, 4}
    for s, row in per.items():
        for m, _key, us in row:
            for mm in {m, max(1, m - 1)}:
                first = enumerate_tactics(mm, 4096, 14336, splits=s)[0]
                bucket = next(r for r in row if r[0] >= mm)
                assert WIN.recorded_key(first) == bucket[1] and first.splits == s
            assert us > 0
    # past the last bucket: the largest one
    assert WIN.recorded_key(enumerate_tactics(20000, 4096, 14336, splits=4)[0]) == per[4][-1][1]
    # all classes: the fastest recorded winner first
    m = 1
    best = min((row[0][2], s) for s, row in per.items())[1]
    assert enumerate_tactics(m, 4096, 14336)[0].splits == best
    # another device: the model's order
    model = enumerate_tactics(1, 4096, 14336, num_sms=114, splits=4)
    assert model == sorted(model, key=lambda t: (COST.rank_key(t, 1, 4096, 14336, 114), t.name))
    # every recorded key names a tactic of the family's space, or the pdl twin of one
    names = set(SPACE.recordable_tactics())
    for (_, n, k), per in WIN.recorded_winners().items():
        for s, row in per.items():
            for m, _key, _us in row:
                assert enumerate_tactics(m, n, k, splits=s)[0].name in names


def test_register_and_smem_feasibility():
    ok, why = T.tile_is_feasible(256, 256)
    assert not ok and "registers" in why
    assert T.tile_is_feasible(128, 256)[0]  # two warpgroups of 64 rows: 128 regs
    assert T.num_consumer_warpgroups(64) == 1 and T.num_consumer_warpgroups(256) == 2
    # the most that fit for 128x256: 4 stages of 48 KB
    assert T.max_stages_for(128, 256) == 4
    # swap_ab: 9 KB stages (64 weight rows + 8 tokens), capped at 16; 24 KB ones: 9
    assert T.max_stages_for(8, 64, swap_ab=True) == T.SWAP_MAX_STAGES == 16
    assert T.max_stages_for(64, 128, swap_ab=True) == 9
    assert T.acc_regs_per_thread(8, 128, swap_ab=True) == 4  # two warpgroups of 64 x 8
    # the epilogue's column sub-tile divides every tile width: 16 for 80 and 112
    for tm in T.TILE_M_CHOICES:
        for tn in T.TILE_N_CHOICES:
            em, en = T.epilogue_tile(tm, tn)
            assert tn % en == 0 and en == (16 if tn in (80, 112) else 32)
    assert T.acc_regs_per_thread(256, 160) == 160 and T.max_stages_for(256, 160) == 4


def test_consumer_warpgroups_along_n():
    """wg_n=2: a 64-row tile whose N is split between two consumer warpgroups (each 64 x
    tile_n/2 wgmma, the K order unchanged): the class of its S, two consumer warpgroups,
    half the accumulator registers, one C buffer for the whole tile (the epilogue's one TMA
    store) and up to SWAP_MAX_STAGES stages."""
    for tn in SPACE.WG_N_TILE_N:
        one = HopperFp8Tactic(64, tn).normalized()
        two = HopperFp8Tactic(64, tn, wg_n=2).normalized()
        assert two.consumer_warpgroups == 2 and one.consumer_warpgroups == 1
        assert two.threads_per_cta == 384
        assert T.acc_regs_per_thread(64, tn, wg_n=2) * 2 == T.acc_regs_per_thread(64, tn)
        assert (tn // 2) % 8 == 0  # the wgmma N step
        assert two.reduction_class == one.reduction_class == "k128.acc1.s1.fixed"
        assert two.reduction_order == one.reduction_order
        epi = -(-64 * tn * 2 // 1024) * 1024  # bf16, 1024-B aligned
        assert two.stages == min(T.SWAP_MAX_STAGES,
                                 (T.SMEM_CAPACITY_BYTES - 2 * 1024 - epi) // ((64 + tn) * 128))
        assert T.smem_bytes(two) == 2 * 1024 + epi + two.stages * (64 + tn) * 128
        assert T.smem_bytes(two) <= T.SMEM_CAPACITY_BYTES
        assert two.name == one.name.replace(f"_st{one.stages}_", f"_st{two.stages}_") + "_wn2"
        assert WIN.recorded_key(two) == f"n64x{tn}m"
        assert WIN.tactic_from_key(f"n64x{tn}m@2x1", 1, "bfloat16", "e4m3") == dataclasses.replace(
            two, cluster_m=2)
        assert tactic_from_params(two.to_params()) == two
    s2 = HopperFp8Tactic(64, 96, splits=2, wg_n=2).normalized()
    assert s2.reduction_class == "k128.acc1.s2.fixed" and WIN.recorded_key(s2) == "n64x96ms"
    # params written before wg_n existed have one consumer warpgroup along N
    assert tactic_from_params({"tile_m": 64, "tile_n": 80}).wg_n == 1


def test_narrow_decode_tiles():
    """64 x 40/48/56 (tokens on the wgmma M side, 40-56 weight rows on its N side): one
    consumer warpgroup, the class of S = 1, clusters 1x1/2x1/1x2, raster m, swizzle 1, up
    to SWAP_MAX_STAGES stages, the whole tile staged for one TMA store (tile_epilogue);
    more CTAs than 64-row tiles on N = 4096..5120 (88-100 for 64 x 48 / 56)."""
    space = [t for t in SPACE.tactic_space(splits=1) if t.tile_n in T.NARROW_TILE_N
             and t.wg_n == 1 and not t.pdl]
    assert len(space) == 9 and T.NARROW_TILE_N == (40, 48, 56)
    assert {(t.tile_n, t.cluster_m, t.cluster_n) for t in space} == {
        (tn, cm, cn) for tn in (40, 48, 56) for cm, cn in T.CLUSTER_CHOICES}
    for t in space:
        assert t.tile_m == 64 and t.raster == "m" and t.swizzle == 1 and t.wg_n == 1
        assert not t.swap_ab and not t.pingpong and t.consumer_warpgroups == 1
        assert t.reduction_class == "k128.acc1.s1.fixed"
        assert t.reduction_order == T.REDUCTION_ORDER
        assert T.tile_epilogue(t.tile_n, t.wg_n, t.swap_ab)
        epi = -(-64 * t.tile_n * 2 // 1024) * 1024  # the whole bf16 tile, 1024-B aligned
        assert t.stages == min(T.SWAP_MAX_STAGES,
                               (T.SMEM_CAPACITY_BYTES - 2 * 1024 - epi)
                               // ((64 + t.tile_n) * 128))
        assert T.smem_bytes(t) == 2 * 1024 + epi + t.stages * (64 + t.tile_n) * 128
        assert T.smem_bytes(t) <= T.SMEM_CAPACITY_BYTES
        assert T.acc_regs_per_thread(64, t.tile_n) == t.tile_n // 2
        key = WIN.recorded_key(t)
        assert WIN.tactic_from_key(key, 1, "bfloat16", "e4m3") == t
        assert tactic_from_params(t.to_params()) == t
    assert [t.stages for t in space if t.cluster_size == 1] == [16, 15, 14]
    assert WIN.recorded_key(HopperFp8Tactic(64, 48, 2, 1).normalized()) == "64x48m@2x1"
    # wg_n = 2 on 48 columns (two 64 x 24 wgmma), in the space with its three clusters
    two = [t for t in SPACE.tactic_space(splits=1) if t.wg_n == 2 and t.tile_n == 48
           and not t.pdl]
    assert len(two) == 3 and all(T.tile_epilogue(48, 2) for _ in two)
    assert WIN.recorded_key(two[0]) == "n64x48m" and two[0].consumer_warpgroups == 2
    # CTAs on the weight stream at M <= 64
    assert [COST.work_units(HopperFp8Tactic(64, tn).normalized(), 64, 4096)
            for tn in (40, 48, 56, 64)] == [103, 86, 74, 64]
    assert [COST.work_units(HopperFp8Tactic(64, tn).normalized(), 64, 5120)
            for tn in (48, 56)] == [107, 92]
    # the other widths keep their epilogue (no tile epilogue unless wg_n = 2)
    assert not any(T.tile_epilogue(tn, 1) for tn in T.TILE_N_CHOICES)
    assert not T.tile_epilogue(48, 1, swap_ab=True)
    # the cost model has a row for each (not the unmeasured-tile fallback): M <= 64 from
    # the H200 decode7 run, under 64x64's; past M = 64 (not timed) 64x64's figures; and a
    # serial split of a narrow tile is a valid tactic of its class
    for t in space:
        plain = COST.cost_model()["US_PER_K_TILE"]
        per = plain[(64, t.tile_n)]
        assert COST._per_k_tile_us(64, t.tile_n, 64) == per[0] < plain[(64, 64)][0]
        assert per[1:] == plain[(64, 64)][1:]
    assert (64, 48) in COST.cost_model()["WG_N_US_PER_K_TILE"]
    s2 = HopperFp8Tactic(64, 48, splits=2).normalized()
    assert s2.reduction_class == "k128.acc1.s2.fixed" and WIN.recorded_key(s2) == "64x48ms"


def test_pingpong_tactics():
    """pingpong: two consumer warpgroups with whole tile_m x tile_n tiles of their own
    (S = 1; tile_m 64, or 128 = two m64 atoms per warpgroup): the class of S = 1, the whole
    tile's accumulator in one warpgroup's registers, 64-row epilogue sub-tiles, a C buffer
    ring per warpgroup, recorded key 'p...'."""
    space = [t for t in SPACE.tactic_space(splits=1) if t.pingpong]
    assert len(space) == 36
    assert {(t.tile_m, t.tile_n) for t in space} == set(SPACE.PINGPONG_TILES) == {
        (64, 128), (64, 192), (64, 256), (128, 128), (128, 160), (128, 192)}
    for t in space:
        one = dataclasses.replace(t, pingpong=False, stages=0).normalized()
        assert t.splits == 1 and t.consumer_warpgroups == 2 and t.threads_per_cta == 384
        assert one.consumer_warpgroups == (1 if t.tile_m == 64 else 2)
        assert t.reduction_class == one.reduction_class == "k128.acc1.s1.fixed"
        assert t.reduction_order == one.reduction_order and t.name.endswith("_pp")
        # one warpgroup holds the whole tile: twice the registers of the cooperative
        # 128-row tile, within the budget
        regs = T.acc_regs_per_thread(t.tile_m, t.tile_n, pingpong=True)
        assert regs == t.tile_m * t.tile_n // 128 <= T.MAX_ACC_REGS_PER_THREAD
        assert T.epilogue_tile(t.tile_m, t.tile_n, True) == (64, 32)
        assert T.smem_bytes(t) == 2 * 1024 + t.stages * (t.tile_m + t.tile_n) * 128 + (
            64 * 32 * 2 * T.EPI_STAGES * 2)
        assert T.smem_bytes(t) <= T.SMEM_CAPACITY_BYTES
        assert T.smem_bytes_for(t.tile_m, t.tile_n, t.stages + 1,
                                pingpong=True) > T.SMEM_CAPACITY_BYTES or t.stages == 8
        assert WIN.tactic_from_key(WIN.recorded_key(t), 1, "bfloat16", "e4m3") == t
        assert WIN.recorded_key(t).startswith(f"p{t.tile_m}x")
        assert tactic_from_params(t.to_params()) == t
    assert [t.stages for t in space if t.tile_m == 128 and t.cluster_size == 1
            and t.raster == "m"] == [6, 5, 5]
    assert T.acc_regs_per_thread(128, 192) == 96  # cooperative: two warpgroups share it
    assert not T.tile_is_feasible(128, 256, pingpong=True)[0]
    assert tactic_from_params({"tile_m": 64, "tile_n": 128}).pingpong is False


# ---------------------------------------------------------------------- encoding

def test_params_round_trip():
    for t in enumerate_tactics(1000, 2688, 4096):
        p = t.to_params()
        # the fields added later (pdl, the scale scheme, the accumulation) only off default
        assert list(p) == [k for k in T.PARAM_KEYS if k not in T.OMITTED_AT_DEFAULT
                           or getattr(t, k) != T.OMITTED_AT_DEFAULT[k]]
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
        ({"splits": 3}, "splits must be one of"),
        ({"splits": 2, "split_mode": "ring"}, "split_mode must be one of"),
        ({"split_mode": "cta"}, "needs splits > 1"),
        ({"splits": 4, "split_mode": "cta", "cluster_m": 2}, "cluster_m = cluster_n = 1"),
        ({"tile_m": 128, "tile_n": 256, "splits": 2}, "serial split keeps a running sum"),
        ({"splits": "4"}, "int"),
        ({"swap_ab": True}, "tile_m must be one of (8, 16, 32, 64) with swap_ab"),
        ({"swap_ab": True, "tile_m": 8, "tile_n": 256}, "tile_n must be one of (64, 128)"),
        ({"swap_ab": True, "tile_m": 8, "tile_n": 64, "cluster_m": 2},
         "swap_ab needs cluster_m = cluster_n = 1"),
        ({"swap_ab": 1}, "swap_ab must be true or false"),
        ({"swap_ab": True, "tile_m": 8, "tile_n": 64, "stages": 17}, "stages must be in [2, 16]"),
        ({"tile_m": 8, "tile_n": 64}, "tile_m must be one of (64, 128, 256)"),
        ({"wg_n": 3}, "wg_n must be one of (1, 2)"),
        ({"wg_n": True}, "int"),
        ({"tile_m": 128, "tile_n": 128, "wg_n": 2}, "needs tile_m=64"),
        ({"tile_m": 8, "tile_n": 64, "swap_ab": True, "wg_n": 2}, "swap_ab=false"),
        ({"tile_m": 64, "tile_n": 128, "wg_n": 2, "splits": 2, "split_mode": "cta"},
         "wg_n=2 takes split_mode 'serial' only"),
        ({"tile_m": 256, "tile_n": 128, "pingpong": True},
         "pingpong needs tile_m in (64, 128)"),
        ({"tile_m": 128, "tile_n": 96, "pingpong": True}, "needs tile_n >= 128"),
        ({"tile_m": 128, "tile_n": 256, "pingpong": True}, "256 fp32 accumulator registers"),
        ({"tile_m": 64, "tile_n": 128, "pingpong": True, "splits": 2, "split_mode": "cta"},
         "pingpong takes split_mode 'serial' only"),
        ({"tile_m": 64, "tile_n": 256, "pingpong": True, "splits": 2},
         "serial split keeps a running sum"),
        ({"tile_m": 64, "tile_n": 128, "pingpong": True, "swap_ab": True}, "pingpong needs"),
        ({"tile_m": 64, "tile_n": 128, "pingpong": 1}, "pingpong must be true or false"),
        ({"tile_m": 128, "tile_n": 48}, "tile_n in (40, 48, 56) (narrow decode tiles) needs "
                                        "tile_m=64"),
        ({"tile_m": 64, "tile_n": 40, "pingpong": True}, "needs tile_m=64 and pingpong=false"),
        ({"tile_m": 64, "tile_n": 56, "splits": 2, "split_mode": "cta"},
         "tile_n in (40, 48, 56) takes split_mode 'serial' only"),
        ({"tile_m": 64, "tile_n": 40, "wg_n": 2}, "tile_n=40 gives 20"),
        ({"tile_m": 64, "tile_n": 56, "wg_n": 2}, "tile_n/2 a multiple of 8"),
        ({"tile_m": 64, "tile_n": 32}, "tile_n must be one of"),
        ({"tile_m": 8, "tile_n": 48, "swap_ab": True}, "tile_n must be one of (64, 128)"),
        ({"tile_m": 64, "tile_n": 128, "pdl": 1}, "pdl must be true or false"),
        ({"tile_m": 64, "tile_n": 128, "pdl": "yes"}, "pdl must be true or false"),
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


def test_tactic_space_modules_import_no_toolchain():
    # space imports tactic, cost and winners: the daemon's main process ranks with them
    code = ("import sys, cached.families.hopper_fp8.space as s; "
            "s.enumerate_tactics(1, 4096, 4096); "
            "bad = [m for m in ('cutlass', 'torch', 'tvm_ffi') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, env=_env(), timeout=120)


# ---------------------------------------------------------------------- plan options

MANIFEST_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
SHAPES_NK = ((4096, 4096), (2688, 4096), (4608, 2688), (14336, 4096), (2112, 7168),
             (8192, 28672), (4096, 512), (57344, 8192))


def _class(request) -> str:
    return tactic_from_params(request.params).reduction_class


def test_plan_batch_invariant_is_one_class_for_every_m():
    from cached.families.hopper_fp8.family import HopperFp8

    fam = HopperFp8()
    for n, k in SHAPES_NK:
        want = T.reduction_class_id(SPACE.choose_split(n, k, 132))
        for m in MANIFEST_MS:
            reqs = fam.plan((m, n, k), "sm_90a", 132, {"batch_invariant": True})
            assert reqs and {_class(r) for r in reqs} == {want}, (m, n, k)
            # the class's swap_ab tactics are in the plan, beside the unswapped ones
            assert {r.params["swap_ab"] for r in reqs} == {True, False}
            # best-first by the family's model, the same order enumerate_tactics gives
            names = [tactic_from_params(r.params).name for r in reqs]
            assert names == [t.name for t in enumerate_tactics(
                m, n, k, splits=SPACE.choose_split(n, k, 132))]
            assert {r.max_active_clusters for r in reqs} <= {132, 66}


def test_plan_reduction_class_option_and_default():
    from cached.families.hopper_fp8.family import HopperFp8

    fam = HopperFp8()
    every = fam.plan((16, 4096, 4096), "sm_90a", 132, {})
    # no scheme option: the per-tensor fast classes (REDUCTION_CLASSES[:5])
    assert {_class(r) for r in every} == set(T.REDUCTION_CLASSES[:5]) and len(every) == 922
    for cid in T.REDUCTION_CLASSES:
        reqs = fam.plan((16, 4096, 4096), "sm_90a", 132, {"reduction_class": cid})
        assert {_class(r) for r in reqs} == {cid}
        # an explicit class wins over batch_invariant's rule
        both = fam.plan((16, 4096, 4096), "sm_90a", 132,
                        {"reduction_class": cid, "batch_invariant": True})
        assert both == reqs


@pytest.mark.parametrize("options, words", [
    ({"batch_invariant": "yes"}, "batch_invariant must be true or false"),
    ({"reduction_class": "k64.acc1.s1.fixed"}, "unknown cached.hopper_fp8 reduction class"),
    ({"reduction_class": 4}, "reduction_class must be a string"),
])
def test_plan_rejects_bad_options(options, words):
    from cached_client.errors import InvalidTactic

    from cached.families.hopper_fp8.family import HopperFp8

    with pytest.raises(InvalidTactic, match=words):
        HopperFp8().plan((16, 4096, 4096), "sm_90a", 132, options)


def test_plan_options_through_the_daemon(daemon):
    """The daemon's plan op carries the options to the family: one class for every M."""
    client = daemon.client()
    classes = set()
    for m in (1, 64, 4096):
        reqs = client.plan("cached.hopper_fp8", (m, 2688, 4096), "sm_90a", 132,
                           {"batch_invariant": True})
        classes |= {_class(r) for r in reqs}
    assert classes == {T.reduction_class_id(SPACE.choose_split(2688, 4096, 132))}


# ---------------------------------------------------------------------- launcher

def test_workspace_sizes():
    from cached_client.gemm.hopper_fp8 import counter_elems, workspace_bytes

    cta = T.HopperFp8Tactic(64, 128, splits=4, split_mode="cta").normalized().to_params()
    serial = T.HopperFp8Tactic(128, 128, splits=4).normalized().to_params()
    plain = T.HopperFp8Tactic(128, 128).normalized().to_params()
    # one 64 x 128 fp32 partial per output tile and split; one counter per tile
    assert workspace_bytes(cta, 1, 4096) == 32 * 4 * 64 * 128 * 4
    assert counter_elems(cta, 1, 4096) == 32
    assert workspace_bytes(cta, 65, 4000) == 2 * 32 * 4 * 64 * 128 * 4
    assert counter_elems(cta, 65, 4000) == 64
    for p in (serial, plain):
        assert workspace_bytes(p, 8192, 4096) == 0 and counter_elems(p, 8192, 4096) == 0
    sizes = [workspace_bytes(cta, m, 2688) for m in MANIFEST_MS]
    assert sizes == sorted(sizes)  # monotonic in M: allocate once for the largest M
    # swap_ab: tile_m is still the tile along M (8 tokens), tile_n along N (64 weight rows)
    sw = T.HopperFp8Tactic(8, 64, splits=4, split_mode="cta", swap_ab=True).normalized()
    assert workspace_bytes(sw.to_params(), 1, 4096) == 64 * 4 * 8 * 64 * 4
    assert counter_elems(sw.to_params(), 9, 4096) == 2 * 64
    with pytest.raises(ValueError):
        workspace_bytes(cta, -1, 16)


def test_launcher_refuses_missing_or_small_workspace():
    torch = pytest.importorskip("torch")
    from cached_client.gemm.hopper_fp8 import check_workspace, counter_elems, workspace_bytes

    cta = T.HopperFp8Tactic(64, 128, splits=4, split_mode="cta").normalized().to_params()
    dev = torch.device("cpu")
    with pytest.raises(ValueError, match="needs a float32 workspace"):
        check_workspace(cta, 16, 4096, dev, None, None)
    ws = torch.empty(workspace_bytes(cta, 16, 4096) // 4)
    cnt = torch.zeros(counter_elems(cta, 16, 4096), dtype=torch.int32)
    check_workspace(cta, 16, 4096, dev, ws, cnt)
    with pytest.raises(ValueError, match="workspace has .* elements; M=128"):
        check_workspace(cta, 128, 4096, dev, ws, cnt)
    with pytest.raises(ValueError, match="int32"):
        check_workspace(cta, 16, 4096, dev, ws, cnt.float())
    with pytest.raises(ValueError, match="without params"):
        check_workspace(None, 16, 4096, dev, ws, cnt)
    serial = T.HopperFp8Tactic(128, 128, splits=4).normalized().to_params()
    check_workspace(serial, 8192, 4096, dev, None, None)  # needs none



def test_launcher_rejects_before_launch():
    torch = pytest.importorskip("torch")
    from cached_client.gemm.hopper_fp8 import gemm

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
        "from cached.families.hopper_fp8.tactic import tactic_from_params\n"
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
def test_the_in_process_fallback_describes_its_build_as_the_daemon_describes_a_kernel(
        tmp_path):
    """The client's fallback (cached.build.build_in_process) compiles here and returns the
    Artifact cached.artifacts.make_artifact makes of any entry: the key of its request,
    toolchain and family sources, each file's digest and size as they are on disk, origin
    ``fallback``, and nothing the client's own checks refuse."""
    code = (
        "import hashlib, json, os, sys\n"
        "from cached_client.keys import KernelRequest, artifact_key\n"
        "from cached_client.trust import mismatches\n"
        "from cached import families\n"
        "from cached.toolchain import compiler_stack\n"
        "from cached.build import build_in_process\n"
        "from cached.families.hopper_fp8.tactic import HopperFp8Tactic\n"
        "r = KernelRequest('cached.hopper_fp8', HopperFp8Tactic(64, 128, 1, 1, 'm', 1)"
        ".normalized().to_params(), 'sm_90a', 132, 132)\n"
        "a = build_in_process(r, sys.argv[1])\n"
        "fam = families.get(r.family)\n"
        "r = fam.canonical_request(r)\n"
        "def sha(p): return hashlib.sha256(open(p, 'rb').read()).hexdigest()\n"
        "print(json.dumps({'origin': a.origin, 'kind': a.kind, 'mismatches': "
        "mismatches(a, r, None), 'key_ok': a.key == artifact_key(r, "
        "compiler_stack.fingerprint(), fam.source_sha256()), 'sources_ok': "
        "a.source_sha256 == fam.source_sha256(), 'files_ok': [sha(a.library_path), "
        "os.path.getsize(a.library_path), sha(a.object_path), os.path.getsize(a.object_path)]"
        " == [a.library_sha256, a.library_size, a.object_sha256, a.object_size], "
        "'symbol_in_library': a.symbol.encode() in open(a.library_path, 'rb').read()}))\n"
    )
    env = {**_env(), "CUTE_DSL_ARCH": "sm_90a"}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "scratch")], check=True,
                         env=env, timeout=540, capture_output=True, text=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got == {"origin": "fallback", "kind": "kernel", "mismatches": {}, "key_ok": True,
                   "sources_ok": True, "files_ok": True, "symbol_in_library": True}


@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None,
                    reason="nvidia-cutlass-dsl is not installed")
def test_compile_refuses_other_arch(tmp_path):
    code = (
        "from cached.families.hopper_fp8.compile import compile_to_object\n"
        "from cached.families.hopper_fp8.tactic import HopperFp8Tactic\n"
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

OLD_TILE_N = (64, 128, 192, 256)  # the widths before the third pass; the others: below


def test_every_tile_and_cluster_compiles_for_sm90a_through_the_daemon(daemon):
    """One S = 1 tactic per (tile, cluster) of the widths 64/128/192/256, rasters and
    swizzles rotating, planned and compiled by the daemon's workers (the widths 80-160:
    test_new_tile_widths_compile_for_sm90a_through_the_daemon; the whole space:
    bench/compile_hopper.py)."""
    import json as _json

    class_id = "k128.acc1.s1.fixed"
    client = daemon.client()
    requests = client.plan("cached.hopper_fp8", (4096, 4096, 4096), "sm_90a",
                           options={"reduction_class": class_id})
    assert len(requests) == 454 and {r.max_active_clusters for r in requests} == {132, 66}
    # the swap_ab, wg_n=2, ping-pong and pdl tactics: their own tests below
    requests = [r for r in requests if not r.params["swap_ab"] and r.params["wg_n"] == 1
                and not r.params["pingpong"] and not r.params.get("pdl")]
    assert len(requests) == 345
    requests = [r for r in requests if r.params["tile_n"] in OLD_TILE_N]
    assert len(requests) == 264
    by_shape: dict = {}
    for r in requests:
        p = r.params
        by_shape.setdefault((p["tile_m"], p["tile_n"], p["cluster_m"], p["cluster_n"]),
                            {})[(p["raster"], p["swizzle"])] = r
    rotation = (("m", 1), ("n", 2), ("m", 4), ("n", 8))
    picked = {shape: variants[rotation[i % 4]]
              for i, (shape, variants) in enumerate(sorted(by_shape.items()))}
    assert len(picked) == 33
    client.prefetch(list(picked.values()))
    for r in picked.values():
        assert client.get(r, timeout=900).origin in ("compiled", "hit")
    entries = client.list()
    assert len({e["kernel_name"] for e in entries}) == 33
    assert all(tactic_from_params(_json.loads(e["params"])).to_params()
               == _json.loads(e["params"]) for e in entries)


def _split_variants() -> list:
    """The split tactics compiled by the test below: all 56 (14 per S > 1; the ping-pong
    splits: _pingpong_128_variants).

    Every field of a tactic is a compile-time constant, so every tactic is its own object
    code. What decides a different code path (the thing a compile can break on) is the
    split mode ('serial': the second accumulator and the range loop; 'cta': the workspace,
    counter and last-unit sum, unrolled over S), the consumer warpgroups and accumulator
    layout (tile_m, tile_n) and S; all of them vary below, and the space is small enough
    to compile whole.
    """
    return [t for t in SPACE.tactic_space() if t.splits > 1 and t.tile_n in OLD_TILE_N
            and t.cluster_size == 1 and t.wg_n == 1 and not t.pingpong]


def _compile_through_daemon(daemon, variants: list) -> set[str]:
    """Compile ``variants`` (tactics of the family's space) with the daemon's workers for
    sm_90a: each served with a real artifact; returns the stored kernel names."""
    from cached_client.keys import KernelRequest

    space = {t.name for t in SPACE.tactic_space("float16", "e5m2") + SPACE.tactic_space()}
    assert all(t.name in space for t in variants)
    client = daemon.client()
    requests = [KernelRequest(family="cached.hopper_fp8", params=t.to_params(), arch="sm_90a",
                              sm_count=132, max_active_clusters=132 // t.cluster_size)
                for t in variants]
    client.prefetch(requests)
    for r in requests:
        art = client.get(r, timeout=900)
        path = art.library_path or art.object_path
        assert path and os.path.getsize(path) > 1000
    return {e["kernel_name"] for e in client.list()}


def test_split_tactics_compile_for_sm90a_through_the_daemon(daemon):
    """The split-K variants (see _split_variants), compiled by the daemon's workers."""
    variants = [t for t in _split_variants() if not t.swap_ab]
    assert len(variants) == 56
    names = _compile_through_daemon(daemon, variants)
    assert len(names) == 56 and all("_k" in nm for nm in names)


def _new_width_variants() -> list:
    """A sample of the N widths 80, 96, 112, 160 (third pass), one per width and code
    path: the 16-column epilogue (80, 112) and the 32-column one (96, 160), one and two
    consumer warpgroups (tile_m 64, 128, 256), each cluster shape, serial splits (two
    accumulators; one with a cluster) and e5m2/fp16. The whole space:
    bench/compile_hopper.py."""
    H = HopperFp8Tactic
    return [t.normalized() for t in (
        H(128, 80),
        H(64, 112, 1, 2, "n"),
        H(256, 96, 2, 1),
        H(128, 160, 1, 2),
        H(64, 96, splits=2, split_mode="serial"),
        H(128, 160, splits=4, split_mode="serial"),
        H(128, 96, 1, 2, splits=2, split_mode="serial"),
        H(256, 80, 1, 1, "m", 1, 0, "float16", "e5m2"),
    )]


def test_new_tile_widths_compile_for_sm90a_through_the_daemon(daemon):
    """The sample of the new N widths (see _new_width_variants), compiled by the daemon's
    workers; every one is in the family's space and in the class of its S."""
    variants = _new_width_variants()
    assert {t.tile_n for t in variants} == {80, 96, 112, 160}
    assert len(_compile_through_daemon(daemon, variants)) == len(variants)
def _swap_variants() -> list:
    """swap_ab tactics, one per distinct code path: S = 1 and both split modes, one and
    two consumer warpgroups (64 or 128 weight rows), every token tile (the wgmma N: 8,
    16, 32, 64), and e5m2/fp16 (the whole space, 72: bench/compile_hopper.py)."""
    H = HopperFp8Tactic
    return [t.normalized() for t in (
        H(8, 64, swap_ab=True),
        H(64, 128, swap_ab=True),
        H(16, 128, splits=2, split_mode="serial", swap_ab=True),
        H(32, 64, splits=4, split_mode="cta", swap_ab=True),
        H(8, 128, splits=8, split_mode="cta", swap_ab=True),
        H(64, 64, splits=16, split_mode="serial", swap_ab=True),
        H(16, 64, 1, 1, "m", 1, 0, "float16", "e5m2", 4, "cta", True),
    )]


def test_swap_tactics_compile_for_sm90a_through_the_daemon(daemon):
    """The swap_ab variants (see _swap_variants), compiled by the daemon's workers."""
    variants = _swap_variants()
    names = _compile_through_daemon(daemon, variants)
    assert len(names) == len(variants) and all(nm.split("_mac")[0].endswith("_sw")
                                               for nm in names)
def _wg_n_variants() -> list:
    """wg_n=2 tactics (two consumer warpgroups along N), one per distinct code path:
    the narrowest and widest halves (wgmma N 32 and 128), a 16-column-odd half (80 -> 40),
    clusters 2x1 and 1x2, a serial split, and e5m2/fp16."""
    H = HopperFp8Tactic
    return [t.normalized() for t in (
        H(64, 64, wg_n=2),
        H(64, 80, wg_n=2),
        H(64, 256, wg_n=2),
        H(64, 160, 2, 1, wg_n=2),
        H(64, 96, 1, 2, wg_n=2),
        H(64, 128, 2, 1, splits=2, split_mode="serial", wg_n=2),
        H(64, 80, 1, 1, "m", 1, 0, "float16", "e5m2", wg_n=2),
    )]


def test_wg_n_tactics_compile_for_sm90a_through_the_daemon(daemon):
    """The wg_n=2 variants (see _wg_n_variants), compiled by the daemon's workers; every
    one is in the family's space (its class checked bitwise on an H200:
    docs/history.md, fourth pass)."""
    variants = _wg_n_variants()
    names = _compile_through_daemon(daemon, variants)
    assert len(names) == len(variants) and all(nm.split("_mac")[0].endswith("_wn2")
                                               for nm in names)
def _narrow_variants() -> list:
    """The narrow decode tiles (seventh pass), one per distinct code path: each width
    (wgmma N 40, 48, 56), each cluster (2x1 multicasts the weight tile to both token
    tiles), wg_n = 2 on 48 columns (wgmma N 24) with and without a cluster, and
    e5m2/fp16."""
    H = HopperFp8Tactic
    return [t.normalized() for t in (
        H(64, 40),
        H(64, 48, 2, 1),
        H(64, 56, 1, 2),
        H(64, 48, wg_n=2),
        H(64, 48, 2, 1, wg_n=2),
        H(64, 56, 1, 1, "m", 1, 0, "float16", "e5m2"),
    )]


def test_narrow_decode_tiles_compile_for_sm90a_through_the_daemon(daemon):
    """The narrow decode tiles (see _narrow_variants), compiled by the daemon's workers;
    every one is in the family's space (their class checked bitwise on an H200:
    docs/history.md, seventh pass)."""
    variants = _narrow_variants()
    assert {t.tile_n for t in variants} == set(T.NARROW_TILE_N)
    names = _compile_through_daemon(daemon, variants)
    assert len(names) == len(variants)
    assert {nm.split("_c")[0] for nm in names} == {"m64n40", "m64n48", "m64n56"}


def _pingpong_variants() -> list:
    """Ping-pong tactics, one per distinct code path: each width (wgmma N 128, 192, 256),
    both clusters, raster n, and e5m2/fp16."""
    H = HopperFp8Tactic
    return [t.normalized() for t in (
        H(64, 128, pingpong=True),
        H(64, 192, 2, 1, pingpong=True),
        H(64, 256, 1, 2, "n", pingpong=True),
        H(64, 256, 1, 1, "m", 1, 0, "float16", "e5m2", pingpong=True),
    )]


def _pingpong_128_variants() -> list:
    """128-row ping-pong tactics (two m64 atoms per warpgroup), one per distinct code path:
    each width (wgmma N 128, 160, 192), both clusters, raster n, and e5m2/fp16; and the
    serial-split ping-pong tactics (S = 2 and 4)."""
    H = HopperFp8Tactic
    return [t.normalized() for t in (
        H(128, 128, pingpong=True),
        H(128, 160, 2, 1, pingpong=True),
        H(128, 192, 1, 2, "n", pingpong=True),
        H(128, 192, 1, 1, "m", 1, 0, "float16", "e5m2", pingpong=True),
        # serial splits: the ranges inside one ordered main-loop turn, two accumulators
        H(64, 192, 2, 1, "n", splits=2, pingpong=True),
        H(64, 128, 1, 1, "m", 1, 0, "float16", "e5m2", splits=4, pingpong=True),
    )]


def test_pingpong_128_row_tactics_compile_for_sm90a_through_the_daemon(daemon):
    """The 128-row ping-pong variants (see _pingpong_128_variants), compiled by the
    daemon's workers (their class checked bitwise on an H200: docs/history.md, fifth
    pass)."""
    variants = _pingpong_128_variants()
    names = _compile_through_daemon(daemon, variants)
    assert len(names) == len(variants) and all(nm.split("_mac")[0].endswith("_pp")
                                               for nm in names)


def test_pingpong_tactics_compile_for_sm90a_through_the_daemon(daemon):
    """The ping-pong variants (see _pingpong_variants), compiled by the daemon's workers
    (their class checked bitwise on an H200: docs/history.md, fourth pass)."""
    variants = _pingpong_variants()
    names = _compile_through_daemon(daemon, variants)
    assert len(names) == len(variants) and all(nm.split("_mac")[0].endswith("_pp")
                                               for nm in names)


# ---------------------------------------------------------------------- pdl (eighth pass)

def test_pdl_twins():
    """pdl=True (programmatic dependent launch): tactic_space lists a twin of each
    decode-band tactic (swap_ab, wg_n = 2, the narrow widths: 41 in S = 1, 31 per S > 1),
    equal to it in every other field, in its class (the K walk is the same; bitwise
    checked on an H200: docs/history.md, eighth pass), named with '_pdl', recorded as
    '+pdl', ranked by the model as its tactic less the microseconds the cost file says a
    pdl launch saves at the M regime (TWINS: right after it where none is fitted); any other
    tactic may take pdl too."""
    import dataclasses as dc

    saves = {r: COST.cost_model()["TWINS"].get(("pdl", "on", r)) for r in range(3)}
    assert saves[0] and saves[0] > 0 and saves[1] is None  # decode sizes only, measured
    for s in T.SPLIT_CHOICES:
        space = SPACE.tactic_space(splits=s)
        base = {t.name: t for t in space if not t.pdl}
        twins = [t for t in space if t.pdl]
        assert len(twins) == (41 if s == 1 else 31)
        assert {t.name.removesuffix("_pdl") for t in twins} == {
            n for n, t in base.items() if SPACE.pdl_twin(t)}
        for t in twins:
            b = base[t.name.removesuffix("_pdl")]
            assert t.name == b.name + "_pdl" and dc.replace(t, pdl=False) == b
            assert b.swap_ab or b.wg_n == 2 or b.tile_n in T.NARROW_TILE_N
            assert t.reduction_class == b.reduction_class == T.reduction_class_id(s)
            assert t.reduction_order == b.reduction_order
            assert T.smem_bytes(t) == T.smem_bytes(b) and t.stages == b.stages
            key = WIN.recorded_key(t)
            assert key == WIN.recorded_key(b) + "+pdl"
            assert WIN.tactic_from_key(key, s, "bfloat16", "e4m3") == t
            assert tactic_from_params(json.loads(json.dumps(t.to_params()))) == t
            tk, bk = (COST.rank_key(x, 64, 4096, 4096, 132) for x in (t, b))
            assert abs(tk[0] - (bk[0] - saves[0])) <= 0.001 and tk[1:-1] == bk[1:-1]
            assert (COST.rank_key(t, 128, 4096, 4096, 132)[:-1]
                    == COST.rank_key(b, 128, 4096, 4096, 132)[:-1])
    # (the model's order: a device with no recorded winners): at M <= 64 a twin before its
    # tactic, past it (nothing fitted) right after
    for m, twin_first in ((32, True), (128, False)):
        order = [t.name for t in enumerate_tactics(m, 4096, 14336, num_sms=114, splits=1)]
        twins = [i for i, nm in enumerate(order) if nm.endswith("_pdl")]
        assert twins
        for i in twins:
            assert (order.index(order[i].removesuffix("_pdl")) > i) == twin_first
    # the recorded winners name the twin where pdl won every round (eighth pass): the
    # plan's first choice there is the twin, in the same class
    recorded = [(n, k, s, m, key) for (_, n, k), per in WIN.recorded_winners().items()
                for s, row in per.items() for m, key, _ in row]
    pdl_keys = [r for r in recorded if r[4].endswith("+pdl")]
    assert pdl_keys and len(pdl_keys) < len(recorded)
    for n, k, s, m, key in pdl_keys:
        first = enumerate_tactics(m, n, k, splits=s)[0]
        assert first.pdl and WIN.recorded_key(first) == key and first.splits == s
    every = SPACE.recordable_tactics()
    assert len(every) == 922 + 757 - 41 - 4 * 31
    assert all(dc.replace(t, pdl=False).name in every for t in every.values())
    # a tactic outside the decode band takes pdl too (a recorded winner may name it)
    wide = tactic_from_params({"tile_m": 128, "tile_n": 256, "cluster_m": 2, "pdl": True})
    assert wide.pdl and wide.name.endswith("_pdl") and not SPACE.pdl_twin(wide)
    assert WIN.tactic_from_key("128x256m@2x1+pdl", 1, "bfloat16", "e4m3") == wide


def test_pdl_keeps_the_params_of_tactics_without_it():
    """pdl is left out of the canonical params when False, so every tactic's params (and
    the artifact keys made from them) are what they were before the field existed; an
    explicit pdl: false canonicalizes to the same params, pdl: true adds the key last."""
    from cached_client.errors import InvalidTactic

    from cached.families.hopper_fp8.family import HopperFp8

    fam = HopperFp8()
    old = {"tile_m": 8, "tile_n": 64, "cluster_m": 1, "cluster_n": 1, "raster": "m",
           "swizzle": 1, "stages": 16, "out_dtype": "bfloat16", "ab_dtype": "e4m3",
           "splits": 1, "split_mode": "serial", "swap_ab": True, "wg_n": 1,
           "pingpong": False}
    assert fam.canonical_params(old, "sm_90a") == old
    assert fam.canonical_params({**old, "pdl": False}, "sm_90a") == old
    assert list(fam.canonical_params(old, "sm_90a")) == list(T.PARAM_KEYS[:-3])
    on = fam.canonical_params({**old, "pdl": True}, "sm_90a")
    assert on == {**old, "pdl": True} and list(on)[-1] == "pdl"
    assert fam.reduction_class(on) == fam.reduction_class(old) == "k128.acc1.s1.fixed"
    with pytest.raises(InvalidTactic, match="pdl must be true or false"):
        fam.canonical_params({**old, "pdl": 0}, "sm_90a")


def _pdl_variants() -> list:
    """pdl twins, one per distinct code path of the decode band: a swap_ab tile (register
    epilogue), a swap_ab 'cta' split (workspace and counters behind the wait) in
    e5m2/fp16, a narrow tile and wg_n = 2 with a 2x1 cluster (the wait after the cluster's
    barrier init)."""
    H = HopperFp8Tactic
    return [t.normalized() for t in (
        H(32, 64, swap_ab=True, pdl=True),
        H(16, 64, 1, 1, "m", 1, 0, "float16", "e5m2", 4, "cta", True, pdl=True),
        H(64, 40, pdl=True),
        H(64, 48, 2, 1, wg_n=2, pdl=True),
    )]


def test_pdl_tactics_compile_for_sm90a_through_the_daemon(daemon):
    """The pdl variants (see _pdl_variants), compiled by the daemon's workers, each its
    own artifact beside the tactic without pdl."""
    variants = _pdl_variants()
    names = _compile_through_daemon(daemon, variants)
    assert len(names) == len(variants)
    assert all(nm.split("_mac")[0].endswith("_pdl") for nm in names)
