"""Split-KV paged attention over host-resident KV: the streaming decode kernel.

One CTA per (split, KV head, sequence). The producer warp (``producer.KVProducer``) streams the
CTA's KV tiles with TMA from the page pools into a ``stages``-deep SMEM ring; one or two
consumer warpgroups hold all ``group * q_len`` query rows of the KV head (GQA group packed into
the WGMMA M dimension) and, tile by tile as each lands, run S = Q K^T (WGMMA, SMEM operands), the
mask and the online softmax, and O += P V (WGMMA, P from registers), releasing the stage right
after. Each KV tile crosses the link once and serves every query row that needs it.

Outputs: with ``split_out`` the CTA writes its normalised partial O (fp32) and LSE for the
combine kernel; otherwise it writes the final O (q dtype) and LSE directly.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr

from directkv_cute.config import DecodeConfig
from directkv_cute.kernels.helpers import acc_as_operand_a, gemm
from directkv_cute.kernels.masks import mask_tile
from directkv_cute.kernels.paged import REGS, PagedAttention
from directkv_cute.kernels.softmax import softmax_finalize, softmax_reset, softmax_update
from directkv_cute.kernels.walk import NamedBarrier


class DecodeAttention(PagedAttention):
    """The streaming kernel: every query row of a KV head fits one CTA; tiles flow through the ring."""

    def __init__(self, dtype, head_dim: int, page_size: int, group: int, cfg: DecodeConfig, split_out: bool):
        assert not cfg.multi_token_only, f"{cfg.multi_token_only}: multi-token kernel options"
        super().__init__(dtype, head_dim, page_size, group, cfg, split_out, copy_rows=min(page_size, cfg.tile_n),
                         occupancy=1, tail=True)

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
            self.consume(tidx, mQ, mO, mLSE, sQ, sK, sV, kv_pipe, cta, tiled_mma_qk, tiled_mma_pv, scale_log2)
        if const_expr(self.cluster > 1):
            # No CTA leaves while a peer may still multicast into its SMEM or arrive on its
            # barriers.
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    @cute.jit
    def consume(self, tidx, mQ, mO, mLSE, sQ, sK, sV, kv_pipe, cta, tiled_mma_qk, tiled_mma_pv, scale_log2,
                ring=None):
        """The consumer warpgroups: Q into SMEM, the CTA's tiles streamed through ``step`` as they
        land (every query row fits one block), then O and LSE out. ``ring``: what ``step`` needs
        beyond the K/V operand tiles (a subclass's own SMEM), passed through."""
        w = self.consumer_regs(tidx, sQ, sK, sV, tiled_mma_qk, tiled_mma_pv)
        self.qio.load_q(mQ, sQ, cta.q_start, cta.q_len, cta.kvh, w.ctidx, 0, w.n_cons, self.q_per_cta)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=int(NamedBarrier.Q_STORED), number_of_threads=w.n_cons)
        softmax_reset(w.acc_O, w.row_max, w.row_sum)
        cons_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        for t in cutlass.range(cta.t_begin, cta.t_end, unroll=1):
            kv_pipe.consumer_wait(cons_state, kv_pipe.consumer_try_wait(cons_state))
            self.step(w, cta, t, kv_pipe, cons_state, scale_log2, ring)
            cons_state.advance()
        softmax_finalize(w.acc_O, w.row_max, w.row_sum, w.lse, scale_log2)
        self.qio.store(mO, mLSE, w.acc_O, w.lse, w.thr_pv, cta.split, cta.q_start, cta.q_len, cta.kvh, w.row0, 0,
                       self.q_per_cta)

    @cute.jit
    def step(self, w, cta, t, kv_pipe, state, scale_log2, ring):
        """Tile t, landed in ring stage ``state``: attend to it in place, then free the stage
        (the caller moves ``state`` on: the loop carries it only through its own call)."""
        self.attend_tile(w, cta, t, state.index, scale_log2)
        kv_pipe.consumer_release(state)

    @cute.jit
    def attend_tile(self, w, cta, t, stage, scale_log2):
        """One KV tile (ring stage ``stage``) for the CTA's query rows: S = Q K^T, mask, online
        softmax, O += P V."""
        gemm(w.mma_qk, w.acc_S, w.tSrQ, w.tSrK[None, None, None, stage], True)
        mask_tile(w.acc_S, t, 0, w.row0, w.tScS, cta.seq_len, cta.q_len, self.tile_n, self.group)
        softmax_update(w.acc_S, w.acc_O, w.row_max, w.row_sum, scale_log2)
        w.tOrP.store(acc_as_operand_a(w.acc_S).load().to(self.dtype))
        gemm(w.mma_pv, w.acc_O, w.tOrP, w.tOrVt[None, None, None, stage], False)
