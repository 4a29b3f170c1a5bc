"""Store eviction and verification, on synthetic blobs (fast, no daemon), and one process
per store (a real daemon, a second serve, offline gc and verify)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from conftest import DaemonProcess, fault, run_cli
from test_store import K, publish

from cached.store.store import Budget, Store


def test_lru_eviction_keeps_the_budget_and_spares_recent_and_shared_blobs(tmp_path):
    store = Store(tmp_path, Budget(grace=0.0))
    payload = b"p" * 1000
    for i in range(4):
        publish(store, f"k{i}", payload + bytes([i]))
        time.sleep(0.01)
    one = store.totals()[1] // 4
    store.set_budget(Budget(max_bytes=3 * one, grace=0.0))
    store.lookup(K("k0"))  # k0 is now the most recently used
    publish(store, "k4", payload + bytes([4]))
    keys = {r.key for r in store.rows()}
    assert keys == {K("k0"), K("k3"), K("k4")} and store.totals()[1] <= store.budget.max_bytes
    assert store.evictions == 2 and not store.over_budget
    assert len(list(store.blob_dir.glob("*/*"))) == 6
    # An entry sharing its blobs with the victim keeps them.
    publish(store, "k5", payload + bytes([0]))  # same bytes as k0
    time.sleep(0.01)
    store.lookup(K("k5"))
    report = store.evict(max_bytes=one)
    assert report["evicted"] == 2 and {r.key for r in store.rows()} == {K("k5")}
    assert store.lookup(K("k5")) is not None  # k0's eviction left the shared blobs
    # The configured budget is hard: an entry used within the grace period goes too when
    # nothing else would make room (issue 16 item 13).
    store.set_budget(Budget(max_bytes=one, grace=60.0))
    publish(store, "k6", payload + bytes([6]))
    assert {r.key for r in store.rows()} == {K("k6")} and not store.over_budget
    # A one-off gc with its own limits spares what was used within the grace period.
    assert store.evict(max_bytes=1)["blocked"] == 1 and store.contains(K("k6"))
    assert store.evict(max_bytes=1, grace=0.0)["evicted"] == 1 and store.totals() == (0, 0)


def test_verify_reports_and_drops_bad_entries(tmp_path):
    store = Store(tmp_path)
    good, bad = publish(store, "good", b"g"), publish(store, "bad", b"b")
    bad.library_path.chmod(0o644)
    bad.library_path.write_bytes(b"tampered")
    (store.blob_dir / "ff").mkdir()
    (store.blob_dir / "ff" / "ff00.so").write_bytes(b"stray")
    report = store.verify()
    assert report["checked"] == 2 and report["verified"] == 1
    assert [b["key"] for b in report["bad"]] == [K("bad")]
    assert "digest" in report["bad"][0]["reason"]
    assert report["orphan_blobs"] >= 1
    assert {r.key for r in store.rows()} == {K("good")}
    assert store.verify()["bad"] == [] and good.library_path.exists()


def test_one_process_per_store_a_second_serve_and_offline_commands_refuse_a_live_store(
        tmp_path):
    """A store lock (cached/store/lock.py): a second serve on a live store, and gc/verify
    --store on it, refuse with one line naming the daemon and touch nothing; after the
    daemon is killed (-9: the kernel drops the lock) the offline commands work."""
    d = DaemonProcess(tmp_path, workers=1)
    try:
        assert d.client(timeout=60).get(fault("build", tag="lock")).origin == "compiled"
        other = tmp_path / "other.sock"
        second = subprocess.run(
            [sys.executable, "-m", "cached", "serve", "--store", str(d.store), "--socket",
             str(other), "--workers", "1"], capture_output=True, text=True, timeout=120,
            env={**os.environ, "CACHED_TEST_FAMILIES": "1"})
        lines = second.stderr.strip().splitlines()
        assert second.returncode == 2 and len(lines) == 1, second.stderr
        assert (f"store {d.store} is in use by cached serve (pid {d.proc.pid}, socket "
                f"{d.socket}): one process per store") in lines[0], lines
        assert "Traceback" not in second.stderr and not other.exists()
        for command in ("gc", "verify"):
            refused = run_cli(command, "--store", str(d.store), check=False)
            assert refused.returncode == 2, refused.stderr
            assert f"in use by cached serve (pid {d.proc.pid}" in refused.stderr
            assert f"run cached {command} without --store" in refused.stderr
        stats = d.stats()
        assert stats["entries"] == 1 and stats["workers_alive"] == 1  # nothing touched
    finally:
        d.kill9()
    verified = json.loads(run_cli("verify", "--store", str(d.store), "--json").stdout)
    assert (verified["verified"], verified["bad"]) == (1, [])
    assert run_cli("gc", "--store", str(d.store)).returncode == 0
