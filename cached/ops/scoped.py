"""What the side tables peers write (tuning winners, certifications) share: each row is
kept under its publisher's trust group and served only to that group (cached/toolchain/trust.py),
each group's rows are bounded in bytes, and a full disk is a typed error.

A tuning winner or a certification decides which kernel another process runs, so it is
trusted like code: a peer's rows are served to its own trust group only; the rows of root
and the daemon's own uid (:data:`cached.toolchain.trust.TRUSTED`) to every peer. A row that names
no group (written before groups were recorded) is never served.

Bounds: a group's rows in one table hold at most :data:`MAX_GROUP_BYTES` of their reply
encoding (trusted ones :data:`MAX_TRUSTED_BYTES`), so a reply (trusted rows and the
asker's group's) is at most :data:`MAX_REPLY_BYTES` and fits the client's reply frame
(``cached_client.protocol.MAX_REPLY_FRAME``, 64 MiB).
"""

from __future__ import annotations

import contextlib
import errno
import json
import sqlite3
from collections.abc import Iterator
from typing import Any

from cached_client import protocol as p
from cached_client.errors import Overloaded

from cached.toolchain import trust

from ..server import Access, Peer

GROUP = "trust_group"
"""The column naming the trust group a row is served to."""
BYTES = "row_bytes"
"""The column holding a row's size in its reply (JSON bytes)."""
MAX_GROUP_BYTES = 8 << 20
MAX_TRUSTED_BYTES = 24 << 20
MAX_REPLY_BYTES = MAX_GROUP_BYTES + MAX_TRUSTED_BYTES
assert MAX_REPLY_BYTES + (1 << 20) <= p.MAX_REPLY_FRAME


def group_of(access: Access, peer: Peer) -> str:
    """The trust group ``peer``'s rows are kept under (:data:`trust.TRUSTED` for root and
    the daemon's uid)."""
    return access.group(peer) or trust.TRUSTED


def visible(group: str) -> tuple[str, ...]:
    """The groups whose rows a peer of ``group`` is served: the trusted ones, and its own."""
    return (trust.TRUSTED,) if group == trust.TRUSTED else (trust.TRUSTED, group)


def size(row: dict) -> int:
    """A row's bytes in a reply (its JSON encoding)."""
    return len(json.dumps(row, default=str))


def check_room(db: Any, table: str, group: str, incoming: int, replaced: int = 0) -> None:
    """Overloaded when ``group``'s rows in ``table`` would exceed the group's cap with a
    row of ``incoming`` bytes added (and one of ``replaced`` bytes gone)."""
    cap = MAX_TRUSTED_BYTES if group == trust.TRUSTED else MAX_GROUP_BYTES
    held = db.execute(f"select coalesce(sum([{BYTES}]), 0) from [{table}] where [{GROUP}] = ?",
                      [group]).fetchone()[0]
    if held - replaced + incoming > cap:
        raise Overloaded(f"{table}: trust group {group} holds {held} bytes of rows, its cap is "
                         f"{cap}; nothing was stored (an operator can clear the table with "
                         "sqlite3 on the store's index.sqlite)")


@contextlib.contextmanager
def disk_errors(root: Any, what: str) -> Iterator[None]:
    """A full disk (or quota) under the store ``root`` while writing ``what`` becomes
    Overloaded naming the disk; nothing is stored."""
    try:
        yield
    except sqlite3.OperationalError as exc:
        if "full" not in str(exc).lower():
            raise
        raise Overloaded(f"{what}: the store's disk ({root}) is full ({exc}); nothing was "
                         "stored: free space there or lower --max-bytes") from None
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise Overloaded(f"{what}: the store's disk ({root}) is full ({exc.strerror}); "
                         "nothing was stored: free space there or lower --max-bytes") from None
