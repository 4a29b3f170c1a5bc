"""Family ``cached.test.fault``: fault injection for tests, registered only when
``CACHED_TEST_FAMILIES=1`` is set in the daemon's environment.

``action``: ``sleep`` (hang for ``seconds``), ``crash`` (the worker SIGKILLs itself),
``fail`` (raise, as a compiler error would), ``build`` (compile a tiny C object with gcc,
in well under a second, holding ``bytes`` bytes of constant data: a real kernel-sized
artifact for tests of the store; the same request always builds the same bytes),
``introspect`` (fail with a message saying which interpreter the worker is and which of
the daemon's own dependencies it has imported). ``tag`` makes otherwise equal requests
distinct keys (and, for ``build``, distinct bytes).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cached_client.errors import InvalidTactic
from cached_client.keys import KernelRequest

from .base import BuiltObject, Family, require

MAX_BUILD_BYTES = 16 << 20


class FaultFamily(Family):
    name = "cached.test.fault"
    arches = ("sm_90a", "sm_100a", "sm_103a")

    def canonical_params(self, params: Mapping[str, Any], arch: str) -> dict:
        seconds = params.get("seconds", 0)
        if not isinstance(seconds, (int, float)) or not 0 <= seconds <= 3600:
            raise InvalidTactic("seconds must be a number in [0, 3600]")
        size = params.get("bytes", 0)
        if (not isinstance(size, int) or isinstance(size, bool)
                or not 0 <= size <= MAX_BUILD_BYTES):
            raise InvalidTactic(f"bytes must be an integer in [0, {MAX_BUILD_BYTES}]")
        return {
            "action": require(params, "action", ("sleep", "crash", "fail", "build",
                                                 "introspect")),
            "seconds": float(seconds),
            "tag": str(params.get("tag", "")),
            "bytes": size,
        }

    def source_sha256(self) -> str:
        return "0" * 64

    def plan(self, shape, arch, sm_count, options) -> list[KernelRequest]:
        """No tactics; options ``mark`` (a file: one line appended per plan run) and
        ``seconds`` (how long the plan takes, at most 10) let tests see plans run."""
        if isinstance(options.get("mark"), str):
            with open(options["mark"], "a") as f:
                f.write(f"{shape}\n")
        seconds = options.get("seconds", 0)
        if isinstance(seconds, (int, float)) and 0 < seconds <= 10:
            time.sleep(seconds)
        return []

    def build(self, request: KernelRequest, workdir: Path) -> BuiltObject:
        action = request.params["action"]
        if action == "build":
            return _build(request.params["tag"], request.params["bytes"], workdir)
        if action == "sleep":
            time.sleep(request.params["seconds"])
        if action == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        if action == "introspect":
            daemon_deps = ("fastapi", "uvicorn", "sqlite_utils", "prometheus_client")
            raise RuntimeError("introspect " + json.dumps({
                "python": sys.executable, "daemon_modules": sorted(
                    m for m in sys.modules if m.split(".")[0] in daemon_deps)}))
        raise RuntimeError(f"injected failure ({action}, tag={request.params['tag']!r})")


def _build(tag: str, size: int, workdir: Path) -> BuiltObject:
    """A real object file: one exported function and ``size`` bytes of data derived from
    ``tag`` (so distinct tags give distinct digests)."""
    name = "cached_test_" + hashlib.sha256(tag.encode()).hexdigest()[:16]
    seed = int(hashlib.sha256(tag.encode()).hexdigest()[:2], 16) | 1
    source = (f"__attribute__((used)) static const unsigned char data[{max(size, 1)}] = "
              f"{{{seed}}};\nint {name}(void) {{ return data[0]; }}\n")
    path = workdir / f"{name}.o"
    subprocess.run(["gcc", "-c", "-O1", "-fPIC", "-x", "c", "-", "-o", str(path)],
                   input=source, text=True, check=True, capture_output=True)
    return BuiltObject(name, name, path, {"bytes": size})
