"""Streaming split-KV decode over FP8 KV pages: half the bytes of a bf16 page per tile.

Pages hold ``float8_e4m3fn`` or ``float8_e5m2`` values with one fp32 scale per token, KV head and
K|V beside them (the format: ``directkv_cute.fp8``). The walk is the decode kernel's
(``decode.DecodeAttention``): one CTA per (split, KV head, sequence), every query row of the KV
head in it. The producer brings each tile's FP8 K and V boxes and their rows' scales
(``producer.KVProducer`` with ``scales``) into a ring of FP8 stages, so every tile crosses the link
once, at 0.516x the bytes of bf16 pages (d 128). As a stage lands, the consumer warpgroups
dequantize it into one K and one V operand tile in the q dtype -- ``fp32(q) * scale``, rounded
once, exactly as ``PagedKVCache.read`` and the reference dequantize (e4m3 and e5m2 values are
exact in fp32, so that rounding is the only one) -- release the FP8 stage to the producer, and run
the decode tile step on the operand tiles (Q K^T, mask, online softmax, P V). Outputs and the split
partials are the decode kernel's.

The dequantization is a pass over SMEM (a 16-byte store of 8 elements per thread and step) that a
link-bound decode hides behind the next tile's transfer; the operand tiles are single-buffered,
so each tile costs two consumer barriers (its operands written; every WGMMA done reading them).

Legality (the one statement): ``directkv_cute.fp8.decode_problems`` (the decode config's rules
at FP8 SMEM sizes) and the streaming kernel's shape rules (``kernels.specs``).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync

from directkv_cute.config import DecodeConfig
from directkv_cute.kernels.decode import DecodeAttention
from directkv_cute.kernels.helpers import SmemAllocator, kv_smem_layout
from directkv_cute.kernels.paged import REGS, shared_storage
from directkv_cute.kernels.walk import NamedBarrier

VEC = 8  # elements per dequantization step: 8 FP8 bytes in, one 16-byte store of the q dtype out
SCALE_ALIGN = 128  # bytes: the alignment of a TMA box's SMEM destination


class DecodeFP8Attention(DecodeAttention):
    """The streaming kernel over FP8 pages. ``kv_dtype``: cutlass.Float8E4M3FN / Float8E5M2."""

    def __init__(self, dtype, kv_dtype, head_dim: int, page_size: int, group: int, cfg: DecodeConfig,
                 split_out: bool):
        super().__init__(dtype, head_dim, page_size, group, cfg, split_out)
        self.kv_dtype = kv_dtype
        self.operand_stages = 1  # one K and one V tile in the q dtype; the ring holds FP8 stages
        assert self.tile_n * head_dim // VEC % (128 * self.wgs) == 0

    def storage(self, sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout):
        """The ring's mbarriers, the Q tile, the K and V operand tiles (q dtype), the FP8 K and V
        rings and their fp32 scale rings; a stage receives 2 tile_n d bytes + 2 tile_n scales."""
        dt, kv_dt, d, n, stages = self.dtype, self.kv_dtype, self.head_dim, self.tile_n, self.stages
        self.sKV8_layout = kv_smem_layout(kv_dt, n, d, stages)  # (tile_n, d, stages) FP8
        # Token t = c * rows + r of a stage at c * pad + r: each copy's scale box starts on the
        # 128 bytes a TMA destination needs (a box of 16 rows is 64 bytes).
        rows, copies = self.copy_rows, self.copies
        pad = max(rows, SCALE_ALIGN // 4)
        self.sS_layout = cute.make_layout(((rows, copies), stages), stride=((1, pad), copies * pad))  # (tile_n, stages)
        scale_elems = copies * pad * stages
        align = cute.struct.Align
        extra = {
            "sK8": align[cute.struct.MemRange[kv_dt, cute.cosize(self.sKV8_layout)], 1024],
            "sV8": align[cute.struct.MemRange[kv_dt, cute.cosize(self.sKV8_layout)], 1024],
            "sKs": align[cute.struct.MemRange[Float32, scale_elems], SCALE_ALIGN],
            "sVs": align[cute.struct.MemRange[Float32, scale_elems], SCALE_ALIGN],
        }
        storage = shared_storage(dt, 2 * stages, cute.cosize(sQ_layout), cute.cosize(sKV_layout), extra)
        stage_bytes = 2 * n * d * (kv_dt.width // 8) + 2 * n * 4
        return storage, stage_bytes

    # ------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        q_ptr: cute.Pointer,  # (total_q, Hq, d) q dtype
        o_ptr: cute.Pointer,  # split_out: (splits, total_q, Hq, d) fp32; else (total_q, Hq, d) q dtype
        lse_ptr: cute.Pointer,  # split_out: (splits, total_q, Hq) fp32; else (total_q, Hq) fp32
        host_ptr: cute.Pointer,  # host pool (pages, L, Hkv, 2, P, d) FP8
        hbm_ptr: cute.Pointer,  # HBM pool, same layout (the host pool again when there is none)
        host_scale_ptr: cute.Pointer,  # host scales (pages, L, Hkv, 2, P) fp32
        hbm_scale_ptr: cute.Pointer,  # HBM scales, same layout
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
        h = self.host_setup(q_ptr, o_ptr, lse_ptr, host_ptr, hbm_ptr, page_table_ptr, seq_lens_ptr, cu_q_ptr, batch,
                            total_q, num_kv_heads, num_layers, host_pages, hbm_pages, max_pages, num_splits)
        P, rows = self.page_size, self.copy_rows
        # Scale pools as (P, X), X the pieces of the page pools: a box is one copy's rows of a piece.
        x_host = host_pages * num_layers * num_kv_heads * 2
        x_hbm = hbm_pages * num_layers * num_kv_heads * 2
        mSh = cute.make_tensor(host_scale_ptr, cute.make_layout((P, x_host), stride=(1, P)))  # (P, Xh)
        mSd = cute.make_tensor(hbm_scale_ptr, cute.make_layout((P, x_hbm), stride=(1, P)))  # (P, Xd)
        op = cpasync.CopyBulkTensorTileG2SOp()
        tma_hs, mSh_tma = cpasync.make_tiled_tma_atom(op, mSh, cute.make_layout(rows), (rows,))
        tma_ds, mSd_tma = cpasync.make_tiled_tma_atom(op, mSd, cute.make_layout(rows), (rows,))
        mLink = cute.make_tensor(link_ptr, cute.make_layout(2))
        self.kernel(
            h.mQ, h.mO, h.mLSE, h.tma_h, h.mKVh, h.tma_d, h.mKVd, tma_hs, mSh_tma, tma_ds, mSd_tma, h.mPT, h.mSeqLen,
            h.mCuQ, mLink, num_kv_heads, num_layers, layer, num_splits, scale_log2,
            h.sQ_layout, h.sKV_layout, self.sKV8_layout, self.sS_layout, h.tiled_mma_qk, h.tiled_mma_pv,
        ).launch(
            grid=[num_splits, num_kv_heads, batch],
            block=[self.num_threads, 1, 1],
            smem=self.shared_storage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=self.occupancy,
            preferred_smem_carveout=self.carveout,
        )

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,  # (total_q, Hq, d)
        mO: cute.Tensor,  # (splits | 1, total_q, Hq, d)
        mLSE: cute.Tensor,  # (splits | 1, total_q, Hq)
        tma_h: cute.CopyAtom,
        mKVh: cute.Tensor,  # TMA coordinate view of the host pool (P, d, Xh) FP8
        tma_d: cute.CopyAtom,
        mKVd: cute.Tensor,  # TMA coordinate view of the HBM pool (P, d, Xd) FP8
        tma_hs: cute.CopyAtom,
        mSh: cute.Tensor,  # TMA coordinate view of the host scales (P, Xh) fp32
        tma_ds: cute.CopyAtom,
        mSd: cute.Tensor,  # TMA coordinate view of the HBM scales (P, Xd) fp32
        mPT: cute.Tensor,  # (B, max_pages) int32
        mSeqLen: cute.Tensor,  # (B,)
        mCuQ: cute.Tensor,  # (B + 1,)
        mLink: cute.Tensor,  # (2,) int32: link tickets issued, landed
        num_kv_heads: Int32,
        num_layers: Int32,
        layer: Int32,
        num_splits: Int32,
        scale_log2: Float32,
        sQ_layout: cute.ComposedLayout,  # (rows, d)
        sKV_layout: cute.ComposedLayout,  # (tile_n, d, 1) q dtype operand tiles
        sKV8_layout: cute.ComposedLayout,  # (tile_n, d, stages) FP8 ring
        sS_layout: cute.Layout,  # ((rows, copies), stages) fp32 scale ring, boxes 128-byte aligned
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        cta = self.cta_work(mSeqLen, mCuQ, num_splits)
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_hs)
            cpasync.prefetch_descriptor(tma_ds)
        storage = SmemAllocator().allocate(self.shared_storage)
        sK8 = storage.sK8.get_tensor(sKV8_layout.outer, swizzle=sKV8_layout.inner)  # (tile_n, d, stages) FP8
        sV8 = storage.sV8.get_tensor(sKV8_layout.outer, swizzle=sKV8_layout.inner)  # (tile_n, d, stages) FP8
        sKs = storage.sKs.get_tensor(sS_layout)  # (tile_n, stages) fp32
        sVs = storage.sVs.get_tensor(sS_layout)  # (tile_n, stages) fp32
        sQ, sK, sV, kv_pipe, admit = self.ring(warp_idx, tidx, tma_h, tma_d, sQ_layout, sKV_layout, storage)

        if warp_idx < 4:
            # ---------------- producer warpgroup: warp 0 streams FP8 K/V boxes and scales -------
            cute.arch.setmaxregister_decrease(REGS[self.wgs, self.occupancy][0])
            if warp_idx == 0:
                self.producer.load(
                    kv_pipe, tma_h, mKVh, tma_d, mKVd, sK8, sV8, mPT, mLink, cta, num_kv_heads, num_layers, layer,
                    admit, scales=(tma_hs, mSh, tma_ds, mSd, sKs, sVs),
                )
        else:
            # ---------------- consumer warpgroups -------------------------------------------
            cute.arch.setmaxregister_increase(REGS[self.wgs, self.occupancy][1])
            self.consume(tidx, mQ, mO, mLSE, sQ, sK, sV, kv_pipe, cta, tiled_mma_qk, tiled_mma_pv, scale_log2,
                         ring=(sK8, sV8, sKs, sVs, sK, sV))

    @cute.jit
    def step(self, w, cta, t, kv_pipe, state, scale_log2, ring):
        """Tile t, landed in FP8 stage ``state``: dequantize it into the operand tiles, free the
        stage, attend to the operands; every warpgroup is done with them before the next tile's."""
        sK8, sV8, sKs, sVs, sK, sV = ring
        self.dequantize(sK8, sKs, sK, state.index, w.ctidx)
        self.dequantize(sV8, sVs, sV, state.index, w.ctidx)
        # The operand tiles are written (generic proxy) before any WGMMA reads them (async).
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=int(NamedBarrier.Q_STORED), number_of_threads=128 * self.wgs)
        kv_pipe.consumer_release(state)
        self.attend_tile(w, cta, t, 0, scale_log2)
        cute.arch.barrier(barrier_id=int(NamedBarrier.Q_STORED), number_of_threads=128 * self.wgs)

    @cute.jit
    def dequantize(self, s8: cute.Tensor, sScale: cute.Tensor, s16: cute.Tensor, stage, ctidx):
        """Operand tile ``s16`` (tile_n, d, 1) = FP8 stage ``stage`` of ``s8`` (tile_n, d, stages)
        times each row's scale in ``sScale`` (tile_n, stages), rounded to the q dtype; the
        consumer threads share the tile's 8-element pieces, a row's pieces to neighbouring threads."""
        n_cons = 128 * self.wgs
        chunks = self.head_dim // VEC
        for i in cutlass.range_constexpr(self.tile_n * chunks // n_cons):
            u = i * n_cons + ctidx
            r = u // chunks
            c = u % chunks
            raw = cute.local_tile(s8[r, None, stage], (VEC,), (c,)).load()  # (8,) FP8
            val = raw.to(Float32) * sScale[r, stage]
            cute.local_tile(s16[r, None, 0], (VEC,), (c,)).store(val.to(self.dtype))
