"""Regression check of a fresh run against the committed per-GPU baseline.

Tracked ratios, per ``ours`` record (bench, shape, HBM fraction):

* ``frac_of_ceiling``: ideal time / our time, the ideal being the bytes at the run's own
  ceilings (so link or clock drift between runs cancels out);
* ``speedup_vs_zero_copy``: naive zero-copy time / our time on the same shape;
* ``frac_of_fa4_limit``: max(floor, fa4[hbm]) / our time, the honest limit of a kernel over host
  KV (the link, or FlashAttention-4's compute with the KV in HBM); only where the run has FA4;
* ``frac_of_memcpy``: the same ideal with the run's cudaMemcpy H2D rate as the host ceiling.
  The copy engine's rate was the steadiest number across H200 machines (55.1 GB/s on two of
  them), while the SM-read ceiling (47.1 vs 49.1 GB/s) and the zero-copy baseline (up to 15%)
  moved more than our kernel did (0.5%), in ``python -m bench all`` runs on each: this ratio
  keeps a tight gate on our kernel when the other two need wide, spread-derived tolerances.

A ratio *regresses* when it drops by more than ``max(rtol * |baseline|, atol)``: the relative
tolerance absorbs run-to-run noise, the absolute one keeps tiny ratios from flagging on noise.
With the defaults (rtol 3%, atol 0.005) a 5% drop of any ratio >= 0.1 is caught. Baseline
records that the fresh run lacks (or could not measure) are reported as MISSING and fail the
check unless allowed; a fresh run whose correctness checks failed always fails.

Records whose baseline time is under ``min_ms`` (default 1 ms) do not gate: at such times a few
microseconds of jitter (clocks, L2 state, launch gaps between back-to-back calls) are a large,
machine-dependent share of the time, and a drop there is reported as ``noisy`` instead of
``REGRESSED``.
``--min-ms 0`` gates everything.

``refresh`` writes the baseline from a run only if that run passed every correctness check.
Given several runs (``--results A --results B ...``, e.g. from different machines with the same
GPU model) it stores each tracked ratio's median and its relative spread (max - min) / median; a
ratio's tolerance is then max(rtol, its spread), so ratios that swing between machines do not
flag while steady ones keep the tight gate.
The comparison takes two JSON dicts, so all of it runs without a GPU. A file given to it that is
missing, not JSON or not a results document is refused with one line (``read_results``: a
``UsageError``, exit status 2) before anything is compared or written.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from bench.common import Ceilings, UsageError, load_json, record_key, shape_key, validate_results, write_json

TRACKED = ("frac_of_ceiling", "speedup_vs_zero_copy", "frac_of_memcpy", "frac_of_fa4_limit")
DEFAULT_RTOL = 0.03
DEFAULT_ATOL = 0.005
DEFAULT_MIN_MS = 1.0
BASELINE_DIR = Path(__file__).resolve().parent / "baselines"


class RefreshRefused(RuntimeError):
    """The run may not become a baseline (it failed a check, or has nothing to track)."""


def tracked_ratios(doc: Mapping) -> dict[str, dict[str, float | None]]:
    """{record key of each ours record: {ratio name: value or None when not measured}}."""
    records = doc["records"]
    zero_copy = {shape_key(r): r for r in records if r["method"] == "zero_copy"}
    floor = {shape_key(r): r["ms"] for r in records if r["method"] == "floor" and r["ms"]}
    fa4 = {shape_key(r): r["ms"] for r in records if r["method"] == "fa4[hbm]" and r["ms"]}
    c = doc["ceilings"]
    memcpy = Ceilings(host_read_gbps=c["memcpy_h2d_gbps"], hbm_read_gbps=c["hbm_read_gbps"],
                      memcpy_h2d_gbps=c["memcpy_h2d_gbps"])
    out = {}
    for r in records:
        if r["method"] != "ours":
            continue
        ms = r["ms"]
        z = zero_copy.get(shape_key(r))
        out[record_key(r)] = {
            "frac_of_ceiling": r["frac_of_ceiling"] if ms else None,
            "speedup_vs_zero_copy": z["ms"] / ms if ms and z and z["ms"] else None,
            "frac_of_memcpy": memcpy.ideal_ms(r["host_bytes"], r["hbm_bytes"]) / ms if ms else None,
        }
        k = shape_key(r)
        if k in fa4 and ms:
            out[record_key(r)]["frac_of_fa4_limit"] = max(floor.get(k, 0.0), fa4[k]) / ms
    return out


def is_regression(base: float, fresh: float, rtol: float = DEFAULT_RTOL, atol: float = DEFAULT_ATOL) -> bool:
    """True when ``fresh`` is lower than ``base`` by more than max(rtol * |base|, atol)."""
    return base - fresh > max(rtol * abs(base), atol)


def is_improvement(base: float, fresh: float, rtol: float = DEFAULT_RTOL, atol: float = DEFAULT_ATOL) -> bool:
    return fresh - base > max(rtol * abs(base), atol)


@dataclass
class DiffRow:
    key: str
    ratio: str
    base: float | None
    fresh: float | None
    status: str  # ok | REGRESSED | noisy | improved | MISSING | new

    @property
    def change(self) -> float | None:
        if self.base is None or self.fresh is None or self.base == 0:
            return None
        return self.fresh / self.base - 1.0


@dataclass
class Report:
    rows: list[DiffRow] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    allow_missing: bool = False

    @property
    def regressions(self) -> list[DiffRow]:
        return [r for r in self.rows if r.status == "REGRESSED"]

    @property
    def missing(self) -> list[DiffRow]:
        return [r for r in self.rows if r.status == "MISSING"]

    @property
    def ok(self) -> bool:
        return not self.problems and not self.regressions and (self.allow_missing or not self.missing)


def compare(baseline: Mapping, fresh: Mapping, *, rtol: float = DEFAULT_RTOL, atol: float = DEFAULT_ATOL,
            allow_missing: bool = False, min_ms: float = DEFAULT_MIN_MS) -> Report:
    """Compare the tracked ratios of ``fresh`` with ``baseline`` (two results documents)."""
    report = Report(allow_missing=allow_missing)
    for name, doc in (("baseline", baseline), ("fresh run", fresh)):
        report.problems += [f"{name}: {p}" for p in validate_results(doc)]
    if report.problems:
        return report
    b_gpu, f_gpu = baseline["header"]["gpu_key"], fresh["header"]["gpu_key"]
    if b_gpu != f_gpu:
        report.problems.append(f"baseline is for {b_gpu}, the fresh run is on {f_gpu}")
    if not fresh["passed"]:
        failed = [c for c in fresh["checks"] if not c["ok"]]
        report.problems.append(f"the fresh run failed {len(failed)} correctness checks")
    base, new = baseline.get("tracked") or tracked_ratios(baseline), tracked_ratios(fresh)
    spread = baseline.get("spread", {})
    base_ms = {record_key(r): r["ms"] for r in baseline["records"] if r["method"] == "ours"}
    for key in sorted(set(base) | set(new)):
        for ratio in TRACKED:
            b = base.get(key, {}).get(ratio)
            f = new.get(key, {}).get(ratio)
            if ratio not in base.get(key, {}) and ratio not in new.get(key, {}):
                continue  # a ratio neither run has (frac_of_fa4_limit without FA4)
            status = _status(b, f, max(rtol, spread.get(key, {}).get(ratio) or 0.0), atol)
            if status == "REGRESSED" and (base_ms.get(key) or 0.0) < min_ms:
                status = "noisy"
            report.rows.append(DiffRow(key, ratio, b, f, status))
    return report


def _status(b: float | None, f: float | None, rtol: float, atol: float) -> str:
    if b is None:
        return "new" if f is not None else "ok"
    if f is None:
        return "MISSING"
    if is_regression(b, f, rtol, atol):
        return "REGRESSED"
    if is_improvement(b, f, rtol, atol):
        return "improved"
    return "ok"


def format_report(report: Report, show_all: bool = False) -> str:
    """A diff table (all rows, or only the interesting ones) and a verdict line."""
    rows = report.rows if show_all else [r for r in report.rows if r.status != "ok"]
    fmt = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
    table = [("record", "ratio", "baseline", "fresh", "change", "status")]
    for r in rows:
        change = "-" if r.change is None else f"{100 * r.change:+.1f}%"
        table.append((r.key, r.ratio, fmt(r.base), fmt(r.fresh), change, r.status))
    widths = [max(len(str(t[i])) for t in table) for i in range(6)]
    lines = ["  ".join(str(c).ljust(w) if i < 2 else str(c).rjust(w) for i, (c, w) in enumerate(zip(t, widths)))
             for t in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if len(table) == 1:
        lines.append(f"(all {len(report.rows)} tracked ratios within tolerance)")
    lines += [f"PROBLEM: {p}" for p in report.problems]
    counts = {s: sum(r.status == s for r in report.rows)
              for s in ("ok", "improved", "new", "noisy", "REGRESSED", "MISSING")}
    lines.append(("PASS" if report.ok else "FAIL") + ": " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    return "\n".join(lines)


def baseline_path(gpu_key: str, baseline_dir: str | Path = BASELINE_DIR) -> Path:
    return Path(baseline_dir) / f"{gpu_key}.json"


def _check_refreshable(run: Mapping) -> None:
    problems = validate_results(run)
    if problems:
        raise RefreshRefused("the run is not a valid results document: " + "; ".join(problems[:5]))
    failed = [c for c in run["checks"] if not c["ok"]]
    if not run["passed"] or failed:
        raise RefreshRefused(f"the run failed {len(failed)} correctness checks; a baseline must come from a run "
                             "that passed them all")
    if not any(v is not None for ratios in tracked_ratios(run).values() for v in ratios.values()):
        raise RefreshRefused("the run has no measured 'ours' records to track")


def refresh_baseline(fresh: Mapping, baseline_dir: str | Path = BASELINE_DIR, source: str = "",
                     more_runs: Sequence[Mapping] = ()) -> Path:
    """Write ``fresh`` (with ``more_runs``: their per-ratio medians and spreads) as the baseline
    of its GPU; refuse if any run failed a check or comes from another GPU."""
    runs = [fresh, *more_runs]
    for run in runs:
        _check_refreshable(run)
        if run["header"]["gpu_key"] != fresh["header"]["gpu_key"]:
            raise RefreshRefused(f"runs from {run['header']['gpu_key']} and {fresh['header']['gpu_key']} cannot "
                                 "make one baseline")
    doc = dict(fresh)
    doc["baseline_source"] = source
    if more_runs:
        per_run = [tracked_ratios(r) for r in runs]
        tracked, spread = {}, {}
        for key in per_run[0]:
            for ratio in TRACKED:
                vals = [t[key][ratio] for t in per_run if t.get(key, {}).get(ratio) is not None]
                if not vals:
                    continue
                mid = statistics.median(vals)
                tracked.setdefault(key, {})[ratio] = mid
                spread.setdefault(key, {})[ratio] = (max(vals) - min(vals)) / mid if mid else 0.0
        doc.update(tracked=tracked, spread=spread, baseline_runs=len(runs))
    return write_json(baseline_path(fresh["header"]["gpu_key"], baseline_dir), doc)


def load_baseline(gpu_key: str, baseline: str | Path | None = None,
                  baseline_dir: str | Path = BASELINE_DIR) -> dict:
    """The baseline of ``gpu_key`` (or the file ``baseline``): FileNotFoundError where there is
    none, UsageError (one line) for a file that is not a results document."""
    path = Path(baseline) if baseline else baseline_path(gpu_key, baseline_dir)
    if not path.exists():
        raise FileNotFoundError(f"no baseline at {path}: create one with `python -m bench refresh --results RUN.json`")
    return read_results(path, "baseline")


_GPU_KEY = re.compile(r"[A-Za-z0-9+_-][A-Za-z0-9.+_-]*")  # a file name in bench/baselines (env_info's gpu_key)


def results_problem(doc) -> str | None:
    """Why ``doc`` (parsed JSON) is not a results document a comparison or a baseline can use
    (None: it is): the fields of ``validate_results``, and a header whose ``gpu_key`` names a
    baseline file."""
    if not isinstance(doc, dict):
        return f"the JSON top level is {type(doc).__name__}, not an object"
    try:
        problems = validate_results(doc)
    except (TypeError, AttributeError, KeyError, ValueError) as e:  # a field of the wrong type
        return f"a field of the wrong type ({type(e).__name__}: {e})"
    if problems:
        return problems[0] + (f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else "")
    key = doc["header"].get("gpu_key")
    if not isinstance(key, str) or not _GPU_KEY.fullmatch(key):
        return f"header.gpu_key {str(key)[:60]!r} is not a GPU key (letters, digits, . + _ -)"
    return None


def read_results(path: str | Path, what: str = "--results") -> dict:
    """The results document in the file ``path``, or a UsageError (one line on stderr, exit status
    2) saying why not: no such file, a folder, unreadable, not JSON, not a results document
    (``what`` names the option or file in the message)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{what} {path}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"{what} {path}: a folder, not a results JSON") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"{what} {path}: not JSON (not UTF-8 text: {e.reason} at byte {e.start})") from None
    except OSError as e:
        raise UsageError(f"{what} {path}: cannot read: {e.strerror or e}") from None
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise UsageError(f"{what} {path}: not JSON ({e})") from None
    except RecursionError:
        raise UsageError(f"{what} {path}: not JSON (nested too deeply)") from None
    problem = results_problem(doc)
    if problem:
        raise UsageError(f"{what} {path}: not a results document ({' '.join(problem.split())[:300]})")
    return doc
