"""What a kernel family is: the small interface every family module implements.

Two halves run in two places. ``canonical_params`` and ``source_sha256`` run in the
daemon's main process and must not import the compiler, torch or FlashInfer. ``plan``
and ``build`` run in a pool worker (or a client's fallback), where the toolchain is
imported once; ``build`` sets nothing global but ``CUTE_DSL_ARCH``.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cached_client.errors import InvalidTactic
from cached_client.keys import DEFAULT_SM_COUNT, KernelRequest  # noqa: F401 (re-export)


@dataclass(frozen=True)
class BuiltObject:
    """A compiled kernel exported as an object file; ``symbol`` is its TVM-FFI function."""

    kernel_name: str
    symbol: str
    object_path: Path
    meta: Mapping[str, Any]


class Family(abc.ABC):
    """A kernel family: its tactic space, its identity rules and its compile recipe."""

    name: str
    arches: tuple[str, ...]
    reduction_order_m_independent: bool = False
    sources: str = "daemon"
    """Whose files decide the kernel (cached/toolchain/toolchains.py routes by it): ``daemon`` (this
    package's own, hashed by :meth:`source_sha256`), ``flashinfer`` (the requesting
    environment's FlashInfer: its client states their hash, cached_client.identity) or
    ``params`` (hashed by the client into the request's parameters; written back only)."""
    light_planner: bool = False
    """Whether :meth:`plan` is pure Python that needs no toolchain and answers in
    milliseconds: the daemon then plans it in its main process (memoized), never as a pool
    job."""
    bundle: bool = False
    """Whether its artifacts are bundles of named opaque files (``publish_bundle``; the
    JIT libraries' own outputs, cached/families/jit.py) rather than an object the daemon
    links into a library (``publish``)."""

    def reduction_class(self, params: Mapping[str, Any]) -> str | None:
        """The reduction-order class of the tactic ``params`` (a short stable id), or None
        for a family that declares none. Tactics of one class give bitwise-equal results
        at every M; a batch-invariant plan never mixes classes."""
        return None

    def reduction_classes(self) -> tuple[str, ...]:
        """Every class id :meth:`reduction_class` can answer (empty: none declared)."""
        return ()

    def reduction_info(self) -> dict[str, Any]:
        """What ``hello`` publishes for this family: its class ids and whether a class's
        reduction order is declared M-independent (``m_independent``)."""
        return {"classes": list(self.reduction_classes()),
                "m_independent": bool(self.reduction_order_m_independent)}

    def tune_schemes(self) -> dict[str, dict[str, Any]]:
        """What ``cached tune`` can time for this family: {scheme name: the plan options of
        that scheme} (every class a batch-invariant plan of the scheme uses is tuned under
        it). Empty (the default): nothing; a family that declares schemes also implements
        :meth:`tune_error_bound`."""
        return {}

    def tune_error_bound(self, reduction_class: str, k: int, floor: float) -> float:
        """The largest relative error (``‖out − ref‖ / ‖ref‖`` against a float32
        reference) a correct kernel of ``reduction_class`` gives at K = ``k``, the output
        type's own rounding of the reference being ``floor``: what ``cached tune`` accepts."""
        raise NotImplementedError(f"{self.name} declares no tune schemes")

    def tune_neighbours(self, n: int, k: int, m: int, sm_count: int, reduction_class: str,
                        options: Mapping[str, Any], near: int) -> list[dict]:
        """Tactic params worth timing for (N, K) at bucket M beside the plan's first ones
        (e.g. recorded winners of nearby shapes, in the class and scheme asked); ``cached
        tune`` keeps only those its plan of the class lists. Default: none."""
        return []

    def check_arch(self, arch: str) -> None:
        if arch not in self.arches:
            raise InvalidTactic(
                f"family {self.name} builds for {', '.join(self.arches)}, not {arch}"
            )

    @abc.abstractmethod
    def canonical_params(self, params: Mapping[str, Any], arch: str) -> dict:
        """Validated parameters with defaults filled in; raises InvalidTactic."""

    @abc.abstractmethod
    def source_sha256(self) -> str:
        """Hash of the kernel source files whose content decides the artifact."""

    @abc.abstractmethod
    def plan(
        self, shape: tuple[int, int, int], arch: str, sm_count: int, options: Mapping[str, Any]
    ) -> list[KernelRequest]:
        """The tactic space for one (M, N, K) shape, in a stable order (best first)."""

    def plan_first(
        self, shape: tuple[int, int, int], arch: str, sm_count: int, options: Mapping[str, Any]
    ) -> KernelRequest | None:
        """:meth:`plan`'s first request (None: it plans nothing), for a family that can say
        it without making the rest."""
        return next(iter(self.plan(shape, arch, sm_count, options)), None)

    @abc.abstractmethod
    def build(self, request: KernelRequest, workdir: Path) -> BuiltObject:
        """Compile ``request`` and export its object file into ``workdir``."""

    def preload(self) -> None:
        """Import the toolchain this family compiles with (a worker calls it once)."""
        return None

    def published_name(self, request: KernelRequest, kernel_name: str | None
                       ) -> tuple[str, str]:
        """(kernel name, exported symbol) of an object a client compiled for ``request`` and
        publishes (write-back, for an environment no toolchain of the daemon matches);
        InvalidTactic unless the name is the one this family gives ``request``."""
        raise InvalidTactic(f"{self.name} kernels are not written back")

    def check_files(self, params: Mapping[str, Any], files: Mapping[str, Any]) -> None:
        """InvalidTactic unless ``files`` (a bundle's manifest) are the files this family's
        bundle for ``params`` consists of."""
        raise InvalidTactic(f"{self.name} artifacts are not bundles")

    def canonical_request(self, request: KernelRequest) -> KernelRequest:
        self.check_arch(request.arch)
        params = self.canonical_params(request.params, request.arch)
        return KernelRequest(
            family=request.family,
            params=params,
            arch=request.arch,
            sm_count=request.sm_count,
            max_active_clusters=request.max_active_clusters,
        )


def set_compile_arch(arch: str) -> None:
    """Make the next ``cute.compile`` in this process target ``arch`` (e.g. ``sm_100a``).

    The DSL reads ``CUTE_DSL_ARCH`` once, when it is imported; a worker serves several
    arches, so the value is also set on every live DSL singleton's environment.
    """
    import sys

    os.environ["CUTE_DSL_ARCH"] = arch
    if "cutlass" in sys.modules:
        from cutlass.base_dsl.dsl import DSLSingletonMeta

        for dsl in list(DSLSingletonMeta._instances.values()):
            dsl.envar.arch = arch


def _tuplify(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_tuplify(v) for v in value)
    return value


def require(params: Mapping[str, Any], name: str, allowed: Any, default: Any = ...) -> Any:
    """``params[name]`` if it equals one of ``allowed`` with the same type (lists as tuples)."""
    if name not in params:
        if default is ...:
            raise InvalidTactic(f"parameter {name!r} is required")
        return default
    value = _tuplify(params[name])
    if not any(type(value) is type(a) and value == a for a in allowed):
        choices = ", ".join(repr(a) for a in allowed)
        raise InvalidTactic(f"parameter {name}={params[name]!r} is not one of: {choices}")
    return value
