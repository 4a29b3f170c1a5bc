"""The ``cached`` command as an operator meets it: help and version, what it says when no
daemon answers, nonsense refused by argparse, ``warm``'s progress (lines off a terminal, a
tqdm bar on one), ``stats`` (text, --json, --zero) and ``ls`` (header, filters, JSON), all
against one real daemon (one worker, CACHED_TEST_FAMILIES=1)."""

from __future__ import annotations

import argparse
import json
import os
import pwd
import re
import select
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from cached_client.gemm import plan as gemm_plan
from conftest import ROOT, DaemonProcess, run_cli

from cached import families
from cached.cli import build_parser
from cached.config import size_text
from cached.toolchain import compiler_stack

PEER = "cachedtest"
PEER_PY = shutil.which("python3", path="/usr/bin:/bin")
as_root = pytest.mark.skipif(os.geteuid() != 0 or not PEER_PY or not shutil.which("useradd"),
                             reason="needs root, useradd and a system python3")
SNAPSHOT_KEYS = {  # what stats --json had before issue 14: none of them may go
    "entries", "bytes", "hits", "misses", "compiles", "failures", "remote_hits", "remote",
    "compile_seconds", "in_flight", "queued", "running", "workers", "workers_alive",
    "workers_ready", "workers_idle", "worker_restarts", "connections", "errors", "families",
    "last_failures", "uptime_s", "toolchain", "serve_only", "store", "socket", "http",
    "max_bytes", "max_files", "evictions", "evicted_bytes", "over_budget",
    "client_fallbacks", "draining"}


@pytest.fixture(scope="module")
def shared():
    """A directory every user may enter (the peer user's tests reach the socket)."""
    d = Path(tempfile.mkdtemp(prefix="cached-cli-"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def d(shared):
    daemon = DaemonProcess(shared, workers=1, extra_args=["--max-bytes", "10MB",
                                                          "--socket-mode", "666"])
    yield daemon
    daemon.stop()


def cli(d: DaemonProcess, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return run_cli(args[0], "--socket", d.socket, *args[1:], check=check)


def fault_requests(path: Path, tag: str, n: int, seconds: float) -> Path:
    path.write_text(json.dumps([
        {"family": "cached.test.fault", "arch": "sm_100a", "sm_count": 148,
         "max_active_clusters": 148, "params": {"action": "sleep", "seconds": seconds,
                                                "tag": f"{tag}-{i}"}} for i in range(n)]))
    return path


# -- help, version, refusals ---------------------------------------------------------------


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_command_and_option_has_plain_help():
    parser = build_parser()
    commands = _subparsers(parser)
    assert set(commands) == {"serve", "config", "warm", "stats", "ls", "gc", "verify",
                             "export", "certify", "tune", "toolchains"}
    for name, sub in commands.items():
        assert sub.description and len(sub.description) > 40, f"cached {name}: no description"
        for action in sub._actions:
            assert action.help and action.help.strip(), f"cached {name} {action.option_strings}"
    for args in ([], *([name] for name in commands)):
        out = subprocess.run([sys.executable, "-m", "cached", *args, "--help"],
                             capture_output=True, text=True, check=True).stdout
        assert "``" not in out and "`" not in out and ":class:" not in out, args
        assert out.startswith("usage: cached"), args
    warm_help = run_cli("warm", "--help").stdout
    for family in families.names():
        assert family in warm_help
    assert "llama-3.1-8b" in warm_help


def test_each_flag_means_one_thing_across_commands():
    """--shape is M,N,K wherever it is (certify's and tune's weight is --weight N,K), --arch
    is the one target flag (warm has no --target), --toolchain names a registered toolchain
    (serve and config register one: NAME=PYTHON; warm picks one: NAME; ls filters by
    --built-with)."""
    seen: dict[str, dict[str, str]] = {}
    for name, sub in _subparsers(build_parser()).items():
        for action in sub._actions:
            for flag in action.option_strings:
                seen.setdefault(flag, {})[name] = action.metavar or ""
    assert set(seen["--shape"].values()) == {"M,N,K"}, seen["--shape"]
    assert seen["--weight"] == {"certify": "N,K", "tune": "N,K"}
    assert set(seen["--arch"].values()) == {"ARCH"} and "--target" not in seen
    assert seen["--toolchain"] == {"serve": "NAME=PYTHON", "config": "NAME=PYTHON",
                                   "warm": "NAME"}, seen["--toolchain"]
    assert seen["--built-with"] == {"ls": "WHICH"}
    result = run_cli("warm", "--manifest", "llama-3.1-8b", "--target", "sm_100a",
                     "--socket", "/nonexistent/cached.sock", check=False)
    assert result.returncode == 2 and "unrecognized arguments: --target" in result.stderr


def test_version_names_cached_and_its_toolchain():
    out = run_cli("--version").stdout.splitlines()
    assert out[0] == f"cached {compiler_stack.daemon_version()}"
    for name, version in compiler_stack.versions().items():
        assert f"{name} {version}" in out[1]


@pytest.mark.parametrize("args, message", [
    (["warm", "--limit", "-264"], "--limit: expected an integer from 1"),
    (["warm", "--limit", "0"], "--limit: expected an integer from 1"),
    (["warm", "--sm-count", "100000"], "--sm-count: expected an integer from 1 to 1024"),
    (["warm", "--timeout", "nan"], "--timeout: expected seconds above 0"),
    (["warm", "--timeout", "-5"], "--timeout: expected seconds above 0"),
    (["warm", "--progress-every", "0"], "--progress-every"),
    (["warm", "--progress", "sometimes"], "--progress: invalid choice"),
    (["gc", "--max-files", "-1"], "--max-files: expected an integer from 0"),
    (["gc", "--max-bytes", "lots"], "--max-bytes: expected a size"),
    (["gc", "--grace", "inf"], "--grace: expected seconds"),
    (["certify", "--family", "x", "--weight", "8,8", "--limit", "-1"], "--limit"),
])
def test_nonsense_counts_are_refused_before_anything_runs(args, message):
    result = run_cli(*args, "--socket", "/nonexistent/cached.sock", check=False)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_no_daemon_says_how_to_start_one(tmp_path):
    for command in (["stats"], ["ls"], ["warm", "--family", "flashinfer.mm_fp4", "--arch",
                                        "sm_100a", "--shape", "1,128,128"]):
        result = run_cli(*command, "--socket", str(tmp_path / "none.sock"), check=False)
        assert result.returncode == 2
        assert f"no daemon is running on {tmp_path / 'none.sock'}" in result.stderr
        assert f"cached serve --socket {tmp_path / 'none.sock'}" in result.stderr
        assert "[Errno" not in result.stderr
    stale = socket.socket(socket.AF_UNIX)  # a socket file nobody listens on any more
    stale.bind(str(tmp_path / "stale.sock"))
    stale.close()
    result = run_cli("stats", "--socket", str(tmp_path / "stale.sock"), check=False)
    assert result.returncode == 2 and "no daemon is running" in result.stderr


# -- warm: progress ------------------------------------------------------------------------


LINE = re.compile(r"^cached warm: (\d+)/(\d+) kernels \(\d+%\): (\d+) compiled, (\d+) cached, "
                  r"(\d+) failed(, last: .+)?; \d+\.\d\d kernels/s, [\d.]+s elapsed"
                  r"(, ETA \S+)?$")


def _progress_lines(stderr: str) -> list[tuple[int, int, int]]:
    """(done, total, failed) of each progress line; every line of that shape must parse."""
    out = []
    for line in stderr.splitlines():
        if line.startswith("cached warm: ") and "kernels to warm" not in line:
            m = LINE.match(line)
            assert m, line
            out.append((int(m.group(1)), int(m.group(2)), int(m.group(5))))
    return out


def test_warm_off_a_terminal_prints_a_line_per_n_kernels(d, tmp_path):
    requests = fault_requests(tmp_path / "r.json", "every", 5, 0.2)
    result = cli(d, "warm", "--requests", str(requests), "--progress-every", "2",
                 "--progress-interval", "3600", check=False)
    assert result.returncode == 1  # the fault family fails every build
    assert result.stderr.splitlines()[0] == ("cached warm: 5 kernels to warm; a line every 2 "
                                             "kernels or 3600s")
    assert _progress_lines(result.stderr) == [(2, 5, 2), (4, 5, 4), (5, 5, 5)]
    assert "last: cached.test.fault (failed)" in result.stderr
    assert re.fullmatch(r"0 compiled, 0 cached, 0 from the fleet tier, 5 failed in \d+\.\ds",
                        result.stdout.strip())


def test_warm_off_a_terminal_prints_a_line_per_interval_while_one_kernel_compiles(d, tmp_path):
    requests = fault_requests(tmp_path / "r.json", "interval", 1, 2.5)
    result = cli(d, "warm", "--requests", str(requests), "--progress-every", "1000",
                 "--progress-interval", "0.5", "--json", check=False)
    lines = _progress_lines(result.stderr)
    assert len([x for x in lines if x[0] == 0]) >= 3, result.stderr  # alive while waiting
    assert lines[-1] == (1, 1, 1)
    assert "ETA unknown" in result.stderr
    assert json.loads(result.stdout)["failed"] == 1  # stdout stays one JSON object


def _run_in_pty(argv: list[str], timeout: float = 120) -> str:
    import fcntl
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 140, 0, 0))
    proc = subprocess.Popen(argv, stdin=follower, stdout=follower, stderr=follower,
                            close_fds=True)
    os.close(follower)
    out, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 1.0)
        if not ready:
            continue
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    proc.wait(30)
    os.close(leader)
    return out.decode(errors="replace")


def test_warm_on_a_terminal_draws_a_tqdm_bar_with_rate_eta_and_last_kernel(d, tmp_path):
    requests = fault_requests(tmp_path / "r.json", "pty", 3, 0.5)
    out = _run_in_pty([sys.executable, "-m", "cached", "warm", "--socket", d.socket,
                       "--requests", str(requests)])
    frames = [f for f in re.split(r"[\r\n]", out) if f.strip()]
    bars = [f for f in frames if f.startswith("warm:")]
    assert bars, out
    assert re.search(r"warm:\s+0%\|.*\| 0/3 \[00:00<\?, \? kernel/s\]", out), out
    assert re.search(r"warm: 100%\|.*\| 3/3 \[\d\d:\d\d<00:00, +\d+\.\d\d kernel/s, "
                     r"0 compiled, 0 cached, 3 failed\]", out), out
    assert re.search(r"\| [12]/3 \[\d\d:\d\d<\d\d:\d\d, ", out), out  # an ETA on the way
    assert "last: cached.test.fault (failed)" in out
    assert "cached warm: " not in out  # no log lines on a terminal
    assert "0 compiled, 0 cached, 0 from the fleet tier, 3 failed in" in out


# -- warm of real kernels, stats, ls ---------------------------------------------------------


@pytest.fixture(scope="module")
def warmed(d):
    """Two real NVFP4 kernels compiled through `cached warm`, one of them warmed again (a
    pre-warm hit), then asked for by a client (a serving hit)."""
    out = cli(d, "warm", "--family", "flashinfer.mm_fp4", "--arch", "sm_100a", "--shape",
              "256,1024,7168", "--limit", "2", "--json")
    assert json.loads(out.stdout)["compiled"] == 2
    out = cli(d, "warm", "--family", "flashinfer.mm_fp4", "--arch", "sm_100a", "--shape",
              "256,1024,7168", "--limit", "1", "--json")
    assert json.loads(out.stdout)["cached"] == 1
    (first,) = d.client(timeout=60).plan("flashinfer.mm_fp4", (256, 1024, 7168), "sm_100a")[:1]
    assert d.client(timeout=60).get(first).origin == "hit"  # a serving request
    return d


def _field(text: str, label: str) -> str:
    match = re.search(rf"^{re.escape(label)}:\s*(.*)$", text, re.M)
    assert match, f"no {label!r} in:\n{text}"
    return match.group(1)


def test_stats_reads_like_ccache(warmed):
    d = warmed
    s = json.loads(cli(d, "stats", "--json").stdout)
    assert SNAPSHOT_KEYS <= set(s)
    assert re.fullmatch(r"[0-9a-f]{16}", s["toolchain"])
    text = cli(d, "stats").stdout
    requests = s["hits"] + s["misses"]
    assert s["hits"] >= 1 and s["prewarm_misses"] >= 2 and s["prewarm_hits"] >= 1
    assert _field(text, "Serving requests") == str(requests)
    assert _field(text, "Pre-warm requests") == (
        f"{s['prewarm_hits'] + s['prewarm_misses']} ({s['prewarm_hits']} stored, "
        f"{s['prewarm_misses']} compiled; not in the hits and misses above)")
    hit_ms = 1000 * s["hit_seconds_mean"]
    assert 0 < hit_ms < 5000
    assert _field(text, "  Mean latency").startswith(f"hit {hit_ms:.3f} ms, miss until served ")
    assert re.fullmatch(rf"\s*{s['hits']} / {requests} \({100 * s['hits'] / requests:.2f}%\)",
                        _field(text, "  Hits"))
    assert re.fullmatch(rf"\s*{s['misses']} / {requests} "
                        rf"\({100 * s['misses'] / requests:.2f}%\)", _field(text, "  Misses"))
    assert _field(text, "  Size") == (f"{size_text(s['bytes'])} / 10 MB "
                                      f"({100 * s['bytes'] / 10**7:.2f}%)")
    assert _field(text, "  Entries") == "2"
    assert _field(text, "Workers") == "1/1 ready, 1 idle, 0 restarts"  # idle counted right
    assert _field(text, "  Store") == str(d.store)
    assert _field(text, "  Socket") == d.socket
    assert _field(text, "  HTTP") == s["http"]
    assert _field(text, "Version") == f"cached {compiler_stack.daemon_version()}"
    for name, version in compiler_stack.versions().items():
        assert f"{name} {version}" in _field(text, "Toolchain")
    assert s["toolchain"] in _field(text, "Toolchain")
    assert re.fullmatch(r"(\d+\.\ds|\d+s|\d+m\d\ds) \(since \d{4}-\d\d-\d\d \d\d:\d\d:\d\d "
                        rf"{time.strftime('%Z')}\), serving", _field(text, "Uptime"))
    assert _field(text, "Counting since") == "start"
    table = text[text.index("\nFamily "):]
    for family, counts in s["families"].items():  # every registered family, idle ones too
        row = re.search(rf"^{re.escape(family)}\s+(\d+)\s+(\d+)\s", table, re.M)
        assert row and (int(row.group(1)), int(row.group(2))) == (counts["hits"],
                                                                  counts["misses"]), family
    assert {"cached.hopper_fp8", "flashinfer.mm_fp4", "cached.test.fault"} <= set(s["families"])
    assert s["families"]["cached.hopper_fp8"]["hits"] == 0


def test_stats_zero_starts_the_counts_again_and_metrics_go_on(warmed, tmp_path):
    d = warmed
    before = d.stats()
    with urllib.request.urlopen(f"http://{before['http']}/metrics", timeout=10) as r:
        metrics_before = r.read().decode()
    result = cli(d, "stats", "--zero")
    assert _field(result.stdout, "Serving requests") == str(before["hits"] + before["misses"])
    assert re.search(r"^Statistics zeroed at \d{4}-\d\d-\d\d \d\d:\d\d:\d\d [A-Z+-]\w*$",
                     result.stdout, re.M)
    after = d.stats()
    assert (after["hits"], after["misses"], after["failures"], after["last_failures"]) == (
        0, 0, 0, [])
    assert after["entries"] == before["entries"] == 2  # the store is not a counter
    assert after["stats_zeroed_at"] and after["uptime_s"] >= before["uptime_s"]
    assert all(c["hits"] == 0 for c in after["families"].values())
    cli(d, "warm", "--requests", str(fault_requests(tmp_path / "r.json", "zero", 1, 0)),
        check=False)
    assert d.stats()["prewarm_misses"] == 1  # counting again
    assert _field(cli(d, "stats").stdout, "Counting since").startswith("zeroed ")
    with urllib.request.urlopen(f"http://{before['http']}/metrics", timeout=10) as r:
        metrics_after = r.read().decode()
    name = 'cached_hits_total{family="flashinfer.mm_fp4"}'
    assert re.search(rf"^{re.escape(name)} (\S+)$", metrics_after, re.M).group(1) == \
        re.search(rf"^{re.escape(name)} (\S+)$", metrics_before, re.M).group(1)


def test_ls_has_a_header_filters_and_json_params_objects(warmed):
    d = warmed
    text = cli(d, "ls").stdout.splitlines()
    assert text[0].split() == ["KEY", "FAMILY", "ARCH", "SIZE", "HITS", "LAST", "USED",
                               "TOOLCHAIN", "KERNEL"]
    assert len(text) == 4 and text[-1].startswith("2 kernels, ")
    assert all(" flashinfer.mm_fp4 " in line for line in text[1:3])
    rows = json.loads(cli(d, "ls", "--json").stdout)
    assert len(rows) == 2 and all(isinstance(r["params"], dict) for r in rows)
    assert rows[0]["params"]["sf_vec_size"] == 16
    digest = d.stats()["toolchain"]
    for args, count in ((["--family", "flashinfer.mm_fp4"], 2), (["--family", "x"], 0),
                        (["--arch", "sm_100a"], 2), (["--arch", "sm_90a"], 0),
                        (["--built-with", "current"], 2), (["--built-with", "other"], 0),
                        (["--built-with", digest[:6]], 2), (["--built-with", "nvidia-cutlass-dsl"
                                                            "==4.8.1"], 2),
                        (["--built-with", "torch==0.0"], 0)):
        assert len(json.loads(cli(d, "ls", *args, "--json").stdout)) == count, args
    empty = cli(d, "ls", "--family", "cached.hopper_fp8").stdout.splitlines()
    assert empty[0].startswith("KEY") and empty[-1] == "0 kernels, 0 B (of 2 stored)"


def test_ls_json_feeds_warm_requests(warmed, tmp_path):
    listing = tmp_path / "kernels.json"
    listing.write_text(cli(warmed, "ls", "--json").stdout)
    out = json.loads(cli(warmed, "warm", "--requests", str(listing), "--json").stdout)
    assert (out["compiled"], out["cached"], out["failed"]) == (0, 2, 0)
    bad = tmp_path / "bad.json"
    bad.write_text('[{"family": "flashinfer.mm_fp4"}]')
    result = cli(warmed, "warm", "--requests", str(bad), check=False)
    assert result.returncode == 2 and "entry 0: request is missing params" in result.stderr


# -- another user ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def peer_uid() -> int:
    try:
        return pwd.getpwnam(PEER).pw_uid
    except KeyError:
        # another test process (pytest -n) may be adding it at the same moment
        subprocess.run(["useradd", "--system", "--no-create-home", PEER], capture_output=True)
        return pwd.getpwnam(PEER).pw_uid


def _as_peer(uid: int, *args: str) -> subprocess.CompletedProcess:
    site = sysconfig.get_paths()["purelib"]  # the daemon's dependencies, as installed
    return subprocess.run([PEER_PY, "-m", "cached", *args], user=uid, group=uid,
                          env={"PYTHONPATH": f"{ROOT}:{ROOT / 'client'}:{site}",
                               "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=60)


@as_root
def test_zeroing_needs_publish_rights_and_a_closed_socket_says_why(d, shared, peer_uid):
    result = _as_peer(peer_uid, "stats", "--socket", d.socket, "--zero")
    assert result.returncode == 2 and "not_allowed" in result.stderr and "zero_stats" in \
        result.stderr, result.stderr
    assert _as_peer(peer_uid, "stats", "--socket", d.socket).returncode == 0
    closed = socket.socket(socket.AF_UNIX)
    path = str(shared / "closed.sock")
    closed.bind(path)
    closed.listen(1)
    os.chmod(path, 0o600)  # root's alone
    try:
        result = _as_peer(peer_uid, "stats", "--socket", path)
    finally:
        closed.close()
    assert result.returncode == 2 and f"{path}: Permission denied" in result.stderr
    assert "cached-clients" in result.stderr


# -- warm of the batch-invariant GEMM family, cached toolchains (last: they add entries) ----


def test_warm_of_the_hopper_family_is_the_plans_choice_per_m_bucket_unless_asked(d):
    """warm --family cached.hopper_fp8 --shape M,N,K compiles what clients will ask for:
    the tactic gemm_plan picks per M bucket up to M (the code clients run), not the
    family's whole space, which takes --all-tactics."""
    hopper = gemm_plan.HOPPER_FAMILY
    base = ["warm", "--family", hopper, "--arch", "sm_90a", "--plan-only", "--json"]
    default = json.loads(cli(d, *base, "--shape", "64,4096,4096").stdout)
    plan = gemm_plan.plan_gemm(d.client(timeout=120), 4096, 4096, arch="sm_90a", max_m=64,
                               prefetch=False)
    assert default["requests"] == [r.to_wire() for r in plan.requests]
    assert 1 <= default["total"] <= len(gemm_plan.buckets_up_to(64)) + 1, default["total"]
    whole = json.loads(cli(d, *base, "--shape", "64,4096,4096", "--all-tactics").stdout)
    assert whole["total"] > 10 * default["total"], (whole["total"], default["total"])
    assert all(r in whole["requests"] for r in default["requests"])
    wanted = gemm_plan.plan_gemm(d.client(timeout=120), 256, 512, arch="sm_90a", max_m=1,
                                 prefetch=False).requests
    warmed = json.loads(cli(d, "warm", "--family", hopper, "--arch", "sm_90a", "--shape",
                            "1,256,512", "--json").stdout)
    assert (warmed["compiled"], warmed["failed"]) == (len(wanted), 0), warmed
    for request in wanted:  # what a client then asks for is there
        assert d.client(timeout=60).get(request).origin == "hit"


def test_toolchains_lists_every_family_each_compiles(d):
    text = cli(d, "toolchains").stdout
    listed = json.loads(cli(d, "toolchains", "--json").stdout)
    (default,) = listed
    assert {"cached.hopper_fp8", "flashinfer.mm_fp4", "flashinfer.bi.bmm_fp8"} <= set(
        default["families"]), default["families"]
    assert not {"flashinfer.jit", "flashinfer.nvcc", "triton"} & set(default["families"])
    assert f"families {', '.join(default['families'])}" in text, text
