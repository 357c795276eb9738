"""Per-CTA timeline of the multi-token kernel, a GPU diagnostic: ``python -m bench timeline``.

It answers "where does the time go" questions that end-to-end timings cannot: when each CTA's
chunk of KV tiles has landed, how long its consumers take per chunk, and how one chunk's passes
(one 64-row query block over the chunk) split into the Q gather + partial reload, the WGMMA loop
and the finalize + store, as medians and tails over all CTAs.

How: the multi-token kernel has timeline stamps as a compile-time option
(``directkv_cute.kernels.trace``): inside ``tracing(Trace(address, chunk))`` the op compiles
a kernel of its own (a separate compile key, never cached on disk) whose first consumer thread
of each CTA reads ``%globaltimer`` at those points into a device buffer at that address. The
op's own kernels, outside the block, have none of it (their code is unchanged). The timeline runs
in this process: the op is timed untraced, then run traced on the same inputs.

It needs a CUDA GPU (no CPU run). ``--json`` also writes the summary as
``<out-dir>/<gpu>-<date>-timeline.json`` (``--out-dir``, default ./bench-results).
"""

from __future__ import annotations

import sys

from directkv_cute.kernels.trace import SLOTS

# A "chunk" below is a round of the walk: one pass of every query block (over one chunk of tiles,
# or with stagger over each block's own bounds; "landed" is then the first block's tiles). The
# stamp layout per CTA is ``directkv_cute.kernels.trace``'s (SLOTS int64 values).


def trace_run(spec: dict) -> dict:
    """On the GPU: build the shape, time the op (untraced), run it traced, summarise the stamps."""
    import torch

    import directkv_cute as dk
    from bench.breakdown import build_shape
    from bench.common import Timer, time_calls
    from directkv_cute.config import DecodeConfig, default_multi_token_config
    from directkv_cute.kernels.trace import TRACE_ELEMS, Trace, tracing

    hq, hkv, d, ql = (spec[k] for k in ("hq", "hkv", "head_dim", "q_len"))
    cfg = DecodeConfig.from_dict(spec["config"]) if spec["config"] else default_multi_token_config(d, ql * hq // hkv)
    cache, tables, q = build_shape(spec)

    def run():
        return dk.paged_attention_tables(q, cache, 0, tables, [ql], config=cfg)

    op_ms = time_calls([run], Timer("cuda"), warmup=3, reps=3).ms  # device time, as the benches time it
    buf = torch.zeros(TRACE_ELEMS, dtype=torch.int64, device="cuda")
    with tracing(Trace(buf.data_ptr(), int(spec["chunk"]), bool(spec.get("skip_passes")))):
        run()  # compiles the traced kernel; the second run is the one summarised
        torch.cuda.synchronize()
        buf.zero_()
        run()
        torch.cuda.synchronize()
    res = summarize_stamps(buf.view(-1, SLOTS).cpu(), cfg.to_dict(), op_ms)  # it drops CTAs that never ran
    cache.close()
    return res


def summarize_stamps(stamps, config: dict, op_ms: float) -> dict:
    """The summary of a stamp buffer (CTAs x SLOTS int64 nanoseconds, 0 = not written): per chunk
    when its tiles landed and when the consumers were done (min / median / max over CTAs), and per
    phase of the traced chunk's passes the median and p90."""
    import torch

    t = stamps[stamps[:, 0] > 0]
    # Nanoseconds since the first CTA started, subtracted in int64 (a double cannot hold the
    # absolute timer to the nanosecond); -1 marks a stamp that was never written.
    rel = torch.where(t > 0, t - t[:, 0].min(), torch.full_like(t, -1)).double()
    res = {"config": dict(config), "op_ms": float(op_ms), "ctas": int(t.shape[0]), "chunks": []}
    for j in range(31):
        ready, done = rel[:, 1 + 2 * j], rel[:, 2 + 2 * j]
        m = (ready >= 0) & (done >= 0)
        if not bool(m.any()):
            break
        r, e = ready[m] / 1e3, done[m] / 1e3
        # The consumers' wait for this chunk: from their previous chunk's end (the CTA's start for
        # chunk 0) to this chunk's landing; 0 when it had landed already.
        prev = rel[:, 2 * j] if j else rel[:, 0]
        w = ((ready - prev)[m & (prev >= 0)] / 1e3).clamp(min=0)
        res["chunks"].append({"chunk": j, "ctas": int(m.sum()),
                              "ready_us": [float(r.min()), float(r.median()), float(r.max())],
                              "done_us": [float(e.min()), float(e.median()), float(e.max())],
                              "busy_us_median": float((e - r).median()),
                              "wait_us": [float(w.median()), float(w.max())] if w.numel() else [0.0, 0.0]})
    res["span_us"] = float(rel[:, 1:63].max() / 1e3)
    p = rel[:, 64:128].reshape(-1, 4)
    p = p[(p >= 0).all(dim=1)]
    if p.shape[0]:
        phase = {"gather_reload": p[:, 1] - p[:, 0], "wgmma": p[:, 2] - p[:, 1], "finalize_store": p[:, 3] - p[:, 2]}
        res["passes"] = {k: {"n": int(v.numel()), "median_us": float(v.median() / 1e3),
                             "p90_us": float(v.quantile(0.9) / 1e3)} for k, v in phase.items()}
    return res


def run_timeline(spec: dict) -> dict:
    """The timeline summary of one shape (needs a CUDA GPU)."""
    return trace_run(spec)


def format_timeline(res: dict) -> str:
    lines = [f"config {res['config']}" + (" (passes skipped: link phase only, outputs not computed)"
                                          if res.get("skip_passes") else ""),
             f"op {res['op_ms']:.3f} ms (back-to-back calls, device time); {res['ctas']} CTAs; "
             f"kernel span {res['span_us']:.0f} us (first CTA start to last chunk done)",
             "chunk  ctas   landed min/med/max (us)        done min/med/max (us)       busy med (us)"
             "   wait med/max (us)"]
    for c in res["chunks"]:
        r, d = c["ready_us"], c["done_us"]
        w = c.get("wait_us", [0.0, 0.0])
        lines.append(f"{c['chunk']:5d}  {c['ctas']:4d}  {r[0]:8.1f} {r[1]:8.1f} {r[2]:8.1f}   "
                     f"{d[0]:8.1f} {d[1]:8.1f} {d[2]:8.1f}   {c['busy_us_median']:8.1f}   {w[0]:8.1f} {w[1]:8.1f}")
    for k, v in res.get("passes", {}).items():
        lines.append(f"pass {k:15s} median {v['median_us']:6.2f} us  p90 {v['p90_us']:6.2f} us  ({v['n']} passes)")
    return "\n".join(lines)


def add_arguments(p) -> None:
    from bench.breakdown import add_shape_arguments

    add_shape_arguments(p, 32768, "the multi-token default")
    p.add_argument("--chunk", type=int, default=2, help="the chunk whose passes are stamped")
    p.add_argument("--skip-passes", action="store_true",
                   help="consumers run no pass (the link phase alone, to set against a normal run)")


def cmd_timeline(ns) -> int:
    from bench.breakdown import prepare, write_summary

    spec, out = prepare(ns, "timeline")
    if spec["kv_dtype"] or (spec["config"] or {}).get("kernel") == "q_tiled":
        print("bench timeline stamps the multi-token kernel over 16-bit pages: no --kv-dtype, no q_tiled config "
              "(bench breakdown lists any call's kernels and copies)", file=sys.stderr)
        return 2
    spec.update(chunk=ns.chunk, skip_passes=bool(ns.skip_passes))
    res = run_timeline(spec) | {"skip_passes": bool(ns.skip_passes)}
    print(format_timeline(res))
    write_summary(out, spec, res)
    return 0


__all__ = ["SLOTS", "add_arguments", "cmd_timeline", "format_timeline", "run_timeline", "summarize_stamps",
           "trace_run"]
