"""``directkv-tune``: tune kernel configs per GPU and manage the YAML profiles.

    directkv-tune [run] (--preset NAME ... | --shape HQ,HKV,D,BATCH,CONTEXT,QLEN ...) [options]
    directkv-tune show   [--dir DIR | FILE ...] [--gpu NAME] [--format table|json|yaml]
    directkv-tune check  [--dir DIR] [--compile]
    directkv-tune lookup --gpu NAME --shape HQ,HKV,D,BATCH,CONTEXT,QLEN [--page-size N] [--dtype T]
    directkv-tune presets

``run`` is the default subcommand. Without a source checkout install, run it as
``python -m tuning.cli`` from the repository root.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import yaml

from . import presets as _presets
from .profiles import PROFILE_DIR_ENV, TUNE_COMMAND, ProfileError, current_kernel_hash, list_profiles, load_profile, \
    profile_dirs, sanitize_gpu_name
from .space import TuneShape, get_space, kernels, normalize_dtype

SUBCOMMANDS = ("run", "show", "check", "lookup", "presets")
CACHE_DIR_ENV = "DIRECTKV_CACHE_DIR"


def default_cache_dir() -> Path:
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "directkv-cute"


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
    return tuple(vals)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="directkv-tune",
        description="Autotune directkv-cute kernels (Optuna) and manage per-GPU YAML profiles.",
    )
    sub = ap.add_subparsers(dest="cmd")

    r = sub.add_parser("run", help="tune shape buckets and write the GPU's profile (default subcommand)")
    src = r.add_argument_group("what to tune")
    src.add_argument("--kernel", default="decode", choices=kernels())
    src.add_argument("--preset", action="append", default=[], metavar="NAME",
                     help=f"model preset ({', '.join(_presets.PRESETS)} or 'all'); repeatable")
    src.add_argument("--shape", action="append", default=[], type=_shape_arg, metavar="HQ,HKV,D,BATCH,CONTEXT,QLEN",
                     help="an explicit shape bucket; repeatable")
    src.add_argument("--batches", type=_int_list, help="override the presets' batch buckets, e.g. 1,4,16,64")
    src.add_argument("--contexts", type=_int_list, help="override the presets' context buckets, e.g. 4096,32768")
    src.add_argument("--q-lens", type=_int_list, help="override the presets' q_len buckets")
    src.add_argument("--dtype", default="bf16", help="bf16 (default) or fp16")
    src.add_argument("--page-size", type=int, default=_presets.DEFAULT_PAGE_SIZE)
    how = r.add_argument_group("search")
    how.add_argument("--objective", choices=("gpu", "model"), default="gpu",
                     help="gpu: measure on this machine's GPU; model: deterministic cost model (CPU demo)")
    how.add_argument("--trials", type=int, default=40, help="distinct configs measured per bucket (default 40)")
    how.add_argument("--time-budget", type=float, default=None, metavar="SECONDS", help="wall-clock budget of the run")
    how.add_argument("--seed", type=int, default=0)
    how.add_argument("--top-k", type=int, default=3, help="configs re-benchmarked with more repetitions")
    how.add_argument("--exhaustive-threshold", type=int, default=128,
                     help="search every legal config when there are at most this many (default 128)")
    how.add_argument("--max-host-gib", type=float, default=40.0, help="pinned host memory the gpu objective may use")
    store = r.add_argument_group("storage")
    store.add_argument("--output", type=Path, default=None,
                       help=f"profile folder (default: ${PROFILE_DIR_ENV} or the bundled profiles; "
                            "the model objective writes only with --output)")
    store.add_argument("--resume", action="store_true", help="continue the journal in the cache folder")
    store.add_argument("--storage", type=Path, default=None, help="Optuna journal file to use (continued if it exists)")
    store.add_argument("--cache-dir", type=Path, default=None,
                       help=f"folder of the default journal (${CACHE_DIR_ENV}, else ~/.cache/directkv-cute)")
    r.add_argument("--dry-run", action="store_true", help="print the space, the legal counts and the buckets; run nothing")
    r.add_argument("-q", "--quiet", action="store_true", help="no progress bar")

    s = sub.add_parser("show", help="print profile entries")
    s.add_argument("files", nargs="*", type=Path, help="profile files (default: every profile in the folder)")
    s.add_argument("--dir", type=Path, default=None, help="profile folder (default: the lookup's folders)")
    s.add_argument("--gpu", default=None, help="only the profile of this GPU name")
    s.add_argument("--format", choices=("table", "json", "yaml"), default="table")

    c = sub.add_parser("check", help="validate every profile (and optionally compile every entry)")
    c.add_argument("--dir", type=Path, default=None, help="profile folder (default: the lookup's folders)")
    c.add_argument("--compile", action="store_true", help="compile each entry's config for sm_90a (no GPU needed)")

    lk = sub.add_parser("lookup", help="which config the op would pick for a launch, and why")
    lk.add_argument("--gpu", required=True)
    lk.add_argument("--shape", required=True, type=_shape_arg, metavar="HQ,HKV,D,BATCH,CONTEXT,QLEN")
    lk.add_argument("--page-size", type=int, default=_presets.DEFAULT_PAGE_SIZE)
    lk.add_argument("--dtype", default="bf16")
    lk.add_argument("--kernel", default="decode", choices=kernels())

    sub.add_parser("presets", help="list the model presets and their buckets")
    return ap


# ---- run -------------------------------------------------------------------------------------


def _shapes_from_args(a) -> list[TuneShape]:
    dtype = normalize_dtype(a.dtype)
    shapes = []
    for p in _presets.resolve_presets(a.preset):
        shapes += p.shapes(batches=a.batches, contexts=a.contexts, q_lens=a.q_lens, page_size=a.page_size, dtype=dtype)
    for hq, hkv, d, b, ctx, q in a.shape:
        shapes.append(TuneShape(hq, hkv, d, b, ctx, q, page_size=a.page_size, dtype=dtype))
    # buckets that differ only in query heads (Llama-3-8B / -70B / Mistral-Large) next to each other,
    # so the GPU objective builds each KV cache once
    return sorted(_presets.unique_shapes(shapes), key=lambda s: (
        s.dtype, s.head_dim, s.num_kv_heads, s.page_size, s.q_len, s.batch, s.context, s.num_q_heads))


def _dry_run(a, shapes, out) -> int:
    space = get_space(a.kernel)
    p = lambda *x: print(*x, file=out)  # noqa: E731
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
        rep = space.legality(s)
        mode = "exhaustive" if rep.legal_count <= a.exhaustive_threshold else "tpe"
        p(f"  hq={s.num_q_heads} hkv={s.num_kv_heads} d={s.head_dim} group={s.group} q_len={s.q_len} "
          f"page={s.page_size} {s.dtype}: {rep.legal_count} legal of {rep.total} -> {mode}")
        for reason, n in sorted(rep.reason_counts().items(), key=lambda x: -x[1]):
            p(f"      excluded {n:5d}: {reason}")
        p(f"      default: {space.default_for(s)}")
    p("")
    p(f"{len(shapes)} bucket(s), up to {a.trials} configs each:")
    rows = [[str(s.num_q_heads), str(s.num_kv_heads), str(s.head_dim), str(s.group), str(s.batch), str(s.context),
             str(s.q_len), f"{s.kv_bytes() / 2**20:.0f}",
             str(space.launch_classes(s))] for s in shapes]
    from .tuner import plain_table

    p(plain_table(["hq", "hkv", "d", "group", "batch", "context", "q_len", "KV MiB/layer", "launches"], rows))
    p("")
    p(f"objective: {a.objective}; seed {a.seed}; time budget {a.time_budget or 'none'}; nothing was run (--dry-run)")
    return 0


def _make_objective(a):
    from .objectives import GpuObjective, ModelledObjective

    if a.objective == "model":
        return ModelledObjective(seed=a.seed)
    return GpuObjective(seed=a.seed, max_host_bytes=int(a.max_host_gib * (1 << 30)), kernel=a.kernel)


def _cmd_run(a, out) -> int:
    try:
        shapes = _shapes_from_args(a)
    except (KeyError, ValueError) as e:
        print(f"directkv-tune: {e}", file=sys.stderr)
        return 2
    if not shapes:
        print("directkv-tune run: give --preset NAME (or 'all') or --shape HQ,HKV,D,BATCH,CONTEXT,QLEN", file=sys.stderr)
        return 2
    if a.dry_run:
        return _dry_run(a, shapes, out)

    from .tuner import TuneOptions, Tuner, TunerAbort, format_results

    try:
        objective = _make_objective(a)
    except (RuntimeError, ImportError) as e:
        print(f"directkv-tune: {e}", file=sys.stderr)
        return 2
    env = objective.environment()
    gpu = env["gpu_name"]
    if a.output is not None:
        output = a.output
    elif a.objective == "gpu":
        output = profile_dirs()[0]
    else:
        output = None
    if a.storage is not None:
        journal = a.storage
    else:
        journal = (a.cache_dir or default_cache_dir()) / f"tune-{sanitize_gpu_name(gpu)}-{a.kernel}-{a.objective}.journal"
        if journal.exists() and not a.resume:
            journal.replace(journal.with_suffix(".journal.prev"))
            print(f"(moved the previous journal to {journal.with_suffix('.journal.prev')}; use --resume to continue one)",
                  file=sys.stderr)
    opts = TuneOptions(n_trials=a.trials, time_budget_s=a.time_budget, seed=a.seed, top_k=a.top_k,
                       exhaustive_threshold=a.exhaustive_threshold, progress=not a.quiet)
    tuner = Tuner(a.kernel, objective, storage=journal, options=opts, output_dir=output, environment=env)
    print(f"directkv-tune: {len(shapes)} bucket(s) of {a.kernel} on {gpu} ({a.objective} objective), "
          f"journal {journal}", file=out)
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
    if tuner.profile_path is not None:
        print(f"profile: {tuner.profile_path}", file=out)
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


def _cmd_show(a, out) -> int:
    from .tuner import plain_table

    paths = _profile_files(a.dir, a.files)
    docs, rc = [], 0
    for path in paths:
        try:
            prof = load_profile(path)
        except ProfileError as e:
            print(f"error: {e}", file=sys.stderr)
            rc = 1
            continue
        if a.gpu and prof.gpu_name != a.gpu and sanitize_gpu_name(a.gpu) != path.stem:
            continue
        docs.append((path, prof))
    if a.format == "json":
        print(json.dumps({str(p): prof.to_doc() for p, prof in docs}, indent=2), file=out)
        return rc
    if a.format == "yaml":
        print(yaml.safe_dump({str(p): prof.to_doc() for p, prof in docs}, sort_keys=False), file=out)
        return rc
    if not docs:
        print("no profiles found in " + ", ".join(str(d) for d in ([a.dir] if a.dir else profile_dirs())), file=out)
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


def _resolve_compile():
    """compile_decode from directkv_cute.kernels.decode (the contract), or a clear error string."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import importlib

    try:
        mod = importlib.import_module("directkv_cute.kernels.decode")
    except ModuleNotFoundError as e:
        if e.name in ("directkv_cute.kernels.decode",):
            return None, "directkv_cute.kernels.decode does not exist yet: cannot compile the entries"
        return None, f"cannot import directkv_cute.kernels.decode: {e}"
    except Exception as e:
        return None, f"cannot import directkv_cute.kernels.decode: {type(e).__name__}: {e}"
    fn = getattr(mod, "compile_decode", None)
    if fn is not None:
        return fn, ""
    try:  # the implementation may keep it next door
        jit = importlib.import_module("directkv_cute.kernels.jit")
        if getattr(jit, "compile_decode", None) is not None:
            return jit.compile_decode, "(note: compile_decode found in directkv_cute.kernels.jit, not in decode)"
    except Exception:
        pass
    return None, "directkv_cute.kernels.decode has no compile_decode(cfg, dtype, head_dim, page_size, group, max_q_len)"


def _cmd_check(a, out) -> int:
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
        elif note:
            print(note, file=out)
    rc = 0 if (compile_fn is not None or not a.compile) else 1
    from .space import torch_dtype

    for path in paths:
        try:
            prof = load_profile(path)
        except ProfileError as e:
            print(f"INVALID {e}", file=out)
            rc = 1
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
            if compile_fn is not None and kernel == "decode":
                try:
                    compile_fn(cfg, dtype=torch_dtype(dtype), head_dim=d, page_size=page, group=group,
                               max_q_len=bk[2])
                    compiled += 1
                except Exception as e:
                    bad += 1
                    print(f"  COMPILE FAILED {path.name} {dtype} d{d} g{group} p{page} {bk} {cfg}: "
                          f"{type(e).__name__}: {e}", file=out)
        status = "OK" if not bad else "FAILED"
        extra = f", {compiled} compiled" if compile_fn is not None else ""
        extra += f", {len(stale)} stale (used while legal)" if stale else ""
        print(f"{status:<7} {path}: {prof.gpu_name}, {len(prof)} bucket(s){extra}", file=out)
        if prof.migrated_from is not None:
            print(f"  note: schema {prof.migrated_from} file, read as schema {prof.schema_version} "
                  "(every entry stale until re-tuned; the next tune writes the new schema)", file=out)
        for n in prof.compat_problems():
            print(f"  not used by the lookup: {n}", file=out)
        for line in _stale_lines(stale, path):
            print(line, file=out)
        if bad:
            rc = 1
    return rc


def _stale_lines(stale, path) -> list[str]:
    """One line per stale bucket (used while legal: not a failure), then a re-tune hint per kernel."""
    lines = [f"  stale {path.name} {ck[0]} {ck[1]} d{ck[2]} g{ck[3]} p{ck[4]} {bk}: {why}" for ck, bk, why in stale]
    for kernel in sorted({ck[0] for ck, _bk, _why in stale}):
        lines.append(f"  stale {kernel} entries are used while their configs are legal; re-tune them with "
                     f"{TUNE_COMMAND} run --kernel {kernel} (--preset NAME | --shape ...) --output {path.parent}")
    return lines


def _cmd_lookup(a, out) -> int:
    from .lookup import ProfileMissError, explain_config

    hq, hkv, d, b, ctx, q = a.shape
    group = hq // hkv
    try:
        dec = explain_config(a.kernel, gpu_name=a.gpu, kernel_hash=current_kernel_hash(a.kernel), dtype=a.dtype,
                             head_dim=d, group=group, page_size=a.page_size, batch=b, context=ctx, q_len=q,
                             rows=group * q)
    except ProfileMissError as e:
        print(str(e), file=out)
        return 1
    print(f"source:  {dec.source}", file=out)
    print(f"config:  {dec.config}", file=out)
    if dec.bucket:
        print(f"bucket:  batch={dec.bucket[0]} context={dec.bucket[1]} q_len={dec.bucket[2]}", file=out)
    print(f"profile: {dec.profile_path or '(none)'} (expected at {dec.expected_path})", file=out)
    if dec.reason:
        print(f"why:     {dec.reason}", file=out)
    return 0


def _cmd_presets(_a, out) -> int:
    from .tuner import plain_table

    rows = [[p.name, str(p.num_q_heads), str(p.num_kv_heads), str(p.group), str(p.head_dim), str(p.hidden_size),
             str(p.num_layers), ",".join(map(str, p.batches)), ",".join(map(str, p.contexts)),
             ",".join(map(str, p.q_lens)), str(p.page_size), p.dtype, p.source] for p in _presets.PRESETS.values()]
    print(plain_table(["preset", "hq", "hkv", "group", "d", "hidden", "layers", "batches", "contexts", "q_lens",
                       "page", "dtype", "source"], rows), file=out)
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in SUBCOMMANDS and argv[0] not in ("-h", "--help")):
        argv.insert(0, "run")
    a = build_parser().parse_args(argv)
    out = sys.stdout
    try:
        return {"run": _cmd_run, "show": _cmd_show, "check": _cmd_check, "lookup": _cmd_lookup,
                "presets": _cmd_presets}[a.cmd](a, out)
    except ProfileError as e:
        print(f"directkv-tune: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
