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
    """$CACHED_SOCKET, else cached.sock under :func:`runtime_dir` (the daemon's default)."""
    return os.environ.get(SOCKET_ENV) or os.path.join(runtime_dir(), "cached.sock")


def check_socket_dir(path: str) -> str | None:
    """Why the directory of ``path`` cannot be trusted, or None.

    A shared /tmp lets any user create ``/tmp/cached-$UID`` first and answer with a
    library of their own; such a directory must belong to this user or root and be
    writable by its owner alone. Directories named by configuration are not checked.
    """
    directory = os.path.dirname(path) or "."
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return None
    if st.st_uid not in (0, os.getuid()) or st.st_mode & 0o022 or os.path.islink(directory):
        return (f"{directory} belongs to uid {st.st_uid} (mode {oct(st.st_mode & 0o777)}), "
                f"not to uid {os.getuid()} or root; set {SOCKET_ENV} to the daemon's socket")
    return None
