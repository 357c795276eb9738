"""End to end: ``python -m bench e2e`` -- per-token decode time and prefill time of a whole model
generating over a long context, ours against transformers' own caches, in one run.

    python -m bench e2e                      # llama3-8b, 32k + 128k, batch 1 + 8, the four methods
    python -m bench e2e --quick              # 32k, batch 1, 8 timed tokens
    python -m bench e2e --preset llama3-70b --contexts 131072 --batches 1   # HF rows record their OOM
    python -m bench e2e --device cpu         # smoke: tiny preset, 128 tokens, ours[host] + dynamic
                                             # (no ceilings, physics rows or targets)

Methods (``--methods``), each through ``model.generate`` with greedy decoding on random prompts of
``--contexts`` tokens, ``--batches`` rows, ``--prefill-chunk`` tokens per prefill forward:

* ``dynamic``: transformers' default ``DynamicCache`` + SDPA, all KV in HBM;
* ``fa4``: the same ``DynamicCache`` (all KV in HBM) with the attention computed by
  FlashAttention-4 (``flash_attn.cute.flash_attn_func``, ``bench.fa4_attention``: registered with
  transformers as ``attn_implementation="directkv_fa4"``, causal bottom-right, GQA native);
* ``hf-offloaded``: ``generate(cache_implementation="offloaded")`` + SDPA, KV in host memory,
  each layer copied back to the GPU every step;
* ``hf-offloaded+fa4``: the offloaded cache with FA4's attention: the "swap + FA4" peer end to end
  (timed like hf-offloaded, ``--offloaded-tokens``);
* ``ours[host]``: ``directkv_cute.hf.DirectKVCache``, host only: KV in pinned host pages, read in
  place by our kernels, each step's new K/V read from its HBM window (``window_tokens``);
* ``ours[readback]``: the same without the window (``window_tokens=0``): each step's new K/V are
  stored in host pages and read back from there;
* ``ours[fused]``: ``ours[host]`` with ``directkv_cute.hf.fuse_kv_projection``: each layer's K/V
  projection, RoPE and page stores in one kernel (``kv_project``);
* ``ours[hbm]``: the same with an HBM tier of ``--hbm-budget`` bytes (default: what hf-offloaded
  used beyond the weights at the same context and batch, i.e. its peak GPU memory minus the
  memory allocated before it); ``ours[hbm=8GiB]`` fixes one.

The FA4 methods are not in the default set (each is one more full prefill per context and batch,
and hf-offloaded+fa4 another seconds-per-token decode); ask for them with ``--methods``. Where
FA4 cannot run (no CUDA, no SM90, flash-attn-4 not importable: ``bench.peers.unavailable``) their
rows are ``skipped`` with the reason. FA4's attention refuses padding masks, dropout and other
mask patterns (the prompts here are random, unpadded). The targets list ours[host]'s speedup over
hf-offloaded+fa4 (reported, with no limit).

The model (``--preset``, random weights from ``directkv_cute.presets.build_random_model``) is built
once on the GPU and kept there; every method builds its cache, runs and frees it (then
``gc.collect`` and ``torch.cuda.empty_cache``) before the next, and the peak GPU memory counter is
reset before each. Per (context, batch) the methods run in the order dynamic, fa4, hf-offloaded,
hf-offloaded+fa4, ours[...], ours[hbm] (the last needs hf-offloaded's peak).

**Timing** (``directkv_cute.generate.timed_generate``): a ``LogitsProcessor`` is called once per
generated token right after that token's forward; it records a CUDA event per call, and
synchronizes the device on its first call. ``prefill_s`` is ``generate()`` called -> first
token's logits ready (the whole chunked prefill, TTFT). The intervals between consecutive events
are per-token decode times (next-token selection + bookkeeping + one forward of every layer, on
the GPU timeline, so host gaps count); the first ``--warmup-tokens`` intervals are dropped and
``decode_ms`` is the median of the next ``--new-tokens``; ``tokens/s`` = batch * 1000 /
decode_ms. hf-offloaded, whose steps take seconds at long contexts, times ``--offloaded-tokens``
after one warm-up token. Before each ``ours`` row the same (context, batch) runs once on a
one-layer view of the model (the same weights), so that the kernels the row needs (chosen per
batch, context and query length, never per layer) are compiled and loaded before anything is
timed; ``compiled`` in a row counts kernels compiled during its timed run anyway. The FA4 rows get
the same warm-up (FA4 compiles its CuTe kernels on first use).

**Failures are results.** ``torch.cuda.OutOfMemoryError`` (or a host allocation failure) is
recorded as status ``OOM`` with its message, everything is freed, and the run goes on. Batch > 1
rows that clearly cannot fit (their KV alone exceeds the host memory available, or for
``dynamic`` weights + KV exceed the GPU's memory) are not attempted (``skipped``, with the
numbers); batch 1 rows are always attempted (``--no-skip`` attempts everything).
``--time-budget-s S`` (default: none, every row runs) stops starting rows after S seconds, and
skips a row whose estimated time (``estimate_row_s``, from the same method's rows already
measured) exceeds what is left; a grid too long for one sitting is split into runs by
``--contexts`` and ``--methods``.

**What the time goes to.** Prefill dominates: every method prefills its own cache, and the
prefill of batch x context tokens grows with the square of the context (4 methods x 128k, and
batch 8 at 32k is 8x batch 1's tokens). Then hf-offloaded's decode (seconds per token at 128k,
which is why it times only ``--offloaded-tokens``), then pinning host memory (``setup_s``, not
in any timing). Batch 8 at 128k is 128 GiB of bf16 KV for the 8B shape: all the host memory of
a 128 GiB machine and, with the weights, more than the GPU's, so its rows are
skipped up front; the rows run batch 1 first so that the main targets are measured before the
budget can run out. The JSON is rewritten after every row, so a run cut short keeps its rows.

**Ceilings and physics, same run.** The host-read, HBM-read and memcpy ceilings are measured first
(``bench.ceilings``). ``dynamic`` also runs at ``--physics-context`` (4k) for each batch: the
model's non-attention time per token. The ``physics`` row of a (context, batch) is ours' KV bytes
per step / the host ceiling + that time; the bench's targets are checked against it:
ours[host] <= 1.15 x physics, ours[host] >= 5x faster than hf-offloaded at 32k and >= 7x at 128k
(at less peak GPU memory), ours[hbm] faster than ours[host], ours' prefill <= 1.3x dynamic's where
dynamic fits, and for llama3-70b >= 1 token/s. A CPU smoke run (``--device cpu``) has no
physics rows and no targets, and prints no ceilings: its timings mean nothing.

Files under ``--out-dir`` (default ./bench-results): ``<gpu>-<date>-e2e-<preset>.json`` (schema
``directkv-bench-e2e/1``: the header, ceilings, args, ``rows``, ``targets``), the table as ``.txt`` and ``.png`` (decode
ms/token and prefill s per method against context, one column per batch) when matplotlib is
installed (GPU runs). The JSON is rewritten after every row.
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import re
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import UsageError, add_device_argument, add_out_dir_argument, checked_out_dir
from bench.common import fmt_opt as _f
from bench.common import available_host_bytes, is_cpu_run, pyplot, require_gpu, save_figure, write_run_files
from bench.common import kilo as _kilo

E2E_SCHEMA = "directkv-bench-e2e/1"
GiB = 1 << 30
BASE_METHODS = ("dynamic", "hf-offloaded", "ours")
DEFAULT_METHODS = "dynamic,hf-offloaded,ours[host],ours[hbm]"
FA4_METHODS = ("fa4", "hf-offloaded+fa4")
METHOD_ORDER = {"dynamic": 0, "fa4": 1, "hf-offloaded": 2, "hf-offloaded+fa4": 3, "ours[readback]": 4,
                "ours[host]": 5, "ours[fused]": 6, "ours[fp8]": 7, "ours[hbm]": 8}
# ours[sparse=B] / ours[fp8,sparse=B]: decode reads each row's best pages under budget B; after
# the exact method of the same pages.
SPARSE_ORDER = 9


def method_order(name: str) -> tuple:
    """A method name's place in tables and plots: METHOD_ORDER, then the sparse methods."""
    if "sparse=" in name:
        return (SPARSE_ORDER, "fp8" in name, name)
    return (METHOD_ORDER.get(name, SPARSE_ORDER + 1), False, name)

ROW_FIELDS = (
    "bench", "preset", "method", "label", "role", "context", "batch", "dtype", "status", "error",
    "prefill_s", "decode_ms", "decode_ms_mean", "tokens_per_s", "step_ms", "timed_tokens", "warmup_tokens",
    "peak_gpu_bytes", "base_gpu_bytes", "host_kv_bytes", "hbm_kv_bytes", "hbm_budget", "kv_bytes_per_step",
    "setup_s", "wall_s", "agree_tokens", "compiled",
)
STATUSES = ("ok", "OOM", "skipped", "error", "computed")

# The targets: ours[host] at least this many times faster than hf-offloaded per context.
OFFLOAD_SPEEDUP = {32768: 5.0, 131072: 7.0}
PHYSICS_FACTOR = 1.15
PREFILL_FACTOR = 1.3
MIN_TOKENS_PER_S = {"llama3-70b": 1.0}
FP8_MIN_TOKENS_PER_S = {"llama3-70b": 2.0}  # with FP8 KV pages (ours[fp8])
# Sparse decode reads: from this context on, a budget of at most 1/8 of the pages decodes in at
# most this share of the exact method's step (the same pages: ours[host] or ours[fp8]); with FP8
# pages and such a budget, at least these tokens/s per sequence.
SPARSE_TARGET_CONTEXT = 131072
SPARSE_STEP_SHARE = 0.2
SPARSE_FP8_MIN_TOKENS_PER_S = {"llama3-70b": 8.0}

# The CPU smoke run (and ``--device cpu`` defaults): the tiny preset, seconds on a laptop.
CPU_DEFAULTS = dict(preset="tiny", contexts=[128], batches=[1], new_tokens=2, warmup_tokens=1, offloaded_tokens=1,
                    methods="ours[host],dynamic", physics_context=64, prefill_chunk=64, dtype="fp32")
GPU_DEFAULTS = dict(preset="llama3-8b", contexts=[32768, 131072], batches=[1, 8], new_tokens=16, warmup_tokens=2,
                    offloaded_tokens=4, methods=DEFAULT_METHODS, physics_context=4096, prefill_chunk=4096,
                    dtype="bf16")
QUICK_GPU = dict(contexts=[32768], batches=[1], new_tokens=8, offloaded_tokens=2)


# ---- methods ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Method:
    """A method of the bench: ``base`` in BASE_METHODS; for ours ``tier`` "host" or "hbm" and an
    explicit ``budget`` (bytes) or None (the default budget); for dynamic / hf-offloaded ``attn``,
    the attention: "sdpa" or "fa4" (FlashAttention-4, ``bench.fa4_attention``)."""

    base: str
    tier: str = "host"
    budget: int | None = None
    window: bool = True  # ours: each step's new K/V read from the HBM window
    fused: bool = False  # ours: fuse_kv_projection (the K/V projection kernel)
    kv_dtype: str | None = None  # ours: "fp8" pages (DirectKVCache(kv_dtype=...)), None the model's dtype
    attn: str = "sdpa"  # dynamic / hf-offloaded: "sdpa" or "fa4"
    sparse: str | None = None  # ours: a page budget for decode ("1/8", "256p"; directkv_cute.sparse), None: exact

    @property
    def name(self) -> str:
        """The method's key in rows and plots: dynamic, fa4, hf-offloaded, hf-offloaded+fa4,
        ours[readback], ours[host], ours[fused], ours[fp8], ours[hbm], ours[sparse=B], ours[fp8,sparse=B],
        ours[hbm,sparse=B] (the HBM tier as the budget's recall cache)."""
        if self.base != "ours":
            if self.attn == "sdpa":
                return self.base
            return self.attn if self.base == "dynamic" else f"{self.base}+{self.attn}"
        if self.sparse:
            where = ",".join(x for x in (self.kv_dtype, "hbm" if self.tier == "hbm" else None) if x)
            return f"ours[{where},sparse={self.sparse}]" if where else f"ours[sparse={self.sparse}]"
        if self.fused:
            return "ours[fused]"
        if self.kv_dtype:
            return f"ours[{self.kv_dtype}]"
        return f"ours[{self.tier}]" if self.window else "ours[readback]"

    def label(self, budget: int | None = None) -> str:
        if self.base == "ours" and self.tier == "hbm":
            b = self.budget if self.budget is not None else budget
            if b is None:
                return self.name
            return f"ours[hbm={_fmt_size(b)},sparse={self.sparse}]" if self.sparse else f"ours[hbm={_fmt_size(b)}]"
        return self.name


def parse_methods(text: str) -> list[Method]:
    """``dynamic,fa4,hf-offloaded,hf-offloaded+fa4,ours[host],ours[hbm],ours[hbm=8GiB]`` -> Methods
    (bench order)."""
    from directkv_cute.generate import parse_size
    from directkv_cute.sparse_budget import parse_budget

    out: list[Method] = []
    for item in (s.strip() for s in re.split(r",(?![^\[]*\])", text)):  # commas outside brackets
        if not item:
            continue
        if item in ("dynamic", "hf-offloaded"):
            out.append(Method(item))
        elif item == "fa4":
            out.append(Method("dynamic", attn="fa4"))
        elif item == "hf-offloaded+fa4":
            out.append(Method("hf-offloaded", attn="fa4"))
        elif item in ("ours", "ours[host]"):
            out.append(Method("ours", "host"))
        elif item == "ours[readback]":
            out.append(Method("ours", "host", window=False))
        elif item == "ours[fused]":
            out.append(Method("ours", "host", fused=True))
        elif item == "ours[fp8]":
            out.append(Method("ours", "host", kv_dtype="fp8"))
        elif item == "ours[hbm]":
            out.append(Method("ours", "hbm"))
        elif item.startswith("ours[hbm=") and item.endswith("]"):
            out.append(Method("ours", "hbm", parse_size(item[len("ours[hbm="):-1])))
        elif item.startswith(("ours[sparse=", "ours[fp8,sparse=", "ours[hbm,sparse=")) and item.endswith("]"):
            where, text = item[len("ours["):-1].rpartition("sparse=")[::2]
            try:
                parse_budget(text)
            except ValueError as e:
                raise ValueError(f"method {item!r}: {e}") from None
            out.append(Method("ours", "hbm" if where == "hbm," else "host", kv_dtype="fp8" if where == "fp8," else None,
                              sparse=text))
        else:
            raise ValueError(f"unknown method {item!r}; use dynamic, fa4, hf-offloaded, hf-offloaded+fa4, "
                             "ours[readback], ours[host], ours[fused], ours[fp8], ours[hbm], ours[hbm=<bytes>], "
                             "ours[sparse=<budget>], ours[fp8,sparse=<budget>] or ours[hbm,sparse=<budget>] (budget: "
                             "1/8, 0.125 or 256p)")
    if not out:
        raise ValueError("no methods given")
    names = [m.name for m in out]
    if len(set(names)) != len(names):
        raise ValueError(f"a method is given twice in {text!r}")
    return sorted(out, key=lambda m: method_order(m.name))


# ---- rows ------------------------------------------------------------------------------------
def new_row(**fields) -> dict:
    """A row with every field of ROW_FIELDS (missing ones None); tokens_per_s derived."""
    unknown = set(fields) - set(ROW_FIELDS)
    if unknown:
        raise KeyError(f"unknown row fields {sorted(unknown)}")
    row = {f: None for f in ROW_FIELDS} | {"bench": "e2e", "role": "measured"} | fields
    if row["label"] is None:
        row["label"] = row["method"]
    if row["tokens_per_s"] is None and row["decode_ms"]:
        row["tokens_per_s"] = row["batch"] * 1e3 / row["decode_ms"]
    return row


def validate_row(row: dict) -> list[str]:
    problems = []
    if set(row) != set(ROW_FIELDS):
        extra, missing = sorted(set(row) - set(ROW_FIELDS)), sorted(set(ROW_FIELDS) - set(row))
        return [f"fields differ: extra {extra}, missing {missing}"]
    if row["status"] not in STATUSES:
        problems.append(f"status {row['status']!r} not in {STATUSES}")
    for f in ("context", "batch"):
        if not isinstance(row[f], int) or row[f] < 1:
            problems.append(f"{f} must be a positive int, got {row[f]!r}")
    for f in ("prefill_s", "decode_ms", "tokens_per_s"):
        v = row[f]
        if v is not None and (not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0):
            problems.append(f"{f} must be null or a finite non-negative number, got {v!r}")
    if row["status"] == "ok" and row["decode_ms"] is None:
        problems.append("status ok without decode_ms")
    if row["decode_ms"] and row["tokens_per_s"] is not None and \
            not math.isclose(row["tokens_per_s"], row["batch"] * 1e3 / row["decode_ms"], rel_tol=1e-6):
        problems.append("tokens_per_s != batch * 1000 / decode_ms")
    return problems


def validate_doc(doc: dict) -> list[str]:
    problems = [f"missing top-level field {f!r}" for f in ("schema", "bench", "header", "ceilings", "rows", "targets")
                if f not in doc]
    if problems:
        return problems
    if doc["schema"] != E2E_SCHEMA:
        problems.append(f"schema {doc['schema']!r} != {E2E_SCHEMA!r}")
    for f in ("gpu", "gpu_key", "date", "versions"):
        if f not in doc["header"]:
            problems.append(f"header lacks {f!r}")
    for i, row in enumerate(doc["rows"]):
        problems += [f"row {i}: {p}" for p in validate_row(row)]
    return problems


def kv_token_bytes(config, dtype: torch.dtype) -> int:
    """Bytes of K and V of one token over all layers: a one-token page of every layer."""
    from directkv_cute.cache import page_bytes
    from directkv_cute.hf import model_spec

    s = model_spec(config)
    return page_bytes(s.num_layers, s.num_kv_heads, 1, s.head_dim, dtype)


def mean_attended(context: int, warmup: int, timed: int) -> float:
    """Mean tokens each timed decode step attends over: after a prompt of ``context`` tokens,
    decode step k (k >= 1) attends over context + k tokens; the timed steps are warmup+1 ..
    warmup+timed."""
    return context + warmup + (timed + 1) / 2


def sparse_tokens(budget: str, tokens: float, page_size: int) -> float:
    """Tokens a decode step under the page budget ``budget`` reads of a sequence of ``tokens``:
    its selected pages (``SparseBudget.budget_pages``), the newest one partial."""
    from directkv_cute.sparse_budget import parse_budget

    pages = math.ceil(tokens / page_size)
    return min(float(tokens), parse_budget(budget).budget_pages(pages) * page_size)


def _ok(rows, **match) -> list[dict]:
    return [r for r in rows if r["status"] == "ok" and all(r[k] == v for k, v in match.items())]


def _one(rows, **match) -> dict | None:
    got = _ok(rows, **match)
    return got[0] if got else None


def physics_rows(rows: list[dict], ceilings: dict, *, preset: str, dtype: str, token_bytes: int, warmup: int,
                 timed: int, physics_context: int) -> list[dict]:
    """The computed ``physics`` row of every measured (context, batch): ours' KV bytes per step at
    the host ceiling + dynamic's per-token time at the physics context with the same batch (the
    model's non-attention time)."""
    out = []
    groups = sorted({(r["context"], r["batch"]) for r in rows if r["role"] == "measured"})
    for ctx, batch in groups:
        base = _one(rows, method="dynamic", role="non-attention", batch=batch)
        if base is None:
            continue
        kv = int(batch * mean_attended(ctx, warmup, timed) * token_bytes)
        ms = kv / (ceilings["host_read_gbps"] * 1e9) * 1e3 + base["decode_ms"]
        out.append(new_row(preset=preset, method="physics", label="physics", role="computed", context=ctx,
                           batch=batch, dtype=dtype, status="computed", decode_ms=ms, kv_bytes_per_step=kv,
                           error=f"KV {kv / 1e9:.2f} GB / {ceilings['host_read_gbps']:.1f} GB/s + "
                                 f"dynamic@{physics_context} {base['decode_ms']:.2f} ms"))
    return out


def _budget_fraction(method: str) -> float | None:
    """The fraction of a sparse method's budget (``ours[sparse=1/8]``: 0.125); None for a page count."""
    from directkv_cute.sparse_budget import parse_budget

    return parse_budget(method.split("sparse=", 1)[1].rstrip("]")).fraction


def evaluate_targets(rows: list[dict], *, preset: str) -> list[dict]:
    """The bench's targets, each {target, context, batch, value, limit, ok, detail} (ok None when a
    side is missing)."""
    out = []

    def add(name, ctx, batch, value, limit, ok, detail):
        out.append({"target": name, "context": ctx, "batch": batch, "value": value, "limit": limit, "ok": ok,
                    "detail": detail})

    groups = sorted({(r["context"], r["batch"]) for r in rows if r["role"] == "measured"})
    for ctx, batch in groups:
        m = dict(context=ctx, batch=batch)
        host = _one(rows, method="ours[host]", role="measured", **m)
        hbm = _one(rows, method="ours[hbm]", role="measured", **m)
        off = _one(rows, method="hf-offloaded", role="measured", **m)
        dyn = _one(rows, method="dynamic", role="measured", **m)
        phys = next((r for r in rows if r["method"] == "physics" and r["context"] == ctx and r["batch"] == batch), None)
        f8 = _one(rows, method="ours[fp8]", role="measured", **m)
        if f8 is not None and f8.get("decode_ms"):
            need_tps = FP8_MIN_TOKENS_PER_S.get(preset)
            per_seq = 1e3 / f8["decode_ms"]
            if need_tps is not None:
                add(f"ours[fp8] decode >= {need_tps:g} token/s per sequence", ctx, batch, per_seq, need_tps,
                    per_seq >= need_tps, f"{per_seq:.2f} token/s ({f8['decode_ms']:.1f} ms per token)")
            if host is not None and host.get("decode_ms"):
                add("ours[fp8] decode faster than ours[host] (bf16 pages)", ctx, batch, f8["decode_ms"],
                    host["decode_ms"], f8["decode_ms"] < host["decode_ms"],
                    f"{f8['decode_ms']:.1f} vs {host['decode_ms']:.1f} ms ({host['decode_ms'] / f8['decode_ms']:.2f}x)")
        for r in rows:
            if r["role"] != "measured" or r["status"] != "ok" or "sparse=" not in r["method"] or not r["decode_ms"] \
                    or r["context"] != ctx or r["batch"] != batch or r["method"].startswith("ours[hbm,"):
                continue
            exact = f8 if r["method"].startswith("ours[fp8,") else host
            fraction = _budget_fraction(r["method"])
            if exact is not None and exact.get("decode_ms") and ctx >= SPARSE_TARGET_CONTEXT and fraction is not None \
                    and fraction <= 1 / 8:
                add(f"{r['method']} decode <= {SPARSE_STEP_SHARE:g} x {exact['method']}", ctx, batch, r["decode_ms"],
                    SPARSE_STEP_SHARE * exact["decode_ms"], r["decode_ms"] <= SPARSE_STEP_SHARE * exact["decode_ms"],
                    f"{r['decode_ms']:.1f} vs {exact['decode_ms']:.1f} ms ({r['decode_ms'] / exact['decode_ms']:.3f}x)")
            need_tps = SPARSE_FP8_MIN_TOKENS_PER_S.get(preset)
            if r["method"].startswith("ours[fp8,") and need_tps is not None and fraction is not None \
                    and fraction <= 1 / 8 and ctx >= SPARSE_TARGET_CONTEXT:
                per_seq = 1e3 / r["decode_ms"]
                add(f"{r['method']} decode >= {need_tps:g} token/s per sequence", ctx, batch, per_seq, need_tps,
                    per_seq >= need_tps, f"{per_seq:.2f} token/s ({r['decode_ms']:.1f} ms per token)")
        if host is None:
            continue
        rb = _one(rows, method="ours[readback]", role="measured", **m)
        fu = _one(rows, method="ours[fused]", role="measured", **m)
        if fu is not None and rb is not None and fu.get("prefill_s") and rb.get("prefill_s"):
            add("ours[fused] prefill faster than ours[readback] (the unfused integration)", ctx, batch,
                fu["prefill_s"], rb["prefill_s"], fu["prefill_s"] < rb["prefill_s"],
                f"{fu['prefill_s']:.2f} vs {rb['prefill_s']:.2f} s")
        if fu is not None and rb is not None and fu.get("decode_ms") and rb.get("decode_ms"):
            add("ours[fused] decode no slower than ours[readback] (<= 1.02x)", ctx, batch, fu["decode_ms"],
                1.02 * rb["decode_ms"], fu["decode_ms"] <= 1.02 * rb["decode_ms"],
                f"{fu['decode_ms']:.2f} vs {rb['decode_ms']:.2f} ms")
        if rb is not None and rb.get("prefill_s") and host.get("prefill_s"):
            add("ours[host] prefill faster than ours[readback] (the window)", ctx, batch, host["prefill_s"],
                rb["prefill_s"], host["prefill_s"] < rb["prefill_s"],
                f"{host['prefill_s']:.2f} vs {rb['prefill_s']:.2f} s")
        if rb is not None and rb.get("decode_ms") and host.get("decode_ms"):
            add("ours[host] decode no slower than ours[readback] (<= 1.02x)", ctx, batch, host["decode_ms"],
                1.02 * rb["decode_ms"], host["decode_ms"] <= 1.02 * rb["decode_ms"],
                f"{host['decode_ms']:.2f} vs {rb['decode_ms']:.2f} ms")
        if phys is not None:
            limit = PHYSICS_FACTOR * phys["decode_ms"]
            add(f"ours[host] <= {PHYSICS_FACTOR} x physics", ctx, batch, host["decode_ms"], limit,
                host["decode_ms"] <= limit,
                f"{host['decode_ms']:.1f} ms vs {PHYSICS_FACTOR} x {phys['decode_ms']:.1f} ms")
        if off is not None:
            speedup = off["decode_ms"] / host["decode_ms"]
            need = OFFLOAD_SPEEDUP.get(ctx)
            add("ours[host] speedup over hf-offloaded" + (f" >= {need:g}x" if need else ""), ctx, batch, speedup, need,
                None if need is None else speedup >= need,
                f"{off['decode_ms']:.1f} / {host['decode_ms']:.1f} ms")
            if host["peak_gpu_bytes"] is not None and off["peak_gpu_bytes"] is not None:
                add("ours[host] peak GPU memory < hf-offloaded", ctx, batch, host["peak_gpu_bytes"] / GiB,
                    off["peak_gpu_bytes"] / GiB, host["peak_gpu_bytes"] < off["peak_gpu_bytes"],
                    f"{host['peak_gpu_bytes'] / GiB:.2f} vs {off['peak_gpu_bytes'] / GiB:.2f} GiB")
        off_fa4 = _one(rows, method="hf-offloaded+fa4", role="measured", **m)
        if off_fa4 is not None:  # the swap + FA4 peer: reported, with no limit
            add("ours[host] speedup over hf-offloaded+fa4 (swap + FA4)", ctx, batch,
                off_fa4["decode_ms"] / host["decode_ms"], None, None,
                f"{off_fa4['decode_ms']:.1f} / {host['decode_ms']:.1f} ms")
        if hbm is not None:
            add("ours[hbm] faster than ours[host]", ctx, batch, hbm["decode_ms"], host["decode_ms"],
                hbm["decode_ms"] < host["decode_ms"],
                f"{hbm['label']} {hbm['decode_ms']:.1f} vs {host['decode_ms']:.1f} ms")
        if dyn is not None and dyn["prefill_s"] and host["prefill_s"]:
            limit = PREFILL_FACTOR * dyn["prefill_s"]
            add(f"ours[host] prefill <= {PREFILL_FACTOR} x dynamic", ctx, batch, host["prefill_s"], limit,
                host["prefill_s"] <= limit, f"{host['prefill_s']:.2f} vs {dyn['prefill_s']:.2f} s")
        need_tps = MIN_TOKENS_PER_S.get(preset)
        if need_tps is not None:
            per_seq = 1e3 / host["decode_ms"]
            add(f"ours[host] decode >= {need_tps:g} token/s per sequence", ctx, batch, per_seq, need_tps,
                per_seq >= need_tps, f"{per_seq:.2f} token/s after a {host['prefill_s']:.1f} s prefill")
    return out


def agree_tokens(a: torch.Tensor, b: torch.Tensor) -> int:
    """Leading new tokens two greedy runs agree on (the fewest over the batch rows)."""
    n = min(a.shape[1], b.shape[1])
    if n == 0:
        return 0
    same = (a[:, :n].cpu() == b[:, :n].cpu()).to(torch.int64)
    lead = same.cumprod(dim=1).sum(dim=1)
    return int(lead.min())


# ---- tables and plots ------------------------------------------------------------------------
def _fmt_gib(n) -> str:
    if n is None:
        return "-"
    g = n / GiB
    return f"{g:.2f}GiB" if g < 10 else f"{g:.1f}GiB"


def _fmt_size(n) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 (0 as "0")."""
    if n is None:
        return "-"
    if n == 0:
        return "0"
    if n >= GiB:
        return _fmt_gib(n)
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{int(n)}B"


TABLE_COLUMNS = ("method", "B", "ctx", "status", "prefill s", "ms/token", "tok/s", "peak GiB", "host KV", "HBM KV",
                 "vs offl.", "note")


def format_table(doc: dict) -> str:
    """The rows as a fixed-width table under the ceilings, then the targets (a CPU run: the table
    alone)."""
    rows = sorted(doc["rows"], key=lambda r: (r["role"] == "non-attention" and -1 or 0, r["batch"], r["context"],
                                              method_order(r["method"])))
    lines = [TABLE_COLUMNS]
    for r in rows:
        off = _one(doc["rows"], method="hf-offloaded", role="measured", context=r["context"], batch=r["batch"])
        vs = None
        if off is not None and r["decode_ms"] and r["method"] != "hf-offloaded":
            vs = off["decode_ms"] / r["decode_ms"]
        note = r["error"] or ""
        if r["role"] == "non-attention":
            note = "non-attention time (physics)"
        if r["compiled"]:
            note = (note + "; " if note else "") + f"{r['compiled']} kernels compiled while timed"
        if r["agree_tokens"] is not None and r["method"] != "dynamic":
            note = (note + "; " if note else "") + f"agrees with dynamic for {r['agree_tokens']} tokens"
        if r["status"] not in ("ok", "computed") and len(note) > 90:
            note = note[:87] + "..."
        peak = None if r["peak_gpu_bytes"] is None else r["peak_gpu_bytes"] / GiB
        lines.append((r["label"], str(r["batch"]), _kilo(r["context"]), r["status"], _f(r["prefill_s"], ".2f"),
                      _f(r["decode_ms"], ".1f"), _f(r["tokens_per_s"], ".2f"), _f(peak, ".2f"),
                      _fmt_size(r["host_kv_bytes"]), _fmt_size(r["hbm_kv_bytes"]),
                      "-" if vs is None else f"{vs:.1f}x", note))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(TABLE_COLUMNS))]
    body = ["  ".join(str(c).ljust(w) if i in (0, 3, len(widths) - 1) else str(c).rjust(w)
                      for i, (c, w) in enumerate(zip(line, widths))).rstrip() for line in lines]
    body.insert(1, "  ".join("-" * w for w in widths))
    c = doc["ceilings"]
    head = [f"== e2e {doc['args'].get('preset')} on {doc['header']['gpu']} {doc['header']['date']} "
            f"({doc['header'].get('dtype', '')}, transformers {doc['header']['versions'].get('transformers')})"]
    if not is_cpu_run(doc["header"]):
        head.append(f"ceilings: host read {c['host_read_gbps']:.1f} GB/s, HBM read {c['hbm_read_gbps']:.0f} GB/s, "
                    f"memcpy H2D {c['memcpy_h2d_gbps']:.1f} GB/s")
    tail = []
    for t in doc["targets"]:
        mark = {True: "MET ", False: "MISS", None: "    "}[t["ok"]]
        tail.append(f"{mark} {t['target']} at {_kilo(t['context'])} B{t['batch']}: {t['detail']}"
                    + (f" (value {t['value']:.3g}, limit {t['limit']:.3g})" if t["limit"] is not None else
                       f" (value {t['value']:.3g})"))
    return "\n".join(head + body + (["targets:"] + tail if tail else []))


_STYLE = {"ours[host]": "o-", "ours[hbm]": "s-", "dynamic": "d-.", "fa4": "v-.", "hf-offloaded": "^--",
          "hf-offloaded+fa4": "<--", "physics": "kx:"}


def plot_e2e(doc: dict, path: str | Path) -> Path | None:
    """PNG: decode ms/token (top) and prefill s (bottom) per method against context, one column
    per batch. None when matplotlib is missing or nothing was measured."""
    plt = pyplot()
    if plt is None:
        return None
    rows = [r for r in doc["rows"] if r["decode_ms"] is not None and r["role"] != "non-attention"]
    if not rows:
        return None
    batches = sorted({r["batch"] for r in doc["rows"] if r["role"] == "measured"})
    fig, axes = plt.subplots(2, len(batches), figsize=(5 * len(batches), 7), squeeze=False)
    for col, b in enumerate(batches):
        for method in _STYLE:
            pts = sorted((r["context"], r["decode_ms"], r["prefill_s"]) for r in rows
                         if r["batch"] == b and r["method"] == method)
            if not pts:
                continue
            axes[0][col].plot([p[0] for p in pts], [p[1] for p in pts], _STYLE[method], label=method, ms=5)
            pre = [(p[0], p[2]) for p in pts if p[2] is not None]
            if pre:
                axes[1][col].plot([p[0] for p in pre], [p[1] for p in pre], _STYLE[method], label=method, ms=5)
        failed = [f"{r['label']} {_kilo(r['context'])}: {r['status']}" for r in doc["rows"]
                  if r["batch"] == b and r["status"] in ("OOM", "error", "skipped") and r["role"] == "measured"]
        if failed:
            axes[0][col].text(0.02, 0.02, "\n".join(failed[:8]), transform=axes[0][col].transAxes, fontsize=6,
                              va="bottom", color="firebrick")
        for row, ylabel in ((0, "decode ms / token"), (1, "prefill s")):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set(xlabel="context (tokens)", ylabel=ylabel, title=f"{doc['args'].get('preset')} batch {b}")
            ax.grid(True, which="both", alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7)
    h = doc["header"]
    return save_figure(plt, fig, path, f"{h['gpu']} {h['date']}: host read ceiling "
                       f"{doc['ceilings']['host_read_gbps']:.1f} GB/s (physics: KV / ceiling + non-attention time)")


# ---- memory estimates ------------------------------------------------------------------------
def predict_skip(method: Method, *, batch: int, kv_bytes: int, weights: int, gpu_total: int | None,
                 host_avail: int | None, budget: int | None) -> str | None:
    """Why a batch > 1 row clearly cannot fit (its KV alone exceeds the host memory available, or
    dynamic's weights + KV the GPU's memory), else None. Batch 1 rows are always attempted."""
    if batch <= 1:
        return None
    if method.base == "dynamic":
        if gpu_total is not None and weights + kv_bytes > gpu_total:
            return (f"cannot fit: weights {_fmt_gib(weights)} + KV {_fmt_gib(kv_bytes)} > "
                    f"{_fmt_gib(gpu_total)} of GPU memory")
        return None
    host_need = kv_bytes - ((budget or 0) if method.tier == "hbm" else 0)
    if host_avail is not None and host_need > host_avail:
        return f"cannot fit: KV {_fmt_gib(host_need)} in host memory > {_fmt_gib(host_avail)} available"
    return None


# ---- running ---------------------------------------------------------------------------------
def _is_oom(e: BaseException) -> bool:
    if isinstance(e, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and ("out of memory" in text or "cudahostregister" in text
                                            or "alloc_failed" in text or "cudaerrormemoryallocation" in text)


def _free(device: str) -> None:
    """Collect garbage and hand cached GPU memory and cached pinned host memory back (transformers'
    offloaded cache copies layers to pinned host tensors that torch's host allocator keeps)."""
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        for fn in (getattr(getattr(torch, "accelerator", None), "empty_host_cache", None),
                   getattr(torch._C, "_host_emptyCache", None)):
            if fn is not None:
                try:
                    fn()
                    break
                except (RuntimeError, AttributeError):
                    continue


def _cache_kv_bytes(cache, device: str) -> tuple[int, int]:
    """(host, device) bytes of K/V in a transformers cache's layers: on the CPU while the model
    runs on a GPU (offloaded) is host, on the model's device is device."""
    host = dev = 0
    for layer in getattr(cache, "layers", None) or []:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor) and t.numel():
                if t.device.type == "cpu" and device != "cpu":
                    host += t.numel() * t.element_size()
                else:
                    dev += t.numel() * t.element_size()
    return host, dev


def shallow_model(model, layers: int = 1):
    """A view of ``model`` with only its first ``layers`` decoder layers (the same modules, no
    new weights): its kernels' shapes are the model's, at a fraction of the cost (the warm-up)."""
    import torch.nn as nn

    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types[:layers])
    with torch.device("meta"):
        view = type(model)(cfg)
    prefix = model.base_model_prefix
    inner, view_inner = getattr(model, prefix), getattr(view, prefix)
    for name, child in list(view_inner.named_children()):
        src = getattr(inner, name)
        setattr(view_inner, name, nn.ModuleList(list(src[:layers])) if name == "layers" else src)
    for name, _ in list(view.named_children()):
        if name != prefix:
            setattr(view, name, getattr(model, name))
    left = [n for n, t in [*view.named_parameters(), *view.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"shallow_model: {left[:3]} still on the meta device")
    view.eval()
    return view


def _set_attn(models, impl: str) -> None:
    for m in models:
        m.set_attn_implementation(impl)


def _attn_implementation(method: Method) -> str:
    """The ``attn_implementation`` of a dynamic / hf-offloaded method: "sdpa", or FA4's
    (``bench.fa4_attention``, registered with transformers at its import)."""
    if method.attn == "fa4":
        from bench import fa4_attention

        return fa4_attention.ATTN_IMPLEMENTATION
    return method.attn


def fa4_unavailable(method: Method, device: str) -> str | None:
    """Why an FA4 method cannot run here (``bench.peers.unavailable``), or None (also for the
    methods that do not use FA4)."""
    if method.attn != "fa4":
        return None
    from bench.fa4_attention import unavailable

    return unavailable(device)


@dataclass
class Options:
    preset: str
    device: str
    dtype: torch.dtype
    contexts: list[int]
    batches: list[int]
    methods: list[Method]
    new_tokens: int
    warmup_tokens: int
    offloaded_tokens: int
    prefill_chunk: int
    page_size: int
    physics_context: int
    hbm_budget: int | None
    time_budget_s: float | None
    skip: bool
    seed: int
    progress: bool


class Runner:
    """Runs the rows of one bench on one model."""

    def __init__(self, model, opts: Options):
        self.model = model
        self.opts = opts
        self.view = None
        self.token_bytes = kv_token_bytes(model.config, opts.dtype)
        from directkv_cute.presets import weight_bytes

        self.weights = weight_bytes(model)
        self.cuda = opts.device == "cuda"
        self.gpu_total = torch.cuda.get_device_properties(0).total_memory if self.cuda else None
        self.tokens: dict = {}  # (context, batch, method) -> new tokens (CPU)

    def _warm_view(self):
        if self.view is None:
            self.view = shallow_model(self.model, 1)
        return self.view

    def prompt(self, context: int, batch: int):
        from directkv_cute.generate import random_prompt

        ids = random_prompt(batch, context, self.model.config.vocab_size, self.opts.seed).to(self.opts.device)
        return ids, torch.ones_like(ids)

    def _generate(self, model, method: Method, ids, mask, n_new: int, budget: int | None, progress: bool):
        """One timed generate; returns (GenerateResult, host KV bytes, HBM KV bytes, setup s)."""
        import directkv_cute.hf as dkhf
        from directkv_cute.generate import timed_generate
        from directkv_cute.sparse_budget import parse_budget

        o = self.opts
        batch, ctx = ids.shape
        # a one-layer view shares the model's layer modules, whose attention reads the model's config
        models = [self.model] if model is self.model else [self.model, model]
        t0 = time.perf_counter()
        if method.base == "ours":
            _set_attn(models, dkhf.ATTN_IMPLEMENTATION)
            cache = dkhf.DirectKVCache(model, max_tokens=batch * (ctx + n_new), max_batch_size=batch,
                                       page_size=o.page_size, hbm_budget=int(budget or 0), dtype=o.dtype,
                                       device=o.device, kv_dtype=method.kv_dtype,
                                       sparse=parse_budget(method.sparse) if method.sparse else None,
                                       **({} if method.window else {"window_tokens": 0}))
            try:
                cache.check_request([ctx] * batch, n_new)
                if method.fused:
                    dkhf.fuse_kv_projection(model)
                setup = time.perf_counter() - t0
                res = timed_generate(model, ids, mask, max_new_tokens=n_new, cache=cache, prefill_chunk=o.prefill_chunk,
                                     progress=progress)
                return res, cache.host_bytes(), cache.hbm_bytes(), setup
            finally:
                if method.fused:
                    dkhf.unfuse_kv_projection(model)
                cache.close()
        _set_attn(models, _attn_implementation(method))
        impl = "offloaded" if method.base == "hf-offloaded" else None
        res = timed_generate(model, ids, mask, max_new_tokens=n_new, cache_implementation=impl,
                             prefill_chunk=o.prefill_chunk, progress=progress, return_cache=True)
        host, dev = _cache_kv_bytes(res.cache, o.device)
        res.cache = None
        return res, host, dev, time.perf_counter() - t0 - res.total_s

    def run_row(self, method: Method, context: int, batch: int, *, role: str = "measured",
                budget: int | None = None) -> dict:
        from directkv_cute.generate import kernels_compiled

        o = self.opts
        offl = method.base == "hf-offloaded"
        warm = 1 if offl else o.warmup_tokens
        timed = o.offloaded_tokens if offl else o.new_tokens
        n_new = 1 + warm + timed
        base = dict(preset=o.preset, method=method.name, label=method.label(budget), role=role, context=context,
                    batch=batch, dtype=str(o.dtype).removeprefix("torch."), warmup_tokens=warm, timed_tokens=timed,
                    hbm_budget=budget if method.tier == "hbm" else None)
        kv = batch * (context + n_new) * self.token_bytes
        why = fa4_unavailable(method, o.device)
        if why:
            return new_row(**base, status="skipped", error=f"FA4 unavailable: {why}")
        if offl and not self.cuda:
            return new_row(**base, status="skipped", error="transformers' offloaded cache needs CUDA (its copy stream)")
        if o.skip:
            why = predict_skip(method, batch=batch, kv_bytes=kv, weights=self.weights, gpu_total=self.gpu_total,
                               host_avail=available_host_bytes(), budget=budget)
            if why:
                return new_row(**base, status="skipped", error=why)
        t_row = time.perf_counter()
        ids, mask = self.prompt(context, batch)
        status, error, res = "ok", None, None
        host = hbm = None
        setup = None
        compiled = None
        try:
            if method.base == "ours" or method.attn == "fa4":  # compile / load every kernel the row needs,
                # on a one-layer view (ours' kernels; FA4 compiles its CuTe kernels on first use)
                view = self._warm_view()
                vb = None if budget is None else budget // self.model.config.num_hidden_layers
                self._generate(view, method, ids, mask, 3, vb, False)
                _free(o.device)
            if self.cuda:
                torch.cuda.reset_peak_memory_stats()
            base_bytes = torch.cuda.memory_allocated() if self.cuda else None
            before = kernels_compiled()
            res, host, hbm, setup = self._generate(self.model, method, ids, mask, n_new, budget, o.progress)
            after = kernels_compiled()
            compiled = None if before is None or after is None else after - before
            peak = torch.cuda.max_memory_allocated() if self.cuda else None
        except Exception as e:  # noqa: BLE001 - a failing method is a result; the run goes on
            status = "OOM" if _is_oom(e) else "error"
            error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:400]
            if status == "error":
                traceback.print_exc()
            peak = torch.cuda.max_memory_allocated() if self.cuda else None
            base_bytes = None
            res = None
        finally:
            ids = mask = None
            _free(o.device)
        wall = time.perf_counter() - t_row
        if res is None:
            return new_row(**base, status=status, error=error, peak_gpu_bytes=peak, wall_s=wall)
        steps = res.step_ms[warm:warm + timed]
        if not steps:
            return new_row(**base, status="error", error=f"only {len(res.step_ms)} decode steps measured",
                           prefill_s=res.prefill_s, wall_s=wall)
        self.tokens[(context, batch, method.name, role)] = res.new_tokens.cpu()
        agree = None
        ref = self.tokens.get((context, batch, "dynamic", role))
        if ref is not None and method.name != "dynamic":
            agree = agree_tokens(ref, res.new_tokens)
        kv_step = int(batch * mean_attended(context, warm, timed) * self.token_bytes)
        if method.sparse:  # the pages the budget reads of the mean attended length
            kv_step = int(batch * sparse_tokens(method.sparse, mean_attended(context, warm, timed), o.page_size)
                          * self.token_bytes)
        return new_row(**base, status=status, prefill_s=res.prefill_s, decode_ms=statistics.median(steps),
                       decode_ms_mean=statistics.fmean(steps), step_ms=[round(s, 4) for s in steps],
                       peak_gpu_bytes=peak, base_gpu_bytes=base_bytes, host_kv_bytes=host, hbm_kv_bytes=hbm,
                       kv_bytes_per_step=kv_step, setup_s=setup, wall_s=wall, agree_tokens=agree, compiled=compiled)


def estimate_row_s(rows: list[dict], method: str, context: int, batch: int) -> float | None:
    """A rough wall-time estimate of a row from the same method's measured rows: the same context
    at batch 1 times the batch, else a smaller context at the same batch scaled by
    (context ratio)^1.5 (prefill attention grows with its square, the rest linearly)."""
    same = [r for r in rows if r["method"] == method and r["role"] == "measured" and r["wall_s"]]
    b1 = [r for r in same if r["context"] == context and r["batch"] == 1]
    if b1 and batch > 1:
        return b1[0]["wall_s"] * batch
    smaller = sorted((r for r in same if r["batch"] == batch and r["context"] < context), key=lambda r: r["context"])
    if smaller:
        r = smaller[-1]
        return r["wall_s"] * (context / r["context"]) ** 1.5
    return None


def _offloaded_budget(rows: list[dict], context: int, batch: int) -> int | None:
    """What hf-offloaded used beyond the memory allocated before it (the weights), measured."""
    off = _one(rows, method="hf-offloaded", role="measured", context=context, batch=batch)
    if off is None or off["peak_gpu_bytes"] is None or off["base_gpu_bytes"] is None:
        return None
    return max(0, int(off["peak_gpu_bytes"] - off["base_gpu_bytes"]))


def run_rows(runner: Runner, doc: dict, write) -> None:
    """Every row of the bench into ``doc['rows']`` (``write()`` after each): the non-attention
    rows first, then per batch and context the methods in order."""
    o = runner.opts
    start = time.monotonic()

    def over_budget() -> bool:
        return o.time_budget_s is not None and time.monotonic() - start > o.time_budget_s

    def emit(row: dict) -> None:
        doc["rows"].append(row)
        r = row
        print(f"  {r['label']:<22} B{r['batch']} ctx {_kilo(r['context']):>5}: {r['status']:<7} "
              f"prefill {_f(r['prefill_s'], '.2f')} s, {_f(r['decode_ms'], '.1f')} ms/token"
              + (f", peak {r['peak_gpu_bytes'] / GiB:.2f} GiB" if r["peak_gpu_bytes"] else "")
              + (f"  [{r['error']}]" if r["error"] else "") + f"  ({_f(r['wall_s'], '.0f')} s)", flush=True)
        write()

    if o.physics_context:
        for batch in o.batches:
            if over_budget():
                break
            emit(runner.run_row(Method("dynamic"), o.physics_context, batch, role="non-attention"))
    for batch in o.batches:
        for ctx in o.contexts:
            for m in o.methods:
                budget = None
                if m.tier == "hbm":
                    budget = m.budget if m.budget is not None else o.hbm_budget
                    if budget is None:
                        budget = _offloaded_budget(doc["rows"], ctx, batch)
                base = dict(preset=o.preset, method=m.name, label=m.label(budget), context=ctx, batch=batch,
                            dtype=str(o.dtype).removeprefix("torch."))
                if over_budget():
                    emit(new_row(**base, status="skipped", error=f"time budget of {o.time_budget_s:.0f} s used up"))
                    continue
                est = estimate_row_s(doc["rows"], m.name, ctx, batch)
                left = None if o.time_budget_s is None else o.time_budget_s - (time.monotonic() - start)
                if est is not None and left is not None and est > left:
                    emit(new_row(**base, status="skipped", error=f"time budget: about {est:.0f} s estimated, "
                                 f"{left:.0f} s of {o.time_budget_s:.0f} s left"))
                    continue
                if m.tier == "hbm" and budget is None:
                    emit(new_row(**base, status="skipped", error="no HBM budget: hf-offloaded was not measured "
                                 "at this context and batch (pass --hbm-budget)"))
                    continue
                emit(runner.run_row(m, ctx, batch, budget=budget))


def _resolve(ns: argparse.Namespace) -> Options:
    from directkv_cute.generate import DTYPES, parse_size

    device = require_gpu(ns.device, command="bench e2e")
    defaults = dict(CPU_DEFAULTS if device == "cpu" else GPU_DEFAULTS)
    if ns.quick and device == "cuda":
        defaults.update(QUICK_GPU)
    val = {k: (getattr(ns, k) if getattr(ns, k) is not None else d) for k, d in defaults.items()}
    dtype = DTYPES[val["dtype"]]
    if dtype == torch.float32 and device == "cuda":
        raise UsageError("bench e2e: --dtype fp32 runs only on the CPU (the GPU kernels take bf16 / fp16)")
    budget = parse_size(ns.hbm_budget) if ns.hbm_budget is not None else None
    for name in ("new_tokens", "offloaded_tokens"):
        if val[name] < 1:
            raise UsageError(f"bench e2e: --{name.replace('_', '-')} must be >= 1")
    return Options(preset=val["preset"], device=device, dtype=dtype, contexts=list(val["contexts"]),
                   batches=list(val["batches"]), methods=parse_methods(val["methods"]), new_tokens=val["new_tokens"],
                   warmup_tokens=val["warmup_tokens"], offloaded_tokens=val["offloaded_tokens"],
                   prefill_chunk=val["prefill_chunk"], page_size=ns.page_size, physics_context=val["physics_context"],
                   hbm_budget=budget, time_budget_s=ns.time_budget_s, skip=not ns.no_skip, seed=ns.seed,
                   progress=not ns.no_progress)


def finish_doc(doc: dict, opts: Options, token_bytes: int) -> dict:
    """Physics rows and targets from the measured rows (idempotent); none on a CPU smoke run."""
    doc["rows"] = [r for r in doc["rows"] if r["method"] != "physics"]
    doc["passed"] = not any(r["status"] == "error" for r in doc["rows"])
    if opts.device != "cuda":
        doc["targets"] = []
        return doc
    doc["rows"] += physics_rows(doc["rows"], doc["ceilings"], preset=opts.preset,
                                dtype=str(opts.dtype).removeprefix("torch."), token_bytes=token_bytes,
                                warmup=opts.warmup_tokens, timed=opts.new_tokens, physics_context=opts.physics_context)
    doc["targets"] = evaluate_targets(doc["rows"], preset=opts.preset)
    return doc


def run_e2e(ns: argparse.Namespace) -> int:
    import transformers

    from bench.ceilings import measure_ceilings
    from bench.common import MiB, env_info, results_path, write_json
    from directkv_cute.presets import build_random_model, preset_config, weight_bytes

    opts = _resolve(ns)
    out_dir = checked_out_dir(ns.out_dir)
    try:
        preset_config(opts.preset)
    except ValueError as e:
        print(f"bench e2e: {e}", file=sys.stderr)
        return 2
    header = env_info(opts.device)
    header["versions"]["transformers"] = transformers.__version__
    header["dtype"] = str(opts.dtype).removeprefix("torch.")
    path = results_path(out_dir, header, f"e2e-{opts.preset}")
    print(f"directkv bench e2e ({opts.preset}, {header['dtype']}) on {header['gpu']} -> {path}", flush=True)
    small = opts.device != "cuda"
    ceilings, details = measure_ceilings(opts.device, host_bytes=64 * MiB if small else int(ns.ceiling_gb * GiB),
                                         hbm_bytes=64 * MiB if small else int(2 * ns.ceiling_gb * GiB))
    _free(opts.device)
    if not small:
        print(f"ceilings: host read {ceilings.host_read_gbps:.2f} GB/s, HBM read {ceilings.hbm_read_gbps:.1f} GB/s, "
              f"memcpy H2D {ceilings.memcpy_h2d_gbps:.2f} GB/s", flush=True)
    t0 = time.perf_counter()
    model = build_random_model(opts.preset, opts.dtype, opts.device, seed=opts.seed, attn_implementation="sdpa")
    print(f"model: {opts.preset}, {weight_bytes(model) / GiB:.2f} GiB of weights, built in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    args = {k: v for k, v in vars(ns).items() if isinstance(v, (str, int, float, bool, list, type(None)))}
    args.update(preset=opts.preset, contexts=opts.contexts, batches=opts.batches,
                methods=[m.label() for m in opts.methods], new_tokens=opts.new_tokens,
                warmup_tokens=opts.warmup_tokens, offloaded_tokens=opts.offloaded_tokens,
                prefill_chunk=opts.prefill_chunk, physics_context=opts.physics_context, device=opts.device)
    doc = {"schema": E2E_SCHEMA, "bench": "e2e", "header": header, "ceilings": ceilings.to_dict(),
           "ceiling_details": details, "args": args, "weights_bytes": weight_bytes(model),
           "kv_token_bytes": kv_token_bytes(model.config, opts.dtype), "passed": True, "rows": [], "targets": []}
    runner = Runner(model, opts)

    def write():
        write_json(path, doc)

    write()
    run_rows(runner, doc, write)
    finish_doc(doc, opts, runner.token_bytes)
    write()
    write_run_files(path, doc, format_table(doc), out_dir, header, f"e2e-{opts.preset}",
                    None if ns.no_plot or small else plot_e2e)
    return 0 if doc["passed"] else 1


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``e2e`` subcommand's options (defaults in brackets are the GPU ones; ``--device cpu``
    defaults to the tiny smoke run)."""
    p.add_argument("--preset", default=None, help="model preset [llama3-8b] (cpu: tiny)")
    p.add_argument("--contexts", type=_ints, default=None, help="prompt tokens [32768,131072]")
    p.add_argument("--batches", type=_ints, default=None, help="[1,8]")
    p.add_argument("--methods", default=None, help=f"[{DEFAULT_METHODS}]; ours[hbm=8GiB] fixes the budget; also "
                   "fa4, hf-offloaded+fa4 (FlashAttention-4 peers), ours[readback], ours[fused], ours[fp8], "
                   "ours[sparse=1/8], ours[fp8,sparse=1/8] (decode reads each row's best pages; 1/8, 0.125, 256p) and "
                   "ours[hbm,sparse=1/8] (with the --hbm-budget tier as their recall cache)")
    p.add_argument("--new-tokens", type=int, default=None, help="timed decode tokens per method [16]")
    p.add_argument("--warmup-tokens", type=int, default=None, help="decode tokens before the timed ones [2]")
    p.add_argument("--offloaded-tokens", type=int, default=None,
                   help="timed tokens of hf-offloaded [4] (after 1 warm-up)")
    p.add_argument("--prefill-chunk", type=int, default=None, help="prompt tokens per prefill forward [4096]")
    p.add_argument("--physics-context", type=int, default=None,
                   help="context of the dynamic run giving the non-attention time [4096]; 0 skips it")
    p.add_argument("--hbm-budget", default=None, help="ours[hbm]'s budget, e.g. 16GiB (default: hf-offloaded's "
                   "peak minus the weights, measured in the same run)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None, help="[bf16] (cpu: fp32)")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="32k, batch 1, 8 timed tokens (about a minute and a half)")
    add_device_argument(p, "the tiny preset at 128 tokens, ours[host] and dynamic")
    add_out_dir_argument(p)
    p.add_argument("--time-budget-s", type=_budget_s, default=None, metavar="S",
                   help="start no new row after S seconds, and skip a row estimated to overrun them; the rest "
                        "are listed as skipped (default: no budget, every row runs)")
    p.add_argument("--no-skip", action="store_true", help="attempt batch > 1 rows that clearly cannot fit")
    p.add_argument("--ceiling-gb", type=float, default=2.0, help="host buffer for the ceilings (HBM: twice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-progress", action="store_true")


def _budget_s(text: str) -> float:
    """--time-budget-s: a finite number of seconds > 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}")
    return v


def cmd_e2e(ns: argparse.Namespace) -> int:
    try:
        return run_e2e(ns)
    except ValueError as e:
        print(f"bench e2e: {e}", file=sys.stderr)
        return 2


__all__ = ["E2E_SCHEMA", "FA4_METHODS", "Method", "ROW_FIELDS", "add_arguments", "agree_tokens", "cmd_e2e",
           "evaluate_targets", "fa4_unavailable", "format_table", "kv_token_bytes", "new_row", "parse_methods",
           "physics_rows", "plot_e2e", "predict_skip", "run_e2e", "shallow_model", "validate_doc", "validate_row"]
