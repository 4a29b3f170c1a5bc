"""The fitted cost model of the Hopper FP8 family: model time of a tactic on a problem.

The fitted numbers are data, ``data/h200_cost.json`` (written by
``bench/gpu/hopper_fp8_fit.py --write-cost`` from H200 runs; docs/history.md): the
microseconds one CTA spends per K tile (128 bytes of an operand row: 128 FP8 elements; a
bf16 K tile of 64 elements is taken to cost the same, its bytes being the same and its four
wgmma k16 running at half the FP8 k32 rate), by tile kind (plain, swap_ab, wg_n = 2,
ping-pong), (tile_m, tile_n) and M regime (M <= 64, M <= 1024, larger), and the constants
of model_parts (bandwidth in bytes/us, drain in K tiles, times in us), and the twins
(TWINS, per M regime: a cluster's factor on the compute part, the microseconds a pdl launch
saves; ``bench/gpu/hopper_fp8_twins.py`` fits them on timed pairs that differ only there).
They are read once, on the first call of cost_model(), never at import. The model is only
an order: it ranks the tactics of a space (rank_key); it never changes what a kernel
computes.

Imports neither cutlass nor torch (the daemon's main process ranks with it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cached_client.keys import DEFAULT_SM_COUNT

from .tactic import (
    AB_DTYPE_BYTES,
    CLUSTER_CHOICES,
    FAMILY,
    OUT_DTYPE_BYTES,
    RASTER_CHOICES,
    SWIZZLE_CHOICES,
    TARGET_ARCH,
    HopperFp8Tactic,
)

H200_NUM_SMS = DEFAULT_SM_COUNT[TARGET_ARCH]  # 132: the device the cost file was fitted on
COST_FILE = Path(__file__).parent / "data" / "h200_cost.json"
# the cost file's table kinds and constant keys -> the names cost_model() gives them
_COST_TABLES = {"plain": "US_PER_K_TILE", "swap_ab": "SWAP_US_PER_K_TILE",
                "wg_n": "WG_N_US_PER_K_TILE", "pingpong": "PINGPONG_US_PER_K_TILE"}
_COST_CONSTANTS = {"hbm_bytes_per_us": "HBM_BYTES_PER_US", "drain_k_tiles": "DRAIN_K_TILES",
                   "cta_fixed_us": "CTA_FIXED_US",
                   "cta_reduce_us_per_kb": "CTA_REDUCE_US_PER_KB", "launch_us": "LAUNCH_US"}
_loaded: dict[str, Any] = {}  # cost_model()'s cache: empty until the first call
# the cost file's "twins" rows: [feature, value, regime (as _regime), figure, pairs fitted on]
# with value "CMxCN" and figure the compute part's factor for "cluster", value "on" and
# figure the us the launch saves for "pdl"
TWIN_FEATURES = ("pdl", "cluster")
CTA_PAST_ONE_WAVE_US = 1e9  # rank a 'cta' split that needs two waves or more last


def load_cost(path: str | Path) -> dict[str, Any]:
    """{attribute name: value} of a cost file (the format of data/h200_cost.json): each
    table as {(tile_m, tile_n): (M <= 64, M <= 1024, larger)} in us, each constant a float.
    ValueError names the file and what is wrong."""
    try:
        raw = json.loads(Path(path).read_text())
        out: dict[str, Any] = {}
        for kind, name in _COST_TABLES.items():
            out[name] = {(int(tm), int(tn)): tuple(float(x) for x in per)
                         for tm, tn, per in raw["us_per_k_tile"][kind]}
            if any(len(v) != 3 or min(v) <= 0 for v in out[name].values()):
                raise ValueError(f"{kind}: every entry needs 3 positive times")
        for key, name in _COST_CONSTANTS.items():
            out[name] = float(raw["constants"][key])
            if out[name] <= 0:
                raise ValueError(f"constant {key} must be positive")
        out["TWINS"] = {}
        for feature, value, regime, figure, _pairs in raw.get("twins", []):
            bounds = (0.25, 4.0) if feature == "cluster" else (-5.0, 5.0)
            if feature not in TWIN_FEATURES or regime not in (0, 1, 2) \
                    or not bounds[0] < figure < bounds[1]:
                raise ValueError(f"twins: bad row {[feature, value, regime, figure]}")
            out["TWINS"][(feature, str(value), int(regime))] = float(figure)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a {FAMILY} cost file: {type(exc).__name__}: {exc}"
                         ) from None
    return out


def cost_model() -> dict[str, Any]:
    """{name: value} of COST_FILE (load_cost), read on the first call; the same dict on
    every call (a caller may replace its contents to rank with other tables)."""
    if "US_PER_K_TILE" not in _loaded:
        _loaded.update(load_cost(COST_FILE))
    return _loaded


def _regime(m: int) -> int:
    """Index of M's regime in a cost table entry: M <= 64, M <= 1024, larger."""
    return 0 if m <= 64 else (1 if m <= 1024 else 2)


def _per_k_tile_us(tile_m: int, tile_n: int, m: int, swap_ab: bool = False,
                   wg_n: int = 1, pingpong: bool = False) -> float:
    """Microseconds one CTA of the tile spends per K tile (128 bytes a row) at M = ``m``.
    A width the table lacks between two it has (same tile_m) is interpolated linearly in
    tile_n; outside them the time scales with the operand bytes per K tile."""
    c = cost_model()
    table = c[("SWAP_US_PER_K_TILE" if swap_ab else "WG_N_US_PER_K_TILE" if wg_n == 2
               else "PINGPONG_US_PER_K_TILE" if pingpong else "US_PER_K_TILE")]
    r = _regime(m)
    per = table.get((tile_m, tile_n))
    if per is not None:
        return per[r]
    below = [tn for tm, tn in table if tm == tile_m and tn < tile_n]
    above = [tn for tm, tn in table if tm == tile_m and tn > tile_n]
    if below and above:
        lo, hi = max(below), min(above)
        f = (tile_n - lo) / (hi - lo)
        return table[(tile_m, lo)][r] * (1 - f) + table[(tile_m, hi)][r] * f
    return 0.0032 * (tile_m + tile_n) * max(1.0, tile_m * tile_n / 16384)


def work_units(t: HopperFp8Tactic, m: int, n: int) -> int:
    """Work units of the persistent schedule: output tiles (padded to whole clusters),
    times S for split_mode 'cta'."""
    tiles_m = -(-m // t.tile_m)
    tiles_n = -(-n // t.tile_n)
    ctas = (-(-tiles_m // t.cluster_m) * t.cluster_m) * (-(-tiles_n // t.cluster_n) * t.cluster_n)
    return ctas * (t.splits if t.split_mode == "cta" else 1)


def estimate_us(t: HopperFp8Tactic, m: int, n: int, k: int, num_sms: int = H200_NUM_SMS) -> float:
    """Model time in microseconds: the larger of model_parts() (the compute part times a
    cluster's twin factor) plus the launch cost, less what a pdl launch saves (TWINS; none
    where the cost file has no figure for the feature, value and M regime)."""
    compute, memory = model_parts(t, m, n, k, num_sms)
    twins, regime = cost_model()["TWINS"], _regime(m)
    feats = twin_value(t, m, n)
    if "cluster" in feats:
        compute *= twins.get(("cluster", feats["cluster"], regime), 1.0)
    saved = twins.get(("pdl", "on", regime), 0.0) if "pdl" in feats else 0.0
    return max(compute, memory) + cost_model()["LAUNCH_US"] - saved


def model_parts(t: HopperFp8Tactic, m: int, n: int, k: int,
                num_sms: int = H200_NUM_SMS) -> tuple[float, float]:
    """(compute, memory) model times in microseconds, launch cost not included.

    Compute side: waves of work units (padding of the last wave and of the cluster grid
    counted) x the K tiles one unit walks x the measured per-K-tile cost of the tile
    shape; a serial split adds one pipeline drain per range boundary, a 'cta' split the
    partial round trip and the last unit's fixed-order sum (and is ranked last when its
    units need more than one wave). Memory side: the unique bytes (A, B, C, partials)
    over the chip's bandwidth.
    """
    c = cost_model()
    slots = (num_sms // t.cluster_size) * t.cluster_size
    units = work_units(t, m, n)
    waves = -(-units // slots)
    kt = -(-k // t.tile_k)  # K tiles of 128 bytes a row (128 FP8 or 64 bf16 elements)
    per = _per_k_tile_us(t.tile_m, t.tile_n, m, t.swap_ab, t.wg_n, t.pingpong)
    partial_bytes = 0
    if t.split_mode == "cta" and t.splits > 1:
        if waves > 1:  # 'cta' exists to fill one wave; past that 'serial' has the same
            return CTA_PAST_ONE_WAVE_US + waves, 0.0  # parallelism without the round trip
        rows = min(m, t.tile_m)
        compute = (waves * -(-kt // t.splits) * per + c["CTA_FIXED_US"]
                   + t.splits * rows * t.tile_n * 4 / 1024 * c["CTA_REDUCE_US_PER_KB"])
        rows_moved = m if m <= t.tile_m else -(-m // t.tile_m) * t.tile_m
        partial_bytes = 2 * t.splits * rows_moved * n * 4
    else:
        compute = waves * (kt + (t.splits - 1) * c["DRAIN_K_TILES"]) * per
    ab, out = AB_DTYPE_BYTES.get(t.ab_dtype, 1), OUT_DTYPE_BYTES.get(t.out_dtype, 2)
    memory = (ab * (n * k + m * k) + out * m * n + partial_bytes) / c["HBM_BYTES_PER_US"]
    return compute, memory


def twin_value(t: HopperFp8Tactic, m: int, n: int) -> dict[str, str]:
    """{feature: value} of the twin features ``t`` has at (m, n): "pdl": "on" for a pdl
    launch, "cluster": "CMxCN" for a cluster that tiles the output grid with no padded tile
    (a padding cluster's cost is work_units'; no twin figure applies to it)."""
    out = {"pdl": "on"} if t.pdl else {}
    if t.cluster_size > 1 and (-(-m // t.tile_m)) % t.cluster_m == 0 \
            and (-(-n // t.tile_n)) % t.cluster_n == 0:
        out["cluster"] = f"{t.cluster_m}x{t.cluster_n}"
    return out


def rank_key(t: HopperFp8Tactic, m: int, n: int, k: int, num_sms: int) -> tuple:
    """The tactic's rank for (m, n, k) on ``num_sms`` SMs; smaller is better. Model time
    (estimate_us, rounded to 1 ns), then its compute part (in a memory-bound tie, the tactic
    whose units would finish the math sooner: more CTAs streaming the weight), then the
    measured preferences (docs/history.md): no cluster, the smaller swizzle, cluster 1x1,
    raster along M, fewer work units (less partial traffic), larger tile_n, larger
    tile_m, and pdl=False before its pdl twin."""
    return (
        round(estimate_us(t, m, n, k, num_sms), 3),
        round(model_parts(t, m, n, k, num_sms)[0], 3),
        t.cluster_size > 1,
        SWIZZLE_CHOICES.index(t.swizzle),
        CLUSTER_CHOICES.index((t.cluster_m, t.cluster_n)),
        RASTER_CHOICES.index(t.raster),
        work_units(t, m, n),
        -t.tile_n,
        -t.tile_m,
        t.pdl,  # where the launch saves nothing measured, a pdl twin ranks after its tactic
    )

