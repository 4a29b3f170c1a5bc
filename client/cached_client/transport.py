"""A blocking Unix-socket connection to the daemon, with a deadline on every call.

Invariant: no call blocks past its deadline (seconds on ``time.monotonic``); a timeout,
a refused or vanished socket and a frame cut short all become DaemonUnavailable or
DeadlineExceeded, and leave the connection closed.
"""

from __future__ import annotations

import socket
import time

from .errors import DaemonUnavailable, DeadlineExceeded, MalformedFrame
from .protocol import HEADER, MAX_REPLY_FRAME, decode_body, encode_frame, frame_length


class Connection:
    """One socket; ``request()`` is a round trip, ``send()``/``receive()`` pipeline."""

    def __init__(self, path: str, deadline: float) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(_remaining(deadline))
            self._sock.connect(path)
        except TimeoutError:
            self._sock.close()
            raise DeadlineExceeded(f"connecting to the daemon at {path} timed out") from None
        except OSError as exc:
            self._sock.close()
            raise DaemonUnavailable(f"cannot connect to the daemon at {path}: {exc}") from None

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, message: dict, deadline: float) -> None:
        try:
            self._sock.settimeout(_remaining(deadline))
            self._sock.sendall(encode_frame(message))
        except TimeoutError:
            self.close()
            raise DeadlineExceeded("sending to the daemon timed out") from None
        except OSError as exc:
            self.close()
            raise DaemonUnavailable(f"the daemon connection failed while sending: {exc}") from None

    def receive(self, deadline: float) -> tuple[dict, bytes | None]:
        """The next reply and, if it announced one, its payload bytes."""
        header = self._read_exact(HEADER.size, deadline)
        try:
            body = self._read_exact(frame_length(header, MAX_REPLY_FRAME), deadline)
            reply = decode_body(body)
        except MalformedFrame:
            self.close()
            raise
        payload = None
        size = reply.get("payload_size")
        if isinstance(size, int) and 0 <= size <= MAX_REPLY_FRAME:
            payload = self._read_exact(size, deadline)
        return reply, payload

    def request(self, message: dict, deadline: float) -> tuple[dict, bytes | None]:
        self.send(message, deadline)
        return self.receive(deadline)

    def _read_exact(self, size: int, deadline: float) -> bytes:
        chunks = bytearray()
        while len(chunks) < size:
            try:
                self._sock.settimeout(_remaining(deadline))
                chunk = self._sock.recv(min(size - len(chunks), 1 << 20))
            except TimeoutError:
                self.close()
                raise DeadlineExceeded("the daemon did not answer before the deadline") from None
            except OSError as exc:
                self.close()
                raise DaemonUnavailable(f"the daemon connection failed: {exc}") from None
            if not chunk:
                self.close()
                raise DaemonUnavailable("the daemon closed the connection mid-reply")
            chunks += chunk
        return bytes(chunks)


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded("the deadline passed before the daemon answered")
    return left
