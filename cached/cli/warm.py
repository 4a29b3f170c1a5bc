"""``cached warm``: compile a family's tactic space for some shapes, or a model's manifest,
at pre-warm priority (waiting clients go first). For the daemon's default toolchain, or with
``--toolchain NAME`` for that registered environment (its identity, as its clients state it)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from cached_client import Client, KernelRequest
from cached_client import protocol as p
from cached_client.errors import CachedError, InvalidArgument
from cached_client.gemm import plan as gemm_plan

from cached import families
from cached.tools import manifests

from . import argtypes, progress
from .store import columns


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


WARM_DESCRIPTION = """\
Compile kernels at pre-warm priority (a client waiting for a kernel goes first): a
family's kernels for some shapes (--family, --arch, --shape), a model's manifest
(--manifest), or a list of kernel requests (--requests, e.g. what cached ls --json printed
on another node). For --family cached.hopper_fp8 that is the tactic its plan picks for
each M bucket (what clients ask for); --all-tactics compiles its whole space. Kernels
already stored count as cached and are not compiled again. Pre-warm requests are counted
apart from serving ones (cached stats: Pre-warm requests)."""


def _epilog() -> str:
    def listing(title: str, names: list[str]) -> list[str]:
        return [title, *textwrap.wrap(", ".join(names) or "none", 86, initial_indent="  ",
                                      subsequent_indent="  ")]

    return "\n".join([
        *listing("families of this installation (--family NAME):", families.names()),
        *listing("shipped manifests (--manifest NAME):", manifests.shipped()),
        "exit status: 0 every kernel stored; 1 some failed (listed on stderr); 2 a usage",
        "  or daemon error"])


def add_parsers(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    warm = sub.add_parser("warm", parents=[common],
                          help="compile a family's tactic space, or a model's manifest",
                          description=WARM_DESCRIPTION, epilog=_epilog(),
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    what = warm.add_argument_group("what to warm")
    what.add_argument("--manifest", metavar="FILE",
                      help="a pre-warm manifest (a path or a shipped name, e.g. llama-3.1-8b)")
    what.add_argument("--skip-missing", action="store_true",
                      help="with --manifest: skip builds whose family this daemon lacks")
    what.add_argument("--plan-only", action="store_true",
                      help="with --manifest or --family: count the kernels, compile nothing")
    what.add_argument("--requests", metavar="FILE",
                      help="kernel requests as JSON: a list of objects with family, arch, "
                           "sm_count, max_active_clusters and params (what cached ls "
                           "--json prints), or one object per line; - reads stdin")
    what.add_argument("--family", metavar="NAME",
                      help="the family (required without --manifest or --requests; with "
                           "them: only this family's kernels)")
    what.add_argument("--arch", action="append", default=[], metavar="ARCH",
                      help="target arch, e.g. sm_100a (repeatable): required with --family "
                           "alone; with --manifest or --requests, only these targets' "
                           "kernels")
    what.add_argument("--shape", type=_shape, action="append", metavar="M,N,K",
                      help="GEMM shape (repeatable; required with --family)")
    what.add_argument("--sm-count", type=argtypes.count(1, argtypes.MAX_SM_COUNT),
                      default=None, metavar="N",
                      help="SMs of the target GPU (default: the arch's usual part, e.g. 148 "
                           "for sm_100a)")
    what.add_argument("--option", type=_option, action="append", default=[],
                      metavar="NAME=VALUE",
                      help="family plan option, e.g. quant=mxfp4, out_dtype=float16 "
                           "(repeatable)")
    what.add_argument("--limit", type=argtypes.count(), default=None, metavar="N",
                      help="at most N kernels in all, the first in plan order")
    what.add_argument("--all-targets", action="store_true",
                      help="with --manifest: every target it lists; without it (and without "
                           "--arch) only this node's GPU's, where nvidia-smi names one")
    what.add_argument("--all-tactics", action="store_true",
                      help=f"with --family {gemm_plan.HOPPER_FAMILY}: its whole tactic space "
                           "for each shape (hundreds of kernels); without it, the tactic "
                           "the plan picks for each M bucket up to the shape's M, as "
                           "clients ask for them")
    what.add_argument("--toolchain", metavar="NAME", default=None,
                      help="compile for the toolchain NAME registered with cached serve "
                           "--toolchain NAME=PYTHON (cached toolchains lists them); default: "
                           "the daemon's default toolchain")
    how = warm.add_argument_group("output")
    how.add_argument("--json", action="store_true",
                     help="print the result as one JSON object on stdout")
    how.add_argument("--progress", choices=progress.MODES, default="auto",
                     help="on stderr: a bar (rate, ETA, last kernel) on a terminal, lines "
                          "elsewhere (auto, the default), or off")
    how.add_argument("--progress-every", type=argtypes.count(), default=50, metavar="N",
                     help="lines mode: a line every N kernels (default 50) ...")
    how.add_argument("--progress-interval", type=argtypes.seconds(0.1, 3600), default=10.0,
                     metavar="SECONDS", help="... or every SECONDS, whichever comes first "
                     "(default 10)")
    warm.add_argument("--timeout", type=argtypes.seconds(0, positive=True),
                      default=3600.0, metavar="SECONDS",
                      help="give up waiting after this many seconds (default 3600); "
                           "compilations already queued go on in the daemon")
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
    if args.requests:
        return warm_requests(args)
    if not (args.family and args.arch and args.shape):
        print("cached warm: needs --family, --arch and --shape, or --manifest, or --requests",
              file=sys.stderr)
        return 2
    started = time.monotonic()
    client = client_for(args)
    requests: list[KernelRequest] = []
    for arch in args.arch:
        for shape in args.shape:
            requests += planned(client, args, shape, arch)
    requests = list(dict.fromkeys(requests))
    if args.limit is not None:
        requests = requests[: args.limit]
    if args.plan_only:
        summary = {"total": len(requests), "seconds": round(time.monotonic() - started, 3),
                   "requests": [r.to_wire() for r in requests]}
        print(json.dumps(summary) if args.json else f"{args.family}: {len(requests)} kernels "
              f"over {len(args.shape)} shapes on {', '.join(args.arch)}")
        return 0
    counts = warm(client, requests, args.timeout, _progress(args, len(requests)),
                  identity=client.identity)
    counts["seconds"] = round(time.monotonic() - started, 3)
    return report_warm(counts, args.json)


def planned(client: Client, args: argparse.Namespace, shape: tuple[int, int, int],
            arch: str) -> list[KernelRequest]:
    """What ``warm --family`` compiles for one shape (M, N, K): for the batch-invariant
    GEMM family (cached.hopper_fp8), unless ``--all-tactics`` or ``--limit``, the tactic
    per M bucket up to M that :func:`cached_client.gemm.plan.plan_gemm` (the code clients
    run) picks, with its split fixups; otherwise the family's tactic space, in plan order."""
    options = dict(args.option)
    if (args.family == gemm_plan.HOPPER_FAMILY and not args.all_tactics
            and args.limit is None):
        m, n, k = shape
        plan = gemm_plan.plan_gemm(
            client, n, k, arch=arch, sm_count=args.sm_count, max_m=m,
            out_dtype=str(options.get("out_dtype", "bfloat16")),
            ab_dtype=str(options.get("ab_dtype", "e4m3")), prefetch=False)
        return plan.requests
    return client.plan(args.family, shape, arch, args.sm_count, options, timeout=120)


def warm_requests(args: argparse.Namespace) -> int:
    started = time.monotonic()
    try:
        requests = read_requests(args.requests)
    except (OSError, ValueError, CachedError) as exc:
        print(f"cached warm: --requests {args.requests}: {exc}", file=sys.stderr)
        return 2
    if args.family:
        requests = [r for r in requests if r.family == args.family]
    if args.arch:
        requests = [r for r in requests if r.arch in args.arch]
    if args.limit is not None:
        requests = requests[: args.limit]
    client = client_for(args)
    counts = warm(client, requests, args.timeout, _progress(args, len(requests)),
                  identity=client.identity)
    counts["seconds"] = round(time.monotonic() - started, 3)
    return report_warm(counts, args.json)


def read_requests(source: str) -> list[KernelRequest]:
    """Kernel requests from a JSON list or JSON lines (``-``: stdin), de-duplicated, in
    order; ValueError or InvalidArgument names the entry that is not one."""
    text = sys.stdin.read() if source == "-" else Path(source).read_text()
    stripped = text.strip()
    if stripped.startswith("["):
        items = json.loads(stripped)
    else:
        items = [json.loads(line) for line in stripped.splitlines() if line.strip()]
    out = []
    for index, item in enumerate(items):
        try:
            out.append(KernelRequest.from_wire(item))
        except CachedError as exc:
            raise ValueError(f"entry {index}: {exc.message}") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"entry {index}: {exc}") from None
    return list(dict.fromkeys(out))


def _progress(args: argparse.Namespace, total: int) -> progress.Progress:
    return progress.Progress(total, args.progress, sys.stderr, args.progress_every,
                             args.progress_interval)


def warm_manifest(args: argparse.Namespace) -> int:
    started = time.monotonic()
    try:
        manifest = manifests.load(args.manifest)
    except manifests.ManifestError as exc:
        print(f"cached warm: {exc}", file=sys.stderr)
        return 2
    targets = set(args.arch) or None
    if targets is None and not args.all_targets:
        targets = node_targets(manifest)
    client = client_for(args)
    known = set(client.hello(timeout=30).families)
    try:
        groups = manifests.plan(client, manifest, targets,
                                {args.family} if args.family else None, known,
                                args.skip_missing)
    except manifests.ManifestError as exc:
        print(f"cached warm: {exc}", file=sys.stderr)
        return 2
    requests = list(dict.fromkeys(r for group in groups.values() for r in group))
    if args.limit is not None:  # kernels in all, not per build
        requests = requests[: args.limit]
        kept = set(requests)
        groups = {g: [r for r in rs if r in kept] for g, rs in groups.items()}
    kernels = {f"{family}@{target}": len(r) for (family, target), r in groups.items()}
    summary: dict[str, Any] = {"model": manifest.model, "kernels": kernels,
                               "total": len(requests), "shapes": len(manifest.shapes()),
                               "pending": [p.get("family") for p in manifest.pending]}
    if args.plan_only:
        summary["seconds"] = round(time.monotonic() - started, 3)
        if args.json:
            summary["requests"] = {f"{family}@{target}": [r.to_wire() for r in group]
                                   for (family, target), group in groups.items()}
            print(json.dumps(summary))
        else:
            print(f"{manifest.model}: {len(requests)} kernels over {summary['shapes']} shapes")
            for line in columns([(g, str(n)) for g, n in kernels.items()], {1}):
                print("  " + line)
            for pending in summary["pending"]:
                print(f"  pending (no family yet): {pending}")
        return 0
    counts = warm(client, requests, args.timeout, _progress(args, len(requests)),
                  identity=client.identity)
    counts.update(summary, seconds=round(time.monotonic() - started, 3))
    return report_warm(counts, args.json, f"{manifest.model}: ")


def targets_of(compute_caps: list[str]) -> set[str]:
    """Compile targets of GPUs with these compute capabilities (nvidia-smi's ``9.0``,
    ``10.0``: sm_90a, sm_100a); values that are not MAJOR.MINOR are skipped."""
    out = set()
    for cap in compute_caps:
        major, _, minor = cap.strip().partition(".")
        if major.isdigit() and minor.isdigit():
            out.add(f"sm_{major}{minor}a")
    return out


def node_targets(manifest: manifests.Manifest) -> set[str] | None:
    """The manifest's targets this node's GPUs run (nvidia-smi), said on stderr; None (every
    target) where no GPU is found: a build node warms for its fleet."""
    listed = sorted({t for b in manifest.builds for t in b.targets})
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        found = targets_of(out.stdout.splitlines()) if out.returncode == 0 else set()
    except (OSError, subprocess.TimeoutExpired):
        found = set()
    if not found:
        print(f"cached warm: no GPU found here (nvidia-smi): every target of the manifest "
              f"({', '.join(listed)}); --arch ARCH for some", file=sys.stderr)
        return None
    mine = found & set(listed)
    print(f"cached warm: this node's GPU targets {', '.join(sorted(found))}: "
          f"{', '.join(sorted(mine)) or 'none of the manifest'} of {', '.join(listed)}; "
          "--all-targets for every one", file=sys.stderr)
    return mine or {"(none)"}


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


def warm(client: Client | str, requests: list[KernelRequest], timeout: float,
         shown: progress.Progress | None = None,
         identity: p.Identity | bool | None = None) -> dict:
    """Ask for every request at pre-warm priority on one pipelined connection of
    ``client``'s (a Client, or a socket path: the same socket search and trust checks as
    its calls) and wait;
    ``shown`` hears of each reply and is closed at the end; ``identity`` (a protocol
    Identity): the environment they are for (None: the daemon's default toolchain)."""
    identity = identity if isinstance(identity, p.Identity) else None
    client = Client(client) if isinstance(client, str) else client
    deadline = time.monotonic() + timeout
    counts: dict = {"compiled": 0, "cached": 0, "remote": 0, "failed": 0, "errors": []}
    deadline_ms = min(p.MAX_DEADLINE_MS, int(timeout * 1000))
    try:
        with client.connect(deadline) as conn:
            for i, request in enumerate(requests):
                body = p.GetRequest(request=request, priority="prewarm",
                                    deadline_ms=deadline_ms, identity=identity)
                conn.send({"v": p.PROTOCOL_VERSION, "id": i, "op": "get", **body.to_wire()},
                          deadline)
            for _ in requests:
                reply, _ = conn.receive(deadline)
                if reply.get("ok"):
                    artifact = reply["artifact"]
                    outcome = {"hit": "cached", "remote": "remote"}.get(artifact["origin"],
                                                                       "compiled")
                    kernel = str(artifact.get("kernel_name", ""))
                else:
                    outcome = "failed"
                    counts["errors"].append(reply.get("error", {}).get("message", "")[:300])
                    index = reply.get("id")
                    family = (requests[index].family if isinstance(index, int)
                              and 0 <= index < len(requests) else "?")
                    kernel = f"{family} (failed)"
                counts[outcome] += 1
                if shown is not None:
                    shown.done(outcome, kernel)
    finally:
        if shown is not None:
            shown.close()
    if not counts["errors"]:
        del counts["errors"]
    return counts
