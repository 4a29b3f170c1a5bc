"""systemd as PID 1 of private namespaces, booting this checkout's cached.socket and
cached.service exactly as shipped (plus a drop-in), on a machine where systemd is not PID 1.

``systemd-socket-activate`` passes a socket but applies none of a unit's sandboxing, and
``systemd-run`` needs a running manager. Here ``/lib/systemd/systemd`` itself runs as PID 1
of new pid, mount, network, uts and ipc namespaces (as systemd-nspawn would run it), with
tmpfs over /run, /tmp and /var/{tmp,lib,log,cache}, overlays over /etc and /opt, and the
root bind-mounted read-only: the host's files are never written. Every unit the stock
targets pull in is masked except journald, so the only services are journald and cached.

The production layout is rebuilt inside: /etc/cached/{cached.env,cached.toml} from deploy/,
the cached user (990) and the cached-clients group (4242) in /etc/passwd and /etc/group, and
/opt/cached/venv, a virtualenv of this interpreter's base Python (bind-mounted at
/opt/python: ProtectHome= would hide it under /root) that sees the test environment's
site-packages. The network namespace has only loopback, with 127.0.0.1 and 10.0.0.1.

Needs root, unshare/nsenter/setpriv/ip (util-linux, iproute2), overlayfs and a writable
cgroup hierarchy; ``unavailable()`` says what is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SYSTEMD = "/lib/systemd/systemd"
CACHED_UID, CLIENTS_GID = 990, 4242
PYTHON = "/opt/cached/venv/bin/python"  # inside: executable by every user
ENTRY_POINT = """#!/opt/cached/venv/bin/python
import sys
from cached.cli import main
if __name__ == "__main__":  # workers are spawned: they import this file as __mp_main__
    sys.exit(main())
"""

BOOT = r"""
set -euo pipefail
S=/run/host-scratch
mount -t tmpfs -o mode=755 tmpfs /run
mkdir -p $S /run/ovl && mount --bind "$1" $S
for d in /tmp /var/tmp; do mount -t tmpfs -o mode=1777 tmpfs $d; done
for d in /var/lib /var/log /var/cache; do mount -t tmpfs -o mode=755 tmpfs $d; done
for d in etc opt; do
  mkdir -p /run/ovl/$d.up /run/ovl/$d.work
  mount -t overlay overlay -o lowerdir=/$d,upperdir=/run/ovl/$d.up,workdir=/run/ovl/$d.work /$d
done
[ "$(findmnt -n -o FSTYPE /etc)" = overlay ] && [ "$(findmnt -n -o FSTYPE /opt)" = overlay ]
rm -rf /etc/systemd/system/* /opt/*
cp -r $S/units/. /etc/systemd/system/
for w in /lib/systemd/system/*.target.wants/* /lib/systemd/system/systemd-remount-fs.service
do
  u=$(basename "$w")
  case $u in systemd-journald.service|systemd-journald.socket|systemd-journald-dev-log.socket)
    continue;; esac
  ln -sf /dev/null /etc/systemd/system/$u
done
cat $S/passwd >> /etc/passwd && cat $S/group >> /etc/group
mkdir -p /etc/cached && cp $S/etc-cached/* /etc/cached/
mkdir -p /opt/python && mount --bind "$2" /opt/python
/opt/python/bin/python3 -m venv --without-pip /opt/cached/venv
SP=$(echo /opt/cached/venv/lib/python3.*/site-packages)
echo "import site; site.addsitedir('$3')" > "$SP/zz-test-site.pth"
install -m 755 $S/cached /opt/cached/venv/bin/cached
ip link set lo up && ip addr add 10.0.0.1/32 dev lo
mount -o remount,bind,ro /
mount -o remount,bind,ro /sys
mount --bind $S/console.log /dev/console
hostname cached-test
exec env -i container=cached-test PATH=/usr/sbin:/usr/bin:/sbin:/bin "$4" --system \
  --unit=cached-test.target --log-target=console --show-status=no
"""


def _cgroup_parents() -> list[Path]:
    root = Path("/sys/fs/cgroup")
    if (root / "cgroup.controllers").exists():  # unified (cgroup v2 only)
        return [root]
    return [root / h for h in ("systemd", "unified") if (root / h / "cgroup.procs").exists()]


def unavailable() -> str | None:
    """Why a booted systemd cannot run here, or None."""
    if os.getuid() != 0:
        return "needs root (namespaces, mounts, cgroups)"
    for tool in ("unshare", "nsenter", "setpriv", "ip", "findmnt"):
        if not shutil.which(tool):
            return f"{tool} is not installed"
    if not os.path.exists(SYSTEMD):
        return "systemd is not installed"
    if "overlay" not in Path("/proc/filesystems").read_text():
        return "no overlayfs"
    if not _cgroup_parents():
        return "no writable cgroup hierarchy"
    for path in (Path(__file__).resolve().parents[1], Path(site.getsitepackages()[0])):
        if path.is_relative_to("/home") or path.is_relative_to("/root"):
            return f"{path} is under a path cached.service hides (ProtectHome=)"
        if path.is_relative_to("/tmp") or path.is_relative_to("/var/tmp"):
            return f"{path} is under a path cached.service hides (PrivateTmp=)"
    return None


class BootedSystemd:
    """``units`` (name -> text) booted under systemd; ``run`` executes inside."""

    def __init__(self, units: dict[str, str], etc_cached: dict[str, str],
                 timeout: float = 60.0) -> None:
        self.scratch = Path(tempfile.mkdtemp(prefix="cached-systemd-", dir="/tmp"))
        self.scratch.chmod(0o755)  # the cached user reads nothing here; test users do
        self.name = self.scratch.name
        for name, text in units.items():
            path = self.scratch / "units" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        (self.scratch / "etc-cached").mkdir()
        for name, text in etc_cached.items():
            (self.scratch / "etc-cached" / name).write_text(text)
        (self.scratch / "passwd").write_text(
            f"cached:x:{CACHED_UID}:{CACHED_UID}:cached:/var/lib/cached:/usr/sbin/nologin\n")
        (self.scratch / "group").write_text(
            f"cached:x:{CACHED_UID}:\ncached-clients:x:{CLIENTS_GID}:\n")
        (self.scratch / "console.log").write_text("")
        (self.scratch / "boot.sh").write_text(BOOT)
        (self.scratch / "cached").write_text(ENTRY_POINT)
        self.cgroups = [parent / self.name for parent in _cgroup_parents()]
        for cgroup in self.cgroups:
            cgroup.mkdir()
        enter = "".join(f"echo $$ > {c}/cgroup.procs; " for c in self.cgroups)
        self.log = open(self.scratch / "unshare.log", "w")
        self.unshare = subprocess.Popen(
            ["sh", "-c", enter + 'exec "$@"', "sh", "unshare", "--pid", "--fork", "--mount",
             "--uts", "--ipc", "--net", "--propagation", "private", "--mount-proc",
             "bash", str(self.scratch / "boot.sh"), str(self.scratch), sys.base_prefix,
             site.getsitepackages()[0], SYSTEMD],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.pid = 0
        try:
            deadline = time.monotonic() + timeout
            while not os.path.exists(f"/proc/{self.pid}/root/run/systemd/private"):
                if self.unshare.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"systemd did not come up: {self.logs()}")
                children = Path(f"/proc/{self.unshare.pid}/task/{self.unshare.pid}/children")
                if not self.pid and children.exists() and children.read_text().split():
                    self.pid = int(children.read_text().split()[0])
                time.sleep(0.1)
            while self.systemctl("is-system-running", check=False).stdout.strip() in (
                    "initializing", "starting", ""):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"systemd did not finish starting: {self.logs()}")
                time.sleep(0.1)
        except BaseException:
            self.close()
            raise

    def run(self, *cmd: str, user: tuple[int, list[int]] | None = None, check: bool = True,
            timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
        """``cmd`` in the booted system's namespaces, as root or as ``(uid, groups)``."""
        who: list[str] = []
        if user is not None:
            uid, groups = user
            who = ["setpriv", f"--reuid={uid}", f"--regid={uid}",
                   f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups"]
        return subprocess.run(["nsenter", "-t", str(self.pid), "-m", "-p", "-n", "-u", "-i",
                               *who, *cmd], capture_output=True, text=True, check=check,
                              timeout=timeout, **kwargs)

    def py(self, *args: str, user: tuple[int, list[int]] | None = None, check: bool = True,
           timeout: float = 300) -> subprocess.CompletedProcess:
        """/opt/cached/venv's Python with ``args``, this checkout on its path."""
        root = Path(__file__).resolve().parents[1]
        return self.run("env", "LD_LIBRARY_PATH=/opt/python/lib",
                        f"PYTHONPATH={root}:{root / 'client'}", PYTHON, *args,
                        user=user, check=check, timeout=timeout)

    def put(self, name: str, text: str) -> str:
        """A file readable by every user inside; its path there."""
        (self.scratch / name).write_text(text)
        return f"/run/host-scratch/{name}"

    def systemctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.run("systemctl", "--no-pager", *args, check=check, timeout=120)

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.systemctl("show", unit, "-p", ",".join(props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def service_pids(self, unit: str) -> list[int]:
        """The unit's processes, as host pids (from its cgroup)."""
        for cgroup in self.cgroups:
            procs = cgroup / "system.slice" / unit / "cgroup.procs"
            if procs.exists():
                return [int(p) for p in procs.read_text().split()]
        return []

    def host_path(self, path: str) -> Path:
        """A path of the booted system, seen from the host."""
        return Path(f"/proc/{self.pid}/root{path}")

    def journal(self, unit: str) -> str:
        return self.run("journalctl", "--no-pager", "-o", "cat", "-u", unit,
                        check=False).stdout

    def write_dropin(self, unit: str, name: str, text: str) -> None:
        """A drop-in for ``unit`` inside (then ``systemctl daemon-reload``)."""
        self.run("sh", "-c", f"mkdir -p /etc/systemd/system/{unit}.d && cat > "
                 f"/etc/systemd/system/{unit}.d/{name}", input=text)
        self.systemctl("daemon-reload")

    def logs(self) -> str:
        text = (self.scratch / "console.log").read_text()[-3000:]
        return text + (self.scratch / "unshare.log").read_text()[-2000:]

    def close(self) -> None:
        """Kill everything in the namespaces (SIGKILL to their PID 1) and clean up."""
        if self.pid:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.unshare.poll() is None:
            try:
                self.unshare.wait(30)
            except subprocess.TimeoutExpired:
                self.unshare.kill()
                self.unshare.wait()
        self.log.close()
        deadline = time.monotonic() + 30
        for cgroup in self.cgroups:
            while cgroup.exists():
                for d in sorted((p for p in cgroup.rglob("*") if p.is_dir()),
                                key=lambda p: -len(p.parts)) + [cgroup]:
                    try:
                        d.rmdir()
                    except OSError:
                        pass
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        shutil.rmtree(self.scratch, ignore_errors=True)


def json_line(result: subprocess.CompletedProcess) -> dict:
    """The last line of a command's output, as JSON."""
    return json.loads(result.stdout.strip().splitlines()[-1])
