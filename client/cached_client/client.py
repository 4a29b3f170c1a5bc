"""The client an inference process holds: ask the daemon for kernels, load them.

Flow: request -> (in-process cache) -> transport -> daemon -> verified path -> loader.
Invariants: every call has a deadline; every reply is matched to its request by id and
decoded by the protocol's checks (a malformed or mismatched reply is ``BadReply``); a
loaded function is cached per request, so the hot path of :meth:`Client.load` is one dict
lookup; a forked child opens its own connection; when the daemon cannot be reached the
client says so once per socket and compiles in-process if a fallback compiler is
available (the ``cached_client.fallback`` entry point, which the daemon's package
provides, or a callable given to the constructor), else raises DaemonUnavailable.

Identity: every request that can return an artifact (``get``, ``prefetch``, ``plan``,
``lease*``, ``publish``) states this environment's identity (cached_client.identity: its
toolchain, the sources of the families it names, its runtime), added here in one place;
the daemon serves only artifacts whose key matches it (docs/keys.md).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from . import identity as env_identity
from . import protocol as p
from .errors import (
    BadReply,
    CachedError,
    DaemonUnavailable,
    DeadlineExceeded,
    InvalidArgument,
    error_from_wire,
)
from .keys import KernelRequest
from .loader import load_bytes, load_library
from .paths import SOCKET_ENV, check_socket_dir, default_socket_path
from .protocol import Artifact
from .transport import Connection

logger = logging.getLogger("cached_client")

DEFAULT_TIMEOUT_S = 60.0
FALLBACK_ENTRY_POINTS = "cached_client.fallback"
"""Entry point group of in-process compilers: ``build(request, scratch_dir) -> Artifact``."""

Fallback = Callable[[KernelRequest, str], Artifact]
R = TypeVar("R", bound=p.Message)
_warned_unreachable: set[str] = set()
_clients: weakref.WeakSet[Client] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for client in list(_clients):
        client._forget_connection()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def installed_fallback() -> Fallback | None:
    """The in-process compiler another installed package offers, or None."""
    from importlib.metadata import entry_points

    for entry in entry_points(group=FALLBACK_ENTRY_POINTS):
        try:
            return entry.load()
        except Exception:  # noqa: BLE001 -- a broken fallback is no fallback
            logger.debug("fallback entry point %s failed to load", entry.value, exc_info=True)
    return None


class Client:
    """A connection to one daemon socket; safe to share between threads, and across fork."""

    def __init__(
        self,
        socket_path: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        transfer: str = "path",
        fallback: bool | Fallback = True,
        identity: bool | p.Identity = True,
    ) -> None:
        """``identity``: True states this environment's own (the default), an Identity
        states that one (``cached warm --toolchain``), False none (the daemon's default
        toolchain then decides)."""
        if transfer not in p.TRANSFERS:
            raise ValueError(f"transfer must be one of {', '.join(p.TRANSFERS)}")
        self.socket_path = socket_path or default_socket_path()
        self._untrusted = None
        if socket_path is None and not os.environ.get(SOCKET_ENV):
            self._untrusted = check_socket_dir(self.socket_path)
        self.timeout = timeout
        self.transfer = transfer
        self.fallback = fallback
        self.identity = identity
        self._conn: Connection | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._next_id = 0
        self._loaded: dict[KernelRequest, Any] = {}
        self._fallbacks: dict[str, int] = {}  # in-process compiles not yet reported
        self._scratch = os.path.join(tempfile.gettempdir(), f"cached-client-{os.getuid()}")
        _clients.add(self)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def _forget_connection(self) -> None:
        """In a forked child: the parent's socket and lock are not ours to use."""
        self._lock = threading.Lock()
        if self._conn is not None:
            self._conn.close()  # closes only this process's descriptor
            self._conn = None
        self._pid = os.getpid()

    # -- one round trip ------------------------------------------------------------------

    def call(self, op: str, request: p.Message | None = None,
             timeout: float | None = None) -> tuple[Any, bytes | None]:
        """One round trip of ``op`` on the shared connection: the decoded reply and its
        payload. Raises the typed error of an error reply, BadReply for a reply that does
        not follow the protocol, DaemonUnavailable/DeadlineExceeded for the transport."""
        spec = p.OPS[op]
        request = request or p.Empty()
        if not isinstance(request, spec.request):
            raise TypeError(f"{op} takes a {spec.request.__name__}, not "
                            f"{type(request).__name__}")
        if getattr(request, "identity", False) is None and self.identity is not False:
            request = dataclasses.replace(request, identity=self._identity_for(request))
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._lock:
            if self._pid != os.getpid():
                self._forget_connection()
            self._next_id += 1
            message = {"v": p.PROTOCOL_VERSION, "id": self._next_id, "op": op,
                       **request.to_wire()}
            if self._conn is None:
                if self._untrusted:
                    raise DaemonUnavailable(f"not connecting: {self._untrusted}")
                self._conn = Connection(self.socket_path, deadline)
            conn = self._conn
            try:
                reply, payload = conn.request(message, deadline)
                if reply.get("id") != message["id"]:
                    raise BadReply(f"the daemon answered request {reply.get('id')!r} to "
                                   f"request {message['id']} ({op}); connection dropped")
            except CachedError:
                self._conn = None
                conn.close()
                raise
        if reply.get("ok") is not True:
            error = reply.get("error")
            raise error_from_wire(error if isinstance(error, dict) else {})
        try:
            return spec.reply.from_wire(reply), payload
        except InvalidArgument as exc:
            raise BadReply(f"the daemon's reply to {op} does not follow the protocol: "
                           f"{exc.message}") from None

    def _identity_for(self, request: p.Message) -> p.Identity:
        """The identity ``request`` states: the configured one, or this environment's with
        the sources of the families the request names."""
        if isinstance(self.identity, p.Identity):
            return self.identity
        kernel = getattr(request, "request", None)
        if isinstance(kernel, KernelRequest):
            names = [kernel.family]
        elif isinstance(request, p.PrefetchRequest):
            names = [w.get("family") for w in request.requests if isinstance(w, dict)]
        else:
            names = [getattr(request, "family", "")]
        return p.Identity(**env_identity.for_families(n for n in names if isinstance(n, str)))

    def _call(self, op: str, request: p.Message | None, reply_type: type[R],
              timeout: float | None = None) -> R:
        reply, _ = self.call(op, request, timeout)
        assert isinstance(reply, reply_type)
        return reply

    # -- one method per op ----------------------------------------------------------------

    def hello(self, timeout: float | None = None) -> p.HelloReply:
        return self._call("hello", None, p.HelloReply, timeout)

    def stats(self, timeout: float | None = None) -> dict:
        return self._call("stats", None, p.StatsReply, timeout).stats

    def zero_stats(self, timeout: float | None = None) -> p.ZeroStatsReply:
        """The statistics as they were; ``cached stats`` counts from zero after this."""
        return self._call("zero_stats", None, p.ZeroStatsReply, timeout)

    def list(self, timeout: float | None = None) -> list[dict]:
        return self._call("list", None, p.ListReply, timeout).entries

    def plan(
        self, family: str, shape: tuple[int, int, int], arch: str, sm_count: int | None = None,
        options: dict | None = None, timeout: float | None = None,
    ) -> list[KernelRequest]:
        """The family's tactic space for ``shape`` on a target, in its stable order."""
        return self.plan_reply(family, shape, arch, sm_count, options, timeout).requests

    def plan_reply(
        self, family: str, shape: tuple[int, int, int], arch: str, sm_count: int | None = None,
        options: dict | None = None, timeout: float | None = None,
    ) -> p.PlanReply:
        """:meth:`plan` with each request's reduction-order class (``reply.classes``)."""
        request = p.PlanRequest(family=family, shape=list(shape), arch=arch,
                                sm_count=sm_count, options=options or {})
        return self._call("plan", request, p.PlanReply, timeout)

    def prefetch(self, requests: Iterable[KernelRequest],
                 timeout: float | None = None) -> p.PrefetchReply:
        """Queue compilations behind waiting clients; answers at once."""
        request = p.PrefetchRequest(requests=[r.to_wire() for r in requests])
        return self._call("prefetch", request, p.PrefetchReply, timeout)

    def get(
        self, request: KernelRequest, timeout: float | None = None, priority: str = "interactive"
    ) -> Artifact:
        """The artifact for ``request``, compiled by the daemon if it has none yet.

        The daemon is given a slightly shorter deadline than the socket, so that a
        kernel still compiling comes back as its typed DeadlineExceeded answer.
        """
        timeout = self.timeout if timeout is None else timeout
        message = p.GetRequest(request=request, priority=priority, transfer=self.transfer,
                               deadline_ms=max(1, int(timeout * 1000 * 0.95) - 20))
        reply, payload = self.call("get", message, timeout)
        artifact = reply.artifact
        if self.transfer == "bytes":
            if payload is None:
                raise BadReply("the daemon sent no library bytes for a 'bytes' transfer")
            artifact = dataclasses.replace(artifact, library_bytes=payload)
        return artifact

    def gc(self, request: p.GcRequest, timeout: float | None = None) -> p.GcReply:
        return self._call("gc", request, p.GcReply, timeout)

    def verify(self, timeout: float | None = None) -> p.VerifyReply:
        return self._call("verify", None, p.VerifyReply, timeout)

    def report(self, fallbacks: dict[str, int], timeout: float | None = None) -> None:
        self._call("report", p.ReportRequest(fallbacks=fallbacks), p.Empty, timeout)

    def lease(self, request: p.LeaseRequest, timeout: float | None = None) -> p.LeaseReply:
        return self._call("lease", request, p.LeaseReply, timeout)

    def lease_renew(self, request: p.LeaseRenewRequest,
                    timeout: float | None = None) -> p.LeaseRenewReply:
        return self._call("lease_renew", request, p.LeaseRenewReply, timeout)

    def lease_release(self, request: p.LeaseReleaseRequest,
                      timeout: float | None = None) -> p.StateReply:
        return self._call("lease_release", request, p.StateReply, timeout)

    def publish(self, request: p.PublishRequest,
                timeout: float | None = None) -> p.PublishReply:
        return self._call("publish", request, p.PublishReply, timeout)

    def publish_bundle(self, request: p.PublishBundleRequest,
                       timeout: float | None = None) -> p.PublishReply:
        return self._call("publish_bundle", request, p.PublishReply, timeout)

    def flashinfer_artifacts(self, family: str | None = None,
                             timeout: float | None = None) -> p.FlashInferArtifactsReply:
        return self._call("flashinfer_artifacts", p.FamilyFilter(family=family),
                          p.FlashInferArtifactsReply, timeout)

    def autotune_put(self, request: p.AutotunePutRequest,
                     timeout: float | None = None) -> bool:
        return self._call("autotune_put", request, p.AutotunePutReply, timeout).stored

    def autotune_get(self, request: p.AutotuneGetRequest,
                     timeout: float | None = None) -> list[dict]:
        return self._call("autotune_get", request, p.AutotuneGetReply, timeout).results

    def certify_record(self, record: dict, timeout: float | None = None) -> int:
        return self._call("certify_record", p.CertifyRecordRequest(record=record),
                          p.CertifyRecordReply, timeout).record_id

    def certifications(self, family: str | None = None,
                       timeout: float | None = None) -> list[dict]:
        return self._call("certifications", p.FamilyFilter(family=family),
                          p.CertificationsReply, timeout).certifications

    # -- loading ---------------------------------------------------------------------------

    def load(self, request: KernelRequest, timeout: float | None = None) -> Any:
        """A callable TVM-FFI function for ``request``, cached in this process."""
        fn = self._loaded.get(request)
        if fn is not None:
            return fn
        try:
            artifact = self.get(request, timeout)
        except (DaemonUnavailable, DeadlineExceeded) as exc:
            if self.fallback is False:
                raise
            artifact = self._fallback_build(request, exc)
        else:
            if self._fallbacks:
                self._report_fallbacks()
        fn = self._load_artifact(artifact)
        self._loaded[request] = fn
        return fn

    def _load_artifact(self, artifact: Artifact) -> Any:
        if artifact.library_bytes is not None:
            return load_bytes(
                artifact.library_bytes, artifact.symbol, artifact.library_sha256,
                artifact.runtime_library, self._scratch,
            )
        if artifact.library_path is None:
            raise BadReply("the daemon's answer named no library path and sent no bytes")
        return load_library(
            artifact.library_path, artifact.symbol, artifact.library_sha256,
            artifact.runtime_library,
        )

    def _fallback_build(self, request: KernelRequest, reason: CachedError) -> Artifact:
        if self.socket_path not in _warned_unreachable:
            _warned_unreachable.add(self.socket_path)
            logger.warning(
                "cached daemon at %s unusable (%s); compiling in this process instead",
                self.socket_path, reason.message,
            )
        build = self.fallback if callable(self.fallback) else installed_fallback()
        if build is None:
            raise DaemonUnavailable(
                f"{reason.message}; and no in-process compiler for {request.family!r} is "
                "installed here (install the 'cached' package to compile in-process, or "
                "start the daemon: make serve)"
            ) from None
        artifact = build(request, self._scratch)
        self._fallbacks[request.family] = self._fallbacks.get(request.family, 0) + 1
        return artifact

    def _report_fallbacks(self) -> None:
        """Tell the daemon, once it answers again, how many kernels this process compiled
        itself meanwhile (its ``cached_client_fallbacks_total`` metric)."""
        pending, self._fallbacks = self._fallbacks, {}
        try:
            self.report(pending, timeout=2.0)
        except CachedError:
            pass  # a daemon without the op, or gone again: not worth more
