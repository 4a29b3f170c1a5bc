"""(c) A thundering herd: N processes start together, each needing the same kernels.

Each process first imports what an inference process already has (torch, through
TVM-FFI) and says it is ready; at one signal they all prefetch their kernels in one
message, then load them one by one. Measured: compilations the daemon ran, and wall time
from the signal until every process has loaded every kernel, against one process alone on
an empty daemon. With --include-imports the clock starts before the processes do, so
each one's own `import torch` counts too. With --python PATH the processes are that
environment's (e.g. .venv-vllm: vLLM 0.33.0's FlashInfer, DSL and TVM-FFI), the daemon
registers it as its only toolchain (its workers are that interpreter) and the kernels are
planned for it; the processes have only the client package on their path.
Usage: python bench/herd.py [--processes 8] [--kernels 24] [--include-imports] [--python PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cached_client import Client
from cached_client import protocol as p
from common import ROOT, SHAPE, Daemon, plan, save

PROCESS_SCRIPT = """
import json, sys, time
import tvm_ffi  # noqa: F401 -- an inference process has torch loaded already
from cached_client import Client, KernelRequest
requests = [KernelRequest.from_wire(w) for w in json.load(open(sys.argv[2]))]
client = Client(sys.argv[1], timeout=600)
print("ready", flush=True)
sys.stdin.readline()
client.prefetch(requests)
for r in requests:
    assert callable(client.load(r))
print(json.dumps({"done": time.time()}))
"""


def plan_for(socket: str, kernels: int) -> list[dict]:
    """The seed shape's tactics as the daemon's only toolchain plans them (its FlashInfer)."""
    t = Client(socket, timeout=60, identity=False).hello().toolchains[0]
    identity = p.Identity(toolchain=t["fingerprint"], sources=t["sources"], runtime=t["runtime"])
    requests = Client(socket, timeout=600, identity=identity).plan(
        "flashinfer.mm_fp4", SHAPE, "sm_100a", 148)
    return [r.to_wire() for r in requests[:kernels]]


def run(processes: int, wires: list[dict] | int, include_imports: bool = False,
        python: str | None = None) -> dict:
    """``wires``: the kernels, or how many of the seed shape's to plan with the daemon."""
    env = None
    if python is not None:
        env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
               "PYTHONPATH": str(ROOT / "client")}
    with tempfile.TemporaryDirectory() as workdir:
        path = Path(workdir) / "wires.json"
        extra = ["--toolchain", f"env={python}"] if python else []
        d = Daemon(Path(workdir), extra_args=extra)
        if isinstance(wires, int):
            wires = plan_for(d.socket, wires)
        path.write_text(json.dumps(wires))
        try:
            started = time.time()
            procs = [subprocess.Popen([python or sys.executable, "-c", PROCESS_SCRIPT, d.socket,
                                       str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True, env=env)
                     for _ in range(processes)]
            for p in procs:
                assert p.stdout.readline().strip() == "ready"
            if not include_imports:
                started = time.time()
            for p in procs:
                p.stdin.write("go\n")
                p.stdin.flush()
            ends = [json.loads(p.communicate()[0])["done"] for p in procs]
            assert all(p.returncode == 0 for p in procs)
            stats = d.stats()
            return {"processes": processes, "kernels": len(wires),
                    "wall_s": max(ends) - started, "compiles": stats["compiles"],
                    "hits": stats["hits"], "misses": stats["misses"],
                    "toolchains": [{k: t[k] for k in ("name", "python", "versions", "workers")}
                                   for t in stats["toolchains"]]}
        finally:
            d.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--kernels", type=int, default=24)
    parser.add_argument("--include-imports", action="store_true")
    parser.add_argument("--python", default=None,
                        help="the processes' environment (its interpreter); the daemon's "
                             "only toolchain")
    args = parser.parse_args()
    wires: list[dict] | int = args.kernels
    if args.python is None:
        wires = [r.to_wire() for r in plan(args.kernels)]
    one = run(1, wires, args.include_imports, args.python)
    herd = run(args.processes, wires if args.python is None else args.kernels,
               args.include_imports, args.python)
    name = "herd_with_imports" if args.include_imports else "herd"
    save(f"{name}_{Path(args.python).parents[1].name}" if args.python else name,
         {"one": one, "herd": herd, "ratio": herd["wall_s"] / one["wall_s"]})


if __name__ == "__main__":
    main()
