"""Who is served what a peer wrote back: trust groups and the keys of their objects.

Publish rights are code execution: an object written back is loaded (``dlopen``) by every
process it is served to. So a written-back object is served only to its publisher's
*trust group* (setting ``trust_group``: uids whose objects are served to each other; a
uid in no group is a group alone), never to another, whatever identity its publisher
stated. Trusted for every peer: what the daemon compiles, what comes verified from the
fleet tier, and what root or the daemon's own uid publish (that uid owns the store).

Invariants:
- a group's objects live under keys of their own (:func:`writeback_key`: the kernel's key,
  docs/keys.md, bound to the group), so a lookup for one group can never find another's
  object; trusted publishers' objects are stored under the kernel's key itself;
- a written-back row records its publisher (uid, gid, pid, group) and the identity it
  stated (:func:`provenance`); a written-back row without a publisher is never served
  (:func:`may_serve`; the daemon drops such rows at start: :func:`drop_unattributed`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any, Protocol

from cached_client import protocol as p

TRUSTED = "trusted"
"""The group of rows served to every peer (daemon compiles, root's and the daemon uid's)."""
ORIGIN = "write-back"
"""``meta.origin`` of a row a peer wrote back."""


def group_name(uids: Iterable[int]) -> str:
    """The name of the trust group of ``uids`` (the same for any order)."""
    return "uids:" + ",".join(str(u) for u in sorted(set(uids)))


def writeback_key(key: str, group: str | None) -> str:
    """The store key of an object written back by trust group ``group`` for the kernel
    whose key is ``key`` (None: a trusted publisher, the kernel's key itself)."""
    if group is None:
        return key
    return hashlib.sha256(f"cached write-back\0{group}\0{key}".encode()).hexdigest()


def provenance(uid: int, gid: int, pid: int, group: str | None,
               identity: p.Identity | None) -> dict[str, Any]:
    """The ``meta`` fields of a written-back row: who published it (SO_PEERCRED) and the
    identity it stated (None: it stated none, the daemon's default toolchain)."""
    return {"origin": ORIGIN,
            "publisher": {"uid": uid, "gid": gid, "pid": pid, "group": group or TRUSTED},
            "identity": identity.to_wire() if identity is not None else None}


class Stored(Protocol):
    """What the trust rules read of a stored row (cached.store.rows.Row): its ``meta``
    column, JSON text (None: an old row without one)."""

    @property
    def key(self) -> str: ...

    @property
    def meta(self) -> str | None: ...


class StoredRows(Protocol):
    """A store as :func:`drop_unattributed` uses it (cached.store.store.Store)."""

    def rows(self) -> Iterable[Stored]: ...

    def drop(self, key: str, reason: str) -> None: ...


def row_group(row: Stored) -> str | None:
    """The trust group a stored row is served to: :data:`TRUSTED` unless a peer wrote it
    back, else its publisher's group; None for a written-back row naming no publisher."""
    try:
        meta = json.loads(row.meta) if isinstance(row.meta, str) else row.meta
    except ValueError:
        return None
    if not isinstance(meta, dict) or meta.get("origin") != ORIGIN:
        return TRUSTED
    publisher = meta.get("publisher")
    group = publisher.get("group") if isinstance(publisher, dict) else None
    return group if isinstance(group, str) and group else None


def may_serve(row: Stored, group: str | None) -> bool:
    """Whether a peer of trust group ``group`` (None: a trusted peer) may be served
    ``row``: trusted rows to every peer, a group's written-back rows to that group only."""
    served_to = row_group(row)
    return served_to == TRUSTED or (group is not None and served_to == group)


def drop_unattributed(store: StoredRows) -> int:
    """Drop every written-back row that names no publisher (written before publishers were
    recorded: nobody can say who may load it); returns how many."""
    dropped = 0
    for row in store.rows():
        if row_group(row) is None:
            store.drop(row.key, "written back with no recorded publisher: not servable")
            dropped += 1
    return dropped
