"""The fleet tier: a shared Redis that hands one node's compilations to every other node.

A local miss asks the tier before compiling (``Remote.fetch``, blocking: call it from a
thread); a finished compilation is published in the background (``Remote.publish``
queues it and returns at once). Nothing read from Redis reaches the store before its
HMAC-SHA256 verifies against one of the fleet's keys and both blobs match the digests
the signed row names; the store then derives every path from the sha256 of the bytes.

One Redis string per artifact, ``cached:v1:art:<key>``::

    b"CKF1" | kid_len u8 | kid | mac (32) | meta_len u32 | obj_len u64 | lib_len u64
            | meta (JSON: key, row, enc) | object (stored) | library (stored)

``mac = HMAC-SHA256(fleet key, b"cached-fleet-v1\\0" + key + everything after the mac)``,
so it covers the artifact key, the row's JSON (kernel name, symbol, digests, toolchain,
...), the encodings and both stored blobs. ``kid`` names which fleet key signed (the
first 16 hex digits of a hash of it), so verification keys can rotate while entries
signed with the previous key stay valid. A blob is stored zlib-compressed when that
saves at least 10 % (measured: CuTe-DSL objects and libraries shrink about 3.5x).

States: ``up``; ``down`` (connection refused, reset or timed out: the daemon goes on
local-only and retries with jittered exponential backoff, 1 s to 60 s); ``full``
(Redis refused a write with OOM: reads go on, publishing retries with backoff). Each
state change is logged once (``remote.state``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import queue
import random
import struct
import threading
import time
import zlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from .log import event

log = logging.getLogger("cached.remote")

PREFIX = "cached:v1:art:"
MAGIC = b"CKF1"
DOMAIN = b"cached-fleet-v1\0"
MAX_META = 1 << 20
MAX_BLOB = 256 << 20
MIN_KEY_BYTES = 16
COMPRESS_LEVEL = 6
COMPRESS_MIN_SAVING = 0.10
BACKOFF_MIN_S, BACKOFF_MAX_S = 1.0, 60.0
_FIXED = struct.Struct(">IQQ")

# The row fields a publisher signs and a fetching node may take over; the store fills
# in the rest (created, last_used, hits, size) itself.
SIGNED_FIELDS = ("key", "family", "kernel_name", "symbol", "params", "arch", "sm_count",
                 "max_active_clusters", "toolchain", "source_sha256", "object_sha256",
                 "object_size", "library_sha256", "library_size", "compile_seconds", "meta")


class Rejected(Exception):
    """An entry read from the tier failed verification; it is ignored."""


# -- signing -----------------------------------------------------------------------------


def key_id(secret: bytes) -> str:
    return hashlib.sha256(b"cached-fleet-kid\0" + secret).hexdigest()[:16]


class SigningKeys:
    """The fleet's HMAC keys: the first signs, every one verifies (rolling rotation)."""

    def __init__(self, secrets: list[bytes]) -> None:
        if not secrets:
            raise ValueError("no signing key")
        for s in secrets:
            if len(s) < MIN_KEY_BYTES:
                raise ValueError(f"a signing key must have at least {MIN_KEY_BYTES} bytes")
        self.current = secrets[0]
        self.current_id = key_id(secrets[0])
        self.by_id = {key_id(s): s for s in secrets}

    @classmethod
    def from_file(cls, path: str | Path) -> SigningKeys:
        """One key per line (e.g. ``openssl rand -hex 32``); the first line signs, later
        lines are previous keys still accepted. Blank lines and ``#`` comments are skipped."""
        lines = [ln.strip() for ln in Path(path).read_text().splitlines()]
        secrets = [ln.encode() for ln in lines if ln and not ln.startswith("#")]
        if not secrets:
            raise ValueError(f"{path} holds no signing key")
        return cls(secrets)

    def sign(self, message: bytes) -> bytes:
        return hmac.new(self.current, message, hashlib.sha256).digest()

    def verify(self, kid: str, message: bytes, mac: bytes) -> bool:
        secret = self.by_id.get(kid)
        if secret is None:
            return False
        return hmac.compare_digest(hmac.new(secret, message, hashlib.sha256).digest(), mac)


def _encode(data: bytes, compress: bool) -> tuple[str, bytes]:
    if compress:
        packed = zlib.compress(data, COMPRESS_LEVEL)
        if len(packed) <= len(data) * (1 - COMPRESS_MIN_SAVING):
            return "zlib", packed
    return "raw", data


def _decode(enc: str, data: bytes, size: int) -> bytes:
    if enc == "raw":
        return data
    if enc != "zlib":
        raise Rejected(f"unknown encoding {enc!r}")
    d = zlib.decompressobj()
    try:
        out = d.decompress(data, size + 1)
    except zlib.error as exc:
        raise Rejected(f"corrupt zlib stream: {exc}") from None
    if len(out) != size or not d.eof:
        raise Rejected("a blob does not decompress to its signed size")
    return out


def pack(key: str, row: dict, obj: bytes, lib: bytes, keys: SigningKeys,
         compress: bool = True) -> bytes:
    """The signed envelope of one artifact (``row`` holds at least SIGNED_FIELDS)."""
    enc_obj, stored_obj = _encode(obj, compress)
    enc_lib, stored_lib = _encode(lib, compress)
    meta = json.dumps({"key": key, "row": {k: row[k] for k in SIGNED_FIELDS},
                       "enc": {"object": enc_obj, "library": enc_lib}},
                      sort_keys=True, separators=(",", ":")).encode()
    body = b"".join([_FIXED.pack(len(meta), len(stored_obj), len(stored_lib)), meta,
                     stored_obj, stored_lib])
    kid = keys.current_id.encode()
    mac = keys.sign(DOMAIN + key.encode() + body)
    return b"".join([MAGIC, bytes([len(kid)]), kid, mac, body])


def unpack(key: str, data: bytes, keys: SigningKeys) -> tuple[dict, bytes, bytes]:
    """Verify an envelope read for ``key``; its row and both blobs, or :class:`Rejected`."""
    view = memoryview(data)
    if len(view) < 5 or bytes(view[:4]) != MAGIC:
        raise Rejected("not a cached fleet entry")
    kid_len = view[4]
    head = 5 + kid_len + 32
    if len(view) < head + _FIXED.size:
        raise Rejected("truncated entry")
    kid = bytes(view[5:5 + kid_len]).decode("ascii", "replace")
    mac = bytes(view[5 + kid_len:head])
    body = view[head:]
    if kid not in keys.by_id:
        raise Rejected(f"signed with unknown key id {kid[:16]!r}")
    if not keys.verify(kid, DOMAIN + key.encode() + body, mac):
        raise Rejected("signature does not verify")
    # Signed: the lengths and the JSON below come from a fleet node, not from Redis.
    meta_len, obj_len, lib_len = _FIXED.unpack(body[:_FIXED.size])
    if meta_len > MAX_META or _FIXED.size + meta_len + obj_len + lib_len != len(body):
        raise Rejected("lengths do not add up")
    at = _FIXED.size
    meta = json.loads(bytes(body[at:at + meta_len]))
    at += meta_len
    stored_obj, stored_lib = bytes(body[at:at + obj_len]), bytes(body[at + obj_len:])
    row = meta.get("row") or {}
    if meta.get("key") != key or row.get("key") != key:
        raise Rejected("the signed key is not the requested one")
    blobs = []
    for kind, stored in (("object", stored_obj), ("library", stored_lib)):
        size = row.get(f"{kind}_size")
        if not isinstance(size, int) or not 0 < size <= MAX_BLOB:
            raise Rejected(f"bad {kind} size")
        blob = _decode(meta.get("enc", {}).get(kind, ""), stored, size)
        if hashlib.sha256(blob).hexdigest() != row.get(f"{kind}_sha256"):
            raise Rejected(f"{kind} bytes do not match the signed digest")
        blobs.append(blob)
    return row, blobs[0], blobs[1]


# -- the tier ----------------------------------------------------------------------------


def redacted(url: str) -> str:
    """``url`` without its password (for logs and stats)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + netloc))


def connect(url: str, timeout: float) -> Any:
    """A redis-py client for ``redis://``, ``rediss://``, ``unix://`` or, for Redis
    Cluster, ``redis+cluster://`` / ``rediss+cluster://`` (any one node is enough)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    scheme = urlsplit(url).scheme
    options = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
    if scheme in ("redis+cluster", "rediss+cluster"):
        from redis.cluster import RedisCluster

        plain = scheme.split("+", 1)[0] + url[len(scheme):]
        return RedisCluster.from_url(plain, retry=Retry(NoBackoff(), 1), **options)
    if scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"unsupported remote URL scheme {scheme!r}: use redis://HOST:PORT/DB, "
                         "rediss://, unix:// or redis+cluster://HOST:PORT")
    return redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), **options)


@dataclass
class _Publish:
    key: str
    row: dict
    object_path: Path
    library_path: Path


_STOP = object()


class Remote:
    """The Redis tier of one daemon. Thread-safe; never raises into its callers."""

    def __init__(self, url: str, keys: SigningKeys, read_only: bool = False,
                 timeout: float = 2.0, compress: bool = True, queue_size: int = 1024,
                 ttl_s: int | None = None) -> None:
        connect_check = urlsplit(url).scheme
        if connect_check not in ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster"):
            raise ValueError(f"unsupported remote URL {redacted(url)!r}")
        self.url = url
        self.keys = keys
        self.read_only = read_only
        self.timeout = timeout
        self.compress = compress
        self.ttl_s = ttl_s
        self.counts: Counter[str] = Counter()
        self.state = "connecting"
        self.since = time.time()
        self.last_error = ""
        self.executor = ThreadPoolExecutor(4, thread_name_prefix="remote-fetch")
        self._client: Any = None
        self._lock = threading.Lock()
        self._delay = BACKOFF_MIN_S
        self._next_try = 0.0
        self._probing = False
        self._queue: queue.Queue = queue.Queue(queue_size)
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._publisher, name="remote-publish",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self, drain_s: float = 10.0) -> None:
        """Stop: publishes already queued get up to ``drain_s`` seconds to go out."""
        self._closing.set()
        try:
            self._queue.put(_STOP, timeout=0.1)
        except queue.Full:
            pass
        if self._thread.is_alive():
            self._thread.join(drain_s)
        self.executor.shutdown(wait=False, cancel_futures=True)

    # -- state -------------------------------------------------------------------------

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def _may_try(self, write: bool) -> bool:
        """Whether to talk to Redis now; in a bad state, one caller per backoff probes."""
        with self._lock:
            if self.state == "up" or (self.state == "full" and not write):
                return True
            if self.state == "connecting":
                return True
            if self._probing or time.monotonic() < self._next_try:
                return False
            self._probing = True
            return True

    def _ok(self, write: bool) -> None:
        with self._lock:
            self._probing = False
            if self.state == "up" or (self.state == "full" and not write):
                return
            self._set_state("up", "")

    def _failed(self, state: str, exc: BaseException) -> None:
        with self._lock:
            reason = f"{type(exc).__name__}: {exc}"[:300]
            self.last_error = reason
            if self.state != state:
                self._delay = BACKOFF_MIN_S
                self._set_state(state, reason)
            elif self._probing:  # the one retry of this backoff period failed: wait longer
                self._delay = min(self._delay * 2, BACKOFF_MAX_S)
            else:  # an operation begun before the state changed; the backoff stands
                return
            self._probing = False
            self._next_try = time.monotonic() + self._delay * random.uniform(0.8, 1.2)
            if state == "down":
                self._client = None  # reconnect (a cluster re-reads its slots) next time

    def _set_state(self, state: str, reason: str) -> None:
        previous, self.state, self.since = self.state, state, time.time()
        level = logging.INFO if state == "up" else logging.WARNING
        event(log, level, "remote.state", state=state, previous=previous,
              url=redacted(self.url), read_only=self.read_only,
              **({"error": reason} if reason else {}))

    def _conn(self) -> Any:
        client = self._client
        if client is None:
            client = self._client = connect(self.url, self.timeout)
        return client

    def _classify(self, exc: BaseException) -> str | None:
        """``down``, ``full`` or None (an error of this one operation)."""
        import redis

        if isinstance(exc, redis.OutOfMemoryError):
            return "full"
        if isinstance(exc, (redis.ConnectionError, redis.TimeoutError, OSError,
                            redis.ReadOnlyError, redis.exceptions.ClusterError,
                            redis.exceptions.RedisClusterException)):
            return "down"
        return None

    # -- reading -----------------------------------------------------------------------

    def fetch(self, key: str, expect: dict | None = None) -> tuple[dict, bytes, bytes] | None:
        """The verified row and blobs for ``key``, or None (absent, rejected, tier down).
        ``expect`` maps row fields to the values this node requires (toolchain, ...)."""
        if not self._may_try(write=False):
            self._count("skipped")
            return None
        started = time.monotonic()
        try:
            data = self._conn().get(PREFIX + key)
        except Exception as exc:  # noqa: BLE001 -- every failure means: compile locally
            self._count("errors")
            state = self._classify(exc)
            if state is not None:
                self._failed("down", exc)
            else:
                with self._lock:
                    self._probing = False
                event(log, logging.WARNING, "remote.error", op="get", key=key[:16],
                      error=f"{type(exc).__name__}: {exc}"[:300])
            return None
        self._ok(write=False)
        if data is None:
            self._count("misses")
            return None
        self._count("bytes_in", len(data))
        try:
            row, obj, lib = unpack(key, data, self.keys)
            for name, value in (expect or {}).items():
                if row.get(name) != value:
                    raise Rejected(f"signed {name} {str(row.get(name))[:40]!r} is not this "
                                   f"node's {str(value)[:40]!r}")
        except (Rejected, ValueError, KeyError, TypeError, AttributeError) as exc:
            self._count("rejected")
            event(log, logging.WARNING, "remote.rejected", key=key[:16], bytes=len(data),
                  reason=str(exc)[:300] if isinstance(exc, Rejected)
                  else f"malformed: {type(exc).__name__}")
            return None
        self._count("hits")
        self._count("fetch_ms", round((time.monotonic() - started) * 1000))
        return row, obj, lib

    # -- publishing --------------------------------------------------------------------

    def publish(self, key: str, row: dict, object_path: Path, library_path: Path) -> None:
        """Queue an artifact for the tier; returns at once (drops it when the queue is full)."""
        if self.read_only or self._closing.is_set():
            return
        try:
            self._queue.put_nowait(_Publish(key, dict(row), Path(object_path),
                                            Path(library_path)))
        except queue.Full:
            self._count("publish_dropped")

    def _publisher(self) -> None:
        self._probe()
        item: Any = None
        while True:
            if item is None:
                try:
                    item = self._queue.get(timeout=1.0)
                except queue.Empty:
                    if self._closing.is_set():
                        return
                    self._probe()
                    continue
                if item is _STOP:
                    item = None
                    if self._queue.empty():
                        return
                    continue
            if not self._may_try(write=True):
                if self._closing.is_set():
                    self._count("publish_dropped", 1 + self._queue.qsize())
                    return
                time.sleep(0.2)
                continue
            try:
                self._publish_now(item)
            except Exception as exc:  # noqa: BLE001 -- the tier must never hurt the daemon
                state = self._classify(exc)
                self._count("errors")
                if state is None:
                    with self._lock:
                        self._probing = False
                    event(log, logging.WARNING, "remote.error", op="set", key=item.key[:16],
                          error=f"{type(exc).__name__}: {exc}"[:300])
                    item = None
                else:
                    self._failed(state, exc)
                    if state == "full":
                        self._count("publish_dropped")
                        item = None
            else:
                item = None

    def _publish_now(self, item: _Publish) -> None:
        obj = item.object_path.read_bytes()
        lib = item.library_path.read_bytes()
        if (hashlib.sha256(obj).hexdigest() != item.row["object_sha256"]
                or hashlib.sha256(lib).hexdigest() != item.row["library_sha256"]):
            self._count("publish_skipped_changed")
            return
        data = pack(item.key, item.row, obj, lib, self.keys, self.compress)
        if self.ttl_s:
            self._conn().set(PREFIX + item.key, data, ex=self.ttl_s)
        else:
            self._conn().set(PREFIX + item.key, data)
        self._ok(write=True)
        with self._lock:
            self.counts["published"] += 1
            self.counts["bytes_out"] += len(data)
            self.counts["raw_bytes_out"] += len(obj) + len(lib)

    def _probe(self) -> None:
        """With no traffic, notice that a down tier is back (so stats and logs say so)."""
        if self.state not in ("down", "connecting") or not self._may_try(write=False):
            return
        try:
            self._conn().ping()
        except Exception as exc:  # noqa: BLE001
            self._failed("down", exc)
        else:
            self._ok(write=False)

    # -- reporting ---------------------------------------------------------------------

    def snapshot(self) -> dict:
        with self._lock:
            c = dict(self.counts)
            state, since, error = self.state, self.since, self.last_error
            retry_in = max(0.0, self._next_try - time.monotonic()) if state != "up" else 0.0
        raw, out = c.get("raw_bytes_out", 0), c.get("bytes_out", 0)
        return {
            "state": state, "since": round(since, 3), "url": redacted(self.url),
            "read_only": self.read_only, "signing_key_id": self.keys.current_id,
            "verify_keys": len(self.keys.by_id),
            "hits": c.get("hits", 0), "misses": c.get("misses", 0),
            "rejected": c.get("rejected", 0), "published": c.get("published", 0),
            "errors": c.get("errors", 0), "skipped": c.get("skipped", 0),
            "publish_queue": self._queue.qsize(),
            "publish_dropped": c.get("publish_dropped", 0),
            "bytes_in": c.get("bytes_in", 0), "bytes_out": out,
            "compression_ratio": round(raw / out, 3) if out else None,
            "retry_in_s": round(retry_in, 2), "last_error": error,
        }
