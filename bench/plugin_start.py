"""What the vLLM plugin costs a starting process: its ``register()`` (what vLLM's
``load_general_plugins()`` runs in every process it starts) against a daemon that is live,
absent or hung (SIGSTOPped), with the client package of a checkout (``--client DIR``, e.g.
another worktree's ``client`` to compare before and after). Each run is a fresh process;
the time is measured inside it around ``register()`` alone (imports of the client
included, since ``register`` makes them).

    .venv/bin/python bench/plugin_start.py --runs 5
    .venv/bin/python bench/plugin_start.py --runs 5 --client /path/to/other/checkout/client
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, Daemon

PROBE = """
import json, time
from importlib.metadata import entry_points
ep = {e.name: e for e in entry_points(group="vllm.general_plugins")}["cached"]
register = ep.load()
t0 = time.perf_counter()
register()
print(json.dumps({"register_s": time.perf_counter() - t0}))
"""


def _once(sock: str, client: Path) -> float:
    env = {**os.environ, "CACHED_SOCKET": sock, "PYTHONPATH": str(client)}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         env=env, timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["register_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="fresh processes per case")
    ap.add_argument("--client", type=Path, default=ROOT / "client",
                    help="the client package directory to put on the processes' path")
    args = ap.parse_args()
    out: dict = {"client": str(args.client), "runs": args.runs}
    with tempfile.TemporaryDirectory() as tmp:
        d = Daemon(Path(tmp), workers=1)
        try:
            cases = {"live": d.socket, "absent": str(Path(tmp) / "none.sock")}
            for name, sock in cases.items():
                out[name] = [_once(sock, args.client) for _ in range(args.runs)]
            os.kill(d.proc.pid, signal.SIGSTOP)
            try:
                out["hung"] = [_once(d.socket, args.client) for _ in range(args.runs)]
            finally:
                os.kill(d.proc.pid, signal.SIGCONT)
        finally:
            d.stop()
    for name in ("live", "absent", "hung"):
        xs = out[name]
        print(f"{name:7s} register() median {statistics.median(xs):.3f} s "
              f"(min {min(xs):.3f}, max {max(xs):.3f}, {len(xs)} processes)")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
