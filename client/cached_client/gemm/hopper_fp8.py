"""Host-side launcher for a loaded ``cached.hopper_fp8`` or ``cached.hopper_bf16`` kernel.

``fn`` is the TVM-FFI function ``Client.load`` returns for a request of either family
(or ``tvm_ffi.load_module(path)[symbol]``). torch is imported lazily, so importing this
module is cheap. The bf16 family's kernels (``params["scales"] == "none"``) take bfloat16
operands and no scales: pass ``a_scale = b_scale = None``; the kernel's scale slots get a
placeholder it never reads.

Split-K tactics with ``split_mode="cta"`` need two buffers from the caller, so that a
call allocates nothing beyond its output (and can be captured in a CUDA graph):

* ``workspace``: float32, at least ``workspace_bytes(params, m, n)`` bytes, for the
  fp32 partial sums; no initial value is needed.
* ``counters``: int32, at least ``counter_elems(params, m, n)`` elements, **zero-filled
  once** when allocated; every launch leaves them at zero again (the last unit of each
  output tile resets its counter), so no memset per call.

``tile_m`` / ``tile_n`` in the params are the tile along the output's M and N for every
tactic, the ``swap_ab`` ones (weight rows on the MMA's M side) included, so these sizes
need no other field. Both sizes grow with M: allocate once for the largest M (and every
tactic) a caller serves, e.g. with :func:`alloc_workspace`. One pair of buffers serves one
launch at a time: GEMMs that may run concurrently (other streams) need their own pair.
Every other tactic (``splits=1`` or ``split_mode="serial"``) needs neither; the launcher
then passes placeholders that the kernel never touches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

#: The largest workspace one launch can address (the kernel indexes it with int32).
MAX_WORKSPACE_ELEMS = 2**31 - 1


def _uses_workspace(params: Mapping[str, Any]) -> bool:
    return int(params.get("splits", 1)) > 1 and params.get("split_mode", "serial") == "cta"


def _tiles(params: Mapping[str, Any], m: int, n: int) -> int:
    tm, tn = int(params.get("tile_m", 128)), int(params.get("tile_n", 128))
    return -(-m // tm) * -(-n // tn)


def workspace_bytes(params: Mapping[str, Any], m: int, n: int) -> int:
    """Bytes of fp32 workspace a launch of tactic ``params`` on an (m, n) output needs:
    one tile_m x tile_n fp32 partial per output tile and split for ``split_mode="cta"``,
    0 for every other tactic. Pure; grows monotonically with m and n."""
    if m < 0 or n < 0:
        raise ValueError(f"m and n must be >= 0, got m={m}, n={n}")
    if not _uses_workspace(params):
        return 0
    tm, tn = int(params["tile_m"]), int(params["tile_n"])
    return _tiles(params, m, n) * int(params["splits"]) * tm * tn * 4


def counter_elems(params: Mapping[str, Any], m: int, n: int) -> int:
    """int32 counters a launch needs (one per output tile for ``split_mode="cta"``, else
    0). Zero-fill them once at allocation; launches leave them at zero."""
    if m < 0 or n < 0:
        raise ValueError(f"m and n must be >= 0, got m={m}, n={n}")
    return _tiles(params, m, n) if _uses_workspace(params) else 0


def alloc_workspace(params: Iterable[Mapping[str, Any]], max_m: int, n: int, device: Any):
    """(workspace, counters) large enough for every tactic in ``params`` at any M up to
    ``max_m`` on an output of width ``n``: float32 and zero-filled int32 CUDA tensors
    (at least one element each). Allocate once, e.g. when a plan is built."""
    import torch

    ps = list(params)
    ws = max([workspace_bytes(p, max_m, n) for p in ps] + [4]) // 4
    cnt = max([counter_elems(p, max_m, n) for p in ps] + [1])
    if ws > MAX_WORKSPACE_ELEMS:
        raise ValueError(f"workspace of {ws} float32 elements is over the kernel's limit "
                         f"{MAX_WORKSPACE_ELEMS}; serve M <= {max_m} with fewer splits")
    return (torch.empty(ws, dtype=torch.float32, device=device),
            torch.zeros(cnt, dtype=torch.int32, device=device))

_FP8_NAMES = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}
_OUT_NAMES = ("bfloat16", "float16")
_BF16_OUT_NAMES = ("bfloat16", "float16", "float32")
NO_SCALES = "none"  # the bf16 family's scheme


def _dtype_name(dt: Any) -> str:
    return str(dt).replace("torch.", "")


SCALE_SCHEMES = ("tensor", "token", "block128")
BLOCK = 128  # block128: activation groups 1 x BLOCK, weight blocks BLOCK x BLOCK


def _check_block_scales(a_scale, b_scale, m: int, n: int, k: int) -> None:
    """The block128 scale layouts (check_gemm_args); ValueError naming the one expected."""
    import torch

    if k % BLOCK:
        raise ValueError(f"block128 scales need K % {BLOCK} == 0 (one scale group per K "
                         f"tile), got K = {k}")
    kb, nb = k // BLOCK, -(-n // BLOCK)
    want = {"a_scale": ((m, kb), (1, m), "column-major: a_scale = s.t().contiguous().t()"),
            "b_scale": ((nb, kb), (kb, 1), "row-major: call .contiguous()")}
    for name, s in (("a_scale", a_scale), ("b_scale", b_scale)):
        shape, strides, how = want[name]
        if s.dtype != torch.float32 or tuple(s.shape) != shape:
            raise ValueError(f"block128 scales: {name} must be a float32 {shape} tensor, got "
                             f"shape {tuple(s.shape)} {s.dtype}")
        if shape[0] > 1 and shape[1] > 1 and s.stride() != strides:
            raise ValueError(f"block128 scales: {name} must have strides {strides} ({how}), "
                             f"got {s.stride()}")


def check_gemm_args(a, b, a_scale, b_scale, out_dtype, out=None,
                    scales: str = "tensor") -> tuple[int, int, int]:
    """Validate the operands; return (M, N, K). Raises ValueError / TypeError.

    ``scales``: ``"tensor"`` (1-element a_scale and b_scale) or ``"token"`` (a_scale M
    float32 values, one per row of a, and b_scale N values, one per row of b; contiguous,
    any shape of that many elements, e.g. (M, 1)) or ``"block128"`` (K % 128 == 0; a_scale
    (M, K/128) float32 column-major, strides (1, M), as vLLM's per_token_group_quant_fp8
    with column_major_scales=True writes it; b_scale (ceil(N/128), K/128) float32
    row-major), all with FP8 operands; or ``"none"`` (bf16 operands, a_scale and b_scale
    None; out_dtype bfloat16, float16 or float32)."""
    import torch

    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise TypeError("a and b must be torch tensors")
    if scales not in (*SCALE_SCHEMES, NO_SCALES):
        raise ValueError(f"scales must be one of {SCALE_SCHEMES}, got {scales!r}")
    bf16 = scales == NO_SCALES
    for name, sc in (("a_scale", a_scale), ("b_scale", b_scale)):
        if bf16 and sc is not None:
            raise TypeError(f"{name}: a bf16 kernel (scales 'none') reads no scales; pass None")
        if not bf16 and not isinstance(sc, torch.Tensor):
            raise TypeError(
                f"{name} must be a float32 CUDA tensor (read on the device), "
                f"got {type(sc).__name__}"
            )
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"a and b must be 2-D, got a{tuple(a.shape)} b{tuple(b.shape)}")
    an, bn = _dtype_name(a.dtype), _dtype_name(b.dtype)
    if bf16 and (an != "bfloat16" or bn != an):
        raise ValueError(f"a and b must both be bfloat16 for a bf16 kernel, got {an} and {bn}")
    if not bf16 and (an not in _FP8_NAMES or bn != an):
        raise ValueError(
            f"a and b must both be float8_e4m3fn or both float8_e5m2, got {an} and {bn}"
        )
    outs = _BF16_OUT_NAMES if bf16 else _OUT_NAMES
    if _dtype_name(out_dtype) not in outs:
        raise ValueError(f"out_dtype must be one of torch.{', torch.'.join(outs)}, got "
                         f"{out_dtype}")
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
    for name, s, want in (("a_scale", a_scale, m), ("b_scale", b_scale, n)):
        if scales == "tensor" and (s.numel() != 1 or s.dtype != torch.float32):
            raise ValueError(
                f"{name} must be a 1-element float32 tensor, got shape {tuple(s.shape)} {s.dtype}"
            )
        if scales == "token" and (s.numel() != want or s.dtype != torch.float32
                                  or not s.is_contiguous()):
            raise ValueError(
                f"per-token scales: {name} must be a contiguous float32 tensor of {want} "
                f"elements (one per row of {name[0]}), got shape {tuple(s.shape)} {s.dtype}"
            )
    if scales == "block128":
        _check_block_scales(a_scale, b_scale, m, n, k)
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
        if s is not None and s.device != a.device:
            raise ValueError(f"{name} must be on {a.device}, got {s.device}")
    if out is not None:
        if out.shape != (m, n) or out.dtype != out_dtype or not out.is_contiguous():
            raise ValueError(
                f"out must be a contiguous ({m}, {n}) {out_dtype} tensor, "
                f"got {tuple(out.shape)} {out.dtype}"
            )
        if out.data_ptr() % 16 or out.device != a.device:
            raise ValueError("out must be 16-byte aligned and on a's device")
    return m, n, k


def check_workspace(params: Mapping[str, Any] | None, m: int, n: int, device: Any,
                    workspace: Any | None, counters: Any | None) -> None:
    """Raise ValueError unless the buffers suit tactic ``params`` at (m, n)."""
    import torch

    if params is None:
        if workspace is not None or counters is not None:
            raise ValueError("workspace/counters given without params: pass the tactic's "
                             "params so the launcher can check their sizes")
        return
    if not _uses_workspace(params):
        return
    need_ws = workspace_bytes(params, m, n) // 4
    need_cnt = counter_elems(params, m, n)
    if workspace is None or counters is None:
        raise ValueError(
            f"tactic splits={params.get('splits')} split_mode='cta' needs a float32 workspace "
            f"of >= {need_ws} elements and zero-filled int32 counters of >= {need_cnt} "
            f"(workspace_bytes / counter_elems; alloc_workspace allocates both once)")
    if need_ws > MAX_WORKSPACE_ELEMS:
        raise ValueError(f"M={m}: the workspace would need {need_ws} float32 elements, over "
                         f"the kernel's limit {MAX_WORKSPACE_ELEMS}; use a serial tactic")
    for name, t, dt, need in (("workspace", workspace, torch.float32, need_ws),
                              ("counters", counters, torch.int32, need_cnt)):
        if not isinstance(t, torch.Tensor) or t.dtype != dt or t.dim() != 1:
            raise ValueError(f"{name} must be a 1-D {dt} tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)}")
        if not t.is_contiguous() or t.device != device:
            raise ValueError(f"{name} must be contiguous and on {device}")
        if t.numel() < need:
            raise ValueError(f"{name} has {t.numel()} elements; M={m}, N={n} needs {need} "
                             f"(allocate for the largest M once: alloc_workspace)")


def gemm(
    fn: Callable[..., Any],
    a,
    b,
    a_scale,
    b_scale,
    out_dtype,
    out: Any | None = None,
    *,
    params: Mapping[str, Any] | None = None,
    workspace: Any | None = None,
    counters: Any | None = None,
):
    """C = cvt((a @ b.T) * (a_scale * b_scale)) with the compiled kernel `fn` (a bf16
    kernel, ``params["scales"] == "none"``: C = cvt(a @ b.T), a and b bfloat16, a_scale and
    b_scale None, out_dtype bfloat16, float16 or float32).

    a (M, K) and b (N, K): float8 (bf16) CUDA tensors, K contiguous; a_scale, b_scale: 1-element
    float32 CUDA tensors, or for a tactic with ``scales="token"`` (its ``params`` say so)
    M and N float32 values (element (m, n) scaled by a_scale[m] * b_scale[n]), or for
    ``scales="block128"`` the block scales (check_gemm_args); out_dtype:
    torch.bfloat16 or torch.float16 (must match the dtype the tactic was compiled for).
    ``params``: the tactic's params (from its request); required with
    ``workspace``/``counters``, which a ``split_mode="cta"`` tactic needs (module doc).
    Runs on the current torch stream; no host sync, no allocation when ``out`` is given.
    """
    import torch

    scales = "tensor" if params is None else params.get("scales", "tensor")
    m, n, _ = check_gemm_args(a, b, a_scale, b_scale, out_dtype, out, scales)
    check_workspace(params, m, n, a.device, workspace, counters)
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if scales == NO_SCALES:  # 1-element placeholders of the scale slots: never read
        flat = workspace[:1] if workspace is not None else torch.empty(
            1, dtype=torch.float32, device=a.device)
        sa = sb = flat
    elif scales == "block128":
        # the strides the kernel was compiled for; exact views (a size-1 dim's stride is
        # never used), so no copy
        kb, nb = a_scale.shape[1], b_scale.shape[0]
        sa, sb = a_scale.as_strided((m, kb), (1, m)), b_scale.as_strided((nb, kb), (kb, 1))
        flat = sb.reshape(-1)
    else:
        sa, sb = a_scale.reshape(-1), b_scale.reshape(-1)
        flat = sa
    if workspace is None:  # placeholders: only split_mode="cta" kernels read them
        workspace, counters = flat, flat.view(torch.int32)
    fn(a, b, out, sa, sb, workspace, counters)
    return out
