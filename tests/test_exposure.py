"""Store and HTTP exposure, and peers that cannot swell the daemon (issue 22): what a local
user the socket refuses, a web page in a browser on the node, or an unprivileged peer can
reach. Real daemons, real uvicorn, a second uid created for the test (root is needed)."""

from __future__ import annotations

import json
import os
import pwd
import socket
import stat
import subprocess
import urllib.request
from pathlib import Path

import pytest
from conftest import ROOT, DaemonProcess
from test_access import PEER_PY, peer_uid, shared_dir  # noqa: F401 -- fixtures

READ_STORE = """
import json, os, sys
out = {}
for name in ("index.sqlite", "blobs"):
    try:
        path = os.path.join(sys.argv[1], name)
        open(path, "rb").read(16) if name.endswith("sqlite") else os.listdir(path)
        out[name] = "read"
    except PermissionError:
        out[name] = "denied"
print(json.dumps(out))
"""


def read_store_as(uid: int, gid: int, store: Path) -> dict:
    out = subprocess.run([PEER_PY, "-c", READ_STORE, str(store)], user=uid, group=gid,
                         extra_groups=[], capture_output=True, text=True, check=True, timeout=30)
    return json.loads(out.stdout)


def store_mode(d: DaemonProcess) -> tuple[int, int]:
    st = os.stat(d.store)
    return stat.S_IMODE(st.st_mode), st.st_gid


def test_the_store_is_readable_only_by_users_the_socket_admits(shared_dir, peer_uid):  # noqa: F811
    """A user the socket refuses read index.sqlite and listed blobs/ (the store was 0755).
    Now the store directory follows the socket: 0660 (its group may connect) gives 0750 with
    the socket's group, an allow_gid alone 0750 with that group, a socket anyone may use
    0755; the refused user reads nothing, a member of the admitted group does."""
    peer_gid = pwd.getpwuid(peer_uid).pw_gid
    (shared_dir / "a").mkdir(mode=0o755)
    d = DaemonProcess(shared_dir / "a", workers=1, ready_workers=0)
    try:
        assert store_mode(d) == (0o750, os.stat(d.socket).st_gid)
        assert read_store_as(peer_uid, peer_gid, d.store) == {"index.sqlite": "denied",
                                                              "blobs": "denied"}
    finally:
        d.stop()
    (shared_dir / "b").mkdir(mode=0o755)
    d = DaemonProcess(shared_dir / "b", workers=1, ready_workers=0, extra_args=[
        "--socket-mode", "666", "--allow-gid", str(peer_gid), "--allow-uid", "0"])
    try:
        assert store_mode(d) == (0o750, peer_gid)
        assert read_store_as(peer_uid, peer_gid, d.store) == {"index.sqlite": "read",
                                                              "blobs": "read"}
        assert read_store_as(peer_uid, 0xfffe, d.store)["index.sqlite"] == "denied"
    finally:
        d.stop()
    (shared_dir / "c").mkdir(mode=0o755)
    d = DaemonProcess(shared_dir / "c", workers=1, ready_workers=0,
                      extra_args=["--socket-mode", "600"])
    try:
        assert store_mode(d)[0] == 0o700
    finally:
        d.stop()


def http_get(address: str, host: str | None, path: str = "/healthz",
             extra: str = "") -> tuple[int, str]:
    """One HTTP/1.1 request on a raw connection to ``address`` with ``Host: host`` (None:
    no Host header); (status, body)."""
    hostname, _, port = address.rpartition(":")
    with socket.create_connection((hostname, int(port)), timeout=10) as conn:
        head = f"GET {path} HTTP/1.1\r\n" + (f"Host: {host}\r\n" if host is not None else "")
        conn.sendall((head + extra + "Connection: close\r\n\r\n").encode())
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    header, _, body = data.partition(b"\r\n\r\n")
    return int(header.split()[1]), body.decode(errors="replace")


@pytest.fixture(scope="module")
def http_daemon(tmp_path_factory):
    d = DaemonProcess(tmp_path_factory.mktemp("exposure"), workers=1, ready_workers=0)
    yield d
    d.stop()


def test_http_refuses_a_host_that_is_not_its_address(http_daemon):
    """DNS rebinding: a page in a browser on the node makes its own name resolve to
    127.0.0.1 and reads /stats or /metrics; its requests say that name in Host. Now they
    get 421 with a body saying why; the address itself (and localhost) is served."""
    address = http_daemon.stats()["http"]
    port = address.rpartition(":")[2]
    for path in ("/stats", "/metrics", "/", "/healthz"):
        status, body = http_get(address, f"rebind.attacker.example:{port}", path)
        assert status == 421, (path, status, body[:200])
        assert "is not this endpoint's address" in body and address in body
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST.:{port}", "127.0.0.1",
                 "127.0.0.1:9000"):  # the port is not the name: a container maps it
        assert http_get(address, host)[0] == 200, host
    for host in (f"10.1.2.3:{port}", f"[::1]:{port}", "127.0.0.1:x", f"127.0.0.1:{port}:1",
                 f"127.0.0.1.rebind.example:{port}", f"localhost.attacker.example:{port}"):
        assert http_get(address, host)[0] == 421, host
    assert http_get(address, None)[0] in (400, 421)  # HTTP/1.1 without Host
    status, body = http_get(address, f"127.0.0.1:{port}", extra=f"Host: evil:{port}\r\n")
    assert status in (400, 421)  # two Host headers: never served
    with urllib.request.urlopen(f"http://{address}/stats", timeout=10) as reply:
        assert reply.status == 200  # what clients (urllib, Prometheus) send is served


PEER_REPORTS = """
import json, sys
from cached_client import Client
from cached_client.errors import UnknownFamily
client = Client(sys.argv[1], timeout=30, fallback=False, identity=False)
refused = 0
for i in range(300):
    try:
        client.report({f"x{i:03d}-{j}-" + "f" * 150: 1000 for j in range(64)})
    except UnknownFamily:
        refused += 1
print(json.dumps(refused))
"""


def test_reports_of_unregistered_families_cannot_grow_metrics_or_stats(shared_dir,  # noqa: F811
                                                                        peer_uid):  # noqa: F811
    """300 reports of 64 fresh family names each, from a peer without publish rights, grew
    /metrics to hundreds of MB. Now only registered families get rows: /metrics and /stats
    stay the size they were (a few digits): a report naming a family the daemon does not have
is refused (unknown_family) and counts nothing."""
    d = DaemonProcess(shared_dir, workers=1, ready_workers=0,
                      extra_args=["--socket-mode", "666"])
    try:
        address = d.stats()["http"]

        def sizes() -> tuple[int, int, int]:
            with urllib.request.urlopen(f"http://{address}/metrics", timeout=60) as r:
                metrics = len(r.read())
            with urllib.request.urlopen(f"http://{address}/stats", timeout=60) as r:
                public = len(r.read())
            return metrics, public, len(json.dumps(d.stats()))

        before = sizes()
        out = subprocess.run([PEER_PY, "-c", PEER_REPORTS, d.socket], user=peer_uid,
                             group=peer_uid, env={"PYTHONPATH": str(ROOT / "client"),
                                                  "PATH": "/usr/bin:/bin"},
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        after = sizes()
        assert all(a <= b + 2048 for a, b in zip(after, before, strict=True)), (before, after)
        assert json.loads(out.stdout.splitlines()[-1]) == 300
        stats = d.stats()
        assert stats["client_fallbacks"] == 0
        assert not any(f.startswith("x") for f in stats["families"])
    finally:
        d.stop()
