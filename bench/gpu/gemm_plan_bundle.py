"""Fill a store, here on the CPU, with every kernel the client's batch-invariant plans
(cached_client.gemm.plan) pick for the given (N, K) on an H200 (sm_90a, 132 SMs), M up to
MAX_M: the daemon plans each bucket, the plan's one prefetch queues the kernels, and a
pre-warm ``get`` of each waits for them. The GPU half, bench/gpu/gemm_plan_check.py, asks a
serve-only daemon on this store for the same plans. ``$ACCUMULATIONS`` (comma-separated,
default ``fast``; ``exact`` for block128) names the accumulation classes planned (``fast``,
``exact``), ``$SCALES`` (default ``tensor``) the scale scheme (``tensor``, ``token``,
``block128``), ``$AB_DTYPE`` (default ``e4m3``; ``bf16``: ``cached.hopper_bf16``'s plans,
no scale scheme, ``$OUT_DTYPES`` their comma-separated output types, default
``bfloat16``). The last line is JSON: the warm's counts and ``seconds``, the wall time
from an empty queue to every kernel in the store (what a cold daemon with these workers
spends compiling them).
Usage: python bench/gpu/gemm_plan_bundle.py STORE_DIR MAX_M N,K [N,K ...]
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cached_client import Client  # noqa: E402
from cached_client.gemm.plan import plan_gemm  # noqa: E402
from common import Daemon  # noqa: E402

from cached.cli.warm import warm  # noqa: E402


def main() -> None:
    store, max_m, shapes = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    scales = os.environ.get("SCALES") or "tensor"
    ab_dtype = os.environ.get("AB_DTYPE") or "e4m3"
    accumulations = (os.environ.get("ACCUMULATIONS")
                     or ("exact" if scales == "block128" else "fast")).split(",")
    if ab_dtype == "bf16":  # one scheme: no scales, fast accumulation; by output type
        variants = [{"ab_dtype": "bf16", "out_dtype": o}
                    for o in (os.environ.get("OUT_DTYPES") or "bfloat16").split(",")]
    else:
        variants = [{"ab_dtype": ab_dtype, "scales": scales, "accumulation": a}
                    for a in accumulations]
    store.mkdir(parents=True, exist_ok=True)
    d = Daemon(store.parent, workers=2, store=store)
    try:
        client = Client(d.socket, timeout=600)
        started = time.monotonic()
        requests = []
        for variant in variants:
            for shape in shapes:
                n, k = (int(v) for v in shape.split(","))
                plan = plan_gemm(client, n, k, arch="sm_90a", sm_count=132,
                                 device="NVIDIA H200", max_m=max_m, **variant)
                print(plan.describe(), flush=True)
                requests += plan.requests
        requests = list(dict.fromkeys(requests))
        counts = warm(d.socket, requests, 3600)
        counts["seconds"] = round(time.monotonic() - started, 1)
        counts["variants"] = variants
        print(json.dumps(counts), flush=True)
    finally:
        d.stop()


if __name__ == "__main__":
    main()
