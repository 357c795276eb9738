"""CPU tests of the reference attention.

``dense_attention_ref`` is checked against torch SDPA and a scalar loop; ``paged_attention_ref``
(float32, paged, mixed tiers) is checked against ``dense_attention_ref`` (float64, unpaged) on
fresh random data with ragged lengths, GQA ratios 1/4/8, head dims 64/128, bf16 and fp16.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from directkv_cute.cache import PagedKVCache
from directkv_cute.reference import dense_attention_ref, paged_attention_ref

TOL = {torch.bfloat16: dict(atol=1.5e-2, rtol=1.5e-2), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def build(randn, lengths, num_layers, num_kv_heads, head_dim, page_size, dtype, hbm_pages=0):
    """A CPU cache holding one random sequence per length, appended in ragged chunks.

    Returns the cache, the sequence ids and the dense per-sequence (L_i, num_layers, Hkv, d) K, V.
    """
    total_pages = sum(math.ceil(n / page_size) for n in lengths)
    cache = PagedKVCache(
        num_layers, num_kv_heads, head_dim, page_size, total_pages + 2, hbm_pages, dtype=dtype, device="cpu"
    )
    seq_ids, ks, vs = [], [], []
    for n in lengths:
        s = cache.add_sequence()
        shape = (n, num_layers, num_kv_heads, head_dim)
        k, v = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype)
        cut = n // 3  # two appends that do not end on page boundaries
        cache.append(s, k[:cut], v[:cut])
        cache.append(s, k[cut:], v[cut:])
        seq_ids.append(s)
        ks.append(k)
        vs.append(v)
    return cache, seq_ids, ks, vs


# ---- dense reference against independent computations -----------------------------------------
def test_dense_matches_sdpa_with_causal_offset(randn):
    lengths, q_lens, hq, hkv, d = [37, 5, 64], [4, 5, 1], 8, 2, 32
    q = randn(sum(q_lens), hq, d, dtype=torch.float64)
    ks = [randn(n, hkv, d, dtype=torch.float64) for n in lengths]
    vs = [randn(n, hkv, d, dtype=torch.float64) for n in lengths]
    out, lse = dense_attention_ref(q, ks, vs, q_lens, None)
    row = 0
    for k, v, n, m in zip(ks, vs, lengths, q_lens):
        qi = q[row : row + m].transpose(0, 1)  # (Hq, m, d)
        ke = k.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)  # (Hq, n, d)
        ve = v.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        mask = torch.arange(n)[None, :] <= torch.arange(n - m, n)[:, None]  # (m, n)
        expect = F.scaled_dot_product_attention(qi, ke, ve, attn_mask=mask).transpose(0, 1)
        torch.testing.assert_close(out[row : row + m], expect, atol=1e-12, rtol=1e-12)
        scores = qi @ ke.transpose(1, 2) / math.sqrt(d)  # (Hq, m, n)
        expect_lse = torch.logsumexp(scores.masked_fill(~mask, -math.inf), dim=-1).transpose(0, 1)
        torch.testing.assert_close(lse[row : row + m], expect_lse, atol=1e-12, rtol=1e-12)
        row += m


def test_dense_matches_scalar_loop(randn):
    """A tiny case spelled out element by element, with a custom scale and GQA 2."""
    q = randn(3, 4, 8, dtype=torch.float64)  # two sequences: q_lens 2 and 1
    ks = [randn(5, 2, 8, dtype=torch.float64), randn(2, 2, 8, dtype=torch.float64)]
    vs = [randn(5, 2, 8, dtype=torch.float64), randn(2, 2, 8, dtype=torch.float64)]
    out, lse = dense_attention_ref(q, ks, vs, [2, 1], 0.3)
    rows = [(0, 0, 2), (0, 1, 2), (1, 0, 1)]  # (sequence, j, q_len)
    for r, (b, j, m) in enumerate(rows):
        n = ks[b].shape[0]
        for h in range(4):
            kvh = h // 2
            visible = range(n - m + j + 1)
            s = [0.3 * float(q[r, h] @ ks[b][t, kvh]) for t in visible]
            z = sum(math.exp(x) for x in s)
            o = sum(math.exp(x) / z * vs[b][t, kvh] for t, x in zip(visible, s))
            assert abs(float(lse[r, h]) - math.log(z)) < 1e-12
            torch.testing.assert_close(out[r, h], o, atol=1e-12, rtol=1e-12)


# ---- paged reference against the dense one ---------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("multi_q", [False, True])
def test_paged_matches_dense(randn, gen, dtype, group, head_dim, multi_q):
    hkv = 2
    page_size = [16, 32, 64, 128][torch.randint(4, (1,), generator=gen).item()]
    lengths = [int(n) for n in torch.randint(1, 300, (4,), generator=gen)]
    lengths[0] = 2 * page_size + 7  # ragged: never a whole number of pages
    cache, seq_ids, ks, vs = build(randn, lengths, 3, hkv, head_dim, page_size, dtype, hbm_pages=12)
    # Mixed tiers: spread HBM pages through one sequence, the recent pages of another.
    cache.set_hbm_fraction(seq_ids[0], 0.5, "strided")
    cache.set_hbm_fraction(seq_ids[1], 0.4, "recent")
    assert cache.page_counts(seq_ids[0]) == {"host": 1, "hbm": 2}
    q_lens = None
    if multi_q:
        q_lens = [min(n, int(m)) for n, m in zip(lengths, torch.randint(2, 20, (4,), generator=gen))]
    total_q = sum(q_lens) if multi_q else len(lengths)
    q = randn(total_q, hkv * group, head_dim, dtype=dtype)
    layer = 1
    out, lse = paged_attention_ref(q, cache, layer, seq_ids, q_lens)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (total_q, hkv * group)
    expect_out, expect_lse = dense_attention_ref(
        q, [k[:, layer] for k in ks], [v[:, layer] for v in vs], q_lens, None
    )
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out.double(), expect_out, **TOL[dtype])
    torch.testing.assert_close(lse.double(), expect_lse, atol=1e-4, rtol=1e-5)


def test_paged_with_forks_scale_and_batch_order(randn):
    """Forked sequences share pages; the batch may list a sequence twice, in any order."""
    cache, (a,), ks, vs = build(randn, [45], 2, 2, 64, 16, torch.bfloat16, hbm_pages=4)
    b = cache.fork(a)
    ka, va = randn(10, 2, 2, 64), randn(10, 2, 2, 64)
    kb, vb = randn(30, 2, 2, 64), randn(30, 2, 2, 64)
    cache.append(a, ka, va)
    cache.append(b, kb, vb, tier="hbm")
    k_a, v_a = torch.cat([ks[0], ka]), torch.cat([vs[0], va])
    k_b, v_b = torch.cat([ks[0], kb]), torch.cat([vs[0], vb])
    q = randn(3 + 16 + 2, 8, 64)
    out, lse = paged_attention_ref(q, cache, 0, [b, a, b], [3, 16, 2], softmax_scale=0.05)
    expect_out, expect_lse = dense_attention_ref(
        q, [k_b[:, 0], k_a[:, 0], k_b[:, 0]], [v_b[:, 0], v_a[:, 0], v_b[:, 0]], [3, 16, 2], 0.05
    )
    torch.testing.assert_close(out.double(), expect_out, **TOL[torch.bfloat16])
    torch.testing.assert_close(lse.double(), expect_lse, atol=1e-4, rtol=1e-5)


def test_paged_in_query_chunks(randn, monkeypatch):
    """Long query runs are processed in chunks of rows; chunking must not change the result."""
    import directkv_cute.reference as reference

    cache, seq_ids, ks, vs = build(randn, [90, 41], 1, 2, 64, 16, torch.float16)
    q_lens = [37, 41]
    q = randn(sum(q_lens), 8, 64, dtype=torch.float16)
    monkeypatch.setattr(reference, "_SCORES_PER_CHUNK", 8 * 90 * 5)  # 5 rows per chunk for seq 0
    out, lse = paged_attention_ref(q, cache, 0, seq_ids, q_lens)
    expect_out, expect_lse = dense_attention_ref(q, [k[:, 0] for k in ks], [v[:, 0] for v in vs], q_lens, None)
    torch.testing.assert_close(out.double(), expect_out, **TOL[torch.float16])
    torch.testing.assert_close(lse.double(), expect_lse, atol=1e-4, rtol=1e-5)


def test_paged_rows_see_only_their_prefix(randn):
    """Changing a key after position p must not change query rows at positions <= p."""
    cache, (s,), ks, vs = build(randn, [40], 1, 1, 64, 16, torch.float16)
    q = randn(6, 1, 64, dtype=torch.float16)
    out1, lse1 = paged_attention_ref(q, cache, 0, [s], [6])
    cache.write(s, 0, 37, randn(1, 1, 64, dtype=torch.float16), randn(1, 1, 64, dtype=torch.float16))
    out2, lse2 = paged_attention_ref(q, cache, 0, [s], [6])
    # Rows 0..2 sit at positions 34..36; rows 3..5 (positions 37..39) see the new key.
    assert torch.equal(out1[:3], out2[:3]) and torch.equal(lse1[:3], lse2[:3])
    assert not torch.equal(lse1[3:], lse2[3:])


# ---- errors -------------------------------------------------------------------------------------
def test_paged_errors(randn):
    cache, seq_ids, _, _ = build(randn, [20, 9], 2, 2, 64, 16, torch.bfloat16)
    q = randn(3, 4, 64)
    with pytest.raises(ValueError, match="q_lens sums to 2"):
        paged_attention_ref(q, cache, 0, seq_ids)
    with pytest.raises(ValueError, match="q has 3 rows but q_lens sums to 4"):
        paged_attention_ref(q, cache, 0, seq_ids, [2, 2])
    with pytest.raises(ValueError, match="2 entries for 1 sequences"):
        paged_attention_ref(q, cache, 0, seq_ids[:1], [1, 2])
    with pytest.raises(ValueError, match=r"q_lens\[1\] = 11"):
        paged_attention_ref(randn(12, 4, 64), cache, 0, seq_ids, [1, 11])
    with pytest.raises(ValueError, match="not a multiple of Hkv"):
        paged_attention_ref(randn(2, 3, 64), cache, 0, seq_ids)
    with pytest.raises(ValueError, match="head_dim 128"):
        paged_attention_ref(randn(2, 4, 128), cache, 0, seq_ids)
    with pytest.raises(TypeError, match="dtype torch.float16"):
        paged_attention_ref(randn(2, 4, 64, dtype=torch.float16), cache, 0, seq_ids)
    with pytest.raises(ValueError, match="3-D"):
        paged_attention_ref(randn(2, 256), cache, 0, seq_ids)
    with pytest.raises(IndexError, match="layer 2"):
        paged_attention_ref(randn(2, 4, 64), cache, 2, seq_ids)
    empty = cache.add_sequence()
    with pytest.raises(ValueError, match="empty"):
        paged_attention_ref(randn(1, 4, 64), cache, 0, [empty])


def test_dense_errors(randn):
    k, v = randn(5, 2, 16), randn(5, 2, 16)
    with pytest.raises(ValueError, match="q has 2 rows"):
        dense_attention_ref(randn(2, 4, 16), [k], [v], [1], None)
    with pytest.raises(ValueError, match="not a multiple"):
        dense_attention_ref(randn(1, 3, 16), [k], [v], None, None)
    with pytest.raises(ValueError, match=r"\(L, Hkv, 16\)"):
        dense_attention_ref(randn(1, 4, 16), [randn(5, 2, 8)], [randn(5, 2, 8)], None, None)
    with pytest.raises(TypeError, match="dtypes"):
        dense_attention_ref(randn(1, 4, 16), [k.half()], [v.half()], None, None)
    with pytest.raises(ValueError, match="one K and one V"):
        dense_attention_ref(randn(1, 4, 16), [k], [], None, None)
    with pytest.raises(ValueError, match=r"q_lens\[0\] = 6"):
        dense_attention_ref(randn(6, 4, 16), [k], [v], [6], None)


def test_dense_reference_in_row_blocks_equals_one_block(monkeypatch):
    """The dense reference computes a long call's scores in blocks of query rows (bounded memory):
    blocks of 3 rows give what one block gives, causal rows and GQA included."""
    import directkv_cute.reference as R

    torch.manual_seed(0)
    ks = [torch.randn(300, 2, 16, dtype=torch.float64), torch.randn(77, 2, 16, dtype=torch.float64)]
    vs = [torch.randn_like(k) for k in ks]
    q = torch.randn(45, 8, 16, dtype=torch.float64)
    whole = R.dense_attention_ref(q, ks, vs, [40, 5], None, dtype=torch.float64)
    monkeypatch.setattr(R, "_SCORES_PER_CHUNK", 8 * 300 * 3)
    blocks = R.dense_attention_ref(q, ks, vs, [40, 5], None, dtype=torch.float64)
    for a, b in zip(whole, blocks):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
