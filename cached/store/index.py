"""The store's SQLite index (``index.sqlite``, WAL): opened or created, its rows read and
checked (:func:`~cached.store.rows.check_row`; a bad row is deleted and logged, never
trusted), written in transactions that take SQLite's write lock up front, and rebuilt from
the daemon's in-memory rows when the file vanishes or is replaced. Hit counts, last-use
times and deletions reach it in batches (:meth:`IndexFile.flush`): a read never waits on
it. Part of :class:`cached.store.store.Store`, which holds the rows this writes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import sqlite_utils

from ..log import event
from .blobs import fsync_dir
from .errors import StoreError
from .rows import ADDED_COLUMNS, COLUMNS, Row, check_row

log = logging.getLogger("cached.store")

INDEX_NAME = "index.sqlite"


class IndexFile:
    """The index half of :class:`~cached.store.store.Store`: its connection (``db``, the
    ``entries`` table), transactions and batched writes of the rows the store holds."""

    root: Path
    tmp_dir: Path
    index_path: Path
    db: sqlite_utils.Database
    entries: sqlite_utils.db.Table
    _lock: threading.RLock
    _db_lock: threading.RLock
    _rows: dict[str, Row]
    _touched: set[str]
    _deleted: set[str]
    _index_id: tuple[int, int]

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

    def _load_rows(self) -> dict[str, Row]:
        """The index's rows, each checked (:func:`check_row`); a bad row is deleted from
        the index and logged, never trusted."""
        rows: dict[str, Row] = {}
        bad: list[int] = []
        try:
            for row in self.db.query("SELECT rowid AS _rowid, * FROM entries"):
                rowid = row.pop("_rowid")
                reason = check_row(row)
                if reason is None:
                    rows[row["key"]] = Row.from_columns(row)
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
            rows = [r.columns() for r in self._rows.values()]
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
            touched = [(r.hits, r.last_used, k) for k in self._touched
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
