"""The scale reads of :class:`~cached.families.hopper_fp8.kernel.HopperFp8GemmKernel`:
per-token x per-channel scales before the epilogue, block128 scales per K tile (indices
clamped into C: an element outside C reads a valid scale and is never stored).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute


class Scales:
    """The scale half of the kernel (a mixin: the kernel's attributes)."""

    def block_products(self, scales, blk):
        """The block128 scale product of each pair of blk.pairs from a thread's scale
        registers ``scales`` [rows..., columns...], in the order a_scale * b_scale.
        Traced inline."""
        prods = []
        for ri, ci in blk.pairs:
            rs, cs = scales[ri], scales[blk.n_rows + ci]
            prods.append(cs * rs if self.swap else rs * cs)
        return prods

    def scale_indices(self, keys, row_keys, col_keys, mC, gcC_t, thr_c):
        """(row_at, col_at): per row key and per column key of ``keys`` (the fragment's
        (row key, column key) per element) the index of its first element's row and
        column, clamped into C. Traced inline by mainloop_promoted."""
        tCcC_t = thr_c.partition_C(gcC_t)
        last_r, last_c = mC.shape[0] - 1, mC.shape[1] - 1
        first_row = [k[0] for k in keys]
        first_col = [k[1] for k in keys]
        return ([cutlass.min(tCcC_t[first_row.index(rk)][0], last_r) for rk in row_keys],
                [cutlass.min(tCcC_t[first_col.index(ck)][1], last_c) for ck in col_keys])

    def load_block_scales(self, dst, kt, row_at, col_at, blk):
        """dst = [row scales..., column scales...] of K tile kt: a_scale[m, kt] per row m of
        row_at and b_scale[n // 128, kt] per column n of col_at (swap_ab: rows are weight
        rows n, columns activation rows m); the indices are clamped into C, so every load
        is in bounds. Traced inline."""
        for i, r in enumerate(row_at):
            dst[i] = blk.b_scale[r // 128, kt] if self.swap else blk.a_scale[r, kt]
        for i, c in enumerate(col_at):
            dst[len(row_at) + i] = (blk.a_scale[c, kt] if self.swap
                                    else blk.b_scale[c // 128, kt])

    @cute.jit
    def apply_token_scales(self, mC, gcC_t, thr_c, acc, mAScale, mBScale):
        """acc[v] *= a_scale[m] * b_scale[n] for this thread's elements (m, n) (swap_ab: the
        MMA's (row, col) is (n, m)). Indices are clamped into C, so every load is in bounds
        and unconditional (loads of one row or column are shared); elements outside C get
        the edge's scale and are never stored."""
        tCcC_t = thr_c.partition_C(gcC_t)
        last_r, last_c = mC.shape[0] - 1, mC.shape[1] - 1
        for v in cutlass.range_constexpr(cute.size(acc)):
            crd = tCcC_t[v]
            r, c = cutlass.min(crd[0], last_r), cutlass.min(crd[1], last_c)
            if cutlass.const_expr(self.swap):
                acc[v] = acc[v] * (mAScale[c] * mBScale[r])
            else:
                acc[v] = acc[v] * (mAScale[r] * mBScale[c])
