"""A node set up as the docs say, used as an operator and a vLLM user would: the default
socket found with no flags (and the hints when none answers), ``select`` asking that daemon,
certify and tune on a node without a GPU, ``--http-allow-host`` under a real Prometheus
scraping by an alias, and journald's priority prefixes. (The system socket under a real
systemd, and ``journalctl -p``: tests/test_ops_deploy.py.)"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import site
import socket
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT, DaemonProcess

PYTHONPATH = f"{ROOT}:{ROOT / 'client'}"


def env_without_socket(xdg: Path, **extra: str) -> dict:
    """The environment of a user who set nothing: no $CACHED_SOCKET, a runtime dir of ``xdg``."""
    env = {k: v for k, v in os.environ.items() if k not in ("CACHED_SOCKET", "JOURNAL_STREAM")}
    env.update(XDG_RUNTIME_DIR=str(xdg), PYTHONPATH=PYTHONPATH, **extra)
    return env


def run(args: list[str], env: dict, check: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          check=check, timeout=300)


@pytest.fixture(scope="module")
def user_daemon(tmp_path_factory):
    """``cached serve`` on the per-user default socket of a runtime dir ($XDG_RUNTIME_DIR)."""
    xdg = tmp_path_factory.mktemp("xdg")
    (xdg / "cached").mkdir(mode=0o700)
    d = DaemonProcess(xdg / "cached", workers=1, ready_workers=0,
                      extra_env={"XDG_RUNTIME_DIR": str(xdg)})
    assert d.socket == str(xdg / "cached" / "cached.sock")
    yield xdg, d
    d.stop()


# -- the socket found with no flags --------------------------------------------------------


def test_the_cli_and_the_client_find_the_per_user_socket_with_nothing_set(user_daemon):
    xdg, d = user_daemon
    out = run(["-m", "cached", "stats", "--json"], env_without_socket(xdg), check=True)
    assert json.loads(out.stdout)["socket"] == d.socket
    code = "from cached_client import Client; c = Client(); c.stats(); print(c.socket_path)"
    assert run(["-c", code], env_without_socket(xdg), check=True).stdout.strip() == d.socket


def test_with_no_daemon_the_hint_names_every_socket_tried_and_the_fix_that_fits(tmp_path):
    """Nothing set, nothing running: both default sockets are named; `cached serve` is the
    fix, and `systemctl start cached.socket` is not offered where no unit is installed. A
    --socket or $CACHED_SOCKET that nothing listens on names that path and the flag to
    start a daemon there, and how to get back to the defaults."""
    unit = any(Path(d, "cached.socket").exists() for d in (
        "/etc/systemd/system", "/usr/lib/systemd/system", "/lib/systemd/system"))
    result = run(["-m", "cached", "stats"], env_without_socket(tmp_path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    for path in (tmp_path / "cached" / "cached.sock", Path("/run/cached/cached.sock")):
        assert f"no daemon is running on {path} (No such file or directory)" in result.stderr
    assert "cached serve " in result.stderr and "make serve" in result.stderr
    assert ("systemctl" in result.stderr) == unit, result.stderr

    named = tmp_path / "elsewhere.sock"
    for how, env in (("--socket", env_without_socket(tmp_path)),
                     ("$CACHED_SOCKET", {**env_without_socket(tmp_path),
                                         "CACHED_SOCKET": str(named)})):
        args = ["-m", "cached", "ls"] + (["--socket", str(named)] if how == "--socket" else [])
        result = run(args, env)
        assert result.returncode == 2, result.stderr
        assert f"no daemon is running on {named}" in result.stderr, result.stderr
        assert f"cached serve --socket {named}" in result.stderr
        assert "/run/cached/cached.sock" in result.stderr.splitlines()[-1]  # the defaults
        assert "systemctl" not in result.stderr

    stale = socket.socket(socket.AF_UNIX)  # a socket file its daemon left behind
    (tmp_path / "cached").mkdir(mode=0o700)
    stale.bind(str(tmp_path / "cached" / "cached.sock"))
    stale.close()
    result = run(["-m", "cached", "stats"], env_without_socket(tmp_path))
    assert (f"no daemon is running on {tmp_path / 'cached' / 'cached.sock'} (Connection "
            "refused)") in result.stderr and "its daemon stopped" in result.stderr


# -- select: what vLLM would get -----------------------------------------------------------

SELECT = ["-m", "cached_client", "select", "--op", "bmm", "--quant", "fp8", "--arch", "sm_90a",
          "--batch-invariant", "--json"]


def test_select_asks_the_daemon_vllm_would_ask(user_daemon, tmp_path):
    """On sm_90a with a daemon serving cached.hopper_fp8, select answers that family both on
    the default socket and on $CACHED_SOCKET (was: vLLM's cutlass pin, as without a daemon);
    --no-daemon and a node without one answer cutlass, saying why."""
    xdg, d = user_daemon
    for env in (env_without_socket(xdg),
                {**env_without_socket(tmp_path), "CACHED_SOCKET": d.socket}):
        chosen = json.loads(run(SELECT, env, check=True).stdout)
        assert chosen["kernel"] == "cached.hopper_fp8", chosen
    for args, env in ((SELECT + ["--no-daemon"], env_without_socket(xdg)),
                      (SELECT, env_without_socket(tmp_path))):
        chosen = json.loads(run(args, env, check=True).stdout)
        assert chosen["kernel"] == "cutlass" and any("no daemon" in w
                                                    for w in chosen["warnings"]), chosen


def test_every_option_of_select_has_help():
    from cached_client.__main__ import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, command in sub.choices.items():
        for action in command._actions:
            assert action.help, (name, action.option_strings)


# -- certify and tune where there is no GPU ------------------------------------------------


@pytest.mark.parametrize("args", [
    ["certify", "--family", "cached.hopper_fp8", "--weight", "4096,4096"],
    ["tune", "--weight", "3584,18944"],
])
def test_certify_and_tune_on_a_cpu_node_say_so_in_one_line(tmp_path, args):
    """The documented install on a node without a GPU (this one: torch's CPU build, as
    deploy/install-deps.sh installs by default): one line naming what is missing and how to
    get it, exit status 2, no traceback, no daemon needed to say so (was: certify ended in
    'AssertionError: Torch not compiled with CUDA enabled', tune said 'no CUDA device
    here' whatever the build)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    result = run(["-m", "cached", *args, "--socket", str(tmp_path / "none.sock")],
                 env_without_socket(tmp_path))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.splitlines()) == 1, \
        result.stderr
    line = result.stderr.strip()
    assert line.startswith(f"cached {args[0]}: ") and "GPU" in line, line
    if torch.version.cuda is None:
        assert "CPU build" in line and "TORCH_BUILD=cuda" in line, line
    else:
        assert "no CUDA device" in line, line


# -- HTTP: names a Prometheus scrapes by ---------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status(address: str, host: str, path: str = "/metrics") -> tuple[int, str]:
    hostname, _, port = address.rpartition(":")
    with socket.create_connection((hostname, int(port)), timeout=10) as conn:
        conn.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
                     .encode())
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode(errors="replace")


def test_the_image_build_takes_torch_build_for_its_install_step():
    """`docker build --build-arg TORCH_BUILD=cuda` (operations.md): the Dockerfile declares
    the argument, default cpu, before the step that runs deploy/install-deps.sh, so that
    step's environment has it (what the script does with it: test_ops_deploy.py)."""
    lines = [line.strip() for line in (ROOT / "Dockerfile").read_text().splitlines()]
    install = lines.index("RUN sh deploy/install-deps.sh pip")
    assert "ARG TORCH_BUILD=cpu" in lines[:install]
    assert "TORCH_BUILD" in (ROOT / "deploy" / "install-deps.sh").read_text()


def test_http_allow_host_admits_the_names_given_and_still_refuses_others(tmp_path):
    """--http-allow-host (repeatable) adds names the endpoint answers to; any other name
    still gets 421, whose body names the setting; ``cached config`` shows the file's list
    (the Prometheus test below serves by it); a value that is not a host name is refused
    at start, naming it."""
    d = DaemonProcess(tmp_path, workers=1, ready_workers=0, extra_args=[
        "--http-allow-host", "metrics-alias.test", "--http-allow-host", "10.9.8.7"])
    try:
        address = d.stats()["http"]
        port = address.rpartition(":")[2]
        for host in (f"metrics-alias.test:{port}", "METRICS-ALIAS.TEST.", f"10.9.8.7:{port}",
                     f"127.0.0.1:{port}"):
            assert _status(address, host)[0] == 200, host
        status, body = _status(address, f"other.example:{port}")
        assert status == 421 and "--http-allow-host NAME" in body, body
    finally:
        d.stop()
    config = tmp_path / "cached.toml"
    config.write_text('http_allow_host = ["node7.cluster.example", "Alias.Example."]\n')
    shown = json.loads(subprocess.run(
        [sys.executable, "-m", "cached", "config", "--config", str(config), "--json",
         "--socket", str(tmp_path / "none.sock")], capture_output=True, text=True,
        check=True, env={**os.environ, "PYTHONPATH": PYTHONPATH}).stdout)
    row = next(r for r in shown["options"] if r["name"] == "http_allow_host")
    assert row["value"] == ["node7.cluster.example", "alias.example"], row
    bad = subprocess.run([sys.executable, "-m", "cached", "serve", "--socket",
                          str(tmp_path / "x.sock"), "--store", str(tmp_path / "s2"),
                          "--http-allow-host", "bad name/x"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "'bad name/x'" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr


PROMETHEUS_CONFIG = """
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: cached
    static_configs:
      - targets: ["{target}"]
"""


def test_a_real_prometheus_scraping_by_an_alias_is_answered(tmp_path):
    """Prometheus (the real server) scrapes the daemon by a DNS alias (from its own
    /etc/hosts, in a private mount namespace): with ``http_allow_host = [ALIAS]`` in the
    config file the target is up; without it the scrape is answered 421, the target down."""
    prometheus = shutil.which("prometheus")
    if prometheus is None or os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs prometheus, root and unshare (a private /etc/hosts)")
    alias = "metrics-alias.test"
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost {alias}\n")
    results = {}
    for allowed in (False, True):
        work = tmp_path / f"allowed-{allowed}"
        work.mkdir()
        config = work / "cached.toml"
        config.write_text(f'http_allow_host = ["{alias}"]\n' if allowed else "")
        d = DaemonProcess(work, workers=1, ready_workers=0, extra_args=["--config", str(config)])
        web = _free_port()
        try:
            port = d.stats()["http"].rpartition(":")[2]
            (work / "prometheus.yml").write_text(PROMETHEUS_CONFIG.format(
                target=f"{alias}:{port}"))
            log = open(work / "prometheus.log", "w")
            prom = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                 f'mount --bind "$1" /etc/hosts && exec "$2" --config.file="$3" '
                 f'--storage.tsdb.path="$4" --web.listen-address=127.0.0.1:{web}',
                 "sh", str(hosts), prometheus, str(work / "prometheus.yml"),
                 str(work / "data")], stdout=log, stderr=subprocess.STDOUT)
            try:
                results[allowed] = _first_scrape(web, prom, work / "prometheus.log")
            finally:
                prom.send_signal(signal.SIGTERM)
                prom.wait(30)
                log.close()
        finally:
            d.stop()
    assert results[True]["health"] == "up", results[True]
    assert results[False]["health"] == "down" and "421" in results[False]["lastError"], \
        results[False]


def _first_scrape(web: int, prom: subprocess.Popen, log: Path) -> dict:
    """The cached target's state after its first scrape, from Prometheus's API."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert prom.poll() is None, log.read_text()[-2000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{web}/api/v1/targets",
                                        timeout=5) as reply:
                targets = json.load(reply)["data"]["activeTargets"]
        except OSError:
            targets = []
        for target in targets:
            if target["health"] != "unknown":
                return target
        time.sleep(0.3)
    raise AssertionError(f"no scrape in 60 s: {log.read_text()[-2000:]}")


# -- journald: priorities ------------------------------------------------------------------

PREFIXED = re.compile(r"^<([0-7])>(.*)$")
SYSLOG = {"debug": 7, "info": 6, "warning": 4, "error": 3, "critical": 2}


def test_logs_to_the_journal_carry_syslog_priorities(tmp_path):
    """stderr as the journal's stream ($JOURNAL_STREAM naming its device and inode, as
    systemd sets it): every line starts with <N>, N the event's syslog priority (an INFO
    start, an ERROR failed reload), which journald turns into PRIORITY; the same daemon on
    any other stream writes plain JSON lines."""
    config = tmp_path / "cached.toml"
    config.write_text("log_level = \"info\"\n")
    for journal in (True, False):
        log_path = tmp_path / f"stderr-{journal}.log"
        with open(log_path, "w") as log:
            st = os.fstat(log.fileno())
            env = {**os.environ, "PYTHONPATH": PYTHONPATH, "CACHED_TEST_FAMILIES": "1"}
            env["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}" if journal else "1:2"
            sock = tmp_path / f"j-{journal}.sock"
            proc = subprocess.Popen(
                [sys.executable, "-m", "cached", "serve", "--socket", str(sock), "--store",
                 str(tmp_path / f"store-{journal}"), "--config", str(config), "--workers", "1",
                 "--no-http"], env=env, stdout=log, stderr=log)
            try:
                _wait('"daemon.listening"', proc, log_path)
                config.write_text("this is not = = toml\n")
                proc.send_signal(signal.SIGHUP)
                _wait('"daemon.reload_failed"', proc, log_path)
                config.write_text("log_level = \"info\"\n")
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
        lines = [line for line in log_path.read_text().splitlines() if line.strip()]
        events = {}
        for line in lines:
            match = PREFIXED.match(line)
            assert bool(match) == journal, line
            doc = json.loads(match.group(2) if match else line)
            if match:
                assert int(match.group(1)) == SYSLOG[doc["level"]], line
            events[doc["event"]] = int(match.group(1)) if match else None
        if journal:
            assert events["daemon.listening"] == 6 and events["daemon.reload_failed"] == 3, \
                events


def _wait(needle: str, proc: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while needle not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)


# -- packages: names of ours, installable from a checkout and from wheels ------------------


def _venv_seeing(path: Path, site_of: Path) -> Path:
    """A fresh virtualenv whose interpreter also sees ``site_of``'s site-packages (the
    dependencies, pip and setuptools included, already installed there): only the
    project's packages are installed into it; ``bin/pip`` is that pip."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True,
                   timeout=120)
    sp = next((path / "lib").glob("python3.*/site-packages"))
    theirs = next((site_of / "lib").glob("python3.*/site-packages")).resolve()
    (sp / "zz-deps.pth").write_text(f"import site; site.addsitedir({str(theirs)!r})\n")
    (path / "bin" / "pip").write_text(f"#!{path / 'bin' / 'python'}\nimport sys\n"
                                      "from pip._internal.cli.main import main\n"
                                      "sys.exit(main())\n")
    (path / "bin" / "pip").chmod(0o755)
    return path


def _checkout(tmp: Path) -> Path:
    """A copy of the checkout's packages (pip builds in the source tree: build/ and
    *.egg-info land in the copy, never in the checkout)."""
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for part in ("client", "cached"):
        shutil.copytree(ROOT / part, src / part, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", src / "pyproject.toml")
    return src


def _clean_env(venv: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CACHED_SOCKET")}
    env["PATH"] = f"{venv / 'bin'}:{env['PATH']}"
    return env


METADATA = """
import json, sys
from importlib import metadata
out = {}
for name in ("cached-kernel-daemon", "cached-kernel-client"):
    d = metadata.distribution(name)
    out[name] = {"requires": d.requires or [], "files": [str(f) for f in d.files or []],
                 "location": str(d.locate_file(""))}
print(json.dumps(out))
"""


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _wheel_requires(wheel: Path) -> list[str]:
    """The Requires-Dist lines of a built wheel's METADATA."""
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA")))
    return [line.split(":", 1)[1].strip() for line in meta.decode().splitlines()
            if line.startswith("Requires-Dist:")]


def _with_parts(names: set[str]) -> set[str]:
    """``names`` and the parts of a release split into several distributions, which each
    requires at exactly one version (nvidia-cutlass-dsl's libs, which hold ``cutlass``)."""
    parts = set()
    for name in names:
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        parts |= {_canonical(re.match(r"[A-Za-z0-9._-]+", r).group()) for r in requires
                  if "==" in r.partition(";")[0] and "extra ==" not in r}
    return names | parts


def _daemon_imports() -> dict[str, set[str]]:
    """Each third-party top-level module the daemon's code imports (at its top or in a
    function), with the distributions of this environment that provide it."""
    names: set[str] = set()
    for path in (ROOT / "cached").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.partition(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names.add(node.module.partition(".")[0])
    dists = importlib.metadata.packages_distributions()

    def providers(module: str) -> set[str]:
        # a package put on the path by another's .pth (cutlass: nvidia_cutlass_dsl's) is
        # that one's: the top directory under site-packages that holds it
        origin = Path(importlib.util.find_spec(module).origin).resolve()
        top = next((origin.relative_to(s).parts[0] for s in
                    (Path(p).resolve() for p in site.getsitepackages())
                    if origin.is_relative_to(s)), module)
        return {_canonical(d) for d in dists.get(module) or dists.get(top, [module])}

    return {n: providers(n) for n in sorted(names)
            if n not in sys.stdlib_module_names and n not in ("cached", "cached_client")}


def test_the_packages_install_from_a_checkout_and_from_wheels(tmp_path):
    """`pip install ./client .` in a fresh environment (offline: every dependency is already
    there, so the metadata alone must resolve), then wheels of both installed by name from a
    wheelhouse: the names are ours (not `cached`, another project's on the index, nor
    `cached-client`, which the index lacks), the daemon requires the client by its name,
    the built wheels' METADATA states ranges, not pins (no `==`), and names a distribution
    of every third-party module the daemon imports, and the installed `cached` command
    runs."""
    src = _checkout(tmp_path)
    venv = _venv_seeing(tmp_path / "checkout", ROOT / ".venv")
    offline = ["--no-index", "--no-build-isolation", "-q"]
    pip = [str(venv / "bin" / "pip")]
    done = subprocess.run([*pip, "install", *offline, "./client", "."], cwd=src,
                          env=_clean_env(venv), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    wheels = tmp_path / "wheels"
    built = subprocess.run([*pip, "wheel", *offline, "--no-deps", "-w", str(wheels),
                            "./client", "."], cwd=src, env=_clean_env(venv),
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    assert sorted(w.name.split("-")[0] for w in wheels.glob("*.whl")) == [
        "cached_kernel_client", "cached_kernel_daemon"]
    requires = {w.name.split("-")[0]: _wheel_requires(w) for w in wheels.glob("*.whl")}
    for name, reqs in requires.items():  # ranges; the exact pins are requirements*.txt's
        assert not [r for r in reqs if re.search(r"==|~=", r.partition(";")[0])], (name, reqs)
    declared = _with_parts({_canonical(re.match(r"[A-Za-z0-9._-]+", r).group())
                            for r in requires["cached_kernel_daemon"] if "extra ==" not in r})
    undeclared = {m: d for m, d in _daemon_imports().items() if not declared & d}
    assert not undeclared, f"imported by the daemon, not in its metadata: {undeclared}"
    from_wheels = _venv_seeing(tmp_path / "wheel", ROOT / ".venv")
    # both by name from the wheelhouse, into this venv even where the environment it sees
    # has them (an editable install of the checkout); pip check: the daemon's requirement on
    # the client by its name is met there
    done = subprocess.run([str(from_wheels / "bin" / "pip"), "install", "--no-index", "-q",
                           "--find-links", str(wheels), "--ignore-installed", "--no-deps",
                           "cached-kernel-daemon", "cached-kernel-client"],
                          env=_clean_env(from_wheels), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    checked = subprocess.run([str(from_wheels / "bin" / "pip"), "check"],
                             env=_clean_env(from_wheels), capture_output=True, text=True,
                             timeout=120)
    assert "cached-kernel" not in checked.stdout, checked.stdout
    for env in (venv, from_wheels):
        meta = json.loads(subprocess.run([str(env / "bin" / "python"), "-c", METADATA],
                                         capture_output=True, text=True, check=True,
                                         cwd=tmp_path, env=_clean_env(env)).stdout)
        daemon = meta["cached-kernel-daemon"]
        assert any(r.startswith("cached-kernel-client") for r in daemon["requires"]), daemon
        assert not [r for r in daemon["requires"] if "==" in r], daemon["requires"]
        assert Path(daemon["location"]).resolve().is_relative_to(env.resolve())
        assert any(f.endswith("hopper_fp8/data/winners.json") or "hopper_fp8/data/" in f
                   for f in daemon["files"]), "the family's data files are installed"
        version = subprocess.run([str(env / "bin" / "cached"), "--version"], cwd=tmp_path,
                                 env=_clean_env(env), capture_output=True, text=True,
                                 timeout=120)
        assert version.returncode == 0 and version.stdout.startswith("cached 0.1.0"), \
            version.stdout + version.stderr[-2000:]


def _sh_block(markdown: str, marker: str) -> list[str]:
    """The commands of the ``sh`` block after ``marker`` (comments stripped)."""
    after = markdown.split(marker, 1)[1]
    block = after.split("```sh\n", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]


def test_readmes_commands_run_as_written_from_the_checkout(user_daemon, tmp_path):
    """README's "Using it" block, each line as written, from the checkout that `make serve`
    set up (its .venv), with nothing set but the runtime dir a daemon listens in: every
    command names an executable of .venv and is one command (was: `gc | verify | config |
    export` was a pipeline, `python -m cached_client` a Python without the client); each
    runs (a warm plans only, `--plan-only`, with the arguments given; certify and tune
    say in one line that this is no GPU node, exit 2)."""
    xdg, d = user_daemon
    lines = _sh_block((ROOT / "README.md").read_text(), "<!-- using:")
    assert len(lines) >= 10, lines
    env = env_without_socket(xdg)
    for line in lines:
        assert not set("|;&<>`$") & set(line), line
        program, *args = shlex.split(line.replace("DIR", str(tmp_path / "flashinfer")))
        assert (ROOT / program).is_file() and program.startswith(".venv/bin/"), line
        module = ["-m", "cached"] if program == ".venv/bin/cached" else []
        if args[0] == "warm":
            args.append("--plan-only")
        done = subprocess.run([sys.executable, *module, *args], capture_output=True,
                              text=True, env=env, cwd=ROOT, timeout=300)
        if args[0] in ("certify", "tune"):
            assert done.returncode == 2 and "GPU" in done.stderr, (line, done.stderr)
            assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        else:
            assert done.returncode == 0, (line, done.stdout[-1000:], done.stderr[-2000:])


def _doc_commands(name: str) -> list[str]:
    """Every command line of the ``sh`` blocks of a document (a ``$ `` prompt dropped, a
    continued line joined, comments and output lines left out)."""
    text = (ROOT / name).read_text()
    lines = []
    for block in re.findall(r"^```sh\n(.*?)^```", text, re.M | re.S):
        block = block.replace("\\\n", " ")
        prompted = any(line.startswith("$ ") for line in block.splitlines())
        for line in block.splitlines():
            if prompted and not line.startswith("$ "):
                continue  # a transcript's output
            line = line.removeprefix("$ ").split("  #", 1)[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def test_every_cached_command_the_docs_show_parses_as_written():
    """Each `cached ...` and `python -m cached_client ...` line of README, operations.md and
    integration.md is accepted by the real argument parsers (no flag renamed under the
    docs); a script of the checkout runs with a named environment's Python, not a bare
    `python` (which has no `cached`), and the systemd install puts `cached` on PATH."""
    from cached_client.__main__ import build_parser as client_parser

    from cached.cli import build_parser

    seen = 0
    for doc in ("README.md", "docs/operations.md", "docs/integration.md"):
        for line in _doc_commands(doc):
            words = shlex.split(re.split(r"\s[>|]\s", line)[0])  # the command, not its output
            program = words[0]
            if program == "cached" or program.endswith("/bin/cached"):
                parser, args = build_parser(), words[1:]
            elif words[1:3] == ["-m", "cached_client"]:
                parser, args = client_parser(), words[3:]
            else:
                assert not (program == "python" and words[1].endswith(".py")), (doc, line)
                continue
            try:
                parser.parse_args(args)
            except SystemExit:
                pytest.fail(f"{doc}: `{line}` does not parse")
            seen += 1
    assert seen >= 25, seen
    install = _doc_commands("docs/operations.md")
    assert "ln -sf /opt/cached/venv/bin/cached /usr/local/bin/cached" in install


def test_integration_md_set_up_runs_as_written(tmp_path):
    """docs/integration.md's set-up: its pip line, as written, in a fresh environment of
    vLLM 0.33.0's (the vLLM environment's packages, nothing of the project's): the plugin's
    entry point is then installed, from this checkout (was: `pip install cached-client`,
    which finds nothing on the index)."""
    vllm_env = ROOT / ".venv-vllm"
    if not (vllm_env / "bin" / "python").exists():
        pytest.skip("the vLLM environment: make setup-vllm")
    commands = _sh_block((ROOT / "docs" / "integration.md").read_text(), "<!-- set-up:")
    pip_lines = [c for c in commands if c.startswith("pip ")]
    assert pip_lines == ["pip install ./client"], commands
    venv = _venv_seeing(tmp_path / "vllm-user", vllm_env)
    env = _clean_env(venv)
    src = _checkout(tmp_path)
    for line in pip_lines:
        done = subprocess.run(["sh", "-c", line], cwd=src, env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, (line, done.stderr[-3000:])
    code = ("import json; from importlib.metadata import entry_points, distribution; "
            "ep = {e.name: e.value for e in entry_points(group='vllm.general_plugins')}; "
            "d = distribution('cached-kernel-client'); "
            "print(json.dumps([ep.get('cached'), str(d.locate_file(''))]))")
    plugin, where = json.loads(subprocess.run([str(venv / "bin" / "python"), "-c", code],
                                              env=env, cwd=tmp_path, capture_output=True,
                                              text=True, check=True).stdout)
    assert plugin == "cached_client.integrations.vllm.plugin:register"
    assert Path(where).resolve().is_relative_to(venv.resolve()), where


# -- gc and verify without a daemon --------------------------------------------------------


def test_gc_and_verify_without_a_daemon_point_at_store_and_say_readable_lines(tmp_path):
    """With no daemon answering, gc and verify name --store with the store a daemon here
    would use; offline verify of a store with a tampered entry prints its report and
    readable lines (command, event, fields), not bare event names on stderr."""
    env = env_without_socket(tmp_path, XDG_CACHE_HOME=str(tmp_path / "cache"))
    for command in ("gc", "verify"):
        result = run(["-m", "cached", command], env)
        assert result.returncode == 2, result.stderr
        assert (f"on the store itself: cached {command} --store {tmp_path / 'cache' / 'cached'}"
                in result.stderr), result.stderr
    sys.path.insert(0, str(ROOT / "tests"))
    from test_store import publish

    from cached.store.store import Store

    store = Store(tmp_path / "store")
    publish(store, "good", b"g")
    bad = publish(store, "bad", b"b")
    store.close()
    bad.library_path.chmod(0o644)
    bad.library_path.write_bytes(b"tampered")
    result = run(["-m", "cached", "verify", "--store", str(tmp_path / "store")], env)
    assert result.returncode == 1 and result.stdout.startswith("1/2 entries verified"), \
        result.stdout
    lines = result.stderr.splitlines()
    assert lines and all(line.startswith("cached verify: ") for line in lines), lines
    dropped = next(line for line in lines if "store.entry_dropped" in line)
    assert "reason=" in dropped and "key=" in dropped, dropped


# -- flags: one meaning each ---------------------------------------------------------------


def _options() -> list[tuple[str, object]]:
    from cached.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return [(name, action) for name, command in sub.choices.items()
            for action in command._actions]


def test_every_json_flag_prints_and_seconds_are_spelled_seconds():
    """--json on every subcommand prints one JSON document (tune's too: `--json PATH`, its
    old form, still writes a file, with a deprecation line); an option taking seconds says
    SECONDS, and a spelling with a unit suffix (`--budget-s`) is the deprecated alias of
    one that does not."""
    from cached.cli import build_parser

    for name, action in _options():
        if "--json" in action.option_strings:
            assert action.nargs == 0 or (action.nargs == "?" and action.const == "-"), name
            assert "print" in (action.help or ""), (name, action.help)
        if any(o.endswith("-s") for o in action.option_strings):
            assert "old spelling" in (action.help or ""), (name, action.option_strings)
    args = build_parser().parse_args(["tune", "--weight", "64,64", "--json"])
    assert args.json == "-"
    args = build_parser().parse_args(["tune", "--weight", "64,64", "--budget", "5"])
    assert args.budget == 5.0


def test_tune_accepts_the_old_budget_spelling_with_a_line_saying_so(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    result = run(["-m", "cached", "tune", "--weight", "64,64", "--budget-s", "5", "--socket",
                  str(tmp_path / "none.sock")], env_without_socket(tmp_path))
    lines = result.stderr.splitlines()
    assert result.returncode == 2 and len(lines) == 2, result.stderr
    assert lines[0] == "cached tune: --budget-s is deprecated: use --budget SECONDS"
    assert "CPU build" in lines[1] or "no CUDA device" in lines[1]


def test_limit_counts_kernels_and_a_manifest_plans_the_nodes_own_targets(user_daemon):
    """`warm --manifest M --limit 4` plans 4 kernels in all (was: 4 per build and target,
    20 for the Llama manifest); on a node where nvidia-smi names no GPU (this one) every
    target is planned and the line says so; the compute capabilities nvidia-smi prints map
    to the targets a node with those GPUs plans."""
    from cached.cli.warm import targets_of

    xdg, _ = user_daemon
    result = run(["-m", "cached", "warm", "--manifest", "llama-3.1-8b", "--limit", "4",
                  "--plan-only", "--json", "--skip-missing"], env_without_socket(xdg), check=True)
    plan = json.loads(result.stdout)
    assert plan["total"] == 4 and sum(plan["kernels"].values()) == 4, plan["kernels"]
    assert len(plan["requests"]) >= 2  # from more than one build: the first 4 in order
    if shutil.which("nvidia-smi") is None:
        assert "no GPU found here (nvidia-smi): every target of the manifest" in result.stderr
    assert targets_of(["9.0", "10.0", "10.0", "n/a", ""]) == {"sm_90a", "sm_100a"}


def test_on_a_hopper_node_a_manifest_warm_plans_sm90a_only_and_all_targets_plans_every_one(
        user_daemon, tmp_path):
    """Where nvidia-smi answers with compute capability 9.0 (an H100/H200 node's answer to
    `--query-gpu=compute_cap --format=csv,noheader`: an executable of that name first on
    PATH prints it), `warm --manifest` plans only the sm_90a builds and says so;
    `--all-targets` plans every target the manifest lists, as a build node does."""
    xdg, _ = user_daemon
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n[ \"$1\" = --query-gpu=compute_cap ] || exit 9\n"
                   "printf '9.0\\n9.0\\n'\n")
    smi.chmod(0o755)
    env = env_without_socket(xdg, PATH=f"{bin_dir}:{os.environ['PATH']}")
    argv = ["-m", "cached", "warm", "--manifest", "llama-3.1-8b", "--plan-only", "--json",
            "--skip-missing"]
    node = run(argv, env, check=True)
    every = run([*argv, "--all-targets"], env, check=True)
    assert "this node's GPU targets sm_90a: sm_90a of " in node.stderr, node.stderr
    mine = {g.rsplit("@", 1)[1] for g in json.loads(node.stdout)["kernels"]}
    listed = {g.rsplit("@", 1)[1] for g in json.loads(every.stdout)["kernels"]}
    assert mine == {"sm_90a"}, mine
    assert "sm_90a" in listed and len(listed) > 1, listed
    assert "GPU targets" not in every.stderr


def test_tune_json_path_says_it_is_deprecated_first_and_a_cpu_node_writes_nothing(
        user_daemon, tmp_path):
    """`tune --json PATH` (the old meaning: a file) says first that `--json > PATH` is the
    spelling now; on a node with no CUDA device the next line says so and no file is
    written (exit 2)."""
    xdg, _ = user_daemon
    out = tmp_path / "tune.json"
    result = run(["-m", "cached", "tune", "--weight", "64,64", "--json", str(out)],
                 env_without_socket(xdg))
    lines = result.stderr.splitlines()
    assert lines[0] == f"cached tune: --json PATH is deprecated: use --json > {out}", lines
    assert result.returncode == 2 and not out.exists() and result.stdout == ""
    assert any("CUDA" in line for line in lines[1:]), lines

# -- drift: what the daemon exposes and prints, as the docs say it ------------------------


def test_metrics_have_no_created_series_and_every_family_is_documented(user_daemon):
    """/metrics has no `_created` series (there were 163), and every metric family it
    exposes is named in docs/operations.md's metrics table."""
    _, d = user_daemon
    with urllib.request.urlopen(f"http://{d.stats()['http']}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    assert not [line for line in text.splitlines() if "_created" in line.split(" ")[0]]
    doc = (ROOT / "docs" / "operations.md").read_text()
    families = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            families[name] = kind
    assert len(families) > 20, families
    missing = [name for name, kind in families.items()
               if f"`{name}_total" not in doc and f"`{name}" not in doc
               and f" `{name}`" not in doc and f"{name}," not in doc]
    assert not missing, missing


def test_the_status_example_uses_the_units_the_daemon_prints():
    """The `systemctl status` example in operations.md shows the shipped budget
    (deploy/cached.toml's max_bytes) as size_text prints it (was: "20.0 GiB" for 20G,
    which the daemon prints "20 GB")."""
    import tomllib

    from cached.config import parse_size, size_text

    budget = size_text(parse_size(tomllib.loads(
        (ROOT / "deploy" / "cached.toml").read_text())["max_bytes"]))
    doc = " ".join((ROOT / "docs" / "operations.md").read_text().split())
    example = re.search(r"`serving: \d+ kernels \(([^)]*)\)", doc).group(1)
    used, _, of = example.partition(" of ")
    assert of == budget, (example, budget)
    assert re.fullmatch(r"\d+\.\d (KiB|MiB|GiB)|\d+ [kMGT]?B", used), used


def test_one_backoff_doubles_to_its_ceiling_jitters_and_starts_over():
    """cached_client.backoff.Backoff, which the prober, a connect to a full backlog, the
    pool's worker restarts and the fleet tier all use: first, doubling, capped; jitter
    within its bounds; reset starts over; nonsense bounds refused."""
    from cached_client.backoff import Backoff

    b = Backoff(0.5, 3.0)
    assert [b.next() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    b.reset()
    assert b.upcoming == 0.5 and b.next() == 0.5
    j = Backoff(1.0, 60.0, jitter=0.2)
    for expected in (1.0, 2.0, 4.0, 8.0):
        assert expected * 0.8 <= j.next() <= expected * 1.2
    for bad in ((0, 1), (2, 1), (1, 2, 1.0)):
        with pytest.raises(ValueError, match="backoff"):
            Backoff(*bad)
    import inspect

    from cached_client import liveness, transport

    from cached import pool
    from cached.fleet import redis_tier
    for module in (liveness, transport, pool, redis_tier):
        source = inspect.getsource(module)
        assert "Backoff(" in source and "* 2, " not in source, module.__name__
