"""The ``cached`` command: one subcommand per module of this package.

``serve`` and ``config`` (serve.py), ``warm`` (warm.py, progress.py), ``stats``, ``ls``,
``gc``, ``verify`` and ``export`` (store.py), ``certify`` (certify.py), ``tune``
(tune.py), ``toolchains`` (toolchains.py); argument types shared by them in argtypes.py.
Every command that talks to a daemon takes ``--socket``. Exit status: 0 done, 1 done with
failures (a kernel failed, a bad entry found), 2 a usage, configuration or daemon error.
Help texts are plain text (argparse prints them as written).
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
import sys

from cached_client.errors import CachedError, DaemonUnavailable
from cached_client.paths import SOCKET_ENV, default_socket_path

from .. import compiler_stack
from ..config import ConfigError
from . import certify, serve, store, toolchains, tune, warm

MODULES = (serve, warm, store, certify, tune, toolchains)

DESCRIPTION = """\
A per-node compilation cache for CuTe-DSL GEMM kernels: one daemon per node compiles
kernels once, stores them and serves them to inference processes over a Unix socket."""

EPILOG = f"""\
Commands that talk to a daemon take --socket PATH (default: ${SOCKET_ENV}, else
cached.sock in $XDG_RUNTIME_DIR/cached or /tmp/cached-$UID). cached COMMAND --help
describes each command.

exit status: 0 done; 1 done with failures (a kernel failed, a bad entry found);
2 a usage, configuration or daemon error."""

START_HINT = """\
  start one:  cached serve                     (in the foreground)
              make serve                       (from a source checkout)
              systemctl start cached.socket    (installed with systemd)
  or point --socket or ${env} at the socket of a running daemon"""


def version_text() -> str:
    """``cached --version``: the daemon's version, then the toolchain it builds with."""
    stack = ", ".join(f"{name} {version}" for name, version in compiler_stack.versions().items())
    return f"cached {compiler_stack.daemon_version()}\ntoolchain: {stack}"


class _Version(argparse.Action):
    """``--version``, read from the installed metadata only when asked for."""

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        print(version_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cached", description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action=_Version, nargs=0,
                        help="print the version of cached and of its toolchain, and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--socket", metavar="PATH", default=default_socket_path(),
                        help=f"the daemon's socket (default: ${SOCKET_ENV}, else the runtime "
                             "directory's cached.sock)")
    for module in MODULES:
        module.add_parsers(sub, common)
    return parser


def unreachable_hint(path: str) -> str | None:
    """Why nothing answers on ``path`` and what to do about it, or None if a daemon does."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(2.0)
        probe.connect(path)
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        if exc.errno in (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTSOCK):
            return (f"no daemon is running on {path} ({why})\n"
                    + START_HINT.replace("${env}", f"${SOCKET_ENV}"))
        if exc.errno == errno.EACCES:
            return (f"cannot connect to {path}: {why}: this user may not use the daemon's "
                    "socket; join its group (cached-clients under systemd: usermod -aG "
                    "cached-clients USER, then log in again)")
        return None
    else:
        return None
    finally:
        probe.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except CachedError as exc:
        hint = None
        if isinstance(exc, DaemonUnavailable) and exc.message.startswith("cannot connect"):
            hint = unreachable_hint(getattr(args, "socket", default_socket_path()))
        if hint:
            print(f"cached {args.command}: {hint}", file=sys.stderr)
        else:
            print(f"cached {args.command}: {exc.code}: {exc.message}", file=sys.stderr)
        return 2
    except ConfigError as exc:  # an offline command on an unusable store, a bad setting
        print(f"cached {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (cached ls | head): not an error to show
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
