"""Shared fixtures: a real daemon process on a real Unix socket with a real store."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cached_client import Client, KernelRequest

ROOT = Path(__file__).resolve().parents[1]
SHAPE = (256, 1024, 7168)


class DaemonProcess:
    """``cached serve`` in a subprocess; ``client()`` talks to it over its socket. ``wrap``:
    a command that runs it (e.g. ``setpriv`` dropping capabilities); ``cwd``: its working
    directory (``python -m`` imports from it first)."""

    def __init__(self, tmp: Path, workers: int = 2, job_timeout: float = 120.0,
                 store: Path | None = None, extra_env: dict | None = None,
                 extra_args: list[str] | None = None, wrap: list[str] | None = None,
                 ready_workers: int | None = None, cwd: Path | None = None) -> None:
        self.tmp = tmp
        self.store = store or tmp / "store"
        self.socket = str(tmp / "cached.sock")
        self.log_path = tmp / f"daemon-{time.monotonic_ns()}.log"
        env = {**os.environ, "CACHED_TEST_FAMILIES": "1", **(extra_env or {})}
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [*(wrap or []), sys.executable, "-m", "cached", "serve", "--store", str(self.store),
             "--socket", self.socket, "--http", "127.0.0.1:0", "--workers", str(workers),
             "--job-timeout", str(job_timeout), *(extra_args or [])],
            env=env, stdout=self._log, stderr=subprocess.STDOUT, cwd=cwd,
        )
        self.wait_ready(workers if ready_workers is None else ready_workers)

    def client(self, **kwargs) -> Client:
        return Client(self.socket, **kwargs)

    def stats(self) -> dict:
        return self.client(timeout=10).stats()

    def wait_ready(self, workers: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}: {self.log()}")
            try:
                if self.stats()["workers_ready"] >= workers:
                    return
            except Exception:  # noqa: BLE001 -- not up yet
                pass
            time.sleep(0.2)
        raise TimeoutError(f"daemon not ready: {self.log()}")

    def log(self) -> str:
        return self.log_path.read_text()[-4000:]

    def worker_pids(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True,
                             text=True).stdout
        return [int(p) for p in out.split()]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self._log.close()


@pytest.fixture
def daemon(tmp_path: Path):
    d = DaemonProcess(tmp_path)
    yield d
    d.stop()


@pytest.fixture(scope="session")
def mm_fp4_requests(tmp_path_factory) -> list[KernelRequest]:
    """The NVFP4 tactic space of SHAPE on sm_100a, as the daemon plans it."""
    out = subprocess.run(
        [sys.executable, "-c", PLAN_SCRIPT], capture_output=True, text=True, check=True,
    ).stdout
    return [KernelRequest.from_wire(r) for r in json.loads(out)]


PLAN_SCRIPT = f"""
import json
from cached.families import get
reqs = get("flashinfer.mm_fp4").plan({SHAPE!r}, "sm_100a", 148, {{}})
print(json.dumps([r.to_wire() for r in reqs]))
"""


def fault(action: str, tag: str = "", seconds: float = 0.0) -> KernelRequest:
    return KernelRequest(family="cached.test.fault",
                         params={"action": action, "tag": tag, "seconds": seconds},
                         arch="sm_100a", sm_count=148, max_active_clusters=148)


def wait_for(predicate, timeout: float = 60.0) -> None:
    """Poll ``predicate`` every 0.1 s; fail the test if it is not true within ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


def raw_call(socket_path: str, message: dict, timeout: float = 30.0) -> dict:
    """One request as raw JSON on a fresh connection (for fields the typed client never
    sends); returns the reply object as it came."""
    from cached_client.transport import Connection

    deadline = time.monotonic() + timeout
    with Connection(socket_path, deadline) as conn:
        reply, _ = conn.request({"id": 1, **message}, deadline)
    return reply


def run_cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cached", *args], capture_output=True,
                          text=True, check=check, timeout=600)


def serve_once(path: str, reply_for, hello: bool = False) -> threading.Thread:
    """A peer that is not a daemon: answers one request on ``path`` with
    ``reply_for(request)``, then closes; with ``hello``, answers the ``hello`` a client
    sends before its first ``get`` first, as today's daemon would."""
    from cached_client import protocol as p

    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(1)

    def run() -> None:
        conn, _ = server.accept()
        with conn:
            while True:
                header = conn.recv(4, socket.MSG_WAITALL)
                message = p.decode_body(conn.recv(int.from_bytes(header, "big"),
                                                  socket.MSG_WAITALL))
                if not (hello and message.get("op") == "hello"):
                    break
                conn.sendall(p.encode_frame({"id": message["id"], "ok": True, "v": 1,
                                             "ops": sorted(p.OPS),
                                             "capabilities": list(p.CAPABILITIES)}))
            conn.sendall(p.encode_frame(reply_for(message)))
        server.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread
