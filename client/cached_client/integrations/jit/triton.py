"""Triton's remote cache backed by the daemon (family ``triton``): one compile per kernel per node.

Select it with Triton's own two variables (the vLLM plugin sets them when a daemon is
live and neither is set)::

    TRITON_CACHE_MANAGER=triton.runtime.cache:RemoteCacheManager
    TRITON_REMOTE_CACHE_BACKEND=cached_client.integrations.jit.triton:DaemonBackend

Triton makes one backend per ``triton.compile`` call, with the kernel's cache key, and asks
it ``get(["__grp__<name>.json"])`` before compiling (then the group's files), or, after
compiling, ``put``s each file with the group file last. :class:`DaemonBackend` answers the
first ``get`` of a group from the daemon (write-back, cached_client.writeback):

- a **hit** (after waiting, if another process of the node is compiling that kernel: its
  lease): the group's files, checked against their digests, served all-or-nothing to the
  ``get`` calls that follow; Triton materialises them in its cache directory and loads
  them as after its own compile;
- a **lease**: ``{}`` (a miss): Triton compiles; the files it ``put``s are published as one
  bundle at the group file's ``put``, which ends the lease. A compile that fails never puts
  the group: the backend's finalizer releases the lease when Triton drops the backend
  (then the lease's time-to-live and its holder's pid are the backstop).

The key is Triton's own (by content: Triton's sources and library, the kernel's source and
signature, the target, the options, Triton's cache-invalidating variables), the group's
name, and the target; plus, as for every request, this environment's toolchain. Triton
hands a backend only the key; the target (the arch the daemon files the kernel under) is
read from the ``triton.compile`` call that made the backend. Backends made elsewhere (the
host-side launcher modules Triton builds with the local C compiler, autotuning results)
and targets the daemon does not key are passed through: Triton's local cache serves them.
"""

from __future__ import annotations

import logging
import sys
import weakref

from triton.runtime.cache import RemoteCacheBackend

from cached_client import identity, writeback
from cached_client.keys import KernelRequest
from cached_client.protocol import Artifact

from .hook import Hook, daemon_arch

logger = logging.getLogger("cached_client.triton")

FAMILY = "triton"
GROUP_PREFIX = "__grp__"


class TritonHook(Hook):
    """Triton's hook: what :class:`DaemonBackend` did. Triton selects the backend by its own
    variables (the module doc), so the hook replaces nothing; the first backend installs it
    (its client: $CACHED_SOCKET, unless :meth:`install` gave one first)."""

    name = "Triton"
    family = FAMILY


install = TritonHook.install
uninstall = TritonHook.uninstall
stats = TritonHook.stats
"""What the backend did in this process (``passthrough``: backends Triton made outside a
kernel compile; the other counts: cached_client.integrations.jit.hook)."""
installed = TritonHook.installed


def _compile_target() -> str | None:
    """``cuda:<arch>:<warp size>`` of the ``triton.compile`` call constructing the backend,
    or None (not made by a compile, or not a CUDA target)."""
    frame = sys._getframe(2)
    for _ in range(12):
        if frame is None:
            return None
        if (frame.f_code.co_name == "compile"
                and frame.f_globals.get("__name__") == "triton.compiler.compiler"):
            target = frame.f_locals.get("target")
            arch, warp = getattr(target, "arch", None), getattr(target, "warp_size", None)
            if getattr(target, "backend", None) == "cuda" and isinstance(arch, int):
                return f"cuda:{arch}:{warp}"
            return None
        frame = frame.f_back
    return None


class DaemonBackend(RemoteCacheBackend):
    """Triton's ``RemoteCacheBackend``, one per kernel compile (see the module doc)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self._target = _compile_target()
        self._state = "new"  # new, hit, leased, done, passthrough
        self._files: dict[str, bytes] = {}
        self._puts: dict[str, bytes] = {}
        self._lease: writeback.HeldLease | None = None

    def _request(self, group: str) -> KernelRequest | None:
        assert self._target is not None
        arch = int(self._target.split(":")[1])
        keyed = daemon_arch(f"{arch}a" if arch >= 90 else str(arch))
        if keyed is None:
            return None
        dist = identity.distributions().get("triton")
        return KernelRequest(FAMILY, {"cache_key": self.key, "group": group,
                                      "triton": dist.version if dist else "unknown",
                                      "target": self._target}, keyed, 1, 1)

    def get(self, filenames: list[str]) -> dict[str, bytes]:
        names = list(filenames)
        if self._state == "new":
            self._state = "passthrough"
            if self._target is None or len(names) != 1 or not names[0].startswith(GROUP_PREFIX):
                TritonHook.install().counts["passthrough"] += 1
                return {}
            self._first(names[0])
        if self._state == "hit" and all(n in self._files for n in names):
            return {n: self._files[n] for n in names}
        return {}

    def _first(self, group_file: str) -> None:
        """The first ``get`` of a group: a hit, a lease, or pass-through."""
        h = TritonHook.install()
        name = group_file[len(GROUP_PREFIX):].removesuffix(".json")
        got = h.ask(name, "asking the daemon for a kernel",
                    lambda: self._request(group_file[len(GROUP_PREFIX):]))
        if got is None:
            return
        if isinstance(got, Artifact):
            try:
                self._files = writeback.read_bundle(got)
            except Exception as exc:  # noqa: BLE001 -- refused: Triton compiles it
                h.refused(name, "reading a kernel from the daemon", exc)
                return
            self._state = "hit"
            h.counts["hit"] += 1
            return
        self._lease = got  # Triton compiles it here, under this lease
        self._state = "leased"
        weakref.finalize(self, got.release, "Triton's compile ended without a group")

    def put(self, filename: str, data: bytes) -> None:
        if self._state != "leased" or self._lease is None:
            return
        self._puts[filename] = bytes(data)
        if not filename.startswith(GROUP_PREFIX):
            return
        self._state = "done"
        h = TritonHook.install()
        try:
            self._lease.publish_bundle(self._puts)
            h.counts["compiled"] += 1
        except Exception as exc:  # noqa: BLE001 -- compiled here; only the sharing failed
            h.failed("publishing a kernel", exc)
