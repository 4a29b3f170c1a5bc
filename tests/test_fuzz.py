"""Hostile input: structured and raw-byte fuzzing of the socket protocol against a live
daemon. Every reply must be well-formed and the daemon must keep serving. The
benchmark run (bench/fuzz.py) sends 100,000 inputs; CI sends a few hundred."""

from __future__ import annotations

import json
import math
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


@pytest.mark.parametrize("cut", [2, 4, 30], ids=["in-header", "after-header", "in-body"])
def test_a_frame_cut_short_by_the_peers_half_close_is_told_malformed(fuzz_daemon, cut):
    """Found by bench/fuzz.py (pipelined frames, 50,000 examples): random bytes whose length
    header asked for more than followed, then a half-close, got no reply at all. The
    requests before such a frame are answered, then the peer is told why."""
    hello = frame({"op": "hello", "id": 1})
    cut_short = frame({"op": "hello", "id": 2, "pad": "x" * 100})[:cut]
    replies = exchange(fuzz_daemon.socket, hello + cut_short)
    assert [r["ok"] for r in replies] == [True, False], replies
    assert replies[0]["id"] == 1
    assert replies[1]["error"]["code"] == "malformed_frame"
    assert "middle of a frame" in replies[1]["error"]["message"]
    assert fuzz_daemon.client(timeout=10).hello().v == 1


# -- nesting, NaN and huge numbers, pipelining (issue 16 item 21; bench/fuzz.py runs these
# at benchmark size too) -------------------------------------------------------------------

def nested(depth: int, leaf: object = 0) -> object:
    value = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def nested_text(depth: int) -> str:
    """JSON nested ``depth`` deep without building it (json.dumps itself would recurse)."""
    return "[" * depth + "]" * depth


hostile_numbers = st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e999",
                                   str(2**63), str(-2**64), str(10**400), "1e-400"])
FIELDS = ["deadline_ms", "priority", "grace", "max_bytes", "sm_count", "ttl_s", "wait_ms",
          "offset", "id", "v"]


@st.composite
def hostile_frames(draw) -> bytes:
    """One request frame with a hostile number spliced in as raw JSON text, or nested deep."""
    op = draw(st.sampled_from(["get", "gc", "lease", "plan", "prefetch", "hello", "publish"]))
    kind = draw(st.sampled_from(["number", "deep", "deep_params"]))
    base = {"op": op, "id": 1, "request": {"family": "cached.test.fault", "params": {
        "action": "fail", "tag": "fuzz"}, "arch": "sm_100a", "sm_count": 148,
        "max_active_clusters": 148}}
    if kind == "number":
        text = json.dumps({**base, "hostile": 0})
        field = draw(st.sampled_from(FIELDS))
        number = draw(hostile_numbers)
        if field == "sm_count":
            text = text.replace('"sm_count": 148', f'"sm_count": {number}')
        else:
            text = text.replace('"hostile": 0', f'"{field}": {number}')
    elif kind == "deep":
        text = json.dumps(base)[:-1] + ', "params": ' + nested_text(
            draw(st.integers(30, 5000))) + "}"
    else:
        depth = draw(st.integers(30, 3000))
        text = json.dumps(base).replace('"tag": "fuzz"', '"tag": ' + nested_text(depth))
    body = text.encode()
    return struct.pack(">I", len(body)) + body


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=hostile_frames())
def test_nan_huge_numbers_and_deep_nesting_get_typed_errors(fuzz_daemon, data):
    replies = exchange(fuzz_daemon.socket, data)
    assert len(replies) == 1 and well_formed(replies[0]), replies
    if not replies[0]["ok"]:
        assert replies[0]["error"]["code"] != "internal", replies


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(frames=st.lists(st.one_of(st.builds(frame, requests), hostile_frames(),
                                 st.binary(min_size=4, max_size=40)), min_size=1, max_size=12))
def test_pipelined_frames_are_each_answered_in_any_order(fuzz_daemon, frames):
    """Frames sent back to back in one write (well-formed, hostile and raw bytes): at least
    one reply, none more than frames, every one well-formed, and the daemon stays up."""
    replies = exchange(fuzz_daemon.socket, b"".join(frames))
    assert 1 <= len(replies) <= len(frames)
    assert all(well_formed(r) for r in replies), replies
    assert fuzz_daemon.proc.poll() is None


def _reply_text(path: str, data: bytes) -> bytes:
    """Every byte the daemon answers ``data`` with (read until it closes)."""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(30)
    s.connect(path)
    try:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out
    finally:
        s.close()


def test_json_nested_thousands_deep_is_a_malformed_frame(fuzz_daemon):
    """Item 21: JSON nested thousands deep dropped the connection unanswered (RecursionError
    in the daemon's log); nested params gave internal."""
    for depth in (33, 1000, 100_000):
        text = b'{"op": "hello", "id": 3, "x": ' + nested_text(depth).encode() + b"}"
        replies = exchange(fuzz_daemon.socket, struct.pack(">I", len(text)) + text)
        assert [r["error"]["code"] for r in replies] == ["malformed_frame"], replies
    params = {"action": "fail", "tag": "x", "deep": nested(40)}
    get = {"op": "get", "id": 4, "request": {"family": "cached.test.fault", "params": params,
                                              "arch": "sm_100a", "sm_count": 148,
                                              "max_active_clusters": 148}}
    replies = exchange(fuzz_daemon.socket, frame(get))
    assert [r["error"]["code"] for r in replies] == ["malformed_frame"], replies
    assert fuzz_daemon.client(timeout=10).hello().v == 1


def test_priority_as_a_list_is_invalid_argument(fuzz_daemon):
    """Item 21: ``priority`` as a list gave internal: TypeError."""
    get = {"op": "get", "id": 5, "priority": ["interactive"], "request": {
        "family": "cached.test.fault", "params": {"action": "fail"}, "arch": "sm_100a",
        "sm_count": 148, "max_active_clusters": 148}}
    (reply,) = exchange(fuzz_daemon.socket, frame(get))
    assert reply["error"]["code"] == "invalid_argument" and "priority" in reply["error"]["message"]
    assert reply["id"] == 5


@pytest.mark.parametrize("op, field", [("get", "deadline_ms"), ("gc", "grace"),
                                       ("lease", "ttl_s"), ("lease", "wait_ms")])
@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_nan_and_infinity_in_requests_are_refused_and_never_echoed(fuzz_daemon, op, field,
                                                                    number):
    """Item 21: NaN or Infinity were accepted in deadline_ms and gc's grace and written back
    into replies. NaN/Infinity tokens are not JSON, and 1e999 is too large for a double:
    all are malformed_frame, refused at decode. No reply carries a non-finite number."""
    text = json.dumps({"op": op, "id": 6, field: 0, "request": {
        "family": "flashinfer.jit", "params": {"module": "m", "kernel": "k", "tvm_ffi": True,
                                               "source_sha256": "0" * 64},
        "arch": "sm_100a", "sm_count": 148, "max_active_clusters": 148}})
    text = text.replace(f'"{field}": 0', f'"{field}": {number}').encode()
    raw = _reply_text(fuzz_daemon.socket, struct.pack(">I", len(text)) + text)
    (n,) = struct.unpack(">I", raw[:4])
    assert len(raw) == 4 + n  # one reply, then the connection closed

    def not_json(token: str) -> None:
        raise AssertionError(f"the reply carries {token}")

    reply = json.loads(raw[4:], parse_constant=not_json,
                       parse_float=lambda t: math.isfinite(float(t)) and float(t) or not_json(t))
    assert reply["error"]["code"] == "malformed_frame"


def test_an_sm_count_of_2_pow_63_costs_no_compile(fuzz_daemon):
    """Item 21: sm_count 2^63 passed validation, cost a compile, then failed publishing."""
    before = fuzz_daemon.stats()
    for field in ("sm_count", "max_active_clusters"):
        request = {"family": "flashinfer.mm_fp4", "params": {}, "arch": "sm_100a",
                   "sm_count": 148, "max_active_clusters": 148, field: 2**63}
        for message in ({"op": "get", "id": 8, "request": request},
                        {"op": "prefetch", "id": 9, "requests": [request]}):
            (reply,) = exchange(fuzz_daemon.socket, frame(message))
            if message["op"] == "get":
                assert reply["error"]["code"] == "invalid_argument", reply
                assert field in reply["error"]["message"]
            else:
                assert reply["queued"] == 0 and reply["rejected"][0]["error"]["code"] == \
                    "invalid_argument", reply
    after = fuzz_daemon.stats()
    assert after["compiles"] == before["compiles"] and after["misses"] == before["misses"]
    assert after["in_flight"] == before["in_flight"]


def test_a_malformed_frame_does_not_cancel_earlier_requests(fuzz_daemon):
    """Item 21: a malformed frame cancelled the well-formed requests still pending on the
    same connection; now they are answered first, then the malformed frame, then close."""
    get = {"op": "get", "id": 10, "deadline_ms": 20_000, "request": {
        "family": "cached.test.fault", "params": {"action": "sleep", "seconds": 1,
                                                  "tag": "before-malformed"},
        "arch": "sm_100a", "sm_count": 148, "max_active_clusters": 148}}
    data = frame(get) + frame({"op": "hello", "id": 11}) + struct.pack(">I", 5) + b"{oops"
    replies = exchange(fuzz_daemon.socket, data)
    by_id = {r.get("id"): r for r in replies}
    assert set(by_id) == {10, 11, None}, replies
    assert by_id[10]["error"]["code"] == "compile_failed"  # its compile ran: it was waited for
    assert by_id[11]["ok"] is True
    assert by_id[None]["error"]["code"] == "malformed_frame"
    assert replies[-1] is by_id[None]


@pytest.mark.parametrize("option", ["--evict-grace", "--drain-timeout", "--job-timeout",
                                    "--idle-timeout", "--upload-timeout"])
@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_nan_and_infinity_settings_are_refused_before_anything_binds(tmp_path, option, value):
    """Item 21: NaN/Infinity were accepted in evict_grace and drain_timeout. Now every
    seconds setting is refused with its name, before a socket exists."""
    import subprocess
    import sys

    sock = tmp_path / "cached.sock"
    out = subprocess.run([sys.executable, "-m", "cached", "serve", "--socket", str(sock),
                          "--store", str(tmp_path / "store"), "--no-http", option, value],
                         capture_output=True, text=True, timeout=60)
    name = option[2:].replace("-", "_")
    assert out.returncode == 2 and name in out.stderr and "Traceback" not in out.stderr
    assert not sock.exists() and not (tmp_path / "store").exists()
