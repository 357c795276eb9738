"""The torch-facing attention op over the paged host KV cache.

``paged_attention`` validates its inputs, picks a config (explicit, tuned profile, or the
heuristic default) and a kernel -- the streaming split-KV kernel when all query rows of a KV head
fit one CTA (decode, short speculative windows), else the multi-token KV-outer chunk kernel
(multi-token queries), or for compute-bound multi-token calls the Q-tiled kernel -- and launches it
and, when the context is split across CTAs, the combine kernel, on the current CUDA stream (the
kernels' specs, ``kernels.specs``, state which runs what). The streaming and multi-token kernels
read host pages in place through their UVA addresses; the Q-tiled kernel
reads HBM, so over host pages the op first stages them into an HBM buffer with the copy engine,
overlapped with the kernel (``_q_tiled_route`` decides, ``directkv_cute.staging`` copies).
Once a shape's kernels are compiled and its ``q_lens`` seen (their device copy is kept), the
in-place paths only allocate their fp32 split workspace from torch's caching allocator, so they
can be captured in a CUDA graph (the captured graph pins the pools' base addresses, which never
move); the staged path is not taken inside a capture.

On a CPU-only machine the same call runs the float32 reference. FP8 pages (``directkv_cute.fp8``)
run there too; on a GPU the streaming kernel reads them in place (``kernels/decode_fp8.py``), or
for long link-bound reads after the copy engine moved their bytes and scales into HBM, and
multi-token calls dequantize the pages they read into an HBM buffer (``_launch_fp8``): group by
group of KV heads as their copy lands, each group's attention running under the next group's copy,
where the Q-tiled kernel runs them (``_fp8_by_head``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
import os
import threading
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from directkv_cute.cache import page_bytes as layer_page_bytes
from directkv_cute.config import DecodeConfig, QTiledConfig, multi_token_splits, q_tiles
from directkv_cute.kernels.trace import current_trace
from directkv_cute.plan import (LINK_PIECES, SPLIT_CHOICES, causal_flops, choose_pipelined, choose_staged,
                                compute_bound, kv_bytes, link_bound_staging, may_stage, partial_bytes, q_tile_profile,
                                q_tiled_splits, ready_split, split_work, trails_copy, window_piece_pages)
from directkv_cute.staging import HEAD_PIECES, MAX_FLAGS, MAX_PIECES, copies_ahead, hbm_in_place, head_groups, \
    in_place_layers, may_copy_ahead, piece_pages_for, plan_staging, stager, staging_cap
from directkv_cute import staging as _staging
from directkv_cute.kernels.specs import config_kernel, op_kernel
from directkv_cute.fp8 import is_fp8
from directkv_cute.validate import check_attention, check_config, check_seq_ids



def _cu_seqlens(q_lens: tuple[int, ...], device) -> tuple[torch.Tensor, int]:
    """(cu_q int32 (B + 1,) on device, max_q_len) from validated per-sequence query lengths."""
    key = (q_lens, str(device))
    cu_q = _CU_Q.get(key)
    if cu_q is None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            # A copy from pageable host memory cannot be captured, and a tensor allocated inside
            # the capture would belong to the graph's private pool.
            raise RuntimeError(
                f"paged_attention: q_lens {list(q_lens[:8])}{'...' if len(q_lens) > 8 else ''} first seen inside "
                "CUDA graph capture; call once outside capture with the same q_lens first (their device copy is kept)")
        cu_q = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32).to(device, non_blocking=True)
        if len(_CU_Q) < _CU_Q_CAP:
            _CU_Q[key] = cu_q
    return cu_q, max(q_lens)


# Device copies of the query offsets per distinct q_lens (decode: one per batch size): a repeated
# shape (a fixed chunk size, a speculative window, a decode batch) skips the per-call
# host-to-device copy, and a captured CUDA graph keeps reading a live tensor. Entries are never
# evicted (a graph may hold one); past the cap, new q_lens are copied per call (and cannot be
# captured).
_CU_Q: dict = {}
_CU_Q_CAP = 4096


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _total_memory(index: int) -> int:
    return torch.cuda.get_device_properties(index).total_memory


# Workspace cap for the multi-token kernel's fp32 partials (bytes); 0 = a quarter of the GPU.
_WORKSPACE_ENV = "DIRECTKV_MAX_WORKSPACE_GB"


def select_config(cache, group: int, max_q_len: int, batch: int, max_context: int,
                  config: DecodeConfig | None) -> tuple[DecodeConfig, str]:
    """(config, kernel): an explicit config wins, else the tuned profile for this GPU, else the
    heuristic default. kernel is "decode" (streaming) when every query row of a KV head fits one
    CTA, else "multi_token" (the KV-outer chunk kernel); an explicit config with a multi-token-only
    option (``q_regs``, ``q_cluster``, ``stagger``) always runs the multi-token kernel. The kernels'
    specs state both rules (``kernels.specs.config_kernel``, ``op_kernel``)."""
    rows = group * max_q_len
    if config is not None:
        return config, config_kernel(config, group, max_q_len)
    kernel = op_kernel(group, max_q_len)
    return _lookup(kernel, cache, group, batch, max_context, max_q_len, rows), kernel


@functools.lru_cache(maxsize=None)
def _gpu_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def _lookup(kernel: str, cache, group: int, batch: int, context: int, q_len: int, rows: int) -> DecodeConfig:
    """The tuned profile entry for this GPU (exact, else nearest bucket), else the default."""
    return _profile_config(kernel, _gpu_name(torch.cuda.current_device()), cache, group, batch, context, q_len,
                           rows)[0]


def _profile_config(kernel: str, gpu_name: str, cache, group: int, batch: int, context: int, q_len: int, rows: int,
                    quiet_miss: bool = False):
    """(config, source) of the profile lookup: source "exact", "nearest" or "default".
    ``quiet_miss``: no warning for a missing entry (the caller falls back to another kernel's)."""
    from directkv_cute.tuning.lookup import select_config as lookup_profile
    from directkv_cute.tuning.profiles import ProfileWarning, current_kernel_hash

    def look():
        return lookup_profile(
            kernel, gpu_name=gpu_name, kernel_hash=current_kernel_hash(kernel),
            dtype=getattr(cache, "compute_dtype", None) or cache.dtype, head_dim=cache.head_dim, group=group,
            page_size=cache.page_size, batch=batch, context=context, q_len=q_len, rows=rows,
        )

    if not quiet_miss:
        return look()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=f"directkv-cute: no tuned {kernel} config", category=ProfileWarning)
        return look()


def fp8_decode_config(gpu_name: str, cache, group: int, batch: int, context: int, q_len: int) -> DecodeConfig:
    """The config of a decode-sized call over FP8 pages: the profile's decode_fp8 entry, else
    (silently) the decode entry for 16-bit pages adapted to FP8 stages (``fp8.decode_config``),
    which warns as the decode lookup does where that is missing too. Plain host work."""
    from directkv_cute.fp8 import decode_config

    rows = group * q_len
    cfg, source = _profile_config("decode_fp8", gpu_name, cache, group, batch, context, q_len, rows, quiet_miss=True)
    if source == "default":
        cfg = decode_config(_profile_config("decode", gpu_name, cache, group, batch, context, q_len, rows)[0],
                            cache.head_dim, cache.page_size)
    return cfg


@functools.lru_cache(maxsize=1024)
def _compiled(cfg: DecodeConfig, dtype, head_dim, page_size, group, max_q_len, split_out, multi_token, trace=None):
    """The compiled kernel for a launch (jit's cache keys on the target arch too; this memo keeps
    that key's construction off the per-call path). ``trace``: ``kernels.trace.tracing``'s, for
    the multi-token kernel (bench timeline)."""
    from directkv_cute.kernels.jit import compile_decode

    return compile_decode(cfg, dtype, head_dim, page_size, group, max_q_len, split_out=split_out,
                          multi_token=multi_token, trace=trace)


@functools.lru_cache(maxsize=64)
def _compiled_combine(head_dim, dtype):
    from directkv_cute.kernels.jit import compile_combine

    return compile_combine(head_dim, dtype)


def paged_attention(q: torch.Tensor, cache, layer: int, seq_ids: Sequence[int], q_lens=None,
                    softmax_scale: float | None = None, *, config: DecodeConfig | None = None,
                    out: torch.Tensor | None = None, return_lse: bool = False):
    """Attention of new query tokens over their sequences' whole cached history.

    q: (total_q, Hq, d), packed by sequence (``q_lens[i]`` rows for ``seq_ids[i]``, default 1).
    The new tokens' K/V must already be in the cache; query j of a sequence of length L and
    q_len Q sits at position L - Q + j and attends causally to keys [0, L - Q + j].
    Returns out (total_q, Hq, d) in q's dtype, and the natural-log LSE (total_q, Hq) fp32 when
    ``return_lse``.
    """
    seq_ids = check_seq_ids(seq_ids)
    lengths = [cache.seq_len(s) for s in seq_ids]  # unknown ids raise here
    layer, q_lens = check_attention(q, cache, layer, batch=len(seq_ids), q_lens=q_lens, out=out, config=config,
                                    softmax_scale=softmax_scale, seq_lens=lengths, cuda=q.is_cuda)
    if not q.is_cuda:
        from directkv_cute.reference import paged_attention_ref

        o, lse = paged_attention_ref(q, cache, layer, seq_ids, q_lens, softmax_scale)
        if out is not None:
            out.copy_(o)
            o = out
        return (o, lse) if return_lse else o
    return _launch(q, cache, layer, cache.kernel_tables(seq_ids), q_lens, softmax_scale, config, out, return_lse,
                   max(lengths))


def paged_attention_tables(q: torch.Tensor, cache, layer: int, tables, q_lens=None,
                           softmax_scale: float | None = None, *, config: DecodeConfig | None = None,
                           out: torch.Tensor | None = None, return_lse: bool = False,
                           max_seq_len: int | None = None):
    """``paged_attention`` with page tables built once (``cache.kernel_tables``) and reused,
    e.g. across the layers of one step or inside a CUDA graph. ``max_seq_len`` (the longest
    sequence, if the caller knows it) only steers the decode split count and the profile bucket;
    without it the page table's width stands in."""
    page_table, seq_lens = tables.page_table, tables.seq_lens
    # ---- validation (before anything is written; messages are only built on failure) -------
    check_tables = getattr(cache, "check_tables", None)
    if check_tables is not None and getattr(tables, "cache_id", 0):
        check_tables(tables)  # from this cache, and no page freed or moved since (two int compares)
    if not (isinstance(page_table, torch.Tensor) and isinstance(seq_lens, torch.Tensor)):
        raise TypeError("tables must be KernelTables from cache.kernel_tables()")
    layer, q_lens = check_attention(q, cache, layer, batch=page_table.shape[0] if page_table.dim() == 2 else -1,
                                    q_lens=q_lens, out=out, config=config, softmax_scale=softmax_scale,
                                    seq_lens=getattr(tables, "host_seq_lens", None), cuda=True)
    if not (page_table.is_cuda and page_table.dtype == torch.int32 and page_table.dim() == 2):
        raise ValueError("tables.page_table must be a (B, max_pages) int32 CUDA tensor")
    if not (seq_lens.is_cuda and seq_lens.dtype == torch.int32):
        raise ValueError("tables.seq_lens must be an int32 CUDA tensor")
    if page_table.device != q.device:
        raise ValueError(f"tables on {page_table.device}, q on {q.device}")
    batch, max_pages = page_table.shape
    if batch < 1 or seq_lens.shape != (batch,):
        raise ValueError("seq_lens must have one entry per page-table row")
    return _launch(q, cache, layer, tables, q_lens, softmax_scale, config, out, return_lse, max_seq_len)


def _launch(q, cache, layer: int, tables, q_lens: tuple[int, ...], softmax_scale, config, out, return_lse: bool,
            max_seq_len: int | None):
    """Pick the kernel and config and launch, on validated arguments."""
    hq = q.shape[1]
    batch, max_pages = tables.page_table.shape
    group = hq // cache.num_kv_heads
    cu_q, max_q_len = _cu_seqlens(q_lens, q.device)
    if max_seq_len is None:
        max_seq_len = max_pages * cache.page_size
    if is_fp8(cache.dtype):
        return _launch_fp8(q, cache, layer, tables, q_lens, cu_q, max_q_len, softmax_scale, config, out, return_lse,
                           max_seq_len)

    if isinstance(config, QTiledConfig) or config is None:
        route = _q_tiled_route(q, cache, tables, q_lens, group, config)
        if route is not None:
            if config is None and route[1] is not None:
                # A capture of this call reads in place (staging is refused there): compile that
                # kernel and allocate its counters now, outside any capture.
                try:
                    _in_place(q, cache, group, max_q_len, batch, max_pages, max_seq_len, None)
                except ValueError:
                    pass  # the in-place kernel cannot run this shape at all (workspace cap)
            return _launch_q_tiled(q, cache, layer, tables, q_lens, cu_q, max_q_len, softmax_scale, out, return_lse,
                                   *route)

    _, multi_token, splits, fn, counters = _in_place(q, cache, group, max_q_len, batch, max_pages, max_seq_len, config)
    return _run_paged(fn, q, cache, layer, tables, cu_q, splits, splits > 1 or multi_token, softmax_scale, counters,
                      out, return_lse)


def _run_paged(fn, q, cache, layer: int, tables, cu_q, splits: int, partials: bool, softmax_scale, counters, out,
               return_lse: bool, parts=None):
    """Launch a compiled kernel over the pages in place: straight into ``out`` and the LSE, or
    (``partials``) into fp32 split partials merged by the combine kernel. ``parts``: instead of
    ``tables`` / ``splits``, several launches over disjoint keys of the same queries, (page_table,
    seq_lens, splits, event to wait for or None) each, their partials merged together."""
    from directkv_cute.kernels.launch import launch_combine, launch_decode

    total_q, hq, d = q.shape
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    if parts is None:
        parts = [(tables.page_table, tables.seq_lens, splits, None)]
    if out is None:
        out = torch.empty_like(q)
    lse = torch.empty(total_q, hq, dtype=torch.float32, device=q.device)
    if not partials:
        launch_decode(fn, q, out, lse, cache, layer, tables.page_table, tables.seq_lens, cu_q, 1, scale, counters)
        return (out, lse) if return_lse else out
    total = sum(part[2] for part in parts)
    o_part = torch.empty(total, total_q, hq, d, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(total, total_q, hq, dtype=torch.float32, device=q.device)
    first = 0
    for page_table, seq_lens, n_splits, event in parts:
        if event is not None:
            torch.cuda.current_stream(q.device).wait_event(event)
        launch_decode(fn, q, o_part[first:first + n_splits], lse_part[first:first + n_splits], cache, layer,
                      page_table, seq_lens, cu_q, n_splits, scale, counters)
        first += n_splits
    launch_combine(_compiled_combine(d, q.dtype), o_part, lse_part, out, lse, total)
    return (out, lse) if return_lse else out


def _launch_fp8(q, cache, layer: int, tables, q_lens, cu_q, max_q_len: int, softmax_scale, config, out,
                return_lse: bool, max_seq_len: int):
    """FP8 pages: the streaming kernel over them in place (decode, short windows: every query row of
    a KV head in one CTA), else the call's pages dequantized once into an HBM buffer in the q dtype
    and the 16-bit kernels over it (``_dequantized``)."""
    _, hq, d = q.shape
    batch = tables.page_table.shape[0]
    group = hq // cache.num_kv_heads
    explicit = isinstance(config, DecodeConfig)
    kernel = config_kernel(config, group, max_q_len) if explicit else op_kernel(group, max_q_len)
    if isinstance(config, QTiledConfig) or kernel != "decode":
        return _dequantized(q, cache, layer, tables, q_lens, softmax_scale, config, out, return_lse, max_seq_len)
    from directkv_cute.kernels.launch import link_counters

    if explicit:
        cfg = config  # compile_decode_fp8 raises if the FP8 kernel cannot run it
    else:
        cfg = fp8_decode_config(_gpu_name(torch.cuda.current_device()), cache, group, batch, max_seq_len, max_q_len)
    splits = cfg.splits_for(batch, cache.num_kv_heads, max_seq_len, _num_sms(q.device.index))
    counters = link_counters(q.device)
    fn = _compiled_fp8(cfg, q.dtype, cache.dtype, d, cache.page_size, group, max_q_len, splits > 1)
    plan = None if explicit else _fp8_stage_plan(q, cache, tables, q_lens)
    if plan is None:
        return _run_paged(fn, q, cache, layer, tables, cu_q, splits, splits > 1, softmax_scale, counters, out,
                          return_lse)
    # Long link-bound reads: the copy engine moves the FP8 pages and their scales into HBM at its
    # rate (faster than the SMs' reads of host memory, as for 16-bit pages), then the same kernel
    # reads them there: in one launch after the whole copy, or (one query token per sequence) in
    # two, the first over the first piece while the copy engine moves the second.
    cur = torch.cuda.current_stream(q.device)
    st = stager(q.device, cur)
    with st.lock:
        raw, scales, landed = st.stage_fp8(cache, layer, plan)  # (pages, 1, Hkv, 2, P, d) FP8; their scales
        view = _PoolView(raw, raw, q.dtype, scales, scales)
        if len(plan.pieces) == 1:
            cur.wait_event(landed[0])
            res = _run_paged(fn, q, view, 0, _staged_tables(plan, tables, tables.host_seq_lens, q.device), cu_q,
                             splits, splits > 1, softmax_scale, counters, out, return_lse)
        else:
            fn = _compiled_fp8(cfg, q.dtype, cache.dtype, d, cache.page_size, group, max_q_len, True)
            res = _run_fp8_parts(fn, cfg, q, view, plan, tables.host_seq_lens, cu_q, landed, softmax_scale,
                                 counters, out, return_lse)
        st.finish()
        return res


# The second piece of a staged FP8 decode: this share of the longest sequence's pages. The first
# launch reads the rest from HBM while the copy engine moves it (measured 2026-12-02, B1 32k: the
# FP8 kernel reads the staged pages at 1.25 TB/s, 55 us after a 1.25 ms copy), so it hides behind
# that copy while the share is above about 4.4%; what stays exposed is the second launch.
FP8_TAIL_SHARE = 1 / 16


def split_staged_table(table: np.ndarray, lens, pages_a: int, page_size: int):
    """The two launches of a two-piece staged decode: ((table, lengths) of every sequence's first
    ``pages_a`` pages, (table, lengths) of the rest), each part a sequence of its own (a part
    can be empty: length 0, no tiles). Plain host work."""
    lens = np.asarray(lens, dtype=np.int64)
    len_a = np.minimum(lens, pages_a * page_size)
    return ((np.ascontiguousarray(table[:, :pages_a]), len_a.astype(np.int32)),
            (np.ascontiguousarray(table[:, pages_a:]), (lens - len_a).astype(np.int32)))


def _run_fp8_parts(fn, cfg: DecodeConfig, q, view, plan, lens, cu_q, landed, softmax_scale, counters, out,
                   return_lse: bool):
    """Decode (one query token per sequence) over a two-piece staging of FP8 pages: the kernel
    over each sequence's first piece once it has landed, over the rest once that has, each into
    its own fp32 split partials, merged by the combine kernel (a query sees every key of both
    parts, so the two are independent attentions over disjoint keys)."""
    batch = len(lens)
    host_parts = split_staged_table(plan.table, lens, plan.piece_pages, view.page_size)
    flat = torch.from_numpy(np.concatenate([a.ravel() for part in host_parts for a in part])).to(q.device,
                                                                                             non_blocking=True)
    sms = _num_sms(q.device.index)
    parts, at = [], 0
    for (table, part_lens), event in zip(host_parts, landed):
        dev_table = flat[at:at + table.size].view(table.shape)
        dev_lens = flat[at + table.size:at + table.size + batch]
        at += table.size + batch
        parts.append((dev_table, dev_lens, cfg.splits_for(batch, view.num_kv_heads, max(int(part_lens.max()), 1), sms),
                      event))
    return _run_paged(fn, q, view, 0, None, cu_q, 0, True, softmax_scale, counters, out, return_lse, parts)


def _pages_used(host_table, lens, page_size: int):
    """(pages per sequence, the table entries the call reads, how many of them are host pages)."""
    n_pages = [math.ceil(n / page_size) for n in lens]
    used = np.concatenate([host_table[b, :n] for b, n in enumerate(n_pages)])
    return n_pages, used, int((used >= 0).sum())


def hbm_runs_per_sequence(host_table, n_pages) -> int:
    """The most runs of consecutive HBM entries (negative) in any sequence's first ``n_pages[b]``
    table entries: 1 for a window of HBM pages (a step's own tokens mirrored). Plain host work."""
    table = np.asarray(host_table)
    live = np.arange(table.shape[1])[None, :] < np.asarray(n_pages)[:, None]
    hbm = (table < 0) & live
    starts = hbm & ~np.concatenate([np.zeros((len(table), 1), dtype=bool), hbm[:, :-1]], axis=1)
    return int(starts.sum(axis=1).max()) if len(table) else 0


def ready_page(host_table, n_pages) -> int:
    """The first logical page from which every sequence's pages (its first ``n_pages[b]`` table
    entries) are HBM entries: one past the last host page of any sequence. Plain host work."""
    table = np.asarray(host_table)
    if not len(table):
        return 0
    live = np.arange(table.shape[1])[None, :] < np.asarray(n_pages)[:, None]
    host = (table >= 0) & live
    past_last = table.shape[1] - np.argmax(host[:, ::-1], axis=1)  # one past each row's last host page
    return int(np.where(host.any(axis=1), past_last, 0).max())


def _staged_tables(plan, tables, lens, device):
    """KernelTables over a staging buffer: the plan's HBM-encoded table, the call's lengths."""
    from directkv_cute.cache import KernelTables

    return KernelTables(_staged_table(plan, device), tables.seq_lens,
                        host_seq_lens=tuple(lens), host_table=plan.table)


def _fp8_stage_plan(q, cache, tables, q_lens):
    """``_plan_fp8_staging``'s answer, made once per KernelTables object and call (``_per_tables``)."""
    return _per_tables("fp8", q, cache, tables, q_lens, None, lambda: _plan_fp8_staging(q, cache, tables, q_lens))


def _plan_fp8_staging(q, cache, tables, q_lens):
    """The staging plan of a decode-sized call over FP8 pages when copying their bytes and scales
    into HBM first beats reading them in place (``plan.may_stage`` on those bytes, as for 16-bit
    pages: long link-bound reads with every page on the host), else None: two pieces (the last
    ``FP8_TAIL_SHARE`` of the longest sequence's pages apart) where every sequence has one query
    token, else one. Never inside a CUDA graph capture (the copies are planned per call)."""
    host_table, lens = getattr(tables, "host_table", None), getattr(tables, "host_seq_lens", None)
    if host_table is None or lens is None or torch.cuda.is_current_stream_capturing():
        return None
    _, hq, d = q.shape
    P, hkv = cache.page_size, cache.num_kv_heads
    n_pages, used, n_host = _pages_used(host_table, lens, P)
    page_bytes = layer_page_bytes(1, hkv, P, d, cache.dtype)  # FP8 rows and their scales, one layer
    flops = causal_flops(lens, q_lens, hq, d)
    if not n_host or not may_stage(n_host * page_bytes, flops, (used.size - n_host) * page_bytes, 2 * len(lens)):
        return None
    longest = max(n_pages)
    pp = longest
    if max(q_lens) == 1 and longest > 1:
        pp = min(longest - 1, math.ceil(longest * (1 - FP8_TAIL_SHARE)))
    plan = plan_staging(host_table, lens, P, pp)
    if plan.pages * page_bytes > staging_cap(_total_memory(q.device.index)):
        return None
    return plan


@functools.lru_cache(maxsize=64)
def _compiled_dequant(kv_dtype, dtype, head_dim, page_size):
    from directkv_cute.kernels.jit import compile_dequant

    return compile_dequant(kv_dtype, dtype, head_dim, page_size)


@functools.lru_cache(maxsize=256)
def _compiled_fp8(cfg: DecodeConfig, dtype, kv_dtype, head_dim, page_size, group, max_q_len, split_out):
    from directkv_cute.kernels.jit import compile_decode_fp8

    return compile_decode_fp8(cfg, dtype, kv_dtype, head_dim, page_size, group, max_q_len, split_out)


def _dequantized(q, cache, layer: int, tables, q_lens, softmax_scale, config, out, return_lse: bool,
                 max_seq_len: int):
    """Multi-token calls over FP8 pages: every page the batch reads (once, however many sequences
    share it) is copied by the copy engine into a staging buffer (``staging``: the FP8 bytes, at
    memcpy speed), its scales copied beside it, and the buffer dequantized into a
    (pages, 1, Hkv, 2, P, d) one in the q dtype, as ``PagedKVCache.read`` dequantizes; the call
    then runs over that as an all-HBM cache (the multi-token kernel, or an explicit DecodeConfig's),
    or, where the Q-tiled kernel runs it, group by group of KV heads (``_fp8_by_head``). The link
    carries each page's FP8 bytes and scales once: 0.516x the bytes of bf16 pages at d 128. A call
    whose staged and dequantized pages exceed the staging cap is refused before any copy."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("paged_attention: multi-token calls over FP8 pages dequantize into a buffer planned per "
                           "call and cannot be captured in a CUDA graph (decode-sized calls can)")
    host_table, lens = getattr(tables, "host_table", None), getattr(tables, "host_seq_lens", None)
    if host_table is None or lens is None:  # bare tables (the dispatcher's op): read them back once
        host_table, lens = tables.page_table.cpu().numpy(), tuple(tables.seq_lens.tolist())
    P, hkv, d = cache.page_size, cache.num_kv_heads, q.shape[2]
    # One piece, planned once per KernelTables object (the layers of a model step share it).
    plan = _per_tables("fp8_chunk", q, cache, tables, q_lens, None,
                       lambda: plan_staging(host_table, lens, P, max(math.ceil(n / P) for n in lens)))
    # The FP8 pages and scales staged, and their dequantized copy: there is no in-place path to
    # fall back to, so a call over the staging cap is refused before anything is queued.
    need = plan.pages * (layer_page_bytes(1, hkv, P, d, cache.dtype) + layer_page_bytes(1, hkv, P, d, q.dtype))
    cap = staging_cap(_total_memory(q.device.index))
    if need > cap:
        raise ValueError(f"paged_attention: a multi-token call over FP8 pages stages and dequantizes "
                         f"{plan.pages} pages ({need / 2**30:.2f} GiB of HBM), over the {cap / 2**30:.2f} GiB "
                         f"cap (DIRECTKV_MAX_STAGING_GB); feed fewer sequences or shorter contexts per call")
    cfg = _fp8_head_config(q, cache, lens, q_lens, config)
    if cfg is not None:
        return _fp8_by_head(q, cache, layer, plan, tables, lens, q_lens, softmax_scale, cfg, out, return_lse)
    from directkv_cute.kernels.launch import launch_dequant

    device = q.device
    st = stager(device, torch.cuda.current_stream(device))
    with st.lock:
        raw, scales, _ = st.stage_fp8(cache, layer, plan)  # (pages, 1, Hkv, 2, P, d) FP8; their scales
        st.finish()  # the current stream waits for the copies
        buf = torch.empty(raw.shape, dtype=q.dtype, device=device)  # (pages, 1, Hkv, 2, P, d)
        launch_dequant(_compiled_dequant(cache.dtype, q.dtype, d, P), raw, scales, buf)  # before a later
        # call's copies reuse them
    return _launch(q, _PoolView(buf, buf), 0, _staged_tables(plan, tables, lens, device), q_lens, softmax_scale,
                   config, out, return_lse, max_seq_len)


# Streams that FP8 chunks run their KV head groups on, at most: one group's launch may fill only
# part of the SMs (its query tiles), so the next groups' launches run beside it.
FP8_HEAD_STREAMS = 4


def _fp8_head_config(q, cache, lens, q_lens, config) -> QTiledConfig | None:
    """The Q-tiled config of a multi-token call over FP8 pages run by groups of KV heads
    (``_fp8_by_head``): where the Q-tiled kernel would run it over 16-bit pages all in HBM (an
    explicit QTiledConfig, else a call that fills a wave), else None (the call is dequantized
    whole, then the chunk kernel or an explicit DecodeConfig runs it)."""
    if isinstance(config, DecodeConfig):
        return None
    group = q.shape[1] // cache.num_kv_heads
    if isinstance(config, QTiledConfig):
        return config
    if group > 128 or not _fills_a_wave(q_lens, group, cache.num_kv_heads, q.device.index):
        return None
    return q_tiled_config(_gpu_name(q.device.index or 0), cache, group, len(lens), max(lens), max(q_lens))


def fp8_head_groups(hkv: int, page_size: int, head_dim: int, elem_bytes: int, lens, q_lens, num_q_heads: int):
    """The KV head groups an FP8 chunk is copied, dequantized and attended in (``_fp8_by_head``):
    ``staging.head_groups`` of one head's FP8 block of a page (two heads at page 64, d 128), the
    first group a single head where the call's compute outlasts the copy of its pages at 16 bits
    (``trails_copy`` false: the first group's copy is the exposed part; measured 2026-12-02, 32k
    q8192 5.78 ms so vs 5.93 in pairs, 8k q8192 0.961 vs 0.971; at q2048, where the compute is
    shorter, single heads cost 15%). Plain host work."""
    bound = not trails_copy(kv_bytes(sum(lens), hkv, head_dim), causal_flops(lens, q_lens, num_q_heads, head_dim))
    return head_groups(hkv, 2 * page_size * head_dim * elem_bytes, first=1 if bound else 0)


def _fp8_by_head(q, cache, layer: int, plan, tables, lens, q_lens, softmax_scale, cfg: QTiledConfig, out,
                 return_lse: bool):
    """A multi-token call over FP8 pages, group by group of KV heads (``staging.head_groups``: a
    page's blocks of a group span a copy row the copy engine moves at full rate, two heads at page
    64 and d 128): the copy engine moves every scale, then each group's blocks of every page the
    batch reads (``Stager.stage_fp8`` by group, ``plan`` of one piece); once group g has landed, a
    high-priority stream dequantizes it into a buffer in the q dtype (``kernels/dequant.py``, as
    ``fp8.dequantize`` defines it; its blocks take SMs as the attention's CTAs free them, ahead of
    queued ones), then the Q-tiled kernel runs over that group's query rows alone. The launches
    go round-robin over up to ``FP8_HEAD_STREAMS`` streams, so that only group 0's copy is exposed
    while the later groups' copies run under the earlier groups' attention, and launches whose
    query tiles fill only part of the SMs run side by side."""
    from directkv_cute.kernels.launch import launch_dequant, launch_q_tiled, link_counters

    total_q, hq, d = q.shape
    hkv, P = cache.num_kv_heads, cache.page_size
    group = hq // hkv
    cu_q, max_q_len = _cu_seqlens(tuple(q_lens), q.device)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    n_qt = q_tiles(max_q_len, group, cfg.rows)
    fn = _compiled_q_tiled(cfg, q.dtype, d, P, group, False, False)
    dequant = _compiled_dequant(cache.dtype, q.dtype, d, P)
    if out is None:
        out = torch.empty_like(q)
    lse = torch.empty(total_q, hq, dtype=torch.float32, device=q.device)
    table = _staged_table(plan, q.device)
    seq_lens = tables.seq_lens
    counters = link_counters(q.device)  # never read: the launches wait for no ready flag
    max_tiles = math.ceil(max(lens) / cfg.tile_n)
    groups = fp8_head_groups(hkv, P, d, cache.host_pool.element_size(), lens, q_lens, hq)
    st = stager(q.device, torch.cuda.current_stream(q.device))
    with st.lock:
        raw, scales, landed = st.stage_fp8(cache, layer, plan, groups)  # (pages, 1, Hkv, 2, P, d) FP8
        buf = torch.empty(raw.shape, dtype=q.dtype, device=q.device)  # (pages, 1, Hkv, 2, P, d) dequantized
        n_streams = min(len(groups), FP8_HEAD_STREAMS)
        streams = st.streams(n_streams)
        deq = st.urgent_stream()
        for i, heads in enumerate(groups):
            deq.wait_event(landed[i])
            with torch.cuda.stream(deq):
                launch_dequant(dequant, raw, scales, buf, heads)
                ready = torch.cuda.Event()
                ready.record(deq)
            s = streams[i % n_streams]
            s.wait_event(ready)
            with torch.cuda.stream(s):
                launch_q_tiled(fn, q, out, lse, buf, buf, 1, 0, hkv, table, seq_lens, cu_q, counters, n_qt, 1,
                               max_tiles, 0, 1, scale, ascending=cfg.order == 2, heads=heads)
        cur = streams[0]
        for s in (*streams[1:], deq):
            cur.wait_stream(s)
        st.finish()
    return (out, lse) if return_lse else out


def _in_place(q, cache, group: int, max_q_len: int, batch: int, max_pages: int, max_seq_len: int, config):
    """(config, multi_token, splits, compiled kernel, link counters) of the kernels that read the
    pages in place: the streaming kernel, or the multi-token one (``multi_token``)."""
    total_q, hq, d = q.shape
    hkv = cache.num_kv_heads
    cfg, kernel = select_config(cache, group, max_q_len, batch, max_seq_len, config)
    check_config(cfg, d, cache.page_size)
    if group > cfg.rows:
        raise ValueError(f"GQA group {group} exceeds one CTA's {cfg.rows} query rows")
    multi_token = kernel == "multi_token"
    if multi_token:
        # Size the split count from the page table's width (a bound the host knows without reading
        # seq_lens), never from a caller's hint.
        splits = multi_token_splits(cfg, max_pages * cache.page_size, batch, hkv, _num_sms(q.device.index), d,
                                    q.element_size())
        ws = splits * total_q * hq * (d + 1) * 4
        cap = float(os.environ.get(_WORKSPACE_ENV, "0")) * 2**30 or _total_memory(q.device.index) / 4
        if ws > cap:
            raise ValueError(
                f"the multi-token kernel needs {ws / 2**30:.1f} GiB of fp32 partials ({splits} splits x "
                f"{total_q} query rows x {hq} heads), over the {cap / 2**30:.1f} GiB cap ({_WORKSPACE_ENV}); "
                "use a config with chunk_tiles > 0 (fewer splits) or feed fewer query tokens per call")
    else:
        splits = cfg.splits_for(batch, hkv, max_seq_len, _num_sms(q.device.index))

    from directkv_cute.kernels.launch import link_counters

    counters = link_counters(q.device)  # before any allocation: refused inside a capture that would own them
    split_out = splits > 1 or multi_token
    fn = _compiled(cfg, q.dtype, d, cache.page_size, group, max_q_len, split_out, multi_token,
                   current_trace() if multi_token else None)
    return cfg, multi_token, splits, fn, counters


def q_tiled_config(gpu_name: str, cache, group: int, batch: int, context: int, q_len: int) -> QTiledConfig:
    """The config of an automatic (no explicit config) Q-tiled launch: the profile's q_tiled entry
    for this GPU (exact bucket, else the nearest), else ``QTiledConfig()``. Its launch fields
    (``piece_pages``, ``splits``, ``order``; 0 in tuned entries) are left for the op's cost model.
    A miss warns as the other kernels' lookups do, except for decode-sized calls (their profile
    buckets are prefill chunks, and the Q-tiled kernel runs them only staged, paced by the copy).
    Calls with one query tile per sequence and KV head run without clusters. Plain host work
    (``cache``: its ``dtype`` / ``compute_dtype``, ``head_dim``, ``page_size``)."""
    quiet = op_kernel(group, q_len) == "decode"
    cfg = _profile_config("q_tiled", gpu_name, cache, group, batch, context, q_len, group * q_len,
                          quiet_miss=quiet)[0]
    return cfg.for_query_tiles(q_tiles(q_len, group, cfg.rows))


# The plans of the calls that share one KernelTables (the layers of a model step) are made once:
# key -> (the tables' host_table, the plan), the host_table kept so that its id stays its own.
_PLANS: collections.OrderedDict = collections.OrderedDict()
_PLANS_LOCK = threading.Lock()
_PLANS_KEPT = 8
_STAGED_TABLES: collections.OrderedDict = collections.OrderedDict()
_STAGED_TABLES_KEPT = 16


def _kept(store: collections.OrderedDict, kept: int, key, owner, make):
    """``make()``, kept in ``store`` under ``key`` while ``owner`` (held by the entry, so its id in
    the key stays its own) is the object the caller has, the ``kept`` latest used entries."""
    with _PLANS_LOCK:
        hit = store.get(key)
        if hit is not None and hit[0] is owner:
            store.move_to_end(key)
            return hit[1]
    got = make()
    with _PLANS_LOCK:
        store[key] = (owner, got)
        while len(store) > kept:
            store.popitem(last=False)
    return got


def _per_tables(kind: str, q, cache, tables, q_lens, config, plan_fn):
    """``plan_fn()``, memoized per KernelTables object (by its host table's identity), ``kind``,
    call shape, cache geometry, config, GPU, staging cap and profile-lookup epoch: the layers of
    one step plan their staging once. Inside a capture, and for bare tables, nothing is kept."""
    from directkv_cute.tuning.lookup import cache_epoch

    host_table = getattr(tables, "host_table", None)
    if host_table is None or torch.cuda.is_current_stream_capturing():
        return plan_fn()
    index = q.device.index
    key = (kind, id(host_table), tables.host_seq_lens, tuple(q_lens or ()), tuple(q.shape[1:]), q.dtype, index,
           cache.page_size, cache.num_kv_heads, cache.dtype, config, _gpu_name(index or 0), _num_sms(index),
           staging_cap(_total_memory(index)), cache_epoch())
    return _kept(_PLANS, _PLANS_KEPT, key, host_table, plan_fn)


def _staged_table(plan, device) -> torch.Tensor:
    """``plan.table`` on ``device``, copied there once per plan and stream on that stream (its
    launches follow the copy; the layers of a step share their plan, ``_per_tables``): a staged
    launch's page table without a copy from pageable memory on the current stream per call."""
    key = (id(plan), device.index, getattr(torch.cuda.current_stream(device), "cuda_stream", None))
    return _kept(_STAGED_TABLES, _STAGED_TABLES_KEPT, key, plan,
                 lambda: torch.from_numpy(plan.table).to(device, non_blocking=True))


def _q_tiled_route(q, cache, tables, q_lens, group: int, config):
    """``_plan_route``'s answer, made once per KernelTables object, call and whether its copy
    would run ahead of its kernel (``_pipelined``; ``_per_tables``)."""
    piped = _pipelined(q, cache, tables)
    return _per_tables("q_tiled/pipelined" if piped else "q_tiled", q, cache, tables, q_lens, config,
                       lambda: _plan_route(q, cache, tables, q_lens, group, config, piped))


def _pipelined(q, cache, tables) -> bool:
    """Whether a call staged now is planned for its copy running ahead of its kernel: the
    caller's tables say calls come back to back in long runs (``KernelTables.back_to_back``: a
    model's layers; over a few calls, filling the pipeline would cost more than it gains), the
    copy may run ahead (``staging.may_copy_ahead``; the staging cap is checked by
    ``_pipelined_choice``), and the latest staged call on this stream is still running on the GPU
    (``staging.busy``)."""
    if not getattr(tables, "back_to_back", False) or not may_copy_ahead(cache):
        return False
    if torch.cuda.is_current_stream_capturing():
        return False
    return _staging.busy(q.device, torch.cuda.current_stream(q.device))


def _fills_a_wave(q_lens, group: int, num_kv_heads: int, device_index) -> bool:
    """Whether the Q-tiled kernel runs a multi-token call over KV all in HBM: once its query tiles
    fill about a wave of SMs (measured from q 512 at Hkv 8); fewer tiles leave SMs idle and the
    split chunk kernel is faster. Streaming launches (decode) keep their kernel."""
    if op_kernel(group, max(q_lens)) == "decode":
        return False
    ctas = q_tiles(max(q_lens), group, QTiledConfig().rows) * num_kv_heads * len(q_lens)
    return 2 * ctas >= _num_sms(device_index)


def _plan_route(q, cache, tables, q_lens, group: int, config, pipelined: bool = False):
    """(QTiledConfig, StagePlan or None) when the Q-tiled kernel runs this call, else None.

    It runs directly when every page of a multi-token call is in HBM, or over host pages staged
    into HBM when the cost model (``plan.choose_staged``) says the copy plus its compute beats
    reading in place: compute-bound chunks, and long link-bound reads (decode included), where the
    copy engine outruns the SMs' reads of host memory. An explicit QTiledConfig always runs it, or
    raises where it cannot; without one the config is the tuned profile's (``q_tiled_config``),
    looked up once the call is one the kernel may run. ``pipelined``: the call's copy will run
    ahead of its kernel (``_pipelined``), which changes the plan the model prefers."""
    explicit = isinstance(config, QTiledConfig)
    host_table, lens = getattr(tables, "host_table", None), getattr(tables, "host_seq_lens", None)

    def refuse(why: str):
        if explicit:
            raise ValueError(f"QTiledConfig: {why}")
        return None

    if host_table is None or lens is None:
        return refuse("needs tables from cache.kernel_tables() (the staging plan reads the host page table)")
    if torch.cuda.is_current_stream_capturing():
        return refuse("the staged Q-tiled path cannot be captured in a CUDA graph (its copies are planned per call)")
    if group > 128:
        return refuse(f"GQA group {group} exceeds the kernel's 128 query rows")

    def looked_up() -> QTiledConfig:
        return q_tiled_config(_gpu_name(q.device.index or 0), cache, group, len(lens), max(lens), max(q_lens))

    _, hq, d = q.shape
    P = cache.page_size
    n_pages, used, n_host = _pages_used(host_table, lens, P)
    if n_host == 0:  # every page already in HBM: the Q-tiled kernel (no KV splits) where it fills a wave
        if explicit or _fills_a_wave(q_lens, group, cache.num_kv_heads, q.device.index):
            return (config if explicit else looked_up()), None
        return None
    cfg = config if explicit else looked_up()
    got = staging_choice(cache, tables, q_lens, hq, d, q.element_size(), q.device.index, cfg, explicit, pipelined)
    if isinstance(got, str):
        return refuse(got)
    if got is None:
        return None  # short link-bound reads: in place (decided before any planning)
    choice, plan = got
    if not explicit:
        if not choice.staged:
            return None
    if not cfg.order:
        cfg = dataclasses.replace(cfg, order=2 if choice.ascending else 1)
    if not cfg.copy_order:
        cfg = dataclasses.replace(cfg, copy_order=2 if choice.by_head else 1)
    if not cfg.splits:
        cfg = dataclasses.replace(cfg, splits=1 if 2 in (cfg.order, cfg.copy_order) else choice.splits)
    return cfg, plan


def staging_choice(cache, tables, q_lens, num_q_heads: int, head_dim: int, elem_bytes: int, device_index: int,
                   cfg: QTiledConfig | None = None, explicit: bool = False, pipelined: bool = False):
    """The cost model's verdict on staging one call over ``tables`` (some pages on the host):
    (StagedChoice, StagePlan); None when staging cannot pay (decided before planning; never for
    an explicit config); a str saying why it cannot run (over the staging cap). With
    ``pipelined`` (the call's copy runs ahead of its kernel) a chunk whose config leaves the
    launch fields to the op is planned by ``_pipelined_choice``. Plain host work."""
    cfg = cfg or QTiledConfig()
    host_table, lens = tables.host_table, tables.host_seq_lens
    P, L = cache.page_size, in_place_layers(cache)
    group = num_q_heads // cache.num_kv_heads
    n_pages, used, n_host = _pages_used(host_table, lens, P)
    page_bytes = 2 * cache.num_kv_heads * P * head_dim * elem_bytes
    flops = causal_flops(lens, q_lens, num_q_heads, head_dim)
    bound = compute_bound(n_host * page_bytes, flops)
    chunk = op_kernel(group, max(q_lens)) != "decode"  # in place, the chunk kernel would run it
    chunk_q = sum(q_lens) if chunk else 0
    # A chunk with more CTAs than SMs whose compute trails the copy: coarser pieces (fewer copy calls
    # and flags); elsewhere finer pieces pace the CTAs (decode, one wave, compute-bound chunks).
    heads = cache.num_kv_heads
    ctas = q_tiles(max(q_lens), group, cfg.rows) * heads * len(lens)
    coarse_link = chunk and ctas > _num_sms(device_index) and trails_copy(n_host * page_bytes, flops)
    pieces, split_choices = link_bound_staging(max(lens)) if coarse_link else (16, SPLIT_CHOICES)
    pp = piece_pages_for(max(n_pages), P, cfg.tile_n, cfg.piece_pages, pieces=pieces)
    hbm_runs = hbm_runs_per_sequence(host_table, n_pages) if chunk else 0
    window = chunk and hbm_runs <= 1
    if hbm_runs == 1 and not cfg.piece_pages:  # a step's own pages in HBM: pieces of their own, ready at the start
        pp = window_piece_pages(pp, ready_page(host_table, n_pages), max(n_pages), max(1, cfg.tile_n // P),
                                math.ceil(max(n_pages) / MAX_PIECES))
    calls = sum(math.ceil(n / pp) for n in n_pages)  # at least one copy per sequence and piece
    if not explicit and not may_stage(n_host * page_bytes, flops, (used.size - n_host) * page_bytes, calls, chunk_q,
                                      window=window):
        return None
    # Staged head by head: fewer, larger pieces per head (each piece is copied once per head);
    # only the first head's copy is exposed, so finer pieces would only add copy calls.
    plan = plan_staging(host_table, lens, P, pp, L) if cfg.copy_order != 2 else None
    head_plan = None  # weighed where compute binds (elsewhere the pieces of all heads win: measured)
    if cfg.copy_order == 2 or (cfg.copy_order == 0 and cfg.splits <= 1 and bound):
        pp_h = piece_pages_for(max(n_pages), P, cfg.tile_n, cfg.piece_pages, pieces=HEAD_PIECES)
        head_plan = plan if plan is not None and pp_h == pp else plan_staging(host_table, lens, P, pp_h, L)
        if len(head_plan.pieces) * heads > MAX_FLAGS:
            head_plan = None
    if plan is None and head_plan is None:
        return f"copy_order 2 (head by head) needs at most {MAX_FLAGS} (KV head, piece) ready flags"
    # A chunk whose CTAs all fit one wave: one split over LINK_PIECES coarse pieces is weighed too.
    wave_plan = None
    if (chunk and plan is not None and cfg.splits <= 1 and cfg.order != 2 and not cfg.piece_pages
            and ctas <= _num_sms(device_index)):
        wave_plan = plan_staging(host_table, lens, P, piece_pages_for(max(n_pages), P, cfg.tile_n, pieces=LINK_PIECES),
                                 L)
    any_plan = plan if plan is not None else head_plan
    need = any_plan.pages * page_bytes
    cap = staging_cap(_total_memory(device_index))
    if need > cap:
        return (f"staging needs {need / 2**30:.2f} GiB of HBM, over the {cap / 2**30:.2f} GiB cap "
                "(DIRECTKV_MAX_STAGING_GB)")
    host_b = any_plan.host_pages * page_bytes
    tiles = q_tile_profile(lens, q_lens, cfg.rows // group) if cfg.order in (0, 2) and plan is not None else None
    host_calls, hbm_calls = any_plan.copy_calls
    head_calls = 0 if head_plan is None else heads * head_plan.copy_calls[0]
    wave_calls = 0 if wave_plan is None else wave_plan.copy_calls[0]
    # What the Q-tiled kernel reads from the buffer beyond its compute: each sequence's pages
    # (its query tiles read them together, through the L2), however many sequences share them.
    kv_read = used.size * page_bytes
    one_split = 2 in (cfg.order, cfg.copy_order)
    choice = choose_staged(host_b, need - host_b, flops,
                           partial_bytes(sum(q_lens), num_q_heads, head_dim), 1 if one_split else cfg.splits,
                           tiles, host_calls=host_calls, hbm_calls=hbm_calls,
                           in_place_bytes=n_host * page_bytes, kv_read_bytes=kv_read, heads=heads,
                           head_calls=head_calls, chunk_q=chunk_q, wave_calls=wave_calls,
                           pieces=len(any_plan.pieces),
                           head_flags=0 if head_plan is None else heads * len(head_plan.pieces),
                           split_ctas=ctas, sms=_num_sms(device_index),
                           choices=split_choices)
    if plan is None:  # head by head asked for
        choice = dataclasses.replace(choice, by_head=True, splits=1, ascending=False, coarse=False)
    out = (choice, head_plan) if choice.by_head else (choice, wave_plan if choice.coarse else plan)
    if pipelined and chunk and not (cfg.piece_pages or cfg.splits or cfg.order or cfg.copy_order):
        # Weighed against this plan back to back: the step's own host pages, or a kernel as long
        # as the copy, may keep it the better one.
        return _pipelined_choice(cache, host_table, lens, q_lens, used, n_host, page_bytes, flops, chunk_q, ctas,
                                 cfg, device_index, num_q_heads, head_dim, out) or out
    return out


def _pipelined_choice(cache, host_table, lens, q_lens, used, n_host: int, page_bytes: int, flops: float,
                      chunk_q: int, ctas: int, cfg: QTiledConfig, device_index: int, num_q_heads: int,
                      head_dim: int, regular):
    """(StagedChoice, StagePlan) of a chunk whose copy runs ahead of its kernel: one plan per
    split count of ``SPLIT_CHOICES``, each in as many pieces as it has splits over the pages before
    the step's own tokens (the first logical page holding any sequence's new tokens ends a piece,
    so that the history's copy waits for none of the step's writes), and ``regular`` (the
    (StagedChoice, StagePlan) planned for one call, paced by its pieces: no pipeline to fill),
    weighed by ``plan.choose_pipelined``. None where ``regular`` wins, or where the copy would not
    run ahead after all (``staging.copies_ahead``: two buffers over the staging cap)."""
    P, L = cache.page_size, in_place_layers(cache)
    n_pages = [math.ceil(n / P) for n in lens]
    staged = n_host if L else used.size  # the pages a buffer takes
    if not copies_ahead(cache, staged * page_bytes, _total_memory(device_index)):
        return None
    max_pages = max(n_pages)
    tile_pages = max(1, cfg.tile_n // P)
    min_pp = math.ceil(max_pages / MAX_PIECES)
    own = min((n - ql) // P for n, ql in zip(lens, q_lens))  # pages before every sequence's new tokens
    own -= own % tile_pages  # pieces end on whole KV tiles
    max_tiles = math.ceil(max(lens) / cfg.tile_n)
    plans, candidates, wants = [], [], []
    for want in SPLIT_CHOICES:
        if own >= tile_pages:
            pp = max(min_pp, tile_pages * math.ceil(own / want / tile_pages))
            pp = window_piece_pages(pp, own, max_pages, tile_pages, min_pp)
        else:
            pp = piece_pages_for(max_pages, P, cfg.tile_n, pieces=want)
        if any(p.piece_pages == pp for p in plans):
            continue
        plan = plan_staging(host_table, lens, P, pp, L)
        plans.append(plan)
        wants.append(want)
        candidates.append((_staged_splits(plan, P, cfg.tile_n, max_tiles, want)[0], *plan.copy_calls,
                           len(plan.pieces), _split_layout(plan, P, cfg.tile_n, max_tiles, want, lens, q_lens)))
    reg_choice, reg_plan = regular
    host_calls, hbm_calls = reg_plan.copy_calls
    if reg_choice.by_head:
        heads = cache.num_kv_heads
        candidates.append((1, heads * host_calls, hbm_calls, heads * len(reg_plan.pieces), None))
    else:
        want = 1 if reg_choice.ascending else reg_choice.splits
        layout = None if reg_choice.ascending else _split_layout(reg_plan, P, cfg.tile_n, max_tiles, want, lens,
                                                                 q_lens)
        candidates.append((_staged_splits(reg_plan, P, cfg.tile_n, max_tiles, want)[0], host_calls, hbm_calls,
                           len(reg_plan.pieces), layout))
    host_b = plans[0].host_pages * page_bytes
    # The step's own host pages were just written: their copy waits for the previous kernel.
    table = np.asarray(host_table)
    wait_pages = sum(int((table[b, (n - ql) // P:n_pages[b]] >= 0).sum())
                     for b, (n, ql) in enumerate(zip(lens, q_lens)))
    choice, best = choose_pipelined(host_b, plans[0].pages * page_bytes - host_b, flops,
                                    partial_bytes(sum(q_lens), num_q_heads, head_dim), candidates,
                                    in_place_bytes=n_host * page_bytes, kv_read_bytes=used.size * page_bytes,
                                    chunk_q=chunk_q, ctas=ctas, sms=_num_sms(device_index),
                                    wait_bytes=wait_pages * page_bytes)
    if best == len(plans):
        return None
    return dataclasses.replace(choice, splits=wants[best]), plans[best]


def _split_layout(plan, page_size: int, tile_n: int, max_tiles: int, want: int, lens, q_lens):
    """The splits of a staged launch over ``plan`` (``_staged_splits``, the ready ones first) in
    launch order, as ``plan.pipelined_tail_ms`` weighs them: (each one's share of the causal work,
    the share of the host copy after which its pages have all landed, None where they are ready
    before it starts). Plain host work."""
    splits, split_tiles, piece_tiles = _staged_splits(plan, page_size, tile_n, max_tiles, want)
    first = ready_split(plan.ready_from, piece_tiles, split_tiles, splits)
    work = split_work(lens, q_lens, tile_n, split_tiles, splits)
    copied = np.cumsum([sum(r.count for r in piece if not r.hbm) for piece in plan.pieces], dtype=np.float64)
    copied /= max(copied[-1], 1.0)
    landed = []
    for s in range(splits):
        lo, hi = s * split_tiles // piece_tiles, min(((s + 1) * split_tiles - 1) // piece_tiles, len(plan.pieces) - 1)
        landed.append(None if lo >= plan.ready_from else float(copied[hi]))
    order = [(first + r) % splits for r in range(splits)]
    return [work[s] for s in order], [landed[s] for s in order]


def _staged_splits(plan, page_size: int, tile_n: int, max_tiles: int, want: int, ready: bool = True):
    """(splits, tiles per split, tiles per piece) of a staged launch over ``plan`` asking for
    ``want`` splits (``plan.q_tiled_splits``); ``ready``: the pieces ready at the start get
    splits of their own."""
    piece_tiles = plan.piece_pages * page_size // tile_n
    splits, split_tiles = q_tiled_splits(max_tiles, piece_tiles, want, plan.ready_from * piece_tiles if ready else 0)
    return splits, split_tiles, piece_tiles


@functools.lru_cache(maxsize=256)
def _compiled_q_tiled(cfg: QTiledConfig, dtype, head_dim, page_size, group, wait_ready, fold):
    from directkv_cute.kernels.jit import compile_q_tiled

    return compile_q_tiled(cfg, dtype, head_dim, page_size, group, wait_ready, fold)


def _launch_q_tiled(q, cache, layer, tables, q_lens, cu_q, max_q_len, softmax_scale, out, return_lse,
                    cfg: QTiledConfig, plan):
    """The Q-tiled kernel over the HBM pool (plan None) or over this call's staging buffer, in
    ``q_tiled_splits`` KV splits when staged, or in one, the copy landing head by head, with
    ``copy_order`` 2. One launch: the splits that read only pages ready at the start first
    (``ready_split``), each query tile's splits folded into one fp32 accumulator in launch order
    inside the kernel, the last writing the output (no partials, no combine)."""
    from directkv_cute.kernels.launch import fold_turn_count, launch_q_tiled, link_counters

    total_q, hq, d = q.shape
    hkv, P = cache.num_kv_heads, cache.page_size
    group = hq // hkv
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    host = cache.host_pool_cuda if cache.host_pool_cuda is not None else cache.host_pool
    n_qt = q_tiles(max_q_len, group, cfg.rows)
    max_tiles = math.ceil(max(tables.host_seq_lens) / cfg.tile_n)
    by_head = plan is not None and cfg.copy_order == 2  # the copy and the CTAs head by head
    first = 0
    if plan is None:
        splits, split_tiles, piece_tiles = 1, max_tiles, 1
    else:
        in_order = by_head or cfg.order == 2  # one split, in the order the copy lands
        splits, split_tiles, piece_tiles = _staged_splits(plan, P, cfg.tile_n, max_tiles, cfg.splits, not in_order)
        if not in_order:
            first = ready_split(plan.ready_from, piece_tiles, split_tiles, splits)
    fn = _compiled_q_tiled(cfg, q.dtype, d, P, group, plan is not None, splits > 1)
    if out is None:
        out = torch.empty_like(q)
    lse = torch.empty(total_q, hq, dtype=torch.float32, device=q.device)
    if plan is None:
        ready = link_counters(q.device)  # never read without wait_ready
        launch_q_tiled(fn, q, out, lse, host, cache.hbm_pool, cache.num_layers, layer, hkv, tables.page_table,
                       tables.seq_lens, cu_q, ready, n_qt, splits, split_tiles, 0, 1, scale)
    else:
        st = stager(q.device, torch.cuda.current_stream(q.device))
        table = _staged_table(plan, q.device)
        with st.lock:
            fold = None
            if splits > 1:  # (accumulator, its LSE, turn counters)
                fold = (torch.empty(total_q, hq, d, dtype=torch.float32, device=q.device),
                        torch.empty(total_q, hq, dtype=torch.float32, device=q.device),
                        st.fold_turns(fold_turn_count(len(tables.host_seq_lens), hkv, n_qt)))
            buf, flags, epoch = st.stage(cache, layer, plan, by_head)
            if plan.reads_in_place:  # the pages already in HBM, read where they are
                host = hbm_in_place(cache.hbm_pool, layer)
            launch_q_tiled(fn, q, out, lse, host, buf, 1, 0, hkv, table, tables.seq_lens, cu_q, flags, n_qt, splits,
                           split_tiles, epoch, piece_tiles, scale, ascending=cfg.order == 2,
                           flag_stride=len(plan.pieces) if by_head else 0, split_first=first, fold=fold)
            st.finish()
    return (out, lse) if return_lse else out


# ---- torch.library registration --------------------------------------------------------------
class _PoolView:
    """The few cache attributes the kernels read, rebuilt from the pool tensors (the op below
    takes tensors only, so that torch.compile and the dispatcher can see them)."""

    def __init__(self, host_pool: torch.Tensor, hbm_pool: torch.Tensor, compute_dtype: torch.dtype | None = None,
                 host_scales: torch.Tensor | None = None, hbm_scales: torch.Tensor | None = None):
        _, self.num_layers, self.num_kv_heads, _, self.page_size, self.head_dim = host_pool.shape
        self.host_pool = self.host_pool_cuda = host_pool
        self.hbm_pool = hbm_pool
        self.host_scales = self.host_scales_cuda = host_scales
        self.hbm_scales = hbm_scales
        self.dtype = host_pool.dtype
        self.compute_dtype = compute_dtype or host_pool.dtype


@torch.library.custom_op("directkv_cute::paged_attention", mutates_args=())
def attention_op(q: torch.Tensor, host_pool: torch.Tensor, hbm_pool: torch.Tensor, page_table: torch.Tensor,
                 seq_lens: torch.Tensor, layer: int, q_lens: list[int] | None = None,
                 softmax_scale: float | None = None, config: list[int] | None = None,
                 max_seq_len: int | None = None, host_scales: torch.Tensor | None = None,
                 hbm_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.directkv_cute.paged_attention``: the op on plain tensors, returning (out, lse).

    host_pool is ``cache.host_pool_cuda`` on a GPU (the UVA alias of the pinned pool) or
    ``cache.host_pool`` on a CPU; hbm_pool is ``cache.hbm_pool``; page_table / seq_lens come from
    ``cache.kernel_tables``; config lists the DecodeConfig fields in order (None: profile lookup).
    FP8 pools come with their scale pools (``cache.device_scales``) and take q's dtype for compute
    (the q dtype: bf16 or fp16 on a GPU).
    Direct Python calls of ``paged_attention_tables`` skip the dispatcher's overhead; this entry
    is for torch.compile'd models and other dispatcher users.
    """
    from directkv_cute.fp8 import is_fp8

    compute = q.dtype if is_fp8(host_pool.dtype) else None
    if q.is_cuda:
        from directkv_cute.cache import KernelTables

        cfg = DecodeConfig(*config) if config else None
        if compute is not None and host_scales is None:
            raise ValueError("FP8 pools need their scale pools (host_scales, hbm_scales: cache.device_scales)")
        view = _PoolView(host_pool, hbm_pool, compute, host_scales, hbm_scales)
        out, lse = paged_attention_tables(q, view, layer, KernelTables(page_table, seq_lens),
                                          q_lens, softmax_scale, config=cfg, return_lse=True, max_seq_len=max_seq_len)
        return out, lse
    from directkv_cute.reference import tables_attention_ref

    view = _PoolView(host_pool, hbm_pool, compute)
    if page_table.dtype != torch.int32 or page_table.dim() != 2 or seq_lens.dtype != torch.int32 \
            or seq_lens.shape != (page_table.shape[0],):
        raise ValueError("page_table must be (B, max_pages) int32 and seq_lens (B,) int32 (cache.kernel_tables)")
    layer, lens = check_attention(q, view, layer, batch=page_table.shape[0], q_lens=q_lens,
                                  config=DecodeConfig(*config) if config else None, softmax_scale=softmax_scale,
                                  seq_lens=seq_lens.tolist(), cuda=False)
    return tables_attention_ref(q, host_pool, hbm_pool, page_table, seq_lens, layer, list(lens), softmax_scale,
                                host_scales=host_scales, hbm_scales=hbm_scales)


@attention_op.register_fake
def _attention_op_fake(q, host_pool, hbm_pool, page_table, seq_lens, layer, q_lens=None, softmax_scale=None,
                       config=None, max_seq_len=None, host_scales=None, hbm_scales=None):
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)
