"""The compiler stack this daemon builds with: its fingerprint, runtime library and linker.

Nothing here imports the CuTe-DSL compiler, torch or FlashInfer: the fingerprint reads
installed distributions' metadata, and source hashing loads FlashInfer's stdlib-only
hashing module straight from its file, so the daemon's main process stays light.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

RUNTIME_LIBRARY_NAME = "libcute_dsl_runtime.so"


@functools.cache
def fingerprint() -> str:
    """The compiler stack's identity, computed exactly as FlashInfer's ``_get_cute_dsl_version``.

    Python's cache tag and SOABI, then ``name==version:sha256(RECORD, direct_url)`` of
    torch, apache-tvm-ffi and every nvidia-cutlass-dsl* distribution, sorted. Equal to
    FlashInfer's value so that exported artifacts carry the meta FlashInfer expects.
    """
    stack = []
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name in {"torch", "apache-tvm-ffi"} or name.startswith("nvidia-cutlass-dsl"):
            provenance = json.dumps(
                [dist.read_text("RECORD"), dist.read_text("direct_url.json")]
            ).encode()
            stack.append(f"{name}=={dist.version}:{hashlib.sha256(provenance).hexdigest()}")
    return ";".join(
        [str(sys.implementation.cache_tag), str(sysconfig.get_config_var("SOABI")), *sorted(stack)]
    )


def fingerprint_digest(value: str | None = None) -> str:
    """A short stable name for a fingerprint (default: :func:`fingerprint`): 16 hex digits."""
    return hashlib.sha256((value or fingerprint()).encode()).hexdigest()[:16]


@functools.cache
def _versions() -> tuple[tuple[str, str], ...]:
    out = {"python": sys.version.split()[0]}
    for name in ("nvidia-cutlass-dsl", "apache-tvm-ffi", "flashinfer-python", "torch"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "absent"
    return tuple(out.items())


def versions() -> dict[str, str]:
    """Readable versions of the parts of the stack, for hello and stats; read once per
    process (a metadata scan costs milliseconds, and ``hello`` is the clients' liveness
    probe)."""
    return dict(_versions())


def package_dir(name: str) -> Path:
    """Directory of an installed top-level package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {name!r} is not installed in {sys.prefix}")
    return Path(next(iter(spec.submodule_search_locations)))


@functools.cache
def runtime_library_path() -> str:
    """The DSL runtime library every exported kernel links against."""
    matches = sorted(package_dir("nvidia_cutlass_dsl").glob(f"cu*/lib/{RUNTIME_LIBRARY_NAME}"))
    if not matches:
        raise FileNotFoundError(f"{RUNTIME_LIBRARY_NAME} not found under nvidia_cutlass_dsl")
    return str(matches[-1])


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


@functools.cache
def _flashinfer_source_hasher() -> ModuleType:
    path = package_dir("flashinfer") / "jit" / "_cute_dsl_source.py"
    spec = importlib.util.spec_from_file_location("_cached_flashinfer_cute_dsl_source", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def flashinfer_source_hash(relative_paths: tuple[str, ...]) -> str:
    """FlashInfer's ``_hash_source_files`` over files given relative to its package."""
    root = package_dir("flashinfer")
    return flashinfer_source_hash_paths(tuple(str(root / p) for p in relative_paths))


def flashinfer_source_hash_paths(paths: tuple[str, ...]) -> str:
    """FlashInfer's ``_hash_source_files`` over absolute paths, as FlashInfer computes it."""
    return _flashinfer_source_hasher()._hash_source_files(paths)


def hash_files(paths: tuple[Path, ...]) -> str:
    """sha256 over (relative name, bytes) of the project's own kernel sources."""
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()
