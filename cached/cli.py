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


def _shape_nk(text: str) -> tuple[int, int]:
    try:
        n, k = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape must be N,K, got {text!r}") from None
    return n, k


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
    serve.add_argument("--remote", metavar="URL", default=None,
                       help="fleet tier: redis://HOST:PORT/DB, rediss://..., or "
                            "redis+cluster://HOST:PORT for Redis Cluster (docs/fleet.md)")
    serve.add_argument("--remote-signing-key", metavar="FILE", type=Path, default=None,
                       help="Ed25519 private key (PEM) that signs what this node publishes")
    serve.add_argument("--remote-verify-keys", metavar="FILE", type=Path, default=None,
                       help="the fleet's Ed25519 public keys (PEM or base64 lines) entries "
                            "must verify against")
    serve.add_argument("--remote-read-only", action="store_true",
                       help="fetch from the fleet tier but never publish to it (GPU nodes)")
    serve.add_argument("--remote-timeout", type=float, default=2.0,
                       help="seconds per Redis operation before the tier counts as down")
    serve.add_argument("--log-level", default="info")
    serve.add_argument("--socket-mode", type=lambda v: int(v, 8), default=0o660,
                       help="file mode of the socket (octal, default 660)")
    for flag, text in (("allow-uid", "uid allowed to connect (repeatable; default: any)"),
                       ("allow-gid", "gid allowed to connect (repeatable; default: any)"),
                       ("publish-uid", "uid allowed to publish (default: root, own uid)"),
                       ("publish-gid", "gid allowed to publish (repeatable)")):
        serve.add_argument(f"--{flag}", type=int, action="append", default=[], help=text)

    # Configuration and the store budget (cached/config.py: flags > env > file > defaults).
    serve.add_argument("--config", metavar="FILE", default=None,
                       help="TOML configuration (default: $CACHED_CONFIG, /etc/cached/cached.toml)")
    serve.add_argument("--max-bytes", default=None,
                       help="store budget, e.g. 20G (0: none); LRU eviction keeps it")
    serve.add_argument("--max-files", type=int, default=None,
                       help="store budget in blob files, two per kernel (0: none)")
    serve.add_argument("--evict-grace", type=float, default=None,
                       help="seconds an entry just served or stored is safe from eviction")
    serve.add_argument("--drain-timeout", type=float, default=None,
                       help="on SIGTERM, seconds running compilations get to finish")

    warm = sub.add_parser("warm", parents=[common],
                          help="compile a family's tactic space, or a model's manifest")
    warm.add_argument("--manifest", metavar="FILE",
                      help="a pre-warm manifest (a path or a shipped name, e.g. llama-3.1-8b)")
    warm.add_argument("--target", action="append", default=[],
                      help="with --manifest: only this target (repeatable)")
    warm.add_argument("--skip-missing", action="store_true",
                      help="with --manifest: skip builds whose family this daemon lacks")
    warm.add_argument("--plan-only", action="store_true",
                      help="with --manifest: count the kernels, compile nothing")
    warm.add_argument("--family", help="family (required without --manifest)")
    warm.add_argument("--arch", help="target arch (required without --manifest)")
    warm.add_argument("--shape", type=_shape, action="append",
                      help="M,N,K (repeatable; required without --manifest)")
    warm.add_argument("--sm-count", type=int, default=None)
    warm.add_argument("--option", type=_option, action="append", default=[],
                      help="family plan option NAME=VALUE, e.g. quant=mxfp4, out_dtype=float16")
    warm.add_argument("--limit", type=int, default=None, help="only the first N tactics")
    warm.add_argument("--json", action="store_true")
    warm.add_argument("--timeout", type=float, default=3600.0)

    certify = sub.add_parser("certify", parents=[common],
                             help="measure batch invariance on this GPU and record it")
    certify.add_argument("--family", required=True)
    certify.add_argument("--shape", type=_shape_nk, action="append", required=True,
                         help="N,K (repeatable)")
    certify.add_argument("--limit", type=int, default=None,
                         help="certify the first N tactics of the M=2048 plan")
    certify.add_argument("--no-record", action="store_true")
    certify.add_argument("--json", action="store_true")

    for name, text in (("stats", "print daemon statistics"), ("ls", "list stored kernels")):
        p = sub.add_parser(name, parents=[common], help=text)
        p.add_argument("--json", action="store_true")
    export = sub.add_parser("export", parents=[common],
                            help="write stored FlashInfer kernels into FlashInfer's disk cache")
    export.add_argument("--flashinfer-cache", type=Path, default=None, metavar="DIR",
                        help="FlashInfer's FLASHINFER_JIT_DIR (the cached_ops folder); default: "
                             "the current environment's")
    export.add_argument("--family", default=None, help="only this family's artifacts")
    export.add_argument("--json", action="store_true")
    _add_ops_parsers(sub, common)  # gc, verify, config (cached/ops_cli.py)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # which flags were given
    try:
        return COMMANDS[args.command](args)
    except CachedError as exc:
        print(f"cached {args.command}: {exc.code}: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def cmd_serve(args: argparse.Namespace) -> int:
    from . import log
    from .config import ConfigError
    from .daemon import Settings, serve
    from .server import Access

    effective = _apply_config(args)  # flags > env > file > defaults, written onto args
    if effective is None:
        return 2
    log.setup(args.log_level)
    host, port = args.http
    access = Access(allow_uids=frozenset(args.allow_uid), allow_gids=frozenset(args.allow_gid),
                    publish_uids=frozenset(args.publish_uid or {0, os.getuid()}),
                    publish_gids=frozenset(args.publish_gid))
    try:
        serve(Settings(store=args.store, socket=args.socket, http_host=host,
                       http_port=-1 if args.no_http else port, workers=args.workers,
                       job_timeout=args.job_timeout, socket_mode=args.socket_mode,
                       access=access, serve_only=args.serve_only, remote_url=args.remote,
                       remote_signing_key=args.remote_signing_key,
                       remote_verify_keys=args.remote_verify_keys,
                       remote_read_only=args.remote_read_only,
                       remote_timeout=args.remote_timeout, **_ops_settings(args, effective)))
    except ConfigError as exc:  # e.g. a fleet key file (remote.KeyFileError), before binding
        print(f"cached serve: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_warm(args: argparse.Namespace) -> int:
    if args.manifest:
        from .ops_cli import warm_manifest

        return warm_manifest(args)
    if not (args.family and args.arch and args.shape):
        print("cached warm: needs --family, --arch and --shape, or --manifest", file=sys.stderr)
        return 2
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
    return report_warm(counts, args.json)


def report_warm(counts: dict, as_json: bool, label: str = "") -> int:
    """Print a warm-up's counts (one JSON line with --json); exit status 1 if any failed."""
    if as_json:
        print(json.dumps(counts))
    else:
        print(f"{label}{counts['compiled']} compiled, {counts['cached']} cached, "
              f"{counts.get('remote', 0)} from the fleet tier, "
              f"{counts['failed']} failed in {counts['seconds']:.1f}s")
        for failure in counts.get("errors", [])[:10]:
            print(f"  failed: {failure}", file=sys.stderr)
    return 1 if counts["failed"] else 0


def warm(socket_path: str, requests: list[KernelRequest], timeout: float,
         progress: bool = False) -> dict:
    """Ask for every request at pre-warm priority on one pipelined connection and wait."""
    deadline = time.monotonic() + timeout
    counts: dict = {"compiled": 0, "cached": 0, "remote": 0, "failed": 0, "errors": []}
    with Connection(socket_path, deadline) as conn:
        for i, request in enumerate(requests):
            conn.send({"v": PROTOCOL_VERSION, "id": i, "op": "get", "priority": "prewarm",
                       "request": request.to_wire(), "deadline_ms": int(timeout * 1000)},
                      deadline)
        for done in range(1, len(requests) + 1):
            reply, _ = conn.receive(deadline)
            if reply.get("ok"):
                origin = reply["artifact"]["origin"]
                counts[{"hit": "cached", "remote": "remote"}.get(origin, "compiled")] += 1
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


def cmd_certify(args: argparse.Namespace) -> int:
    from cached_client.certify import certify

    records = certify(Client(args.socket, timeout=600), args.family, args.shape, args.limit,
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


def cmd_stats(args: argparse.Namespace) -> int:
    stats = Client(args.socket, timeout=10).stats()
    if args.json:
        print(json.dumps(stats))
        return 0
    for key in ("entries", "bytes", "hits", "misses", "compiles", "failures", "in_flight",
                "queued", "running", "workers_alive", "worker_restarts", "uptime_s"):
        print(f"{key:<16} {stats[key]}")
    for key in ("max_bytes", "evictions", "client_fallbacks"):  # budget and fallbacks
        if key in stats:
            print(f"{key:<16} {stats[key]}")
    tier = stats.get("remote") or {}
    if tier.get("state", "disabled") != "disabled":  # the fleet tier (docs/fleet.md)
        print(f"{'remote':<16} {tier['state']} {tier['url']}"
              f"{' read-only' if tier['read_only'] else ''}: {stats.get('remote_hits', 0)} "
              f"hits, {tier['misses']} misses, {tier['rejected']} rejected, "
              f"{tier['published']} published, {tier['errors']} errors")
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


def cmd_export(args: argparse.Namespace) -> int:
    from .export import default_flashinfer_cache, export

    target = args.flashinfer_cache or default_flashinfer_cache()
    report = export(args.socket, target, args.family)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{report['written']} written, {report['unchanged']} unchanged, "
              f"{report['skipped']} skipped into {report['modules']} module(s) under {target}")
        for reason in report["reasons"][:10]:
            print(f"  skipped: {reason}", file=sys.stderr)
    return 0


COMMANDS = {"serve": cmd_serve, "warm": cmd_warm, "stats": cmd_stats, "ls": cmd_ls,
            "certify": cmd_certify, "export": cmd_export}


def _apply_config(args: argparse.Namespace):
    from .ops_cli import apply_config

    return apply_config(args)


def _ops_settings(args: argparse.Namespace, effective) -> dict:
    from .ops_cli import ops_settings

    return ops_settings(args, effective)


def _ops_command(name: str):
    def run(args: argparse.Namespace) -> int:
        from . import ops_cli

        return getattr(ops_cli, f"cmd_{name}")(args)
    return run


def _add_ops_parsers(sub, common: argparse.ArgumentParser) -> None:
    gc = sub.add_parser("gc", parents=[common], help="evict least recently used entries now")
    verify = sub.add_parser("verify", parents=[common],
                            help="recheck every stored blob against its digest")
    for p in (gc, verify):
        p.add_argument("--store", type=Path, default=None,
                       help="work on this store directly instead of through the daemon")
        p.add_argument("--json", action="store_true")
    gc.add_argument("--max-bytes", default=None, help="budget for this run (default: the "
                    "daemon's, or the configuration's with --store)")
    gc.add_argument("--max-files", type=int, default=None)
    gc.add_argument("--grace", type=float, default=None,
                    help="seconds of recent use that protect an entry (default: configured)")
    gc.add_argument("--config", metavar="FILE", default=None)
    config = sub.add_parser("config", help="print the effective configuration and sources")
    config.add_argument("--config", metavar="FILE", default=None)
    config.add_argument("--json", action="store_true")
    config.add_argument("serve_args", nargs=argparse.REMAINDER,
                        help="serve flags to evaluate (after --)")


COMMANDS.update({name: _ops_command(name) for name in ("gc", "verify", "config")})
