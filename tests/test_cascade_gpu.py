"""GPU tests of cascade attention (``directkv_cute.cascade``) against the float32 per-sequence
reference: trees of forks with ragged suffixes, decode and multi-token steps, GQA groups, both
dtypes, spans whose query rows need several pseudo-sequences (staged once into HBM), hybrid
tiers, poisoned outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from directkv_cute.cache import PagedKVCache
from directkv_cute.cascade import plan_cascade
from directkv_cute.ops import cascade_attention
from directkv_cute.reference import paged_attention_ref

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def _kv(n, hkv, d, dtype, g):
    return (torch.randn(n, 1, hkv, d, device="cuda", generator=g).to(dtype),
            torch.randn(n, 1, hkv, d, device="cuda", generator=g).to(dtype))


def _tree(prompt: int, forks: list[tuple[int, int]], hkv: int, d: int, page: int, dtype, seed: int, hbm: int = 0):
    """A prompt, then forks: (parent index, own tokens) each; returns cache and ids (prompt
    first)."""
    g = torch.Generator("cuda").manual_seed(seed)
    cache = PagedKVCache(1, hkv, d, page, 4 * (prompt + sum(n for _, n in forks)) // page + 64 * len(forks) + 64,
                         hbm, dtype=dtype, device="cuda")
    ids = [cache.add_sequence()]
    cache.append(ids[0], *_kv(prompt, hkv, d, dtype, g))
    for parent, own in forks:
        child = cache.fork(ids[parent])
        if own:
            cache.append(child, *_kv(own, hkv, d, dtype, g))
        ids.append(child)
    return cache, ids, g


def _check(cache, ids, q_lens, hq, d, dtype, g, batch_rows=None):
    rows = ids if batch_rows is None else [ids[i] for i in batch_rows]
    for sid, n in zip(rows, q_lens):  # the step's new tokens
        cache.append(sid, *_kv(n, cache.num_kv_heads, d, dtype, g))
    q = torch.randn(sum(q_lens), hq, d, device="cuda", generator=g).to(dtype)
    t = cache.kernel_tables(rows)
    plan = plan_cascade(t.host_table, t.host_seq_lens, q_lens, cache.page_size)
    assert plan.shared and plan.host_pages_read < plan.host_pages_naive
    out = torch.full_like(q, float("nan"))
    o, lse = cascade_attention(q, cache, 0, rows, q_lens, tables=t, plan=plan, out=out, return_lse=True)
    torch.cuda.synchronize()
    ref_o, ref_lse = paged_attention_ref(q, cache, 0, rows, q_lens)
    assert o.data_ptr() == out.data_ptr() and not torch.isnan(o).any()
    err = ((o.double() - ref_o.double()).norm() / ref_o.double().norm()).item()
    assert err < 2e-2, err
    assert torch.allclose(lse, ref_lse, atol=2e-3, rtol=1e-4), (lse - ref_lse).abs().max()
    return plan


@pytest.mark.parametrize("batch,own,q_len,hq,hkv,dtype", [
    (16, [0, 70, 300, 1000], 1, 32, 8, torch.bfloat16),   # one span, one pseudo-sequence (64 rows)
    (64, [0, 5, 129], 1, 32, 8, torch.float16),          # 256 rows: two pseudo-sequences, staged
    (8, [0, 64, 900], 16, 32, 8, torch.bfloat16),        # 512 rows: staged Q-tiled pass
    (5, [1, 300], 3, 16, 16, torch.float16),             # MHA, ragged q
])
def test_cascade_over_forks_of_one_prompt(batch, own, q_len, hq, hkv, dtype):
    forks = [(0, own[i % len(own)]) for i in range(batch)]
    cache, ids, g = _tree(4096 + 37, forks, hkv, 128, 64, dtype, seed=batch)
    rows = list(range(1, batch + 1))
    plan = _check(cache, ids, [q_len] * batch, hq, 128, dtype, g, rows)
    assert len(plan.spans) == 1 and len(plan.spans[0].rows) == batch
    cache.close()


def test_cascade_over_a_nested_tree_with_hybrid_pages():
    # prompt -> A, B; A -> A1, A2, A3 (after 2k more tokens); B -> B1; rows: A1 A2 A3 B B1 and the prompt
    forks = [(0, 2048), (0, 100), (1, 30), (1, 700), (1, 0), (2, 513)]
    cache, ids, g = _tree(3000, forks, 8, 128, 16, torch.bfloat16, seed=7, hbm=512)
    cache.move_pages(ids[0], range(10, 40), "hbm")  # shared prompt pages in HBM: every sharer sees them
    rows = [0, 2, 3, 4, 5, 6]
    plan = _check(cache, ids, [1, 4, 1, 2, 1, 1], 32, 128, torch.bfloat16, g, rows)
    assert any(len(s.rows) == 3 for s in plan.spans), "the nested span of A's forks"
    cache.close()


def test_cascade_without_sharing_is_the_plain_op():
    g = torch.Generator("cuda").manual_seed(1)
    cache = PagedKVCache(1, 8, 128, 64, 256, 0, dtype=torch.bfloat16, device="cuda")
    ids = [cache.add_sequence() for _ in range(3)]
    for sid, n in zip(ids, (1000, 2000, 17)):
        cache.append(sid, *_kv(n, 8, 128, torch.bfloat16, g))
    q = torch.randn(3, 32, 128, device="cuda", generator=g).to(torch.bfloat16)
    t = cache.kernel_tables(ids)
    assert not plan_cascade(t.host_table, t.host_seq_lens, [1, 1, 1], 64).shared
    o = cascade_attention(q, cache, 0, ids, tables=t)
    from directkv_cute.ops import paged_attention_tables

    assert torch.equal(o, paged_attention_tables(q, cache, 0, t))
    cache.close()
