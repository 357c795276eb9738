"""The one K/V store path (``directkv_cute.cache.store``): the rows of a pool, the cache's
``TokenSlots`` lowered to them and to ``kv_project``'s slots, and the stores through them against
plain advanced-index stores."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from directkv_cute import kv_proj as K
from directkv_cute.cache import PagedKVCache
from directkv_cute.cache.store import StoreIndex, layer_start, pool_rows, store_rows


def test_pool_rows_name_the_rows_of_the_pool():
    """Row ``pool_rows(...)[i]`` of a (pages, L, Hkv, 2, P, d) pool viewed as (-1, d) is the row
    the pool's index names, in numpy and torch alike; layer l is ``layer_start(l)`` rows on."""
    pages, L, hkv, P, d = 5, 3, 2, 16, 4
    pool = torch.arange(pages * L * hkv * 2 * P * d, dtype=torch.float64).view(pages, L, hkv, 2, P, d)
    pg, off = np.array([4, 0, 2]), np.array([15, 3, 0])
    rows = pool_rows(pg, off, hkv, P, L)
    assert rows.shape == (3 * 2 * hkv,)
    trows = pool_rows(torch.from_numpy(pg), torch.from_numpy(off), hkv, P, L)
    assert trows.tolist() == rows.tolist()
    flat = pool.view(-1, d)
    for layer in range(L):
        got = flat[torch.from_numpy(rows) + layer_start(layer, hkv, P)].view(3, hkv, 2, d)
        for i in range(3):
            assert torch.equal(got[i, :, 0], pool[pg[i], layer, :, 0, off[i]])
            assert torch.equal(got[i, :, 1], pool[pg[i], layer, :, 1, off[i]])
    every = pool_rows(pg, off, hkv, P, L, all_layers=True)
    assert every.tolist() == pool_rows(torch.from_numpy(pg), torch.from_numpy(off), hkv, P, L,
                                       all_layers=True).tolist()
    got = flat[torch.from_numpy(every)].view(3, L, hkv, 2, d)
    for i in range(3):
        assert torch.equal(got[i], pool[pg[i], :, :, :, off[i]])


def test_store_rows_writes_only_the_named_rows_and_their_scales():
    pages, hkv, P, d = 4, 2, 16, 8
    host, hbm = torch.zeros(pages, hkv, 2, P, d), torch.zeros(2, hkv, 2, P, d)
    hs, bs = torch.zeros(pages, hkv, 2, P), torch.zeros(2, hkv, 2, P)
    k, v = torch.randn(3, hkv, d), torch.randn(3, hkv, d)
    sk, sv = torch.rand(3, hkv), torch.rand(3, hkv)
    index = StoreIndex.build((np.array([0, 2]), np.array([3, 1]), np.array([5, 15])),
                             (np.array([2]), np.array([1]), np.array([15])), 3, hkv, P).to("cpu")
    store_rows(index, k, v, host, hbm, k_scales=sk, v_scales=sv, host_scales=hs, hbm_scales=bs)
    for t, (page, off) in ((0, (3, 5)), (2, (1, 15))):
        assert torch.equal(host[page, :, 0, off], k[t]) and torch.equal(host[page, :, 1, off], v[t])
        assert torch.equal(hs[page, :, 0, off], sk[t]) and torch.equal(hs[page, :, 1, off], sv[t])
    assert torch.equal(hbm[1, :, 0, 15], k[2]) and torch.equal(hbm[1, :, 1, 15], v[2])
    assert torch.equal(bs[1, :, 0, 15], sk[2]) and torch.equal(bs[1, :, 1, 15], sv[2])
    assert int((host != 0).sum()) == 2 * 2 * hkv * d and int((hbm != 0).sum()) == 2 * hkv * d
    assert int((hs != 0).sum()) == 2 * 2 * hkv and int((bs != 0).sum()) == 2 * hkv


def _cache(dtype=torch.float32):
    """Host pages, HBM pages and window mirrors in one step: sequence a's tokens 10..39 on host
    pages (some mirrored), b's 20 tokens in the HBM tier."""
    cache = PagedKVCache(num_layers=3, num_kv_heads=2, head_dim=16, page_size=16, num_host_pages=8,
                         num_hbm_pages=3, device="cpu", num_window_pages=2, dtype=dtype,
                         compute_dtype=torch.float32 if dtype != torch.float32 else None)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.extend(a, 40)
    cache.extend(b, 20, tier="hbm")
    cache.mirror(a, 10, 30)
    return cache, cache.token_slots([a, b], [10, 0], [30, 20])


@pytest.mark.parametrize("defer", [False, True])
def test_kv_project_destinations_are_the_stores(defer):
    """``write_destinations`` (the store path's slots) names what ``kv_proj.cache_destinations``
    names, and what ``write_slots`` writes."""
    cache, slots = _cache()
    assert slots.mirrored and slots.runs
    ours, theirs = cache.write_destinations(slots, defer), K.cache_destinations(cache, slots, defer)
    assert set(ours) == set(theirs)
    for tier in ours:
        assert ours[tier][0] is theirs[tier][0] and torch.equal(ours[tier][1], theirs[tier][1]), tier


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("defer", [False, True])
def test_write_slots_store_what_advanced_index_stores_store(defer, dtype):
    """``write_slots`` through the store rows leaves the pools (and FP8 scales) as per-part
    advanced-index stores of the same tokens would."""
    cache, slots = _cache(dtype)
    ref, _ = _cache(dtype)
    k, v = torch.randn(slots.total, 2, 16), torch.randn(slots.total, 2, 16)
    layer = 1
    for c in (cache, ref):
        c.host_pool.view(torch.uint8).fill_(0x7)
        c.hbm_pool.view(torch.uint8).fill_(0x7)
    cache.write_slots(slots, layer, k, v, defer_host=defer)
    ke, ve, ks, vs = ref._pools.encode(k, v)  # (n, Hkv, d) each as the pages hold them
    kv = torch.stack((ke, ve), dim=2)  # (n, Hkv, 2, d)
    scales = None if ks is None else torch.stack((ks, vs), dim=2)  # (n, Hkv, 2)
    for tier, tok, pidx, off in slots.parts + (() if defer else slots.mirrored):
        pool = ref.device_pool(tier).view(torch.uint8) if ref.fp8 else ref.device_pool(tier)
        pool[pidx, layer, :, :, off] = kv if tok is None else kv[tok]
        if scales is not None:
            sc = scales if tok is None else scales[tok]
            ref.device_scales(tier)[pidx, layer, :, :, off] = sc
    if defer:
        ref._copy_back(layer, slots.runs)
    for name in ("host_pool", "hbm_pool", "host_scales", "hbm_scales"):
        ours, theirs = getattr(cache, name), getattr(ref, name)
        if ours is None:
            continue
        raw = (lambda t: t.view(torch.uint8)) if ours.dtype != torch.float32 else (lambda t: t)
        assert torch.equal(raw(ours), raw(theirs)), name


def test_append_of_every_layer_goes_through_the_rows_of_every_layer():
    """``append`` stores every layer at once (rows of every layer), HBM pages and a window
    mirror written through."""
    cache = PagedKVCache(num_layers=3, num_kv_heads=2, head_dim=16, page_size=16, num_host_pages=8,
                         num_hbm_pages=2, device="cpu", num_window_pages=2, dtype=torch.float32)
    sid = cache.add_sequence()
    cache.extend(sid, 5, tier="hbm")  # page 0 in the HBM tier
    k, v = torch.randn(30, 3, 2, 16), torch.randn(30, 3, 2, 16)
    cache.append(sid, k[:25], v[:25])  # tokens 5..29: page 0, then host page 1
    assert cache.mirror(sid, 16, 14) == 1  # page 1 gets a mirror, a copy of its host page
    cache.append(sid, k[25:], v[25:])  # tokens 30, 31 into the mirrored page, then page 2
    got_k, got_v = cache.read(sid, None, 5)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    (lp, w), = cache.mirrored_pages(sid).items()
    assert lp == 1 and torch.equal(cache.hbm_pool[w], cache.host_pool[cache.page_table(sid)[1]])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_store_makes_no_copy_of_the_kv_data(dtype):
    """``append`` of every layer into 16-bit pages writes K and V from the caller's tensors into
    their pages: no operation makes new memory as large as half of K (a stacked or gathered copy of
    the data), only indexes; the pages then hold K and V."""
    from torch.utils._python_dispatch import TorchDispatchMode

    cache = PagedKVCache(2, 4, 64, 16, 12, 2, dtype=dtype, device="cpu")
    sid = cache.add_sequence()
    k, v = torch.randn(100, 2, 4, 64).to(dtype), torch.randn(100, 2, 4, 64).to(dtype)
    made = []

    class Outputs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {a.untyped_storage().data_ptr() for a in [*args, *(kwargs or {}).values()]
                      if isinstance(a, torch.Tensor)}
            if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() not in inputs:  # new memory
                made.append((func.__name__, out.numel() * out.element_size()))
            return out

    with Outputs():
        cache.append(sid, k, v)
    assert made and not [(n, b) for n, b in made if b >= k.nbytes // 2], made
    got_k, got_v = cache.read(sid, None)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
