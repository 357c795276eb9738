"""Shared prefixes: ``python -m bench prefix`` -- batches of sequences forked from one prompt,
the cascade (``directkv_cute.cascade``: a shared page read once per batch) against the
per-sequence kernels (a shared page read once per sequence) and the baselines.

    python -m bench prefix                          # the 18 rows below + the no-sharing control
    python -m bench prefix --batches 16 --own-tokens 1024 --q-lens 1   # one row
    python -m bench prefix --device cpu             # smoke: a 512-token prompt, batch 4, the reference

**Rows.** ``--batches`` (4 / 16 / 64) sequences forked (``PagedKVCache.fork``) from one
``--prompt``-token prompt (32k), each then given ``--own-tokens`` (0 / 1k / 8k) tokens of its own,
then one step of ``--q-lens`` (1: decode, 16) new tokens appended to every sequence before it
attends (so a "0 own tokens" row still holds the q_len new ones): page 64, bf16, Hq/Hkv 32/8,
head_dim 128, one layer. Every sequence of a row has the same length, ``context = prompt + own +
q_len`` (the record's ``context``). The cache (host tier pinned, sized to the pages the row needs;
its HBM tier as large, for the HBM rows) holds the prompt once: the prompt is appended to one
sequence, which is forked ``batch`` times and then freed. A **control row** (``bench`` field
``prefix-distinct``; ``--control-batch`` 16 sequences of ``prompt`` distinct tokens each, decode,
no sharing; ``--no-control`` leaves it out) runs last, so the time budget drops it first.

**Methods** (records as in ``bench decode`` / ``prefill``, ``bench.common.RECORD_FIELDS``):

* ``floor``: the batch's unique host bytes (``CascadePlan.host_pages_read`` x page bytes) at the
  host-read ceiling measured in the same run (computed, not timed);
* ``ours[cascade]``: ``cascade_attention`` with the page tables (``kernel_tables``), the plan
  (``plan_cascade``) and its device side (``prepare_cascade``) built once outside the timed loop,
  as a model step builds them once for all its layers (``directkv_cute.hf`` does). Planning alone
  (``plan_cascade`` on the host table) is timed on the host and reported as ``plan_ms`` (ms per
  step), ``prepare_cascade`` as ``prepare_ms``, in the row's summary and in ``notes``;
* ``ours[per-seq]``: ``paged_attention_tables`` over the same tables with the in-place kernel's
  config given explicitly (each sequence's pages read in place by the paged kernels: the path
  of every sequence without a cascade);
* ``ours[op]``: ``paged_attention_tables`` with no config, the op's own choice without a cascade:
  a long link-bound read is staged through the copy engine, and staging copies each distinct page
  once (its host bytes are then the unique pages);
* ``hbm``: torch SDPA over dense per-sequence KV in HBM, as in the other benches (its output is
  the pivot every other method is compared with);
* ``zero_copy``: SDPA over a CUDA view of the same dense KV in pinned host memory;
* ``swap``: the dense KV copied into an HBM staging buffer, then SDPA;
* ``fa4[hbm]`` (dense KV in HBM) and ``fa4[zero_copy_paged]`` (FA4's ``page_table`` path over
  pinned host K/V pools holding the row's unique pages, with the cache's sharing: a shared page is
  one pool page, named by every sharer's table) when flash-attn-4 imports (``bench.peers``);
  otherwise, and with ``--no-peers``, left out with a note;
* ``ours[cascade]`` and ``ours[per-seq]`` again with every page moved to the cache's HBM tier
  (``hbm_fraction`` 1.0; ``--no-hbm`` leaves them out): the kernels' compute-side limit. A row
  is *link-bound* when its floor is at least ours[cascade]'s HBM time.

``host_bytes`` of a record is what the method reads from host memory: the unique pages for the
cascade and the floor, every sequence's pages (``host_pages_naive``) for the per-sequence kernel
and FA4's paged path, every sequence's dense KV for zero_copy and swap.

**Columns**: time (ms), host MB read, ``KV tok/s`` = the *attended KV tokens per second*,
defined as the sum of ``seq_len`` over the batch divided by the method's time (each sequence's
whole context counted once per step, however often its pages are shared), ``x floor`` (time /
floor) and, on ours[cascade]'s lines, its speedup over ours[per-seq] at the same placement.

**Correctness before timing.** As in the harness (``bench.harness.ShapeBench``, which this bench
extends): every method's output is checked against an independent float32 anchor computed from
the generated dense KV (the last query rows of the first, middle and last sequence) and against
the ``hbm`` baseline's whole output (max |error| / max |reference| <= ``--tol``); ours writes
into a NaN-poisoned output. A method that fails is not timed (``ms: null``), its row is marked
``FAIL`` and the run fails (exit status 1).

**Timing**: ``bench.common.time_calls`` (CUDA events, warm-up, median of samples, each behind a
GPU sleep so that ``ms`` is device time). ``--time-budget-s`` stops starting rows after that many
seconds (rows are sorted cheapest first, the control row last); the JSON is rewritten after
every row.

**Targets** (printed at the end as MET / MISS lines, and in the JSON's ``targets``):

* batch 16, 1k own tokens, decode: ours[cascade] >= 8x faster than ours[per-seq];
* link-bound rows: ours[cascade] <= 1.15 x floor;
* batch 16: attended KV tokens/s >= 4 x (host ceiling bytes/s / KV bytes per token), i.e. the
  batch served at four times the rate the link could deliver distinct KV (at the floor a row
  reaches naive / unique bytes times the link rate, printed with each line);
* the control row: ours[cascade] no slower than ours[per-seq] (<= 1.03x: timing noise).

**Files** under ``--out-dir`` (default ./bench-results): ``<gpu>-<date>-prefix.json`` (the
``directkv-bench/1`` results document of the other benches, plus ``rows``: one summary per row,
and ``targets``), the table as ``.txt`` and ``-prefix.png`` (time per method against batch, one
panel per own-token count and q_len) when matplotlib is installed (else ``python -m bench plot
--results FILE`` afterwards).

**``--device cpu``**: a smoke run of the whole code path in seconds (a 512-token prompt, batch
4, 0 / 40 own tokens, q_len 1 / 4, Hq/Hkv 4/2, d 64, page 16, float32): ``cascade_attention``
and the per-sequence op run through the project's reference there, the SDPA baselines on the
CPU; no meaningful timing, so it prints no ceilings, no targets and no ``x floor``, and draws no
plot.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bench import peers
from bench.common import (CEILING_METHODS, GiB, MiB, Ceilings, Shape, UsageError, add_check, add_device_argument,
                          add_out_dir_argument, checked_out_dir, dtype_name, env_info, is_cpu_run, new_results,
                          problem_lines, progress_bar, require_gpu, results_path, save_figure, shape_key,
                          write_json, write_run_files)
from bench.common import fmt_opt as _fmt
from bench.common import kilo as _kilo
from bench.harness import BenchOptions, ShapeBench, _Inputs, memory_problem, _short_error, peak_extra_bytes
from bench.hostmem import PinnedBuffer
from bench.methods import q_as_4d

BENCH = "prefix"
CONTROL_BENCH = "prefix-distinct"

CASCADE, PER_SEQ, OP = "ours[cascade]", "ours[per-seq]", "ours[op]"
FA4_METHODS = ("fa4[hbm]", "fa4[zero_copy_paged]")
METHOD_ORDER = ("floor", CASCADE, PER_SEQ, OP, "hbm", "zero_copy", "swap") + FA4_METHODS

# The targets.
SPEEDUP_TARGET = 8.0  # ours[cascade] over ours[per-seq] at SPEEDUP_ROW
SPEEDUP_ROW = (16, 1024, 1)  # (batch, own tokens, q_len)
FLOOR_FACTOR = 1.15  # link-bound rows: ours[cascade] <= this x floor
LINK_MULTIPLE = 4.0  # attended KV tokens/s >= this x the link's rate in KV tokens, at LINK_MULTIPLE_BATCH
LINK_MULTIPLE_BATCH = 16
CONTROL_SLACK = 1.03  # the control row: ours[cascade] <= this x ours[per-seq]

GPU_DEFAULTS = dict(prompt=32768, batches=[4, 16, 64], own_tokens=[0, 1024, 8192], q_lens=[1, 16], heads=(32, 8),
                    head_dim=128, page_size=64, dtype="bfloat16", control_batch=16)
CPU_DEFAULTS = dict(prompt=512, batches=[4], own_tokens=[0, 40], q_lens=[1, 4], heads=(4, 2), head_dim=64,
                    page_size=16, dtype="float32", control_batch=4)
CPU_TIMING = dict(warmup=1, reps=2, max_rep_s=0.05, min_sample_ms=0.01)


# ---- rows ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrefixRow:
    """One row: ``batch`` sequences of ``prompt`` shared tokens (distinct ones for the control
    row, ``shared`` False), ``own`` tokens of their own, then a step of ``q_len`` new tokens."""

    batch: int
    prompt: int
    own: int
    q_len: int
    hq: int
    hkv: int
    head_dim: int
    dtype: str
    shared: bool = True

    @property
    def context(self) -> int:
        return self.prompt + self.own + self.q_len

    @property
    def shape(self) -> Shape:
        return Shape(BENCH if self.shared else CONTROL_BENCH, self.batch, self.context, self.q_len, self.hq,
                     self.hkv, self.head_dim, self.dtype)

    @property
    def label(self) -> str:
        what = f"own{_kilo(self.own)}" if self.shared else "distinct"
        return f"B{self.batch} prompt{_kilo(self.prompt)} {what} q{self.q_len}"

    @property
    def dense_bytes(self) -> int:
        """Every sequence's K/V, dense (what zero_copy and swap read)."""
        return self.shape.kv_bytes

    def unique_tokens(self) -> int:
        """Distinct KV tokens of the batch (the prompt once when shared)."""
        if not self.shared:
            return self.batch * self.context
        return self.prompt + self.batch * (self.own + self.q_len)


def rows_for(*, prompt: int, batches, own_tokens, q_lens, heads, head_dim: int, dtype: str, control: bool,
             control_batch: int) -> list[PrefixRow]:
    """The bench's rows, cheapest first (by dense KV bytes x q_len), the control row last."""
    hq, hkv = heads
    rows = [PrefixRow(b, prompt, own, q, hq, hkv, head_dim, dtype) for b in batches for own in own_tokens
            for q in q_lens]
    rows.sort(key=lambda r: (r.dense_bytes * r.q_len, r.batch, r.own))
    if control:
        rows.append(PrefixRow(control_batch, prompt, 0, 1, hq, hkv, head_dim, dtype, shared=False))
    return rows


def footprint(row: PrefixRow, page_size: int) -> tuple[int, int]:
    """Peak (host, GPU) bytes of a row: the dense KV pinned plus the cache's pool and FA4's
    unique-page pool on the host; the dense KV, a second dense copy (swap's staging or FA4's
    layout) and the cache's HBM tier (as large as its host tier) plus a gather of it on the GPU."""
    s = row.shape
    pages = _pages_needed(row, page_size)
    pool = pages * 2 * s.hkv * page_size * s.head_dim * s.elem_bytes
    return row.dense_bytes + 2 * pool, 2 * row.dense_bytes + 2 * pool


def _pages_needed(row: PrefixRow, page: int) -> int:
    if not row.shared:
        return row.batch * math.ceil(row.context / page)
    # the prompt's pages once, each sequence's partial prompt page (copied by fork) and its tail
    return math.ceil(row.prompt / page) + row.batch * (math.ceil((row.own + row.q_len) / page) + 1)


def skip_reason(row: PrefixRow, opts: BenchOptions) -> str | None:
    if row.dense_bytes > opts.max_gb * GiB:
        return f"dense KV {row.dense_bytes / GiB:.1f} GiB > --max-gb {opts.max_gb:g}"
    host, gpu = footprint(row, opts.page_size)
    return memory_problem(host, gpu, opts.device)


# ---- one row ---------------------------------------------------------------------------------
class PrefixBench(ShapeBench):
    """Every method on one row (``run()`` returns its records; checks and notes go to ``doc``).

    Reuses the harness's checks, SDPA baselines (hbm, zero_copy, swap), peer runner and timing;
    builds the forked cache and runs the cascade and per-sequence kernels itself."""

    def __init__(self, row: PrefixRow, opts: BenchOptions, ceilings: Ceilings, doc: dict, *, hbm_rows: bool = True):
        super().__init__(row.shape, opts, ceilings, doc)
        self.row = row
        self.hbm_rows = hbm_rows
        self.sets = 1  # every row is over 256 MiB of KV: one input set, nothing to rotate
        b = row.batch
        self.anchor_at = (sorted({0, b // 2, b - 1}), min(row.q_len, 16))
        self.cache = None
        self.seq_ids: list[int] = []
        self.tables = None
        self.plan = None
        self.prepared = None
        self.summary: dict = {}

    # -- driver --
    def run(self):
        try:
            self._build_inputs()
            self._build_anchor()
            self._plan()
            self._baselines()
            self._peers()
            self._release_host()
            self.inputs.kv_dev = []  # the anchor and the pivot are computed: the dense KV may go
            self.timer.sync()
            self._ours_all()
        finally:
            self._release_all()
        return self.records

    def _release_all(self) -> None:
        self.timer.sync()
        if self.cache is not None:
            self.cache.close()  # unpin the pool now rather than at garbage collection
            self.cache = None
        self.tables = self.prepared = None
        super()._release_all()

    # -- inputs: dense KV (baselines, anchor) and the forked cache holding the same tokens --
    def _build_inputs(self) -> None:
        from directkv_cute.cache import PagedKVCache

        row, s, opts = self.row, self.shape, self.opts
        dev, dt = opts.device, self.dtype
        gen = torch.Generator(device=dev).manual_seed(opts.seed)
        q = torch.randn(s.batch * s.q_len, s.hq, s.head_dim, generator=gen, device=dev, dtype=dt)
        kv = torch.randn(2, s.batch, s.hkv, s.context, s.head_dim, generator=gen, device=dev, dtype=dt)
        if row.shared:
            kv[:, 1:, :, :row.prompt] = kv[:, :1, :, :row.prompt]  # one prompt for every sequence
        pages = _pages_needed(row, opts.page_size)
        self.cache = PagedKVCache(1, s.hkv, s.head_dim, opts.page_size, num_host_pages=pages,
                                  num_hbm_pages=pages if self.hbm_rows else 0, dtype=dt, device=dev)
        cache = self.cache

        def tokens(b: int, lo: int, hi: int):  # (n, 1 layer, Hkv, d) K and V of sequence b
            return tuple(kv[i, b, :, lo:hi].permute(1, 0, 2).unsqueeze(1).contiguous() for i in (0, 1))

        if row.shared:
            root = cache.add_sequence()
            cache.append(root, *tokens(0, 0, row.prompt))
            self.seq_ids = [cache.fork(root) for _ in range(s.batch)]
            cache.free(root)  # the forks hold the prompt's pages
            for b, sid in enumerate(self.seq_ids):
                if row.own:
                    cache.append(sid, *tokens(b, row.prompt, row.prompt + row.own))
        else:
            self.seq_ids = [cache.add_sequence() for _ in range(s.batch)]
            for b, sid in enumerate(self.seq_ids):
                cache.append(sid, *tokens(b, 0, s.context - s.q_len))
        for b, sid in enumerate(self.seq_ids):  # the step: q_len new tokens each, before attending
            cache.append(sid, *tokens(b, s.context - s.q_len, s.context))
        host = PinnedBuffer(kv.shape, dt, dev)
        host.cpu.copy_(kv)
        self.timer.sync()
        self.inputs = _Inputs(qs=[q], kv_dev=[kv], host=[host])

    # -- the plan, its host time and the floor --
    def _plan(self) -> None:
        from directkv_cute.cascade import plan_cascade

        s, page = self.shape, self.opts.page_size
        self._prepare()
        t = self.tables
        q_lens = [s.q_len] * s.batch
        self.summary = {
            "plan_ms": _host_ms(lambda: plan_cascade(t.host_table, t.host_seq_lens, q_lens, page)),
            "prepare_ms": _host_ms(self._prepare_call) if self.plan.shared else 0.0}
        self.page_bytes = 2 * s.hkv * page * s.head_dim * s.elem_bytes  # one layer
        self.unique_bytes = self.plan.host_pages_read * self.page_bytes
        self.naive_bytes = self.plan.host_pages_naive * self.page_bytes
        plan = self.plan
        self.summary |= {
            "shared": plan.shared, "spans": len(plan.spans),
            "span_pages": [s.page_hi - s.page_lo for s in plan.spans][:8],
            "host_pages_naive": plan.host_pages_naive, "host_pages_read": plan.host_pages_read,
            "page_bytes": self.page_bytes, "unique_bytes": self.unique_bytes, "naive_bytes": self.naive_bytes,
            "dense_bytes": self.row.dense_bytes}
        key = shape_key(s.fields())
        self.doc["notes"].setdefault("plan_ms", {})[key] = self.summary["plan_ms"]
        self.doc["notes"].setdefault("prepare_ms", {})[key] = self.summary["prepare_ms"]
        self._add("floor", self.ceilings.ideal_ms(self.unique_bytes, 0), host_bytes=self.unique_bytes)

    def _prepare(self) -> None:
        """The step's tables, plan and prepared cascade (its device tables), built once outside
        the timed loop as a model step builds them once for all its layers."""
        from directkv_cute.cascade import plan_cascade

        s = self.shape
        t = self.tables = self.cache.kernel_tables(self.seq_ids)
        self.plan = plan_cascade(t.host_table, t.host_seq_lens, [s.q_len] * s.batch, self.opts.page_size)
        self.prepared = self._prepare_call() if self.plan.shared else None

    def _prepare_call(self):
        from directkv_cute.ops import prepare_cascade

        return prepare_cascade(self.cache, self.tables, self.plan, self.shape.hq, self.inputs.qs[0].device)

    # -- peers: FA4 over the same sharing --
    def _peers(self) -> None:
        if not self.opts.peers:
            return
        why = peers.unavailable(self.opts.device)
        if why is not None:
            self.doc["notes"]["peers"] = why
            return
        s, kv = self.shape, self.shape.kv_bytes
        try:
            fa = self._fa4_inputs()
        except Exception as e:  # noqa: BLE001 - out of memory for the copies: the peer is missing
            self._peer_missing(FA4_METHODS, f"FA4 inputs: {_short_error(e)}")
            return
        try:
            q = self.inputs.qs[0]
            self._peer_method("fa4[hbm]", [peers.hbm_call(q, fa, s.batch, s.q_len)], hbm_bytes=kv, hbm_fraction=1.0,
                              resident=kv)
            fa.dense = None  # only the paged host pools from here on
            gc.collect()
            self._peer_method("fa4[zero_copy_paged]", [peers.zero_copy_paged_call(q, fa, s.q_len)],
                              host_bytes=self.naive_bytes, resident=0)
        finally:
            self.timer.sync()
            fa.host.close()
            del fa
            gc.collect()

    def _fa4_inputs(self) -> "peers.Fa4Inputs":
        """FA4's layouts: dense (2, B, S, Hkv, d) in HBM, and pinned host K/V pools
        (2, unique pages, P, Hkv, d) holding the row's unique pages, its page table naming them
        with the cache's sharing (a shared page is one pool page)."""
        s, page = self.shape, self.opts.page_size
        dense = self.inputs.kv_dev[0].permute(0, 1, 3, 2, 4).contiguous()
        n_pages = math.ceil(s.context / page)
        table = np.asarray(self.tables.host_table)[:, :n_pages]
        if (table < 0).any():
            raise RuntimeError("a freshly built row has pages outside the host tier")
        uniq, inv = np.unique(table, return_inverse=True)
        pool = self.cache.device_pool("host")  # (pages, 1, Hkv, 2, P, d)
        idx = torch.from_numpy(uniq.astype(np.int64)).to(pool.device)
        pages = pool[idx, 0]  # (U, Hkv, 2, P, d)
        host = PinnedBuffer((2, len(uniq), page, s.hkv, s.head_dim), self.dtype, self.opts.device)
        host.cpu.copy_(pages.permute(2, 0, 3, 1, 4))
        del pages
        dev = self.inputs.qs[0].device
        page_table = torch.from_numpy(inv.reshape(table.shape).astype(np.int32)).to(dev)
        seqused = torch.full((s.batch,), s.context, dtype=torch.int32, device=dev)
        cu_q = torch.arange(0, (s.batch + 1) * s.q_len, s.q_len, dtype=torch.int32, device=dev)
        self.timer.sync()
        return peers.Fa4Inputs(dense, host, page_table, seqused, cu_q)

    # -- ours --
    def _ops(self):
        """(cascade call, per-sequence call, the op's own call, whether the op stages) for the
        current tables and plan."""
        from directkv_cute.ops import cascade_attention

        s, cache, ids = self.shape, self.cache, self.seq_ids
        q = self.inputs.qs[0]
        q_lens = [s.q_len] * s.batch
        per_lens = None if s.q_len == 1 else q_lens
        staged = False
        if self.opts.device == "cuda":
            from directkv_cute.attention import DirectKVAttention
            from directkv_cute.ops import paged_attention_tables

            plan = DirectKVAttention(cache).plan(tables=self.tables, q_lens=q_lens, num_q_heads=s.hq, cascade=False)
            staged = plan.staged
            in_place_plan = plan.capture if plan.capture is not None else plan  # what reads in place
            in_place = in_place_plan.config if in_place_plan.kernel in ("decode", "multi_token") else None

            def per_seq(out):
                return paged_attention_tables(q, cache, 0, self.tables, per_lens, out=out, config=in_place)

            def op(out):
                return paged_attention_tables(q, cache, 0, self.tables, per_lens, out=out)
        else:  # the CPU path of the op is the reference (paged_attention_tables needs CUDA tables)
            from directkv_cute.ops import paged_attention

            def per_seq(out):
                return paged_attention(q, cache, 0, ids, per_lens, out=out)

            op = per_seq

        def cascade(out):
            return cascade_attention(q, cache, 0, ids, q_lens, tables=self.tables, plan=self.plan,
                                     prepared=self.prepared, out=out)

        return cascade, per_seq, op, staged

    def _ours_all(self) -> None:
        cascade, per_seq, op, staged = self._ops()
        self._ours_method(CASCADE, cascade, host_bytes=self.unique_bytes)
        self._ours_method(PER_SEQ, per_seq, host_bytes=self.naive_bytes)
        self._ours_method(OP, op, host_bytes=self.unique_bytes if staged else self.naive_bytes)
        if not self.hbm_rows:
            return
        try:
            self._all_pages_to_hbm()
        except Exception as e:  # noqa: BLE001 - a failed page move fails the run, not the bench
            add_check(self.doc, self.shape, "ours", False, hbm_fraction=1.0, against="move_pages",
                      detail=_short_error(e))
            for m in (CASCADE, PER_SEQ):
                self._add(m, None, hbm_fraction=1.0)
            return
        resident = self.summary["host_pages_read"] * self.page_bytes
        cascade, per_seq, _, _ = self._ops()  # the tables changed: the in-place config too
        self._ours_method(CASCADE, cascade, hbm_bytes=self.unique_bytes, fraction=1.0, resident=resident)
        self._ours_method(PER_SEQ, per_seq, hbm_bytes=self.naive_bytes, fraction=1.0, resident=resident)

    def _all_pages_to_hbm(self) -> None:
        """Every page of the row to the cache's HBM tier (a shared page moves once, for all its
        sharers), then fresh tables and plan."""
        page = self.opts.page_size
        self.tables = self.prepared = None
        for sid in self.seq_ids:
            self.cache.move_pages(sid, range(math.ceil(self.cache.seq_len(sid) / page)), "hbm")
        self.timer.sync()
        self._prepare()
        if self.plan.host_pages_read or (np.asarray(self.tables.host_table) >= 0).any():
            raise RuntimeError("pages left in the host tier after moving every page to HBM")

    def _ours_method(self, method: str, op, *, host_bytes: int = 0, hbm_bytes: int = 0, fraction: float = 0.0,
                     resident: int = 0) -> None:
        """Check one of ours (NaN-poisoned output, anchor + pivot), then time it."""
        s = self.shape
        kw = dict(host_bytes=host_bytes, hbm_bytes=hbm_bytes, hbm_fraction=fraction)
        out = torch.empty_like(self.inputs.qs[0])
        out.fill_(float("nan"))  # poison: every element must be written
        try:
            res, extra = peak_extra_bytes(lambda: op(out), self.opts.device)
        except (NotImplementedError, ValueError) as e:  # the op refusing the shape: missing, not failed
            self._add(method, None, gpu_bytes=resident, **kw)
            self.doc["missing"].append({"shape": self.row.label, "bench": s.bench, "method": method,
                                        "hbm_fractions": [fraction], "reason": _short_error(e)})
            return
        except Exception as e:  # noqa: BLE001 - a crashing kernel is a failed check, not a crashed run
            add_check(self.doc, s, method, False, hbm_fraction=fraction, against=self._against(),
                      detail=f"raised {_short_error(e)}")
            self._add(method, None, gpu_bytes=resident, **kw)
            return
        got = res if isinstance(res, torch.Tensor) else out
        ok, err = self._check(q_as_4d(got, s.batch, s.q_len))
        add_check(self.doc, s, method, ok, hbm_fraction=fraction, rel_err=err, against=self._against())
        if not ok:
            self._add(method, None, gpu_bytes=resident, **kw)
            return
        ms = self._time([lambda: op(out)])
        self._add(method, ms, gpu_bytes=resident + extra, **kw)


def _host_ms(fn, min_calls: int = 3, max_calls: int = 50, max_s: float = 0.3) -> float:
    """Median host milliseconds of ``fn()`` (wall clock; GPU work it enqueues is not waited for)."""
    times = []
    end = time.perf_counter() + max_s
    while len(times) < min_calls or (len(times) < max_calls and time.perf_counter() < end):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# ---- summaries, targets, table, plot ---------------------------------------------------------
def _by_method(records, key: str) -> dict:
    """(method, hbm_fraction) -> record, for the records of one row."""
    return {(r["method"], float(r["hbm_fraction"])): r for r in records if shape_key(r) == key}


def row_summary(row: PrefixRow, records: list[dict], doc: dict, extra: dict) -> dict:
    """The row's summary for ``doc['rows']``: its parameters, plan, status and per method the
    time, host MB and attended KV tokens/s, and the cascade's speedup over per-seq."""
    key = shape_key(row.shape.fields())
    recs = _by_method(records, key)
    tokens = row.batch * row.context
    failed = any(not c["ok"] for c in doc["checks"] if c["shape"] == row.shape.label and c["bench"] == row.shape.bench)
    methods = {}
    for (m, f), r in sorted(recs.items(), key=lambda kv: (kv[0][1], _order(kv[0][0]))):
        name = m if f == 0.0 or m not in (CASCADE, PER_SEQ) else f"{m}@hbm"
        methods[name] = {"ms": r["ms"], "host_mb": r["host_bytes"] / 1e6, "hbm_fraction": f,
                         "kv_tokens_per_s": None if not r["ms"] else tokens / (r["ms"] * 1e-3)}
    speedup = {}
    for f, tag in ((0.0, "host"), (1.0, "hbm")):
        c, p = recs.get((CASCADE, f)), recs.get((PER_SEQ, f))
        speedup[tag] = p["ms"] / c["ms"] if c and p and c["ms"] and p["ms"] else None
    return {"row": row.label, "key": key, "shape_label": row.shape.label, "bench": row.shape.bench,
            "batch": row.batch, "prompt": row.prompt,
            "own": row.own, "q_len": row.q_len, "context": row.context, "shared_prompt": row.shared,
            "attended_tokens": tokens, "status": "FAIL" if failed else "ok", **extra, "methods": methods,
            "speedup_cascade_vs_per_seq": speedup["host"], "speedup_cascade_vs_per_seq_hbm": speedup["hbm"]}


def _order(method: str) -> int:
    return METHOD_ORDER.index(method) if method in METHOD_ORDER else len(METHOD_ORDER)


def evaluate_targets(doc: dict) -> list[dict]:
    """The bench's targets, each {target, row, value, limit, ok, detail} (ok None: not
    applicable or a side not measured)."""
    out = []
    ceil_gbps = doc["ceilings"]["host_read_gbps"]

    def add(name, row, value, limit, ok, detail):
        out.append({"target": name, "row": row, "value": value, "limit": limit, "ok": ok, "detail": detail})

    rows = [r for r in doc.get("rows", []) if "unique_bytes" in r]  # not rows that crashed before planning
    for r in rows:
        m = r["methods"]
        c_ms = (m.get(CASCADE) or {}).get("ms")
        p_ms = (m.get(PER_SEQ) or {}).get("ms")
        if (r["batch"], r["own"], r["q_len"]) == SPEEDUP_ROW and r["shared_prompt"]:
            sp = r["speedup_cascade_vs_per_seq"]
            add(f"ours[cascade] >= {SPEEDUP_TARGET:g}x faster than ours[per-seq]", r["row"], sp, SPEEDUP_TARGET,
                None if sp is None else sp >= SPEEDUP_TARGET,
                "not measured" if sp is None else f"{p_ms:.3f} / {c_ms:.3f} ms (bytes: "
                f"{r['naive_bytes'] / max(r['unique_bytes'], 1):.1f}x fewer)")
        if not r["shared_prompt"]:
            ratio = None if not (c_ms and p_ms) else c_ms / p_ms
            add(f"no sharing: ours[cascade] no slower than ours[per-seq] (<= {CONTROL_SLACK:g}x)", r["row"], ratio,
                CONTROL_SLACK, None if ratio is None else ratio <= CONTROL_SLACK,
                "not measured" if ratio is None else f"{c_ms:.3f} vs {p_ms:.3f} ms")
            continue
        floor_ms = (m.get("floor") or {}).get("ms")
        hbm_ms = (m.get(f"{CASCADE}@hbm") or {}).get("ms")
        if floor_ms:
            if hbm_ms is None:
                add(f"link-bound: ours[cascade] <= {FLOOR_FACTOR:g} x floor", r["row"], None, None, None,
                    "no HBM time to tell whether the row is link-bound (--no-hbm or not measured)")
            elif hbm_ms > floor_ms:
                add(f"link-bound: ours[cascade] <= {FLOOR_FACTOR:g} x floor", r["row"], None, None, None,
                    f"not link-bound: ours[cascade] with every page in HBM {hbm_ms:.3f} ms > floor {floor_ms:.3f} ms")
            else:
                x = None if not c_ms else c_ms / floor_ms
                add(f"link-bound: ours[cascade] <= {FLOOR_FACTOR:g} x floor", r["row"], x, FLOOR_FACTOR,
                    None if x is None else x <= FLOOR_FACTOR,
                    "not measured" if x is None else f"{c_ms:.3f} ms vs floor {floor_ms:.3f} ms "
                    f"(HBM {hbm_ms:.3f} ms)")
        if r["batch"] == LINK_MULTIPLE_BATCH:
            link_tps = ceil_gbps * 1e9 / r["token_bytes"]  # KV tokens per second the link delivers
            tps = (m.get(CASCADE) or {}).get("kv_tokens_per_s")
            x = None if tps is None else tps / link_tps
            at_floor = r["attended_tokens"] * r["token_bytes"] / max(r["unique_bytes"], 1)
            add(f"attended KV tokens/s >= {LINK_MULTIPLE:g} x the link's KV tokens/s", r["row"], x, LINK_MULTIPLE,
                None if x is None else x >= LINK_MULTIPLE,
                ("not measured" if x is None else f"{tps / 1e6:.1f} M tok/s vs link {link_tps / 1e6:.1f} M tok/s")
                + f"; {at_floor:.1f}x at the floor")
    return out


TABLE_COLUMNS = ("method", "row", "hbm%", "ms", "host MB", "KV tok/s", "x floor", "speedup", "status")


def format_table(doc: dict) -> str:
    """Every row's methods as a fixed-width table, then missing / skipped / failed items and the
    targets (a CPU smoke run: no ceilings line and no ``x floor``)."""
    c = doc["ceilings"]
    cpu = is_cpu_run(doc["header"])
    lines = [TABLE_COLUMNS]
    variants = doc["notes"].get("variants", {})
    for r in doc.get("rows", []):
        recs = _by_method(doc["records"], r["key"])
        floor = recs.get(("floor", 0.0))
        for (m, f), rec in sorted(recs.items(), key=lambda kv: (kv[0][1], _order(kv[0][0]))):
            if cpu and m in CEILING_METHODS:
                continue
            name = m + (f"[{variants[r['key'] + '|' + m]}]" if variants.get(f"{r['key']}|{m}") else "")
            ms = rec["ms"]
            tps = None if not ms else r["attended_tokens"] / (ms * 1e-3)
            xf = None if cpu or not (ms and floor and floor["ms"]) else ms / floor["ms"]
            sp = None
            if m == CASCADE:
                sp = r["speedup_cascade_vs_per_seq"] if f == 0.0 else r["speedup_cascade_vs_per_seq_hbm"]
            failed = any(not ch["ok"] for ch in doc["checks"] if ch["method"] == m and ch["bench"] == r["bench"]
                         and ch["shape"] == r["shape_label"] and float(ch["hbm_fraction"]) == f)
            status = "FAIL" if failed else ("missing" if ms is None else "ok")
            lines.append((name, r["row"], f"{100 * f:.0f}", _fmt(ms, ".3f"), f"{rec['host_bytes'] / 1e6:.1f}",
                          "-" if tps is None else f"{tps / 1e6:.1f}M", _fmt(xf, ".2f"),
                          "-" if sp is None else f"{sp:.1f}x", status))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(TABLE_COLUMNS))]
    body = ["  ".join(str(v).ljust(w) if i in (0, 1, len(widths) - 1) else str(v).rjust(w)
                      for i, (v, w) in enumerate(zip(line, widths))).rstrip() for line in lines]
    body.insert(1, "  ".join("-" * w for w in widths))
    h = doc["header"]
    head = [f"== prefix on {h['gpu']} {h['date']}: {len(doc.get('rows', []))} rows, {len(doc['records'])} records",
            ("" if cpu else f"ceilings: host read {c['host_read_gbps']:.1f} GB/s, HBM read {c['hbm_read_gbps']:.0f} "
             f"GB/s, memcpy H2D {c['memcpy_h2d_gbps']:.1f} GB/s; ") + "KV tok/s = sum of seq_len over the batch / time"]
    plan = [f"plan ({r['row']}): plan_cascade {r['plan_ms']:.3f} ms + prepare_cascade {r['prepare_ms']:.3f} ms on "
            f"the host per step, {r['spans']} span(s), {r['host_pages_read']} of {r['host_pages_naive']} host pages "
            "read" for r in doc.get("rows", []) if "plan_ms" in r]
    tail = []
    for m in doc["missing"]:
        tail.append(f"missing: {m['method']} on {m['shape']}: {m['reason']}")
    tail += problem_lines(doc)
    if doc["notes"].get("peers"):
        tail.append(f"peers: {doc['notes']['peers']}")
    targets = []
    for t in doc.get("targets", []):
        mark = {True: "MET ", False: "MISS", None: "    "}[t["ok"]]
        val = "" if t["value"] is None else f" (value {t['value']:.3g}" + (
            f", limit {t['limit']:.3g})" if t["limit"] is not None else ")")
        targets.append(f"{mark} {t['target']} at {t['row']}: {t['detail']}{val}")
    return "\n".join(head + body + plan + tail + (["targets:"] + targets if targets else []))


_STYLE = {CASCADE: "o-", PER_SEQ: "s-", OP: "x-", "floor": "k_:", "hbm": "d-.", "zero_copy": "v--", "swap": "^--",
          "fa4[hbm]": "x-.", "fa4[zero_copy_paged]": "+--"}


def plot_prefix(doc: dict, path) -> Path | None:
    """PNG: time per method (ours on the host tier; ours with every page in HBM dashed) against
    batch, one panel per (q_len, own tokens). None when matplotlib is missing or nothing was
    measured."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in doc.get("rows", []) if r["shared_prompt"]]
    if not any(v["ms"] for r in rows for v in r["methods"].values()):
        return None
    panels = sorted({(r["q_len"], r["own"]) for r in rows})
    cols = min(3, len(panels))
    n_rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(n_rows, cols, figsize=(4.6 * cols, 3.6 * n_rows), squeeze=False)
    flat = [ax for line in axes for ax in line]
    for ax in flat[len(panels):]:
        ax.set_visible(False)
    for ax, (q_len, own) in zip(flat, panels):
        mine = sorted((r for r in rows if (r["q_len"], r["own"]) == (q_len, own)), key=lambda r: r["batch"])
        for method, style in _STYLE.items():
            for suffix, extra in (("", {}), ("@hbm", {"alpha": 0.5})):
                if suffix and method not in (CASCADE, PER_SEQ):
                    continue
                pts = [(r["batch"], r["methods"].get(method + suffix, {}).get("ms")) for r in mine]
                pts = [p for p in pts if p[1]]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=method + suffix, ms=4, **extra)
        ax.set_xscale("log", base=2)
        ax.set(yscale="log", xlabel="batch (forks of one prompt)", ylabel="ms per step (one layer)",
               title=f"q_len {q_len}, {own} own tokens")
        ax.grid(True, which="both", alpha=0.3)
    flat[0].legend(fontsize=6)
    h = doc["header"]
    return save_figure(plt, fig, path, f"{h['gpu']} {h['date']}: prefix {doc['args'].get('prompt')} tokens shared; "
                       f"host read ceiling {doc['ceilings']['host_read_gbps']:.1f} GB/s")


# ---- a run -----------------------------------------------------------------------------------
def _resolve(ns: argparse.Namespace) -> tuple[str, dict]:
    device = require_gpu(ns.device, command="bench prefix")
    defaults = CPU_DEFAULTS if device == "cpu" else GPU_DEFAULTS
    val = {k: (getattr(ns, k) if getattr(ns, k, None) is not None else d) for k, d in defaults.items()}
    val["dtype"] = dtype_name(val["dtype"])
    if val["dtype"] == "float32" and device == "cuda":
        raise UsageError("bench prefix: --dtype float32 runs only on the CPU (the GPU kernels take bf16 / fp16)")
    return device, val


def run_prefix(ns: argparse.Namespace) -> int:
    from bench.ceilings import measure_ceilings

    device, val = _resolve(ns)
    out_dir = checked_out_dir(ns.out_dir)
    cpu = device == "cpu"
    # A CPU run checks the plumbing, not speed: as few timed calls as the timer allows.
    timing = dict(CPU_TIMING) if cpu else dict(warmup=ns.warmup, reps=ns.reps, max_rep_s=ns.max_rep_s,
                                               min_sample_ms=2.0)
    opts = BenchOptions(device=device, page_size=val["page_size"], tol=ns.tol, seed=ns.seed, max_gb=ns.max_gb,
                        peers=not ns.no_peers, **timing)
    rows = rows_for(prompt=val["prompt"], batches=val["batches"], own_tokens=val["own_tokens"], q_lens=val["q_lens"],
                    heads=val["heads"], head_dim=val["head_dim"], dtype=val["dtype"], control=not ns.no_control,
                    control_batch=val["control_batch"])
    header = env_info(device)
    path = results_path(out_dir, header, BENCH)
    print(f"directkv bench prefix ({len(rows)} rows, prompt {val['prompt']}) on {header['gpu']} -> {path}", flush=True)
    ceilings, details = measure_ceilings(device, host_bytes=64 * MiB if cpu else int(ns.ceiling_gb * GiB),
                                         hbm_bytes=64 * MiB if cpu else int(2 * ns.ceiling_gb * GiB))
    if not cpu:
        print(f"ceilings: host read {ceilings.host_read_gbps:.2f} GB/s ({details['host_read']['kernel']}), "
              f"HBM read {ceilings.hbm_read_gbps:.1f} GB/s, memcpy H2D {ceilings.memcpy_h2d_gbps:.2f} GB/s",
              flush=True)
    args = {k: v for k, v in vars(ns).items() if isinstance(v, (str, int, float, bool, list, tuple, type(None)))
            and k != "func"}
    args.update(val, device=device, benches=[BENCH], timing=timing)
    doc = new_results(BENCH, header, ceilings, ceiling_details=details, args=args)
    doc["rows"], doc["targets"] = [], []
    write_json(path, doc)
    start = time.monotonic()
    bar = progress_bar(rows, not ns.no_progress, BENCH, "row")
    for row in bar:
        if ns.time_budget_s is not None and time.monotonic() - start > ns.time_budget_s:
            doc["skipped"].append({"shape": row.label, "bench": row.shape.bench, "reason": "time budget spent"})
            continue
        why = skip_reason(row, opts)
        if why:
            doc["skipped"].append({"shape": row.label, "bench": row.shape.bench, "reason": why})
            _say(bar, f"skip {row.label}: {why}")
            continue
        if hasattr(bar, "set_postfix_str"):
            bar.set_postfix_str(row.label)
        t0 = time.monotonic()
        bench = PrefixBench(row, opts, ceilings, doc, hbm_rows=not ns.no_hbm)
        try:
            records = [r.to_dict() for r in bench.run()]
        except Exception as e:  # noqa: BLE001 - record the crash, keep the other rows
            add_check(doc, row.shape, "row", False, detail=f"crashed: {_short_error(e)}")
            _say(bar, f"FAILED {row.label}:\n{traceback.format_exc()}")
            records = [r.to_dict() for r in bench.records]
            if device == "cuda":
                torch.cuda.empty_cache()
        doc["records"].extend(records)
        extra = dict(bench.summary, token_bytes=row.shape.token_bytes, wall_s=time.monotonic() - t0)
        doc["rows"].append(row_summary(row, records, doc, extra))
        write_json(path, doc)
        _say(bar, format_table({**doc, "rows": doc["rows"][-1:], "targets": [], "missing": [], "skipped": [],
                                "checks": [c for c in doc["checks"] if c["shape"] == row.shape.label]}))
    doc["targets"] = [] if cpu else evaluate_targets(doc)
    write_json(path, doc)
    write_run_files(path, doc, format_table(doc), out_dir, header, BENCH, None if ns.no_plot or cpu else plot_prefix)
    print("PASSED all correctness checks" if doc["passed"] else "FAILED: some correctness checks failed", flush=True)
    return 0 if doc["passed"] else 1


def _say(bar, text: str) -> None:
    if hasattr(bar, "write"):
        bar.write(text)
    else:
        print(text, flush=True)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _heads(s: str) -> tuple[int, int]:
    hq, hkv = s.split("/")
    return int(hq), int(hkv)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``prefix`` subcommand's options (defaults in brackets are the GPU ones; ``--device
    cpu`` defaults to the smoke run's)."""
    p.add_argument("--prompt", type=int, default=None, help="shared prompt tokens [32768] (cpu: 512)")
    p.add_argument("--batches", type=_ints, default=None, help="sequences forked from the prompt [4,16,64] (cpu: 4)")
    p.add_argument("--own-tokens", type=_ints, default=None,
                   help="tokens each sequence holds after the fork, before the step [0,1024,8192] (cpu: 0,40)")
    p.add_argument("--q-lens", type=_ints, default=None, help="new tokens per sequence per step [1,16] (cpu: 1,4)")
    p.add_argument("--heads", type=_heads, default=None, help="Hq/Hkv [32/8] (cpu: 4/2)")
    p.add_argument("--head-dim", type=int, default=None, help="[128] (cpu: 64)")
    p.add_argument("--page-size", type=int, default=None, help="[64] (cpu: 16)")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32", "bf16", "fp16", "fp32"),
                   help="[bfloat16] (cpu: float32)")
    p.add_argument("--control-batch", type=int, default=None,
                   help="sequences of the no-sharing control row, prompt tokens each, decode [16] (cpu: 4)")
    p.add_argument("--no-control", action="store_true", help="leave out the no-sharing control row")
    p.add_argument("--no-hbm", action="store_true", help="leave out ours with every page in HBM")
    p.add_argument("--no-peers", action="store_true",
                   help="leave out FlashAttention-4 (fa4[hbm], fa4[zero_copy_paged])")
    add_device_argument(p, "the whole code path on tiny rows")
    add_out_dir_argument(p)
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="start no new row after this many seconds (rows run cheapest first, the control row last)")
    p.add_argument("--max-gb", type=float, default=32.0, help="skip rows whose dense KV exceeds this (GiB)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=7, help="timed samples per method (fewer for slow methods)")
    p.add_argument("--max-rep-s", type=float, default=1.5, help="timed seconds per method, about")
    p.add_argument("--tol", type=float, default=2e-2, help="max |out - ref| / max |ref| for a check to pass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ceiling-gb", type=float, default=2.0, help="host buffer for the ceilings (HBM: twice)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-progress", action="store_true")


def cmd_prefix(ns: argparse.Namespace) -> int:
    try:
        return run_prefix(ns)
    except ValueError as e:
        print(f"bench prefix: {e}", file=sys.stderr)
        return 2


__all__ = ["BENCH", "CONTROL_BENCH", "PrefixBench", "PrefixRow", "add_arguments", "cmd_prefix", "evaluate_targets",
           "format_table", "plot_prefix", "row_summary", "rows_for", "run_prefix"]
