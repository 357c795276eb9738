"""``directkv-generate``: generate text (or tokens) with a Hugging Face model whose KV cache lives in
pinned host memory (``directkv_cute.hf.DirectKVCache``), and report the timings.

    directkv-generate --preset tiny --context 512 --max-new-tokens 16        # CPU: the reference path
    directkv-generate --preset llama3-8b --context 131072 --max-new-tokens 64 --hbm-budget 8GiB
    directkv-generate --model /path/to/Llama-3.1-8B-Instruct --prompt "Hello" --max-new-tokens 64

A local model folder (``--model``, with its tokenizer; nothing is downloaded) or a random-weight
preset (``--preset``, see ``directkv_cute.presets``); a prompt as text (``--prompt``, repeatable
for a batch of different prompts, left-padded) or ``--context N`` random token ids (``--batch``
rows). The cache is sized for ``batch * (prompt + max_new_tokens)`` tokens and the request is
checked against it before anything runs.

How it is timed: ``model.generate`` runs everything, chunked prefill included
(``prefill_chunk_size``), and two observers watch it: a forward hook on the input embedding
counts the prompt tokens each prefill forward consumes (the progress bar), and a
``LogitsProcessor`` (``StepClock``) is called once per generated token, right after that token's
forward pass: its first call marks the end of the prefill (the device is synchronized there: time
to first token), and every call records a CUDA event (a host timestamp on a CPU), so the
intervals between consecutive calls are the per-token decode times, with no synchronization
added to the decode loop. Letting ``generate`` do the work, rather than driving prefill with our
own forward calls and handing a half-filled cache to ``generate``, keeps us on the path users
run and off the input slicing that changed between transformers releases (5.17's
``past_key_values`` / 5.24's ``cache``, ``next_sequence_length``); the same function times
transformers' own caches in the end-to-end bench (``bench/e2e.py``).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["GenerateResult", "StepClock", "dtype_kwargs", "main", "parse_size", "random_prompt",
           "timed_generate"]

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "half": torch.float16, "fp32": torch.float32, "float32": torch.float32}
DEFAULT_PREFILL_CHUNK = 2048
PROMPT_IDS_IN_JSON = 65536  # prompt ids are written to the JSON when the batch has at most this many

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
          "g": 1 << 30, "gib": 1 << 30, "gb": 10**9, "t": 1 << 40, "tib": 1 << 40, "tb": 10**12}


# ---- small helpers shared with the e2e bench ------------------------------------------------
def parse_size(text: str | int) -> int:
    """Bytes from ``"8GiB"``, ``"512MiB"``, ``"1.5G"`` (K/M/G/T and KiB/MiB/GiB/TiB are powers
    of 1024, KB/MB/GB/TB powers of 1000), or a plain integer."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"a size must be >= 0, got {text}")
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size (e.g. 8GiB, 512MiB, 4GB, 1073741824)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value != int(value) and m.group(2).lower() in ("", "b"):
        raise ValueError(f"a size in bytes must be whole, got {text!r}")
    return int(value)


def format_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def dtype_kwargs(dtype: torch.dtype) -> dict:
    """``from_pretrained`` / ``from_config``'s dtype keyword: ``dtype`` in transformers >= 4.56,
    ``torch_dtype`` before."""
    import transformers

    major, minor = (int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])
    return {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": dtype}


def random_prompt(batch: int, context: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """(batch, context) int64 random token ids on the CPU, the same for the same arguments."""
    gen = torch.Generator().manual_seed(int(seed))
    return torch.randint(0, int(vocab_size), (int(batch), int(context)), generator=gen, dtype=torch.long)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# ---- timing generate ------------------------------------------------------------------------
class StepClock:
    """A ``LogitsProcessor`` that timestamps every generated token (it returns the scores as
    they are). Call 0 comes right after the prefill's forward: the device is synchronized and
    ``prefill_end`` (perf_counter) taken. Every call records a CUDA event on the current stream
    (on a GPU) and a host timestamp; ``step_ms()`` are the intervals between consecutive calls:
    each one token's decode step (sampling of the previous token, bookkeeping, the forward)."""

    def __init__(self, device, on_first=None):
        self.cuda = torch.device(device).type == "cuda"
        self.events: list = []
        self.host: list[float] = []
        self.prefill_end: float | None = None
        self.on_first = on_first

    @property
    def calls(self) -> int:
        return len(self.host)

    def __call__(self, input_ids, scores):
        if not self.host:
            if self.cuda:
                torch.cuda.synchronize()
            self.prefill_end = time.perf_counter()
            if self.on_first is not None:
                self.on_first()
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.events.append(ev)
        self.host.append(time.perf_counter())
        return scores

    def step_ms(self) -> list[float]:
        """Per-token decode times in ms (call the device synchronized first)."""
        if self.cuda and len(self.events) > 1:
            return [a.elapsed_time(b) for a, b in zip(self.events, self.events[1:])]
        return [1e3 * (b - a) for a, b in zip(self.host, self.host[1:])]


class _PrefillProgress:
    """A forward hook on the input embedding: the prompt tokens each prefill forward consumes,
    until the clock's first call (the first token); drives a tqdm bar when enabled."""

    def __init__(self, model, clock: StepClock, total: int, enabled: bool, device):
        self.clock = clock
        clock.on_first = self.finish
        self.forwards = 0
        self.tokens = 0
        self._last = 0
        self.bar = None
        self.cuda = torch.device(device).type == "cuda"
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc="prefill", unit="tok", dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                self.bar = None
        self.handle = model.get_input_embeddings().register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        if self.clock.calls:
            return None
        ids = args[0] if args else None
        n = int(ids.shape[-1]) if isinstance(ids, torch.Tensor) and ids.dim() >= 1 else 0
        if self.bar is not None and self.cuda:  # the bar shows finished chunks, not queued ones
            torch.cuda.synchronize()
        if self.bar is not None and self.forwards:
            self.bar.update(self._last)
        self.forwards += 1
        self.tokens += n
        self._last = n
        return None

    def finish(self) -> None:
        """The prefill is over (the clock's first call, device synchronized): close the bar."""
        if self.bar is not None:
            self.bar.update(self._last)
            self.bar.close()
            self.bar = None

    def close(self) -> None:
        self.handle.remove()
        self.finish()


@dataclass
class GenerateResult:
    """What ``timed_generate`` measured."""

    sequences: torch.Tensor  # (B, prompt + new) on the model's device
    new_tokens: torch.Tensor  # (B, new)
    prefill_s: float  # generate() called -> the first token's logits ready (device synchronized)
    step_ms: list[float]  # per-token decode times, one per token after the first
    total_s: float  # the whole generate() call, synchronized
    prefill_forwards: int  # forward calls that made up the prefill (chunks)
    prefill_tokens: int  # prompt columns those forwards consumed
    cache: object | None = None  # the cache generate used (when return_cache)
    extra: dict = field(default_factory=dict)

    @property
    def decode_ms(self) -> float | None:
        """Mean per-token decode time (the decode's wall time / its steps)."""
        return statistics.fmean(self.step_ms) if self.step_ms else None

    @property
    def decode_ms_median(self) -> float | None:
        return statistics.median(self.step_ms) if self.step_ms else None


def timed_generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                   max_new_tokens: int, cache=None, cache_implementation: str | None = None,
                   prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK, do_sample: bool = False,
                   temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                   pad_token_id: int | None = 0, progress: bool = False, return_cache: bool = False,
                   **generate_kwargs) -> GenerateResult:
    """``model.generate`` with the prefill and every decode step timed (see the module docstring).

    ``cache``: a Cache object (passed under ``cache_kwargs``'s keyword) or None (transformers
    builds its own, ``cache_implementation`` e.g. "offloaded"). ``prefill_chunk``: tokens per
    prefill forward (``prefill_chunk_size``; None or >= the prompt: one forward)."""
    from transformers import LogitsProcessorList

    device = input_ids.device
    prompt_len = int(input_ids.shape[1])
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    clock = StepClock(device)
    kwargs = dict(generate_kwargs)
    if cache is not None:
        from directkv_cute.hf import cache_kwargs

        kwargs.update(cache_kwargs(model, cache))
    if cache_implementation is not None:
        kwargs["cache_implementation"] = cache_implementation
    if prefill_chunk and prefill_chunk < prompt_len:
        kwargs["prefill_chunk_size"] = int(prefill_chunk)
    if do_sample:
        kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k)
    else:
        kwargs.update(do_sample=False)
    watcher = _PrefillProgress(model, clock, prompt_len, progress, device)
    try:
        _sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():  # (generate's own; not inference_mode: the cache keeps tensors across calls)
            out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=int(max_new_tokens),
                                 logits_processor=LogitsProcessorList([clock]), pad_token_id=pad_token_id,
                                 return_dict_in_generate=True, **kwargs)
        _sync(device)
        t1 = time.perf_counter()
    finally:
        watcher.close()
    used_cache = None
    if return_cache:
        for name in ("cache", "past_key_values"):
            used_cache = getattr(out, name, None)
            if used_cache is not None:
                break
    sequences = out.sequences
    del out
    prefill_end = clock.prefill_end if clock.prefill_end is not None else t1
    return GenerateResult(sequences=sequences, new_tokens=sequences[:, prompt_len:], prefill_s=prefill_end - t0,
                          step_ms=clock.step_ms(), total_s=t1 - t0, prefill_forwards=watcher.forwards,
                          prefill_tokens=watcher.tokens, cache=used_cache)


def kernels_compiled() -> int | None:
    """How many DirectKV kernels this process holds compiled (None off a GPU)."""
    if not torch.cuda.is_available():
        return None
    try:
        from directkv_cute.kernels import jit

        return len(jit._CACHE)
    except Exception:  # noqa: BLE001 - informational only
        return None


def versions() -> dict:
    import directkv_cute

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "directkv_cute": directkv_cute.__version__}
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:
        out["transformers"] = None
    return out


# ---- the command ----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from directkv_cute.presets import preset_names

    p = argparse.ArgumentParser(prog="directkv-generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="PATH", help="a local Hugging Face model folder (with its tokenizer)")
    src.add_argument("--preset", choices=None, metavar="NAME",
                     help=f"a random-weight model: {', '.join(preset_names())}")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", action="append", metavar="TEXT",
                        help="prompt text (needs --model's tokenizer); give it several times for a batch")
    prompt.add_argument("--context", type=int, metavar="N", help="N random prompt token ids per row (default 512)")
    p.add_argument("--batch", type=int, default=None, help="rows (default 1, or the number of --prompt)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--hbm-budget", default="0", help="bytes of GPU memory for the HBM tier of the cache, "
                   "e.g. 8GiB, 512MiB (default 0: host only)")
    p.add_argument("--page-size", type=int, default=64, help="tokens per cache page (16, 32, 64, 128)")
    p.add_argument("--sink-pages", type=int, default=1, help="first pages of each sequence kept in HBM (with a budget)")
    p.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                   help=f"prompt tokens per prefill forward (default {DEFAULT_PREFILL_CHUNK}; 0: the whole prompt)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                   help="model and cache dtype (default bf16 on CUDA, fp32 on the CPU; fp32 only on the CPU)")
    p.add_argument("--kv-dtype", choices=("auto", "bf16", "fp16", "fp8"), default="auto",
                   help="K/V page dtype (default auto: the model dtype); fp8: float8_e4m3fn pages with per-token "
                        "scales, half the bytes (CPU only until the FP8 GPU kernels exist)")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default cuda if available, else cpu)")
    p.add_argument("--sample", action="store_true", help="sample (default greedy)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="with --sample: keep the k most likely tokens (0: all)")
    p.add_argument("--seed", type=int, default=0, help="weights of a preset, random prompts, sampling")
    p.add_argument("--json", metavar="PATH", help="write the measurements and tokens as JSON")
    p.add_argument("--no-progress", action="store_true", help="no prefill progress bar")
    return p


@dataclass
class _Args:
    device: torch.device
    dtype: torch.dtype
    hbm_budget: int
    kv_dtype: torch.dtype | None = None  # None: the model dtype


def check_args(p: argparse.ArgumentParser, ns: argparse.Namespace) -> _Args:
    """Parse-level checks (no GPU needed): ``p.error`` (exit 2) on a bad combination."""
    from directkv_cute.presets import preset_names

    if ns.preset is not None and ns.preset not in preset_names():
        p.error(f"unknown preset {ns.preset!r}; choose one of {', '.join(preset_names())}")
    if ns.prompt and ns.preset is not None:
        p.error("--prompt needs a tokenizer: use --model PATH, or --context N random tokens with a preset")
    try:
        device = torch.device(ns.device) if ns.device else None
    except (RuntimeError, ValueError) as e:
        p.error(f"--device {ns.device!r}: {e}")
    if device is not None and device.type not in ("cuda", "cpu"):
        p.error(f"--device {ns.device!r}: only cuda and cpu are supported")
    if ns.dtype == "fp32" and device is not None and device.type == "cuda":
        p.error("--dtype fp32 runs only on the CPU reference path (the GPU kernels take bf16 / fp16)")
    for name in ("max_new_tokens", "page_size"):
        if getattr(ns, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if ns.context is not None and ns.context < 1:
        p.error("--context must be >= 1")
    if ns.batch is not None and ns.batch < 1:
        p.error("--batch must be >= 1")
    if ns.prefill_chunk < 0:
        p.error("--prefill-chunk must be >= 0")
    if ns.sink_pages < 0:
        p.error("--sink-pages must be >= 0")
    try:
        budget = parse_size(ns.hbm_budget)
    except ValueError as e:
        p.error(f"--hbm-budget: {e}")
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kv = getattr(ns, "kv_dtype", "auto") or "auto"
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but torch.cuda.is_available() is False (use --device cpu)")
    if ns.dtype == "fp32" and device.type == "cuda":
        p.error("--dtype fp32 runs only on the CPU reference path (the GPU kernels take bf16 / fp16)")
    dtype = DTYPES[ns.dtype] if ns.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    kv_dtype = None
    if kv == "fp8":
        kv_dtype = torch.float8_e4m3fn
    elif kv != "auto":
        if DTYPES[kv] != dtype:
            p.error(f"--kv-dtype {kv} differs from the model dtype {str(dtype).removeprefix('torch.')}: pages hold "
                    "the model dtype (auto) or fp8")
    return _Args(device=device, dtype=dtype, hbm_budget=budget, kv_dtype=kv_dtype)


def _load(ns, a: _Args):
    """(model, tokenizer or None, description)."""
    import directkv_cute.hf as dkhf

    if ns.preset is not None:
        from directkv_cute.presets import build_random_model

        model = build_random_model(ns.preset, a.dtype, a.device, seed=ns.seed,
                                   attn_implementation=dkhf.ATTN_IMPLEMENTATION)
        return model, None, f"preset {ns.preset} (random weights, seed {ns.seed})"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(ns.model)
    if not path.is_dir():
        raise FileNotFoundError(f"--model {ns.model}: not a folder (a local Hugging Face model folder is needed)")
    tok = None
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - a model folder without a tokenizer still runs on --context
        if ns.prompt:
            raise RuntimeError(f"cannot load the tokenizer of {path}: {e}") from e
    kw = dict(local_files_only=True, attn_implementation=dkhf.ATTN_IMPLEMENTATION, **dtype_kwargs(a.dtype))
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), device_map=str(a.device), **kw)
    except (ImportError, ValueError) as e:
        if "device_map" not in str(e) and "accelerate" not in str(e).lower():
            raise
        model = AutoModelForCausalLM.from_pretrained(str(path), **kw).to(a.device)
    model.eval()
    return model, tok, f"{path}"


def _prompt(ns, model, tok, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) on the device: left-padded text prompts or random ids."""
    if ns.prompt:
        prompts = list(ns.prompt)
        if ns.batch and len(prompts) == 1:
            prompts = prompts * ns.batch
        elif ns.batch and ns.batch != len(prompts):
            raise ValueError(f"--batch {ns.batch} with {len(prompts)} prompts (give one prompt, or as many as rows)")
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.convert_ids_to_tokens(0)
        tok.padding_side = "left"
        enc = tok(prompts, return_tensors="pt", padding=True)
        return enc["input_ids"].to(device), enc["attention_mask"].to(device)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    vocab = config.vocab_size
    ids = random_prompt(ns.batch or 1, ns.context or 512, vocab, ns.seed)
    return ids.to(device), torch.ones_like(ids).to(device)


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    ns = p.parse_args(argv)
    a = check_args(p, ns)
    import directkv_cute.hf as dkhf
    from directkv_cute.hf import CacheCapacityError, DirectKVCache, UnsupportedModelError

    torch.manual_seed(ns.seed)
    t_load = time.perf_counter()
    try:
        model, tok, desc = _load(ns, a)
        input_ids, mask = _prompt(ns, model, tok, a.device)
    except (FileNotFoundError, RuntimeError, ValueError) as e:
        print(f"directkv-generate: {e}", file=sys.stderr)
        return 1
    load_s = time.perf_counter() - t_load
    spec = dkhf.model_spec(model.config)
    batch, prompt_len = input_ids.shape
    lengths = mask.sum(dim=1).tolist()
    cuda = a.device.type == "cuda"
    cuda = a.device.type == "cuda"
    params = sum(t.numel() for t in model.parameters())
    print(f"model: {desc}: {spec.num_layers} layers, {spec.num_q_heads}/{spec.num_kv_heads} heads, head_dim "
          f"{spec.head_dim}, {params / 1e9:.2f}B parameters" if params >= 1e8 else
          f"model: {desc}: {spec.num_layers} layers, {spec.num_q_heads}/{spec.num_kv_heads} heads, head_dim "
          f"{spec.head_dim}, {params / 1e6:.1f}M parameters", end="")
    print(f", {str(a.dtype).removeprefix('torch.')} on {a.device} (loaded in {load_s:.1f} s)", flush=True)
    host_kind = "pinned host memory" if cuda else "host memory"
    try:
        cache = DirectKVCache(model, max_tokens=batch * (prompt_len + ns.max_new_tokens), max_batch_size=batch,
                              page_size=ns.page_size, hbm_budget=a.hbm_budget, sink_pages=ns.sink_pages,
                              dtype=a.dtype, device=a.device, kv_dtype=a.kv_dtype)
        cache.check_request(lengths, ns.max_new_tokens)
    except (CacheCapacityError, UnsupportedModelError, ValueError, TypeError) as e:
        print(f"directkv-generate: {e}", file=sys.stderr)
        return 1
    print(f"prompt: {batch} x {prompt_len} tokens ({'text' if ns.prompt else 'random ids'}); cache: "
          f"{'host only' if not a.hbm_budget else 'HBM budget ' + format_bytes(a.hbm_budget)}, page {ns.page_size}, "
          f"{str(cache.kv_dtype).removeprefix('torch.')} pages, "
          f"{format_bytes(cache.kv.num_pages('host') * cache.kv.page_bytes)} of {host_kind} reserved", flush=True)
    if cuda:
        torch.cuda.reset_peak_memory_stats(a.device)
    compiled_before = kernels_compiled()
    pad = (tok.pad_token_id if tok is not None and tok.pad_token_id is not None else 0)
    res = timed_generate(model, input_ids, mask, max_new_tokens=ns.max_new_tokens, cache=cache,
                         prefill_chunk=ns.prefill_chunk or None, do_sample=ns.sample, temperature=ns.temperature,
                         top_p=ns.top_p, top_k=ns.top_k, pad_token_id=pad, progress=not ns.no_progress)
    compiled = None if compiled_before is None else kernels_compiled() - compiled_before
    peak = torch.cuda.max_memory_allocated(a.device) if cuda else None
    host_kv, hbm_kv = cache.host_bytes(), cache.hbm_bytes()
    seq_lengths = cache.seq_lengths()
    new = res.new_tokens.cpu()
    steps = len(res.step_ms)
    decode_s = sum(res.step_ms) / 1e3
    tps = batch * steps / decode_s if decode_s > 0 else None
    real = int(sum(lengths))
    note = f"; includes compiling {compiled} kernels (cached on disk for the next run)" if compiled else ""
    print(f"time to first token: {res.prefill_s:.3f} s (prefill of {real} tokens in {res.prefill_forwards} "
          f"forward{'s' if res.prefill_forwards != 1 else ''}, {real / max(res.prefill_s, 1e-9):,.0f} tokens/s{note})")
    if steps:
        print(f"decode: {steps} steps, {res.decode_ms:.2f} ms/token (median {res.decode_ms_median:.2f}), "
              f"{1e3 / res.decode_ms:.2f} tokens/s per sequence, {tps:.2f} tokens/s for the batch of {batch}")
    else:
        print("decode: no steps after the first token (--max-new-tokens 1)")
    print(f"peak GPU memory: {format_bytes(peak)}" if cuda else "peak GPU memory: - (CPU run)")
    print(f"KV cache: {format_bytes(host_kv)} in {host_kind}, {format_bytes(hbm_kv)} in HBM; "
          f"sequence lengths {seq_lengths}")
    texts = None
    if tok is not None:
        texts = tok.batch_decode(new, skip_special_tokens=True)
    for i in range(batch):
        shown = repr(texts[i]) if texts is not None else " ".join(map(str, new[i].tolist()))
        print(f"[{i}] {shown}")
    if ns.json:
        doc = {
            "command": "directkv-generate", "argv": list(sys.argv[1:] if argv is None else argv),
            "model": desc, "preset": ns.preset, "model_path": ns.model,
            "spec": {"layers": spec.num_layers, "q_heads": spec.num_q_heads, "kv_heads": spec.num_kv_heads,
                     "head_dim": spec.head_dim},
            "device": str(a.device), "gpu": torch.cuda.get_device_name(a.device) if cuda else "cpu",
            "dtype": str(a.dtype).removeprefix("torch."), "kv_dtype": str(cache.kv_dtype).removeprefix("torch."),
            "versions": versions(),
            "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "batch": int(batch), "prompt_len": int(prompt_len), "prompt_lens": [int(x) for x in lengths],
            "prompt_ids": input_ids.cpu().tolist() if input_ids.numel() <= PROMPT_IDS_IN_JSON else None,
            "max_new_tokens": ns.max_new_tokens, "page_size": ns.page_size, "hbm_budget": a.hbm_budget,
            "prefill_chunk": ns.prefill_chunk, "sample": ns.sample, "seed": ns.seed,
            "ttft_s": res.prefill_s, "prefill_forwards": res.prefill_forwards, "total_s": res.total_s,
            "decode_steps": steps, "decode_ms_per_token": res.decode_ms, "decode_ms_median": res.decode_ms_median,
            "decode_tokens_per_s": tps, "step_ms": res.step_ms,
            "peak_gpu_bytes": peak, "host_kv_bytes": host_kv, "hbm_kv_bytes": hbm_kv, "seq_lengths": seq_lengths,
            "kernels_compiled": compiled, "tokens": new.tolist(), "text": texts,
        }
        path = Path(ns.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"json: {path}")
    cache.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
