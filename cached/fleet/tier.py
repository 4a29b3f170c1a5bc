"""What the daemon asks of a fleet tier: the :class:`Tier` protocol the scheduler, the
autotune table, the daemon's lifecycle and the metrics depend on. The one implementation is
:class:`cached.fleet.redis_tier.RedisTier`; tests may pass anything of this shape.

Invariants every tier keeps: nothing it returns from :meth:`Tier.fetch` or
:meth:`Tier.fetch_records` is unverified (a tier hands back only what its fleet's keys
sign); no call raises into its caller (a tier that is down answers None or []); the
publishing calls return at once; a read-only tier publishes nothing.
"""

from __future__ import annotations

from concurrent.futures import Executor
from pathlib import Path
from typing import Protocol


class Tier(Protocol):
    read_only: bool
    """True on a node that may only fetch (it holds no signing key)."""
    executor: Executor
    """Where the scheduler runs :meth:`fetch` (it blocks)."""

    def start(self) -> None:
        """Begin publishing in the background."""

    def close(self, drain_s: float = 10.0) -> None:
        """Stop; publishes already queued get up to ``drain_s`` seconds to go out."""

    def fetch(self, key: str, expect: dict | None = None) -> tuple[dict, bytes, bytes] | None:
        """The verified row, object and library for ``key``, or None; blocking. ``expect``
        maps row fields to the values this node requires (toolchain, ...)."""

    def publish(self, key: str, row: dict, object_path: Path, library_path: Path) -> None:
        """Queue an artifact this node compiled; returns at once."""

    def publish_record(self, group: str, rid: str, row: dict) -> None:
        """Queue a tuning winner (cached.ops.autotune); returns at once."""

    def fetch_records(self, group: str) -> list[tuple[str, dict]]:
        """The verified (row id, row) of every winner filed under ``group``; blocking."""

    def snapshot(self) -> dict:
        """The tier's state and counters, for stats, /metrics and the page."""
