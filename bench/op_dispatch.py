"""Host cost of one call of a torch op registered two ways (issue 36): through
``torch.library.custom_op`` (how ``cached::fp8_gemm`` was registered) and straight with the
dispatcher (``Library.define`` + ``impl`` + ``register_fake``, how ``cached::fp8_gemm`` and
``cached::bf16_gemm`` are now, as vLLM's ``direct_register_custom_op``). Both bodies return
one preallocated tensor, so the figure is the dispatch alone: what an op costs on the host
where it runs outside a captured CUDA graph (a prefill's uncaptured piecewise graph calls
the op once per layer). CPU tensors; the dispatch path is the same for CUDA ones.

  python bench/op_dispatch.py [--calls N]   (median of 7 runs of N calls, microseconds)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

SCHEMA = "(Tensor a, Tensor b, Tensor a_scale, Tensor b_scale, int plan, ScalarType out_dtype)"


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


def _time(op, calls: int) -> float:
    a = torch.empty(4, 8)
    s = torch.ones(1)
    runs = []
    for _ in range(7):
        RESULTS[:] = [torch.empty(4, 4) for _ in range(calls)]  # fresh outputs: no aliasing
        t0 = time.perf_counter()
        for _ in range(calls):
            op(a, a, s, s, 0, torch.bfloat16)
        runs.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(runs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=20000)
    args = p.parse_args()
    print(f"torch {torch.__version__}")
    for name, op in (("torch.library.custom_op", torch.ops.op_dispatch_bench.via_custom_op),
                     ("Library.define + impl", torch.ops.op_dispatch_bench.direct)):
        print(f"{name}: {_time(op, args.calls):.2f} us per call")


if __name__ == "__main__":
    main()
