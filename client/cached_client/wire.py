"""The protocol's building blocks: its constants, the field checks a message declares
its fields with, and the :class:`Message` base (decode once with the checks, encode).

A check returns the decoded value or raises :class:`~cached_client.errors.InvalidArgument`
naming the field; a field declared without a check is local, never on the wire. The
messages are in :mod:`cached_client.messages`, the frames and the op table in
:mod:`cached_client.protocol` (which re-exports all of this: import from there).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .errors import InvalidArgument
from .keys import KernelRequest

MAX_REQUEST_FRAME = 1 << 20
PRIORITIES = ("interactive", "prewarm")
TRANSFERS = ("fd", "path", "bytes")
"""How ``get`` hands a library over: open descriptors of the verified blobs (SCM_RIGHTS;
eviction cannot break a load in progress), their paths in the store, or the library's
bytes as payload."""
BLOB_KINDS = ("object", "library")
BLOB_SUFFIXES = {"object": ".o", "library": ".so"}
"""A blob's file name is its sha256 and this suffix (the store's and a client's copies)."""
MAX_DEADLINE_MS = 3_600_000
KINDS = ("kernel", "bundle")
"""What an artifact is: a ``kernel`` (an object and the library linked from it) or a
``bundle`` (named opaque files a JIT library wrote, listed in a manifest)."""
BUNDLE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]{0,254}\Z")
"""A bundle file's name: one plain path component without a leading dot."""
MAX_BUNDLE_FILES = 64


# -- field checks ------------------------------------------------------------------------

Check = Callable[[Any, str], Any]
"""A wire check: returns the decoded value or raises InvalidArgument naming the field."""


def _bad(name: str, wanted: str, value: Any) -> InvalidArgument:
    shown = repr(value)
    return InvalidArgument(f"{name} must be {wanted}, got {shown[:80]}")


def Int(low: int = 0, high: int = (1 << 53)) -> Check:  # noqa: N802 -- reads as a type
    def check(value: Any, name: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise _bad(name, f"an integer in [{low}, {high}]", value)
        return value
    return check


def Number(low: float = 0.0, high: float = 1e12) -> Check:  # noqa: N802
    def check(value: Any, name: str) -> float:
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or (isinstance(value, float) and not math.isfinite(value))
                or not low <= value <= high):  # an int of any size compares exactly
            raise _bad(name, f"a number in [{low:g}, {high:g}]", value)
        return float(value)
    return check


def Str(max_len: int = 256, choices: tuple[str, ...] | None = None) -> Check:  # noqa: N802
    def check(value: Any, name: str) -> str:
        if choices is not None and value not in choices:
            raise _bad(name, "one of " + ", ".join(repr(c) for c in choices), value)
        if not isinstance(value, str) or len(value) > max_len:
            raise _bad(name, f"a string of at most {max_len} characters", value)
        return value
    return check


def Bool() -> Check:  # noqa: N802
    def check(value: Any, name: str) -> bool:
        if not isinstance(value, bool):
            raise _bad(name, "true or false", value)
        return value
    return check


def Obj(max_items: int = 10_000) -> Check:  # noqa: N802
    """A JSON object with string keys, returned as a plain dict."""
    def check(value: Any, name: str) -> dict:
        if not isinstance(value, dict) or len(value) > max_items:
            raise _bad(name, f"an object of at most {max_items} fields", value)
        return value
    return check


def List(item: Check | None = None, max_items: int = 100_000) -> Check:  # noqa: N802
    def check(value: Any, name: str) -> list:
        if not isinstance(value, list) or len(value) > max_items:
            raise _bad(name, f"a list of at most {max_items} items", value)
        if item is None:
            return value
        return [item(v, f"{name}[{i}]") for i, v in enumerate(value)]
    return check


def Kernel() -> Check:  # noqa: N802
    """A kernel request (keys.KernelRequest); its own checks raise InvalidTactic."""
    def check(value: Any, name: str) -> KernelRequest:
        return KernelRequest.from_wire(value)
    return check


def Any_() -> Check:  # noqa: N802
    """Any JSON value (already bounded by the frame size and depth limits)."""
    return lambda value, name: value


def Nested(cls: type[Message]) -> Check:  # noqa: N802
    def check(value: Any, name: str) -> Message:
        if not isinstance(value, dict):
            raise _bad(name, "an object", value)
        return cls.from_wire(value)
    return check


def Optional(check: Check) -> Check:  # noqa: N802
    """``check``, or JSON null (decoded as None)."""
    return lambda value, name: None if value is None else check(value, name)


def wire(check: Check, default: Any = dataclasses.MISSING, doc: str = "") -> Any:
    """A message field with its wire check; no default means the field is required."""
    if isinstance(default, (dict, list)):
        return field(default_factory=functools.partial(type(default), default),
                     metadata={"check": check, "doc": doc})
    return field(default=default, metadata={"check": check, "doc": doc})


# -- messages ----------------------------------------------------------------------------

M = TypeVar("M", bound="Message")


@dataclass(frozen=True, kw_only=True)
class Message:
    """A request or reply body; fields declared with :func:`wire`."""

    @classmethod
    def from_wire(cls: type[M], obj: Mapping[str, Any]) -> M:
        values = {}
        for name, check, required in _wire_fields(cls):
            if name in obj:
                values[name] = check(obj[name], name)
            elif required:
                raise InvalidArgument(f"{cls.__name__} needs the field {name!r}")
        return cls(**values)

    def to_wire(self) -> dict:
        out = {}
        for name, _, _ in _wire_fields(type(self)):
            value = getattr(self, name)
            if value is not None:
                out[name] = _encode(value)
        return out


@functools.cache
def _wire_fields(cls: type[Message]) -> tuple[tuple[str, Check, bool], ...]:
    """(name, check, required) of each wire field of ``cls``, in declaration order; a field
    without a check is local, never on the wire."""
    return tuple((f.name, f.metadata["check"], f.default is dataclasses.MISSING
                  and f.default_factory is dataclasses.MISSING)
                 for f in dataclasses.fields(cls) if "check" in f.metadata)


def _encode(value: Any) -> Any:
    if isinstance(value, (Message, KernelRequest)):
        return value.to_wire()
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


# -- digests and manifests ---------------------------------------------------------------

HEX64_RE = re.compile(r"[0-9a-f]{64}\Z")
r"""A sha256 in hex: exactly 64 lowercase hex digits (``\Z``: no trailing newline)."""


def hex64(value: Any, name: str) -> str:
    if not isinstance(value, str) or not HEX64_RE.match(value):
        raise _bad(name, "64 lowercase hex digits", value)
    return value


def check_manifest(files: Any) -> str | None:
    """Why a bundle manifest ``{name: {"sha256", "size"}}`` is not one (None when it is): 1 to
    :data:`MAX_BUNDLE_FILES` plain file names (:data:`BUNDLE_NAME`), each with a digest of
    64 lowercase hex digits and a size in bytes."""
    if not isinstance(files, dict) or not 0 < len(files) <= MAX_BUNDLE_FILES:
        return f"a bundle manifest is an object of 1 to {MAX_BUNDLE_FILES} files"
    for name, f in files.items():
        if not isinstance(name, str) or not BUNDLE_NAME.match(name):
            return f"bundle file name {str(name)[:80]!r} is not one plain file name"
        if not isinstance(f, dict) or set(f) != {"sha256", "size"}:
            return f"bundle file {name!r} must have exactly sha256 and size"
        sha = f["sha256"]
        if not isinstance(sha, str) or not HEX64_RE.match(sha):
            return f"bundle file {name!r}: sha256 is not 64 lowercase hex digits"
        if isinstance(f["size"], bool) or not isinstance(f["size"], int) or f["size"] < 0:
            return f"bundle file {name!r}: size is not a non-negative integer"
    return None
