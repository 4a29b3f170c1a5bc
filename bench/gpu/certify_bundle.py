"""Fill a store, here on the CPU, with what `cached certify` will ask for on the H200.

For each (N, K): the first LIMIT tactics of the M=2048 plan and the best-ranked tactic
of every seed M (the autotuner's mix), compiled by a real daemon (sm_90a, 132 SMs); the
plans are asked with certify's options (one reduction-order class per (N, K)).
Usage: python bench/gpu/certify_bundle.py STORE_DIR LIMIT N,K [N,K ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cached_client import Client  # noqa: E402
from cached_client.gemm.certify import FULL_M, PLAN_OPTIONS, SEED_MS  # noqa: E402
from common import Daemon  # noqa: E402

from cached.cli.warm import warm  # noqa: E402


def main() -> None:
    store, limit, shapes = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    store.mkdir(parents=True, exist_ok=True)
    d = Daemon(store.parent, workers=2, store=store)
    try:
        client = Client(d.socket, timeout=600)
        requests = []
        options = PLAN_OPTIONS.get("cached.hopper_fp8")
        for shape in shapes:
            n, k = (int(v) for v in shape.split(","))
            requests += client.plan("cached.hopper_fp8", (FULL_M, n, k), "sm_90a", 132,
                                    options)[:limit]
            requests += [client.plan("cached.hopper_fp8", (m, n, k), "sm_90a", 132, options)[0]
                         for m in SEED_MS]
        requests = list(dict.fromkeys(requests))
        print(warm(d.socket, requests, 3600))
    finally:
        d.stop()


if __name__ == "__main__":
    main()
