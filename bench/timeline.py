"""Per-CTA timeline of the multi-token kernel, a GPU diagnostic: ``python -m bench timeline``.

It answers "where does the time go" questions that end-to-end timings cannot: when each CTA's
chunk of KV tiles has landed, how long its consumers take per chunk, and how one chunk's passes
(one 64-row query block over the chunk) split into the Q gather + partial reload, the WGMMA loop
and the finalize + store, as medians and tails over all CTAs.

How: an instrumented copy of the installed ``directkv_cute`` is written to a temporary folder
(the package's own sources are never touched, so tuned profiles and compile caches stay valid).
In the copy, the first consumer thread of each CTA reads ``%globaltimer`` at those points and
stores the stamps into a buffer whose address is baked into the kernel at compile time. A child
interpreter, started in that folder so that it imports the copy, runs the op on one shape and
prints the summary. The patches are anchored on lines of ``kernels/multi_token.py``; when the kernel
changes so that an anchor is gone, ``instrument`` says which one (a CPU test checks that they
still apply and that the instrumented kernel compiles for sm_90a).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# A "chunk" below is a round of the walk: one pass of every query block (over one chunk of tiles,
# or with stagger over each block's own bounds; "landed" is then the first block's tiles).
SLOTS = 128  # int64 stamps per CTA: [0] start, [1 + 2j] chunk j landed, [2 + 2j] chunk j done (j < 31),
# [64 + 4p + k] pass p < 16 of the traced chunk: k = 0 start, 1 before the WGMMA loop, 2 after it, 3 stored

_INIT = """        self.chunk = cfg.chunk
"""
_PATCHES = (
    ("the kernel's static config", _INIT,
     """        import os
        self.trace_addr = int(os.environ["DIRECTKV_TIMELINE_ADDR"])
        self.trace_chunk = int(os.environ.get("DIRECTKV_TIMELINE_CHUNK", "2"))
""" + _INIT),
    ("the walk's pipeline states",
     """            wait_state = RingState.consumer(self.stages)""",
     """            cta_id = split * self.cluster + cta.rank + num_splits * self.cluster * (kvh + num_kv_heads * cta.b)
            tr = cute.make_tensor(
                cute.make_ptr(cutlass.Int64, self.trace_addr, cute.AddressSpace.gmem, assumed_align=8),
                cute.make_layout(1 << 26),
            )
            if w.ctidx == 0:
                tr[cta_id * 128] = cute.arch.globaltimer()
            wait_state = RingState.consumer(self.stages)"""),
    ("the wait for a pass's tiles",
     """                    waited = wait_state.wait_through(kv_pipe, waited, e_rel)
""",
     """                    waited = wait_state.wait_through(kv_pipe, waited, e_rel)
                    if w.ctidx == 0 and j < 31 and m == 0:
                        tr[cta_id * 128 + 1 + 2 * j] = cute.arch.globaltimer()
"""),
    ("the end of a round",
     """                nxt = self.walk.round_begin(j + 1, n_rounds, n_mine, n_tiles)
                waited = wait_state.wait_through(kv_pipe, waited, nxt)
""",
     """                if w.ctidx == 0 and j < 31:
                    tr[cta_id * 128 + 2 + 2 * j] = cute.arch.globaltimer()
                nxt = self.walk.round_begin(j + 1, n_rounds, n_mine, n_tiles)
                waited = wait_state.wait_through(kv_pipe, waited, nxt)
"""),
    ("the start of a pass",
     """                        nb = rb + step
""",
     """                        pidx = m
                        if w.ctidx == 0 and j == self.trace_chunk and pidx < 16:
                            tr[cta_id * 128 + 64 + 4 * pidx] = cute.arch.globaltimer()
                        nb = rb + step
"""),
    ("the pass's WGMMA loop",
     """                        self.attend_tiles(w, cta, c_begin, t_stop""",
     """                        if w.ctidx == 0 and j == self.trace_chunk and pidx < 16:
                            tr[cta_id * 128 + 65 + 4 * pidx] = cute.arch.globaltimer()
                        self.attend_tiles(w, cta, c_begin, t_stop"""),
    ("the pass's finalize and store",
     """                        softmax_finalize(w.acc_O, w.row_max, w.row_sum, w.lse, scale_log2)
                        self.qio.store(mO, mLSE, w.acc_O, w.lse, w.thr_pv, split, q_start, q_len, kvh, 0, tok0, qb)
""",
     """                        if w.ctidx == 0 and j == self.trace_chunk and pidx < 16:
                            tr[cta_id * 128 + 66 + 4 * pidx] = cute.arch.globaltimer()
                        softmax_finalize(w.acc_O, w.row_max, w.row_sum, w.lse, scale_log2)
                        self.qio.store(mO, mLSE, w.acc_O, w.lse, w.thr_pv, split, q_start, q_len, kvh, 0, tok0, qb)
                        if w.ctidx == 0 and j == self.trace_chunk and pidx < 16:
                            tr[cta_id * 128 + 67 + 4 * pidx] = cute.arch.globaltimer()
"""),
)


# ``--skip-passes``: the consumers wait for each chunk and release it but run no pass over it (no
# Q gather, no WGMMA, no partial traffic), so the timeline shows the link phase with idle
# consumers, to set against a normal run (outputs are not computed).
_SKIP_PASSES = ("the pass over a block",
                """                    if j == 0 or t_stop > c_begin:
""",
                """                    if const_expr(False):  # bench timeline --skip-passes
""")


class InstrumentError(RuntimeError):
    """The kernel source no longer has a line the instrumentation is anchored on."""


def instrument(dst: Path, src_pkg: Path | None = None, skip_passes: bool = False) -> Path:
    """Copy the ``directkv_cute`` package (with ``tuning`` and ``profiles`` as its subpackages, as
    installed) into ``dst`` and instrument the copy's multi-token kernel (``skip_passes``: and
    take its passes out); returns ``dst``."""
    import directkv_cute

    src_pkg = Path(src_pkg or Path(directkv_cute.__file__).parent)
    pkg = Path(dst) / "directkv_cute"
    shutil.copytree(src_pkg, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    for sub in ("tuning", "profiles"):
        if not (pkg / sub).exists():
            try:
                mod = __import__(f"directkv_cute.{sub}", fromlist=["__name__"])
                shutil.copytree(Path(mod.__file__).parent, pkg / sub, ignore=shutil.ignore_patterns("__pycache__"))
            except (ImportError, TypeError):
                pass  # profiles are only needed for a lookup; the timeline always passes a config
    kernel = pkg / "kernels" / "multi_token.py"
    text = kernel.read_text()
    for what, old, new in _PATCHES + ((_SKIP_PASSES,) if skip_passes else ()):
        if text.count(old) != 1:
            raise InstrumentError(f"bench.timeline: the anchor at {what} is not (once) in {kernel.name}; "
                                  "update bench/timeline.py to the kernel's new code")
        text = text.replace(old, new)
    kernel.write_text(text)
    return Path(dst)


_CHILD = r'''
import json, sys
import torch
from bench.timeline import SLOTS

spec = json.loads(sys.argv[1])
buf = torch.zeros(1 << 26, dtype=torch.int64, device="cuda")  # the kernel's view: (1 << 26,)
import os
os.environ["DIRECTKV_TIMELINE_ADDR"] = str(buf.data_ptr())
os.environ["DIRECTKV_TIMELINE_CHUNK"] = str(spec["chunk"])
os.environ["DIRECTKV_DISK_CACHE"] = "0"  # the address is part of the code
import directkv_cute as dk
from directkv_cute.config import DecodeConfig, default_prefill_config

from bench.breakdown import build_shape

hq, hkv, d, ql = (spec[k] for k in ("hq", "hkv", "head_dim", "q_len"))
cfg = DecodeConfig.from_dict(spec["config"]) if spec["config"] else default_prefill_config(d, ql * hq // hkv)
cache, tables, q = build_shape(spec)
run = lambda: dk.paged_attention_tables(q, cache, 0, tables, [ql], config=cfg)
from bench.common import Timer, time_calls
op_ms = time_calls([run], Timer("cuda"), warmup=3, reps=3).ms  # device time, as the benches time it
buf.zero_()
run()
torch.cuda.synchronize()
from bench.timeline import summarize_stamps

stamps = buf.view(-1, SLOTS)
res = summarize_stamps(stamps.cpu(), cfg.to_dict(), op_ms)  # it drops the CTAs that never ran
print(json.dumps(res))
'''


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


def child_env(environ=None) -> dict:
    """The child's environment: PYTHONPATH keeps the folders that bring cutlass and torch (the GPU
    machine's wheels live on it) but loses any that holds a ``directkv_cute``, which would shadow
    the instrumented copy."""
    env = dict(os.environ if environ is None else environ)
    keep = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and not (Path(p) / "directkv_cute").is_dir()]
    if keep:
        env["PYTHONPATH"] = os.pathsep.join(keep)
    else:
        env.pop("PYTHONPATH", None)
    return env


def run_timeline(spec: dict, keep: Path | None = None) -> dict:
    """Instrument a copy, run the child on the GPU, return its summary dict."""
    with tempfile.TemporaryDirectory(prefix="dk-timeline-") as tmp:
        root = instrument(Path(keep or tmp), skip_passes=bool(spec.get("skip_passes")))
        script = root / "timeline_child.py"
        script.write_text(_CHILD)
        proc = subprocess.run([sys.executable, str(script), json.dumps(spec)], cwd=root, env=child_env(),
                              capture_output=True, text=True, timeout=900)
        if proc.returncode:
            raise RuntimeError(f"bench timeline: the instrumented run failed:\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])


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
    from bench.breakdown import shape_spec

    spec = shape_spec(ns, "timeline")
    if spec is None:
        return 2
    spec.update(chunk=ns.chunk, skip_passes=bool(ns.skip_passes))
    res = run_timeline(spec) | {"skip_passes": bool(ns.skip_passes)}
    print(format_timeline(res))
    if ns.json:
        Path(ns.json).write_text(json.dumps(dict(spec=spec, **res), indent=1))
    return 0


__all__ = ["InstrumentError", "add_arguments", "cmd_timeline", "format_timeline", "instrument", "run_timeline",
           "summarize_stamps"]
