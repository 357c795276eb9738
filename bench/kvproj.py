"""``python -m bench kvproj``: the fused K/V projection + RoPE + store kernel against the separate
path, with the ceilings measured in the same run.

Per row (T new tokens, hidden size; bf16, Hkv 8, d 128 by default) the methods are

  ours[fused]          ``kv_project`` storing K and V into host pages (one kernel)
  ours[fused,hbm]      the same into HBM pages
  separate             what a transformers model runs: two cuBLAS linears (k_proj, v_proj), the
                       rotary math ``k * cos + rotate_half(k) * sin`` in the model dtype, then
                       ``PagedKVCache.write_slots`` into host pages
  separate[hbm]        the same into HBM pages
  gemm[cublas]         the two linears alone (for reference; not a target)

and the ceilings: the weight bytes at the HBM read rate and the host-write bytes at the rate of a
plain store kernel into pinned host memory (both measured here; cudaMemcpy D2H is reported too).
``ideal`` is the larger of the two. The target, per row: ours[fused] <= separate and
ours[fused,hbm] <= separate[hbm] (MET / MISS). Every method rotates over several weight sets
(together more than twice the L2), as a model's layers do. Times are medians of CUDA-event samples
behind a GPU-side lead (``bench.common.time_calls``).

Writes <out-dir>/<gpu>-<date>-kvproj.json and .txt (``--out-dir``, default ./bench-results).
``--device cpu`` is a smoke run of the code path on tiny shapes (no meaningful timing: no ceilings,
ideal times or targets). Exit 1 if a correctness check failed.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from bench.common import (GB, MiB, Timer, add_device_argument, add_out_dir_argument, checked_out_dir, dtype_name,
                          env_info, is_cpu_run, progress_bar, require_gpu, results_path, time_calls, torch_dtype,
                          write_json)

BENCH = "kvproj"
TOKENS = (1, 2, 4, 8, 16, 32, 64, 512, 1024, 2048, 4096, 8192)
QUICK_TOKENS = (1, 16, 64, 512, 4096)
HIDDEN = (4096, 8192)
CPU_DEFAULTS = {"tokens": (1, 5, 64), "hidden": (256,), "kv_heads": 2}
METHODS = ("ours[fused]", "ours[fused,hbm]", "separate", "separate[hbm]", "gemm[cublas]")
TARGETS = (("ours[fused]", "separate"), ("ours[fused,hbm]", "separate[hbm]"))
L2_MULTIPLE_BYTES = 150 * MiB  # weight sets rotated per method: together at least this much
HEAD_DIM = 128


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=_ints, default=None, help=f"new tokens per row [{','.join(map(str, TOKENS))}]")
    p.add_argument("--hidden", type=_ints, default=None, help="hidden sizes [4096,8192]")
    p.add_argument("--quick", action="store_true",
                   help=f"a subset: tokens {','.join(map(str, QUICK_TOKENS))}, hidden 4096")
    p.add_argument("--kv-heads", type=int, default=None, help="[8] (cpu: 2)")
    p.add_argument("--page-size", type=int, default=64, help="[64]")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "bf16", "fp16"))
    p.add_argument("--bias", action="store_true", help="with k/v biases (Qwen2-style)")
    p.add_argument("--sets", type=int, default=0,
                   help="weight sets rotated per method (0: enough for 150 MB, beyond the L2)")
    add_device_argument(p, "the code path on tiny shapes")
    add_out_dir_argument(p, "the JSON and table")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=7, help="timed samples per method")
    p.add_argument("--max-rep-s", type=float, default=1.5, help="timed seconds per method, about")
    p.add_argument("--ceiling-mb", type=int, default=1024, help="buffer size of the ceiling measurements")
    p.add_argument("--no-progress", action="store_true")


# ---- ceilings --------------------------------------------------------------------------------


def measure_ceilings(device: str, nbytes: int, timer: Timer, timing: dict) -> dict:
    """HBM read GB/s (the best torch reduction over a device buffer), host write GB/s (a store
    kernel -- fill_ -- over the UVA alias of pinned host memory) and cudaMemcpy D2H GB/s."""
    from bench.ceilings import best_read, flat_bytes
    from bench.hostmem import PinnedBuffer

    nbytes -= nbytes % 16
    hbm = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    name, hbm_gbps, _ = best_read([flat_bytes(hbm)], timer, **timing)
    host = PinnedBuffer((nbytes // 4,), torch.float32, device)
    try:
        view = host.device_view
        t = time_calls([lambda: view.fill_(1.0)], timer, **timing)
        write_gbps = nbytes / (t.ms * 1e-3) / GB
        t = time_calls([lambda: host.cpu.copy_(hbm, non_blocking=True)], timer, **timing)
        memcpy_gbps = nbytes / (t.ms * 1e-3) / GB
        timer.sync()
    finally:
        host.close()
    del hbm
    return {"hbm_read_gbps": hbm_gbps, "hbm_read_kernel": name, "host_write_gbps": write_gbps,
            "memcpy_d2h_gbps": memcpy_gbps, "bytes": nbytes}


# ---- one row ---------------------------------------------------------------------------------


class Row:
    """Inputs of one (tokens, hidden) row: ``sets`` weight sets, a cache with the tokens' pages in
    the host tier (sequence ``host_seq``) and in the HBM tier (``hbm_seq``)."""

    def __init__(self, tokens, hidden, kv_heads, page_size, dtype, bias, sets, device, seed=0):
        from directkv_cute.cache import PagedKVCache

        self.tokens, self.hidden, self.kv_heads = tokens, hidden, kv_heads
        self.dtype, self.device = dtype, device
        g = torch.Generator(device=device).manual_seed(seed)
        rnd = lambda *s: torch.randn(*s, generator=g, device=device)  # noqa: E731
        n = kv_heads * HEAD_DIM
        self.sets = []
        for _ in range(sets):
            x = rnd(tokens, hidden).to(dtype)
            w_k = (rnd(n, hidden) * hidden ** -0.5).to(dtype)
            w_v = (rnd(n, hidden) * hidden ** -0.5).to(dtype)
            b_k = rnd(n).to(dtype) if bias else None
            b_v = rnd(n).to(dtype) if bias else None
            self.sets.append((x, w_k, w_v, b_k, b_v))
        pos = torch.arange(tokens, device=device, dtype=torch.float64) + 1000
        inv = 1.0 / 500000.0 ** (torch.arange(0, HEAD_DIM, 2, device=device, dtype=torch.float64) / HEAD_DIM)
        emb = torch.cat((pos[:, None] * inv, pos[:, None] * inv), -1)
        self.cos, self.sin = emb.cos().to(dtype), emb.sin().to(dtype)
        pages = math.ceil(tokens / page_size) + 1
        self.cache = PagedKVCache(1, kv_heads, HEAD_DIM, page_size, num_host_pages=pages, num_hbm_pages=pages,
                                  dtype=dtype, device=device)
        self.host_seq, self.hbm_seq = self.cache.add_sequence(), self.cache.add_sequence()
        self.cache.extend(self.host_seq, tokens, "host")
        self.cache.extend(self.hbm_seq, tokens, "hbm")
        self.slots = {"host": self.cache.token_slots([self.host_seq], [0], [tokens]),
                      "hbm": self.cache.token_slots([self.hbm_seq], [0], [tokens])}

    @property
    def weight_bytes(self) -> int:
        return 2 * self.kv_heads * HEAD_DIM * self.hidden * self.dtype.itemsize

    @property
    def kv_bytes(self) -> int:
        return 2 * self.tokens * self.kv_heads * HEAD_DIM * self.dtype.itemsize

    def close(self):
        self.cache.close()

    # -- methods -------------------------------------------------------------------------------
    def fused(self, tier: str):
        from directkv_cute.kv_proj import cache_destinations, kv_project

        dest = cache_destinations(self.cache, self.slots[tier])
        cos, sin = self.cos, self.sin

        def call(s):
            x, w_k, w_v, b_k, b_v = s
            kv_project(x, w_k, w_v, b_k, b_v, cos=cos, sin=sin, layer=0, check_slots=False, **dest)
        return [lambda s=s: call(s) for s in self.sets]

    def separate(self, tier: str | None):
        """transformers' path: k_proj, v_proj, the rotary math in the model dtype, write_slots
        (``tier`` None: the linears alone)."""
        from directkv_cute.kv_proj import rotate_half

        t, h, d = self.tokens, self.kv_heads, HEAD_DIM
        cos, sin = self.cos[:, None, :], self.sin[:, None, :]
        slots = self.slots[tier] if tier else None
        linear = torch.nn.functional.linear

        def call(s):
            x, w_k, w_v, b_k, b_v = s
            k = linear(x, w_k, b_k).view(t, h, d)
            v = linear(x, w_v, b_v).view(t, h, d)
            if slots is None:
                return k, v
            k = (k * cos) + (rotate_half(k) * sin)
            self.cache.write_slots(slots, 0, k, v)
            return k, v
        return [lambda s=s: call(s) for s in self.sets]

    def check(self, tier: str) -> tuple[bool, str]:
        """ours vs the separate path on the first weight set: the rows of the tier's pages."""
        self.fused(tier)[0]()
        ours = self.cache.read(self.host_seq if tier == "host" else self.hbm_seq, 0, 0, self.tokens)
        self.separate(tier)[0]()
        theirs = self.cache.read(self.host_seq if tier == "host" else self.hbm_seq, 0, 0, self.tokens)
        worst, exact = 0.0, 1.0
        for a, b in zip(ours, theirs):
            if torch.isnan(a).any():
                return False, "NaN in ours"
            worst = max(worst, ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-6)).item())
            exact = min(exact, (a == b).double().mean().item())
        # cuBLAS and our kernel sum the dot products in different orders: rare one-ulp flips.
        ok = worst < 2e-2 and exact > 0.95
        return ok, f"max rel gap {worst:.2e}, {exact:.4f} bit-equal"


def _row_result(row: Row, ceil: dict, timer: Timer, timing: dict, page_size: int, targets: bool = True) -> dict:
    out = {"tokens": row.tokens, "hidden": row.hidden, "kv_heads": row.kv_heads, "head_dim": HEAD_DIM,
           "page_size": page_size, "dtype": dtype_name(row.dtype), "weight_bytes": row.weight_bytes,
           "kv_bytes": row.kv_bytes, "sets": len(row.sets), "methods": {}, "checks": {}}
    weights_ms = row.weight_bytes / (ceil["hbm_read_gbps"] * GB) * 1e3
    host_ms = row.kv_bytes / (ceil["host_write_gbps"] * GB) * 1e3
    out["ceilings_ms"] = {"weights_hbm": weights_ms, "kv_host_write": host_ms, "ideal_host": max(weights_ms, host_ms),
                          "ideal_hbm": weights_ms}
    for tier in ("host", "hbm"):
        ok, detail = row.check(tier)
        out["checks"][tier] = {"ok": ok, "detail": detail}
    calls = {"ours[fused]": row.fused("host"), "ours[fused,hbm]": row.fused("hbm"),
             "separate": row.separate("host"), "separate[hbm]": row.separate("hbm"),
             "gemm[cublas]": row.separate(None)}
    for name in METHODS:
        t = time_calls(calls[name], timer, **timing)
        out["methods"][name] = {"ms": t.ms, "samples": t.samples, "inner": t.inner}
    out["targets"] = {}
    for ours, theirs in TARGETS if targets else ():
        a, b = out["methods"][ours]["ms"], out["methods"][theirs]["ms"]
        out["targets"][f"{ours} <= {theirs}"] = {"met": a <= b, "ratio": a / b}
    return out


def format_table(doc: dict) -> str:
    """The rows' times under the ceilings, with the ideal times and the targets (a CPU smoke run:
    the times and checks alone)."""
    c = doc["ceilings"]
    gpu = not is_cpu_run(doc["header"])
    ceilings = (f": HBM read {c['hbm_read_gbps']:.0f} GB/s, host write {c['host_write_gbps']:.1f} GB/s (store "
                f"kernel), memcpy D2H {c['memcpy_d2h_gbps']:.1f} GB/s") if gpu else ""
    lines = [f"kvproj on {doc['header']['gpu']}{ceilings}",
             f"{'tokens':>6} {'hidden':>6} " + " ".join(f"{m:>15}" for m in METHODS)
             + (f" {'ideal':>8} {'ideal,hbm':>9}  target (fused<=separate | hbm)" if gpu else "") + "  check"]
    for r in doc["rows"]:
        ms = " ".join(f"{r['methods'][m]['ms']:15.4f}" for m in METHODS)
        chk = "ok" if all(v["ok"] for v in r["checks"].values()) else "FAIL " + "; ".join(
            f"{k}: {v['detail']}" for k, v in r["checks"].items() if not v["ok"])
        if not gpu:
            lines.append(f"{r['tokens']:>6} {r['hidden']:>6} {ms}  {chk}")
            continue
        tg = " | ".join(("MET " if t["met"] else "MISS") + f" {t['ratio']:.2f}x" for t in r["targets"].values())
        ceil = r["ceilings_ms"]
        lines.append(f"{r['tokens']:>6} {r['hidden']:>6} {ms} {ceil['ideal_host']:8.4f} {ceil['ideal_hbm']:9.4f}  "
                     f"{tg:<29}  {chk}")
    if gpu:
        met = sum(t["met"] for r in doc["rows"] for t in r["targets"].values())
        total = sum(len(r["targets"]) for r in doc["rows"])
        lines.append(f"(ms per call, medians) targets met: {met}/{total}")
    else:
        lines.append("(ms per call on the CPU: a smoke run, no meaningful timing)")
    return "\n".join(lines)


def run_kvproj(ns: argparse.Namespace) -> int:
    device = require_gpu(ns.device, command="bench kvproj")
    out_dir = checked_out_dir(ns.out_dir)
    cpu = device == "cpu"
    tokens = ns.tokens or (CPU_DEFAULTS["tokens"] if cpu else QUICK_TOKENS if ns.quick else TOKENS)
    hidden = ns.hidden or (CPU_DEFAULTS["hidden"] if cpu else (4096,) if ns.quick else HIDDEN)
    kv_heads = ns.kv_heads or (CPU_DEFAULTS["kv_heads"] if cpu else 8)
    dtype = torch_dtype(dtype_name(ns.dtype))
    timing = (dict(warmup=1, reps=1, max_total_s=0.05, min_sample_ms=0.1) if cpu else
              dict(warmup=ns.warmup, reps=ns.reps, max_total_s=ns.max_rep_s, min_sample_ms=2.0))
    timer = Timer(device)
    header = env_info(device)
    path = results_path(out_dir, header, BENCH)
    print(f"directkv bench kvproj on {header['gpu']} -> {path}", flush=True)
    ceil = measure_ceilings(device, (16 if cpu else ns.ceiling_mb) * MiB, timer, timing)
    args = {k: v for k, v in vars(ns).items() if isinstance(v, (str, int, float, bool, list, tuple, type(None)))}
    args.update(device=device, tokens=list(tokens), hidden=list(hidden), kv_heads=kv_heads, timing=timing)
    doc = {"schema": "directkv-bench/1", "bench": BENCH, "header": header, "ceilings": ceil, "args": args,
           "passed": True, "rows": []}
    write_json(path, doc)
    grid = [(t, h) for h in hidden for t in tokens]
    bar = progress_bar(grid, not ns.no_progress, BENCH, "row")
    for t, h in bar:
        weight_bytes = 2 * kv_heads * HEAD_DIM * h * dtype.itemsize
        sets = ns.sets or max(1, math.ceil((1 if cpu else L2_MULTIPLE_BYTES) / weight_bytes))
        t0 = time.monotonic()
        row = Row(t, h, kv_heads, ns.page_size, dtype, ns.bias, sets, device, seed=t + h)
        try:
            result = _row_result(row, ceil, timer, timing, ns.page_size, targets=not cpu)
        finally:
            row.close()
            del row
            if not cpu:
                torch.cuda.empty_cache()
        result["wall_s"] = time.monotonic() - t0
        doc["rows"].append(result)
        doc["passed"] = doc["passed"] and all(v["ok"] for v in result["checks"].values())
        write_json(path, doc)
    text = format_table(doc)
    print(text, flush=True)
    txt = results_path(out_dir, header, BENCH, ext="txt")
    txt.write_text(text + "\n")
    print(f"files:\n  {path}\n  {txt}", flush=True)
    print("PASSED all correctness checks" if doc["passed"] else "FAILED: some correctness checks failed", flush=True)
    return 0 if doc["passed"] else 1


def cmd_kvproj(ns: argparse.Namespace) -> int:
    return run_kvproj(ns)
