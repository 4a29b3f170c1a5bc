"""``cached toolchains``: the inference environments the daemon compiles for.

One line per registered toolchain (``cached serve --toolchain NAME=PYTHON``; docs/keys.md):
its name, readable versions (FlashInfer, nvidia-cutlass-dsl, torch, TVM-FFI, Python), the
digest of its fingerprint, its interpreter and its workers. ``--json`` prints what ``hello``
says of each (the full fingerprint, sources and runtime) with its workers.
"""

from __future__ import annotations

import argparse
import json

from cached_client import Client

VERSIONS = (("FlashInfer", "flashinfer-python"), ("DSL", "nvidia-cutlass-dsl"),
            ("torch", "torch"), ("TVM-FFI", "apache-tvm-ffi"), ("Python", "python"))


def add_parsers(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = sub.add_parser("toolchains", parents=[common],
                            help="list the toolchains (environments) the daemon compiles for",
                            description="One entry per toolchain registered with the running "
                            "daemon (cached serve --toolchain NAME=PYTHON): its name, "
                            "readable versions, fingerprint digest, interpreter, workers and "
                            "the families it compiles.")
    parser.add_argument("--json", action="store_true",
                        help="print the toolchains as one JSON list")
    parser.set_defaults(run=cmd_toolchains)


def cmd_toolchains(args: argparse.Namespace) -> int:
    client = Client(args.socket, timeout=10, identity=False)
    described = client.hello().toolchains
    running = {t["name"]: t for t in client.stats().get("toolchains", [])}
    workers = {name: t.get("workers", {}) for name, t in running.items()}
    if args.json:
        print(json.dumps([{**t, "workers": workers.get(t["name"], {}),
                           "families": running.get(t["name"], {}).get("families", [])}
                          for t in described]))
        return 0
    for i, t in enumerate(described):
        v = t.get("versions", {})
        versions = ", ".join(f"{label} {v.get(key, '?')}" for label, key in VERSIONS)
        w = workers.get(t["name"], {})
        print(f"{t['name']}{' (default)' if i == 0 else ''}  {t['digest']}  {versions}")
        compiled = running.get(t["name"], {}).get("families") or sorted(t.get("sources", {}))
        print(f"    python {t['python'] or '-'}  workers {w.get('ready', 0)} ready, "
              f"{w.get('busy', 0)} busy  families {', '.join(compiled) or '-'}")
    return 0
