"""Sparse decode reads (``directkv_cute.sparse``): the budget, the page selection against an
independent numpy reference of the Quest bound, and the planner's route. Attention over the
selected pages against a float64 reference is in the end-to-end tests below (over a cache with
page summaries)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from directkv_cute.machine import H200, DeviceInfo
from directkv_cute.plan_types import CallShape, ProfileConfigs
from directkv_cute.planner import plan_attention
from directkv_cute.sparse import SparseBudget, page_scores, select_pages


@pytest.mark.parametrize("kwargs, err", [
    ({}, ValueError), ({"fraction": 0.5, "pages": 4}, ValueError), ({"fraction": 0.0}, ValueError),
    ({"fraction": 1.5}, ValueError), ({"fraction": float("nan")}, ValueError), ({"fraction": "1/8"}, TypeError),
    ({"fraction": True}, TypeError), ({"pages": 0}, ValueError), ({"pages": 2.0}, TypeError),
    ({"pages": 4, "sink_pages": -1}, ValueError), ({"pages": 4, "recent_pages": 0}, ValueError),
])
def test_a_budget_that_cannot_be_read_is_refused_naming_the_field(kwargs, err):
    with pytest.raises(err, match="SparseBudget"):
        SparseBudget(**kwargs)


def test_budget_pages():
    assert SparseBudget(fraction=1 / 8).budget_pages(2048) == 256
    assert SparseBudget(fraction=1 / 8).budget_pages(9) == 3  # at least sink + recent
    assert SparseBudget(pages=40).budget_pages(16) == 16  # never more than there are
    assert SparseBudget(fraction=1 / 16, sink_pages=0, recent_pages=1).budget_pages(8) == 1


def _summaries(rng, n_host, n_hbm, layers, hkv, d, rows=8):
    """Summaries of random pages: each page's K rows drawn, their min and max (the test's own)."""
    def one(n):
        k = torch.from_numpy(rng.standard_normal((n, layers, hkv, rows, d)) * rng.uniform(0.2, 3, (n, 1, 1, 1, 1)))
        return torch.stack((k.amin(3), k.amax(3)), dim=3).float()  # (n, layers, hkv, 2, d)
    return SimpleNamespace(host=one(n_host), hbm=one(n_hbm))


def _reference_selection(q, table, lens, summ, layer, P, budget, sink, recent):
    """numpy float64: per row, the chosen page positions (sinks, recents, then by score)."""
    q = q.double().numpy()
    B, Hq, d = q.shape
    out = []
    for b in range(B):
        n = -(-int(lens[b]) // P)
        s = []
        for j in range(n):
            e = int(table[b, j])
            page = summ.host[e, layer] if e >= 0 else summ.hbm[-e - 1, layer]  # (Hkv, 2, d)
            page = page.double().numpy()
            hkv = page.shape[0]
            g = Hq // hkv
            s.append([np.maximum(q[b, h] * page[h // g, 0], q[b, h] * page[h // g, 1]).sum() for h in range(Hq)])
        s = np.array(s)  # (n, Hq)
        rel = (s - s.max(axis=0)).max(axis=1)
        forced = [j for j in range(n) if j < sink or j >= n - recent]
        rest = sorted((j for j in range(n) if j not in forced), key=lambda j: -rel[j])
        out.append(sorted(forced + rest[: max(0, min(budget, n) - len(forced))]))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_selection_takes_the_sinks_the_newest_and_the_best_bounded_pages(seed):
    rng = np.random.default_rng(seed)
    P, layers, hkv, Hq, d, layer = 16, 2, 2, 8, 32, 1
    lens = [37 * P + 5, 3 * P, 20 * P + 1, 5]  # ragged: one under the budget, one of a single row
    W = max(-(-n // P) for n in lens)
    summ = _summaries(rng, 200, 40, layers, hkv, d)
    table = np.zeros((len(lens), W), np.int32)
    for b, n in enumerate(lens):
        k = -(-n // P)
        host = rng.choice(200, size=k, replace=False)
        hbm = rng.random(k) < 0.3  # some pages read from HBM mirrors
        table[b, :k] = np.where(hbm, -rng.integers(0, 40, k) - 1, host)
        table[b, k:] = table[b, k - 1]
    q = torch.from_numpy(rng.standard_normal((len(lens), Hq, d))).to(torch.bfloat16).float()
    budget, sink, recent = 8, 1, 2
    sel, sel_lens = select_pages(q, torch.from_numpy(table), torch.tensor(lens, dtype=torch.int32), summ, layer, P,
                                 budget, sink, recent)
    want = _reference_selection(q, table, lens, summ, layer, P, budget, sink, recent)
    for b, n in enumerate(lens):
        chosen = want[b]
        k = len(chosen)
        np.testing.assert_array_equal(sel[b, :k].numpy(), table[b, chosen])
        assert (sel[b, k:] == sel[b, k - 1]).all()  # the row's rest repeats its last page
        tail = n - (-(-n // P) - 1) * P
        assert int(sel_lens[b]) == (k - 1) * P + tail
        assert chosen[-1] == -(-n // P) - 1  # the newest page is read, last
    assert int(sel_lens[1]) == lens[1] and int(sel_lens[3]) == lens[3]  # within the budget: every page, exact


def test_selection_into_bound_buffers_and_scores_of_pages_past_a_sequence():
    rng = np.random.default_rng(5)
    summ = _summaries(rng, 20, 0, 1, 1, 8)
    summ.hbm = torch.zeros(0, 1, 1, 2, 8)
    table = torch.arange(12, dtype=torch.int32).view(2, 6)
    lens = torch.tensor([6 * 4, 2 * 4], dtype=torch.int32)
    q = torch.randn(2, 2, 8)
    s = page_scores(q, table, lens, summ, 0, 4, 1, 1)
    assert torch.isinf(s[1, 2:]).all() and (s[1, 2:] < 0).all()  # past the second sequence's pages
    assert s[0, 0] == math.inf and s[0, 5] == math.inf
    out_t, out_l = torch.full((2, 3), -7, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    t, l = select_pages(q, table, lens, summ, 0, 4, 3, 1, 1, out_table=out_t, out_lens=out_l)
    assert t is out_t and l is out_l and int(out_t[1, 0]) == 6 and int(out_l[1]) == 8


def test_decode_rows_under_a_budget_plan_the_selected_pages_and_prefill_stays_exact():
    info = DeviceInfo("NVIDIA H200", sms=132, total_memory=141 * 2**30)
    configs = ProfileConfigs("NVIDIA H200")
    budget = SparseBudget(fraction=1 / 8)
    shape = CallShape.example([131072], page_size=64).replace(sparse=budget)
    plan = plan_attention(shape, info, H200, configs)
    assert plan.route == "sparse_decode" and plan.detail.pages == 256
    inner = plan.detail.inner
    assert inner.route == "decode" and inner.shape.max_seq_len == 256 * 64 and inner.shape.host_table is None
    assert "256 of 2048 pages" in plan.explain() and "sparse:" in plan.explain()
    # prefill rows, and a budget that covers every page, are planned exactly as without one
    chunk = CallShape.example([131072], [2048], page_size=64)
    assert plan_attention(chunk.replace(sparse=budget), info, H200, configs).route == \
        plan_attention(chunk, info, H200, configs).route
    short = CallShape.example([64 * 3], page_size=64).replace(sparse=budget)  # 3 pages: sink + recent
    assert plan_attention(short, info, H200, configs).route == "decode"
    # on a CPU the selection feeds the reference
    cpu = plan_attention(shape, DeviceInfo.for_cpu(), H200, configs)
    assert cpu.route == "sparse_decode" and cpu.detail.inner.route == "reference"
