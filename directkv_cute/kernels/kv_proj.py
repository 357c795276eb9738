"""Fused K/V projection + RoPE + KV-cache store of one layer's new tokens (sm_90a).

For T new tokens with hidden states X (T, hidden): K = X W_k^T (+ b_k), V = X W_v^T (+ b_v),
the rotary embedding applied to K as Hugging Face transformers applies it (the NeoX /
``rotate_half`` layout, with the (T, d) cos and sin the model's rotary module produced), and
each row stored straight into its KV-cache page: the pinned host pool (through its UVA alias),
an HBM pool, and dense (T, Hkv, d) outputs, each optional.

One CTA per (N tile, M tile, K split). An N tile is one head of K or V: the head's 128 rows of
W_k or W_v, so the 128 output columns of a CTA are exactly one head's d columns and
``rotate_half`` pairs column c with column c + 64 inside the tile. (That choice keeps W as the
model holds it: no host-side permutation of its rows, no second layout of the weights to keep
in sync; a 64-wide N tile would need one.) The M tile is 64 rows per consumer warpgroup.

A producer warp streams the X and W tiles of its K range (64 columns of the hidden size per
stage) with TMA into a ``stages``-deep SMEM ring; one or two consumer warpgroups (64 rows each)
accumulate X W^T with WGMMA in fp32 registers.

Split-K (``num_splits`` > 1, a launch argument): at decode the 2 Hkv tiles alone cannot pull
HBM bandwidth, so the K range is split over CTAs. Each writes its fp32 partial to a workspace
and counts itself in on its tile's counter (release/acquire at GPU scope); the CTA that arrives
last sums the partials in split order (deterministic: the same sum whoever comes last), resets
the counter for the next launch and runs the epilogue. Nobody waits for anybody.

Epilogue: the accumulator goes to SMEM as fp32 (aliasing the idle ring), then each consumer
thread takes 8 columns c..c+7 of a row and their partners c+64..c+71 (16-byte pieces), adds the
bias and rounds to the model dtype (what the linear layer returns), applies
``k*cos + rotate_half(k)*sin`` with every product and the sum rounded to the model dtype (fp32
math, as torch computes each bf16/fp16 op), and stores the row pieces with 16-byte stores: a
warp writes whole 128-byte runs of 4 rows. Rows go to ``pool[slot // P, layer, h, K|V,
slot % P, :]``; a slot < 0 or past the pool is skipped. Stores are fire-and-forget; with two
CTAs per SM one CTA's host stores drain over the link while the other runs its main loop.

Legality (the one statement): ``KVProjConfig.problems`` in ``directkv_cute.kv_proj`` (head_dim
128, page size a power of two, hidden a multiple of 64, the ring within SMEM and at least the
fp32 staging tile).
"""

from __future__ import annotations

from enum import IntEnum

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import T

from directkv_cute.kernels.helpers import SmemAllocator, gemm_issue, kv_smem_layout

TILE_K = 64  # hidden columns per ring stage: one 128-byte swizzle row of 16-bit elements
VEC = 8  # elements of one 16-byte access
C_PAD = 8  # fp32 staging rows are tile_n + 8 floats apart: conflict-free accumulator writes

# setmaxnreg budgets (producer warpgroup, each consumer warpgroup) by (consumer warpgroups, CTAs
# per SM), within what the launch gives a CTA (65536 / CTAs per SM, at the register count the
# occupancy leaves each thread).
# Two CTAs of 384 threads would leave 80 registers a thread, too few for a 64 x 128 WGMMA
# accumulator: two CTAs per SM take one consumer warpgroup.
KV_PROJ_REGS = {(1, 1): (40, 232), (2, 1): (40, 232), (1, 2): (40, 216)}


@cute.jit
def rounded_product(a: cute.TensorSSA, b: cute.TensorSSA, dt) -> cute.TensorSSA:
    """round(a * b) to ``dt``, elementwise, back in fp32 (a and b hold ``dt`` values, so the fp32
    product is exact and one rounding gives torch's ``dt`` product).

    The product is an opaque ``mul.rn.f32``: written as a plain multiply, the compiler narrows
    ``round(a * b)`` to a ``dt`` multiply without a rounding modifier, which ptxas may fuse with
    the following add into one FMA (one rounding instead of torch's two: a one-ulp difference in
    about a fifth of the RoPE outputs)."""
    ra = cute.make_rmem_tensor(a.shape, Float32)
    rb = cute.make_rmem_tensor(b.shape, Float32)
    ra.store(a)
    rb.store(b)
    for i in cutlass.range_constexpr(cute.size(ra)):
        ra[i] = Float32(llvm.inline_asm(T.f32(), [ra[i].ir_value(), rb[i].ir_value()], "mul.rn.f32 $0, $1, $2;",
                                        "=f,f,f"))
    return ra.load().to(dt).to(Float32)


class Barrier(IntEnum):
    """Named barrier ids (0 is ``__syncthreads``)."""

    CONSUMERS = 1  # every consumer thread of the CTA


def ring_bytes(tile_m: int, stages: int, elem_bytes: int = 2) -> int:
    """Bytes of the X and W ring: (tile_m + 128) rows of TILE_K elements per stage."""
    return (tile_m + 128) * TILE_K * elem_bytes * stages


def staging_bytes(tile_m: int, tile_n: int = 128) -> int:
    """Bytes of the fp32 accumulator staging tile (it aliases the ring)."""
    return tile_m * (tile_n + C_PAD) * 4


class KVProjection:
    """Static configuration (everything that changes code generation).

    dtype: cutlass.BFloat16 / Float16; hidden: a multiple of 64; kv_heads x head_dim (128) output
    columns per projection; page_size: tokens per cache page (a power of two); bias: b_k and b_v
    are added; to_host / to_hbm / to_out: which destinations the kernel stores to (a disabled
    one's pointers are never read); tile_m: token rows per CTA (64 or 128); consumer_wgs:
    warpgroups sharing them (tile_m / consumer_wgs rows each, a multiple of 64); stages: ring
    depth; ctas_per_sm: the occupancy it is compiled for.
    """

    def __init__(self, dtype, hidden: int, kv_heads: int, head_dim: int, page_size: int, bias: bool,
                 to_host: bool, to_hbm: bool, to_out: bool, tile_m: int, consumer_wgs: int, stages: int,
                 ctas_per_sm: int):
        assert head_dim == 128, "an N tile is one head of 128 columns"
        assert hidden % TILE_K == 0 and page_size & (page_size - 1) == 0
        self.dtype = dtype
        self.hidden = hidden
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.page_size = page_size
        self.bias = bias
        self.to_host = to_host
        self.to_hbm = to_hbm
        self.to_out = to_out
        self.wgs = consumer_wgs
        self.stages = stages
        self.ctas_per_sm = ctas_per_sm
        self.tile_m = tile_m
        self.wg_rows = tile_m // consumer_wgs
        assert self.wg_rows % 64 == 0, "a warpgroup's rows are whole 64-row WGMMA atoms"
        self.tile_n = head_dim
        self.k_blocks = hidden // TILE_K
        self.n_tiles = 2 * kv_heads  # K heads, then V heads
        self.n_cons = 128 * consumer_wgs
        self.num_threads = 128 + self.n_cons
        self.regs = KV_PROJ_REGS[(consumer_wgs, ctas_per_sm)]
        assert ring_bytes(self.tile_m, stages) >= staging_bytes(self.tile_m, self.tile_n)

    # ------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        x_ptr: cute.Pointer,  # (T, hidden) dtype
        wk_ptr: cute.Pointer,  # (Hkv * d, hidden) dtype
        wv_ptr: cute.Pointer,  # (Hkv * d, hidden) dtype
        bk_ptr: cute.Pointer,  # (Hkv * d,) dtype (bias)
        bv_ptr: cute.Pointer,  # (Hkv * d,) dtype (bias)
        cos_ptr: cute.Pointer,  # (T, d) dtype
        sin_ptr: cute.Pointer,  # (T, d) dtype
        host_slot_ptr: cute.Pointer,  # (T,) int64 host slots (page * P + row, < 0: skip)
        hbm_slot_ptr: cute.Pointer,  # (T,) int64 HBM slots
        out_k_ptr: cute.Pointer,  # (T, Hkv, d) dtype (to_out)
        out_v_ptr: cute.Pointer,  # (T, Hkv, d) dtype (to_out)
        ws_ptr: cute.Pointer,  # (tiles * splits, tile_m * d) fp32 split partials
        cnt_ptr: cute.Pointer,  # (tiles,) int32 split arrival counters, zero between launches
        host_addr: Int64,  # UVA address of the host pool (pages, L, Hkv, 2, P, d)
        hbm_addr: Int64,  # address of the HBM pool, same layout
        tokens: Int32,
        num_layers: Int32,
        layer: Int32,
        host_pages: Int32,
        hbm_pages: Int32,
        num_splits: Int32,
        stream: cuda.CUstream,
    ):
        dt, hidden, d = self.dtype, self.hidden, self.head_dim
        rows_w = self.kv_heads * d
        mX = cute.make_tensor(x_ptr, cute.make_layout((tokens, hidden), stride=(hidden, 1)))  # (T, hidden)
        mWk = cute.make_tensor(wk_ptr, cute.make_layout((rows_w, hidden), stride=(hidden, 1)))  # (Hkv d, hidden)
        mWv = cute.make_tensor(wv_ptr, cute.make_layout((rows_w, hidden), stride=(hidden, 1)))  # (Hkv d, hidden)
        mBk = cute.make_tensor(bk_ptr, cute.make_layout(rows_w))  # (Hkv d,)
        mBv = cute.make_tensor(bv_ptr, cute.make_layout(rows_w))  # (Hkv d,)
        mCos = cute.make_tensor(cos_ptr, cute.make_layout((tokens, d), stride=(d, 1)))  # (T, d)
        mSin = cute.make_tensor(sin_ptr, cute.make_layout((tokens, d), stride=(d, 1)))  # (T, d)
        mHostSlot = cute.make_tensor(host_slot_ptr, cute.make_layout(tokens))  # (T,) int64
        mHbmSlot = cute.make_tensor(hbm_slot_ptr, cute.make_layout(tokens))  # (T,) int64
        out_layout = cute.make_layout((tokens, self.kv_heads, d), stride=(self.kv_heads * d, d, 1))
        mOutK = cute.make_tensor(out_k_ptr, out_layout)  # (T, Hkv, d)
        mOutV = cute.make_tensor(out_v_ptr, out_layout)  # (T, Hkv, d)
        m_tiles = (tokens + self.tile_m - 1) // self.tile_m
        tile_elems = self.tile_m * d
        mWs = cute.make_tensor(ws_ptr, cute.make_layout((m_tiles * self.n_tiles * num_splits, tile_elems),
                                                        stride=(tile_elems, 1)))  # (tiles * splits, tile_m d)
        mCnt = cute.make_tensor(cnt_ptr, cute.make_layout(m_tiles * self.n_tiles))  # (tiles,)

        sX_layout = kv_smem_layout(dt, self.tile_m, TILE_K, self.stages)  # (tile_m, 64, stages)
        sW_layout = kv_smem_layout(dt, self.tile_n, TILE_K, self.stages)  # (128, 64, stages)
        op = cpasync.CopyBulkTensorTileG2SOp()
        tma_x, mX_tma = cpasync.make_tiled_tma_atom(op, mX, cute.select(sX_layout, mode=[0, 1]), (self.tile_m, TILE_K))
        tma_wk, mWk_tma = cpasync.make_tiled_tma_atom(op, mWk, cute.select(sW_layout, mode=[0, 1]),
                                                      (self.tile_n, TILE_K))
        tma_wv, mWv_tma = cpasync.make_tiled_tma_atom(op, mWv, cute.select(sW_layout, mode=[0, 1]),
                                                      (self.tile_n, TILE_K))
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            dt, dt, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
            atom_layout_mnk=(1, 1, 1), tiler_mn=(64, self.tile_n), a_source=warpgroup.OperandSource.SMEM,
        )
        self.stage_bytes = cute.size_in_bytes(dt, cute.select(sX_layout, mode=[0, 1])) + cute.size_in_bytes(
            dt, cute.select(sW_layout, mode=[0, 1]))

        # sX then sW, back to back (sX is a whole number of KB): the fp32 staging tile of the
        # epilogue spans both. (Evaluated annotations: this module postpones them.)
        fields = {
            "mbar": cute.struct.MemRange[cutlass.Int64, 2 * self.stages],
            "flag": cute.struct.MemRange[Int32, 4],
            "sX": cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sX_layout)], 1024],
            "sW": cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sW_layout)], 1024],
        }
        SharedStorage = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))  # noqa: N806
        self.shared_storage = SharedStorage

        self.kernel(
            tma_x, mX_tma, tma_wk, mWk_tma, tma_wv, mWv_tma, mBk, mBv, mCos, mSin, mHostSlot, mHbmSlot, mOutK, mOutV,
            mWs, mCnt, host_addr, hbm_addr, tokens, num_layers, layer, host_pages, hbm_pages, num_splits,
            sX_layout, sW_layout, tiled_mma,
        ).launch(
            grid=[self.n_tiles, m_tiles, num_splits],
            block=[self.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=self.ctas_per_sm,
            preferred_smem_carveout=100,
        )

    @cute.kernel
    def kernel(
        self,
        tma_x: cute.CopyAtom,
        mX_tma: cute.Tensor,  # TMA coordinate view of X (T, hidden)
        tma_wk: cute.CopyAtom,
        mWk_tma: cute.Tensor,  # TMA coordinate view of W_k (Hkv d, hidden)
        tma_wv: cute.CopyAtom,
        mWv_tma: cute.Tensor,  # TMA coordinate view of W_v (Hkv d, hidden)
        mBk: cute.Tensor,  # (Hkv d,)
        mBv: cute.Tensor,  # (Hkv d,)
        mCos: cute.Tensor,  # (T, d)
        mSin: cute.Tensor,  # (T, d)
        mHostSlot: cute.Tensor,  # (T,) int64
        mHbmSlot: cute.Tensor,  # (T,) int64
        mOutK: cute.Tensor,  # (T, Hkv, d)
        mOutV: cute.Tensor,  # (T, Hkv, d)
        mWs: cute.Tensor,  # (tiles * splits, tile_m d) fp32
        mCnt: cute.Tensor,  # (tiles,) int32
        host_addr: Int64,
        hbm_addr: Int64,
        tokens: Int32,
        num_layers: Int32,
        layer: Int32,
        host_pages: Int32,
        hbm_pages: Int32,
        num_splits: Int32,
        sX_layout: cute.ComposedLayout,
        sW_layout: cute.ComposedLayout,
        tiled_mma: cute.TiledMma,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        n_blk, m_blk, split = cute.arch.block_idx()
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_x)
            cpasync.prefetch_descriptor(tma_wk)
            cpasync.prefetch_descriptor(tma_wv)

        storage = SmemAllocator().allocate(self.shared_storage)
        sX = storage.sX.get_tensor(sX_layout.outer, swizzle=sX_layout.inner)  # (tile_m, 64, stages)
        sW = storage.sW.get_tensor(sW_layout.outer, swizzle=sW_layout.inner)  # (128, 64, stages)
        # (tile_m, 128) fp32, rows tile_n + C_PAD apart: the epilogue's staging tile over the ring.
        sC = cute.make_tensor(cute.recast_ptr(storage.sX.data_ptr(), dtype=Float32),
                              cute.make_layout((self.tile_m, self.tile_n), stride=(self.tile_n + C_PAD, 1)))
        sFlag = storage.flag.get_tensor(cute.make_layout(4))  # (4,) int32: [0] the split counter's old value
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * self.wgs),
            tx_count=self.stage_bytes,
            defer_sync=True,
        )
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

        # This split's hidden blocks [kb0, kb1): every split gets at least one (num_splits <= blocks).
        kb0 = split * self.k_blocks // num_splits
        kb1 = (split + 1) * self.k_blocks // num_splits

        if warp_idx < 4:
            # ---------------- producer warpgroup: warp 0 streams X and W with TMA --------------
            cute.arch.setmaxregister_decrease(self.regs[0])
            if warp_idx == 0:
                self.load(pipe, tma_x, mX_tma, tma_wk, mWk_tma, tma_wv, mWv_tma, sX, sW, m_blk, n_blk, kb0, kb1)
        else:
            # ---------------- consumer warpgroups: wg_rows rows each -------------------------
            cute.arch.setmaxregister_increase(self.regs[1])
            ctid = tidx - 128
            wg = ctid // 128
            thr = tiled_mma.get_slice(ctid % 128)
            acc = cute.make_rmem_tensor(thr.partition_shape_C((self.wg_rows, self.tile_n)), Float32)  # (wg_rows, 128)
            self.mainloop(pipe, tiled_mma, thr, acc, sX, sW, wg, kb1 - kb0)
            tile = m_blk * self.n_tiles + n_blk
            finish = num_splits == 1
            if num_splits > 1:
                finish = self.reduce_splits(acc, mWs, mCnt, sFlag, ctid, tile, split, num_splits)
            if finish:
                # Every warpgroup is done reading the ring before the staging tile overwrites it.
                cute.arch.barrier(barrier_id=int(Barrier.CONSUMERS), number_of_threads=self.n_cons)
                tCsC = thr.partition_C(cute.local_tile(sC, (self.wg_rows, self.tile_n), (wg, 0)))  # this thread's part
                tCsC.store(acc.load())
                cute.arch.barrier(barrier_id=int(Barrier.CONSUMERS), number_of_threads=self.n_cons)
                head = n_blk % self.kv_heads
                m0 = m_blk * self.tile_m
                if n_blk < self.kv_heads:
                    self.epilogue(sC, mBk, mCos, mSin, mHostSlot, mHbmSlot, mOutK, host_addr, hbm_addr, ctid, m0,
                                  tokens, head, num_layers, layer, host_pages, hbm_pages, 0, True)
                else:
                    self.epilogue(sC, mBv, mCos, mSin, mHostSlot, mHbmSlot, mOutV, host_addr, hbm_addr, ctid, m0,
                                  tokens, head, num_layers, layer, host_pages, hbm_pages, 1, False)

    # ------------------------------------------------------------------------------------
    @cute.jit
    def load(self, pipe, tma_x, mX_tma, tma_wk, mWk_tma, tma_wv, mWv_tma, sX, sW, m_blk, n_blk, kb0, kb1):
        """Producer (the whole warp; each TMA copy and the pipeline's arrive elect one lane): the
        X rows of the M tile and the head's W rows, hidden blocks [kb0, kb1), into the ring."""
        head = n_blk % self.kv_heads
        gX = cute.local_tile(mX_tma, (self.tile_m, TILE_K), (m_blk, None))  # (tile_m, 64, blocks)
        gWk = cute.local_tile(mWk_tma, (self.tile_n, TILE_K), (head, None))  # (128, 64, blocks)
        gWv = cute.local_tile(mWv_tma, (self.tile_n, TILE_K), (head, None))  # (128, 64, blocks)
        one = cute.make_layout(1)
        tXsX, tXgX = cpasync.tma_partition(tma_x, 0, one, cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2))
        tWsW, tWgWk = cpasync.tma_partition(tma_wk, 0, one, cute.group_modes(sW, 0, 2), cute.group_modes(gWk, 0, 2))
        _, tWgWv = cpasync.tma_partition(tma_wv, 0, one, cute.group_modes(sW, 0, 2), cute.group_modes(gWv, 0, 2))
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        for kb in cutlass.range(kb0, kb1, unroll=1):
            pipe.producer_acquire(state)
            bar = pipe.producer_get_barrier(state)
            cute.copy(tma_x, tXgX[None, kb], tXsX[None, state.index], tma_bar_ptr=bar)
            if n_blk < self.kv_heads:
                cute.copy(tma_wk, tWgWk[None, kb], tWsW[None, state.index], tma_bar_ptr=bar)
            else:
                cute.copy(tma_wv, tWgWv[None, kb], tWsW[None, state.index], tma_bar_ptr=bar)
            pipe.producer_commit(state)
            state.advance()
        pipe.producer_tail(state)

    @cute.jit
    def mainloop(self, pipe, tiled_mma, thr, acc, sX, sW, wg, n_blocks):
        """acc = X W^T over the split's ``n_blocks`` ring stages, for this warpgroup's rows:
        one WGMMA group in flight while the next stage is waited for; a stage is released once
        the group that read it is done."""
        sX_wg = cute.local_tile(sX, (self.wg_rows, TILE_K), (wg, 0, None))  # (wg_rows, 64, stages) its rows
        tCrA = thr.make_fragment_A(thr.partition_A(sX_wg))
        tCrB = thr.make_fragment_B(thr.partition_B(sW))
        acc.fill(0.0)
        wait_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        free_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        for i in cutlass.range(n_blocks, unroll=1):
            pipe.consumer_wait(wait_state, pipe.consumer_try_wait(wait_state))
            st = wait_state.index
            warpgroup.fence()
            gemm_issue(tiled_mma, acc, tCrA[None, None, None, st], tCrB[None, None, None, st], False)
            warpgroup.wait_group(1)  # the previous stage's group is done
            if i > 0:
                pipe.consumer_release(free_state)
                free_state.advance()
            wait_state.advance()
        warpgroup.wait_group(0)
        pipe.consumer_release(free_state)

    @cute.jit
    def reduce_splits(self, acc, mWs, mCnt, sFlag, ctid, tile, split, num_splits):
        """Split-K: write this CTA's partial, count in on the tile's counter; the last CTA of the
        tile sums every split's partial in split order into ``acc`` and resets the counter.
        Returns whether this CTA is the last (it runs the epilogue)."""
        n_cons = self.n_cons
        frag = cute.size(acc)
        acc_v = cute.make_tensor(acc.iterator, cute.make_layout((4, frag // 4)))  # (4, frag/4) 16-byte pieces
        # Partials in fragment order: piece v of consumer thread i at (v * n_cons + i) * 4, so a
        # warp's 16-byte accesses are 512 contiguous bytes.
        mine = mWs[tile * num_splits + split, None]  # (tile_m d,) fp32
        for v in cutlass.range_constexpr(frag // 4):
            cute.autovec_copy(acc_v[None, v], cute.local_tile(mine, (4,), (v * n_cons + ctid,)))
        cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier(barrier_id=int(Barrier.CONSUMERS), number_of_threads=n_cons)
        if ctid == 0:
            sFlag[0] = cute.arch.atomic_add(mCnt.iterator + tile, Int32(1), sem="acq_rel", scope="gpu")
        cute.arch.barrier(barrier_id=int(Barrier.CONSUMERS), number_of_threads=n_cons)
        last = sFlag[0] == num_splits - 1
        if last:
            cute.arch.fence_acq_rel_gpu()
            acc.fill(0.0)
            group = 8  # pieces loaded together
            piece = cute.make_rmem_tensor((4, group), Float32)  # (4, group) fp32
            for s in cutlass.range(num_splits, unroll=1):
                part = mWs[tile * num_splits + s, None]  # (tile_m d,) fp32
                for g in cutlass.range_constexpr(frag // 4 // group):
                    for j in cutlass.range_constexpr(group):
                        v = g * group + j
                        cute.autovec_copy(cute.local_tile(part, (4,), (v * n_cons + ctid,)), piece[None, j])
                    acc_g = cute.local_tile(acc_v, (4, group), (0, g))  # (4, group)
                    acc_g.store(acc_g.load() + piece.load())
            if ctid == 0:
                mCnt[tile] = Int32(0)  # every split has counted in: ready for the next launch
        return last

    @cute.jit
    def epilogue(self, sC, mBias, mCos, mSin, mHostSlot, mHbmSlot, mOut, host_addr, hbm_addr, ctid, m0, tokens, head,
                 num_layers, layer, host_pages, hbm_pages, kv: cutlass.Constexpr, rope: cutlass.Constexpr):
        """Bias, rounding, RoPE (K only) and the stores of the tile's valid rows from the fp32
        staging tile ``sC`` (tile_m, 128). Each step takes, per consumer thread, one row's
        columns [8c, 8c + 8) and [8c + 64, 8c + 72): the rotate_half partners."""
        dt, d, P = self.dtype, self.head_dim, self.page_size
        half = d // 2
        chunks = half // VEC  # 16-byte pieces per half row
        for it in cutlass.range_constexpr(self.tile_m * chunks // self.n_cons):
            u = it * self.n_cons + ctid
            r = u // chunks
            c = u % chunks
            t = m0 + r
            if t < tokens:
                lo = cute.local_tile(sC[r, None], (VEC,), (c,)).load()  # (8,) fp32
                hi = cute.local_tile(sC[r, None], (VEC,), (c + chunks,)).load()  # (8,) fp32
                if const_expr(self.bias):
                    lo = lo + cute.local_tile(mBias, (VEC,), (head * (d // VEC) + c,)).load().to(Float32)
                    hi = hi + cute.local_tile(mBias, (VEC,), (head * (d // VEC) + c + chunks,)).load().to(Float32)
                # The linear layer's output, rounded to the model dtype.
                k_lo = lo.to(dt).to(Float32)
                k_hi = hi.to(dt).to(Float32)
                out_lo = cute.make_rmem_tensor((VEC,), dt)  # (8,) columns 8c..
                out_hi = cute.make_rmem_tensor((VEC,), dt)  # (8,) columns 64 + 8c..
                if const_expr(rope):
                    cos_lo = cute.local_tile(mCos[t, None], (VEC,), (c,)).load().to(Float32)
                    cos_hi = cute.local_tile(mCos[t, None], (VEC,), (c + chunks,)).load().to(Float32)
                    sin_lo = cute.local_tile(mSin[t, None], (VEC,), (c,)).load().to(Float32)
                    sin_hi = cute.local_tile(mSin[t, None], (VEC,), (c + chunks,)).load().to(Float32)
                    # k*cos + rotate_half(k)*sin, rotate_half(k) = (-k_hi, k_lo): each product and
                    # the sum rounded to the model dtype (round(-p) = -round(p)).
                    a_lo = rounded_product(k_lo, cos_lo, dt)
                    b_lo = rounded_product(k_hi, sin_lo, dt)
                    a_hi = rounded_product(k_hi, cos_hi, dt)
                    b_hi = rounded_product(k_lo, sin_hi, dt)
                    out_lo.store((a_lo - b_lo).to(dt))
                    out_hi.store((a_hi + b_hi).to(dt))
                else:
                    out_lo.store(lo.to(dt))
                    out_hi.store(hi.to(dt))
                if const_expr(self.to_host):
                    slot = mHostSlot[t]
                    if slot >= 0:
                        if slot < Int64(host_pages) * P:
                            self.put(host_addr, self.pool_row(slot, num_layers, layer, head, kv), c, out_lo, out_hi)
                if const_expr(self.to_hbm):
                    slot = mHbmSlot[t]
                    if slot >= 0:
                        if slot < Int64(hbm_pages) * P:
                            self.put(hbm_addr, self.pool_row(slot, num_layers, layer, head, kv), c, out_lo, out_hi)
                if const_expr(self.to_out):
                    self.put(mOut.iterator.toint(), Int64(t) * self.kv_heads + head, c, out_lo, out_hi)

    @cute.jit
    def pool_row(self, slot, num_layers, layer, head, kv: cutlass.Constexpr):
        """Row (of d elements, Int64) of ``pool[slot // P, layer, head, kv, slot % P]`` in a pool
        (pages, L, Hkv, 2, P, d)."""
        P = self.page_size
        page = slot // P
        off = slot - page * P
        return (((page * num_layers + layer) * self.kv_heads + head) * 2 + kv) * P + off

    @cute.jit
    def put(self, base, row, c, out_lo, out_hi):
        """Store a row's two 16-byte pieces (columns 8c.. and 64 + 8c..) at element row ``row``
        of the d-wide rows starting at address ``base``."""
        esize = self.dtype.width // 8
        at = base + (row * self.head_dim + c * VEC) * esize
        dst_lo = cute.make_tensor(cute.make_ptr(self.dtype, at, cute.AddressSpace.gmem, assumed_align=16),
                                  cute.make_layout(VEC))
        dst_hi = cute.make_tensor(cute.make_ptr(self.dtype, at + self.head_dim // 2 * esize, cute.AddressSpace.gmem,
                                                assumed_align=16), cute.make_layout(VEC))
        cute.autovec_copy(out_lo, dst_lo)
        cute.autovec_copy(out_hi, dst_hi)
