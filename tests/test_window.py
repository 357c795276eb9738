"""CPU tests of the HBM window: mirrors of the pages a step writes (``PagedKVCache.mirror``).

Every mirrored page is written through (host page and mirror), the kernel tables name the mirror
while the host page is private, and the data read through the tables always equals what was
written. A hypothesis state machine drives random writes, mirrors, releases, forks, truncations,
moves and frees against a dense model of every sequence.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from directkv_cute.cache import CacheCapacityError, PagedKVCache, StaleTablesError, encode_page
from directkv_cute.reference import tables_attention_ref
from cache_reads import read_through_tables

L, H, D, P = 2, 2, 8, 16


def make(host=16, hbm=2, window=6) -> PagedKVCache:
    return PagedKVCache(L, H, D, P, host, hbm, dtype=torch.float32, device="cpu", num_window_pages=window)


def rand(n, gen):
    return torch.randn(n, L, H, D, generator=gen), torch.randn(n, L, H, D, generator=gen)


def test_mirrored_pages_are_written_through_and_read_from_hbm():
    gen = torch.Generator().manual_seed(0)
    cache = make()
    sid = cache.add_sequence()
    k0, v0 = rand(20, gen)
    cache.append(sid, k0, v0)  # pages 0, 1 (history)
    cache.extend(sid, 30)  # tokens 20..49: pages 1 (partial history), 2, 3
    assert cache.mirror(sid, 20, 30) == 3
    assert sorted(cache.mirrored_pages(sid)) == [1, 2, 3]
    w1 = cache.mirrored_pages(sid)[1]
    host1 = cache.page_table(sid)[1]
    # The page holding history was copied into its mirror first.
    assert torch.equal(cache.hbm_pool[w1, :, :, :, :4], cache.host_pool[host1, :, :, :, :4])
    k1, v1 = rand(30, gen)
    slots = cache.token_slots([sid], [20], [30])
    for layer in range(L):
        cache.write_slots(slots, layer, k1[:, layer], v1[:, layer])
    table = cache.kernel_tables([sid]).host_table[0]
    assert table[0] >= 0 and all(table[lp] == encode_page("hbm", cache.mirrored_pages(sid)[lp]) for lp in (1, 2, 3))
    k, v = read_through_tables(cache, sid)
    assert torch.equal(k, torch.cat([k0, k1])) and torch.equal(v, torch.cat([v0, v1]))
    # The host copy is current too (write-through): after a release the host pages serve the reads.
    assert cache.release_mirrors(sid) == 2  # pages 1, 2 are full; page 3 (partial) keeps its mirror
    assert list(cache.mirrored_pages(sid)) == [3]
    k, v = read_through_tables(cache, sid)
    assert torch.equal(k, torch.cat([k0, k1])) and torch.equal(v, torch.cat([v0, v1]))
    assert cache.release_mirrors(sid, keep_partial=False) == 1
    assert cache.free_window_pages() == 6


def test_deferred_host_stores_copy_whole_mirrored_pages_by_runs():
    """write_slots(defer_host=True): mirrored tokens go to their mirrors, and one copy per run of
    consecutive (mirror, host) pages brings that layer into the host pages; tokens without a
    mirror are stored directly."""
    gen = torch.Generator().manual_seed(4)
    cache = make(window=3)
    sid = cache.add_sequence()
    cache.append(sid, *rand(5, gen))
    cache.extend(sid, 4 * P)  # tokens 5..68: pages 0..4; the window holds 3 of them
    assert cache.mirror(sid, 5, 4 * P) == 3
    slots = cache.token_slots([sid], [5], [4 * P])
    assert slots.runs == ((cache.mirrored_pages(sid)[0], cache.page_table(sid)[0], 3),)
    k, v = rand(4 * P, gen)
    calls = []
    real = PagedKVCache._copy_back
    PagedKVCache._copy_back = lambda self, layer, runs: (calls.append((layer, runs)), real(self, layer, runs))
    try:
        for layer in range(L):
            cache.write_slots(slots, layer, k[:, layer], v[:, layer], defer_host=True)
    finally:
        PagedKVCache._copy_back = real
    assert [c[0] for c in calls] == [0, 1]
    cache.release_mirrors(sid, keep_partial=False)
    got_k, got_v = read_through_tables(cache, sid)
    assert torch.equal(got_k[5:], k) and torch.equal(got_v[5:], v)


def test_attention_over_mirrors_equals_attention_over_host_pages():
    gen = torch.Generator().manual_seed(1)
    cache = make(window=8)
    sids = [cache.add_sequence() for _ in range(2)]
    for sid, hist, new in zip(sids, (37, 5), (40, 18)):
        cache.append(sid, *rand(hist, gen))
        cache.extend(sid, new)
        cache.mirror(sid, hist, new)
        k, v = rand(new, gen)
        cache.write(sid, 0, hist, k[:, 0], v[:, 0])
        cache.write(sid, 1, hist, k[:, 1], v[:, 1])
    q_lens = [40, 18]
    q = torch.randn(sum(q_lens), 4, D, generator=gen)
    mirrored = cache.kernel_tables(sids)
    assert (mirrored.host_table < 0).any()
    out_m, _ = tables_attention_ref(q, cache.host_pool, cache.hbm_pool, mirrored.page_table, mirrored.seq_lens, 1,
                                    q_lens, None)
    for sid in sids:
        cache.release_mirrors(sid, keep_partial=False)
    host = cache.kernel_tables(sids)
    assert (host.host_table >= 0).all()
    out_h, _ = tables_attention_ref(q, cache.host_pool, cache.hbm_pool, host.page_table, host.seq_lens, 1, q_lens,
                                    None)
    torch.testing.assert_close(out_m, out_h, rtol=0, atol=0)


def test_window_capacity_mirrors_what_fits_and_releases_make_tables_stale():
    gen = torch.Generator().manual_seed(2)
    cache = make(window=2)
    sid = cache.add_sequence()
    cache.extend(sid, 5 * P)
    assert cache.mirror(sid, 0, 5 * P) == 2  # the first two pages; the rest stay host-only
    assert sorted(cache.mirrored_pages(sid)) == [0, 1] and cache.free_window_pages() == 0
    k, v = rand(5 * P, gen)
    cache.write(sid, 0, 0, k[:, 0], v[:, 0])
    cache.write(sid, 1, 0, k[:, 1], v[:, 1])
    got_k, got_v = read_through_tables(cache, sid)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    tables = cache.kernel_tables([sid])
    cache.release_mirrors(sid)
    with pytest.raises(StaleTablesError):
        cache.check_tables(tables)
    assert cache.mirror(sid, 0, 0) == 0
    with pytest.raises(ValueError, match="past the end"):
        cache.mirror(sid, 5 * P - 1, 2)


def test_a_shared_mirrored_page_is_read_from_the_host_by_every_sharer():
    gen = torch.Generator().manual_seed(3)
    cache = make()
    sid = cache.add_sequence()
    cache.extend(sid, 2 * P + 3)
    cache.mirror(sid, 0, 2 * P + 3)
    cache.write(sid, 0, 0, *[t[:, 0] for t in rand(2 * P + 3, gen)])
    child = cache.fork(sid, 2 * P)  # shares pages 0, 1
    parent = cache.kernel_tables([sid]).host_table[0]
    kid = cache.kernel_tables([child]).host_table[0]
    assert parent[0] == kid[0] >= 0 and parent[1] == kid[1] >= 0  # one host entry: a cascade finds it
    assert parent[2] < 0  # the private partial page still reads its mirror
    assert cache.mirrored_pages(child) == {}
    # A write into the shared page copies it (copy-on-write); the parent's mirror stays current.
    k, v = rand(1, gen)
    cache.write(sid, 0, 5, k[:, 0], v[:, 0])
    assert cache.kernel_tables([sid]).host_table[0][0] < 0
    got_k, _ = read_through_tables(cache, sid)
    assert torch.equal(got_k[5, 0], k[0, 0])
    assert not torch.equal(read_through_tables(cache, child)[0][5, 0], k[0, 0])


def test_truncate_move_and_free_return_mirrors_to_the_window():
    cache = make(window=4)
    sid = cache.add_sequence()
    cache.extend(sid, 3 * P + 1)
    assert cache.mirror(sid, 0, 3 * P + 1) == 4
    cache.truncate(sid, P + 2)
    assert sorted(cache.mirrored_pages(sid)) == [0, 1] and cache.free_window_pages() == 2
    cache.move_pages(sid, [0], "hbm")  # an HBM-tier page needs no mirror
    assert sorted(cache.mirrored_pages(sid)) == [1] and cache.free_window_pages() == 3
    assert cache.state().mirrors == {sid: ((1, cache.mirrored_pages(sid)[1]),)}
    cache.free(sid)
    assert cache.free_window_pages() == 4 and cache.state().mirrors == {}


def test_window_pages_do_not_count_as_hbm_tier_capacity():
    cache = make(hbm=2, window=5)
    assert cache.num_pages("hbm") == 2 and cache.free_pages("hbm") == 2
    assert cache.hbm_pool.shape[0] == 7 and cache.free_window_pages() == 5
    with pytest.raises(CacheCapacityError):
        sid = cache.add_sequence()
        cache.extend(sid, 3 * P, "hbm")
    with pytest.raises(ValueError, match="num_window_pages"):
        PagedKVCache(L, H, D, P, 4, 0, dtype=torch.float32, device="cpu", num_window_pages=-1)


class WindowMachine(RuleBasedStateMachine):
    """Random operations against a dense model: what the tables read is what was written."""

    @initialize()
    def setup(self):
        self.cache = make(host=40, hbm=6, window=5)
        self.gen = torch.Generator().manual_seed(7)
        self.truth: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _ids(self):
        return sorted(self.truth)

    @rule()
    def add(self):
        if len(self.truth) < 4:
            self.truth[self.cache.add_sequence()] = (torch.zeros(0, L, H, D), torch.zeros(0, L, H, D))

    @precondition(lambda self: self.truth)
    @rule(pick=st.integers(0, 3), n=st.integers(1, 40), mirror=st.booleans(), tier=st.sampled_from(["host", "hbm"]),
          per_layer=st.booleans(), defer=st.booleans())
    def grow(self, pick, n, mirror, tier, per_layer, defer):
        sid = self._ids()[pick % len(self.truth)]
        try:
            start = self.cache.extend(sid, n, tier)
        except CacheCapacityError:
            return
        if mirror:
            self.cache.release_mirrors(sid)
            self.cache.mirror(sid, start, n)
        k, v = rand(n, self.gen)
        try:
            if per_layer:
                slots = self.cache.token_slots([sid], [start], [n])
                for layer in range(L):
                    self.cache.write_slots(slots, layer, k[:, layer], v[:, layer], defer_host=defer)
            else:
                for layer in range(L):
                    self.cache.write(sid, layer, start, k[:, layer], v[:, layer])
        except CacheCapacityError:  # copy-on-write found no page: undo the growth
            self.cache.truncate(sid, start)
            return
        tk, tv = self.truth[sid]
        self.truth[sid] = (torch.cat([tk, k]), torch.cat([tv, v]))

    @precondition(lambda self: self.truth)
    @rule(pick=st.integers(0, 3), whole=st.booleans())
    def fork(self, pick, whole):
        if len(self.truth) >= 4:
            return
        sid = self._ids()[pick % len(self.truth)]
        n = self.cache.seq_len(sid)
        length = None if whole else (n // P) * P
        try:
            child = self.cache.fork(sid, length)
        except CacheCapacityError:
            return
        tk, tv = self.truth[sid]
        m = n if length is None else length
        self.truth[child] = (tk[:m].clone(), tv[:m].clone())

    @precondition(lambda self: self.truth)
    @rule(pick=st.integers(0, 3), frac=st.floats(0, 1))
    def truncate(self, pick, frac):
        sid = self._ids()[pick % len(self.truth)]
        m = int(self.cache.seq_len(sid) * frac)
        try:
            self.cache.truncate(sid, m)
        except CacheCapacityError:
            return
        tk, tv = self.truth[sid]
        self.truth[sid] = (tk[:m], tv[:m])

    @precondition(lambda self: self.truth)
    @rule(pick=st.integers(0, 3), page=st.integers(0, 6), tier=st.sampled_from(["host", "hbm"]))
    def move(self, pick, page, tier):
        sid = self._ids()[pick % len(self.truth)]
        pages = len(self.cache.page_table(sid))
        if pages:
            try:
                self.cache.move_pages(sid, [page % pages], tier)
            except CacheCapacityError:
                pass

    @precondition(lambda self: self.truth)
    @rule(pick=st.integers(0, 3), keep=st.booleans())
    def release(self, pick, keep):
        self.cache.release_mirrors(self._ids()[pick % len(self.truth)], keep)

    @precondition(lambda self: self.truth)
    @rule(pick=st.integers(0, 3))
    def free(self, pick):
        sid = self._ids()[pick % len(self.truth)]
        self.cache.free(sid)
        del self.truth[sid]

    @invariant()
    def reads_match_and_window_is_conserved(self):
        held = sum(len(self.cache.mirrored_pages(s)) for s in self.truth)
        assert held + self.cache.free_window_pages() == 5
        for sid, (tk, tv) in self.truth.items():
            if not len(tk):
                continue
            k, v = read_through_tables(self.cache, sid)
            assert torch.equal(k, tk) and torch.equal(v, tv), sid
            for lp, w in self.cache.mirrored_pages(sid).items():
                assert self.cache.page_table(sid)[lp] >= 0  # only host pages have mirrors
                got = self.cache.hbm_pool[w, :, :, :, : min(P, len(tk) - lp * P)]
                want = self.cache.host_pool[self.cache.page_table(sid)[lp], :, :, :, : min(P, len(tk) - lp * P)]
                assert torch.equal(got, want)


TestWindowMachine = WindowMachine.TestCase
TestWindowMachine.settings = settings(max_examples=60, stateful_step_count=25, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])
