"""The fleet tier on Redis: a shared Redis that hands one node's compilations to every
other node (:class:`RedisTier`, the :class:`cached.fleet.tier.Tier` the daemon runs).

A local miss asks the tier before compiling (``RedisTier.fetch``, blocking: call it from a
thread); a finished compilation is published in the background (``RedisTier.publish``
queues it and returns at once). Nothing read from Redis reaches the store before its
Ed25519 signature verifies against one of the fleet's public keys and both blobs match
the digests the signed row names (cached.fleet.envelope); the store then derives every
path from the sha256 of the bytes. Only publishing nodes hold a private key; a read-only
node holds public keys only, so it can check entries but never make one.

Keys: one Redis string per artifact, ``cached:v2:art:<key>`` (the artifact's envelope);
tuning winners travel the same way, small and signed: one Redis hash per (op, N, K, dtype,
arch, device), ``cached:v2:tune:<group id>``, one field per winner (its row id), each value
a signed record.

States: ``up``; ``down`` (connection refused, reset or timed out: the daemon goes on
local-only and retries with jittered exponential backoff, 1 s to 60 s); ``full``
(Redis refused a write with OOM: reads go on, publishing retries with backoff). Each
state change is logged once (``remote.state``).
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from cached_client.backoff import Backoff

from ..config import ConfigError
from ..log import event
from .envelope import (
    FleetKeys,
    Rejected,
    pack,
    pack_record,
    unpack,
    unpack_record,
)

log = logging.getLogger("cached.remote")  # the name logs had before the split

PREFIX = "cached:v2:art:"
RECORD_PREFIX = "cached:v2:tune:"
MAX_RECORDS = 4096  # fields read from one hash
BACKOFF_MIN_S, BACKOFF_MAX_S = 1.0, 60.0


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


@dataclass
class _Record:
    group: str
    rid: str
    row: dict

    @property
    def key(self) -> str:
        return self.group + ":" + self.rid


_STOP = object()


class RedisTier:
    """The Redis tier of one daemon. Thread-safe; never raises into its callers. A node
    whose ``keys`` hold no signing key is read-only: it fetches and never writes."""

    def __init__(self, url: str, keys: FleetKeys, timeout: float = 2.0, compress: bool = True,
                 queue_size: int = 1024, ttl_s: int | None = None) -> None:
        connect_check = urlsplit(url).scheme
        if connect_check not in ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster"):
            raise ConfigError(f"unsupported remote URL {redacted(url)!r}: use "
                              "redis://HOST:PORT/DB, rediss://, unix:// or redis+cluster://")
        self.url = url
        self.keys = keys
        self.read_only = keys.signer is None
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
        self._backoff = Backoff(BACKOFF_MIN_S, BACKOFF_MAX_S, jitter=0.2)
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
                self._backoff.reset()
                self._set_state(state, reason)
            elif not self._probing:  # an operation begun before the state changed: the
                return               # backoff stands (a failed probe waits longer, below)
            self._probing = False
            self._next_try = time.monotonic() + self._backoff.next()
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

    def publish_record(self, group: str, rid: str, row: dict) -> None:
        """Queue a tuning winner for the tier (see the module doc); returns at once."""
        if self.read_only or self._closing.is_set():
            return
        try:
            self._queue.put_nowait(_Record(group, rid, dict(row)))
        except queue.Full:
            self._count("publish_dropped")

    def fetch_records(self, group: str) -> list[tuple[str, dict]]:
        """The verified (row id, row) of every winner the tier holds for ``group``; []
        when it holds none or is down. A record that fails verification is counted,
        logged (``remote.rejected``) and left out. Blocking: call it from a thread."""
        if not self._may_try(write=False):
            self._count("skipped")
            return []
        try:
            raw = self._conn().hgetall(RECORD_PREFIX + group)
        except Exception as exc:  # noqa: BLE001 -- every failure means: local winners only
            self._count("errors")
            if self._classify(exc) is not None:
                self._failed("down", exc)
            else:
                with self._lock:
                    self._probing = False
                event(log, logging.WARNING, "remote.error", op="hgetall", key=group[:16],
                      error=f"{type(exc).__name__}: {exc}"[:300])
            return []
        self._ok(write=False)
        out, rejected, reasons, first = [], 0, set(), ""
        for field, data in list(raw.items())[:MAX_RECORDS]:
            rid = field.decode(errors="replace") if isinstance(field, bytes) else str(field)
            try:
                out.append((rid, unpack_record(group, rid, bytes(data), self.keys)))
            except (Rejected, ValueError, TypeError) as exc:
                rejected += 1
                first = first or rid[:16]
                if len(reasons) < 4:
                    reasons.add(str(exc)[:120] if isinstance(exc, Rejected)
                                else f"malformed: {type(exc).__name__}")
        if rejected:  # one line a fetch, however many records fail
            self._count("rejected", rejected)
            event(log, logging.WARNING, "remote.rejected", group=group[:16], records=rejected,
                  first=first, reasons=sorted(reasons))
        self._count("record_hits", len(out))
        return out

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

    def _publish_now(self, item: _Publish | _Record) -> None:
        if isinstance(item, _Record):
            data = pack_record(item.group, item.rid, item.row, self.keys)
            self._conn().hset(RECORD_PREFIX + item.group, item.rid, data)
            self._ok(write=True)
            self._count("records_published")
            return
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
            "read_only": self.read_only, "signing_key_id": self.keys.signer_id,
            "verify_keys": len(self.keys.by_id), "verify_key_ids": sorted(self.keys.by_id),
            "hits": c.get("hits", 0), "misses": c.get("misses", 0),
            "rejected": c.get("rejected", 0), "published": c.get("published", 0),
            "records_published": c.get("records_published", 0),
            "record_hits": c.get("record_hits", 0),
            "errors": c.get("errors", 0), "skipped": c.get("skipped", 0),
            "publish_queue": self._queue.qsize(),
            "publish_dropped": c.get("publish_dropped", 0),
            "bytes_in": c.get("bytes_in", 0), "bytes_out": out,
            "compression_ratio": round(raw / out, 3) if out else None,
            "retry_in_s": round(retry_in, 2), "last_error": error,
        }
