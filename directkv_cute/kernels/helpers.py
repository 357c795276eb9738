"""Shared device-side helpers for the attention kernels: SMEM layouts, accumulator views and
WGMMA issue (the online softmax is in ``softmax.py``). Written for CuTe DSL 4.8.1 (sm_90a); the
kernels also compile on 4.6.0, the version vLLM 0.26 pins."""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import warpgroup
from cutlass.cutlass_dsl import T

# SmemAllocator is the kernels' (imported from here, one place for both homes).
try:
    from cutlass.memory import SmemAllocator  # noqa: F401
    from cutlass.tensor_utils import LayoutEnum
except ImportError:  # CuTe DSL 4.6.0 (vLLM 0.26's pin): their older homes
    from cutlass.utils import SmemAllocator  # noqa: F401
    from cutlass.utils.layout import LayoutEnum

LOG2_E = math.log2(math.e)


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
def pack_operand(src: cute.Tensor, dst: cute.Tensor):
    """dst (bf16/fp16, compact) = src (fp32, the same shape) rounded to nearest even, two
    elements per cvt. The cvts are inline asm with side effects, so the compiler keeps them where
    they are written: LLVM otherwise sinks a plain conversion of P down to the next P V issue,
    which keeps the fp32 P alive across the next S WGMMA (64 more registers per thread)."""
    dst32 = cute.recast_tensor(dst, Int32)
    op = "cvt.rn.bf16x2.f32" if dst.element_type is cutlass.BFloat16 else "cvt.rn.f16x2.f32"
    for i in cutlass.range_constexpr(cute.size(dst32)):
        dst32[i] = Int32(llvm.inline_asm(T.i32(), [Float32(src[2 * i]).ir_value(), Float32(src[2 * i + 1]).ir_value()],
                                         f"{op} $0, $2, $1;", "=r,f,f", has_side_effects=True))


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
