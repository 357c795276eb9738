"""vLLM as a peer: ``python -m bench vllm`` -- vLLM's own KV handling and vLLM with the DirectKV
plugin serving a Llama-3-8B-shaped model with dummy weights, next to the link floor of a host
read, in one run.

    python -m bench vllm                                   # llama3-8b, 32k/64k/128k, batch 1 + max
    python -m bench vllm --methods hbm --contexts 32768 --batches 1,8
    python -m bench vllm --methods directkv --directkv-gib 64
    python -m bench vllm --methods offload,directkv --directkv-hbm-gib auto
    python -m bench vllm --smoke                           # 2-layer tiny Llama, 2048 tokens, batch 1 + 2

Methods (``--methods``), each one vLLM engine (``vllm.LLM``, ``load_format="dummy"``: random
weights from a ``config.json`` written into a temporary folder; bf16; token-id prompts only):

* ``vllm[hbm]``: vLLM's defaults, all KV in GPU blocks sized by ``--gpu-memory-utilization``;
* ``vllm[offload]``: the same with vLLM's native KV offloading to host memory
  (``kv_offloading_size=--offload-gib``, ``kv_offloading_backend="native"``). vLLM still attends
  only to tokens in its GPU blocks: the host buffer holds blocks it can load back, so a batch
  whose KV does not fit in the GPU blocks waits or is preempted rather than decoded at once
  (``peak conc.`` shows how many decoded together);
* ``vllm+directkv[host]``: the DirectKV plugin (``directkv_cute.vllm``, loaded by vLLM through its
  ``vllm.general_plugins`` entry point): ``attention_backend="CUSTOM"`` and
  ``kv_cache_memory_bytes=--directkv-gib``, every KV block in pinned host memory, attention reading
  it in place over the link (vLLM's V2 model runner, its default for this model; an environment
  with ``VLLM_USE_V2_MODEL_RUNNER=0`` is refused). The worker checks in the engine's own process
  that every attention layer runs the plugin's backend over pinned host KV
  (``bench/vllm_worker.py``). Its target: decode at >= 95% of the link floor (``target``).
  With ``--directkv-hbm-gib X`` (> 0) the plugin also keeps HBM copies of blocks in X GiB
  (``DIRECTKV_VLLM_HBM_GB=X`` in that worker's environment; docs/SERVING.md), and the method is
  named ``vllm+directkv[hbm X GiB]`` (no target: part of its KV is read from HBM). ``auto``
  gives it as much HBM as ``vllm[offload]``'s GPU KV blocks took in the same run (that engine's
  ``staging_bytes``; offload runs first): DirectKV and vLLM's native offloading at equal HBM.
  A comma list (``0,20``) runs one directkv engine per tier, each row named by its tier.

Batches (``--batches``) are integers or ``max``: the largest batch whose KV fits the method,
from the capacity the engine reports after startup (GPU blocks x block size; for offload plus
the host buffer's tokens; for directkv its blocks, all in host memory), each sequence rounded up
to whole blocks and capped at vLLM's ``max_num_seqs``. The default ``--offload-gib`` holds what
the GPU blocks cannot for the largest integer batch at the longest context, the default
``--directkv-gib`` that whole batch; with ``max`` either holds at least as much as vllm[hbm]'s
GPU blocks are estimated to hold; at most half of the host memory available
(``default_host_gib``). A host size beyond the host memory available is refused, and so is a
``--directkv-gib`` below one sequence of the longest length (vLLM refuses to start with less).

With ``kv_cache_memory_bytes`` set, vLLM's startup needs nothing else for a KV size beyond the
free HBM: ``Worker.determine_available_memory`` runs the profile pass and returns the bytes as
given (no HBM check); ``get_kv_cache_configs`` makes blocks of them (bytes / block bytes /
layers) and ``_check_enough_kv_cache_memory`` only asks for one sequence of ``max_model_len``;
the startup plan (``VLLM_ENABLE_STARTUP_PLAN``) neither applies nor saves a plan when the size is
given. ``request_memory`` still asks for ``--gpu-memory-utilization`` of the device's memory to
be free at startup, whatever the KV size.

**Timing.** Each (method, context, batch) makes ``batch`` prompts of distinct random token ids
(nothing shared between requests or rows) and drives ``engine.step()`` itself over two passes
of them, greedy, ``ignore_eos``, no detokenization (prefix caching on, every method;
``bench/vllm_worker.py``, ``measure``), stamping ``time.perf_counter()`` whenever a request's
output grows (cumulative outputs). Pass 1 asks one token per request: TTFT (submit -> first
token; batches: median and max) is the prompts' prefill. Its finished requests leave their
blocks in vLLM's prefix cache (and, for offload, in its host buffer), so pass 2, the same
prompts for ``1 + --new-tokens`` tokens, starts every request decoding together rather than
between other prompts' prefill chunks: ``resume ms`` is its median time to the first token (the
cached KV reloaded, or read in place), and from its stamps (``reduce_timing``) come the decode
ms per token per sequence (median over requests of (t_last - t_first) / (tokens - 1)), the
median step time (``step_ms``, in the JSON: between consecutive steps that gave decode tokens, so
a one-off stall that the mean per token counts in full leaves it unchanged), total
decode tokens/s over the stretch in which every request is decoding, and the peak number of
requests that got a decode token in the same step. A short request warms the engine up first
(compilation and CUDA graph capture are not timed; the directkv plugin compiles its kernels in
vLLM's warm-up before serving).

**Memory.** ``GPU`` is the device memory in use during the row minus before the engine started
(NVML where available, else ``torch.cuda.mem_get_info``); ``staging`` is vLLM's GPU KV pool (every
token vLLM attends to sits in these blocks; for directkv its HBM tier's block mirrors, 0 without
one: the planner's own staging buffers are part of ``GPU``); ``host`` the offload buffer, or directkv's
pinned KV (its blocks x block size x KV bytes per token).

**Floor and ceilings, same run.** Before any engine starts the host-read, HBM-read and memcpy H2D
ceilings are measured (``bench.ceilings``) and their GPU memory freed. ``vllm[hbm]`` also decodes
at ``--short-context`` (1024) for batch 1 and every row's batch: the model's non-attention step
time. A row's floor is its KV bytes per decode step (batch x context x layers x 2 x KV heads x
head dim x 2 bytes) over the memcpy H2D ceiling plus that time; ``%floor`` is floor / measured
(``pct_floor``), and a directkv row's ``target`` is MET at >= 95% (``target_pct``, ``target_met``;
no verdict without the non-attention time). vLLM's own methods need not read their KV over the
link each step, so their ``%floor`` may pass 100.

**Processes.** Each method runs in its own worker process (``python -P -m bench.vllm_worker
SPEC.json``; the environment passes through, with this checkout's root first on PYTHONPATH:
``bench`` is not installed, and ``-P`` leaves the current folder off the path), which builds one engine,
runs all its rows and writes a JSON after every row; the parent collects them. A worker that
fails, crashes or runs past ``--worker-timeout-s`` (its whole process group is killed) is an
error entry in the results, and the other methods still run. ``vllm[offload]`` and
``vllm+directkv[host]`` run first, so that ``vllm[hbm]``'s short rows cover their batches too.

Files under ``--out-dir`` (default ./bench-results): ``<gpu>-<date>-vllm-<preset>.json`` (schema
``directkv-bench-vllm/1``: header with vLLM's version, ceilings, args, model, engines, rows), the
table as ``.txt`` and a ``.png`` of ms per token against context per method (matplotlib).
Without a CUDA GPU the bench refuses (exit status 2): vLLM has no CPU run here.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import (GB, GiB, UsageError, add_out_dir_argument, available_host_bytes, checked_out_dir, fmt_opt,
                          kilo, pyplot, save_figure, write_run_files)

VLLM_SCHEMA = "directkv-bench-vllm/1"
METHODS = ("offload", "directkv", "hbm")  # run order: hbm's short rows then cover the others' batches
METHOD_NAMES = {"hbm": "vllm[hbm]", "offload": "vllm[offload]", "directkv": "vllm+directkv[host]"}
HOST_KV_METHODS = {"offload": "--offload-gib", "directkv": "--directkv-gib"}  # methods with host KV: their option
DIRECTKV_BACKEND = "CUSTOM"  # vLLM's attention backend slot the directkv plugin registers into
DIRECTKV_TARGET_PCT = 95.0  # decode over host KV only: at least this share of the link floor
DEFAULTS = dict(preset="llama3-8b", contexts=[32768, 65536, 131072], batches=["1", "max"], new_tokens=32,
                short_context=1024)
SMOKE = dict(preset="tiny", contexts=[2048], batches=["1", "2"], new_tokens=8, short_context=256)
SMOKE_OFFLOAD_GIB = 1.0
HOST_FRACTION = 0.5  # the default offload buffer takes at most this share of the available host memory
RESERVED_GPU_BYTES = 2 * GiB  # activations, CUDA graphs, the allocator: not KV, not weights
ELEM_BYTES = 2  # bf16 weights
WORKER_MODULE = "bench.vllm_worker"
VLLM_MISSING = ("bench vllm: vLLM is not importable: `pip install -e .[vllm]` (vllm==0.26.0), or put the folder "
                "vLLM is installed in on PYTHONPATH")
# The workers run under this interpreter, whose pip may not be the `pip` on PATH.
PLUGIN_MISSING = ("bench vllm: the directkv plugin is not installed where vLLM runs (no `vllm.general_plugins` "
                  f"entry point `directkv` for {sys.executable}): `{sys.executable} -m pip install -e .` "
                  "there, not only this tree on PYTHONPATH")

ROW_FIELDS = ("bench", "method", "role", "context", "batch", "batch_spec", "status", "error", "note", "ttft_ms",
              "ttft_max_ms", "resume_ms", "decode_ms", "step_ms", "tokens_per_s", "all_decoding", "peak_concurrent", "requests",
              "new_tokens", "gpu_bytes", "staging_bytes", "host_bytes", "kv_bytes_per_step", "non_attention_ms",
              "floor_ms", "pct_floor", "target_pct", "target_met", "wall_s")
STATUSES = ("ok", "error", "timeout", "skipped")


def new_row(**fields) -> dict:
    """A row with every field of ROW_FIELDS (missing ones None)."""
    unknown = set(fields) - set(ROW_FIELDS)
    if unknown:
        raise KeyError(f"unknown row fields {sorted(unknown)}")
    return {f: None for f in ROW_FIELDS} | {"bench": "vllm", "role": "measured"} | fields


# ---- the model -------------------------------------------------------------------------------
def model_shape(preset: str) -> dict:
    """The transformers config fields of a ``directkv_cute.presets`` preset (Llama / Qwen2)."""
    from directkv_cute.presets import PRESETS

    if preset not in PRESETS:
        raise UsageError(f"bench vllm: unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    cls_name, kwargs = PRESETS[preset]
    return {"class": cls_name, **kwargs}


def kv_token_bytes(shape: dict) -> int:
    """K and V bytes of one token over all layers (bf16): a one-token page of every layer."""
    import torch

    from directkv_cute.cache import page_bytes

    return page_bytes(shape["num_hidden_layers"], shape["num_key_value_heads"], 1, shape["head_dim"], torch.bfloat16)


def weight_bytes(shape: dict) -> int:
    """bf16 bytes of the weights: embeddings, LM head, attention, MLP, norms (Qwen2's q/k/v biases)."""
    h, layers, inter, vocab = (shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"],
                               shape["vocab_size"])
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter + 2 * h
    if shape["class"] == "Qwen2Config":
        per_layer += q + 2 * kv
    heads = vocab * h * (1 if shape.get("tie_word_embeddings") else 2)
    return ELEM_BYTES * (heads + layers * per_layer + h)


def config_json(preset: str, max_model_len: int) -> dict:
    """The ``config.json`` vLLM's dummy loader reads: the preset's shape, bf16, no special tokens,
    ``max_position_embeddings`` at least ``max_model_len``. RoPE is written as ``rope_theta`` +
    ``rope_scaling`` (transformers 4 and 5 both read them)."""
    shape = dict(model_shape(preset))
    cls_name = shape.pop("class")
    rope = dict(shape.pop("rope_parameters"))
    arch, model_type = {"LlamaConfig": ("LlamaForCausalLM", "llama"),
                        "Qwen2Config": ("Qwen2ForCausalLM", "qwen2")}[cls_name]
    cfg = {"architectures": [arch], "model_type": model_type, "torch_dtype": "bfloat16", **shape,
           "rope_theta": rope.pop("rope_theta"), "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
           "hidden_act": "silu", "attention_bias": model_type == "qwen2", "use_cache": True}
    if rope.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = rope
    cfg["max_position_embeddings"] = max(int(cfg["max_position_embeddings"]), int(max_model_len))
    return cfg


def write_model_dir(folder: str | Path, preset: str, max_model_len: int) -> Path:
    """``folder``/config.json for ``preset`` (the folder is created); returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config_json(preset, max_model_len), indent=1) + "\n")
    return folder


# ---- options ---------------------------------------------------------------------------------
def parse_batches(text: str) -> list[str]:
    """``1,max,8`` -> ["1", "max", "8"]: positive integers or ``max``; one line and exit 2 otherwise."""
    out = []
    for item in (s.strip().lower() for s in str(text).split(",")):
        if not item:
            continue
        if item != "max" and not (item.isdigit() and int(item) >= 1):
            raise UsageError(f"bench vllm: --batches takes positive integers or 'max', got {item!r}")
        if item not in out:
            out.append(item if item == "max" else str(int(item)))
    if not out:
        raise UsageError("bench vllm: --batches is empty")
    return out


def parse_contexts(text: str) -> list[int]:
    out = []
    for item in (s.strip() for s in str(text).split(",")):
        if not item:
            continue
        try:
            n = int(item)
        except ValueError:
            raise UsageError(f"bench vllm: --contexts takes integers, got {item!r}") from None
        if n < 1:
            raise UsageError(f"bench vllm: a context must be >= 1 token, got {n}")
        out.append(n)
    if not out:
        raise UsageError("bench vllm: --contexts is empty")
    return out


def method_name(method: str, hbm_gib: float = 0.0) -> str:
    """A method's name in the rows and the table: ``directkv`` with an HBM tier is
    ``vllm+directkv[hbm X GiB]``."""
    if method == "directkv" and hbm_gib:
        return f"vllm+directkv[hbm {hbm_gib:.3g} GiB]"
    return METHOD_NAMES[method]


def method_of(name: str) -> str | None:
    """The method a row's name stands for (``method_name``'s inverse), None for another name."""
    if name.startswith("vllm+directkv["):
        return "directkv"
    return next((m for m, n in METHOD_NAMES.items() if n == name), None)


def parse_hbm_gib(text) -> float | str:
    """``--directkv-hbm-gib``: a finite number of GiB >= 0, or ``auto``; one line and exit 2 otherwise."""
    item = str(text).strip().lower()
    if item == "auto":
        return "auto"
    try:
        gib = float(item)
    except ValueError:
        gib = math.nan
    if not math.isfinite(gib) or gib < 0:
        raise UsageError(f"bench vllm: --directkv-hbm-gib takes GiB (a finite number >= 0) or 'auto', got {text!r}")
    return gib


def parse_hbm_gibs(text) -> list:
    """``--directkv-hbm-gib``: a comma list of ``parse_hbm_gib`` items, one directkv engine each
    (``0,auto``: host only, then with offload's GPU KV bytes); one line and exit 2 when empty or
    when a value repeats."""
    items = [item for item in str(text).split(",") if item.strip()]
    if not items:
        raise UsageError(f"bench vllm: --directkv-hbm-gib is empty, got {text!r}")
    got = [parse_hbm_gib(item) for item in items]
    if len(set(got)) != len(got):
        raise UsageError(f"bench vllm: --directkv-hbm-gib names a tier twice: {text!r}")
    return got


def auto_hbm_gib(results: list[dict]) -> float:
    """``--directkv-hbm-gib auto``: the GPU KV bytes (``staging_bytes``) that the ``vllm[offload]``
    engine of this run reported, in GiB; ValueError (one line) when it reported none."""
    for res in results:
        if res.get("method") == "offload" and (res.get("engine") or {}).get("staging_bytes"):
            return res["engine"]["staging_bytes"] / GiB
    raise ValueError("--directkv-hbm-gib auto: vllm[offload] reported no GPU KV bytes in this run (its engine did "
                     "not start); give the GiB as a number")


def parse_methods(text: str) -> list[str]:
    """``hbm,offload`` (or ``vllm[hbm]``...) -> the methods in run order."""
    names = {**{m: m for m in METHODS}, **{v: k for k, v in METHOD_NAMES.items()}}
    got = set()
    for item in (s.strip() for s in str(text).split(",")):
        if not item:
            continue
        if item not in names:
            raise UsageError(f"bench vllm: unknown method {item!r}; use {', '.join(METHODS)}")
        got.add(names[item])
    if not got:
        raise UsageError("bench vllm: --methods is empty")
    return [m for m in METHODS if m in got]


def default_host_gib(method: str, *, token_bytes: int, contexts: list[int], batches: list[str], seq_extra: int,
                     hbm_kv_bytes: int, host_avail: int | None) -> tuple[float, str]:
    """The default host KV (GiB, whole) of a method with host KV and why. ``offload``'s buffer
    holds what its GPU blocks (``hbm_kv_bytes``, estimated) cannot for the largest integer batch
    (at least one sequence) at the longest context; ``directkv`` keeps every block in host memory,
    so it holds that whole batch. With ``max`` either holds at least as much as ``vllm[hbm]``'s GPU
    blocks (so ``max`` can outgrow HBM). At least 1 GiB; at most ``HOST_FRACTION`` of the
    available host memory."""
    if method not in HOST_KV_METHODS:
        raise ValueError(f"{method!r} keeps no KV in host memory")
    in_gpu = hbm_kv_bytes if method == "offload" else 0  # what the engine's own GPU blocks hold
    need, why = 0, []
    largest = max((int(b) for b in batches if b != "max"), default=1)
    over = largest * (max(contexts) + seq_extra) * token_bytes - in_gpu
    if over > 0:
        need, why = over, [f"B{largest} at {kilo(max(contexts))}" + (" beyond the GPU blocks" if in_gpu else "")]
    if "max" in batches and hbm_kv_bytes > need:
        need, why = hbm_kv_bytes, ["as much as vllm[hbm]'s GPU blocks hold (batch max)"]
    gib = max(1, math.ceil(need / GiB))
    why = why or ["every batch fits the GPU blocks: the minimum"]
    if host_avail is not None and gib * GiB > HOST_FRACTION * host_avail:
        gib = max(1, math.floor(HOST_FRACTION * host_avail / GiB))
        why.append(f"capped at {HOST_FRACTION:.0%} of {host_avail / GiB:.0f} GiB of host memory available")
    return float(gib), "; ".join(why)


def resolve_options(ns: argparse.Namespace, host_avail: int | None) -> dict:
    """Every option checked and defaulted (``--smoke`` picks the tiny shapes); bad values are a
    UsageError (one line, exit status 2) before any GPU work."""
    base = SMOKE if ns.smoke else DEFAULTS
    opts = {"preset": ns.preset or base["preset"],
            "contexts": parse_contexts(ns.contexts) if ns.contexts is not None else list(base["contexts"]),
            "batches": parse_batches(ns.batches) if ns.batches is not None else list(base["batches"]),
            "new_tokens": base["new_tokens"] if ns.new_tokens is None else ns.new_tokens,
            "short_context": base["short_context"] if ns.short_context is None else ns.short_context,
            "methods": parse_methods(ns.methods), "smoke": bool(ns.smoke), "seed": ns.seed,
            "enforce_eager": bool(ns.enforce_eager), "worker_timeout_s": ns.worker_timeout_s}
    model_shape(opts["preset"])  # an unknown preset is refused here
    if opts["new_tokens"] < 1:
        raise UsageError(f"bench vllm: --new-tokens must be >= 1, got {opts['new_tokens']}")
    if opts["short_context"] < 0:
        raise UsageError(f"bench vllm: --short-context must be >= 0 (0 skips it), got {opts['short_context']}")
    util = ns.gpu_memory_utilization
    if not (isinstance(util, (int, float)) and math.isfinite(util) and 0 < util <= 1):
        raise UsageError(f"bench vllm: --gpu-memory-utilization must be in (0, 1], got {util}")
    opts["gpu_memory_utilization"] = float(util)
    if ns.worker_timeout_s <= 0:
        raise UsageError(f"bench vllm: --worker-timeout-s must be > 0, got {ns.worker_timeout_s}")
    opts["seq_extra"] = 1 + opts["new_tokens"]  # max_tokens per request
    opts["max_model_len"] = max(opts["contexts"] + [opts["short_context"]]) + opts["seq_extra"]
    token_bytes = kv_token_bytes(model_shape(opts["preset"]))
    opts["offload_gib"] = check_host_gib("offload", SMOKE_OFFLOAD_GIB if ns.offload_gib is None and ns.smoke
                                         else ns.offload_gib, host_avail=host_avail)
    opts["directkv_gib"] = check_host_gib("directkv", ns.directkv_gib, host_avail=host_avail,
                                          min_bytes=opts["max_model_len"] * token_bytes)
    # None: sized from the GPU's memory once it is known (default_host_gib)
    opts["directkv_hbm_gib"] = parse_hbm_gibs(ns.directkv_hbm_gib)
    if "auto" in opts["directkv_hbm_gib"] and "directkv" in opts["methods"] and "offload" not in opts["methods"]:
        raise UsageError("bench vllm: --directkv-hbm-gib auto takes vllm[offload]'s GPU KV bytes of the same run: "
                         "add offload to --methods, or give the GiB as a number")
    if "directkv" in opts["methods"]:
        check_directkv_env(os.environ)
    return opts


def check_host_gib(method: str, gib: float | None, *, host_avail: int | None, min_bytes: int = 0) -> float | None:
    """A method's host KV option (``HOST_KV_METHODS``) checked: finite, >= 0 (``directkv``: > 0,
    its every KV block lives there), at least ``min_bytes``, at most the host memory available.
    None (the default, sized later) passes."""
    if gib is None:
        return None
    option = HOST_KV_METHODS[method]
    if not math.isfinite(gib) or gib < 0 or (method == "directkv" and gib == 0):
        raise UsageError(f"bench vllm: {option} must be {'>' if method == 'directkv' else '>='} 0, got {gib}")
    if host_avail is not None and gib * GiB > host_avail:
        raise UsageError(f"bench vllm: {option} {gib:g} is more than the host memory available "
                         f"({host_avail / GiB:.1f} GiB)")
    if gib * GiB < min_bytes:
        raise UsageError(f"bench vllm: {option} {gib:g} holds less than one sequence of the longest length "
                         f"({min_bytes / GiB:.2f} GiB); vLLM refuses to start with that")
    return float(gib)


def check_directkv_env(environ) -> None:
    """The directkv backend needs vLLM's V2 model runner: refuse an environment that turns it off
    (``VLLM_USE_V2_MODEL_RUNNER=0``; unset lets vLLM pick it, which it does for this model)."""
    value = str(environ.get("VLLM_USE_V2_MODEL_RUNNER", "")).strip()
    if value and value.lstrip("-").isdigit() and int(value) == 0:
        raise UsageError("bench vllm: method directkv needs vLLM's V2 model runner; unset VLLM_USE_V2_MODEL_RUNNER=0")


# ---- batch sizing and timing (used by the worker; no vLLM needed) ------------------------------
def max_batch(capacity_tokens: int, context: int, seq_extra: int, block_size: int, max_num_seqs: int | None) -> int:
    """The largest batch of sequences of ``context + seq_extra`` tokens (each rounded up to whole
    blocks of ``block_size``) that ``capacity_tokens`` holds, at most ``max_num_seqs``."""
    per_seq = math.ceil((context + seq_extra) / block_size)
    n = (capacity_tokens // block_size) // per_seq
    return min(n, max_num_seqs) if max_num_seqs else n


def resolve_batches(specs: list[str], capacity_tokens: int, context: int, seq_extra: int, block_size: int,
                    max_num_seqs: int | None) -> list[tuple[str, int]]:
    """(spec, batch) per ``--batches`` item at one context, ``max`` sized by ``max_batch`` (0 when
    not even one sequence fits); a batch that an earlier item already gives is not repeated."""
    out, seen = [], set()
    for spec in specs:
        b = max_batch(capacity_tokens, context, seq_extra, block_size, max_num_seqs) if spec == "max" else int(spec)
        if b in seen:
            continue
        seen.add(b)
        out.append((spec, b))
    return out


def reduce_timing(submit: dict, events: list[tuple[float, str, int]]) -> dict:
    """Timings of one batch from its stamps: ``submit`` maps request -> submit time (s),
    ``events`` are (time s, request, output tokens so far), one per growth, the events of one
    engine step sharing its time.

    ttft_ms / ttft_max_ms: median / max over requests of first token - submit; decode_ms: median
    over requests of (t_last - t_first) / (tokens_last - tokens_first), in ms (a mean over each
    request's tokens: one slow step counts in full); step_ms: the median time between consecutive
    steps that gave decode tokens (what a typical step takes, stalls left out); tokens_per_s:
    decode tokens of all requests per second over the stretch in which all of them are decoding
    (from the last first token to the first last token; ``all_decoding`` False when that stretch
    is empty, then over the whole decode span); peak_concurrent: the most requests that got a
    decode token (not their first) in one step."""
    first: dict[str, tuple[float, int]] = {}
    last: dict[str, tuple[float, int]] = {}
    prev: dict[str, int] = {}
    steps: dict[float, int] = collections.Counter()
    gained: list[tuple[float, int]] = []
    for t, rid, n in sorted(events, key=lambda e: e[0]):
        if rid not in first:
            first[rid] = (t, n)
        else:
            steps[t] += 1
            gained.append((t, n - prev[rid]))
        last[rid], prev[rid] = (t, n), n
    if not first:
        raise ValueError("no request produced a token")
    missing = sorted(set(submit) - set(first))
    if missing:
        raise ValueError(f"{len(missing)} requests produced no token ({missing[0]}...)")
    ttft = [1e3 * (first[r][0] - submit[r]) for r in first]
    per_token = [1e3 * (last[r][0] - first[r][0]) / (last[r][1] - first[r][1]) for r in first
                 if last[r][1] > first[r][1]]
    times = sorted({t for t, _ in gained})
    step_ms = statistics.median([b - a for a, b in zip(times, times[1:])]) * 1e3 if len(times) > 1 else None
    t0, t1 = max(t for t, _ in first.values()), min(t for t, _ in last.values())
    all_decoding = t1 > t0
    if all_decoding:
        tokens = sum(g for t, g in gained if t0 < t <= t1)
        span = t1 - t0
    else:
        tokens = sum(g for _, g in gained)
        span = max(t for t, _ in last.values()) - min(t for t, _ in first.values())
    return {"ttft_ms": statistics.median(ttft), "ttft_max_ms": max(ttft),
            "decode_ms": statistics.median(per_token) if per_token else None, "step_ms": step_ms,
            "tokens_per_s": tokens / span if span > 0 and tokens else None, "all_decoding": all_decoding,
            "peak_concurrent": max(steps.values(), default=0), "requests": len(first)}


# ---- the floor -------------------------------------------------------------------------------
def kv_bytes_per_step(batch: int, context: int, shape: dict) -> int:
    """The KV one decode step reads: batch x context x layers x 2 (K, V) x KV heads x head dim x 2 bytes."""
    return batch * context * kv_token_bytes(shape)


def floor_ms(kv_bytes: int, memcpy_h2d_gbps: float, non_attention_ms: float | None) -> float:
    """The KV over the memcpy H2D ceiling plus the model's non-attention step time (0 if unknown)."""
    return kv_bytes / (memcpy_h2d_gbps * GB) * 1e3 + (non_attention_ms or 0.0)


def add_floors(rows: list[dict], shape: dict, memcpy_h2d_gbps: float) -> None:
    """Fill kv_bytes_per_step, non_attention_ms, floor_ms and pct_floor (100 x floor / decode ms)
    of every measured row in place; the non-attention time is vllm[hbm]'s decode_ms at the short
    context with the row's batch. ``vllm+directkv[host]`` rows also get their target
    (``target_pct``: ``DIRECTKV_TARGET_PCT`` of the link floor) and whether they meet it; a row
    whose floor lacks the non-attention time gets no verdict."""
    short = {r["batch"]: r["decode_ms"] for r in rows
             if r["role"] == "non-attention" and r["status"] == "ok" and r["decode_ms"]}
    for r in rows:
        if r["role"] != "measured" or not r["batch"] or not r["context"]:
            continue
        r["kv_bytes_per_step"] = kv_bytes_per_step(r["batch"], r["context"], shape)
        r["non_attention_ms"] = short.get(r["batch"])
        r["floor_ms"] = floor_ms(r["kv_bytes_per_step"], memcpy_h2d_gbps, r["non_attention_ms"])
        r["pct_floor"] = 100 * r["floor_ms"] / r["decode_ms"] if r["decode_ms"] else None
        if r["method"] == METHOD_NAMES["directkv"]:  # host KV only: an HBM tier reads part of it from HBM
            r["target_pct"] = DIRECTKV_TARGET_PCT
            complete = r["pct_floor"] is not None and r["non_attention_ms"] is not None
            r["target_met"] = r["pct_floor"] >= DIRECTKV_TARGET_PCT if complete else None
        if r["non_attention_ms"] is None:
            r["note"] = "; ".join(filter(None, [r["note"], "floor without non-attention time (no short row)"]))


# ---- workers ---------------------------------------------------------------------------------
def worker_command() -> list[str]:
    """The worker's command line, to which the spec file is appended."""
    return [sys.executable, "-P", "-m", WORKER_MODULE]


def worker_env() -> dict:
    """The parent's environment with the checkout this ``bench`` was imported from (the folder
    above bench/) first on PYTHONPATH and the rest of PYTHONPATH kept after it: ``bench`` is not
    installed and ``-P`` drops the current folder, so the worker finds the same code only there.
    Hugging Face kept offline (the model is a local config.json)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in parts if p != root])
    env["HF_HUB_OFFLINE"] = "1"
    return env


def error_result(method: str, status: str, error: str) -> dict:
    return {"method": method, "status": status, "error": error, "engine": {}, "rows": []}


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the worker's process group (its engine processes too)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_worker(spec: dict, *, command: list[str] | None = None, timeout_s: float, echo: bool = True,
               env: dict | None = None) -> dict:
    """Run one method's worker on ``spec`` (written next to ``spec['out']``) and return its result
    document. A worker that exits non-zero, writes no result or runs past ``timeout_s`` becomes
    an error result (status "error" / "timeout") with the last lines it printed; a result it
    wrote before failing keeps its rows."""
    method = spec["method"]
    out = Path(spec["out"])
    spec_path = out.with_name(out.stem + "-spec.json")
    spec_path.write_text(json.dumps(spec, indent=1))
    cmd = list(command or worker_command()) + [str(spec_path)]
    tail: collections.deque[str] = collections.deque(maxlen=40)
    env = (worker_env() if env is None else dict(env)) | {"PYTHONUNBUFFERED": "1"}  # lines in the order printed
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                            env=env, start_new_session=True)

    def pump():
        for line in proc.stdout:
            tail.append(line.rstrip())
            if echo:
                print(f"[{spec.get('name') or METHOD_NAMES.get(method, method)}] {line.rstrip()}", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        _kill_group(proc)  # a timeout, Ctrl-C, or engine processes left behind
        proc.wait()
        reader.join(timeout=5)
    last = next((line for line in reversed(tail) if line.strip()), "")
    result = None
    if out.exists():
        try:
            result = json.loads(out.read_text())
        except ValueError:
            result = None
    if timed_out:
        why = f"worker timed out after {timeout_s:g} s" + (f"; last output: {last}" if last else "")
        result = result or error_result(method, "timeout", why)
        result.update(status="timeout", error=why)
    elif proc.returncode != 0:
        why = f"worker exited with status {proc.returncode}" + (f": {last}" if last else "")
        result = result or error_result(method, "error", why)
        if result.get("status") == "ok":
            result.update(status="error", error=why)
        result.setdefault("error", why)
    elif result is None:
        result = error_result(method, "error", "worker wrote no result" + (f"; last output: {last}" if last else ""))
    result["returncode"] = proc.returncode
    result["log_tail"] = list(tail)[-12:]
    return result


def collect(doc: dict, results: list[dict]) -> dict:
    """The workers' results into ``doc``: their engines, rows (a failed worker without rows is one
    error row), vLLM's version, floors and ``passed``."""
    for res in results:
        name = res.get("name") or METHOD_NAMES.get(res["method"], res["method"])
        engine = dict(res.get("engine") or {}) | {"status": res["status"], "error": res.get("error"),
                                                  "returncode": res.get("returncode")}
        doc["engines"][name] = engine
        if res.get("vllm_version"):
            doc["header"]["versions"]["vllm"] = res["vllm_version"]
        rows = [new_row(**r) for r in res.get("rows", [])]
        if res["status"] != "ok" and not any(r["role"] == "measured" for r in rows):
            rows.append(new_row(method=name, status=res["status"], error=res.get("error")))
        doc["rows"] += rows
    add_floors(doc["rows"], doc["model"], doc["ceilings"]["memcpy_h2d_gbps"])
    doc["passed"] = (all(e["status"] == "ok" for e in doc["engines"].values())
                     and all(r["status"] in ("ok", "skipped") for r in doc["rows"]))
    return doc


# ---- table and plot --------------------------------------------------------------------------
TABLE_COLUMNS = ("method", "ctx", "B", "status", "TTFT ms", "resume ms", "ms/tok/seq", "tok/s", "peak conc.", "GPU GiB",
                 "staging GiB", "host GiB", "floor ms", "%floor", "target", "note")


def _gib(n) -> str:
    return "-" if n is None else f"{n / GiB:.1f}"


def format_table(doc: dict) -> str:
    """The rows (the non-attention rows first) under the ceilings line."""
    order = {m: i for i, m in enumerate(METHOD_NAMES)}
    rows = sorted(doc["rows"], key=lambda r: (r["role"] != "non-attention", order.get(method_of(r["method"]), 9),
                                              r["method"], r["context"] or 0, r["batch"] or 0))
    lines = [TABLE_COLUMNS]
    for r in rows:
        ttft = fmt_opt(r["ttft_ms"], ".0f")
        if r["ttft_max_ms"] is not None and (r["batch"] or 0) > 1:
            ttft += f" / {r['ttft_max_ms']:.0f}"
        note = r["error"] or r["note"] or ""
        if r["role"] == "non-attention":
            note = "non-attention time (floor)"
        elif r["batch_spec"] == "max":
            note = "; ".join(filter(None, ["batch max", note]))
        if r["all_decoding"] is False:
            note = "; ".join(filter(None, [note, "never all decoding at once"]))
        if len(note) > 100:
            note = note[:97] + "..."
        target = "" if r["target_pct"] is None else f">={r['target_pct']:.0f}% " + {
            True: "MET", False: "MISS", None: "?"}[r["target_met"]]
        lines.append((r["method"], "-" if r["context"] is None else kilo(r["context"]), fmt_opt(r["batch"], "d"),
                      r["status"], ttft, fmt_opt(r["resume_ms"], ".0f"), fmt_opt(r["decode_ms"], ".2f"), fmt_opt(r["tokens_per_s"], ".0f"),
                      fmt_opt(r["peak_concurrent"], "d"), _gib(r["gpu_bytes"]), _gib(r["staging_bytes"]),
                      _gib(r["host_bytes"]), fmt_opt(r["floor_ms"], ".2f"), fmt_opt(r["pct_floor"], ".0f"), target,
                      note))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(TABLE_COLUMNS))]
    left = tuple(TABLE_COLUMNS.index(c) for c in ("method", "status", "target", "note"))
    body = ["  ".join(str(c).ljust(w) if i in left else str(c).rjust(w)
                      for i, (c, w) in enumerate(zip(line, widths))).rstrip() for line in lines]
    body.insert(1, "  ".join("-" * w for w in widths))
    h, c = doc["header"], doc["ceilings"]
    head = [f"== vllm {h['versions'].get('vllm') or '?'}: {doc['args'].get('preset')} (bf16, dummy weights) on "
            f"{h['gpu']} {h['date']}",
            f"ceilings: memcpy H2D {c['memcpy_h2d_gbps']:.1f} GB/s (the floor's link), SM host read "
            f"{c['host_read_gbps']:.1f} GB/s, HBM read {c['hbm_read_gbps']:.0f} GB/s; floor = KV per step / "
            "memcpy H2D + non-attention time; %floor = floor / ms per token; target: "
            f"{METHOD_NAMES['directkv']} at >= {DIRECTKV_TARGET_PCT:.0f}% of its floor"]
    for name, e in doc["engines"].items():
        if e["status"] != "ok":
            head.append(f"{name}: {e['status']}: {e['error']}")
    return "\n".join(head + body)


_STYLE = {"vllm[hbm]": "d-", "vllm[offload]": "^--", "vllm+directkv[host]": "o-"}


def plot_vllm(doc: dict, path: str | Path) -> Path | None:
    """PNG: decode ms per token per sequence against context, one line per method and batch
    (``max`` is one line though its batch differs per context), floors dotted. None when
    matplotlib is missing or nothing was measured."""
    plt = pyplot()
    rows = [r for r in doc["rows"] if r["role"] == "measured" and r["decode_ms"] is not None]
    if plt is None or not rows:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for (method, spec) in sorted({(r["method"], r["batch_spec"]) for r in rows}):
        pts = sorted((r["context"], r["decode_ms"], r["floor_ms"]) for r in rows
                     if r["method"] == method and r["batch_spec"] == spec)
        label = f"{method} B{spec}"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], _STYLE.get(method, "o-"), label=label, ms=5)
        floor = [(p[0], p[2]) for p in pts if p[2] is not None]
        if floor:
            ax.plot([p[0] for p in floor], [p[1] for p in floor], "k:", lw=1, alpha=0.6)
            ax.annotate(f"floor {label}", floor[-1], fontsize=6, alpha=0.7)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set(xlabel="context (tokens)", ylabel="decode ms / token / sequence",
           title=f"vLLM {doc['header']['versions'].get('vllm') or ''} {doc['args'].get('preset')}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    h = doc["header"]
    return save_figure(plt, fig, path, f"{h['gpu']} {h['date']}: floor = KV / memcpy H2D "
                       f"{doc['ceilings']['memcpy_h2d_gbps']:.1f} GB/s + non-attention time")


# ---- the run ---------------------------------------------------------------------------------
def worker_spec(method: str, opts: dict, *, model_dir: Path, out: Path, host_gib: dict[str, float],
                short_batches: list[int], hbm_gib: float = 0.0) -> dict:
    """What one worker runs: its engine's options and its rows (``host_gib``: the host KV in GiB
    of each method in ``HOST_KV_METHODS``; ``spec["host_gib"]`` is this method's, None without;
    ``hbm_gib``: directkv's HBM tier, GiB)."""
    shape = model_shape(opts["preset"])
    hbm_gib = float(hbm_gib) if method == "directkv" else 0.0
    return {"method": method, "name": method_name(method, hbm_gib), "out": str(out), "model_dir": str(model_dir),
            "hbm_gib": hbm_gib,
            "kv_layout": [shape["num_hidden_layers"], shape["num_key_value_heads"], shape["head_dim"]],
            "contexts": opts["contexts"], "batches": opts["batches"], "new_tokens": opts["new_tokens"],
            "seq_extra": opts["seq_extra"], "max_model_len": opts["max_model_len"],
            "gpu_memory_utilization": opts["gpu_memory_utilization"],
            "host_gib": host_gib.get(method) if method in HOST_KV_METHODS else None,
            "enforce_eager": opts["enforce_eager"],
            "short_context": opts["short_context"] if method == "hbm" else 0, "short_batches": short_batches,
            "token_bytes": kv_token_bytes(model_shape(opts["preset"])), "seed": opts["seed"]}


def run_methods(opts: dict, *, work_dir: Path, host_gib: dict[str, float], write, doc: dict,
                command: list[str] | None = None, echo: bool = True) -> list[dict]:
    """Every method's worker in run order, directkv's once per HBM tier of ``--directkv-hbm-gib``;
    ``vllm[hbm]`` also gets the batches the earlier methods resolved, for its short rows (a run
    without ``hbm`` still runs its short rows in an hbm worker when a floor needs them)."""
    model_dir = write_model_dir(work_dir / "model", opts["preset"], opts["max_model_len"])
    methods = list(opts["methods"])
    if "hbm" not in methods and opts["short_context"]:
        methods.append("hbm")  # the short rows only
    runs = [(m, hbm) for m in methods for hbm in (opts["directkv_hbm_gib"] if m == "directkv" else [0.0])]
    results = []
    for i, (method, hbm_gib) in enumerate(runs):
        batches = sorted({r["batch"] for res in results for r in res.get("rows", []) if r.get("batch")})
        try:
            hbm_gib = auto_hbm_gib(results) if hbm_gib == "auto" else hbm_gib
        except ValueError as e:
            res = error_result(method, "error", str(e)) | {"name": "vllm+directkv[hbm auto]"}
        else:
            spec = worker_spec(method, opts, model_dir=model_dir, out=work_dir / f"{i}-{method}.json",
                               host_gib=host_gib, short_batches=batches, hbm_gib=hbm_gib)
            if method not in opts["methods"]:
                spec["contexts"] = []
            print(f"-- {spec['name']}: worker starting (timeout {opts['worker_timeout_s']:g} s)", flush=True)
            res = run_worker(spec, command=command, timeout_s=opts["worker_timeout_s"], echo=echo)
            res.setdefault("name", spec["name"])
        print(f"-- {res['name']}: {res['status']}" + (f": {res['error']}" if res.get("error") else ""), flush=True)
        results.append(res)
        doc["engines"], doc["rows"] = {}, []
        collect(doc, results)
        write()
    return results


def run_vllm(ns: argparse.Namespace) -> int:
    import importlib.util

    import torch

    from bench.ceilings import measure_ceilings
    from bench.common import package_version, env_info, require_gpu, results_path, write_json

    host_avail = available_host_bytes()
    opts = resolve_options(ns, host_avail)
    out_dir = checked_out_dir(ns.out_dir)
    require_gpu(ns.device, command="bench vllm", cpu_run=False)
    if importlib.util.find_spec("vllm") is None:
        raise UsageError(VLLM_MISSING)
    header = env_info("cuda")
    header["versions"]["vllm"] = package_version("vllm")
    header["dtype"] = "bfloat16"
    shape = model_shape(opts["preset"])
    path = results_path(out_dir, header, f"vllm-{opts['preset']}")
    print(f"directkv bench vllm ({opts['preset']}, vllm {header['versions']['vllm']}) on {header['gpu']} -> {path}",
          flush=True)
    ceilings, details = measure_ceilings("cuda", host_bytes=int(ns.ceiling_gb * GiB),
                                         hbm_bytes=int(2 * ns.ceiling_gb * GiB))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the engines get the GPU memory back
    print(f"ceilings: memcpy H2D {ceilings.memcpy_h2d_gbps:.2f} GB/s, host read {ceilings.host_read_gbps:.2f} GB/s, "
          f"HBM read {ceilings.hbm_read_gbps:.1f} GB/s", flush=True)
    hbm_kv = max(0, int(header["gpu_mem_bytes"] * opts["gpu_memory_utilization"] - weight_bytes(shape)
                        - RESERVED_GPU_BYTES))  # vllm[hbm]'s GPU blocks, estimated
    host_gib, why = {}, {}
    for method, option in HOST_KV_METHODS.items():
        host_gib[method], why[method] = opts[f"{method}_gib"], option
        if host_gib[method] is None:
            host_gib[method], why[method] = default_host_gib(
                method, token_bytes=kv_token_bytes(shape), contexts=opts["contexts"], batches=opts["batches"],
                seq_extra=opts["seq_extra"], hbm_kv_bytes=hbm_kv, host_avail=host_avail)
        if method in opts["methods"]:
            print(f"{METHOD_NAMES[method]} host KV: {host_gib[method]:g} GiB ({why[method]})", flush=True)
    args = {k: v for k, v in vars(ns).items() if isinstance(v, (str, int, float, bool, list, type(None)))}
    args.update({k: opts[k] for k in ("preset", "contexts", "batches", "new_tokens", "short_context", "methods",
                                      "gpu_memory_utilization", "max_model_len", "smoke")},
                **{f"{m}_gib": host_gib[m] for m in HOST_KV_METHODS},
                **{f"{m}_gib_reason": why[m] for m in HOST_KV_METHODS})
    doc = {"schema": VLLM_SCHEMA, "bench": "vllm", "header": header, "ceilings": ceilings.to_dict(),
           "ceiling_details": details, "args": args,
           "model": shape | {"kv_token_bytes": kv_token_bytes(shape), "weight_bytes": weight_bytes(shape)},
           "engines": {}, "passed": True, "rows": []}

    def write():
        write_json(path, doc)

    write()
    with tempfile.TemporaryDirectory(prefix="directkv-vllm-") as tmp:
        results = run_methods(opts, work_dir=Path(tmp), host_gib=host_gib, write=write, doc=doc,
                              echo=not ns.quiet)
    write()
    write_run_files(path, doc, format_table(doc), out_dir, header, f"vllm-{opts['preset']}",
                    None if ns.no_plot else plot_vllm)
    if results and all(r.get("returncode") == 2 for r in results):
        return 2  # no worker could start (vLLM not importable there)
    return 0 if doc["passed"] else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``vllm`` subcommand's options (defaults in brackets; ``--smoke`` ones in parentheses)."""
    p.add_argument("--methods", default="hbm,offload,directkv", help="hbm, offload, directkv [all three]")
    p.add_argument("--preset", default=None, help="model shape from directkv_cute.presets [llama3-8b] (smoke: tiny)")
    p.add_argument("--contexts", default=None, help="prompt tokens [32768,65536,131072] (smoke: 2048)")
    p.add_argument("--batches", default=None,
                   help="integers or max, the largest batch whose KV fits the method [1,max] (smoke: 1,2)")
    p.add_argument("--new-tokens", type=int, default=None, help="decode tokens after the first [32] (smoke: 8)")
    p.add_argument("--short-context", type=int, default=None,
                   help="context of vllm[hbm]'s non-attention rows [1024] (smoke: 256); 0 skips them")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.90, help="vLLM's, in (0, 1] [0.90]")
    p.add_argument("--offload-gib", type=float, default=None,
                   help="vllm[offload]'s host buffer in GiB (default: what HBM cannot hold for the largest batch, "
                        f"at most {HOST_FRACTION:.0%}% of the available host memory; smoke: {SMOKE_OFFLOAD_GIB:g})")
    p.add_argument("--directkv-gib", type=float, default=None,
                   help="vllm+directkv[host]'s KV cache in pinned host memory, GiB (vLLM's kv_cache_memory_bytes; "
                        "default: the largest batch at the longest context, with batch max as much as vllm[hbm]'s "
                        f"GPU blocks, at most {HOST_FRACTION:.0%}% of the available host memory)")
    p.add_argument("--directkv-hbm-gib", default="0",
                   help="directkv's HBM tier in GiB (DIRECTKV_VLLM_HBM_GB; the method becomes "
                        "vllm+directkv[hbm X GiB]), or auto: vllm[offload]'s GPU KV bytes of the same run; "
                        "a comma list runs one directkv engine per tier, e.g. 0,auto [0: none]")
    p.add_argument("--smoke", action="store_true",
                   help="the 2-layer tiny Llama at 2048 tokens, batches 1 and 2: the whole path in well under a minute")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs or compilation (faster startup)")
    p.add_argument("--worker-timeout-s", type=float, default=1500.0,
                   help="kill a method's worker (and its engine) after this many seconds [1500]")
    p.add_argument("--ceiling-gb", type=float, default=2.0, help="host buffer for the ceilings (HBM: twice) [2]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                   help="auto / cuda: the GPU; cpu is refused (vLLM has no CPU run here)")
    p.add_argument("--quiet", action="store_true", help="do not echo the workers' output (vLLM's log)")
    p.add_argument("--no-plot", action="store_true")
    add_out_dir_argument(p)


def cmd_vllm(ns: argparse.Namespace) -> int:
    return run_vllm(ns)


__all__ = ["METHOD_NAMES", "ROW_FIELDS", "VLLM_SCHEMA", "add_arguments", "add_floors", "auto_hbm_gib", "cmd_vllm",
           "collect", "config_json", "default_host_gib", "floor_ms", "format_table", "kv_bytes_per_step", "max_batch",
           "method_name", "method_of", "new_row", "parse_hbm_gib", "parse_hbm_gibs", "plot_vllm", "reduce_timing",
           "resolve_batches", "resolve_options", "run_worker", "write_model_dir"]
