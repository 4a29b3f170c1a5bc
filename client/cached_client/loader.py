"""Turn a verified shared library into a callable TVM-FFI function.

Needs only TVM-FFI and the CuTe-DSL runtime library (``libcute_dsl_runtime.so``), not the
compiler and not FlashInfer. Both are imported or opened on first use, never at import.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import stat
import threading
from pathlib import Path
from typing import Any

from .errors import IntegrityError

RUNTIME_LIBRARY_ENV = "CACHED_DSL_RUNTIME"
RUNTIME_LIBRARY_NAME = "libcute_dsl_runtime.so"
_opened_runtimes: dict[str, ctypes.CDLL] = {}
_lock = threading.Lock()


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def installed_runtime_libraries(name: str) -> list[str]:
    """``name`` in the installed DSL's ``cu*/lib`` directories, newest CUDA first (the one
    kernels are linked against, cached.compiler_stack.runtime_library_path)."""
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    found: list[str] = []
    if spec and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            found += [str(p) for p in sorted(Path(root).glob(f"cu*/lib/{name}"), reverse=True)]
    return found


def runtime_library_path() -> str | None:
    """The DSL runtime library this process opens: $CACHED_DSL_RUNTIME when it names a file
    (client-side configuration, e.g. a bare library carried on a GPU node), else the
    installed DSL's; None when there is neither. Never a path or name a daemon states: the
    library is opened RTLD_GLOBAL, and its digest is this process's identity
    (cached_client.identity.runtime hashes this same file, once per process)."""
    env = os.environ.get(RUNTIME_LIBRARY_ENV)
    if env and os.path.isfile(env):
        return env
    installed = installed_runtime_libraries(RUNTIME_LIBRARY_NAME)
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


def load_library(path: str, symbol: str, sha256: str, hashed_as_copied: bool = False) -> Any:
    """The function ``symbol`` of the shared library at ``path``, after checking its digest
    (the DSL runtime it needs is this process's own: :func:`open_runtime`).

    What is checked before native code is loaded: the daemon's uid at connect (transport,
    SO_PEERCRED against paths.trusted_uids), the artifact's stated identity against this
    process's (trust.mismatches, in ``Client.get``), and here the file's sha256.
    ``hashed_as_copied`` skips only the last, and only for a private copy that
    :func:`copy_verified` wrote in this process after the bytes it hashed matched, inside
    the 0700 scratch directory of this uid (``Client._load_artifact``); a copy found there
    from before is hashed here. Refused forgeries: tests/test_client_trust.py
    (``test_an_artifact_built_for_another_environment_is_a_miss_never_a_load``), the
    changed library of tests/test_client.py
    (``test_client_refuses_a_library_whose_digest_changed``) and the changed kept copy of
    ``test_a_load_is_passed_and_copies_only_the_library_and_checks_a_kept_copy``."""
    if not hashed_as_copied:
        actual = sha256_file(path)
        if actual != sha256:
            raise IntegrityError(f"{path} has sha256 {actual}, expected {sha256}; not "
                                 "loading it")
    open_runtime()
    import tvm_ffi

    return tvm_ffi.load_module(path)[symbol]


def is_private(st: os.stat_result) -> bool:
    """Whether ``st`` (an lstat) is a real directory that only this user can write."""
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


def private_dir(directory: str) -> str:
    """``directory``, created 0700; refused unless it is a real directory that only this
    user can write (a planted directory in /tmp could otherwise swap a library)."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    if not is_private(os.lstat(directory)):
        raise IntegrityError(f"{directory} is not a private directory of uid {os.getuid()}; "
                             "remove it or point TMPDIR elsewhere")
    return directory


def copy_verified(fd: int, sha256: str, size: int, path: str) -> tuple[str, bool]:
    """``path`` holding the bytes of the open file ``fd`` (read from offset 0), written
    atomically once they match ``sha256``; IntegrityError otherwise. Returns the path and
    whether its bytes were hashed here: a file already at ``path`` with ``size`` bytes is
    kept unhashed (loading it must check its digest)."""
    try:
        if os.stat(path).st_size == size:
            return path, False
    except FileNotFoundError:
        pass
    digest = hashlib.sha256()
    tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
    try:
        with open(tmp, "wb") as out:
            offset = 0
            while chunk := os.pread(fd, 1 << 20, offset):
                digest.update(chunk)
                out.write(chunk)
                offset += len(chunk)
        actual = digest.hexdigest()
        if actual != sha256:
            raise IntegrityError(f"the daemon passed a file with sha256 {actual}, expected "
                                 f"{sha256}; not loading it")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path, True


def load_bytes(data: bytes, symbol: str, sha256: str, directory: str) -> Any:
    """Write verified library bytes to a private file under ``directory`` and load it."""
    actual = hashlib.sha256(data).hexdigest()
    if actual != sha256:
        raise IntegrityError(f"received library has sha256 {actual}, expected {sha256}")
    private_dir(directory)
    path = os.path.join(directory, f"{sha256}.so")
    if not os.path.exists(path):
        tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    return load_library(path, symbol, sha256)
