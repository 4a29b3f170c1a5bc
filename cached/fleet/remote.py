"""The fleet tier: a shared Redis that hands one node's compilations to every other node.

A local miss asks the tier before compiling (``Remote.fetch``, blocking: call it from a
thread); a finished compilation is published in the background (``Remote.publish``
queues it and returns at once). Nothing read from Redis reaches the store before its
Ed25519 signature verifies against one of the fleet's public keys and both blobs match
the digests the signed row names; the store then derives every path from the sha256 of
the bytes. Only publishing nodes hold a private key; a read-only node holds public keys
only, so it can check entries but never make one.

One Redis string per artifact, ``cached:v2:art:<key>``::

    b"CKF2" | kid (8) | sig (64) | meta_len u32 | obj_len u64 | lib_len u64
            | meta (JSON: key, row, enc) | object (stored) | library (stored)

``sig = Ed25519(private key, b"cached-fleet-v2\\0" + key + everything after sig)``, so it
covers the artifact key, the row's JSON (kernel name, symbol, digests, toolchain, ...),
the encodings and both stored blobs. ``kid`` names the public key that verifies it (see
:func:`key_id`), so keys can rotate while entries signed with the previous key stay
valid. A blob is stored zlib-compressed when that saves at least 10 % (measured:
CuTe-DSL objects and libraries shrink about 3.5x).

Tuning winners (cached.ops.autotune) travel the same way, small and signed: one Redis hash
per (op, N, K, dtype, arch, device), ``cached:v2:tune:<group id>``, one field per winner
(its row id), each value ``b"CKR2" | kid (8) | sig (64) | JSON row`` with ``sig =
Ed25519(private key, b"cached-fleet-tune-v2\0" + group + row id + JSON)``: a row cannot be
moved to another shape or bucket without breaking its signature, and the reader checks that
the row's fields name the group and id it was filed under.

States: ``up``; ``down`` (connection refused, reset or timed out: the daemon goes on
local-only and retries with jittered exponential backoff, 1 s to 60 s); ``full``
(Redis refused a write with OOM: reads go on, publishing retries with backoff). Each
state change is logged once (``remote.state``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import queue
import random
import re
import struct
import threading
import time
import zlib
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    PublicFormat,
    load_der_public_key,
    load_pem_private_key,
)

from ..config import ConfigError
from ..log import event

log = logging.getLogger("cached.fleet.remote")

PREFIX = "cached:v2:art:"
MAGIC = b"CKF2"
DOMAIN = b"cached-fleet-v2\0"
RECORD_PREFIX = "cached:v2:tune:"
RECORD_MAGIC = b"CKR2"
RECORD_DOMAIN = b"cached-fleet-tune-v2\0"
MAX_RECORD = 64 << 10
MAX_RECORDS = 4096  # fields read from one hash
KID_BYTES, SIG_BYTES = 8, 64
MAX_META = 1 << 20
MAX_BLOB = 256 << 20
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


class KeyFileError(ConfigError):
    """A fleet key file that cannot be used; the one-line message names the file and the
    format expected. Raised before the daemon binds anything."""


# -- keys and signatures -----------------------------------------------------------------

SIGNING_FORMAT = ("expected an Ed25519 private key in PEM (PKCS#8, '-----BEGIN PRIVATE "
                  "KEY-----'), as written by 'openssl genpkey -algorithm ed25519' (docs/fleet.md)")
VERIFY_FORMAT = ("expected Ed25519 public keys: PEM blocks ('-----BEGIN PUBLIC KEY-----', as "
                 "written by 'openssl pkey -pubout') or one base64 key a line (docs/fleet.md)")
MAX_KEY_FILE = 1 << 20
_PEM_BLOCK = re.compile(r"-----BEGIN ([A-Z0-9 ]+)-----(.*?)-----END \1-----", re.S)


def key_id(public: Ed25519PublicKey) -> str:
    """16 hex digits naming a public key (in envelopes, stats and logs)."""
    raw = public.public_bytes(Encoding.Raw, PublicFormat.Raw)
    return hashlib.sha256(b"cached-fleet-kid-v2\0" + raw).hexdigest()[:2 * KID_BYTES]


def _kind(key: object) -> str:
    name = type(key).__name__
    for suffix in ("PrivateKey", "PublicKey"):
        name = name.removesuffix(suffix)
    return name


class FleetKeys:
    """The fleet's Ed25519 keys on one node: the private key that signs (publishing nodes
    only; None on a read-only node) and the public keys an entry may verify against (the
    current and, during a rotation, the previous ones). A signer always verifies its own
    signatures."""

    def __init__(self, signer: Ed25519PrivateKey | None,
                 verify: Iterable[Ed25519PublicKey] = ()) -> None:
        publics = ([signer.public_key()] if signer is not None else []) + list(verify)
        if not publics:
            raise ValueError("no fleet key: a node needs a signing key or verify keys")
        self.signer = signer
        self.signer_id = key_id(signer.public_key()) if signer is not None else None
        self.by_id = {key_id(p): p for p in publics}

    def sign(self, message: bytes) -> tuple[bytes, bytes]:
        """(key id, 8 bytes; signature, 64 bytes) of ``message``."""
        if self.signer is None or self.signer_id is None:
            raise RuntimeError("this node holds no fleet signing key (read-only)")
        return bytes.fromhex(self.signer_id), self.signer.sign(message)

    def verify(self, kid: str, message: bytes, signature: bytes) -> bool:
        public = self.by_id.get(kid)
        if public is None:
            return False
        try:
            public.verify(signature, message)
        except InvalidSignature:
            return False
        return True


def _read_key_file(path: Path, what: str, expected: str) -> str:
    """The text of a key file, or :class:`KeyFileError` (unreadable, too big, binary, empty)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_KEY_FILE + 1)
    except OSError as exc:
        raise KeyFileError(f"{what} {path}: cannot read it: {exc.strerror}; {expected}") from None
    if len(data) > MAX_KEY_FILE:
        raise KeyFileError(f"{what} {path}: larger than {MAX_KEY_FILE} bytes; {expected}")
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise KeyFileError(f"{what} {path}: {len(data)} bytes of binary data, not PEM text; "
                           f"{expected}") from None
    if not text.strip():
        raise KeyFileError(f"{what} {path}: the file is empty; {expected}")
    return text


def read_signing_key(path: str | Path) -> Ed25519PrivateKey:
    """The one Ed25519 private key in a PEM file, or :class:`KeyFileError`."""
    path, what = Path(path), "fleet signing key"

    def bad(problem: str) -> KeyFileError:
        return KeyFileError(f"{what} {path}: {problem}; {SIGNING_FORMAT}")

    text = _read_key_file(path, what, SIGNING_FORMAT)
    blocks = _PEM_BLOCK.findall(text)
    if not blocks:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        if all(re.fullmatch(r"[0-9a-fA-F]{32,}", ln) or ln.startswith("#") for ln in lines):
            raise bad("holds hex keys of the old HMAC scheme, which is no longer used")
        raise bad("no PEM block")
    if len(blocks) > 1:
        raise bad(f"{len(blocks)} PEM blocks; the file must hold exactly one private key")
    label = blocks[0][0]
    if label == "ENCRYPTED PRIVATE KEY":
        raise bad("the key is encrypted, which is not supported (protect the file with mode "
                  "0400 instead)")
    if not label.endswith("PRIVATE KEY"):
        raise bad(f"a '{label}' block, not a private key"
                  + (" (public keys go in --remote-verify-keys)" if label == "PUBLIC KEY"
                     else ""))
    try:
        key = load_pem_private_key(text.encode(), password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise bad(f"the PEM block does not decode ({str(exc).split('.')[0][:80]})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise bad(f"an {_kind(key)} key, not Ed25519")
    return key


def read_verify_keys(path: str | Path) -> list[Ed25519PublicKey]:
    """The Ed25519 public keys in a file: PEM ``PUBLIC KEY`` blocks and/or lines holding one
    key each as base64 DER (the body line of such a block); blank lines and ``#`` comments
    are skipped. At least one key, or :class:`KeyFileError`."""
    path, what = Path(path), "fleet verify keys"

    def bad(problem: str) -> KeyFileError:
        return KeyFileError(f"{what} {path}: {problem}; {VERIFY_FORMAT}")

    def public(der: bytes, where: str) -> Ed25519PublicKey:
        try:
            key = load_der_public_key(der)
        except (ValueError, UnsupportedAlgorithm):
            raise bad(f"{where} is not a public key") from None
        if not isinstance(key, Ed25519PublicKey):
            raise bad(f"{where} is an {_kind(key)} key, not Ed25519")
        return key

    def line_of(at: int) -> int:
        return text.count("\n", 0, at) + 1

    text = _read_key_file(path, what, VERIFY_FORMAT)
    keys = []
    for match in _PEM_BLOCK.finditer(text):
        label, where = match.group(1), f"the PEM block at line {line_of(match.start())}"
        if label != "PUBLIC KEY":
            raise bad(f"{where} is a '{label}'"
                      + (": a private key does not belong in this file"
                         if "PRIVATE" in label else ""))
        try:
            der = base64.b64decode("".join(match.group(2).split()), validate=True)
        except binascii.Error:
            raise bad(f"{where} is not base64") from None
        keys.append(public(der, where))
    rest = _PEM_BLOCK.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for number, line in enumerate(rest.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            der = base64.b64decode(line, validate=True)
        except binascii.Error:
            raise bad(f"line {number} is neither a PEM block nor a base64 key") from None
        keys.append(public(der, f"line {number}"))
    if not keys:
        raise bad("no key in the file")
    return keys


def load_keys(signing_key: str | Path | None, verify_keys: str | Path | None,
              read_only: bool) -> FleetKeys:
    """A node's fleet keys from its settings; :class:`KeyFileError` for a missing, unusable
    or contradictory setting. A read-only node must not hold the signing key; a publishing
    node verifies with its own public key plus those in ``verify_keys``."""
    if read_only and signing_key:
        raise KeyFileError("--remote-read-only with --remote-signing-key: a read-only node "
                           "must not hold the fleet's private key; give it only "
                           "--remote-verify-keys FILE (docs/fleet.md)")
    if read_only and not verify_keys:
        raise KeyFileError("--remote-read-only needs --remote-verify-keys FILE, the fleet's "
                           "public keys (docs/fleet.md)")
    if not read_only and not signing_key:
        raise KeyFileError("--remote needs --remote-signing-key FILE on a publishing node, or "
                           "--remote-read-only with --remote-verify-keys FILE (docs/fleet.md)")
    signer = read_signing_key(signing_key) if signing_key else None
    verify = read_verify_keys(verify_keys) if verify_keys else []
    keys = FleetKeys(signer, verify)
    if signer is not None and verify_keys and keys.signer_id not in {key_id(p) for p in verify}:
        event(log, logging.WARNING, "remote.signing_key_not_in_verify_keys",
              signing_key_id=keys.signer_id, verify_keys=str(verify_keys),
              hint="nodes that use this verify-keys file reject what this node publishes")
    return keys


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


def pack(key: str, row: dict, obj: bytes, lib: bytes, keys: FleetKeys,
         compress: bool = True) -> bytes:
    """The signed envelope of one artifact (``row`` holds at least SIGNED_FIELDS)."""
    enc_obj, stored_obj = _encode(obj, compress)
    enc_lib, stored_lib = _encode(lib, compress)
    meta = json.dumps({"key": key, "row": {k: row[k] for k in SIGNED_FIELDS},
                       "enc": {"object": enc_obj, "library": enc_lib}},
                      sort_keys=True, separators=(",", ":")).encode()
    body = b"".join([_FIXED.pack(len(meta), len(stored_obj), len(stored_lib)), meta,
                     stored_obj, stored_lib])
    kid, sig = keys.sign(DOMAIN + key.encode() + body)
    return b"".join([MAGIC, kid, sig, body])


def unpack(key: str, data: bytes, keys: FleetKeys) -> tuple[dict, bytes, bytes]:
    """Verify an envelope read for ``key``; its row and both blobs, or :class:`Rejected`."""
    view = memoryview(data)
    if len(view) < 4 or bytes(view[:4]) != MAGIC:
        raise Rejected("not a cached fleet entry")
    head = 4 + KID_BYTES + SIG_BYTES
    if len(view) < head + _FIXED.size:
        raise Rejected("truncated entry")
    kid = bytes(view[4:4 + KID_BYTES]).hex()
    sig = bytes(view[4 + KID_BYTES:head])
    body = view[head:]
    if kid not in keys.by_id:
        raise Rejected(f"signed with unknown key id {kid!r}")
    if not keys.verify(kid, DOMAIN + key.encode() + body, sig):
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


def pack_record(group: str, rid: str, row: dict, keys: FleetKeys) -> bytes:
    """The signed envelope of one tuning winner (a JSON-able ``row``)."""
    body = json.dumps(row, sort_keys=True, separators=(",", ":")).encode()
    kid, sig = keys.sign(RECORD_DOMAIN + group.encode() + b"\0" + rid.encode() + b"\0" + body)
    return b"".join([RECORD_MAGIC, kid, sig, body])


def unpack_record(group: str, rid: str, data: bytes, keys: FleetKeys) -> dict:
    """Verify a winner's envelope filed under (group, rid); its row, or :class:`Rejected`."""
    head = 4 + KID_BYTES + SIG_BYTES
    if len(data) < head or data[:4] != RECORD_MAGIC:
        raise Rejected("not a cached fleet tuning record")
    if len(data) > MAX_RECORD:
        raise Rejected("record too large")
    kid, sig, body = data[4:4 + KID_BYTES].hex(), data[4 + KID_BYTES:head], data[head:]
    if kid not in keys.by_id:
        raise Rejected(f"signed with unknown key id {kid!r}")
    message = RECORD_DOMAIN + group.encode() + b"\0" + rid.encode() + b"\0" + body
    if not keys.verify(kid, message, sig):
        raise Rejected("signature does not verify")
    row = json.loads(body)
    if not isinstance(row, dict):
        raise Rejected("a record is a JSON object")
    return row


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


@dataclass
class _Record:
    group: str
    rid: str
    row: dict

    @property
    def key(self) -> str:
        return self.group + ":" + self.rid


_STOP = object()


class Remote:
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
        out = []
        for field, data in list(raw.items())[:MAX_RECORDS]:
            rid = field.decode(errors="replace") if isinstance(field, bytes) else str(field)
            try:
                out.append((rid, unpack_record(group, rid, bytes(data), self.keys)))
            except (Rejected, ValueError, TypeError) as exc:
                self._count("rejected")
                event(log, logging.WARNING, "remote.rejected", key=rid[:16], bytes=len(data),
                      reason=str(exc)[:300] if isinstance(exc, Rejected)
                      else f"malformed: {type(exc).__name__}")
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
