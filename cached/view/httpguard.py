"""What one HTTP peer can make the daemon's HTTP endpoint hold (uvicorn, h11).

Invariants:
- at most :data:`MAX_CONNECTIONS` connections are open: one more closes the connection
  idle longest (no request in progress), or itself when every one is busy (counted,
  logged at most once every :data:`LOG_EVERY_S`). The endpoint serves a status page, a
  health check and a metrics scraper, never enough connections to take the daemon's
  descriptors, and idle connections never keep the health check out;
- a connection is closed once :data:`IDLE_S` seconds pass with no request in progress
  since it was made or its last response: one that never sends a request, sends one
  byte at a time, or idles after a response (uvicorn's own keep-alive timeout,
  :data:`KEEP_ALIVE_S`, closes the last sooner);
- what uvicorn logs is rate-limited per message (:class:`cached.log.RateLimited`).

A 503 (uvicorn's ``limit_concurrency``) would need a request first, and an idle
connection sends none: the cap is applied when a connection is made instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from ..log import RateLimited, event

log = logging.getLogger("cached.http")

MAX_CONNECTIONS = 64
IDLE_S = 10.0
KEEP_ALIVE_S = 5.0
LOG_EVERY_S = 10.0


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with the connection cap and idle timeout above."""

    refused = 0
    _logged = -LOG_EVERY_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        over = len(self.connections) >= MAX_CONNECTIONS
        super().connection_made(transport)
        self._progress = time.monotonic()
        if over:  # room for this one: the longest idle connection goes, else this one
            idle = [c for c in self.connections if c is not self and _idle(c)]
            victim = min(idle, key=lambda c: c._progress) if idle else self
            cls = type(self)
            cls.refused += 1
            now = time.monotonic()
            if now - cls._logged >= LOG_EVERY_S:
                cls._logged = now
                event(log, logging.WARNING, "http.over_limit", open=len(self.connections) - 1,
                      limit=MAX_CONNECTIONS, closed=cls.refused,
                      which="the longest idle" if victim is not self else "the new one")
            victim.transport.abort()
            if victim is self:
                return
        self._idle_check = self.loop.call_later(IDLE_S, self._close_if_idle)

    def on_response_complete(self) -> None:
        self._progress = time.monotonic()
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        check = getattr(self, "_idle_check", None)
        if check is not None:
            check.cancel()
        super().connection_lost(exc)

    def _close_if_idle(self) -> None:
        if self.transport.is_closing():
            return
        busy = self.cycle is not None and not self.cycle.response_complete
        left = IDLE_S - (time.monotonic() - self._progress)
        if busy or left > 0:
            self._idle_check = self.loop.call_later(IDLE_S if busy else left,
                                                    self._close_if_idle)
            return
        self.transport.close()


def _idle(c: Any) -> bool:
    """Whether connection ``c`` has no request in progress."""
    return (isinstance(c, GuardedH11) and hasattr(c, "_progress")
            and (c.cycle is None or c.cycle.response_complete))


def config_options() -> dict[str, Any]:
    """The uvicorn.Config options that apply the bounds above (and quiet its logs)."""
    for name in ("uvicorn", "uvicorn.error", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RateLimited) for f in logger.filters):
            logger.addFilter(RateLimited(LOG_EVERY_S))
    return {"http": GuardedH11, "timeout_keep_alive": KEEP_ALIVE_S}
