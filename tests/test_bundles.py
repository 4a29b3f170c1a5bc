"""Bundles: entries of named opaque files (the JIT libraries' own artifacts, issue 15), in the
store and through write-back (lease, chunked publish_bundle, hit), with a real store and a
real daemon on a real socket. The libraries' real compiles are in test_jit.py."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import sqlite3
import sys
import threading

import pytest
from cached_client import InvalidArgument, InvalidTactic, KernelRequest, writeback
from cached_client import protocol as p
from cached_client.errors import IntegrityError
from conftest import DaemonProcess, raw_call

from cached.store.store import Store

BARE = ["--toolchain", f"bare={sys._base_executable}"]  # write-back needs no compiler


def K(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def _row(name: str, family: str = "triton") -> dict:
    return {"key": K(name), "family": family, "kernel_name": name, "symbol": "",
            "params": {"n": name}, "arch": "sm_90a", "sm_count": 1, "max_active_clusters": 1,
            "toolchain": "t", "source_sha256": "s", "compile_seconds": 1.0, "meta": {}}


def _bundle(store: Store, name: str, files: dict[str, bytes]):
    work = store.workdir()
    paths = {}
    for i, (fname, data) in enumerate(files.items()):
        (work / f"f{i}").write_bytes(data)
        paths[fname] = work / f"f{i}"
    entry = store.publish_bundle(_row(name), paths)
    work.rmdir()
    return entry


def test_a_bundle_is_stored_whole_named_by_digest_and_served_verified(tmp_path):
    store = Store(tmp_path)
    files = {"k.so": b"\x7fELF module", "__grp__k.json": b'{"child_paths": ["k.so"]}',
             "README": b"x"}
    entry = _bundle(store, "b1", files)
    assert entry.kind == "bundle" and entry.object_path is None and entry.library_path is None
    for fname, data in files.items():  # each file a read-only blob, with its own extension
        path = entry.files[fname]
        assert path.read_bytes() == data
        assert path.name == hashlib.sha256(data).hexdigest() + (
            os.path.splitext(fname)[1] or ".bin")
        assert oct(path.stat().st_mode & 0o777) == "0o444"
    row = store.rows()[0]
    assert row.size == sum(map(len, files.values()))
    assert json.loads(row.files) == {n: {"sha256": hashlib.sha256(d).hexdigest(),
                                            "size": len(d)} for n, d in files.items()}
    store.close()
    again = Store(tmp_path)  # survives a reopen, verified on read
    assert again.lookup(K("b1")).files == entry.files


def test_a_tampered_bundle_file_is_dropped_by_lookup_verify_and_scan(tmp_path):
    store = Store(tmp_path)
    a = _bundle(store, "a", {"x.cubin": b"one", "y.json": b"{}"})
    b = _bundle(store, "b", {"x.cubin": b"two"})
    shared = _bundle(store, "c", {"z.json": b"{}"})  # shares a's y.json blob
    os.chmod(a.files["x.cubin"], 0o644)
    a.files["x.cubin"].write_bytes(b"ONE")
    report = store.verify()  # `cached verify`
    assert [(r["key"], r["family"]) for r in report["bad"]] == [(K("a"), "triton")]
    assert "file x.cubin blob" in report["bad"][0]["reason"]
    assert report["checked"] == 3 and report["verified"] == 2
    assert store.lookup(K("a")) is None and store.lookup(K("b")) is not None
    assert store.lookup(K("c")).files["z.json"] == shared.files["z.json"]
    os.chmod(b.files["x.cubin"], 0o644)
    b.files["x.cubin"].write_bytes(b"TWO")
    assert store.lookup(K("b")) is None  # a read refuses it too
    store.close()
    reopened = Store(tmp_path)
    reopened.scan()
    assert not a.files["x.cubin"].exists() and shared.files["z.json"].exists()


def test_eviction_counts_every_bundle_file_and_keeps_shared_blobs(tmp_path):
    from cached.store.store import Budget

    store = Store(tmp_path, Budget(max_files=4, grace=0))
    old = _bundle(store, "old", {"a.json": b"1", "b.json": b"2", "s.json": b"shared"})
    new = _bundle(store, "new", {"s.json": b"shared"})  # 3 + 1 files: fits
    assert store.totals()[0] == 2
    _bundle(store, "newer", {"c.json": b"3"})  # 5 files: the oldest bundle goes
    assert store.lookup(K("old")) is None and not old.files["a.json"].exists()
    assert new.files["s.json"].exists() and store.lookup(K("new")) is not None


def test_an_older_index_gains_the_kind_and_files_columns(tmp_path):
    from cached.store.rows import ADDED_COLUMNS, COLUMNS

    store = Store(tmp_path)
    work = store.workdir()
    (work / "k.o").write_bytes(b"o")
    (work / "k.so").write_bytes(b"l")
    store.publish(_row("old", "flashinfer.mm_fp4") | {"symbol": "s"}, work / "k.o",
                  work / "k.so")
    store.close()
    db = sqlite3.connect(tmp_path / "index.sqlite")
    old_columns = [c for c in COLUMNS if c not in ADDED_COLUMNS]
    db.executescript(f"CREATE TABLE e2 AS SELECT {', '.join(old_columns)} FROM entries; "
                     "DROP TABLE entries; ALTER TABLE e2 RENAME TO entries;")
    db.close()
    again = Store(tmp_path)
    (row,) = again.rows()
    assert row.kind == "kernel" and row.files == ""
    assert again.lookup(K("old")).library_path.read_bytes() == b"l"


@pytest.mark.parametrize("files, why", [
    ({"../x": {"sha256": "0" * 64, "size": 1}}, "plain file name"),
    ({"x": {"sha256": "0" * 64, "size": 2}}, "sum of the bundle's file sizes"),
    ({}, "1 to 64"),
])
def test_an_index_row_with_a_bad_manifest_is_never_trusted(tmp_path, files, why):
    from cached.store.rows import check_row

    row = {**_row("x"), "params": "{}", "meta": "{}", "kind": "bundle", "files":
           json.dumps(files), "object_sha256": "", "library_sha256": "", "object_size": 0,
           "library_size": 0, "size": 1, "created": 1.0, "last_used": 1.0, "hits": 0}
    assert why in check_row(row)


# -- write-back of bundles over the socket ----------------------------------------------


def triton_request(tag: str = "A") -> KernelRequest:
    return KernelRequest("triton", {"cache_key": (tag * 52)[:52], "group": "k.json",
                                    "triton": "3.8.0", "target": "cuda:90:32"},
                         "sm_90a", 132, 132)


FILES = {"k.json": b'{"name": "k"}', "k.cubin": os.urandom(3000),
         "__grp__k.json": b'{"child_paths": ["k.cubin", "k.json"]}'}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = DaemonProcess(tmp_path_factory.mktemp("bundles"), workers=1, extra_args=BARE)
    yield d
    d.stop()


def test_a_bundle_is_published_in_chunks_and_becomes_visible_whole(daemon, monkeypatch):
    client = daemon.client(timeout=30)
    request = triton_request("B")
    held = writeback.acquire(client, request)
    assert isinstance(held, writeback.HeldLease)
    monkeypatch.setattr(writeback, "CHUNK_BYTES", 1000)  # several chunks per file
    seen: list[str] = []
    original = client.publish_bundle

    def publish_and_peek(message, timeout=None):  # another process's view between chunks
        reply = original(message, timeout)
        if reply.state == "partial":
            other = daemon.client(timeout=30).lease(p.LeaseRequest(request=request, wait_ms=0))
            seen.append(other.state)
        return reply

    monkeypatch.setattr(client, "publish_bundle", publish_and_peek)
    artifact = held.publish_bundle(dict(FILES))
    assert seen and set(seen) == {"wait"}  # never a partial bundle
    assert artifact.kind == "bundle" and artifact.origin == "compiled"
    hit = writeback.acquire(daemon.client(timeout=30), request)
    assert isinstance(hit, p.Artifact) and hit.origin == "hit"
    assert writeback.read_bundle(hit) == FILES
    assert {f["name"]: f["size"] for f in hit.files} == {n: len(d) for n, d in FILES.items()}
    fam = daemon.stats()["families"]["triton"]
    assert fam["published"] == 1 and fam["bytes_published"] == sum(map(len, FILES.values()))
    assert fam["hits"] >= 1 and fam["compiles_avoided"] == fam["hits"]


def test_device_facts_the_family_does_not_depend_on_are_not_in_the_key(daemon):
    client = daemon.client(timeout=30)
    a, b = triton_request("C"), triton_request("C")
    b = KernelRequest(b.family, b.params, b.arch, 148, 74)
    held = writeback.acquire(client, a)
    held.publish_bundle(dict(FILES))
    hit = writeback.acquire(client, b)
    assert isinstance(hit, p.Artifact)
    (row,) = [e for e in client.list() if e["key"] == hit.key]
    assert (row["sm_count"], row["max_active_clusters"], row["kind"]) == (1, 1, "bundle")


def _chunk(request: KernelRequest, files: dict, name: str, data: bytes, **kw) -> dict:
    return {"op": "publish_bundle", "request": request.to_wire(), "files": files,
            "file": name, "data": base64.b64encode(data).decode(), **kw}


def _manifest(files: dict[str, bytes]) -> dict:
    return {n: {"sha256": hashlib.sha256(d).hexdigest(), "size": len(d)} for n, d in files.items()}


@pytest.mark.parametrize("change, code, message", [
    ({"files": {"../k.json": {"sha256": "0" * 64, "size": 1}}}, "invalid_argument",
     "plain file name"),
    ({"file": "other.json"}, "invalid_argument", "not in the bundle's files"),
    ({"files": {"k.json": {"sha256": "0" * 64, "size": 1}}}, "invalid_tactic",
     "holds its group file"),
    ({"request": KernelRequest("flashinfer.jit", {"module": "m", "kernel": "k",
                                                  "source_sha256": "0" * 64}, "sm_90a", 1,
                               1).to_wire()}, "invalid_argument", "publish them with publish"),
    ({"request": KernelRequest("triton", {"cache_key": "x"}, "sm_90a", 1, 1).to_wire()},
     "invalid_tactic", "takes exactly the parameters"),
])
def test_bad_bundle_uploads_get_a_typed_error_and_lose_nothing(daemon, change, code, message):
    request = triton_request("D" + message[:3].upper())  # a key of its own
    held = writeback.acquire(daemon.client(timeout=30), request)
    good = _chunk(request, _manifest(FILES), "k.json", FILES["k.json"])
    reply = raw_call(daemon.socket, {**good, **change})
    assert reply["ok"] is False and reply["error"]["code"] == code, reply
    assert message in reply["error"]["message"]
    assert held.publish_bundle(dict(FILES)).kind == "bundle"  # the lease still holds
    assert writeback.read_bundle(writeback.acquire(daemon.client(), request)) == FILES


def test_a_file_that_does_not_match_its_manifest_drops_the_upload(daemon):
    request = triton_request("E")
    client = daemon.client(timeout=30, identity=False)  # as raw_call: the default toolchain
    held = writeback.acquire(client, request)
    manifest = _manifest(FILES)
    reply = raw_call(daemon.socket, _chunk(request, manifest, "k.cubin", b"not the cubin",
                                           lease=held.token))
    assert reply["error"]["code"] == "invalid_argument", reply
    assert "does not match its manifest entry" in reply["error"]["message"]
    reply = raw_call(daemon.socket, _chunk(request, manifest, "k.json", FILES["k.json"],
                                           offset=5, lease=held.token))
    assert "start again at offset 0" in reply["error"]["message"]
    assert client.lease(p.LeaseRequest(request=request, wait_ms=0)).state == "wait"
    held.publish_bundle(dict(FILES))


def test_objects_and_bundles_each_go_through_their_own_op(daemon):
    client = daemon.client(timeout=30)
    with pytest.raises(InvalidArgument, match="publish_bundle"):
        client.publish(p.PublishRequest(request=triton_request("F"), object_sha256="0" * 64))
    with pytest.raises(InvalidArgument, match="ask for them with lease"):
        client.get(triton_request("F"))
    with pytest.raises(InvalidTactic, match="missing: code_sha256, compiler"):
        client.lease(p.LeaseRequest(request=KernelRequest("humming", {}, "sm_90a", 1, 1)))


def test_a_hit_whose_file_changed_is_refused_by_the_client(daemon, tmp_path):
    request = triton_request("G")
    client = daemon.client(timeout=30)
    artifact = writeback.acquire(client, request).publish_bundle(dict(FILES))
    copy = dict(artifact.files[0])
    moved = tmp_path / "copy"
    moved.write_bytes(b"changed after the daemon checked it")
    copy["path"] = str(moved)
    forged = p.Artifact(**{**artifact.__dict__, "files": [copy, *artifact.files[1:]]})
    with pytest.raises(IntegrityError, match="does not match its digest"):
        writeback.read_bundle(forged)


def test_a_waiting_process_gets_the_bundle_the_holder_publishes(daemon):
    request = triton_request("H")
    holder = writeback.acquire(daemon.client(timeout=30), request)
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(
        writeback.acquire(daemon.client(timeout=30), request)))
    waiter.start()
    holder.publish_bundle(dict(FILES))
    waiter.join(30)
    assert isinstance(got[0], p.Artifact) and writeback.read_bundle(got[0]) == FILES
