"""A pool worker: a long-lived process of one toolchain that imports its compiler stack once.

Started by the pool (cached/pool.py) as ``PYTHON -c "from cached.worker import main;
main()" FD PARENT_PID FAMILIES_JSON`` with the toolchain's own interpreter and PYTHONPATH
holding only this package and the client package (cached/toolchain/toolchains.py ``code_dir``): it
imports the standard library, that environment's FlashInfer/DSL/TVM-FFI and this code,
nothing of the daemon's own dependencies (no FastAPI, no SQLite helpers).

Protocol over the socket ``FD`` (stdout is FlashInfer's and the DSL's to print on): the
client protocol's frames (cached_client.protocol: a 4-byte big-endian length and one JSON
object). The worker sends ``{"ready": pid}`` once preloaded; then for each ``{"kind",
"payload"}`` it receives (``build`` or ``plan``) it answers ``{"ok": result}`` (a build:
:class:`cached.build.BuildResult`'s wire form) or ``{"error": {"message", "traceback"}}``.

Invariant: a worker never outlives the daemon. The kernel kills it when its parent dies
(PR_SET_PDEATHSIG), a watchdog thread exits when its parent pid changes, and a closed
socket ends the loop.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from cached_client import protocol as p
from cached_client.errors import MalformedFrame

PR_SET_PDEATHSIG = 1
MAX_FRAME = 256 << 20
"""The largest frame either end of the worker's socket takes (bytes)."""


def send_frame(sock: socket.socket, message: dict) -> None:
    """One frame, as the protocol encodes it (:func:`cached_client.protocol.encode_frame`)."""
    sock.sendall(p.encode_frame(message))


def recv_frame(sock: socket.socket) -> dict:
    """One frame's JSON object, read as the protocol reads one
    (:func:`~cached_client.protocol.frame_length`,
    :func:`~cached_client.protocol.decode_body`); EOFError when the peer closed the socket
    or sent something that is not a frame."""
    try:
        length = p.frame_length(_exactly(sock, p.HEADER.size), MAX_FRAME)
        return p.decode_body(_exactly(sock, length))
    except MalformedFrame as exc:
        raise EOFError(f"not a frame: {exc.message}") from None


def _exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("peer closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _die_with_parent(parent_pid: int) -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
    if os.getppid() != parent_pid:
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    fd, parent_pid, family_names = argv or sys.argv[1:4]
    _die_with_parent(int(parent_pid))
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=int(fd))
    from cached_client.keys import KernelRequest

    from . import families
    from .build import build

    for name in json.loads(family_names):
        try:
            families.get(name).preload()
        except ImportError as exc:  # a family this environment lacks: its jobs say why
            print(f"cached worker: {name} not preloaded: {exc}", file=sys.stderr, flush=True)
    send_frame(sock, {"ready": os.getpid()})
    while True:
        try:
            job = recv_frame(sock)
        except (EOFError, OSError, ValueError):
            return
        try:
            kind, payload = job["kind"], job["payload"]
            if kind == "build":
                result: Any = build(KernelRequest.from_wire(payload["request"]),
                                    Path(payload["workdir"])).to_wire()
            elif kind == "plan":
                family = families.get(payload["family"])
                requests = family.plan(tuple(payload["shape"]), payload["arch"],
                                       payload["sm_count"], payload.get("options", {}))
                result = [r.to_wire() for r in requests[:payload.get("limit")]]
            else:
                raise ValueError(f"unknown job kind {kind!r}")
            reply: dict = {"ok": result}
        except Exception as exc:  # noqa: BLE001 -- every failure goes back to the daemon
            message = f"{type(exc).__name__}: {exc}"
            detail = traceback.format_exc(limit=6)
            reply = {"error": {"message": message[:4000], "traceback": detail[-8000:]}}
        try:
            send_frame(sock, reply)
        except OSError:
            return
