"""The Unix-socket server: frames in, one typed request per frame, the op's handler, frames out.

Beside it: cached.peers (who asks, their rights, what a handler returns), cached.frames
(frame room, remembered decoded frames), cached.connection (a connection and its socket
I/O). The wire surface is :data:`cached_client.protocol.OPS`; the server has one handler
per op (each component declares its own with ``ops()``) and refuses to start if an op has
no handler or a handler no op. A request is decoded once, here: a field that fails its
check is ``invalid_argument`` before any component sees it.

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
- the requests of :data:`DROPPED_WHEN_GONE` ops (``plan``, ``plan_shape``) are
  cancelled, their queued jobs dropped, once their peer has hung up entirely (checked every
  :data:`HANGUP_CHECK_S` while they wait; a peer that only shut its sending side still
  gets every answer);
- payloads are never buffered: a library sent as bytes streams from its file
  (``sendfile``), and descriptors pass with SCM_RIGHTS; decoded ``get`` frames are
  remembered within cached.frames.DecodedFrameCache's bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import time
from collections import Counter
from typing import Any

from cached_client import protocol as p
from cached_client.errors import (
    CachedError,
    DeadlineExceeded,
    InternalError,
    MalformedFrame,
    NotAllowed,
    Overloaded,
    UnsupportedVersion,
)

from . import connection
from .frames import (  # noqa: F401 -- re-exported: the server's frame bounds
    MAX_FRAME_BYTES,
    MAX_FRAME_BYTES_PER_UID,
    SMALL_FRAME,
    SURROGATE_ESCAPE,
    DecodedFrameCache,
    Frame,
    FrameBudget,
    check_text,
)
from .log import event, request_pid, request_uid
from .peers import (  # noqa: F401 -- re-exported: what every op's component imports
    Access,
    Attachment,
    Handler,
    Limits,
    Peer,
    Reply,
    peer_of,
    served_ops,
)
from .stats import Stats

log = logging.getLogger("cached.server")

MAX_INFLIGHT_PER_CONNECTION = 64
"""Requests of one connection answered at once; the next is read when one is answered."""
MAX_UNSENT_PER_CONNECTION = 64 << 10
"""Reply bytes of one connection waiting for the peer to read them before reading stops."""
FRAME_TIMEOUT_S = 30.0
REFUSAL_READ_S = 2.0
MAX_REFUSING = 64
"""Refused connections whose first request is read (to echo its id) at once."""
LOG_EVERY_S = 10.0
DROPPED_WHEN_GONE = frozenset({"plan", "plan_shape"})
"""Ops whose requests are cancelled when their peer hangs up (nothing else depends on
them finishing; a ``get``'s compilation is shared and goes on anyway)."""
HANGUP_CHECK_S = 0.5


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
        self._open: set[connection.Connection] = set()
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
            peer = peer_of(sock)
        except OSError:
            sock.close()
            return
        refusal = self._admission(peer)
        if refusal is not None:
            try:
                await self._refuse(sock, peer, refusal)
            finally:
                connection.discard_input(sock, 64 << 10)
                sock.close()
            return
        self.connections += 1
        self.by_uid[peer.uid] += 1
        c = connection.Connection(sock, peer)
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
            connection.discard_input(sock)
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
                header = await connection.read_exact(
                    sock, p.HEADER.size, deadline, lambda: connection.readable(loop, sock))
                size = p.frame_length(header, SMALL_FRAME)
                body = await connection.read_exact(
                    sock, size, deadline, lambda: connection.readable(loop, sock))
                reply["id"] = p.decode_body(body).get("id")
            except (connection.Closed, TimeoutError, CachedError, OSError):
                pass
            finally:
                self._refusing -= 1
        with contextlib.suppress(OSError, TimeoutError):
            async with asyncio.timeout(REFUSAL_READ_S):
                await loop.sock_sendall(sock, p.encode_frame(reply))

    async def _read_requests(self, c: connection.Connection) -> None:
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
                header = start
                if len(start) < p.HEADER.size:
                    header += await connection.read_exact(
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
                body = await connection.read_exact(c.sock, size, deadline, c.readable)
                c.in_frame = False
                frame = self._parse(body)
                del body
            except connection.Closed:  # a frame cut short: the requests before it, then why
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

    def _parse(self, body: bytearray) -> Frame:
        """A frame's request: remembered (:class:`DecodedFrameCache`), else parsed (MalformedFrame
        if it is no JSON object of bounded depth)."""
        recalled = self.decoded_frames.recall(body)
        if recalled is not None:
            request_id, op, request = recalled
            return Frame({"id": request_id, "op": op.name}, (op, request))
        return Frame(p.decode_body(body), None,
                      bytes(body) if len(body) <= DecodedFrameCache.LONGEST else None,
                      SURROGATE_ESCAPE.search(body) is not None)

    async def _frame_start(self, c: connection.Connection) -> bytes:
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

    async def _last_word(self, c: connection.Connection, error: CachedError,
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

    async def _answer(self, request: Frame, c: connection.Connection, reserved: int) -> None:
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

    async def _reply(self, request: Frame, peer: Peer) -> tuple[bytes, Attachment | None]:
        """The encoded reply frame to ``request`` and what goes with it."""
        message = request.message
        attachment = None
        try:
            reply_message = await self._handle(request, peer)
            if isinstance(reply_message, tuple):
                reply_message, attachment = reply_message
                if (attachment.encoded is not None and attachment.payload_fd is None
                        and type(message.get("id")) is int):
                    return p.frame_after_id(message["id"], attachment.encoded), attachment
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

    async def _write(self, c: connection.Connection, frame: bytes, attachment: Attachment | None
                     ) -> None:
        """One reply, whole. While the peer reads none of it, ``blocked_since`` says since
        when (the sweeper shuts the connection after idle_timeout)."""
        loop = asyncio.get_running_loop()
        async with c.write_lock:
            try:
                if attachment is not None and attachment.fds:
                    await connection.sendmsg_all(loop, c, frame, attachment.fds)
                else:
                    await connection.sendall(loop, c, frame)
                if attachment is not None and attachment.payload_fd is not None:
                    await connection.sendfile_all(loop, c, attachment.payload_fd,
                                        attachment.payload_size)
            finally:
                c.blocked_since = None
        c.last_active = time.monotonic()

    async def _handle(self, frame: Frame, peer: Peer) -> Reply:
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
            op = served_ops().get(name) if isinstance(name, str) else None
            if op is None:
                raise MalformedFrame(f"unknown op {str(name)[:64]!r}; expected one of "
                                     f"{', '.join(served_ops())}")
            request = None
        if op.publish and not self.access.may_publish(peer):
            raise NotAllowed(f"uid {peer.uid} gid {peer.gid} may not use {op.name!r}; the "
                             "daemon's --publish-uid/--publish-gid lists who may")
        if request is None:
            if frame.surrogates:
                check_text({k: v for k, v in m.items() if k not in ("id", "op", "v")})
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


def _op_name(frame: Frame) -> Any:
    return frame.decoded[0].name if frame.decoded is not None else frame.message.get("op")


def _unknown_op(frame: Frame) -> MalformedFrame | None:
    """The error for a frame of a supported version whose ``op`` is none of ``p.OPS``
    (a frame of another version is answered ``unsupported_version`` instead)."""
    if frame.decoded is not None:
        return None
    m = frame.message
    name = m.get("op")
    if not _is_version(m.get("v", p.PROTOCOL_VERSION)) or (
            isinstance(name, str) and name in served_ops()):
        return None
    return MalformedFrame(f"unknown op {str(name)[:64]!r}; expected one of "
                          f"{', '.join(served_ops())}"
                          "; closing this connection")



def _error(exc: CachedError) -> dict:
    return {"ok": False, "error": exc.to_wire()}
