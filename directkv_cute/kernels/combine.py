"""Split-KV combine: merge the per-split partial outputs of the attention kernels.

O = sum_s w_s O_s and LSE = log(sum_s exp(lse_s)) with w_s = exp(lse_s - LSE). A split that saw
no key has lse_s = -inf and weight 0. A CTA of 128 threads merges 4 rows (query token, head): a
warp per row, each lane owning d/32 adjacent columns (one 16-byte load per split). The splits
are taken in groups of ``SPLIT_GROUP``: a group's LSEs and partial rows are all loaded before any
is used (one memory round trip per group, not one per split), then folded into a running
(max, sum, O) as in the online softmax. These partials live in HBM, so this pass costs HBM
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
SPLIT_GROUP = 8  # splits whose loads are in flight together (8 x d/32 fp32 registers of partials)


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
            run_max = -Float32.inf  # the largest LSE so far (natural log)
            ref = Float32(0.0)  # run_max, or 0 while every split so far is empty
            total = Float32(0.0)  # sum of exp(lse_s - ref)
            acc = cute.make_rmem_tensor((vec,), Float32)  # (d/32,) this lane's columns, sum of w_s O_s
            acc.fill(0.0)
            lse_g = cute.make_rmem_tensor((SPLIT_GROUP,), Float32)  # (G,) the group's LSEs
            part_g = cute.make_rmem_tensor((vec, SPLIT_GROUP), Float32)  # (d/32, G) the group's partial columns
            for s0 in cutlass.range(0, num_splits, SPLIT_GROUP, unroll=1):
                for g in cutlass.range_constexpr(SPLIT_GROUP):
                    if s0 + g < num_splits:
                        lse_g[g] = mLp[s0 + g, row]
                        cute.autovec_copy(cute.local_tile(mOp[s0 + g, row, None], (vec,), (lane,)), part_g[None, g])
                    else:
                        lse_g[g] = -Float32.inf
                        part_g[None, g].fill(0.0)
                new_max = run_max
                for g in cutlass.range_constexpr(SPLIT_GROUP):
                    new_max = cutlass.max(new_max, lse_g[g])
                new_ref = Float32(0.0)
                if new_max != -Float32.inf:
                    new_ref = new_max
                # exp(-inf) = 0: a running sum of empty splits only (0) or a still empty group
                # rescales to 0 / by 1, never to NaN (ref is finite).
                carry = cute.math.exp2((run_max - new_ref) * LOG2_E, fastmath=True)
                total = total * carry
                acc.store(acc.load() * carry)
                for g in cutlass.range_constexpr(SPLIT_GROUP):
                    w = cute.math.exp2((lse_g[g] - new_ref) * LOG2_E, fastmath=True)
                    total = total + w
                    acc.store(acc.load() + part_g[None, g].load() * w)
                run_max = new_max
                ref = new_ref
            lse = -Float32.inf
            inv = Float32(0.0)
            if total > Float32(0.0):
                inv = Float32(1.0) / total
                lse = ref + cute.math.log(total, fastmath=True)
            out = cute.make_rmem_tensor((vec,), self.dtype)
            out.store((acc.load() * inv).to(self.dtype))
            cute.autovec_copy(out, cute.local_tile(mO[row, None], (vec,), (lane,)))
            if lane == 0:
                mL[row] = lse
