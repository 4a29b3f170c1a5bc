"""Load: 64 concurrent clients x 1000 requests, all hits; then a mixed load with misses.

Hits: 8 processes x 8 threads, each thread its own connection, each request a `get` of
one of 8 stored kernels (path transfer, the client's default). Reports p50/p99 latency,
errors and the daemon's RSS before and after. Mixed: 20 kernels queued as pre-warm work,
then 16 clients asking at once for 6 other kernels (4 overlapping): compilations must
equal distinct kernels, and the waiting clients must finish before the pre-warm backlog.
Usage: python bench/load.py [--clients 64] [--requests 1000]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cached_client import Client, KernelRequest  # noqa: F401
from common import Daemon, percentile, plan, save

from cached.cli.warm import warm

WORKER = """
import json, sys, threading, time
from cached_client import Client, KernelRequest  # noqa: F401
sock, threads, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
requests = [KernelRequest.from_wire(w) for w in json.loads(sys.stdin.read())]
lat, errors = [], []
def run(t):
    c = Client(sock, timeout=30)
    for i in range(n):
        t0 = time.perf_counter()
        try:
            c.get(requests[(i + t) % len(requests)])
            lat.append(time.perf_counter() - t0)
        except Exception as e:
            errors.append(repr(e))
ts = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
[t.start() for t in ts]; [t.join() for t in ts]
print(json.dumps({"lat": lat, "errors": errors[:5], "n_errors": len(errors)}))
"""


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def hits(d: Daemon, requests: list[KernelRequest], clients: int, per_client: int) -> dict:
    procs, threads = 8, clients // 8
    wires = json.dumps([r.to_wire() for r in requests])
    before = rss_kib(d.proc.pid)
    started = time.monotonic()
    ps = [subprocess.Popen([sys.executable, "-c", WORKER, d.socket, str(threads),
                            str(per_client)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           text=True) for _ in range(procs)]
    outs = [json.loads(p.communicate(wires)[0]) for p in ps]
    wall = time.monotonic() - started
    lat = [v * 1000 for o in outs for v in o["lat"]]
    return {"clients": procs * threads, "requests": len(lat) + sum(o["n_errors"] for o in outs),
            "errors": sum(o["n_errors"] for o in outs), "p50_ms": percentile(lat, 50),
            "p99_ms": percentile(lat, 99), "max_ms": max(lat), "wall_s": wall,
            "throughput_rps": len(lat) / wall, "rss_kib_before": before,
            "rss_kib_after": rss_kib(d.proc.pid)}


def mixed(d: Daemon, prewarm: list[KernelRequest], wanted: list[KernelRequest]) -> dict:
    client = Client(d.socket, timeout=600)
    compiles_before = d.stats()["compiles"]
    started = time.monotonic()
    client.prefetch(prewarm)
    done: dict[str, float] = {}

    def ask(i: int) -> float:
        t0 = time.monotonic()
        Client(d.socket, timeout=600).get(wanted[i % len(wanted)])
        return time.monotonic() - t0

    with ThreadPoolExecutor(16) as pool:
        waits = list(pool.map(ask, range(16)))
    done["clients_all_served_s"] = time.monotonic() - started
    while d.stats()["in_flight"]:
        time.sleep(0.2)
    done["prewarm_drained_s"] = time.monotonic() - started
    compiles = d.stats()["compiles"] - compiles_before
    return {"prewarm_kernels": len(prewarm), "client_kernels": len(set(wanted)),
            "clients": 16, "compiles": compiles,
            "expected_compiles": len(set(prewarm) | set(wanted)),
            "client_wait_p50_s": percentile(waits, 50), "client_wait_max_s": max(waits),
            **done}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=1000)
    args = parser.parse_args()
    requests = plan()
    with tempfile.TemporaryDirectory() as workdir:
        d = Daemon(Path(workdir))
        try:
            stored = requests[:8]
            warm(d.socket, stored, 600)
            result = {"hits": hits(d, stored, args.clients, args.requests)}
            result["mixed"] = mixed(d, requests[20:40], requests[8:14])
        finally:
            d.stop()
    save("load", result)


if __name__ == "__main__":
    main()
