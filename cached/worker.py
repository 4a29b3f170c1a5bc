"""A pool worker: a long-lived spawned process that imports the toolchain once.

Protocol over its pipe: the worker sends ``("ready", pid)`` once preloaded, then for
each ``(kind, payload)`` it receives (``build`` or ``plan``) it answers
``("ok", result)`` or ``("error", message)``.

Invariant: a worker never outlives the daemon. The kernel kills it when its parent dies
(PR_SET_PDEATHSIG), a watchdog thread exits when its parent pid changes, and a closed
pipe ends the loop.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

PR_SET_PDEATHSIG = 1


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


def main(conn: Connection, parent_pid: int, family_names: list[str]) -> None:
    _die_with_parent(parent_pid)
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from cached_client.keys import KernelRequest

    from . import families
    from .build import build

    for name in family_names:
        families.get(name).preload()
    conn.send(("ready", os.getpid()))
    while True:
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if kind == "build":
                result = build(KernelRequest.from_wire(payload["request"]),
                               Path(payload["workdir"]))
            elif kind == "plan":
                family = families.get(payload["family"])
                requests = family.plan(tuple(payload["shape"]), payload["arch"],
                                       payload["sm_count"], payload.get("options", {}))
                result = [r.to_wire() for r in requests]
            else:
                raise ValueError(f"unknown job kind {kind!r}")
            conn.send(("ok", result))
        except Exception as exc:  # noqa: BLE001 -- every failure goes back to the daemon
            message = f"{type(exc).__name__}: {exc}"
            detail = traceback.format_exc(limit=6)
            conn.send(("error", {"message": message[:4000], "traceback": detail[-8000:]}))
