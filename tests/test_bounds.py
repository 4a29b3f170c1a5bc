"""Issue 22's bounded waits and small ones, each as the hostile run found it: real daemons,
real interpreters registered with ``--toolchain``, real sockets between real processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys

import pytest
from conftest import DaemonProcess, raw_call


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """A daemon for protocol cases: one worker, not waited for (no compile needed)."""
    d = DaemonProcess(tmp_path_factory.mktemp("quick"), workers=1, ready_workers=0)
    yield d
    d.stop()


def _frames(sock_path: str, bodies: list[bytes]) -> tuple[list[dict], bool]:
    """Send these frame bodies back to back on one connection; every reply until the
    daemon closes it (or 10 s of silence), and whether it closed."""
    replies = []
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(sock_path)
        s.sendall(b"".join(struct.pack(">I", len(b)) + b for b in bodies))
        while True:
            try:
                header = s.recv(4, socket.MSG_WAITALL)
            except TimeoutError:
                return replies, False
            if len(header) < 4:
                return replies, True
            (n,) = struct.unpack(">I", header)
            replies.append(json.loads(s.recv(n, socket.MSG_WAITALL)))
            if len(replies) == len(bodies):
                s.settimeout(2)


def test_an_unknown_op_is_malformed_and_closes_the_connection(quick):
    """docs/protocol.md: an unknown ``op`` is ``malformed_frame`` and closes that connection
    (requests before it still answered). It was answered and the connection kept."""
    replies, closed = _frames(quick.socket, [
        b'{"id":1,"op":"hello"}', b'{"id":2,"op":"no_such_op"}', b'{"id":3,"op":"hello"}'])
    assert closed
    assert [r.get("id") for r in replies] == [1, 2], replies
    assert replies[0]["ok"] is True
    assert replies[1]["error"]["code"] == "malformed_frame"
    assert "unknown op 'no_such_op'" in replies[1]["error"]["message"]
    replies, closed = _frames(quick.socket, [b'{"id":4,"op":7}'])
    assert closed and replies[0]["error"]["code"] == "malformed_frame"
    assert raw_call(quick.socket, {"op": "hello"})["ok"] is True  # it serves on


@pytest.mark.parametrize("version", [True, 1.0, "1", [1]])
def test_a_version_that_only_equals_1_in_python_is_not_version_1(quick, version):
    """``"v": true`` and ``"v": 1.0`` passed as version 1 (``True == 1.0 == 1``): each is
    ``unsupported_version`` now, id echoed, the connection kept (nothing else is lost)."""
    replies, closed = _frames(quick.socket, [
        json.dumps({"id": 1, "op": "hello", "v": version}).encode(),
        b'{"id":2,"op":"hello","v":1}'])
    assert not closed
    assert replies[0]["id"] == 1 and replies[0]["error"]["code"] == "unsupported_version"
    assert "speaks 1" in replies[0]["error"]["message"]
    assert replies[1]["id"] == 2 and replies[1]["ok"] is True


KEPT = """
import json, os, signal, sys, time
from cached_client import Client, DaemonUnavailable
client = Client(sys.argv[1], timeout=600, fallback=False)  # what flashinfer.install() uses
client.hello()  # the connection is kept for the next call
os.kill(int(sys.argv[2]), signal.SIGSTOP)
out = {}
for i in range(2):
    t0 = time.monotonic()
    try:
        client.hello()
        out[f"call{i}"] = "answered"
    except DaemonUnavailable as exc:
        out[f"call{i}"] = exc.message
    out[f"seconds{i}"] = time.monotonic() - t0
print(json.dumps(out))
"""


def test_a_stopped_daemon_costs_a_call_on_a_kept_connection_one_silence_window(quick):
    """docs/design.md: a stopped daemon costs a process one silence window (3 s without a
    byte) and one hello probe (2 s), once. On a kept connection it cost two of each (about
    10 s): the silent kept connection was taken for one the daemon had closed and the call
    was tried again on a fresh one. Now the first call ends after one window and probe,
    and the next fails at once (the circuit is open)."""
    try:
        out = subprocess.run([sys.executable, "-c", KEPT, quick.socket, str(quick.proc.pid)],
                             capture_output=True, text=True, timeout=120)
    finally:
        os.kill(quick.proc.pid, signal.SIGCONT)
    result = json.loads(out.stdout)
    assert "went silent" in result["call0"], result
    assert 3 <= result["seconds0"] < 3 + 2 + 2.5, result  # one window and one probe
    assert "not asking the daemon" in result["call1"] and result["seconds1"] < 1, result
    assert raw_call(quick.socket, {"op": "hello"})["ok"] is True
