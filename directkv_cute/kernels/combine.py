"""Split-KV combine: merge the per-split partial outputs of the decode kernel.

O = sum_s w_s O_s and LSE = log(sum_s exp(lse_s)) with w_s = exp(lse_s - LSE). A split that saw
no key has lse_s = -inf and weight 0. One CTA per (query token, head); thread j owns column j.
These partials live in HBM, so this pass costs HBM bandwidth only, never link bandwidth.
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

LOG2_E = math.log2(math.e)


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
        mOp = cute.make_tensor(o_part_ptr, cute.make_layout((num_splits, rows, d), stride=(cutlass.Int64(rows) * d, d, 1)))
        mLp = cute.make_tensor(lse_part_ptr, cute.make_layout((num_splits, rows), stride=(cutlass.Int64(rows), 1)))
        mO = cute.make_tensor(o_ptr, cute.make_layout((rows, d), stride=(d, 1)))
        mL = cute.make_tensor(lse_ptr, cute.make_layout(rows))
        self.kernel(mOp, mLp, mO, mL, num_splits).launch(grid=[rows, 1, 1], block=[d, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mOp: cute.Tensor, mLp: cute.Tensor, mO: cute.Tensor, mL: cute.Tensor, num_splits: Int32):
        col, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        lse_max = -Float32.inf
        for s in cutlass.range(num_splits, unroll=1):
            lse_max = cutlass.max(lse_max, mLp[s, row])
        lse_ref = lse_max
        if lse_max == -Float32.inf:
            lse_ref = Float32(0.0)
        total = Float32(0.0)
        acc = Float32(0.0)
        for s in cutlass.range(num_splits, unroll=1):
            w = cute.math.exp2((mLp[s, row] - lse_ref) * LOG2_E, fastmath=True)
            total = total + w
            acc = acc + w * mOp[s, row, col]
        out = Float32(0.0)
        lse = -Float32.inf
        if total > Float32(0.0):
            out = acc / total
            lse = lse_ref + cute.math.log(total, fastmath=True)
        mO[row, col] = out.to(self.dtype)
        if col == 0:
            mL[row] = lse
