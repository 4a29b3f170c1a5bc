"""Family ``cached.hopper_fp8``: the project's own sm_90a FP8 GEMM, served by the daemon.

Every tactic reduces over K in one order (``tactics.REDUCTION_ORDER``), so the family
declares its reduction order M-independent and the batch-invariant policy may mix its
tactics across M. ``max_active_clusters`` comes from the request (an H200: 132 SMs),
never from a GPU query in the daemon.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cached_client.errors import InvalidTactic
from cached_client.keys import KernelRequest

from ... import toolchain
from ..base import BuiltObject, Family, require, set_compile_arch
from . import tactics

SOURCES = ("kernel.py", "compile.py", "tactics.py")


class HopperFp8(Family):
    name = "cached.hopper_fp8"
    arches = ("sm_90a",)
    reduction_order_m_independent = tactics.REDUCTION_ORDER_M_INDEPENDENT

    def canonical_params(self, params: Mapping[str, Any], arch: str) -> dict:
        try:
            return tactics.tactic_from_params(params).to_params()
        except (TypeError, ValueError) as exc:
            raise InvalidTactic(str(exc)) from None

    @functools.cache  # noqa: B019 -- one instance per process; sources fixed per install
    def source_sha256(self) -> str:
        here = Path(__file__).parent
        return toolchain.hash_files(tuple(here / name for name in SOURCES))

    def plan(self, shape: tuple[int, int, int], arch: str, sm_count: int,
             options: Mapping[str, Any]) -> list[KernelRequest]:
        self.check_arch(arch)
        out_dtype = require(options, "out_dtype", tactics.OUT_DTYPES, "bfloat16")
        ab_dtype = require(options, "ab_dtype", tactics.AB_DTYPES, "e4m3")
        m, n, k = shape
        try:
            space = tactics.enumerate_tactics(m, n, k, out_dtype, ab_dtype, num_sms=sm_count)
        except ValueError as exc:
            raise InvalidTactic(str(exc)) from None
        return [KernelRequest(family=self.name, params=t.to_params(), arch=arch,
                              sm_count=sm_count,
                              max_active_clusters=max(1, sm_count // t.cluster_size))
                for t in space]

    def build(self, request: KernelRequest, workdir: Path) -> BuiltObject:
        set_compile_arch(request.arch)
        from .compile import compile_to_object

        tactic = tactics.tactic_from_params(request.params)
        kernel_name = f"{tactic.name}_mac{request.max_active_clusters}"
        symbol = f"cached_hopper_fp8_{kernel_name}"
        object_path = workdir / f"{kernel_name}.o"
        compile_to_object(tactic, request.max_active_clusters, str(object_path), symbol)
        return BuiltObject(kernel_name, symbol, object_path,
                           {"reduction_order": tactics.REDUCTION_ORDER})
