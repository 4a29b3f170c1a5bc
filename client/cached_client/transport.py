"""A blocking Unix-socket connection to the daemon, with a deadline on every call.

Invariants: no call blocks past its deadline (seconds on ``time.monotonic``), and connecting
takes at most ``connect_timeout``; a timeout, a refused or vanished socket and a frame cut
short all become DaemonUnavailable or DeadlineExceeded, and leave the connection closed.
While a call waits, every ``silence_s`` without a byte from the daemon the ``on_silence``
check runs (the client asks for a ``hello`` on a new connection): a daemon that answers is
waited for up to the deadline (a long compilation), one that does not ends the call at once
as DaemonUnavailable. Sending reads whatever replies arrive meanwhile, so a client that
pipelines many requests before reading never deadlocks against the daemon's back-pressure.
Descriptors passed with a reply (SCM_RIGHTS) are handed to the frame that names them
(``"fds"``) and are the caller's to close; any other is closed with the connection.

Trust, at every connect (UntrustedDaemon otherwise, before a byte is sent): the process
listening on the socket runs as a trusted uid (SO_PEERCRED; cached_client.paths.trusted_uids).
With ``check_dir`` (the default socket, whose directory may be under a shared /tmp) the
socket's directory is opened first (O_PATH | O_DIRECTORY | O_NOFOLLOW), checked through that
descriptor (a real directory of a trusted uid that only its owner can write) and connected
through it (``/proc/self/fd/N/NAME``), so a directory created or swapped after the check is
never the one connected to.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import time
from collections import deque
from collections.abc import Callable

from . import paths
from .backoff import Backoff
from .errors import BadReply, DaemonUnavailable, DeadlineExceeded, MalformedFrame, UntrustedDaemon
from .protocol import HEADER, MAX_REPLY_FRAME, decode_body, encode_frame, frame_length

CONNECT_TIMEOUT_S = 2.0
SILENCE_S = 3.0
RECV_SIZE = 64 << 10
MAX_FDS_PER_READ = 128
"""Descriptors one read takes: a ``get_batch`` reply passes up to 128 at once."""
_FD = struct.Struct("i")
_UCRED = struct.Struct("3i")
MAX_SOCKET_PATH = 107
_O_PATH = getattr(os, "O_PATH", os.O_RDONLY)  # a directory reference: no read right needed


class DaemonSilent(DaemonUnavailable):
    """The daemon accepts no connection in time, or went silent during a call and did not
    answer a ``hello`` either: stopped or hung. Waiting for it again would cost as much."""


class ConnectFailed(DaemonUnavailable):
    """Connecting failed; ``errno`` says how (ECONNREFUSED: nothing listens there)."""

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


class Connection:
    """One socket; ``request()`` is a round trip, ``send()``/``receive()`` pipeline."""

    def __init__(self, path: str, deadline: float,
                 connect_timeout: float = CONNECT_TIMEOUT_S,
                 on_silence: Callable[[], bool] | None = None,
                 silence_s: float = SILENCE_S, check_dir: bool = False) -> None:
        self.path = path
        self.on_silence = on_silence
        self.silence_s = silence_s
        self.received = 0
        """Bytes received on this connection so far."""
        self._buffer = bytearray()
        self._fds: deque[int] = deque()
        self._eof = False
        self._closed = False
        self.capabilities: frozenset[str] | None = None
        self.ops: frozenset[str] | None = None  # what its daemon's hello listed
        """What the daemon's ``hello`` on this connection stated (None: not asked yet)."""
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            _connect_trusted(self._sock, path, time.monotonic() + min(_remaining(deadline),
                                                                      connect_timeout),
                             check_dir)
        except UntrustedDaemon:
            self._sock.close()
            raise
        except TimeoutError:
            self._sock.close()
            raise DaemonSilent(
                f"connecting to the daemon at {path} timed out: it accepts no connection "
                "(stopped, hung, or its backlog is full)") from None
        except OSError as exc:
            self._sock.close()
            raise ConnectFailed(f"cannot connect to the daemon at {path}: {exc}",
                                exc.errno) from None
        self._sock.setblocking(False)
        self._poll = select.poll()
        self._poll.register(self._sock, select.POLLIN)
        self._events = select.POLLIN

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sock.close()
        while self._fds:
            _close_fd(self._fds.popleft())

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def usable(self) -> bool:
        """Whether a kept connection may carry another request: open, its end not seen, and
        nothing unexpected buffered. (A connection the daemon closed meanwhile shows when
        used: the client then retries once on a fresh one.)"""
        return not (self._closed or self._eof or self._buffer)

    def send(self, message: dict, deadline: float) -> None:
        data = memoryview(encode_frame(message))
        try:
            self._send(data, deadline)
        except DeadlineExceeded:
            self.close()  # half a frame may be out: this connection is done
            raise DeadlineExceeded("sending to the daemon timed out") from None

    def _send(self, data: memoryview, deadline: float) -> None:
        try:  # the socket buffer usually takes a request whole: no poll needed
            data = data[self._sock.send(data):]
        except BlockingIOError:
            pass
        except OSError as exc:
            self.close()
            raise DaemonUnavailable(f"the daemon connection failed while sending: {exc}") from None
        while data:
            events = select.POLLOUT | (0 if self._eof else select.POLLIN)
            ready = self._wait(events, deadline, "sending to")
            if ready & select.POLLIN and not self._eof:
                self._fill()  # replies to earlier requests wait here, not in the daemon
            if ready & (select.POLLOUT | select.POLLERR | select.POLLHUP):
                try:
                    sent = self._sock.send(data)
                except BlockingIOError:
                    continue
                except OSError as exc:
                    self.close()
                    raise DaemonUnavailable(
                        f"the daemon connection failed while sending: {exc}") from None
                data = data[sent:]

    def receive(self, deadline: float) -> tuple[dict, bytes | None]:
        """The next reply and, if it announced one, its payload bytes (descriptors that
        came with it are closed)."""
        reply, payload, fds = self.receive_with_fds(deadline)
        for fd in fds:
            _close_fd(fd)
        return reply, payload

    def receive_with_fds(self, deadline: float) -> tuple[dict, bytes | None, list[int]]:
        """The next reply, its payload bytes if it announced some, and the descriptors it
        names in ``fds`` (the caller closes them)."""
        header = self._take(HEADER.size, deadline)
        try:
            body = self._take(frame_length(header, MAX_REPLY_FRAME), deadline)
            reply = decode_body(body)
        except MalformedFrame:
            self.close()
            raise
        payload = None
        size = reply.get("payload_size")
        if isinstance(size, int) and 0 <= size <= MAX_REPLY_FRAME:
            payload = self._take(size, deadline)
        named = reply.get("fds")
        fds: list[int] = []
        if isinstance(named, list) and named:
            if len(self._fds) < len(named):
                self.close()
                raise BadReply(f"the daemon's reply names {len(named)} descriptors but passed "
                               f"{len(self._fds)}; connection dropped")
            fds = [self._fds.popleft() for _ in named]
        return reply, payload, fds

    def request(self, message: dict, deadline: float) -> tuple[dict, bytes | None]:
        self.send(message, deadline)
        return self.receive(deadline)

    # -- internals --------------------------------------------------------------------------

    def _wait(self, events: int, deadline: float, doing: str) -> int:
        """Poll for ``events`` until the deadline, checking a silent daemon every
        ``silence_s``; the events that came."""
        if self._closed:
            raise DaemonUnavailable("the daemon connection is closed")
        if events != self._events:
            self._poll.modify(self._sock, events)
            self._events = events
        while True:
            left = _remaining(deadline)
            if self.on_silence is None:
                step = left
            else:
                step = min(left, self.silence_s)
            ready = self._poll.poll(max(1, int(step * 1000 + 0.999)))
            if ready:
                return ready[0][1]
            if self.on_silence is not None and step < left and not self.on_silence():
                self.close()
                raise DaemonSilent(
                    f"the daemon at {self.path} went silent {doing} it ({self.silence_s:.0f}s "
                    "without a byte) and did not answer a hello on a new connection: it is "
                    "stopped or hung")

    def _fill(self) -> None:
        """Read what is there (bytes and descriptors) into the buffer."""
        try:
            data, ancillary, _, _ = self._sock.recvmsg(
                RECV_SIZE, socket.CMSG_SPACE(MAX_FDS_PER_READ * _FD.size),
                socket.MSG_CMSG_CLOEXEC)
        except BlockingIOError:
            return
        except OSError as exc:
            self.close()
            raise DaemonUnavailable(f"the daemon connection failed: {exc}") from None
        for level, kind, cdata in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                usable = len(cdata) - len(cdata) % _FD.size
                self._fds.extend(fd for (fd,) in _FD.iter_unpack(cdata[:usable]))
        if not data:
            self._eof = True
        else:
            self.received += len(data)
            self._buffer += data

    def _take(self, size: int, deadline: float) -> bytes:
        while len(self._buffer) < size:
            if self._eof:
                self.close()
                raise DaemonUnavailable("the daemon closed the connection" + (
                    " mid-reply" if self._buffer else ""))
            try:
                self._wait(select.POLLIN, deadline, "waiting for")
            except DeadlineExceeded:
                self.close()
                raise DeadlineExceeded("the daemon did not answer before the deadline") from None
            self._fill()
        out = bytes(self._buffer[:size])
        del self._buffer[:size]
        return out


def _connect_trusted(sock: socket.socket, path: str, deadline: float, check_dir: bool) -> None:
    """Connect to ``path`` by ``deadline``, then check the peer's uid; with ``check_dir``
    through the checked, opened directory (see the module doc)."""
    try:
        uids = paths.trusted_uids()
    except ValueError as exc:
        raise UntrustedDaemon(f"not connecting to {path}: {exc}") from None
    if not check_dir:
        _connect(sock, path, deadline)
    else:
        directory = os.path.dirname(path) or "."
        try:
            dfd = os.open(directory, _O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise  # nothing there yet: like a socket file that does not exist
        except OSError as exc:  # ELOOP (a link), ENOTDIR, EACCES
            raise UntrustedDaemon(f"not connecting to {path}: {directory} cannot be opened as "
                                  f"a directory ({exc.strerror}); set {paths.SOCKET_ENV} to "
                                  "the daemon's socket") from None
        try:
            why = paths.check_dir_stat(os.fstat(dfd), directory, uids)
            if why:
                raise UntrustedDaemon(f"not connecting to {path}: {why}")
            through = f"/proc/self/fd/{dfd}/{os.path.basename(path)}"
            if len(os.fsencode(through)) <= MAX_SOCKET_PATH and os.path.isdir(
                    f"/proc/self/fd/{dfd}"):
                _connect(sock, through, deadline)
            else:  # no /proc, or a long name: connect by path, then the same directory?
                _connect(sock, path, deadline)
                st, now = os.fstat(dfd), os.stat(directory)
                if (st.st_dev, st.st_ino) != (now.st_dev, now.st_ino):
                    raise UntrustedDaemon(f"not connecting to {path}: {directory} was "
                                          "replaced while connecting")
        finally:
            os.close(dfd)
    pid, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                _UCRED.size))
    if uid not in uids:
        raise UntrustedDaemon(
            f"not using {path}: the process answering there (pid {pid}) runs as uid {uid}, "
            f"not as root or uid {', '.join(str(u) for u in sorted(uids - {0}))}; if that is "
            f"the daemon, set {paths.DAEMON_UID_ENV}={uid}")


def _connect(sock: socket.socket, path: str, deadline: float) -> None:
    """Connect by ``deadline``; a full accept backlog (EAGAIN) is waited out, not an error."""
    pauses = Backoff(0.002, 0.1)
    while True:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            sock.connect(path)
            return
        except BlockingIOError:
            if time.monotonic() + pauses.upcoming >= deadline:
                raise TimeoutError() from None
            time.sleep(pauses.next())


def _close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded("the deadline passed before the daemon answered")
    return left
