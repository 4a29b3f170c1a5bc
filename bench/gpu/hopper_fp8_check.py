#!/usr/bin/env python3
"""Hopper FP8 GEMM family: build a bundle here, check and time it on an H200 there.

  build (here, with the venv; CUTE_DSL_ARCH=sm_90a):
      python bench/gpu/hopper_fp8_check.py build --out DIR --set wide|mid|...|final
    compiles the chosen tactics to .o, links each into a .so, copies this script, the
    client package (for the launcher), the DSL runtime and the tvm-ffi wheel into DIR
    and writes DIR/manifest.json (kernels, shapes, and the plan's choices: the
    batch-invariant plan of cached.hopper_fp8 for every shape and M).
  run (there: Python 3.12, torch CUDA, tvm_ffi from the carried wheel; no cutlass):
      python DIR/hopper_fp8_check.py run --bundle DIR --out $OUT [--phases correct,bi,perf]
    correct: float64 reference on fresh data (M, N, K ragged; K not a multiple of S x 128),
      NaN-poisoned outputs, bitwise equality inside each reduction-order class (the
      swap_ab kernels against the unswapped first kernel of their class).
    bi: the seeds' method (x[:M] vs the first M rows of the M=2048 output, bitwise) for
      every kernel, for the plan's per-M mix and for torch._scaled_mm (fast accumulation
      on and off), M in MS; kernels of one class compared with each other at every M.
    perf: CUDA-event medians over CUDA-graph replays, inputs rotated past the 60 MB L2;
      "wide" times every kernel at every M (the data the split rule and the cost model are
      fitted to), "mid" the new N widths and cluster variants beside the old tiles of the
      plan's class at M in MID_MS (or --ms), "pass4" the wg_n=2 tiles (two consumer
      warpgroups along N) beside the plan's earlier first choices at M in PASS4_MS (or
      --ms), "pingpong" / "pp128" the ping-pong tiles (64 / 128 rows) at M in PINGPONG_MS
      / PP128_MS, "split5" every unswapped S = 2 tactic at PP128_MS, "decode6" the plan's
      first choice beside its class's decode candidates at M in DECODE_MS and the S = 2
      class's unswapped tactics at DECODE6_SPLIT_MS (with a per-round spread table),
      "decode7" the same at DECODE_MS only, class S = 1's decode candidates with the
      narrow 64 x 40/48/56 tiles (seventh pass),
      "pdl8" the plan's first choice beside its pdl=True twin at every M (eighth pass;
      the twins are the manifest's plan_alt, so summarize --markdown --alt gives the
      tables of the plan with every first choice launched with PDL),
      "final" the plan's first choice (what a client runs) and the next ones in its class
      (build --top), and
      with build --alt-winners another recorded table's first choices too, at every M,
      against torch._scaled_mm. run --rounds R times every implementation of a point in
      R interleaved rounds; ratios are then the median of the per-round ratios.
    Short tables are printed last; everything goes to $OUT/hopper_fp8.json.
  summarize JSON MANIFEST [--markdown [--alt]]: the tables again; --markdown the final
    run's three tables (us, ratio fast, ratio exact) and the counts by M band.
  run --fake: the same driver on the CPU with an emulation of the kernels' arithmetic
    (a dry run of this script; no timing meaning).
  build --kernels NAMES: exactly these tactics, any scale scheme (_tok, _ex, _b128_ex).
  profile --bundle DIR --kernel NAME --mnk M,N,K [--events R --iters I] [--dry]: launches
    for ncu (hopper_fp8_ncu.sh), the scales of the kernel's scheme (block128 too);
    --events: CUDA-event time per launch; --dry: CPU checks of the arguments only.
  The DSL runtime may travel as libcute_dsl_runtime.so.xz; the runtime and every kernel are
  checked against the digests the manifest recorded at build time before they are loaded
  (bundle_natives.py).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

SEEDS = [(4096, 4096), (2688, 4096), (4608, 2688), (14336, 4096)]  # (N, K)
# From manifests/*.toml (TP applied): each model's smallest-N and largest-K projections and
# more: DeepSeek-V3 (TP8) 2112x7168 (smallest N), 4608x7168, 7168x2304, 4096x512 (smallest
# K); Llama-3.1-8B 4096x14336 (largest K), 6144x4096; Llama-3.3-70B 8192x28672 (largest K
# of all), 8192x8192 (smallest N); Qwen3-32B 5120x25600 (largest K), 5120x8192 (smallest N).
EXTRA = [(2112, 7168), (4608, 7168), (7168, 2304), (4096, 512), (4096, 14336), (6144, 4096),
         (8192, 28672), (8192, 8192), (5120, 25600), (5120, 8192)]
SHAPES = SEEDS + EXTRA
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
# the "mid" set times these M by default (the band where the first choice trailed cuBLAS
# most); run --ms widens it
MID_MS = [128, 256, 512, 1024, 2048]
# the "pass4" set (issue 13, fourth pass: wg_n = 2) times these M by default
PASS4_MS = [64, 128, 256, 512, 1024]
# the "pingpong" set (fourth pass, issue 13 item 4) times these M by default
PINGPONG_MS = [1024, 2048, 4096, 8192]
# the "pp128" set (fifth pass: 128-row ping-pong tiles) times these M by default
PP128_MS = [256, 512, 1024, 2048, 4096, 8192]
# the "decode6" set (sixth pass) times these M: the decode band with the same-class
# alternatives of the plan's first choice, and the large M of the S = 2 class
DECODE_MS = [1, 2, 4, 8, 16, 32, 64]
DECODE6_SPLIT_MS = [2048, 4096, 8192]
FULL_M = 2048
NUM_SMS = 132
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def _bundle_natives():
    """bench/gpu/bundle_natives.py (beside this script, in the repository and in a bundle)."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import bundle_natives

    return bundle_natives


def _repo_on_path() -> None:
    for d in (os.path.join(REPO, "client"), REPO):
        if os.path.isdir(d) and d not in sys.path:
            sys.path.insert(0, d)


def class_of(params: dict) -> str:
    return f"k128.acc1.s{params.get('splits', 1)}.fixed"


def group_of(params: dict) -> str:
    """The class, with the swap_ab and the wg_n = 2 kernels apart (their cross-kernel rows
    are the evidence that swapping the operands, or splitting N between two warpgroups,
    keeps the class)."""
    return class_of(params) + (" swap_ab" if params.get("swap_ab") else "") + (
        " wg_n2" if params.get("wg_n", 1) == 2 else "") + (
        " pingpong" if params.get("pingpong") else "") + (" pdl" if params.get("pdl") else "")


# ====================================================================================
# build (here)
# ====================================================================================

def _wide_tactics():
    """The tactics a "wide" run times at every shape and M (the data the split rule and
    the cost model are fitted to): per class, the tile shapes that win somewhere."""
    from cached.families.hopper_fp8.tactic import HopperFp8Tactic as T

    out = []
    for tm, tn in [(64, 64), (64, 128), (64, 256), (128, 128), (128, 192), (128, 256),
                   (256, 128), (256, 192)]:
        out.append(T(tm, tn))
    out += [T(128, 128, raster="n"), T(128, 256, raster="n")]
    for s in (2, 4, 8, 16):
        for tm, tn in [(64, 64), (64, 128), (64, 256), (128, 128), (128, 256)]:
            out.append(T(tm, tn, splits=s, split_mode="cta"))
        for tm, tn, r in [(64, 128, "m"), (64, 192, "m"), (128, 128, "m"), (128, 192, "m"),
                          (128, 128, "n"), (128, 192, "n")]:
            out.append(T(tm, tn, raster=r, splits=s, split_mode="serial"))
    # swap_ab (tokens on the wgmma N side), after the unswapped kernels (each class's first
    # kernel is unswapped): every tile in S = 1, 2, 4 (both split modes), one per mode in
    # S = 8, 16 (class equality)
    for s in (1, 2, 4):
        for mode in (("serial",) if s == 1 else ("serial", "cta")):
            for tm in (8, 16, 32, 64):
                for tn in (64, 128):
                    out.append(T(tm, tn, splits=s, split_mode=mode, swap_ab=True))
    for s in (8, 16):
        out += [T(8, 64, splits=s, split_mode="cta", swap_ab=True),
                T(64, 128, splits=s, split_mode="serial", swap_ab=True)]
    # other dtypes (correctness and class equality only)
    out += [T(64, 128, out_dtype="float16", ab_dtype="e5m2", splits=4, split_mode="cta"),
            T(128, 128, out_dtype="float16", ab_dtype="e5m2", splits=4, split_mode="serial"),
            T(128, 256, 2, 1, "m", 1, 0, "float16", "e5m2"),
            T(16, 64, out_dtype="float16", ab_dtype="e5m2", splits=4, split_mode="cta",
              swap_ab=True)]
    return [t.normalized() for t in out]


def _mid_tactics():
    """The tactics a "mid" run times at M in MID_MS (issue 13, third pass): the N widths
    between the old ones (80, 96, 112, 160) and the cluster variants the cost model ranks
    at M = 128..2048, beside the old tiles of the same classes (S = 1 everywhere, S = 2 for
    2112x7168), so one run compares them on one machine."""
    from cached.families.hopper_fp8.tactic import HopperFp8Tactic as T

    widths = (64, 80, 96, 112, 128, 160, 192, 256)
    out = [T(tm, tn) for tm in (64, 128) for tn in widths]
    out += [T(128, tn, raster="n") for tn in widths[1:-1]]
    out += [T(256, tn) for tn in widths[1:-1]]
    out += [T(128, tn, 1, 2) for tn in widths[:-1]] + [T(64, 64, 1, 2), T(64, 128, 1, 2)]
    out += [T(128, 64, 2, 1), T(128, 128, 2, 1), T(256, 128, 2, 1)]
    out += [T(64, 64, swap_ab=True), T(64, 128, swap_ab=True)]
    for tm, tn, r in [(64, 64, "m"), (64, 96, "m"), (64, 128, "m"), (64, 160, "m"),
                      (64, 192, "m"), (128, 64, "m"), (128, 96, "m"), (128, 128, "m"),
                      (128, 160, "m"), (128, 192, "m"), (128, 128, "n"), (128, 192, "n")]:
        out.append(T(tm, tn, raster=r, splits=2, split_mode="serial"))
    out += [T(64, 64, splits=2, split_mode="cta"), T(64, 128, splits=2, split_mode="cta"),
            T(128, 128, splits=2, split_mode="cta"),
            T(64, 64, splits=2, split_mode="serial", swap_ab=True),
            T(64, 64, splits=2, split_mode="cta", swap_ab=True),
            T(64, 128, splits=2, split_mode="serial", swap_ab=True)]
    # second mid run (M = 64..8192): more cluster shapes of the new widths, 256-row tiles
    # along N, and every swap_ab tile of S = 1 and 2 (the M = 64 winners)
    out += [T(128, tn, 2, 1) for tn in (80, 96, 112, 160)]
    out += [T(256, tn, 1, 2) for tn in (80, 96, 112, 128, 160)]
    out += [T(64, tn, 1, 2) for tn in (80, 96, 112, 160)]
    out += [T(128, tn, 1, 2, "n") for tn in (96, 112, 160)]
    out += [T(256, tn, raster="n") for tn in (96, 128, 160)]
    for sp, modes in ((1, ("serial",)), (2, ("serial", "cta"))):
        for mode in modes:
            out += [T(tm, tn, splits=sp, split_mode=mode, swap_ab=True)
                    for tn in (64, 128) for tm in (8, 16, 32, 64)]
    # other dtypes with the 16-column epilogue (80, 112) and a cluster (correctness only)
    out += [T(128, 80, out_dtype="float16", ab_dtype="e5m2"),
            T(64, 112, 1, 2, "n", 2, 0, "float16", "e5m2"),
            T(128, 160, out_dtype="float16", ab_dtype="e5m2", splits=2, split_mode="serial")]
    return _unique(out)


def _unique(tactics: list) -> list:
    """``tactics`` normalized, each name once (the first kept), in order."""
    seen: dict = {}
    for t in tactics:
        t = t.normalized()
        seen.setdefault(t.name, t)
    return list(seen.values())


def _split_tactics():
    """The tactics a "split" run times (S = 2, the class of 2112x7168, the only shape whose
    plan splits): every S = 2 kernel of the mid set, and serial splits with clusters (the
    plan's split tactics were cluster 1x1 before)."""
    from cached.families.hopper_fp8.tactic import HopperFp8Tactic as T

    out = [t for t in _mid_tactics() if t.splits == 2 and t.ab_dtype == "e4m3"
           and t.out_dtype == "bfloat16"]
    for tm, tn in [(64, 96), (64, 128), (64, 192), (128, 64), (128, 96), (128, 128),
                   (128, 160), (128, 192)]:
        for cm, cn in ((1, 2), (2, 1)):
            out.append(T(tm, tn, cm, cn, splits=2, split_mode="serial").normalized())
    return out


def _pass4_tactics():
    """The tactics a "pass4" run checks and times at M in PASS4_MS (issue 13, fourth pass):
    every wg_n = 2 tactic of the plan's space (S = 1: every width and cluster; S = 2:
    the serial splits), after one unswapped wg_n = 1 kernel per class (the class's first
    kernel, which the others are compared with bitwise), beside 128x64 and 64x80 (the
    M = 128 tiles of the third pass) and the one-warpgroup 64-row tiles with a 2x1 cluster
    (B multicast to both M tiles, as wg_n = 2's best; never timed before); the build adds
    the plan's first choices. Two e5m2/fp16 wg_n = 2 kernels for correctness."""
    from cached.families.hopper_fp8.space import tactic_space
    from cached.families.hopper_fp8.tactic import HopperFp8Tactic as T

    out = [T(64, 128), T(64, 96, splits=2, split_mode="serial"), T(128, 64), T(64, 80)]
    out += [t for t in tactic_space(splits=1) + tactic_space(splits=2)
            if t.wg_n == 2 and not t.pdl]
    out += [T(64, tn, 2, 1) for tn in (64, 80, 96, 128)]
    out += [T(64, 80, out_dtype="float16", ab_dtype="e5m2", wg_n=2),
            T(64, 128, 2, 1, out_dtype="float16", ab_dtype="e5m2", splits=2, wg_n=2)]
    return _unique(out)


def _pingpong_tactics(e5m2_tile: tuple[int, int] = (64, 256)):
    """The tactics a "pingpong" run (fourth pass) or a "pp128" run (fifth pass, e5m2_tile
    128 x 192) checks and times: every ping-pong tactic of the space after the class's
    first kernel, and one e5m2/fp16 ping-pong kernel of ``e5m2_tile`` (cluster 1x2, raster
    n) for correctness; the build adds the plan's first choices at those M."""
    from cached.families.hopper_fp8.space import tactic_space
    from cached.families.hopper_fp8.tactic import HopperFp8Tactic as T

    out = [T(64, 128).normalized()]
    out += [t for t in tactic_space(splits=1) if t.pingpong]
    out += [T(*e5m2_tile, 1, 2, "n", out_dtype="float16", ab_dtype="e5m2",
              pingpong=True).normalized()]
    return out


def _split5_tactics():
    """The tactics a "split5" run (fifth pass) checks and times at M in PP128_MS: every
    unswapped S = 2 tactic of the space (the class of 2112x7168, the only shape whose plan
    splits; new: serial splits with clusters and raster n, serial-split ping-pong), after
    the class's first kernel, and one e5m2/fp16 split ping-pong kernel for correctness; the
    build adds the plan's first choices at those M."""
    from cached.families.hopper_fp8.space import tactic_space
    from cached.families.hopper_fp8.tactic import HopperFp8Tactic as T

    out = [T(64, 128, splits=2, split_mode="cta").normalized()]
    out += [t for t in tactic_space(splits=2) if not t.swap_ab]
    out += [T(64, 192, 2, 1, "n", out_dtype="float16", ab_dtype="e5m2", splits=2,
              pingpong=True).normalized()]
    return _unique(out)


def decode_candidate(params: dict) -> bool:
    """A tactic the "decode6" run times at M <= 64 beside the plan's first choice: a
    swap_ab decode tile, or a one-CTA-row 64-row tile (wg_n 1 or 2, no ping-pong) of
    width <= 128, raster m, swizzle 1, any cluster; no pdl twin (the eighth pass's pdl8
    set times those)."""
    if params.get("pdl"):
        return False
    return bool(params["swap_ab"]) or (
        params["tile_m"] == 64 and params["tile_n"] <= 128 and not params["pingpong"]
        and params["raster"] == "m" and params["swizzle"] == 1)


def _decode6_tactics():
    """The tactics a "decode6" run (sixth pass) checks and times: at M in DECODE_MS, every
    decode_candidate of the classes S = 1 and 2 (the plans' classes on the 14 shapes);
    at M in DECODE6_SPLIT_MS, every unswapped S = 2 tactic (the class of 2112x7168). The
    classes' first kernels lead; the build adds the plan's first choices at DECODE_MS."""
    from cached.families.hopper_fp8.space import tactic_space
    from cached.families.hopper_fp8.tactic import HopperFp8Tactic as T

    out = [T(64, 128).normalized(), T(64, 128, splits=2, split_mode="cta").normalized()]
    out += [t for t in tactic_space(splits=1) if decode_candidate(t.to_params())]
    out += [t for t in tactic_space(splits=2) if not t.pdl
            if decode_candidate(t.to_params()) or not t.swap_ab]
    return _unique(out)


def _decode7_tactics():
    """The tactics a "decode7" run (seventh pass) checks and times at M in DECODE_MS: the
    decode_candidates of class S = 1 (with the narrow 64 x 40/48/56 tiles and 64 x 48
    wg_n = 2), after the classes' first kernels; the build adds the plan's first choices
    at DECODE_MS (2112x7168's S = 2 ones among them, timed alone in their class)."""
    from cached.families.hopper_fp8.space import tactic_space
    from cached.families.hopper_fp8.tactic import HopperFp8Tactic as T

    out = [T(64, 128).normalized(), T(64, 128, splits=2, split_mode="cta").normalized()]
    out += [t for t in tactic_space(splits=1) if decode_candidate(t.to_params())]
    return _unique(out)


def _final_plan(top: int):
    """The batch-invariant plan per shape: its class, and the first `top` tactics per M."""
    from cached.families.hopper_fp8.space import choose_split, enumerate_tactics

    plan = {}
    for n, k in SHAPES:
        s = choose_split(n, k, NUM_SMS)
        plan[f"{n}x{k}"] = {
            "splits": s,
            "by_m": {str(m): [t.name for t in enumerate_tactics(m, n, k, splits=s,
                                                                num_sms=NUM_SMS)[:top]]
                     for m in MS},
        }
    return plan


def _alt_plan(winners_path: str):
    """The plan's first choice per shape and M with the recorded winners of another
    winners file (winners.load_winners' format, e.g. the one before a refit), for a final
    run that times both plans side by side (the same machine, interleaved rounds)."""
    from cached.families.hopper_fp8 import winners as WIN

    alt = WIN.load_winners(winners_path)
    recorded = WIN.recorded_winners()
    saved = dict(recorded)
    recorded.clear()
    recorded.update(alt)
    try:
        return _final_plan(1)
    finally:
        recorded.clear()
        recorded.update(saved)


def pdl_plan(plan, on: bool) -> dict:
    """The plan with every first choice launched with programmatic dependent launch (on)
    or without it (eighth pass; the same tactic otherwise): a pdl8 run times the plan
    without PDL beside the one with it, in the same rounds."""
    return {nk: {"splits": p["splits"],
                 "by_m": {m: [v[0].removesuffix("_pdl") + ("_pdl" if on else "")]
                          for m, v in p["by_m"].items()}}
            for nk, p in plan.items()}


def _pdl8_tactics(plan):
    """The tactics a "pdl8" run (eighth pass) checks and times at every M: the classes'
    first kernels, the plan's first choice per shape and M without PDL, and the pdl=True
    twin of each (whether or not tactic_space lists it), plus two e5m2/fp16 pdl kernels
    (a swap_ab 'cta' split and a 2x1 cluster) for correctness."""
    import dataclasses

    from cached.families.hopper_fp8.space import recordable_tactics
    from cached.families.hopper_fp8.tactic import HopperFp8Tactic as T

    by_name = recordable_tactics()
    out = [T(64, 128).normalized()] + [T(64, 128, splits=s, split_mode="cta").normalized()
                                       for s in (2, 4)]
    firsts = [dataclasses.replace(by_name[v[0]], pdl=False)
              for p in plan.values() for v in p["by_m"].values()]
    out += firsts + [dataclasses.replace(t, pdl=True) for t in firsts]
    out += [T(16, 64, out_dtype="float16", ab_dtype="e5m2", splits=4, split_mode="cta",
              swap_ab=True, pdl=True).normalized(),
            T(128, 256, 2, 1, "m", 1, 0, "float16", "e5m2", pdl=True).normalized()]
    return _unique(out)


def _final_tactics(plan):
    from cached.families.hopper_fp8.space import recordable_tactics
    from cached.families.hopper_fp8.tactic import HopperFp8Tactic as T

    by_name = recordable_tactics()
    chosen = {}
    # an unswapped kernel leads each class, so the swapped ones are compared with it
    for t in [T(64, 128)] + [T(64, 128, splits=s, split_mode="cta") for s in (2, 4, 8, 16)]:
        t = t.normalized()
        chosen[t.name] = t
    for p in plan.values():
        for names in p["by_m"].values():
            for nm in names:
                chosen[nm] = by_name[nm]
    # every class has a kernel of each mode (invariance of every class), other dtypes
    extra = [T(64, 128), T(128, 128), T(8, 64, swap_ab=True), T(64, 128, swap_ab=True)]
    for s in (2, 4, 8, 16):
        extra += [T(64, 128, splits=s, split_mode="cta"),
                  T(128, 128, splits=s, split_mode="serial"),
                  T(8, 64, splits=s, split_mode="cta", swap_ab=True),
                  T(64, 128, splits=s, split_mode="serial", swap_ab=True)]
    extra += [T(64, 128, out_dtype="float16", ab_dtype="e5m2", splits=4, split_mode="cta"),
              T(128, 128, out_dtype="float16", ab_dtype="e5m2", splits=4, split_mode="serial"),
              T(128, 256, 2, 1, "m", 1, 0, "float16", "e5m2"),
              T(16, 64, out_dtype="float16", ab_dtype="e5m2", splits=4, split_mode="cta",
                swap_ab=True)]
    for t in extra:
        t = t.normalized()
        chosen.setdefault(t.name, t)
    return list(chosen.values())


def _compile_worker(jobs_json: str) -> None:
    _repo_on_path()
    from cached.families.hopper_fp8.compile import compile_to_object
    from cached.families.hopper_fp8.tactic import tactic_from_params

    for job in json.loads(jobs_json):
        t = tactic_from_params(job["params"])
        t0 = time.perf_counter()
        compile_to_object(t, job["mac"], job["obj"], job["symbol"])
        print(json.dumps({"name": t.name, "seconds": round(time.perf_counter() - t0, 3)}),
              flush=True)


def _codegen_constants() -> dict:
    """The tactic.py values the kernel's code is generated from (besides the params)."""
    from cached.families.hopper_fp8 import tactic as T

    return {k: getattr(T, k) for k in (
        "TILE_K", "EPI_STAGES", "CONSUMER_MAX_REGS", "SWAP_EPI_BYTES", "MBAR_REGION_BYTES",
        "STATIC_SMEM_BYTES", "BUFFER_ALIGN_BYTES")} | {
        "epilogue_tiles": [list(T.epilogue_tile(m, n, pp)) for m in T.TILE_M_CHOICES
                           for n in T.TILE_N_CHOICES for pp in (False, True)]}


def build(out: str, which: str, jobs: int, top: int, dry: bool = False,
          reuse_code: bool = False, alt_winners: str | None = None,
          kernels: list[str] | None = None) -> None:
    _repo_on_path()
    os.makedirs(os.path.join(out, "obj"), exist_ok=True)
    os.makedirs(os.path.join(out, "kernels"), exist_ok=True)
    plan = _final_plan(top)
    if which == "pdl8":  # the first choices without PDL; the twins are plan_alt
        plan = pdl_plan(plan, False)
    tactics = {"wide": _wide_tactics, "mid": _mid_tactics, "split": _split_tactics,
               "pass4": _pass4_tactics, "pingpong": _pingpong_tactics,
               "pp128": functools.partial(_pingpong_tactics, (128, 192)), "split5": _split5_tactics,
               "decode6": _decode6_tactics, "decode7": _decode7_tactics,
               "pdl8": lambda: _pdl8_tactics(plan)}.get(
        which, lambda: _final_tactics(plan))() if not kernels else None
    if kernels:  # exactly these tactics (e.g. for ncu on a tune's winners), nothing else
        from cached.families.hopper_fp8.space import recordable_tactics, scheme_space

        by_name = recordable_tactics()
        base = list(by_name.values())
        # and their scale / accumulation schemes (issue 27: _tok, _ex, _b128_ex names)
        for scales, accum in (("tensor", "exact"), ("token", "fast"), ("token", "exact"),
                              ("block128", "exact")):
            by_name |= {t.name: t for t in scheme_space(base, scales, accum)}
        missing = [nm for nm in kernels if nm not in by_name]
        if missing:
            raise SystemExit(f"--kernels: not in the family's space: {missing}")
        tactics, which = [by_name[nm] for nm in kernels], "kernels"
    plan_alt = pdl_plan(plan, True) if which == "pdl8" else None
    if alt_winners:  # final: the other plan's first choices too, timed beside the plan's
        from cached.families.hopper_fp8.space import recordable_tactics

        plan_alt = _alt_plan(alt_winners)
        by_name = recordable_tactics()
        have = {t.name for t in tactics}
        for p in plan_alt.values():
            for names in p["by_m"].values():
                for nm in names:
                    if nm not in have:
                        tactics.append(by_name[nm])
                        have.add(nm)
    if which in ("wide", "mid", "pass4", "pingpong", "pp128", "split5", "decode6", "decode7"):
        names = {t.name for t in tactics}  # + the plan's first choices at the set's M
        ms = {str(m) for m in {"wide": MS, "mid": MID_MS, "pass4": PASS4_MS,
                               "pingpong": PINGPONG_MS, "pp128": PP128_MS,
                               "split5": PP128_MS, "decode6": DECODE_MS,
                               "decode7": DECODE_MS}[which]}
        for t in _final_tactics({k: {"by_m": {m: v[:1] for m, v in p["by_m"].items()
                                              if m in ms}}
                                 for k, p in plan.items()}):
            if t.name not in names:
                tactics.append(t)
    entries = []
    for i, t in enumerate(tactics):
        sym = f"hopper_fp8_{i:03d}"
        entries.append({"name": t.name, "params": t.to_params(), "symbol": sym,
                        "so": f"kernels/{sym}.so", "obj": os.path.join(out, "obj", f"{sym}.o"),
                        "mac": NUM_SMS // t.cluster_size, "class": t.reduction_class})
    from cached.families.hopper_fp8.family import HopperFp8
    from cached.toolchain import compiler_stack

    src = HopperFp8().source_sha256()
    here = os.path.join(REPO, "cached", "families", "hopper_fp8")
    # what the object code is made of: the kernel and the compile step; tactic.py (in the
    # family's source hash) also holds validation and resource arithmetic, which change no
    # kernel when its codegen constants (checked equal below) stay the same
    code_sha = compiler_stack.hash_files(tuple(Path(here, f) for f in ("kernel.py", "compile.py")))
    old = {}
    mpath = os.path.join(out, "manifest.json")
    if os.path.exists(mpath):  # reuse objects of an earlier build: same code and params
        with open(mpath) as f:
            prev_manifest = json.load(f)
        same = prev_manifest.get("source_sha256") == src
        if not same and reuse_code and prev_manifest.get("code_sha256") == code_sha and \
                prev_manifest.get("codegen_constants") == _codegen_constants():
            print("reusing kernels built from other tactic.py sources: kernel.py, compile.py "
                  "and tactic.py's codegen constants are unchanged")
            same = True
        if same:
            for e in prev_manifest["kernels"]:
                old[json.dumps(e["params"], sort_keys=True)] = e
    todo = []
    for e in entries:
        prev = old.get(json.dumps(e["params"], sort_keys=True))
        if prev and os.path.exists(os.path.join(out, prev["so"])):
            e["so"], e["symbol"] = prev["so"], prev["symbol"]
            continue
        todo.append(e)
    used = {e["so"] for e in entries if e not in todo}
    for e in todo:  # fresh names that no reused kernel has
        i = 0
        while f"kernels/hopper_fp8_{i:03d}.so" in used:
            i += 1
        e["symbol"], e["so"] = f"hopper_fp8_{i:03d}", f"kernels/hopper_fp8_{i:03d}.so"
        e["obj"] = os.path.join(out, "obj", f"hopper_fp8_{i:03d}.o")
        used.add(e["so"])
    if dry:  # manifest and files only (for `run --fake`)
        todo = []
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a")
    chunks = [todo[i::jobs] for i in range(jobs)]
    t0 = time.perf_counter()
    procs = [subprocess.Popen(
        [sys.executable, __file__, "_compile", json.dumps(
            [{"params": e["params"], "mac": e["mac"], "obj": e["obj"], "symbol": e["symbol"]}
             for e in ch])], env=env, stdout=subprocess.PIPE, text=True)
        for ch in chunks if ch]
    for p in procs:
        p.communicate()
        if p.returncode:
            raise SystemExit(f"compile worker failed (rc={p.returncode})")
    wall = time.perf_counter() - t0
    import tvm_ffi

    site_dir = os.path.dirname(os.path.dirname(tvm_ffi.__file__))
    rt_dir = os.path.join(site_dir, "nvidia_cutlass_dsl", "cu13", "lib")
    ffi_dir = os.path.join(site_dir, "tvm_ffi", "lib")
    for e in todo:
        subprocess.check_call(["gcc", "-shared", "-o", os.path.join(out, e["so"]), e["obj"],
                               f"-L{rt_dir}", "-lcute_dsl_runtime", f"-L{ffi_dir}", "-ltvm_ffi"])
    for e in entries:
        del e["obj"]
    shutil.rmtree(os.path.join(out, "obj"))
    if not dry and not os.path.exists(os.path.join(out, "libcute_dsl_runtime.so")):
        shutil.copy2(os.path.join(rt_dir, "libcute_dsl_runtime.so"), out)
    digests = {} if dry else _bundle_natives().record(
        out, entries, os.path.join(out, "libcute_dsl_runtime.so"))
    shutil.copy2(__file__, os.path.join(out, "hopper_fp8_check.py"))
    for script in ("run_hopper_fp8.sh", "hopper_fp8_ncu.sh", "bundle_natives.py"):
        shutil.copy2(os.path.join(HERE, script), os.path.join(out, script))
    cdst = os.path.join(out, "client", "cached_client")
    shutil.rmtree(cdst, ignore_errors=True)
    shutil.copytree(os.path.join(REPO, "client", "cached_client"), cdst,
                    ignore=shutil.ignore_patterns("__pycache__"))
    keep = {os.path.basename(e["so"]) for e in entries}
    for f in os.listdir(os.path.join(out, "kernels")):
        if f not in keep:
            os.remove(os.path.join(out, "kernels", f))
    with open(mpath, "w") as f:
        json.dump({"set": which, "kernels": entries, "plan": plan, "shapes": SHAPES,
                   "plan_alt": plan_alt,
                   "alt_winners": os.path.basename(alt_winners) if alt_winners else None,
                   "source_sha256": src, "code_sha256": code_sha,
                   "codegen_constants": _codegen_constants(),
                   "num_sms": NUM_SMS, "compiled_now": len(todo),
                   "compile_wall_seconds": round(wall, 1), **digests}, f, indent=1)
    print(f"{which}: {len(entries)} kernels ({len(todo)} compiled now, {wall:.0f} s wall, "
          f"{jobs} workers)")


# ====================================================================================
# run (there)
# ====================================================================================

class FakeFn:
    """CPU emulation of a kernel's arithmetic (for --fake dry runs of this driver)."""

    def __init__(self, params):
        self.p = params

    def __call__(self, a, b, c, sa, sb, ws, cnt):
        import torch

        k = a.shape[1]
        kt = -(-k // 128)
        s = self.p["splits"]
        af, bf = a.float(), b.float()
        acc = torch.zeros(a.shape[0], b.shape[0])
        for i in range(s):
            lo, hi = i * kt // s * 128, min(k, (i + 1) * kt // s * 128)
            acc = acc + (af[:, lo:hi] @ bf[:, lo:hi].t() if hi > lo else 0.0)
        c.copy_((acc * (sa * sb)).to(c.dtype))


class Runner:
    def __init__(self, bundle: str, out: str, fake: bool):
        import torch

        self.torch = torch
        self.fake = fake
        sys.path.insert(0, os.path.join(bundle, "client"))
        from cached_client.gemm import hopper_fp8 as launcher

        self.launcher = launcher
        with open(os.path.join(bundle, "manifest.json")) as f:
            self.manifest = json.load(f)
        self.fns, self.meta = {}, {}
        t0 = time.perf_counter()
        if fake:
            for e in self.manifest["kernels"]:
                self.fns[e["name"]] = FakeFn(e["params"])
                self.meta[e["name"]] = e["params"]
            self.dev = torch.device("cpu")
        else:
            # the runtime and each kernel checked against the manifest's digests first
            natives = _bundle_natives()
            natives.use_runtime(bundle, self.manifest)
            self.fns = natives.load_kernels(bundle, self.manifest)
            self.meta = {e["name"]: e["params"] for e in self.manifest["kernels"]}
            self.dev = torch.device("cuda")
        self.load_ms = (time.perf_counter() - t0) * 1e3
        self.out = out
        self.log = open(os.path.join(out, "hopper_fp8.log"), "a")
        self.results = {"set": self.manifest["set"], "torch": torch.__version__,
                        "load_ms_all": round(self.load_ms, 1), "kernels": list(self.fns)}
        if not fake:
            props = torch.cuda.get_device_properties(0)
            self.results.update(device=torch.cuda.get_device_name(),
                                sms=props.multi_processor_count)
        self.ws_cache = {}

    # -- helpers ---------------------------------------------------------------------
    def p(self, *a):
        s = " ".join(str(x) for x in a)
        print(s, flush=True)
        self.log.write(s + "\n")
        self.log.flush()

    def watchdog(self, name):
        """A kernel that hangs the GPU ends the process; the shell driver reruns without
        it (its name is left in $OUT/progress)."""
        import faulthandler

        with open(os.path.join(self.out, "progress"), "w") as f:
            f.write(name)
        faulthandler.cancel_dump_traceback_later()
        if name:
            faulthandler.dump_traceback_later(60, exit=True)

    def sync(self):
        if not self.fake:
            self.torch.cuda.synchronize()

    def fp8(self, rows, cols, dtype=None):
        t = self.torch
        return (t.randn(rows, cols, device=self.dev)).to(dtype or t.float8_e4m3fn)

    def scales(self):
        t = self.torch
        return (t.tensor([0.75], device=self.dev, dtype=t.float32),
                t.tensor([1.25], device=self.dev, dtype=t.float32))

    def outdt(self, name):
        t = self.torch
        return t.bfloat16 if self.meta[name]["out_dtype"] == "bfloat16" else t.float16

    def abdt(self, name):
        t = self.torch
        return t.float8_e4m3fn if self.meta[name]["ab_dtype"] == "e4m3" else t.float8_e5m2

    def is_plain(self, name):
        return self.meta[name]["out_dtype"] == "bfloat16" and self.meta[name]["ab_dtype"] == "e4m3"

    def is_swap(self, name):
        return bool(self.meta[name].get("swap_ab"))

    def is_cta(self, name):
        return self.meta[name]["split_mode"] == "cta" and self.meta[name]["splits"] > 1

    def fits(self, name, m, n):
        """Whether the kernel's workspace at (m, n) is within the kernel's int32 indexing."""
        L = self.launcher
        return L.workspace_bytes(self.meta[name], m, n) // 4 <= L.MAX_WORKSPACE_ELEMS

    def buffers(self, names, max_m, n):
        """One (workspace, counters) pair big enough for every kernel in names at max_m."""
        L = self.launcher
        names = [x for x in names if self.fits(x, max_m, n)]
        need_ws = max([L.workspace_bytes(self.meta[x], max_m, n) // 4 for x in names] + [1])
        need_cnt = max([L.counter_elems(self.meta[x], max_m, n) for x in names] + [1])
        cur = self.ws_cache.get("buf")
        if cur is None or cur[0].numel() < need_ws or cur[1].numel() < need_cnt:
            self.ws_cache.clear()
            self.sync()
            ws = self.torch.empty(max(need_ws, cur[0].numel() if cur else 0),
                                  dtype=self.torch.float32, device=self.dev)
            cnt = self.torch.zeros(max(need_cnt, cur[1].numel() if cur else 0),
                                   dtype=self.torch.int32, device=self.dev)
            self.ws_cache["buf"] = (ws, cnt)
        return self.ws_cache["buf"]

    def call(self, name, a, b, sa, sb, out=None):
        """Through the client's launcher (checks, workspace); output poisoned with NaN."""
        t = self.torch
        if out is None:
            out = t.full((a.shape[0], b.shape[0]), float("nan"), dtype=self.outdt(name),
                         device=self.dev)
        ws, cnt = self.buffers([name], a.shape[0], b.shape[0])
        if self.fake:
            self.fns[name](a, b, out, sa, sb, ws, cnt)
            return out
        return self.launcher.gemm(self.fns[name], a, b, sa, sb, self.outdt(name), out=out,
                                  params=self.meta[name], workspace=ws, counters=cnt)

    def scaled_mm(self, a, b, sa, sb, fast, out_dtype=None):
        t = self.torch
        if self.fake:
            return ((a.float() @ b.float().t()) * (sa * sb)).to(out_dtype or t.bfloat16)
        return t._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb,
                            out_dtype=out_dtype or t.bfloat16, use_fast_accum=fast)

    @staticmethod
    def rows_differ(ref, out):
        """Rows of out (bitwise, NaN payloads included) that differ from ref[:rows]."""
        import torch

        r = min(ref.shape[0], out.shape[0])
        w = {2: torch.int16, 4: torch.int32}[ref.element_size()]
        return int((ref[:r].contiguous().view(w) != out[:r].contiguous().view(w))
                   .any(dim=1).sum().item())

    # -- phase: correctness ---------------------------------------------------------
    def correct(self, names):
        t = self.torch
        problems = [(1, 256, 128), (7, 2688, 4096), (77, 272, 48), (129, 4608, 2704),
                    (300, 1040, 4112), (1000, 4096, 4096), (33, 2112, 7168), (5, 512, 1040)]
        if self.fake:
            problems = [(1, 256, 128), (7, 272, 400), (77, 272, 48)]
        rows = []
        sa, sb = self.scales()
        for (m, n, k) in problems:
            per_dtype = {}
            for name in names:
                key = (self.meta[name]["ab_dtype"], self.meta[name]["out_dtype"])
                if key not in per_dtype:
                    a = self.fp8(m, k, self.abdt(name))
                    b = self.fp8(n, k, self.abdt(name))
                    ref = (a.double() @ b.double().t()) * (sa.double() * sb.double())
                    cub = {}
                    try:
                        for fa in (True, False):
                            cub[fa] = self.scaled_mm(a, b, sa, sb, fa, self.outdt(name))
                    except Exception as ex:  # e5m2 x e5m2 is not supported by cuBLASLt
                        self.p(f"  scaled_mm n/a for {key}: {str(ex)[:80]}")
                    per_dtype[key] = dict(a=a, b=b, ref=ref, cub=cub, first={})
                d = per_dtype[key]
                self.watchdog(name)
                out = self.call(name, d["a"], d["b"], sa, sb)
                self.sync()
                self.watchdog("")
                written = bool(t.isfinite(out).all().item())
                rel = ((out.double() - d["ref"]).norm() / d["ref"].norm()).item()
                cls = class_of(self.meta[name])
                if cls not in d["first"]:
                    d["first"][cls] = (name, out)
                same = bool(t.equal(out, d["first"][cls][1]))
                eq = {f"eq_fast{int(fa)}": bool(t.equal(out, c)) for fa, c in d["cub"].items()}
                rows.append(dict(m=m, n=n, k=k, kernel=name, cls=cls, rel=rel,
                                 swap=bool(self.meta[name].get("swap_ab")),
                                 all_written=written, same_as_class_first=same, **eq))
                if not (written and rel < 2e-2 and same):
                    self.p(f"  FAIL {name} {m}x{n}x{k}: rel={rel:.3g} written={written} "
                           f"same_as_class={same}")
            for key, d in per_dtype.items():
                for fa, c in d["cub"].items():
                    rows.append(dict(m=m, n=n, k=k, kernel=f"scaled_mm_fast{int(fa)}_{key[0]}",
                                     cls="cublas", all_written=True, same_as_class_first=True,
                                     rel=((c.double() - d["ref"]).norm() / d["ref"].norm()).item()))
            self.p(f"correct {m}x{n}x{k}: done")
        self.results["correct"] = rows

    # -- phase: batch invariance ------------------------------------------------------
    def bi(self, names, shapes, ms):
        sa, sb = self.scales()
        plan = self.manifest["plan"]
        rows = []
        plain = [x for x in names if self.is_plain(x)]
        for (n, k) in shapes:
            x = self.fp8(max(ms), k)
            w = self.fp8(n, k)
            self.buffers(plain, max(ms), n)
            by_cls_first = {}  # class -> {m: output of the class's first kernel}
            impls = [(nm, nm) for nm in plain] + [("scaled_mm_fast1", True),
                                                  ("scaled_mm_fast0", False)]
            for label, what in impls:
                if isinstance(what, bool):
                    def run(xx, fa=what, w=w):
                        return self.scaled_mm(xx, w, sa, sb, fa)
                else:
                    def run(xx, nm=what, w=w):
                        return self.call(nm, xx, w, sa, sb)
                self.watchdog(label)
                full = run(x[:FULL_M].clone())
                diff, cross = {}, {}
                cls = class_of(self.meta[label]) if label in self.meta else None
                firsts = by_cls_first.setdefault(cls, {}) if cls else None
                for m in ms:
                    if label in self.meta and not self.fits(label, m, n):
                        continue  # workspace over the kernel's limit at this M: not run
                    o = full if m == FULL_M else run(x[:m].clone())  # fresh: no aliasing
                    diff[m] = self.rows_differ(full, o)
                    if firsts is not None:
                        if m not in firsts:
                            firsts[m] = o
                        else:
                            cross[m] = self.rows_differ(firsts[m], o)
                self.watchdog("")
                rows.append(dict(n=n, k=k, impl=label, cls=cls, diff_rows=diff,
                                 total=sum(diff.values()), cross_class_rows=cross,
                                 cross_total=sum(cross.values()),
                                 group=group_of(self.meta[label]) if cls else None))
            # the plan's per-M mix: each M on the plan's first choice for that M
            p = plan.get(f"{n}x{k}")
            if p:
                pick = {m: p["by_m"][str(m)][0] for m in ms if str(m) in p["by_m"]}
                if FULL_M in pick and all(v in self.fns for v in pick.values()):
                    full = self.call(pick[FULL_M], x[:FULL_M].clone(), w, sa, sb)
                    diff = {m: self.rows_differ(full, self.call(nm, x[:m].clone(), w, sa, sb))
                            for m, nm in pick.items()}
                    rows.append(dict(n=n, k=k, impl="plan_mix", cls=class_of(
                        {"splits": p["splits"]}), diff_rows=diff, total=sum(diff.values()),
                        used=pick))
            self.p(f"bi {n}x{k}: done")
        self.results["bi"] = rows

    # -- phase: throughput ----------------------------------------------------------
    def _graph(self, launch, nsets, iters):
        """A replayable of `iters` launches cycling over `nsets` input sets: a CUDA graph,
        warmed up (eager on the CPU)."""
        t = self.torch
        if self.fake:
            def eager():
                for i in range(iters):
                    launch(i % nsets)
            return eager
        s = t.cuda.Stream()
        s.wait_stream(t.cuda.current_stream())
        with t.cuda.stream(s):
            for i in range(nsets):
                launch(i)
        t.cuda.current_stream().wait_stream(s)
        t.cuda.synchronize()
        g = t.cuda.CUDAGraph()
        with t.cuda.graph(g):
            for i in range(iters):
                launch(i % nsets)
        g.replay()
        t.cuda.synchronize()
        return g.replay

    def _replay_us(self, replay, iters, reps):
        """Median us per launch over `reps` timed replays."""
        t = self.torch
        if self.fake:
            t0 = time.perf_counter()
            replay()
            return (time.perf_counter() - t0) * 1e6 / iters
        samples = []
        for _ in range(reps):
            e0 = t.cuda.Event(enable_timing=True)
            e1 = t.cuda.Event(enable_timing=True)
            e0.record()
            replay()
            e1.record()
            e1.synchronize()
            samples.append(e0.elapsed_time(e1) * 1e3 / iters)
        return statistics.median(samples)

    def perf(self, shapes, ms, pick, deadline, rounds=1):
        """pick(n, k, m) -> kernel names to time (cuBLAS fast/exact always).

        Each implementation's graph is captured once per point; then `rounds` rounds
        time every implementation in turn (the order rotated by one each round), each
        a median of 5 replays (3 when rounds > 1). A row's `us` is the median over the
        rounds and `rounds_us` keeps each round's time, so a ratio to cuBLAS can be the
        median of the per-round ratios (summarize), which a slow moment of the GPU
        during one implementation's turn does not move."""
        t = self.torch
        sa, sb = self.scales()
        rows = []
        reps = 5 if rounds == 1 else 3
        for (n, k) in shapes:
            for m in ms:
                if time.time() > deadline:
                    self.p(f"perf: deadline reached at {m}x{n}x{k}; stopping")
                    self.results["perf_truncated"] = True
                    self.results["perf"] = rows
                    return
                todo = [x for x in pick(n, k, m) if x in self.fns and self.fits(x, m, n)]
                if not todo:  # a set that times this shape at other M only
                    continue
                per = m * k + n * k + 2 * m * n
                nsets = max(1, min(16, -(-(200 << 20) // per)))
                if self.fake:
                    nsets = 1
                A = [self.fp8(m, k) for _ in range(nsets)]
                B = [self.fp8(n, k) for _ in range(nsets)]
                C = [t.empty(m, n, dtype=t.bfloat16, device=self.dev) for _ in range(nsets)]
                ws, cnt = self.buffers(todo, m, n)
                iters = 20 if m * n * k < (1 << 36) else 8
                if self.fake:
                    iters = 1
                graphs = {}
                for fa in (True, False):
                    def ls(i, fa=fa, A=A, B=B):
                        self.scaled_mm(A[i], B[i], sa, sb, fa)
                    graphs[f"cublas_fast{int(fa)}"] = self._graph(ls, nsets, iters)
                for name in todo:
                    fn = self.fns[name]
                    self.watchdog(name)

                    def ls(i, fn=fn, A=A, B=B, C=C, ws=ws, cnt=cnt):
                        fn(A[i], B[i], C[i], sa, sb, ws, cnt)
                    graphs[name] = self._graph(ls, nsets, iters)
                    self.watchdog("")
                keys = list(graphs)
                samples = {key: [] for key in keys}
                for r in range(rounds):
                    for j in range(len(keys)):
                        key = keys[(j + r) % len(keys)]
                        self.watchdog("" if key.startswith("cublas") else key)
                        samples[key].append(self._replay_us(graphs[key], iters, reps))
                self.watchdog("")
                del graphs
                res = {key: statistics.median(v) for key, v in samples.items()}
                for key, us in res.items():
                    rows.append(dict(m=m, n=n, k=k, impl=key, us=us,
                                     tflops=2.0 * m * n * k / us / 1e6,
                                     rounds_us=[round(x, 3) for x in samples[key]]))
                del A, B, C
                ours = [x for x in res if not x.startswith("cublas")]
                if ours:
                    best = min(ours, key=res.get)
                    self.p(f"perf {m}x{n}x{k}: cublas fast {res['cublas_fast1']:.1f} exact "
                           f"{res['cublas_fast0']:.1f} us; best {best} {res[best]:.1f} us")
        self.results["perf"] = rows


def run(bundle: str, out: str, phases: list[str], exclude: list[str], fake: bool,
        budget_s: float, override_ms: list[int] | None = None,
        only_shapes: list[str] | None = None, rounds: int = 1) -> None:
    """The phases on the bundle; override_ms replaces a "mid", "split" or "pass4" bundle's M
    list in perf; only_shapes ("NxK") restricts bi and perf to those shapes; rounds: timing
    rounds per point in perf (Runner.perf)."""
    os.makedirs(out, exist_ok=True)
    r = Runner(bundle, out, fake)
    torch = r.torch
    torch.manual_seed(0)
    t_start = time.time()
    names = [x for x in r.fns if x not in exclude]
    r.results["excluded_after_hang"] = exclude
    r.p(f"device {r.results.get('device', 'cpu (fake)')} torch {torch.__version__}; "
        f"{len(names)} kernels loaded in {r.load_ms:.1f} ms; set {r.manifest['set']}")
    jpath = os.path.join(out, "hopper_fp8.json")

    def dump():
        with open(jpath, "w") as f:
            json.dump(r.results, f, indent=1, default=str)

    shapes = [tuple(s) for s in r.manifest["shapes"]]
    if only_shapes:
        shapes = [s for s in shapes if f"{s[0]}x{s[1]}" in only_shapes]
    if fake:  # small stand-ins for two seed shapes, with their plans
        shapes = [(272, 400), (256, 1040)]
        r.manifest["plan"]["272x400"] = r.manifest["plan"]["4096x4096"]
        r.manifest["plan"]["256x1040"] = r.manifest["plan"]["2688x4096"]
    plain = [x for x in names if r.is_plain(x)]
    if "correct" in phases:
        r.correct(names)
        dump()
    if "bi" in phases:
        r.bi(names, shapes, MS if not fake else [1, 2, 7, 64, FULL_M])
        dump()
    if "perf" in phases:
        plan = r.manifest["plan"]
        if r.manifest["set"] == "wide":
            def pick(n, k, m):
                # classes S <= 4 (S = 8, 16 never came close: docs/history.md); 'cta'
                # only up to M = 1024; swap_ab only up to M = 256, but for its largest
                # tile (64 tokens x 128 weight rows) at every M
                return [x for x in plain if r.meta[x]["splits"] <= 4
                        and not (r.is_cta(x) and m > 1024) and not (
                            r.is_swap(x) and m > 256 and r.meta[x]["tile_m"] != 64)]
            ms = MS
        elif r.manifest["set"] in ("mid", "split", "pass4", "pingpong", "pp128", "split5"):
            def pick(n, k, m):
                # the plan's class for (N, K) only
                s = plan[f"{n}x{k}"]["splits"]
                return [x for x in plain if r.meta[x]["splits"] == s]
            ms = override_ms or {"pass4": PASS4_MS, "pingpong": PINGPONG_MS,
                                 "pp128": PP128_MS, "split5": PP128_MS}.get(
                r.manifest["set"], MID_MS)
        elif r.manifest["set"] in ("decode6", "decode7"):
            def pick(n, k, m):
                # the plan's first choice, then its class's decode candidates (M <= 64) or,
                # at M in DECODE6_SPLIT_MS, the class S = 2's unswapped tactics
                s = plan[f"{n}x{k}"]["splits"]
                out = list(plan[f"{n}x{k}"]["by_m"].get(str(m), [])[:1])
                if m <= DECODE_MS[-1]:
                    out += [x for x in plain if r.meta[x]["splits"] == s
                            and decode_candidate(r.meta[x])]
                elif s == 2:
                    out += [x for x in plain if r.meta[x]["splits"] == s
                            and not r.meta[x]["swap_ab"]]
                return list(dict.fromkeys(out))
            ms = override_ms or DECODE_MS + (DECODE6_SPLIT_MS if r.manifest["set"] == "decode6"
                                             else [])
        else:
            alt = r.manifest.get("plan_alt") or {}

            def pick(n, k, m):
                names = list(plan[f"{n}x{k}"]["by_m"][str(m)])
                for nm in alt.get(f"{n}x{k}", {}).get("by_m", {}).get(str(m), []):
                    if nm not in names:
                        names.append(nm)
                return names
            ms = MS
        if fake:
            ms = [1, 64]
        r.results["rounds"] = rounds
        r.perf(shapes, ms, pick, t_start + budget_s, rounds)
        dump()
    r.results["wall_seconds"] = round(time.time() - t_start, 1)
    dump()
    summarize(r.results, r.manifest, r.p)


# ====================================================================================
# summary tables
# ====================================================================================

def _gm(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def points(res, manifest, alt: bool = False) -> dict:
    """{(n, k, m): (kernel, us, r1, r0)} of the plan's first choice (alt: the alternative
    plan's) in a final run's perf rows; r1/r0 = cuBLAS time over ours (fast accumulation
    on/off), the median of the per-round ratios where the run timed in rounds."""
    cells, rounds = {}, {}
    for row in res.get("perf", []):
        cells.setdefault((row["n"], row["k"], row["m"]), {})[row["impl"]] = row["us"]
        if row.get("rounds_us"):
            rounds[(row["n"], row["k"], row["m"], row["impl"])] = row["rounds_us"]
    plan = manifest.get("plan_alt" if alt else "plan") or {}
    out = {}
    for (n, k, m), d in cells.items():
        first = (plan.get(f"{n}x{k}", {}).get("by_m", {}).get(str(m)) or [None])[0]
        if first not in d:
            continue
        rs = []
        for cub in ("cublas_fast1", "cublas_fast0"):
            a, b = rounds.get((n, k, m, cub)), rounds.get((n, k, m, first))
            rs.append(statistics.median(x / y for x, y in zip(a, b, strict=True))
                      if a and b and len(a) == len(b) > 1 else d[cub] / d[first])
        out[(n, k, m)] = (first, d[first], rs[0], rs[1])
    return out


def markdown(res, manifest, alt: bool = False) -> None:
    """The final run's three tables (plan's first choice in us; cuBLAS fast / ours, bold
    under 0.9; cuBLAS exact / ours, bold under 1.0) and the geometric means and counts by
    M band, as markdown."""
    pts = points(res, manifest, alt)
    shapes = [tuple(s) for s in manifest["shapes"]]
    plan = manifest.get("plan_alt" if alt else "plan") or {}
    head = "| N x K | S | " + " | ".join(str(m) for m in MS) + " |"
    rule = "|---|---|" + "---|" * len(MS)
    for title, col, fmt in (("us", 1, lambda v: f"{v:.1f}"),
                            ("fast", 2, lambda v: f"**{v:.2f}**" if v < 0.9 else f"{v:.2f}"),
                            ("exact", 3, lambda v: f"**{v:.2f}**" if v < 1.0 else f"{v:.2f}")):
        print(f"\n{title}:\n\n{head}\n{rule}")
        for n, k in shapes:
            s = plan.get(f"{n}x{k}", {}).get("splits", "")
            cells = [fmt(pts[(n, k, m)][col]) if (n, k, m) in pts else "-" for m in MS]
            print(f"| {n}x{k} | {s} | " + " | ".join(cells) + " |")
    bands = (("all", 1, 8192), ("M <= 64", 1, 64), ("M = 128-1024", 128, 1024),
             ("M = 2048-8192", 2048, 8192))
    print()
    for name, lo, hi in bands:
        v = [x for (_, _, m), x in pts.items() if lo <= m <= hi]
        if not v:
            continue
        r1 = [x[2] for x in v]
        r0 = [x[3] for x in v]
        print(f"- {name}: {len(v)} points, geomean fast {_gm(r1):.3f} / exact {_gm(r0):.3f}, "
              f"min {min(r1):.2f} / {min(r0):.2f}, under 0.9 fast {sum(x < 0.9 for x in r1)}, "
              f"under 1.0 exact {sum(x < 1.0 for x in r0)}")


def rounds_report(res, manifest, p, max_m: int = 8192) -> None:
    """Per point (M <= max_m) of a run timed in rounds: the plan's first choice's ratio to
    cuBLAS (fast on / off) as the median of the per-round ratios with its min-max over
    the rounds, and the fastest other kernel of the point (all timed kernels are of the
    plan's class) with the first choice's time over its time (median of the per-round
    quotients, min-max)."""
    cells = {}
    for row in res.get("perf", []):
        if row.get("rounds_us") and row["m"] <= max_m:
            cells.setdefault((row["n"], row["k"], row["m"]), {})[row["impl"]] = row["rounds_us"]
    plan = manifest.get("plan", {})
    p("PER-ROUND SPREAD (ratio = median of per-round ratios [min-max over rounds]; "
      "first/best = first choice's time over the fastest other kernel's)")
    p("      M  N x K           r1 fast [min-max]     r0 exact [min-max]    first/best "
      "[min-max]   first -> best")
    order = [tuple(s) for s in manifest["shapes"]]
    def where(c):
        nk = (c[0], c[1])
        return (order.index(nk) if nk in order else len(order), nk, c[2])
    for (n, k, m) in sorted(cells, key=where):
        d = cells[(n, k, m)]
        first = (plan.get(f"{n}x{k}", {}).get("by_m", {}).get(str(m)) or [None])[0]
        if first not in d:
            continue

        def q(a, b):
            per = [x / y for x, y in zip(a, b, strict=True)]
            return statistics.median(per), min(per), max(per)
        r1, r0 = q(d["cublas_fast1"], d[first]), q(d["cublas_fast0"], d[first])
        others = {x: statistics.median(v) for x, v in d.items()
                  if not x.startswith("cublas") and x != first}
        line = (f"  {m:5d}  {n}x{k}".ljust(22) + f"{r1[0]:5.3f} [{r1[1]:.3f}-{r1[2]:.3f}]   "
                f"{r0[0]:5.3f} [{r0[1]:.3f}-{r0[2]:.3f}]")
        if others:
            best = min(others, key=others.get)
            fb = q(d[first], d[best])
            line += f"   {fb[0]:5.3f} [{fb[1]:.3f}-{fb[2]:.3f}]   {first} -> {best}"
        p(line)


def summarize(res, manifest, p) -> None:
    p("")
    p("=" * 100)
    if "correct" in res:
        p("CORRECTNESS (rel = ||out - ref64|| / ||ref64||, worst over problems)")
        worst = {}
        for row in res["correct"]:
            w = worst.setdefault(row["kernel"], dict(rel=0.0, written=True, same=True, cls=""))
            w["rel"] = max(w["rel"], row["rel"])
            w["written"] &= bool(row["all_written"])
            w["same"] &= bool(row["same_as_class_first"])
            w["cls"] = row["cls"]
        ours = {k: v for k, v in worst.items() if v["cls"] != "cublas"}
        bad = [k for k, v in ours.items() if not (v["written"] and v["rel"] < 2e-2)]
        notsame = [k for k, v in ours.items() if not v["same"]]
        rels = sorted(v["rel"] for v in ours.values())
        p(f"  kernels: {len(ours)}; failing (rel >= 2e-2 or unwritten): {len(bad)} {bad[:4]}")
        if rels:
            p(f"  worst rel max {rels[-1]:.3e}, median {statistics.median(rels):.3e}")
        p(f"  kernels not bitwise equal to their class's first kernel: {len(notsame)} "
          f"{notsame[:4]}")
        sw = {row["kernel"] for row in res["correct"] if row.get("swap")}
        sw_same = sum(1 for row in res["correct"] if row.get("swap") and
                      row["same_as_class_first"])
        sw_all = sum(1 for row in res["correct"] if row.get("swap"))
        p(f"  swap_ab kernels: {len(sw)}; (kernel, problem) pairs bitwise equal to the "
          f"unswapped first kernel of their class: {sw_same}/{sw_all}")
        for k, v in worst.items():
            if v["cls"] == "cublas":
                p(f"  {k:34s} worst rel {v['rel']:.3e}")
        eq = {}
        for row in res["correct"]:
            if "eq_fast1" in row:
                e = eq.setdefault(row["cls"], [0, 0, 0])
                e[0] += row["eq_fast1"]
                e[1] += row["eq_fast0"]
                e[2] += 1
        for cls, (e1, e0, n) in sorted(eq.items()):
            p(f"  class {cls}: bitwise equal to scaled_mm fast1 {e1}/{n}, fast0 {e0}/{n}")
    if "bi" in res:
        p(f"BATCH INVARIANCE (rows of x[:M] differing from the M={FULL_M} output, summed over"
          f" M in {MS}; cross = rows differing from the class's first kernel at the same M)")
        shapes = sorted({(row["n"], row["k"]) for row in res["bi"]},
                        key=lambda s: [tuple(x) for x in manifest["shapes"]].index(s)
                        if list(s) in manifest["shapes"] else 0)
        by = {}
        for row in res["bi"]:
            key = (row.get("group") or row["cls"]) if row["impl"] not in ("plan_mix",) and \
                row["cls"] else row["impl"]
            if row["impl"] == "plan_mix":
                key = "plan_mix"
            d = by.setdefault(key, {}).setdefault((row["n"], row["k"]), [0, 0, 0])
            d[0] += row["total"]
            d[1] += row.get("cross_total", 0)
            d[2] += 1
        p("  " + "impl (kernels)".ljust(38) + "".join(f"{n}x{k}".rjust(12) for n, k in shapes))
        for key in sorted(by, key=str):
            cells = []
            for s in shapes:
                d = by[key].get(s)
                cells.append("-" if d is None else (f"{d[0]}/{d[1]}" if key.startswith("k128")
                                                    else str(d[0])))
            nk = max(v[2] for v in by[key].values())
            p(f"  {(key + f' ({nk})')[:38]:38s}" + "".join(c.rjust(12) for c in cells))
        p("  (k128.* cells: seeds' method rows / cross-kernel rows within the class)")
    if "perf" in res:
        by, rounds = {}, {}
        for row in res["perf"]:
            cell = by.setdefault((row["n"], row["k"]), {}).setdefault(row["m"], {})
            cell[row["impl"]] = row["us"]
            if row.get("rounds_us"):
                rounds[(row["n"], row["k"], row["m"], row["impl"])] = row["rounds_us"]

        def ratio(n, k, m, cub, ours, d):
            """cuBLAS time / ours: the median of the per-round ratios where the run timed
            in rounds, else the ratio of the medians."""
            a, b = rounds.get((n, k, m, cub)), rounds.get((n, k, m, ours))
            if a and b and len(a) == len(b) > 1:
                return statistics.median(x / y for x, y in zip(a, b, strict=True))
            return d[cub] / d[ours]
        plan = manifest.get("plan", {})
        p("THROUGHPUT (us per GEMM, bf16 out; r1/r0 = cuBLAS fast-accum on/off time / ours)")
        p("      M  N x K          cuB1     cuB0    plan   r1    r0      best   r1b  plan kernel")
        allr1, allr0, spread = [], [], []
        for (n, k), bym in by.items():
            pl = plan.get(f"{n}x{k}", {}).get("by_m", {})
            for m in sorted(bym):
                d = bym[m]
                ours = {x: v for x, v in d.items() if not x.startswith("cublas")}
                if not ours:
                    continue
                first = (pl.get(str(m)) or [None])[0]
                best = min(ours, key=ours.get)
                pv = ours.get(first)
                r1 = ratio(n, k, m, "cublas_fast1", first, d) if pv else float("nan")
                r0 = ratio(n, k, m, "cublas_fast0", first, d) if pv else float("nan")
                if pv and manifest.get("set") in ("final", "pdl8"):
                    allr1.append(r1)
                    allr0.append(r0)
                a, b = rounds.get((n, k, m, "cublas_fast1")), rounds.get((n, k, m, first))
                if pv and a and b and len(a) == len(b) > 1:
                    per = [x / y for x, y in zip(a, b, strict=True)]
                    spread.append(max(per) / min(per))
                p(f"  {m:5d}  {n}x{k}".ljust(22) + f"{d['cublas_fast1']:8.1f} "
                  f"{d['cublas_fast0']:8.1f} " + (f"{pv:7.1f} {r1:5.2f} {r0:5.2f}" if pv else
                                                  f"{'-':>7} {'-':>5} {'-':>5}") +
                  f"  {ours[best]:8.1f}  {d['cublas_fast1'] / ours[best]:5.2f}  {first}")
        if allr1:
            p(f"  plan's first choice: geomean r1 {_gm(allr1):.3f} (min {min(allr1):.2f}), "
              f"geomean r0 {_gm(allr0):.3f} (min {min(allr0):.2f}); points {len(allr1)}; "
              f"r1 < 0.9: {sum(x < 0.9 for x in allr1)}; r0 < 1.0: {sum(x < 1.0 for x in allr0)}")
        if manifest.get("plan_alt"):
            new, old = points(res, manifest), points(res, manifest, alt=True)
            both = [x for x in new if x in old]
            if both:
                moved = [x for x in both if new[x][0] != old[x][0]]
                p(f"  alternative plan ({manifest.get('alt_winners')}), same run: geomean r1 "
                  f"{_gm([old[x][2] for x in both]):.3f}, r0 {_gm([old[x][3] for x in both]):.3f}"
                  f"; r1 < 0.9: {sum(old[x][2] < 0.9 for x in both)}; r0 < 1.0: "
                  f"{sum(old[x][3] < 1.0 for x in both)}; at the {len(moved)} points whose "
                  f"first choice differs, r1 plan/alt geomean "
                  f"{_gm([new[x][2] for x in moved]) / _gm([old[x][2] for x in moved]):.3f}"
                  if moved else "")
        if spread:
            spread.sort()
            nr = len(next(iter(rounds.values())))
            p(f"  r1 of the plan's first choice across the {nr} rounds (max/min per point): "
              f"median {statistics.median(spread):.3f}, "
              f"90th percentile {spread[round(0.9 * (len(spread) - 1))]:.3f}, "
              f"worst {spread[-1]:.3f} over {len(spread)} points")
    if manifest.get("set") in ("decode6", "decode7", "pdl8") and res.get("rounds", 1) > 1:
        rounds_report(res, manifest, p)
    p(f"wall {res.get('wall_seconds')} s")


def profile_inputs(torch, params: dict, m: int, n: int, k: int, dev):
    """a (m, k), b (n, k) e4m3 and the scales the kernel's scheme takes: per-tensor
    (0.75, 1.25), per-token (M and N values) or block128 (a_scale (M, K/128) column-major,
    b_scale (ceil(N/128), K/128) row-major, as hopper_fp8_schemes.py's BlockRunner.data),
    fp32 in [0.5, 2)."""
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(m, k, device=dev, generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device=dev, generator=g).to(torch.float8_e4m3fn)
    scales = params.get("scales", "tensor")
    if scales == "block128":
        kb, nb = k // 128, -(-n // 128)
        sa = (torch.rand(kb, m, device=dev, generator=g) * 1.5 + 0.5).t()
        sb = torch.rand(nb, kb, device=dev, generator=g) * 1.5 + 0.5
    elif scales == "token":
        sa = torch.rand(m, 1, device=dev, generator=g) * 1.5 + 0.5
        sb = torch.rand(n, 1, device=dev, generator=g) * 1.5 + 0.5
    else:
        sa = torch.tensor([0.75], device=dev, dtype=torch.float32)
        sb = torch.tensor([1.25], device=dev, dtype=torch.float32)
    return a, b, sa, sb


def profile(bundle: str, name: str, m: int, n: int, k: int, reps: int, events: int = 0,
            iters: int = 10, dry: bool = False) -> None:
    """Launch one kernel `reps` times on fresh data (for ncu: profile the last launch). Our
    kernels take the scales of their scheme (profile_inputs). events > 0: afterwards, time
    `events` rounds of `iters` back-to-back launches with CUDA events and print the median
    us per launch (run it without ncu). dry: on the CPU, check the name, the inputs' shapes
    and strides and the launcher's argument checks that need no device; launch nothing."""
    if dry:
        import torch

        with open(os.path.join(bundle, "manifest.json")) as f:
            meta = {e["name"]: e for e in json.load(f)["kernels"]}
        if name.startswith("cublas"):
            print(f"dry: {name} {m}x{n}x{k}: torch._scaled_mm, fast accumulation "
                  f"{name.endswith('1')}")
            return
        if name not in meta:
            raise SystemExit(f"dry: {name} is not in {bundle}/manifest.json")
        e = meta[name]
        a, b, sa, sb = profile_inputs(torch, e["params"], m, n, k, torch.device("cpu"))
        sys.path.insert(0, os.path.join(bundle, "client"))
        from cached_client.gemm import hopper_fp8 as launcher

        if e["params"].get("scales") == "block128":
            launcher._check_block_scales(sa, sb, m, n, k)  # shapes and strides only
        print(f"dry: {name} ({e['symbol']}, {e['so']}, exists "
              f"{os.path.exists(os.path.join(bundle, e['so']))}) {m}x{n}x{k}: scales "
              f"{e['params'].get('scales', 'tensor')}, accum {e['params'].get('accum', 'fast')}, "
              f"a_scale {tuple(sa.shape)} strides {sa.stride()}, b_scale {tuple(sb.shape)} "
              f"strides {sb.stride()}; reps {reps}, events {events} x {iters}")
        return
    r = Runner(bundle, os.environ.get("OUT", "/tmp"), fake=False)
    if name.startswith("cublas"):
        sa, sb = r.scales()
        a, b = r.fp8(m, k), r.fp8(n, k)

        def launch():
            r.scaled_mm(a, b, sa, sb, name.endswith("1"))
    else:
        a, b, sa, sb = profile_inputs(r.torch, r.meta[name], m, n, k, r.dev)
        out = r.torch.empty(m, n, dtype=r.outdt(name), device=r.dev)

        def launch():
            r.call(name, a, b, sa, sb, out)
    for _ in range(reps):
        launch()
    r.sync()
    if events > 0:
        t = r.torch
        us = []
        for _ in range(events):
            e0, e1 = t.cuda.Event(enable_timing=True), t.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(iters):
                launch()
            e1.record()
            e1.synchronize()
            us.append(e0.elapsed_time(e1) * 1e3 / iters)
        print(f"time {name} {m}x{n}x{k}: median {statistics.median(us):.1f} us per launch "
              f"(min {min(us):.1f}, max {max(us):.1f}; {events} rounds x {iters} launches, "
              f"CUDA events, eager, same inputs)", flush=True)


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", required=True)
    b.add_argument("--set", default="final",
                   choices=["wide", "mid", "split", "pass4", "pingpong", "pp128", "split5",
                            "decode6", "decode7", "pdl8", "final"])
    b.add_argument("--jobs", type=int, default=2)
    b.add_argument("--top", type=int, default=3, help="plan choices per M kept (final)")
    b.add_argument("--alt-winners", default=None,
                   help="final: another winners JSON whose plan's first choices are "
                        "timed beside the plan's (summarize compares the two)")
    b.add_argument("--kernels", default="",
                   help="comma-separated tactic names: build exactly these (replaces --set)")
    b.add_argument("--dry", action="store_true", help="manifest only, no compile")
    b.add_argument("--reuse-code", action="store_true",
                   help="reuse the bundle's kernels across a tactic.py change that leaves "
                        "kernel.py, compile.py and the codegen constants as they were")
    r = sub.add_parser("run")
    r.add_argument("--bundle", default=HERE)
    r.add_argument("--out", default=os.environ.get("OUT", "/tmp/hopper_fp8_out"))
    r.add_argument("--phases", default="correct,bi,perf")
    r.add_argument("--exclude", default="", help="comma-separated kernel names to skip")
    r.add_argument("--budget", type=float, default=400.0,
                   help="seconds from start after which perf stops")
    r.add_argument("--fake", action="store_true", help="CPU dry run of the driver")
    r.add_argument("--ms", default="", help="mid/split set: comma-separated M to time "
                                            "instead of MID_MS")
    r.add_argument("--shapes", default="", help="comma-separated NxK: bi and perf on these")
    r.add_argument("--rounds", type=int, default=1,
                   help="perf: timing rounds per point, implementations interleaved; the "
                        "ratios to cuBLAS are the median of the per-round ratios")
    c = sub.add_parser("_compile")
    c.add_argument("jobs_json")
    pr = sub.add_parser("profile")
    pr.add_argument("--bundle", default=HERE)
    pr.add_argument("--kernel", required=True, help="kernel name, or cublas_fast1/0")
    pr.add_argument("--mnk", required=True, help="M,N,K")
    pr.add_argument("--reps", type=int, default=3)
    pr.add_argument("--events", type=int, default=0,
                    help="then time this many rounds of --iters launches (CUDA events)")
    pr.add_argument("--iters", type=int, default=10)
    pr.add_argument("--dry", action="store_true",
                    help="CPU: check the name, inputs and scale layouts; launch nothing")
    s = sub.add_parser("summarize")
    s.add_argument("json")
    s.add_argument("manifest")
    s.add_argument("--markdown", action="store_true",
                   help="final: the three tables (us, ratio fast, ratio exact) as markdown, "
                        "and the geometric means and counts by M band")
    s.add_argument("--alt", action="store_true",
                   help="--markdown: tables of the alternative plan (--alt-winners) instead")
    a = ap.parse_args()
    if a.cmd == "build":
        build(a.out, a.set, a.jobs, a.top, a.dry, a.reuse_code, a.alt_winners,
              [x for x in a.kernels.split(",") if x] or None)
    elif a.cmd == "_compile":
        _compile_worker(a.jobs_json)
    elif a.cmd == "profile":
        m, n, k = (int(x) for x in a.mnk.split(","))
        profile(a.bundle, a.kernel, m, n, k, a.reps, a.events, a.iters, a.dry)
    elif a.cmd == "summarize":
        with open(a.json) as f, open(a.manifest) as g:
            res, man = json.load(f), json.load(g)
        if a.markdown:
            markdown(res, man, a.alt)
        else:
            summarize(res, man, print)
    else:
        run(a.bundle, a.out, a.phases.split(","), [x for x in a.exclude.split(",") if x],
            a.fake, a.budget, [int(x) for x in a.ms.split(",") if x] or None,
            [x for x in a.shapes.split(",") if x] or None, a.rounds)


if __name__ == "__main__":
    main()
