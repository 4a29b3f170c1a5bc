"""The store commands: ``stats``, ``ls``, ``gc``, ``verify`` and ``export``.

``gc`` and ``verify`` go through the daemon, or work on a store directly with ``--store``
(refused while a daemon serves it: cached/store/lock.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Collection
from pathlib import Path

from cached_client import Client
from cached_client import protocol as p

from cached import config
from cached.toolchain import compiler_stack

from ..stats import duration_text, time_text
from ..store import lock as storelock
from ..view.snapshot import hit_ratio, mean_compile_s
from . import argtypes

THROUGH_THE_DAEMON = ("run cached {} without --store (through the daemon, with --socket), "
                      "or stop the daemon first")


def add_parsers(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    stats = sub.add_parser("stats", parents=[common], help="print daemon statistics",
                           description="Hits and misses, compilations, workers, the store "
                           "against its budget, where the daemon keeps things, its version "
                           "and uptime, and one row per family. Counts run from the daemon's "
                           "start or the last --zero.")
    stats.add_argument("--json", action="store_true",
                       help="print the daemon's statistics as one JSON object")
    stats.add_argument("--zero", action="store_true",
                       help="print the statistics, then start their counts from zero "
                            "(needs publish rights; /metrics counters go on)")
    stats.set_defaults(run=cmd_stats)
    ls = sub.add_parser("ls", parents=[common], help="list stored kernels",
                        description="One row per stored kernel, by family and kernel name.")
    ls.add_argument("--family", metavar="NAME", help="only this family's kernels")
    ls.add_argument("--arch", metavar="ARCH", help="only kernels for this arch, e.g. sm_100a")
    ls.add_argument("--built-with", metavar="WHICH",
                    help="only kernels built with: current (the daemon's toolchain), other "
                         "(any other: left from an upgrade), a digest prefix as ls and stats "
                         "show it, or text in the toolchain, e.g. nvidia-cutlass-dsl==4.8.1")
    ls.add_argument("--json", action="store_true",
                    help="print a JSON list of the rows, params as objects")
    ls.set_defaults(run=cmd_ls)
    gc = sub.add_parser("gc", parents=[common], help="evict least recently used entries now",
                        description="Evict least recently used entries until the store is "
                        "under its budget (the daemon's, or the one given here), sparing "
                        "entries used within the grace period and those in use. Goes "
                        "through the running daemon, or with --store works on a store no "
                        "daemon serves.")
    verify = sub.add_parser("verify", parents=[common],
                            help="recheck every stored blob against its digest",
                            description="Read every stored blob, check it against the digest "
                            "its index row records, and drop the entries that fail (the next "
                            "request compiles them again); report unreferenced blobs and "
                            "temporaries. Goes through the running daemon, or with --store "
                            "works on a store no daemon serves.")
    for parser in (gc, verify):
        parser.add_argument("--store", type=Path, default=None, metavar="DIR",
                            help="work on this store directly instead of through the daemon "
                                 "(refused while a daemon serves it)")
        parser.add_argument("--json", action="store_true",
                            help="print the report as one JSON object on stdout")
    gc.add_argument("--max-bytes", type=argtypes.size, default=None, metavar="SIZE",
                    help="budget for this run, e.g. 500MB or 2GiB (default: the daemon's, or "
                         "the configuration's with --store)")
    gc.add_argument("--max-files", type=argtypes.count(0), default=None, metavar="N",
                    help="blob-file budget for this run, two per entry (default: configured)")
    gc.add_argument("--grace", type=argtypes.seconds(), default=None, metavar="SECONDS",
                    help="seconds of recent use that protect an entry (default: configured)")
    gc.add_argument("--config", metavar="FILE", default=None,
                    help="with --store: the TOML configuration whose budget applies")
    gc.set_defaults(run=cmd_gc)
    verify.set_defaults(run=cmd_verify)
    export = sub.add_parser("export", parents=[common],
                            help="write stored FlashInfer kernels into FlashInfer's disk cache",
                            description="Copy the daemon's verified FlashInfer kernels into "
                            "an environment's FlashInfer JIT cache directory, with the meta "
                            "its FlashInfer accepts, so that processes without the client "
                            "find them there.")
    export.add_argument("--flashinfer-cache", type=Path, default=None, metavar="DIR",
                        help="FlashInfer's FLASHINFER_JIT_DIR (the cached_ops folder); default: "
                             "the current environment's")
    export.add_argument("--family", metavar="NAME", default=None,
                        help="only this family's artifacts")
    export.add_argument("--python", default=None, metavar="PYTHON",
                        help="the environment to export for (its interpreter; default: this "
                             "one): its artifacts, with the meta its FlashInfer accepts")
    export.add_argument("--json", action="store_true",
                            help="print the report as one JSON object on stdout")
    export.set_defaults(run=cmd_export)


def cmd_stats(args: argparse.Namespace) -> int:
    client = Client(args.socket, timeout=10)
    zeroed_at = None
    if args.zero:
        reply = client.zero_stats()
        stats, zeroed_at = reply.stats, reply.zeroed_at
    else:
        stats = client.stats()
    if args.json:
        print(json.dumps(stats))
    else:
        print(format_stats(stats))
    if zeroed_at is not None:
        print(f"Statistics zeroed at {_when(zeroed_at)}", file=sys.stderr if args.json
              else sys.stdout)
    return 0


def _percent(part: float, whole: float) -> str:
    return f"({100 * part / whole:.2f}%)" if whole else ""


def _when(unix: float) -> str:
    return time_text(unix)


def _ms(seconds: float | None) -> str:
    """Seconds as milliseconds (``-`` for none yet)."""
    return "-" if seconds is None else f"{1000 * seconds:.3f} ms"


def columns(rows: list[tuple[str, ...]], right: Collection[int] = ()) -> list[str]:
    """Lines of ``rows`` (a header is a row like the others) in aligned columns two spaces
    apart, those in ``right`` right-aligned: tabulate's plain layout, cells as given
    (imported here: a command that prints no table runs without the daemon's dependencies)."""
    from tabulate import tabulate

    align = ["right" if i in right else "left" for i in range(len(rows[0]))]
    text = tabulate(rows, tablefmt="plain", disable_numparse=True, colalign=align)
    return [line.rstrip() for line in text.splitlines()]


def format_stats(s: dict) -> str:
    """``cached stats``: ccache -s's layout, from one statistics object (stats --json: the
    daemon's snapshot as the wire has it, :meth:`DaemonSnapshot.to_wire`)."""
    requests = s["hits"] + s["misses"]
    width = len(str(requests))
    out: list[tuple[str, str]] = [
        ("Serving requests", str(requests)),
        ("  Hits", f"{s['hits']:>{width}} / {requests} {_percent(s['hits'], requests)}"),
        ("  Misses", f"{s['misses']:>{width}} / {requests} "
                     f"{_percent(s['misses'], requests)}"),
    ]
    if s.get("remote_hits"):
        out.append(("    From the fleet tier", str(s["remote_hits"])))
    out.append(("  Mean latency", f"hit {_ms(s.get('hit_seconds_mean'))}, miss until served "
                                  f"{_ms(s.get('miss_seconds_mean'))}"))
    prewarm = s.get("prewarm_hits", 0) + s.get("prewarm_misses", 0)
    out.append(("Pre-warm requests", f"{prewarm} ({s.get('prewarm_hits', 0)} stored, "
                                     f"{s.get('prewarm_misses', 0)} compiled; not in the "
                                     "hits and misses above)"))
    compiles = s["compiles"]
    mean = f", {s.get('compile_seconds', 0) / compiles:.2f} s mean" if compiles else ""
    out += [
        ("Compilations", f"{compiles} stored, {s['failures']} failed{mean}"
                         + (f", {s['persist_failures']} served unstored (store full)"
                            if s.get("persist_failures") else "")),
        ("Queue", f"{s['queued']} queued, {s['running']} compiling, {s['in_flight']} in flight"),
        ("Workers", f"{s.get('workers_ready', 0)}/{s.get('workers', 0)} ready, "
                    f"{s.get('workers_idle', 0)} idle, {s['worker_restarts']} restarts"
                    + (" (serve-only: no compiler)" if s.get("serve_only") else "")),
        *[("  Broken", t["broken"]) for t in s.get("toolchains", []) if t.get("broken")],
        ("Store", ""),
    ]
    max_bytes = s.get("max_bytes") or 0
    size = config.size_text(s["bytes"])
    if max_bytes:
        size += f" / {config.size_text(max_bytes)} {_percent(s['bytes'], max_bytes)}"
        size += " OVER BUDGET" if s.get("over_budget") else ""
    else:
        size += " (no budget)"
    entries = str(s["entries"])
    if s.get("max_files"):
        limit = s["max_files"] // 2
        entries += f" / {limit} {_percent(s['entries'], limit)}"
    out += [("  Size", size), ("  Entries", entries),
            ("  Evictions", f"{s.get('evictions', 0)} "
                            f"({config.size_text(s.get('evicted_bytes', 0))} freed)")]
    tier = s.get("remote") or {}
    if tier.get("state", "disabled") != "disabled":  # the fleet tier (docs/fleet.md)
        out.append(("Fleet tier", f"{tier['state']} {tier['url']}"
                    f"{' read-only' if tier['read_only'] else ''}: {tier['hits']} hits, "
                    f"{tier['misses']} misses, {tier['rejected']} rejected, "
                    f"{tier['published']} published, {tier['errors']} errors"))
    errors = ", ".join(f"{code} {n}" for code, n in sorted(s.get("errors", {}).items()) if n)
    out += [("Client fallbacks", str(s.get("client_fallbacks", 0))),
            ("Errors", errors or "none"),
            ("Location", ""), ("  Store", str(s.get("store", ""))),
            ("  Socket", str(s.get("socket", ""))),
            ("  HTTP", s.get("http") or "off")]
    versions = s.get("versions") or {}
    ordered = sorted(versions, key=lambda name: (name != "python", name))  # python first
    out += [("Version", f"cached {s.get('version', 'unknown')}"),
            ("Toolchain", ", ".join(f"{k} {versions[k]}" for k in ordered)
             + f" (digest {s['toolchain']})")]
    started = s.get("started", time.time() - s["uptime_s"])
    state = "draining" if s.get("draining") else "serving"
    out.append(("Uptime", f"{duration_text(s['uptime_s'])} (since {_when(started)}), "
                          f"{state}"))
    zeroed = s.get("stats_zeroed_at")
    out.append(("Counting since", f"zeroed {_when(zeroed)}" if zeroed else "start"))
    label = max(len(k) for k, _ in out) + 2
    lines = [f"{k + ':' if v else k + ':':<{label}}{v}".rstrip() for k, v in out]
    lines += ["", *_family_table(s.get("families", {}))]
    failures = s.get("last_failures", [])
    if failures:
        lines += ["", f"Last compile failures ({len(failures)} kept, newest first):"]
        for f in list(reversed(failures))[:10]:
            message = " ".join(str(f.get("message", "")).split())[:200]
            lines.append(f"  {_when(f.get('time', 0))}  {f.get('family', '')} "
                         f"{str(f.get('key', ''))[:12]}: {message}")
    return "\n".join(lines)


def _family_table(families: dict) -> list[str]:
    rows = [("Family", "Hits", "Misses", "Hit %", "Compiled", "Failed", "Mean s",
             "Written back", "Avoided", "Served", "Fallbacks")]
    for name, c in sorted(families.items()):
        hits, misses, compiles = c.get("hits", 0), c.get("misses", 0), c.get("compiles", 0)
        ratio, compile_s = hit_ratio(hits, misses), mean_compile_s(c)
        rows.append((name, str(hits), str(misses),
                     "-" if ratio is None else f"{100 * ratio:.2f}%", str(compiles),
                     str(c.get("failures", 0)),
                     "-" if compile_s is None else f"{compile_s:.2f}",
                     str(c.get("published", 0)), str(c.get("compiles_avoided", 0)),
                     config.size_text(c.get("bytes_served", 0)),
                     str(c.get("client_fallbacks", 0))))
    return columns(rows, right=set(range(1, 11)))


def cmd_ls(args: argparse.Namespace) -> int:
    client = Client(args.socket, timeout=10)
    entries = client.list()
    current = None
    if args.built_with in ("current", "other"):
        current = client.stats()["toolchain"]
    rows = []
    for e in entries:
        digest = compiler_stack.fingerprint_digest(e["toolchain"]) if "toolchain" in e else ""
        if args.family and e["family"] != args.family or args.arch and e["arch"] != args.arch:
            continue
        if args.built_with and not _toolchain_matches(args.built_with, e.get("toolchain", ""),
                                                      digest, current):
            continue
        params = e["params"]
        rows.append({**e, "params": json.loads(params) if isinstance(params, str) else params})
    rows.sort(key=lambda e: (e["family"], e["kernel_name"]))
    if args.json:
        print(json.dumps(rows))
        return 0
    table = [("KEY", "FAMILY", "ARCH", "SIZE", "HITS", "LAST USED", "TOOLCHAIN", "KERNEL")]
    for e in rows:
        table.append((e["key"][:12], e["family"], e["arch"], config.size_text(e["size"]),
                      str(e["hits"]), _when(e["last_used"])[:16] if e.get("last_used") else "-",
                      compiler_stack.fingerprint_digest(e["toolchain"])[:8] if e.get("toolchain")
                      else "-", e["kernel_name"]))
    print("\n".join(columns(table, right={3, 4})))
    total = sum(e["size"] for e in rows)
    print(f"{len(rows)} kernel{'s' if len(rows) != 1 else ''}, {config.size_text(total)}"
          + (f" (of {len(entries)} stored)" if len(rows) != len(entries) else ""))
    return 0


def _toolchain_matches(which: str, fingerprint: str, digest: str, current: str | None) -> bool:
    if which == "current":
        return digest == current
    if which == "other":
        return digest != current
    return digest.startswith(which) or which in fingerprint


def _print_json_or(args: argparse.Namespace, report: dict, text: str) -> None:
    print(json.dumps(report) if args.json else text)


def cmd_gc(args: argparse.Namespace) -> int:
    if args.store is None:
        reply = Client(args.socket, timeout=600).gc(p.GcRequest(
            max_bytes=args.max_bytes, max_files=args.max_files, grace=args.grace))
        report = reply.to_wire()
    else:
        from .. import log
        from ..store.store import Store

        log.setup_command("gc")
        settings = config.resolve(config_flag=args.config)
        lock = storelock.take(args.store, "gc", hint=THROUGH_THE_DAEMON.format("gc"))
        store = Store(args.store)
        try:
            limits = {"max_bytes": settings.max_bytes if args.max_bytes is None
                      else args.max_bytes,
                      "max_files": settings.max_files if args.max_files is None
                      else args.max_files}
            grace = settings.evict_grace if args.grace is None else args.grace
            report = {**store.evict(grace=grace, **limits), **limits}
            report["entries"], report["bytes"] = store.totals()
        finally:
            store.close()
            lock.release()
    budget = (f"of a {config.size_text(report['max_bytes'])} budget"
              if report.get("max_bytes") else "no byte budget")
    _print_json_or(args, report,
                   f"evicted {report['evicted']} entries "
                   f"({config.size_text(report['freed_bytes'])}); store: {report['entries']} "
                   f"entries, {config.size_text(report['bytes'])} ({budget}); "
                   f"{report['blocked']} skipped as in use")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    if args.store is None:
        report = dataclasses.asdict(Client(args.socket, timeout=3600).verify())
    else:
        from .. import log
        from ..store.store import Store

        log.setup_command("verify")
        if not (Path(args.store) / "index.sqlite").exists():
            print(f"cached verify: no store at {args.store}", file=sys.stderr)
            return 2
        lock = storelock.take(args.store, "verify", hint=THROUGH_THE_DAEMON.format("verify"))
        store = Store(args.store)
        try:
            report = store.verify()
        finally:
            store.close()
            lock.release()
    text = [f"{report['verified']}/{report['checked']} entries verified "
            f"({config.size_text(report['bytes'])}), "
            f"{len(report['bad'])} bad (dropped), {report['orphan_blobs']} unreferenced blobs, "
            f"{report['tmp_entries']} temporaries, in {report['seconds']}s"]
    text += [f"  bad: {b['key'][:16]} {b['family']}: {b['reason']}" for b in report["bad"]]
    _print_json_or(args, report, "\n".join(text))
    return 1 if report["bad"] else 0


def cmd_export(args: argparse.Namespace) -> int:
    from ..store.export import ExportError, export

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
