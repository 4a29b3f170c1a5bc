"""Who is asking and what an op's handler gives back: the connecting process
(:class:`Peer`, from SO_PEERCRED), the rights it has (:class:`Access`), the per-peer limits
(:class:`Limits`), what goes with a reply (:class:`Attachment`), and the ops this daemon
serves (:func:`served_ops`).

Invariant: one :class:`Access` is shared by every component that checks a peer, so a
SIGHUP's change of it applies to all of them at once.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import struct
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cached_client import protocol as p

from cached.toolchain import trust

if TYPE_CHECKING:
    from .config import Settings

WITHHOLD_OPS_ENV = "CACHED_TEST_WITHHOLD_OPS"
"""Tests only (honoured with ``CACHED_TEST_FAMILIES=1``): ops, comma-separated, this daemon
acts as if it predated: not in ``hello``'s list, refused as an unknown op."""


@functools.cache
def served_ops() -> dict[str, p.Op]:
    """The ops this daemon serves: :data:`cached_client.protocol.OPS`, less those a test
    withholds (:data:`WITHHOLD_OPS_ENV`)."""
    withheld: set[str] = set()
    if os.environ.get("CACHED_TEST_FAMILIES") == "1":
        withheld = set(filter(None, os.environ.get(WITHHOLD_OPS_ENV, "").split(",")))
    return {name: op for name, op in p.OPS.items() if name not in withheld}


@dataclass(frozen=True)
class Peer:
    """The connecting process, from SO_PEERCRED."""

    pid: int
    uid: int
    gid: int


@dataclass(frozen=True)
class Limits:
    """Per-peer limits an operator may change (cached/config.py: max_connections,
    max_connections_per_uid, idle_timeout; SIGHUP applies them to new connections)."""

    max_connections: int = 1024
    max_connections_per_uid: int = 128
    idle_timeout: float = 600.0

    @classmethod
    def from_settings(cls, settings: Settings) -> Limits:
        return cls(settings.max_connections, settings.max_connections_per_uid,
                   settings.idle_timeout)


class Access:
    """Who may connect, who may publish, and whose written-back objects each peer is served.
    Empty ``allow_*`` sets admit every peer the socket's file mode admits; an empty
    ``publish_uids`` means root and the daemon's own uid. ``trust_groups``: sets of uids
    whose written-back objects are served to each other (cached/toolchain/trust.py; a uid in none is
    a group alone); ``writeback``: False refuses lease and publish. One instance is shared
    by every component that checks a peer; :meth:`update` changes it in place (SIGHUP)."""

    def __init__(self, allow_uids: Iterable[int] = (), allow_gids: Iterable[int] = (),
                 publish_uids: Iterable[int] = (), publish_gids: Iterable[int] = (),
                 trust_groups: Iterable[Iterable[int]] = (), writeback: bool = True) -> None:
        self.update(allow_uids, allow_gids, publish_uids, publish_gids, trust_groups,
                    writeback)

    @classmethod
    def from_settings(cls, settings: Settings) -> Access:
        return cls(settings.allow_uid, settings.allow_gid, settings.publish_uid,
                   settings.publish_gid, settings.trust_group, settings.writeback)

    def update(self, allow_uids: Iterable[int] = (), allow_gids: Iterable[int] = (),
               publish_uids: Iterable[int] = (), publish_gids: Iterable[int] = (),
               trust_groups: Iterable[Iterable[int]] = (), writeback: bool = True) -> None:
        self.allow_uids = frozenset(allow_uids)
        self.allow_gids = frozenset(allow_gids)
        self.publish_uids = frozenset(publish_uids) or frozenset({0, os.getuid()})
        self.publish_gids = frozenset(publish_gids)
        self.writeback = writeback
        self._trusted = frozenset({0, os.getuid()})
        self._groups = {uid: trust.group_name(group) for group in map(tuple, trust_groups)
                        for uid in group}

    def may_connect(self, peer: Peer) -> bool:
        if not self.allow_uids and not self.allow_gids:
            return True
        return peer.uid in self.allow_uids or peer.gid in self.allow_gids

    def may_publish(self, peer: Peer) -> bool:
        return peer.uid in self.publish_uids or peer.gid in self.publish_gids

    def group(self, peer: Peer) -> str | None:
        """``peer``'s trust group: None for root and the daemon's own uid (trusted: what
        they write back is served to every peer, and they are served only trusted
        objects), else its configured group or its uid alone."""
        if peer.uid in self._trusted:
            return None
        group = self._groups.get(peer.uid)
        if group is None:
            group = self._groups[peer.uid] = trust.group_name((peer.uid,))
        return group


@dataclass
class Attachment:
    """What goes with a reply besides its frame: descriptors passed with SCM_RIGHTS
    (``fds``, in the order the reply names them), or a file sent as the reply's payload
    (``payload_fd``: ``payload_size`` bytes from offset 0, announced as ``payload_size``).
    The server owns the descriptors once a handler returns them and closes them when they
    are sent or the connection is gone. ``encoded``: the successful reply already encoded,
    its frame after the leading id (cached_client.protocol.encode_after_id of ``{"ok":
    true, ...}``, made once for many requests: cached.artifacts.Served.get_reply); the
    server sends it under the request's integer id, and encodes the reply message itself
    for any other id or a payload."""

    fds: list[int] = field(default_factory=list)
    payload_fd: int | None = None
    payload_size: int = 0
    encoded: bytes | None = None

    def close(self) -> None:
        for fd in [*self.fds, *([] if self.payload_fd is None else [self.payload_fd])]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds, self.payload_fd = [], None


Reply = p.Message | tuple[p.Message, Attachment]
Handler = Callable[[Any, Peer], Awaitable[Reply]]
"""An op's handler: (decoded request, peer) -> reply, or (reply, attachment)."""


def peer_of(sock: socket.socket) -> Peer:
    """The process at the other end of ``sock`` (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return Peer(*struct.unpack("3i", creds))
