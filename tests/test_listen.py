"""The socket path and the HTTP port (issue 16 items 4-7, and item 21's socket directory and
socket mode): a daemon never removes what it did not create, never takes over a live or
busy socket, refuses paths and ports it cannot use with one line before binding anything,
and leaves nothing behind when it does."""

from __future__ import annotations

import errno
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from cached_client import Client, DaemonUnavailable
from conftest import DaemonProcess, fault, wait_for


def serve(*args: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    """``cached serve`` that is expected to refuse: its result, or a failed test if it serves
    instead (it is killed after ``timeout``)."""
    proc = subprocess.Popen([sys.executable, "-m", "cached", "serve", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"cached serve {' '.join(args)} did not refuse; it served: {err[-2000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def one_line_refusal(result: subprocess.CompletedProcess, *words: str) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def test_an_old_daemon_draining_leaves_its_successors_socket_alone(tmp_path):
    """Item 4: SIGTERM a daemon with a compile running, start a new one on the same path
    while the old one drains; the old one's exit must not unlink the new one's socket."""
    old = DaemonProcess(tmp_path, workers=1, store=tmp_path / "store-old",
                        extra_args=["--drain-timeout", "300"])
    client = old.client(timeout=300, fallback=False)
    result: dict = {}
    waiter = threading.Thread(target=lambda: result.update(
        error=_error_of(lambda: client.get(fault("sleep", "drain", 300)))))
    waiter.start()
    wait_for(lambda: old.stats()["running"] == 1, 30)
    workers = old.worker_pids()
    old.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: "daemon.draining" in old.log_path.read_text(), 30)
    new = DaemonProcess(tmp_path, workers=1, store=tmp_path / "store-new", ready_workers=0)
    try:
        inode = os.stat(new.socket).st_ino
        assert old.proc.poll() is None, "the old daemon must still be draining here"
        for pid in workers:  # ends the compile the old daemon drains, so it exits now
            os.kill(pid, signal.SIGKILL)
        old.proc.wait(60)
        waiter.join(60)
        assert result["error"] in ("compile_failed", "unavailable")
        assert os.path.exists(new.socket), "the old daemon removed its successor's socket"
        assert os.stat(new.socket).st_ino == inode
        assert new.client(timeout=10).stats()["store"] == str(tmp_path / "store-new")
    finally:
        new.stop()
        old.stop()
    assert not os.path.exists(new.socket) and not os.path.exists(new.socket + ".lock")


def _error_of(call) -> str | None:
    try:
        call()
    except Exception as exc:  # noqa: BLE001
        return getattr(exc, "code", type(exc).__name__)
    return None


def _fill_backlog(path: str) -> list[socket.socket]:
    """Connect until the listener's accept backlog is full (EAGAIN)."""
    held = []
    for _ in range(5000):
        s = socket.socket(socket.AF_UNIX)
        s.setblocking(False)
        err = s.connect_ex(path)
        if err in (errno.EAGAIN, errno.EWOULDBLOCK):
            s.close()
            return held
        assert err == 0, os.strerror(err)
        held.append(s)
    raise AssertionError("the backlog never filled")


def test_a_busy_daemons_socket_is_not_taken_over(tmp_path):
    """Item 5: a daemon whose accept backlog is full (stopped here) keeps its socket; a
    second daemon on the same path refuses to start and says why."""
    first = DaemonProcess(tmp_path, workers=1, extra_args=["--max-connections-per-uid", "2000"])
    held: list[socket.socket] = []
    try:
        inode = os.stat(first.socket).st_ino
        os.kill(first.proc.pid, signal.SIGSTOP)
        held = _fill_backlog(first.socket)
        refused = serve("--socket", first.socket, "--store", str(tmp_path / "other"),
                        "--no-http", "--workers", "1")
        one_line_refusal(refused, first.socket)
        assert os.stat(first.socket).st_ino == inode
        assert not (tmp_path / "other").exists()
    finally:
        for s in held:
            s.close()
        os.kill(first.proc.pid, signal.SIGCONT)
    try:
        assert first.client(timeout=30).stats()["store"] == str(first.store)
    finally:
        first.stop()


def test_a_foreign_listener_with_a_full_backlog_is_busy_not_stale(tmp_path):
    """Item 5 without the lock file (a daemon of another version, any other program):
    EAGAIN means busy; only ECONNREFUSED or ENOENT would mean stale."""
    path = str(tmp_path / "busy.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(1)
    held = _fill_backlog(path)
    try:
        inode = os.stat(path).st_ino
        refused = serve("--socket", path, "--store", str(tmp_path / "store"), "--no-http")
        one_line_refusal(refused, "backlog is full", path)
        assert os.stat(path).st_ino == inode
    finally:
        for s in held:
            s.close()
        listener.close()


def test_a_stale_socket_is_replaced(tmp_path):
    """The other side of item 5: a socket file nobody listens on is stale and replaced."""
    path = str(tmp_path / "cached.sock")
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(path)
    dead.close()
    d = DaemonProcess(tmp_path, workers=1)
    try:
        assert d.client(timeout=10).stats()["socket"] == path
    finally:
        d.stop()


@pytest.mark.parametrize("what", ["regular file", "directory", "symbolic link", "too long"])
def test_a_socket_path_that_is_not_a_socket_is_refused_and_kept(tmp_path, what):
    """Item 6: never delete what is not a socket; a directory or a path over the 107 bytes a
    Unix socket path holds is a one-line refusal, not a traceback."""
    path = tmp_path / "cached.sock"
    if what == "regular file":
        path.write_text("precious\n")
    elif what == "directory":
        path.mkdir()
        (path / "inside").write_text("kept\n")
    elif what == "symbolic link":
        (tmp_path / "target").write_text("kept\n")
        path.symlink_to(tmp_path / "target")
    else:
        deep = tmp_path / ("d" * 60) / ("e" * 60)
        deep.mkdir(parents=True)
        path = deep / "cached.sock"
    refused = serve("--socket", str(path), "--store", str(tmp_path / "store"), "--no-http")
    line = one_line_refusal(refused, str(path))
    if what == "regular file":
        assert path.read_text() == "precious\n" and "regular file" in line
    elif what == "directory":
        assert (path / "inside").read_text() == "kept\n" and "directory" in line
    elif what == "symbolic link":
        assert path.is_symlink() and (tmp_path / "target").read_text() == "kept\n"
    else:
        assert "107" in line and not path.exists()
    assert not Path(f"{path}.lock").exists() and not (tmp_path / "store").exists()


@pytest.mark.parametrize("http", ["taken", "256.1.1.1:8377", "no-such-host.invalid:8377"])
def test_an_unusable_http_port_stops_the_daemon_before_its_socket(tmp_path, http):
    """Item 7: a taken or invalid HTTP address is a one-line error before the Unix socket
    (or the store) exists: nothing is left behind."""
    blocker = None
    if http == "taken":
        blocker = socket.socket()
        blocker.bind(("127.0.0.1", 0))
        blocker.listen(1)
        http = f"127.0.0.1:{blocker.getsockname()[1]}"
    sock = tmp_path / "cached.sock"
    try:
        refused = serve("--socket", str(sock), "--store", str(tmp_path / "store"), "--http",
                        http)
    finally:
        if blocker is not None:
            blocker.close()
    one_line_refusal(refused, http)
    assert sorted(os.listdir(tmp_path)) == [], os.listdir(tmp_path)


def test_the_default_socket_directory_is_created_private(tmp_path):
    """Item 21: the default socket directory is created 0700, as the docs say."""
    runtime = tmp_path / "xdg"
    runtime.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if k != "CACHED_SOCKET"}
    env["XDG_RUNTIME_DIR"] = str(runtime)
    proc = subprocess.Popen([sys.executable, "-m", "cached", "serve", "--store",
                             str(tmp_path / "store"), "--http", "127.0.0.1:0", "--workers",
                             "1"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        socket_path = runtime / "cached" / "cached.sock"
        wait_for(lambda: _answers(str(socket_path)), 60)
        mode = stat.S_IMODE(os.stat(runtime / "cached").st_mode)
        assert mode == 0o700, oct(mode)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def _answers(path: str) -> bool:
    try:
        return Client(path, timeout=10).hello().v == 1
    except DaemonUnavailable:
        return False


@pytest.mark.parametrize("mode", ["777777", "4777", "2660", "1666"])
def test_a_socket_mode_with_special_bits_is_refused_and_no_socket_made(tmp_path, mode):
    """Item 21: ``--socket-mode 777777`` gave a setuid socket; now the configuration is
    refused (exit 2, the option named) and no socket exists."""
    sock = tmp_path / "cached.sock"
    refused = serve("--socket", str(sock), "--store", str(tmp_path / "store"), "--no-http",
                    "--socket-mode", mode)
    assert refused.returncode == 2 and "socket_mode" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr
    assert not sock.exists()


def test_a_second_daemon_on_a_live_socket_names_the_first(tmp_path):
    """The lock beside the socket: a second daemon on a live path is told who holds it."""
    first = DaemonProcess(tmp_path, workers=1)
    try:
        refused = serve("--socket", first.socket, "--store", str(tmp_path / "other"),
                        "--no-http")
        one_line_refusal(refused, f"pid {first.proc.pid}", first.socket)
        assert first.client(timeout=10).stats()["store"] == str(first.store)
    finally:
        first.stop()
