"""Tactic space of the Hopper (sm_90a) FP8 GEMM family.

C = cvt((A @ B^T) * (a_scale * b_scale)), A (M, K) and B (N, K) FP8 and K-major,
a_scale / b_scale per-tensor fp32 scales held in 1-element device tensors, C (M, N)
row-major bf16 or fp16.

This module is imported by the daemon's main process: it must not import cutlass
or torch. It only knows the arithmetic of the tactic space (shared-memory budget,
register budget, a wave/padding cost model) and the canonical parameter encoding.

Reduction order
---------------
Every tactic reduces every output element over K in the same order: the CTA owns
the whole K range (no split-K, no stream-K), walks it in K tiles of ``TILE_K`` = 128
elements from k = 0 upwards, and inside a K tile issues four wgmma k32 instructions
in k order into one fp32 register accumulator that starts at zero (no second
"promotion" accumulator, no periodic flush). After the last K tile the accumulator is
multiplied once by (a_scale * b_scale), computed in fp32, and rounded to the output
type (round to nearest even). Tile M / tile N / cluster shape / raster / swizzle /
stage count change which CTA computes an element and when, never the arithmetic that
produces it. So the family's result for a row does not depend on M (batch invariant),
and all tactics of the family agree bitwise with each other (checked on an H200 by
bench/gpu/hopper_fp8_check.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

FAMILY = "hopper_fp8_gemm"
TARGET_ARCH = "sm_90a"

TILE_K = 128  # FP8 K tile: 4 x wgmma k32. Fixed for every tactic (see module doc).
WGMMA_K = 32
REDUCTION_ORDER = "k_tile=128,wgmma_k=32,full_k_per_cta,fp32_acc_single,scale_after"
REDUCTION_ORDER_M_INDEPENDENT = True

TILE_M_CHOICES = (64, 128, 256)
TILE_N_CHOICES = (64, 128, 192, 256)
CLUSTER_CHOICES = ((1, 1), (2, 1), (1, 2))
RASTER_CHOICES = ("m", "n")
SWIZZLE_CHOICES = (1, 2, 4, 8)
OUT_DTYPES = ("bfloat16", "float16")
AB_DTYPES = ("e4m3", "e5m2")

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

THREADS_PER_WARPGROUP = 128
# setmaxnreg budget of a consumer warpgroup (producer warpgroup drops to 40):
# (232 * 2 + 40) * 128 = 64512 <= 65536 registers per SM.
CONSUMER_MAX_REGS = 232
# fp32 accumulator registers per consumer thread that still leave room for
# addresses, the epilogue fragment and the pipeline state without spilling: 256x192
# (192 regs) compiles with a zero-byte stack frame under the 232 cap; 128x256 on one
# warpgroup or 256x256 on two (256 regs) cannot fit at all.
MAX_ACC_REGS_PER_THREAD = 192

OUT_DTYPE_BYTES = {"bfloat16": 2, "float16": 2}

H200_NUM_SMS = 132

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
)


def num_consumer_warpgroups(tile_m: int) -> int:
    """64 -> one warpgroup of 64 rows; 128 -> two of 64 rows; 256 -> two of 128 rows."""
    return 1 if tile_m == 64 else 2


def epilogue_tile(tile_m: int, tile_n: int) -> tuple[int, int]:
    """Sub-tile of C staged through shared memory per TMA store."""
    rows = 64 if tile_m == 64 else 128
    return rows, min(32, tile_n)


def acc_regs_per_thread(tile_m: int, tile_n: int) -> int:
    return tile_m * tile_n // (num_consumer_warpgroups(tile_m) * THREADS_PER_WARPGROUP)


def _stage_bytes(tile_m: int, tile_n: int) -> int:
    # FP8: one byte per element, for A (tile_m x TILE_K) and B (tile_n x TILE_K).
    return (tile_m + tile_n) * TILE_K


def _epi_bytes(tile_m: int, tile_n: int, out_dtype: str) -> int:
    em, en = epilogue_tile(tile_m, tile_n)
    raw = em * en * OUT_DTYPE_BYTES[out_dtype] * EPI_STAGES
    return -(-raw // BUFFER_ALIGN_BYTES) * BUFFER_ALIGN_BYTES


def smem_bytes_for(tile_m: int, tile_n: int, stages: int, out_dtype: str = "bfloat16") -> int:
    """Dynamic shared memory of one CTA: mbarriers + A/B stage buffers + C staging."""
    return (
        STATIC_SMEM_BYTES
        + MBAR_REGION_BYTES
        + stages * _stage_bytes(tile_m, tile_n)
        + _epi_bytes(tile_m, tile_n, out_dtype)
    )


def max_stages_for(tile_m: int, tile_n: int, out_dtype: str = "bfloat16") -> int:
    """Most A/B stages that fit the budget (capped at MAX_STAGES); may be < 2."""
    fixed = STATIC_SMEM_BYTES + MBAR_REGION_BYTES + _epi_bytes(tile_m, tile_n, out_dtype)
    free = SMEM_CAPACITY_BYTES - fixed
    return min(MAX_STAGES, free // _stage_bytes(tile_m, tile_n))


def tile_is_feasible(tile_m: int, tile_n: int, out_dtype: str = "bfloat16") -> tuple[bool, str]:
    if acc_regs_per_thread(tile_m, tile_n) > MAX_ACC_REGS_PER_THREAD:
        return False, (
            f"tile {tile_m}x{tile_n} needs {acc_regs_per_thread(tile_m, tile_n)} fp32 "
            f"accumulator registers per consumer thread "
            f"({num_consumer_warpgroups(tile_m)} consumer warpgroup(s)); the limit is "
            f"{MAX_ACC_REGS_PER_THREAD} (consumer budget {CONSUMER_MAX_REGS} regs/thread). "
            f"Use a smaller tile_n or tile_m=128."
        )
    if max_stages_for(tile_m, tile_n, out_dtype) < MIN_STAGES:
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

    # -- derived facts -------------------------------------------------------------
    @property
    def tile_k(self) -> int:
        return TILE_K

    @property
    def cluster_size(self) -> int:
        return self.cluster_m * self.cluster_n

    @property
    def consumer_warpgroups(self) -> int:
        return num_consumer_warpgroups(self.tile_m)

    @property
    def threads_per_cta(self) -> int:
        return (1 + self.consumer_warpgroups) * THREADS_PER_WARPGROUP

    @property
    def reduction_order(self) -> str:
        return REDUCTION_ORDER

    @property
    def name(self) -> str:
        return (
            f"m{self.tile_m}n{self.tile_n}_c{self.cluster_m}x{self.cluster_n}"
            f"_r{self.raster}_s{self.swizzle}_st{self.stages}_{self.ab_dtype}_{self.out_dtype}"
        )

    # -- validation / encoding -------------------------------------------------------
    def normalized(self) -> HopperFp8Tactic:
        """Return the tactic with stages filled in (0 -> the most that fit), validated."""
        t = self
        if t.stages == 0 and t.tile_m in TILE_M_CHOICES and t.tile_n in TILE_N_CHOICES \
                and t.out_dtype in OUT_DTYPES:
            t = dataclasses.replace(t, stages=max_stages_for(t.tile_m, t.tile_n, t.out_dtype))
        t.validate()
        return t

    def validate(self) -> None:
        """Raise ValueError with an actionable message if the tactic cannot be built."""
        def bad(msg: str) -> None:
            raise ValueError(f"invalid {FAMILY} tactic {self.to_params()}: {msg}")

        for f in ("tile_m", "tile_n", "cluster_m", "cluster_n", "swizzle", "stages"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool):
                bad(f"{f} must be an int, got {type(v).__name__}")
        if self.tile_m not in TILE_M_CHOICES:
            bad(f"tile_m must be one of {TILE_M_CHOICES}")
        if self.tile_n not in TILE_N_CHOICES:
            bad(f"tile_n must be one of {TILE_N_CHOICES}")
        if (self.cluster_m, self.cluster_n) not in CLUSTER_CHOICES:
            bad(f"(cluster_m, cluster_n) must be one of {CLUSTER_CHOICES}")
        if self.raster not in RASTER_CHOICES:
            bad(f"raster must be one of {RASTER_CHOICES}")
        if self.swizzle not in SWIZZLE_CHOICES:
            bad(f"swizzle must be one of {SWIZZLE_CHOICES}")
        if self.out_dtype not in OUT_DTYPES:
            bad(f"out_dtype must be one of {OUT_DTYPES}")
        if self.ab_dtype not in AB_DTYPES:
            bad(f"ab_dtype must be one of {AB_DTYPES}")
        ok, why = tile_is_feasible(self.tile_m, self.tile_n, self.out_dtype)
        if not ok:
            bad(why)
        top = max_stages_for(self.tile_m, self.tile_n, self.out_dtype)
        if not (MIN_STAGES <= self.stages <= top):
            bad(
                f"stages must be in [{MIN_STAGES}, {top}] for tile {self.tile_m}x{self.tile_n} "
                f"({smem_bytes_for(self.tile_m, self.tile_n, self.stages, self.out_dtype)} B of "
                f"shared memory at stages={self.stages}, budget {SMEM_CAPACITY_BYTES} B); "
                f"pass stages=0 to take the most that fit"
            )

    def to_params(self) -> dict[str, Any]:
        """Canonical, JSON-able parameters (every field, fixed key order)."""
        return {k: getattr(self, k) for k in PARAM_KEYS}


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
    return smem_bytes_for(t.tile_m, t.tile_n, t.stages, t.out_dtype)


# --------------------------------------------------------------------------------------
# Enumeration and the cost model
# --------------------------------------------------------------------------------------

# Microseconds one CTA spends per 128-deep K tile, by (tile_m, tile_n), cluster (1,1),
# swizzle 1: the median over 24 problems (M in 1..8192, four LLM weight shapes) of
# time / waves / k_tiles, measured on an H200 by bench/gpu/hopper_fp8_check.py (2026-11-30).
# Small-M problems fit the same per-tile cost (they are latency/issue bound per CTA, not
# bandwidth bound), so one table serves decode and prefill.
US_PER_K_TILE = {
    (64, 64): 0.203, (64, 128): 0.293, (64, 192): 0.364, (64, 256): 0.428,
    (128, 64): 0.342, (128, 128): 0.412, (128, 192): 0.618, (128, 256): 0.776,
    (256, 64): 0.586, (256, 128): 0.812, (256, 192): 1.176,
}


def estimate_us(t: HopperFp8Tactic, m: int, n: int, k: int, num_sms: int = H200_NUM_SMS) -> float:
    """Model time: full waves of CTAs (padding of the last wave and of the cluster grid
    counted) x K tiles x the measured per-K-tile cost of the tile shape."""
    tiles_m = -(-m // t.tile_m)
    tiles_n = -(-n // t.tile_n)
    ctas = (-(-tiles_m // t.cluster_m) * t.cluster_m) * (-(-tiles_n // t.cluster_n) * t.cluster_n)
    slots = (num_sms // t.cluster_size) * t.cluster_size
    waves = -(-ctas // slots)
    per = US_PER_K_TILE.get((t.tile_m, t.tile_n))
    if per is None:  # a tile shape not measured yet: scale from operand bytes per K tile
        per = 0.0032 * (t.tile_m + t.tile_n) * max(1.0, t.tile_m * t.tile_n / 16384)
    return waves * -(-k // TILE_K) * per


def _cost(t: HopperFp8Tactic, m: int, n: int, k: int, num_sms: int) -> tuple:
    """Smaller is better: model time, then (measured) preferences: no cluster, swizzle 1
    (clusters and swizzle 8 won only a few percent at M=8192 and lost up to 2x at small M
    because of padded, empty tiles), raster along M, then larger tiles."""
    return (
        round(estimate_us(t, m, n, k, num_sms), 3),
        t.cluster_size > 1,
        SWIZZLE_CHOICES.index(t.swizzle),
        CLUSTER_CHOICES.index((t.cluster_m, t.cluster_n)),
        RASTER_CHOICES.index(t.raster),
        -t.tile_n,
        -t.tile_m,
    )


def enumerate_tactics(
    m: int,
    n: int,
    k: int,
    out_dtype: str = "bfloat16",
    ab_dtype: str = "e4m3",
    num_sms: int = H200_NUM_SMS,
) -> list[HopperFp8Tactic]:
    """All feasible tactics for (m, n, k), best-first by the wave/padding cost model
    (estimate_us, then the tie-breaks of _cost).

    The order is deterministic (total order on the cost tuple). Every tactic carries the
    same reduction order (REDUCTION_ORDER), so any subset is batch-invariant as a set.
    """
    for name, v in (("m", m), ("n", n), ("k", k)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if n % 16 or k % 16:
        raise ValueError(f"n and k must be multiples of 16 (TMA 16-byte rows); got n={n}, k={k}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype!r}")
    if ab_dtype not in AB_DTYPES:
        raise ValueError(f"ab_dtype must be one of {AB_DTYPES}, got {ab_dtype!r}")
    out: list[HopperFp8Tactic] = []
    for tm in TILE_M_CHOICES:
        for tn in TILE_N_CHOICES:
            if not tile_is_feasible(tm, tn, out_dtype)[0]:
                continue
            stages = max_stages_for(tm, tn, out_dtype)
            for cm, cn in CLUSTER_CHOICES:
                for raster in RASTER_CHOICES:
                    for swz in SWIZZLE_CHOICES:
                        out.append(HopperFp8Tactic(tm, tn, cm, cn, raster, swz, stages,
                                                   out_dtype, ab_dtype))
    out.sort(key=lambda t: (_cost(t, m, n, k, num_sms), t.name))
    return out


def default_tactic(m: int, n: int, k: int, out_dtype: str = "bfloat16") -> HopperFp8Tactic:
    return enumerate_tactics(m, n, k, out_dtype)[0]


def reference_tactics(out_dtype: str = "bfloat16", ab_dtype: str = "e4m3") -> list[HopperFp8Tactic]:
    """A small fixed set used by the GPU check: every tile shape, every cluster shape."""
    spec = [
        (64, 64, 1, 1, "m", 1), (64, 128, 1, 1, "m", 1), (64, 256, 1, 1, "m", 1),
        (128, 64, 1, 1, "m", 1), (128, 128, 1, 1, "m", 1), (128, 128, 2, 1, "n", 4),
        (128, 192, 1, 1, "m", 1), (128, 256, 1, 1, "m", 1), (128, 256, 2, 1, "m", 8),
        (128, 256, 1, 2, "n", 8), (256, 64, 1, 1, "m", 1), (256, 128, 1, 1, "m", 1),
        (256, 128, 2, 1, "n", 4), (64, 192, 1, 2, "n", 2),
    ]
    return [HopperFp8Tactic(tm, tn, cm, cn, r, s, 0, out_dtype, ab_dtype).normalized()
            for tm, tn, cm, cn, r, s in spec]
