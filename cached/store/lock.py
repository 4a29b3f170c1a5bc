"""One process per store: the daemon, or an offline ``cached gc``/``verify --store``.

The holder keeps an exclusive ``flock`` on ``<store>/.lock/daemon.lock`` for as long as it
uses the store, and writes who it is there (pid, command, socket, since) for the refusal
message; the kernel drops the lock when the holder exits, however it exits (``kill -9``
included), so a stale file never blocks anyone. A second ``cached serve`` on a live store,
or an offline command on a store a daemon serves, gets :class:`StoreInUse` (a ConfigError:
one line, exit status 2) naming the process that holds the lock (read from
``/proc/locks``) and touches nothing.

Invariants: only the daemon's user can open the lock file (its directory ``.lock`` is mode
0700, owned by that uid, and checked, never followed as a link, at every take), so a user
who can read the store cannot hold the lock through a descriptor of its own. The lock of
earlier versions, ``<store>/daemon.lock`` (readable by every user the store is), is taken
too where it is free; held by a process of this uid or root (an older daemon) it refuses
the store, held by anyone else it is ignored.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
import time
from pathlib import Path

from ..config import ConfigError

LOCK_DIR = ".lock"
LOCK_NAME = "daemon.lock"
LEGACY_NAME = "daemon.lock"  # in the store's root: the lock before LOCK_DIR


class StoreInUse(ConfigError):
    """Another process (a daemon, an offline gc or verify) holds the store."""


class StoreLock:
    """The store's lock, held from :func:`take` until :meth:`release` (or the process's
    exit)."""

    def __init__(self, fd: int | None, path: Path, legacy_fd: int | None = None) -> None:
        self.fd = fd
        self.path = path
        self.legacy_fd = legacy_fd

    def release(self) -> None:
        """Drop the lock (idempotent); the file stays (a later holder rewrites it)."""
        for name in ("fd", "legacy_fd"):
            fd = getattr(self, name)
            if fd is not None:
                os.close(fd)
                setattr(self, name, None)


def _open_dir(root: Path, create: bool) -> int | None:
    """A descriptor of ``root/.lock`` once it is checked: a directory (no link), owned by
    this uid, mode 0700 (made so when ``create``); None when absent and not ``create``."""
    path = Path(root) / LOCK_DIR
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        if create:
            raise
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise StoreInUse(f"{path} is not a directory (a link, or a file): it is where "
                             "the store's lock lives; remove it") from None
        raise
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        os.close(fd)
        raise StoreInUse(f"{path} belongs to uid {st.st_uid}, not this daemon's user "
                         f"({os.geteuid()}): another user could hold the store's lock; remove "
                         "it")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.fchmod(fd, 0o700)
    return fd


def check(root: Path, command: str, hint: str = "") -> None:
    """StoreInUse now if a process holds the store at ``root``; creates nothing (the lock is
    :func:`take`-n later, when the store is opened)."""
    try:
        dfd = _open_dir(root, create=False)
    except OSError:
        return  # take() will say more
    if dfd is not None:
        try:
            fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=dfd)
        except OSError:
            fd = None  # no lock file (nobody holds it), or one take() will say more about
        finally:
            os.close(dfd)
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise _in_use(root, fd, hint) from None
            finally:
                os.close(fd)
    legacy = _legacy(root, hint)
    if legacy is not None:
        os.close(legacy)


def _legacy(root: Path, hint: str) -> int | None:
    """The earlier versions' lock, held (its descriptor), or None where it is absent or
    held by a process of another user; StoreInUse where a process of this uid or root
    (an older daemon, an offline command) holds it."""
    try:
        fd = os.open(Path(root) / LEGACY_NAME,
                     os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        holders = _holders(fd)
        if any(uid in (0, os.geteuid()) for _, uid, _ in holders) or not holders:
            error = _in_use(root, fd, hint, holders)
            os.close(fd)
            raise error from None
        os.close(fd)  # another user's descriptor: it proves nothing about the store
        return None


def _holders(fd: int) -> list[tuple[int, int | None, str]]:
    """(pid, uid, command line) of each process holding a flock on ``fd``'s file, from
    ``/proc/locks`` (uid None where the process is gone or unreadable)."""
    st = os.fstat(fd)
    out = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/locks").read_text().splitlines():
            parts = line.split()
            if "->" in parts:  # a waiter, not a holder
                continue
            try:
                kind, pid, ident = parts[1], int(parts[4]), parts[5]
                major, minor, inode = ident.split(":")
                same = (int(major, 16), int(minor, 16), int(inode)) == (
                    os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
            except (IndexError, ValueError):
                continue
            if kind == "FLOCK" and same and pid > 0:
                out.append((pid, *_process(pid)))
    return out


def _process(pid: int) -> tuple[int | None, str]:
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None, ""
    return uid, cmdline.replace(b"\0", b" ").decode(errors="replace").strip()[:200]


def _in_use(root: Path, fd: int, hint: str,
            holders: list[tuple[int, int | None, str]] | None = None) -> StoreInUse:
    """The refusal: the holder as ``/proc/locks`` names it (with what it wrote in the file
    when that is the same process)."""
    holder = _read(fd)
    holders = _holders(fd) if holders is None else holders
    pids = [pid for pid, _, _ in holders]
    if holder and (not pids or holder.get("pid") in pids):
        who = (f"cached {holder.get('command', '?')} (pid {holder.get('pid', '?')}"
               + (f", socket {holder['socket']}" if holder.get("socket") else "") + ")")
    elif holders:
        who = "; ".join(f"pid {pid} (uid {uid if uid is not None else '?'}"
                        + (f": {cmd}" if cmd else "") + ")" for pid, uid, cmd in holders[:3])
    else:
        who = "another process"
    return StoreInUse(f"store {root} is in use by {who}: one process per store"
                      + (f"; {hint}" if hint else ""))


def take(root: Path, command: str, socket: str = "", hint: str = "") -> StoreLock:
    """The lock of the store at ``root`` for ``command`` (``serve``, ``gc``, ``verify``);
    StoreInUse naming the holder, and ``hint`` (what to do instead), when it is held. A
    root that cannot be made or written gets an unheld lock: opening the store says why."""
    path = Path(root) / LOCK_DIR / LOCK_NAME
    try:
        Path(root).mkdir(parents=True, exist_ok=True)
        dfd = _open_dir(Path(root), create=True)
    except OSError:
        return StoreLock(None, path)
    try:
        fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600,
                     dir_fd=dfd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a link where the lock belongs: never followed
            raise StoreInUse(f"{path} is a symbolic link, not the store's lock file; "
                             "remove it") from None
        return StoreLock(None, path)
    finally:
        os.close(dfd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        error = _in_use(root, fd, hint)
        os.close(fd)
        raise error from None
    try:
        legacy = _legacy(Path(root), hint)
    except StoreInUse:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "command": command, "socket": socket,
                              "since": round(time.time(), 3)}).encode() + b"\n", 0)
    return StoreLock(fd, path, legacy)


def _read(fd: int) -> dict:
    with contextlib.suppress(OSError, ValueError):
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
        if isinstance(holder, dict):
            return holder
    return {}
