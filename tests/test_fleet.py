"""The fleet tier against a real ``redis-server`` on a loopback port (docs/fleet.md).

Two daemons with separate stores are two nodes. The server runs with no persistence in
the test's tmp dir and is killed at the end; ``make setup`` installs it if missing.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import DaemonProcess

from cached import remote
from cached.remote import PREFIX, Rejected, Remote, SigningKeys, pack, unpack

redis = pytest.importorskip("redis")
pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed (make setup installs it)")

SECRET = b"8f1c2a0e5b7d4c3f9a6e1b2d0c4f7a8e"
OLD_SECRET = b"0b1d2c3e4f5a6b7c8d9e0f1a2b3c4d5e"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_cluster_port() -> int:
    """A free port P below 55536 whose cluster bus port P + 10000 is free too."""
    while True:
        port = free_port()
        if port > 55535:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue


class RedisServer:
    """``redis-server`` in the foreground on 127.0.0.1, no persistence, killed at the end."""

    def __init__(self, workdir: Path, port: int | None = None, *extra: str) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.extra = extra
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client().ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.kill()
                    raise
                time.sleep(0.05)

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path / "redis")
    yield server
    server.kill()


@pytest.fixture
def key_file(tmp_path) -> Path:
    path = tmp_path / "fleet.key"
    path.write_bytes(b"# fleet key\n" + SECRET + b"\n")
    return path


class Node(DaemonProcess):
    """A daemon with its own store and socket under ``tmp``, joined to the fleet tier."""

    def __init__(self, tmp: Path, url: str | None, key: Path, *flags: str,
                 workers: int = 1) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        self.tmp, self.store, self.workers = tmp, tmp / "store", workers
        self.socket = str(tmp / "cached.sock")
        self.log_path = tmp / "daemon.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cached", "serve", "--store", str(self.store),
             "--socket", self.socket, "--http", "127.0.0.1:0", "--workers", str(workers),
             *(["--remote", url, "--remote-signing-key", str(key), "--remote-timeout", "1"]
               if url else []), *flags],
            env={**os.environ, "CACHED_TEST_FAMILIES": "1"}, stdout=self._log,
            stderr=subprocess.STDOUT)

    def ready(self) -> Node:
        self.wait_ready(self.workers)
        return self

    def tier(self) -> dict:
        return self.stats()["remote"]

    def wait_tier(self, predicate, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            tier = self.tier()
            if predicate(tier):
                return tier
            if time.monotonic() > deadline:
                raise TimeoutError(f"tier state {tier}: {self.log()}")
            time.sleep(0.1)

    def state_changes(self, state: str) -> int:
        return sum(1 for line in self.log_path.read_text().splitlines()
                   if '"remote.state"' in line and f'"state": "{state}"' in line)


@pytest.fixture
def nodes(tmp_path):
    started: list[Node] = []

    def start(url: str | None, key: Path, *flag_sets: tuple[str, ...]) -> list[Node]:
        new = [Node(tmp_path / f"node{len(started) + i}", url, key, *flags)
               for i, flags in enumerate(flag_sets)]
        started.extend(new)
        return [n.ready() for n in new]

    yield start
    for node in started:
        node.stop()


def _row(key: str, obj: bytes, lib: bytes) -> dict:
    return {"key": key, "family": "f", "kernel_name": "k", "symbol": "s", "params": "{}",
            "arch": "sm_100a", "sm_count": 148, "max_active_clusters": 148, "toolchain": "t",
            "source_sha256": "0" * 64, "object_sha256": hashlib.sha256(obj).hexdigest(),
            "object_size": len(obj), "library_sha256": hashlib.sha256(lib).hexdigest(),
            "library_size": len(lib), "compile_seconds": 1.0, "meta": "{}"}


# -- the envelope -----------------------------------------------------------------------


def test_envelope_verifies_key_row_and_blobs_and_accepts_the_previous_key():
    key, other = hashlib.sha256(b"a").hexdigest(), hashlib.sha256(b"b").hexdigest()
    obj, lib = b"\x7fELF object " * 500, os.urandom(4000)  # compressible, incompressible
    old = SigningKeys([OLD_SECRET])
    data = pack(key, _row(key, obj, lib), obj, lib, old)
    rotated = SigningKeys([SECRET, OLD_SECRET])  # rolling rotation: new signs, old verifies
    row, got_obj, got_lib = unpack(key, data, rotated)
    assert (got_obj, got_lib, row["kernel_name"]) == (obj, lib, "k")
    assert len(data) < len(obj) + len(lib)  # the object was stored compressed
    with pytest.raises(Rejected, match="unknown key"):
        unpack(key, data, SigningKeys([SECRET]))  # the old key retired
    with pytest.raises(Rejected, match="signature"):
        unpack(other, data, old)  # an entry copied under another artifact's key
    for at in (10, 60, 90, len(data) // 2, len(data) - 1):  # mac, lengths, meta, blobs
        tampered = bytearray(data)
        tampered[at] ^= 0x01
        with pytest.raises(Rejected):
            unpack(key, bytes(tampered), old)
    forger = SigningKeys([b"not-the-fleet-key-but-long-enough"])
    forger.current_id = old.current_id  # claims the fleet's key id
    with pytest.raises(Rejected, match="signature"):
        unpack(key, pack(key, _row(key, obj, lib), obj, lib, forger), old)


def test_tier_states_slow_redis_goes_down_full_redis_stops_only_publishing(
        tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="cached.remote")
    key = hashlib.sha256(b"k").hexdigest()
    # Slow: a server that accepts and never answers; the fetch gives up at the timeout.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        tier = Remote(f"redis://127.0.0.1:{port}/0", SigningKeys([SECRET]), timeout=0.3)
        started = time.monotonic()
        assert tier.fetch(key) is None
        assert time.monotonic() - started < 1.5
        for _ in range(5):  # within the backoff: not even tried
            assert tier.fetch(key) is None
        snap = tier.snapshot()
        assert (snap["state"], snap["errors"], snap["skipped"]) == ("down", 1, 5)
    downs = [r for r in caplog.records if r.getMessage() == "remote.state"]
    assert len(downs) == 1 and downs[0].fields["state"] == "down"

    # Full: maxmemory with noeviction refuses writes (OOM); reads go on.
    server = RedisServer(tmp_path / "full", None, "--maxmemory", "3mb",
                         "--maxmemory-policy", "noeviction")
    try:
        tier = Remote(server.url, SigningKeys([SECRET]), timeout=2)
        tier.start()
        blobs = []
        for i in range(12):  # incompressible 512 KiB libraries: 3 MiB fill up quickly
            obj, lib = os.urandom(1000), os.urandom(512 << 10)
            k = hashlib.sha256(b"%d" % i).hexdigest()
            (tmp_path / f"{i}.o").write_bytes(obj)
            (tmp_path / f"{i}.so").write_bytes(lib)
            blobs.append((k, obj, lib))
            tier.publish(k, _row(k, obj, lib), tmp_path / f"{i}.o", tmp_path / f"{i}.so")
        deadline = time.monotonic() + 20
        while tier.snapshot()["state"] != "full" and time.monotonic() < deadline:
            time.sleep(0.05)
        snap = tier.snapshot()
        assert snap["state"] == "full" and 0 < snap["published"] < 12, snap
        assert "OutOfMemoryError" in snap["last_error"]
        fetched = tier.fetch(blobs[0][0])
        assert fetched is not None and fetched[2] == blobs[0][2]
        assert tier.snapshot()["state"] == "full"
        tier.close(drain_s=1)
    finally:
        server.kill()
    fulls = [r for r in caplog.records
             if r.getMessage() == "remote.state" and r.fields["state"] == "full"]
    assert len(fulls) == 1


@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="needs redis-cli")
def test_redis_cluster_mode_spreads_entries_over_three_nodes(tmp_path):
    servers: list[RedisServer] = []
    try:
        for i in range(3):
            servers.append(RedisServer(tmp_path / f"c{i}", free_cluster_port(),
                                       "--cluster-enabled", "yes",
                                       "--cluster-config-file", "nodes.conf"))
        subprocess.run(["redis-cli", "--cluster", "create",
                        *[f"127.0.0.1:{s.port}" for s in servers],
                        "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        deadline = time.monotonic() + 20
        while "cluster_state:ok" not in subprocess.run(
                ["redis-cli", "-p", str(servers[0].port), "cluster", "info"],
                capture_output=True, text=True).stdout:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        tier = Remote(f"redis+cluster://127.0.0.1:{servers[0].port}", SigningKeys([SECRET]))
        tier.start()
        keys = [hashlib.sha256(b"%d" % i).hexdigest() for i in range(12)]
        for i, k in enumerate(keys):
            (tmp_path / f"{i}.o").write_bytes(b"o%d" % i)
            (tmp_path / f"{i}.so").write_bytes(b"l%d" % i)
            tier.publish(k, _row(k, b"o%d" % i, b"l%d" % i), tmp_path / f"{i}.o",
                         tmp_path / f"{i}.so")
        tier.close(drain_s=20)
        assert tier.snapshot()["published"] == 12
        reader = Remote(f"redis+cluster://127.0.0.1:{servers[1].port}", SigningKeys([SECRET]))
        assert all(reader.fetch(k)[2] == b"l%d" % i for i, k in enumerate(keys))
        assert sum(s.client().dbsize() > 0 for s in servers) == 3  # spread over the nodes
    finally:
        for s in servers:
            s.kill()


# -- two daemons are two nodes ----------------------------------------------------------


def test_node_b_serves_what_node_a_compiled_with_zero_compilations(
        redis_server, key_file, nodes, mm_fp4_requests):
    a, b = nodes(redis_server.url, key_file, (), ("--remote-read-only",))
    reqs = mm_fp4_requests[:2]
    built = [a.client(timeout=120).get(r) for r in reqs]
    assert [x.origin for x in built] == ["compiled", "compiled"]
    a.wait_tier(lambda t: t["published"] == 2)

    client = b.client(timeout=60)
    with ThreadPoolExecutor(4) as pool:  # four waiters, one fetch
        first = list(pool.map(lambda _: client.get(reqs[0]), range(4)))
    second = client.get(reqs[1])
    # a waiter that came after the fetch finished finds a hit
    assert "remote" in {x.origin for x in first} <= {"remote", "hit"}
    assert second.origin == "remote"
    assert [first[0].library_sha256, second.library_sha256] == [x.library_sha256 for x in built]
    assert [first[0].object_sha256, second.object_sha256] == [x.object_sha256 for x in built]
    assert client.get(reqs[0]).origin == "hit"
    stats = b.stats()
    assert (stats["compiles"], stats["remote_hits"], stats["hits"] + stats["misses"]) == (0, 2, 6)
    assert (stats["remote"]["hits"], stats["remote"]["published"]) == (2, 0)
    assert stats["entries"] == 2 and stats["remote"]["state"] == "up"
    assert stats["remote"]["compression_ratio"] is None  # B sent nothing
    assert a.tier()["compression_ratio"] > 1.5


def test_tampered_or_forged_entry_is_rejected_and_node_b_compiles(
        redis_server, key_file, nodes, mm_fp4_requests):
    a, b = nodes(redis_server.url, key_file, (), ())
    reqs = mm_fp4_requests[2:4]
    built = [a.client(timeout=120).get(r) for r in reqs]
    a.wait_tier(lambda t: t["published"] == 2)
    r = redis_server.client()
    fleet = SigningKeys([SECRET])
    tampered = bytearray(r.get(PREFIX + built[0].key))
    tampered[-100] ^= 0xFF  # one bit pattern in the stored library
    r.set(PREFIX + built[0].key, bytes(tampered))
    row, obj, lib = unpack(built[1].key, r.get(PREFIX + built[1].key), fleet)
    evil = lib[:-4] + b"EVIL"
    row = {**row, "library_sha256": hashlib.sha256(evil).hexdigest()}
    forger = SigningKeys([b"an-attacker-key-of-plenty-bytes!"])
    forger.current_id = fleet.current_id
    r.set(PREFIX + built[1].key, pack(built[1].key, row, obj, evil, forger))

    got = [b.client(timeout=120).get(x) for x in reqs]
    assert [x.origin for x in got] == ["compiled", "compiled"]
    assert [x.library_sha256 for x in got] == [x.library_sha256 for x in built]
    stats = b.stats()
    assert (stats["compiles"], stats["remote_hits"], stats["remote"]["rejected"]) == (2, 0, 2)
    assert b.log_path.read_text().count('"remote.rejected"') == 2
    # B is a build node too: its own compilations replace the bad entries.
    b.wait_tier(lambda t: t["published"] == 2)
    for x in built:
        assert unpack(x.key, r.get(PREFIX + x.key), fleet)[2] is not None


def test_read_only_node_never_writes(redis_server, key_file, nodes, mm_fp4_requests,
                                     tmp_path):
    config = tmp_path / "cached.toml"  # the tier set in the config file, not by flags
    config.write_text(f'remote = "{redis_server.url}"\nremote-signing-key = "{key_file}"\n'
                      'remote-read-only = true\nremote-timeout = 1\n')
    (b,) = nodes(None, key_file, ("--config", str(config)))
    assert b.client(timeout=120).get(mm_fp4_requests[4]).origin == "compiled"
    time.sleep(1.5)  # a publisher would have written by now
    r = redis_server.client()
    assert r.dbsize() == 0
    writes = {k for k in r.info("commandstats")
              if k.split("_", 1)[1] in ("set", "setex", "hset", "del", "expire", "mset")}
    assert writes == set()
    tier = b.tier()
    assert (tier["misses"], tier["published"], tier["read_only"]) == (1, 0, True)


def test_redis_killed_mid_run_leaves_both_nodes_serving(
        redis_server, key_file, nodes, mm_fp4_requests):
    a, b = nodes(redis_server.url, key_file, (), ())
    r0, r1, r2, r3 = mm_fp4_requests[5:9]
    ca, cb = a.client(timeout=120), b.client(timeout=120)
    assert ca.get(r0).origin == "compiled"
    a.wait_tier(lambda t: t["published"] == 1)
    assert cb.get(r0).origin == "remote"

    redis_server.kill()
    results: dict[str, str] = {}
    threads = [threading.Thread(target=lambda: results.update(a1=ca.get(r1).origin)),
               threading.Thread(target=lambda: results.update(b2=cb.get(r2).origin))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == {"a1": "compiled", "b2": "compiled"}
    assert (ca.get(r0).origin, cb.get(r0).origin) == ("hit", "hit")
    assert cb.get(r3).origin == "compiled"
    a.wait_tier(lambda t: t["state"] == "down")  # A's publish of r1 failed
    assert b.tier()["state"] == "down"
    assert a.state_changes("down") == 1 and b.state_changes("down") == 1
    assert a.stats()["workers_alive"] == 1 and b.stats()["workers_alive"] == 1
    with urllib.request.urlopen(f"http://{b.stats()['http']}/metrics", timeout=10) as reply:
        metrics = reply.read().decode()
    assert 'cached_remote_state{state="down"} 1.0' in metrics
    assert 'cached_remote_hits_total{family="flashinfer.mm_fp4"} 1.0' in metrics

    redis_server.start()  # back, empty: both notice with their backoff probes
    a.wait_tier(lambda t: t["state"] == "up")
    b.wait_tier(lambda t: t["state"] == "up")
    # A kept r1's publish queued through the outage and sends it now.
    a.wait_tier(lambda t: t["published"] == 2)
    assert redis_server.client().exists(PREFIX + ca.get(r1).key)
    assert cb.get(r1).origin == "remote"


def test_serve_refuses_a_remote_tier_without_a_signing_key(tmp_path):
    out = subprocess.run([sys.executable, "-m", "cached", "serve", "--store",
                          str(tmp_path / "s"), "--socket", str(tmp_path / "s.sock"),
                          "--remote", "redis://127.0.0.1:1/0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--remote-signing-key" in out.stderr
    with pytest.raises(ValueError):
        SigningKeys([b"short"])
    assert remote.redacted("redis://u:secret@h:1/0") == "redis://u:***@h:1/0"
