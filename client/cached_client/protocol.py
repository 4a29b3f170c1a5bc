"""The wire protocol between the daemon and its clients (see docs/protocol.md).

A frame is a 4-byte big-endian length followed by that many bytes of one UTF-8 JSON
object. A reply whose object has ``"payload_size": N`` is followed by N raw bytes (an
artifact's contents, when the client asked for bytes rather than a path).

Invariants: a request frame is at most :data:`MAX_REQUEST_FRAME` bytes; every request
carries ``op``; every reply carries ``ok`` and echoes the request's ``id`` when it had
one; an error reply is ``{"ok": false, "error": {"code", "message"}}``.
"""

from __future__ import annotations

import json
import struct

from .errors import MalformedFrame

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = (1,)
MAX_REQUEST_FRAME = 1 << 20
MAX_REPLY_FRAME = 64 << 20
HEADER = struct.Struct(">I")

OPS = ("hello", "get", "prefetch", "stats", "list", "plan")
CAPABILITIES = ("transfer:path", "transfer:bytes")
"""What ``hello`` offers beyond its ``ops`` list (which the daemon's op registry gives)."""


def encode_frame(message: dict) -> bytes:
    """One frame: length header plus compact JSON."""
    body = json.dumps(message, separators=(",", ":"), sort_keys=True).encode()
    return HEADER.pack(len(body)) + body


def decode_body(body: bytes) -> dict:
    """Parse a frame body; raises MalformedFrame unless it is one JSON object."""
    try:
        message = json.loads(body)
    except (UnicodeDecodeError, ValueError) as exc:
        raise MalformedFrame(f"frame is not valid UTF-8 JSON: {exc}") from None
    if not isinstance(message, dict):
        raise MalformedFrame(f"frame must be a JSON object, got {type(message).__name__}")
    return message


def frame_length(header: bytes, limit: int) -> int:
    """The body length announced by a 4-byte header; MalformedFrame if over ``limit``."""
    (length,) = HEADER.unpack(header)
    if length > limit:
        raise MalformedFrame(f"frame of {length} bytes exceeds the {limit}-byte limit")
    return length
