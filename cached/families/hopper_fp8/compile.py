"""Cross-compile one Hopper FP8 GEMM tactic to a host object file (no GPU needed).

Run in a worker process with CUTE_DSL_ARCH=sm_90a in the environment before cutlass
is imported (compile_to_object sets it if it is unset and cutlass is not imported yet,
and passes the arch in the compile options too).
"""

from __future__ import annotations

import os
import sys

from .tactic import TARGET_ARCH, HopperFp8Tactic


def _ensure_arch_env() -> None:
    arch = os.environ.get("CUTE_DSL_ARCH")
    if arch is None:
        if "cutlass" in sys.modules:
            # cutlass read its environment at import; the options string still sets the arch
            return
        os.environ["CUTE_DSL_ARCH"] = TARGET_ARCH
    elif arch != TARGET_ARCH:
        raise ValueError(
            f"CUTE_DSL_ARCH={arch!r} but the hopper_fp8 family targets {TARGET_ARCH}; "
            f"compile in a process started with CUTE_DSL_ARCH={TARGET_ARCH}"
        )


def compile_to_object(
    tactic: HopperFp8Tactic, max_active_clusters: int, object_path: str, symbol: str
) -> None:
    """Compile `tactic` for sm_90a and write a relocatable object to `object_path`.

    The object exports one TVM-FFI function named `symbol`. After linking
    (``gcc -shared -o k.so k.o -L<site>/nvidia_cutlass_dsl/cu13/lib -lcute_dsl_runtime
    -L<site>/tvm_ffi/lib -ltvm_ffi``) and ``tvm_ffi.load_module("k.so")[symbol]`` it is
    called as::

        fn(a, b, c, a_scale, b_scale, workspace, counters)   # returns None; torch's stream

    with torch CUDA tensors:
      a        (M, K) float8_e4m3fn (float8_e5m2 for ab_dtype="e5m2"), row-major (K contiguous)
      b        (N, K) same dtype as a, row-major (K contiguous)
      c        (M, N) bfloat16 / float16 per tactic.out_dtype, row-major, written entirely
      a_scale  (1,) float32 on the same device; (M,) for tactic.scales="token"
      b_scale  (1,) float32 on the same device; (N,) for tactic.scales="token"
      block128 a_scale (M, K/128) float32 column-major (strides (1, M)), b_scale
               (ceil(N/128), K/128) float32 row-major; K % 128 == 0
      workspace (W,) float32, W >= workspace_bytes(params, M, N) / 4 (split_mode "cta"
               only; any float32 tensor otherwise): fp32 partials, no initial value needed
      counters (C,) int32, C >= counter_elems(params, M, N) (split_mode "cta" only; any
               int32 tensor otherwise): zero-filled once when allocated, and left at zero
               by every launch (the last unit of a tile resets its counter)
    bf16 (tactic.ab_dtype = "bf16", scales "none"): a and b bfloat16, c bfloat16 / float16 /
    float32, a_scale and b_scale any (1,) float32 tensors (never read), c = cvt(a @ b.T).
    computing c = cvt((a @ b.T) * (a_scale * b_scale)) (per-token: the element (m, n)
    scaled by a_scale[m] * b_scale[n]). workspace_bytes / counter_elems
    are in cached_client.gemm.hopper_fp8. A "cta" kernel given smaller buffers writes nothing
    (no out-of-bounds access). One workspace serves one launch at a time (stream order).
    M, N, K are runtime values; a, b, c must be 16-byte aligned, N and K multiples of 16,
    M >= 1 (the launcher in cached_client.gemm.hopper_fp8 checks these). The stream is
    TVM-FFI's environment stream, i.e. the caller's current torch stream, so the call is
    CUDA-graph capturable.

    `max_active_clusters` (e.g. 132 // cluster_size on an H200) is baked into the grid
    size: grid = min(#tiles, max_active_clusters * cluster_size) CTAs.
    """
    tactic = tactic.normalized()
    if not isinstance(max_active_clusters, int) or max_active_clusters < 1:
        raise ValueError(
            f"max_active_clusters must be a positive int, got {max_active_clusters!r}"
        )
    if not symbol.isidentifier():
        raise ValueError(f"symbol must be a C identifier, got {symbol!r}")
    _ensure_arch_env()

    import cutlass
    import cutlass.cute as cute

    from .fragments import cutlass_dtypes
    from .kernel import HopperFp8GemmKernel

    ab_dtype, c_dtype = cutlass_dtypes(tactic)
    m = cute.sym_int()
    n = cute.sym_int(divisibility=16)
    k = cute.sym_int(divisibility=16)
    fake = cute.runtime.make_fake_compact_tensor
    a = fake(ab_dtype, (m, k), stride_order=(1, 0), assumed_align=16)
    b = fake(ab_dtype, (n, k), stride_order=(1, 0), assumed_align=16)
    c = fake(c_dtype, (m, n), stride_order=(1, 0), assumed_align=16)
    token = tactic.scales == "token"
    if tactic.scales == "block128":
        # a_scale (M, K/128) column-major, b_scale (N/128 rounded up, K/128) row-major
        kb = cute.sym_int()
        sa = fake(cutlass.Float32, (m, kb), stride_order=(0, 1), assumed_align=4)
        sb = fake(cutlass.Float32, (cute.sym_int(), kb), stride_order=(1, 0), assumed_align=4)
    else:
        sa = fake(cutlass.Float32, (m if token else 1,), assumed_align=4)
        sb = fake(cutlass.Float32, (n if token else 1,), assumed_align=4)
    ws = fake(cutlass.Float32, (cute.sym_int(),), assumed_align=4)
    cnt = fake(cutlass.Int32, (cute.sym_int(),), assumed_align=4)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)

    kern = HopperFp8GemmKernel(tactic)
    compiled = cute.compile(
        kern, a, b, c, sa, sb, ws, cnt, max_active_clusters, stream,
        options="--enable-tvm-ffi",
    )
    from .tactic import SMEM_CAPACITY_BYTES, STATIC_SMEM_BYTES, smem_bytes

    dyn = getattr(kern, "smem_dynamic_bytes", None)
    total = None if dyn is None else dyn + STATIC_SMEM_BYTES
    if total is not None and (total > SMEM_CAPACITY_BYTES or total > smem_bytes(tactic)):
        raise RuntimeError(
            f"{tactic.name}: kernel asks for {dyn} B of dynamic shared memory, more than the "
            f"tactic model's {smem_bytes(tactic) - STATIC_SMEM_BYTES} B; fix tactic.smem_bytes_for"
        )
    d = os.path.dirname(os.path.abspath(object_path))
    os.makedirs(d, exist_ok=True)
    compiled.export_to_c(object_path, function_name=symbol)
    if not os.path.isfile(object_path) or os.path.getsize(object_path) == 0:
        raise RuntimeError(f"export_to_c wrote no object at {object_path}")


def _main(argv: list[str]) -> int:
    import argparse
    import json
    import time

    from .tactic import tactic_from_params

    p = argparse.ArgumentParser(description="compile one hopper_fp8 tactic to a .o")
    p.add_argument("--params", required=True, help="tactic params as JSON")
    p.add_argument("--max-active-clusters", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--symbol", required=True)
    args = p.parse_args(argv)
    t = tactic_from_params(json.loads(args.params))
    t0 = time.perf_counter()
    compile_to_object(t, args.max_active_clusters, args.out, args.symbol)
    print(json.dumps({"tactic": t.name, "seconds": round(time.perf_counter() - t0, 2),
                      "object": args.out, "bytes": os.path.getsize(args.out)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
