"""Recorded winners of the Hopper FP8 family: the tactic measured fastest per device, (N, K),
reduction-order class and M bucket, ranked first by the plan (space.enumerate_tactics).

The table is data, ``data/h200_winners.json`` (written by
``bench/gpu/hopper_fp8_fit.py --write-table`` from H200 runs), read once, on the first call
of recorded_winners(), never at import. A winner is named by a short key (recorded_key);
every key of a loaded file parses to a valid tactic (tactic_from_key) or the load fails.

Imports neither cutlass nor torch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .tactic import FAMILY, HopperFp8Tactic

WINNERS_FILE = Path(__file__).parent / "data" / "h200_winners.json"
PDL_KEY = "+pdl"  # recorded_key's suffix of a pdl=True tactic
_loaded: dict[str, Any] = {}  # recorded_winners()'s cache: empty until the first call


def recorded_key(t: HopperFp8Tactic) -> str:
    """Short name of a swizzle-1 tactic in a recorded table: 'w' first for swap_ab, 'n'
    for wg_n = 2, 'p' for ping-pong, then the tile, the raster, 'c' or 's' for the split
    mode of S > 1, '@CMxCN' for a cluster other than 1x1, then '+pdl' for pdl=True, e.g.
    '64x128mc',
    'w8x128mc', '128x64m@1x2', 'n64x80m@2x1', 'w32x64m+pdl'."""
    mode = t.split_mode[0] if t.splits > 1 else ""
    cluster = f"@{t.cluster_m}x{t.cluster_n}" if t.cluster_size > 1 else ""
    lead = "w" if t.swap_ab else ("n" if t.wg_n == 2 else ("p" if t.pingpong else ""))
    return f"{lead}{t.tile_m}x{t.tile_n}{t.raster}{mode}{cluster}{PDL_KEY if t.pdl else ''}"


def tactic_from_key(key: str, splits: int, out_dtype: str, ab_dtype: str) -> HopperFp8Tactic:
    """Inverse of recorded_key for a tactic with S = ``splits``: swizzle 1, the most stages
    that fit, validated (ValueError for a key that names no valid tactic)."""
    pdl = key.endswith(PDL_KEY)
    key = key[:-len(PDL_KEY)] if pdl else key
    swap = key.startswith("w")
    wg_n = 2 if key.startswith("n") else 1
    pp = key.startswith("p")
    key = key[1:] if swap or wg_n == 2 or pp else key
    key, _, cluster = key.partition("@")
    cm, cn = (int(x) for x in cluster.split("x")) if cluster else (1, 1)
    tile, rest = key[:-1 if splits == 1 else -2], key[-1 if splits == 1 else -2:]
    tm, tn = (int(x) for x in tile.split("x"))
    mode = {"c": "cta", "s": "serial"}[rest[1]] if splits > 1 else "serial"
    return HopperFp8Tactic(tm, tn, cm, cn, rest[0], 1, 0, out_dtype, ab_dtype, splits,
                           mode, swap, wg_n, pp, pdl).normalized()


def load_winners(path: str | Path) -> dict:
    """(sm_count, N, K) -> {S: ((M, key, us), ...)} of a recorded-winners file (the format
    of data/h200_winners.json): M ascending per class, us the measured time; every key parses
    to a valid tactic (tactic_from_key). ValueError names the file and what is wrong."""
    try:
        raw = json.loads(Path(path).read_text())
        sms = int(raw["sm_count"])
        out: dict = {}
        for shape in raw["shapes"]:
            per = {}
            for s, rows in shape["classes"].items():
                per[int(s)] = tuple((int(m), str(key), float(us)) for m, key, us in rows)
                for _, key, _ in per[int(s)]:
                    tactic_from_key(key, int(s), "bfloat16", "e4m3")
            out[(sms, int(shape["n"]), int(shape["k"]))] = per
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a {FAMILY} winners file: {type(exc).__name__}: {exc}"
                         ) from None
    return out


def recorded_winners() -> dict:
    """load_winners(WINNERS_FILE), read on the first call: the dict the plan ranks by, the
    same object on every call (a caller may replace its contents)."""
    if "RECORDED_WINNERS" not in _loaded:
        _loaded["RECORDED_WINNERS"] = load_winners(WINNERS_FILE)
    return _loaded["RECORDED_WINNERS"]


def recorded_first(m: int, n: int, k: int, splits: int | None, num_sms: int, out_dtype: str,
                   ab_dtype: str) -> list[HopperFp8Tactic]:
    """The recorded winner of each class (S = ``splits``, or every S for None) for
    (num_sms, n, k) at M = ``m``, fastest first; [] when that (device, N, K) has none. The
    M bucket is the smallest recorded M >= m (the largest one past the end)."""
    per = recorded_winners().get((num_sms, n, k))
    if not per:
        return []
    found = []
    for sp, row in per.items():
        if splits is not None and sp != splits:
            continue
        hit = next((r for r in row if r[0] >= m), row[-1])
        found.append((hit[2], tactic_from_key(hit[1], sp, out_dtype, ab_dtype)))
    return [t for _, t in sorted(found, key=lambda x: x[0])]



def nearest_keys(n: int, k: int, m: int, sm_count: int, splits: int, near: int) -> list[str]:
    """The recorded winners' keys (:func:`recorded_key`) at bucket M, split ``splits``, of
    the ``near`` recorded (N, K) of this SM count nearest to (N, K) in (log N, log K),
    nearest first; a shape with no winner of that split is passed over."""
    rec = recorded_winners()
    mine = sorted(((nn, kk) for (sms, nn, kk) in rec if sms == sm_count),
                  key=lambda s: (math.log(s[0] / n) ** 2 + math.log(s[1] / k) ** 2, s))
    keys = []
    for nn, kk in mine[:near]:
        row = rec[(sm_count, nn, kk)].get(splits)
        if row:
            keys.append(next((r for r in row if r[0] >= m), row[-1])[1])
    return keys
