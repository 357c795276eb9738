"""Page summaries: per page, layer and KV head, the elementwise min and max of the page's K rows
written so far, kept on the cache device (in HBM on a GPU cache) so that a page selection can bound
``q . k`` for every page without reading a byte of KV over the link (Quest-style selection):
``q . k <= sum_d max(q_d * kmin_d, q_d * kmax_d) = q+ . kmax + q- . kmin`` for every K row ``k``
of the page.

Layout. ``host`` (host pages, L, Hkv, 2, d) and ``hbm`` (HBM pages then window pages, L, Hkv, 2,
d), indexed like the pools: a page-table entry ``e >= 0`` names ``host[e]``, ``e < 0`` names
``hbm[-e - 1]`` (window mirrors included, so the entries of ``kernel_tables`` index them as they
are). ``[..., 0, :]`` is the min, ``[..., 1, :]`` the max. The dtype is the pages' for 16-bit (and
the CPU's float32) pages, bfloat16 for FP8 pages: the dequantized K (``float32(q) * scale``,
rounded to nearest, as ``fp8.dequantize`` gives it), so the bound holds up to half a bfloat16 ulp
of those values.

Bytes. ``2 * d`` elements per (page, layer, KV head) against the page's ``2 * P * d`` of K and V:
1/P of the KV for 16-bit pages (1/64 at page 64), 2/P of the FP8 bytes (bf16 summaries of 1-byte
elements; the scales not counted).

Empty pages. A page that no row was written to since it was handed out holds min = +inf and
max = -inf, the identity of the min/max merge. Its bound ``q+ . kmax + q- . kmin`` is -inf (a
product ``0 * inf`` is NaN, which a scorer maps to -inf as well): an empty page never ranks above
a written one.

Upkeep (``PagedKVCache`` drives it; every step is enqueued on the current stream, no host sync):

* a store of rows (``write``, ``append``, ``write_slots``): per (page, layer, KV head) the min and
  max merged with the stored K rows, one ``scatter_reduce`` (amin) and one (amax) per tier, the
  host page and its window mirror alike (a mirror's summary is its host page's, also when the
  host copy is left to the copy engine);
* a store by other means (``kv_project`` into ``write_destinations``): ``refresh`` reads the
  stored K rows back from the pools (a token with an HBM copy from HBM, others from the host
  pool) and merges them the same way;
* a page handed out empty (``extend``, a window mirror its writes will fill): reset to the empty
  summary, so a freed and reused page starts fresh whatever row its first write lands in;
* a page copy (fork's partial last page, copy-on-write, moves between tiers, a mirror's first
  copy): the summary is copied with it;
* ``truncate``: the new partial last page's summary is recomputed from its remaining rows (and
  its mirror's set to the same), so it is exact again.

A row written twice (``write`` over tokens already written) keeps its old values in the merge:
the summary then bounds both, still a valid (looser) bound; truncating and writing again makes it
exact.

``StoreSummaries`` keeps the same summaries for one-layer pools written through a
``cache.store.StoreIndex`` (the vLLM backend's per-layer pools, ``L = 1``): each store merges its
K rows into the summaries of the host pages and of their HBM copies, and a page whose row 0 is
stored is emptied first (a page handed out fresh is written from row 0; a page read again without
being written, a prefix shared by another request, keeps its summary). Both are device operations
of static shapes (no host sync; a CUDA graph can hold them).
"""

from __future__ import annotations

import numpy as np
import torch

from directkv_cute.cache.pages import Tier, check_tier, decode_page
from directkv_cute.cache.store import StoreIndex, one_copy
from directkv_cute.fp8 import dequantize

MIN, MAX = 0, 1  # the index of the min and the max on a summary's second-to-last dimension


def merge_rows(summaries: torch.Tensor, index: torch.Tensor, values: torch.Tensor, start: int = 0) -> None:
    """Merge ``values`` (n, d) into the summary rows ``start + index`` (int64 (n,)) of
    ``summaries`` viewed as rows ``(-1, 2, d)``: the min with amin, the max with amax (one
    ``scatter_reduce`` each; rows named several times take all their values)."""
    d = values.shape[-1]
    flat = summaries.view(-1, 2, summaries.shape[-1])[start:]
    index = index[:, None].expand(-1, d)
    flat[:, MIN].scatter_reduce_(0, index, values, "amin")
    flat[:, MAX].scatter_reduce_(0, index, values, "amax")


def empty_rows(summaries: torch.Tensor, index: torch.Tensor, fresh: torch.Tensor) -> None:
    """Empty the summary rows ``index[fresh]`` of ``summaries`` (rows ``(-1, 2, d)``; ``fresh``
    bool (n,)) and leave the others as they are, with static shapes (no host sync): every row of
    ``index`` takes ``max(min, +inf or -inf)`` and ``min(max, -inf or +inf)``."""
    d = summaries.shape[-1]
    # filled on the device from Python scalars: no host-to-device copy (a CUDA graph capture holds it)
    low = torch.full(fresh.shape, float("-inf"), dtype=summaries.dtype, device=summaries.device)
    low = low.masked_fill_(fresh, float("inf"))[:, None].expand(-1, d)  # +inf: emptied, -inf: kept
    flat = summaries.view(-1, 2, d)
    index = index[:, None].expand(-1, d)
    flat[:, MIN].scatter_reduce_(0, index, low, "amax")
    flat[:, MAX].scatter_reduce_(0, index, -low, "amin")


def empty_summaries(pages: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype, device) -> torch.Tensor:
    """(pages, L, Hkv, 2, d) summaries of pages never written: min +inf, max -inf."""
    out = torch.empty((pages, num_layers, num_kv_heads, 2, head_dim), dtype=dtype, device=device)
    out[..., MIN, :] = float("inf")
    out[..., MAX, :] = float("-inf")
    return out


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
        self.dtype = torch.bfloat16 if pools.fp8 else pools.dtype
        self.device = pools.device
        shape = (self.num_layers, self.num_kv_heads, 2, self.head_dim)
        # One empty summary, (L, Hkv, 2, d): +inf then -inf, what a reset writes.
        self._empty = empty_summaries(1, *shape[:2], self.head_dim, self.dtype, self.device)[0]
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
        """Bytes of one page's summaries, every layer: ``L * Hkv * 2 * d`` elements."""
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
        scales (``(n, ...)``), in bfloat16."""
        if not self.fp8:
            return k.detach()
        return dequantize(stored.view(self.page_dtype), scales, self.dtype)

    def merge(self, slots, layer: int | None, k: torch.Tensor) -> None:
        """Merge the K rows ``k`` ((total, Hkv, d) of layer ``layer``, or (total, L, Hkv, d) of every
        layer for None) of the tokens of ``slots`` (``TokenSlots``) into the summaries of the pages
        they were stored in: host pages, HBM pages, window mirrors and their host pages."""
        d = self.head_dim
        start = 0 if layer is None else layer * self.num_kv_heads
        for summaries, tok, sidx in self._destinations(slots, layer is None):
            merge_rows(summaries, sidx, (k if tok is None else k.index_select(0, tok)).reshape(-1, d), start)

    def refresh(self, slots, layer: int | None) -> None:
        """Merge the K rows the pools hold for the tokens of ``slots`` at ``layer`` (None: every
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
                k[tok] = self._k_rows(tier, pidx, lsel, off)
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
        out = torch.stack((k.amin(dim=2), k.amax(dim=2)), dim=2).to(self.dtype)  # (L, Hkv, 2, d)
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

    def __init__(self, host_pages: int, hbm_pages: int, num_kv_heads: int, head_dim: int, page_size: int, dtype,
                 device) -> None:
        self.page_size, self.num_kv_heads, self.head_dim, self.dtype = page_size, num_kv_heads, head_dim, dtype
        self.host = empty_summaries(host_pages, 1, num_kv_heads, head_dim, dtype, device)
        self.hbm = empty_summaries(hbm_pages, 1, num_kv_heads, head_dim, dtype, device)

    @property
    def nbytes(self) -> int:
        """Bytes of both tiers' summaries."""
        return (self.host.numel() + self.hbm.numel()) * self.host.element_size()

    def merge(self, index: StoreIndex, k: torch.Tensor) -> None:
        """Merge the K rows ``k`` ((span, Hkv, d), the store's tokens) that ``index`` (on ``k``'s
        device) stores into the summaries of their host pages and HBM copies, each page whose row
        0 is among them emptied first. A token written twice with the same values (a padding
        token of a fixed-size store) changes nothing."""
        k = k.detach().to(self.dtype)
        for summaries, rows, tokens in ((self.host, index.host_rows, index.tokens),
                                        (self.hbm, index.hbm_rows, index.hbm_tokens)):
            if not len(rows):
                continue
            k_rows = rows.view(-1, 2)[:, 0]  # token by token, each KV head's K row (then its V row)
            sidx = k_rows.div(2 * self.page_size, rounding_mode="floor")
            empty_rows(summaries, sidx, k_rows.remainder(self.page_size) == 0)
            vals = (k if tokens is None else k.index_select(0, tokens)).reshape(-1, self.head_dim)
            merge_rows(summaries, sidx, vals)
