"""Client side of write-back: take a lease, compile, publish (daemon: leases.py, uploads.py).

``obtain(client, request, compile_object)`` returns the stored artifact for a kernel the
daemon has no recipe for: a hit, or after waiting for the process holding the lease, or
after this process compiled it (``compile_object(path)`` writes the object) and published
it. A lease holder renews its lease from a thread while its compile makes progress: only
when this process or its children used CPU since the last renewal, and never for more
than ``max_hold_s`` (MAX_HOLD_S); so a compile that is stuck (waiting on nothing, or
spinning for ever) loses the lease within its time-to-live of stopping (or of the hard
maximum), and the next waiter gets it. If this process dies, the daemon sees its pid gone
and hands the lease on at once. A waiter waits at most ``timeout`` seconds (WAIT_S) for
others, then gives up: :class:`WaitedTooLong` (a CompileLocally), and the caller
compiles in its own process. Every publish chunk carries the lease's token: the daemon
stores only what the process holding the lease sends, and serves it only to the
publisher's trust group (docs/reliability.md).

Bundles (the JIT libraries' own files: cached/families/jit.py): :func:`acquire` answers
a hit or a :class:`HeldLease` for a compile that happens elsewhere in this process (a
Triton compile runs between its cache's ``get`` and ``put``, and publishes through the
lease); :func:`read_bundle` reads a hit's files and checks each against its digest and size
(a file that does not match is never returned).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import resource
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from . import protocol as p
from .client import Client
from .errors import CachedError, IntegrityError
from .keys import KernelRequest
from .protocol import Artifact

logger = logging.getLogger("cached_client.writeback")

CHUNK_BYTES = 512 << 10  # base64 of this stays well under the 1 MiB request frame
DEFAULT_TTL_S = 120.0
WAIT_MS = 5_000
MAX_HOLD_S = 1800.0
"""The most seconds a holder renews its lease, progressing or not."""
WAIT_S = 1800.0
"""The most seconds a process waits for other processes' leases before compiling itself."""
MIN_PROGRESS = 0.01
"""CPU seconds per second of a renewal interval that count as progress (1%)."""


class CompileLocally(Exception):
    """The daemon will not coordinate this kernel (this peer may not publish), or others
    took too long: compile it in this process."""


class WaitedTooLong(CompileLocally, TimeoutError):
    """Other processes held the kernel's lease for longer than this one would wait."""


def lease(client: Client, request: KernelRequest, ttl_s: float = DEFAULT_TTL_S,
          wait_ms: int = WAIT_MS) -> p.LeaseReply:
    return client.lease(p.LeaseRequest(request=request, ttl_s=ttl_s, wait_ms=wait_ms),
                        timeout=wait_ms / 1000 + 10)


def publish(client: Client, request: KernelRequest, data: bytes,
            compile_seconds: float = 0.0, kernel_name: str | None = None,
            lease: str = "") -> p.PublishReply:
    """Send an exported object in chunks; the last chunk commits it. ``kernel_name``: the
    compiled kernel's name, for a family the daemon names itself (mm_fp4, batch-invariant);
    ``lease``: the token of the lease this process holds on ``request`` (the daemon stores
    nothing without it: NotAllowed)."""
    sha = hashlib.sha256(data).hexdigest()
    offset = 0
    while True:
        chunk = data[offset:offset + CHUNK_BYTES]
        final = offset + len(chunk) >= len(data)
        reply = client.publish(p.PublishRequest(
            request=request, object_sha256=sha, offset=offset, final=final,
            data=base64.b64encode(chunk).decode(), compile_seconds=compile_seconds,
            kernel_name=kernel_name, lease=lease), timeout=120)
        offset += len(chunk)
        if final or reply.state in ("exists", "stored"):
            return reply


def release(client: Client, request: KernelRequest, token: str, reason: str) -> None:
    """Give a lease back so the next waiter gets it at once (best effort)."""
    try:
        client.lease_release(p.LeaseReleaseRequest(request=request, lease=token,
                                                   reason=reason[:200]), timeout=10)
    except CachedError:
        pass


def cpu_seconds() -> float:
    """CPU seconds used so far by this process (all its threads) and by its descendants,
    running (read from /proc, where there is one) or reaped."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (time.process_time() + children.ru_utime + children.ru_stime
            + _descendants_cpu_s(os.getpid()))


def _descendants_cpu_s(pid: int, depth: int = 0) -> float:
    """CPU seconds of ``pid``'s running descendants and of the children they reaped."""
    total = 0.0
    for child in _children(pid):
        try:
            with open(f"/proc/{child}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()
        except OSError:  # gone meanwhile
            continue
        total += sum(int(x) for x in fields[11:15]) / _CLOCK_TICKS  # utime..cstime
        if depth < 16:
            total += _descendants_cpu_s(child, depth + 1)
    return total


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children", "rb") as f:
                out.extend(int(x) for x in f.read().split())
        except (OSError, ValueError):
            continue
    return out


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _renewer(client: Client, request: KernelRequest, token: str, ttl_s: float,
             stop: threading.Event, max_hold_s: float = MAX_HOLD_S) -> None:
    """Renew every ttl/3 while the process made progress (CPU used by anything but this
    thread: MIN_PROGRESS of the interval), for at most ``max_hold_s``; a renewal refused
    (the lease expired and went to another) ends it."""
    interval = max(0.5, ttl_s / 3)
    started = time.monotonic()
    used = cpu_seconds() - time.thread_time()
    while not stop.wait(interval):
        now_used = cpu_seconds() - time.thread_time()
        progressed, used = now_used - used >= interval * MIN_PROGRESS, now_used
        if time.monotonic() - started >= max_hold_s:
            logger.warning("cached: held the lease on %s for %.0fs, the most a compile may "
                           "hold one; not renewing it (the next waiter takes over)",
                           request.family, max_hold_s)
            return
        if not progressed:
            logger.debug("cached: no CPU used for %.1fs; lease on %s not renewed",
                         interval, request.family)
            continue
        try:
            client.lease_renew(p.LeaseRenewRequest(request=request, lease=token, ttl_s=ttl_s),
                               timeout=10)
        except CachedError:
            return


def obtain(client: Client, request: KernelRequest, compile_object: Callable[[str], Any],
           ttl_s: float = DEFAULT_TTL_S, timeout: float = WAIT_S,
           kernel_name: str | None = None,
           max_hold_s: float = MAX_HOLD_S) -> tuple[Artifact, Any]:
    """The artifact for ``request`` and what ``compile_object`` returned (None unless this
    process compiled it). Raises CompileLocally when this peer may not publish, and
    WaitedTooLong after ``timeout`` seconds of waiting on other processes' leases."""
    deadline = time.monotonic() + timeout
    while True:
        wait_ms = int(max(0, min(WAIT_MS, (deadline - time.monotonic()) * 1000)))
        reply = lease(client, request, ttl_s, wait_ms)
        if reply.state == "hit" and reply.artifact is not None:
            return reply.artifact, None
        if reply.state == "compile_locally":
            raise CompileLocally(reply.reason or "")
        if reply.state == "granted" and reply.lease:
            return _compile_and_publish(client, request, reply.lease, ttl_s, compile_object,
                                        kernel_name, max_hold_s)
        if time.monotonic() >= deadline:
            raise WaitedTooLong(f"waited {timeout:.0f}s for another process (pid "
                                f"{reply.holder_pid}) to publish "
                                f"{request.params.get('kernel')}; compiling it here")


def _compile_and_publish(client: Client, request: KernelRequest, token: str, ttl_s: float,
                         compile_object: Callable[[str], Any],
                         kernel_name: str | None = None,
                         max_hold_s: float = MAX_HOLD_S) -> tuple[Artifact, Any]:
    """Compile under the lease and publish; any failure releases the lease at once, so
    the other processes waiting on it need not sit out its time-to-live."""
    stop = threading.Event()
    renewer = threading.Thread(target=_renewer,
                               args=(client, request, token, ttl_s, stop, max_hold_s),
                               name="cached-lease-renew", daemon=True)
    renewer.start()
    tmpdir = tempfile.mkdtemp(prefix="cached-wb-")
    path = os.path.join(tmpdir, "kernel.o")
    try:
        started = time.perf_counter()
        try:
            result = compile_object(path)
            seconds = time.perf_counter() - started
            with open(path, "rb") as f:
                data = f.read()
            published = publish(client, request, data, seconds, kernel_name, token)
        except BaseException as exc:
            stop.set()
            release(client, request, token, f"{type(exc).__name__}: {exc}")
            raise
    finally:
        stop.set()
        try:
            os.unlink(path)
        except OSError:
            pass
        os.rmdir(tmpdir) if not os.listdir(tmpdir) else None
    if published.artifact is not None:
        return published.artifact, result
    reply = lease(client, request, ttl_s, 0)  # a daemon whose publish names no artifact
    if reply.state != "hit" or reply.artifact is None:
        raise CachedError(f"published {request.params.get('kernel')} but the daemon does not "
                          f"serve it ({reply.state})")
    return reply.artifact, result


# -- bundles ----------------------------------------------------------------------------


class HeldLease:
    """A lease this process holds on ``request``: renewed from a thread until it is
    published (:meth:`publish_bundle`) or released (:meth:`release`); idempotent."""

    def __init__(self, client: Client, request: KernelRequest, token: str,
                 ttl_s: float = DEFAULT_TTL_S, max_hold_s: float = MAX_HOLD_S) -> None:
        self.client = client
        self.request = request
        self.token = token
        self.started = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_renewer, args=(client, request, token, ttl_s, self._stop, max_hold_s),
            name="cached-lease-renew", daemon=True)
        self._thread.start()

    @property
    def open(self) -> bool:
        return not self._stop.is_set()

    def publish_bundle(self, files: dict[str, bytes],
                       compile_seconds: float | None = None) -> Artifact:
        """Publish ``files`` (name -> bytes) as the bundle of the lease's key, which ends
        the lease; the stored artifact. Any failure releases the lease, then raises."""
        seconds = (time.perf_counter() - self.started if compile_seconds is None
                   else compile_seconds)
        try:
            artifact = publish_bundle(self.client, self.request, files, seconds, self.token)
        except BaseException as exc:
            self.release(f"{type(exc).__name__}: {exc}")
            raise
        self._stop.set()
        return artifact

    def release(self, reason: str) -> None:
        """Give the lease back (the next waiter gets it at once); a no-op once ended."""
        if self._stop.is_set():
            return
        self._stop.set()
        release(self.client, self.request, self.token, reason)


def acquire(client: Client, request: KernelRequest, ttl_s: float = DEFAULT_TTL_S,
            timeout: float = WAIT_S, max_hold_s: float = MAX_HOLD_S) -> Artifact | HeldLease:
    """A hit (the artifact), after waiting on another process's lease if one holds it; or
    the lease, when this process is to compile (renewed as :func:`obtain`'s is).
    CompileLocally when this peer may not publish; WaitedTooLong (a CompileLocally and a
    TimeoutError) after ``timeout`` seconds of waiting."""
    deadline = time.monotonic() + timeout
    while True:
        wait_ms = int(max(0, min(WAIT_MS, (deadline - time.monotonic()) * 1000)))
        reply = lease(client, request, ttl_s, wait_ms)
        if reply.state == "hit" and reply.artifact is not None:
            return reply.artifact
        if reply.state == "compile_locally":
            raise CompileLocally(reply.reason or "")
        if reply.state == "granted" and reply.lease:
            return HeldLease(client, request, reply.lease, ttl_s, max_hold_s)
        if time.monotonic() >= deadline:
            raise WaitedTooLong(f"waited {timeout:.0f}s for another process (pid "
                                f"{reply.holder_pid}) to publish {request.family} "
                                f"{request.params}"[:400])


def publish_bundle(client: Client, request: KernelRequest, files: dict[str, bytes],
                   compile_seconds: float = 0.0, lease: str = "") -> Artifact:
    """Upload ``files`` in chunks, file by file; the daemon stores the bundle when the last
    chunk of the last file has arrived and every file matched the manifest. ``lease``: the
    token of the lease this process holds on ``request``."""
    manifest = {name: {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
                for name, data in files.items()}
    reply = None
    for name in sorted(files):
        data, offset = files[name], 0
        while True:
            chunk = data[offset:offset + CHUNK_BYTES]
            final = offset + len(chunk) >= len(data)
            reply = client.publish_bundle(p.PublishBundleRequest(
                request=request, files=manifest, file=name, offset=offset, final=final,
                data=base64.b64encode(chunk).decode(), compile_seconds=compile_seconds,
                lease=lease), timeout=120)
            offset += len(chunk)
            if reply.state == "exists" and reply.artifact is not None:
                return reply.artifact
            if final:
                break
    if reply is None or reply.state != "stored" or reply.artifact is None:
        raise CachedError(f"published a {request.family} bundle but the daemon did not store "
                          f"it ({reply.state if reply else 'nothing sent'})")
    return reply.artifact


def read_bundle(artifact: Artifact) -> dict[str, bytes]:
    """The files of a bundle artifact, read from the paths the daemon named, each checked
    against its digest and size; IntegrityError for one that does not match or cannot be
    read (nothing is returned then)."""
    if artifact.kind != "bundle":
        raise IntegrityError(f"{artifact.family} artifact {artifact.key[:12]} is not a bundle")
    out = {}
    for f in artifact.files:
        name, path = f.get("name"), f.get("path")
        if not isinstance(name, str) or not p.BUNDLE_NAME.match(name) or not path:
            raise IntegrityError(f"the daemon's bundle {artifact.key[:12]} names a file "
                                 f"{str(name)[:60]!r} without a usable name or path")
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except OSError as exc:
            raise IntegrityError(f"bundle file {name} of {artifact.key[:12]} cannot be read: "
                                 f"{exc.strerror}") from None
        if len(data) != f.get("size") or hashlib.sha256(data).hexdigest() != f.get("sha256"):
            raise IntegrityError(f"bundle file {name} of {artifact.key[:12]} does not match its "
                                 "digest; not using it")
        out[name] = data
    return out

