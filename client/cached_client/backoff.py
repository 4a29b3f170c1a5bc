"""Exponential backoff, the one helper for every retry loop of the client and the daemon
(the prober, a connect to a full backlog, a worker that dies while starting, the fleet tier).

Invariants: :meth:`Backoff.next` returns ``first`` seconds, then twice the last, never more
than ``most``; with ``jitter`` each returned delay is scaled by a uniform factor in
``[1 - jitter, 1 + jitter]`` (the doubling itself is not jittered); :meth:`reset` starts over.
"""

from __future__ import annotations

import random


class Backoff:
    """Delays in seconds: ``first``, doubling to ``most`` (see the module doc)."""

    def __init__(self, first: float, most: float, jitter: float = 0.0) -> None:
        if not 0 < first <= most:
            raise ValueError(f"backoff needs 0 < first <= most, got {first} and {most}")
        if not 0 <= jitter < 1:
            raise ValueError(f"backoff jitter must be in [0, 1), got {jitter}")
        self.first, self.most, self.jitter = first, most, jitter
        self._next = first

    @property
    def upcoming(self) -> float:
        """The delay :meth:`next` returns next, before jitter."""
        return self._next

    def next(self) -> float:
        """This delay (jittered), and double the one after it, up to ``most``."""
        delay, self._next = self._next, min(self._next * 2, self.most)
        return delay * random.uniform(1 - self.jitter, 1 + self.jitter) if self.jitter else delay

    def reset(self) -> None:
        self._next = self.first
