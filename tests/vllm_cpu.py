"""vLLM 0.33.0 on a CPU machine as on a CUDA device, for the harnesses run in .venv-vllm
(vllm_harness.py, vllm_bf16_harness.py): only what needs the GPU is answered here, the rest
is vLLM's own code. Import it before vLLM."""

from __future__ import annotations

import sys
import types

# compiled extensions imported at module level: vllm/platforms/cuda.py's (needs
# libcuda.so.1) and flash-attention's (not installed here; vllm_flash_attn refuses to import
# without it, and the model executor's attention and MoE modules import that): empty
# modules, so their ops are absent (any call raises)
for _name in ("vllm._C_stable_libtorch", "vllm.vllm_flash_attn._vllm_fa2_C"):
    sys.modules.setdefault(_name, types.ModuleType(_name))

_libs: list = []  # kept referenced: an op lives as long as its library


def capability_queries() -> None:
    """The compiled extension's capability queries, with the rules of vLLM's
    scaled_mm_entry.cu (vLLM's FP8 modules ask them at import)."""
    import torch

    lib = torch.library.Library("_C", "FRAGMENT")
    for name, least in (("cutlass_scaled_mm_supports_fp8", 89),
                        ("cutlass_scaled_mm_supports_block_fp8", 90),
                        ("cutlass_group_gemm_supported", 90),
                        ("cutlass_scaled_mm_supports_fp4", 100)):
        lib.define(f"{name}(int cuda_device_capability) -> bool")
        lib.impl(name, (lambda m: lambda c: c >= m)(least), "CompositeExplicitAutograd")
    _libs.append(lib)


def patch_platform(cap: int, sm_count: int | None = None) -> None:
    """vLLM's CUDA platform reporting capability ``cap`` (and ``sm_count`` SMs, if given)."""
    import vllm.platforms as platforms
    from vllm.platforms.cuda import CudaPlatform
    from vllm.platforms.interface import DeviceCapability

    class PatchedCuda(CudaPlatform):
        @classmethod
        def get_device_capability(cls, device_id: int = 0):
            return DeviceCapability(cap // 10, cap % 10)

        if sm_count is not None:
            @classmethod
            def num_compute_units(cls, device_id: int = 0) -> int:
                return sm_count

    platforms.current_platform.__class__ = PatchedCuda
