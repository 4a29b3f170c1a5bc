"""The BF16 family cached.hopper_bf16 (issue 36): the hopper_fp8 machinery on bf16 operands
(64-element K tile, wgmma k16, no scales, bf16 / fp32 output). Its tactics and classes, its
plan options, real sm_90a compiles through a real daemon with their SASS read, the client's
plan (one class for every M) and launcher checks, and the policy. Correctness, batch
invariance and speed on a GPU: bench/gpu/hopper_bf16.py."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from cached_client.errors import InvalidTactic
from cached_client.gemm import plan as gemm_plan
from cached_client.gemm import policy
from cached_client.keys import KernelRequest
from conftest import DaemonProcess
from test_hopper_fp8_schemes import wgmma_waits

from cached.families import get as family
from cached.families.hopper_fp8 import space as SPACE
from cached.families.hopper_fp8 import tactic as T
from cached.families.hopper_fp8.tactic import HopperFp8Tactic, tactic_from_params

BF16 = "cached.hopper_bf16"
FP8 = "cached.hopper_fp8"
#: the issue's shapes: Llama-3.1-8B, Qwen2.5-7B, and the two lm_heads (N x K)
SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (4608, 3584),
          (3584, 3584), (37888, 3584), (3584, 18944), (128256, 4096), (152064, 3584))


def bf16(**kw) -> HopperFp8Tactic:
    return HopperFp8Tactic(ab_dtype="bf16", scales="none", **kw).normalized()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = DaemonProcess(tmp_path_factory.mktemp("bf16"), workers=2, job_timeout=600)
    yield d
    d.stop()


def test_bf16_tactics_take_a_64_element_k_tile_and_classes_of_their_own():
    fam = family(BF16)
    assert fam.reduction_classes() == T.BF16_REDUCTION_CLASSES == tuple(
        f"k64.acc1.s{s}.fixed" for s in T.SPLIT_CHOICES)
    assert not set(T.BF16_REDUCTION_CLASSES) & set(T.REDUCTION_CLASSES)
    for out in ("bfloat16", "float32"):
        space = SPACE.tactic_space(out, "bf16", scales="none")
        assert len(space) == len({t.name for t in space}) == 910
        assert {t.splits for t in space} == set(T.SPLIT_CHOICES)
        for t in space:
            assert (t.ab_dtype, t.scales, t.accum, t.out_dtype) == ("bf16", "none", "fast", out)
            assert (t.tile_k, t.wgmma_k, t.family) == (64, 16, BF16)
            p = json.loads(json.dumps(t.to_params()))
            assert tactic_from_params(p) == t and fam.canonical_params(p, "sm_90a") == p
            assert fam.reduction_class(p) == t.reduction_class == f"k64.acc1.s{t.splits}.fixed"
            assert "k_tile=64,wgmma_k=16" in t.reduction_order and "scale" not in t.name
            # 128 bytes of an operand row per stage, as FP8: the same shared memory
            fp8 = dataclasses.replace(t, ab_dtype="e4m3", scales="tensor", out_dtype="bfloat16")
            if out == "bfloat16":
                assert T.smem_bytes(t) == T.smem_bytes(fp8)
    # the tiles bf16 cannot take are not planned (the compiler aborts on 64 x 40 / 64 x 56)
    assert {t.tile_n for t in SPACE.tactic_space(scales="none", ab_dtype="bf16")
            if not t.swap_ab and t.wg_n == 1 and t.tile_m == 64} >= {48}
    assert not [t for t in SPACE.tactic_space(ab_dtype="bf16", scales="none")
                if t.tile_n in (40, 56) and not t.swap_ab and t.wg_n == 1]
    # the FP8 space and its classes are what they were
    assert len(SPACE.tactic_space()) == 922 and len(T.REDUCTION_CLASSES) == 21


@pytest.mark.parametrize("params, words", [
    ({"ab_dtype": "bf16"}, "bf16 operands take scales='none'"),
    ({"ab_dtype": "bf16", "scales": "none", "accum": "exact"}, "accum='fast' only"),
    ({"scales": "none"}, "is the bf16 operands' scheme"),
    ({"out_dtype": "float32"}, "out_dtype must be one of ('bfloat16', 'float16')"),
    ({"ab_dtype": "bf16", "scales": "none", "out_dtype": "float64"}, "out_dtype must be one"),
    ({"ab_dtype": "bf16", "scales": "none", "tile_m": 64, "tile_n": 40},
     "bf16 narrow decode tiles take tile_n in"),
])
def test_bad_bf16_params_are_refused_by_both_families(params, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        tactic_from_params(params)
    for name in (BF16, FP8):
        with pytest.raises(InvalidTactic):
            family(name).canonical_params(params, "sm_90a")


def test_each_family_serves_its_own_operand_type_only():
    b, f = bf16(tile_m=128, tile_n=128).to_params(), HopperFp8Tactic().normalized().to_params()
    with pytest.raises(InvalidTactic, match="cached.hopper_fp8 tactics take ab_dtype in"):
        family(FP8).canonical_params(b, "sm_90a")
    with pytest.raises(InvalidTactic, match="family cached.hopper_fp8 serves it"):
        family(BF16).reduction_class(f)
    assert family(BF16).canonical_params(b, "sm_90a") == b
    assert family(FP8).canonical_params(f, "sm_90a") == f
    # cached tune: each family's own schemes (bf16's takes no scale option), each family's
    # bound for its own classes only (tests/test_tune.py: the bf16 scheme end to end)
    assert family(BF16).tune_schemes() == {"bf16": {}}
    assert "tensor-fast" in family(FP8).tune_schemes()
    assert not set(family(BF16).tune_schemes()) & set(family(FP8).tune_schemes())
    bcls = family(BF16).reduction_class(b)
    assert family(BF16).tune_error_bound(bcls, 4096, 1.66e-3) < 4e-3
    with pytest.raises(ValueError, match="unknown cached.hopper_fp8 reduction class"):
        family(FP8).tune_error_bound(bcls, 4096, 1.66e-3)


def test_batch_invariant_plan_is_one_class_for_every_m():
    fam = family(BF16)
    for n, k in SHAPES + ((1024, 28672), (2112, 7168)):
        s = SPACE.choose_split(n, k, 132, "bf16")
        classes = set()
        for m in (1, 2, 16, 64, 100, 1024, 8192):
            reqs = fam.plan((m, n, k), "sm_90a", 132, {"batch_invariant": True})
            classes |= {fam.reduction_class(r.params) for r in reqs}
            assert {r.params["ab_dtype"] for r in reqs} == {"bf16"}
        assert classes == {f"k64.acc1.s{s}.fixed"}, (n, k, classes)
    # split classes where the K is long and N narrow (K counted in 128-byte tiles)
    assert SPACE.choose_split(1024, 28672, 132, "bf16") == 4
    assert SPACE.choose_split(2112, 7168, 132, "bf16") == 2
    # reduction_class picks one class; no option plans every class
    only = fam.plan((16, 4096, 4096), "sm_90a", 132, {"reduction_class": "k64.acc1.s2.fixed"})
    assert {fam.reduction_class(r.params) for r in only} == {"k64.acc1.s2.fixed"}
    every = fam.plan((16, 4096, 4096), "sm_90a", 132, {"out_dtype": "float32"})
    assert {fam.reduction_class(r.params) for r in every} == set(T.BF16_REDUCTION_CLASSES)
    assert {r.params["out_dtype"] for r in every} == {"float32"}


@pytest.mark.parametrize("options, words", [
    ({"scales": "tensor"}, "unknown: scales"),
    ({"accumulation": "exact"}, "unknown: accumulation"),
    ({"out_dtype": "float64"}, "out_dtype='float64' is not one of"),
    ({"ab_dtype": "e4m3"}, "ab_dtype='e4m3' is not one of: 'bf16'"),
    ({"batch_invariant": "yes"}, "batch_invariant must be true or false"),
    ({"reduction_class": "k128.acc1.s1.fixed"}, "unknown cached.hopper_bf16 reduction class"),
    ({"reduction_class": 1}, "reduction_class must be a string"),
])
def test_bad_plan_options_are_refused(options, words):
    with pytest.raises(InvalidTactic, match=words):
        family(BF16).plan((16, 4096, 4096), "sm_90a", 132, options)


def test_bf16_through_the_daemon_hello_plan_and_bad_options(daemon):
    """hello lists the bf16 classes beside FP8's; plan_gemm(ab_dtype="bf16") gets one class
    for all 14 M buckets up to 8192, in the asked output type; bad options and bad requests
    get typed errors, and the daemon keeps serving."""
    c = daemon.client(timeout=120)
    info = c.hello().reduction_classes
    assert info[BF16] == {"classes": list(T.BF16_REDUCTION_CLASSES), "m_independent": True}
    assert info[FP8]["classes"] == list(T.REDUCTION_CLASSES)
    for (n, k), out in (((4096, 4096), "bfloat16"), ((128256, 4096), "bfloat16"),
                        ((4096, 14336), "float32")):
        plan = gemm_plan.plan_gemm(c, n, k, arch="sm_90a", ab_dtype="bf16", out_dtype=out,
                                   sm_count=132, prefetch=False)
        assert plan.family == BF16 and len(plan.choice.buckets) == 14
        cls = f"k64.acc1.s{SPACE.choose_split(n, k, 132, 'bf16')}.fixed"
        assert plan.choice.reduction_class == cls
        assert {b.reduction_class for b in plan.choice.buckets} == {cls}
        assert {(b.request.family, b.request.params["ab_dtype"], b.request.params["out_dtype"])
                for b in plan.choice.buckets} == {(BF16, "bf16", out)}
        assert plan.key.scales == "none" and "k64.acc1" in plan.describe()
    for opts, words in (({"scales": "token"}, "unknown: scales"),
                        ({"out_dtype": "half"}, "out_dtype='half'"),
                        ({"reduction_class": "k128.acc1.s1.fixed"}, "reduction class")):
        with pytest.raises(InvalidTactic, match=words):
            c.plan_reply(BF16, (16, 4096, 4096), "sm_90a", 132, opts)
    bad = KernelRequest(family=FP8, params=bf16().to_params(), arch="sm_90a", sm_count=132,
                        max_active_clusters=132)
    with pytest.raises(InvalidTactic, match="family cached.hopper_bf16 serves it"):
        c.get(bad, timeout=60)
    # the client refuses what no family serves, before asking
    for kw, exc, words in (
            ({"scales": "tensor"}, ValueError, "no scales"),
            ({"accumulation": "exact"}, ValueError, "no scales"),
            ({"out_dtype": "float64"}, ValueError, "out_dtype must be one of"),
            ({"arch": "sm_100a"}, gemm_plan.PlanUnavailable, "no batch-invariant bf16"),
            ({"n": 4100}, ValueError, "multiples of 16")):
        args = {"arch": "sm_90a", "prefetch": False, **kw}
        n = args.pop("n", 4096)
        with pytest.raises(exc, match=words):
            gemm_plan.plan_gemm(c, n, 4096, ab_dtype="bf16", **args)
    # still serving, FP8 unchanged
    again = gemm_plan.plan_gemm(c, 4096, 4096, arch="sm_90a", sm_count=132, max_m=16,
                                prefetch=False)
    assert again.family == FP8 and again.choice.reduction_class == "k128.acc1.s1.fixed"
    sel = policy.select("linear", "bf16", "sm_90a", True, client=c)
    assert (sel.kernel, sel.tactics, sel.warnings) == (BF16, "set", [])


def _variants() -> list[HopperFp8Tactic]:
    """One bf16 kernel per code path: the TMA epilogue (128 x 128; 256 x 192, the most
    accumulator registers; a 2x1 cluster), swap_ab with S = 1 and a bf16 output (ptxas
    serialized its wgmma while the conversion read the accumulator: kernel.epilogue_direct),
    a swap_ab 'cta' split, wg_n = 2, the narrow 64 x 48, ping-pong, a serial split, and the
    float32 output on the TMA, register, whole-tile and split-workspace epilogues."""
    return [
        bf16(tile_m=128, tile_n=128),
        bf16(tile_m=256, tile_n=192),
        bf16(tile_m=128, tile_n=256, cluster_m=2),
        bf16(tile_m=8, tile_n=64, swap_ab=True),
        bf16(tile_m=16, tile_n=128, swap_ab=True, splits=4, split_mode="cta"),
        bf16(tile_m=64, tile_n=80, wg_n=2),
        bf16(tile_m=64, tile_n=48),
        bf16(tile_m=64, tile_n=128, pingpong=True),
        bf16(tile_m=128, tile_n=128, splits=2),
        bf16(tile_m=128, tile_n=128, out_dtype="float32"),
        bf16(tile_m=8, tile_n=64, swap_ab=True, out_dtype="float32"),
        bf16(tile_m=64, tile_n=128, wg_n=2, out_dtype="float32"),
        bf16(tile_m=64, tile_n=128, splits=2, split_mode="cta", out_dtype="float32"),
    ]


def test_bf16_tactics_compile_for_sm90a_through_the_daemon(daemon):
    """Each variant compiled by the daemon's workers and served: in its SASS the bf16
    wgmma (HGMMA ... F32.BF16), no local-memory spills, and no wgmma serialized by ptxas
    (at most one full wait per K tile's four wgmma)."""
    variants = _variants()
    spaces = {t.name for od in ("bfloat16", "float32")
              for t in SPACE.tactic_space(od, "bf16", scales="none")}
    assert [t.name for t in variants if t.name not in spaces] == []
    c = daemon.client(timeout=120)
    requests = [KernelRequest(family=BF16, params=t.to_params(), arch="sm_90a", sm_count=132,
                              max_active_clusters=132 // t.cluster_size) for t in variants]
    c.prefetch(requests)
    for t, r in zip(variants, requests, strict=True):
        art = c.get(r, timeout=900)
        path = art.library_path or art.object_path
        assert path and os.path.getsize(path) > 1000
        got = wgmma_waits(path)
        sass = open(path, "rb").read()
        assert b"cached_hopper_bf16_" in sass, t.name
        assert got["GMMA"] >= 4 and got["spills"] == 0, (t.name, got)
        assert 4 * got["wait0"] <= got["GMMA"], (t.name, got)  # serialized: one per wgmma
        assert got["bf16_wgmma"] >= 4, (t.name, got)
    listed = {e["kernel_name"] for e in c.list()}
    assert {f"{t.name}_mac{132 // t.cluster_size}" for t in variants} <= listed


def test_launcher_checks_bf16_operands_before_launch():
    torch = pytest.importorskip("torch")
    from cached_client.gemm.hopper_fp8 import gemm

    calls = []

    def fn(*args):
        calls.append(args)

    p = bf16(tile_m=128, tile_n=128).to_params()
    a, b = torch.empty(4, 64, dtype=torch.bfloat16), torch.empty(32, 64, dtype=torch.bfloat16)
    f8 = torch.float8_e4m3fn
    one = torch.ones(1)
    cases = [
        ((a, b, one, None, torch.bfloat16), p, TypeError, "reads no scales; pass None"),
        ((a.to(f8), b.to(f8), None, None, torch.bfloat16), p, ValueError,
         "both be bfloat16"),
        ((a, b.half(), None, None, torch.bfloat16), p, ValueError, "both be bfloat16"),
        ((a, b, None, None, torch.float64), p, ValueError, "out_dtype must be one of"),
        ((a, torch.empty(32, 48, dtype=torch.bfloat16), None, None, torch.bfloat16), p,
         ValueError, "K differs"),
        ((a, torch.empty(40, 64, dtype=torch.bfloat16), None, None, torch.bfloat16), p,
         ValueError, "multiples of 16"),
        ((a, b, None, None, torch.float32), HopperFp8Tactic().normalized().to_params(),
         TypeError, "a_scale must be a float32 CUDA tensor"),
        ((a.to(f8), b.to(f8), one, one, torch.float32),
         HopperFp8Tactic().normalized().to_params(), ValueError, "out_dtype must be one of"),
    ]
    for args, params, exc, words in cases:
        with pytest.raises(exc) as e:
            gemm(fn, *args, params=params)
        assert words in str(e.value), (words, str(e.value))
    # valid bf16 operands (either output type) stop at the CPU tensors
    for out in (torch.bfloat16, torch.float32):
        with pytest.raises(ValueError, match="CUDA"):
            gemm(fn, a, b, None, None, out, params=dict(p, out_dtype=str(out)[6:]))
    assert calls == []


def test_loaded_bf16_plan_is_called_with_a_and_b(daemon):
    torch = pytest.importorskip("torch")
    c = daemon.client(timeout=120)
    plan = gemm_plan.plan_gemm(c, 4096, 4096, arch="sm_90a", ab_dtype="bf16",
                               out_dtype="float32", sm_count=132, max_m=512, prefetch=False)
    calls = []
    f = gemm_plan.HopperBf16Gemm(plan, [calls.append] * len(plan.choice.buckets), "cpu")
    assert f.out_dtype == torch.float32 and f.workspace.dtype == torch.float32
    assert [f.bucket(m) for m in (1, 2, 3, 512, 10_000)] == [0, 1, 2, 9, 9]
    assert f.tactic(300)["ab_dtype"] == "bf16"
    a, b = torch.empty(3, 4096, dtype=torch.bfloat16), torch.empty(4096, 4096,
                                                                    dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA"):
        f(a, b)
    with pytest.raises(TypeError):
        f(a, b, None, None)  # no scales: f(a, b, out=None)
    assert calls == []


def test_policy_bf16_rows():
    sel = policy.select("linear", "bf16", "sm_90a", True)
    assert sel.kernel == policy.VLLM_BF16_BI and sel.tactics == "one"
    assert any("no daemon to ask for cached.hopper_bf16" in w for w in sel.warnings)
    other = policy.select("linear", "bf16", "sm_100a", True, "triton")
    assert other.kernel == policy.VLLM_BF16_BI and "sm_100a" in other.reason
    assert any("overrides backend='triton'" in w for w in other.warnings)
    assert policy.select("linear", "bf16", "sm_90a", False).kernel == "torch"
    with pytest.raises(ValueError, match="bmm is served for fp8 only"):
        policy.select("bmm", "bf16", "sm_90a", True)
