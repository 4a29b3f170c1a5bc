"""flashinfer.mm_fp4 agrees with FlashInfer 0.7.4 itself: tactics, names, sources, meta rules."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")
torch = pytest.importorskip("torch")

from cached_client import InvalidTactic, UnknownFamily  # noqa: E402

from cached.families import flashinfer_mm_fp4 as fam  # noqa: E402
from cached.families import get  # noqa: E402
from cached.toolchain import compiler_stack  # noqa: E402


def flashinfer_valid_tactics(monkeypatch, m, n, k, use_nvfp4, sm_count=148):
    """FlashInfer's own runner's get_valid_tactics, with the SM count given, not queried."""
    from flashinfer.gemm import gemm_base

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(multi_processor_count=sm_count))
    monkeypatch.setattr(gemm_base, "get_device_sm_count", lambda device: sm_count)
    runner = gemm_base._cute_dsl_gemm_fp4_runner(10, 0, True, torch.bfloat16, use_nvfp4)
    a = torch.empty(m, k // 2, dtype=torch.uint8)
    b = torch.empty(k // 2, n, dtype=torch.uint8)
    out = torch.empty(m, n, dtype=torch.bfloat16)
    inputs = [a, b, None, None, None, None, out, None, None, None]
    return runner.get_valid_tactics(inputs, None)


@pytest.mark.parametrize("m,n,k,nvfp4", [(256, 1024, 7168, True), (8, 4096, 4096, True),
                                          (4096, 2688, 4096, False), (24, 2560, 16384, True)])
def test_enumeration_matches_flashinfer_autotuner(monkeypatch, m, n, k, nvfp4):
    ours = fam.enumerate_tactics(m, n, k, 16 if nvfp4 else 32, 148)
    theirs = flashinfer_valid_tactics(monkeypatch, m, n, k, nvfp4)
    assert ours[: fam.MAX_AUTOTUNE_TACTICS] == theirs
    assert len(set(ours)) == len(ours)


def test_seed_shape_has_about_120_tactics_and_all_validate():
    family = get("flashinfer.mm_fp4")
    requests = family.plan((256, 1024, 7168), "sm_100a", 148, {})
    assert len(requests) == 120
    for r in requests:
        assert family.canonical_request(r).params == dict(r.params)
    mxfp4 = family.plan((256, 1024, 7168), "sm_103a", 148, {"quant": "mxfp4",
                                                             "out_dtype": "float16"})
    assert {r.params["sf_vec_size"] for r in mxfp4} == {32}
    assert {r.params["out_dtype"] for r in mxfp4} == {"float16"}


def test_sources_are_flashinfers_key_files_and_export_uses_flashinfers_own_meta_rules():
    from cached_client import flashinfer_sources, identity
    from flashinfer.gemm.gemm_mm_fp4_cute_dsl import _blockscaled_gemm_cache_key_files
    from flashinfer.jit.cute_dsl_core import _get_cute_dsl_version, _hash_source_files

    from cached.store.export import flashinfer_functions

    files = _blockscaled_gemm_cache_key_files()
    root = compiler_stack.package_dir("flashinfer")
    assert tuple(str(Path(f).relative_to(root)) for f in files) == \
        flashinfer_sources.MM_FP4_KEY_FILES
    assert flashinfer_sources.MM_FP4_SOURCES[-1].endswith("_splitk.py")  # the sm100sk tactics
    assert get("flashinfer.mm_fp4").source_sha256() == identity.flashinfer_files_source(
        flashinfer_sources.MM_FP4_SOURCES)
    version, hasher = flashinfer_functions(root)  # loaded from FlashInfer's files
    assert version() == _get_cute_dsl_version()
    assert hasher(tuple(files)) == _hash_source_files(tuple(files))


def test_candidate_lists_are_flashinfers():
    from flashinfer.gemm.kernels.utils import (
        _CLUSTER_SHAPE_MN_CANDIDATES,
        _SM100_MMA_TILER_MN_CANDIDATES,
    )

    assert list(fam.MMA_TILERS) == _SM100_MMA_TILER_MN_CANDIDATES
    assert list(fam.CLUSTERS) == _CLUSTER_SHAPE_MN_CANDIDATES


@pytest.mark.parametrize("params, message", [
    ({"sf_vec_size": 16, "mma_tiler_mn": [256, 64], "cluster_shape_mn": [1, 1],
      "swap_ab": False}, "even cluster M"),
    ({"sf_vec_size": 16, "mma_tiler_mn": [96, 64], "cluster_shape_mn": [1, 1],
      "swap_ab": False}, "mma_tiler_mn"),
    ({"sf_vec_size": 16, "mma_tiler_mn": [128, 64], "cluster_shape_mn": [1, 1],
      "swap_ab": False, "use_tma_store": 8}, "deep-K"),
    ({"sf_vec_size": 16, "mma_tiler_mn": [128, 64], "cluster_shape_mn": [1, 1],
      "swap_ab": "yes"}, "swap_ab"),
    ({"sf_vec_size": 16, "mma_tiler_mn": [128, 8], "cluster_shape_mn": [1, 1],
      "swap_ab": True, "kernel_type": "sm100sk", "use_tma_store": 3}, "use_tma_store"),
    ({"sf_vec_size": 16, "bogus": 1}, "bogus"),
])
def test_impossible_tactics_are_rejected_before_compiling(params, message):
    with pytest.raises(InvalidTactic, match=message):
        get("flashinfer.mm_fp4").canonical_params(params, "sm_100a")


def test_unknown_family_and_wrong_arch():
    with pytest.raises(UnknownFamily, match="flashinfer.mm_fp4"):
        get("nope")
    with pytest.raises(InvalidTactic, match="sm_90a"):
        get("flashinfer.mm_fp4").check_arch("sm_90a")


def test_compiled_name_symbol_and_bits_match_flashinfers_compile(tmp_path):
    """A tactic built by the family equals FlashInfer's own JitSpecCuteDsl build of it."""
    import cutlass
    from flashinfer.gemm.gemm_mm_fp4_cute_dsl import (
        _blockscaled_kernel_disk_name,
        _make_blockscaled_gemm_compile_fn,
        _mm_fp4_cache_key,
    )
    from flashinfer.gemm.kernels.dense_blockscaled_gemm_sm100 import (
        Sm100BlockScaledPersistentDenseGemmKernel,
    )

    family = get("flashinfer.mm_fp4")
    request = family.plan((256, 1024, 7168), "sm_100a", 148, {"enable_pdl": False})[0]
    built = family.build(request, tmp_path)
    p = request.params
    tactic = (tuple(p["mma_tiler_mn"]), tuple(p["cluster_shape_mn"]), p["swap_ab"],
              p["use_prefetch"], "sm100", None)
    key = _mm_fp4_cache_key(16, tactic, False, torch.bfloat16, None, p["l2_policy"])
    name = _blockscaled_kernel_disk_name(key, 1, request.max_active_clusters)
    assert built.kernel_name == name and built.symbol == f"mm_fp4_{name}"
    gemm = Sm100BlockScaledPersistentDenseGemmKernel(
        16, tactic[0], tactic[1], False, False, None,
        b_l2_evict_first=p["l2_policy"] == "b_ef", a_l2_evict_first=p["l2_policy"] == "a_ef",
        a_l2_evict_last=p["l2_policy"] == "ab_el", b_l2_evict_last=p["l2_policy"] == "ab_el")
    theirs = _make_blockscaled_gemm_compile_fn(
        gemm, ab_cutlass_dtype=cutlass.Uint8, sf_dtype=cutlass.Float8E4M3FN,
        c_cutlass_dtype=cutlass.BFloat16, ab_assumed_align=32, swap_ab=p["swap_ab"],
        sf_m=2, sf_n=8, sf_k=112, batch_size=1,
        max_active_clusters=request.max_active_clusters)()
    theirs.export_to_c(str(tmp_path / "theirs.o"), function_name=built.symbol)
    assert (tmp_path / "theirs.o").read_bytes() == built.object_path.read_bytes()
