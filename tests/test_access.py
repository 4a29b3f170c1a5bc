"""Access: socket file mode, SO_PEERCRED allowlists, publish rights, with a second user."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from conftest import ROOT, DaemonProcess

USER = "cachedtest"
PEER_PY = shutil.which("python3", path="/usr/bin:/bin")
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not PEER_PY or not shutil.which("useradd"),
                                reason="needs root, useradd and a system python3")

PEER_SCRIPT = """
import json, sys
from cached_client import Client
from cached_client.errors import CachedError
out = {}
for op in ("stats", "certify_record"):
    try:
        client = Client(sys.argv[1], timeout=5, fallback=False)
        client.stats() if op == "stats" else client.certify_record({})
        out[op] = "ok"
    except CachedError as exc:
        out[op] = exc.code
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def peer_uid() -> int:
    try:
        return pwd.getpwnam(USER).pw_uid
    except KeyError:
        # another test process (pytest -n) may be adding it at the same moment
        subprocess.run(["useradd", "--system", "--no-create-home", USER], capture_output=True)
        return pwd.getpwnam(USER).pw_uid


def as_peer(uid: int, socket_path: str) -> dict:
    out = subprocess.run([PEER_PY, "-c", PEER_SCRIPT, socket_path], user=uid, group=uid,
                         env={"PYTHONPATH": str(ROOT / "client"), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, check=True, timeout=30)
    return json.loads(out.stdout)


@pytest.fixture
def shared_dir():
    d = Path(tempfile.mkdtemp(prefix="cached-access-"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def start(shared_dir: Path, *args: str) -> DaemonProcess:
    return DaemonProcess(shared_dir, workers=1, extra_args=list(args))


def test_socket_file_mode_keeps_other_users_out(shared_dir, peer_uid):
    d = start(shared_dir)
    try:
        assert oct(os.stat(d.socket).st_mode & 0o777) == "0o660"
        assert as_peer(peer_uid, d.socket) == {"stats": "unavailable",
                                               "certify_record": "unavailable"}
    finally:
        d.stop()


def test_peer_credential_allowlist_refuses_a_disallowed_uid(shared_dir, peer_uid):
    d = start(shared_dir, "--socket-mode", "666", "--allow-uid", "0")
    try:
        assert as_peer(peer_uid, d.socket) == {"stats": "not_allowed",
                                               "certify_record": "not_allowed"}
        assert d.client().stats()["errors"]["not_allowed"] == 2
    finally:
        d.stop()


def test_only_publish_peers_may_publish(shared_dir, peer_uid):
    d = start(shared_dir, "--socket-mode", "666")
    try:
        assert as_peer(peer_uid, d.socket) == {"stats": "ok", "certify_record": "not_allowed"}
        (shared_dir / "x").mkdir(mode=0o755)
        d2 = start(shared_dir / "x", "--socket-mode", "666", "--publish-uid", str(peer_uid))
        try:
            assert as_peer(peer_uid, d2.socket)["certify_record"] == "invalid_argument"
        finally:
            d2.stop()
    finally:
        d.stop()


def test_store_paths_never_come_from_client_input(daemon, mm_fp4_requests):
    from cached_client import InvalidTactic, KernelRequest

    wire = mm_fp4_requests[0].to_wire()
    for evil in ("../../etc/passwd", "/etc/passwd", "a/../../b"):
        with pytest.raises(InvalidTactic):
            daemon.client().get(KernelRequest.from_wire(
                {**wire, "params": {**wire["params"], "out_dtype": evil}}))
    art = daemon.client(transfer="path").get(mm_fp4_requests[0])
    blobs = (daemon.store / "blobs").resolve()
    for path in (art.library_path, art.object_path):
        assert Path(path).resolve().parent.parent == blobs
        assert Path(path).name.split(".")[0] in (art.library_sha256, art.object_sha256)


def test_symlink_swap_in_the_store_is_not_served(daemon, mm_fp4_requests, tmp_path):
    art = daemon.client(transfer="path").get(mm_fp4_requests[1])
    fake = tmp_path / "evil.so"
    fake.write_bytes(b"\x7fELF not the kernel")
    os.chmod(art.library_path, 0o644)
    os.unlink(art.library_path)
    os.symlink(fake, art.library_path)
    again = daemon.client(transfer="path").get(mm_fp4_requests[1])
    assert again.origin == "compiled"
    assert not Path(again.library_path).is_symlink()
    assert fake.read_bytes() == b"\x7fELF not the kernel"
