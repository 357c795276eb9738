"""GPU tests of the attention kernels against an independent float64 reference.

Every case builds a fresh cache with fresh random K/V (appended from GPU tensors straight into
pinned host pages), places pages in host memory, HBM or both, poisons the output with NaN, runs
the op, and compares with ``dense_attention_ref`` over the original, unpaged K/V.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from directkv_cute import DecodeConfig
from directkv_cute.cache import PagedKVCache
from directkv_cute.ops import paged_attention, paged_attention_tables
from directkv_cute.reference import dense_attention_ref

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _build(lens, hkv, d, page_size, dtype, hbm_fraction=0.0, placement="strided", layers=2, seed=0):
    """A cache holding one random sequence per length; returns (cache, seq_ids, k_list, v_list, layer)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = sum(math.ceil(n / page_size) for n in lens)
    cache = PagedKVCache(layers, hkv, d, page_size, num_host_pages=pages + 2, num_hbm_pages=pages + 2,
                         dtype=dtype, device="cuda")
    layer = layers - 1
    ids, ks, vs = [], [], []
    for n in lens:
        sid = cache.add_sequence()
        k = torch.randn(n, layers, hkv, d, generator=g, device="cuda").to(dtype)
        v = torch.randn(n, layers, hkv, d, generator=g, device="cuda").to(dtype)
        cache.append(sid, k, v)
        if hbm_fraction:
            cache.set_hbm_fraction(sid, hbm_fraction, placement)
        ids.append(sid)
        ks.append(k[:, layer])
        vs.append(v[:, layer])
    return cache, ids, ks, vs, layer


def _check(out, lse, q, ks, vs, q_lens, dtype):
    ref_o, ref_lse = dense_attention_ref(q, ks, vs, q_lens, None)
    assert not torch.isnan(out).any(), "NaN in the output (unwritten rows?)"
    err = ((out.double() - ref_o).norm() / ref_o.norm()).item()
    assert err < TOL[dtype], f"relative error {err:.3e}"
    assert torch.allclose(lse.double(), ref_lse, atol=1e-3, rtol=1e-4), (lse.double() - ref_lse).abs().max()


def _run(lens, q_lens, hq, hkv, d, page_size, dtype, hbm_fraction=0.0, config=None, seed=0, placement="strided",
         staging=None):
    cache, ids, ks, vs, layer = _build(lens, hkv, d, page_size, dtype, hbm_fraction, placement, seed=seed)
    total = sum(q_lens) if q_lens else len(lens)
    q = torch.randn(total, hq, d, device="cuda", generator=torch.Generator("cuda").manual_seed(seed + 1)).to(dtype)
    out = torch.full_like(q, float("nan"))
    o, lse = paged_attention(q, cache, layer, ids, q_lens, config=config, staging=staging, out=out, return_lse=True)
    torch.cuda.synchronize()
    assert o.data_ptr() == out.data_ptr()
    _check(o, lse, q, ks, vs, q_lens, dtype)
    cache.close()


DECODE_CASES = [
    # lens, hq, hkv, d, page, dtype, hbm_fraction, config
    ([1000, 37, 4101, 129], 32, 8, 128, 16, torch.bfloat16, 0.0, None),
    ([1000, 37, 4101, 129], 32, 8, 128, 64, torch.float16, 0.5, None),
    ([513], 8, 8, 64, 128, torch.bfloat16, 0.25, None),
    ([513], 8, 8, 64, 32, torch.bfloat16, 1.0, None),
    ([70000], 64, 8, 128, 64, torch.bfloat16, 0.0, None),
    ([5] * 64, 32, 8, 128, 16, torch.float16, 0.0, None),
    ([3000, 1, 17], 16, 4, 64, 16, torch.float16, 0.5, DecodeConfig(tile_n=32, stages=6)),
    ([3000, 1, 17], 16, 4, 128, 128, torch.bfloat16, 0.0, DecodeConfig(tile_n=128, stages=2, carveout=100)),
    ([2049, 300], 32, 8, 128, 64, torch.bfloat16, 0.0, DecodeConfig(tile_n=64, stages=3, num_splits=1)),
    ([2049, 300], 32, 8, 128, 64, torch.bfloat16, 0.0, DecodeConfig(tile_n=64, stages=3, num_splits=7)),
    ([2049, 300], 32, 8, 128, 64, torch.bfloat16, 0.5, DecodeConfig(tile_n=64, stages=4, max_inflight=1)),
    ([999], 40, 8, 128, 16, torch.bfloat16, 0.0, None),  # group 5: rows not a power of two
]


@pytest.mark.parametrize("lens,hq,hkv,d,page,dtype,hbm,config", DECODE_CASES)
def test_decode_matches_reference(lens, hq, hkv, d, page, dtype, hbm, config):
    _run(lens, None, hq, hkv, d, page, dtype, hbm, config)


SPEC_CASES = [
    # speculative-decoding windows: the streaming kernel holds group x q_len rows
    ([800, 90], [4, 4], 32, 8, 128, 16, torch.bfloat16, 0.0),
    ([800, 90, 2000], [2, 8, 1], 32, 8, 128, 64, torch.float16, 0.5),
    ([333], [16], 16, 4, 64, 32, torch.bfloat16, 0.0),
]


@pytest.mark.parametrize("lens,q_lens,hq,hkv,d,page,dtype,hbm", SPEC_CASES)
def test_small_q_len_matches_reference(lens, q_lens, hq, hkv, d, page, dtype, hbm):
    _run(lens, q_lens, hq, hkv, d, page, dtype, hbm)


PREFILL_CASES = [
    # chunk at position 0 (no history), chunk longer than its history, ragged lengths, q_len 1
    # mixed with long chunks, host/HBM/mixed pages
    ([700], [700], 32, 8, 128, 64, torch.bfloat16, 0.0),
    ([1300], [1000], 32, 8, 128, 16, torch.bfloat16, 0.5),
    ([5000, 77, 3001], [513, 1, 64], 32, 8, 128, 64, torch.float16, 0.0),
    ([2500, 2500], [1, 2047], 16, 16, 64, 128, torch.bfloat16, 0.25),
    ([4099], [300], 64, 8, 128, 32, torch.bfloat16, 1.0),
]


@pytest.mark.parametrize("lens,q_lens,hq,hkv,d,page,dtype,hbm", PREFILL_CASES)
def test_multi_token_matches_reference(lens, q_lens, hq, hkv, d, page, dtype, hbm):
    _run(lens, q_lens, hq, hkv, d, page, dtype, hbm)


@pytest.mark.parametrize("seed", range(12))
def test_random_shapes(seed):
    """Random draws over the whole supported grid (seeded, so a failure reproduces)."""
    r = random.Random(seed)
    dtype = r.choice([torch.bfloat16, torch.float16])
    hkv = r.choice([1, 2, 8])
    group = r.choice([1, 4, 8])
    d = r.choice([64, 128])
    page = r.choice([16, 32, 64, 128])
    batch = r.choice([1, 3, 9])
    lens = [r.randint(1, 3000) for _ in range(batch)]
    q_lens = [r.randint(1, min(n, r.choice([1, 4, 200]))) for n in lens]
    hbm = r.choice([0.0, 0.3, 1.0])
    tile = r.choice([32, 64, 128])
    cfg = DecodeConfig(tile_n=tile, stages=2, carveout=100) if r.random() < 0.5 else None
    _run(lens, q_lens, hkv * group, hkv, d, page, dtype, hbm, cfg, seed=seed, placement="strided")


@pytest.mark.parametrize("q_lens", [None, [300, 77]])
def test_cuda_graph_replay(q_lens):
    """Captured once after an eager call with the same shapes, replayed with new queries: same
    answers, for decode (one query per sequence) and for the multi-token kernel (ragged q_lens,
    split partials and the combine). New q_lens inside a capture are refused with a clear error."""
    dtype, hq, hkv, d = torch.bfloat16, 32, 8, 128
    cache, ids, ks, vs, layer = _build([3000, 1200], hkv, d, 64, dtype)
    tables = cache.kernel_tables(ids)
    q = torch.randn(sum(q_lens) if q_lens else 2, hq, d, device="cuda").to(dtype)
    out = torch.empty_like(q)
    paged_attention_tables(q, cache, layer, tables, q_lens, out=out, max_seq_len=3000)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, lse = paged_attention_tables(q, cache, layer, tables, q_lens, out=out, max_seq_len=3000, return_lse=True)
    for _ in range(2):
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, lse, q, ks, vs, q_lens, dtype)
    if q_lens:
        with pytest.raises(RuntimeError, match="first seen inside CUDA graph capture"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                paged_attention_tables(q, cache, layer, tables, [299, 78], out=out, max_seq_len=3000)
        torch.cuda.synchronize()
    cache.close()


def test_compiles_once():
    from directkv_cute.kernels import jit

    cache, ids, _, _, layer = _build([100], 8, 128, 16, torch.bfloat16)
    q = torch.randn(1, 8, 128, device="cuda").to(torch.bfloat16)
    cfg = DecodeConfig(tile_n=64, stages=3)
    paged_attention(q, cache, layer, ids, config=cfg)
    n = jit.cache_size()
    for _ in range(3):
        paged_attention(q, cache, layer, ids, config=cfg)
    assert jit.cache_size() == n


def test_bad_inputs_raise_before_launch():
    cache, ids, _, _, layer = _build([100], 8, 128, 16, torch.bfloat16)
    q = torch.randn(1, 8, 128, device="cuda").to(torch.bfloat16)
    with pytest.raises(TypeError):
        paged_attention(q.half(), cache, layer, ids)
    with pytest.raises(ValueError):
        paged_attention(q[:, :, :64].contiguous(), cache, layer, ids)
    with pytest.raises(ValueError):
        paged_attention(torch.randn(1, 12, 128, device="cuda").to(torch.bfloat16), cache, layer, ids)
    with pytest.raises(IndexError):
        paged_attention(q, cache, 7, ids)
    with pytest.raises(ValueError):
        paged_attention(q, cache, layer, ids, q_lens=[2])


@pytest.mark.parametrize(
    "config",
    [
        DecodeConfig(tile_n=64, stages=4, consumer_wgs=1, carveout=100),
        DecodeConfig(tile_n=64, stages=5, consumer_wgs=3, carveout=100),
        DecodeConfig(tile_n=32, stages=8, consumer_wgs=3, carveout=100),
        DecodeConfig(tile_n=128, stages=2, consumer_wgs=2, carveout=100),
        # CTAs walking several chunks (partials merged in place across chunks):
        DecodeConfig(tile_n=64, stages=6, consumer_wgs=2, carveout=100, chunk_tiles=3, num_splits=1),
        DecodeConfig(tile_n=64, stages=2, consumer_wgs=2, carveout=100, chunk_tiles=1, num_splits=3),
        DecodeConfig(tile_n=32, stages=8, consumer_wgs=3, carveout=100, chunk_tiles=3),
        DecodeConfig(tile_n=128, stages=3, consumer_wgs=1, carveout=100, chunk_tiles=1, num_splits=2),
        DecodeConfig(tile_n=64, stages=4, consumer_wgs=2, carveout=100, num_splits=2),  # one-chunk ring, walked
        # a producer limited to 1-2 tiles in flight (streams in order, phases of the full barriers):
        DecodeConfig(tile_n=32, stages=12, consumer_wgs=2, carveout=100, chunk_tiles=6, max_inflight=1),
        DecodeConfig(tile_n=64, stages=6, consumer_wgs=2, carveout=100, chunk_tiles=3, max_inflight=2, num_splits=2),
        # device-wide link admission: one tile in flight on the whole GPU, and a few
        DecodeConfig(tile_n=64, stages=4, consumer_wgs=2, carveout=100, chunk_tiles=2, max_inflight=1, link_credits=1),
        DecodeConfig(tile_n=128, stages=3, consumer_wgs=2, carveout=100, chunk_tiles=2, max_inflight=1, link_credits=6),
        # edge chunks (first and last chunk of one or two tiles), alone and with link admission
        DecodeConfig(tile_n=64, stages=6, consumer_wgs=2, carveout=100, chunk_tiles=5, edge_tiles=1),
        DecodeConfig(tile_n=64, stages=6, consumer_wgs=2, carveout=100, chunk_tiles=3, edge_tiles=2, num_splits=2),
        DecodeConfig(tile_n=32, stages=8, consumer_wgs=3, carveout=100, chunk_tiles=3, edge_tiles=1, max_inflight=1,
                     link_credits=8),
        # Q rows in registers (Q K^T from registers), with the ring it frees and with wide tiles, GQA 4
        DecodeConfig(tile_n=64, stages=7, consumer_wgs=2, carveout=100, chunk_tiles=5, max_inflight=1, link_credits=16,
                     q_regs=1),
        DecodeConfig(tile_n=128, stages=3, consumer_wgs=1, carveout=100, chunk_tiles=1, num_splits=2, q_regs=1),
        DecodeConfig(tile_n=32, stages=8, consumer_wgs=3, carveout=100, chunk_tiles=3, q_regs=1),
        # clusters sharing each tile by multicast and splitting the query rows: the default's ring,
        # an odd split count with Q in SMEM, and four CTAs over wide tiles (8 boxes a tile)
        DecodeConfig(tile_n=64, stages=7, consumer_wgs=2, carveout=100, chunk_tiles=4, max_inflight=1, q_regs=1,
                     q_cluster=2),
        DecodeConfig(tile_n=64, stages=6, consumer_wgs=2, carveout=100, chunk_tiles=3, num_splits=3, q_cluster=2),
        # clusters under link admission: rank 0 admits each tile and signals its peers (one credit
        # on the whole GPU: every tile waits for the previous one to land)
        DecodeConfig(tile_n=64, stages=7, consumer_wgs=2, carveout=100, chunk_tiles=4, max_inflight=1, q_regs=1,
                     q_cluster=2, link_credits=16),
        DecodeConfig(tile_n=64, stages=6, consumer_wgs=2, carveout=100, chunk_tiles=3, max_inflight=1, num_splits=3,
                     q_cluster=4, link_credits=1),
        DecodeConfig(tile_n=128, stages=3, consumer_wgs=1, carveout=100, ctas_per_sm=1, chunk_tiles=1, max_inflight=1,
                     q_cluster=4),
        # staggered chunk boundaries (each block's own passes, tiles freed one at a time): the
        # cluster default with four groups; one split walking many rounds with Q in SMEM (short
        # remainders absorbed); a tight ring (one slot beyond the chunk) under one link credit with
        # three warpgroups; four CTAs over wide tiles
        DecodeConfig(tile_n=64, stages=7, consumer_wgs=2, carveout=100, chunk_tiles=4, max_inflight=1, q_regs=1,
                     q_cluster=2, stagger=4),
        DecodeConfig(tile_n=64, stages=6, consumer_wgs=2, carveout=100, chunk_tiles=3, num_splits=1, stagger=2),
        DecodeConfig(tile_n=32, stages=4, consumer_wgs=3, carveout=100, chunk_tiles=3, max_inflight=1, link_credits=1,
                     stagger=3),
        DecodeConfig(tile_n=128, stages=3, consumer_wgs=1, carveout=100, ctas_per_sm=1, chunk_tiles=2, q_cluster=4,
                     stagger=2),
    ],
)
def test_multi_token_configs(config):
    """The multi-token kernel across warpgroup counts, tiles, chunk sizes and split counts (ragged,
    mixed tiers)."""
    _run([3333, 900], [700, 129], 32, 8, 128, 32, torch.bfloat16, 0.5, config)


@pytest.mark.gpu
@pytest.mark.parametrize("q_cluster,hbm_fraction", [(2, 1.0), (2, 0.0), (4, 0.5)])
def test_cluster_by_tier(q_cluster, hbm_fraction):
    """q_cluster over 64-token pages with every page in one tier, then mixed; four CTAs halve each
    page piece into four boxes. (A hang is the failure to look for: run under `timeout`.)"""
    cfg = DecodeConfig(tile_n=64, stages=7, consumer_wgs=2, carveout=100, ctas_per_sm=1, chunk_tiles=4, max_inflight=1,
                       q_regs=1, q_cluster=q_cluster)
    _run([2048, 777], [64, 300], 32, 8, 128, 64, torch.bfloat16, hbm_fraction, cfg)


def test_torch_library_op_on_gpu():
    """torch.ops.directkv_cute.paged_attention runs the same kernels on the pool tensors."""
    dtype = torch.bfloat16
    cache, ids, ks, vs, layer = _build([2000, 333], 8, 128, 64, dtype, hbm_fraction=0.5)
    t = cache.kernel_tables(ids)
    q = torch.randn(2 + 40, 32, 128, device="cuda").to(dtype)
    o, lse = torch.ops.directkv_cute.paged_attention(q, cache.host_pool_cuda, cache.hbm_pool, t.page_table,
                                                       t.seq_lens, layer, [2, 40])
    _check(o, lse, q, ks, vs, [2, 40], dtype)
    o2, lse2 = torch.ops.directkv_cute.paged_attention(q, cache.host_pool_cuda, cache.hbm_pool, t.page_table,
                                                         t.seq_lens, layer, [2, 40], None, [64, 3, 0, 2, 100, 1])
    _check(o2, lse2, q, ks, vs, [2, 40], dtype)


@pytest.mark.gpu
def test_link_tickets_balance():
    """Every link ticket a launch takes is reported landed, so the device counters agree again
    after each launch; a tile that reads host pages takes exactly one ticket and a tile wholly in
    HBM none (multi-token and decode kernels, several splits)."""
    from directkv_cute.kernels.launch import link_counters

    counters = link_counters(torch.device("cuda"), False)

    def tickets(lens, q_lens, hbm, config):
        torch.cuda.synchronize()
        before = counters.clone()
        _run(lens, q_lens, 32, 8, 128, 64, torch.bfloat16, hbm, config)
        issued, landed = (counters - before).tolist()
        assert issued == landed and counters[0].item() == counters[1].item(), (issued, landed)
        return issued

    walk = DecodeConfig(tile_n=64, stages=4, consumer_wgs=2, carveout=100, chunk_tiles=2, max_inflight=1,
                        link_credits=3)
    tiles = lambda lens: 8 * sum(-(-n // 64) for n in lens)  # noqa: E731  (KV heads x tiles)
    assert tickets([3333, 900], [700, 129], 0.0, walk) == tiles([3333, 900])
    assert tickets([3333, 900], [700, 129], 1.0, walk) == 0
    assert 0 < tickets([3333, 900], [700, 129], 0.5, walk) < tiles([3333, 900])
    decode = DecodeConfig(tile_n=64, stages=4, max_inflight=1, link_credits=2, num_splits=3)
    assert tickets([2049, 300], [1, 1], 0.0, decode) == tiles([2049, 300])
    # clusters: rank 0 takes one ticket per host tile for the whole cluster (its peers none)
    for c in (2, 4):
        cluster = DecodeConfig(tile_n=64, stages=7, consumer_wgs=2, carveout=100, ctas_per_sm=1, chunk_tiles=4,
                               max_inflight=1, q_regs=1, q_cluster=c, link_credits=4)
        assert tickets([3333, 900], [700, 129], 0.0, cluster) == tiles([3333, 900])
        assert 0 < tickets([3333, 900], [700, 129], 0.5, cluster) < tiles([3333, 900])


@pytest.mark.gpu
def test_first_call_inside_graph_capture_is_refused(monkeypatch):
    """The op allocates the device's link counters on its first call; a first call inside a CUDA
    graph capture is refused with a clear error instead of allocating from the graph's pool, and
    an eager call first makes the capture work (decode with link admission, as in
    test_cuda_graph_replay)."""
    from directkv_cute.kernels import launch

    dtype = torch.bfloat16
    cache, ids, ks, vs, layer = _build([3000, 700], 8, 128, 64, dtype)
    tables = cache.kernel_tables(ids)
    q = torch.randn(2, 32, 128, device="cuda").to(dtype)
    out = torch.empty_like(q)
    cfg = DecodeConfig(tile_n=64, stages=4, max_inflight=1, link_credits=2, num_splits=3)
    call = lambda: paged_attention_tables(q, cache, layer, tables, out=out, max_seq_len=3000,  # noqa: E731
                                          config=cfg, return_lse=True)
    call()  # compiles
    torch.cuda.synchronize()
    monkeypatch.setattr(launch, "_LINK_COUNTERS", {})
    with pytest.raises(RuntimeError, match="outside CUDA graph capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            call()
    torch.cuda.synchronize()
    call()  # eager: the counters are ready again
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, lse = call()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _check(out, lse, q, ks, vs, None, dtype)
    cache.close()


@pytest.mark.gpu
@pytest.mark.parametrize("splits,d,dtype", [(1, 128, torch.bfloat16), (5, 64, torch.float16), (8, 128, torch.bfloat16),
                                            (9, 128, torch.float16), (20, 256, torch.bfloat16), (41, 128, torch.bfloat16)])
def test_combine_kernel_matches_logsumexp_merge(splits, d, dtype):
    """The split combine alone, on fresh random partials, against torch's logsumexp merge: split
    counts below, at and past a load group (8), partials with empty splits (LSE -inf, garbage O)
    anywhere among a row's splits, rows with every split empty (O 0, LSE -inf)
    and large LSE offsets between splits."""
    from directkv_cute.kernels.jit import compile_combine
    from directkv_cute.kernels.launch import launch_combine

    g = torch.Generator(device="cuda").manual_seed(splits * 1000 + d)
    total_q, hq = 37, 6
    o_part = torch.randn(splits, total_q, hq, d, generator=g, device="cuda")
    lse_part = torch.randn(splits, total_q, hq, generator=g, device="cuda") * 20
    empty = torch.rand(splits, total_q, hq, generator=g, device="cuda") < 0.3
    empty[:, 0, 0] = True  # a row no split saw
    lse_part[empty] = -float("inf")
    o_part[empty] = 1e6  # an empty split's (finite) O gets weight exactly 0
    out = torch.full((total_q, hq, d), float("nan"), device="cuda", dtype=dtype)
    lse = torch.full((total_q, hq), float("nan"), device="cuda")
    launch_combine(compile_combine(d, dtype), o_part, lse_part, out, lse, splits)
    torch.cuda.synchronize()
    ref_lse = torch.logsumexp(lse_part.double(), dim=0)
    w = torch.exp(lse_part.double() - ref_lse).nan_to_num(0.0)  # all-empty rows: weights 0
    ref_o = (w[..., None] * o_part.double()).sum(0)
    assert not torch.isnan(out).any()
    assert torch.equal(lse[0, 0], torch.tensor(-float("inf"), device="cuda"))
    assert torch.equal(out[0, 0].float(), torch.zeros(d, device="cuda"))
    err = ((out.double() - ref_o).norm() / ref_o.norm()).item()
    assert err < TOL[dtype], f"relative error {err:.3e}"
    finite = torch.isfinite(ref_lse)
    assert torch.allclose(lse.double()[finite], ref_lse[finite], atol=1e-4, rtol=1e-5)
