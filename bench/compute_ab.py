"""Compute efficiency of the Q-tiled kernel against FlashAttention-4, same run: each shape's KV
all in HBM pages (ours) and dense in HBM (fa4), bf16, Hq/Hkv 32/8, d 128, page 64, batch 1,
causal; each config of ours timed back to back with CUDA events (medians of 7 samples, each
behind a GPU sleep covering the host's enqueue time), checked against FA4's output, with TFLOP/s.

usage: python -m bench.compute_ab SHAPES CONFIGS_JSON [out.json]
  SHAPES: CONTEXTxQ_LEN,... e.g. 8192x512,32768x8192; CONFIGS_JSON: a list of QTiledConfig dicts.
A kernel-source A/B runs this twice in one command, once per copy of the package."""
import json, math, statistics, sys, time
import torch
from directkv_cute.cache import PagedKVCache
from directkv_cute.config import QTiledConfig
from directkv_cute.ops import paged_attention_tables

shapes = [tuple(int(v) for v in s.split("x")) for s in sys.argv[1].split(",")]
cfgs = [QTiledConfig.from_dict(d) for d in json.loads(sys.argv[2])]
hq, hkv, d, P, dt = 32, 8, 128, 64, torch.bfloat16
try:
    from flash_attn.cute import flash_attn_func
except Exception as e:  # noqa
    flash_attn_func = None
    print("no FA4:", e)


def timeit(fn, inner=20, samples=7):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    host_ms = (time.perf_counter() - t0) / 3 * 1e3  # the host's enqueue time per call
    torch.cuda.synchronize()
    lead = int((1.0 + 1.5 * inner * host_ms) * 2.0e6)  # GPU sleep cycles covering the sample's enqueue
    out = []
    for _ in range(samples):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(lead)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / inner)
    return statistics.median(out), out


rows = []
for ctx, ql in shapes:
    g = torch.Generator("cuda").manual_seed(ctx + ql)
    pages = math.ceil(ctx / P)
    cache = PagedKVCache(1, hkv, d, P, num_host_pages=pages + 1, num_hbm_pages=pages + 1, dtype=dt, device="cuda")
    sid = cache.add_sequence()
    k = torch.randn(ctx, 1, hkv, d, generator=g, device="cuda").to(dt)
    v = torch.randn(ctx, 1, hkv, d, generator=g, device="cuda").to(dt)
    cache.append(sid, k, v)
    cache.set_hbm_fraction(sid, 1.0, "strided")
    tables = cache.kernel_tables([sid])
    q = torch.randn(ql, hq, d, generator=g, device="cuda").to(dt)
    pairs = ql * (ctx - ql) + ql * (ql + 1) / 2
    flops = 4 * d * hq * pairs
    res = {"context": ctx, "q_len": ql, "tflop": flops / 1e12}
    ref = None
    if flash_attn_func is not None:
        kd, vd = k[:, 0].unsqueeze(0).contiguous(), v[:, 0].unsqueeze(0).contiguous()
        q4 = q.unsqueeze(0)
        fa = lambda: flash_attn_func(q4, kd, vd, causal=True)
        o = fa()
        ref = (o[0] if isinstance(o, tuple) else o)[0].float()
        ms, s = timeit(fa)
        res["fa4"] = ms
    for c in cfgs:
        name = json.dumps({k2: v2 for k2, v2 in c.to_dict().items() if v2 != getattr(QTiledConfig(), k2)}) or "{}"
        call = lambda: paged_attention_tables(q, cache, 0, tables, [ql], config=c, max_seq_len=ctx)
        try:
            o = call().float()
            err = ((o - ref).norm() / ref.norm()).item() if ref is not None else float("nan")
            ms, s = timeit(call)
            res[name] = ms
            res[name + ":err"] = err
        except Exception as e:  # noqa
            res[name] = None
            res[name + ":error"] = f"{type(e).__name__}: {str(e)[:200]}"
    rows.append(res)
    cache.close()
    del k, v, q
    torch.cuda.empty_cache()
    line = f"{ctx // 1024}k q{ql}: " + "  ".join(
        f"{kk}={vv:.3f}ms({res['tflop'] / vv * 1e3:.0f}TF)" if isinstance(vv, float) and not kk.endswith("err") and kk not in ("tflop",) else ""
        for kk, vv in res.items() if kk not in ("context", "q_len", "tflop"))
    print(" ".join(line.split()), flush=True)
    errs = {kk: vv for kk, vv in res.items() if kk.endswith(":err") or kk.endswith(":error")}
    print("   ", errs, flush=True)
if len(sys.argv) > 3:
    json.dump(rows, open(sys.argv[3], "w"), indent=1)
