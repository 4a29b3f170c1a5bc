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
import time

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


def test_a_lone_surrogate_is_invalid_argument_on_every_op_and_nothing_is_queued(quick):
    """Issue 37 (low): lone UTF-16 surrogates got ``internal`` on six ops (and reached a
    worker through get and prefetch). Now a request whose strings are not text is
    invalid_argument naming the field, before its op sees it; the connection stays and a
    surrogate pair (real text) is taken."""
    bad = "\ud800x"
    req = {"family": "cached.test.fault", "arch": "sm_100a", "sm_count": 148,
           "max_active_clusters": 148, "params": {"action": "build", "tag": bad}}
    put = {"op_name": bad, "n": 1, "k": 1, "dtype": "a", "arch": "b", "device": "c",
           "bucket": 1, "kernel": "k", "tactic": {bad: 1}, "time_us": 1.0, "toolchain": "t",
           "reduction_class": "c"}
    frames = [{"op": "get", "request": req}, {"op": "prefetch", "requests": [req]},
              {"op": "plan", "family": "cached.test.fault", "shape": [1, 2, 3],
               "arch": "sm_100a", "options": {"ab_dtype": bad}},
              {"op": "report", "fallbacks": {bad: 1}}, {"op": "autotune_put", **put},
              {"op": "autotune_get", "device": bad}, {"op": "planned", "family": bad},
              {"op": "certify_record", "record": {"family": bad}},
              {"op": "certifications", "family": bad}, {"op": "lease", "request": req},
              {"op": "flashinfer_artifacts", "family": bad}]
    bodies = [json.dumps({"id": i, **f}).encode() for i, f in enumerate(frames)]
    replies, closed = _frames(quick.socket, bodies + [b'{"id":99,"op":"hello"}'])
    assert not closed and len(replies) == len(frames) + 1
    by_id = {r["id"]: r for r in replies}
    for i, f in enumerate(frames):
        error = by_id[i].get("error") or {}
        assert error.get("code") == "invalid_argument", (f["op"], by_id[i])
        assert "lone UTF-16 surrogate" in error["message"]
    assert by_id[99]["ok"] is True
    assert quick.stats()["in_flight"] == 0  # nothing reached the queue
    pair = raw_call(quick.socket, {"op": "planned", "family": "\ud83d\ude00"})
    assert pair["ok"] is True and pair["shapes"] == []


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


# -- toolchain interpreters that are not what they claim ------------------------------------

BINARY = ("#!/bin/sh\nprintf '\\377\\376\\000\\033[2Jgarbage\\n\\200more'\n"
          "printf '\\377oops\\n' >&2\nexit 3\n")
HANGING = "#!/bin/sh\necho $$ > {pids}\nsleep 600 &\necho $! >> {pids}\nsleep 600\n"


def _interpreter(path, text: str):
    path.write_text(text)
    path.chmod(0o755)
    return path


def _serve(tmp_path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cached", "serve", "--store",
                           str(tmp_path / "store"), "--socket", str(tmp_path / "x.sock"),
                           "--http", "off", *args], capture_output=True, text=True,
                          timeout=timeout)


def _left_behind(tmp_path, *expected: str) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir() if p.name not in expected)


def test_an_interpreter_printing_binary_is_refused_in_one_line_leaving_nothing(tmp_path):
    """A toolchain "interpreter" writing invalid UTF-8 and control bytes: the daemon died
    with a UnicodeDecodeError traceback, after creating its store. Now: exit 2, one line
    naming the toolchain, its exit code and what it wrote (escaped), and no store, socket
    or lock file left in the directory."""
    bad = _interpreter(tmp_path / "binary.sh", BINARY)
    out = _serve(tmp_path, "--toolchain", f"bin={bad}")
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert f"toolchain bin: probing {bad} failed (exit 3" in lines[0]
    assert "\\xffoops" in lines[0]
    assert _left_behind(tmp_path, "binary.sh") == []


def test_a_hanging_interpreter_is_killed_with_its_children_leaving_nothing(tmp_path):
    """An interpreter that never answers and started a child of its own: the probe's
    timeout (120 s, fixed) killed only the interpreter, and the child lived on. Now the
    interpreter's process group is killed at ``--probe-timeout``: exit 2 in one line, both
    processes gone, nothing left behind."""
    pids = tmp_path / "pids"
    hang = _interpreter(tmp_path / "hang.sh", HANGING.format(pids=pids))
    started = time.monotonic()
    out = _serve(tmp_path, "--toolchain", f"hang={hang}", "--probe-timeout", "2")
    assert out.returncode == 2, out.stderr[-2000:]
    assert time.monotonic() - started < 60
    assert out.stderr.strip().splitlines() == [
        f"cached serve: toolchain hang: probing {hang} took over 2s; it and the processes it "
        "started were killed"], out.stderr
    assert [pid for pid in map(int, pids.read_text().split()) if _running(pid)] == []
    assert _left_behind(tmp_path, "hang.sh", "pids") == []


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting for its reaper is not)."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def test_a_smaller_max_bytes_at_restart_evicts_at_start(tmp_path):
    """Three 200 kB kernels stored, then a restart with --max-bytes that holds one: the
    store stayed at three (over its budget) until the next publish. Now it is evicted to
    the budget before the socket listens: one entry, within the budget, the two oldest
    gone, their blobs deleted."""
    d = DaemonProcess(tmp_path, workers=1)
    try:
        client = d.client(timeout=120)
        for tag in ("a", "b", "c"):
            client.get(_built(tag, 200_000))
            time.sleep(0.05)  # distinct last_used, oldest first
        sizes = [r["size"] for r in _index(d)]
        assert len(sizes) == 3
    finally:
        d.stop()
    blobs = sorted(p.name for p in (tmp_path / "store" / "blobs").rglob("*") if p.is_file())
    budget = max(sizes) + 1000
    d = DaemonProcess(tmp_path, workers=1, ready_workers=0,
                      extra_args=["--max-bytes", str(budget), "--evict-grace", "0"])
    try:
        stats = d.stats()
        assert stats["entries"] == 1 and stats["bytes"] <= budget, stats
        assert stats["evictions"] == 2 and not stats["over_budget"], stats
        assert d.client(timeout=120, transfer="path").get(_built("c", 200_000)).origin == "hit"
        left = sorted(p.name for p in (tmp_path / "store" / "blobs").rglob("*")
                      if p.is_file())
        assert len(left) == len(blobs) - 4, (blobs, left)  # two blobs per evicted kernel
    finally:
        d.stop()


def _built(tag: str, size: int):
    from cached_client import KernelRequest

    return KernelRequest("cached.test.fault", {"action": "build", "tag": tag, "bytes": size},
                         "sm_100a", 148, 148)


def _index(d: DaemonProcess) -> list[dict]:
    import sqlite3

    with sqlite3.connect(d.store / "index.sqlite") as db:
        db.row_factory = sqlite3.Row
        return [dict(r) for r in db.execute("select * from entries")]


# -- a toolchain whose workers die while starting ---------------------------------------------

DIES_AT_START = """#!/bin/sh
case "$2" in
  *cached.worker*) echo "libcuda.so.1: cannot open shared object file" >&2; exit 3;;
esac
exec {python} "$@"
"""


def test_a_toolchain_whose_workers_die_at_start_fails_requests_at_once_and_backs_off(
        tmp_path):
    """The hostile run's interpreter states its identity but every worker of it exits at
    start: a get waited out its whole deadline ("it keeps compiling") while the pool
    respawned every 2 s for ever, uncounted. Now the get is ``compile_failed`` at once,
    naming the toolchain, the exit status and what the worker wrote; so is the next one
    (no wait for a worker); the respawns back off (1, 2, 4 s...) and count in
    ``worker_restarts``."""
    from cached_client import CompileFailed, KernelRequest

    wrapper = _interpreter(tmp_path / "dies.sh", DIES_AT_START.format(python=sys.executable))
    d = DaemonProcess(tmp_path, workers=1, ready_workers=0,
                      extra_args=["--toolchain", f"dies={wrapper}"])
    try:
        client = d.client(timeout=120, fallback=False)
        request = KernelRequest("cached.test.fault", {"action": "build", "tag": "x"},
                                "sm_100a", 148, 148)
        for _ in range(2):
            started = time.monotonic()
            with pytest.raises(CompileFailed) as err:
                client.get(request, timeout=60)
            assert time.monotonic() - started < 20  # not the 60 s deadline
            message = err.value.message
            assert "toolchain dies's workers die while starting" in message, message
            assert "exit code 3" in message and "libcuda.so.1: cannot open" in message
        time.sleep(7.5)
        stats = d.stats()
        assert stats["failures"] == 2 and stats["in_flight"] == 0, stats
        (toolchain,) = stats["toolchains"]  # `cached stats --json` says why, HTTP does not
        assert "exit code 3" in toolchain["broken"], toolchain
        assert "broken" not in _http_stats(d)["toolchains"][0]
        text = subprocess.run([sys.executable, "-m", "cached", "stats", "--socket", d.socket],
                              capture_output=True, text=True, timeout=60).stdout
        assert "Broken:" in text and "toolchain dies's workers die while starting" in text
        retries = [json.loads(line)["retry_in_s"] for line in d.log_path.read_text().splitlines()
                   if '"worker.start_failed"' in line]
        assert retries[:3] == [1.0, 2.0, 4.0], retries  # 2 s each, for ever, before
        assert stats["worker_restarts"] == len(retries) <= 4, (stats, retries)
    finally:
        d.stop()


SPEWS = """#!/bin/sh
case "$2" in
  *cached.worker*) (yes "a broken toolchain's worker says this again and again" \
                    | head -c 400000000 >&2) &;;
esac
exec {python} "$@"
"""


def test_a_toolchain_whose_workers_flood_stderr_gets_a_bounded_share_of_the_log(tmp_path):
    """Issue 37 (low): a broken toolchain's stderr was forwarded without limit (333 MB in
    30 s). Now each toolchain's workers get STDERR_BYTES (64 KiB) of the daemon's log every
    10 s, the rest drained and dropped, said in one line; the worker still serves."""
    from cached_client import KernelRequest

    wrapper = _interpreter(tmp_path / "spews.sh", SPEWS.format(python=sys.executable))
    d = DaemonProcess(tmp_path, workers=1, extra_args=["--toolchain", f"spews={wrapper}"])
    try:
        request = KernelRequest("cached.test.fault", {"action": "build", "tag": "spew"},
                                "sm_100a", 148, 148)
        assert d.client(timeout=60, fallback=False).get(request).origin == "compiled"
        time.sleep(3)  # the worker has written far more than a window's share by now
        size = d.log_path.stat().st_size
        assert size < 300_000, size  # a window's 64 KiB or two, and the daemon's own lines
        assert '"worker.stderr_dropped"' in d.log_path.read_text()
        assert d.stats()["workers_alive"] == 1
    finally:
        d.stop()


FAILS_AT_FIRST = """#!/bin/sh
n=$(cat {count} 2>/dev/null || echo 0); echo $((n + 1)) > {count}
[ "$n" -lt {fails} ] && {{ echo "start $n failed" >&2; exit 1; }}
exec {python} "$@"
"""


def _http_stats(d: DaemonProcess) -> dict:
    import urllib.request

    address = d.stats()["http"]
    with urllib.request.urlopen(f"http://{address}/stats", timeout=10) as reply:
        return json.loads(reply.read())


def test_worker_start_retries_double_up_to_their_cap_and_reset_when_one_is_ready(
        tmp_path, caplog):
    """The back-off itself, on a real pool whose interpreter dies at its first six starts:
    the delays double to the cap and stay there, each failure counts as a restart, acquire
    fails at once (naming the cause) while the toolchain is broken; once a worker is ready
    the toolchain is whole again and the delay starts over."""
    import asyncio
    import logging

    from cached.pool import Launcher, Pool, WorkerFailed
    from cached.toolchain import toolchains

    interpreter = _interpreter(tmp_path / "flaky.sh", FAILS_AT_FIRST.format(
        count=tmp_path / "count", fails=6, python=sys.executable))

    async def run() -> dict:
        pool = Pool(1, 10, [Launcher("f", str(interpreter), toolchains.environment(),
                                     str(toolchains.code_dir()))], retry=(0.05, 0.2))
        await pool.start()
        while pool.restarts < 2:
            await asyncio.sleep(0.01)
        out = {}
        try:
            await pool.acquire("f")
        except WorkerFailed as exc:
            out["broken"] = str(exc)
        worker = await asyncio.wait_for(_acquire_when_whole(pool), 60)
        out.update(restarts=pool.restarts, retry_in=pool._retry_in["f"],
                   broken_after=dict(pool.broken), pid=worker.pid)
        await pool.stop()
        return out

    with caplog.at_level(logging.ERROR, logger="cached.pool"):
        out = asyncio.run(run())
    delays = [r.fields["retry_in_s"] for r in caplog.records
              if r.getMessage() == "worker.start_failed"]
    assert delays == [0.05, 0.1, 0.2, 0.2, 0.2, 0.2], delays
    assert out["restarts"] == 6 and out["pid"] > 0, out
    assert "toolchain f's workers die while starting" in out["broken"], out
    assert "exit code 1" in out["broken"] and "start 1 failed" in out["broken"], out
    assert out["broken_after"] == {} and out["retry_in"] == 0.05, out


async def _acquire_when_whole(pool):
    """A worker of toolchain ``f``, asking again while it is broken."""
    import asyncio

    from cached.pool import WorkerFailed

    while True:
        try:
            return await pool.acquire("f")
        except WorkerFailed:
            await asyncio.sleep(0.05)


# -- write-back leases: a holder that is stuck, one that never ends, and its waiters -------

HOLDER = """
import json, sys, threading, time
from cached_client import Client, KernelRequest, writeback
client = Client(sys.argv[1], timeout=30, fallback=False)
request = KernelRequest.from_wire(json.loads(sys.argv[2]))
def compile_object(path):
    print("HELD", flush=True)
    if sys.argv[3] == "stuck":  # waits on something that never comes: no CPU used
        threading.Event().wait(300)
    end = time.monotonic() + 300  # spins: CPU used, no end
    while time.monotonic() < end:
        pass
bound = {} if sys.argv[5] == "default" else {"max_hold_s": float(sys.argv[5])}
writeback.obtain(client, request, compile_object, ttl_s=float(sys.argv[4]), **bound)
"""


def _jit(kernel: str):
    from cached_client import KernelRequest

    return KernelRequest("flashinfer.jit", {"module": "bounds", "kernel": kernel,
                                            "tvm_ffi": True, "source_sha256": "0" * 64},
                         "sm_100a", 148, 148)


def _holder(d: DaemonProcess, kernel: str, mode: str, ttl_s: float,
            max_hold_s: float | str = "default"):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, d.socket,
                             json.dumps(_jit(kernel).to_wire()), mode, str(ttl_s),
                             str(max_hold_s)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "HELD"
    return proc


def test_a_lease_holder_whose_compile_is_stuck_loses_the_lease_after_its_ttl(quick):
    """A holder whose compile waits on something that never comes (no CPU used): its
    renewer renewed every ttl/3 for ever, so every other process of the node waited on it
    (3600 s each). Now it renews only while the process uses CPU: the lease runs out one
    TTL (1.5 s) after the compile stopped, and the next process gets it."""
    from cached_client.writeback import lease

    holder = _holder(quick, "stuck", "stuck", ttl_s=1.5)
    try:
        started = time.monotonic()
        reply = lease(quick.client(timeout=30), _jit("stuck"), ttl_s=30, wait_ms=10_000)
        assert reply.state == "granted", reply
        assert time.monotonic() - started < 8
        assert holder.poll() is None  # the holder is alive: only its lease ran out
        assert '"not renewed within 2s"' in quick.log_path.read_text()
    finally:
        holder.kill()
        holder.wait()


def test_a_holder_that_never_finishes_keeps_its_lease_at_most_max_hold_and_waiters_give_up(
        quick):
    """A holder whose compile spins for ever (CPU used, so it counts as progress) held the
    lease as long as it lived. Now it renews while it progresses (a waiter 2 s later still
    waits), for at most ``max_hold_s`` (4 s here), then the lease runs out within its TTL.
    A waiter that waited ``timeout`` seconds gives up: WaitedTooLong, a CompileLocally (its
    caller compiles in-process), its compile function not called."""
    from cached_client.writeback import CompileLocally, WaitedTooLong, lease, obtain

    holder = _holder(quick, "spins", "spin", ttl_s=1.5, max_hold_s=4)
    try:
        held_at = time.monotonic()
        calls = []
        with pytest.raises(WaitedTooLong) as err:
            obtain(quick.client(timeout=30), _jit("spins"), calls.append, timeout=2.5)
        assert isinstance(err.value, CompileLocally) and calls == []
        assert f"pid {holder.pid}" in str(err.value)
        reply = lease(quick.client(timeout=30), _jit("spins"), ttl_s=30, wait_ms=15_000)
        assert reply.state == "granted", reply
        assert 4 <= time.monotonic() - held_at < 4 + 1.5 + 5
        assert holder.poll() is None
    finally:
        holder.kill()
        holder.wait()


NORM_WAITER = """
import importlib, json, os, sys, time
from cached_client.integrations.flashinfer import cute_dsl as cf
cf.install(os.environ["CACHED_SOCKET"], lease_wait_s=float(os.environ["WAIT"]))
r = importlib.import_module("flashinfer.norm.kernels.rmsnorm_sigmoid_gate")
from flashinfer.jit import cute_dsl_core
spec_cls = cute_dsl_core.JitSpecCuteDsl
original = spec_cls._export_object
def export(self, path):
    if os.environ.get("HANG"):  # the holder: compiled, then stuck before it publishes
        print("HOLDER", flush=True)
        time.sleep(600)
    return original(self, path)
spec_cls._export_object = export
started = time.monotonic()
fn = r._get_compiled(8, 8 * r.HEAD_DIM, 8 * r.HEAD_DIM, 32, 4, 1)
print("RESULT " + json.dumps({"fn": type(fn).__name__, "stats": cf.stats(),
                              "seconds": time.monotonic() - started}), flush=True)
"""


def test_a_flashinfer_process_waiting_on_a_stuck_holder_compiles_it_itself(tmp_path):
    """Real FlashInfer (its RMSNorm-gate kernel, which the daemon writes back): one process
    holds the lease and is stuck before it publishes; another, installed with
    ``lease_wait_s=3``, waits 3 s, gives up (WaitedTooLong) and FlashInfer compiles the
    kernel in that process: a working function, one fallback, the holder untouched."""
    pytest.importorskip("flashinfer")
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_100a", "CACHED_SM_COUNT": "148"}
    d = DaemonProcess(tmp_path, workers=1, ready_workers=0, extra_env=env)
    holder = None
    try:
        base = {**env, "CACHED_SOCKET": d.socket, "WAIT": "3"}
        holder = subprocess.Popen([sys.executable, "-c", NORM_WAITER], stdout=subprocess.PIPE,
                                  text=True, env={**base, "HANG": "1",
                                                  "FLASHINFER_WORKSPACE_BASE": str(tmp_path / "h")})
        assert holder.stdout.readline().strip() == "HOLDER"
        out = subprocess.run([sys.executable, "-c", NORM_WAITER], capture_output=True,
                             text=True, timeout=600,
                             env={**base, "FLASHINFER_WORKSPACE_BASE": str(tmp_path / "w")})
        result = next(json.loads(line[7:]) for line in out.stdout.splitlines()
                      if line.startswith("RESULT "))
        assert result["fn"] == "Function" and result["stats"] == {"fallback": 1}, result
        assert "WaitedTooLong" in out.stderr and f"pid {holder.pid}" in out.stderr, out.stderr
        assert holder.poll() is None
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
        d.stop()


HAND_RENEWER = """
import json, sys, time
from cached_client import Client, KernelRequest, protocol as p
from cached_client.errors import NotAllowed
client = Client(sys.argv[1], timeout=30, fallback=False)
request = KernelRequest.from_wire(json.loads(sys.argv[2]))
reply = client.lease(p.LeaseRequest(request=request, ttl_s=60, wait_ms=0))
assert reply.state == "granted", reply
held = time.monotonic()
print("HELD", reply.ttl_s, flush=True)
while True:  # renews by hand, for ever, whatever its compile does
    time.sleep(0.3)
    try:
        client.lease_renew(p.LeaseRenewRequest(request=request, lease=reply.lease, ttl_s=60))
    except NotAllowed as exc:
        print("REFUSED", round(time.monotonic() - held, 1), exc.message, flush=True)
        break
time.sleep(60)
"""


def test_a_peer_renewing_by_hand_loses_its_lease_at_the_daemons_max_hold(tmp_path):
    """A peer with publish rights that renews its lease itself, for ever, with a long TTL
    (the client's renewer stops at its own max_hold_s; this one does not): every other
    process waited on it as long as it lived. The daemon's ``lease_max_hold`` (3 s here)
    ends it: no grant or renewal runs past it, a renewal after it is refused (not_allowed,
    naming the setting), and the next waiter gets the lease while the peer still lives."""
    from cached_client.writeback import lease

    d = DaemonProcess(tmp_path, workers=1, ready_workers=0,
                      extra_args=["--lease-max-hold", "3"])
    proc = subprocess.Popen([sys.executable, "-c", HAND_RENEWER, d.socket,
                             json.dumps(_jit("by_hand").to_wire())], stdout=subprocess.PIPE,
                            text=True)
    try:
        first = proc.stdout.readline().split()
        held_at = time.monotonic()
        assert first[0] == "HELD" and float(first[1]) <= 3, first  # the grant is capped too
        reply = lease(d.client(timeout=30), _jit("by_hand"), ttl_s=30, wait_ms=15_000)
        assert reply.state == "granted", reply
        assert time.monotonic() - held_at < 3 + 2
        refused = proc.stdout.readline().split(maxsplit=2)
        assert refused[0] == "REFUSED" and 2.5 <= float(refused[1]) < 5, refused
        assert "lease_max_hold" in refused[2], refused
        assert proc.poll() is None  # the peer lives on: only its lease ended
    finally:
        proc.kill()
        proc.wait()
        d.stop()


LATE_RENEWER = """
import json, sys
from cached_client import Client, KernelRequest, protocol as p
from cached_client.errors import NotAllowed
client = Client(sys.argv[1], timeout=30, fallback=False)
request = KernelRequest.from_wire(json.loads(sys.argv[2]))
reply = client.lease(p.LeaseRequest(request=request, ttl_s=60, wait_ms=0))
print("HELD", reply.state, flush=True)
sys.stdin.readline()  # renews only once the test says another process holds the kernel
try:
    client.lease_renew(p.LeaseRenewRequest(request=request, lease=reply.lease, ttl_s=60))
    print("RENEWED", flush=True)
except NotAllowed as exc:
    print("REFUSED", exc.message, flush=True)
"""


def test_a_renewal_after_the_lease_went_to_another_process_says_why_it_ended(tmp_path):
    """A holder that renews after its lease ran to ``lease_max_hold`` and was granted to the
    next waiter is refused with the reason its lease ended and the new holder's pid, not only
    "not the token in force"; the new holder keeps the lease."""
    from cached_client.writeback import lease

    d = DaemonProcess(tmp_path, workers=1, ready_workers=0,
                      extra_args=["--lease-max-hold", "2"])
    proc = subprocess.Popen([sys.executable, "-c", LATE_RENEWER, d.socket,
                             json.dumps(_jit("late").to_wire())], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().split() == ["HELD", "granted"]
        reply = lease(d.client(timeout=30), _jit("late"), ttl_s=30, wait_ms=15_000)
        assert reply.state == "granted", reply
        proc.stdin.write("go\n")
        proc.stdin.flush()
        refused = proc.stdout.readline()
        assert refused.startswith("REFUSED"), refused
        assert "lease_max_hold" in refused and f"pid {os.getpid()}" in refused, refused
        again = lease(d.client(timeout=30), _jit("late"), ttl_s=30, wait_ms=0)
        assert again.state == "wait" and again.holder_pid == os.getpid(), again
    finally:
        proc.kill()
        proc.wait()
        d.stop()
