"""The client an inference process holds: ask the daemon for kernels, load them.

Flow: request -> (in-process cache) -> transport -> daemon -> verified path -> loader.
Invariants: every call has a deadline; a loaded function is cached per request, so the
hot path of :meth:`Client.load` is one dict lookup; when the daemon cannot be reached
the client says so once per socket and compiles in-process if the family's recipe is
importable here, else raises DaemonUnavailable.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .errors import CachedError, DaemonUnavailable, DeadlineExceeded, error_from_wire
from .keys import KernelRequest
from .loader import load_bytes, load_library
from .paths import SOCKET_ENV, check_socket_dir, default_socket_path
from .protocol import PROTOCOL_VERSION
from .transport import Connection

logger = logging.getLogger("cached_client")

DEFAULT_TIMEOUT_S = 60.0
_warned_unreachable: set[str] = set()


@dataclass(frozen=True)
class Artifact:
    """A built kernel as the daemon describes it; paths are read-only verified blobs."""

    key: str
    family: str
    kernel_name: str
    symbol: str
    library_sha256: str
    object_sha256: str
    toolchain: str
    runtime_library: dict
    origin: str
    compile_seconds: float
    library_path: str | None = None
    object_path: str | None = None
    library_bytes: bytes | None = field(default=None, repr=False)
    meta: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_wire(cls, obj: dict, payload: bytes | None = None) -> Artifact:
        return cls(
            key=obj["key"],
            family=obj["family"],
            kernel_name=obj["kernel_name"],
            symbol=obj["symbol"],
            library_sha256=obj["library_sha256"],
            object_sha256=obj["object_sha256"],
            toolchain=obj["toolchain"],
            runtime_library=obj["runtime_library"],
            origin=obj.get("origin", "cache"),
            compile_seconds=float(obj.get("compile_seconds", 0.0)),
            library_path=obj.get("library_path"),
            object_path=obj.get("object_path"),
            library_bytes=payload,
            meta=obj,
        )


class Client:
    """A connection to one daemon socket; safe to share between threads."""

    def __init__(
        self,
        socket_path: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        transfer: str = "path",
        fallback: bool = True,
    ) -> None:
        if transfer not in ("path", "bytes"):
            raise ValueError("transfer must be 'path' or 'bytes'")
        self.socket_path = socket_path or default_socket_path()
        self._untrusted = None
        if socket_path is None and not os.environ.get(SOCKET_ENV):
            self._untrusted = check_socket_dir(self.socket_path)
        self.timeout = timeout
        self.transfer = transfer
        self.fallback = fallback
        self._conn: Connection | None = None
        self._lock = threading.Lock()
        self._next_id = 0
        self._loaded: dict[KernelRequest, Any] = {}
        self._fallbacks: dict[str, int] = {}  # in-process compiles not yet reported
        self._scratch = os.path.join(tempfile.gettempdir(), f"cached-client-{os.getuid()}")

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def call(self, message: dict, timeout: float | None = None) -> tuple[dict, bytes | None]:
        """One round trip on the shared connection; raises the typed error of an error reply."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._lock:
            self._next_id += 1
            message = {"v": PROTOCOL_VERSION, "id": self._next_id, **message}
            if self._conn is None:
                if self._untrusted:
                    raise DaemonUnavailable(f"not connecting: {self._untrusted}")
                self._conn = Connection(self.socket_path, deadline)
            conn = self._conn
            try:
                reply, payload = conn.request(message, deadline)
            except CachedError:
                self._conn = None
                conn.close()
                raise
        if not reply.get("ok"):
            raise error_from_wire(reply.get("error") or {})
        return reply, payload

    def hello(self, timeout: float | None = None) -> dict:
        reply, _ = self.call({"op": "hello"}, timeout)
        return reply

    def stats(self, timeout: float | None = None) -> dict:
        reply, _ = self.call({"op": "stats"}, timeout)
        return reply["stats"]

    def list(self, timeout: float | None = None) -> list[dict]:
        reply, _ = self.call({"op": "list"}, timeout)
        return reply["entries"]

    def plan(
        self, family: str, shape: tuple[int, int, int], arch: str, sm_count: int | None = None,
        options: dict | None = None, timeout: float | None = None,
    ) -> list[KernelRequest]:
        """The family's tactic space for ``shape`` on a target, in its stable order."""
        message = {"op": "plan", "family": family, "shape": list(shape), "arch": arch,
                   "options": options or {}}
        if sm_count is not None:
            message["sm_count"] = sm_count
        reply, _ = self.call(message, timeout)
        return [KernelRequest.from_wire(r) for r in reply["requests"]]

    def prefetch(self, requests: Iterable[KernelRequest], timeout: float | None = None) -> dict:
        """Queue compilations behind waiting clients; answers at once."""
        reply, _ = self.call(
            {"op": "prefetch", "requests": [r.to_wire() for r in requests]}, timeout
        )
        return reply

    def get(
        self, request: KernelRequest, timeout: float | None = None, priority: str = "interactive"
    ) -> Artifact:
        """The artifact for ``request``, compiled by the daemon if it has none yet.

        The daemon is given a slightly shorter deadline than the socket, so that a
        kernel still compiling comes back as its typed DeadlineExceeded answer.
        """
        timeout = self.timeout if timeout is None else timeout
        message = {
            "op": "get",
            "request": request.to_wire(),
            "deadline_ms": max(1, int(timeout * 1000 * 0.95) - 20),
            "transfer": self.transfer,
            "priority": priority,
        }
        reply, payload = self.call(message, timeout)
        return Artifact.from_wire(reply["artifact"], payload)

    def load(self, request: KernelRequest, timeout: float | None = None) -> Any:
        """A callable TVM-FFI function for ``request``, cached in this process."""
        fn = self._loaded.get(request)
        if fn is not None:
            return fn
        try:
            artifact = self.get(request, timeout)
        except (DaemonUnavailable, DeadlineExceeded) as exc:
            if not self.fallback:
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
            raise DaemonUnavailable("the daemon's answer named no library path and sent no bytes")
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
        try:
            from cached.build import build_in_process
        except ImportError:
            raise DaemonUnavailable(
                f"{reason.message}; and the compiler recipe for {request.family!r} is not "
                "importable here (install the 'cached' package to compile in-process, or "
                "start the daemon: make serve)"
            ) from None
        artifact = build_in_process(request, self._scratch)
        self._fallbacks[request.family] = self._fallbacks.get(request.family, 0) + 1
        return artifact

    def _report_fallbacks(self) -> None:
        """Tell the daemon, once it answers again, how many kernels this process compiled
        itself meanwhile (its ``cached_client_fallbacks_total`` metric)."""
        pending, self._fallbacks = self._fallbacks, {}
        try:
            self.call({"op": "report", "fallbacks": pending}, timeout=2.0)
        except CachedError:
            pass  # a daemon without the op, or gone again: not worth more
