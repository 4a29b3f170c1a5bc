"""The circuit breaker of a process's clients, one per daemon socket path.

Invariants: a socket whose daemon could not be reached or went silent is not asked again
for :data:`RETRY_AFTER_S` seconds (every call fails at once meanwhile, saying why and for
how long); the first answer closes it; :meth:`Circuits.open` says whether it was closed
(the client logs that, once); a forked child gets a fresh lock (another thread may have
held the parent's).
"""

from __future__ import annotations

import threading
import time

RETRY_AFTER_S = 30.0
"""How long a process stops asking a daemon that could not be reached or went silent."""


class Circuits:
    """Socket path -> (monotonic time to ask again, why it stopped answering)."""

    def __init__(self) -> None:
        self._open: dict[str, tuple[float, str]] = {}
        self._lock = threading.Lock()

    def open(self, path: str, reason: str) -> bool:
        """Stop asking ``path`` for RETRY_AFTER_S; whether it was closed until now (the
        caller logs that once)."""
        with self._lock:
            first = path not in self._open
            self._open[path] = (time.monotonic() + RETRY_AFTER_S, reason)
        return first

    def reason(self, path: str) -> str | None:
        """Why calls to ``path`` fail at once now, or None when the daemon may be asked."""
        with self._lock:
            state = self._open.get(path)
            if state is None:
                return None
            retry_at, reason = state
            left = retry_at - time.monotonic()
            if left <= 0:
                return None  # ask again; a failure opens it again
        return f"{reason}; not asking the daemon at {path} again for {left:.0f}s"

    def close(self, path: str) -> None:
        if path in self._open:
            with self._lock:
                self._open.pop(path, None)

    def after_fork(self) -> None:
        """In a forked child: a lock of its own."""
        self._lock = threading.Lock()


CIRCUITS = Circuits()
