"""Batch-invariance certifications: what ``cached certify`` measured on a device.

A record says, for one family, tactic set and (N, K) on one device, how many output rows
differed between ``x[:M]`` and the first M rows of the M=2048 output (the seeds'
method), per tactic and for the tactic mix an autotuner would choose across M. The
batch-invariant policy may allow a tactic set only with a record of 0 differing rows on
that device (or a family that declares its reduction order M-independent).

Records live in the store's index database, table ``certifications``, read and written
off the event loop. Ops:
``certify_record`` (publish permission) and ``certifications``.
"""

from __future__ import annotations

import asyncio
import json
import time

from cached_client import protocol as p
from cached_client.errors import InvalidArgument

from .. import families
from ..server import Handler, Peer
from ..store.store import Store

TABLE = "certifications"
REQUIRED = {"family": str, "n": int, "k": int, "device": str, "arch": str,
            "tactics": list, "rows_differing": dict}
JSON_FIELDS = ("tactics", "rows_differing", "ms")


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
    clean = {name: record[name] for name in REQUIRED}
    clean["total_rows_differing"] = sum(counts.values())
    clean["ms"] = [m for m in record.get("ms", []) if isinstance(m, int)]
    clean["toolchain"] = str(record.get("toolchain", ""))[:4096]
    clean["checked_at"] = time.time()
    return clean


class Certifications:
    """The certification records of one store."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def record(self, record: dict) -> int:
        row = {k: json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else v
               for k, v in record.items()}
        with self.store.write() as db:
            table = db.table(TABLE)
            table.insert(row, alter=True)
            return int(table.last_pk)

    def rows(self, family: str | None = None) -> list[dict]:
        with self.store.read() as db:
            table = db.table(TABLE)
            if not table.exists():
                return []
            where, args = ("family = ?", [family]) if family else (None, None)
            rows = list(table.rows_where(where, args, order_by="rowid"))
        for row in rows:
            for name in JSON_FIELDS:
                if isinstance(row.get(name), str):
                    row[name] = json.loads(row[name])
        return rows

    # -- ops -------------------------------------------------------------------------

    async def certify_record(self, m: p.CertifyRecordRequest,
                             peer: Peer) -> p.CertifyRecordReply:
        record = validate(m.record)
        record["recorded_by_uid"] = peer.uid
        record_id = await asyncio.get_running_loop().run_in_executor(None, self.record, record)
        return p.CertifyRecordReply(record_id=record_id)

    async def certifications(self, m: p.FamilyFilter, peer: Peer) -> p.CertificationsReply:
        rows = await asyncio.get_running_loop().run_in_executor(None, self.rows, m.family)
        return p.CertificationsReply(certifications=rows)

    def ops(self) -> dict[str, Handler]:
        return {"certify_record": self.certify_record, "certifications": self.certifications}
