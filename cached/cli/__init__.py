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
from cached_client.paths import SOCKET_ENV, SYSTEM_SOCKET, socket_candidates, user_socket_path

from cached import config
from cached.toolchain import compiler_stack

from ..config import ConfigError
from . import certify, serve, store, toolchains, tune, warm

MODULES = (serve, warm, store, certify, tune, toolchains)

DESCRIPTION = """\
A per-node compilation cache for CuTe-DSL GEMM kernels: one daemon per node compiles
kernels once, stores them and serves them to inference processes over a Unix socket."""

EPILOG = f"""\
Commands that talk to a daemon take --socket PATH (default: ${SOCKET_ENV}, else the first
that answers of cached.sock in $XDG_RUNTIME_DIR/cached (or /tmp/cached-$UID) and
{SYSTEM_SOCKET}, the systemd unit's). cached COMMAND --help describes each command.

exit status: 0 done; 1 done with failures (a kernel failed, a bad entry found);
2 a usage, configuration or daemon error."""

UNIT_DIRS = ("/etc/systemd/system", "/usr/lib/systemd/system", "/lib/systemd/system")
"""Where an installed cached.socket unit would be (deploy/, docs/operations.md)."""


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
    common.add_argument("--socket", metavar="PATH", default=None,
                        help=f"the daemon's socket (default: ${SOCKET_ENV}, else the first "
                             f"that answers of {user_socket_path()} and {SYSTEM_SOCKET})")
    for module in MODULES:
        module.add_parsers(sub, common)
    return parser


OFFLINE = ("gc", "verify")
"""Commands that also work on a store no daemon serves (``--store DIR``)."""


def offline_hint(command: str) -> str:
    """How to run ``command`` on the store itself, naming the store a daemon started here
    would use."""
    try:
        store = config.resolve(config_flag=None).store
    except ConfigError:
        store = "DIR"
    return (f"  or, with no daemon serving it, on the store itself: cached {command} --store "
            f"{store}")


def _probe(path: str) -> OSError | None:
    """How connecting to ``path`` fails, or None when something accepts."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(2.0)
        probe.connect(path)
    except OSError as exc:
        return exc
    finally:
        probe.close()
    return None


def unreachable_hint(named: str | None) -> str | None:
    """Why no daemon answers, naming every socket tried (``named``: the --socket given;
    None: ${SOCKET_ENV} or the default sockets), and the fix that fits; None when a socket
    accepts (the error is then the daemon's own)."""
    env = os.environ.get(SOCKET_ENV)
    tried = [named] if named else list(socket_candidates())
    failed = [(path, _probe(path)) for path in tried]
    if any(exc is None for _, exc in failed):
        return None
    codes = {exc.errno for _, exc in failed if exc is not None}
    if not codes <= {errno.ENOENT, errno.ECONNREFUSED, errno.ENOTSOCK, errno.EACCES}:
        return None
    lines = [f"cannot connect to {path}: {exc.strerror}: this user may not use the daemon's "
             "socket" if exc.errno == errno.EACCES else
             f"no daemon is running on {path} ({exc.strerror or type(exc).__name__})"
             for path, exc in failed if exc is not None]
    if errno.EACCES in codes:
        lines.append("  join the daemon's group (cached-clients under systemd: usermod -aG "
                     "cached-clients USER, then log in again)")
        return "\n".join(lines)
    unit = any(os.path.exists(os.path.join(d, "cached.socket")) for d in UNIT_DIRS)
    fixes: list[tuple[str, str]] = []
    for path, exc in failed:
        assert exc is not None
        if path == SYSTEM_SOCKET:
            if unit:
                fixes.append(("systemctl enable --now cached.socket", "the installed unit"))
            continue
        flag = "" if path == user_socket_path() and not named and not env else \
            f" --socket {path}"
        fixes.append((f"cached serve{flag}", "its daemon stopped; in the foreground"
                      if exc.errno == errno.ECONNREFUSED else "in the foreground"))
        if not flag:
            fixes.append(("make serve", "from a source checkout"))
    width = max(len(cmd) for cmd, _ in fixes) + 3
    lines.append("  start one:  " + "\n              ".join(
        f"{cmd:<{width}}({why})" for cmd, why in fixes))
    if named or env:
        lines.append(f"  or {'drop --socket' if named else 'unset ' + SOCKET_ENV} to use the "
                     f"default sockets ({user_socket_path()}, then {SYSTEM_SOCKET})")
    else:
        lines.append(f"  or point --socket or ${SOCKET_ENV} at the socket of a running daemon")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except CachedError as exc:
        hint = None
        if isinstance(exc, DaemonUnavailable) and exc.message.startswith("cannot connect"):
            hint = unreachable_hint(getattr(args, "socket", None))
        if hint and args.command in OFFLINE:
            hint += "\n" + offline_hint(args.command)
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
