"""Shared autotune results: one process tunes, the others on the node reuse the winner.

One row per (op, N, K, dtype, arch, device, M bucket), in the store's index database,
table ``autotune_results``. A later result replaces the recorded one only when it is
faster, or when the publisher says ``replace``. Ops: ``autotune_put`` (publish
permission) and ``autotune_get``; both touch the index off the event loop (another
process holding the index locked delays only them).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from typing import Any

from cached_client import protocol as p
from cached_client.errors import InvalidArgument

from .server import Handler, Peer
from .store import Store

TABLE = "autotune_results"
COLUMNS = {"id": str, "op": str, "n": int, "k": int, "dtype": str, "arch": str,
           "device": str, "bucket": int, "kernel": str, "tactic": str, "time_us": float,
           "pid": int, "updated": float}
IDENTITY = ("op", "n", "k", "dtype", "arch", "device", "bucket")
MAX_TACTIC_CHARS = 4096


def _row(m: p.AutotunePutRequest, pid: int) -> dict:
    tactic = json.dumps(m.tactic, sort_keys=True)
    if len(tactic) > MAX_TACTIC_CHARS:
        raise InvalidArgument(f"autotune_put tactic is over {MAX_TACTIC_CHARS} characters")
    row: dict[str, Any] = {"op": m.op_name, "n": m.n, "k": m.k, "dtype": m.dtype,
                           "arch": m.arch, "device": m.device, "bucket": m.bucket,
                           "kernel": m.kernel, "tactic": tactic, "time_us": m.time_us,
                           "pid": pid, "updated": time.time()}
    row["id"] = hashlib.sha256(json.dumps([row[k] for k in IDENTITY]).encode()).hexdigest()
    return row


class Autotune:
    """The autotune table of one store."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def _table(self, db: Any) -> Any:
        table = db.table(TABLE)
        if not table.exists():
            table.create(COLUMNS, pk="id")
        return table

    async def autotune_put(self, m: p.AutotunePutRequest, peer: Peer) -> p.AutotunePutReply:
        """Record a tuning winner; a later, faster result for the same bucket replaces it."""
        row = _row(m, peer.pid)
        stored = await asyncio.get_running_loop().run_in_executor(
            None, self._put, row, m.replace)
        return p.AutotunePutReply(stored=stored)

    def _put(self, row: dict, replace: bool) -> bool:
        with self.store.write() as db:
            table = self._table(db)
            old = next(table.rows_where("id = ?", [row["id"]]), None)
            stored = old is None or replace or row["time_us"] < old["time_us"]
            if stored:
                table.insert(row, replace=True)
        return stored

    async def autotune_get(self, m: p.AutotuneGetRequest, peer: Peer) -> p.AutotuneGetReply:
        where = {name: value for name, value in (
            ("op", m.op_name), ("n", m.n), ("k", m.k), ("dtype", m.dtype), ("arch", m.arch),
            ("device", m.device)) if value is not None}
        rows = await asyncio.get_running_loop().run_in_executor(None, self._get, where)
        for r in rows:
            r["tactic"] = json.loads(r["tactic"])
        return p.AutotuneGetReply(results=rows)

    def _get(self, where: dict) -> list[dict]:
        with self.store.read() as db:
            table = db.table(TABLE)
            if not table.exists():
                return []
            clause = " and ".join(f"[{k}] = ?" for k in where) or None
            return list(table.rows_where(clause, list(where.values()) or None,
                                         order_by="bucket"))

    def ops(self) -> dict[str, Handler]:
        return {"autotune_put": self.autotune_put, "autotune_get": self.autotune_get}
