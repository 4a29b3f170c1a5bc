"""(a) Cold: compile every NVFP4 mm_fp4 tactic of m=256, n=1024, k=7168 on sm_100a, three ways.

FlashInfer serial (a fresh process, ``build_and_load_cute_dsl_kernel`` with its disk
cache), FlashInfer's spawn pool (``_run_mm_fp4_precompile_pool``), and the daemon (a
``cached warm`` against a daemon whose workers are up; its start-up is reported apart).
Each path starts from an empty cache. Usage: python bench/cold.py [--limit N]
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

from common import ROOT, Daemon, plan, save


def flashinfer(mode: str, wires: list[dict], env: dict) -> dict:
    with tempfile.TemporaryDirectory() as workspace:
        path = Path(workspace) / "wires.json"
        path.write_text(json.dumps(wires))
        started = time.monotonic()
        out = subprocess.run(
            [sys.executable, str(ROOT / "bench" / "flashinfer_paths.py"), mode, str(path)],
            env={**os.environ, **env, "FLASHINFER_WORKSPACE_BASE": workspace},
            capture_output=True, text=True, check=True)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        result["wall_s"] = time.monotonic() - started
        return result


def daemon_path(wires: list[dict], workers: int | None) -> dict:
    with tempfile.TemporaryDirectory() as workdir:
        d = Daemon(Path(workdir), workers)
        try:
            requests_file = Path(workdir) / "requests.json"
            requests_file.write_text(json.dumps(wires))
            started = time.monotonic()
            code = ("import json,sys; from cached.cli.warm import warm; "
                    "from cached_client import KernelRequest; "
                    "r=[KernelRequest.from_wire(w) for w in json.load(open(sys.argv[2]))]; "
                    "print(json.dumps(warm(sys.argv[1], r, 3600)))")
            out = subprocess.run([sys.executable, "-c", code, d.socket, str(requests_file)],
                                 capture_output=True, text=True, check=True)
            wall = time.monotonic() - started
            counts = json.loads(out.stdout)
            stats = d.stats()
            return {"wall_s": wall, "daemon_start_s": d.ready_seconds, **counts,
                    "workers": stats["workers"], "compile_seconds": stats["compile_seconds"]}
        finally:
            d.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args()
    wires = [r.to_wire() for r in plan(args.limit)]
    result = {"kernels": len(wires), "shape": [256, 1024, 7168], "arch": "sm_100a"}
    result["daemon"] = daemon_path(wires, args.workers)
    workers = str(result["daemon"]["workers"])
    result["flashinfer_pool"] = flashinfer("pool", wires, {
        "FLASHINFER_MM_FP4_CUTE_DSL_COMPILE_WORKERS": workers})
    result["flashinfer_pool_default"] = flashinfer("pool", wires, {})
    result["flashinfer_serial"] = flashinfer("serial", wires, {})
    serial = result["flashinfer_serial"]["wall_s"]
    result["ratio_daemon_to_serial"] = result["daemon"]["wall_s"] / serial
    result["ratio_daemon_to_pool"] = (result["daemon"]["wall_s"]
                                      / result["flashinfer_pool"]["wall_s"])
    save("cold", result)


if __name__ == "__main__":
    main()
