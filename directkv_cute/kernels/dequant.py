"""Dequantize staged FP8 pages into 16-bit pages of the same layout, for a range of KV heads.

A staging buffer of FP8 pages (pages, 1, Hkv, 2, P, d) with per-token fp32 scales (pages, 1, Hkv,
2, P) becomes (pages, 1, Hkv, 2, P, d) in bf16/fp16: ``float32(x) * scale`` rounded once, as
``fp8.dequantize`` defines it. One pass over HBM: every thread loads 16 FP8 values of one row (a
16-byte load) and that row's scale, and stores 16 values of the row (two 16-byte stores); the
d / 16 threads of a row are neighbours, so a warp covers consecutive rows. Addresses are 64-bit
(a buffer may hold more than 2^31 elements). Grid y runs over the KV heads [``head0``, ``head0``
+ grid y): multi-token calls over FP8 pages dequantize each group of heads as soon as its copy
has landed, while earlier groups' attention runs.

Legality: ``head_dim`` a multiple of 16; the buffers 16-byte aligned.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

VEC = 16  # FP8 values per thread: one 16-byte load
THREADS = 256


class DequantizePages:
    """FP8 pages -> 16-bit pages, ``kv_dtype`` / ``dtype`` cutlass types; static head_dim and page size."""

    def __init__(self, kv_dtype, dtype, head_dim: int, page_size: int):
        if head_dim % VEC:
            raise ValueError(f"head_dim {head_dim} is not a multiple of {VEC}")
        self.kv_dtype = kv_dtype
        self.dtype = dtype
        self.head_dim = head_dim
        self.page_size = page_size

    @cute.jit
    def __call__(
        self,
        src_addr: Int64,  # (pages, 1, Hkv, 2, P, d) FP8
        scale_addr: Int64,  # (pages, 1, Hkv, 2, P) fp32
        dst_addr: Int64,  # (pages, 1, Hkv, 2, P, d) q dtype
        pages: Int32,
        num_kv_heads: Int32,
        head0: Int32,
        heads: Int32,
        stream: cuda.CUstream,
    ):
        per_head = pages * (2 * self.page_size) * (self.head_dim // VEC)  # threads of one head
        self.kernel(src_addr, scale_addr, dst_addr, num_kv_heads, head0, per_head).launch(
            grid=[(per_head + THREADS - 1) // THREADS, heads, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, src_addr: Int64, scale_addr: Int64, dst_addr: Int64, num_kv_heads: Int32, head0: Int32,
               per_head: Int32):
        d = self.head_dim
        chunks = d // VEC
        rows = 2 * self.page_size  # K and V rows of one head of one page
        tidx, _, _ = cute.arch.thread_idx()
        bidx, hy, _ = cute.arch.block_idx()
        u = bidx * THREADS + tidx  # (page, row, chunk) of this head, chunk fastest
        if u < per_head:
            c = u % chunks
            r = (u // chunks) % rows
            page = u // (chunks * rows)
            row = (Int64(page) * num_kv_heads + head0 + hy) * rows + r  # the row's index in the buffer
            at = row * d + c * VEC  # its chunk's first element
            src = cute.make_tensor(cute.make_ptr(self.kv_dtype, src_addr + at, cute.AddressSpace.gmem,
                                                 assumed_align=16), cute.make_layout(VEC))  # (16,) FP8
            scale = cute.make_tensor(cute.make_ptr(Float32, scale_addr + row * 4, cute.AddressSpace.gmem,
                                                   assumed_align=4), cute.make_layout(1))  # (1,) fp32
            dst = cute.make_tensor(cute.make_ptr(self.dtype, dst_addr + at * (self.dtype.width // 8),
                                                 cute.AddressSpace.gmem, assumed_align=16),
                                   cute.make_layout(VEC))  # (16,) q dtype
            out = cute.make_rmem_tensor((VEC,), self.dtype)
            out.store((src.load().to(Float32) * scale[0]).to(self.dtype))
            cute.autovec_copy(out, dst)
