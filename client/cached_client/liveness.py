"""Whether the daemon at a socket answers, kept current by one prober thread per process.

:func:`watch` starts the prober for a socket (the vLLM plugin does,
cached_client.integrations.vllm.state); :func:`watched` returns it, or None where nobody started one
(the hooks then behave as without it). The hooks ask :meth:`Liveness.usable` before each kernel they
would get from the daemon and tell :meth:`Liveness.lost` when the daemon failed them; the kernels a
process compiled itself because the daemon was unusable are :meth:`Liveness.fell_back` and told to
the daemon with ``report`` once it answers again (``client_fallbacks`` in its stats).

Invariants: :meth:`Liveness.usable` reads state only (no I/O, no lock); at most one probe (a
``hello``, ``PROBE_TIMEOUT_S`` at most) is in flight per socket per process, on the prober's
own thread and connection, never on a caller's thread; a probe that fails is repeated after
``BACKOFF_S`` seconds, doubling up to ``BACKOFF_MAX_S``; a usable daemon is not probed until
a hook reports it lost or there is something to report. Reports are sent by the prober only;
counts a report failed to deliver (the daemon gone again) are kept for the next one; a
report the daemon refuses (an older daemon, a family it lacks) is dropped and the daemon
stays usable. A forked child starts a prober of its own on first use.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from typing import TYPE_CHECKING, Protocol

from .backoff import Backoff
from .errors import CachedError, DaemonUnavailable, DeadlineExceeded

if TYPE_CHECKING:
    from .client import Client
    from .protocol import HelloReply

logger = logging.getLogger("cached_client.liveness")

PROBE_TIMEOUT_S = 2.0
"""How long one probe (a ``hello``) waits for the daemon."""
BACKOFF_S = 0.5
"""Seconds before the first repeat of a failed probe; doubled after each failure."""
BACKOFF_MAX_S = 10.0
"""The longest wait between two probes of a daemon that does not answer."""
REPORT_TIMEOUT_S = 2.0

_watchers: dict[str, Liveness] = {}
_lock = threading.Lock()


class Reporter(Protocol):
    def take(self) -> dict: ...

    def restore(self, fields: dict) -> None: ...


class Liveness:
    """The prober of one socket (see the module doc). ``hello`` is the last answer, None
    while the daemon does not answer; ``reason`` says why; ``probes`` counts probes done."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.hello: HelloReply | None = None
        self.reason = "not asked yet"
        self.probes = 0
        self.answered_after_failure = 0
        """How often the daemon answered again after not answering (recoveries)."""
        self._failed = False
        self._cond = threading.Condition()
        self._wake = False
        self._fallbacks: Counter[str] = Counter()
        self._reporters: list[Reporter] = []
        self._pid = -1
        self._client: Client | None = None
        self._start()

    def _start(self) -> None:
        from .client import Client

        self._pid = os.getpid()
        self._cond = threading.Condition()
        self._client = Client(self.path, timeout=PROBE_TIMEOUT_S, fallback=False)
        threading.Thread(target=self._run, name="cached-liveness", daemon=True).start()

    def _alive_here(self) -> None:
        if self._pid != os.getpid():  # a forked child: the parent's thread is not here
            self._start()

    # -- what hooks ask and tell -----------------------------------------------------------

    def usable(self) -> bool:
        """Whether the last probe found the daemon answering (state only: no I/O)."""
        self._alive_here()
        return self.hello is not None

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the first probe's answer; whether it answered."""
        self._alive_here()
        with self._cond:
            self._cond.wait_for(lambda: self.probes > 0, timeout)
        return self.hello is not None

    def lost(self, exc: BaseException) -> None:
        """A hook found the daemon unusable (``exc``): marked down, the prober wakes."""
        if self.hello is not None:
            message = exc.message if isinstance(exc, CachedError) else str(exc)
            self._down(f"{type(exc).__name__}: {message[:300]}")
        self._poke()

    def fell_back(self, family: str, n: int = 1) -> None:
        """``n`` kernels of ``family`` compiled in this process because the daemon was
        unusable; told to the daemon once it answers."""
        with self._cond:
            self._fallbacks[family] += n

    def add_reporter(self, reporter: Reporter) -> None:
        """``reporter.take()`` gives ``report`` fields to send ({} for none) and forgets
        them; ``reporter.restore(fields)`` takes back those of a report that failed."""
        with self._cond:
            self._reporters.append(reporter)

    def poke(self) -> None:
        """Something to report: the prober sends it (if the daemon answers) soon."""
        self._alive_here()
        self._poke()

    def _poke(self) -> None:
        with self._cond:
            self._wake = True
            self._cond.notify_all()

    # -- the prober's thread ---------------------------------------------------------------

    def _down(self, reason: str) -> None:
        was, self.hello = self.hello, None
        self.reason = reason
        if was is not None:
            logger.info("cached: pid %d: the daemon at %s stopped answering (%s); kernels "
                        "compile in this process until it answers again (asked again in the "
                        "background, at most every %.0fs)", os.getpid(), self.path, reason,
                        BACKOFF_MAX_S)

    def _run(self) -> None:
        pid, delays = self._pid, Backoff(BACKOFF_S, BACKOFF_MAX_S)
        while pid == os.getpid():
            ok = self._probe()
            if ok:
                delays.reset()
                ok = self._report()
            with self._cond:
                if ok:
                    self._cond.wait_for(lambda: self._wake)
                else:
                    self._cond.wait_for(lambda: self._wake, delays.next())
                self._wake = False

    def _probe(self) -> bool:
        try:
            hello = self._client.hello(timeout=PROBE_TIMEOUT_S)
        except CachedError as exc:
            self._down(f"{type(exc).__name__}: {exc.message[:300]}")
            self._failed = True
            ok = False
        else:
            if self._failed:
                self.answered_after_failure += 1
                logger.info("cached: pid %d: the daemon at %s answers again; its kernels are "
                            "used again", os.getpid(), self.path)
            self._failed = False
            self.hello, self.reason = hello, ""
            ok = True
        with self._cond:
            self.probes += 1
            self._cond.notify_all()
        return ok

    def _report(self) -> bool:
        """Send what is to report; False (counts kept) when the daemon failed it."""
        with self._cond:
            fallbacks, self._fallbacks = dict(self._fallbacks), Counter()
            reporters = list(self._reporters)
        fields: dict = {"fallbacks": fallbacks} if fallbacks else {}
        taken = []
        for reporter in reporters:
            got = reporter.take()
            if got:
                taken.append((reporter, got))
                for key, value in got.items():
                    fields.setdefault(key, value)
        if not fields:
            return True
        from . import protocol as p

        try:
            self._client.call("report", p.ReportRequest(**{"fallbacks": {}, **fields}),
                              timeout=REPORT_TIMEOUT_S)
        except (DaemonUnavailable, DeadlineExceeded) as exc:
            with self._cond:
                self._fallbacks.update(fallbacks)
            for reporter, got in taken:
                reporter.restore(got)
            self._down(f"{type(exc).__name__}: {exc.message[:300]}")
            self._failed = True
            return False
        except CachedError as exc:  # refused (an older daemon, a family it lacks): dropped
            logger.debug("cached: the daemon at %s refused a report (%s); its counts are "
                         "dropped", self.path, exc.message)
        return True


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # another thread may have held it at the fork


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def watch(path: str) -> Liveness:
    """The prober of ``path`` in this process, started on first call."""
    with _lock:
        live = _watchers.get(path)
        if live is None:
            live = _watchers[path] = Liveness(path)
        return live


def watched(path: str | None) -> Liveness | None:
    """The prober of ``path`` if one was started, else None (no I/O)."""
    return _watchers.get(path) if path else None

