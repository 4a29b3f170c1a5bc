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

Ops: :data:`OPS`, the one op table, maps each op's name to its request and reply types
(frozen dataclasses in :mod:`cached_client.messages` whose fields are declared with a wire
check from :mod:`cached_client.wire`; all re-exported here) and to whether it needs a peer
allowed to publish. The daemon decodes a request once, at its edge
(:meth:`Message.from_wire`): a missing or ill-typed field is
:class:`~cached_client.errors.InvalidArgument` naming the field; unknown fields are ignored
(a newer peer may send more). The client decodes replies with the same checks, so a
malformed reply is a typed error, never a ``KeyError``.

Invariants: a request frame is at most :data:`MAX_REQUEST_FRAME` bytes and a reply frame
at most :data:`MAX_REPLY_FRAME`; JSON nesting deeper than :data:`MAX_DEPTH` is refused
before it is parsed; numbers are finite (NaN and Infinity are not JSON, and a number too
large for a double, such as ``1e999``, is refused rather than read as infinity).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any

from .errors import MalformedFrame
from .messages import (  # noqa: F401 -- the protocol's surface, in one place
    MAX_BUCKETS,
    MAX_GET_BATCH,
    Artifact,
    AutotuneGetReply,
    AutotuneGetRequest,
    AutotunePutReply,
    AutotunePutRequest,
    CertificationsReply,
    CertifyRecordReply,
    CertifyRecordRequest,
    Empty,
    FamilyFilter,
    FlashInferArtifactsReply,
    GcReply,
    GcRequest,
    GetBatchItem,
    GetBatchReply,
    GetBatchRequest,
    GetReply,
    GetRequest,
    HelloReply,
    Identity,
    IdentityField,
    LeaseReleaseRequest,
    LeaseRenewReply,
    LeaseRenewRequest,
    LeaseReply,
    LeaseRequest,
    ListReply,
    PlannedBucket,
    PlannedReply,
    PlannedRequest,
    PlanReply,
    PlanRequest,
    PlanShapeReply,
    PlanShapeRequest,
    PrefetchReply,
    PrefetchRequest,
    PublishBundleRequest,
    PublishReply,
    PublishRequest,
    ReportRequest,
    StateReply,
    StatsReply,
    VerifyReply,
    ZeroStatsReply,
)
from .wire import (  # noqa: F401 -- the protocol's surface, in one place
    BLOB_KINDS,
    BLOB_SUFFIXES,
    BUNDLE_NAME,
    HEX64_RE,
    KINDS,
    MAX_BUNDLE_FILES,
    MAX_DEADLINE_MS,
    MAX_REQUEST_FRAME,
    PRIORITIES,
    TRANSFERS,
    Any_,
    Bool,
    Check,
    Int,
    Kernel,
    List,
    Message,
    Nested,
    Number,
    Obj,
    Optional,
    Str,
    check_manifest,
    hex64,
    wire,
)

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = (1,)
MAX_REPLY_FRAME = 64 << 20
MAX_DEPTH = 32
HEADER = struct.Struct(">I")
CAPABILITIES = ("transfer:path", "transfer:bytes", "transfer:fd", "identity:keys",
                "identity:artifact")
"""What ``hello`` offers beyond its ``ops`` list: each ``get`` transfer; ``identity:keys``,
keys built from the identity a request states (docs/keys.md); ``identity:artifact``, every
artifact states what it was built for (toolchain, runtime, sources, arch, device), which
the client checks against its own identity before loading anything (cached_client.trust)."""

# -- frames ------------------------------------------------------------------------------


def encode_frame(message: dict) -> bytes:
    """One frame: length header plus compact JSON (finite numbers only), keys sorted, but an
    integer ``id`` first: ``{"id":N,...}``, so that frames asking the same differ only in
    their leading digits (the daemon remembers decoded requests by the bytes after them:
    ``cached.frames.DecodedFrameCache``)."""
    request_id = message.get("id")
    if type(request_id) is int and len(message) > 1:
        return frame_after_id(request_id,
                              encode_after_id({k: v for k, v in message.items() if k != "id"}))
    body = _FRAME_JSON(message).encode()
    return HEADER.pack(len(body)) + body


def encode_after_id(members: dict) -> bytes:
    """What follows ``{"id":N,`` in :func:`encode_frame`'s frame of ``members`` (a non-empty
    object without ``id``) under an integer id N: encode it once, send it under many ids."""
    return _FRAME_JSON(members)[1:].encode()


def frame_after_id(request_id: int, tail: bytes) -> bytes:
    """The frame of integer id ``request_id`` and an :func:`encode_after_id` tail: the very
    bytes :func:`encode_frame` writes for that object with that id."""
    body = b'{"id":%d,' % request_id + tail
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


@dataclass(frozen=True)
class Op:
    """One op: its request and reply types, whether it needs publish rights, and whether
    the daemon remembers its decoded requests (the hot op, whose clients repeat the same
    requests: see ``cached.frames.DecodedFrameCache``)."""

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
    Op("get_batch", GetBatchRequest, GetBatchReply, False,
       "several gets in one reply (transfer fd or path); each item an artifact or its error"),
    Op("prefetch", PrefetchRequest, PrefetchReply, False,
       "queue compilations behind waiting clients; answers at once"),
    Op("plan", PlanRequest, PlanReply, False, "a family's tactic space for one shape"),
    Op("plan_shape", PlanShapeRequest, PlanShapeReply, False,
       "one weight shape's tactic per M bucket (shared winners applied), optionally "
       "prefetched"),
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
