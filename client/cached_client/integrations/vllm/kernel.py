"""vLLM's side of the plugin: a daemon-backed FP8 scaled-mm linear kernel, and vLLM #62192's
batch-invariance pins on versions that lack them.

Imported only by :mod:`cached_client.integrations.vllm.plugin`'s import hooks, once
vLLM's linear-kernel registry (``vllm.model_executor.kernels.linear``) has been imported, so it may
import vLLM and torch. What :func:`attach_linear` changes in vLLM:

1. ``CachedFP8ScaledMMLinearKernel`` goes first in the CUDA FP8 list
   (``_POSSIBLE_FP8_KERNELS``) and ``CachedFp8BlockScaledMMKernel`` first in the CUDA block
   FP8 list (``_POSSIBLE_FP8_BLOCK_KERNELS``); both are the ``--linear-backend`` value ``cached``
   (``_LINEAR_BACKEND_KERNEL_MAP``; the plugin adds the name to
   ``KernelConfig.linear_backend``). Its ``is_supported`` says yes only when asked for
   (``--linear-backend cached``), or under ``VLLM_BATCH_INVARIANT=1`` where the daemon holds
   a certification of the family with 0 differing rows for this device; otherwise vLLM's
   own choice stands.
2. ``fp8_scaled_mm_is_batch_invariant`` (imported by name into vLLM's FP8 linear methods)
   recognises the class, so under batch invariance FP8 linears run FP8 GEMMs from the daemon
   instead of a BF16 dequant.
3. Under ``VLLM_BATCH_INVARIANT=1``, on a vLLM whose source lacks vLLM #62192's pins: W4A16
   NVFP4 linears on ``HummingNvFp4LinearKernel`` (:func:`attach_linear`) and FlashInfer's FP8
   bmm on the ``cutlass`` backend instead of ``auto``
   (:func:`cached_client.integrations.vllm.plugin.attach_flashinfer_utils`).
"""

from __future__ import annotations

import inspect
import sys
import threading
from typing import Any

import torch
from vllm import envs
from vllm.logger import init_logger
from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import (
    Fp8BlockScaledMMLinearKernel,
)
from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import (
    FP8ScaledMMLinearKernel,
    FP8ScaledMMLinearLayerConfig,
)
from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
from vllm.platforms import current_platform

from cached_client.gemm import plan as gemm_plan
from cached_client.gemm import policy

from .state import ARCH_OF_CAPABILITY, DEVICE_NAME_ENV, daemon, device_name
from .state import capability as _capability

logger = init_logger("vllm.cached")

BACKEND = "cached"
ACCUMULATION_ENV = gemm_plan.ACCUMULATION_ENV
QUANTIZATION = "fp8_w8a8"
BLOCK = 128  # block FP8: activation groups (1, BLOCK), weight blocks (BLOCK, BLOCK)
_lock = threading.Lock()
_certified: dict[tuple[str, str, str | None], dict | None] = {}
_plans: dict[gemm_plan.PlanKey, Any] = {}  # loaded plans, shared by layers of one shape
_gemms: list[Any] = []  # the custom op's plan table (index -> loaded plan)


def _daemon() -> Any:
    return daemon()


def _asked() -> bool:
    from vllm.model_executor.kernels.linear import _get_linear_backend

    return _get_linear_backend(quantization=QUANTIZATION) == BACKEND


def certification(family: str, arch: str, device: str | None) -> dict | None:
    """A 0-row certification of ``family`` on ``device`` (``cached certify``'s records in
    the daemon), asked once per process; None without one (or without a device name)."""
    key = (family, arch, device)
    with _lock:
        if key in _certified:
            return _certified[key]
    found = None
    daemon = _daemon()
    if device is not None and daemon.client is not None:
        for record in policy.certifications(daemon.client, family):
            if (record.get("device") == device and record.get("arch") == arch
                    and policy.rows_all_zero(record.get("rows_differing"))):
                found = record
                break
    with _lock:
        _certified[key] = found
    return found


def _family(arch: str) -> tuple[str | None, str]:
    try:
        return gemm_plan.family_for(arch), ""
    except gemm_plan.PlanUnavailable as exc:
        logger.info_once("cached: not offered on %s: %s", arch, str(exc))
        return None, str(exc)


def scale_scheme(c: FP8ScaledMMLinearLayerConfig, arch: str | None
                 ) -> tuple[str | None, str | None]:
    """(the family's scale scheme for the layer, None) or (None, why not): per-tensor
    weight and activation scales -> ``"tensor"`` (the activation's static, or dynamic
    without batch invariance: a dynamic per-tensor scale is an amax over every row); a
    per-token activation with a per-channel or per-tensor weight -> ``"token"`` (the
    FP8-dynamic checkpoints; a per-tensor weight scale is expanded to N values at load),
    on sm_90a only (cached.hopper_fp8)."""
    w, a = c.weight_quant_key.scale, c.activation_quant_key.scale
    if w.group_shape.is_per_tensor() and a.group_shape.is_per_tensor():
        if envs.VLLM_BATCH_INVARIANT and not a.static:
            return None, ("a dynamic per-tensor activation scale is an amax over every row "
                          "(not batch invariant): needs static or per-token activation scales")
        return "tensor", None
    if a.group_shape.is_per_token() and (w.group_shape.is_per_channel()
                                         or w.group_shape.is_per_tensor()):
        if arch != "sm_90a":
            return None, (f"per-token activation scales are served on sm_90a "
                          f"({gemm_plan.HOPPER_FAMILY}), not on {arch}")
        return "token", None
    return None, ("serves per-tensor weight and activation scales, or per-token activation "
                  "with per-channel (or per-tensor) weight scales; not weight "
                  f"{tuple(w.group_shape)} x activation {tuple(a.group_shape)} groups")


class CachedFP8ScaledMMLinearKernel(FP8ScaledMMLinearKernel):
    """FP8 W8A8 linear on the project's batch-invariant GEMMs, served by the cached daemon:
    ``cached.hopper_fp8`` on sm_90a (per-tensor scales, and per-token activation x
    per-channel weight scales: :func:`scale_scheme`), FlashInfer's FP8 batch-invariant
    class (per-tensor) on SM100+ where this environment's FlashInfer has it."""

    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        if not current_platform.is_cuda():
            return False, "requires CUDA"
        cc = compute_capability if compute_capability is not None else _capability()
        arch = ARCH_OF_CAPABILITY.get(cc)
        if arch is None:
            return False, (f"serves capability 90 ({gemm_plan.HOPPER_FAMILY}) and 100/103/107 "
                           f"({gemm_plan.FLASHINFER_BI_FAMILY}), not {cc}")
        family, why = _family(arch)
        if family is None:
            return False, why
        daemon = _daemon()
        if daemon.hello is None:
            return False, f"no live cached daemon ({daemon.reason})"
        if family not in daemon.hello.families:
            return False, f"the daemon at {daemon.socket} does not serve {family}"
        if _asked():
            logger.info_once("cached: FP8 linears run %s from the daemon at %s "
                             "(--linear-backend %s)", family, daemon.socket, BACKEND,
                             scope="global")
            return True, None
        if not envs.VLLM_BATCH_INVARIANT:
            return False, f"used under VLLM_BATCH_INVARIANT=1 or with --linear-backend {BACKEND}"
        device = device_name()
        record = certification(family, arch, device)
        if record is None:
            logger.info_once(
                "cached: %s is not certified on %s (no 0-row record from `cached certify` in "
                "the daemon at %s); FP8 linears keep vLLM's kernel (--linear-backend %s to use "
                "it anyway)", family, device or "this device (name unknown: set "
                f"{DEVICE_NAME_ENV})", daemon.socket, BACKEND, scope="global")
            return False, f"{family} is not certified on {device}: run `cached certify`"
        logger.info_once(
            "cached: VLLM_BATCH_INVARIANT=1: FP8 linears run %s from the daemon at %s "
            "(certified on %s: 0 rows differ at N=%s K=%s, %s)", family, daemon.socket,
            device, record.get("n"), record.get("k"), record.get("toolchain", "")[:12] or "-",
            scope="global")
        return True, None

    @classmethod
    def can_implement(cls, c: FP8ScaledMMLinearLayerConfig) -> tuple[bool, str | None]:
        scheme, why = scale_scheme(c, ARCH_OF_CAPABILITY.get(_capability()))
        if scheme is None:
            return False, why
        n, k = c.weight_shape
        if n % 16 or k % 16:
            return False, f"needs N and K multiples of 16, got N={n} K={k}"
        if c.out_dtype not in (torch.bfloat16, torch.float16, None):
            return False, f"outputs bfloat16 or float16, not {c.out_dtype}"
        return True, None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Load the plan of this layer's shape (shared by every layer of that shape): one
        ``prefetch`` and a ``get`` per tactic, at model load."""
        from vllm.model_executor.utils import replace_parameter

        weight = layer.weight  # (K, N): the transposed view of the (N, K) checkpoint weight
        if not weight.t().is_contiguous():
            replace_parameter(layer, "weight", weight.t().contiguous().t())
            weight = layer.weight
        k, n = weight.shape
        scheme, why = scale_scheme(self.config, ARCH_OF_CAPABILITY.get(_capability()))
        if scheme is None:
            raise ValueError(f"cached: layer of N={n} K={k}: {why}")
        if scheme == "token":  # one fp32 scale per weight row, contiguous
            ws = layer.weight_scale
            if ws.numel() not in (1, n):
                raise ValueError(f"cached: per-channel weight scales of N={n} K={k} hold "
                                 f"{ws.numel()} values, not 1 or {n}")
            replace_parameter(layer, "weight_scale",
                              ws.reshape(-1).to(torch.float32).expand(n).contiguous())
        self._gemm_index = load_plan(n, k, weight.dtype, self.config.out_dtype or torch.bfloat16,
                                     weight.device, scales=scheme,
                                     accumulation=gemm_plan.accumulation_from_env())
        check_weight(self._gemm_index, weight.t(), layer.weight_scale.reshape(-1))

    def apply_scaled_mm(self, *, A: torch.Tensor, B: torch.Tensor, out_dtype: torch.dtype,
                        As: torch.Tensor, Bs: torch.Tensor, bias: torch.Tensor | None,
                        output_shape: list) -> torch.Tensor:
        out = torch.ops.cached.fp8_gemm(A, B.t(), As.reshape(-1), Bs.reshape(-1),
                                        self._gemm_index, out_dtype)
        if bias is not None:
            out.add_(bias)
        return out.view(*output_shape)


class CachedFp8BlockScaledMMKernel(Fp8BlockScaledMMLinearKernel):
    """Block FP8 W8A8 linear (DeepSeek-V3 / Qwen3-FP8: 128x128 weight blocks, dynamic 1x128
    activation groups) on ``cached.hopper_fp8``'s block128 class
    (``k128.prom128.s1.fixed.block128``), sm_90a only. Offered when
    :class:`CachedFP8ScaledMMLinearKernel` is (its ``is_supported``). The activation scales
    are quantized column-major (M, K/128), as vLLM's CUTLASS block kernel asks for; the
    weight's block scales are (ceil(N/128), K/128) fp32 row-major."""

    def __init__(self, config: FP8ScaledMMLinearLayerConfig) -> None:
        super().__init__(config)
        act = config.activation_quant_key.scale
        self.quant_fp8 = QuantFP8(static=act.static, group_shape=act.group_shape,
                                  num_token_padding=self.get_output_padding(),
                                  use_ue8m0=False, column_major_scales=True)

    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        return CachedFP8ScaledMMLinearKernel.is_supported(compute_capability)

    @classmethod
    def can_implement(cls, c: FP8ScaledMMLinearLayerConfig) -> tuple[bool, str | None]:
        w, a = c.weight_quant_key.scale, c.activation_quant_key.scale
        if a.static or tuple(a.group_shape) != (1, BLOCK) or tuple(w.group_shape) != (
                BLOCK, BLOCK):
            return False, (f"serves dynamic (1, {BLOCK}) activation groups x ({BLOCK}, {BLOCK}) "
                           f"weight blocks; not weight {tuple(w.group_shape)} x "
                           f"{'static' if a.static else 'dynamic'} activation "
                           f"{tuple(a.group_shape)} groups")
        arch = ARCH_OF_CAPABILITY.get(_capability())
        if arch != "sm_90a":
            return False, (f"block FP8 is served on sm_90a ({gemm_plan.HOPPER_FAMILY}), "
                           f"not on {arch}")
        n, k = c.weight_shape
        if k % BLOCK or n % 16:
            return False, (f"needs K % {BLOCK} == 0 (one scale group per K tile) and N % 16 "
                           f"== 0, got N={n} K={k}")
        if c.out_dtype not in (torch.bfloat16, torch.float16, None):
            return False, f"outputs bfloat16 or float16, not {c.out_dtype}"
        return True, None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """vLLM's block processing, then the layouts the kernel reads (weight (N, K)
        row-major, block scales fp32 row-major) and this shape's plan, loaded now."""
        from vllm.model_executor.utils import replace_parameter

        super().process_weights_after_loading(layer)
        params = self._get_layer_params(layer)
        n, k = params.weight.shape
        if not params.weight.is_contiguous():
            replace_parameter(layer, params.WEIGHT, params.weight.contiguous())
        bs = params.block_scale
        want = (-(-n // BLOCK), k // BLOCK)
        if tuple(bs.shape) != want:
            raise ValueError(f"cached: block FP8 layer of N={n} K={k}: weight block scales "
                             f"are {tuple(bs.shape)}, not {want}")
        replace_parameter(layer, params.block_scale_attr, bs.to(torch.float32).contiguous())
        self._gemm_index = load_plan(n, k, params.weight.dtype,
                                     self.config.out_dtype or torch.bfloat16,
                                     params.weight.device, scales="block128",
                                     accumulation="exact")
        check_weight(self._gemm_index, getattr(layer, params.WEIGHT),
                     getattr(layer, params.block_scale_attr))

    def apply_block_scaled_mm(self, A: torch.Tensor, B: torch.Tensor, As: torch.Tensor,
                              Bs: torch.Tensor) -> torch.Tensor:
        return torch.ops.cached.fp8_gemm(A, B, As, Bs, self._gemm_index,
                                         self.config.out_dtype or torch.bfloat16)


def load_plan(n: int, k: int, ab_dtype: torch.dtype, out_dtype: torch.dtype,
              device: torch.device, scales: str = "tensor", accumulation: str = "fast") -> int:
    """The custom op's index of the loaded plan for (N, K) and the scheme on ``device``;
    planned, prefetched and loaded on first use, with one log line per shape and scheme
    saying what was chosen and why."""
    props = torch.cuda.get_device_properties(device)
    arch = ARCH_OF_CAPABILITY[props.major * 10 + props.minor]
    key = gemm_plan.PlanKey("linear", n, k, {torch.float8_e4m3fn: "e4m3"}.get(ab_dtype, "e5m2"),
                            str(out_dtype).replace("torch.", ""), arch,
                            props.multi_processor_count, device_name() or props.name,
                            scales, accumulation)
    with _lock:
        loaded = _plans.get(key)
        if loaded is not None:
            return _gemms.index(loaded)
    daemon = _daemon()
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    max_m = gemm_plan.DEFAULT_MAX_M
    if config is not None and getattr(config, "scheduler_config", None) is not None:
        max_m = max(1, int(config.scheduler_config.max_num_batched_tokens or max_m))
    plan = gemm_plan.plan_gemm(daemon.client, n, k, arch=arch, sm_count=key.sm_count,
                               device=key.device, out_dtype=key.out_dtype,
                               ab_dtype=key.ab_dtype,
                               batch_invariant=bool(envs.VLLM_BATCH_INVARIANT), max_m=max_m,
                               scales=scales, accumulation=accumulation)
    # registers FlashInfer's installer with gemm_plan
    from ..flashinfer import cute_dsl  # noqa: F401

    loaded = plan.load(daemon.client, device)
    for warning in plan.choice.warnings:
        logger.warning_once("cached: %s", warning)
    logger.info("cached: FP8 linear %s", plan.describe())
    with _lock:
        _plans[key] = loaded
        _gemms.append(loaded)
        return len(_gemms) - 1


def check_weight(plan: int, b: torch.Tensor, b_scale: torch.Tensor) -> None:
    """Check once, at a layer's load, what the op's unchecked call trusts of the layer's
    weight ``b`` (N, K) and its scales ``b_scale`` as the op receives them (the loaded
    plan's ``check``); ValueError naming the layer's shape and what differs."""
    loaded = _gemms[plan]
    if not isinstance(loaded, gemm_plan.HopperFp8Gemm):
        return  # FlashInfer's class checks its operands on each call itself
    try:
        loaded.check(b, b_scale)
    except (TypeError, ValueError) as exc:
        k = loaded.plan.key
        raise ValueError(f"cached: FP8 layer of N={k.n} K={k.k} ({k.scales} scales): {exc}"
                         ) from None


# Registered straight with the dispatcher (one CUDA kernel and a fake, as vLLM's own
# direct_register_custom_op does), not through torch.library.custom_op, whose Python dispatch
# costs several times more per call where the op runs from the host: a graph that is not
# captured (the prefill under FULL_DECODE_ONLY, or past the capture sizes) calls it per layer.
_lib = torch.library.Library("cached", "FRAGMENT")  # kept referenced: the op lives with it
_lib.define("fp8_gemm(Tensor a, Tensor b, Tensor a_scale, Tensor b_scale, int plan, "
            "ScalarType out_dtype) -> Tensor")


def fp8_gemm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
             plan: int, out_dtype: torch.dtype) -> torch.Tensor:
    """C (M, N) = a (M, K) @ b (N, K)^T * a_scale * b_scale by the loaded plan ``plan``
    (scales of one element, M and N values for a per-token plan, or the block scales of a
    block128 plan: cached_client.gemm.hopper_fp8.check_gemm_args). Unchecked per call (the
    plan's ``run``): ``b`` and ``b_scale`` are the layer's, checked at its load
    (:func:`check_weight`), ``a`` and ``a_scale`` the layer's quantized input; an ``a`` of
    another dtype or with more rows than the plan's max_m takes the checked path, which
    refuses what it cannot run (ValueError)."""
    if a.shape[0] == 0:
        return torch.empty((0, b.shape[0]), dtype=out_dtype, device=a.device)
    return _gemms[plan].run(a, b, a_scale, b_scale)


def _fp8_gemm_fake(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor,
                   b_scale: torch.Tensor, plan: int, out_dtype: torch.dtype) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


_lib.impl("fp8_gemm", fp8_gemm, "CUDA")
torch.library.register_fake("cached::fp8_gemm", _fp8_gemm_fake, lib=_lib)


# -- attaching to vLLM -----------------------------------------------------------------------


def recognises(original: Any) -> Any:
    """vLLM's ``fp8_scaled_mm_is_batch_invariant``, also true for this kernel (with vLLM's
    own rule for the activation scale: static, or not per-tensor)."""

    def fp8_scaled_mm_is_batch_invariant(kernel: Any) -> bool:
        if isinstance(kernel, CachedFp8BlockScaledMMKernel):
            return True  # dynamic 1x128 groups: each row's scales are its own
        if isinstance(kernel, CachedFP8ScaledMMLinearKernel):
            scale = kernel.config.activation_quant_key.scale
            return bool(scale.static or not scale.group_shape.is_per_tensor())
        return original(kernel)

    fp8_scaled_mm_is_batch_invariant.__wrapped__ = original
    return fp8_scaled_mm_is_batch_invariant


def _replace_everywhere(module: Any, name: str, new: Any) -> None:
    """``module.name = new``, and in every loaded module that imported the old one by name."""
    old = getattr(module, name)
    for mod in list(sys.modules.values()):
        namespace = getattr(mod, "__dict__", None)  # never a lazy module's __getattr__
        if isinstance(namespace, dict) and namespace.get(name) is old:
            setattr(mod, name, new)


def lacks_w4a16_pin(init_nvfp4_linear_kernel: Any) -> bool:
    """Whether vLLM's NVFP4 selection lacks #62192's W4A16 pin: its batch-invariant branch
    never names the Humming kernel."""
    src = inspect.getsource(init_nvfp4_linear_kernel)
    rest = src.partition("if envs.VLLM_BATCH_INVARIANT")[2]
    return "Humming" not in rest.split("\n    elif ")[0]


def attach_linear(L: Any) -> list[str]:
    """Register the kernel class in vLLM's linear-kernel registry (module ``L``), make the
    batch-invariance test recognise it, and pin W4A16 NVFP4 on Humming under batch
    invariance where vLLM lacks that pin. Returns what was done, for the plugin's line."""
    from vllm.platforms import PlatformEnum

    done = []
    kernels = L._POSSIBLE_FP8_KERNELS.setdefault(PlatformEnum.CUDA, [])
    if CachedFP8ScaledMMLinearKernel not in kernels:
        kernels.insert(0, CachedFP8ScaledMMLinearKernel)
    blocks = L._POSSIBLE_FP8_BLOCK_KERNELS.setdefault(PlatformEnum.CUDA, [])
    if CachedFp8BlockScaledMMKernel not in blocks:
        blocks.insert(0, CachedFp8BlockScaledMMKernel)
    L._LINEAR_BACKEND_KERNEL_MAP[BACKEND] = {CachedFP8ScaledMMLinearKernel,
                                             CachedFp8BlockScaledMMKernel}
    if getattr(L.fp8_scaled_mm_is_batch_invariant, "__wrapped__", None) is None:
        _replace_everywhere(L, "fp8_scaled_mm_is_batch_invariant",
                            recognises(L.fp8_scaled_mm_is_batch_invariant))
    done.append(f"FP8 linear kernels {CachedFP8ScaledMMLinearKernel.__name__} and "
                f"{CachedFp8BlockScaledMMKernel.__name__} (--linear-backend {BACKEND})")
    if envs.VLLM_BATCH_INVARIANT and lacks_w4a16_pin(L.init_nvfp4_linear_kernel):
        _replace_everywhere(L, "init_nvfp4_linear_kernel",
                            _humming_w4a16(L, L.init_nvfp4_linear_kernel))
        done.append("W4A16 NVFP4 on Humming (vLLM #62192)")
    return done


def _humming_w4a16(L: Any, original: Any) -> Any:
    def init_nvfp4_linear_kernel(use_a16: bool = False) -> Any:
        if not (use_a16 and envs.VLLM_BATCH_INVARIANT):
            return original(use_a16)
        from vllm.model_executor.kernels.linear.nvfp4.humming import HummingNvFp4LinearKernel

        backend = L._get_linear_backend(quantization="nvfp4_w4a16")
        if backend not in ("auto", "humming"):
            logger.warning_once(
                "cached: VLLM_BATCH_INVARIANT overrides --linear-backend=%s for W4A16 NVFP4; "
                "using HummingNvFp4LinearKernel (vLLM #62192's pin, missing in this vLLM)",
                backend)
        ok, reason = HummingNvFp4LinearKernel.is_supported()
        if not ok:
            raise ValueError(f"W4A16 NVFP4 under VLLM_BATCH_INVARIANT=1 runs on "
                             f"HummingNvFp4LinearKernel (vLLM #62192), which is not "
                             f"supported here: {reason}")
        logger.warning_once("cached: VLLM_BATCH_INVARIANT=1: W4A16 NVFP4 linears use "
                            "HummingNvFp4LinearKernel (vLLM #62192's pin; this vLLM would "
                            "force CutlassNvFp4LinearKernel, which is W4A4-only)")
        return HummingNvFp4LinearKernel(L.NvFp4LinearLayerConfig())

    init_nvfp4_linear_kernel.__wrapped__ = original
    return init_nvfp4_linear_kernel
