"""``cached export --flashinfer-cache DIR``: the store's FlashInfer artifacts in FlashInfer's
own CuTe-DSL disk layout, so a process with plain FlashInfer (no client) gets disk hits.

FlashInfer's layout (``flashinfer.jit.cute_dsl_core.JitSpecCuteDsl``), under its
``FLASHINFER_JIT_DIR`` (the ``cached_ops`` folder)::

    <module>_<arch>_cute_dsl/<kernel>.o     the exported object, symbol <module>_<kernel>
    <module>_<arch>_cute_dsl/meta.json      {"arch", "cute_dsl_version", "source_sha256"}
                                            (+ "tvm_ffi": false for plain objects)

``meta.json`` is written exactly as ``JitSpecCuteDsl.expected_meta``: the arch sanitised as
FlashInfer does (``sm_100a`` -> ``sm100a``), the toolchain fingerprint (equal to FlashInfer's
``_get_cute_dsl_version()``) and FlashInfer's hash of the module's key files. Objects are
written through a temporary file and renamed, and meta.json (the module's commit marker,
as in FlashInfer) after them. A module directory whose meta.json differs is stale for this
environment and is replaced, as FlashInfer's own build would. Artifacts built by another
toolchain, or whose sources no longer match FlashInfer's installed sources, are skipped.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from cached_client import Client
from cached_client import flashinfer_names as names
from cached_client.loader import sha256_file

from . import families, toolchain


def sanitize(name: str) -> str:
    return re.sub(r"[^0-9a-zA-Z_]", "_", name)


def default_flashinfer_cache() -> Path:
    """The current environment's ``FLASHINFER_JIT_DIR`` (honours FLASHINFER_WORKSPACE_BASE)."""
    from flashinfer.jit import env

    return Path(env.FLASHINFER_JIT_DIR)


def expected_meta(artifact: dict) -> tuple[str, dict]:
    """(module directory name, meta.json) FlashInfer expects for this artifact."""
    meta = artifact["meta"]
    module = meta.get("flashinfer_module") or names.MM_FP4_MODULE
    arch = sanitize(artifact["arch"].replace("_", ""))
    expected: dict[str, Any] = {
        "arch": arch, "cute_dsl_version": artifact["toolchain"],
        "source_sha256": meta.get("flashinfer_source_sha256") or artifact["source_sha256"],
    }
    if meta.get("tvm_ffi") is False:
        expected["tvm_ffi"] = False
    return sanitize(f"{module}_{arch}_cute_dsl"), expected


def current_sources(artifact: dict) -> str | None:
    """FlashInfer's present hash of the artifact's sources, when the daemon family knows it."""
    family, meta = artifact["family"], artifact["meta"]
    if family == "flashinfer.mm_fp4":
        return families.get(family).source_sha256()
    if family.startswith("flashinfer.bi."):
        from .families.flashinfer_bi import module_source_sha256

        return module_source_sha256(meta["flashinfer_module"])
    return None  # write-back: hashed by the publishing client as FlashInfer does


def export(socket_path: str, target: Path, family: str | None = None) -> dict:
    """Write every exportable artifact under ``target``; returns counts and skip reasons."""
    reply = Client(socket_path, timeout=60).flashinfer_artifacts(family, timeout=600)
    fingerprint = toolchain.fingerprint()
    report: dict[str, Any] = {"written": 0, "unchanged": 0, "skipped": 0, "modules": 0,
                              "target": str(target), "reasons": []}
    by_module: dict[str, list[tuple[dict, dict]]] = {}
    for artifact in reply.artifacts:
        module_dir, meta = expected_meta(artifact)
        reason = None
        if artifact["toolchain"] != fingerprint:
            reason = "built by another toolchain than this environment's"
        else:
            current = current_sources(artifact)
            if current is not None and current != meta["source_sha256"]:
                reason = "FlashInfer's sources changed since it was built"
        if reason:
            report["skipped"] += 1
            report["reasons"].append(f"{artifact['kernel_name']}: {reason}")
            continue
        by_module.setdefault(module_dir, []).append((artifact, meta))
    target.mkdir(parents=True, exist_ok=True)
    for module_dir, items in sorted(by_module.items()):
        newest = max(items, key=lambda item: item[0]["created"])[1]
        directory = target / module_dir
        meta_path = directory / "meta.json"
        if directory.exists() and _read_json(meta_path) != newest:
            shutil.rmtree(directory, ignore_errors=True)  # stale for this environment
        directory.mkdir(parents=True, exist_ok=True)
        report["modules"] += 1
        for artifact, meta in items:
            if meta != newest:
                report["skipped"] += 1
                report["reasons"].append(f"{artifact['kernel_name']}: an older build of "
                                         f"{module_dir}'s sources")
                continue
            dest = directory / f"{sanitize(artifact['kernel_name'])}.o"
            if dest.exists() and sha256_file(dest) == artifact["object_sha256"]:
                report["unchanged"] += 1
                continue
            data = Path(artifact["object_path"]).read_bytes()
            if _sha256(data) != artifact["object_sha256"]:
                report["skipped"] += 1
                report["reasons"].append(f"{artifact['kernel_name']}: blob changed on disk")
                continue
            tmp = dest.with_suffix(f".o.tmp.{os.getpid()}")
            tmp.write_bytes(data)
            os.replace(tmp, dest)
            report["written"] += 1
        if _read_json(meta_path) != newest:
            tmp = meta_path.with_suffix(f".json.tmp.{os.getpid()}")
            tmp.write_text(json.dumps(newest, indent=2))
            os.replace(tmp, meta_path)
    return report


def _sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
