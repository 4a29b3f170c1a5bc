"""The daemon a vLLM process uses (shared by the plugin, its hooks and the kernel class;
imports nothing heavy).

:func:`daemon` is made once per process: at ``$CACHED_SOCKET`` (whether or not a daemon
listens there yet), else at the first default socket that answers now, or exists
(cached_client.paths.find_socket: the per-user one, then the system one), it starts that
socket's prober (cached_client.liveness) and waits at most ``START_WAIT_S`` for its first
answer, so a stopped or hung daemon costs a starting process that long, not a probe's
timeout; the prober goes on asking in the background, and ``hello`` is whatever it last
heard (None while the daemon does not answer).
"""

from __future__ import annotations

import hashlib
import os
import threading
from typing import TYPE_CHECKING

from cached_client import paths

if TYPE_CHECKING:
    from cached_client.client import Client
    from cached_client.liveness import Liveness
    from cached_client.protocol import HelloReply

DEVICE_NAME_ENV = "CACHED_DEVICE_NAME"
ARCH_OF_CAPABILITY = {90: "sm_90a", 100: "sm_100a", 103: "sm_103a", 107: "sm_107a"}
"""The arch a kernel is compiled for, by vLLM's device capability (major * 10 + minor)."""

START_WAIT_S = 0.25
"""How long a starting process waits for the daemon's first answer (a live one answers in
about a millisecond)."""
CLIENT_TIMEOUT_S = 600.0


class Daemon:
    """The daemon this process uses: ``socket`` None when ``$CACHED_SOCKET`` is unset and
    no default socket exists;
    ``hello`` the daemon's last answer, None while it does not answer (``reason`` says why);
    ``client`` the hooks' client (None without a socket)."""

    def __init__(self, socket: str | None, live: Liveness | None, client: Client | None,
                 reason: str = "") -> None:
        self.socket = socket
        self.live = live
        self.client = client
        self._reason = reason

    @property
    def hello(self) -> HelloReply | None:
        return self.live.hello if self.live is not None else None

    @property
    def reason(self) -> str:
        if self.live is None:
            return self._reason
        if self.live.probes == 0:
            return f"no answer from the daemon at {self.socket} within {START_WAIT_S}s"
        return f"no live daemon at {self.socket}: {self.live.reason}"

    def toolchain(self) -> str:
        if self.hello is None:
            return "-"
        tc = hashlib.sha256(self.hello.toolchain.encode()).hexdigest()[:12]
        dsl = self.hello.versions.get("nvidia-cutlass-dsl", "?")
        return f"{tc} (CuTe DSL {dsl})"


_daemon: Daemon | None = None
_lock = threading.Lock()


def daemon() -> Daemon:
    """The daemon at ``$CACHED_SOCKET`` or the default socket for this process (made on
    first call)."""
    global _daemon
    with _lock:
        if _daemon is None:
            _daemon = _make()
        return _daemon


def _make() -> Daemon:
    path = os.environ.get(paths.SOCKET_ENV) or paths.find_socket(connect=True)
    if not path:
        return Daemon(None, None, None, f"{paths.SOCKET_ENV} is not set and no daemon socket "
                      f"exists at {' or '.join(paths.socket_candidates())}")
    from cached_client import liveness
    from cached_client.client import Client

    live = liveness.watch(path)
    live.wait(START_WAIT_S)
    return Daemon(path, live, Client(path, timeout=CLIENT_TIMEOUT_S, fallback=False))


def capability() -> int | None:
    """This device's capability as vLLM reports it (major * 10 + minor), or None."""
    from vllm.platforms import current_platform

    cap = current_platform.get_device_capability()
    return None if cap is None else cap.to_int()


def device_name() -> str | None:
    """This device's name as ``cached certify`` records it (``$CACHED_DEVICE_NAME`` first, for
    processes that cannot query it), or None."""
    name = os.environ.get(DEVICE_NAME_ENV)
    if name:
        return name
    try:
        from vllm.platforms import current_platform

        return current_platform.get_device_name()
    except Exception:  # noqa: BLE001 -- no device to ask (CPU tests, build nodes)
        return None
