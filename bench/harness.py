"""Runs every method on one shape, checks them against each other, times them, makes records.

Per shape, in this order (so that at most ~2x the shape's KV is resident on either side):

1. inputs: random queries and dense KV ``(2, B, Hkv, S, d)`` on the device (the HBM baseline's
   data), copied into pinned host buffers (the zero-copy and swap baselines' data); several
   input sets when one set is small, so that timed calls rotate and do not run from L2;
2. a float32 anchor (an independent attention over the last query rows of two sequences);
3. per-shape ceilings: a streaming read of the same host bytes and of the same HBM bytes, and
   the read-once floor (host bytes / run-level host ceiling);
4. baselines (HBM, naive zero-copy, swap), each checked against the anchor and the HBM output;
5. ours: the same KV written into a ``PagedKVCache`` (one layer by default), then
   ``paged_attention_tables`` for every HBM fraction (pages moved to the HBM tier in a spread
   or recency order), each checked before it is timed.

A method whose check fails is not timed (its record has ``ms = None``) and the run is marked
failed. If ours cannot run a shape (NotImplementedError / ConfigError, or the op is not
there yet) its record is ``ms = None`` and the shape is listed under ``missing``.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
import traceback
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from bench.ceilings import flat_bytes, read_gbps
from bench.common import (GiB, MiB, Ceilings, Record, Shape, Timer, add_check, format_table, make_record,
                          available_host_bytes, progress_bar, shape_key, time_calls, torch_dtype, write_json)
from bench import peers
from bench.hostmem import PinnedBuffer
from bench.methods import (SdpaVariant, anchor_reference, anchor_rows, anchor_slice, backend_context, q_as_4d,
                           rel_error, sdpa, sdpa_variants)
from bench.placement import hbm_pages, tier_tokens


@dataclass
class BenchOptions:
    """Knobs shared by the decode and prefill benchmarks."""

    device: str = "cuda"
    page_size: int = 64
    hbm_fractions: tuple[float, ...] = (0.0,)
    placement: str = "spread"
    num_layers: int = 1
    warmup: int = 2
    reps: int = 7
    max_rep_s: float = 3.0
    min_sample_ms: float = 2.0
    rotate_bytes: int = 256 * MiB
    max_sets: int = 8
    tol: float = 2e-2
    seed: int = 0
    max_gb: float = 32.0
    config: dict | None = None
    compare_configs: tuple[dict, ...] = ()  # more configs of ours, each its own method ours[...]
    host_read_kernel: str = "sum_f32"
    hbm_read_kernel: str = "sum_f32"
    peers: bool = True  # FlashAttention-4's methods (bench.peers) where it is installed
    window: bool = False  # ours[window]: the query tokens' pages mirrored in HBM (multi-token, host only)
    kv_dtype: str | None = None  # "fp8" / "e5m2": also ours[fp8] / ours[e5m2] over FP8 host pages
    sparse_budgets: tuple[str, ...] = ()  # also ours[sparse=B] and select[B] (decode shapes, host pages)
    skip_methods: tuple[str, ...] = ()  # of SKIPPABLE: listed as missing, not run
    # Samples of at least this many calls back to back (a model's layers); ours' tables marked so
    # (``KernelTables.back_to_back``: staged chunks may plan their copies to run ahead).
    layers: int = 1

    def timing(self) -> dict:
        return {"warmup": self.warmup, "reps": self.reps, "max_total_s": self.max_rep_s,
                "min_sample_ms": self.min_sample_ms, "min_inner": self.layers}


# The methods that read host pages once per query tile (naive zero-copy SDPA, FA4's page table over
# UVA): 14-47x slower than the floor from q 512 (``python -m bench prefill --full`` on an H200),
# minutes of a grid's time.
SKIPPABLE = ("zero_copy", "fa4[zero_copy_paged]")


# ---- feasibility ---------------------------------------------------------------------------
def num_sets(shape: Shape, opts: BenchOptions) -> int:
    """Input sets to rotate among: enough that one pass over them exceeds ``rotate_bytes``."""
    return max(1, min(opts.max_sets, math.ceil(opts.rotate_bytes / max(1, shape.kv_bytes))))


def footprint(shape: Shape, opts: BenchOptions) -> tuple[int, int]:
    """Peak (host bytes, GPU bytes) a shape needs, following the order in the module docstring."""
    kv, sets = shape.kv_bytes, num_sets(shape, opts)
    pool = kv * opts.num_layers * sets
    max_frac = max(opts.hbm_fractions, default=0.0)
    host = max(kv * sets, pool)
    gpu = max(kv * sets + kv, kv * sets + pool * max_frac)  # (dense + staging), (dense + HBM pages)
    return host, gpu


def skip_reason(shape: Shape, opts: BenchOptions) -> str | None:
    """Why a shape cannot run here (over --max-gb, or over the free memory), or None."""
    if shape.q_len > shape.context:
        return f"q_len {shape.q_len} > context {shape.context}"
    if shape.kv_bytes > opts.max_gb * GiB:
        return f"KV {shape.kv_bytes / GiB:.1f} GiB > --max-gb {opts.max_gb:g}"
    host, gpu = footprint(shape, opts)
    return memory_problem(host, gpu, opts.device)


def memory_problem(host: int, gpu: int, device: str) -> str | None:
    """Why ``host`` bytes of pinned host memory and ``gpu`` bytes of GPU memory do not fit here
    (90% of the available host memory, 95% of the free GPU memory), or None."""
    avail = available_host_bytes()
    if avail is not None and host > 0.9 * avail:
        return f"needs {host / GiB:.1f} GiB pinned host memory, {avail / GiB:.1f} GiB available"
    if device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        if gpu > 0.95 * free:
            return f"needs {gpu / GiB:.1f} GiB GPU memory, {free / GiB:.1f} GiB free"
    return None


# ---- the op under test ---------------------------------------------------------------------
@dataclass
class OursApi:
    """What the benchmark needs from directkv_cute (the CPU tests substitute a fake).

    ``run(q, cache, tables, seq_ids, q_lens, config, out)`` computes layer 0's attention and
    returns the output; ``missing_errors`` are the op refusing a shape (not a failure).
    """

    cache_cls: type
    run: Callable
    missing_errors: tuple[type[BaseException], ...]


def load_ours(device: str) -> OursApi:
    """The cache class and the op; raises ImportError naming what is not there yet.

    On CUDA the op is ``paged_attention_tables`` (tables built once, reused by every timed
    call); on a CPU ``paged_attention`` (which runs the reference there), so that a CPU smoke
    run checks the benchmark's cache filling against the project's own reference. The op
    refusing a shape before launching anything (NotImplementedError, ConfigError or another
    ValueError from its validation, e.g. more query rows than a CTA holds while the
    multi-token kernel does not exist) marks ours *missing* for that shape, not failed.
    """
    import directkv_cute

    try:
        from directkv_cute.cache import PagedKVCache
    except ImportError as e:
        raise ImportError(f"directkv_cute.cache.PagedKVCache is not importable: {e}") from e
    name = "paged_attention_tables" if device == "cuda" else "paged_attention"
    op = getattr(directkv_cute, name, None)
    if op is None:
        try:
            op = getattr(__import__("directkv_cute.ops", fromlist=[name]), name)
        except (ImportError, AttributeError) as e:
            raise ImportError(f"directkv_cute.{name} is not importable: {e}") from e

    fresh = weakref.WeakKeyDictionary()  # cache -> {(seq_ids, q_lens): step pages}

    def run(q, cache, tables, seq_ids, q_lens, config, out):
        if device == "cuda" and hasattr(cache, "note_host_write"):
            # As in a model's step, the call's own tokens were just written: their host pages are
            # recorded, so a staged copy of them waits for the current stream (the history need not).
            known = fresh.setdefault(cache, {})
            key = (tuple(seq_ids), tuple(q_lens or ()))
            if key not in known:
                known[key] = step_host_pages(cache, seq_ids, q_lens)
            cache.note_host_write(known[key])
        target = tables if device == "cuda" else seq_ids
        return op(q, cache, 0, target, q_lens=q_lens, config=config, out=out)

    return OursApi(cache_cls=PagedKVCache, run=run, missing_errors=(NotImplementedError, ValueError))


def step_host_pages(cache, seq_ids, q_lens) -> list[int]:
    """The host pages holding each sequence's last ``q_lens[i]`` tokens (1 without q_lens)."""
    P, pages = cache.page_size, set()
    for i, sid in enumerate(seq_ids):
        n, q_len = cache.seq_len(sid), (q_lens[i] if q_lens else 1)
        table = cache.page_table(sid)
        pages.update(e for e in table[max(0, n - q_len) // P: -(-n // P)] if e >= 0)
    return sorted(pages)


# ---- one shape -----------------------------------------------------------------------------
@dataclass
class _Inputs:
    qs: list[torch.Tensor]
    kv_dev: list[torch.Tensor]
    host: list[PinnedBuffer] = field(default_factory=list)


def peak_extra_bytes(call: Callable[[], object], device: str) -> tuple[object, int]:
    """Run ``call`` once; return its result and the GPU memory it allocated at its peak."""
    if device != "cuda":
        return call(), 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = call()
    torch.cuda.synchronize()
    return out, max(0, torch.cuda.max_memory_allocated() - base)


class ShapeBench:
    """All methods on one shape; ``run()`` returns the records and logs checks into ``doc``."""

    def __init__(self, shape: Shape, opts: BenchOptions, ceilings: Ceilings, doc: dict,
                 ours_loader: Callable[[str], OursApi] = load_ours):
        self.shape, self.opts, self.ceilings, self.doc = shape, opts, ceilings, doc
        self.ours_loader = ours_loader
        self.timer = Timer(opts.device)
        self.dtype = torch_dtype(shape.dtype)
        self.sets = num_sets(shape, opts)
        self.inputs: _Inputs | None = None
        self.anchor: torch.Tensor | None = None
        self.anchor_at: tuple[list[int], int] = anchor_rows(shape.batch, shape.q_len)
        self.pivot: torch.Tensor | None = None
        self.hbm_variant: SdpaVariant | None = None
        self.records: list[Record] = []

    # -- driver --
    def run(self) -> list[Record]:
        try:
            self._build_inputs()
            self._build_anchor()
            self._ceiling_records()
            self._baselines()
            self._peers()
            self._release_host()
            self._ours()
        finally:
            self._release_all()
        return self.records

    # -- inputs --
    def _build_inputs(self) -> None:
        s = self.shape
        gen = torch.Generator(device=self.opts.device).manual_seed(self.opts.seed)
        qs, kvs, hosts = [], [], []
        for _ in range(self.sets):
            qs.append(torch.randn(s.batch * s.q_len, s.hq, s.head_dim, generator=gen, device=self.opts.device,
                                  dtype=self.dtype))
            kv = torch.randn(2, s.batch, s.hkv, s.context, s.head_dim, generator=gen, device=self.opts.device,
                             dtype=self.dtype)
            host = PinnedBuffer(kv.shape, self.dtype, self.opts.device)
            host.cpu.copy_(kv)
            kvs.append(kv)
            hosts.append(host)
        self.timer.sync()
        self.inputs = _Inputs(qs=qs, kv_dev=kvs, host=hosts)

    def _q4(self, i: int) -> torch.Tensor:
        return q_as_4d(self.inputs.qs[i], self.shape.batch, self.shape.q_len)

    def _build_anchor(self) -> None:
        kv = self.inputs.kv_dev[0]
        batches, rows = self.anchor_at
        self.anchor = anchor_reference(self._q4(0), kv[0], kv[1], batches, rows)

    # -- checks --
    def _check(self, out4: torch.Tensor) -> tuple[bool, float]:
        """Compare a (B, Hq, L, d) output with the anchor and with the HBM baseline's output."""
        errs = [rel_error(anchor_slice(out4, *self.anchor_at), self.anchor)]
        if self.pivot is not None:
            errs.append(rel_error(out4, self.pivot))
        err = max(errs)
        return err <= self.opts.tol, err

    def _against(self) -> str:
        return "fp32 anchor" + (" + hbm output" if self.pivot is not None else "")

    # -- records --
    def _add(self, method: str, ms: float | None, **kw) -> Record:
        rec = make_record(self.shape, method, ms, self.ceilings, **kw)
        self.records.append(rec)
        return rec

    def _note_variant(self, method: str, chosen: str, trials: dict) -> None:
        key = f"{shape_key(self.shape.fields())}|{method}"
        self.doc["notes"].setdefault("variants", {})[key] = chosen
        self.doc["notes"].setdefault("variant_trials", {})[key] = trials

    def _time(self, calls: Sequence[Callable], context: Callable[[], object] = contextlib.nullcontext) -> float:
        with context():
            return time_calls(calls, self.timer, **self.opts.timing()).ms

    # -- ceilings --
    def _ceiling_records(self) -> None:
        kv = self.shape.kv_bytes
        self._add("floor", self.ceilings.ideal_ms(kv, 0), host_bytes=kv)
        host_views = [flat_bytes(h.device_view) for h in self.inputs.host]
        gbps = read_gbps(host_views, self.opts.host_read_kernel, self.timer, **self.opts.timing())
        self._add("host_read", kv / (gbps * 1e9) * 1e3, host_bytes=kv)
        dev_views = [flat_bytes(t) for t in self.inputs.kv_dev]
        gbps = read_gbps(dev_views, self.opts.hbm_read_kernel, self.timer, **self.opts.timing())
        self._add("hbm_read", kv / (gbps * 1e9) * 1e3, hbm_bytes=kv, hbm_fraction=1.0, gpu_bytes=kv)

    # -- baselines --
    def _baselines(self) -> None:
        kv = self.shape.kv_bytes
        inp = self.inputs

        def hbm_calls(v):
            return [lambda i=i: sdpa(v, self._q4(i), inp.kv_dev[i][0], inp.kv_dev[i][1]) for i in range(self.sets)]

        def zero_copy_calls(v):
            return [lambda i=i: sdpa(v, self._q4(i), inp.host[i].device_view[0], inp.host[i].device_view[1])
                    for i in range(self.sets)]

        self.hbm_variant, out = self._sdpa_method("hbm", hbm_calls, self.shape_variants(), hbm_bytes=kv,
                                                  hbm_fraction=1.0, resident=kv)
        self.pivot = out
        self._sdpa_method("zero_copy", zero_copy_calls, self.shape_variants(), host_bytes=kv, resident=0)
        staging = torch.empty_like(inp.kv_dev[0])

        def swap_calls(v):
            def call(i):
                staging.copy_(inp.host[i].cpu, non_blocking=True)
                return sdpa(v, self._q4(i), staging[0], staging[1])
            return [lambda i=i: call(i) for i in range(self.sets)]

        swap_candidates = [self.hbm_variant] if self.hbm_variant else self.shape_variants()
        self._sdpa_method("swap", swap_calls, swap_candidates, host_bytes=kv, resident=kv, staging_bytes=kv)
        del staging
        self.timer.sync()

    # -- peers --
    def _peers(self) -> None:
        """FlashAttention-4's methods (bench.peers), listed as missing where it cannot run."""
        if not self.opts.peers:
            return
        why = peers.unavailable(self.opts.device)
        if why is not None:  # not installed here: said once per run, no records
            self.doc["notes"]["peers"] = why
            return
        s, kv = self.shape, self.shape.kv_bytes
        n = max(1, min(self.sets, peers.ONE_SET_BYTES // max(kv, 1)))
        want_host = kv <= peers.MAX_HOST_BYTES
        try:
            fa = [peers.fa4_layout(self.inputs.kv_dev[i], self.opts.page_size, PinnedBuffer, want_host, s.q_len)
                  for i in range(n)]
        except Exception as e:  # noqa: BLE001 - out of memory for the copies: the peer is missing
            self._peer_missing(peers.METHODS, f"FA4 inputs: {_short_error(e)}")
            return
        try:
            qs = self.inputs.qs
            self._peer_method("fa4[hbm]", [peers.hbm_call(qs[i], fa[i], s.batch, s.q_len) for i in range(n)],
                              hbm_bytes=kv, hbm_fraction=1.0, resident=kv)
            if not want_host:
                self._peer_missing(peers.METHODS[1:], f"KV over {peers.MAX_HOST_BYTES >> 30} GiB: no host copy")
                return
            self._peer_method("fa4[zero_copy_paged]", [peers.zero_copy_paged_call(qs[i], fa[i], s.q_len)
                                                       for i in range(n)], host_bytes=kv, resident=0)
            for f in fa[1:]:
                f.host.close()
            del fa[1:]
            staging = torch.empty(fa[0].host.cpu.shape, dtype=self.dtype, device=self.opts.device)
            self._peer_method("swap+fa4", [peers.swap_call(qs[0], fa[0], staging, s.batch, s.q_len, s.context)],
                              host_bytes=kv, resident=kv, staging_bytes=kv)
            del staging
        finally:
            self.timer.sync()
            for f in fa:
                if f.host is not None:
                    f.host.close()
            del fa
            gc.collect()

    def _peer_missing(self, methods, reason: str) -> None:
        for m in methods:
            self._add(m, None)
            self.doc["missing"].append({"shape": self.shape.label, "bench": self.shape.bench, "method": m,
                                        "hbm_fractions": [], "reason": reason})

    def _skipped(self, name: str) -> bool:
        """Whether ``name`` is one of ``--skip-methods`` (then recorded as missing)."""
        if name not in self.opts.skip_methods:
            return False
        self._peer_missing([name], "skipped (--skip-methods)")
        return True

    def _peer_method(self, name: str, calls: list[Callable], *, resident: int, host_bytes: int = 0,
                     hbm_bytes: int = 0, staging_bytes: int = 0, hbm_fraction: float = 0.0) -> None:
        """Check a peer's first call against the anchor and the HBM output, then time it."""
        if self._skipped(name):
            return
        s = self.shape
        kw = dict(host_bytes=host_bytes, hbm_bytes=hbm_bytes, staging_bytes=staging_bytes, hbm_fraction=hbm_fraction)
        try:
            out, extra = peak_extra_bytes(calls[0], self.opts.device)
            ok, err = self._check(q_as_4d(out, s.batch, s.q_len))
        except Exception as e:  # noqa: BLE001 - a peer refusing a shape is recorded, not fatal
            self._peer_missing([name], _short_error(e))
            return
        add_check(self.doc, s, name, ok, hbm_fraction=hbm_fraction, rel_err=err, against=self._against())
        if not ok:
            self._add(name, None, gpu_bytes=resident, **kw)
            return
        ms = self._time(calls)
        self._add(name, ms, gpu_bytes=resident + extra, **kw)

    def shape_variants(self) -> list[SdpaVariant]:
        return sdpa_variants(self.shape.q_len, self.shape.hq, self.shape.hkv)

    def _try_variant(self, v: SdpaVariant, calls: list[Callable]) -> dict:
        """Run one formulation once (checked) and once more (timed): a trial dict."""
        try:
            with backend_context(v, self.opts.device), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # SDPA explains at length why a backend declined
                out, extra = peak_extra_bytes(calls[0], self.opts.device)
                ok, err = self._check(out)
                est = self.timer.measure(calls[0], 1.0) if ok else None  # 1 ms lead: device time
        except Exception as e:  # noqa: BLE001 - a backend refusing a layout is an expected outcome
            return {"ok": False, "error": _short_error(e)}
        return {"ok": ok, "rel_err": err, "est_ms": est, "extra_bytes": extra, "out": out}

    def _sdpa_method(self, name: str, make_calls, candidates: list[SdpaVariant], *, resident: int,
                     host_bytes: int = 0, hbm_bytes: int = 0, staging_bytes: int = 0, hbm_fraction: float = 0.0):
        """Check every candidate formulation, time the fastest correct one, add its record.

        Fallback formulations are tried only when no primary one is correct. Returns
        (chosen variant or None, its set-0 output or None).
        """
        if self._skipped(name):
            return None, None
        trials: dict[str, dict] = {}
        for v in candidates:
            if v.fallback and any(t["ok"] for t in trials.values()):
                break
            trials[v.name] = self._try_variant(v, make_calls(v))
        good = {n: t for n, t in trials.items() if t["ok"]}
        kw = dict(host_bytes=host_bytes, hbm_bytes=hbm_bytes, staging_bytes=staging_bytes, hbm_fraction=hbm_fraction)
        if not good:
            detail = "; ".join(f"{n}: {t.get('error') or 'rel_err %.3g' % t['rel_err']}" for n, t in trials.items())
            add_check(self.doc, self.shape, name, False, hbm_fraction=hbm_fraction, against=self._against(),
                      detail=detail)
            self._note_variant(name, "", _public(trials))
            self._add(name, None, gpu_bytes=resident, **kw)
            return None, None
        chosen = min(good, key=lambda n: good[n]["est_ms"])
        variant = next(v for v in candidates if v.name == chosen)
        t = good[chosen]
        add_check(self.doc, self.shape, name, True, hbm_fraction=hbm_fraction, rel_err=t["rel_err"],
                  against=self._against(), detail=chosen)
        self._note_variant(name, chosen, _public(trials))
        out = t["out"]
        for trial in trials.values():
            trial.pop("out", None)
        ms = self._time(make_calls(variant), lambda: backend_context(variant, self.opts.device))
        self._add(name, ms, gpu_bytes=resident + t["extra_bytes"], **kw)
        return variant, out

    def _release_host(self) -> None:
        """Free the dense host copies once the baselines are done (the cache gets its own)."""
        self.timer.sync()
        for h in self.inputs.host:
            h.close()
        self.inputs.host = []
        gc.collect()

    # -- ours --
    def _ours(self) -> None:
        fractions = sorted(set(self.opts.hbm_fractions))
        try:
            api = self.ours_loader(self.opts.device)
        except Exception as e:  # noqa: BLE001 - the op may not be written yet: baselines still count
            self._ours_missing(fractions, _short_error(e))
            return
        try:
            cache, seq_ids = self._build_cache(api, fractions)
        except NotImplementedError as e:
            self._ours_missing(fractions, _short_error(e))
            return
        except Exception as e:  # noqa: BLE001 - a broken cache fails the run but keeps the baselines
            add_check(self.doc, self.shape, "ours", False, against="cache setup", detail=_short_error(e))
            self._ours_unmeasured(fractions)
            return
        # The dense device KV is not needed any more: the anchor and the pivot are computed.
        self.inputs.kv_dev = []
        self.timer.sync()
        try:
            placed = [[set() for _ in ids] for ids in seq_ids]
            for n, f in enumerate(fractions):
                try:
                    self._place(cache, seq_ids, placed, f)
                except NotImplementedError as e:
                    self._ours_missing(fractions[n:], _short_error(e))
                    break
                except Exception as e:  # noqa: BLE001 - a failed page move fails the run, not the sweep
                    add_check(self.doc, self.shape, "ours", False, hbm_fraction=f, against="move_pages",
                              detail=_short_error(e))
                    self._ours_unmeasured(fractions[n:])
                    break
                self._ours_fraction(api, cache, seq_ids, placed, f)
            if self.opts.kv_dtype and 0.0 in fractions:
                self._ours_fp8(api, cache, seq_ids, placed)
            if self._sparse():
                self._ours_sparse(cache, seq_ids, placed)
        finally:
            self.timer.sync()
            if hasattr(cache, "close"):
                cache.close()  # unpin the host pool now rather than at garbage collection
            del cache
            gc.collect()

    def _ours_methods(self, method: str | None = None) -> list[str]:
        """``[method]``, or every method of ours in this run: "ours" and one per compared config."""
        return [method] if method else ["ours"] + [config_method(c) for c in self.opts.compare_configs]

    def _ours_unmeasured(self, fractions: Sequence[float], method: str | None = None) -> None:
        """Records with ms = None for fractions ours (one config, or all of them) could not be
        measured at."""
        for m in self._ours_methods(method):
            for f in fractions:
                host_b, hbm_b = self._tier_bytes(f)
                self._add(m, None, host_bytes=host_b, hbm_bytes=hbm_b, hbm_fraction=f)

    def _ours_missing(self, fractions: Sequence[float], reason: str, method: str | None = None) -> None:
        """Ours does not support the shape (or is not there yet): not a failure, but listed."""
        for m in self._ours_methods(method):
            self._ours_unmeasured(fractions, m)
            self.doc["missing"].append({"shape": self.shape.label, "bench": self.shape.bench, "method": m,
                                        "hbm_fractions": list(fractions), "reason": reason})

    def _pages_per_seq(self) -> int:
        return math.ceil(self.shape.context / self.opts.page_size)

    def _tier_bytes(self, fraction: float) -> tuple[int, int]:
        s = self.shape
        in_hbm = hbm_pages(self._pages_per_seq(), fraction, self.opts.placement)
        host_t, hbm_t = tier_tokens(s.context, self.opts.page_size, in_hbm)
        return s.batch * host_t * s.token_bytes, s.batch * hbm_t * s.token_bytes

    def _build_cache(self, api: OursApi, fractions: Sequence[float]):
        s, opts = self.shape, self.opts
        n_pages = self._pages_per_seq()
        n_hbm = len(hbm_pages(n_pages, max(fractions), opts.placement))
        extra = {}
        if self._window():
            extra["num_window_pages"] = self.sets * s.batch * (math.ceil(s.q_len / opts.page_size) + 1)
        if self._sparse():
            extra["summaries"] = True
        cache = api.cache_cls(opts.num_layers, s.hkv, s.head_dim, opts.page_size,
                              num_host_pages=self.sets * s.batch * n_pages,
                              num_hbm_pages=self.sets * s.batch * n_hbm, dtype=self.dtype, device=opts.device,
                              **extra)
        seq_ids = []
        for i in range(self.sets):
            ids = []
            for _ in range(s.batch):
                sid = cache.add_sequence()
                cache.extend(sid, s.context)
                ids.append(sid)
            self._fill_pages(cache, ids, self.inputs.kv_dev[i])
            if self._sparse():  # the pools were written in place: their summaries from what they hold
                cache.refresh_summaries(cache.token_slots(ids, [0] * s.batch, [s.context] * s.batch))
            seq_ids.append(ids)
        self.timer.sync()
        return cache, seq_ids

    def _fill_pages(self, cache, ids: list[int], kv: torch.Tensor) -> None:
        """Write dense KV ``(2, B, Hkv, S, d)`` into the sequences' host pages (every layer)."""
        s, page = self.shape, self.opts.page_size
        n_pages = self._pages_per_seq()
        pool = cache.host_pool_cuda if getattr(cache, "host_pool_cuda", None) is not None else cache.host_pool
        table = cache.kernel_tables(ids).page_table
        pad = n_pages * page - s.context
        for b in range(s.batch):
            pages = table[b, :n_pages].to(device=pool.device, dtype=torch.long)
            if bool((pages < 0).any()):
                raise RuntimeError("a freshly extended sequence has pages outside the host tier")
            seq = kv[:, b]  # (2, Hkv, S, d)
            if pad:
                seq = torch.nn.functional.pad(seq, (0, 0, 0, pad))
            blocks = seq.reshape(2, s.hkv, n_pages, page, s.head_dim).permute(2, 1, 0, 3, 4).to(pool.device)
            for layer in range(self.opts.num_layers):
                pool[:, layer].index_copy_(0, pages, blocks)

    def _place(self, cache, seq_ids, placed, fraction: float) -> None:
        """Move pages between tiers so that each sequence has ``fraction`` of its pages in HBM."""
        target = hbm_pages(self._pages_per_seq(), fraction, self.opts.placement)
        for ids, now in zip(seq_ids, placed):
            for j, sid in enumerate(ids):
                up, down = sorted(target - now[j]), sorted(now[j] - target)
                if up:
                    cache.move_pages(sid, up, "hbm")
                if down:
                    cache.move_pages(sid, down, "host")
                now[j] = set(target)
        self.timer.sync()

    def _ours_fraction(self, api: OursApi, cache, seq_ids, placed, fraction: float) -> None:
        """Ours at one HBM fraction: with ``--config`` (or the profile) as method "ours", then with
        each of ``--compare-configs`` as method "ours[field=value,...]" in the same run."""
        self._ours_config(api, cache, seq_ids, placed, fraction, self.opts.config, "ours")
        for cfg in self.opts.compare_configs:
            self._ours_config(api, cache, seq_ids, placed, fraction, cfg, config_method(cfg))
        if fraction == 0.0 and self._window():
            self._ours_window(api, cache, seq_ids, placed)

    def _sparse(self) -> bool:
        """Whether this shape gets ours[sparse=B] (``--sparse-budgets``; decode, with host pages)."""
        return bool(self.opts.sparse_budgets) and self.shape.q_len == 1 and 0.0 in self.opts.hbm_fractions

    def _ours_sparse(self, cache, seq_ids, placed) -> None:
        """ours[sparse=B] for each budget: every page on the host, each row reading only the pages
        its query selects (``DirectKVAttention.plan(sparse=B)`` once per table, as a model step
        plans, then one run per call: the selection from the page summaries and the decode over
        the chosen pages, both timed). Its check is float32 attention over the pages the selection
        chose (the selection itself is checked against an independent one by the tests); its host
        bytes are those pages'. select[B] times the selection alone (``sparse.PageSelector.select``: a layer's), its
        bytes the page summaries it reads."""
        from directkv_cute.attention import DirectKVAttention
        from directkv_cute.sparse import PageSelector
        from directkv_cute.sparse_budget import parse_budget

        s, page = self.shape, self.opts.page_size
        if any(placed[0][0]):
            self._place(cache, seq_ids, placed, 0.0)
        n_pages = self._pages_per_seq()
        marked = {"back_to_back": True} if self.opts.layers > 1 else {}
        for text in self.opts.sparse_budgets:
            method, budget = f"ours[sparse={text}]", parse_budget(text)
            k = budget.budget_pages(n_pages)
            tail = s.context - (n_pages - 1) * page
            tokens = (k - 1) * page + tail  # what each row attends
            kw = dict(host_bytes=s.batch * tokens * s.token_bytes, hbm_fraction=0.0)
            seen = _Selections()
            tables, plans = [], []
            try:
                for ids in seq_ids:
                    t = cache.kernel_tables(ids, **marked)
                    dk = DirectKVAttention(cache)
                    dk.sparse_hooks.append(seen)
                    dk.plan(tables=t, num_q_heads=s.hq, sparse=budget, max_seq_len=s.context)
                    tables.append(t)
                    plans.append(dk)
            except (NotImplementedError, ValueError) as e:
                self._ours_missing([0.0], _short_error(e), method)
                continue
            outs = [torch.empty_like(q) for q in self.inputs.qs]
            calls = [lambda i=i: plans[i].run(self.inputs.qs[i], 0, outs[i]) for i in range(self.sets)]
            outs[0].fill_(float("nan"))  # poison: every element must be written
            try:
                _, extra = peak_extra_bytes(calls[0], self.opts.device)
                ok, err = self._check_sparse(cache, seq_ids[0], outs[0], seen.tables[-1], tokens)
            except Exception as e:  # noqa: BLE001 - a crashing call is a failed check, not a crashed run
                add_check(self.doc, s, method, False, hbm_fraction=0.0, against="fp32 over the selected pages",
                          detail=f"raised {_short_error(e)}")
                self._ours_unmeasured([0.0], method)
                continue
            add_check(self.doc, s, method, ok, hbm_fraction=0.0, rel_err=err, against="fp32 over the selected pages")
            if not ok:
                self._ours_unmeasured([0.0], method)
                continue
            seen.keep = False
            self._add(method, self._time(calls), gpu_bytes=extra, **kw)
            summ = cache.summaries
            scale = 1.0 / math.sqrt(s.head_dim)
            selectors = [PageSelector(t.page_table, t.seq_lens, page, k, budget.sink_pages, budget.recent_pages,
                                      self.opts.device) for t in tables]
            select = [lambda i=i: selectors[i].select(self.inputs.qs[i], summ, 0, scale) for i in range(self.sets)]
            read = s.batch * n_pages * summ.bytes_per_page // self.opts.num_layers
            self._add(f"select[{text}]", self._time(select), hbm_bytes=read, hbm_fraction=0.0)

    def _check_sparse(self, cache, ids, out: torch.Tensor, sel_table: torch.Tensor, tokens: int):
        """(ok, rel err) of a decode output (B, Hq, d) against float32 attention over the first
        ``tokens`` keys of the pages ``sel_table`` (B, k) names, in its order."""
        s, page = self.shape, self.opts.page_size
        batches, _ = self.anchor_at
        ks, vs = [], []
        for b in batches:
            k_all, v_all = cache.read(ids[b], 0)  # (S, Hkv, d)
            entries = cache.page_table(ids[b])
            order = [entries.index(int(e)) for e in sel_table[b].tolist()]
            pos = torch.cat([torch.arange(j * page, min((j + 1) * page, s.context)) for j in order])[:tokens]
            pos = pos.to(k_all.device)
            ks.append(k_all[pos].transpose(0, 1))
            vs.append(v_all[pos].transpose(0, 1))
        q4 = q_as_4d(self.inputs.qs[0], s.batch, 1)[batches]
        ref = anchor_reference(q4, torch.stack(ks), torch.stack(vs), list(range(len(batches))), 1)
        err = rel_error(anchor_slice(q_as_4d(out, s.batch, 1), batches, 1), ref)
        return err <= self.opts.tol, err

    def _window(self) -> bool:
        """Whether this shape gets ours[window] (``--window``; multi-token, with host pages)."""
        return self.opts.window and self.shape.q_len > 1 and 0.0 in self.opts.hbm_fractions

    def _ours_window(self, api: OursApi, cache, seq_ids, placed) -> None:
        """ours[window]: the pages holding the query tokens mirrored in HBM, as a model step's
        window leaves them (the partial page before them copied in), the op's own choice; the
        history's full pages are read from the host."""
        s, page = self.shape, self.opts.page_size
        hist = s.context - s.q_len
        for ids in seq_ids:
            for sid in ids:
                cache.mirror(sid, hist, s.q_len)
                for layer in range(self.opts.num_layers):  # the step's own stores, through to the mirrors
                    cache.write(sid, layer, hist, *cache.read(sid, layer, hist, s.context))
        self.timer.sync()
        try:
            host_t = (hist // page) * page
            kw = dict(host_bytes=s.batch * host_t * s.token_bytes,
                      hbm_bytes=s.batch * (s.context - host_t) * s.token_bytes)
            self._ours_config(api, cache, seq_ids, placed, 0.0, self.opts.config, "ours[window]", bytes_kw=kw)
        finally:
            for ids in seq_ids:
                for sid in ids:
                    cache.release_mirrors(sid, keep_partial=False)

    def _ours_fp8(self, api: OursApi, cache, seq_ids, placed) -> None:
        """ours[fp8] (or ours[e5m2]): the same K/V written into a cache of FP8 host pages (quantized
        on the way in, one scale per token), host only, with the op's own choices. Its check
        compares with the float32 anchor over the K/V the FP8 pages give back, so the tolerance is
        the op's, not the format's; its host bytes are the FP8 pages and their scales."""
        from directkv_cute.fp8 import SCALE_DTYPE, fp8_dtype

        s, opts = self.shape, self.opts
        method = f"ours[{opts.kv_dtype}]"
        if any(placed[0][0]):
            self._place(cache, seq_ids, placed, 0.0)
        kv_dtype = fp8_dtype(opts.kv_dtype)
        n_pages = self._pages_per_seq()
        try:
            c8 = api.cache_cls(opts.num_layers, s.hkv, s.head_dim, opts.page_size,
                               num_host_pages=self.sets * s.batch * n_pages, num_hbm_pages=0, dtype=kv_dtype,
                               compute_dtype=self.dtype, device=opts.device)
        except (TypeError, ValueError, NotImplementedError) as e:
            self._ours_missing([0.0], _short_error(e), method)
            return
        try:
            ids8 = []
            for ids in seq_ids:
                row = []
                for sid in ids:
                    sid8 = c8.add_sequence()
                    c8.extend(sid8, s.context)
                    for layer in range(opts.num_layers):
                        c8.write(sid8, layer, 0, *cache.read(sid, layer, 0, s.context))
                    row.append(sid8)
                ids8.append(row)
            self.timer.sync()
            # The anchor over what the FP8 pages hold: (B, Hkv, S, d) K and V, dequantized.
            batches, rows = self.anchor_at
            k = torch.stack([c8.read(ids8[0][b], 0)[0].transpose(0, 1) for b in range(s.batch)])
            v = torch.stack([c8.read(ids8[0][b], 0)[1].transpose(0, 1) for b in range(s.batch)])
            anchor, pivot = self.anchor, self.pivot
            self.anchor, self.pivot = anchor_reference(self._q4(0), k, v, batches, rows), None
            del k, v
            row_bytes = s.head_dim * kv_dtype.itemsize + SCALE_DTYPE.itemsize
            host_b = s.batch * s.context * s.hkv * 2 * row_bytes
            placed8 = [[set() for _ in ids] for ids in ids8]
            try:
                self._ours_config(api, c8, ids8, placed8, 0.0, None, method, bytes_kw={"host_bytes": host_b},
                                  page_bytes=c8.page_bytes)
            finally:
                self.anchor, self.pivot = anchor, pivot
        finally:
            self.timer.sync()
            if hasattr(c8, "close"):
                c8.close()
            del c8
            gc.collect()

    def _ours_config(self, api: OursApi, cache, seq_ids, placed, fraction: float, cfg: dict | None,
                     method: str, bytes_kw: dict | None = None, page_bytes: int | None = None) -> None:
        s = self.shape
        host_b, hbm_b = self._tier_bytes(fraction)
        if page_bytes is None:
            page_bytes = 2 * s.hkv * self.opts.page_size * s.head_dim * s.elem_bytes * self.opts.num_layers
        resident = len(placed[0][0]) * s.batch * page_bytes
        q_lens = None if s.q_len == 1 else [s.q_len] * s.batch
        kw = {"host_bytes": host_b, "hbm_bytes": hbm_b, **(bytes_kw or {}), "hbm_fraction": fraction}
        marked = {"back_to_back": True} if self.opts.layers > 1 else {}
        tables = [cache.kernel_tables(ids, **marked) for ids in seq_ids]
        outs = [torch.empty_like(q) for q in self.inputs.qs]
        config = _decode_config(cfg)

        def call(i):
            return api.run(self.inputs.qs[i], cache, tables[i], seq_ids[i], q_lens, config, outs[i])

        calls = [lambda i=i: call(i) for i in range(self.sets)]
        outs[0].fill_(float("nan"))  # poison: every element must be written
        try:
            res, extra = peak_extra_bytes(calls[0], self.opts.device)
        except api.missing_errors as e:
            self._ours_missing([fraction], _short_error(e), method)
            return
        except Exception as e:  # noqa: BLE001 - a crashing kernel is a failed check, not a crashed run
            add_check(self.doc, s, method, False, hbm_fraction=fraction, against=self._against(),
                      detail=f"raised {_short_error(e)}")
            self._ours_unmeasured([fraction], method)
            return
        out = res if isinstance(res, torch.Tensor) else outs[0]
        ok, err = self._check(q_as_4d(out, s.batch, s.q_len))
        add_check(self.doc, s, method, ok, hbm_fraction=fraction, rel_err=err, against=self._against())
        if not ok:
            self._ours_unmeasured([fraction], method)
            return
        ms = self._time(calls)
        self._add(method, ms, gpu_bytes=resident + extra, **kw)

    def _release_all(self) -> None:
        self.timer.sync()
        if self.inputs is not None:
            for h in self.inputs.host:
                h.close()
        self.inputs = None
        self.anchor = self.pivot = None
        gc.collect()
        if self.opts.device == "cuda":
            torch.cuda.empty_cache()


class _Selections:
    """A sparse plan's hook that keeps the selected page tables while ``keep`` (the checked call)."""

    def __init__(self):
        self.tables: list[torch.Tensor] = []
        self.keep = True

    def selected(self, call, page_table, seq_lens, sel_table) -> None:
        if self.keep:
            self.tables.append(sel_table.clone())


def _short_error(e: BaseException) -> str:
    """'Type: first line of the message' (at most 200 characters of it)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200] if lines else ''}"


def _public(trials: dict) -> dict:
    """Trial dicts without tensors, for the JSON."""
    return {n: {k: v for k, v in t.items() if k != "out"} for n, t in trials.items()}


def config_method(cfg: dict) -> str:
    """The method name of ours with one of ``--compare-configs``: ours[field=value,...]."""
    return "ours[" + ",".join(f"{k}={v}" for k, v in cfg.items()) + "]"


def _decode_config(cfg: dict | None):
    """A config dict of the command line: ``{"kernel": "q_tiled", ...}`` is a QTiledConfig (the
    staged Q-tiled kernel), any other a DecodeConfig."""
    if cfg is None:
        return None
    from directkv_cute.config import DecodeConfig, QTiledConfig
    if cfg.get("kernel") == "q_tiled":
        return QTiledConfig.from_dict({k: v for k, v in cfg.items() if k != "kernel"})
    return DecodeConfig.from_dict(cfg)


# ---- a whole sweep -------------------------------------------------------------------------
def run_shapes(shapes: Sequence[Shape], opts: BenchOptions, ceilings: Ceilings, doc: dict, out_path,
               *, deadline: float | None = None, progress: bool = True,
               ours_loader: Callable[[str], OursApi] = load_ours) -> dict:
    """Run every shape (skipping those that do not fit or start after ``deadline``, a
    ``time.monotonic()`` value), rewriting ``out_path`` after each shape."""
    bar = progress_bar(shapes, progress, doc["bench"], "shape")
    for shape in bar:
        if deadline is not None and time.monotonic() > deadline:
            doc["skipped"].append({"shape": shape.label, "bench": shape.bench, "reason": "time budget spent"})
            continue
        reason = skip_reason(shape, opts)
        if reason:
            doc["skipped"].append({"shape": shape.label, "bench": shape.bench, "reason": reason})
            _say(bar, f"skip {shape.label}: {reason}")
            continue
        if hasattr(bar, "set_postfix_str"):
            bar.set_postfix_str(shape.label)
        try:
            records = ShapeBench(shape, opts, ceilings, doc, ours_loader=ours_loader).run()
        except Exception as e:  # noqa: BLE001 - record the crash, keep the other shapes
            add_check(doc, shape, "shape", False, detail=f"crashed: {_short_error(e)}")
            _say(bar, f"FAILED {shape.label}:\n{traceback.format_exc()}")
            if opts.device == "cuda":
                torch.cuda.empty_cache()
            write_json(out_path, doc)
            continue
        doc["records"].extend(r.to_dict() for r in records)
        write_json(out_path, doc)
        _say(bar, format_table([r.to_dict() for r in records], ceilings if opts.device == "cuda" else None,
                               doc["notes"].get("variants")))
    return doc


def _say(bar, text: str) -> None:
    if hasattr(bar, "write"):
        bar.write(text)
    else:
        print(text, flush=True)
