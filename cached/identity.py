"""The registry of toolchains pinned in a store: ``identity.json`` at the store's root.

A compiling daemon probes its toolchains (cached/toolchains.py) and pins them here, with
the hashes of this package's own families' sources. A serve-only daemon (no compiler
installed, e.g. a GPU node serving a store built on a CPU build node) reads them back
(:func:`pinned`), so requests that state no identity, and the project's own families
(routed by runtime), get the same keys the builder gave them; requests that state their
identity need nothing pinned (their key is built from it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from . import families
from .toolchains import Toolchains

FILENAME = "identity.json"


def compute(registered: list[tuple[str, str]]) -> Toolchains:
    """Probe the registered toolchains and hash this package's own families' sources."""
    toolchains = Toolchains.probe_all(registered)
    for name in families.names():
        family = families.get(name)
        if family.sources == "daemon":
            toolchains.daemon_source(family)
    return toolchains


def pinned(store_root: Path) -> Toolchains:
    path = Path(store_root) / FILENAME
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path} is missing: a serve-only daemon needs a store built by a compiling "
            "daemon (which writes it)") from None
    return Toolchains.from_json(doc)


def save(store_root: Path, toolchains: Toolchains) -> None:
    path = Path(store_root) / FILENAME
    tmp = path.with_suffix(f".tmp.{os.getpid()}")
    tmp.write_text(json.dumps(toolchains.to_json(), indent=2, sort_keys=True))
    os.replace(tmp, path)
