"""The store commands: ``stats``, ``ls``, ``gc``, ``verify`` and ``export``.

``gc`` and ``verify`` go through the daemon, or work on a store directly with ``--store``
(the daemon stopped)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from cached_client import Client
from cached_client import protocol as p

from .. import config


def add_parsers(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    for name, text, run in (("stats", "print daemon statistics", cmd_stats),
                            ("ls", "list stored kernels", cmd_ls)):
        parser = sub.add_parser(name, parents=[common], help=text)
        parser.add_argument("--json", action="store_true")
        parser.set_defaults(run=run)
    gc = sub.add_parser("gc", parents=[common], help="evict least recently used entries now")
    verify = sub.add_parser("verify", parents=[common],
                            help="recheck every stored blob against its digest")
    for parser in (gc, verify):
        parser.add_argument("--store", type=Path, default=None,
                            help="work on this store directly instead of through the daemon")
        parser.add_argument("--json", action="store_true")
    gc.add_argument("--max-bytes", default=None, help="budget for this run (default: the "
                    "daemon's, or the configuration's with --store)")
    gc.add_argument("--max-files", type=int, default=None)
    gc.add_argument("--grace", type=float, default=None,
                    help="seconds of recent use that protect an entry (default: configured)")
    gc.add_argument("--config", metavar="FILE", default=None)
    gc.set_defaults(run=cmd_gc)
    verify.set_defaults(run=cmd_verify)
    export = sub.add_parser("export", parents=[common],
                            help="write stored FlashInfer kernels into FlashInfer's disk cache")
    export.add_argument("--flashinfer-cache", type=Path, default=None, metavar="DIR",
                        help="FlashInfer's FLASHINFER_JIT_DIR (the cached_ops folder); default: "
                             "the current environment's")
    export.add_argument("--family", default=None, help="only this family's artifacts")
    export.add_argument("--python", default=None, metavar="PYTHON",
                        help="the environment to export for (its interpreter; default: this "
                             "one): its artifacts, with the meta its FlashInfer accepts")
    export.add_argument("--json", action="store_true")
    export.set_defaults(run=cmd_export)


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


def _print_json_or(args: argparse.Namespace, report: dict, text: str) -> None:
    print(json.dumps(report) if args.json else text)


def cmd_gc(args: argparse.Namespace) -> int:
    try:
        max_bytes = None if args.max_bytes is None else config.parse_size(args.max_bytes)
    except config.ConfigError as exc:
        print(f"cached gc: --max-bytes: {exc}", file=sys.stderr)
        return 2
    if args.store is None:
        reply = Client(args.socket, timeout=600).gc(p.GcRequest(
            max_bytes=max_bytes, max_files=args.max_files, grace=args.grace))
        report = reply.to_wire()
    else:
        from ..store import Store

        settings = config.resolve(config_flag=args.config)
        store = Store(args.store)
        try:
            limits = {"max_bytes": settings.max_bytes if max_bytes is None else max_bytes,
                      "max_files": settings.max_files if args.max_files is None
                      else args.max_files}
            grace = settings.evict_grace if args.grace is None else args.grace
            report = {**store.evict(grace=grace, **limits), **limits}
            report["entries"], report["bytes"] = store.totals()
        finally:
            store.close()
    budget = (f"{report['max_bytes']} bytes" if report.get("max_bytes") else "no byte budget")
    _print_json_or(args, report,
                   f"evicted {report['evicted']} entries ({report['freed_bytes']} bytes); "
                   f"store: {report['entries']} entries, {report['bytes']} bytes ({budget}); "
                   f"{report['blocked']} skipped as in use")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    if args.store is None:
        report = dataclasses.asdict(Client(args.socket, timeout=3600).verify())
    else:
        from ..store import Store

        if not (Path(args.store) / "index.sqlite").exists():
            print(f"cached verify: no store at {args.store}", file=sys.stderr)
            return 2
        store = Store(args.store)
        try:
            report = store.verify()
        finally:
            store.close()
    text = [f"{report['verified']}/{report['checked']} entries verified ({report['bytes']} bytes), "
            f"{len(report['bad'])} bad (dropped), {report['orphan_blobs']} unreferenced blobs, "
            f"{report['tmp_entries']} temporaries, in {report['seconds']}s"]
    text += [f"  bad: {b['key'][:16]} {b['family']}: {b['reason']}" for b in report["bad"]]
    _print_json_or(args, report, "\n".join(text))
    return 1 if report["bad"] else 0


def cmd_export(args: argparse.Namespace) -> int:
    from ..export import ExportError, export

    try:
        report = export(args.socket, args.flashinfer_cache, args.family, args.python)
    except ExportError as exc:
        print(f"cached export: {exc}", file=sys.stderr)
        return 2
    target = report["target"]
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{report['written']} written, {report['unchanged']} unchanged, "
              f"{report['skipped']} skipped into {report['modules']} module(s) under {target}")
        for reason in report["reasons"][:10]:
            print(f"  skipped: {reason}", file=sys.stderr)
    return 0
