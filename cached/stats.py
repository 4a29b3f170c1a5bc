"""The daemon's counters: one :class:`Stats` every component counts into.

Bottom layer: imports nothing of the daemon. Counters are monotonic (reset only by a
restart); per-family counters sit under ``by_family``; the last failures are kept for
operators; compile times are also kept as a histogram per family for ``/metrics``.
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter, defaultdict, deque

COMPILE_BUCKETS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0)
"""Upper bounds, in seconds, of the compile-time histogram's buckets."""


class Stats:
    """Counters by name (``hits``, ``errors.<code>``, ...) and by family."""

    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()
        self.by_family: defaultdict[str, Counter[str]] = defaultdict(Counter)
        self.failures: deque[dict] = deque(maxlen=20)
        self._lock = threading.Lock()
        self._compile_buckets: defaultdict[str, list[int]] = defaultdict(
            lambda: [0] * (len(COMPILE_BUCKETS) + 1))

    def count(self, name: str, family: str | None = None, n: float = 1) -> None:
        with self._lock:
            self.counters[name] += n
            if family:
                self.by_family[family][name] += n
                if name == "compile_seconds":
                    self._compile_buckets[family][bisect.bisect_left(COMPILE_BUCKETS, n)] += 1

    def fail(self, record: dict) -> None:
        """Keep one failure (time, family, key, params, message) for ``stats``."""
        with self._lock:
            self.failures.append(record)

    def histogram(self, family: str) -> tuple[list[tuple[str, int]], float]:
        """Cumulative (upper bound, count) buckets of compile seconds, and their sum."""
        with self._lock:
            counts = list(self._compile_buckets[family])
            total = float(self.by_family[family]["compile_seconds"])
        cumulative, buckets = 0, []
        for bound, count in zip((*COMPILE_BUCKETS, float("inf")), counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        return buckets, total
