"""Page summaries: per page, layer and KV head, the elementwise sum and sum of squares of the
page's K rows written so far, kept on the cache device (in HBM on a GPU cache) so that a page
selection can estimate each page's share of a query's attention without reading a byte of KV over
the link. From them a page of ``n`` rows has the mean ``mu = sum / n`` and the variance ``var =
squares / n - mu**2`` of its keys per channel; ``sparse`` scores a page by the log of the
expected ``exp(scale * q . k)`` of a key drawn from a normal distribution of that mean and
variance: ``scale * (q . mu + scale / 2 * sum_d q_d**2 var_d)``.

Why not the min and max (Quest's bound). The bound's slack is dominated by a few channels whose
keys are large and spread (the low-frequency RoPE channels of a trained model): on
SmolLM2-135M the bound missed the page a retrieval head needed in a quarter of the steps and a
needle task at a budget of 1/8 lost most of its score; mean and variance in the same number of
values keep more of those pages (docs/PERFORMANCE.md).

Layout. ``host`` (host pages, L, Hkv, 2, d) and ``hbm`` (HBM pages then window pages, L, Hkv, 2,
d), indexed like the pools: a page-table entry ``e >= 0`` names ``host[e]``, ``e < 0`` names
``hbm[-e - 1]`` (window mirrors included, so the entries of ``kernel_tables`` index them as they
are). ``[..., SUM, :]`` is the sum, ``[..., SQUARES, :]`` the sum of squares, in float32 (sums of
many rows keep their low bits there; the variance is a difference of two of them) of the K rows
as stored: 16-bit values as they are, FP8 pages dequantized (``fp8.dequantize``).

Bytes. ``2 * d`` float32 per (page, layer, KV head) against the page's ``2 * P * d`` elements of
K and V: 2/P of the KV for 16-bit pages (1/32 at page 64, 1/8 at page 16), 4/P for FP8 pages.

Empty pages. A page that no row was written to since it was handed out holds zeros, the
identity of the sums. A page's row count is not stored: a sequence's pages are full but its
newest, whose rows its length gives (``sparse`` divides by them).

Upkeep (``PagedKVCache`` drives it; every step is enqueued on the current stream, no host sync):

* a store of rows (``write``, ``append``, ``write_slots``): per (page, layer, KV head) the K rows
  and their squares added, one ``index_add_`` per tier, the host page and its window mirror alike
  (a mirror's summary is its host page's, also when the host copy is left to the copy engine);
* a store by other means (``kv_project`` into ``write_destinations``): ``refresh`` reads the
  stored K rows back from the pools (a token with an HBM copy from HBM, others from the host
  pool) and adds them the same way;
* a page handed out empty (``extend``, a window mirror its writes will fill): reset to zeros, so
  a freed and reused page starts fresh whatever row its first write lands in;
* a page copy (fork's partial last page, copy-on-write, moves between tiers, a mirror's first
  copy): the summary is copied with it;
* ``truncate``: the new partial last page's summary is recomputed from its remaining rows (and
  its mirror's set to the same), so it is exact again.

A row written twice (``write`` over tokens already written) is counted twice: the page's
summary then describes both writes until the page is truncated and written again (``truncate``
recomputes it).

``StoreSummaries`` keeps the same summaries for one-layer pools written through a
``cache.store.StoreIndex`` (the vLLM backend's per-layer pools, ``L = 1``): each store adds its K
rows to the summaries of the host pages and of their HBM copies, a token that a fixed-size store
names more than once counted once, and a page whose row 0 is stored is emptied first (a page
handed out fresh is written from row 0; a page read again without being written, a prefix shared
by another request, keeps its summary). Both are device operations of static shapes (no host
sync; a CUDA graph can hold them).
"""

from __future__ import annotations

import numpy as np
import torch

from directkv_cute.cache.pages import Tier, check_tier, decode_page
from directkv_cute.cache.store import StoreIndex, one_copy
from directkv_cute.fp8 import dequantize

SUM, SQUARES = 0, 1  # the index of the sum and the sum of squares on a summary's second-to-last dimension
DTYPE = torch.float32  # every summary's dtype


def merge_rows(summaries: torch.Tensor, index: torch.Tensor, values: torch.Tensor, start: int = 0) -> None:
    """Add ``values`` (n, d) and their squares to the summary rows ``start + index`` (int64 (n,))
    of ``summaries`` viewed as rows ``(-1, 2 * d)``, in one ``index_add_`` (rows named several
    times take every value; a zero row adds nothing)."""
    d = values.shape[-1]
    v = values.to(DTYPE)
    both = torch.cat((v, v * v), dim=1)  # (n, 2d): the rows of the summaries' view
    summaries.view(-1, 2 * d)[start:].index_add_(0, index, both)


def empty_rows(summaries: torch.Tensor, index: torch.Tensor, fresh: torch.Tensor) -> None:
    """Empty the summary rows ``index[fresh]`` of ``summaries`` (rows ``(-1, 2 * d)``; ``fresh``
    bool (n,)) and leave the others as they are, with static shapes (no host sync): every row of
    ``index`` is multiplied by 0 (emptied) or 1 (kept)."""
    d2 = summaries.shape[-1] * 2
    keep = (~fresh).to(summaries.dtype)[:, None].expand(-1, d2)
    summaries.view(-1, d2).scatter_reduce_(0, index[:, None].expand(-1, d2), keep, "prod")


def empty_summaries(pages: int, num_layers: int, num_kv_heads: int, head_dim: int, device) -> torch.Tensor:
    """(pages, L, Hkv, 2, d) float32 summaries of pages never written: zeros."""
    return torch.zeros((pages, num_layers, num_kv_heads, 2, head_dim), dtype=DTYPE, device=device)


def page_moments(summaries: torch.Tensor, rows) -> torch.Tensor:
    """float32 (..., 2, d): the mean (at ``SUM``) and the variance (at ``SQUARES``) of pages of
    ``rows`` rows (an int, or a tensor that broadcasts against (..., 2, d)) from their summaries
    (..., 2, d), in the summaries' layout."""
    m = summaries / rows  # the mean, and the mean of the squares
    m[..., SQUARES, :].sub_(m[..., SUM, :] * m[..., SUM, :]).clamp_(min=0)
    return m


class PageSummaries:
    """The min / max of K of every page of a cache's pools (see the module docstring).

    host: (host pages, L, Hkv, 2, d) on the cache device.
    hbm:  (HBM pages + window pages, L, Hkv, 2, d) on the cache device.
    """

    def __init__(self, pools) -> None:
        self._pools = pools
        self.num_layers, self.num_kv_heads, _, self.page_size, self.head_dim = pools.page_shape
        self.page_dtype = pools.dtype
        self.fp8 = pools.fp8
        self.dtype = DTYPE  # the summaries', and the K rows' they are made from
        self.device = pools.device
        shape = (self.num_layers, self.num_kv_heads, 2, self.head_dim)
        # One empty summary, (L, Hkv, 2, d): zeros, what a reset writes.
        self._empty = empty_summaries(1, *shape[:2], self.head_dim, self.device)[0]
        self.host = self._empty.expand(pools.host_pool.shape[0], *shape).contiguous()
        self.hbm = self._empty.expand(pools.hbm_pool.shape[0], *shape).contiguous()
        self._heads = torch.arange(self.num_kv_heads, dtype=torch.int64, device=self.device)  # (Hkv,)
        self._layers = torch.arange(self.num_layers, dtype=torch.int64, device=self.device)  # (L,)
        self._memo: tuple | None = None  # (TokenSlots, {layers: destinations}) of the last slots merged

    # ---- queries ---------------------------------------------------------------------------
    def pool(self, tier: Tier) -> torch.Tensor:
        """The tier's summaries (``host`` or ``hbm``)."""
        return self.hbm if check_tier(tier) == "hbm" else self.host

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page's summaries, every layer: ``L * Hkv * 2 * d`` float32."""
        return self._empty.numel() * self._empty.element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of every summary, both tiers and the window."""
        return (self.host.shape[0] + self.hbm.shape[0]) * self.bytes_per_page

    # ---- upkeep ------------------------------------------------------------------------------
    def reset(self, entries) -> None:
        """Empty the summaries of the pages ``entries`` (encoded page-table entries)."""
        entries = np.asarray(entries, dtype=np.int64).reshape(-1)
        host, hbm = entries[entries >= 0], -entries[entries < 0] - 1
        idx = one_copy([host, hbm], self.device)
        for t, i in zip((self.host, self.hbm), idx):
            if len(i):
                t[i] = self._empty

    def copy(self, src: int, dst: int) -> None:
        """The summaries of page ``dst`` := those of page ``src`` (encoded entries, every layer)."""
        (st, si), (dt, di) = decode_page(src), decode_page(dst)
        self.pool(dt)[di].copy_(self.pool(st)[si])

    def stored_k(self, k: torch.Tensor, stored: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        """The K rows of a store as the summaries take them: ``k`` itself for 16-bit pages, else
        the stored FP8 bytes (``stored``: ``(n, ..., d)`` as the pages hold them) times their
        scales (``(n, ...)``), in float32."""
        if not self.fp8:
            return k.detach()
        return dequantize(stored.view(self.page_dtype), scales, self.dtype)

    def merge(self, slots, layer: int | None, k: torch.Tensor) -> None:
        """Add the K rows ``k`` ((total, Hkv, d) of layer ``layer``, or (total, L, Hkv, d) of every
        layer for None) of the tokens of ``slots`` (``TokenSlots``) to the summaries of the pages
        they were stored in: host pages, HBM pages, window mirrors and their host pages."""
        d = self.head_dim
        start = 0 if layer is None else layer * self.num_kv_heads
        for summaries, tok, sidx in self._destinations(slots, layer is None):
            merge_rows(summaries, sidx, (k if tok is None else k.index_select(0, tok)).reshape(-1, d), start)

    def refresh(self, slots, layer: int | None) -> None:
        """Add the K rows the pools hold for the tokens of ``slots`` at ``layer`` (None: every
        layer), written there by other means (``kv_project``): each token's rows are read from its
        HBM copy where it has one (an HBM page, a window mirror: no link traffic), else from its
        host page (on a GPU, through the host pool's CUDA alias: ``Hkv * d`` elements per token
        and layer cross the link)."""
        lsel = slice(None) if layer is None else layer
        parts = slots.parts  # disjoint tokens covering the slots: a mirrored token's part is its mirror
        if len(parts) == 1 and parts[0][1] is None:
            tier, _, pidx, off = parts[0]
            k = self._k_rows(tier, pidx, lsel, off)
        else:
            rows = (self.num_layers,) if layer is None else ()
            k = torch.empty((slots.total, *rows, self.num_kv_heads, self.head_dim), dtype=self.dtype,
                            device=self.device)
            for tier, tok, pidx, off in parts:
                k[tok] = self._k_rows(tier, pidx, lsel, off).to(self.dtype)
        self.merge(slots, layer, k)

    def recompute(self, entry: int, rows: int, also: tuple = ()) -> None:
        """Recompute page ``entry``'s summaries (every layer) from its first ``rows`` rows, and
        set the pages ``also`` (encoded entries: its mirror) to the same."""
        tier, index = decode_page(entry)
        raw = self._raw(tier)[index, :, :, 0, :rows]  # (L, Hkv, rows, d)
        if self.fp8:
            k = dequantize(raw.view(self.page_dtype), self._pools.scales(tier)[index, :, :, 0, :rows], self.dtype)
        else:
            k = raw
        k = k.to(DTYPE)
        out = torch.stack((k.sum(dim=2), (k * k).sum(dim=2)), dim=2)  # (L, Hkv, 2, d)
        for e in (entry, *also):
            t, i = decode_page(e)
            self.pool(t)[i].copy_(out)

    # ---- internals ---------------------------------------------------------------------------
    def _raw(self, tier: Tier) -> torch.Tensor:
        """The tier's pool on the cache device, FP8 pages as their bytes (indexed gathers do not
        all take float8 dtypes)."""
        pool = self._pools.pool(tier)
        return pool.view(torch.uint8) if self.fp8 else pool

    def _k_rows(self, tier: Tier, pidx, lsel, off) -> torch.Tensor:
        """K rows at pages ``pidx``, rows ``off`` of ``tier``, layers ``lsel``: (m, [L,] Hkv, d)."""
        raw = self._raw(tier)[pidx, lsel, :, 0, off]
        if not self.fp8:
            return raw
        return dequantize(raw.view(self.page_dtype), self._pools.scales(tier)[pidx, lsel, :, 0, off], self.dtype)

    def _destinations(self, slots, all_layers: bool) -> list:
        """Per tier the slots' tokens go to: (summaries, tokens int64 (m,) or None for all,
        summary rows int64 (m * Hkv,) of layer 0 as rows of ``summaries.view(-1, 2, d)``, or
        (m * L * Hkv,) of every layer with ``all_layers``). Host destinations are the host pages and
        the mirrored tokens' host pages; HBM ones the HBM pages and the window mirrors. Made on the
        device once per slots (the step's layers reuse them)."""
        if self._memo is not None and self._memo[0] is slots and all_layers in self._memo[1]:
            return self._memo[1][all_layers]
        L, H = self.num_layers, self.num_kv_heads
        out = []
        for tier, summaries in (("host", self.host), ("hbm", self.hbm)):
            got = [(tok, pidx) for t, tok, pidx, _ in slots.parts + slots.mirrored if t == tier]
            if not got:
                continue
            if len(got) == 1:
                tok, pidx = got[0]
            else:
                every = torch.arange(slots.total, dtype=torch.int64, device=self.device)
                tok = torch.cat([every if t is None else t for t, _ in got])
                pidx = torch.cat([p for _, p in got])
            if all_layers:  # token, then layer, then head: the order of k.reshape(-1, d)
                base = (pidx[:, None] * L + self._layers) * H  # (m, L)
                sidx = (base[:, :, None] + self._heads).reshape(-1)
            else:
                sidx = (pidx[:, None] * (L * H) + self._heads).reshape(-1)
            out.append((summaries, tok, sidx))
        if self._memo is None or self._memo[0] is not slots:
            self._memo = (slots, {})
        self._memo[1][all_layers] = out
        return out


class StoreSummaries:
    """The page summaries of one layer's pools in the vLLM backend's layout (one-layer pages
    ``(pages, Hkv, 2, P, d)``), kept by the stores of ``cache.store.StoreIndex`` (see the module
    docstring): ``host`` (host pages, 1, Hkv, 2, d) and ``hbm`` (HBM pages, 1, Hkv, 2, d) on
    ``device``, as ``sparse.page_scores`` reads them (layer 0).

    A K row of the store lands at pool row ``(page * 2 * Hkv + 2 * h) * P + off``
    (``cache.store.pool_rows``, ``L = 1``): its summary row is ``row // (2 * P)``, ``page * Hkv +
    h``, and its offset ``row % P``."""

    def __init__(self, host_pages: int, hbm_pages: int, num_kv_heads: int, head_dim: int, page_size: int, kv_dtype,
                 device) -> None:
        self.page_size, self.num_kv_heads, self.head_dim, self.dtype = page_size, num_kv_heads, head_dim, DTYPE
        self.kv_dtype = kv_dtype  # the pools': a store's K rows are summed as the pools hold them
        self.host = empty_summaries(host_pages, 1, num_kv_heads, head_dim, device)
        self.hbm = empty_summaries(hbm_pages, 1, num_kv_heads, head_dim, device)

    @property
    def nbytes(self) -> int:
        """Bytes of both tiers' summaries."""
        return (self.host.numel() + self.hbm.numel()) * self.host.element_size()

    def merge(self, index: StoreIndex, k: torch.Tensor) -> None:
        """Add the K rows ``k`` ((span, Hkv, d), the store's tokens) that ``index`` (on ``k``'s
        device) stores to the summaries of their host pages and HBM copies, each page whose row 0
        is among them emptied first. A token the index names more than once (the padding of a
        fixed-size store writes a stored token's rows again) is counted once."""
        k = k.detach().to(self.kv_dtype)
        for summaries, rows, tokens in ((self.host, index.host_rows, index.tokens),
                                        (self.hbm, index.hbm_rows, index.hbm_tokens)):
            if not len(rows):
                continue
            k_rows = rows.view(-1, 2)[:, 0]  # token by token, each KV head's K row (then its V row)
            sidx = k_rows.div(2 * self.page_size, rounding_mode="floor")
            empty_rows(summaries, sidx, k_rows.remainder(self.page_size) == 0)
            vals = k if tokens is None else k.index_select(0, tokens)  # (m, Hkv, d)
            if index.counted is not None:  # a repeated token's rows count once: its repeats add zeros
                vals = vals * index.counted[:, None, None].to(vals.dtype)
            merge_rows(summaries, sidx, vals.reshape(-1, self.head_dim))
