"""The compiler stack of the environment this code runs in: identity, runtime library, linker.

Runs in the daemon's main process and in every worker (each in its own toolchain's
environment, cached/toolchain/toolchains.py). Nothing here imports the CuTe-DSL compiler, torch or
FlashInfer: the fingerprint is the client's (cached_client.identity: one implementation for
both sides), and the runtime library is found by its path.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path

from cached_client import identity
from cached_client.loader import RUNTIME_LIBRARY_NAME, installed_runtime_libraries

__all__ = ["RUNTIME_LIBRARY_NAME", "fingerprint", "fingerprint_digest", "versions",
           "package_dir", "runtime_library_path", "runtime_library", "link_shared_library",
           "hash_files"]


def fingerprint() -> str:
    """This environment's compiler stack fingerprint (cached_client.identity.toolchain)."""
    return identity.toolchain()


def fingerprint_digest(value: str | None = None) -> str:
    """A short stable name for a fingerprint (default: :func:`fingerprint`): 16 hex digits."""
    return identity.digest(value or fingerprint())


DAEMON_DIST = "cached-kernel-daemon"
"""The daemon's distribution (pyproject.toml; its import package is ``cached``)."""


def daemon_version() -> str:
    """This daemon's own version, from the metadata of the distribution that installed the
    ``cached`` package (:data:`DAEMON_DIST`, or an install of the same code under an
    earlier name)."""
    names = [DAEMON_DIST, *importlib.metadata.packages_distributions().get("cached", [])]
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown (not installed)"


def versions() -> dict[str, str]:
    """Readable versions of the parts of the stack, for hello and stats."""
    return identity.versions()


def package_dir(name: str) -> Path:
    """Directory of an installed top-level package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {name!r} is not installed in {sys.prefix}")
    return Path(next(iter(spec.submodule_search_locations)))


@functools.cache
def runtime_library_path() -> str:
    """The DSL runtime library every exported kernel links against (newest CUDA variant)."""
    matches = installed_runtime_libraries(RUNTIME_LIBRARY_NAME)
    if not matches:
        raise FileNotFoundError(f"{RUNTIME_LIBRARY_NAME} not found under nvidia_cutlass_dsl")
    return matches[0]


def runtime_library() -> dict:
    """The runtime library kernels need; ``path`` is None where the DSL is not installed
    (a serve-only node: clients then find it through $CACHED_DSL_RUNTIME)."""
    try:
        path: str | None = runtime_library_path()
    except FileNotFoundError:
        path = None
    return {"name": RUNTIME_LIBRARY_NAME, "path": path}


def link_shared_library(object_path: Path, library_path: Path) -> None:
    """Link an exported kernel object into a shared library loadable by ``tvm_ffi``."""
    runtime_dir = str(Path(runtime_library_path()).parent)
    tvm_ffi_lib = str(package_dir("tvm_ffi") / "lib")
    command = [
        "gcc", "-shared", "-o", str(library_path), str(object_path),
        f"-L{runtime_dir}", "-lcute_dsl_runtime", f"-L{tvm_ffi_lib}", "-ltvm_ffi",
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"linking {object_path.name} failed: {result.stderr.strip()}")


def hash_files(paths: tuple[Path, ...]) -> str:
    """sha256 over (relative name, bytes) of the project's own kernel sources."""
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()
