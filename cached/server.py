"""The Unix-socket server: frames in, scheduler calls, frames out (docs/protocol.md).

Invariants: each connection is its own task and each request on it its own sub-task,
so a slow or hostile client costs only itself; replies on one connection are written
whole, one at a time; a malformed or oversize frame gets an error reply and closes that
connection only; any other failure of a request becomes a typed error reply.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Any

from cached_client.errors import CachedError, InvalidTactic, MalformedFrame, UnsupportedVersion
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


class Server:
    def __init__(self, scheduler: Scheduler, stats_fn: Any) -> None:
        self.scheduler = scheduler
        self.stats_fn = stats_fn
        self.connections = 0
        self._server: asyncio.AbstractServer | None = None

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
        try:
            while True:
                try:
                    header = await reader.readexactly(HEADER.size)
                    body = await reader.readexactly(frame_length(header, MAX_REQUEST_FRAME))
                    message = decode_body(body)
                except asyncio.IncompleteReadError:
                    break
                except MalformedFrame as exc:
                    self.scheduler.stats.count("errors.malformed_frame")
                    async with write_lock:
                        await _send(writer, {"ok": False, "error": exc.to_wire()})
                    break
                if len(pending) >= MAX_PENDING_PER_CONNECTION:
                    async with write_lock:
                        await _send(writer, _error(message, CachedError(
                            "too many requests pending on this connection")))
                    break
                task = asyncio.get_running_loop().create_task(
                    self._answer(message, writer, write_lock))
                pending.add(task)
                task.add_done_callback(pending.discard)
        except (ConnectionError, OSError):
            pass
        finally:
            for task in pending:
                task.cancel()
            self.connections -= 1
            writer.close()

    async def _answer(self, message: dict, writer: asyncio.StreamWriter,
                      write_lock: asyncio.Lock) -> None:
        payload = None
        try:
            reply, payload = await self._handle(message)
        except CachedError as exc:
            self.scheduler.stats.count(f"errors.{exc.code}")
            reply = _error(message, exc)
        except Exception as exc:  # noqa: BLE001 -- a bug answers, it does not kill the daemon
            event(log, logging.ERROR, "request.crashed", op=str(message.get("op"))[:32],
                  error=f"{type(exc).__name__}: {exc}")
            self.scheduler.stats.count("errors.internal")
            reply = _error(message, CachedError(f"internal error: {type(exc).__name__}: {exc}"))
        if "id" in message:
            reply["id"] = message["id"]
        if payload is not None:
            reply["payload_size"] = len(payload)
        try:
            async with write_lock:
                await _send(writer, reply, payload)
        except (ConnectionError, OSError):
            pass

    async def _handle(self, m: dict) -> tuple[dict, bytes | None]:
        version = m.get("v", PROTOCOL_VERSION)
        if version not in SUPPORTED_VERSIONS:
            raise UnsupportedVersion(
                f"protocol version {version!r} is not supported; this daemon speaks "
                f"{', '.join(map(str, SUPPORTED_VERSIONS))}"
            )
        op = m.get("op")
        if op == "hello":
            return {"ok": True, "v": PROTOCOL_VERSION, "capabilities": list(CAPABILITIES),
                    "families": families.names(), "toolchain": toolchain.fingerprint(),
                    "versions": toolchain.versions(),
                    "runtime_library": toolchain.runtime_library()}, None
        if op == "get":
            return await self._get(m)
        if op == "prefetch":
            requests = m.get("requests")
            if not isinstance(requests, list):
                raise InvalidTactic("prefetch needs 'requests': a list of requests")
            return {"ok": True, **self.scheduler.prefetch(requests)}, None
        if op == "stats":
            return {"ok": True, "stats": self.stats_fn()}, None
        if op == "list":
            return {"ok": True, "entries": [_public_row(r) for r in
                                            self.scheduler.store.rows()]}, None
        if op == "plan":
            requests = await self.scheduler.plan(
                str(m.get("family")), m.get("shape"), str(m.get("arch")),
                _positive_int(m.get("sm_count")), _options(m.get("options")))
            return {"ok": True, "requests": requests}, None
        raise MalformedFrame(f"unknown op {op!r}; expected one of hello, get, prefetch, stats, "
                             "list, plan")

    async def _get(self, m: dict) -> tuple[dict, bytes | None]:
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


def _error(message: Any, exc: CachedError) -> dict:
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
