"""Hopper (sm_90a) FP8 GEMM in CuTe-DSL: C = cvt((A @ B^T) * (a_scale * b_scale)).

BF16 operands (tactic.ab_dtype = "bf16", scales = "none"; the family cached.hopper_bf16):
the same kernel with bfloat16 A and B, a 64-element K tile (128 bytes a row, so the same
shared-memory layouts and sizes), four wgmma k16 per K tile in place of FP8's four k32, no
scale read (the epilogue rounds the fp32 sum as it is; the register epilogue multiplies it
by a 1.0 known only at run time, see epilogue_direct), and bf16, fp16 or fp32 output.

A (M, K), B (N, K): float8 (e4m3fn or e5m2), K-major. C (M, N): bf16/fp16, row-major.
a_scale, b_scale: fp32 tensors of one element, read on the device (no host sync, so
CUDA-graph safe); with tactic.scales = "token", a_scale (M,) and b_scale (N,): before the
epilogue each thread multiplies every element (m, n) of its fp32 sum by the fp32 product
a_scale[m] * b_scale[n] (indices clamped into C: elements outside C are never stored),
and the epilogue's per-tensor factor is 1. With tactic.scales = "block128" (accum "exact"
only), a_scale (M, K/128) column-major (element (m, j) at j*M + m) and b_scale
(ceil(N/128), K/128) row-major: at the promotion of K tile j each element (m, n) adds
acc * (a_scale[m, j] * b_scale[n // 128, j]) (row and column clamped into C, as for
"token"; the block index is per element, so any tile_n and a partial last weight block
are served), and the epilogue's factor is 1. K % 128 == 0 (one scale group per K tile).

Exact accumulation (tactic.accum = "exact"): per K tile the four k32 wgmma start
from zero in the wgmma accumulator (ACCUMULATE off for the first), the consumer waits for
them to retire, releases the stage and adds the accumulator into a second fp32 register
tensor (the promoted sum, from zero, in K-tile order), which the epilogue reads (not
block128, where one more accumulator copy fits in PREFETCH_REGS: two K tiles at a time, in
two wgmma accumulators, so the second one's wgmma runs while the first one is added; the
same sum, bitwise); with a split (not block128) each K range's promoted sum is its
partial p_s (Split-K below; a serial split holds it in a third copy). block128
loads a thread's scales (one per distinct row and weight block of its fragment) SCALE_SETS
K tiles before their use, into register sets taken in turn, where those sets and the two
accumulator copies fit in PREFETCH_REGS fp32 registers per thread; otherwise in the K tile
itself, before its pipeline wait.

Structure (one CTA = 1 producer warpgroup + 1 or 2 consumer warpgroups):
  * producer warp 0: walks the persistent tile schedule and, per K tile, TMA-loads the
    A and B tiles into a ring of `stages` shared-memory buffers guarded by full/empty
    mbarriers (PipelineTmaAsync). With a cluster, A is multicast to the CTAs of the
    same cluster row and B to those of the same cluster column.
  * consumer warpgroups: wait for a stage, issue the K tile's wgmma (4 x k32) into the
    fp32 register accumulator, release the previous stage once its wgmma retired
    (one wgmma batch in flight), and after the last K tile run the epilogue: multiply
    once by a_scale*b_scale, convert, stage through shared memory (stmatrix) and TMA-store.
  * persistent static tile scheduler: grid = min(#tiles, max_active_clusters * cluster
    size) CTAs, each looping over tiles; raster order and swizzle set the tile walk.
  * tactic.pdl: launched with programmatic dependent launch; every thread runs
    griddepcontrol.wait after the prologue (barrier init, descriptor prefetch), before
    any global read or write, then griddepcontrol.launch_dependents, so the next kernel's
    prologue can overlap this one. The K walk is untouched.
M, N, K are symbolic: out-of-range rows/columns are zero-filled by TMA loads and
clipped by TMA stores, so one compiled kernel serves every shape (N, K multiples of 16).

Split-K (tactic.splits = S > 1; the reduction-order class is tactic.reduction_class):
the K tiles are cut into S contiguous ranges, range s = [s*kt//S, (s+1)*kt//S) of the
kt = ceil(K/128) K tiles. Each range is accumulated from zero into its own fp32
partial p_s, and the partials are summed in one fixed order, ((0 + p_0) + p_1) + ...,
before the scale and the conversion. Two ways to run the same arithmetic:
  * split_mode "serial": one CTA walks all S ranges of its tile and keeps the running
    sum in a second register accumulator (no workspace);
  * split_mode "cta": the persistent schedule has S work units per output tile (the
    scheduler's L mode is the split index). Each unit writes the valid rows of its
    partial to the fp32 workspace, fences, and bumps the tile's counter; the unit that
    sees S-1 (the last to arrive) reads the S partials back in split order, sums them,
    resets the counter to 0 and runs the epilogue. No unit waits for another, so any
    schedule is deadlock-free; the counters are left at zero for the next launch.
Either way a row's result depends only on (K, S), never on M or on which CTA computed it.

Swap-AB (tactic.swap_ab, decode tiles): the same kernel on exchanged operands. The weight
B (N, K) is the MMA's A operand (tile_n rows on the wgmma M side), the tokens A (M, K)
its B operand (tile_m = 8..64 on the wgmma N side), and the output is addressed through
an (N, M) view of C with strides (1, N). The K walk, the splits and their sum are the
ones above. The epilogue multiplies by the scale and converts exactly as the TMA
epilogue does, then stores each element from registers to global memory, guarded by the
output bounds (at decode sizes C is a few KB, so the scattered stores cost nothing next
to the weight stream).

Consumer warpgroups along N (tactic.wg_n = 2, tile_m = 64): the tiled MMA's atom layout
is (1, 2, 1) with a 64 x tile_n/2 wgmma, so warpgroup w reads the whole A stage and the
B rows [w*tile_n/2, (w+1)*tile_n/2) of each stage, and accumulates its half of the tile
over the same K tiles, in the same order. Its epilogue scales and converts as the others
do, writes the whole tile to one row-major shared-memory buffer with plain stores in the
MMA's register layout, and TMA-stores it in one copy.

Ping-pong (tactic.pingpong; S = 1, or a serial split): two consumer warpgroups, each
owning whole tiles (the CTA's persistent tiles alternate between them, each skipping the
other's tiles and their stages), so one warpgroup's epilogue runs while the other's main
loop issues wgmma. The tiled MMA is one warpgroup's m64 atom (atom layout (1, 1, 1)); a
128-row tile repeats it twice along M (tile_n accumulator registers per thread). Named
barriers 3 and 4 order the main loops (a warpgroup starts one only after the other
finished its previous one); each warpgroup has its own epilogue barrier (1, 2), store
warp and ring of 64-row C buffers. The K walk is every tactic's; a serial split walks
all S ranges of its tile inside one ordered main-loop turn (the ranges' stages sum to
the tile's K tiles, which the other warpgroup skips).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

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


class HopperFp8GemmKernel:
    """Warp-specialized persistent FP8 GEMM for sm_90a. See the module docstring."""

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

    # ---------------------------------------------------------------- device helpers
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

    def block_products(self, scales, blk):
        """The block128 scale product of each pair of blk.pairs from a thread's scale
        registers ``scales`` [rows..., columns...], in the order a_scale * b_scale.
        Traced inline."""
        prods = []
        for ri, ci in blk.pairs:
            rs, cs = scales[ri], scales[blk.n_rows + ci]
            prods.append(cs * rs if self.swap else rs * cs)
        return prods

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
