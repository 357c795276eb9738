"""GPU tests of the fused K/V projection + RoPE + store kernel against the float64 reference.

Every case draws fresh random inputs, builds a cache (pinned host pool, HBM pool), poisons both
pools with NaN, runs ``kv_project`` (the kernel), and checks every element:

* the linear outputs -- V, and K before RoPE (the same launch with the identity rotation) --
  against ``project_reference`` (float64 dot products rounded once): within one ulp of the model
  dtype (an fp32 sum next to a rounding boundary rounds to the neighbour) plus the fp32
  accumulation error where a sum cancels (``_sum_error``), and at least 99% bit-equal (97% in
  fp16);
* K after RoPE bit-equal to transformers' RoPE (torch's model-dtype ops, each product and the sum
  rounded) applied to the kernel's own linear K: the epilogue must round exactly as torch does;
* the pools' rows equal to the dense outputs, and every element outside the slots still NaN.
"""

from __future__ import annotations

import math

import pytest
import torch

from directkv_cute.cache import PagedKVCache
from directkv_cute.kv_proj import KVProjConfig, kv_project, project_reference, rotate_half

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


def _sum_error(x, w, hidden, hkv):
    """A bound on the fp32 accumulation error of each dot product: (hidden / 16 + 64) sequential
    fp32 additions (one per k16 WGMMA step, then the split partials), each off by at most 2^-24 of
    the running magnitude, which never exceeds sum |x_i w_i|; doubled for the tensor cores' own
    alignment of the products. It matters only where the sum cancels (|result| much below
    sum |x_i w_i|); elsewhere the result's rounding dominates."""
    mag = (x.double().abs() @ w.double().abs().t()).view(x.shape[0], hkv, D)  # (T, Hkv, d)
    return 2 * (hidden // 16 + 64) * 2.0**-24 * mag


def _tolerance(args, lin_ref, v_ref, hkv=HKV):
    """Bounds of the linear outputs (K before RoPE, V) against the float64 reference: one ulp of
    the result's rounding plus the fp32 accumulation error."""
    x, w_k, w_v = args[:3]
    hidden = x.shape[1]
    return _ulp(lin_ref) + _sum_error(x, w_k, hidden, hkv), _ulp(v_ref) + _sum_error(x, w_v, hidden, hkv)


def _rope(lin, cos, sin):
    """transformers' RoPE in the model dtype (each product and the sum rounded), as torch runs it."""
    c, s = cos[:, None, :], sin[:, None, :]
    return (lin * c) + (rotate_half(lin) * s)


def _close(got, want, tol, what):
    assert not torch.isnan(got).any(), f"{what}: NaN (an unwritten row?)"
    gap = (got.double() - want.double()).abs()
    assert (gap <= tol).all(), f"{what}: max gap {gap.max().item():.3e} past the bound at {(gap > tol).nonzero()[:4]}"
    exact = (got == want).double().mean().item()
    # A flip needs the fp32 sum's error to straddle a rounding boundary: about 8x likelier against
    # fp16's ulp than bf16's (measured 99.0-99.5% bit-equal in fp16, 99.5-99.9% in bf16).
    need = 0.97 if got.dtype == torch.float16 else 0.99
    assert exact >= need, f"{what}: only {exact:.4f} of the elements bit-equal (need {need})"


def _check_pool(pool, k_want, v_ref, slots, tol_v, what):
    """Written rows: K exactly ``k_want``, V within tolerance of the reference; every other
    element still NaN."""
    keep = (slots >= 0).nonzero().flatten()
    P = pool.shape[4]
    page, row = slots[keep] // P, slots[keep] % P
    assert torch.equal(pool[page, LAYER, :, 0, row], k_want[keep]), f"{what} K: not RoPE of the kernel's own linear output"
    _close(pool[page, LAYER, :, 1, row], v_ref[keep], tol_v[keep], f"{what} V")
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
    if out:
        kw["out_k"] = torch.full((tokens, hkv, D), float("nan"), dtype=dtype, device="cuda")
        kw["out_v"] = torch.full_like(kw["out_k"], float("nan"))
    x, w_k, w_v, b_k, b_v, cos, sin = args
    kv_project(x, w_k, w_v, b_k, b_v, cos=cos, sin=sin, layer=LAYER, config=config, **kw)
    # The kernel's own linear K (the same launch with the identity rotation: round(round(k * 1) -
    # round(k' * 0)) = k; split-K sums in a fixed order, so it is the K the first launch rotated).
    lin_k = torch.full((tokens, hkv, D), float("nan"), dtype=dtype, device="cuda")
    kv_project(x, w_k, w_v, b_k, b_v, cos=torch.ones_like(cos), sin=torch.zeros_like(sin), layer=LAYER,
               config=config, out_k=lin_k, out_v=torch.empty_like(lin_k))
    lin_ref, v_ref = project_reference(x, w_k, w_v, b_k, b_v, torch.ones_like(cos), torch.zeros_like(sin), hkv, D)
    torch.cuda.synchronize()
    tol_lin, tol_v = _tolerance(args, lin_ref, v_ref, hkv)
    _close(lin_k, lin_ref, tol_lin, "linear K")
    k_want = _rope(lin_k, cos, sin)  # the epilogue's RoPE must be torch's, bit for bit
    for name in ("host", "hbm"):
        if name in kw:
            _check_pool(kw[name][0], k_want, v_ref, kw[name][1], tol_v, name)
    if out:
        assert torch.equal(kw["out_k"], k_want), "out_k: not RoPE of the kernel's own linear output"
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
