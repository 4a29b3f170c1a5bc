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

``cached tune`` tunes it as the scheme ``bf16`` (bf16 operands, no scales): winners filed
under the bf16 class, never an FP8 one (the class ids differ: ``k64`` against ``k128``);
correct within accuracy.bf16_error_bound (the output's rounding, fp32 accumulation over
K / S).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from cached_client.errors import InvalidTactic

from ..hopper_fp8 import accuracy, space, tactic, winners
from ..hopper_fp8.family import HopperFp8

PLAN_OPTIONS = ("out_dtype", "ab_dtype", "batch_invariant", "reduction_class")
#: ``cached tune``'s scheme of this family: bf16 operands, no scales (no plan option)
TUNE_SCHEMES: dict[str, dict[str, Any]] = {"bf16": {}}


class HopperBf16(HopperFp8):
    name = tactic.BF16_FAMILY
    ab_dtypes = (tactic.BF16,)
    out_dtypes = tactic.BF16_OUT_DTYPES
    symbol_prefix = "cached_hopper_bf16_"

    def reduction_classes(self) -> tuple[str, ...]:
        return tactic.BF16_REDUCTION_CLASSES

    def tune_schemes(self) -> dict[str, dict[str, Any]]:
        """{"bf16": {}}: one scheme, no plan option beyond the operand type."""
        return {name: dict(opts) for name, opts in TUNE_SCHEMES.items()}

    def tune_error_bound(self, reduction_class: str, k: int, floor: float) -> float:
        """accuracy.bf16_error_bound: the floor, and fp32 accumulation over K / S."""
        return accuracy.bf16_error_bound(reduction_class, k, floor)

    def tune_neighbours(self, n: int, k: int, m: int, sm_count: int, reduction_class: str,
                        options: Mapping[str, Any], near: int) -> list[dict]:
        """The FP8 family's recorded winners (winners.recorded_winners: same bytes per K
        tile row, so the same tiles and stages fit) at bucket M of the ``near`` recorded
        (N, K) of this SM count nearest to (N, K) in (log N, log K), nearest first, with S
        of the class, as bf16 tactics; one that is no valid bf16 tactic is left out (the
        tuner takes only those its plan lists)."""
        splits = tactic.bf16_class_splits(reduction_class)
        out_dtype = options.get("out_dtype", "bfloat16")
        found = []
        for key in winners.nearest_keys(n, k, m, sm_count, splits, near):
            try:
                t = winners.tactic_from_key(key, splits, "bfloat16", "e4m3")
                t = dataclasses.replace(t, ab_dtype=tactic.BF16, scales=tactic.NO_SCALES,
                                        accum="fast", out_dtype=out_dtype,
                                        stages=0).normalized()
            except ValueError:
                continue
            found.append(t.to_params())
        return found

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
