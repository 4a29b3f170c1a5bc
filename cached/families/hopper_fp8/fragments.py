"""What the kernel fixes at trace time outside its class: the cutlass types of a tactic's
operands and output, register budgets, and the keys of a wgmma accumulator fragment's
elements (which row, 8-column group and column each holds; block128's scale products).
Pure Python but for the cutlass type table.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import cutlass

from .tactic import HopperFp8Tactic

_AB_DTYPES = {"e4m3": cutlass.Float8E4M3FN, "e5m2": cutlass.Float8E5M2,
              "bf16": cutlass.BFloat16}
_OUT_DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16,
               "float32": cutlass.Float32}

PRODUCER_REGS = 40
BLOCK_COLUMNS = 128  # the block128 scheme's weight block width (columns of C)
# block128: scales are loaded K tiles early where SCALE_SETS x scales + 2 x accumulator
# registers per thread stay within this (a 128x128 tile: 3 x 3 + 128; a 192-wide one,
# 3 x 26 + 192, does not: loading ahead made it 1.4-2x slower, docs/history.md, block FP8 run 5)
PREFETCH_REGS = 160
# exact, not block128: two K tiles at a time in two wgmma accumulators (promoted_overlapped)
# where the tactic's accumulator copies and the second wgmma accumulator fit in PREFETCH_REGS
SCALE_SETS = 3  # block128: register sets of those scales, so loads run this many K tiles ahead


class BlockScales(NamedTuple):
    """A block128 fragment's scale plan, fixed at trace time: the distinct (row index,
    column index) pairs into a thread's scale registers [rows..., columns...], the pair of
    each accumulator element, the row count, and the two scale tensors."""

    pairs: list
    pair_of: list
    n_rows: int
    a_scale: Any
    b_scale: Any


def fragment_keys(shape) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """Per element v of a wgmma accumulator fragment of static shape ((2, 2, N/8), MMA_M,
    MMA_N) (the N/8 mode absent when N = 8; colexicographic, as fragment[v] indexes it):
    (row key, 8-column-group key, column key). Elements with one row key share their row,
    with one group key their 8 aligned columns (so their 128-column weight block), with
    one column key their column. Raises ValueError for any other shape."""
    ok = (isinstance(shape, tuple) and len(shape) == 3 and isinstance(shape[0], tuple)
          and tuple(shape[0][:2]) == (2, 2) and len(shape[0]) in (2, 3)
          and all(isinstance(d, int) for d in (*shape[0], shape[1], shape[2])))
    if not ok:
        raise ValueError(f"unexpected wgmma accumulator fragment shape {shape}")
    dims = [2, 2, shape[0][2] if len(shape[0]) == 3 else 1, shape[1], shape[2]]
    keys = []
    for v in range(dims[0] * dims[1] * dims[2] * dims[3] * dims[4]):
        i, crd = v, []
        for d in dims:
            crd.append(i % d)
            i //= d
        pair, half, group, mma_m, mma_n = crd
        keys.append(((half, mma_m), (group, mma_n), (pair, group, mma_n)))
    return keys


def block_pair_keys(shape) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Per element v of a wgmma accumulator fragment (fragment_keys' shape), the (row key,
    column key) of its block128 scale product a_scale[m, kt] * b_scale[n // 128, kt], MMA
    rows being activation rows. The fragment spans W = N_atom x MMA_N columns from a first
    column that is a multiple of W (the tile's, plus the warpgroup's offset). Where W
    divides 128 or is a multiple of it, columns at one offset // 128 lie in one weight
    block, so they share one key (a 128-wide fragment: one b_scale per K tile, two
    products); otherwise the key is the 8-column group, which never spans two blocks."""
    keys = fragment_keys(shape)
    n_atom = shape[0][2] * 8 if len(shape[0]) == 3 else 8
    width = n_atom * shape[2]
    if width % BLOCK_COLUMNS and BLOCK_COLUMNS % width:
        return [(rk, gk) for rk, gk, _ in keys]
    return [(rk, ((gk[1] * n_atom + gk[0] * 8) // BLOCK_COLUMNS,)) for rk, gk, _ in keys]


def cutlass_dtypes(t: HopperFp8Tactic):
    return _AB_DTYPES[t.ab_dtype], _OUT_DTYPES[t.out_dtype]
