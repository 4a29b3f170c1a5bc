"""Host cost of one call of a torch op (issue 36), CPU.

1. The dispatch alone, registered two ways: through ``torch.library.custom_op`` (how
   ``cached::fp8_gemm`` was registered) and straight with the dispatcher (``Library.define`` +
   ``impl`` + ``register_fake``, how ``cached::fp8_gemm`` and ``cached::bf16_gemm`` are now, as
   vLLM's ``direct_register_custom_op``). Both bodies return one preallocated tensor.
2. ``cached::fp8_gemm`` whole: its body (``cached_client.integrations.vllm.kernel.fp8_gemm``,
   registered for CPU under this bench's namespace) running a loaded ``cached.hopper_fp8``
   plan (per-tensor and per-token scales, N = K = 256, buckets up to M = 256, split-K tactics
   with their workspace) whose kernels are no-ops: dispatch, the body's host work (bucket,
   output allocation), no launch; and beside it the same op whose body calls the plan's
   checked ``__call__`` (``check_gemm_args``, ``check_workspace``: the op's body before its
   checks moved to the layer's load). The tensors are CPU ones that answer ``is_cuda``
   (the checks' one CUDA-only question). Needs the vLLM environment (the op's module
   imports vLLM); run it against another checkout's client with that checkout's
   ``client`` first on ``PYTHONPATH``.

What an op costs on the host where it runs outside a captured CUDA graph (a prefill's
uncaptured piecewise graph calls it once per layer).

  .venv-vllm/bin/python bench/op_dispatch.py [--calls N]
  (median of 7 runs of N calls, microseconds per call)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

SCHEMA = "(Tensor a, Tensor b, Tensor a_scale, Tensor b_scale, int plan, ScalarType out_dtype)"
N = K = 256
M = 8


@torch.library.custom_op("op_dispatch_bench::via_custom_op", mutates_args=())
def via_custom_op(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor,
                  b_scale: torch.Tensor, plan: int, out_dtype: torch.dtype) -> torch.Tensor:
    return _result()


def _result() -> torch.Tensor:
    return RESULTS.pop()


RESULTS: list[torch.Tensor] = []
_lib = torch.library.Library("op_dispatch_bench", "FRAGMENT")
_lib.define("direct" + SCHEMA + " -> Tensor")
_lib.impl("direct", lambda a, b, sa, sb, plan, dt: _result(), "CPU")


class OnDevice(torch.Tensor):
    """A CPU tensor that answers ``is_cuda`` (no torch-function override: plain speed)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def _time(op, args: tuple, calls: int, fresh: bool = False) -> float:
    runs = []
    for _ in range(7):
        if fresh:
            RESULTS[:] = [torch.empty(4, 4) for _ in range(calls)]  # no aliasing
        t0 = time.perf_counter()
        for _ in range(calls):
            op(*args)
        runs.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(runs)


def _fp8_plans() -> list[tuple[str, tuple]]:
    """The op and its arguments for a loaded plan of each scheme (registered in the op's
    plan table)."""
    from cached_client.gemm import plan as gp
    from cached_client.gemm import policy
    from cached_client.integrations.vllm import kernel
    from cached_client.keys import KernelRequest

    _lib.impl("fp8_gemm_cpu", kernel.fp8_gemm, "CPU")
    # the body as it was: the loaded plan's checked call (check_gemm_args, check_workspace)
    _lib.impl("fp8_gemm_checked", lambda a, b, sa, sb, plan, dt: kernel._gemms[plan](
        a, b, sa, sb), "CPU")
    cases = []
    for scales in ("tensor", "token"):
        params = {"splits": 4, "split_mode": "cta", "tile_m": 64, "tile_n": 128,
                  "scales": scales}
        buckets = [policy.BucketChoice(u, KernelRequest(gp.HOPPER_FAMILY, params, "sm_90a",
                                                        132, 1), "c", "plan order")
                   for u in gp.buckets_up_to(256)]
        key = gp.PlanKey("linear", N, K, "e4m3", "bfloat16", "sm_90a", 132, None, scales)
        choice = policy.TacticChoice(gp.HOPPER_FAMILY, N, K, "sm_90a", True, buckets, "c",
                                     "bench")
        loaded = gp.HopperFp8Gemm(gp.GemmPlan(key, gp.HOPPER_FAMILY, choice, 256),
                                  [lambda *args: None] * len(buckets), "cpu")
        kernel._gemms.append(loaded)
        fp8 = torch.float8_e4m3fn
        a = torch.empty(M, K, dtype=fp8).as_subclass(OnDevice)
        b = torch.empty(N, K, dtype=fp8).as_subclass(OnDevice)
        sa = torch.ones(1 if scales == "tensor" else M).as_subclass(OnDevice)
        sb = torch.ones(1 if scales == "tensor" else N).as_subclass(OnDevice)
        cases.append((scales, (a, b, sa, sb, len(kernel._gemms) - 1, torch.bfloat16)))
    return cases


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=20000)
    args = p.parse_args()
    print(f"torch {torch.__version__}")
    a, s = torch.empty(4, 8), torch.ones(1)
    for name, op in (("torch.library.custom_op", torch.ops.op_dispatch_bench.via_custom_op),
                     ("Library.define + impl", torch.ops.op_dispatch_bench.direct)):
        print(f"{name}: {_time(op, (a, a, s, s, 0, torch.bfloat16), args.calls, True):.2f} "
              "us per call")
    for name in ("fp8_gemm_cpu", "fp8_gemm_checked"):
        _lib.define(name + SCHEMA + " -> Tensor")
    ops = torch.ops.op_dispatch_bench
    for scales, op_args in _fp8_plans():
        for name, op in (("cached::fp8_gemm", ops.fp8_gemm_cpu),
                         ("  the same, checked per call", ops.fp8_gemm_checked)):
            print(f"{name} ({scales} scales, M={M} N={N} K={K}, no launch): "
                  f"{_time(op, op_args, args.calls):.2f} us per call")


if __name__ == "__main__":
    main()
