"""One client connection of the daemon and the non-blocking socket I/O the server does on
it: reading exact sizes by a deadline, writing whole replies (with descriptors passed by
SCM_RIGHTS, or a file's bytes by ``sendfile``).

Invariants: a read that ends early raises :class:`Closed`; a write waits for the socket
without spinning, and notes since when it has waited (``Connection.blocked_since``) for the
server's idle sweep; a descriptor is passed with the first byte of its reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import select
import socket
import struct
import time
from collections.abc import Awaitable, Callable

from .peers import Peer


class Connection:
    """A peer's connection: its socket, its requests in flight and its reply state."""

    def __init__(self, sock: socket.socket, peer: Peer) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.peer = peer
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future | None = None
        self._watching = False
        self.inflight = 0
        self.unsent = 0
        self.tasks: set[asyncio.Task] = set()
        self.droppable: set[asyncio.Task] = set()  # DROPPED_WHEN_GONE requests in flight
        self.write_lock = asyncio.Lock()
        self.changed = asyncio.Event()
        self.last_active = time.monotonic()
        self.blocked_since: float | None = None  # a reply waits for the peer to read
        self.in_frame = False  # part of a frame has arrived

    async def readable(self) -> None:
        """Until the socket has bytes to read (or its end). The reader stays registered from
        one wait to the next (a request costs no epoll_ctl); it fires with nobody waiting
        only while the bytes are left unread on purpose (back-pressure, no frame room), and
        then unregisters itself, so unread bytes never spin the loop."""
        self._waiter = self._loop.create_future()
        if not self._watching:
            self._loop.add_reader(self.fd, self._on_readable)
            self._watching = True
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _on_readable(self) -> None:
        if self._waiter is None:
            self.unwatch()
        elif not self._waiter.done():
            self._waiter.set_result(None)

    def hung_up(self) -> bool:
        """Whether the peer has closed its end entirely (it can read no answer)."""
        poller = select.poll()
        poller.register(self.fd, select.POLLRDHUP)
        return any(events & (select.POLLHUP | select.POLLERR | select.POLLNVAL)
                   for _, events in poller.poll(0))

    def drop_if_gone(self) -> bool:
        """Cancel the DROPPED_WHEN_GONE requests of a peer that hung up; whether it has."""
        if not self.hung_up():
            return False
        for task in self.droppable:
            task.cancel()
        return True

    def unwatch(self) -> None:
        """Unregister the reader (before the socket closes)."""
        if self._watching:
            self._loop.remove_reader(self.fd)
            self._watching = False


class Closed(Exception):
    """The peer shut its sending side (or vanished) before a frame was whole."""


def discard_input(sock: socket.socket, limit: int = 1 << 20) -> None:
    """Read and drop what the peer sent and nobody will read (up to ``limit`` bytes): closing
    a Unix socket with unread input resets the connection, and the peer would lose the
    replies it has not read yet."""
    with contextlib.suppress(OSError):
        while limit > 0:
            data = sock.recv(min(limit, 64 << 10))
            if not data:
                return
            limit -= len(data)


async def readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    future = loop.create_future()
    fd = sock.fileno()
    loop.add_reader(fd, lambda: future.done() or future.set_result(None))
    try:
        await future
    finally:
        loop.remove_reader(fd)


async def writable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    future = loop.create_future()
    fd = sock.fileno()
    loop.add_writer(fd, lambda: future.done() or future.set_result(None))
    try:
        await future
    finally:
        loop.remove_writer(fd)


async def read_exact(sock: socket.socket, size: int, deadline: float,
                      readable: Callable[[], Awaitable[None]]) -> bytearray:
    """``size`` bytes by ``deadline`` (loop time): TimeoutError, or Closed at end of input.
    No timer is armed unless the bytes are not there yet."""
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    while got < size:
        try:
            n = sock.recv_into(view[got:])
        except BlockingIOError:
            async with asyncio.timeout_at(deadline):
                await readable()
            continue
        except OSError:
            raise Closed() from None
        if n == 0:
            raise Closed()
        got += n
    return buffer


async def _untilwritable(loop: asyncio.AbstractEventLoop, c: Connection) -> None:
    if c.blocked_since is None:
        c.blocked_since = time.monotonic()
    await writable(loop, c.sock)


async def sendall(loop: asyncio.AbstractEventLoop, c: Connection, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[c.sock.send(view):]
        except BlockingIOError:
            await _untilwritable(loop, c)


async def sendmsg_all(loop: asyncio.AbstractEventLoop, c: Connection, data: bytes,
                       fds: list[int]) -> None:
    """``data`` with ``fds`` attached to its first byte (SCM_RIGHTS), then the rest."""
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))]
    while True:
        try:
            sent = c.sock.sendmsg([data], ancillary)
            break
        except BlockingIOError:
            await _untilwritable(loop, c)
    if sent < len(data):
        await sendall(loop, c, memoryview(data)[sent:])


async def sendfile_all(loop: asyncio.AbstractEventLoop, c: Connection, fd: int,
                        size: int) -> None:
    """Bytes ``[0, size)`` of the file ``fd``, straight from the page cache."""
    offset = 0
    while offset < size:
        try:
            sent = os.sendfile(c.sock.fileno(), fd, offset, size - offset)
        except BlockingIOError:
            await _untilwritable(loop, c)
            continue
        if sent == 0:
            raise OSError(errno.EIO, "the payload file ended early")
        offset += sent
