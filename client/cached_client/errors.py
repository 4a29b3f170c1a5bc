"""Typed errors shared by the daemon and the client.

Every error the daemon sends has a ``code`` from :data:`ERROR_CODES`; the client turns
it back into the matching exception class, so callers can catch what they can act on.
Bad input is ``invalid_argument`` (a field) or ``invalid_tactic`` (a family's parameters);
``internal`` is only ever a daemon bug.
"""

from __future__ import annotations


class CachedError(Exception):
    """Base of every error this project raises on purpose."""

    code = "internal"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def to_wire(self) -> dict:
        return {"code": self.code, "message": self.message}


class MalformedFrame(CachedError):
    code = "malformed_frame"


class UnsupportedVersion(CachedError):
    code = "unsupported_version"


class UnknownFamily(CachedError):
    code = "unknown_family"


class InvalidArgument(CachedError):
    """A request field is missing, of the wrong type or out of range."""

    code = "invalid_argument"


class InvalidTactic(CachedError):
    """A kernel request's parameters fail its family's validation."""

    code = "invalid_tactic"


class ToolchainMismatch(CachedError):
    """No registered toolchain links kernels against the runtime the client loads them with."""

    code = "toolchain_mismatch"


class UnknownToolchain(CachedError):
    """No toolchain registered with the daemon matches the client's stated identity; nothing
    was compiled. The client compiles in-process and may write the result back."""

    code = "unknown_toolchain"


class CompileFailed(CachedError):
    code = "compile_failed"


class DeadlineExceeded(CachedError):
    code = "deadline_exceeded"


class Overloaded(CachedError):
    code = "overloaded"


class NotAllowed(CachedError):
    code = "not_allowed"


class IntegrityError(CachedError):
    """An artifact's bytes do not match their recorded sha256."""

    code = "integrity"


class DaemonUnavailable(CachedError):
    """The daemon could not be reached, is shutting down, or went away mid-request."""

    code = "unavailable"


class BadReply(DaemonUnavailable):
    """The daemon's reply does not follow the protocol (client side only)."""


class UntrustedDaemon(DaemonUnavailable):
    """The socket's directory or the process answering on it is not one the client trusts
    (client side only; the message says what to fix). Nothing was sent."""


class DaemonTooOld(DaemonUnavailable):
    """The daemon's ``hello`` does not state the capabilities this request needs (an older
    daemon: its artifacts do not say what they were built with). Client side only."""


class ArtifactMismatch(DaemonUnavailable):
    """The artifact the daemon described was not built for this process (its toolchain,
    runtime, sources, arch or device differ, or are not stated): a miss, never loaded.
    Client side only; ``fields`` names what differs."""

    def __init__(self, message: str, fields: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.fields = fields


class InternalError(CachedError):
    """A daemon bug; the daemon keeps serving."""

    code = "internal"


ERROR_CODES: dict[str, type[CachedError]] = {
    cls.code: cls
    for cls in (
        MalformedFrame,
        UnsupportedVersion,
        UnknownFamily,
        InvalidArgument,
        InvalidTactic,
        ToolchainMismatch,
        UnknownToolchain,
        CompileFailed,
        DeadlineExceeded,
        Overloaded,
        NotAllowed,
        IntegrityError,
        DaemonUnavailable,
        InternalError,
    )
}


CLIENT_ERROR_CODES = frozenset(cls.code for cls in (
    MalformedFrame, UnsupportedVersion, UnknownFamily, InvalidArgument, InvalidTactic,
    ToolchainMismatch, UnknownToolchain, NotAllowed))
"""Codes of errors in what the client sent or who it is (a typo, a frame, an environment
no toolchain is registered for, a peer without the right); every other code is a failure
of a well-formed request (the daemon's ``cached_errors_total`` counts only those)."""


def error_from_wire(error: dict) -> CachedError:
    """The exception for an ``{"code", "message"}`` object received on the wire."""
    cls = ERROR_CODES.get(str(error.get("code")), InternalError)
    return cls(str(error.get("message", "")))
