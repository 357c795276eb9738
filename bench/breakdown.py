"""Where one op call's GPU time goes, a GPU diagnostic: ``python -m bench breakdown``.

End-to-end timings say how long a call takes; this says what the GPU did in it. The op runs on
one shape (the same cache build as ``bench timeline``), first timed back to back with CUDA events,
then a few calls under ``torch.profiler``: every kernel and copy it launched, with its median
duration and the median idle gap before it, and the GPU span per call: a split combine's
kernel time, or a host-to-device copy a call should not make, shows up here.

It needs a CUDA GPU (no CPU run). ``--json`` also writes the summary as
``<out-dir>/<gpu>-<date>-breakdown.json`` (``--out-dir``, default ./bench-results).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench.common import add_out_dir_argument, checked_out_dir, require_gpu, results_path, write_json


def build_shape(spec: dict):
    """(cache, tables, q) for ``spec`` (context, q_len, hq, hkv, head_dim, page_size, dtype,
    hbm_fraction; optional kv_dtype "fp8" / "e5m2": FP8 pages, quantized as they are appended;
    optional window: the pages of the query tokens mirrored in HBM, as a model step's window
    leaves them): one sequence of random K/V appended from the GPU, the given fraction of its
    pages moved to HBM. ``bench timeline``'s child builds its shape with it too."""
    import torch

    import directkv_cute as dk

    hq, hkv, d, page, ctx, ql = (spec[k] for k in ("hq", "hkv", "head_dim", "page_size", "context", "q_len"))
    dtype = getattr(torch, spec["dtype"])
    pages = math.ceil(ctx / page)
    kv = {}
    if spec.get("kv_dtype"):
        from directkv_cute.fp8 import fp8_dtype

        kv = dict(dtype=fp8_dtype(spec["kv_dtype"]), compute_dtype=dtype)
    window = bool(spec.get("window"))
    extra = dict(num_window_pages=math.ceil(ql / page) + 1) if window else {}
    cache = dk.PagedKVCache(1, hkv, d, page, num_host_pages=pages + 1, num_hbm_pages=pages + 1,
                            **(kv or dict(dtype=dtype)), **extra)
    sid = cache.add_sequence()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for s in range(0, ctx, 8192):
        n = min(8192, ctx - s)
        cache.append(sid, torch.randn(n, 1, hkv, d, generator=gen, device="cuda").to(dtype),
                     torch.randn(n, 1, hkv, d, generator=gen, device="cuda").to(dtype))
    if spec["hbm_fraction"]:
        cache.set_hbm_fraction(sid, spec["hbm_fraction"])
    if window:  # the step's own tokens, stored again through to their new mirrors
        cache.mirror(sid, ctx - ql, ql)
        cache.write(sid, 0, ctx - ql, *cache.read(sid, 0, ctx - ql, ctx))
    q = torch.randn(ql, hq, d, generator=gen, device="cuda").to(dtype)
    return cache, cache.kernel_tables([sid]), q


def summarize_events(events: Sequence[tuple[float, float, str]], calls: int) -> dict:
    """Per-activity statistics of ``calls`` back-to-back op calls from the GPU activities
    ``(start_us, end_us, name)`` the profiler saw: for each name (in first-seen order) how many
    ran, their median duration and the median idle time before each (since the previous
    activity ended; the first activity has none), and the GPU span per call (first start to last
    end, divided by ``calls``)."""
    if calls < 1:
        raise ValueError("calls must be >= 1")
    evs = sorted(events)
    if not evs:
        return {"calls": calls, "span_us_per_call": 0.0, "activities": []}
    stats: dict[str, dict] = {}
    prev_end = None
    for start, end, name in evs:
        s = stats.setdefault(name, {"name": name, "dur": [], "gap": []})
        s["dur"].append(end - start)
        if prev_end is not None:
            s["gap"].append(max(0.0, start - prev_end))
        prev_end = end if prev_end is None else max(prev_end, end)
    acts = [{"name": s["name"], "count": len(s["dur"]), "per_call": len(s["dur"]) / calls,
             "median_us": statistics.median(s["dur"]),
             "gap_before_median_us": statistics.median(s["gap"]) if s["gap"] else None} for s in stats.values()]
    span = (max(e for _, e, _ in evs) - evs[0][0]) / calls
    return {"calls": calls, "span_us_per_call": span, "activities": acts, "last_call": last_call(evs, calls)}


def last_call(events: Sequence[tuple[float, float, str]], calls: int) -> list[dict]:
    """The last of ``calls`` calls' activities (every call launches as many; else []), each with
    its start and end in us since that call's first start: where copies and kernels overlap."""
    evs = sorted(events)
    if not evs or len(evs) % calls:
        return []
    tail = evs[len(evs) - len(evs) // calls:]
    t0 = tail[0][0]
    return [{"name": n, "start_us": s - t0, "end_us": e - t0} for s, e, n in tail]


def format_breakdown(res: dict) -> str:
    lines = [f"config {res['config']}",
             f"op {res['op_us']:.1f} us per call (median of samples of {res['timed_calls']} back-to-back calls, device time); "
             f"GPU span {res['span_us_per_call']:.1f} us per call over {res['calls']} profiled calls",
             f"{'activity':64s} {'per call':>8s} {'median us':>10s} {'gap before us':>14s}"]
    for a in res["activities"]:
        gap = "-" if a["gap_before_median_us"] is None else f"{a['gap_before_median_us']:.1f}"
        lines.append(f"{a['name'][:64]:64s} {a['per_call']:8.2f} {a['median_us']:10.1f} {gap:>14s}")
    if res.get("last_call"):
        lines.append(f"the last call, us since its first activity ({len(res['last_call'])} activities):")
        lines += [f"  {e['start_us']:9.1f} {e['end_us']:9.1f}  {e['name'][:64]}" for e in res["last_call"]]
    return "\n".join(lines)


def run_breakdown(spec: dict, calls: int = 10) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import directkv_cute as dk
    from bench.harness import _decode_config

    cache, tables, q = build_shape(spec)
    cfg = _decode_config(spec["config"])
    q_lens = [spec["q_len"]] if spec["q_len"] > 1 else None

    def run():
        return dk.paged_attention_tables(q, cache, 0, tables, q_lens, config=cfg)

    # Warm up for at least 0.2 s (compiles, the profile table, and the GPU's clocks, which ramp up
    # after an idle spell such as a compile), then time it as the benches do (device time).
    start = time.perf_counter()
    while True:
        run()
        torch.cuda.synchronize()
        if time.perf_counter() - start > 0.2:
            break
    from bench.common import Timer, time_calls

    timing = time_calls([run], Timer("cuda"), reps=3)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
    events = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
              if e.device_type == torch.autograd.DeviceType.CUDA]
    cache.close()
    res = summarize_events(events, calls)
    return {"config": spec["config"] or "profile or default", "op_us": timing.ms * 1e3, "timed_calls": timing.inner,
            **res}


def add_shape_arguments(p, context: int, config_help: str) -> None:
    """The shape and config options of the one-shape GPU diagnostics (breakdown, timeline)."""
    p.add_argument("--context", type=int, default=context)
    p.add_argument("--q-len", type=int, default=512)
    p.add_argument("--heads", default="32/8", help="Hq/Hkv")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--hbm-fraction", type=float, default=0.0, help="fraction of pages in the HBM tier")
    p.add_argument("--kv-dtype", default=None, choices=("fp8", "e5m2"), help="FP8 pages (default: the q dtype)")
    p.add_argument("--window", action="store_true",
                   help="the query tokens' pages mirrored in HBM (the HBM window of a model step)")
    p.add_argument("--config", default=None,
                   help=f"DecodeConfig as JSON, or a QTiledConfig with \"kernel\": \"q_tiled\" "
                        f"(default: {config_help})")
    p.add_argument("--json", action="store_true",
                   help="also write the summary as <out-dir>/<gpu>-<date>-<command>.json")
    add_out_dir_argument(p, "the --json summary")


def shape_spec(ns, command: str) -> dict:
    """The spec of ``ns``'s shape; a bad config raises here, before anything is built."""
    from bench.harness import _decode_config

    hq, hkv = (int(x) for x in ns.heads.split("/"))
    config = json.loads(ns.config) if ns.config else None
    _decode_config(config)
    return dict(context=ns.context, q_len=ns.q_len, hq=hq, hkv=hkv, head_dim=ns.head_dim, page_size=ns.page_size,
                dtype=ns.dtype, hbm_fraction=ns.hbm_fraction, config=config, kv_dtype=ns.kv_dtype,
                window=ns.window)


def add_arguments(p) -> None:
    add_shape_arguments(p, 8192, "the profile or the default")
    p.add_argument("--calls", type=int, default=10, help="calls under the profiler")


def prepare(ns, command: str) -> tuple[dict, Path | None]:
    """The GPU diagnostics' checks before any work: a GPU (``require_gpu``), the shape's spec and,
    with ``--json``, the file the summary goes to (under a checked ``--out-dir``)."""
    from bench.common import env_info

    require_gpu(command=f"bench {command}", cpu_run=False)
    spec = shape_spec(ns, command)
    out = results_path(checked_out_dir(ns.out_dir), env_info("cuda"), command) if ns.json else None
    return spec, out


def write_summary(path: Path | None, spec: dict, res: dict) -> None:
    if path is not None:
        write_json(path, dict(spec=spec, **res))
        print(f"wrote {path}")


def cmd_breakdown(ns) -> int:
    if ns.calls < 1:
        print("bench breakdown: --calls must be >= 1", file=sys.stderr)
        return 2
    spec, out = prepare(ns, "breakdown")
    res = run_breakdown(spec, calls=ns.calls)
    print(format_breakdown(res))
    write_summary(out, spec, res)
    return 0


__all__ = ["add_arguments", "add_shape_arguments", "build_shape", "cmd_breakdown", "format_breakdown", "last_call",
           "prepare", "run_breakdown", "shape_spec", "summarize_events", "write_summary"]
