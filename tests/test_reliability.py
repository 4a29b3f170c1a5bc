"""Faults with real processes: daemon killed under load, worker killed mid-compile, a
full disk during publish, a locked SQLite index. Nothing corrupt is ever served."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import pytest
from cached_client import CachedError, Client, CompileFailed, KernelRequest
from conftest import DaemonProcess, wait_for

from cached.store.store import Store


def verify_store(root: Path) -> int:
    store = Store(root)
    store.scan()
    rows = store.rows()
    assert all(store.lookup(r.key) is not None for r in rows)
    store.close()
    return len(rows)


def _wait_and_retry(socket_path: str, wire: dict, deadline_s: float, out) -> None:
    """A client that keeps asking until its deadline: recovers once the daemon is back."""
    deadline = time.monotonic() + deadline_s
    request = KernelRequest.from_wire(wire)
    while time.monotonic() < deadline:
        try:
            art = Client(socket_path, timeout=max(0.5, deadline - time.monotonic()),
                         fallback=False).get(request)
            out.put(("ok", art.library_sha256))
            return
        except CachedError as exc:
            last = exc.code
            time.sleep(0.3)
    out.put(("gave_up", last))


def test_kill9_under_load_then_restart_recovers_clients_and_store(tmp_path, mm_fp4_requests):
    d = DaemonProcess(tmp_path)
    d.client().prefetch(mm_fp4_requests[40:60])
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    waiters = [ctx.Process(target=_wait_and_retry,
                           args=(d.socket, mm_fp4_requests[40 + i].to_wire(), 120, out))
               for i in range(8)]
    for w in waiters:
        w.start()
    wait_for(lambda: d.stats()["compiles"] >= 2)
    d.kill9()
    assert verify_store(tmp_path / "store") >= 2
    restarted = DaemonProcess(tmp_path)
    try:
        results = [out.get(timeout=150) for _ in waiters]
        assert all(status == "ok" for status, _ in results), results
        for w in waiters:
            w.join(10)
    finally:
        restarted.stop()
    assert verify_store(tmp_path / "store") >= 8


def test_worker_killed_from_outside_mid_compile_fails_only_its_job(daemon, mm_fp4_requests):
    client = daemon.client(timeout=120)
    errors: list[Exception] = []

    def ask(request: KernelRequest) -> None:
        try:
            client.get(request)
        except CompileFailed as exc:
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=(r,)) for r in mm_fp4_requests[60:62]]
    for t in threads:
        t.start()
    wait_for(lambda: daemon.stats()["running"] >= 1, 30)
    victim = daemon.worker_pids()[-1]
    os.kill(victim, signal.SIGKILL)
    for t in threads:
        t.join(120)
    assert len(errors) <= 1
    if errors:
        assert "SIGKILL" in errors[0].message
    wait_for(lambda: daemon.stats()["workers_ready"] == 2)
    assert daemon.client().get(mm_fp4_requests[60]).library_sha256


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_full_disk_during_publish_is_a_clear_error_and_service_resumes(
        tmp_path, small_disk, mm_fp4_requests):
    d = DaemonProcess(tmp_path, workers=1, store=small_disk / "store")
    try:
        client = d.client(timeout=120)
        failures = []
        for request in mm_fp4_requests[70:78]:
            try:
                client.get(request)
            except CompileFailed as exc:
                failures.append(exc.message)
        assert failures and any("No space left" in m for m in failures), failures
        assert verify_store(small_disk / "store") == d.stats()["entries"]
        subprocess.run(["mount", "-o", "remount,size=20m", str(small_disk)], check=True)
        art = client.get(mm_fp4_requests[77])
        assert art.origin in ("compiled", "hit")
    finally:
        d.stop()
    assert verify_store(small_disk / "store") >= 1


def test_locked_index_delays_publish_but_loses_nothing(daemon, mm_fp4_requests):
    conn = sqlite3.connect(daemon.store / "index.sqlite", timeout=1, check_same_thread=False)
    conn.execute("BEGIN EXCLUSIVE")
    released = threading.Timer(3.0, conn.rollback)
    released.start()
    art = daemon.client(timeout=120).get(mm_fp4_requests[80])
    released.join()
    conn.close()
    assert art.origin == "compiled"
    assert verify_store(daemon.store) == 1
