"""Client side of write-back: take a lease, compile, publish (daemon: leases.py, uploads.py).

``obtain(client, request, compile_object)`` returns the stored artifact for a kernel the
daemon has no recipe for: a hit, or after waiting for the process holding the lease, or
after this process compiled it (``compile_object(path)`` writes the object) and published
it. A lease holder renews its lease from a thread while it compiles; if this process dies,
the daemon sees its pid gone and hands the lease to the next waiter.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from . import protocol as p
from .client import Client
from .errors import CachedError
from .keys import KernelRequest
from .protocol import Artifact

logger = logging.getLogger("cached_client.writeback")

CHUNK_BYTES = 512 << 10  # base64 of this stays well under the 1 MiB request frame
DEFAULT_TTL_S = 120.0
WAIT_MS = 5_000


class CompileLocally(Exception):
    """The daemon will not coordinate this kernel (this peer may not publish)."""


def lease(client: Client, request: KernelRequest, ttl_s: float = DEFAULT_TTL_S,
          wait_ms: int = WAIT_MS) -> p.LeaseReply:
    return client.lease(p.LeaseRequest(request=request, ttl_s=ttl_s, wait_ms=wait_ms),
                        timeout=wait_ms / 1000 + 10)


def publish(client: Client, request: KernelRequest, data: bytes,
            compile_seconds: float = 0.0, kernel_name: str | None = None) -> p.PublishReply:
    """Send an exported object in chunks; the last chunk commits it. ``kernel_name``: the
    compiled kernel's name, for a family the daemon names itself (mm_fp4, batch-invariant)."""
    sha = hashlib.sha256(data).hexdigest()
    offset = 0
    while True:
        chunk = data[offset:offset + CHUNK_BYTES]
        final = offset + len(chunk) >= len(data)
        reply = client.publish(p.PublishRequest(
            request=request, object_sha256=sha, offset=offset, final=final,
            data=base64.b64encode(chunk).decode(), compile_seconds=compile_seconds,
            kernel_name=kernel_name), timeout=120)
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


def _renewer(client: Client, request: KernelRequest, token: str, ttl_s: float,
             stop: threading.Event) -> None:
    while not stop.wait(max(0.5, ttl_s / 3)):
        try:
            client.lease_renew(p.LeaseRenewRequest(request=request, lease=token, ttl_s=ttl_s),
                               timeout=10)
        except CachedError:
            return


def obtain(client: Client, request: KernelRequest, compile_object: Callable[[str], Any],
           ttl_s: float = DEFAULT_TTL_S, timeout: float = 3600.0,
           kernel_name: str | None = None) -> tuple[Artifact, Any]:
    """The artifact for ``request`` and what ``compile_object`` returned (None unless this
    process compiled it). Raises CompileLocally when this peer may not publish."""
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
                                        kernel_name)
        if time.monotonic() >= deadline:
            raise TimeoutError(f"waited {timeout:.0f}s for another process to publish "
                               f"{request.params.get('kernel')}")


def _compile_and_publish(client: Client, request: KernelRequest, token: str, ttl_s: float,
                         compile_object: Callable[[str], Any],
                         kernel_name: str | None = None) -> tuple[Artifact, Any]:
    """Compile under the lease and publish; any failure releases the lease at once, so
    the other processes waiting on it need not sit out its time-to-live."""
    stop = threading.Event()
    renewer = threading.Thread(target=_renewer, args=(client, request, token, ttl_s, stop),
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
            publish(client, request, data, seconds, kernel_name)
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
    reply = lease(client, request, ttl_s, 0)
    if reply.state != "hit" or reply.artifact is None:
        raise CachedError(f"published {request.params.get('kernel')} but the daemon does not "
                          f"serve it ({reply.state})")
    return reply.artifact, result
