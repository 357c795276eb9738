"""The one store path of new K/V rows: where a batch of tokens' K and V go in a pool of pages and
in its HBM copies, and the indexed copies that put them there. Every writer of new tokens goes
through it: the cache (``PagedKVCache.write_slots``, ``write``, ``append``: ``TokenSlots`` carry
the step's ``StoreIndex``), the fused projection (``kv_project`` takes the same destinations as
per-token slots: ``token_slots``, ``PagedKVCache.write_destinations``) and the vLLM backend
(``vllm.step.store_kv`` over ``SlotDestinations.store_index`` and ``GraphDecode``'s buffers).

Rows. A pool holds pages ``(pages, L, Hkv, 2, P, d)`` (the cache's, every layer) or ``(pages,
Hkv, 2, P, d)`` (the vLLM backend's, one layer: ``L = 1``). Viewed as rows of ``d`` elements,
row ``off`` of page ``page``, layer ``l``, KV head ``h``, K (``c = 0``) or V (``c = 1``) is row
``((page * L + l) * 2 * Hkv + 2 * h + c) * P + off`` (``pool_rows``); the scales of FP8 pages,
``(pages, L, Hkv, 2, P)``, hold that row's scale at the same index. An index names the rows of
layer 0; the store of layer ``l`` starts ``layer_start(l)`` rows into the pool, so one index
serves every layer of a step.

Store. K and V ``(tokens, [L,] Hkv, d)`` are copied as they are, one ``index_copy_`` each per
pool (no staging copy of the data): K into the K rows of the index, V into the same rows ``P``
further (a page holds a head's V rows right after its K rows). The host pool is written on a GPU
through its CUDA alias (the GPU stores straight into pinned host memory, on the current stream);
the HBM pool gets the rows of tokens whose pages have an HBM copy there (the cache's HBM pages and
window mirrors, the vLLM tier's mirrors) (``store_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def pool_rows(pages, offsets, num_kv_heads: int, page_size: int, num_layers: int = 1, all_layers: bool = False,
              hc=None):
    """The rows (``(-1, d)`` view of a pool of ``num_layers`` layers) that hold the K then V of
    every KV head of m tokens at ``pages``, ``offsets`` (int64 (m,)), token by token: of layer 0
    ((m * 2 * Hkv,)), or with ``all_layers`` of every layer ((m * L * 2 * Hkv,), token, then
    layer, then head and K/V).

    numpy arrays give a numpy array; tensors give a tensor on their device (``hc``: int64
    ``arange(2 * Hkv)`` there, made once by a caller that stores often)."""
    width = 2 * num_kv_heads
    if isinstance(pages, torch.Tensor):
        if hc is None:
            hc = torch.arange(width, dtype=torch.int64, device=pages.device)  # h * 2 + c
        if not all_layers:
            rows = pages[:, None] * (num_layers * width) + hc
            return rows.mul_(page_size).add_(offsets[:, None]).view(-1)
        lay = torch.arange(num_layers, dtype=torch.int64, device=pages.device)
    else:
        pages, offsets = np.asarray(pages, dtype=np.int64), np.asarray(offsets, dtype=np.int64)
        hc = np.arange(width, dtype=np.int64)
        if not all_layers:
            return ((pages[:, None] * (num_layers * width) + hc) * page_size + offsets[:, None]).reshape(-1)
        lay = np.arange(num_layers, dtype=np.int64)
    rows = ((pages[:, None, None] * num_layers + lay[None, :, None]) * width + hc) * page_size
    return (rows + offsets[:, None, None]).reshape(-1)


def layer_start(layer: int, num_kv_heads: int, page_size: int) -> int:
    """The row where layer ``layer`` of a pool's page 0 starts: an index of layer-0 rows
    (``pool_rows``) names that layer's rows from there."""
    return layer * 2 * num_kv_heads * page_size


def one_copy(parts, device) -> list:
    """The int64 host arrays ``parts`` (None entries kept) as tensors on ``device``: views of
    one host-to-device copy (staged by the driver before it returns; no wait for the GPU)."""
    flat = [p for p in parts if p is not None]
    host = np.concatenate(flat).astype(np.int64, copy=False) if flat else np.zeros(0, np.int64)
    dev = torch.from_numpy(host).to(device, non_blocking=True)
    views, at = [], 0
    for p in parts:
        if p is None:
            views.append(None)
            continue
        views.append(dev[at:at + len(p)])
        at += len(p)
    return views


@dataclass(frozen=True)
class StoreIndex:
    """Where a store writes a batch of tokens' K/V rows, as rows of the pools (``pool_rows``):
    numpy arrays on the host, tensors on a device after ``to``.

    host_rows:  int64 (m * Hkv * 2,) the host pool's rows, for each stored token its K and V of
                every KV head (of each layer stored, for an index of several layers).
    tokens:     int64 (m,) the token rows they come from; None: tokens 0..m-1 (dense).
    hbm_rows:   int64 (k * Hkv * 2,) the HBM pool's rows of the tokens whose pages have a copy
                there (HBM pages, mirrors).
    hbm_tokens: int64 (k,) their token rows.
    span:       the stored token rows all lie below it.
    extents:    (host rows, HBM rows) the pools must have: one past the largest row of each,
                known on the host where the index was made there; None: not known on the host
                (an index made on the device, ``vllm.step.GraphDecode``'s).
    counted:    float32 (m,) on the device, for the rows of ``tokens`` (the same as ``hbm_tokens``
                in the indexes that have it): 1 where a token is named for the first time and 0
                where a fixed-size store names it again (its padding writes a stored token's
                rows once more: harmless for the pools, not for sums of them); None: each once.
    """

    host_rows: object
    tokens: object
    hbm_rows: object
    hbm_tokens: object
    span: int
    extents: tuple | None = None
    counted: object = None

    @classmethod
    def build(cls, host, hbm, span: int, num_kv_heads: int, page_size: int) -> "StoreIndex":
        """The index on the host of destinations ``host`` and ``hbm`` in one-layer pools, each
        (tokens, pages, offsets) int64 numpy arrays (the host's tokens None: 0..m-1, dense)."""
        rows = [pool_rows(pages, offsets, num_kv_heads, page_size) for _, pages, offsets in (host, hbm)]
        extents = tuple(int(r.max()) + 1 if r.size else 0 for r in rows)
        return cls(rows[0], host[0], rows[1], np.asarray(hbm[0], dtype=np.int64), int(span), extents)

    @property
    def num_mirrored(self) -> int:
        """k: the stored rows that also go to the HBM pool."""
        return len(self.hbm_tokens)

    def to(self, device) -> "StoreIndex":
        """The same index as tensors on ``device``, from one host-to-device copy."""
        views = one_copy([self.host_rows, self.tokens, self.hbm_rows, self.hbm_tokens], device)
        return StoreIndex(*views, self.span, self.extents)


def _copy_rows(pool: torch.Tensor, start: int, rows: torch.Tensor, values: torch.Tensor) -> None:
    """``values`` into rows ``start + rows`` of ``pool`` viewed as rows of its last dimension
    (a scale pool: as single values)."""
    flat = pool.view(-1, pool.shape[-1]) if values.dim() > 1 else pool.view(-1)
    if start:
        flat = flat[start:]
    flat.index_copy_(0, rows, values)


def _store_pool(pool, scales_pool, start: int, rows, tokens, k, v, k_scales, v_scales) -> None:
    """K and V of ``tokens`` (None: all, in order) into their rows of one pool (and scales)."""
    krows = rows.view(-1, 2)[:, 0]  # (m * Hkv,): each token's K rows; its V rows follow P rows on
    page_size = pool.shape[-2]
    d = k.shape[-1]
    for at, data, scale in ((start, k, k_scales), (start + page_size, v, v_scales)):
        picked = data if tokens is None else data.index_select(0, tokens)
        _copy_rows(pool, at, krows, picked.reshape(-1, d))
        if scale is not None:
            picked = scale if tokens is None else scale.index_select(0, tokens)
            _copy_rows(scales_pool, at, krows, picked.reshape(-1))


def store_rows(index: StoreIndex, k: torch.Tensor, v: torch.Tensor, host: torch.Tensor,
               hbm: torch.Tensor | None = None, *, start: int = 0, k_scales: torch.Tensor | None = None,
               v_scales: torch.Tensor | None = None, host_scales: torch.Tensor | None = None,
               hbm_scales: torch.Tensor | None = None) -> None:
    """Copy K and V (``(span, [L,] Hkv, d)`` in the pools' dtype) into their rows ``start +
    index.host_rows`` of ``host`` and, the mirrored tokens', ``start + index.hbm_rows`` of ``hbm``
    (contiguous pools; ``start``: ``layer_start``). FP8 pages: ``k_scales`` / ``v_scales``
    ``(span, [L,] Hkv)`` into the same rows of ``host_scales`` / ``hbm_scales``. Per pool one
    gather of the stored tokens (none for a dense index) and one indexed copy each of K and V, on
    the current stream."""
    if len(index.host_rows):
        _store_pool(host, host_scales, start, index.host_rows, index.tokens, k, v, k_scales, v_scales)
    if index.num_mirrored:
        _store_pool(hbm, hbm_scales, start, index.hbm_rows, index.hbm_tokens, k, v, k_scales, v_scales)


def token_slots(total: int, parts, page_size: int) -> np.ndarray | None:
    """``kv_project``'s slots of one pool (``page * P + row``, -1 for a token the pool does not
    take) of ``total`` tokens from destinations ``parts``, each (tokens, pages, offsets) int64
    numpy arrays naming disjoint tokens; None when no token goes there."""
    if not any(len(t) for t, _, _ in parts):
        return None
    out = np.full(total, -1, dtype=np.int64)
    for tokens, pages, offsets in parts:
        out[tokens] = pages * page_size + offsets
    return out
