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
* **Execution** (``cascade_attention``): one pass per span, in which the query rows of all its
  sharers become the query heads of a single token (``q_len`` 1, GQA group = sharers x q_len x
  group, up to 128 rows per pseudo-sequence), so the span's pages are read once for all of them;
  one pass over every row's own pages as today; the partial results merged by their LSE. A span
  whose rows need more than one pseudo-sequence (over 128 rows per KV head) is staged into HBM
  once (``staging.plan_staging`` copies each unique page once) and read there by the Q-tiled
  kernel, so it still crosses the link once.

Host bytes per step = the unique pages of the batch (``CascadePlan.host_pages_read``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

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


# ---- execution -------------------------------------------------------------------------------
def _tables(src, rows, page_lo, page_hi, lengths, device):
    """KernelTables over pages [page_lo[i], page_hi[i]) of ``src``'s row ``rows[i]``, of
    ``lengths[i]`` tokens. They name the same pages as ``src``, so they are valid exactly as long
    as it is (same cache id and generation)."""
    from directkv_cute.cache import KernelTables

    host = np.asarray(src.host_table)
    width = max(hi - lo for lo, hi in zip(page_lo, page_hi))
    packed = np.empty(len(rows) * width + len(rows), dtype=np.int32)
    table = packed[: len(rows) * width].reshape(len(rows), width)
    for i, (r, lo, hi) in enumerate(zip(rows, page_lo, page_hi)):
        ent = host[r, lo:hi]
        table[i, : len(ent)] = ent
        table[i, len(ent):] = ent[-1]
    packed[len(rows) * width:] = lengths
    dev = torch.from_numpy(packed).to(device, non_blocking=True)
    return KernelTables(dev[: len(rows) * width].view(len(rows), width), dev[len(rows) * width:], src.cache_id,
                        src.generation, tuple(int(n) for n in lengths), table.copy())


def _packing(rows: int) -> tuple[int, int]:
    """(pseudo-sequences, rows G' of each) for a span pass of ``rows`` query rows per KV head; G'
    a power of two (few compiled variants), at most ``MAX_PSEUDO_ROWS``."""
    n_pseudo = math.ceil(rows / MAX_PSEUDO_ROWS)
    return n_pseudo, min(MAX_PSEUDO_ROWS, 1 << (math.ceil(rows / n_pseudo) - 1).bit_length())


def _pack_rows(qs: torch.Tensor, num_kv_heads: int):
    """(n_tok, Hq, d) query rows of a span's sharers -> (n_pseudo, Hkv * G', d): per KV head its
    n_tok x group rows, as the heads of n_pseudo one-token pseudo-sequences of G' rows each."""
    n_tok, hq, d = qs.shape
    group = hq // num_kv_heads
    rows = n_tok * group
    n_pseudo, g2 = _packing(rows)
    x = qs.view(n_tok, num_kv_heads, group, d).permute(1, 0, 2, 3).reshape(num_kv_heads, rows, d)
    if n_pseudo * g2 > rows:
        x = torch.cat([x, x.new_zeros(num_kv_heads, n_pseudo * g2 - rows, d)], dim=1)
    x = x.view(num_kv_heads, n_pseudo, g2, d).permute(1, 0, 2, 3).reshape(n_pseudo, num_kv_heads * g2, d)
    return x.contiguous(), n_pseudo, g2


def _unpack_rows(o: torch.Tensor, lse: torch.Tensor, n_tok: int, hq: int, num_kv_heads: int, g2: int):
    """Inverse of ``_pack_rows`` for the pass's output (n_pseudo, Hkv * G', d) and LSE."""
    n_pseudo, _, d = o.shape
    group = hq // num_kv_heads
    rows = n_tok * group
    o = o.view(n_pseudo, num_kv_heads, g2, d).permute(1, 0, 2, 3).reshape(num_kv_heads, n_pseudo * g2, d)
    o = o[:, :rows].reshape(num_kv_heads, n_tok, group, d).permute(1, 0, 2, 3).reshape(n_tok, hq, d)
    lse = lse.view(n_pseudo, num_kv_heads, g2).permute(1, 0, 2).reshape(num_kv_heads, n_pseudo * g2)
    lse = lse[:, :rows].reshape(num_kv_heads, n_tok, group).permute(1, 0, 2).reshape(n_tok, hq)
    return o, lse


def merge_partials(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor):
    """Attention over the union of two disjoint key sets from each one's (O, LSE): float32
    (rows, H, d) and (rows, H); a side that saw no key has LSE -inf and weight 0."""
    m = torch.maximum(lse1, lse2)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w1 = torch.exp(lse1 - m)
    w2 = torch.exp(lse2 - m)
    s = w1 + w2
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    o = (o1 * (w1 * inv).unsqueeze(-1)) + (o2 * (w2 * inv).unsqueeze(-1))
    lse = torch.where(s > 0, m + torch.log(s), torch.full_like(s, -math.inf))
    return o, lse


def _attend(q, cache, layer, tables, q_lens, scale, staged: bool):
    """One pass: the kernels on a GPU (``staged``: the Q-tiled kernel over this pass's pages
    copied once into HBM, falling back to reading in place where it cannot), else the reference."""
    if q.is_cuda:
        from directkv_cute.config import QTiledConfig
        from directkv_cute.ops import paged_attention_tables

        if staged:
            try:
                return paged_attention_tables(q, cache, layer, tables, q_lens, scale, config=QTiledConfig(),
                                              return_lse=True)
            except ValueError:
                pass  # over the staging cap, or inside a CUDA graph capture: read in place
        return paged_attention_tables(q, cache, layer, tables, q_lens, scale, return_lse=True)
    from directkv_cute.reference import cache_scales, tables_attention_ref

    return tables_attention_ref(q, cache.device_pool("host"), cache.device_pool("hbm"), tables.page_table,
                                tables.seq_lens, layer, q_lens, scale, **cache_scales(cache))


@dataclass
class PreparedCascade:
    """A plan's device side, built once per step and reused by every layer: the own pass's
    tables, and per span the rows of q it gathers, its tables and its packing."""

    plan: CascadePlan
    own: object  # KernelTables of every row's own pages
    spans: list  # (idx (n_tok,) int64 on the device, KernelTables, n_pseudo, G', staged)
    q_lens: tuple[int, ...]
    staged: bool = False  # one staged call of the whole batch instead (plan.stage_instead_of_cascade)


def prepare_cascade(cache, tables, plan: CascadePlan, num_q_heads: int, device) -> PreparedCascade:
    """The device tables and indices of ``plan`` over ``tables`` (see ``PreparedCascade``)."""
    P, hkv = cache.page_size, cache.num_kv_heads
    group = num_q_heads // hkv
    lens = plan.seq_lens
    n_pages = [math.ceil(n / P) for n in lens]
    own_lens = [n - lo * P for n, lo in zip(lens, plan.own_lo)]
    own = _tables(tables, range(len(lens)), plan.own_lo, n_pages, own_lens, device)
    cu = np.concatenate(([0], np.cumsum(plan.q_lens)))
    host = np.asarray(tables.host_table)
    spans = []
    for span in plan.spans:
        idx = np.concatenate([np.arange(cu[r], cu[r + 1]) for r in span.rows])
        n_pseudo, g2 = _packing(len(idx) * group)
        span_tables = _tables(tables, [span.rows[0]] * n_pseudo, [span.page_lo] * n_pseudo,
                              [span.page_hi] * n_pseudo, [(span.page_hi - span.page_lo) * P] * n_pseudo, device)
        host_pages = int((host[span.rows[0], span.page_lo:span.page_hi] >= 0).sum())
        spans.append((torch.from_numpy(idx).to(device, non_blocking=True), span_tables, n_pseudo, g2,
                      n_pseudo > 1 and host_pages > 0))
    return PreparedCascade(plan, own, spans, plan.q_lens, _stage_whole_batch(cache, tables, plan, num_q_heads,
                                                                             device))


def _stage_whole_batch(cache, tables, plan: CascadePlan, num_q_heads: int, device) -> bool:
    """Whether the batch runs as one staged call rather than as the cascade: on CUDA, when the
    staging (each distinct page copied once) is estimated faster (``plan.stage_instead_of_cascade``)."""
    if torch.device(device).type != "cuda" or not plan.host_pages_read:
        return False
    from directkv_cute.ops import staging_choice
    from directkv_cute.plan import stage_instead_of_cascade

    got = staging_choice(cache, tables, plan.q_lens, num_q_heads, cache.head_dim, cache.dtype.itemsize,
                         torch.device(device).index or 0)
    choice = got[0] if isinstance(got, tuple) else None
    layer_page_bytes = cache.page_bytes // cache.num_layers
    return stage_instead_of_cascade(plan.host_pages_read * layer_page_bytes, 1 + len(plan.spans), choice)


def cascade_attention(q: torch.Tensor, cache, layer: int, seq_ids: Sequence[int], q_lens=None,
                      softmax_scale: float | None = None, *, tables=None, plan: CascadePlan | None = None,
                      groups=None, prepared: PreparedCascade | None = None, out: torch.Tensor | None = None,
                      return_lse: bool = False):
    """``paged_attention`` that reads the pages a batch's sequences share once per batch.

    q: (total_q, Hq, d) packed by sequence (``q_lens[i]`` rows each, default 1). ``tables``: the
    batch's ``cache.kernel_tables(seq_ids)`` if already built; ``plan``: a ``plan_cascade`` of
    them (built here otherwise); ``prepared``: its ``prepare_cascade`` (reuse tables, plan and
    prepared across the layers of a step); ``groups``: an explicit prefix grouping (rows that may
    share). Without shared pages this is ``paged_attention``.
    Returns out (total_q, Hq, d) in q's dtype, and with ``return_lse`` the float32 LSE."""
    from directkv_cute.validate import check_attention, check_seq_ids

    seq_ids = check_seq_ids(seq_ids)
    if tables is None:
        tables = cache.kernel_tables(seq_ids)
    elif hasattr(cache, "check_tables"):
        cache.check_tables(tables)
    if len(tables.host_seq_lens) != len(seq_ids):
        raise ValueError(f"tables hold {len(tables.host_seq_lens)} sequences, seq_ids {len(seq_ids)}")
    layer, q_lens = check_attention(q, cache, layer, batch=len(seq_ids), q_lens=q_lens, out=out,
                                    softmax_scale=softmax_scale, seq_lens=tables.host_seq_lens, cuda=q.is_cuda)
    if prepared is not None:
        plan = prepared.plan
    if plan is None:
        plan = plan_cascade(tables.host_table, tables.host_seq_lens, q_lens, cache.page_size, groups=groups)
    elif plan.q_lens != tuple(q_lens) or plan.seq_lens != tuple(tables.host_seq_lens) \
            or plan.page_size != cache.page_size:
        raise ValueError("the cascade plan was made for other sequence lengths, q_lens or page size")
    total_q, hq, d = q.shape
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    if not plan.shared:
        if q.is_cuda:
            from directkv_cute.ops import paged_attention_tables

            return paged_attention_tables(q, cache, layer, tables, q_lens, scale, out=out, return_lse=return_lse)
        o, lse = _attend(q, cache, layer, tables, q_lens, scale, False)
        if out is not None:
            out.copy_(o)
            o = out
        return (o, lse) if return_lse else o

    prep = prepared if prepared is not None else prepare_cascade(cache, tables, plan, hq, q.device)
    if prep.staged:
        from directkv_cute.ops import paged_attention_tables

        return paged_attention_tables(q, cache, layer, tables, q_lens, scale, out=out, return_lse=return_lse)
    hkv = cache.num_kv_heads
    o_own, lse_own = _attend(q, cache, layer, prep.own, q_lens, scale, False)
    o_acc, lse_acc = o_own.float(), lse_own.float()
    for idx, span_tables, n_pseudo, g2, staged in prep.spans:
        qs = q.index_select(0, idx)  # (n_tok, Hq, d)
        qp, _, _ = _pack_rows(qs, hkv)  # (n_pseudo, Hkv * G', d)
        o_s, lse_s = _attend(qp, cache, layer, span_tables, [1] * n_pseudo, scale, staged)
        o_s, lse_s = _unpack_rows(o_s, lse_s, len(idx), hq, hkv, g2)
        o_m, lse_m = merge_partials(o_acc.index_select(0, idx), lse_acc.index_select(0, idx), o_s.float(),
                                    lse_s.float())
        o_acc.index_copy_(0, idx, o_m)
        lse_acc.index_copy_(0, idx, lse_m)
    if out is None:
        out = torch.empty_like(q)
    out.copy_(o_acc)
    return (out, lse_acc) if return_lse else out
