"""The ``cached`` command: one subcommand per module of this package.

``serve`` and ``config`` (serve.py), ``warm`` (warm.py: a family's tactic space or a model's
manifest), ``stats``, ``ls``, ``gc``, ``verify`` and ``export`` (store.py), ``certify``
(certify.py), ``toolchains`` (toolchains.py). Every command that talks to a daemon takes
``--socket`` (default: $CACHED_SOCKET, else the runtime directory). Exit status: 0 done, 1
done with failures (a kernel failed, a bad entry found), 2 a usage, configuration or daemon
error.
"""

from __future__ import annotations

import argparse
import sys

from cached_client.errors import CachedError
from cached_client.paths import default_socket_path

from . import certify, serve, store, toolchains, warm

MODULES = (serve, warm, store, certify, toolchains)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cached", description="A per-node compilation cache for CuTe-DSL GEMM kernels.")
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--socket", default=default_socket_path(),
                        help="daemon socket (default: $CACHED_SOCKET or the runtime dir)")
    for module in MODULES:
        module.add_parsers(sub, common)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except CachedError as exc:
        print(f"cached {args.command}: {exc.code}: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
