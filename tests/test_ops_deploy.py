"""Deployment: systemd units verify, their exposure score, the shipped units booted under a
real systemd (sandbox applied, compiles, group-only socket, leases, IP allow list), socket
activation with group-only access and sd_notify, and the Dockerfile lints."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import booted_systemd
import pytest
from booted_systemd import BootedSystemd, json_line
from cached_client import Client
from cached_client.protocol import HEADER, decode_body, encode_frame
from conftest import ROOT, SHAPE

CLIENT_GROUP = 4242  # stands for the inference service's group (SocketGroup=)
MEMBER_UID, OUTSIDER_UID = 4243, 4244


def _tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    assert path, f"{name} is not installed (make setup installs it)"
    return path


def test_systemd_units_verify(tmp_path: Path):
    for name in ("cached.service", "cached.socket"):
        text = (ROOT / "deploy" / name).read_text()
        # verify checks that ExecStart's binary exists: point it at this checkout's.
        text = text.replace("/opt/cached/venv/bin/cached", str(Path(sys.executable).parent
                                                               / "cached"))
        (tmp_path / name).write_text(text)
    result = subprocess.run([_tool("systemd-analyze"), "verify", "--man=no",
                             str(tmp_path / "cached.service"), str(tmp_path / "cached.socket")],
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr
    service = (ROOT / "deploy" / "cached.service").read_text()
    for line in ("Type=notify", "WatchdogSec=", "StateDirectory=cached",
                 "NoNewPrivileges=yes", "ProtectSystem=strict",
                 "ProtectHome=yes", "PrivateTmp=yes", "RestrictAddressFamilies=", "MemoryMax=",
                 "User=cached", "EnvironmentFile=-/etc/cached/cached.env",
                 # the store readable by exactly the socket's group (test_exposure.py)
                 "Group=cached-clients", "StateDirectoryMode=0750"):
        assert line in service, line
    # below vLLM (a unit with the defaults): lower CPU and IO weights, niced, capped tasks
    # and memory (the booted test reads them back from systemd and the kernel)
    below = dict(re.findall(r"^(CPUWeight|IOWeight|Nice|TasksMax|MemoryHigh)=(\S+)$",
                            service, re.MULTILINE))
    assert int(below["CPUWeight"]) < 100 and int(below["IOWeight"]) < 100, below
    assert 0 < int(below["Nice"]) <= 19 and 0 < int(below["TasksMax"]) <= 4096, below
    assert below["MemoryHigh"].endswith("G"), below
    # systemd chowns a RuntimeDirectory= recursively on start: the socket in /run/cached
    # would become cached:cached (test_the_shipped_units_serve_under_systemd_with_their_hardening)
    assert not re.search(r"^RuntimeDirectory", service, re.MULTILINE)
    sock = (ROOT / "deploy" / "cached.socket").read_text()
    assert "SocketMode=0660" in sock and "SocketGroup=cached-clients" in sock


EXPOSURE_BEFORE = 1.7  # the unit before issue 14 (docs/operations.md, "Hardening")
EXPOSURE = 1.1


def test_unit_exposure_score_is_lower():
    result = subprocess.run([_tool("systemd-analyze"), "security", "--offline=yes",
                             str(ROOT / "deploy" / "cached.service")],
                            capture_output=True, text=True)
    match = re.search(r"Overall exposure level for cached.service: (\d+\.\d)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match.group(1)) <= EXPOSURE < EXPOSURE_BEFORE
    for directive in ("SystemCallFilter=~@privileged", "SystemCallFilter=~@resources",
                      "RemoveIPC=", "PrivateMounts=", "ProcSubset=", "ProtectProc="):
        line = next(x for x in result.stdout.splitlines() if directive in x)
        assert line.lstrip().startswith("\u2713"), line  # a check mark: the unit has it


# -- the shipped units under a real systemd (tests/booted_systemd.py) ------------------

SOCK = "/run/cached/cached.sock"
MEMBER, OUTSIDER = (MEMBER_UID, [CLIENT_GROUP]), (OUTSIDER_UID, [])
WARM = ("-m", "cached", "warm", "--socket", SOCK, "--family", "flashinfer.mm_fp4",
        "--arch", "sm_100a", "--shape", ",".join(map(str, SHAPE)), "--json")

# A lease holder that dies without releasing, and a waiter: run as a member of the group.
LEASE = """
import json, subprocess, sys, time
from cached_client import Client, KernelRequest
from cached_client.writeback import lease
request = KernelRequest("flashinfer.jit", {"module": "demo", "kernel": sys.argv[2],
                        "tvm_ffi": True, "source_sha256": "0" * 64}, "sm_100a", 148, 148)
def take(wait_ms):
    return lease(Client("/run/cached/cached.sock"), request, ttl_s=300.0, wait_ms=wait_ms)
if sys.argv[1] == "hold":
    print(json.dumps(take(0).to_wire()), flush=True)
    time.sleep(600)
elif sys.argv[1] == "once":
    print(json.dumps(take(0).to_wire()))
else:
    holder = subprocess.Popen([sys.executable, sys.argv[0], "hold", sys.argv[2]],
                              stdout=subprocess.PIPE, text=True)
    held = json.loads(holder.stdout.readline())["state"]
    alive = take(1000).state
    holder.kill()
    holder.wait()
    start = time.monotonic()
    after = take(10000).state
    print(json.dumps({"held": held, "alive": alive, "after": after,
                      "seconds": time.monotonic() - start}))
"""

# GET /healthz on the loopback address and on the namespace's other address.
HEALTHZ = """
import json, urllib.request
out = {}
for host in ("127.0.0.1", "10.0.0.1"):
    try:
        with urllib.request.urlopen(f"http://{host}:8377/healthz", timeout=3) as r:
            out[host] = json.load(r)["ok"]
    except OSError as exc:
        out[host] = type(getattr(exc, "reason", exc)).__name__
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def booted():
    why = booted_systemd.unavailable()
    if why:
        pytest.skip(why)
    deploy = ROOT / "deploy"
    units = {name: (deploy / name).read_text() for name in ("cached.service", "cached.socket")}
    units["cached-test.target"] = "[Unit]\nDescription=cached test boot\nWants=cached.socket\n"
    # The test's only additions: this checkout's code, the interpreter's library path, one
    # worker, HTTP on every address (to show the IP allow list), the member may publish.
    units["cached.service.d/test.conf"] = (
        f"[Service]\nEnvironment=PYTHONPATH={ROOT}:{ROOT}/client "
        "LD_LIBRARY_PATH=/opt/python/lib CACHED_WORKERS=1 CACHED_HTTP=0.0.0.0:8377 "
        f"CACHED_PUBLISH_UID={MEMBER_UID}\n")
    etc = {name: (deploy / name).read_text() for name in ("cached.env", "cached.toml")}
    system = BootedSystemd(units, etc)
    yield system
    print(system.journal("cached.service")[-4000:])
    system.close()


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, v in (line.split(":", 1) for line in lines)}


def test_the_shipped_units_serve_under_systemd_with_their_hardening(booted):
    socket_path = booted.host_path(SOCK)
    st = socket_path.stat()
    assert (st.st_mode & 0o777, st.st_uid, st.st_gid) == (0o660, 990, CLIENT_GROUP)
    assert booted.show("cached.service", "ActiveState")["ActiveState"] == "inactive"

    # a member of cached-clients connects: systemd starts the daemon, which compiles (spawned
    # worker, gcc link) inside the sandbox; then the same kernels are hits
    first = json_line(booted.py(*WARM, "--limit", "2", user=MEMBER))
    assert (first["compiled"], first["failed"]) == (2, 0), first
    again = json_line(booted.py(*WARM, "--limit", "2", user=MEMBER))
    assert (again["cached"], again["failed"]) == (2, 0), again
    st = socket_path.stat()  # still the group's once the service runs
    assert (st.st_mode & 0o777, st.st_uid, st.st_gid) == (0o660, 990, CLIENT_GROUP)
    for state in ("/var/lib/cached", "/var/lib/cached/store"):  # the socket's group only
        st = booted.host_path(state).stat()
        assert (st.st_mode & 0o777, st.st_uid, st.st_gid) == (0o750, 990, CLIENT_GROUP), state
    outsider = booted.py("-m", "cached", "stats", "--socket", SOCK, user=OUTSIDER, check=False)
    assert outsider.returncode != 0 and "Permission denied" in outsider.stderr

    state = booted.show("cached.service", "ActiveState", "SubState", "StatusText", "NRestarts")
    assert (state["ActiveState"], state["SubState"], state["NRestarts"]) == (
        "active", "running", "0"), state
    assert state["StatusText"].startswith("serving: "), state  # sd_notify STATUS=

    # the sandbox, read from the kernel: every process of the unit (daemon, workers)
    pids = booted.service_pids("cached.service")
    assert len(pids) >= 2, pids
    for pid in pids:
        status = _status(pid)
        assert status["Uid"].split()[0] == "990" and status["Seccomp"] == "2", status
        assert status["NoNewPrivs"] == "1" and int(status["CapEff"], 16) == 0, status
        nice = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])
        assert nice == 10, (pid, nice)  # Nice=: below vLLM, workers included
    below = booted.show("cached.service", "CPUWeight", "IOWeight", "TasksMax", "MemoryHigh")
    assert below == {"CPUWeight": "20", "IOWeight": "20", "TasksMax": "1024",
                     "MemoryHigh": str(9 << 30)}, below
    procs = [line.split(" - ")[1].split() for line in
             Path(f"/proc/{pids[0]}/mountinfo").read_text().splitlines()
             if line.split()[4] == "/proc"]
    options = procs[-1][2].split(",")  # the /proc the daemon sees: ProtectProc, ProcSubset
    assert "hidepid=invisible" in options and "subset=pid" in options, procs[-1]

    # a write-back lease whose holder dies is handed on at once: ProtectProc=invisible hides
    # the holder's /proc entry from the daemon, its pidfd still says it is gone
    race = json_line(booted.py(booted.put("lease.py", LEASE), "race", "k1", user=MEMBER))
    assert (race["held"], race["alive"], race["after"]) == ("granted", "wait", "granted"), race
    assert race["seconds"] < 5, race

    # IPAddressAllow=localhost: HTTP answers on 127.0.0.1, not on another address
    healthz = json_line(booted.py("-c", HEALTHZ))
    assert healthz["127.0.0.1"] is True and healthz["10.0.0.1"] in ("timeout",
                                                                    "TimeoutError"), healthz

    booted.systemctl("stop", "cached.service")
    stopped = booted.show("cached.service", "ActiveState", "Result", "ExecMainStatus")
    assert stopped == {"ActiveState": "inactive", "Result": "success",
                       "ExecMainStatus": "0"}, stopped
    assert '"daemon.stopped"' in booted.journal("cached.service")


# Nothing set, as a member of the group who reads no docs: no --socket, no $CACHED_SOCKET,
# no runtime directory (a service's environment).
AS_SET_UP = ("env", "-u", "CACHED_SOCKET", "-u", "XDG_RUNTIME_DIR", "-u", "JOURNAL_STREAM",
             "LD_LIBRARY_PATH=/opt/python/lib", f"PYTHONPATH={ROOT}:{ROOT}/client",
             booted_systemd.PYTHON)
STALE = """
import os, socket
d = f"/tmp/cached-{os.getuid()}"
os.makedirs(d, mode=0o700, exist_ok=True)
s = socket.socket(socket.AF_UNIX)
s.bind(d + "/cached.sock")
s.close()
"""
PLUGIN = """
import logging, sys
from importlib.metadata import entry_points
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
plugins = {ep.name: ep for ep in entry_points(group="vllm.general_plugins")}
plugins["cached"].load()()
from cached_client.integrations.vllm.state import daemon
print("hello" if daemon().hello is not None else "none", daemon().socket)
"""


def test_with_nothing_set_the_cli_and_the_vllm_plugin_find_the_units_socket(booted):
    """The unit listens on /run/cached/cached.sock; a member runs `cached stats` with
    nothing set: the per-user socket (/tmp/cached-UID) is not there, so the system one is
    used, its directory and server checked (was: 'no daemon is running on
    /tmp/cached-UID/cached.sock'). A stale per-user socket is passed over; the vLLM plugin
    finds the same daemon (was: nothing installed without $CACHED_SOCKET)."""
    for stale in (False, True):
        if stale:
            booted.run(*AS_SET_UP, "-c", STALE, user=MEMBER)
        stats = booted.run(*AS_SET_UP, "-m", "cached", "stats", "--json", user=MEMBER,
                           check=False)
        assert stats.returncode == 0, (stale, stats.stderr)
        assert json_line(stats)["socket"] == SOCK, stats.stdout
    shown = booted.run(*AS_SET_UP, "-m", "cached", "config", user=MEMBER).stdout
    assert f"the daemon running on {SOCK}:" in shown, shown[-2000:]  # what a client finds
    plugin = booted.run(*AS_SET_UP, "-c", PLUGIN, user=MEMBER).stdout
    assert f"daemon at {SOCK} (toolchain" in plugin, plugin
    assert plugin.strip().splitlines()[-1] == f"hello {SOCK}", plugin
    # an outsider is told the right fix: the group, not `systemctl start cached.socket`
    outsider = booted.run(*AS_SET_UP, "-m", "cached", "stats", user=OUTSIDER, check=False)
    assert outsider.returncode == 2 and f"cannot connect to {SOCK}: Permission denied" \
        in outsider.stderr and "usermod -aG cached-clients" in outsider.stderr, \
        outsider.stderr
    assert "systemctl" not in outsider.stderr and "Traceback" not in outsider.stderr


def test_journalctl_priority_separates_errors_from_info(booted):
    """The daemon's lines reach the journal with their syslog priority (<N> prefixes on the
    journal's stream): `journalctl -p warning` shows a failed reload and no INFO line
    (was: every line at the stream's default, info, so -p warning showed nothing)."""
    booted.run(*AS_SET_UP, "-m", "cached", "stats", "--socket", SOCK, user=MEMBER)  # started
    booted.run("sh", "-c", "cp /etc/cached/cached.toml /run/cached.toml.orig && "
               "echo 'not = = toml' >> /etc/cached/cached.toml")
    try:
        booted.systemctl("reload", "cached.service")
        deadline = time.monotonic() + 30
        while "daemon.reload_failed" not in booted.journal("cached.service"):
            assert time.monotonic() < deadline, booted.journal("cached.service")[-3000:]
            time.sleep(0.2)
        warned = booted.run("journalctl", "--no-pager", "-o", "cat", "-u", "cached.service",
                            "-p", "warning").stdout
        assert '"daemon.reload_failed"' in warned and '"daemon.listening"' not in warned, \
            warned
        assert '"level": "info"' not in warned and not warned.startswith("<"), warned
        entries = [json.loads(line) for line in booted.run(
            "journalctl", "--no-pager", "-o", "json", "-u", "cached.service").stdout.splitlines()]
        by_event = {json.loads(e["MESSAGE"])["event"]: e["PRIORITY"] for e in entries
                    if isinstance(e.get("MESSAGE"), str) and e["MESSAGE"].startswith("{")}
        assert by_event["daemon.listening"] == "6" and by_event["daemon.reload_failed"] == "3", \
            by_event
    finally:  # as the first test left it: the shipped file, the service stopped
        booted.run("cp", "/run/cached.toml.orig", "/etc/cached/cached.toml")
        booted.systemctl("stop", "cached.service")


def test_directives_left_out_of_the_unit_would_break_it(booted):
    booted.write_dropin("cached.service", "zz-left-out.conf",
                        "[Service]\nMemoryDenyWriteExecute=yes\nPrivateUsers=yes\n")
    # MemoryDenyWriteExecute: the DSL JITs code while compiling; every new kernel fails
    counts = json_line(booted.py(*WARM, "--limit", "3", check=False))
    assert counts["failed"] >= 1 and counts["compiled"] == 0, counts
    assert "JIT session error: Operation not permitted" in booted.journal("cached.service")
    # PrivateUsers: peers of other users look like uid 65534, so publish_uid cannot work
    refused = json_line(booted.py(booted.put("lease.py", LEASE), "once", "k2", user=MEMBER))
    assert refused["state"] == "compile_locally" and "uid 65534" in refused["reason"], refused


def test_dockerfile_lints():
    result = subprocess.run([_tool("hadolint"), "--failure-threshold", "info",
                             str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    text = (ROOT / "Dockerfile").read_text()
    for word in ("HEALTHCHECK", "/healthz", "VOLUME", "USER 990", "docker run"):
        assert word in text, word
    # the healthcheck asks the configured address (test_healthcheck_asks_the_configured_...)
    healthcheck = _instructions(text)["HEALTHCHECK"][0]
    assert healthcheck.endswith('CMD ["python", "-m", "cached.node.healthcheck"]'), healthcheck


# -- the image's install steps, run here (no container engine on the test machine) ------

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# the wheels PyPI's (CUDA) torch depends on: none of them may come with the image
CUDA_TORCH_DEPS = re.compile(r"^(triton|nvidia-(cublas|cuda-(runtime|nvrtc|cupti)|cudnn-cu|cufft"
                             r"|cufile|curand|cusolver|cusparse|nccl|nvjitlink|nvshmem|nvtx))")


def _instructions(text: str) -> dict[str, list[str]]:
    """The Dockerfile's instructions by keyword, continuation lines joined."""
    out: dict[str, list[str]] = {}
    for line in re.sub(r"\\\n\s*", " ", text).splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            keyword, _, rest = line.strip().partition(" ")
            out.setdefault(keyword, []).append(rest.strip())
    return out


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_image_installs_torchs_cpu_build_and_the_pins_without_cuda_wheels(tmp_path):
    """The Dockerfile's dependency step is deploy/install-deps.sh; run here the way the
    Dockerfile runs it, in a fresh virtualenv, with --dry-run --report: what pip resolves
    (names, versions, torch's own requirements) without installing gigabytes."""
    dockerfile = _instructions((ROOT / "Dockerfile").read_text())
    script = (ROOT / "deploy" / "install-deps.sh").read_text()
    assert f"TORCH_INDEX={CPU_INDEX}" in dockerfile["ARG"]
    assert re.search(r"--index-url \"\$\{TORCH_INDEX:-(\S+)\}\"", script).group(1) == CPU_INDEX
    pip_runs = [r for r in dockerfile["RUN"] if "pip" in r]
    assert pip_runs[0] == "sh deploy/install-deps.sh pip", pip_runs
    assert all("--no-deps" in r for r in pip_runs[1:]), pip_runs  # only the project itself
    pins = dict(line.split("==") for line in (ROOT / "requirements.txt").read_text().split()
                if "==" in line)
    assert pins["torch"].endswith("+cpu"), pins

    index = CPU_INDEX
    try:
        socket.getaddrinfo("download.pytorch.org", 443)
    except OSError:  # offline: a local index of the CPU wheel pip's configuration finds on disk
        local = tmp_path / "simple" / "torch"
        got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                              "--no-index", "-d", str(local), f"torch=={pins['torch']}"],
                             capture_output=True, text=True)
        if got.returncode:
            pytest.skip(f"no route to {CPU_INDEX} and no torch {pins['torch']} wheel on disk")
        (local / "index.html").write_text("".join(
            f'<a href="{w.name.replace("+", "%2B")}">{w.name}</a>\n' for w in local.iterdir()))
        index = (tmp_path / "simple").as_uri()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    result = subprocess.run(
        ["sh", str(ROOT / "deploy" / "install-deps.sh"), str(venv / "bin" / "pip"),
         "--dry-run", "--quiet", "--report", "-"], capture_output=True, text=True,
        env={**os.environ, "TORCH_INDEX": index}, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    decoder, text, reports = json.JSONDecoder(), result.stdout.strip(), []
    while text:
        report, end = decoder.raw_decode(text)
        reports.append({_canonical(i["metadata"]["name"]): i["metadata"]
                        for i in report["install"]})
        text = text[end:].strip()
    torch_step, rest_step = reports  # one report per pip command of the script
    assert torch_step["torch"]["version"] == pins["torch"]
    assert not [r for r in torch_step["torch"].get("requires_dist", [])
                if CUDA_TORCH_DEPS.match(r)], torch_step["torch"]["requires_dist"]
    for name, version in pins.items():
        assert rest_step[_canonical(name)]["version"] == version, name
    for step in reports:
        assert not [n for n in step if CUDA_TORCH_DEPS.match(n)], sorted(step)


def test_a_gpu_nodes_install_gets_torchs_cuda_build_and_the_same_pins(tmp_path):
    """TORCH_BUILD=cuda (docs/operations.md, "Certify and tune on a GPU node"), run as the
    docs say into a fresh virtualenv with --dry-run --report: torch at exactly the pinned
    version without the +cpu label (this machine holds the +cpu wheel in pip's find-links:
    it is not taken), with its CUDA wheels, and every other pin as the CPU install has it.
    A value that is neither cpu nor cuda is refused before pip runs."""
    refused = subprocess.run(["sh", str(ROOT / "deploy" / "install-deps.sh"), "false"],
                             capture_output=True, text=True, env={**os.environ,
                                                                  "TORCH_BUILD": "gpu"})
    assert refused.returncode == 2 and "must be cpu or cuda" in refused.stderr
    try:
        socket.getaddrinfo("pypi.org", 443)
    except OSError:
        pytest.skip("no route to the package index: torch's CUDA build cannot be resolved")
    pins = dict(line.split("==") for line in (ROOT / "requirements.txt").read_text().split()
                if "==" in line)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    result = subprocess.run(
        ["sh", str(ROOT / "deploy" / "install-deps.sh"), str(venv / "bin" / "pip"),
         "--dry-run", "--quiet", "--report", "-"], capture_output=True, text=True,
        env={**os.environ, "TORCH_BUILD": "cuda"}, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = {_canonical(i["metadata"]["name"]): i["metadata"]
              for i in json.loads(result.stdout)["install"]}
    assert report["torch"]["version"] == pins["torch"].removesuffix("+cpu"), report["torch"]
    assert [n for n in report if CUDA_TORCH_DEPS.match(n)], sorted(report)
    for name, version in pins.items():
        if name != "torch":
            assert report[_canonical(name)]["version"] == version, name


def test_image_apt_packages_resolve_on_debian_12():
    dockerfile = _instructions((ROOT / "Dockerfile").read_text())
    assert "bookworm" in dockerfile["FROM"][0]  # Debian 12
    release = Path("/etc/debian_version")
    if not release.exists() or not release.read_text().startswith("12") or not shutil.which(
            "apt-get"):
        pytest.skip("not a Debian 12 machine: apt cannot resolve the image's packages here")
    apt = next(r for r in dockerfile["RUN"] if "apt-get install" in r)
    packages = re.search(r"--no-install-recommends ([^&]+)", apt).group(1).split()
    assert "gcc=4:12.2.0-3" in packages and "libc6-dev" in packages, packages
    result = subprocess.run(["apt-get", "install", "-s", "--no-install-recommends", *packages],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_healthcheck_asks_the_configured_address(tmp_path):
    from conftest import DaemonProcess

    d = DaemonProcess(tmp_path, workers=1)
    try:
        port = d.stats()["http"].rpartition(":")[2]
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        env = {k: v for k, v in os.environ.items() if not k.startswith("CACHED_")}
        empty = tmp_path / "cached.toml"  # no file settings: the environment decides
        empty.write_text("")

        def health(**values: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "cached.node.healthcheck"],
                                  capture_output=True, text=True, timeout=60,
                                  env={**env, "CACHED_CONFIG": str(empty),
                                       **{f"CACHED_{k.upper()}": v for k, v in values.items()}})

        for http in (f"127.0.0.1:{port}", f"0.0.0.0:{port}"):  # a wildcard: asked on loopback
            ok = health(http=http)
            assert ok.returncode == 0 and f"127.0.0.1:{port}/healthz: ok" in ok.stderr, ok.stderr
        down = health(http=f"127.0.0.1:{closed.getsockname()[1]}")
        assert down.returncode == 1 and "refused" in down.stderr, down.stderr
        closed.close()
        assert health(http="off", socket=d.socket).returncode == 0  # then: the socket's stats
        gone = health(http="off", socket=str(tmp_path / "nothing.sock"))
        assert gone.returncode == 1 and "nothing.sock" in gone.stderr, gone.stderr
        bad = health(http="8377")
        assert bad.returncode == 1 and "HOST:PORT" in bad.stderr, bad.stderr
    finally:
        d.stop()


def _hello_as(path: str, uid: int, groups: list[int]) -> str:
    """Connect as another user (forked, privileges dropped); 'ok' or the errno name."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        result = "crashed"
        try:
            os.close(read)
            os.setgroups(groups)
            os.setgid(uid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(60)
                try:
                    s.connect(path)
                except OSError as exc:
                    result = f"errno:{exc.errno}"
                else:
                    s.sendall(encode_frame({"op": "hello", "id": 1}))
                    (length,) = HEADER.unpack(s.recv(4, socket.MSG_WAITALL))
                    reply = decode_body(s.recv(length, socket.MSG_WAITALL))
                    result = "ok" if reply.get("ok") else str(reply)
        finally:
            os.write(write, result.encode())
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as f:
        return f.read()


def test_socket_activation_serves_the_group_only_and_notifies_systemd():
    if os.getuid() != 0:
        pytest.skip("needs root to act as other users")
    workdir = Path(tempfile.mkdtemp(prefix="cached-sa-", dir="/tmp"))
    workdir.chmod(0o755)  # other users must reach the socket; 0660 is the gate
    path = str(workdir / "cached.sock")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(workdir / "notify.sock"))
    notify.settimeout(60)
    log = open(workdir / "daemon.log", "w")
    proc = subprocess.Popen(
        [_tool("systemd-socket-activate"), "-l", path, "-E", f"HOME={os.environ['HOME']}",
         "-E", "CACHED_TEST_FAMILIES=1", "-E", f"NOTIFY_SOCKET={workdir / 'notify.sock'}",
         "-E", "WATCHDOG_USEC=2000000",
         sys.executable, "-m", "cached", "serve", "--store", str(workdir / "store"),
         "--no-http", "--workers", "1", "--socket", str(workdir / "unused.sock")],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(path):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        # What SocketGroup=/SocketMode=0660 do in cached.socket.
        os.chown(path, 0, CLIENT_GROUP)
        os.chmod(path, 0o660)
        assert _hello_as(path, MEMBER_UID, [CLIENT_GROUP]) == "ok"  # starts the daemon
        assert _hello_as(path, OUTSIDER_UID, []) == "errno:13"  # EACCES
        messages = []
        while not any("READY=1" in m for m in messages):
            messages.append(notify.recv(4096).decode())
        assert any("STATUS=serving" in m for m in messages)
        while not any("WATCHDOG=1" in m for m in messages):  # pinged from the event loop
            messages.append(notify.recv(4096).decode())
        stats = Client(path, timeout=30).stats()
        assert stats["socket"] == path
        assert not os.path.exists(workdir / "unused.sock")
        proc.send_signal(signal.SIGTERM)  # exec'd: the daemon has this pid
        assert proc.wait(60) == 0
        while not any("STOPPING=1" in m for m in messages):
            messages.append(notify.recv(4096).decode())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        notify.close()
        print((workdir / "daemon.log").read_text()[-3000:])
        shutil.rmtree(workdir, ignore_errors=True)
