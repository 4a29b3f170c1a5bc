"""The tactic of the Hopper (sm_90a) FP8 GEMM family: its fields, validation, canonical
parameters, resource arithmetic (shared memory in bytes, accumulator registers per thread)
and the reduction-order class it belongs to (docs/hopper-fp8.md: the classes, and what
each field changes).

Invariants: within one reduction-order class every tactic gives bitwise the same result
for every M (tile, cluster, raster, swizzle, stages, split mode, operand swap, pdl change
which CTA computes an element and when, never its arithmetic); two classes are never mixed
by a batch-invariant plan. This module is imported by the daemon's main process: it never
imports cutlass or torch. Which tactics a plan lists is space.py, their order cost.py and
winners.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

FAMILY = "cached.hopper_fp8"  # its name in the family registry (cached.families)
BF16_FAMILY = "cached.hopper_bf16"  # the same machinery on bf16 operands (module doc)
TARGET_ARCH = "sm_90a"

TILE_K = 128  # FP8 K tile: 4 x wgmma k32. Fixed for every FP8 tactic (see module doc).
WGMMA_K = 32
K_TILE_BYTES = 128  # one K tile of one operand row, for every operand dtype (SW128 rows)
BF16_TILE_K = 64  # BF16 K tile: 4 x wgmma k16, 128 bytes a row like FP8's
REDUCTION_ORDER = "k_tile=128,wgmma_k=32,full_k_per_cta,fp32_acc_single,scale_after"
REDUCTION_ORDER_M_INDEPENDENT = True  # within each reduction-order class
ACC_MODE = "acc1"  # one fp32 wgmma accumulator per K range (no periodic promotion)

SPLIT_CHOICES = (1, 2, 4, 8, 16)
# per-tensor; per-token activation x per-channel weight; 128-block (in the K loop, exact only)
SCALE_SCHEMES = ("tensor", "token", "block128")
BLOCK = 128  # the block128 scheme's group size along K and the weight's block size along N
ACCUM_MODES = ("fast", "exact")  # one wgmma accumulator; promoted every K tile
#: the (scales, accum) pairs that exist: block128 is exact only
SCHEMES = tuple((sc, acc) for sc in SCALE_SCHEMES for acc in ACCUM_MODES
                if (sc, acc) != ("block128", "fast"))
ACC_IDS = {"fast": ACC_MODE, "exact": "prom128"}  # the class id's accumulation part
SPLIT_MODES = ("serial", "cta")

TILE_M_CHOICES = (64, 128, 256)
# N widths between 64 and 256 in steps of 16 or 32 (the wgmma takes any N multiple of 8
# up to 256): at M = 128..1024 they fill the 132 SMs where 64/128/192/256 leave a wave
# mostly empty or start a second one (e.g. N = 5120: 64 tiles of 80 at M <= 128)
TILE_N_CHOICES = (64, 80, 96, 112, 128, 160, 192, 256)
# wave widths: built for any class, planned in the split classes only (space.py), where a
# small N over 144 columns gives about one full wave with no second K pass (N = 1152: 8
# tiles; 1984: 14)
WAVE_TILE_N = (144,)
# narrow weight tiles (unswapped): 64 token rows on the wgmma M side and 40, 48 or 56
# weight rows on its N side. tile_m = 64 only, no ping-pong, split_mode 'serial' only; the
# whole tile is staged for one TMA store (tile_epilogue: 40 and 56 are no multiple of the
# 16-column epilogue sub-tile)
NARROW_TILE_N = (40, 48, 56)
# swap_ab=True: tokens on the wgmma N side, weight rows on its M side
SWAP_TILE_M_CHOICES = (8, 16, 32, 64)
SWAP_TILE_N_CHOICES = (64, 128)
# stage cap of swap_ab, wg_n = 2 and the NARROW_TILE_N widths (small stages: deeper rings
# keep more weight bytes in flight)
SWAP_MAX_STAGES = 16
# consumer warpgroups along N (wg_n = 2): tile_m = 64, tile_n split in two halves of
# tile_n/2 columns (a multiple of 8, the wgmma N step); the epilogue stages the whole tile
# in one shared-memory buffer
WG_N_CHOICES = (1, 2)
# ping-pong (pingpong = True): two consumer warpgroups, each with whole tile_m x tile_n
# tiles of its own, the CTA's tiles alternating between them, so one warpgroup's epilogue
# runs under the other's main loop. tile_m = 64 (one m64 wgmma atom) or 128 (two m64 atoms
# along M per warpgroup: tile_n accumulator registers per thread, so tile_n <=
# MAX_ACC_REGS_PER_THREAD, and tile_n >= 128); S > 1 with split_mode 'serial' only
PINGPONG_TILE_M = (64, 128)
CLUSTER_CHOICES = ((1, 1), (2, 1), (1, 2))
RASTER_CHOICES = ("m", "n")
SWIZZLE_CHOICES = (1, 2, 4, 8)
OUT_DTYPES = ("bfloat16", "float16")  # FP8 operands
BF16_OUT_DTYPES = ("bfloat16", "float16", "float32")  # bf16 operands (float32: router logits)
FP8_AB_DTYPES = ("e4m3", "e5m2")
BF16 = "bf16"  # bf16 operands: scales "none", accum "fast", family BF16_FAMILY
AB_DTYPES = (*FP8_AB_DTYPES, BF16)
AB_DTYPE_BYTES = {"e4m3": 1, "e5m2": 1, BF16: 2}
NO_SCALES = "none"  # the bf16 operands' scheme: no scale is read, the sum is rounded as is

# Shared memory: 228 KB per SM on H100/H200, of which 227 KB (232448 B) per block.
SMEM_CAPACITY_BYTES = 227 * 1024
# The mbarrier array (2 per stage, 8 B each) sits in front of the 1024-B aligned
# operand buffers; with at most 16 stages it fits in one 1024-B slot.
MBAR_REGION_BYTES = 1024
# The compiled kernel also carries a 1024-B static shared section; count it.
STATIC_SMEM_BYTES = 1024
BUFFER_ALIGN_BYTES = 1024
EPI_STAGES = 2
MAX_STAGES = 8
MIN_STAGES = 2
# swap_ab: the epilogue stores from registers; the kernel still declares a 1-stage 8x64
# C buffer (never used), 1 KB after alignment for a 2-byte output (2 KB for float32)
SWAP_EPI_BYTES = 1024
# bf16 narrow decode tiles: 48 only. CuTe-DSL aborts compiling the unswapped 64 x 40 and
# 64 x 56 bf16 kernels (SIGABRT in the compiler, no message), which FP8 builds
BF16_NARROW_TILE_N = (48,)

THREADS_PER_WARPGROUP = 128
# setmaxnreg budget of a consumer warpgroup (producer warpgroup drops to 40):
# (232 * 2 + 40) * 128 = 64512 <= 65536 registers per SM.
CONSUMER_MAX_REGS = 232
# fp32 accumulator registers per consumer thread that still leave room for
# addresses, the epilogue fragment and the pipeline state without spilling: 256x192
# (192 regs) compiles with a zero-byte stack frame under the 232 cap; 128x256 on one
# warpgroup or 256x256 on two (256 regs) cannot fit at all.
MAX_ACC_REGS_PER_THREAD = 192

OUT_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

PARAM_KEYS = (
    "tile_m",
    "tile_n",
    "cluster_m",
    "cluster_n",
    "raster",
    "swizzle",
    "stages",
    "out_dtype",
    "ab_dtype",
    "splits",
    "split_mode",
    "swap_ab",
    "wg_n",
    "pingpong",
    "pdl",
    "scales",
    "accum",
)
# keys to_params() leaves out at their default, so that the canonical params (and so the
# artifact keys) of every tactic from before the field existed stay what they were
OMITTED_AT_DEFAULT = {"pdl": False, "scales": "tensor", "accum": "fast"}


def num_consumer_warpgroups(tile_m: int) -> int:
    """By the tile's wgmma M side (tile_m, or tile_n for swap_ab): 64 -> one warpgroup of
    64 rows; 128 -> two of 64 rows; 256 -> two of 128 rows."""
    return 1 if tile_m == 64 else 2


def mma_tile(tile_m: int, tile_n: int, swap_ab: bool = False) -> tuple[int, int]:
    """The kernel's (wgmma M side, wgmma N side) tile: (tile_m, tile_n), or swapped."""
    return (tile_n, tile_m) if swap_ab else (tile_m, tile_n)


def epilogue_tile(tile_m: int, tile_n: int, pingpong: bool = False) -> tuple[int, int]:
    """Sub-tile of C staged through shared memory per TMA store: 32 columns, or 16 where
    32 does not divide tile_n (80, 112); as many rows as the tiled MMA has (64 for one
    warpgroup's tiles: tile_m = 64, or ping-pong), else 128."""
    rows = 64 if tile_m == 64 or pingpong else 128
    return rows, min(32 if tile_n % 32 == 0 else 16, tile_n)


def acc_regs_per_thread(tile_m: int, tile_n: int, swap_ab: bool = False, wg_n: int = 1,
                        pingpong: bool = False) -> int:
    """fp32 accumulator registers per consumer thread: the tile over the warpgroups that
    share it (ping-pong: one warpgroup owns the whole tile)."""
    rows = mma_tile(tile_m, tile_n, swap_ab)[0]
    wgs = 1 if pingpong else num_consumer_warpgroups(rows) * wg_n
    return tile_m * tile_n // (wgs * THREADS_PER_WARPGROUP)


def register_epilogue(swap_ab: bool, wg_n: int) -> bool:
    """Whether the kernel stores C from registers (swap_ab) rather than through shared
    memory and TMA (wg_n = 2: the whole tile in one buffer, see _epi_bytes)."""
    return swap_ab


def tile_epilogue(tile_n: int, wg_n: int, swap_ab: bool = False) -> bool:
    """Whether the kernel stages the whole tile_m x tile_n output tile in one row-major
    shared-memory buffer (plain stores in the MMA's register layout) and TMA-stores it at
    once: wg_n = 2, and the NARROW_TILE_N widths; never with swap_ab (register_epilogue)."""
    return not swap_ab and (wg_n == 2 or tile_n in NARROW_TILE_N)


def acc_sets(splits: int, split_mode: str, accum: str = "fast") -> int:
    """fp32 accumulator copies a consumer thread holds: one, plus one for a serial split
    (the running sum beside the current range's partial), plus one for exact accumulation
    (the promoted sum beside the K tile's wgmma accumulator)."""
    return 1 + (splits > 1 and split_mode == "serial") + (accum == "exact")


def tile_k_for(ab_dtype: str) -> int:
    """K tile in elements: K_TILE_BYTES of one operand row (128 for FP8, 64 for bf16)."""
    return K_TILE_BYTES // AB_DTYPE_BYTES[ab_dtype]


def family_of(ab_dtype: str) -> str:
    """The family whose tactics have operands ``ab_dtype``: BF16_FAMILY for bf16, else
    FAMILY."""
    return BF16_FAMILY if ab_dtype == BF16 else FAMILY


def out_dtypes_for(ab_dtype: str) -> tuple[str, ...]:
    """The output types a tactic with operands ``ab_dtype`` may have."""
    return BF16_OUT_DTYPES if ab_dtype == BF16 else OUT_DTYPES


def reduction_class_id(splits: int, accum: str = "fast", scales: str = "tensor") -> str:
    """The stable id of the reduction-order class with S = ``splits``, accumulation mode
    and scale scheme (module doc): ``k128.acc1.s4.fixed`` (per-tensor, fast),
    ``k128.prom128.s1.fixed.token`` (per-token x per-channel, exact); the bf16 operands'
    scheme ``"none"`` names its 64-element K tile, ``k64.acc1.s2.fixed``."""
    if scales == NO_SCALES:
        return f"k{BF16_TILE_K}.{ACC_IDS[accum]}.s{splits}.fixed"
    return (f"k{TILE_K}.{ACC_IDS[accum]}.s{splits}.fixed"
            + ("" if scales == "tensor" else f".{scales}"))


#: the per-tensor fast classes first (the ids published before the schemes existed)
REDUCTION_CLASSES = (tuple(reduction_class_id(s) for s in SPLIT_CHOICES)
                     + tuple(reduction_class_id(s, "fast", "token") for s in SPLIT_CHOICES)
                     # block128 has exact accumulation only (its scales go in at the promotion)
                     + tuple(reduction_class_id(1, "exact", sc) for sc in SCALE_SCHEMES)
                     # exact splits (per-tensor and per-token)
                     + tuple(reduction_class_id(s, "exact", sc) for sc in ("tensor", "token")
                             for s in SPLIT_CHOICES if s > 1))


#: the bf16 family's classes (BF16_FAMILY): fast accumulation, no scales, every S
BF16_REDUCTION_CLASSES = tuple(reduction_class_id(s, "fast", NO_SCALES) for s in SPLIT_CHOICES)


def bf16_class_splits(class_id: str) -> int:
    """S of a BF16_FAMILY class id; ValueError for an id that family does not have."""
    for s in SPLIT_CHOICES:
        if reduction_class_id(s, "fast", NO_SCALES) == class_id:
            return s
    raise ValueError(f"unknown {BF16_FAMILY} reduction class {class_id!r}; classes: "
                     f"{', '.join(BF16_REDUCTION_CLASSES)}")


def class_scheme(class_id: str) -> tuple[int, str, str]:
    """(splits, accum, scales) of a class id; ValueError for an id this family lacks."""
    for s in SPLIT_CHOICES:
        for acc in ACCUM_MODES:
            for sc in SCALE_SCHEMES:
                if reduction_class_id(s, acc, sc) == class_id and class_id in REDUCTION_CLASSES:
                    return s, acc, sc
    raise ValueError(
        f"unknown {FAMILY} reduction class {class_id!r}; classes: {', '.join(REDUCTION_CLASSES)}"
    )


def splits_of_class(class_id: str) -> int:
    """S of a class id (class_scheme); ValueError for an id this family does not have."""
    return class_scheme(class_id)[0]


def _stage_bytes(tile_m: int, tile_n: int) -> int:
    # K_TILE_BYTES per row of A (tile_m rows) and B (tile_n rows), whatever the operand
    # type: 128 one-byte FP8 elements or 64 two-byte bf16 ones.
    return (tile_m + tile_n) * K_TILE_BYTES


def _epi_bytes(tile_m: int, tile_n: int, out_dtype: str, swap_ab: bool = False,
               wg_n: int = 1, pingpong: bool = False) -> int:
    if register_epilogue(swap_ab, wg_n):  # the unused 8x64 C buffer (1 KB; 2 KB for fp32)
        return SWAP_EPI_BYTES * OUT_DTYPE_BYTES[out_dtype] // 2
    if tile_epilogue(tile_n, wg_n):  # the whole tile_m x tile_n tile, one buffer
        raw = tile_m * tile_n * OUT_DTYPE_BYTES[out_dtype]
        return -(-raw // BUFFER_ALIGN_BYTES) * BUFFER_ALIGN_BYTES
    em, en = epilogue_tile(tile_m, tile_n, pingpong)
    # ping-pong: one ring of C buffers per warpgroup
    raw = em * en * OUT_DTYPE_BYTES[out_dtype] * EPI_STAGES * (2 if pingpong else 1)
    return -(-raw // BUFFER_ALIGN_BYTES) * BUFFER_ALIGN_BYTES


def smem_bytes_for(tile_m: int, tile_n: int, stages: int, out_dtype: str = "bfloat16",
                   swap_ab: bool = False, wg_n: int = 1, pingpong: bool = False) -> int:
    """Dynamic shared memory of one CTA: mbarriers + A/B stage buffers + C staging."""
    return (
        STATIC_SMEM_BYTES
        + MBAR_REGION_BYTES
        + stages * _stage_bytes(tile_m, tile_n)
        + _epi_bytes(tile_m, tile_n, out_dtype, swap_ab, wg_n, pingpong)
    )


def max_stages_for(tile_m: int, tile_n: int, out_dtype: str = "bfloat16",
                   swap_ab: bool = False, wg_n: int = 1, pingpong: bool = False) -> int:
    """Most A/B stages that fit the budget (capped at MAX_STAGES, SWAP_MAX_STAGES for
    swap_ab, wg_n = 2 and the NARROW_TILE_N widths); may be < 2."""
    fixed = (STATIC_SMEM_BYTES + MBAR_REGION_BYTES
             + _epi_bytes(tile_m, tile_n, out_dtype, swap_ab, wg_n, pingpong))
    free = SMEM_CAPACITY_BYTES - fixed
    cap = (SWAP_MAX_STAGES if swap_ab or wg_n == 2 or tile_n in NARROW_TILE_N
           else MAX_STAGES)
    return min(cap, free // _stage_bytes(tile_m, tile_n))


def tile_is_feasible(tile_m: int, tile_n: int, out_dtype: str = "bfloat16",
                     sets: int = 1, swap_ab: bool = False, wg_n: int = 1,
                     pingpong: bool = False) -> tuple[bool, str]:
    """Whether the tile fits registers (``sets`` accumulator copies) and shared memory."""
    regs = acc_regs_per_thread(tile_m, tile_n, swap_ab, wg_n, pingpong)
    wgs = 1 if pingpong else num_consumer_warpgroups(mma_tile(tile_m, tile_n, swap_ab)[0]) * wg_n
    if sets * regs > MAX_ACC_REGS_PER_THREAD:
        what = "" if sets == 1 else (f" x {sets} (a serial split keeps a running sum, exact "
                                     f"accumulation a promoted sum)")
        return False, (
            f"tile {tile_m}x{tile_n} needs {regs}{what} fp32 "
            f"accumulator registers per consumer thread "
            f"({wgs} consumer warpgroup(s) per tile); the limit is "
            f"{MAX_ACC_REGS_PER_THREAD} (consumer budget {CONSUMER_MAX_REGS} regs/thread). "
            f"Use a smaller tile, tile_m=128, or split_mode 'cta'."
        )
    if max_stages_for(tile_m, tile_n, out_dtype, swap_ab, wg_n, pingpong) < MIN_STAGES:
        return False, (
            f"tile {tile_m}x{tile_n} does not fit {MIN_STAGES} pipeline stages in "
            f"{SMEM_CAPACITY_BYTES} B of shared memory"
        )
    return True, ""


@dataclasses.dataclass(frozen=True)
class HopperFp8Tactic:
    """One compiled variant of the Hopper FP8 GEMM.

    Fields (all part of the artifact identity):
      tile_m, tile_n   CTA output tile (tile_k is always TILE_K = 128)
      cluster_m/n      thread-block cluster shape; A is TMA-multicast across cluster_n,
                       B across cluster_m
      raster           "m" or "n": which output dimension the persistent scheduler walks first
      swizzle          group size (in clusters) of the scheduler's L2-friendly swizzle
      stages           A/B shared-memory pipeline depth
      out_dtype        "bfloat16" or "float16"
      ab_dtype         "e4m3" (float8_e4m3fn) or "e5m2" (float8_e5m2), both A and B
      splits           S in SPLIT_CHOICES: K split count of the reduction-order class
      split_mode       "serial" (one CTA sums its tile's S ranges in registers) or "cta"
                       (S work units per tile, reduced through a workspace; needs S > 1
                       and cluster 1x1). Same arithmetic either way (module doc).
      swap_ab          False, or True for the decode tiles: weight rows on the wgmma M
                       side, tokens on its N side (module doc); tile_m in
                       SWAP_TILE_M_CHOICES, tile_n in SWAP_TILE_N_CHOICES, cluster 1x1.
      wg_n             consumer warpgroups along N: 1, or 2 for tile_m = 64 with the
                       tile's N split between two warpgroups (module doc); not with swap_ab.
      pingpong         False, or True: two consumer warpgroups that each own whole tiles
                       (tile_m 64 or 128), the CTA's tiles alternating between them
                       (PINGPONG_TILE_M; S > 1 with split_mode 'serial' only);
                       not with swap_ab or wg_n = 2.
      pdl              False, or True: launched with programmatic dependent launch (the
                       next kernel on the stream may start its prologue while this one
                       runs; every CTA waits for the previous grid before its first read
                       or write of global memory). Any tactic may take it; the K walk is
                       unchanged, so a pdl tactic is in the class of its S. Left out of
                       to_params() when False (OMITTED_AT_DEFAULT).
      scales           "tensor", "token" (per-token activation x per-channel weight,
                       applied in the epilogue) or "block128" (1x128 x 128x128 scales at
                       the promotion, accum "exact" only); part of the class (module doc). Left out
                       of to_params() at "tensor".
      accum            "fast" or "exact" (the wgmma accumulator promoted into fp32
                       registers every K tile; block128: S = 1 only); part of the class.
                       Left out of to_params() at "fast".
    """

    tile_m: int = 128
    tile_n: int = 128
    cluster_m: int = 1
    cluster_n: int = 1
    raster: str = "m"
    swizzle: int = 1
    stages: int = 0  # 0 in a constructor call means "the most that fit"; see normalized()
    out_dtype: str = "bfloat16"
    ab_dtype: str = "e4m3"
    splits: int = 1
    split_mode: str = "serial"
    swap_ab: bool = False
    wg_n: int = 1
    pingpong: bool = False
    pdl: bool = False
    scales: str = "tensor"
    accum: str = "fast"

    # -- derived facts -------------------------------------------------------------
    @property
    def tile_k(self) -> int:
        """K tile in elements: 128 (FP8) or 64 (bf16), 128 bytes a row either way."""
        return tile_k_for(self.ab_dtype) if self.ab_dtype in AB_DTYPE_BYTES else TILE_K

    @property
    def wgmma_k(self) -> int:
        """K of one wgmma instruction: a quarter of the K tile (k32 FP8, k16 bf16)."""
        return self.tile_k // 4

    @property
    def family(self) -> str:
        """The family that serves the tactic (family_of its operand type)."""
        return family_of(self.ab_dtype)

    @property
    def cluster_size(self) -> int:
        return self.cluster_m * self.cluster_n

    @property
    def consumer_warpgroups(self) -> int:
        if self.pingpong:
            return 2
        return (num_consumer_warpgroups(mma_tile(self.tile_m, self.tile_n, self.swap_ab)[0])
                * self.wg_n)

    @property
    def threads_per_cta(self) -> int:
        return (1 + self.consumer_warpgroups) * THREADS_PER_WARPGROUP

    @property
    def reduction_order(self) -> str:
        if self.scales == NO_SCALES:  # bf16: fast, no scale
            kw = f"k_tile={self.tile_k},wgmma_k={self.wgmma_k}"
            if self.splits == 1:
                return f"{kw},full_k_per_cta,fp32_acc_single,no_scale"
            return (f"{kw},splits={self.splits}:balanced_k_tile_ranges,fp32_acc_single_per_"
                    f"range,fp32_sum_in_split_order_from_zero,no_scale")
        scheme = {"tensor": "", "token": ",scale=per_token_a_x_per_channel_b",
                  "block128": ",scale=block128_a_1x128_x_b_128x128_at_promotion"}[self.scales]
        if self.accum == "exact" and self.splits > 1:  # either split mode
            return (f"k_tile={TILE_K},wgmma_k={WGMMA_K},splits={self.splits}:balanced_k_tile_"
                    f"ranges,wgmma_acc_per_k_tile_promoted_to_fp32_in_k_order_per_range,"
                    f"fp32_sum_in_split_order_from_zero,scale_after{scheme}")
        if self.accum == "exact":
            return (f"k_tile={TILE_K},wgmma_k={WGMMA_K},full_k_per_cta,"
                    f"wgmma_acc_per_k_tile_promoted_to_fp32_in_k_order"
                    f"{'' if self.scales == 'block128' else ',scale_after'}{scheme}")
        if self.splits == 1:
            return REDUCTION_ORDER + scheme
        return (f"k_tile={TILE_K},wgmma_k={WGMMA_K},splits={self.splits}:balanced_k_tile_ranges,"
                f"fp32_acc_single_per_range,fp32_sum_in_split_order_from_zero,scale_after"
                f"{scheme}")

    @property
    def reduction_class(self) -> str:
        return reduction_class_id(self.splits, self.accum, self.scales)

    @property
    def name(self) -> str:
        split = f"_k{self.splits}{self.split_mode[0]}" if self.splits > 1 else ""
        return (
            f"m{self.tile_m}n{self.tile_n}_c{self.cluster_m}x{self.cluster_n}"
            f"_r{self.raster}_s{self.swizzle}_st{self.stages}_{self.ab_dtype}_{self.out_dtype}"
            f"{split}{'_sw' if self.swap_ab else ''}{'_wn2' if self.wg_n == 2 else ''}"
            f"{'_pp' if self.pingpong else ''}{'_pdl' if self.pdl else ''}"
            f"{ {'tensor': '', 'token': '_tok', 'block128': '_b128'}.get(self.scales, '')}"
            f"{'_ex' if self.accum == 'exact' else ''}"
        )

    # -- validation / encoding -------------------------------------------------------
    def normalized(self) -> HopperFp8Tactic:
        """Return the tactic with stages filled in (0 -> the most that fit), validated."""
        t = self
        ms, ns = ((SWAP_TILE_M_CHOICES, SWAP_TILE_N_CHOICES) if t.swap_ab is True
                  else (TILE_M_CHOICES, TILE_N_CHOICES + NARROW_TILE_N + WAVE_TILE_N))
        if (t.stages == 0 and t.tile_m in ms and t.tile_n in ns
                and t.out_dtype in OUT_DTYPE_BYTES):
            t = dataclasses.replace(t, stages=max_stages_for(t.tile_m, t.tile_n, t.out_dtype,
                                                             t.swap_ab, t.wg_n, t.pingpong))
        t.validate()
        return t

    def validate(self) -> None:
        """Raise ValueError with an actionable message if the tactic cannot be built."""
        def bad(msg: str) -> None:
            fam = family_of(self.ab_dtype) if isinstance(self.ab_dtype, str) else FAMILY
            raise ValueError(f"invalid {fam} tactic {self.to_params()}: {msg}")

        for f in ("tile_m", "tile_n", "cluster_m", "cluster_n", "swizzle", "stages", "splits",
                  "wg_n"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool):
                bad(f"{f} must be an int, got {type(v).__name__}")
        if not isinstance(self.swap_ab, bool):
            bad(f"swap_ab must be true or false, got {type(self.swap_ab).__name__}")
        if self.swap_ab:
            if self.tile_m not in SWAP_TILE_M_CHOICES:
                bad(f"tile_m must be one of {SWAP_TILE_M_CHOICES} with swap_ab (the tokens "
                    f"are the wgmma N side)")
            if self.tile_n not in SWAP_TILE_N_CHOICES:
                bad(f"tile_n must be one of {SWAP_TILE_N_CHOICES} with swap_ab (the weight "
                    f"rows are the wgmma M side)")
            if self.cluster_size != 1:
                bad("swap_ab needs cluster_m = cluster_n = 1")
        else:
            if self.tile_m not in TILE_M_CHOICES:
                bad(f"tile_m must be one of {TILE_M_CHOICES}")
            if self.tile_n not in TILE_N_CHOICES + NARROW_TILE_N + WAVE_TILE_N:
                bad(f"tile_n must be one of {TILE_N_CHOICES + NARROW_TILE_N + WAVE_TILE_N}")
        if self.wg_n not in WG_N_CHOICES:
            bad(f"wg_n must be one of {WG_N_CHOICES}")
        if self.wg_n == 2 and (self.swap_ab or self.tile_m != 64):
            bad("wg_n=2 (two consumer warpgroups along N) needs tile_m=64 and swap_ab=false")
        if self.wg_n == 2 and self.split_mode == "cta" and self.splits > 1:
            bad("wg_n=2 takes split_mode 'serial' only")
        if self.wg_n == 2 and (self.tile_n // 2) % 8:
            bad(f"wg_n=2 needs tile_n/2 a multiple of 8 (the wgmma N step); tile_n="
                f"{self.tile_n} gives {self.tile_n / 2:g}")
        if not isinstance(self.pingpong, bool):
            bad(f"pingpong must be true or false, got {type(self.pingpong).__name__}")
        if not isinstance(self.pdl, bool):
            bad(f"pdl must be true or false, got {type(self.pdl).__name__}")
        if self.ab_dtype == BF16 and (self.scales != NO_SCALES or self.accum != "fast"):
            bad(f"bf16 operands take scales={NO_SCALES!r} and accum='fast' only (no scale is "
                f"read; the bf16 wgmma accumulates in fp32), got scales={self.scales!r}, "
                f"accum={self.accum!r}")
        if self.scales == NO_SCALES and self.ab_dtype != BF16:
            bad(f"scales={NO_SCALES!r} is the bf16 operands' scheme; FP8 operands take one "
                f"of {SCALE_SCHEMES}")
        if self.scales not in (*SCALE_SCHEMES, NO_SCALES):
            bad(f"scales must be one of {SCALE_SCHEMES}, got {self.scales!r}")
        if self.accum not in ACCUM_MODES:
            bad(f"accum must be one of {ACCUM_MODES}, got {self.accum!r}")
        if self.accum == "exact" and self.splits != 1 and self.scales == "block128":
            bad("accum 'exact' with scales 'block128' takes splits=1 only (block128 is not "
                "split)")
        if self.scales == "block128" and self.accum != "exact":
            bad("scales 'block128' are applied at the promotion: it needs accum='exact'")
        if self.tile_n in NARROW_TILE_N and not self.swap_ab:
            if self.ab_dtype == BF16 and self.tile_n not in BF16_NARROW_TILE_N:
                bad(f"bf16 narrow decode tiles take tile_n in {BF16_NARROW_TILE_N} (the "
                    f"compiler cannot build 64 x {self.tile_n} on bf16 operands)")
            if self.tile_m != 64 or self.pingpong:
                bad(f"tile_n in {NARROW_TILE_N} (narrow decode tiles) needs tile_m=64 and "
                    f"pingpong=false")
            if self.split_mode == "cta" and self.splits > 1:
                bad(f"tile_n in {NARROW_TILE_N} takes split_mode 'serial' only")
        if self.pingpong and (self.tile_m not in PINGPONG_TILE_M or self.swap_ab
                              or self.wg_n != 1):
            bad(f"pingpong needs tile_m in {PINGPONG_TILE_M}, wg_n=1 and swap_ab=false")
        if self.pingpong and self.splits > 1 and self.split_mode != "serial":
            bad("pingpong takes split_mode 'serial' only")
        if self.pingpong and self.tile_m == 128 and self.tile_n < 128:
            bad("pingpong with tile_m=128 needs tile_n >= 128 (each warpgroup owns a whole "
                "128-row tile)")
        if (self.cluster_m, self.cluster_n) not in CLUSTER_CHOICES:
            bad(f"(cluster_m, cluster_n) must be one of {CLUSTER_CHOICES}")
        if self.raster not in RASTER_CHOICES:
            bad(f"raster must be one of {RASTER_CHOICES}")
        if self.swizzle not in SWIZZLE_CHOICES:
            bad(f"swizzle must be one of {SWIZZLE_CHOICES}")
        if self.ab_dtype not in AB_DTYPES:
            bad(f"ab_dtype must be one of {AB_DTYPES}")
        if self.out_dtype not in out_dtypes_for(self.ab_dtype):
            bad(f"out_dtype must be one of {out_dtypes_for(self.ab_dtype)}")
        if self.splits not in SPLIT_CHOICES:
            bad(f"splits must be one of {SPLIT_CHOICES}")
        if self.split_mode not in SPLIT_MODES:
            bad(f"split_mode must be one of {SPLIT_MODES}")
        if self.split_mode == "cta" and self.splits == 1:
            bad("split_mode 'cta' needs splits > 1 (splits=1 is one unit per tile: use 'serial')")
        if self.split_mode == "cta" and self.cluster_size != 1:
            bad("split_mode 'cta' needs cluster_m = cluster_n = 1")
        ok, why = tile_is_feasible(self.tile_m, self.tile_n, self.out_dtype,
                                   acc_sets(self.splits, self.split_mode, self.accum),
                                   self.swap_ab,
                                   self.wg_n, self.pingpong)
        if not ok:
            bad(why)
        top = max_stages_for(self.tile_m, self.tile_n, self.out_dtype, self.swap_ab, self.wg_n,
                             self.pingpong)
        if not (MIN_STAGES <= self.stages <= top):
            used = smem_bytes_for(self.tile_m, self.tile_n, self.stages, self.out_dtype,
                                  self.swap_ab, self.wg_n, self.pingpong)
            bad(
                f"stages must be in [{MIN_STAGES}, {top}] for tile {self.tile_m}x{self.tile_n} "
                f"({used} B of "
                f"shared memory at stages={self.stages}, budget {SMEM_CAPACITY_BYTES} B); "
                f"pass stages=0 to take the most that fit"
            )

    def to_params(self) -> dict[str, Any]:
        """Canonical, JSON-able parameters (every field, fixed key order; a field of
        OMITTED_AT_DEFAULT only where it differs from its default)."""
        return {k: getattr(self, k) for k in PARAM_KEYS
                if k not in OMITTED_AT_DEFAULT or getattr(self, k) != OMITTED_AT_DEFAULT[k]}


def tactic_from_params(params: Mapping[str, Any]) -> HopperFp8Tactic:
    """Inverse of HopperFp8Tactic.to_params(); validates.

    Every key of PARAM_KEYS is accepted; "stages" may be omitted or 0 (= the most that
    fit), the others default to the dataclass defaults. Unknown keys are an error.
    """
    if not isinstance(params, Mapping):
        raise ValueError(f"{FAMILY} params must be a mapping, got {type(params).__name__}")
    unknown = sorted(set(params) - set(PARAM_KEYS))
    if unknown:
        raise ValueError(
            f"unknown {FAMILY} tactic parameter(s) {unknown}; expected keys {list(PARAM_KEYS)}"
        )
    return HopperFp8Tactic(**dict(params)).normalized()


def smem_bytes(t: HopperFp8Tactic) -> int:
    """Shared memory of one CTA of ``t`` in bytes (smem_bytes_for of its fields)."""
    return smem_bytes_for(t.tile_m, t.tile_n, t.stages, t.out_dtype, t.swap_ab, t.wg_n,
                          t.pingpong)
