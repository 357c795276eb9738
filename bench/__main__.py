"""``python -m bench {decode,prefill,all,prefix,kvproj,fp8-accuracy,sparse-accuracy,check,regress,refresh,timeline,
breakdown,plot,e2e,vllm,serve,soak}``,
run from the root of a source checkout (``bench`` is not installed with the package).

decode | prefill | all   run the GPU benchmarks (``--quick`` default, ``--full``), print the
                        tables, write <out-dir>/<gpu>-<date>[-bench].json, the tables and PNG
                        plots; exit 1 if a correctness check failed.
prefix                  batches forked from one shared prompt: cascade attention (shared
                        pages read once per batch) vs the per-sequence kernels and the
                        baselines, with targets (``bench/prefix.py``; ``--device cpu`` smoke).
kvproj                  the fused K/V projection + RoPE + store kernel vs cuBLAS + the rotary
                        math + write_slots, host and HBM pages, with ceilings and the target
                        per row (``bench/kvproj.py``; ``--device cpu`` smoke).
fp8-accuracy            FP8 KV pages: op output error vs float64 for bf16 and FP8 pages per scale
                        granularity (random and heavy-tailed K), and end-to-end greedy agreement
                        and logit error of FP8 vs bf16 KV on a random-weight Llama (CPU by
                        design; ``bench/fp8_accuracy.py``).
sparse-accuracy         RULER-style tasks (needles, variable tracking, common / frequent words) at 4k
                        and 8k tokens on SmolLM2-135M-Instruct: transformers' cache, exact DirectKV
                        and page budgets (1/4, 1/8, 1/16), FP8 pages; mean score per task and method,
                        its difference to exact and the attention mass of the selected pages
                        (``bench/sparse_accuracy.py``; ``--device cpu`` smoke).
check                   the GPU-free CI part: profiles validate, every default / profile config
                        compiles for sm_90a, the host-traffic model reads each byte once.
regress                 compare a run (``--results FILE``, or a fresh run replaying the
                        baseline's options) with bench/baselines/<gpu>.json; exit 1 on a
                        regression, a missing record or a failed check.
refresh                 make a run (``--results FILE`` or a fresh one) the baseline of its GPU,
                        only if it passed every correctness check.
timeline                per-CTA chunk and pass timeline of the multi-token kernel, compiled
                        with its timeline stamps (GPU only; ``bench/timeline.py``).
breakdown               the kernels and copies of one op call, their GPU times and the gaps
                        between them, from torch.profiler (GPU only; ``bench/breakdown.py``).
vllm                    vLLM 0.26 serving the same model shape with dummy weights as a peer: all KV in
                        HBM, with vLLM's native host offloading and with the DirectKV plugin (all KV
                        in pinned host memory), TTFT, ms per token, tokens/s and memory per context
                        and batch, next to the link floor (``bench/vllm.py``; GPU only, each engine
                        in its own worker process).
serve                   vLLM's serving benchmark (``vllm bench serve``) against ``vllm serve``, one
                        engine at a time (hbm, offload, directkv, directkv-hbm=X): TTFT, TPOT, ITL,
                        throughput, goodput and preemptions per concurrency or request rate, with
                        ratios to the hbm engine (``bench/serve.py``; GPU only).
soak                    >= 1,000 requests of mixed lengths, some cut off mid-decode, through ``vllm serve``
                        with the DirectKV backend: every request served, the KV cache free when idle,
                        RSS and pinned bytes flat after the warm-up, no error in the server log
                        (``bench/soak.py``; GPU only).
plot                    PNG plots of a results JSON (``--results FILE``; a prefix run's too),
                        for runs made where matplotlib is missing; exit 2 if it cannot plot.

Every command that writes files writes them under ``--out-dir`` (default ./bench-results under
the current directory, created on demand; ``refresh`` writes bench/baselines/, its job). Without
a CUDA GPU the GPU benches refuse (exit status 2) unless ``--device cpu`` asks for a smoke run
(``timeline``, ``breakdown``, ``vllm``, ``serve`` and ``soak`` have none); a CPU run prints no
ceilings and no targets. ``check``, ``plot``, ``fp8-accuracy`` and ``regress`` / ``refresh`` of
given ``--results`` files need no GPU.
"""

from __future__ import annotations

import argparse
import sys

from bench.breakdown import add_arguments as add_breakdown_arguments
from bench.common import add_out_dir_argument
from bench.breakdown import cmd_breakdown
from bench.e2e import add_arguments as add_e2e_arguments
from bench.e2e import cmd_e2e
from bench.fp8_accuracy import add_arguments as add_fp8_arguments
from bench.fp8_accuracy import cmd_fp8_accuracy
from bench.kvproj import add_arguments as add_kvproj_arguments
from bench.kvproj import cmd_kvproj
from bench.prefix import add_arguments as add_prefix_arguments
from bench.prefix import cmd_prefix
from bench.regress import DEFAULT_ATOL, DEFAULT_MIN_MS, DEFAULT_RTOL
from bench.serve import add_arguments as add_serve_arguments
from bench.serve import cmd_serve
from bench.soak import add_arguments as add_soak_arguments
from bench.sparse_accuracy import add_arguments as add_sparse_accuracy_arguments
from bench.sparse_accuracy import cmd_sparse_accuracy
from bench.soak import cmd_soak
from bench.timeline import add_arguments as add_timeline_arguments
from bench.timeline import cmd_timeline
from bench.vllm import add_arguments as add_vllm_arguments
from bench.vllm import cmd_vllm

REPLAYED_ARGS = ("preset", "batches", "contexts", "q_lens", "heads", "head_dim", "dtype", "page_size",
                 "hbm_fractions", "placement", "num_layers", "max_gb", "config")


def build_parser() -> argparse.ArgumentParser:
    from bench.suite import add_run_arguments

    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for name, text in (("decode", "decode sweep over host KV, hybrid HBM fractions"),
                       ("prefill", "multi-token queries over host KV"), ("all", "decode then prefill")):
        add_run_arguments(sub.add_parser(name, help=text))

    c = sub.add_parser("check", help="GPU-free CI checks: profiles, compile for sm_90a, traffic model")
    c.add_argument("--no-profiles", action="store_true")
    c.add_argument("--no-compile", action="store_true")
    c.add_argument("--no-traffic", action="store_true")
    c.add_argument("--no-fp16", action="store_true", help="skip the float16 compile spot checks")
    c.add_argument("--profile-dir", default=None, help="validate these profiles instead of the shipped ones")
    c.add_argument("--verbose", action="store_true", help="list every compiled kernel")
    c.add_argument("--no-progress", action="store_true")

    add_timeline_arguments(sub.add_parser("timeline", help="per-CTA chunk and pass timeline of the multi-token kernel"))
    add_breakdown_arguments(sub.add_parser("breakdown", help="GPU time of each kernel and copy of one op call"))
    add_e2e_arguments(sub.add_parser("e2e", help="end to end: a whole model's prefill and decode, ours vs transformers' caches"))
    add_prefix_arguments(sub.add_parser("prefix", help="forks of one shared prompt: cascade vs per-sequence attention"))
    add_kvproj_arguments(sub.add_parser("kvproj", help="fused K/V projection + RoPE + store vs the separate path"))
    add_vllm_arguments(sub.add_parser("vllm", help="vLLM (HBM, native offload) as a peer, and vLLM + the DirectKV plugin"))
    add_serve_arguments(sub.add_parser("serve", help="vllm bench serve against vllm serve, one engine at a time"))
    add_soak_arguments(sub.add_parser("soak", help="vllm serve with the DirectKV backend under a long mixed load"))
    add_fp8_arguments(sub.add_parser("fp8-accuracy", help="FP8 KV pages: op and end-to-end accuracy vs bf16 (CPU)"))
    add_sparse_accuracy_arguments(sub.add_parser(
        "sparse-accuracy", help="RULER-style tasks on a real model: exact vs page budgets vs FP8 pages"))

    pl = sub.add_parser("plot", help="PNG plots of a results JSON (made where matplotlib is missing)")
    pl.add_argument("--results", required=True, help="a results JSON written by decode / prefill / all / prefix")
    pl.add_argument("--prefix", default=None,
                    help="PNG path prefix (default: <out-dir>/<the JSON's name without .json>)")
    add_out_dir_argument(pl, "the PNG files")

    for name, text in (("regress", "compare a run with the committed baseline of its GPU"),
                       ("refresh", "make a passing run the baseline of its GPU")):
        r = sub.add_parser(name, help=text)
        if name == "refresh":
            r.add_argument("--results", action="append", default=None,
                           help="a results JSON (default: run the benchmarks now); give it several times to "
                                "build the baseline from several runs: medians, with their spread as the tolerance")
        else:
            r.add_argument("--results", default=None, help="a results JSON (default: run the benchmarks now)")
        r.add_argument("--baseline-dir", default=None, help="default bench/baselines")
        if name == "regress":
            r.add_argument("--baseline", default=None, help="a baseline JSON (default <baseline-dir>/<gpu>.json)")
            r.add_argument("--rtol", type=float, default=DEFAULT_RTOL)
            r.add_argument("--atol", type=float, default=DEFAULT_ATOL)
            r.add_argument("--min-ms", type=float, default=DEFAULT_MIN_MS,
                           help="records faster than this in the baseline report drops as 'noisy' (default 1 ms)")
            r.add_argument("--allow-missing", action="store_true", help="report missing records without failing")
            r.add_argument("--show-all", action="store_true", help="list every tracked ratio, not only changes")
        add_run_arguments(r)
    return p


def cmd_run(ns: argparse.Namespace) -> int:
    from bench.suite import run_suite

    benches = ["decode", "prefill"] if ns.command == "all" else [ns.command]
    return run_suite(ns, benches).exit_code


def cmd_check(ns: argparse.Namespace) -> int:
    from bench.check import run_check

    return run_check(profiles=not ns.no_profiles, compile=not ns.no_compile, traffic=not ns.no_traffic,
                     profile_dir=ns.profile_dir, fp16=not ns.no_fp16, progress=not ns.no_progress,
                     verbose=ns.verbose)


def _fresh_run(ns: argparse.Namespace, benches: list[str]) -> dict:
    from bench.suite import run_suite

    result = run_suite(ns, benches)
    return result.combined or result.docs[benches[0]]


def _baseline_dir(ns: argparse.Namespace):
    from bench.regress import BASELINE_DIR

    return ns.baseline_dir or BASELINE_DIR


def _replay(ns: argparse.Namespace, args: dict) -> dict:
    """A fresh run of the baseline's benches with its shapes and options: each bench with its own
    arguments when the baseline merged separate runs (``per_bench``), else all with the same."""
    import copy

    from bench.common import merge_results

    benches = list(args.get("benches", ["decode", "prefill"]))
    per_bench = args.get("per_bench") or {}
    groups = [[b] for b in benches] if per_bench else [benches]
    docs = []
    for group in groups:
        run_ns = copy.copy(ns)
        source = per_bench.get(group[0], args)
        for key in REPLAYED_ARGS:  # replay the baseline's shapes and options
            if key in source:
                setattr(run_ns, key, source[key])
        docs.append(_fresh_run(run_ns, group))
    return docs[0] if len(docs) == 1 else merge_results("all", docs)


def cmd_regress(ns: argparse.Namespace) -> int:
    from bench.common import env_info, require_gpu
    from bench.regress import compare, format_report, load_baseline, read_results

    fresh = read_results(ns.results) if ns.results else None  # a bad file: one line, exit status 2
    if fresh is None:  # a fresh run: the GPU rule applies
        gpu_key = env_info(require_gpu(ns.device, command="bench regress"))["gpu_key"]
    else:
        gpu_key = fresh["header"]["gpu_key"]
    try:
        baseline = load_baseline(gpu_key, ns.baseline, _baseline_dir(ns))
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return 2
    if fresh is None:
        fresh = _replay(ns, baseline.get("args", {}))
    report = compare(baseline, fresh, rtol=ns.rtol, atol=ns.atol, allow_missing=ns.allow_missing, min_ms=ns.min_ms)
    print(format_report(report, show_all=ns.show_all))
    return 0 if report.ok else 1


def cmd_refresh(ns: argparse.Namespace) -> int:
    from bench.regress import RefreshRefused, read_results, refresh_baseline

    if ns.results:  # every file read and checked before anything is written (a bad one: one line, exit 2)
        doc, *more = [read_results(r) for r in ns.results]
        source = ", ".join(map(str, ns.results))
    else:
        doc, source, more = _fresh_run(ns, ["decode", "prefill"]), "fresh run", []
    try:
        path = refresh_baseline(doc, _baseline_dir(ns), source=source, more_runs=more)
    except RefreshRefused as e:
        print(f"refresh refused: {e}", file=sys.stderr)
        return 1
    print(f"baseline written: {path}")
    return 0


def cmd_plot(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from bench.common import checked_out_dir, load_json, validate_results
    from bench.plots import PlotError, plot_results

    try:
        doc = load_json(ns.results)
    except (OSError, ValueError) as e:
        print(f"cannot read {ns.results}: {e}", file=sys.stderr)
        return 2
    problems = validate_results(doc)
    if problems:
        print(f"{ns.results} is not a results document: {problems[0]}", file=sys.stderr)
        return 2
    if ns.prefix:
        checked_out_dir(Path(ns.prefix).parent, "--prefix's folder")
        prefix = ns.prefix
    else:
        prefix = str(checked_out_dir(ns.out_dir) / Path(ns.results).with_suffix("").name)
    folder = Path(prefix).parent
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    try:
        if doc.get("bench") == "prefix":
            from bench.prefix import plot_prefix

            png = plot_prefix(doc, prefix + ".png")
            if png is None:
                raise PlotError("matplotlib is not installed or the document has no measured prefix rows")
            files = [png]
        else:
            files = plot_results(doc, prefix)
    except PlotError as e:
        if created and not any(folder.iterdir()):
            folder.rmdir()
        print(f"no plots: {e}", file=sys.stderr)
        return 2
    for f in files:
        print(f)
    return 0


COMMANDS = {"decode": cmd_run, "prefill": cmd_run, "all": cmd_run, "check": cmd_check,
            "regress": cmd_regress, "refresh": cmd_refresh, "timeline": cmd_timeline, "breakdown": cmd_breakdown,
            "plot": cmd_plot, "e2e": cmd_e2e, "prefix": cmd_prefix, "kvproj": cmd_kvproj,
            "fp8-accuracy": cmd_fp8_accuracy, "sparse-accuracy": cmd_sparse_accuracy, "vllm": cmd_vllm,
            "serve": cmd_serve, "soak": cmd_soak}


def main(argv: list[str] | None = None) -> int:
    """Run a command; a command line this machine cannot run (``UsageError``: no GPU, an unusable
    ``--out-dir``) is one line on stderr and exit status 2."""
    from bench.common import exit_status

    ns = build_parser().parse_args(argv)
    return exit_status(COMMANDS[ns.command], ns)


if __name__ == "__main__":
    sys.exit(main())
