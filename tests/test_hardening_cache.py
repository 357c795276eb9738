"""Refusals of the paged KV cache a hostile caller meets on the CPU path: stale token slots,
mirrors and kernel tables that would name bytes nobody wrote, absurd sizes and loose arguments.
Each refusal is a clear error raised before anything is written; the cache is unchanged."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from directkv_cute.cache import KernelTables, PagedKVCache, StaleTablesError, TokenSlots
from directkv_cute.cache.tables import check_kernel_tables
from cache_reads import read_through_tables

L, H, D, P = 2, 2, 8, 16


def make(host: int = 8, hbm: int = 2, window: int = 0) -> PagedKVCache:
    return PagedKVCache(L, H, D, P, host, hbm, dtype=torch.float32, device="cpu", num_window_pages=window)


def rand(n: int, seed: int, layers: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (n, L, H, D) if layers else (n, H, D)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


# ---- token slots carry the cache's identity and slot generation ------------------------------
def test_slots_taken_before_a_free_cannot_overwrite_the_next_owner_of_the_page():
    cache = make()
    a = cache.add_sequence()
    cache.append(a, *rand(P, 0))
    slots = cache.token_slots([a], [0], [P])
    cache.free(a)
    b = cache.add_sequence()
    kb, vb = rand(P, 1)
    cache.append(b, kb, vb)  # takes a's page
    k, v = rand(P, 2, layers=False)
    with pytest.raises(StaleTablesError, match="stale token slots"):
        cache.write_slots(slots, 0, k, v)
    got_k, got_v = cache.read(b, None)
    assert torch.equal(got_k, kb) and torch.equal(got_v, vb)


@pytest.mark.parametrize("change", ["fork", "truncate", "move", "mirror", "free_other"])
def test_slots_are_refused_once_any_page_may_have_changed_owner(change):
    cache = make(window=4)
    a, other = cache.add_sequence(), cache.add_sequence()
    cache.append(a, *rand(2 * P, 0))
    cache.append(other, *rand(P, 1))
    slots = cache.token_slots([a], [0], [P])  # a's first (full) page
    {"fork": lambda: cache.fork(a),  # the page gains a sharer: a write would show in the fork
     "truncate": lambda: cache.truncate(a, 0),
     "move": lambda: cache.move_pages(a, [0], "hbm"),
     "mirror": lambda: cache.mirror(a, 0, P),  # the tables name the mirror, the slots miss it
     "free_other": lambda: cache.free(other)}[change]()
    before = cache.host_pool.clone(), cache.hbm_pool.clone()
    k, v = rand(P, 3, layers=False)
    with pytest.raises(StaleTablesError, match="stale token slots"):
        cache.write_slots(slots, 0, k, v)
    with pytest.raises(StaleTablesError):
        cache.copy_mirrors_to_host(slots, 0)
    with pytest.raises(StaleTablesError):
        cache.note_host_write(slots)
    assert torch.equal(cache.host_pool, before[0]) and torch.equal(cache.hbm_pool, before[1])


def test_slots_from_another_cache_or_by_hand_are_refused_and_fresh_slots_write():
    cache, other = make(), make()
    a = cache.add_sequence()
    cache.extend(a, P)
    o = other.add_sequence()
    other.extend(o, P)
    k, v = rand(P, 0, layers=False)
    with pytest.raises(StaleTablesError, match="another cache"):
        cache.write_slots(other.token_slots([o], [0], [P]), 0, k, v)
    entry, off = cache.token_entries([a], [0], [P])
    taken_at = cache.page_generation
    with pytest.raises(StaleTablesError, match="another cache"):
        cache.write_slots(TokenSlots.build(entry, off, cache.device), 0, k, v)
    with pytest.raises(TypeError, match="TokenSlots"):
        cache.write_slots(None, 0, k, v)
    cache.extend(a, 3)  # growth gives no page a new owner: slots stay good
    cache.write_slots(cache.build_slots(entry, off, taken_at=taken_at), 1, k, v)
    assert torch.equal(cache.read(a, 1, 0, P)[0], k)


def test_entries_taken_before_a_free_cannot_become_slots_over_the_next_owner():
    cache = make()
    a = cache.add_sequence()
    cache.extend(a, P)
    entry, off = cache.token_entries([a], [0], [P])
    taken_at = cache.page_generation
    cache.free(a)
    b = cache.add_sequence()
    kb, vb = rand(P, 1)
    cache.append(b, kb, vb)  # takes a's page
    with pytest.raises(StaleTablesError, match="stale token entries"):
        cache.build_slots(entry, off, taken_at=taken_at)
    assert torch.equal(cache.read(b, None)[0], kb)


# ---- mirrors and tables never name bytes nobody wrote ----------------------------------------
def test_a_mirror_of_a_range_short_of_the_end_holds_the_pages_tokens():
    cache = make(host=4, window=2)
    junk = cache.add_sequence()  # leaves its bytes in the window page
    cache.append(junk, *rand(P, 9))
    cache.mirror(junk, 0, P)
    cache.free(junk)
    s = cache.add_sequence()
    k, v = rand(P, 0)
    cache.append(s, k, v)
    assert cache.mirror(s, 0, 5) == 1  # tokens 5.. of the page are in the host page only
    got_k, got_v = read_through_tables(cache, s)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)


@pytest.mark.parametrize("how", ["append", "write", "token_slots", "note_host_write"])
def test_a_mirror_of_written_tokens_holds_them(how):
    cache = make(host=4, window=2)
    junk = cache.add_sequence()  # leaves its bytes in the window pages
    cache.append(junk, *rand(2 * P, 9))
    cache.mirror(junk, 0, 2 * P)
    cache.free(junk)
    s = cache.add_sequence()
    k, v = rand(2 * P, 0)
    if how == "append":
        cache.append(s, k, v)
    else:
        cache.extend(s, 2 * P)
        for layer in range(L):
            if how == "write":
                cache.write(s, layer, 0, k[:, layer], v[:, layer])
            elif how == "token_slots":
                cache.write_slots(cache.token_slots([s], [0], [2 * P]), layer, k[:, layer], v[:, layer])
            else:  # written by other means, then announced
                for pos in range(2 * P):
                    page = cache.page_table(s)[pos // P]
                    cache.host_pool[page, layer, :, 0, pos % P] = k[pos, layer]
                    cache.host_pool[page, layer, :, 1, pos % P] = v[pos, layer]
        if how == "note_host_write":
            cache.note_host_write(cache.page_table(s))
    assert cache.mirror(s, 0, 2 * P) == 2
    got_k, got_v = read_through_tables(cache, s)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)


def test_mirrors_of_pages_nothing_was_written_to_copy_nothing():
    from directkv_cute.cache import PageBook

    copies = []
    book = PageBook({"host": 8, "hbm": 0}, P, 4, lambda src, dst: copies.append((src, dst)))
    a = book.add_sequence()
    book.extend(a, 2 * P)
    assert book.mirror(a, 0, 2 * P) == 2 and copies == []
    book.token_entries([a], [0], [2 * P])  # written from now on
    book.release_mirrors(a, keep_partial=False)
    assert book.mirror(a, 0, 2 * P) == 2 and len(copies) == 2


def test_tables_of_a_freed_sequence_are_refused_even_when_its_pages_live_on():
    cache = make()
    a = cache.add_sequence()
    cache.append(a, *rand(2 * P, 0))
    fork = cache.fork(a)  # every page of a is shared: freeing a frees none
    tables = cache.kernel_tables([a])
    cache.free(a)
    with pytest.raises(StaleTablesError):
        cache.check_tables(tables)
    with pytest.raises(StaleTablesError):
        check_kernel_tables(tables, cache)
    cache.check_tables(cache.kernel_tables([fork]))


def test_check_kernel_tables_refuses_what_is_not_kernel_tables():
    cache = make()
    a = cache.add_sequence()
    cache.append(a, *rand(3, 0))
    t = cache.kernel_tables([a])
    check_kernel_tables(t, cache)
    for bad in (None, (t.page_table, t.seq_lens), "tables"):
        with pytest.raises(TypeError, match="KernelTables"):
            check_kernel_tables(bad, cache)
        with pytest.raises(TypeError, match="KernelTables"):
            cache.check_tables(bad)
    with pytest.raises(StaleTablesError, match="another cache"):
        check_kernel_tables(KernelTables(t.page_table, t.seq_lens), cache)


# ---- sizes ----------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [
    dict(num_layers=1, num_kv_heads=1, head_dim=2**60, num_host_pages=1),
    dict(num_layers=2**62, num_kv_heads=1, head_dim=8, num_host_pages=1),
    dict(num_layers=1, num_kv_heads=2**62, head_dim=8, num_host_pages=1),
    dict(num_layers=1, num_kv_heads=1, head_dim=8, num_host_pages=1, num_hbm_pages=2**30),
    dict(num_layers=64, num_kv_heads=64, head_dim=1024, num_host_pages=1, num_hbm_pages=2**31 - 2),
    dict(num_layers=1, num_kv_heads=1, head_dim=8, num_host_pages=1, num_window_pages=2**31 - 2),
])
def test_absurd_sizes_are_one_memory_error_naming_the_bytes(shape):
    with pytest.raises(MemoryError, match=r"\d+ bytes"):
        PagedKVCache(page_size=16, dtype=torch.float32, device="cpu", **shape)


def test_an_unaddressable_pool_is_refused_before_any_allocation(monkeypatch):
    import directkv_cute.cache.pools as pools

    def no_alloc(*args, **kwargs):
        raise AssertionError("allocated")

    monkeypatch.setattr(pools, "PinnedHostBuffer", no_alloc)
    with pytest.raises(MemoryError, match=str(sys.maxsize)):
        PagedKVCache(2**40, 2**10, 2**10, 16, 1, device="cpu", dtype=torch.float32)


# ---- loose arguments ------------------------------------------------------------------------
@pytest.mark.parametrize("pages", [[1.7], np.array([1.0]), [True], ["1"], torch.tensor([0.5])])
def test_note_host_write_refuses_non_integer_pages(pages):
    cache = make()
    with pytest.raises(TypeError, match="integers"):
        cache.note_host_write(pages)
    for good in ([1], np.array([0, 3], np.int32), torch.tensor([2]), [], None):
        cache.note_host_write(good)
    with pytest.raises(IndexError):
        cache.note_host_write([8])


@pytest.mark.parametrize("fraction", [np.float32(0.5), np.int64(1), np.float16(0.25)])
def test_set_hbm_fraction_takes_real_numbers_numpy_scalars_included(fraction):
    cache = make(host=8, hbm=4)
    s = cache.add_sequence()
    cache.append(s, *rand(4 * P, 0))
    cache.set_hbm_fraction(s, fraction)
    assert cache.page_counts(s)["hbm"] == int(float(fraction) * 4 + 0.5)


@pytest.mark.parametrize("fraction,error,words", [
    (float("nan"), ValueError, "finite"), (float("inf"), ValueError, "finite"), (np.float32("nan"), ValueError,
                                                                                   "finite"),
    ("0.5", TypeError, "real number"), (True, TypeError, "real number"), (None, TypeError, "real number")])
def test_set_hbm_fraction_refuses_non_finite_out_of_range_and_non_numbers(fraction, error, words):
    cache = make(host=8, hbm=4)
    s = cache.add_sequence()
    cache.append(s, *rand(4 * P, 0))
    before = cache.state()
    with pytest.raises(error, match=words):
        cache.set_hbm_fraction(s, fraction)
    assert cache.state() == before


@pytest.mark.parametrize("nbytes", [2**70, sys.maxsize + 1])
def test_a_pinned_buffer_beyond_the_address_space_is_a_memory_error(nbytes):
    from directkv_cute._pinned import PinnedHostBuffer

    with pytest.raises(MemoryError, match=str(nbytes)):
        PinnedHostBuffer(nbytes)


def _ops():
    from hypothesis import strategies as st

    op = st.one_of(
        st.tuples(st.just("add"), st.integers(1, 3 * P)),
        st.tuples(st.just("free"), st.integers(0, 5)),
        st.tuples(st.just("fork"), st.integers(0, 5)),
        st.tuples(st.just("truncate"), st.integers(0, 5), st.integers(0, 3 * P)),
        st.tuples(st.just("move"), st.integers(0, 5), st.sampled_from(["host", "hbm"])),
        st.tuples(st.just("mirror"), st.integers(0, 5)),
        st.tuples(st.just("extend"), st.integers(0, 5), st.integers(0, P)),
    )
    return st.lists(op, max_size=6)


def test_a_write_through_old_slots_is_refused_or_lands_only_in_their_own_sequence():
    """Random operations between taking a sequence's slots and writing through them: the write
    is refused (nothing written), or every other sequence reads what it read before."""
    from hypothesis import given, settings

    from directkv_cute.cache import CacheCapacityError

    @settings(max_examples=150, deadline=None)
    @given(_ops())
    def run(ops):
        cache = make(host=12, hbm=4, window=3)
        a = cache.add_sequence()
        cache.append(a, *rand(2 * P + 3, 0))
        slots = cache.token_slots([a], [P], [P + 3])
        for i, op in enumerate(ops):
            live = cache.seq_ids
            pick = (lambda j: live[j % len(live)]) if live else None
            try:
                if op[0] == "add":
                    s = cache.add_sequence()
                    cache.append(s, *rand(op[1], 10 + i))
                elif pick is None:
                    continue
                elif op[0] == "free":
                    cache.free(pick(op[1]))
                elif op[0] == "fork":
                    cache.fork(pick(op[1]))
                elif op[0] == "truncate":
                    s = pick(op[1])
                    cache.truncate(s, min(op[2], cache.seq_len(s)))
                elif op[0] == "move":
                    s = pick(op[1])
                    cache.move_pages(s, range(len(cache.page_table(s))), op[2])
                elif op[0] == "mirror":
                    s = pick(op[1])
                    if cache.seq_len(s):
                        cache.mirror(s, 0, cache.seq_len(s))
                elif op[0] == "extend":
                    s = pick(op[1])
                    start = cache.extend(s, op[2])
                    if op[2]:
                        k, v = rand(op[2], 20 + i)
                        for layer in range(L):
                            cache.write(s, layer, start, k[:, layer], v[:, layer])
            except CacheCapacityError:
                pass
        others = {s: cache.read(s, None) for s in cache.seq_ids if s != a}
        k, v = torch.full((P + 3, H, D), 7.0), torch.full((P + 3, H, D), -7.0)
        try:
            cache.write_slots(slots, 1, k, v)
        except StaleTablesError:
            wrote = False
        else:
            wrote = True
        for s, (ok, ov) in others.items():
            got_k, got_v = cache.read(s, None)
            assert torch.equal(got_k, ok) and torch.equal(got_v, ov), f"sequence {s} changed"
        if wrote:
            assert a in cache.seq_ids
            assert torch.equal(cache.read(a, 1, P, 2 * P + 3)[0], k)
            got_k, _ = read_through_tables(cache, a)
            assert torch.equal(got_k[P : 2 * P + 3, 1], k)

    run()
