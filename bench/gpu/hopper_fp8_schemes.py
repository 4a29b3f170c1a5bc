#!/usr/bin/env python3
"""Hopper FP8 scale schemes and exact accumulation (issue 27): build here, check and time there.

  build (here, the daemon's venv; CUTE_DSL_ARCH=sm_90a):
      python bench/gpu/hopper_fp8_schemes.py build --out DIR [--jobs 2]
    compiles the batch-invariant plan's first choice per shape, M and scheme (SCHEMES:
    per-token x per-channel fast, per-tensor exact, per-token exact), plus the per-tensor
    fast first choices for reference, links each into a .so and writes DIR/manifest.json.
    DIR also gets this script, vllm_cutlass.py (vLLM's cutlass_scaled_mm as vLLM calls it),
    the client package (the launcher), the DSL runtime (xz) and the tvm-ffi wheel
    (bench/gpu/run_hopper_fp8.sh's recipe).
  run (there: torch CUDA, tvm_ffi from the carried wheel, no cutlass):
      python DIR/hopper_fp8_schemes.py run --bundle DIR --out $OUT [--vllm-so PATH
      --vllm-sha256 HEX]
    correct: float64 reference on fresh data (ragged M, N, K), NaN-poisoned outputs,
      relative error beside the bf16 floor (the reference rounded to bf16) and beside
      cuBLAS / torch's rowwise GEMM with and without fast accumulation; every kernel of a
      class bitwise equal to the class's first on the same data.
    bi: the seeds' method (x[:M] against the first M rows of the largest M's output,
      bitwise) for every kernel and for each scheme's per-M plan mix; eager against a
      CUDA-graph replay, bitwise, for every kernel.
    alts (--phases ...,alts): ALTERNATIVES, other tactics of a short point's class (and of
      S = 1), timed beside the plan's first choice and cuBLAS without fast accumulation.
    perf: CUDA-event medians of CUDA-graph replays (inputs rotated past the L2): the plan's
      first choice per scheme against torch._scaled_mm of the same scheme (per-tensor or
      rowwise, fast accumulation on and off) and vLLM's cutlass_scaled_mm (--vllm-so,
      vLLM 0.33.0's _C_stable_libtorch.abi3.so; per-tensor and per-token scales).
    block phases (bcorrect, bbi, bperf; --phases): the block128 scheme (1x128 activation x
      128x128 weight scales, exact) on BLOCK_SHAPES x BLOCK_MS: float64 reference (<= 1.05x
      the bf16 floor), the seeds' method and eager vs graph, and throughput against vLLM
      0.33.0's Triton w8a8_block_fp8_matmul (its kernel's source and its H200 configs,
      copied from the installed vLLM into the bundle at build; the configs vLLM picks
      without batch invariance) and vLLM's cutlass_scaled_mm with block scales (--vllm-so).
    Tables are printed last; everything goes to $OUT/schemes.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

# the seed shapes, a small N with a large K (and the held-out K = 18944 of issue 27), a very
# large N: (N, K)
SHAPES = [(4096, 4096), (2688, 4096), (4608, 2688), (14336, 4096), (3584, 18944),
          (1024, 16384), (28672, 4096)]
MS = [1, 16, 128, 512, 2048, 8192]
# (scales, accum): the schemes issue 27 adds (per-tensor fast is timed by hopper_fp8_check.py)
SCHEMES = [("token", "fast"), ("tensor", "exact"), ("token", "exact")]
NUM_SMS = 132
# block128: the shapes above (K % 128 == 0 all) and DeepSeek-V3's (small N / large K, very
# large N); M trimmed to six powers of two for device time
BLOCK_SHAPES = SHAPES + [(2112, 7168), (576, 7168), (24576, 1536), (7168, 18432),
                         (36864, 7168), (4608, 7168), (7168, 2048)]
BLOCK_MS = [1, 16, 128, 512, 2048, 8192]
# exact per-tensor on a shape the plan's first choices leave short (docs/history.md,
# exact run 3): other tactics of its class (S = 4, both split modes) and the S = 1 class's
# 128 x 128, timed beside the first choice (the alts phase)
ALTERNATIVES = [{"n": 1024, "k": 16384, "ms": [512, 2048, 8192], "scales": "tensor", "tactics": [
    dict(tile_m=tm, tile_n=tn, splits=4, split_mode=mode)
    for mode, tiles in (("cta", ((64, 64), (64, 128), (64, 192), (128, 128))),
                        ("serial", ((64, 64), (64, 128), (128, 64), (128, 128))))
    for tm, tn in tiles] + [dict(tile_m=128, tile_n=128)]}]
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def _bundle_natives():
    """bench/gpu/bundle_natives.py (beside this script, in the repository and in a bundle)."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import bundle_natives

    return bundle_natives


def _vllm_cutlass():
    """bench/gpu/vllm_cutlass.py (beside this script, in the repository and in a bundle):
    vLLM's cutlass_scaled_mm as vLLM calls it."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import vllm_cutlass

    return vllm_cutlass


VLLM_SITE = os.path.join(REPO, ".venv-vllm", "lib", "python3.11", "site-packages", "vllm")


def scheme_name(scales: str, accum: str) -> str:
    return f"{scales}-{accum}"


# ====================================================================================
# build (here)
# ====================================================================================

PLANNED: dict = {}  # tactic name -> params, filled by plan()


def plan(schemes: list[str] | None = None) -> dict:
    """{scheme: {"NxK": {"class": id, "by_m": {M: tactic name}}}}: the batch-invariant
    plan's first choice (what a client runs), as the family plans it (PLANNED: their
    params), for the SCHEMES named in ``schemes`` (None: all)."""
    sys.path[:0] = [REPO, os.path.join(REPO, "client")]
    from cached.families.hopper_fp8.family import HopperFp8
    from cached.families.hopper_fp8.tactic import tactic_from_params

    fam = HopperFp8()
    out = {}
    for scales, accum in SCHEMES:
        if schemes is not None and scheme_name(scales, accum) not in schemes:
            continue
        per = out[scheme_name(scales, accum)] = {}
        for n, k in SHAPES:
            by_m = {}
            for m in MS:
                req = fam.plan((m, n, k), "sm_90a", NUM_SMS,
                               {"batch_invariant": True, "scales": scales,
                                "accumulation": accum})[0]
                by_m[str(m)] = tactic_from_params(req.params).name
                PLANNED[by_m[str(m)]] = dict(req.params)
            per[f"{n}x{k}"] = {"class": tactic_from_params(req.params).reduction_class,
                               "by_m": by_m}
    return out


def block_plan() -> dict:
    """{"NxK": {"class": id, "by_m": {M: tactic name}}} of the block128 batch-invariant plan
    (PLANNED gets their params)."""
    sys.path[:0] = [REPO, os.path.join(REPO, "client")]
    from cached.families.hopper_fp8.family import HopperFp8
    from cached.families.hopper_fp8.tactic import tactic_from_params

    fam = HopperFp8()
    per = {}
    for n, k in BLOCK_SHAPES:
        by_m = {}
        for m in BLOCK_MS:
            req = fam.plan((m, n, k), "sm_90a", NUM_SMS,
                           {"batch_invariant": True, "scales": "block128"})[0]
            by_m[str(m)] = tactic_from_params(req.params).name
            PLANNED[by_m[str(m)]] = dict(req.params)
        per[f"{n}x{k}"] = {"class": tactic_from_params(req.params).reduction_class,
                           "by_m": by_m}
    return per


def copy_vllm_triton(out: str) -> None:
    """vLLM 0.33.0's Triton block-FP8 kernel (its source, unchanged, cut from the installed
    fp8_utils.py) and its H200 block configs, for the rival (bundle only, not the repo)."""
    import ast

    src_path = os.path.join(VLLM_SITE, "model_executor", "layers", "quantization", "utils",
                            "fp8_utils.py")
    src = open(src_path).read()
    fn = next(x for x in ast.parse(src).body if isinstance(x, ast.FunctionDef)
              and x.name == "_w8a8_triton_block_scaled_mm")
    lines = src.splitlines()[fn.decorator_list[0].lineno - 1:fn.end_lineno]
    with open(os.path.join(out, "vllm_triton_block.py"), "w") as f:
        f.write("# cut from vLLM 0.33.0 model_executor/layers/quantization/utils/fp8_utils.py\n"
                "import triton\nimport triton.language as tl\n\n\n" + "\n".join(lines) + "\n")
    cdir = os.path.join(out, "triton_configs")
    os.makedirs(cdir, exist_ok=True)
    src_cfg = os.path.join(os.path.dirname(src_path), "configs")
    for n, k in BLOCK_SHAPES:
        nm = (f"N={n},K={k},device_name=NVIDIA_H200,dtype=fp8_w8a8,"
              f"block_shape=[128,128].json")
        if os.path.exists(os.path.join(src_cfg, nm)):
            shutil.copy2(os.path.join(src_cfg, nm), os.path.join(cdir, f"{n}x{k}.json"))


#: what ``build --schemes`` may name: SCHEMES' names and the block128 scheme
BLOCK_SCHEME = scheme_name("block128", "exact")
ALL_SCHEMES = [scheme_name(sc, acc) for sc, acc in SCHEMES] + [BLOCK_SCHEME]


def build(out: str, jobs: int, schemes: list[str] | None = None) -> None:
    """The bundle of the plans' first choices for ``schemes`` (None: ALL_SCHEMES) and the
    extra kernels of those schemes."""
    sys.path[:0] = [REPO, os.path.join(REPO, "client")]
    from cached.families.hopper_fp8.family import HopperFp8
    from cached.families.hopper_fp8.tactic import HopperFp8Tactic, tactic_from_params

    schemes = ALL_SCHEMES if schemes is None else schemes
    bad = sorted(set(schemes) - set(ALL_SCHEMES))
    if bad or not schemes:
        raise SystemExit(f"--schemes {','.join(schemes)}: name one or more of "
                         f"{', '.join(ALL_SCHEMES)}")
    p = plan([x for x in schemes if x != BLOCK_SCHEME])
    bp = block_plan() if BLOCK_SCHEME in schemes else {}
    by_name = {nm: tactic_from_params(params) for nm, params in PLANNED.items()}
    names = list(dict.fromkeys([nm for per in p.values() for sh in per.values()
                                for nm in sh["by_m"].values()]
                               + [nm for sh in bp.values() for nm in sh["by_m"].values()]))
    # a few more on the correctness data: code paths the plan's first choices lack (exact
    # ping-pong and wg_n = 2, an exact narrow tile, e5m2 / fp16)
    extra = [HopperFp8Tactic(**kw).normalized() for kw in (
        {"tile_m": 64, "tile_n": 128, "pingpong": True, "scales": "token", "accum": "exact"},
        {"tile_m": 64, "tile_n": 128, "wg_n": 2, "accum": "exact"},
        {"tile_m": 64, "tile_n": 48, "scales": "token", "accum": "exact"},
        {"tile_m": 128, "tile_n": 128, "out_dtype": "float16", "ab_dtype": "e5m2",
         "scales": "token", "accum": "exact"},
        {"tile_m": 64, "tile_n": 128, "splits": 2, "split_mode": "cta", "accum": "exact"},
        {"tile_m": 64, "tile_n": 128, "splits": 2, "pingpong": True, "accum": "exact"},
        {"tile_m": 64, "tile_n": 64, "splits": 2, "wg_n": 2, "scales": "token",
         "accum": "exact"})]
    # block128's code paths beyond the plan's picks: ping-pong, swap_ab, wg_n = 2, a narrow
    # tile (tile_n 48: weight blocks split across tiles), one scale per 8 columns loaded per
    # K tile (tile_n 192, outside the block space), e5m2 / fp16
    extra += [HopperFp8Tactic(scales="block128", accum="exact", **kw).normalized() for kw in (
        {"tile_m": 64, "tile_n": 128, "pingpong": True},
        {"tile_m": 128, "tile_n": 192},
        {"tile_m": 16, "tile_n": 64, "swap_ab": True},
        {"tile_m": 64, "tile_n": 128, "wg_n": 2},
        {"tile_m": 64, "tile_n": 48},
        {"tile_m": 128, "tile_n": 128, "out_dtype": "float16", "ab_dtype": "e5m2"})]
    alts = []
    for alt in ALTERNATIVES:
        if scheme_name(alt["scales"], "exact") not in schemes:
            continue
        ts = [HopperFp8Tactic(scales=alt["scales"], accum="exact", **kw).normalized()
              for kw in alt["tactics"]]
        extra += ts
        alts.append({**{x: alt[x] for x in ("n", "k", "ms", "scales")},
                     "names": [t.name for t in ts]})
    for t in extra:
        if scheme_name(t.scales, t.accum) not in schemes:
            continue
        by_name.setdefault(t.name, t)
        if t.name not in names:
            names.append(t.name)
    natives = _bundle_natives()
    entries, compiled_now, seconds = natives.compile_kernels(
        out, [(nm, by_name[nm]) for nm in names], "fp8s", jobs, REPO, NUM_SMS)
    digests = natives.finish(out, entries, [__file__, os.path.join(HERE, "vllm_cutlass.py")],
                             REPO)
    copy_vllm_triton(out)
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump({"kernels": entries, "plan": p, "shapes": SHAPES, "ms": MS,
                   "block_plan": bp, "block_shapes": BLOCK_SHAPES, "block_ms": BLOCK_MS,
                   "alts": alts,
                   "source_sha256": HopperFp8().source_sha256(),
                   "compiled_now": compiled_now,
                   "compile_wall_seconds": round(seconds, 1), **digests}, f,
                  indent=1)
    print(f"{len(entries)} kernels ({compiled_now} compiled now, {seconds:.0f} s)")


# ====================================================================================
# run (there)
# ====================================================================================

class Runner:
    def __init__(self, bundle: str, out: str, vllm_so: str | None,
                 vllm_sha256: str | None = None):
        import torch

        self.t = torch
        sys.path.insert(0, os.path.join(bundle, "client"))
        from cached_client.gemm import hopper_fp8 as launcher

        self.L = launcher
        with open(os.path.join(bundle, "manifest.json")) as f:
            self.man = json.load(f)
        # the runtime and each kernel checked against the manifest's digests first
        natives = _bundle_natives()
        natives.use_runtime(bundle, self.man)
        self.fns = natives.load_kernels(bundle, self.man)
        self.meta = {e["name"]: e["params"] for e in self.man["kernels"]}
        self.cls = {e["name"]: e["class"] for e in self.man["kernels"]}
        self.dev = torch.device("cuda")
        self.vc = _vllm_cutlass()
        why = self.vc.load(vllm_so, vllm_sha256)
        self.vllm = not why
        if vllm_so and why:
            print(f"vLLM's _C left out: {why}")
        self.out = out
        self.log = open(os.path.join(out, "schemes.log"), "a")
        self.res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "vllm_cutlass": self.vllm, "kernels": len(self.fns)}
        self.ws = torch.empty(1 << 26, dtype=torch.float32, device=self.dev)
        self.cnt = torch.zeros(1 << 16, dtype=torch.int32, device=self.dev)

    def p(self, *a):
        s = " ".join(str(x) for x in a)
        print(s, flush=True)
        self.log.write(s + "\n")
        self.log.flush()

    def fits(self, name, m, n):
        """Whether the shared workspace and counters serve the kernel at (m, n)."""
        p = self.meta[name]
        return (self.L.workspace_bytes(p, m, n) // 4 <= self.ws.numel()
                and self.L.counter_elems(p, m, n) <= self.cnt.numel())

    def scheme(self, name):
        m = self.meta[name]
        return m.get("scales", "tensor"), m.get("accum", "fast")

    def dtypes(self, name):
        t = self.t
        m = self.meta[name]
        return ({"e4m3": t.float8_e4m3fn, "e5m2": t.float8_e5m2}[m["ab_dtype"]],
                {"bfloat16": t.bfloat16, "float16": t.float16}[m["out_dtype"]])

    def data(self, m, n, k, ab=None, seed=0):
        t = self.t
        g = t.Generator(device=self.dev).manual_seed(seed)
        ab = ab or t.float8_e4m3fn
        a = t.randn(m, k, device=self.dev, generator=g).to(ab)
        b = t.randn(n, k, device=self.dev, generator=g).to(ab)
        sa_tok = t.rand(m, 1, device=self.dev, generator=g) * 1.5 + 0.5
        sb_tok = t.rand(n, 1, device=self.dev, generator=g) * 1.5 + 0.5
        sa = t.tensor([0.75], device=self.dev)
        sb = t.tensor([1.25], device=self.dev)
        return a, b, {"tensor": (sa, sb), "token": (sa_tok, sb_tok)}

    def call(self, name, a, b, sa, sb, out=None):
        t = self.t
        _, od = self.dtypes(name)
        if out is None:
            out = t.full((a.shape[0], b.shape[0]), float("nan"), dtype=od, device=self.dev)
        return self.L.gemm(self.fns[name], a, b, sa, sb, od, out=out, params=self.meta[name],
                           workspace=self.ws, counters=self.cnt)

    def torch_mm(self, a, b, sa, sb, fast, scales, od=None):
        t = self.t
        if scales == "token":
            return t._scaled_mm(a, b.t(), scale_a=sa.reshape(-1, 1), scale_b=sb.reshape(1, -1),
                                out_dtype=t.bfloat16, use_fast_accum=fast)
        return t._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=od or t.bfloat16,
                            use_fast_accum=fast)

    def vllm_mm(self, a, b, sa, sb, out, scales):
        return self.vc.scaled_mm(a, b, sa, sb, out, scales)

    @staticmethod
    def rows_differ(ref, out):
        import torch

        r = min(ref.shape[0], out.shape[0])
        return int((ref[:r].contiguous().view(torch.int16)
                    != out[:r].contiguous().view(torch.int16)).any(dim=1).sum().item())

    # -- correctness -----------------------------------------------------------------
    def correct(self):
        t = self.t
        problems = [(1, 256, 128), (77, 2688, 4096), (300, 1040, 4112), (129, 4608, 2704),
                    (1000, 4096, 4096), (5, 3584, 18944), (64, 1024, 16384),
                    (333, 3584, 18944)]
        rows = []
        for (m, n, k) in problems:
            per = {}
            for name in self.fns:
                if self.scheme(name)[0] == "block128":
                    continue  # the block phases' (bcorrect)
                ab, od = self.dtypes(name)
                key = (ab, od)
                if key not in per:
                    a, b, sc = self.data(m, n, k, ab, seed=m + n + k)
                    d = per[key] = {"a": a, "b": b, "sc": sc, "first": {}, "ref": {}}
                    for s, (sa, sb) in sc.items():
                        ref = (a.double() @ b.double().t()) * (sa.double().reshape(-1, 1)
                                                                * sb.double().reshape(1, -1))
                        floor = ((ref.to(od).double() - ref).norm() / ref.norm()).item()
                        bf16 = ((ref.to(t.bfloat16).double() - ref).norm() / ref.norm()).item()
                        d["ref"][s] = (ref, floor, bf16)
                        for fast in (True, False):
                            try:
                                c = self.torch_mm(a, b, sa, sb, fast, s, od)
                                rows.append(dict(m=m, n=n, k=k, impl=f"torch_{s}_fast{int(fast)}",
                                                 ab=str(ab), scheme=s, floor=floor,
                                                 rel=((c.double() - ref).norm()
                                                      / ref.norm()).item()))
                            except Exception as ex:  # noqa: BLE001 -- e5m2, fp16 rowwise
                                self.p(f"  torch {s} fast{int(fast)} n/a for {key}: "
                                       f"{str(ex)[:80]}")
                        if self.vllm and ab == t.float8_e4m3fn and od == t.bfloat16:
                            c = self.vllm_mm(a, b, sa, sb,
                                             t.empty(m, n, dtype=od, device=self.dev), s)
                            rows.append(dict(m=m, n=n, k=k, impl=f"vllm_cutlass_{s}",
                                             ab=str(ab), scheme=s, floor=floor,
                                             rel=((c.double() - ref).norm()
                                                  / ref.norm()).item()))
                d = per[key]
                scales, accum = self.scheme(name)
                sa, sb = d["sc"][scales]
                out = self.call(name, d["a"], d["b"], sa, sb)
                t.cuda.synchronize()
                ref, floor, bf16 = d["ref"][scales]
                rel = ((out.double() - ref).norm() / ref.norm()).item()
                cls = self.cls[name]
                first = d["first"].setdefault(cls, (name, out))
                same = bool(t.equal(out, first[1]))
                # exact: within 1.05x the bf16 floor (issue 27; for fp16 outputs, whose own
                # floor is 8x lower, ratio_floor reports that one)
                ok = bool(t.isfinite(out).all().item()) and same and (
                    rel <= 1.05 * bf16 if accum == "exact" else rel < 2e-2)
                rows.append(dict(m=m, n=n, k=k, impl=name, cls=cls, scheme=scales, accum=accum,
                                 ab=str(ab), rel=rel, floor=floor, ratio_floor=rel / floor,
                                 ratio_bf16_floor=rel / bf16,
                                 same_as_class_first=same, ok=ok))
                if not ok:
                    self.p(f"  FAIL {name} {m}x{n}x{k}: rel={rel:.3g} floor={floor:.3g} "
                           f"same_as_class_first={same}")
            self.p(f"correct {m}x{n}x{k}: done")
        self.res["correct"] = rows

    # -- batch invariance and CUDA graphs -------------------------------------------
    def bi(self):
        t = self.t
        ms = self.man["ms"]
        full_m = max(ms)
        rows = []
        for n, k in [tuple(x) for x in self.man["shapes"]]:
            x, w, sc = self.data(full_m, n, k, seed=n * 7 + k)
            names = {nm for per in self.man["plan"].values()
                     for nm in per[f"{n}x{k}"]["by_m"].values()}
            for name in sorted(names):
                scales, _ = self.scheme(name)
                sa, sb = sc[scales]

                def run(mm, name=name, sa=sa, sb=sb, scales=scales, x=x, w=w):
                    return self.call(name, x[:mm].clone(), w,
                                     sa[:mm].clone() if scales == "token" else sa, sb)
                top = max(mm for mm in ms if self.fits(name, mm, n))  # 'cta': workspace
                full = run(top)
                diff = {mm: self.rows_differ(full, run(mm)) for mm in ms if mm <= top}
                # eager against a CUDA-graph replay of the same launch, bitwise
                xs = x[:ms[1]].clone()
                sas = sa[:ms[1]].clone() if scales == "token" else sa
                eager = self.call(name, xs, w, sas, sb)
                gout = t.full_like(eager, float("nan"))
                s = t.cuda.Stream()
                s.wait_stream(t.cuda.current_stream())
                with t.cuda.stream(s):
                    self.call(name, xs, w, sas, sb, out=gout)
                t.cuda.current_stream().wait_stream(s)
                gout.fill_(float("nan"))
                g = t.cuda.CUDAGraph()
                with t.cuda.graph(g):
                    self.call(name, xs, w, sas, sb, out=gout)
                g.replay()
                t.cuda.synchronize()
                rows.append(dict(n=n, k=k, impl=name, cls=self.cls[name], diff_rows=diff, top=top,
                                 total=sum(diff.values()),
                                 graph_equal=bool(t.equal(eager, gout))))
            for sch, per in self.man["plan"].items():
                pick = per[f"{n}x{k}"]["by_m"]
                scales = sch.split("-")[0]
                sa, sb = sc[scales]

                def run_mix(mm, sa=sa, sb=sb, pick=pick, scales=scales, x=x, w=w):
                    return self.call(pick[str(mm)], x[:mm].clone(), w,
                                     sa[:mm].clone() if scales == "token" else sa, sb)
                full = run_mix(full_m)
                diff = {mm: self.rows_differ(full, run_mix(mm)) for mm in ms}
                rows.append(dict(n=n, k=k, impl=f"plan_mix {sch}", cls=per[f"{n}x{k}"]["class"],
                                 diff_rows=diff, total=sum(diff.values())))
            self.p(f"bi {n}x{k}: done")
        self.res["bi"] = rows

    # -- throughput --------------------------------------------------------------------
    def _graph(self, launch, nsets, iters):
        t = self.t
        s = t.cuda.Stream()
        s.wait_stream(t.cuda.current_stream())
        with t.cuda.stream(s):
            for i in range(nsets):
                launch(i)
        t.cuda.current_stream().wait_stream(s)
        t.cuda.synchronize()
        g = t.cuda.CUDAGraph()
        with t.cuda.graph(g):
            for i in range(iters):
                launch(i % nsets)
        g.replay()
        t.cuda.synchronize()
        return g

    def _us(self, g, iters, reps=5):
        t = self.t
        samples = []
        for _ in range(reps):
            e0, e1 = t.cuda.Event(enable_timing=True), t.cuda.Event(enable_timing=True)
            e0.record()
            g.replay()
            e1.record()
            e1.synchronize()
            samples.append(e0.elapsed_time(e1) * 1e3 / iters)
        return statistics.median(samples)

    def _time(self, impls, nsets, iters, skipped="perf_skipped", label=""):
        """({name: median us}, {name: us per round}) of launch functions ``impls`` (each
        takes an input set's index), CUDA-graph replays in 5 interleaved rounds, the order
        rotated; one that cannot be captured is left out (res[skipped], its name + label)."""
        graphs = {}
        for key, fn in impls.items():
            try:
                graphs[key] = self._graph(fn, nsets, iters)
            except Exception as ex:  # noqa: BLE001 -- e.g. a scheme torch lacks
                self.res.setdefault(skipped, {})[key + label] = str(ex)[:200]
                self.t.cuda.synchronize()
        keys = list(graphs)
        samples = {key: [] for key in keys}
        for r in range(5):
            for j in range(len(keys)):
                key = keys[(j + r) % len(keys)]
                samples[key].append(self._us(graphs[key], iters, 5))
        return {key: statistics.median(v) for key, v in samples.items()}, samples

    def _inputs(self, m, n, k):
        """(nsets, iters, A, B, S): input sets rotated past the L2 (about 200 MB in all)."""
        per = m * k + n * k + 2 * m * n
        nsets = max(1, min(16, -(-(200 << 20) // per)))
        A, B, S = [], [], []
        for i in range(nsets):
            a, b, sc = self.data(m, n, k, seed=1000 + i)
            A.append(a)
            B.append(b)
            S.append(sc)
        return nsets, 20 if m * n * k < (1 << 36) else 6, A, B, S

    def alts(self, deadline):
        """The manifest's alternatives (ALTERNATIVES) beside the plan's first choice and
        cuBLAS without fast accumulation, at each of their M: us per kernel."""
        t = self.t
        rows = []
        for alt in self.man.get("alts", []):
            n, k, scales = alt["n"], alt["k"], alt["scales"]
            first = self.man["plan"][scheme_name(scales, "exact")][f"{n}x{k}"]["by_m"]
            for m in alt["ms"]:
                if time.time() > deadline:
                    self.res["alts_truncated"] = True
                    break
                nsets, iters, A, B, S = self._inputs(m, n, k)
                C = [t.empty(m, n, dtype=t.bfloat16, device=self.dev) for _ in range(nsets)]
                impls = {}
                for name in dict.fromkeys([first[str(m)], *alt["names"]]):
                    if not self.fits(name, m, n):
                        continue
                    fn = self.fns[name]

                    def ours(i, fn=fn, A=A, B=B, C=C, S=S, scales=scales):
                        sa, sb = S[i][scales]
                        fn(A[i], B[i], C[i], sa.reshape(-1), sb.reshape(-1), self.ws, self.cnt)
                    impls[name] = ours

                def cublas(i, A=A, B=B, S=S, scales=scales):
                    sa, sb = S[i][scales]
                    self.torch_mm(A[i], B[i], sa, sb, False, scales)
                impls["torch fast0"] = cublas
                res, _ = self._time(impls, nsets, iters)
                del A, B, C, S
                rows.append(dict(n=n, k=k, m=m, scales=scales, first=first[str(m)], us=res))
                self.p(f"alts M={m} {n}x{k}: " + " ".join(f"{a}={b:.1f}" for a, b in res.items()))
        self.res["alts"] = rows

    def perf(self, deadline):
        t = self.t
        rows = []
        plan = self.man["plan"]
        for m in self.man["ms"]:
            for n, k in [tuple(x) for x in self.man["shapes"]]:
                if time.time() > deadline:
                    self.p(f"perf: deadline at M={m} {n}x{k}")
                    self.res["perf_truncated"] = True
                    self.res["perf"] = rows
                    return
                nsets, iters, A, B, S = self._inputs(m, n, k)
                C = [t.empty(m, n, dtype=t.bfloat16, device=self.dev) for _ in range(nsets)]
                impls = {}
                for sch, p in plan.items():
                    name = p[f"{n}x{k}"]["by_m"][str(m)]
                    scales = sch.split("-")[0]
                    fn = self.fns[name]

                    def ours(i, fn=fn, scales=scales, A=A, B=B, C=C, S=S):
                        sa, sb = S[i][scales]
                        fn(A[i], B[i], C[i], sa.reshape(-1), sb.reshape(-1), self.ws, self.cnt)
                    impls[f"ours {sch}"] = ours
                for scales in ("tensor", "token"):
                    for fast in (True, False):
                        def tm(i, fast=fast, scales=scales, A=A, B=B, S=S):
                            sa, sb = S[i][scales]
                            self.torch_mm(A[i], B[i], sa, sb, fast, scales)
                        impls[f"torch {scales} fast{int(fast)}"] = tm
                    if self.vllm:
                        def vm(i, scales=scales, A=A, B=B, C=C, S=S):
                            sa, sb = S[i][scales]
                            self.vllm_mm(A[i], B[i], sa, sb, C[i], scales)
                        impls[f"vllm {scales}"] = vm
                res, samples = self._time(impls, nsets, iters)
                del A, B, C, S
                rows.append(dict(m=m, n=n, k=k, us=res, rounds_us=samples,
                                 first={sch: p[f"{n}x{k}"]["by_m"][str(m)]
                                        for sch, p in plan.items()}))
                self.p(f"perf M={m} {n}x{k}: " + " ".join(f"{a}={b:.1f}" for a, b in res.items()))
        self.res["perf"] = rows


class BlockRunner:
    """The block128 phases on a Runner's kernels (module doc)."""

    def __init__(self, r: Runner, bundle: str):
        self.r, self.t = r, r.t
        self.tri = None
        self.cfgs = {}
        try:
            sys.path.insert(0, bundle)
            import vllm_triton_block

            self.tri = vllm_triton_block._w8a8_triton_block_scaled_mm
            cdir = os.path.join(bundle, "triton_configs")
            for f in os.listdir(cdir):
                with open(os.path.join(cdir, f)) as fh:
                    self.cfgs[f[:-5]] = {int(m): c for m, c in json.load(fh).items()}
        except Exception as ex:  # noqa: BLE001 -- reported, the run goes on without it
            r.p(f"Triton rival unavailable: {ex}")
        r.res["triton_configs"] = sorted(self.cfgs)
        self.names = [e["name"] for e in r.man["kernels"]
                      if e["params"].get("scales") == "block128"]

    def data(self, m, n, k, ab=None, seed=0):
        """a (m, k), b (n, k) FP8; a_scale (m, k/128) column-major, b_scale (ceil(n/128),
        k/128) row-major, fp32 in [0.5, 2)."""
        t = self.t
        dev = self.r.dev
        g = t.Generator(device=dev).manual_seed(seed)
        ab = ab or t.float8_e4m3fn
        a = t.randn(m, k, device=dev, generator=g).to(ab)
        b = t.randn(n, k, device=dev, generator=g).to(ab)
        kb, nb = k // 128, -(-n // 128)
        sa = (t.rand(kb, m, device=dev, generator=g) * 1.5 + 0.5).t()
        sb = t.rand(nb, kb, device=dev, generator=g) * 1.5 + 0.5
        return a, b, sa, sb

    def ref(self, a, b, sa, sb):
        n, k = b.shape
        fa = a.double() * sa.double().repeat_interleave(128, dim=1)[:, :k]
        fb = b.double() * sb.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)
        return fa @ fb.t()

    @staticmethod
    def rows(sa, mm):
        """The first mm rows' activation scales as a client passes them: column-major."""
        return sa[:mm].t().contiguous().t()

    def triton(self, a, b, sa, sb, c):
        m, k = a.shape
        n = b.shape[0]
        cfg = self.cfgs.get(f"{n}x{k}")
        cfg = (cfg[min(cfg, key=lambda x: abs(x - m))] if cfg else
               {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128,
                "GROUP_SIZE_M": 32, "num_warps": 4, "num_stages": 2})
        grid = (-(-m // cfg["BLOCK_SIZE_M"]) * -(-n // cfg["BLOCK_SIZE_N"]),)
        self.tri[grid](a, b, c, sa, sb, m, n, k, 128, 128, a.stride(0), a.stride(1),
                       b.stride(1), b.stride(0), c.stride(0), c.stride(1), sa.stride(0),
                       sa.stride(1), sb.stride(1), sb.stride(0), **cfg)
        return c

    def cutlass(self, a, b, sa, sb, c):
        return self.r.vc.scaled_mm(a, b, sa, sb, c, "block128")

    def correct(self):
        t, r = self.t, self.r
        problems = [(1, 256, 128), (77, 2688, 4096), (300, 1040, 4224), (129, 4624, 2688),
                    (1000, 4096, 4096), (5, 3584, 18944), (64, 1024, 16384),
                    (333, 2112, 7168), (200, 7168, 18432), (17, 576, 7168)]
        rows = []
        for m, n, k in problems:
            per = {}
            for name in self.names:
                ab, od = r.dtypes(name)
                if (ab, od) not in per:
                    a, b, sa, sb = self.data(m, n, k, ab, seed=m + n + k)
                    ref = self.ref(a, b, sa, sb)
                    bf16 = ((ref.to(t.bfloat16).double() - ref).norm() / ref.norm()).item()
                    floor = ((ref.to(od).double() - ref).norm() / ref.norm()).item()
                    per[(ab, od)] = (a, b, sa, sb, ref, bf16, floor, {})
                    if ab == t.float8_e4m3fn and od == t.bfloat16:
                        rivals = {"triton": self.triton} if self.tri else {}
                        if r.vllm:
                            rivals["vllm_cutlass"] = self.cutlass
                        for rn, fn in rivals.items():
                            try:
                                c = fn(a, b, sa, sb, t.empty(m, n, dtype=od, device=r.dev))
                                rows.append(dict(m=m, n=n, k=k, impl=rn, floor=bf16, rel=(
                                    (c.double() - ref).norm() / ref.norm()).item()))
                            except Exception as ex:  # noqa: BLE001 -- reported
                                rows.append(dict(m=m, n=n, k=k, impl=rn, error=str(ex)[:200]))
                a, b, sa, sb, ref, bf16, floor, first = per[(ab, od)]
                out = r.call(name, a, b, sa, sb)
                t.cuda.synchronize()
                rel = ((out.double() - ref).norm() / ref.norm()).item()
                f = first.setdefault(r.cls[name], (name, out))
                same = bool(t.equal(out, f[1]))
                ok = bool(t.isfinite(out).all().item()) and same and rel <= 1.05 * bf16
                rows.append(dict(m=m, n=n, k=k, impl=name, cls=r.cls[name], ab=str(ab),
                                 rel=rel, floor=floor, ratio_floor=rel / floor,
                                 ratio_bf16_floor=rel / bf16, same_as_class_first=same, ok=ok))
                if not ok:
                    r.p(f"  FAIL {name} {m}x{n}x{k}: rel={rel:.3g} bf16 floor={bf16:.3g} "
                        f"same={same}")
            r.p(f"bcorrect {m}x{n}x{k}: done")
        r.res["bcorrect"] = rows

    def bi(self):
        t, r = self.t, self.r
        ms = r.man["block_ms"]
        full_m = max(ms)
        rows = []
        for n, k in [tuple(x) for x in r.man["block_shapes"]]:
            x, w, sa, sb = self.data(full_m, n, k, seed=n * 7 + k)
            pick = r.man["block_plan"][f"{n}x{k}"]["by_m"]

            def run(name, mm, x=x, w=w, sa=sa, sb=sb):
                return r.call(name, x[:mm].clone(), w, self.rows(sa, mm), sb)
            for name in sorted(set(pick.values())):
                full = run(name, full_m)
                diff = {mm: r.rows_differ(full, run(name, mm)) for mm in ms}
                xs, sas = x[:ms[1]].clone(), self.rows(sa, ms[1])
                eager = r.call(name, xs, w, sas, sb)
                gout = t.full_like(eager, float("nan"))
                st = t.cuda.Stream()
                st.wait_stream(t.cuda.current_stream())
                with t.cuda.stream(st):
                    r.call(name, xs, w, sas, sb, out=gout)
                t.cuda.current_stream().wait_stream(st)
                gout.fill_(float("nan"))
                g = t.cuda.CUDAGraph()
                with t.cuda.graph(g):
                    r.call(name, xs, w, sas, sb, out=gout)
                g.replay()
                t.cuda.synchronize()
                rows.append(dict(n=n, k=k, impl=name, cls=r.cls[name], diff_rows=diff,
                                 total=sum(diff.values()), graph_equal=bool(t.equal(eager, gout))))
            full = run(pick[str(full_m)], full_m)
            diff = {mm: r.rows_differ(full, run(pick[str(mm)], mm)) for mm in ms}
            rows.append(dict(n=n, k=k, impl="plan_mix block128", diff_rows=diff,
                             total=sum(diff.values())))
            r.p(f"bbi {n}x{k}: done")
        r.res["bbi"] = rows

    def perf(self, deadline):
        t, r = self.t, self.r
        rows = []
        r.res["bperf"] = rows
        for m in r.man["block_ms"]:
            for n, k in [tuple(x) for x in r.man["block_shapes"]]:
                if time.time() > deadline:
                    r.p(f"bperf: deadline at M={m} {n}x{k}")
                    r.res["bperf_truncated"] = True
                    return
                per = m * k + n * k + 2 * m * n
                nsets = max(1, min(16, -(-(200 << 20) // per)))
                D = [self.data(m, n, k, seed=1000 + i) for i in range(nsets)]
                C = [t.empty(m, n, dtype=t.bfloat16, device=r.dev) for _ in range(nsets)]
                iters = 20 if m * n * k < (1 << 36) else 6
                name = r.man["block_plan"][f"{n}x{k}"]["by_m"][str(m)]
                fn = r.fns[name]
                impls = {"ours": lambda i, fn=fn, D=D, C=C: fn(
                    D[i][0], D[i][1], C[i], D[i][2], D[i][3], D[i][3].reshape(-1),
                    D[i][3].reshape(-1).view(t.int32))}
                if self.tri:
                    impls["triton"] = lambda i, D=D, C=C: self.triton(*D[i], C[i])
                if r.vllm:
                    impls["vllm_cutlass"] = lambda i, D=D, C=C: self.cutlass(*D[i], C[i])
                res, _ = r._time(impls, nsets, iters, "bperf_skipped", f" {m} {n}x{k}")
                del D, C
                rows.append(dict(m=m, n=n, k=k, us=res, first=name))
                r.p(f"bperf M={m} {n}x{k}: " + " ".join(f"{a}={b:.1f}" for a, b in res.items()))


def block_tables(res) -> None:
    """block128: correctness per class, bi totals, and the ratio table per rival."""
    if "bcorrect" in res:
        ours = [x for x in res["bcorrect"] if "cls" in x]
        print(f"\n## block128 correctness: {len(ours)} runs, all ok: "
              f"{all(x['ok'] for x in ours)}, max rel/bf16 floor "
              f"{max(x['ratio_bf16_floor'] for x in ours):.3f}")
        for impl in ("triton", "vllm_cutlass"):
            v = [x["rel"] / x["floor"] for x in res["bcorrect"] if x["impl"] == impl
                 and "rel" in x]
            if v:
                print(f"  {impl}: max rel/bf16 floor {max(v):.3f}")
    if "bbi" in res:
        print(f"\n## block128 batch invariance: {len(res['bbi'])} rows, "
              f"{sum(x['total'] for x in res['bbi'])} differing rows; eager vs graph unequal: "
              f"{sum(not x.get('graph_equal', True) for x in res['bbi'])}")
    if "bperf" not in res:
        return
    perf = res["bperf"]
    ms = sorted({x["m"] for x in perf})
    shapes = list(dict.fromkeys((x["n"], x["k"]) for x in perf))
    for rival in ("triton", "vllm_cutlass", "best"):
        print(f"\nblock128: {rival} us / ours us (>1: ours faster; ours in us)\n")
        print("| N x K | " + " | ".join(f"M={m}" for m in ms) + " |")
        print("|---|" + "---|" * len(ms))
        allr = []
        for n, k in shapes:
            cells = []
            for m in ms:
                x = next((y for y in perf if (y["m"], y["n"], y["k"]) == (m, n, k)), None)
                us = x["us"] if x else {}
                have = ([us[y] for y in ("triton", "vllm_cutlass") if y in us]
                        if rival == "best" else [us[rival]] if rival in us else [])
                if "ours" not in us or not have:
                    cells.append("-")
                    continue
                allr.append(min(have) / us["ours"])
                cells.append(f"{allr[-1]:.2f} ({us['ours']:.1f})")
            print(f"| {n}x{k} | " + " | ".join(cells) + " |")
        if allr:
            print(f"\ngeomean {_gm(allr):.3f}, min {min(allr):.2f}, max {max(allr):.2f}, "
                  f">= 1.0: {sum(x >= 1.0 for x in allr)}/{len(allr)}")


def _gm(xs):
    import math

    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def tables(res) -> None:
    """Short tables: correctness by scheme, bi totals, and the ratios per scheme."""
    if "correct" in res:
        by = {}
        for r in res["correct"]:
            if "cls" in r:
                by.setdefault(r["cls"], []).append(r)
        print("\n## correctness (max rel / floor ratio, all ok?)")
        for cls, rs in sorted(by.items()):
            print(f"{cls:32s} kernels={len({r['impl'] for r in rs})} "
                  f"max_rel={max(r['rel'] for r in rs):.3g} "
                  f"max_rel/floor={max(r['ratio_floor'] for r in rs):.3f} "
                  f"max_rel/bf16_floor={max(r.get('ratio_bf16_floor', 0) for r in rs):.3f} "
                  f"all_ok={all(r['ok'] for r in rs)}")
        refs = {}
        for r in res["correct"]:
            if "cls" not in r and r["k"] >= 16384:
                refs.setdefault(r["impl"], []).append(r["rel"] / r["floor"])
        for impl, v in sorted(refs.items()):
            print(f"  reference {impl:28s} rel/floor at K>=16384: max {max(v):.2f}")
        ours = {}
        for r in res["correct"]:
            if "cls" in r and r["k"] >= 16384:
                ours.setdefault(r["cls"], []).append(r["ratio_floor"])
        for cls, v in sorted(ours.items()):
            print(f"  ours {cls:33s} rel/floor at K>=16384: max {max(v):.2f}")
    if "bi" in res:
        tot = sum(r["total"] for r in res["bi"])
        g = sum(not r.get("graph_equal", True) for r in res["bi"])
        print(f"\n## batch invariance: {len(res['bi'])} rows, {tot} differing rows in all; "
              f"eager vs graph unequal: {g}")
    if "perf" in res:
        print("\n## throughput ratios (competitor us / ours us; >1 = ours faster)")
        for ours, rivals in RIVALS.items():
            ratios = []
            line = []
            for r in res["perf"]:
                us = r["us"]
                if ours not in us:
                    continue
                have = [us[x] for x in rivals if x in us]
                if not have:
                    continue
                ratio = min(have) / us[ours]
                ratios.append(ratio)
                line.append(f"M{r['m']}:{r['n']}x{r['k']}={ratio:.2f}")
            if ratios:
                print(f"{ours:18s} vs {'/'.join(rivals)}: "
                      f"geomean {_gm(ratios):.3f} min {min(ratios):.2f} max {max(ratios):.2f} "
                      f"(n={len(ratios)})")
                print("   " + " ".join(line))


def alt_tables(res) -> None:
    """The alts phase: per (shape, M), each kernel's us and cuBLAS exact's / its."""
    if not res.get("alts"):
        return
    print("\n## alternatives (us; cuBLAS exact us / ours in parentheses; * = first choice)")
    for r in res["alts"]:
        ref = r["us"].get("torch fast0")
        cells = [f"{'*' if name == r['first'] else ''}{name}={us:.1f}"
                 + (f" ({ref / us:.2f})" if ref and name != "torch fast0" else "")
                 for name, us in sorted(r["us"].items(), key=lambda x: x[1])]
        print(f"M={r['m']} {r['n']}x{r['k']}: " + ", ".join(cells))


RIVALS = {"ours token-fast": ["torch token fast1", "vllm token"],
          "ours tensor-exact": ["torch tensor fast0"],
          "ours token-exact": ["torch token fast0"]}


def markdown(res) -> None:
    """Per scheme, a table of competitor us / ours us (the faster rival of the same
    scheme and precision; >1: ours faster) by shape and M, ours in us beside it."""
    perf = res["perf"]
    ms = sorted({r["m"] for r in perf})
    shapes = list(dict.fromkeys((r["n"], r["k"]) for r in perf))
    for ours, rivals in RIVALS.items():
        if not any(ours in r["us"] for r in perf):
            continue  # a scheme this bundle did not build
        print(f"\n{ours} against the faster of {', '.join(rivals)} (ratio; ours in us)\n")
        print("| N x K | " + " | ".join(f"M={m}" for m in ms) + " |")
        print("|---|" + "---|" * len(ms))
        allr = []
        for n, k in shapes:
            cells = []
            for m in ms:
                r = next((x for x in perf if (x["m"], x["n"], x["k"]) == (m, n, k)), None)
                have = [r["us"][x] for x in rivals if r and x in r["us"]]
                if not r or ours not in r["us"] or not have:
                    cells.append("-")
                    continue
                ratio = min(have) / r["us"][ours]
                allr.append(ratio)
                cells.append(f"{ratio:.2f} ({r['us'][ours]:.1f})")
            print(f"| {n}x{k} | " + " | ".join(cells) + " |")
        print(f"\ngeomean {_gm(allr):.3f}, min {min(allr):.2f}, max {max(allr):.2f}, "
              f"points >= 1.0: {sum(x >= 1.0 for x in allr)}/{len(allr)}, "
              f">= 0.9: {sum(x >= 0.9 for x in allr)}/{len(allr)}")


def run(bundle, out, phases, vllm_so, budget, vllm_sha256=None):
    os.makedirs(out, exist_ok=True)
    r = Runner(bundle, out, vllm_so, vllm_sha256)
    t0 = time.time()
    r.p(f"device {r.res['device']} torch {r.res['torch']}; {len(r.fns)} kernels; "
        f"vLLM cutlass {r.vllm}")
    path = os.path.join(out, "schemes.json")
    import traceback

    br = BlockRunner(r, bundle) if any(x.startswith("b") for x in phases) else None
    for phase, fn in (("correct", r.correct), ("bi", r.bi),
                      ("perf", lambda: r.perf(t0 + budget)),
                      ("alts", lambda: r.alts(t0 + budget)),
                      ("bcorrect", lambda: br.correct()), ("bbi", lambda: br.bi()),
                      ("bperf", lambda: br.perf(t0 + budget))):
        if phase not in phases:
            continue
        try:
            fn()
        except Exception:  # noqa: BLE001 -- recorded; the other phases still run
            r.res[f"{phase}_error"] = traceback.format_exc()
            r.p(f"{phase} FAILED:\n{traceback.format_exc()}")
        r.res["wall_s"] = round(time.time() - t0, 1)
        with open(path, "w") as f:
            json.dump(r.res, f, indent=1, default=str)
    tables(r.res)
    alt_tables(r.res)
    block_tables(r.res)


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", required=True)
    b.add_argument("--jobs", type=int, default=2)
    b.add_argument("--schemes", default=",".join(ALL_SCHEMES),
                   help=f"comma-separated, of {','.join(ALL_SCHEMES)}")
    sub.add_parser("plan")
    r = sub.add_parser("run")
    r.add_argument("--bundle", default=HERE)
    r.add_argument("--out", default=os.environ.get("OUT", "/tmp/fp8s_out"))
    r.add_argument("--phases", default="correct,bi,perf")
    r.add_argument("--vllm-so", default=None)
    r.add_argument("--vllm-sha256", default=None, help="the digest --vllm-so must have")
    r.add_argument("--budget", type=float, default=300.0, help="seconds before perf stops")
    s = sub.add_parser("tables")
    s.add_argument("json")
    s.add_argument("--markdown", action="store_true", help="the ratio tables as markdown")
    a = ap.parse_args()
    if a.cmd == "build":
        build(a.out, a.jobs, a.schemes.split(","))
    elif a.cmd == "plan":
        print(json.dumps(plan(), indent=1))
    elif a.cmd == "run":
        run(a.bundle, a.out, a.phases.split(","), a.vllm_so, a.budget, a.vllm_sha256)
    else:
        with open(a.json) as f:
            res = json.load(f)
        if a.markdown and "perf" in res:
            markdown(res)
        else:
            tables(res)
        alt_tables(res)
        block_tables(res)


if __name__ == "__main__":
    main()
