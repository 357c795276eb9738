"""GPU tests of the fused K/V projection + RoPE + store kernel against the float64 reference.

Every case draws fresh random inputs, builds a cache (pinned host pool, HBM pool), poisons both
pools with NaN, runs ``kv_project`` (the kernel) and ``kv_project_reference`` (float64 dot
products, torch's model-dtype RoPE) into poisoned copies, and compares every element.

Tolerance: the kernel sums the dot products in fp32 in another order than the reference's
float64, so a linear output next to a rounding boundary may round to the neighbouring value
(one ulp of the model dtype). V is therefore bit-equal or one ulp off. K carries such a flip
through RoPE: |k_kernel - k_ref| <= 3 (ulp(a) + ulp(b)) + ulp(k_ref), a = round(k cos) and
b = round(rotate_half(k) sin) of the reference's linear output (a one-ulp input change moves each
rounded product by at most about two of its ulps, and the sum's rounding by one more). Flips are
rare (fp32 relative error ~1e-6 against an ulp of 4e-3 / 5e-4): at least 99% of the elements must
be bit-equal. Unwritten rows must stay NaN, and NaN never passes.
"""

from __future__ import annotations

import math

import pytest
import torch

from directkv_cute.cache import PagedKVCache
from directkv_cute.kv_proj import KVProjConfig, kv_project, kv_project_reference, project_reference, rotate_half

pytestmark = pytest.mark.gpu

HKV, D, LAYERS, LAYER = 8, 128, 2, 1


def _ulp(t: torch.Tensor) -> torch.Tensor:
    m = {torch.bfloat16: 7, torch.float16: 10}[t.dtype]
    a = t.double().abs().clamp_min(torch.finfo(t.dtype).tiny)
    return torch.exp2(torch.floor(torch.log2(a)) - m)


def _inputs(tokens, hidden, dtype, bias, seed, hkv=HKV):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    x = rnd(tokens, hidden).to(dtype)
    w_k = (rnd(hkv * D, hidden) * hidden ** -0.5).to(dtype)
    w_v = (rnd(hkv * D, hidden) * hidden ** -0.5).to(dtype)
    b_k = rnd(hkv * D).to(dtype) if bias else None
    b_v = rnd(hkv * D).to(dtype) if bias else None
    pos = torch.randint(0, 100000, (tokens,), generator=g, device="cuda").double()
    inv = 1.0 / 500000.0 ** (torch.arange(0, D, 2, device="cuda", dtype=torch.float64) / D)
    emb = torch.cat((pos[:, None] * inv, pos[:, None] * inv), -1)
    return x, w_k, w_v, b_k, b_v, emb.cos().to(dtype), emb.sin().to(dtype)


def _slots(tokens, page_size, pages, g, every=1):
    """Slots of a run of tokens starting mid-page, over random (non-contiguous) pages; with
    ``every`` > 1 only the last tokens (a window of tokens // every) get one, the rest -1."""
    start = int(torch.randint(0, page_size, (1,), generator=g))
    pos = torch.arange(tokens) + start
    perm = torch.randperm(pages, generator=g)
    slots = perm[pos // page_size] * page_size + pos % page_size
    if every > 1:
        slots[: tokens - max(1, tokens // every)] = -1
    return slots.cuda()


def _tolerance(args, k_ref, v_ref, hkv=HKV):
    x, w_k, w_v, b_k, b_v, cos, sin = args
    lin, _ = project_reference(x, w_k, w_v, b_k, b_v, torch.ones_like(cos), torch.zeros_like(sin), hkv, D)
    c, s = cos[:, None, :], sin[:, None, :]
    a, b = (lin * c), (rotate_half(lin) * s)
    return 3 * (_ulp(a) + _ulp(b)) + _ulp(k_ref), _ulp(v_ref)


def _close(got, want, tol, what):
    assert not torch.isnan(got).any(), f"{what}: NaN (an unwritten row?)"
    gap = (got.double() - want.double()).abs()
    assert (gap <= tol).all(), f"{what}: max gap {gap.max().item():.3e} past the bound at {(gap > tol).nonzero()[:4]}"
    exact = (got == want).double().mean().item()
    assert exact >= 0.99, f"{what}: only {exact:.4f} of the elements bit-equal"


def _check_pool(pool, ref_pool, slots, tol_k, tol_v, what):
    """Written rows within tolerance of the reference's, every other element still NaN."""
    keep = (slots >= 0).nonzero().flatten()
    P = pool.shape[4]
    page, row = slots[keep] // P, slots[keep] % P
    for kv, tol in ((0, tol_k), (1, tol_v)):
        _close(pool[page, LAYER, :, kv, row], ref_pool[page, LAYER, :, kv, row], tol[keep], f"{what} {'KV'[kv]}")
    mask = torch.ones(pool.shape[:5], dtype=torch.bool, device=pool.device)
    mask[page, LAYER, :, :, row] = False
    assert torch.isnan(pool[mask]).all(), f"{what}: a row outside the slots was written"


def _run(tokens, hidden, dtype, bias, page_size, dests, out, seed=0, config=None, hkv=HKV):
    g = torch.Generator().manual_seed(seed)
    args = _inputs(tokens, hidden, dtype, bias, seed, hkv)
    pages = math.ceil(tokens / page_size) + 3
    cache = PagedKVCache(LAYERS, hkv, D, page_size, num_host_pages=pages, num_hbm_pages=pages, dtype=dtype,
                         device="cuda")
    host, hbm = cache.host_pool_cuda, cache.hbm_pool
    host.fill_(float("nan"))
    hbm.fill_(float("nan"))
    kw = {}
    if "host" in dests:
        kw["host"] = (host, _slots(tokens, page_size, pages, g))
    if "hbm" in dests:
        kw["hbm"] = (hbm, _slots(tokens, page_size, pages, g, every=4))
    ref_kw = {n: (torch.full_like(p, float("nan")), s) for n, (p, s) in kw.items()}
    if out:
        kw["out_k"] = torch.full((tokens, hkv, D), float("nan"), dtype=dtype, device="cuda")
        kw["out_v"] = torch.full_like(kw["out_k"], float("nan"))
    x, w_k, w_v, b_k, b_v, cos, sin = args
    kv_project(x, w_k, w_v, b_k, b_v, cos=cos, sin=sin, layer=LAYER, config=config, **kw)
    k_ref, v_ref = kv_project_reference(x, w_k, w_v, b_k, b_v, cos=cos, sin=sin, layer=LAYER,
                                        out_k=torch.empty(tokens, hkv, D, dtype=dtype, device="cuda"),
                                        out_v=torch.empty(tokens, hkv, D, dtype=dtype, device="cuda"), **ref_kw)
    torch.cuda.synchronize()
    tol_k, tol_v = _tolerance(args, k_ref, v_ref, hkv)
    for name in ("host", "hbm"):
        if name in kw:
            _check_pool(kw[name][0], ref_kw[name][0], kw[name][1], tol_k, tol_v, name)
    if out:
        _close(kw["out_k"], k_ref, tol_k, "out_k")
        _close(kw["out_v"], v_ref, tol_v, "out_v")
        # The pools hold exactly what the kernel's dense outputs hold.
        if "host" in kw:
            slots = kw["host"][1]
            P = page_size
            assert torch.equal(host[slots // P, LAYER, :, 0, slots % P], kw["out_k"])
    cache.close()
    return kw


CASES = [
    # tokens, hidden, dtype, bias, page, destinations, dense out
    (1, 4096, torch.bfloat16, True, 16, ("host", "hbm"), True),
    (1, 8192, torch.float16, False, 64, ("host",), False),
    (3, 8192, torch.float16, False, 64, ("host",), False),
    (3, 4096, torch.bfloat16, True, 16, ("hbm",), True),
    (64, 4096, torch.float16, True, 16, ("hbm",), False),
    (64, 8192, torch.bfloat16, False, 64, ("host", "hbm"), True),
    (65, 4096, torch.bfloat16, False, 64, ("host", "hbm"), False),
    (65, 8192, torch.float16, True, 16, ("host",), True),
    (500, 8192, torch.bfloat16, True, 16, ("host", "hbm"), True),
    (500, 4096, torch.float16, False, 64, ("hbm",), False),
    (2048, 4096, torch.float16, True, 64, ("host",), True),
    (2048, 8192, torch.bfloat16, False, 16, ("host", "hbm"), False),
    (8192, 4096, torch.bfloat16, False, 64, ("host", "hbm"), False),
    (8192, 8192, torch.bfloat16, True, 16, ("host",), True),
    (8192, 4096, torch.float16, True, 16, ("hbm",), False),
]


@pytest.mark.parametrize("tokens, hidden, dtype, bias, page, dests, out", CASES)
def test_kernel_matches_reference(tokens, hidden, dtype, bias, page, dests, out):
    _run(tokens, hidden, dtype, bias, page, dests, out, seed=tokens + hidden)


@pytest.mark.parametrize("tokens, config", [
    (1, KVProjConfig(tile_m=64, stages=4, splits=1)),  # no split: one CTA per head, the whole hidden size
    (3, KVProjConfig(tile_m=64, stages=4, splits=64)),  # one block of W per split
    (37, KVProjConfig(tile_m=128, stages=3, splits=5)),  # uneven splits
    (500, KVProjConfig(tile_m=128, consumer_wgs=2, stages=5, ctas_per_sm=1)),
    (500, KVProjConfig(tile_m=64, stages=8, ctas_per_sm=1, splits=3)),
    (130, KVProjConfig(tile_m=128, stages=6, ctas_per_sm=1, splits=2)),
])
def test_configs_and_splits(tokens, config):
    _run(tokens, 4096, torch.bfloat16, True, 16, ("host", "hbm"), True, seed=7, config=config)


def test_other_kv_head_counts():
    _run(20, 4096, torch.bfloat16, True, 64, ("host",), True, seed=3, hkv=4)
    _run(20, 4096, torch.bfloat16, False, 16, ("hbm",), True, seed=4, hkv=1)


def _call(args, host, slots, out_k, out_v, config=None):
    x, w_k, w_v, b_k, b_v, cos, sin = args
    kv_project(x, w_k, w_v, b_k, b_v, cos=cos, sin=sin, layer=LAYER, host=(host, slots), out_k=out_k, out_v=out_v,
               config=config, check_slots=False)


def test_split_counters_reset_and_results_are_deterministic():
    """Back-to-back split-K launches (the counters reset themselves) give bit-identical results."""
    args = _inputs(5, 4096, torch.bfloat16, True, 11)
    cache = PagedKVCache(LAYERS, HKV, D, 16, num_host_pages=4, dtype=torch.bfloat16, device="cuda")
    slots = torch.arange(5, device="cuda") + 20
    outs = []
    for _ in range(4):
        out_k = torch.full((5, HKV, D), float("nan"), dtype=torch.bfloat16, device="cuda")
        out_v = torch.full_like(out_k, float("nan"))
        _call(args, cache.host_pool_cuda, slots, out_k, out_v, KVProjConfig(tile_m=64, stages=4, splits=16))
        outs.append((out_k, out_v))
    torch.cuda.synchronize()
    for k, v in outs[1:]:
        assert torch.equal(k, outs[0][0]) and torch.equal(v, outs[0][1])
    cache.close()


def test_out_of_range_and_skipped_slots_are_never_written():
    args = _inputs(6, 4096, torch.bfloat16, False, 12)
    cache = PagedKVCache(LAYERS, HKV, D, 16, num_host_pages=2, dtype=torch.bfloat16, device="cuda")
    cache.host_pool_cuda.fill_(float("nan"))
    slots = torch.tensor([0, -1, 31, 32, 1 << 40, -7], device="cuda")
    out_k = torch.empty(6, HKV, D, dtype=torch.bfloat16, device="cuda")
    out_v = torch.empty_like(out_k)
    _call(args, cache.host_pool_cuda, slots, out_k, out_v)
    torch.cuda.synchronize()
    pool = cache.host_pool_cuda
    assert torch.equal(pool[0, LAYER, :, 0, 0], out_k[0]) and torch.equal(pool[1, LAYER, :, 1, 15], out_v[2])
    pool[0, LAYER, :, :, 0] = 0
    pool[1, LAYER, :, :, 15] = 0
    assert torch.isnan(pool).sum() == pool.numel() - 2 * HKV * 2 * D


def test_cuda_graph_replay():
    args = _inputs(4, 4096, torch.bfloat16, True, 13)
    cache = PagedKVCache(LAYERS, HKV, D, 64, num_host_pages=2, dtype=torch.bfloat16, device="cuda")
    slots = torch.tensor([70, 71, 72, 3], device="cuda")
    out_k = torch.empty(4, HKV, D, dtype=torch.bfloat16, device="cuda")
    out_v = torch.empty_like(out_k)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        _call(args, cache.host_pool_cuda, slots, out_k, out_v)  # compiles, allocates this stream's counters
        torch.cuda.synchronize()
        want_k = out_k.clone()
        out_k.fill_(float("nan"))
        cache.host_pool_cuda.fill_(float("nan"))
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            _call(args, cache.host_pool_cuda, slots, out_k, out_v)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out_k, want_k)
    pool = cache.host_pool_cuda
    assert torch.equal(pool[1, LAYER, :, 0, 6], want_k[0]) and torch.equal(pool[0, LAYER, :, 0, 3], want_k[3])
    cache.close()


def test_a_cache_step_through_its_token_slots():
    """The op over a cache's TokenSlots (cache_destinations): ``cache.read`` returns the kernel's
    dense K and V for every token, host and HBM pages mixed."""
    from directkv_cute.kv_proj import cache_destinations

    cache = PagedKVCache(LAYERS, HKV, D, 16, num_host_pages=16, num_hbm_pages=8, dtype=torch.bfloat16,
                         device="cuda")
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.extend(a, 40)
    cache.extend(b, 20, tier="hbm")
    cache.extend(b, 50)
    slots = cache.token_slots([a, b], [5, 10], [35, 60])
    args = _inputs(95, 4096, torch.bfloat16, True, 14)
    x, w_k, w_v, b_k, b_v, cos, sin = args
    out_k = torch.empty(95, HKV, D, dtype=torch.bfloat16, device="cuda")
    out_v = torch.empty_like(out_k)
    kv_project(x, w_k, w_v, b_k, b_v, cos=cos, sin=sin, layer=LAYER, out_k=out_k, out_v=out_v,
               **cache_destinations(cache, slots))
    ka, va = cache.read(a, LAYER, 5, 40)
    kb, vb = cache.read(b, LAYER, 10, 70)
    assert torch.equal(torch.cat((ka, kb)), out_k) and torch.equal(torch.cat((va, vb)), out_v)
    cache.close()
