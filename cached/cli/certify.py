"""``cached certify``: measure batch invariance of a family on this node's GPU and record
it in the daemon (cached_client.gemm.certify does the measuring)."""

from __future__ import annotations

import argparse
import json
import sys

from cached_client import Client

from . import argtypes, gpu


def _shape_nk(text: str) -> tuple[int, int]:
    try:
        n, k = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a weight shape is N,K, got {text!r}") from None
    if min(n, k) < 1:
        raise argparse.ArgumentTypeError(f"shape dimensions must be positive, got {text!r}")
    return n, k


def add_parsers(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    certify = sub.add_parser("certify", parents=[common],
                             help="measure batch invariance on this GPU and record it",
                             description="Run a family's kernels (fetched from the daemon) "
                             "on this node's GPU for some weight shapes, count the rows that "
                             "differ between batch sizes, tactics and the autotuner's mix, "
                             "and record the result in the daemon. Needs a GPU.")
    certify.add_argument("--family", required=True, metavar="NAME",
                         help="the family to certify, e.g. cached.hopper_fp8")
    certify.add_argument("--weight", type=_shape_nk, action="append", required=True,
                         metavar="N,K", help="weight shape N,K (repeatable); every M the "
                         "measurement needs is run against it")
    certify.add_argument("--limit", type=argtypes.count(), default=None, metavar="N",
                         help="certify the first N tactics of the M=2048 plan")
    certify.add_argument("--no-record", action="store_true",
                         help="measure only; do not record the result in the daemon")
    certify.add_argument("--json", action="store_true",
                         help="print one JSON object per shape on stdout")
    certify.set_defaults(run=cmd_certify)


def cmd_certify(args: argparse.Namespace) -> int:
    why = gpu.why_not("certify")
    if why:
        print(why, file=sys.stderr)
        return 2
    from cached_client.gemm.certify import certify

    records = certify(Client(args.socket, timeout=600), args.family, args.weight, args.limit,
                      record=not args.no_record)
    for rec in records:
        if args.json:
            print(json.dumps(rec))
            continue
        counts = rec["rows_differing"]
        print(f"{rec['family']} {rec['n']}x{rec['k']} on {rec['device']}: "
              f"{len(rec['tactics'])} tactics, differing rows: "
              f"per-tactic {sum(v for t, v in counts.items() if t not in ('mix', 'cross_tactic'))}"
              f", autotuner mix {counts['mix']}, cross-tactic {counts['cross_tactic']}")
    return 1 if any(sum(r["rows_differing"].values()) for r in records) else 0
