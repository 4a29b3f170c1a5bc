"""The FlashInfer integration on CPU (CUTE_DSL_ARCH=sm_100a): FlashInfer's own
build_and_load_cute_dsl_kernel gets mm_fp4 tactics from the daemon, other kernels go by
write-back under a lease, `cached export` fills FlashInfer's own disk cache, and uninstall()
restores FlashInfer exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import DaemonProcess, run_cli

pytest.importorskip("flashinfer")

ENV = {"CUTE_DSL_ARCH": "sm_100a", "CACHED_SM_COUNT": "148"}

# One mm_fp4 tactic built exactly as FlashInfer's runner builds it, through FlashInfer's own
# build_and_load_cute_dsl_kernel; compile_fn is counted so "compiles nothing" is observable.
MM_FP4 = """
import json, os, sys
import cutlass
from flashinfer.gemm.gemm_mm_fp4_cute_dsl import (
    _blockscaled_gemm_cache_key_files, _blockscaled_kernel_disk_name,
    _make_blockscaled_gemm_compile_fn, _mm_fp4_cache_key)
from flashinfer.gemm.kernels.dense_blockscaled_gemm_sm100 import (
    Sm100BlockScaledPersistentDenseGemmKernel)
from flashinfer.jit.cute_dsl_core import build_and_load_cute_dsl_kernel, JitSpecCuteDsl
from flashinfer.jit.cute_dsl_core import _hash_source_files
import torch
MODE = sys.argv[1]
if MODE == "client":
    from cached_client.integrations.flashinfer import cute_dsl as cf
    cf.install(os.environ["CACHED_SOCKET"])
tactic = ((128, 64), (1, 1), False, False, "sm100", None)
key = _mm_fp4_cache_key(16, tactic, True, torch.bfloat16, None, "b_ef")
name = _blockscaled_kernel_disk_name(key, 1, 148)
gemm = Sm100BlockScaledPersistentDenseGemmKernel(16, (128, 64), (1, 1), False, True, None,
                                                 b_l2_evict_first=True)
inner = _make_blockscaled_gemm_compile_fn(
    gemm, ab_cutlass_dtype=cutlass.Uint8, sf_dtype=cutlass.Float8E4M3FN,
    c_cutlass_dtype=cutlass.BFloat16, ab_assumed_align=32, swap_ab=False,
    sf_m=2, sf_n=8, sf_k=112, batch_size=1, max_active_clusters=148)
calls = []
def compile_fn():
    calls.append(1)
    return inner()
out = {"name": name}
if MODE == "plain":
    spec = JitSpecCuteDsl("mm_fp4", name, compile_fn,
                          _hash_source_files(_blockscaled_gemm_cache_key_files()))
    out["is_compiled"] = spec.is_compiled
    fn = spec.try_load()
    out["try_load"] = type(fn).__name__ if fn is not None else None
else:
    fn = build_and_load_cute_dsl_kernel("mm_fp4", name, compile_fn,
                                        extra_key_files=_blockscaled_gemm_cache_key_files())
    out["fn"] = type(fn).__name__
    out["stats"] = cf.stats()
out["compiles_here"] = len(calls)
print("RESULT " + json.dumps(out))
"""

# A FlashInfer kernel the daemon has no recipe for (FlashInfer's quantization kernels query
# the CUDA driver while compiling, so the CPU test takes its RMSNorm-gate kernel).
NORM = """
import importlib, json, os, sys, time
from cached_client.integrations.flashinfer import cute_dsl as cf
cf.install(os.environ["CACHED_SOCKET"], lease_ttl_s=float(os.environ.get("TTL", "120")))
r = importlib.import_module("flashinfer.norm.kernels.rmsnorm_sigmoid_gate")
from flashinfer.jit import cute_dsl_core
spec_cls = cute_dsl_core.JitSpecCuteDsl
original = spec_cls._export_object
def slow_export(self, path):
    if os.environ.get("HANG"):
        print("HOLDER " + str(os.getpid()), flush=True)
        time.sleep(3600)
    return original(self, path)
spec_cls._export_object = slow_export
fn = r._get_compiled(8, 8 * r.HEAD_DIM, 8 * r.HEAD_DIM, 32, 4, 1)
print("RESULT " + json.dumps({"fn": type(fn).__name__, "stats": cf.stats()}), flush=True)
"""


def _env(tmp: Path, sock: str, fi_base: Path, **extra: str) -> dict:
    return {**os.environ, **ENV, "CACHED_SOCKET": sock,
            "FLASHINFER_WORKSPACE_BASE": str(fi_base), **extra}


def _result(proc: subprocess.CompletedProcess) -> dict:
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise AssertionError(f"no result: rc={proc.returncode}\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-3000:]}")


@pytest.fixture
def fi_daemon(tmp_path):
    d = DaemonProcess(tmp_path, workers=1, extra_env=ENV)
    yield d
    d.stop()


def test_mm_fp4_from_daemon_second_process_compiles_nothing_then_export(fi_daemon, tmp_path):
    run = [sys.executable, "-c", MM_FP4]
    # each process has its own, empty FlashInfer disk cache: only the daemon can share
    first = _result(subprocess.run(run + ["client"], capture_output=True, text=True,
                                   env=_env(tmp_path, fi_daemon.socket, tmp_path / "fi1")))
    assert first["fn"] == "Function" and first["compiles_here"] == 0
    assert first["stats"] == {"daemon": 1}
    stats = fi_daemon.stats()
    assert stats["compiles"] == 1
    second = _result(subprocess.run(run + ["client"], capture_output=True, text=True,
                                    env=_env(tmp_path, fi_daemon.socket, tmp_path / "fi2")))
    assert second["compiles_here"] == 0 and second["stats"] == {"daemon": 1}
    after = fi_daemon.stats()
    assert after["compiles"] == 1 and after["hits"] == stats["hits"] + 1
    entry = next(e for e in fi_daemon.client().list() if e["family"] == "flashinfer.mm_fp4")
    assert entry["kernel_name"] == first["name"]

    # export into a plain FlashInfer's cache directory; a process without the client hits it
    plain_base = tmp_path / "plain"
    jit_dir = subprocess.run(
        [sys.executable, "-c", "from flashinfer.jit import env; print(env.FLASHINFER_JIT_DIR)"],
        capture_output=True, text=True, check=True,
        env=_env(tmp_path, fi_daemon.socket, plain_base)).stdout.strip()
    report = json.loads(run_cli("export", "--socket", fi_daemon.socket, "--flashinfer-cache",
                                jit_dir, "--family", "flashinfer.mm_fp4", "--json").stdout)
    assert report["written"] == 1 and report["skipped"] == 0
    plain = _result(subprocess.run(run + ["plain"], capture_output=True, text=True,
                                   env=_env(tmp_path, "/nonexistent", plain_base)))
    assert plain["is_compiled"] is True and plain["try_load"] == "Function"
    assert plain["compiles_here"] == 0
    meta = json.loads((Path(jit_dir) / "mm_fp4_sm100a_cute_dsl" / "meta.json").read_text())
    assert set(meta) == {"arch", "cute_dsl_version", "source_sha256"}


def test_write_back_four_processes_compile_once_and_a_dead_holder_is_replaced(fi_daemon,
                                                                             tmp_path):
    # a holder that hangs after compiling; killing it hands the lease to a waiter
    holder = subprocess.Popen(
        [sys.executable, "-c", NORM], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=_env(tmp_path, fi_daemon.socket, tmp_path / "h", HANG="1"))
    deadline = time.monotonic() + 120
    line = ""
    while time.monotonic() < deadline and not line.startswith("HOLDER"):
        line = holder.stdout.readline()
        assert line or holder.poll() is None, holder.stderr.read()[-3000:]
    procs = [subprocess.Popen([sys.executable, "-c", NORM], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=_env(tmp_path, fi_daemon.socket, tmp_path / f"w{i}"))
             for i in range(3)]
    time.sleep(6)  # the three are waiting on the holder's lease by now
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        results.append(_result(subprocess.CompletedProcess(p.args, p.returncode, out, err)))
    assert all(r["fn"] == "Function" for r in results)
    compiled = sum(r["stats"].get("write_back_compiled", 0) for r in results)
    hits = sum(r["stats"].get("write_back_hit", 0) for r in results)
    assert (compiled, hits) == (1, 2), results
    stats = fi_daemon.stats()
    assert stats["compiles"] == 0  # the daemon compiled nothing: a client did, once
    rows = [e for e in fi_daemon.client().list() if e["family"] == "flashinfer.jit"]
    assert len(rows) == 1 and rows[0]["kernel_name"].startswith("h8_")
    # and a fourth process later is a plain hit
    late = _result(subprocess.run([sys.executable, "-c", NORM], capture_output=True, text=True,
                                  env=_env(tmp_path, fi_daemon.socket, tmp_path / "late")))
    assert late["stats"] == {"write_back_hit": 1}


def test_publish_needs_the_allowlist_and_a_stalled_lease_expires(tmp_path):
    from cached_client import Client, KernelRequest, NotAllowed
    from cached_client.writeback import lease, publish

    d = DaemonProcess(tmp_path, workers=1, extra_env=ENV)
    try:
        client = d.client()
        request = KernelRequest("flashinfer.jit", {
            "module": "demo", "kernel": "k1", "tvm_ffi": True, "source_sha256": "0" * 64},
            "sm_100a", 148, 148)
        first = lease(client, request, ttl_s=1.0, wait_ms=0)
        assert first.state == "granted"
        other = Client(d.socket)  # same pid, but the lease is stalled: no renewal in 1 s
        again = lease(other, request, ttl_s=1.0, wait_ms=3000)
        assert again.state == "granted" and again.lease != first.lease
        # granted again: the refusal says why the first lease ended and who holds the kernel
        with pytest.raises(NotAllowed, match=r"has ended \(not renewed within 1s\) and was "
                                             rf"granted to pid {os.getpid()}"):
            publish(client, request, b"\x7fELF", lease=first.lease)
        with pytest.raises(Exception, match="ELF"):
            publish(client, request, b"not an object", lease=again.lease)
    finally:
        d.stop()
    # a daemon whose publish allowlist excludes us: no lease, no publish
    (tmp_path / "strict").mkdir()
    strict = DaemonProcess(tmp_path / "strict", workers=1, extra_env=ENV, extra_args=[
        "--publish-uid", "0" if os.getuid() != 0 else "12345"])
    try:
        client = strict.client()
        assert lease(client, request, wait_ms=0).state == "compile_locally"
        with pytest.raises(NotAllowed):
            publish(client, request, b"\x7fELF....")
    finally:
        strict.stop()


def test_precompile_becomes_one_prefetch_and_uninstall_restores(fi_daemon, tmp_path):
    code = textwrap.dedent("""
        import json, os, sys
        import flashinfer.gemm.gemm_base as gb
        import flashinfer.gemm.gemm_mm_fp4_cute_dsl as m
        import flashinfer.cute_dsl.utils as cu
        import flashinfer.gemm.batch_invariant.api as api
        import flashinfer.gemm.batch_invariant.tuning as tuning
        from flashinfer.jit.cute_dsl_core import JitSpecCuteDsl
        import torch

        def snapshot():
            out = {}
            for name, mod in list(sys.modules.items()):
                if name.startswith("flashinfer") and mod is not None:
                    for attr, value in list(vars(mod).items()):
                        if callable(value):
                            out[name + ":" + attr] = id(value)
            for cls in (JitSpecCuteDsl, tuning.BatchInvariantGemmRunner):
                out[cls.__name__] = sorted((k, id(v)) for k, v in vars(cls).items())
            return out

        before = snapshot()
        from cached_client.integrations.flashinfer import cute_dsl as cf
        cf.install(os.environ["CACHED_SOCKET"])
        assert gb.precompile_mm_fp4_tactics is not m.precompile_mm_fp4_tactics.__wrapped__
        saved = (cu.get_max_active_clusters, sys.modules["flashinfer.utils"].get_device_index)
        cu.get_max_active_clusters = lambda size: 148 // size   # no GPU here: the occupancy
        sys.modules["flashinfer.utils"].get_device_index = lambda d: 0  # answers of a B200
        from cached.families.flashinfer_mm_fp4 import enumerate_tactics
        tactics = enumerate_tactics(256, 1024, 7168, 16, 148)[:32]
        gb.precompile_mm_fp4_tactics(tactics, 256, 1024, 7168, True, True, torch.bfloat16,
                                     {}, "cuda:0")
        stats = cf.stats()
        patched = snapshot() != before
        cf.uninstall()
        cu.get_max_active_clusters, sys.modules["flashinfer.utils"].get_device_index = saved
        after = snapshot()
        print("RESULT " + json.dumps({"stats": stats, "patched": patched,
                                      "restored": {k: after.get(k) for k in before} == before}))
    """)
    out = _result(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                 env=_env(tmp_path, fi_daemon.socket, tmp_path / "fi")))
    assert out["patched"] and out["restored"]
    assert out["stats"] == {"prefetch_calls": 1, "prefetched": 32}
    stats = fi_daemon.stats()
    assert stats["in_flight"] + stats["compiles"] + stats["failures"] >= 1
