"""``cached export --flashinfer-cache DIR [--python PYTHON]``: the store's FlashInfer artifacts of
one environment in FlashInfer's own CuTe-DSL disk layout, so a process of that environment
with plain FlashInfer (no client) gets disk hits.

FlashInfer's layout (``flashinfer.jit.cute_dsl_core.JitSpecCuteDsl``), under its
``FLASHINFER_JIT_DIR`` (the ``cached_ops`` folder)::

    <module>_<arch>_cute_dsl/<kernel>.o     the exported object, symbol <module>_<kernel>
    <module>_<arch>_cute_dsl/meta.json      {"arch", "cute_dsl_version", "source_sha256"}
                                            (+ "tvm_ffi": false for plain objects)

The meta FlashInfer accepts is the target environment's own: ``cute_dsl_version`` by its
FlashInfer's rule (0.7.2.post1: the DSL distributions' names and versions; 0.7.4: their
RECORDs too, which hold the environment's install paths) and ``source_sha256`` by its
hasher over the module's key files as installed there (absolute paths included). So both
are computed in that environment: PYTHON (default: this interpreter) runs
:func:`target_main` with only this package and the client package added to its path, and
FlashInfer's own functions, loaded from its files without importing FlashInfer, give the
values. Exported: the artifacts whose key is that environment's (its toolchain fingerprint
and sources, cached_client.identity); others are skipped with the reason.

Objects are written through a temporary file and renamed, and meta.json (the module's
commit marker, as in FlashInfer) after them. A module directory whose meta.json differs is
stale for this environment and is replaced, as FlashInfer's own build would.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from cached_client import Client, identity
from cached_client import flashinfer_names as names
from cached_client import flashinfer_sources as fs
from cached_client.loader import sha256_file

TARGET_MAIN = "from cached.store.export import target_main; target_main()"


class ExportError(RuntimeError):
    """The target environment could not describe itself (no FlashInfer, a failed probe)."""


def sanitize(name: str) -> str:
    return re.sub(r"[^0-9a-zA-Z_]", "_", name)


# -- in the target environment ------------------------------------------------------------


def _load_file(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _function_from_file(path: Path, name: str) -> Callable:
    """One function of a FlashInfer module, with that module's absolute (stdlib) imports,
    without importing FlashInfer (its relative imports are left out)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    body = [n for n in tree.body if (isinstance(n, ast.Import)
                                     or isinstance(n, ast.ImportFrom) and n.level == 0
                                     or isinstance(n, ast.FunctionDef) and n.name == name)]
    if not any(isinstance(n, ast.FunctionDef) for n in body):
        raise ExportError(f"{path} defines no {name}; this FlashInfer is not one export knows")
    namespace: dict[str, Any] = {"__name__": f"_cached_export_{name}"}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102
    return namespace[name]


def flashinfer_functions(root: Path) -> tuple[Callable[[], str], Callable[[tuple], str]]:
    """This environment's FlashInfer ``_get_cute_dsl_version`` and ``_hash_source_files``:
    0.7.4 keeps the hasher in ``jit/_cute_dsl_source.py`` (honouring its strict mode),
    0.7.2.post1 in ``jit/cute_dsl_core.py``."""
    core = root / "jit" / "cute_dsl_core.py"
    version = _function_from_file(core, "_get_cute_dsl_version")
    source = root / "jit" / "_cute_dsl_source.py"
    if source.is_file():
        hasher = _load_file(source, "_cached_flashinfer_cute_dsl_source")._hash_source_files
    else:
        hasher = _function_from_file(core, "_hash_source_files")
    return version, hasher


def describe_target(request: dict) -> dict:
    """What export needs from this environment: its identity (cached_client.identity), its
    FlashInfer's ``cute_dsl_version`` and FlashInfer's source hash of each module asked for
    (``modules``) and of each list of key files (``file_sets``, with this environment's own
    hash of them, to see the sources are still the ones an artifact was built from)."""
    root = fs.package_dir()
    if root is None:
        raise ExportError(f"FlashInfer is not installed in {sys.prefix}")
    version, hasher = flashinfer_functions(root)
    modules = {}
    for module in request.get("modules", []):
        if module == names.MM_FP4_MODULE:
            paths = [str(root / f) for f in fs.MM_FP4_KEY_FILES]
        else:
            bi = fs.bi_jit()
            if bi is None:
                continue
            paths = [str(p) for p in bi.module_sources(module)]
        modules[module] = hasher(tuple(paths))
    file_sets = []
    for files in request.get("file_sets", []):
        try:
            file_sets.append({"source": identity.flashinfer_files_source(tuple(files)),
                              "flashinfer": hasher(tuple(str(root / f) for f in files))})
        except OSError:
            file_sets.append({"source": None, "flashinfer": None})
    out = {"identity": identity.describe(), "cute_dsl_version": version(),
           "modules": modules, "file_sets": file_sets}
    if request.get("jit_dir"):
        from flashinfer.jit import env  # FlashInfer's own rule for its cache directory

        out["jit_dir"] = str(env.FLASHINFER_JIT_DIR)
    return out


def target_main() -> None:
    """Run by the target environment's interpreter: a request on stdin, the answer on the
    last line of stdout."""
    answer = describe_target(json.loads(sys.stdin.read() or "{}"))
    sys.stdout.write("\n" + json.dumps(answer) + "\n")


def run_in(python: str | None, request: dict) -> dict:
    """:func:`describe_target` in the environment of ``python`` (None: this process)."""
    if python is None:
        return describe_target(request)
    from cached.toolchain.toolchains import code_dir, environment

    try:
        out = subprocess.run([python, "-c", TARGET_MAIN], input=json.dumps(request), text=True,
                             capture_output=True, env=environment(), cwd=code_dir(),
                             timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ExportError(f"running {python} failed: {exc}") from None
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        raise ExportError(f"{python} could not describe its environment (exit "
                          f"{out.returncode}): {out.stderr.strip()[-800:]}")
    return json.loads(lines[-1])


# -- in the exporting process -------------------------------------------------------------


def _module(artifact: dict) -> str:
    return artifact["meta"].get("flashinfer_module") or names.MM_FP4_MODULE


def export(socket_path: str, target: Path | None, family: str | None = None,
           python: str | None = None) -> dict:
    """Write every artifact of the environment of ``python`` (None: this one) under
    ``target`` (None: that environment's FLASHINFER_JIT_DIR); returns counts and skip
    reasons."""
    reply = Client(socket_path, timeout=60, identity=False).flashinfer_artifacts(
        family, timeout=600)
    artifacts = reply.artifacts
    jit_files = sorted({tuple(a["params"]["key_files"]) for a in artifacts
                        if a["family"] == names.WRITE_BACK_FAMILY
                        and a["params"].get("key_files")})
    env = run_in(python, {"modules": sorted({_module(a) for a in artifacts
                                             if a["family"] != names.WRITE_BACK_FAMILY}),
                          "file_sets": [list(f) for f in jit_files],
                          "jit_dir": target is None})
    target = Path(env["jit_dir"]) if target is None else target
    file_sets = dict(zip(jit_files, env["file_sets"], strict=True))
    mine = env["identity"]
    report: dict[str, Any] = {"written": 0, "unchanged": 0, "skipped": 0, "modules": 0,
                              "target": str(target), "python": mine["python"],
                              "toolchain": identity.digest(mine["toolchain"]), "reasons": []}
    by_module: dict[str, list[tuple[dict, dict]]] = {}
    for artifact in artifacts:
        source, reason = None, "built by another toolchain than this environment's"
        if artifact["toolchain"] == mine["toolchain"]:
            source, reason = _flashinfer_source(artifact, mine, env, file_sets)
        if reason is not None:
            report["skipped"] += 1
            report["reasons"].append(f"{artifact['kernel_name']}: {reason}")
            continue
        arch = sanitize(artifact["arch"].replace("_", ""))
        meta: dict[str, Any] = {"arch": arch, "cute_dsl_version": env["cute_dsl_version"],
                                "source_sha256": source}
        if artifact["meta"].get("tvm_ffi") is False:
            meta["tvm_ffi"] = False
        module_dir = sanitize(f"{_module(artifact)}_{arch}_cute_dsl")
        by_module.setdefault(module_dir, []).append((artifact, meta))
    target.mkdir(parents=True, exist_ok=True)
    for module_dir, items in sorted(by_module.items()):
        _write_module(target / module_dir, items, report)
    return report


def _flashinfer_source(artifact: dict, mine: dict, env: dict,
                       file_sets: dict) -> tuple[str | None, str | None]:
    """(FlashInfer's source hash for the artifact's meta, or why it is not exported)."""
    family = artifact["family"]
    if family == names.WRITE_BACK_FAMILY:
        files = artifact["params"].get("key_files")
        if not files:  # hashed by the publisher as FlashInfer does, at its install path
            return artifact["params"]["source_sha256"], None
        found = file_sets[tuple(files)]
        if found["source"] != artifact["params"]["source_sha256"]:
            return None, "this environment's FlashInfer sources differ from its build's"
        return found["flashinfer"], None
    if mine["sources"].get(family) != artifact["source_sha256"]:
        return None, "this environment's FlashInfer sources differ from its build's"
    source = env["modules"].get(_module(artifact))
    if source is None:
        return None, f"this environment's FlashInfer has no {_module(artifact)} module"
    return source, None


def _write_module(directory: Path, items: list[tuple[dict, dict]], report: dict) -> None:
    newest = max(items, key=lambda item: item[0]["created"])[1]
    meta_path = directory / "meta.json"
    if directory.exists() and _read_json(meta_path) != newest:
        shutil.rmtree(directory, ignore_errors=True)  # stale for this environment
    directory.mkdir(parents=True, exist_ok=True)
    report["modules"] += 1
    for artifact, meta in items:
        if meta != newest:
            report["skipped"] += 1
            report["reasons"].append(f"{artifact['kernel_name']}: an older build of "
                                     f"{directory.name}'s sources")
            continue
        dest = directory / f"{sanitize(artifact['kernel_name'])}.o"
        if dest.exists() and sha256_file(dest) == artifact["object_sha256"]:
            report["unchanged"] += 1
            continue
        data = Path(artifact["object_path"]).read_bytes()
        if hashlib.sha256(data).hexdigest() != artifact["object_sha256"]:
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


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
