"""The vLLM plugin's part of a model load against a cold and a warm daemon (issue 26).

The H200 has no CuTe-DSL compiler, so a cold daemon cannot run there; this is the stand-in
on this machine. A fresh client process plans the four FP8 linear shapes of
Llama-3.1-8B (``plan_gemm``: sm_90a, an H200's 132 SMs, M up to 8192, what
``CachedFP8ScaledMMLinearKernel`` asks at model load) and gets and loads every bucket's
kernel (``Client.load_many``), three ways:

* cold: a daemon on an empty store, which compiles what the plans queue;
* warm: the same daemon again, every kernel stored;
* restarted: a new daemon process on the filled store (a node after a reboot).

``s`` is the client process's whole wall time from its first import (imports, connect, plans,
loads); ``plan_s`` the four ``plan_gemm`` calls (what the <= 0.5 s target is about).

Usage: python bench/plan_load.py [--scales tensor|token|block128] [--workers N]
Writes bench/out/plan_load.json; the last line printed is the same JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Daemon, save  # noqa: E402

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down
MAX_M = 8192

CLIENT = r"""
import json, sys, time
t0 = time.monotonic()
from cached_client import Client
from cached_client.gemm.plan import plan_gemm

socket, scales, shapes, max_m = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
c = Client(socket, timeout=1800)
per, planning = [], 0.0
for n, k in shapes:
    ts = time.monotonic()
    plan = plan_gemm(c, n, k, arch="sm_90a", sm_count=132, device="NVIDIA H200",
                     max_m=max_m, scales=scales)
    tp = time.monotonic()
    planning += tp - ts
    requests = [b.request for b in plan.choice.buckets]
    if hasattr(c, "load_many"):
        fns = c.load_many(requests, 1800)
    else:  # a client from before load_many
        fns = [c.load(r, 1800) for r in requests]
    per.append({"n": n, "k": k, "buckets": len(fns), "plan_s": round(tp - ts, 3),
                "s": round(time.monotonic() - ts, 3)})
print(json.dumps({"s": round(time.monotonic() - t0, 3), "plan_s": round(planning, 3),
                  "shapes": per}))
"""


def client_run(socket: str, scales: str) -> dict:
    """One fresh client process: plan and load the four shapes; its timings."""
    out = subprocess.run([sys.executable, "-c", CLIENT, socket, scales, json.dumps(SHAPES),
                          str(MAX_M)],
                         capture_output=True, text=True, timeout=3600)
    if out.returncode:
        raise SystemExit(f"client failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scales", default="tensor", choices=("tensor", "token", "block128"))
    ap.add_argument("--workers", type=int, default=2)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="plan-load-") as tmp:
        work = Path(tmp)
        d = Daemon(work, workers=a.workers)
        try:
            cold = client_run(d.socket, a.scales)
            compiled = d.stats().get("compiles")
            warm = client_run(d.socket, a.scales)
        finally:
            d.stop()
        d = Daemon(work, workers=a.workers)
        try:
            restarted = client_run(d.socket, a.scales)
            recompiled = d.stats().get("compiles")
        finally:
            d.stop()
    result = {"scales": a.scales, "workers": a.workers, "max_m": MAX_M,
              "cold": cold, "compiles_cold": compiled, "warm": warm, "restarted": restarted,
              "compiles_after_restart": recompiled}
    save("plan_load", result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
