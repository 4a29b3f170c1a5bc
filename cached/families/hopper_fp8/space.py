"""The tactic space of the Hopper FP8 family: which tactics a plan lists, in what order, and
the split count S of a batch-invariant plan.

tactic_space(S) lists every tactic the family plans for one reduction-order class (or for
all of them); enumerate_tactics ranks that list for one problem (m, n, k): the recorded
winners of each class first (winners.recorded_first), then the cost model's order
(cost.rank_key, a total order, so the list is deterministic). recordable_tactics is what a
recorded winner may name.

pdl twins: tactic_space lists a pdl=True twin of each decode-band tactic (pdl_twin); a
recorded winner may name pdl on any tactic (recordable_tactics).

Choosing S: ``choose_split(n, k, sm_count)`` depends on N, K and the device only, never on
M, so a batch-invariant plan for one (N, K) uses one class for every M.

Imports neither cutlass nor torch.
"""

from __future__ import annotations

import dataclasses

from .cost import H200_NUM_SMS, rank_key
from .tactic import (
    AB_DTYPE_BYTES,
    AB_DTYPES,
    ACCUM_MODES,
    BF16,
    BF16_NARROW_TILE_N,
    BLOCK,
    CLUSTER_CHOICES,
    NARROW_TILE_N,
    NO_SCALES,
    RASTER_CHOICES,
    SCALE_SCHEMES,
    SPLIT_CHOICES,
    SWAP_TILE_M_CHOICES,
    SWAP_TILE_N_CHOICES,
    SWIZZLE_CHOICES,
    TILE_M_CHOICES,
    TILE_N_CHOICES,
    HopperFp8Tactic,
    acc_sets,
    max_stages_for,
    out_dtypes_for,
    tile_is_feasible,
)
from .winners import recorded_first

# The tiles each part of the space is planned on. Which tiles made it in, and why, is
# measured (H200 runs, docs/history.md); these tables are what the space is.

# the widths planned with every swizzle; the other widths with swizzle 1 only
SWIZZLED_TILE_N = (64, 128, 192, 256)
# wg_n = 2 tiles (64 x tile_n, tile_n / 2 a multiple of 8)
WG_N_TILE_N = (48, 64, 80, 96, 128, 160, 192, 256)
# ping-pong tiles: 64 x PINGPONG_TILE_N and 128 x PINGPONG_128_TILE_N; for S > 1 (serial),
# the tiles whose two accumulator copies fit (PINGPONG_SPLIT_TILES)
PINGPONG_TILE_N = (128, 192, 256)
PINGPONG_128_TILE_N = (128, 160, 192)
PINGPONG_TILES = (tuple((64, tn) for tn in PINGPONG_TILE_N)
                  + tuple((128, tn) for tn in PINGPONG_128_TILE_N))
PINGPONG_SPLIT_TILES = ((64, 128), (64, 192))
# The wave tiles of the split classes (serial, raster m): widths between the others, so
# that a small N fills about one wave of 132 SMs at M = 256..1024 without the split being a
# second pass of CTAs (N = 1152 over 144: 8 tiles; over 48: 24)
SPLIT_WAVE_TILES = ((64, 48, "m"), (64, 80, "m"), (64, 112, "m"), (64, 144, "m"),
                    (128, 80, "m"), (128, 144, "m"))
# Split tactics (S > 1): 'cta' on the decode tiles (one M tile row; the N tile width sets
# how many units fill the chip) and 'serial' on the tiles that fit two accumulators
SPLIT_CTA_TILES = ((64, 64), (64, 128), (64, 192), (64, 256), (128, 128), (128, 256))
SPLIT_SERIAL_TILES = ((64, 64, "m"), (64, 128, "m"), (64, 192, "m"), (128, 64, "m"),
                      (128, 128, "m"), (128, 128, "n"), (128, 192, "m"), (128, 192, "n"),
                      (64, 96, "m"), (64, 160, "m"), (128, 96, "m"), (128, 160, "m"),
                      *SPLIT_WAVE_TILES)
# serial splits with a 1x2 or 2x1 cluster, on each raster of SPLIT_SERIAL_CLUSTER_RASTERS
# (raster n keeps the weight in L2 where raster m streams A from DRAM once per two N tiles)
SPLIT_SERIAL_CLUSTER_TILES = ((128, 64), (128, 96), (128, 160), (128, 192), (128, 128),
                              (128, 144))
SPLIT_SERIAL_CLUSTER_RASTERS = ("m", "n")
# wg_n = 2 serial splits: tile 64 x tile_n, clusters 1x1 and 2x1, raster m
SPLIT_SERIAL_WG_N_TILE_N = (64, 96, 128, 160, 80, 112, 144)
# swap_ab tiles (tokens x weight rows), in every class: S = 1, and both split modes for S > 1
SWAP_TILES = tuple((tm, tn) for tn in SWAP_TILE_N_CHOICES for tm in SWAP_TILE_M_CHOICES)


def tactic_space(out_dtype: str = "bfloat16", ab_dtype: str = "e4m3",
                 splits: int | None = None, scales: str = "tensor",
                 accum: str = "fast") -> list[HopperFp8Tactic]:
    """Every tactic the family plans, for one split count S or (None) for all of them.

    S = 1 (413): every feasible tile x cluster x raster x swizzle of the widths
    SWIZZLED_TILE_N (11 tiles, 264), the same with swizzle 1 for the widths 80, 96, 112,
    160 (12 tiles, 72), the 8 swap_ab tiles, the wg_n = 2 tiles (24), the ping-pong
    tiles PINGPONG_TILES x cluster x raster (36) and the narrow decode tiles 64 x
    NARROW_TILE_N x cluster, raster m, swizzle 1 (9). S > 1 (86 per S): split_mode 'cta' on
    SPLIT_CTA_TILES and 'serial' on SPLIT_SERIAL_TILES (the wave tiles among them), cluster
    1x1, swizzle 1 (24: clusters and swizzles lost at small M in the S = 1 measurements),
    'serial' on SPLIT_SERIAL_CLUSTER_TILES with clusters 1x2 and 2x1 and both rasters (24),
    on the wg_n = 2 tiles (14), 'serial' ping-pong on PINGPONG_SPLIT_TILES with clusters
    1x1 and 2x1 and both rasters (8), and both modes on the 8 swap_ab tiles (16); 757 in
    all. Then a pdl twin (pdl=True) of each decode-band tactic (pdl_twin: swap_ab, wg_n = 2,
    the narrow widths): 41 in S = 1 and 31 per S > 1, so 454 in S = 1, 117 per S > 1,
    922 in all.

    Other schemes (scheme_space): ``scales="token"`` lists the same tactics with that
    scheme; ``accum="exact"`` the S = 1 and (per-tensor and per-token) split tactics whose
    accumulator copies (tactic.acc_sets) fit, in the scheme.
    """
    if ab_dtype == BF16 or scales == NO_SCALES:
        return bf16_space(out_dtype, ab_dtype, splits, scales, accum)
    if scales != "tensor" or accum != "fast":
        return scheme_space(tactic_space(out_dtype, ab_dtype, splits), scales, accum)
    out: list[HopperFp8Tactic] = []
    for sp in SPLIT_CHOICES if splits is None else (splits,):
        if sp == 1:
            for tm in TILE_M_CHOICES:
                for tn in TILE_N_CHOICES:
                    if not tile_is_feasible(tm, tn, out_dtype)[0]:
                        continue
                    stages = max_stages_for(tm, tn, out_dtype)
                    for cm, cn in CLUSTER_CHOICES:
                        for raster in RASTER_CHOICES:
                            for swz in SWIZZLE_CHOICES if tn in SWIZZLED_TILE_N else (1,):
                                out.append(HopperFp8Tactic(tm, tn, cm, cn, raster, swz, stages,
                                                           out_dtype, ab_dtype))
            out += _swap_tactics(sp, "serial", out_dtype, ab_dtype)
            out += _wg_n_tactics(out_dtype, ab_dtype)
            out += [HopperFp8Tactic(64, tn, cm, cn, "m", 1, max_stages_for(64, tn, out_dtype),
                                    out_dtype, ab_dtype)
                    for tn in NARROW_TILE_N for cm, cn in CLUSTER_CHOICES]
            out += [HopperFp8Tactic(tm, tn, cm, cn, r, 1,
                                    max_stages_for(tm, tn, out_dtype, pingpong=True),
                                    out_dtype, ab_dtype, pingpong=True)
                    for tm, tn in PINGPONG_TILES for cm, cn in CLUSTER_CHOICES
                    for r in RASTER_CHOICES]
            continue
        for tm, tn in SPLIT_CTA_TILES:
            out.append(HopperFp8Tactic(tm, tn, 1, 1, "m", 1, max_stages_for(tm, tn, out_dtype),
                                       out_dtype, ab_dtype, sp, "cta"))
        for tm, tn, raster in SPLIT_SERIAL_TILES:
            out.append(HopperFp8Tactic(tm, tn, 1, 1, raster, 1,
                                       max_stages_for(tm, tn, out_dtype), out_dtype, ab_dtype,
                                       sp, "serial"))
        for tm, tn in SPLIT_SERIAL_CLUSTER_TILES:
            for raster in SPLIT_SERIAL_CLUSTER_RASTERS:
                for cm, cn in ((1, 2), (2, 1)):
                    out.append(HopperFp8Tactic(tm, tn, cm, cn, raster, 1,
                                               max_stages_for(tm, tn, out_dtype), out_dtype,
                                               ab_dtype, sp, "serial"))
        out += [HopperFp8Tactic(tm, tn, cm, 1, r, 1,
                                max_stages_for(tm, tn, out_dtype, pingpong=True),
                                out_dtype, ab_dtype, sp, "serial", pingpong=True)
                for tm, tn in PINGPONG_SPLIT_TILES for cm in (1, 2) for r in RASTER_CHOICES]
        for tn in SPLIT_SERIAL_WG_N_TILE_N:
            for cm in (1, 2):
                out.append(HopperFp8Tactic(64, tn, cm, 1, "m", 1,
                                           max_stages_for(64, tn, out_dtype, wg_n=2),
                                           out_dtype, ab_dtype, sp, "serial", wg_n=2))
        out += _swap_tactics(sp, "cta", out_dtype, ab_dtype)
        out += _swap_tactics(sp, "serial", out_dtype, ab_dtype)
    return out + [dataclasses.replace(t, pdl=True) for t in out if pdl_twin(t)]


def bf16_space(out_dtype: str = "bfloat16", ab_dtype: str = BF16, splits: int | None = None,
               scales: str = NO_SCALES, accum: str = "fast") -> list[HopperFp8Tactic]:
    """The bf16 operands' space (cached.hopper_bf16): the per-tensor fast FP8 space's tiles
    (their stage bytes are the same: K_TILE_BYTES a row) with ab_dtype bf16 and scales
    "none", less the narrow widths outside BF16_NARROW_TILE_N (the compiler aborts on
    them). The stage count is recomputed for the output type (a float32 output takes more
    shared memory). ValueError for anything but bf16 operands, scales "none" and accum
    "fast"."""
    if ab_dtype != BF16 or scales != NO_SCALES or accum != "fast":
        raise ValueError(f"the bf16 space takes ab_dtype={BF16!r}, scales={NO_SCALES!r} and "
                         f"accum='fast', got {ab_dtype!r}, {scales!r}, {accum!r}")
    if out_dtype not in out_dtypes_for(BF16):
        raise ValueError(f"out_dtype must be one of {out_dtypes_for(BF16)}, got {out_dtype!r}")
    out = []
    for t in tactic_space("bfloat16", "e4m3", splits):
        if t.tile_n in NARROW_TILE_N and not t.swap_ab and t.tile_n not in BF16_NARROW_TILE_N:
            continue
        if not tile_is_feasible(t.tile_m, t.tile_n, out_dtype, acc_sets(t.splits, t.split_mode),
                                t.swap_ab, t.wg_n, t.pingpong)[0]:
            continue
        stages = min(t.stages, max_stages_for(t.tile_m, t.tile_n, out_dtype, t.swap_ab,
                                              t.wg_n, t.pingpong))
        out.append(dataclasses.replace(t, out_dtype=out_dtype, ab_dtype=BF16,
                                       scales=NO_SCALES, stages=stages))
    return out


def scheme_space(base: list[HopperFp8Tactic], scales: str, accum: str
                 ) -> list[HopperFp8Tactic]:
    """The tactics of ``base`` (per-tensor, fast) in scale scheme ``scales`` and
    accumulation ``accum``: every one for fast; for exact the S = 1 ones and (not block128)
    the splits, whose promoted sum fits beside the wgmma accumulator (and a serial split's
    running sum: tile_is_feasible with acc_sets copies). ValueError for an unknown scheme
    or mode."""
    if scales not in SCALE_SCHEMES:
        raise ValueError(f"scales must be one of {SCALE_SCHEMES}, got {scales!r}")
    if accum not in ACCUM_MODES:
        raise ValueError(f"accum must be one of {ACCUM_MODES}, got {accum!r}")
    if scales == "block128" and accum != "exact":
        raise ValueError("scales 'block128' are applied at the promotion: it needs accum='exact'")
    out = []
    for t in base:
        if accum == "exact" and ((t.splits != 1 and scales == "block128") or not
                                 tile_is_feasible(t.tile_m, t.tile_n, t.out_dtype,
                                                  acc_sets(t.splits, t.split_mode, accum),
                                                  t.swap_ab, t.wg_n, t.pingpong)[0]):
            continue
        if scales == "block128" and not block_scale_shared(t):
            continue
        out.append(dataclasses.replace(t, scales=scales, accum=accum))
    return out


def block_scale_shared(t: HopperFp8Tactic) -> bool:
    """Whether a block128 kernel of ``t``'s tile loads one weight-block scale per K tile
    for all of a warpgroup's columns in one 128-column block (kernel.block_pair_keys):
    swap_ab tiles (weight rows on the MMA's M side, a few rows per thread) and tiles whose
    per-warpgroup width tile_n / wg_n divides 128 or is a multiple of it. The others
    (widths 80, 96, 112, 160, 192) need one scale load and product per 8 columns per K
    tile (docs/history.md, block FP8 runs 4-6), so the block128 space leaves them out;
    the kernel still computes them correctly when a request names one."""
    width = t.tile_n // t.wg_n
    return t.swap_ab or width % BLOCK == 0 or BLOCK % width == 0


def pdl_twin(t: HopperFp8Tactic) -> bool:
    """Whether tactic_space lists a pdl=True twin of ``t`` (a pdl=False tactic): the
    decode-band tactics (swap_ab, wg_n = 2, NARROW_TILE_N), whose launches are a few us
    long, so overlapping one launch's prologue and tail with the next's matters most.
    A recorded winner may still name pdl on any tactic (recorded_key's '+pdl')."""
    return not t.pdl and (t.swap_ab or t.wg_n == 2 or t.tile_n in NARROW_TILE_N)


def recordable_tactics(out_dtype: str = "bfloat16", ab_dtype: str = "e4m3"
                       ) -> dict[str, HopperFp8Tactic]:
    """{name: tactic} of what a recorded winner (data/h200_winners.json) may name:
    tactic_space() and the pdl=True twin of each of its tactics (pdl changes no arithmetic,
    so any tactic may be recorded with it)."""
    space = {t.name: t for t in tactic_space(out_dtype, ab_dtype)}
    return space | {t.name: t for t in (dataclasses.replace(x, pdl=True)
                                        for x in space.values() if not x.pdl)}


def _wg_n_tactics(out_dtype: str, ab_dtype: str) -> list[HopperFp8Tactic]:
    return [HopperFp8Tactic(64, tn, cm, cn, "m", 1, max_stages_for(64, tn, out_dtype, wg_n=2),
                            out_dtype, ab_dtype, wg_n=2)
            for tn in WG_N_TILE_N for cm, cn in CLUSTER_CHOICES]


def _swap_tactics(splits: int, mode: str, out_dtype: str, ab_dtype: str
                  ) -> list[HopperFp8Tactic]:
    return [HopperFp8Tactic(tm, tn, 1, 1, "m", 1, max_stages_for(tm, tn, out_dtype, True),
                            out_dtype, ab_dtype, splits, mode, True) for tm, tn in SWAP_TILES]


def _check_problem(m: int, n: int, k: int, out_dtype: str, ab_dtype: str) -> None:
    for name, v in (("m", m), ("n", n), ("k", k)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if n % 16 or k % 16:
        raise ValueError(f"n and k must be multiples of 16 (TMA 16-byte rows); got n={n}, k={k}")
    if ab_dtype not in AB_DTYPES:
        raise ValueError(f"ab_dtype must be one of {AB_DTYPES}, got {ab_dtype!r}")
    if out_dtype not in out_dtypes_for(ab_dtype):
        raise ValueError(f"out_dtype must be one of {out_dtypes_for(ab_dtype)}, got "
                         f"{out_dtype!r}")


def enumerate_tactics(
    m: int,
    n: int,
    k: int,
    out_dtype: str = "bfloat16",
    ab_dtype: str = "e4m3",
    num_sms: int = H200_NUM_SMS,
    splits: int | None = None,
    scales: str = "tensor",
    accum: str = "fast",
) -> list[HopperFp8Tactic]:
    """The tactics of tactic_space(splits) for (m, n, k), best-first: the recorded winner
    of each class for this device and (N, K), if any (winners.recorded_first), then the
    cost model's order (cost.rank_key: estimate_us, then its tie-breaks).

    ``scales`` / ``accum`` pick the scheme (tactic_space). The order is deterministic
    (total order on the cost tuple). With ``splits`` given,
    every tactic is of one reduction-order class, so any subset is batch-invariant as a
    set; with splits=None the list mixes classes (not batch-invariant across M).
    """
    _check_problem(m, n, k, out_dtype, ab_dtype)
    if splits is not None and splits not in SPLIT_CHOICES:
        raise ValueError(f"splits must be one of {SPLIT_CHOICES}, got {splits!r}")
    out = tactic_space(out_dtype, ab_dtype, splits, scales, accum)
    out.sort(key=lambda t: (rank_key(t, m, n, k, num_sms), t.name))
    # recorded winners were timed per-tensor and fast; the token scheme changes only the
    # epilogue, so they rank first there too; exact tactics are ranked by the model alone
    first = [] if accum != "fast" or ab_dtype == BF16 else [
        dataclasses.replace(t, scales=scales)
        for t in recorded_first(m, n, k, splits, num_sms, out_dtype, ab_dtype)]
    if first:
        names = {t.name for t in first}
        out = first + [t for t in out if t.name not in names]
    return out


# choose_split's constants, fitted to the H200 runs (bench/gpu/hopper_fp8_fit.py,
# docs/history.md): per (N, K), the class whose best kernel per M gives the highest
# geometric-mean speed over the measured M. S > 1 pays off only where the swap_ab decode
# tiles (one CTA per SPLIT_TILE_N weight rows) leave most SMs idle and every split still
# walks enough K tiles; S = 1 keeps the large-M tiles free of drains and second
# accumulators.
SPLIT_MAX = 4
SPLIT_MIN_K_PER_SPLIT = 3584  # 28 K tiles of 128
SPLIT_TILE_N = 64  # the swap_ab decode tile's weight rows: one CTA each at S = 1
SPLIT_SM_SHARE = 2  # split only while the split decode CTAs fill at most 1/2 of the SMs


def choose_split(n: int, k: int, sm_count: int = H200_NUM_SMS, ab_dtype: str = "e4m3") -> int:
    """S of the reduction-order class a batch-invariant plan uses for (N, K) on a device
    with ``sm_count`` SMs: S = 1, doubled while 2S <= SPLIT_MAX, each split keeps
    K >= SPLIT_MIN_K_PER_SPLIT * 2S bytes of an operand row (K elements for FP8, 2K for
    bf16: the same number of 128-byte K tiles) and the decode CTAs ceil(N / SPLIT_TILE_N) *
    2S fill at most sm_count / SPLIT_SM_SHARE SMs. Depends on N, K, the operand type and the
    device only, never on M."""
    for name, v in (("n", n), ("k", k), ("sm_count", sm_count)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if ab_dtype not in AB_DTYPE_BYTES:
        raise ValueError(f"ab_dtype must be one of {AB_DTYPES}, got {ab_dtype!r}")
    k_bytes = k * AB_DTYPE_BYTES[ab_dtype]
    tiles = -(-n // SPLIT_TILE_N)
    s = 1
    while (2 * s <= SPLIT_MAX and k_bytes >= SPLIT_MIN_K_PER_SPLIT * 2 * s
           and tiles * 2 * s * SPLIT_SM_SHARE <= sm_count):
        s *= 2
    return s
