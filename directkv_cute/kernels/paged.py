"""What the paged attention kernels share: their static configuration, the host side of the
launch (global tensors, TMA atoms, MMAs, shared storage) and the device set-up every CTA runs
(its work item, the SMEM ring and its pipeline, the consumer warpgroups' fragments).

One CTA per (split, KV head, sequence). A producer warp (``producer.KVProducer``) streams the
CTA's KV tiles into a ``stages``-deep SMEM ring; one or two consumer warpgroups run S = Q K^T
(WGMMA, SMEM operands), the online softmax (``softmax``), and O += P V (WGMMA, P from
registers). The kernels differ in how the consumers walk the ring: ``decode.DecodeAttention``
streams it, ``multi_token.MultiTokenAttention`` applies each resident chunk to every block of
query rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from directkv_cute.config import DecodeConfig
from directkv_cute.kernels.helpers import SmemAllocator, acc_as_mn, acc_as_operand_a, kv_smem_layout, transpose_view
from directkv_cute.kernels.producer import KVProducer
from directkv_cute.kernels.qio import QIO
from directkv_cute.kernels.walk import CtaWork

# setmaxnreg budgets (producer warpgroup, each consumer warpgroup) by (consumer warpgroups, CTAs
# per SM): 128 x (producer + wgs x consumer) x CTAs registers must fit the SM's 64K.
REGS = {(1, 1): (40, 232), (2, 1): (40, 232), (3, 1): (32, 160), (1, 2): (40, 216)}


def shared_storage(dt, n_mbar: int, q_elems: int, kv_elems: int, extra: dict | None = None):
    """The CTA's shared storage: the ring's mbarriers, the Q tile (none when ``q_elems`` is 0)
    and the K and V rings, each tile 1 KB aligned, then a kernel's ``extra`` fields (built with
    evaluated annotations, so a plain host function can make it)."""
    fields = {"mbar": cute.struct.MemRange[cutlass.Int64, n_mbar]}
    if q_elems:
        fields["sQ"] = cute.struct.Align[cute.struct.MemRange[dt, q_elems], 1024]
    fields["sK"] = cute.struct.Align[cute.struct.MemRange[dt, kv_elems], 1024]
    fields["sV"] = cute.struct.Align[cute.struct.MemRange[dt, kv_elems], 1024]
    fields.update(extra or {})
    return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))


@dataclass
class HostSetup:
    """The host side's tensors and atoms (``PagedAttention.host_setup``)."""

    mQ: cute.Tensor  # (total_q, Hq, d)
    mO: cute.Tensor  # (splits | 1, total_q, Hq, d)
    mLSE: cute.Tensor  # (splits | 1, total_q, Hq)
    mKVh: cute.Tensor  # TMA coordinate view of the host pool (P, d, Xh)
    mKVd: cute.Tensor  # TMA coordinate view of the HBM pool (P, d, Xd)
    mPT: cute.Tensor  # (B, max_pages) int32
    mSeqLen: cute.Tensor  # (B,)
    mCuQ: cute.Tensor  # (B + 1,)
    tma_h: cute.CopyAtom
    tma_d: cute.CopyAtom
    sQ_layout: cute.ComposedLayout  # (rows, d)
    sKV_layout: cute.ComposedLayout  # (tile_n, d, stages)
    tiled_mma_qk: cute.TiledMma
    tiled_mma_pv: cute.TiledMma


@dataclass
class ConsumerRegs:
    """One consumer thread's view of its warpgroup's work: MMA slices, operand fragments,
    accumulators and the softmax state of the block of query rows it holds."""

    ctidx: object  # thread among the consumers
    wg: object  # consumer warpgroup
    wg_tidx: object  # thread in the warpgroup
    mma_qk: cute.TiledMma
    mma_pv: cute.TiledMma
    thr_pv: object  # this thread's slice of mma_pv
    sQ_wg: object  # (64, d) the warpgroup's Q rows in SMEM (None with q_regs)
    rQc: object  # (64, d) as the P V accumulator: the pass's Q rows in registers (q_regs)
    tSrQ: object  # Q as the A operand of Q K^T
    tSrK: object  # K as the B operand, per stage
    tOrVt: object  # V^T as the B operand of P V, per stage
    acc_S: object  # (64, tile_n) fp32 scores
    acc_O: object  # (64, d) fp32 output
    tScS: object  # (rows, cols) of this thread: (row, key) coordinates of acc_S
    row_max: object  # (rows,) running max
    row_sum: object  # (rows,) running sum
    lse: object  # (rows,) finalized LSE
    row_scale: object  # (rows,) O rescale of a pipelined step
    tOrP: object  # P in the q dtype, as the A operand of P V
    row0: object  # the warpgroup's first row in the CTA's rows
    n_cons: int  # consumer threads


class PagedAttention:
    """Static configuration (everything that changes code generation) shared by the kernels; a
    kernel class adds its own fields and its ``kernel``; the host ``__call__`` is this one."""

    def __init__(self, dtype, head_dim: int, page_size: int, group: int, cfg: DecodeConfig, split_out: bool,
                 copy_rows: int, occupancy: int, tail: bool):
        self.dtype = dtype
        self.head_dim = head_dim
        self.page_size = page_size
        self.group = group
        self.tile_n = cfg.tile_n
        self.stages = cfg.stages
        self.wgs = cfg.consumer_wgs
        self.rows = 64 * cfg.consumer_wgs
        self.copy_rows = copy_rows
        self.copies = cfg.tile_n // self.copy_rows
        self.split_out = split_out
        # Each warpgroup keeps its pass's Q rows in registers (the QK^T WGMMA reads A from
        # registers) instead of an SMEM tile, freeing rows x d x 2 B of SMEM.
        self.q_regs = bool(cfg.q_regs)
        # A cluster of `cluster` CTAs shares each KV tile (each TMA box issued by one of them,
        # multicast to all) and splits the query rows.
        self.cluster = cfg.cluster
        assert not cfg.link_credits or cfg.max_inflight == 1, "link_credits needs max_inflight == 1"
        # Clusters under link admission: rank 0 admits each host tile for the whole cluster and
        # signals the peers through one more mbarrier (after the ring's 2 x stages).
        self.cluster_admit = self.cluster > 1 and cfg.link_credits > 0
        self.occupancy = occupancy  # 16-bit dtypes only
        self.num_threads = cfg.num_threads
        self.carveout = cfg.carveout
        # Query tokens whose whole GQA group fits in the CTA's rows; rows past
        # q_per_cta * group are padding.
        self.q_per_cta = self.rows // group
        assert self.q_per_cta >= 1, "a GQA group larger than the CTA's query rows"
        # Multi-token: each consumer warpgroup works through its own blocks of 64 rows.
        self.q_per_wg = 64 // group
        # Stages of the K/V operand tiles the MMAs read: the ring itself (pages in the q dtype).
        self.operand_stages = cfg.stages
        self.producer = KVProducer(head_dim, page_size, cfg.tile_n, cfg.stages, copy_rows, cfg.cluster,
                                   cfg.max_inflight, cfg.link_credits, self.cluster_admit, tail)
        self.qio = QIO(dtype, head_dim, group, self.q_per_wg, split_out)

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
        """The host side of the split kernels: global tensors, TMA atoms, MMAs and shared storage
        (``host_setup``), then the launch of the subclass's ``kernel``."""
        h = self.host_setup(q_ptr, o_ptr, lse_ptr, host_ptr, hbm_ptr, page_table_ptr, seq_lens_ptr, cu_q_ptr, batch,
                            total_q, num_kv_heads, num_layers, host_pages, hbm_pages, max_pages, num_splits)
        mLink = cute.make_tensor(link_ptr, cute.make_layout(2))
        C = self.cluster
        self.kernel(
            h.mQ, h.mO, h.mLSE, h.tma_h, h.mKVh, h.tma_d, h.mKVd, h.mPT, h.mSeqLen, h.mCuQ, mLink,
            num_kv_heads, num_layers, layer, num_splits, scale_log2,
            h.sQ_layout, h.sKV_layout, h.tiled_mma_qk, h.tiled_mma_pv,
        ).launch(
            grid=[num_splits * C, num_kv_heads, batch],
            block=[self.num_threads, 1, 1],
            cluster=[C, 1, 1] if const_expr(C > 1) else None,
            smem=self.shared_storage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=self.occupancy,
            preferred_smem_carveout=self.carveout,
        )

    def host_setup(self, q_ptr, o_ptr, lse_ptr, host_ptr, hbm_ptr, page_table_ptr, seq_lens_ptr, cu_q_ptr, batch,
                   total_q, num_kv_heads, num_layers, host_pages, hbm_pages, max_pages, num_splits) -> "HostSetup":
        """What every kernel's host side builds (at trace time): the global tensors, the TMA
        atoms of both pools, the two MMAs, the SMEM layouts and ``self.shared_storage``. With
        ``split_out`` O and LSE are (splits, ...) fp32 partials, else (1, ...) final outputs."""
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
        sKV_layout = kv_smem_layout(dt, self.tile_n, d, self.operand_stages)
        # A TMA box in the pools' element type (the q dtype, or FP8 pages).
        sCopy_layout = kv_smem_layout(mKVh.element_type, self.copy_rows, d)
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
        self.shared_storage, self.stage_bytes = self.storage(sQ_layout, sKV_layout)
        return HostSetup(mQ, mO, mLSE, mKVh_tma, mKVd_tma, mPT, mSeqLen, mCuQ, tma_h, tma_d, sQ_layout, sKV_layout,
                         tiled_mma_qk, tiled_mma_pv)

    def storage(self, sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout):
        """(the shared storage struct, the bytes one ring stage receives): the ring's mbarriers,
        the Q tile (none with q_regs), the K and V rings."""
        dt = self.dtype
        stage_bytes = 2 * cute.size_in_bytes(dt, cute.select(sKV_layout, mode=[0, 1]))
        n_mbar = 2 * self.stages + (1 if self.cluster_admit else 0)
        q_elems = 0 if self.q_regs else cute.cosize(sQ_layout)
        return shared_storage(dt, n_mbar, q_elems, cute.cosize(sKV_layout)), stage_bytes

    # ------------------------------------------------------------------------------------
    @cute.jit
    def cta_work(self, mSeqLen: cute.Tensor, mCuQ: cute.Tensor, num_splits):
        """This CTA's work item from its grid index; mSeqLen (B,), mCuQ (B + 1,)."""
        tile_n = self.tile_n
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
        return CtaWork(split, kvh, b, rank, seq_len, q_start, q_len, n_pages, t_begin, t_end)

    @cute.jit
    def ring(self, warp_idx, tidx, tma_h: cute.CopyAtom, tma_d: cute.CopyAtom, sQ_layout: cute.ComposedLayout,
             sKV_layout: cute.ComposedLayout, storage=None):
        """Prefetch the TMA descriptors, allocate the shared storage (unless the caller passes
        the one it allocated) and set up the KV ring's pipeline; returns (sQ (rows, d) or None
        with q_regs, sK (tile_n, d, operand_stages), sV, the pipeline, the cluster admit mbarrier
        or None)."""
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_h)
            cpasync.prefetch_descriptor(tma_d)

        if const_expr(storage is None):
            storage = SmemAllocator().allocate(self.shared_storage)
        sQ = None
        if const_expr(not self.q_regs):
            sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)  # (rows, d)
        sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)  # (tile_n, d, operand_stages)
        sV = storage.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)  # (tile_n, d, operand_stages)
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
        return sQ, sK, sV, kv_pipe, admit

    @cute.jit
    def consumer_regs(self, tidx, sQ, sK: cute.Tensor, sV: cute.Tensor, tiled_mma_qk: cute.TiledMma,
                      tiled_mma_pv: cute.TiledMma):
        """A consumer thread's slices, fragments, accumulators and softmax state."""
        d, tile_n = self.head_dim, self.tile_n
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
        return ConsumerRegs(ctidx, wg, wg_tidx, tiled_mma_qk, tiled_mma_pv, thr_pv, sQ_wg, rQc, tSrQ, tSrK, tOrVt,
                            acc_S, acc_O, tScS, row_max, row_sum, lse, row_scale, tOrP, row0, n_cons)
