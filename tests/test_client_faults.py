"""The client against faults on its side of the socket (issue 16 items 13, 14, 15 and item
21's malformed replies): eviction racing a load, a fork with the connection open, a daemon
that stops answering, a daemon whose replies do not follow the protocol."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from cached_client import BadReply, Client, DaemonUnavailable
from cached_client import protocol as p
from cached_client.loader import load_library
from conftest import DaemonProcess, fault, serve_once

ENV = {"CUTE_DSL_ARCH": "sm_100a", "CACHED_SM_COUNT": "148"}


@pytest.fixture(scope="module")
def stored(tmp_path_factory, mm_fp4_requests):
    """A daemon with two kernels stored."""
    d = DaemonProcess(tmp_path_factory.mktemp("client-faults"), workers=1)
    client = d.client(timeout=600)
    for request in mm_fp4_requests[:2]:
        client.get(request)
    yield d, mm_fp4_requests[:2]
    d.stop()


# -- item 13: descriptors, not paths ----------------------------------------------------------

def test_eviction_right_after_get_cannot_break_the_load(tmp_path, mm_fp4_requests):
    """Item 13: a kernel evicted between the daemon's answer and the client's load. With the
    path the load fails (the blob is gone); with the descriptors the daemon passed it loads
    (the client's private copy, digest checked)."""
    d = DaemonProcess(tmp_path, workers=1)
    try:
        request = mm_fp4_requests[3]
        admin = d.client(timeout=600)
        by_fd = d.client(timeout=600).get(request)  # the default transfer
        assert not by_fd.library_path.startswith(str(d.store))
        assert admin.gc(p.GcRequest(max_bytes=1, grace=0)).evicted == 1
        fn = load_library(by_fd.library_path, by_fd.symbol, by_fd.library_sha256)
        assert callable(fn)
        by_path = d.client(timeout=600, transfer="path").get(request)  # compiled again
        assert by_path.library_path.startswith(str(d.store))
        assert admin.gc(p.GcRequest(max_bytes=1, grace=0)).evicted == 1
        with pytest.raises(FileNotFoundError):
            load_library(by_path.library_path, by_path.symbol, by_path.library_sha256)
    finally:
        d.stop()


def test_every_transfer_hands_over_the_same_verified_kernel(stored):
    d, requests = stored
    got = {t: d.client(transfer=t).get(requests[0]) for t in p.TRANSFERS}
    assert len({a.library_sha256 for a in got.values()}) == 1
    assert got["bytes"].library_bytes is not None
    for transfer in ("fd", "path"):
        art = got[transfer]
        with open(art.library_path, "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == art.library_sha256
        assert callable(d.client(transfer=transfer).load(requests[1]))
    assert d.client().hello().capabilities.count("transfer:fd") == 1


IN_PLACE = """
import json, os, sys
from cached_client import Client, KernelRequest
client = Client(sys.argv[1], timeout=30, fallback=False)
fn = client.load(KernelRequest.from_wire(json.loads(sys.argv[2])))
print(json.dumps({"callable": callable(fn)}))
"""


def test_the_default_load_runs_the_store_blob_in_place_and_copies_nothing(stored, tmp_path):
    """Transfer fd, the default, from a daemon whose store only its uid can change: the
    library passed is hashed and loaded where it is, so a node's first process writes no
    private copy (its scratch directory holds no library afterwards)."""
    d, requests = stored
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    out = subprocess.run([sys.executable, "-c", IN_PLACE, d.socket,
                          json.dumps(requests[0].to_wire())], capture_output=True, text=True,
                         env={**os.environ, "TMPDIR": str(scratch),
                              "CACHED_IDENTITY_CACHE": ""}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"callable": True}
    assert [f for f in scratch.rglob("*") if f.suffix == ".so"] == []


# -- item 14: fork -----------------------------------------------------------------------------

FORK = """
import json, os, sys, threading
from cached_client import Client, KernelRequest
requests = [KernelRequest.from_wire(w) for w in json.loads(sys.argv[2])]
threaded = sys.argv[3] == "threads"
client = Client(sys.argv[1], timeout=10, fallback=False)
keys = [client.get(r).key for r in requests]  # the connection is open from here on

def hammer(n, seed):
    wrong, errors = 0, []
    for j in range(n):
        i = (j + seed) % len(requests)
        try:
            if client.get(requests[i]).key != keys[i]:
                wrong += 1
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}"[:200])
    return {"wrong": wrong, "errors": errors[:5], "n_errors": len(errors)}

out = {}
threads = [threading.Thread(target=lambda s=s: out.__setitem__(f"thread{s}", hammer(300, s)))
           for s in range(2 if threaded else 0)]
for t in threads:
    t.start()
children = []
for c in range(2 if threaded else 1):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.write(w, json.dumps(hammer(300, c)).encode())
        os._exit(0)
    os.close(w)
    children.append((pid, r))
out["parent"] = hammer(300, 1)
for t in threads:
    t.join()
for c, (pid, r) in enumerate(children):
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.waitpid(pid, 0)
    out[f"child{c}"] = json.loads(data) if data else {"wrong": -1, "errors": ["no output"]}
print(json.dumps(out))
"""


@pytest.mark.parametrize("mode, who", [
    ("plain", {"parent", "child0"}),
    ("threads", {"thread0", "thread1", "parent", "child0", "child1"})])
def test_a_forked_child_and_its_parent_each_get_their_own_kernels(stored, mode, who):
    """Item 14: after a fork with the connection open, 300 gets each in parent and child
    gave replies for the wrong kernel. ``plain``: exactly that. ``threads``: two threads
    keep the parent's connection busy while it forks twice (a child may inherit a lock some
    thread held). Every process and thread makes 300 gets and checks each reply's key."""
    d, requests = stored
    out = subprocess.run([sys.executable, "-c", FORK, d.socket,
                          json.dumps([r.to_wire() for r in requests]), mode],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert set(result) == who
    for name, r in result.items():
        assert r["wrong"] == 0 and not r["errors"], (name, r)


# -- item 15: a daemon that stops answering --------------------------------------------------

STOPPED = """
import json, logging, sys, time
from cached_client import Client, DaemonUnavailable, KernelRequest
logging.basicConfig(level=logging.WARNING)
requests = [KernelRequest.from_wire(w) for w in json.loads(sys.argv[2])]
client = Client(sys.argv[1], timeout=600)  # what flashinfer.install() uses
out = {}
for i, request in enumerate(requests):
    t0 = time.monotonic()
    try:
        client.get(request)
        out[f"get{i}"] = "answered"
    except DaemonUnavailable as exc:
        out[f"get{i}"] = exc.message
    out[f"seconds{i}"] = time.monotonic() - t0
print(json.dumps(out))
"""


def test_a_stopped_daemon_costs_a_few_seconds_once_then_nothing(stored):
    """Item 15: with the daemon SIGSTOPped, a 600 s call blocked for its whole timeout. Now
    the first call ends within a few seconds (no byte for 3 s, no answer to a hello on a new
    connection within 2 s), and the next ones fail at once (circuit open for 30 s)."""
    d, requests = stored
    os.kill(d.proc.pid, signal.SIGSTOP)
    try:
        out = subprocess.run([sys.executable, "-c", STOPPED, d.socket,
                              json.dumps([r.to_wire() for r in requests * 2])],
                             capture_output=True, text=True, timeout=120)
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
    result = json.loads(out.stdout)
    assert "went silent" in result["get0"] and result["seconds0"] < 15, result
    for i in (1, 2, 3):
        assert "not asking the daemon" in result[f"get{i}"] and result[f"seconds{i}"] < 1
    assert d.client(timeout=30).hello().v == 1  # the daemon itself is fine once continued


def test_a_long_compile_on_a_live_daemon_is_waited_for(stored):
    """Item 15's other half: a daemon that answers hellos while a get waits is waited for,
    past the 3 s silence window, until its own answer."""
    d, _ = stored
    client = d.client(timeout=600, fallback=False)
    started = time.monotonic()
    with pytest.raises(Exception) as err:
        client.get(fault("sleep", "long-compile", 8))
    assert getattr(err.value, "code", None) == "compile_failed", err.value
    assert time.monotonic() - started >= 8
    assert client.hello().v == 1


FLASHINFER_STOPPED = """
import json, logging, os, sys, time
logging.basicConfig(level=logging.WARNING, format="WARNING-LINE %(name)s %(message)s")
import cutlass, torch
from flashinfer.gemm.gemm_mm_fp4_cute_dsl import (
    _blockscaled_gemm_cache_key_files, _blockscaled_kernel_disk_name,
    _make_blockscaled_gemm_compile_fn, _mm_fp4_cache_key)
from flashinfer.gemm.kernels.dense_blockscaled_gemm_sm100 import (
    Sm100BlockScaledPersistentDenseGemmKernel)
from flashinfer.jit.cute_dsl_core import build_and_load_cute_dsl_kernel
from cached_client.integrations.flashinfer import cute_dsl as cf
cf.install(os.environ["CACHED_SOCKET"])
out = {}
for i, tile in enumerate(((128, 64), (128, 128))):
    tactic = (tile, (1, 1), False, False, "sm100", None)
    key = _mm_fp4_cache_key(16, tactic, True, torch.bfloat16, None, "b_ef")
    name = _blockscaled_kernel_disk_name(key, 1, 148)
    gemm = Sm100BlockScaledPersistentDenseGemmKernel(16, tile, (1, 1), False, True, None,
                                                     b_l2_evict_first=True)
    inner = _make_blockscaled_gemm_compile_fn(
        gemm, ab_cutlass_dtype=cutlass.Uint8, sf_dtype=cutlass.Float8E4M3FN,
        c_cutlass_dtype=cutlass.BFloat16, ab_assumed_align=32, swap_ab=False,
        sf_m=2, sf_n=8, sf_k=112, batch_size=1, max_active_clusters=148)
    started = time.monotonic()
    def compile_fn(inner=inner, i=i, started=started):
        out[f"asked_daemon_s{i}"] = time.monotonic() - started
        return inner()
    fn = build_and_load_cute_dsl_kernel("mm_fp4", name, compile_fn,
                                        extra_key_files=_blockscaled_gemm_cache_key_files())
    out[f"fn{i}"] = type(fn).__name__
out["stats"] = cf.stats()
print("RESULT " + json.dumps(out), flush=True)
"""


def test_flashinfer_builds_with_a_stopped_daemon_compile_here_after_one_short_wait(tmp_path):
    """Item 15 through FlashInfer: install() and two kernel builds while the daemon is
    stopped. The first build asks the daemon for a few seconds, the second not at all; both
    compile in the process, with one warning."""
    pytest.importorskip("flashinfer")
    d = DaemonProcess(tmp_path, workers=1, extra_env=ENV)
    os.kill(d.proc.pid, signal.SIGSTOP)
    try:
        out = subprocess.run([sys.executable, "-c", FLASHINFER_STOPPED], capture_output=True,
                             text=True, timeout=300,
                             env={**os.environ, **ENV, "CACHED_SOCKET": d.socket,
                                  "FLASHINFER_WORKSPACE_BASE": str(tmp_path / "fi")})
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
        d.stop()
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, out.stderr[-3000:]
    result = json.loads(lines[0][7:])
    assert result["fn0"] == result["fn1"] == "Function"
    assert result["stats"] == {"fallback": 2}
    assert result["asked_daemon_s0"] < 15 and result["asked_daemon_s1"] < 1, result
    warnings = [line for line in out.stderr.splitlines()
                if line.startswith("WARNING-LINE cached")]
    assert len(warnings) == 1, warnings


# -- item 21: malformed replies through Client.load -----------------------------------------

ARTIFACT = {"key": "a" * 64, "family": "flashinfer.mm_fp4", "kernel_name": "k", "symbol": "s",
            "library_sha256": "b" * 64, "object_sha256": "c" * 64, "toolchain": "t",
            "runtime_library": {"name": "libcute_dsl_runtime.so"}}


@pytest.mark.parametrize("reply_for, why", [
    (lambda m: {"ok": True, "id": m["id"]}, "needs the field 'artifact'"),
    (lambda m: {"ok": True, "id": m["id"], "artifact": {"key": 5}}, "key must be"),
    (lambda m: {"ok": True, "id": m["id"], "artifact": []}, "artifact must be"),
    (lambda m: {"ok": True, "id": m["id"], "artifact": {**ARTIFACT, "symbol": None}},
     "symbol must be"),
    (lambda m: {"ok": True, "id": m["id"], "artifact": ARTIFACT, "fds": ["object", "library"]},
     "names 2 descriptors but passed 0"),
    (lambda m: {"ok": True, "id": m["id"], "artifact": ARTIFACT}, "passed descriptors for"),
    (lambda m: {"ok": True, "id": m["id"] + 1, "artifact": ARTIFACT}, "answered request"),
])
def test_malformed_replies_surface_from_load_as_bad_reply(tmp_path, mm_fp4_requests, reply_for,
                                                          why):
    """Item 21: a daemon's malformed reply surfaced from Client.load as KeyError or
    AttributeError; now it is BadReply (a DaemonUnavailable: the caller may fall back)."""
    path = str(tmp_path / "not-a-daemon.sock")
    thread = serve_once(path, reply_for, hello=True)
    with pytest.raises(BadReply, match=why):
        Client(path, timeout=5, fallback=False).load(mm_fp4_requests[0])
    thread.join(5)
    assert issubclass(BadReply, DaemonUnavailable)
