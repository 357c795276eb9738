"""CPU tests of cascade attention over shared prefixes (``directkv_cute.cascade``): the sharing
detection and plan over random fork trees (property tests), the packing of a span's query rows,
the LSE merge, and the whole cascade against the plain per-sequence reference."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from directkv_cute.cache import PagedKVCache
from directkv_cute.cascade import find_spans, merge_partials, pack_rows, plan_cascade, unpack_rows
from directkv_cute.ops import cascade_attention
from directkv_cute.reference import paged_attention_ref

L, HKV, D = 2, 2, 32


def _append(cache, sid, n, gen):
    k = torch.randn(n, L, HKV, D, generator=gen).to(cache.dtype)
    v = torch.randn(n, L, HKV, D, generator=gen).to(cache.dtype)
    cache.append(sid, k, v)


def _forest(seed: int, page: int, roots: int, forks: int, dtype=torch.float32, hbm_pages: int = 0):
    """A cache holding ``roots`` prompts and ``forks`` forks of random earlier sequences (each
    fork, and sometimes its parent, then grows): a random tree of shared pages. Returns the
    cache and every sequence id."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(L, HKV, D, page, 4096, hbm_pages, dtype=dtype, device="cpu")
    ids = []
    for _ in range(roots):
        sid = cache.add_sequence()
        _append(cache, sid, int(rng.integers(1, 12 * page)), gen)
        ids.append(sid)
    for _ in range(forks):
        parent = ids[int(rng.integers(len(ids)))]
        child = cache.fork(parent)
        _append(cache, child, int(rng.integers(0, 4 * page)), gen)
        if rng.random() < 0.3:
            _append(cache, parent, int(rng.integers(1, 2 * page)), gen)
        ids.append(child)
    return cache, ids, rng, gen


def _step(cache, ids, rng, gen, max_q: int):
    """Append each sequence's new tokens (q_len of them), as a model step does before attending."""
    q_lens = [int(rng.integers(1, max_q + 1)) for _ in ids]
    for sid, n in zip(ids, q_lens):
        _append(cache, sid, n, gen)
    return q_lens


@st.composite
def forests(draw):
    return (draw(st.integers(0, 10_000)), draw(st.sampled_from([16, 32, 64])), draw(st.integers(1, 3)),
            draw(st.integers(0, 9)), draw(st.integers(1, 5)))


@settings(max_examples=40, deadline=None)
@given(forests())
def test_spans_are_exactly_the_shared_pages(case):
    seed, page, roots, forks, max_q = case
    cache, ids, rng, gen = _forest(seed, page, roots, forks)
    q_lens = _step(cache, ids, rng, gen, max_q)
    tables = cache.kernel_tables(ids)
    table, lens = tables.host_table, tables.host_seq_lens
    spans, own_lo = find_spans(table, lens, q_lens, page)
    shareable = [(n - q) // page for n, q in zip(lens, q_lens)]
    for s in spans:
        assert len(s.rows) >= 2 and s.page_hi > s.page_lo
        block = table[list(s.rows), s.page_lo:s.page_hi]
        assert (block == block[0]).all(), "a span's rows hold different pages"
        assert all(s.page_hi <= shareable[r] for r in s.rows), "a span reaches a row's query tokens"
    for r in range(len(ids)):
        mine = sorted((s.page_lo, s.page_hi) for s in spans if r in s.rows)
        at = 0
        for lo, hi in mine:  # a chain from page 0 to own_lo: no gap, no overlap
            assert lo == at
            at = hi
        assert at == own_lo[r]
    # Maximal: two rows sit in the same spans exactly over their common shareable prefix.
    for a in range(len(ids)):
        for b in range(a + 1, len(ids)):
            lim = min(shareable[a], shareable[b])
            eq = table[a, :lim] == table[b, :lim]
            common = lim if eq.all() else int(np.argmin(eq))
            together = sum(s.page_hi - s.page_lo for s in spans if a in s.rows and b in s.rows)
            assert together == common, (a, b, together, common)
    # Host pages read: each distinct page once.
    plan = plan_cascade(table, lens, q_lens, page, min_shared_tokens=1)
    used = {int(table[b, j]) for b, n in enumerate(lens) for j in range(math.ceil(n / page))}
    assert plan.host_pages_read == len(used)
    assert plan.host_pages_naive == sum(math.ceil(n / page) for n in lens)
    cache.close()


def test_explicit_groups_restrict_sharing_and_bad_groups_are_refused():
    cache, ids, rng, gen = _forest(7, 16, 1, 0)
    ids += [cache.fork(ids[0]) for _ in range(3)]
    q_lens = _step(cache, ids, rng, gen, 2)
    t = cache.kernel_tables(ids)
    spans, _ = find_spans(t.host_table, t.host_seq_lens, q_lens, 16)
    assert [s.rows for s in spans] == [(0, 1, 2, 3)]
    spans, _ = find_spans(t.host_table, t.host_seq_lens, q_lens, 16, groups=[[0, 1], [2], [3]])
    assert [s.rows for s in spans] == [(0, 1)]
    with pytest.raises(ValueError, match="disjoint"):
        find_spans(t.host_table, t.host_seq_lens, q_lens, 16, groups=[[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="disjoint"):
        find_spans(t.host_table, t.host_seq_lens, q_lens, 16, groups=[[0, 9]])
    cache.close()


def test_short_spans_are_left_to_the_own_pass():
    cache, ids, rng, gen = _forest(3, 16, 1, 0)
    while cache.seq_len(ids[0]) < 40:
        _append(cache, ids[0], 8, gen)
    ids.append(cache.fork(ids[0]))
    q_lens = _step(cache, ids, rng, gen, 1)
    t = cache.kernel_tables(ids)
    shared_tokens = (min(t.host_seq_lens) - 1) // 16 * 16
    assert plan_cascade(t.host_table, t.host_seq_lens, q_lens, 16, min_shared_tokens=1).shared
    plan = plan_cascade(t.host_table, t.host_seq_lens, q_lens, 16, min_shared_tokens=shared_tokens + 16)
    assert not plan.shared and plan.own_lo == (0, 0)
    cache.close()


@pytest.mark.parametrize("n_tok,hq,hkv", [(1, 8, 2), (16, 32, 8), (40, 32, 8), (3, 12, 1), (100, 8, 8)])
def testpack_rows_round_trips_and_maps_heads_to_their_kv_head(n_tok, hq, hkv):
    q = torch.randn(n_tok, hq, 16)
    packed, n_pseudo, g2 = pack_rows(q, hkv)
    group = hq // hkv
    assert g2 <= 128 and n_pseudo * g2 >= n_tok * group and packed.shape == (n_pseudo, hkv * g2, 16)
    # Every real row lands under its own KV head (head h' -> KV head h' // g2).
    for t in (0, n_tok - 1):
        for h in (0, hq - 1):
            hits = (packed == q[t, h]).all(-1).nonzero()
            assert any(int(hp) // g2 == h // group for _, hp in hits)
    lse = torch.randn(n_pseudo, hkv * g2)
    o, lse_back = unpack_rows(packed, lse, n_tok, hq, hkv, g2)
    assert torch.equal(o, q)
    assert lse_back.shape == (n_tok, hq)


def test_merge_of_two_key_sets_equals_attention_over_their_union():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 3, 8, generator=g, dtype=torch.float64)
    k = torch.randn(20, 8, generator=g, dtype=torch.float64)
    v = torch.randn(20, 8, generator=g, dtype=torch.float64)

    def attend(ks, vs):
        s = torch.einsum("qhd,kd->qhk", q, ks)
        return torch.einsum("qhk,kd->qhd", s.softmax(-1), vs), s.logsumexp(-1)

    o_all, l_all = attend(k, v)
    o1, l1 = attend(k[:7], v[:7])
    o2, l2 = attend(k[7:], v[7:])
    o, lse = merge_partials(o1, l1, o2, l2)
    assert torch.allclose(o, o_all) and torch.allclose(lse, l_all)
    # A side that saw no key (LSE -inf) leaves the other unchanged; both empty stays empty.
    empty = torch.full_like(l1, -math.inf)
    o, lse = merge_partials(o1, l1, torch.zeros_like(o1), empty)
    assert torch.allclose(o, o1) and torch.allclose(lse, l1)
    o, lse = merge_partials(torch.zeros_like(o1), empty, torch.zeros_like(o1), empty)
    assert (o == 0).all() and torch.isinf(lse).all()


@settings(max_examples=25, deadline=None)
@given(forests(), st.sampled_from([1, 2, 4]))
def test_cascade_matches_per_sequence_attention(case, group):
    seed, page, roots, forks, max_q = case
    cache, ids, rng, gen = _forest(seed, page, roots, forks)
    q_lens = _step(cache, ids, rng, gen, max_q)
    q = torch.randn(sum(q_lens), HKV * group, D, generator=gen)
    out = torch.full_like(q, float("nan"))
    t = cache.kernel_tables(ids)
    plan = plan_cascade(t.host_table, t.host_seq_lens, q_lens, page, min_shared_tokens=1)
    o, lse = cascade_attention(q, cache, 1, ids, q_lens, tables=t, plan=plan, out=out, return_lse=True)
    ref_o, ref_lse = paged_attention_ref(q, cache, 1, ids, q_lens)
    assert o.data_ptr() == out.data_ptr()
    assert torch.allclose(o, ref_o, atol=2e-5, rtol=1e-4), (o - ref_o).abs().max()
    assert torch.allclose(lse, ref_lse, atol=2e-5, rtol=1e-5)
    cache.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cascade_in_half_precision_with_hbm_pages(dtype):
    cache, ids, rng, gen = _forest(11, 16, 2, 6, dtype=dtype, hbm_pages=256)
    # Move part of a shared prefix to HBM: every sharer sees the move (one physical page).
    cache.move_pages(ids[0], [0, 1], "hbm")
    q_lens = _step(cache, ids, rng, gen, 3)
    t = cache.kernel_tables(ids)
    plan = plan_cascade(t.host_table, t.host_seq_lens, q_lens, 16, min_shared_tokens=1)
    assert plan.shared
    q = torch.randn(sum(q_lens), HKV * 4, D, generator=gen).to(dtype)
    o, lse = cascade_attention(q, cache, 0, ids, q_lens, tables=t, plan=plan, return_lse=True)
    ref_o, ref_lse = paged_attention_ref(q, cache, 0, ids, q_lens)
    err = ((o.double() - ref_o.double()).norm() / ref_o.double().norm()).item()
    assert err < 1e-2
    assert torch.allclose(lse, ref_lse, atol=1e-3, rtol=1e-4)
    cache.close()


def test_cascade_refuses_bad_input_before_writing():
    cache, ids, rng, gen = _forest(5, 16, 1, 2)
    q_lens = _step(cache, ids, rng, gen, 2)
    q = torch.randn(sum(q_lens), HKV * 2, D, generator=gen)
    out = torch.full_like(q, float("nan"))
    t = cache.kernel_tables(ids)
    plan = plan_cascade(t.host_table, t.host_seq_lens, q_lens, 16)
    with pytest.raises(ValueError, match="q has"):
        cascade_attention(q[:-1], cache, 0, ids, q_lens)
    with pytest.raises(TypeError, match="dtype"):
        cascade_attention(q.half(), cache, 0, ids, q_lens)
    with pytest.raises(ValueError, match="cascade plan"):
        cascade_attention(q, cache, 0, ids, q_lens, tables=t, plan=dataclasses.replace(plan, page_size=32), out=out)
    with pytest.raises(IndexError):
        cascade_attention(q, cache, 5, ids, q_lens, out=out)
    assert torch.isnan(out).all()
    cache.close()


def test_plan_of_64_forks_of_a_32k_prompt():
    """64 forks of a 32k prompt (page 64), 1k own tokens each: one span of all 64 rows."""
    prompt = np.arange(512, dtype=np.int32)
    table = np.stack([np.concatenate([prompt, [10_000 + 16 * i + j for j in range(16)]]) for i in range(64)])
    plan = plan_cascade(table, [528 * 64] * 64, [1] * 64, 64)
    assert [s.rows for s in plan.spans] == [tuple(range(64))]
    assert plan.spans[0].page_hi == 512 and plan.own_lo == (512,) * 64
    assert plan.host_pages_read == 512 + 64 * 16 and plan.host_pages_naive == 64 * 528
