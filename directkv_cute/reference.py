"""Reference attention in plain torch, for tests and for the CPU path of the op.

``paged_attention_ref`` gathers K/V through the cache's kernel page tables (decoding the int32
entry encoding itself, so it checks the contract the kernels rely on) and computes attention in
float32. ``dense_attention_ref`` works on unpaged per-sequence K/V in float64 by default, through
a separate formulation (grouped heads, explicit masked exponentials), so that the two are
independent checks of one another and of the kernels.

Semantics (docs/ARCHITECTURE.md, "Interfaces between the modules"): q is packed by sequence, ``q_lens[i]`` rows each; query row j of a
sequence of length L sits at position ``L - q_len + j`` and sees keys ``[0, L - q_len + j]``.
Query head h uses KV head ``h // (Hq // Hkv)``. LSE is the natural log of the sum of
``exp(scale * q . k)`` over the visible keys.

FP8 pages (``directkv_cute.fp8``) are dequantized with their per-token scales to float32 before
the float32 attention: the reference reads what the cache stored, not what was written.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from directkv_cute.cache import PagedKVCache
from directkv_cute.fp8 import dequantize, is_fp8

_SCORES_PER_CHUNK = 1 << 26  # scores per query chunk of the references (256 MB in float32)


def _check_q_lens(q_lens: Sequence[int] | None, batch: int, total_q: int, seq_lens: Sequence[int]) -> list[int]:
    """Validate q_lens (default: one query row per sequence) against q and the sequence lengths."""
    q_lens = [1] * batch if q_lens is None else [int(n) for n in q_lens]
    if len(q_lens) != batch:
        raise ValueError(f"q_lens has {len(q_lens)} entries for {batch} sequences")
    if sum(q_lens) != total_q:
        raise ValueError(f"q has {total_q} rows but q_lens sums to {sum(q_lens)}")
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        if not 1 <= q_len <= seq_len:
            raise ValueError(f"q_lens[{i}] = {q_len} must be in [1, seq_len = {seq_len}]")
    return q_lens


def _check_heads(num_q_heads: int, num_kv_heads: int) -> int:
    """GQA group size Hq // Hkv."""
    if num_q_heads % num_kv_heads:
        raise ValueError(f"Hq = {num_q_heads} is not a multiple of Hkv = {num_kv_heads}")
    return num_q_heads // num_kv_heads


def paged_attention_ref(
    q: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    seq_ids: Sequence[int],
    q_lens: Sequence[int] | None = None,
    softmax_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of packed queries over paged K/V of one layer (float32 accumulation).

    q: (total_q, Hq, d), the cache's dtype, on any device; K/V are gathered to q's device.
    Returns out (total_q, Hq, d) in q's dtype and lse float32 (total_q, Hq).
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be a 3-D tensor (total_q, Hq, head_dim), got {getattr(q, 'shape', q)!r}")
    compute = getattr(cache, "compute_dtype", cache.dtype)
    if q.dtype != compute:
        raise TypeError(f"q has dtype {q.dtype}, the cache holds {compute}")
    total_q, num_q_heads, head_dim = q.shape
    if head_dim != cache.head_dim:
        raise ValueError(f"q has head_dim {head_dim}, the cache has {cache.head_dim}")
    if not 0 <= layer < cache.num_layers:
        raise IndexError(f"layer {layer} out of range for a cache of {cache.num_layers} layers")
    _check_heads(num_q_heads, cache.num_kv_heads)
    tables = cache.kernel_tables(seq_ids)
    return tables_attention_ref(q, cache.device_pool("host"), cache.device_pool("hbm"), tables.page_table,
                                tables.seq_lens, layer, q_lens, softmax_scale, **cache_scales(cache))


def cache_scales(cache) -> dict:
    """``host_scales`` / ``hbm_scales`` keywords of ``tables_attention_ref`` for a cache (empty for
    bf16/fp16 pages)."""
    if not getattr(cache, "fp8", False):
        return {}
    return {"host_scales": cache.device_scales("host"), "hbm_scales": cache.device_scales("hbm")}


def tables_attention_ref(
    q: torch.Tensor,
    host_pool: torch.Tensor,
    hbm_pool: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    layer: int,
    q_lens: Sequence[int] | None = None,
    softmax_scale: float | None = None,
    host_scales: torch.Tensor | None = None,
    hbm_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``paged_attention_ref`` on the raw pieces the kernels see: the two page pools
    (num_pages, L, Hkv, 2, page_size, d), an encoded int32 page table (B, max_pages) and the
    sequence lengths (B,). Used by the CPU path of the ``directkv_cute::paged_attention`` op.
    FP8 pools need their scale pools (num_pages, L, Hkv, 2, page_size) float32 (``cache_scales``)."""
    total_q, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = host_pool.shape[2], host_pool.shape[4]
    group = _check_heads(num_q_heads, num_kv_heads)
    page_table = page_table.cpu()  # int32 (B, max_pages)
    seq_lens = seq_lens.tolist()
    q_lens = _check_q_lens(q_lens, len(seq_lens), total_q, seq_lens)
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    fp8 = is_fp8(host_pool.dtype)
    if fp8 and (host_scales is None or hbm_scales is None):
        raise ValueError(f"{host_pool.dtype} pages need their scale pools (host_scales, hbm_scales)")
    if fp8 != is_fp8(hbm_pool.dtype):
        raise TypeError(f"host pool {host_pool.dtype} and HBM pool {hbm_pool.dtype} differ")

    out = torch.empty_like(q)  # (total_q, Hq, d)
    lse = torch.empty((total_q, num_q_heads), dtype=torch.float32, device=q.device)
    row = 0
    for b, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens)):
        # Gather the sequence's pages, then its first seq_len tokens: (seq_len, Hkv, d) each.
        entries = page_table[b, : -(-seq_len // page_size)].long()  # (n_pages,)
        in_hbm = entries < 0
        # pages: (n_pages, Hkv, 2, page_size, d), this layer only.
        at_hbm = in_hbm.to(q.device)
        if fp8:  # dequantized: float32 (n_pages, Hkv, 2, page_size, d)
            pages = torch.empty((len(entries), *host_pool.shape[2:]), dtype=torch.float32, device=q.device)
            for sel, pool, scales, idx in ((~at_hbm, host_pool, host_scales, entries[~in_hbm]),
                                           (at_hbm, hbm_pool, hbm_scales, -entries[in_hbm] - 1)):
                idx = idx.to(pool.device)
                raw = pool.view(torch.uint8)[idx, layer].view(pool.dtype)  # (n, Hkv, 2, page_size, d)
                pages[sel] = dequantize(raw, scales[idx.to(scales.device), layer].to(pool.device),
                                        torch.float32).to(q.device)
        else:
            pages = torch.empty((len(entries), *host_pool.shape[2:]), dtype=q.dtype, device=q.device)
            pages[~at_hbm] = host_pool[entries[~in_hbm].to(host_pool.device), layer].to(q.device)
            pages[at_hbm] = hbm_pool[(-entries[in_hbm] - 1).to(hbm_pool.device), layer].to(q.device)
        # -> (2, n_pages * page_size, Hkv, d)
        kv = pages.permute(2, 0, 3, 1, 4).reshape(2, -1, num_kv_heads, head_dim)
        k = kv[0, :seq_len].float()  # (seq_len, Hkv, d)
        v = kv[1, :seq_len].float()  # (seq_len, Hkv, d)
        key_pos = torch.arange(seq_len, device=q.device)  # (seq_len,)
        # Query rows in chunks, so that the scores stay within ~256 MB at long contexts.
        chunk = max(1, _SCORES_PER_CHUNK // (num_q_heads * seq_len))
        for j0 in range(0, q_len, chunk):
            j1 = min(q_len, j0 + chunk)
            # Head h = kv * group + g, so viewing Hq as (Hkv, group) maps h to KV head h // group.
            qc = q[row + j0 : row + j1].float().view(j1 - j0, num_kv_heads, group, head_dim)
            scores = torch.einsum("qhgd,khd->hgqk", qc, k) * scale  # (Hkv, group, rows, seq_len)
            query_pos = torch.arange(seq_len - q_len + j0, seq_len - q_len + j1, device=q.device)  # (rows,)
            scores = scores.masked_fill(key_pos[None, :] > query_pos[:, None], float("-inf"))
            lse_c = torch.logsumexp(scores, dim=-1)  # (Hkv, group, rows)
            probs = torch.softmax(scores, dim=-1)  # (Hkv, group, rows, seq_len)
            out_c = torch.einsum("hgqk,khd->qhgd", probs, v)  # (rows, Hkv, group, d)
            out[row + j0 : row + j1] = out_c.reshape(j1 - j0, num_q_heads, head_dim).to(q.dtype)
            lse[row + j0 : row + j1] = lse_c.permute(2, 0, 1).reshape(j1 - j0, num_q_heads)
        row += q_len
    return out, lse


def dense_attention_ref(
    q: torch.Tensor,
    k_list: Sequence[torch.Tensor],
    v_list: Sequence[torch.Tensor],
    q_lens: Sequence[int] | None,
    scale: float | None,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over unpaged per-sequence K/V, computed in ``dtype``.

    q: (total_q, Hq, d) packed by sequence; k_list[i], v_list[i]: (L_i, Hkv, d).
    q_lens: rows of q per sequence (None: one each); scale: None for 1/sqrt(d).
    Returns out (total_q, Hq, d) and lse (total_q, Hq), both in ``dtype``.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be (total_q, Hq, head_dim), got shape {tuple(q.shape)}")
    if len(k_list) == 0 or len(k_list) != len(v_list):
        raise ValueError(f"need one K and one V tensor per sequence, got {len(k_list)} and {len(v_list)}")
    total_q, num_q_heads, head_dim = q.shape
    for i, (k, v) in enumerate(zip(k_list, v_list)):
        if k.dim() != 3 or k.shape != v.shape or k.shape[2] != head_dim:
            raise ValueError(
                f"sequence {i}: k {tuple(k.shape)} and v {tuple(v.shape)} must both be (L, Hkv, {head_dim})"
            )
        if k.dtype != q.dtype or v.dtype != q.dtype:
            raise TypeError(f"sequence {i}: k/v dtypes {k.dtype}/{v.dtype} differ from q's {q.dtype}")
        if k.shape[1] != k_list[0].shape[1]:
            raise ValueError(f"sequence {i} has {k.shape[1]} KV heads, sequence 0 has {k_list[0].shape[1]}")
    num_kv_heads = k_list[0].shape[1]
    group = _check_heads(num_q_heads, num_kv_heads)
    q_lens = _check_q_lens(q_lens, len(k_list), total_q, [k.shape[0] for k in k_list])
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)

    out = torch.empty((total_q, num_q_heads, head_dim), dtype=dtype, device=q.device)
    lse = torch.empty((total_q, num_q_heads), dtype=dtype, device=q.device)
    row = 0
    for k, v, q_len in zip(k_list, v_list, q_lens):
        seq_len = k.shape[0]
        kt = k.to(dtype).permute(1, 2, 0)  # (Hkv, d, seq_len)
        vh = v.to(dtype).permute(1, 0, 2)  # (Hkv, seq_len, d)
        # Query rows in blocks of at most _SCORES_PER_CHUNK scores (Hkv, group * rows, seq_len).
        step = max(1, _SCORES_PER_CHUNK // max(1, num_q_heads * seq_len))
        for a in range(0, q_len, step):
            b = min(q_len, a + step)
            n = b - a
            # Query heads grouped by their KV head: (Hkv, group * n, d), row = g * n + i.
            qg = q[row + a: row + b].to(dtype).reshape(n, num_kv_heads, group, head_dim)
            qg = qg.permute(1, 2, 0, 3).reshape(num_kv_heads, group * n, head_dim)
            s = torch.bmm(qg, kt) * scale  # (Hkv, group * n, seq_len)
            # Query j of the sequence sees keys up to seq_len - q_len + j.
            last_key = (seq_len - q_len + torch.arange(a, b, device=q.device)).repeat(group)  # (group * n,)
            visible = torch.arange(seq_len, device=q.device)[None, :] <= last_key[:, None]  # (group * n, seq_len)
            m = torch.where(visible, s, torch.full_like(s, -math.inf)).amax(dim=-1, keepdim=True)
            e = torch.where(visible, torch.exp(s - m), torch.zeros_like(s))  # (Hkv, group * n, seq_len)
            denom = e.sum(dim=-1, keepdim=True)  # (Hkv, group * n, 1)
            o = torch.bmm(e, vh) / denom  # (Hkv, group * n, d)
            o = o.reshape(num_kv_heads, group, n, head_dim).permute(2, 0, 1, 3)  # (n, Hkv, group, d)
            out[row + a: row + b] = o.reshape(n, num_q_heads, head_dim)
            lse_g = (m + torch.log(denom)).reshape(num_kv_heads, group, n)  # (Hkv, group, n)
            lse[row + a: row + b] = lse_g.permute(2, 0, 1).reshape(n, num_q_heads)
        row += q_len
    return out, lse
