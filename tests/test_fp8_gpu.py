"""GPU tests of attention over FP8 KV pages against an independent float64 reference.

Every case builds a cache of FP8 pages (e4m3 or e5m2, per-token scales), appends fresh random
bf16/fp16 K/V from GPU tensors (quantized as they are stored into pinned host pages), moves some
pages to HBM where asked, poisons the output with NaN and runs the op: the streaming FP8 kernel
for decode-sized calls, the dequantize-then-attend path for multi-token ones. The reference is
float64 attention (``dense_attention_ref``) over what the pages hold, the K/V quantized and
dequantized by the format's definition (``fp8.quantize`` / ``fp8.dequantize`` of the original
rows), so the tolerance is the 16-bit kernels' own, not the format's.
"""

from __future__ import annotations

import math

import pytest
import torch

from directkv_cute import DecodeConfig, fp8
from directkv_cute.cache import PagedKVCache
from directkv_cute.config import QTiledConfig
from directkv_cute.ops import paged_attention, paged_attention_tables
from directkv_cute.planner import StagingRequest
from directkv_cute.reference import dense_attention_ref

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _build(lens, hkv, d, page_size, dtype, kv_dtype, hbm_fraction=0.0, layers=2, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = sum(math.ceil(n / page_size) for n in lens)
    cache = PagedKVCache(layers, hkv, d, page_size, num_host_pages=pages + 2, num_hbm_pages=pages + 2,
                         dtype=kv_dtype, compute_dtype=dtype, device="cuda")
    layer = layers - 1
    ids, ks, vs = [], [], []
    for n in lens:
        sid = cache.add_sequence()
        k = (torch.randn(n, layers, hkv, d, generator=g, device="cuda") * 3).to(dtype)
        v = torch.randn(n, layers, hkv, d, generator=g, device="cuda").to(dtype)
        cache.append(sid, k, v)
        if hbm_fraction:
            cache.set_hbm_fraction(sid, hbm_fraction, "strided")
        ids.append(sid)
        # What the pages hold: each row quantized with its own scale, read back in the q dtype.
        ks.append(fp8.dequantize(*fp8.quantize(k[:, layer], kv_dtype), dtype))
        vs.append(fp8.dequantize(*fp8.quantize(v[:, layer], kv_dtype), dtype))
    return cache, ids, ks, vs, layer


def _run(lens, q_lens, hq, hkv, d, page_size, dtype, kv_dtype, hbm_fraction=0.0, config=None, seed=0, staging=None):
    cache, ids, ks, vs, layer = _build(lens, hkv, d, page_size, dtype, kv_dtype, hbm_fraction, seed=seed)
    total = sum(q_lens) if q_lens else len(lens)
    q = torch.randn(total, hq, d, device="cuda", generator=torch.Generator("cuda").manual_seed(seed + 1)).to(dtype)
    out = torch.full_like(q, float("nan"))
    o, lse = paged_attention(q, cache, layer, ids, q_lens, config=config, staging=staging, out=out, return_lse=True)
    torch.cuda.synchronize()
    assert o.data_ptr() == out.data_ptr()
    ref_o, ref_lse = dense_attention_ref(q, ks, vs, q_lens, None)
    assert not torch.isnan(out).any(), "NaN in the output (unwritten rows?)"
    err = ((out.double() - ref_o).norm() / ref_o.norm()).item()
    assert err < TOL[dtype], f"relative error {err:.3e}"
    assert torch.allclose(lse.double(), ref_lse, atol=2e-3, rtol=1e-4), (lse.double() - ref_lse).abs().max()
    cache.close()


CASES = [
    # lens, q_lens, hq, hkv, d, page, dtype, kv dtype, hbm fraction, config
    ([1000, 37, 4101, 129], None, 32, 8, 128, 64, torch.bfloat16, E4M3, 0.0, None),
    ([1000, 37, 4101, 129], None, 32, 8, 128, 16, torch.float16, E4M3, 0.5, None),
    ([70000], None, 64, 8, 128, 64, torch.bfloat16, E4M3, 0.0, None),
    ([513], None, 8, 8, 64, 32, torch.bfloat16, E5M2, 0.25, None),
    ([513, 2], None, 8, 8, 64, 128, torch.float16, E4M3, 1.0, None),
    ([5] * 64, None, 32, 8, 128, 16, torch.bfloat16, E4M3, 0.0, None),
    ([3000, 1, 17], None, 16, 4, 128, 64, torch.bfloat16, E5M2, 0.0, DecodeConfig(tile_n=128, stages=3, carveout=100)),
    ([2049, 300], None, 32, 8, 128, 64, torch.bfloat16, E4M3, 0.5,
     DecodeConfig(tile_n=64, stages=9, num_splits=7, carveout=100)),
    ([2049, 300], None, 32, 8, 128, 64, torch.bfloat16, E4M3, 0.0,
     DecodeConfig(tile_n=32, stages=6, max_inflight=1, link_credits=8)),
    ([999], None, 40, 8, 128, 16, torch.bfloat16, E4M3, 0.0, None),  # group 5
    # Short windows through the streaming kernel (group x q_len <= 128 rows), ragged.
    ([4000, 90], [16, 3], 32, 8, 128, 64, torch.bfloat16, E4M3, 0.0, None),
    ([777], [32], 16, 4, 64, 16, torch.float16, E4M3, 0.5, None),
    # Multi-token: the pages dequantized once into HBM, then the 16-bit kernels.
    ([8192, 3000], [512, 77], 32, 8, 128, 64, torch.bfloat16, E4M3, 0.0, None),
    ([2500], [2500], 32, 8, 128, 16, torch.float16, E5M2, 0.25, None),
]


@pytest.mark.parametrize("lens, q_lens, hq, hkv, d, page, dtype, kv_dtype, frac, config", CASES)
def test_attention_over_fp8_pages(lens, q_lens, hq, hkv, d, page, dtype, kv_dtype, frac, config):
    _run(lens, q_lens, hq, hkv, d, page, dtype, kv_dtype, frac, config)


def test_shared_pages_are_dequantized_once_and_read_by_every_sharer():
    """Forked sequences share FP8 pages: a multi-token batch over them (one buffer page per
    distinct page) and a decode batch agree with the reference."""
    dtype, hkv, d, P = torch.bfloat16, 8, 128, 64
    cache = PagedKVCache(1, hkv, d, P, num_host_pages=200, num_hbm_pages=0, dtype=E4M3, compute_dtype=dtype,
                         device="cuda")
    g = torch.Generator(device="cuda").manual_seed(3)
    root = cache.add_sequence()
    k0 = torch.randn(3000, 1, hkv, d, generator=g, device="cuda").to(dtype)
    v0 = torch.randn(3000, 1, hkv, d, generator=g, device="cuda").to(dtype)
    cache.append(root, k0, v0)
    ids, ks, vs = [], [], []
    for n in (100, 1, 700):
        sid = cache.fork(root)
        k1 = torch.randn(n, 1, hkv, d, generator=g, device="cuda").to(dtype)
        v1 = torch.randn(n, 1, hkv, d, generator=g, device="cuda").to(dtype)
        cache.append(sid, k1, v1)
        ids.append(sid)
        ks.append(fp8.dequantize(*fp8.quantize(torch.cat([k0, k1])[:, 0], E4M3), dtype))
        vs.append(fp8.dequantize(*fp8.quantize(torch.cat([v0, v1])[:, 0], E4M3), dtype))
    for q_lens in (None, [64, 1, 300]):
        total = sum(q_lens) if q_lens else len(ids)
        q = torch.randn(total, 32, d, generator=g, device="cuda").to(dtype)
        o = paged_attention(q, cache, 0, ids, q_lens)
        ref, _ = dense_attention_ref(q, ks, vs, q_lens, None)
        err = ((o.double() - ref).norm() / ref.norm()).item()
        assert err < TOL[dtype], (q_lens, err)
    cache.close()


def test_fp8_decode_is_capturable_and_replays_what_it_computes():
    cache, ids, ks, vs, layer = _build([3000, 50], 8, 128, 64, torch.bfloat16, E4M3)
    q = torch.randn(2, 32, 128, device="cuda").to(torch.bfloat16)
    tables = cache.kernel_tables(ids)
    out = torch.empty_like(q)
    paged_attention_tables(q, cache, layer, tables, out=out)  # compiles, allocates counters
    ref, _ = dense_attention_ref(q, ks, vs, None, None)
    _captured_call_matches(q, cache, layer, tables, out, ref)
    cache.close()


def _captured_call_matches(q, cache, layer, tables, out, ref):
    """A CUDA graph capture of the call, replayed into a poisoned ``out``, matches ``ref``."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention_tables(q, cache, layer, tables, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert ((out.double() - ref).norm() / ref.norm()).item() < TOL[q.dtype]


def test_fp8_decode_reads_half_the_bytes_of_bf16_pages():
    """The cache's page bytes (what the kernel reads per page) are the FP8 rows and scales."""
    c8 = PagedKVCache(2, 8, 128, 64, 4, 0, dtype=E4M3, compute_dtype=torch.bfloat16, device="cuda")
    c16 = PagedKVCache(2, 8, 128, 64, 4, 0, dtype=torch.bfloat16, device="cuda")
    assert c8.page_bytes / c16.page_bytes == pytest.approx((128 + 4) / 256)
    c8.close()
    c16.close()


def test_long_fp8_decode_is_staged_and_still_capturable(monkeypatch):
    """Decode over 70k tokens of FP8 host pages: the op copies the pages and their scales into HBM
    with the copy engine, then the FP8 kernel reads them there (``Stager.stage_fp8`` runs), and
    matches the reference; a CUDA graph capture of the same call reads in place and matches too."""
    from directkv_cute import staging

    staged = []
    real = staging.Stager.stage_fp8
    monkeypatch.setattr(staging.Stager, "stage_fp8", lambda *a, **k: staged.append(1) or real(*a, **k))
    dtype = torch.bfloat16
    cache, ids, ks, vs, layer = _build([40000, 30000], 8, 128, 64, dtype, E4M3)
    tables = cache.kernel_tables(ids)
    q = torch.randn(2, 32, 128, device="cuda").to(dtype)
    ref, _ = dense_attention_ref(q, ks, vs, None, None)
    out = torch.full_like(q, float("nan"))
    paged_attention_tables(q, cache, layer, tables, out=out)
    torch.cuda.synchronize()
    assert staged, "not staged"
    assert ((out.double() - ref).norm() / ref.norm()).item() < TOL[dtype]
    _captured_call_matches(q, cache, layer, tables, out, ref)
    cache.close()


@pytest.mark.parametrize("dtype,kv_dtype,page", [(torch.bfloat16, E4M3, 64), (torch.float16, E5M2, 16)])
def test_two_piece_staged_fp8_decode_over_ragged_sequences(dtype, kv_dtype, page):
    """Decode over long ragged FP8 host sequences (one of a single page, one that ends inside the
    first piece, one that ends exactly on the split): planned as staged in two pieces and two
    launches whose partials are combined; matches the reference over what the pages hold,
    poisoned output."""
    from directkv_cute import DirectKVAttention, stage_plan

    longest = 36000
    pp = math.ceil(math.ceil(longest / page) * (1 - stage_plan.FP8_TAIL_SHARE))
    lens = [longest, 1, 20001, pp * page, 33333]
    cache, ids, ks, vs, layer = _build(lens, 4, 128, page, dtype, kv_dtype, seed=5)
    q = torch.randn(len(lens), 16, 128, device="cuda", generator=torch.Generator("cuda").manual_seed(6)).to(dtype)
    out = torch.full_like(q, float("nan"))
    attn = DirectKVAttention(cache)
    plan = attn.plan(tables=cache.kernel_tables(ids), num_q_heads=16, return_lse=True)
    o, lse = attn.run(q, layer, out=out)
    torch.cuda.synchronize()
    assert plan.route == "decode_fp8_two_piece", plan.explain()
    assert len(plan.detail.parts) == 2 and len(plan.staging.pieces) == 2 and plan.staging.piece_pages == pp, \
        plan.explain()
    ref, ref_lse = dense_attention_ref(q, ks, vs, None, None)
    assert not torch.isnan(out).any()
    assert ((out.double() - ref).norm() / ref.norm()).item() < TOL[dtype]
    assert torch.allclose(lse.double(), ref_lse, atol=2e-3, rtol=1e-4), (lse.double() - ref_lse).abs().max()
    cache.close()


@pytest.mark.parametrize("lens, q_lens, hq, hkv, page, dtype, kv_dtype, frac, config, staging", [
    # ragged, one sequence with fewer queries than a query tile, pages partly in HBM
    ([12000, 700, 5000], [2048, 700, 1], 32, 8, 64, torch.bfloat16, E4M3, 0.3, None, None),
    # GQA 8, page 16, fp16 / e5m2, one long chunk
    ([9000], [4096], 64, 8, 16, torch.float16, E5M2, 0.0, None, None),
    # an explicit config: no clusters, 64-key tiles, lightest query tiles first
    ([3000, 6000], [1500, 1000], 16, 4, 64, torch.bfloat16, E4M3, 0.0,
     QTiledConfig(tile_n=64, stages=4, cluster=1), StagingRequest(order=2)),
])
def test_fp8_chunks_run_head_by_head(monkeypatch, lens, q_lens, hq, hkv, page, dtype, kv_dtype, frac, config,
                                     staging):
    """Multi-token calls over FP8 pages that fill a wave run one Q-tiled launch per group of KV
    heads (``stage_plan.fp8_head_groups``), each after its group's copy and dequantization, on several
    streams: every head's rows match the reference (poisoned output, LSE checked), and each KV
    head is launched exactly once, in the groups the copy lands."""
    from directkv_cute import stage_plan
    from directkv_cute.kernels import launch as L
    from directkv_cute.tuning.lookup import machine_for

    heads = []
    real = L.launch_q_tiled
    monkeypatch.setattr(L, "launch_q_tiled", lambda *a, **k: heads.append(k["heads"]) or real(*a, **k))
    _run(lens, q_lens, hq, hkv, 128, page, dtype, kv_dtype, frac, config, seed=11, staging=staging)
    m = machine_for(torch.cuda.get_device_name())
    assert heads == stage_plan.fp8_head_groups(m, hkv, page, 128, 1, lens, q_lens, hq), heads


@pytest.mark.parametrize("kv_dtype,dtype,d,page", [(E4M3, torch.bfloat16, 128, 64), (E5M2, torch.float16, 64, 16)])
def test_dequant_kernel_matches_the_definition_bit_for_bit(kv_dtype, dtype, d, page):
    """kernels/dequant.py over a staged buffer of FP8 pages equals ``fp8.dequantize`` (float32
    product, one rounding) bit for bit, for all heads and for a range of heads, which leaves the
    other heads' rows untouched (poisoned)."""
    from directkv_cute.kernels.jit import compile_dequant
    from directkv_cute.kernels.launch import launch_dequant

    pages, hkv = 37, 4
    g = torch.Generator(device="cuda").manual_seed(21)
    x = torch.randn(pages, 1, hkv, 2, page, d, generator=g, device="cuda")
    x = x * torch.exp(3 * torch.randn(pages, 1, hkv, 2, page, 1, generator=g, device="cuda"))
    raw, scales = fp8.quantize(x, kv_dtype)
    want = fp8.dequantize(raw, scales, dtype)
    fn = compile_dequant(kv_dtype, dtype, d, page)
    out = torch.full(raw.shape, float("nan"), dtype=dtype, device="cuda")
    launch_dequant(fn, raw, scales, out)
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    out = torch.full(raw.shape, float("nan"), dtype=dtype, device="cuda")
    launch_dequant(fn, raw, scales, out, range(1, 3))
    torch.cuda.synchronize()
    assert torch.equal(out[:, :, 1:3], want[:, :, 1:3])
    assert out[:, :, 0].isnan().all() and out[:, :, 3].isnan().all()
    with pytest.raises(ValueError, match="heads"):
        launch_dequant(fn, raw, scales, out, range(3, 5))
