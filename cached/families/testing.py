"""Family ``cached.test.fault``: fault injection for tests, registered only when
``CACHED_TEST_FAMILIES=1`` is set in the daemon's environment.

``action``: ``sleep`` (hang for ``seconds``), ``crash`` (the worker SIGKILLs itself),
``fail`` (raise, as a compiler error would), ``introspect`` (fail with a message saying which
interpreter the worker is and which of the daemon's own dependencies it has imported).
``tag`` makes otherwise equal requests distinct keys.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cached_client.errors import InvalidTactic
from cached_client.keys import KernelRequest

from .base import BuiltObject, Family, require


class FaultFamily(Family):
    name = "cached.test.fault"
    arches = ("sm_90a", "sm_100a", "sm_103a")

    def canonical_params(self, params: Mapping[str, Any], arch: str) -> dict:
        seconds = params.get("seconds", 0)
        if not isinstance(seconds, (int, float)) or not 0 <= seconds <= 3600:
            raise InvalidTactic("seconds must be a number in [0, 3600]")
        return {
            "action": require(params, "action", ("sleep", "crash", "fail", "introspect")),
            "seconds": float(seconds),
            "tag": str(params.get("tag", "")),
        }

    def source_sha256(self) -> str:
        return "0" * 64

    def plan(self, shape, arch, sm_count, options) -> list[KernelRequest]:
        return []

    def build(self, request: KernelRequest, workdir: Path) -> BuiltObject:
        action = request.params["action"]
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
