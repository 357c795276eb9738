"""Sparse decode reads (``directkv_cute.sparse``): the budget, the page selection against an
independent numpy reference of the page estimates (from each page's K rows), and the planner's route. Attention over the
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
from directkv_cute.sparse import SparseBudget, SparseStats, page_scores, parse_budget, select_pages


@pytest.mark.parametrize("kwargs, err", [
    ({}, ValueError), ({"fraction": 0.5, "pages": 4}, ValueError), ({"fraction": 0.0}, ValueError),
    ({"fraction": 1.5}, ValueError), ({"fraction": float("nan")}, ValueError), ({"fraction": "1/8"}, TypeError),
    ({"fraction": True}, TypeError), ({"pages": 0}, ValueError), ({"pages": 2.0}, TypeError),
    ({"pages": 4, "sink_pages": -1}, ValueError), ({"pages": 4, "recent_pages": 0}, ValueError),
])
def test_a_budget_that_cannot_be_read_is_refused_naming_the_field(kwargs, err):
    with pytest.raises(err, match="SparseBudget"):
        SparseBudget(**kwargs)


def test_a_command_lines_budget():
    assert parse_budget("1/8") == SparseBudget(fraction=0.125)
    assert parse_budget(" 0.25 ") == SparseBudget(fraction=0.25)
    assert parse_budget("256p") == SparseBudget(pages=256)
    for bad in ("", "1/0", "x", "0", "2", "-1/8", "0p", "1.5p", "nan"):
        with pytest.raises(ValueError) as e:
            parse_budget(bad)
        assert "\n" not in str(e.value) and "sparse budget" in str(e.value)


def test_budget_pages():
    assert SparseBudget(fraction=1 / 8).budget_pages(2048) == 256
    assert SparseBudget(fraction=1 / 8).budget_pages(9) == 3  # at least sink + recent
    assert SparseBudget(pages=40).budget_pages(16) == 16  # never more than there are
    assert SparseBudget(fraction=1 / 16, sink_pages=0, recent_pages=1).budget_pages(8) == 1


def _summaries(rng, n_host, n_hbm, layers, hkv, d, rows=16):
    """Summaries of random full pages of ``rows`` rows: each page's K rows drawn (kept as
    ``host_k`` / ``hbm_k`` for the reference), their sum and sum of squares."""
    def one(n):
        shift = rng.standard_normal((n, 1, 1, 1, d)) * rng.uniform(0, 2, (n, 1, 1, 1, 1))
        k = torch.from_numpy(rng.standard_normal((n, layers, hkv, rows, d)) * rng.uniform(0.2, 3, (n, 1, 1, 1, 1))
                             + shift)
        return k, torch.stack((k.sum(3), (k * k).sum(3)), dim=3).float()  # (n, layers, hkv, 2, d)
    (hk, h), (bk, b) = one(n_host), one(n_hbm)
    return SimpleNamespace(host=h, hbm=b, host_k=hk, hbm_k=bk, host_rows={})


def _partial_page(summ, e, rows):
    """Host page ``e`` of ``summ`` cut to its first ``rows`` K rows, its summary with it; returns ``e``."""
    k = summ.host_k[e, :, :, :rows]  # (layers, hkv, rows, d)
    summ.host[e] = torch.stack((k.sum(2), (k * k).sum(2)), dim=2).float()
    for layer in range(k.shape[0]):
        summ.host_rows[e, layer] = k[layer]
    return e


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
            rows = summ.hbm_k[-e - 1, layer] if e < 0 else getattr(summ, "host_rows", {}).get((e, layer))
            rows = summ.host_k[e, layer] if rows is None else rows  # (Hkv, rows, d)
            rows = rows.double().numpy()
            mean, var = rows.mean(axis=1), rows.var(axis=1)  # (Hkv, d)
            g = Hq // rows.shape[0]
            sc = 1 / math.sqrt(d)
            s.append([sc * q[b, h] @ mean[h // g] + sc**2 / 2 * (q[b, h] ** 2) @ var[h // g] for h in range(Hq)])
        s = np.array(s)  # (n, Hq): each page's estimated logit per head
        if n <= sink + recent:
            rel = np.zeros(n)
        else:  # a softmax over the row's pages per head, summed over the heads
            e = np.exp(s - s.max(axis=0))
            rel = (e / e.sum(axis=0)).sum(axis=1)
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
    summ = _summaries(rng, 200 + len(lens), 40, layers, hkv, d)
    table = np.zeros((len(lens), W), np.int32)
    for b, n in enumerate(lens):
        k = -(-n // P)
        host = rng.choice(200, size=k, replace=False)
        hbm = rng.random(k) < 0.3  # some pages read from HBM mirrors
        table[b, :k] = np.where(hbm, -rng.integers(0, 40, k) - 1, host)
        tail = n - (k - 1) * P
        if tail < P:  # the newest page holds its first rows only: a page of its own, summarized over them
            table[b, k - 1] = _partial_page(summ, 200 + b, tail)
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


def _dense(q, k, v, scale):
    """float64 attention of one decode row q (Hq, d) over k, v (n, Hkv, d)."""
    g = q.shape[0] // k.shape[1]
    s = torch.einsum("hd,nhd->hn", q.double(), k.double().repeat_interleave(g, 1)) * scale
    return torch.einsum("hn,nhd->hd", s.softmax(-1), v.double().repeat_interleave(g, 1))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sparse_decode_over_a_cache_attends_exactly_the_selected_pages(dtype, device):
    """``DirectKVAttention.plan(sparse=...)`` over a ``PagedKVCache(summaries=True)`` (the
    reference on the CPU; on a GPU the selection there and the decode kernels over host pages in
    place): ragged sequences (one within the budget), GQA, some pages moved to HBM, output
    poisoned first; each row's output equals float64 attention over exactly the pages an
    independent selection (min / max taken from the pools' own K rows) chooses, and a budget
    covering every page equals exact attention."""
    from directkv_cute.attention import DirectKVAttention
    from directkv_cute.cache import PagedKVCache

    torch.manual_seed(0)
    P, L, hkv, hq, d = 16, 2, 2, 8, 64
    cache = PagedKVCache(L, hkv, d, P, 64, 16, dtype=dtype, device=device, summaries=True)
    lens = [21 * P + 3, 2 * P + 1, 12 * P]
    kv = {}
    for n in lens:
        sid = cache.add_sequence()
        k = torch.randn(n, L, hkv, d) * torch.rand(n, 1, 1, 1) * 3  # pages of different spread
        v = torch.randn(n, L, hkv, d)
        cache.append(sid, k.to(dtype).to(device), v.to(dtype).to(device))
        kv[sid] = (k.to(dtype), v.to(dtype))
    sids = list(kv)
    cache.move_pages(sids[0], [3, 4, 20], "hbm")
    budget = SparseBudget(pages=6, sink_pages=1, recent_pages=2)
    tables = cache.kernel_tables(sids)
    dk = DirectKVAttention(cache)
    stats = SparseStats()
    dk.sparse_hooks.append(stats)
    plan = dk.plan(tables=tables, num_q_heads=hq, sparse=budget)
    assert plan.route == "sparse_decode" and plan.detail.pages == 6
    masses, oracles = [], []
    scale = 1 / math.sqrt(d)
    host, hbm = cache.device_pool("host"), cache.device_pool("hbm")
    for layer in range(L):
        q = torch.randn(len(sids), hq, d).to(dtype)
        out = torch.full_like(q, float("nan"), device=device)
        dk.run(q.to(device), layer, out)
        out = out.cpu()
        # the selection again, from the pools' K rows (not from the cache's summaries)
        table = tables.page_table.cpu().numpy()
        for b, sid in enumerate(sids):
            n = lens[b]
            pages = -(-n // P)
            rows = [min(P, n - j * P) for j in range(pages)]
            fake = SimpleNamespace(host_k={}, hbm_k=None)  # (page, layer) -> its K rows (Hkv, rows, d)
            for j in range(pages):
                e = int(table[b, j])
                fake.host_k[j, layer] = (host[e] if e >= 0 else hbm[-e - 1])[layer, :, 0, : rows[j]].float().cpu()
            want = _reference_selection(q[b:b + 1].float(), np.arange(pages)[None], [n], fake, layer, P, 6, 1, 2)[0]
            keys = torch.cat([kv[sid][0][j * P: j * P + rows[j], layer] for j in want])
            vals = torch.cat([kv[sid][1][j * P: j * P + rows[j], layer] for j in want])
            torch.testing.assert_close(out[b].double(), _dense(q[b], keys, vals, scale), atol=2e-2, rtol=2e-2)
            # the share of each head's exact softmax on the chosen pages, averaged over the heads
            g = hq // hkv
            logits = torch.einsum("hd,nhd->hn", q[b].double(), kv[sid][0][:, layer].double().repeat_interleave(g, 1))
            probs = (logits * scale).softmax(-1)
            on = torch.zeros(n, dtype=torch.bool)
            for j in want:
                on[j * P: j * P + rows[j]] = True
            masses.append(float(probs[:, on].sum(-1).mean()))
            # the best set of as many pages for all heads: the largest mean page masses
            per_page = torch.stack([probs[:, j * P: j * P + rows[j]].sum(-1).mean() for j in range(pages)])
            oracles.append(float(per_page.topk(len(want)).values.sum()))
    assert stats.count == L * len(sids)
    assert stats.mass == pytest.approx(sum(masses) / len(masses), abs=2e-3)
    assert stats.oracle_mass == pytest.approx(sum(oracles) / len(oracles), abs=2e-3)
    assert stats.oracle_mass >= stats.mass - 1e-6
    per_layer = stats.by_layer
    assert sorted(per_layer) == list(range(L))
    for layer, (m, o) in per_layer.items():  # each layer's rows: the same numbers, per layer
        rows = slice(layer * len(sids), (layer + 1) * len(sids))
        assert m == pytest.approx(sum(masses[rows]) / len(sids), abs=2e-3)
        assert o == pytest.approx(sum(oracles[rows]) / len(sids), abs=2e-3)
    assert 0 < stats.mass < 1  # one row within the budget holds all its mass, the others less
    full = dk.plan(tables=tables, num_q_heads=hq, sparse=SparseBudget(fraction=1.0))
    assert full.route != "sparse_decode"
    q = torch.randn(len(sids), hq, d).to(dtype)
    out = dk.run(q.to(device), 1).cpu()
    for b, sid in enumerate(sids):
        torch.testing.assert_close(out[b].double(), _dense(q[b], kv[sid][0][:, 1], kv[sid][1][:, 1], scale),
                                   atol=2e-2, rtol=2e-2)


def test_a_sparse_budget_needs_a_cache_with_page_summaries():
    from directkv_cute.attention import DirectKVAttention
    from directkv_cute.cache import PagedKVCache

    cache = PagedKVCache(1, 1, 16, 16, 8, 0, device="cpu")
    sid = cache.add_sequence()
    cache.append(sid, torch.zeros(40, 1, 1, 16, dtype=torch.bfloat16), torch.zeros(40, 1, 1, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="summaries=True"):
        DirectKVAttention(cache).plan(seq_ids=[sid], num_q_heads=1, sparse=SparseBudget(pages=1))
    with pytest.raises(TypeError, match="SparseBudget"):
        DirectKVAttention(cache).plan(seq_ids=[sid], num_q_heads=1, sparse=0.125)


def test_directkv_cache_decodes_under_a_budget_and_prompts_stay_exact():
    """``DirectKVCache(sparse=...)`` on a random tiny model: the prompt step is planned exactly,
    a decode step under the budget (the sparse route, named with its pages by ``explain()``), the
    tokens of a budget that covers every page equal exact decoding, and a wrong type is refused."""
    import directkv_cute.hf  # noqa: F401  (registers the attention implementation)
    from directkv_cute.hf.cache import DirectKVCache
    from directkv_cute.presets import build_random_model

    model = build_random_model("tiny", torch.float32, "cpu", seed=0, num_hidden_layers=2,
                               attn_implementation="directkv")
    ids = torch.randint(0, 1024, (1, 200), generator=torch.Generator().manual_seed(3))

    def generate(sparse):
        cache = DirectKVCache(model, max_tokens=260, page_size=16, sparse=sparse)
        with torch.no_grad():
            return model.generate(ids, past_key_values=cache, max_new_tokens=5, do_sample=False)[0, 200:]

    assert torch.equal(generate(SparseBudget(fraction=1.0)), generate(None))
    cache = DirectKVCache(model, max_tokens=260, page_size=16, sparse=SparseBudget(pages=4, sink_pages=1,
                                                                                   recent_pages=1), sparse_stats=True)
    with torch.no_grad():
        logits = model(ids, past_key_values=cache).logits
        assert cache.last_plan.route == "reference"  # the prompt: exact
        assert cache.sparse_stats.mass is None  # prompt steps are not sparse
        model(logits[:, -1:].argmax(-1), past_key_values=cache)
    assert cache.last_plan.route == "sparse_decode" and "4 pages per row" in cache.last_plan.explain()
    assert cache.sparse_stats.count == 2 and 0 < cache.sparse_stats.mass < 1  # 2 layers x 1 row; 4 of 13 pages
    cache.reset()
    assert cache.sparse_stats.mass is None
    with pytest.raises(TypeError, match="sparse_stats"):
        DirectKVCache(model, max_tokens=64, sparse=SparseBudget(pages=4), sparse_stats=1)
    with pytest.raises(TypeError, match="SparseBudget"):
        DirectKVCache(model, max_tokens=64, sparse="1/8")


@pytest.mark.parametrize("bad", ["2", "1/0", "eighth", "0p"])
def test_directkv_generate_refuses_a_bad_sparse_budget_in_one_line(bad, capsys):
    from directkv_cute.generate import main

    with pytest.raises(SystemExit) as e:
        main(["--preset", "tiny", "--context", "64", "--device", "cpu", "--sparse-budget", bad])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and "--sparse-budget" in err[-1] and "Traceback" not in "".join(err)


def test_recall_targets_keep_sinks_newest_then_preferred_then_recent():
    from directkv_cute.hf.step_plan import Growth, growth_needs, hbm_targets, plan_growth

    assert hbm_targets(20, 6, 1) == {0, 15, 16, 17, 18, 19}  # no ranking: sinks and the most recent
    assert hbm_targets(20, 6, 1, [7, 3, 19, 12, 5], recent_pages=2) == {0, 19, 18, 7, 3, 12}
    assert hbm_targets(20, 6, 1, [7], recent_pages=2) == {0, 19, 18, 7, 17, 16}  # the rest: most recent
    assert hbm_targets(3, 6, 1, [2, 1], recent_pages=1) == {0, 1, 2}
    # a sequence of 10 full pages of 16 with 0, 8, 9 in HBM, growing by one token: 8 leaves for the
    # preferred 4; the new page (10) is among the newest 2; 9 stays
    g = plan_growth(160, [0, 8, 9], 1, 16, 4, 1, preferred=[4, 2], recent_pages=2)
    assert g == Growth(demote=(8,), runs=(("hbm", 1),), promote=(4,))
    assert growth_needs([g], [160], 16) == {"host": 0, "hbm": 1}  # +1 new, +1 promoted, -1 demoted
    # a partial last page is extended where it is, never promoted
    g = plan_growth(150, [0], 1, 16, 4, 1, preferred=[9, 3], recent_pages=1)
    assert g.promote == (3,) and g.runs == (("host", 1),)
    # without a ranking nothing is promoted (the plain rule)
    assert plan_growth(160, [0], 1, 16, 4, 1).promote == ()


def test_recall_counts_each_selection_once_per_tier():
    from directkv_cute.sparse import RecallCounts

    rc = RecallCounts(10, 4, "cpu")
    sel = torch.tensor([[0, 3, -2, 5, 5, 5], [3, -1, -2, 7, 8, 9]], dtype=torch.int32)  # row 0 repeats its last page
    rc.selected(None, None, None, sel)
    rc.selected(None, None, None, sel[:1])
    host, hbm = rc.take()
    assert host.tolist() == [2, 0, 0, 3, 0, 2, 0, 1, 1, 1]
    assert hbm.tolist() == [1, 3, 0, 0]
    host, hbm = rc.take()
    assert not host.any() and not hbm.any()


def test_the_hbm_tier_recalls_the_pages_sparse_decode_keeps_choosing():
    """A tiny model decoding under a page budget over a cache whose HBM tier holds 6 of a
    sequence's pages: pages its selections keep choosing move into HBM (beyond the sinks and the
    newest pages), and the tokens equal those of the same budget over host pages only (moves do
    not change what is read)."""
    import directkv_cute.hf  # noqa: F401  (registers the attention implementation)
    from directkv_cute.hf.cache import DirectKVCache
    from directkv_cute.cache.pools import page_bytes
    from directkv_cute.presets import build_random_model

    model = build_random_model("tiny", torch.float32, "cpu", seed=1, num_hidden_layers=2,
                               attn_implementation="directkv")
    ids = torch.randint(0, 1024, (1, 300), generator=torch.Generator().manual_seed(4))
    budget = SparseBudget(pages=5, sink_pages=1, recent_pages=1)
    spec = model.config
    hd = spec.hidden_size // spec.num_attention_heads
    one_page = page_bytes(2, spec.num_key_value_heads, 16, hd, torch.float32)

    def generate(hbm_pages):
        cache = DirectKVCache(model, max_tokens=340, page_size=16, sparse=budget, hbm_budget=hbm_pages * one_page,
                              window_tokens=0)
        with torch.no_grad():
            out = model.generate(ids, past_key_values=cache, max_new_tokens=12, do_sample=False)[0, 300:]
        return out, cache

    exact_tier, _ = generate(0)
    tokens, cache = generate(6)
    assert torch.equal(tokens, exact_tier)
    sid = cache.seq_ids[0]
    table = cache.kv.page_table(sid)
    n = len(table)
    in_hbm = {lp for lp, e in enumerate(table) if e < 0}
    assert len(in_hbm) <= 6 and 0 in in_hbm
    recalled = in_hbm - {0, n - 1}
    assert recalled, f"no page recalled into HBM: {sorted(in_hbm)} of {n}"
    scores = cache._batch._scores[sid]
    assert all(scores[lp] >= 0.5 * 2 for lp in recalled if lp < n - 6)  # chosen, not merely recent


def test_recall_with_a_batch_and_the_write_window():
    """Two rows, a tier of a few pages and the default write window (a decode step's table names
    the window's mirror of each row's newest page, past the tier's pages): the recall counts every
    page the tables name, and the tokens equal those of the same budget over host pages only."""
    import directkv_cute.hf  # noqa: F401  (registers the attention implementation)
    from directkv_cute.hf.cache import DirectKVCache
    from directkv_cute.presets import build_random_model

    model = build_random_model("tiny", torch.float32, "cpu", seed=2, num_hidden_layers=2,
                               attn_implementation="directkv")
    ids = torch.randint(0, 1024, (2, 300), generator=torch.Generator().manual_seed(5))
    budget = SparseBudget(pages=5, sink_pages=1, recent_pages=1)

    def generate(hbm_budget):
        cache = DirectKVCache(model, max_tokens=700, max_batch_size=2, page_size=16, sparse=budget,
                              hbm_budget=hbm_budget)
        with torch.no_grad():
            out = model.generate(ids, **directkv_cute.hf.cache_kwargs(model, cache), max_new_tokens=10,
                                 do_sample=False)[:, 300:]
        return out, cache

    host_only, _ = generate(0)
    tokens, cache = generate(1 << 15)
    assert cache.kv.device_pool("hbm").shape[0] > cache.kv.num_pages("hbm")  # the window's mirrors
    assert torch.equal(tokens, host_only)


def test_the_attention_mass_of_fp8_pages_reads_them_dequantized():
    """``selected_mass`` over FP8 pages (host and HBM) against float64 softmax over the keys the
    cache itself returns (dequantized), for a chosen subset of each row's pages."""
    from directkv_cute.cache import PagedKVCache
    from directkv_cute.sparse import selected_mass

    torch.manual_seed(3)
    P, L, hkv, hq, d = 16, 2, 2, 4, 64
    cache = PagedKVCache(L, hkv, d, P, 32, 8, dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16, device="cpu")
    lens = [7 * P + 5, 3 * P]
    sids = []
    for n in lens:
        sid = cache.add_sequence()
        cache.append(sid, torch.randn(n, L, hkv, d, dtype=torch.bfloat16) * 2,
                     torch.randn(n, L, hkv, d, dtype=torch.bfloat16))
        sids.append(sid)
    cache.move_pages(sids[0], [2, 5], "hbm")
    tables = cache.kernel_tables(sids)
    chosen = [[0, 2, 7], [0, 1, 2]]  # page positions per row
    sel = torch.stack([tables.page_table[b, chosen[b]] for b in range(2)])
    q = torch.randn(2, hq, d)
    layer, scale = 1, 0.125
    got = selected_mass(q, tables.page_table, tables.seq_lens, sel, cache, layer, scale)
    for b, sid in enumerate(sids):
        k, _ = cache.read(sid, layer)  # (n, Hkv, d), dequantized
        probs = (torch.einsum("hd,nhd->hn", q[b].double(), k.double().repeat_interleave(hq // hkv, 1)) * scale
                 ).softmax(-1)
        on = torch.zeros(lens[b], dtype=torch.bool)
        for j in chosen[b]:
            on[j * P:(j + 1) * P] = True
        assert float(got[b]) == pytest.approx(float(probs[:, on].sum(-1).mean()), abs=1e-3)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_ops_take_a_budget_and_attend_the_selected_pages(device):
    """``paged_attention`` and ``paged_attention_tables`` with ``sparse=``: each decode row equals
    float64 attention over the pages an independent selection (the float64 reference selection
    over min / max taken from the pools' K rows) picks; output poisoned first; without a budget
    the same call is exact."""
    from directkv_cute import paged_attention, paged_attention_tables
    from directkv_cute.cache import PagedKVCache

    torch.manual_seed(3)
    P, L, hkv, hq, d, dtype = 16, 1, 2, 4, 64, torch.bfloat16
    cache = PagedKVCache(L, hkv, d, P, 48, 8, dtype=dtype, device=device, summaries=True)
    lens, kv = [17 * P + 5, 9 * P], {}
    for n in lens:
        sid = cache.add_sequence()
        k = (torch.randn(n, L, hkv, d) * torch.rand(n, 1, 1, 1) * 3).to(dtype)
        v = torch.randn(n, L, hkv, d).to(dtype)
        cache.append(sid, k.to(device), v.to(device))
        kv[sid] = (k, v)
    sids = list(kv)
    budget = SparseBudget(pages=5, sink_pages=1, recent_pages=1)
    q = torch.randn(len(sids), hq, d).to(dtype).to(device)
    outs = [paged_attention(q, cache, 0, sids, sparse=budget, out=torch.full_like(q, float("nan")))]
    if device == "cuda":
        outs.append(paged_attention_tables(q, cache, 0, cache.kernel_tables(sids), sparse=budget))
    exact = paged_attention(q, cache, 0, sids).cpu()
    host = cache.device_pool("host")
    for out in outs:
        out = out.cpu()
        for b, sid in enumerate(sids):
            n, table = lens[b], cache.page_table(sid)
            pages = -(-n // P)
            rows = [min(P, n - j * P) for j in range(pages)]
            fake = SimpleNamespace(host_k={(j, 0): host[table[j]][0, :, 0, :rows[j]].float().cpu()
                                           for j in range(pages)}, hbm_k=None)
            want = _reference_selection(q[b:b + 1].float().cpu(), np.arange(pages)[None], [n], fake, 0, P, 5, 1, 1)[0]
            assert len(want) == 5
            keys = torch.cat([kv[sid][0][j * P: j * P + rows[j], 0] for j in want])
            vals = torch.cat([kv[sid][1][j * P: j * P + rows[j], 0] for j in want])
            torch.testing.assert_close(out[b].double(), _dense(q[b].cpu(), keys, vals, 1 / math.sqrt(d)),
                                       atol=2e-2, rtol=2e-2)
            full = _dense(q[b].cpu(), kv[sid][0][:, 0], kv[sid][1][:, 0], 1 / math.sqrt(d))
            torch.testing.assert_close(exact[b].double(), full, atol=2e-2, rtol=2e-2)
            assert not torch.allclose(out[b].double(), full, atol=2e-2, rtol=2e-2)  # fewer pages: another result


def test_a_bound_selector_follows_tables_written_in_place():
    """``PageSelector`` (a plan's selection, reused over tables that a CUDA graph's steps write in
    place): after the lengths and the page table change in place, each layer's selection equals
    ``select_pages`` over the new tables (the rows' state is remade on each write); under a
    capture it is remade on every call, so a replay remakes it per step."""
    from directkv_cute.sparse import PageSelector

    rng = np.random.default_rng(11)
    P, hkv, Hq, d, budget = 8, 2, 4, 16, 5
    summ = _summaries(rng, 64, 0, 2, hkv, d)
    summ.hbm = torch.zeros(0, 2, hkv, 2, d)
    table = torch.from_numpy(rng.choice(64, size=(2, 12), replace=False).astype(np.int32))
    lens = torch.tensor([12 * P, 3 * P + 2], dtype=torch.int32)
    sel = PageSelector(table, lens, P, budget, 1, 1, "cpu")
    for step in range(3):
        for layer in range(2):
            q = torch.randn(2, Hq, d)
            sel.select(q, summ, layer, 0.25)
            want_t, want_l = select_pages(q, table, lens, summ, layer, P, budget, 1, 1, 0.25)
            assert torch.equal(sel.table, want_t) and torch.equal(sel.lens, want_l), (step, layer)
        lens.copy_(torch.tensor([[5 * P + 1, 12 * P], [9 * P, 2]][step % 2], dtype=torch.int32))
        table[0].copy_(table[0].flip(0))
    lens.numpy()[1] = 7 * P  # a write torch does not see (no version change): only a capture's call remakes
    q = torch.randn(2, Hq, d)
    sel.select(q, summ, 0, 0.25, capturing=True)
    want_t, want_l = select_pages(q, table, lens, summ, 0, P, budget, 1, 1, 0.25)
    assert torch.equal(sel.table, want_t) and torch.equal(sel.lens, want_l)


def test_a_selector_over_inference_tensors_selects_anew_each_call():
    """Tables made under ``torch.inference_mode`` keep no version counter: the selector remakes
    the rows' state every call and selects as ``select_pages`` does."""
    from directkv_cute.sparse import PageSelector

    rng = np.random.default_rng(2)
    summ = _summaries(rng, 32, 0, 1, 2, 16)
    summ.hbm = torch.zeros(0, 1, 2, 2, 16)
    with torch.inference_mode():
        table = torch.from_numpy(rng.choice(32, size=(2, 10), replace=False).astype(np.int32)).clone()
        lens = torch.tensor([10 * 8, 4 * 8 + 3], dtype=torch.int32)
        sel = PageSelector(table, lens, 8, 4, 1, 1, "cpu")
        for n in (10 * 8, 6 * 8):
            lens[0] = n
            q = torch.randn(2, 4, 16)
            sel.select(q, summ, 0, 0.25)
            want_t, want_l = select_pages(q, table, lens, summ, 0, 8, 4, 1, 1, 0.25)
            assert torch.equal(sel.table, want_t) and torch.equal(sel.lens, want_l)


def test_sparse_stats_means_overall_and_per_layer():
    """``SparseStats.record``: the overall means weigh every row once; ``by_layer`` holds the
    layers given, in order; rows recorded without a layer count overall only."""
    stats = SparseStats()
    assert stats.mass is None and stats.oracle_mass is None and stats.by_layer == {}
    stats.record(torch.tensor([0.5, 0.7]), torch.tensor([0.6, 0.8]), layer=3)
    stats.record(torch.tensor([0.9]), torch.tensor([1.0]), layer=1)
    stats.record(torch.tensor([0.1]))
    assert stats.count == 4
    assert stats.mass == pytest.approx((0.5 + 0.7 + 0.9 + 0.1) / 4)
    assert stats.oracle_mass == pytest.approx((0.6 + 0.8 + 1.0) / 4)
    assert list(stats.by_layer) == [1, 3]
    assert stats.by_layer[3] == pytest.approx((0.6, 0.7)) and stats.by_layer[1] == pytest.approx((0.9, 1.0))
    stats.reset()
    assert stats.count == 0 and stats.by_layer == {}
