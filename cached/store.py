"""Content-addressed artifact store: blobs named by sha256 plus an SQLite index.

Layout under the store root::

    blobs/ab/abcdef....so  read-only files named by their sha256 (and kind's suffix)
    tmp/                 work directories of compilations in progress
    index.sqlite         one row per key (sqlite-utils, WAL)

Invariants: a blob is written to ``tmp/``, fsynced, made read-only and renamed into
``blobs/`` before any index row names it, so a crash at any instant leaves either no
entry or a whole one. Every read recomputes the blob's sha256; a row whose blob is
missing or wrong is dropped (and the blob removed), never served. Store paths derive
only from digests, never from client input. Hit counts and last-use times are kept in
memory and written back in batches (:meth:`Store.flush`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import sqlite3
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlite_utils
from cached_client.errors import IntegrityError
from cached_client.keys import KernelRequest
from cached_client.loader import sha256_file

from .log import event

log = logging.getLogger("cached.store")

COLUMNS = {
    "key": str, "family": str, "kernel_name": str, "symbol": str, "params": str, "arch": str,
    "sm_count": int, "max_active_clusters": int, "toolchain": str, "source_sha256": str,
    "object_sha256": str, "object_size": int, "library_sha256": str, "library_size": int,
    "size": int, "compile_seconds": float, "created": float, "last_used": float, "hits": int,
    "meta": str,
}

SUFFIXES = {"object": ".o", "library": ".so"}


@dataclass(frozen=True)
class Budget:
    """How much the store may hold (0: unlimited) and how recently used an entry must be
    to be safe from eviction (seconds)."""

    max_bytes: int = 0
    max_files: int = 0
    grace: float = 30.0


@dataclass(frozen=True)
class StoreSnapshot:
    """The store's state for stats, metrics and the status page."""

    entries: int
    bytes: int
    max_bytes: int
    max_files: int
    evictions: int
    evicted_bytes: int
    over_budget: bool


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


@dataclass(frozen=True)
class Entry:
    """One index row, with paths to its verified blobs."""

    row: dict
    object_path: Path
    library_path: Path

    @property
    def key(self) -> str:
        return self.row["key"]


class Store:
    """Blobs and index under ``root``, kept within ``budget`` (see :meth:`evict`)."""

    def __init__(self, root: Path, budget: Budget | None = None) -> None:
        self.root = Path(root)
        self.budget = budget or Budget()
        self.evictions = 0
        self.evicted_bytes = 0
        self.over_budget = False
        self._in_use: Callable[[], Iterable[str]] = tuple
        self.blob_dir = self.root / "blobs"
        self.tmp_dir = self.root / "tmp"
        for d in (self.root, self.blob_dir, self.tmp_dir):
            d.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        conn = sqlite3.connect(self.root / "index.sqlite", check_same_thread=False,
                               isolation_level=None, timeout=30)
        self.db = sqlite_utils.Database(conn)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.entries = self.db.table("entries")
        if not self.entries.exists():
            self.entries.create(COLUMNS, pk="key")
        self._rows: dict[str, dict] = {r["key"]: r for r in self.entries.rows}
        self._touched: set[str] = set()
        self._db_lock = threading.RLock()
        self._opened = time.time()

    def set_budget(self, budget: Budget) -> None:
        """Change the budget (SIGHUP); the next publish or :meth:`evict` applies it."""
        self.budget = budget

    def protect(self, in_use: Callable[[], Iterable[str]]) -> None:
        """Never evict the keys ``in_use()`` names (kernels being compiled or fetched)."""
        self._in_use = in_use

    def snapshot(self) -> StoreSnapshot:
        entries, size = self.totals()
        return StoreSnapshot(entries, size, self.budget.max_bytes, self.budget.max_files,
                             self.evictions, self.evicted_bytes, self.over_budget)

    # -- reading -----------------------------------------------------------------------

    def blob_path(self, sha256: str, kind: str) -> Path:
        """Where the blob of ``kind`` (object or library) with this digest lives."""
        return self.blob_dir / sha256[:2] / f"{sha256}{SUFFIXES[kind]}"

    def lookup(self, key: str) -> Entry | None:
        """The entry for ``key`` after checking both blobs' digests; None if absent or bad."""
        row = self._rows.get(key)
        if row is None:
            return None
        with self._lock:
            if self._rows.get(key) is not row:  # evicted or dropped since the read above
                return None
            row["hits"] += 1
            row["last_used"] = time.time()
            self._touched.add(key)
        return self._verified(row)

    def _verified(self, row: dict) -> Entry | None:
        paths = {}
        for kind in ("object", "library"):
            sha = row[f"{kind}_sha256"]
            path = self.blob_path(sha, kind)
            try:
                actual = sha256_file(path)
            except FileNotFoundError:
                self.drop(row["key"], f"{kind} blob {sha[:12]} is missing")
                return None
            if actual != sha:
                self.drop(row["key"], f"{kind} blob {sha[:12]} has digest {actual[:12]}")
                self._remove_blob(path)
                return None
            paths[kind] = path
        return Entry(dict(row), paths["object"], paths["library"])

    def read_library(self, entry: Entry) -> bytes:
        """The library blob's bytes, checked against its digest once more as read."""
        data = entry.library_path.read_bytes()
        if hashlib.sha256(data).hexdigest() != entry.row["library_sha256"]:
            self.drop(entry.key, "library blob changed while being read")
            raise IntegrityError(f"the stored library of {entry.key[:12]} changed while being "
                                 "read; it was dropped, and the next request rebuilds it")
        return data

    def contains(self, key: str) -> bool:
        """Whether an index row exists (not verified; use :meth:`lookup` to serve)."""
        return key in self._rows

    def rows(self) -> list[dict]:
        with self._lock:
            return [dict(r) for r in self._rows.values()]

    def totals(self) -> tuple[int, int]:
        with self._lock:
            return len(self._rows), sum(r["size"] for r in self._rows.values())

    # -- writing -----------------------------------------------------------------------

    def workdir(self) -> Path:
        """A fresh directory under tmp/ for one compilation (same filesystem as blobs/)."""
        return Path(tempfile.mkdtemp(prefix="job-", dir=self.tmp_dir))

    def publish(self, row: dict, object_file: Path, library_file: Path) -> Entry:
        """Move two built files into blobs/ and commit their index row; atomic per step."""
        row = dict(row)
        for kind, path in (("object", object_file), ("library", library_file)):
            sha, size = self._commit_blob(Path(path), kind)
            row[f"{kind}_sha256"], row[f"{kind}_size"] = sha, size
        now = time.time()
        row.update(size=row["object_size"] + row["library_size"], created=now, last_used=now,
                   hits=0)
        for name in ("params", "meta"):
            if not isinstance(row.get(name), str):
                row[name] = json.dumps(row.get(name, {}), sort_keys=True)
        with self.write(), self._lock:
            self.evict(incoming=row)  # room first, under the same lock
            self.entries.insert(row, pk="key", replace=True)
            self._rows[row["key"]] = row
        return Entry(dict(row), self.blob_path(row["object_sha256"], "object"),
                     self.blob_path(row["library_sha256"], "library"))

    @contextlib.contextmanager
    def write(self) -> Iterator[sqlite_utils.Database]:
        """One write transaction on the index database (side tables use it too) that takes
        SQLite's write lock up front (BEGIN IMMEDIATE), so another process holding the
        index makes us wait (busy timeout), not fail."""
        conn = self.db.conn
        with self._db_lock:
            if conn.in_transaction:
                yield self.db
                return
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield self.db
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            if conn.in_transaction:
                conn.execute("COMMIT")

    @contextlib.contextmanager
    def read(self) -> Iterator[sqlite_utils.Database]:
        """The index database for a side table's read, serialized with this store's writes."""
        with self._db_lock:
            yield self.db

    def _commit_blob(self, path: Path, kind: str) -> tuple[str, int]:
        with open(path, "rb+") as f:
            data = f.read()
            os.fsync(f.fileno())
        sha = hashlib.sha256(data).hexdigest()
        dest = self.blob_path(sha, kind)
        if dest.exists() and sha256_file(dest) == sha:
            path.unlink()
            return sha, len(data)
        dest.parent.mkdir(exist_ok=True)
        os.chmod(path, 0o444)
        os.replace(path, dest)
        _fsync_dir(dest.parent)
        return sha, len(data)

    def drop(self, key: str, reason: str) -> None:
        with self._lock:
            if self._rows.pop(key, None) is None:
                return
            self._touched.discard(key)
        with self.write():
            self.entries.delete_where("key = ?", [key])
        event(log, logging.WARNING, "store.entry_dropped", key=key[:16], reason=reason)

    def _remove_blob(self, path: Path) -> None:
        try:
            os.chmod(path, 0o644)
            path.unlink()
        except FileNotFoundError:
            pass

    def flush(self) -> int:
        """Write batched hit counts and last-use times to the index; returns rows written."""
        with self._lock:
            touched = [(r["hits"], r["last_used"], k) for k in self._touched
                       if (r := self._rows.get(k)) is not None]
            self._touched.clear()
        if touched:
            with self.write():
                self.db.conn.executemany(
                    "UPDATE entries SET hits = ?, last_used = ? WHERE key = ?", touched
                )
        return len(touched)

    def close(self) -> None:
        self.flush()
        self.db.conn.close()

    # -- start-up scan -----------------------------------------------------------------

    def scan(self) -> dict[str, Any]:
        """Drop rows whose blobs are missing or wrong, delete stray temporaries and
        unreferenced blobs older than this store's opening. Safe to run while serving."""
        started = time.monotonic()
        report = {"checked": 0, "dropped": 0, "tmp_removed": 0, "orphans_removed": 0}
        for row in self.rows():
            report["checked"] += 1
            if self._rows.get(row["key"]) is not None and self._verified(row) is None:
                report["dropped"] += 1
        for child in self.tmp_dir.iterdir():
            if child.stat().st_mtime < self._opened:
                shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink()
                report["tmp_removed"] += 1
        with self._lock:
            referenced = {self.blob_path(r[f"{k}_sha256"], k).name
                          for r in self._rows.values() for k in SUFFIXES}
        for path in self.blob_dir.glob("*/*"):
            if path.name not in referenced and path.stat().st_mtime < self._opened:
                self._remove_blob(path)
                report["orphans_removed"] += 1
        report["seconds"] = round(time.monotonic() - started, 3)
        level = logging.WARNING if report["dropped"] or report["orphans_removed"] else logging.INFO
        event(log, level, "store.scan_done", **report)
        return report

    # -- budget and verification --------------------------------------------------------

    def evict(self, incoming: dict | None = None, max_bytes: int | None = None,
              max_files: int | None = None, grace: float | None = None) -> dict[str, Any]:
        """Remove least recently used entries until the index, plus the ``incoming`` row
        about to be published, fits ``max_bytes`` and ``max_files`` (two blob files per
        entry); a blob another entry (or the incoming one) shares stays. Never removes
        the incoming key, a key :meth:`protect`'s callable names (being
        compiled), or an entry used within ``grace`` seconds: :meth:`lookup` stamps
        ``last_used`` before it verifies, so an entry just handed out by path (a client
        may be about to open it) stays. Rows leave the index under the lock before their
        blobs go, so a concurrent lookup either sees a fresh row or none."""
        configured = max_bytes is None and max_files is None  # not a one-off gc budget
        max_bytes = self.budget.max_bytes if max_bytes is None else max_bytes
        max_files = self.budget.max_files if max_files is None else max_files
        grace = self.budget.grace if grace is None else grace
        report: dict[str, Any] = {"evicted": 0, "freed_bytes": 0, "blocked": 0}
        if not max_bytes and not max_files:
            return report
        keep = incoming["key"] if incoming else None
        incoming_bytes = incoming["size"] if incoming else 0
        incoming_files = 2 if incoming else 0
        protected = set(self._in_use()) | {keep}
        now = time.time()
        with self._lock:
            size = sum(r["size"] for r in self._rows.values() if r["key"] != keep)
            files = 2 * sum(1 for k in self._rows if k != keep)

            def over() -> bool:
                return bool((max_bytes and size + incoming_bytes > max_bytes)
                            or (max_files and files + incoming_files > max_files))

            victims = []
            if over():
                for row in sorted(self._rows.values(), key=lambda r: r["last_used"]):
                    if not over():
                        break
                    if row["key"] in protected or now - row["last_used"] < grace:
                        report["blocked"] += 1
                        continue
                    victims.append(row)
                    size -= row["size"]
                    files -= 2
            for row in victims:
                self._rows.pop(row["key"], None)
                self._touched.discard(row["key"])
            if victims:
                self.db.conn.executemany("DELETE FROM entries WHERE key = ?",
                                         [(r["key"],) for r in victims])
                referenced = {self.blob_path(r[f"{k}_sha256"], k)
                              for r in [*self._rows.values(), *([incoming] if incoming else [])]
                              for k in SUFFIXES}
                for row in victims:
                    for kind in SUFFIXES:
                        path = self.blob_path(row[f"{kind}_sha256"], kind)
                        if path not in referenced:
                            self._remove_blob(path)
            still_over = over()
            if configured:
                self.over_budget = still_over
        report["evicted"] = len(victims)
        report["freed_bytes"] = sum(r["size"] for r in victims)
        self.evictions += report["evicted"]
        self.evicted_bytes += report["freed_bytes"]
        if victims:
            event(log, logging.INFO, "store.evicted", entries=report["evicted"],
                  bytes=report["freed_bytes"], max_bytes=max_bytes, max_files=max_files)
        if still_over:
            event(log, logging.WARNING, "store.over_budget", bytes=size + incoming_bytes,
                  files=files + incoming_files, max_bytes=max_bytes, max_files=max_files,
                  blocked=report["blocked"], reason="every remaining entry is in use or "
                  "within the eviction grace period")
        return report

    def verify(self) -> dict[str, Any]:
        """Recheck every entry's blobs against their digests; drop the bad ones (and
        their blobs). Also counts unreferenced blobs and leftover temporaries."""
        started = time.monotonic()
        report: dict[str, Any] = {"checked": 0, "verified": 0, "bad": [], "bytes": 0,
                                  "orphan_blobs": 0, "tmp_entries": 0}
        for row in self.rows():
            if self._rows.get(row["key"]) is None:
                continue  # evicted meanwhile
            report["checked"] += 1
            reason = None
            for kind in SUFFIXES:
                sha = row[f"{kind}_sha256"]
                try:
                    actual = sha256_file(self.blob_path(sha, kind))
                except FileNotFoundError:
                    reason = f"{kind} blob {sha[:12]} is missing"
                    break
                if actual != sha:
                    reason = f"{kind} blob {sha[:12]} has digest {actual[:12]}"
                    break
            if reason is None:
                report["verified"] += 1
                report["bytes"] += row["size"]
            elif self._rows.get(row["key"]) is not None:
                report["bad"].append({"key": row["key"], "family": row["family"],
                                      "reason": reason})
                self._verified(row)  # drops the row and removes a wrong blob
        with self._lock:
            referenced = {self.blob_path(r[f"{k}_sha256"], k).name
                          for r in self._rows.values() for k in SUFFIXES}
        report["orphan_blobs"] = sum(1 for p in self.blob_dir.glob("*/*")
                                     if p.name not in referenced)
        report["tmp_entries"] = sum(1 for _ in self.tmp_dir.iterdir())
        report["seconds"] = round(time.monotonic() - started, 3)
        event(log, logging.WARNING if report["bad"] else logging.INFO, "store.verify_done",
              checked=report["checked"], verified=report["verified"], bad=len(report["bad"]),
              orphan_blobs=report["orphan_blobs"])
        return report


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
