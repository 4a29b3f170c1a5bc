"""Fill a store, here on the CPU, with every candidate ``cached tune`` times for the given
(N, K) and schemes on an H200 (sm_90a, 132 SMs) at every M bucket (cached.tools.tune.candidates:
the plan's first ``top`` and DEFAULT_WIDEN more of the scheme's class, what a bucket short of
its competitor is timed with, and the nearest recorded shapes' winners),
so that a serve-only daemon there can tune without compiling. Usage:
    python bench/gpu/tune_bundle.py STORE_DIR TOP NEAR [--buckets M,M,..] \
        [--schemes S,S,..] N,K [N,K ...]
(schemes: cached.tools.tune's names, default tensor-fast; a store that exists is added to: only
kernels it lacks are compiled; a scheme that plans nothing for a shape is skipped).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cached_client import Client  # noqa: E402
from cached_client.errors import InvalidTactic  # noqa: E402
from common import Daemon  # noqa: E402

from cached.cli.warm import warm  # noqa: E402
from cached.tools import tune  # noqa: E402


def main() -> None:
    store, top, near = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    rest = sys.argv[4:]
    buckets, schemes = tune.DEFAULT_BUCKETS, [tune.DEFAULT_SCHEME]
    while rest[:1] in (["--buckets"], ["--schemes"]):
        if rest[0] == "--buckets":
            buckets = tuple(int(v) for v in rest[1].split(","))
        else:
            schemes = tune.check_schemes(rest[1].split(","))
        rest = rest[2:]
    shapes = [tune.parse_shape(s) for s in rest]
    store.mkdir(parents=True, exist_ok=True)
    d = Daemon(store.parent, workers=2, store=store)
    try:
        client = Client(d.socket, timeout=600)
        target = tune.Target("NVIDIA H200", 132, "")
        requests = []
        for scheme in schemes:
            for n, k in shapes:
                per = []
                try:
                    for m in buckets:
                        # a bucket short of its competitor is timed with widen more
                        cls, cands = tune.candidates(client, n, k, m, target, top, near,
                                                     scheme, tune.DEFAULT_WIDEN)
                        per += cands
                except InvalidTactic as exc:
                    print(f"{n}x{k} {scheme}: not planned ({exc})", flush=True)
                    continue
                per = list(dict.fromkeys(per))
                print(f"{n}x{k} {scheme} {cls}: {len(per)} candidates", flush=True)
                requests += per
        requests = list(dict.fromkeys(requests))
        print(f"{len(requests)} kernels", flush=True)
        print(json.dumps(warm(d.socket, requests, 7200)), flush=True)
    finally:
        d.stop()


if __name__ == "__main__":
    main()
