"""The fleet tier's signed entries: the envelope of one artifact and of one tuning record,
and the Ed25519 keys that sign and verify them. No I/O but reading key files; the Redis
client that stores these bytes is cached.fleet.redis_tier.

One artifact's envelope (stored at ``cached:v2:art:<key>``)::

    b"CKF2" | kid (8) | sig (64) | meta_len u32 | obj_len u64 | lib_len u64
            | meta (JSON: key, row, enc) | object (stored) | library (stored)

``sig = Ed25519(private key, b"cached-fleet-v2\\0" + key + everything after sig)``, so it
covers the artifact key, the row's JSON (kernel name, symbol, digests, toolchain, ...),
the encodings and both stored blobs. ``kid`` names the public key that verifies it (see
:func:`key_id`), so keys can rotate while entries signed with the previous key stay
valid. A blob is stored zlib-compressed when that saves at least 10 % (measured:
CuTe-DSL objects and libraries shrink about 3.5x).

A tuning winner's record (cached.ops.autotune; one field of the hash
``cached:v2:tune:<group id>``, named by its row id) is ``b"CKR2" | kid (8) | sig (64) |
JSON row`` with ``sig = Ed25519(private key, b"cached-fleet-tune-v2\\0" + group + row id +
JSON)``: a row cannot be moved to another shape or bucket without breaking its signature,
and the reader checks that the row's fields name the group and id it was filed under.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import re
import struct
import zlib
from collections.abc import Iterable
from pathlib import Path

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

log = logging.getLogger("cached.remote")  # the name logs had before the split

MAGIC = b"CKF2"
DOMAIN = b"cached-fleet-v2\0"
RECORD_MAGIC = b"CKR2"
RECORD_DOMAIN = b"cached-fleet-tune-v2\0"
MAX_RECORD = 64 << 10
KID_BYTES, SIG_BYTES = 8, 64
MAX_META = 1 << 20
MAX_BLOB = 256 << 20
COMPRESS_LEVEL = 6
COMPRESS_MIN_SAVING = 0.10
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
