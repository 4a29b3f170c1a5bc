"""Default locations shared by the daemon and its clients, and whom a client trusts.

A client trusts a daemon process running as root, as its own uid (which can already do
anything to it), or as the configured daemon uid ($CACHED_DAEMON_UID; unset: the system user
``cached`` that deploy/ and the image create, when this machine has one: only root makes
users); every connect checks
the server's uid (SO_PEERCRED) against them, and a default socket's directory too
(cached_client.transport). With no path and no $CACHED_SOCKET a client tries the per-user
socket, then the system one (:func:`socket_candidates`).
"""

from __future__ import annotations

import functools
import os
import pwd
import socket
import stat
import tempfile

SOCKET_ENV = "CACHED_SOCKET"
DAEMON_UID_ENV = "CACHED_DAEMON_UID"
DAEMON_USER = "cached"
"""The daemon's system user as deploy/cached.sysusers.conf and the Dockerfile name it."""
SYSTEM_SOCKET = "/run/cached/cached.sock"
"""The socket deploy/cached.socket (systemd) and the image listen on."""


def runtime_dir() -> str:
    """$XDG_RUNTIME_DIR/cached, else /tmp/cached-$UID (created by the daemon, mode 0700)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base:
        return os.path.join(base, "cached")
    return os.path.join("/tmp", f"cached-{os.getuid()}")


def scratch_dir() -> str:
    """The client's private scratch directory: $TMPDIR/cached-client-$UID (made 0700 by
    the client on first use: private copies of served blobs, the identity cache)."""
    return os.path.join(tempfile.gettempdir(), f"cached-client-{os.getuid()}")


def user_socket_path() -> str:
    """cached.sock under :func:`runtime_dir`: where ``cached serve`` listens by default."""
    return os.path.join(runtime_dir(), "cached.sock")


def socket_candidates() -> tuple[str, ...]:
    """The sockets a client with no path tries, in order: $CACHED_SOCKET alone when set;
    else the per-user one (:func:`user_socket_path`), then :data:`SYSTEM_SOCKET`."""
    named = os.environ.get(SOCKET_ENV)
    if named:
        return (named,)
    return (user_socket_path(), SYSTEM_SOCKET)


def is_default_socket(path: str) -> bool:
    """Whether ``path`` is one of the default sockets (not named by $CACHED_SOCKET): a
    client checks such a socket's directory at every connect (cached_client.transport)."""
    return not os.environ.get(SOCKET_ENV) and path in socket_candidates()


def find_socket(connect: bool = False) -> str | None:
    """The first of :func:`socket_candidates` that is a socket file now, or None; with
    ``connect``, the first that accepts a connection before the first that merely exists
    (a daemon that stopped may leave its socket file behind). Whom it reached is not
    checked here: every client connect checks that (cached_client.transport)."""
    sockets = []
    for path in socket_candidates():
        try:
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                sockets.append(path)
        except OSError:
            continue
    if connect:
        for path in sockets:
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            try:
                probe.settimeout(0.5)
                probe.connect(path)
                return path
            except (BlockingIOError, TimeoutError):
                return path  # a full backlog: something listens there
            except OSError:
                continue
            finally:
                probe.close()
    return sockets[0] if sockets else None


def default_socket_path() -> str:
    """The socket a client with no path would use now: :func:`find_socket`, else the first
    candidate (nothing runs yet)."""
    return find_socket() or socket_candidates()[0]


def daemon_socket_path() -> str:
    """Where the daemon listens by default: $CACHED_SOCKET, else :func:`user_socket_path`
    (the system socket is systemd's, passed to the daemon by cached.socket)."""
    return os.environ.get(SOCKET_ENV) or user_socket_path()


def trusted_uids() -> frozenset[int]:
    """The uids a daemon may run as: root, this process's uid and $CACHED_DAEMON_UID (a
    number or a user name; unset: the user ``cached`` if it exists). ValueError names a
    value that is neither."""
    return _trusted(os.environ.get(DAEMON_UID_ENV, "").strip(), os.getuid())


@functools.lru_cache(maxsize=8)
def _trusted(configured: str, own: int) -> frozenset[int]:
    uids = {0, own}
    if not configured:
        try:
            uids.add(pwd.getpwnam(DAEMON_USER).pw_uid)
        except KeyError:
            pass
    else:
        if configured.isdigit():
            uids.add(int(configured))
        else:
            try:
                uids.add(pwd.getpwnam(configured).pw_uid)
            except KeyError:
                raise ValueError(f"{DAEMON_UID_ENV}={configured!r} is neither a uid nor a "
                                 "user name known here; set it to the daemon's uid") from None
    return frozenset(uids)


def check_dir_stat(st: os.stat_result, directory: str, uids: frozenset[int]) -> str | None:
    """Why a socket directory with status ``st`` (lstat or fstat) cannot be trusted, or None:
    it must be a real directory (no link) owned by one of ``uids`` and writable by its owner
    alone, else another user could put a socket of their own there."""
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return (f"{directory} is not a directory (a link?); set {SOCKET_ENV} to the "
                "daemon's socket")
    if st.st_uid not in uids or st.st_mode & 0o022:
        owners = " or ".join(["root", *(f"uid {u}" for u in sorted(uids - {0}))])
        return (f"{directory} belongs to uid {st.st_uid} (mode {oct(st.st_mode & 0o777)}); "
                f"a socket directory must belong to {owners} and be writable by its owner "
                f"alone: remove it, or set {SOCKET_ENV} (and {DAEMON_UID_ENV} to the daemon's "
                "uid) to the daemon's socket")
    return None


def check_socket_dir(path: str) -> str | None:
    """Why the directory of ``path`` cannot be trusted now, or None (also when it does not
    exist: the daemon then creates it). For the daemon's start; a client checks the
    directory it connects through (cached_client.transport)."""
    directory = os.path.dirname(path) or "."
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return None
    return check_dir_stat(st, directory, frozenset({0, os.getuid()}))
