"""One process per store: the daemon, or an offline ``cached gc``/``verify --store``.

The holder keeps an exclusive ``flock`` on ``<store>/daemon.lock`` for as long as it uses
the store, and writes who it is there (pid, command, socket, since) for the refusal
message; the kernel drops the lock when the holder exits, however it exits (``kill -9``
included), so a stale file never blocks anyone. A second ``cached serve`` on a live store,
or an offline command on a store a daemon serves, gets :class:`StoreInUse` (a ConfigError:
one line, exit status 2) and touches nothing.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import time
from pathlib import Path

from ..config import ConfigError

LOCK_NAME = "daemon.lock"


class StoreInUse(ConfigError):
    """Another process (a daemon, an offline gc or verify) holds the store."""


class StoreLock:
    """The store's lock, held from :func:`take` until :meth:`release` (or the process's
    exit)."""

    def __init__(self, fd: int | None, path: Path) -> None:
        self.fd = fd
        self.path = path

    def release(self) -> None:
        """Drop the lock (idempotent); the file stays (a later holder rewrites it)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def check(root: Path, command: str, hint: str = "") -> None:
    """StoreInUse now if a process holds the store at ``root``; creates nothing (the lock is
    :func:`take`-n later, when the store is opened)."""
    try:
        fd = os.open(Path(root) / LOCK_NAME, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return  # no lock file (nobody holds it), or one take() will say more about
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _in_use(root, fd, hint) from None
    finally:
        os.close(fd)


def _in_use(root: Path, fd: int, hint: str) -> StoreInUse:
    holder = _read(fd)
    who = (f"cached {holder.get('command', '?')} (pid {holder.get('pid', '?')}"
           + (f", socket {holder['socket']}" if holder.get("socket") else "") + ")"
           if holder else "another process")
    return StoreInUse(f"store {root} is in use by {who}: one process per store"
                      + (f"; {hint}" if hint else ""))


def take(root: Path, command: str, socket: str = "", hint: str = "") -> StoreLock:
    """The lock of the store at ``root`` for ``command`` (``serve``, ``gc``, ``verify``);
    StoreInUse naming the holder, and ``hint`` (what to do instead), when it is held. A
    root that cannot be made or written gets an unheld lock: opening the store says why."""
    path = Path(root) / LOCK_NAME
    try:
        Path(root).mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a link where the lock belongs: never followed
            raise StoreInUse(f"{path} is a symbolic link, not the store's lock file; "
                             "remove it") from None
        return StoreLock(None, path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        error = _in_use(root, fd, hint)
        os.close(fd)
        raise error from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "command": command, "socket": socket,
                              "since": round(time.time(), 3)}).encode() + b"\n", 0)
    return StoreLock(fd, path)


def _read(fd: int) -> dict:
    with contextlib.suppress(OSError, ValueError):
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
        if isinstance(holder, dict):
            return holder
    return {}
