"""Request frames as the daemon holds them: the room they may take
(:class:`FrameBudget`), the decoded requests remembered by their bytes
(:class:`DecodedFrameCache`), and one frame read (:class:`Frame`) whose strings are
checked to be text (:func:`check_text`).

Invariants: frames over :data:`SMALL_FRAME` bytes hold at most
:data:`MAX_FRAME_BYTES_PER_UID` per uid and :data:`MAX_FRAME_BYTES` in all; a remembered
request hits only a frame equal to its own but for the id's digits.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from cached_client import protocol as p
from cached_client.errors import InvalidArgument

SMALL_FRAME = 4 << 10
"""Request frames up to this size need no reserved room (a ``get`` is about 600 bytes)."""
MAX_FRAME_BYTES_PER_UID = 16 << 20
MAX_FRAME_BYTES = 64 << 20


class FrameBudget:
    """Room for request frames over :data:`SMALL_FRAME`: per uid and in all. A uid that holds
    nothing always gets room for one frame (a frame is at most 1 MiB). Waiters are granted
    room in arrival order as it is freed, each only when it fits; a release wakes only the
    waiters it grants (a flood of waiting frames is not woken all at once)."""

    def __init__(self, per_uid: int = MAX_FRAME_BYTES_PER_UID, total: int = MAX_FRAME_BYTES
                 ) -> None:
        self.per_uid, self.total = per_uid, total
        self.used = 0
        self.by_uid: Counter[int] = Counter()
        self._waiters: dict[asyncio.Future, tuple[int, int]] = {}  # in arrival order

    def _fits(self, uid: int, n: int) -> bool:
        mine = self.by_uid[uid]
        return (mine == 0 or mine + n <= self.per_uid) and (
            self.used == 0 or self.used + n <= self.total or mine == 0)

    def _hold(self, uid: int, n: int) -> None:
        self.used += n
        self.by_uid[uid] += n

    async def reserve(self, uid: int, n: int, deadline: float) -> bool:
        """Hold ``n`` bytes for ``uid``; False if no room came before ``deadline``
        (loop time). Room granted is the caller's to release, whatever happens after."""
        if self._fits(uid, n):
            self._hold(uid, n)
            return True
        granted = asyncio.get_running_loop().create_future()
        self._waiters[granted] = (uid, n)
        try:
            async with asyncio.timeout_at(deadline):
                await granted
            return True
        except TimeoutError:
            return granted.done() and not granted.cancelled()  # granted as time ran out
        except BaseException:  # cancelled (the connection went): give back what came
            if granted.done() and not granted.cancelled():
                self.release(uid, n)
            raise
        finally:
            self._waiters.pop(granted, None)

    def release(self, uid: int, n: int) -> None:
        if n:
            self.used -= n
            self.by_uid[uid] -= n
            if not self.by_uid[uid]:
                del self.by_uid[uid]
            self._grant()

    def _grant(self) -> None:
        for granted, (uid, n) in list(self._waiters.items()):
            if not granted.done() and self._fits(uid, n):
                self._hold(uid, n)
                granted.set_result(True)
                del self._waiters[granted]


class DecodedFrameCache:
    """Decoded requests of the ops that ask for it (:attr:`cached_client.protocol.Op.remember`),
    by their frame's bytes after a leading integer id (``{"id":N,``: cached_client writes
    every frame so, its keys sorted): a client asking again for what it asked before is
    neither parsed nor checked again. Exact: a frame hits only when every byte but the id's
    digits is that of a frame that was decoded, passed its op's checks, and holds no other
    ``"id"`` (so N is its id). Each remembered frame is at most :attr:`LONGEST` bytes, at
    most :attr:`MOST` are held (when full it starts over); a remembered request is shared
    by every frame that hits it (messages are frozen). The peer's rights are still checked
    on every request."""

    MOST = 2048
    LONGEST = 2048

    def __init__(self) -> None:
        self._decoded: dict[bytes, tuple[p.Op, p.Message]] = {}

    def recall(self, body: bytes | bytearray) -> tuple[int, p.Op, p.Message] | None:
        """(id, op, request) of a frame remembered but for its id; None if not one."""
        leading = LEADING_ID.match(body)
        if leading is None:
            return None
        hit = self._decoded.get(bytes(body[leading.end():]))
        return None if hit is None else (int(leading[1]), *hit)

    def remember(self, body: bytes, message: dict, op: p.Op, request: p.Message) -> None:
        """Remember ``request``, decoded from ``body`` (parsed as ``message``), if its frame
        has the form that :meth:`recall` can tell apart."""
        leading = LEADING_ID.match(body)
        if (leading is None or len(body) > self.LONGEST
                or type(message.get("id")) is not int or message["id"] != int(leading[1])):
            return
        rest = body[leading.end():]
        # a second "id" further on would be the frame's id, whatever the first says: none
        # written plainly (nested or a string too, to be safe), none spelled with escapes
        if b'"id"' in rest:
            return
        if b"\\" in rest:
            try:
                if "id" in json.loads(b"{" + rest):
                    return
            except (ValueError, RecursionError):
                return
        if len(self._decoded) >= self.MOST:
            self._decoded.clear()
        self._decoded[rest] = (op, request)

    def __len__(self) -> int:
        return len(self._decoded)


LEADING_ID = re.compile(rb'\{"id":(0|[1-9][0-9]{0,15}),')


@dataclass(slots=True)
class Frame:
    """One request frame: its parsed object (only ``id`` and ``op`` when remembered), its
    remembered (op, request), its bytes while its request may be remembered, and whether
    its JSON escapes a UTF-16 surrogate (its strings are checked to be text)."""

    message: dict
    decoded: tuple[p.Op, p.Message] | None = None
    body: bytes | None = None
    surrogates: bool = False


SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def check_text(value: Any, where: str = "request") -> None:
    """InvalidArgument naming the first string (or key) of ``value`` that is no text: one
    holding a lone UTF-16 surrogate (an escape ``\\ud800``-``\\udfff`` not in a pair)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgument(f"{where[:200]} holds a lone UTF-16 surrogate (a \\ud800-"
                                  "\\udfff escape not in a pair): it is not text; nothing was "
                                  "done") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(key, f"a key of {where}")
            check_text(item, f"{where}.{key}" if key.isascii() else where)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_text(item, f"{where}[{i}]")
