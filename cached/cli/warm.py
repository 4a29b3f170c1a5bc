"""``cached warm``: compile a family's tactic space for some shapes, or a model's manifest,
at pre-warm priority (waiting clients go first). For the daemon's default toolchain, or with
``--toolchain NAME`` for that registered environment (its identity, as its clients state it)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from cached_client import Client, KernelRequest
from cached_client import protocol as p
from cached_client.errors import InvalidArgument
from cached_client.transport import Connection

from .. import manifests


def _shape(text: str) -> tuple[int, int, int]:
    try:
        m, n, k = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"shape must be M,N,K (three integers), got {text!r}") from None
    if min(m, n, k) < 1:
        raise argparse.ArgumentTypeError(f"shape dimensions must be positive, got {text!r}")
    return m, n, k


def _option(text: str) -> tuple[str, object]:
    name, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        return name, json.loads(value)
    except ValueError:
        return name, value


def add_parsers(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
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
    warm.add_argument("--toolchain", metavar="NAME", default=None,
                      help="compile for this registered toolchain (cached toolchains); "
                           "default: the daemon's default toolchain")
    warm.set_defaults(run=cmd_warm)


def client_for(args: argparse.Namespace) -> Client:
    """A client stating the identity of ``--toolchain`` (as that environment's own clients
    state it), or none (the daemon's default toolchain)."""
    client = Client(args.socket, timeout=args.timeout, identity=False)
    if args.toolchain:
        found = [t for t in client.hello(timeout=30).toolchains if t["name"] == args.toolchain]
        if not found:
            raise InvalidArgument(f"the daemon has no toolchain {args.toolchain!r} "
                                  "(cached toolchains lists them)")
        t = found[0]
        client.identity = p.Identity(toolchain=t["fingerprint"], sources=t["sources"],
                                     runtime=t["runtime"])
    return client


def cmd_warm(args: argparse.Namespace) -> int:
    if args.manifest:
        return warm_manifest(args)
    if not (args.family and args.arch and args.shape):
        print("cached warm: needs --family, --arch and --shape, or --manifest", file=sys.stderr)
        return 2
    started = time.monotonic()
    client = client_for(args)
    requests: list[KernelRequest] = []
    for shape in args.shape:
        requests += client.plan(args.family, shape, args.arch, args.sm_count,
                                dict(args.option), timeout=120)
    requests = list(dict.fromkeys(requests))
    if args.limit is not None:
        requests = requests[: args.limit]
    counts = warm(client.socket_path, requests, args.timeout,
                  progress=sys.stderr.isatty() and not args.json, identity=client.identity)
    counts["seconds"] = round(time.monotonic() - started, 3)
    return report_warm(counts, args.json)


def warm_manifest(args: argparse.Namespace) -> int:
    started = time.monotonic()
    try:
        manifest = manifests.load(args.manifest)
    except manifests.ManifestError as exc:
        print(f"cached warm: {exc}", file=sys.stderr)
        return 2
    client = client_for(args)
    known = set(client.hello(timeout=30).families)
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
                  progress=sys.stderr.isatty() and not args.json, identity=client.identity)
    counts.update(summary, seconds=round(time.monotonic() - started, 3))
    return report_warm(counts, args.json, f"{manifest.model}: ")


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
         progress: bool = False, identity: Any = None) -> dict:
    """Ask for every request at pre-warm priority on one pipelined connection and wait;
    ``identity`` (a protocol Identity): the environment they are for (None: the default)."""
    identity = identity if isinstance(identity, p.Identity) else None
    deadline = time.monotonic() + timeout
    counts: dict = {"compiled": 0, "cached": 0, "remote": 0, "failed": 0, "errors": []}
    deadline_ms = min(p.MAX_DEADLINE_MS, int(timeout * 1000))
    with Connection(socket_path, deadline) as conn:
        for i, request in enumerate(requests):
            body = p.GetRequest(request=request, priority="prewarm", deadline_ms=deadline_ms,
                                identity=identity)
            conn.send({"v": p.PROTOCOL_VERSION, "id": i, "op": "get", **body.to_wire()},
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
