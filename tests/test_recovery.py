"""Issue 24, "Recovery": a vLLM process whose daemon is stopped, restarted or hung uses it
again once it answers, and tells it how many kernels it compiled meanwhile; a hung daemon
costs a starting process a quarter of a second, not a probe's timeout.

Real processes with the plugin loaded as vLLM's loader loads it (entry point), real Triton
compiles (``triton.compile`` for sm_90: tests/jit_harness.py), a real daemon stopped with
SIGTERM and started again on the same socket and store, or stopped with SIGSTOP."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import DaemonProcess
from jit_harness import JIT, environment

pytestmark = pytest.mark.skipif(not (JIT / "triton").is_dir(),
                                reason="make setup-jit installs Triton")

BARE = ["--toolchain", f"bare={sys._base_executable}"]  # write-back needs no compiler

STEPS = """
import json, logging, os, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="LOG %(name)s %(message)s")
t0 = time.monotonic()
from importlib.metadata import entry_points
plugins = {ep.name: ep for ep in entry_points(group="vllm.general_plugins")}
plugins["cached"].load()()          # what vllm.plugins.load_general_plugins() does
register_s = time.monotonic() - t0
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from cached_client.integrations.jit import triton as ct
from cached_client.integrations.vllm import state as vllm_state

def kernel(n):                      # a new kernel each time (another constant)
    src = f'''
import triton, triton.language as tl
@triton.jit
def k{n}(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * {n}, mask=offs < n)
'''
    path = os.path.join(os.getcwd(), f"k{n}.py")
    open(path, "w").write(src)
    ns = {}
    exec(compile(src, path, "exec"), ns)
    triton.compile(ASTSource(fn=ns[f"k{n}"], signature={"x_ptr": "*fp32", "n": "i32",
                   "BLOCK": "constexpr"}, constexprs={"BLOCK": 256}),
                   target=GPUTarget("cuda", 90, 32))
    return dict(ct.stats())

def step(name, **out):
    print("STEP " + json.dumps({"step": name, **out}), flush=True)
    sys.stdin.readline()

def usable_within(seconds):
    d, t = vllm_state.daemon(), time.monotonic()
    while d.hello is None and time.monotonic() - t < seconds:
        time.sleep(0.05)
    return d.hello is not None, round(time.monotonic() - t, 2)

d = vllm_state.daemon()
plan = sys.argv[1].split(",")
n = 1
for what in plan:
    if what == "compile":
        n += 1
        step("compiled", stats=kernel(n), usable=d.hello is not None, register_s=register_s)
    elif what == "wait":
        ok, s = usable_within(60)
        step("waited", usable=ok, seconds=s, stats=dict(ct.stats()))
    elif what == "settle":           # the prober's report after it answered again
        time.sleep(1.0)
        from cached_client import monitor
        step("settled", recovered=d.live.answered_after_failure, outside=monitor.counts())
    elif what == "serve":            # what the plugin's wrapped worker warm-up does
        from cached_client import monitor
        monitor.serving(d.live)
        step("serving")
step("end")
"""


class Steps:
    """The process running STEPS: each ``next()`` lets it take one step and returns it."""

    def __init__(self, tmp: Path, sock: str, plan: str) -> None:
        script = tmp / "steps.py"
        script.write_text(STEPS)
        env = environment("plain", sock, tmp / "w")
        env["TRITON_CACHE_DIR"] = str(tmp / "triton")
        self.err = open(tmp / "stderr.log", "w+")
        self.proc = subprocess.Popen([sys.executable, str(script), plan], env=env,
                                     cwd=str(tmp / "w"), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.err, text=True)
        self.first = True

    def next(self) -> dict:
        if not self.first:
            self.proc.stdin.write("go\n")  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
        self.first = False
        for line in self.proc.stdout:  # type: ignore[union-attr]
            if line.startswith("STEP "):
                return json.loads(line[5:])
        raise AssertionError(f"the process ended: {self.log()[-4000:]}")

    def log(self) -> str:
        self.err.flush()
        self.err.seek(0)
        return self.err.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.err.close()


def _within(seconds: float, condition) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _metric(d: DaemonProcess, name: str) -> float:
    with urllib.request.urlopen(f"http://{d.stats()['http']}/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def test_a_daemon_stopped_and_restarted_under_a_running_process_is_used_again(tmp_path):
    """Before: the plugin decided at start; a daemon restart meant every later kernel was
    compiled in the process for its lifetime, and the daemon never heard of it."""
    d = DaemonProcess(tmp_path, workers=1, extra_args=BARE)
    steps = Steps(tmp_path, d.socket, "compile,compile,wait,compile,settle")
    try:
        first = steps.next()
        assert first["usable"] and first["stats"] == {"compiled": 1}, first  # via the daemon
        d.stop()                                          # the daemon goes away
        second = steps.next()  # Triton's hook finds it gone: compiled here, counted
        assert second["usable"] is False and second["stats"]["local"] == 1, second
        d = DaemonProcess(tmp_path, workers=1, extra_args=BARE)  # back, same socket and store
        waited = steps.next()
        assert waited["usable"], waited                   # the prober heard from it again
        third = steps.next()                              # its kernels are used again
        assert third["stats"]["compiled"] == 2, third     # a write-back through the daemon
        assert steps.next()["recovered"] == 1
        stats = d.stats()
        assert stats["client_fallbacks"] == 1 and \
            stats["families"]["triton"]["client_fallbacks"] == 1, stats
        assert _metric(d, 'cached_client_fallbacks_total{family="triton"}') == 1.0
        assert '"event": "client.fallbacks_reported"' in d.log()
        steps.next()
        log = steps.log()
        assert "the daemon at" in log and "answers again; its kernels are used again" in log
    finally:
        steps.close()
        d.stop()


def test_a_hung_daemon_costs_a_starting_process_a_quarter_second_and_is_used_once_it_answers(
        tmp_path):
    """Before: the plugin's probe waited 2 s for a SIGSTOPped daemon's hello (2.15 s per
    starting process, docs/benchmarks.md), then installed nothing for the process's life."""
    d = DaemonProcess(tmp_path, workers=1, extra_args=BARE)
    os.kill(d.proc.pid, signal.SIGSTOP)
    steps = Steps(tmp_path, d.socket, "compile,wait,compile")
    try:
        first = steps.next()
        assert first["register_s"] < 1.0, first           # START_WAIT_S (0.25 s) and imports
        assert first["usable"] is False and first["stats"]["local"] == 1, first
        os.kill(d.proc.pid, signal.SIGCONT)
        waited = steps.next()
        assert waited["usable"], waited
        again = steps.next()
        assert again["stats"]["compiled"] == 1, again     # through the daemon again
        steps.next()
        assert "hooks installed" in steps.log()           # the first line said so
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
        steps.close()
        d.stop()


def test_a_report_naming_a_family_the_daemon_lacks_is_refused_and_counts_nothing(tmp_path):
    from cached_client import protocol as p
    from cached_client.errors import UnknownFamily

    d = DaemonProcess(tmp_path, workers=0)
    try:
        c = d.client(timeout=10)
        with pytest.raises(UnknownFamily, match="nothing was counted"):
            c.call("report", p.ReportRequest(fallbacks={"triton": 1, "no.such": 2}))
        assert d.stats()["client_fallbacks"] == 0
        c.report({"triton": 2})
        assert d.stats()["families"]["triton"]["client_fallbacks"] == 2
    finally:
        d.stop()


def test_liveness_probes_once_at_a_time_and_backs_off(tmp_path):
    """Nothing listens: the first probe is refused and the prober waits 0.5 s, then 1 s,
    then 2 s ... before the next; asking usable() does no I/O and starts no probe."""
    from cached_client import liveness

    live = liveness.Liveness(str(tmp_path / "none.sock"))
    assert live.wait(2.0) is False and "cannot connect" in live.reason
    before = live.probes
    for _ in range(10_000):
        assert live.usable() is False
    assert live.probes <= before + 1  # at most the one the backoff had due


def test_a_refused_report_is_dropped_and_the_daemon_stays_usable(tmp_path):
    """A report the daemon refuses (here: a family it does not have; an older daemon would
    refuse the new fields) is not a daemon that stopped answering: the prober drops it and
    the hooks keep using the daemon; the next report is counted."""
    from cached_client import liveness

    d = DaemonProcess(tmp_path, workers=0)
    try:
        live = liveness.Liveness(d.socket)
        assert live.wait(10.0) is True
        live.fell_back("no.such.family")
        live.poke()
        before = live.probes
        assert _within(10, lambda: live.probes > before)  # the probe that sends the report
        live.fell_back("triton", 2)
        live.poke()
        assert _within(10, lambda: d.stats()["client_fallbacks"] > 0)
        assert live.usable() and live.answered_after_failure == 0
        assert d.stats()["families"]["triton"]["client_fallbacks"] == 2
    finally:
        d.stop()
