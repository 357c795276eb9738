"""Compute efficiency of the Q-tiled kernel against FlashAttention-4, same run: each shape's KV
all in HBM pages (ours) and dense in HBM (``fa4[hbm]``, as ``bench.peers`` calls it), bf16,
Hq/Hkv 32/8, d 128, page 64, batch 1, causal; every config of ours timed as the benches time
(``bench.common.time_calls``), checked against FA4's output, with TFLOP/s.

usage: python -m bench.compute_ab SHAPES CONFIGS_JSON [--out-dir DIR]
  SHAPES: CONTEXTxQ_LEN,... e.g. 8192x512,32768x8192; CONFIGS_JSON: a list of QTiledConfig dicts.
Writes <out-dir>/<gpu>-<date>-compute-ab.json (default ./bench-results). A kernel-source A/B runs
this twice in one command, once per copy of the package (with an --out-dir each). It needs a CUDA
GPU (no CPU run).
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from bench import peers
from bench.common import (Timer, add_out_dir_argument, checked_out_dir, env_info, exit_status, require_gpu,
                          results_path, time_calls, write_json)
from bench.hostmem import PinnedBuffer
from bench.methods import rel_error
from directkv_cute.cache import PagedKVCache
from directkv_cute.config import QTiledConfig
from directkv_cute.ops import paged_attention_tables
from directkv_cute.plan import causal_flops

HQ, HKV, HEAD_DIM, PAGE, DTYPE = 32, 8, 128, 64, torch.bfloat16


def config_name(cfg: QTiledConfig) -> str:
    """The fields that differ from the default, as JSON ("{}" for the default)."""
    default = QTiledConfig()
    return json.dumps({k: v for k, v in cfg.to_dict().items() if v != getattr(default, k)})


def run_shape(context: int, q_len: int, cfgs, timer: Timer) -> dict:
    """ms (and the error against FA4's output) of FA4 and of each config on one shape."""
    g = torch.Generator("cuda").manual_seed(context + q_len)
    pages = math.ceil(context / PAGE)
    cache = PagedKVCache(1, HKV, HEAD_DIM, PAGE, num_host_pages=pages + 1, num_hbm_pages=pages + 1, dtype=DTYPE,
                         device="cuda")
    try:
        sid = cache.add_sequence()
        kv = torch.randn(2, 1, HKV, context, HEAD_DIM, generator=g, device="cuda").to(DTYPE)  # (2, B, Hkv, S, d)
        cache.append(sid, *(kv[i, 0].transpose(0, 1).unsqueeze(1).contiguous() for i in (0, 1)))  # (S, 1, Hkv, d)
        cache.set_hbm_fraction(sid, 1.0, "strided")
        tables = cache.kernel_tables([sid])
        q = torch.randn(q_len, HQ, HEAD_DIM, generator=g, device="cuda").to(DTYPE)
        res = {"context": context, "q_len": q_len,
               "tflop": causal_flops([context], [q_len], HQ, HEAD_DIM) / 1e12}
        ref = None
        if peers.unavailable("cuda") is None:
            fa = peers.hbm_call(q, peers.fa4_layout(kv, PAGE, PinnedBuffer, False, q_len), 1, q_len)
            ref = fa().float()
            res["fa4"] = time_calls([fa], timer).ms
        for cfg in cfgs:
            name = config_name(cfg)
            call = lambda cfg=cfg: paged_attention_tables(q, cache, 0, tables, [q_len], config=cfg,  # noqa: E731
                                                          max_seq_len=context)
            try:
                out = call().float()
                res[name + ":err"] = rel_error(out, ref) if ref is not None else float("nan")
                res[name] = time_calls([call], timer).ms
            except Exception as e:  # noqa: BLE001 - a config that cannot run is listed with its error
                res[name] = None
                res[name + ":error"] = f"{type(e).__name__}: {str(e)[:200]}"
        return res
    finally:
        cache.close()
        torch.cuda.empty_cache()


def _shapes(text: str) -> list[tuple[int, int]]:
    try:
        return [tuple(int(v) for v in s.split("x", 1)) for s in text.split(",") if s]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected CONTEXTxQ_LEN,..., got {text!r}") from None


def _configs(text: str) -> list[QTiledConfig]:
    try:
        return [QTiledConfig.from_dict(d) for d in json.loads(text)]
    except (ValueError, TypeError, AttributeError) as e:
        raise argparse.ArgumentTypeError(f"expected a JSON list of QTiledConfig dicts: {e}") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.compute_ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shapes", type=_shapes, help="CONTEXTxQ_LEN,..., e.g. 8192x512,32768x8192")
    p.add_argument("configs", type=_configs, help='a JSON list of QTiledConfig dicts, e.g. \'[{}, {"cluster": 1}]\'')
    add_out_dir_argument(p, "the JSON")
    return p


def main(argv=None) -> int:
    ns = parser().parse_args(argv)
    require_gpu(command="python -m bench.compute_ab", cpu_run=False)
    out = results_path(checked_out_dir(ns.out_dir), env_info("cuda"), "compute-ab")
    shapes, cfgs = ns.shapes, ns.configs
    why = peers.unavailable("cuda")
    if why is not None:
        print("no FA4:", why)
    timer, rows = Timer("cuda"), []
    for context, q_len in shapes:
        res = run_shape(context, q_len, cfgs, timer)
        rows.append(res)
        timed = [f"{k}={v:.3f}ms({res['tflop'] / v * 1e3:.0f}TF)" for k, v in res.items()
                 if isinstance(v, float) and k not in ("tflop",) and ":" not in k]
        print(f"{context // 1024}k q{q_len}: " + " ".join(timed), flush=True)
        print("   ", {k: v for k, v in res.items() if ":" in k}, flush=True)
    write_json(out, {"bench": "compute-ab", "rows": rows})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
