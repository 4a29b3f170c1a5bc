"""Build one kernel: the family compiles and exports an object, then it is linked.

Runs inside a pool worker, or inside a client process as its fallback when the daemon
cannot be reached. Writes only into the work directory it is given.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from cached_client import identity
from cached_client.keys import KernelRequest, artifact_key
from cached_client.protocol import Artifact
from cached_client.trust import RUNTIME_KEYS

from . import compiler_stack, families


def build(request: KernelRequest, workdir: Path) -> dict:
    """Compile ``request`` into ``workdir``; returns file paths, names and seconds spent."""
    family = families.get(request.family)
    started = time.perf_counter()
    built = family.build(request, workdir)
    compiled = time.perf_counter()
    library_path = workdir / f"{built.kernel_name}.so"
    compiler_stack.link_shared_library(built.object_path, library_path)
    return {
        "kernel_name": built.kernel_name,
        "symbol": built.symbol,
        "object_path": str(built.object_path),
        "library_path": str(library_path),
        "compile_seconds": round(compiled - started, 4),
        "link_seconds": round(time.perf_counter() - compiled, 4),
        "meta": dict(built.meta),
    }


def build_in_process(request: KernelRequest, scratch: str) -> Artifact:
    """The client's fallback (entry point ``cached_client.fallback``): compile here, in the
    calling process, and describe the result as the daemon would."""
    from cached_client.loader import private_dir, sha256_file

    family = families.get(request.family)
    request = family.canonical_request(request)
    private_dir(scratch)
    result = build(request, Path(tempfile.mkdtemp(prefix="fallback-", dir=scratch)))
    return Artifact(
        key=artifact_key(request, compiler_stack.fingerprint(), family.source_sha256()),
        family=request.family,
        kernel_name=result["kernel_name"],
        symbol=result["symbol"],
        library_sha256=sha256_file(result["library_path"]),
        object_sha256=sha256_file(result["object_path"]),
        toolchain=compiler_stack.fingerprint(),
        runtime_library=compiler_stack.runtime_library(),
        arch=request.arch, sm_count=request.sm_count,
        max_active_clusters=request.max_active_clusters,
        runtime={k: identity.runtime().get(k) for k in RUNTIME_KEYS},
        origin="fallback",
        compile_seconds=result["compile_seconds"],
        library_path=result["library_path"],
        object_path=result["object_path"],
    )
