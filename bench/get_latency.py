"""One client's `get` latency against a fresh daemon: 2 stored kernels, 3 x 1000 gets with
transfer path, the best mean in ms; once on one kept connection, once on a new connection
for every get through the default socket (``$XDG_RUNTIME_DIR/cached/cached.sock``: what a
connect costs, with the client's checks of the socket's directory and the server's uid and
the ``hello`` it reads before its first ``get``). To compare commits, run it from a
checkout of each:

    PYTHONPATH=$PWD:$PWD/client .venv/bin/python bench/get_latency.py LABEL
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from cached_client import Client
from common import Daemon, plan

from cached.cli.warm import warm


def best_ms_per_get(client: Client, requests: list, n: int = 1000, rounds: int = 3,
                    reconnect: bool = False) -> float:
    client.get(requests[0])
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for i in range(n):
            if reconnect:
                client.close()
            client.get(requests[i % len(requests)])
        best = min(best, (time.perf_counter() - started) / n * 1e3)
    return best


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else "this checkout"
    with tempfile.TemporaryDirectory() as workdir:
        runtime = Path(workdir) / "cached"  # the default socket's directory, 0700
        runtime.mkdir(mode=0o700)
        d = Daemon(runtime, workers=1)
        try:
            requests = plan()[:2]
            warm(d.socket, requests, 600)
            ms = best_ms_per_get(Client(d.socket, timeout=30, transfer="path"), requests)
            print(f"{label}: {ms:.3f} ms per get (transfer path, one client)")
            os.environ.pop("CACHED_SOCKET", None)
            os.environ["XDG_RUNTIME_DIR"] = workdir
            client = Client(timeout=30, transfer="path")
            assert client.socket_path == d.socket
            ms = best_ms_per_get(client, requests, reconnect=True)
            print(f"{label}: {ms:.3f} ms per get on a new connection each (default socket)")
        finally:
            d.stop()


if __name__ == "__main__":
    main()
