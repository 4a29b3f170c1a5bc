"""A ``get`` hit's reply is encoded once per stored row version (cached.artifacts.Served.
get_reply) and sent under each request's id: the bytes are those an encoding per request
writes, and a row replaced under the same key is never answered with the old one's reply."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct

import pytest
from cached_client import Client, writeback
from cached_client import protocol as p
from conftest import DaemonProcess, fault
from test_writeback_trust import build_object, jit_request


def test_a_frame_after_its_id_is_the_frame_encode_frame_writes():
    """protocol.frame_after_id(N, encode_after_id(m)) == encode_frame({"id": N, **m})."""
    members = {"ok": True, "artifact": {"key": "é\u2028", "n": 1.5, "list": [1, None]},
               "fds": ["library"]}
    for request_id in (0, 7, 1 << 60):
        assert p.frame_after_id(request_id, p.encode_after_id(members)) == p.encode_frame(
            {"id": request_id, **members})


def _get_frames(sock_path: str, message: dict, ids: tuple[int, ...]) -> list[bytes]:
    """The reply bodies, as sent, to ``message`` under each of ``ids`` on one connection
    (descriptors a transfer ``fd`` reply passes are closed)."""
    bodies = []
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(sock_path)
        for request_id in ids:
            s.sendall(p.encode_frame({"id": request_id, **message}))
            data = b""
            while len(data) < 4 or len(data) < 4 + struct.unpack(">I", data[:4])[0]:
                chunk, ancillary, _, _ = s.recvmsg(1 << 16, socket.CMSG_SPACE(64))
                assert chunk, "the daemon closed the connection"
                data += chunk
                for _, _, fds in ancillary:
                    for (fd,) in struct.iter_unpack("i", fds[:len(fds) - len(fds) % 4]):
                        os.close(fd)
            bodies.append(data[4:])
    return bodies


@pytest.mark.parametrize("transfer", ["fd", "path"])
def test_a_hit_reply_is_the_encoding_of_its_message_under_each_id(daemon, transfer):
    """The hits after the first send the reply encoded once, under their own id: the very
    bytes protocol.encode_frame writes for the reply they decode to, the same artifact
    whatever the id (an id that is no integer gets its reply encoded as any other)."""
    request = fault("build", f"encoded-{transfer}")
    fingerprint = daemon.client(timeout=10).hello().toolchain
    message = {"v": 1, "op": "get", **p.GetRequest(
        request=request, transfer=transfer, blobs=["library"], deadline_ms=60_000,
        identity=p.Identity(toolchain=fingerprint)).to_wire()}
    bodies = _get_frames(daemon.socket, message, (1, 2, 3, 12345))
    replies = [p.decode_body(b) for b in bodies]
    assert [r["artifact"]["origin"] for r in replies] == ["compiled", "hit", "hit", "hit"]
    assert [r["id"] for r in replies] == [1, 2, 3, 12345]
    for body, reply in zip(bodies, replies, strict=True):
        assert p.encode_frame(reply)[4:] == body
    assert all({**r, "id": 0} == {**replies[1], "id": 0} for r in replies[2:])
    assert replies[1]["fds"] == (["library"] if transfer == "fd" else [])
    (other,) = _get_frames(daemon.socket, {**message, "id": "one"}, (4,))
    assert {**json.loads(other), "id": 0} == {**replies[1], "id": 0}


@pytest.mark.parametrize("transfer", ["fd", "path"])
def test_a_rebuilt_row_is_never_answered_with_the_reply_encoded_for_the_old_one(
        daemon, transfer):
    """A blob corrupted after its hits were served (their reply encoded): the row is
    dropped and compiled again under the same key, a new version; the next hit states the
    new row (its compile time), not what was encoded for the old one."""
    request = fault("build", f"rebuilt-{transfer}")
    client = daemon.client(transfer=transfer)
    daemon.client(transfer="path").get(request)
    old = client.get(request)
    assert old.origin == "hit" and client.get(request) == old
    stored = daemon.client(transfer="path").get(request).library_path
    os.chmod(stored, 0o644)
    with open(stored, "r+b") as f:
        f.seek(64)
        f.write(b"\x00\xff\x00\xff")
    rebuilt = client.get(request)
    assert rebuilt.origin == "compiled" and rebuilt.compile_seconds != old.compile_seconds
    again = client.get(request)
    assert again.origin == "hit" and again.compile_seconds == rebuilt.compile_seconds
    assert again.library_sha256 == old.library_sha256  # the same bytes, built again


@pytest.mark.parametrize("transfer", ["fd", "path"])
def test_a_key_published_again_with_other_bytes_is_served_with_the_new_rows_digests(
        tmp_path, transfer):
    """A written-back kernel hit (its reply encoded), evicted, then published again under
    the same key with another object: the next hits name the new blobs, and their bytes
    are what the client copies and checks."""
    d = DaemonProcess(tmp_path, workers=1, ready_workers=0)
    try:
        fingerprint = d.client(timeout=10).hello().toolchain
        client = Client(d.socket, timeout=30, fallback=False, transfer=transfer,
                        identity=p.Identity(toolchain=fingerprint))
        request = jit_request(f"again_{transfer}")
        digests = []
        for name in ("first", "second"):
            obj = build_object(tmp_path, f"{name}_{transfer}", None)
            token = client.lease(p.LeaseRequest(request=request, wait_ms=0)).lease
            writeback.publish(client, request, obj.read_bytes(), lease=token)
            hits = [client.get(request) for _ in range(3)]
            assert [a.origin for a in hits] == ["hit"] * 3
            assert {a.object_sha256 for a in hits} == {
                hashlib.sha256(obj.read_bytes()).hexdigest()}
            for artifact in hits:
                with open(artifact.library_path, "rb") as f:
                    assert hashlib.sha256(f.read()).hexdigest() == artifact.library_sha256
            digests.append(hits[0].library_sha256)
            if name == "first":
                assert client.gc(p.GcRequest(max_bytes=1, grace=0)).entries == 0
        assert digests[0] != digests[1]
    finally:
        d.stop()


def test_the_reply_a_prewarm_encodes_for_a_load_is_the_reply_a_load_gets(daemon):
    """A pre-warm get (what ``cached warm`` sends: transfer path, every blob) also encodes
    the hit reply a client's ``load`` asks for (transfer fd, the library: Served.prime);
    the first load after it gets exactly the bytes its own reply encodes to, as a hit
    passing the library alone, under its own id."""
    request = fault("build", "primed")
    fingerprint = daemon.client(timeout=10).hello().toolchain
    identity = p.Identity(toolchain=fingerprint)
    warm = {"v": 1, "op": "get", **p.GetRequest(
        request=request, priority="prewarm", deadline_ms=60_000, identity=identity).to_wire()}
    (warmed,) = _get_frames(daemon.socket, warm, (1,))
    assert p.decode_body(warmed)["artifact"]["origin"] == "compiled"
    load = {"v": 1, "op": "get", **p.GetRequest(
        request=request, transfer="fd", blobs=["library"], deadline_ms=60_000,
        identity=identity).to_wire()}
    bodies = _get_frames(daemon.socket, load, (7, 8))
    replies = [p.decode_body(b) for b in bodies]
    assert [r["artifact"]["origin"] for r in replies] == ["hit", "hit"]
    assert [r["id"] for r in replies] == [7, 8]
    assert replies[0]["fds"] == ["library"]
    assert replies[0]["artifact"].get("library_path") is None  # passed, not named
    for body, reply in zip(bodies, replies, strict=True):
        assert p.encode_frame(reply)[4:] == body
    assert Client(daemon.socket, transfer="fd").get(request, blobs=("library",)).origin == "hit"
