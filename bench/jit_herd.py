"""(j) JIT libraries, a herd: N processes start together, each needing the same JIT kernels.

For each library (Triton, Humming, FlashInfer's nvcc modules), N processes of one
environment (.venv plus .venv-jit: ``make setup-jit``) import the library, say they are
ready, and at one signal all build the same set of kernels through the library's own entry
point. Three ways:

- ``own``: each library's own cache alone, one per process (processes of different
  containers or users: nothing shared);
- ``shared``: each library's own cache alone, one directory for all (one user's processes
  on one node: FlashInfer and Humming take a file lock per kernel, Triton takes none);
- ``daemon``: one cache per process, the daemon's hooks installed
  (cached_client.integrations.jit: triton, humming, nvcc), a fresh daemon with an empty
  store.

Measured per way: compilations the processes ran (counted in the processes: Triton's
compilation listener, Humming's ``_compile`` calls, FlashInfer's ninja runs that built the
module's ``.so``; a ninja run that finds it up to date is not one) and wall time from the
signal until every process has every kernel. Kernels: Triton, vector adds of 2 block sizes
and fp16 ``tl.dot`` matmuls of 2 tile shapes (sm_90); Humming, ``pack_weight_kernel`` and
``unpack_weight_kernel`` for 4 and 8 bits (NVRTC, sm_90a, device facts from the H200
profile of tests/jit_harness.py); FlashInfer, ``silu_and_mul`` and ``gelu_and_mul``
(sm_90a, libcuda link stub of ``make setup-jit``).

Usage: python bench/jit_herd.py [--processes 4] [--libs triton,humming,flashinfer.nvcc]
                                [--ways own,shared,daemon]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, Daemon, save

JIT = ROOT / ".venv-jit"
CUDA_HOME = JIT / "nvidia" / "cu13"
PROFILE = {"index": 0, "sm_version": 90, "is_ppu": False}

PRELUDE = """
import json, os, sys, time
def ready_then_wait():
    print("READY", flush=True)
    sys.stdin.readline()
    return time.time()
HOOK = os.environ.get("HOOK") == "1"
"""

SCRIPTS = {"triton": PRELUDE + """
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m) + tl.load(y_ptr + offs, mask=m), mask=m)

@triton.jit
def matmul_kernel(a, b, c, M, N, K, sam, sak, sbk, sbn, scm, scn,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        x = tl.load(a + rm[:, None] * sam + (k + rk)[None, :] * sak)
        y = tl.load(b + (k + rk)[:, None] * sbk + rn[None, :] * sbn)
        acc += tl.dot(x, y)
    tl.store(c + rm[:, None] * scm + rn[None, :] * scn, acc.to(tl.float16))

misses = []
triton.knobs.compilation.listener = (
    lambda src, metadata, metadata_group, times, cache_hit: misses.append(not cache_hit))
target = GPUTarget("cuda", 90, 32)
start = ready_then_wait()
for block in (256, 1024):
    triton.compile(ASTSource(fn=add_kernel, signature={"x_ptr": "*fp32", "y_ptr": "*fp32",
                   "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                   constexprs={"BLOCK": block}), target=target)
mm = {"a": "*fp16", "b": "*fp16", "c": "*fp16",
      **{k: "i32" for k in "M N K sam sak sbk sbn scm scn".split()},
      "BM": "constexpr", "BN": "constexpr", "BK": "constexpr"}
for bm, bn, bk in ((64, 64, 32), (128, 128, 64)):
    triton.compile(ASTSource(fn=matmul_kernel, signature=mm,
                   constexprs={"BM": bm, "BN": bn, "BK": bk}), target=target)
print("RESULT " + json.dumps({"compiles": sum(misses), "done": time.time()}))
""", "humming": PRELUDE + """
import types
import torch
torch.version.cuda = "13.0"
import humming.device
humming.device.current_device._value = types.SimpleNamespace(**json.loads(os.environ["PROFILE"]))
import humming.jit.compiler as hc
from humming.kernel.pack_weight import PackWeightKernel
from humming.kernel.unpack_weight import UnpackWeightKernel
calls = []
for cls in (hc.NVRTCCompiler, hc.NVCCCompiler):      # count the compiler's runs
    original = cls.__dict__["_compile"].__func__
    def counted(c, *a, _o=original, **k):
        calls.append(1)
        return _o(c, *a, **k)
    cls._compile = classmethod(counted)
if HOOK:
    from cached_client.integrations.jit import humming as ch
    ch.install(os.environ["CACHED_SOCKET"])
start = ready_then_wait()
for bits in (4, 8):
    PackWeightKernel(num_bits=bits)
    UnpackWeightKernel(num_bits=bits)
compiles = (ch.stats().get("compiled", 0) + ch.stats().get("local", 0)) if HOOK else len(calls)
print("RESULT " + json.dumps({"compiles": compiles, "done": time.time()}))
""", "flashinfer.nvcc": PRELUDE + """
import flashinfer.jit.core as core
from flashinfer.jit.activation import gen_act_and_mul_module
built = []
original = core.run_ninja
def counted(build_dir, ninja_path, verbose, *a, **k):   # ninja built the module's .so: a compile
    so = [p for p in build_dir.glob("*.so")]
    before = {p: p.stat().st_mtime_ns for p in so}
    result = original(build_dir, ninja_path, verbose, *a, **k)
    after = {p: p.stat().st_mtime_ns for p in build_dir.glob("*.so")}
    built.append(after != before)
    return result
core.run_ninja = counted
specs = [gen_act_and_mul_module(act) for act in ("silu", "gelu")]
if HOOK:
    from cached_client.integrations.jit import nvcc as cn
    cn.install(os.environ["CACHED_SOCKET"])
start = ready_then_wait()
for spec in specs:
    spec.build_and_load()
print("RESULT " + json.dumps({"compiles": sum(built), "done": time.time()}))
"""}


def environment(lib: str, workdir: Path, sock: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "FLASHINFER_",
                                                                   "HUMMING_"))}
    env.update(PYTHONPATH=f"{ROOT / 'client'}:{JIT}", LD_LIBRARY_PATH=str(CUDA_HOME / "lib"),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               HOOK="1" if sock else "0")
    if sock:
        env["CACHED_SOCKET"] = sock
    if lib == "triton":
        env["TRITON_CACHE_DIR"] = str(workdir / "triton")
        if sock:
            env.update(TRITON_CACHE_MANAGER="triton.runtime.cache:RemoteCacheManager",
                       TRITON_REMOTE_CACHE_BACKEND="cached_client.integrations.jit.triton:DaemonBackend")
    elif lib == "humming":
        env.update(HUMMING_CACHE_DIR=str(workdir / "humming"), HUMMING_TMP_DIR=str(workdir / "tmp"),
                   HUMMING_COMPILER="nvrtc", PROFILE=json.dumps(PROFILE))
    else:
        env.update(FLASHINFER_WORKSPACE_BASE=str(workdir), FLASHINFER_CUDA_ARCH_LIST="9.0a",
                   CUDA_HOME=str(CUDA_HOME), FLASHINFER_EXTRA_LDFLAGS=f"-L{JIT / 'stubs'}")
    return env


def herd(lib: str, n: int, way: str, tmp: Path) -> dict:
    """N processes of ``lib`` released together; compiles and wall seconds."""
    daemon = Daemon(tmp, workers=1, extra_args=["--toolchain", f"bare={sys._base_executable}"]
                    ) if way == "daemon" else None
    try:
        procs = []
        for i in range(n):
            work = tmp / ("shared" if way == "shared" else f"p{i}")
            work.mkdir(exist_ok=True)
            script = tmp / f"{lib}-{i}.py"
            script.write_text(SCRIPTS[lib])
            procs.append(subprocess.Popen(
                ["nice", "-n", "10", sys.executable, str(script)],
                env=environment(lib, work, daemon.socket if daemon else None),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True))
        for proc in procs:
            for line in proc.stdout:  # type: ignore[union-attr]
                if line.startswith("READY"):
                    break
            else:
                raise RuntimeError(f"{lib} process exited before it was ready")
        start = time.time()
        for proc in procs:
            proc.stdin.write("go\n")  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
        results = []
        for proc in procs:
            out, _ = proc.communicate(timeout=3600)
            line = [x for x in out.splitlines() if x.startswith("RESULT ")]
            if proc.returncode != 0 or not line:
                raise RuntimeError(f"{lib} process failed:\n{out[-3000:]}")
            results.append(json.loads(line[-1][7:]))
        row = {"lib": lib, "way": way, "processes": n,
               "compiles": sum(r["compiles"] for r in results),
               "wall_s": round(max(r["done"] for r in results) - start, 2)}
        if daemon is not None:
            fam = daemon.stats()["families"][lib]
            row["daemon"] = {k: fam[k] for k in ("hits", "misses", "published",
                                                 "compiles_avoided")}
        return row
    finally:
        if daemon is not None:
            daemon.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--libs", default="triton,humming,flashinfer.nvcc")
    ap.add_argument("--ways", default="own,shared,daemon")
    args = ap.parse_args()
    if not (JIT / ".installed").exists():
        sys.exit("the JIT libraries are missing: make setup-jit")
    rows = []
    for lib in args.libs.split(","):
        for way in args.ways.split(","):
            with tempfile.TemporaryDirectory(prefix=f"jit-herd-{way}-") as tmp:
                row = herd(lib, args.processes, way, Path(tmp))
            print(json.dumps(row), flush=True)
            rows.append(row)
    save("jit_herd", {"command": " ".join(["python", "bench/jit_herd.py", *sys.argv[1:]]),
                      "rows": rows})


if __name__ == "__main__":
    main()
