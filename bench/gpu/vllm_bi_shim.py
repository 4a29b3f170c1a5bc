"""Load vLLM 0.33.0's own batch-invariant matmul (``matmul_persistent`` in
``vllm/model_executor/determinism/batch_invariant.py``) on a machine without vLLM.

The two real files (``batch_invariant.py`` and ``batch_invariant_configs.py``, copied by the
build step from the vLLM venv) are executed unchanged under their own module names; only what
they import from the rest of vLLM is provided here, answered from torch and Triton:
``vllm.envs`` (VLLM_BATCH_INVARIANT on), ``vllm.platforms.current_platform`` (CUDA: device
capability, compute units, device name), ``vllm.triton_utils`` (triton, tl),
``vllm.utils.{mem_utils, nccl, platform_utils, torch_utils}``. So the kernel, its fixed
configs and its tuned per-shape M buckets (``hopper`` on capability 9.x) are vLLM's own.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from typing import Any, NamedTuple

PKG = "vllm.model_executor.determinism"


class DeviceCapability(NamedTuple):
    """(major, minor), as vLLM's ``vllm.platforms.interface.DeviceCapability``."""

    major: int
    minor: int

    def to_int(self) -> int:
        return self.major * 10 + self.minor


class _CudaPlatform:
    """The parts of vLLM's ``current_platform`` the two files call, answered by torch."""

    dispatch_key = "CUDA"

    def is_cuda(self) -> bool:
        return True

    def is_cuda_alike(self) -> bool:
        return True

    def is_rocm(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def get_device_capability(self, device_id: int = 0) -> DeviceCapability:
        import torch

        return DeviceCapability(*torch.cuda.get_device_capability(device_id))

    def is_device_capability_family(self, family: int, device_id: int = 0) -> bool:
        return self.get_device_capability(device_id).to_int() // 10 == family // 10

    def num_compute_units(self, device_id: int = 0) -> int:
        import torch

        return torch.cuda.get_device_properties(device_id).multi_processor_count

    def get_device_name(self, device_id: int = 0) -> str:
        import torch

        return torch.cuda.get_device_name(device_id)


def _module(name: str, **attrs: Any) -> types.ModuleType:
    mod = sys.modules.get(name) or types.ModuleType(name)
    mod.__dict__.update(attrs)
    if "." not in name or attrs.get("__path__") is not None:
        mod.__path__ = attrs.get("__path__", [])  # a package
    sys.modules[name] = mod
    return mod


def _max_shared_memory_bytes(gpu: int = 0) -> int:
    import torch

    return int(torch.cuda.get_device_properties(gpu).shared_memory_per_block_optin)


def load(directory: str | Path) -> types.ModuleType:
    """Import the real ``batch_invariant.py`` from ``directory`` (which also holds
    ``batch_invariant_configs.py``) and return the module. Raises FileNotFoundError naming
    the missing file."""
    import torch
    import triton
    import triton.language as tl

    directory = Path(directory)
    for f in ("batch_invariant.py", "batch_invariant_configs.py"):
        if not (directory / f).is_file():
            raise FileNotFoundError(f"{directory / f}: copy it from vLLM 0.33.0's "
                                    f"vllm/model_executor/determinism/")
    platform = _CudaPlatform()
    _module("vllm", __path__=[])
    _module("vllm.envs", VLLM_BATCH_INVARIANT=True)
    _module("vllm.platforms", __path__=[], current_platform=platform)
    _module("vllm.platforms.interface", DeviceCapability=DeviceCapability)
    _module("vllm.triton_utils", __path__=[], triton=triton, tl=tl, HAS_TRITON=True)
    _module("vllm.utils", __path__=[])
    _module("vllm.utils.mem_utils", get_max_shared_memory_bytes=_max_shared_memory_bytes)
    _module("vllm.utils.nccl", pin_nccl_env=lambda env: None)
    _module("vllm.utils.platform_utils", num_compute_units=platform.num_compute_units)

    def is_torch_equal_or_newer(version: str) -> bool:
        from torch.torch_version import TorchVersion

        return TorchVersion(torch.__version__.split("+")[0]) >= version

    _module("vllm.utils.torch_utils", is_torch_equal_or_newer=is_torch_equal_or_newer)
    _module("vllm.model_executor", __path__=[])
    _module(PKG, __path__=[str(directory)])
    out = None
    for name in ("batch_invariant_configs", "batch_invariant"):
        spec = importlib.util.spec_from_file_location(f"{PKG}.{name}", directory / f"{name}.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        out = mod
    assert out is not None
    return out
