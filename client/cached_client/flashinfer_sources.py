"""FlashInfer's kernel sources per daemon family: which files, found without importing FlashInfer.

One definition for both sides: the client's identity (cached_client.identity) hashes these
files to state the sources it would compile from, the daemon's families use the same lists,
and ``cached export`` gives them to FlashInfer's own hasher in the target environment.
Paths are relative to the ``flashinfer`` package directory, so the same files installed at
two paths are the same sources. Stdlib only; nothing of FlashInfer is imported (its
batch-invariant closure walk is loaded from its file, see :func:`bi_jit`).

Families and FlashInfer versions: ``flashinfer.mm_fp4`` exists in 0.7.2.post1 and 0.7.4
(byte-identical kernel files); ``flashinfer.bi.*`` only where FlashInfer has its
batch-invariant modules (0.7.4): :func:`family_files` returns None elsewhere.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
from pathlib import Path
from types import ModuleType

from .flashinfer_names import BI_BLOCKSCALED_MODULE, BI_DENSE_MODULE, MM_FP4_MODULE

MM_FP4_KEY_FILES = (
    "gemm/gemm_mm_fp4_cute_dsl.py",
    "gemm/kernels/dense_blockscaled_gemm_sm100.py",
    "gemm/kernels/dense_blockscaled_gemm_sm100_common.py",
    "gemm/kernels/dense_blockscaled_gemm_sm103.py",
)
"""FlashInfer's own ``_blockscaled_gemm_cache_key_files()``: what its disk cache keys mm_fp4 on
(its ``meta.json``'s ``source_sha256``)."""
MM_FP4_SOURCES = (*MM_FP4_KEY_FILES, "gemm/kernels/dense_blockscaled_gemm_sm100_splitk.py")
"""What the ``flashinfer.mm_fp4`` family's key hashes: FlashInfer's list plus the split-K kernel
(``kernel_type`` ``sm100sk``), which FlashInfer's list omits."""
BI_FAMILY_MODULES = {
    "flashinfer.bi.bmm_fp8": (BI_DENSE_MODULE,),
    "flashinfer.bi.mm_fp4": (BI_BLOCKSCALED_MODULE, BI_DENSE_MODULE),  # the split's fixup
}
FAMILIES = ("flashinfer.mm_fp4", *BI_FAMILY_MODULES)
_BI_IMPORT = ("from ..jit.cute_dsl_core import build_and_load_cute_dsl_kernel, "
              "sanitize_symbol_name")


class SourcesUnavailable(LookupError):
    """This environment's FlashInfer does not have the sources asked for."""


def package_dir() -> Path | None:
    """The ``flashinfer`` package directory of this environment, or None (not installed)."""
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


@functools.cache
def bi_jit() -> ModuleType | None:
    """FlashInfer's ``batch_invariant/jit.py`` (its cache modules' closure walk), loaded from its
    file with its one package import removed (the walk does not use it); None where this
    FlashInfer has no batch-invariant modules (0.7.2.post1)."""
    root = package_dir()
    path = root / "batch_invariant" / "jit.py" if root is not None else None
    if path is None or not path.is_file():
        return None
    text = path.read_text()
    if _BI_IMPORT not in text:
        raise SourcesUnavailable(f"{path} changed shape; update cached_client.flashinfer_sources")
    spec = importlib.util.spec_from_loader("_cached_flashinfer_bi_jit", loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    module.__file__ = str(path)
    exec(compile(text.replace(_BI_IMPORT, ""), str(path), "exec"), module.__dict__)  # noqa: S102
    return module


@functools.cache
def module_files(module: str) -> tuple[str, ...]:
    """The key files of one FlashInfer CuTe-DSL cache module, relative to the package, as
    FlashInfer keys its disk cache on them; SourcesUnavailable where this FlashInfer lacks
    the module."""
    if module == MM_FP4_MODULE:
        return MM_FP4_KEY_FILES
    bi = bi_jit()
    if bi is None:
        raise SourcesUnavailable(f"this FlashInfer has no {module} module")
    return tuple(bi.relative_sources(module))


def family_files(family: str, root: Path | None = None) -> tuple[str, ...] | None:
    """The files a daemon family's key hashes, relative to the package (``root``, when the
    caller found it already: :func:`package_dir`); None when this environment's FlashInfer
    lacks the family (or FlashInfer is absent). KeyError for a family whose sources are not
    FlashInfer's."""
    if (root or package_dir()) is None:
        return None
    if family == "flashinfer.mm_fp4":
        return MM_FP4_SOURCES
    modules = BI_FAMILY_MODULES[family]
    try:
        return tuple(sorted({f for m in modules for f in module_files(m)}))
    except SourcesUnavailable:
        return None


def content_sha256(root: Path, relative: tuple[str, ...]) -> str:
    """sha256 over (relative path, size, bytes) of each file, sorted by path: the same files at
    any install path give the same hash. FileNotFoundError for a missing file."""
    digest = hashlib.sha256()
    for rel in sorted(set(relative)):
        data = (root / rel).read_bytes()
        digest.update(f"{rel}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()
