"""Family ``cached.hopper_bf16``: C = A @ B^T on bf16 operands for sm_90a, served by the
daemon. The cached.hopper_fp8 machinery (kernel.py, tactic.py, space.py, cost.py,
compile.py) with ``ab_dtype="bf16"``: a K tile of 64 elements (128 bytes a row, as FP8's
128), four wgmma k16 per K tile, scale scheme ``"none"`` (no scale is read; the fp32 sum is
rounded once to the output type), fast accumulation only (the bf16 wgmma accumulates in
fp32). No bias: the caller adds it.

Reduction-order classes ``k64.acc1.s{S}.fixed`` (tactic.BF16_REDUCTION_CLASSES): the K
tiles of 64, S fixed-order split-K ranges summed in split order. Within a class the result
of a row does not depend on M, so a batch-invariant plan mixes tactics of one class across
M, never two classes.

Plan options: ``out_dtype`` ("bfloat16", the default, "float16" or "float32"),
``ab_dtype`` ("bf16" only), ``batch_invariant: true`` (only the class with
``space.choose_split(N, K, sm_count, "bf16")`` splits, the same for every M) and
``reduction_class: "<id>"`` (only that class; wins over ``batch_invariant``). Any other
option is refused (InvalidTactic naming it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cached_client.errors import InvalidTactic

from ..hopper_fp8 import space, tactic
from ..hopper_fp8.family import HopperFp8

PLAN_OPTIONS = ("out_dtype", "ab_dtype", "batch_invariant", "reduction_class")


class HopperBf16(HopperFp8):
    name = tactic.BF16_FAMILY
    ab_dtypes = (tactic.BF16,)
    out_dtypes = tactic.BF16_OUT_DTYPES
    symbol_prefix = "cached_hopper_bf16_"

    def reduction_classes(self) -> tuple[str, ...]:
        return tactic.BF16_REDUCTION_CLASSES

    def tune_schemes(self) -> dict[str, dict[str, Any]]:
        """None yet (the FP8 family's schemes are not this family's options, and the tune
        timer builds FP8 operands): a bf16 plan runs the cost model's order."""
        return {}

    def plan_scheme(self, shape: tuple[int, int, int], sm_count: int,
                    options: Mapping[str, Any]) -> tuple[int | None, str, str]:
        """(S or None for every S, "none", "fast") of what the options ask for."""
        unknown = sorted(set(options) - set(PLAN_OPTIONS))
        if unknown:
            raise InvalidTactic(f"{self.name} takes the plan options {', '.join(PLAN_OPTIONS)};"
                                f" unknown: {', '.join(map(str, unknown))} (bf16 operands have "
                                f"no scales and one accumulation mode)")
        bi = options.get("batch_invariant", False)
        if not isinstance(bi, bool):
            raise InvalidTactic(f"option batch_invariant must be true or false, got {bi!r}")
        rc = options.get("reduction_class")
        if rc is not None:
            if not isinstance(rc, str):
                raise InvalidTactic(f"option reduction_class must be a string, got {rc!r}")
            try:
                return tactic.bf16_class_splits(rc), tactic.NO_SCALES, "fast"
            except ValueError as exc:
                raise InvalidTactic(str(exc)) from None
        if bi:
            _, n, k = shape
            return space.choose_split(n, k, sm_count, tactic.BF16), tactic.NO_SCALES, "fast"
        return None, tactic.NO_SCALES, "fast"
