"""What the daemon listens on, bound before anything else: the HTTP port, then the Unix
socket, under a lock file beside it.

Invariants:
- the HTTP port is bound first, so a port that is taken or invalid stops the daemon before
  any socket file exists (:func:`bind_http`);
- a socket path is refused, with one line saying why, when it is longer than the 107 bytes
  a Unix socket address holds, or when something other than a socket is there (a regular
  file, a directory, a link): nothing that is not a socket is ever removed;
- the lock ``<socket>.lock`` (``flock``) is taken before the path is inspected and held
  until the daemon stops listening, so two daemons never race for one path;
- an existing socket is replaced only when connecting to it is refused (ECONNREFUSED: no
  process listens) or it vanished (ENOENT); a socket that answers, or whose accept backlog
  is full (EAGAIN: busy, not stale), or any other error, refuses the start;
- on the way out a daemon unlinks the socket file only if it is still the one it created
  (same device and inode), and its lock file likewise; a socket systemd passed is never
  unlinked.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import stat

from cached_client.paths import check_socket_dir, daemon_socket_path

from cached.config import ConfigError
from cached.log import event

log = logging.getLogger("cached.daemon")

MAX_SOCKET_PATH = 107
"""Bytes of a Unix socket path (``sun_path`` holds 108, with its terminating NUL)."""
LISTEN_BACKLOG = 512


class StartRefused(ConfigError):
    """The daemon cannot listen where it is configured to; the message says why and what to
    do about it (``cached serve`` prints it as one line and exits 2)."""


# -- HTTP ------------------------------------------------------------------------------


def bind_http(address: tuple[str, int] | None) -> socket.socket | None:
    """A listening TCP socket on ``address`` (host, port), or None when HTTP is off.
    StartRefused when the port is taken, needs privileges or the host is not local."""
    if address is None:
        return None
    host, port = address
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                         socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(64)
    except OSError as exc:
        sock.close()
        raise StartRefused(_http_reason(host, port, exc)) from None
    return sock


def _http_reason(host: str, port: int, exc: OSError) -> str:
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if isinstance(exc, socket.gaierror):
        why = f"{host!r} is not an address ({exc.strerror})"
    elif exc.errno == errno.EADDRINUSE:
        why = f"port {port} is already in use on {host} (another daemon on this node?)"
    elif exc.errno == errno.EADDRNOTAVAIL:
        why = f"{host} is not an address of this machine"
    elif exc.errno == errno.EACCES:
        why = f"port {port} needs privileges this process does not have"
    else:
        why = exc.strerror or str(exc)
    return (f"cannot serve HTTP on {shown}: {why}; pick another --http HOST:PORT (port 0 "
            "picks a free one) or --no-http")


# -- the Unix socket -------------------------------------------------------------------


def _ident(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a socket"


class UnixListener:
    """The listening Unix socket at ``path``: created here under the path's lock, or passed
    by systemd (``inherited``: no lock, never unlinked)."""

    def __init__(self, path: str, sock: socket.socket, lock_fd: int | None = None,
                 lock_path: str | None = None, ident: tuple[int, int] | None = None) -> None:
        self.path = path
        self.sock = sock
        self.inherited = lock_fd is None
        self._lock_fd = lock_fd
        self._lock_path = lock_path
        self._ident = ident

    @classmethod
    def inherit(cls, sock: socket.socket) -> UnixListener:
        name = sock.getsockname()
        return cls(name.decode() if isinstance(name, bytes) else str(name), sock)

    @classmethod
    def claim(cls, path: str, mode: int) -> UnixListener:
        """Take ``path`` for a new socket with file mode ``mode``, bound but not listening
        yet (:meth:`listen`); StartRefused (nothing created, nothing removed) when it cannot
        be taken safely."""
        size = len(os.fsencode(path))
        if size > MAX_SOCKET_PATH:
            raise StartRefused(f"socket path {path} is {size} bytes; a Unix socket path holds "
                               f"at most {MAX_SOCKET_PATH}: pick a shorter --socket")
        if size == 0:
            raise StartRefused("the socket path is empty: give --socket PATH")
        default = path == daemon_socket_path()
        _make_directory(os.path.dirname(os.path.abspath(path)), 0o700 if default else 0o755)
        if default and (why := check_socket_dir(path)):
            raise StartRefused(f"refusing to listen: {why}")
        _refuse_other_files(path)
        lock_fd, lock_path = _lock(path)
        try:
            _clear_stale(path)
            sock = _bind(path, mode)
            ident = _ident(os.lstat(path))
        except BaseException:
            _unlock(lock_fd, lock_path)
            raise
        return cls(path, sock, lock_fd, lock_path, ident)

    def listen(self) -> None:
        """Start accepting connections (until now a connect is refused, so clients of a
        daemon still starting fall back at once instead of waiting in its backlog)."""
        self.sock.listen(LISTEN_BACKLOG)

    def release(self) -> None:
        """Stop owning the path: close the listening socket, unlink the socket file if it is
        still the one created here, then the lock. Idempotent."""
        self.sock.close()
        if self._lock_fd is None:
            return
        if self._ident is not None:
            with contextlib.suppress(OSError):
                if _ident(os.lstat(self.path)) == self._ident:
                    os.unlink(self.path)
            self._ident = None
        _unlock(self._lock_fd, self._lock_path)
        self._lock_fd = None


def _make_directory(directory: str, mode: int) -> None:
    try:
        os.makedirs(directory, mode=mode, exist_ok=True)
    except OSError as exc:
        raise StartRefused(f"cannot create the socket's directory {directory}: "
                           f"{exc.strerror}") from None
    if not os.path.isdir(directory):
        raise StartRefused(f"the socket's directory {directory} is not a directory")


def _refuse_other_files(path: str) -> os.stat_result | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StartRefused(f"cannot inspect {path}: {exc.strerror}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise StartRefused(f"{path} exists and is {_kind(st.st_mode)}, not a socket; refusing "
                           "to replace it: remove it yourself or pick another --socket")
    return st


def _lock(path: str) -> tuple[int, str]:
    """Hold ``<path>.lock`` exclusively; StartRefused naming the holder if another has it."""
    lock_path = path + ".lock"
    for _ in range(5):
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
                         | os.O_NONBLOCK, 0o600)
        except OSError as exc:
            hint = " (it is a symbolic link)" if exc.errno == errno.ELOOP else ""
            raise StartRefused(f"cannot open the lock file {lock_path}: {exc.strerror}{hint}; "
                               "pick another --socket") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise StartRefused(f"the lock file {lock_path} is not a regular file; remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise StartRefused(
                f"another daemon{f' (pid {holder})' if holder else ''} is serving on {path} "
                f"(it holds {lock_path}); stop it or pick another --socket") from None
        try:  # a daemon that just stopped unlinks its lock file: lock only the live one
            same = _ident(os.fstat(fd)) == _ident(os.lstat(lock_path))
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd, lock_path
        os.close(fd)
    raise StartRefused(f"could not lock {lock_path}: it keeps being replaced")


def _holder(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).decode().strip() or "0") or None
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def _unlock(fd: int, lock_path: str | None) -> None:
    with contextlib.suppress(OSError):
        if lock_path is not None and _ident(os.lstat(lock_path)) == _ident(os.fstat(fd)):
            os.unlink(lock_path)
    os.close(fd)


def _clear_stale(path: str) -> None:
    """Remove a socket file no process listens on; StartRefused for anything else there."""
    st = _refuse_other_files(path)
    if st is None:
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    probe.setblocking(False)
    try:
        err = probe.connect_ex(path)
    finally:
        probe.close()
    if err == errno.ENOENT:
        return
    if err == errno.ECONNREFUSED:
        with contextlib.suppress(FileNotFoundError):
            if _ident(os.lstat(path)) == _ident(st):
                os.unlink(path)
        event(log, logging.INFO, "socket.stale_removed", socket=path)
        return
    if err == 0:
        raise StartRefused(f"a process already answers on {path} (another daemon, or the "
                           "socket systemd holds for cached.socket); stop it or pick another "
                           "--socket")
    if err in (errno.EAGAIN, errno.EWOULDBLOCK):
        raise StartRefused(f"a process listens on {path} but accepts no connection now (its "
                           "accept backlog is full: busy, not stale), so it is left alone; "
                           "stop it or pick another --socket")
    raise StartRefused(f"cannot tell whether a process serves on {path} ({os.strerror(err)}), "
                       "so it is left alone; remove it if it is stale, or pick another --socket")


def _bind(path: str, mode: int) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    old = os.umask(0o777 & ~mode)  # created with no more than ``mode``, never wider
    try:
        sock.bind(path)
    except OSError as exc:
        sock.close()
        raise StartRefused(f"cannot create the socket {path}: {exc.strerror}") from None
    finally:
        os.umask(old)
    try:
        os.chmod(path, mode)
    except OSError as exc:
        sock.close()
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise StartRefused(f"cannot set the mode of {path}: {exc.strerror}") from None
    sock.setblocking(False)
    return sock
