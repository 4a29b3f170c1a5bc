"""Compile the whole tactic space of cached.hopper_fp8 (every reduction-order class) for
sm_90a through a fresh daemon, and report counts and time. `make test` compiles one tactic
per (tile, cluster) of the S = 1 class and every split tactic; this is the whole space.

    .venv/bin/python bench/compile_hopper.py [--workers N]
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
from cached.families.hopper_fp8 import tactics as T


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        daemon = Daemon(Path(tmp), workers=args.workers)
        try:
            client = Client(daemon.socket, timeout=600)
            requests = []
            for class_id in T.REDUCTION_CLASSES:
                requests += client.plan("cached.hopper_fp8", (4096, 4096, 4096), "sm_90a",
                                        options={"reduction_class": class_id})
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
