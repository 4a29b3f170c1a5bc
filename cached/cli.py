"""The ``cached`` command: serve, warm, stats, ls.

Every command takes ``--socket`` (default: $CACHED_SOCKET, else the runtime directory).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from cached_client import Client, KernelRequest
from cached_client.errors import CachedError
from cached_client.paths import default_socket_path
from cached_client.protocol import PROTOCOL_VERSION
from cached_client.transport import Connection


def default_store() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cached"


def _shape(text: str) -> tuple[int, int, int]:
    try:
        m, n, k = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"shape must be M,N,K (three integers), got {text!r}") from None
    if min(m, n, k) < 1:
        raise argparse.ArgumentTypeError(f"shape dimensions must be positive, got {text!r}")
    return m, n, k


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def _option(text: str) -> tuple[str, object]:
    name, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        return name, json.loads(value)
    except ValueError:
        return name, value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cached", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--socket", default=default_socket_path(),
                        help="daemon socket (default: $CACHED_SOCKET or the runtime dir)")

    serve = sub.add_parser("serve", parents=[common], help="run the daemon in the foreground")
    serve.add_argument("--store", type=Path, default=default_store())
    serve.add_argument("--http", type=_address, default=("127.0.0.1", 8377),
                       help="HOST:PORT of the stats endpoint (port 0 picks one)")
    serve.add_argument("--no-http", action="store_true", help="do not serve HTTP")
    serve.add_argument("--workers", type=int, default=None,
                       help="compile workers (default: from cores and memory)")
    serve.add_argument("--job-timeout", type=float, default=300.0, help="seconds per compile")
    serve.add_argument("--serve-only", action="store_true",
                       help="no compiler: serve a store built elsewhere (keys pinned in it)")
    serve.add_argument("--log-level", default="info")
    serve.add_argument("--socket-mode", type=lambda v: int(v, 8), default=0o660,
                       help="file mode of the socket (octal, default 660)")
    for flag, text in (("allow-uid", "uid allowed to connect (repeatable; default: any)"),
                       ("allow-gid", "gid allowed to connect (repeatable; default: any)"),
                       ("publish-uid", "uid allowed to publish (default: root, own uid)"),
                       ("publish-gid", "gid allowed to publish (repeatable)")):
        serve.add_argument(f"--{flag}", type=int, action="append", default=[], help=text)

    warm = sub.add_parser("warm", parents=[common], help="compile a family's tactic space")
    warm.add_argument("--family", required=True)
    warm.add_argument("--arch", required=True)
    warm.add_argument("--shape", type=_shape, action="append", required=True,
                      help="M,N,K (repeatable)")
    warm.add_argument("--sm-count", type=int, default=None)
    warm.add_argument("--option", type=_option, action="append", default=[],
                      help="family plan option NAME=VALUE, e.g. quant=mxfp4, out_dtype=float16")
    warm.add_argument("--limit", type=int, default=None, help="only the first N tactics")
    warm.add_argument("--json", action="store_true")
    warm.add_argument("--timeout", type=float, default=3600.0)

    for name, text in (("stats", "print daemon statistics"), ("ls", "list stored kernels")):
        p = sub.add_parser(name, parents=[common], help=text)
        p.add_argument("--json", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except CachedError as exc:
        print(f"cached {args.command}: {exc.code}: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def cmd_serve(args: argparse.Namespace) -> int:
    from . import log
    from .daemon import Settings, serve
    from .server import Access

    log.setup(args.log_level)
    host, port = args.http
    access = Access(allow_uids=frozenset(args.allow_uid), allow_gids=frozenset(args.allow_gid),
                    publish_uids=frozenset(args.publish_uid or {0, os.getuid()}),
                    publish_gids=frozenset(args.publish_gid))
    serve(Settings(store=args.store, socket=args.socket, http_host=host,
                   http_port=-1 if args.no_http else port, workers=args.workers,
                   job_timeout=args.job_timeout, socket_mode=args.socket_mode, access=access,
                   serve_only=args.serve_only))
    return 0


def cmd_warm(args: argparse.Namespace) -> int:
    started = time.monotonic()
    client = Client(args.socket, timeout=args.timeout)
    requests: list[KernelRequest] = []
    for shape in args.shape:
        requests += client.plan(args.family, shape, args.arch, args.sm_count,
                                dict(args.option), timeout=120)
    requests = list(dict.fromkeys(requests))
    if args.limit is not None:
        requests = requests[: args.limit]
    counts = warm(client.socket_path, requests, args.timeout,
                  progress=sys.stderr.isatty() and not args.json)
    counts["seconds"] = round(time.monotonic() - started, 3)
    if args.json:
        print(json.dumps(counts))
    else:
        print(f"{counts['compiled']} compiled, {counts['cached']} cached, "
              f"{counts['failed']} failed in {counts['seconds']:.1f}s")
        for failure in counts.get("errors", [])[:10]:
            print(f"  failed: {failure}", file=sys.stderr)
    return 1 if counts["failed"] else 0


def warm(socket_path: str, requests: list[KernelRequest], timeout: float,
         progress: bool = False) -> dict:
    """Ask for every request at pre-warm priority on one pipelined connection and wait."""
    deadline = time.monotonic() + timeout
    counts: dict = {"compiled": 0, "cached": 0, "failed": 0, "errors": []}
    with Connection(socket_path, deadline) as conn:
        for i, request in enumerate(requests):
            conn.send({"v": PROTOCOL_VERSION, "id": i, "op": "get", "priority": "prewarm",
                       "request": request.to_wire(), "deadline_ms": int(timeout * 1000)},
                      deadline)
        for done in range(1, len(requests) + 1):
            reply, _ = conn.receive(deadline)
            if reply.get("ok"):
                origin = reply["artifact"]["origin"]
                counts["cached" if origin == "hit" else "compiled"] += 1
            else:
                counts["failed"] += 1
                counts["errors"].append(reply.get("error", {}).get("message", "")[:300])
            if progress:
                bar = "#" * (30 * done // len(requests))
                sys.stderr.write(f"\r[{bar:<30}] {done}/{len(requests)}")
                sys.stderr.flush()
    if progress:
        sys.stderr.write("\n")
    if not counts["errors"]:
        del counts["errors"]
    return counts


def cmd_stats(args: argparse.Namespace) -> int:
    stats = Client(args.socket, timeout=10).stats()
    if args.json:
        print(json.dumps(stats))
        return 0
    for key in ("entries", "bytes", "hits", "misses", "compiles", "failures", "in_flight",
                "queued", "running", "workers_alive", "worker_restarts", "uptime_s"):
        print(f"{key:<16} {stats[key]}")
    for failure in stats["last_failures"]:
        print(f"failure          {failure['family']} {failure['message'][:200]}")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    entries = Client(args.socket, timeout=10).list()
    if args.json:
        print(json.dumps(entries))
        return 0
    for e in sorted(entries, key=lambda e: (e["family"], e["kernel_name"])):
        print(f"{e['key'][:12]}  {e['family']:<20} {e['arch']:<8} {e['size']:>8}  "
              f"{e['hits']:>5} hits  {e['kernel_name']}")
    return 0


COMMANDS = {"serve": cmd_serve, "warm": cmd_warm, "stats": cmd_stats, "ls": cmd_ls}
