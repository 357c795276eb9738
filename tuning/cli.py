"""``directkv-tune``: tune kernel configs per GPU and manage the YAML profiles.

    directkv-tune [run] (--preset NAME ... | --shape HQ,HKV,D,BATCH,CONTEXT,QLEN ...) [options]
    directkv-tune show   [--dir DIR | FILE ...] [--gpu NAME] [--format table|json|yaml]
    directkv-tune check  [--dir DIR] [--compile]
    directkv-tune lookup --gpu NAME --shape HQ,HKV,D,BATCH,CONTEXT,QLEN [--page-size N] [--dtype T] [--kernel K]
    directkv-tune presets
    directkv-tune machine [--output DIR] [--gpu NAME] [--dry-run]
    directkv-tune restamp [--profile FILE ...] [--against REV] [--dry-run] [-v]

``run`` is the default subcommand. Without a source checkout install, run it as
``python -m tuning.cli`` from the repository root.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from pathlib import Path

from directkv_cute import env as envvars
from directkv_cute.config import SUPPORTED_HEAD_DIMS, SUPPORTED_PAGE_SIZES, ConfigError
from directkv_cute.kernels import specs
from directkv_cute.paths import cache_root

from directkv_cute.presets import TEST_PRESETS

from . import machine as _machine
from . import presets as _presets
from . import profiles as _profiles
from . import restamp as _restamp
from .lookup import ProfileMissError, explain_config, tuned_buckets
from .objectives import GpuObjective, ModelledObjective
from .profiles import PROFILE_DIR_ENV, TUNE_COMMAND, ProfileError, current_kernel_hash, default_output_dir, \
    dump_yaml, find_profiles, list_profiles, load_profile, one_line, output_problem, profile_dirs, sanitize_gpu_name
from .space import STREAM_MAX_ROWS, TuneShape, get_space, kernels, normalize_dtype, op_kernel, torch_dtype
from .tuner import MAX_SEEDS, TuneOptions, Tuner, TunerAbort, format_results, plain_table, shape_problem

SUBCOMMANDS = ("run", "show", "check", "lookup", "presets", "machine", "restamp")
CACHE_DIR_ENV = envvars.CACHE_DIR
DRY_RUN_ENUMERATE = 50_000  # spaces up to this many points are filtered exactly in --dry-run
DRY_RUN_SAMPLE = 20_000  # larger ones: the legal share of this many seeded random points


def default_cache_dir() -> Path:
    """Tuner journals: the package's one cache folder (``directkv_cute.paths.cache_root``) / tune."""
    return cache_root() / "tune"


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error: ``directkv-tune run: error: ...`` and exit status 2 (the
    usage is a --help away, not printed above every mistake)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _fail(message, rc: int = 2) -> int:
    print(f"directkv-tune: {one_line(message)}", file=sys.stderr)
    return rc


def _int_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or any(v < 1 for v in out):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


def _shape_arg(text: str) -> tuple[int, ...]:
    vals = _int_list(text)
    if len(vals) != 6:
        raise argparse.ArgumentTypeError(f"--shape wants HQ,HKV,D,BATCH,CONTEXT,QLEN (6 integers), got {text!r}")
    if vals[0] % vals[1]:
        raise argparse.ArgumentTypeError(f"HQ {vals[0]} is not a multiple of HKV {vals[1]}")
    if vals[2] not in SUPPORTED_HEAD_DIMS:
        raise argparse.ArgumentTypeError(
            f"head dim D={vals[2]} in {text!r}: the kernels support head dims {_listing(SUPPORTED_HEAD_DIMS)}")
    return tuple(vals)


def _listing(values) -> str:
    return ", ".join(str(v) for v in values)


def _dtype_arg(text: str) -> str:
    try:
        return normalize_dtype(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _page_size_arg(text: str) -> int:
    n = _count_arg(text, minimum=1)
    if n not in SUPPORTED_PAGE_SIZES:
        raise argparse.ArgumentTypeError(
            f"page size {n}: the kernels support page sizes {_listing(SUPPORTED_PAGE_SIZES)} (tokens per page)")
    return n


def _count_arg(text: str, minimum: int) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if n < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {n}")
    return n


def _positive_int(text: str) -> int:
    return _count_arg(text, 1)


def _nonnegative_int(text: str) -> int:
    return _count_arg(text, 0)


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return v


def _seed_arg(text: str) -> int:
    n = _count_arg(text, 0)
    if n >= MAX_SEEDS:
        raise argparse.ArgumentTypeError(f"must be < {MAX_SEEDS} (2**32), got {n}")
    return n


def _seconds_arg(text: str) -> float:
    v = _positive_float(text)
    if v < 1e-3:
        raise argparse.ArgumentTypeError(f"{text!r} seconds is too short to measure anything (at least 0.001)")
    return v


def _gib_arg(text: str) -> float:
    v = _positive_float(text)
    if v * (1 << 30) >= 2**63:
        raise argparse.ArgumentTypeError(f"{text!r} GiB is more memory than a machine addresses")
    return v


def _gpu_arg(text: str) -> str:
    try:
        sanitize_gpu_name(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"GPU name {text!r} has no letters or digits") from None
    return text


PAGE_SIZE_HELP = f"tokens per KV page ({_listing(SUPPORTED_PAGE_SIZES)}; default {_presets.DEFAULT_PAGE_SIZE})"


# Old kernel names the CLI still takes (deprecated): the multi-token kernel was "prefill".
KERNEL_ALIASES = {"prefill": "multi_token"}
KERNEL_ALIAS_HELP = "'prefill' is a deprecated alias of multi_token"


def _kernel_arg(text: str) -> str:
    """A --kernel value: a kernel name, or a deprecated alias of one (said on stderr)."""
    new = KERNEL_ALIASES.get(text)
    if new is None:
        return text
    print(f"directkv-tune: --kernel {text} is deprecated; it names the {new} kernel (use --kernel {new})",
          file=sys.stderr)
    return new


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog="directkv-tune",
        description="Autotune directkv-cute kernels (Optuna) and manage per-GPU YAML profiles.",
    )
    sub = ap.add_subparsers(dest="cmd")

    r = sub.add_parser("run", help="tune shape buckets and write the GPU's profile (default subcommand)")
    src = r.add_argument_group("what to tune")
    src.add_argument("--kernel", default="decode", type=_kernel_arg, choices=kernels(),
                     help=f"kernel to tune (default decode); buckets the op runs with the other kernel are left "
                          f"out (decode when group x q_len <= {STREAM_MAX_ROWS}, else multi_token; q_tiled takes "
                          f"the multi-token buckets, by default batch 1 x context 8k-128k x q_len 512-8192). "
                          f"{KERNEL_ALIAS_HELP}")
    src.add_argument("--preset", action="append", default=[], metavar="NAME",
                     help=f"model preset ({', '.join(_presets.PRESETS)}, or 'all': every one but the test "
                          f"shape{'s' if len(TEST_PRESETS) > 1 else ''} {', '.join(TEST_PRESETS)}; the names of "
                          "directkv-generate --preset, also spelled as on the Hub, e.g. Meta-Llama-3-8B); "
                          "repeatable")
    src.add_argument("--shape", action="append", default=[], type=_shape_arg, metavar="HQ,HKV,D,BATCH,CONTEXT,QLEN",
                     help="an explicit shape bucket; repeatable")
    src.add_argument("--batches", type=_int_list,
                     help="override the presets' (or the kernel's, for q_tiled) batch buckets, e.g. 1,4,16,64")
    src.add_argument("--contexts", type=_int_list,
                     help="override the presets' (or the kernel's) context buckets, e.g. 4096,32768")
    src.add_argument("--q-lens", type=_int_list, help="override the presets' (or the kernel's) q_len buckets")
    src.add_argument("--dtype", default="bf16", type=_dtype_arg, help="bf16 (default) or fp16")
    src.add_argument("--page-size", type=_page_size_arg, default=_presets.DEFAULT_PAGE_SIZE,
                     help=PAGE_SIZE_HELP)
    how = r.add_argument_group("search")
    how.add_argument("--objective", choices=("gpu", "model"), default="gpu",
                     help="gpu: measure on this machine's GPU; model: deterministic cost model (CPU demo)")
    how.add_argument("--trials", type=_positive_int, default=40,
                     help="distinct configs measured per bucket (default 40)")
    how.add_argument("--time-budget", type=_seconds_arg, default=None, metavar="SECONDS",
                     help="wall-clock budget of the run")
    how.add_argument("--seed", type=_seed_arg, default=0, help="seed of the search and the data (0 .. 2**32 - 1)")
    how.add_argument("--top-k", type=_nonnegative_int, default=3, help="configs re-benchmarked with more repetitions")
    how.add_argument("--exhaustive-threshold", type=_nonnegative_int, default=128,
                     help="search every legal config when there are at most this many (default 128)")
    how.add_argument("--max-host-gib", type=_gib_arg, default=40.0,
                     help="pinned host memory the gpu objective may use")
    how.add_argument("--precompile-jobs", type=_nonnegative_int, default=0, metavar="N",
                     help="before measuring, compile in N processes the kernels the run measures first (every "
                          "legal config of a bucket searched exhaustively, else its first --trials seeds: the "
                          "default, the profile's entry, the portfolio) into the compiled-kernel disk cache; "
                          "0 (default): each compiles when first measured")
    store = r.add_argument_group("storage")
    store.add_argument("--output", type=Path, default=None,
                       help=f"profile folder (default: the first ${PROFILE_DIR_ENV} folder, else a source "
                            "checkout's profiles/, else ~/.config/directkv_cute/profiles; checked for writing "
                            "before tuning; the model objective writes only with --output)")
    store.add_argument("--resume", action="store_true", help="continue the journal in the cache folder")
    store.add_argument("--storage", type=Path, default=None, help="Optuna journal file to use (continued if it exists)")
    store.add_argument("--cache-dir", type=Path, default=None,
                       help=f"folder of the default journal (${CACHE_DIR_ENV}/tune, else $XDG_CACHE_HOME or ~/.cache, /directkv_cute/tune)")
    r.add_argument("--dry-run", action="store_true", help="print the space, the legal counts and the buckets; run nothing")
    r.add_argument("-q", "--quiet", action="store_true", help="no progress bar")

    s = sub.add_parser("show", help="print profile entries")
    s.add_argument("files", nargs="*", type=Path, help="profile files (default: every profile in the folder)")
    s.add_argument("--dir", type=Path, default=None, help="profile folder (default: the lookup's folders)")
    s.add_argument("--gpu", default=None, type=_gpu_arg, help="only the profile of this GPU name")
    s.add_argument("--format", choices=("table", "json", "yaml"), default="table")

    c = sub.add_parser("check", help="validate every profile (and optionally compile every entry)",
                       description="Validate every profile (and optionally compile every entry). Exit status 1 "
                                   "when a profile is invalid or an entry illegal (or fails to compile), 2 when a "
                                   "profile's machine: section holds rates the planner refuses (one line on "
                                   "stderr each).")
    c.add_argument("--dir", type=Path, default=None, help="profile folder (default: the lookup's folders)")
    c.add_argument("--compile", action="store_true", help="compile each entry's config for sm_90a (no GPU needed)")

    lk = sub.add_parser("lookup", help="which config the op would pick for a launch, and why")
    lk.add_argument("--gpu", required=True, type=_gpu_arg,
                    help="GPU name as torch reports it ('NVIDIA H200') or as the profile file spells it (NVIDIA_H200)")
    lk.add_argument("--shape", required=True, type=_shape_arg, metavar="HQ,HKV,D,BATCH,CONTEXT,QLEN",
                    help="query heads, KV heads, head dim, batch, longest context, longest q_len of the launch")
    lk.add_argument("--page-size", type=_page_size_arg, default=_presets.DEFAULT_PAGE_SIZE,
                    help=PAGE_SIZE_HELP)
    lk.add_argument("--dtype", default="bf16", type=_dtype_arg, help="bf16 (default) or fp16")
    lk.add_argument("--kernel", default=None, type=_kernel_arg, choices=kernels(),
                    help=f"kernel to look up (default: the one the op runs, decode when group x q_len <= "
                         f"{STREAM_MAX_ROWS}, else multi_token). {KERNEL_ALIAS_HELP}")

    sub.add_parser("presets", help="list the model presets and their buckets")

    m = sub.add_parser("machine", help="measure the planner's machine model on this GPU and write it into the "
                                       "GPU's profile (machine:)")
    m.add_argument("--output", type=Path, default=None,
                   help=f"profile folder (default as for run: the first ${PROFILE_DIR_ENV} folder, else a source "
                        "checkout's profiles/, else ~/.config/directkv_cute/profiles); checked before measuring")
    m.add_argument("--gpu", default=None, type=_gpu_arg,
                   help="the GPU name the profile is written for (default: this GPU's name as torch reports it)")
    m.add_argument("--dry-run", "--print", dest="dry_run", action="store_true",
                   help="measure and print the rates and the machine: section; write nothing")

    rs = sub.add_parser("restamp", help="re-stamp stale entries whose kernels compile to the same PTX as the sources "
                                        "they were tuned for",
                        description="For each kernel family whose entries carry a stale kernel_hash: find the sources "
                                    "they were tuned for in git (--against REV, else the newest commit whose sources "
                                    "hash to it), compile a sample of the family's kernels for sm_90a from those "
                                    "sources and from the current ones (two fresh interpreters), and re-stamp the "
                                    "entries with the current hash only where every sampled kernel's PTX is "
                                    "identical. One line per family. Exit status 0 when no stale entry is left, 1 "
                                    "when some stay stale (PTX differs, no revision found, a compile failed), 2 for "
                                    "a bad argument (or no git checkout).")
    rs.add_argument("--profile", type=Path, action="append", default=[], metavar="FILE",
                    help="profile to re-stamp; repeatable (default: every profile in the checkout's profiles/)")
    rs.add_argument("--against", default=None, metavar="REV",
                    help="the git revision the stale entries were tuned for (default: found by walking git log "
                         "over each family's source files until their hash is the entries' one)")
    rs.add_argument("--dry-run", action="store_true", help="compare and report; write nothing")
    rs.add_argument("-v", "--verbose", action="store_true", help="also list every kernel compared")
    return ap


# ---- run -------------------------------------------------------------------------------------


def _shapes_from_args(a) -> list[TuneShape]:
    dtype = normalize_dtype(a.dtype)
    shapes = []
    for p in _presets.resolve_presets(a.preset):
        shapes += p.shapes(batches=a.batches, contexts=a.contexts, q_lens=a.q_lens, page_size=a.page_size, dtype=dtype,
                           kernel=a.kernel)
    for hq, hkv, d, b, ctx, q in a.shape:
        shapes.append(TuneShape(hq, hkv, d, b, ctx, q, page_size=a.page_size, dtype=dtype))
    # buckets that differ only in query heads (Llama-3-8B / -70B / Mistral-Large) next to each other,
    # so the GPU objective builds each KV cache once
    return sorted(_presets.unique_shapes(shapes), key=lambda s: (
        s.dtype, s.head_dim, s.num_kv_heads, s.page_size, s.q_len, s.batch, s.context, s.num_q_heads))


def _for_kernel(kernel: str, shapes) -> list[TuneShape]:
    """The buckets the planner looks ``kernel``'s entries up for (``lookup.tuned_buckets``, by
    space.op_kernel); says which were left out."""
    runs = tuned_buckets(kernel)
    kept = [s for s in shapes if op_kernel(s.group, s.q_len) == runs]
    left = [s for s in shapes if op_kernel(s.group, s.q_len) != runs]
    other = "multi_token" if runs == "decode" else "decode"
    if not kept:  # a failure: one line
        print(f"directkv-tune: no bucket left for the {kernel} kernel: the op runs every one given with the "
              f"{other} kernel (decode when group x q_len <= {STREAM_MAX_ROWS}, else multi_token); pick --q-lens "
              f"(or --shape QLEN) with group x q_len {'<=' if runs == 'decode' else '>'} {STREAM_MAX_ROWS}, or "
              f"tune them with --kernel {other}", file=sys.stderr)
    elif left:
        qs = sorted({s.q_len for s in left})
        print(f"directkv-tune: left out {len(left)} bucket(s) with q_len {_listing(qs)}: the op runs them with the "
              f"{other} kernel (decode when group x q_len <= {STREAM_MAX_ROWS}, else multi_token); "
              f"tune them with --kernel {other}", file=sys.stderr)
    return kept


def _legality_line(a, space, s, p) -> None:
    """One shape class of --dry-run: exact counts for a small space, a sampled estimate for a
    large one (the multi_token space has millions of points: enumerating them takes minutes)."""
    head = (f"  hq={s.num_q_heads} hkv={s.num_kv_heads} d={s.head_dim} group={s.group} q_len={s.q_len} "
            f"page={s.page_size} {s.dtype}: ")
    total = space.cardinality()
    if total <= DRY_RUN_ENUMERATE:
        rep = space.legality(s)
        mode = "exhaustive" if rep.legal_count <= a.exhaustive_threshold else "tpe"
        p(f"{head}{rep.legal_count} legal of {rep.total} -> {mode}")
    else:
        rep = space.sample_legality(s, DRY_RUN_SAMPLE, seed=a.seed)
        est = round(rep.legal_count / rep.total * total)
        mode = "tpe" if est > 4 * a.exhaustive_threshold else "exhaustive or tpe (the tuner counts exactly)"
        p(f"{head}~{est} legal of {total} (estimated from {rep.legal_count} legal of {rep.total} sampled "
          f"points) -> {mode}")
    for reason, n in sorted(rep.reason_counts().items(), key=lambda x: -x[1]):
        p(f"      excluded {n:5d}{' of the sample' if total > DRY_RUN_ENUMERATE else ''}: {reason}")
    p(f"      default: {space.default_for(s)}")


def _dry_run(a, shapes, out) -> int:
    space = get_space(a.kernel)
    p = lambda *x: print(*x, file=out, flush=True)  # noqa: E731
    p(f"kernel {a.kernel}: space hash {space.space_hash()[:16]}  ({space.cardinality()} points)")
    for prm in space.params:
        p(f"  {prm.name:<12} {list(prm.choices)}  {prm.doc}")
    if space.fixed_doc:
        p(f"  fixed: {space.fixed_doc}")
    classes = {}
    for s in shapes:
        classes.setdefault(s.class_key + (s.q_len, s.num_kv_heads, s.num_q_heads), s)
    p("")
    p("legal configs per shape class (static filter: SMEM under alpha, per-block opt-in, page divisibility):")
    for s in classes.values():
        _legality_line(a, space, s, p)
    p("")
    small = space.cardinality() <= DRY_RUN_ENUMERATE
    p(f"{len(shapes)} bucket(s), up to {a.trials} configs each"
      + ("" if small else " (launches: not counted for a space this large)") + ":")
    rows = [[str(s.num_q_heads), str(s.num_kv_heads), str(s.head_dim), str(s.group), str(s.batch), str(s.context),
             str(s.q_len), f"{s.kv_bytes() / 2**20:.0f}",
             str(space.launch_classes(s)) if small else "-"] for s in shapes]
    p(plain_table(["hq", "hkv", "d", "group", "batch", "context", "q_len", "KV MiB/layer", "launches"], rows))
    p("")
    p(f"objective: {a.objective}; seed {a.seed}; time budget {a.time_budget or 'none'}; nothing was run (--dry-run)")
    return 0


def _make_objective(a):
    if a.objective == "model":
        return ModelledObjective(seed=a.seed, kernel=a.kernel)
    return GpuObjective(seed=a.seed, max_host_bytes=int(a.max_host_gib * (1 << 30)), kernel=a.kernel)


def _folder_problem(path: Path, what: str) -> str | None:
    """Why the tuner could not make files in folder ``path`` (None: it can, creating it if need
    be): the nearest existing one of it and its parents must be a writable folder."""
    for anc in (path, *path.parents):
        if anc.is_symlink() and not anc.exists():
            return f"{what} {path}: {anc} is a broken symbolic link"
        if anc.exists():
            if not anc.is_dir():
                return f"{what} {path}: {anc} is not a folder"
            if not os.access(anc, os.W_OK | os.X_OK):
                return f"{what} {path}: {anc} is not writable"
            return None
    return None


def _journal_problem(path: Path, what: str) -> str | None:
    """Why ``path`` cannot be the run's journal (None: it can): an existing one must be a regular
    file this user can read and write, a new one's folder :func:`_folder_problem`'s test."""
    if path.exists() or path.is_symlink():
        if not path.is_file():
            return f"{what} {path}: not a regular file"
        if not os.access(path, os.R_OK | os.W_OK):
            return f"{what} {path}: not readable and writable"
        return None
    return _folder_problem(path.parent, f"{what} {path}: its folder")


def _journal_records_problem(path: Path) -> str | None:
    """Why the existing file ``path`` is not an Optuna journal to continue (None: it is one):
    every line a whole JSON record with an ``op_code`` (Optuna reads a bad line as a JSON error
    mid-run, or a cut last line as a later write's corruption)."""
    try:
        with open(path, "rb") as f:
            for n, line in enumerate(f, 1):
                if not line.endswith(b"\n"):
                    return f"journal {path}: line {n} is cut short (an interrupted write?); move the file aside"
                try:
                    rec = json.loads(line)
                except ValueError as e:
                    return f"journal {path}: line {n} is not JSON ({e}); not an Optuna journal"
                if not isinstance(rec, dict) or "op_code" not in rec:
                    return f"journal {path}: line {n} is not an Optuna journal record"
    except OSError as e:
        return f"journal {path}: cannot read: {e.strerror or e}"
    return None


def _cmd_run(a, out) -> int:
    envvars.check_all()  # the op the GPU objective measures reads them: refuse a bad one now
    try:
        shapes = _shapes_from_args(a)
    except (KeyError, ValueError) as e:
        return _fail(e)
    if not shapes:
        return _fail("run: give --preset NAME (or 'all') or --shape HQ,HKV,D,BATCH,CONTEXT,QLEN")
    for shape in shapes:
        problem = shape_problem(shape)
        if problem:
            return _fail(problem)
    shapes = _for_kernel(a.kernel, shapes)
    if not shapes:
        return 2
    if a.dry_run:
        return _dry_run(a, shapes, out)
    if a.storage is not None:
        problem = _journal_problem(a.storage, "--storage")
    else:
        problem = _folder_problem(a.cache_dir or default_cache_dir(), "--cache-dir" if a.cache_dir else "journal folder")
    if problem:
        return _fail(problem)
    output = a.output if a.output is not None else (default_output_dir() if a.objective == "gpu" else None)
    problem = None if output is None else _folder_problem(output, "--output")
    if problem:
        return _fail(problem)

    try:
        objective = _make_objective(a)
    except (RuntimeError, ImportError) as e:
        return _fail(e)
    env = objective.environment()
    gpu = env["gpu_name"]
    journal = a.storage
    if journal is None:
        journal = (a.cache_dir or default_cache_dir()) / f"tune-{sanitize_gpu_name(gpu)}-{a.kernel}-{a.objective}.journal"
        problem = _journal_problem(journal, "journal")
        if problem:
            return _fail(problem)
    problem = _journal_records_problem(journal) if journal.exists() else None
    problem = problem or (None if output is None else output_problem(output, gpu))
    if problem:
        return _fail(problem)
    if a.storage is None and journal.exists() and not a.resume:
        journal.replace(journal.with_suffix(".journal.prev"))
        print(f"(moved the previous journal to {journal.with_suffix('.journal.prev')}; use --resume to continue one)",
              file=sys.stderr)
    opts = TuneOptions(n_trials=a.trials, time_budget_s=a.time_budget, seed=a.seed, top_k=a.top_k,
                       exhaustive_threshold=a.exhaustive_threshold, progress=not a.quiet)
    tuner = Tuner(a.kernel, objective, storage=journal, options=opts, output_dir=output, environment=env)
    print(f"directkv-tune: {len(shapes)} bucket(s) of {a.kernel} on {gpu} ({a.objective} objective), "
          f"journal {journal}", file=out)
    if a.precompile_jobs:
        import time

        t0 = time.perf_counter()
        n, fails = tuner.precompile(shapes, a.precompile_jobs)
        print(f"directkv-tune: precompiled {n} kernel(s) in {a.precompile_jobs} process(es), "
              f"{time.perf_counter() - t0:.0f} s, {len(fails)} failed", file=out)
        for f in fails:
            print(f"  precompile failed (its trial will fail too): {f}", file=sys.stderr)
    rc = 0
    try:
        results = tuner.tune(shapes)
    except TunerAbort as e:
        print(f"directkv-tune: stopped: {e}\nThe journal keeps every finished trial; re-run the same command with "
              f"--resume (or --storage {journal}) to continue.", file=sys.stderr)
        results, rc = tuner.results, 3
    except KeyboardInterrupt:
        print(f"\ndirectkv-tune: interrupted; resume with --storage {journal}", file=sys.stderr)
        return 130
    if results:
        print(format_results(results, kernel=a.kernel), file=out)
    if tuner.written is not None:
        print(f"profile: {tuner.written}", file=out)
    elif tuner.profile_path is not None:
        print(f"profile: not written (no bucket finished; {tuner.profile_path} is unchanged)", file=out)
    else:
        print("profile: not written (the model objective writes only with --output DIR)", file=out)
    left = [r for r in results if r.status == "skipped"]
    if left:
        print(f"{len(left)} bucket(s) not reached within the time budget: run the same command with --resume "
              f"(or --storage {journal}) to continue", file=out)
    if any(r.status == "failed" for r in results):
        rc = rc or 1
    return rc


# ---- show / check / lookup ---------------------------------------------------------------------


def _profile_files(dir_, files=()) -> list[Path]:
    if files:
        return list(files)
    dirs = [dir_] if dir_ is not None else profile_dirs()
    out = []
    for d in dirs:
        out += list_profiles(d)
    return out


def _missing_dir(a, cmd) -> bool:
    """--dir names no folder: say so (an exit status of 0 would pass a CI check of nothing)."""
    if a.dir is not None and not a.dir.is_dir():
        why = "not a folder" if a.dir.exists() else "no such folder"
        print(f"directkv-tune {cmd}: --dir {a.dir}: {why}", file=sys.stderr)
        return True
    return False


def _file_arg_problem(path: Path) -> str | None:
    """Why ``show FILE`` cannot read ``path`` (None: it can): it must be a regular file (a FIFO
    or a device would block the read or never end)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return f"{path}: no such file"
    except OSError as e:
        return f"{path}: {e.strerror or e}"
    if not stat.S_ISREG(st.st_mode):
        return f"{path}: {'a folder' if stat.S_ISDIR(st.st_mode) else 'not a regular file'}, not a profile"
    return None


def _cmd_show(a, out) -> int:
    if _missing_dir(a, "show"):
        return 2
    for f in a.files:  # the files named: each must be a readable profile, else nothing is shown
        problem = _file_arg_problem(f)
        if problem:
            return _fail(f"show: {problem}")
        load_profile(f)  # a ProfileError: one line, exit status 2 (main)
    paths = _profile_files(a.dir, a.files)
    docs, rc, others = [], 0, []
    for path in paths:
        try:
            prof = load_profile(path)
        except ProfileError as e:
            print(f"error: {one_line(e)}", file=sys.stderr)
            rc = 1
            continue
        if a.gpu and prof.gpu_name != a.gpu and sanitize_gpu_name(a.gpu) != path.stem:
            others.append(prof.gpu_name)
            continue
        docs.append((path, prof))
    if a.format == "json":
        print(json.dumps({str(p): prof.to_doc() for p, prof in docs}, indent=2), file=out)
        return rc
    if a.format == "yaml":
        print(dump_yaml({str(p): prof.to_doc() for p, prof in docs}), file=out)
        return rc
    if not docs and rc:  # every profile found was bad: said above, one line each
        return rc
    if not docs:
        where = ", ".join(str(d) for d in ([a.dir] if a.dir else profile_dirs()))
        if a.gpu and others:
            print(f"no profile for GPU {a.gpu!r} in {where} (profiles there are for: "
                  f"{', '.join(sorted(set(others)))})", file=out)
        elif a.gpu:
            print(f"no profile for GPU {a.gpu!r}: no profiles found in {where}", file=out)
        else:
            print("no profiles found in " + where, file=out)
        return rc
    for path, prof in docs:
        md = prof.metadata
        stale = {(ck, bk) for ck, bk, _ in prof.stale()}
        print(f"{path}: {prof.gpu_name} (cc {md.get('compute_capability')}, {md.get('sm_count')} SMs), "
              f"objective {md.get('objective', '?')}, {len(stale)} stale bucket(s), "
              f"link {md.get('host_link_gbps')} GB/s, HBM {md.get('hbm_gbps')} GB/s, updated {md.get('updated')}",
              file=out)
        rows = []
        for ck, bk, rec in prof.records():
            t, dt = rec.get("p50_us"), rec.get("default_p50_us")
            cfg = " ".join(f"{k}={v}" for k, v in rec["config"].items())
            rows.append([ck[0], ck[1], str(ck[2]), str(ck[3]), str(ck[4]), str(bk[0]), str(bk[1]), str(bk[2]),
                         f"{t:.1f}", "-" if dt is None else f"{dt:.1f}", "-" if not dt else f"{dt / t:.2f}x",
                         str(rec.get("trials")), "stale" if (ck, bk) in stale else "current", cfg])
        print(plain_table(["kernel", "dtype", "d", "group", "page", "batch", "context", "q_len", "p50 us",
                           "default us", "speedup", "trials", "sources", "config"], rows), file=out)
        print(file=out)
    return rc


_COMPILE_MODULE = "directkv_cute.kernels.jit"  # where the runner gets its kernels (runner._compiled)


def _resolve_compile():
    """The op's compile_decode (directkv_cute.kernels.jit), or (None, a clear error string)."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import importlib

    try:
        mod = importlib.import_module(_COMPILE_MODULE)
    except ModuleNotFoundError as e:
        if e.name == _COMPILE_MODULE:
            return None, f"{_COMPILE_MODULE} does not exist: cannot compile the entries"
        return None, f"cannot import {_COMPILE_MODULE}: {e}"
    except Exception as e:
        return None, f"cannot import {_COMPILE_MODULE}: {type(e).__name__}: {e}"
    fn = getattr(mod, "compile_decode", None)
    if fn is None:
        return None, f"{_COMPILE_MODULE} has no compile_decode(cfg, dtype, head_dim, page_size, group, max_q_len)"
    return fn, ""




def _compile_entry(compile_fn, kernel, cfg, dtype, d, page, group, q_len) -> None:
    """Compile one entry as the op launches it: multi_token entries with the multi-token kernel,
    q_tiled entries in each variant the op launches (``specs.Q_TILED_VARIANTS``)."""
    if kernel == "q_tiled":
        compile_q_tiled = specs.get("q_tiled").compile_fn
        for wait_ready, fold in specs.Q_TILED_VARIANTS:
            compile_q_tiled(cfg, torch_dtype(dtype), d, page, group, wait_ready, fold)
        return
    kw = dict(dtype=torch_dtype(dtype), head_dim=d, page_size=page, group=group, max_q_len=q_len)
    if kernel == "decode_fp8":  # its own compile, over e4m3 pages
        import torch

        # torch and the compiler load only to compile: the CLI answers --help and bad arguments without them
        from directkv_cute.kernels.jit import compile_decode_fp8

        compile_decode_fp8(cfg, kv_dtype=torch.float8_e4m3fn, split_out=True, **kw)
        return
    if kernel == "multi_token":
        kw["multi_token"] = True
    compile_fn(cfg, **kw)


def _cmd_check(a, out) -> int:
    if _missing_dir(a, "check"):
        return 2
    dirs = [a.dir] if a.dir is not None else profile_dirs()
    paths = []
    for d in dirs:
        paths += list_profiles(d)
    if not paths:
        print("no profiles found in " + ", ".join(str(d) for d in dirs), file=out)
    compile_fn, note = (None, "")
    if a.compile:
        compile_fn, note = _resolve_compile()
        if compile_fn is None:
            print(f"check --compile: {note}", file=out)
    rc = 0 if (compile_fn is not None or not a.compile) else 1

    machine_bad = False
    for path in paths:
        try:
            prof = load_profile(path)
        except ProfileError as e:
            if _machine_problem(e):  # rates the planner would refuse to plan with: a user's error, exit 2
                print(f"directkv-tune check: INVALID {one_line(e)}", file=sys.stderr)
                machine_bad = True
            else:
                print(f"INVALID {one_line(e)}", file=out)
            rc = max(rc, 1)
            continue
        if prof.gpu_name and sanitize_gpu_name(prof.gpu_name) != path.stem:
            print(f"INVALID {path}: file name does not match gpu_name {prof.gpu_name!r} "
                  f"(expected {sanitize_gpu_name(prof.gpu_name)}.yaml)", file=out)
            rc = 1
        bad = 0
        compiled = 0
        stale = prof.stale()
        for ck, bk, rec in prof.records():
            kernel, dtype, d, group, page = ck
            if kernel not in kernels():
                print(f"  note {path.name}: kernel {kernel!r} is unknown to this version; entry not checked", file=out)
                continue
            space = get_space(kernel)
            cfg = space.config_from_dict(rec["config"])
            rows = group * bk[2]
            probs = space.static_problems(cfg, head_dim=d, page_size=page, rows=rows, dtype=dtype)
            if probs:
                bad += 1
                print(f"  ILLEGAL {path.name} {kernel} {dtype} d{d} g{group} p{page} {bk}: {'; '.join(probs)}", file=out)
                continue
            if compile_fn is not None:
                try:
                    _compile_entry(compile_fn, kernel, cfg, dtype, d, page, group, bk[2])
                    compiled += 1
                except Exception as e:
                    bad += 1
                    print(f"  COMPILE FAILED {path.name} {kernel} {dtype} d{d} g{group} p{page} {bk} {cfg}: "
                          f"{type(e).__name__}: {e}", file=out)
        status = "OK" if not bad else "FAILED"
        extra = f", {compiled} compiled" if compile_fn is not None else ""
        extra += f", {len(stale)} stale (used while legal)" if stale else ""
        print(f"{status:<7} {path}: {prof.gpu_name}, {len(prof)} bucket(s){extra}", file=out)
        if prof.migrated_from is not None:
            print(f"  note: schema {prof.migrated_from} file, read as schema {prof.schema_version} "
                  "(its stale entries are used while legal until re-tuned; the next tune writes the new schema)",
                  file=out)
        for n in prof.compat_problems():
            print(f"  not used by the lookup: {n}", file=out)
        for line in _stale_lines(stale, path):
            print(line, file=out)
        if bad:
            rc = max(rc, 1)
    return 2 if machine_bad else rc


def _machine_problem(e: ProfileError) -> bool:
    """Whether a profile was refused (also) for its ``machine:`` section, the planner's rates."""
    return any(f == "machine" or f.startswith("machine.") for f in getattr(e, "fields", ()))


def _stale_lines(stale, path) -> list[str]:
    """One line per stale bucket (used while legal: not a failure), then a re-tune hint per kernel."""
    lines = [f"  stale {path.name} {ck[0]} {ck[1]} d{ck[2]} g{ck[3]} p{ck[4]} {bk}: {why}" for ck, bk, why in stale]
    for kernel in sorted({ck[0] for ck, _bk, _why in stale}):
        lines.append(f"  stale {kernel} entries are used while their configs are legal; re-tune them with "
                     f"{TUNE_COMMAND} run --kernel {kernel} (--preset NAME | --shape ...) --output {path.parent}")
    return lines


def resolve_gpu_name(name: str) -> str:
    """The GPU name as its profile spells it: the file's spelling (NVIDIA_H200) finds 'NVIDIA H200'."""
    for path in find_profiles(name):
        try:
            prof = load_profile(path)
        except ProfileError:
            continue
        if sanitize_gpu_name(prof.gpu_name) == sanitize_gpu_name(name):
            return prof.gpu_name
    return name


def _cmd_lookup(a, out) -> int:
    hq, hkv, d, b, ctx, q = a.shape
    group = hq // hkv
    op = op_kernel(group, q)
    kernel = a.kernel or op
    gpu = resolve_gpu_name(a.gpu)
    try:
        dec = explain_config(kernel, gpu_name=gpu, kernel_hash=current_kernel_hash(kernel), dtype=a.dtype,
                             head_dim=d, group=group, page_size=a.page_size, batch=b, context=ctx, q_len=q,
                             rows=group * q)
    except ProfileMissError as e:
        print(str(e), file=out)
        return 1
    except envvars.EnvironmentVariableError:
        raise
    except (ConfigError, ValueError) as e:
        print(f"directkv-tune lookup: no {kernel} config for this launch: {e}", file=sys.stderr)
        return 2
    if kernel == "q_tiled":
        note = (" (the op runs it for multi-token calls over HBM pages, or over host pages it stages, when its "
                "cost model says so)")
    else:
        note = "" if kernel == op else f" (the op runs {op} for group x q_len = {group * q}; asked with --kernel)"
    print(f"kernel:  {kernel}{note}", file=out)
    if gpu != a.gpu:
        print(f"gpu:     {gpu}", file=out)
    print(f"source:  {dec.source}", file=out)
    print(f"config:  {dec.config}", file=out)
    if dec.bucket:
        print(f"bucket:  batch={dec.bucket[0]} context={dec.bucket[1]} q_len={dec.bucket[2]}", file=out)
    print(f"profile: {dec.profile_path or '(none)'} (expected at {dec.expected_path})", file=out)
    if dec.reason:
        print(f"why:     {dec.reason}", file=out)
    return 0


def _cmd_presets(_a, out) -> int:
    rows = [[p.name, str(p.num_q_heads), str(p.num_kv_heads), str(p.group), str(p.head_dim), str(p.hidden_size),
             str(p.num_layers), ",".join(map(str, p.batches)), ",".join(map(str, p.contexts)),
             ",".join(map(str, p.q_lens)), str(p.page_size), p.dtype, p.source] for p in _presets.PRESETS.values()]
    print(plain_table(["preset", "hq", "hkv", "group", "d", "hidden", "layers", "batches", "contexts", "q_lens",
                       "page", "dtype", "source"], rows), file=out)
    print(f"--preset all: every preset but {', '.join(TEST_PRESETS)} (a test shape); the names are "
          "directkv-generate's (directkv_cute.presets), also spelled as on the Hub (Meta-Llama-3-8B, "
          "Qwen2.5-7B-Instruct, Mistral-Large-Instruct-2407)", file=out)
    for kernel, kb in sorted(_presets.KERNEL_BUCKETS.items()):
        print(f"--kernel {kernel}: every preset with batches {','.join(map(str, kb['batches']))}, contexts "
              f"{','.join(map(str, kb['contexts']))}, q_lens {','.join(map(str, kb['q_lens']))} "
              "(unless --batches / --contexts / --q-lens say otherwise)", file=out)
    return 0


def _cmd_machine(a, out) -> int:
    output = None if a.dry_run else (a.output if a.output is not None else default_output_dir())
    problem = None if output is None else _folder_problem(output, "--output")
    if problem:
        return _fail(problem)
    try:
        probes = _machine.gpu_probes()
    except (RuntimeError, ImportError) as e:
        return _fail(e)
    env = dict(probes.env)
    if a.gpu:
        env["gpu_name"] = resolve_gpu_name(a.gpu)
    problem = None if output is None else output_problem(output, env["gpu_name"])
    if problem:
        return _fail(problem)
    print(f"directkv-tune machine: measuring the machine model of {probes.gpu_name}", file=out, flush=True)
    try:
        measured = _machine.measure_machine(probes, env["gpu_name"],
                                            log=lambda msg: print(f"  {msg}", file=out, flush=True))
    except (_machine.MeasureError, ValueError) as e:
        return _fail(f"machine: {e}", 1)
    print(plain_table(["rate", "value", "how"], _machine.table_rows(measured)), file=out)
    if output is None:
        print(dump_yaml({"machine": _machine.rounded(measured.model)}, default_flow_style=None, width=120), file=out)
        print("profile: not written (--dry-run)", file=out)
        return 0
    path = _machine.write_profile(output, env, measured)
    print(f"profile: {path} (machine: written, its entries kept)", file=out)
    return 0


def _cmd_restamp(a, out) -> int:
    paths = list(a.profile) or list_profiles(_profiles.bundled_profile_dir())
    if not paths:
        return _fail(f"restamp: no profiles in {_profiles.bundled_profile_dir()} (name one with --profile FILE)")
    try:
        return _restamp.run(paths, against=a.against, dry_run=a.dry_run, verbose=a.verbose, out=out)
    except _restamp.RestampError as e:
        return _fail(f"restamp: {e}")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in SUBCOMMANDS and argv[0] not in ("-h", "--help")):
        argv.insert(0, "run")
    a = build_parser().parse_args(argv)
    out = sys.stdout
    try:
        return {"run": _cmd_run, "show": _cmd_show, "check": _cmd_check, "lookup": _cmd_lookup,
                "presets": _cmd_presets, "machine": _cmd_machine, "restamp": _cmd_restamp}[a.cmd](a, out)
    except (ProfileError, envvars.EnvironmentVariableError) as e:  # a bad file or variable: one line
        return _fail(e)


if __name__ == "__main__":
    sys.exit(main())
