"""The index's rows: their columns, the checks every row read from the index passes, the
blobs a row references, and :class:`Entry` (a row with the paths of its verified blobs).
Pure: no I/O."""

from __future__ import annotations

import json
import math
import operator
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cached_client.keys import KernelRequest
from cached_client.protocol import BLOB_SUFFIXES, HEX64_RE, KINDS, check_manifest

COLUMNS = {
    "key": str, "family": str, "kernel_name": str, "symbol": str, "params": str, "arch": str,
    "sm_count": int, "max_active_clusters": int, "toolchain": str, "source_sha256": str,
    "object_sha256": str, "object_size": int, "library_sha256": str, "library_size": int,
    "size": int, "compile_seconds": float, "created": float, "last_used": float, "hits": int,
    "meta": str, "kind": str, "files": str,
}
ADDED_COLUMNS = {"kind": "kernel", "files": ""}
"""Columns an older index lacks, added with these values when it is opened."""

SUFFIXES = BLOB_SUFFIXES  # a blob kind -> its file suffix (the protocol's)
BLOB_SUFFIX = re.compile(r"\.[a-z0-9]{1,16}\Z")

@dataclass(frozen=True)
class Blob:
    """One blob an entry references: its digest, file-name suffix, size and what it is."""

    sha256: str
    suffix: str
    size: int
    label: str

    @property
    def name(self) -> str:
        return f"{self.sha256}{self.suffix}"


def bundle_suffix(name: str) -> str:
    """The blob suffix of a bundle file: its own extension (``.so``, ``.cubin``, ``.json``:
    a loader such as TVM-FFI's picks its format by it), else ``.bin``."""
    ext = os.path.splitext(name)[1].lower()
    return ext if BLOB_SUFFIX.match(ext) else ".bin"


def row_for(key: str, request: KernelRequest, *, kernel_name: str, symbol: str,
            toolchain: str, source_sha256: str, compile_seconds: float,
            meta: Mapping[str, Any]) -> dict:
    """The index row of a kernel about to be published (blob digests and sizes, times and
    hits are filled in by :meth:`Store.publish`)."""
    return {
        "key": key, "family": request.family, "kernel_name": kernel_name, "symbol": symbol,
        "params": json.dumps(dict(request.params), sort_keys=True), "arch": request.arch,
        "sm_count": request.sm_count, "max_active_clusters": request.max_active_clusters,
        "toolchain": toolchain, "source_sha256": source_sha256,
        "compile_seconds": float(compile_seconds), "meta": dict(meta),
    }


def complete(draft: dict) -> Row:
    """The row of a draft holding every column (``params`` and ``meta`` become JSON text
    when they are not yet)."""
    for name in ("params", "meta"):
        if not isinstance(draft.get(name), str):
            draft[name] = json.dumps(draft.get(name, {}), sort_keys=True)
    return Row.from_columns(draft)


def kernel_row(draft: Mapping[str, Any], *, object_sha256: str, object_size: int,
               library_sha256: str, library_size: int, now: float) -> Row:
    """The row of a built kernel (a :func:`row_for` draft) with its blobs' digests and
    sizes (bytes), created and last used at ``now`` (seconds since the epoch), no hits."""
    return complete({**draft, "kind": "kernel", "files": "", "object_sha256": object_sha256,
                     "object_size": object_size, "library_sha256": library_sha256,
                     "library_size": library_size, "size": object_size + library_size,
                     "created": now, "last_used": now, "hits": 0})


def check_row(row: Mapping[str, Any]) -> str | None:
    """Why an index row cannot be trusted (None when it can): every key and digest is 64
    lowercase hex digits, every column has its type, sizes add up, JSON columns parse; a
    bundle's manifest names plain files (no path) with digests and sizes."""
    kind = row.get("kind")
    if kind not in KINDS:
        return f"kind is not one of {', '.join(KINDS)}: {str(kind)[:80]!r}"
    blobs = ("object_sha256", "library_sha256") if kind == "kernel" else ()
    for name in ("key", *blobs):
        value = row.get(name)
        if not isinstance(value, str) or not HEX64_RE.match(value):
            return f"{name} is not 64 lowercase hex digits: {str(value)[:80]!r}"
    for name, type_ in COLUMNS.items():
        value = row.get(name)
        if type_ is str and name != "meta" and not isinstance(value, str):
            return f"{name} is not text: {str(value)[:80]!r}"
        if type_ is int and (not isinstance(value, int) or isinstance(value, bool)
                             or value < 0):
            return f"{name} is not a non-negative integer: {str(value)[:80]!r}"
        if type_ is float and (not isinstance(value, (int, float)) or isinstance(value, bool)
                               or not math.isfinite(value)):
            return f"{name} is not a finite number: {str(value)[:80]!r}"
    if kind == "bundle":
        try:
            files = json.loads(row["files"])
        except ValueError:
            return "files is not a JSON object"
        why = check_manifest(files)
        if why is not None:
            return why
        if row["size"] != sum(f["size"] for f in files.values()):
            return "size is not the sum of the bundle's file sizes"
    elif row["size"] != row["object_size"] + row["library_size"]:
        return "size is not object_size + library_size"
    for name in ("params", "meta"):
        value = row.get(name)
        if value is None and name == "meta":
            continue
        try:
            parsed = json.loads(value) if isinstance(value, str) else None
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            return f"{name} is not a JSON object"
    return None


@dataclass(frozen=True, slots=True)
class Row:
    """One index row (table ``entries``), built from a checked SQLite row by
    :meth:`from_columns` only (and by :meth:`hit` from such a row). Digests are 64
    lowercase hex digits ('' for a bundle's object and library); sizes are bytes; times
    are seconds since the epoch (``created``, ``last_used``) or of work
    (``compile_seconds``); ``params``, ``meta`` and ``files`` are JSON text (``files``: a
    bundle's manifest, '' for a kernel)."""

    key: str
    family: str
    kernel_name: str
    symbol: str
    params: str
    arch: str
    sm_count: int
    max_active_clusters: int
    toolchain: str
    source_sha256: str
    object_sha256: str
    object_size: int
    library_sha256: str
    library_size: int
    size: int
    compile_seconds: float
    created: float
    last_used: float
    hits: int
    meta: str | None
    kind: str
    files: str

    @classmethod
    def from_columns(cls, columns: Mapping[str, Any]) -> Row:
        """The row of a mapping holding every column (a SQLite row :func:`check_row`
        passed, or one about to be indexed); a column an older index lacks takes its
        :data:`ADDED_COLUMNS` value."""
        return cls(**{name: columns[name] if name in columns else ADDED_COLUMNS[name]
                      for name in COLUMNS})

    def hit(self, now: float) -> Row:
        """This row with one more hit, last used at ``now`` (seconds since the epoch): what
        ``dataclasses.replace`` gives, built positionally in the fields' order, a third of
        its cost on every served hit (tests/test_store.py keeps the two equal)."""
        return Row(self.key, self.family, self.kernel_name, self.symbol, self.params,
                   self.arch, self.sm_count, self.max_active_clusters, self.toolchain,
                   self.source_sha256, self.object_sha256, self.object_size,
                   self.library_sha256, self.library_size, self.size, self.compile_seconds,
                   self.created, now, self.hits + 1, self.meta, self.kind, self.files)

    def same_version(self, other: Row) -> bool:
        """Whether ``other`` is this row but for its hit count and last use (what
        :meth:`hit` changes): every other column equal, so whatever is derived from the row
        alone (an encoded reply: cached.artifacts.Served.get_reply) holds for both."""
        return _VERSION(self) == _VERSION(other)

    def columns(self) -> dict[str, Any]:
        """The row as SQLite stores it, ``{column: value}``."""
        return {name: getattr(self, name) for name in COLUMNS}

    def manifest(self) -> dict[str, dict]:
        """A bundle's files, ``{name: {"sha256", "size"}}`` (empty for a kernel)."""
        return json.loads(self.files) if self.kind == "bundle" else {}

    def blobs(self) -> list[Blob]:
        """Every blob the row references (a kernel: object and library; a bundle: its
        files)."""
        if self.kind == "bundle":
            return [Blob(f["sha256"], bundle_suffix(name), f["size"], f"file {name}")
                    for name, f in sorted(self.manifest().items())]
        return [Blob(self.object_sha256, SUFFIXES["object"], self.object_size, "object"),
                Blob(self.library_sha256, SUFFIXES["library"], self.library_size, "library")]


@dataclass(frozen=True)
class Entry:
    """A stored row with paths to its verified blobs (a kernel: ``object_path`` and
    ``library_path``; a bundle: ``files``, by name, and no object or library). An
    *unstored* entry (a kernel the store could not take, see :meth:`Store.unstored`) is in
    no index; its paths are in the compilation's work directory and ``library_data``
    holds the library's bytes."""

    row: Row
    object_path: Path | None
    library_path: Path | None
    library_data: bytes | None = field(default=None, repr=False, compare=False)
    files: Mapping[str, Path] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return self.row.kind

    @property
    def key(self) -> str:
        return self.row.key


_VERSION = operator.attrgetter(*(c for c in COLUMNS if c not in ("hits", "last_used")))
"""A row's columns but for what a hit changes (:meth:`Row.same_version`)."""
