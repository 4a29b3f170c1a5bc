"""The wire protocol between the daemon and its clients: the whole surface in one place.

Frames: a 4-byte big-endian length, then that many bytes of one UTF-8 JSON object. A reply
whose object has ``"payload_size": N`` is followed by N raw bytes (an artifact's library,
when the client asked for bytes rather than a path). A reply whose object has ``"fds":
[kind, ...]`` carries that many open file descriptors, passed with SCM_RIGHTS on its first
byte, in that order (a ``get`` with transfer ``fd``).

Envelope: every request carries ``op`` and may carry ``v`` (protocol version, default 1)
and ``id``; every reply carries ``ok`` and echoes ``id``; an error reply is
``{"ok": false, "error": {"code", "message"}}`` with a code from
:data:`cached_client.errors.ERROR_CODES`.

Ops: :data:`OPS` maps each op's name to its request and reply types (frozen dataclasses
whose fields are declared with a wire check) and to whether it needs a peer allowed to
publish. The daemon decodes a request once, at its edge (:meth:`Message.from_wire`): a
missing or ill-typed field is :class:`~cached_client.errors.InvalidArgument` naming the
field; unknown fields are ignored (a newer peer may send more). The client decodes replies
with the same checks, so a malformed reply is a typed error, never a ``KeyError``.

Invariants: a request frame is at most :data:`MAX_REQUEST_FRAME` bytes and a reply frame
at most :data:`MAX_REPLY_FRAME`; JSON nesting deeper than :data:`MAX_DEPTH` is refused
before it is parsed; numbers are finite (NaN and Infinity are not JSON, and a number too
large for a double, such as ``1e999``, is refused rather than read as infinity).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .errors import InvalidArgument, MalformedFrame
from .keys import KernelRequest

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = (1,)
MAX_REQUEST_FRAME = 1 << 20
MAX_REPLY_FRAME = 64 << 20
MAX_DEPTH = 32
HEADER = struct.Struct(">I")
CAPABILITIES = ("transfer:path", "transfer:bytes", "transfer:fd", "identity:keys",
                "identity:artifact")
"""What ``hello`` offers beyond its ``ops`` list: each ``get`` transfer; ``identity:keys``,
keys built from the identity a request states (docs/keys.md); ``identity:artifact``, every
artifact states what it was built for (toolchain, runtime, sources, arch, device), which
the client checks against its own identity before loading anything (cached_client.trust)."""
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

# -- frames ------------------------------------------------------------------------------


def encode_frame(message: dict) -> bytes:
    """One frame: length header plus compact JSON (finite numbers only), keys sorted, but an
    integer ``id`` first: ``{"id":N,...}``, so that frames asking the same differ only in
    their leading digits (the daemon remembers decoded requests by the bytes after them:
    ``cached.server.DecodedFrameCache``)."""
    request_id = message.get("id")
    if type(request_id) is int and len(message) > 1:
        rest = _FRAME_JSON({k: v for k, v in message.items() if k != "id"})
        body = f'{{"id":{request_id},{rest[1:]}'.encode()
    else:
        body = _FRAME_JSON(message).encode()
    return HEADER.pack(len(body)) + body


_FRAME_JSON = json.JSONEncoder(separators=(",", ":"), sort_keys=True, allow_nan=False).encode


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _too_deep(value: Any, limit: int) -> bool:
    """Whether objects and arrays nest deeper than ``limit`` in a parsed JSON value."""
    level: list[Any] = [value]
    for _ in range(limit):
        level = [child for item in level if isinstance(item, (dict, list))
                 for child in (item.values() if isinstance(item, dict) else item)]
        if not level:
            return False
    return any(isinstance(item, (dict, list)) for item in level)


def decode_body(body: bytes) -> dict:
    """Parse a frame body; MalformedFrame unless it is one JSON object of bounded depth."""
    try:
        message = json.loads(body, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise MalformedFrame(f"frame nests JSON deeper than {MAX_DEPTH} levels") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise MalformedFrame(f"frame is not valid UTF-8 JSON: {exc}") from None
    if not isinstance(message, dict):
        raise MalformedFrame(f"frame must be a JSON object, got {type(message).__name__}")
    # nesting cannot be deeper than the brackets that open it: most frames need no walk
    if body.count(b"{") + body.count(b"[") > MAX_DEPTH and _too_deep(message, MAX_DEPTH):
        raise MalformedFrame(f"frame nests JSON deeper than {MAX_DEPTH} levels")
    return message


def frame_length(header: bytes, limit: int) -> int:
    """The body length announced by a 4-byte header; MalformedFrame if over ``limit``."""
    (length,) = HEADER.unpack(header)
    if length > limit:
        raise MalformedFrame(f"frame of {length} bytes exceeds the {limit}-byte limit")
    return length


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


# -- identity ----------------------------------------------------------------------------

HEX64_RE = re.compile(r"[0-9a-f]{64}\Z")
r"""A sha256 in hex: exactly 64 lowercase hex digits (``\Z``: no trailing newline)."""


def _hex64(value: Any, name: str) -> str:
    if not isinstance(value, str) or not HEX64_RE.match(value):
        raise _bad(name, "64 lowercase hex digits", value)
    return value


@dataclass(frozen=True, kw_only=True)
class Identity(Message):
    """The requesting environment's identity (cached_client.identity computes it): the key
    of an artifact is built from it, and the daemon compiles a miss only with a registered
    toolchain that matches it (docs/keys.md)."""

    toolchain: str = wire(Str(1 << 16), doc="the compiler stack's fingerprint")
    sources: dict = wire(Obj(16), {}, "{family: sha256} of the kernel sources it compiles from")
    runtime: dict = wire(Obj(8), {}, "tvm_ffi, dsl_runtime_sha256 (and dsl, for messages)")

    def __post_init__(self) -> None:
        for family, sha in self.sources.items():
            Str(200)(family, "identity.sources key")
            _hex64(sha, f"identity.sources[{family[:200]!r}]")
        for name, value in self.runtime.items():
            Optional(Str(128))(value, f"identity.runtime[{str(name)[:40]!r}]")


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


def IdentityField() -> Any:  # noqa: N802 -- reads as a type
    """The optional ``identity`` field of every request that can return an artifact."""
    return wire(Optional(Nested(Identity)), None,
                "the requesting environment's identity; absent: the daemon's default toolchain")


# -- the ops -----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Empty(Message):
    """A request or reply with no fields."""


@dataclass(frozen=True, kw_only=True)
class HelloReply(Message):
    v: int = wire(Int())
    ops: list = wire(List(Str()))
    capabilities: list = wire(List(Str()), [])
    families: list = wire(List(Str()), [])
    toolchain: str = wire(Str(1 << 16), "")
    versions: dict = wire(Obj(), {})
    runtime_library: dict = wire(Obj(), {})
    serve_only: bool = wire(Bool(), False)
    may_publish: bool = wire(Bool(), False)
    reduction_classes: dict = wire(
        Obj(), {}, "family -> {classes: [class id], m_independent: bool}: the reduction-order "
        "classes a family's tactics belong to, and whether a class's rows are declared "
        "independent of M (a batch-invariant plan may then mix the tactics of one class)")
    toolchains: list = wire(List(Obj(), 64), [], "each registered toolchain (cached toolchains)")


@dataclass(frozen=True, kw_only=True)
class Artifact(Message):
    """A stored kernel as the daemon describes it; paths are read-only verified blobs."""

    key: str = wire(Str(64))
    family: str = wire(Str())
    kernel_name: str = wire(Str(4096))
    symbol: str = wire(Str(4096))
    library_sha256: str = wire(Str(64))
    object_sha256: str = wire(Str(64))
    toolchain: str = wire(Str(1 << 16))
    runtime_library: dict = wire(Obj(), doc="{name, path} for people: a client never opens "
                                 "a path the daemon names (cached_client.loader.open_runtime)")
    arch: str = wire(Str(32), "", "the target it was compiled for ('': not stated)")
    sm_count: int = wire(Int(), 0, "the SM count it was keyed with (1: not a fact it depends "
                         "on; 0: not stated)")
    max_active_clusters: int = wire(Int(), 0, "the occupancy it was keyed with (as sm_count)")
    runtime: dict = wire(Obj(8), {}, "tvm_ffi and dsl_runtime_sha256 of the toolchain that "
                         "built it ({}: not known)")
    origin: str = wire(Str(16), "hit", "hit, compiled, remote, unstored or fallback")
    compile_seconds: float = wire(Number(), 0.0)
    source_sha256: str = wire(Str(64), "")
    library_size: int = wire(Int(), 0)
    object_size: int = wire(Int(), 0)
    library_path: str | None = wire(Optional(Str(4096)), None)
    object_path: str | None = wire(Optional(Str(4096)), None)
    kind: str = wire(Str(16, KINDS), "kernel", "kernel, or bundle (no object or library)")
    files: list = wire(List(Obj(8), MAX_BUNDLE_FILES), [],
                       "a bundle's files: {name, sha256, size, path} each")
    library_bytes: bytes | None = field(default=None, repr=False, compare=False)
    """The library itself when it came as the reply's payload (local, not a wire field)."""


@dataclass(frozen=True, kw_only=True)
class GetRequest(Message):
    request: KernelRequest = wire(Kernel())
    deadline_ms: float = wire(Number(1, MAX_DEADLINE_MS), 60_000)
    priority: str = wire(Str(choices=PRIORITIES), "interactive")
    transfer: str = wire(Str(choices=TRANSFERS), "path")
    blobs: list = wire(List(Str(16, BLOB_KINDS), 2), list(BLOB_KINDS),
                       "transfer 'fd': the blobs whose descriptors to pass (a daemon that "
                       "predates this field passes both)")
    identity: Identity | None = IdentityField()

    def __post_init__(self) -> None:
        if not self.blobs or len(set(self.blobs)) != len(self.blobs):
            raise InvalidArgument("get.blobs must name 'object', 'library' or both, once each")


@dataclass(frozen=True, kw_only=True)
class GetReply(Message):
    artifact: Artifact = wire(Nested(Artifact))
    fds: list = wire(List(Str(16, BLOB_KINDS), 2), [],
                     "transfer 'fd': the blobs whose descriptors come with this reply, in order")


@dataclass(frozen=True, kw_only=True)
class PrefetchRequest(Message):
    requests: list = wire(List(Any_(), 100_000), doc="kernel requests, checked one by one")
    identity: Identity | None = IdentityField()


@dataclass(frozen=True, kw_only=True)
class PrefetchReply(Message):
    queued: int = wire(Int(), 0)
    cached: int = wire(Int(), 0)
    in_flight: int = wire(Int(), 0)
    rejected: list = wire(List(Obj()), [], "{index, error} per refused request")


@dataclass(frozen=True, kw_only=True)
class PlanRequest(Message):
    family: str = wire(Str())
    shape: list = wire(List(Int(1, 1 << 31), 3))
    arch: str = wire(Str(32))
    sm_count: int | None = wire(Optional(Int(1, 1 << 16)), None)
    options: dict = wire(Obj(64), {})
    identity: Identity | None = IdentityField()
    limit: int | None = wire(Optional(Int(1, 1 << 20)), None,
                             "at most this many requests: the plan's first ones (null: all; a "
                             "daemon that predates the field answers all)")

    def __post_init__(self) -> None:
        if len(self.shape) != 3:
            raise InvalidArgument(f"shape must be three positive integers M,N,K, "
                                  f"got {self.shape!r}")


@dataclass(frozen=True, kw_only=True)
class PlanReply(Message):
    requests: list = wire(List(Kernel()))
    classes: list = wire(List(Optional(Str())), [],
                         "the reduction-order class of each request (parallel to requests; "
                         "null for a family that declares none)")

    def __post_init__(self) -> None:
        if self.classes and len(self.classes) != len(self.requests):
            raise InvalidArgument(f"classes has {len(self.classes)} entries for "
                                  f"{len(self.requests)} requests")


@dataclass(frozen=True, kw_only=True)
class StatsReply(Message):
    stats: dict = wire(Obj())


@dataclass(frozen=True, kw_only=True)
class ZeroStatsReply(Message):
    """The statistics just before they were zeroed, and when that was (Unix seconds)."""

    stats: dict = wire(Obj())
    zeroed_at: float = wire(Number(0, 1e11))


@dataclass(frozen=True, kw_only=True)
class ListReply(Message):
    entries: list = wire(List(Obj()))


@dataclass(frozen=True, kw_only=True)
class ReportRequest(Message):
    fallbacks: dict = wire(Obj(64), {}, "{family: count} compiled in-process meanwhile")
    outside: dict = wire(Obj(64), {}, "{family: count} of kernels built or loaded in the "
                         "process outside the daemon while serving (cached_client.monitor)")
    outside_kernels: list = wire(List(Str(300), 16), [], "some of those kernels' names")

    def __post_init__(self) -> None:
        for name in ("fallbacks", "outside"):
            for family, count in getattr(self, name).items():
                Str(200)(family, f"{name} key")
                Int(1, 1_000_000)(count, f"{name}[{family[:200]!r}]")


@dataclass(frozen=True, kw_only=True)
class GcRequest(Message):
    max_bytes: int | None = wire(Optional(Int()), None, "a one-off budget in bytes")
    max_files: int | None = wire(Optional(Int()), None, "a one-off budget in blob files")
    grace: float | None = wire(Optional(Number()), None, "seconds of recent use that protect")


@dataclass(frozen=True, kw_only=True)
class GcReply(Message):
    evicted: int = wire(Int())
    freed_bytes: int = wire(Int())
    blocked: int = wire(Int())
    entries: int = wire(Int())
    bytes: int = wire(Int())
    max_bytes: int = wire(Int(), 0)
    max_files: int = wire(Int(), 0)


@dataclass(frozen=True, kw_only=True)
class VerifyReply(Message):
    checked: int = wire(Int())
    verified: int = wire(Int())
    bad: list = wire(List(Obj()))
    bytes: int = wire(Int())
    orphan_blobs: int = wire(Int())
    tmp_entries: int = wire(Int())
    seconds: float = wire(Number())


@dataclass(frozen=True, kw_only=True)
class LeaseRequest(Message):
    request: KernelRequest = wire(Kernel())
    ttl_s: float = wire(Number(1, 3600), 120.0, "seconds the lease lasts without a renewal")
    wait_ms: float = wire(Number(0, 60_000), 10_000, "how long to wait on another holder")
    identity: Identity | None = IdentityField()


@dataclass(frozen=True, kw_only=True)
class LeaseReply(Message):
    state: str = wire(Str(32, ("hit", "granted", "wait", "compile_locally")))
    artifact: Artifact | None = wire(Optional(Nested(Artifact)), None)
    lease: str | None = wire(Optional(Str(64)), None)
    ttl_s: float | None = wire(Optional(Number()), None)
    holder_pid: int | None = wire(Optional(Int()), None)
    held_s: float | None = wire(Optional(Number()), None)
    reason: str | None = wire(Optional(Str(1000)), None)


@dataclass(frozen=True, kw_only=True)
class LeaseRenewRequest(Message):
    request: KernelRequest = wire(Kernel())
    lease: str = wire(Str(64))
    ttl_s: float | None = wire(Optional(Number(1, 3600)), None)
    identity: Identity | None = IdentityField()


@dataclass(frozen=True, kw_only=True)
class LeaseRenewReply(Message):
    state: str = wire(Str(32))
    ttl_s: float = wire(Number())


@dataclass(frozen=True, kw_only=True)
class LeaseReleaseRequest(Message):
    request: KernelRequest = wire(Kernel())
    lease: str = wire(Str(64))
    reason: str = wire(Str(1000), "")
    identity: Identity | None = IdentityField()


@dataclass(frozen=True, kw_only=True)
class StateReply(Message):
    state: str = wire(Str(32))


@dataclass(frozen=True, kw_only=True)
class PublishRequest(Message):
    request: KernelRequest = wire(Kernel())
    object_sha256: str = wire(Str(64))
    data: str = wire(Str(MAX_REQUEST_FRAME), "", "base64 of this chunk")
    offset: int = wire(Int(), 0)
    final: bool = wire(Bool(), True)
    compile_seconds: float = wire(Number(0, 1e6), 0.0)
    kernel_name: str | None = wire(Optional(Str(4096)), None,
                                   "the kernel's name, for a family the daemon could compile")
    lease: str = wire(Str(64), "", "the token of the lease this process took on the kernel")
    identity: Identity | None = IdentityField()


@dataclass(frozen=True, kw_only=True)
class PublishReply(Message):
    state: str = wire(Str(32, ("partial", "exists", "stored")))
    received: int | None = wire(Optional(Int()), None)
    key: str | None = wire(Optional(Str(64)), None)
    artifact: Artifact | None = wire(Optional(Nested(Artifact)), None,
                                     "the stored artifact (with state stored or exists)")


@dataclass(frozen=True, kw_only=True)
class PublishBundleRequest(Message):
    """One chunk of one file of a bundle; the bundle is stored, whole, once every file of
    ``files`` has arrived and matches its entry."""

    request: KernelRequest = wire(Kernel())
    files: dict = wire(Obj(MAX_BUNDLE_FILES), doc="the manifest: {name: {sha256, size}}")
    file: str = wire(Str(255), doc="the file (a name in files) this chunk belongs to")
    data: str = wire(Str(MAX_REQUEST_FRAME), "", "base64 of this chunk")
    offset: int = wire(Int(), 0)
    final: bool = wire(Bool(), True, "the last chunk of this file")
    compile_seconds: float = wire(Number(0, 1e6), 0.0)
    lease: str = wire(Str(64), "", "the token of the lease this process took on the kernel")
    identity: Identity | None = IdentityField()

    def __post_init__(self) -> None:
        why = check_manifest(self.files)
        if why is not None:
            raise InvalidArgument(f"files: {why}")
        if self.file not in self.files:
            raise InvalidArgument(f"file {self.file[:80]!r} is not in the bundle's files")


@dataclass(frozen=True, kw_only=True)
class FamilyFilter(Message):
    family: str | None = wire(Optional(Str()), None)


@dataclass(frozen=True, kw_only=True)
class FlashInferArtifactsReply(Message):
    artifacts: list = wire(List(Obj()))
    toolchain: str = wire(Str(1 << 16))


@dataclass(frozen=True, kw_only=True)
class AutotunePutRequest(Message):
    op_name: str = wire(Str(200), doc="the GEMM op (``op`` is the protocol's)")
    n: int = wire(Int(1, 1 << 31))
    k: int = wire(Int(1, 1 << 31))
    dtype: str = wire(Str(200))
    arch: str = wire(Str(200))
    device: str = wire(Str(200))
    bucket: int = wire(Int(1, 1 << 31))
    kernel: str = wire(Str(200))
    tactic: Any = wire(Any_(), None)
    time_us: float = wire(Number(1e-6, 1e9))
    replace: bool = wire(Bool(), False)
    toolchain: str = wire(Str(1 << 16), "", "the fingerprint of the stack that compiled the "
                          "kernel timed (hello's toolchain); empty: not stated")
    reduction_class: str = wire(Str(200), "", "the winner's reduction-order class; when "
                                "stated, the daemon checks the tactic is of it")


@dataclass(frozen=True, kw_only=True)
class AutotunePutReply(Message):
    stored: bool = wire(Bool())


@dataclass(frozen=True, kw_only=True)
class AutotuneGetRequest(Message):
    op_name: str | None = wire(Optional(Str(200)), None)
    n: int | None = wire(Optional(Int(1, 1 << 31)), None)
    k: int | None = wire(Optional(Int(1, 1 << 31)), None)
    dtype: str | None = wire(Optional(Str(200)), None)
    arch: str | None = wire(Optional(Str(200)), None)
    device: str | None = wire(Optional(Str(200)), None)
    toolchain: str | None = wire(Optional(Str(1 << 16)), None)
    reduction_class: str | None = wire(Optional(Str(200)), None)


@dataclass(frozen=True, kw_only=True)
class AutotuneGetReply(Message):
    results: list = wire(List(Obj()))


@dataclass(frozen=True, kw_only=True)
class PlannedRequest(Message):
    family: str | None = wire(Optional(Str()), None)


@dataclass(frozen=True, kw_only=True)
class PlannedReply(Message):
    shapes: list = wire(List(Obj()), [], "each (family, n, k, arch, sm_count, options) a "
                        "client planned on this node, first seen first")


@dataclass(frozen=True, kw_only=True)
class CertifyRecordRequest(Message):
    record: dict = wire(Obj(64), doc="a certification (cached/certifications.py)")


@dataclass(frozen=True, kw_only=True)
class CertifyRecordReply(Message):
    record_id: int = wire(Int())


@dataclass(frozen=True, kw_only=True)
class CertificationsReply(Message):
    certifications: list = wire(List(Obj()))


@dataclass(frozen=True)
class Op:
    """One op: its request and reply types, whether it needs publish rights, and whether
    the daemon remembers its decoded requests (the hot op, whose clients repeat the same
    requests: see ``cached.server.DecodedFrameCache``)."""

    name: str
    request: type[Message]
    reply: type[Message]
    publish: bool
    doc: str
    remember: bool = False


OPS: dict[str, Op] = {op.name: op for op in (
    Op("hello", Empty, HelloReply, False, "who the daemon is and what it serves"),
    Op("get", GetRequest, GetReply, False,
       "the artifact for a kernel request, compiled once if needed; with transfer "
       "'bytes' the library follows as payload", remember=True),
    Op("prefetch", PrefetchRequest, PrefetchReply, False,
       "queue compilations behind waiting clients; answers at once"),
    Op("plan", PlanRequest, PlanReply, False, "a family's tactic space for one shape"),
    Op("stats", Empty, StatsReply, False, "the daemon's statistics (cached stats --json)"),
    Op("zero_stats", Empty, ZeroStatsReply, True,
       "the statistics, then their counters start from zero (cached stats --zero)"),
    Op("list", Empty, ListReply, False, "one row per stored kernel"),
    Op("report", ReportRequest, Empty, False,
       "kernels a client compiled in-process while the daemon was unusable to it"),
    Op("gc", GcRequest, GcReply, True, "evict least recently used entries now"),
    Op("verify", Empty, VerifyReply, True, "recheck every stored blob against its digest"),
    Op("lease", LeaseRequest, LeaseReply, False,
       "write-back: a hit, a lease to compile and publish, or wait"),
    Op("lease_renew", LeaseRenewRequest, LeaseRenewReply, False, "extend a held lease"),
    Op("lease_release", LeaseReleaseRequest, StateReply, False, "give a lease up"),
    Op("publish", PublishRequest, PublishReply, True,
       "write-back: upload an exported object in chunks; the final chunk stores it"),
    Op("publish_bundle", PublishBundleRequest, PublishReply, True,
       "write-back: upload a bundle's files in chunks; the last file's last chunk stores "
       "the bundle, whole"),
    Op("flashinfer_artifacts", FamilyFilter, FlashInferArtifactsReply, False,
       "verified FlashInfer artifacts with their meta, for cached export"),
    Op("autotune_put", AutotunePutRequest, AutotunePutReply, True,
       "share a tuning winner with the node"),
    Op("autotune_get", AutotuneGetRequest, AutotuneGetReply, False,
       "tuning winners recorded on this node (and, with a fleet tier, on its peers)"),
    Op("planned", PlannedRequest, PlannedReply, False,
       "the weight shapes clients have planned on this node (what cached tune --planned "
       "tunes)"),
    Op("certify_record", CertifyRecordRequest, CertifyRecordReply, True,
       "record a batch-invariance certification"),
    Op("certifications", FamilyFilter, CertificationsReply, False,
       "certifications recorded on this node"),
)}
