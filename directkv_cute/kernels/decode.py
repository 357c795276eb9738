"""Split-KV paged attention over host-resident KV: the decode kernel.

One CTA per (split, KV head, sequence). A producer warp streams the CTA's KV tiles with TMA
straight from the page pools (pinned host memory through UVA, or the HBM tier) into a
``stages``-deep SMEM ring; one or two consumer warpgroups hold all ``group * q_len`` query rows
of the KV head (GQA group packed into the WGMMA M dimension) and run S = Q K^T (WGMMA, SMEM
operands), the online softmax, and O += P V (WGMMA, P from registers). Each KV tile crosses
the link once and serves every query row that needs it.

Pages: the pools are viewed as (page_size, head_dim, X) with X = ((page * L + layer) * Hkv +
kv_head) * 2 + {0: K, 1: V}; a TMA copy moves ``rows = min(page_size, tile_n)`` tokens of one
page. Copies past a sequence's last page use an out-of-bounds coordinate, which TMA fills with
zeros without touching memory (and still counts the full box toward the stage's byte count).

Resident mode (multi-token queries): KV-outer order. The CTA walks its split a chunk of
``cfg.chunk`` tiles at a time; every block of query rows is applied to the chunk while it sits in
SMEM, and the ring slots a chunk frees are refilled with the next chunk while the consumers work
(no link idle time between chunks). A block's running softmax state is carried across chunks in
the split's fp32 partial (normalised O and LSE, reloaded by the thread that stored it).

Link admission (``link_credits``): the producer takes a ticket from a device-wide counter pair
before it issues a tile that reads host pages and reports the tile once it has landed, so at
most ``link_credits`` host tiles are in flight on the GPU; the consumers' HBM traffic (Q rows,
partials) does not queue behind a backlog of host requests. In a cluster the rank-0 CTA takes
the tile's ticket and, once admitted, arrives on an ``admit`` mbarrier in each peer's SMEM; the
peers wait on it before they issue their boxes and take no tickets, so no CTA holding a ticket
ever waits for another's.

Multi-token options: ``edge_tiles`` shortens each CTA's first and last chunk
(``config.chunk_bounds``); ``stagger`` gives each block of query rows its own chunk boundaries,
staggered through the walk (``config.block_passes``), so the first blocks start after one tile
and tiles are freed one at a time; ``q_regs`` keeps a pass's Q rows in registers (Q K^T with A from
registers), so the Q tile's SMEM goes to the ring.

Outputs: with ``split_out`` the CTA writes its normalised partial O (fp32) and LSE for the
combine kernel; otherwise it writes the final O (q dtype) and LSE directly.
"""

from __future__ import annotations

from functools import partial

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.experimental.primitives.nvvm_wrapper import nanosleep

from directkv_cute.config import DecodeConfig
from directkv_cute.kernels.helpers import (
    LOG2_E,
    acc_as_mn,
    acc_as_operand_a,
    gemm,
    gemm_issue,
    kv_smem_layout,
    rescale_rows,
    softmax_finalize,
    softmax_step,
    softmax_update,
    transpose_view,
)

# setmaxnreg budgets (producer warpgroup, each consumer warpgroup) by (consumer warpgroups, CTAs
# per SM): 128 x (producer + wgs x consumer) x CTAs registers must fit the SM's 64K.
REGS = {(1, 1): (40, 232), (2, 1): (40, 232), (3, 1): (32, 160), (1, 2): (40, 216)}


class DecodeAttention:
    """Static configuration (everything that changes code generation) lives here."""

    def __init__(self, dtype, head_dim: int, page_size: int, group: int, cfg: DecodeConfig, split_out: bool,
                 resident: bool = False):
        self.dtype = dtype
        self.head_dim = head_dim
        self.page_size = page_size
        self.group = group
        self.tile_n = cfg.tile_n
        self.stages = cfg.stages
        self.wgs = cfg.consumer_wgs
        self.rows = 64 * cfg.consumer_wgs
        self.copy_rows = min(page_size, cfg.tile_n)
        if resident and cfg.q_cluster:
            # The CTAs of a cluster share out a tile's TMA boxes (K and V of each piece): pieces
            # are halved (fewer rows, whole 2*d-byte rows still) until every CTA has a box.
            while 2 * cfg.tile_n // self.copy_rows < cfg.cluster:
                self.copy_rows //= 2
        self.copies = cfg.tile_n // self.copy_rows
        self.split_out = split_out
        self.resident = resident
        self.chunk = cfg.chunk
        self.edge = cfg.edge_tiles if resident else 0
        self.stagger = cfg.stagger if resident else 0
        assert resident or not cfg.multi_token_only, f"{cfg.multi_token_only}: multi-token kernel options"
        # Each warpgroup keeps its pass's Q rows in registers (the QK^T WGMMA reads A from
        # registers) instead of an SMEM tile, freeing rows x d x 2 B of SMEM.
        self.q_regs = bool(cfg.q_regs)
        # A cluster of `cluster` CTAs shares each KV tile (each TMA box issued by one of them,
        # multicast to all) and splits the query rows.
        self.cluster = cfg.cluster
        self.max_inflight = cfg.max_inflight
        self.link_credits = cfg.link_credits
        assert not cfg.link_credits or cfg.max_inflight == 1, "link_credits needs max_inflight == 1"
        # Clusters under link admission: rank 0 admits each host tile for the whole cluster and
        # signals the peers through one more mbarrier (after the ring's 2 x stages).
        self.cluster_admit = self.cluster > 1 and cfg.link_credits > 0
        self.occupancy = cfg.resident_occupancy(head_dim) if resident else 1  # 16-bit dtypes only
        self.num_threads = cfg.num_threads
        self.carveout = cfg.carveout
        # Query tokens whose whole GQA group fits in the CTA's rows; rows past
        # q_per_cta * group are padding.
        self.q_per_cta = self.rows // group
        assert self.q_per_cta >= 1, "a GQA group larger than the CTA's query rows"
        # Resident mode: each consumer warpgroup works through its own blocks of 64 rows.
        self.q_per_wg = 64 // group
        assert not resident or self.q_per_wg >= 1, "the multi-token kernel holds GQA groups up to 64"

    # ------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        q_ptr: cute.Pointer,  # (total_q, Hq, d) q dtype
        o_ptr: cute.Pointer,  # split_out: (splits, total_q, Hq, d) fp32; else (total_q, Hq, d) q dtype
        lse_ptr: cute.Pointer,  # split_out: (splits, total_q, Hq) fp32; else (total_q, Hq) fp32
        host_ptr: cute.Pointer,  # host pool (pages, L, Hkv, 2, P, d)
        hbm_ptr: cute.Pointer,  # HBM pool, same layout (the host pool again when there is none)
        page_table_ptr: cute.Pointer,  # (B, max_pages) int32
        seq_lens_ptr: cute.Pointer,  # (B,) int32
        cu_q_ptr: cute.Pointer,  # (B + 1,) int32 query row offsets
        link_ptr: cute.Pointer,  # (2,) int32 device-wide link tickets: issued, landed (link_credits)
        batch: Int32,
        total_q: Int32,
        num_kv_heads: Int32,
        num_layers: Int32,
        layer: Int32,
        host_pages: Int32,
        hbm_pages: Int32,
        max_pages: Int32,
        num_splits: Int32,
        scale_log2: Float32,
        stream: cuda.CUstream,
    ):
        d, P, dt = self.head_dim, self.page_size, self.dtype
        hq = num_kv_heads * self.group
        # Pools as (P, d, X): X indexes one (page, layer, kv_head, K|V) piece.
        x_host = host_pages * num_layers * num_kv_heads * 2
        x_hbm = hbm_pages * num_layers * num_kv_heads * 2
        pool_layout = lambda x: cute.make_layout((P, d, x), stride=(d, 1, P * d))  # noqa: E731
        mKVh = cute.make_tensor(host_ptr, pool_layout(x_host))  # (P, d, Xh)
        mKVd = cute.make_tensor(hbm_ptr, pool_layout(x_hbm))  # (P, d, Xd)
        q_row = cute.assume(hq * d, divby=64)  # rows stay 16-byte aligned: vector loads of Q
        mQ = cute.make_tensor(q_ptr, cute.make_layout((total_q, hq, d), stride=(q_row, d, 1)))
        mPT = cute.make_tensor(page_table_ptr, cute.make_layout((batch, max_pages), stride=(max_pages, 1)))
        mSeqLen = cute.make_tensor(seq_lens_ptr, cute.make_layout(batch))
        mCuQ = cute.make_tensor(cu_q_ptr, cute.make_layout(batch + 1))
        mLink = cute.make_tensor(link_ptr, cute.make_layout(2))
        if const_expr(self.split_out):
            # Partials of long prefills exceed 2^31 elements: 64-bit split strides.
            split_o = cute.assume(cutlass.Int64(total_q) * hq * d, divby=64)
            split_lse = cutlass.Int64(total_q) * hq
            mO = cute.make_tensor(o_ptr, cute.make_layout((num_splits, total_q, hq, d), stride=(split_o, q_row, d, 1)))
            mLSE = cute.make_tensor(lse_ptr, cute.make_layout((num_splits, total_q, hq), stride=(split_lse, hq, 1)))
        else:
            mO = cute.make_tensor(o_ptr, cute.make_layout((1, total_q, hq, d), stride=(0, q_row, d, 1)))
            mLSE = cute.make_tensor(lse_ptr, cute.make_layout((1, total_q, hq), stride=(0, hq, 1)))

        sQ_layout = kv_smem_layout(dt, self.rows, d)
        sKV_layout = kv_smem_layout(dt, self.tile_n, d, self.stages)
        sCopy_layout = kv_smem_layout(dt, self.copy_rows, d)
        C = self.cluster
        op = cpasync.CopyBulkTensorTileG2SMulticastOp() if const_expr(C > 1) else cpasync.CopyBulkTensorTileG2SOp()
        # Whole boxes (not 1/C slices of each, which would split their rows): a CTA of a cluster
        # issues the boxes it owns, multicast (load).
        tma_h, mKVh_tma = cpasync.make_tiled_tma_atom(op, mKVh, sCopy_layout, (self.copy_rows, d))
        tma_d, mKVd_tma = cpasync.make_tiled_tma_atom(op, mKVd, sCopy_layout, (self.copy_rows, d))

        q_source = warpgroup.OperandSource.RMEM if self.q_regs else warpgroup.OperandSource.SMEM
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            dt, dt, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
            atom_layout_mnk=(1, 1, 1), tiler_mn=(64, self.tile_n), a_source=q_source,
        )
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            dt, dt, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN, Float32,
            atom_layout_mnk=(1, 1, 1), tiler_mn=(64, d), a_source=warpgroup.OperandSource.RMEM,
        )
        stage_bytes = 2 * cute.size_in_bytes(dt, cute.select(sKV_layout, mode=[0, 1]))

        n_mbar = 2 * self.stages + (1 if self.cluster_admit else 0)

        @cute.struct
        class SharedStorageQ:
            mbar: cute.struct.MemRange[cutlass.Int64, n_mbar]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sKV_layout)], 1024]

        @cute.struct
        class SharedStorageNoQ:  # q_regs: the ring only
            mbar: cute.struct.MemRange[cutlass.Int64, n_mbar]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sKV_layout)], 1024]

        SharedStorage = SharedStorageNoQ if const_expr(self.q_regs) else SharedStorageQ  # noqa: N806
        self.shared_storage = SharedStorage
        self.stage_bytes = stage_bytes
        self.kernel(
            mQ, mO, mLSE, tma_h, mKVh_tma, tma_d, mKVd_tma, mPT, mSeqLen, mCuQ, mLink,
            num_kv_heads, num_layers, layer, num_splits, scale_log2,
            sQ_layout, sKV_layout, tiled_mma_qk, tiled_mma_pv,
        ).launch(
            grid=[num_splits * C, num_kv_heads, batch],
            block=[self.num_threads, 1, 1],
            cluster=[C, 1, 1] if const_expr(C > 1) else None,
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=self.occupancy,
            preferred_smem_carveout=self.carveout,
        )

    # ------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,  # (total_q, Hq, d)
        mO: cute.Tensor,  # (splits | 1, total_q, Hq, d)
        mLSE: cute.Tensor,  # (splits | 1, total_q, Hq)
        tma_h: cute.CopyAtom,
        mKVh: cute.Tensor,  # TMA coordinate view of the host pool (P, d, Xh)
        tma_d: cute.CopyAtom,
        mKVd: cute.Tensor,  # TMA coordinate view of the HBM pool (P, d, Xd)
        mPT: cute.Tensor,  # (B, max_pages) int32
        mSeqLen: cute.Tensor,  # (B,)
        mCuQ: cute.Tensor,  # (B + 1,)
        mLink: cute.Tensor,  # (2,) int32: link tickets issued, landed
        num_kv_heads: Int32,
        num_layers: Int32,
        layer: Int32,
        num_splits: Int32,
        scale_log2: Float32,
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
    ):
        d, tile_n = self.head_dim, self.tile_n
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        split, kvh, b = cute.arch.block_idx()
        rank = 0  # this CTA's place in its cluster (q_cluster): the CTAs of a split are adjacent in x
        if const_expr(self.cluster > 1):
            rank = split % self.cluster
            split = split // self.cluster

        seq_len = mSeqLen[b]
        q_start = mCuQ[b]
        q_len = mCuQ[b + 1] - q_start
        n_tiles = (seq_len + tile_n - 1) // tile_n
        n_pages = (seq_len + self.page_size - 1) // self.page_size
        per = n_tiles // num_splits
        extra = n_tiles % num_splits
        t_begin = split * per + cutlass.min(split, extra)
        t_end = t_begin + per + (1 if split < extra else 0)

        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_h)
            cpasync.prefetch_descriptor(tma_d)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        sQ = None
        if const_expr(not self.q_regs):
            sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)  # (rows, d)
        sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)  # (tile_n, d, stages)
        sV = storage.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)  # (tile_n, d, stages)
        # A stage is free once every consumer warp of every CTA of the cluster has released it
        # (each producer multicasts into all of them): one arrive per warp and cluster CTA.
        cta_layout_vmnk = None
        if const_expr(self.cluster > 1):
            cta_layout_vmnk = cute.make_layout((1, self.cluster, 1, 1))
        kv_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * self.wgs * self.cluster),
            tx_count=self.stage_bytes,
            cta_layout_vmnk=cta_layout_vmnk,
            mcast_mode_mn=(0, 1),
            defer_sync=True,
        )
        admit = None  # cluster_admit: rank 0's per-tile signal to this CTA's producer
        if const_expr(self.cluster_admit):
            admit = storage.mbar.data_ptr() + 2 * self.stages
            if tidx == 0:
                cute.arch.mbarrier_init(admit, 1)
            cute.arch.mbarrier_init_fence()
        pipeline.pipeline_init_arrive(cluster_shape_mn=(self.cluster, 1), is_relaxed=True)
        pipeline.pipeline_init_wait(cluster_shape_mn=(self.cluster, 1))

        if warp_idx < 4:
            # ---------------- producer warpgroup: warp 0 streams K/V pages with TMA ----------
            cute.arch.setmaxregister_decrease(REGS[self.wgs, self.occupancy][0])
            if warp_idx == 0:
                self.load(
                    kv_pipe, tma_h, mKVh, tma_d, mKVd, sK, sV, mPT, mLink, b, kvh, num_kv_heads, num_layers,
                    layer, t_begin, t_end, n_pages, rank, admit,
                )
        else:
            # ---------------- consumer warpgroups -------------------------------------------
            cute.arch.setmaxregister_increase(REGS[self.wgs, self.occupancy][1])
            ctidx = tidx - 128
            wg = ctidx // 128
            wg_tidx = ctidx % 128
            thr_qk = tiled_mma_qk.get_slice(wg_tidx)
            thr_pv = tiled_mma_pv.get_slice(wg_tidx)
            sQ_wg = None
            rQc = None
            if const_expr(self.q_regs):
                # The pass's Q rows in registers, loaded in the (64, d) accumulator layout of the
                # P V product and viewed as the A operand of Q K^T (the same re-view as P).
                rQc = cute.make_rmem_tensor(thr_pv.partition_shape_C((64, d)), self.dtype)  # (64, d) as acc
                tSrQ = acc_as_operand_a(rQc)
            else:
                sQ_wg = cute.local_tile(sQ, (64, d), (wg, 0))  # (64, d) rows of this warpgroup
                tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ_wg))
            tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK))
            sVt = transpose_view(sV)  # (d, tile_n, stages)
            tOrVt = thr_pv.make_fragment_B(thr_pv.partition_B(sVt))
            acc_S = cute.make_rmem_tensor(thr_qk.partition_shape_C((64, tile_n)), Float32)
            acc_O = cute.make_rmem_tensor(thr_pv.partition_shape_C((64, d)), Float32)
            tScS = acc_as_mn(thr_qk.partition_C(cute.make_identity_tensor((64, tile_n))))
            n_rows = cute.size(tScS, mode=[0])
            row_max = cute.make_rmem_tensor(n_rows, Float32)
            row_sum = cute.make_rmem_tensor(n_rows, Float32)
            lse = cute.make_rmem_tensor(n_rows, Float32)
            row_scale = cute.make_rmem_tensor(n_rows, Float32)
            tOrP = cute.make_rmem_tensor_like(acc_as_operand_a(acc_S), self.dtype)
            row0 = wg * 64
            n_cons = 128 * self.wgs
            tile = partial(
                self.attend_tile, acc_S=acc_S, acc_O=acc_O, tOrP=tOrP, tSrQ=tSrQ, tSrK=tSrK, tOrVt=tOrVt,
                tScS=tScS, row_max=row_max, row_sum=row_sum, row0=row0, seq_len=seq_len, q_len=q_len,
                scale_log2=scale_log2, tiled_mma_qk=tiled_mma_qk, tiled_mma_pv=tiled_mma_pv,
            )
            if const_expr(not self.resident):
                # Streaming: every query row fits one block; tiles flow through the ring.
                self.load_q(mQ, sQ, q_start, q_len, kvh, ctidx, 0, n_cons, self.q_per_cta)
                cute.arch.fence_view_async_shared()
                cute.arch.barrier(barrier_id=1, number_of_threads=n_cons)
                acc_O.fill(0.0)
                row_max.fill(-Float32.inf)
                row_sum.fill(0.0)
                cons_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
                for t in cutlass.range(t_begin, t_end, unroll=1):
                    kv_pipe.consumer_wait(cons_state, kv_pipe.consumer_try_wait(cons_state))
                    tile(t=t, stage=cons_state.index, tok0=0)
                    kv_pipe.consumer_release(cons_state)
                    cons_state.advance()
                softmax_finalize(acc_O, row_max, row_sum, lse, scale_log2)
                self.store(mO, mLSE, acc_O, lse, thr_pv, split, q_start, q_len, kvh, row0, 0, self.q_per_cta)
            else:
                # Resident (KV-outer): the CTA walks its tiles a chunk at a time. Every block of
                # query rows is applied to the chunk while it sits in SMEM; only then are its ring
                # slots released, so the producer loads the next chunk (into the other slots of
                # the ring) while the consumers work on this one. A block's running (O, max, sum)
                # lives in this split's partial: stored normalised with its LSE after each chunk
                # and reloaded for the next.
                # Each consumer warpgroup takes its own blocks of q_per_wg tokens (64 rows) and
                # syncs only with itself, so one warpgroup's per-block work (Q gather, partial
                # reload and store) overlaps the other's MMAs.
                chunk, qb = self.chunk, self.q_per_wg
                # Blocks of query rows are dealt to the warpgroups of all CTAs of the cluster.
                lanes = self.wgs * self.cluster
                lane = rank * self.wgs + wg
                rQ = None
                if const_expr(not self.q_regs):
                    rQ = cute.make_rmem_tensor((8, 64 * d // 8 // 128), self.dtype)  # (8, d/16) Q pieces of a pass
                n_blocks = (q_len + qb - 1) // qb
                n_mine = (n_blocks - lane + lanes - 1) // lanes  # this warpgroup's blocks
                # At least one round: a split with no tiles still writes its (empty) partials.
                n_tiles = t_end - t_begin
                n_rounds = self.num_rounds(n_tiles)
                last_rb = lane + (n_blocks - 1 - lane) // lanes * lanes  # this warpgroup's last block
                wg_bar = 2 + wg  # named barrier of this warpgroup's 128 threads
                wait_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
                free_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
                waited = Int32(0)  # tiles (from the split's first) this warpgroup has waited for
                freed = Int32(0)  # and released
                for j in cutlass.range(n_rounds, unroll=1):
                    # Round j: one pass of each block over its tiles of the round, a chunk
                    # (chunk_bounds) or, with stagger, the block's own bounds (pass_bounds).
                    # Serpentine order (unstaggered): odd rounds walk this warpgroup's blocks
                    # backwards, so the partials stored last are reloaded first, while still in L2.
                    back = 0  # 1: backwards
                    if const_expr(self.stagger == 0):
                        back = j % 2
                    step = lanes - 2 * lanes * back
                    for k in cutlass.range(lane, n_blocks, lanes, unroll=1):
                        m = (k - lane) // lanes  # the block's place in this warpgroup's walk
                        rb = k + back * (last_rb + lane - 2 * k)
                        tok0 = rb * qb
                        b_rel, e_rel = self.pass_bounds(j, m, n_mine, n_tiles)
                        for _t in cutlass.range(waited, e_rel, unroll=1):
                            kv_pipe.consumer_wait(wait_state, kv_pipe.consumer_try_wait(wait_state))
                            wait_state.advance()
                        waited = cutlass.max(waited, e_rel)
                        c_begin = t_begin + b_rel
                        c_end = t_begin + e_rel
                        # Keys visible to the block's last token bound the tiles it needs.
                        last_tok = cutlass.min(q_len, tok0 + qb) - 1
                        key_end = seq_len - q_len + last_tok + 1
                        t_stop = cutlass.min(c_end, (key_end + tile_n - 1) // tile_n)
                        # The first round writes every block's partial (an empty one for blocks
                        # that see none of the split); later rounds touch only blocks they feed.
                        if j == 0 or t_stop > c_begin:
                            # Warm L2 with the next block's Q rows and partial, so its gather and
                            # reload do not wait on HBM latency. (The next round starts with this
                            # same block, or unstaggered with this warpgroup's first.)
                            nb = rb + step
                            if nb >= 0 and nb < n_blocks:
                                self.prefetch_block(mQ, mO, split, q_start, q_len, kvh, nb * qb, wg_tidx, j > 0)
                            # The block's Q rows and its partial are loaded together (both in
                            # flight at once, one L2 round trip per pass). With q_regs they stay in
                            # registers; else they go to SMEM once the warpgroup's previous pass is
                            # done with sQ_wg.
                            if const_expr(self.q_regs):
                                self.gather_q_regs(mQ, rQc, thr_pv, q_start, q_len, kvh, tok0)
                            else:
                                self.gather_q(mQ, rQ, q_start, q_len, kvh, wg_tidx, tok0, 128, qb)
                            if j == 0:
                                acc_O.fill(0.0)
                                row_max.fill(-Float32.inf)
                                row_sum.fill(0.0)
                            else:
                                self.reload(mO, mLSE, acc_O, row_max, row_sum, thr_pv, split, q_start, q_len,
                                            kvh, tok0, scale_log2)
                            if const_expr(not self.q_regs):
                                cute.arch.barrier(barrier_id=wg_bar, number_of_threads=128)  # sQ_wg free again
                                self.store_q(rQ, sQ_wg, wg_tidx, 128)
                                cute.arch.fence_view_async_shared()
                                cute.arch.barrier(barrier_id=wg_bar, number_of_threads=128)
                            self.attend_tiles(
                                c_begin, t_stop, t_begin, tok0, acc_S, acc_O, tOrP, tSrQ, tSrK, tOrVt, tScS,
                                row_max, row_sum, row_scale, seq_len, q_len, scale_log2, tiled_mma_qk, tiled_mma_pv,
                            )
                            softmax_finalize(acc_O, row_max, row_sum, lse, scale_log2)
                            self.store(mO, mLSE, acc_O, lse, thr_pv, split, q_start, q_len, kvh, 0, tok0, qb)
                        if const_expr(self.stagger > 0):
                            # Free the tiles no later pass of this warpgroup needs: below the next
                            # block's begin in this round and the first block's in the next (the
                            # begins rise through the walk, so tiles are freed in ring order).
                            nxt = self.round_begin(j + 1, n_rounds, n_mine, n_tiles)
                            if m + 1 < n_mine:
                                nxt = cutlass.min(nxt, self.pass_bounds(j, m + 1, n_mine, n_tiles)[0])
                            for _t in cutlass.range(freed, nxt, unroll=1):
                                kv_pipe.consumer_release(free_state)
                                free_state.advance()
                            freed = cutlass.max(freed, nxt)
                    # The round's end frees the tiles the next round does not need (the chunk,
                    # unstaggered). A warpgroup without blocks waits for them first: a slot is
                    # released only after its tile has landed.
                    nxt = self.round_begin(j + 1, n_rounds, n_mine, n_tiles)
                    for _t in cutlass.range(waited, nxt, unroll=1):
                        kv_pipe.consumer_wait(wait_state, kv_pipe.consumer_try_wait(wait_state))
                        wait_state.advance()
                    waited = cutlass.max(waited, nxt)
                    for _t in cutlass.range(freed, nxt, unroll=1):
                        kv_pipe.consumer_release(free_state)
                        free_state.advance()
                    freed = cutlass.max(freed, nxt)
        if const_expr(self.cluster > 1):
            # No CTA leaves while a peer may still multicast into its SMEM or arrive on its
            # barriers.
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    @cute.jit
    def num_rounds(self, n_tiles):
        """Rounds of the resident walk over a split of ``n_tiles`` (at least one): its chunks
        (config.chunk_bounds), or with stagger config.stagger_rounds."""
        chunk = self.chunk
        if const_expr(self.stagger > 0):
            first = (chunk + self.stagger - 1) // self.stagger
            n = 1 + (cutlass.max(n_tiles - first, 0) + chunk - 1) // chunk
        elif const_expr(self.edge > 0):
            # Edge chunks of `edge` tiles open and close the split.
            n = 1
            if n_tiles > self.edge:
                n = 2 + (cutlass.max(n_tiles - 2 * self.edge, 0) + chunk - 1) // chunk
        else:
            n = cutlass.max((n_tiles + chunk - 1) // chunk, 1)
        return n

    @cute.jit
    def round_begin(self, j, n_rounds, n_mine, n_tiles):
        """The first tile any pass of round j needs (its first block's begin; ``n_tiles`` past the
        last round)."""
        begin = n_tiles
        if j < n_rounds:
            begin = self.pass_bounds(j, 0, n_mine, n_tiles)[0]
        return begin

    @cute.jit
    def pass_bounds(self, j, m, n_mine, n_tiles):
        """[begin, end) (tiles from the split's first) of round j's pass of this warpgroup's m-th
        block (of ``n_mine``): config.chunk_bounds, or with stagger config.pass_bounds."""
        chunk = self.chunk
        begin = cutlass.min(j * chunk, n_tiles)
        end = cutlass.min(begin + chunk, n_tiles)
        if const_expr(self.stagger > 0):
            g = m * self.stagger // cutlass.max(n_mine, 1)
            first = (chunk * (g + 1) + self.stagger - 1) // self.stagger
            take = cutlass.min(first, self.stages - chunk)  # the longest remainder a pass absorbs
            begin = Int32(0)
            end = cutlass.min(first, n_tiles)
            if j > 0:
                begin = first + chunk * (j - 1)
                end = begin + chunk
                if n_tiles - end > 0 and n_tiles - end <= take:
                    end = n_tiles
                if j >= 2 and n_tiles - begin > 0 and n_tiles - begin <= take:
                    begin = n_tiles  # absorbed by round j - 1
                begin = cutlass.min(begin, n_tiles)
                end = cutlass.min(end, n_tiles)
        elif const_expr(self.edge > 0):
            # Edge chunks: the first holds `edge` tiles, the middle ones `chunk`, the last what is
            # left of `edge` (config.chunk_bounds).
            begin = self.chunk_start(j, n_tiles)
            end = n_tiles
            if j + 1 < self.num_rounds(n_tiles):
                end = self.chunk_start(j + 1, n_tiles)
        return begin, end

    @cute.jit
    def chunk_start(self, j, n_tiles):
        """First tile (from the split's start) of chunk j >= 0 with edge chunks."""
        start = 0
        if j > 0:
            start = cutlass.max(self.edge, cutlass.min(self.edge + (j - 1) * self.chunk, n_tiles - self.edge))
        return start

    @cute.jit
    def mask_tile(self, acc_S, t, tok0, row0, tScS, seq_len, q_len):
        """Mask keys past the sequence and the causal future of each query token; only tiles that
        reach past the first token's position need it."""
        tile_n, group = self.tile_n, self.group
        if (t + 1) * tile_n > seq_len - q_len + tok0 + 1:
            s_mn = acc_as_mn(acc_S)
            for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
                qi = tok0 + (row0 + tScS[r, 0][0]) // group
                limit = seq_len - q_len + qi + 1 - t * tile_n  # keys [0, limit) of this tile
                for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                    if tScS[r, c][1] >= limit:
                        s_mn[r, c] = -Float32.inf

    @cute.jit
    def attend_tile(self, t, stage, tok0, acc_S, acc_O, tOrP, tSrQ, tSrK, tOrVt, tScS, row_max, row_sum, row0,
                    seq_len, q_len, scale_log2, tiled_mma_qk, tiled_mma_pv):
        """One KV tile for one block of query rows: S = Q K^T, mask, online softmax, O += P V."""
        gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, stage], True)
        self.mask_tile(acc_S, t, tok0, row0, tScS, seq_len, q_len)
        softmax_update(acc_S, acc_O, row_max, row_sum, scale_log2)
        tOrP.store(acc_as_operand_a(acc_S).load().to(self.dtype))
        gemm(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, stage], False)

    @cute.jit
    def attend_tiles(self, t_first, t_stop, t_begin, tok0, acc_S, acc_O, tOrP, tSrQ, tSrK, tOrVt, tScS, row_max,
                     row_sum, row_scale, seq_len, q_len, scale_log2, tiled_mma_qk, tiled_mma_pv):
        """Tiles [t_first, t_stop) (all resident in SMEM) for one block of query rows, software
        pipelined: S(t) = Q K(t)^T and O += P(t-1) V(t-1) are issued together, and the softmax of
        tile t runs while the P V WGMMA is still in flight; O is rescaled once it lands."""
        stages, row0 = self.stages, 0
        if t_stop > t_first:
            st = (t_first - t_begin) % stages
            gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, st], True)
            self.mask_tile(acc_S, t_first, tok0, row0, tScS, seq_len, q_len)
            softmax_update(acc_S, acc_O, row_max, row_sum, scale_log2)
            tOrP.store(acc_as_operand_a(acc_S).load().to(self.dtype))
            for t in cutlass.range(t_first + 1, t_stop, unroll=1):
                st_prev = st
                st = (t - t_begin) % stages
                warpgroup.fence()
                gemm_issue(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, st], True)
                gemm_issue(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, st_prev], False)
                warpgroup.wait_group(1)  # S(t) is ready; P V of the previous tile may still run
                self.mask_tile(acc_S, t, tok0, row0, tScS, seq_len, q_len)
                softmax_step(acc_S, row_max, row_sum, row_scale, scale_log2)
                warpgroup.wait_group(0)
                rescale_rows(acc_O, row_scale)
                tOrP.store(acc_as_operand_a(acc_S).load().to(self.dtype))
            gemm(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, st], False)

    # ------------------------------------------------------------------------------------
    @cute.jit
    def load(self, kv_pipe, tma_h, mKVh, tma_d, mKVd, sK, sV, mPT, mLink, b, kvh, num_kv_heads, num_layers,
             layer, t_begin, t_end, n_pages, rank, admit):
        """Producer: warp 0 walks the CTA's tiles (the pipeline and each TMA copy elect one lane).
        With q_cluster the CTAs of the cluster take turns over a tile's boxes (K and V of each
        page piece): each box is issued by one of them and multicast to all, so every row of
        the tile crosses the link once."""
        rows, d = self.copy_rows, self.head_dim
        gKVh = cute.local_tile(mKVh, (rows, d), (None, 0, None))  # (rows, d, P/rows, Xh)
        gKVd = cute.local_tile(mKVd, (rows, d), (None, 0, None))  # (rows, d, P/rows, Xd)
        sK_cp = cute.local_tile(sK, (rows, d), (None, 0, None))  # (rows, d, copies, stages)
        sV_cp = cute.local_tile(sV, (rows, d), (None, 0, None))
        tSh, tGh = cpasync.tma_partition(
            tma_h, 0, cute.make_layout(1), cute.group_modes(sK_cp, 0, 2), cute.group_modes(gKVh, 0, 2)
        )
        tSVh, _ = cpasync.tma_partition(
            tma_h, 0, cute.make_layout(1), cute.group_modes(sV_cp, 0, 2), cute.group_modes(gKVh, 0, 2)
        )
        _, tGd = cpasync.tma_partition(
            tma_d, 0, cute.make_layout(1), cute.group_modes(sK_cp, 0, 2), cute.group_modes(gKVd, 0, 2)
        )
        # The whole warp walks the tiles: the pipeline's arrive and every TMA copy elect their own
        # lane. (An elect.sync from inside an already elected lane waits for lanes that never
        # come: the first cluster kernel hung there on the H200.)
        blocks_per_page = self.page_size // rows
        prod_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        # With max_inflight, tile t is issued only once tile t - max_inflight has landed (its full
        # barrier); that stage is not re-armed before tile t - max_inflight + stages > t, so the
        # phase it waits on is unambiguous. The wait arrives on nothing.
        landed = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        # link_credits (which implies max_inflight == 1): a tile that reads host pages takes a
        # device-wide ticket before it is issued; ``held`` remembers whether the tile in flight
        # holds one, reported once it lands. Tiles wholly in HBM leave the link counters alone.
        # In a cluster only rank 0 takes and reports tickets; each peer waits for rank 0's signal
        # on its ``admit`` barrier (phase ``admit_phase``) before issuing a host tile's boxes.
        # Rank 0 signals tile t + 1 only after tile t has landed, which needed every peer's boxes
        # of tile t, so a peer never has two signals pending.
        held = Int32(0)
        admit_phase = Int32(0)
        for t in cutlass.range(t_begin, t_end, unroll=1):
            if const_expr(self.max_inflight > 0):
                if t - t_begin >= self.max_inflight:
                    kv_pipe.consumer_wait(landed, kv_pipe.consumer_try_wait(landed))
                    landed.advance()
                    if const_expr(self.link_credits > 0):
                        if held != 0:
                            self.link_report(mLink, rank)
            kv_pipe.producer_acquire(prod_state)
            if const_expr(self.link_credits > 0):
                held = Int32(0)
                for c in cutlass.range_constexpr(self.copies):
                    slot = (t * self.tile_n + c * rows) // self.page_size
                    if slot < n_pages:
                        if mPT[b, slot] >= 0:
                            held = Int32(1)
                if held != 0:
                    if const_expr(self.cluster_admit):
                        if rank == 0:
                            self.link_admit(mLink)
                            if cute.arch.lane_idx() == 0:
                                for peer in cutlass.range_constexpr(1, self.cluster):
                                    cute.arch.mbarrier_arrive(admit, peer_cta_rank_in_cluster=peer)
                        else:
                            cute.arch.mbarrier_wait(admit, admit_phase)
                            admit_phase = admit_phase ^ 1
                    else:
                        self.link_admit(mLink)
            bar = kv_pipe.producer_get_barrier(prod_state)
            stage = prod_state.index
            for c in cutlass.range_constexpr(self.copies):
                token = t * self.tile_n + c * rows
                slot = token // self.page_size
                blk = (token % self.page_size) // rows
                entry = mPT[b, cutlass.min(slot, n_pages - 1)]
                piece = ((entry * num_layers + layer) * num_kv_heads + kvh) * 2
                if slot >= n_pages:
                    # Past the last page: an out-of-bounds box, zero-filled, no memory read.
                    self.tma_box(tma_h, tGh[None, blocks_per_page, 0], tSh[None, c, stage], bar, rank, 2 * c)
                    self.tma_box(tma_h, tGh[None, blocks_per_page, 0], tSVh[None, c, stage], bar, rank, 2 * c + 1)
                elif entry >= 0:
                    self.tma_box(tma_h, tGh[None, blk, piece], tSh[None, c, stage], bar, rank, 2 * c)
                    self.tma_box(tma_h, tGh[None, blk, piece + 1], tSVh[None, c, stage], bar, rank, 2 * c + 1)
                else:
                    hpiece = (((-entry - 1) * num_layers + layer) * num_kv_heads + kvh) * 2
                    self.tma_box(tma_d, tGd[None, blk, hpiece], tSh[None, c, stage], bar, rank, 2 * c)
                    self.tma_box(tma_d, tGd[None, blk, hpiece + 1], tSVh[None, c, stage], bar, rank, 2 * c + 1)
            prod_state.advance()
        if const_expr(self.link_credits > 0):
            # The last tile's ticket: every ticket taken is reported exactly once, so the
            # device-wide counters balance again when the launch ends.
            if held != 0:
                kv_pipe.consumer_wait(landed, kv_pipe.consumer_try_wait(landed))
                self.link_report(mLink, rank)
        if const_expr(not self.resident):
            kv_pipe.producer_tail(prod_state)

    @cute.jit
    def tma_box(self, atom, src, dst, bar, rank, box: cutlass.Constexpr):
        """One TMA box of a tile; with q_cluster only its owner (box modulo the cluster size)
        issues it, multicast to every CTA of the cluster."""
        if const_expr(self.cluster > 1):
            if rank == box % self.cluster:
                cute.copy(atom, src, dst, tma_bar_ptr=bar, mcast_mask=cutlass.Int16((1 << self.cluster) - 1))
        else:
            cute.copy(atom, src, dst, tma_bar_ptr=bar)

    @cute.jit
    def link_admit(self, mLink):
        """Take a device-wide link ticket and wait until at most ``link_credits - 1`` earlier
        tickets are unlanded (int32 differences: the counters may wrap)."""
        # The producer warp calls this with all lanes: lane 0 takes the ticket and reads the
        # landed count, the others get both from it, so the warp polls in step.
        ticket = Int32(0)
        if cute.arch.lane_idx() == 0:
            ticket = cute.arch.atomic_add(mLink.iterator, Int32(1), sem="relaxed", scope="gpu")
        ticket = cute.arch.shuffle_sync(ticket, 0)
        landed = cute.arch.shuffle_sync(cute.arch.load(mLink.iterator + 1, Int32, sem="relaxed", scope="gpu"), 0)
        while ticket - landed >= self.link_credits:
            # About one tile's link time per ticket ahead, capped: few polls of one L2 line.
            nanosleep(cutlass.min(ticket - landed - self.link_credits + 1, 8) * 256)
            landed = cute.arch.shuffle_sync(cute.arch.load(mLink.iterator + 1, Int32, sem="relaxed", scope="gpu"), 0)

    @cute.jit
    def link_report(self, mLink, rank):
        """Report a ticketed tile as landed: in a cluster only rank 0 took the ticket."""
        if const_expr(self.cluster_admit):
            if rank == 0:
                self.link_landed(mLink)
        else:
            self.link_landed(mLink)

    @cute.jit
    def link_landed(self, mLink):
        if cute.arch.lane_idx() == 0:  # once per warp
            cute.arch.red(mLink.iterator + 1, Int32(1), op="add", dtype="s32", sem="relaxed", scope="gpu")

    @cute.jit
    def load_q(self, mQ, sQ, q_start, q_len, kvh, ctidx, tok0, n_thr, q_per_block):
        """``n_thr`` consumer threads gather a block of query rows into ``sQ`` (rows, d)."""
        rQ = cute.make_rmem_tensor((8, cute.size(sQ, mode=[0]) * self.head_dim // 8 // n_thr), self.dtype)
        self.gather_q(mQ, rQ, q_start, q_len, kvh, ctidx, tok0, n_thr, q_per_block)
        self.store_q(rQ, sQ, ctidx, n_thr)

    @cute.jit
    def gather_q(self, mQ, rQ, q_start, q_len, kvh, ctidx, tok0, n_thr, q_per_block):
        """Issue this thread's loads of a block of query rows (row r = token tok0 + r // group,
        head r % group of the KV head's group) into ``rQ`` (8, pieces), one 16-byte piece per
        column; rows past the block's tokens are zero. Fully unrolled, nothing waits on a load
        here: the caller overlaps them with other loads before ``store_q`` consumes them."""
        d, group, vec = self.head_dim, self.group, 8  # 8 x 16-bit = one 16-byte access
        n_valid = cutlass.min(q_len - tok0, q_per_block)
        for k in cutlass.range_constexpr(cute.size(rQ, mode=[1])):
            i = ctidx + k * n_thr
            r = i // (d // vec)
            qi = r // group
            if qi < n_valid:
                gQv = cute.local_tile(mQ[q_start + tok0 + qi, kvh * group + r % group, None], (vec,), (i % (d // vec),))
                cute.autovec_copy(gQv, rQ[None, k])
            else:
                rQ[None, k].fill(self.dtype(0.0))

    @cute.jit
    def gather_q_regs(self, mQ, rQc, thr_pv, q_start, q_len, kvh, tok0):
        """Load this thread's elements of a pass's Q rows into ``rQc`` ((64, d) in the P V
        accumulator layout): 4-byte column pairs, as ``reload`` reads the partial; rows past the
        block's tokens are zero. Nothing waits here: the first Q K^T WGMMA does."""
        group, d = self.group, self.head_dim
        tQcQ = acc_as_mn(thr_pv.partition_C(cute.make_identity_tensor((64, d))))
        q_mn = acc_as_mn(rQc)
        for r in cutlass.range_constexpr(cute.size(q_mn, mode=[0])):
            row = tQcQ[r, 0][0]
            qi = row // group
            if qi < cutlass.min(q_len - tok0, self.q_per_wg):
                gQ_row = mQ[q_start + tok0 + qi, kvh * group + row % group, None]  # (d,)
                for c in cutlass.range_constexpr(cute.size(q_mn, mode=[1]) // 2):
                    rPair = cute.make_rmem_tensor((2,), self.dtype)  # (2,) columns 2c, 2c + 1
                    cute.autovec_copy(cute.local_tile(gQ_row, (2,), (tQcQ[r, 2 * c][1] // 2,)), rPair)
                    q_mn[r, 2 * c] = rPair[0]
                    q_mn[r, 2 * c + 1] = rPair[1]
            else:
                for c in cutlass.range_constexpr(cute.size(q_mn, mode=[1])):
                    q_mn[r, c] = self.dtype(0.0)

    @cute.jit
    def store_q(self, rQ, sQ, ctidx, n_thr):
        """Write the pieces ``gather_q`` loaded into ``sQ`` (rows, d)."""
        d, vec = self.head_dim, 8
        for k in cutlass.range_constexpr(cute.size(rQ, mode=[1])):
            i = ctidx + k * n_thr
            sQv = cute.local_tile(sQ[i // (d // vec), None], (vec,), (i % (d // vec),))  # (8,) swizzle keeps 16 B whole
            cute.autovec_copy(rQ[None, k], sQv)

    @cute.jit
    def prefetch_block(self, mQ, mO, split, q_start, q_len, kvh, tok0, wg_tidx, with_partial):
        """Prefetch into L2 one block's Q rows (and, ``with_partial``, its fp32 partial O)."""
        n_tok = cutlass.min(q_len - tok0, self.q_per_wg)
        self.prefetch_rows(mQ, q_start + tok0, kvh, n_tok, wg_tidx)
        if const_expr(self.split_out):
            if with_partial:
                self.prefetch_rows(mO[split, None, None, None], q_start + tok0, kvh, n_tok, wg_tidx)

    @cute.jit
    def prefetch_rows(self, mRows, tok0, kvh, n_tok, wg_tidx):
        """Prefetch into L2 the GQA group of KV head ``kvh`` for tokens [tok0, tok0 + n_tok) of a
        (tokens, Hq, d) tensor: each token's group is one contiguous run of ``group * d``
        elements. The 128 threads of a warpgroup issue one prefetch per 128-byte line."""
        group, d = self.group, self.head_dim
        elems = 128 * 8 // mRows.element_type.width  # elements per line
        lines = group * d // elems  # lines per token
        for k in cutlass.range_constexpr((self.q_per_wg * lines + 127) // 128):
            i = wg_tidx + k * 128
            if i // lines < n_tok:
                row = mRows[tok0 + i // lines, kvh * group, None]  # (d,) first head of the group
                cute.arch.prefetch((row.iterator + (i % lines) * elems).to_llvm_ptr(), cache_level="L2")

    @cute.jit
    def store(self, mO, mLSE, acc_O, lse, thr_pv, split, q_start, q_len, kvh, row0, tok0, q_per_block):
        """Write this warpgroup's rows of O (and their LSE) for valid query tokens."""
        group, d = self.group, self.head_dim
        o_split = 0
        if const_expr(self.split_out):
            o_split = split
        tOcO = acc_as_mn(thr_pv.partition_C(cute.make_identity_tensor((64, d))))
        o_mn = acc_as_mn(acc_O)
        for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
            row = row0 + tOcO[r, 0][0]
            qi = row // group
            if qi < cutlass.min(q_len - tok0, q_per_block):
                head = kvh * group + row % group
                gO_row = mO[o_split, q_start + tok0 + qi, head, None]  # (d,)
                # Columns come in pairs (2c, 2c + 1) held in adjacent registers: one vector store
                # each, so a quad of lanes writes a whole 32-byte sector of the row at once.
                for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1]) // 2):
                    gO = cute.local_tile(gO_row, (2,), (tOcO[r, 2 * c][1] // 2,))  # (2,)
                    rO = cute.make_rmem_tensor((2,), gO.element_type)  # (2,)
                    rO[0] = o_mn[r, 2 * c].to(gO.element_type)
                    rO[1] = o_mn[r, 2 * c + 1].to(gO.element_type)
                    cute.autovec_copy(rO, gO)
                if tOcO[r, 0][1] == 0:
                    mLSE[o_split, q_start + tok0 + qi, head] = lse[r]

    @cute.jit
    def reload(self, mO, mLSE, acc_O, row_max, row_sum, thr_pv, split, q_start, q_len, kvh, tok0, scale_log2):
        """Resume a block's online softmax from the normalised partial O and LSE this thread
        stored after the previous chunk: O_norm with max = LSE (in raw-score units) and sum = 1
        (a quarter on each of the 4 lanes that share a row). Rows past the block's tokens start
        empty."""
        group, d = self.group, self.head_dim
        tOcO = acc_as_mn(thr_pv.partition_C(cute.make_identity_tensor((64, d))))
        o_mn = acc_as_mn(acc_O)
        to_raw = LOG2_E / scale_log2
        for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
            row = tOcO[r, 0][0]
            qi = row // group
            if qi < cutlass.min(q_len - tok0, self.q_per_wg):
                head = kvh * group + row % group
                gO_row = mO[split, q_start + tok0 + qi, head, None]  # (d,)
                for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1]) // 2):
                    rO = cute.make_rmem_tensor((2,), Float32)  # (2,) columns 2c, 2c + 1
                    cute.autovec_copy(cute.local_tile(gO_row, (2,), (tOcO[r, 2 * c][1] // 2,)), rO)
                    o_mn[r, 2 * c] = rO[0]
                    o_mn[r, 2 * c + 1] = rO[1]
                row_max[r] = mLSE[split, q_start + tok0 + qi, head] * to_raw
                row_sum[r] = Float32(0.25)
            else:
                for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
                    o_mn[r, c] = Float32(0.0)
                row_max[r] = -Float32.inf
                row_sum[r] = Float32(0.0)
