"""End to end: real daemon process, real socket, real compiles, real store."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import struct
import time

import pytest
from cached_client import (
    Client,
    CompileFailed,
    InvalidArgument,
    InvalidTactic,
    KernelRequest,
    UnknownFamily,
    UnsupportedVersion,
)
from conftest import SHAPE, DaemonProcess, fault, raw_call, run_cli

from cached.store.store import Store


def warm_json(daemon: DaemonProcess, limit: int) -> dict:
    out = run_cli("warm", "--socket", daemon.socket, "--family", "flashinfer.mm_fp4",
                  "--arch", "sm_100a", "--shape", ",".join(map(str, SHAPE)),
                  "--limit", str(limit), "--json").stdout
    return json.loads(out.strip().splitlines()[-1])


def test_cold_then_warm_warm_up_compiles_nothing_the_second_time(daemon):
    cold = warm_json(daemon, 4)
    assert (cold["compiled"], cold["cached"], cold["failed"]) == (4, 0, 0)
    warm = warm_json(daemon, 4)
    assert (warm["compiled"], warm["cached"], warm["failed"]) == (0, 4, 0)
    stats = daemon.stats()
    assert stats["compiles"] == 4 and stats["entries"] == 4 and stats["prewarm_hits"] == 4
    assert (stats["hits"], stats["misses"], stats["prewarm_misses"]) == (0, 0, 4)  # warm-ups
    listed = run_cli("ls", "--socket", daemon.socket, "--json").stdout
    assert {e["family"] for e in json.loads(listed)} == {"flashinfer.mm_fp4"}


def _get_all(socket_path: str, wires: list[dict], barrier) -> list[str]:
    client = Client(socket_path, timeout=300)
    barrier.wait()
    return [client.get(KernelRequest.from_wire(w)).library_sha256 for w in wires]


def test_eight_processes_asking_at_once_cause_one_compile_per_kernel(daemon, mm_fp4_requests):
    wires = [r.to_wire() for r in mm_fp4_requests[10:16]]
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Manager().Barrier(8)
    with ctx.Pool(8) as pool:
        results = pool.starmap(_get_all, [(daemon.socket, wires[i:] + wires[:i], barrier)
                                          for i in range(8)])
    assert len({frozenset(r) for r in results}) == 1
    stats = daemon.stats()
    assert stats["compiles"] == 6
    assert stats["hits"] + stats["misses"] == 48


def test_restarted_daemon_serves_what_it_had(tmp_path, mm_fp4_requests):
    first = DaemonProcess(tmp_path)
    try:
        art = first.client().get(mm_fp4_requests[0])
        assert art.origin == "compiled"
    finally:
        first.stop()
    second = DaemonProcess(tmp_path)
    try:
        again = second.client().get(mm_fp4_requests[0])
        assert again.origin == "hit" and again.library_sha256 == art.library_sha256
        assert second.stats()["compiles"] == 0
    finally:
        second.stop()


def test_kill9_during_compilation_leaves_a_store_that_verifies_and_no_orphans(
        tmp_path, mm_fp4_requests):
    d = DaemonProcess(tmp_path)
    client = d.client()
    client.prefetch(mm_fp4_requests[20:30])
    deadline = time.monotonic() + 60
    while d.stats()["compiles"] < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    workers = d.worker_pids()
    assert workers
    d.kill9()
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{p}") for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in workers if os.path.exists(f"/proc/{p}")], "orphaned workers"
    store = Store(tmp_path / "store")
    store.scan()
    rows = store.rows()
    assert len(rows) >= 2
    assert all(store.lookup(r.key) is not None for r in rows)
    assert not list((tmp_path / "store" / "tmp").iterdir())
    store.close()
    restarted = DaemonProcess(tmp_path)
    try:
        assert restarted.client().get(mm_fp4_requests[20]).origin in ("hit", "compiled")
    finally:
        restarted.stop()


@pytest.mark.parametrize("times_put_back", [False, True], ids=["written", "times-put-back"])
def test_corrupted_blob_is_detected_and_recompiled_never_served(daemon, mm_fp4_requests,
                                                                 times_put_back):
    """Also when the blob was served (so checked) just before, and its modification time is
    put back after the write: the daemon re-hashes any blob whose file changed at all."""
    client = daemon.client(transfer="path")  # the store's blob itself is corrupted here
    art = client.get(mm_fp4_requests[1])
    assert client.get(mm_fp4_requests[1]).origin == "hit"  # checked, remembered as checked
    before = os.stat(art.library_path)
    os.chmod(art.library_path, 0o644)
    with open(art.library_path, "r+b") as f:
        f.seek(100)
        f.write(b"\x00\xff\x00\xff")
    if times_put_back:
        os.chmod(art.library_path, before.st_mode)
        os.utime(art.library_path, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert os.stat(art.library_path).st_mtime_ns == before.st_mtime_ns
    again = client.get(mm_fp4_requests[1])
    assert again.origin == "compiled"
    assert again.library_sha256 == art.library_sha256
    with open(again.library_path, "rb") as f:
        import hashlib
        assert hashlib.sha256(f.read()).hexdigest() == art.library_sha256
    assert daemon.stats()["compiles"] == 2


def test_a_remembered_request_never_answers_one_that_differs_only_in_json_type(
        daemon, mm_fp4_requests):
    """The daemon remembers how each request resolves; ``1`` where the family wants
    ``true`` is still refused after the ``true`` one was served (Python's 1 == True)."""
    client = daemon.client(transfer="path")
    request = mm_fp4_requests[0]
    assert request.params["enable_pdl"] is True
    client.get(request)
    wire = request.to_wire()
    wire["params"]["enable_pdl"] = 1
    with pytest.raises(InvalidTactic, match="enable_pdl=1"):
        client.get(KernelRequest.from_wire(wire))
    assert client.get(request).origin == "hit"


def _pipelined(sock_path: str, bodies: list[bytes]) -> list[dict]:
    """Send these frame bodies back to back on one connection; their replies as they came."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(sock_path)
        s.sendall(b"".join(struct.pack(">I", len(b)) + b for b in bodies))
        replies = []
        for _ in bodies:
            (n,) = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL))
            replies.append(json.loads(s.recv(n, socket.MSG_WAITALL)))
    return replies


def test_a_remembered_frame_answers_only_frames_equal_to_it_but_for_their_id(
        daemon, mm_fp4_requests):
    """The server remembers decoded get frames by their bytes after a leading id
    (cached.frames.DecodedFrameCache): the same frame under another id is answered with that id;
    a frame that differs anywhere else (a JSON type; a second "id", which JSON makes the
    frame's id) is decoded as itself, before and after it was seen."""
    request = mm_fp4_requests[0]
    stored = daemon.client(transfer="path").get(request)

    def frame(leading: int, **changes: object) -> bytes:
        wire = request.to_wire()
        wire["params"].update(changes.pop("params", {}))
        rest = json.dumps({"op": "get", "transfer": "path", "request": wire, **changes},
                          separators=(",", ":"), sort_keys=True)
        return b'{"id":%d,' % leading + rest[1:].encode()

    for _ in range(2):  # the second round finds every well-formed frame remembered
        replies = _pipelined(daemon.socket, [
            frame(1), frame(2), frame(3, params={"enable_pdl": 1}), frame(9, id=9),
            frame(5, id=9), frame(6, v=99)])
        by_id: dict = {}
        for reply in replies:
            by_id.setdefault(reply.get("id"), []).append(reply)
        assert sorted(by_id) == [1, 2, 3, 6, 9], by_id.keys()
        for i in (1, 2):
            assert by_id[i][0]["ok"] and by_id[i][0]["artifact"]["key"] == stored.key
        assert by_id[3][0]["error"]["code"] == "invalid_tactic"
        assert "enable_pdl=1" in by_id[3][0]["error"]["message"]
        assert [r["ok"] for r in by_id[9]] == [True, True]  # JSON's last "id" wins, both times
        assert by_id[6][0]["error"]["code"] == UnsupportedVersion.code


def test_remembered_frames_are_bounded_and_only_well_formed_ones_are_kept():
    """At most MOST frames of at most LONGEST bytes are held; a frame whose leading id is
    not its id (a second "id" further on), or that is not in the leading-id form, is not."""
    from cached_client import protocol as p

    from cached.server import DecodedFrameCache

    remembered = DecodedFrameCache()
    remembered.MOST = 2
    op = p.OPS["get"]
    request = object()  # what the op's checks gave; recall hands back the same object

    def remember(body: bytes) -> None:
        remembered.remember(body, json.loads(body), op, request)

    remember(b'{"id":1,"op":"get","x":1}')
    assert remembered.recall(b'{"id":77,"op":"get","x":1}') == (77, op, request)
    assert remembered.recall(b'{"id":77,"op":"get","x":1.0}') is None
    assert remembered.recall(b'{"id":077,"op":"get","x":1}') is None  # not a JSON number
    remember(b'{"id":1,"id":2,"op":"get","x":2}')  # its id is 2: not remembered
    remember(b'{"id":1,"op":"get","\\u0069d":1,"x":6}')  # a second id, spelled with escapes
    assert remembered.recall(b'{"id":4,"op":"get","\\u0069d":1,"x":6}') is None
    remember(b'{"op":"get","id":1,"x":3}')  # no leading id
    remember(b'{"id":1,"op":"get","x":"' + b"y" * DecodedFrameCache.LONGEST + b'"}')
    assert len(remembered) == 1
    remember(b'{"id":1,"op":"get","x":4}')
    remember(b'{"id":1,"op":"get","x":5}')  # full: starts over
    assert len(remembered) <= DecodedFrameCache.MOST
    assert remembered.recall(b'{"id":3,"op":"get","x":5}') == (3, op, request)


def test_the_clients_frames_are_the_ones_the_daemon_remembers(mm_fp4_requests):
    """cached_client writes a frame's integer id first (protocol.encode_frame), so two gets
    of the same kernel differ only in the id's digits, the form DecodedFrameCache recalls."""
    from cached_client import protocol as p

    from cached.server import DecodedFrameCache

    get = p.GetRequest(request=mm_fp4_requests[0], transfer="fd", deadline_ms=1000)
    frames = [p.encode_frame({"v": 1, "op": "get", **get.to_wire(), "id": i})[4:]
              for i in (7, 12345)]
    remembered = DecodedFrameCache()
    remembered.remember(frames[0], p.decode_body(frames[0]), p.OPS["get"], get)
    assert remembered.recall(frames[1]) == (12345, p.OPS["get"], get)
    assert p.decode_body(frames[1]) == {"v": 1, "op": "get", **get.to_wire(), "id": 12345}


def _raw(sock_path: str, data: bytes) -> tuple[dict | None, bool]:
    """Send raw bytes; the first reply and whether the daemon then closed the connection."""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(sock_path)
    s.sendall(data)
    header = s.recv(4, socket.MSG_WAITALL)
    reply = None
    if len(header) == 4:
        (n,) = struct.unpack(">I", header)
        reply = json.loads(s.recv(n, socket.MSG_WAITALL))
    closed = s.recv(1) == b""
    s.close()
    return reply, closed


def test_bad_input_gets_typed_errors_and_the_daemon_keeps_serving(daemon, mm_fp4_requests):
    reply, closed = _raw(daemon.socket, struct.pack(">I", 5) + b"nope!")
    assert reply["error"]["code"] == "malformed_frame" and closed
    reply, closed = _raw(daemon.socket, struct.pack(">I", 50 << 20))
    assert reply["error"]["code"] == "malformed_frame" and "limit" in reply["error"]["message"]
    assert closed
    reply, _ = _raw(daemon.socket, struct.pack(">I", 2) + b"[]")
    assert reply["error"]["code"] == "malformed_frame"

    client = daemon.client()
    reply = raw_call(daemon.socket, {"op": "hello", "v": 99})
    assert reply["error"]["code"] == UnsupportedVersion.code
    assert "speaks 1" in reply["error"]["message"]
    good = mm_fp4_requests[2].to_wire()
    with pytest.raises(UnknownFamily, match="flashinfer.mm_fp4"):
        client.get(KernelRequest.from_wire({**good, "family": "no.such"}))
    bad_params = {**good["params"], "mma_tiler_mn": [256, 64], "cluster_shape_mn": [1, 1]}
    with pytest.raises(InvalidTactic, match="even cluster M"):
        client.get(KernelRequest.from_wire({**good, "params": bad_params}))
    with pytest.raises(CompileFailed, match="injected failure"):
        client.get(fault("fail", tag="typed"))
    reply = raw_call(daemon.socket, {"op": "plan", "family": "flashinfer.mm_fp4",
                                     "shape": [1, 2], "arch": "sm_100a"})
    assert reply["error"]["code"] == InvalidArgument.code and "shape" in reply["error"]["message"]
    reply = raw_call(daemon.socket, {"op": "get", "request": good, "priority": ["x"]})
    assert reply["error"]["code"] == InvalidArgument.code
    assert "priority" in reply["error"]["message"]
    assert client.get(mm_fp4_requests[2]).origin == "compiled"
    stats = daemon.stats()
    assert stats["errors"]["malformed_frame"] == 3 and stats["failures"] == 1
    assert stats["workers_alive"] == 2
