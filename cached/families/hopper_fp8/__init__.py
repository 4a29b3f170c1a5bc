"""Hopper (sm_90a) FP8 GEMM family written in CuTe-DSL.

Only the tactic space is re-exported here: it imports neither cutlass nor torch, so the
daemon's main process can use it. kernel.py / compile.py (cutlass) are imported by the
workers, and the launcher lives in the client (cached_client.hopper_fp8, torch).
"""

from .tactics import (
    FAMILY,
    REDUCTION_CLASSES,
    REDUCTION_ORDER,
    REDUCTION_ORDER_M_INDEPENDENT,
    SPLIT_CHOICES,
    TARGET_ARCH,
    TILE_K,
    HopperFp8Tactic,
    choose_split,
    enumerate_tactics,
    reduction_class_id,
    smem_bytes,
    tactic_from_params,
)

__all__ = [
    "FAMILY",
    "REDUCTION_CLASSES",
    "REDUCTION_ORDER",
    "REDUCTION_ORDER_M_INDEPENDENT",
    "SPLIT_CHOICES",
    "TARGET_ARCH",
    "TILE_K",
    "HopperFp8Tactic",
    "choose_split",
    "enumerate_tactics",
    "reduction_class_id",
    "smem_bytes",
    "tactic_from_params",
]
