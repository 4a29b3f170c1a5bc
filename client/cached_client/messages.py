"""Every op's request and reply: frozen dataclasses whose fields carry their wire check
(:func:`cached_client.wire.wire`); :data:`cached_client.protocol.OPS` names which op each
serves. Invariant: decoding (``from_wire``) either yields a message whose every field passed
its check, or raises InvalidArgument naming the field; unknown fields are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidArgument
from .keys import KernelRequest
from .wire import (
    BLOB_KINDS,
    KINDS,
    MAX_BUNDLE_FILES,
    MAX_DEADLINE_MS,
    MAX_REQUEST_FRAME,
    PRIORITIES,
    TRANSFERS,
    Any_,
    Bool,
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
            hex64(sha, f"identity.sources[{family[:200]!r}]")
        for name, value in self.runtime.items():
            Optional(Str(128))(value, f"identity.runtime[{str(name)[:40]!r}]")


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
    toolchains: list = wire(
        List(Obj(), 64), [], "each registered toolchain (cached toolchains), with the "
        "``records`` its probe hashed (cached_client.identity.ComponentCache.adopt)")


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
    record: dict = wire(Obj(64), doc="a certification (cached/ops/certifications.py)")


@dataclass(frozen=True, kw_only=True)
class CertifyRecordReply(Message):
    record_id: int = wire(Int())


@dataclass(frozen=True, kw_only=True)
class CertificationsReply(Message):
    certifications: list = wire(List(Obj()))


MAX_BUCKETS = 64
"""M buckets one ``plan_shape`` may ask (2**63 is 64 powers of two)."""


@dataclass(frozen=True, kw_only=True)
class PlanShapeRequest(Message):
    """One weight shape's plan: (family, N, K, scheme ``options``) at each M bucket."""

    family: str = wire(Str())
    n: int = wire(Int(1, 1 << 31))
    k: int = wire(Int(1, 1 << 31))
    buckets: list = wire(List(Int(1, 1 << 31), MAX_BUCKETS), doc="increasing M upper bounds")
    arch: str = wire(Str(32))
    sm_count: int | None = wire(Optional(Int(1, 1 << 16)), None)
    options: dict = wire(Obj(64), {}, "the family's plan options (as plan's)")
    batch_invariant: bool = wire(Bool(), True, "one reduction-order class for every M")
    op_name: str = wire(Str(200), "linear", "the GEMM op the shared winners are filed under")
    dtype: str = wire(Str(200), "fp8", "the dtype the shared winners are filed under")
    device: str | None = wire(Optional(Str(200)), None, "with a device: the node's shared "
                              "autotune winners for it override the plan's first tactic "
                              "where they are tactics of the plan (of its class)")
    prefetch: bool = wire(Bool(), False, "also queue the chosen kernels (as prefetch)")
    identity: Identity | None = IdentityField()

    def __post_init__(self) -> None:
        if not self.buckets or self.buckets != sorted(set(self.buckets)):
            raise InvalidArgument(f"buckets must be increasing positive M bounds, got "
                                  f"{self.buckets[:8]!r}")


@dataclass(frozen=True, kw_only=True)
class PlannedBucket(Message):
    """The tactic that serves M <= ``upper`` (above the previous bucket's upper)."""

    upper: int = wire(Int(1, 1 << 31))
    request: KernelRequest = wire(Kernel())
    reduction_class: str | None = wire(Optional(Str()), None, "null: the family declares none")
    source: str = wire(Str(32, ("autotune", "plan order")), "plan order")


@dataclass(frozen=True, kw_only=True)
class PlanShapeReply(Message):
    buckets: list = wire(List(Nested(PlannedBucket), MAX_BUCKETS),
                         doc="one per requested bucket, in order")
    warnings: list = wire(List(Str(2000), MAX_BUCKETS), [],
                          "shared winners not taken, and why")
    prefetch: PrefetchReply | None = wire(Optional(Nested(PrefetchReply)), None,
                                          "with prefetch: what was queued")


MAX_GET_BATCH = 64
"""Requests one ``get_batch`` may carry (with two blobs each, 128 descriptors)."""


@dataclass(frozen=True, kw_only=True)
class GetBatchRequest(Message):
    """Several ``get`` requests answered in one reply; transfer ``fd`` or ``path``."""

    requests: list = wire(List(Kernel(), MAX_GET_BATCH), doc="kernel requests")
    deadline_ms: float = wire(Number(1, MAX_DEADLINE_MS), 60_000, "for all of them")
    priority: str = wire(Str(choices=PRIORITIES), "interactive")
    transfer: str = wire(Str(choices=("fd", "path")), "path")
    blobs: list = wire(List(Str(16, BLOB_KINDS), 2), list(BLOB_KINDS),
                       "transfer 'fd': the blobs whose descriptors to pass, per request")
    identity: Identity | None = IdentityField()

    def __post_init__(self) -> None:
        if not self.requests:
            raise InvalidArgument("get_batch.requests must name at least one kernel")
        if not self.blobs or len(set(self.blobs)) != len(self.blobs):
            raise InvalidArgument("get_batch.blobs must name 'object', 'library' or both, "
                                  "once each")


@dataclass(frozen=True, kw_only=True)
class GetBatchItem(Message):
    """One request's answer: its artifact (and the blobs whose descriptors follow, in
    order, after those of the items before it), or its typed error."""

    artifact: Artifact | None = wire(Optional(Nested(Artifact)), None)
    fds: list = wire(List(Str(16, BLOB_KINDS), 2), [])
    error: dict | None = wire(Optional(Obj(8)), None, "{code, message}, as an error reply's")

    def __post_init__(self) -> None:
        if (self.artifact is None) == (self.error is None):
            raise InvalidArgument("a get_batch item has exactly one of artifact and error")


@dataclass(frozen=True, kw_only=True)
class GetBatchReply(Message):
    items: list = wire(List(Nested(GetBatchItem), MAX_GET_BATCH), doc="one per request, in order")
    fds: list = wire(List(Str(16, BLOB_KINDS), 2 * MAX_GET_BATCH), [],
                     "every item's descriptors, in order (what the frame carries)")
