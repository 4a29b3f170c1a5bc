"""Build one kernel: the family compiles and exports an object, then it is linked.

Runs inside a pool worker, or inside a client process as its fallback when the daemon
cannot be reached. Writes only into the work directory it is given.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cached_client import identity
from cached_client.keys import KernelRequest, artifact_key
from cached_client.protocol import Artifact
from cached_client.trust import RUNTIME_KEYS

from cached import families
from cached.toolchain import compiler_stack


@dataclass(frozen=True)
class BuildResult:
    """A built kernel in its work directory: its name and exported symbol, the object and
    the library linked from it (absolute paths), seconds spent compiling and linking, the
    family's ``meta``, and the interpreter that built it (``python``: a worker's
    ``sys.executable``). Crosses the worker's socket as :meth:`to_wire`'s JSON object."""

    kernel_name: str
    symbol: str
    object_path: str
    library_path: str
    compile_seconds: float
    link_seconds: float
    meta: dict[str, Any]
    python: str | None = None

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> BuildResult:
        """The result a worker sent; TypeError when a field is missing or unknown."""
        return cls(**wire)


def build(request: KernelRequest, workdir: Path) -> BuildResult:
    """Compile ``request`` into ``workdir``: the object, then the library linked from it."""
    family = families.get(request.family)
    started = time.perf_counter()
    built = family.build(request, workdir)
    compiled = time.perf_counter()
    library_path = workdir / f"{built.kernel_name}.so"
    compiler_stack.link_shared_library(built.object_path, library_path)
    return BuildResult(
        kernel_name=built.kernel_name, symbol=built.symbol,
        object_path=str(built.object_path), library_path=str(library_path),
        compile_seconds=round(compiled - started, 4),
        link_seconds=round(time.perf_counter() - compiled, 4),
        meta=dict(built.meta), python=sys.executable)


def build_in_process(request: KernelRequest, scratch: str) -> Artifact:
    """The client's fallback (entry point ``cached_client.fallback``): compile here, in the
    calling process, and describe the result as the daemon describes an unstored kernel
    (:func:`cached.artifacts.make_artifact`, origin ``fallback``)."""
    from cached_client.loader import private_dir, sha256_file

    from .artifacts import make_artifact
    from .store.rows import Entry, kernel_row, row_for

    family = families.get(request.family)
    request = family.canonical_request(request)
    private_dir(scratch)
    result = build(request, Path(tempfile.mkdtemp(prefix="fallback-", dir=scratch)))
    toolchain, sources = compiler_stack.fingerprint(), family.source_sha256()
    draft = row_for(artifact_key(request, toolchain, sources), request,
                    kernel_name=result.kernel_name, symbol=result.symbol, toolchain=toolchain,
                    source_sha256=sources, compile_seconds=result.compile_seconds,
                    meta=result.meta)
    row = kernel_row(draft, object_sha256=sha256_file(result.object_path),
                     object_size=os.path.getsize(result.object_path),
                     library_sha256=sha256_file(result.library_path),
                     library_size=os.path.getsize(result.library_path), now=time.time())
    entry = Entry(row, Path(result.object_path), Path(result.library_path))
    return make_artifact(entry, origin="fallback",
                         runtime_library=compiler_stack.runtime_library(),
                         runtime={k: identity.runtime().get(k) for k in RUNTIME_KEYS})
