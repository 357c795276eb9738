"""vLLM's own serving benchmark against ``vllm serve``: ``python -m bench serve`` -- one engine
configuration at a time, each a real OpenAI-compatible server driven by ``vllm bench serve``
(vLLM 0.26), TTFT / TPOT / ITL / end-to-end latency, throughput and goodput per point of a
concurrency (or request-rate) sweep, next to vLLM's all-HBM engine and the host link's floor.

    python -m bench serve                       # llama3-8b shape, 32k, engines hbm,offload,directkv, C 1,2,4
    python -m bench serve --engines hbm,directkv-hbm=all,directkv --concurrency 1,4 --num-prompts 1x
    python -m bench serve --model /path/to/hf-folder --input-lens 8192,32768 --engines hbm,directkv
    python -m bench serve --request-rates 0.05,0.1 --num-prompts 16 --engines hbm,directkv

**Engines** (``--engines``, a comma list, run in the order given; each one ``vllm serve`` with
the same ``--gpu-memory-utilization``, ``--max-model-len``, ``--dtype bfloat16``, ``--seed``,
``--generation-config vllm`` and vLLM's defaults for the rest, prefix caching included):

* ``hbm``: nothing more: every KV block in HBM, as many as ``--gpu-memory-utilization`` leaves;
* ``offload``: ``--kv-offloading-size G --kv-offloading-backend native`` (G: ``--offload-gib``):
  vLLM's native host offloading. vLLM still attends only to blocks in HBM; the host buffer holds
  blocks it can load back;
* ``directkv``: ``--attention-backend CUSTOM --kv-cache-memory-bytes B`` (B: ``--directkv-gib``
  GiB): the DirectKV plugin (``directkv_cute.vllm``), every KV block in pinned host memory read in
  place over the link, ``DIRECTKV_VLLM_HBM_GB=0`` in the server's environment;
* ``directkv-hbm=X``: the same with ``DIRECTKV_VLLM_HBM_GB=X`` (X GiB of HBM mirrors of blocks,
  docs/SERVING.md); ``directkv-hbm=all``: X is the KV of the sweep's largest point (its
  concurrency x whole 64-token blocks of ``input + output + 64`` tokens) rounded up to GiB, + 1;
* ``directkv-sparse=B``: ``directkv`` with ``DIRECTKV_VLLM_SPARSE_BUDGET=B`` (a page budget: ``1/8``,
  ``0.125`` or ``256p``): decode rows read only their best pages.

The default host sizes (``--directkv-gib``, ``--offload-gib``) hold the KV of the sweep's largest
point (its in-flight requests x ``max_model_len`` tokens; a rate sweep counts every prompt of a
point as in flight), at most half the host memory available; a size beyond the available host
memory is refused (exit 2). A model is either ``--preset NAME`` (``directkv_cute.presets``,
default ``llama3-8b``: a ``config.json`` of that shape in a temporary folder, ``--load-format
dummy``, random bf16 weights, and a generated word-level tokenizer of the model's vocabulary in
the same folder -- token ``i`` is the word ``t<i>``, so every prompt length is exact and every
generated id decodes) or ``--model PATH`` (a local Hugging Face folder with its weights and
tokenizer; ``--tokenizer PATH`` overrides either). A ``max_model_len`` beyond a model's
``max_position_embeddings`` sets ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1`` (the table's header says
so: timing only). ``max_model_len`` = the longest ``--input-lens`` + ``--output-len`` + 1024 (``MODEL_LEN_SLACK``).

**Per engine.** The server (``python -m vllm.entrypoints.cli.main serve ...``, the ``vllm``
script's own entry point under this interpreter) starts on 127.0.0.1 at a free port in its own
process group, its output in ``<stem>-raw/<engine>.server.log``. The bench polls ``/health``
(``--startup-timeout-s``); a server that exits first, or never answers, is an error entry with
the tail of its log, and the run goes on with the next engine. Then GPU memory in use is read
(``gpu_bytes_after_start``: in use now minus before the server started, NVML, else
``torch.cuda.mem_get_info`` from this process), as are vLLM's log lines with its KV capacity
(``GPU KV cache size: N tokens``, ``Maximum concurrency for L tokens per request``, ``Available KV
cache memory``; for directkv the "GPU" blocks are host pages). Two warm-up requests of 1024
random token ids and 16 tokens each, sent together (``--no-warmup`` skips them), are not
recorded. Then every point of the sweep, each by one client process::

    python -m vllm.entrypoints.cli.main bench serve --backend vllm --base-url http://127.0.0.1:PORT
        --endpoint /v1/completions --model MODEL --tokenizer TOKENIZER --dataset-name random
        --random-input-len I --random-output-len O --random-range-ratio 0.0 --ignore-eos
        --num-prompts N --max-concurrency C (or --request-rate R) --temperature 0 --seed S
        --goodput ttft:MS tpot:MS --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99
        --save-result --save-detailed --result-dir DIR --result-filename FILE --disable-tqdm --label ENGINE

(every flag as defined in vLLM 0.26's ``vllm/benchmarks/serve.py`` and
``vllm/benchmarks/datasets/datasets.py``; ``client_command`` builds it; the random dataset's
prompts are runs of consecutive token ids from a random offset per request). Point k of the sweep
uses seed ``--seed + k`` on every engine: the engines get the same prompts, and no point's
prompts are in the prefix cache from an earlier point. Before and after each point the bench
reads ``/metrics`` (Prometheus text): ``preemptions`` is the rise of ``vllm:num_preemptions``
(requests the scheduler preempted for want of KV blocks), ``prefix_cache_hits`` /
``prefix_cache_queries`` the rise of vLLM's prefix-cache counters (tokens). A point is bounded by
``--point-timeout-s``, and with ``--time-budget-s`` an engine's points after its health check (the
warm-up included) end when the budget is spent: the point under way is stopped (``timeout``),
the rest are ``skipped``. Finally the server's group gets SIGTERM, then SIGKILL after
``--stop-timeout-s``, until no process of the group is left, and the bench waits
(``--release-timeout-s``) until the GPU memory in use is back within 1 GiB of what it was before
the server started (``gpu_release`` in the engine entry), so that the next engine finds its HBM
and pinned host memory free.

**Row fields** (all from the client's JSON, ``parse_client_result``): ``ttft_*`` (time to first
token: request sent -> first streamed chunk), ``tpot_*`` (per request: (latency - TTFT) / (output
tokens - 1), then the median / p99 / mean over requests), ``itl_*`` (every gap between streamed
chunks of every request), ``e2el_*`` (request latency), each ``_p50_ms``, ``_p99_ms``,
``_mean_ms``; ``output_throughput`` (output tokens / the point's duration, tok/s),
``request_throughput`` (completed requests / s), ``request_goodput`` (requests / s that met every
SLO: ``--slo-ttft-ms``, ``--slo-tpot-ms``; 0 drops one), ``completed`` / ``failed``,
``max_concurrent_requests`` (the client's count, per second). Computed here:
``tpot_p50_vs_hbm`` / ``ttft_p50_vs_hbm`` (the row's p50 over the ``hbm`` engine's at the same
input length, output length and concurrency or rate; needs ``hbm`` in the run) and, for
``directkv`` rows (host only) of a concurrency sweep, ``floor_tpot_ms``: the KV one decode step
of C requests reads over the link, C x (I + O / 2) tokens (the mean context while decoding) x
the KV bytes per token, over the memcpy H2D ceiling measured before the first engine starts
(``bench.ceilings``; ``--no-ceilings`` skips it and the floor), and ``pct_floor`` = 100 x floor /
TPOT p50. The floor leaves out the model's non-attention time and other requests' prefill
chunks between decode steps, both part of TPOT: it is a lower bound, not a target.

Files under ``--out-dir`` (default ./bench-results): ``<gpu>-<date>-serve-<workload>.json``
(schema ``directkv-bench-serve/1``: header with vLLM's version, GPU, ceilings, args, the model,
every engine's command-line flags, environment, GPU memory, KV log lines, stop and release, and
rows), the table as ``.txt``, a ``.png`` (TPOT p50 and output tokens/s against concurrency or
rate per engine, one column of panels per input length) and ``<stem>-raw/`` (each server's log,
each point's client JSON and log). The JSON and the table are rewritten after every point, so a
run cut short keeps what it measured. Without a CUDA GPU the bench refuses (exit status 2), as it
does without vLLM or, for a directkv engine, without the plugin's entry point; bad options are one
line and exit status 2, before anything starts. Exit status 1 when an engine or a point failed.

**Time.** Each engine's startup (weights, torch.compile, CUDA graphs, for directkv the plugin's
kernel warm-up; ``startup_s``) takes about 100 s for the 8B shape on one H100/H200 (less with
``--max-num-seqs 8``, which shrinks the graphs captured and the directkv warm-up, or
``--enforce-eager``, which changes what is measured), each client about 10-15 s before its first
request (it imports vLLM and builds its prompts), each point its prompts' prefill and decode. To
reproduce a run, its JSON's ``args`` hold every option and each engine's ``command`` and ``env``.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from bench.common import GB, GiB, UsageError, add_out_dir_argument, available_host_bytes, checked_out_dir, fmt_opt, kilo

SERVE_SCHEMA = "directkv-bench-serve/1"
ENGINE_KINDS = ("hbm", "offload", "directkv", "directkv-hbm", "directkv-sparse")
DIRECTKV_KINDS = ("directkv", "directkv-hbm", "directkv-sparse")  # the plugin's engines
DIRECTKV_BACKEND = "CUSTOM"
DIRECTKV_BLOCK = 64  # the page size the plugin asks vLLM for (docs/SERVING.md)
# tokens beyond input + output: the server re-tokenizes each prompt's text, which may come out
# longer than the client's count (with 64 tokens of slack, 3 of 9 prompts of 32768 tokens were
# refused with 400 Bad Request; none with more)
MODEL_LEN_SLACK = 1024
MIN_OUTPUT_LEN = 128
DEFAULTS = dict(preset="llama3-8b", input_lens=[32768], output_len=256, concurrency=[1, 2, 4],
                engines="hbm,offload,directkv", slo_ttft_ms=30000.0, slo_tpot_ms=100.0)
RATE_NUM_PROMPTS = 16  # a rate point's default number of prompts
HOST_FRACTION = 0.5
ELEM_BYTES = 2  # bf16 K/V (the servers run --dtype bfloat16)
PERCENTILES = (50, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")
WARMUP_PROMPT_TOKENS, WARMUP_OUTPUT_TOKENS, WARMUP_REQUESTS = 1024, 16, 2
RELEASE_SLACK_BYTES = GiB  # the GPU counts as released within this much of its use before the server
PREEMPTIONS = "vllm:num_preemptions"
PREFIX_HITS, PREFIX_QUERIES = "vllm:prefix_cache_hits", "vllm:prefix_cache_queries"
VLLM_MISSING = ("bench serve: vLLM is not importable: `pip install -e .[vllm]` (vllm==0.26.0); the servers and the "
                f"client run as `{sys.executable} -m vllm.entrypoints.cli.main`")
PLUGIN_MISSING = ("bench serve: the directkv plugin is not installed where vLLM runs (no `vllm.general_plugins` "
                  f"entry point `directkv` for {sys.executable}): `{sys.executable} -m pip install -e .` there, "
                  "not only this tree on PYTHONPATH")

ROW_FIELDS = ("bench", "engine", "status", "error", "note", "input_len", "output_len", "concurrency", "request_rate",
              "num_prompts", "seed", "completed", "failed", "duration_s",
              "ttft_p50_ms", "ttft_p99_ms", "ttft_mean_ms", "tpot_p50_ms", "tpot_p99_ms", "tpot_mean_ms",
              "itl_p50_ms", "itl_p99_ms", "itl_mean_ms", "e2el_p50_ms", "e2el_p99_ms", "e2el_mean_ms",
              "output_throughput", "request_throughput", "request_goodput", "total_token_throughput",
              "max_output_tokens_per_s", "max_concurrent_requests", "total_input_tokens", "total_output_tokens",
              "preemptions", "prefix_cache_hits", "prefix_cache_queries", "gpu_peak_bytes",
              "tpot_p50_vs_hbm", "ttft_p50_vs_hbm", "kv_bytes_per_step", "floor_tpot_ms", "pct_floor",
              "wall_s", "client_file")
STATUSES = ("ok", "partial", "error", "timeout", "skipped")


def new_row(**fields) -> dict:
    """A row with every field of ROW_FIELDS (missing ones None)."""
    unknown = set(fields) - set(ROW_FIELDS)
    if unknown:
        raise KeyError(f"unknown row fields {sorted(unknown)}")
    return {f: None for f in ROW_FIELDS} | {"bench": "serve"} | fields


# ---- options ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Engine:
    """One engine configuration: ``kind`` in ENGINE_KINDS; ``hbm_gib`` the directkv HBM tier
    (``directkv-hbm=X``; ``"all"`` until resolved); ``sparse`` the page budget of
    ``directkv-sparse=B`` (``DIRECTKV_VLLM_SPARSE_BUDGET``); ``name`` as given on the command line."""

    name: str
    kind: str
    hbm_gib: float | str | None = None
    sparse: str | None = None


def _usage(msg: str) -> UsageError:
    return UsageError(f"bench serve: {msg}")


def parse_engines(text: str) -> list[Engine]:
    """``hbm,directkv-hbm=20,directkv,directkv-sparse=1/8`` -> Engines in the order given; unknown
    names, bad tiers or budgets and repeats are one line (exit 2)."""
    out: list[Engine] = []
    for item in (s.strip() for s in str(text).split(",")):
        if not item:
            continue
        kind, _, value = item.partition("=")
        kind = kind.strip().lower()
        if kind not in ENGINE_KINDS or (kind in ("directkv-hbm", "directkv-sparse")) != bool(_):
            raise _usage(f"unknown engine {item!r}; use hbm, offload, directkv, directkv-hbm=GIB (or =all) or "
                         "directkv-sparse=BUDGET (1/8, 0.125 or 256p)")
        hbm = sparse = None
        if kind == "directkv-sparse":
            from directkv_cute.sparse_budget import parse_budget

            value = value.strip()
            try:
                parse_budget(value)
            except ValueError as e:
                raise _usage(f"{item!r}: {e}") from None
            sparse = value
        elif kind == "directkv-hbm":
            value = value.strip().lower()
            if value == "all":
                hbm = "all"
            else:
                try:
                    hbm = float(value)
                except ValueError:
                    hbm = math.nan
                if not math.isfinite(hbm) or hbm < 0:
                    raise _usage(f"directkv-hbm= takes GiB (a finite number >= 0) or all, got {item!r}")
        name = kind if not _ else f"{kind}={value}"
        if any(e.name == name for e in out):
            raise _usage(f"--engines names {name} twice")
        out.append(Engine(name, kind, hbm, sparse))
    if not out:
        raise _usage("--engines is empty")
    return out


def parse_tokens(text: str, option: str) -> list[int]:
    """``32768,64k`` -> [32768, 65536] (k = 1024), each >= 1, in the order given, no repeats."""
    out = []
    for item in (s.strip().lower() for s in str(text).split(",")):
        if not item:
            continue
        mult = 1024 if item.endswith("k") else 1
        try:
            n = int(item[:-1] if mult > 1 else item) * mult
        except ValueError:
            raise _usage(f"{option} takes token counts (integers, k = 1024), got {item!r}") from None
        if n < 1:
            raise _usage(f"{option} must be >= 1 token, got {item!r}")
        if n not in out:
            out.append(n)
    if not out:
        raise _usage(f"{option} is empty")
    return out


def parse_concurrency(text: str) -> list[int]:
    out = []
    for item in (s.strip() for s in str(text).split(",")):
        if not item:
            continue
        if not (item.isdigit() and int(item) >= 1):
            raise _usage(f"--concurrency takes positive integers, got {item!r}")
        if int(item) not in out:
            out.append(int(item))
    if not out:
        raise _usage("--concurrency is empty")
    return sorted(out)


def parse_rates(text: str) -> list[float]:
    out = []
    for item in (s.strip() for s in str(text).split(",")):
        if not item:
            continue
        try:
            r = float(item)
        except ValueError:
            r = math.nan
        if not math.isfinite(r) or r <= 0:
            raise _usage(f"--request-rates takes positive finite requests per second, got {item!r}")
        if r not in out:
            out.append(r)
    if not out:
        raise _usage("--request-rates is empty")
    return sorted(out)


def parse_num_prompts(text: str | None, *, rates: bool) -> Callable[[int | None], int]:
    """``--num-prompts``: ``N`` (every point), ``Kx`` (K x the point's concurrency, at least 1) or
    None: max(4 x concurrency, 8), and ``RATE_NUM_PROMPTS`` for a rate point. Returns the
    function from a point's concurrency (None for a rate) to its number of prompts."""
    if text is None:
        return lambda c: RATE_NUM_PROMPTS if c is None else max(4 * c, 8)
    item = str(text).strip().lower()
    if item.endswith("x"):
        if rates:
            raise _usage("--num-prompts Kx multiplies a concurrency: give a number of prompts for --request-rates")
        try:
            k = float(item[:-1])
        except ValueError:
            k = math.nan
        if not math.isfinite(k) or k <= 0:
            raise _usage(f"--num-prompts takes N or Kx (K > 0), got {text!r}")
        return lambda c: max(1, math.ceil(k * c))
    if not (item.isdigit() and int(item) >= 1):
        raise _usage(f"--num-prompts takes N or Kx (K > 0), got {text!r}")
    return lambda c, n=int(item): n


def _positive(value, option: str, *, zero: bool = False) -> float:
    ok = isinstance(value, (int, float)) and math.isfinite(value) and (value >= 0 if zero else value > 0)
    if not ok:
        raise _usage(f"{option} must be {'>=' if zero else '>'} 0, got {value}")
    return float(value)


def plan_points(opts: dict) -> list[dict]:
    """The sweep: every input length x every concurrency (or rate), in that order; point k gets
    seed ``opts['seed'] + k`` (the same on every engine)."""
    points = []
    loads = [(c, None) for c in opts["concurrency"]] if opts["concurrency"] else [(None, r) for r in opts["rates"]]
    for input_len in opts["input_lens"]:
        for c, rate in loads:
            points.append({"input_len": input_len, "output_len": opts["output_len"], "concurrency": c,
                           "request_rate": rate, "num_prompts": opts["num_prompts"](c),
                           "seed": opts["seed"] + len(points)})
    return points


def in_flight(points: list[dict]) -> int:
    """The most requests one point can have in flight: its concurrency, or for a rate its prompts."""
    return max(min(p["num_prompts"], p["concurrency"] or p["num_prompts"]) for p in points)


# ---- the model -------------------------------------------------------------------------------
def model_info(config: dict) -> dict:
    """What the bench needs of a Hugging Face ``config.json`` (``text_config`` for a multimodal
    one): layers, KV heads, head dim, KV bytes per token (bf16), vocabulary, trained length."""
    cfg = config.get("text_config") or config
    try:
        layers, heads = int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError) as e:
        raise _usage(f"the model's config.json lacks {e} (a decoder's layers, heads and hidden size)") from None
    return {"num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "head_dim": head_dim, "vocab_size": cfg.get("vocab_size"),
            "max_position_embeddings": cfg.get("max_position_embeddings"),
            "kv_token_bytes": layers * 2 * kv_heads * head_dim * ELEM_BYTES}


def write_word_tokenizer(folder: str | Path, vocab_size: int) -> Path:
    """A word-level fast tokenizer of ``vocab_size`` words ``t0`` .. ``t<V-1>`` (token ``i`` is the
    word ``t<i>``, whitespace between words, no special tokens) as ``tokenizer.json`` and
    ``tokenizer_config.json`` in ``folder``: vLLM's random dataset gets exact prompt lengths from it
    and every id the model can generate decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(int(vocab_size))}, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # words joined by one space
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 30, "clean_up_tokenization_spaces":
         False}, indent=1) + "\n")
    return folder


# ---- sizes -----------------------------------------------------------------------------------
def default_host_gib(token_bytes: int, max_model_len: int, requests: int, host_avail: int | None) -> tuple[float, str]:
    """Host KV (GiB, whole) for ``requests`` sequences of ``max_model_len`` tokens, at least 1,
    at most HOST_FRACTION of the available host memory; and why."""
    gib = max(1, math.ceil(requests * max_model_len * token_bytes / GiB))
    why = f"{requests} x {max_model_len} tokens"
    if host_avail is not None and gib * GiB > HOST_FRACTION * host_avail:
        gib = max(1, math.floor(HOST_FRACTION * host_avail / GiB))
        why += f"; capped at {HOST_FRACTION:.0%} of {host_avail / GiB:.0f} GiB of host memory available"
    return float(gib), why


def all_kv_hbm_gib(token_bytes: int, points: list[dict]) -> float:
    """``directkv-hbm=all``: the largest point's KV in whole blocks of DIRECTKV_BLOCK tokens
    (in-flight requests x blocks of input + output + slack), in GiB rounded up, + 1."""
    need = max(min(p["num_prompts"], p["concurrency"] or p["num_prompts"])
               * math.ceil((p["input_len"] + p["output_len"] + MODEL_LEN_SLACK) / DIRECTKV_BLOCK) for p in points)
    return float(math.ceil(need * DIRECTKV_BLOCK * token_bytes / GiB) + 1)


def check_host_gib(option: str, gib: float | None, *, host_avail: int | None, min_bytes: int) -> float | None:
    if gib is None:
        return None
    if not math.isfinite(gib) or gib <= 0:
        raise _usage(f"{option} must be > 0, got {gib}")
    if host_avail is not None and gib * GiB > host_avail:
        raise _usage(f"{option} {gib:g} is more than the host memory available ({host_avail / GiB:.1f} GiB)")
    if gib * GiB < min_bytes:
        raise _usage(f"{option} {gib:g} holds less than one sequence of max_model_len ({min_bytes / GiB:.2f} GiB); "
                     "vLLM refuses to start with that")
    return float(gib)


def resolve_options(ns: argparse.Namespace, host_avail: int | None) -> dict:
    """Every option checked and defaulted; a bad one is a UsageError (one line, exit 2) before
    anything starts. Reads the model's config.json (``--model``) but writes nothing."""
    if ns.model and ns.preset:
        raise _usage("give --model PATH or --preset NAME, not both")
    if ns.concurrency is not None and ns.request_rates is not None:
        raise _usage("give --concurrency or --request-rates, not both")
    opts = {"engines": parse_engines(ns.engines or DEFAULTS["engines"]),
            "input_lens": (parse_tokens(ns.input_lens, "--input-lens") if ns.input_lens
                           else list(DEFAULTS["input_lens"])),
            "output_len": DEFAULTS["output_len"] if ns.output_len is None else ns.output_len,
            "rates": parse_rates(ns.request_rates) if ns.request_rates is not None else None,
            "seed": ns.seed, "enforce_eager": bool(ns.enforce_eager), "prefix_caching": not ns.no_prefix_caching,
            "warmup": not ns.no_warmup, "ceilings": not ns.no_ceilings}
    opts["concurrency"] = None if opts["rates"] else (
        parse_concurrency(ns.concurrency) if ns.concurrency is not None else list(DEFAULTS["concurrency"]))
    opts["num_prompts"] = parse_num_prompts(ns.num_prompts, rates=bool(opts["rates"]))
    if opts["output_len"] < MIN_OUTPUT_LEN:
        raise _usage(f"--output-len must be >= {MIN_OUTPUT_LEN} (TPOT over fewer tokens is noise), "
                     f"got {opts['output_len']}")
    opts["gpu_memory_utilization"] = float(ns.gpu_memory_utilization)
    if not (math.isfinite(opts["gpu_memory_utilization"]) and 0 < opts["gpu_memory_utilization"] <= 1):
        raise _usage(f"--gpu-memory-utilization must be in (0, 1], got {ns.gpu_memory_utilization}")
    for key in ("slo_ttft_ms", "slo_tpot_ms"):
        value = DEFAULTS[key] if getattr(ns, key) is None else getattr(ns, key)
        opts[key] = _positive(value, "--" + key.replace("_", "-"), zero=True)
    for key in ("startup_timeout_s", "stop_timeout_s", "release_timeout_s", "point_timeout_s", "ceiling_gb"):
        opts[key] = _positive(getattr(ns, key), "--" + key.replace("_", "-"))
    opts["time_budget_s"] = None if ns.time_budget_s is None else _positive(ns.time_budget_s, "--time-budget-s")
    if ns.max_num_seqs is not None and ns.max_num_seqs < 1:
        raise _usage(f"--max-num-seqs must be >= 1, got {ns.max_num_seqs}")
    opts["max_num_seqs"] = ns.max_num_seqs
    try:
        opts["server_args"] = shlex.split(ns.server_args or "")
    except ValueError as e:
        raise _usage(f"--server-args: {e}") from None
    # the model
    if ns.model:
        folder = Path(ns.model).expanduser()
        if not (folder / "config.json").is_file():
            raise _usage(f"--model {ns.model}: no config.json there (a local Hugging Face folder)")
        try:
            config = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise _usage(f"--model {ns.model}: cannot read config.json: {e}") from None
        opts.update(model=str(folder.resolve()), preset=None,
                    workload=re.sub(r"[^A-Za-z0-9._-]+", "_", folder.resolve().name))
    else:
        from bench.vllm import config_json, model_shape

        preset = ns.preset or DEFAULTS["preset"]
        try:
            model_shape(preset)
        except UsageError as e:
            raise _usage(str(e).removeprefix("bench vllm: ")) from None
        config = config_json(preset, 1)
        opts.update(model=None, preset=preset, workload=preset)
    opts["model_info"] = model_info(config)
    if ns.tokenizer and not Path(ns.tokenizer).expanduser().exists():
        raise _usage(f"--tokenizer {ns.tokenizer} does not exist (a local tokenizer folder)")
    opts["tokenizer"] = str(Path(ns.tokenizer).expanduser().resolve()) if ns.tokenizer else None
    opts["max_model_len"] = max(opts["input_lens"]) + opts["output_len"] + MODEL_LEN_SLACK
    trained = opts["model_info"]["max_position_embeddings"]
    opts["long_model_len"] = bool(opts["model"] and trained and opts["max_model_len"] > int(trained))
    points = plan_points(opts)
    opts["points"] = points
    token_bytes = opts["model_info"]["kv_token_bytes"]
    seq_bytes = opts["max_model_len"] * token_bytes
    kinds = {e.kind for e in opts["engines"]}
    host_why = {}
    for key, kinds_of in (("directkv_gib", DIRECTKV_KINDS), ("offload_gib", ("offload",))):
        given = check_host_gib("--" + key.replace("_", "-"), getattr(ns, key), host_avail=host_avail,
                               min_bytes=seq_bytes if key == "directkv_gib" else 0)
        if given is None:
            given, why = default_host_gib(token_bytes, opts["max_model_len"], in_flight(points), host_avail)
            if key == "directkv_gib" and given * GiB < seq_bytes and kinds & set(kinds_of):
                raise _usage(f"the host memory available holds less than one sequence of max_model_len "
                             f"({seq_bytes / GiB:.2f} GiB) for the directkv engines")
        else:
            why = "given"
        opts[key], host_why[key] = given, why
    opts["host_why"] = host_why
    hbm_all = all_kv_hbm_gib(token_bytes, points)
    opts["engines"] = [replace(e, hbm_gib=hbm_all) if e.hbm_gib == "all" else e for e in opts["engines"]]
    if kinds & set(DIRECTKV_KINDS):
        value = str(os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "")).strip()
        if value and value.lstrip("-").isdigit() and int(value) == 0:
            raise _usage("the directkv engines need vLLM's V2 model runner; unset VLLM_USE_V2_MODEL_RUNNER=0")
    return opts


# ---- commands and environments (pure) ---------------------------------------------------------
def vllm_cli(python: str | None = None) -> list[str]:
    """The ``vllm`` script's entry point under this interpreter (the script may not be on PATH)."""
    return [python or sys.executable, "-m", "vllm.entrypoints.cli.main"]


def engine_flags(engine: Engine, opts: dict) -> list[str]:
    """The flags that make ``engine`` what it is (beyond the flags every engine gets)."""
    if engine.kind == "offload":
        return ["--kv-offloading-size", f"{opts['offload_gib']:g}", "--kv-offloading-backend", "native"]
    if engine.kind in DIRECTKV_KINDS:
        return ["--attention-backend", DIRECTKV_BACKEND,
                "--kv-cache-memory-bytes", str(int(opts["directkv_gib"] * GiB))]
    return []


def server_command(engine: Engine, opts: dict, *, model: str, port: int, tokenizer: str | None,
                   python: str | None = None) -> list[str]:
    """``vllm serve`` for ``engine`` on 127.0.0.1:``port`` (``model``: the folder the server loads;
    ``tokenizer``: its tokenizer folder, None for the model's own)."""
    cmd = vllm_cli(python) + ["serve", model, "--host", "127.0.0.1", "--port", str(port),
                              "--max-model-len", str(opts["max_model_len"]),
                              "--gpu-memory-utilization", f"{opts['gpu_memory_utilization']:g}",
                              "--dtype", "bfloat16", "--seed", str(opts["seed"]), "--generation-config", "vllm",
                              "--disable-uvicorn-access-log"]
    if opts["preset"]:
        cmd += ["--load-format", "dummy"]
    if tokenizer:
        cmd += ["--tokenizer", tokenizer]
    if not opts["prefix_caching"]:
        cmd += ["--no-enable-prefix-caching"]
    if opts["enforce_eager"]:
        cmd += ["--enforce-eager"]
    if opts["max_num_seqs"]:
        cmd += ["--max-num-seqs", str(opts["max_num_seqs"])]
    return cmd + engine_flags(engine, opts) + list(opts["server_args"])


def engine_env_changes(engine: Engine, opts: dict) -> dict[str, str | None]:
    """The environment ``engine``'s server gets beyond the bench's own (None: removed)."""
    from directkv_cute.env import VLLM_HBM_GB, VLLM_SPARSE_BUDGET

    # only the directkv engines read them; a sparse budget only where the engine names one
    changes: dict[str, str | None] = {VLLM_HBM_GB: None, VLLM_SPARSE_BUDGET: None}
    if engine.kind in DIRECTKV_KINDS:
        changes[VLLM_HBM_GB] = repr(float(engine.hbm_gib or 0.0))
    if engine.sparse:
        changes[VLLM_SPARSE_BUDGET] = engine.sparse
    if opts["long_model_len"]:
        changes["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    return changes


def server_env(engine: Engine, opts: dict, base: dict | None = None) -> dict:
    """The server's whole environment: ``base`` (default: this process's, with this tree first
    on PYTHONPATH and Hugging Face offline, ``bench.vllm.worker_env``) with the engine's changes."""
    if base is None:
        from bench.vllm import worker_env

        base = worker_env()
    env = dict(base)
    for key, value in engine_env_changes(engine, opts).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def client_command(point: dict, opts: dict, *, model: str, tokenizer: str, port: int, result_dir: str | Path,
                   result_file: str, label: str, python: str | None = None) -> list[str]:
    """``vllm bench serve`` for one point against the server on 127.0.0.1:``port`` (flags of vLLM
    0.26's ``vllm/benchmarks/serve.py`` and ``datasets.py``)."""
    cmd = vllm_cli(python) + ["bench", "serve", "--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}",
                              "--endpoint", "/v1/completions", "--model", model, "--tokenizer", tokenizer,
                              "--dataset-name", "random", "--random-input-len", str(point["input_len"]),
                              "--random-output-len", str(point["output_len"]), "--random-range-ratio", "0.0",
                              "--ignore-eos", "--num-prompts", str(point["num_prompts"])]
    if point["concurrency"] is not None:
        cmd += ["--max-concurrency", str(point["concurrency"])]
    else:
        cmd += ["--request-rate", f"{point['request_rate']:g}"]
    cmd += ["--temperature", "0", "--seed", str(point["seed"])]
    slos = [f"{k}:{opts[f'slo_{k}_ms']:g}" for k in ("ttft", "tpot") if opts[f"slo_{k}_ms"] > 0]
    if slos:
        cmd += ["--goodput", *slos]
    return cmd + ["--percentile-metrics", ",".join(METRICS),
                  "--metric-percentiles", ",".join(str(p) for p in PERCENTILES),
                  "--save-result", "--save-detailed", "--result-dir", str(result_dir), "--result-filename", result_file,
                  "--disable-tqdm", "--label", label]


def point_label(point: dict) -> str:
    load = f"c{point['concurrency']}" if point["concurrency"] is not None else f"r{point['request_rate']:g}"
    return f"i{point['input_len']}-o{point['output_len']}-{load}"


def file_safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9.-]+", "_", name)


# ---- what the server and the client report ---------------------------------------------------
def parse_client_result(doc: dict) -> dict:
    """Row fields from the JSON ``vllm bench serve --save-result`` writes (its keys in vLLM 0.26:
    ``completed``, ``failed``, ``duration``, ``request_throughput``, ``request_goodput``,
    ``output_throughput``, ``total_token_throughput``, ``max_output_tokens_per_s``,
    ``max_concurrent_requests``, ``total_input_tokens``, ``total_output_tokens``, and per metric
    ``mean_<m>_ms``, ``median_<m>_ms``, ``p50_<m>_ms``, ``p99_<m>_ms``; ``errors`` with
    ``--save-detailed``). Status ``ok`` (every request completed), ``partial`` or ``error`` (none);
    the first request error, if any, as ``error``."""
    if not isinstance(doc, dict) or "completed" not in doc:
        raise ValueError("not a `vllm bench serve` result (no 'completed')")

    def num(key):
        v = doc.get(key)
        return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None

    row = {"completed": int(doc["completed"]), "failed": int(doc.get("failed") or 0), "duration_s": num("duration")}
    for key in ("request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
                "max_output_tokens_per_s"):
        row[key] = num(key)
    for key in ("max_concurrent_requests", "total_input_tokens", "total_output_tokens"):
        row[key] = None if num(key) is None else int(num(key))
    for m in METRICS:
        row[f"{m}_mean_ms"] = num(f"mean_{m}_ms")
        for p in PERCENTILES:
            got = num(f"p{p}_{m}_ms")
            if got is None and p == 50:
                got = num(f"median_{m}_ms")
            row[f"{m}_p{p}_ms"] = got
    errors = [e for e in doc.get("errors") or [] if e]
    total = row["completed"] + row["failed"]
    row["status"] = "error" if row["completed"] == 0 else ("partial" if row["failed"] else "ok")
    if errors:
        first = str(errors[0]).strip().splitlines()
        row["error"] = f"{len(errors)} of {total} requests failed: " + (first[-1][:300] if first else "?")
    elif row["status"] != "ok":
        row["error"] = f"{row['failed']} of {total} requests failed"
    return row


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_samples(text: str) -> list[tuple[str, dict, float]]:
    """Prometheus text -> [(name, {label: value}, value)] of every finite sample."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if math.isfinite(value):
            labels = {k: v.replace('\\"', '"').replace("\\\\", "\\") for k, v in _LABEL.findall(m.group(2) or "")}
            out.append((m.group(1), labels, value))
    return out


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {metric name: sum of its samples over label sets}; a counter's
    ``_total`` sample is filed under its name without the suffix (``vllm:num_preemptions``), its
    ``_created`` samples are dropped."""
    out: dict[str, float] = collections.defaultdict(float)
    for name, _, value in parse_samples(text):
        if not name.endswith("_created"):
            out[name.removesuffix("_total")] += value
    return dict(out)


def counter_rise(before: dict | None, after: dict | None, name: str) -> int | None:
    """How much counter ``name`` rose between two ``parse_metrics`` readings (None if unknown)."""
    if before is None or after is None or name not in after:
        return None
    return int(round(after[name] - before.get(name, 0.0)))


_KV_LOG = {"gpu_kv_cache_tokens": re.compile(r"GPU KV cache size:\s*([\d,]+)\s*tokens"),
           "max_concurrency": re.compile(r"Maximum concurrency for\s*[\d,]+\s*tokens per request:\s*([\d.]+)x"),
           "available_kv_cache_gib": re.compile(r"Available KV cache memory:\s*([\d.]+)\s*GiB")}


def kv_log_lines(text: str) -> dict:
    """vLLM's startup log lines about its KV capacity: ``gpu_kv_cache_tokens`` (blocks x block
    size; for directkv, host pages), ``max_concurrency`` (requests of max_model_len tokens it
    holds), ``available_kv_cache_gib`` (absent when the KV size is given), and the lines."""
    out: dict = {"lines": []}
    for line in text.splitlines():
        for key, pat in _KV_LOG.items():
            m = pat.search(line)
            if m and key not in out:
                value = m.group(1).replace(",", "")
                out[key] = int(value) if key == "gpu_kv_cache_tokens" else float(value)
                out["lines"].append(line.strip()[-200:])
    return out


# ---- ratios and floors -----------------------------------------------------------------------
def point_key(row: dict) -> tuple:
    return row["input_len"], row["output_len"], row["concurrency"], row["request_rate"]


def add_ratios(rows: list[dict], reference: str = "hbm") -> None:
    """``tpot_p50_vs_hbm`` and ``ttft_p50_vs_hbm`` of every measured row: its p50 over the
    ``reference`` engine's at the same point (None without one)."""
    ref = {point_key(r): r for r in rows if r["engine"] == reference and r["status"] in ("ok", "partial")}
    for r in rows:
        base = ref.get(point_key(r))
        for metric in ("tpot", "ttft"):
            mine, theirs = r[f"{metric}_p50_ms"], base and base[f"{metric}_p50_ms"]
            r[f"{metric}_p50_vs_hbm"] = mine / theirs if mine is not None and theirs else None


def floor_tpot_ms(concurrency: int, input_len: int, output_len: int, token_bytes: int,
                  h2d_gbps: float) -> tuple[int, float]:
    """(KV bytes one decode step of ``concurrency`` requests reads at the mean decode context,
    input + output / 2, and that over the memcpy H2D ceiling in ms)."""
    kv = int(concurrency * (input_len + output_len / 2) * token_bytes)
    return kv, kv / (h2d_gbps * GB) * 1e3


def add_floors(rows: list[dict], engines: dict, token_bytes: int, h2d_gbps: float | None) -> None:
    """``kv_bytes_per_step``, ``floor_tpot_ms`` and ``pct_floor`` of the directkv host-only rows of
    a concurrency sweep (``engines``: name -> entry with ``kind``)."""
    for r in rows:
        r["kv_bytes_per_step"] = r["floor_tpot_ms"] = r["pct_floor"] = None
        if (engines.get(r["engine"], {}).get("kind") != "directkv" or r["concurrency"] is None
                or not h2d_gbps or r["input_len"] is None):
            continue
        r["kv_bytes_per_step"], r["floor_tpot_ms"] = floor_tpot_ms(r["concurrency"], r["input_len"], r["output_len"],
                                                                   token_bytes, h2d_gbps)
        r["pct_floor"] = 100 * r["floor_tpot_ms"] / r["tpot_p50_ms"] if r["tpot_p50_ms"] else None


def finish(doc: dict) -> dict:
    """Ratios, floors and ``passed`` of a results document, in place."""
    add_ratios(doc["rows"])
    add_floors(doc["rows"], doc["engines"], doc["model"]["kv_token_bytes"],
               (doc.get("ceilings") or {}).get("memcpy_h2d_gbps"))
    doc["passed"] = (all(e["status"] == "ok" for e in doc["engines"].values())
                     and all(r["status"] in ("ok", "skipped") for r in doc["rows"]))
    return doc


# ---- processes -------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cmd: list[str], env: dict, log_path: str | Path) -> subprocess.Popen:
    """Start ``cmd`` as the leader of a new process group, stdout and stderr into ``log_path``."""
    log = open(log_path, "ab")
    try:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    finally:
        log.close()  # the child holds its own descriptor


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``, from /proc; where /proc cannot
    say, [pgid] while ``killpg(pgid, 0)`` finds the group."""
    proc = Path("/proc")
    if proc.is_dir():
        out = []
        for d in proc.iterdir():
            if not d.name.isdigit():
                continue
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()  # state ppid pgrp ...
            if len(fields) >= 3 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                out.append(int(d.name))
        return out
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return []
    except PermissionError:
        pass
    return [pgid]


def stop_group(proc: subprocess.Popen, *, timeout_s: float, kill_timeout_s: float = 15.0, sig=signal.SIGTERM,
               poll_s: float = 0.1) -> dict:
    """Stop ``proc``'s process group (``proc`` leads it: ``start_new_session``): ``sig`` to the
    group, up to ``timeout_s`` for every process of it to exit, then SIGKILL and up to
    ``kill_timeout_s`` more. Returns how it went: {"signal", "killed", "stop_s", "group_gone",
    "returncode"}."""
    pgid = proc.pid
    t0 = time.monotonic()

    def gone(deadline: float) -> bool:
        while True:
            proc.poll()  # reap the leader
            if not group_members(pgid):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)

    def send(s):
        try:
            os.killpg(pgid, s)
        except (ProcessLookupError, PermissionError):
            pass

    killed = False
    if proc.poll() is None or group_members(pgid):
        send(sig)
        if not gone(time.monotonic() + timeout_s):
            killed = True
            send(signal.SIGKILL)
            gone(time.monotonic() + kill_timeout_s)
    try:
        proc.wait(timeout=kill_timeout_s)
    except subprocess.TimeoutExpired:
        pass
    return {"signal": signal.Signals(sig).name, "killed": killed, "stop_s": round(time.monotonic() - t0, 3),
            "group_gone": not group_members(pgid), "returncode": proc.returncode}


def http_get(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    """(status, body) of a GET; (0, why) when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, ""
    except (urllib.error.URLError, OSError, ValueError) as e:
        return 0, f"{type(e).__name__}: {e}"


def wait_healthy(proc: subprocess.Popen, base_url: str, *, timeout_s: float, poll_s: float = 1.0,
                 tick: Callable[[], None] | None = None) -> tuple[str, float]:
    """Poll ``base_url``/health until it answers 200 ("ok"), the process exits ("died") or
    ``timeout_s`` passes ("timeout"); returns (that, seconds waited)."""
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            return "died", time.monotonic() - t0
        status, _ = http_get(base_url + "/health", timeout_s=min(5.0, max(0.5, poll_s)))
        if status == 200:
            return "ok", time.monotonic() - t0
        if time.monotonic() - t0 >= timeout_s:
            return "timeout", time.monotonic() - t0
        if tick:
            tick()
        time.sleep(poll_s)


def read_metrics(base_url: str) -> dict | None:
    status, body = http_get(base_url + "/metrics", timeout_s=10.0)
    return parse_metrics(body) if status == 200 else None


def read_text(path: str | Path) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def log_tail(path: str | Path, lines: int = 30) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    return [line.rstrip() for line in text.splitlines()[-lines:]]


def run_client(cmd: list[str], env: dict, log_path: str | Path, *, timeout_s: float,
               tick: Callable[[], None] | None = None, poll_s: float = 0.5) -> dict:
    """Run one client to its end (its own process group, killed after ``timeout_s``), calling
    ``tick`` every ``poll_s`` meanwhile: {"returncode", "timed_out", "wall_s"}."""
    t0 = time.monotonic()
    proc = launch(cmd, env, log_path)
    timed_out = False
    try:
        while proc.poll() is None:
            if time.monotonic() - t0 > timeout_s:
                timed_out = True
                break
            if tick:
                tick()
            try:
                proc.wait(timeout=poll_s)
            except subprocess.TimeoutExpired:
                pass
    finally:
        stop_group(proc, timeout_s=5.0, sig=signal.SIGKILL if timed_out else signal.SIGTERM)
    return {"returncode": proc.returncode, "timed_out": timed_out, "wall_s": time.monotonic() - t0}


def warmup(base_url: str, model: str, vocab: int, seed: int, timeout_s: float) -> str | None:
    """WARMUP_REQUESTS completions of WARMUP_PROMPT_TOKENS random token ids, sent together (not
    recorded); None when all answered 200, else why not."""
    import random

    rng = random.Random(0x5EED ^ seed)
    errors: list[str] = []

    def one(i):
        ids = [rng.randrange(min(int(vocab or 1000), 1 << 31)) for _ in range(WARMUP_PROMPT_TOKENS)]
        body = json.dumps({"model": model, "prompt": ids, "max_tokens": WARMUP_OUTPUT_TOKENS, "ignore_eos": True,
                           "temperature": 0}).encode()
        req = urllib.request.Request(base_url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                r.read()
        except urllib.error.HTTPError as e:
            errors.append(f"HTTP {e.code}: {e.read()[:200].decode('utf-8', 'replace')}")
        except (urllib.error.URLError, OSError) as e:
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(WARMUP_REQUESTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    return "; ".join(errors) or None


class GpuUse:
    """Device memory in use (bytes, all processes): ``bench.vllm_worker.GpuMemory`` (NVML, else
    ``torch.cuda.mem_get_info``); ``read()`` None where neither works."""

    def __init__(self):
        self._mem = None
        try:
            from bench.vllm_worker import GpuMemory

            self._mem = GpuMemory()
            self._mem.used()
        except Exception:  # noqa: BLE001 - no GPU view: memory is not recorded
            self._mem = None

    def read(self) -> int | None:
        if self._mem is None:
            return None
        try:
            return int(self._mem.used())
        except Exception:  # noqa: BLE001
            return None


def wait_released(read: Callable[[], int | None], baseline: int | None, *, timeout_s: float,
                  poll_s: float = 1.0) -> dict:
    """Wait until GPU memory in use is within RELEASE_SLACK_BYTES of ``baseline`` (or
    ``timeout_s``): {"released", "wait_s", "gpu_used_bytes", "baseline_bytes"}."""
    t0 = time.monotonic()
    used = read()
    while used is not None and baseline is not None and used > baseline + RELEASE_SLACK_BYTES:
        if time.monotonic() - t0 >= timeout_s:
            break
        time.sleep(poll_s)
        used = read()
    released = None if used is None or baseline is None else used <= baseline + RELEASE_SLACK_BYTES
    return {"released": released, "wait_s": round(time.monotonic() - t0, 3), "gpu_used_bytes": used,
            "baseline_bytes": baseline}


# ---- one engine ------------------------------------------------------------------------------
@dataclass
class Context:
    """What ``run_engine`` needs beyond the options: where files go, the model and tokenizer
    folders, the environment, and the injectable pieces (tests replace ``launch`` with a fake
    server and ``client`` with a fake client)."""

    raw_dir: Path
    model: str
    tokenizer: str
    base_env: dict
    launch: Callable = launch
    client: Callable = run_client
    gpu_used: Callable[[], int | None] = lambda: None
    host_avail: Callable[[], int | None] = available_host_bytes
    echo: Callable[[str], None] = lambda line: print(line, flush=True)
    health_poll_s: float = 1.0
    release_poll_s: float = 1.0
    python: str | None = None
    on_row: Callable[[list], None] = lambda rows: None  # called with the engine's rows so far


def run_engine(engine: Engine, opts: dict, ctx: Context) -> tuple[dict, list[dict]]:
    """One engine: start its server, wait for /health, warm up, run every point, stop the server
    and wait for its GPU memory; returns (its engine entry, its rows). Never raises for what the
    server or the client does: a failure is an error entry or row, and the run goes on."""
    safe = file_safe(engine.name)
    log_path = ctx.raw_dir / f"{safe}.server.log"
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    cmd = server_command(engine, opts, model=ctx.model, port=port,
                         tokenizer=ctx.tokenizer if (ctx.tokenizer != ctx.model) else None, python=ctx.python)
    changes = engine_env_changes(engine, opts)
    env = server_env(engine, opts, ctx.base_env)
    entry = {"name": engine.name, "kind": engine.kind, "status": "ok", "error": None,
             "flags": engine_flags(engine, opts), "env": changes, "command": cmd, "port": port,
             "hbm_gib": (engine.hbm_gib or 0.0) if engine.kind in DIRECTKV_KINDS else None,
             "sparse_budget": engine.sparse,
             "host_kv_gib": opts["directkv_gib"] if engine.kind.startswith("directkv") else (
                 opts["offload_gib"] if engine.kind == "offload" else None),
             "server_log": str(log_path)}
    rows: list[dict] = []
    baseline = ctx.gpu_used()
    entry["gpu_used_before_bytes"] = baseline
    entry["host_available_before_bytes"] = ctx.host_avail()
    peak = [baseline]

    def tick():
        used = ctx.gpu_used()
        if used is not None:
            peak[0] = used if peak[0] is None else max(peak[0], used)

    ctx.echo(f"-- {engine.name}: starting `{shlex.join(cmd[1:])}`" + (
        f" with {' '.join(f'{k}={v}' for k, v in changes.items() if v is not None)}" if any(changes.values()) else ""))
    t0 = time.monotonic()
    try:
        proc = ctx.launch(cmd, env, log_path)
    except OSError as e:
        entry.update(status="error", error=f"server did not start: {type(e).__name__}: {e}")
        rows.append(new_row(engine=engine.name, status="error", error=entry["error"]))
        return entry, rows
    try:
        state, waited = wait_healthy(proc, base_url, timeout_s=opts["startup_timeout_s"], poll_s=ctx.health_poll_s,
                                     tick=tick)
        entry["startup_s"] = round(waited, 3)
        if state != "ok":
            tail = log_tail(log_path)
            last = next((line for line in reversed(tail) if line.strip()), "")
            why = (f"server exited with status {proc.returncode} during startup" if state == "died"
                   else f"server not healthy after {opts['startup_timeout_s']:g} s")
            entry.update(status="error", error=why + (f": {last[-300:]}" if last else ""), log_tail=tail)
            rows.append(new_row(engine=engine.name, status="error", error=entry["error"]))
            ctx.echo(f"-- {engine.name}: {entry['error']}")
            return entry, rows
        used = ctx.gpu_used()
        entry["gpu_bytes_after_start"] = None if used is None or baseline is None else used - baseline
        entry["kv_log"] = kv_log_lines(read_text(log_path))
        ctx.echo(f"-- {engine.name}: healthy after {waited:.0f} s" + (
            f", {entry['gpu_bytes_after_start'] / GiB:.1f} GiB of GPU memory" if entry["gpu_bytes_after_start"]
            is not None else "") + "".join(f"; {line.split('] ')[-1]}" for line in entry["kv_log"]["lines"]))
        t_sweep = time.monotonic()
        if opts["warmup"]:
            err = warmup(base_url, ctx.model, opts["model_info"]["vocab_size"], opts["seed"],
                         timeout_s=min(opts["point_timeout_s"], 600.0))
            entry["warmup_s"] = round(time.monotonic() - t_sweep, 3)
            if err:
                entry["warmup_error"] = err[:400]
                ctx.echo(f"-- {engine.name}: warm-up: {err[:200]}")
        budget = opts["time_budget_s"]
        for point in opts["points"]:
            base = dict(engine=engine.name, input_len=point["input_len"], output_len=point["output_len"],
                        concurrency=point["concurrency"], request_rate=point["request_rate"],
                        num_prompts=point["num_prompts"], seed=point["seed"])
            left = None if budget is None else budget - (time.monotonic() - t_sweep)
            if proc.poll() is not None:
                rows.append(new_row(**base, status="skipped", error=f"the server exited (status {proc.returncode})"))
                continue
            if left is not None and left <= 0:
                rows.append(new_row(**base, status="skipped", note=f"--time-budget-s {budget:g} spent"))
                continue
            row = run_point(point, base, opts, ctx, base_url=base_url, port=port, label=engine.name, safe=safe,
                            timeout_s=opts["point_timeout_s"] if left is None else min(opts["point_timeout_s"], left),
                            budget_bound=left is not None and left < opts["point_timeout_s"], tick=tick,
                            baseline=baseline)
            if proc.poll() is not None:
                row["note"] = "; ".join(filter(None, [row["note"], f"the server exited (status {proc.returncode})"]))
                if row["status"] == "ok":
                    row["status"] = "error"
            rows.append(row)
            ctx.on_row(rows)
            ctx.echo(format_progress(row))
        if proc.poll() is not None:
            tail = log_tail(log_path)
            entry.update(status="error", error=f"the server exited with status {proc.returncode} during the sweep",
                         log_tail=tail)
        entry["sweep_s"] = round(time.monotonic() - t_sweep, 3)
    finally:
        entry["stop"] = stop_group(proc, timeout_s=opts["stop_timeout_s"])
        entry["gpu_release"] = wait_released(ctx.gpu_used, baseline, timeout_s=opts["release_timeout_s"],
                                             poll_s=ctx.release_poll_s)
        entry["gpu_peak_bytes"] = None if peak[0] is None or baseline is None else peak[0] - baseline
        entry["host_available_after_bytes"] = ctx.host_avail()
        entry["wall_s"] = round(time.monotonic() - t0, 3)
        if entry["gpu_release"]["released"] is False:
            entry["note"] = (f"GPU memory not back within {RELEASE_SLACK_BYTES / GiB:g} GiB of its use before the "
                             f"server after {opts['release_timeout_s']:g} s")
        stop = entry["stop"]
        ctx.echo(f"-- {engine.name}: stopped ({stop['signal']}" + (", SIGKILL" if stop["killed"] else "")
                 + f", {stop['stop_s']:.1f} s)")
    return entry, rows


def run_point(point: dict, base: dict, opts: dict, ctx: Context, *, base_url: str, port: int, label: str, safe: str,
              timeout_s: float, budget_bound: bool, tick, baseline: int | None) -> dict:
    """One client run at ``point``: the row (preemptions and prefix-cache counters from /metrics
    before and after)."""
    name = f"{safe}-{point_label(point)}"
    result_file = f"{name}.json"
    result_path = ctx.raw_dir / result_file
    result_path.unlink(missing_ok=True)
    cmd = client_command(point, opts, model=ctx.model, tokenizer=ctx.tokenizer, port=port, result_dir=ctx.raw_dir,
                         result_file=result_file, label=label, python=ctx.python)
    before = read_metrics(base_url)
    point_peak = [None]

    def point_tick():
        tick()
        used = ctx.gpu_used()
        if used is not None:
            point_peak[0] = used if point_peak[0] is None else max(point_peak[0], used)

    run = ctx.client(cmd, ctx.base_env, ctx.raw_dir / f"{name}.client.log", timeout_s=timeout_s, tick=point_tick)
    after = read_metrics(base_url)
    row = new_row(**base, wall_s=round(run["wall_s"], 3), client_file=str(result_path),
                  preemptions=counter_rise(before, after, PREEMPTIONS),
                  prefix_cache_hits=counter_rise(before, after, PREFIX_HITS),
                  prefix_cache_queries=counter_rise(before, after, PREFIX_QUERIES),
                  gpu_peak_bytes=None if point_peak[0] is None or baseline is None else point_peak[0] - baseline)
    if run["timed_out"]:
        why = "--time-budget-s spent" if budget_bound else f"--point-timeout-s {opts['point_timeout_s']:g}"
        row.update(status="timeout", error=f"client stopped after {timeout_s:.0f} s ({why})")
        return row
    try:
        parsed = parse_client_result(json.loads(result_path.read_text()))
    except (OSError, ValueError) as e:
        tail = log_tail(ctx.raw_dir / f"{name}.client.log", 8)
        last = next((line for line in reversed(tail) if line.strip()), "")
        row.update(status="error", error=(f"client exited with status {run['returncode']}, no result ({e})"
                                          + (f": {last[-300:]}" if last else "")))
        return row
    row.update(parsed)
    if run["returncode"] not in (0, None) and row["status"] == "ok":
        row["note"] = f"client exited with status {run['returncode']}"
    return row


def format_progress(r: dict) -> str:
    load = f"C{r['concurrency']}" if r["concurrency"] is not None else f"{r['request_rate']:g} req/s"
    if r["status"] in ("ok", "partial"):
        return (f"   {r['engine']} {kilo(r['input_len'])}+{r['output_len']} {load} x{r['num_prompts']}: "
                f"TTFT p50 {fmt_opt(r['ttft_p50_ms'], '.0f')} ms, TPOT p50 {fmt_opt(r['tpot_p50_ms'], '.2f')} ms, "
                f"{fmt_opt(r['output_throughput'], '.1f')} tok/s, {r['completed']} ok / {r['failed']} failed, "
                f"preemptions {fmt_opt(r['preemptions'], 'd')}, {r['wall_s']:.0f} s"
                + (f" [{r['error']}]" if r["error"] else ""))
    return f"   {r['engine']} {kilo(r['input_len'])}+{r['output_len']} {load}: {r['status']}: {r['error'] or r['note']}"


def run_engines(opts: dict, ctx: Context, doc: dict, write: Callable[[], None]) -> dict:
    """Every engine in order into ``doc`` (engines, rows, ratios, floors), written after every
    point and engine."""
    done_rows: list[dict] = []

    def refresh(current: list[dict] | None = None):
        doc["rows"] = done_rows + list(current or [])
        finish(doc)
        write()

    for engine in opts["engines"]:
        doc["engines"][engine.name] = {"name": engine.name, "kind": engine.kind, "status": "running", "error": None}
        ctx.on_row = refresh
        entry, rows = run_engine(engine, opts, ctx)
        doc["engines"][engine.name] = entry
        done_rows.extend(rows)
        refresh()
    return doc


# ---- table and plot --------------------------------------------------------------------------
TABLE_COLUMNS = ("engine", "in", "out", "load", "N", "status", "ok/fail", "TTFT p50", "TTFT p99", "TPOT p50",
                 "TPOT p99", "ITL p50", "E2EL p50 s", "out tok/s", "req/s", "goodput", "preempt", "TPOT/hbm",
                 "TTFT/hbm", "floor ms", "%floor", "note")


def _load(r: dict) -> str:
    if r["concurrency"] is not None:
        return f"C{r['concurrency']}"
    return "-" if r["request_rate"] is None else f"{r['request_rate']:g}/s"


def format_table(doc: dict) -> str:
    """The rows, engine by engine in run order, under the header lines."""
    order = {name: i for i, name in enumerate(doc["engines"])}
    rows = sorted(doc["rows"], key=lambda r: (order.get(r["engine"], 99), r["input_len"] or 0, r["output_len"] or 0,
                                              r["concurrency"] or 0, r["request_rate"] or 0))
    lines = [TABLE_COLUMNS]
    for r in rows:
        note = r["error"] or r["note"] or ""
        if len(note) > 90:
            note = note[:87] + "..."
        e2el = None if r["e2el_p50_ms"] is None else r["e2el_p50_ms"] / 1e3
        lines.append((r["engine"], "-" if r["input_len"] is None else kilo(r["input_len"]),
                      fmt_opt(r["output_len"], "d"),
                      _load(r), fmt_opt(r["num_prompts"], "d"), r["status"],
                      "-" if r["completed"] is None else f"{r['completed']}/{r['failed']}",
                      fmt_opt(r["ttft_p50_ms"], ".0f"), fmt_opt(r["ttft_p99_ms"], ".0f"),
                      fmt_opt(r["tpot_p50_ms"], ".2f"),
                      fmt_opt(r["tpot_p99_ms"], ".2f"), fmt_opt(r["itl_p50_ms"], ".2f"), fmt_opt(e2el, ".1f"),
                      fmt_opt(r["output_throughput"], ".1f"), fmt_opt(r["request_throughput"], ".3f"),
                      fmt_opt(r["request_goodput"], ".3f"), fmt_opt(r["preemptions"], "d"),
                      fmt_opt(r["tpot_p50_vs_hbm"], ".2f"), fmt_opt(r["ttft_p50_vs_hbm"], ".2f"),
                      fmt_opt(r["floor_tpot_ms"], ".1f"), fmt_opt(r["pct_floor"], ".0f"), note))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(TABLE_COLUMNS))]
    left = tuple(TABLE_COLUMNS.index(c) for c in ("engine", "load", "status", "note"))
    body = ["  ".join(str(c).ljust(w) if i in left else str(c).rjust(w)
                      for i, (c, w) in enumerate(zip(line, widths))).rstrip() for line in lines]
    body.insert(1, "  ".join("-" * w for w in widths))
    h, a = doc["header"], doc["args"]
    ceil = doc.get("ceilings")
    slos = ", ".join(f"{k.upper()} <= {a[f'slo_{k}_ms']:g} ms" for k in ("ttft", "tpot")
                     if a.get(f"slo_{k}_ms")) or "none"
    head = [f"== vllm {h['versions'].get('vllm') or '?'} serve: {a['workload']} on {h['gpu']} {h['date']}; "
            f"--gpu-memory-utilization {a['gpu_memory_utilization']:g} for every engine, max_model_len "
            f"{a['max_model_len']}",
            "latencies in ms (E2EL in s) from `vllm bench serve`; TPOT/hbm, TTFT/hbm: p50 over the hbm engine's at the "
            f"same point; goodput: requests/s meeting {slos}; preempt: vllm:num_preemptions during the point"]
    if a.get("long_model_len"):
        head.append("max_model_len is beyond the model's max_position_embeddings (VLLM_ALLOW_LONG_MAX_MODEL_LEN=1): "
                    "timing only")
    if ceil:
        head.append(f"floor (directkv host-only rows): C x (in + out/2) x {doc['model']['kv_token_bytes']} B of KV per "
                    f"token / memcpy H2D {ceil['memcpy_h2d_gbps']:.1f} GB/s; %floor = floor / TPOT p50 (a lower bound: "
                    "no non-attention time)")
    for name, e in doc["engines"].items():
        mem = e.get("gpu_bytes_after_start")
        kv = (e.get("kv_log") or {}).get("gpu_kv_cache_tokens")
        desc = " ".join(e.get("flags") or []) or "vLLM defaults"
        extra = [f"{k}={v}" for k, v in (e.get("env") or {}).items() if v is not None and k.startswith("DIRECTKV")]
        line = (f"{name}: {desc}" + (f" {' '.join(extra)}" if extra else "")
                + (f"; GPU {mem / GiB:.1f} GiB after start" if mem is not None else "")
                + (f"; KV blocks hold {kv} tokens" if kv is not None else "")
                + (f"; started in {e['startup_s']:.0f} s" if e.get("startup_s") is not None else ""))
        if e["status"] != "ok":
            line += f"; {e['status']}: {e['error']}"
        head.append(line)
    return "\n".join(head + body)


_STYLE = {"hbm": "d-", "offload": "^--", "directkv": "o-", "directkv-hbm": "s-", "directkv-sparse": "v-"}


def plot_serve(doc: dict, path: str | Path) -> Path | None:
    """PNG: TPOT p50 (top) and output tokens/s (bottom) against concurrency (or request rate),
    one line per engine, one column per input length. None without matplotlib or measured rows."""
    from bench.common import pyplot, save_figure

    plt = pyplot()
    rows = [r for r in doc["rows"] if r["status"] in ("ok", "partial") and r["tpot_p50_ms"] is not None]
    if plt is None or not rows:
        return None
    input_lens = sorted({r["input_len"] for r in rows})
    rate = rows[0]["concurrency"] is None
    fig, axes = plt.subplots(2, len(input_lens), figsize=(4.5 * len(input_lens) + 1, 7.5), squeeze=False)
    kinds = {name: e.get("kind") for name, e in doc["engines"].items()}
    for col, n in enumerate(input_lens):
        top, bottom = axes[0][col], axes[1][col]
        for engine in doc["engines"]:
            pts = sorted(((r["request_rate"] if rate else r["concurrency"]), r["tpot_p50_ms"], r["output_throughput"],
                          r["floor_tpot_ms"]) for r in rows if r["engine"] == engine and r["input_len"] == n)
            if not pts:
                continue
            style = _STYLE.get(kinds.get(engine), "o-")
            top.plot([p[0] for p in pts], [p[1] for p in pts], style, label=engine, ms=5)
            bottom.plot([p[0] for p in pts], [p[2] or 0 for p in pts], style, label=engine, ms=5)
            floor = [(p[0], p[3]) for p in pts if p[3] is not None]
            if floor:
                top.plot([p[0] for p in floor], [p[1] for p in floor], "k:", lw=1, alpha=0.6,
                         label=f"link floor ({engine})")
        xs = sorted({(r["request_rate"] if rate else r["concurrency"]) for r in rows if r["input_len"] == n})
        for ax in (top, bottom):
            ax.set_xscale("log", base=2 if not rate else 10)
            ax.set_xticks(xs, [f"{x:g}" for x in xs])
            ax.minorticks_off()
            ax.grid(True, which="major", alpha=0.3)
        top.set_yscale("log")
        top.set(title=f"input {kilo(n)}, output {rows[0]['output_len']}", ylabel="TPOT p50 (ms)")
        bottom.set(xlabel="request rate (req/s)" if rate else "concurrency", ylabel="output tokens / s")
        top.legend(fontsize=7)
    h, a = doc["header"], doc["args"]
    return save_figure(plt, fig, path, f"vLLM {h['versions'].get('vllm') or ''} serve, {a['workload']}\n{h['gpu']} "
                       f"{h['date']}, --gpu-memory-utilization {a['gpu_memory_utilization']:g}")


# ---- the run ---------------------------------------------------------------------------------
def check_runnable(opts: dict) -> None:
    """vLLM importable here, and the directkv plugin's entry point installed when a directkv
    engine is asked; UsageError (one line, exit 2) otherwise."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise UsageError(VLLM_MISSING)
    if any(e.kind.startswith("directkv") for e in opts["engines"]):
        from directkv_cute.vllm import plugin_installed

        if not plugin_installed():
            raise UsageError(PLUGIN_MISSING)


def args_record(ns: argparse.Namespace, opts: dict) -> dict:
    args = {k: v for k, v in vars(ns).items() if isinstance(v, (str, int, float, bool, list, type(None)))}
    args.update({k: opts[k] for k in ("input_lens", "output_len", "concurrency", "rates", "gpu_memory_utilization",
                                      "max_model_len", "slo_ttft_ms", "slo_tpot_ms", "directkv_gib", "offload_gib",
                                      "host_why", "time_budget_s", "max_num_seqs", "server_args", "preset", "model",
                                      "workload", "prefix_caching", "long_model_len")},
                engines=[e.name for e in opts["engines"]], points=opts["points"])
    return args


def run_serve(ns: argparse.Namespace) -> int:
    from bench.common import env_info, package_version, require_gpu, results_path, write_json, write_run_files

    host_avail = available_host_bytes()
    opts = resolve_options(ns, host_avail)
    out_dir = checked_out_dir(ns.out_dir)
    require_gpu(ns.device, command="bench serve", cpu_run=False)
    check_runnable(opts)
    header = env_info("cuda")
    header["versions"]["vllm"] = package_version("vllm")
    suffix = f"serve-{opts['workload']}"
    path = results_path(out_dir, header, suffix)
    raw_dir = out_dir / f"{path.stem}-raw"
    print(f"directkv bench serve ({opts['workload']}, vllm {header['versions']['vllm']}) on {header['gpu']} -> {path}",
          flush=True)
    for key in ("directkv_gib", "offload_gib"):
        if any(e.kind.startswith(key.split("_")[0]) for e in opts["engines"]):
            print(f"{key}: {opts[key]:g} GiB ({opts['host_why'][key]})", flush=True)
    ceilings = details = None
    if opts["ceilings"]:
        import torch

        from bench.ceilings import measure_ceilings

        c, details = measure_ceilings("cuda", host_bytes=int(opts["ceiling_gb"] * GiB),
                                      hbm_bytes=int(2 * opts["ceiling_gb"] * GiB))
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the servers get the GPU memory back
        ceilings = c.to_dict()
        print(f"ceilings: memcpy H2D {c.memcpy_h2d_gbps:.2f} GB/s, host read {c.host_read_gbps:.2f} GB/s, "
              f"HBM read {c.hbm_read_gbps:.1f} GB/s", flush=True)
    info = dict(opts["model_info"])
    if opts["preset"]:
        from bench.vllm import model_shape, weight_bytes

        info["weight_bytes"] = weight_bytes(model_shape(opts["preset"]))
    doc = {"schema": SERVE_SCHEMA, "bench": "serve", "header": header, "ceilings": ceilings,
           "ceiling_details": details, "args": args_record(ns, opts),
           "model": info | {"preset": opts["preset"], "path": opts["model"]}, "engines": {}, "passed": True, "rows": []}

    txt = results_path(out_dir, header, suffix, ext="txt")

    def write():  # after every point: a run cut short keeps its JSON and table
        write_json(path, doc)
        txt.write_text(format_table(doc) + "\n")

    raw_dir.mkdir(parents=True, exist_ok=True)
    write()
    with tempfile.TemporaryDirectory(prefix="directkv-serve-") as tmp:
        if opts["preset"]:
            from bench.vllm import write_model_dir

            model = write_model_dir(Path(tmp) / opts["preset"], opts["preset"], opts["max_model_len"])
            if not opts["tokenizer"]:
                write_word_tokenizer(model, int(opts["model_info"]["vocab_size"]))
            model = str(model)
        else:
            model = opts["model"]
        from bench.vllm import worker_env

        ctx = Context(raw_dir=raw_dir, model=model, tokenizer=opts["tokenizer"] or model, base_env=worker_env(),
                      gpu_used=GpuUse().read)
        run_engines(opts, ctx, doc, write)
    finish(doc)
    write()
    write_run_files(path, doc, format_table(doc), out_dir, header, suffix, None if ns.no_plot else plot_serve)
    return 0 if doc["passed"] else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``serve`` subcommand's options (defaults in brackets)."""
    p.add_argument("--engines", default=None,
                   help="comma list, run in this order: hbm, offload, directkv, directkv-hbm=GIB (or =all: the "
                        "largest point's KV), directkv-sparse=BUDGET (1/8, 0.125, 256p) "
                        f"[{DEFAULTS['engines']}]")
    p.add_argument("--model", default=None, help="a local Hugging Face folder (weights, tokenizer) to serve")
    p.add_argument("--preset", default=None,
                   help=f"or a model shape from directkv_cute.presets, dummy weights [{DEFAULTS['preset']}]")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer folder for the servers and the client (default: the model's own; a preset: a "
                        "generated word-level tokenizer of its vocabulary)")
    p.add_argument("--input-lens", default=None, help="prompt tokens, a comma list (k = 1024) [32768]")
    p.add_argument("--output-len", type=int, default=None,
                   help=f"output tokens per request, >= {MIN_OUTPUT_LEN} [{DEFAULTS['output_len']}]")
    p.add_argument("--concurrency", default=None, help="client --max-concurrency values [1,2,4]")
    p.add_argument("--request-rates", default=None, help="or client --request-rate values (req/s), Poisson arrivals")
    p.add_argument("--num-prompts", default=None,
                   help="prompts per point: N, or Kx (K x the concurrency) [max(4 x concurrency, 8); rates: "
                        f"{RATE_NUM_PROMPTS}]")
    p.add_argument("--slo-ttft-ms", type=float, default=None,
                   help=f"goodput's TTFT objective, 0: none [{DEFAULTS['slo_ttft_ms']:g}]")
    p.add_argument("--slo-tpot-ms", type=float, default=None,
                   help=f"goodput's TPOT objective, 0: none [{DEFAULTS['slo_tpot_ms']:g}]")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.90,
                   help="vLLM's, the same for every engine, in (0, 1] [0.90]")
    p.add_argument("--directkv-gib", type=float, default=None,
                   help="the directkv engines' KV in pinned host memory, GiB (--kv-cache-memory-bytes) [the largest "
                        f"point's KV, at most {HOST_FRACTION:.0%}% of the available host memory]")
    p.add_argument("--offload-gib", type=float, default=None,
                   help="the offload engine's host buffer, GiB (--kv-offloading-size) [as --directkv-gib's default]")
    p.add_argument("--max-num-seqs", type=int, default=None, help="every server's --max-num-seqs [vLLM's default]")
    p.add_argument("--no-prefix-caching", action="store_true", help="--no-enable-prefix-caching on every server")
    p.add_argument("--enforce-eager", action="store_true", help="--enforce-eager on every server (faster startup)")
    p.add_argument("--server-args", default=None, help="more flags for every server, one shell-quoted string")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="bound each engine's sweep (warm-up and points, after its health check) to this many seconds")
    p.add_argument("--startup-timeout-s", type=float, default=1200.0, help="wait this long for /health [1200]")
    p.add_argument("--point-timeout-s", type=float, default=3600.0, help="stop a client after this long [3600]")
    p.add_argument("--stop-timeout-s", type=float, default=60.0,
                   help="after SIGTERM to a server's group, SIGKILL after this long [60]")
    p.add_argument("--release-timeout-s", type=float, default=120.0,
                   help="wait this long for a stopped server's GPU memory to be free [120]")
    p.add_argument("--no-warmup", action="store_true", help="no warm-up requests before an engine's points")
    p.add_argument("--no-ceilings", action="store_true", help="no ceilings measured, so no link floor")
    p.add_argument("--ceiling-gb", type=float, default=2.0, help="host buffer for the ceilings (HBM: twice) [2]")
    p.add_argument("--seed", type=int, default=0, help="point k's prompts use seed + k [0]")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                   help="auto / cuda: the GPU; cpu is refused (vLLM has no CPU run here)")
    p.add_argument("--no-plot", action="store_true")
    add_out_dir_argument(p)


def cmd_serve(ns: argparse.Namespace) -> int:
    return run_serve(ns)


__all__ = ["Context", "Engine", "ROW_FIELDS", "SERVE_SCHEMA", "add_arguments", "add_floors", "add_ratios",
           "all_kv_hbm_gib", "client_command", "cmd_serve", "counter_rise", "default_host_gib", "engine_env_changes",
           "engine_flags", "finish", "floor_tpot_ms", "format_table", "kv_log_lines", "model_info", "new_row",
           "parse_client_result", "parse_engines", "parse_metrics", "plan_points", "plot_serve", "resolve_options",
           "run_engine", "run_engines", "server_command", "server_env", "stop_group", "wait_healthy",
           "write_word_tokenizer"]
