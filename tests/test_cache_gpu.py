"""GPU tests of the cache and the reference: pinned exact-size host pool, UVA aliasing, GPU-side
writes into host pages without staging, tier moves, and the reference on GPU tensors.

All tests are marked ``gpu`` and skipped when ``torch.cuda.is_available()`` is False.
"""

from __future__ import annotations

import pytest
import torch

from directkv_cute.cache import PagedKVCache
from directkv_cute.reference import dense_attention_ref, paged_attention_ref

pytestmark = pytest.mark.gpu

L, H, D, P = 2, 4, 64, 16


@pytest.fixture
def cache():
    c = PagedKVCache(L, H, D, P, 7, 4, dtype=torch.bfloat16, device="cuda")
    yield c
    c.close()


def test_host_pool_is_pinned_exact_and_mapped(cache):
    from cuda.bindings import runtime as rt

    assert cache.host_pinned
    assert cache.host_pool.device.type == "cpu" and cache.host_pool.is_pinned()
    assert cache.host_pool.untyped_storage().nbytes() == 7 * cache.page_bytes  # no rounding
    err, attrs = rt.cudaPointerGetAttributes(cache.host_pool.data_ptr())
    assert err == rt.cudaError_t.cudaSuccess
    assert attrs.type == rt.cudaMemoryType.cudaMemoryTypeHost
    alias = cache.host_pool_cuda
    assert alias.is_cuda and alias.dtype == cache.dtype and alias.shape == cache.host_pool.shape
    assert alias.data_ptr() == int(attrs.devicePointer)
    assert not alias.any().item()
    assert cache.hbm_pool.is_cuda and cache.hbm_pool.shape == (4, L, H, 2, P, D)


def test_host_pool_cuda_aliases_host_memory(cache):
    cache.host_pool_cuda[3, 1, 2, 0, 5].fill_(1.5)  # a GPU store into host memory
    torch.cuda.synchronize()
    assert (cache.host_pool[3, 1, 2, 0, 5] == 1.5).all()
    cache.host_pool[2, 0, 1, 1].fill_(-2.0)  # a CPU store, read by the GPU
    assert (cache.host_pool_cuda[2, 0, 1, 1] == -2.0).all().item()
    assert not cache.host_pool_cuda[4:].any().item()


def test_append_from_gpu_writes_host_pages_without_staging(cache, randn):
    s = cache.add_sequence()
    n = 100  # 7 pages: ragged, fills the host tier
    k, v = randn(n, L, H, D, device="cuda"), randn(n, L, H, D, device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    cache.append(s, k, v)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < k.nbytes  # no GPU copy of the data
    table = cache.page_table(s)
    assert all(e >= 0 for e in table) and len(table) == 7
    kc, vc = k.cpu(), v.cpu()
    for t in (0, 15, 16, 57, 99):
        page, row = table[t // P], t % P
        assert torch.equal(cache.host_pool[page, :, :, 0, row], kc[t])
        assert torch.equal(cache.host_pool[page, :, :, 1, row], vc[t])
    rk, rv = cache.read(s, None)
    assert rk.is_cuda and torch.equal(rk, k) and torch.equal(rv, v)
    # A one-layer overwrite from the GPU.
    nk, nv = randn(20, H, D, device="cuda"), randn(20, H, D, device="cuda")
    cache.write(s, 1, 30, nk, nv)
    rk, rv = cache.read(s, 1, 30, 50)
    assert torch.equal(rk, nk) and torch.equal(rv, nv)
    torch.cuda.synchronize()
    assert torch.equal(cache.host_pool[table[1], 1, :, 0, 30 % P], nk[0].cpu())  # token 30: page 1, row 14


def test_tier_moves_and_fork_on_gpu(cache, randn):
    s = cache.add_sequence()
    k, v = randn(70, L, H, D, device="cuda"), randn(70, L, H, D, device="cuda")
    cache.append(s, k, v)  # 5 host pages
    cache.set_hbm_fraction(s, 0.6, "strided")
    table = cache.page_table(s)
    assert cache.page_counts(s) == {"host": 2, "hbm": 3}
    rk, rv = cache.read(s, None)
    assert torch.equal(rk, k) and torch.equal(rv, v)
    lp = next(i for i, e in enumerate(table) if e < 0)
    assert torch.equal(cache.hbm_pool[-table[lp] - 1, :, :, 0, 0], k[lp * P])
    f = cache.fork(s)  # copies the partial last page (in HBM) on the GPU
    kf, vf = randn(3, L, H, D, device="cuda"), randn(3, L, H, D, device="cuda")
    cache.append(f, kf, vf)
    cache.write(f, 0, 0, kf[:, 0], vf[:, 0])  # copy-on-write of shared page 0
    rk, _ = cache.read(s, None)
    assert torch.equal(rk, k)
    rk, _ = cache.read(f, 0)
    assert torch.equal(rk[:3], kf[:, 0]) and torch.equal(rk[3:70], k[3:, 0]) and torch.equal(rk[70:], kf[:, 0])
    cache.free(f)
    cache.set_hbm_fraction(s, 0.0)
    rk, rv = cache.read(s, None)
    assert torch.equal(rk, k) and torch.equal(rv, v)
    assert cache.free_pages("hbm") == 4
    tables = cache.kernel_tables([s])
    assert tables.page_table.is_cuda and tables.page_table.dtype == torch.int32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_on_gpu(randn, dtype):
    with PagedKVCache(3, 2, 128, 32, 16, 8, dtype=dtype, device="cuda") as cache:
        lengths, q_lens = [150, 33, 71], [5, 1, 16]
        seq_ids, ks, vs = [], [], []
        for n in lengths:
            s = cache.add_sequence()
            k, v = randn(n, 3, 2, 128, dtype=dtype, device="cuda"), randn(n, 3, 2, 128, dtype=dtype, device="cuda")
            cache.append(s, k, v)
            seq_ids.append(s)
            ks.append(k[:, 2].cpu())
            vs.append(v[:, 2].cpu())
        cache.set_hbm_fraction(seq_ids[0], 0.5, "strided")
        cache.set_hbm_fraction(seq_ids[2], 0.5, "recent")
        q = randn(sum(q_lens), 8, 128, dtype=dtype, device="cuda")
        out, lse = paged_attention_ref(q, cache, 2, seq_ids, q_lens)
        assert out.is_cuda and lse.is_cuda
        expect_out, expect_lse = dense_attention_ref(q.cpu(), ks, vs, q_lens, None)
        tol = dict(atol=1.5e-2, rtol=1.5e-2) if dtype == torch.bfloat16 else dict(atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(out.cpu().double(), expect_out, **tol)
        torch.testing.assert_close(lse.cpu().double(), expect_lse, atol=1e-4, rtol=1e-5)
        # The same from CPU queries over the CUDA cache.
        out_cpu, lse_cpu = paged_attention_ref(q.cpu(), cache, 2, seq_ids, q_lens)
        torch.testing.assert_close(out_cpu.double(), expect_out, **tol)
        torch.testing.assert_close(lse_cpu.double(), expect_lse, atol=1e-4, rtol=1e-5)


def test_close_unregisters_the_host_pool():
    cache = PagedKVCache(L, H, D, P, 3, 0, dtype=torch.float16, device="cuda")
    host = cache.host_pool
    assert host.is_pinned()
    cache.close()
    assert not cache.host_pinned and not host.is_pinned()
    assert cache.host_pool_cuda is None
    assert not host.any()  # still ordinary, readable host memory
    cache.close()  # idempotent
