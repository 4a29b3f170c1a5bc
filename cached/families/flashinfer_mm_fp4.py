"""Family ``flashinfer.mm_fp4``: FlashInfer's SM100 CuTe-DSL block-scaled FP4 GEMM tactics.

Parameters mirror FlashInfer's in-memory cache key for one mm_fp4 tactic
(``_mm_fp4_cache_key``): scale-factor vector (16 NVFP4, 32 MXFP4), MMA tile, cluster,
swap_ab, TMA prefetch, kernel type (``sm100`` persistent or ``sm100sk`` cluster split-K),
the ``use_tma_store`` slot (deep-K 8 for ``sm100``, K slices for ``sm100sk``), PDL, output
dtype, per-token alpha mode and L2 policy. The kernel is compiled by FlashInfer's own
``_make_blockscaled_gemm_compile_fn`` and named by ``_blockscaled_kernel_disk_name``; its
sources (``cached_client.flashinfer_sources.MM_FP4_SOURCES``) are FlashInfer's
``_blockscaled_gemm_cache_key_files`` plus the split-K kernel, hashed with the FlashInfer
distribution by cached_client.identity. The same code works with FlashInfer 0.7.2.post1
(vLLM 0.33.0's pin) and 0.7.4, whose mm_fp4 files are byte-identical.

FlashInfer 0.7.4 disables its SM103 3xFP4 kernel on Blackwell, so sm_103a gets the SM100
kernel's tactic space, as FlashInfer's runner does there.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cached_client import flashinfer_names as names
from cached_client import identity
from cached_client.errors import InvalidTactic
from cached_client.keys import KernelRequest

from .base import BuiltObject, Family, require, set_compile_arch

MMA_TILERS = ((128, 8), (128, 16), (128, 32), (128, 64), (256, 64), (128, 128), (256, 128),
              (128, 192), (256, 192), (128, 256), (256, 256))
CLUSTERS = ((1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2), (4, 4))
SPLIT_K_TILERS = ((128, 8), (128, 16), (128, 32))
LOW_M_TILERS = ((128, 8), (128, 16), (128, 32), (256, 8), (256, 16), (256, 32))
DEEP_K_INST = 8
DEEP_K_TILE = 512
MAX_AUTOTUNE_TACTICS = 32


class FlashInferMmFp4(Family):
    name = "flashinfer.mm_fp4"
    arches = ("sm_100a", "sm_103a")
    sources = "flashinfer"

    def canonical_params(self, params: Mapping[str, Any], arch: str) -> dict:
        known = {"sf_vec_size", "mma_tiler_mn", "cluster_shape_mn", "swap_ab", "use_prefetch",
                 "kernel_type", "use_tma_store", "enable_pdl", "out_dtype", "per_token_alpha",
                 "l2_policy"}
        unknown = sorted(set(params) - known)
        if unknown:
            raise InvalidTactic(f"{self.name} has no parameter(s) {', '.join(unknown)}")
        p = {
            "sf_vec_size": require(params, "sf_vec_size", (16, 32)),
            "mma_tiler_mn": require(params, "mma_tiler_mn", MMA_TILERS),
            "cluster_shape_mn": require(params, "cluster_shape_mn", CLUSTERS),
            "swap_ab": require(params, "swap_ab", (False, True)),
            "use_prefetch": require(params, "use_prefetch", (False, True), False),
            "kernel_type": require(params, "kernel_type", ("sm100", "sm100sk"), "sm100"),
            "enable_pdl": require(params, "enable_pdl", (False, True), True),
            "out_dtype": require(params, "out_dtype", ("bfloat16", "float16"), "bfloat16"),
            "per_token_alpha": require(params, "per_token_alpha", (None, "m", "n"), None),
        }
        tile_m, tile_n = p["mma_tiler_mn"]
        if tile_m == 256 and p["cluster_shape_mn"][0] % 2:
            raise InvalidTactic(
                f"mma_tiler_mn {p['mma_tiler_mn']} is a 2-CTA MMA and needs an even cluster M, "
                f"got cluster_shape_mn {p['cluster_shape_mn']}"
            )
        if p["kernel_type"] == "sm100sk":
            p["use_tma_store"] = require(params, "use_tma_store", (2, 4))
            p["l2_policy"] = require(params, "l2_policy", (None,), None)
            if (p["mma_tiler_mn"] not in SPLIT_K_TILERS or p["cluster_shape_mn"] != (1, 1)
                    or not p["swap_ab"] or p["use_prefetch"] or p["sf_vec_size"] != 16):
                raise InvalidTactic(
                    "split-K (kernel_type sm100sk) needs NVFP4 (sf_vec_size 16), a tile in "
                    f"{SPLIT_K_TILERS}, cluster (1, 1), swap_ab true and no prefetch"
                )
        else:
            p["use_tma_store"] = require(params, "use_tma_store", (None, DEEP_K_INST), None)
            p["l2_policy"] = require(params, "l2_policy", (None, "a_ef", "b_ef", "ab_el"), None)
            if p["use_tma_store"] == DEEP_K_INST and tile_n > 32:
                raise InvalidTactic(f"deep-K (use_tma_store 8) needs tile N <= 32, got {tile_n}")
        return {k: list(v) if isinstance(v, tuple) else v for k, v in p.items()}

    def preload(self) -> None:
        import flashinfer.gemm.gemm_mm_fp4_cute_dsl  # noqa: F401
        import flashinfer.gemm.kernels.dense_blockscaled_gemm_sm100  # noqa: F401
        import flashinfer.gemm.kernels.dense_blockscaled_gemm_sm100_splitk  # noqa: F401

    def source_sha256(self) -> str:
        """This environment's sources of the family (cached_client.identity.family_source)."""
        sha = identity.family_source(self.name)
        if sha is None:
            raise InvalidTactic(f"{self.name} needs FlashInfer, which this environment lacks")
        return sha

    def published_name(self, request: KernelRequest, kernel_name: str | None
                       ) -> tuple[str, str]:
        """FlashInfer's disk name of an mm_fp4 tactic names exactly its request: the name a
        client publishes must read back as the request it published under."""
        parsed = names.mm_fp4_request(kernel_name or "", request.arch, request.sm_count)
        if parsed is None or self.canonical_request(parsed) != request:
            raise InvalidTactic(f"kernel name {str(kernel_name)[:200]!r} is not the mm_fp4 "
                                "tactic of this request")
        assert kernel_name is not None
        return kernel_name, names.symbol(names.MM_FP4_MODULE, kernel_name)

    def plan(
        self, shape: tuple[int, int, int], arch: str, sm_count: int, options: Mapping[str, Any]
    ) -> list[KernelRequest]:
        self.check_arch(arch)
        m, n, k = shape
        quant = require(options, "quant", ("nvfp4", "mxfp4"), "nvfp4")
        out_dtype = require(options, "out_dtype", ("bfloat16", "float16"), "bfloat16")
        enable_pdl = require(options, "enable_pdl", (False, True), True)
        autotune_only = require(options, "autotune_only", (False, True), False)
        tactics = enumerate_tactics(m, n, k, 16 if quant == "nvfp4" else 32, sm_count, out_dtype)
        if autotune_only:
            tactics = tactics[:MAX_AUTOTUNE_TACTICS]
        from flashinfer.gemm.gemm_mm_fp4_cute_dsl import mm_fp4_l2_policy

        requests = []
        for tile, cluster, swap_ab, prefetch, kernel_type, tma in tactics:
            slices = tma if kernel_type == "sm100sk" else 1
            params = {
                "sf_vec_size": 16 if quant == "nvfp4" else 32, "mma_tiler_mn": list(tile),
                "cluster_shape_mn": list(cluster), "swap_ab": swap_ab, "use_prefetch": prefetch,
                "kernel_type": kernel_type, "use_tma_store": tma, "enable_pdl": enable_pdl,
                "out_dtype": out_dtype, "per_token_alpha": None,
                "l2_policy": mm_fp4_l2_policy(m, tile, swap_ab, kernel_type),
            }
            requests.append(KernelRequest(
                family=self.name, params=params, arch=arch, sm_count=sm_count,
                max_active_clusters=max(1, sm_count // (cluster[0] * cluster[1] * slices)),
            ))
        return requests

    def build(self, request: KernelRequest, workdir: Path) -> BuiltObject:
        set_compile_arch(request.arch)
        p = request.params
        import cutlass
        import torch
        from flashinfer.cute_dsl.utils import torch_to_cutlass_dtype
        from flashinfer.gemm.gemm_mm_fp4_cute_dsl import (
            _blockscaled_kernel_disk_name,
            _make_blockscaled_gemm_compile_fn,
            _mm_fp4_cache_key,
        )

        out_dtype = getattr(torch, p["out_dtype"])
        tile, cluster = tuple(p["mma_tiler_mn"]), tuple(p["cluster_shape_mn"])
        tactic = (tile, cluster, p["swap_ab"], p["use_prefetch"], p["kernel_type"],
                  p["use_tma_store"])
        cache_key = _mm_fp4_cache_key(p["sf_vec_size"], tactic, p["enable_pdl"], out_dtype,
                                      p["per_token_alpha"], p["l2_policy"])
        gemm = _make_kernel(p, tile, cluster)
        compile_fn = _make_blockscaled_gemm_compile_fn(
            gemm,
            ab_cutlass_dtype=cutlass.Uint8,
            sf_dtype=cutlass.Float8E4M3FN if p["sf_vec_size"] == 16 else cutlass.Float8E8M0FNU,
            c_cutlass_dtype=torch_to_cutlass_dtype(out_dtype),
            ab_assumed_align=32,
            swap_ab=p["swap_ab"],
            sf_m=1, sf_n=1, sf_k=1, batch_size=1,
            max_active_clusters=request.max_active_clusters,
            per_token_alpha=p["per_token_alpha"],
        )
        kernel_name = _blockscaled_kernel_disk_name(cache_key, 1, request.max_active_clusters)
        symbol = names.symbol(names.MM_FP4_MODULE, kernel_name)
        object_path = workdir / f"{kernel_name}.o"
        compile_fn().export_to_c(str(object_path), function_name=symbol)
        return BuiltObject(kernel_name, symbol, object_path,
                           {"flashinfer_module": names.MM_FP4_MODULE, "cache_key": repr(cache_key)})


def _make_kernel(p: Mapping[str, Any], tile: tuple, cluster: tuple) -> Any:
    """The kernel object FlashInfer's runner builds for this tactic."""
    if p["kernel_type"] == "sm100sk":
        from flashinfer.gemm.kernels.dense_blockscaled_gemm_sm100_splitk import (
            Sm100BlockScaledSplitKGemmKernel,
        )

        return Sm100BlockScaledSplitKGemmKernel(
            p["sf_vec_size"], tile, p["use_tma_store"], p["enable_pdl"], p["per_token_alpha"]
        )
    from flashinfer.gemm.kernels.dense_blockscaled_gemm_sm100 import (
        Sm100BlockScaledPersistentDenseGemmKernel,
    )

    l2 = p["l2_policy"]
    return Sm100BlockScaledPersistentDenseGemmKernel(
        p["sf_vec_size"], tile, cluster, p["use_prefetch"], p["enable_pdl"], p["per_token_alpha"],
        mma_inst_tile_k=p["use_tma_store"] or 4,
        a_l2_evict_first=l2 == "a_ef", b_l2_evict_first=l2 == "b_ef",
        a_l2_evict_last=l2 == "ab_el", b_l2_evict_last=l2 == "ab_el",
    )


def enumerate_tactics(
    m: int, n: int, k: int, sf_vec_size: int, sm_count: int, out_dtype: str = "bfloat16"
) -> list[tuple]:
    """FlashInfer's SM100 mm_fp4 tactic space for (m, n, k), ranked as its autotuner ranks it.

    Mirrors ``CuteDSLFp4GemmRunner.get_valid_tactics`` on SM100 with the SM count given
    instead of queried from a GPU. FlashInfer's autotuner profiles the first
    ``MAX_AUTOTUNE_TACTICS`` of this list (the ranking sort is stable).
    """
    import cutlass
    from flashinfer.gemm.gemm_base import _get_approximate_cta_nums
    from flashinfer.gemm.kernels.dense_blockscaled_gemm_sm100 import (
        Sm100BlockScaledPersistentDenseGemmKernel as Persistent,
    )
    from flashinfer.gemm.kernels.dense_blockscaled_gemm_sm100_splitk import (
        Sm100BlockScaledSplitKGemmKernel as SplitK,
    )
    from flashinfer.gemm.kernels.utils import _rank_mm_fp4_autotune_tactics

    ab_dtype = cutlass.Float4E2M1FN
    sf_dtype = cutlass.Float8E4M3FN if sf_vec_size == 16 else cutlass.Float8E8M0FNU
    c_dtype = cutlass.BFloat16 if out_dtype == "bfloat16" else cutlass.Float16
    base = []
    if n % 8 == 0:
        for tile in MMA_TILERS:
            for cluster in CLUSTERS:
                for swap_ab in (False, True):
                    kernel_m, kernel_n, c_major = (n, m, "m") if swap_ab else (m, n, "n")
                    if not Persistent.can_implement(ab_dtype, sf_dtype, sf_vec_size, c_dtype,
                                                    tile, cluster, kernel_m, kernel_n, k, 1,
                                                    "k", "k", c_major):
                        continue
                    for prefetch in (False, True):
                        if prefetch:
                            ratio = _get_approximate_cta_nums(kernel_m, kernel_n, tile,
                                                              cluster) / sm_count
                            if not (0.5 < ratio < 1.0 or k >= 8192):
                                continue
                        base.append((tile, cluster, swap_ab, prefetch))
    if m <= 32:
        base = [t for t in base if t[0] in LOW_M_TILERS and t[2]]
    tactics = [(*t, "sm100", None) for t in base]
    if k % DEEP_K_TILE == 0:
        tactics += [(*t, "sm100", DEEP_K_INST) for t in base if t[0][1] <= 32]
    if sf_vec_size == 16 and SplitK.supports_m(m):
        for slices in SplitK.SUPPORTED_SPLIT_K_SLICES:
            if SplitK.is_valid_tactic(m, k, ab_dtype, slices):
                tactics += [(tile, (1, 1), True, False, "sm100sk", slices)
                            for tile in SplitK.mma_tilers_for_m(m)]
    return _rank_mm_fp4_autotune_tactics(tactics, m, n, k, sm_count, len(tactics))
