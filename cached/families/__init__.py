"""The registry of kernel families: name -> module-level singleton.

A family module is imported only when its name is first asked for, so the daemon's main
process imports none of the heavy toolchains through this registry.
"""

from __future__ import annotations

import importlib
import os

from cached_client.errors import UnknownFamily

from .base import Family

_MODULES = {
    "flashinfer.mm_fp4": ("cached.families.flashinfer_mm_fp4", "FlashInferMmFp4"),
    "cached.hopper_fp8": ("cached.families.hopper_fp8.family", "HopperFp8"),
    "cached.hopper_bf16": ("cached.families.hopper_bf16.family", "HopperBf16"),
    "flashinfer.bi.bmm_fp8": ("cached.families.flashinfer_bi", "FlashInferBiBmmFp8"),
    "flashinfer.bi.mm_fp4": ("cached.families.flashinfer_bi", "FlashInferBiMmFp4"),
    "flashinfer.jit": ("cached.families.flashinfer_jit", "FlashInferJit"),
    "flashinfer.nvcc": ("cached.families.jit", "FlashInferNvcc"),
    "humming": ("cached.families.jit", "Humming"),
    "triton": ("cached.families.jit", "Triton"),
}
if os.environ.get("CACHED_TEST_FAMILIES") == "1":
    _MODULES["cached.test.fault"] = ("cached.families.testing", "FaultFamily")
_instances: dict[str, Family] = {}


def names() -> list[str]:
    return sorted(_MODULES)


def flashinfer_kernels() -> tuple[str, ...]:
    """The FlashInfer families whose artifacts are CuTe-DSL objects in FlashInfer's own
    naming (what ``cached export`` writes into FlashInfer's disk cache); FlashInfer's nvcc
    modules are bundles (:attr:`Family.bundle`), not among them."""
    return tuple(n for n in names() if n.startswith("flashinfer.") and not get(n).bundle)


def get(name: str) -> Family:
    """The family called ``name``; UnknownFamily lists the known ones."""
    family = _instances.get(name)
    if family is None:
        if name not in _MODULES:
            raise UnknownFamily(f"unknown family {name!r}; known: {', '.join(names())}")
        module, cls = _MODULES[name]
        family = _instances[name] = getattr(importlib.import_module(module), cls)()
    return family
