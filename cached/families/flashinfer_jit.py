"""Family ``flashinfer.jit``: any FlashInfer CuTe-DSL kernel, keyed as FlashInfer keys it.

Parameters: FlashInfer's module and kernel name, the export format (``tvm_ffi``), the hash
of the module's key files (``source_sha256``, computed by the client: by content and path
relative to the flashinfer package, with the FlashInfer distribution, when every key file
is inside the package, and then also listed in ``key_files``; otherwise FlashInfer's own
hash, which includes absolute paths), plus the arch and device every request carries and
the toolchain the client states. The daemon has no recipe for these: their artifacts arrive
by write-back only (cached/ops/leases.py, cached/ops/uploads.py), compiled by a client with
FlashInfer's own closure.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cached_client import flashinfer_names as names
from cached_client.errors import InvalidTactic
from cached_client.keys import ARCHES, KernelRequest
from cached_client.protocol import HEX64_RE

from .base import BuiltObject, Family, require

NAME = names.WRITE_BACK_FAMILY
SYMBOL_RE = re.compile(r"^[0-9A-Za-z_]{1,512}$")
MAX_KEY_FILES = 512


class FlashInferJit(Family):
    name = NAME
    arches = ARCHES
    sources = "params"

    def canonical_params(self, params: Mapping[str, Any], arch: str) -> dict:
        unknown = sorted(set(params) - {"module", "kernel", "tvm_ffi", "source_sha256",
                                        "key_files"})
        if unknown:
            raise InvalidTactic(f"{self.name} has no parameter(s) {', '.join(unknown)}")
        out = {}
        for name in ("module", "kernel"):
            value = params.get(name)
            if not isinstance(value, str) or not SYMBOL_RE.match(value):
                raise InvalidTactic(f"parameter {name} must be a C symbol name, got "
                                    f"{str(value)[:80]!r}")
            out[name] = value
        sha = params.get("source_sha256")
        if not isinstance(sha, str) or not HEX64_RE.match(sha):
            raise InvalidTactic("parameter source_sha256 must be 64 lowercase hex digits")
        out["source_sha256"] = sha
        out["tvm_ffi"] = require(params, "tvm_ffi", (False, True), True)
        files = params.get("key_files")
        if files is not None:
            if (not isinstance(files, (list, tuple)) or not 0 < len(files) <= MAX_KEY_FILES
                    or not all(_relative(f) for f in files)):
                raise InvalidTactic("parameter key_files must be a list of paths relative to "
                                    f"the flashinfer package (at most {MAX_KEY_FILES})")
            out["key_files"] = sorted(set(files))
        return out

    def source_sha256(self) -> str:
        # the sources are FlashInfer's, hashed by the client: they are in the params
        return hashlib.sha256(b"flashinfer.jit: sources in params.source_sha256").hexdigest()

    def symbol(self, params: Mapping[str, Any]) -> str:
        """The exported function's name, as FlashInfer's JitSpecCuteDsl names it."""
        return names.symbol(params["module"], params["kernel"])

    def published_name(self, request: KernelRequest, kernel_name: str | None
                       ) -> tuple[str, str]:
        return request.params["kernel"], self.symbol(request.params)

    def plan(self, shape, arch, sm_count, options) -> list[KernelRequest]:
        raise InvalidTactic(f"{self.name} has no tactic space: its kernels are published")

    def build(self, request: KernelRequest, workdir: Path) -> BuiltObject:
        raise InvalidTactic(f"{self.name} has no compile recipe in the daemon: a client "
                            "compiles it and publishes it (write-back)")


def _relative(path: Any) -> bool:
    return (isinstance(path, str) and 0 < len(path) <= 512 and not path.startswith("/")
            and ".." not in path.split("/") and "\0" not in path)
