"""(c) A thundering herd: N processes start together, each needing the same kernels.

Each process first imports what an inference process already has (torch, through
TVM-FFI) and says it is ready; at one signal they all prefetch their kernels in one
message, then load them one by one. Measured: compilations the daemon ran, and wall time
from the signal until every process has loaded every kernel, against one process alone on
an empty daemon. With --include-imports the clock starts before the processes do, so
each one's own `import torch` counts too.
Usage: python bench/herd.py [--processes 8] [--kernels 24] [--include-imports]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import Daemon, plan, save

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


def run(processes: int, wires: list[dict], include_imports: bool = False) -> dict:
    with tempfile.TemporaryDirectory() as workdir:
        path = Path(workdir) / "wires.json"
        path.write_text(json.dumps(wires))
        d = Daemon(Path(workdir))
        try:
            started = time.time()
            procs = [subprocess.Popen([sys.executable, "-c", PROCESS_SCRIPT, d.socket, str(path)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
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
                    "hits": stats["hits"], "misses": stats["misses"]}
        finally:
            d.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--kernels", type=int, default=24)
    parser.add_argument("--include-imports", action="store_true")
    args = parser.parse_args()
    wires = [r.to_wire() for r in plan(args.kernels)]
    one = run(1, wires, args.include_imports)
    herd = run(args.processes, wires, args.include_imports)
    save("herd_with_imports" if args.include_imports else "herd",
         {"one": one, "herd": herd, "ratio": herd["wall_s"] / one["wall_s"]})


if __name__ == "__main__":
    main()
