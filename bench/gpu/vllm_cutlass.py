"""vLLM's CUTLASS GEMM, ``torch.ops._C.cutlass_scaled_mm`` from vLLM 0.33.0's
_C_stable_libtorch.abi3.so, called as vLLM's own Python calls it: the one place bench/gpu's
scripts (tune_check.py, hopper_fp8_schemes.py) take it from. No vLLM Python is needed (a
bundle carries this file beside its script).

The op: ``cutlass_scaled_mm(Tensor! out, Tensor a, Tensor b, Tensor a_scales,
Tensor b_scales, Tensor? bias) -> ()`` (its schema, in the .so). vLLM's callers
(vllm/_custom_ops.py::cutlass_scaled_mm; model_executor/kernels/linear/scaled_mm/cutlass.py)
pass ``out`` (M, N) bf16, ``a`` (M, K) FP8 row-major and ``b`` (K, N) FP8 column-major (the
(N, K) weight's ``.t()``), bias None, and scales:

* per-tensor: 1-element float32 ``a_scales`` and ``b_scales``;
* per-token x per-channel: (M, 1) and (N, 1) float32, contiguous;
* block (CutlassFp8BlockScaledMMKernel.apply_block_scaled_mm, ``ops.cutlass_scaled_mm(A,
  B.T, scale_a=As, scale_b=Bs.T)``): ``As`` (M, K/128) float32 column-major, strides (1, M)
  (QuantFP8 with column_major_scales=True: ``empty(K/128, M).permute(1, 0)``), ``Bs`` the
  weight's (ceil(N/128), K/128) row-major scales, passed transposed: (K/128, ceil(N/128)).
  The daemon's block128 kernels read the same two layouts (a_scale column-major, b_scale
  row-major: cached_client.gemm.hopper_fp8.check_gemm_args), so one set of scales serves
  both.

vLLM takes this op only where K % 16 == 0 and N % 16 == 0 (else its Triton fallback):
:func:`covers`. Its per-tensor and per-token kernels on sm_90 are CUTLASS's FP8FastAccum
schedules (fast accumulation), its block kernel promotes per 128 of K (:data:`SCHEMES`).

Usage: only through :func:`load` (which checks the library's digest first), :func:`covers`,
:func:`scaled_mm` (bench/gpu/tune_check.py smoke checks the loaded op against a float
reference before any timing). Imports torch, and cached_client's loader when it loads.
"""

from __future__ import annotations

import os

import torch

#: the (scales, accumulation) schemes vLLM's CUTLASS op computes, with its label
SCHEMES = {("tensor", "fast"): "vLLM cutlass_scaled_mm",
           ("token", "fast"): "vLLM cutlass_scaled_mm",
           ("block128", "exact"): "vLLM cutlass_scaled_mm blockwise"}


def load(path: str | None, sha256: str | None) -> str:
    """Load vLLM's _C from ``path``: "" when ``torch.ops._C.cutlass_scaled_mm`` is then
    there, else why not (no path or digest given, no file, other bytes, the load's error, or
    a library without the op).

    What is checked before this native code runs: its bytes are copied into a sealed memfd
    (``cached_client.loader.sealed_copy``: no write, grow or shrink once sealed), hashed
    there against ``sha256`` (the digest the bundle's build recorded from .venv-vllm), and
    that memfd is what ``torch.ops.load_library`` opens (``/proc/self/fd/N``), so a file
    swapped or changed after the check is never what is loaded. No digest, no load. Refused
    forgery: tests/test_tune_check.py
    (``test_vllm_covers_its_schemes_only_and_load_refuses_other_bytes``)."""
    if not path:
        return "no --vllm-so given"
    if not sha256:
        return (f"{path}: no sha256 given for it (--vllm-sha256); native code is not "
                f"loaded unchecked")
    if not os.path.exists(path):
        return f"{path}: no such file"
    from cached_client.errors import IntegrityError
    from cached_client.loader import sealed_copy

    try:
        fd = sealed_copy(path, sha256)
    except IntegrityError as exc:
        return str(exc)
    try:
        torch.ops.load_library(f"/proc/self/fd/{fd}")
    except Exception as exc:  # noqa: BLE001 -- reported; the run goes on without it
        return f"{path} did not load: {str(exc)[:300]}"
    finally:
        os.close(fd)  # the mapping dlopen made stays
    if not hasattr(torch.ops._C, "cutlass_scaled_mm"):
        return f"{path} loaded, but torch.ops._C has no cutlass_scaled_mm"
    return ""


def covers(scales: str, accum: str, n: int, k: int) -> bool:
    """Whether vLLM runs this op for the scheme at (N, K): a scheme of SCHEMES with
    K % 16 == 0 and N % 16 == 0 (vLLM's guard before its Triton fallback)."""
    return (scales, accum) in SCHEMES and n % 16 == 0 and k % 16 == 0


def label(scales: str, accum: str) -> str:
    """The competitor's label for the scheme (KeyError for one SCHEMES lacks)."""
    return SCHEMES[(scales, accum)]


def scaled_mm(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
              out: torch.Tensor, scales: str) -> torch.Tensor:
    """out = vLLM's C = (a @ b^T) scaled, for ``a`` (M, K) and ``b`` (N, K) FP8 (the
    daemon's operand layouts) and the scheme's scales as cached.tools.tune_cuda.operands
    gives them: per-tensor 1 value each; per-token M and N values (any shape of that many,
    contiguous); block128 ``sa`` (M, K/128) column-major, strides (1, M), and ``sb``
    (ceil(N/128), K/128) row-major. ``out`` (M, N) bf16, contiguous. Returns ``out``."""
    if scales == "token":
        sa, sb = sa.reshape(-1, 1), sb.reshape(-1, 1)
    elif scales == "block128":
        sb = sb.t()
    elif scales != "tensor":
        raise ValueError(f"vLLM's cutlass_scaled_mm takes per-tensor, per-token or block128 "
                         f"scales, not {scales!r}")
    torch.ops._C.cutlass_scaled_mm(out, a, b.t(), sa, sb, None)
    return out
