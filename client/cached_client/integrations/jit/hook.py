"""The base of the JIT-library hooks: install and uninstall, a client per thread, counters.

A hook (:class:`~cached_client.integrations.jit.nvcc.NvccHook`,
:class:`~cached_client.integrations.jit.humming.HummingHook`,
:class:`~cached_client.integrations.jit.triton.TritonHook`) is a :class:`Hook` subclass: it
names its library and its daemon family and replaces the library's functions in
:meth:`Hook.attach`. The base keeps one instance per subclass in a process
(:meth:`Hook.install`, :meth:`Hook.uninstall`, :meth:`Hook.current`), puts back what it
replaced, and owns the one route every hook takes to the daemon (:meth:`Hook.ask`): by
write-back (cached_client.writeback: a hit, or a lease to compile and publish), and
otherwise the library does what it does alone: any daemon problem is logged once per hook
and what, and costs compile time, never the process. ``counts`` says what the hook did in
this process (``hit``: loaded an artifact another process compiled; ``compiled``: compiled
under a lease and published; ``aot``: the library's own prebuilt module won; ``local``:
the library compiled without the daemon (not served, daemon problem); ``refused``: a hit
whose files did not match their digests).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from cached_client import liveness, monitor, writeback
from cached_client.client import Client
from cached_client.errors import CachedError, DaemonUnavailable, DeadlineExceeded
from cached_client.keys import ARCHES, KernelRequest
from cached_client.protocol import Artifact

logger = logging.getLogger("cached_client.jit")

COOL_OFF_S = 30.0
"""After the daemon could not be reached, how long a hook goes straight to the library."""

H = TypeVar("H", bound="Hook")
_install_lock = threading.RLock()


def daemon_arch(arch: str) -> str | None:
    """``sm_<arch>`` when the daemon keys artifacts for it (cached_client.keys.ARCHES), else
    None: the library then compiles alone."""
    name = f"sm_{arch}"
    return name if name in ARCHES else None


class Hook:
    """One library's hook in this process. A subclass sets :attr:`name` and :attr:`family`
    and overrides :meth:`attach`; the class methods manage its one instance."""

    name: ClassVar[str]
    """The library, as the hook's log lines name it."""
    family: ClassVar[str]
    """The daemon family its artifacts are filed under."""
    _installed: ClassVar[Hook]  # set on the subclass while installed (:meth:`current`)

    def __init__(self, client: Client) -> None:
        self._base = client
        self._owner = threading.current_thread()
        self._local = threading.local()
        self.counts: Counter[str] = Counter()
        self._replaced: list[tuple[Any, str, Any, bool, Any]] = []
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self._down_until = 0.0


    def attach(self) -> None:
        """Replace the library's functions with :meth:`replace` (called once, by
        :meth:`install`; what it replaced is put back if it raises). Nothing by default: a
        library that selects the hook itself (Triton's remote-cache variables) needs none."""

    @classmethod
    def current(cls: type[H]) -> H | None:
        """This process's hook of this class, or None when it is not installed."""
        return cls.__dict__.get("_installed")

    @classmethod
    def installed(cls) -> bool:
        return cls.current() is not None

    @classmethod
    def install(cls: type[H], socket_path: str | None = None, *,
                client: Client | None = None) -> H:
        """Install this hook (idempotent: the installed one is returned); its client is
        ``client``, else one for ``socket_path`` or $CACHED_SOCKET (:func:`socket_client`)."""
        with _install_lock:
            hook = cls.current()
            if hook is None:
                hook = cls(socket_client(socket_path, client))
                try:
                    hook.attach()
                except BaseException:
                    hook.restore()
                    raise
                cls._installed = hook
            return hook

    @classmethod
    def uninstall(cls) -> None:
        """Put back what the installed hook replaced; the next call finds it not installed."""
        with _install_lock:
            hook = cls.current()
            if hook is not None:
                del cls._installed
        if hook is not None:
            hook.restore()

    @classmethod
    def stats(cls) -> dict:
        """What the hook did in this process (``counts``; ``{}`` when not installed)."""
        hook = cls.current()
        return dict(hook.counts) if hook is not None else {}

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

    def ask(self, name: str, what: str, request: Callable[[], KernelRequest | None]
            ) -> Artifact | writeback.HeldLease | None:
        """The daemon's answer for kernel ``name`` (``request()`` makes its request; None: a
        target the daemon does not key): a hit (an :class:`Artifact`, its files not yet
        read), this process's lease to compile it under (a :class:`writeback.HeldLease`), or
        None: the library builds it here without the daemon. Every outcome but a hit is a
        local build, told to the serving monitor (:meth:`local`); a daemon that is unusable
        is not asked, a daemon problem while ``what`` is :meth:`failed`."""
        if not self.usable():
            self.counts["local"] += 1
            self.local(name, fell_back=True)
            return None
        try:
            req = request()
            got = writeback.acquire(self.client, req) if req is not None else None
        except Exception as exc:  # noqa: BLE001 -- a daemon problem costs a compile, no more
            self.failed(what, exc)
            self.local(name, unreachable(exc))
            return None
        if not isinstance(got, Artifact):
            self.local(name, fell_back=False)  # compiled here, alone or under this lease
        return got

    def refused(self, name: str, what: str, exc: BaseException) -> None:
        """A hit for kernel ``name`` that could not be used (its files did not match their
        digests, or did not load) while ``what``: counted, and the library builds it here."""
        self.counts["refused"] += 1
        self.failed(what, exc)
        self.local(name, fell_back=False)

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
