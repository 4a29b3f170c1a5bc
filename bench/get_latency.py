"""One client's `get` latency against a fresh daemon: 2 stored kernels, 3 x 1000 gets with
transfer path, the best mean in ms. To compare commits, run it from a checkout of each:

    PYTHONPATH=$PWD:$PWD/client .venv/bin/python bench/get_latency.py LABEL
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from cached_client import Client
from common import Daemon, plan

from cached.cli.warm import warm


def best_ms_per_get(client: Client, requests: list, n: int = 1000, rounds: int = 3) -> float:
    client.get(requests[0])
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for i in range(n):
            client.get(requests[i % len(requests)])
        best = min(best, (time.perf_counter() - started) / n * 1e3)
    return best


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else "this checkout"
    with tempfile.TemporaryDirectory() as workdir:
        d = Daemon(Path(workdir), workers=1)
        try:
            requests = plan()[:2]
            warm(d.socket, requests, 600)
            ms = best_ms_per_get(Client(d.socket, timeout=30, transfer="path"), requests)
            print(f"{label}: {ms:.3f} ms per get (transfer path, one client)")
        finally:
            d.stop()


if __name__ == "__main__":
    main()
