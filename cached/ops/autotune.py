"""Shared autotune results: one process tunes, the others on the node reuse the winner.

One row per (trust group, op, N, K, dtype, arch, device, toolchain, reduction class, M
bucket), in the store's index database, table ``autotune_results``. A later result
replaces the recorded one only when it is faster, or when the publisher says ``replace``.
Ops: ``autotune_put`` (publish permission), ``autotune_get`` and ``planned`` (the weight
shapes clients planned here, table ``planned_shapes``); all touch the index off the event
loop (another process holding the index locked delays only them).

Invariants (a winner decides which kernel another process runs: cached/ops/scoped.py):
- a winner states its toolchain and reduction-order class, or is refused
  (``invalid_argument``); a class is checked against the family's class of its tactic;
- a winner lives under its publisher's trust group: served to that group only, and it
  never replaces or hides another group's; the trusted group's (root's, the daemon
  uid's: ``cached tune``) are served to every peer; rows naming no group, toolchain or
  class are never served;
- each group's rows are bounded in bytes (``overloaded`` past the cap), so a reply fits
  the client's frame; a full disk is ``overloaded`` naming it;
- the planned shapes are bounded in all and per uid (:data:`MAX_PLANNED_PER_UID`).

With a fleet tier (:mod:`cached.fleet`), a stored winner is also published there,
Ed25519-signed like an artifact, with its trust group among the signed fields, and
``autotune_get`` for a whole (op, N, K, dtype, arch, device) first adopts the verified
winners its peers published, each under the group it was signed with (a record naming no
group is refused; a peer's row replaces a local one only when faster, as a local put
without ``replace``); what is refused is logged in one line per fetch. Each stored winner
is logged (``autotune.stored``): the daemon's journal of a ``cached tune`` run.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from typing import Any

from cached_client import protocol as p
from cached_client.errors import CachedError, InvalidArgument, InvalidTactic, UnknownFamily

from cached import families
from cached.toolchain import trust

from ..fleet.tier import Tier
from ..log import event
from ..server import Access, Handler, Peer
from ..store.store import Store
from . import scoped

log = logging.getLogger("cached.autotune")

TABLE = "autotune_results"
COLUMNS = {"id": str, "op": str, "n": int, "k": int, "dtype": str, "arch": str,
           "device": str, "toolchain": str, "reduction_class": str, "bucket": int,
           "kernel": str, "tactic": str, "time_us": float, "pid": int, "updated": float,
           "source": str, scoped.GROUP: str, scoped.BYTES: int}
PRIVATE = ("id", "pid", "updated", "source", scoped.BYTES)  # not signed for the fleet

IDENTITY = ("op", "n", "k", "dtype", "arch", "device", "toolchain", "reduction_class",
            "bucket")
GROUP = ("op", "n", "k", "dtype", "arch", "device")  # what one fleet-tier hash holds
MAX_TACTIC_CHARS = 4096
MAX_TOOLCHAIN_CHARS = 8192
PLANNED = "planned_shapes"
PLANNED_COLUMNS = {"id": str, "family": str, "n": int, "k": int, "arch": str, "sm_count": int,
                   "options": str, "first_seen": float}
MAX_PLANNED = 4096  # distinct shapes remembered (a client cannot grow the table past it)
MAX_PLANNED_PER_UID = 256  # of them, those one uid (not root's, not the daemon's) may add


def row_id(row: dict) -> str:
    """The sha256 naming a winner's row: its IDENTITY fields, bound to its trust group
    (a trusted row's id is the IDENTITY hash itself)."""
    base = hashlib.sha256(json.dumps([row[k] for k in IDENTITY]).encode()).hexdigest()
    group = row.get(scoped.GROUP, trust.TRUSTED)
    return trust.writeback_key(base, None if group == trust.TRUSTED else group)


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


def _row(m: p.AutotunePutRequest, pid: int, group: str) -> dict:
    if not m.toolchain or not m.reduction_class:
        raise InvalidArgument("autotune_put must state toolchain (hello's toolchain: the stack "
                              "that compiled the kernels timed) and reduction_class (the "
                              "winner's reduction-order class): a winner whose toolchain or "
                              "class is unstated is never taken; nothing was stored")
    if len(m.toolchain) > MAX_TOOLCHAIN_CHARS:
        raise InvalidArgument(f"autotune_put toolchain is over {MAX_TOOLCHAIN_CHARS} characters")
    tactic = json.dumps(m.tactic, sort_keys=True)
    if len(tactic) > MAX_TACTIC_CHARS:
        raise InvalidArgument(f"autotune_put tactic is over {MAX_TACTIC_CHARS} characters")
    _check_class(m)
    row: dict[str, Any] = {"op": m.op_name, "n": m.n, "k": m.k, "dtype": m.dtype,
                           "arch": m.arch, "device": m.device, "toolchain": m.toolchain,
                           "reduction_class": m.reduction_class, "bucket": m.bucket,
                           "kernel": m.kernel, "tactic": tactic, "time_us": m.time_us,
                           "pid": pid, "updated": time.time(), "source": "local",
                           scoped.GROUP: group}
    row["id"] = row_id(row)
    row[scoped.BYTES] = scoped.size(row)
    return row


class Autotune:
    """The autotune table of one store, and its fleet tier (``remote``, or None); ``access``
    names each peer's trust group."""

    def __init__(self, store: Store, remote: Tier | None = None,
                 access: Access | None = None) -> None:
        self.store = store
        self.remote = remote
        self.access = access or Access()
        self._planned_seen: set[str] = set()
        self._planned_by_uid: dict[int, int] = {}

    def _table(self, db: Any) -> Any:
        table = db.table(TABLE)
        if not table.exists():
            table.create(COLUMNS, pk="id")
        else:  # a table from before toolchain / class / source / group were columns
            missing = {c: t for c, t in COLUMNS.items() if c not in table.columns_dict}
            for name, kind in missing.items():
                table.add_column(name, kind, not_null_default="" if kind is str else 0)
        if missing_index(db, TABLE, scoped.GROUP):
            table.create_index([scoped.GROUP], if_not_exists=True)
        return table

    async def autotune_put(self, m: p.AutotunePutRequest, peer: Peer) -> p.AutotunePutReply:
        """Record a tuning winner under ``peer``'s trust group; a later, faster result for
        the same bucket of that group replaces it."""
        row = _row(m, peer.pid, scoped.group_of(self.access, peer))
        stored = await asyncio.get_running_loop().run_in_executor(
            None, self._put, row, m.replace)
        event(log, logging.INFO, "autotune.stored" if stored else "autotune.kept",
              n=m.n, k=m.k, bucket=m.bucket, device=m.device, kernel=m.kernel,
              reduction_class=m.reduction_class, time_us=round(m.time_us, 3), pid=peer.pid,
              uid=peer.uid, group=row[scoped.GROUP])
        if stored and self.remote is not None and not self.remote.read_only:
            self.remote.publish_record(group_id(row), row["id"], _signed_row(row))
        return p.AutotunePutReply(stored=stored)

    def _put(self, row: dict, replace: bool) -> bool:
        with scoped.disk_errors(self.store.root, "autotune_put"), self.store.write() as db:
            table = self._table(db)
            old = next(table.rows_where("id = ?", [row["id"]]), None)
            stored = old is None or replace or row["time_us"] < old["time_us"]
            if stored:
                scoped.check_room(db, TABLE, row[scoped.GROUP], row[scoped.BYTES],
                                  old[scoped.BYTES] if old else 0)
                table.insert(row, replace=True)
        return stored

    async def autotune_get(self, m: p.AutotuneGetRequest, peer: Peer) -> p.AutotuneGetReply:
        """The winners ``peer`` may be served: the trusted group's and its own group's, the
        fastest of them per bucket identity, ordered by bucket."""
        where = {name: value for name, value in (
            ("op", m.op_name), ("n", m.n), ("k", m.k), ("dtype", m.dtype), ("arch", m.arch),
            ("device", m.device), ("toolchain", m.toolchain),
            ("reduction_class", m.reduction_class)) if value is not None}
        loop = asyncio.get_running_loop()
        if self.remote is not None and all(k in where for k in GROUP):
            await loop.run_in_executor(None, self._adopt, where)
        rows = await loop.run_in_executor(
            None, self._get, where, scoped.visible(scoped.group_of(self.access, peer)))
        for r in rows:
            r["tactic"] = json.loads(r["tactic"])
            r.pop(scoped.BYTES, None)
        return p.AutotuneGetReply(results=rows)

    def _adopt(self, where: dict) -> None:
        """Take the verified winners the fleet tier holds for ``where``'s group, each under
        the trust group it was signed with; what is refused is logged in one line."""
        adopted, refused, reasons = 0, 0, set()
        for rid, row in self.remote.fetch_records(group_id(where)):
            try:
                fields = {c: row[c] for c in COLUMNS if c not in PRIVATE}
                fields["tactic"] = json.dumps(json.loads(fields["tactic"]), sort_keys=True)
                for name in ("toolchain", "reduction_class", scoped.GROUP):
                    if not isinstance(fields[name], str) or not fields[name]:
                        raise ValueError(f"the record states no {name}")
                local = {**fields, "pid": 0, "updated": time.time(), "source": "fleet"}
                if row_id(local) != rid or group_id(local) != group_id(where):
                    raise ValueError("the signed fields do not name this row")
            except (KeyError, TypeError, ValueError) as exc:
                refused += 1
                if len(reasons) < 4:
                    reasons.add(f"{type(exc).__name__}: {exc}"[:120])
                continue
            local["id"] = rid
            local[scoped.BYTES] = scoped.size(local)
            try:
                if self._put(local, replace=False):
                    adopted += 1
            except CachedError as exc:  # the group's cap, a full disk: the rest likewise
                refused += 1
                reasons.add(exc.message[:120])
                break
        if refused:
            event(log, logging.WARNING, "autotune.fleet_rejected", records=refused,
                  n=where["n"], k=where["k"], device=where["device"], reasons=sorted(reasons))
        if adopted:
            event(log, logging.INFO, "autotune.fleet_adopted", rows=adopted,
                  n=where["n"], k=where["k"], device=where["device"])

    def _get(self, where: dict, groups: tuple[str, ...]) -> list[dict]:
        with self.store.read() as db:
            table = db.table(TABLE)
            if not table.exists():
                return []
            cols = table.columns_dict
            if any(k not in cols for k in [*where, scoped.GROUP]):  # an old table
                return []
            clauses = [f"[{k}] = ?" for k in where]
            clauses.append(f"[{scoped.GROUP}] in ({', '.join('?' for _ in groups)})")
            clauses.append("[toolchain] != '' and [reduction_class] != ''")
            rows = list(table.rows_where(" and ".join(clauses), [*where.values(), *groups],
                                         order_by="bucket"))
        best: dict[tuple, dict] = {}  # per bucket identity, the fastest visible row
        for r in rows:
            ident = tuple(r[k] for k in IDENTITY)
            if ident not in best or r["time_us"] < best[ident]["time_us"]:
                best[ident] = r
        return list(best.values())

    # -- what clients planned ------------------------------------------------------------

    def note_plan(self, m: p.PlanRequest, peer: Peer | None = None) -> None:
        """Remember (family, N, K, arch, sm_count, options) of a plan request, once; off the
        event loop, never failing the plan (called by Service.plan). A uid other than root
        and the daemon's adds at most MAX_PLANNED_PER_UID shapes: no peer fills the table."""
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
        uid = None if peer is None or self.access.group(peer) is None else peer.uid
        if uid is not None:
            if self._planned_by_uid.get(uid, 0) >= MAX_PLANNED_PER_UID:
                return
            self._planned_by_uid[uid] = self._planned_by_uid.get(uid, 0) + 1
        self._planned_seen.add(rid)
        row["id"] = rid
        asyncio.get_running_loop().run_in_executor(None, self._note, row, uid)

    def _note(self, row: dict, uid: int | None = None) -> None:
        try:
            with self.store.write() as db:
                table = db.table(PLANNED)
                if not table.exists():
                    table.create(PLANNED_COLUMNS, pk="id")
                table.insert(row, ignore=True)
        except Exception as exc:  # noqa: BLE001 -- a plan never fails for its record
            self._planned_seen.discard(row["id"])  # the next plan of the shape tries again
            if uid is not None:
                self._planned_by_uid[uid] -= 1
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


def missing_index(db: Any, table: str, column: str) -> bool:
    """Whether ``table`` has no index on ``column`` alone."""
    return not any(list(i.columns) == [column] for i in db.table(table).indexes)


def _signed_row(row: dict) -> dict:
    """The fields of a winner a fleet peer may take over (not pid, updated, source, its
    size here): its trust group among them."""
    return {c: row[c] for c in COLUMNS if c not in PRIVATE}
