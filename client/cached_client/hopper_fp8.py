"""Host-side launcher for a loaded ``cached.hopper_fp8`` kernel.

``fn`` is the TVM-FFI function ``Client.load`` returns for a ``cached.hopper_fp8``
request (or ``tvm_ffi.load_module(path)[symbol]``). torch is imported lazily, so
importing this module is cheap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_FP8_NAMES = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}
_OUT_NAMES = ("bfloat16", "float16")


def _dtype_name(dt: Any) -> str:
    return str(dt).replace("torch.", "")


def check_gemm_args(a, b, a_scale, b_scale, out_dtype, out=None) -> tuple[int, int, int]:
    """Validate the operands; return (M, N, K). Raises ValueError / TypeError."""
    import torch

    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise TypeError("a and b must be torch tensors")
    for name, sc in (("a_scale", a_scale), ("b_scale", b_scale)):
        if not isinstance(sc, torch.Tensor):
            raise TypeError(
                f"{name} must be a 1-element float32 CUDA tensor (read on the device), "
                f"got {type(sc).__name__}"
            )
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"a and b must be 2-D, got a{tuple(a.shape)} b{tuple(b.shape)}")
    an, bn = _dtype_name(a.dtype), _dtype_name(b.dtype)
    if an not in _FP8_NAMES or bn != an:
        raise ValueError(
            f"a and b must both be float8_e4m3fn or both float8_e5m2, got {an} and {bn}"
        )
    m, k = a.shape
    n, kb = b.shape
    if kb != k:
        raise ValueError(f"a is (M, K)=({m}, {k}) but b is (N, K)=({n}, {kb}): K differs")
    if m == 0:
        raise ValueError("M = 0: an empty batch has nothing to compute; skip the call")
    if n == 0 or k == 0:
        raise ValueError(f"N and K must be positive, got N={n}, K={k}")
    if n % 16 or k % 16:
        raise ValueError(
            f"N and K must be multiples of 16 (TMA needs 16-byte rows), got N={n}, K={k}; "
            f"pad the weight to the next multiple of 16"
        )
    for name, t in (("a", a), ("b", b)):
        if t.stride(1) != 1 or t.stride(0) != t.shape[1]:
            raise ValueError(
                f"{name} must be row-major contiguous (K-major), got strides {t.stride()}; "
                f"call .contiguous()"
            )
        if t.data_ptr() % 16:
            raise ValueError(f"{name} must be 16-byte aligned")
        if not t.is_cuda:
            raise ValueError(f"{name} must be a CUDA tensor")
        if t.device != a.device:
            raise ValueError("a, b, scales and output must be on one device")
    for name, s in (("a_scale", a_scale), ("b_scale", b_scale)):
        if s.numel() != 1 or s.dtype != torch.float32:
            raise ValueError(
                f"{name} must be a 1-element float32 tensor, got shape {tuple(s.shape)} {s.dtype}"
            )
        if s.device != a.device:
            raise ValueError(f"{name} must be on {a.device}, got {s.device}")
    if _dtype_name(out_dtype) not in _OUT_NAMES:
        raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float16, got {out_dtype}")
    if out is not None:
        if out.shape != (m, n) or out.dtype != out_dtype or not out.is_contiguous():
            raise ValueError(
                f"out must be a contiguous ({m}, {n}) {out_dtype} tensor, "
                f"got {tuple(out.shape)} {out.dtype}"
            )
        if out.data_ptr() % 16 or out.device != a.device:
            raise ValueError("out must be 16-byte aligned and on a's device")
    return m, n, k


def gemm(
    fn: Callable[..., Any],
    a,
    b,
    a_scale,
    b_scale,
    out_dtype,
    out: Any | None = None,
):
    """C = cvt((a @ b.T) * (a_scale * b_scale)) with the compiled kernel `fn`.

    a (M, K) and b (N, K): float8 CUDA tensors, K contiguous; a_scale, b_scale: 1-element
    float32 CUDA tensors; out_dtype: torch.bfloat16 or torch.float16 (must match the dtype
    the tactic was compiled for). Runs on the current torch stream; no host sync.
    """
    import torch

    m, n, _ = check_gemm_args(a, b, a_scale, b_scale, out_dtype, out)
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    fn(a, b, out, a_scale.reshape(1), b_scale.reshape(1))
    return out
