"""How a stored entry is served: its wire ``Artifact`` and its blobs opened for a transfer.

The one place where an entry becomes what the protocol sends (``get``, ``lease``,
``publish``, a client's fallback build): :func:`make_artifact` describes it
(:meth:`Served.artifact` for a stored one), :func:`open_blobs` opens the blobs a
transfer ``fd`` passes, :func:`open_checked_library` the library a transfer ``bytes``
streams. Every descriptor is opened by :func:`cached.store.blobs.open_served` (no link
followed, no FIFO blocked on, only a regular file of the indexed size).
"""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING

from cached_client import protocol as p
from cached_client.trust import RUNTIME_KEYS

from .store.blobs import BadBlob, open_served
from .store.rows import SUFFIXES, Entry, Row

if TYPE_CHECKING:
    from cached.toolchain.toolchains import Toolchains

    from .store.store import Store

RUNTIMES_MAX = 4096
"""Toolchain fingerprints whose runtime is remembered (the toolchains are fixed for the
daemon's life; the bound only caps what rows naming unknown ones can add)."""
REPLIES_MAX = 4096
"""Encoded ``get`` hit replies :meth:`Served.get_reply` holds (one per stored row version,
transfer and blob kinds; about 1.5 KB each)."""


def make_artifact(entry: Entry, *, origin: str, runtime_library: dict[str, str | None],
                  runtime: dict[str, str | None], paths: bool = True) -> p.Artifact:
    """The one way an entry becomes the wire ``Artifact`` (a stored one, an unstored one,
    a client's fallback build): its row's fields, ``origin``, the runtime library it links
    against and the runtime that built it, and its blob paths unless not ``paths``. A
    bundle has no object or library but its files, each with its blob's path."""
    r = entry.row
    common = dict(key=r.key, family=r.family, kernel_name=r.kernel_name,
                  toolchain=r.toolchain, source_sha256=r.source_sha256, origin=origin,
                  arch=r.arch, sm_count=r.sm_count, max_active_clusters=r.max_active_clusters,
                  runtime=dict(runtime), compile_seconds=r.compile_seconds)
    if entry.kind == "bundle":
        return p.Artifact(
            **common, symbol="", library_sha256="", object_sha256="", runtime_library={},
            kind="bundle",
            files=[{"name": name, "sha256": f["sha256"], "size": f["size"],
                    "path": str(entry.files[name]) if paths else None}
                   for name, f in sorted(r.manifest().items())])
    return p.Artifact(
        **common, symbol=r.symbol, library_sha256=r.library_sha256,
        object_sha256=r.object_sha256, library_size=r.library_size,
        object_size=r.object_size, runtime_library=runtime_library,
        library_path=str(entry.library_path) if paths else None,
        object_path=str(entry.object_path) if paths else None)


class Served:
    """Describes stored entries for the wire, with the registered toolchains' runtimes."""

    def __init__(self, toolchains: Toolchains) -> None:
        self.toolchains = toolchains
        self._runtimes: dict[str, dict] = {}  # fingerprint -> runtime: _runtime
        self._replies: dict[tuple[str, str, tuple[str, ...]],
                            tuple[Row, p.GetReply, bytes]] = {}  # get_reply's hits

    def get_reply(self, entry: Entry, origin: str, transfer: str,
                  kinds: tuple[str, ...] = ()) -> tuple[p.GetReply, bytes | None]:
        """The reply to a ``get`` of the stored ``entry`` by ``transfer`` (``fd``, passing
        the blobs of ``kinds``, or ``path``) and, for a ``hit``, that reply's frame after its
        leading id (cached_client.protocol.encode_after_id: the server sends it under each
        request's id; None for any other origin). A hit's is made once per row version,
        transfer and kinds, then reused: a reply is a function of those alone (the row's
        columns; its blob paths, which derive from its digests; the runtime of the
        toolchain it names, fixed for the daemon's life), and a version is every column
        but the hit count and last use (Row.same_version), so a row published again,
        rebuilt or changed in any column is encoded anew, never answered with an older
        version's reply (tests/test_served_replies.py). It states nothing that is checked
        here: the blobs are still opened and checked for each request, and the client
        still hashes what it loads. At most :data:`REPLIES_MAX` are held (when full it
        starts over)."""
        if origin != "hit":
            return self._reply(entry, origin, transfer, kinds), None
        slot = (entry.row.key, transfer, kinds)
        held = self._replies.get(slot)
        if held is not None and held[0].same_version(entry.row):
            return held[1], held[2]
        reply = self._reply(entry, origin, transfer, kinds)
        tail = p.encode_after_id({"ok": True, **reply.to_wire()})
        if len(self._replies) >= REPLIES_MAX:
            self._replies.clear()
        self._replies[slot] = (entry.row, reply, tail)
        return reply, tail

    def prime(self, entry: Entry) -> None:
        """Encode now the hit reply a client's ``load`` asks of ``entry`` (transfer ``fd``,
        the library alone: cached_client.Client.load), so that after a pre-warm (``cached
        warm``) a node's first process finds it made."""
        self.get_reply(entry, "hit", "fd", ("library",))

    def _reply(self, entry: Entry, origin: str, transfer: str,
               kinds: tuple[str, ...]) -> p.GetReply:
        if transfer == "fd":
            return p.GetReply(artifact=self.artifact(entry, origin, False), fds=list(kinds))
        return p.GetReply(artifact=self.artifact(entry, origin))

    def artifact(self, entry: Entry, origin: str, paths: bool = True) -> p.Artifact:
        """How the protocol describes a stored entry (:func:`make_artifact`), with the
        runtime library and runtime of the registered toolchain it names."""
        toolchain = entry.row.toolchain
        return make_artifact(
            entry, origin=origin, paths=paths, runtime=self._runtime(toolchain),
            runtime_library={} if entry.kind == "bundle"
            else self.toolchains.runtime_library(toolchain))

    def _runtime(self, fingerprint: str) -> dict:
        """What an artifact states it was built by (protocol capability
        ``identity:artifact``): the runtime of the toolchain whose fingerprint it carries
        ({} for one not registered here); its arch and device facts are its row's."""
        runtime = self._runtimes.get(fingerprint)
        if runtime is None:
            t = self.toolchains.by_fingerprint(fingerprint)
            runtime = {} if t is None else {k: t.runtime.get(k) for k in RUNTIME_KEYS}
            if len(self._runtimes) < RUNTIMES_MAX:
                self._runtimes[fingerprint] = runtime
        return runtime


def open_blobs(entry: Entry, kinds: list[str]) -> list[int]:
    """Descriptors of the entry's blobs of ``kinds`` ("object", "library"), in that order:
    all or none (BadBlob, FileNotFoundError or Overloaded from :func:`open_served`)."""
    fds: list[int] = []
    try:
        for kind in kinds:
            path = entry.object_path if kind == "object" else entry.library_path
            fds.append(open_served(path, entry.row.object_size if kind == "object"
                                     else entry.row.library_size))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def open_checked_library(store: Store, entry: Entry) -> int:
    """The library's descriptor after its digest is checked through that descriptor (unless
    the file it opened is the one the store checked last: :meth:`Store.unchanged`), so the
    bytes sent (from offset 0) are the bytes checked."""
    fd = open_served(entry.library_path, entry.row.library_size)
    if store.unchanged(entry.row.library_sha256, SUFFIXES["library"], os.fstat(fd)):
        return fd
    digest, offset = hashlib.sha256(), 0
    while chunk := os.pread(fd, 1 << 20, offset):
        digest.update(chunk)
        offset += len(chunk)
    if digest.hexdigest() != entry.row.library_sha256:
        os.close(fd)
        raise BadBlob("library blob changed while being read", True)
    return fd
