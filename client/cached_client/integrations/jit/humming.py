"""Humming integration: Humming's cubins compiled once per node (family ``humming``).

``install(socket_path=None)`` wraps ``_compile`` of Humming's two compilers
(``NVRTCCompiler``, ``NVCCCompiler`` in ``humming.jit.compiler``). Humming calls it only
on a miss of its own cache, inside its own file lock, after writing ``kernel.cu`` and
``signature.txt`` into the kernel's cache directory. The hook then asks the daemon
(write-back, cached_client.writeback):

- a **hit**: the cubin's bytes, checked against their digest, are written where Humming's
  compiler writes them (``<cache dir>/kernel_tmp.cubin``) and ``_compile`` reports success;
  Humming then post-processes it, renames it to ``kernel.cubin`` and loads it with its own
  loader, exactly as after its own compile;
- a **lease**: Humming's own ``_compile`` runs; the raw cubin it wrote is published (before
  Humming post-processes it: that step is deterministic and runs in every process).

Identity (docs/keys.md): what Humming's signature holds, by content: the compiler class
and its signature (``nvrtc+13.0``), the flags with every ``-I`` directory replaced by a
token (the content of each: cached_client.integrations.jit.content), the kernel
expression, the code, the content of Humming's headers (Humming itself uses their absolute paths and
modification times), the compiler library or binary and the Humming distribution; plus the target
(``sm_90a``) and, as for every request, this environment's toolchain. Targets the daemon
does not key (cached_client.keys.ARCHES) are compiled by Humming alone.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from cached_client import identity, writeback
from cached_client.keys import KernelRequest
from cached_client.protocol import Artifact

from . import content
from .hook import Hook, daemon_arch

FAMILY = "humming"
CUBIN = "kernel_tmp.cubin"
DIST = "humming-kernels"


class HummingHook(Hook):
    """Humming's two compilers' ``_compile`` routed through the daemon (the module doc)."""

    name = "Humming"
    family = FAMILY

    def attach(self) -> None:
        from humming.jit import compiler as hc

        for cls in (hc.NVRTCCompiler, hc.NVCCCompiler):
            original = vars(cls)["_compile"].__func__

            def _compile(cls: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
                return _compile_via_daemon(_original, cls, *args, **kwargs)

            self.replace(cls, "_compile", classmethod(_compile))


install = HummingHook.install
"""Route Humming's compiles through the daemon (``install(socket_path=None, *,
client=None)``); imports ``humming.jit.compiler``. Idempotent."""
uninstall = HummingHook.uninstall
stats = HummingHook.stats
installed = HummingHook.installed


def _toolkit(cls: Any, include_dirs: list[str]) -> str:
    """The compiler's identity by content: its library (NVRTC) or binary and version (nvcc),
    the content of every include directory but Humming's own, Humming's distribution."""
    parts = [cls.signature()]
    if cls.__name__ == "NVRTCCompiler":
        from humming.utils.nvrtc import get_nvrtc_library_path

        parts.append(content.content_id(get_nvrtc_library_path()))
    else:
        nvcc = cls._get_env()["binaries"]["nvcc"]
        parts += [content.content_id(nvcc), content.command_output((nvcc, "--version"))]
    parts += content.contents(include_dirs)
    dist = identity.distributions().get(DIST)
    parts.append(identity.dist_component(dist) if dist is not None else f"{DIST}==unknown")
    return content.sha256_text(*parts)


def request_for(cls: Any, source_path: str, sm_version: str, kernel_expr: str | None,
                flags: list[str]) -> KernelRequest | None:
    """The ``humming`` request of one ``_compile`` call (None: a target the daemon does not
    key). Reads the kernel source Humming just wrote."""
    arch = daemon_arch(sm_version)
    if arch is None:
        return None
    headers = cls.humming_include_dir()
    others = [f[2:] for f in flags if f.startswith("-I") and f[2:] != headers]
    roots = [(headers, "$HUMMING_INCLUDE"),
             *((d, f"$INCLUDE{i}") for i, d in enumerate(others))]
    tokenised = content.tokenise(json.dumps(list(flags)), roots)
    dist = identity.distributions().get(DIST)
    params = {
        "compiler": cls.__name__, "signature": cls.signature(),
        "kernel_expr": " ".join((kernel_expr or "").split()),
        "humming": dist.version if dist is not None else "unknown",
        "code_sha256": content.file_sha256(source_path),
        "flags_sha256": content.sha256_text(tokenised),
        "headers_sha256": content.tree_sha256(str(Path(headers).resolve())),
        "toolkit_sha256": _toolkit(cls, others),
    }
    return KernelRequest(FAMILY, params, arch, 1, 1)


def _write_cubin(cache_dirname: Any, data: bytes) -> None:
    """Put the cubin where Humming's compiler writes it, whole (temporary file, rename)."""
    fd, tmp = tempfile.mkstemp(prefix=".cached-", dir=str(cache_dirname))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, Path(cache_dirname) / CUBIN)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _compile_via_daemon(original: Any, cls: Any, source_path: str, cache_dirname: Any,
                        sm_version: str, kernel_expr: str | None, flags: list[str]) -> Any:
    hook = HummingHook.current()
    if hook is None:
        return original(cls, source_path, cache_dirname, sm_version, kernel_expr, flags)
    name = " ".join((kernel_expr or Path(source_path).parent.name).split())[:200]
    got = hook.ask(name, "asking the daemon for a cubin",
                   lambda: request_for(cls, source_path, sm_version, kernel_expr, flags))
    if got is None:
        return original(cls, source_path, cache_dirname, sm_version, kernel_expr, flags)
    if isinstance(got, Artifact):
        try:
            data = writeback.read_bundle(got)[CUBIN]
        except Exception as exc:  # noqa: BLE001 -- a file that does not match is refused
            hook.refused(name, "reading a cubin from the daemon", exc)
            return original(cls, source_path, cache_dirname, sm_version, kernel_expr, flags)
        _write_cubin(cache_dirname, data)
        hook.counts["hit"] += 1
        return 0, "", ""
    try:  # compiled here under this process's lease
        result = original(cls, source_path, cache_dirname, sm_version, kernel_expr, flags)
    except BaseException as exc:
        got.release(f"{type(exc).__name__}: {exc}")
        raise
    returncode = result[0]
    if returncode != 0:
        got.release(f"{cls.__name__} exited {returncode}")
        return result
    try:
        got.publish_bundle({CUBIN: (Path(cache_dirname) / CUBIN).read_bytes()})
        hook.counts["compiled"] += 1
    except Exception as exc:  # noqa: BLE001 -- compiled here; only the sharing failed
        hook.failed("publishing a cubin", exc)
    return result

