"""Kernel requests and the artifact key schema (see docs/keys.md).

A :class:`KernelRequest` names everything the caller knows that decides an artifact's
bits: family, canonical tactic parameters, target arch, the device facts the kernel
bakes in (SM count) and ``max_active_clusters``. The daemon adds the compiler stack's
fingerprint and the hash of the family's kernel sources, and :func:`artifact_key` is a
sha256 over a canonical JSON encoding of all of it. Two requests that differ in any of
these never share a key; two that agree always do.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidArgument

KEY_SCHEMA = 1
ARCHES = ("sm_90a", "sm_100a", "sm_103a", "sm_107a")
DEFAULT_SM_COUNT = {"sm_90a": 132, "sm_100a": 148, "sm_103a": 148, "sm_107a": 148}
"""A device profile per arch (H200, B200, B300, Rubin) for planning without a GPU."""
MAX_SM_COUNT = 1024
"""No GPU has more SMs; larger counts are refused before they cost a compile."""


def canonical_json(value: Any) -> str:
    """Deterministic JSON: sorted keys, no spaces, tuples as lists."""
    return _CANONICAL(value)


_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


@dataclass(frozen=True)
class KernelRequest:
    """One kernel: a family's tactic on one target.

    ``params`` must be JSON-representable; lists and tuples are equivalent.
    ``max_active_clusters`` is the value the *calling* process computed for its device.
    """

    family: str
    params: Mapping[str, Any] = field(hash=False, compare=False)
    arch: str = field(default="")
    sm_count: int = 0
    max_active_clusters: int = 0
    _frozen: tuple = field(init=False, repr=False, compare=True, hash=True)

    def __post_init__(self) -> None:
        if not isinstance(self.family, str) or not 0 < len(self.family) <= 200:
            raise InvalidArgument("request.family must be a non-empty string")
        if self.arch not in ARCHES:
            raise InvalidArgument(f"arch {str(self.arch)[:32]!r} is not one of "
                                  f"{', '.join(ARCHES)}")
        for name in ("sm_count", "max_active_clusters"):
            value = getattr(self, name)
            if (not isinstance(value, int) or isinstance(value, bool)
                    or not 0 < value <= MAX_SM_COUNT):
                raise InvalidArgument(f"request.{name} must be an integer in [1, "
                                      f"{MAX_SM_COUNT}], got {str(value)[:32]}")
        if not isinstance(self.params, Mapping):
            raise InvalidArgument("request.params must be an object")
        object.__setattr__(self, "_frozen", _freeze(self.params))

    @property
    def params_json(self) -> str:
        """``params`` as canonical JSON, which tells apart what Python equality does not
        (``1`` and ``true``); computed once (params are not changed after construction).
        TypeError/ValueError for params JSON cannot hold."""
        text = self.__dict__.get("_params_json")
        if text is None:
            text = canonical_json(dict(self.params))
            object.__setattr__(self, "_params_json", text)
        return text

    def to_wire(self) -> dict:
        """A fresh dict each call (callers may change it); params in canonical JSON form."""
        return {
            "family": self.family,
            "params": json.loads(self.params_json),
            "arch": self.arch,
            "sm_count": self.sm_count,
            "max_active_clusters": self.max_active_clusters,
        }

    @classmethod
    def from_wire(cls, obj: Any) -> KernelRequest:
        if not isinstance(obj, Mapping):
            raise InvalidArgument("request must be an object")
        missing = [k for k in ("family", "params", "arch", "sm_count", "max_active_clusters")
                   if k not in obj]
        if missing:
            raise InvalidArgument(f"request is missing {', '.join(missing)}")
        return cls(
            family=obj["family"],
            params=obj["params"],
            arch=obj["arch"],
            sm_count=obj["sm_count"],
            max_active_clusters=obj["max_active_clusters"],
        )

    def identity(self) -> str:
        """Canonical encoding of the caller-side identity (no toolchain, no sources)."""
        return canonical_json(self.to_wire())


def artifact_key(request: KernelRequest, toolchain: str, source_sha256: str) -> str:
    """The store key: sha256 over the canonical encoding of everything that decides bits."""
    document = {
        "schema": KEY_SCHEMA,
        **request.to_wire(),
        "toolchain": toolchain,
        "source_sha256": source_sha256,
    }
    return hashlib.sha256(canonical_json(document).encode()).hexdigest()
