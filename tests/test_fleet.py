"""The fleet tier against a real ``redis-server`` on a loopback port (docs/fleet.md).

Two daemons with separate stores are two nodes. The server runs with no persistence in
the test's tmp dir and is killed at the end; ``make setup`` installs it if missing.
"""

from __future__ import annotations

import hashlib
import hmac
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
from cached_client import protocol as p
from conftest import DaemonProcess
from cryptography.hazmat.primitives.asymmetric.ec import SECP256R1, generate_private_key
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    BestAvailableEncryption,
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)
from test_access import peer_uid, shared_dir  # noqa: F401 -- fixtures

from cached.fleet import envelope, redis_tier
from cached.fleet.envelope import (
    FleetKeys,
    Rejected,
    key_id,
    load_keys,
    pack,
    read_verify_keys,
    unpack,
)
from cached.fleet.redis_tier import PREFIX, RedisTier

redis = pytest.importorskip("redis")
pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed (make setup installs it)")

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


class KeyPair:
    """A fleet key pair on disk: ``key`` (private, PEM PKCS#8: publishing nodes only) and
    ``pub`` (public, PEM: every node), in the forms ``openssl genpkey``/``pkey`` write."""

    def __init__(self, directory: Path, name: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.private = Ed25519PrivateKey.generate()
        self.public = self.private.public_key()
        self.id = key_id(self.public)
        self.key, self.pub = directory / f"{name}.key", directory / f"{name}.pub"
        self.key.write_bytes(self.private.private_bytes(Encoding.PEM, PrivateFormat.PKCS8,
                                                        NoEncryption()))
        self.pub.write_bytes(self.public.public_bytes(Encoding.PEM,
                                                      PublicFormat.SubjectPublicKeyInfo))
        self.key.chmod(0o400)

    def signer(self) -> FleetKeys:
        return FleetKeys(self.private)

    def verifier(self) -> FleetKeys:
        return FleetKeys(None, [self.public])


def publishing(pair: KeyPair, verify: Path | None = None) -> tuple[str, ...]:
    """``cached serve`` flags of a publishing node that signs with ``pair``."""
    return ("--remote-signing-key", str(pair.key),
            *(("--remote-verify-keys", str(verify)) if verify else ()))


def read_only(verify: Path) -> tuple[str, ...]:
    """``cached serve`` flags of a read-only node: public keys only."""
    return ("--remote-read-only", "--remote-verify-keys", str(verify))


def forger_of(pair: KeyPair) -> FleetKeys:
    """Everything a node holding only ``pair``'s public key can make of it: the public key's
    bytes used as a private key, claiming the fleet key's id."""
    raw = pair.public.public_bytes(Encoding.Raw, PublicFormat.Raw)
    forger = FleetKeys(Ed25519PrivateKey.from_private_bytes(raw))
    forger.signer_id = pair.id
    return forger


@pytest.fixture
def fleet(tmp_path) -> KeyPair:
    return KeyPair(tmp_path / "keys", "fleet")


class Node(DaemonProcess):
    """A daemon with its own store and socket under ``tmp``, joined to the fleet tier
    (``flags`` name its keys: :func:`publishing`, :func:`read_only`)."""

    def __init__(self, tmp: Path, url: str | None, *flags: str, workers: int = 1) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        self.tmp, self.store, self.workers = tmp, tmp / "store", workers
        self.socket = str(tmp / "cached.sock")
        self.log_path = tmp / "daemon.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cached", "serve", "--store", str(self.store),
             "--socket", self.socket, "--http", "127.0.0.1:0", "--workers", str(workers),
             *(["--remote", url, "--remote-timeout", "1"] if url else []), *flags],
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

    def start(url: str | None, *flag_sets: tuple[str, ...]) -> list[Node]:
        new = [Node(tmp_path / f"node{len(started) + i}", url, *flags)
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


def test_envelope_verifies_key_row_and_blobs_and_accepts_the_previous_key(tmp_path):
    key, other = hashlib.sha256(b"a").hexdigest(), hashlib.sha256(b"b").hexdigest()
    obj, lib = b"\x7fELF object " * 500, os.urandom(4000)  # compressible, incompressible
    old, new = KeyPair(tmp_path, "old"), KeyPair(tmp_path, "new")
    data = pack(key, _row(key, obj, lib), obj, lib, old.signer())
    rotated = FleetKeys(new.private, [old.public])  # rotation: new signs, old still verifies
    row, got_obj, got_lib = unpack(key, data, rotated)
    assert (got_obj, got_lib, row["kernel_name"]) == (obj, lib, "k")
    assert unpack(key, data, old.verifier())[2] == lib  # a public key alone verifies
    assert len(data) < len(obj) + len(lib)  # the object was stored compressed
    with pytest.raises(Rejected, match="unknown key id"):
        unpack(key, data, new.verifier())  # the old key retired
    with pytest.raises(Rejected, match="signature"):
        unpack(other, data, old.verifier())  # an entry copied under another artifact's key
    for at in (10, 40, 80, 100, len(data) // 2, len(data) - 1):  # kid, sig, lengths, meta, blobs
        tampered = bytearray(data)
        tampered[at] ^= 0x01
        with pytest.raises(Rejected):
            unpack(key, bytes(tampered), rotated)


def test_verify_key_material_cannot_sign_an_entry(fleet):
    """What a read-only node holds (the verify-keys file) makes no entry that verifies."""
    key = hashlib.sha256(b"a").hexdigest()
    obj, lib = b"obj" * 100, b"EVIL" * 100
    reader = load_keys(None, fleet.pub, read_only=True)
    assert reader.signer is None and reader.signer_id is None
    assert list(reader.by_id) == [fleet.id]
    with pytest.raises(RuntimeError, match="no fleet signing key"):
        pack(key, _row(key, obj, lib), obj, lib, reader)
    # Every way to turn the public material into a signer, each claiming the fleet's key id.
    material = [fleet.public.public_bytes(Encoding.Raw, PublicFormat.Raw),
                hashlib.sha256(fleet.pub.read_bytes()).digest(),
                hashlib.sha256(fleet.public.public_bytes(Encoding.Raw, PublicFormat.Raw)).digest()]
    for seed in material:
        forger = FleetKeys(Ed25519PrivateKey.from_private_bytes(seed))
        forger.signer_id = fleet.id
        with pytest.raises(Rejected, match="signature does not verify"):
            unpack(key, pack(key, _row(key, obj, lib), obj, lib, forger), reader)
    # The old scheme's construction: a MAC keyed with what the node holds, padded to 64.
    body = pack(key, _row(key, obj, lib), obj, lib, forger_of(fleet))[4 + 8 + 64:]
    mac = hmac.new(material[0], envelope.DOMAIN + key.encode() + body, "sha256").digest()
    with pytest.raises(Rejected, match="signature does not verify"):
        unpack(key, envelope.MAGIC + bytes.fromhex(fleet.id) + mac * 2 + body, reader)


# The key-generation commands docs/fleet.md gives; the test runs them as written there.
DOC_KEYGEN = ["openssl genpkey -algorithm ed25519 -out fleet.key",
              "openssl pkey -in fleet.key -pubout -out fleet.pub",
              "openssl pkey -in fleet.key -pubout | grep -v -- -----"]


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
def test_the_documented_key_commands_make_keys_the_daemon_accepts(tmp_path, caplog):
    doc = (Path(__file__).resolve().parents[1] / "docs" / "fleet.md").read_text()
    for command in DOC_KEYGEN:
        assert command in doc, command

    def sh(command: str) -> str:
        return subprocess.run(["bash", "-c", command], cwd=tmp_path, check=True,
                              capture_output=True, text=True).stdout

    sh(DOC_KEYGEN[0])
    sh(DOC_KEYGEN[1])
    one_line = sh(DOC_KEYGEN[2]).strip()
    (tmp_path / "lines.pub").write_text(f"# fleet key, 2026-12\n{one_line}\n")
    (tmp_path / "new").mkdir()
    sh(DOC_KEYGEN[0].replace("fleet.key", "new/fleet.key"))
    sh(DOC_KEYGEN[1].replace("fleet.", "new/fleet."))
    sh("cat new/fleet.pub fleet.pub > both.pub")  # rotation: current and previous

    signer = load_keys(tmp_path / "fleet.key", None, read_only=False)
    key = hashlib.sha256(b"a").hexdigest()
    data = pack(key, _row(key, b"o", b"l"), b"o", b"l", signer)
    for verify in ("fleet.pub", "lines.pub", "both.pub"):
        reader = load_keys(None, tmp_path / verify, read_only=True)
        assert signer.signer_id in reader.by_id
        assert unpack(key, data, reader)[2] == b"l"
    assert len(read_verify_keys(tmp_path / "both.pub")) == 2
    # A signer whose own public key is missing from its verify-keys file says so at start.
    caplog.set_level(logging.WARNING, logger="cached.remote")
    moved = load_keys(tmp_path / "new" / "fleet.key", tmp_path / "fleet.pub", read_only=False)
    assert len(moved.by_id) == 2  # its own key and the file's
    assert [r.getMessage() for r in caplog.records] == ["remote.signing_key_not_in_verify_keys"]
    load_keys(tmp_path / "new" / "fleet.key", tmp_path / "both.pub", read_only=False)
    assert len(caplog.records) == 1


def test_tier_states_slow_redis_goes_down_full_redis_stops_only_publishing(
        tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="cached.remote")
    key = hashlib.sha256(b"k").hexdigest()
    # Slow: a server that accepts and never answers; the fetch gives up at the timeout.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        tier = RedisTier(f"redis://127.0.0.1:{port}/0", FleetKeys(Ed25519PrivateKey.generate()),
                      timeout=0.3)
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
        tier = RedisTier(server.url, FleetKeys(Ed25519PrivateKey.generate()), timeout=2)
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
def test_redis_cluster_mode_spreads_entries_over_three_nodes(tmp_path, fleet):
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
        tier = RedisTier(f"redis+cluster://127.0.0.1:{servers[0].port}", fleet.signer())
        tier.start()
        keys = [hashlib.sha256(b"%d" % i).hexdigest() for i in range(12)]
        for i, k in enumerate(keys):
            (tmp_path / f"{i}.o").write_bytes(b"o%d" % i)
            (tmp_path / f"{i}.so").write_bytes(b"l%d" % i)
            tier.publish(k, _row(k, b"o%d" % i, b"l%d" % i), tmp_path / f"{i}.o",
                         tmp_path / f"{i}.so")
        tier.close(drain_s=20)
        assert tier.snapshot()["published"] == 12
        reader = RedisTier(f"redis+cluster://127.0.0.1:{servers[1].port}", fleet.verifier())
        assert all(reader.fetch(k)[2] == b"l%d" % i for i, k in enumerate(keys))
        assert sum(s.client().dbsize() > 0 for s in servers) == 3  # spread over the nodes
    finally:
        for s in servers:
            s.kill()


# -- two daemons are two nodes ----------------------------------------------------------


def test_node_b_serves_what_node_a_compiled_with_zero_compilations(
        redis_server, fleet, nodes, mm_fp4_requests):
    # A signs with the private key; B holds only the public key.
    a, b = nodes(redis_server.url, publishing(fleet), read_only(fleet.pub))
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
    assert (stats["remote"]["signing_key_id"], stats["remote"]["verify_key_ids"]) == (
        None, [fleet.id])
    assert (a.tier()["signing_key_id"], a.tier()["read_only"]) == (fleet.id, False)
    assert a.tier()["compression_ratio"] > 1.5


def test_tampered_forged_or_foreign_entry_is_rejected_and_node_b_compiles(
        redis_server, fleet, nodes, mm_fp4_requests, tmp_path):
    # Two build nodes, each with its own private key; both verify both public keys.
    own = KeyPair(tmp_path / "keys", "b")
    both = tmp_path / "keys" / "both.pub"
    both.write_bytes(fleet.pub.read_bytes() + own.pub.read_bytes())
    a, b = nodes(redis_server.url, publishing(fleet, both), publishing(own, both))
    reqs = mm_fp4_requests[2:5]
    built = [a.client(timeout=120).get(r) for r in reqs]
    a.wait_tier(lambda t: t["published"] == 3)
    r = redis_server.client()
    fleet_keys = FleetKeys(None, read_verify_keys(both))
    tampered = bytearray(r.get(PREFIX + built[0].key))
    tampered[-100] ^= 0xFF  # one bit pattern in the stored library
    r.set(PREFIX + built[0].key, bytes(tampered))
    # Forged: other library bytes, "signed" with all a verifying node holds (the public key).
    row, obj, lib = unpack(built[1].key, r.get(PREFIX + built[1].key), fleet_keys)
    evil = lib[:-4] + b"EVIL"
    row = {**row, "library_sha256": hashlib.sha256(evil).hexdigest()}
    r.set(PREFIX + built[1].key, pack(built[1].key, row, obj, evil, forger_of(fleet)))
    # Foreign: the genuine kernel, signed by a key outside the fleet's verify set.
    row, obj, lib = unpack(built[2].key, r.get(PREFIX + built[2].key), fleet_keys)
    stranger = FleetKeys(Ed25519PrivateKey.generate())
    r.set(PREFIX + built[2].key, pack(built[2].key, row, obj, lib, stranger))

    got = [b.client(timeout=120).get(x) for x in reqs]
    assert [x.origin for x in got] == ["compiled"] * 3
    assert [x.library_sha256 for x in got] == [x.library_sha256 for x in built]
    stats = b.stats()
    assert (stats["compiles"], stats["remote_hits"], stats["remote"]["rejected"]) == (3, 0, 3)
    log = b.log_path.read_text()
    assert log.count('"remote.rejected"') == 3
    assert log.count("signature does not verify") == 2
    assert f"signed with unknown key id '{stranger.signer_id}'" in log
    # B is a build node too: its own compilations, signed with its key, replace the bad ones.
    b.wait_tier(lambda t: t["published"] == 3)
    for x in built:
        assert unpack(x.key, r.get(PREFIX + x.key), own.verifier())[2] is not None


def test_read_only_node_holds_no_signing_key_and_never_writes(
        redis_server, fleet, nodes, mm_fp4_requests, tmp_path):
    config = tmp_path / "cached.toml"  # the tier set in the config file, not by flags
    config.write_text(f'remote = "{redis_server.url}"\nremote-verify-keys = "{fleet.pub}"\n'
                      'remote-read-only = true\nremote-timeout = 1\n')
    (b,) = nodes(None, ("--config", str(config)))
    assert b.client(timeout=120).get(mm_fp4_requests[5]).origin == "compiled"
    time.sleep(1.5)  # a publisher would have written by now
    r = redis_server.client()
    assert r.dbsize() == 0
    writes = {k for k in r.info("commandstats")
              if k.split("_", 1)[1] in ("set", "setex", "hset", "del", "expire", "mset")}
    assert writes == set()
    tier = b.tier()
    assert (tier["misses"], tier["published"], tier["read_only"]) == (1, 0, True)
    assert (tier["signing_key_id"], tier["verify_key_ids"]) == (None, [fleet.id])


def test_rotation_previous_key_verifies_until_removed_from_the_verify_set(
        redis_server, fleet, nodes, mm_fp4_requests, tmp_path):
    old, new = fleet, KeyPair(tmp_path / "keys", "new")
    both = tmp_path / "keys" / "both.pub"  # step 1: every node verifies the old and the new
    both.write_bytes(new.pub.read_bytes() + old.pub.read_bytes())
    r0, r1 = mm_fp4_requests[9:11]
    (signer,) = nodes(redis_server.url, publishing(old, both))
    assert signer.client(timeout=120).get(r0).origin == "compiled"  # signed with the old key
    signer.wait_tier(lambda t: t["published"] == 1)
    signer.stop()
    # Step 2: the build node moves to the new key; the old key's entries still verify.
    moved, reader, retired = nodes(redis_server.url, publishing(new, both), read_only(both),
                                   read_only(new.pub))  # step 3: the old key removed
    assert moved.tier()["signing_key_id"] == new.id
    assert moved.client(timeout=120).get(r0).origin == "remote"
    assert moved.client(timeout=120).get(r1).origin == "compiled"  # signed with the new key
    moved.wait_tier(lambda t: t["published"] == 1)
    assert [reader.client(timeout=120).get(x).origin for x in (r0, r1)] == ["remote", "remote"]
    # With the old key gone from its verify set, the old entry is rejected and recompiled.
    got = [retired.client(timeout=120).get(x) for x in (r0, r1)]
    assert [x.origin for x in got] == ["compiled", "remote"]
    assert retired.tier()["rejected"] == 1
    assert f"signed with unknown key id '{old.id}'" in retired.log_path.read_text()
    assert reader.tier()["rejected"] == 0


def test_redis_killed_mid_run_leaves_both_nodes_serving(
        redis_server, fleet, nodes, mm_fp4_requests):
    a, b = nodes(redis_server.url, publishing(fleet), publishing(fleet))
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




# -- key files and settings the daemon refuses --------------------------------------------

SIGNING_FORMAT = "expected an Ed25519 private key in PEM"
VERIFY_FORMAT = "expected Ed25519 public keys"


def _bad_key_cases(d: Path, fleet: KeyPair) -> dict[str, tuple[list[str], str, str]]:
    """name: (flags after --remote, text the one-line error must hold, format it names)."""

    def write(name: str, data: bytes) -> str:
        (d / name).write_bytes(data)
        return str(d / name)

    ec = generate_private_key(SECP256R1())
    ec_key = ec.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
    ec_pub = ec.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)
    encrypted = fleet.private.private_bytes(Encoding.PEM, PrivateFormat.PKCS8,
                                            BestAvailableEncryption(b"pw"))
    raw = os.urandom(32)  # issue 16 item 18: `head -c 32 /dev/urandom > fleet.key`
    sign, verify = "--remote-signing-key", "--remote-verify-keys"
    ro = "--remote-read-only"
    return {
        "raw-random-bytes": ([sign, write("raw.key", raw)], "raw.key", SIGNING_FORMAT),
        "empty": ([sign, write("empty.key", b"")], "empty.key", SIGNING_FORMAT),
        "directory": ([sign, str(d)], f"{d}: cannot read it", SIGNING_FORMAT),
        "missing": ([sign, str(d / "nope.key")], "No such file", SIGNING_FORMAT),
        "ec-key": ([sign, write("ec.key", ec_key)], "an EC key, not Ed25519", SIGNING_FORMAT),
        "public-as-private": ([sign, str(fleet.pub)], "public keys go in --remote-verify-keys",
                              SIGNING_FORMAT),
        "encrypted": ([sign, write("enc.key", encrypted)], "encrypted", SIGNING_FORMAT),
        "two-keys": ([sign, write("two.key", fleet.key.read_bytes() + ec_key)],
                     "exactly one private key", SIGNING_FORMAT),
        "old-hmac-hex": ([sign, write("hmac.key", os.urandom(32).hex().encode() + b"\n")],
                         "old HMAC scheme", SIGNING_FORMAT),
        "verify-raw-bytes": ([ro, verify, write("raw.pub", raw)], "raw.pub", VERIFY_FORMAT),
        "verify-empty": ([ro, verify, write("empty.pub", b"# none yet\n")], "no key",
                         VERIFY_FORMAT),
        "verify-private": ([ro, verify, str(fleet.key)], "a private key does not belong",
                           VERIFY_FORMAT),
        "verify-ec": ([ro, verify, write("ec.pub", ec_pub)], "an EC key, not Ed25519",
                      VERIFY_FORMAT),
        "verify-garbage-line": ([ro, verify, write("junk.pub", fleet.pub.read_bytes()
                                                   + b"not a key!\n")], "line 4", VERIFY_FORMAT),
        "read-only-with-signing-key": ([ro, sign, str(fleet.key), verify, str(fleet.pub)],
                                       "must not hold the fleet's private key", ""),
        "read-only-without-verify-keys": ([ro], "needs --remote-verify-keys", ""),
        "no-keys": ([], "--remote needs --remote-signing-key", ""),
    }


CASES = ["raw-random-bytes", "empty", "directory", "missing", "ec-key", "public-as-private",
         "encrypted", "two-keys", "old-hmac-hex", "verify-raw-bytes", "verify-empty",
         "verify-private", "verify-ec", "verify-garbage-line", "read-only-with-signing-key",
         "read-only-without-verify-keys", "no-keys"]


@pytest.mark.parametrize("case", CASES)
def test_serve_refuses_a_bad_key_file_in_one_line_before_binding_anything(
        tmp_path, fleet, case):
    bad = tmp_path / "bad"
    bad.mkdir()
    cases = _bad_key_cases(bad, fleet)
    assert sorted(cases) == sorted(CASES)
    flags, says, expected = cases[case]
    sock, store = tmp_path / "run" / "cached.sock", tmp_path / "store"
    port = free_port()
    out = subprocess.run([sys.executable, "-m", "cached", "serve", "--store", str(store),
                          "--socket", str(sock), "--http", f"127.0.0.1:{port}",
                          "--remote", "redis://127.0.0.1:1/0", *flags],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cached serve: "), out.stderr
    assert says in lines[0] and expected in lines[0]
    if expected:  # a bad file: the message names it
        assert flags[-1] in lines[0]
    assert not sock.exists() and not sock.parent.exists()  # nothing bound, nothing left
    assert not store.exists()  # the store was not even opened
    with socket.socket() as s:  # the HTTP port was never taken
        s.bind(("127.0.0.1", port))


def test_redacted_url_hides_the_password():
    assert redis_tier.redacted("redis://u:secret@h:1/0") == "redis://u:***@h:1/0"


def test_a_peers_winners_cross_the_fleet_under_its_group_and_junk_is_one_line(
        redis_server, fleet, shared_dir, peer_uid):  # noqa: F811
    """Issue 37 case 3, through the fleet tier: a --publish-uid user's winner on node A
    reached root on a read-only node B. Now the signed record carries its trust group: on
    B it is served to that uid's group only, while root's winner on A is served to every
    peer of B; a signed record naming no group, and junk records, are refused, logged in
    one line a fetch (not one line a record)."""
    from test_hostile_peer import as_peer

    from cached.ops.autotune import group_id

    share = ("--socket-mode", "666", "--publish-uid", "0", "--publish-uid", str(peer_uid))
    a = Node(shared_dir / "a", redis_server.url, *publishing(fleet), *share).ready()
    b = Node(shared_dir / "b", redis_server.url, *read_only(fleet.pub), *share).ready()
    try:
        where = dict(op_name="linear", n=64, k=64, dtype="fp8", arch="sm_100a", device="D")
        put = dict(where, kernel="k", tactic={"t": 1}, time_us=2.0, toolchain="T",
                   reduction_class="c")
        assert as_peer(peer_uid, a.socket, "put", winners=[{**put, "bucket": 1}]) == {
            "put": ["ok"]}
        a.client(timeout=30).autotune_put(p.AutotunePutRequest(**put, bucket=2))
        a.wait_tier(lambda t: t["records_published"] == 2)
        group = group_id({**where, "op": "linear"})
        unattributed = {k: v for k, v in {**put, "op": "linear", "bucket": 3}.items()
                        if k != "op_name"} | {"tactic": '{"t": 1}'}
        junk = {f"junk{i}": b"CKR2" + os.urandom(80) for i in range(50)}
        junk["legacy"] = envelope.pack_record(group, "legacy", unattributed, fleet.signer())
        redis_server.client().hset(redis_tier.RECORD_PREFIX + group, mapping=junk)
        root = b.client(timeout=30).autotune_get(p.AutotuneGetRequest(**where))
        assert [(r["bucket"], r["trust_group"], r["source"]) for r in root] == [
            (2, "trusted", "fleet")]
        mine = as_peer(peer_uid, b.socket, "get", where=where)["get"]
        assert sorted((r["bucket"], r["trust_group"]) for r in mine) == [
            (1, f"uids:{peer_uid}"), (2, "trusted")]
        text = b.log_path.read_text()
        assert text.count('"remote.rejected"') == 2  # two fetches, 50 records each
        assert text.count('"autotune.fleet_rejected"') <= 2  # the legacy record's
        assert len(text) < 50_000
    finally:
        a.stop()
        b.stop()
