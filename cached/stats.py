"""The daemon's counters: one :class:`Stats` every component counts into.

Bottom layer: imports nothing of the daemon. Counters are monotonic for the daemon's life
(``/metrics`` exports them as they are); per-family counters sit under ``by_family``; the
last failures are kept for operators; latencies are kept as histograms per family for
``/metrics``. :meth:`Stats.zero` (``cached stats --zero``) does not reset them: it records
a baseline, and :meth:`Stats.view` (what ``cached stats`` shows) counts from there.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Iterable

COMPILE_BUCKETS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0)
"""Upper bounds, in seconds, of the compile-time histogram's buckets."""
HIT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
               1.0)
"""Upper bounds, in seconds, of the hit-latency histogram (a get answered from the store)."""
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0,
                600.0)
"""Upper bounds, in seconds, of the miss-to-served histogram (a get that was not a hit)."""
HISTOGRAMS = {"compile_seconds": COMPILE_BUCKETS, "hit_seconds": HIT_BUCKETS,
              "miss_seconds": WAIT_BUCKETS}
"""Every histogram by name: ``compile_seconds`` is observed by ``count`` (the counter of
the same name is its sum); ``hit_seconds`` and ``miss_seconds`` by :meth:`Stats.observe`."""
FAMILY_COUNTERS = ("hits", "misses", "compiles", "failures", "compile_seconds",
                   "client_fallbacks", "client_outside_kernels", "remote_hits",
                   "deadline_exceeded", "persist_failures", "compiles_avoided", "published",
                   "bytes_served", "bytes_published")
"""Per-family counters every family reports, zero until counted. ``hits``/``misses``
count ``get`` answers and write-back ``lease`` answers (hit; granted: the asker compiles);
``compiles_avoided``: artifacts served that nobody compiled for that request (a ``get``
hit or fleet-tier fetch, a write-back hit); ``published``: entries written back by
clients; ``bytes_served``/``bytes_published``: their sizes; ``client_fallbacks`` and
``client_outside_kernels``: what clients reported of their own processes (``report``)."""


class Stats:
    """Counters by name (``hits``, ``errors.<code>``, ...) and by family."""

    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()
        self.by_family: defaultdict[str, Counter[str]] = defaultdict(Counter)
        self.failures: deque[dict] = deque(maxlen=20)
        self.outside_kernels: deque[dict] = deque(maxlen=20)
        self.zeroed_at: float | None = None
        self._lock = threading.Lock()
        self._base: Counter[str] = Counter()
        self._base_family: dict[str, Counter[str]] = {}
        self._buckets: dict[str, dict[str, list[int]]] = {name: {} for name in HISTOGRAMS}
        self._sums: dict[str, Counter[str]] = {name: Counter() for name in HISTOGRAMS}

    def count(self, name: str, family: str | None = None, n: float = 1) -> None:
        with self._lock:
            self.counters[name] += n
            if family:
                self.by_family[family][name] += n
                if name == "compile_seconds":
                    self._observe(name, family, n)

    def observe(self, name: str, family: str, seconds: float) -> None:
        """One observation of histogram ``name`` (a key of :data:`HISTOGRAMS`)."""
        with self._lock:
            self._observe(name, family, seconds)

    def _observe(self, name: str, family: str, seconds: float) -> None:
        bounds = HISTOGRAMS[name]
        counts = self._buckets[name].setdefault(family, [0] * (len(bounds) + 1))
        counts[bisect.bisect_left(bounds, seconds)] += 1
        self._sums[name][family] += seconds

    def fail(self, record: dict) -> None:
        """Keep one failure (time, family, key, params, message) for ``stats``."""
        with self._lock:
            self.failures.append(record)

    def note_outside(self, pid: int, kernels: Iterable[str]) -> None:
        """Keep the names of kernels a serving client built outside the daemon (last 20)."""
        now = time.time()
        with self._lock:
            for name in kernels:
                self.outside_kernels.append({"time": now, "pid": pid, "kernel": name})

    def histogram(self, family: str, name: str = "compile_seconds"
                  ) -> tuple[list[tuple[str, int]], float]:
        """Cumulative (upper bound, count) buckets of histogram ``name`` for ``family``
        since the daemon started, and their sum (seconds)."""
        bounds = HISTOGRAMS[name]
        with self._lock:
            counts = list(self._buckets[name].get(family) or [0] * (len(bounds) + 1))
            total = float(self._sums[name][family])
        cumulative, buckets = 0, []
        for bound, count in zip((*bounds, float("inf")), counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        return buckets, total

    def zero(self) -> float:
        """Start ``cached stats``' counts from zero now (the monotonic counters behind
        ``/metrics`` go on); forget the kept failures. Returns the time (Unix seconds)."""
        with self._lock:
            self._base = Counter(self.counters)
            self._base_family = {f: Counter(c) for f, c in self.by_family.items()}
            self.failures.clear()
            self.zeroed_at = time.time()
            return self.zeroed_at

    def view(self, registered: Iterable[str] = (), since_zero: bool = True
             ) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
        """Counters and per-family counters since the last :meth:`zero` (or the start;
        since the start whatever the zeroing with ``since_zero=False``). Every family in
        ``registered`` has a row, with :data:`FAMILY_COUNTERS` at least."""
        empty: Counter[str] = Counter()
        with self._lock:
            base = self._base if since_zero else empty
            counters = {k: _less(v, base.get(k, 0)) for k, v in self.counters.items()}
            families = {}
            for f in sorted(set(registered) | set(self.by_family)):
                base = self._base_family.get(f, empty) if since_zero else empty
                row: dict[str, float] = dict.fromkeys(FAMILY_COUNTERS, 0)
                row.update({k: _less(v, base.get(k, 0))
                            for k, v in self.by_family.get(f, empty).items()})
                families[f] = row
            return counters, families


def _less(value: float, base: float) -> float:
    """``value - base``; float sums rounded to microseconds (no 1e-17 residues)."""
    diff = value - base
    return round(diff, 6) if isinstance(diff, float) else diff


def duration_text(seconds: float) -> str:
    """A duration as people read it, two units at most: ``42s``, ``12m05s``, ``3h07m``,
    ``2d04h``; under ten seconds with a tenth (``3.4s``)."""
    if seconds < 10:
        return f"{max(0.0, seconds):.1f}s"
    s = int(seconds)
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{s:02d}s"
    return f"{s}s"
