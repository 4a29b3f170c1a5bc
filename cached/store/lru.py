"""Least-recently-used bookkeeping for the store's budget, apart from any I/O.

:class:`LRU` tracks keys, each with a size in bytes, a number of files and a last-use
time, and answers which keys to evict, least recently used first, to bring the totals
under a budget (:meth:`LRU.select`) without sorting every key on each call: a heap of
(last use, insertion number, key) with stale entries skipped, so finding the ``k``
oldest of ``n`` keys costs O(k log n) plus the stale entries passed (compacted away
whenever they outnumber the live ones). Keys used at the same time are ordered by when
they were first put (a key put again while present keeps its place, as a dict does).
The store (:class:`cached.store.store.Store`) keeps one, rebuilt from its index at open and
updated on every publish, hit, drop and eviction, under its own lock: this type takes
no lock.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from numbers import Real

_Stamp = tuple[float, int, str]
"""(last use, insertion number, key): the heap's order; the numbers are unique."""


@dataclass(frozen=True)
class Selection:
    """What :meth:`LRU.select` chose: ``victims`` in eviction order (least recently used
    first), how many keys it could not take (``blocked``: protected, or recent when the
    limit is not hard), the bytes and files left without the victims (the excluded key
    and the incoming sizes not counted) and whether that is still over the limits."""

    victims: tuple[str, ...]
    blocked: int
    bytes: int
    files: int
    over: bool


class LRU:
    """Keys with a size, a file count and a last-use time (see the module docstring)."""

    def __init__(self) -> None:
        self._items: dict[str, tuple[_Stamp, int, int]] = {}  # key -> (stamp, size, files)
        self._heap: list[_Stamp] = []
        self._next = 0
        self._changes = 0
        self.bytes = 0
        """The sum of every key's size."""
        self.files = 0
        """The sum of every key's file count."""

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def get(self, key: str) -> tuple[int, int, float] | None:
        """``(size, files, last_used)`` of ``key``, or None when it is not tracked."""
        item = self._items.get(key)
        if item is None:
            return None
        stamp, size, files = item
        return size, files, stamp[0]

    def put(self, key: str, size: int, files: int, last_used: float) -> None:
        """Track ``key`` (or replace its size, file count and last use, keeping its place
        among keys used at the same time). Raises TypeError or ValueError for a key that
        is not a non-empty string, a size or file count that is not a non-negative
        integer, or a last use that is not a finite number."""
        if not isinstance(key, str) or not key:
            raise TypeError(f"an LRU key is a non-empty string, not {key!r:.80}")
        for name, value in (("size", size), ("files", files)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} of {key[:16]} is an integer, not {value!r:.80}")
            if value < 0:
                raise ValueError(f"{name} of {key[:16]} is negative ({value})")
        last_used = _check_time(key, last_used)
        old = self._items.get(key)
        if old is None:
            stamp: _Stamp | None = None
            seq = self._next
            self._next += 1
        else:
            stamp, seq = old[0], old[0][1]
            self.bytes -= old[1]
            self.files -= old[2]
        moved = stamp is None or stamp[0] != last_used
        if moved:
            stamp = (last_used, seq, key)
        self._items[key] = (stamp, size, files)
        self.bytes += size
        self.files += files
        if moved:
            heapq.heappush(self._heap, stamp)
            self._tidy()
        self._changes += 1

    def touch(self, key: str, last_used: float) -> None:
        """Set ``key``'s last use. Raises KeyError for a key not tracked, TypeError or
        ValueError for a last use that is not a finite number."""
        item = self._items.get(key)
        if item is None:
            raise KeyError(f"LRU key {str(key)[:16]} is not tracked; put it first")
        last_used = _check_time(key, last_used)
        stamp, size, files = item
        if stamp[0] == last_used:
            return
        stamp = (last_used, stamp[1], key)
        self._items[key] = (stamp, size, files)
        heapq.heappush(self._heap, stamp)
        self._tidy()
        self._changes += 1

    def remove(self, key: str) -> bool:
        """Stop tracking ``key``; False when it was not tracked."""
        item = self._items.pop(key, None)
        if item is None:
            return False
        self.bytes -= item[1]
        self.files -= item[2]
        self._changes += 1
        self._tidy()
        return True

    def oldest(self) -> Iterator[str]:
        """Every key, least recently used first (ties: first put first), without changing
        anything; the LRU must not change while this is iterated (RuntimeError)."""
        heap, changes = self._heap, self._changes
        frontier: list[tuple[_Stamp, int]] = [(heap[0], 0)] if heap else []
        while frontier:
            stamp, i = heapq.heappop(frontier)
            for child in (2 * i + 1, 2 * i + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child], child))
            if self._stale(stamp):
                continue  # removed or used again since
            yield stamp[2]
            if self._changes != changes:
                raise RuntimeError("the LRU changed while its keys were iterated")

    def select(self, *, max_bytes: int = 0, max_files: int = 0, extra_bytes: int = 0,
               extra_files: int = 0, exclude: str | None = None,
               protected: Collection[str] = (), now: float | None = None, grace: float = 0.0,
               hard: bool = True) -> Selection:
        """The keys to evict, least recently used first, until the totals (without
        ``exclude``'s, plus ``extra_bytes`` and ``extra_files`` about to be added) fit
        ``max_bytes`` and ``max_files`` (0: no limit). Never a key in ``protected``. Keys
        used within ``grace`` seconds of ``now`` (``now - last_used < grace``: a last use
        after ``now`` is recent too; no ``now``: none is recent) go only after every older
        one, and only when ``hard``; else each one needed counts as blocked. Changes
        nothing."""
        for name, value in (("max_bytes", max_bytes), ("max_files", max_files),
                            ("extra_bytes", extra_bytes), ("extra_files", extra_files)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} is a non-negative integer, not {value!r:.80}")
        size, files = self.bytes, self.files
        if exclude is not None and (item := self._items.get(exclude)) is not None:
            size -= item[1]
            files -= item[2]

        def over() -> bool:
            return bool((max_bytes and size + extra_bytes > max_bytes)
                        or (max_files and files + extra_files > max_files))

        victims: list[str] = []
        recent: list[str] = []
        blocked = 0
        for key in self.oldest():
            if not over():
                break
            stamp, nbytes, nfiles = self._items[key]
            if key in protected:
                blocked += 1
            elif now is not None and now - stamp[0] < grace:
                recent.append(key)
            else:
                victims.append(key)
                size -= nbytes
                files -= nfiles
        for key in recent:  # oldest first; only as many as the limit needs
            if not over():
                break
            if hard:
                _, nbytes, nfiles = self._items[key]
                victims.append(key)
                size -= nbytes
                files -= nfiles
            else:
                blocked += 1
        return Selection(tuple(victims), blocked, size, files, over())

    def _stale(self, stamp: _Stamp) -> bool:
        item = self._items.get(stamp[2])
        return item is None or item[0] is not stamp

    def _tidy(self) -> None:
        """Drop stale stamps from the heap's top; rebuild it when most of it is stale."""
        heap = self._heap
        while heap and self._stale(heap[0]):
            heapq.heappop(heap)
        if len(heap) > 2 * len(self._items) + 64:
            self._heap = [item[0] for item in self._items.values()]
            heapq.heapify(self._heap)


def _check_time(key: str, value: object) -> float:
    if not isinstance(value, Real) or isinstance(value, bool):
        raise TypeError(f"last_used of {key[:16]} is a number, not {value!r:.80}")
    if not math.isfinite(value):
        raise ValueError(f"last_used of {key[:16]} is not finite ({value})")
    return value
