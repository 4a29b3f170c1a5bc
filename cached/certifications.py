"""Batch-invariance certifications: what ``cached certify`` measured on a device.

A record says, for one family, tactic set and (N, K) on one device, how many output rows
differed between ``x[:M]`` and the first M rows of the M=2048 output (the seeds'
method), per tactic and for the tactic mix an autotuner would choose across M. The
batch-invariant policy may allow a tactic set only with a record of 0 differing rows on
that device (or a family that declares its reduction order M-independent).

Recording is a publish-level op: only peers on the daemon's publish allowlist.
"""

from __future__ import annotations

import time
from typing import Any

from cached_client.errors import InvalidTactic

from . import families
from .server import Peer, Server
from .store import Store

REQUIRED = {"family": str, "n": int, "k": int, "device": str, "arch": str,
            "tactics": list, "rows_differing": dict}


def validate(record: Any) -> dict:
    if not isinstance(record, dict):
        raise InvalidTactic("record must be an object")
    for name, kind in REQUIRED.items():
        if not isinstance(record.get(name), kind):
            raise InvalidTactic(f"record.{name} must be a {kind.__name__}")
    families.get(record["family"])
    counts = record["rows_differing"]
    if not all(isinstance(v, int) and v >= 0 for v in counts.values()):
        raise InvalidTactic("record.rows_differing values must be counts (integers >= 0)")
    clean = {name: record[name] for name in REQUIRED}
    clean["total_rows_differing"] = sum(counts.values())
    clean["ms"] = [m for m in record.get("ms", []) if isinstance(m, int)]
    clean["toolchain"] = str(record.get("toolchain", ""))
    clean["checked_at"] = time.time()
    return clean


def register(server: Server, store: Store) -> None:
    async def certify_record(m: dict, peer: Peer) -> tuple[dict, bytes | None]:
        record = validate(m.get("record"))
        record["recorded_by_uid"] = peer.uid
        return {"ok": True, "record_id": store.record_certification(record)}, None

    async def certifications(m: dict, peer: Peer) -> tuple[dict, bytes | None]:
        family = m.get("family")
        return {"ok": True, "certifications": store.certifications(
            family if isinstance(family, str) else None)}, None

    server.register("certify_record", certify_record, publish=True)
    server.register("certifications", certifications)
