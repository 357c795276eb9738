"""Split-KV paged attention over host-resident KV for multi-token queries: the KV-outer chunk
kernel (prefill, chunked prefill, long speculative windows).

One CTA per (split, KV head, sequence); the producer warp (``producer.KVProducer``) streams the
CTA's KV tiles into the SMEM ring as in the decode kernel. The consumers walk the split a chunk
of ``cfg.chunk`` tiles at a time (``walk.ChunkWalk``): every block of query rows (64 rows per
consumer warpgroup) is applied to the chunk while it sits in SMEM, and the ring slots a chunk
frees are refilled with the next chunk while the consumers work (no link idle time between
chunks). A block's running softmax state is carried across chunks in the split's fp32 partial
(normalised O and LSE, reloaded by the thread that stored it: ``qio.QIO.reload``).

Options: ``edge_tiles`` shortens each CTA's first and last chunk (``config.chunk_bounds``);
``stagger`` gives each block of query rows its own chunk boundaries, staggered through the walk
(``config.block_passes``), so the first blocks start after one tile and tiles are freed one at a
time; ``q_regs`` keeps a pass's Q rows in registers (Q K^T with A from registers), so the Q tile's
SMEM goes to the ring; ``q_cluster`` shares each tile among the CTAs of a cluster, each issuing
some of its boxes multicast to all. Always writes split partials (combined afterwards).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from directkv_cute.config import DecodeConfig
from directkv_cute.kernels.helpers import acc_as_operand_a, gemm, gemm_issue
from directkv_cute.kernels.masks import mask_tile
from directkv_cute.kernels.paged import REGS, PagedAttention
from directkv_cute.kernels.trace import SLOTS, TRACE_ELEMS, Trace
from directkv_cute.kernels.softmax import (
    rescale_rows,
    softmax_finalize,
    softmax_reset,
    softmax_step,
    softmax_update,
)
from directkv_cute.kernels.walk import ChunkWalk, NamedBarrier, RingState


class MultiTokenAttention(PagedAttention):
    """The KV-outer chunk kernel: each CTA's KV chunk stays in SMEM while every block of query
    rows is applied to it."""

    def __init__(self, dtype, head_dim: int, page_size: int, group: int, cfg: DecodeConfig, split_out: bool = True,
                 trace: Trace | None = None):
        copy_rows = min(page_size, cfg.tile_n)
        if cfg.q_cluster:
            # The CTAs of a cluster share out a tile's TMA boxes (K and V of each piece): pieces
            # are halved (fewer rows, whole 2*d-byte rows still) until every CTA has a box.
            while 2 * cfg.tile_n // copy_rows < cfg.cluster:
                copy_rows //= 2
        super().__init__(dtype, head_dim, page_size, group, cfg, split_out, copy_rows=copy_rows,
                         occupancy=cfg.multi_token_occupancy(head_dim), tail=False)
        self.chunk = cfg.chunk
        # Timeline stamps (``kernels/trace.py``, for ``bench timeline``): None compiles none.
        self.trace = trace
        self.skip_passes = bool(trace is not None and trace.skip_passes)
        self.walk = ChunkWalk(cfg.chunk, cfg.edge_tiles, cfg.stagger, cfg.stages)
        assert self.q_per_wg >= 1, "the multi-token kernel holds GQA groups up to 64"

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
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        cta = self.cta_work(mSeqLen, mCuQ, num_splits)
        sQ, sK, sV, kv_pipe, admit = self.ring(warp_idx, tidx, tma_h, tma_d, sQ_layout, sKV_layout)

        if warp_idx < 4:
            # ---------------- producer warpgroup: warp 0 streams K/V pages with TMA ----------
            cute.arch.setmaxregister_decrease(REGS[self.wgs, self.occupancy][0])
            if warp_idx == 0:
                self.producer.load(
                    kv_pipe, tma_h, mKVh, tma_d, mKVd, sK, sV, mPT, mLink, cta, num_kv_heads, num_layers, layer, admit,
                )
        else:
            # ---------------- consumer warpgroups -------------------------------------------
            cute.arch.setmaxregister_increase(REGS[self.wgs, self.occupancy][1])
            w = self.consumer_regs(tidx, sQ, sK, sV, tiled_mma_qk, tiled_mma_pv)
            # KV-outer: the CTA walks its tiles a chunk at a time. Every block of query rows is
            # applied to the chunk while it sits in SMEM; only then are its ring slots released,
            # so the producer loads the next chunk (into the other slots of the ring) while the
            # consumers work on this one. A block's running (O, max, sum) lives in this split's
            # partial: stored normalised with its LSE after each chunk and reloaded for the next.
            # Each consumer warpgroup takes its own blocks of q_per_wg tokens (64 rows) and syncs
            # only with itself, so one warpgroup's per-block work (Q gather, partial reload and
            # store) overlaps the other's MMAs.
            d, tile_n = self.head_dim, self.tile_n
            split, kvh, q_start, q_len, t_begin = cta.split, cta.kvh, cta.q_start, cta.q_len, cta.t_begin
            wg, wg_tidx = w.wg, w.wg_tidx
            qb = self.q_per_wg
            # Blocks of query rows are dealt to the warpgroups of all CTAs of the cluster.
            lanes = self.wgs * self.cluster
            lane = cta.rank * self.wgs + wg
            rQ = None
            if const_expr(not self.q_regs):
                rQ = cute.make_rmem_tensor((8, 64 * d // 8 // 128), self.dtype)  # (8, d/16) Q pieces of a pass
            n_blocks = (q_len + qb - 1) // qb
            n_mine = (n_blocks - lane + lanes - 1) // lanes  # this warpgroup's blocks
            # At least one round: a split with no tiles still writes its (empty) partials.
            n_tiles = cta.t_end - t_begin
            n_rounds = self.walk.num_rounds(n_tiles)
            last_rb = lane + (n_blocks - 1 - lane) // lanes * lanes  # this warpgroup's last block
            wg_bar = int(NamedBarrier.WG_BASE) + wg  # named barrier of this warpgroup's 128 threads
            tr = None  # trace: this CTA's SLOTS stamps (bench timeline)
            if const_expr(self.trace is not None):
                tr = self.trace_slots(cta, kvh, num_splits, num_kv_heads)
                self.stamp(tr, w, 0, True)
            wait_state = RingState.consumer(self.stages)  # the next tile to wait for
            free_state = RingState.consumer(self.stages)  # the next tile to release
            waited = Int32(0)  # tiles (from the split's first) this warpgroup has waited for
            freed = Int32(0)  # and released
            for j in cutlass.range(n_rounds, unroll=1):
                # Round j: one pass of each block over its tiles of the round, a chunk
                # (chunk_bounds) or, with stagger, the block's own bounds (pass_bounds).
                # Serpentine order (unstaggered): odd rounds walk this warpgroup's blocks
                # backwards, so the partials stored last are reloaded first, while still in L2.
                back = 0  # 1: backwards
                if const_expr(self.walk.stagger == 0):
                    back = j % 2
                step = lanes - 2 * lanes * back
                for k in cutlass.range(lane, n_blocks, lanes, unroll=1):
                    m = (k - lane) // lanes  # the block's place in this warpgroup's walk
                    rb = k + back * (last_rb + lane - 2 * k)
                    tok0 = rb * qb
                    b_rel, e_rel = self.walk.pass_bounds(j, m, n_mine, n_tiles)
                    waited = wait_state.wait_through(kv_pipe, waited, e_rel)
                    if const_expr(self.trace is not None):
                        self.stamp(tr, w, 1 + 2 * j, j < 31 and m == 0)  # round j's first tiles landed
                    c_begin = t_begin + b_rel
                    c_end = t_begin + e_rel
                    # Keys visible to the block's last token bound the tiles it needs.
                    last_tok = cutlass.min(q_len, tok0 + qb) - 1
                    key_end = cta.seq_len - q_len + last_tok + 1
                    t_stop = cutlass.min(c_end, (key_end + tile_n - 1) // tile_n)
                    # The first round writes every block's partial (an empty one for blocks
                    # that see none of the split); later rounds touch only blocks they feed.
                    if j == 0 or t_stop > c_begin:
                        if const_expr(not self.skip_passes):  # bench timeline --skip-passes: none
                            # Warm L2 with the next block's Q rows and partial, so its gather and
                            # reload do not wait on HBM latency. (The next round starts with this
                            # same block, or unstaggered with this warpgroup's first.)
                            if const_expr(self.trace is not None):
                                self.stamp(tr, w, 64 + 4 * m, j == self.trace.chunk and m < 16)  # pass start
                            nb = rb + step
                            if nb >= 0 and nb < n_blocks:
                                self.qio.prefetch_block(mQ, mO, split, q_start, q_len, kvh, nb * qb, wg_tidx, j > 0)
                            # The block's Q rows and its partial are loaded together (both in
                            # flight at once, one L2 round trip per pass). With q_regs they stay in
                            # registers; else they go to SMEM once the warpgroup's previous pass is
                            # done with sQ_wg.
                            if const_expr(self.q_regs):
                                self.qio.gather_q_regs(mQ, w.rQc, w.thr_pv, q_start, q_len, kvh, tok0)
                            else:
                                self.qio.gather_q(mQ, rQ, q_start, q_len, kvh, wg_tidx, tok0, 128, qb)
                            if j == 0:
                                softmax_reset(w.acc_O, w.row_max, w.row_sum)
                            else:
                                self.qio.reload(mO, mLSE, w.acc_O, w.row_max, w.row_sum, w.thr_pv, split, q_start, q_len,
                                           kvh, tok0, scale_log2)
                            if const_expr(not self.q_regs):
                                cute.arch.barrier(barrier_id=wg_bar, number_of_threads=128)  # sQ_wg free again
                                self.qio.store_q(rQ, w.sQ_wg, wg_tidx, 128)
                                cute.arch.fence_view_async_shared()
                                cute.arch.barrier(barrier_id=wg_bar, number_of_threads=128)
                            if const_expr(self.trace is not None):
                                self.stamp(tr, w, 65 + 4 * m, j == self.trace.chunk and m < 16)  # WGMMA loop
                            self.attend_tiles(w, cta, c_begin, t_stop, tok0, scale_log2)
                            if const_expr(self.trace is not None):
                                self.stamp(tr, w, 66 + 4 * m, j == self.trace.chunk and m < 16)  # finalize
                            softmax_finalize(w.acc_O, w.row_max, w.row_sum, w.lse, scale_log2)
                            self.qio.store(mO, mLSE, w.acc_O, w.lse, w.thr_pv, split, q_start, q_len, kvh, 0, tok0, qb)
                            if const_expr(self.trace is not None):
                                self.stamp(tr, w, 67 + 4 * m, j == self.trace.chunk and m < 16)  # stored
                    if const_expr(self.walk.stagger > 0):
                        # Free the tiles no later pass of this warpgroup needs: below the next
                        # block's begin in this round and the first block's in the next (the
                        # begins rise through the walk, so tiles are freed in ring order).
                        nxt = self.walk.round_begin(j + 1, n_rounds, n_mine, n_tiles)
                        if m + 1 < n_mine:
                            nxt = cutlass.min(nxt, self.walk.pass_bounds(j, m + 1, n_mine, n_tiles)[0])
                        freed = free_state.release_through(kv_pipe, freed, nxt)
                # The round's end frees the tiles the next round does not need (the chunk,
                # unstaggered). A warpgroup without blocks waits for them first: a slot is
                # released only after its tile has landed.
                if const_expr(self.trace is not None):
                    self.stamp(tr, w, 2 + 2 * j, j < 31)  # round j done
                nxt = self.walk.round_begin(j + 1, n_rounds, n_mine, n_tiles)
                waited = wait_state.wait_through(kv_pipe, waited, nxt)
                freed = free_state.release_through(kv_pipe, freed, nxt)
        if const_expr(self.cluster > 1):
            # No CTA leaves while a peer may still multicast into its SMEM or arrive on its
            # barriers.
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    @cute.jit
    def trace_slots(self, cta, kvh, num_splits, num_kv_heads):
        """This CTA's SLOTS int64 stamps in the trace buffer, (CTAs x SLOTS,) from its address."""
        C = self.cluster
        cta_id = cta.split * C + cta.rank + num_splits * C * (kvh + num_kv_heads * cta.b)
        buf = cute.make_tensor(cute.make_ptr(cutlass.Int64, self.trace.addr, cute.AddressSpace.gmem, assumed_align=8),
                               cute.make_layout(TRACE_ELEMS))
        return cute.local_tile(buf, (SLOTS,), (cta_id,))  # (SLOTS,)

    @cute.jit
    def stamp(self, tr, w, slot, cond):
        """The first consumer thread writes %globaltimer into ``slot`` when ``cond``."""
        if w.ctidx == 0:
            if cond:
                tr[slot] = cute.arch.globaltimer()

    @cute.jit
    def attend_tiles(self, w, cta, t_first, t_stop, tok0, scale_log2):
        """Tiles [t_first, t_stop) (all resident in SMEM) for one block of query rows (token tok0
        on), software pipelined: S(t) = Q K(t)^T and O += P(t-1) V(t-1) are issued together, and
        the softmax of tile t runs while the P V WGMMA is still in flight; O is rescaled once it
        lands."""
        stages, row0, t_begin = self.stages, 0, cta.t_begin
        seq_len, q_len, tile_n, group = cta.seq_len, cta.q_len, self.tile_n, self.group
        acc_S, acc_O, tOrP, tSrQ, tSrK, tOrVt = w.acc_S, w.acc_O, w.tOrP, w.tSrQ, w.tSrK, w.tOrVt
        row_max, row_sum, row_scale, tScS = w.row_max, w.row_sum, w.row_scale, w.tScS
        if t_stop > t_first:
            st = (t_first - t_begin) % stages
            gemm(w.mma_qk, acc_S, tSrQ, tSrK[None, None, None, st], True)
            mask_tile(acc_S, t_first, tok0, row0, tScS, seq_len, q_len, tile_n, group)
            softmax_update(acc_S, acc_O, row_max, row_sum, scale_log2)
            tOrP.store(acc_as_operand_a(acc_S).load().to(self.dtype))
            for t in cutlass.range(t_first + 1, t_stop, unroll=1):
                st_prev = st
                st = (t - t_begin) % stages
                warpgroup.fence()
                gemm_issue(w.mma_qk, acc_S, tSrQ, tSrK[None, None, None, st], True)
                gemm_issue(w.mma_pv, acc_O, tOrP, tOrVt[None, None, None, st_prev], False)
                warpgroup.wait_group(1)  # S(t) is ready; P V of the previous tile may still run
                mask_tile(acc_S, t, tok0, row0, tScS, seq_len, q_len, tile_n, group)
                softmax_step(acc_S, row_max, row_sum, row_scale, scale_log2)
                warpgroup.wait_group(0)
                rescale_rows(acc_O, row_scale)
                tOrP.store(acc_as_operand_a(acc_S).load().to(self.dtype))
            gemm(w.mma_pv, acc_O, tOrP, tOrVt[None, None, None, st], False)
