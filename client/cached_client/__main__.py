"""``python -m cached_client select --op OP --quant Q --arch ARCH [--batch-invariant]
[--backend B] [--json]``: the kernel the batch-invariant policy picks, and why."""

from __future__ import annotations

import argparse
import json
import sys

from .gemm import policy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cached_client")
    sub = parser.add_subparsers(dest="command", required=True)
    sel = sub.add_parser("select", help="which GEMM kernel to use, and why")
    sel.add_argument("--op", required=True, choices=policy.OPS)
    sel.add_argument("--quant", required=True, choices=policy.QUANTS)
    sel.add_argument("--arch", required=True, choices=policy.ARCHES)
    sel.add_argument("--batch-invariant", action="store_true")
    sel.add_argument("--backend", default=None)
    sel.add_argument("--socket", default=None,
                     help="ask this daemon (families, certifications, autotune results)")
    sel.add_argument("--n", type=int, default=None)
    sel.add_argument("--k", type=int, default=None)
    sel.add_argument("--device", default=None, help="device name, e.g. 'NVIDIA B200'")
    sel.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    client = None
    if args.socket:
        from .client import Client

        client = Client(args.socket, timeout=10, fallback=False)
    try:
        selection = policy.select(args.op, args.quant, args.arch, args.batch_invariant,
                                  args.backend, client=client, n=args.n, k=args.k,
                                  device=args.device)
    except ValueError as exc:
        print(f"select: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(selection.to_dict()))
    else:
        print(f"{selection.kernel}: {selection.reason}")
        for warning in selection.warnings:
            print(f"warning: {warning}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
