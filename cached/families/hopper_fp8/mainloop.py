"""The consumer's K walk of :class:`~cached.families.hopper_fp8.kernel.HopperFp8GemmKernel`:
wgmma K tiles into the fp32 accumulator, fast (one batch in flight) or exact (promoted
into a second register tensor every K tile, in K order; block128 scales applied at the
promotion). Every stage read is released; a K range's sum depends only on its K tiles
(docs/hopper-fp8.md, "The kernel").
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from .fragments import PREFETCH_REGS, SCALE_SETS, BlockScales, block_pair_keys, fragment_keys


class KLoop:
    """The main-loop half of the kernel (a mixin: the kernel's attributes)."""

    @cute.jit
    def skip_stages(self, read_state, release_state, n):
        """Advance both consumer states past n stages (another warpgroup's tile)."""
        for _i in range(n):
            read_state.advance()
            release_state.advance()
        return read_state, release_state

    @cute.jit
    def mainloop(self, ab_pipe, tiled_mma, acc, tCrA, tCrB, read_state, release_state,
                 k_begin, k_end, may_be_empty: cutlass.Constexpr):
        """acc = the sum over K tiles [k_begin, k_end) from zero, in K order, one wgmma
        batch in flight; every stage read is released. Returns the pipeline states."""
        num_k_blocks = cute.size(tCrA, mode=[2])
        acc.fill(0.0)
        cute.nvgpu.warpgroup.fence()
        if cutlass.const_expr(may_be_empty):
            if k_end > k_begin:
                read_state, release_state = self.k_loop(
                    ab_pipe, tiled_mma, acc, tCrA, tCrB, read_state, release_state,
                    k_begin, k_end, num_k_blocks)
        else:
            read_state, release_state = self.k_loop(
                ab_pipe, tiled_mma, acc, tCrA, tCrB, read_state, release_state,
                k_begin, k_end, num_k_blocks)
        return read_state, release_state

    @cute.jit
    def range_sum(self, ab_pipe, tiled_mma, acc, dst, tCrA, tCrB, read_state, release_state,
                  k_begin, k_end, may_be_empty: cutlass.Constexpr, mC, gcC_t, thr_c, mAScale,
                  mBScale):
        """dst = the sum over K tiles [k_begin, k_end): exact, promoted (mainloop_promoted,
        dst another tensor than acc); fast, in the wgmma accumulator (mainloop; dst is acc).
        Returns the pipeline states."""
        if cutlass.const_expr(self.exact):
            read_state, release_state = self.mainloop_promoted(
                ab_pipe, tiled_mma, acc, dst, tCrA, tCrB, read_state, release_state, k_begin,
                k_end, mC, gcC_t, thr_c, mAScale, mBScale)
        else:
            read_state, release_state = self.mainloop(
                ab_pipe, tiled_mma, acc, tCrA, tCrB, read_state, release_state, k_begin, k_end,
                may_be_empty)
        return read_state, release_state

    @cute.jit
    def mainloop_promoted(self, ab_pipe, tiled_mma, acc, acc_sum, tCrA, tCrB, read_state,
                          release_state, k_begin, k_end, mC, gcC_t, thr_c, mAScale, mBScale):
        """acc_sum = ((0 + t_b) + t_b+1) + ... over the K tiles [k_begin, k_end) (0 for an
        empty range), t_i = K tile i's four k32 wgmma from zero (ACCUMULATE off for the
        first); each tile's wgmma retires before its stage is released and its sum added
        (block128, never split so k_begin = 0: t_i times the element's block scale
        product, module doc). Returns the pipeline states."""
        num_k_blocks = cute.size(tCrA, mode=[2])
        acc_sum.fill(0.0)
        if cutlass.const_expr(self.block):
            # per element: (row key, column key) of its scale product; the column key is
            # the weight block (block_pair_keys) or, swap_ab (MMA rows are weight rows),
            # the column. One scale register per distinct row and column key, one
            # product per distinct pair; all of this is Python ints, fixed at trace time
            # (no method is called on a container inside the K loop: the DSL would pass
            # it into the loop as a dynamic value).
            keys = ([(rk, ck) for rk, _, ck in fragment_keys(acc.shape)] if self.swap
                    else block_pair_keys(acc.shape))
            row_keys = list(dict.fromkeys(rk for rk, _ in keys))
            col_keys = list(dict.fromkeys(ck for _, ck in keys))
            pairs = list(dict.fromkeys((row_keys.index(rk), col_keys.index(ck))
                                       for rk, ck in keys))
            pair_of = [pairs.index((row_keys.index(rk), col_keys.index(ck)))
                       for rk, ck in keys]
            n_scales = len(row_keys) + len(col_keys)
            # indices once per tile, and SCALE_SETS register sets taken in turn (SCALE_SETS
            # K tiles per trip): a K tile forms its products from its set, then reloads that
            # set with the scales of SCALE_SETS K tiles on, so a load has that many K tiles
            # of wgmma to land (ptxas may hoist a product by one) and no copy between sets
            # waits on one. Where the sets would not fit beside the accumulators (one
            # scale per 8 columns of a wide tile): indices, loads and products per K tile.
            ahead_loaded = SCALE_SETS * n_scales + 2 * cute.size(acc) <= PREFETCH_REGS
            scales = cute.make_rmem_tensor((n_scales,), cutlass.Float32)
            blk = BlockScales(pairs, pair_of, len(row_keys), mAScale, mBScale)
        if cutlass.const_expr(self.block and ahead_loaded):
            sets = [scales] + [cute.make_rmem_tensor((n_scales,), cutlass.Float32)
                               for _ in range(SCALE_SETS - 1)]
            row_at, col_at = self.scale_indices(keys, row_keys, col_keys, mC, gcC_t, thr_c)
            last = k_end - 1
            for j in cutlass.range_constexpr(SCALE_SETS):
                self.load_block_scales(sets[j], cutlass.min(j, last), row_at, col_at, blk)
            for kq in range(k_end // SCALE_SETS):
                for j in cutlass.range_constexpr(SCALE_SETS):
                    prods = self.block_products(sets[j], blk)
                    read_state, release_state, tiled_mma = self.promoted_k_tile(
                        ab_pipe, tiled_mma, acc, acc_sum, tCrA, tCrB, read_state,
                        release_state, num_k_blocks, prods, blk,
                        (sets[j], cutlass.min(SCALE_SETS * (kq + 1) + j, last), row_at,
                         col_at))
            # the k_end % SCALE_SETS last K tiles, in sets 0, 1, ... (loaded last trip)
            for j in cutlass.range_constexpr(SCALE_SETS - 1):
                if k_end % SCALE_SETS > j:
                    tail_prods = self.block_products(sets[j], blk)
                    read_state, release_state, tiled_mma = self.promoted_k_tile(
                        ab_pipe, tiled_mma, acc, acc_sum, tCrA, tCrB, read_state,
                        release_state, num_k_blocks, tail_prods, blk, None)
        elif cutlass.const_expr(not self.block and (self.acc_copies + 1) * cute.size(acc)
                                <= PREFETCH_REGS):
            read_state, release_state, tiled_mma = self.promoted_overlapped(
                ab_pipe, tiled_mma, acc, acc_sum, tCrA, tCrB, read_state, release_state,
                k_begin, k_end, num_k_blocks)
        else:
            for kt in range(k_begin, k_end):
                if cutlass.const_expr(self.block):
                    rows_at, cols_at = self.scale_indices(keys, row_keys, col_keys, mC,
                                                          gcC_t, thr_c)
                    self.load_block_scales(scales, kt, rows_at, cols_at, blk)
                    prods = self.block_products(scales, blk)
                    read_state, release_state, tiled_mma = self.promoted_k_tile(
                        ab_pipe, tiled_mma, acc, acc_sum, tCrA, tCrB, read_state,
                        release_state, num_k_blocks, prods, blk, None)
                else:
                    read_state, release_state, tiled_mma = self.promoted_k_tile(
                        ab_pipe, tiled_mma, acc, acc_sum, tCrA, tCrB, read_state,
                        release_state, num_k_blocks, None, None, None)
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        return read_state, release_state

    @cute.jit
    def promoted_overlapped(self, ab_pipe, tiled_mma, acc, acc_sum, tCrA, tCrB, read_state,
                            release_state, k_begin, k_end, num_k_blocks: cutlass.Constexpr):
        """mainloop_promoted's sum, bitwise, two K tiles at a time: tile i's wgmma into
        ``acc`` and tile i+1's into a second accumulator are issued together, tile i is
        added (its stage released) once it retired while tile i+1 still runs, then tile
        i+1; an odd last tile alone. The adds stay in K-tile order, and no wgmma is in
        flight across the loop's back edge (ptxas would serialize every wgmma to copy a
        loop-carried accumulator). Returns the pipeline states and tiled_mma."""
        acc_b = cute.make_rmem_tensor(acc.shape, self.acc_dtype)
        n = k_end - k_begin
        for _kp in range(n // 2):
            tiled_mma = self.issue_k_tile(ab_pipe, tiled_mma, acc, tCrA, tCrB, read_state,
                                          num_k_blocks)
            read_state.advance()
            tiled_mma = self.issue_k_tile(ab_pipe, tiled_mma, acc_b, tCrA, tCrB, read_state,
                                          num_k_blocks)
            read_state.advance()
            release_state = self.retire_k_tile(ab_pipe, release_state, acc, acc_sum, 1)
            release_state = self.retire_k_tile(ab_pipe, release_state, acc_b, acc_sum, 0)
        if n % 2 == 1:
            tiled_mma = self.issue_k_tile(ab_pipe, tiled_mma, acc, tCrA, tCrB, read_state,
                                          num_k_blocks)
            read_state.advance()
            release_state = self.retire_k_tile(ab_pipe, release_state, acc, acc_sum, 0)
        return read_state, release_state, tiled_mma

    def issue_k_tile(self, ab_pipe, tiled_mma, dst, tCrA, tCrB, read_state, num_k_blocks):
        """Wait for the stage ``read_state`` names and issue its four k32 wgmma into ``dst``
        from zero (ACCUMULATE off for the first), one commit group; the caller advances
        read_state. Traced inline. Returns tiled_mma (the caller rebinds it)."""
        ab_pipe.consumer_wait(read_state)
        cute.nvgpu.warpgroup.fence()
        for kb in range(num_k_blocks):
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, kb != 0)
            kc = (None, None, kb, read_state.index)
            cute.gemm(tiled_mma, dst, tCrA[kc], tCrB[kc], dst)
        cute.nvgpu.warpgroup.commit_group()
        return tiled_mma

    def retire_k_tile(self, ab_pipe, release_state, src, acc_sum, pending):
        """Wait until at most ``pending`` wgmma groups are in flight (the oldest, whose
        accumulator is ``src``, has retired), release its stage, acc_sum += src. Traced
        inline."""
        cute.nvgpu.warpgroup.wait_group(pending)
        ab_pipe.consumer_release(release_state)
        release_state.advance()
        for v in range(cute.size(src)):
            acc_sum[v] = acc_sum[v] + src[v]
        return release_state

    def promoted_k_tile(self, ab_pipe, tiled_mma, acc, acc_sum, tCrA, tCrB, read_state,
                        release_state, num_k_blocks, prods, blk, load):
        """One K tile of mainloop_promoted: issue ``load`` = (dst, kt, row_at, col_at) (a
        later K tile's block scales, load_block_scales) or nothing, wait for the stage,
        its four k32 wgmma from zero, wait for them to retire, release the stage, then
        acc_sum += acc (block128: acc times the element's product from ``prods``, this K
        tile's, block_products). Traced inline (Python loops, unrolled). Returns the
        pipeline states and tiled_mma (its ACCUMULATE field is set here: the caller rebinds
        it, so the DSL carries it through the K loop)."""
        if load is not None:
            self.load_block_scales(*load, blk)
        tiled_mma = self.issue_k_tile(ab_pipe, tiled_mma, acc, tCrA, tCrB, read_state,
                                      num_k_blocks)
        cute.nvgpu.warpgroup.wait_group(0)
        ab_pipe.consumer_release(release_state)
        release_state.advance()
        read_state.advance()
        for v in range(cute.size(acc)):
            if prods is None:
                acc_sum[v] = acc_sum[v] + acc[v]
            else:
                acc_sum[v] = acc_sum[v] + acc[v] * prods[blk.pair_of[v]]
        return read_state, release_state, tiled_mma

    @cute.jit
    def k_loop(self, ab_pipe, tiled_mma, acc, tCrA, tCrB, read_state, release_state,
               k_begin, k_end, num_k_blocks: cutlass.Constexpr):
        # first K tile: nothing to release yet
        ab_pipe.consumer_wait(read_state)
        for kb in cutlass.range_constexpr(num_k_blocks):
            kc = (None, None, kb, read_state.index)
            cute.gemm(tiled_mma, acc, tCrA[kc], tCrB[kc], acc)
        cute.nvgpu.warpgroup.commit_group()
        read_state.advance()

        for _kt in range(k_begin + 1, k_end):
            ab_pipe.consumer_wait(read_state)
            for kb in cutlass.range_constexpr(num_k_blocks):
                kc = (None, None, kb, read_state.index)
                cute.gemm(tiled_mma, acc, tCrA[kc], tCrB[kc], acc)
            cute.nvgpu.warpgroup.commit_group()
            # the previous K tile's wgmma has retired: give its stage back
            cute.nvgpu.warpgroup.wait_group(1)
            ab_pipe.consumer_release(release_state)
            release_state.advance()
            read_state.advance()

        cute.nvgpu.warpgroup.wait_group(0)
        ab_pipe.consumer_release(release_state)
        release_state.advance()
        return read_state, release_state
