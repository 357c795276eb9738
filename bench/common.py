"""Shared pieces of every benchmark: records, result files, timing, tables and the environment.

A *record* is one measured (or computed) method on one shape, with exactly the fields in
``RECORD_FIELDS``. A *results document* is the JSON written per run::

    {"schema": SCHEMA, "bench": "decode" | "prefill" | "all",
     "header": {"gpu", "gpu_key", "date", "versions", ...},
     "ceilings": {"host_read_gbps", "hbm_read_gbps", "memcpy_h2d_gbps"},
     "ceiling_details": {...}, "args": {...}, "passed": bool,
     "checks": [...], "skipped": [...], "missing": [...], "notes": {...},
     "records": [record, ...]}

Bandwidths are in GB/s with GB = 1e9 bytes; times in milliseconds.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import os
import platform
import re
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import torch

from directkv_cute._pinned import available_host_bytes  # noqa: F401 (the benches read it from here)

SCHEMA = "directkv-bench/1"

RECORD_FIELDS = (
    "bench", "method", "batch", "context", "q_len", "hq", "hkv", "head_dim", "dtype",
    "hbm_fraction", "ms", "host_bytes", "hbm_bytes", "gbps", "staging_bytes", "gpu_bytes",
    "frac_of_ceiling",
)
CEILING_FIELDS = ("host_read_gbps", "hbm_read_gbps", "memcpy_h2d_gbps")
HEADER_FIELDS = ("gpu", "gpu_key", "date", "versions")
DOC_FIELDS = ("schema", "bench", "header", "ceilings", "passed", "checks", "records")

# Fields that identify a record (everything that is not a measurement).
KEY_FIELDS = ("bench", "method", "batch", "context", "q_len", "hq", "hkv", "head_dim", "dtype", "hbm_fraction")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}

GB = 1e9
MiB = 1 << 20
GiB = 1 << 30


# ---- dtypes and shapes ---------------------------------------------------------------------
def dtype_name(name: str | torch.dtype) -> str:
    """Canonical dtype name ("bfloat16", "float16", "float32") for a string or torch dtype."""
    if isinstance(name, torch.dtype):
        for key, value in DTYPES.items():
            if value == name:
                return key
        raise ValueError(f"unsupported dtype {name}")
    key = _DTYPE_ALIASES.get(name.lower(), name.lower())
    if key not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; use one of {sorted(DTYPES)}")
    return key


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[dtype_name(name)]


@dataclass(frozen=True)
class Shape:
    """One benchmark problem: ``batch`` sequences of ``context`` KV tokens (one layer).

    The last ``q_len`` tokens of each sequence are the new ones: their queries are the
    ``q_len`` query rows, causal among themselves, and they see the whole prefix.
    """

    bench: str
    batch: int
    context: int
    q_len: int
    hq: int
    hkv: int
    head_dim: int
    dtype: str

    @property
    def group(self) -> int:
        return self.hq // self.hkv

    @property
    def elem_bytes(self) -> int:
        return torch.tensor([], dtype=torch_dtype(self.dtype)).element_size()

    @property
    def token_bytes(self) -> int:
        """Bytes of K and V for one token of one sequence (all KV heads, one layer)."""
        return 2 * self.hkv * self.head_dim * self.elem_bytes

    @property
    def kv_bytes(self) -> int:
        """Unique K/V bytes of the whole batch for one layer."""
        return self.batch * self.context * self.token_bytes

    @property
    def label(self) -> str:
        return (f"B{self.batch} ctx{kilo(self.context)} q{self.q_len} "
                f"{self.hq}/{self.hkv} d{self.head_dim} {self.dtype}")

    def fields(self) -> dict:
        """The record fields this shape fixes (every field of the shape)."""
        return dataclasses.asdict(self)


def kilo(n: int) -> str:
    """Tokens in thousands where exact: 32768 -> "32k", 1000 -> "1000"."""
    return f"{n // 1024}k" if n % 1024 == 0 and n >= 1024 else str(n)


# ---- ceilings and records ------------------------------------------------------------------
@dataclass(frozen=True)
class Ceilings:
    """Run-level bandwidth ceilings, measured in the same run as the methods (GB/s)."""

    host_read_gbps: float
    hbm_read_gbps: float
    memcpy_h2d_gbps: float

    def ideal_ms(self, host_bytes: int, hbm_bytes: int) -> float:
        """Fastest possible time to read the bytes: both tiers stream concurrently, so the
        slower of the two decides: max(host_bytes / host ceiling, hbm_bytes / HBM ceiling)."""
        host_s = host_bytes / (self.host_read_gbps * GB) if host_bytes else 0.0
        hbm_s = hbm_bytes / (self.hbm_read_gbps * GB) if hbm_bytes else 0.0
        return 1e3 * max(host_s, hbm_s)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> "Ceilings":
        return cls(**{k: float(d[k]) for k in CEILING_FIELDS})


@dataclass
class Record:
    """One method on one shape. ``ms`` is None when the method could not run (missing)."""

    bench: str
    method: str
    batch: int
    context: int
    q_len: int
    hq: int
    hkv: int
    head_dim: int
    dtype: str
    hbm_fraction: float
    ms: float | None
    host_bytes: int
    hbm_bytes: int
    gbps: float | None
    staging_bytes: int
    gpu_bytes: int
    frac_of_ceiling: float | None

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in RECORD_FIELDS}


def make_record(shape: Shape, method: str, ms: float | None, ceilings: Ceilings, *,
                host_bytes: int = 0, hbm_bytes: int = 0, staging_bytes: int = 0, gpu_bytes: int = 0,
                hbm_fraction: float = 0.0) -> Record:
    """Build a record, deriving the effective bandwidth and the fraction of the ideal time.

    gbps = (host_bytes + hbm_bytes) / time: the KV bytes the method makes available, each
    counted once however often the method actually moves it.
    frac_of_ceiling = ceilings.ideal_ms(host_bytes, hbm_bytes) / ms (1.0 = at the ceiling).
    """
    gbps = frac = None
    if ms is not None and ms > 0:
        gbps = (host_bytes + hbm_bytes) / (ms * 1e-3) / GB
        ideal = ceilings.ideal_ms(host_bytes, hbm_bytes)
        frac = ideal / ms if ideal > 0 else None
    return Record(**shape.fields(), method=method, hbm_fraction=round(float(hbm_fraction), 4), ms=ms,
                  host_bytes=int(host_bytes), hbm_bytes=int(hbm_bytes), gbps=gbps,
                  staging_bytes=int(staging_bytes), gpu_bytes=int(gpu_bytes), frac_of_ceiling=frac)


def record_key(rec: Mapping) -> str:
    """A stable string naming a record's method and shape (its non-measured fields)."""
    return (f"{rec['bench']}/{rec['method']}/B{rec['batch']}/ctx{rec['context']}/q{rec['q_len']}/"
            f"{rec['hq']}x{rec['hkv']}/d{rec['head_dim']}/{rec['dtype']}/hbm{float(rec['hbm_fraction']):.2f}")


def shape_key(rec: Mapping) -> str:
    """Like record_key but without the method and HBM fraction: the shape alone."""
    return (f"{rec['bench']}/B{rec['batch']}/ctx{rec['context']}/q{rec['q_len']}/"
            f"{rec['hq']}x{rec['hkv']}/d{rec['head_dim']}/{rec['dtype']}")


# ---- environment ---------------------------------------------------------------------------
def gpu_key(name: str) -> str:
    """File-name-safe GPU name: 'NVIDIA H200' -> 'NVIDIA_H200'."""
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_") or "unknown"


def package_version(dist: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(dist)
    except Exception:  # noqa: BLE001 - any lookup failure just means "unknown"
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=5, cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def env_info(device: str) -> dict:
    """GPU name, date and software versions for the results header."""
    import directkv_cute

    now = _dt.datetime.now(_dt.timezone.utc)
    info = {"date": now.strftime("%Y-%m-%d"), "time": now.strftime("%H:%M:%SZ"), "device": device,
            "host": platform.node(), "git_commit": _git_commit()}
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "cuda": torch.version.cuda, "directkv_cute": directkv_cute.__version__,
                "nvidia_cutlass_dsl": package_version("nvidia-cutlass-dsl"),
                "numpy": package_version("numpy")}
    if device == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info.update(gpu=props.name, sm_count=props.multi_processor_count,
                    l2_bytes=getattr(props, "L2_cache_size", None), gpu_mem_bytes=props.total_memory,
                    capability=f"{props.major}.{props.minor}")
        try:
            versions["driver"] = torch._C._cuda_getDriverVersion()
        except (AttributeError, RuntimeError):
            versions["driver"] = None
    else:
        info["gpu"] = "cpu"
    info["gpu_key"] = gpu_key(info["gpu"])
    info["versions"] = versions
    return info


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None where matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        return None


def save_figure(plt, fig, path, title: str) -> Path:
    """Give ``fig`` its title line (GPU, date, what the lines mean), lay it out, write it to
    ``path`` as a PNG and close it."""
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def try_plot(plot: Callable, *args):
    """``plot(*args)``, or None after one line saying why it failed: a plotting problem must not
    lose the measurements already written."""
    try:
        return plot(*args)
    except Exception as e:  # noqa: BLE001 - any plotting failure is reported, never raised
        print(f"plotting failed: {type(e).__name__}: {e}")
        return None


# ---- results documents ---------------------------------------------------------------------
def new_results(bench: str, header: dict, ceilings: Ceilings, *, ceiling_details: dict | None = None,
                args: dict | None = None) -> dict:
    """An empty results document for one run."""
    return {"schema": SCHEMA, "bench": bench, "header": dict(header), "ceilings": ceilings.to_dict(),
            "ceiling_details": ceiling_details or {}, "args": args or {}, "passed": True,
            "checks": [], "skipped": [], "missing": [], "notes": {}, "records": []}


def add_check(doc: dict, shape: Shape, method: str, ok: bool, *, hbm_fraction: float = 0.0,
              rel_err: float | None = None, against: str = "", detail: str = "") -> None:
    """Log one correctness comparison; any failed check marks the whole run as failed."""
    doc["checks"].append({"shape": shape.label, "bench": shape.bench, "method": method,
                          "hbm_fraction": hbm_fraction, "ok": bool(ok), "rel_err": rel_err,
                          "against": against, "detail": detail})
    if not ok:
        doc["passed"] = False


def merge_results(bench: str, docs: Sequence[dict]) -> dict:
    """One document holding the records of several runs that share a header and ceilings. Its
    ``args`` are the first run's, with ``benches`` listing every run's benches and ``per_bench``
    each bench's own arguments (runs made separately may differ, e.g. in ``hbm_fractions``), so
    that ``bench regress`` can replay each bench as it was run."""
    first = docs[0]
    args = dict(first.get("args") or {})
    benches: list[str] = []
    per_bench: dict = {}
    for doc in docs:
        doc_args = doc.get("args") or {}
        own = {k: v for k, v in doc_args.items() if k != "per_bench"}
        for name in doc_args.get("benches") or [doc.get("bench")]:
            if name not in benches:
                benches.append(name)
            per_bench.setdefault(name, (doc_args.get("per_bench") or {}).get(name, own))
    if args:
        args["benches"], args["per_bench"] = benches, per_bench
    out = new_results(bench, first["header"], Ceilings.from_dict(first["ceilings"]),
                      ceiling_details=first.get("ceiling_details"), args=args)
    for doc in docs:
        out["passed"] = out["passed"] and bool(doc["passed"])
        for key in ("checks", "skipped", "missing", "records"):
            out[key].extend(doc.get(key, []))
        out["notes"].update(doc.get("notes", {}))
    return out


def validate_results(doc: Mapping) -> list[str]:
    """Problems with a results document's structure (empty list = valid)."""
    problems = [f"missing top-level field {f!r}" for f in DOC_FIELDS if f not in doc]
    if problems:
        return problems
    if doc["schema"] != SCHEMA:
        problems.append(f"schema {doc['schema']!r} != {SCHEMA!r}")
    problems += [f"header lacks {f!r}" for f in HEADER_FIELDS if f not in doc["header"]]
    for f in CEILING_FIELDS:
        v = doc["ceilings"].get(f)
        if not isinstance(v, (int, float)) or not v > 0:
            problems.append(f"ceiling {f!r} must be a positive number, got {v!r}")
    if not isinstance(doc["passed"], bool):
        problems.append("'passed' must be a bool")
    for i, rec in enumerate(doc["records"]):
        problems += [f"record {i}: {p}" for p in validate_record(rec)]
    return problems


def validate_record(rec: Mapping) -> list[str]:
    """Problems with one record (exact field set, types, derived-value consistency)."""
    problems = []
    if set(rec) != set(RECORD_FIELDS):
        extra, lacking = sorted(set(rec) - set(RECORD_FIELDS)), sorted(set(RECORD_FIELDS) - set(rec))
        return [f"fields differ: extra {extra}, missing {lacking}"]
    for f in ("batch", "context", "q_len", "hq", "hkv", "head_dim", "host_bytes", "hbm_bytes",
              "staging_bytes", "gpu_bytes"):
        if not isinstance(rec[f], int) or rec[f] < 0:
            problems.append(f"{f} must be a non-negative int, got {rec[f]!r}")
    if not 0.0 <= float(rec["hbm_fraction"]) <= 1.0:
        problems.append(f"hbm_fraction {rec['hbm_fraction']} outside [0, 1]")
    for f in ("ms", "gbps", "frac_of_ceiling"):
        if rec[f] is not None and (not isinstance(rec[f], (int, float)) or not math.isfinite(rec[f]) or rec[f] < 0):
            problems.append(f"{f} must be null or a finite non-negative number, got {rec[f]!r}")
    if rec["ms"] is None and rec["gbps"] is not None:
        problems.append("gbps given without ms")
    if rec["ms"] and rec["gbps"] is not None:
        expect = (rec["host_bytes"] + rec["hbm_bytes"]) / (rec["ms"] * 1e-3) / GB
        if not math.isclose(expect, rec["gbps"], rel_tol=1e-6):
            problems.append(f"gbps {rec['gbps']} != bytes/time {expect}")
    return problems


# ---- command line: where files go, which device runs ----------------------------------------
DEFAULT_OUT_DIR = "bench-results"  # relative to the current directory, never the source tree


class UsageError(SystemExit):
    """A command line this machine cannot run (no GPU, an unusable ``--out-dir``): the commands
    print its one-line message on stderr and exit with status 2, before anything is written."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def add_out_dir_argument(p, what: str = "the JSON, table and PNG files") -> None:
    """The ``--out-dir`` option every writing command shares (one default: ``DEFAULT_OUT_DIR``)."""
    p.add_argument("--out-dir", default=DEFAULT_OUT_DIR,
                   help=f"directory for {what} (default ./{DEFAULT_OUT_DIR}/ under the current directory, "
                        "created on demand)")


def add_device_argument(p, cpu_run: str) -> None:
    """The ``--device`` option of a GPU bench with a CPU smoke run (``cpu_run`` says what it runs);
    ``require_gpu`` applies it."""
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                   help="auto / cuda: the GPU (without one the bench refuses, exit status 2); cpu: "
                        f"{cpu_run} (a smoke run: no meaningful timing, no ceilings, no targets)")


def checked_out_dir(path: str | Path, option: str = "--out-dir") -> Path:
    """``path`` as a usable output directory, checked before any long work: not a file, not under
    a file, and writable (or creatable). Raises UsageError (naming ``option``) otherwise; creates
    nothing."""
    out = Path(path)
    for p in (out, *out.parents):
        if p.exists() and not p.is_dir():
            where = "is a file" if p == out else f"is under the file {p}"
            raise UsageError(f"{option} {out} {where}: give a directory")
    existing = next(p for p in (out, *out.parents) if p.exists() or p == p.parent)
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == out else f"cannot be created: {existing} is not writable"
        raise UsageError(f"{option} {out} {what}")
    return out


def exit_status(command: Callable[..., int], *args) -> int:
    """``command(*args)``'s exit status, or 2 with the UsageError's line on stderr."""
    import sys

    try:
        return command(*args)
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2


NO_GPU = "no CUDA GPU here: the benches time GPU kernels."


def require_gpu(requested: str = "auto", *, command: str, cpu_run: bool = True) -> str:
    """The device a bench runs on: "cuda", or "cpu" when ``--device cpu`` asks for a smoke run
    (``cpu_run``: the bench has one); ``command`` names the bench in messages ("bench e2e").
    Every GPU bench calls this first: without a GPU it raises UsageError (exit status 2, nothing
    written) unless the CPU was asked for."""
    if requested == "cpu":
        if cpu_run:
            return "cpu"
        raise UsageError(f"{command} has no CPU run: it times GPU kernels")
    if requested not in ("auto", "cuda"):
        raise UsageError(f"{command}: unknown device {requested!r} (auto, cuda or cpu)")
    if not torch.cuda.is_available():
        if cpu_run:
            raise UsageError(f"{NO_GPU} Pass --device cpu for a smoke run on CPU-sized shapes, or "
                             "`python -m bench check` for the GPU-free checks")
        raise UsageError(f"{NO_GPU} {command} needs CUDA (it has no CPU run); "
                         "`python -m bench check` runs the GPU-free checks")
    return "cuda"


def is_cpu_run(header: Mapping) -> bool:
    """A smoke run on the CPU: its timings mean nothing, so it prints no ceilings and no targets."""
    return header.get("device", header.get("gpu")) == "cpu"


def results_path(out_dir: str | Path, header: Mapping, suffix: str = "", ext: str = "json") -> Path:
    """<out_dir>/<gpu>-<date>[-suffix].<ext>."""
    name = f"{header['gpu_key']}-{header['date']}" + (f"-{suffix}" if suffix else "")
    return Path(out_dir) / f"{name}.{ext}"


def write_run_files(json_path: Path, doc: Mapping, text: str, out_dir: str | Path, header: Mapping, suffix: str,
                    plot: Callable | None) -> list[Path]:
    """A finished run's files beside its JSON: print the table ``text`` and write it as
    <gpu>-<date>-<suffix>.txt, then the PNG from ``plot(doc, path)`` unless ``plot`` is None (a
    plotting failure is one line, ``try_plot``); print and return every file written."""
    print(text, flush=True)
    txt = results_path(out_dir, header, suffix, ext="txt")
    txt.write_text(text + "\n")
    files = [Path(json_path), txt]
    png = None if plot is None else try_plot(plot, doc, results_path(out_dir, header, suffix, ext="png"))
    if png is not None:
        files.append(png)
    print("files:\n" + "\n".join(f"  {p}" for p in files), flush=True)
    return files


def write_json(path: str | Path, doc: Mapping) -> Path:
    """Write atomically (temp file + rename), so a killed run never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, path)
    return path


def load_json(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


# ---- timing --------------------------------------------------------------------------------
@dataclass
class Timing:
    """Median time per call over ``samples`` (each the mean of ``inner`` back-to-back calls)."""

    ms: float
    samples: list[float]
    inner: int


class Timer:
    """Times a stretch of work: CUDA events on the current stream, or wall clock on a CPU.

    On a GPU each measured stretch starts behind a GPU-side sleep (``lead_ms``) queued before the
    start event, so that the host has enqueued the work before the GPU reaches it: the events then
    time the device, not the host's launch latency of the first call. Without the lead the first
    call's host path (about 150 µs for the op on an H200) is charged to every sample's few calls:
    0.759 ms per call at 8k q512 against 0.740 ms behind a lead or in a CUDA graph (``python -m
    bench prefill --contexts 8192 --q-lens 512``). A method whose host path is slower than its GPU
    work still shows it once the lead is used up."""

    def __init__(self, device: str):
        self.device = device
        self._cycles_per_ms: float | None = None

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def _sleep_cycles_per_ms(self) -> float:
        """GPU clock cycles ``torch.cuda._sleep`` spins per millisecond (measured once)."""
        if self._cycles_per_ms is None:
            cycles = 2_000_000
            torch.cuda._sleep(cycles)  # warm
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            self._cycles_per_ms = cycles / max(start.elapsed_time(end), 1e-3)
        return self._cycles_per_ms

    def lead(self, ms: float) -> None:
        """Queue ``ms`` of GPU idle spinning on the current stream (no-op on a CPU or without
        ``torch.cuda._sleep``)."""
        if self.device == "cuda" and ms > 0 and hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(int(ms * self._sleep_cycles_per_ms()))

    def measure(self, work: Callable[[], object], lead_ms: float = 0.0) -> float:
        """Milliseconds the device spends on ``work()`` (launched and finished inside), started
        behind ``lead_ms`` of queued GPU sleep."""
        if self.device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.lead(lead_ms)
            start.record()
            fence_staging()
            work()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        work()
        return (time.perf_counter() - t0) * 1e3


def fence_staging() -> None:
    """directkv_cute's staged copies run ahead of the current stream (``staging.fence``): none of
    the timed calls' copies may start before the start event, behind the lead."""
    import sys

    staging = sys.modules.get("directkv_cute.staging")
    if staging is not None and torch.cuda.is_available():
        staging.fence()


def lead_ms(host_ms_per_call: float, calls: int, cap_ms: float = 200.0) -> float:
    """GPU sleep to queue ahead of a sample of ``calls`` calls whose host path takes
    ``host_ms_per_call`` each: long enough for the host to enqueue the whole sample (with 50%
    and 0.5 ms to spare), at most ``cap_ms``."""
    if host_ms_per_call < 0 or calls < 1:
        raise ValueError("lead_ms needs host_ms_per_call >= 0 and calls >= 1")
    return min(cap_ms, 1.5 * host_ms_per_call * calls + 0.5)


def time_calls(calls: Sequence[Callable[[], object]], timer: Timer, *, warmup: int = 2, reps: int = 7,
               min_sample_ms: float = 2.0, max_total_s: float = 3.0, max_inner: int = 256,
               min_inner: int = 1) -> Timing:
    """Median per-call time of a method, rotating among ``calls`` (one per input set).

    Each call runs a different input set, so consecutive calls do not find their inputs in L2.
    Calls run back to back in samples of ``inner`` calls (a multiple of ``len(calls)``, at least
    ``min_sample_ms`` of work and at least ``min_inner`` calls, e.g. a model's layers) between two
    events, each sample behind a GPU sleep that covers the host's time to enqueue it
    (``lead_ms``; see ``Timer``); the result is the median over
    the samples of the mean per call. Slow methods get fewer samples so that the timed part
    stays under about ``max_total_s`` seconds (at least one sample).
    """
    if not calls:
        raise ValueError("time_calls needs at least one call")
    n = len(calls)
    for i in range(max(1, warmup)):
        t0 = time.perf_counter()
        calls[i % n]()
        host = (time.perf_counter() - t0) * 1e3  # the last warm-up call's host path (GPU work may go on)
    timer.sync()
    est = max(timer.measure(calls[0], lead_ms(host, 1)), 1e-4)
    inner = max(min_inner, min(max_inner, max(n, math.ceil(min_sample_ms / est))))
    inner = n * math.ceil(inner / n)
    n_samples = max(1, min(reps, int(max_total_s * 1e3 / (est * inner))))
    lead = lead_ms(host, inner)

    def sample():
        for i in range(inner):
            calls[i % n]()

    samples = [timer.measure(sample, lead) / inner for _ in range(n_samples)]
    return Timing(ms=statistics.median(samples), samples=samples, inner=inner)


def progress_bar(items, enabled: bool, desc: str, unit: str):
    """``items`` wrapped in a tqdm progress bar when enabled (and tqdm is installed)."""
    if not enabled:
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, unit=unit, dynamic_ncols=True)


# ---- tables --------------------------------------------------------------------------------
def _fmt_bytes(n: int | None) -> str:
    if not n:
        return "0"
    if n < 10 * MiB:
        return f"{n / MiB:.2f}M"
    return f"{n / MiB:.0f}M" if n < 100 * GiB else f"{n / GiB:.0f}G"


def fmt_opt(v: float | None, spec: str) -> str:
    """``v`` formatted with ``spec``, or "-" for None."""
    return "-" if v is None else format(v, spec)


# Records that are ceilings (the floor from the run's host ceiling, streaming reads of the shape's
# bytes), not methods: a CPU smoke run does not print them.
CEILING_METHODS = ("floor", "host_read", "hbm_read")
TABLE_COLUMNS = ("method", "shape", "hbm%", "ms", "GB/s", "%host", "%ideal", "staging", "gpu")


def format_table(records: Iterable[Mapping], ceilings: Ceilings | None, variants: Mapping | None = None) -> str:
    """A fixed-width table: method, shape, ms, effective GB/s, % of the host ceiling,
    % of the ideal time (frac_of_ceiling), staging and extra GPU bytes, under a line of the
    ceilings. ``ceilings`` None (a CPU smoke run): no ceilings line, no percentages and no
    ceiling rows (``CEILING_METHODS``).
    ``variants`` maps (shape_key, method) to the formulation a baseline used (shown after the
    method)."""
    rows = [TABLE_COLUMNS]
    for rec in records:
        if ceilings is None and rec["method"] in CEILING_METHODS:
            continue
        method = rec["method"]
        variant = (variants or {}).get(f"{shape_key(rec)}|{method}")
        if variant:
            method = f"{method}[{variant}]"
        shape = (f"B{rec['batch']} ctx{kilo(rec['context'])} q{rec['q_len']} "
                 f"{rec['hq']}/{rec['hkv']} d{rec['head_dim']}")
        pct_host = None if rec["gbps"] is None or ceilings is None else 100.0 * rec["gbps"] / ceilings.host_read_gbps
        pct_ideal = None if rec["frac_of_ceiling"] is None or ceilings is None else 100.0 * rec["frac_of_ceiling"]
        ms = "missing" if rec["ms"] is None else f"{rec['ms']:.3f}"
        rows.append((method, shape, f"{100 * float(rec['hbm_fraction']):.0f}", ms, fmt_opt(rec["gbps"], ".1f"),
                     fmt_opt(pct_host, ".1f"), fmt_opt(pct_ideal, ".1f"), _fmt_bytes(rec["staging_bytes"]),
                     _fmt_bytes(rec["gpu_bytes"])))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(TABLE_COLUMNS))]
    lines = ["  ".join(str(c).ljust(w) if i < 2 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if ceilings is None:
        return "\n".join(lines)
    head = (f"ceilings: host read {ceilings.host_read_gbps:.1f} GB/s, HBM read {ceilings.hbm_read_gbps:.0f} GB/s, "
            f"memcpy H2D {ceilings.memcpy_h2d_gbps:.1f} GB/s")
    return head + "\n" + "\n".join(lines)


def problem_lines(doc: dict) -> list[str]:
    """The skipped shapes and failed checks of a results document, one line each."""
    lines = [f"skipped: {s['shape']}: {s['reason']}" for s in doc["skipped"]]
    lines += [f"CHECK FAILED: {c['method']} on {c['shape']} hbm={c['hbm_fraction']}: "
              f"rel_err={c['rel_err']} vs {c['against']} {c['detail']}" for c in doc["checks"] if not c["ok"]]
    return lines
