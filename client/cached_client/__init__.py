"""Thin client of the cached daemon.

Importing this package is cheap: it pulls in none of FastAPI, the CuTe-DSL compiler,
FlashInfer, TVM-FFI or torch. Loading a kernel imports TVM-FFI on first use.
"""

from .client import Client
from .errors import (
    BadReply,
    CachedError,
    CompileFailed,
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
)
from .keys import KernelRequest, artifact_key
from .paths import default_socket_path
from .protocol import Artifact

__all__ = [
    "Artifact",
    "BadReply",
    "CachedError",
    "Client",
    "CompileFailed",
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
    "artifact_key",
    "default_socket_path",
]
