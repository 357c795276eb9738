"""Paged attention of multi-token queries over KV in HBM: the Q-tiled kernel (compute-bound
chunks: long prefills, large chunked-prefill steps).

One CTA per (128 query rows, KV head, sequence), heaviest tiles first (the last query rows see
the most keys). Its producer warp (``producer.KVProducer``) streams every KV tile the rows see,
causally bounded, from the HBM pool into the SMEM ring; two consumer warpgroups of 64 rows each
keep O in registers across the whole walk and pipeline it as S(t) = Q K(t)^T issued together
with O += P(t-1) V(t-1), the softmax of tile t running while that P V WGMMA is in flight. Tiles
wholly below the first row's causal limit run a step compiled without the mask, the rest one with
it. With ``cluster`` 2 the CTAs of adjacent query tiles of a KV head form a cluster that walks the
same KV tiles (the range of its last query token), each issuing half of every tile's TMA boxes
multicast to both. The CTA writes the final O and LSE; a staged call in several KV splits
(``fold``) has the CTAs of each query tile's splits fold their rows into one fp32 accumulator in
launch order, the last one writing O and LSE: no partials, no combine kernel.

The KV must sit in HBM: each CTA reads all of it, so host pages would cross the link once per
query tile. The op stages host pages into an HBM buffer with the copy engine first
(``directkv_cute.staging``), piece by piece; with ``wait_ready`` the producer issues a tile once
its piece's flag says the copy landed, so compute overlaps the copy.

Legality: ``QTiledConfig.problems`` (tile_n 64 or 128, the ring within SMEM, cluster 1 or 2),
GQA group <= 128.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from directkv_cute.config import QTiledConfig
from directkv_cute.kernels.helpers import acc_as_operand_a, gemm_issue, pack_operand
from directkv_cute.kernels.masks import mask_tile
from directkv_cute.kernels.paged import PagedAttention
from directkv_cute.kernels.softmax import rescale_rows, softmax_finalize, softmax_reset, softmax_step, softmax_update
from directkv_cute.kernels.walk import CtaWork, NamedBarrier, RingState


# setmaxnreg budgets (producer warpgroup, each consumer warpgroup): 128 x (24 + 2 x 240) = 64512 of
# the SM's 64K. The consumers hold S and O of a 64 x 128 tile (128 fp32 registers) and P.
Q_TILED_REGS = (24, 240)


class QTiledAttention(PagedAttention):
    """Q-outer over HBM-resident KV: each CTA's 128 query rows walk all their KV tiles."""

    def __init__(self, dtype, head_dim: int, page_size: int, group: int, cfg: QTiledConfig, wait_ready: bool,
                 fold: bool = False):
        ring = cfg.ring_config()
        super().__init__(dtype, head_dim, page_size, group, ring, False, copy_rows=min(page_size, cfg.tile_n),
                         occupancy=1, tail=True)
        self.fold_splits = fold
        self.wait_ready = wait_ready
        self.producer.wait_ready = wait_ready
        self.pingpong = bool(cfg.pingpong)

    # ------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        q_ptr: cute.Pointer,  # (total_q, Hq, d) q dtype
        o_ptr: cute.Pointer,  # (total_q, Hq, d) q dtype
        lse_ptr: cute.Pointer,  # (total_q, Hq) fp32
        host_ptr: cute.Pointer,  # the pool of entries >= 0 (a staged call's: staging.hbm_in_place), same layout
        hbm_ptr: cute.Pointer,  # HBM pool or staging buffer, same layout
        page_table_ptr: cute.Pointer,  # (B, max_pages) int32: < 0 hbm_ptr's pages, >= 0 host_ptr's
        seq_lens_ptr: cute.Pointer,  # (B,) int32
        cu_q_ptr: cute.Pointer,  # (B + 1,) int32 query row offsets
        ready_ptr: cute.Pointer,  # (pieces,) int32 ready flags of the staged pieces (wait_ready)
        acc_ptr: cute.Pointer,  # fold: (total_q, Hq, d) fp32 running O of the splits folded so far
        acc_lse_ptr: cute.Pointer,  # fold: (total_q, Hq) fp32 their LSE
        turn_ptr: cute.Pointer,  # fold: (B, Hkv, grid x, 2) int32 splits folded per warpgroup's rows: 0, left 0
        batch: Int32,
        total_q: Int32,
        num_kv_heads: Int32,
        num_layers: Int32,
        layer: Int32,
        host_pages: Int32,
        hbm_pages: Int32,
        max_pages: Int32,
        n_q_tiles: Int32,
        num_splits: Int32,
        split_tiles: Int32,
        ascending: Int32,
        epoch: Int32,
        piece_tiles: Int32,
        flag_stride: Int32,
        head_base: Int32,
        grid_heads: Int32,
        split_first: Int32,
        scale_log2: Float32,
        stream: cuda.CUstream,
    ):
        h = self.host_setup(q_ptr, o_ptr, lse_ptr, host_ptr, hbm_ptr, page_table_ptr, seq_lens_ptr, cu_q_ptr, batch,
                            total_q, num_kv_heads, num_layers, host_pages, hbm_pages, max_pages, num_splits)
        mReady = cute.make_tensor(ready_ptr, cute.make_layout(max_pages * num_kv_heads))  # (flags,)
        C = self.cluster
        n_x = (n_q_tiles + C - 1) // C * C  # whole clusters of query tiles
        hq = num_kv_heads * self.group
        mAcc = cute.make_tensor(acc_ptr, cute.make_layout((1, total_q, hq, self.head_dim),
                                                          stride=(0, cute.assume(hq * self.head_dim, divby=64),
                                                                  self.head_dim, 1)))  # (1, total_q, Hq, d)
        mAccLSE = cute.make_tensor(acc_lse_ptr, cute.make_layout((1, total_q, hq), stride=(0, hq, 1)))  # (1, total_q, Hq)
        mTurn = cute.make_tensor(turn_ptr, cute.make_layout(batch * num_kv_heads * n_x * 2))  # (B * Hkv * n_x * 2,)
        self.kernel(
            h.mQ, h.mO, h.mLSE, h.tma_h, h.mKVh, h.tma_d, h.mKVd, h.mPT, h.mSeqLen, h.mCuQ, mReady, mAcc, mAccLSE, mTurn,
            num_kv_heads, num_layers, layer, batch, num_splits, split_tiles, ascending, epoch, piece_tiles, flag_stride,
            head_base, split_first, scale_log2, h.sQ_layout, h.sKV_layout, h.tiled_mma_qk, h.tiled_mma_pv,
        ).launch(
            grid=[n_x, grid_heads, batch * num_splits],
            block=[self.num_threads, 1, 1],
            cluster=[C, 1, 1] if const_expr(C > 1) else None,
            smem=self.shared_storage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=1,
            preferred_smem_carveout=self.carveout,
        )

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,  # (total_q, Hq, d)
        mO: cute.Tensor,  # (1, total_q, Hq, d)
        mLSE: cute.Tensor,  # (1, total_q, Hq)
        tma_h: cute.CopyAtom,
        mKVh: cute.Tensor,  # TMA coordinate view of host_ptr's pool (P, d, Xh)
        tma_d: cute.CopyAtom,
        mKVd: cute.Tensor,  # TMA coordinate view of the HBM pool (P, d, Xd)
        mPT: cute.Tensor,  # (B, max_pages) int32
        mSeqLen: cute.Tensor,  # (B,)
        mCuQ: cute.Tensor,  # (B + 1,)
        mReady: cute.Tensor,  # (flags,) int32: piece p of KV head h at h * flag_stride + p
        mAcc: cute.Tensor,  # (1, total_q, Hq, d) fp32 (fold)
        mAccLSE: cute.Tensor,  # (1, total_q, Hq) fp32 (fold)
        mTurn: cute.Tensor,  # (B * Hkv * n_x * 2,) int32 (fold)
        num_kv_heads: Int32,
        num_layers: Int32,
        layer: Int32,
        batch: Int32,
        num_splits: Int32,
        split_tiles: Int32,
        ascending: Int32,
        epoch: Int32,
        piece_tiles: Int32,
        flag_stride: Int32,
        head_base: Int32,
        split_first: Int32,
        scale_log2: Float32,
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        cta, tok0 = self.tile_work(mSeqLen, mCuQ, batch, num_kv_heads, num_splits, split_tiles, ascending, flag_stride,
                                   head_base, split_first)
        sQ, sK, sV, kv_pipe, admit = self.ring(warp_idx, tidx, tma_h, tma_d, sQ_layout, sKV_layout)

        if warp_idx < 4:
            # ---------------- producer warpgroup: warp 0 streams the KV tiles with TMA --------
            cute.arch.setmaxregister_decrease(Q_TILED_REGS[0])
            if warp_idx == 0:
                mReadyH = cute.make_tensor(mReady.iterator + cta.kvh * flag_stride, mReady.layout)  # this head's
                self.producer.load(
                    kv_pipe, tma_h, mKVh, tma_d, mKVd, sK, sV, mPT, None, cta, num_kv_heads, num_layers, layer,
                    admit, mReadyH, epoch, piece_tiles,
                )
        else:
            # ---------------- consumer warpgroups: 64 rows each, O in registers --------------
            cute.arch.setmaxregister_increase(Q_TILED_REGS[1])
            w = self.consumer_regs(tidx, sQ, sK, sV, tiled_mma_qk, tiled_mma_pv)
            self.qio.load_q(mQ, sQ, cta.q_start, cta.q_len, cta.kvh, w.ctidx, tok0, w.n_cons, self.q_per_cta)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=int(NamedBarrier.Q_STORED), number_of_threads=w.n_cons)
            softmax_reset(w.acc_O, w.row_max, w.row_sum)
            self.attend_all(w, cta, kv_pipe, tok0, scale_log2)
            softmax_finalize(w.acc_O, w.row_max, w.row_sum, w.lse, scale_log2)
            if const_expr(self.fold_splits):
                self.fold(mO, mLSE, mAcc, mAccLSE, mTurn, w, cta, tok0, batch, num_kv_heads)
            else:
                self.qio.store(mO, mLSE, w.acc_O, w.lse, w.thr_pv, 0, cta.q_start, cta.q_len, cta.kvh, w.row0, tok0,
                               self.q_per_cta)
        if const_expr(self.cluster > 1):
            # No CTA leaves while its peer may still multicast into its SMEM or arrive on its
            # barriers.
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    @cute.jit
    def tile_work(self, mSeqLen: cute.Tensor, mCuQ: cute.Tensor, batch, num_kv_heads, num_splits, split_tiles,
                  ascending, flag_stride, head_base, split_first):
        """(CtaWork, first query token) of this CTA. Grid x runs over query tiles from the last
        (heaviest) down, or with ``ascending`` from the first (the lightest, whose keys a staged
        copy lands first), y over KV heads, z over (split, sequence), split-major: split s owns KV
        tiles [s * split_tiles, (s + 1) * split_tiles), so the CTAs of early splits (whose staged
        pages land first) run first. Its z rank r (the order the splits fold in) runs split
        ``split_first`` + r, wrapped at ``num_splits`` (the splits from ``split_first`` on read pages
        that were in HBM before the copy began, a step's own tokens mirrored, whose CTAs then run
        while the copy lands the history). With ``flag_stride`` (a copy staged head by
        head, one split) the launch order (x, then y, then z) is remapped to KV head outermost, the
        order the copy lands the heads in. Grid y covers KV heads [``head_base``, ``head_base`` + grid y): all of
        them (``head_base`` 0, always with ``flag_stride``, whose remap spans every head) or a few,
        as a launch per KV head does. The CTAs of a cluster (adjacent in x) walk the same KV tiles: the
        causal range of the cluster's last query token. A cluster past its sequence's queries or
        its split's keys walks no KV tiles (folded, its rows add nothing: LSE -inf). The work item's
        ``split`` is the z rank."""
        tile_n, qpc, C = self.tile_n, self.q_per_cta, self.cluster
        mt, kvh, z = cute.arch.block_idx()
        n_mt, _, _ = cute.arch.grid_dim()
        if flag_stride != 0:
            yz = kvh + z * num_kv_heads  # launch rank of (head, sequence)
            kvh = yz // batch
            z = yz - kvh * batch
        kvh = kvh + head_base
        z_rank = z // batch
        b = z - z_rank * batch
        split = z_rank + split_first
        if split >= num_splits:
            split = split - num_splits
        seq_len = mSeqLen[b]
        q_start = mCuQ[b]
        q_len = mCuQ[b + 1] - q_start
        rank = mt % C
        base = mt - rank  # the cluster's first x
        tok0 = (n_mt - 1 - mt) * qpc
        tok_lo = (n_mt - base - C) * qpc  # the cluster's first and last tiles' first tokens
        tok_hi = (n_mt - 1 - base) * qpc
        if ascending != 0:
            tok0 = mt * qpc
            tok_lo = base * qpc
            tok_hi = (base + C - 1) * qpc
        last_tok = cutlass.min(q_len, tok_hi + qpc) - 1
        key_end = seq_len - q_len + last_tok + 1  # keys the cluster's last token sees
        t_begin = split * split_tiles
        t_end = t_begin
        if tok_lo < q_len:
            t_end = cutlass.max(t_begin, cutlass.min(t_begin + split_tiles, (key_end + tile_n - 1) // tile_n))
        n_pages = (seq_len + self.page_size - 1) // self.page_size
        if const_expr(C == 1):
            rank = 0
        return CtaWork(z_rank, kvh, b, rank, seq_len, q_start, q_len, n_pages, t_begin, t_end), tok0

    @cute.jit
    def attend_all(self, w, cta, kv_pipe, tok0, scale_log2):
        """Every KV tile [t_begin, t_end) as it lands, for this warpgroup's rows, software pipelined:
        S(t) and P(t-1) V(t-1) are issued together (``step``); tile t-1 is released once both are
        done. The tiles before the first one that reaches past the first row's causal limit run a
        step compiled without the mask, the rest one with it. With pingpong the two warpgroups
        alternate their issues (turn_wait / turn_done): both make the same n + 1 issues,
        warpgroup 1 first hands the first turn to warpgroup 0."""
        tile_n = self.tile_n
        seq_len, q_len, t0, n = cta.seq_len, cta.q_len, cta.t_begin, cta.t_end - cta.t_begin
        acc_S, acc_O, tOrP = w.acc_S, w.acc_O, w.tOrP
        wait_state = RingState.consumer(self.stages)
        free_state = RingState.consumer(self.stages)
        if n > 0:
            if const_expr(self.pingpong):
                if w.wg == 1:  # warpgroup 0 issues first
                    self.turn_done(0)
            kv_pipe.consumer_wait(wait_state, kv_pipe.consumer_try_wait(wait_state))
            st = wait_state.index
            self.turn_wait(w.wg)
            warpgroup.fence()
            gemm_issue(w.mma_qk, acc_S, w.tSrQ, w.tSrK[None, None, None, st], True)
            self.turn_done(1 - w.wg)
            warpgroup.wait_group(0)
            mask_tile(acc_S, t0, tok0, w.row0, w.tScS, seq_len, q_len, tile_n, self.group)
            softmax_update(acc_S, acc_O, w.row_max, w.row_sum, scale_log2)
            pack_operand(acc_as_operand_a(acc_S), tOrP)
            wait_state.advance()
            # Tiles [t0, t0 + n_free) lie wholly at or below the first row's causal limit.
            n_free = cutlass.max(cutlass.min((seq_len - q_len + tok0 + 1) // tile_n - t0, n), 1)
            for t in cutlass.range(1, n_free, unroll=1):
                st = self.step(w, kv_pipe, wait_state, free_state, st, cta, t, tok0, scale_log2, False)
                wait_state.advance()
                free_state.advance()
            for t in cutlass.range(n_free, n, unroll=1):
                st = self.step(w, kv_pipe, wait_state, free_state, st, cta, t, tok0, scale_log2, True)
                wait_state.advance()
                free_state.advance()
            self.turn_wait(w.wg)
            warpgroup.fence()
            gemm_issue(w.mma_pv, acc_O, tOrP, w.tOrVt[None, None, None, st], False)
            self.turn_done(1 - w.wg)
            warpgroup.wait_group(0)
            kv_pipe.consumer_release(free_state)

    @cute.jit
    def step(self, w, kv_pipe, wait_state, free_state, st, cta, t, tok0, scale_log2, masked: cutlass.Constexpr):
        """One pipelined step at KV tile t (from the split's first): wait for tile t, issue S(t) =
        Q K(t)^T and O += P(t-1) V(t-1) (tile t-1 in stage ``st``), the online softmax of S(t)
        (masked with ``masked``) while that P V runs, then release tile t-1, rescale O and convert
        P(t). The caller's loop advances the states. Returns tile t's stage."""
        acc_S, acc_O, tOrP = w.acc_S, w.acc_O, w.tOrP
        kv_pipe.consumer_wait(wait_state, kv_pipe.consumer_try_wait(wait_state))
        st_next = wait_state.index
        self.turn_wait(w.wg)
        warpgroup.fence()
        gemm_issue(w.mma_qk, acc_S, w.tSrQ, w.tSrK[None, None, None, st_next], True)
        gemm_issue(w.mma_pv, acc_O, tOrP, w.tOrVt[None, None, None, st], False)
        self.turn_done(1 - w.wg)
        warpgroup.wait_group(1)  # S(t) is ready; P V of tile t-1 may still run
        if const_expr(masked):
            mask_tile(acc_S, cta.t_begin + t, tok0, w.row0, w.tScS, cta.seq_len, cta.q_len, self.tile_n, self.group)
        softmax_step(acc_S, w.row_max, w.row_sum, w.row_scale, scale_log2)
        warpgroup.wait_group(0)
        kv_pipe.consumer_release(free_state)  # tile t-1: its K and V are read
        rescale_rows(acc_O, w.row_scale)
        pack_operand(acc_as_operand_a(acc_S), tOrP)
        return st_next

    @cute.jit
    def fold(self, mO, mLSE, mAcc, mAccLSE, mTurn, w, cta, tok0, batch, num_kv_heads):
        """Fold this warpgroup's rows into the launch's running O, in launch order. The
        split of z rank r waits until the rows' turn counter reads r (the ranks before it have
        folded theirs; they were dispatched first, so they run or have run), merges the
        accumulator into its registers (``QIO.merge``), then the last rank stores the final O and
        LSE and sets the counter back to 0 (the next launch on the stream starts from it), any other
        stores the accumulator and publishes turn r + 1 (the warpgroup's stores ordered before it by
        its barrier and a GPU-scope fence). A warpgroup with no valid row (the same for every rank)
        skips it all."""
        if w.row0 // self.group < cutlass.min(cta.q_len - tok0, self.q_per_cta):
            mt, _, _ = cute.arch.block_idx()
            n_x, _, n_z = cute.arch.grid_dim()
            ranks = n_z // batch
            rank = cta.split
            turn = mTurn.iterator + ((cta.b * num_kv_heads + cta.kvh) * n_x + mt) * 2 + w.wg
            bar = int(NamedBarrier.WG_BASE) + w.wg
            if rank > 0:
                if w.wg_tidx == 0:
                    seen = cute.arch.load(turn, Int32, sem="acquire", scope="gpu")
                    while seen != rank:
                        seen = cute.arch.load(turn, Int32, sem="acquire", scope="gpu")
                cute.arch.barrier(barrier_id=bar, number_of_threads=128)
                cute.arch.fence_acq_rel_gpu()
                self.qio.merge(mAcc, mAccLSE, w.acc_O, w.lse, w.thr_pv, cta.q_start, cta.q_len, cta.kvh, w.row0, tok0,
                               self.q_per_cta)
            if rank == ranks - 1:
                self.qio.store(mO, mLSE, w.acc_O, w.lse, w.thr_pv, 0, cta.q_start, cta.q_len, cta.kvh, w.row0, tok0,
                               self.q_per_cta)
                if w.wg_tidx == 0:  # the only reader left of this counter
                    cute.arch.store(turn, Int32(0), sem="relaxed", scope="gpu")
            else:
                self.qio.store(mAcc, mAccLSE, w.acc_O, w.lse, w.thr_pv, 0, cta.q_start, cta.q_len, cta.kvh, w.row0,
                               tok0, self.q_per_cta)
                cute.arch.barrier(barrier_id=bar, number_of_threads=128)
                if w.wg_tidx == 0:
                    cute.arch.fence_acq_rel_gpu()
                    cute.arch.store(turn, rank + 1, sem="relaxed", scope="gpu")

    @cute.jit
    def turn_wait(self, wg):
        """Pingpong: wait until the other warpgroup has issued its WGMMAs (its arrive on ours)."""
        if const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=int(NamedBarrier.SCHED_BASE) + wg, number_of_threads=256)

    @cute.jit
    def turn_done(self, other):
        """Pingpong: hand the tensor cores to warpgroup ``other``."""
        if const_expr(self.pingpong):
            cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.SCHED_BASE) + other, number_of_threads=256)
