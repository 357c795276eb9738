"""Multi-token queries (chunked prefill, speculative verify) over host-resident KV.

Shapes: q_len 16/64/512/2048/8192 new tokens at the end of 8k..128k host tokens (the context
includes them), batch 1, Hq/Hkv 32/8, head_dim 128, bf16, one layer. The new tokens are causal
among themselves and see the whole prefix. Methods: the read-once floor (host bytes once at
the host ceiling), host_read and hbm_read of the same bytes, hbm, naive zero-copy (SDPA over
the host KV), swap, and ours (missing where the op refuses the shape).
"""

from __future__ import annotations

import itertools

from bench.common import Shape

BENCH = "prefill"
HEAD_DIM = 128
HBM_FRACTIONS = (0.0,)

FULL_GRID = {
    "q_lens": (16, 64, 512, 2048, 8192),
    "contexts": (8192, 16384, 32768, 65536, 131072),
    "heads": ((32, 8),),
    "batches": (1,),
}
# (q_len, context): every q_len over 32k host tokens, and a short and a long context.
QUICK_SHAPES = ((16, 8192), (512, 8192), (16, 32768), (64, 32768), (512, 32768), (2048, 32768),
                (8192, 32768), (512, 131072))


def shapes(preset: str = "quick", *, q_lens=None, contexts=None, heads=None, batches=None,
           head_dim: int = HEAD_DIM, dtype: str = "bfloat16") -> list[Shape]:
    """The sweep's shapes, cheapest first (by KV bytes x q_len). Any axis given replaces that
    axis of the full grid (and turns the quick list into a grid)."""
    custom = any(x is not None for x in (q_lens, contexts, heads, batches))
    if preset == "quick" and not custom:
        combos = [(1, c, q, 32, 8) for q, c in QUICK_SHAPES]
    else:
        combos = [(b, c, q, hq, hkv) for b, c, q, (hq, hkv) in itertools.product(
            batches or FULL_GRID["batches"], contexts or FULL_GRID["contexts"], q_lens or FULL_GRID["q_lens"],
            heads or FULL_GRID["heads"]) if q <= c]
    out = [Shape(BENCH, b, c, q, hq, hkv, head_dim, dtype) for b, c, q, hq, hkv in combos]
    return sorted(out, key=lambda s: (s.kv_bytes * s.q_len, s.q_len))
