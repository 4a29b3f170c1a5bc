"""Batch-invariance certifications: what ``cached certify`` measured on a device.

A record says, for one family, tactic set and (N, K) on one device, how many output rows
differed between ``x[:M]`` and the first M rows of the M=2048 output (the seeds'
method), per tactic and for the tactic mix an autotuner would choose across M. The
batch-invariant policy may allow a tactic set only with a record of 0 differing rows on
that device (or a family that declares its reduction order M-independent).

Records live in the store's index database, table ``certifications``, read and written
off the event loop. Ops: ``certify_record`` (publish permission) and ``certifications``.

Invariants (a certification decides which kernels another process runs:
cached/ops/scoped.py):
- a record states at least one tactic and a count for each of ``mix`` and
  ``cross_tactic`` (an empty ``rows_differing`` is refused, never "0 rows differ"); a
  stored record with no counts is never served;
- a record lives under its publisher's trust group, served to that group only (the
  trusted group's to every peer); a record of the same (family, N, K, device, arch,
  tactics, toolchain) replaces the group's earlier one;
- each group's records are bounded in bytes (``overloaded`` past the cap); a full disk
  is ``overloaded`` naming it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time

from cached_client import protocol as p
from cached_client.errors import InvalidArgument

from cached import families
from cached.toolchain import trust

from ..server import Access, Handler, Peer
from ..store.store import Store
from . import scoped

TABLE = "certifications"
REQUIRED = {"family": str, "n": int, "k": int, "device": str, "arch": str,
            "tactics": list, "rows_differing": dict}
COUNTS = ("mix", "cross_tactic")
"""The counts every record states besides its per-tactic ones."""
JSON_FIELDS = ("tactics", "rows_differing", "ms")
PRIVATE = ("record_key", scoped.BYTES)  # kept, not served


def validate(record: dict) -> dict:
    """The record as stored, or InvalidArgument naming the bad field."""
    for name, kind in REQUIRED.items():
        value = record.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise InvalidArgument(f"record.{name} must be a {kind.__name__}")
    families.get(record["family"])
    counts = record["rows_differing"]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
               for v in counts.values()):
        raise InvalidArgument("record.rows_differing values must be counts (integers >= 0)")
    missing = [c for c in COUNTS if c not in counts]
    if not record["tactics"] or len(counts) <= len(COUNTS) or missing:
        raise InvalidArgument(
            "record.rows_differing must count the differing rows of each tactic and of "
            f"{' and '.join(COUNTS)} (missing: {', '.join(missing) or 'the per-tactic counts'}"
            "), and record.tactics name at least one tactic: a certification that counted "
            "nothing certifies nothing; nothing was stored")
    clean = {name: record[name] for name in REQUIRED}
    clean["total_rows_differing"] = sum(counts.values())
    clean["ms"] = [m for m in record.get("ms", []) if isinstance(m, int)]
    clean["toolchain"] = str(record.get("toolchain", ""))[:8192]
    clean["checked_at"] = time.time()
    return clean


def _key(record: dict) -> str:
    """What a later record of the same group replaces: its (family, N, K, device, arch,
    tactics, toolchain, group)."""
    return hashlib.sha256(json.dumps(
        [record[c] for c in ("family", "n", "k", "device", "arch", "tactics", "toolchain",
                             scoped.GROUP)], sort_keys=True).encode()).hexdigest()


class Certifications:
    """The certification records of one store; ``access`` names each peer's trust group."""

    def __init__(self, store: Store, access: Access | None = None) -> None:
        self.store = store
        self.access = access or Access()
        self._migrated = False

    def _migrate(self, db: object) -> None:
        """Give rows from before trust groups were recorded the group of the uid that
        recorded them (trusted for root and the daemon's uid), their key and size."""
        table = db.table(TABLE)
        if self._migrated or not table.exists():
            self._migrated = True  # a table made from now on has the columns
            return
        cols = table.columns_dict
        for name, kind in ((scoped.GROUP, str), ("record_key", str), (scoped.BYTES, int)):
            if name not in cols:
                table.add_column(name, kind, not_null_default="" if kind is str else 0)
        for row in list(table.rows_where(f"[{scoped.GROUP}] = ''", select="rowid, *")):
            uid = row.get("recorded_by_uid")
            group = "" if not isinstance(uid, int) else (
                trust.TRUSTED if uid in (0, os.getuid())
                else scoped.group_of(self.access, Peer(0, uid, -1)))
            row[scoped.GROUP] = group
            for name in JSON_FIELDS:
                if isinstance(row.get(name), str):
                    row[name] = json.loads(row[name])
            fix = {scoped.GROUP: group, "record_key": _key({**row, "toolchain":
                                                           row.get("toolchain") or ""}),
                   scoped.BYTES: scoped.size(row)}
            table.update(row["rowid"], fix)
        self._migrated = True

    def record(self, record: dict) -> int:
        record = {**record, "record_key": _key(record)}
        record[scoped.BYTES] = scoped.size(record)
        row = {k: json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else v
               for k, v in record.items()}
        with scoped.disk_errors(self.store.root, "certify_record"), self.store.write() as db:
            self._migrate(db)
            table = db.table(TABLE)
            old = (db.execute(f"select rowid, [{scoped.BYTES}] from [{TABLE}] where "
                              "record_key = ?", [row["record_key"]]).fetchall()
                   if table.exists() else [])
            if table.exists():
                scoped.check_room(db, TABLE, record[scoped.GROUP], record[scoped.BYTES],
                                  sum(b for _, b in old))
            for rowid, _ in old:
                table.delete(rowid)
            table.insert(row, alter=True)
            return int(table.last_pk)

    def rows(self, family: str | None = None, groups: tuple[str, ...] = (trust.TRUSTED,)
             ) -> list[dict]:
        """The records of ``groups`` (of ``family``), oldest first; none without counts."""
        if not self._migrated:
            with self.store.write() as db:
                self._migrate(db)
        with self.store.read() as db:
            table = db.table(TABLE)
            if not table.exists():
                return []
            where = f"[{scoped.GROUP}] in ({', '.join('?' for _ in groups)})"
            args = list(groups)
            if family:
                where, args = where + " and family = ?", args + [family]
            rows = list(table.rows_where(where, args, order_by="rowid"))
        out = []
        for row in rows:
            for name in JSON_FIELDS:
                if isinstance(row.get(name), str):
                    row[name] = json.loads(row[name])
            if not row.get("rows_differing") or not row.get("tactics"):
                continue  # counted nothing: never served as "0 rows differ"
            for name in PRIVATE:
                row.pop(name, None)
            out.append(row)
        return out

    # -- ops -------------------------------------------------------------------------

    async def certify_record(self, m: p.CertifyRecordRequest,
                             peer: Peer) -> p.CertifyRecordReply:
        record = validate(m.record)
        record["recorded_by_uid"] = peer.uid
        record[scoped.GROUP] = scoped.group_of(self.access, peer)
        record_id = await asyncio.get_running_loop().run_in_executor(None, self.record, record)
        return p.CertifyRecordReply(record_id=record_id)

    async def certifications(self, m: p.FamilyFilter, peer: Peer) -> p.CertificationsReply:
        groups = scoped.visible(scoped.group_of(self.access, peer))
        rows = await asyncio.get_running_loop().run_in_executor(None, self.rows, m.family,
                                                                groups)
        return p.CertificationsReply(certifications=rows)

    def ops(self) -> dict[str, Handler]:
        return {"certify_record": self.certify_record, "certifications": self.certifications}
