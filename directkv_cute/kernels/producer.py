"""The paged-KV TMA producer with link admission, shared by the kernels.

Warp 0 of a CTA walks the CTA's KV tiles and issues them with TMA straight from the page pools
(pinned host memory through UVA, or the HBM tier) into the SMEM ring. The pools are viewed as
(page_size, head_dim, X) with X = ((page * L + layer) * Hkv + kv_head) * 2 + {0: K, 1: V}; a
TMA copy moves ``copy_rows = min(page_size, tile_n)`` tokens of one page. Copies past a
sequence's last page use an out-of-bounds coordinate, which TMA fills with zeros without touching
memory (and still counts the full box toward the stage's byte count).

Link admission (``link_credits``): the producer takes a ticket from a device-wide counter pair
before it issues a tile that reads host pages and reports the tile once it has landed, so at
most ``link_credits`` host tiles are in flight on the GPU; the consumers' HBM traffic (Q rows,
partials) does not queue behind a backlog of host requests. In a cluster the rank-0 CTA takes
the tile's ticket and, once admitted, arrives on an ``admit`` mbarrier in each peer's SMEM; the
peers wait on it before they issue their boxes and take no tickets, so no CTA holding a ticket
ever waits for another's.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync

try:
    from cutlass.experimental.primitives.nvvm_wrapper import nanosleep
except ImportError:  # CuTe DSL 4.6.0 (vLLM 0.26's pin): the same NVVM op, unwrapped
    from cutlass._mlir.dialects import nvvm as _nvvm
    from cutlass.cutlass_dsl import dsl_user_op

    @dsl_user_op
    def nanosleep(duration, *, loc=None, ip=None) -> None:
        _nvvm.nanosleep(Int32(duration).ir_value(loc=loc, ip=ip), loc=loc, ip=ip)


class KVProducer:
    """Static configuration of the producer (everything about it that changes code generation).
    ``tail``: finish with ``producer_tail`` (the streaming kernel; the multi-token kernel's
    consumers release the ring out of order and the CTA's exit needs no tail)."""

    def __init__(self, head_dim: int, page_size: int, tile_n: int, stages: int, copy_rows: int, cluster: int,
                 max_inflight: int, link_credits: int, cluster_admit: bool, tail: bool, wait_ready: bool = False):
        self.head_dim = head_dim
        self.page_size = page_size
        self.tile_n = tile_n
        self.stages = stages
        self.copy_rows = copy_rows
        self.copies = tile_n // copy_rows
        self.cluster = cluster
        self.max_inflight = max_inflight
        self.link_credits = link_credits
        self.cluster_admit = cluster_admit
        self.tail = tail
        # Staged KV (``staging``): before a tile is issued, the piece of the pages it reads must be
        # marked ready (the copy stream writes ``epoch`` into its flag once the piece's copies
        # are done).
        self.wait_ready = wait_ready

    @cute.jit
    def load(self, kv_pipe, tma_h, mKVh, tma_d, mKVd, sK, sV, mPT, mLink, cta, num_kv_heads, num_layers, layer,
             admit, mReady=None, epoch=None, piece_tiles=None, scales=None):
        """Producer: warp 0 walks the CTA's tiles (the pipeline and each TMA copy elect one lane).
        With q_cluster the CTAs of the cluster take turns over a tile's boxes (K and V of each
        page piece): each box is issued by one of them and multicast to all, so every row of
        the tile crosses the link once. ``cta``: the CTA's :class:`walk.CtaWork`; mKVh/mKVd (P, d, X)
        TMA coordinate views of the pools, sK/sV (tile_n, d, stages), mPT (B, max_pages). With
        ``wait_ready``: mReady (pieces,) int32 flags, tile t reads piece t // piece_tiles, ready
        once its flag has reached ``epoch``. With ``scales`` (FP8 pages, no cluster): (tma_hs, mSh,
        tma_ds, mSd, sKs, sVs), the scale pools' TMA atoms and (P, X) coordinate views and the
        (tile_n, stages) fp32 scale rings: each K/V box brings its rows' scales along."""
        b, kvh, rank, n_pages, t_begin, t_end = cta.b, cta.kvh, cta.rank, cta.n_pages, cta.t_begin, cta.t_end
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
        if const_expr(scales is not None):
            tma_hs, mSh, tma_ds, mSd, sKs, sVs = scales
            gSh = cute.local_tile(mSh, (rows,), (None, None))  # (rows, P/rows, Xh)
            gSd = cute.local_tile(mSd, (rows,), (None, None))  # (rows, P/rows, Xd)
            sKs_cp = cute.local_tile(sKs, (rows,), (None, None))  # (rows, copies, stages)
            sVs_cp = cute.local_tile(sVs, (rows,), (None, None))  # (rows, copies, stages)
            one = cute.make_layout(1)
            tKsh, tGsh = cpasync.tma_partition(tma_hs, 0, one, cute.group_modes(sKs_cp, 0, 1),
                                               cute.group_modes(gSh, 0, 1))
            tVsh, _ = cpasync.tma_partition(tma_hs, 0, one, cute.group_modes(sVs_cp, 0, 1), cute.group_modes(gSh, 0, 1))
            _, tGsd = cpasync.tma_partition(tma_ds, 0, one, cute.group_modes(sKs_cp, 0, 1), cute.group_modes(gSd, 0, 1))
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
        ready = Int32(0)  # pieces [0, ready) seen ready (wait_ready)
        for t in cutlass.range(t_begin, t_end, unroll=1):
            if const_expr(self.wait_ready):
                ready = self.wait_piece(mReady, epoch, t // piece_tiles, ready)
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
                    if const_expr(scales is not None):
                        cute.copy(tma_hs, tGsh[None, blocks_per_page, 0], tKsh[None, c, stage], tma_bar_ptr=bar)
                        cute.copy(tma_hs, tGsh[None, blocks_per_page, 0], tVsh[None, c, stage], tma_bar_ptr=bar)
                elif entry >= 0:
                    self.tma_box(tma_h, tGh[None, blk, piece], tSh[None, c, stage], bar, rank, 2 * c)
                    self.tma_box(tma_h, tGh[None, blk, piece + 1], tSVh[None, c, stage], bar, rank, 2 * c + 1)
                    if const_expr(scales is not None):
                        cute.copy(tma_hs, tGsh[None, blk, piece], tKsh[None, c, stage], tma_bar_ptr=bar)
                        cute.copy(tma_hs, tGsh[None, blk, piece + 1], tVsh[None, c, stage], tma_bar_ptr=bar)
                else:
                    hpiece = (((-entry - 1) * num_layers + layer) * num_kv_heads + kvh) * 2
                    self.tma_box(tma_d, tGd[None, blk, hpiece], tSh[None, c, stage], bar, rank, 2 * c)
                    self.tma_box(tma_d, tGd[None, blk, hpiece + 1], tSVh[None, c, stage], bar, rank, 2 * c + 1)
                    if const_expr(scales is not None):
                        cute.copy(tma_ds, tGsd[None, blk, hpiece], tKsh[None, c, stage], tma_bar_ptr=bar)
                        cute.copy(tma_ds, tGsd[None, blk, hpiece + 1], tVsh[None, c, stage], tma_bar_ptr=bar)
            prod_state.advance()
        if const_expr(self.link_credits > 0):
            # The last tile's ticket: every ticket taken is reported exactly once, so the
            # device-wide counters balance again when the launch ends.
            if held != 0:
                kv_pipe.consumer_wait(landed, kv_pipe.consumer_try_wait(landed))
                self.link_report(mLink, rank)
        if const_expr(self.tail):
            kv_pipe.producer_tail(prod_state)

    @cute.jit
    def wait_piece(self, mReady, epoch, piece, ready):
        """Wait until staged piece ``piece`` is marked ready (its flag - epoch >= 0, int32
        differences), unless a later piece already was; returns the pieces known ready."""
        if piece >= ready:
            flag = cute.arch.load(mReady.iterator + piece, Int32, sem="acquire", scope="sys")
            while flag - epoch < 0:
                nanosleep(512)
                flag = cute.arch.load(mReady.iterator + piece, Int32, sem="acquire", scope="sys")
            # The copy engine wrote the piece; the TMA reads below go through the async proxy.
            cute.arch.fence_proxy("async.global")
            ready = piece + 1
        return ready

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
