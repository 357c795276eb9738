"""``python -m bench fp8-accuracy``: how much accuracy FP8 KV pages cost, and which scale wins.

1. Op level: the attention output over K/V stored as bf16 pages and as FP8 pages with each scale
   granularity (``directkv_cute.fp8``), against a float64 reference over the unrounded K/V;
   random inputs and heavy-tailed ones (a few K channels 20-100x larger, as real models have), at
   several contexts, GQA 4 (Hq 8 / Hkv 2), head_dim 128. Errors: max|out - ref| / max|ref| and
   RMS(out - ref) / RMS(ref). The attention itself runs in float64 on the dequantized values, so
   the numbers are the storage's alone; the "cache" row runs the real ``PagedKVCache`` with FP8
   pages through ``paged_attention`` (the CPU reference path) as a check of the simulation.
   Granularities: ``token`` (per token per KV head per K/V), ``page`` (per page per layer per KV
   head per K/V over the full page: the best a page scale can do, i.e. with requantization as the
   page fills), ``page-first`` (a page scale fixed by its first token: what a page costs without
   requantizing; later larger tokens clamp), ``tensor`` (one scale calibrated on the first 256
   tokens), and e5m2 with token scales.
2. End to end: a random-weight small Llama (4 layers, Hq 8 / Hkv 2, head_dim 128, bf16) on
   ``DirectKVCache`` with bf16 KV and with FP8 KV: a greedy run of >= 200 steps with bf16 KV,
   then the FP8 run fed the same tokens (teacher forcing, so every step compares the same
   context): the agreement of the greedy (argmax) tokens, the max and median relative logit error
   (|logits - logits_bf16|_inf / |logits_bf16|_inf per step), and the free-running greedy
   agreement (the steps until the FP8 run's own greedy tokens first differ).

Result (``python -m bench fp8-accuracy``; the run docs/FP8.md quotes: ``git show
7747519:bench/results/cpu-2026-12-01-s13-fp8-accuracy.txt``): token scales win. On random inputs
token, full-page and calibrated tensor scales are alike (RMS ~3.7e-2 vs 2.4e-3 for bf16); on
heavy-tailed K token scales are ~2x better than full-page scales (which would need requantizing
as a page fills) and 2-4x better than a tensor scale, because each row's largest element (the
outlier channel) is stored exactly; page scales fixed at the first write clamp (error > 1). End
to end, FP8 KV keeps all 200 greedy tokens of the bf16 run. docs/FP8.md has the table.

It runs on the CPU by design (the errors are the storage's, not a kernel's), so it needs no GPU
and takes no ``--device``. Files: ``<out-dir>/cpu-fp8-accuracy.json`` and ``.txt`` (``--out-dir``,
default ./bench-results; ``--name`` renames them).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from bench.common import add_out_dir_argument
from directkv_cute import fp8
from directkv_cute.reference import dense_attention_ref

NAME = "cpu-fp8-accuracy"
HQ, HKV, D, PAGE = 8, 2, 128, 64
CALIBRATION_TOKENS = 256


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contexts", default="1024,8192", help="comma-separated contexts (default 1024,8192)")
    p.add_argument("--q-len", type=int, default=16, help="query rows per call (default 16)")
    p.add_argument("--trials", type=int, default=3, help="random draws per row; the table shows their mean")
    p.add_argument("--steps", type=int, default=200, help="greedy steps end to end (default 200)")
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens end to end (default 256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-e2e", action="store_true", help="op level only")
    add_out_dir_argument(p, "the JSON and the report")
    p.add_argument("--name", default=NAME, help=f"file name without extension (default {NAME})")


# ---- op level --------------------------------------------------------------------------------
def make_kv(n: int, kind: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V float32 (n, Hkv, d): standard normal, or with heavy-tailed K channels (4 channels per
    KV head scaled by 20, 40, 70, 100, plus a per-token jitter of those channels)."""
    k = torch.randn(n, HKV, D, generator=gen)
    v = torch.randn(n, HKV, D, generator=gen)
    if kind == "heavy":
        for h in range(HKV):
            chans = torch.randperm(D, generator=gen)[:4]
            for c, f in zip(chans.tolist(), (20.0, 40.0, 70.0, 100.0)):
                k[:, h, c] = k[:, h, c] * f + f * 0.5
    return k, v


def store(x: torch.Tensor, how: str) -> torch.Tensor:
    """x (n, Hkv, d) float32 as the pages would hold it, read back as float64."""
    if how == "bf16":
        return x.to(torch.bfloat16).double()
    dtype = torch.float8_e5m2 if how == "e5m2-token" else torch.float8_e4m3fn
    if how in ("token", "e5m2-token"):
        q, s = fp8.quantize(x, dtype, dims=-1)
        return fp8.dequantize(q, s, torch.float64, dims=-1)
    if how in ("page", "page-first"):
        n = x.shape[0]
        out = torch.empty(n, *x.shape[1:], dtype=torch.float64)
        for p0 in range(0, n, PAGE):
            piece = x[p0 : p0 + PAGE]  # (rows, Hkv, d)
            amax = piece.abs().amax(dim=(0, 2)) if how == "page" else piece[0].abs().amax(dim=-1)  # (Hkv,)
            scale = fp8.scale_from_amax(amax, dtype).expand(piece.shape[0], -1)
            q, s = fp8.quantize(piece, dtype, dims=-1, scale=scale)
            out[p0 : p0 + PAGE] = fp8.dequantize(q, s, torch.float64, dims=-1)
        return out
    if how == "tensor":
        amax = x[:CALIBRATION_TOKENS].abs().amax()
        q, s = fp8.quantize(x, dtype, dims=(0, 1, 2), scale=fp8.scale_from_amax(amax, dtype))
        return fp8.dequantize(q, s, torch.float64, dims=(0, 1, 2))
    raise ValueError(how)


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    diff = (out.double() - ref).abs()
    return (float(diff.max() / ref.abs().max()),
            float(diff.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()))


def cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_len: int) -> torch.Tensor:
    """The op over a real FP8 PagedKVCache (CPU reference path): K/V appended as bf16."""
    from directkv_cute.cache import PagedKVCache
    from directkv_cute.ops import paged_attention

    n = k.shape[0]
    cache = PagedKVCache(1, HKV, D, PAGE, num_host_pages=-(-n // PAGE) + 1, dtype=torch.float8_e4m3fn,
                         device="cpu")
    sid = cache.add_sequence()
    cache.append(sid, k.to(torch.bfloat16)[:, None], v.to(torch.bfloat16)[:, None])
    return paged_attention(q, cache, 0, [sid], q_lens=[q_len])


HOWS = ("bf16", "token", "page", "page-first", "tensor", "e5m2-token")


def op_level(contexts, q_len: int, seed: int, trials: int = 3) -> list[dict]:
    rows = []
    for kind in ("random", "heavy"):
        for n in contexts:
            acc: dict[str, list] = {}
            for t in range(trials):
                gen = torch.Generator().manual_seed(seed + 1000 * t + n)
                k, v = make_kv(n, kind, gen)
                q = torch.randn(q_len, HQ, D, generator=gen).to(torch.bfloat16)
                ref, _ = dense_attention_ref(q.double(), [k.double()], [v.double()], [q_len], None)
                for how in HOWS:
                    out, _ = dense_attention_ref(q.double(), [store(k, how)], [store(v, how)], [q_len], None)
                    acc.setdefault(how, []).append(errors(out, ref))
                acc.setdefault("cache (token, bf16 out)", []).append(errors(cache_attention(q, k, v, q_len), ref))
            for how, errs in acc.items():
                rows.append(dict(inputs=kind, context=n, pages=how, trials=trials,
                                 max_rel=sum(e[0] for e in errs) / trials, rms_rel=sum(e[1] for e in errs) / trials,
                                 max_rel_worst=max(e[0] for e in errs)))
    return rows


# ---- end to end ------------------------------------------------------------------------------
def _model(seed: int):
    from directkv_cute.presets import build_random_model, preset_config

    config = preset_config("tiny", num_hidden_layers=4, hidden_size=512, num_attention_heads=HQ,
                           num_key_value_heads=HKV, head_dim=D, intermediate_size=1024, vocab_size=2048)
    return build_random_model(config, torch.bfloat16, "cpu", seed=seed, attn_implementation="directkv")


def _run(model, prompt: torch.Tensor, steps: int, kv_dtype, forced: torch.Tensor | None):
    """(tokens (steps,), logits float32 (steps, vocab)): greedy, or fed ``forced`` tokens."""
    import directkv_cute.hf as dkhf

    cache = dkhf.DirectKVCache(model, max_tokens=prompt.shape[1] + steps + 1, page_size=PAGE, device="cpu",
                               kv_dtype=kv_dtype)
    toks, logits = [], []
    ids = prompt
    with torch.no_grad():
        for i in range(steps):
            out = model(input_ids=ids, use_cache=True, **dkhf.cache_kwargs(model, cache))
            lg = out.logits[0, -1].float()
            logits.append(lg)
            toks.append(int(lg.argmax()))
            nxt = toks[-1] if forced is None else int(forced[i])
            ids = torch.tensor([[nxt]])
    cache.close()
    return torch.tensor(toks), torch.stack(logits)


def end_to_end(steps: int, prompt_len: int, seed: int) -> dict:
    model = _model(seed)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=gen)
    t0 = time.perf_counter()
    ref_tok, ref_logits = _run(model, prompt, steps, None, None)
    out = {"model": "random-weight Llama: 4 layers, hidden 512, Hq 8 / Hkv 2, head_dim 128, bf16",
           "prompt": prompt_len, "steps": steps, "kv": {}}
    for name, kv in (("fp8-e4m3", "fp8"), ("fp8-e5m2", "e5m2")):
        tok, logits = _run(model, prompt, steps, kv, ref_tok)
        free_tok, _ = _run(model, prompt, steps, kv, None)
        rel = (logits - ref_logits).abs().amax(dim=-1) / ref_logits.abs().amax(dim=-1)
        diverged = (free_tok != ref_tok).nonzero()
        out["kv"][name] = dict(
            token_agreement=float((tok == ref_tok).float().mean()),
            logit_rel_max=float(rel.max()), logit_rel_median=float(rel.median()),
            free_running_equal_steps=int(diverged[0]) if len(diverged) else steps)
    out["seconds"] = time.perf_counter() - t0
    return out


# ---- report ----------------------------------------------------------------------------------
def format_report(doc: dict) -> str:
    lines = [f"FP8 KV accuracy (op: GQA {HQ}/{HKV}, head_dim {D}, page {PAGE}, q_len {doc['args']['q_len']}; "
             f"errors vs float64 over the unrounded K/V, mean of {doc['args']['trials']} draws)", "",
             f"{'inputs':<8} {'context':>7}  {'pages':<24} {'max|err|/max|ref|':>18} {'(worst)':>10} "
             f"{'rms err/rms ref':>16}"]
    for r in doc["op"]:
        lines.append(f"{r['inputs']:<8} {r['context']:>7}  {r['pages']:<24} {r['max_rel']:>18.3e} "
                     f"{r['max_rel_worst']:>10.3e} {r['rms_rel']:>16.3e}")
    lines += ["", "bytes per token per KV head per K/V (head_dim 128, page 64):"]
    for k, b in doc["bytes"].items():
        lines.append(f"  {k:<8} {b:8.2f} B  ({b / doc['bytes']['bf16']:.3f}x bf16)")
    e2e = doc.get("e2e")
    if e2e:
        lines += ["", f"end to end: {e2e['model']}, prompt {e2e['prompt']}, {e2e['steps']} greedy steps vs bf16 KV "
                      "(teacher-forced on the bf16 run's tokens)",
                  f"  {'kv':<9} {'token agreement':>16} {'logit rel max':>14} {'median':>10} {'free-running equal steps':>25}"]
        for name, r in e2e["kv"].items():
            lines.append(f"  {name:<9} {r['token_agreement']:>16.3f} {r['logit_rel_max']:>14.3e} "
                         f"{r['logit_rel_median']:>10.3e} {r['free_running_equal_steps']:>25}")
    return "\n".join(lines) + "\n"


def cmd_fp8_accuracy(ns: argparse.Namespace) -> int:
    from bench.common import UsageError, checked_out_dir, env_info, write_json

    out = checked_out_dir(ns.out_dir)
    if not ns.name or Path(ns.name).name != ns.name or ns.name in (".", ".."):
        raise UsageError(f"bench fp8-accuracy: --name {ns.name!r} must be a plain file name (no directories)")
    torch.manual_seed(ns.seed)
    contexts = [int(c) for c in str(ns.contexts).split(",") if c]
    doc = {"bench": "fp8-accuracy", "header": env_info("cpu"),
           "args": {"contexts": contexts, "q_len": ns.q_len, "trials": ns.trials, "steps": ns.steps, "prompt": ns.prompt, "seed": ns.seed},
           "granularity": fp8.GRANULARITY,
           "bytes": {"bf16": fp8.bytes_per_row(D, torch.bfloat16),
                     **{g: fp8.bytes_per_row(D, torch.float8_e4m3fn, g, PAGE) for g in fp8.GRANULARITIES}},
           "op": op_level(contexts, ns.q_len, ns.seed, ns.trials)}
    if not ns.no_e2e:
        doc["e2e"] = end_to_end(ns.steps, ns.prompt, ns.seed)
    text = format_report(doc)
    print(text, end="")
    write_json(out / f"{ns.name}.json", doc)
    (out / f"{ns.name}.txt").write_text(text)
    print(f"wrote {out / (ns.name + '.json')} and .txt")
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m bench.fp8_accuracy")
    add_arguments(p)
    from bench.common import exit_status

    sys.exit(exit_status(cmd_fp8_accuracy, p.parse_args()))
