"""The toolchains one daemon compiles with: the inference environments registered on the node.

A toolchain is a Python interpreter and the compiler stack of its environment (FlashInfer,
nvidia-cutlass-dsl, TVM-FFI, torch). ``cached serve --toolchain NAME=PYTHON`` registers
one (repeatable); without any, the daemon's own interpreter is the only one, ``default``.
The first registered is the default toolchain: it serves requests that state no identity
(an older client, ``cached warm``). At start each is probed once (:func:`probe`): its
interpreter runs ``cached_client.identity``, the code every client runs, with nothing but
this package and the client package added to its path (:func:`code_dir`), so the daemon
knows each environment's identity exactly as that environment states it. Its workers are
spawned the same way (cached/pool.py), so its kernels are compiled by exactly its stack.

Routing (:meth:`Toolchains.route`): the requesting environment is the authority. The key is
built from the identity the request states (docs/keys.md), never from the daemon's own:

- FlashInfer families (``Family.sources == "flashinfer"``): key = (request, the client's
  toolchain, the client's sources of the family); a miss is compiled by the registered
  toolchain whose fingerprint and sources both equal the client's, else nobody:
  ``unknown_toolchain`` (the client compiles and may write the result back).
- The project's own families (``"daemon"``: sources are this package's): compiled by the
  toolchain with the client's fingerprint, else the first whose runtime (TVM-FFI version and
  DSL runtime library) is the client's; the key carries that toolchain's fingerprint. None:
  ``toolchain_mismatch`` naming both runtimes.
- Write-back only families (``"params"``: ``flashinfer.jit``): key = (request, the client's
  toolchain); never compiled here.

No identity: the default toolchain's. A hit needs no probe: the key is computed from the
claimed identity and the registry in memory.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cached_client
from cached_client import identity as client_identity
from cached_client import protocol as p
from cached_client.errors import InvalidTactic, ToolchainMismatch, UnknownToolchain
from cached_client.keys import KernelRequest, artifact_key
from cached_client.loader import RUNTIME_LIBRARY_NAME

import cached
from cached.config import ConfigError
from cached.families.base import Family
from cached.log import event, one_line, request_pid, request_uid

log = logging.getLogger("cached.toolchains")

DEFAULT_NAME = "default"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
PROBE_TIMEOUT_S = 120.0
KEYS_MAX = 4096
"""Store keys remembered (:meth:`Toolchains._key`)."""
PROBE = "from cached_client.identity import main; main()"
MAX_UNKNOWN = 32
"""Unknown environments remembered (each logged once); more are counted, not kept."""
MAX_UNKNOWN_PER_UID = 4
"""Of them, those one uid other than root's and the daemon's may add (a peer making up
environments cannot push the real ones out)."""
MAX_VERSIONS = 24
"""Distributions kept of an unknown environment's fingerprint."""


class ToolchainError(ConfigError):
    """A registered toolchain cannot be used (its interpreter is missing or its probe failed)."""


@dataclass(frozen=True)
class Toolchain:
    """One registered environment, as its probe described it."""

    name: str
    python: str
    fingerprint: str
    sources: Mapping[str, str] = field(default_factory=dict)
    runtime: Mapping[str, Any] = field(default_factory=dict)
    runtime_library: str | None = None
    versions: Mapping[str, str] = field(default_factory=dict)
    records: Mapping[str, Any] = field(default_factory=dict, compare=False)
    """``{RECORD path: [stamp, component]}`` and ``{DSL runtime library: [stamp, sha256]}``
    as the probe hashed them (cached_client.identity.records), stated in ``hello`` for
    clients on this node."""

    @property
    def digest(self) -> str:
        return client_identity.digest(self.fingerprint)

    def to_json(self) -> dict:
        return {"name": self.name, "python": self.python, "fingerprint": self.fingerprint,
                "digest": self.digest, "sources": dict(self.sources),
                "runtime": dict(self.runtime), "runtime_library": self.runtime_library,
                "versions": dict(self.versions), "records": dict(self.records)}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Toolchain:
        return cls(str(doc["name"]), str(doc.get("python", "")), str(doc["fingerprint"]),
                   dict(doc.get("sources", {})), dict(doc.get("runtime", {})),
                   doc.get("runtime_library"), dict(doc.get("versions", {})),
                   _records(doc.get("records")))

    def identity(self) -> p.Identity:
        """The identity this environment's own clients state (for ``cached warm --toolchain``)."""
        return p.Identity(toolchain=self.fingerprint, sources=dict(self.sources),
                          runtime=dict(self.runtime))

    def describe_runtime(self) -> str:
        return describe_runtime(self.runtime)


def describe_runtime(runtime: Mapping[str, Any]) -> str:
    sha = runtime.get("dsl_runtime_sha256")
    dsl = runtime.get("dsl")
    return (f"TVM-FFI {runtime.get('tvm_ffi') or 'absent'}, DSL runtime "
            f"{sha[:12] if sha else 'absent'}"
            f"{f' (nvidia-cutlass-dsl {dsl})' if dsl else ' (no nvidia-cutlass-dsl)'}")


def runtime_matches(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether kernels linked in one environment load in the other: the same TVM-FFI version
    and the same DSL runtime library bytes."""
    keys = ("tvm_ffi", "dsl_runtime_sha256")
    return all(a.get(k) for k in keys) and all(a.get(k) == b.get(k) for k in keys)


# -- where this package's code is, for interpreters of other environments -------------------

_code_dir: Path | None = None


def code_dir() -> Path:
    """A private directory holding only the ``cached`` and ``cached_client`` packages (links
    to this daemon's own), for the PYTHONPATH of probes and workers run by another
    environment's interpreter: they import the standard library, that environment's
    compiler stack and this code, nothing of the daemon's own dependencies. Created once per
    process, removed at exit."""
    global _code_dir
    if _code_dir is None:
        _remove_stale_code_dirs()
        path = Path(tempfile.mkdtemp(prefix=f"cached-code-{os.getpid()}-"))
        for package in (cached, cached_client):
            (path / package.__name__).symlink_to(Path(package.__file__).resolve().parent)
        atexit.register(shutil.rmtree, path, True)
        _code_dir = path
    return _code_dir


def _remove_stale_code_dirs() -> None:
    """Remove the code directories of this user's daemons that are gone (one killed with
    SIGKILL cannot remove its own)."""
    for path in Path(tempfile.gettempdir()).glob("cached-code-*-*"):
        try:
            if path.stat().st_uid != os.getuid():
                continue
            os.kill(int(path.name.split("-")[2]), 0)
        except ProcessLookupError:  # its daemon is gone
            shutil.rmtree(path, ignore_errors=True)
        except (OSError, ValueError):  # alive, or not ours to judge
            continue


def environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a probe or worker: the daemon's, with PYTHONPATH = :func:`code_dir`."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONPATH"] = str(code_dir())
    env.update(extra or {})
    return env


def probe(name: str, python: str, timeout: float = PROBE_TIMEOUT_S) -> Toolchain:
    """Describe the environment of ``python`` by running cached_client.identity with it,
    in a process group of its own: one that takes longer than ``timeout`` seconds is killed
    with every process it started. ToolchainError says why it cannot be used, in one line
    of text whatever bytes the interpreter wrote."""
    if not NAME_RE.match(name):
        raise ToolchainError(f"toolchain name {name!r}: use letters, digits, '.', '_', '-'")
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise ToolchainError(f"toolchain {name}: {python} is not an executable interpreter")
    try:
        proc = subprocess.Popen([python, "-c", PROBE], env=environment(), cwd=code_dir(),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
    except OSError as exc:
        raise ToolchainError(f"toolchain {name}: probing {python} failed: {exc}") from None
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise ToolchainError(f"toolchain {name}: probing {python} took over {timeout:g}s; "
                             "it and the processes it started were killed") from None
    lines = stdout.decode("utf-8", "replace").strip().splitlines()
    try:
        doc = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or not isinstance(doc.get("toolchain"), str):
        said = one_line(stderr) or one_line(stdout) or "nothing on stdout or stderr"
        raise ToolchainError(f"toolchain {name}: probing {python} failed (exit "
                             f"{proc.returncode}; it is not an interpreter that prints its "
                             f"identity): {said}")
    return Toolchain(name, python, doc["toolchain"], doc.get("sources", {}),
                     doc.get("runtime", {}), doc.get("runtime_library"), doc.get("versions", {}),
                     _records(doc.get("records")))


def _records(doc: object) -> dict[str, list]:
    """A probe's or a pinned registry's records, the well-formed entries only (absent in
    registries older daemons wrote)."""
    return {k: [v[0], v[1]] for k, v in client_identity.ComponentCache.entries(doc).items()}


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group ``proc`` leads (it and what it started; ``proc`` is not
    reaped yet, so its pid is still the group's) and reap it."""
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.communicate(timeout=5)


# -- routing -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Route:
    """Where a request's artifact is: its key, the toolchain and sources in the key (the
    row's), and the registered toolchain that compiles a miss (None: none may; ``why``)."""

    key: str
    toolchain: str
    source_sha256: str
    compiler: Toolchain | None
    why: str = ""


class Toolchains:
    """The registered toolchains, in order (the first is the default)."""

    def __init__(self, items: Sequence[Toolchain],
                 daemon_sources: Mapping[str, str] | None = None, live: bool = True) -> None:
        if not items:
            raise ToolchainError("no toolchain registered")
        names = [t.name for t in items]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ToolchainError(f"toolchain name(s) registered twice: {', '.join(duplicates)}")
        self.items = tuple(items)
        self.by_name = {t.name: t for t in items}
        self.live = live
        self._daemon_sources = dict(daemon_sources or {})
        self.unknown_environments: dict[str, dict] = {}
        self._unknown_by_uid: dict[int, int] = {}
        """Fingerprint digest -> what the daemon knows of an environment it has no
        toolchain for (:meth:`note_unknown`)."""
        self._keys: dict[tuple, str] = {}

    @property
    def default(self) -> Toolchain:
        return self.items[0]

    @classmethod
    def probe_all(cls, registered: Sequence[tuple[str, str]],
                  timeout: float = PROBE_TIMEOUT_S) -> Toolchains:
        """Probe every registered (name, python), each within ``timeout`` seconds; none
        registered: the daemon's own."""
        pairs = list(registered) or [(DEFAULT_NAME, sys.executable)]
        return cls([probe(name, python, timeout) for name, python in pairs])

    def to_json(self) -> dict:
        return {"toolchains": [t.to_json() for t in self.items],
                "daemon_sources": dict(self._daemon_sources)}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Toolchains:
        """A pinned registry (a serve-only daemon); also reads the one-toolchain form
        ``{"toolchain", "sources"}`` older daemons wrote."""
        if "toolchains" in doc:
            items = [Toolchain.from_json(t) for t in doc["toolchains"]]
            return cls(items, doc.get("daemon_sources", {}), live=False)
        sources = dict(doc.get("sources", {}))
        return cls([Toolchain(DEFAULT_NAME, "", doc["toolchain"], sources)], sources, live=False)

    def by_fingerprint(self, fingerprint: str) -> Toolchain | None:
        return next((t for t in self.items if t.fingerprint == fingerprint), None)

    def daemon_source(self, family: Family) -> str:
        """The hash of one of this package's own families' sources (the same for every
        toolchain: their workers compile from this package)."""
        sha = self._daemon_sources.get(family.name)
        if sha is None:
            if not self.live:
                raise InvalidTactic(f"this serve-only daemon's store has no {family.name} "
                                    "artifacts (no source hash pinned for it)")
            sha = self._daemon_sources[family.name] = family.source_sha256()
        return sha

    def source(self, toolchain: Toolchain, family: Family) -> str:
        """The sources ``toolchain`` compiles ``family`` from."""
        if family.sources == "flashinfer":
            sha = toolchain.sources.get(family.name)
            if sha is None:
                raise InvalidTactic(f"toolchain {toolchain.name} (FlashInfer "
                                    f"{toolchain.versions.get('flashinfer-python', '?')}) has no "
                                    f"{family.name} family")
            return sha
        if family.sources == "params":
            return family.source_sha256()
        return self.daemon_source(family)

    def route(self, family: Family, request: KernelRequest,
              identity: p.Identity | None) -> Route:
        """The key of ``request`` for the environment ``identity`` describes (None: the
        default toolchain) and who compiles it; see the module doc."""
        if identity is None:
            t = self.default
            src = self.source(t, family)
            compiler = t if family.sources != "params" else None
            return Route(self._key(request, t.fingerprint, src), t.fingerprint, src, compiler,
                         "" if compiler else f"{family.name} kernels are written back")
        fp = identity.toolchain
        if family.sources == "flashinfer":
            src = identity.sources.get(family.name)
            if src is None:
                raise UnknownToolchain(f"the client's environment states no sources for "
                                       f"{family.name}: its FlashInfer does not have that family")
            t = next((t for t in self.items
                      if t.fingerprint == fp and t.sources.get(family.name) == src), None)
            why = "" if t else self.unknown(identity, family.name)
            return Route(self._key(request, fp, src), fp, src, t, why)
        if family.sources == "params":
            src = family.source_sha256()
            return Route(self._key(request, fp, src), fp, src, None,
                         f"{family.name} kernels are written back")
        t = self.by_fingerprint(fp) or next(
            (t for t in self.items if runtime_matches(t.runtime, identity.runtime)), None)
        if t is None:
            raise ToolchainMismatch(
                f"{family.name} kernels link against TVM-FFI and the DSL runtime library: this "
                f"process has {describe_runtime(identity.runtime)}, and no toolchain of this "
                "daemon links against that: " + "; ".join(
                    f"{t.name}: {t.describe_runtime()}" for t in self.items)
                + ". Register this environment (cached serve --toolchain NAME=PYTHON) or align "
                "apache-tvm-ffi and nvidia-cutlass-dsl (or $CACHED_DSL_RUNTIME) with one of them")
        src = self.daemon_source(family)
        return Route(self._key(request, t.fingerprint, src), t.fingerprint, src, t)

    def _key(self, request: KernelRequest, toolchain: str, source_sha256: str) -> str:
        """:func:`artifact_key`, remembered (:data:`KEYS_MAX`) by what decides it: the
        request's fields with its params as canonical JSON (``true`` is not ``1``), the
        toolchain fingerprint and the source digest. So environments that state another
        identity but the same toolchain and sources (a client's, ``cached warm``'s none)
        hash a key once."""
        try:
            slot = (request.family, request.arch, request.sm_count,
                    request.max_active_clusters, request.params_json, toolchain, source_sha256)
        except (TypeError, ValueError):  # params JSON cannot hold: artifact_key says why
            return artifact_key(request, toolchain, source_sha256)
        key = self._keys.get(slot)
        if key is None:
            if len(self._keys) >= KEYS_MAX:
                del self._keys[next(iter(self._keys))]
            key = self._keys[slot] = artifact_key(request, toolchain, source_sha256)
        return key

    def planner(self, family: Family, identity: p.Identity | None) -> Toolchain:
        """The toolchain that plans ``family`` for a client: the one that would compile it."""
        if identity is None or family.sources == "params":
            return self.default
        if family.sources == "flashinfer":
            src = identity.sources.get(family.name)
            t = next((t for t in self.items if t.fingerprint == identity.toolchain
                      and src is not None and t.sources.get(family.name) == src), None)
            if t is None:
                raise UnknownToolchain(self.unknown(identity, family.name))
            return t
        return self.by_fingerprint(identity.toolchain) or self.default

    def note_unknown(self, identity: p.Identity, family: str) -> None:
        """Remember an environment no toolchain compiles ``family`` for; the first time,
        log ``toolchain.unknown_environment`` with its fingerprint digest, versions and the
        ``--toolchain`` line that registers it (its interpreter read from the asking
        process, ``/proc/PID/cmdline``, where this daemon may read it)."""
        key = client_identity.digest(identity.toolchain)
        seen = self.unknown_environments.get(key)
        if seen is not None:
            seen["requests"] += 1
            if family not in seen["families"] and len(seen["families"]) < 16:
                seen["families"].append(family)
            return
        if len(self.unknown_environments) >= MAX_UNKNOWN:
            return
        uid = request_uid.get()
        if uid is not None and uid not in (0, os.getuid()):
            if self._unknown_by_uid.get(uid, 0) >= MAX_UNKNOWN_PER_UID:
                return
            self._unknown_by_uid[uid] = self._unknown_by_uid.get(uid, 0) + 1
        pid = request_pid.get()
        python = interpreter_of(pid) if pid else None
        versions = versions_of(identity.toolchain)
        dsl = identity.runtime.get("dsl")
        if dsl and "nvidia-cutlass-dsl" not in versions:
            versions["nvidia-cutlass-dsl"] = str(dsl)
        register = f"cached serve --toolchain NAME={python or 'PYTHON'}"
        self.unknown_environments[key] = {
            "fingerprint": key, "versions": versions, "families": [family], "requests": 1,
            "first_seen": round(time.time(), 3), "pid": pid, "python": python,
            "register": register}
        event(log, logging.WARNING, "toolchain.unknown_environment", fingerprint=key,
              versions=versions, family=family, pid=pid, register=register,
              hint="no registered toolchain is this environment: its processes compile "
                   "in-process (write-back); register it with the line given (PYTHON: that "
                   "environment's interpreter) and restart the daemon")

    def unknown_snapshot(self) -> list[dict]:
        """The unknown environments, oldest first (for stats and the page)."""
        return [dict(v, families=list(v["families"]))
                for v in self.unknown_environments.values()]

    def unknown(self, identity: p.Identity, family: str) -> str:
        """Why no toolchain compiles ``family`` for ``identity`` (the unknown_toolchain message)."""
        self.note_unknown(identity, family)
        same = self.by_fingerprint(identity.toolchain)
        if same is not None:
            detail = (f"toolchain {same.name} has this stack but other {family} sources "
                      f"(FlashInfer {same.versions.get('flashinfer-python', '?')})")
        else:
            detail = (f"its stack ({client_identity.digest(identity.toolchain)}, "
                      f"{describe_runtime(identity.runtime)}) is none of "
                      + ", ".join(f"{t.name} ({t.digest})" for t in self.items))
        return (f"no toolchain of this daemon compiles {family} for the client's environment: "
                f"{detail}. Register it (cached serve --toolchain NAME=PYTHON); meanwhile the "
                "client compiles in-process and writes the result back")

    def runtime_library(self, fingerprint: str) -> dict:
        """The runtime library an artifact of ``fingerprint`` was linked against, with the
        path in that toolchain's environment (None for an unregistered one)."""
        t = self.by_fingerprint(fingerprint)
        return {"name": RUNTIME_LIBRARY_NAME,
                "path": t.runtime_library if t is not None else None}

    def snapshot(self) -> list[dict]:
        """Each toolchain for people: name, python, readable versions, fingerprint digest,
        the families it compiles (:func:`compiled_families`)."""
        return [{"name": t.name, "python": t.python, "fingerprint": t.digest,
                 "versions": dict(t.versions), "families": compiled_families(t),
                 "runtime": t.describe_runtime(), "default": t is self.default}
                for t in self.items]


def compiled_families(toolchain: Toolchain) -> list[str]:
    """The registered families ``toolchain`` compiles: the project's own (every toolchain
    compiles them) and the FlashInfer families its FlashInfer has; never the write-back
    ones (``"params"``)."""
    from cached import families

    return sorted(n for n in families.names()
                  if families.get(n).sources == "daemon"
                  or families.get(n).sources == "flashinfer" and n in toolchain.sources)
def versions_of(fingerprint: str) -> dict[str, str]:
    """``{distribution: version}`` read from a toolchain fingerprint
    (cached_client.identity.toolchain: ``tag;soabi;name==version:sha256;...``), with
    ``python`` the cache tag."""
    parts = fingerprint.split(";")
    out = {"python": parts[0][:32]} if parts and parts[0] else {}
    for part in parts[2:]:
        name, sep, rest = part.partition("==")
        if sep and name:
            out[name[:64]] = rest.split(":", 1)[0][:64]
            if len(out) >= MAX_VERSIONS:
                break
    return out


def interpreter_of(pid: int) -> str | None:
    """The interpreter process ``pid`` was started with (its ``argv[0]``, made absolute
    against its working directory), when this process may read it and it is an executable
    file; else None. A virtual environment's ``bin/python`` stays as it was named (its
    real executable would name the base interpreter, not the environment)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv0 = f.read(4096).split(b"\0", 1)[0].decode()
        if "/" not in argv0:
            return None
        if not argv0.startswith("/"):
            argv0 = os.path.join(os.readlink(f"/proc/{pid}/cwd"), argv0)
    except (OSError, UnicodeDecodeError):
        return None
    path = os.path.normpath(argv0)
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None
