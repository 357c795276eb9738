"""Split-KV combine: merge the per-split partial outputs of the decode kernel.

O = sum_s w_s O_s and LSE = log(sum_s exp(lse_s)) with w_s = exp(lse_s - LSE). A split that saw
no key has lse_s = -inf and weight 0. A CTA of 128 threads merges 4 rows (query token, head): a
warp per row, each lane owning d/32 adjacent columns (one vector load per split), and the split
loop unrolled so several loads are in flight. These partials live in HBM, so this pass costs HBM
bandwidth only, never link bandwidth.
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

LOG2_E = math.log2(math.e)
ROWS_PER_CTA = 4  # one warp per row


class SplitCombine:
    def __init__(self, dtype, head_dim: int):
        self.dtype = dtype
        self.head_dim = head_dim

    @cute.jit
    def __call__(
        self,
        o_part_ptr: cute.Pointer,  # (splits, total_q, Hq, d) fp32
        lse_part_ptr: cute.Pointer,  # (splits, total_q, Hq) fp32
        o_ptr: cute.Pointer,  # (total_q, Hq, d) out dtype
        lse_ptr: cute.Pointer,  # (total_q, Hq) fp32
        rows: Int32,  # total_q * Hq
        num_splits: Int32,
        stream: cuda.CUstream,
    ):
        d = self.head_dim
        # (splits x rows x d) partials can exceed 2^31 elements: 64-bit split stride.
        mOp = cute.make_tensor(o_part_ptr, cute.make_layout((num_splits, rows, d), stride=(cute.assume(cutlass.Int64(rows) * d, divby=d), d, 1)))
        mLp = cute.make_tensor(lse_part_ptr, cute.make_layout((num_splits, rows), stride=(cutlass.Int64(rows), 1)))
        mO = cute.make_tensor(o_ptr, cute.make_layout((rows, d), stride=(d, 1)))
        mL = cute.make_tensor(lse_ptr, cute.make_layout(rows))
        self.kernel(mOp, mLp, mO, mL, rows, num_splits).launch(
            grid=[(rows + ROWS_PER_CTA - 1) // ROWS_PER_CTA, 1, 1], block=[32 * ROWS_PER_CTA, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, mOp: cute.Tensor, mLp: cute.Tensor, mO: cute.Tensor, mL: cute.Tensor, rows: Int32,
               num_splits: Int32):
        vec = self.head_dim // 32
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        row = bidx * ROWS_PER_CTA + tidx // 32
        if row < rows:
            lse_max = -Float32.inf
            for s in cutlass.range(num_splits, unroll=4):
                lse_max = cutlass.max(lse_max, mLp[s, row])
            lse_ref = lse_max
            if lse_max == -Float32.inf:
                lse_ref = Float32(0.0)
            total = Float32(0.0)
            acc = cute.make_rmem_tensor((vec,), Float32)  # (d/32,) this lane's columns
            acc.fill(0.0)
            part = cute.make_rmem_tensor((vec,), Float32)
            for s in cutlass.range(num_splits, unroll=4):
                w = cute.math.exp2((mLp[s, row] - lse_ref) * LOG2_E, fastmath=True)
                total = total + w
                cute.autovec_copy(cute.local_tile(mOp[s, row, None], (vec,), (lane,)), part)
                acc.store(acc.load() + part.load() * w)
            lse = -Float32.inf
            inv = Float32(0.0)
            if total > Float32(0.0):
                inv = Float32(1.0) / total
                lse = lse_ref + cute.math.log(total, fastmath=True)
            out = cute.make_rmem_tensor((vec,), self.dtype)
            out.store((acc.load() * inv).to(self.dtype))
            cute.autovec_copy(out, cute.local_tile(mO[row, None], (vec,), (lane,)))
            if lane == 0:
                mL[row] = lse
