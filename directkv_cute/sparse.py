"""Reading only the pages a decode query needs (opt-in): the budget and the page selection.

A ``SparseBudget`` turns exact decode into reading a fixed number of each sequence's pages per
layer: the first ``sink_pages`` and the last ``recent_pages`` always, and the rest by score, the
highest first. A page's score bounds what its keys can contribute to a query row (Quest): with the
elementwise min and max of the page's K rows per KV head (``cache.summaries``: kept next to the
GPU, 1/page_size of the KV's bytes), ``q . k <= sum_d max(q_d * kmin_d, q_d * kmax_d)`` for every
key k of the page. The pages of a sequence are shared by all its KV heads and query heads (one
page table per sequence, which the decode kernels walk): a page's score is
``log sum_h exp(scale * (bound_h - best_h))`` over the query heads h, ``best_h`` that head's
largest bound over the sequence's pages: a bound on the page's share of each head's softmax
mass relative to that head's best page, summed over the heads, so a head whose queries are large
does not crowd out the others, and a page several heads need ranks above one that one head needs.

``select_pages`` runs on the device, with static shapes (a CUDA graph can hold it): the selected
pages, in their order in the sequence, become a compact page table of ``budget`` pages per
sequence and lengths ``(k - 1) * page_size + tail`` (the newest page, partial, stays last), which
the existing decode kernels read as they read any table. Positions are in the keys already
(RoPE is applied before the store), so reading fewer pages changes which keys are attended, not
where they sit. A sequence with no more pages than the budget reads all of them: exact.

Prefill and multi-token rows stay exact (the planner routes only decode-sized calls here).
"""

from __future__ import annotations

import math

import torch

from directkv_cute.sparse_budget import SparseBudget, parse_budget


def page_scores(q: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor, summaries, layer: int,
                page_size: int, sink_pages: int, recent_pages: int, scale: float | None = None) -> torch.Tensor:
    """float32 (B, W): each page's score for the decode rows ``q`` (B, Hq, d): +inf for the
    pages always read, -inf past a sequence's pages, else ``log sum_h exp(scale * (bound_h -
    best_h))`` (the module docstring; ``scale``: the softmax scale, default 1 / sqrt(d)).
    ``page_table`` int32 (B, W) (encoded: >= 0 host page, < 0 HBM page -e - 1), ``seq_lens``
    int32 (B,), ``summaries``: ``PageSummaries`` (``host`` and ``hbm``: (pages, layers, Hkv, 2, d),
    min then max of each page's K rows)."""
    B, Hq, d = q.shape
    W = page_table.shape[1]
    e = page_table.long()
    host = summaries.host[:, layer]  # (host pages, Hkv, 2, d)
    hbm = summaries.hbm[:, layer] if summaries.hbm is not None and summaries.hbm.shape[0] else None
    s = host.index_select(0, e.clamp(min=0).view(-1)).view(B, W, *host.shape[1:])  # (B, W, Hkv, 2, d)
    if hbm is not None:
        in_hbm = (e < 0).view(B, W, 1, 1, 1)
        s = torch.where(in_hbm, hbm.index_select(0, (-e - 1).clamp(min=0).view(-1)).view(B, W, *hbm.shape[1:]), s)
    hkv = s.shape[2]
    qf = q.float().view(B, hkv, Hq // hkv, d)  # (B, Hkv, g, d)
    kmin, kmax = s[..., 0, :].float(), s[..., 1, :].float()  # (B, W, Hkv, d)
    # max(q * kmin, q * kmax) summed over d = q+ . kmax + q- . kmin
    bound = torch.einsum("bhgd,bwhd->bwhg", qf.clamp(min=0), kmax) + \
        torch.einsum("bhgd,bwhd->bwhg", qf.clamp(max=0), kmin)
    bound = torch.nan_to_num(bound, nan=-math.inf)  # a page never written: -inf (0 x inf is nan)
    n_pages = (seq_lens.long() + page_size - 1) // page_size  # (B,)
    j = torch.arange(W, device=q.device)
    valid = j[None, :] < n_pages[:, None]  # (B, W)
    bound = bound.masked_fill(~valid[:, :, None, None], -math.inf)
    best = bound.amax(dim=1, keepdim=True)  # (B, 1, Hkv, g): each head's best page
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    rel = ((bound - best) * scale).nan_to_num(nan=-math.inf).flatten(2)  # (B, W, Hq)
    score = torch.logsumexp(rel, dim=2)  # (B, W)
    keep = (j[None, :] < sink_pages) | (j[None, :] >= n_pages[:, None] - recent_pages)
    score = torch.where(keep & valid, torch.full_like(score, math.inf), score)
    return score.masked_fill(~valid, -math.inf)


def select_pages(q: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor, summaries, layer: int,
                 page_size: int, budget: int, sink_pages: int, recent_pages: int, scale: float | None = None,
                 out_table: torch.Tensor | None = None, out_lens: torch.Tensor | None = None):
    """(table int32 (B, budget), lens int32 (B,)): each sequence's ``budget`` best pages
    (``page_scores``) in sequence order, the rest of its row repeating its last selected page,
    and the length the decode kernels read over them: ``(k - 1) * page_size + tail``, k =
    min(budget, its pages), tail = its newest page's rows. Written into ``out_table`` /
    ``out_lens`` where given (persistent buffers a plan binds once)."""
    B, W = page_table.shape
    score = page_scores(q, page_table, seq_lens, summaries, layer, page_size, sink_pages, recent_pages, scale)
    idx = score.topk(budget, dim=1).indices.sort(dim=1).values  # chosen pages, in sequence order
    lens = seq_lens.long()
    n_pages = (lens + page_size - 1) // page_size
    k = n_pages.clamp(max=budget).clamp(min=1)  # (B,)
    pos = torch.arange(budget, device=q.device)[None, :]
    idx = torch.where(pos < k[:, None], idx, idx.gather(1, (k - 1)[:, None]))  # past k: the last chosen page
    table = page_table.gather(1, idx)
    tail = lens - (n_pages - 1).clamp(min=0) * page_size
    sel_lens = ((k - 1) * page_size + tail).to(torch.int32)
    if out_table is None:
        return table, sel_lens
    out_table.copy_(table)
    out_lens.copy_(sel_lens)
    return out_table, out_lens


__all__ = ["SparseBudget", "page_scores", "parse_budget", "select_pages"]
