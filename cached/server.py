"""The Unix-socket server: frames in, one typed request per frame, the op's handler, frames out.

The wire surface is :data:`cached_client.protocol.OPS`; the server is built with one
handler per op (each component declares its own with ``ops()``) and refuses to start if
an op has no handler or a handler no op. A request is decoded once, here: a field that
fails its check is ``invalid_argument`` before any component sees it.

Invariants: each connection is its own task and each request on it its own sub-task, so a
slow or hostile client costs only itself; replies on one connection are written whole, one
at a time; every well-formed request gets its reply, also after the peer has shut its
sending side; a malformed or oversize frame gets an error reply and closes that connection
only (the well-formed requests before it are answered first); any other failure of a
request becomes a typed error reply, ``internal`` only for a daemon bug; a request whose
strings are not text (a lone UTF-16 surrogate escaped in its JSON) is
``invalid_argument`` before its op sees it.

Bounds (what a peer can make the daemon hold; docs/reliability.md):
- connections: at most ``Limits.max_connections`` in all and
  ``Limits.max_connections_per_uid`` per peer uid; one more is answered ``overloaded`` and
  closed;
- a request frame is read only after its room is reserved: frames over
  :data:`SMALL_FRAME` bytes, partial or being answered, hold at most
  :data:`MAX_FRAME_BYTES_PER_UID` per uid and :data:`MAX_FRAME_BYTES` in all; a frame that
  finds no room within :data:`FRAME_TIMEOUT_S` is ``overloaded`` and closes its connection;
- a frame must arrive whole within :data:`FRAME_TIMEOUT_S` (or ``idle_timeout`` if shorter)
  of its first byte;
- back-pressure: the daemon reads no further request from a connection while
  :data:`MAX_INFLIGHT_PER_CONNECTION` of its requests are being answered or while more
  than :data:`MAX_UNSENT_PER_CONNECTION` bytes of its replies wait for it to read them;
- a connection with nothing in flight and no byte received for ``Limits.idle_timeout``
  seconds is closed, and so is one whose peer reads none of a reply for that long;
- the requests of :data:`DROPPED_WHEN_GONE` ops (``plan``) are cancelled, their queued
  jobs dropped, once their peer has hung up entirely (checked every
  :data:`HANGUP_CHECK_S` while they wait; a peer that only shut its sending side still
  gets every answer);
- payloads are never buffered: a library sent as bytes streams from its file
  (``sendfile``), and descriptors pass with SCM_RIGHTS;
- decoded ``get`` frames are remembered (:class:`DecodedFrameCache`): at most
  :attr:`DecodedFrameCache.MOST` frames of at most :attr:`DecodedFrameCache.LONGEST` bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import re
import select
import socket
import struct
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from cached_client import protocol as p
from cached_client.errors import (
    CachedError,
    DeadlineExceeded,
    InternalError,
    InvalidArgument,
    MalformedFrame,
    NotAllowed,
    Overloaded,
    UnsupportedVersion,
)

from . import trust
from .log import event, request_pid, request_uid
from .stats import Stats

log = logging.getLogger("cached.server")

MAX_INFLIGHT_PER_CONNECTION = 64
"""Requests of one connection answered at once; the next is read when one is answered."""
MAX_UNSENT_PER_CONNECTION = 64 << 10
"""Reply bytes of one connection waiting for the peer to read them before reading stops."""
SMALL_FRAME = 4 << 10
"""Request frames up to this size need no reserved room (a ``get`` is about 600 bytes)."""
MAX_FRAME_BYTES_PER_UID = 16 << 20
MAX_FRAME_BYTES = 64 << 20
FRAME_TIMEOUT_S = 30.0
REFUSAL_READ_S = 2.0
MAX_REFUSING = 64
"""Refused connections whose first request is read (to echo its id) at once."""
LOG_EVERY_S = 10.0
DROPPED_WHEN_GONE = frozenset({"plan"})
"""Ops whose requests are cancelled when their peer hangs up (nothing else depends on
them finishing; a ``get``'s compilation is shared and goes on anyway)."""
HANGUP_CHECK_S = 0.5


@dataclass(frozen=True)
class Peer:
    """The connecting process, from SO_PEERCRED."""

    pid: int
    uid: int
    gid: int


@dataclass(frozen=True)
class Limits:
    """Per-peer limits an operator may change (cached/config.py: max_connections,
    max_connections_per_uid, idle_timeout; SIGHUP applies them to new connections)."""

    max_connections: int = 1024
    max_connections_per_uid: int = 128
    idle_timeout: float = 600.0

    @classmethod
    def from_settings(cls, settings: Any) -> Limits:
        return cls(settings.max_connections, settings.max_connections_per_uid,
                   settings.idle_timeout)


class Access:
    """Who may connect, who may publish, and whose written-back objects each peer is served.
    Empty ``allow_*`` sets admit every peer the socket's file mode admits; an empty
    ``publish_uids`` means root and the daemon's own uid. ``trust_groups``: sets of uids
    whose written-back objects are served to each other (cached/trust.py; a uid in none is
    a group alone); ``writeback``: False refuses lease and publish. One instance is shared
    by every component that checks a peer; :meth:`update` changes it in place (SIGHUP)."""

    def __init__(self, allow_uids: Iterable[int] = (), allow_gids: Iterable[int] = (),
                 publish_uids: Iterable[int] = (), publish_gids: Iterable[int] = (),
                 trust_groups: Iterable[Iterable[int]] = (), writeback: bool = True) -> None:
        self.update(allow_uids, allow_gids, publish_uids, publish_gids, trust_groups,
                    writeback)

    @classmethod
    def from_settings(cls, settings: Any) -> Access:
        return cls(settings.allow_uid, settings.allow_gid, settings.publish_uid,
                   settings.publish_gid, settings.trust_group, settings.writeback)

    def update(self, allow_uids: Iterable[int] = (), allow_gids: Iterable[int] = (),
               publish_uids: Iterable[int] = (), publish_gids: Iterable[int] = (),
               trust_groups: Iterable[Iterable[int]] = (), writeback: bool = True) -> None:
        self.allow_uids = frozenset(allow_uids)
        self.allow_gids = frozenset(allow_gids)
        self.publish_uids = frozenset(publish_uids) or frozenset({0, os.getuid()})
        self.publish_gids = frozenset(publish_gids)
        self.writeback = writeback
        self._trusted = frozenset({0, os.getuid()})
        self._groups = {uid: trust.group_name(group) for group in map(tuple, trust_groups)
                        for uid in group}

    def may_connect(self, peer: Peer) -> bool:
        if not self.allow_uids and not self.allow_gids:
            return True
        return peer.uid in self.allow_uids or peer.gid in self.allow_gids

    def may_publish(self, peer: Peer) -> bool:
        return peer.uid in self.publish_uids or peer.gid in self.publish_gids

    def group(self, peer: Peer) -> str | None:
        """``peer``'s trust group: None for root and the daemon's own uid (trusted: what
        they write back is served to every peer, and they are served only trusted
        objects), else its configured group or its uid alone."""
        if peer.uid in self._trusted:
            return None
        group = self._groups.get(peer.uid)
        if group is None:
            group = self._groups[peer.uid] = trust.group_name((peer.uid,))
        return group


@dataclass
class Attachment:
    """What goes with a reply besides its frame: descriptors passed with SCM_RIGHTS
    (``fds``, in the order the reply names them), or a file sent as the reply's payload
    (``payload_fd``: ``payload_size`` bytes from offset 0, announced as ``payload_size``).
    The server owns the descriptors once a handler returns them and closes them when they
    are sent or the connection is gone."""

    fds: list[int] = field(default_factory=list)
    payload_fd: int | None = None
    payload_size: int = 0

    def close(self) -> None:
        for fd in [*self.fds, *([] if self.payload_fd is None else [self.payload_fd])]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds, self.payload_fd = [], None


Reply = p.Message | tuple[p.Message, Attachment]
Handler = Callable[[Any, Peer], Awaitable[Reply]]
"""An op's handler: (decoded request, peer) -> reply, or (reply, attachment)."""


class FrameBudget:
    """Room for request frames over :data:`SMALL_FRAME`: per uid and in all. A uid that holds
    nothing always gets room for one frame (a frame is at most 1 MiB). Waiters are granted
    room in arrival order as it is freed, each only when it fits; a release wakes only the
    waiters it grants (a flood of waiting frames is not woken all at once)."""

    def __init__(self, per_uid: int = MAX_FRAME_BYTES_PER_UID, total: int = MAX_FRAME_BYTES
                 ) -> None:
        self.per_uid, self.total = per_uid, total
        self.used = 0
        self.by_uid: Counter[int] = Counter()
        self._waiters: dict[asyncio.Future, tuple[int, int]] = {}  # in arrival order

    def _fits(self, uid: int, n: int) -> bool:
        mine = self.by_uid[uid]
        return (mine == 0 or mine + n <= self.per_uid) and (
            self.used == 0 or self.used + n <= self.total or mine == 0)

    def _hold(self, uid: int, n: int) -> None:
        self.used += n
        self.by_uid[uid] += n

    async def reserve(self, uid: int, n: int, deadline: float) -> bool:
        """Hold ``n`` bytes for ``uid``; False if no room came before ``deadline``
        (loop time). Room granted is the caller's to release, whatever happens after."""
        if self._fits(uid, n):
            self._hold(uid, n)
            return True
        granted = asyncio.get_running_loop().create_future()
        self._waiters[granted] = (uid, n)
        try:
            async with asyncio.timeout_at(deadline):
                await granted
            return True
        except TimeoutError:
            return granted.done() and not granted.cancelled()  # granted as time ran out
        except BaseException:  # cancelled (the connection went): give back what came
            if granted.done() and not granted.cancelled():
                self.release(uid, n)
            raise
        finally:
            self._waiters.pop(granted, None)

    def release(self, uid: int, n: int) -> None:
        if n:
            self.used -= n
            self.by_uid[uid] -= n
            if not self.by_uid[uid]:
                del self.by_uid[uid]
            self._grant()

    def _grant(self) -> None:
        for granted, (uid, n) in list(self._waiters.items()):
            if not granted.done() and self._fits(uid, n):
                self._hold(uid, n)
                granted.set_result(True)
                del self._waiters[granted]


class DecodedFrameCache:
    """Decoded requests of the ops that ask for it (:attr:`cached_client.protocol.Op.remember`),
    by their frame's bytes after a leading integer id (``{"id":N,``: cached_client writes
    every frame so, its keys sorted): a client asking again for what it asked before is
    neither parsed nor checked again. Exact: a frame hits only when every byte but the id's
    digits is that of a frame that was decoded, passed its op's checks, and holds no other
    ``"id"`` (so N is its id). Each remembered frame is at most :attr:`LONGEST` bytes, at
    most :attr:`MOST` are held (when full it starts over); a remembered request is shared
    by every frame that hits it (messages are frozen). The peer's rights are still checked
    on every request."""

    MOST = 2048
    LONGEST = 2048

    def __init__(self) -> None:
        self._decoded: dict[bytes, tuple[p.Op, p.Message]] = {}

    def recall(self, body: bytes | bytearray) -> tuple[int, p.Op, p.Message] | None:
        """(id, op, request) of a frame remembered but for its id; None if not one."""
        leading = _LEADING_ID.match(body)
        if leading is None:
            return None
        hit = self._decoded.get(bytes(body[leading.end():]))
        return None if hit is None else (int(leading[1]), *hit)

    def remember(self, body: bytes, message: dict, op: p.Op, request: p.Message) -> None:
        """Remember ``request``, decoded from ``body`` (parsed as ``message``), if its frame
        has the form that :meth:`recall` can tell apart."""
        leading = _LEADING_ID.match(body)
        if (leading is None or len(body) > self.LONGEST
                or type(message.get("id")) is not int or message["id"] != int(leading[1])):
            return
        rest = body[leading.end():]
        try:  # a second "id" further on would be the frame's id, whatever the first says
            if "id" in json.loads(b"{" + rest):
                return
        except (ValueError, RecursionError):
            return
        if len(self._decoded) >= self.MOST:
            self._decoded.clear()
        self._decoded[rest] = (op, request)

    def __len__(self) -> int:
        return len(self._decoded)


_LEADING_ID = re.compile(rb'\{"id":(0|[1-9][0-9]{0,15}),')


@dataclass(slots=True)
class _Frame:
    """One request frame: its parsed object (only ``id`` and ``op`` when remembered), its
    remembered (op, request), its bytes while its request may be remembered, and whether
    its JSON escapes a UTF-16 surrogate (its strings are checked to be text)."""

    message: dict
    decoded: tuple[p.Op, p.Message] | None = None
    body: bytes | None = None
    surrogates: bool = False


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _check_text(value: Any, where: str = "request") -> None:
    """InvalidArgument naming the first string (or key) of ``value`` that is no text: one
    holding a lone UTF-16 surrogate (an escape ``\\ud800``-``\\udfff`` not in a pair)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgument(f"{where[:200]} holds a lone UTF-16 surrogate (a \\ud800-"
                                  "\\udfff escape not in a pair): it is not text; nothing was "
                                  "done") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, f"a key of {where}")
            _check_text(item, f"{where}.{key}" if key.isascii() else where)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_text(item, f"{where}[{i}]")


class _Connection:
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


class _Closed(Exception):
    """The peer shut its sending side (or vanished) before a frame was whole."""


class Server:
    def __init__(self, handlers: dict[str, Handler], access: Access, stats: Stats,
                 limits: Limits | None = None) -> None:
        missing = sorted(set(p.OPS) - set(handlers))
        extra = sorted(set(handlers) - set(p.OPS))
        if missing or extra:
            raise InternalError(f"ops without a handler: {missing}; handlers without an op "
                                f"in protocol.OPS: {extra}")
        self.handlers = handlers
        self.access = access
        self.stats = stats
        self.limits = limits or Limits()
        self.connections = 0
        self.by_uid: Counter[int] = Counter()
        self.frame_budget = FrameBudget()
        self.decoded_frames = DecodedFrameCache()
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._open: set[_Connection] = set()
        self._sweeper: asyncio.Task | None = None
        self._refusing = 0
        self._logged: dict[tuple[str, int], float] = {}

    async def start(self, sock: socket.socket) -> None:
        """Accept connections on the listening socket ``sock`` (listeners.UnixListener)."""
        sock.setblocking(False)
        self._listener = sock
        loop = asyncio.get_running_loop()
        self._accepting = loop.create_task(self._accept_loop())
        self._sweeper = loop.create_task(self._sweep())

    async def stop(self) -> None:
        """Stop accepting; connected clients keep their connections."""
        for task in (self._accepting, self._sweeper):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._accepting = None
        if self._listener is not None:
            self._listener.close()

    # -- connections -----------------------------------------------------------------------

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            try:
                sock, _ = await loop.sock_accept(self._listener)
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                continue
            except OSError as exc:  # out of descriptors or memory: wait, do not spin
                if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    raise
                self._log_sometimes(("accept", 0), "server.accept_failed", error=str(exc))
                await asyncio.sleep(0.1)
                continue
            sock.setblocking(False)
            task = loop.create_task(self._serve(sock))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _sweep(self) -> None:
        """Close idle connections (nothing in flight, no byte for idle_timeout) and those
        whose peer has read none of a reply for idle_timeout: their sockets are shut down,
        so their reader sees the end and their writers fail at once. One pass every
        quarter of idle_timeout (at most 5 s) costs no timer per request."""
        while True:
            idle = self.limits.idle_timeout
            await asyncio.sleep(min(idle / 4, 5.0))
            now = time.monotonic()
            for c in list(self._open):
                stalled = c.blocked_since is not None and now - c.blocked_since >= idle
                silent = (c.inflight == 0 and not c.in_frame
                          and now - c.last_active >= idle)
                if stalled or silent:
                    self.stats.count("connections_write_timeout" if stalled
                                     else "connections_idle_closed")
                    with contextlib.suppress(OSError):
                        c.sock.shutdown(socket.SHUT_RDWR)

    def _admission(self, peer: Peer) -> CachedError | None:
        if not self.access.may_connect(peer):
            return NotAllowed(f"uid {peer.uid} gid {peer.gid} is not allowed to use this "
                              "daemon")
        limits = self.limits
        if self.connections >= limits.max_connections:
            return Overloaded(f"the daemon has {self.connections} connections open, its limit "
                              "(max_connections); retry later")
        if self.by_uid[peer.uid] >= limits.max_connections_per_uid:
            return Overloaded(f"uid {peer.uid} has {self.by_uid[peer.uid]} connections open to "
                              "this daemon, its limit (max_connections_per_uid); close some")
        return None

    async def _serve(self, sock: socket.socket) -> None:
        try:
            peer = _peer(sock)
        except OSError:
            sock.close()
            return
        refusal = self._admission(peer)
        if refusal is not None:
            try:
                await self._refuse(sock, peer, refusal)
            finally:
                _discard_input(sock, 64 << 10)
                sock.close()
            return
        self.connections += 1
        self.by_uid[peer.uid] += 1
        c = _Connection(sock, peer)
        self._open.add(c)
        try:
            await self._read_requests(c)
            while c.tasks:  # the peer stopped sending; it may still read its answers
                if c.droppable and c.drop_if_gone():
                    await asyncio.wait(set(c.tasks))
                    break
                await asyncio.wait(set(c.tasks), timeout=HANGUP_CHECK_S)
        except OSError:
            pass
        finally:
            c.unwatch()
            self._open.discard(c)
            for task in c.tasks:
                task.cancel()
            self.connections -= 1
            self.by_uid[peer.uid] -= 1
            if not self.by_uid[peer.uid]:
                del self.by_uid[peer.uid]
            _discard_input(sock)
            sock.close()

    async def _refuse(self, sock: socket.socket, peer: Peer, error: CachedError) -> None:
        """Answer the first request of a refused connection with ``error`` (echoing its id
        when it is small and comes at once), then close."""
        self.stats.count(f"errors.{error.code}")
        if isinstance(error, NotAllowed):
            event(log, logging.WARNING, "connection.refused", uid=peer.uid, gid=peer.gid,
                  pid=peer.pid)
        else:
            self._log_sometimes(("limit", peer.uid), "connection.over_limit", uid=peer.uid,
                                pid=peer.pid, reason=error.message)
        reply = _error(error)
        loop = asyncio.get_running_loop()
        if self._refusing < MAX_REFUSING:
            self._refusing += 1
            try:
                deadline = loop.time() + REFUSAL_READ_S
                header = await _read_exact(sock, p.HEADER.size, deadline,
                                           lambda: _readable(loop, sock))
                size = p.frame_length(header, SMALL_FRAME)
                body = await _read_exact(sock, size, deadline, lambda: _readable(loop, sock))
                reply["id"] = p.decode_body(body).get("id")
            except (_Closed, TimeoutError, CachedError, OSError):
                pass
            finally:
                self._refusing -= 1
        with contextlib.suppress(OSError, TimeoutError):
            async with asyncio.timeout(REFUSAL_READ_S):
                await loop.sock_sendall(sock, p.encode_frame(reply))

    async def _read_requests(self, c: _Connection) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while (c.inflight >= MAX_INFLIGHT_PER_CONNECTION
                   or c.unsent > MAX_UNSENT_PER_CONNECTION):
                c.changed.clear()  # back-pressure: nothing more is read until it moves
                try:
                    await asyncio.wait_for(c.changed.wait(), HANGUP_CHECK_S)
                except TimeoutError:
                    if c.droppable and c.drop_if_gone():
                        return
            start = await self._frame_start(c)
            if not start:
                return
            frame_timeout = min(FRAME_TIMEOUT_S, self.limits.idle_timeout)
            deadline = loop.time() + frame_timeout
            reserved = 0
            c.in_frame = True
            try:
                header = start if len(start) == p.HEADER.size else start + await _read_exact(
                    c.sock, p.HEADER.size - len(start), deadline, c.readable)
                size = p.frame_length(header, p.MAX_REQUEST_FRAME)
                if size > SMALL_FRAME:
                    if not await self.frame_budget.reserve(c.peer.uid, size, deadline):
                        raise Overloaded(
                            f"no room for a {size}-byte request frame within "
                            f"{frame_timeout:g}s (uid {c.peer.uid} holds "
                            f"{self.frame_budget.by_uid[c.peer.uid]} bytes of frames, the daemon "
                            f"{self.frame_budget.used}); closing this connection")
                    reserved = size
                body = await _read_exact(c.sock, size, deadline, c.readable)
                c.in_frame = False
                frame = self._parse(body)
                del body
            except _Closed:  # a frame cut short: the requests before it, then why
                self.frame_budget.release(c.peer.uid, reserved)
                await self._last_word(c, MalformedFrame(
                    "the connection's sending side closed in the middle of a frame (a "
                    "frame is a 4-byte big-endian length, then that many bytes of JSON)"))
                return
            except TimeoutError:
                self.frame_budget.release(c.peer.uid, reserved)
                await self._last_word(c, DeadlineExceeded(
                    f"a request frame must arrive whole within {frame_timeout:g}s of its "
                    "first byte; closing this connection"))
                return
            except CachedError as exc:  # malformed or oversize frame, no room
                self.frame_budget.release(c.peer.uid, reserved)
                await self._last_word(c, exc)
                return
            unknown = _unknown_op(frame)
            if unknown is not None:  # docs/protocol.md: malformed_frame, then close
                self.frame_budget.release(c.peer.uid, reserved)
                await self._last_word(c, unknown, frame.message.get("id"))
                return
            c.last_active = time.monotonic()
            c.inflight += 1
            task = loop.create_task(self._answer(frame, c, reserved))
            c.tasks.add(task)
            task.add_done_callback(c.tasks.discard)
            if _op_name(frame) in DROPPED_WHEN_GONE:
                c.droppable.add(task)
                task.add_done_callback(c.droppable.discard)

    def _parse(self, body: bytearray) -> _Frame:
        """A frame's request: remembered (:class:`DecodedFrameCache`), else parsed (MalformedFrame
        if it is no JSON object of bounded depth)."""
        recalled = self.decoded_frames.recall(body)
        if recalled is not None:
            request_id, op, request = recalled
            return _Frame({"id": request_id, "op": op.name}, (op, request))
        return _Frame(p.decode_body(body), None,
                      bytes(body) if len(body) <= DecodedFrameCache.LONGEST else None,
                      _SURROGATE_ESCAPE.search(body) is not None)

    async def _frame_start(self, c: _Connection) -> bytes:
        """The first bytes (1 to 4) of the next frame's header, whenever they come (the
        sweeper closes connections idle too long); empty when the peer shut its sending side
        (or the sweeper shut the connection)."""
        while True:
            try:  # a pipelining peer's next frame is usually there already
                return c.sock.recv(p.HEADER.size)
            except BlockingIOError:
                pass
            except OSError:
                return b""
            await c.readable()

    async def _last_word(self, c: _Connection, error: CachedError,
                         request_id: Any = None) -> None:
        """A frame that ends the connection: answer the requests before it, then say why
        (echoing ``request_id`` when the frame had one)."""
        self.stats.count(f"errors.{error.code}")
        if c.tasks:  # well-formed requests before it still get their answers
            await asyncio.wait(set(c.tasks))
        reply = {"ok": False, "error": error.to_wire()}
        if request_id is not None:
            reply["id"] = request_id
        with contextlib.suppress(OSError, TypeError, ValueError):
            await self._write(c, p.encode_frame(reply), None)

    async def _answer(self, request: _Frame, c: _Connection, reserved: int) -> None:
        attachment: Attachment | None = None
        frame = b""
        try:
            frame, attachment = await self._reply(request, c.peer)
            c.unsent += len(frame)
            await self._write(c, frame, attachment)
        except OSError:  # the peer is gone
            pass
        finally:
            if attachment is not None:
                attachment.close()
            self.frame_budget.release(c.peer.uid, reserved)
            c.unsent -= len(frame)
            c.inflight -= 1
            c.last_active = time.monotonic()
            c.changed.set()

    async def _reply(self, request: _Frame, peer: Peer) -> tuple[bytes, Attachment | None]:
        """The encoded reply frame to ``request`` and what goes with it."""
        message = request.message
        attachment = None
        try:
            reply_message = await self._handle(request, peer)
            if isinstance(reply_message, tuple):
                reply_message, attachment = reply_message
            reply = {"ok": True, **reply_message.to_wire()}
            if attachment is not None and attachment.payload_fd is not None:
                reply["payload_size"] = attachment.payload_size
        except CachedError as exc:
            self.stats.count(f"errors.{exc.code}")
            reply = _error(exc)
        except Exception as exc:  # noqa: BLE001 -- a bug answers, it does not kill the daemon
            reply = self._crashed(message, exc)
        if "id" in message:
            reply["id"] = message["id"]
        try:
            frame = p.encode_frame(reply)
        except (TypeError, ValueError) as exc:  # NaN, infinity, an unencodable value: a bug
            reply = self._crashed(message, exc)
            with contextlib.suppress(TypeError, ValueError):
                p.encode_frame({"id": message.get("id")})
                reply["id"] = message.get("id")
            frame = p.encode_frame(reply)
        if not reply["ok"] and attachment is not None:
            attachment.close()
            attachment = None
        return frame, attachment

    def _crashed(self, message: dict, exc: Exception) -> dict:
        event(log, logging.ERROR, "request.crashed", op=str(message.get("op"))[:32],
              error=f"{type(exc).__name__}: {exc}"[:500])
        self.stats.count("errors.internal")
        return _error(InternalError(f"internal error: {type(exc).__name__}: {exc}"))

    async def _write(self, c: _Connection, frame: bytes, attachment: Attachment | None
                     ) -> None:
        """One reply, whole. While the peer reads none of it, ``blocked_since`` says since
        when (the sweeper shuts the connection after idle_timeout)."""
        loop = asyncio.get_running_loop()
        async with c.write_lock:
            try:
                if attachment is not None and attachment.fds:
                    await _sendmsg_all(loop, c, frame, attachment.fds)
                else:
                    await _sendall(loop, c, frame)
                if attachment is not None and attachment.payload_fd is not None:
                    await _sendfile_all(loop, c, attachment.payload_fd,
                                        attachment.payload_size)
            finally:
                c.blocked_since = None
        c.last_active = time.monotonic()

    async def _handle(self, frame: _Frame, peer: Peer) -> Reply:
        if frame.decoded is not None:
            op, request = frame.decoded
        else:
            m = frame.message
            version = m.get("v", p.PROTOCOL_VERSION)
            if not _is_version(version):
                raise UnsupportedVersion(
                    f"protocol version {str(version)[:16]!r} is not supported; this daemon "
                    f"speaks {', '.join(map(str, p.SUPPORTED_VERSIONS))}")
            name = m.get("op")
            op = p.OPS.get(name) if isinstance(name, str) else None
            if op is None:
                raise MalformedFrame(f"unknown op {str(name)[:64]!r}; expected one of "
                                     f"{', '.join(p.OPS)}")
            request = None
        if op.publish and not self.access.may_publish(peer):
            raise NotAllowed(f"uid {peer.uid} gid {peer.gid} may not use {op.name!r}; the "
                             "daemon's --publish-uid/--publish-gid lists who may")
        if request is None:
            if frame.surrogates:
                _check_text({k: v for k, v in m.items() if k not in ("id", "op", "v")})
            request = op.request.from_wire(m)
            if op.remember and frame.body is not None:
                self.decoded_frames.remember(frame.body, m, op, request)
        request_pid.set(peer.pid)
        request_uid.set(peer.uid)
        return await self.handlers[op.name](request, peer)

    def _log_sometimes(self, what: tuple[str, int], name: str, **fields: Any) -> None:
        """Log ``name`` at most once every LOG_EVERY_S per ``what`` (a flood logs little)."""
        now = time.monotonic()
        if now - self._logged.get(what, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._logged[what] = now
            event(log, logging.WARNING, name, **fields)


def _is_version(value: Any) -> bool:
    """Whether ``value`` is a protocol version this daemon speaks: a JSON integer (``true``
    and ``1.0`` equal 1 in Python but are not version 1)."""
    return type(value) is int and value in p.SUPPORTED_VERSIONS


def _op_name(frame: _Frame) -> Any:
    return frame.decoded[0].name if frame.decoded is not None else frame.message.get("op")


def _unknown_op(frame: _Frame) -> MalformedFrame | None:
    """The error for a frame of a supported version whose ``op`` is none of ``p.OPS``
    (a frame of another version is answered ``unsupported_version`` instead)."""
    if frame.decoded is not None:
        return None
    m = frame.message
    name = m.get("op")
    if not _is_version(m.get("v", p.PROTOCOL_VERSION)) or (
            isinstance(name, str) and name in p.OPS):
        return None
    return MalformedFrame(f"unknown op {str(name)[:64]!r}; expected one of {', '.join(p.OPS)}"
                          "; closing this connection")


def _peer(sock: socket.socket) -> Peer:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return Peer(*struct.unpack("3i", creds))


def _error(exc: CachedError) -> dict:
    return {"ok": False, "error": exc.to_wire()}


def _discard_input(sock: socket.socket, limit: int = 1 << 20) -> None:
    """Read and drop what the peer sent and nobody will read (up to ``limit`` bytes): closing
    a Unix socket with unread input resets the connection, and the peer would lose the
    replies it has not read yet."""
    with contextlib.suppress(OSError):
        while limit > 0:
            data = sock.recv(min(limit, 64 << 10))
            if not data:
                return
            limit -= len(data)


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    future = loop.create_future()
    fd = sock.fileno()
    loop.add_reader(fd, lambda: future.done() or future.set_result(None))
    try:
        await future
    finally:
        loop.remove_reader(fd)


async def _writable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    future = loop.create_future()
    fd = sock.fileno()
    loop.add_writer(fd, lambda: future.done() or future.set_result(None))
    try:
        await future
    finally:
        loop.remove_writer(fd)


async def _read_exact(sock: socket.socket, size: int, deadline: float,
                      readable: Callable[[], Awaitable[None]]) -> bytearray:
    """``size`` bytes by ``deadline`` (loop time): TimeoutError, or _Closed at end of input.
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
            raise _Closed() from None
        if n == 0:
            raise _Closed()
        got += n
    return buffer


async def _until_writable(loop: asyncio.AbstractEventLoop, c: _Connection) -> None:
    if c.blocked_since is None:
        c.blocked_since = time.monotonic()
    await _writable(loop, c.sock)


async def _sendall(loop: asyncio.AbstractEventLoop, c: _Connection, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[c.sock.send(view):]
        except BlockingIOError:
            await _until_writable(loop, c)


async def _sendmsg_all(loop: asyncio.AbstractEventLoop, c: _Connection, data: bytes,
                       fds: list[int]) -> None:
    """``data`` with ``fds`` attached to its first byte (SCM_RIGHTS), then the rest."""
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))]
    while True:
        try:
            sent = c.sock.sendmsg([data], ancillary)
            break
        except BlockingIOError:
            await _until_writable(loop, c)
    if sent < len(data):
        await _sendall(loop, c, memoryview(data)[sent:])


async def _sendfile_all(loop: asyncio.AbstractEventLoop, c: _Connection, fd: int,
                        size: int) -> None:
    """Bytes ``[0, size)`` of the file ``fd``, straight from the page cache."""
    offset = 0
    while offset < size:
        try:
            sent = os.sendfile(c.sock.fileno(), fd, offset, size - offset)
        except BlockingIOError:
            await _until_writable(loop, c)
            continue
        if sent == 0:
            raise OSError(errno.EIO, "the payload file ended early")
        offset += sent
