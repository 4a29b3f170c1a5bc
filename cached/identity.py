"""What the daemon adds to every key: the toolchain fingerprint and each family's sources.

A compiling daemon computes both (``Identity.live``) and pins them in ``identity.json``
at the store's root. A serve-only daemon (no compiler installed, e.g. a GPU node serving
a store built on a CPU build node) reads them back (``Identity.pinned``), so it derives
the same keys the builder did and serves that store's artifacts unchanged.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from cached_client.errors import InvalidTactic

from . import families, toolchain
from .config import ConfigError
from .families.base import Family

FILENAME = "identity.json"


class IdentityError(ConfigError):
    """``identity.json`` is missing or unusable on a serve-only node (one line, at start)."""


@dataclass
class Identity:
    toolchain: str
    sources: dict[str, str] = field(default_factory=dict)
    live: bool = True

    @classmethod
    def compute(cls) -> Identity:
        """The running environment's identity, every registered family's sources hashed."""
        return cls(toolchain.fingerprint(),
                   {name: families.get(name).source_sha256() for name in families.names()})

    @classmethod
    def pinned(cls, store_root: Path) -> Identity:
        """The identity a compiling daemon pinned in the store; :class:`IdentityError` if
        the file is missing, unreadable or not ``{"toolchain": str, "sources": {name:
        hex}}``."""
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
        sources = doc.get("sources") if isinstance(doc, dict) else None
        if (not isinstance(doc, dict) or not isinstance(doc.get("toolchain"), str)
                or not isinstance(sources, dict)
                or not all(isinstance(k, str) and isinstance(v, str)
                           for k, v in sources.items())):
            raise IdentityError(f"{path} is not an identity file (expected an object with "
                                "'toolchain': text and 'sources': {family: digest}): copy it "
                                "again from the store of the build node")
        return cls(doc["toolchain"], dict(sources), live=False)

    def save(self, store_root: Path) -> None:
        path = Path(store_root) / FILENAME
        tmp = path.with_suffix(f".tmp.{os.getpid()}")
        tmp.write_text(json.dumps({"toolchain": self.toolchain, "sources": self.sources},
                                  indent=2, sort_keys=True))
        os.replace(tmp, path)

    def source(self, family: Family) -> str:
        sha = self.sources.get(family.name)
        if sha is None:
            if not self.live:
                raise InvalidTactic(f"this serve-only daemon's store has no {family.name} "
                                    "artifacts (no source hash pinned for it)")
            sha = self.sources[family.name] = family.source_sha256()
        return sha
