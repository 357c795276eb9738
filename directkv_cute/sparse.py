"""Reading only the pages a decode query needs (opt-in): the budget and the page selection.

A ``SparseBudget`` turns exact decode into reading a fixed number of each sequence's pages per
layer: the first ``sink_pages`` and the last ``recent_pages`` always, and the rest by score, the
highest first. A page's score estimates the share of each query head's attention its keys hold:
with the mean ``mu`` and variance ``var`` of the page's K rows per KV head and channel
(``cache.summaries``: kept next to the GPU, from their sum and sum of squares), a key drawn from
a normal distribution of that mean and variance has ``log E[exp(s * q . k)] = s * (q . mu + s / 2
* sum_d q_d**2 var_d)`` (``s`` the softmax scale): the page's estimated logit. Per query head a
softmax over the sequence's pages turns the estimates into shares of that head's attention; a
page's score is its shares summed over the query heads (every KV head's group). The pages of a
sequence are shared by all its KV heads and query heads (one page table per sequence, which the
decode kernels walk), so a page that several heads need ranks above one that one head needs, and
a head whose attention falls on one page (a retrieval head) gives that page nearly a whole share.

``select_pages`` runs on the device, with static shapes (a CUDA graph can hold it): the selected
pages, in their order in the sequence, become a compact page table of ``budget`` pages per
sequence and lengths ``(k - 1) * page_size + tail`` (the newest page, partial, stays last), which
the existing decode kernels read as they read any table. Positions are in the keys already
(RoPE is applied before the store), so reading fewer pages changes which keys are attended, not
where they sit. A sequence with no more pages than the budget reads all of them: exact.

Prefill and multi-token rows stay exact (the planner routes only decode-sized calls here).

``RecallCounts`` counts, on the device, how often each page is selected (per layer and row); a
cache with an HBM tier reads them once per step and keeps the pages its queries keep choosing in
HBM (``hf.step_plan.hbm_targets``: the tier as a recall cache).

``SparseStats`` (opt-in, for measurements) records the attention mass the selected pages hold:
per decode row and layer, the share of each query head's exact softmax (over every key of the
sequence, read from the pools) that falls on the selected pages, averaged over the heads. It
reads all of a row's keys, so it costs an exact step's reads and more: a measurement, not a mode
to serve with.
"""

from __future__ import annotations

import math

import torch

from directkv_cute.cache.pages import kernel_host_pool, kernel_host_scales
from directkv_cute.cache.summaries import page_moments
from directkv_cute.fp8 import dequantize
from directkv_cute.sparse_budget import SparseBudget, parse_budget


def _row_bounds(seq_lens: torch.Tensor, page_size: int, width: int, sink_pages: int, recent_pages: int):
    """What a row's selection needs of its length alone: (last page index (B, 1) int32, pages
    past the sequence (B, W) bool, pages always read (B, W) bool, rows of each page (B * W, 1, 1, 1)
    float32: the page size but for the newest page's tail, at least 1)."""
    last = torch.div(seq_lens - 1, page_size, rounding_mode="floor").view(-1, 1)  # (B, 1): the newest page
    j = torch.arange(width, device=seq_lens.device)  # (W,)
    past = j > last
    keep = (j < sink_pages) | (j > last - recent_pages)
    rows = (seq_lens.view(-1, 1) - j * page_size).clamp_(1, page_size).to(torch.float32).view(-1, 1, 1, 1)
    return last, past, keep, rows


def _logits(q: torch.Tensor, page_table: torch.Tensor, summaries, layer: int, rows: torch.Tensor,
            scale: float) -> torch.Tensor:
    """float32 (B, Hkv, g, W): each page's estimated logit per query head (the module docstring),
    ``q`` (B, Hq, d), from the summaries of pages of ``rows`` rows ((B * W, 1, 1, 1), ``_row_bounds``:
    the newest page's estimate enters every head's softmax, so its own rows count)."""
    B, Hq, d = q.shape
    W = page_table.shape[1]
    host = summaries.host[:, layer]  # (host pages, Hkv, 2, d)
    hkv = host.shape[1]
    s = host.index_select(0, page_table.clamp(min=0).view(-1))  # (B * W, Hkv, 2, d)
    hbm = summaries.hbm[:, layer] if summaries.hbm is not None and summaries.hbm.shape[0] else None
    if hbm is not None:
        in_hbm = (page_table < 0).view(-1, 1, 1, 1)
        s = torch.where(in_hbm, hbm.index_select(0, (-1 - page_table).clamp(min=0).view(-1)), s)
    # (B, Hkv, W, 2d): mean then variance of each page's K rows, per KV head
    m = page_moments(s, rows).view(B, W, hkv, 2 * d).transpose(1, 2)
    qf = q.float().mul(scale)
    # s * (q . mu) + s^2 / 2 * (q^2 . var): one product with [s q, s^2 q^2 / 2]
    q2 = torch.cat((qf, qf * qf * 0.5), dim=2).view(B, hkv, Hq // hkv, 2 * d)
    return torch.matmul(q2, m.transpose(2, 3))


def _scores(logit: torch.Tensor, past: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """float32 (B, W) from ``logit`` (B, Hkv, g, W): per query head a softmax over the row's
    pages, summed over the heads (the module docstring's score), +inf where ``keep``, -inf where
    ``past``."""
    logit = logit.masked_fill_(past[:, None, None, :], -math.inf)
    score = torch.softmax(logit, dim=3).sum(dim=(1, 2))  # (B, W), >= 0
    return score.masked_fill_(keep, math.inf).masked_fill_(past, -math.inf)


def page_scores(q: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor, summaries, layer: int,
                page_size: int, sink_pages: int, recent_pages: int, scale: float | None = None) -> torch.Tensor:
    """float32 (B, W): each page's score for the decode rows ``q`` (B, Hq, d): +inf for the
    pages always read, -inf past a sequence's pages, else the sum over the query heads of the
    page's share of each head's softmax over the row's pages of estimated logits (the module
    docstring; ``scale``: the softmax scale, default 1 / sqrt(d)). ``page_table`` int32 (B, W)
    (encoded: >= 0 host page, < 0 HBM page -e - 1), ``seq_lens`` int32 (B,), ``summaries``:
    ``PageSummaries`` (``host`` and ``hbm``: (pages, layers, Hkv, 2, d) float32, the sum then the
    sum of squares of each page's K rows)."""
    _, past, keep, rows = _row_bounds(seq_lens, page_size, page_table.shape[1], sink_pages, recent_pages)
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    return _scores(_logits(q, page_table, summaries, layer, rows, scale), past, keep)


def _chosen(q: torch.Tensor, page_table: torch.Tensor, summaries, layer: int, bounds, scale: float,
            budget: int) -> torch.Tensor:
    """int64 (B, budget): the ``budget`` best pages (``page_scores``) of each row in sequence
    order; past a row's own pages (a row with fewer), its newest page again. ``bounds``: the rows'
    ``_row_bounds``."""
    last, past, keep, rows = bounds
    score = _scores(_logits(q, page_table, summaries, layer, rows, scale), past, keep)
    idx = score.topk(budget, dim=1).indices.sort(dim=1).values
    return torch.minimum(idx, last)  # pages past the sequence score -inf: they sort last


def _selected_lens(seq_lens: torch.Tensor, last: torch.Tensor, page_size: int, budget: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """int32 (B,): the keys a row reads over its chosen pages: its length less the full pages it
    skips, ``(k - 1) * page_size + tail`` (k = min(budget, its pages), tail = its newest page's rows)."""
    skipped = (last.view(-1) - (budget - 1)).clamp_(min=0).mul_(page_size)
    return torch.sub(seq_lens, skipped, out=out)


def select_pages(q: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor, summaries, layer: int,
                 page_size: int, budget: int, sink_pages: int, recent_pages: int, scale: float | None = None,
                 out_table: torch.Tensor | None = None, out_lens: torch.Tensor | None = None):
    """(table int32 (B, budget), lens int32 (B,)): each sequence's ``budget`` best pages
    (``page_scores``) in sequence order, the rest of its row repeating its last selected page,
    and the length the decode kernels read over them: ``(k - 1) * page_size + tail``, k =
    min(budget, its pages), tail = its newest page's rows. Written into ``out_table`` /
    ``out_lens`` where given (persistent buffers a plan binds once)."""
    bounds = _row_bounds(seq_lens, page_size, page_table.shape[1], sink_pages, recent_pages)
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    idx = _chosen(q, page_table, summaries, layer, bounds, scale, budget)
    table = torch.gather(page_table, 1, idx, out=out_table)
    return table, _selected_lens(seq_lens, bounds[0], page_size, budget, out_lens)


class PageSelector:
    """A plan's selection (``routes.SparseDecode``): the buffers its inner decode plan reads,
    ``table`` (B, budget) int32 and ``lens`` (B,) int32, bound once, and per layer
    ``select`` into them. What depends on the rows' lengths alone (which pages are past a
    sequence or always read, the lengths read) is made once per change of ``page_table`` /
    ``seq_lens`` (their version counters: a plan that is reused over tables written in place,
    as a CUDA graph's are, sees each write), and in every call under a CUDA graph capture (the
    replay then remakes it per step) or over tables made under ``torch.inference_mode`` (no
    version counter); each layer then costs the estimates, the scores, the top pages
    and one gather."""

    def __init__(self, page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int, budget: int,
                 sink_pages: int, recent_pages: int, device):
        B, W = page_table.shape
        self.page_table, self.seq_lens = page_table, seq_lens  # (B, W) int32, (B,) int32: the plan's
        self.page_size, self.budget = page_size, budget
        self.sink_pages, self.recent_pages = sink_pages, recent_pages
        self.table = torch.zeros((B, budget), dtype=torch.int32, device=device)  # (B, budget) the chosen pages
        self.lens = torch.ones(B, dtype=torch.int32, device=device)  # (B,) the keys read over them
        self._rows = None  # (last, past, keep, rows) of the versions in _seen
        self._seen = None

    def _row_state(self, capturing: bool):
        # tensors made under torch.inference_mode keep no version counter: remade every call
        tracked = not (self.page_table.is_inference() or self.seq_lens.is_inference())
        seen = (self.page_table._version, self.seq_lens._version) if tracked else None
        if capturing or seen is None or self._rows is None or seen != self._seen:
            self._rows = _row_bounds(self.seq_lens, self.page_size, self.page_table.shape[1], self.sink_pages,
                                     self.recent_pages)
            _selected_lens(self.seq_lens, self._rows[0], self.page_size, self.budget, self.lens)
            self._seen = seen
        return self._rows

    def select(self, q: torch.Tensor, summaries, layer: int, scale: float, capturing: bool = False) -> None:
        """Writes the pages ``q`` (B, Hq, d) selects at ``layer`` into ``table`` (and ``lens``)."""
        idx = _chosen(q, self.page_table, summaries, layer, self._row_state(capturing), scale, self.budget)
        torch.gather(self.page_table, 1, idx, out=self.table)


def _page_keys(pool: torch.Tensor, scales: torch.Tensor | None, pages: torch.Tensor, layer: int) -> torch.Tensor:
    """float32 (n, Hkv, P, d): the K rows of ``layer`` in pages ``pages`` of ``pool`` (pages, L,
    Hkv, 2, P, d), FP8 pages dequantized with their ``scales`` (pages, L, Hkv, 2, P)."""
    k = pool[:, layer, :, 0].index_select(0, pages)
    if scales is None:
        return k.float()
    return dequantize(k, scales[:, layer, :, 0].index_select(0, pages), torch.float32)


def page_masses(q: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor, cache, layer: int,
                scale: float) -> torch.Tensor:
    """float32 (B, Hkv, g, W): for each decode row of ``q`` (B, Hq, d), the share of each query
    head's exact softmax (every key of its sequence, ``page_table`` (B, W) and ``seq_lens`` (B,)
    as for ``page_scores``) on each page. Keys are read from ``cache``'s pools (FP8 pages
    dequantized with their scales)."""
    B, Hq, d = q.shape
    W = page_table.shape[1]
    host, host_s = kernel_host_pool(cache), kernel_host_scales(cache)  # as the kernels read them
    e = page_table.long()
    k = _page_keys(host, host_s, e.clamp(min=0).view(-1), layer)  # (B * W, Hkv, P, d)
    if cache.hbm_pool is not None and cache.hbm_pool.shape[0]:
        kd = _page_keys(cache.hbm_pool, cache.hbm_scales, (-e - 1).clamp(min=0).view(-1), layer)
        k = torch.where((e < 0).view(-1, 1, 1, 1), kd, k)
    hkv, P = k.shape[1], k.shape[2]
    k = k.view(B, W, hkv, P, d)
    qf = q.float().view(B, hkv, Hq // hkv, d)
    s = torch.einsum("bhgd,bwhpd->bhgwp", qf, k) * scale  # (B, Hkv, g, W, P)
    pos = torch.arange(W * P, device=q.device).view(W, P)
    s = s.masked_fill((pos[None] >= seq_lens.long().view(B, 1, 1))[:, None, None], -math.inf)
    whole = torch.logsumexp(s.flatten(3), dim=3)  # (B, Hkv, g)
    return torch.exp(torch.logsumexp(s, dim=4) - whole[..., None])  # (B, Hkv, g, W)


def selected_mass(q: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor, sel_table: torch.Tensor,
                  cache, layer: int, scale: float) -> torch.Tensor:
    """float32 (B,): for each decode row, the share of its exact softmax mass (``page_masses``) on
    the pages of ``sel_table`` (B, K), averaged over the query heads."""
    return _held(page_masses(q, page_table, seq_lens, cache, layer, scale), page_table, sel_table)


def _held(masses: torch.Tensor, page_table: torch.Tensor, sel_table: torch.Tensor) -> torch.Tensor:
    """float32 (B,): the mass (``masses`` (B, Hkv, g, W)) on the pages of ``sel_table``, mean over heads."""
    chosen = (page_table[:, :, None] == sel_table[:, None, :]).any(-1)  # (B, W)
    return (masses * chosen[:, None, None, :]).sum(3).flatten(1).mean(1)


def oracle_mass(masses: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """float32 (B,): the most mass any ``pages[b]`` pages shared by all heads of row b could hold
    (``masses``: ``page_masses``, (B, Hkv, g, W)): the pages of the largest mean mass over the
    heads, their mass averaged over the heads. The bound a selection of that many pages per row
    (one set for all heads, as sparse decode reads) is measured against."""
    B, hkv, g, W = masses.shape
    order = masses.mean((1, 2)).argsort(dim=1, descending=True)  # (B, W)
    ranked = masses.gather(3, order[:, None, None, :].expand(B, hkv, g, W)).cumsum(3)  # (B, Hkv, g, W)
    at = (pages.long().clamp(1, W) - 1).view(B, 1, 1, 1).expand(B, hkv, g, 1)
    return ranked.gather(3, at).flatten(1).mean(1)


class SparseStats:
    """What the selected pages of sparse decode steps hold of the exact attention (opt-in; see
    the module docstring): in ``DirectKVAttention.sparse_hooks`` (``DirectKVCache(...,
    sparse_stats=True)`` puts one there), every sparse decode layer run outside a CUDA graph
    capture records its rows' mass on the selected pages and ``oracle_mass``, the most that
    as many pages shared by the heads could hold. Sums stay on the device until read."""

    def __init__(self):
        self.reset()

    def selected(self, call, page_table: torch.Tensor, seq_lens: torch.Tensor, sel_table: torch.Tensor) -> None:
        """A sparse decode run chose ``sel_table`` (B, K) for ``call`` over ``page_table`` /
        ``seq_lens``: record its rows' attention mass (not while a CUDA graph is captured)."""
        if call.capturing:
            return
        masses = page_masses(call.q, page_table, seq_lens, call.cache, call.layer, call.scale)
        pages = (sel_table[:, 1:] != sel_table[:, :-1]).sum(1) + 1  # (B,) distinct: repeats end a row
        self.record(_held(masses, page_table, sel_table), oracle_mass(masses, pages), call.layer)

    def reset(self) -> None:
        self._sums: dict = {}  # layer (None: not given) -> [mass sum, oracle sum or None, rows], on the device

    def record(self, mass: torch.Tensor, oracle: torch.Tensor | None = None, layer: int | None = None) -> None:
        """Adds the per-row masses (a 1-d tensor) of one layer run, and the oracle's for them."""
        acc = self._sums.setdefault(layer, [0, None, 0])
        acc[0] = acc[0] + mass.double().sum()
        if oracle is not None:
            best = oracle.double().sum()
            acc[1] = best if acc[1] is None else acc[1] + best
        acc[2] += mass.numel()

    @property
    def count(self) -> int:
        """Rows x layers recorded since the last ``reset``."""
        return sum(n for _, _, n in self._sums.values())

    @property
    def mass(self) -> float | None:
        """The mean attention mass on the selected pages over every row and layer recorded (0..1);
        None before the first."""
        n = self.count
        return float(sum(m for m, _, _ in self._sums.values())) / n if n else None

    @property
    def oracle_mass(self) -> float | None:
        """The mean of ``sparse.oracle_mass`` over the same rows and layers (0..1): what the best
        page set of each selection's size would have held; None before the first."""
        n, best = self.count, [o for _, o, _ in self._sums.values() if o is not None]
        return float(sum(best)) / n if n and best else None

    @property
    def by_layer(self) -> dict:
        """{layer: (mean mass, mean oracle mass or None)} over the rows recorded at each layer."""
        out = {}
        for layer in sorted(layer for layer in self._sums if layer is not None):
            m, o, n = self._sums[layer]
            out[layer] = (float(m) / n, None if o is None else float(o) / n)
        return out


class RecallCounts:
    """How often each page was selected since the last ``take``: one count per (layer, row) that
    chose it, on the device, without a host sync (a CUDA graph can hold ``selected``). Host pages
    and HBM pages are counted apart (a page table's encoding: >= 0 host, < 0 HBM ``-e - 1``; the
    HBM pool's pages: the tier's and the window's mirrors); a row's repeats of its last selected
    page count once."""

    def __init__(self, num_host_pages: int, num_hbm_pages: int, device):
        self.num_host_pages = num_host_pages
        # the host pages' counts, then the HBM pages', then one spare slot where repeats land
        self.counts = torch.zeros(num_host_pages + num_hbm_pages + 1, dtype=torch.float32, device=device)
        self._ones = torch.ones(0, dtype=torch.float32, device=device)  # one per entry of a table, kept

    def selected(self, call, page_table: torch.Tensor, seq_lens: torch.Tensor, sel_table: torch.Tensor) -> None:
        sel = sel_table.long()
        # entry e >= 0 counts at e, e < 0 (HBM page -e - 1) at num_host_pages - e - 1
        slot = torch.where(sel >= 0, sel, (self.num_host_pages - 1) - sel)
        slot[:, 1:].masked_fill_(sel[:, 1:] == sel[:, :-1], self.counts.shape[0] - 1)
        if self._ones.numel() != slot.numel():
            self._ones = torch.ones(slot.numel(), dtype=torch.float32, device=slot.device)
        self.counts.index_add_(0, slot.view(-1), self._ones)

    def take(self):
        """(host counts, HBM counts) as numpy float32 arrays (one copy to the host), zeroed after."""
        counts = self.counts[:-1].cpu().numpy().copy()
        self.counts.zero_()
        return counts[:self.num_host_pages], counts[self.num_host_pages:]


__all__ = ["PageSelector", "RecallCounts", "SparseBudget", "SparseStats", "oracle_mass", "page_masses", "page_scores",
           "parse_budget", "select_pages", "selected_mass"]
