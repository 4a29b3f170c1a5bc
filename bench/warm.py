"""(b) Warm: get+load latency per kernel through the client, against FlashInfer's disk hit.

Both caches are filled first (the daemon's by a warm-up, FlashInfer's by its serial
path). Then, in a fresh process each, every kernel is loaded once: through
``Client.load`` with each transfer (``fd``: descriptors passed, private copies, digest
check, ``tvm_ffi.load_module``; ``path``; ``bytes``), and through FlashInfer's disk cache:
``build_and_load_cute_dsl_kernel`` on a hit (``flashinfer_disk_hit``: what its callers pay,
the sources hashed and the DSL version read included) and ``JitSpecCuteDsl.try_load``
alone (``flashinfer_try_load``: the object load, without them). Module imports are done before
timing in both. Each transfer runs in a process with an empty scratch directory
(``client_<transfer>``: private copies made, the stack's digests computed) and then in a
second process with the same one (``client_<transfer>_again``: what a node's next process
finds); ``--runs`` repeats the client processes against the one warmed daemon.
Usage: python bench/warm.py [--limit N] [--runs R] [--name NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, Daemon, percentile, plan, save

CLIENT_SCRIPT = """
import json, sys, time
import tvm_ffi  # imported before timing, as FlashInfer's side imports cutlass first
from cached_client import Client, KernelRequest
requests = [KernelRequest.from_wire(w) for w in json.load(open(sys.argv[2]))]
client = Client(sys.argv[1], transfer=sys.argv[3])
client.hello()
latencies = []
for r in requests:
    t = time.perf_counter()
    fn = client.load(r)
    latencies.append(time.perf_counter() - t)
    assert callable(fn)
print(json.dumps({"latencies_s": latencies}))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--limit", type=int, default=48)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--name", default="warm", help="bench/out/NAME.json")
    args = parser.parse_args()
    wires = [r.to_wire() for r in plan(args.limit)]
    result: dict = {"kernels": len(wires), "runs": args.runs}
    names = []
    with tempfile.TemporaryDirectory() as workdir:
        path = Path(workdir) / "wires.json"
        path.write_text(json.dumps(wires))
        d = Daemon(Path(workdir))
        try:
            code = ("import json,sys; from cached.cli.warm import warm; "
                    "from cached_client import KernelRequest; "
                    "print(warm(sys.argv[1], [KernelRequest.from_wire(w) for w in "
                    "json.load(open(sys.argv[2]))], 3600))")
            subprocess.run([sys.executable, "-c", code, d.socket, str(path)], check=True,
                           capture_output=True)
            for run in range(args.runs):
                for transfer in ("fd", "path", "bytes"):
                    scratch = Path(workdir) / f"scratch-{transfer}-{run}"  # empty at first
                    scratch.mkdir()
                    for again in ("", "_again"):
                        out = subprocess.run(
                            [sys.executable, "-c", CLIENT_SCRIPT, d.socket, str(path),
                             transfer], capture_output=True, text=True, check=True,
                            env={**os.environ, "TMPDIR": str(scratch)})
                        name = f"client_{transfer}{again}" + (f"_run{run}" if run else "")
                        result[name] = json.loads(out.stdout)
                        names.append(name)
        finally:
            d.stop()
        workspace = Path(workdir) / "fi"
        workspace.mkdir()
        env = {"FLASHINFER_WORKSPACE_BASE": str(workspace)}
        subprocess.run([sys.executable, str(ROOT / "bench" / "flashinfer_paths.py"), "serial",
                        str(path)], env={**os.environ, **env}, check=True, capture_output=True)
        for mode in ("try_load", "disk_hit"):
            out = subprocess.run([sys.executable, str(ROOT / "bench" / "flashinfer_paths.py"),
                                  mode, str(path)], env={**os.environ, **env},
                                 capture_output=True, text=True, check=True)
            result[f"flashinfer_{mode}"] = json.loads(out.stdout.strip().splitlines()[-1])
            names.append(f"flashinfer_{mode}")
    for name in names:
        lat = [v * 1000 for v in result[name]["latencies_s"]]
        result[name].update(p50_ms=percentile(lat, 50), p99_ms=percentile(lat, 99),
                            first_ms=lat[0])
    save(args.name, result)
    for name in names:
        r = result[name]
        print(f"{name:28s} p50 {r['p50_ms']:6.2f} ms  p99 {r['p99_ms']:6.2f} ms  "
              f"first {r['first_ms']:6.1f} ms")


if __name__ == "__main__":
    main()
