"""Run in .venv-vllm (vLLM 0.33.0) by test_vllm_plugin.py: vLLM's own plugin loader, logging
configuration, FP8 linear-kernel selection, CLI parser and NVFP4 selection, on a CPU machine
as on a CUDA device of capability CAP (only the capability is patched; vllm_env_report §4).

Usage: python vllm_harness.py CAP SCENARIOS, SCENARIOS a JSON list of ``{"bi": 0|1, "device":
NAME|null, "backend": NAME|null}``: each selects with ``VLLM_BATCH_INVARIANT``,
``CACHED_DEVICE_NAME`` and ``--linear-backend`` set so. Prints ``RESULT {json}`` last.
"""

from __future__ import annotations

import json
import os
import sys

cap = int(sys.argv[1])
scenarios = json.loads(sys.argv[2])
START_BI = os.environ.get("VLLM_BATCH_INVARIANT", "0")

import vllm_cpu  # noqa: E402,I001  (before vLLM: its compiled extensions' stand-ins)
import torch  # noqa: E402
from vllm.config.logging import LoggingConfig  # noqa: E402
from vllm.logger import configure_logging  # noqa: E402

configure_logging(LoggingConfig())  # what `vllm serve` and LLM() apply in each process

from vllm.plugins import load_general_plugins  # noqa: E402

load_general_plugins()  # VLLM_PLUGINS unset: every installed plugin

vllm_cpu.capability_queries()

import vllm.utils.flashinfer as fu  # noqa: E402
from vllm.model_executor.kernels import linear as L  # noqa: E402
from vllm.model_executor.layers.quantization import fp8 as fp8_method  # noqa: E402
from vllm.model_executor.layers.quantization.utils.quant_utils import (  # noqa: E402
    kFp8Dynamic128Sym,
    kFp8DynamicTensorSym,
    kFp8DynamicTokenSym,
    kFp8Static128BlockSym,
    kFp8StaticChannelSym,
    kFp8StaticTensorSym,
)

vllm_cpu.patch_platform(cap)

from vllm.config import KernelConfig, VllmConfig, set_current_vllm_config  # noqa: E402

out: dict = {"plugins": sorted(m for m in sys.modules if m.startswith("cached_client")),
             "selected": []}
# (activation, weight) keys: vLLM's online fp8 (static, or dynamic per-token under batch
# invariance), FP8-dynamic checkpoints (per-token x per-channel), dynamic per-tensor; then
# block FP8 (1x128 x 128x128), whose selection in vLLM imports FlashInfer, so it runs after
# the snapshot below
LAYERS = (("static_tensor", kFp8StaticTensorSym, kFp8StaticTensorSym),
          ("dynamic_token", kFp8DynamicTokenSym, kFp8StaticTensorSym),
          ("dynamic_token_channel", kFp8DynamicTokenSym, kFp8StaticChannelSym),
          ("dynamic_tensor", kFp8DynamicTensorSym, kFp8StaticTensorSym))
# (a layer may name its (N, K); else 4096 x 4096)
BLOCK = (("block", kFp8Dynamic128Sym, kFp8Static128BlockSym),
         ("block_k4112", kFp8Dynamic128Sym, kFp8Static128BlockSym, (4096, 4112)))


def select(sc: dict, layers: tuple, got: dict) -> None:
    """vLLM's selection (and the kernel's own can_implement) for ``layers`` in scenario sc."""
    os.environ["VLLM_BATCH_INVARIANT"] = str(int(sc["bi"]))
    os.environ.pop("CACHED_DEVICE_NAME", None)
    if sc.get("device"):
        os.environ["CACHED_DEVICE_NAME"] = sc["device"]
    try:
        config = KernelConfig(linear_backend=sc["backend"]) if sc.get("backend") else KernelConfig()
    except Exception as exc:  # noqa: BLE001 -- reported
        got["config_error"] = f"{type(exc).__name__}: {exc}"[:600]
        return
    with set_current_vllm_config(VllmConfig(kernel_config=config)):
        for name, act, wkey, *shape in layers:
            wshape = shape[0] if shape else (4096, 4096)
            try:
                k = L.init_fp8_linear_kernel(
                    activation_quant_key=act, weight_quant_key=wkey,
                    input_dtype=torch.bfloat16, out_dtype=torch.bfloat16,
                    weight_shape=wshape, module_name="Fp8LinearMethod")
                got[name] = [type(k).__name__, fp8_method.fp8_scaled_mm_is_batch_invariant(k)]
            except Exception as exc:  # noqa: BLE001 -- reported
                got[name] = f"{type(exc).__name__}: {exc}"[:600]
            if "cached_client.integrations.vllm.kernel" in sys.modules:  # the kernel's own answer
                from cached_client.integrations.vllm.kernel import (
                    CachedFp8BlockScaledMMKernel as KB,
                )
                from cached_client.integrations.vllm.kernel import (
                    CachedFP8ScaledMMLinearKernel as K,
                )
                from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import (
                    FP8ScaledMMLinearLayerConfig,
                )

                lc = FP8ScaledMMLinearLayerConfig(
                    weight_quant_key=wkey, activation_quant_key=act, weight_shape=wshape,
                    input_dtype=torch.bfloat16, out_dtype=torch.bfloat16)
                got[f"can_implement {name}"] = list(K.can_implement(lc))
                got[f"can_implement_block {name}"] = list(KB.can_implement(lc))


for sc in scenarios:
    got: dict = {}
    select(sc, LAYERS, got)
    out["selected"].append(got)
out["after_fp8_selection"] = {"flashinfer_imported": "flashinfer" in sys.modules,
                              "cuda_initialized": torch.cuda.is_initialized()}
for sc, got in zip(scenarios, out["selected"], strict=True):
    if "config_error" not in got:
        select(sc, BLOCK, got)
os.environ["VLLM_BATCH_INVARIANT"] = START_BI  # the process's own, as the pins saw it
context = set_current_vllm_config(VllmConfig())
context.__enter__()  # kept referenced: closing it restores the previous config

from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402

try:
    parsed = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(
        ["--linear-backend", "cached"])
    out["cli"] = parsed.linear_backend
except SystemExit:
    out["cli"] = "refused"

try:
    out["w4a16"] = type(L.init_nvfp4_linear_kernel(use_a16=True)).__name__
except Exception as exc:  # noqa: BLE001 -- reported
    out["w4a16"] = f"{type(exc).__name__}: {exc}"[:400]

# what vLLM's FlashInfer FP8 GEMM sends to its bmm_fp8 op, on fake CUDA tensors
if hasattr(fu, "bmm_fp8"):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        backends: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "bmm_fp8" in str(func):
                self.backends.append(args[-1])
            return func(*args, **(kwargs or {}))

    try:
        with FakeTensorMode(), Record():
            a = torch.empty(8, 64, dtype=torch.float8_e4m3fn, device="cuda")
            b = torch.empty(64, 32, dtype=torch.float8_e4m3fn, device="cuda")
            s = torch.ones(1, dtype=torch.float32, device="cuda")
            fu.flashinfer_scaled_fp8_mm(a, b, s, s, torch.bfloat16)
        out["bmm_backend"] = Record.backends
    except Exception as exc:  # noqa: BLE001 -- reported
        out["bmm_backend"] = f"{type(exc).__name__}: {exc}"[:400]

# the kernel's custom op, as torch.compile traces it (fake tensors: shape and dtype only)
if "cached_client.integrations.vllm.kernel" in sys.modules:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = torch.empty(5, 64, dtype=torch.float8_e4m3fn, device="cuda")
        b = torch.empty(32, 64, dtype=torch.float8_e4m3fn, device="cuda")
        s = torch.ones(1, dtype=torch.float32, device="cuda")
        y = torch.ops.cached.fp8_gemm(a, b, s, s, 0, torch.float16)
    out["custom_op_fake"] = [list(y.shape), str(y.dtype)]
    from torch._library import custom_ops

    # registered straight with the dispatcher: a CUDA kernel, not a custom_op's composite
    out["custom_op_direct"] = [
        "cached::fp8_gemm" not in custom_ops.OPDEFS,
        torch._C._dispatch_has_kernel_for_dispatch_key("cached::fp8_gemm", "CUDA")]

out["flashinfer_imported"] = "flashinfer" in sys.modules
out["cuda_initialized"] = torch.cuda.is_initialized()

# where the client's lines go (issue 24): CACHED_HARNESS_SPEAK is the daemon's pid; FlashInfer
# (vLLM's pin) builds two real mm_fp4 kernels through the plugin's hook, the first answered
# unknown_toolchain by a daemon with no toolchain of this environment, the second while the
# daemon is SIGSTOPped (DaemonSilent, the breaker) after serving began (the monitor)
if os.environ.get("CACHED_HARNESS_SPEAK"):
    import signal
    import time

    import cutlass
    from cached_client import monitor
    from cached_client.integrations.flashinfer import cute_dsl as cf
    from cached_client.integrations.vllm import state as vllm_state
    from flashinfer.gemm.gemm_mm_fp4_cute_dsl import (
        _blockscaled_gemm_cache_key_files,
        _blockscaled_kernel_disk_name,
        _make_blockscaled_gemm_compile_fn,
        _mm_fp4_cache_key,
    )
    from flashinfer.gemm.kernels.dense_blockscaled_gemm_sm100 import (
        Sm100BlockScaledPersistentDenseGemmKernel,
    )
    from flashinfer.jit.cute_dsl_core import build_and_load_cute_dsl_kernel

    def build(tile):
        tactic = (tile, (1, 1), False, False, "sm100", None)
        name = _blockscaled_kernel_disk_name(
            _mm_fp4_cache_key(16, tactic, True, torch.bfloat16, None, "b_ef"), 1, 148)
        gemm = Sm100BlockScaledPersistentDenseGemmKernel(16, tile, (1, 1), False, True, None,
                                                         b_l2_evict_first=True)
        compile_fn = _make_blockscaled_gemm_compile_fn(
            gemm, ab_cutlass_dtype=cutlass.Uint8, sf_dtype=cutlass.Float8E4M3FN,
            c_cutlass_dtype=cutlass.BFloat16, ab_assumed_align=32, swap_ab=False, sf_m=2,
            sf_n=8, sf_k=112, batch_size=1, max_active_clusters=148)
        fn = build_and_load_cute_dsl_kernel("mm_fp4", name, compile_fn,
                                            extra_key_files=_blockscaled_gemm_cache_key_files())
        return name, type(fn).__name__

    pid = int(os.environ["CACHED_HARNESS_SPEAK"])
    speak: dict = {"installed": cf.installed(), "first": build((128, 64))}
    import vllm.v1.worker.gpu_worker as gpu_worker

    speak["worker_wrapped"] = hasattr(gpu_worker.Worker.compile_or_warm_up_model,
                                      "__wrapped__")
    monitor.serving(vllm_state.daemon().live)  # what the wrapped warm-up does as it returns
    os.kill(pid, signal.SIGSTOP)
    try:
        speak["second"] = build((128, 128))
    finally:
        os.kill(pid, signal.SIGCONT)
    speak["outside"] = monitor.counts()
    d, started = vllm_state.daemon(), time.monotonic()
    while d.hello is None and time.monotonic() - started < 60:
        time.sleep(0.1)
    time.sleep(1.0)  # the prober's report, right after its answer
    speak["usable_again"] = d.hello is not None
    speak["stats"] = cf.stats()
    out["speak"] = speak
sys.stdout.flush()
print("RESULT " + json.dumps(out))
