"""Content-addressed artifact store: blobs named by sha256 plus an SQLite index.

Layout under the store root::

    blobs/ab/abcdef....so  read-only files named by their sha256 (and a suffix: .o, .so, or
                         a bundle file's own extension)
    tmp/                 work directories of compilations in progress
    index.sqlite         one row per key (sqlite-utils, WAL)

Invariants: a blob is written to ``tmp/``, fsynced, made read-only and renamed into
``blobs/`` before any index row names it, so a crash at any instant leaves either no
entry or a whole one. A blob's sha256 is recomputed when it is first served, whenever its
file is not the very one last checked (device, inode, size, modification and change times,
read with ``lstat``), and at least every :data:`REVERIFY_S` seconds; a row whose blob is
missing or wrong is dropped (and the blob removed), never served. Store paths derive
only from digests (64 lowercase hex digits, checked on every row read from the index),
never from client input. Blobs are opened without following links and read only when
they are regular files of the recorded size; nothing here chmods or unlinks through a
link. The index is never waited on by a read: rows live in memory, and hit counts,
last-use times and deletions are written back in batches (:meth:`Store.flush`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import sqlite3
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlite_utils
from cached_client.errors import CompileFailed
from cached_client.protocol import BUNDLE_NAME, HEX64_RE, MAX_BUNDLE_FILES

from ..config import ConfigError
from ..log import event
from .blobs import (
    OPEN_BLOB,
    OPEN_DIR,
    BadBlob,
    file_identity,
    fsync_dir,
    prepare,
    read_all,
    read_regular,
    remove_at,
)
from .lru import LRU
from .rows import (
    ADDED_COLUMNS,
    BLOB_SUFFIX,
    COLUMNS,
    SUFFIXES,
    Entry,
    bundle_suffix,
    check_row,
    manifest,
    row_blobs,
)

log = logging.getLogger("cached.store")

INDEX_NAME = "index.sqlite"
REVERIFY_S = 300.0
"""Seconds a blob checked by its digest is trusted while its file stays the same (same
device, inode, size, mtime and ctime: any write, rename, link or chmod changes one of them),
before a hit hashes it again."""
BLOB_PATHS_MAX = 1 << 16
"""Blob paths :meth:`Store.blob_path` remembers (a path is a function of digest and suffix)."""


class StoreError(ConfigError):
    """The store directory or its index cannot be used (raised when the store is opened,
    before the daemon binds anything); the message says what to do."""


class PersistFailed(CompileFailed):
    """The store could not take an entry (disk or inodes full, read-only, an I/O or index
    error, or an entry larger than the whole budget). Nothing of it is indexed; files
    already moved into ``blobs/`` are unreferenced and verified like any other blob;
    ``moved`` maps each built file's path that publish had already moved (or found
    stored) to its digest."""

    def __init__(self, message: str, moved: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.moved = dict(moved or {})


@dataclass(frozen=True)
class Budget:
    """How much the store may hold (0: unlimited) and how recently used an entry must be
    to be spared by eviction (seconds). The limits are hard: when sparing recent entries
    would leave the store over budget, the least recently used of them go too."""

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


class Store:
    """Blobs and index under ``root``, kept within ``budget`` (see :meth:`evict`).

    Raises :class:`StoreError` when the root is not a writable directory or the index is
    not a usable SQLite database."""

    def __init__(self, root: Path, budget: Budget | None = None) -> None:
        self.root = Path(root)
        self.budget = budget or Budget()
        self.evictions = 0
        self.evicted_bytes = 0
        self.over_budget = False
        self._in_use: Callable[[], Iterable[str]] = tuple
        self.blob_dir = self.root / "blobs"
        self.tmp_dir = self.root / "tmp"
        self.index_path = self.root / INDEX_NAME
        self._check_root()
        self._lock = threading.RLock()  # the in-memory rows
        self._db_lock = threading.RLock()  # the index connection
        self._touched: set[str] = set()
        self._deleted: set[str] = set()  # dropped or evicted keys not yet deleted from the index
        self._checked: dict[tuple[str, str], tuple[tuple, float, str]] = {}
        """(sha256, suffix) -> (the blob file's identity, monotonic time, path) at its last
        digest check; a blob whose file still has that identity is served without hashing."""
        self._blob_paths: dict[tuple[str, str], Path] = {}
        self.index_created = not self.index_path.exists()
        self._open_index()
        self._rows: dict[str, dict] = {}
        self._lru = LRU()
        """Each row's size, blob count and last use, for :meth:`evict` (kept with _rows)."""
        self._blob_refs: dict[str, int] = {}
        """Blob name -> how many rows reference it (kept with _rows)."""
        for row in self._load_rows().values():
            self._set_row(row)
        self._opened = time.time()
        self.readers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="store-read")
        """Threads for blob hashing (lookups, library reads): they never touch the index,
        so a lookup never queues behind a write waiting for SQLite's lock."""

    # -- opening -----------------------------------------------------------------------

    def _check_root(self) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise StoreError(f"store path {self.root} is not a directory; point --store at "
                             "a directory (it is created if missing)")
        try:
            for d in (self.root, self.blob_dir, self.tmp_dir):
                d.mkdir(parents=True, exist_ok=True)
            probe_fd, probe = tempfile.mkstemp(prefix=".probe-", dir=self.tmp_dir)
            os.close(probe_fd)
            os.unlink(probe)
        except OSError as exc:
            why = exc.strerror or str(exc)
            raise StoreError(f"store {self.root} is not a writable directory ({why}): the "
                             "daemon writes its index, blobs and temporaries there; give it "
                             "a writable directory it owns") from None

    def _open_index(self) -> None:
        """Open (or create) the index; remember which file it is (:meth:`check_index`)."""
        try:
            conn = sqlite3.connect(self.index_path, check_same_thread=False,
                                   isolation_level=None, timeout=30)
            self.db = sqlite_utils.Database(conn)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.entries = self.db.table("entries")
            if not self.entries.exists():
                self.entries.create(COLUMNS, pk="key")
            missing = set(COLUMNS) - set(self.entries.columns_dict)
            if missing and missing <= set(ADDED_COLUMNS):  # an older index: every row a kernel
                for name in sorted(missing):
                    self.entries.add_column(name, str, not_null_default=ADDED_COLUMNS[name])
                missing = set()
        except sqlite3.Error as exc:
            raise StoreError(f"index {self.index_path} is not a usable SQLite database "
                             f"({exc}); move it aside to start with an empty index (the "
                             "blobs are kept; kernels are compiled again on request)") from None
        if missing:
            raise StoreError(f"index {self.index_path} has a table 'entries' without "
                             f"column(s) {', '.join(sorted(missing))}: it is not this "
                             "program's index; move it aside")
        st = os.stat(self.index_path)
        self._index_id = (st.st_dev, st.st_ino)

    def _load_rows(self) -> dict[str, dict]:
        """The index's rows, each checked (:func:`check_row`); a bad row is deleted from
        the index and logged, never trusted."""
        rows: dict[str, dict] = {}
        bad: list[int] = []
        try:
            for row in self.db.query("SELECT rowid AS _rowid, * FROM entries"):
                rowid = row.pop("_rowid")
                reason = check_row(row)
                if reason is None:
                    rows[row["key"]] = row
                    continue
                bad.append(rowid)
                event(log, logging.ERROR, "store.row_invalid", rowid=rowid,
                      key=str(row.get("key"))[:80], reason=reason)
            if bad:
                with self.write():
                    self.db.conn.executemany("DELETE FROM entries WHERE rowid = ?",
                                             [(r,) for r in bad])
        except sqlite3.Error as exc:
            raise StoreError(f"index {self.index_path} cannot be read ({exc}); move it aside "
                             "to start with an empty index (the blobs are kept)") from None
        return rows

    def check_index(self) -> str | None:
        """Whether the index file is still the one this store opened. If it vanished or was
        replaced (a new file at its path), log it, set the replacement aside and write a
        new index from this store's own copy (every table, read through the connection
        still open on the old file; the rows in memory win), then carry on. Returns what
        happened (``vanished``, ``replaced``) or None."""
        why = self._index_changed()
        if why is None:
            return None
        with self._db_lock:
            why = self._index_changed()
            if why is None:
                return None
            event(log, logging.ERROR, "store.index_lost", index=str(self.index_path),
                  reason=why, rows=len(self._rows),
                  action="rebuilding it from the daemon's own copy")
            try:
                self._rebuild_index(why)
            except (OSError, sqlite3.Error, StoreError) as exc:  # retried at the next check
                event(log, logging.ERROR, "store.index_rebuild_failed",
                      error=f"{type(exc).__name__}: {exc}"[:300])
        return why

    def _index_changed(self) -> str | None:
        try:
            st = os.stat(self.index_path)
        except FileNotFoundError:
            return "vanished"
        except OSError:
            return None  # cannot tell; the next check will
        return None if (st.st_dev, st.st_ino) == self._index_id else "replaced"

    def _rebuild_index(self, why: str) -> None:
        fresh = self.tmp_dir / f"index-rebuild-{os.getpid()}.sqlite"
        with contextlib.suppress(FileNotFoundError):
            fresh.unlink()
        try:
            self.db.execute("VACUUM INTO ?", [str(fresh)])  # every table of the old file
        except sqlite3.Error as exc:
            event(log, logging.WARNING, "store.index_copy_failed", error=str(exc)[:300])
            with contextlib.suppress(FileNotFoundError):
                fresh.unlink()
        with self._lock:
            rows = [dict(r) for r in self._rows.values()]
        copy = sqlite_utils.Database(sqlite3.connect(fresh, isolation_level=None))
        try:
            table = copy.table("entries")
            if not table.exists():
                table.create(COLUMNS, pk="key")
            copy.execute("BEGIN")
            copy.execute("DELETE FROM entries")
            table.insert_all(rows, pk="key", replace=True)
            copy.execute("COMMIT")
        finally:
            copy.conn.close()
        self.db.conn.close()
        try:
            if why == "replaced":
                aside = f"{INDEX_NAME}.replaced-{int(time.time())}"
                for suffix in ("", "-wal", "-shm"):
                    with contextlib.suppress(FileNotFoundError):
                        os.replace(self.root / (INDEX_NAME + suffix),
                                   self.root / (aside + suffix))
                event(log, logging.WARNING, "store.index_set_aside",
                      path=str(self.root / aside))
            else:
                for suffix in ("-wal", "-shm"):  # the old file's, now without it
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self.root / (INDEX_NAME + suffix))
            os.replace(fresh, self.index_path)
            fsync_dir(self.root)
        finally:
            self._open_index()  # the new file, or whatever is there if the swap failed
        event(log, logging.WARNING, "store.index_rebuilt", index=str(self.index_path),
              rows=len(rows), reason=why)

    def set_budget(self, budget: Budget) -> None:
        """Change the budget (SIGHUP); the next publish or :meth:`evict` applies it."""
        self.budget = budget

    def check_budget(self) -> None:
        """StoreError if the budget cannot hold one of the entries already stored (or one
        kernel's two files): a budget smaller than one kernel is a configuration error."""
        b = self.budget
        if b.max_files == 1:
            raise StoreError("max_files 1 cannot hold one kernel (two files: object and "
                             "library); use 0 (unlimited) or at least 2")
        with self._lock:
            largest = max((r["size"] for r in self._rows.values()), default=0)
        if b.max_bytes and largest > b.max_bytes:
            raise StoreError(f"max_bytes {b.max_bytes} is smaller than a kernel this store "
                             f"holds ({largest} bytes): the budget could not keep even one; "
                             "raise --max-bytes (0: unlimited)")

    def protect(self, in_use: Callable[[], Iterable[str]]) -> None:
        """Never evict the keys ``in_use()`` names (kernels being compiled or fetched)."""
        self._in_use = in_use

    def snapshot(self) -> StoreSnapshot:
        entries, size = self.totals()
        return StoreSnapshot(entries, size, self.budget.max_bytes, self.budget.max_files,
                             self.evictions, self.evicted_bytes, self.over_budget)

    # -- blobs, never through a link ----------------------------------------------------

    def blob_path(self, sha256: str, suffix: str) -> Path:
        """Where the blob with this digest and suffix (``.o``, ``.so``, a bundle file's
        extension: :data:`SUFFIXES`, :func:`bundle_suffix`) lives (remembered for at most
        :data:`BLOB_PATHS_MAX` blobs: a hit builds no path)."""
        path = self._blob_paths.get((sha256, suffix))
        if path is not None:
            return path
        if not HEX64_RE.match(sha256):
            raise ValueError(f"not a sha256 digest: {sha256[:80]!r}")
        if not BLOB_SUFFIX.match(suffix):
            raise ValueError(f"not a blob suffix: {suffix[:20]!r}")
        if len(self._blob_paths) >= BLOB_PATHS_MAX:
            self._blob_paths.clear()
        path = self.blob_dir / sha256[:2] / f"{sha256}{suffix}"
        self._blob_paths[(sha256, suffix)] = path
        return path

    def _shard(self, sha256: str) -> int:
        """A descriptor of the blob's shard directory, opened without following a link."""
        return os.open(self.blob_dir / sha256[:2], OPEN_DIR)

    def read_blob(self, sha256: str, suffix: str, size: int | None = None,
                  keep: bool = False, what: str = "") -> bytes | None:
        """Check the blob of this digest: opened without following links, read only if it
        is a regular file (of ``size`` bytes when given), hashed. Returns its bytes when
        ``keep``; raises :class:`BadBlob` saying why it cannot be served."""
        label = f"{what or suffix.lstrip('.')} blob {sha256[:12]}"
        name = self.blob_path(sha256, suffix).name
        try:
            shard = self._shard(sha256)
        except FileNotFoundError:
            raise BadBlob(f"{label} is missing", False) from None
        except OSError as exc:
            raise BadBlob(f"{label}: its directory is not a plain directory "
                          f"({exc.strerror})", False) from None
        try:
            data, checked = read_regular(shard, name, label, size, sha256, keep)
        finally:
            os.close(shard)
        self._checked[(sha256, suffix)] = (file_identity(checked), time.monotonic(),
                                           os.fspath(self.blob_path(sha256, suffix)))
        return data

    def unchanged(self, sha256: str, suffix: str, st: os.stat_result | None = None) -> bool:
        """Whether the blob's file (``st``, else ``lstat`` of its path: never opened, never
        followed) is the very file whose digest was checked less than REVERIFY_S ago."""
        checked = self._checked.get((sha256, suffix))
        if checked is None or time.monotonic() - checked[1] > REVERIFY_S:
            return False
        if st is None:
            try:
                st = os.lstat(checked[2])
            except OSError:
                return False
        return file_identity(st) == checked[0]

    def remove_blob(self, sha256: str, suffix: str) -> None:
        """Remove whatever sits at the blob's name (a file, link, FIFO or directory) without
        following a link; nothing else is touched, no mode is changed."""
        name = self.blob_path(sha256, suffix).name
        self._checked.pop((sha256, suffix), None)
        try:
            shard = self._shard(sha256)
        except OSError:
            return
        try:
            remove_at(shard, name)
        finally:
            os.close(shard)

    # -- reading -----------------------------------------------------------------------

    def lookup(self, key: str) -> Entry | None:
        """The entry for ``key`` after checking both blobs' digests; None if absent or bad.
        Hashes blobs: call it off the event loop (:attr:`readers`). Never waits on the
        index."""
        row = self._rows.get(key)
        if row is None or not self._count_hit(key, row):
            return None
        return self._verified(row)

    def lookup_unchanged(self, key: str) -> Entry | None:
        """The entry for ``key`` when each of its blobs is :meth:`unchanged` since its last
        digest check (``lstat`` only, so it may run on the event loop); None: absent, or
        some blob must be hashed again (call :meth:`lookup` on a reader thread)."""
        row = self._rows.get(key)
        if row is None:
            return None
        if row.get("kind") == "bundle":
            blobs = [(b.sha256, b.suffix) for b in row_blobs(row)]
        else:
            blobs = [(row[f"{kind}_sha256"], suffix) for kind, suffix in SUFFIXES.items()]
        if not all(self.unchanged(sha, suffix) for sha, suffix in blobs):
            return None
        return self._entry(row) if self._count_hit(key, row) else None

    def _count_hit(self, key: str, row: dict) -> bool:
        """Count a hit on ``row``; False if it was evicted or dropped since it was read."""
        with self._lock:
            if self._rows.get(key) is not row:
                return False
            row["hits"] += 1
            row["last_used"] = time.time()
            self._lru.touch(key, row["last_used"])
            self._touched.add(key)
        return True

    def _set_row(self, row: dict) -> None:
        """Under the lock: hold ``row`` in memory (replacing the key's row, if any), with
        its recency and blob references. A key held already keeps its place (in
        :meth:`rows` and among rows used at the same time), as a dict's key does."""
        old = self._rows.get(row["key"])
        if old is not None:
            self._unref(old)
        blobs = row_blobs(row)
        self._rows[row["key"]] = row
        self._lru.put(row["key"], row["size"], len(blobs), row["last_used"])
        for blob in blobs:
            self._blob_refs[blob.name] = self._blob_refs.get(blob.name, 0) + 1

    def _pop_row(self, key: str) -> dict | None:
        """Under the lock: forget ``key``'s row in memory; returns it (None: not held)."""
        row = self._rows.pop(key, None)
        if row is None:
            return None
        self._lru.remove(key)
        self._unref(row)
        return row

    def _unref(self, row: Mapping[str, Any]) -> None:
        for blob in row_blobs(row):
            left = self._blob_refs[blob.name] - 1
            if left:
                self._blob_refs[blob.name] = left
            else:
                del self._blob_refs[blob.name]

    def blob_problem(self, row: Mapping[str, Any]) -> str | None:
        """Why the row's blobs cannot be served (removing what is certainly not a blob at
        their names), or None when every one verifies."""
        for blob in row_blobs(row):
            try:
                self.read_blob(blob.sha256, blob.suffix, blob.size, what=blob.label)
            except BadBlob as bad:
                if bad.remove:
                    self.remove_blob(blob.sha256, blob.suffix)
                return bad.reason
        return None

    def _verified(self, row: dict) -> Entry | None:
        reason = self.blob_problem(row)
        if reason is not None:
            self.drop(row["key"], reason)
            return None
        return self._entry(row)

    def _entry(self, row: dict) -> Entry:
        """The entry of a stored row, with the paths of its blobs."""
        if row.get("kind") == "bundle":
            return Entry(dict(row), None, None, files={
                name: self.blob_path(f["sha256"], bundle_suffix(name))
                for name, f in manifest(row).items()})
        return Entry(dict(row), self.blob_path(row["object_sha256"], SUFFIXES["object"]),
                     self.blob_path(row["library_sha256"], SUFFIXES["library"]))

    def contains(self, key: str) -> bool:
        """Whether an index row exists (not verified; use :meth:`lookup` to serve)."""
        return key in self._rows

    def rows(self) -> list[dict]:
        with self._lock:
            return [dict(r) for r in self._rows.values()]

    def totals(self) -> tuple[int, int]:
        with self._lock:
            return len(self._rows), self._lru.bytes

    # -- writing -----------------------------------------------------------------------

    def workdir(self) -> Path:
        """A fresh directory under tmp/ for one compilation (same filesystem as blobs/);
        tmp/ itself is made again if it was removed. Raises OSError (no space or inodes,
        read-only) for the caller to report."""
        try:
            return Path(tempfile.mkdtemp(prefix="job-", dir=self.tmp_dir))
        except FileNotFoundError:
            self.tmp_dir.mkdir(parents=True, exist_ok=True)
            event(log, logging.WARNING, "store.tmp_recreated", path=str(self.tmp_dir))
            return Path(tempfile.mkdtemp(prefix="job-", dir=self.tmp_dir))

    def publish(self, row: dict, object_file: Path, library_file: Path) -> Entry:
        """Move two built files into blobs/ and commit their index row; atomic per step.
        Evicts down to the budget first (hard: see :meth:`evict`). Raises
        :class:`PersistFailed` when the store cannot take the entry; the built files then
        stay where they are unless already moved into blobs/ (see :meth:`unstored`)."""
        row = {**row, "kind": "kernel", "files": ""}
        return self._publish(row, [("object", Path(object_file), SUFFIXES["object"]),
                                   ("library", Path(library_file), SUFFIXES["library"])])

    def publish_bundle(self, row: dict, files: Mapping[str, Path]) -> Entry:
        """Move a bundle's files into blobs/ (each named by its digest and its own
        extension) and commit one index row listing them, ``{name: {sha256, size}}``: the
        bundle appears whole or not at all. ``files`` maps each file's name (one plain
        component, :data:`BUNDLE_NAME`) to its path. Raises PersistFailed as
        :meth:`publish` does, and for a name or count the store does not take."""
        names = sorted(files)
        bad = [n for n in names if not BUNDLE_NAME.match(n)]
        if bad or not 0 < len(names) <= MAX_BUNDLE_FILES:
            raise PersistFailed(f"a bundle holds 1 to {MAX_BUNDLE_FILES} plain file names, "
                                f"not {len(names)} ({', '.join(repr(n[:40]) for n in bad)})")
        row = {**row, "kind": "bundle", "object_sha256": "", "object_size": 0,
               "library_sha256": "", "library_size": 0}
        return self._publish(row, [(n, Path(files[n]), bundle_suffix(n)) for n in names])

    def _publish(self, row: dict, items: list[tuple[str, Path, str]]) -> Entry:
        """Prepare, place and index ``items`` (label, path, blob suffix) as ``row``."""
        moved: dict[str, str] = {}
        bundle = row["kind"] == "bundle"
        try:
            prepared = [(label, path, suffix, *prepare(path)) for label, path, suffix in items]
            size = sum(nbytes for *_, nbytes in prepared)
            self._check_fits(size, len(items))
            files = {}
            for label, path, suffix, sha, nbytes in prepared:
                self._place(path, sha, suffix)
                moved[str(path)] = sha
                if bundle:
                    files[label] = {"sha256": sha, "size": nbytes}
                else:
                    row[f"{label}_sha256"], row[f"{label}_size"] = sha, nbytes
            if bundle:
                row["files"] = json.dumps(files, sort_keys=True)
            now = time.time()
            row.update(size=size, created=now, last_used=now, hits=0)
            for name in ("params", "meta"):
                if not isinstance(row.get(name), str):
                    row[name] = json.dumps(row.get(name, {}), sort_keys=True)
            self.check_index()
            with self.write(), self._lock:
                self.evict(incoming=row)  # room first, under the same lock
                deleted = self._write_deletes()
                self.entries.insert(row, pk="key", replace=True)
                self._set_row(row)
                self._deleted.discard(row["key"])
            self._deleted.difference_update(deleted)
        except (OSError, sqlite3.Error) as exc:
            event(log, logging.ERROR, "store.persist_failed", key=row["key"][:16],
                  error=f"{type(exc).__name__}: {exc}"[:300])
            raise PersistFailed(f"the store could not take this kernel: {exc}", moved) from exc
        except PersistFailed as exc:
            exc.moved = moved
            raise
        return self._entry(row)

    def _check_fits(self, size: int, nfiles: int = 2) -> None:
        b = self.budget
        if (b.max_bytes and size > b.max_bytes) or (b.max_files and nfiles > b.max_files):
            event(log, logging.ERROR, "store.budget_too_small", entry_bytes=size,
                  entry_files=nfiles, max_bytes=b.max_bytes, max_files=b.max_files)
            raise PersistFailed(
                f"this entry ({size} bytes, {nfiles} files) does not fit the whole store "
                f"budget (max_bytes {b.max_bytes}, max_files {b.max_files}); raise the budget "
                "(0: unlimited)")

    def unstored(self, row: dict, object_file: Path, library_file: Path,
                 failed: PersistFailed | None = None) -> Entry:
        """An entry for a built kernel the store could not take, for the waiters of the one
        job that built it: served from where its files are now (the work directory, or
        blobs/ for a file publish had already moved), checked like a blob, with the
        library's bytes held here. Indexed nowhere; its files are made readable (0444, the
        work directory 0711) like blobs; the caller removes the work directory later."""
        row = {**row, "kind": "kernel", "files": ""}
        paths: dict[str, Path] = {}
        data: dict[str, bytes] = {}
        for kind, path in (("object", Path(object_file)), ("library", Path(library_file))):
            try:
                fd = os.open(path, OPEN_BLOB)
            except FileNotFoundError:
                fd = None
            if fd is not None:
                try:
                    st = os.fstat(fd)
                    if not stat.S_ISREG(st.st_mode):
                        raise PersistFailed(f"the built {kind} file is not a regular file")
                    data[kind] = read_all(fd)
                    os.fchmod(fd, 0o444)
                finally:
                    os.close(fd)
                paths[kind] = path
                sha = hashlib.sha256(data[kind]).hexdigest()
            else:  # publish moved it into blobs/ before failing: find it by digest
                sha = failed.moved.get(str(path), "") if failed is not None else ""
                try:
                    kept = (self.read_blob(sha, SUFFIXES[kind], keep=True, what=kind)
                            if sha else None)
                except BadBlob:
                    kept = None
                if kept is None:
                    raise PersistFailed(f"the built {kind} file is gone: {failed}")
                data[kind], paths[kind] = kept, self.blob_path(sha, SUFFIXES[kind])
            row[f"{kind}_sha256"], row[f"{kind}_size"] = sha, len(data[kind])
        with contextlib.suppress(OSError):
            fd = os.open(Path(library_file).parent, OPEN_DIR)
            try:
                os.fchmod(fd, 0o711)
            finally:
                os.close(fd)
        now = time.time()
        row.update(size=row["object_size"] + row["library_size"], created=now,
                   last_used=now, hits=0)
        return Entry(row, paths["object"], paths["library"], data["library"])

    @contextlib.contextmanager
    def write(self) -> Iterator[sqlite_utils.Database]:
        """One write transaction on the index database (side tables use it too) that takes
        SQLite's write lock up front (BEGIN IMMEDIATE), so another process holding the
        index makes us wait (busy timeout), not fail. Blocks: never call it on the event
        loop."""
        with self._db_lock:
            conn = self.db.conn
            if conn.in_transaction:
                yield self.db
                return
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield self.db
                if conn.in_transaction:
                    conn.execute("COMMIT")  # a full disk may refuse it: rolled back below
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise

    @contextlib.contextmanager
    def read(self) -> Iterator[sqlite_utils.Database]:
        """The index database for a side table's read, serialized with this store's writes.
        Blocks: never call it on the event loop."""
        with self._db_lock:
            yield self.db

    def _place(self, path: Path, sha: str, suffix: str) -> None:
        """Move a prepared file to its blob name; an identical blob already there is kept
        (the file is dropped), anything else at that name is replaced."""
        shard = self.blob_dir / sha[:2]
        try:
            st = os.lstat(shard)
        except FileNotFoundError:
            shard.mkdir(exist_ok=True)
        else:
            if not stat.S_ISDIR(st.st_mode):  # a link or file where a shard belongs
                shard.unlink()
                shard.mkdir()
        try:
            self.read_blob(sha, suffix, os.stat(path).st_size)
        except BadBlob as bad:
            if bad.remove:
                self.remove_blob(sha, suffix)
        else:
            path.unlink()
            return
        dest = self.blob_path(sha, suffix)
        os.replace(path, dest)
        fsync_dir(dest.parent)

    def drop(self, key: str, reason: str) -> None:
        """Forget ``key`` now (memory); its index row goes at the next :meth:`flush`, so a
        drop never waits on the index."""
        with self._lock:
            if self._pop_row(key) is None:
                return
            self._touched.discard(key)
            self._deleted.add(key)
        event(log, logging.WARNING, "store.entry_dropped", key=key[:16], reason=reason)

    def _write_deletes(self) -> set[str]:
        """Inside a write transaction: delete the index rows of keys dropped or evicted
        (unless published again since); returns the keys handled."""
        with self._lock:
            gone = {k for k in self._deleted if k not in self._rows}
            handled = set(self._deleted)
        if gone:
            self.db.conn.executemany("DELETE FROM entries WHERE key = ?",
                                     [(k,) for k in gone])
        return handled

    def flush(self) -> int:
        """Check the index is still there (:meth:`check_index`), then write batched hit
        counts, last-use times and deletions; returns rows written. Blocks: call it off
        the event loop."""
        self.check_index()
        with self._lock:
            touched = [(r["hits"], r["last_used"], k) for k in self._touched
                       if (r := self._rows.get(k)) is not None]
            self._touched.clear()
            pending = bool(self._deleted)
        if not touched and not pending:
            return 0
        try:
            with self.write():
                deleted = self._write_deletes()
                if touched:
                    self.db.conn.executemany(
                        "UPDATE entries SET hits = ?, last_used = ? WHERE key = ?", touched)
        except sqlite3.Error as exc:  # counts and deletions wait for the next flush
            with self._lock:
                self._touched.update(k for _, _, k in touched)
            event(log, logging.WARNING, "store.flush_failed", error=str(exc)[:300])
            return 0
        with self._lock:
            self._deleted.difference_update(deleted)
        return len(touched) + len(deleted)

    def close(self) -> None:
        self.flush()
        self.readers.shutdown(wait=False, cancel_futures=True)
        self.db.conn.close()

    # -- start-up scan -----------------------------------------------------------------

    def _blob_files(self) -> Iterator[tuple[str, os.stat_result]]:
        """(name, lstat) of every entry in the shard directories (links never followed)."""
        try:
            shards = list(os.scandir(self.blob_dir))
        except OSError:
            return
        for shard in shards:
            if not shard.is_dir(follow_symlinks=False):
                continue
            with contextlib.suppress(OSError), os.scandir(shard.path) as it:
                for item in it:
                    yield item.name, item.stat(follow_symlinks=False)

    def _referenced(self) -> set[str]:
        with self._lock:
            return set(self._blob_refs)

    def scan(self) -> dict[str, Any]:
        """Drop rows whose blobs are missing or wrong (each logged; a bad blob never stops
        the scan), delete stray temporaries and unreferenced blobs older than this store's
        opening. Unreferenced blobs are kept when the index is empty or was created at this
        opening: an index that lost its rows says nothing about the blobs. Safe to run
        while serving."""
        started = time.monotonic()
        report = {"checked": 0, "dropped": 0, "tmp_removed": 0, "orphans_removed": 0,
                  "orphans_kept": 0}
        for row in self.rows():
            report["checked"] += 1
            if self._rows.get(row["key"]) is not None and self._verified(row) is None:
                report["dropped"] += 1
        with contextlib.suppress(OSError), os.scandir(self.tmp_dir) as it:
            for child in it:
                with contextlib.suppress(OSError):
                    if child.stat(follow_symlinks=False).st_mtime < self._opened:
                        if child.is_dir(follow_symlinks=False):
                            shutil.rmtree(child.path, ignore_errors=True)
                        else:
                            os.unlink(child.path)
                        report["tmp_removed"] += 1
        referenced = self._referenced()
        trust_index = not self.index_created and bool(referenced)
        for name, st in list(self._blob_files()):
            if name in referenced or st.st_mtime >= self._opened:
                continue
            sha, dot, suffix = name.partition(".")
            if not trust_index or not HEX64_RE.match(sha) or not BLOB_SUFFIX.match(dot + suffix):
                report["orphans_kept"] += 1
                continue
            self.remove_blob(sha, dot + suffix)
            report["orphans_removed"] += 1
        if report["orphans_kept"] and not trust_index:
            event(log, logging.WARNING, "store.orphans_kept", blobs=report["orphans_kept"],
                  reason="the index is empty or was created at this start; blobs are never "
                  "deleted on the word of an empty index")
        report["seconds"] = round(time.monotonic() - started, 3)
        level = logging.WARNING if report["dropped"] or report["orphans_removed"] else logging.INFO
        event(log, level, "store.scan_done", **report)
        return report

    # -- budget and verification --------------------------------------------------------

    def evict(self, incoming: dict | None = None, max_bytes: int | None = None,
              max_files: int | None = None, grace: float | None = None) -> dict[str, Any]:
        """Remove least recently used entries until the index, plus the ``incoming`` row
        about to be published, fits ``max_bytes`` and ``max_files`` (blob files: two per
        kernel, one per bundle file); a blob another entry (or the incoming one) shares
        stays. Never removes the incoming key or a key :meth:`protect`'s callable names
        (being compiled). Entries used within ``grace`` seconds go last: with the
        configured budget (no limits passed) the limit is hard and they go too, oldest
        first, when nothing else is left to evict; with limits passed (a one-off ``gc``)
        they stay. Rows leave the in-memory index under the lock before their blobs go, so
        a concurrent lookup either sees a fresh row or none; their index rows go at the
        next write."""
        configured = max_bytes is None and max_files is None  # not a one-off gc budget
        max_bytes = self.budget.max_bytes if max_bytes is None else max_bytes
        max_files = self.budget.max_files if max_files is None else max_files
        hard = configured and grace is None
        grace = self.budget.grace if grace is None else grace
        report: dict[str, Any] = {"evicted": 0, "freed_bytes": 0, "blocked": 0}
        if not max_bytes and not max_files:
            return report
        keep = incoming["key"] if incoming else None
        incoming_bytes = incoming["size"] if incoming else 0
        incoming_files = len(row_blobs(incoming)) if incoming else 0
        protected = set(self._in_use()) | {keep}
        now = time.time()
        with self._lock:
            chosen = self._lru.select(max_bytes=max_bytes, max_files=max_files,
                                      extra_bytes=incoming_bytes, extra_files=incoming_files,
                                      exclude=keep, protected=protected, now=now,
                                      grace=grace, hard=hard)
            report["blocked"] = chosen.blocked
            victims = [self._pop_row(key) for key in chosen.victims]
            for row in victims:
                self._touched.discard(row["key"])
                self._deleted.add(row["key"])
            if victims:
                incoming_blobs = {b.name for b in row_blobs(incoming)} if incoming else set()
                for row in victims:
                    for blob in row_blobs(row):
                        if blob.name not in self._blob_refs and blob.name not in incoming_blobs:
                            self.remove_blob(blob.sha256, blob.suffix)
            size, files, still_over = chosen.bytes, chosen.files, chosen.over
            if configured:
                self.over_budget = still_over
        report["evicted"] = len(victims)
        report["freed_bytes"] = sum(r["size"] for r in victims)
        self.evictions += report["evicted"]
        self.evicted_bytes += report["freed_bytes"]
        if victims:
            event(log, logging.INFO, "store.evicted", entries=report["evicted"],
                  bytes=report["freed_bytes"], max_bytes=max_bytes, max_files=max_files,
                  within_grace=sum(1 for r in victims if now - r["last_used"] < grace))
        if still_over:
            event(log, logging.WARNING, "store.over_budget", bytes=size + incoming_bytes,
                  files=files + incoming_files, max_bytes=max_bytes, max_files=max_files,
                  blocked=report["blocked"], reason="every remaining entry is being compiled"
                  if hard else "every remaining entry is in use or within the grace period")
        return report

    def verify(self) -> dict[str, Any]:
        """Recheck every entry's blobs against their digests; report and drop each bad one
        (removing what sits at a bad blob's name unless it may be a good blob) and go on:
        a FIFO, a link, a directory or an unreadable file is a bad entry, never a hang or
        an abort. Also counts unreferenced blobs and leftover temporaries."""
        started = time.monotonic()
        report: dict[str, Any] = {"checked": 0, "verified": 0, "bad": [], "bytes": 0,
                                  "orphan_blobs": 0, "tmp_entries": 0}
        for row in self.rows():
            if self._rows.get(row["key"]) is None:
                continue  # evicted meanwhile
            report["checked"] += 1
            reason = self.blob_problem(row)
            if reason is None:
                report["verified"] += 1
                report["bytes"] += row["size"]
                continue
            report["bad"].append({"key": row["key"], "family": row["family"],
                                  "reason": reason})
            self.drop(row["key"], reason)
        referenced = self._referenced()
        report["orphan_blobs"] = sum(1 for name, _ in self._blob_files()
                                     if name not in referenced)
        with contextlib.suppress(OSError):
            report["tmp_entries"] = sum(1 for _ in os.scandir(self.tmp_dir))
        report["seconds"] = round(time.monotonic() - started, 3)
        event(log, logging.WARNING if report["bad"] else logging.INFO, "store.verify_done",
              checked=report["checked"], verified=report["verified"], bad=len(report["bad"]),
              orphan_blobs=report["orphan_blobs"])
        return report
