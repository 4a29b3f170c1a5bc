"""Capacity: kernels per model manifest, family and target, and what they weigh.

The figures of docs/operations.md's Capacity table: for each shipped manifest, ``cached
warm --manifest NAME --plan-only --json`` (the command an operator runs), the kernels per
``family@target``, and the union over the manifests ("all models together"). With
``--sample N`` it also compiles N kernels spread over each family's union plan (``cached
warm --requests``), reads their sizes (``cached ls --json``: object + library) and prints
the mean per family and each cell's size at that mean. Without ``--socket`` it starts a
daemon of its own (one worker, a temporary store).

Usage: python bench/capacity.py [--socket PATH] [--manifest NAME ...] [--sample N] [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import Daemon

from cached.tools import manifests


def cli(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "cached", *args], capture_output=True,
                          text=True, check=True).stdout


def count(socket: str, names: list[str]) -> dict:
    """{"models": {model: {group: kernels}}, "all": {group: kernels}} for the manifests."""
    models: dict[str, dict[str, int]] = {}
    union: dict[str, set[str]] = {}
    wires: dict[str, dict[str, dict]] = {}
    for name in names:
        plan = json.loads(cli("warm", "--socket", socket, "--manifest", name, "--plan-only",
                              "--json"))
        models[plan["model"]] = plan["kernels"]
        for group, requests in plan["requests"].items():
            for wire in requests:
                text = json.dumps(wire, sort_keys=True)
                union.setdefault(group, set()).add(text)
                wires.setdefault(group, {})[text] = wire
    return {"models": models, "all": {g: len(r) for g, r in union.items()},
            "union": {g: [wires[g][t] for t in sorted(r)] for g, r in union.items()}}


def sample_sizes(socket: str, union: dict[str, list[dict]], n: int, work: Path) -> dict:
    """Mean bytes per kernel of each family, from ``n`` kernels spread over its plan."""
    picked: dict[str, list[dict]] = {}
    for group, wires in union.items():
        family = group.split("@")[0]
        if family not in picked and wires:
            step = max(1, len(wires) // n)
            picked[family] = wires[::step][:n]
    requests = work / "sample.json"
    requests.write_text(json.dumps([w for ws in picked.values() for w in ws]))
    subprocess.run([sys.executable, "-m", "cached", "warm", "--socket", socket, "--requests",
                    str(requests), "--progress", "off"], check=False)
    sizes: dict[str, list[int]] = {}
    for row in json.loads(cli("ls", "--socket", socket, "--json")):
        sizes.setdefault(row["family"], []).append(row["size"])
    return {f: sum(v) / len(v) for f, v in sizes.items() if f in picked}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--socket", default=None)
    parser.add_argument("--manifest", action="append", default=None)
    parser.add_argument("--sample", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    names = args.manifest or manifests.shipped()
    with tempfile.TemporaryDirectory() as tmp:
        daemon = None if args.socket else Daemon(Path(tmp), workers=1)
        socket = args.socket or daemon.socket
        try:
            out = count(socket, names)
            if args.sample:
                out["mean_bytes"] = sample_sizes(socket, out["union"], args.sample, Path(tmp))
        finally:
            if daemon is not None:
                daemon.stop()
    del out["union"]
    if args.json:
        print(json.dumps(out))
        return
    mean = out.get("mean_bytes", {})
    for model, groups in [*out["models"].items(), ("all together", out["all"])]:
        cells = []
        for group, n in groups.items():
            size = mean.get(group.split("@")[0])
            cells.append(f"{group} {n}" + (f" ({n * size / 2**20:.1f} MiB)" if size else ""))
        print(f"{model}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
