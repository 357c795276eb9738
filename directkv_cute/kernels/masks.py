"""Score masks of the attention kernels."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from directkv_cute.kernels.helpers import acc_as_mn


@cute.jit
def mask_tile(acc_S, t, tok0, row0, tScS, seq_len, q_len, tile_n: cutlass.Constexpr, group: cutlass.Constexpr):
    """Mask keys past the sequence and the causal future of each query token in the S accumulator
    of KV tile ``t`` (``tile_n`` keys; row r of the block is token tok0 + (row0 + r) // group); only
    tiles that reach past the first token's position need it."""
    if (t + 1) * tile_n > seq_len - q_len + tok0 + 1:
        s_mn = acc_as_mn(acc_S)  # (rows, tile_n) of this thread
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            qi = tok0 + (row0 + tScS[r, 0][0]) // group
            limit = seq_len - q_len + qi + 1 - t * tile_n  # keys [0, limit) of this tile
            for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                if tScS[r, c][1] >= limit:
                    s_mn[r, c] = -Float32.inf
