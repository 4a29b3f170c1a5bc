"""Blob files: read only when a regular file of the recorded size whose sha256 matches,
opened without following links (relative to their shard's directory descriptor), opened
for a client the same way (:func:`open_served`), prepared for the store (fsynced,
read-only) and removed without following links. No index here."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
from pathlib import Path

from cached_client.errors import Overloaded

CHUNK = 1 << 20
OPEN_BLOB = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class BadBlob(Exception):
    """A blob that cannot be served; ``remove``: what sits at its name is certainly not
    the blob (not a regular file, a link, unreadable, wrong digest) and may go."""

    def __init__(self, reason: str, remove: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.remove = remove


def mode_name(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def read_all(fd: int) -> bytes:
    parts = []
    while chunk := os.read(fd, CHUNK):
        parts.append(chunk)
    return b"".join(parts)


def file_identity(st: os.stat_result) -> tuple:
    """What changes whenever a file is replaced, written, linked or its mode changed."""
    return (st.st_dev, st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def read_regular(shard: int, name: str, label: str, size: int | None, sha256: str,
                  keep: bool) -> tuple[bytes | None, os.stat_result]:
    """The blob's bytes (when ``keep``) and the fstat of the file whose digest matched."""
    try:
        st = os.stat(name, dir_fd=shard, follow_symlinks=False)
    except FileNotFoundError:
        raise BadBlob(f"{label} is missing", False) from None
    if not stat.S_ISREG(st.st_mode):  # refused before anything is opened
        raise BadBlob(f"{label} is {mode_name(st.st_mode)}, not a regular file", True)
    try:
        fd = os.open(name, OPEN_BLOB, dir_fd=shard)
    except FileNotFoundError:
        raise BadBlob(f"{label} is missing", False) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise BadBlob(f"{label} is a symbolic link, not a regular file", True) from None
        raise BadBlob(f"{label} cannot be opened: {exc.strerror}", True) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadBlob(f"{label} is {mode_name(st.st_mode)}, not a regular file", True)
        if size is not None and st.st_size != size:
            raise BadBlob(f"{label} is {st.st_size} bytes, not the {size} recorded", False)
        digest = hashlib.sha256()
        parts = []
        total = 0
        try:
            while chunk := os.read(fd, CHUNK):
                total += len(chunk)
                if size is not None and total > size:
                    raise BadBlob(f"{label} grew past the {size} bytes recorded", False)
                digest.update(chunk)
                if keep:
                    parts.append(chunk)
        except OSError as exc:
            raise BadBlob(f"{label} cannot be read: {exc.strerror}", False) from None
    finally:
        os.close(fd)
    actual = digest.hexdigest()
    if actual != sha256:
        raise BadBlob(f"{label} has digest {actual[:12]}", True)
    return (b"".join(parts) if keep else None), st


def open_served(path: os.PathLike | str, size: int) -> int:
    """A read-only descriptor of the blob at ``path`` to hand to a client: never through a
    link, never blocking on a FIFO, only a regular file of ``size`` bytes. FileNotFoundError
    when it is gone (evicted meanwhile: look it up again), Overloaded when the daemon is
    out of descriptors, BadBlob otherwise."""
    try:
        fd = os.open(path, OPEN_BLOB)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise FileNotFoundError(str(path)) from None
        if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
            raise Overloaded(f"the daemon cannot open a blob now ({exc.strerror}); retry "
                             "later") from None
        raise BadBlob(f"{os.fspath(path)[-80:]}: {exc.strerror}", True) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size != size:
        os.close(fd)
        raise BadBlob(f"{os.fspath(path)[-80:]} is not a regular file of {size} bytes", True)
    return fd


def remove_at(directory: int, name: str) -> None:
    try:
        st = os.stat(name, dir_fd=directory, follow_symlinks=False)
    except FileNotFoundError:
        return
    try:
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, dir_fd=directory)
        else:
            os.unlink(name, dir_fd=directory)
    except FileNotFoundError:
        pass


def prepare(path: Path) -> tuple[str, int]:
    """Digest and size of a built file, fsynced and made read-only (0444) through its
    descriptor (opened without following a link; only a regular file)."""
    fd = os.open(path, OPEN_BLOB)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{path.name} is not a regular file")
        digest = hashlib.sha256()
        size = 0
        while chunk := os.read(fd, CHUNK):
            digest.update(chunk)
            size += len(chunk)
        os.fsync(fd)
        os.fchmod(fd, 0o444)
    finally:
        os.close(fd)
    return digest.hexdigest(), size


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
