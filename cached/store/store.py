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
import errno
import hashlib
import json
import logging
import os
import sqlite3
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from cached_client.protocol import BUNDLE_NAME, HEX64_RE, MAX_BUNDLE_FILES

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
from .errors import PersistFailed, StoreError
from .index import INDEX_NAME, IndexFile
from .lru import LRU
from .rows import BLOB_SUFFIX, SUFFIXES, Entry, Row, bundle_suffix, complete
from .upkeep import Budget, Upkeep

log = logging.getLogger("cached.store")

REVERIFY_S = 300.0
"""Seconds a blob checked by its digest is trusted while its file stays the same (same
device, inode, size, mtime and ctime: any write, rename, link or chmod changes one of them),
before a hit hashes it again."""
BLOB_PATHS_MAX = 1 << 16
"""Blob paths :meth:`Store.blob_path` remembers (a path is a function of digest and suffix)."""


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


class Store(IndexFile, Upkeep):
    """Blobs and index under ``root``, kept within ``budget`` (see :meth:`evict`); the
    index is :class:`~cached.store.index.IndexFile`'s, scan, eviction and verification
    :class:`~cached.store.upkeep.Upkeep`'s.

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
        self._rows: dict[str, Row] = {}
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
            largest = max((r.size for r in self._rows.values()), default=0)
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
        row = None if row is None else self._count_hit(row)
        return None if row is None else self._verified(row)

    def lookup_unchanged(self, key: str) -> Entry | None:
        """The entry for ``key`` when each of its blobs is :meth:`unchanged` since its last
        digest check (``lstat`` only, so it may run on the event loop); None: absent, or
        some blob must be hashed again (call :meth:`lookup` on a reader thread)."""
        row = self._rows.get(key)
        if row is None:
            return None
        if row.kind == "bundle":
            blobs = [(b.sha256, b.suffix) for b in row.blobs()]
        else:
            blobs = [(row.object_sha256, SUFFIXES["object"]),
                     (row.library_sha256, SUFFIXES["library"])]
        if not all(self.unchanged(sha, suffix) for sha, suffix in blobs):
            return None
        row = self._count_hit(row)
        return None if row is None else self._entry(row)

    def _count_hit(self, row: Row) -> Row | None:
        """Count a hit on ``row``: the key's row with one more hit, used now; None if the
        row was evicted, dropped or published again (other blobs) since it was read."""
        with self._lock:
            held = self._rows.get(row.key)
            if held is None or (held.created, held.object_sha256, held.library_sha256,
                                held.files) != (row.created, row.object_sha256,
                                                row.library_sha256, row.files):
                return None
            now = time.time()
            held = held.hit(now)
            self._rows[row.key] = held
            self._lru.touch(row.key, now)
            self._touched.add(row.key)
        return held

    def _set_row(self, row: Row) -> None:
        """Under the lock: hold ``row`` in memory (replacing the key's row, if any), with
        its recency and blob references. A key held already keeps its place (in
        :meth:`rows` and among rows used at the same time), as a dict's key does."""
        old = self._rows.get(row.key)
        if old is not None:
            self._unref(old)
        blobs = row.blobs()
        self._rows[row.key] = row
        self._lru.put(row.key, row.size, len(blobs), row.last_used)
        for blob in blobs:
            self._blob_refs[blob.name] = self._blob_refs.get(blob.name, 0) + 1

    def _pop_row(self, key: str) -> Row | None:
        """Under the lock: forget ``key``'s row in memory; returns it (None: not held)."""
        row = self._rows.pop(key, None)
        if row is None:
            return None
        self._lru.remove(key)
        self._unref(row)
        return row

    def _unref(self, row: Row) -> None:
        for blob in row.blobs():
            left = self._blob_refs[blob.name] - 1
            if left:
                self._blob_refs[blob.name] = left
            else:
                del self._blob_refs[blob.name]

    def blob_problem(self, row: Row) -> str | None:
        """Why the row's blobs cannot be served (removing what is certainly not a blob at
        their names), or None when every one verifies."""
        for blob in row.blobs():
            try:
                self.read_blob(blob.sha256, blob.suffix, blob.size, what=blob.label)
            except BadBlob as bad:
                if bad.remove:
                    self.remove_blob(blob.sha256, blob.suffix)
                return bad.reason
        return None

    def _verified(self, row: Row) -> Entry | None:
        reason = self.blob_problem(row)
        if reason is not None:
            self.drop(row.key, reason)
            return None
        return self._entry(row)

    def _entry(self, row: Row) -> Entry:
        """The entry of a stored row, with the paths of its blobs."""
        if row.kind == "bundle":
            return Entry(row, None, None, files={
                name: self.blob_path(f["sha256"], bundle_suffix(name))
                for name, f in row.manifest().items()})
        return Entry(row, self.blob_path(row.object_sha256, SUFFIXES["object"]),
                     self.blob_path(row.library_sha256, SUFFIXES["library"]))

    def contains(self, key: str) -> bool:
        """Whether an index row exists (not verified; use :meth:`lookup` to serve)."""
        return key in self._rows

    def rows(self) -> list[Row]:
        with self._lock:
            return list(self._rows.values())

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
            stored = complete(row)
            self.check_index()
            with self.write(), self._lock:
                self.evict(incoming=stored)  # room first, under the same lock
                deleted = self._write_deletes()
                self.entries.insert(stored.columns(), pk="key", replace=True)
                self._set_row(stored)
                self._deleted.discard(stored.key)
            self._deleted.difference_update(deleted)
        except (OSError, sqlite3.Error) as exc:
            event(log, logging.ERROR, "store.persist_failed", key=row["key"][:16],
                  error=f"{type(exc).__name__}: {exc}"[:300])
            raise PersistFailed(f"the store could not take this kernel: {exc}", moved) from exc
        except PersistFailed as exc:
            exc.moved = moved
            raise
        return self._entry(stored)

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
        return Entry(complete(row), paths["object"], paths["library"], data["library"])

    def _place(self, path: Path, sha: str, suffix: str) -> None:
        """Move a prepared file to its blob name; an identical blob already there is kept
        (the file is dropped), anything else at that name is replaced. The placed blob is
        checked as a lookup checks it (:meth:`read_blob`: the first hit after a compile
        hashes nothing, :meth:`unchanged`); OSError when it is not the file prepared."""
        shard = self.blob_dir / sha[:2]
        try:
            st = os.lstat(shard)
        except FileNotFoundError:
            shard.mkdir(exist_ok=True)
        else:
            if not stat.S_ISDIR(st.st_mode):  # a link or file where a shard belongs
                shard.unlink()
                shard.mkdir()
        size = os.stat(path).st_size
        try:
            self.read_blob(sha, suffix, size)
        except BadBlob as bad:
            if bad.remove:
                self.remove_blob(sha, suffix)
        else:
            path.unlink()
            return
        dest = self.blob_path(sha, suffix)
        os.replace(path, dest)
        fsync_dir(dest.parent)
        try:
            self.read_blob(sha, suffix, size)
        except BadBlob as bad:
            self.remove_blob(sha, suffix)
            raise OSError(errno.EIO, f"the built file changed once placed: {bad.reason}"
                          ) from None

    def drop(self, key: str, reason: str) -> None:
        """Forget ``key`` now (memory); its index row goes at the next :meth:`flush`, so a
        drop never waits on the index."""
        with self._lock:
            if self._pop_row(key) is None:
                return
            self._touched.discard(key)
            self._deleted.add(key)
        event(log, logging.WARNING, "store.entry_dropped", key=key[:16], reason=reason)

    def close(self) -> None:
        self.flush()
        self.readers.shutdown(wait=False, cancel_futures=True)
        self.db.conn.close()

