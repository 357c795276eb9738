"""``python -m bench check``: the GPU-free part of the regression bench (what CI runs).

(a) profiles: every shipped profile (``directkv_cute.tuning.profiles``, lazily imported; no
    module or no profile yet is a pass) loads and validates, and every entry's config is legal
    for its shape;
(b) compile: every heuristic default config (head_dim 64/128 x rows 8/16/64/128 x page
    16..128) and every profile entry compiles for sm_90a through ``compile_decode`` (with and
    without split outputs when the compiler takes ``split_out``), plus the combine kernel;
(c) traffic: the host-traffic model reads every host KV byte exactly once (bench.traffic).
Exit status 1 if any part fails.
"""

from __future__ import annotations

import inspect
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from bench.common import dtype_name, progress_bar, torch_dtype
from directkv_cute.config import (
    SUPPORTED_HEAD_DIMS,
    SUPPORTED_PAGE_SIZES,
    DecodeConfig,
    default_decode_config,
    default_prefill_config,
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
    resident: bool = False  # the multi-token (KV-chunk resident) kernel

    @property
    def label(self) -> str:
        c = self.cfg
        kind = f"prefill chunk{c.chunk} ctas{c.ctas_per_sm}" if self.resident else f"q{self.max_q_len}"
        return (f"{self.source}: {self.dtype} d{self.head_dim} page{self.page_size} group{self.group} "
                f"{kind} tile{c.tile_n} st{c.stages} wg{c.consumer_wgs} a{c.carveout}")


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


def profile_targets(loaded) -> list[CompileTarget]:
    """Compile targets for the decode and prefill entries of loaded profiles."""
    out = []
    for path, prof in loaded:
        for class_key, bucket, rec in prof.records():
            kernel, dtype, head_dim, group, page_size = class_key
            if kernel not in ("decode", "prefill"):
                continue
            q_len = bucket[2] if len(bucket) > 2 else 1
            out.append(CompileTarget(DecodeConfig.from_dict(rec["config"]), dtype_name(str(dtype)), int(head_dim),
                                     int(page_size), int(group), 1 if kernel == "prefill" else int(q_len),
                                     f"{path.name}", resident=kernel == "prefill"))
    return out


def profile_legality_problems(prof) -> list[str]:
    """Static legality of each decode entry's config for its shape."""
    problems = []
    for class_key, bucket, rec in prof.records():
        kernel, _dtype, head_dim, group, page_size = class_key
        if kernel not in ("decode", "prefill"):
            continue
        cfg = DecodeConfig.from_dict(rec["config"])
        q_len = bucket[2] if len(bucket) > 2 else 1
        issues = cfg.problems(int(head_dim), int(page_size))
        if kernel == "prefill":
            if int(group) > cfg.rows:
                issues.append(f"group {group} exceeds {cfg.rows} rows")
        elif int(group) * int(q_len) > cfg.rows:
            issues.append(f"group {group} x q_len {q_len} exceeds {cfg.rows} rows")
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
                out.append(CompileTarget(default_prefill_config(d), dtype, d, 64, group, 1, "default",
                                         resident=True))
    return out


def portfolio_targets() -> list[CompileTarget]:
    """The prefill tuner's portfolio (the configs it tries right after the default), bf16, d 128,
    GQA 4: they must compile wherever the tuner may pick them."""
    from directkv_cute.tuning.space import TuneShape, get_space

    space = get_space("prefill")
    shape = TuneShape(32, 8, 128, batch=1, context=32768, q_len=512)
    return [CompileTarget(cfg, "bfloat16", 128, 64, 4, 1, "portfolio", resident=True)
            for cfg in space.portfolio(shape)]


def resolve_compiler() -> tuple[Callable, Callable | None]:
    """(compile_decode, compile_combine or None) from the kernel package.

    docs/CONTRACT.md names ``directkv_cute.kernels.decode.compile_decode``; the implementation
    may keep it in ``directkv_cute.kernels.jit``. Raises CheckError if neither imports.
    """
    errors = []
    for module in ("directkv_cute.kernels.decode", "directkv_cute.kernels.jit"):
        try:
            mod = __import__(module, fromlist=["compile_decode"])
        except Exception as e:  # noqa: BLE001 - report every reason the kernels do not import
            errors.append(f"{module}: {type(e).__name__}: {e}")
            continue
        if hasattr(mod, "compile_decode"):
            return mod.compile_decode, getattr(mod, "compile_combine", None)
        errors.append(f"{module}: no compile_decode")
    raise CheckError("the decode kernel cannot be compiled: " + " | ".join(errors))


def ensure_arch() -> str:
    """Compile for sm_90a without a GPU: set CUTE_DSL_ARCH if it is unset and there is no GPU."""
    if not os.environ.get("CUTE_DSL_ARCH") and not torch.cuda.is_available():
        os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    return os.environ.get("CUTE_DSL_ARCH", "(current GPU)")


def compile_targets(targets: list[CompileTarget], progress: bool = True) -> tuple[list[tuple], list[str]]:
    """Compile every target; returns ([(target, split_out, seconds, error or None)], problems)."""
    compile_decode, compile_combine = resolve_compiler()
    has_split = "split_out" in inspect.signature(compile_decode).parameters
    variants = (True, False) if has_split else (None,)
    seen, rows, problems = set(), [], []
    jobs = [(t, s) for t in targets for s in ((True,) if t.resident else variants)]
    for t, split in progress_bar(jobs, progress, "compile", "kernel"):
        key = (t.cfg, t.dtype, t.head_dim, t.page_size, t.group, t.max_q_len, split, t.resident)
        if key in seen:
            continue
        seen.add(key)
        kwargs = {} if split is None else {"split_out": split}
        if t.resident:
            kwargs["resident"] = True
        t0 = time.perf_counter()
        try:
            compile_decode(t.cfg, torch_dtype(t.dtype), t.head_dim, t.page_size, t.group, t.max_q_len, **kwargs)
            err = None
        except Exception as e:  # noqa: BLE001 - a config that stops compiling is what CI must catch
            err = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
            problems.append(f"{t.label} split_out={split}: {err}")
        rows.append((t, split, time.perf_counter() - t0, err))
    if compile_combine is not None:
        for d in SUPPORTED_HEAD_DIMS:
            for dtype in sorted({t.dtype for t in targets}):
                try:
                    compile_combine(d, torch_dtype(dtype))
                except Exception as e:  # noqa: BLE001
                    problems.append(f"combine d{d} {dtype}: {type(e).__name__}: {e}")
    return rows, problems


def format_compile_table(rows: list[tuple]) -> str:
    lines = [f"{'target':<92} {'split':>5} {'sec':>6}  result"]
    for t, split, sec, err in rows:
        lines.append(f"{t.label:<92} {str(split):>5} {sec:6.2f}  {'ok' if err is None else 'FAIL ' + err}")
    return "\n".join(lines)


# ---- driver --------------------------------------------------------------------------------
def run_check(*, profiles: bool = True, compile: bool = True, traffic: bool = True, profile_dir=None,
              fp16: bool = True, progress: bool = True, verbose: bool = False) -> int:
    """Run the selected parts, print their tables and a summary; 0 if all pass, else 1."""
    results: list[PartResult] = []
    loaded = []
    if profiles:
        msgs, loaded, problems = load_shipped_profiles(profile_dir)
        print("== (a) profiles\n" + "\n".join(msgs + [f"FAIL {p}" for p in problems]))
        results.append(PartResult("profiles", not problems, f"{len(loaded)} loaded, {len(problems)} problems"))
    if compile:
        arch = ensure_arch()
        targets = (default_targets(("bfloat16", "float16") if fp16 else ("bfloat16",)) + portfolio_targets()
                   + profile_targets(loaded))
        print(f"== (b) compile for {arch}: {len(targets)} configs")
        try:
            rows, problems = compile_targets(targets, progress)
        except CheckError as e:
            print(f"FAIL {e}")
            results.append(PartResult("compile", False, str(e)))
        else:
            table = format_compile_table(rows)
            print(table if verbose or problems else "\n".join(table.splitlines()[:1] + [
                f"... {len(rows)} kernels compiled, {sum(r[2] for r in rows):.1f} s (--verbose lists them)"]))
            for p in problems:
                print(f"FAIL {p}")
            results.append(PartResult("compile", not problems, f"{len(rows)} kernels, {len(problems)} failed"))
    if traffic:
        from bench.traffic import format_traffic_table, run_traffic_check

        tr = run_traffic_check()
        print("== (c) host-traffic model\n" + format_traffic_table(tr))
        failed = sum(not r.ok for r in tr)
        results.append(PartResult("traffic", failed == 0, f"{len(tr)} cases, {failed} failed"))
    print("== summary")
    for r in results:
        print(f"{'PASS' if r.ok else 'FAIL'}  {r.name:<9} {r.summary}")
    return 0 if all(r.ok for r in results) else 1
