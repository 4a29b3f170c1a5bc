"""The operator commands behind ``cached``: configuration for ``serve``, ``config``,
``gc``, ``verify`` and ``warm --manifest`` (cli.py dispatches here)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from cached_client import Client

from . import config as cfg


def _given(args: argparse.Namespace) -> set[str]:
    return cfg.explicit_flags(None, getattr(args, "argv", []))


def apply_config(args: argparse.Namespace) -> cfg.Effective | None:
    """Resolve ``cached serve``'s configuration and write it onto ``args``."""
    given = _given(args)
    try:
        effective = cfg.resolve(args, given, args.config)
    except cfg.ConfigError as exc:
        print(f"cached serve: configuration: {exc}", file=sys.stderr)
        return None
    cfg.apply(effective, args)
    return effective


def ops_settings(args: argparse.Namespace, effective: cfg.Effective) -> dict[str, Any]:
    """The daemon Settings fields this module owns, and how to reload them on SIGHUP."""
    given = _given(args)
    v = effective.values
    return {"max_bytes": v["max_bytes"], "max_files": v["max_files"],
            "evict_grace": v["evict_grace"], "drain_timeout": v["drain_timeout"],
            "config": dict(v), "reload": lambda: cfg.resolve(args, given, args.config)}


def cmd_config(args: argparse.Namespace) -> int:
    from .cli import build_parser

    rest = list(args.serve_args)
    if rest and rest[0] == "--":
        rest = rest[1:]
    serve_args = build_parser().parse_args(["serve", *rest])
    try:
        effective = cfg.resolve(serve_args, cfg.explicit_flags(None, rest),
                                args.config or serve_args.config)
    except cfg.ConfigError as exc:
        print(f"cached config: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"file": str(effective.file) if effective.file else None,
                          "file_source": effective.file_source,
                          "options": effective.as_rows()}))
    else:
        print(cfg.format_table(effective))
    return 0


def _print_json_or(args: argparse.Namespace, report: dict, text: str) -> None:
    print(json.dumps(report) if args.json else text)


def cmd_gc(args: argparse.Namespace) -> int:
    try:
        max_bytes = None if args.max_bytes is None else cfg.parse_size(args.max_bytes)
    except cfg.ConfigError as exc:
        print(f"cached gc: --max-bytes: {exc}", file=sys.stderr)
        return 2
    if args.store is None:
        message: dict[str, Any] = {"op": "gc"}
        if max_bytes is not None:
            message["max_bytes"] = max_bytes
        if args.max_files is not None:
            message["max_files"] = args.max_files
        if args.grace is not None:
            message["grace"] = args.grace
        reply, _ = Client(args.socket, timeout=600).call(message)
        report = {k: v for k, v in reply.items() if k not in ("ok", "id", "v")}
    else:
        from .store import Store

        values = cfg.resolve(config_flag=args.config).values
        store = Store(args.store)
        try:
            limits = {"max_bytes": values["max_bytes"] if max_bytes is None else max_bytes,
                      "max_files": values["max_files"] if args.max_files is None
                      else args.max_files}
            grace = values["evict_grace"] if args.grace is None else args.grace
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
        reply, _ = Client(args.socket, timeout=3600).call({"op": "verify"})
        report = {k: v for k, v in reply.items() if k not in ("ok", "id", "v")}
    else:
        from .store import Store

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


def warm_manifest(args: argparse.Namespace) -> int:
    from . import manifests
    from .cli import report_warm, warm

    started = time.monotonic()
    try:
        manifest = manifests.load(args.manifest)
    except manifests.ManifestError as exc:
        print(f"cached warm: {exc}", file=sys.stderr)
        return 2
    client = Client(args.socket, timeout=args.timeout)
    known = set(client.hello(timeout=30)["families"])
    try:
        groups = manifests.plan(client, manifest, set(args.target) or None,
                                {args.family} if args.family else None, known,
                                args.skip_missing)
    except manifests.ManifestError as exc:
        print(f"cached warm: {exc}", file=sys.stderr)
        return 2
    if args.limit is not None:
        groups = {g: r[: args.limit] for g, r in groups.items()}
    kernels = {f"{family}@{target}": len(r) for (family, target), r in groups.items()}
    requests = list(dict.fromkeys(r for group in groups.values() for r in group))
    summary: dict[str, Any] = {"model": manifest.model, "kernels": kernels,
                               "total": len(requests), "shapes": len(manifest.shapes()),
                               "pending": [p.get("family") for p in manifest.pending]}
    if args.plan_only:
        summary["seconds"] = round(time.monotonic() - started, 3)
        if args.json:
            print(json.dumps(summary))
        else:
            print(f"{manifest.model}: {len(requests)} kernels over {summary['shapes']} shapes")
            for group, count in kernels.items():
                print(f"  {group:<32} {count}")
            for pending in summary["pending"]:
                print(f"  pending (no family yet): {pending}")
        return 0
    counts = warm(client.socket_path, requests, args.timeout,
                  progress=sys.stderr.isatty() and not args.json)
    counts.update(summary, seconds=round(time.monotonic() - started, 3))
    return report_warm(counts, args.json, f"{manifest.model}: ")
