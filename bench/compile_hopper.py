"""Compile the whole tactic space of cached.hopper_fp8 (every reduction-order class) for
sm_90a through a fresh daemon, and report counts and time. `make test` compiles one tactic
per (tile, cluster) of the S = 1 class for the widths 64/128/192/256, every unswapped split
tactic of those widths without a cluster, one swap_ab tactic per code path and a sample of
the third pass's tactics, of the fourth pass's wg_n=2 and ping-pong tactics and of the
fifth pass's 128-row and serial-split ping-pong tactics; this is the whole space (665
tactics, the 72 swap_ab ones included).

    .venv/bin/python bench/compile_hopper.py [--workers N] [--swap-only | --new-only |
        --wg-n-only | --pingpong-only] [--out-dtype float16 --ab-dtype e5m2]

--swap-only compiles the 72 swap_ab tactics alone; --new-only the 152 tactics of the widths
80, 96, 112, 160 (72 of S = 1, 16 serial splits) and the serial splits with a cluster (64,
both rasters); --wg-n-only the 53 wg_n=2 tactics of the fourth pass (21 of S = 1, 8
serial splits per S > 1); --pingpong-only the 68 ping-pong tactics (36 of S = 1, 8 serial
splits per S > 1).
--out-dtype / --ab-dtype plan with other dtypes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from cached_client import Client
from common import Daemon

from cached.cli.warm import warm
from cached.families.hopper_fp8 import space as SPACE
from cached.families.hopper_fp8 import tactic as T


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=None)
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--swap-only", action="store_true")
    only.add_argument("--new-only", action="store_true")
    only.add_argument("--wg-n-only", action="store_true")
    only.add_argument("--pingpong-only", action="store_true")
    parser.add_argument("--out-dtype", default="bfloat16", choices=T.OUT_DTYPES)
    parser.add_argument("--ab-dtype", default="e4m3", choices=T.AB_DTYPES)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        daemon = Daemon(Path(tmp), workers=args.workers)
        try:
            client = Client(daemon.socket, timeout=600)
            requests = []
            for class_id in T.REDUCTION_CLASSES:
                requests += client.plan("cached.hopper_fp8", (4096, 4096, 4096), "sm_90a",
                                        options={"reduction_class": class_id,
                                                 "out_dtype": args.out_dtype,
                                                 "ab_dtype": args.ab_dtype})
            if args.swap_only:
                requests = [r for r in requests if r.params["swap_ab"]]
            if args.wg_n_only:
                requests = [r for r in requests if r.params["wg_n"] == 2]
            if args.pingpong_only:
                requests = [r for r in requests if r.params["pingpong"]]
            if args.new_only:
                requests = [r for r in requests if not r.params["swap_ab"]
                            and r.params["wg_n"] == 1 and not r.params["pingpong"] and (
                    r.params["tile_n"] not in SPACE.SWIZZLED_TILE_N or (
                        r.params["splits"] > 1
                        and r.params["cluster_m"] * r.params["cluster_n"] > 1))]
            started = time.monotonic()
            counts = warm(daemon.socket, requests, 7200)
            counts["seconds"] = round(time.monotonic() - started, 1)
            counts["kernels"] = len(requests)
            counts["workers"] = client.stats()["workers"]
        finally:
            daemon.stop()
    print(json.dumps(counts))
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
