"""What the client checks before it loads anything a daemon describes.

The daemon builds keys from the identity a request states, but a client cannot know the
daemon is today's: an older one ignores the identity and serves its own toolchain's
kernels. So the client checks every artifact's metadata against what it asked for and the
identity it stated (:func:`mismatches`), and asks only daemons whose ``hello`` states the
capabilities that make those checks meaningful (:data:`REQUIRED`). Stdlib only.

What must agree, for an artifact of a kernel request:

- ``family``, ``kind``, ``arch``: equal to the request's;
- ``sm_count``, ``max_active_clusters``: equal to the request's, or 1 (the family keys the
  kernel without that device fact: docs/keys.md);
- the toolchain fingerprint equals this process's; for the project's own families
  (``cached.*``, whose sources are the daemon's package and which the daemon routes by
  runtime) the runtime the kernel links against (TVM-FFI version and DSL runtime digest)
  may equal this process's instead;
- ``source_sha256``: equal to the sources this process states for the family, if it states
  them (FlashInfer's families).

Identity parts are checked against the identity the request stated; a request that stated
none (``Client(identity=False)``) accepts the daemon's default toolchain.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping
from typing import Any

from .errors import BadReply
from .keys import KernelRequest
from .protocol import Artifact

REQUIRED = ("identity:keys", "identity:artifact")
"""What a daemon's ``hello`` must state before the client asks it for an artifact."""
OWN_FAMILY_PREFIX = "cached."
"""The project's own families: built from the daemon's sources, routed by runtime."""
RUNTIME_KEYS = ("tvm_ffi", "dsl_runtime_sha256")


def too_old(capabilities: Iterable[str], path: str) -> str | None:
    """Why the daemon at ``path`` that stated ``capabilities`` may not be asked for an
    artifact (one line), or None."""
    missing = [c for c in REQUIRED if c not in capabilities]
    if not missing:
        return None
    return (f"the daemon at {path} is older than this client: its hello does not state "
            f"{', '.join(missing)}, so its artifacts do not say what they were built with; "
            "not asking it for kernels (upgrade or restart it)")


def _short(value: Any) -> str:
    text = str(value) if value not in (None, "") else "not stated"
    return text if len(text) <= 16 else text[:12] + "..."


def _runtime(runtime: Mapping[str, Any]) -> str:
    return (f"TVM-FFI {_short(runtime.get('tvm_ffi'))}, DSL runtime "
            f"{_short(runtime.get('dsl_runtime_sha256'))}")


def mismatches(artifact: Artifact, request: KernelRequest, identity: Mapping[str, Any] | None,
               kind: str = "kernel") -> dict[str, str]:
    """{field: what differs} between ``artifact`` and what ``request`` with ``identity``
    (its wire form, or None) asked for; empty when the artifact is this process's."""
    out: dict[str, str] = {}

    def differ(name: str, stated: Any, wanted: Any) -> None:
        out[name] = f"{name} {_short(stated)}, this process {_short(wanted)}"

    if artifact.family != request.family:
        differ("family", artifact.family, request.family)
    if artifact.kind != kind:
        differ("kind", artifact.kind, kind)
    if artifact.arch != request.arch:
        differ("arch", artifact.arch, request.arch)
    for name in ("sm_count", "max_active_clusters"):
        stated = getattr(artifact, name)
        if stated not in (getattr(request, name), 1):
            differ(name, stated or None, getattr(request, name))
    if identity is None:
        return out
    if artifact.toolchain != identity.get("toolchain"):
        mine, theirs = identity.get("runtime") or {}, artifact.runtime
        if not request.family.startswith(OWN_FAMILY_PREFIX):
            differ("toolchain", _digest(artifact.toolchain), _digest(identity.get("toolchain")))
        elif not all(mine.get(k) and theirs.get(k) == mine.get(k) for k in RUNTIME_KEYS):
            out["runtime"] = (f"toolchain {_short(_digest(artifact.toolchain))} with runtime "
                              f"{_runtime(theirs)}, this process {_runtime(mine)}")
    sources = identity.get("sources") or {}
    if request.family in sources and artifact.source_sha256 != sources[request.family]:
        differ("source_sha256", artifact.source_sha256, sources[request.family])
    return out


def _digest(fingerprint: Any) -> str | None:
    if not fingerprint:
        return None
    from .identity import digest

    return digest(str(fingerprint))


def passed_blobs(transfer: str, blobs: Iterable[str], named: list[str], fds: list[int]
                 ) -> dict[str, int] | None:
    """For transfer ``fd``, the descriptors ``fds`` a reply passed for the blobs it
    ``named``, as kind -> fd, only the ``blobs`` asked for (None for another transfer);
    BadReply unless one came for each. Every descriptor not returned is closed."""
    wanted = set(blobs)
    if transfer != "fd" or not wanted <= set(named) or len(named) != len(fds):
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        if transfer != "fd":
            return None
        raise BadReply(f"the daemon passed descriptors for {named!r} ({len(fds)} received), "
                       f"not one for each of {sorted(wanted)!r}")
    passed = dict(zip(named, fds, strict=True))
    for kind in set(passed) - wanted:
        with contextlib.suppress(OSError):
            os.close(passed.pop(kind))
    return passed
