"""The Unix-socket server: frames in, scheduler calls, frames out (docs/protocol.md).

Invariants: each connection is its own task and each request on it its own sub-task,
so a slow or hostile client costs only itself; replies on one connection are written
whole, one at a time; every well-formed request gets its reply, also after the peer has
shut its sending side; a malformed or oversize frame gets an error reply and closes that
connection only; any other failure of a request becomes a typed error reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from cached_client.errors import (
    CachedError,
    InvalidTactic,
    MalformedFrame,
    NotAllowed,
    UnsupportedVersion,
)
from cached_client.paths import check_socket_dir, default_socket_path
from cached_client.protocol import (
    CAPABILITIES,
    HEADER,
    MAX_REQUEST_FRAME,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    decode_body,
    encode_frame,
    frame_length,
)

from . import families, toolchain
from .log import event
from .scheduler import PRIORITIES, Scheduler
from .store import Entry

log = logging.getLogger("cached.server")

MAX_PENDING_PER_CONNECTION = 4096
MAX_DEADLINE_S = 3600.0


@dataclass(frozen=True)
class Peer:
    """The connecting process, from SO_PEERCRED."""

    pid: int
    uid: int
    gid: int


@dataclass(frozen=True)
class Access:
    """Who may connect and who may publish. Empty ``allow_*`` sets admit every peer the
    socket's file mode admits; ``publish_*`` default to root and the daemon's own uid."""

    allow_uids: frozenset[int] = frozenset()
    allow_gids: frozenset[int] = frozenset()
    publish_uids: frozenset[int] = frozenset({0, os.getuid()})
    publish_gids: frozenset[int] = frozenset()

    def may_connect(self, peer: Peer) -> bool:
        if not self.allow_uids and not self.allow_gids:
            return True
        return peer.uid in self.allow_uids or peer.gid in self.allow_gids

    def may_publish(self, peer: Peer) -> bool:
        return peer.uid in self.publish_uids or peer.gid in self.publish_gids


Handler = Callable[[dict, Peer], Awaitable[tuple[dict, "bytes | None"]]]


class Server:
    def __init__(self, scheduler: Scheduler, stats_fn: Any, access: Access | None = None) -> None:
        self.scheduler = scheduler
        self.stats_fn = stats_fn
        self.access = access or Access()
        self.connections = 0
        self._server: asyncio.AbstractServer | None = None
        self.ops: dict[str, tuple[Handler, bool]] = {}
        for op, handler in (("hello", self._hello), ("get", self._get),
                            ("prefetch", self._prefetch), ("stats", self._stats),
                            ("list", self._list), ("plan", self._plan)):
            self.register(op, handler)

    async def start(self, path: str | None = None, sock: socket.socket | None = None,
                    mode: int = 0o660) -> None:
        """Listen on ``path`` (replacing a stale socket file) or on an inherited socket."""
        if sock is None:
            assert path is not None
            _claim_socket_path(path)
            self._server = await asyncio.start_unix_server(self._connection, path=path,
                                                           limit=MAX_REQUEST_FRAME + 1024)
            os.chmod(path, mode)
        else:
            self._server = await asyncio.start_unix_server(self._connection, sock=sock,
                                                           limit=MAX_REQUEST_FRAME + 1024)

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
                self.scheduler.stats.count("errors.not_allowed")
                event(log, logging.WARNING, "connection.refused", uid=peer.uid, gid=peer.gid,
                      pid=peer.pid)
                reply = {"ok": False, "error": NotAllowed(
                    f"uid {peer.uid} gid {peer.gid} is not allowed to use this daemon"
                ).to_wire()}
                with contextlib.suppress(Exception):
                    header = await asyncio.wait_for(reader.readexactly(HEADER.size), 5)
                    body = await asyncio.wait_for(
                        reader.readexactly(frame_length(header, MAX_REQUEST_FRAME)), 5)
                    reply["id"] = decode_body(body).get("id")
                await _send(writer, reply)
                return
            while True:
                try:
                    header = await reader.readexactly(HEADER.size)
                    body = await reader.readexactly(frame_length(header, MAX_REQUEST_FRAME))
                    message = decode_body(body)
                except asyncio.IncompleteReadError:
                    if pending:  # the peer stopped sending; it may still read its answers
                        await asyncio.wait(set(pending))
                    break
                except MalformedFrame as exc:
                    self.scheduler.stats.count("errors.malformed_frame")
                    async with write_lock:
                        await _send(writer, {"ok": False, "error": exc.to_wire()})
                    break
                if len(pending) >= MAX_PENDING_PER_CONNECTION:
                    async with write_lock:
                        await _send(writer, _error(CachedError(
                            "too many requests pending on this connection")))
                    break
                task = asyncio.get_running_loop().create_task(
                    self._answer(message, peer, writer, write_lock))
                pending.add(task)
                task.add_done_callback(pending.discard)
        except (ConnectionError, OSError):
            pass
        finally:
            for task in pending:
                task.cancel()
            self.connections -= 1
            writer.close()

    async def _answer(self, message: dict, peer: Peer, writer: asyncio.StreamWriter,
                      write_lock: asyncio.Lock) -> None:
        payload = None
        try:
            reply, payload = await self._handle(message, peer)
        except CachedError as exc:
            self.scheduler.stats.count(f"errors.{exc.code}")
            reply = _error(exc)
        except Exception as exc:  # noqa: BLE001 -- a bug answers, it does not kill the daemon
            event(log, logging.ERROR, "request.crashed", op=str(message.get("op"))[:32],
                  error=f"{type(exc).__name__}: {exc}")
            self.scheduler.stats.count("errors.internal")
            reply = _error(CachedError(f"internal error: {type(exc).__name__}: {exc}"))
        if "id" in message:
            reply["id"] = message["id"]
        if payload is not None:
            reply["payload_size"] = len(payload)
        try:
            async with write_lock:
                await _send(writer, reply, payload)
        except (ConnectionError, OSError):
            pass

    def register(self, op: str, handler: Handler, publish: bool = False) -> None:
        """Serve ``op`` with ``handler``; ``publish`` ops need a peer allowed to publish."""
        self.ops[op] = (handler, publish)

    async def _handle(self, m: dict, peer: Peer) -> tuple[dict, bytes | None]:
        version = m.get("v", PROTOCOL_VERSION)
        if version not in SUPPORTED_VERSIONS:
            raise UnsupportedVersion(
                f"protocol version {version!r} is not supported; this daemon speaks "
                f"{', '.join(map(str, SUPPORTED_VERSIONS))}"
            )
        op = m.get("op")
        entry = self.ops.get(op) if isinstance(op, str) else None
        if entry is None:
            raise MalformedFrame(f"unknown op {op!r}; expected one of {', '.join(self.ops)}")
        handler, publish = entry
        if publish and not self.access.may_publish(peer):
            raise NotAllowed(f"uid {peer.uid} gid {peer.gid} may not use {op!r}; the daemon's "
                             "--publish-uid/--publish-gid lists who may")
        return await handler(m, peer)

    async def _hello(self, m: dict, peer: Peer) -> tuple[dict, bytes | None]:
        return {"ok": True, "v": PROTOCOL_VERSION, "capabilities": list(CAPABILITIES),
                "ops": sorted(self.ops), "families": families.names(),
                "toolchain": self.scheduler.identity.toolchain,
                "versions": toolchain.versions(), "serve_only": self.scheduler.pool.size == 0,
                "runtime_library": toolchain.runtime_library(),
                "may_publish": self.access.may_publish(peer)}, None

    async def _prefetch(self, m: dict, peer: Peer) -> tuple[dict, bytes | None]:
        requests = m.get("requests")
        if not isinstance(requests, list):
            raise InvalidTactic("prefetch needs 'requests': a list of requests")
        return {"ok": True, **self.scheduler.prefetch(requests)}, None

    async def _stats(self, m: dict, peer: Peer) -> tuple[dict, bytes | None]:
        return {"ok": True, "stats": self.stats_fn()}, None

    async def _list(self, m: dict, peer: Peer) -> tuple[dict, bytes | None]:
        rows = [_public_row(r) for r in self.scheduler.store.rows()]
        return {"ok": True, "entries": rows}, None

    async def _plan(self, m: dict, peer: Peer) -> tuple[dict, bytes | None]:
        requests = await self.scheduler.plan(
            str(m.get("family")), m.get("shape"), str(m.get("arch")),
            _positive_int(m.get("sm_count")), _options(m.get("options")))
        return {"ok": True, "requests": requests}, None

    async def _get(self, m: dict, peer: Peer) -> tuple[dict, bytes | None]:
        priority = PRIORITIES.get(m.get("priority", "interactive"))
        if priority is None:
            raise InvalidTactic("priority must be 'interactive' or 'prewarm'")
        deadline_ms = m.get("deadline_ms", 60_000)
        if not isinstance(deadline_ms, (int, float)) or deadline_ms <= 0:
            raise InvalidTactic("deadline_ms must be a positive number")
        transfer = m.get("transfer", "path")
        if transfer not in ("path", "bytes"):
            raise InvalidTactic("transfer must be 'path' or 'bytes'")
        expected = m.get("toolchain")
        entry, origin = await self.scheduler.get(
            m.get("request"), priority, min(deadline_ms / 1000, MAX_DEADLINE_S),
            expected if isinstance(expected, str) else None)
        artifact = _artifact(entry, origin)
        if transfer == "bytes":
            return {"ok": True, "artifact": artifact}, self.scheduler.store.read_library(entry)
        artifact["library_path"] = str(entry.library_path)
        artifact["object_path"] = str(entry.object_path)
        return {"ok": True, "artifact": artifact}, None


def _artifact(entry: Entry, origin: str) -> dict:
    r = entry.row
    return {
        "key": r["key"], "family": r["family"], "kernel_name": r["kernel_name"],
        "symbol": r["symbol"], "library_sha256": r["library_sha256"],
        "object_sha256": r["object_sha256"], "library_size": r["library_size"],
        "object_size": r["object_size"], "toolchain": r["toolchain"],
        "source_sha256": r["source_sha256"], "runtime_library": toolchain.runtime_library(),
        "compile_seconds": r["compile_seconds"], "origin": origin,
    }


def _public_row(row: dict) -> dict:
    return {k: row[k] for k in ("key", "family", "kernel_name", "arch", "sm_count",
                                "max_active_clusters", "params", "size", "compile_seconds",
                                "created", "last_used", "hits")}


def _peer(writer: asyncio.StreamWriter) -> Peer:
    sock = writer.get_extra_info("socket")
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return Peer(*struct.unpack("3i", creds))


def _error(exc: CachedError) -> dict:
    return {"ok": False, "error": exc.to_wire()}


def _positive_int(value: Any) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidTactic(f"expected a positive integer, got {value!r}")
    return value


def _options(value: Any) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidTactic("options must be an object")
    return value


async def _send(writer: asyncio.StreamWriter, reply: dict, payload: bytes | None = None) -> None:
    writer.write(encode_frame(reply))
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
