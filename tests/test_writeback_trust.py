"""Write-back that cannot be forged (issue 22's second hole), as a hostile local user tried it.

The attack: a user on the publish allowlist read the daemon's default toolchain fingerprint
from ``hello``, published a ``flashinfer.jit`` object under it without holding any lease,
and root's ``writeback.obtain`` for that kernel loaded it (a constructor run as root). Each
test here runs the hostile side as a second, unprivileged uid created for the test (root
is needed), with the real client on the system python, against a real daemon.
"""

from __future__ import annotations

import base64
import ctypes
import hashlib
import json
import os
import pwd
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from cached_client import Client, KernelRequest, writeback
from cached_client import protocol as p
from cached_client.errors import CachedError
from conftest import ROOT, DaemonProcess, raw_call
from test_access import PEER_PY, peer_uid, shared_dir  # noqa: F401 -- fixtures

SECOND_USER = "cachedtest2"

PEER = """
import base64, hashlib, json, sys
from cached_client import Client, KernelRequest
from cached_client import protocol as p
from cached_client.errors import CachedError
sock, action, arg = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
probe = Client(sock, timeout=30, fallback=False, identity=False)
fingerprint = probe.hello().toolchain  # the daemon's default toolchain, as hello says it
me = p.Identity(toolchain=fingerprint)
client = Client(sock, timeout=30, fallback=False, identity=me)
request = KernelRequest.from_wire(arg["request"])
out = {}
def publish(data, lease=""):
    sha = hashlib.sha256(data).hexdigest()
    frame = {"op": "publish", "request": request.to_wire(), "object_sha256": sha,
             "data": base64.b64encode(data).decode(), "identity": me.to_wire()}
    if lease:
        frame["lease"] = lease
    from cached_client.transport import Connection
    import time
    deadline = time.monotonic() + 30
    with Connection(sock, deadline) as conn:
        reply, _ = conn.request({"id": 1, **frame}, deadline)
    return reply.get("state") if reply.get("ok") else reply["error"]["code"]
try:
    data = open(arg["object"], "rb").read() if "object" in arg else b""
    if action == "forge":  # no lease at all
        out["publish"] = publish(data)
    elif action == "publish_with":  # somebody else's lease token
        out["publish"] = publish(data, arg["token"])
    elif action == "steal":  # somebody else's lease token, for everything a lease allows
        out["publish"] = publish(data, arg["token"])
        try:
            client.lease_renew(p.LeaseRenewRequest(request=request, lease=arg["token"]))
            out["renew"] = "renewed"
        except CachedError as exc:
            out["renew"] = exc.code
        client.lease_release(p.LeaseReleaseRequest(request=request, lease=arg["token"]))
    elif action == "publish":  # the honest way: lease, then publish with its token
        lease = client.lease(p.LeaseRequest(request=request, wait_ms=0))
        out["lease"] = lease.state
        out["publish"] = publish(data, lease.lease) if lease.lease else None
    elif action == "lease":
        lease = client.lease(p.LeaseRequest(request=request, wait_ms=0))
        out["lease"] = lease.state
        out["object_sha256"] = lease.artifact.object_sha256 if lease.artifact else None
    elif action == "get":
        try:
            out["get"] = client.get(request).object_sha256
        except CachedError as exc:
            out["get"] = exc.code
except CachedError as exc:
    out["error"] = exc.code
    out["message"] = exc.message
print(json.dumps(out))
"""


def run_peer(uid: int, sock: str, action: str, **arg) -> dict:
    out = subprocess.run([PEER_PY, "-c", PEER, sock, action, json.dumps(arg)], user=uid,
                         group=uid, env={"PYTHONPATH": str(ROOT / "client"),
                                         "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def second_uid() -> int:
    try:
        return pwd.getpwnam(SECOND_USER).pw_uid
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", SECOND_USER],
                       capture_output=True)
        return pwd.getpwnam(SECOND_USER).pw_uid


def jit_request(kernel: str) -> KernelRequest:
    return KernelRequest("flashinfer.jit", {"module": "norm", "kernel": kernel, "tvm_ffi": True,
                                            "source_sha256": "0" * 64}, "sm_100a", 148, 148)


def build_object(directory: Path, name: str, marker: Path | None) -> Path:
    """A real ELF object; with ``marker``, one whose constructor creates that file when the
    library linked from it is loaded (the hostile user's payload)."""
    source = directory / f"{name}.c"
    body = (f'#include <stdio.h>\n__attribute__((constructor)) static void run(void) {{\n'
            f'  FILE *f = fopen("{marker}", "w"); if (f) fclose(f);\n}}\n'
            if marker is not None else "")
    source.write_text(body + f"int {name}_kernel(void) {{ return 7; }}\n")
    obj = directory / f"{name}.o"
    subprocess.run(["gcc", "-c", "-fPIC", "-o", str(obj), str(source)], check=True)
    os.chmod(obj, 0o644)
    return obj


def load(library_path: str) -> None:
    """dlopen a served library as a client does: its DSL and TVM-FFI runtimes first."""
    from cached.toolchain.compiler_stack import package_dir, runtime_library_path

    ctypes.CDLL(runtime_library_path(), mode=ctypes.RTLD_GLOBAL)
    ctypes.CDLL(str(package_dir("tvm_ffi") / "lib" / "libtvm_ffi.so"), mode=ctypes.RTLD_GLOBAL)
    ctypes.CDLL(library_path)


def written_back(d: DaemonProcess, kernel: str) -> list[dict]:
    """The stored rows of flashinfer.jit kernel ``kernel``."""
    return [r for r in d.client(timeout=10).list()
            if r["family"] == "flashinfer.jit" and r["kernel_name"] == kernel]


@pytest.fixture(scope="module")
def node_dir():
    d = Path(tempfile.mkdtemp(prefix="cached-wb-"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def node(node_dir, peer_uid):  # noqa: F811
    """A daemon the peer may reach and publish to (the hostile user is on the allowlist);
    no compile worker is needed (``ready_workers=0``): nothing here is compiled by it."""
    d = DaemonProcess(node_dir, workers=1, ready_workers=0,
                      extra_args=["--socket-mode", "666", "--publish-uid", "0",
                                  "--publish-uid", str(peer_uid)])
    yield d
    d.stop()


@pytest.fixture
def objects(node_dir, request) -> Path:
    """A directory the peer can read, for this test's objects."""
    d = node_dir / request.node.name[:60]
    d.mkdir(mode=0o755)
    return d


def test_a_forged_publish_without_a_lease_is_refused_and_roots_obtain_compiles_its_own(
        node, objects, peer_uid):  # noqa: F811
    """The attack as it was done: no lease, the default fingerprint from hello, then root's
    writeback.obtain. Now the publish is not_allowed and leaves nothing (no row, no upload);
    root is granted the lease, compiles its own object and loads that one."""
    marker = objects / "constructor-ran"
    evil = build_object(objects, "evil", marker)
    request = jit_request("forged")
    assert run_peer(peer_uid, node.socket, "forge", request=request.to_wire(),
                    object=str(evil)) == {"publish": "not_allowed"}
    assert written_back(node, "forged") == []
    assert os.listdir(node.store / "tmp") == []
    compiled = []

    good = build_object(objects, "good", None)

    def compile_object(path: str) -> str:
        compiled.append(path)
        shutil.copy(good, path)
        return "mine"

    root = Client(node.socket, timeout=30, fallback=False)  # the daemon's own environment
    artifact, result = writeback.obtain(root, request, compile_object)
    load(artifact.library_path)  # what root's process does with what it is handed
    assert result == "mine" and len(compiled) == 1 and not marker.exists()
    assert artifact.object_sha256 != hashlib.sha256(evil.read_bytes()).hexdigest()


def test_a_publish_with_another_processs_lease_token_is_refused(node, objects, peer_uid):  # noqa: F811
    """A lease token proves nothing in another process's hands: root's token used by the
    peer uid, and by another process of root's own uid, publishes nothing (not_allowed),
    renews nothing, and releases nothing: the holder then publishes with it."""
    obj = build_object(objects, "held", None)
    request = jit_request("held")
    fp = node.client(timeout=10).hello().toolchain
    holder = Client(node.socket, timeout=30, fallback=False, identity=p.Identity(toolchain=fp))
    token = holder.lease(p.LeaseRequest(request=request, wait_ms=0)).lease
    assert token
    assert run_peer(peer_uid, node.socket, "publish_with", request=request.to_wire(),
                    object=str(obj), token=token) == {"publish": "not_allowed"}
    same_uid = subprocess.run(  # root, but not the process that took the lease
        [sys.executable, "-c", PEER, node.socket, "steal",
         json.dumps({"request": request.to_wire(), "object": str(obj), "token": token})],
        capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(same_uid.stdout) == {"publish": "not_allowed", "renew": "not_allowed"}
    # its lease_release with the token did not end the lease: the holder still holds it
    assert written_back(node, "held") == []
    data = obj.read_bytes()
    stored = writeback.publish(holder, request, data, lease=token)
    assert stored.state == "stored"
    assert [r["key"] for r in written_back(node, "held")] == [stored.key]


def test_an_expired_lease_cannot_publish(node, objects):  # noqa: F811
    """A lease not renewed within its TTL (1 s here) has ended: publishing with it is
    not_allowed, nothing is stored, and the next lease is granted."""
    obj = build_object(objects, "late", None)
    request = jit_request("late")
    client = Client(node.socket, timeout=30, fallback=False)
    token = client.lease(p.LeaseRequest(request=request, ttl_s=1, wait_ms=0)).lease
    time.sleep(1.3)
    with pytest.raises(CachedError) as refused:
        writeback.publish(client, request, obj.read_bytes(), lease=token)
    assert refused.value.code == "not_allowed" and "has ended" in refused.value.message
    assert written_back(node, "late") == [] and os.listdir(node.store / "tmp") == []
    assert client.lease(p.LeaseRequest(request=request, wait_ms=0)).state == "granted"


def test_another_uids_written_back_object_is_served_to_that_uid_only(  # noqa: F811
        node, objects, peer_uid):  # noqa: F811
    """The peer publishes honestly (lease, then publish): its object is stored under its
    own group's key, the row names its uid and the identity it stated, and it is served to
    the peer (lease and get), never to root: root's lease is granted (it compiles its own),
    root's get is unknown_toolchain, root's export lists nothing. What root publishes is
    served to every peer, before the peer's own."""
    marker = objects / "constructor-ran"
    evil = build_object(objects, "peer", marker)
    sha = hashlib.sha256(evil.read_bytes()).hexdigest()
    request = jit_request("peer")
    assert run_peer(peer_uid, node.socket, "publish", request=request.to_wire(),
                    object=str(evil)) == {"lease": "granted", "publish": "stored"}
    fp = node.client(timeout=10).hello().toolchain
    root = Client(node.socket, timeout=30, fallback=False, identity=p.Identity(toolchain=fp))
    reply = root.lease(p.LeaseRequest(request=request, wait_ms=0))
    assert reply.state == "granted" and reply.artifact is None
    with pytest.raises(CachedError) as refused:
        root.get(request)
    assert refused.value.code == "unknown_toolchain"
    assert [a for a in root.flashinfer_artifacts().artifacts
            if a["kernel_name"] == "peer"] == []
    assert not marker.exists()

    (row,) = written_back(node, "peer")
    meta = json.loads(sqlite3.connect(node.store / "index.sqlite").execute(
        "SELECT meta FROM entries WHERE key = ?", (row["key"],)).fetchone()[0])
    assert meta["publisher"]["uid"] == peer_uid and meta["publisher"]["group"] == \
        f"uids:{peer_uid}"
    assert meta["identity"]["toolchain"] == fp
    assert run_peer(peer_uid, node.socket, "lease", request=request.to_wire()) == {
        "lease": "hit", "object_sha256": sha}
    assert run_peer(peer_uid, node.socket, "get", request=request.to_wire()) == {"get": sha}
    mine = build_object(objects, "root", None)
    writeback.publish(root, request, mine.read_bytes(), lease=reply.lease)
    assert run_peer(peer_uid, node.socket, "lease", request=request.to_wire()) == {
        "lease": "hit", "object_sha256": hashlib.sha256(mine.read_bytes()).hexdigest()}


def test_a_trust_group_shares_written_back_objects_among_its_uids_only(
        shared_dir, peer_uid, second_uid):  # noqa: F811
    """trust_group = "PEER,SECOND": what one publishes the other is served; root is not."""
    d = DaemonProcess(shared_dir, workers=1, ready_workers=0, extra_args=[
        "--socket-mode", "666", "--publish-uid", "0", "--publish-uid", str(peer_uid),
        "--trust-group", f"{peer_uid},{second_uid}"])
    try:
        obj = build_object(shared_dir, "shared", None)
        request = jit_request("shared")
        assert run_peer(peer_uid, d.socket, "publish", request=request.to_wire(),
                        object=str(obj))["publish"] == "stored"
        sha = hashlib.sha256(obj.read_bytes()).hexdigest()
        assert run_peer(second_uid, d.socket, "lease", request=request.to_wire()) == {
            "lease": "hit", "object_sha256": sha}
        fp = d.client(timeout=10).hello().toolchain
        root = Client(d.socket, timeout=30, fallback=False, identity=p.Identity(toolchain=fp))
        assert root.lease(p.LeaseRequest(request=request, wait_ms=0)).state == "granted"
    finally:
        d.stop()


def test_write_back_off_refuses_lease_and_publish_with_a_clear_code(tmp_path):
    """writeback = false: lease and publish are not_allowed, naming the setting; nothing
    is stored, and get and hello still work."""
    d = DaemonProcess(tmp_path, workers=1, ready_workers=0, extra_args=["--no-writeback"])
    try:
        client = d.client(timeout=30, fallback=False)
        request = jit_request("off")
        with pytest.raises(CachedError) as refused:
            client.lease(p.LeaseRequest(request=request, wait_ms=0))
        assert refused.value.code == "not_allowed" and "writeback" in refused.value.message
        reply = raw_call(d.socket, {"op": "publish", "request": request.to_wire(),
                                    "object_sha256": "0" * 64, "data": ""})
        assert reply["error"]["code"] == "not_allowed"
        assert client.hello().v == 1 and client.list() == []
    finally:
        d.stop()


def test_written_back_rows_with_no_recorded_publisher_are_dropped_at_start(tmp_path):
    """A written-back row that names no publisher (a store written before publishers were
    recorded) is dropped when the daemon starts, never served."""
    d = DaemonProcess(tmp_path, workers=1, ready_workers=0)
    obj = build_object(tmp_path, "old", None)
    request = jit_request("old")
    try:
        client = Client(d.socket, timeout=30, fallback=False)
        token = client.lease(p.LeaseRequest(request=request, wait_ms=0)).lease
        writeback.publish(client, request, obj.read_bytes(), lease=token)
    finally:
        d.stop()
    with sqlite3.connect(tmp_path / "store" / "index.sqlite") as db:
        db.execute("""UPDATE entries SET meta = '{"origin": "write-back"}'""")
    d = DaemonProcess(tmp_path, workers=1, ready_workers=0)
    try:
        assert d.client(timeout=10).list() == []
        assert '"store.unattributed_dropped"' in d.log()
        reply = Client(d.socket, timeout=30, fallback=False).lease(
            p.LeaseRequest(request=request, wait_ms=0))
        assert reply.state == "granted"
    finally:
        d.stop()


def test_publish_chunks_carry_the_token_and_a_stolen_one_cannot_finish_an_upload(
        node, objects, peer_uid):  # noqa: F811
    """Every chunk is checked, not only the first: a final chunk from another process with
    the holder's token is refused and the upload is not stored."""
    data = build_object(objects, "chunks", None).read_bytes()
    request = jit_request("chunks")
    client = Client(node.socket, timeout=30, fallback=False, identity=False)
    token = client.lease(p.LeaseRequest(request=request, wait_ms=0)).lease
    sha = hashlib.sha256(data).hexdigest()
    first = client.publish(p.PublishRequest(request=request, object_sha256=sha, final=False,
                                            data=base64.b64encode(data[:100]).decode(),
                                            lease=token))
    assert first.state == "partial"
    reply = raw_call(node.socket, {"op": "publish", "request": request.to_wire(),
                                   "object_sha256": sha, "offset": 100,
                                   "data": base64.b64encode(data[100:]).decode(),
                                   "lease": "f" * 32})
    assert reply["error"]["code"] == "not_allowed"
    assert written_back(node, "chunks") == []


def test_trust_groups_and_writeback_come_from_flags_env_and_file_and_bad_ones_are_refused(
        tmp_path):
    """trust_group and writeback like every setting (flag, environment, file); a group
    naming root, a uid in two groups or a non-number is refused in one line, exit 2."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHED_")}

    def config(*args: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "cached", "config", *args],
                              capture_output=True, text=True, env={**env, **extra})

    def value(name: str, *args: str, **extra: str) -> object:
        out = config("--json", *args, **extra)
        assert out.returncode == 0, out.stderr
        return next(o["value"] for o in json.loads(out.stdout)["options"] if o["name"] == name)

    assert value("trust_group", "--trust-group", "1002,1001", "--trust-group", "2000") == [
        [1001, 1002], [2000]]
    assert value("trust_group", CACHED_TRUST_GROUP="1001,1002;2000") == [[1001, 1002], [2000]]
    toml = tmp_path / "cached.toml"
    toml.write_text('trust_group = [[1001, 1002], "2000"]\nwriteback = false\n')
    assert value("trust_group", "--config", str(toml)) == [[1001, 1002], [2000]]
    assert value("writeback", "--config", str(toml)) is False
    assert value("writeback", "--no-writeback") is False and value("writeback") is True
    assert "1001,1002 2000" in config("--config", str(toml)).stdout
    for bad, why in (("0,1001", "uid 0 is in no trust group"), ("5,6 6", "more than one"),
                     ("x", "expected an integer")):
        out = config(CACHED_TRUST_GROUP=bad)
        assert out.returncode == 2 and why in out.stderr and "trust_group" in out.stderr, (
            bad, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1


def test_sighup_turns_write_back_off_and_on(tmp_path):
    """writeback is reloadable: SIGHUP with writeback = false in the file refuses the next
    lease (not_allowed), and back to true grants it again."""
    config = tmp_path / "cached.toml"
    config.write_text("writeback = true\n")
    d = DaemonProcess(tmp_path, workers=1, ready_workers=0, extra_args=["--config", str(config)])
    try:
        client = Client(d.socket, timeout=30, fallback=False)
        request = jit_request("reload")

        def reloaded(n: int) -> None:
            deadline = time.monotonic() + 30
            while d.log_path.read_text().count('"daemon.reloaded"') < n:
                assert time.monotonic() < deadline, d.log()
                time.sleep(0.1)

        config.write_text("writeback = false\n")
        d.proc.send_signal(signal.SIGHUP)
        reloaded(1)
        with pytest.raises(CachedError) as refused:
            client.lease(p.LeaseRequest(request=request, wait_ms=0))
        assert refused.value.code == "not_allowed"
        config.write_text("writeback = true\n")
        d.proc.send_signal(signal.SIGHUP)
        reloaded(2)
        assert client.lease(p.LeaseRequest(request=request, wait_ms=0)).state == "granted"
    finally:
        d.stop()
