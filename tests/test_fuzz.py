"""Hostile input: structured and raw-byte fuzzing of the socket protocol against a live
daemon. Every reply must be well-formed and the daemon must keep serving. The
benchmark run (bench/fuzz.py) sends 100,000 inputs; CI sends a few hundred."""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from pathlib import Path

import pytest
from cached_client.errors import ERROR_CODES
from cached_client.protocol import OPS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12,
)
requests = st.fixed_dictionaries(
    {"op": st.sampled_from([*OPS, "bogus", "certify_record", "certifications"])},
    optional={"v": st.integers(-1, 3) | st.text(max_size=3), "id": json_values,
              "request": json_values | st.fixed_dictionaries(
                  {"family": st.sampled_from(["flashinfer.mm_fp4", "cached.hopper_fp8", "x"]),
                   "params": json_values, "arch": st.sampled_from(["sm_100a", "sm_90a", "z"]),
                   "sm_count": st.integers(-5, 300), "max_active_clusters": st.integers(-5, 300)}),
              "requests": st.lists(json_values, max_size=3), "shape": json_values,
              "deadline_ms": st.integers(-10, 50) | st.floats(allow_nan=False),
              "transfer": st.sampled_from(["path", "bytes", "x"]),
              "priority": st.sampled_from(["interactive", "prewarm", "x"]),
              "family": st.text(max_size=10), "record": json_values},
)


def exchange(path: str, data: bytes) -> list[dict]:
    """Send raw bytes, half-close, and read every reply frame until the daemon closes."""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(15)
    s.connect(path)
    try:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        replies = []
        while True:
            header = s.recv(4, socket.MSG_WAITALL)
            if len(header) < 4:
                return replies
            (n,) = struct.unpack(">I", header)
            reply = json.loads(s.recv(n, socket.MSG_WAITALL))
            if "payload_size" in reply:
                s.recv(reply["payload_size"], socket.MSG_WAITALL)
            replies.append(reply)
    finally:
        s.close()


def well_formed(reply: dict) -> bool:
    if reply.get("ok") is True:
        return True
    return reply.get("ok") is False and reply["error"]["code"] in ERROR_CODES \
        and isinstance(reply["error"]["message"], str)


def frame(obj: dict) -> bytes:
    body = json.dumps(obj).encode()
    return struct.pack(">I", len(body)) + body


EXAMPLES = int(os.environ.get("CACHED_FUZZ_EXAMPLES", "300"))


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


@pytest.fixture(scope="module")
def fuzz_daemon(tmp_path_factory):
    from conftest import DaemonProcess

    d = DaemonProcess(tmp_path_factory.mktemp("fuzz"), workers=1)
    before = rss_kib(d.proc.pid)
    yield d
    report = os.environ.get("CACHED_FUZZ_REPORT")
    if report:
        Path(report).write_text(json.dumps({
            "examples_per_test": EXAMPLES, "rss_kib_before": before,
            "rss_kib_after": rss_kib(d.proc.pid), "daemon_alive": d.proc.poll() is None,
            "errors": d.stats()["errors"]}))
    d.stop()


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(message=requests)
def test_structured_frames_get_well_formed_replies(fuzz_daemon, message):
    message.setdefault("deadline_ms", 20)
    replies = exchange(fuzz_daemon.socket, frame(message))
    assert len(replies) == 1 and well_formed(replies[0]), replies


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.binary(max_size=64) | st.builds(
    lambda n, body: struct.pack(">I", n) + body, st.integers(0, 2**32 - 1),
    st.binary(max_size=32)))
def test_raw_bytes_never_crash_the_daemon(fuzz_daemon, data):
    for reply in exchange(fuzz_daemon.socket, data):
        assert well_formed(reply), reply
    assert fuzz_daemon.proc.poll() is None


def test_slow_and_oversize_clients_cost_others_nothing(fuzz_daemon):
    slow = socket.socket(socket.AF_UNIX)
    slow.connect(fuzz_daemon.socket)
    slow.sendall(struct.pack(">I", 200))
    big = socket.socket(socket.AF_UNIX)
    big.connect(fuzz_daemon.socket)
    big.sendall(struct.pack(">I", 1 << 31))
    client = fuzz_daemon.client(timeout=5)
    started = time.monotonic()
    for _ in range(50):
        slow.send(b"x")
        client.stats()
    assert time.monotonic() - started < 5
    assert json.loads(big.recv(4096)[4:])["error"]["code"] == "malformed_frame"
    slow.close()
    big.close()
    stats = client.stats()
    assert stats["workers_alive"] == 1


def test_a_request_still_pending_at_the_peers_half_close_is_answered(fuzz_daemon):
    """Found by the fuzzer: a get that had to wait was cancelled when its peer shut its
    sending side, so the peer read nothing."""
    message = {"op": "get", "id": 7, "deadline_ms": 30, "request": {
        "family": "cached.test.fault", "params": {"action": "sleep", "seconds": 5,
                                                  "tag": "half-close"},
        "arch": "sm_100a", "sm_count": 148, "max_active_clusters": 148}}
    replies = exchange(fuzz_daemon.socket, frame(message))
    assert len(replies) == 1 and replies[0]["error"]["code"] == "deadline_exceeded"
    assert replies[0]["id"] == 7
