"""The in-process compiler a client falls back to when the daemon is unusable: the one
another installed package offers (the daemon's package does, under the entry point group
:data:`FALLBACK_ENTRY_POINTS`), or a callable given to the Client.

Invariant: a broken entry point is no fallback (logged at debug, never raised); nothing is
imported until a fallback is asked for.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from .keys import KernelRequest
from .protocol import Artifact

logger = logging.getLogger("cached_client")

FALLBACK_ENTRY_POINTS = "cached_client.fallback"
"""Entry point group of in-process compilers: ``build(request, scratch_dir) -> Artifact``."""

Fallback = Callable[[KernelRequest, str], Artifact]


def installed_fallback() -> Fallback | None:
    """The in-process compiler another installed package offers, or None."""
    from importlib.metadata import entry_points

    for entry in entry_points(group=FALLBACK_ENTRY_POINTS):
        try:
            return entry.load()
        except Exception:  # noqa: BLE001 -- a broken fallback is no fallback
            logger.debug("fallback entry point %s failed to load", entry.value, exc_info=True)
    return None
