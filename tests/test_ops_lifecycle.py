"""Lifecycle and the store budget, with real compiles: SIGHUP reload, LRU eviction
during a warm-up larger than the budget, `cached gc` and `cached verify`, and SIGTERM
during a warm-up."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from conftest import SHAPE, DaemonProcess, run_cli

from cached.store.store import Store

BUDGET = 500_000  # about four mm_fp4 kernels (~117 KB each: object + library)


def _events(d: DaemonProcess) -> list[dict]:
    lines = d.log_path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def _wait(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


def _manifest(path: Path, limit: int) -> Path:
    m, n, k = SHAPE
    path.write_text(f'[model]\nname = "test"\nm = [{m}]\n'
                    f'[[layer]]\nname = "proj"\nn = {n}\nk = {k}\n'
                    f'[[build]]\nfamily = "flashinfer.mm_fp4"\ntargets = ["sm_100a"]\n'
                    f"limit = {limit}\n")
    return path


def test_eviction_keeps_a_reloaded_budget_during_a_larger_warm_up(tmp_path, mm_fp4_requests):
    config = tmp_path / "cached.toml"
    config.write_text("max_bytes = 0\nevict_grace = 1\n")
    d = DaemonProcess(tmp_path, extra_args=["--config", str(config)])
    try:
        hot = mm_fp4_requests[0]
        client = d.client(timeout=120)
        assert client.get(hot).origin == "compiled"
        config.write_text(f"max_bytes = {BUDGET}\nevict_grace = 1\n")  # SIGHUP applies it
        d.proc.send_signal(signal.SIGHUP)
        _wait(lambda: d.stats()["max_bytes"] == BUDGET)
        assert any(e["event"] == "daemon.reloaded" for e in _events(d))

        warm = subprocess.Popen(
            [sys.executable, "-m", "cached", "warm", "--socket", d.socket, "--manifest",
             str(_manifest(tmp_path / "m.toml", 10)), "--json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        sizes, origins, errors = [], [], []

        def keep_using_hot() -> None:  # an inference process using one kernel all along
            c = d.client(timeout=120)
            while warm.poll() is None:
                try:
                    origins.append(c.get(hot).origin)
                    sizes.append(d.stats()["bytes"])
                except Exception as exc:  # noqa: BLE001 -- any failure fails the test
                    errors.append(repr(exc))
                time.sleep(0.1)

        user = threading.Thread(target=keep_using_hot)
        user.start()
        out, err = warm.communicate(timeout=300)
        user.join()
        counts = json.loads(out.strip().splitlines()[-1])
        assert warm.returncode == 0 and counts["failed"] == 0, err
        assert counts["compiled"] + counts["cached"] == counts["total"] == 10
        assert not errors and origins and set(origins) == {"hit"}  # never evicted: in use
        assert max(sizes) <= BUDGET
        stats = d.stats()
        assert stats["evictions"] >= 5 and stats["bytes"] <= BUDGET
        assert stats["entries"] * 117_000 > BUDGET * 0.5
        assert stats["errors"] == {}

        verified = json.loads(run_cli("verify", "--socket", d.socket, "--json").stdout)
        assert verified["verified"] == stats["entries"] and not verified["bad"]
        assert verified["orphan_blobs"] == 0

        gc = json.loads(run_cli("gc", "--socket", d.socket, "--max-bytes", "250000",
                                "--grace", "0", "--json").stdout)
        assert gc["evicted"] >= 1 and gc["bytes"] <= 250_000
        blobs = list((d.store / "blobs").glob("*/*"))
        assert len(blobs) == 2 * d.stats()["entries"]  # evicted blobs are gone from disk
    finally:
        d.stop()


def test_sigterm_during_a_warm_up_drains_and_loses_no_finished_artifact(tmp_path):
    d = DaemonProcess(tmp_path, extra_args=["--drain-timeout", "30"])
    warm = subprocess.Popen(
        [sys.executable, "-m", "cached", "warm", "--socket", d.socket, "--family",
         "flashinfer.mm_fp4", "--arch", "sm_100a", "--shape", ",".join(map(str, SHAPE)),
         "--limit", "10", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait(lambda: d.stats()["compiles"] >= 2 and d.stats()["running"] >= 1, timeout=120)
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(60) == 0
        out, err = warm.communicate(timeout=60)
    finally:
        d.stop()
        if warm.poll() is None:
            warm.kill()
    counts = json.loads(out.strip().splitlines()[-1])
    assert counts["failed"] >= 1 and counts["compiled"] >= 2, counts
    assert all("shutting down" in e for e in counts["errors"]), counts["errors"]

    events = _events(d)  # structured logs: one JSON object per line
    names = [e["event"] for e in events]
    assert names.index("daemon.stopping") < names.index("daemon.drained") < names.index(
        "daemon.stopped")
    drained = next(e for e in events if e["event"] == "daemon.drained")
    assert drained["finished"] >= 1 and drained["abandoned"] == 0
    done = {e["key"] for e in events if e["event"] == "compile.done"}
    assert len(done) >= counts["compiled"]  # every reply the warm-up got was stored

    result = run_cli("verify", "--store", str(d.store), "--json")
    report = json.loads(result.stdout)
    assert not report["bad"] and report["verified"] == len(done)
    store = Store(d.store)
    try:
        stored = {r.key[:16] for r in store.rows()}
    finally:
        store.close()
    assert done == stored  # every finished compilation is in the store, nothing else
