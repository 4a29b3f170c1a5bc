"""One client's `get` latency against a fresh daemon: 2 stored kernels, 3 x 1000 gets with
transfer path, the best mean in ms (wall, and the client process's CPU: a figure a busy
machine disturbs less); once on one kept connection, once on a new connection
for every get through the default socket (``$XDG_RUNTIME_DIR/cached/cached.sock``: what a
connect costs, with the client's checks of the socket's directory and the server's uid and
the ``hello`` it reads before its first ``get``); then a bare connect's client CPU with and
without the directory check (both check the server's uid). To compare commits, run it from a
checkout of each:

    PYTHONPATH=$PWD:$PWD/client .venv/bin/python bench/get_latency.py LABEL
"""

from __future__ import annotations

import inspect
import os
import sys
import tempfile
import time
from pathlib import Path

from cached_client import Client
from cached_client.transport import Connection
from common import Daemon, plan

from cached.cli.warm import warm


def best_ms_per_get(client: Client, requests: list, n: int = 1000, rounds: int = 3,
                    reconnect: bool = False) -> tuple[float, float]:
    """The best round's mean (wall ms, client CPU ms) per get."""
    client.get(requests[0])
    wall = cpu = float("inf")
    for _ in range(rounds):
        started, used = time.perf_counter(), time.process_time()
        for i in range(n):
            if reconnect:
                client.close()
            client.get(requests[i % len(requests)])
        wall = min(wall, (time.perf_counter() - started) / n * 1e3)
        cpu = min(cpu, (time.process_time() - used) / n * 1e3)
    return wall, cpu


def connect_us(path: str, check_dir: bool, n: int = 2000, rounds: int = 3) -> float:
    """The best round's client CPU per connect and close, in microseconds."""
    best = float("inf")
    for _ in range(rounds):
        used = time.process_time()
        for _ in range(n):
            Connection(path, time.monotonic() + 5, check_dir=check_dir).close()
        best = min(best, (time.process_time() - used) / n * 1e6)
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
            wall, cpu = best_ms_per_get(Client(d.socket, timeout=30, transfer="path"), requests)
            print(f"{label}: {wall:.3f} ms per get, client CPU {cpu:.3f} ms (transfer path, "
                  "one client)")
            os.environ.pop("CACHED_SOCKET", None)
            os.environ["XDG_RUNTIME_DIR"] = workdir
            client = Client(timeout=30, transfer="path")
            assert client.socket_path == d.socket
            wall, cpu = best_ms_per_get(client, requests, reconnect=True)
            print(f"{label}: {wall:.3f} ms per get, client CPU {cpu:.3f} ms, on a new "
                  "connection each (default socket)")
            if "check_dir" in inspect.signature(Connection).parameters:  # not before it
                for check in (False, True):
                    print(f"{label}: connect (check_dir={check}): client CPU "
                          f"{connect_us(d.socket, check):.1f} us")
        finally:
            d.stop()


if __name__ == "__main__":
    main()
