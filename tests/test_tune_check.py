"""bench/gpu/tune_check.py and bench/gpu/vllm_cutlass.py on the CPU: the summary of old and
new JSONs (a point's ratio against the faster competitor, which one won, vLLM's errors and
why it was left out; older JSONs as per-tensor fast against torch, their unrecorded checks
"n/a"), the block128 activation scales as the launcher and vLLM take them, and vLLM's
``cutlass_scaled_mm`` called as vLLM's own Python calls it (the op replaced by an
emulation of its documented contract: C = (scale_a * a) @ (scale_b * b), b (K, N)
column-major, block scales broadcast per 128). The op itself, and every timing, need the
GPU: bench/gpu/run_tune.sh gpu with a VLLM=1 build.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from types import SimpleNamespace

import pytest
from conftest import ROOT

torch = pytest.importorskip("torch")
GPU = ROOT / "bench" / "gpu"


@pytest.fixture
def tc(monkeypatch):
    monkeypatch.syspath_prepend(str(GPU))
    spec = importlib.util.spec_from_file_location("tune_check", GPU / "tune_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def vc(monkeypatch):
    monkeypatch.syspath_prepend(str(GPU))
    import vllm_cutlass

    return vllm_cutlass


def _old(name: str) -> dict:
    return json.loads((ROOT / "bench" / "results" / name).read_text())


def test_old_jsons_summarize_as_per_tensor_fast_against_torch(tc, capsys):
    """The first runs' JSON (no scheme, competitor, bound or graph check recorded) and a
    later one (all of them): one row each, every point against torch's time."""
    first = _old("h200_tune_run2_check.json")
    [row] = tc.summary_rows([first])
    assert row["name"] == "tensor-fast vs torch._scaled_mm fast"
    assert row["points"] == 126 and row["won"] == {"torch": 126}
    assert row["within"] == "n/a" and row["eager"] == "n/a"
    assert row["from_winners"] == (126, 126) and row["rows_differ"] == 0
    want = [p["fast_us"] / p["after_us"] for r in first["shapes"] for p in r["perf"].values()]
    assert row["after"] == want
    assert round(tc._gm(row["after"]), 3) == 1.066  # docs/benchmarks.md's figure
    assert row["vllm_worst_rel"] is None and row["vllm_left_out"] == []
    later = _old("h100_tune_widened_2026-12-07_check.json")
    [row] = tc.summary_rows([later])
    assert row["name"] == "bf16 vs torch.mm" and row["within"] is True and row["eager"] is True
    tc.summarize([str(ROOT / "bench" / "results" / "h200_tune_run1_check.json")])
    out = capsys.readouterr().out
    assert "| tensor-fast vs torch._scaled_mm fast |" in out and "torch 126" in out


def _point(tc, before, after, **competitors):
    med = {"before": before, "after": after, **competitors}
    p = {f"{k}_us": v for k, v in med.items()}
    p |= {"before_tactic": "t0", "after_tactic": "t1", "rounds_us": {}}
    if "vllm" in competitors:
        p["best"], p["best_us"] = tc.best_of(med)
    return p


def _shape(n, k, scheme, competitor, perf, vllm=None):
    r = {"n": n, "k": k, "scheme": scheme, "competitor": competitor, "class": "c",
         "correct": {"1": {"rel": 2e-3, "bound": 5e-3, "within": True, "nan_left": False}},
         "seeds_rows_differing": {"1": 0, "7": 0}, "eager_equals_graph": {"1": True},
         "after_sources": ["autotune"] * len(perf), "perf": perf}
    if vllm is not None:
        r["vllm"] = vllm
    return r


def test_new_jsons_take_the_faster_competitor_and_say_which(tc, capsys, tmp_path):
    both = "faster of torch._scaled_mm fast and vLLM cutlass_scaled_mm"
    vgood = {"label": "vLLM cutlass_scaled_mm",
             "correct": {"1": {"rel": 3.8e-3, "bound": 6e-3, "within": True}}}
    run = {"device": "NVIDIA H200", "shapes": [
        _shape(4096, 4096, "tensor-fast", both, {
            "1": _point(tc, 10.0, 8.0, fast=12.0, vllm=9.0),
            "2": _point(tc, 10.0, 8.0, fast=7.0, vllm=9.0)}, vgood),
        # vLLM wrong here: left out of the timing, torch alone (its own row)
        _shape(1152, 16384, "tensor-fast", "torch._scaled_mm fast",
               {"1": _point(tc, 10.0, 10.0, fast=9.0)},
               {"label": "vLLM cutlass_scaled_mm", "left_out": "wrong results: rel err",
                "correct": {"1": {"rel": 0.5, "bound": 6e-3, "within": False}}}),
        _shape(2112, 7168, "block128", "vLLM cutlass_scaled_mm blockwise",
               {"1": _point(tc, 20.0, 16.0, vllm=18.0)},
               {"label": "vLLM cutlass_scaled_mm blockwise",
                "correct": {"1": {"rel": 1.67e-3, "bound": 2.1e-3, "within": True}}})]}
    rows = {r["name"]: r for r in tc.summary_rows([run])}
    r = rows[f"tensor-fast vs {both}"]
    assert r["after"] == [9.0 / 8.0, 7.0 / 8.0] and r["before"] == [0.9, 0.7]
    assert r["won"] == {"vllm": 1, "torch": 1} and r["vllm_worst_rel"] == 3.8e-3
    r = rows["tensor-fast vs torch._scaled_mm fast"]
    assert r["after"] == [0.9] and r["won"] == {"torch": 1}
    assert r["vllm_left_out"] == ["1152x16384: wrong results: rel err"]
    r = rows["block128 vs vLLM cutlass_scaled_mm blockwise"]
    assert r["after"] == [18.0 / 16.0] and r["won"] == {"vllm": 1} and r["points"] == 1
    assert tc.best_of({"before": 1.0, "after": 1.0, "fast": 3.0, "vllm": 2.0}) == ("vllm", 2.0)
    assert tc.best_of({"before": 1.0, "after": 1.0, "fast": 2.0}) == ("torch", 2.0)
    assert tc.competitor_us({"fast_us": 5.0}) == 5.0 and tc.winner({"fast_us": 5.0}) == "torch"
    f = tmp_path / "tune_check_1.json"
    f.write_text(json.dumps(run))
    tc.summarize([str(f)])
    out = capsys.readouterr().out
    assert "torch 1, vllm 1" in out and "left out 1152x16384" in out
    # a run's own tables, as tune_check prints them last
    for s in run["shapes"]:
        s |= {"plan_ms": 1.0}
        for e in s["correct"].values():
            e.setdefault("bound", 1.0)
    tc.report({**run, "sm_count": 132, "torch": "x", "date": "d"})
    out = capsys.readouterr().out
    assert "vllm (torch 12.0, vllm 9.0 us)" in out and "vllm at 1" in out
    assert "vLLM's CUTLASS against the same reference" in out


def test_block128_activation_scales_go_in_column_major_per_m(tc):
    """rows_of: the first m rows' block scales as a compact column-major (m, K/128) tensor,
    which the launcher takes (a slice of the M = 8192 scales it refuses) and vLLM's
    QuantFP8(column_major_scales=True) writes; per-token a slice; per-tensor itself."""
    from cached_client.gemm.hopper_fp8 import check_gemm_args

    import cached.tools.tune_cuda as TC

    g = torch.Generator().manual_seed(1)
    n, k, m = 256, 512, 77
    sa_all, sb = TC.operands("block128", 8192, n, k, g, "cpu")
    sa = tc.rows_of(sa_all, m, "block128")
    assert sa.shape == (m, 4) and sa.stride() == (1, m) and torch.equal(sa, sa_all[:m])
    a = torch.zeros(m, k).to(torch.float8_e4m3fn)
    b = torch.zeros(n, k).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="must be a CUDA tensor"):  # the scales passed
        check_gemm_args(a, b, sa, sb, torch.bfloat16, scales="block128")
    with pytest.raises(ValueError, match="a_scale must have strides"):
        check_gemm_args(a, b, sa_all[:m], sb, torch.bfloat16, scales="block128")
    assert tc.rows_of(sa_all, 1, "block128").shape == (1, 4)
    tok, _ = TC.operands("token", 8192, n, k, g, "cpu")
    assert torch.equal(tc.rows_of(tok, m, "token"), tok[:m])
    one, _ = TC.operands("tensor", 8192, n, k, g, "cpu")
    assert tc.rows_of(one, m, "tensor") is one


def _emulated_op(calls):
    """vLLM's cutlass_scaled_mm by its contract (vllm/_custom_ops.py::cutlass_scaled_mm),
    in float64, after checking the layouts vLLM's Python hands it."""
    def op(out, a, b, sa, sb, bias):
        m, k = a.shape
        kb, n = b.shape
        assert kb == k and b.stride() == (1, k), "b: (K, N) column-major, the weight's .t()"
        assert a.stride() == (k, 1) and bias is None and out.shape == (m, n)
        fa, fb = a.double(), b.double()
        if sa.numel() == 1 and sb.numel() == 1:
            c = (fa @ fb) * float(sa) * float(sb)
        elif sa.dim() == 2 and sa.shape == (m, k // 128):
            assert m == 1 or sa.stride() == (1, m), "block a_scales: column-major (1, M)"
            assert sb.shape == (k // 128, -(-n // 128)) and sb.stride() == (1, k // 128)
            fa = fa * sa.double().repeat_interleave(128, 1)
            fb = fb * sb.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:, :n]
            c = fa @ fb
        else:
            assert sa.shape == (m, 1) and sb.shape == (n, 1), "per-token: (M, 1) and (N, 1)"
            assert sa.is_contiguous() and sb.is_contiguous()
            c = (fa @ fb) * sa.double() * sb.double().reshape(1, n)
        calls.append((a.shape, b.stride(), tuple(sa.shape), tuple(sb.shape)))
        out.copy_(c)
    return op


@pytest.mark.parametrize("scales", ["tensor", "token", "block128"])
def test_vllm_is_called_as_vllm_calls_it(vc, monkeypatch, scales):
    """The daemon's operands (a (M, K), b (N, K), tune_cuda's scales) through
    vllm_cutlass.scaled_mm reach the op in vLLM's layouts and give tune_cuda's reference
    (N = 200: a partial weight block)."""
    import cached.tools.tune_cuda as TC

    calls = []
    fake = SimpleNamespace(ops=SimpleNamespace(_C=SimpleNamespace(
        cutlass_scaled_mm=_emulated_op(calls))))
    monkeypatch.setattr(vc, "torch", fake)
    g = torch.Generator().manual_seed(5)
    for m in (1, 33):
        n, k = 208, 384
        a, b = TC.data(scales, m, k, g, "cpu"), TC.data(scales, n, k, g, "cpu")
        sa, sb = TC.operands(scales, m, n, k, g, "cpu")
        out = torch.full((m, n), float("nan"))
        assert vc.scaled_mm(a, b, sa, sb, out, scales) is out
        assert TC.rel_err(out, TC.reference(a, b, sa, sb, scales)) < 1e-6
    assert len(calls) == 2
    assert vc.covers(scales, "exact" if scales == "block128" else "fast", 208, 384)
    with pytest.raises(ValueError, match="per-tensor, per-token or block128"):
        vc.scaled_mm(a, b, sa, sb, out, "none")


def test_vllm_covers_its_schemes_only_and_load_refuses_other_bytes(vc, tc, monkeypatch,
                                                                     tmp_path):
    """vllm_cutlass.load runs native code only from a sealed copy whose bytes hash to the
    digest given: other bytes, or no digest, are refused with the reason and nothing is
    loaded; what torch's load_library opens is that copy, so a file swapped after the check
    (here: while it loads) is never what runs."""
    import hashlib

    assert not vc.covers("tensor", "exact", 4096, 4096)  # its kernels accumulate fast
    assert not vc.covers("token", "fast", 4104, 4096)  # N % 16: vLLM's Triton fallback
    assert vc.covers("block128", "exact", 2112, 7168)
    assert vc.label("block128", "exact") == "vLLM cutlass_scaled_mm blockwise"
    assert vc.load(None, None) == "no --vllm-so given"
    good = b"\x7fELF the build's vLLM _C"
    sha = hashlib.sha256(good).hexdigest()
    assert "no such file" in vc.load(str(tmp_path / "nope.so"), sha)
    so = tmp_path / "lib.so"
    so.write_bytes(good)
    loaded: list[tuple[str, bytes]] = []

    def load_library(path: str) -> None:
        so.write_bytes(b"forged")  # swapped on disk after the check
        with open(path, "rb") as f:
            loaded.append((path, f.read()))

    empty = SimpleNamespace(ops=SimpleNamespace(load_library=load_library,
                                                _C=SimpleNamespace()))
    monkeypatch.setattr(vc, "torch", empty)
    assert "no sha256 given" in vc.load(str(so), None) and loaded == []
    why = vc.load(str(so), hashlib.sha256(b"another build").hexdigest())
    assert f"sha256 {sha}" in why and "not loading" in why and loaded == []
    assert "has no cutlass_scaled_mm" in vc.load(str(so), sha)
    [(path, got)] = loaded
    assert path.startswith("/proc/self/fd/") and got == good
    so.write_bytes(good)
    empty.ops._C.cutlass_scaled_mm = object()
    assert vc.load(str(so), sha) == ""
    assert tc.load_vllm(None, None) == (None, "no --vllm-so given")
    so.write_bytes(good)
    assert tc.load_vllm(str(so), sha) == (vc, "")
    so.write_bytes(b"forged")
    assert tc.load_vllm(str(so), sha)[0] is None
    assert "vllm_cutlass" in sys.modules
