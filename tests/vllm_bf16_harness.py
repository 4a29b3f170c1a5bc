"""Run in .venv-vllm (vLLM 0.33.0) by test_vllm_bf16.py: vLLM's own plugin loader, logging and
layers (``ReplicatedLinear``, ``GateLinear``, ``ParallelLMHead``, their quant methods'
``process_weights_after_loading`` and ``apply``) on a CPU machine as on a CUDA device of
capability CAP with 132 SMs (only the platform's capability and SM count are patched; the
tensors are fake CUDA tensors, so shapes and dtypes propagate and no kernel runs).

Usage: python vllm_bf16_harness.py SCENARIOS, a JSON list of ``{"bi": 0|1, "cap": CAP}``:
each builds fresh layers with ``VLLM_BATCH_INVARIANT`` and the capability set so;
``CACHED_SOCKET`` and ``CACHED_DEVICE_NAME`` come from the environment. Prints
``RESULT {json}`` last: per scenario and layer,
what its weight load chose (``served``: the plan index or -1, the plan's out dtype), what its
forward ran (``ran``: ``cached.bf16_gemm``, ``vllm.linear_batch_invariant`` or the aten ops of
vLLM's default path) and its output's shape and dtype; the loaded plans (family, class, the
kernels' loaded types); the Dynamo graph of a compiled forward.
"""

from __future__ import annotations

import json
import os
import socket
import sys

scenarios = json.loads(sys.argv[1])

import torch  # noqa: E402
import vllm_cpu  # noqa: E402  (before vLLM)
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from vllm.config.logging import LoggingConfig  # noqa: E402
from vllm.logger import configure_logging  # noqa: E402

configure_logging(LoggingConfig())  # what `vllm serve` and LLM() apply in each process

from vllm.plugins import load_general_plugins  # noqa: E402

load_general_plugins()  # VLLM_PLUGINS unset: every installed plugin
vllm_cpu.capability_queries()
vllm_cpu.patch_platform(scenarios[0]["cap"], sm_count=132)  # vLLM's config asks it first

from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed import (  # noqa: E402
    init_distributed_environment,
    initialize_model_parallel,
)
from vllm.model_executor.layers import linear as vllm_linear  # noqa: E402
from vllm.model_executor.layers import vocab_parallel_embedding as vpe  # noqa: E402
from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear  # noqa: E402

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
config = VllmConfig()
config.scheduler_config.max_num_batched_tokens = 16  # the plans' buckets: 1..16
with set_current_vllm_config(config):
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(1, 1)

RAN: list[str] = []


def recording(module, name: str):
    """vLLM's own ``linear_batch_invariant`` (imported by name into ``module``), noting each
    call; it then runs (and raises on fake tensors: no Triton here)."""
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        RAN.append("vllm.linear_batch_invariant")
        return original(*args, **kwargs)

    setattr(module, name, wrapper)


recording(vllm_linear, "linear_batch_invariant")
recording(vpe, "linear_batch_invariant")


class Record(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name.startswith("cached.") or name in ("aten.mm", "aten.addmm", "aten.linear",
                                                    "aten.matmul"):
            RAN.append(name)
        return func(*args, **(kwargs or {}))


out: dict = {"plugins": sorted(m for m in sys.modules if m.startswith("cached_client")),
             "wrapped": {"linear": hasattr(vllm_linear.UnquantizedLinearMethod.apply,
                                           "__wrapped__"),
                         "lm_head": hasattr(vpe.UnquantizedEmbeddingMethod.apply,
                                            "__wrapped__")},
             "scenarios": []}
K = 512


def run(layer: torch.nn.Module, forward) -> dict:
    """vLLM's weight-load step for ``layer`` (as its model loader calls it), then one
    forward of 5 tokens, recording what ran."""
    got: dict = {}
    try:
        layer.quant_method.process_weights_after_loading(layer)
        got["served"] = getattr(layer, "_cached_bf16", None)
        got["out_dtype"] = str(getattr(layer, "_cached_bf16_out", None))
        RAN.clear()
        x = torch.empty(5, K, dtype=torch.bfloat16, device="cuda")
        try:
            with Record():
                y = forward(layer, x)
            y = y[0] if isinstance(y, tuple) else y
            got["y"] = [list(y.shape), str(y.dtype)]
        except Exception as exc:  # noqa: BLE001 -- vLLM's Triton kernel on fake tensors
            got["error"] = f"{type(exc).__name__}: {exc}"[:300]
        got["ran"] = list(RAN)
    except Exception as exc:  # noqa: BLE001 -- reported
        got["failed"] = f"{type(exc).__name__}: {exc}"[:600]
    return got


def forward_of(name: str):
    if name == "linear_fp16":
        return lambda layer, x: layer(x.to(torch.float16))
    if name == "lm_head":  # what vLLM's LogitsProcessor calls
        return lambda layer, x: layer.quant_method.apply(layer, x, bias=None)
    return lambda layer, x: layer(x)


def compiled_forward(layer: torch.nn.Module) -> dict:
    """torch.compile's front end on vLLM's forward of a served linear: Dynamo traces it into
    one graph (fullgraph: no break; dynamic M: one graph for M = 3 and 7), AOTAutograd runs
    it on fake tensors."""
    from torch._dynamo.backends.common import aot_autograd

    graphs: list = []

    def backend(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes
                       if n.op in ("call_function", "call_method")])
        return aot_autograd(fw_compiler=lambda g, _: g.forward)(gm, example_inputs)

    try:
        compiled = torch.compile(layer, backend=backend, fullgraph=True, dynamic=True)
        ys = [compiled(torch.empty(m, K, dtype=torch.bfloat16, device="cuda")) for m in (3, 7)]
        return {"graphs": graphs, "y": [[list(y.shape), str(y.dtype)] for y in ys]}
    except Exception as exc:  # noqa: BLE001 -- reported
        return {"error": f"{type(exc).__name__}: {exc}"[:1500]}


for sc in scenarios:
    os.environ["VLLM_BATCH_INVARIANT"] = str(sc["bi"])
    vllm_cpu.patch_platform(sc["cap"], sm_count=132)
    got: dict = {"layers": {}}
    with set_current_vllm_config(config), FakeTensorMode():
        with torch.device("cuda"):  # vLLM's loader builds the model under its device
            layers = {
                "linear": vllm_linear.ReplicatedLinear(K, 256, bias=True,
                                                       params_dtype=torch.bfloat16,
                                                       return_bias=False),
                "linear_n40": vllm_linear.ReplicatedLinear(K, 40, bias=False,
                                                           params_dtype=torch.bfloat16,
                                                           return_bias=False),
                "linear_fp16": vllm_linear.ReplicatedLinear(K, 256, bias=False,
                                                            params_dtype=torch.float16,
                                                            return_bias=False),
                "gate": GateLinear(K, 64, out_dtype=torch.float32, params_dtype=torch.bfloat16,
                                   return_bias=False),
                "lm_head": vpe.ParallelLMHead(1024, K, params_dtype=torch.bfloat16),
            }
        for name, layer in layers.items():
            got["layers"][name] = run(layer, forward_of(name))
        # the input embedding (a lookup) is left alone: its weight load plans nothing
        with torch.device("cuda"):
            embed = vpe.VocabParallelEmbedding(1024, K, params_dtype=torch.bfloat16)
        embed.quant_method.process_weights_after_loading(embed)
        got["embedding_served"] = getattr(embed, "_cached_bf16", None)
        served = got["layers"]["linear"].get("served")
        if isinstance(served, int) and served >= 0:
            got["compiled"] = compiled_forward(layers["linear"])
    out["scenarios"].append(got)

bf16 = sys.modules.get("cached_client.integrations.vllm.bf16")
if bf16 is not None:
    out["plans"] = [{"family": g.plan.family, "class": g.plan.choice.reduction_class,
                     "n": g.plan.key.n, "k": g.plan.key.k, "out_dtype": str(g.out_dtype),
                     "buckets": [b.upper for b in g.plan.choice.buckets],
                     "loaded": sorted({type(f).__name__ for f in g._fns})}
                    for g in bf16._gemms]
if bf16 is not None:
    from torch._library import custom_ops

    out["op_direct"] = [
        "cached::bf16_gemm" not in custom_ops.OPDEFS,
        torch._C._dispatch_has_kernel_for_dispatch_key("cached::bf16_gemm", "CUDA")]
out["cuda_initialized"] = torch.cuda.is_initialized()
sys.stdout.flush()
print("RESULT " + json.dumps(out))
