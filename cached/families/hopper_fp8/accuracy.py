"""How far a correct Hopper FP8 kernel's output may be from a float32 reference, by class.

Errors are relative Frobenius norms, ``‖out − ref‖ / ‖ref‖``, on Gaussian FP8 operands
(``cached tune``'s data). Two parts add in quadrature:

* the **floor**: the output type's rounding of the exact result, measured on the same data
  by the caller (``‖ref.to(out_dtype) − ref‖ / ‖ref‖``; about 1.6e-3 for bf16). Exact
  classes (``prom128``: fp32 promotion every K tile) stay at it at any K.
* **fast accumulation** (``acc1``): one wgmma accumulator walks the whole K range of a
  split, losing precision as it grows: FAST_AT_4096 at K = 4096, growing as K ** FAST_POWER
  with the K one accumulator walks (K / S). Fitted to the H200 runs (relative error against
  float32 of fast-accumulation plans: 2.1e-3 at K = 3584-4096, 3.3e-3 at 14336, 3.8e-3 at
  18944, 5.0e-3 at 32768; docs/benchmarks.md).

:func:`error_bound` is the expected error times a margin (FAST_MARGIN, EXACT_MARGIN): wide
enough for data and run-to-run spread, far below what a wrong kernel gives (a wrong scale,
K tile or row is an error of order 1e-1 or more). Imports neither cutlass nor torch.
"""

from __future__ import annotations

import math

from .tactic import bf16_class_splits, class_scheme

FAST_AT_4096 = 1.27e-3  # fast accumulation's own part at K = 4096 (the floor taken out)
FAST_POWER = 0.63  # its growth with the K one accumulator walks
FAST_MARGIN = 2.0
EXACT_MARGIN = 1.25
BF16_ACC_AT_4096 = 2.5e-6  # fp32 accumulation's part at K = 4096 (bf16 operands)
BF16_ACC_POWER = 0.5
BF16_MARGIN = 2.0


def fast_part(k_per_accumulator: int) -> float:
    """Fast accumulation's expected relative error over ``k_per_accumulator`` of K."""
    return FAST_AT_4096 * (k_per_accumulator / 4096) ** FAST_POWER


def _check_k_floor(k: int, floor: float) -> None:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    if not (isinstance(floor, float | int) and math.isfinite(floor) and floor > 0):
        raise ValueError(f"floor must be a positive finite number, got {floor!r}")


def expected_error(reduction_class: str, k: int, floor: float) -> float:
    """The relative error a correct kernel of the class is expected to give at K = ``k``
    with output rounding ``floor``. ValueError for an unknown class, a K < 1 or a floor
    that is not a positive finite number."""
    splits, accum, _ = class_scheme(reduction_class)
    _check_k_floor(k, floor)
    if accum == "exact":
        return float(floor)
    return math.hypot(floor, fast_part(-(-k // splits)))


def error_bound(reduction_class: str, k: int, floor: float) -> float:
    """The largest relative error a kernel of the class may give at K = ``k`` and still
    count as correct: expected_error times FAST_MARGIN (fast classes) or EXACT_MARGIN."""
    margin = EXACT_MARGIN if class_scheme(reduction_class)[1] == "exact" else FAST_MARGIN
    return margin * expected_error(reduction_class, k, floor)


def bf16_expected_error(reduction_class: str, k: int, floor: float) -> float:
    """The relative error a correct kernel of a bf16 class (S fixed-order splits) is
    expected to give at K = ``k`` with output rounding ``floor``: the floor and fp32
    accumulation over K / S in quadrature. ValueError for a class of no bf16 family, a K < 1
    or a floor that is not a positive finite number."""
    splits = bf16_class_splits(reduction_class)
    _check_k_floor(k, floor)
    return math.hypot(floor, BF16_ACC_AT_4096 * (-(-k // splits) / 4096) ** BF16_ACC_POWER)


def bf16_error_bound(reduction_class: str, k: int, floor: float) -> float:
    """The largest relative error a kernel of a bf16 class may give at K = ``k`` and still
    count as correct: bf16_expected_error times BF16_MARGIN."""
    return BF16_MARGIN * bf16_expected_error(reduction_class, k, floor)
