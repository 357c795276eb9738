"""GPU tests of the Q-tiled kernel, directly over HBM pages and over host pages staged into HBM
by the copy engine (``directkv_cute.staging``), against the float64 reference; poisoned outputs,
ragged batches, GQA groups 1-16, both dtypes, every page size, hybrid tiers."""

from __future__ import annotations

import math
import random

import pytest
import torch

from directkv_cute.cache import PagedKVCache
from directkv_cute.config import QTiledConfig
from directkv_cute.ops import paged_attention
from directkv_cute.planner import StagingRequest
from test_attention_gpu import _build, _check, _run

pytestmark = pytest.mark.gpu


def qt(**fields):
    """(QTiledConfig, StagingRequest or None) of the fields of both."""
    asked = {k: fields.pop(k) for k in ("piece_pages", "splits", "order", "copy_order") if k in fields}
    return QTiledConfig(**fields), StagingRequest(**asked) if asked else None


CASES = [
    # lens, q_lens, hq, hkv, d, page, dtype, hbm fraction, config, staging
    ([700], [700], 32, 8, 128, 64, torch.bfloat16, 0.0, *qt()),
    ([700], [700], 32, 8, 128, 64, torch.bfloat16, 1.0, *qt()),  # direct: no staging
    ([700], [700], 32, 8, 128, 64, torch.bfloat16, 1.0, *qt(cluster=1)),  # one CTA per query tile
    ([1300], [1000], 32, 8, 128, 16, torch.float16, 0.0, *qt(cluster=1)),
    ([1300], [1000], 32, 8, 128, 16, torch.bfloat16, 0.5, *qt()),
    ([5000, 77, 3001], [513, 1, 64], 32, 8, 128, 64, torch.float16, 0.0, *qt(piece_pages=2)),
    ([2500, 2500], [1, 2047], 16, 16, 64, 128, torch.bfloat16, 0.25, *qt(tile_n=64, stages=4)),
    ([4099], [300], 64, 8, 128, 32, torch.bfloat16, 1.0, *qt(tile_n=64, stages=3)),
    ([9000], [4096], 32, 2, 128, 64, torch.bfloat16, 0.0, *qt(piece_pages=4)),  # group 16
    ([333, 1], [333, 1], 8, 8, 64, 16, torch.float16, 0.0, *qt(tile_n=64, stages=2)),
    ([6000, 900], [2000, 900], 32, 8, 128, 64, torch.bfloat16, 0.0, *qt(splits=3, piece_pages=2)),
    ([6000, 900], [2000, 900], 32, 8, 128, 64, torch.float16, 0.3, *qt(splits=1)),
    ([5000], [17], 32, 8, 128, 16, torch.bfloat16, 0.0, *qt(splits=8, piece_pages=8)),
    ([4000, 2500], [4000, 1000], 32, 8, 128, 64, torch.bfloat16, 0.0, *qt(order=2, piece_pages=2)),
    ([4000, 2500], [4000, 1000], 16, 8, 64, 32, torch.float16, 0.5, *qt(order=1, splits=1)),
    # clusters of two CTAs sharing each tile (the default; odd tile counts: a padded cluster with
    # an empty CTA), staged and direct
    ([1300], [1000], 32, 8, 128, 16, torch.float16, 0.5, *qt(stages=2)),
    ([6000, 900], [2000, 900], 32, 8, 128, 64, torch.bfloat16, 0.0, *qt(splits=3, piece_pages=2)),
    ([4099, 77], [300, 77], 64, 8, 128, 32, torch.bfloat16, 1.0, *qt(cluster=2, tile_n=64, stages=3)),
    ([5000, 77, 3001], [513, 1, 64], 32, 8, 128, 64, torch.float16, 0.0, *qt(cluster=2, piece_pages=2)),
    ([4000, 2500], [4000, 1000], 32, 8, 128, 64, torch.bfloat16, 0.0, *qt(cluster=2, order=2)),
    ([6000, 900], [2000, 900], 32, 8, 128, 64, torch.bfloat16, 0.3, *qt(cluster=2, splits=3)),
    ([2500, 2500], [1, 2047], 16, 16, 64, 128, torch.bfloat16, 1.0, *qt(cluster=2, tile_n=64)),
    # many splits folded in the kernel in launch order (more CTAs per split than SMs: a rank waits
    # for the one before), single and ragged; a GQA group of 7 (padded rows, 18 tokens per CTA)
    ([20000], [1500], 32, 8, 128, 64, torch.bfloat16, 0.0, *qt(splits=8)),
    ([17000, 3000, 9000], [1200, 1, 700], 32, 8, 128, 16, torch.float16, 0.0, *qt(splits=6, cluster=1)),
    ([12000, 5000], [900, 300], 28, 4, 128, 16, torch.bfloat16, 0.0, *qt(splits=4)),
    ([33000], [2048], 32, 8, 128, 64, torch.bfloat16, 0.0, *qt(splits=16)),
    # the copy staged head by head, the CTAs remapped head-major (over the batch too)
    ([6000, 900, 3001], [2000, 900, 64], 32, 8, 128, 64, torch.bfloat16, 0.0, *qt(copy_order=2)),
    ([6000, 900], [2000, 900], 32, 8, 128, 16, torch.float16, 0.3, *qt(copy_order=2, cluster=1)),
    ([4000, 2500], [4000, 1000], 32, 8, 128, 64, torch.bfloat16, 0.0, *qt(copy_order=2, order=2)),
    ([9000], [4096], 32, 2, 128, 64, torch.bfloat16, 0.0, *qt(copy_order=2, piece_pages=4)),
    ([333, 1], [333, 1], 8, 8, 64, 16, torch.float16, 0.0, *qt(copy_order=2, tile_n=64, stages=2)),
]


@pytest.mark.parametrize("lens,q_lens,hq,hkv,d,page,dtype,hbm,config,staging", CASES)
def test_q_tiled_matches_reference(lens, q_lens, hq, hkv, d, page, dtype, hbm, config, staging):
    _run(lens, q_lens, hq, hkv, d, page, dtype, hbm, config, staging=staging)


@pytest.mark.parametrize("seed", range(6))
def test_q_tiled_random_shapes(seed):
    r = random.Random(100 + seed)
    dtype = r.choice([torch.bfloat16, torch.float16])
    hkv, group = r.choice([1, 2, 8]), r.choice([1, 4, 8])
    d, page = r.choice([64, 128]), r.choice([16, 32, 64, 128])
    lens = [r.randint(1, 4000) for _ in range(r.choice([1, 3, 5]))]
    q_lens = [r.randint(1, n) for n in lens]
    cfg, st = qt(tile_n=r.choice([64, 128]), stages=2, piece_pages=r.choice([0, 1, 3]), cluster=r.choice([1, 2]),
                 copy_order=r.choice([0, 1, 2]))
    _run(lens, q_lens, hkv * group, hkv, d, page, dtype, r.choice([0.0, 0.4, 1.0]), cfg, seed=seed, staging=st)


def test_staged_calls_back_to_back_reuse_the_buffer():
    """Two layers, then the first again, staged through one buffer in three folded splits: each
    call waits for its own epoch's copies, never a previous call's, and takes the stream's fold
    turn counters as the previous launch left them (at zero)."""
    from directkv_cute import staging

    dtype = torch.bfloat16
    cache, ids, ks, vs, _ = _build([3000, 1200], 8, 128, 64, dtype, layers=2, seed=3)
    g = torch.Generator("cuda").manual_seed(4)
    q = torch.randn(3000 + 1200, 32, 128, device="cuda", generator=g).to(dtype)
    outs = []
    for layer in (0, 1, 0):
        out = torch.full_like(q, float("nan"))
        outs.append(paged_attention(q, cache, layer, ids, [3000, 1200], config=QTiledConfig(),
                                    staging=StagingRequest(piece_pages=3, splits=3), out=out, return_lse=True))
    torch.cuda.synchronize()
    st = staging.stager(q.device, torch.cuda.current_stream())
    assert st.epoch >= 3
    assert st.turns is not None and st.turns.numel() > 0 and not st.turns.any()
    held = staging.staging_bytes()
    assert held >= (3000 + 1200) * 2 * 8 * 128 * 2  # one layer of both sequences
    assert staging.release_staging() == held and staging.staging_bytes() == 0
    for layer, (o, lse) in zip((0, 1, 0), outs):
        # the reference for this layer, rebuilt from the cache's own pages of that layer
        from directkv_cute.reference import paged_attention_ref

        ref_o, ref_lse = paged_attention_ref(q, cache, layer, ids, [3000, 1200], None)
        assert not torch.isnan(o).any()
        err = ((o.double() - ref_o.double()).norm() / ref_o.double().norm()).item()
        assert err < 2e-2, (layer, err)
        assert torch.allclose(lse, ref_lse, atol=2e-3, rtol=1e-4)
    assert torch.equal(outs[0][0], outs[2][0]), "the same layer twice gave different outputs"
    cache.close()


def test_a_cache_without_hbm_pages_stages_its_chunks():
    """A cache with no HBM pages at all (no window, no HBM tier: a model run without the window)
    stages a chunk over its host pages, the kernel's other source left the host pool, and matches
    the reference; ragged, both with the op's own plan and with an explicit config."""
    g = torch.Generator(device="cuda").manual_seed(11)
    lens, q_lens, hkv, d, page, layers = [5000, 1800], [2048, 900], 8, 128, 64, 3
    cache = PagedKVCache(layers, hkv, d, page, num_host_pages=sum(math.ceil(n / page) for n in lens) + 2,
                         num_hbm_pages=0, dtype=torch.bfloat16, device="cuda")
    ids, ks, vs = [], [], []
    for n in lens:
        sid = cache.add_sequence()
        k = torch.randn(n, layers, hkv, d, generator=g, device="cuda").to(torch.bfloat16)
        v = torch.randn(n, layers, hkv, d, generator=g, device="cuda").to(torch.bfloat16)
        cache.append(sid, k, v)
        ids.append(sid)
        ks.append(k[:, 1])
        vs.append(v[:, 1])
    q = torch.randn(sum(q_lens), 32, d, generator=g, device="cuda").to(torch.bfloat16)
    for config in (None, QTiledConfig()):
        out = torch.full_like(q, float("nan"))
        o, lse = paged_attention(q, cache, 1, ids, q_lens, config=config, out=out, return_lse=True)
        torch.cuda.synchronize()
        _check(o, lse, q, ks, vs, q_lens, torch.bfloat16)
    cache.close()


def test_auto_route_stages_a_compute_bound_chunk():
    """Without a config, a long chunk over host pages is staged (the cost model) and matches."""
    from directkv_cute import staging

    before = sum(s.epoch for s in staging._STAGERS.values())
    _run([8192], [4096], 32, 8, 128, 64, torch.bfloat16, 0.0, None)
    assert sum(s.epoch for s in staging._STAGERS.values()) > before


def test_staging_cap_refuses_before_writing(monkeypatch):
    monkeypatch.setenv("DIRECTKV_MAX_STAGING_GB", "0.0001")
    cache, ids, ks, vs, layer = _build([4000], 8, 128, 64, torch.bfloat16)
    q = torch.randn(4000, 32, 128, device="cuda").to(torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    with pytest.raises(ValueError, match="DIRECTKV_MAX_STAGING_GB"):
        paged_attention(q, cache, layer, ids, [4000], config=QTiledConfig(), out=out)
    assert torch.isnan(out).all()
    # Without an explicit config the op falls back to reading in place, and is right.
    o, lse = paged_attention(q, cache, layer, ids, [4000], out=out, return_lse=True)
    torch.cuda.synchronize()
    _check(o, lse, q, ks, vs, [4000], torch.bfloat16)
    cache.close()


@pytest.mark.parametrize("lens,q_lens,page,dtype,config,staging", [
    ([8192], [2048], 64, torch.bfloat16, None, None),
    ([16384, 9000], [2048, 1000], 16, torch.float16, None, None),
    ([6000, 700], [1500, 700], 64, torch.bfloat16, *qt(splits=3, cluster=1)),
])
def test_window_chunks_run_their_ready_splits_first(monkeypatch, lens, q_lens, page, dtype, config, staging):
    """A step's own tokens mirrored in HBM (the window a model step leaves), the history on the
    host, ragged: the staged call launches the window's splits first (``split_first`` > 0) and
    matches the reference over the whole sequences, every output row written."""
    from directkv_cute.kernels import launch as L

    firsts, sources = [], []
    real = L.launch_q_tiled

    def spy(*a, **k):
        firsts.append(k.get("split_first", 0))
        sources.append(a[4].shape[0])
        return real(*a, **k)

    monkeypatch.setattr(L, "launch_q_tiled", spy)
    hq, hkv, d, layers = 32, 8, 128, 2
    g = torch.Generator(device="cuda").manual_seed(5)
    pages = sum(math.ceil(n / page) for n in lens)
    window = sum(math.ceil(m / page) + 1 for m in q_lens)
    cache = PagedKVCache(layers, hkv, d, page, num_host_pages=pages + 2, num_hbm_pages=2, num_window_pages=window,
                         dtype=dtype, device="cuda")
    ids, ks, vs = [], [], []
    for n, m in zip(lens, q_lens):
        sid = cache.add_sequence()
        k = torch.randn(n, layers, hkv, d, generator=g, device="cuda").to(dtype)
        v = torch.randn(n, layers, hkv, d, generator=g, device="cuda").to(dtype)
        cache.append(sid, k[:n - m], v[:n - m])
        cache.extend(sid, m)
        cache.mirror(sid, n - m, m)
        for layer in range(layers):  # the step's own K/V, stored through to the mirrors
            cache.write(sid, layer, n - m, k[n - m:, layer], v[n - m:, layer])
        ids.append(sid)
        ks.append(k[:, layers - 1])
        vs.append(v[:, layers - 1])
    assert (cache.kernel_tables(ids).host_table < 0).any()
    q = torch.randn(sum(q_lens), hq, d, generator=g, device="cuda").to(dtype)
    out = torch.full_like(q, float("nan"))
    o, lse = paged_attention(q, cache, layers - 1, ids, q_lens, config=config, staging=staging, out=out,
                             return_lse=True)
    torch.cuda.synchronize()
    _check(o, lse, q, ks, vs, q_lens, dtype)
    assert firsts and firsts[-1] > 0, firsts
    # the window's pages read where they are: the launch's other source is the HBM pool seen as
    # one-layer pages from the layer read on
    assert sources[-1] == cache.hbm_pool.shape[0] * layers - (layers - 1), sources
    cache.close()


def test_hybrid_staging_with_more_ctas_than_sms_finishes():
    """Hybrid tiers with a grid far larger than the GPU (1024 CTAs): the pages already in HBM
    are read where they are, and no copy waits for SMs that CTAs spinning on ready flags hold.
    Run in a child process so a deadlock fails the test instead of hanging it."""
    import os
    import subprocess
    import sys

    import gc

    gc.collect()
    torch.cuda.empty_cache()  # the child's float64 reference needs the memory this process caches
    here = os.path.dirname(os.path.abspath(__file__))
    code = ("import sys, torch; sys.path.insert(0, %r); from test_attention_gpu import _run; "
            "from directkv_cute.config import QTiledConfig; "
            "_run([8192], [4096], 32, 8, 128, 64, torch.bfloat16, 0.5, QTiledConfig()); "
            "torch.cuda.synchronize(); print('done')" % here)
    try:
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("the staged hybrid call did not finish in 240 s (copies waiting on the kernel's SMs)")
    assert res.returncode == 0 and "done" in res.stdout, res.stderr[-3000:]


def test_long_decode_is_staged_and_still_capturable():
    """Decode over 70k host tokens takes the staged path on its own (the copy engine outruns SM
    reads of host memory); the eager call also readies the in-place kernel, so a CUDA graph
    capture of the same call (which reads in place) works."""
    from directkv_cute import staging
    from directkv_cute.ops import paged_attention_tables

    dtype = torch.bfloat16
    cache, ids, ks, vs, layer = _build([40000, 30000], 8, 128, 64, dtype)
    tables = cache.kernel_tables(ids)
    q = torch.randn(2, 32, 128, device="cuda").to(dtype)
    out = torch.full_like(q, float("nan"))
    before = sum(s.epoch for s in staging._STAGERS.values())
    o, lse = paged_attention_tables(q, cache, layer, tables, out=out, return_lse=True)
    torch.cuda.synchronize()
    assert sum(s.epoch for s in staging._STAGERS.values()) > before, "decode over 70k tokens was not staged"
    _check(o, lse, q, ks, vs, None, dtype)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, lse = paged_attention_tables(q, cache, layer, tables, out=out, return_lse=True)
    q.copy_(torch.randn_like(q))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _check(out, lse, q, ks, vs, None, dtype)
    cache.close()


def _stage_case(seed: int):
    """A 6000-token sequence over host pages (two layers) and a 2000-token query, staged."""
    dtype = torch.bfloat16
    cache, ids, ks, vs, _ = _build([6000], 8, 128, 64, dtype, layers=2, seed=seed)
    q = torch.randn(2000, 32, 128, device="cuda", generator=torch.Generator("cuda").manual_seed(seed + 1)).to(dtype)
    return cache, ids, q


def test_staged_copy_follows_a_late_write_to_its_history():
    """A staged call's copy runs ahead of the current stream, yet a host write enqueued before
    the call (here behind 50 ms of GPU sleep, so it lands late) is seen: the call's copy of the
    written pages waits for it. Layer 1's first 1000 tokens are rewritten after layer 0's call."""
    from directkv_cute import staging
    from directkv_cute.reference import paged_attention_ref

    cache, ids, q = _stage_case(11)
    cfg = dict(config=QTiledConfig(), staging=StagingRequest(piece_pages=4))
    paged_attention(q, cache, 0, ids, [2000], **cfg)  # compiled, slot chosen
    torch.cuda.synchronize()
    st = staging.stager(q.device, torch.cuda.current_stream())
    slot = st.slot
    g = torch.Generator("cuda").manual_seed(12)
    k_new = torch.randn(1000, 8, 128, device="cuda", generator=g).to(q.dtype)
    v_new = torch.randn(1000, 8, 128, device="cuda", generator=g).to(q.dtype)
    torch.cuda._sleep(100_000_000)  # about 50 ms: the write below runs late
    cache.write(ids[0], 1, 0, k_new, v_new)
    out = torch.full_like(q, float("nan"))
    o, lse = paged_attention(q, cache, 1, ids, [2000], **cfg, out=out, return_lse=True)
    assert st.slot != slot, "the call did not take the other slot (no copy ahead)"
    torch.cuda.synchronize()
    ref_o, ref_lse = paged_attention_ref(q, cache, 1, ids, [2000], None)
    k_read, _ = cache.read(ids[0], 1, 0, 1000)
    assert torch.equal(k_read, k_new)
    assert not torch.isnan(o).any()
    err = ((o.double() - ref_o.double()).norm() / ref_o.double().norm()).item()
    assert err < 2e-2, err
    assert torch.allclose(lse, ref_lse, atol=2e-3, rtol=1e-4)
    cache.close()


def test_back_to_back_chunks_are_planned_for_copies_ahead():
    """A staged chunk over tables marked back to back (a model step's layers) is planned for its
    copy running ahead of the kernel before it (``choice.pipelined``: coarse pieces, the pieces of
    the step's own pages apart); over unmarked tables it is not. Both copies may run ahead of the
    current stream (the cache records its host writes), and both run while an earlier kernel
    still occupies the GPU. Ragged batch, the step's own tokens of layer 1 rewritten (recorded host writes its copy
    follows), poisoned outputs; every call matches the reference."""
    from directkv_cute import DirectKVAttention
    from directkv_cute.reference import paged_attention_ref

    dtype = torch.bfloat16
    lens, q_lens = [6000, 3100], [2000, 700]
    cache, ids, _, _, _ = _build(lens, 8, 128, 64, dtype, layers=2, seed=31)
    g = torch.Generator("cuda").manual_seed(32)
    q = torch.randn(sum(q_lens), 32, 128, device="cuda", generator=g).to(dtype)
    paged_attention(q, cache, 0, ids, q_lens)  # compiled
    for sid, n, ql in zip(ids, lens, q_lens):
        cache.write(sid, 1, n - ql, torch.randn(ql, 8, 128, device="cuda", generator=g).to(dtype),
                    torch.randn(ql, 8, 128, device="cuda", generator=g).to(dtype))
    plain, marked = DirectKVAttention(cache), DirectKVAttention(cache)
    plain_plan = plain.plan(tables=cache.kernel_tables(ids), q_lens=q_lens, num_q_heads=32, cascade=False)
    marked_plan = marked.plan(tables=cache.kernel_tables(ids, back_to_back=True), q_lens=q_lens, num_q_heads=32,
                              cascade=False)
    assert plain_plan.staged and plain_plan.detail.copy_ahead and not plain_plan.choice.pipelined, plain_plan.explain()
    assert marked_plan.staged and marked_plan.detail.copy_ahead and marked_plan.choice.pipelined, marked_plan.explain()
    assert len(marked_plan.staging.pieces) < len(plain_plan.staging.pieces)  # coarse pieces
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)  # about 50 ms: the calls below queue behind it
    outs = [(0, plain.run(q, 0, out=torch.full_like(q, float("nan")))),
            (0, plain.run(q, 0, out=torch.full_like(q, float("nan")))),
            (1, marked.run(q, 1, out=torch.full_like(q, float("nan"))))]
    torch.cuda.synchronize()
    for layer, out in outs:
        ref_o, _ = paged_attention_ref(q, cache, layer, ids, q_lens, None)
        assert not torch.isnan(out).any()
        err = ((out.double() - ref_o.double()).norm() / ref_o.double().norm()).item()
        assert err < 2e-2, (layer, err)
    cache.close()


def test_staged_history_copy_runs_ahead_of_the_current_stream(monkeypatch):
    """Nothing written since: a staged call's copy lands while the current stream still sleeps
    (it waits only for the kernel that last read its slot); with DIRECTKV_STAGE_OVERLAP=0 it waits
    for the current stream. Outputs match the reference either way."""
    import time

    from directkv_cute import staging
    from directkv_cute.reference import paged_attention_ref

    cache, ids, q = _stage_case(21)
    cfg = dict(config=QTiledConfig(), staging=StagingRequest(piece_pages=4))
    for layer in (0, 1):
        paged_attention(q, cache, layer, ids, [2000], **cfg)
    torch.cuda.synchronize()
    st = staging.stager(q.device, torch.cuda.current_stream())
    ref_o, _ = paged_attention_ref(q, cache, 0, ids, [2000], None)
    for overlap in ("1", "0"):
        monkeypatch.setenv("DIRECTKV_STAGE_OVERLAP", overlap)
        torch.cuda._sleep(400_000_000)  # about 200 ms
        out = paged_attention(q, cache, 0, ids, [2000], **cfg)
        time.sleep(0.05)
        landed = st.stream.query()
        torch.cuda.synchronize()
        assert landed == (overlap == "1"), (overlap, landed)
        err = ((out.double() - ref_o.double()).norm() / ref_o.double().norm()).item()
        assert err < 2e-2, (overlap, err)
    cache.close()


@pytest.mark.parametrize("order", ["descending", "interleaved"])
def test_staged_pages_held_in_any_order_match_the_reference(order):
    """Host pages handed out last to first (a freed sequence's pages come back descending, as an
    engine that frees blocks in reverse hands them out) or two sequences' pages interleaved page
    by page: each staged piece is copied in page order, in few copies, and every query still
    attends to its own keys (a 700-row chunk and a decode row, both staged)."""
    from directkv_cute.attention import DirectKVAttention

    dtype, layers, hkv, d, page = torch.bfloat16, 2, 8, 128, 64
    lens, q_lens = [5000, 3001], [700, 1]
    pages = sum(math.ceil(n / page) for n in lens)
    cache = PagedKVCache(layers, hkv, d, page, num_host_pages=pages + 2, dtype=dtype, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(11)
    ids = [cache.add_sequence() for _ in lens]
    ks = [torch.randn(n, layers, hkv, d, generator=g, device="cuda").to(dtype) for n in lens]
    vs = [torch.randn(n, layers, hkv, d, generator=g, device="cuda").to(dtype) for n in lens]
    if order == "descending":
        held = cache.add_sequence()
        cache.extend(held, (pages + 2) * page)
        cache.free(held)
        for sid, k, v in zip(ids, ks, vs):
            cache.append(sid, k, v)
    else:
        for start in range(0, max(lens), page):
            for sid, k, v in zip(ids, ks, vs):
                if start < len(k):
                    cache.append(sid, k[start:start + page], v[start:start + page])
    tables = [cache.page_table(sid) for sid in ids]
    step = -1 if order == "descending" else 2
    assert all(t[1] - t[0] == step for t in tables), tables[0][:4]
    q = torch.randn(sum(q_lens), 32, d, device="cuda", generator=g).to(dtype)
    attn = DirectKVAttention(cache)
    plan = attn.plan(ids, q_lens=q_lens, num_q_heads=32, return_lse=True, config=QTiledConfig(),
                     staging=StagingRequest(piece_pages=8))
    host_copies, _ = plan.staging.copy_calls
    assert plan.route == "q_tiled_staged" and host_copies <= 2 * len(plan.staging.pieces)
    out = torch.full_like(q, float("nan"))
    o, lse = attn.run(q, 1, out)
    torch.cuda.synchronize()
    _check(o, lse, q, [k[:, 1] for k in ks], [v[:, 1] for v in vs], q_lens, dtype)
    cache.close()


def test_a_pool_view_with_a_write_log_copies_ahead_after_the_writes_it_records():
    """Per-layer pools as an engine keeps them (``PoolView`` over its host KV, with a
    ``HostWriteLog``, as the vLLM backend's): a staged call copies ahead of the current stream
    (into the other slot), yet a write to four of its host pages, enqueued before the call behind
    50 ms of GPU sleep and recorded in the log, is seen; the step's restart stands for the writes
    before it. Matches the reference over the rewritten pages."""
    import numpy as np

    from directkv_cute import staging
    from directkv_cute.attention import DirectKVAttention
    from directkv_cute.cache import HostWriteLog
    from directkv_cute.reference import paged_attention_ref
    from directkv_cute.runner import PoolView, tables_from_host

    cache, ids, q = _stage_case(41)
    write_log = HostWriteLog(q.device)
    view = PoolView(cache.host_pool_cuda, cache.hbm_pool, write_log=write_log)
    host_table = cache.kernel_tables(ids).host_table
    tables = tables_from_host(host_table, [6000], q.device)._replace(back_to_back=True)
    attn = DirectKVAttention(view)
    plan = attn.plan(tables=tables, q_lens=[2000], num_q_heads=32, config=QTiledConfig(),
                     staging=StagingRequest(piece_pages=4))
    assert plan.route == "q_tiled_staged" and plan.detail.copy_ahead, plan.explain()
    attn.run(q, 0)  # compiled, slot chosen
    torch.cuda.synchronize()
    step = torch.cuda.Event()
    step.record()
    write_log.restart(step)
    st = staging.stager(q.device, torch.cuda.current_stream())
    slot = st.slot
    first = cache.page_table(ids[0])[:4]
    assert first == list(range(first[0], first[0] + 4))
    g = torch.Generator("cuda").manual_seed(42)
    new = torch.randn(4, *view.host_pool.shape[2:], device="cuda", generator=g).to(q.dtype)
    torch.cuda._sleep(100_000_000)  # about 50 ms: the write below runs late
    view.host_pool[first[0]:first[0] + 4, 1].copy_(new)
    write_log.record(np.asarray(first, dtype=np.int64))
    out = torch.full_like(q, float("nan"))
    o = attn.run(q, 1, out)
    assert st.slot != slot, "the call did not take the other slot (no copy ahead)"
    torch.cuda.synchronize()
    assert torch.equal(cache.host_pool[first[0]:first[0] + 4, 1], new.cpu())
    ref_o, _ = paged_attention_ref(q, cache, 1, ids, [2000], None)
    assert o is out and not torch.isnan(o).any()
    err = ((o.double() - ref_o.double()).norm() / ref_o.double().norm()).item()
    assert err < 2e-2, err
    cache.close()
