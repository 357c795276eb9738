"""CPU tests of the paged KV cache: layout, sequence operations, capacity, validation, tables.

The "HBM" tier of a ``device="cpu"`` cache is a second CPU pool, so mixed-tier paths run here.
A hypothesis state machine drives random operation sequences against a plain model.
"""

from __future__ import annotations

import contextlib
import gc
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from directkv_cute._pinned import PinnedHostBuffer
from directkv_cute.cache import (
    CacheCapacityError,
    KernelTables,
    PagedKVCache,
    UnknownSequenceError,
    decode_page,
    encode_page,
)

L, H, D, P = 2, 2, 8, 16  # small model shape: one page is 2 * 2 * 2 * 16 * 8 * 2 B = 2 KiB


def make_cache(host: int = 8, hbm: int = 4) -> PagedKVCache:
    return PagedKVCache(L, H, D, P, host, hbm, dtype=torch.bfloat16, device="cpu")


def snapshot(cache: PagedKVCache) -> tuple:
    """Bookkeeping plus a copy of both pools' data."""
    return cache.state(), cache.host_pool.clone(), cache.hbm_pool.clone()


def assert_unchanged(cache: PagedKVCache, before: tuple) -> None:
    state, host, hbm = before
    assert cache.state() == state
    assert torch.equal(cache.host_pool, host)
    assert torch.equal(cache.hbm_pool, hbm)


def fill(cache: PagedKVCache, seq: int, n: int, randn, tier: str = "host") -> tuple[torch.Tensor, torch.Tensor]:
    """Append n random tokens; return their (n, L, H, D) K and V."""
    k, v = randn(n, L, H, D, dtype=cache.dtype), randn(n, L, H, D, dtype=cache.dtype)
    cache.append(seq, k, v, tier)
    return k, v


# ---- construction and layout --------------------------------------------------------------
def test_pool_layout_exact_size_and_zero_init():
    cache = PagedKVCache(3, 4, 64, 16, 5, 2, dtype=torch.float16, device="cpu")
    assert cache.host_pool.shape == (5, 3, 4, 2, 16, 64)
    assert cache.hbm_pool.shape == (2, 3, 4, 2, 16, 64)
    assert cache.page_bytes == 3 * 4 * 2 * 16 * 64 * 2
    # Exactly num_host_pages * page_bytes, no rounding (5 pages is not a power of two).
    assert cache.host_pool.untyped_storage().nbytes() == 5 * cache.page_bytes
    assert cache.host_pool.is_contiguous() and cache.host_pool.data_ptr() % 4096 == 0
    assert not cache.host_pool.any() and not cache.hbm_pool.any()
    assert cache.host_pool_cuda is None and not cache.host_pinned
    assert cache.num_pages("host") == 5 and cache.num_pages("hbm") == 2
    assert cache.free_pages("host") == 5 and cache.free_pages("hbm") == 2


def test_k_and_v_of_a_page_and_head_are_one_contiguous_piece(randn):
    cache = PagedKVCache(2, 3, 64, 16, 4, 0, dtype=torch.bfloat16, device="cpu")
    s = cache.add_sequence()
    cache.extend(s, 20)  # pages 0 and 1
    k, v = randn(20, 3, 64), randn(20, 3, 64)
    cache.write(s, 1, 0, k, v)
    piece_bytes = 2 * 16 * 64 * 2
    assert piece_bytes >= 4096
    base = cache.host_pool.data_ptr()
    for page, layer, head in [(0, 0, 0), (1, 1, 2), (0, 1, 1)]:
        piece = cache.host_pool[page, layer, head]  # (2, 16, 64): K rows then V rows
        assert piece.is_contiguous()
        assert piece.data_ptr() - base == ((page * 2 + layer) * 3 + head) * piece_bytes
        assert piece.data_ptr() % 16 == 0
    # Token 17 of the sequence is row 1 of page 1.
    assert torch.equal(cache.host_pool[1, 1, :, 0, 1], k[17])
    assert torch.equal(cache.host_pool[1, 1, :, 1, 1], v[17])
    assert not cache.host_pool[:, 0].any()  # layer 0 untouched


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(page_size=24), ValueError, "page_size"),
        (dict(head_dim=12), ValueError, "multiple of 8"),
        (dict(num_host_pages=0), ValueError, "num_host_pages"),
        (dict(num_hbm_pages=-1), ValueError, "num_hbm_pages"),
        (dict(num_layers=2.0), TypeError, "num_layers"),
        (dict(dtype=torch.float64), TypeError, "dtype"),
        (dict(dtype=torch.float32, device="cuda"), TypeError, "on device='cpu'"),
        (dict(device="meta"), ValueError, "device"),
    ],
)
def test_constructor_validation(kwargs, error, match):
    args = dict(num_layers=2, num_kv_heads=2, head_dim=64, page_size=16, num_host_pages=4, device="cpu")
    args.update(kwargs)
    with pytest.raises(error, match=match):
        PagedKVCache(**args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_device_without_cuda_is_a_clear_error():
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        PagedKVCache(2, 2, 64, 16, 4, device="cuda")


# ---- pinned host buffer: registration protocol, with the CUDA calls faked ------------------------
class FakeCudart:
    """Records torch.cuda.cudart() calls; cudaHostRegister returns ``register_code``."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.register_code = 0

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        self.calls.append(("register", ptr, nbytes, flags))
        return self.register_code

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        return 0


@pytest.fixture
def fake_cuda(monkeypatch):
    from cuda.bindings import runtime as rt

    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(rt, "cudaSetDevice", lambda index: (rt.cudaError_t.cudaSuccess,))
    monkeypatch.setattr(rt, "cudaHostGetDevicePointer", lambda ptr, flags: (rt.cudaError_t.cudaSuccess, ptr))
    return cudart


def test_host_buffer_is_exact_aligned_and_zero():
    buf = PinnedHostBuffer(3 * 4096 + 48)
    assert buf.tensor.shape == (3 * 4096 + 48,) and buf.tensor.untyped_storage().nbytes() == 3 * 4096 + 48
    assert buf.host_ptr % 4096 == 0 and not buf.tensor.any()
    assert not buf.registered and buf.device_ptr is None
    with pytest.raises(RuntimeError, match="registered"):
        buf.cuda_view(torch.float16)
    with pytest.raises(ValueError, match="positive"):
        PinnedHostBuffer(0)


def test_host_buffer_registers_exact_range_and_unregisters_once(fake_cuda):
    buf = PinnedHostBuffer(5 * 1000, torch.device("cuda", 0))
    assert fake_cuda.calls == [("register", buf.host_ptr, 5000, 0x03)]  # portable | mapped
    assert buf.registered and buf.uva and buf.device_ptr == buf.host_ptr
    buf.close()
    buf.close()
    assert fake_cuda.calls[1:] == [("unregister", buf.host_ptr)]
    assert not buf.registered


def test_host_buffer_unregisters_when_collected(fake_cuda):
    buf = PinnedHostBuffer(4096, torch.device("cuda", 0))
    ptr = buf.host_ptr
    del buf
    gc.collect()
    assert fake_cuda.calls[-1] == ("unregister", ptr)


def test_host_buffer_registration_failures(fake_cuda, monkeypatch):
    from cuda.bindings import runtime as rt

    fake_cuda.register_code = 2  # cudaErrorMemoryAllocation
    with pytest.raises(RuntimeError, match="cudaHostRegister of 4096 bytes .* CUDA error 2"):
        PinnedHostBuffer(4096, torch.device("cuda", 0))
    assert [c[0] for c in fake_cuda.calls] == ["register"]
    fake_cuda.register_code = 0
    failure = (rt.cudaError_t.cudaErrorInvalidValue, None)
    monkeypatch.setattr(rt, "cudaHostGetDevicePointer", lambda ptr, flags: failure)
    with pytest.raises(RuntimeError, match="cudaHostGetDevicePointer"):
        PinnedHostBuffer(4096, torch.device("cuda", 0))
    assert [c[0] for c in fake_cuda.calls] == ["register", "register", "unregister"]  # rolled back
    with pytest.raises(ValueError, match="CUDA device"):
        PinnedHostBuffer(4096, torch.device("cpu"))


# ---- sequences, writes, reads ------------------------------------------------------------------
def test_extend_write_read_across_pages(randn):
    cache = make_cache()
    s = cache.add_sequence()
    assert cache.seq_len(s) == 0 and cache.page_table(s) == []
    assert cache.extend(s, 5) == 0
    assert cache.extend(s, 30) == 5  # 35 tokens -> 3 pages, handed out in order
    assert cache.seq_len(s) == 35 and cache.page_table(s) == [0, 1, 2]
    assert cache.extend(s, 0) == 35 and cache.free_pages("host") == 5
    k, v = randn(35, H, D), randn(35, H, D)
    cache.write(s, 0, 0, k[:13], v[:13])
    cache.write(s, 0, 13, k[13:], v[13:])  # crosses the page boundaries at 16 and 32
    rk, rv = cache.read(s, 0)
    assert torch.equal(rk, k) and torch.equal(rv, v)
    rk, rv = cache.read(s, 0, 10, 20)
    assert torch.equal(rk, k[10:20]) and torch.equal(rv, v[10:20])
    assert cache.read(s, 0, 7, 7)[0].shape == (0, H, D)


def test_append_all_layers_and_hbm_tier(randn):
    cache = make_cache()
    s = cache.add_sequence()
    k1, v1 = fill(cache, s, 20, randn)
    k2, v2 = fill(cache, s, 30, randn, tier="hbm")  # fills page 1 (host), then 2 HBM pages
    assert cache.page_table(s) == [0, 1, -1, -2]
    assert cache.page_counts(s) == {"host": 2, "hbm": 2}
    k, v = torch.cat([k1, k2]), torch.cat([v1, v2])
    rk, rv = cache.read(s, None)
    assert torch.equal(rk, k) and torch.equal(rv, v)
    for layer in range(L):
        rk, rv = cache.read(s, layer, 3, 45)  # mixed tiers in one gather
        assert torch.equal(rk, k[3:45, layer]) and torch.equal(rv, v[3:45, layer])
    assert torch.equal(cache.hbm_pool[1, 1, :, 0, 1], k[49, 1])  # token 49 = HBM page 1, row 1


def test_page_encoding_roundtrip():
    assert encode_page("host", 0) == 0 and encode_page("host", 7) == 7
    assert encode_page("hbm", 0) == -1 and encode_page("hbm", 7) == -8
    for tier in ("host", "hbm"):
        for i in (0, 1, 1000):
            assert decode_page(encode_page(tier, i)) == (tier, i)


# ---- fork and copy-on-write ----------------------------------------------------------------------
def test_fork_shares_full_pages_and_copies_partial_page_at_once(randn):
    cache = make_cache()
    a = cache.add_sequence()
    k, v = fill(cache, a, 40, randn)  # pages 0, 1 full; page 2 holds 8 tokens
    b = cache.fork(a)
    ta, tb = cache.page_table(a), cache.page_table(b)
    assert tb[:2] == ta[:2] and tb[2] != ta[2]
    refs = cache.state().refcounts["host"]
    assert refs[ta[0]] == refs[ta[1]] == 2 and refs[ta[2]] == refs[tb[2]] == 1
    assert torch.equal(cache.host_pool[tb[2]], cache.host_pool[ta[2]])  # whole page copied
    assert cache.seq_len(b) == 40
    # The fork diverges: appends go to private pages.
    kb, vb = fill(cache, b, 5, randn)
    ka, va = fill(cache, a, 3, randn)
    assert torch.equal(cache.read(a, None)[0], torch.cat([k, ka]))
    assert torch.equal(cache.read(b, None)[0], torch.cat([k, kb]))
    assert torch.equal(cache.read(b, None)[1], torch.cat([v, vb]))


def test_fork_at_a_prefix_shares_its_pages_only(randn):
    cache = make_cache()
    a = cache.add_sequence()
    k, v = fill(cache, a, 40, randn)  # pages 0, 1 full; page 2 partial
    free = cache.free_pages("host")
    b = cache.fork(a, 16)
    assert cache.seq_len(b) == 16 and cache.page_table(b) == cache.page_table(a)[:1]
    assert cache.free_pages("host") == free, "a prefix fork copies nothing"
    refs = cache.state().refcounts["host"]
    assert refs[cache.page_table(a)[0]] == 2 and refs[cache.page_table(a)[1]] == 1
    kb, vb = fill(cache, b, 20, randn)
    assert torch.equal(cache.read(b, None)[0], torch.cat([k[:16], kb]))
    assert torch.equal(cache.read(a, None)[0], k) and torch.equal(cache.read(a, None)[1], v)
    assert cache.fork(a, 0) is not None
    for bad in (8, 48, -16):
        with pytest.raises(ValueError):
            cache.fork(a, bad)
    cache.free(b)
    assert cache.state().refcounts["host"][cache.page_table(a)[0]] == 1


def test_write_into_shared_page_copies_it_first(randn):
    cache = make_cache()
    a = cache.add_sequence()
    k, v = fill(cache, a, 32, randn)  # two full pages: the fork shares both
    b = cache.fork(a)
    assert cache.page_table(a) == cache.page_table(b) == [0, 1]
    nk, nv = randn(3, H, D), randn(3, H, D)
    cache.write(b, 1, 17, nk, nv)  # page 1 only
    assert cache.page_table(a) == [0, 1] and cache.page_table(b) == [0, 2]
    refs = cache.state().refcounts["host"]
    assert refs[:3] == (2, 1, 1)
    expect_k = k[:, 1].clone()
    expect_k[17:20] = nk
    assert torch.equal(cache.read(b, 1)[0], expect_k)
    assert torch.equal(cache.read(b, 0)[0], k[:, 0])  # other layers copied with the page
    assert torch.equal(cache.read(a, 1)[0], k[:, 1]) and torch.equal(cache.read(a, 1)[1], v[:, 1])
    # Now private: a second write does not copy again.
    cache.write(b, 1, 16, nk[:1], nv[:1])
    assert cache.page_table(b) == [0, 2] and cache.free_pages("host") == 5


def test_fork_of_empty_and_free_returns_pages(randn):
    cache = make_cache()
    a = cache.add_sequence()
    e = cache.fork(a)
    assert cache.seq_len(e) == 0 and cache.page_table(e) == []
    k, v = fill(cache, a, 20, randn)
    b = cache.fork(a)
    assert cache.free_pages("host") == 5
    cache.free(a)
    assert cache.free_pages("host") == 6  # a's private partial page; page 0 is still b's
    assert torch.equal(cache.read(b, None)[0], k)
    cache.free(b)
    assert cache.free_pages("host") == 8 and cache.state().refcounts["host"] == (0,) * 8
    with pytest.raises(UnknownSequenceError):
        cache.seq_len(a)
    assert cache.seq_ids == [e]


# ---- capacity ------------------------------------------------------------------------------------
def test_capacity_errors_leave_the_cache_unchanged(randn):
    cache = make_cache(host=4, hbm=1)
    a = cache.add_sequence()
    fill(cache, a, 40, randn)  # 3 host pages
    b = cache.fork(a)  # takes the 4th (copy of the partial page)
    before = snapshot(cache)
    with pytest.raises(CacheCapacityError, match="1 host pages needed, 0 free"):
        cache.extend(a, 9)
    assert_unchanged(cache, before)
    cache.extend(a, 8)  # fills the partial page without a new one
    before = snapshot(cache)
    with pytest.raises(CacheCapacityError):
        cache.append(b, randn(30, L, H, D), randn(30, L, H, D))
    assert_unchanged(cache, before)
    with pytest.raises(CacheCapacityError, match="copy-on-write"):
        cache.write(b, 0, 0, randn(1, H, D), randn(1, H, D))  # page 0 is shared with a
    assert_unchanged(cache, before)
    with pytest.raises(CacheCapacityError, match="hbm"):
        cache.move_pages(a, [0, 1], "hbm")
    assert_unchanged(cache, before)
    with pytest.raises(CacheCapacityError, match="set_hbm_fraction"):
        cache.set_hbm_fraction(b, 1.0)
    assert_unchanged(cache, before)
    c = cache.fork(b)  # the host tier is full: the copy of b's partial page takes the free HBM page
    assert cache.page_table(c)[-1] < 0 and cache.free_pages("hbm") == 0
    assert all(torch.equal(x, y) for x, y in zip(cache.read(c, None), cache.read(b, None)))
    before = snapshot(cache)
    with pytest.raises(CacheCapacityError, match="fork"):
        cache.fork(b)  # both tiers full
    assert_unchanged(cache, before)
    assert isinstance(CacheCapacityError("x"), ValueError)


def test_bad_input_to_append_changes_nothing(randn):
    cache = make_cache()
    a = cache.add_sequence()
    fill(cache, a, 10, randn)
    before = snapshot(cache)
    with pytest.raises(ValueError):
        cache.append(a, randn(5, L, H, D), randn(6, L, H, D))
    with pytest.raises(TypeError):
        cache.append(a, randn(5, L, H, D, dtype=torch.float16), randn(5, L, H, D, dtype=torch.float16))
    assert_unchanged(cache, before)


# ---- validation -----------------------------------------------------------------------------------
def test_validation_messages(randn):
    cache = make_cache()
    s = cache.add_sequence()
    cache.extend(s, 10)
    k, v = randn(4, H, D), randn(4, H, D)
    with pytest.raises(TypeError, match="dtype torch.float16"):
        cache.write(s, 0, 0, k.half(), v.half())
    with pytest.raises(ValueError, match=r"expected \(n, num_kv_heads, head_dim\)"):
        cache.write(s, 0, 0, randn(4, H + 1, D), randn(4, H + 1, D))
    with pytest.raises(ValueError, match="differ in shape"):
        cache.write(s, 0, 0, k, v[:3])
    with pytest.raises(ValueError, match="is on meta"):
        cache.write(s, 0, 0, k.to("meta"), v.to("meta"))
    with pytest.raises(TypeError, match="torch.Tensor"):
        cache.write(s, 0, 0, k.tolist(), v)
    with pytest.raises(ValueError, match="past the end"):
        cache.write(s, 0, 8, k, v)
    with pytest.raises(IndexError, match="layer 2 out of range"):
        cache.write(s, 2, 0, k, v)
    with pytest.raises(ValueError, match="layer"):
        cache.write(s, -1, 0, k, v)
    with pytest.raises(UnknownSequenceError, match="unknown sequence id 99") as info:
        cache.write(99, 0, 0, k, v)
    assert isinstance(info.value, KeyError)
    with pytest.raises(TypeError, match="seq_id"):
        cache.seq_len("0")
    with pytest.raises(TypeError, match="seq_id"):
        cache.seq_len(True)
    with pytest.raises(ValueError, match="tier"):
        cache.extend(s, 1, tier="disk")
    with pytest.raises(ValueError, match="n must be >= 0"):
        cache.extend(s, -1)
    with pytest.raises(ValueError, match="read range"):
        cache.read(s, 0, 5, 11)
    with pytest.raises(IndexError, match="logical page 1"):
        cache.move_pages(s, [1], "hbm")
    with pytest.raises(TypeError, match="iterable"):
        cache.move_pages(s, 0, "hbm")
    with pytest.raises(ValueError, match="fraction"):
        cache.set_hbm_fraction(s, 1.5)
    with pytest.raises(ValueError, match="placement"):
        cache.set_hbm_fraction(s, 0.5, placement="random")
    with pytest.raises(ValueError, match="num_layers, num_kv_heads"):
        cache.append(s, randn(2, H, D), randn(2, H, D))  # per-layer shape given to append


def test_closed_cache_refuses_work():
    with make_cache() as cache:
        s = cache.add_sequence()
    with pytest.raises(RuntimeError, match="closed"):
        cache.extend(s, 1)
    with pytest.raises(RuntimeError, match="closed"):
        cache.add_sequence()


# ---- tier moves ------------------------------------------------------------------------------------
def test_move_pages_copies_data_and_frees_old_pages(randn):
    cache = make_cache()
    s = cache.add_sequence()
    k, v = fill(cache, s, 50, randn)  # pages 0..3
    cache.move_pages(s, [1, 3, 3], "hbm")
    assert cache.page_table(s) == [0, -1, 2, -2]
    assert cache.free_pages("host") == 6 and cache.free_pages("hbm") == 2
    assert cache.state().free_lists["host"][-2:] == (1, 3)  # freed pages are reused next
    rk, rv = cache.read(s, None)
    assert torch.equal(rk, k) and torch.equal(rv, v)
    cache.move_pages(s, [0, 1], "hbm")  # page 1 is already there
    assert cache.page_table(s) == [-3, -1, 2, -2]
    cache.move_pages(s, range(4), "host")
    assert cache.page_counts(s) == {"host": 4, "hbm": 0} and cache.free_pages("hbm") == 4
    rk, rv = cache.read(s, None)
    assert torch.equal(rk, k) and torch.equal(rv, v)
    kt = cache.kernel_tables([s])  # the cached table follows the moves
    assert kt.page_table.tolist() == [cache.page_table(s)]


def test_moving_a_shared_page_moves_it_for_every_sharer(randn):
    cache = make_cache()
    a = cache.add_sequence()
    k, v = fill(cache, a, 40, randn)
    b = cache.fork(a)
    c = cache.fork(b)
    cache.move_pages(b, [0, 2], "hbm")  # page 0 is shared by a, b, c; page 2 is b's own
    assert cache.page_table(a)[0] == cache.page_table(b)[0] == cache.page_table(c)[0] == -1
    assert cache.page_table(b)[2] == -2 and cache.page_table(a)[2] >= 0 and cache.page_table(c)[2] >= 0
    assert cache.state().refcounts["hbm"][:2] == (3, 1)
    assert cache.state().refcounts["host"][0] == 0 and 0 in cache.state().free_lists["host"]
    for s in (a, b, c):
        rk, rv = cache.read(s, None)
        assert torch.equal(rk, k) and torch.equal(rv, v)


@pytest.mark.parametrize("placement", ["recent", "strided"])
def test_set_hbm_fraction(randn, placement):
    cache = make_cache(host=12, hbm=12)
    s = cache.add_sequence()
    k, v = fill(cache, s, 10 * P - 3, randn)  # 10 pages
    for fraction, n_hbm in [(0.3, 3), (0.55, 6), (1.0, 10), (0.0, 0), (0.25, 3)]:
        cache.set_hbm_fraction(s, fraction, placement)
        hbm = [e < 0 for e in cache.page_table(s)]
        assert sum(hbm) == n_hbm
        if placement == "recent":
            assert hbm == [False] * (10 - n_hbm) + [True] * n_hbm
        else:  # evenly spread: gaps between HBM pages differ by at most one
            pos = [i for i, h in enumerate(hbm) if h]
            gaps = np.diff(pos)
            assert len(gaps) == 0 or gaps.max() - gaps.min() <= 1
        assert cache.page_counts(s) == {"host": 10 - n_hbm, "hbm": n_hbm}
        rk, rv = cache.read(s, None)
        assert torch.equal(rk, k) and torch.equal(rv, v)
    assert cache.free_pages("host") + cache.free_pages("hbm") == 14


# ---- kernel tables ---------------------------------------------------------------------------------
def test_kernel_tables_encoding_and_padding(randn):
    cache = make_cache(host=12, hbm=6)
    a, b, c = cache.add_sequence(), cache.add_sequence(), cache.add_sequence()
    fill(cache, a, 70, randn)  # 5 pages
    fill(cache, b, 3, randn)  # 1 page
    fill(cache, c, 33, randn, tier="hbm")  # 3 HBM pages
    cache.move_pages(a, [1, 4], "hbm")
    tables = cache.kernel_tables([b, a, c, b])
    assert isinstance(tables, KernelTables) and not tables.back_to_back
    assert cache.kernel_tables([b], back_to_back=True).back_to_back
    pt, lens = tables.page_table, tables.seq_lens
    assert pt.dtype == torch.int32 and lens.dtype == torch.int32
    assert pt.shape == (4, 5) and pt.is_contiguous() and lens.is_contiguous()
    assert lens.tolist() == [3, 70, 33, 3]
    ta, tb, tc = cache.page_table(a), cache.page_table(b), cache.page_table(c)
    assert (ta, tb, tc) == ([0, -4, 2, 3, -5], [5], [-1, -2, -3])
    assert pt.tolist() == [tb * 5, ta, tc + [tc[-1]] * 2, tb * 5]
    assert tables.is_hbm.tolist()[2] == [True] * 5
    assert tables.is_hbm.tolist()[1] == [e < 0 for e in ta]
    assert tables.num_pages(P).tolist() == [1, 5, 3, 1]
    assert cache.page_hbm([a, b]) == [[e < 0 for e in ta], [False]]
    # Decoding every entry lands on a page that holds the sequence's data.
    for row, s in zip(pt.tolist(), [b, a, c, b]):
        for lp, e in enumerate(row[: math.ceil(cache.seq_len(s) / P)]):
            tier, index = decode_page(e)
            pool = cache.host_pool if tier == "host" else cache.hbm_pool
            assert torch.equal(pool[index, 0, :, 0, 0], cache.read(s, 0, lp * P, lp * P + 1)[0][0])


def test_kernel_tables_errors():
    cache = make_cache()
    s, e = cache.add_sequence(), cache.add_sequence()
    cache.extend(s, 3)
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        cache.kernel_tables([s, e])
    with pytest.raises(ValueError, match="non-empty"):
        cache.kernel_tables([])
    with pytest.raises(ValueError, match="non-empty"):
        cache.kernel_tables(s)
    with pytest.raises(UnknownSequenceError):
        cache.kernel_tables([s, 7])


# ---- random operation sequences ----------------------------------------------------------------
TIER = st.sampled_from(["host", "hbm"])


class CacheMachine(RuleBasedStateMachine):
    """Random add/extend/append/write/fork/free/move/placement against a dense model.

    The model keeps, per sequence, a float32 (len, L, H, 2, D) array of what was written, NaN
    where a reserved token was never written. Capacity errors must leave the cache unchanged.
    """

    def __init__(self) -> None:
        super().__init__()
        self.cache = PagedKVCache(L, H, D, P, 16, 8, dtype=torch.float16, device="cpu")
        self.model: dict[int, torch.Tensor] = {}

    # ---- helpers ------------------------------------------------------------------------------
    def pick(self, data, nonempty: bool = False) -> int:
        ids = sorted(s for s, m in self.model.items() if len(m) or not nonempty)
        return data.draw(st.sampled_from(ids), label="seq")

    def attempt(self, name: str, op, short: bool | None = None) -> bool:
        """Run op; on CacheCapacityError check nothing changed. ``short``: predicted shortage."""
        before = snapshot(self.cache)
        try:
            op()
        except CacheCapacityError:
            event(f"{name}: capacity error")
            assert short is not False, "capacity error although there were enough free pages"
            assert_unchanged(self.cache, before)
            return False
        assert short is not True, "no capacity error although pages were short"
        return True

    def short(self, needs: dict[str, int]) -> bool:
        return any(n > self.cache.free_pages(t) for t, n in needs.items())

    def new_pages(self, seq: int, n: int) -> int:
        length = len(self.model[seq])
        return math.ceil((length + n) / P) - math.ceil(length / P)

    def refs(self, entry: int) -> int:
        return sum(t.count(entry) for t in self.cache.state().page_tables.values())

    @staticmethod
    def data_tensor(data, shape) -> torch.Tensor:
        seed = data.draw(st.integers(0, 2**31 - 1), label="data seed")
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).half()

    # ---- rules ----------------------------------------------------------------------------------
    @initialize(n=st.integers(1, 3))
    def start(self, n) -> None:
        for _ in range(n):
            self.add()

    @precondition(lambda self: len(self.model) < 6)
    @rule()
    def add(self) -> None:
        self.model[self.cache.add_sequence()] = torch.empty(0, L, H, 2, D)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), n=st.integers(0, 24), tier=TIER)
    def extend(self, data, n, tier) -> None:
        s = self.pick(data)
        length = len(self.model[s])
        if self.attempt("extend", lambda: self.cache.extend(s, n, tier), self.short({tier: self.new_pages(s, n)})):
            self.model[s] = torch.cat([self.model[s], torch.full((n, L, H, 2, D), math.nan)])
            assert self.cache.seq_len(s) == length + n

    @precondition(lambda self: self.model)
    @rule(data=st.data(), n=st.integers(1, 24), tier=TIER)
    def append(self, data, n, tier) -> None:
        s = self.pick(data)
        k, v = self.data_tensor(data, (n, L, H, D)), self.data_tensor(data, (n, L, H, D))
        short = self.short({tier: self.new_pages(s, n)})
        if self.attempt("append", lambda: self.cache.append(s, k, v, tier), short):
            self.model[s] = torch.cat([self.model[s], torch.stack([k, v], dim=3).float()])

    @precondition(lambda self: any(len(m) for m in self.model.values()))
    @rule(data=st.data())
    def write(self, data) -> None:
        s = self.pick(data, nonempty=True)
        length = len(self.model[s])
        table = self.cache.page_table(s)
        # Half of the time, aim at a page shared with a fork to exercise copy-on-write.
        shared = [lp for lp, e in enumerate(table) if self.refs(e) > 1]
        if shared and data.draw(st.booleans(), label="hit shared page"):
            start = data.draw(st.sampled_from(shared), label="shared page") * P
        else:
            start = data.draw(st.integers(0, length - 1), label="start")
        n = data.draw(st.integers(1, min(length - start, 40)), label="n")
        layer = data.draw(st.integers(0, L - 1), label="layer")
        k, v = self.data_tensor(data, (n, H, D)), self.data_tensor(data, (n, H, D))
        needs: dict[str, int] = {}
        for lp in range(start // P, (start + n - 1) // P + 1):
            if self.refs(table[lp]) > 1:
                tier = decode_page(table[lp])[0]
                needs[tier] = needs.get(tier, 0) + 1
        if needs:
            event("write: copy-on-write")
        if self.attempt("write", lambda: self.cache.write(s, layer, start, k, v), self.short(needs)):
            self.model[s][start : start + n, layer] = torch.stack([k, v], dim=2).float()

    @precondition(lambda self: self.model and len(self.model) < 6)
    @rule(data=st.data())
    def fork(self, data) -> None:
        s = self.pick(data)
        table = self.cache.page_table(s)
        # The copy of a partial last page goes to its own tier, or the other when that one is full.
        short = bool(len(self.model[s]) % P) and not (self.cache.free_pages("host") + self.cache.free_pages("hbm"))
        child: list[int] = []
        if self.attempt("fork", lambda: child.append(self.cache.fork(s)), short):
            event("fork")
            self.model[child[0]] = self.model[s].clone()
            assert self.cache.page_table(child[0])[: len(self.model[s]) // P] == table[: len(self.model[s]) // P]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data) -> None:
        s = self.pick(data)
        self.cache.free(s)
        del self.model[s]

    @precondition(lambda self: any(len(m) for m in self.model.values()))
    @rule(data=st.data(), tier=TIER)
    def move(self, data, tier) -> None:
        s = self.pick(data, nonempty=True)
        table = self.cache.page_table(s)
        lps = data.draw(st.lists(st.integers(0, len(table) - 1), max_size=6), label="pages")
        moving = {table[lp] for lp in lps if decode_page(table[lp])[0] != tier}
        if any(self.refs(e) > 1 for e in moving):
            event("move: shared page")
        self.attempt("move", lambda: self.cache.move_pages(s, lps, tier), self.short({tier: len(moving)}))

    @precondition(lambda self: any(len(m) for m in self.model.values()))
    @rule(data=st.data(), fraction=st.floats(0, 1), placement=st.sampled_from(["recent", "strided"]))
    def hbm_fraction(self, data, fraction, placement) -> None:
        s = self.pick(data, nonempty=True)
        if self.attempt("hbm_fraction", lambda: self.cache.set_hbm_fraction(s, fraction, placement)):
            n = len(self.cache.page_table(s))
            assert self.cache.page_counts(s)["hbm"] == math.floor(fraction * n + 0.5)

    # ---- invariants -----------------------------------------------------------------------------
    @invariant()
    def bookkeeping(self) -> None:
        state = self.cache.state()
        assert state.seq_lens == {s: len(m) for s, m in self.model.items()}
        for tier in ("host", "hbm"):
            counts = [0] * self.cache.num_pages(tier)
            for table in state.page_tables.values():
                for entry in table:
                    t, index = decode_page(entry)
                    if t == tier:
                        counts[index] += 1
            assert tuple(counts) == state.refcounts[tier]
            free = state.free_lists[tier]
            assert len(set(free)) == len(free)
            used = {i for i, c in enumerate(counts) if c}
            assert used.isdisjoint(free)
            assert used | set(free) == set(range(self.cache.num_pages(tier)))
            assert self.cache.free_pages(tier) == len(free)
        for s, table in state.page_tables.items():
            assert len(table) == math.ceil(state.seq_lens[s] / P)
            assert len(set(table)) == len(table)
            if state.seq_lens[s] % P:  # the partial last page is private
                assert self.refs(table[-1]) == 1

    @invariant()
    def data_reads_back(self) -> None:
        for s, expect in self.model.items():
            k, v = self.cache.read(s, None)  # (n, L, H, D) each
            got = torch.stack([k, v], dim=3).float()
            written = ~expect.isnan()
            assert torch.equal(got[written], expect[written])


CacheMachine.TestCase.settings = settings(
    max_examples=50,  # x up to 40 steps: 2000 random operations a run
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCacheMachine = CacheMachine.TestCase


def test_token_slots_write_a_batch_across_tiers(randn):
    cache = PagedKVCache(2, 2, 64, 16, num_host_pages=20, num_hbm_pages=6, device="cpu")
    ids = [cache.add_sequence() for _ in range(3)]
    for sid, n in zip(ids, (40, 7, 0)):
        if n:
            cache.append(sid, randn(n, 2, 2, 64), randn(n, 2, 2, 64))
    cache.set_hbm_fraction(ids[0], 0.5, "strided")
    counts = (30, 20, 17)
    starts = [cache.extend(sid, n, tier) for sid, n, tier in zip(ids, counts, ("host", "hbm", "host"))]
    slots = cache.token_slots(ids, starts, counts)
    k, v = randn(sum(counts), 2, 64), randn(sum(counts), 2, 64)
    cache.write_slots(slots, 1, k, v)
    at = 0
    for sid, start, n in zip(ids, starts, counts):
        rk, rv = cache.read(sid, 1, start, start + n)
        assert torch.equal(rk, k[at : at + n]) and torch.equal(rv, v[at : at + n])
        at += n
    with pytest.raises(ValueError, match="slots"):
        cache.write_slots(slots, 0, k[:-1], v[:-1])
    with pytest.raises(ValueError, match="past the end"):
        cache.token_slots(ids[:1], [starts[0]], [counts[0] + 1])


def test_token_slots_copy_shared_pages_first(randn):
    cache = PagedKVCache(1, 1, 64, 16, num_host_pages=8, device="cpu")
    a = cache.add_sequence()
    k0, v0 = randn(32, 1, 1, 64), randn(32, 1, 1, 64)
    cache.append(a, k0, v0)
    b = cache.fork(a)  # pages 0-1 shared
    slots = cache.token_slots([b], [16], [4])
    assert cache.page_table(b)[1] != cache.page_table(a)[1]
    cache.write_slots(slots, 0, randn(4, 1, 64), randn(4, 1, 64))
    assert torch.equal(cache.read(a, 0)[0], k0[:, 0])  # the sharer never sees the write


def test_truncate_releases_pages_and_keeps_the_last_page_private(randn):
    cache = PagedKVCache(1, 1, 64, 16, num_host_pages=8, device="cpu")
    a = cache.add_sequence()
    k, v = randn(50, 1, 1, 64), randn(50, 1, 1, 64)
    cache.append(a, k, v)
    b = cache.fork(a)
    free = cache.free_pages("host")
    cache.truncate(b, 20)  # pages 2-3 go (page 2 shared: refcount drops; 3 private: freed), page 1 copied
    assert cache.seq_len(b) == 20 and len(cache.page_table(b)) == 2
    assert cache.page_table(b)[1] != cache.page_table(a)[1]
    assert cache.free_pages("host") == free + 1 - 1  # the private last page freed, one copy made
    assert torch.equal(cache.read(b, 0)[0], k[:20, 0]) and torch.equal(cache.read(a, 0)[0], k[:, 0])
    with pytest.raises(ValueError, match="only"):
        cache.truncate(b, 21)
    cache.truncate(b, 0)
    assert cache.page_table(b) == [] and cache.seq_len(b) == 0


def test_gpu_head_dims_are_named_at_construction():
    with pytest.raises(ValueError, match=r"head dims \(64, 128\)"):
        PagedKVCache(2, 2, 96, 16, num_host_pages=4, device="cuda")
    PagedKVCache(2, 2, 96, 16, num_host_pages=4, device="cpu").close()  # the reference takes it


def test_host_allocation_failure_names_the_bytes(monkeypatch):
    import directkv_cute.cache.pools as cache_mod

    def fail(nbytes, device):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(cache_mod, "PinnedHostBuffer", fail)
    with pytest.raises(MemoryError, match=r"\d+ bytes \(.* GiB\)"):
        PagedKVCache(2, 2, 64, 16, num_host_pages=1000, device="cpu")


def test_appends_never_join_autograd(randn):
    cache = PagedKVCache(2, 2, 64, 16, num_host_pages=4, device="cpu")
    sid = cache.add_sequence()
    k = randn(5, 2, 2, 64).requires_grad_()
    cache.append(sid, k * 2, k * 3)
    assert not cache.host_pool.requires_grad and cache.host_pool.grad_fn is None
    assert torch.equal(cache.read(sid, 0)[0], (k * 2).detach()[:, 0])


def test_failed_append_leaves_the_cache_unchanged(randn):
    cache = PagedKVCache(2, 2, 64, 16, num_host_pages=8, device="cpu")
    sid = cache.add_sequence()
    cache.append(sid, randn(20, 2, 2, 64), randn(20, 2, 2, 64))
    before = cache.state()
    sparse = randn(30, 2, 2, 64).to_sparse()
    with pytest.raises(TypeError, match="dense"):
        cache.append(sid, sparse, sparse)
    assert cache.state() == before

    def boom(*args, **kwargs):
        raise RuntimeError("store failed")

    cache._store = boom
    with pytest.raises(RuntimeError, match="store failed"):
        cache.append(sid, randn(30, 2, 2, 64), randn(30, 2, 2, 64))
    assert cache.state() == before


def test_stale_and_foreign_tables_are_refused(randn):
    cache = PagedKVCache(1, 1, 64, 16, num_host_pages=8, device="cpu")
    other = PagedKVCache(1, 1, 64, 16, num_host_pages=8, device="cpu")
    a, b = cache.add_sequence(), cache.add_sequence()
    for s in (a, b):
        cache.append(s, randn(20, 1, 1, 64), randn(20, 1, 1, 64))
    t = cache.kernel_tables([a])
    cache.check_tables(t)
    cache.extend(a, 5)  # growth keeps existing pages: still valid
    cache.check_tables(t)
    from directkv_cute.cache import KernelTables, StaleTablesError

    cache.free(b)
    with pytest.raises(StaleTablesError, match="stale"):
        cache.check_tables(t)
    with pytest.raises(StaleTablesError, match="another cache"):
        other.check_tables(cache.kernel_tables([a]))
    with pytest.raises(StaleTablesError, match="another cache"):
        cache.check_tables(KernelTables(t.page_table, t.seq_lens))


def test_concurrent_extend_and_free_never_leak_pages(randn):
    import threading

    cache = PagedKVCache(1, 1, 64, 16, num_host_pages=16, device="cpu")
    errors = []

    def worker(seed):
        import random

        rng = random.Random(seed)
        for _ in range(300):
            sid = cache.add_sequence()
            try:
                for _ in range(rng.randint(1, 3)):
                    cache.extend(sid, rng.randint(1, 40))
            except dk_CacheCapacityError:
                pass
            except Exception as exc:  # noqa: BLE001 - any other error is the bug under test
                errors.append(exc)
            finally:
                cache.free(sid)

    from directkv_cute.cache import CacheCapacityError as dk_CacheCapacityError

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert cache.free_pages("host") == 16 and cache.seq_ids == []
    assert sorted(cache.state().free_lists["host"]) == list(range(16))


def test_for_model_sizes_the_cache_in_bytes():
    from types import SimpleNamespace

    cfg = SimpleNamespace(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096)
    cache = PagedKVCache.for_model(cfg, host_bytes=64 * 2**20 + 5, hbm_bytes=0, page_size=16, device="cpu")
    assert cache.page_bytes == 2 * 32 * 8 * 16 * 128 * 2 == 2**21
    assert (cache.num_pages("host"), cache.num_pages("hbm")) == (32, 0)
    assert (cache.num_layers, cache.num_kv_heads, cache.head_dim) == (32, 8, 128)
    with pytest.raises(ValueError, match="holds no page"):
        PagedKVCache.for_model(cfg, host_bytes=1000, device="cpu")


# ---- the page book alone: bookkeeping and the copies it asks for, no tensors -------------------
def test_page_book_asks_for_exactly_the_copies_that_keep_sharers_apart():
    from directkv_cute.cache import PageBook

    copies = []
    book = PageBook({"host": 8, "hbm": 2}, 16, copy_page=lambda src, dst: copies.append((src, dst)))
    a = book.add_sequence()
    book.extend(a, 40)  # pages 0, 1, 2 (8 tokens in the last)
    b = book.fork(a)
    assert copies == [(2, 3)]  # the partial last page only
    assert book.seq(b).pages == [0, 1, 3] and book.refs["host"].tolist()[:4] == [2, 2, 1, 1]
    copies.clear()
    book.unshare_range(b, 20, 21)  # a write into shared page 1
    assert copies == [(1, 4)] and book.seq(b).pages == [0, 4, 3] and book.seq(a).pages == [0, 1, 2]
    copies.clear()
    book.move_pages(a, [0], "hbm")  # shared page 0 moves for both sharers
    assert copies == [(0, encode_page("hbm", 0))]
    assert book.seq(a).pages[0] == book.seq(b).pages[0] == encode_page("hbm", 0)
    before, generation = book.state(), book.generation
    copies.clear()
    with pytest.raises(CacheCapacityError, match="unchanged"):
        book.extend(a, 16 * 8)
    with pytest.raises(CacheCapacityError, match="unchanged"):
        book.move_pages(b, [1, 2], "hbm")  # one HBM page left
    assert book.state() == before and book.generation == generation and copies == []


def test_cache_and_book_agree_on_every_table_change():
    """The cache's bookkeeping is its book's: a cache run and a bare book run of the same
    operations end in the same state."""
    from directkv_cute.cache import PageBook

    cache = make_cache(host=8, hbm=4)
    book = PageBook({"host": 8, "hbm": 4}, P)
    for c in (cache, book):
        s = c.add_sequence()
        c.extend(s, 37)
        f = c.fork(s)
        c.extend(f, 20, "hbm")
        c.set_hbm_fraction(s, 0.5, "strided")
        c.truncate(f, 17)
    assert cache.state() == book.state()


def test_host_kernel_table_names_a_private_pages_mirror_and_a_shared_pages_host_copy():
    from directkv_cute.cache import PageBook
    from directkv_cute.cache.tables import host_kernel_table

    book = PageBook({"host": 8, "hbm": 1}, 16, num_window_pages=4)
    a = book.add_sequence()
    book.extend(a, 40)  # host pages 0, 1, 2
    assert book.mirror(a, 20, 20) == 2  # logical pages 1 and 2 get window pages 1 and 2 (after the tier's 1)
    b = book.fork(a, 32)  # shares host pages 0 and 1
    book.extend(b, 1)  # host page 3
    packed, table = host_kernel_table(book, [book.seq(a), book.seq(b)])
    # a: page 1 is shared with b, so it is read from the host; page 2 is private, read from its mirror
    assert table.tolist() == [[0, 1, encode_page("hbm", 2)], [0, 1, 3]]
    assert packed[table.size:].tolist() == [40, 33]
    book.truncate(b, 16)  # page 1 private again: a reads its mirror
    packed, table = host_kernel_table(book, [book.seq(a), book.seq(b)])
    assert table.tolist() == [[0, encode_page("hbm", 1), encode_page("hbm", 2)], [0, 0, 0]]
