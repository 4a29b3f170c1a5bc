"""What the JIT-library hooks share: their client, their counters, what they replaced.

A hook (cached_client.flashinfer_nvcc, cached_client.humming, cached_client.triton) asks
the daemon for an artifact by write-back (cached_client.writeback: a hit, or a lease to
compile and publish) and otherwise leaves the library to do what it does alone: any
daemon problem is logged once per hook and what, and costs compile time, never the
process. ``counts`` says what the hook did in this process (``hit``: loaded an artifact
another process compiled; ``compiled``: compiled under a lease and published;
``aot``: the library's own prebuilt module won; ``local``: the library compiled without
the daemon (not served, daemon problem); ``refused``: a hit whose files did not match
their digests).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from typing import Any

from . import liveness, monitor
from .client import Client
from .errors import CachedError, DaemonUnavailable, DeadlineExceeded
from .keys import ARCHES

logger = logging.getLogger("cached_client.jit")

COOL_OFF_S = 30.0
"""After the daemon could not be reached, how long a hook goes straight to the library."""


def daemon_arch(arch: str) -> str | None:
    """``sm_<arch>`` when the daemon keys artifacts for it (cached_client.keys.ARCHES), else
    None: the library then compiles alone."""
    name = f"sm_{arch}"
    return name if name in ARCHES else None


class Hook:
    """One library's hook in this process."""

    def __init__(self, name: str, client: Client, family: str) -> None:
        self.name = name
        self.family = family
        self._base = client
        self._owner = threading.current_thread()
        self._local = threading.local()
        self.counts: Counter[str] = Counter()
        self._replaced: list[tuple[Any, str, Any, bool, Any]] = []
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self._down_until = 0.0

    @property
    def client(self) -> Client:
        """This thread's client: the one given for the thread that installed the hook, a
        connection of its own for every other thread (a library that compiles on several
        threads, as Humming does, must not queue one thread's lease wait behind another's
        on one connection)."""
        client = getattr(self._local, "client", None)
        if client is None:
            base = self._base
            client = base if threading.current_thread() is self._owner else Client(
                base.socket_path, timeout=base.timeout, fallback=False, identity=base.identity)
            self._local.client = client
        return client

    def replace(self, owner: Any, attr: str, new: Any) -> None:
        """Set ``owner.attr`` to ``new``, remembering what was there (:meth:`restore`)."""
        own = attr in vars(owner)
        original = vars(owner)[attr] if own else getattr(owner, attr)
        setattr(owner, attr, new)
        self._replaced.append((owner, attr, original, own, new))

    def restore(self) -> None:
        """Put back every attribute :meth:`replace` set (where it is still ours)."""
        for owner, attr, original, own, new in reversed(self._replaced):
            if vars(owner).get(attr) is new:
                if own:
                    setattr(owner, attr, original)
                else:
                    delattr(owner, attr)
        self._replaced.clear()

    def _live(self) -> liveness.Liveness | None:
        return liveness.watched(self._base.socket_path)

    def usable(self) -> bool:
        """Whether to ask the daemon: what this process's prober last found
        (cached_client.liveness) where one runs, else False for :data:`COOL_OFF_S` after
        the daemon could not be reached. No I/O."""
        live = self._live()
        if live is not None:
            return live.usable()
        return time.monotonic() >= self._down_until

    def local(self, name: str, fell_back: bool) -> None:
        """The library builds kernel ``name`` in this process: counted by the serving
        monitor (cached_client.monitor) and, when the daemon was unusable (``fell_back``),
        told to it as a fallback once it answers (where a prober runs)."""
        monitor.outside(self.family, name, "compiled")
        live = self._live()
        if fell_back and live is not None:
            live.fell_back(self.family)

    def failed(self, what: str, exc: BaseException) -> None:
        """A daemon problem while ``what``: counted, logged once per ``what``; an
        unreachable daemon is left alone for :data:`COOL_OFF_S` (or until this process's
        prober hears from it again)."""
        self.counts["local"] += 1
        if unreachable(exc):
            self._down_until = time.monotonic() + COOL_OFF_S
            live = self._live()
            if live is not None:
                live.lost(exc)
        with self._lock:
            if what in self._warned:
                return
            self._warned.add(what)
        message = exc.message if isinstance(exc, CachedError) else str(exc)
        logger.warning("cached: %s: %s failed (%s: %s); %s compiles it in this process",
                       self.name, what, type(exc).__name__, message[:300], self.name)


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the daemon could not be used (not a refusal of one request)."""
    return isinstance(exc, (DaemonUnavailable, DeadlineExceeded, ConnectionError))


def socket_client(socket_path: str | None, client: Client | None) -> Client:
    """The client a hook uses: the one given, else one for ``socket_path`` or
    $CACHED_SOCKET (no in-process fallback compiler: the library is the fallback)."""
    if client is not None:
        return client
    return Client(socket_path or os.environ.get("CACHED_SOCKET") or None, timeout=600.0,
                  fallback=False)
