"""The epilogue of :class:`~cached.families.hopper_fp8.kernel.HopperFp8GemmKernel`: the
fp32 sum times the per-tensor factor, converted to C's type, stored through shared memory
and TMA (clipped to C), or from registers guarded by C's bounds (epilogue_direct).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline


class Epilogue:
    """The epilogue half of the kernel (a mixin: the kernel's attributes)."""

    @cute.jit
    def store_tile(self, tma_c, sC, gC_t, tRS_acc, tRS_rF, tRS_rC, tRS_sC, tiled_r2s,
                   store_pipe, scale, tiles_executed, warp_idx, mC, gcC, crd, thr_c, acc,
                   mAScale, mBScale):
        """The epilogue of one output tile: through shared memory and TMA, or (swap_ab)
        from registers (thr_c: this thread's slice of the tiled MMA). acc is the sum the
        epilogue reads (tRS_acc is a view of it); per-token scales are applied to it first."""
        if cutlass.const_expr(self.token):
            self.apply_token_scales(mC, gcC[(None, None, crd[0], crd[1])], thr_c, acc,
                                    mAScale, mBScale)
        if cutlass.const_expr(self.direct_epi):
            self.epilogue_direct(mC, gC_t, gcC[(None, None, crd[0], crd[1])], thr_c, acc,
                                 scale)
        else:
            self.epilogue(tma_c, sC, gC_t, tRS_acc, tRS_rF, tRS_rC, tRS_sC, tiled_r2s,
                          store_pipe, scale, tiles_executed, warp_idx)

    @cute.jit
    def epilogue_direct(self, mC, gC_t, gcC_t, thr_c, acc, scale):
        """scale and convert as epilogue() does (fp32 product, then round to the output
        type), and store each element of this thread's fragment that lies inside mC.
        thr_c must be the thread's own MMA slice: its partition_C gives the positions of
        the accumulator's registers, in their order."""
        tCgC_t = thr_c.partition_C(gC_t)
        tCcC_t = thr_c.partition_C(gcC_t)
        rC = cute.make_rmem_tensor(acc.shape, self.c_dtype)
        if cutlass.const_expr(self.no_scale):
            # times 1.0 known only at run time (min(M, 1), M >= 1): exact, and the bf16
            # conversion then reads no wgmma accumulator register, which would make ptxas
            # serialize every wgmma of the kernel (swap_ab, S = 1, bf16 output: one full
            # wait per wgmma in the SASS; tests/test_hopper_bf16.py)
            one = cutlass.Float32(cutlass.min(mC.shape[0], 1))
            vals = acc.load() * one
            rC.store(vals.to(self.c_dtype))
        else:
            vals = acc.load() * scale
            rC.store(vals.to(self.c_dtype))
        for v in cutlass.range_constexpr(cute.size(acc)):
            if cute.elem_less(tCcC_t[v], mC.shape):
                tCgC_t[v] = rC[v]

    @cute.jit
    def epilogue(self, tma_c, sC, gC_t, tRS_acc, tRS_rF, tRS_rC, tRS_sC, tiled_r2s,
                 store_pipe, scale, tiles_executed, warp_idx):
        """scale, convert, stage through shared memory (stmatrix) and TMA-store one tile."""
        frag_size = cute.size(tRS_rF)
        gC_epi = cute.zipped_divide(gC_t, self.epi_tile)
        bSG_sC, bSG_gC = cute.nvgpu.cpasync.tma_partition(
            tma_c, 0, cute.make_layout(1),
            cute.group_modes(sC, 0, 2), gC_epi,
        )
        epi_num = cute.size(gC_epi, mode=[1])
        epi_shape = gC_epi.shape[1]
        epi_layout = cute.make_layout(epi_shape, stride=(epi_shape[1], 1))
        prev_epi = tiles_executed * epi_num
        epi_bar = self.epi_barrier
        store_warp = warp_idx == self.epi_store_warp
        first_buf = 0
        if cutlass.const_expr(self.pingpong):
            # this warpgroup's barrier (ids 1, 2), store warp and C buffers
            cwg = warp_idx // 4 - 1
            epi_bar = pipeline.NamedBarrier(barrier_id=cwg + 1, num_threads=self.tile_threads)
            store_warp = warp_idx % 4 == 0
            first_buf = cwg * self.epi_stages
        for e in cutlass.range_constexpr(epi_num):
            for v in cutlass.range_constexpr(frag_size):
                tRS_rF[v] = tRS_acc[e * frag_size + v]
            if cutlass.const_expr(self.no_scale):
                tRS_rC.store(tRS_rF.load().to(self.c_dtype))
            else:
                vals = tRS_rF.load() * scale
                tRS_rC.store(vals.to(self.c_dtype))
            buf = first_buf + (prev_epi + e) % self.epi_stages
            cute.copy(tiled_r2s, tRS_rC, tRS_sC[(None, None, None, buf)])
            cute.arch.fence_proxy("async.shared", space="cta")
            epi_bar.arrive_and_wait()
            if store_warp:
                cute.copy(tma_c, bSG_sC[(None, buf)],
                          bSG_gC[(None, epi_layout.get_hier_coord(e))])
                store_pipe.producer_commit()
                store_pipe.producer_acquire()
            epi_bar.arrive_and_wait()
