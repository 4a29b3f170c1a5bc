"""``python -m cached_client select --op OP --quant Q --arch ARCH [--batch-invariant]
[--backend B] [--n N --k K --device NAME] [--socket PATH | --no-daemon] [--json]``: the
kernel the batch-invariant policy picks, and why, asking the daemon a vLLM process of this
environment would ask ($CACHED_SOCKET, else the default sockets: cached_client.paths)."""

from __future__ import annotations

import argparse
import json
import sys

from . import paths
from .gemm import policy


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cached_client",
                                     description="The thin client's own commands.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sel = sub.add_parser(
        "select", help="which GEMM kernel to use, and why",
        description="Which GEMM kernel the policy picks (what the vLLM plugin would use), "
                    "and why; the daemon is asked which families, certifications and "
                    "autotune results it has.")
    sel.add_argument("--op", required=True, choices=policy.OPS,
                     help="the GEMM: a linear layer or a batched matmul")
    sel.add_argument("--quant", required=True, choices=policy.QUANTS,
                     help="the quantization of the weights (and activations)")
    sel.add_argument("--arch", required=True, choices=policy.ARCHES,
                     help="the GPU architecture, e.g. sm_90a for H100/H200")
    sel.add_argument("--batch-invariant", action="store_true",
                     help="as under VLLM_BATCH_INVARIANT=1: one reduction order for every M")
    sel.add_argument("--backend", default=None, metavar="NAME",
                     help="the backend asked for (e.g. cutlass, cublas, auto; default: none)")
    where = sel.add_mutually_exclusive_group()
    where.add_argument("--socket", default=None, metavar="PATH",
                       help=f"ask the daemon on this socket (default: ${paths.SOCKET_ENV}, "
                            f"else the first that answers of {paths.user_socket_path()} and "
                            f"{paths.SYSTEM_SOCKET})")
    where.add_argument("--no-daemon", action="store_true",
                       help="ask no daemon: the answer of a process without one")
    sel.add_argument("--n", type=int, default=None, metavar="N",
                     help="the weight's output features (with --k and --device: the node's "
                          "shared autotune results and certifications for that shape)")
    sel.add_argument("--k", type=int, default=None, metavar="K",
                     help="the weight's input features")
    sel.add_argument("--device", default=None, metavar="NAME",
                     help="the device name, e.g. 'NVIDIA H200'")
    sel.add_argument("--json", action="store_true",
                     help="print the selection as one JSON object")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    client = None
    if not args.no_daemon:
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
