"""Shared device-side helpers for the attention kernels: SMEM layouts, accumulator views and
the online softmax. Written for CuTe DSL 4.8.1 (sm_90a)."""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


def kv_smem_layout(dtype, rows: int, head_dim: int, stages: int | None = None):
    """Swizzled K-major SMEM layout of a (rows, head_dim[, stages]) tile, row-group major.

    The 8-row swizzle atoms are tiled along head_dim first and then along rows, so any
    block of rows (a multiple of 8) is one contiguous piece with the same layout as a
    standalone tile of that many rows: a TMA copy of one page lands in a sub-tile of the
    stage while WGMMA reads the whole stage.
    """
    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, head_dim), dtype
    )
    if stages is None:
        return cute.tile_to_shape(atom, (rows, head_dim), order=(1, 0))
    return cute.tile_to_shape(atom, (rows, head_dim, stages), order=(1, 0, 2))


def transpose_view(t: cute.Tensor) -> cute.Tensor:
    """Swap the first two modes of an SMEM tensor (used for V as the MN-major B operand)."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


def acc_mn_layout(acc_layout: cute.Layout) -> cute.Layout:
    """View a WGMMA accumulator ((2, 2, V), MMA_M, MMA_N) as (rows, cols) = ((2, MMA_M), (2, V, MMA_N))."""
    cm = cute.make_layout(acc_layout.shape)
    shape = ((cm.shape[0][1], cm.shape[1]), (cm.shape[0][0], *cm.shape[0][2:], cm.shape[2]))
    stride = ((cm.stride[0][1], cm.stride[1]), (cm.stride[0][0], *cm.stride[0][2:], cm.stride[2]))
    return cute.composition(acc_layout, cute.make_layout(shape, stride=stride))


def acc_as_mn(acc: cute.Tensor) -> cute.Tensor:
    return cute.make_tensor(acc.iterator, acc_mn_layout(acc.layout))


@cute.jit
def acc_as_operand_a(acc: cute.Tensor) -> cute.Tensor:
    """Re-view the fp32 S accumulator ((2, 2, N/8), MMA_M, MMA_N) as the A-operand fragment
    ((2, 2, 2), MMA_M, (N/16, MMA_N)) of the next (register-sourced) WGMMA."""
    layout = acc.layout
    l = cute.logical_divide(layout, ((None, None, 2), None, None))
    frg = cute.make_layout(
        ((l.shape[0][0], l.shape[0][1], l.shape[0][2][0]), l.shape[1], (l.shape[0][2][1], l.shape[2])),
        stride=(
            (l.stride[0][0], l.stride[0][1], l.stride[0][2][0]),
            l.stride[1],
            (l.stride[0][2][1], l.stride[2]),
        ),
    )
    return cute.make_tensor(acc.iterator, frg)


@cute.jit
def gemm_issue(tiled_mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor, zero_init: bool):
    """Issue acc (+)= A @ B on one warpgroup and commit it as one group; no fence, no wait (the
    caller fences before the first issue and waits with ``warpgroup.wait_group``)."""
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(tA, mode=[2])):
        cute.gemm(atom, acc, tA[None, None, k], tB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()


@cute.jit
def gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor, zero_init: bool):
    """acc (+)= A @ B on one warpgroup; waits for completion."""
    warpgroup.fence()
    gemm_issue(tiled_mma, acc, tA, tB, zero_init)
    warpgroup.wait_group(0)


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
