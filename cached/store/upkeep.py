"""The store's upkeep: the start-up scan (rows whose blobs are missing or wrong dropped,
stray temporaries and unreferenced blobs removed), eviction to the budget (least recently
used first; a shared blob stays while a row names it) and the full re-verification. Part
of :class:`cached.store.store.Store`; every row leaves the in-memory index under its lock
before a blob goes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cached_client.protocol import HEX64_RE

from ..log import event
from .lru import LRU
from .rows import BLOB_SUFFIX, Row

log = logging.getLogger("cached.store")


@dataclass(frozen=True)
class Budget:
    """How much the store may hold (0: unlimited) and how recently used an entry must be
    to be spared by eviction (seconds). The limits are hard: when sparing recent entries
    would leave the store over budget, the least recently used of them go too."""

    max_bytes: int = 0
    max_files: int = 0
    grace: float = 30.0


class Upkeep:
    """Scan, eviction and verification over the rows and blobs a store holds (the
    store supplies ``rows``, ``drop``, ``remove_blob``, ``blob_problem`` and its row
    bookkeeping)."""

    blob_dir: Path
    tmp_dir: Path
    budget: Budget
    index_created: bool
    evictions: int
    evicted_bytes: int
    over_budget: bool
    _opened: float
    _lock: Any
    _lru: LRU
    _rows: dict[str, Row]
    _blob_refs: dict[str, int]
    _touched: set[str]
    _deleted: set[str]
    _in_use: Callable[[], Iterable[str]]

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
            if self._rows.get(row.key) is not None and self._verified(row) is None:
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

    def evict(self, incoming: Row | None = None, max_bytes: int | None = None,
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
        keep = incoming.key if incoming else None
        incoming_bytes = incoming.size if incoming else 0
        incoming_files = len(incoming.blobs()) if incoming else 0
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
                self._touched.discard(row.key)
                self._deleted.add(row.key)
            if victims:
                incoming_blobs = {b.name for b in incoming.blobs()} if incoming else set()
                for row in victims:
                    for blob in row.blobs():
                        if blob.name not in self._blob_refs and blob.name not in incoming_blobs:
                            self.remove_blob(blob.sha256, blob.suffix)
            size, files, still_over = chosen.bytes, chosen.files, chosen.over
            if configured:
                self.over_budget = still_over
        report["evicted"] = len(victims)
        report["freed_bytes"] = sum(r.size for r in victims)
        self.evictions += report["evicted"]
        self.evicted_bytes += report["freed_bytes"]
        if victims:
            event(log, logging.INFO, "store.evicted", entries=report["evicted"],
                  bytes=report["freed_bytes"], max_bytes=max_bytes, max_files=max_files,
                  within_grace=sum(1 for r in victims if now - r.last_used < grace))
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
            if self._rows.get(row.key) is None:
                continue  # evicted meanwhile
            report["checked"] += 1
            reason = self.blob_problem(row)
            if reason is None:
                report["verified"] += 1
                report["bytes"] += row.size
                continue
            report["bad"].append({"key": row.key, "family": row.family,
                                  "reason": reason})
            self.drop(row.key, reason)
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
