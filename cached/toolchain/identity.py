"""The registry of toolchains pinned in a store: ``identity.json`` at the store's root.

A compiling daemon probes its toolchains (cached/toolchain/toolchains.py) and pins them here, with
the hashes of this package's own families' sources. A serve-only daemon (no compiler
installed, e.g. a GPU node serving a store built on a CPU build node) reads them back
(:func:`pinned`), so requests that state no identity, and the project's own families
(routed by runtime), get the same keys the builder gave them; requests that state their
identity need nothing pinned (their key is built from it). A missing or unusable file is
:class:`IdentityError`, one line at start, before anything is bound.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from cached import families
from cached.config import ConfigError
from cached.toolchain.toolchains import PROBE_TIMEOUT_S, Toolchains

FILENAME = "identity.json"


class IdentityError(ConfigError):
    """``identity.json`` is missing or unusable on a serve-only node (one line, at start)."""


def compute(registered: list[tuple[str, str]],
            timeout: float = PROBE_TIMEOUT_S) -> Toolchains:
    """Probe the registered toolchains (each within ``timeout`` seconds) and hash this
    package's own families' sources."""
    toolchains = Toolchains.probe_all(registered, timeout)
    for name in families.names():
        family = families.get(name)
        if family.sources == "daemon":
            toolchains.daemon_source(family)
    return toolchains


def pinned(store_root: Path) -> Toolchains:
    """The toolchains a compiling daemon pinned in the store."""
    path = Path(store_root) / FILENAME
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise IdentityError(
            f"{path} is missing: a serve-only daemon needs a store built by a compiling "
            "daemon (which writes it)") from None
    except (OSError, ValueError) as exc:
        raise IdentityError(f"{path} cannot be read as JSON ({exc}): copy it again from "
                            "the store of the build node") from None
    try:
        if not isinstance(doc, dict):
            raise TypeError(f"a JSON {type(doc).__name__}, not an object")
        toolchains = Toolchains.from_json(doc)
        for t in toolchains.items:
            if not isinstance(t.fingerprint, str) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in t.sources.items()):
                raise TypeError("a toolchain's fingerprint or sources are not text")
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise IdentityError(f"{path} is not an identity file ({exc}): copy it again from the "
                            "store of the build node") from None
    return toolchains


def save(store_root: Path, toolchains: Toolchains) -> None:
    path = Path(store_root) / FILENAME
    tmp = path.with_suffix(f".tmp.{os.getpid()}")
    tmp.write_text(json.dumps(toolchains.to_json(), indent=2, sort_keys=True))
    os.replace(tmp, path)
