"""Processes of an inference environment that compile JIT kernels with the daemon's hooks
(issue 15): real Triton, Humming and FlashInfer compiles on this CPU machine.

Environments: ``MAIN`` (.venv: torch 2.13 CPU, FlashInfer 0.7.4, TVM-FFI 0.1.15, DSL 4.8.1)
and ``VLLM`` (.venv-vllm: vLLM 0.33.0's pins, FlashInfer 0.7.2.post1, TVM-FFI 0.1.11, DSL
4.8.0): two toolchains. Both get the JIT libraries from ``.venv-jit`` (``make setup-jit``:
Triton, Humming and the CUDA toolkit's compiler wheels, requirements-jit.txt) on their path,
with the client package: the daemon package is never on an inference process's path.

What these machines lack, and what stands in (each said where it is used):

- **no CUDA driver**: FlashInfer's modules link with ``-lcuda``; the CUDA toolkit's own
  ``lib64/stubs/libcuda.so`` is a link-time stand-in for exactly that, and no wheel ships
  it, so ``make setup-jit`` builds the same thing (an empty ``libcuda.so`` with soname
  ``libcuda.so.1``) into ``.venv-jit/stubs``, given to FlashInfer through its own
  ``FLASHINFER_EXTRA_LDFLAGS``. The module does not need libcuda to load (it links
  ``--as-needed``; its NEEDED list is libcudart only), so it loads here with TVM-FFI.
- **no GPU**: Triton compiles for a target given explicitly (``triton.compile(...,
  target=GPUTarget("cuda", 90, 32))``: the driver is asked nothing); FlashInfer for the
  arch list of ``FLASHINFER_CUDA_ARCH_LIST`` (its own variable); Humming reads three
  device facts while it compiles, from the driver, with no override: they come from
  :data:`HUMMING_DEVICE_PROFILE` (DESIGN.md rule 1: device facts may come from a device
  profile), see there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from conftest import ROOT

MAIN = sys.executable
VLLM = str(ROOT / ".venv-vllm" / "bin" / "python")
JIT = ROOT / ".venv-jit"
CUDA_HOME = JIT / "nvidia" / "cu13"
STUBS = JIT / "stubs"

HUMMING_DEVICE_PROFILE = {"index": 0, "sm_version": 90, "is_ppu": False}
"""The device facts Humming's compile path reads, for an H200 (sm 9.0): ``index`` (the key of
its per-device instance cache), ``sm_version`` (the compile target: Humming adds ``a``,
``sm_90a``) and ``is_ppu`` (whether the part is a PPU: False for NVIDIA GPUs; True adds
``-DUSE_PPU=1``). Humming reads them from the CUDA driver (``humming.device.current_device``),
which this machine does not have, so a test process sets that object's value from this
profile before Humming compiles; and ``torch.version.cuda = "13.0"`` (the CUDA major Humming
picks its toolkit by; the CPU torch has none). Nothing else of the device is read on this
path (the kernel's launch, which reads more, needs a GPU and is not run)."""

PRELUDE = """
import json, os, sys
def ready_then_wait():
    print("READY", flush=True)
    sys.stdin.readline()
def result(**out):
    print("RESULT " + json.dumps(out), flush=True)
"""

TRITON = PRELUDE + """
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m) + tl.load(y_ptr + offs, mask=m), mask=m)

seen = []
triton.knobs.compilation.listener = (
    lambda src, metadata, metadata_group, times, cache_hit: seen.append(cache_hit))
ready_then_wait()
src = ASTSource(fn=add_kernel, signature={"x_ptr": "*fp32", "y_ptr": "*fp32",
                "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}, constexprs={"BLOCK": 1024})
kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32))
from cached_client.integrations.jit import triton as ct
result(stats=ct.stats(), triton_cache_hit=seen, name=kernel.name,
       cubin=len(kernel.asm["cubin"]), hash=kernel.hash)
"""

HUMMING = PRELUDE + """
import types
import torch
torch.version.cuda = "13.0"                       # the profile: see HUMMING_DEVICE_PROFILE
import humming.device
humming.device.current_device._value = types.SimpleNamespace(**json.loads(os.environ["PROFILE"]))
from humming.kernel.pack_weight import PackWeightKernel
from humming.utils.cubin import get_cubin_kernel_names
from cached_client.integrations.jit import humming as ch
ch.install(os.environ["CACHED_SOCKET"])
ready_then_wait()
kernel = PackWeightKernel(num_bits=4)             # Humming's own runtime: prepare -> compile
result(stats=ch.stats(), cubin=kernel.kernel_filename,
       names=get_cubin_kernel_names(kernel.kernel_filename),
       cubin_sha256=__import__("hashlib").sha256(open(kernel.kernel_filename, "rb").read()
                                                 ).hexdigest())
"""

FLASHINFER = PRELUDE + """
from flashinfer.jit.activation import gen_act_and_mul_module
from cached_client.integrations.jit import nvcc as cn
cn.install(os.environ["CACHED_SOCKET"])
if os.environ.get("AOT_DIR"):   # FlashInfer's data/aot directory, pointed at the test's
    from flashinfer.jit import env as jit_env
    jit_env.FLASHINFER_AOT_DIR = __import__("pathlib").Path(os.environ["AOT_DIR"])
spec = gen_act_and_mul_module("silu")
ready_then_wait()
module = spec.build_and_load()
result(stats=cn.stats(), has_fn=hasattr(module, "silu_and_mul"),
       built_here=spec.jit_library_path.exists(), so=str(spec.jit_library_path))
"""

SCRIPTS = {"triton": TRITON, "humming": HUMMING, "flashinfer.nvcc": FLASHINFER}


def environment(family: str, sock: str, workdir: Path, python: str = MAIN,
                **extra: str) -> dict:
    """A process of the environment of ``python`` (its ``bin`` first on PATH, as activated:
    FlashInfer runs the ``ninja`` installed there): the client package and the JIT
    libraries on its path, the library's own cache in ``workdir`` (a fresh one per process:
    a process of another container), the daemon at ``sock``. LD_LIBRARY_PATH has the CUDA
    runtime wheel's ``lib`` (the modules FlashInfer builds need libcudart.so.13; Humming
    0.1.19's NVRTC helper needs it to find NVRTC's builtins, fixed in 0.1.20)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "FLASHINFER_",
                                                                   "HUMMING_"))}
    env.update(PYTHONPATH=f"{ROOT / 'client'}:{JIT}", CACHED_SOCKET=sock,
               LD_LIBRARY_PATH=str(CUDA_HOME / "lib"),
               PATH=f"{Path(python).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    workdir.mkdir(parents=True, exist_ok=True)
    if family == "triton":
        env.update(TRITON_CACHE_DIR=str(workdir / "triton"),
                   TRITON_CACHE_MANAGER="triton.runtime.cache:RemoteCacheManager",
                   TRITON_REMOTE_CACHE_BACKEND="cached_client.integrations.jit.triton:DaemonBackend")
    elif family == "humming":
        env.update(HUMMING_CACHE_DIR=str(workdir / "humming"), HUMMING_TMP_DIR=str(workdir / "tmp"),
                   HUMMING_COMPILER="nvrtc", PROFILE=json.dumps(HUMMING_DEVICE_PROFILE))
    elif family == "flashinfer.nvcc":
        env.update(FLASHINFER_WORKSPACE_BASE=str(workdir), FLASHINFER_CUDA_ARCH_LIST="9.0a",
                   CUDA_HOME=str(CUDA_HOME), FLASHINFER_EXTRA_LDFLAGS=f"-L{STUBS}")
    env.update(extra)
    return env


def run_together(family: str, sock: str, workdirs: list[Path], python: str = MAIN,
                 timeout: float = 600, **extra: str) -> list[dict]:
    """One process per work directory, all started, released together once every one has
    imported its libraries (so they miss at the same moment); their RESULTs, in order."""
    procs = []
    for w in workdirs:
        env = environment(family, sock, w, python, **extra)
        script = w / "run.py"  # a file: Triton reads a kernel's source from its file
        script.write_text(SCRIPTS[family])
        procs.append(subprocess.Popen(
            [python, str(script)], env=env, cwd=str(w), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs: list[list[str]] = [[] for _ in procs]
    deadline = time.monotonic() + timeout
    try:
        for proc, log in zip(procs, logs, strict=True):
            for line in proc.stdout:  # type: ignore[union-attr]
                log.append(line)
                if line.startswith("READY"):
                    break
            else:
                raise AssertionError(f"process exited before READY: {''.join(log)[-3000:]}")
        for proc in procs:
            proc.stdin.write("go\n")  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
        out = []
        for proc, log in zip(procs, logs, strict=True):
            rest, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            log.append(rest)
            text = "".join(log)
            lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
            assert proc.returncode == 0 and lines, text[-4000:]
            out.append(json.loads(lines[-1][len("RESULT "):]))
        return out
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
