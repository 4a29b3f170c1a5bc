"""The calling environment's identity: what it states on every request that can return an artifact.

The requesting environment is the authority on identity (docs/keys.md): the client states
its own compiler stack and kernel sources, and the daemon serves an artifact only when the
key built from them matches. The daemon probes each registered toolchain with this same
module, run by that toolchain's interpreter (``python -m cached_client.identity``), so the
two sides compute identity with one implementation.

Three parts, each independent of where the environment is installed and of how pip was
invoked:

- **toolchain** (:func:`toolchain`): Python's cache tag and SOABI, then for torch,
  apache-tvm-ffi and every nvidia-cutlass-dsl* distribution ``name==version:sha256`` of its
  RECORD entries for files inside site-packages that have a hash. Left out: entries outside
  (``../../../bin/torchrun``, whose shebang holds the environment's path) and the
  distribution's own metadata files (``REQUESTED``, ``INSTALLER``, ``direct_url.json``,
  ``RECORD``), which depend on the install command. A rebuilt wheel of one version still
  differs (its files' hashes do).
- **sources** (:func:`family_source`), per daemon family whose kernel sources are
  FlashInfer's: the ``flashinfer-python`` distribution (same rule) and the content of the
  family's files (cached_client.flashinfer_sources) by path relative to the package. None
  where this environment's FlashInfer lacks the family.
- **runtime** (:func:`runtime`): what a loaded kernel needs, for the project's own kernels:
  the TVM-FFI version and the sha256 of the DSL runtime library this process opens
  ($CACHED_DSL_RUNTIME, e.g. a bare library carried on a GPU node, else the installed DSL's).

Stdlib only, nothing heavy imported (distributions are found by their ``.dist-info``
directory names on ``sys.path``, as importlib.metadata would, without parsing every
METADATA); every value is computed once per process. What is costly to find again (a RECORD's
component, the DSL runtime's digest, a directory's ``.dist-info`` names, the content digest of
a family's files) is remembered by the stamps of what it was read from (:class:`ComponentCache`).
"""

from __future__ import annotations

import base64
import csv
import functools
import hashlib
import importlib.machinery
import json
import logging
import os
import re
import stat
import sys
import sysconfig
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from . import flashinfer_sources
from .errors import IntegrityError
from .loader import (
    RUNTIME_LIBRARY_ENV,
    open_private_dir,
    open_private_file,
    runtime_library_path,
    write_private_file,
)
from .paths import scratch_dir

STACK_NAMES = ("torch", "apache-tvm-ffi")
STACK_PREFIX = "nvidia-cutlass-dsl"
FLASHINFER_DIST = "flashinfer-python"
VERSION_NAMES = ("flashinfer-python", "nvidia-cutlass-dsl", "apache-tvm-ffi", "torch")
IDENTITY_CACHE_ENV = "CACHED_IDENTITY_CACHE"
_SYSCONFIG_LOCK = threading.Lock()
logger = logging.getLogger("cached_client")
_DIST_INFO = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)\.dist-info$")
_SEPARATORS = re.compile(r"[-_.]+")
SOURCES_PREFIX = "sources:"
"""Key prefix of a family's content digest in the component cache (no file of that name)."""
RACY_S = 2.0
"""A listing or content digest is remembered only when what it was read from last changed
more than this long before (seconds): a change within one timestamp tick of the read would
keep its stamp."""
LARGE_LISTING = 64
"""Entries of a directory whose fresh listing is worth writing the cache for at once."""
_used: dict[str, list] = {}
"""Listings and content digests this process used, ``{key: [stamp, value]}`` (records)."""


@dataclass(frozen=True)
class Dist:
    """An installed distribution: normalised name, version and its .dist-info directory
    (``location``, a path string; :attr:`path` as a Path)."""

    name: str
    version: str
    location: str

    @functools.cached_property
    def path(self) -> Path:
        return Path(self.location)


def normalise(name: str) -> str:
    return _SEPARATORS.sub("-", name).lower()


@functools.cache
def distributions() -> dict[str, Dist]:
    """Installed distributions by normalised name; the first on ``sys.path`` wins."""
    found: dict[str, Dist] = {}
    cache = _component_cache()
    worth_writing = False
    for entry in sys.path:
        directory = entry or "."
        names, large = dist_info_names(directory, cache)
        worth_writing = worth_writing or large
        for item in names:
            m = _DIST_INFO.match(item)
            if m is not None:
                name = normalise(m["name"])
                if name not in found:
                    found[name] = Dist(name, m["version"], os.path.join(directory, item))
    if worth_writing:
        cache.save()
    return found


def dist_info_names(directory: str, cache: ComponentCache) -> tuple[list[str], bool]:
    """(the ``.dist-info`` names in ``directory``, sorted; whether a listing of at least
    LARGE_LISTING entries was remembered now, worth a write of the cache): ``cache``'s
    listing while the directory's stamp is the one it was listed at (adding, removing or
    renaming an entry changes a directory's mtime), else a listing, remembered once the
    directory has not changed for RACY_S (a smaller one is written with the cache's next
    entry: listing it costs less than a write); stamped before it is listed, so a change
    meanwhile only costs a listing next time. [] for what is no directory."""
    try:
        st = os.stat(directory)
    except OSError:
        return [], False
    if not stat.S_ISDIR(st.st_mode):
        return [], False
    key, stamp = os.path.abspath(directory), _stamp(st)
    held = cache.components.get(key)
    if held is not None and held[0] == stamp:
        _used[key] = [stamp, held[1]]
        return (held[1].split("\0") if held[1] else []), False
    try:
        listing = os.listdir(directory)
    except OSError:
        return [], False
    names = sorted(n for n in listing if n.endswith(".dist-info"))
    if not _settled(st):
        return names, False
    value = "\0".join(names)
    cache.remember(key, stamp, value)
    _used[key] = [stamp, value]
    return names, len(listing) >= LARGE_LISTING


def _settled(*stats: os.stat_result) -> bool:
    """Whether each of these was last changed more than RACY_S ago."""
    now = time.time_ns()
    return all(now - st.st_mtime_ns > RACY_S * 1e9 for st in stats)


@functools.cache
def dist_files(dist: Dist) -> tuple[tuple[str, str], ...]:
    """(path, hash) of the RECORD entries that are the distribution's installed content."""
    try:
        text = (dist.path / "RECORD").read_text()
    except OSError:
        return ()
    own = dist.path.name + "/"
    out = []
    for line in text.splitlines():
        if '"' in line:  # a quoted path (it has a comma): the csv rules
            row = next(csv.reader([line]), [])
        else:
            row = line.rsplit(",", 2)
        if len(row) < 2 or not row[1]:
            continue  # RECORD itself, compiled .pyc files: no hash
        path = row[0]
        if path.startswith(("../", "/", own)):
            continue  # outside site-packages (scripts), or install metadata
        out.append((path, row[1]))
    out.sort()
    return tuple(out)


def dist_component(dist: Dist) -> str:
    """``name==version:sha256`` of a distribution's installed content (see the module doc),
    from this user's component cache while the distribution's RECORD is unchanged."""
    record = str(dist.path / "RECORD")
    try:
        stamp = _stamp(os.stat(record))
    except OSError:
        stamp = None
    cache = _component_cache()
    hit = cache.components.get(record)
    if stamp is not None and hit is not None and hit[0] == stamp:
        return hit[1]
    digest = hashlib.sha256("\n".join(f"{p},{h}" for p, h in dist_files(dist)).encode())
    component = f"{dist.name}=={dist.version}:{digest.hexdigest()}"
    if stamp is not None:
        cache.put(record, stamp, component)
    return component


def _stamp(st: os.stat_result) -> list[int]:
    """What changes when a file is rewritten: device, inode, size, mtime (ns)."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


class ComponentCache:
    """Digests of files by path and :func:`_stamp`: :func:`dist_component` of a RECORD, the
    DSL runtime library's sha256 (:func:`runtime`), a ``sys.path`` directory's ``.dist-info``
    names (:func:`dist_info_names`) and, under :data:`SOURCES_PREFIX`, the content digest of
    a family's files by their stamps (:func:`files_content`), kept in ``path`` (JSON, this
    user's private directory) so a process does not hash the RECORD of every stack
    distribution again (torch's lists some 12,000 files), nor parse the DSL's to find its
    runtime's, nor list site-packages, nor read FlashInfer's kernel files.

    Invariants: an entry is used only while its file's (or files') stamp is unchanged (pip
    writes a new RECORD on every install); at most MAX_ENTRIES entries; the file is read once per
    process and written atomically, both through a descriptor of its directory checked at
    that moment (cached_client.loader.open_private_dir: a real directory of this uid that
    only it can write) and only as a regular file of this uid (no link). Absence, a
    directory or file that fails the check, one over MAX_BYTES, or one that is not a
    well-formed cache (too deeply nested to parse included) costs a recompute, never an
    error and never trust (tests/test_client_trust.py,
    ``test_an_identity_cache_another_uid_planted_is_never_trusted``)."""

    VERSION = 1
    MAX_ENTRIES = 256
    MAX_BYTES = 1 << 20

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.components: dict[str, tuple[list[int], str]] = {}
        self._lock = threading.Lock()
        if path is not None:
            self.components = self._read(path)

    @staticmethod
    def _read(path: str) -> dict[str, tuple[list[int], str]]:
        directory, name = os.path.split(path)
        try:
            dir_fd = open_private_dir(directory or ".", create=False)
        except (OSError, IntegrityError):
            return {}  # absent, or not ours alone: computed
        try:
            fd = open_private_file(dir_fd, name)
        finally:
            os.close(dir_fd)
        if fd is None:
            return {}
        try:
            with os.fdopen(fd, "rb") as f:
                raw = f.read(ComponentCache.MAX_BYTES + 1)
        except OSError:
            return {}
        if len(raw) > ComponentCache.MAX_BYTES:
            return {}
        try:
            data = json.loads(raw)
        except ValueError:
            return {}
        except RecursionError:
            logger.warning("cached: the identity cache %s is nested too deeply to read; "
                           "computing this environment's identity instead", path)
            return {}
        if not isinstance(data, dict) or data.get("version") != ComponentCache.VERSION:
            return {}
        return ComponentCache.entries(data.get("components"))

    @staticmethod
    def entries(doc: object) -> dict[str, tuple[list[int], str]]:
        """The well-formed entries of ``{record: [stamp, component]}`` (at most
        MAX_ENTRIES); anything else in ``doc`` is left out."""
        out: dict[str, tuple[list[int], str]] = {}
        if not isinstance(doc, dict):
            return out
        for record, value in doc.items():
            if len(out) >= ComponentCache.MAX_ENTRIES:
                break
            if (isinstance(record, str) and isinstance(value, list) and len(value) == 2
                    and isinstance(value[1], str) and isinstance(value[0], list)
                    and len(value[0]) == 4 and all(type(x) is int for x in value[0])):
                out[record] = (value[0], value[1])
        return out

    def adopt(self, doc: object) -> int:
        """Use the daemon's components (its probes of its registered toolchains, from its
        ``hello``) as this process's own: each entry whose stamp is the stamp of that RECORD
        here and now, so it names the same file this process would hash (the next
        :meth:`put` writes it to this user's file with the rest). An entry already held at
        that stamp is kept and costs no stat. Returns how many were adopted; a malformed
        ``doc`` adopts nothing."""
        adopted = 0
        for record, (stamp, component) in self.entries(doc).items():
            held = self.components.get(record)
            if held is not None and held[0] == stamp:
                continue  # known at this stamp (a later hello): no stat, own value kept
            if not record.startswith(SOURCES_PREFIX):  # those: their files' stamps, at use
                try:
                    if _stamp(os.stat(record)) != stamp:
                        continue
                except OSError:
                    continue
            with self._lock:
                self.components[record] = (stamp, component)
            adopted += 1
        return adopted

    def put(self, record: str, stamp: list[int], component: str) -> None:
        """Remember one component and rewrite the file (best effort)."""
        self.remember(record, stamp, component)
        self.save()

    def remember(self, record: str, stamp: list[int], component: str) -> None:
        """Hold one component in memory; :meth:`save` writes it."""
        with self._lock:
            self.components[record] = (stamp, component)

    def save(self) -> None:
        """Rewrite the file with what is held (best effort)."""
        with self._lock:
            if self.path is None:
                return
            if len(self.components) > self.MAX_ENTRIES:  # files gone first, then oldest
                alive = {k: v for k, v in self.components.items()
                         if k.startswith(SOURCES_PREFIX) or os.path.exists(k)}
                self.components = dict(list(alive.items())[-self.MAX_ENTRIES:])
            data = {"version": self.VERSION,
                    "components": {k: [v[0], v[1]] for k, v in self.components.items()}}
            directory, name = os.path.split(self.path)
            try:
                dir_fd = open_private_dir(directory or ".")
            except (OSError, IntegrityError):
                return  # not ours alone now: not written
            try:
                write_private_file(dir_fd, name, [json.dumps(data).encode()])
            except OSError:
                pass
            finally:
                os.close(dir_fd)


@functools.cache
def _component_cache() -> ComponentCache:
    """This process's component cache: $CACHED_IDENTITY_CACHE when set ("" turns it off),
    else ``stack-digests.json`` in the client's private scratch directory (paths.scratch_dir;
    whether that is ours alone is checked at each read and write, not here)."""
    configured = os.environ.get(IDENTITY_CACHE_ENV)
    if configured == "":
        return ComponentCache(None)
    return ComponentCache(configured or os.path.join(scratch_dir(), "stack-digests.json"))


def records() -> dict[str, list]:
    """``{RECORD path: [stamp, component]}`` of the stack's and FlashInfer's distributions,
    ``{runtime library path: [stamp, sha256]}`` of the DSL runtime, then the directory
    listings and content digests this process used (:func:`dist_info_names`,
    :func:`files_content`): what the daemon states in its ``hello`` so a client on the node
    need not hash, list or read them (ComponentCache.adopt)."""
    out: dict[str, list] = {}
    for name, dist in distributions().items():
        if name in STACK_NAMES or name.startswith(STACK_PREFIX) or name == FLASHINFER_DIST:
            record = str(dist.path / "RECORD")
            try:
                stamp = _stamp(os.stat(record))
            except OSError:
                continue
            out[record] = [stamp, dist_component(dist)]
    path, sha = runtime_library_path(), runtime()["dsl_runtime_sha256"]
    if path is not None and sha is not None:
        try:
            out[path] = [_stamp(os.stat(path)), sha]
        except OSError:
            pass
    for key, entry in _used.items():
        out.setdefault(key, entry)
    return out


def adopt(doc: object) -> int:
    """This process's component cache adopts the daemon's stated components
    (ComponentCache.adopt); the number adopted."""
    return _component_cache().adopt(doc)


def adopt_stated(toolchains: object) -> None:
    """:func:`adopt` the ``records`` of each toolchain a daemon's ``hello`` lists (at most
    64): the node's first process need not hash torch's RECORD before its first load."""
    if isinstance(toolchains, list):
        for entry in toolchains[:64]:
            if isinstance(entry, dict):
                adopt(entry.get("records"))


@functools.cache
def toolchain() -> str:
    """This environment's compiler stack fingerprint (see the module doc)."""
    stack = [dist_component(d) for name, d in distributions().items()
             if name in STACK_NAMES or name.startswith(STACK_PREFIX)]
    return ";".join([str(sys.implementation.cache_tag), soabi(),
                     *sorted(stack)])


def soabi() -> str:
    """The interpreter's extension ABI tag (``cpython-311-x86_64-linux-gnu``), as
    ``sysconfig.get_config_var("SOABI")`` gives it, read from the extension suffixes that
    are fixed at start-up: Python 3.11's sysconfig fills its variables lazily without a
    lock, so two threads asking first at once can get None
    (test_toolchains.py::test_the_fingerprint_is_the_same_in_threads_asking_at_once)."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        parts = suffix.split(".")
        if len(parts) == 3 and parts[2] == "so" and parts[1]:
            return parts[1]
    with _SYSCONFIG_LOCK:
        return str(sysconfig.get_config_var("SOABI"))


def digest(fingerprint: str) -> str:
    """A short stable name for a fingerprint: 16 hex digits."""
    return hashlib.sha256(fingerprint.encode()).hexdigest()[:16]


@functools.cache
def family_source(family: str) -> str | None:
    """The sources this environment would compile ``family`` from, or None when they are not
    FlashInfer's (the daemon's own families) or this FlashInfer lacks the family."""
    if family not in flashinfer_sources.FAMILIES:
        return None
    root = flashinfer_sources.package_dir()
    files = None if root is None else flashinfer_sources.family_files(family, root)
    if files is None:
        return None
    try:
        return flashinfer_files_source(files, root)
    except OSError:
        return None


def flashinfer_files_source(files: tuple[str, ...], root: Path | None = None) -> str:
    """The sources a kernel compiled from these FlashInfer files (relative to the package
    ``root``, by default this environment's) has in this environment: the FlashInfer
    distribution's installed content (which covers the helpers the files import) and the
    files' own content (which covers an editable install, whose RECORD lists no files).
    OSError for a missing file or no FlashInfer."""
    root = root or flashinfer_sources.package_dir()
    if root is None:
        raise FileNotFoundError("FlashInfer is not installed here")
    dist = distributions().get(FLASHINFER_DIST)
    dist_part = dist_component(dist) if dist is not None else "flashinfer-python==unknown"
    content = files_content(root, files)
    return hashlib.sha256(f"{dist_part}\n{content}".encode()).hexdigest()


def files_content(root: Path, files: tuple[str, ...]) -> str:
    """flashinfer_sources.content_sha256 of ``files`` under ``root``: this user's (or the
    daemon's adopted) digest while every file's stamp is the one it was read at (stamped
    before it is read, so a change meanwhile only costs a read next time; remembered once
    none has changed for RACY_S). FileNotFoundError for a missing file."""
    names = sorted(set(files))
    stats = [os.stat(root / rel) for rel in names]
    key = SOURCES_PREFIX + json.dumps([str(root), names])
    stamp = _files_stamp(stats)
    cache = _component_cache()
    held = cache.components.get(key)
    if held is not None and held[0] == stamp:
        _used[key] = [stamp, held[1]]
        return held[1]
    content = flashinfer_sources.content_sha256(root, tuple(names))
    if all(stat.S_ISREG(st.st_mode) for st in stats) and _settled(*stats):
        cache.put(key, stamp, content)
        _used[key] = [stamp, content]
    return content


def _files_stamp(stats: list[os.stat_result]) -> list[int]:
    """One stamp for several files, in order: four 62-bit words of the sha256 of each one's
    :func:`_stamp` (equal only while every stamp is)."""
    raw = hashlib.sha256(json.dumps([_stamp(st) for st in stats]).encode()).digest()
    return [int.from_bytes(raw[i:i + 8], "big") >> 2 for i in range(0, 32, 8)]


def _record_sha256(path: str) -> str | None:
    """The RECORD hash (hex) of an installed DSL file, so the library is not read to hash it."""
    for name, dist in distributions().items():
        if not name.startswith(STACK_PREFIX):
            continue
        try:
            rel = Path(path).relative_to(dist.path.parent).as_posix()
        except ValueError:
            continue
        value = dict(dist_files(dist)).get(rel, "")
        if value.startswith("sha256="):
            raw = value.removeprefix("sha256=")
            return base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)).hex()
    return None


def _sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _runtime_sha256(path: str) -> str:
    """The sha256 of the DSL runtime library at ``path``: this user's (or the daemon's
    adopted) digest while the file's stamp is the one it was taken at, else its RECORD's
    hash (an installed DSL; not for $CACHED_DSL_RUNTIME) or its bytes', remembered."""
    cache = _component_cache()
    try:
        stamp = _stamp(os.stat(path))
    except OSError:
        stamp = None
    held = cache.components.get(path)
    if stamp is not None and held is not None and held[0] == stamp:
        return held[1]
    sha = (None if os.environ.get(RUNTIME_LIBRARY_ENV) else _record_sha256(path)) \
        or _sha256_file(path)
    if stamp is not None:
        cache.put(path, stamp, sha)
    return sha


@functools.cache
def runtime() -> dict:
    """What a loaded kernel of the project's own families needs: ``tvm_ffi`` (version),
    ``dsl_runtime_sha256`` (of :func:`runtime_library_path`) and, for messages only,
    ``dsl`` (the nvidia-cutlass-dsl version, or None for a bare carried library)."""
    dists = distributions()
    path = runtime_library_path()
    sha = None
    if path is not None:
        sha = _runtime_sha256(path)
    tvm, dsl = dists.get("apache-tvm-ffi"), dists.get(STACK_PREFIX)
    return {"tvm_ffi": tvm.version if tvm else None, "dsl_runtime_sha256": sha,
            "dsl": dsl.version if dsl else None}


def versions() -> dict[str, str]:
    """Readable versions of the stack, for people (hello, stats, ``cached toolchains``)."""
    dists = distributions()
    out = {"python": sys.version.split()[0]}
    for name in VERSION_NAMES:
        out[name] = dists[name].version if name in dists else "absent"
    return out


def for_families(families: Iterable[str]) -> dict:
    """The identity a request states (its wire form): the toolchain, the sources of the
    families it names that this environment has, and the runtime."""
    sources = {}
    for family in sorted(set(families)):
        sha = family_source(family)
        if sha is not None:
            sources[family] = sha
    return {"toolchain": toolchain(), "sources": sources, "runtime": runtime()}


def describe() -> dict:
    """Everything, for the daemon's toolchain probe: identity, versions and paths."""
    sources = {f: s for f in flashinfer_sources.FAMILIES if (s := family_source(f)) is not None}
    return {"python": sys.executable, "prefix": sys.prefix, "toolchain": toolchain(),
            "sources": sources, "runtime": runtime(), "runtime_library": runtime_library_path(),
            "versions": versions(), "records": records()}


def main() -> None:
    """``python -m cached_client.identity``: this environment's :func:`describe` as JSON."""
    json.dump(describe(), sys.stdout, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
