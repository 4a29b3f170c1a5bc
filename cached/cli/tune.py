"""``cached tune``: on a GPU node, time each M bucket's candidates of the batch-invariant
class for some weight shapes and share the winners through the daemon (cached.tools.tune; the
timing in cached.tools.tune_cuda), per scheme: cached.hopper_fp8's (tensor-fast, ...) and
cached.hopper_bf16's ``bf16``. Interrupt it at any time (Ctrl-C): what finished is
published, and the next run goes on from there."""

from __future__ import annotations

import argparse
import json
import sys

from cached_client import Client

from cached.tools import tune

from . import argtypes, gpu


def _shape(text: str) -> tuple[int, int]:
    try:
        return tune.parse_shape(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _buckets(text: str) -> tuple[int, ...]:
    try:
        ups = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"buckets are M bounds a,b,c, got {text!r}") from None
    if not ups or min(ups) < 1 or list(ups) != sorted(set(ups)):
        raise argparse.ArgumentTypeError(f"buckets must be increasing positive M, got {text!r}")
    return ups


def _count(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {text!r}")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return v


def add_parsers(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    t = sub.add_parser("tune", parents=[common],
                       help="time tactics per M bucket on this GPU and share the winners",
                       description="For some weight shapes, time each M bucket's candidate "
                       "tactics of the batch-invariant class on this node's GPU (kernels "
                       "fetched from the daemon) and publish the winners through the daemon, "
                       "for every process and, with a fleet tier, every node with this device "
                       "and toolchain. Interruptible; a later run goes on where it stopped. "
                       "Needs a GPU; never run it inside an inference process.")
    t.add_argument("--weight", type=_shape, action="append", default=[], metavar="N,K",
                   help="weight shape N,K (repeatable)")
    t.add_argument("--manifest", metavar="NAME|PATH", help="the shapes of a manifest")
    t.add_argument("--planned", action="store_true",
                   help="the shapes clients have planned on this node (each scheme: those "
                        "its family's plans asked for)")
    t.add_argument("--scheme", action="append", default=[], metavar="NAME[,NAME..]",
                   help="the schemes to tune, each under its own class: "
                        "cached.hopper_fp8's (e.g. tensor-fast, token-exact, block128) and "
                        "cached.hopper_bf16's bf16 (bf16 operands); repeatable; 'all': "
                        f"every one; default {tune.DEFAULT_SCHEME}; an unknown name is "
                        "refused with the list")
    t.add_argument("--buckets", type=_buckets, default=tune.DEFAULT_BUCKETS, metavar="M,M,..",
                   help="M bucket bounds (default: 1,2,4,...,8192)")
    t.add_argument("--top", type=argtypes.count(), default=tune.DEFAULT_TOP, metavar="N",
                   help=f"the plan's first N tactics per bucket (default {tune.DEFAULT_TOP})")
    t.add_argument("--near", type=int, default=tune.DEFAULT_NEAR, metavar="N",
                   help="and the winners of the N nearest recorded shapes (default "
                        f"{tune.DEFAULT_NEAR})")
    t.add_argument("--rounds", type=argtypes.count(), default=tune.DEFAULT_ROUNDS,
                   metavar="R", help=f"interleaved timing rounds (default {tune.DEFAULT_ROUNDS})")
    t.add_argument("--margin", type=float, default=tune.DEFAULT_MARGIN, metavar="F",
                   help="a tactic replaces the plan's first choice only when faster by more "
                        f"than F in every round (default {tune.DEFAULT_MARGIN})")
    t.add_argument("--budget", type=_positive_float, default=tune.DEFAULT_BUDGET_S,
                   metavar="SECONDS", help="seconds per shape; buckets left over wait for "
                   f"the next run (default {tune.DEFAULT_BUDGET_S:g})")
    t.add_argument("--budget-s", type=_positive_float, dest="budget_deprecated",
                   default=None, metavar="SECONDS", help="the old spelling of --budget")
    t.add_argument("--force", action="store_true",
                   help="time buckets whose winners are published already")
    t.add_argument("--widen", type=_count, default=tune.DEFAULT_WIDEN, metavar="N",
                   help="where the best candidate is short of the competitor, time the "
                        f"bucket again with N more of the plan's, each of a kind not timed "
                        f"yet (default {tune.DEFAULT_WIDEN}; 0: never)")
    t.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="print the results as one JSON object on stdout, as every --json "
                        "does (a PATH after it, the old form, writes that file instead)")
    t.set_defaults(run=cmd_tune)


def cmd_tune(args: argparse.Namespace) -> int:
    if args.budget_deprecated is not None:
        print("cached tune: --budget-s is deprecated: use --budget SECONDS", file=sys.stderr)
        args.budget = args.budget_deprecated
    if args.json not in (None, "-"):
        print(f"cached tune: --json PATH is deprecated: use --json > {args.json}",
              file=sys.stderr)
    if not (args.weight or args.manifest or args.planned):
        print("cached tune: no shapes: give --weight, --manifest or --planned",
              file=sys.stderr)
        return 2
    try:  # the arguments first: a bad one is named on any node
        schemes = tune.check_schemes([s for v in args.scheme or [tune.DEFAULT_SCHEME]
                                      for s in v.split(",") if s])
    except ValueError as exc:
        print(f"cached tune: {exc}", file=sys.stderr)
        return 2
    why = gpu.why_not("tune")
    if why:
        print(why, file=sys.stderr)
        return 2
    client = Client(args.socket, timeout=600)
    given = tune.shapes_to_tune(client, args.weight, args.manifest)
    # per family: the shapes given, and with --planned what that family's plans asked for
    work = {fam: (list(dict.fromkeys(given + (tune.planned_shapes(client, fam)
                                               if args.planned else []))), group)
            for fam, group in tune.by_family(schemes).items()}
    if not any(shapes for shapes, _ in work.values()):
        print("cached tune: no shapes: give --weight, --manifest or --planned",
              file=sys.stderr)
        return 2
    import torch

    from cached.tools.tune_cuda import CudaTimer

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    arch = f"sm_{props.major}{props.minor}a"
    if arch != tune.ARCH:
        print(f"cached tune: {tune.FAMILY} runs on {tune.ARCH}; this device is {arch}",
              file=sys.stderr)
        return 2
    target = tune.Target(props.name, props.multi_processor_count, client.hello().toolchain)
    timer = CudaTimer(client)
    results: list = []

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        for shapes, group in work.values():
            tune.tune(client, shapes, timer, target, buckets=args.buckets, top=args.top,
                      near=args.near, rounds=args.rounds, margin=args.margin,
                      budget_s=args.budget, force=args.force, progress=say,
                      results=results, schemes=group, widen=args.widen)
    except KeyboardInterrupt:
        say("cached tune: interrupted; the winners of finished buckets are published, and "
            "the next run starts where this one stopped")
        return 130
    finally:
        report = {"device": target.device, "sm_count": target.sm_count,
                  "shapes": [r.__dict__ | {"buckets": [b.__dict__ for b in r.buckets]}
                             for r in results], "skipped": timer.skipped}
        if args.json not in (None, "-"):
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
    if args.json == "-":
        print(json.dumps(report))
        return 1 if any(r.unfinished for r in results) else 0
    for r in results:
        if r.not_planned:
            print(f"{r.n}x{r.k} {r.scheme}: not planned: {r.not_planned}")
            continue
        print(f"{r.n}x{r.k} {r.scheme} {r.reduction_class}: {len(r.buckets)} tuned "
              f"({sum(b.changed for b in r.buckets)} changed), {len(r.skipped)} published "
              f"before, {len(r.unfinished)} left, {r.seconds:.1f} s")
    return 1 if any(r.unfinished for r in results) else 0
