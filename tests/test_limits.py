"""Memory and fairness (issue 16 items 8 and 9): what one peer can make the daemon hold is
bounded, a slow reader gets back-pressure instead of memory, and each uid has quotas.

Limits are set through the environment (CACHED_<OPTION>), so the same test runs against a
daemon that predates them (and fails there)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
import resource
import socket
import struct
import subprocess
import time
from pathlib import Path

import pytest
from cached_client import InvalidArgument, KernelRequest
from cached_client import protocol as p
from conftest import ROOT, DaemonProcess, fault, wait_for
from test_access import PEER_PY, peer_uid, shared_dir  # noqa: F401 -- fixtures
from test_hostile_peer import as_peer as hostile

MIB = 1024


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def frame(obj: dict) -> bytes:
    body = json.dumps(obj).encode()
    return struct.pack(">I", len(body)) + body


def push(conns: list[socket.socket], data: dict[socket.socket, memoryview], seconds: float
         ) -> int:
    """Send what the daemon takes of each connection's data for ``seconds``; bytes sent."""
    sent, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline and any(data.values()):
        moved = 0
        for s in conns:
            if data[s]:
                try:
                    n = s.send(data[s])
                except BlockingIOError:
                    continue
                data[s] = data[s][n:]
                moved += n
        sent += moved
        if not moved:
            time.sleep(0.05)
    return sent


@pytest.fixture
def many_descriptors():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_thousand_almost_complete_1mib_frames_hold_bounded_memory(tmp_path,
                                                                     many_descriptors):
    """Item 8: 1,000 connections each sending a 1 MiB header and all but the last byte of
    its body took the daemon from 74 to 1,076 MiB. Frames over 4 KiB now wait for room
    (16 MiB per uid, 64 MiB in all) before their bodies are read."""
    d = DaemonProcess(tmp_path, workers=1, extra_env={
        "CACHED_MAX_CONNECTIONS": "4000", "CACHED_MAX_CONNECTIONS_PER_UID": "4000"})
    conns: list[socket.socket] = []
    try:
        before = rss_kib(d.proc.pid)
        data = {}
        for _ in range(1000):
            s = socket.socket(socket.AF_UNIX)
            s.connect(d.socket)
            s.setblocking(False)
            conns.append(s)
            data[s] = memoryview(struct.pack(">I", 1 << 20) + b"x" * ((1 << 20) - 1))
        sent = push(conns, data, 20)
        time.sleep(1)
        during = rss_kib(d.proc.pid)
        stats = d.client(timeout=10).stats()  # a well-behaved client is still served
        assert stats["connections"] >= 1000
        grew = (during - before) / MIB
        assert grew < 128, f"daemon RSS grew {grew:.0f} MiB holding partial frames ({sent} B)"
    finally:
        for s in conns:
            s.close()
        d.stop()


@pytest.fixture(scope="module")
def kernel_daemon(tmp_path_factory, mm_fp4_requests):
    d = DaemonProcess(tmp_path_factory.mktemp("limits"), workers=1)
    d.client(timeout=600).get(mm_fp4_requests[0])
    yield d, mm_fp4_requests[0]
    d.stop()


def test_a_slow_reader_gets_back_pressure_not_memory(kernel_daemon):
    """Item 8: 4,000 pipelined gets with transfer 'bytes' whose replies are never read took
    178 MiB. Now the daemon stops reading a connection while its replies wait unread (64
    requests in flight, 64 KiB unsent), and payloads stream from the file."""
    d, request = kernel_daemon
    before = rss_kib(d.proc.pid)
    frames = b"".join(frame({"op": "get", "id": i, "transfer": "bytes",
                             "request": request.to_wire()}) for i in range(4000))
    slow = socket.socket(socket.AF_UNIX)
    slow.connect(d.socket)
    slow.setblocking(False)
    try:
        sent = push([slow], {slow: memoryview(frames)}, 10)
        time.sleep(1)
        during = rss_kib(d.proc.pid)
        art = d.client(timeout=10).get(request)  # others are served meanwhile
        assert art.library_path and art.origin == "hit"
        grew = (during - before) / MIB
        assert grew < 32, f"daemon RSS grew {grew:.0f} MiB for one slow reader"
        assert sent < len(frames), "the daemon read every request of a peer that reads nothing"
    finally:
        slow.close()
    wait_for(lambda: d.client(timeout=10).stats()["connections"] == 1, 30)


PEER_PREFETCH = """
import json, sys
from cached_client import Client, KernelRequest
client = Client(sys.argv[1], timeout=30, fallback=False,
                identity=False)  # the system python: the daemon's toolchain decides
requests = [KernelRequest("cached.test.fault", {"action": "sleep", "seconds": 600,
                                                 "tag": f"peer{i}"}, "sm_100a", 148, 148)
            for i in range(int(sys.argv[2]))]
reply = client.prefetch(requests)
print(json.dumps({"queued": reply.queued, "in_flight": reply.in_flight,
                  "rejected": [r["error"]["code"] for r in reply.rejected]}))
"""

PEER_CONNECT = """
import json, socket, struct, sys
out, held = [], []
for i in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(sys.argv[1])
    body = json.dumps({"op": "hello", "id": i}).encode()
    s.sendall(struct.pack(">I", len(body)) + body)
    (n,) = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL))
    reply = json.loads(s.recv(n, socket.MSG_WAITALL))
    out.append("ok" if reply.get("ok") else reply["error"]["code"])
    held.append(s)
print(json.dumps(out), flush=True)
sys.stdin.read()
"""


def as_peer(uid: int, script: str, *args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([PEER_PY, "-c", script, *args], user=uid, group=uid,
                            env={"PYTHONPATH": str(ROOT / "client"), "PATH": "/usr/bin:/bin"},
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, **kwargs)


def test_a_peer_without_publish_rights_queues_at_most_its_quota(shared_dir, peer_uid):  # noqa: F811
    """Item 9: a peer without publish rights queued 3,000 compiles in one prefetch. Now it
    has max_queued_per_uid (5 here) queued or running; the rest are refused one by one as
    overloaded. An operator (publish rights) is not counted."""
    d = DaemonProcess(shared_dir, workers=1, extra_args=["--socket-mode", "666",
                                                         "--drain-timeout", "0"],
                      extra_env={"CACHED_MAX_QUEUED_PER_UID": "5"})
    try:
        peer = as_peer(peer_uid, PEER_PREFETCH, d.socket, "3000")
        result = json.loads(peer.communicate(timeout=60)[0])
        assert result["queued"] == 5 and len(result["rejected"]) == 2995
        assert set(result["rejected"]) == {"overloaded"}
        assert d.stats()["in_flight"] == 5
        again = json.loads(as_peer(peer_uid, PEER_PREFETCH, d.socket, "50")
                           .communicate(timeout=60)[0])
        assert again["queued"] == 0 and again["in_flight"] == 5 and len(again["rejected"]) == 45
        mine = d.client(timeout=30).prefetch(
            [fault("sleep", f"operator{i}", 600) for i in range(50)])
        assert mine.queued == 50 and not mine.rejected
    finally:
        d.stop()


PEER_GETS = """
import json, sys
from cached_client import CachedError, Client, KernelRequest
client = Client(sys.argv[1], timeout=1.5, fallback=False, identity=False)
def ask(params):
    try:
        return client.get(KernelRequest("cached.test.fault", params, "sm_100a", 148, 148)).origin
    except CachedError as exc:
        return exc.code
sleep = {"action": "sleep", "seconds": 600}
print(json.dumps([ask({**sleep, "tag": "peer0"}), ask({**sleep, "tag": "peer1"}),
                  ask({**sleep, "tag": "peer2"}), ask({**sleep, "tag": "peer0"}),
                  ask({"action": "build", "tag": "stored", "bytes": 100})]))
"""


def test_a_peer_without_publish_rights_gets_at_most_its_quota_compiled(shared_dir,  # noqa: F811
                                                                       peer_uid):  # noqa: F811
    """Item 9, through ``get``: the quota (2 here) is asked when a miss would be queued. Two
    misses queue (their deadlines pass, they keep compiling), a third distinct miss is
    refused as overloaded, a fourth joining a miss already in flight costs nothing, and a
    stored kernel is served as a hit."""
    d = DaemonProcess(shared_dir, workers=1, extra_args=["--socket-mode", "666",
                                                         "--drain-timeout", "0"],
                      extra_env={"CACHED_MAX_QUEUED_PER_UID": "2"})
    try:
        d.client(timeout=60).get(KernelRequest(  # an operator's: stored, not counted
            "cached.test.fault", {"action": "build", "tag": "stored", "bytes": 100},
            "sm_100a", 148, 148))
        peer = as_peer(peer_uid, PEER_GETS, d.socket)
        codes = json.loads(peer.communicate(timeout=60)[0])
        assert codes == ["deadline_exceeded", "deadline_exceeded", "overloaded",
                         "deadline_exceeded", "hit"]
        assert d.stats()["in_flight"] == 2
    finally:
        d.stop()


@pytest.fixture
def limited(shared_dir):  # noqa: F811
    """A daemon any uid may reach (none but root may publish); a uid's queue holds 4 jobs."""
    d = DaemonProcess(shared_dir, workers=1, extra_args=["--socket-mode", "666",
                                                         "--max-queued-per-uid", "4"])
    yield d
    d.stop()


def test_plans_count_in_the_peers_queue_and_are_dropped_when_it_hangs_up(
        limited, peer_uid, shared_dir):  # noqa: F811
    """The attack: 600 plans queued, then the requester hung up; they ran anyway and root's
    next compile waited 39.6 s. Now a uid's plans count against max_queued_per_uid (the
    fifth is overloaded), and once it hangs up its queued plans never run: root's plan
    right after finds at most the one that was running ahead of it."""
    mark = shared_dir / "plans-run"
    mark.touch()
    os.chmod(mark, 0o666)
    plan = {"family": "cached.test.fault", "shape": [1, 64, 64], "arch": "sm_100a",
            "options": {"mark": str(mark), "seconds": 1.0}}
    assert hostile(peer_uid, limited.socket, "plans", queued=4, plan=plan) == {
        "extra": "overloaded"}
    limited.client(timeout=60).plan("cached.test.fault", (2, 64, 64), "sm_100a", 148,
                                 {"mark": str(mark)})
    lines = mark.read_text().splitlines()
    assert lines[-1] == "(2, 64, 64)"
    assert len(lines) <= 2, lines  # at most one of the peer's ran (it had started)


def test_a_peers_reports_add_a_bounded_count_and_log_a_line_or_two(limited, peer_uid):  # noqa: F811
    """Issue 37 case 10: any peer's ``report`` pushed the counters behind two documented
    alerts to 4e9 and wrote about 26 MB/s of log. Now a uid adds at most REPORT_BUDGET
    (1000) a counter and family a minute, the rest counted as reports_clipped, and its
    report lines are logged once every 10 s."""
    family = "cached.test.fault"
    hostile(peer_uid, limited.socket, "report", family=family, times=300)
    stats = limited.stats()
    assert stats["client_fallbacks"] <= 1000
    assert stats["client_outside_kernels"] <= 1000
    lines = [line for line in limited.log_path.read_text().splitlines()
             if "client.fallbacks_reported" in line or "client.outside_kernels" in line]
    assert 1 <= len(lines) <= 4
    assert sum(len(line) for line in lines) < 20_000


def test_connections_per_uid_are_capped(shared_dir, peer_uid):  # noqa: F811
    """Item 9: one uid may hold max_connections_per_uid connections (4 here); the next is
    answered overloaded and closed; other uids are unaffected."""
    d = DaemonProcess(shared_dir, workers=1, extra_args=["--socket-mode", "666"],
                      extra_env={"CACHED_MAX_CONNECTIONS_PER_UID": "4"})
    try:
        peer = as_peer(peer_uid, PEER_CONNECT, d.socket, "6")
        codes = json.loads(peer.stdout.readline())
        assert codes == ["ok"] * 4 + ["overloaded"] * 2
        assert d.client(timeout=10).hello().v == 1  # root, meanwhile
        peer.communicate("", timeout=30)
    finally:
        d.stop()


def test_abandoned_uploads_expire(tmp_path):
    """Item 9: 50 abandoned partial uploads stayed in tmp/ until restart. Uploads.expire
    (run from the daemon's flush loop) removes them upload_timeout seconds (2 here) after
    their last chunk; a late chunk is told to start again."""
    d = DaemonProcess(tmp_path, workers=1, extra_env={"CACHED_UPLOAD_TIMEOUT": "2"})
    try:
        client = d.client(timeout=30)
        data = b"\x7fELF" + bytes(1000)
        sha = hashlib.sha256(data).hexdigest()
        requests = [KernelRequest("flashinfer.jit", {
            "module": "demo", "kernel": f"k{i}", "tvm_ffi": True, "source_sha256": "0" * 64},
            "sm_100a", 148, 148) for i in range(50)]
        tokens = [client.lease(p.LeaseRequest(request=r, wait_ms=0)).lease for r in requests]
        for request, token in zip(requests, tokens, strict=True):
            reply = client.publish(p.PublishRequest(
                request=request, object_sha256=sha, offset=0, final=False,
                data=base64.b64encode(data[:500]).decode(), lease=token))
            assert reply.state == "partial"
        assert len(os.listdir(d.store / "tmp")) == 50
        wait_for(lambda: not os.listdir(d.store / "tmp"), 30)
        with pytest.raises(InvalidArgument, match="start again at offset 0"):
            client.publish(p.PublishRequest(request=requests[0], object_sha256=sha,
                                            offset=500, final=True, lease=tokens[0],
                                            data=base64.b64encode(data[500:]).decode()))
    finally:
        d.stop()


def test_idle_and_stalled_connections_are_closed_and_the_client_reconnects(tmp_path):
    """Item 8's idle time: a connection with nothing in flight that stays silent for
    idle_timeout (1 s here) is closed, and so is one stalled mid-frame (with
    deadline_exceeded); a Client whose kept connection was closed reconnects silently."""
    d = DaemonProcess(tmp_path, workers=1, extra_env={"CACHED_IDLE_TIMEOUT": "1"})
    try:
        idle = socket.socket(socket.AF_UNIX)
        idle.settimeout(15)
        idle.connect(d.socket)
        idle.sendall(frame({"op": "hello", "id": 1}))
        (n,) = struct.unpack(">I", idle.recv(4, socket.MSG_WAITALL))
        assert json.loads(idle.recv(n, socket.MSG_WAITALL))["ok"] is True
        started = time.monotonic()
        assert idle.recv(1) == b""  # closed by the daemon
        assert time.monotonic() - started < 10
        stalled = socket.socket(socket.AF_UNIX)
        stalled.settimeout(15)
        stalled.connect(d.socket)
        stalled.sendall(struct.pack(">I", 100) + b'{"op": "hel')
        (n,) = struct.unpack(">I", stalled.recv(4, socket.MSG_WAITALL))
        reply = json.loads(stalled.recv(n, socket.MSG_WAITALL))
        assert reply["error"]["code"] == "deadline_exceeded"
        assert stalled.recv(1) == b""
        client = d.client(timeout=10, fallback=False)
        assert client.hello().v == 1
        time.sleep(2.5)  # the daemon closes the kept connection meanwhile
        assert client.hello().v == 1
    finally:
        d.stop()


def test_frame_room_grants_waiters_in_order_and_never_leaks_room():
    """FrameBudget (item 8's bound on partial frames): a release grants waiters in arrival
    order, each only if it fits, and wakes no other; a waiter cancelled right after its
    grant gives the room back; one that times out holds nothing and is forgotten."""
    from cached.server import FrameBudget

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        room = FrameBudget(per_uid=2, total=3)
        assert await room.reserve(1, 2, loop.time() + 1)  # uid 1 at its own limit
        assert await room.reserve(2, 1, loop.time() + 1)  # and the daemon full
        first = loop.create_task(room.reserve(2, 1, loop.time() + 5))  # needs total room
        second = loop.create_task(room.reserve(1, 1, loop.time() + 5))  # needs uid 1's
        late = loop.create_task(room.reserve(2, 1, loop.time() + 0.2))
        await asyncio.sleep(0.05)
        assert len(room._waiters) == 3
        asleep = set(room._waiters)
        room.release(1, 1)  # fits the first waiter only; the others stay asleep
        assert room.used == 3 and room.by_uid == {1: 1, 2: 2}
        assert len(room._waiters) == 2 and not any(f.done() for f in room._waiters)
        assert sum(f.done() for f in asleep) == 1
        assert await first is True and not second.done() and not late.done()
        assert await late is False and len(room._waiters) == 1  # timed out, forgotten
        room.release(2, 1)  # the second's turn; cancelled before it runs
        second.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await second
        assert room.used == 2 and room.by_uid == {1: 1, 2: 1} and not room._waiters

    asyncio.run(scenario())
