"""Cost of Store.evict on a large index (no daemon, no real blobs): rows are written
straight into the index, the store is reopened, then evict is timed (a) within budget
(what every publish pays) and (b) taking one entry per call.

    PYTHONPATH=.:client python bench/evict_cost.py [--rows 20000] [--calls 100]
"""

from __future__ import annotations

import argparse
import hashlib
import sqlite3
import tempfile
import time
from pathlib import Path

from cached.store.rows import COLUMNS
from cached.store.store import Budget, Store


def _hex(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def fill(root: Path, rows: int) -> None:
    Store(root).close()
    db = sqlite3.connect(root / "index.sqlite")
    names = list(COLUMNS)
    values = []
    for i in range(rows):
        row = {"key": _hex(f"k{i}"), "family": "f", "kernel_name": "k", "symbol": "s",
               "params": "{}", "arch": "sm_90a", "sm_count": 132, "max_active_clusters": 132,
               "toolchain": "t", "source_sha256": "s", "object_sha256": _hex(f"o{i}"),
               "object_size": 600, "library_sha256": _hex(f"l{i}"), "library_size": 400,
               "size": 1000, "compile_seconds": 1.0, "created": 1.0,
               "last_used": 1_000_000.0 + (i * 7919) % rows, "hits": 0, "meta": "{}",
               "kind": "kernel", "files": ""}
        values.append([row[n] for n in names])
    db.executemany(f"INSERT INTO entries ({', '.join(names)}) VALUES "
                   f"({', '.join('?' * len(names))})", values)
    db.commit()
    db.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--calls", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        fill(root, args.rows)
        t0 = time.perf_counter()
        store = Store(root, Budget(max_bytes=args.rows * 1000, grace=0.0))
        opened = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(args.calls):
            assert store.evict()["evicted"] == 0
        within = (time.perf_counter() - t0) / args.calls
        t0 = time.perf_counter()
        for i in range(args.calls):
            report = store.evict(max_bytes=(args.rows - 1 - i) * 1000, grace=0.0)
            assert report["evicted"] == 1, report
        one = (time.perf_counter() - t0) / args.calls
        assert store.totals() == (args.rows - args.calls, (args.rows - args.calls) * 1000)
        store.close()
    print(f"rows {args.rows}: open {opened * 1e3:.1f} ms; evict within budget "
          f"{within * 1e6:.0f} us/call; evict one entry {one * 1e6:.0f} us/call "
          f"({args.calls} calls each)")


if __name__ == "__main__":
    main()
