"""Reading a sequence's K/V out of a ``PagedKVCache`` the way the kernels do (the cache tests'
independent check of where a write landed)."""

from __future__ import annotations

import torch


def read_through_tables(cache, sid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V (n, L, H, D) of a sequence gathered the way the kernels read: from its kernel table
    (host pages by entry e >= 0, HBM pages by -e - 1)."""
    t = cache.kernel_tables([sid])
    row, n, P = t.host_table[0], t.host_seq_lens[0], cache.page_size
    ks, vs = [], []
    for pos in range(n):
        e = int(row[pos // P])
        pool, idx = (cache.host_pool, e) if e >= 0 else (cache.hbm_pool, -e - 1)
        ks.append(pool[idx, :, :, 0, pos % P])
        vs.append(pool[idx, :, :, 1, pos % P])
    return torch.stack(ks), torch.stack(vs)
