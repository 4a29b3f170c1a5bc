"""The client an inference process holds: ask the daemon for kernels, load them.

Flow: request -> (in-process cache) -> transport -> daemon -> open descriptors of the
verified blobs (transfer ``fd``, the default) -> loader (hashed; loaded in place or from a
private copy). Eviction in the daemon's store cannot break a load in progress: a blob gone
from its name is copied from the descriptor, never read by path (unless asked: ``path``).

Invariants: every call has a deadline; every reply is matched to its request by id and
decoded by the protocol's checks (a malformed or mismatched reply is ``BadReply``); a
loaded function is cached per request, so the hot path of :meth:`Client.load` is one dict
lookup; a forked child opens its own connection; when the daemon stops answering (a
connect that times out, or no byte for ``SILENCE_S`` and no answer to a ``hello`` on a new
connection) the process stops asking it for ``RETRY_AFTER_S`` seconds (cached_client.circuit,
per socket path: every call fails at once meanwhile; a daemon that is simply not running costs
a refused connect, microseconds, and trips nothing); when the daemon is unusable the
client compiles in-process if a fallback compiler is available (the
``cached_client.fallback`` entry point, which the daemon's package provides, or a callable
given to the constructor), else raises DaemonUnavailable; it says so once per socket.

Identity: every request that can return an artifact (``get``, ``prefetch``, ``plan``,
``lease*``, ``publish``) states this environment's identity (cached_client.identity: its
toolchain, the sources of the families it names, its runtime), added here in one place;
the daemon serves only artifacts whose key matches it (docs/keys.md).

Trust: every connect checks whom it reached (cached_client.transport: the server's uid, and
a default socket's directory); before the first ``get`` or ``lease`` on a connection the
client reads the daemon's ``hello`` capabilities (refusing one too old to state what its
artifacts were built with, and choosing the transfer), and every artifact a ``get`` or a
``lease`` hit returns is checked against this process's identity before anything is copied
or loaded (cached_client.trust): a mismatch is ArtifactMismatch, a miss (``load`` compiles
in-process), warned once per socket and set of fields. All three refusals are
DaemonUnavailable.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from . import identity as env_identity
from . import monitor, paths, trust
from . import protocol as p
from .circuit import CIRCUITS, RETRY_AFTER_S
from .errors import (
    ArtifactMismatch,
    BadReply,
    CachedError,
    DaemonTooOld,
    DaemonUnavailable,
    DeadlineExceeded,
    InvalidArgument,
    Overloaded,
    error_from_wire,
)
from .inprocess import Fallback, installed_fallback
from .keys import KernelRequest
from .loader import Scratch, load_library, place
from .paths import default_socket_path
from .protocol import BLOB_SUFFIXES, Artifact
from .transport import ConnectFailed, Connection, DaemonSilent

logger = logging.getLogger("cached_client")

DEFAULT_TIMEOUT_S = 60.0
PROBE_TIMEOUT_S = 2.0
"""How long a silent daemon gets to answer a ``hello`` on a new connection."""
R = TypeVar("R", bound=p.Message)
_warned_unreachable: set[str] = set()
_warned_mismatch: set[tuple[str, tuple[str, ...]]] = set()
_clients: weakref.WeakSet[Client] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    CIRCUITS.after_fork()
    for client in list(_clients):
        client._forget_connection()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@functools.lru_cache(maxsize=256)
def _environment_identity(families: tuple[str, ...]) -> dict:
    """This process's identity for ``families``, checked and in wire form (what it is
    made of is computed once per process: cached_client.identity). Never mutate it."""
    return p.Identity(**env_identity.for_families(families)).to_wire()


class Client:
    """A connection to one daemon socket; safe to share between threads, and across fork."""

    def __init__(
        self,
        socket_path: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        transfer: str = "fd",
        fallback: bool | Fallback = True,
        identity: bool | p.Identity = True,
    ) -> None:
        """``identity``: True states this environment's own (the default), an Identity
        states that one (``cached warm --toolchain``), False none (the daemon's default
        toolchain then decides)."""
        if transfer not in p.TRANSFERS:
            raise ValueError(f"transfer must be one of {', '.join(p.TRANSFERS)}")
        self.socket_path = socket_path or default_socket_path()
        """The socket asked (with no path: the default that answered last)."""
        # no path and no $CACHED_SOCKET: every new connection tries paths.socket_candidates()
        # in order (the per-user socket, then the system one)
        self._search = socket_path is None and not os.environ.get(paths.SOCKET_ENV)
        # a default socket may sit under a shared /tmp: its directory is checked at every
        # connect; one named by $CACHED_SOCKET gets the peer's uid check only
        self._check_dir = self._search or paths.is_default_socket(socket_path or "")
        self.timeout = timeout
        self.transfer = transfer
        self.fallback = fallback
        self.identity = identity
        self._conn: Connection | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._next_id = 0
        self._loaded: dict[KernelRequest, Callable[..., Any]] = {}
        self._fallbacks: dict[str, int] = {}  # in-process compiles not yet reported
        self._scratch = Scratch()  # checked at every use (cached_client.loader)
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
        reply, payload, fds = self._round_trip(op, request, timeout)
        for fd in fds:
            _close(fd)
        return reply, payload

    def _round_trip(self, op: str, request: p.Message | None,
                    timeout: float | None) -> tuple[Any, bytes | None, list[int]]:
        """:meth:`call`, also returning the descriptors the reply passed (caller closes)."""
        spec = p.OPS[op]
        request = request or p.Empty()
        if not isinstance(request, spec.request):
            raise TypeError(f"{op} takes a {spec.request.__name__}, not "
                            f"{type(request).__name__}")
        message = {"v": p.PROTOCOL_VERSION, "op": op, **request.to_wire()}
        if getattr(request, "identity", False) is None and self.identity is not False:
            message["identity"] = self._identity_wire(request)
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._lock:
            if self._pid != os.getpid():
                self._forget_connection()
            self._next_id += 1
            message["id"] = self._next_id
            reply, payload, fds = self._exchange(message, deadline)
        try:
            if reply.get("ok") is not True:
                error = reply.get("error")
                raise error_from_wire(error if isinstance(error, dict) else {})
            try:
                return spec.reply.from_wire(reply), payload, fds
            except InvalidArgument as exc:
                raise BadReply(f"the daemon's reply to {op} does not follow the protocol: "
                               f"{exc.message}") from None
        except BaseException:
            for fd in fds:
                _close(fd)
            raise

    def _exchange(self, message: dict, deadline: float) -> tuple[dict, bytes | None, list[int]]:
        """Send ``message`` and read its reply, under the lock. A kept connection the daemon
        closed meanwhile (its idle timeout, a restart) is replaced once, silently; a daemon
        that cannot be reached or went silent opens the circuit (``RETRY_AFTER_S``) at once,
        kept connection or not (one silence window and one probe, never two)."""
        why = CIRCUITS.reason(self.socket_path)
        if why is not None:
            raise DaemonUnavailable(why)
        for attempt in (1, 2):
            conn = self._conn
            if conn is not None and not conn.usable():
                conn.close()
                conn = self._conn = None
            kept = conn is not None
            try:
                if conn is None:
                    conn = self._conn = self.connect(deadline)
                received = conn.received
                conn.on_silence = self._daemon_answers  # only during the call: no cycle
                try:
                    conn.send(message, deadline)
                    reply, payload, fds = conn.receive_with_fds(deadline)
                finally:
                    conn.on_silence = None
            except BadReply:
                self._drop(conn)
                raise
            except DaemonUnavailable as exc:
                self._drop(conn)
                if (kept and attempt == 1 and conn is not None and conn.received == received
                        and not isinstance(exc, DaemonSilent)):
                    continue  # the daemon had closed the kept connection: one fresh try
                if isinstance(exc, DaemonSilent):
                    if CIRCUITS.open(self.socket_path, exc.message):
                        logger.info("cached daemon at %s unusable (%s); not asking it again "
                                    "for %.0fs", self.socket_path, exc.message, RETRY_AFTER_S)
                raise
            except DeadlineExceeded:
                self._drop(conn)
                raise
            if reply.get("id") != message["id"]:
                for fd in fds:
                    _close(fd)
                self._drop(conn)
                raise BadReply(f"the daemon answered request {reply.get('id')!r} to request "
                               f"{message['id']} ({message['op']}); connection dropped")
            CIRCUITS.close(self.socket_path)
            if message["op"] == "hello" and reply.get("ok") is True:
                caps = reply.get("capabilities")
                caps = caps if isinstance(caps, list) else []
                conn.capabilities = frozenset(c for c in caps if isinstance(c, str))
                ops = reply.get("ops")
                conn.ops = frozenset(o for o in (ops if isinstance(ops, list) else [])
                                     if isinstance(o, str))
                env_identity.adopt_stated(reply.get("toolchains"))
            return reply, payload, fds
        raise AssertionError("unreachable")

    def connect(self, deadline: float, connect_timeout: float | None = None) -> Connection:
        """A new connection of the caller's own (to close), through the same trust checks as
        every call's: to :attr:`socket_path`, or, with no path given, to the first default
        socket that accepts (one with no file or no listener is passed over; any other
        failure, an untrusted directory or server included, is raised as it is)."""
        kw = {} if connect_timeout is None else {"connect_timeout": connect_timeout}
        if not self._search:
            return Connection(self.socket_path, deadline, check_dir=self._check_dir, **kw)
        missed: list[tuple[str, ConnectFailed]] = []
        for path in paths.socket_candidates():
            try:
                conn = Connection(path, deadline, check_dir=True, **kw)
            except ConnectFailed as exc:
                if exc.errno not in (errno.ENOENT, errno.ECONNREFUSED):
                    raise
                missed.append((path, exc))
                continue
            self.socket_path = path
            return conn
        self.socket_path = missed[0][0]
        raise ConnectFailed("cannot connect to the daemon at " + " nor at ".join(
            f"{path} ({os.strerror(exc.errno or 0)})" for path, exc in missed),
            missed[0][1].errno)

    def _drop(self, conn: Connection | None) -> None:
        if conn is not None:
            conn.close()
        if self._conn is conn:
            self._conn = None

    def _daemon_answers(self) -> bool:
        """Whether the daemon answers a ``hello`` on a new connection within
        ``PROBE_TIMEOUT_S`` (asked while a call has heard nothing for a while). Nothing
        listening (refused, or no socket file) counts as answering: a draining daemon stops
        listening but finishes what its connections wait for, and a dead one closes them."""
        deadline = time.monotonic() + PROBE_TIMEOUT_S
        try:
            with self.connect(deadline, PROBE_TIMEOUT_S) as probe:
                reply, _ = probe.request({"v": p.PROTOCOL_VERSION, "id": 0, "op": "hello"},
                                         deadline)
        except ConnectFailed as exc:
            return exc.errno in (errno.ECONNREFUSED, errno.ENOENT)
        except CachedError:
            return False
        return "ok" in reply

    def _identity_wire(self, request: p.Message) -> dict:
        """The identity ``request`` states, as sent: the configured one, or this
        environment's with the sources of the families the request names."""
        if isinstance(self.identity, p.Identity):
            return self.identity.to_wire()
        kernel = getattr(request, "request", None)
        if isinstance(kernel, KernelRequest):
            names = [kernel.family]
        elif isinstance(request, p.GetBatchRequest):
            names = [r.family for r in request.requests]
        elif isinstance(request, p.PrefetchRequest):
            names = [w.get("family") for w in request.requests if isinstance(w, dict)]
        else:
            names = [getattr(request, "family", "")]
        return _environment_identity(tuple(sorted({n for n in names if isinstance(n, str)})))

    def _call(self, op: str, request: p.Message | None, reply_type: type[R],
              timeout: float | None = None) -> R:
        reply, _ = self.call(op, request, timeout)
        assert isinstance(reply, reply_type)
        return reply

    # -- one method per op ----------------------------------------------------------------

    def hello(self, timeout: float | None = None) -> p.HelloReply:
        return self._call("hello", None, p.HelloReply, timeout)

    def capabilities(self, timeout: float | None = None) -> frozenset[str]:
        """What the daemon on the current connection stated in its ``hello`` (asked once per
        connection: a new connection may reach a restarted, different daemon)."""
        with self._lock:
            conn = self._conn
            if (self._pid == os.getpid() and conn is not None and conn.usable()
                    and conn.capabilities is not None):
                return conn.capabilities
        return frozenset(self.hello(timeout).capabilities)

    def supports(self, op: str, timeout: float | None = None) -> bool:
        """Whether the daemon on the current connection listed ``op`` in its ``hello``
        (asked once per connection, as :meth:`capabilities`); False when it cannot be
        asked (an older or absent daemon: the caller takes the path every daemon has)."""
        with self._lock:
            conn = self._conn
            if (self._pid == os.getpid() and conn is not None and conn.usable()
                    and conn.ops is not None):
                return op in conn.ops
        try:
            return op in self.hello(timeout).ops
        except CachedError:
            return False

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
        options: dict | None = None, timeout: float | None = None, limit: int | None = None,
    ) -> p.PlanReply:
        """:meth:`plan` with each request's reduction-order class (``reply.classes``); with
        ``limit``, at most that many of the plan's first requests (an older daemon may
        answer all)."""
        request = p.PlanRequest(family=family, shape=list(shape), arch=arch,
                                sm_count=sm_count, options=options or {}, limit=limit)
        return self._call("plan", request, p.PlanReply, timeout)

    def plan_shape(self, request: p.PlanShapeRequest,
                   timeout: float | None = None) -> p.PlanShapeReply:
        """One weight shape's tactic per M bucket (shared winners applied by the daemon, with
        cached_client.gemm.policy.pick_tactics), its kernels queued with ``prefetch``."""
        return self._call("plan_shape", request, p.PlanShapeReply, timeout)

    def prefetch(self, requests: Iterable[KernelRequest],
                 timeout: float | None = None) -> p.PrefetchReply:
        """Queue compilations behind waiting clients; answers at once."""
        request = p.PrefetchRequest(requests=[r.to_wire() for r in requests])
        return self._call("prefetch", request, p.PrefetchReply, timeout)

    def get(
        self, request: KernelRequest, timeout: float | None = None,
        priority: str = "interactive", blobs: tuple[str, ...] = p.BLOB_KINDS,
    ) -> Artifact:
        """The artifact for ``request``, compiled by the daemon if it has none yet.

        The daemon is given a slightly shorter deadline than the socket, so that a
        kernel still compiling comes back as its typed DeadlineExceeded answer. With
        transfer ``fd`` the returned paths are this user's private copies (their digests
        checked as they were copied), so nothing the daemon evicts can break reading them;
        only the ``blobs`` asked for are copied (the others' paths are None). A path is a
        name, not a promise: whatever loads one hashes what it opened
        (cached_client.loader).
        """
        artifact, passed = self._fetch(request, timeout, priority, blobs)
        if passed is None:
            return artifact
        return self._private_copies(artifact, passed, blobs)

    def _fetch(
        self, request: KernelRequest, timeout: float | None, priority: str,
        blobs: tuple[str, ...],
    ) -> tuple[Artifact, dict[str, int] | None]:
        """:meth:`get`'s round trip and checks: the artifact, and for transfer ``fd`` the
        descriptors passed for ``blobs`` (kind -> fd; the caller closes them)."""
        timeout = self.timeout if timeout is None else timeout
        transfer = self._transfer(timeout)
        message = p.GetRequest(request=request, priority=priority, transfer=transfer,
                               blobs=list(blobs),
                               deadline_ms=max(1, int(timeout * 1000 * 0.95) - 20))
        reply, payload, fds = self._round_trip("get", message, timeout)
        stated = None if self.identity is False else self._identity_wire(message)
        artifact, passed = self._checked(reply.artifact, request, stated, transfer, blobs,
                                         reply.fds, fds)
        if transfer == "bytes":
            if payload is None:
                raise BadReply("the daemon sent no library bytes for a 'bytes' transfer")
            artifact = dataclasses.replace(artifact, library_bytes=payload)
        return artifact, passed

    def _transfer(self, timeout: float) -> str:
        """The transfer to ask for: this client's, where the daemon (its ``hello``, asked
        once per connection) offers it; DaemonTooOld for a daemon too old to state what
        its artifacts were built with."""
        caps = self.capabilities(timeout)
        why = trust.too_old(caps, self.socket_path)
        if why is not None:
            raise DaemonTooOld(why)
        transfer = self.transfer
        if transfer not in ("path", "bytes") and f"transfer:{transfer}" not in caps:
            transfer = "path"
        return transfer

    def _checked(self, artifact: Artifact, request: KernelRequest, stated: dict | None,
                 transfer: str, blobs: tuple[str, ...], named: list[str], fds: list[int]
                 ) -> tuple[Artifact, dict[str, int] | None]:
        """``artifact`` checked against this process's identity (trust.mismatches:
        ArtifactMismatch) with the descriptors passed for ``blobs`` (trust.passed_blobs);
        every descriptor not returned is closed, also on an error."""
        found = trust.mismatches(artifact, request, stated)
        passed = trust.passed_blobs(transfer, blobs, named, fds)
        if found:
            for fd in (passed or {}).values():
                _close(fd)
            raise self._mismatch(artifact, found)
        return artifact, passed

    def _mismatch(self, artifact: Artifact, found: dict[str, str]) -> ArtifactMismatch:
        """The error for an artifact not built for this process; warned once per socket
        and set of fields."""
        fields = tuple(sorted(found))
        differ = "; ".join(found[f] for f in fields)
        message = (f"the daemon at {self.socket_path} described {artifact.family} kernel "
                   f"{artifact.key[:16]} built for another environment ({differ}); not "
                   "loading it: a miss")
        if (self.socket_path, fields) not in _warned_mismatch:
            _warned_mismatch.add((self.socket_path, fields))
            logger.warning("cached: %s (compiling in this process instead)", message)
        return ArtifactMismatch(message, fields)

    def _private_copies(self, artifact: Artifact, passed: dict[str, int],
                        blobs: tuple[str, ...]) -> Artifact:
        """Copy the ``blobs`` the daemon passed as descriptors (kind -> fd) into the private
        scratch directory, through a descriptor of it checked now, each hashed as it is
        copied (cached_client.loader.place); closes every descriptor passed."""
        paths: dict[str, str | None] = {"object": None, "library": None}
        try:
            dir_fd = self._scratch.open()
            try:
                for kind in blobs:
                    name = getattr(artifact, f"{kind}_sha256") + BLOB_SUFFIXES[kind]
                    place(dir_fd, name, getattr(artifact, f"{kind}_sha256"), passed[kind])
                    paths[kind] = os.path.join(self._scratch.path, name)
            finally:
                os.close(dir_fd)
        finally:
            for fd in passed.values():
                _close(fd)
        return dataclasses.replace(artifact, object_path=paths["object"],
                                   library_path=paths["library"])

    def gc(self, request: p.GcRequest, timeout: float | None = None) -> p.GcReply:
        return self._call("gc", request, p.GcReply, timeout)

    def verify(self, timeout: float | None = None) -> p.VerifyReply:
        return self._call("verify", None, p.VerifyReply, timeout)

    def report(self, fallbacks: dict[str, int], timeout: float | None = None) -> None:
        self._call("report", p.ReportRequest(fallbacks=fallbacks), p.Empty, timeout)

    def lease(self, request: p.LeaseRequest, timeout: float | None = None) -> p.LeaseReply:
        """The lease's state; a ``hit``'s artifact is checked as :meth:`get`'s is (a daemon
        too old to state what it built: DaemonTooOld; one built for another environment:
        ArtifactMismatch)."""
        why = trust.too_old(self.capabilities(timeout), self.socket_path)
        if why is not None:
            raise DaemonTooOld(why)
        reply = self._call("lease", request, p.LeaseReply, timeout)
        if reply.artifact is not None:
            stated = (request.identity.to_wire() if request.identity is not None
                      else None if self.identity is False else self._identity_wire(request))
            found = trust.mismatches(reply.artifact, request.request, stated,
                                     reply.artifact.kind)
            if found:
                raise self._mismatch(reply.artifact, found)
        return reply

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

    def planned(self, family: str | None = None, timeout: float | None = None) -> list[dict]:
        """The weight shapes clients planned on this node ({family, n, k, arch, sm_count,
        options}), first seen first."""
        return self._call("planned", p.PlannedRequest(family=family), p.PlannedReply,
                          timeout).shapes

    def certify_record(self, record: dict, timeout: float | None = None) -> int:
        return self._call("certify_record", p.CertifyRecordRequest(record=record),
                          p.CertifyRecordReply, timeout).record_id

    def certifications(self, family: str | None = None,
                       timeout: float | None = None) -> list[dict]:
        return self._call("certifications", p.FamilyFilter(family=family),
                          p.CertificationsReply, timeout).certifications

    # -- loading ---------------------------------------------------------------------------

    def load(self, request: KernelRequest,
             timeout: float | None = None) -> Callable[..., Any]:
        """A callable TVM-FFI function for ``request``, cached in this process."""
        fn = self._loaded.get(request)
        if fn is not None:
            return fn
        try:
            artifact, passed = self._fetch(request, timeout, "interactive", ("library",))
        except (DaemonUnavailable, DeadlineExceeded, Overloaded) as exc:
            if self.fallback is False:
                raise
            artifact = self._fallback_build(request, exc)
            passed = None
        else:
            if self._fallbacks:
                self._report_fallbacks()
        try:
            fn = self._load_artifact(artifact, None if passed is None else passed["library"])
        finally:
            for fd in (passed or {}).values():
                _close(fd)
        self._loaded[request] = fn
        return fn

    def load_many(self, requests: Iterable[KernelRequest],
                  timeout: float | None = None) -> list[Callable[..., Any]]:
        """:meth:`load` of each request, in order: those not loaded yet fetched in one
        ``get_batch`` per :data:`~cached_client.protocol.MAX_GET_BATCH` where the daemon has
        the op (each artifact checked as :meth:`get`'s is: the daemon's age, its identity,
        one descriptor per blob); a request the batch answers with an error, and every
        request where the daemon has no such op, goes through :meth:`load` (its own error,
        or its in-process fallback)."""
        wanted = list(requests)
        missing = [r for r in dict.fromkeys(wanted) if r not in self._loaded]
        if len(missing) > 1 and self.supports("get_batch", timeout):
            for start in range(0, len(missing), p.MAX_GET_BATCH):
                self._load_batch(missing[start:start + p.MAX_GET_BATCH], timeout)
        return [self.load(r, timeout) for r in wanted]

    def _load_batch(self, requests: list[KernelRequest], timeout: float | None) -> None:
        """Fetch and load ``requests`` in one ``get_batch``; what fails here is left for
        :meth:`load` (the batch is an optimisation, never the only way)."""
        timeout = self.timeout if timeout is None else timeout
        try:
            transfer = self._transfer(timeout)
            if transfer == "bytes":  # not a batch transfer: load() asks for each
                return
            message = p.GetBatchRequest(requests=requests, transfer=transfer,
                                        blobs=["library"],
                                        deadline_ms=max(1, int(timeout * 1000 * 0.95) - 20))
            reply, _, fds = self._round_trip("get_batch", message, timeout)
        except CachedError:
            return
        stated = None if self.identity is False else self._identity_wire(message)
        if (len(reply.items) != len(requests) or len(fds) != len(reply.fds)
                or sum(len(item.fds) for item in reply.items) != len(fds)):
            for fd in fds:
                _close(fd)
            return
        at = 0
        for request, item in zip(requests, reply.items, strict=True):
            mine, at = fds[at:at + len(item.fds)], at + len(item.fds)
            if item.artifact is None:
                for fd in mine:
                    _close(fd)
                continue
            try:
                artifact, passed = self._checked(item.artifact, request, stated, transfer,
                                                 ("library",), item.fds, mine)
            except CachedError:  # load() asks again and raises or falls back as it does
                continue
            try:
                self._loaded[request] = self._load_artifact(
                    artifact, None if passed is None else passed["library"])
            except CachedError:
                continue
            except BaseException:
                for fd in fds[at:]:
                    _close(fd)
                raise
            finally:
                for fd in (passed or {}).values():
                    _close(fd)

    def _load_artifact(self, artifact: Artifact, fd: int | None = None) -> Callable[..., Any]:
        """Load a library this process has already checked: the daemon's uid and socket
        directory at connect (transport), the artifact's stated identity against this
        process's own in ``get``/``lease`` (trust.check: ArtifactMismatch, never a load), and
        its sha256 where it is loaded from (the daemon's store when only a daemon's uid can
        change it, else a private copy: cached_client.loader.load_library); the runtime it
        links is this process's own. The library is the descriptor ``fd`` the daemon
        passed, else its bytes, else its path. Forgeries refused: tests/test_client_trust.py
        (``test_an_artifact_built_for_another_environment_is_a_miss_never_a_load``,
        ``test_the_runtime_library_a_daemon_names_is_never_loaded``,
        ``test_a_scratch_directory_remade_by_another_uid_never_runs_its_code``)."""
        source: str | int | bytes | None = fd
        if source is None:
            source = artifact.library_bytes
        if source is None:
            source = artifact.library_path
        if source is None:
            raise BadReply("the daemon's answer named no library path and sent no bytes")
        return load_library(source, artifact.symbol, artifact.library_sha256, self._scratch)

    def _fallback_build(self, request: KernelRequest, reason: CachedError) -> Artifact:
        if isinstance(reason, ArtifactMismatch):
            pass  # get() warned, naming the fields
        elif self.socket_path not in _warned_unreachable:
            _warned_unreachable.add(self.socket_path)
            logger.warning(
                "cached daemon at %s unusable (%s); compiling in this process instead",
                self.socket_path, reason.message,
            )
        build = self.fallback if callable(self.fallback) else installed_fallback()
        if build is None:
            raise DaemonUnavailable(
                f"{reason.message}; and no in-process compiler for {request.family!r} is "
                "installed here (install the daemon's package, cached-kernel-daemon, to compile "
                "in-process, or start the daemon: make serve)"
            ) from None
        artifact = build(request, self._scratch.directory())
        self._fallbacks[request.family] = self._fallbacks.get(request.family, 0) + 1
        monitor.outside(request.family, artifact.kernel_name, "compiled")
        return artifact

    def _report_fallbacks(self) -> None:
        """Tell the daemon, once it answers again, how many kernels this process compiled
        itself meanwhile (its ``cached_client_fallbacks_total`` metric)."""
        pending, self._fallbacks = self._fallbacks, {}
        try:
            self.report(pending, timeout=2.0)
        except CachedError:
            pass  # a daemon without the op, or gone again: not worth more


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
