"""Load: 64 concurrent clients x 1000 requests, all hits, alone and next to hostile peers;
then a mixed load with misses.

Hits: 8 processes x 8 threads (``--threads 1``: 64 processes of one thread), each thread
its own connection, each request a `get` of
one of 8 stored kernels (the client's default transfer, descriptors). Each thread's first
`get` (connecting; the process's identity computed once) is timed apart (``first_get_*``);
then all 64 start their timed `get`s together. Reports p50/p99 latency, errors, the
daemon's CPU per request (user + system, over the timed gets) and its RSS before, at its
peak (sampled every 0.1 s) and after.
The same hits run three times: alone; next to slow readers (8 connections each
pipelining 4,000 `get`s with transfer "bytes" and never reading a reply); and next to a
partial-frame flood (1,000 connections each sending a 1 MiB header and all but the last
byte of its body, and holding it). The hostile peers run as another uid (`nobody`; the
daemon's socket is 0666 for it), as a hostile local user would. Mixed: 20 kernels queued
as pre-warm work, then 16 clients asking at once for 6 other kernels (4 overlapping):
compilations must equal distinct kernels, and the waiting clients must finish before the
pre-warm backlog.
Usage: python bench/load.py [--clients 64] [--requests 1000] [--transfer fd|path] [--threads 8]
(as root, for the other uid)
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cached_client import Client, KernelRequest  # noqa: F401
from common import Daemon, percentile, plan, save

from cached.cli.warm import warm

WORKER = """
import json, sys, threading, time
from cached_client import Client, KernelRequest  # noqa: F401
sock, threads, n, transfer = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
requests = [KernelRequest.from_wire(w) for w in json.loads(sys.stdin.readline())]
lat, first, errors = [], [], []
clients = [Client(sock, timeout=30, transfer=transfer) for _ in range(threads)]
def warm(t):  # connects, and computes this process's identity once: timed apart
    t0 = time.perf_counter()
    clients[t].get(requests[t % len(requests)])
    first.append(time.perf_counter() - t0)
ws = [threading.Thread(target=warm, args=(t,)) for t in range(threads)]
[w.start() for w in ws]; [w.join() for w in ws]
print("ready", flush=True)
sys.stdin.readline()  # all processes start the timed gets together
def run(t):
    c = clients[t]
    for i in range(n):
        t0 = time.perf_counter()
        try:
            c.get(requests[(i + t) % len(requests)])
            lat.append(time.perf_counter() - t0)
        except Exception as e:
            errors.append(repr(e))
ts = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
[t.start() for t in ts]; [t.join() for t in ts]
print(json.dumps({"lat": lat, "first": first, "errors": errors[:5], "n_errors": len(errors)}))
"""


HOSTILE = """
import json, os, resource, signal, socket, struct, sys, time
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
kind, path, n, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
if kind == "slow":
    request = json.loads(sys.stdin.read())
    one = json.dumps({"op": "get", "transfer": "bytes", "request": request}).encode()
    data = b"".join(struct.pack(">I", len(one)) + one for _ in range(4000))
else:
    data = struct.pack(">I", 1 << 20) + b"x" * ((1 << 20) - 1)
conns, left, refused = [], {}, 0
for _ in range(n):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
    except OSError:
        refused += 1
        continue
    s.setblocking(False)
    conns.append(s)
    left[s] = memoryview(data)
print("ready", flush=True)
sent, deadline = 0, time.monotonic() + seconds
while not stop and time.monotonic() < deadline:
    moved = 0
    for s in conns:
        if left[s]:
            try:
                k = s.send(left[s])
            except (BlockingIOError, OSError):
                continue
            left[s] = left[s][k:]
            moved += k
    sent += moved
    if not moved:
        time.sleep(0.05)
print(json.dumps({"connections": len(conns), "connect_refused": refused, "bytes_sent": sent}))
"""


class RssSampler:
    """The daemon's RSS every 0.1 s while it runs; ``peak`` in KiB."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, rss_kib(pid), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.peak = max(self.peak, rss_kib(self.pid))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def hostile(d: Daemon, kind: str, request: KernelRequest, seconds: float) -> subprocess.Popen:
    """Hostile peers as uid ``nobody``: ``slow`` readers or a partial-``flood``."""
    nobody = pwd.getpwnam("nobody")
    n = {"slow": 8, "flood": 1000}[kind]
    python = shutil.which("python3", path="/usr/bin:/bin")  # stdlib only; any uid runs it
    proc = subprocess.Popen([python, "-c", HOSTILE, kind, d.socket, str(n),
                             str(seconds)], user=nobody.pw_uid, group=nobody.pw_gid,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    proc.stdin.write(json.dumps(request.to_wire()))
    proc.stdin.close()
    assert proc.stdout.readline().strip() == "ready"
    return proc


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) the process has used, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def hits(d: Daemon, requests: list[KernelRequest], clients: int, per_client: int,
         against: str | None = None, transfer: str = "fd", threads: int = 8) -> dict:
    procs = clients // threads
    wires = json.dumps([r.to_wire() for r in requests])
    loadavg = os.getloadavg()[0]  # anything else running on the machine shows here
    before = rss_kib(d.proc.pid)
    bad = hostile(d, against, requests[0], 600) if against else None
    time.sleep(2 if against else 0)  # the hostile peers are in place
    sampler = RssSampler(d.proc.pid)
    ps = [subprocess.Popen([sys.executable, "-c", WORKER, d.socket, str(threads),
                            str(per_client), transfer], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True) for _ in range(procs)]
    for p in ps:  # each process connected and its identity computed: then all at once
        p.stdin.write(wires + "\n")
        p.stdin.flush()
    for p in ps:
        assert p.stdout.readline().strip() == "ready"
    started, cpu_before = time.monotonic(), cpu_seconds(d.proc.pid)
    outs = [json.loads(p.communicate("go\n")[0]) for p in ps]
    wall, daemon_cpu = time.monotonic() - started, cpu_seconds(d.proc.pid) - cpu_before
    peak = sampler.stop()
    hostile_report = None
    if bad is not None:
        bad.terminate()
        out = bad.stdout.read()
        bad.wait()
        hostile_report = {"kind": against, **json.loads(out.strip().splitlines()[-1])}
    time.sleep(2)
    lat = [v * 1000 for o in outs for v in o["lat"]]
    first = [v * 1000 for o in outs for v in o["first"]]
    return {"clients": procs * threads, "processes": procs,
            "requests": len(lat) + sum(o["n_errors"] for o in outs),
            "errors": sum(o["n_errors"] for o in outs),
            "error_samples": [e for o in outs for e in o["errors"]][:5],
            "p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99), "max_ms": max(lat),
            "first_get_p50_ms": percentile(first, 50), "first_get_max_ms": max(first),
            "wall_s": wall, "throughput_rps": len(lat) / wall,
            "daemon_cpu_us_per_request": daemon_cpu / max(1, len(lat)) * 1e6,
            "rss_kib_before": before,
            "rss_kib_peak": peak, "rss_kib_after": rss_kib(d.proc.pid),
            "loadavg_1min_before": loadavg, "hostile": hostile_report}


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
    parser.add_argument("--transfer", choices=("fd", "path"), default="fd",
                        help="how the clients take the kernel (fd: the default, descriptors "
                             "and a private verified copy; path: the store's path)")
    parser.add_argument("--threads", type=int, default=8,
                        help="client threads per process (clients / threads processes); "
                             "1: every client its own process")
    args = parser.parse_args()
    requests = plan()
    with tempfile.TemporaryDirectory() as workdir:
        os.chmod(workdir, 0o755)  # the hostile peers' uid reaches the socket
        d = Daemon(Path(workdir), extra_args=("--socket-mode", "666"))
        try:
            stored = requests[:8]
            warm(d.socket, stored, 600)
            result = {"transfer": args.transfer, "threads_per_process": args.threads,
                      "hits": hits(d, stored, args.clients, args.requests,
                                   transfer=args.transfer, threads=args.threads)}
            print(json.dumps(result["hits"]), flush=True)
            for kind in ("slow", "flood"):
                result[f"hits_with_{kind}"] = hits(d, stored, args.clients, args.requests, kind,
                                                   args.transfer, args.threads)
                print(json.dumps(result[f"hits_with_{kind}"]), flush=True)
            result["mixed"] = mixed(d, requests[20:40], requests[8:14])
        finally:
            d.stop()
    name = "load" if args.transfer == "fd" else f"load_{args.transfer}"
    save(name if args.threads == 8 else f"{name}_{args.threads}t", result)


if __name__ == "__main__":
    main()
