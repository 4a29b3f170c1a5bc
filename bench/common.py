"""Helpers shared by the benchmarks: a daemon process, the seed shape's tactics, output."""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

from cached_client import Client, KernelRequest

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
SHAPE = (256, 1024, 7168)


def plan(limit: int | None = None, shape: tuple[int, int, int] = SHAPE) -> list[KernelRequest]:
    """The NVFP4 mm_fp4 tactic space of ``shape`` on sm_100a (B200: 148 SMs), planned here."""
    code = ("import json,sys; from cached.families import get; "
            f"r = get('flashinfer.mm_fp4').plan({shape!r}, 'sm_100a', 148, {{}}); "
            "print(json.dumps([x.to_wire() for x in r]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    requests = [KernelRequest.from_wire(w) for w in json.loads(out)]
    return requests[:limit] if limit else requests


class Daemon:
    def __init__(self, workdir: Path, workers: int | None = None,
                 store: Path | None = None, extra_args: tuple[str, ...] = ()) -> None:
        self.socket = str(workdir / "cached.sock")
        args = [sys.executable, "-m", "cached", "serve", "--store", str(store or workdir / "store"),
                "--socket", self.socket, "--no-http", *extra_args]
        if workers:
            args += ["--workers", str(workers)]
        self.started = time.monotonic()
        self.log = open(workdir / "daemon.log", "w")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        self.ready_seconds = self._wait_ready()

    def _wait_ready(self) -> float:
        while True:
            try:
                stats = Client(self.socket, timeout=5).stats()
                if stats["workers_ready"] == stats["workers"]:
                    return time.monotonic() - self.started
            except Exception:  # noqa: BLE001 -- not up yet
                if self.proc.poll() is not None:
                    raise RuntimeError("daemon exited") from None
            time.sleep(0.1)

    def stats(self) -> dict:
        return Client(self.socket, timeout=10).stats()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)
        self.log.close()


def machine() -> dict:
    return {"cpus": os.cpu_count(), "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d"), "host": platform.node()}


def save(name: str, result: dict) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **result}, indent=2))
    print(json.dumps(result, indent=2))
    return path


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]
