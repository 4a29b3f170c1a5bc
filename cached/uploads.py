"""Write-back uploads: a lease holder's exported object, received in chunks and stored.

A ``publish`` request carries a base64 chunk at ``offset``; the ``final`` chunk commits.
The object is checked against ``object_sha256`` and for being ELF, linked into a ``.so``
here (so the only untrusted input is the object, which is exactly what FlashInfer's own
disk cache would have held), and stored like any other artifact; the key's lease ends and
its waiters get the hit. The row carries the publisher's identity (the toolchain and
sources it stated), never the daemon's: it is served only to requests stating the same.
Only peers on the publish allowlist reach this op (protocol.OPS). An upload that stops
arriving is removed ``idle_s`` seconds after its last chunk (setting ``upload_timeout``;
the daemon's flush loop calls :meth:`Uploads.expire`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cached_client import protocol as p
from cached_client.errors import CompileFailed, InvalidArgument

from . import toolchain
from .families.base import Family
from .families.flashinfer_jit import HEX64_RE
from .leases import Leases
from .log import event
from .server import Handler, Peer
from .store import Entry, row_for

log = logging.getLogger("cached.uploads")

MAX_OBJECT_BYTES = 256 << 20
UPLOAD_IDLE_S = 300.0


@dataclass
class Upload:
    path: Path
    size: int = 0
    digest: Any = field(default_factory=hashlib.sha256)
    touched: float = field(default_factory=time.monotonic)


class Uploads:
    """Uploads in progress, by (key, object digest)."""

    def __init__(self, leases: Leases, idle_s: float = UPLOAD_IDLE_S) -> None:
        self.leases = leases
        self.idle_s = idle_s
        self.scheduler = leases.scheduler
        self.store = leases.scheduler.store
        self.stats = leases.stats
        self.pending: dict[tuple[str, str], Upload] = {}

    def _discard(self, id_: tuple[str, str]) -> None:
        upload = self.pending.pop(id_, None)
        if upload is not None:
            shutil.rmtree(upload.path.parent, ignore_errors=True)

    def expire(self, now: float | None = None) -> int:
        """Remove uploads idle for ``idle_s``; returns how many."""
        now = time.monotonic() if now is None else now
        stale = [i for i, u in self.pending.items() if now - u.touched > self.idle_s]
        for id_ in stale:
            self._discard(id_)
        if stale:
            event(log, logging.INFO, "writeback.uploads_expired", count=len(stale),
                  idle_s=self.idle_s)
        return len(stale)

    async def publish(self, m: p.PublishRequest, peer: Peer) -> p.PublishReply:
        """Receive one chunk; the final one is verified, linked, stored and served."""
        family, request, route = self.leases.resolve(m.request, m.identity)
        key = route.key
        kernel_name, symbol = family.published_name(request, m.kernel_name)
        if not HEX64_RE.match(m.object_sha256):
            raise InvalidArgument("publish needs object_sha256: 64 lowercase hex digits")
        id_ = (key, m.object_sha256)
        if self.store.contains(key):
            self._discard(id_)
            return p.PublishReply(state="exists")
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
            if upload.digest.hexdigest() != m.object_sha256:
                raise InvalidArgument("published object does not match its object_sha256")
            with open(upload.path, "rb") as f:
                if f.read(4) != b"\x7fELF":
                    raise InvalidArgument("published object is not an ELF object file")
            entry = await asyncio.get_running_loop().run_in_executor(
                None, self._commit, family, request, route, (kernel_name, symbol), upload.path,
                m)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        self.leases.settle(key)
        self.stats.count("writeback.published")
        event(log, logging.INFO, "writeback.published", key=key[:16], pid=peer.pid,
              family=family.name, kernel=kernel_name[:120], bytes=entry.row["object_size"],
              toolchain=route.toolchain[-24:])
        return p.PublishReply(state="stored", key=key)

    def _commit(self, family: Family, request: Any, route: Any, names: tuple[str, str],
                object_path: Path, m: p.PublishRequest) -> Entry:
        library_path = object_path.with_suffix(".so")
        try:
            toolchain.link_shared_library(object_path, library_path)
        except RuntimeError as exc:
            raise CompileFailed(f"the published object does not link: {exc}") from None
        meta: dict[str, Any] = {"origin": "write-back",
                                "runtime_library": toolchain.RUNTIME_LIBRARY_NAME}
        if family.sources == "params":  # flashinfer.jit: FlashInfer's module and its sources
            meta.update({"flashinfer_module": request.params["module"],
                         "flashinfer_source_sha256": request.params["source_sha256"],
                         "tvm_ffi": request.params["tvm_ffi"]})
        elif family.sources == "flashinfer":  # exported as <module>_<kernel>
            meta["flashinfer_module"] = names[1][:-(len(names[0]) + 1)]
        row = row_for(route.key, request, kernel_name=names[0], symbol=names[1],
                      toolchain=route.toolchain, source_sha256=route.source_sha256,
                      compile_seconds=m.compile_seconds, meta=meta)
        return self.store.publish(row, object_path, library_path)

    def ops(self) -> dict[str, Handler]:
        return {"publish": self.publish}
