"""Decode sweep: one new token per sequence over host-resident KV (and hybrid placements).

Shapes: batch 1/4/16/64 x context 4k..128k x (Hq, Hkv) 32/8 and 64/8, head_dim 128, bf16,
one layer. Methods per shape: the ceilings (host_read, hbm_read, floor), the baselines (hbm,
zero_copy, swap) and ours at 0/25/50/75% of the pages in HBM (the hybrid runs; their ideal
time is max(host bytes / host ceiling, HBM bytes / HBM ceiling)).
"""

from __future__ import annotations

import itertools

from bench.common import Shape

BENCH = "decode"
HEAD_DIM = 128
HBM_FRACTIONS = (0.0, 0.25, 0.5, 0.75)

FULL_GRID = {
    "batches": (1, 4, 16, 64),
    "contexts": (4096, 8192, 16384, 32768, 65536, 131072),
    "heads": ((32, 8), (64, 8)),
}
# (batch, context, hq, hkv): small, long, wide and GQA-64 corners of the full grid.
QUICK_SHAPES = (
    (1, 4096, 32, 8), (1, 32768, 32, 8), (1, 131072, 32, 8), (16, 32768, 32, 8),
    (64, 8192, 32, 8), (64, 32768, 32, 8), (1, 32768, 64, 8), (16, 32768, 64, 8),
)


def shapes(preset: str = "quick", *, batches=None, contexts=None, heads=None, head_dim: int = HEAD_DIM,
           dtype: str = "bfloat16") -> list[Shape]:
    """The sweep's shapes, smallest KV first. Any of batches / contexts / heads given replaces
    that axis of the full grid (and turns the quick list into a grid)."""
    if preset == "quick" and batches is None and contexts is None and heads is None:
        combos = QUICK_SHAPES
    else:
        combos = [(b, c, hq, hkv) for b, c, (hq, hkv) in itertools.product(
            batches or FULL_GRID["batches"], contexts or FULL_GRID["contexts"], heads or FULL_GRID["heads"])]
    out = [Shape(BENCH, b, c, 1, hq, hkv, head_dim, dtype) for b, c, hq, hkv in combos]
    return sorted(out, key=lambda s: (s.kv_bytes, s.hq, s.batch))
