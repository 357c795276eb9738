"""Running the GPU benchmarks: ceilings once per run, then each bench's shapes, then files.

Files (under ``--out-dir``, default ./bench-results): ``<gpu>-<date>-<bench>.json`` per bench
and its table as ``.txt``, ``<gpu>-<date>.json`` with every record when several benches ran
(``all``), and PNG plots next to them (GPU runs). JSON files are rewritten after every shape, so a
run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import decode, prefill
from bench.ceilings import measure_ceilings
from bench.harness import SKIPPABLE
from bench.common import (GiB, MiB, Ceilings, add_device_argument, add_out_dir_argument, checked_out_dir, env_info,
                          format_table, is_cpu_run, merge_results, new_results, problem_lines, require_gpu,
                          results_path, try_plot, write_json)
from bench.harness import BenchOptions, load_ours, run_shapes
from bench.plots import plot_decode, plot_prefill

BENCHES = {"decode": decode, "prefill": prefill}
DECODE_SHARE = 0.6  # of --time-budget-s, when both benches run


@dataclass
class SuiteResult:
    exit_code: int
    docs: dict = field(default_factory=dict)  # bench -> results document
    combined: dict | None = None
    files: list[Path] = field(default_factory=list)


# A CPU run (--device cpu) is a smoke test of the code paths: shapes capped to these.
CPU_MAX_CONTEXT = 2048
CPU_MAX_Q_LEN = 64
CPU_MAX_BATCH = 2


def cpu_shapes(shapes: list) -> list:
    """The shapes a CPU smoke run measures: the grid's within the CPU caps, else its smallest, capped."""
    small = [s for s in shapes if s.context <= CPU_MAX_CONTEXT and s.q_len <= CPU_MAX_Q_LEN
             and s.batch <= CPU_MAX_BATCH]
    if small:
        return small
    s = shapes[0]
    return [dataclasses.replace(s, context=CPU_MAX_CONTEXT, q_len=min(s.q_len, CPU_MAX_Q_LEN),
                                batch=min(s.batch, CPU_MAX_BATCH))]


def bench_options(ns: argparse.Namespace, bench: str, device: str, details: dict) -> BenchOptions:
    """BenchOptions for one bench from the parsed command line."""
    fractions = ns.hbm_fractions if ns.hbm_fractions is not None else BENCHES[bench].HBM_FRACTIONS
    return BenchOptions(
        device=device, page_size=ns.page_size, hbm_fractions=tuple(fractions), placement=ns.placement,
        num_layers=ns.num_layers, warmup=ns.warmup, reps=ns.reps, max_rep_s=ns.max_rep_s, tol=ns.tol,
        seed=ns.seed, max_gb=ns.max_gb, config=ns.config, compare_configs=tuple(ns.compare_configs),
        host_read_kernel=details.get("host_read", {}).get("kernel", "sum_f32"),
        hbm_read_kernel=details.get("hbm_read", {}).get("kernel", "sum_f32"),
        peers=not getattr(ns, "no_peers", False), window=getattr(ns, "window", False),
        skip_methods=tuple(getattr(ns, "skip_methods", ()) or ()), layers=getattr(ns, "layers", 1),
        kv_dtype=getattr(ns, "kv_dtype", None), sparse_budgets=tuple(getattr(ns, "sparse_budgets", ()) or ()))


def bench_shapes(ns: argparse.Namespace, bench: str, device: str = "cuda"):
    common = dict(heads=ns.heads, contexts=ns.contexts, head_dim=ns.head_dim, dtype=ns.dtype)
    if bench == "decode":
        shapes = decode.shapes(ns.preset, batches=ns.batches, **common)
    else:
        shapes = prefill.shapes(ns.preset, q_lens=ns.q_lens, batches=ns.batches, **common)
    return cpu_shapes(shapes) if device == "cpu" else shapes


def _json_args(ns: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(ns).items() if isinstance(v, (str, int, float, bool, list, tuple, dict, type(None)))
            and k != "func"}


def run_suite(ns: argparse.Namespace, benches: list[str], ours_loader=load_ours) -> SuiteResult:
    """Measure the ceilings, run each bench, write JSON, tables and plots (a CPU smoke run prints
    no ceilings and no targets, and draws no plots)."""
    device = require_gpu(ns.device, command="bench " + (getattr(ns, "command", None) or "+".join(benches)))
    out_dir = checked_out_dir(ns.out_dir)
    header = env_info(device)
    small = device != "cuda"
    print(f"directkv bench {'+'.join(benches)} ({ns.preset}) on {header['gpu']} -> {out_dir}", flush=True)
    ceilings, details = measure_ceilings(device, host_bytes=64 * MiB if small else int(ns.ceiling_gb * GiB),
                                         hbm_bytes=64 * MiB if small else int(2 * ns.ceiling_gb * GiB))
    if not small:
        print(f"ceilings: host read {ceilings.host_read_gbps:.2f} GB/s ({details['host_read']['kernel']}), "
              f"HBM read {ceilings.hbm_read_gbps:.1f} GB/s, memcpy H2D {ceilings.memcpy_h2d_gbps:.2f} GB/s",
              flush=True)
    result = SuiteResult(exit_code=0)
    start = time.monotonic()
    args = _json_args(ns) | {"benches": benches}
    for i, bench in enumerate(benches):
        deadline = _deadline(ns.time_budget_s, start, benches, i)
        doc = new_results(bench, header, ceilings, ceiling_details=details, args=args)
        path = results_path(out_dir, header, bench)
        write_json(path, doc)
        run_shapes(bench_shapes(ns, bench, device), bench_options(ns, bench, device, details), ceilings, doc, path,
                   deadline=deadline, progress=not ns.no_progress, ours_loader=ours_loader)
        result.docs[bench] = doc
        result.files.append(write_json(path, doc))
        text = summarize(doc)
        print(text, flush=True)
        txt = results_path(out_dir, header, bench, ext="txt")
        txt.write_text(text + "\n")
        result.files.append(txt)
        if not (ns.no_plot or small):
            result.files += _plots(doc, bench, out_dir, header)
    if len(benches) > 1:
        result.combined = merge_results("all", list(result.docs.values()))
        result.files.append(write_json(results_path(out_dir, header), result.combined))
    final = result.combined or result.docs[benches[0]]
    result.exit_code = 0 if final["passed"] else 1
    print("files:\n" + "\n".join(f"  {p}" for p in result.files), flush=True)
    print("PASSED all correctness checks" if final["passed"] else "FAILED: some correctness checks failed", flush=True)
    return result


def _deadline(budget: float | None, start: float, benches: list[str], index: int) -> float | None:
    """Deadline (time.monotonic) for starting shapes of bench ``index``: decode gets
    DECODE_SHARE of the budget when prefill also runs, the last bench gets the rest."""
    if budget is None:
        return None
    if index == len(benches) - 1:
        return start + budget
    return start + budget * (DECODE_SHARE if benches[index] == "decode" else 1.0 / len(benches))


def _plots(doc: dict, bench: str, out_dir: Path, header: dict) -> list[Path]:
    prefix = results_path(out_dir, header, bench).with_suffix("")
    files = try_plot(plot_decode if bench == "decode" else plot_prefill, doc, prefix)
    if files is None:
        return []
    if not files:
        print("no plots (matplotlib not installed or nothing measured)")
    return files


def summarize(doc: dict) -> str:
    """The full table of a bench plus its missing, skipped and failed items (and, on a GPU, the
    ceilings and the FP8 targets)."""
    cpu = is_cpu_run(doc["header"])
    ceilings = None if cpu else Ceilings.from_dict(doc["ceilings"])
    parts = [f"== {doc['bench']}: {len(doc['records'])} records",
             format_table(doc["records"], ceilings, doc["notes"].get("variants"))]
    for m in doc["missing"]:
        parts.append(f"missing: {m.get('method', 'ours')} on {m['shape']} (hbm {m['hbm_fractions']}): {m['reason']}")
    parts += problem_lines(doc)
    if not cpu:
        parts += fp8_target_lines(doc)
    return "\n".join(parts)


# Targets of FP8 pages (bench --kv-dtype): decode from FP8_MIN_CONTEXT up at least
# FP8_MIN_SPEEDUP x faster than ours over bf16 pages, at FP8_MIN_CEILING of the host-read ceiling
# in FP8 bytes; multi-token shapes no slower than bf16 where compute-bound.
FP8_MIN_CONTEXT = 32768
FP8_MIN_SPEEDUP = 1.9
FP8_MIN_CEILING = 0.98


def fp8_target_lines(doc: dict) -> list[str]:
    """MET / MISS lines of ours[fp8] (or ours[e5m2]) against ours over bf16 pages, host only."""
    key = lambda r: (r["batch"], r["context"], r["q_len"], r["hq"], r["hkv"])  # noqa: E731
    base = {key(r): r for r in doc["records"] if r["method"] == "ours" and r["hbm_fraction"] == 0.0 and r["ms"]}
    out = []
    for r in doc["records"]:
        if not (r["method"].startswith("ours[") and r["method"] in ("ours[fp8]", "ours[e5m2]") and r["ms"]):
            continue
        b = base.get(key(r))
        if b is None:
            continue
        label = f"B{r['batch']} ctx{r['context']} q{r['q_len']} {r['hq']}/{r['hkv']}"
        speed = b["ms"] / r["ms"]
        ceil = r["frac_of_ceiling"] or 0.0
        if r["q_len"] == 1 and r["context"] >= FP8_MIN_CONTEXT:
            for ok, what in ((speed >= FP8_MIN_SPEEDUP, f"{speed:.2f}x faster than bf16 pages "
                              f"({r['ms']:.3f} vs {b['ms']:.3f} ms; limit {FP8_MIN_SPEEDUP}x)"),
                             (ceil >= FP8_MIN_CEILING, f"{ceil:.1%} of the host-read ceiling in FP8 bytes "
                              f"(limit {FP8_MIN_CEILING:.0%})")):
                out.append(f"{'MET ' if ok else 'MISS'} {r['method']} decode {label}: {what}")
        elif r["q_len"] > 1:
            ok = speed >= 1.0
            out.append(f"{'MET ' if ok else 'MISS'} {r['method']} {label}: {speed:.2f}x bf16 pages, no slower "
                       f"({r['ms']:.3f} vs {b['ms']:.3f} ms; bf16 at {b['frac_of_ceiling'] or 0:.0%} of the floor)")
        else:
            out.append(f"info {r['method']} decode {label}: {speed:.2f}x bf16 pages, {ceil:.1%} of the ceiling")
    return (["fp8 targets:"] + out) if out else []


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Options shared by decode / prefill / all / regress / refresh (when they run)."""
    g = p.add_argument_group("run")
    preset = g.add_mutually_exclusive_group()
    preset.add_argument("--quick", dest="preset", action="store_const", const="quick",
                        help="a few shapes of each grid, meant to take a few minutes on an H200 (default)")
    preset.add_argument("--full", dest="preset", action="store_const", const="full", help="the whole grid")
    p.set_defaults(preset="quick")
    add_out_dir_argument(g)
    add_device_argument(g, f"the same code on CPU-sized shapes (contexts <= {CPU_MAX_CONTEXT}, q_len <= "
                           f"{CPU_MAX_Q_LEN}, batch <= {CPU_MAX_BATCH})")
    g.add_argument("--max-gb", type=float, default=32.0, help="skip shapes whose one-layer KV exceeds this (GiB)")
    g.add_argument("--time-budget-s", type=float, default=None,
                   help="start no new shape after this many seconds (decode gets 60%% when both run)")
    g.add_argument("--batches", type=_ints, default=None, help="e.g. 1,4,16 (replaces the preset's batches)")
    g.add_argument("--contexts", type=_ints, default=None, help="e.g. 4096,32768")
    g.add_argument("--q-lens", type=_ints, default=None, help="prefill query lengths, e.g. 16,512")
    g.add_argument("--heads", type=_heads, default=None, help="Hq/Hkv pairs, e.g. 32/8,64/8")
    g.add_argument("--head-dim", type=int, default=128)
    g.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    g.add_argument("--page-size", type=int, default=64)
    g.add_argument("--hbm-fractions", type=_floats, default=None,
                   help="fractions of pages in HBM for ours (decode default 0,0.25,0.5,0.75; prefill 0)")
    g.add_argument("--placement", default="spread", choices=("spread", "recent", "oldest"))
    g.add_argument("--num-layers", type=int, default=1, help="layers in the benchmark cache (one is read)")
    g.add_argument("--config", type=_config, default=None,
                   help='DecodeConfig for ours as JSON, e.g. \'{"tile_n": 64, "stages": 4}\' (default: profile)')
    g.add_argument("--compare-configs", type=_configs, default=(),
                   help="more DecodeConfigs for ours, timed in the same run as methods ours[field=value,...]; "
                        'a JSON list, e.g. \'[{"tile_n": 32, "stages": 12, "chunk_tiles": 6}]\'')
    g.add_argument("--warmup", type=int, default=2)
    g.add_argument("--reps", type=int, default=7, help="timed samples per method (fewer for slow methods)")
    g.add_argument("--max-rep-s", type=float, default=3.0, help="timed seconds per method, about")
    g.add_argument("--tol", type=float, default=2e-2, help="max |out - ref| / max |ref| for a check to pass")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ceiling-gb", type=float, default=2.0, help="host buffer for the ceilings (HBM: twice)")
    g.add_argument("--no-plot", action="store_true")
    g.add_argument("--kv-dtype", default=None, choices=("fp8", "e5m2"),
                   help="also ours[fp8] / ours[e5m2]: the same K/V in FP8 host pages (with per-token scales)")
    g.add_argument("--sparse-budgets", type=_budgets, default=(),
                   help="also ours[sparse=B] for each budget B, comma-separated (1/8, 0.125, 256p): decode "
                        "shapes over host pages, each row reading only its best pages (chosen per call from "
                        "the page summaries), and select[B], the selection alone")
    g.add_argument("--window", action="store_true",
                   help="also ours[window]: multi-token shapes with the query tokens' own pages mirrored in "
                        "HBM (the HBM window of a model step), host only")
    g.add_argument("--layers", type=_positive, default=1,
                   help="time every method in runs of at least this many calls back to back (a model's "
                        "layers), ours over tables marked back to back (KernelTables.back_to_back)")
    g.add_argument("--no-peers", action="store_true",
                   help="leave out FlashAttention-4's methods (fa4[hbm], fa4[zero_copy_paged], swap+fa4)")
    g.add_argument("--skip-methods", type=_skippable, default=(),
                   help="leave out these slow baselines, comma-separated: " + ", ".join(SKIPPABLE)
                        + " (they read host pages once per query tile)")
    g.add_argument("--no-progress", action="store_true")


def _positive(s: str) -> int:
    n = int(s)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _budgets(s: str) -> tuple[str, ...]:
    from directkv_cute.sparse_budget import parse_budget

    names = tuple(x.strip() for x in s.split(",") if x.strip())
    if not names:
        raise argparse.ArgumentTypeError("give at least one budget, e.g. 1/8")
    for n in names:
        try:
            parse_budget(n)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return names


def _skippable(s: str) -> tuple[str, ...]:
    names = tuple(x for x in s.split(",") if x)
    bad = [n for n in names if n not in SKIPPABLE]
    if bad:
        raise argparse.ArgumentTypeError(f"cannot skip {bad}: only {', '.join(SKIPPABLE)}")
    return names


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def _heads(s: str) -> list[tuple[int, int]]:
    out = []
    for pair in s.split(","):
        hq, hkv = pair.split("/")
        out.append((int(hq), int(hkv)))
    return out


def _configs(s: str) -> tuple[dict, ...]:
    import json

    items = json.loads(s)
    if not isinstance(items, list) or not all(isinstance(d, dict) for d in items):
        raise ValueError("--compare-configs takes a JSON list of config objects")
    return tuple(_checked_config(d) for d in items)


def _config(s: str) -> dict:
    import json

    return _checked_config(json.loads(s))


def _checked_config(d: dict) -> dict:
    """``d`` if it names a DecodeConfig, or with ``"kernel": "q_tiled"`` a QTiledConfig (raises
    ConfigError, a ValueError, early otherwise)."""
    from bench.harness import _decode_config

    _decode_config(d)
    return d


__all__ = ["SuiteResult", "add_run_arguments", "run_suite", "summarize"]
