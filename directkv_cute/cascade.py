"""Shared prefixes read once per batch: cascade attention over the cache's page tables.

Sequences forked from one prompt (``PagedKVCache.fork``: full pages shared by reference) hold
the same page entries at the same logical positions. The per-sequence kernels read such a page
once per sequence; this module reads it once per batch:

* **Planning** (``plan_cascade``, plain Python over the host page table): the sharing tree. Rows
  that hold the same entry at logical page 0 form a group; the group's *span* runs while every
  row of it holds the same entries; at the span's end the group splits by the next entry, and so
  on (nested forks give nested spans). Only full pages wholly before a row's first query token
  are shared, so every query of a span's sharers sees the whole span (no causal mask inside it).
  Each row's *own* pass covers its pages after its deepest span.
* **Execution** (the ``cascade`` route, ``directkv_cute.routes.Cascade``): one pass per
  span, in which the query rows of all its sharers become the query heads of a single token
  (``q_len`` 1, GQA group = sharers x q_len x group, up to 128 rows per pseudo-sequence), so the
  span's pages are read once for all of them; one pass over every row's own pages; the partial
  results merged by their LSE. A span whose rows need more than one pseudo-sequence (over 128
  rows per KV head) is staged into HBM once (``stage_plan.plan_staging`` copies each unique page
  once) and read there by the Q-tiled kernel, so it still crosses the link once.

Host bytes per step = the unique pages of the batch (``CascadePlan.host_pages_read``).
``ops.cascade_attention`` plans and runs it in one call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MAX_PSEUDO_ROWS = 128  # query rows per KV head one pseudo-sequence of a span pass holds
MIN_SHARED_TOKENS = 256  # shorter spans are read per sequence (a pass costs a launch and a merge)


@dataclass(frozen=True)
class Span:
    """Logical pages [page_lo, page_hi) that every row of ``rows`` (batch rows, >= 2) holds with
    the same entries."""

    rows: tuple[int, ...]
    page_lo: int
    page_hi: int


@dataclass(frozen=True)
class CascadePlan:
    """The spans of a batch and each row's own pages (from ``own_lo[row]`` to its end)."""

    spans: tuple[Span, ...]
    own_lo: tuple[int, ...]
    seq_lens: tuple[int, ...]
    q_lens: tuple[int, ...]
    page_size: int
    host_pages_naive: int  # host pages the per-sequence kernels read
    host_pages_read: int  # host pages the cascade reads (each span once, plus the own pages)

    @property
    def shared(self) -> bool:
        return bool(self.spans)


def find_spans(table: np.ndarray, seq_lens: Sequence[int], q_lens: Sequence[int], page_size: int,
               min_pages: int = 1, groups: Sequence[Sequence[int]] | None = None):
    """(spans, own_lo) of a batch from its encoded page table (B, max_pages).

    ``groups`` (optional): the rows that may share, as disjoint lists (an explicit prefix
    grouping); by default every row may share with every other. A span shorter than
    ``min_pages`` is not used, and neither are the spans nested under it."""
    table = np.asarray(table)
    batch = len(seq_lens)
    if table.ndim != 2 or table.shape[0] != batch:
        raise ValueError(f"page table {table.shape} does not match {batch} sequences")
    if len(q_lens) != batch:
        raise ValueError(f"{len(q_lens)} q_lens for {batch} sequences")
    # Full pages wholly before the row's first query token: the only pages a span may hold.
    shareable = [max(0, (int(n) - int(q)) // page_size) for n, q in zip(seq_lens, q_lens)]
    if max(shareable, default=0) > table.shape[1]:
        raise ValueError(f"sequence lengths {list(seq_lens)[:8]} do not fit the table's {table.shape[1]} pages")
    if groups is None:
        roots = [list(range(batch))]
    else:
        roots = [sorted(int(r) for r in g) for g in groups]
        flat = [r for g in roots for r in g]
        if len(set(flat)) != len(flat) or any(not 0 <= r < batch for r in flat):
            raise ValueError(f"groups must be disjoint lists of rows in [0, {batch}), got {groups!r}")
    own_lo = [0] * batch
    spans: list[Span] = []
    stack = [(g, 0) for g in roots]
    while stack:
        rows, lo = stack.pop()
        by_entry: dict[int, list[int]] = {}
        for r in rows:
            if shareable[r] > lo:
                by_entry.setdefault(int(table[r, lo]), []).append(r)
        for grp in by_entry.values():
            if len(grp) < 2:
                continue
            lim = min(shareable[r] for r in grp)
            sub = table[grp, lo:lim]  # (rows, lim - lo)
            same = (sub == sub[0]).all(axis=0)
            hi = lim if same.all() else lo + int(np.argmin(same))
            if hi - lo < min_pages:
                continue
            spans.append(Span(tuple(grp), lo, hi))
            for r in grp:
                own_lo[r] = max(own_lo[r], hi)
            stack.append((grp, hi))
    spans.sort(key=lambda s: (s.page_lo, s.rows))
    return tuple(spans), tuple(own_lo)


def plan_cascade(table: np.ndarray, seq_lens: Sequence[int], q_lens: Sequence[int], page_size: int, *,
                 groups=None, min_shared_tokens: int = MIN_SHARED_TOKENS) -> CascadePlan:
    """The cascade plan of a batch (see the module docstring): its spans, own pages and the host
    pages read with and without it."""
    seq_lens = tuple(int(n) for n in seq_lens)
    q_lens = tuple(int(q) for q in q_lens)
    min_pages = max(1, math.ceil(min_shared_tokens / page_size))
    spans, own_lo = find_spans(table, seq_lens, q_lens, page_size, min_pages, groups)
    table = np.asarray(table)
    n_pages = [math.ceil(n / page_size) for n in seq_lens]
    naive = sum(int((table[b, :n] >= 0).sum()) for b, n in enumerate(n_pages))
    read = sum(int((table[b, own_lo[b]:n] >= 0).sum()) for b, n in enumerate(n_pages))
    read += sum(int((table[s.rows[0], s.page_lo:s.page_hi] >= 0).sum()) for s in spans)
    return CascadePlan(spans, own_lo, seq_lens, q_lens, page_size, naive, read)


# ---- the passes' host tables and query packing ------------------------------------------------
def sub_table(host_table, rows, page_lo, page_hi) -> np.ndarray:
    """The host page table over pages [page_lo[i], page_hi[i]) of ``host_table``'s row
    ``rows[i]``, each row padded with its last page."""
    host = np.asarray(host_table)
    width = max(hi - lo for lo, hi in zip(page_lo, page_hi))
    table = np.empty((len(rows), width), dtype=np.int32)
    for i, (r, lo, hi) in enumerate(zip(rows, page_lo, page_hi)):
        ent = host[r, lo:hi]
        table[i, : len(ent)] = ent
        table[i, len(ent):] = ent[-1]
    return table


def pack_shape(rows: int) -> tuple[int, int]:
    """(pseudo-sequences, rows G' of each) for a span pass of ``rows`` query rows per KV head; G'
    a power of two (few compiled variants), at most ``MAX_PSEUDO_ROWS``."""
    n_pseudo = math.ceil(rows / MAX_PSEUDO_ROWS)
    return n_pseudo, min(MAX_PSEUDO_ROWS, 1 << (math.ceil(rows / n_pseudo) - 1).bit_length())


def pack_rows(qs, num_kv_heads: int):
    """(n_tok, Hq, d) query rows of a span's sharers -> (n_pseudo, Hkv * G', d): per KV head its
    n_tok x group rows, as the heads of n_pseudo one-token pseudo-sequences of G' rows each."""
    n_tok, hq, d = qs.shape
    group = hq // num_kv_heads
    rows = n_tok * group
    n_pseudo, g2 = pack_shape(rows)
    x = qs.view(n_tok, num_kv_heads, group, d).permute(1, 0, 2, 3).reshape(num_kv_heads, rows, d)
    if n_pseudo * g2 > rows:
        import torch

        x = torch.cat([x, x.new_zeros(num_kv_heads, n_pseudo * g2 - rows, d)], dim=1)
    x = x.view(num_kv_heads, n_pseudo, g2, d).permute(1, 0, 2, 3).reshape(n_pseudo, num_kv_heads * g2, d)
    return x.contiguous(), n_pseudo, g2


def unpack_rows(o, lse, n_tok: int, hq: int, num_kv_heads: int, g2: int):
    """Inverse of ``pack_rows`` for the pass's output (n_pseudo, Hkv * G', d) and LSE."""
    n_pseudo, _, d = o.shape
    group = hq // num_kv_heads
    rows = n_tok * group
    o = o.view(n_pseudo, num_kv_heads, g2, d).permute(1, 0, 2, 3).reshape(num_kv_heads, n_pseudo * g2, d)
    o = o[:, :rows].reshape(num_kv_heads, n_tok, group, d).permute(1, 0, 2, 3).reshape(n_tok, hq, d)
    lse = lse.view(n_pseudo, num_kv_heads, g2).permute(1, 0, 2).reshape(num_kv_heads, n_pseudo * g2)
    lse = lse[:, :rows].reshape(num_kv_heads, n_tok, group).permute(1, 0, 2).reshape(n_tok, hq)
    return o, lse


def merge_partials(o1, lse1, o2, lse2):
    """Attention over the union of two disjoint key sets from each one's (O, LSE): float32
    (rows, H, d) and (rows, H); a side that saw no key has LSE -inf and weight 0."""
    import torch

    m = torch.maximum(lse1, lse2)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w1 = torch.exp(lse1 - m)
    w2 = torch.exp(lse2 - m)
    s = w1 + w2
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    o = (o1 * (w1 * inv).unsqueeze(-1)) + (o2 * (w2 * inv).unsqueeze(-1))
    lse = torch.where(s > 0, m + torch.log(s), torch.full_like(s, -math.inf))
    return o, lse
