"""The identity cache's directory listings and source digests (cached_client.identity): used
while the stamps they were taken at hold, never across a change, and adopted from the
daemon's ``hello`` by a node's first process. Real processes; the daemon test a real daemon."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cached_client import identity
from conftest import DaemonProcess

pytest.importorskip("flashinfer")

MAIN = sys.executable
OLD = time.time() - 600  # long settled: RACY_S is seconds


def _run(code: str, cache: str, path: Path | None = None, *args: str) -> object:
    """What ``code`` prints after ``RESULT `` in a fresh process, with $CACHED_IDENTITY_CACHE
    set to ``cache`` and ``path`` first on its sys.path."""
    env = {**os.environ, "CACHED_IDENTITY_CACHE": cache}
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(path), os.environ.get("PYTHONPATH", "")])
    out = subprocess.run([MAIN, "-c", code, *args], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.split("RESULT ", 1)[1])


TOOLCHAIN = ("import json; from cached_client import identity; "
             "print('RESULT ' + json.dumps(identity.toolchain()))")
CONTENT = ("import json, sys; from pathlib import Path; from cached_client import identity; "
           "print('RESULT ' + json.dumps(identity.files_content(Path(sys.argv[1]), "
           "('a.py', 'b.py'))))")


def _entries(cache: Path) -> dict:
    return json.loads(cache.read_text())["components"]


def _settle(*paths: Path, at: float = OLD) -> None:
    for path in paths:
        os.utime(path, (at, at))


def test_a_listing_is_used_while_its_directory_is_unchanged_and_a_new_entry_is_seen(tmp_path):
    """A sys.path directory's ``.dist-info`` names come from the cache while the directory's
    stamp holds; a distribution added since (a new mtime) is seen at once, and its listing is
    remembered only once the directory has settled."""
    site = tmp_path / "site"
    (site / "apache_tvm_ffi-9.9.dist-info").mkdir(parents=True)
    for i in range(identity.LARGE_LISTING):  # a listing worth a write of its own
        (site / f"module_{i}.py").write_text("")
    (site / "apache_tvm_ffi-9.9.dist-info" / "RECORD").write_text("tvm_ffi/a.py,sha256=AA,1\n")
    _settle(site)
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    cache = private / "stack-digests.json"
    assert "apache-tvm-ffi==9.9:" in _run(TOOLCHAIN, str(cache), site)
    stamp, listing = _entries(cache)[str(site)]
    assert listing == "apache_tvm_ffi-9.9.dist-info"
    # consulted: a listing held at this stamp is what the process sees
    entries = _entries(cache)
    entries[str(site)] = [stamp, "apache_tvm_ffi-9.8.dist-info"]
    cache.write_text(json.dumps({"version": 1, "components": entries}))
    assert "apache-tvm-ffi==9.8:" in _run(TOOLCHAIN, str(cache), site)
    # a distribution installed now: the directory's stamp changed, it is listed again
    (site / "torch-1.0.dist-info").mkdir()
    (site / "torch-1.0.dist-info" / "RECORD").write_text("torch/a.py,sha256=BB,1\n")
    seen = _run(TOOLCHAIN, str(cache), site)
    assert "torch==1.0:" in seen and "apache-tvm-ffi==9.9:" in seen
    assert _entries(cache)[str(site)][1] == "apache_tvm_ffi-9.8.dist-info"  # not settled
    _settle(site, at=OLD + 1)
    assert _run(TOOLCHAIN, str(cache), site) == seen
    _run(TOOLCHAIN, str(cache), site)
    assert _entries(cache)[str(site)][1] == "apache_tvm_ffi-9.9.dist-info\0torch-1.0.dist-info"


def test_a_source_digest_is_used_while_every_file_is_unchanged(tmp_path):
    """The content digest of a family's files comes from the cache while each file's stamp
    holds; a file rewritten (same size, new bytes) is read again, and remembered only once
    it has settled."""
    root = tmp_path / "flashinfer"
    root.mkdir()
    (root / "a.py").write_text("a = 1\n")
    (root / "b.py").write_text("b = 2\n")
    _settle(root / "a.py", root / "b.py")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    cache = private / "stack-digests.json"
    first = _run(CONTENT, str(cache), None, str(root))
    assert _run(CONTENT, "", None, str(root)) == first  # what reading the files gives
    (key, (stamp, held)), = _entries(cache).items()
    assert key.startswith("sources:") and held == first
    cache.write_text(json.dumps({"version": 1, "components": {key: [stamp, "0" * 64]}}))
    assert _run(CONTENT, str(cache), None, str(root)) == "0" * 64  # consulted
    (root / "b.py").write_text("b = 3\n")
    changed = _run(CONTENT, str(cache), None, str(root))
    assert changed not in (first, "0" * 64)
    assert changed == _run(CONTENT, "", None, str(root))
    assert _entries(cache)[key][1] == "0" * 64  # not settled: not remembered
    _settle(root / "b.py", at=OLD + 1)
    assert _run(CONTENT, str(cache), None, str(root)) == changed
    assert _entries(cache)[key][1] == changed


ADOPT_SCRIPT = """
import json, os, sys
from cached_client import Client, flashinfer_sources, identity
listed = []
real_listdir = os.listdir
os.listdir = lambda d=".": listed.append(os.path.abspath(d)) or real_listdir(d)
def no_read(root, files):
    raise AssertionError("read the sources")
flashinfer_sources.content_sha256 = no_read
hello = Client(sys.argv[1], timeout=30).hello()
stated = {k for t in hello.toolchains for k in t["records"]}
print("RESULT " + json.dumps({
    "toolchain": identity.toolchain(), "source": identity.family_source("flashinfer.mm_fp4"),
    "listed": listed, "stated": sorted(stated)}))
"""
COMPUTED = ("import json; from cached_client import identity; print('RESULT ' + json.dumps("
            "[identity.toolchain(), identity.family_source('flashinfer.mm_fp4')]))")


def test_a_nodes_first_process_adopts_the_daemons_listings_and_source_digests(tmp_path):
    """With no identity cache of its own, a client on the node lists no directory the daemon
    stated at its stamp and reads no FlashInfer source, and states what computing everything
    states."""
    daemon = DaemonProcess(tmp_path, workers=1)
    try:
        got = _run(ADOPT_SCRIPT, "", None, daemon.socket)
    finally:
        daemon.stop()
    assert [got["toolchain"], got["source"]] == _run(COMPUTED, "")
    site = next(p for p in sys.path if p.endswith("site-packages"))
    assert site in got["stated"] and any(k.startswith("sources:") for k in got["stated"])
    assert not set(got["listed"]) & set(got["stated"])
