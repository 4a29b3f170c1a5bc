"""Family ``cached.hopper_fp8``: the project's own sm_90a FP8 GEMM, served by the daemon.

Every tactic belongs to one reduction-order class (``reduction_class``: K tile,
accumulation mode, split count S with its fixed order; see ``tactic``). Within a class
the result of a row does not depend on M, so a batch-invariant plan may mix the tactics
of one class across M, never two classes. ``max_active_clusters`` comes from the
request (an H200: 132 SMs), never from a GPU query in the daemon.

Plan options: ``out_dtype``, ``ab_dtype``; ``scales`` (``"tensor"``, the default, or
``"token"``: per-token activation x per-channel weight, or ``"block128"``: 1x128 activation
x 128x128 weight scales in the K loop, K % 128 == 0) and ``accumulation`` (``"fast"``,
the default, or ``"exact"``: promoted every K tile; the default and the only mode for
block128); ``batch_invariant: true``
(only the class of that scheme with ``space.choose_split(N, K, sm_count)`` splits, S = 1
for block128, the same for every M); ``reduction_class: "<id>"`` (only that class; wins over
``batch_invariant``; a ``scales`` or ``accumulation`` option that disagrees with it is an
error).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cached_client.errors import InvalidTactic
from cached_client.keys import KernelRequest

from cached.toolchain import compiler_stack

from ..base import BuiltObject, Family, require, set_compile_arch
from . import accuracy, space, tactic, winners

# what a kernel's object code is built from (the tactic's fields and resource arithmetic
# included; the cost model and recorded winners only order the plan)
SOURCES = ("kernel.py", "mainloop.py", "scales.py", "epilogue.py", "fragments.py", "compile.py",
           "tactic.py")
#: ``cached tune``'s schemes: name -> the plan options (scales, accumulation) of the scheme
TUNE_SCHEMES = {
    "tensor-fast": {},
    "token-fast": {"scales": "token", "accumulation": "fast"},
    "tensor-exact": {"scales": "tensor", "accumulation": "exact"},
    "token-exact": {"scales": "token", "accumulation": "exact"},
    "block128": {"scales": "block128", "accumulation": "exact"},
}


class HopperFp8(Family):
    name = tactic.FAMILY
    arches = (tactic.TARGET_ARCH,)
    reduction_order_m_independent = tactic.REDUCTION_ORDER_M_INDEPENDENT
    light_planner = True  # the tactic space and the cost model: arithmetic

    #: the operand types this family's tactics have (the bf16 family: tactic.BF16)
    ab_dtypes: tuple[str, ...] = tactic.FP8_AB_DTYPES
    out_dtypes: tuple[str, ...] = tactic.OUT_DTYPES
    symbol_prefix = "cached_hopper_fp8_"

    def tactic(self, params: Mapping[str, Any]) -> tactic.HopperFp8Tactic:
        """The validated tactic of ``params``, one of this family's operand types; raises
        InvalidTactic naming what is wrong."""
        try:
            t = tactic.tactic_from_params(params)
        except (TypeError, ValueError) as exc:
            raise InvalidTactic(str(exc)) from None
        if t.ab_dtype not in self.ab_dtypes:
            raise InvalidTactic(f"{self.name} tactics take ab_dtype in {self.ab_dtypes}, got "
                                f"{t.ab_dtype!r} (family {t.family} serves it)")
        return t

    def reduction_class(self, params: Mapping[str, Any]) -> str:
        """e.g. ``"k128.acc1.s4.fixed"``; raises InvalidTactic for invalid params."""
        return self.tactic(params).reduction_class

    def reduction_classes(self) -> tuple[str, ...]:
        return tactic.REDUCTION_CLASSES

    def plan_scheme(self, shape: tuple[int, int, int], sm_count: int,
                    options: Mapping[str, Any]) -> tuple[int | None, str, str]:
        """(S or None for every S, scales, accum) of what the options ask for."""
        bi = options.get("batch_invariant", False)
        if not isinstance(bi, bool):
            raise InvalidTactic(f"option batch_invariant must be true or false, got {bi!r}")
        scales = require(options, "scales", tactic.SCALE_SCHEMES, "tensor")
        accum = require(options, "accumulation", tactic.ACCUM_MODES,
                        "exact" if scales == "block128" else "fast")
        if scales == "block128" and shape[2] % tactic.BLOCK:
            raise InvalidTactic(f"scales 'block128' need K % {tactic.BLOCK} == 0 (one scale "
                                f"group per K tile), got K = {shape[2]}")
        rc = options.get("reduction_class")
        if rc is not None:
            if not isinstance(rc, str):
                raise InvalidTactic(f"option reduction_class must be a string, got {rc!r}")
            try:
                s, c_accum, c_scales = tactic.class_scheme(rc)
            except ValueError as exc:
                raise InvalidTactic(str(exc)) from None
            for opt, have, want in (("scales", scales, c_scales),
                                    ("accumulation", accum, c_accum)):
                if opt in options and have != want:
                    raise InvalidTactic(f"option {opt}={have!r} contradicts reduction_class "
                                        f"{rc!r} ({opt} {want!r})")
            return s, c_scales, c_accum
        if bi:
            _, n, k = shape
            return (1 if scales == "block128" else space.choose_split(n, k, sm_count),
                    scales, accum)
        return None, scales, accum

    def tune_schemes(self) -> dict[str, dict[str, Any]]:
        """Every (scales, accumulation) pair of the family (tactic.SCHEMES), by name."""
        return {name: dict(opts) for name, opts in TUNE_SCHEMES.items()}

    def tune_error_bound(self, reduction_class: str, k: int, floor: float) -> float:
        """accuracy.error_bound: the floor, and fast accumulation's part over K / S."""
        return accuracy.error_bound(reduction_class, k, floor)

    def tune_neighbours(self, n: int, k: int, m: int, sm_count: int, reduction_class: str,
                        options: Mapping[str, Any], near: int) -> list[dict]:
        """The recorded winners (winners.recorded_winners, timed per-tensor fast) at bucket
        M of the ``near`` recorded (N, K) of this SM count nearest to (N, K) in
        (log N, log K), nearest first, in the class's S and scheme; a winner that is no
        valid tactic of the scheme is left out."""
        splits, accum, scales = tactic.class_scheme(reduction_class)
        out_dtype = options.get("out_dtype", "bfloat16")
        ab_dtype = options.get("ab_dtype", "e4m3")
        found = []
        for key in winners.nearest_keys(n, k, m, sm_count, splits, near):
            t = winners.tactic_from_key(key, splits, out_dtype, ab_dtype)
            try:
                t = dataclasses.replace(t, scales=scales, accum=accum).normalized()
            except ValueError:
                continue
            found.append(t.to_params())
        return found

    def canonical_params(self, params: Mapping[str, Any], arch: str) -> dict:
        return self.tactic(params).to_params()

    @functools.cache  # noqa: B019 -- one instance per process; sources fixed per install
    def source_sha256(self) -> str:
        here = Path(__file__).parent
        return compiler_stack.hash_files(tuple(here / name for name in SOURCES))

    def _ranked(self, shape: tuple[int, int, int], arch: str, sm_count: int,
                options: Mapping[str, Any]) -> list[tactic.HopperFp8Tactic]:
        self.check_arch(arch)
        out_dtype = require(options, "out_dtype", self.out_dtypes, "bfloat16")
        ab_dtype = require(options, "ab_dtype", self.ab_dtypes, self.ab_dtypes[0])
        m, n, k = shape
        try:
            splits, scales, accum = self.plan_scheme(shape, sm_count, options)
            return space.enumerate_tactics(m, n, k, out_dtype, ab_dtype, num_sms=sm_count,
                                           splits=splits, scales=scales, accum=accum)
        except ValueError as exc:
            raise InvalidTactic(str(exc)) from None

    def _request(self, t: tactic.HopperFp8Tactic, arch: str, sm_count: int) -> KernelRequest:
        return KernelRequest(family=self.name, params=t.to_params(), arch=arch,
                             sm_count=sm_count,
                             max_active_clusters=max(1, sm_count // t.cluster_size))

    def plan(self, shape: tuple[int, int, int], arch: str, sm_count: int,
             options: Mapping[str, Any]) -> list[KernelRequest]:
        return [self._request(t, arch, sm_count)
                for t in self._ranked(shape, arch, sm_count, options)]

    def plan_first(self, shape: tuple[int, int, int], arch: str, sm_count: int,
                   options: Mapping[str, Any]) -> KernelRequest | None:
        ranked = self._ranked(shape, arch, sm_count, options)
        return self._request(ranked[0], arch, sm_count) if ranked else None

    def build(self, request: KernelRequest, workdir: Path) -> BuiltObject:
        set_compile_arch(request.arch)
        from .compile import compile_to_object

        t = self.tactic(request.params)
        kernel_name = f"{t.name}_mac{request.max_active_clusters}"
        symbol = f"{self.symbol_prefix}{kernel_name}"
        object_path = workdir / f"{kernel_name}.o"
        compile_to_object(t, request.max_active_clusters, str(object_path), symbol)
        return BuiltObject(kernel_name, symbol, object_path,
                           {"reduction_order": t.reduction_order,
                            "reduction_class": t.reduction_class})
