"""Write-back: kernels the daemon has no recipe for, compiled once per node by a client.

Many FlashInfer CuTe-DSL kernels are built by ``build_and_load_cute_dsl_kernel`` from a
compile closure the daemon cannot rebuild. For those, the first process that needs a key
takes a *lease*, compiles, and publishes the exported object; processes asking for the same
key meanwhile wait on the lease instead of compiling. A lease ends when its holder publishes
or releases it, when its time-to-live passes without a renewal (a stalled holder), or when
its holder process is gone (watched through a pidfd opened from SO_PEERCRED's pid, checked
every ``POLL_S``: no /proc involved, so it holds under systemd's ProtectProc=invisible and
ProcSubset=pid, and a reused pid cannot pass for the holder); the next waiter then gets it.

Published objects are stored like any other artifact: the daemon links the ``.so`` itself
from the received ``.o`` (so the only untrusted input is the object, which is exactly what
FlashInfer's own disk cache would have held; every entry keeps both blobs, so lookup, scan,
eviction and the thin client's loader work unchanged). Only peers on the daemon's publish
allowlist may publish; a peer that may not is told to compile locally instead of being
handed a lease it could never fulfil.

Also here: shared autotune results (``autotune_put`` / ``autotune_get``): one process tunes,
the others on the node reuse the winner per (op, N, K, dtype, arch, device, M bucket).

Ops (docs/integration.md): ``lease``, ``lease_renew``, ``lease_release``, ``publish``
(allowlisted), ``flashinfer_artifacts``, ``autotune_put`` (allowlisted), ``autotune_get``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import logging
import os
import re
import secrets
import select
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cached_client.errors import CompileFailed, InvalidTactic
from cached_client.keys import ARCHES, KernelRequest

from . import toolchain
from .families.base import BuiltObject, Family, require
from .log import event

log = logging.getLogger("cached.writeback")

FAMILY = "flashinfer.jit"
DEFAULT_TTL_S = 120.0
MAX_TTL_S = 3600.0
DEFAULT_WAIT_MS = 10_000
MAX_WAIT_MS = 60_000
POLL_S = 0.25
MAX_OBJECT_BYTES = 256 << 20
SYMBOL_RE = re.compile(r"^[0-9A-Za-z_]{1,512}$")
HEX64_RE = re.compile(r"^[0-9a-f]{64}$")
FLASHINFER_FAMILIES = ("flashinfer.mm_fp4", "flashinfer.bi.bmm_fp8", "flashinfer.bi.mm_fp4",
                       FAMILY)


class FlashInferJit(Family):
    """A FlashInfer CuTe-DSL kernel keyed as FlashInfer keys it: module, kernel name, export
    format and FlashInfer's source hash of its key files (plus arch, device and toolchain).
    The daemon has no recipe: artifacts arrive by write-back only."""

    name = FAMILY
    arches = ARCHES

    def canonical_params(self, params: Mapping[str, Any], arch: str) -> dict:
        unknown = sorted(set(params) - {"module", "kernel", "tvm_ffi", "source_sha256"})
        if unknown:
            raise InvalidTactic(f"{self.name} has no parameter(s) {', '.join(unknown)}")
        out = {}
        for name in ("module", "kernel"):
            value = params.get(name)
            if not isinstance(value, str) or not SYMBOL_RE.match(value):
                raise InvalidTactic(f"parameter {name} must be a C symbol name, got {value!r}")
            out[name] = value
        sha = params.get("source_sha256")
        if not isinstance(sha, str) or not HEX64_RE.match(sha):
            raise InvalidTactic("parameter source_sha256 must be 64 lowercase hex digits")
        out["source_sha256"] = sha
        out["tvm_ffi"] = require(params, "tvm_ffi", (False, True), True)
        return out

    def source_sha256(self) -> str:
        # the sources are FlashInfer's, hashed by the client as FlashInfer does: in the params
        return hashlib.sha256(b"flashinfer.jit: sources in params.source_sha256").hexdigest()

    def plan(self, shape, arch, sm_count, options) -> list[KernelRequest]:
        raise InvalidTactic(f"{self.name} has no tactic space: its kernels are published")

    def build(self, request: KernelRequest, workdir: Path) -> BuiltObject:
        raise RuntimeError(f"{self.name} has no compile recipe in the daemon: a client "
                           "compiles it and publishes it (write-back)")


def _watch(pid: int) -> int | None:
    """A pidfd of process ``pid`` (readable once it has exited), or None when there is none
    to watch (pid 0: a peer in another pid namespace; or the process is gone already)."""
    if pid <= 0:
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:  # gone, or no pidfd support: the time-to-live still ends the lease
        return None


@dataclass
class Lease:
    token: str
    pid: int
    pidfd: int | None
    ttl: float
    expires: float
    granted: float = field(default_factory=time.monotonic)

    def expired(self, now: float) -> str | None:
        if now >= self.expires:
            return f"not renewed within {self.ttl:.0f}s"
        if self.pidfd is not None:
            poll = select.poll()
            poll.register(self.pidfd, select.POLLIN)
            if poll.poll(0):
                return f"holder pid {self.pid} is gone"
        return None

    def close(self) -> None:
        """Stop watching the holder (the lease is over); idempotent."""
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


@dataclass
class Upload:
    path: Path
    size: int = 0
    digest: Any = field(default_factory=hashlib.sha256)
    touched: float = field(default_factory=time.monotonic)


class WriteBack:
    def __init__(self, server: Any, scheduler: Any, store: Any) -> None:
        self.server = server
        self.scheduler = scheduler
        self.store = store
        self.leases: dict[str, Lease] = {}
        self.changed: dict[str, asyncio.Event] = {}
        self.uploads: dict[tuple[str, str], Upload] = {}
        self.stats = scheduler.stats

    # -- helpers ---------------------------------------------------------------------

    def _resolve(self, m: dict) -> tuple[KernelRequest, str]:
        family, request, key = self.scheduler.resolve(m.get("request"))
        if family.name != FAMILY:
            raise InvalidTactic(f"write-back is for {FAMILY} requests; {family.name} kernels "
                                "are compiled by the daemon (use get)")
        return request, key

    def _event(self, key: str) -> asyncio.Event:
        ev = self.changed.get(key)
        if ev is None:
            ev = self.changed[key] = asyncio.Event()
        return ev

    def _drop(self, key: str) -> None:
        lease = self.leases.pop(key, None)
        if lease is not None:
            lease.close()

    def _notify(self, key: str) -> None:
        ev = self.changed.pop(key, None)
        if ev is not None:
            ev.set()

    def _hit(self, key: str) -> dict | None:
        entry = self.store.lookup(key)
        if entry is None:
            return None
        from .server import _artifact

        artifact = _artifact(entry, "hit")
        artifact["library_path"] = str(entry.library_path)
        artifact["object_path"] = str(entry.object_path)
        return artifact

    def _grant(self, key: str, peer: Any, ttl: float, reason: str = "") -> dict:
        lease = Lease(secrets.token_hex(16), peer.pid, _watch(peer.pid), ttl,
                      time.monotonic() + ttl)
        self._drop(key)
        self.leases[key] = lease
        self.stats.count("writeback.leases_granted")
        event(log, logging.INFO, "writeback.lease_granted", key=key[:16], pid=peer.pid,
              after=reason or "free")
        return {"ok": True, "state": "granted", "lease": lease.token, "ttl_s": ttl}

    # -- ops -------------------------------------------------------------------------

    async def lease(self, m: dict, peer: Any) -> tuple[dict, bytes | None]:
        """A hit, a lease to compile and publish, or (after ``wait_ms``) ``wait``."""
        request, key = self._resolve(m)
        ttl = _number(m, "ttl_s", DEFAULT_TTL_S, 1.0, MAX_TTL_S)
        wait = _number(m, "wait_ms", DEFAULT_WAIT_MS, 0, MAX_WAIT_MS) / 1000
        deadline = time.monotonic() + wait
        may_publish = self.server.access.may_publish(peer)
        waited = False
        while True:
            artifact = self._hit(key)
            if artifact is not None:
                self.stats.count("writeback.hits_after_wait" if waited else "writeback.hits")
                return {"ok": True, "state": "hit", "artifact": artifact}, None
            if not may_publish:
                return {"ok": True, "state": "compile_locally",
                        "reason": f"uid {peer.uid} may not publish to this daemon"}, None
            now = time.monotonic()
            current = self.leases.get(key)
            why = current.expired(now) if current is not None else "free"
            if why:
                if current is not None:
                    self.stats.count("writeback.leases_expired")
                    event(log, logging.WARNING, "writeback.lease_expired", key=key[:16],
                          pid=current.pid, reason=why)
                return self._grant(key, peer, ttl, why if current else ""), None
            if now >= deadline:
                return {"ok": True, "state": "wait", "holder_pid": current.pid,
                        "held_s": round(now - current.granted, 3)}, None
            if not waited:
                self.stats.count("writeback.waits")
            waited = True
            ev = self._event(key)
            try:
                await asyncio.wait_for(ev.wait(), min(POLL_S, max(0.0, deadline - now)))
            except TimeoutError:
                pass

    def _held(self, key: str, token: Any) -> Lease:
        lease = self.leases.get(key)
        if lease is None or lease.token != token:
            raise InvalidTactic("this lease is not held (it expired and was given to another "
                                "process, or it was never granted)")
        return lease

    async def lease_renew(self, m: dict, peer: Any) -> tuple[dict, bytes | None]:
        _, key = self._resolve(m)
        lease = self._held(key, m.get("lease"))
        lease.ttl = _number(m, "ttl_s", lease.ttl, 1.0, MAX_TTL_S)
        lease.expires = time.monotonic() + lease.ttl
        return {"ok": True, "state": "renewed", "ttl_s": lease.ttl}, None

    async def lease_release(self, m: dict, peer: Any) -> tuple[dict, bytes | None]:
        _, key = self._resolve(m)
        lease = self.leases.get(key)
        if lease is not None and lease.token == m.get("lease"):
            self._drop(key)
            self._notify(key)
            event(log, logging.INFO, "writeback.lease_released", key=key[:16], pid=peer.pid,
                  reason=str(m.get("reason", ""))[:200])
        return {"ok": True, "state": "released"}, None

    async def publish(self, m: dict, peer: Any) -> tuple[dict, bytes | None]:
        """Receive an object (chunks of base64 ``data`` at ``offset``; ``final`` commits):
        checked against ``object_sha256``, linked into a ``.so`` here, stored, served."""
        request, key = self._resolve(m)
        sha = m.get("object_sha256")
        if not isinstance(sha, str) or not HEX64_RE.match(sha):
            raise InvalidTactic("publish needs object_sha256: 64 lowercase hex digits")
        symbol = f"{request.params['module']}_{request.params['kernel']}"
        if self.store.contains(key):
            self.uploads.pop((key, sha), None)
            return {"ok": True, "state": "exists"}, None
        try:
            data = base64.b64decode(m.get("data", ""), validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise InvalidTactic("publish data must be base64") from None
        offset = m.get("offset", 0)
        upload = self.uploads.get((key, sha))
        if offset == 0:
            if upload is not None:
                upload.path.unlink(missing_ok=True)
            upload = Upload(self.store.workdir() / "published.o")
            self.uploads[(key, sha)] = upload
        elif upload is None or offset != upload.size:
            raise InvalidTactic(f"publish chunk at offset {offset!r} does not continue the "
                                "upload; start again at offset 0")
        if upload.size + len(data) > MAX_OBJECT_BYTES:
            self.uploads.pop((key, sha), None)
            shutil.rmtree(upload.path.parent, ignore_errors=True)
            raise InvalidTactic(f"object larger than {MAX_OBJECT_BYTES} bytes")
        with open(upload.path, "ab") as f:
            f.write(data)
        upload.size += len(data)
        upload.digest.update(data)
        upload.touched = time.monotonic()
        if not m.get("final", True):
            return {"ok": True, "state": "partial", "received": upload.size}, None
        del self.uploads[(key, sha)]
        workdir = upload.path.parent
        try:
            if upload.digest.hexdigest() != sha:
                raise InvalidTactic("published object does not match its object_sha256")
            with open(upload.path, "rb") as f:
                if f.read(4) != b"\x7fELF":
                    raise InvalidTactic("published object is not an ELF object file")
            loop = asyncio.get_running_loop()
            entry = await loop.run_in_executor(None, self._commit, request, key, symbol,
                                               upload.path, m)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        self._drop(key)
        self._notify(key)
        self.stats.count("writeback.published")
        event(log, logging.INFO, "writeback.published", key=key[:16], pid=peer.pid,
              kernel=request.params["kernel"][:120], module=request.params["module"],
              bytes=entry.row["object_size"])
        return {"ok": True, "state": "stored", "key": key}, None

    def _commit(self, request: KernelRequest, key: str, symbol: str, object_path: Path,
                m: dict) -> Any:
        library_path = object_path.with_suffix(".so")
        try:
            toolchain.link_shared_library(object_path, library_path)
        except RuntimeError as exc:
            raise CompileFailed(f"the published object does not link: {exc}") from None
        row = {
            "key": key, "family": FAMILY, "kernel_name": request.params["kernel"],
            "symbol": symbol, "params": json.dumps(dict(request.params), sort_keys=True),
            "arch": request.arch, "sm_count": request.sm_count,
            "max_active_clusters": request.max_active_clusters,
            "toolchain": self.scheduler.identity.toolchain,
            "source_sha256": self.scheduler.identity.source(self.scheduler_family()),
            "compile_seconds": float(m.get("compile_seconds") or 0.0),
            "meta": {"flashinfer_module": request.params["module"],
                     "flashinfer_source_sha256": request.params["source_sha256"],
                     "tvm_ffi": request.params["tvm_ffi"], "origin": "write-back",
                     "runtime_library": toolchain.RUNTIME_LIBRARY_NAME},
        }
        return self.store.publish(row, object_path, library_path)

    def scheduler_family(self) -> Family:
        from . import families

        return families.get(FAMILY)

    async def flashinfer_artifacts(self, m: dict, peer: Any) -> tuple[dict, bytes | None]:
        """Verified FlashInfer artifacts for ``cached export``: rows, meta and object paths."""
        wanted = m.get("family")
        out = []
        for row in self.store.rows():
            if row["family"] not in FLASHINFER_FAMILIES or (wanted and row["family"] != wanted):
                continue
            entry = self.store.lookup(row["key"])
            if entry is None:
                continue
            r = entry.row
            out.append({k: r[k] for k in ("key", "family", "kernel_name", "symbol", "arch",
                                          "toolchain", "source_sha256", "object_sha256",
                                          "created")}
                       | {"meta": json.loads(r["meta"] or "{}"), "params": json.loads(r["params"]),
                          "object_path": str(entry.object_path)})
        return {"ok": True, "artifacts": out,
                "toolchain": self.scheduler.identity.toolchain}, None

    # -- shared autotune results -----------------------------------------------------

    def _autotune_table(self) -> Any:
        table = self.store.db.table("autotune_results")
        if not table.exists():
            table.create({"id": str, "op": str, "n": int, "k": int, "dtype": str, "arch": str,
                          "device": str, "bucket": int, "kernel": str, "tactic": str,
                          "time_us": float, "pid": int, "updated": float}, pk="id")
        return table

    async def autotune_put(self, m: dict, peer: Any) -> tuple[dict, bytes | None]:
        """Record a tuning winner; a later, faster result for the same bucket replaces it."""
        row = _autotune_row(m)
        row.update(pid=peer.pid, updated=time.time())
        with self.store._lock:
            table = self._autotune_table()
            try:
                old = table.get(row["id"])
            except Exception:  # noqa: BLE001 -- sqlite_utils raises NotFoundError
                old = None
            if old is None or m.get("replace") or row["time_us"] < old["time_us"]:
                table.insert(row, replace=True)
                stored = True
            else:
                stored = False
        return {"ok": True, "stored": stored}, None

    async def autotune_get(self, m: dict, peer: Any) -> tuple[dict, bytes | None]:
        where = {k: m[k] for k in ("n", "k", "dtype", "arch", "device") if k in m}
        if "op_name" in m:  # the GEMM op ("op" is the protocol's)
            where["op"] = m["op_name"]
        with self.store._lock:
            table = self._autotune_table()
            clause = " and ".join(f"[{k}] = ?" for k in where) or None
            rows = list(table.rows_where(clause, list(where.values()) or None,
                                         order_by="bucket"))
        for r in rows:
            r["tactic"] = json.loads(r["tactic"])
        return {"ok": True, "results": rows}, None


def _autotune_row(m: dict) -> dict:
    row: dict[str, Any] = {}
    for name in ("op_name", "dtype", "arch", "device", "kernel"):
        value = m.get(name)
        if not isinstance(value, str) or not value or len(value) > 200:
            raise InvalidTactic(f"autotune_put needs {name}: a short string")
        row["op" if name == "op_name" else name] = value
    for name in ("n", "k", "bucket"):
        value = m.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidTactic(f"autotune_put needs {name}: a positive integer")
        row[name] = value
    time_us = m.get("time_us")
    if not isinstance(time_us, (int, float)) or time_us <= 0:
        raise InvalidTactic("autotune_put needs time_us: a positive number")
    row["time_us"] = float(time_us)
    row["tactic"] = json.dumps(m.get("tactic"), sort_keys=True)
    if len(row["tactic"]) > 4096:
        raise InvalidTactic("autotune_put tactic is too large")
    row["id"] = hashlib.sha256(json.dumps(
        [row[k] for k in ("op", "n", "k", "dtype", "arch", "device", "bucket")]).encode()
    ).hexdigest()
    return row


def _number(m: dict, name: str, default: float, low: float, high: float) -> float:
    value = m.get(name, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
        raise InvalidTactic(f"{name} must be a number in [{low}, {high}], got {value!r}")
    return float(value)


def register(server: Any, scheduler: Any, store: Any) -> WriteBack:
    """Serve the write-back and autotune-sharing ops on ``server``."""
    wb = WriteBack(server, scheduler, store)
    server.register("lease", wb.lease)
    server.register("lease_renew", wb.lease_renew)
    server.register("lease_release", wb.lease_release)
    server.register("publish", wb.publish, publish=True)
    server.register("flashinfer_artifacts", wb.flashinfer_artifacts)
    server.register("autotune_put", wb.autotune_put, publish=True)
    server.register("autotune_get", wb.autotune_get)
    os.makedirs(store.tmp_dir, exist_ok=True)
    return wb
