"""flashinfer.bi.bmm_fp8 and flashinfer.bi.mm_fp4: FlashInfer 0.7.4's batch-invariant classes
as families, compiled for sm_100a on CPU through FlashInfer's own compile code."""

from __future__ import annotations

import json
import os
import sys

import pytest
from conftest import ROOT, DaemonProcess, run_cli

os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")
pytest.importorskip("flashinfer")

from cached_client.flashinfer_names import bi_request  # noqa: E402

from cached.families import get  # noqa: E402
from cached.tools import manifests  # noqa: E402


def test_sources_match_flashinfers_meta_and_main_process_stays_light():
    import subprocess

    code = ("import sys; from cached.families import get; "
            "[get(n).source_sha256() for n in ('flashinfer.bi.bmm_fp8', 'flashinfer.bi.mm_fp4')]; "
            "print([m for m in ('torch', 'flashinfer', 'cutlass') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
    from cached_client import flashinfer_sources, identity
    from flashinfer.batch_invariant import jit

    for module in ("batch_invariant_gemm", "batch_invariant_gemm_blockscaled"):
        assert list(flashinfer_sources.module_files(module)) == jit.relative_sources(module)
    assert get("flashinfer.bi.bmm_fp8").source_sha256() == identity.flashinfer_files_source(
        tuple(jit.relative_sources("batch_invariant_gemm")))


@pytest.mark.parametrize("name,shape,options", [
    ("flashinfer.bi.bmm_fp8", (8192, 4096, 4096), {}),
    ("flashinfer.bi.bmm_fp8", (64, 256, 16384), {"dtype": "e5m2", "out_dtype": "f16"}),
    ("flashinfer.bi.mm_fp4", (8192, 4096, 4096), {}),
    ("flashinfer.bi.mm_fp4", (64, 256, 16384), {"quant": "mxfp4"}),
])
def test_plan_is_the_dispatchers_choice_per_bucket(name, shape, options):
    from flashinfer.fused_moe.utils import get_hybrid_num_tokens_buckets
    from flashinfer.gemm.batch_invariant.schedule import chunks_for, default_config

    from cached.families.flashinfer_bi import knobs_of
    family = get(name)
    requests = family.plan(shape, "sm_100a", 148, options)
    m, n, k = shape
    gemms = [r for r in requests if r.params["kind"] == "gemm"]
    in_fmt = gemms[0].params["in_fmt"]
    chunks = chunks_for(n, k, in_fmt)
    assert {r.params["chunks"] for r in requests} == {chunks}
    ours = {knobs_of(r.params) for r in gemms}
    theirs = {default_config(b, n, k, chunks, "k", 148, "sm_100", in_fmt)
              for b in set(get_hybrid_num_tokens_buckets(m)) | {m}}
    assert ours == theirs
    for r in requests:
        assert family.canonical_request(r) == r
    if chunks > 1 and any(not (c.cta_chunks or c.cluster_k > 1) for c in ours):
        assert requests[-1].params["kind"] == "fixup"


def test_warm_compiles_for_sm_100a_with_flashinfers_fingerprints(tmp_path):
    from flashinfer.batch_invariant import fingerprint

    d = DaemonProcess(tmp_path, workers=2, extra_env={"CUTE_DSL_ARCH": "sm_100a"})
    try:
        for family, shape, fp in (
            ("flashinfer.bi.bmm_fp8", "64,256,16384",
             fingerprint("bmm_fp8", N=256, K=16384, dtype="e4m3", out_dtype="bf16")),
            ("flashinfer.bi.mm_fp4", "64,4096,4096",
             fingerprint("mm_fp4", N=4096, K=4096, out_dtype="bf16", arch="sm_100")),
        ):
            out = run_cli("warm", "--socket", d.socket, "--family", family, "--arch",
                          "sm_100a", "--shape", shape, "--json")
            counts = json.loads(out.stdout)
            assert counts["failed"] == 0 and counts["compiled"] >= 1, counts
            reply = d.client().flashinfer_artifacts(family)
            # gemm kernels first: FlashInfer compiles a class's gemm before its fixup
            arts = sorted(reply.artifacts, key=lambda a: a["params"]["kind"] != "gemm")
            assert arts and {a["meta"]["fingerprint"] for a in arts} == {fp}
            for a in arts:
                assert a["symbol"] == f"{a['meta']['flashinfer_module']}_{a['kernel_name']}"
                # the integration's parser maps FlashInfer's name back to the same request
                op = a["meta"]["op"]
                req = bi_request(a["meta"]["flashinfer_module"], a["kernel_name"],
                                 (op, a["params"]["n"], a["params"]["k"]), "sm_100a", 148)
                assert req is not None and req.params == a["params"], a["kernel_name"]
        kinds = {json.loads(e["params"])["kind"] for e in d.client().list()
                 if e["family"] == "flashinfer.bi.bmm_fp8"}
        assert kinds == {"gemm", "fixup"}  # N=256, K=16384 is a split class
    finally:
        d.stop()


BMM_FP8 = "flashinfer.bi.bmm_fp8"
BLACKWELL = {"sm_100a": "sm_100", "sm_103a": "sm_103"}


def _dispatcher_kernels(manifest: manifests.Manifest, arch: str) -> int:
    """bmm_fp8 kernels of a manifest on ``arch``, counted from FlashInfer's dispatcher alone:
    one per distinct (N, K, default configuration) over the manifest's shapes and every token
    bucket of its tuner up to M, plus one split-K fixup per (N, K) class that needs one."""
    from flashinfer.fused_moe.utils import get_hybrid_num_tokens_buckets
    from flashinfer.gemm.batch_invariant.schedule import chunks_for, default_config

    gemms, fixups = set(), set()
    for _, (m, n, k) in manifest.shapes():
        chunks = chunks_for(n, k, "e4m3")
        for bucket in set(get_hybrid_num_tokens_buckets(m)) | {m}:
            cfg = default_config(bucket, n, k, chunks, "k", 148, BLACKWELL[arch], "e4m3")
            gemms.add((n, k, cfg))
            if chunks > 1 and not cfg.cta_chunks:
                fixups.add((n, k))
    return len(gemms) + len(fixups)


def test_every_manifest_warms_fp8_on_blackwell_through_the_bi_family(tmp_path):
    from flashinfer.batch_invariant import fingerprint

    shipped = sorted((ROOT / "manifests").glob("*.toml"))
    d = DaemonProcess(tmp_path, workers=2, extra_env={"CUTE_DSL_ARCH": "sm_100a"})
    try:
        # --plan-only plans on the daemon (its plan op, in a worker) and counts the kernels:
        # every family of one manifest, then the FP8 rows of the others (sm_100a only; the
        # plan is the same code for sm_103a, checked on the first)
        first = manifests.load("llama-3.1-8b")
        plan = json.loads(run_cli("warm", "--socket", d.socket, "--manifest", "llama-3.1-8b",
                                  "--plan-only", "--json").stdout)
        assert plan["pending"] == [] and plan["total"] == sum(plan["kernels"].values())
        for arch in BLACKWELL:
            expected = _dispatcher_kernels(first, arch)
            assert plan["kernels"][f"{BMM_FP8}@{arch}"] == expected > 0, arch
        text = run_cli("warm", "--socket", d.socket, "--manifest", "llama-3.1-8b",
                       "--plan-only").stdout
        for arch in BLACKWELL:
            assert f"{BMM_FP8}@{arch}" in text, text
        assert "pending" not in text, text
        for path in shipped:
            manifest = manifests.load(path)
            if manifest.model == first.model:
                continue
            plan = json.loads(run_cli("warm", "--socket", d.socket, "--manifest", str(path),
                                      "--family", BMM_FP8, "--arch", "sm_100a",
                                      "--plan-only", "--json").stdout)
            expected = _dispatcher_kernels(manifest, "sm_100a")
            assert plan["kernels"] == {f"{BMM_FP8}@sm_100a": expected} and expected > 0, path

        # real compiles: the first two planned kernels for each Blackwell target (--limit
        # counts kernels in all: one warm per target)
        for arch in BLACKWELL:
            out = run_cli("warm", "--socket", d.socket, "--manifest", "llama-3.1-8b",
                          "--family", BMM_FP8, "--arch", arch, "--limit", "2", "--json").stdout
            counts = json.loads(out.strip().splitlines()[-1])
            assert (counts["compiled"], counts["failed"], counts["total"]) == (2, 0, 2), counts
        arts = d.client().flashinfer_artifacts(BMM_FP8).artifacts
        assert len(arts) == 4 and {a["arch"] for a in arts} == set(BLACKWELL)
        llama = manifests.load("llama-3.1-8b")
        weights = {fingerprint("bmm_fp8", N=n, K=k, dtype="e4m3", out_dtype="bf16")
                   for _, (_, n, k) in llama.shapes()}
        assert {a["meta"]["fingerprint"] for a in arts} <= weights
    finally:
        d.stop()
