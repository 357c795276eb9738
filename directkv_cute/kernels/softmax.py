"""The online softmax of the attention kernels, on one thread's rows of WGMMA accumulators (a
row is spread over a quad of 4 lanes, as WGMMA lays it out). The state of a block of query rows
is (O, row_max, row_sum): running max and sum per row, O unnormalised until finalize."""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from directkv_cute.kernels.helpers import acc_as_mn

LN_2 = math.log(2.0)


@cute.jit
def softmax_reset(acc_O: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor):
    """An empty state: O = 0, max = -inf, sum = 0."""
    acc_O.fill(0.0)
    row_max.fill(-Float32.inf)
    row_sum.fill(0.0)


@cute.jit
def softmax_update(acc_S: cute.Tensor, acc_O: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor,
                   scale_log2: Float32):
    """Online softmax step on one thread's rows of the S accumulator (a row is spread over a
    quad of 4 lanes, as WGMMA lays it out): exponentiate S in place into the unnormalised P,
    update the running max and sum, and rescale O by exp(m_old - m_new)."""
    row_scale = cute.make_rmem_tensor(cute.size(row_max), Float32)
    softmax_step(acc_S, row_max, row_sum, row_scale, scale_log2)
    rescale_rows(acc_O, row_scale)


@cute.jit
def rescale_rows(acc_O: cute.Tensor, row_scale: cute.Tensor):
    """O[r, :] *= row_scale[r] on one thread's rows of an accumulator."""
    o_mn = acc_as_mn(acc_O)
    for r in cutlass.range_constexpr(cute.size(row_scale)):
        o_mn[r, None].store(o_mn[r, None].load() * row_scale[r])


@cute.jit
def softmax_step(acc_S: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor, row_scale: cute.Tensor,
                 scale_log2: Float32):
    """The part of the online softmax step that leaves O alone (so it can run while a P V WGMMA
    into O is in flight): S -> unnormalised P in place, running max and sum updated, and
    row_scale[r] = exp(m_old - m_new), by which O must be rescaled."""
    s_mn = acc_as_mn(acc_S)
    for r in cutlass.range_constexpr(cute.size(row_max)):
        row = s_mn[r, None].load()
        m_new = row.reduce(cute.ReductionOp.MAX, row_max[r], 0)
        m_new = cute.arch.warp_reduction_max(m_new, threads_in_group=4)
        m_old = row_max[r]
        row_max[r] = m_new
        # A fully masked row keeps m = -inf; use 0 so exp2 gives 0, not NaN.
        m_safe = m_new
        if m_new == -Float32.inf:
            m_safe = Float32(0.0)
        p = cute.math.exp2(row * scale_log2 - m_safe * scale_log2, fastmath=True)
        scale = cute.math.exp2((m_old - m_safe) * scale_log2, fastmath=True)
        row_sum[r] = row_sum[r] * scale + p.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        s_mn[r, None].store(p)
        row_scale[r] = scale


@cute.jit
def softmax_finalize(acc_O: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor, lse: cute.Tensor,
                     scale_log2: Float32):
    """Normalise O by the row sums; lse[r] = natural-log sum-exp of the scaled scores
    (-inf for a row that saw no key, whose O stays 0)."""
    o_mn = acc_as_mn(acc_O)
    for r in cutlass.range_constexpr(cute.size(row_max)):
        total = cute.arch.warp_reduction_sum(row_sum[r], threads_in_group=4)
        inv = Float32(0.0)
        lse_r = -Float32.inf
        if total > Float32(0.0):
            inv = cute.arch.rcp_approx(total)
            lse_r = (row_max[r] * scale_log2 + cute.math.log2(total, fastmath=True)) * LN_2
        lse[r] = lse_r
        o_mn[r, None].store(o_mn[r, None].load() * inv)
