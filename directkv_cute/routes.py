"""The routes: each way a call runs, one class each, that binds, runs, lists the kernels of and
explains a plan of its kind.

A route is its name (a ``str``: ``plan.route == "q_tiled_staged"``) with that behaviour; the
planner (``directkv_cute.planner``) puts one in every ``AttentionPlan`` with the record of the
route's own fields (``AttentionPlan.detail``, the route's ``detail`` type). ``runner.bind`` and
``runner.run`` hold what every route shares (the query offsets, the capture fallback, the CPU
reference) and call the plan's route for the rest. Adding a route is a class here and a line in
``ROUTES``.

- ``decode``, ``multi_token``, ``decode_fp8``: one kernel over the pages in place (``InPlace``);
- ``q_tiled_hbm``, ``q_tiled_staged``: the Q-tiled kernel over HBM pages, or over the host pages
  the copy engine stages into HBM piece by piece under it (``QTiled``);
- ``decode_fp8_staged``, ``decode_fp8_two_piece``: FP8 pages staged, then the FP8 decode kernel,
  in one launch or one per piece (``StagedDecode``);
- ``fp8_dequantized``: FP8 pages staged and dequantized, then the inner 16-bit plan (``Dequantized``);
- ``fp8_by_head``: the same group by group of KV heads, each group's Q-tiled launch under the
  next group's copy (``ByHead``);
- ``cascade``: the pages sequences share read once per batch, the passes merged by their LSE
  (``CascadePasses``); ``cascade_staged``: the batch as one staged call (``WholeBatch``);
- ``sparse_decode``: decode rows that read only their best pages, selected per layer on the
  device, then the in-place decode plan over them (``SparseDecode``);
- ``reference``: a CPU cache: the float32 reference.
"""

from __future__ import annotations

import numpy as np
import torch

from directkv_cute.cache.pages import kernel_host_pool
from directkv_cute.cache.tables import KernelTables
from directkv_cute.cascade import merge_partials, pack_rows, unpack_rows
from directkv_cute.kernels import launch
from directkv_cute.plan_types import (ByHead, CascadePasses, Dequantized, InPlace, QTiled, Sparse, StagedDecode,
                                      WholeBatch)
from directkv_cute.reference import cache_scales, tables_attention_ref
from directkv_cute.runner import (Bound, Call, PoolView, bind, compiled_combine, compiled_dequant, compiled_q_tiled,
                                  in_place_kernel, in_place_partials, run_call, tables_from_host)
from directkv_cute.sparse import PageSelector
from directkv_cute.staging import hbm_in_place, stager

# Streams that FP8 chunks run their KV head groups on, at most: one group's launch may fill only
# part of the SMs (its query tiles), so the next groups' launches run beside it.
FP8_HEAD_STREAMS = 4


class Route(str):
    """A way a call runs. Subclasses name it (``name``), the record of its fields in a plan
    (``detail``), and what differs from here: ``bind`` (its device side beyond the query offsets
    and the staged page table), ``run`` (its launches), ``kernels``, and the lines of its
    ``explain``."""

    name = ""
    detail: type | None = None

    def __new__(cls, *_):  # copies and pickles pass the name back
        return super().__new__(cls, cls.name)

    # ---- binding and running -------------------------------------------------------------------
    def bind(self, plan, bound: Bound, device: torch.device, capturing: bool, staged: dict | None) -> None:
        """Make the device side of ``plan`` into ``bound`` (once per plan): here, the staged page
        table of a plan that stages, on the current stream (the launches over it follow the copy);
        ``staged``: such tables already made, by (device, stream), filled here."""
        if plan.staging is None or device.type != "cuda":
            return
        key = (str(device), torch.cuda.current_stream(device).cuda_stream)
        made = None if staged is None else staged.get(key)
        if made is None:
            made = torch.from_numpy(plan.staging.table).to(device, non_blocking=True)
            if staged is not None:
                staged[key] = made
        bound.staged_table = made

    def run(self, plan, bound: Bound, call: Call):
        """(out, lse) of ``plan``'s launches for ``call`` on the GPU."""
        raise ValueError(f"no runner for route {self.name!r}")

    def reference(self, plan, bound: Bound, call: Call):
        """(out, lse) of the float32 reference over the call's pools and tables (a CPU cache)."""
        t, cache = bound.tables, call.cache
        o, lse = tables_attention_ref(call.q, cache.device_pool("host"), cache.device_pool("hbm"), t.page_table,
                                      t.seq_lens, call.layer, list(plan.shape.q_lens), call.scale,
                                      **cache_scales(cache))
        if call.out is not None:
            call.out.copy_(o)
            o = call.out
        return o, lse

    def kernels(self, plan, dtype) -> list[tuple]:
        """The compiled kernels ``run`` launches, as (memoized compile function, its arguments)."""
        raise ValueError(f"no runner for route {self.name!r}")

    # ---- explaining ------------------------------------------------------------------------------
    def describe(self, plan) -> list[str]:
        """The lines of ``explain`` that say how the route reads the pages."""
        return []

    def nested(self, plan) -> list[str]:
        """The lines of ``explain`` after the reasons: the plans this one runs."""
        return []

    def explain(self, plan) -> str:
        """``plan.explain()``: the route, the kernel and its config, the call, how the pages are
        read, the cost model's verdict, the reasons, the plans it runs, the capture's plan."""
        s = plan.shape
        lines = [f"route {self}: kernel {plan.kernel or '-'}" + (f", {plan.config}" if plan.config else "")]
        if s is not None:
            lines.append(f"  call: batch {s.batch}, q_lens {_brief(s.q_lens)}, seq_lens {_brief(s.seq_lens)}, "
                         f"heads {s.num_q_heads}/{s.num_kv_heads}, d {s.head_dim}, page {s.page_size}, "
                         f"pages {str(s.page_dtype).removeprefix('torch.')}")
        lines += self.describe(plan)
        if plan.choice is not None:
            c = plan.choice
            lines.append(f"  cost model ({plan.machine}): in place {c.in_place_ms:.3f} ms, staged {c.staged_ms:.3f} ms"
                         f" at {c.splits} split(s)" + (" (copies ahead)" if c.pipelined else ""))
        lines += [f"  - {w}" for w in plan.why]
        lines += self.nested(plan)
        if plan.capture is not None:
            lines.append(f"  inside a CUDA graph capture: {plan.capture.route} ({plan.capture.kernel})")
        return "\n".join(lines)


def _brief(xs, n: int = 6) -> str:
    xs = list(xs or ())
    return f"[{', '.join(map(str, xs[:n]))}{', ...' if len(xs) > n else ''}]"


def _staged_line(sp, copy_ahead: bool = False) -> str:
    return (f"  staged: {sp.pages} pages ({sp.host_pages} from host) in {len(sp.pieces)} piece(s) of "
            f"{sp.piece_pages}, {sp.copy_calls[0]} host copy calls" + (", copies ahead" if copy_ahead else ""))


def _layout_line(lo) -> str:
    return (f"  Q-tiled: {lo.query_tiles} query tile(s), {lo.splits} split(s) of {lo.split_tiles} tiles"
            + (f", launched from split {lo.first}" if lo.first else "")
            + (", head by head" if lo.by_head else "") + (", lightest first" if lo.ascending else ""))


def _nested(what: str, plan) -> str:
    return f"  {what}: " + plan.explain().replace("\n", "\n  ")


def dequant_args(plan, dtype) -> tuple:
    """``compiled_dequant``'s arguments for a plan over FP8 pages (dequantized to ``dtype``)."""
    shape = plan.shape
    return (shape.page_dtype, dtype, shape.head_dim, shape.page_size)


# ---- in place ----------------------------------------------------------------------------------
def _in_place_kernels(plan, dtype, parts=None) -> list[tuple]:
    partials = in_place_partials(plan, parts)
    fn, args = in_place_kernel(plan, dtype, partials, compile_now=False)
    return [(fn, args)] + ([(compiled_combine, (plan.shape.head_dim, dtype))] if partials else [])


def _in_place(plan, bound: Bound, call: Call, parts=None):
    """Launch a compiled kernel over the pages in place: straight into ``out`` and the LSE, or
    (several splits, or the multi-token kernel) into fp32 split partials merged by the combine
    kernel. ``parts``: several launches over disjoint keys of the same queries, (page_table,
    seq_lens, splits, event to wait for or None) each, their partials merged together."""
    q = call.q
    total_q, hq, d = q.shape
    # before any allocation: refused inside a capture that would own them
    counters = launch.link_counters(q.device, call.capturing)
    partials = in_place_partials(plan, parts)
    fn = in_place_kernel(plan, q.dtype, partials)
    tables = bound.tables
    if parts is None:
        parts = [(tables.page_table, tables.seq_lens, plan.detail.splits, None)]
    out = torch.empty_like(q) if call.out is None else call.out
    lse = torch.empty(total_q, hq, dtype=torch.float32, device=q.device)
    if not partials:
        launch.launch_decode(fn, q, out, lse, call.cache, call.layer, tables.page_table, tables.seq_lens, bound.cu_q,
                             1, call.scale, counters)
        return out, lse
    total = sum(part[2] for part in parts)
    o_part = torch.empty(total, total_q, hq, d, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(total, total_q, hq, dtype=torch.float32, device=q.device)
    first = 0
    for page_table, seq_lens, n_splits, event in parts:
        if event is not None:
            torch.cuda.current_stream(q.device).wait_event(event)
        launch.launch_decode(fn, q, o_part[first:first + n_splits], lse_part[first:first + n_splits], call.cache,
                             call.layer, page_table, seq_lens, bound.cu_q, n_splits, call.scale, counters)
        first += n_splits
    launch.launch_combine(compiled_combine(d, q.dtype), o_part, lse_part, out, lse, total)
    return out, lse


class InPlaceRoute(Route):
    """One kernel reads the pages where they are (host pages through UVA, HBM pages in HBM), in
    the plan's KV splits, merged by the combine kernel."""

    detail = InPlace

    def run(self, plan, bound, call):
        return _in_place(plan, bound, call)

    def kernels(self, plan, dtype):
        return _in_place_kernels(plan, dtype)

    def describe(self, plan):
        return [f"  in place, {plan.detail.splits} split(s)"]


class Decode(InPlaceRoute):
    """The streaming split-KV kernel: every query row of a KV head in one CTA."""

    name = "decode"


class MultiToken(InPlaceRoute):
    """The KV-outer chunk kernel: longer query runs."""

    name = "multi_token"


class DecodeFP8(InPlaceRoute):
    """The streaming kernel over FP8 pages and their scales."""

    name = "decode_fp8"


# ---- the Q-tiled kernel --------------------------------------------------------------------------
class QTiledRoute(Route):
    """The Q-tiled kernel over the HBM pool, or over the call's staging buffer while the copy
    engine lands its pieces (``QTiled``)."""

    detail = QTiled

    @staticmethod
    def q_tiled_args(plan, dtype) -> tuple:
        """``compiled_q_tiled``'s arguments: it waits for ready flags where it reads staged
        pages, and folds its KV splits where it has more than one."""
        shape = plan.shape
        return (plan.config, dtype, shape.head_dim, shape.page_size, shape.group, plan.staging is not None,
                plan.detail.layout.splits > 1)

    def kernels(self, plan, dtype):
        return [(compiled_q_tiled, self.q_tiled_args(plan, dtype))]

    def describe(self, plan):
        d = plan.detail
        return ([] if d.staging is None else [_staged_line(d.staging, d.copy_ahead)]) + [_layout_line(d.layout)]

    def run(self, plan, bound, call):
        """The plan's KV splits (the splits that read only pages ready at the start first) folded
        into one fp32 accumulator in launch order inside the kernel, or one split, the copy
        landing head by head."""
        q, cache = call.q, call.cache
        total_q, hq, d = q.shape
        shape, lo = plan.shape, plan.detail.layout
        hkv = shape.num_kv_heads
        sp = plan.staging
        host = kernel_host_pool(cache)
        tables = bound.tables
        fn = compiled_q_tiled(*self.q_tiled_args(plan, q.dtype))
        out = torch.empty_like(q) if call.out is None else call.out
        lse = torch.empty(total_q, hq, dtype=torch.float32, device=q.device)
        if sp is None:
            ready = launch.link_counters(q.device, call.capturing)  # never read without wait_ready
            launch.launch_q_tiled(fn, q, out, lse, host, cache.hbm_pool, cache.num_layers, call.layer, hkv,
                                  tables.page_table, tables.seq_lens, bound.cu_q, ready, lo.query_tiles, 1,
                                  lo.split_tiles, 0, 1, call.scale)
            return out, lse
        st = stager(q.device, torch.cuda.current_stream(q.device))
        with st.lock:
            fold = None
            if lo.splits > 1:  # (accumulator, its LSE, turn counters)
                fold = (torch.empty(total_q, hq, d, dtype=torch.float32, device=q.device),
                        torch.empty(total_q, hq, dtype=torch.float32, device=q.device),
                        st.fold_turns(launch.fold_turn_count(shape.batch, hkv, lo.query_tiles)))
            buf, flags, epoch = st.stage(cache, call.layer, sp, lo.by_head, plan.detail.copy_ahead)
            if sp.reads_in_place:  # the pages already in HBM, read where they are
                host = hbm_in_place(cache.hbm_pool, call.layer)
            launch.launch_q_tiled(fn, q, out, lse, host, buf, 1, 0, hkv, bound.staged_table, tables.seq_lens,
                                  bound.cu_q, flags, lo.query_tiles, lo.splits, lo.split_tiles, epoch, lo.piece_tiles,
                                  call.scale, ascending=lo.ascending, flag_stride=len(sp.pieces) if lo.by_head else 0,
                                  split_first=lo.first, fold=fold)
            st.finish()
        return out, lse


class QTiledHBM(QTiledRoute):
    """Every page in HBM and enough query tiles to fill a wave: no copy."""

    name = "q_tiled_hbm"


class QTiledStaged(QTiledRoute):
    """Host pages copied into HBM piece by piece under the kernel, where the cost model says the
    copy and its compute beat reading in place."""

    name = "q_tiled_staged"


# ---- FP8 pages -----------------------------------------------------------------------------------
def _staged_tables(plan, bound: Bound) -> KernelTables:
    """The call's tables over its staging buffer (``plan.staging.table`` on the device)."""
    return KernelTables(bound.staged_table, bound.tables.seq_lens, host_seq_lens=tuple(plan.shape.seq_lens),
                        host_table=plan.staging.table)


class StagedDecodeRoute(Route):
    """Long link-bound decode over FP8 pages: the copy engine moves the pages and their scales
    into HBM at its rate, then the FP8 kernel reads them there (``StagedDecode``)."""

    detail = StagedDecode

    def bind(self, plan, bound, device, capturing, staged):
        super().bind(plan, bound, device, capturing, staged)
        if plan.detail.parts and device.type == "cuda":  # each part's (page_table, seq_lens), one copy
            parts = plan.detail.parts
            flat = torch.from_numpy(np.concatenate([np.concatenate([p.table.ravel(), p.lens]) for p in parts])
                                    ).to(device, non_blocking=True)
            out, at = [], 0
            for p in parts:
                out.append((flat[at:at + p.table.size].view(p.table.shape),
                            flat[at + p.table.size:at + p.table.size + len(p.lens)]))
                at += p.table.size + len(p.lens)
            bound.parts = tuple(out)

    def kernels(self, plan, dtype):
        return _in_place_kernels(plan, dtype, plan.detail.parts or None)

    def describe(self, plan):
        d = plan.detail
        return ([] if d.parts else [f"  in place, {d.splits} split(s)"]) + [_staged_line(d.staging)]

    def run(self, plan, bound, call):
        """In one launch after the whole copy, or in two (``parts``), the first over the first
        piece while the copy engine moves the second."""
        q = call.q
        cur = torch.cuda.current_stream(q.device)
        st = stager(q.device, cur)
        with st.lock:
            # (pages, 1, Hkv, 2, P, d) FP8; their scales; an event per piece
            raw, scales, landed = st.stage_fp8(call.cache, call.layer, plan.staging)
            on_buffer = call.replace(cache=PoolView(raw, raw, q.dtype, scales, scales), layer=0)
            if not plan.detail.parts:
                cur.wait_event(landed[0])
                res = _in_place(plan, Bound(_staged_tables(plan, bound), bound.cu_q), on_buffer)
            else:
                parts = [(t, lens, p.splits, ev) for (t, lens), p, ev in zip(bound.parts, plan.detail.parts, landed)]
                res = _in_place(plan, bound, on_buffer, parts)
            st.finish()
            return res


class DecodeFP8Staged(StagedDecodeRoute):
    """A staged FP8 decode in one launch after the copy (more than one query token per sequence)."""

    name = "decode_fp8_staged"


class DecodeFP8TwoPiece(StagedDecodeRoute):
    """A staged FP8 decode in two launches, the first under the second piece's copy."""

    name = "decode_fp8_two_piece"


class FP8Dequantized(Route):
    """Multi-token calls over FP8 pages: the pages the batch reads staged (``Stager.stage_fp8``),
    dequantized into a buffer in the q dtype, then the inner plan over it (``Dequantized``)."""

    name = "fp8_dequantized"
    detail = Dequantized

    def bind(self, plan, bound, device, capturing, staged):
        super().bind(plan, bound, device, capturing, staged)
        if device.type == "cuda":  # the inner plan reads the buffer: the staged table, every page in HBM
            bound.inner = Bound(_staged_tables(plan, bound), bound.cu_q)

    def kernels(self, plan, dtype):
        inner = plan.detail.inner
        return [(compiled_dequant, dequant_args(plan, dtype))] + inner.route.kernels(inner, dtype)

    def describe(self, plan):
        return [_staged_line(plan.staging)]

    def nested(self, plan):
        return [_nested("then over the dequantized pages", plan.detail.inner)]

    def run(self, plan, bound, call):
        q = call.q
        device = q.device
        st = stager(device, torch.cuda.current_stream(device))
        with st.lock:
            # (pages, 1, Hkv, 2, P, d) FP8; their scales
            raw, scales, _ = st.stage_fp8(call.cache, call.layer, plan.staging)
            st.finish()  # the current stream waits for the copies
            buf = torch.empty(raw.shape, dtype=q.dtype, device=device)
            launch.launch_dequant(compiled_dequant(*dequant_args(plan, q.dtype)), raw, scales,
                                  buf)  # before a later call's copies reuse them
        return run_call(plan.detail.inner, bound.inner, call.replace(cache=PoolView(buf, buf), layer=0))


class FP8ByHead(Route):
    """A multi-token call over FP8 pages, group by group of KV heads (``ByHead``): the copy engine
    moves every scale, then each group's blocks of every page (``Stager.stage_fp8`` by group);
    once group g has landed, a high-priority stream dequantizes it into a buffer in the q dtype
    (its blocks take SMs as the attention's CTAs free them, ahead of queued ones), then the
    Q-tiled kernel runs over that group's query rows alone. The launches go round-robin over up
    to ``FP8_HEAD_STREAMS`` streams, so that only group 0's copy is exposed."""

    name = "fp8_by_head"
    detail = ByHead

    @staticmethod
    def q_tiled_args(plan, dtype) -> tuple:
        """``compiled_q_tiled``'s arguments: over dequantized buffers, waiting for no ready flag,
        one split each."""
        shape = plan.shape
        return (plan.config, dtype, shape.head_dim, shape.page_size, shape.group, False, False)

    def kernels(self, plan, dtype):
        return [(compiled_q_tiled, self.q_tiled_args(plan, dtype)), (compiled_dequant, dequant_args(plan, dtype))]

    def describe(self, plan):
        return [_staged_line(plan.staging), _layout_line(plan.detail.layout)]

    def run(self, plan, bound, call):
        q = call.q
        total_q, hq, _ = q.shape
        shape, lo = plan.shape, plan.detail.layout
        hkv = shape.num_kv_heads
        fn = compiled_q_tiled(*self.q_tiled_args(plan, q.dtype))
        dequant = compiled_dequant(*dequant_args(plan, q.dtype))
        out = torch.empty_like(q) if call.out is None else call.out
        lse = torch.empty(total_q, hq, dtype=torch.float32, device=q.device)
        counters = launch.link_counters(q.device, call.capturing)  # never read: the launches wait for no flag
        groups = list(plan.detail.head_groups)
        st = stager(q.device, torch.cuda.current_stream(q.device))
        with st.lock:
            raw, scales, landed = st.stage_fp8(call.cache, call.layer, plan.staging, groups)
            buf = torch.empty(raw.shape, dtype=q.dtype, device=q.device)
            n_streams = min(len(groups), FP8_HEAD_STREAMS)
            streams = st.streams(n_streams)
            deq = st.urgent_stream()
            for i, heads in enumerate(groups):
                deq.wait_event(landed[i])
                with torch.cuda.stream(deq):
                    launch.launch_dequant(dequant, raw, scales, buf, heads)
                    ready = torch.cuda.Event()
                    ready.record(deq)
                s = streams[i % n_streams]
                s.wait_event(ready)
                with torch.cuda.stream(s):
                    launch.launch_q_tiled(fn, q, out, lse, buf, buf, 1, 0, hkv, bound.staged_table,
                                          bound.tables.seq_lens, bound.cu_q, counters, lo.query_tiles, 1,
                                          lo.split_tiles, 0, 1, call.scale, ascending=lo.ascending, heads=heads)
            cur = streams[0]
            for s in (*streams[1:], deq):
                cur.wait_stream(s)
            st.finish()
        return out, lse


# ---- shared pages --------------------------------------------------------------------------------
class Cascade(Route):
    """The cascade's passes (``CascadePasses``): every row's own pages, then each shared span once
    for all its sharers (their query rows packed as the heads of one-token pseudo-sequences),
    merged by their LSE. On a CPU each pass runs the reference."""

    name = "cascade"
    detail = CascadePasses

    def bind(self, plan, bound, device, capturing, staged):
        """Each pass's tables (its rows' pages, from the call's host table), the row indices it
        gathers, and its plan's device side."""
        cu = np.concatenate(([0], np.cumsum(plan.shape.q_lens)))
        passes = []
        for p in plan.detail.passes:
            sub = tables_from_host(p.shape.host_table, p.shape.seq_lens, device, bound.tables)
            idx = None
            if p.rows is not None:
                idx = torch.from_numpy(np.concatenate([np.arange(cu[r], cu[r + 1]) for r in p.rows])).to(
                    device, non_blocking=True)
            passes.append((idx, bind(p.plan, sub, device, capturing)))
        bound.passes = tuple(passes)

    def kernels(self, plan, dtype):
        return [k for p in plan.detail.passes for k in p.plan.route.kernels(p.plan, dtype)]

    def nested(self, plan):
        return [_nested(f"pass over {'every row' if p.rows is None else f'rows {_brief(p.rows)}'}", p.plan)
                for p in plan.detail.passes]

    def run(self, plan, bound, call):
        q = call.q
        hq, hkv = q.shape[1], plan.shape.num_kv_heads
        (_, own_bound), *spans = bound.passes
        own, *span_passes = plan.detail.passes
        o_own, lse_own = run_call(own.plan, own_bound, call.replace(out=None))
        o_acc, lse_acc = o_own.float(), lse_own.float()
        for p, (idx, b) in zip(span_passes, spans):
            qs = q.index_select(0, idx)  # (n_tok, Hq, d)
            qp, _, _ = pack_rows(qs, hkv)  # (n_pseudo, Hkv * G', d)
            o_s, lse_s = run_call(p.plan, b, call.replace(q=qp, out=None))
            o_s, lse_s = unpack_rows(o_s, lse_s, len(idx), hq, hkv, p.g2)
            o_m, lse_m = merge_partials(o_acc.index_select(0, idx), lse_acc.index_select(0, idx), o_s.float(),
                                        lse_s.float())
            o_acc.index_copy_(0, idx, o_m)
            lse_acc.index_copy_(0, idx, lse_m)
        out = torch.empty_like(q) if call.out is None else call.out
        out.copy_(o_acc)
        return out, lse_acc

    reference = run


class CascadeStaged(Route):
    """A batch whose rows share pages run as one staged call of the whole batch (``WholeBatch``)."""

    name = "cascade_staged"
    detail = WholeBatch

    def bind(self, plan, bound, device, capturing, staged):
        bound.inner = bind(plan.detail.inner, bound.tables, device, capturing)

    def kernels(self, plan, dtype):
        inner = plan.detail.inner
        return inner.route.kernels(inner, dtype)

    def nested(self, plan):
        return [_nested("the whole batch", plan.detail.inner)]

    def run(self, plan, bound, call):
        return run_call(plan.detail.inner, bound.inner, call)


class SparseDecode(Route):
    """Decode rows that read only their best pages (``Sparse``): per layer, a ``sparse.PageSelector``
    bound once per plan writes each row's pages into a compact table, then the inner in-place
    decode plan reads it."""

    name = "sparse_decode"
    detail = Sparse

    def bind(self, plan, bound, device, capturing, staged):
        t, b = bound.tables, plan.detail.budget
        bound.selector = PageSelector(t.page_table, t.seq_lens, plan.shape.page_size, plan.detail.pages,
                                      b.sink_pages, b.recent_pages, device)
        bound.inner = bind(plan.detail.inner, KernelTables(bound.selector.table, bound.selector.lens), device,
                           capturing)

    def kernels(self, plan, dtype):
        inner = plan.detail.inner
        return inner.route.kernels(inner, dtype)

    def describe(self, plan):
        return [f"  sparse: {plan.detail.pages} pages per row ({plan.detail.budget}), chosen per layer by their "
                "estimated share of the heads' attention"]

    def nested(self, plan):
        return [_nested("over the selected pages", plan.detail.inner)]

    def run(self, plan, bound, call):
        summaries = getattr(call.cache, "summaries", None)
        if summaries is None:
            raise ValueError("a sparse plan needs the cache's page summaries (PagedKVCache(..., summaries=True))")
        bound.selector.select(call.q, summaries, call.layer, call.scale, call.capturing)
        for hook in call.sparse_hooks:  # what the selection is watched by (a measurement, a recall cache)
            hook.selected(call, bound.tables.page_table, bound.tables.seq_lens, bound.selector.table)
        return run_call(plan.detail.inner, bound.inner, call)

    reference = run


class Reference(Route):
    """A CPU cache: the float32 reference (``Route.reference``); no kernel."""

    name = "reference"


# Every route, in the order the docs list them.
ROUTES: tuple[Route, ...] = (
    Decode(), MultiToken(), QTiledHBM(), QTiledStaged(), DecodeFP8(), DecodeFP8Staged(), DecodeFP8TwoPiece(),
    FP8Dequantized(), FP8ByHead(), Cascade(), CascadeStaged(), SparseDecode(), Reference(),
)
BY_NAME = {r.name: r for r in ROUTES}


def get(name: str) -> Route:
    """The route named ``name``."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"no route {name!r}; routes: {sorted(BY_NAME)}") from None
