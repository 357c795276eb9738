"""The runner: executes an ``AttentionPlan`` (``directkv_cute.planner``) on the GPU.

``bind(plan, cache, tables, device)`` makes a plan's device side once (the query offsets, the
staged page tables, the cascade's tables and row indices); ``run(plan, bound, q, cache, layer)``
launches it, per layer: in place (and the split combine), staged Q-tiled, FP8 in place / staged /
by head groups, or the cascade's passes merged by their LSE. On a CPU cache it runs the float32
reference. It decides nothing: every choice is the plan's. It and ``staging.Stager`` are the only
places that touch streams and events.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch

from directkv_cute.config import DecodeConfig, QTiledConfig
from directkv_cute.planner import AttentionPlan
from directkv_cute.staging import hbm_in_place, stager


# ---- compiled kernels (jit keys on the target arch too; these memos keep the key off the call path)
@functools.lru_cache(maxsize=1024)
def _compiled(cfg: DecodeConfig, dtype, head_dim, page_size, group, max_q_len, split_out, multi_token, trace=None):
    from directkv_cute.kernels.jit import compile_decode

    return compile_decode(cfg, dtype, head_dim, page_size, group, max_q_len, split_out=split_out,
                          multi_token=multi_token, trace=trace)


@functools.lru_cache(maxsize=256)
def _compiled_fp8(cfg: DecodeConfig, dtype, kv_dtype, head_dim, page_size, group, max_q_len, split_out):
    from directkv_cute.kernels.jit import compile_decode_fp8

    return compile_decode_fp8(cfg, dtype, kv_dtype, head_dim, page_size, group, max_q_len, split_out)


@functools.lru_cache(maxsize=256)
def _compiled_q_tiled(cfg: QTiledConfig, dtype, head_dim, page_size, group, wait_ready, fold):
    from directkv_cute.kernels.jit import compile_q_tiled

    return compile_q_tiled(cfg, dtype, head_dim, page_size, group, wait_ready, fold)


@functools.lru_cache(maxsize=64)
def _compiled_combine(head_dim, dtype):
    from directkv_cute.kernels.jit import compile_combine

    return compile_combine(head_dim, dtype)


@functools.lru_cache(maxsize=64)
def _compiled_dequant(kv_dtype, dtype, head_dim, page_size):
    from directkv_cute.kernels.jit import compile_dequant

    return compile_dequant(kv_dtype, dtype, head_dim, page_size)


# ---- device state ----------------------------------------------------------------------------
# Device copies of the query offsets per distinct q_lens (decode: one per batch size): a repeated
# shape skips the per-call host-to-device copy, and a captured CUDA graph keeps reading a live
# tensor. Entries are never evicted (a graph may hold one); past the cap, new q_lens are copied
# per call (and cannot be captured).
_CU_Q: dict = {}
_CU_Q_CAP = 4096


def cu_seqlens(q_lens: tuple[int, ...], device) -> torch.Tensor:
    """cu_q int32 (B + 1,) on device from validated per-sequence query lengths."""
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
    return cu_q


class PoolView:
    """The few cache attributes the kernels read, rebuilt from pool tensors (a staging buffer, the
    dispatcher's op, an engine's per-layer KV tensors).

    write_log: the ``cache.HostWriteLog`` of the host writes to ``host_pool`` that its owner
    records (``record`` after each write it enqueues): staged calls over the view then copy ahead
    of the current stream, each host page after the writes recorded for it (``host_writes``, as a
    ``PagedKVCache``'s). None: nothing is recorded, so every staged copy waits for the current
    stream's work so far."""

    def __init__(self, host_pool: torch.Tensor, hbm_pool: torch.Tensor, compute_dtype: torch.dtype | None = None,
                 host_scales: torch.Tensor | None = None, hbm_scales: torch.Tensor | None = None,
                 write_log=None):
        _, self.num_layers, self.num_kv_heads, _, self.page_size, self.head_dim = host_pool.shape
        self.host_pool = self.host_pool_cuda = host_pool
        self.hbm_pool = hbm_pool
        self.host_scales = self.host_scales_cuda = host_scales
        self.hbm_scales = hbm_scales
        self.dtype = host_pool.dtype
        self.compute_dtype = compute_dtype or host_pool.dtype
        self.write_log = write_log

    @property
    def host_writes(self):
        """What ``DeviceInfo.current`` and ``Stager.stage`` ask a cache for: the write log's
        ``pending`` (as ``PagedKVCache.host_writes``), None without a log."""
        return None if self.write_log is None else self.write_log.pending

    def device_pool(self, tier: str) -> torch.Tensor:
        """The tier's pool as the reference reads it (a CPU view runs the reference)."""
        return self.host_pool if tier == "host" else self.hbm_pool


def tables_from_host(table: np.ndarray, lens, device, like=None):
    """KernelTables over a host table and lengths, one host-to-device copy (``like``: the cache id
    and generation of the tables they were cut from)."""
    from directkv_cute.cache import KernelTables

    table = np.ascontiguousarray(table, dtype=np.int32)
    packed = np.concatenate([table.ravel(), np.asarray(lens, dtype=np.int32)])
    dev = torch.from_numpy(packed).to(device, non_blocking=True)
    n = table.size
    return KernelTables(dev[:n].view(table.shape), dev[n:], getattr(like, "cache_id", 0),
                        getattr(like, "generation", -1), tuple(int(x) for x in lens), table)


@dataclass
class Bound:
    """A plan's device side, made once (``bind``) and reused by every layer that runs it."""

    tables: object  # KernelTables of the call
    cu_q: torch.Tensor | None
    staged_table: torch.Tensor | None = None  # plan.staging.table on the device
    parts: tuple = ()  # decode_fp8_two_piece: (page_table, seq_lens) per part
    inner: "Bound | None" = None  # fp8_dequantized: over the buffer
    passes: tuple = ()  # cascade: (row indices on the device or None, Bound) per pass
    capture: "Bound | None" = None


def bind(plan: AttentionPlan, tables, device, staged: dict | None = None) -> Bound:
    """The device side of ``plan`` over ``tables`` (see ``Bound``). ``staged``: device copies of
    the plan's staged page table already made, by (device, stream), filled here (a plan made
    again for the same shape reuses them: no copy from pageable memory per call)."""
    device = torch.device(device)
    shape = plan.shape
    if device.type != "cuda":
        b = Bound(tables, None)
    else:
        b = Bound(tables, cu_seqlens(tuple(shape.q_lens), device))
    if plan.staging is not None and device.type == "cuda":
        # Copied on the current stream: the launches over it follow the copy.
        key = (str(device), torch.cuda.current_stream(device).cuda_stream)
        made = None if staged is None else staged.get(key)
        if made is None:
            made = torch.from_numpy(plan.staging.table).to(device, non_blocking=True)
            if staged is not None:
                staged[key] = made
        b.staged_table = made
    if plan.fp8_parts and device.type == "cuda":
        flat = torch.from_numpy(np.concatenate([np.concatenate([p.table.ravel(), p.lens]) for p in plan.fp8_parts])
                                ).to(device, non_blocking=True)
        parts, at = [], 0
        for p in plan.fp8_parts:
            parts.append((flat[at:at + p.table.size].view(p.table.shape),
                          flat[at + p.table.size:at + p.table.size + len(p.lens)]))
            at += p.table.size + len(p.lens)
        b.parts = tuple(parts)
    if plan.route == "cascade_staged":
        b.inner = bind(plan.inner, tables, device)
    elif plan.inner is not None and device.type == "cuda":  # fp8_dequantized: over the buffer
        from directkv_cute.cache import KernelTables

        inner_tables = KernelTables(b.staged_table, tables.seq_lens, host_seq_lens=tuple(shape.seq_lens),
                                    host_table=plan.staging.table)
        b.inner = Bound(inner_tables, b.cu_q)
    if plan.passes:
        cu = np.concatenate(([0], np.cumsum(shape.q_lens)))
        passes = []
        for p in plan.passes:
            sub = tables_from_host(p.shape.host_table, p.shape.seq_lens, device, tables)
            idx = None
            if p.rows is not None:
                idx = torch.from_numpy(np.concatenate([np.arange(cu[r], cu[r + 1]) for r in p.rows])).to(
                    device, non_blocking=True)
            passes.append((idx, bind(p.plan, sub, device)))
        b.passes = tuple(passes)
    if plan.capture is not None and device.type == "cuda":
        # What a CUDA graph capture of this call runs: its kernel compiled and the link counters
        # allocated now, outside any capture.
        from directkv_cute.kernels.launch import link_counters

        b.capture = Bound(tables, b.cu_q)
        link_counters(device)
        _in_place_kernel(plan.capture, plan.shape.compute_dtype)
    return b


# ---- running ---------------------------------------------------------------------------------
def run(plan: AttentionPlan, bound: Bound, q: torch.Tensor, cache, layer: int, softmax_scale=None, out=None,
        return_lse: bool = False):
    """Launch ``plan`` for ``layer`` (validated arguments); returns out, and the LSE with
    ``return_lse``."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[2])
    o, lse = _run(plan, bound, q, cache, layer, scale, out)
    return (o, lse) if return_lse else o


def _run(plan, bound, q, cache, layer, scale, out):
    if not q.is_cuda:
        return _reference(plan, bound, q, cache, layer, scale, out)
    if plan.staging is not None and torch.cuda.is_current_stream_capturing():
        if plan.capture is None:  # planned outside the capture, with nothing that reads in place
            raise RuntimeError(f"paged_attention: the {plan.route} plan copies pages planned per call and cannot be "
                               "captured in a CUDA graph; plan inside the capture (decode-sized calls can be captured)")
        plan, bound = plan.capture, bound.capture  # a capture reads in place: no copies planned per call
    route = plan.route
    if route == "cascade":
        return _cascade(plan, bound, q, cache, layer, scale, out)
    if route == "cascade_staged":  # one staged call of the whole batch
        return _run(plan.inner, bound.inner, q, cache, layer, scale, out)
    if route in ("decode", "multi_token", "decode_fp8"):
        return _in_place(plan, bound, q, cache, layer, scale, out)
    if route in ("q_tiled_hbm", "q_tiled_staged"):
        return _q_tiled(plan, bound, q, cache, layer, scale, out)
    if route in ("decode_fp8_staged", "decode_fp8_two_piece"):
        return _fp8_staged_decode(plan, bound, q, cache, layer, scale, out)
    if route == "fp8_dequantized":
        return _fp8_dequantized(plan, bound, q, cache, layer, scale, out)
    if route == "fp8_by_head":
        return _fp8_by_head(plan, bound, q, cache, layer, scale, out)
    raise ValueError(f"no runner for route {route!r}")


def _reference(plan, bound, q, cache, layer, scale, out):
    """The float32 reference on a CPU: the cascade's passes merged as on a GPU, else one call."""
    from directkv_cute.reference import cache_scales, tables_attention_ref

    if plan.route == "cascade":
        return _cascade(plan, bound, q, cache, layer, scale, out)
    t = bound.tables
    o, lse = tables_attention_ref(q, cache.device_pool("host"), cache.device_pool("hbm"), t.page_table, t.seq_lens,
                                  layer, list(plan.shape.q_lens), scale, **cache_scales(cache))
    if out is not None:
        out.copy_(o)
        o = out
    return o, lse


def _in_place_kernel(plan, dtype, partials=None, compile_now=True):
    """The compiled kernel of an in-place plan (``partials``: it writes split partials); with
    ``compile_now`` False, the (compile function, arguments) that give it."""
    from directkv_cute.kernels.trace import current_trace

    shape, cfg = plan.shape, plan.config
    multi_token = plan.kernel == "multi_token"
    if partials is None:
        partials = _in_place_partials(plan)
    if plan.kernel == "decode_fp8":
        fn, args = _compiled_fp8, (cfg, dtype, shape.page_dtype, shape.head_dim, shape.page_size, shape.group,
                                   shape.max_q_len, partials)
    else:
        fn, args = _compiled, (cfg, dtype, shape.head_dim, shape.page_size, shape.group, shape.max_q_len, partials,
                               multi_token, current_trace() if multi_token else None)
    return fn(*args) if compile_now else (fn, args)


def _q_tiled_args(plan, dtype) -> tuple:
    """``_compiled_q_tiled``'s arguments for a plan's Q-tiled launches (staged or over HBM; FP8
    by head groups: over dequantized buffers, waiting for no ready flag, one split each)."""
    shape = plan.shape
    by_head = plan.route == "fp8_by_head"
    return (plan.config, dtype, shape.head_dim, shape.page_size, shape.group,
            plan.staging is not None and not by_head, plan.layout.splits > 1 and not by_head)


def _dequant_args(plan, dtype) -> tuple:
    """``_compiled_dequant``'s arguments for a plan over FP8 pages (dequantized to ``dtype``)."""
    shape = plan.shape
    return (shape.page_dtype, dtype, shape.head_dim, shape.page_size)


def _in_place_partials(plan, parts=None) -> bool:
    """Whether an in-place launch writes split partials (merged by the combine kernel)."""
    return plan.splits > 1 or plan.kernel == "multi_token" or parts is not None


def plan_kernels(plan, dtype) -> list[tuple]:
    """The compiled kernels ``run`` launches for ``plan`` with queries of ``dtype``, as
    (memoized compile function, its arguments): calling each compiles it now (or loads it from
    the disk cache), so that no launch of the plan compiles. A serving engine calls them at
    startup for the steps it may plan (``directkv_cute.vllm``'s warm-up)."""
    route = plan.route
    if route == "cascade":
        return [k for p in plan.passes for k in plan_kernels(p.plan, dtype)]
    if route == "cascade_staged":
        return plan_kernels(plan.inner, dtype)
    shape = plan.shape
    combine = (_compiled_combine, (shape.head_dim, dtype))
    if route in ("decode", "multi_token", "decode_fp8", "decode_fp8_staged", "decode_fp8_two_piece"):
        parts = plan.fp8_parts if route == "decode_fp8_two_piece" else None
        partials = _in_place_partials(plan, parts or None)
        fn, args = _in_place_kernel(plan, dtype, partials, compile_now=False)
        return [(fn, args)] + ([combine] if partials else [])
    if route in ("q_tiled_hbm", "q_tiled_staged"):
        return [(_compiled_q_tiled, _q_tiled_args(plan, dtype))]
    dequant = (_compiled_dequant, _dequant_args(plan, dtype))
    if route == "fp8_dequantized":
        return [dequant] + plan_kernels(plan.inner, dtype)
    if route == "fp8_by_head":
        return [(_compiled_q_tiled, _q_tiled_args(plan, dtype)), dequant]
    raise ValueError(f"no runner for route {route!r}")


def _in_place(plan, bound, q, cache, layer, scale, out, parts=None):
    """Launch a compiled kernel over the pages in place: straight into ``out`` and the LSE, or
    (several splits, or the multi-token kernel) into fp32 split partials merged by the combine
    kernel. ``parts``: several launches over disjoint keys of the same queries, (page_table,
    seq_lens, splits, event to wait for or None) each, their partials merged together."""
    from directkv_cute.kernels.launch import launch_combine, launch_decode, link_counters

    total_q, hq, d = q.shape
    counters = link_counters(q.device)  # before any allocation: refused inside a capture that would own them
    partials = _in_place_partials(plan, parts)
    fn = _in_place_kernel(plan, q.dtype, partials)
    tables = bound.tables
    if parts is None:
        parts = [(tables.page_table, tables.seq_lens, plan.splits, None)]
    if out is None:
        out = torch.empty_like(q)
    lse = torch.empty(total_q, hq, dtype=torch.float32, device=q.device)
    if not partials:
        launch_decode(fn, q, out, lse, cache, layer, tables.page_table, tables.seq_lens, bound.cu_q, 1, scale,
                      counters)
        return out, lse
    total = sum(part[2] for part in parts)
    o_part = torch.empty(total, total_q, hq, d, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(total, total_q, hq, dtype=torch.float32, device=q.device)
    first = 0
    for page_table, seq_lens, n_splits, event in parts:
        if event is not None:
            torch.cuda.current_stream(q.device).wait_event(event)
        launch_decode(fn, q, o_part[first:first + n_splits], lse_part[first:first + n_splits], cache, layer,
                      page_table, seq_lens, bound.cu_q, n_splits, scale, counters)
        first += n_splits
    launch_combine(_compiled_combine(d, q.dtype), o_part, lse_part, out, lse, total)
    return out, lse


def _q_tiled(plan, bound, q, cache, layer, scale, out):
    """The Q-tiled kernel over the HBM pool (nothing staged) or over this call's staging buffer,
    in the plan's KV splits (the splits that read only pages ready at the start first, folded into
    one fp32 accumulator in launch order inside the kernel), or in one, the copy landing head by
    head."""
    from directkv_cute.kernels.launch import fold_turn_count, launch_q_tiled, link_counters

    total_q, hq, d = q.shape
    shape, lo = plan.shape, plan.layout
    hkv = shape.num_kv_heads
    sp = plan.staging
    host = cache.host_pool_cuda if cache.host_pool_cuda is not None else cache.host_pool
    tables = bound.tables
    fn = _compiled_q_tiled(*_q_tiled_args(plan, q.dtype))
    if out is None:
        out = torch.empty_like(q)
    lse = torch.empty(total_q, hq, dtype=torch.float32, device=q.device)
    if sp is None:
        ready = link_counters(q.device)  # never read without wait_ready
        launch_q_tiled(fn, q, out, lse, host, cache.hbm_pool, cache.num_layers, layer, hkv, tables.page_table,
                       tables.seq_lens, bound.cu_q, ready, lo.query_tiles, 1, lo.split_tiles, 0, 1, scale)
        return out, lse
    st = stager(q.device, torch.cuda.current_stream(q.device))
    with st.lock:
        fold = None
        if lo.splits > 1:  # (accumulator, its LSE, turn counters)
            fold = (torch.empty(total_q, hq, d, dtype=torch.float32, device=q.device),
                    torch.empty(total_q, hq, dtype=torch.float32, device=q.device),
                    st.fold_turns(fold_turn_count(shape.batch, hkv, lo.query_tiles)))
        buf, flags, epoch = st.stage(cache, layer, sp, lo.by_head, plan.copy_ahead)
        if sp.reads_in_place:  # the pages already in HBM, read where they are
            host = hbm_in_place(cache.hbm_pool, layer)
        launch_q_tiled(fn, q, out, lse, host, buf, 1, 0, hkv, bound.staged_table, tables.seq_lens, bound.cu_q, flags,
                       lo.query_tiles, lo.splits, lo.split_tiles, epoch, lo.piece_tiles, scale,
                       ascending=lo.ascending, flag_stride=len(sp.pieces) if lo.by_head else 0,
                       split_first=lo.first, fold=fold)
        st.finish()
    return out, lse


def _staged_tables(plan, bound):
    from directkv_cute.cache import KernelTables

    return KernelTables(bound.staged_table, bound.tables.seq_lens, host_seq_lens=tuple(plan.shape.seq_lens),
                        host_table=plan.staging.table)


def _fp8_staged_decode(plan, bound, q, cache, layer, scale, out):
    """Long link-bound decode over FP8 pages: the copy engine moves the pages and their scales into
    HBM at its rate, then the FP8 kernel reads them there: in one launch after the whole copy, or
    in two (``fp8_parts``), the first over the first piece while the copy engine moves the second."""
    cur = torch.cuda.current_stream(q.device)
    st = stager(q.device, cur)
    with st.lock:
        raw, scales, landed = st.stage_fp8(cache, layer, plan.staging)  # (pages, 1, Hkv, 2, P, d) FP8; scales
        view = PoolView(raw, raw, q.dtype, scales, scales)
        if not plan.fp8_parts:
            cur.wait_event(landed[0])
            res = _in_place(plan, Bound(_staged_tables(plan, bound), bound.cu_q), q, view, 0, scale, out)
        else:
            parts = [(t, lens, p.splits, ev) for (t, lens), p, ev in zip(bound.parts, plan.fp8_parts, landed)]
            res = _in_place(plan, bound, q, view, 0, scale, out, parts)
        st.finish()
        return res


def _fp8_dequantized(plan, bound, q, cache, layer, scale, out):
    """Multi-token calls over FP8 pages: the pages the batch reads staged (``Stager.stage_fp8``),
    dequantized into a (pages, 1, Hkv, 2, P, d) buffer in the q dtype, then the inner plan over it."""
    from directkv_cute.kernels.launch import launch_dequant

    device = q.device
    st = stager(device, torch.cuda.current_stream(device))
    with st.lock:
        raw, scales, _ = st.stage_fp8(cache, layer, plan.staging)  # (pages, 1, Hkv, 2, P, d) FP8; their scales
        st.finish()  # the current stream waits for the copies
        buf = torch.empty(raw.shape, dtype=q.dtype, device=device)
        launch_dequant(_compiled_dequant(*_dequant_args(plan, q.dtype)), raw, scales,
                       buf)  # before a later call's copies reuse them
    return _run(plan.inner, bound.inner, q, PoolView(buf, buf), 0, scale, out)


def _fp8_by_head(plan, bound, q, cache, layer, scale, out):
    """A multi-token call over FP8 pages, group by group of KV heads: the copy engine moves every
    scale, then each group's blocks of every page (``Stager.stage_fp8`` by group); once group g
    has landed, a high-priority stream dequantizes it into a buffer in the q dtype (its blocks take
    SMs as the attention's CTAs free them, ahead of queued ones), then the Q-tiled kernel runs over
    that group's query rows alone. The launches go round-robin over up to ``FP8_HEAD_STREAMS``
    streams, so that only group 0's copy is exposed."""
    from directkv_cute.kernels.launch import launch_dequant, launch_q_tiled, link_counters
    from directkv_cute.planner import FP8_HEAD_STREAMS

    total_q, hq, _ = q.shape
    shape, lo = plan.shape, plan.layout
    hkv = shape.num_kv_heads
    fn = _compiled_q_tiled(*_q_tiled_args(plan, q.dtype))
    dequant = _compiled_dequant(*_dequant_args(plan, q.dtype))
    if out is None:
        out = torch.empty_like(q)
    lse = torch.empty(total_q, hq, dtype=torch.float32, device=q.device)
    counters = link_counters(q.device)  # never read: the launches wait for no ready flag
    groups = list(plan.head_groups)
    st = stager(q.device, torch.cuda.current_stream(q.device))
    with st.lock:
        raw, scales, landed = st.stage_fp8(cache, layer, plan.staging, groups)
        buf = torch.empty(raw.shape, dtype=q.dtype, device=q.device)
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
                launch_q_tiled(fn, q, out, lse, buf, buf, 1, 0, hkv, bound.staged_table, bound.tables.seq_lens,
                               bound.cu_q, counters, lo.query_tiles, 1, lo.split_tiles, 0, 1, scale,
                               ascending=lo.ascending, heads=heads)
        cur = streams[0]
        for s in (*streams[1:], deq):
            cur.wait_stream(s)
        st.finish()
    return out, lse


def _cascade(plan, bound, q, cache, layer, scale, out):
    """The cascade's passes: every row's own pages, then each shared span once for all its sharers
    (their query rows packed as the heads of one-token pseudo-sequences), merged by their LSE."""
    from directkv_cute.cascade import merge_partials, pack_rows, unpack_rows

    hq, hkv = q.shape[1], plan.shape.num_kv_heads
    (_, own_bound), *spans = bound.passes
    own, *span_passes = plan.passes
    o_own, lse_own = _run(own.plan, own_bound, q, cache, layer, scale, None)
    o_acc, lse_acc = o_own.float(), lse_own.float()
    for p, (idx, b) in zip(span_passes, spans):
        qs = q.index_select(0, idx)  # (n_tok, Hq, d)
        qp, _, _ = pack_rows(qs, hkv)  # (n_pseudo, Hkv * G', d)
        o_s, lse_s = _run(p.plan, b, qp, cache, layer, scale, None)
        o_s, lse_s = unpack_rows(o_s, lse_s, len(idx), hq, hkv, p.g2)
        o_m, lse_m = merge_partials(o_acc.index_select(0, idx), lse_acc.index_select(0, idx), o_s.float(),
                                    lse_s.float())
        o_acc.index_copy_(0, idx, o_m)
        lse_acc.index_copy_(0, idx, lse_m)
    if out is None:
        out = torch.empty_like(q)
    out.copy_(o_acc)
    return out, lse_acc
