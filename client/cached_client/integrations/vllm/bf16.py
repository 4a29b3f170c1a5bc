"""vLLM's unquantized BF16 GEMMs on the daemon's ``cached.hopper_bf16`` under
``VLLM_BATCH_INVARIANT=1``.

vLLM 0.33.0 runs every unquantized linear (``UnquantizedLinearMethod.apply``: a BF16 model's
qkv/o/gate_up/down, and the MoE router gate, whose ``GateLinear`` falls back to
``ReplicatedLinear.forward`` under batch invariance) and the lm_head
(``UnquantizedEmbeddingMethod.apply`` on a ``ParallelLMHead``) through
``linear_batch_invariant`` -> Triton ``matmul_persistent`` on every CUDA device.
:func:`attach_linear` and :func:`attach_embedding` (the plugin's import hooks) wrap those two
methods:

* ``process_weights_after_loading`` plans and loads the layer's (N, K) once, at weight load
  (one plan per (N, K, out dtype), shared by the layers of that shape), and checks there
  what the plan trusts on every call: bfloat16 (N, K) row-major weight on a CUDA sm_90a
  device, N and K multiples of 16, the daemon serving the family. The layer then holds the
  plan's index (``layer._cached_bf16``); -1 keeps vLLM's kernel for that layer, for good.
* ``apply`` runs ``torch.ops.cached.bf16_gemm`` (a torch op with a fake impl: torch.compile
  puts it into the graph, CUDA graphs capture it; the loaded plan picks the bucket of M
  inside the op, so a compiled graph never freezes it) and adds the bias after. The router
  gate's float32 logits come out of the GEMM in float32 (the plan's out dtype).

Whatever the daemon cannot serve (no batch invariance, another arch, no daemon, a shape or
dtype the family refuses, a plan that fails to load) keeps vLLM's own batch-invariant kernel
for that layer, logged once per reason through vLLM's logger; a served layer never runs
another class's kernel for any M (one class for every bucket; M above the plan's largest
bucket runs the last bucket's tactic, same class).
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import Any

import torch
from vllm import envs
from vllm.logger import init_logger
from vllm.platforms import current_platform

from cached_client.gemm import plan as gemm_plan

from .state import ARCH_OF_CAPABILITY, capability, daemon, device_name

logger = init_logger("vllm.cached")

FAMILY = gemm_plan.HOPPER_BF16_FAMILY
ARCH = "sm_90a"
ATTR = "_cached_bf16"  # on a layer: the op's plan index (>= 0), or -1: vLLM's kernel
OUT_ATTR = "_cached_bf16_out"  # on a served layer: the plan's output dtype
_GATE_MODULE = "vllm.model_executor.layers.fused_moe.router.gate_linear"
_lock = threading.Lock()
_index: dict[tuple, int] = {}  # (N, K, out dtype, device) -> index into _gemms
_gemms: list[Any] = []  # the op's plan table (index -> loaded plan)


EVERY = "BF16 GEMMs (unquantized linears, router gates, the lm_head)"


def _keep(what: str, why: str, warn: bool = False) -> int:
    """Log once per (what, why) that ``what`` stays on vLLM's kernel; -1."""
    log = logger.warning_once if warn else logger.info_once
    log("cached: VLLM_BATCH_INVARIANT=1: %s on vLLM's batch-invariant kernel "
        "(matmul_persistent): %s", what, why)
    return -1


def _out_dtype(layer: torch.nn.Module) -> torch.dtype:
    """bfloat16, or float32 for a router gate that asks for float32 logits."""
    gate = sys.modules.get(_GATE_MODULE)
    cls = getattr(gate, "GateLinear", None)
    if cls is not None and isinstance(layer, cls) and layer.out_dtype == torch.float32:
        return torch.float32
    return torch.bfloat16


def _max_m() -> int:
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    scheduler = getattr(config, "scheduler_config", None)
    tokens = getattr(scheduler, "max_num_batched_tokens", None)
    return max(1, int(tokens)) if tokens else gemm_plan.DEFAULT_MAX_M


def serve(layer: torch.nn.Module, what: str) -> int:
    """The op's plan index for ``layer``'s weight, planned and loaded now (shared by every
    layer of that (N, K) and out dtype); -1 where vLLM's kernel stays, with the reason
    logged once. ``what`` names the layers in the log ("BF16 linears", "the lm_head")."""
    if not envs.VLLM_BATCH_INVARIANT:
        return -1
    if not current_platform.is_cuda():
        return _keep(EVERY, "not a CUDA device")
    cap = capability()
    arch = ARCH_OF_CAPABILITY.get(cap or 0)
    if arch != ARCH:
        return _keep(EVERY, f"{FAMILY} serves {ARCH} (capability 90), not capability {cap}")
    d = daemon()
    if d.hello is None:
        return _keep(EVERY, d.reason)
    if FAMILY not in d.hello.families:
        return _keep(EVERY, f"the daemon at {d.socket} does not serve {FAMILY}")
    weight = layer.weight
    if weight.dtype != torch.bfloat16 or weight.dim() != 2:
        return _keep(what, f"{FAMILY} serves bfloat16 2-D weights, not {weight.dtype} "
                           f"{tuple(weight.shape)}")
    n, k = weight.shape
    if n % 16 or k % 16:
        return _keep(f"{what} of N={n} K={k}", "the family needs N and K multiples of 16")
    if not weight.is_cuda or not weight.is_contiguous():
        return _keep(f"{what} of N={n} K={k}", "the weight is not a row-major (N, K) CUDA "
                                               "tensor")
    out = _out_dtype(layer)
    key = (n, k, out, str(weight.device))
    with _lock:
        if key in _index:
            return _index[key]
    try:
        plan = gemm_plan.plan_gemm(
            d.client, n, k, arch=arch, ab_dtype="bf16",
            out_dtype=str(out).replace("torch.", ""),
            sm_count=current_platform.num_compute_units(), device=device_name(),
            batch_invariant=True, max_m=_max_m())
        loaded = plan.load(d.client, weight.device)
    except Exception as exc:  # noqa: BLE001 -- any failure keeps vLLM's kernel, never the worker's
        return _keep(f"{what} of N={n} K={k}", f"no plan ({type(exc).__name__}: {exc})",
                     warn=True)
    logger.info("cached: VLLM_BATCH_INVARIANT=1: %s of N=%d K=%d on %s from the daemon at "
                "%s: %s", what, n, k, FAMILY, d.socket, plan.describe())
    with _lock:
        if key not in _index:
            _gemms.append(loaded)
            _index[key] = len(_gemms) - 1
        return _index[key]


def _served(layer: torch.nn.Module, what: str) -> None:
    index = serve(layer, what)
    setattr(layer, ATTR, index)
    if index >= 0:
        setattr(layer, OUT_ATTR, _gemms[index].out_dtype)


def _gemm(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    weight = layer.weight
    out = torch.ops.cached.bf16_gemm(x.reshape(-1, x.shape[-1]).contiguous(), weight,
                                     getattr(layer, ATTR), getattr(layer, OUT_ATTR))
    if bias is not None:
        out.add_(bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def _wrap(cls: type, what: str, only: Any = None) -> bool:
    """Wrap ``cls``'s ``process_weights_after_loading`` and ``apply`` (once); ``only``: a
    predicate on the layer (the lm_head, not the input embedding). Whether it wrapped."""
    load, apply = cls.process_weights_after_loading, cls.apply
    if getattr(apply, "__wrapped__", None) is not None:
        return False

    @functools.wraps(load)
    def process_weights_after_loading(self: Any, layer: torch.nn.Module) -> None:
        load(self, layer)
        if only is None or only(layer):
            _served(layer, what)

    @functools.wraps(apply)
    def apply_(self: Any, layer: torch.nn.Module, x: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        if getattr(layer, ATTR, -1) < 0 or x.dtype != torch.bfloat16:
            return apply(self, layer, x, bias)
        return _gemm(layer, x, bias)

    cls.process_weights_after_loading = process_weights_after_loading
    cls.apply = apply_
    return True


def attach_linear(module: Any) -> list[str]:
    """``vllm.model_executor.layers.linear``: unquantized linears (and router gates)."""
    done = _wrap(module.UnquantizedLinearMethod, "BF16 linears")
    return ["BF16 linears on " + FAMILY] if done else []


def attach_embedding(module: Any) -> list[str]:
    """``vllm.model_executor.layers.vocab_parallel_embedding``: the lm_head (a
    ``ParallelLMHead``; the input embedding is a lookup, left alone)."""
    head = module.ParallelLMHead
    done = _wrap(module.UnquantizedEmbeddingMethod, "the lm_head",
                 only=lambda layer: isinstance(layer, head))
    return ["the lm_head on " + FAMILY] if done else []


# -- the op ------------------------------------------------------------------------------------
# Registered straight with the dispatcher (as kernel.py registers cached::fp8_gemm), not through
# torch.library.custom_op, whose Python dispatch costs several times more per call where the
# op runs from the host (graphs that are not captured: prefills past the capture sizes, the
# lm_head outside the compiled forward).

_lib = torch.library.Library("cached", "FRAGMENT")  # kept referenced: the op lives with it
_lib.define("bf16_gemm(Tensor a, Tensor b, int plan, ScalarType out_dtype) -> Tensor")


def _bf16_gemm(a: torch.Tensor, b: torch.Tensor, plan: int,
               out_dtype: torch.dtype) -> torch.Tensor:
    """C (M, N) = a (M, K) @ b (N, K)^T by the loaded plan ``plan`` (checked at weight load:
    b is the plan's bfloat16 weight; a bfloat16, row-major, on b's device)."""
    if a.shape[0] == 0:
        return a.new_empty((0, b.shape[0]), dtype=out_dtype)
    return _gemms[plan].run(a, b)


def _bf16_gemm_fake(a: torch.Tensor, b: torch.Tensor, plan: int,
                    out_dtype: torch.dtype) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


_lib.impl("bf16_gemm", _bf16_gemm, "CUDA")
torch.library.register_fake("cached::bf16_gemm", _bf16_gemm_fake, lib=_lib)
