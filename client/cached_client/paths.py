"""Default locations shared by the daemon and its clients."""

from __future__ import annotations

import os

SOCKET_ENV = "CACHED_SOCKET"


def runtime_dir() -> str:
    """$XDG_RUNTIME_DIR/cached, else /tmp/cached-$UID (created by the daemon, mode 0700)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base:
        return os.path.join(base, "cached")
    return os.path.join("/tmp", f"cached-{os.getuid()}")


def default_socket_path() -> str:
    """$CACHED_SOCKET, else cached.sock under :func:`runtime_dir`."""
    return os.environ.get(SOCKET_ENV) or os.path.join(runtime_dir(), "cached.sock")
