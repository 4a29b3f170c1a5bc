"""Thin client of the cached daemon.

Importing this package is cheap: it pulls in none of FastAPI, the CuTe-DSL compiler,
FlashInfer, TVM-FFI or torch. Loading a kernel imports TVM-FFI on first use.
"""

from .client import Client
from .errors import (
    ArtifactMismatch,
    BadReply,
    CachedError,
    CompileFailed,
    DaemonTooOld,
    DaemonUnavailable,
    DeadlineExceeded,
    IntegrityError,
    InvalidArgument,
    InvalidTactic,
    MalformedFrame,
    NotAllowed,
    Overloaded,
    ToolchainMismatch,
    UnknownFamily,
    UnknownToolchain,
    UnsupportedVersion,
    UntrustedDaemon,
)
from .keys import KernelRequest, artifact_key
from .paths import default_socket_path
from .protocol import Artifact

__all__ = [
    "Artifact",
    "ArtifactMismatch",
    "BadReply",
    "CachedError",
    "Client",
    "CompileFailed",
    "DaemonTooOld",
    "DaemonUnavailable",
    "DeadlineExceeded",
    "IntegrityError",
    "InvalidArgument",
    "InvalidTactic",
    "KernelRequest",
    "MalformedFrame",
    "NotAllowed",
    "Overloaded",
    "ToolchainMismatch",
    "UnknownFamily",
    "UnknownToolchain",
    "UnsupportedVersion",
    "UntrustedDaemon",
    "artifact_key",
    "default_socket_path",
]
