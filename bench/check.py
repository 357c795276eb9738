"""``python -m bench check``: the GPU-free part of the regression bench (what CI runs).

(a) profiles: every shipped profile (``directkv_cute.tuning.profiles``, lazily imported; no
    module or no profile yet is a pass) loads and validates, and every entry's config is legal
    for its shape;
(b) compile: every heuristic default config (head_dim 64/128 x rows 8/16/64/128 x page
    16..128, a float16 spot check), the multi-token defaults, the multi_token tuner's portfolio and
    every profile entry compiles for sm_90a through ``compile_decode`` (with and without split
    outputs when the compiler takes ``split_out``), plus the combine kernels; each distinct kernel
    (the compiler's cache key) is compiled once and counted once; (b2) the Q-tiled kernel's default
    and every q_tiled profile entry in each variant the op launches; (b3) the FP8 decode kernel and
    the FP8 dequant kernel;
(c) traffic: the host-traffic model reads every host KV byte exactly once (bench.traffic), and a
    model's steps through the HBM window read only the history's full pages from the host.

The output is a summary: one line per part, every failure in full; ``--verbose`` adds the
profile notes, every compiled kernel with its time and the traffic table. Exit status 1 if any
part fails.
"""

from __future__ import annotations

import inspect
import os
import sys
import time
import warnings
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from bench.common import dtype_name, progress_bar, torch_dtype
from directkv_cute.kernels import specs
from directkv_cute.config import (
    SUPPORTED_HEAD_DIMS,
    SUPPORTED_PAGE_SIZES,
    DecodeConfig,
    default_decode_config,
    default_multi_token_config,
)

# rows (GQA group x q_len) -> (group, max_q_len) compiled for it: decode with group 8,
# speculative / chunked windows with groups 4 and 8, two consumer warpgroups at 128 rows.
ROWS = {8: (8, 1), 16: (4, 4), 64: (8, 8), 128: (4, 32)}
FP16_SPOT_CHECK = ((64, 8), (64, 128))  # (page size, rows) also compiled in float16


class CheckError(RuntimeError):
    """A part of the check cannot run at all (e.g. the kernel module does not import)."""


@dataclass(frozen=True)
class CompileTarget:
    cfg: DecodeConfig
    dtype: str
    head_dim: int
    page_size: int
    group: int
    max_q_len: int
    source: str
    kernel: str = "decode"  # the kernel spec's name: "decode" (streaming) or "multi_token"

    @property
    def multi_token(self) -> bool:
        """Whether ``compile_decode`` builds the multi-token kernel for it (its ``multi_token=``)."""
        return self.kernel == "multi_token"

    @property
    def label(self) -> str:
        """Where the target comes from, its shape and every config field off the default."""
        kind = "multi-token" if self.multi_token else f"decode q{self.max_q_len}"
        base = DecodeConfig()
        fields = " ".join(f"{f.name}={getattr(self.cfg, f.name)}" for f in dataclasses.fields(self.cfg)
                          if getattr(self.cfg, f.name) != getattr(base, f.name))
        return (f"{self.source}: {self.dtype} d{self.head_dim} page{self.page_size} group{self.group} {kind}"
                + (f" {fields}" if fields else ""))


@dataclass
class PartResult:
    name: str
    ok: bool
    summary: str


# ---- (a) profiles --------------------------------------------------------------------------
def _profiles_module():
    try:
        from directkv_cute.tuning import profiles
    except ImportError:
        return None
    return profiles


def load_shipped_profiles(profile_dir: str | Path | None = None) -> tuple[list[str], list, list[str]]:
    """(messages, [(path, Profile)], problems) for the shipped profiles."""
    mod = _profiles_module()
    if mod is None:
        return ["directkv_cute.tuning.profiles does not exist yet: nothing to validate (pass)"], [], []
    needed = ("bundled_profile_dir", "list_profiles", "load_profile")
    lacking = [n for n in needed if not hasattr(mod, n)]
    if lacking:
        return [], [], [f"directkv_cute.tuning.profiles lacks {lacking}: the check cannot read profiles"]
    directory = Path(profile_dir) if profile_dir else Path(mod.bundled_profile_dir())
    paths = mod.list_profiles(directory)
    if not paths:
        return [f"no profiles in {directory} yet (pass)"], [], []
    msgs, loaded, problems = [], [], []
    for path in paths:
        try:
            with warnings.catch_warnings(record=True):
                warnings.simplefilter("always")
                prof = mod.load_profile(path)
        except Exception as e:  # noqa: BLE001 - any failure to load is a failed validation
            problems.append(f"{path.name}: {type(e).__name__}: {e}")
            continue
        loaded.append((path, prof))
        stale = _stale_count(prof)
        msgs.append(f"{path.name}: valid, {len(prof)} buckets" + (
            f" (WARNING: {stale} tuned for other kernel sources, used while legal; re-tune on the GPU)"
            if stale else ""))
        problems += [f"{path.name}: {p}" for p in profile_legality_problems(prof)]
    return msgs, loaded, problems


def _stale_count(prof) -> int:
    try:
        return len(prof.stale())
    except Exception:  # noqa: BLE001 - staleness is a warning only
        return 0


# The kernels over host pages whose profile entries compile through compile_decode.
PAGED_KERNELS = ("decode", "multi_token")


def profile_targets(loaded, kernels=PAGED_KERNELS) -> list[CompileTarget]:
    """Compile targets for the ``kernels`` entries (decode and multi_token) of loaded profiles."""
    out = []
    for path, prof in loaded:
        for class_key, bucket, rec in prof.records():
            kernel, dtype, head_dim, group, page_size = class_key
            if kernel not in kernels:
                continue
            q_len = bucket[2] if len(bucket) > 2 else 1
            cfg = specs.get(kernel).config_class.from_dict(rec["config"])
            out.append(CompileTarget(cfg, dtype_name(str(dtype)), int(head_dim), int(page_size), int(group),
                                     1 if kernel == "multi_token" else int(q_len), f"{path.name}", kernel=kernel))
    return out


def profile_legality_problems(prof) -> list[str]:
    """Static legality of each entry's config for its shape: its kernel spec's rules (the
    config's own and the kernel's on the GQA group and query rows)."""
    problems = []
    for class_key, bucket, rec in prof.records():
        kernel, dtype, head_dim, group, page_size = class_key
        if kernel not in (*PAGED_KERNELS, "decode_fp8", "q_tiled"):
            continue
        spec = specs.get(kernel)
        cfg = spec.config_class.from_dict(rec["config"])
        q_len = bucket[2] if len(bucket) > 2 else 1
        if kernel == "decode_fp8":  # its config rule is the FP8 one (fp8.decode_problems)
            from directkv_cute.fp8 import decode_problems

            issues = decode_problems(cfg, int(head_dim), int(page_size)) + spec.shape_problems(cfg, int(group),
                                                                                                int(q_len))
        else:  # the multi-token and Q-tiled kernels hold any number of query tokens
            issues = spec.problems(cfg, int(head_dim), int(page_size), group=int(group),
                                   q_len=int(q_len) if kernel == "decode" else 1)
        if issues:
            problems.append(f"{class_key} {bucket}: " + "; ".join(issues))
    return problems


# ---- (b) compile ---------------------------------------------------------------------------
def default_targets(dtypes=("bfloat16",)) -> list[CompileTarget]:
    """The heuristic default of every (head_dim, rows, page size), in bf16; a float16 spot check."""
    out = []
    for dtype in dtypes:
        for d in SUPPORTED_HEAD_DIMS:
            for rows, (group, q_len) in ROWS.items():
                for page in SUPPORTED_PAGE_SIZES:
                    if dtype != "bfloat16" and (page, rows) not in FP16_SPOT_CHECK:
                        continue
                    cfg = default_decode_config(d, rows, page)
                    out.append(CompileTarget(cfg, dtype, d, page, group, q_len, "default"))
            # The multi-token kernel's default, GQA 4 and 8.
            for group in (4, 8):
                out.append(CompileTarget(default_multi_token_config(d), dtype, d, 64, group, 1, "default",
                                         kernel="multi_token"))
    return out


def portfolio_targets() -> list[CompileTarget]:
    """The multi_token tuner's portfolio (the configs it tries right after the default), bf16, d 128,
    GQA 4: they must compile wherever the tuner may pick them."""
    from directkv_cute.tuning.space import TuneShape, get_space

    space = get_space("multi_token")
    shape = TuneShape(32, 8, 128, batch=1, context=32768, q_len=512)
    return [CompileTarget(cfg, "bfloat16", 128, 64, 4, 1, "portfolio", kernel="multi_token")
            for cfg in space.portfolio(shape)]


def resolve_compiler() -> tuple[Callable, Callable | None, Callable | None]:
    """(compile_decode, compile_combine, decode_key): the compile and key functions the kernel
    specs name (``directkv_cute.kernels.specs``: the streaming and the multi-token kernel share
    ``compile_decode``, its ``multi_token=`` picking the second). ``decode_key`` is the compiler's
    cache key (two requests with the same key get the same kernel). Raises CheckError if they do
    not import.
    """
    decode, combine = specs.get("decode"), specs.get("combine")
    try:
        return decode.compile_fn, combine.compile_fn, decode.key_fn
    except Exception as e:  # noqa: BLE001 - report why the kernels do not import
        raise CheckError(f"the decode kernel cannot be compiled: {decode.compile}: {type(e).__name__}: {e}") from e


def ensure_arch() -> str:
    """Compile for sm_90a without a GPU: set CUTE_DSL_ARCH if it is unset and there is no GPU."""
    if not os.environ.get("CUTE_DSL_ARCH") and not torch.cuda.is_available():
        os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    return os.environ.get("CUTE_DSL_ARCH", "(current GPU)")


@dataclass
class CompileJob:
    """One distinct kernel: the first target that asks for it (and how many others do too)."""
    target: CompileTarget | None  # None: the combine kernel
    split: bool | None
    head_dim: int = 0
    dtype: str = ""
    seconds: float = 0.0
    error: str | None = None

    @property
    def label(self) -> str:
        if self.target is None:
            return f"combine: {self.dtype} d{self.head_dim}"
        return self.target.label + ("" if self.split is None or self.target.multi_token else f" split_out={self.split}")


def _error_line(e: Exception) -> str:
    """A compile failure in one line: its type and the first 300 characters of its first line."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}"


def compile_jobs(targets: list[CompileTarget], key_fn: Callable | None = None,
                 has_split: bool = True) -> list[CompileJob]:
    """The distinct kernels ``targets`` need (by the compiler's ``key_fn`` where it has one), then
    one combine kernel per head dim and dtype."""
    jobs, seen = [], set()
    for t in targets:
        for split in ((True,) if t.multi_token else (True, False)) if has_split else (None,):
            if key_fn is not None:
                key = key_fn(t.cfg, torch_dtype(t.dtype), t.head_dim, t.page_size, t.group, bool(split),
                             multi_token=t.multi_token)
            else:
                key = (t.cfg, t.dtype, t.head_dim, t.page_size, t.group, t.max_q_len, split, t.multi_token)
            if key not in seen:
                seen.add(key)
                jobs.append(CompileJob(t, split))
    for d in SUPPORTED_HEAD_DIMS:
        for dtype in sorted({t.dtype for t in targets}):
            jobs.append(CompileJob(None, None, d, dtype))
    return jobs


def _progress(jobs: list, enabled: bool):
    """A progress bar on a terminal; in a log (CI) a line at each quarter instead of one
    carriage-return line of every update."""
    if not enabled:
        return jobs
    if sys.stderr.isatty():
        return progress_bar(jobs, True, "compile", "kernel")

    def quarters():
        t0, marks = time.perf_counter(), {len(jobs) * q // 4 for q in (1, 2, 3)} - {0}
        for i, job in enumerate(jobs, 1):
            yield job
            if i in marks:
                print(f"  {i}/{len(jobs)} kernels, {time.perf_counter() - t0:.0f} s", flush=True)
    return quarters()


def compile_targets(targets: list[CompileTarget], progress: bool = True) -> tuple[list[CompileJob], list[str]]:
    """Compile every distinct kernel ``targets`` need; returns (jobs with their times and errors,
    problems)."""
    compile_decode, compile_combine, key_fn = resolve_compiler()
    has_split = "split_out" in inspect.signature(compile_decode).parameters
    jobs = compile_jobs(targets, key_fn, has_split)
    if compile_combine is None:
        jobs = [j for j in jobs if j.target is not None]
    for job in _progress(jobs, progress):
        t0 = time.perf_counter()
        try:
            if job.target is None:
                compile_combine(job.head_dim, torch_dtype(job.dtype))
            else:
                t = job.target
                kwargs = {} if job.split is None else {"split_out": job.split}
                if t.multi_token:
                    kwargs["multi_token"] = True
                compile_decode(t.cfg, torch_dtype(t.dtype), t.head_dim, t.page_size, t.group, t.max_q_len, **kwargs)
        except Exception as e:  # noqa: BLE001 - a config that stops compiling is what CI must catch
            job.error = _error_line(e)
        job.seconds = time.perf_counter() - t0
    return jobs, [f"{j.label}: {j.error}" for j in jobs if j.error]


# ---- (b2) the Q-tiled kernel -------------------------------------------------------------------
# The op's untuned QTiledConfig() (where no profile entry serves a call): every variant it can route
# to, for the presets' page sizes and GQA groups; then every q_tiled profile entry's config for its
# own class, in every variant. (wait_ready, fold): all-HBM (no, no); staged in KV splits folded
# in the kernel (yes, yes) or in one split (yes, no); staged calls of one query tile (decode) also as
# ``QTiledConfig.for_query_tiles(1)`` runs them.
Q_TILED_VARIANTS = specs.Q_TILED_VARIANTS
Q_TILED_PAGES = (16, 64)
Q_TILED_GROUPS = (1, 4, 8)


def q_tiled_targets(loaded=()) -> list[tuple]:
    """(config, dtype, head_dim, page, group, wait_ready, fold, source) of every Q-tiled kernel
    to compile: the default's (source "default"), then the q_tiled entries of the ``loaded``
    profiles (source: the file's name)."""
    QTiledConfig = specs.get("q_tiled").config_class
    out = [(QTiledConfig(), "bfloat16", d, page, g, wr, so, "default") for d in SUPPORTED_HEAD_DIMS
           for page in Q_TILED_PAGES for g in Q_TILED_GROUPS for wr, so in Q_TILED_VARIANTS]
    one_tile = QTiledConfig().for_query_tiles(1)
    out += [(one_tile, *t[1:]) for t in out if t[5] and one_tile != t[0]]
    for path, prof in loaded:
        for (kernel, dtype, head_dim, group, page_size), _bucket, rec in prof.records():
            if kernel != "q_tiled":
                continue
            cfg = QTiledConfig.from_dict(rec["config"])
            mine = [(cfg, dtype_name(str(dtype)), int(head_dim), int(page_size), int(group), wr, so, path.name)
                    for wr, so in Q_TILED_VARIANTS]
            one_tile = cfg.for_query_tiles(1)
            out += mine + [(one_tile, *t[1:]) for t in mine if t[5] and one_tile != cfg]
    return out


def resolve_q_tiled() -> Callable:
    return specs.get("q_tiled").compile_fn


def compile_q_tiled_targets(progress: bool = True, loaded=()) -> tuple[int, list[str]]:
    """Compile every distinct Q-tiled kernel of ``q_tiled_targets(loaded)`` (the compiler's key:
    profile entries that are the default, or one another, once); returns (kernels, problems)."""
    spec = specs.get("q_tiled")
    compile_q_tiled = resolve_q_tiled()
    seen, jobs = set(), []
    for t in q_tiled_targets(loaded):
        cfg, dtype, d, page, g, wr, so, _source = t
        key = spec.key_fn(cfg, torch_dtype(dtype), d, page, g, wr, so)
        if key not in seen:
            seen.add(key)
            jobs.append(t)
    problems = []
    for cfg, dtype, d, page, g, wr, so, source in _progress(jobs, progress):
        try:
            compile_q_tiled(cfg, torch_dtype(dtype), d, page, g, wr, so)
        except Exception as e:  # noqa: BLE001 - a kernel that stops compiling is what CI must catch
            where = "" if source == "default" else f" ({source}) {cfg}"
            problems.append(f"q_tiled {dtype} d{d} page{page} group{g} wait_ready={wr} fold={so}{where}: "
                            f"{_error_line(e)}")
    return len(jobs), problems


# ---- (b3) the streaming kernel over FP8 pages -------------------------------------------------
def fp8_targets(loaded) -> list[tuple]:
    """(config, dtype, kv dtype, head_dim, page, group, q_len, source) of every FP8 decode kernel the
    op can build: the heuristic default of every (head_dim, rows, page size) and every decode entry
    of the shipped profiles, each as the op adapts it (``fp8.decode_config``), e4m3 pages; an e5m2
    spot check."""
    from directkv_cute.fp8 import decode_config

    out = []
    for d in SUPPORTED_HEAD_DIMS:
        for rows, (group, q_len) in ROWS.items():
            for page in SUPPORTED_PAGE_SIZES:
                cfg = decode_config(default_decode_config(d, rows, page), d, page)
                out.append((cfg, "bfloat16", "float8_e4m3fn", d, page, group, q_len, "default"))
    out.append((decode_config(default_decode_config(128, 8, 64), 128, 64), "bfloat16", "float8_e5m2", 128, 64, 8, 1,
                "default"))
    for t in profile_targets(loaded, ("decode", "decode_fp8")):  # the FP8 kernel's own entries as they are
        cfg = decode_config(t.cfg, t.head_dim, t.page_size) if t.kernel == "decode" else t.cfg
        out.append((cfg, t.dtype, "float8_e4m3fn", t.head_dim, t.page_size, t.group, t.max_q_len, t.source))
    return out


def compile_fp8_targets(loaded, progress: bool = True) -> tuple[int, list[str]]:
    """Compile every distinct FP8 decode kernel of ``fp8_targets`` (split partials); returns
    (kernels, problems)."""
    spec = specs.get("decode_fp8")
    seen, jobs, problems = set(), [], []
    for cfg, dtype, kv, d, page, group, q_len, source in fp8_targets(loaded):
        key = spec.key_fn(cfg, torch_dtype(dtype), getattr(torch, kv), d, page, group, True)
        if key not in seen:
            seen.add(key)
            jobs.append((cfg, dtype, kv, d, page, group, q_len, source))
    for cfg, dtype, kv, d, page, group, q_len, source in _progress(jobs, progress):
        try:
            spec.compile_fn(cfg, torch_dtype(dtype), getattr(torch, kv), d, page, group, q_len, True)
        except Exception as e:  # noqa: BLE001 - a kernel that stops compiling is what CI must catch
            problems.append(f"decode_fp8 {kv} {dtype} d{d} page{page} group{group} q{q_len} ({source}) {cfg}: "
                            f"{_error_line(e)}")
    deq = dequant_targets()
    compile_dequant = specs.get("dequant").compile_fn
    for kv, dtype, d, page in _progress(deq, progress):
        try:
            compile_dequant(getattr(torch, kv), torch_dtype(dtype), d, page)
        except Exception as e:  # noqa: BLE001 - as above
            problems.append(f"dequant {kv} {dtype} d{d} page{page}: {_error_line(e)}")
    return len(jobs) + len(deq), problems


def dequant_targets() -> list[tuple]:
    """(kv dtype, dtype, head_dim, page) of every kernel that dequantizes staged FP8 pages for
    multi-token calls: both FP8 formats, both 16-bit dtypes, every supported head dim and page."""
    return [(kv, dtype, d, page) for kv in ("float8_e4m3fn", "float8_e5m2") for dtype in ("bfloat16", "float16")
            for d in SUPPORTED_HEAD_DIMS for page in SUPPORTED_PAGE_SIZES]


def format_compile_table(jobs: list[CompileJob]) -> str:
    width = max([len(j.label) for j in jobs] + [6])
    lines = [f"{'kernel':<{width}} {'sec':>6}  result"]
    for j in jobs:
        lines.append(f"{j.label:<{width}} {j.seconds:6.2f}  {'ok' if j.error is None else 'FAIL ' + j.error}")
    return "\n".join(lines)


def _count(items, what: str) -> str:
    return f"{items} {what}" + ("" if items == 1 else "s")


# ---- driver --------------------------------------------------------------------------------
def run_check(*, profiles: bool = True, compile: bool = True, traffic: bool = True, profile_dir=None,
              fp16: bool = True, progress: bool = True, verbose: bool = False, q_tiled: bool = True,
              fp8: bool = True) -> int:
    """Run the selected parts, print a summary of each (every failure in full; ``verbose``: the
    long lists too); 0 if all pass, else 1."""
    results: list[PartResult] = []
    loaded = []
    if profiles:
        msgs, loaded, problems = load_shipped_profiles(profile_dir)
        buckets = sum(len(prof) for _, prof in loaded)
        summary = f"{_count(len(loaded), 'file')}, {_count(buckets, 'bucket')}, {_count(len(problems), 'problem')}"
        print(f"== (a) profiles: {summary}")
        stale = [m for m in msgs if "WARNING" in m]
        for m in msgs if verbose or not loaded else stale:
            print(f"  {m}")
        for p in problems:
            print(f"FAIL {p}")
        results.append(PartResult("profiles", not problems, summary))
    if compile:
        arch = ensure_arch()
        targets = (default_targets(("bfloat16", "float16") if fp16 else ("bfloat16",)) + portfolio_targets()
                   + profile_targets(loaded))
        sources = {}
        for t in targets:
            sources[t.source] = sources.get(t.source, 0) + 1
        print(f"== (b) compile for {arch}: {_count(len(targets), 'config')} ("
              + ", ".join(f"{n} {src}" for src, n in sources.items()) + ")")
        t0 = time.perf_counter()
        try:
            jobs, problems = compile_targets(targets, progress)
        except CheckError as e:
            print(f"FAIL {e}")
            results.append(PartResult("compile", False, str(e)))
        else:
            if verbose:
                print(format_compile_table(jobs))
            for p in problems:
                print(f"FAIL {p}")
            summary = (f"{_count(len(jobs), 'kernel')} in {time.perf_counter() - t0:.0f} s, "
                       f"{len(problems)} failed")
            print(f"  {summary}" + ("" if verbose else " (--verbose lists them)"))
            results.append(PartResult("compile", not problems, summary))
    if compile and q_tiled:
        t0 = time.perf_counter()
        n, problems = compile_q_tiled_targets(progress, loaded)
        summary = f"{_count(n, 'kernel')} in {time.perf_counter() - t0:.0f} s, {len(problems)} failed"
        entries = sum(1 for _, prof in loaded for ck, _, _ in prof.records() if ck[0] == "q_tiled")
        what = "the op's default config" + (
            f" and {entries} profile entr{'y' if entries == 1 else 'ies'}" if entries else "")
        print(f"== (b2) Q-tiled kernel, {what}: {summary}")
        for p in problems:
            print(f"FAIL {p}")
        results.append(PartResult("q_tiled", not problems, summary))
    if compile and fp8:
        t0 = time.perf_counter()
        n, problems = compile_fp8_targets(loaded, progress)
        summary = f"{_count(n, 'kernel')} in {time.perf_counter() - t0:.0f} s, {len(problems)} failed"
        print(f"== (b3) FP8 pages, the streaming kernel (defaults and profile entries as the op adapts them) and "
              f"the dequant kernel (every format, dtype, head dim and page): {summary}")
        for p in problems:
            print(f"FAIL {p}")
        results.append(PartResult("fp8", not problems, summary))
    if traffic:
        from bench.traffic import format_traffic_table, run_step_traffic_check, run_traffic_check

        tr = run_traffic_check() + run_step_traffic_check()
        failed = [r for r in tr if not r.ok]
        summary = f"{len(tr) - len(failed)}/{len(tr)} cases pass"
        print(f"== (c) host-traffic model: {summary}")
        if verbose:
            print(format_traffic_table(tr))
        else:
            for r in failed[:20]:
                print(f"FAIL {r.case.label}: " + "; ".join(r.problems[:3]))
            if len(failed) > 20:
                print(f"... and {len(failed) - 20} more failing cases (--verbose: the table)")
        results.append(PartResult("traffic", not failed, f"{len(tr)} cases, {len(failed)} failed"))
    print("== summary")
    for r in results:
        print(f"{'PASS' if r.ok else 'FAIL'}  {r.name:<9} {r.summary}")
    return 0 if all(r.ok for r in results) else 1
