"""Turn a verified shared library into a callable TVM-FFI function.

Needs only TVM-FFI and the CuTe-DSL runtime library (``libcute_dsl_runtime.so``), not the
compiler and not FlashInfer. Both are imported or opened on first use, never at import.

The client's private files (copies of served blobs, the identity cache) live in this uid's
scratch directory (paths.scratch_dir), which sits in a shared ``$TMPDIR``: any user may
create that name while it is absent (after a boot, after a tmp cleaner). So the directory
is never trusted by its path: every use opens it (:func:`open_private_dir`) and checks the
descriptor at that moment (a real directory, no link, owned by this uid and writable by it
alone), then reaches its files through that descriptor only (``openat``-style). A library is
dlopened as ``/proc/self/fd/<directory>/<sha256>.so``: a name resolved in a checked directory
itself, so nothing between the hash and the dlopen can change what runs (the name carries
the digest, so the loader's per-name reuse of an opened library can only give the same
bytes). That directory is the daemon's own where only a daemon's uid can change it and the
file (:func:`open_in_place`: the store as a node installs it; no copy is made), else this
uid's scratch directory, the library copied into it and hashed as it is copied (or, a copy
found there, hashed after it is opened through the descriptor). An object is loaded
from a sealed memfd holding the bytes hashed (:func:`sealed_copy`). A scratch directory
that fails the check is warned once and replaced, for this process, by a fresh private one
(:class:`Scratch`): never an exception, never a use.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import importlib.util
import logging
import os
import stat
import tempfile
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from .errors import IntegrityError
from .paths import scratch_dir, trusted_uids

RUNTIME_LIBRARY_ENV = "CACHED_DSL_RUNTIME"
RUNTIME_LIBRARY_NAME = "libcute_dsl_runtime.so"
_opened_runtimes: dict[str, ctypes.CDLL] = {}
_installed_runtime: dict[str, str] = {}  # name -> the installed DSL's (runtime_library_path)
_lock = threading.Lock()
logger = logging.getLogger("cached_client")
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_fd(fd: int) -> str:
    """The sha256 of the open file ``fd``, read from offset 0 (its offset is left alone)."""
    digest = hashlib.sha256()
    offset = 0
    while chunk := os.pread(fd, 1 << 20, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


def installed_runtime_libraries(name: str) -> list[str]:
    """``name`` in the installed DSL's ``cu*/lib`` directories, newest CUDA first (the one
    kernels are linked against, cached.toolchain.compiler_stack.runtime_library_path)."""
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    found: list[str] = []
    if spec and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            try:
                dirs = [d for d in os.listdir(root) if d.startswith("cu")]
            except OSError:
                continue
            paths = (os.path.join(root, d, "lib", name) for d in sorted(dirs, reverse=True))
            found += [p for p in paths if os.path.isfile(p)]
    return found


def runtime_library_path() -> str | None:
    """The DSL runtime library this process opens: $CACHED_DSL_RUNTIME when it names a file
    (client-side configuration, e.g. a bare library carried on a GPU node), else the
    installed DSL's; None when there is neither. Never a path or name a daemon states: the
    library is opened RTLD_GLOBAL, and its digest is this process's identity
    (cached_client.identity.runtime hashes this same file, once per process). The installed
    one found is remembered for the process while it is a file (found once, not per use)."""
    env = os.environ.get(RUNTIME_LIBRARY_ENV)
    if env and os.path.isfile(env):
        return env
    found = _installed_runtime.get(RUNTIME_LIBRARY_NAME)
    if found is not None and os.path.isfile(found):
        return found
    installed = installed_runtime_libraries(RUNTIME_LIBRARY_NAME)
    if installed:
        _installed_runtime[RUNTIME_LIBRARY_NAME] = installed[0]
    return installed[0] if installed else None


def open_runtime() -> None:
    """dlopen this process's DSL runtime globally, once per process, so kernels can resolve
    it; FileNotFoundError when there is none."""
    with _lock:
        if RUNTIME_LIBRARY_NAME in _opened_runtimes:
            return
        path = runtime_library_path()
        if path is None:
            raise FileNotFoundError(
                f"cannot find {RUNTIME_LIBRARY_NAME}: set {RUNTIME_LIBRARY_ENV} to its path, or "
                "install nvidia-cutlass-dsl in this environment")
        _opened_runtimes[RUNTIME_LIBRARY_NAME] = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)


def _load_at(dir_fd: int, name: str, symbol: str) -> Any:
    """dlopen ``name`` as resolved in the directory ``dir_fd`` (not by any path of it)."""
    open_runtime()
    import tvm_ffi

    return tvm_ffi.load_module(f"/proc/self/fd/{dir_fd}/{name}")[symbol]


def load_library(source: str | int | bytes, symbol: str, sha256: str,
                 scratch: Scratch | None = None) -> Any:
    """The function ``symbol`` of the shared library ``source`` (a path, an open file read
    from offset 0, or its bytes) whose bytes must hash to ``sha256``. A file only a daemon's
    uid can change, in a directory only it can change (:func:`open_in_place`: the daemon's
    store, as a node installs it), is hashed and loaded where it is, through a descriptor of
    that directory; anything else is copied into the private scratch directory through a
    descriptor checked now, hashed as it is copied, and loaded through that descriptor (see
    the module doc; for a descriptor or bytes, a copy already there whose bytes hash right is
    loaded instead). The DSL runtime it needs is this process's own (:func:`open_runtime`).
    IntegrityError when the bytes differ; FileNotFoundError for a path that is gone.

    What else is checked before native code is loaded: the daemon's uid at connect
    (transport, SO_PEERCRED against paths.trusted_uids) and the artifact's stated identity
    against this process's (trust.mismatches, in ``Client.get``). Refused forgeries:
    tests/test_client_trust.py (``test_an_artifact_built_for_another_environment_is_a_miss_
    never_a_load``, ``test_a_scratch_directory_remade_by_another_uid_never_runs_its_code``,
    ``test_a_store_another_uid_can_write_is_copied_never_loaded_in_place``),
    tests/test_client.py (``test_client_refuses_a_library_whose_digest_changed``)."""
    src = os.open(source, os.O_RDONLY | os.O_CLOEXEC) if isinstance(source, str) else None
    try:
        what = source if isinstance(source, str) else "the library the daemon passed"
        opened = source if src is None else src
        if not isinstance(opened, bytes):
            in_place = open_in_place(opened, f"{sha256}.so")
            if in_place is not None:
                dir_fd, held = in_place
                try:
                    actual = sha256_fd(held)
                    if actual != sha256:
                        raise IntegrityError(f"{what} has sha256 {actual}, expected {sha256}; "
                                             "not loading it")
                    return _load_at(dir_fd, f"{sha256}.so", symbol)
                finally:
                    os.close(held)
                    os.close(dir_fd)
        scratch = scratch or Scratch()
        dir_fd = scratch.open()
        try:
            name = f"{sha256}.so"
            place(dir_fd, name, sha256, opened, what, keep=src is None)
            return _load_at(dir_fd, name, symbol)
        finally:
            os.close(dir_fd)
    finally:
        if src is not None:
            os.close(src)


def _changed_only_by_daemons(st: os.stat_result) -> bool:
    """Whether only a uid a daemon may run as (paths.trusted_uids) can change ``st``'s file:
    owned by one, no write for group or others (an ACL's grants show in the group bits)."""
    try:
        return st.st_uid in trusted_uids() and not st.st_mode & 0o022
    except ValueError:  # a $CACHED_DAEMON_UID that names no user: trust none here
        return False


def open_in_place(fd: int, name: str) -> tuple[int, int] | None:
    """(a descriptor of the directory holding the open file ``fd``, a descriptor of ``name``
    opened in it) when both are what only a daemon's uid can change and ``name`` there is
    the very file ``fd`` is: a regular file and a real directory, each owned by a trusted
    uid with no write for group or others. Then nothing between a hash of the file and a
    dlopen of ``/proc/self/fd/<directory>/<name>`` can change what runs but a daemon's uid
    (whose socket this process already trusts), and the name, which carries the digest, can
    only give the same bytes again. None when any of it fails (a copy is made instead): a
    file in a directory this process cannot open, renamed or unlinked since, writable by
    others, or in a directory others can write. The caller closes both."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or not _changed_only_by_daemons(st):
        return None
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    directory, base = os.path.split(path)
    if base != name or not directory.startswith("/"):
        return None  # another name, or unlinked (" (deleted)")
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    held = None
    try:
        dst = os.fstat(dir_fd)
        if stat.S_ISDIR(dst.st_mode) and _changed_only_by_daemons(dst):
            held = os.open(name, FILE_FLAGS, dir_fd=dir_fd)
            hst = os.fstat(held)
            if (hst.st_dev, hst.st_ino) == (st.st_dev, st.st_ino):
                return dir_fd, held
    except OSError:
        pass
    if held is not None:
        os.close(held)
    os.close(dir_fd)
    return None


def is_private(st: os.stat_result) -> bool:
    """Whether ``st`` (an lstat or fstat) is a real directory that only this user can
    write."""
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


def open_private_dir(directory: str, create: bool = True) -> int:
    """A descriptor of ``directory`` checked now: a real directory (its last component no
    link), owned by this uid and writable by it alone; made 0700 (with its parents) when
    absent and ``create``. IntegrityError naming the owner and mode when it is not;
    FileNotFoundError when absent and not ``create``."""
    try:
        fd = os.open(directory, DIR_FLAGS)
    except FileNotFoundError:
        if not create:
            raise
        os.makedirs(directory, mode=0o700, exist_ok=True)
        return open_private_dir(directory, create=False)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise IntegrityError(f"{directory} is not a directory (a link?); remove it or "
                                 "point TMPDIR elsewhere") from None
        raise
    st = os.fstat(fd)
    if not is_private(st):
        os.close(fd)
        raise IntegrityError(f"{directory} is not a private directory of uid {os.getuid()} "
                             f"(it belongs to uid {st.st_uid}, mode "
                             f"{oct(st.st_mode & 0o777)}); remove it or point TMPDIR "
                             "elsewhere")
    return fd


def private_dir(directory: str) -> str:
    """``directory``, created 0700; refused (IntegrityError) unless it is now a real
    directory that only this user can write (:func:`open_private_dir`)."""
    os.close(open_private_dir(directory))
    return directory


def open_private_file(dir_fd: int, name: str) -> int | None:
    """``name`` in the checked directory ``dir_fd``, opened for reading when it is a regular
    file (no link) of this uid that only it can write; None when absent or not so."""
    try:
        fd = os.open(name, FILE_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None
    st = os.fstat(fd)
    if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid()
            or st.st_mode & 0o022):
        os.close(fd)
        return None
    return fd


def write_private_file(dir_fd: int, name: str, chunks: Iterable[bytes]) -> None:
    """Write ``chunks`` (bytes) to ``name`` in the checked directory ``dir_fd``, atomically
    (a new 0600 file renamed over it within that directory). The iterable may raise to
    abandon the write; nothing is left behind then."""
    tmp = f".{name}.tmp.{os.getpid()}.{threading.get_ident()}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        out = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
    except FileExistsError:  # a leftover of a thread of a dead process with this pid
        os.unlink(tmp, dir_fd=dir_fd)
        out = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
    placed = False
    try:
        for chunk in chunks:
            view = memoryview(chunk)
            while view:
                view = view[os.write(out, view):]
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        placed = True
    finally:
        os.close(out)
        if not placed:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except FileNotFoundError:
                pass


def _verified_chunks(source: int | bytes, sha256: str, what: str) -> Iterator[bytes]:
    """The bytes of ``source`` (an open file read from offset 0, or bytes) in chunks,
    raising IntegrityError after the last when they do not hash to ``sha256``."""
    digest = hashlib.sha256()
    for chunk in [source] if isinstance(source, bytes) else _pread_all(source):
        digest.update(chunk)
        yield chunk
    actual = digest.hexdigest()
    if actual != sha256:
        raise IntegrityError(f"{what} has sha256 {actual}, expected {sha256}; not loading it")


def _pread_all(fd: int) -> Iterator[bytes]:
    """The bytes of ``fd`` from offset 0 (a pipe or FIFO: from where it is)."""
    offset = 0
    while True:
        try:
            chunk = os.pread(fd, 1 << 20, offset)
        except OSError as exc:
            if exc.errno != errno.ESPIPE or offset:
                raise
            yield from iter(lambda: os.read(fd, 1 << 20), b"")
            return
        if not chunk:
            return
        offset += len(chunk)
        yield chunk


def place(dir_fd: int, name: str, sha256: str, source: int | bytes,
          what: str = "the file the daemon passed", keep: bool = True) -> None:
    """Make ``name`` in the checked directory ``dir_fd`` hold bytes hashing to ``sha256``:
    with ``keep``, a copy already there (this uid's, no link) is kept when its bytes, read
    through the descriptor, hash to it; otherwise ``source`` (an open file read from offset
    0, or bytes) is written there, hashed as it is written. IntegrityError naming ``what``
    when ``source`` differs (nothing is left behind)."""
    kept = open_private_file(dir_fd, name) if keep else None
    if kept is not None:
        try:
            if sha256_fd(kept) == sha256:
                return
        finally:
            os.close(kept)
    write_private_file(dir_fd, name, _verified_chunks(source, sha256, what))


def sealed_copy(source: str | int, sha256: str) -> int:
    """A sealed memfd (no write, grow or shrink) holding the bytes of ``source`` (a path, or
    an open file read from offset 0), hashed after sealing; IntegrityError when they do not
    hash to ``sha256``. Load it as ``/proc/self/fd/N``: what was hashed is what is read.
    The caller closes it."""
    src = os.open(source, os.O_RDONLY | os.O_CLOEXEC) if isinstance(source, str) else source
    fd = os.memfd_create(f"cached-{sha256[:16]}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        for chunk in _pread_all(src):
            os.write(fd, chunk)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW
                    | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
        actual = sha256_fd(fd)
        if actual != sha256:
            raise IntegrityError(f"{source if isinstance(source, str) else 'the file'} has "
                                 f"sha256 {actual}, expected {sha256}; not loading it")
    except BaseException:
        os.close(fd)
        raise
    finally:
        if src is not source:
            os.close(src)
    return fd


_replacements: dict[str, str] = {}
"""Preferred scratch directory -> the fresh private one this process uses instead."""
_scratch_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _scratch_lock
    _scratch_lock = threading.Lock()  # another thread may have held it at the fork


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Scratch:
    """This uid's private scratch directory (paths.scratch_dir, or ``preferred``), checked
    every time it is opened, never once per process. When the preferred directory fails the
    check (another uid made it first, a link, writable by others), a warning (once per
    process) and a fresh private directory (mkdtemp, 0700) beside it serve this process
    instead; one that vanished or was replaced is made again. Safe to share between
    threads and across fork."""

    def __init__(self, preferred: str | None = None) -> None:
        self.preferred = preferred or scratch_dir()

    @property
    def path(self) -> str:
        """The directory in use now (by path: only for what cannot take a descriptor, such
        as a compiler's output directory)."""
        return _replacements.get(self.preferred, self.preferred)

    def open(self) -> int:
        """A descriptor of the directory in use, checked now (:func:`open_private_dir`); the
        caller closes it."""
        with _scratch_lock:
            fresh = _replacements.get(self.preferred)
            if fresh is None:
                try:
                    return open_private_dir(self.preferred)
                except (IntegrityError, PermissionError) as exc:
                    why = exc.message if isinstance(exc, IntegrityError) else str(exc)
                    logger.warning("cached: not using the scratch directory %s (%s); this "
                                   "process uses a fresh private directory instead",
                                   self.preferred, why)
            else:
                try:
                    return open_private_dir(fresh, create=False)
                except (OSError, IntegrityError):
                    pass  # removed (a tmp cleaner) or replaced: another fresh one
            parent = os.path.dirname(self.preferred) or "."
            fresh = tempfile.mkdtemp(prefix=os.path.basename(self.preferred) + "-", dir=parent)
            _replacements[self.preferred] = fresh
            return open_private_dir(fresh, create=False)

    def directory(self) -> str:
        """The path of the directory in use, checked now (for a compiler's output)."""
        os.close(self.open())
        return self.path
