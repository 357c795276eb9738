"""``directkv-generate``: generate tokens with a Hugging Face model whose KV cache lives in pinned
host memory (``directkv_cute.hf.DirectKVCache``), and report the timings. ``--help`` is the user's
guide (``DESCRIPTION``); this docstring says how the timings are taken.

    directkv-generate --preset tiny --context 512 --max-new-tokens 16 --device cpu
    directkv-generate --preset llama3-8b --context 131072 --max-new-tokens 64 --hbm-budget 8GiB
    directkv-generate --model /path/to/Llama-3.1-8B-Instruct --prompt "Hello" --max-new-tokens 64

Everything a user can get wrong (numbers, sizes, the device, the model folder, the JSON path, a
request beyond the model's positions or the machine's memory) is checked before the model loads
and refused with one line on stderr and exit status 2; so is running out of memory while the
weights or the cache are allocated, or while generating.

How it is timed: ``model.generate`` runs everything, chunked prefill included
(``prefill_chunk_size``), and two observers watch it: a forward hook on the input embedding
counts the prompt tokens each prefill forward consumes (the prefill progress bar), and a
``LogitsProcessor`` (``StepClock``) is called once per generated token, right after that token's
forward pass: its first call marks the end of the prefill (the device is synchronized there: time
to first token), and every call records a CUDA event (a host timestamp on a CPU), so the
intervals between consecutive calls are the per-token decode times, with no synchronization
added to the decode loop (the decode progress bar advances on the same calls). Letting
``generate`` do the work, rather than driving prefill with our own forward calls and handing a
half-filled cache to ``generate``, keeps us on the path users run and off the input slicing that
changed between transformers releases (5.17's ``past_key_values`` / 5.24's ``cache``,
``next_sequence_length``); the same function times transformers' own caches in the end-to-end
bench (``bench/e2e.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from directkv_cute import presets
from directkv_cute.cache import page_bytes
from directkv_cute.kernels import jit
from directkv_cute.sparse import SparseBudget, parse_budget
from directkv_cute.version import __version__

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
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not a finite size")
    if value != int(value) and m.group(2).lower() in ("", "b"):
        raise ValueError(f"a size in bytes must be whole, got {text!r}")
    return int(value)


def format_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
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

    def __init__(self, device, on_first=None, on_step=None):
        self.cuda = torch.device(device).type == "cuda"
        self.events: list = []
        self.host: list[float] = []
        self.prefill_end: float | None = None
        self.on_first = on_first  # called once, at the first call (the prefill is over)
        self.on_step = on_step  # called at every call, after its timestamp

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
        if self.on_step is not None:
            self.on_step()
        return scores

    def step_ms(self) -> list[float]:
        """Per-token decode times in ms (call the device synchronized first)."""
        if self.cuda and len(self.events) > 1:
            return [a.elapsed_time(b) for a, b in zip(self.events, self.events[1:])]
        return [1e3 * (b - a) for a, b in zip(self.host, self.host[1:])]


def _bar(total: int, desc: str, delay: float):
    """A tqdm bar on stderr (None without tqdm). ``delay``: seconds before it appears (a phase
    that ends sooner never shows one)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="tok", dynamic_ncols=True, file=sys.stderr, delay=delay)


class _Progress:
    """Progress of one ``generate`` call: a forward hook on the input embedding counts the prompt
    tokens each prefill forward consumes, until the clock's first call (the first token); the
    clock's calls then count the generated tokens. With ``enabled``, a tqdm bar for each phase
    (the prefill in prompt tokens, the decode in new tokens), shown once the phase has run
    ``delay`` seconds."""

    def __init__(self, model, clock: StepClock, total: int, new_tokens: int, enabled: bool, device,
                 delay: float = 0.0):
        self.clock = clock
        clock.on_first = self.finish
        clock.on_step = self.step
        self.forwards = 0
        self.tokens = 0
        self._last = 0
        self.enabled = enabled
        self.delay = delay
        self.new_tokens = new_tokens
        self.bar = _bar(total, "prefill", delay) if enabled else None
        self.decode_bar = None
        self.cuda = torch.device(device).type == "cuda"
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
        """The prefill is over (the clock's first call, device synchronized): close its bar and
        open the decode's."""
        if self.bar is not None:
            self.bar.update(self._last)
            self.bar.close()
            self.bar = None
        if self.enabled and self.decode_bar is None and self.new_tokens > 1:
            self.decode_bar = _bar(self.new_tokens, "decode", self.delay)

    def step(self) -> None:
        """One generated token (every clock call, the first included)."""
        if self.decode_bar is not None:
            self.decode_bar.update(1)

    def close(self) -> None:
        self.handle.remove()
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.decode_bar is not None:
            self.decode_bar.close()
            self.decode_bar = None


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
                   pad_token_id: int | None = 0, progress: bool = False, progress_delay: float = 0.0,
                   return_cache: bool = False, **generate_kwargs) -> GenerateResult:
    """``model.generate`` with the prefill and every decode step timed (see the module docstring).

    ``cache``: a Cache object (passed under ``cache_kwargs``'s keyword) or None (transformers
    builds its own, ``cache_implementation`` e.g. "offloaded"). ``prefill_chunk``: tokens per
    prefill forward (``prefill_chunk_size``; None or >= the prompt: one forward). ``progress``:
    tqdm bars on stderr for the prefill and the decode, each shown once its phase has run
    ``progress_delay`` seconds."""
    from transformers import LogitsProcessorList

    device = input_ids.device
    prompt_len = int(input_ids.shape[1])
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    clock = StepClock(device)
    kwargs = dict(generate_kwargs)
    if cache is not None:
        # transformers is optional: this module, its parser and its checks import without it
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
    watcher = _Progress(model, clock, prompt_len, int(max_new_tokens), progress, device, progress_delay)
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
    return jit.cache_size()


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "directkv_cute": __version__}
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:
        out["transformers"] = None
    return out


# ---- the command ----------------------------------------------------------------------------
DESCRIPTION = """\
Generate tokens with a Hugging Face causal language model whose KV cache lives in pinned host
memory, read in place by the DirectKV GPU kernels, and report the time to first token, the
per-token decode time and where the KV cache lives.

The model: --model PATH, a local Hugging Face model folder (its config.json, weights and
tokenizer; nothing is downloaded), or --preset NAME, the shapes of a real model with random
weights built directly on the device ({presets}).

The prompt: --prompt TEXT (needs --model's tokenizer; repeat it for a batch, shorter prompts are
left-padded), or --context N random token ids per row for --batch rows.

The KV cache: pinned host memory sized for batch x (prompt + --max-new-tokens) tokens, in pages
of --page-size tokens. --hbm-budget (on a GPU) adds a tier in GPU memory that holds each
sequence's first --sink-pages pages and its most recent pages. --kv-dtype fp8 stores
float8_e4m3fn pages with per-token scales: half the bytes of bf16 per token over the link, read
in place by the FP8 GPU kernels (on a GPU, with a bf16 or fp16 model) and by the CPU reference
path; the model still computes in --dtype.

--device cpu runs the reference attention (float32 by default): slow, for checking results.
The request is checked before the model loads: its length against the model's
max_position_embeddings and its KV cache (and a preset's weights) against the machine's memory.
A mistake in the command line is one line on stderr and exit status 2.
"""

EPILOG = """\
examples:
  directkv-generate --preset tiny --context 512 --max-new-tokens 16 --device cpu
  directkv-generate --preset llama3-8b --context 131072 --max-new-tokens 64 --hbm-budget 8GiB
  directkv-generate --preset llama3-8b --context 32768 --batch 4 --kv-dtype fp8 --json run.json
  directkv-generate --model /path/to/Llama-3.1-8B-Instruct --prompt "Hello" --max-new-tokens 64
"""

MAX_SEED = 2**64 - 1  # torch's generators take seeds in [0, 2**64)
MAX_PAGE_ID = 2**31 - 1  # the cache's page tables hold int32 page ids
PAGE_SIZES = (16, 32, 64, 128)
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr (no usage block), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(str(message).split())}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="directkv-generate", description=DESCRIPTION.format(presets=", ".join(presets.preset_names())),
                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="PATH",
                     help="a local Hugging Face model folder: config.json, weights, tokenizer (nothing is downloaded)")
    src.add_argument("--preset", metavar="NAME",
                     help=f"a model of real shapes with random weights: {', '.join(presets.preset_names())} (the "
                          "names of directkv-tune's presets; also spelled as on the Hub, e.g. Meta-Llama-3-8B, "
                          "Qwen2.5-7B-Instruct)")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", action="append", metavar="TEXT",
                        help="prompt text (needs --model's tokenizer); give it several times for a batch")
    prompt.add_argument("--context", type=int, metavar="N",
                        help="N random prompt token ids per row (default 512 when there is no --prompt)")
    p.add_argument("--batch", type=int, default=None, metavar="B",
                   help="rows (default 1, or the number of --prompt; one --prompt is repeated B times)")
    p.add_argument("--max-new-tokens", type=int, default=32, metavar="N",
                   help="tokens to generate per row (default 32); the prompt plus these must stay within the "
                        "model's max_position_embeddings")
    p.add_argument("--hbm-budget", default="0", metavar="SIZE",
                   help="GPU memory for the cache's HBM tier, e.g. 8GiB, 512MiB, 4GB (default 0: every page in "
                        "pinned host memory; a CPU run has no HBM and takes only 0)")
    p.add_argument("--sparse-budget", default=None, metavar="BUDGET",
                   help="decode reads only each row's best pages: a fraction of the pages (1/8, 0.125) or a page "
                        "count (256p), chosen per layer from page summaries; prefill stays exact (default: exact)")
    p.add_argument("--page-size", type=int, default=64, choices=PAGE_SIZES, metavar="TOKENS",
                   help=f"tokens per cache page: {', '.join(map(str, PAGE_SIZES))} (default 64)")
    p.add_argument("--sink-pages", type=int, default=1, metavar="N",
                   help="with --hbm-budget: the first N pages of each sequence stay in HBM (default 1)")
    p.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK, metavar="TOKENS",
                   help=f"prompt tokens per prefill forward (default {DEFAULT_PREFILL_CHUNK}; 0: the whole prompt "
                        "in one forward)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                   help="model dtype (default bf16 on CUDA, fp32 on the CPU; fp32 only on the CPU)")
    p.add_argument("--kv-dtype", choices=("auto", "bf16", "fp16", "fp8"), default="auto",
                   help="K/V page dtype: auto (default: the model dtype; bf16 / fp16 name it and must match it) "
                        "or fp8: float8_e4m3fn pages with per-token scales, half the bytes of bf16, on the GPU "
                        "and the CPU")
    p.add_argument("--device", default=None,
                   help="cuda, cuda:N or cpu (default cuda if available, else cpu)")
    p.add_argument("--sample", action="store_true",
                   help="sample the next token (default greedy: the most likely token)")
    p.add_argument("--temperature", type=float, default=1.0, metavar="T",
                   help="with --sample: divide the logits by T > 0 (default 1.0)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="with --sample: sample from the smallest set of tokens whose probability reaches P, "
                        "0 < P <= 1 (default 1.0: all)")
    p.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="with --sample: sample from the K most likely tokens (default 0: all)")
    p.add_argument("--seed", type=int, default=0, metavar="S",
                   help=f"seeds a preset's weights, the random prompt and sampling, 0 <= S <= {MAX_SEED} "
                        "(default 0)")
    p.add_argument("--json", metavar="PATH",
                   help="write the measurements and tokens to PATH as JSON (replaced whole at the end of the run)")
    bars = p.add_mutually_exclusive_group()
    bars.add_argument("--progress", action="store_true",
                      help="always show the prefill and decode progress bars (default: when stderr is a "
                           "terminal, once a phase has run 2 s)")
    bars.add_argument("--no-progress", action="store_true", help="never show progress bars")
    return p


@dataclass
class _Args:
    device: torch.device
    dtype: torch.dtype
    hbm_budget: int
    kv_dtype: torch.dtype | None = None  # None: the model dtype
    json_path: Path | None = None
    sparse: SparseBudget | None = None  # None: exact decode


def _check_device(p: argparse.ArgumentParser, text: str | None) -> torch.device:
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError) as e:
        p.error(f"--device {text!r}: {e}")
    if device.type == "cpu":
        if device.index not in (None, 0):
            p.error(f"--device {text}: the CPU has no device index (use cpu)")
        return torch.device("cpu")
    if device.type != "cuda":
        p.error(f"--device {text!r}: only cuda, cuda:N and cpu are supported")
    if not torch.cuda.is_available():
        p.error(f"--device {text}, but torch.cuda.is_available() is False (use --device cpu)")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        p.error(f"--device {text}: this machine has {count} CUDA device{'s' if count != 1 else ''} "
                f"(cuda:0{f' to cuda:{count - 1}' if count > 1 else ''})")
    return device


def _check_json_path(p: argparse.ArgumentParser, text: str) -> Path:
    """The JSON record's path, refused now if the file could not be written there at the end:
    a folder, a path under a file, or a folder where no file can be created (probed by creating
    and removing a temporary file in the nearest existing folder)."""
    path = Path(text).expanduser()
    if not path.name or path.is_dir():
        p.error(f"--json {text}: is a folder (give a file name)")
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        p.error(f"--json {text}: {parent} is a file, not a folder")
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=".directkv-generate-", suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        p.error(f"--json {text}: cannot write in {parent}: {e.strerror or e}")
    return path


def check_args(p: argparse.ArgumentParser, ns: argparse.Namespace) -> _Args:
    """Command-line checks that need no model: ``p.error`` (one line, exit 2) on a bad value."""
    if ns.preset is not None:
        name = presets.canonical_name(ns.preset)  # any spelling of a preset: its one name from here on
        if name is None:
            p.error(f"unknown preset {ns.preset!r}; choose one of {', '.join(presets.preset_names())}")
        ns.preset = name
    if ns.prompt and ns.preset is not None:
        p.error("--prompt needs a tokenizer: use --model PATH, or --context N random tokens with a preset")
    if ns.dtype == "fp32" and ns.device and ns.device.startswith("cuda"):  # before touching a GPU
        p.error("--dtype fp32 runs only on the CPU reference path (the GPU kernels take bf16 / fp16)")
    for flag, value in (("--max-new-tokens", ns.max_new_tokens), ("--context", ns.context), ("--batch", ns.batch)):
        if value is not None and value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    for flag, value in (("--prefill-chunk", ns.prefill_chunk), ("--sink-pages", ns.sink_pages),
                        ("--top-k", ns.top_k)):
        if value < 0:
            p.error(f"{flag} must be >= 0, got {value}")
    if not 0 <= ns.seed <= MAX_SEED:
        p.error(f"--seed must be in [0, {MAX_SEED}] (2**64 - 1), got {ns.seed}")
    if not (math.isfinite(ns.temperature) and ns.temperature > 0):
        p.error(f"--temperature must be a finite number > 0, got {ns.temperature}")
    if not 0 < ns.top_p <= 1:
        p.error(f"--top-p must be in (0, 1], got {ns.top_p}")
    try:
        budget = parse_size(ns.hbm_budget)
    except ValueError as e:
        p.error(f"--hbm-budget: {e}")
    device = _check_device(p, ns.device)
    if budget and device.type == "cpu":  # before the config is read or anything is allocated
        p.error(_cpu_budget_refusal(ns.hbm_budget, budget))
    if ns.dtype == "fp32" and device.type == "cuda":
        p.error("--dtype fp32 runs only on the CPU reference path (the GPU kernels take bf16 / fp16)")
    dtype = DTYPES[ns.dtype] if ns.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    kv = ns.kv_dtype or "auto"
    kv_dtype = None
    if kv == "fp8":
        kv_dtype = torch.float8_e4m3fn
    elif kv != "auto" and DTYPES[kv] != dtype:
        p.error(f"--kv-dtype {kv} differs from the model dtype {str(dtype).removeprefix('torch.')}: pages hold "
                "the model dtype (auto) or fp8")
    json_path = _check_json_path(p, ns.json) if ns.json else None
    sparse = None
    if ns.sparse_budget is not None:
        try:
            sparse = parse_budget(ns.sparse_budget)
        except ValueError as e:
            p.error(f"--sparse-budget: {e}")
    return _Args(device=device, dtype=dtype, hbm_budget=budget, kv_dtype=kv_dtype, json_path=json_path,
                 sparse=sparse)


def _cpu_budget_refusal(text: str, budget: int) -> str:
    """Why a CPU run refuses ``--hbm-budget`` (nonzero): a CPU has no HBM, and the tier would be
    host memory taken for nothing (``budget`` bytes of it, reported as "in HBM")."""
    memory = host_memory()
    beyond = (f" is more than this machine's memory ({format_bytes(memory)}), and" if memory is not None
              and budget > memory else ":")
    return (f"--hbm-budget {text} ({format_bytes(budget)}){beyond} --device cpu has no HBM (the cache lives in "
            "host memory); leave --hbm-budget out (or 0), or run on a GPU (--device cuda)")


# ---- planning: everything checked before the model loads ---------------------------------
@dataclass
class _Plan:
    config: object  # the model's transformers config
    tok: object | None  # the folder's tokenizer (None for a preset, or a folder without one)
    batch: int
    prompt_len: int  # columns of the (left-padded) prompt
    encoded: tuple | None  # (input_ids, attention_mask) on the CPU for text prompts
    host_kv_bytes: int  # the cache's host tier
    device_kv_bytes: int  # the cache's HBM tier and write window (on the cache's device)
    weight_bytes: int | None  # the weights, estimated (None: unknown)


def host_memory() -> int | None:
    """Bytes of this machine's physical memory (None where the OS does not say). The requests
    refused against it cannot fit at all; free memory is not the bound, because a virtual
    machine may grow its memory as it is used (its reading starts low)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _load_config(p: argparse.ArgumentParser, ns: argparse.Namespace):
    """(config, tokenizer or None): the preset's, or the folder's, checked to be a HF model folder."""
    if ns.preset is not None:
        return presets.preset_config(ns.preset), None
    path = Path(ns.model).expanduser()
    if not path.exists():
        p.error(f"--model {ns.model}: no such folder (a local Hugging Face model folder is needed)")
    if not path.is_dir():
        p.error(f"--model {ns.model}: not a folder (a local Hugging Face model folder is needed)")
    if not (path / "config.json").is_file():
        p.error(f"--model {ns.model}: no config.json, not a Hugging Face model folder")
    if not any(any(path.glob(pattern)) for pattern in WEIGHT_FILES):
        p.error(f"--model {ns.model}: no weight files ({', '.join(WEIGHT_FILES)})")
    from transformers import AutoConfig, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable config is the folder's fault
        p.error(f"--model {ns.model}: cannot read config.json: {e}")
    tok = None
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - a model folder without a tokenizer still runs on --context
        if ns.prompt:
            p.error(f"--model {ns.model}: cannot load its tokenizer for --prompt: {e}")
    return config, tok


def _encode(p: argparse.ArgumentParser, ns: argparse.Namespace, tok) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded text prompts: (input_ids, attention_mask) on the CPU. One prompt for --batch
    rows is encoded once and expanded (a view: the batch is sized before anything is copied)."""
    prompts = list(ns.prompt)
    if ns.batch and len(prompts) != 1 and ns.batch != len(prompts):
        p.error(f"--batch {ns.batch} with {len(prompts)} prompts (give one prompt, or as many as rows)")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.convert_ids_to_tokens(0)
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    if ids.shape[1] == 0:
        p.error("--prompt: the prompts encode to no tokens")
    if ns.batch and len(prompts) == 1:
        ids, mask = ids.expand(ns.batch, -1), mask.expand(ns.batch, -1)
    return ids, mask


def _estimate_weight_bytes(ns: argparse.Namespace, config, dtype: torch.dtype) -> int | None:
    """A preset's weights in ``dtype`` (counted on the meta device: nothing is allocated); a
    folder's weight files as stored."""
    if ns.preset is not None:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, **dtype_kwargs(dtype))
        return presets.weight_bytes(model.to(dtype=dtype))
    path = Path(ns.model).expanduser()
    return sum(f.stat().st_size for pattern in WEIGHT_FILES for f in path.glob(pattern) if f.is_file())


def plan_run(p: argparse.ArgumentParser, ns: argparse.Namespace, a: _Args) -> _Plan:
    """Read the model's config (and tokenizer), size the request and refuse it (``p.error``)
    when it cannot run: the prompt plus the new tokens beyond the model's positions, a model the
    DirectKV attention does not support, a KV cache beyond the int32 page ids, or the KV cache
    and weights beyond the machine's memory or the GPU's free memory. Nothing large is allocated."""
    # transformers is optional: loaded once a model is sized, after the argument checks
    import directkv_cute.hf as dkhf
    from directkv_cute.hf.step_plan import cache_pages  # also loads transformers, through directkv_cute.hf

    config, tok = _load_config(p, ns)
    encoded = None
    if ns.prompt:
        encoded = _encode(p, ns, tok)
        batch, prompt_len = (int(x) for x in encoded[0].shape)
    else:
        batch, prompt_len = ns.batch or 1, ns.context or 512
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    positions = getattr(text, "max_position_embeddings", None)
    total = prompt_len + ns.max_new_tokens
    if positions is not None and total > positions:
        p.error(f"the prompt ({prompt_len} tokens) + --max-new-tokens {ns.max_new_tokens} = {total} tokens, "
                f"beyond the model's max_position_embeddings {positions}")
    try:
        spec = dkhf.model_spec(config)
    except dkhf.UnsupportedModelError as e:
        p.error(str(e))
    page_dtype = a.kv_dtype or a.dtype
    one = page_bytes(spec.num_layers, spec.num_kv_heads, ns.page_size, spec.head_dim, page_dtype)
    ps = ns.page_size
    pages = cache_pages(batch * total, batch, ps, one, a.hbm_budget)  # what DirectKVCache will allocate
    host_pages, hbm_pages, window_pages = pages.host, pages.hbm, pages.window
    rows = f"{batch} x ({prompt_len} + {ns.max_new_tokens}) tokens"
    if host_pages > MAX_PAGE_ID or hbm_pages + window_pages > MAX_PAGE_ID:
        p.error(f"a KV cache for {rows} needs more than {MAX_PAGE_ID} pages of {ps} tokens (int32 page ids); "
                "lower --batch, --context or --max-new-tokens, or raise --page-size")
    host_kv, device_kv = host_pages * one, (hbm_pages + window_pages) * one
    weights = _estimate_weight_bytes(ns, config, a.dtype)
    memory = host_memory()
    if a.device.type == "cuda":
        free, total_gpu = torch.cuda.mem_get_info(a.device)
        if a.hbm_budget > total_gpu:
            p.error(f"--hbm-budget {ns.hbm_budget} ({format_bytes(a.hbm_budget)}) is more than the memory of "
                    f"{a.device} ({format_bytes(total_gpu)})")
        need_gpu = device_kv + (weights or 0)
        if need_gpu > free:
            p.error(f"the weights ({format_bytes(weights)}) and the cache's HBM tier and window "
                    f"({format_bytes(device_kv)}) need {format_bytes(need_gpu)} of GPU memory, {a.device} has "
                    f"{format_bytes(free)} free")
        if memory is not None and host_kv > memory:
            p.error(f"a KV cache for {rows} needs {format_bytes(host_kv)} ({host_kv} bytes) of pinned host memory, "
                    f"this machine has {format_bytes(memory)}")
    elif memory is not None:  # (a CPU run has no HBM tier: check_args refused a budget)
        need = host_kv + device_kv + (weights or 0)
        if need > memory:
            p.error(f"{rows} need {format_bytes(need)} ({need} bytes) of host memory on the CPU (KV cache "
                    f"{format_bytes(host_kv + device_kv)}, weights {format_bytes(weights)}), this machine has "
                    f"{format_bytes(memory)}")
    return _Plan(config=config, tok=tok, batch=batch, prompt_len=prompt_len, encoded=encoded, host_kv_bytes=host_kv,
                 device_kv_bytes=device_kv, weight_bytes=weights)


# ---- running ------------------------------------------------------------------------------
_OOM_ERRORS = tuple(e for e in (MemoryError, getattr(torch, "OutOfMemoryError", None),
                                getattr(torch.cuda, "OutOfMemoryError", None)) if e is not None)


def _is_oom(e: BaseException) -> bool:
    """An allocation failed: MemoryError, torch's OutOfMemoryError, or the RuntimeError of torch's
    CPU allocator ("can't allocate memory: you tried to allocate N bytes")."""
    if isinstance(e, _OOM_ERRORS):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and ("out of memory" in text or "can't allocate" in text
                                            or "cannot allocate" in text or "tried to allocate" in text)


def _oom_line(what: str, e: BaseException) -> str:
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
    return f"out of memory {what}: {first}"


def _load_model(ns, a: _Args, plan: _Plan):
    """(model, description)."""
    import directkv_cute.hf as dkhf  # transformers is optional: loaded once a model is built

    if ns.preset is not None:
        model = presets.build_random_model(plan.config, a.dtype, a.device, seed=ns.seed,
                                           attn_implementation=dkhf.ATTN_IMPLEMENTATION)
        return model, f"preset {ns.preset} (random weights, seed {ns.seed})"
    from transformers import AutoModelForCausalLM

    path = Path(ns.model).expanduser()
    kw = dict(local_files_only=True, attn_implementation=dkhf.ATTN_IMPLEMENTATION, **dtype_kwargs(a.dtype))
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), device_map=str(a.device), **kw)
    except (ImportError, ValueError) as e:
        if "device_map" not in str(e) and "accelerate" not in str(e).lower():
            raise
        model = AutoModelForCausalLM.from_pretrained(str(path), **kw).to(a.device)
    model.eval()
    return model, f"{path}"


def _model_error(ns, e: BaseException) -> str | None:
    """The one-line refusal of a model folder transformers cannot load (unreadable or mismatched
    weights, an unknown architecture); None for a preset, whose failure is a bug."""
    if ns.model is None:
        return None
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
    return f"--model {ns.model}: cannot load the model: {type(e).__name__}: {first}"


def _write_json(path: Path, doc: dict) -> None:
    """Replace ``path`` whole: write a temporary file beside it, then rename it over."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    ns = p.parse_args(argv)
    a = check_args(p, ns)
    plan = plan_run(p, ns, a)
    # transformers is optional: loaded once the arguments are checked and the run is sized
    from directkv_cute.hf import CacheCapacityError, DirectKVCache, UnsupportedModelError, model_spec

    torch.manual_seed(ns.seed)
    cuda = a.device.type == "cuda"
    t_load = time.perf_counter()
    try:
        model, desc = _load_model(ns, a, plan)
    except Exception as e:
        if not _is_oom(e):
            if _model_error(ns, e) is None:
                raise
            p.error(_model_error(ns, e))
        p.error(_oom_line(f"loading the weights (about {format_bytes(plan.weight_bytes)}) onto {a.device}", e))
    tok = plan.tok
    if plan.encoded is not None:
        input_ids, mask = (t.contiguous().to(a.device) for t in plan.encoded)
    else:
        vocab = (model.config.get_text_config() if hasattr(model.config, "get_text_config")
                 else model.config).vocab_size
        ids = random_prompt(plan.batch, plan.prompt_len, vocab, ns.seed)
        input_ids, mask = ids.to(a.device), torch.ones_like(ids).to(a.device)
    load_s = time.perf_counter() - t_load
    spec = model_spec(model.config)
    batch, prompt_len = input_ids.shape
    lengths = mask.sum(dim=1).tolist()
    params = sum(t.numel() for t in model.parameters())
    size = f"{params / 1e9:.2f}B" if params >= 1e8 else f"{params / 1e6:.1f}M"
    print(f"model: {desc}: {spec.num_layers} layers, {spec.num_q_heads}/{spec.num_kv_heads} heads, head_dim "
          f"{spec.head_dim}, {size} parameters, {str(a.dtype).removeprefix('torch.')} on {a.device} "
          f"(loaded in {load_s:.1f} s)", flush=True)
    host_kind = "pinned host memory" if cuda else "host memory"
    pages_per_row = -(-(prompt_len + ns.max_new_tokens) // ns.page_size)
    try:
        cache = DirectKVCache(model, max_tokens=batch * (prompt_len + ns.max_new_tokens), max_batch_size=batch,
                              page_size=ns.page_size, hbm_budget=a.hbm_budget,
                              sink_pages=min(ns.sink_pages, pages_per_row), dtype=a.dtype, device=a.device,
                              kv_dtype=a.kv_dtype, sparse=a.sparse)
        cache.check_request(lengths, ns.max_new_tokens)
    except (CacheCapacityError, UnsupportedModelError, ValueError, TypeError) as e:
        p.error(str(e))
    except Exception as e:
        if not _is_oom(e):
            raise
        p.error(_oom_line(f"allocating the KV cache ({format_bytes(plan.host_kv_bytes)} of {host_kind}, "
                          f"{format_bytes(plan.device_kv_bytes)} on {a.device})", e))
    print(f"prompt: {batch} x {prompt_len} tokens ({'text' if ns.prompt else 'random ids'}); cache: "
          f"{'host only' if not a.hbm_budget else 'HBM budget ' + format_bytes(a.hbm_budget)}, page {ns.page_size}, "
          f"{str(cache.kv_dtype).removeprefix('torch.')} pages, "
          f"{format_bytes(cache.kv.num_pages('host') * cache.kv.page_bytes)} of {host_kind} reserved", flush=True)
    if cuda:
        torch.cuda.reset_peak_memory_stats(a.device)
    compiled_before = kernels_compiled()
    pad = (tok.pad_token_id if tok is not None and tok.pad_token_id is not None else 0)
    progress = not ns.no_progress and (ns.progress or sys.stderr.isatty())
    try:
        res = timed_generate(model, input_ids, mask, max_new_tokens=ns.max_new_tokens, cache=cache,
                             prefill_chunk=ns.prefill_chunk or None, do_sample=ns.sample,
                             temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, pad_token_id=pad,
                             progress=progress, progress_delay=0.0 if ns.progress else 2.0)
    except Exception as e:
        if not _is_oom(e):
            raise
        cache.close()
        p.error(_oom_line(f"while generating ({batch} x {prompt_len} prompt tokens, prefill chunk "
                          f"{ns.prefill_chunk or prompt_len}; a smaller --prefill-chunk or --batch needs less)", e))
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
    rc = 0
    if a.json_path is not None:
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
            "sparse_budget": None if a.sparse is None else str(a.sparse),
            "prefill_chunk": ns.prefill_chunk, "sample": ns.sample, "seed": ns.seed,
            "ttft_s": res.prefill_s, "prefill_forwards": res.prefill_forwards, "total_s": res.total_s,
            "decode_steps": steps, "decode_ms_per_token": res.decode_ms, "decode_ms_median": res.decode_ms_median,
            "decode_tokens_per_s": tps, "step_ms": res.step_ms,
            "peak_gpu_bytes": peak, "host_kv_bytes": host_kv, "hbm_kv_bytes": hbm_kv, "seq_lengths": seq_lengths,
            "kernels_compiled": compiled, "tokens": new.tolist(), "text": texts,
        }
        try:
            _write_json(a.json_path, doc)
            print(f"json: {a.json_path}")
        except OSError as e:  # the folder changed during the run: keep the record elsewhere
            fd, spare = tempfile.mkstemp(prefix="directkv-generate-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(doc, indent=1) + "\n")
            print(f"directkv-generate: cannot write --json {a.json_path} ({e.strerror or e}); the record is in "
                  f"{spare}", file=sys.stderr)
            rc = 1
    cache.close()
    return rc


if __name__ == "__main__":
    sys.exit(main())
