"""Deployment: systemd units verify, socket activation end to end with group-only
access and sd_notify, and the Dockerfile lints."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from cached_client import Client
from cached_client.protocol import HEADER, decode_body, encode_frame
from conftest import ROOT

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
                 "RuntimeDirectory=cached", "NoNewPrivileges=yes", "ProtectSystem=strict",
                 "ProtectHome=yes", "PrivateTmp=yes", "RestrictAddressFamilies=", "MemoryMax=",
                 "User=cached", "EnvironmentFile=-/etc/cached/cached.env"):
        assert line in service, line
    sock = (ROOT / "deploy" / "cached.socket").read_text()
    assert "SocketMode=0660" in sock and "SocketGroup=cached-clients" in sock


def test_dockerfile_lints():
    result = subprocess.run([_tool("hadolint"), "--failure-threshold", "info",
                             str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    text = (ROOT / "Dockerfile").read_text()
    for word in ("HEALTHCHECK", "/healthz", "VOLUME", "USER 990", "docker run"):
        assert word in text, word


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
