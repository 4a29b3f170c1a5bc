"""The Unix-socket server: frames in, one typed request per frame, the op's handler, frames out.

The wire surface is :data:`cached_client.protocol.OPS`; the server is built with one
handler per op (each component declares its own with ``ops()``) and refuses to start if
an op has no handler or a handler no op. A request is decoded once, here: a field that
fails its check is ``invalid_argument`` before any component sees it.

Invariants: each connection is its own task and each request on it its own sub-task, so a
slow or hostile client costs only itself; replies on one connection are written whole, one
at a time; every well-formed request gets its reply, also after the peer has shut its
sending side; a malformed or oversize frame gets an error reply and closes that connection
only; any other failure of a request becomes a typed error reply, ``internal`` only for a
daemon bug.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from cached_client import protocol as p
from cached_client.errors import (
    CachedError,
    InternalError,
    MalformedFrame,
    NotAllowed,
    Overloaded,
    UnsupportedVersion,
)
from cached_client.paths import check_socket_dir, default_socket_path

from .log import event
from .stats import Stats

log = logging.getLogger("cached.server")

MAX_PENDING_PER_CONNECTION = 4096


@dataclass(frozen=True)
class Peer:
    """The connecting process, from SO_PEERCRED."""

    pid: int
    uid: int
    gid: int


class Access:
    """Who may connect and who may publish. Empty ``allow_*`` sets admit every peer the
    socket's file mode admits; an empty ``publish_uids`` means root and the daemon's own
    uid. One instance is shared by every component that checks a peer; :meth:`update`
    changes it in place (SIGHUP)."""

    def __init__(self, allow_uids: Iterable[int] = (), allow_gids: Iterable[int] = (),
                 publish_uids: Iterable[int] = (), publish_gids: Iterable[int] = ()) -> None:
        self.update(allow_uids, allow_gids, publish_uids, publish_gids)

    @classmethod
    def from_settings(cls, settings: Any) -> Access:
        return cls(settings.allow_uid, settings.allow_gid, settings.publish_uid,
                   settings.publish_gid)

    def update(self, allow_uids: Iterable[int] = (), allow_gids: Iterable[int] = (),
               publish_uids: Iterable[int] = (), publish_gids: Iterable[int] = ()) -> None:
        self.allow_uids = frozenset(allow_uids)
        self.allow_gids = frozenset(allow_gids)
        self.publish_uids = frozenset(publish_uids) or frozenset({0, os.getuid()})
        self.publish_gids = frozenset(publish_gids)

    def may_connect(self, peer: Peer) -> bool:
        if not self.allow_uids and not self.allow_gids:
            return True
        return peer.uid in self.allow_uids or peer.gid in self.allow_gids

    def may_publish(self, peer: Peer) -> bool:
        return peer.uid in self.publish_uids or peer.gid in self.publish_gids


Reply = p.Message | tuple[p.Message, bytes]
Handler = Callable[[Any, Peer], Awaitable[Reply]]
"""An op's handler: (decoded request, peer) -> reply, or (reply, payload bytes)."""


class Server:
    def __init__(self, handlers: dict[str, Handler], access: Access, stats: Stats) -> None:
        missing = sorted(set(p.OPS) - set(handlers))
        extra = sorted(set(handlers) - set(p.OPS))
        if missing or extra:
            raise InternalError(f"ops without a handler: {missing}; handlers without an op "
                                f"in protocol.OPS: {extra}")
        self.handlers = handlers
        self.access = access
        self.stats = stats
        self.connections = 0
        self._server: asyncio.AbstractServer | None = None

    async def start(self, path: str | None = None, sock: socket.socket | None = None,
                    mode: int = 0o660) -> None:
        """Listen on ``path`` (replacing a stale socket file) or on an inherited socket."""
        if sock is None:
            assert path is not None
            _claim_socket_path(path)
            self._server = await asyncio.start_unix_server(self._connection, path=path,
                                                           limit=p.MAX_REQUEST_FRAME + 1024)
            os.chmod(path, mode)
        else:
            self._server = await asyncio.start_unix_server(self._connection, sock=sock,
                                                           limit=p.MAX_REQUEST_FRAME + 1024)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        write_lock = asyncio.Lock()
        pending: set[asyncio.Task] = set()
        peer = _peer(writer)
        try:
            if not self.access.may_connect(peer):
                await self._refuse(peer, reader, writer)
                return
            while True:
                try:
                    header = await reader.readexactly(p.HEADER.size)
                    body = await reader.readexactly(p.frame_length(header,
                                                                   p.MAX_REQUEST_FRAME))
                    message = p.decode_body(body)
                except asyncio.IncompleteReadError:
                    break
                except MalformedFrame as exc:
                    self.stats.count("errors.malformed_frame")
                    if pending:  # well-formed requests before it still get their answers
                        await asyncio.wait(set(pending))
                    async with write_lock:
                        await _send(writer, {"ok": False, "error": exc.to_wire()})
                    break
                if len(pending) >= MAX_PENDING_PER_CONNECTION:
                    async with write_lock:
                        await _send(writer, _error(Overloaded(
                            f"over {MAX_PENDING_PER_CONNECTION} requests pending on this "
                            "connection; wait for replies before sending more")))
                    break
                task = asyncio.get_running_loop().create_task(
                    self._answer(message, peer, writer, write_lock))
                pending.add(task)
                task.add_done_callback(pending.discard)
            if pending:  # the peer stopped sending; it may still read its answers
                await asyncio.wait(set(pending))
        except (ConnectionError, OSError):
            pass
        finally:
            for task in pending:
                task.cancel()
            self.connections -= 1
            writer.close()

    async def _refuse(self, peer: Peer, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        self.stats.count("errors.not_allowed")
        event(log, logging.WARNING, "connection.refused", uid=peer.uid, gid=peer.gid,
              pid=peer.pid)
        reply = _error(NotAllowed(f"uid {peer.uid} gid {peer.gid} is not allowed to use this "
                                  "daemon"))
        with contextlib.suppress(Exception):
            header = await asyncio.wait_for(reader.readexactly(p.HEADER.size), 5)
            body = await asyncio.wait_for(
                reader.readexactly(p.frame_length(header, p.MAX_REQUEST_FRAME)), 5)
            reply["id"] = p.decode_body(body).get("id")
        await _send(writer, reply)

    async def _answer(self, message: dict, peer: Peer, writer: asyncio.StreamWriter,
                      write_lock: asyncio.Lock) -> None:
        payload = None
        try:
            reply_message = await self._handle(message, peer)
            if isinstance(reply_message, tuple):
                reply_message, payload = reply_message
            reply = {"ok": True, **reply_message.to_wire()}
        except CachedError as exc:
            self.stats.count(f"errors.{exc.code}")
            reply = _error(exc)
        except Exception as exc:  # noqa: BLE001 -- a bug answers, it does not kill the daemon
            event(log, logging.ERROR, "request.crashed", op=str(message.get("op"))[:32],
                  error=f"{type(exc).__name__}: {exc}"[:500])
            self.stats.count("errors.internal")
            reply = _error(InternalError(f"internal error: {type(exc).__name__}: {exc}"))
        if "id" in message:
            reply["id"] = message["id"]
        if payload is not None:
            reply["payload_size"] = len(payload)
        try:
            async with write_lock:
                await _send(writer, reply, payload)
        except (ConnectionError, OSError):
            pass

    async def _handle(self, m: dict, peer: Peer) -> Reply:
        version = m.get("v", p.PROTOCOL_VERSION)
        if version not in p.SUPPORTED_VERSIONS:
            raise UnsupportedVersion(
                f"protocol version {str(version)[:16]!r} is not supported; this daemon speaks "
                f"{', '.join(map(str, p.SUPPORTED_VERSIONS))}"
            )
        name = m.get("op")
        op = p.OPS.get(name) if isinstance(name, str) else None
        if op is None:
            raise MalformedFrame(f"unknown op {str(name)[:64]!r}; expected one of "
                                 f"{', '.join(p.OPS)}")
        if op.publish and not self.access.may_publish(peer):
            raise NotAllowed(f"uid {peer.uid} gid {peer.gid} may not use {op.name!r}; the "
                             "daemon's --publish-uid/--publish-gid lists who may")
        request = op.request.from_wire(m)
        return await self.handlers[op.name](request, peer)


def _peer(writer: asyncio.StreamWriter) -> Peer:
    sock = writer.get_extra_info("socket")
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return Peer(*struct.unpack("3i", creds))


def _error(exc: CachedError) -> dict:
    return {"ok": False, "error": exc.to_wire()}


async def _send(writer: asyncio.StreamWriter, reply: dict, payload: bytes | None = None) -> None:
    writer.write(p.encode_frame(reply))
    if payload is not None:
        writer.write(payload)
    await writer.drain()


def _claim_socket_path(path: str) -> None:
    """Remove a stale socket file; refuse if a live daemon still answers on it."""
    os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
    if path == default_socket_path() and (why := check_socket_dir(path)):
        raise RuntimeError(f"refusing to listen: {why}")
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError:
        os.unlink(path)
        return
    finally:
        probe.close()
    raise RuntimeError(f"another daemon is already serving on {path}; stop it or pick "
                       "another --socket")
