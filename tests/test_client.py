"""The thin client: cheap import, deadlines against bad daemons, loading, fallback."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
from cached_client import (
    Client,
    DaemonUnavailable,
    DeadlineExceeded,
    IntegrityError,
    InvalidArgument,
)
from cached_client import protocol as p
from cached_client.loader import load_library
from conftest import run_cli


def test_import_pulls_in_no_heavy_module():
    code = ("import sys, cached_client; heavy = [m for m in ('fastapi', 'cutlass', 'flashinfer',"
            " 'torch', 'tvm_ffi', 'cached') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


class BadDaemon:
    """A Unix-socket server that misbehaves in one chosen way."""

    def __init__(self, path: str, mode: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(path)
        self.sock.listen(8)
        self.mode = mode
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            try:
                if self.mode == "slow":
                    time.sleep(3)
                    body = b'{"ok": true, "stats": {}}'
                    conn.sendall(struct.pack(">I", len(body)) + body)
                elif self.mode == "cut":
                    conn.recv(65536)
                    conn.sendall(struct.pack(">I", 1000) + b'{"ok": tr')
                    conn.close()
            except OSError:
                return

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.mark.parametrize("mode, error", [("silent", DeadlineExceeded),
                                         ("slow", DeadlineExceeded),
                                         ("cut", DaemonUnavailable)])
def test_deadline_holds_against_a_misbehaving_daemon(tmp_path, mode, error):
    bad = BadDaemon(str(tmp_path / "bad.sock"), mode)
    try:
        started = time.monotonic()
        with pytest.raises(error):
            Client(str(tmp_path / "bad.sock"), timeout=1.0).stats()
        assert time.monotonic() - started < 2.0
    finally:
        bad.close()


def test_unreachable_daemon_falls_back_to_compiling_here_and_says_so_once(
        tmp_path, mm_fp4_requests, caplog):
    client = Client(str(tmp_path / "absent.sock"), timeout=2)
    with caplog.at_level(logging.WARNING, logger="cached_client"):
        fn = client.load(mm_fp4_requests[5])
        fn2 = client.load(mm_fp4_requests[6])
    assert callable(fn) and callable(fn2)
    warnings = [r for r in caplog.records if "compiling in this process" in r.getMessage()]
    assert len(warnings) == 1
    with pytest.raises(DaemonUnavailable, match="cannot connect"):
        Client(str(tmp_path / "absent.sock"), fallback=False).load(mm_fp4_requests[5])


def test_path_and_bytes_transfer_load_the_same_kernel(daemon, mm_fp4_requests):
    by_path = daemon.client().load(mm_fp4_requests[7])
    by_bytes = daemon.client(transfer="bytes").load(mm_fp4_requests[7])
    assert callable(by_path) and callable(by_bytes)
    art = daemon.client(transfer="bytes").get(mm_fp4_requests[7])
    assert art.library_bytes is not None and art.origin == "hit"


def test_client_refuses_a_library_whose_digest_changed(daemon, mm_fp4_requests, tmp_path):
    art = daemon.client().get(mm_fp4_requests[8])
    copy = tmp_path / "copy.so"
    copy.write_bytes(open(art.library_path, "rb").read() + b"\0")
    with pytest.raises(IntegrityError, match="not loading"):
        load_library(str(copy), art.symbol, art.library_sha256)


def test_http_stats_equal_the_cli_and_health(daemon):
    hello = daemon.client().hello()
    assert hello.v == 1 and "flashinfer.mm_fp4" in hello.families
    address = daemon.stats()["http"]
    assert address.startswith("127.0.0.1:")
    health = httpx.get(f"http://{address}/healthz", timeout=5).json()
    assert health == {"ok": True}
    over_http = httpx.get(f"http://{address}/stats", timeout=5).json()
    over_cli = __import__("json").loads(run_cli("stats", "--socket", daemon.socket,
                                                "--json").stdout)
    for key in ("entries", "bytes", "hits", "misses", "compiles", "failures", "in_flight"):
        assert over_http[key] == over_cli[key]
    assert os.path.exists(daemon.socket)


def test_scratch_directory_must_be_private(tmp_path):
    from cached_client.loader import private_dir

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    with pytest.raises(IntegrityError, match="not a private directory"):
        private_dir(str(shared))
    assert private_dir(str(tmp_path / "mine")) == str(tmp_path / "mine")
    assert oct(os.stat(tmp_path / "mine").st_mode & 0o777) == "0o700"


def test_default_socket_in_a_directory_another_user_made_is_refused(tmp_path, monkeypatch):
    from cached_client.paths import check_socket_dir

    planted = tmp_path / "cached-planted"
    planted.mkdir()
    os.chown(planted, 4242, 4242)
    assert "belongs to uid 4242" in check_socket_dir(str(planted / "cached.sock"))
    monkeypatch.delenv("CACHED_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(planted.parent))
    os.rename(planted, tmp_path / "cached")
    with pytest.raises(DaemonUnavailable, match="not connecting"):
        Client(fallback=False).stats()
    assert check_socket_dir(str(tmp_path / "mine" / "cached.sock")) is None


def test_a_load_is_passed_and_copies_only_the_library_and_checks_a_kept_copy(
        daemon, mm_fp4_requests, tmp_path, monkeypatch):
    """``load`` asks for the library's descriptor alone (``get.blobs``); FlashInfer's hook
    asks for the object alone. ``get`` copies what it is passed, hashed as it is copied. A
    copy already in the scratch directory whose bytes changed is never loaded nor handed
    out: ``load`` runs this daemon's blob in place (its store is root's alone) and leaves
    the copy be, and ``get`` keeps a copy only when its bytes hash right (a kept copy
    replaced on the copy path: test_client_trust.py::test_a_store_another_uid_can_write_is_
    copied_never_loaded_in_place)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    scratch = tmp_path / f"cached-client-{os.getuid()}"
    client = daemon.client()
    assert callable(client.load(mm_fp4_requests[2]))
    art = client.get(mm_fp4_requests[2], blobs=("library",))
    assert art.object_path is None and art.library_path == str(
        scratch / f"{art.library_sha256}.so")
    blobs = sorted(f.name for f in scratch.iterdir() if f.suffix in (".o", ".so"))
    assert blobs == [f"{art.library_sha256}.so"]
    obj = client.get(mm_fp4_requests[3], blobs=("object",))
    assert obj.library_path is None and obj.object_path == str(
        scratch / f"{obj.object_sha256}.o")
    assert not (scratch / f"{obj.library_sha256}.so").exists()
    kept = scratch / f"{obj.library_sha256}.so"  # changed: the right size, other bytes
    kept.write_bytes(b"\0" * obj.library_size)
    assert callable(daemon.client(fallback=False).load(mm_fp4_requests[3]))
    assert kept.read_bytes() == b"\0" * obj.library_size  # in place: the copy not used
    again = daemon.client(fallback=False).get(mm_fp4_requests[3], blobs=("library",))
    assert hashlib.sha256(Path(again.library_path).read_bytes()).hexdigest() == \
        obj.library_sha256
    # a get naming no blob, or one twice, is refused by the client and by the daemon
    for blobs in ([], ["library", "library"]):
        with pytest.raises(InvalidArgument, match="get.blobs"):
            p.GetRequest(request=mm_fp4_requests[2], transfer="fd", blobs=blobs)
        wire = {**p.GetRequest(request=mm_fp4_requests[2], transfer="fd").to_wire(),
                "blobs": blobs}
        body = json.dumps({"v": 1, "id": 1, "op": "get", **wire}).encode()
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(10)
        s.connect(daemon.socket)
        s.sendall(struct.pack(">I", len(body)) + body)
        (n,) = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL))
        reply = json.loads(s.recv(n, socket.MSG_WAITALL))
        s.close()
        assert reply["ok"] is False and reply["error"]["code"] == "invalid_argument"
        assert "get.blobs" in reply["error"]["message"]
    assert daemon.client().get(mm_fp4_requests[2]).origin == "hit"  # still serving


def test_get_batch_answers_each_request_or_its_error_and_load_many_loads_each_once(
        daemon, mm_fp4_requests):
    """``get_batch``: one reply, an item per request in order (an unknown family is its
    item's typed error; the others still served, their descriptors passed in item order);
    ``load_many`` loads each kernel once, through one batch, and the daemon serves on."""
    from cached_client.keys import KernelRequest
    from conftest import fault

    c = daemon.client(fallback=False)
    bad = KernelRequest(family="no.such.family", params={}, arch="sm_100a", sm_count=148,
                        max_active_clusters=148)
    good = [fault("build", "batch-a"), fault("build", "batch-b")]
    reply, _ = c.call("get_batch", p.GetBatchRequest(requests=[good[0], bad, good[1]],
                                                      transfer="fd", blobs=["library"]))
    assert [i.error["code"] if i.error else None for i in reply.items] == [
        None, "unknown_family", None]
    assert "no.such.family" in reply.items[1].error["message"]
    assert reply.fds == ["library", "library"] and reply.items[0].fds == ["library"]
    for item, request in ((reply.items[0], good[0]), (reply.items[2], good[1])):
        assert item.artifact.library_sha256 == c.get(request).library_sha256
    with pytest.raises(InvalidArgument, match="get_batch.requests"):
        p.GetBatchRequest(requests=[])
    wanted = [mm_fp4_requests[2], mm_fp4_requests[3], mm_fp4_requests[2]]
    fns = c.load_many(wanted, 600)
    assert all(map(callable, fns)) and fns[0] is fns[2] and fns[0] is not fns[1]
    assert c.load(mm_fp4_requests[3]) is fns[1]
    assert c.stats()["entries"] >= 4
