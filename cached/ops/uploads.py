"""Write-back uploads: a lease holder's exported object, received in chunks and stored.

A ``publish`` request carries a base64 chunk at ``offset``; the ``final`` chunk commits.
The object is checked against ``object_sha256`` and for being ELF, linked into a ``.so``
here (so the only untrusted input is the object, which is exactly what FlashInfer's own
disk cache would have held), and stored like any other artifact; the key's lease ends and
its waiters get the hit. The row carries the publisher's identity (the toolchain and
sources it stated), never the daemon's: it is served only to requests stating the same,
from peers of the publisher's trust group (cached/toolchain/trust.py: stored under that group's key,
the row names the publisher's uid, gid, pid and group and the identity it stated). Only
peers on the publish allowlist reach this op (protocol.OPS), and every chunk needs the
token of the lease that very peer holds on the key (:meth:`Leases.holder`; else
``not_allowed`` and nothing is kept). An upload that stops
arriving is removed ``idle_s`` seconds after its last chunk (setting ``upload_timeout``;
the daemon's flush loop calls :meth:`Uploads.expire`).

``publish_bundle`` is the same for a bundle family's artifacts (cached/families/jit.py):
every chunk names the bundle's manifest (``{name: {sha256, size}}``, the family checks
which files a bundle holds) and the file it belongs to; each file is checked against its
entry when its last chunk arrives, and when every file has, the bundle is stored as one
index row (Store.publish_bundle): whole or not at all. File names are never paths here:
received files are written under the upload's work directory by index.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cached_client import protocol as p
from cached_client.errors import CompileFailed, InvalidArgument, NotAllowed

from cached.toolchain import compiler_stack, trust

from ..families.base import Family
from ..log import event
from ..server import Handler, Peer
from ..store.rows import Entry, row_for
from .leases import Leases

log = logging.getLogger("cached.uploads")

MAX_OBJECT_BYTES = 256 << 20
MAX_BUNDLE_BYTES = 1 << 30
UPLOAD_IDLE_S = 300.0


@dataclass
class Upload:
    path: Path
    size: int = 0
    digest: Any = field(default_factory=hashlib.sha256)
    touched: float = field(default_factory=time.monotonic)


@dataclass
class BundleUpload:
    """A bundle being received: its manifest, its work directory and each file so far."""

    workdir: Path
    files: dict[str, dict]
    received: dict[str, Upload] = field(default_factory=dict)
    complete: set[str] = field(default_factory=set)
    touched: float = field(default_factory=time.monotonic)


class Uploads:
    """Uploads in progress, by (key, object digest) and bundles by (key, manifest digest)."""

    def __init__(self, leases: Leases, idle_s: float = UPLOAD_IDLE_S) -> None:
        self.leases = leases
        self.idle_s = idle_s
        self.scheduler = leases.scheduler
        self.store = leases.scheduler.store
        self.stats = leases.stats
        self.pending: dict[tuple[str, str], Upload] = {}
        self.bundles: dict[tuple[str, str], BundleUpload] = {}

    def _discard(self, id_: tuple[str, str]) -> None:
        upload = self.pending.pop(id_, None)
        if upload is not None:
            shutil.rmtree(upload.path.parent, ignore_errors=True)

    def _discard_bundle(self, id_: tuple[str, str]) -> None:
        bundle = self.bundles.pop(id_, None)
        if bundle is not None:
            shutil.rmtree(bundle.workdir, ignore_errors=True)

    def expire(self, now: float | None = None) -> int:
        """Remove uploads idle for ``idle_s``; returns how many."""
        now = time.monotonic() if now is None else now
        stale = [i for i, u in self.pending.items() if now - u.touched > self.idle_s]
        for id_ in stale:
            self._discard(id_)
        stale_bundles = [i for i, b in self.bundles.items() if now - b.touched > self.idle_s]
        for id_ in stale_bundles:
            self._discard_bundle(id_)
        if stale or stale_bundles:
            event(log, logging.INFO, "writeback.uploads_expired",
                  count=len(stale) + len(stale_bundles), idle_s=self.idle_s)
        return len(stale) + len(stale_bundles)

    async def publish(self, m: p.PublishRequest, peer: Peer) -> p.PublishReply:
        """Receive one chunk; the final one is verified, linked, stored and served."""
        self.leases.check_enabled()
        family, request, route = self.leases.resolve(m.request, m.identity)
        if family.bundle:
            raise InvalidArgument(f"{family.name} artifacts are bundles: publish them with "
                                  "publish_bundle")
        key = self.leases.keys(route, peer)[0]
        kernel_name, symbol = family.published_name(request, m.kernel_name)
        if not p.HEX64_RE.match(m.object_sha256):
            raise InvalidArgument("publish needs object_sha256: 64 lowercase hex digits")
        id_ = (key, m.object_sha256)
        if self.store.contains(key):
            self._discard(id_)
            return p.PublishReply(state="exists")
        self._holder(key, m.lease, peer, family)
        try:
            data = base64.b64decode(m.data, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidArgument("publish data must be base64") from None
        self.expire()
        upload = self.pending.get(id_)
        if m.offset == 0:
            self._discard(id_)
            upload = self.pending[id_] = Upload(self.store.workdir() / "published.o")
        elif upload is None or m.offset != upload.size:
            raise InvalidArgument(f"publish chunk at offset {m.offset} does not continue the "
                                  "upload; start again at offset 0")
        if upload.size + len(data) > MAX_OBJECT_BYTES:
            self._discard(id_)
            raise InvalidArgument(f"object larger than {MAX_OBJECT_BYTES} bytes")
        with open(upload.path, "ab") as f:
            f.write(data)
        upload.size += len(data)
        upload.digest.update(data)
        upload.touched = time.monotonic()
        if not m.final:
            return p.PublishReply(state="partial", received=upload.size)
        del self.pending[id_]
        workdir = upload.path.parent
        try:
            self._holder(key, m.lease, peer, family)  # still, after the last chunk
            if upload.digest.hexdigest() != m.object_sha256:
                raise InvalidArgument("published object does not match its object_sha256")
            with open(upload.path, "rb") as f:
                if f.read(4) != b"\x7fELF":
                    raise InvalidArgument("published object is not an ELF object file")
            entry = await asyncio.get_running_loop().run_in_executor(
                None, self._commit, family, request, route, (kernel_name, symbol), upload.path,
                m, key, self._provenance(key, peer, m.identity))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        self.leases.settle(key)
        self.stats.count("writeback.published")
        self.stats.count("published", family.name)
        self.stats.count("bytes_published", family.name, entry.row.object_size)
        event(log, logging.INFO, "writeback.published", key=key[:16], pid=peer.pid,
              family=family.name, kernel=kernel_name[:120], bytes=entry.row.object_size,
              toolchain=route.toolchain[-24:])
        return p.PublishReply(state="stored", key=key,
                              artifact=self.leases.served.artifact(entry, "compiled"))

    def _holder(self, key: str, token: str, peer: Peer, family: Family) -> None:
        """NotAllowed (counted and logged) unless ``peer`` holds the lease on ``key``."""
        try:
            self.leases.holder(key, token, peer)
        except NotAllowed as exc:
            self.stats.count("writeback.publish_refused")
            event(log, logging.WARNING, "writeback.publish_refused", key=key[:16],
                  pid=peer.pid, uid=peer.uid, family=family.name, reason=exc.message[:200])
            raise

    def _provenance(self, key: str, peer: Peer, identity: p.Identity | None) -> dict:
        """The row's record of its publisher and the identity it stated (cached/toolchain/trust.py);
        the group is the one whose key the lease was on."""
        lease = self.leases.held[key]
        return trust.provenance(lease.uid, peer.gid, lease.pid, self.leases.access.group(peer),
                                identity)

    def _commit(self, family: Family, request: Any, route: Any, names: tuple[str, str],
                object_path: Path, m: p.PublishRequest, key: str, provenance: dict) -> Entry:
        library_path = object_path.with_suffix(".so")
        try:
            compiler_stack.link_shared_library(object_path, library_path)
        except RuntimeError as exc:
            raise CompileFailed(f"the published object does not link: {exc}") from None
        meta: dict[str, Any] = {**provenance,
                                "runtime_library": compiler_stack.RUNTIME_LIBRARY_NAME}
        if family.sources == "params":  # flashinfer.jit: FlashInfer's module and its sources
            meta.update({"flashinfer_module": request.params["module"],
                         "flashinfer_source_sha256": request.params["source_sha256"],
                         "tvm_ffi": request.params["tvm_ffi"]})
        elif family.sources == "flashinfer":  # exported as <module>_<kernel>
            meta["flashinfer_module"] = names[1][:-(len(names[0]) + 1)]
        row = row_for(key, request, kernel_name=names[0], symbol=names[1],
                      toolchain=route.toolchain, source_sha256=route.source_sha256,
                      compile_seconds=m.compile_seconds, meta=meta)
        return self.store.publish(row, object_path, library_path)

    async def publish_bundle(self, m: p.PublishBundleRequest, peer: Peer) -> p.PublishReply:
        """Receive one chunk of one file of a bundle; when every file has arrived and
        matches its manifest entry, store the bundle (one row) and serve it."""
        self.leases.check_enabled()
        family, request, route = self.leases.resolve(m.request, m.identity)
        if not family.bundle:
            raise InvalidArgument(f"{family.name} artifacts are objects: publish them with "
                                  "publish")
        family.check_files(request.params, m.files)
        key = self.leases.keys(route, peer)[0]
        total = sum(f["size"] for f in m.files.values())
        if total > MAX_BUNDLE_BYTES or any(f["size"] > MAX_OBJECT_BYTES
                                            for f in m.files.values()):
            raise InvalidArgument(f"a bundle is at most {MAX_BUNDLE_BYTES} bytes, each file "
                                  f"at most {MAX_OBJECT_BYTES}")
        id_ = (key, hashlib.sha256(json.dumps(m.files, sort_keys=True).encode()).hexdigest())
        if self.store.contains(key):
            self._discard_bundle(id_)
            entry = await self.scheduler.lookup(key)
            if entry is not None and not trust.may_serve(entry.row,
                                                         self.leases.access.group(peer)):
                entry = None
            return p.PublishReply(state="exists", key=key, artifact=(
                self.leases.served.artifact(entry, "hit") if entry is not None else None))
        self._holder(key, m.lease, peer, family)
        try:
            data = base64.b64decode(m.data, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidArgument("publish_bundle data must be base64") from None
        self.expire()
        bundle = self.bundles.get(id_)
        if bundle is None:
            if m.offset != 0:
                raise InvalidArgument(f"publish_bundle chunk at offset {m.offset} of a bundle "
                                      "not being received; start again at offset 0")
            bundle = self.bundles[id_] = BundleUpload(self.store.workdir(), dict(m.files))
        bundle.touched = time.monotonic()
        expected = m.files[m.file]
        upload = bundle.received.get(m.file)
        if m.offset == 0:  # (re)start this file
            index = sorted(m.files).index(m.file)
            upload = bundle.received[m.file] = Upload(bundle.workdir / f"file-{index}")
            upload.path.write_bytes(b"")
            bundle.complete.discard(m.file)
        elif upload is None or m.offset != upload.size or m.file in bundle.complete:
            raise InvalidArgument(f"publish_bundle chunk of {m.file!r} at offset {m.offset} "
                                  "does not continue its upload; start that file again at 0")
        if upload.size + len(data) > expected["size"]:
            self._discard_bundle(id_)
            raise InvalidArgument(f"{m.file!r} is larger than the {expected['size']} bytes "
                                  "its manifest entry says; the bundle upload was dropped")
        with open(upload.path, "ab") as f:
            f.write(data)
        upload.size += len(data)
        upload.digest.update(data)
        if m.final:
            if upload.size != expected["size"] or upload.digest.hexdigest() != expected["sha256"]:
                self._discard_bundle(id_)
                raise InvalidArgument(f"{m.file!r} does not match its manifest entry (size "
                                      "and sha256); the bundle upload was dropped")
            bundle.complete.add(m.file)
        if bundle.complete != set(bundle.files):
            return p.PublishReply(state="partial", received=upload.size)
        del self.bundles[id_]
        try:
            self._holder(key, m.lease, peer, family)  # still, after the last chunk
            entry = await asyncio.get_running_loop().run_in_executor(
                None, self._commit_bundle, family, request, route, bundle, m, key,
                self._provenance(key, peer, m.identity))
        finally:
            shutil.rmtree(bundle.workdir, ignore_errors=True)
        self.leases.settle(key)
        self.stats.count("writeback.published")
        self.stats.count("published", family.name)
        self.stats.count("bytes_published", family.name, entry.row.size)
        event(log, logging.INFO, "writeback.published", key=key[:16], pid=peer.pid,
              family=family.name, kernel=entry.row.kernel_name[:120],
              bytes=entry.row.size, files=len(bundle.files),
              toolchain=route.toolchain[-24:])
        return p.PublishReply(state="stored", key=key,
                              artifact=self.leases.served.artifact(entry, "compiled"))

    def _commit_bundle(self, family: Family, request: Any, route: Any, bundle: BundleUpload,
                       m: p.PublishBundleRequest, key: str, provenance: dict) -> Entry:
        kernel_name, symbol = family.published_name(request, None)
        row = row_for(key, request, kernel_name=kernel_name, symbol=symbol,
                      toolchain=route.toolchain, source_sha256=route.source_sha256,
                      compile_seconds=m.compile_seconds, meta=provenance)
        return self.store.publish_bundle(row, {name: u.path
                                               for name, u in bundle.received.items()})

    def ops(self) -> dict[str, Handler]:
        return {"publish": self.publish, "publish_bundle": self.publish_bundle}
