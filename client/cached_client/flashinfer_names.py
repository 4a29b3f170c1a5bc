"""FlashInfer's CuTe-DSL kernel names: one grammar for the client's hooks and the daemon.

FlashInfer names every compiled CuTe-DSL kernel by module and kernel name, and exports it
as the function ``<module>_<kernel>`` (:func:`symbol`). The hooks
(cached_client.integrations.flashinfer.cute_dsl) read a kernel name back into the daemon family's
request that builds it; the daemon's families build with FlashInfer's own naming functions and
export under :func:`symbol`. Pure: stdlib only, nothing of FlashInfer imported.
"""

from __future__ import annotations

import re

from .keys import KernelRequest

MM_FP4_MODULE = "mm_fp4"
BI_DENSE_MODULE = "batch_invariant_gemm"
BI_BLOCKSCALED_MODULE = "batch_invariant_gemm_blockscaled"
BI_MODULES = (BI_DENSE_MODULE, BI_BLOCKSCALED_MODULE)
WRITE_BACK_FAMILY = "flashinfer.jit"


def symbol(module: str, kernel: str) -> str:
    """The exported function's name, as FlashInfer's ``JitSpecCuteDsl`` names it."""
    return f"{module}_{kernel}"


_MM_FP4_RE = re.compile(
    r"^sf(?P<sf>16|32)_t(?P<tm>\d+)x(?P<tn>\d+)_c(?P<cm>\d+)x(?P<cn>\d+)_swap(?P<swap>[01])"
    r"_pf(?P<pf>[01])_(?P<kt>sm100sk|sm100)_tma(?P<tma>x|\d+)_pdl(?P<pdl>[01])"
    r"_(?P<dt>bfloat16|float16)_pta(?P<pta>x|m|n)_l2(?P<l2>x|a_ef|b_ef|ab_el)_b1_mac(?P<mac>\d+)$")
_KNOBS = (r"_mma(?P<tm>\d+)x(?P<tn>\d+)_cl(?P<cm>\d+)x(?P<cn>\d+)_(?P<cta>1cta|2cta)"
          r"_(?P<st>tma|st)_r(?P<r>[mn])_sw(?P<sw>\d+)(?:_ck(?P<ck>\d+))?(?P<swap>_swap)?"
          r"(?P<cc>_cc)?_g(?P<g>\d+)")
_BI_DENSE_RE = re.compile(r"^(?P<fmt>e4m3|e5m2)_(?P<out>bf16|f16)_b(?P<bm>[kn])_C(?P<c>\d+)"
                          + _KNOBS + r"(?P<bl>_bL)?$")
_BI_SCALED_RE = re.compile(r"^(?P<fmt>nvfp4|mxfp4|nvfp4_k128|mxfp4_k128)_(?P<out>bf16|f16)"
                           r"_bk_C(?P<c>\d+)" + _KNOBS + r"$")
_BI_FIXUP_RE = re.compile(r"^splitk_fixup_C(?P<c>\d+)_(?P<out>bf16|f16)_(?P<chain>scaled|alpha)$")



def mm_fp4_request(kernel_name: str, arch: str, sm_count: int) -> KernelRequest | None:
    """The ``flashinfer.mm_fp4`` request behind an mm_fp4 disk name, or None."""
    m = _MM_FP4_RE.match(kernel_name)
    if m is None:
        return None
    g = m.groupdict()
    params = {
        "sf_vec_size": int(g["sf"]), "mma_tiler_mn": [int(g["tm"]), int(g["tn"])],
        "cluster_shape_mn": [int(g["cm"]), int(g["cn"])], "swap_ab": g["swap"] == "1",
        "use_prefetch": g["pf"] == "1", "kernel_type": g["kt"],
        "use_tma_store": None if g["tma"] == "x" else int(g["tma"]),
        "enable_pdl": g["pdl"] == "1", "out_dtype": g["dt"],
        "per_token_alpha": None if g["pta"] == "x" else g["pta"],
        "l2_policy": None if g["l2"] == "x" else g["l2"],
    }
    return KernelRequest("flashinfer.mm_fp4", params, arch, sm_count, int(g["mac"]))


def bi_request(module: str, kernel_name: str, call: tuple | None, arch: str,
               sm_count: int, in_fmt: str | None = None) -> KernelRequest | None:
    """The ``flashinfer.bi.*`` request behind a batch-invariant kernel name, given the (op, N,
    K) of the API call compiling it; None when it is not one the families build. A split-K
    fixup's name omits its class's input format: ``in_fmt``, else the one last seen for
    (op, arch, N, K)."""
    if call is None:
        return None
    op, n, k = call
    family = {"bmm_fp8": "flashinfer.bi.bmm_fp8", "mm_fp4": "flashinfer.bi.mm_fp4"}[op]
    if module == BI_DENSE_MODULE and (m := _BI_FIXUP_RE.match(kernel_name)):
        if (m["chain"] == "scaled") != (op == "bmm_fp8"):
            return None
        in_fmt = in_fmt or _BI_FMT.get((op, arch, n, k))
        params = {"kind": "fixup", "n": n, "k": k, "out_fmt": m["out"], "chunks": int(m["c"]),
                  "in_fmt": in_fmt}
        if in_fmt is None:
            return None
        return KernelRequest(family, params, arch, sm_count, 1)
    regex = _BI_DENSE_RE if op == "bmm_fp8" else _BI_SCALED_RE
    if module != BI_MODULES[op == "mm_fp4"] or not (m := regex.match(kernel_name)):
        return None
    g = m.groupdict()
    chunks = int(g["c"])
    if op == "bmm_fp8" and (g["bl"] is not None) != (chunks == 1):
        return None  # the one-product fp8 entry (mm_fp8), not bmm_fp8's class
    _BI_FMT[(op, arch, n, k)] = g["fmt"]
    params = {"kind": "gemm", "n": n, "k": k, "in_fmt": g["fmt"], "out_fmt": g["out"],
              "chunks": chunks, "b_major": g.get("bm") or "k", "knobs": {
                  "mma_tiler_mn": [int(g["tm"]), int(g["tn"])],
                  "cluster_shape_mn": [int(g["cm"]), int(g["cn"])],
                  "use_2cta_instrs": g["cta"] == "2cta", "use_tma_store": g["st"] == "tma",
                  "raster_along": g["r"], "swizzle_size": int(g["sw"]),
                  "cta_chunks": g["cc"] is not None, "cluster_k": int(g["ck"] or 1),
                  "swap_ab": g["swap"] is not None}}
    return KernelRequest(family, params, arch, sm_count, int(g["g"]))


#: the input format of the (op, arch, N, K) classes seen, for their split-K fixups
_BI_FMT: dict[tuple, str] = {}




def write_back_request(module: str, kernel: str, tvm_ffi: bool, source_sha256: str,
                       arch: str, sm_count: int,
                       key_files: tuple[str, ...] | None = None) -> KernelRequest:
    """The ``flashinfer.jit`` request of a kernel the daemon has no recipe for; ``key_files``
    (relative to the flashinfer package) when ``source_sha256`` hashes them by content
    (cached_client.identity.flashinfer_files_source), absent when it is FlashInfer's own."""
    params: dict = {"module": module, "kernel": kernel, "tvm_ffi": tvm_ffi,
                    "source_sha256": source_sha256}
    if key_files:
        params["key_files"] = sorted(key_files)
    return KernelRequest(WRITE_BACK_FAMILY, params, arch, sm_count, sm_count)
