"""Families of the JIT libraries' own artifacts: ``flashinfer.nvcc``, ``humming``, ``triton``.

Each is write-back only (no recipe in the daemon: compiling needs the library's state in
the calling process) and its artifacts are bundles of named opaque files, stored as the
library wrote them and served back to be loaded by the library itself:

- ``flashinfer.nvcc``: one FlashInfer nvcc JIT module, ``<module>.so``;
- ``humming``: one Humming cubin as its compiler wrote it, ``kernel_tmp.cubin`` (Humming
  post-processes it itself, in every process, before loading it);
- ``triton``: one Triton cache group: ``__grp__<name>.json`` and the files it lists.

Their parameters are what the library itself decides a rebuild on, normalised to content
(the client computes them: cached_client.integrations.jit.content and .triton); the key
adds the client's toolchain (cached/toolchain/toolchains.py, sources ``params``). None of
these artifacts bakes in the device's SM count, so requests are keyed with ``sm_count`` and
``max_active_clusters`` 1, whatever the client sent.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from cached_client.errors import InvalidTactic
from cached_client.keys import ARCHES, KernelRequest
from cached_client.protocol import BUNDLE_NAME, HEX64_RE

from .base import BuiltObject, Family

Check = Callable[[Any], bool]


def _text(limit: int, pattern: str | None = None) -> Check:
    regex = re.compile(pattern) if pattern else None
    return lambda v: (isinstance(v, str) and len(v) <= limit
                      and (regex is None or regex.fullmatch(v) is not None))


HEX64 = _text(64, HEX64_RE.pattern)
VERSION = _text(64, r"[0-9A-Za-z.+_-]{1,64}")


class BundleFamily(Family):
    """A write-back family whose artifacts are bundles; subclasses declare ``fields``
    (parameter name -> check) and which files a bundle holds."""

    arches = ARCHES
    sources = "params"
    bundle = True
    fields: dict[str, Check] = {}

    def canonical_params(self, params: Mapping[str, Any], arch: str) -> dict:
        unknown = sorted(set(params) - set(self.fields))
        missing = sorted(set(self.fields) - set(params))
        if unknown or missing:
            raise InvalidTactic(f"{self.name} takes exactly the parameters "
                                f"{', '.join(sorted(self.fields))}"
                                + (f"; unknown: {', '.join(unknown)}" if unknown else "")
                                + (f"; missing: {', '.join(missing)}" if missing else ""))
        for name, check in self.fields.items():
            if not check(params[name]):
                raise InvalidTactic(f"{self.name}: parameter {name}={str(params[name])[:80]!r} "
                                    "is not valid")
        return {name: params[name] for name in sorted(self.fields)}

    def canonical_request(self, request: KernelRequest) -> KernelRequest:
        """The request as keyed: no SM count or cluster occupancy (not a fact these
        artifacts depend on)."""
        self.check_arch(request.arch)
        return KernelRequest(request.family, self.canonical_params(request.params, request.arch),
                             request.arch, 1, 1)

    def source_sha256(self) -> str:
        # the library's sources are hashed by the client into the parameters
        return hashlib.sha256(f"{self.name}: sources in params".encode()).hexdigest()

    def published_name(self, request: KernelRequest, kernel_name: str | None
                       ) -> tuple[str, str]:
        return self.kernel_name(request.params), ""

    def kernel_name(self, params: Mapping[str, Any]) -> str:
        raise NotImplementedError

    def plan(self, shape, arch, sm_count, options) -> list[KernelRequest]:
        raise InvalidTactic(f"{self.name} has no tactic space: its artifacts are published")

    def build(self, request: KernelRequest, workdir: Path) -> BuiltObject:
        raise InvalidTactic(f"{self.name} has no compile recipe in the daemon: a client "
                            "compiles it and publishes it (write-back)")

    def _exactly(self, files: Mapping[str, Any], names: set[str]) -> None:
        if set(files) != names:
            raise InvalidTactic(f"a {self.name} bundle holds exactly {', '.join(sorted(names))}, "
                                f"not {', '.join(sorted(files))}")


class FlashInferNvcc(BundleFamily):
    """FlashInfer's nvcc JIT modules (``JitSpecNvcc``): the module's ``.so``."""

    name = "flashinfer.nvcc"
    fields = {
        "module": _text(200, r"[A-Za-z0-9_]{1,200}"),
        "flashinfer": VERSION,
        "archs": lambda v: (isinstance(v, list) and 0 < len(v) <= 16
                            and all(_text(16, r"\d{1,3}\.\d{1,2}[af]?")(a) for a in v)),
        "cuda": VERSION,
        "cxx": _text(256),
        "build_sha256": HEX64,
        "sources_sha256": HEX64,
        "toolkit_sha256": HEX64,
    }

    def kernel_name(self, params: Mapping[str, Any]) -> str:
        return params["module"]

    def check_files(self, params: Mapping[str, Any], files: Mapping[str, Any]) -> None:
        self._exactly(files, {f"{params['module']}.so"})


class Humming(BundleFamily):
    """Humming's cubins, as its compiler (NVRTC or nvcc) writes them."""

    name = "humming"
    fields = {
        "compiler": lambda v: v in ("NVRTCCompiler", "NVCCCompiler"),
        "signature": _text(64),
        "kernel_expr": _text(4096),
        "humming": VERSION,
        "code_sha256": HEX64,
        "flags_sha256": HEX64,
        "headers_sha256": HEX64,
        "toolkit_sha256": HEX64,
    }
    FILE = "kernel_tmp.cubin"

    def kernel_name(self, params: Mapping[str, Any]) -> str:
        return params["kernel_expr"] or params["code_sha256"][:16]

    def check_files(self, params: Mapping[str, Any], files: Mapping[str, Any]) -> None:
        self._exactly(files, {self.FILE})


class Triton(BundleFamily):
    """Triton's compiled kernels: one cache group (``__grp__<name>.json`` and its files)."""

    name = "triton"
    fields = {
        "cache_key": _text(52, r"[A-Z2-7]{52}"),
        "group": lambda v: (isinstance(v, str) and BUNDLE_NAME.match(v) is not None
                            and v.endswith(".json") and not v.startswith("__grp__")),
        "triton": VERSION,
        "target": _text(64, r"cuda:\d{2,3}:\d{1,3}"),
    }

    def kernel_name(self, params: Mapping[str, Any]) -> str:
        return params["group"].removesuffix(".json")

    def check_files(self, params: Mapping[str, Any], files: Mapping[str, Any]) -> None:
        needed = {params["group"], f"__grp__{params['group']}"}
        if not needed <= set(files):
            raise InvalidTactic(f"a triton bundle holds its group file and metadata "
                                f"({', '.join(sorted(needed))}), not only "
                                f"{', '.join(sorted(files))}")
