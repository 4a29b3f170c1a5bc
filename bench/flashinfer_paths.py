"""FlashInfer's own ways of compiling the same tactics, driven as FlashInfer drives them.

Run as a script in a fresh process (imports counted): ``serial`` compiles every tactic
through ``build_and_load_cute_dsl_kernel`` with its disk cache, ``pool`` through
``_run_mm_fp4_precompile_pool``, ``try_load`` times ``JitSpecCuteDsl.try_load`` hits (the
object load alone), ``disk_hit`` times ``build_and_load_cute_dsl_kernel`` hits: what a
FlashInfer caller pays for a kernel in its disk cache (the sources hashed, the DSL version
read once per process, the object loaded); a miss there is an error, never a compile.

The only adaptation for a machine without a GPU: the pool worker calls
``torch.cuda.set_device``, so the pool is given :func:`precompile_worker`, which makes
that call a no-op and then runs FlashInfer's worker unchanged.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")
STARTED = time.perf_counter()


def precompile_worker(payload):
    import torch

    torch.cuda.set_device = lambda index: None
    from flashinfer.gemm.gemm_mm_fp4_cute_dsl import _mm_fp4_precompile_worker

    return _mm_fp4_precompile_worker(payload)


def _spec_args(wire: dict):
    import cutlass
    import torch
    from flashinfer.cute_dsl.utils import torch_to_cutlass_dtype
    from flashinfer.gemm.gemm_mm_fp4_cute_dsl import (
        _blockscaled_kernel_disk_name,
        _make_blockscaled_gemm_compile_fn,
        _mm_fp4_cache_key,
    )

    from cached.families.flashinfer_mm_fp4 import _make_kernel

    p = wire["params"]
    tile, cluster = tuple(p["mma_tiler_mn"]), tuple(p["cluster_shape_mn"])
    tactic = (tile, cluster, p["swap_ab"], p["use_prefetch"], p["kernel_type"],
              p["use_tma_store"])
    out_dtype = getattr(torch, p["out_dtype"])
    key = _mm_fp4_cache_key(p["sf_vec_size"], tactic, p["enable_pdl"], out_dtype,
                            p["per_token_alpha"], p["l2_policy"])
    mac = wire["max_active_clusters"]
    name = _blockscaled_kernel_disk_name(key, 1, mac)

    def compile_fn():
        return _make_blockscaled_gemm_compile_fn(
            _make_kernel(p, tile, cluster), ab_cutlass_dtype=cutlass.Uint8,
            sf_dtype=cutlass.Float8E4M3FN, c_cutlass_dtype=torch_to_cutlass_dtype(out_dtype),
            ab_assumed_align=32, swap_ab=p["swap_ab"], sf_m=2, sf_n=8, sf_k=112, batch_size=1,
            max_active_clusters=mac, per_token_alpha=p["per_token_alpha"])()

    return key, name, mac, compile_fn


def serial(wires: list[dict]) -> dict:
    from flashinfer.gemm.gemm_mm_fp4_cute_dsl import _blockscaled_gemm_cache_key_files
    from flashinfer.jit.cute_dsl_core import build_and_load_cute_dsl_kernel

    for wire in wires:
        _, name, _, compile_fn = _spec_args(wire)
        build_and_load_cute_dsl_kernel("mm_fp4", name, compile_fn,
                                       extra_key_files=_blockscaled_gemm_cache_key_files())
    return {"kernels": len(wires)}


def pool(wires: list[dict]) -> dict:
    from flashinfer.gemm import gemm_mm_fp4_cute_dsl as fp4

    payloads = []
    for wire in wires:
        key, name, mac, _ = _spec_args(wire)
        payloads.append({"cache_key": key, "kernel_name": name, "max_active_clusters": mac,
                         "sf_m": 2, "sf_n": 8, "sf_k": 112, "batch_size": 1,
                         "key_files": fp4._blockscaled_gemm_cache_key_files(),
                         "device_index": 0})
    fp4._mm_fp4_precompile_worker = precompile_worker
    workers = fp4._get_mm_fp4_cute_dsl_compile_workers()
    fp4._run_mm_fp4_precompile_pool(payloads)
    return {"kernels": len(wires), "workers": workers}


def try_load(wires: list[dict]) -> dict:
    from flashinfer.gemm.gemm_mm_fp4_cute_dsl import _blockscaled_gemm_cache_key_files
    from flashinfer.jit.cute_dsl_core import JitSpecCuteDsl, _hash_source_files

    source = _hash_source_files(tuple(_blockscaled_gemm_cache_key_files()))
    latencies = []
    for wire in wires:
        _, name, _, compile_fn = _spec_args(wire)
        spec = JitSpecCuteDsl("mm_fp4", name, compile_fn, source)
        t = time.perf_counter()
        fn = spec.try_load()
        latencies.append(time.perf_counter() - t)
        assert fn is not None, f"{name} is not in FlashInfer's disk cache"
    return {"latencies_s": latencies}


def disk_hit(wires: list[dict]) -> dict:
    from flashinfer.gemm.gemm_mm_fp4_cute_dsl import _blockscaled_gemm_cache_key_files
    from flashinfer.jit.cute_dsl_core import build_and_load_cute_dsl_kernel

    key_files = _blockscaled_gemm_cache_key_files()
    latencies = []
    for wire in wires:
        _, name, _, _ = _spec_args(wire)

        def miss(name: str = name) -> None:
            raise AssertionError(f"{name} is not in FlashInfer's disk cache")

        t = time.perf_counter()
        fn = build_and_load_cute_dsl_kernel("mm_fp4", name, miss, extra_key_files=key_files)
        latencies.append(time.perf_counter() - t)
        assert fn is not None
    return {"latencies_s": latencies}


if __name__ == "__main__":
    mode, wires = sys.argv[1], json.load(open(sys.argv[2]))
    result = {"serial": serial, "pool": pool, "try_load": try_load,
              "disk_hit": disk_hit}[mode](wires)
    result["wall_s"] = time.perf_counter() - STARTED
    print(json.dumps(result))
