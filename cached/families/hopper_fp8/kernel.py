"""Hopper (sm_90a) FP8 and BF16 GEMM in CuTe-DSL: C = cvt((A @ B^T) * scale).

A (M, K), B (N, K) K-major (float8 e4m3fn/e5m2, or bf16); C (M, N) row-major. M, N, K are
symbolic: one compiled kernel serves every shape (N, K multiples of 16); TMA loads
zero-fill and TMA stores clip out-of-range rows and columns. Scales are read on the device
(CUDA-graph safe). Invariants: a row's result depends only on (K, the tactic's reduction
class), never on M or on which CTA computed it; every stage a consumer reads is released;
a persistent CTA's tiles are walked in the tactic's raster order. The design (warp roles,
split-K, swap-AB, ping-pong, exact accumulation, the scale schemes) is docs/hopper-fp8.md.
The class's device halves live beside it: mainloop.py (the K walk), scales.py, epilogue.py;
fragments.py holds its trace-time tables.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

from .epilogue import Epilogue
from .fragments import PRODUCER_REGS
from .mainloop import KLoop
from .scales import Scales
from .tactic import (
    CONSUMER_MAX_REGS,
    EPI_STAGES,
    HopperFp8Tactic,
    acc_sets,
    epilogue_tile,
    mma_tile,
    num_consumer_warpgroups,
    register_epilogue,
    tile_epilogue,
)


class HopperFp8GemmKernel(KLoop, Scales, Epilogue):
    """Warp-specialized persistent FP8/BF16 GEMM for sm_90a (docs/hopper-fp8.md)."""

    def __init__(self, tactic: HopperFp8Tactic):
        tactic.validate()
        self.tactic = tactic
        self.acc_dtype = cutlass.Float32
        self.cluster_shape_mn = (tactic.cluster_m, tactic.cluster_n)
        self.swizzle = tactic.swizzle
        self.swap = tactic.swap_ab
        # raster names the output dimension walked first; the kernel's M is N when swapped
        self.raster_along_m = (tactic.raster == "m") != self.swap
        self.stages = tactic.stages
        # the K tile: 128 bytes of an operand row (128 FP8 or 64 bf16 elements)
        self.tile_shape_mnk = (*mma_tile(tactic.tile_m, tactic.tile_n, self.swap),
                               tactic.tile_k)
        # consumer warpgroups along N (wg_n = 2): one 64-row wgmma M side, the tile's N
        # columns in two halves, one per warpgroup; else the warpgroups stack along M
        self.wg_n = tactic.wg_n
        # ping-pong (tactic.pingpong): two consumer warpgroups, each with whole tiles of
        # its own (the CTA's tiles alternate between them); the tiled MMA is one
        # warpgroup's m64 atom, repeated along M for a 128-row tile
        self.pingpong = tactic.pingpong
        self.num_mma_wg = tactic.consumer_warpgroups
        self.atom_layout_mnk = ((1, 2, 1) if self.wg_n == 2 else (1, 1, 1) if self.pingpong
                                else (num_consumer_warpgroups(self.tile_shape_mnk[0]), 1, 1))
        # swap_ab stores C from registers (epilogue_direct); wg_n = 2 and the narrow
        # decode tiles (64 x 40/48/56) stage the whole
        # tile through shared memory (plain stores in the MMA's register layout) and
        # TMA-stores it at once
        self.direct_epi = register_epilogue(self.swap, self.wg_n)
        self.tile_epi = tile_epilogue(tactic.tile_n, self.wg_n, self.swap)
        self.threads_per_wg = 128
        self.num_mma_threads = self.num_mma_wg * self.threads_per_wg
        self.threads_per_cta = (1 + self.num_mma_wg) * self.threads_per_wg
        self.producer_warp = 0
        self.epi_store_warp = 4  # first warp of the first consumer warpgroup
        # a register epilogue's C buffer is a never-used 8x64 placeholder; wg_n = 2 stores
        # the whole tile from one buffer
        self.epi_tile = ((8, 64) if self.direct_epi else
                         (tactic.tile_m, tactic.tile_n) if self.tile_epi else
                         epilogue_tile(tactic.tile_m, tactic.tile_n, tactic.pingpong))
        self.epi_stages = 1 if self.tile_epi else EPI_STAGES
        # C buffers: one ring of epi_stages per warpgroup that stores tiles on its own
        self.epi_buffers = self.epi_stages * (2 if self.pingpong else 1)
        # threads that share one output tile (and its epilogue barrier)
        self.tile_threads = self.threads_per_wg if self.pingpong else self.num_mma_threads
        self.num_mcast_a = self.cluster_shape_mn[1]
        self.num_mcast_b = self.cluster_shape_mn[0]
        self.buffer_align = 1024
        self.epi_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=self.num_mma_threads)
        self.splits = tactic.splits
        self.split_cta = tactic.splits > 1 and tactic.split_mode == "cta"
        self.split_serial = tactic.splits > 1 and tactic.split_mode == "serial"
        # work units per output tile in the persistent schedule
        self.units_per_tile = tactic.splits if self.split_cta else 1
        # programmatic dependent launch: launched so that it may start while the previous
        # kernel on the stream runs; griddepcontrol.wait before any global read or write
        self.pdl = tactic.pdl
        self.token = tactic.scales == "token"  # per-token x per-channel scales
        self.block = tactic.scales == "block128"  # 1x128 x 128x128 scales at the promotion
        self.exact = tactic.accum == "exact"  # promoted into fp32 registers every K tile
        # bf16 operands: no scale is read and the epilogue rounds the fp32 sum as it is
        self.no_scale = tactic.scales == "none"
        # fp32 accumulator copies a consumer thread holds (tactic.acc_sets)
        self.acc_copies = acc_sets(tactic.splits, tactic.split_mode, tactic.accum)

    # ---------------------------------------------------------------- host-side setup
    def _setup(self, a_dtype, b_dtype, c_dtype, a_layout, b_layout, c_layout):
        tm, tn, tk = self.tile_shape_mnk
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            a_dtype,
            b_dtype,
            a_layout.sm90_mma_major_mode(),
            b_layout.sm90_mma_major_mode(),
            self.acc_dtype,
            self.atom_layout_mnk,
            tiler_mn=(64, tn // self.wg_n),
        )
        inst_k = cute.size(self.tiled_mma.shape_mnk, mode=[2])
        assert inst_k * 4 == tk, f"wgmma k {inst_k} x 4 != tile_k {tk}"
        self.cta_layout_mnk = cute.make_layout((*self.cluster_shape_mn, 1))

        def staged(dtype, layout, rows, cols, stages):
            atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
                sm90_utils.get_smem_layout_atom(layout, dtype, cols), dtype
            )
            return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))

        self.a_smem_staged = staged(a_dtype, a_layout, tm, tk, self.stages)
        self.b_smem_staged = staged(b_dtype, b_layout, tn, tk, self.stages)
        em, en = self.epi_tile
        if self.tile_epi:  # row-major, unswizzled: the TMA store's box is the whole tile
            self.epi_smem_staged = cute.make_layout((em, en, 1), stride=(en, 1, em * en))
        else:
            self.epi_smem_staged = staged(c_dtype, c_layout, em, en,
                                          1 if self.direct_epi else self.epi_buffers)

    @staticmethod
    def _tma_load(tensor, smem_staged, tile, mcast):
        op = (
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
            if mcast == 1
            else cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp()
        )
        return cute.nvgpu.cpasync.make_tiled_tma_atom(
            op, tensor, cute.slice_(smem_staged, (None, None, 0)), tile, num_multicast=mcast
        )

    def _operands(self, a, b, c):
        """(MMA A operand, MMA B operand, output as the MMA sees it): (a, b, c), or for
        swap_ab (b, a, the (N, M) view of c with strides (1, N))."""
        if not self.swap:
            return a, b, c
        return b, a, cute.make_tensor(c.iterator, cute.select(c.layout, mode=[1, 0]))

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,
        b: cute.Tensor,
        c: cute.Tensor,
        a_scale: cute.Tensor,
        b_scale: cute.Tensor,
        workspace: cute.Tensor,
        counters: cute.Tensor,
        max_active_clusters: cutlass.Constexpr,
        stream,
    ):
        # c_out: what the TMA store / the epilogue writes (c, or its transposed view)
        opa, opb, c_out = self._operands(a, b, c)
        self.a_dtype = opa.element_type
        self.b_dtype = opb.element_type
        self.c_dtype = c.element_type
        a_layout = utils.LayoutEnum.from_tensor(opa)
        b_layout = utils.LayoutEnum.from_tensor(opb)
        # (swap_ab: the layout of c itself, for the placeholder C buffer only)
        self.c_layout = utils.LayoutEnum.from_tensor(c)
        self._setup(self.a_dtype, self.b_dtype, self.c_dtype, a_layout, b_layout, self.c_layout)

        tm, tn, tk = self.tile_shape_mnk
        tma_a, tA = self._tma_load(opa, self.a_smem_staged, (tm, tk), self.num_mcast_a)
        tma_b, tB = self._tma_load(opb, self.b_smem_staged, (tn, tk), self.num_mcast_b)
        tma_c, tC = tma_a, c_out  # register epilogue: no TMA store; tma_a stands in, unused
        if cutlass.const_expr(not self.direct_epi):
            tma_c, tC = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(),
                c,
                cute.slice_(self.epi_smem_staged, (None, None, 0)),
                self.epi_tile,
            )

        # persistent schedule over (M tiles, N tiles, 1) of the MMA's output
        gc = cute.zipped_divide(c_out, tiler=(tm, tn))
        num_ctas_mnl = (*gc[(0, (None, None))].shape, self.units_per_tile)
        sched_params = utils.PersistentTileSchedulerParams(
            num_ctas_mnl, (*self.cluster_shape_mn, 1), self.swizzle, self.raster_along_m
        )
        grid = utils.StaticPersistentTileScheduler.get_grid_shape(
            sched_params, max_active_clusters
        )

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            # split_mode "cta": the counter value the arriving unit saw, for all its threads
            flag: cute.struct.MemRange[cutlass.Int32, 4]
            sA: cute.struct.Align[
                cute.struct.MemRange[self.a_dtype, cute.cosize(self.a_smem_staged)],
                self.buffer_align,
            ]
            sB: cute.struct.Align[
                cute.struct.MemRange[self.b_dtype, cute.cosize(self.b_smem_staged)],
                self.buffer_align,
            ]
            sC: cute.struct.Align[
                cute.struct.MemRange[self.c_dtype, cute.cosize(self.epi_smem_staged)],
                self.buffer_align,
            ]

        self.shared_storage = SharedStorage
        # checked against tactic.smem_bytes() by compile.compile_to_object
        self.smem_dynamic_bytes = SharedStorage.size_in_bytes()

        self.kernel(
            tma_a, tA, tma_b, tB, tma_c, tC,
            a_scale, b_scale, workspace, counters,
            self.tiled_mma, self.cta_layout_mnk,
            self.a_smem_staged, self.b_smem_staged, self.epi_smem_staged,
            sched_params,
        ).launch(
            grid=grid,
            block=[self.threads_per_cta, 1, 1],
            cluster=(*self.cluster_shape_mn, 1),
            min_blocks_per_mp=1,
            stream=stream,
            use_pdl=self.pdl,
        )

    # ---------------------------------------------------------------- device kernel
    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_c: cute.CopyAtom,
        mC: cute.Tensor,
        mAScale: cute.Tensor,
        mBScale: cute.Tensor,
        mWs: cute.Tensor,
        mCnt: cute.Tensor,
        tiled_mma: cute.TiledMma,
        cta_layout_mnk: cute.Layout,
        a_smem_staged: cute.ComposedLayout,
        b_smem_staged: cute.ComposedLayout,
        epi_smem_staged: cute.ComposedLayout | cute.Layout,
        sched_params: utils.PersistentTileSchedulerParams,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())

        if warp_idx == self.producer_warp:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_c)

        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord = cta_layout_mnk.get_flat_coord(cta_rank)
        a_mcast_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=1)
        b_mcast_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=0)
        a_mcast_mask = a_mcast_mask if self.num_mcast_a > 1 else 0
        b_mcast_mask = b_mcast_mask if self.num_mcast_b > 1 else 0

        tx_bytes = cute.size_in_bytes(
            self.a_dtype, cute.slice_(a_smem_staged, (None, None, 0))
        ) + cute.size_in_bytes(self.b_dtype, cute.slice_(b_smem_staged, (None, None, 0)))

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        # every consumer warp of every CTA that reads a multicast tile releases it
        mcast_size = self.num_mcast_a + self.num_mcast_b - 1
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread,
                mcast_size * (1 if self.pingpong else self.num_mma_wg) * 4
            ),
            tx_count=tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, *cta_layout_mnk.shape)),
            defer_sync=True,
        )
        pipeline_init_arrive(cluster_shape_mn=self.cluster_shape_mn, is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
        sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        if cutlass.const_expr(self.tile_epi):
            sC = storage.sC.get_tensor(epi_smem_staged)
        else:
            sC = storage.sC.get_tensor(epi_smem_staged.outer, swizzle=epi_smem_staged.inner)

        tm, tn, tk = self.tile_shape_mnk
        # (bM, bK, RestM, RestK), (bN, bK, RestN, RestK), (bM, bN, RestM, RestN)
        gA = cute.local_tile(mA, (tm, tk), (None, None))
        gB = cute.local_tile(mB, (tn, tk), (None, None))
        gC = cute.local_tile(mC, (tm, tn), (None, None))

        a_cta_layout = cute.make_layout(cute.slice_(cta_layout_mnk, (0, None, 0)).shape)
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_a, cluster_coord[1], a_cta_layout,
            cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2),
        )
        b_cta_layout = cute.make_layout(cute.slice_(cta_layout_mnk, (None, 0, 0)).shape)
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_b, cluster_coord[0], b_cta_layout,
            cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2),
        )

        wg_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_wg)
        mma_wg_layout = cute.make_layout(self.num_mma_wg, stride=self.threads_per_wg)
        thr_mma = tiled_mma.get_slice(0 if self.pingpong else mma_wg_layout(wg_idx - 1))
        tCsA = thr_mma.partition_A(sA)
        tCsB = thr_mma.partition_B(sB)
        tCrA = tiled_mma.make_fragment_A(tCsA)
        tCrB = tiled_mma.make_fragment_B(tCsB)
        tCgC = thr_mma.partition_C(gC)
        acc = cute.make_rmem_tensor(tCgC.shape[:3], self.acc_dtype)

        k_tiles = cute.size(gA, mode=[3])

        pipeline_init_wait(cluster_shape_mn=self.cluster_shape_mn)

        if cutlass.const_expr(self.pdl):
            # Everything above (descriptor prefetch, barrier init, partitions) touches no
            # global tensor, so it may run under the previous kernel. Every thread waits
            # here for the previous grid to finish and flush before it reads A, B, the
            # scales, the workspace or the counters, or writes C / the workspace. Then the
            # next kernel may be scheduled: it waits the same way, so nothing it reads or
            # writes can race with this grid.
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()

        if wg_idx == 0:
            # ---------------------------------------------------------- producer
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp_idx == self.producer_warp:
                sched = utils.StaticPersistentTileScheduler.create(
                    sched_params, cute.arch.block_idx(), cute.arch.grid_dim()
                )
                work = sched.initial_work_tile_info()
                prod_state = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Producer, self.stages
                )
                while work.is_valid_tile:
                    crd = work.tile_idx
                    tAgA_t = tAgA[(None, crd[0], None)]
                    tBgB_t = tBgB[(None, crd[1], None)]
                    k_begin = 0
                    k_end = k_tiles
                    if cutlass.const_expr(self.split_cta):
                        k_begin = crd[2] * k_tiles // self.splits
                        k_end = (crd[2] + 1) * k_tiles // self.splits
                    for kt in range(k_begin, k_end):
                        ab_pipe.producer_acquire(prod_state)
                        bar = ab_pipe.producer_get_barrier(prod_state)
                        cute.copy(tma_a, tAgA_t[(None, kt)], tAsA[(None, prod_state.index)],
                                  tma_bar_ptr=bar, mcast_mask=a_mcast_mask)
                        cute.copy(tma_b, tBgB_t[(None, kt)], tBsB[(None, prod_state.index)],
                                  tma_bar_ptr=bar, mcast_mask=b_mcast_mask)
                        ab_pipe.producer_commit(prod_state)
                        prod_state.advance()
                    sched.advance_to_next_work()
                    work = sched.get_current_work()
                ab_pipe.producer_tail(prod_state)
        else:
            # ---------------------------------------------------------- consumers
            cute.arch.setmaxregister_increase(CONSUMER_MAX_REGS)
            sched = utils.StaticPersistentTileScheduler.create(
                sched_params, cute.arch.block_idx(), cute.arch.grid_dim()
            )
            work = sched.initial_work_tile_info()
            read_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.stages
            )
            release_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.stages
            )
            if cutlass.const_expr(self.pingpong):
                # the second warpgroup takes the CTA's odd tiles: skip tile 0 and its
                # stages (no branch: the scheduler's state must not change inside one)
                read_state, release_state = self.skip_stages(read_state, release_state,
                                                             (wg_idx - 1) * k_tiles)
                sched.advance_to_next_work(advance_count=wg_idx - 1)
                work = sched.get_current_work()
            # scale, read once on the device; applied once per element after the K loop
            # (per-token scales: applied per element before the epilogue, which gets 1)
            scale = cutlass.Float32(1.0)
            if cutlass.const_expr(not self.token and not self.block and not self.no_scale):
                scale = mAScale[0] * mBScale[0]

            # split_mode "serial": the running sum over the splits lives in a second
            # accumulator, which the epilogue reads; exact: the promoted sum likewise
            acc_sum = acc
            if cutlass.const_expr(self.split_serial or self.exact):
                acc_sum = cute.make_rmem_tensor(tCgC.shape[:3], self.acc_dtype)
            # a serial exact split: each range's promoted sum, added into acc_sum
            acc_range = acc
            if cutlass.const_expr(self.split_serial and self.exact):
                acc_range = cute.make_rmem_tensor(tCgC.shape[:3], self.acc_dtype)
            # epilogue partitions: registers -> smem (stmatrix) -> gmem (TMA); swap_ab and
            # wg_n = 2 store from registers (epilogue_direct) and need none of them
            tiled_r2s = tRS_sC = tRS_acc = tRS_rF = tRS_rC = store_pipe = None
            if cutlass.const_expr(not self.direct_epi):
                if cutlass.const_expr(self.tile_epi):
                    # plain shared-memory stores in the MMA's register layout
                    tiled_r2s = cute.make_tiled_copy_C(
                        cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.c_dtype),
                        tiled_mma)
                else:
                    copy_atom_r2s = sm90_utils.sm90_get_smem_store_op(
                        self.c_layout, elem_ty_d=self.c_dtype, elem_ty_acc=self.acc_dtype
                    )
                    copy_atom_c = cute.make_copy_atom(
                        cute.nvgpu.warp.StMatrix8x8x16bOp(self.c_layout.is_m_major_c(), 4),
                        self.c_dtype,
                    )
                    tiled_copy_c_atom = cute.make_tiled_copy_C_atom(copy_atom_c, tiled_mma)
                    tiled_r2s = cute.make_tiled_copy_S(copy_atom_r2s, tiled_copy_c_atom)
                thr_r2s = tiled_r2s.get_slice((tidx - self.threads_per_wg) % self.tile_threads)
                tRS_sC = thr_r2s.partition_D(sC)
                tRS_acc = tiled_r2s.retile(acc_sum)
                rC_shape = cute.shape(thr_r2s.partition_S(sC))[:3]
                tRS_rF = cute.make_rmem_tensor(rC_shape, self.acc_dtype)
                tRS_rC = cute.make_rmem_tensor(rC_shape, self.c_dtype)

                store_pipe = pipeline.PipelineTmaStore.create(
                    num_stages=self.epi_stages,
                    producer_group=pipeline.CooperativeGroup(
                        pipeline.Agent.Thread, self.tile_threads
                    ),
                )

            sFlag = storage.flag.get_tensor(cute.make_layout(4))
            frag = cute.size(acc)
            ctid = tidx - self.threads_per_wg  # 0 .. num_mma_threads-1
            # this thread's own slice of the tiled MMA (thr_mma is its warpgroup's: the
            # coordinates of the warpgroup's first thread), for the register epilogue
            thr_c = tiled_mma.get_slice(ctid % self.tile_threads)
            tiles_m = cute.size(gC, mode=[2])
            tiles_n = cute.size(gC, mode=[3])
            cC = cute.make_identity_tensor(mC.shape)
            gcC = cute.local_tile(cC, (tm, tn), (None, None))
            slot_elems = tm * tn
            ws_ok = True
            if cutlass.const_expr(self.split_cta):
                # a workspace or counter buffer smaller than the launcher's
                # workspace_bytes()/counter_elems(): compute nothing, write nothing
                ws_ok = (mWs.shape[0] >= tiles_m * tiles_n * (self.splits * slot_elems)) and (
                    mCnt.shape[0] >= tiles_m * tiles_n)

            # ping-pong order: a warpgroup starts a main loop only after the other one has
            # finished its previous one (named barriers 3 and 4, both warpgroups), so no
            # consumer waits on a stage more than one ring round ahead of the producer
            order_wait = order_signal = None
            if cutlass.const_expr(self.pingpong):
                order_wait = pipeline.NamedBarrier(barrier_id=5 - wg_idx,
                                                   num_threads=self.num_mma_threads)
                order_signal = pipeline.NamedBarrier(barrier_id=wg_idx + 2,
                                                     num_threads=self.num_mma_threads)
            own_tiles = cutlass.Int32(0)
            while work.is_valid_tile:
                crd = work.tile_idx
                gC_t = gC[(None, None, crd[0], crd[1])]
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)

                if cutlass.const_expr(self.split_serial):
                    if cutlass.const_expr(self.pingpong):
                        if wg_idx == 2 or own_tiles > 0:
                            order_wait.arrive_and_wait()
                    acc_sum.fill(0.0)
                    for seg in range(self.splits):
                        seg_begin = seg * k_tiles // self.splits
                        seg_end = (seg + 1) * k_tiles // self.splits
                        read_state, release_state = self.range_sum(
                            ab_pipe, tiled_mma, acc, acc_range, tCrA, tCrB, read_state,
                            release_state, seg_begin, seg_end, True, mC,
                            gcC[(None, None, crd[0], crd[1])], thr_c, mAScale, mBScale)
                        for v in cutlass.range_constexpr(frag):
                            acc_sum[v] = acc_sum[v] + acc_range[v]
                    if cutlass.const_expr(self.pingpong):
                        order_signal.arrive()
                    self.store_tile(tma_c, sC, gC_t, tRS_acc, tRS_rF, tRS_rC, tRS_sC, tiled_r2s,
                                    store_pipe, scale, sched.num_tiles_executed, warp_idx,
                                    mC, gcC, crd, thr_c, acc_sum, mAScale, mBScale)
                elif cutlass.const_expr(self.split_cta):
                    # the unit's partial: acc_sum (exact: promoted over its K range; fast:
                    # acc_sum is acc)
                    split = crd[2]
                    k_begin = split * k_tiles // self.splits
                    k_end = (split + 1) * k_tiles // self.splits
                    read_state, release_state = self.range_sum(
                        ab_pipe, tiled_mma, acc, acc_sum, tCrA, tCrB, read_state,
                        release_state, k_begin, k_end, True, mC,
                        gcC[(None, None, crd[0], crd[1])], thr_c, mAScale, mBScale)
                    if ws_ok:
                        tile_lin = crd[0] + crd[1] * tiles_m
                        # threads whose fragment lies wholly outside (M, N) skip the
                        # round trip: at decode sizes most of the tile is padding. The
                        # others move their whole fragment (inside this tile's slot), with
                        # no per-element branch, so the loads below can all be in flight.
                        tCcC = thr_mma.partition_C(gcC[(None, None, crd[0], crd[1])])
                        any_valid = cute.elem_less(tCcC[0], mC.shape)
                        for v in cutlass.range_constexpr(1, frag):
                            any_valid = any_valid | cute.elem_less(tCcC[v], mC.shape)
                        own = (tile_lin * self.splits + split) * slot_elems + ctid
                        if any_valid:
                            for v in cutlass.range_constexpr(frag):
                                mWs[own + v * self.num_mma_threads] = acc_sum[v]
                        # release: the barrier orders every thread's partial before thread
                        # 0's acq_rel atomic (cumulativity); the last unit's atomic acquires
                        # them, and its barrier orders its threads' loads after that.
                        self.epi_barrier.arrive_and_wait()
                        if ctid == 0:
                            sFlag[0] = cute.arch.atomic_add(
                                mCnt.iterator + tile_lin, cutlass.Int32(1),
                                sem="acq_rel", scope="gpu",
                            )
                        self.epi_barrier.arrive_and_wait()
                        if sFlag[0] == self.splits - 1:
                            # last unit of this tile: sum the partials in split order
                            acc_sum.fill(0.0)
                            if any_valid:
                                for s in cutlass.range_constexpr(self.splits):
                                    base = (tile_lin * self.splits + s) * slot_elems + ctid
                                    for v in cutlass.range_constexpr(frag):
                                        acc_sum[v] = acc_sum[v] + cute.arch.load(
                                            mWs.iterator + (base + v * self.num_mma_threads),
                                            cutlass.Float32, cop="cg",
                                        )
                            if ctid == 0:
                                mCnt[tile_lin] = cutlass.Int32(0)
                            self.store_tile(tma_c, sC, gC_t, tRS_acc, tRS_rF, tRS_rC, tRS_sC,
                                            tiled_r2s, store_pipe, scale,
                                            sched.num_tiles_executed, warp_idx,
                                            mC, gcC, crd, thr_c, acc_sum, mAScale, mBScale)
                else:
                    if cutlass.const_expr(self.pingpong):
                        if wg_idx == 2 or own_tiles > 0:
                            order_wait.arrive_and_wait()
                    read_state, release_state = self.range_sum(
                        ab_pipe, tiled_mma, acc, acc_sum, tCrA, tCrB, read_state,
                        release_state, 0, k_tiles, False, mC,
                        gcC[(None, None, crd[0], crd[1])], thr_c, mAScale, mBScale)
                    if cutlass.const_expr(self.pingpong):
                        order_signal.arrive()
                    self.store_tile(tma_c, sC, gC_t, tRS_acc, tRS_rF, tRS_rC, tRS_sC, tiled_r2s,
                                    store_pipe, scale, sched.num_tiles_executed, warp_idx,
                                    mC, gcC, crd, thr_c, acc_sum, mAScale, mBScale)

                own_tiles = own_tiles + 1
                if cutlass.const_expr(self.pingpong):
                    # the other warpgroup's next tile: skip its stages
                    read_state, release_state = self.skip_stages(read_state, release_state,
                                                                 k_tiles)
                    sched.advance_to_next_work(advance_count=2)
                else:
                    sched.advance_to_next_work()
                work = sched.get_current_work()

            if cutlass.const_expr(not self.direct_epi):
                store_pipe.producer_tail()
