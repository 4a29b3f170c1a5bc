"""Shared autotune results: one process tunes, the others on the node reuse the winner.

One row per (op, N, K, dtype, arch, device, toolchain, reduction class, M bucket), in the
store's index database, table ``autotune_results``. A later result replaces the recorded
one only when it is faster, or when the publisher says ``replace``. A winner that states
its reduction-order class is checked against the family's class of its tactic (a winner
is never filed under another class). Ops: ``autotune_put`` (publish permission),
``autotune_get`` and ``planned`` (the weight shapes clients planned here, table
``planned_shapes``); all touch the index off the event loop (another process holding the
index locked delays only them).

With a fleet tier (:mod:`cached.fleet`), a stored winner is also published there,
Ed25519-signed like an artifact, and ``autotune_get`` for a whole (op, N, K, dtype, arch,
device) first adopts the verified winners its peers published (a peer's row replaces a
local one only when faster, as a local put without ``replace``). Each stored winner is
logged (``autotune.stored``): the daemon's journal of a ``cached tune`` run.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from typing import Any

from cached_client import protocol as p
from cached_client.errors import InvalidArgument, InvalidTactic, UnknownFamily

from .. import families
from ..fleet.tier import Tier
from ..log import event
from ..server import Handler, Peer
from ..store.store import Store

log = logging.getLogger("cached.autotune")

TABLE = "autotune_results"
COLUMNS = {"id": str, "op": str, "n": int, "k": int, "dtype": str, "arch": str,
           "device": str, "toolchain": str, "reduction_class": str, "bucket": int,
           "kernel": str, "tactic": str, "time_us": float, "pid": int, "updated": float,
           "source": str}
IDENTITY = ("op", "n", "k", "dtype", "arch", "device", "toolchain", "reduction_class",
            "bucket")
GROUP = ("op", "n", "k", "dtype", "arch", "device")  # what one fleet-tier hash holds
MAX_TACTIC_CHARS = 4096
PLANNED = "planned_shapes"
PLANNED_COLUMNS = {"id": str, "family": str, "n": int, "k": int, "arch": str, "sm_count": int,
                   "options": str, "first_seen": float}
MAX_PLANNED = 4096  # distinct shapes remembered (a client cannot grow the table past it)


def row_id(row: dict) -> str:
    """The sha256 naming a winner's row: its IDENTITY fields."""
    return hashlib.sha256(json.dumps([row[k] for k in IDENTITY]).encode()).hexdigest()


def group_id(row: dict) -> str:
    """The sha256 naming the (op, N, K, dtype, arch, device) a winner belongs to."""
    return hashlib.sha256(json.dumps([row[k] for k in GROUP]).encode()).hexdigest()


def _check_class(m: p.AutotunePutRequest) -> None:
    """A stated class must be the family's class of the tactic (InvalidArgument)."""
    if not m.reduction_class or m.kernel not in families.names():
        return
    try:
        cls = families.get(m.kernel).reduction_class(m.tactic)
    except (InvalidTactic, UnknownFamily, TypeError, ValueError) as exc:
        raise InvalidArgument(f"autotune_put tactic is not a {m.kernel} tactic: {exc}") from None
    if cls is not None and cls != m.reduction_class:
        raise InvalidArgument(f"autotune_put tactic is of the class {cls}, not the stated "
                              f"{m.reduction_class}: a winner is filed under its own class")


def _row(m: p.AutotunePutRequest, pid: int) -> dict:
    tactic = json.dumps(m.tactic, sort_keys=True)
    if len(tactic) > MAX_TACTIC_CHARS:
        raise InvalidArgument(f"autotune_put tactic is over {MAX_TACTIC_CHARS} characters")
    _check_class(m)
    row: dict[str, Any] = {"op": m.op_name, "n": m.n, "k": m.k, "dtype": m.dtype,
                           "arch": m.arch, "device": m.device, "toolchain": m.toolchain,
                           "reduction_class": m.reduction_class, "bucket": m.bucket,
                           "kernel": m.kernel, "tactic": tactic, "time_us": m.time_us,
                           "pid": pid, "updated": time.time(), "source": "local"}
    row["id"] = row_id(row)
    return row


class Autotune:
    """The autotune table of one store, and its fleet tier (``remote``, or None)."""

    def __init__(self, store: Store, remote: Tier | None = None) -> None:
        self.store = store
        self.remote = remote
        self._planned_seen: set[str] = set()

    def _table(self, db: Any) -> Any:
        table = db.table(TABLE)
        if not table.exists():
            table.create(COLUMNS, pk="id")
        else:  # a table from before toolchain / class / source were columns
            missing = {c: t for c, t in COLUMNS.items() if c not in table.columns_dict}
            for name, kind in missing.items():
                table.add_column(name, kind, not_null_default="" if kind is str else None)
        return table

    async def autotune_put(self, m: p.AutotunePutRequest, peer: Peer) -> p.AutotunePutReply:
        """Record a tuning winner; a later, faster result for the same bucket replaces it."""
        row = _row(m, peer.pid)
        stored = await asyncio.get_running_loop().run_in_executor(
            None, self._put, row, m.replace)
        event(log, logging.INFO, "autotune.stored" if stored else "autotune.kept",
              n=m.n, k=m.k, bucket=m.bucket, device=m.device, kernel=m.kernel,
              reduction_class=m.reduction_class, time_us=round(m.time_us, 3), pid=peer.pid)
        if stored and self.remote is not None and not self.remote.read_only:
            self.remote.publish_record(group_id(row), row["id"], _signed_row(row))
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
            ("device", m.device), ("toolchain", m.toolchain),
            ("reduction_class", m.reduction_class)) if value is not None}
        loop = asyncio.get_running_loop()
        if self.remote is not None and all(k in where for k in GROUP):
            await loop.run_in_executor(None, self._adopt, where)
        rows = await loop.run_in_executor(None, self._get, where)
        for r in rows:
            r["tactic"] = json.loads(r["tactic"])
        return p.AutotuneGetReply(results=rows)

    def _adopt(self, where: dict) -> None:
        """Take the verified winners the fleet tier holds for ``where``'s group."""
        adopted = 0
        for rid, row in self.remote.fetch_records(group_id(where)):
            try:
                fields = {c: row[c] for c in COLUMNS if c not in ("id", "pid", "updated",
                                                                  "source")}
                fields["tactic"] = json.dumps(json.loads(fields["tactic"]), sort_keys=True)
                local = {**fields, "pid": 0, "updated": time.time(), "source": "fleet"}
                if row_id(local) != rid or group_id(local) != group_id(where):
                    raise ValueError("the signed fields do not name this row")
            except (KeyError, TypeError, ValueError) as exc:
                event(log, logging.WARNING, "autotune.fleet_rejected", id=str(rid)[:16],
                      reason=str(exc)[:200])
                continue
            local["id"] = rid
            if self._put(local, replace=False):
                adopted += 1
        if adopted:
            event(log, logging.INFO, "autotune.fleet_adopted", rows=adopted,
                  n=where["n"], k=where["k"], device=where["device"])

    def _get(self, where: dict) -> list[dict]:
        with self.store.read() as db:
            table = db.table(TABLE)
            if not table.exists():
                return []
            cols = table.columns_dict
            if any(k not in cols for k in where):  # an old table: nothing has those fields
                return []
            clause = " and ".join(f"[{k}] = ?" for k in where) or None
            return list(table.rows_where(clause, list(where.values()) or None,
                                         order_by="bucket"))

    # -- what clients planned ------------------------------------------------------------

    def note_plan(self, m: p.PlanRequest) -> None:
        """Remember (family, N, K, arch, sm_count, options) of a plan request, once; off the
        event loop, never failing the plan (called by Service.plan)."""
        _, n, k = m.shape
        options = {k_: v for k_, v in m.options.items() if k_ in ("ab_dtype", "out_dtype")}
        row = {"family": m.family, "n": n, "k": k, "arch": m.arch,
               "sm_count": m.sm_count or 0, "options": json.dumps(options, sort_keys=True),
               "first_seen": time.time()}
        rid = hashlib.sha256(json.dumps([row[c] for c in ("family", "n", "k", "arch",
                                                          "sm_count", "options")]
                                        ).encode()).hexdigest()
        if rid in self._planned_seen or len(self._planned_seen) >= MAX_PLANNED:
            return
        self._planned_seen.add(rid)
        row["id"] = rid
        asyncio.get_running_loop().run_in_executor(None, self._note, row)

    def _note(self, row: dict) -> None:
        try:
            with self.store.write() as db:
                table = db.table(PLANNED)
                if not table.exists():
                    table.create(PLANNED_COLUMNS, pk="id")
                table.insert(row, ignore=True)
        except Exception as exc:  # noqa: BLE001 -- a plan never fails for its record
            self._planned_seen.discard(row["id"])  # the next plan of the shape tries again
            event(log, logging.WARNING, "autotune.planned_not_recorded", n=row["n"],
                  k=row["k"], error=f"{type(exc).__name__}: {exc}"[:200])

    async def planned(self, m: p.PlannedRequest, peer: Peer) -> p.PlannedReply:
        rows = await asyncio.get_running_loop().run_in_executor(None, self._planned, m.family)
        return p.PlannedReply(shapes=[{**{c: r[c] for c in ("family", "n", "k", "arch",
                                                             "sm_count")},
                                       "options": json.loads(r["options"])} for r in rows])

    def _planned(self, family: str | None) -> list[dict]:
        with self.store.read() as db:
            table = db.table(PLANNED)
            if not table.exists():
                return []
            return list(table.rows_where("family = ?" if family else None,
                                         [family] if family else None, order_by="first_seen"))

    def ops(self) -> dict[str, Handler]:
        return {"autotune_put": self.autotune_put, "autotune_get": self.autotune_get,
                "planned": self.planned}


def _signed_row(row: dict) -> dict:
    """The fields of a winner a fleet peer may take over (not pid, updated, source)."""
    return {c: row[c] for c in COLUMNS if c not in ("id", "pid", "updated", "source")}
