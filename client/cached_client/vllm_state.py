"""The daemon a vLLM process uses, asked once per process (shared by the plugin and the
kernel class; imports nothing heavy)."""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass
from typing import Any

from .paths import SOCKET_ENV

PROBE_TIMEOUT_S = 2.0
CLIENT_TIMEOUT_S = 600.0


@dataclass
class Daemon:
    """The daemon this process uses: ``hello`` None when there is none (``reason`` says why)."""

    socket: str | None
    hello: Any
    reason: str
    client: Any

    def toolchain(self) -> str:
        if self.hello is None:
            return "-"
        tc = hashlib.sha256(self.hello.toolchain.encode()).hexdigest()[:12]
        dsl = self.hello.versions.get("nvidia-cutlass-dsl", "?")
        return f"{tc} (CuTe DSL {dsl})"


_daemon: Daemon | None = None
_lock = threading.Lock()


def daemon() -> Daemon:
    """The daemon at ``$CACHED_SOCKET``, asked once per process."""
    global _daemon
    with _lock:
        if _daemon is None:
            _daemon = _probe()
        return _daemon


def _probe() -> Daemon:
    path = os.environ.get(SOCKET_ENV)
    if not path:
        return Daemon(None, None, f"{SOCKET_ENV} is not set", None)
    from .client import Client
    from .errors import CachedError

    client = Client(path, timeout=CLIENT_TIMEOUT_S, fallback=False)
    try:
        hello = client.hello(timeout=PROBE_TIMEOUT_S)
    except CachedError as exc:
        client.close()
        return Daemon(path, None, f"no live daemon at {path}: {exc.message}", None)
    return Daemon(path, hello, "", client)
