"""The H200 check script of the Hopper FP8 family (bench/gpu/hopper_fp8_check.py) on the
CPU: which tactics and points its "decode6" set times, and the per-round spread table
that reports them (docs/history.md, sixth pass)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from cached.families.hopper_fp8.space import tactic_space

ROOT = Path(__file__).resolve().parents[1]


def _check_script():
    spec = importlib.util.spec_from_file_location(
        "hopper_fp8_check", ROOT / "bench" / "gpu" / "hopper_fp8_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_decode6_set_is_the_decode_candidates_of_classes_1_and_2() -> None:
    """S = 1: the 8 swap_ab tiles, the 64 x (40, 48, 56, 64, 80, 96, 112, 128) tiles (wg_n
    1) and the 64 x (48, 64, 80, 96, 128) tiles with wg_n 2, raster m, swizzle 1, 3
    clusters (39): 47 (35 before the seventh pass's narrow tiles);
    S = 2: every tactic of the class (86: its unswapped ones for the large-M points, its
    swap_ab ones as decode candidates)."""
    h = _check_script()
    got = h._decode6_tactics()
    names = [t.name for t in got]
    assert len(names) == len(set(names))
    space = {t.name for t in tactic_space()}
    assert set(names) <= space
    s1 = [t for t in got if t.splits == 1]
    s2 = [t for t in got if t.splits == 2]
    assert len(got) == len(s1) + len(s2)
    assert len(s1) == 47 and len(s2) == 86
    assert sum(t.swap_ab for t in s1) == 8
    assert {t.name for t in s2} == {t.name for t in tactic_space(splits=2) if not t.pdl}
    assert not any(t.pingpong or t.tile_m != 64 for t in s1 if not t.swap_ab)
    assert {(t.tile_n, t.wg_n) for t in s1 if not t.swap_ab} == {
        (tn, w) for tn in (40, 48, 56, 64, 80, 96, 112, 128) for w in (1, 2)
        if (tn, w) not in ((112, 2), (40, 2), (56, 2))}
    # a wide, ping-pong or swizzled tile is no decode candidate
    for t in tactic_space(splits=1):
        cand = h.decode_candidate(t.to_params())
        assert cand == (not t.pdl and (t.swap_ab or (
            t.tile_m == 64 and t.tile_n <= 128 and not t.pingpong and t.raster == "m"
            and t.swizzle == 1)))


def test_decode7_set_is_class_1_decode_candidates_with_the_narrow_tiles() -> None:
    """decode7 (seventh pass): the classes' first kernels (64x128, and the S = 2 'cta' one
    that leads 2112x7168's class) and class S = 1's 47 decode candidates, among them the 9
    narrow 64 x 40/48/56 tiles and the 3 64 x 48 wg_n = 2 ones; the build adds the
    plan's first choices at M <= 64."""
    h = _check_script()
    got = h._decode7_tactics()
    names = [t.name for t in got]
    assert len(names) == len(set(names)) == 48
    assert set(names) <= {t.name for t in tactic_space()}
    assert got[0].name == "m64n128_c1x1_rm_s1_st8_e4m3_bfloat16"
    assert got[1].splits == 2 and got[1].split_mode == "cta" and not got[1].swap_ab
    s1 = [t for t in got if t.splits == 1]
    assert len(s1) == 47 and all(h.decode_candidate(t.to_params()) for t in s1)
    narrow = [t for t in s1 if t.tile_n in (40, 48, 56) and not t.swap_ab]
    assert len(narrow) == 12
    assert sorted({(t.tile_n, t.wg_n) for t in narrow}) == [(40, 1), (48, 1), (48, 2),
                                                            (56, 1)]


def test_rounds_report_gives_median_and_range_of_per_round_ratios() -> None:
    """The first choice's ratio to cuBLAS is the median of the per-round ratios, with
    their min and max; first/best is its time over the fastest other kernel's."""
    h = _check_script()
    manifest = {"shapes": [[4096, 512]],
                "plan": {"4096x512": {"splits": 1, "by_m": {"64": ["ours"], "128": ["ours"]}}}}
    rows = [dict(n=4096, k=512, m=64, impl="cublas_fast1", us=9.0, rounds_us=[9.0, 10.0, 8.0]),
            dict(n=4096, k=512, m=64, impl="cublas_fast0", us=10.0,
                 rounds_us=[10.0, 10.0, 10.0]),
            dict(n=4096, k=512, m=64, impl="ours", us=10.0, rounds_us=[10.0, 10.0, 10.0]),
            dict(n=4096, k=512, m=64, impl="other", us=8.0, rounds_us=[8.0, 12.5, 8.0]),
            # past max_m: left out
            dict(n=4096, k=512, m=128, impl="cublas_fast1", us=9.0, rounds_us=[9.0, 9.0]),
            dict(n=4096, k=512, m=128, impl="cublas_fast0", us=9.0, rounds_us=[9.0, 9.0]),
            dict(n=4096, k=512, m=128, impl="ours", us=9.0, rounds_us=[9.0, 9.0])]
    lines: list[str] = []
    h.rounds_report({"perf": rows}, manifest, lambda *a: lines.append(" ".join(map(str, a))),
                    max_m=64)
    body = [x for x in lines if x.strip().startswith("64 ")]
    assert len(body) == 1 and not any(x.strip().startswith("128 ") for x in lines)
    line = body[0]
    assert "0.900 [0.800-1.000]" in line  # fast: 0.9, 1.0, 0.8
    assert "1.000 [1.000-1.000]" in line  # exact
    assert "1.250 [0.800-1.250]" in line  # ours / other: 1.25, 0.8, 1.25
    assert line.endswith("ours -> other")


def test_pdl8_set_is_each_first_choice_beside_its_pdl_twin() -> None:
    """pdl8 (eighth pass): the classes' first kernels, the plan's first choice per shape
    and M (every M of MS) and the pdl=True twin of each, equal to it but for pdl, plus
    two e5m2/fp16 pdl kernels; the alternative plan names the twins, so a run times
    each point's first choice with and without PDL in the same rounds."""
    import dataclasses

    h = _check_script()
    recorded = h._final_plan(1)
    plan = h.pdl_plan(recorded, False)
    got = h._pdl8_tactics(recorded)
    assert [t.name for t in h._pdl8_tactics(plan)] == [t.name for t in got]
    by = {t.name: t for t in got}
    assert len(by) == len(got)
    assert got[0].name == "m64n128_c1x1_rm_s1_st8_e4m3_bfloat16" and not got[0].pdl
    alt = h.pdl_plan(plan, True)
    assert h.pdl_plan(alt, True) == alt and h.pdl_plan(alt, False) == plan
    assert set(alt) == set(plan) == {f"{n}x{k}" for n, k in h.SHAPES}
    firsts = set()
    for nk, p in plan.items():
        assert alt[nk]["splits"] == p["splits"] and set(alt[nk]["by_m"]) == set(p["by_m"])
        for m, names in p["by_m"].items():
            assert len(names) == 1 and str(m) in {str(x) for x in h.MS}
            base, twin = by[names[0]], by[alt[nk]["by_m"][m][0]]
            assert not base.pdl and twin.pdl and dataclasses.replace(twin, pdl=False) == base
            firsts.add(base.name)
    pdl = [t for t in got if t.pdl]
    assert len(pdl) == len(firsts) + 2
    assert {t.ab_dtype for t in pdl} == {"e4m3", "e5m2"}
    assert all(h.group_of(t.to_params()).endswith(" pdl") for t in pdl)
    assert not any(h.decode_candidate(t.to_params()) for t in pdl)


def test_profile_inputs_take_the_kernels_scheme_and_pass_the_launchers_block_checks() -> None:
    """profile (for ncu, issue 27) gives a block128 kernel the block scales the launcher
    takes (a_scale (M, K/128) column-major, b_scale (ceil(N/128), K/128) row-major) and a
    per-tensor kernel one scale each."""
    import torch
    from cached_client.gemm import hopper_fp8 as launcher

    h = _check_script()
    m, n, k = 40, 300, 512
    cpu = torch.device("cpu")
    a, b, sa, sb = h.profile_inputs(torch, {"scales": "block128", "accum": "exact"}, m, n, k,
                                    cpu)
    assert a.shape == (m, k) and b.shape == (n, k) and a.dtype == torch.float8_e4m3fn
    assert sa.shape == (m, k // 128) and sa.stride() == (1, m)
    assert sb.shape == (-(-n // 128), k // 128) and sb.stride() == (k // 128, 1)
    assert float(sa.min()) >= 0.5 and float(sb.max()) < 2.0
    launcher._check_block_scales(sa, sb, m, n, k)
    _, _, sa, sb = h.profile_inputs(torch, {"accum": "exact"}, m, n, k, cpu)
    assert sa.numel() == 1 and sb.numel() == 1


def _natives():
    spec = importlib.util.spec_from_file_location(
        "bundle_natives", ROOT / "bench" / "gpu" / "bundle_natives.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_bundle_whose_runtime_or_kernel_changed_is_refused_before_loading(
        tmp_path, monkeypatch) -> None:
    """The GPU runners load a bundle's DSL runtime and kernels only with the digests its
    manifest recorded at build: a runtime unpacked from a changed .xz, a changed unpacked
    runtime and a changed kernel library are each refused, naming the file, before anything
    is opened; $CACHED_DSL_RUNTIME is set only to a runtime that matched, in a 0700
    directory of this process's own."""
    import os
    import stat
    import subprocess

    import pytest
    from cached_client.errors import IntegrityError

    nat = _natives()
    monkeypatch.delenv(nat.RUNTIME_ENV, raising=False)
    b = tmp_path / "bundle"
    (b / "kernels").mkdir(parents=True)
    (b / "kernels" / "k0.so").write_bytes(b"kernel bytes as built")
    runtime = b / nat.RUNTIME
    runtime.write_bytes(b"runtime bytes as built")
    entries = [{"name": "k0", "so": "kernels/k0.so", "symbol": "k0"}]
    manifest = {"kernels": entries, **nat.record(str(b), entries, str(runtime))}
    assert len(entries[0]["sha256"]) == 64 and len(manifest["runtime_sha256"]) == 64

    def xz_runtime(data: bytes) -> None:
        (b / (nat.RUNTIME + ".xz")).write_bytes(
            subprocess.run(["xz", "-c"], input=data, capture_output=True, check=True).stdout)

    # carried as .xz: unpacked into a private directory, checked, then named
    runtime.unlink()
    xz_runtime(b"runtime bytes as built")
    path = nat.use_runtime(str(b), manifest)
    st = os.stat(os.path.dirname(path))
    assert os.environ[nat.RUNTIME_ENV] == path and not path.startswith(str(b))
    assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
    monkeypatch.delenv(nat.RUNTIME_ENV)
    # a changed .xz, or a changed unpacked runtime in the bundle: refused, nothing named
    xz_runtime(b"runtime bytes someone swapped in")
    with pytest.raises(SystemExit, match="the bundle's manifest says .*not loading it"):
        nat.use_runtime(str(b), manifest)
    runtime.write_bytes(b"runtime bytes someone swapped in")
    with pytest.raises(SystemExit, match=f"{runtime} has sha256"):
        nat.use_runtime(str(b), manifest)
    assert nat.RUNTIME_ENV not in os.environ
    # a changed kernel: the client's loader refuses it before dlopen (IntegrityError, not
    # the OSError a dlopen of these bytes would raise)
    (b / "kernels" / "k0.so").write_bytes(b"kernel bytes someone swapped in")
    with pytest.raises(IntegrityError, match="k0.so has sha256 .* not loading it"):
        nat.load_kernels(str(b), manifest)
    # a bundle built before the digests were recorded: told to rebuild, nothing loaded
    with pytest.raises(SystemExit, match="no runtime_sha256: rebuild"):
        nat.use_runtime(str(b), {"kernels": entries})
    with pytest.raises(SystemExit, match="no sha256 for k0: rebuild"):
        nat.load_kernels(str(b), {"kernels": [{"name": "k0", "so": "kernels/k0.so",
                                                "symbol": "k0"}]})
