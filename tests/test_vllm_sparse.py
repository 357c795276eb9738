"""The sparse budget in the vLLM backend (``DIRECTKV_VLLM_SPARSE_BUDGET``): the variable, the
per-layer page summaries that ``step.store_kv`` keeps (``cache.summaries.StoreSummaries``) against
the sums and sums of squares recomputed here from the pools' K rows (host path with a dynamic HBM tier, fresh and
reused blocks, padding tokens; ``GraphDecode``'s fixed-size stores; prompt steps over every block),
and decode steps planned under the budget against float64 attention over exactly the pages an
independent selection picks (``test_sparse._reference_selection``), eager and over the graph
buffers; prompt rows stay exact. The builder itself (with vLLM installed): summaries only when the
variable is set, and a whole step through ``build`` and ``DirectKVImpl.forward`` on CPU pools."""

from __future__ import annotations

import math
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_sparse import _reference_selection
from test_vllm_graph import _dense, _mixed_step, _vllm_step

from directkv_cute import env
from directkv_cute.attention import DirectKVAttention
from directkv_cute.cache import KernelTables
from directkv_cute.cache.summaries import StoreSummaries
from directkv_cute.machine import H200, DeviceInfo
from directkv_cute.planner import CallShape, DefaultConfigs, plan_attention
from directkv_cute.runner import PoolView, plan_kernels, tables_from_host
from directkv_cute.sparse import SparseBudget
from directkv_cute.vllm.step import (
    EVERY_BLOCK,
    GraphDecode,
    HbmMirrors,
    every_block_step,
    mirror_table,
    page_table,
    slot_destinations,
    step_shape,
    store_kv,
    warmup_kernels,
    warmup_steps,
)

H200_FACTS = DeviceInfo("NVIDIA H200", sms=132, total_memory=141 * 2**30)


# ---- the variable ------------------------------------------------------------------------------
def test_the_variable_parses_a_budget_and_unset_is_exact(monkeypatch):
    name = env.VLLM_SPARSE_BUDGET
    assert name == "DIRECTKV_VLLM_SPARSE_BUDGET" and env.VARIABLES[name].kind == "budget"
    monkeypatch.delenv(name, raising=False)
    assert env.vllm_sparse_budget() is None
    for value, want in [("1/8", SparseBudget(fraction=1 / 8)), (" 0.25 ", SparseBudget(fraction=0.25)),
                        ("256p", SparseBudget(pages=256)), ("", None), ("  ", None)]:
        monkeypatch.setenv(name, value)
        assert env.vllm_sparse_budget() == want, value


@pytest.mark.parametrize("value", ["x", "0", "2", "1/0", "0p", "-1/8", "1.5p", "nan", "on"])
def test_a_bad_budget_is_one_line_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(env.VLLM_SPARSE_BUDGET, value)
    for read in (env.vllm_sparse_budget, env.check_all):
        with pytest.raises(env.EnvironmentVariableError) as e:
            read()
        text = str(e.value)
        assert text.startswith(f"DIRECTKV_VLLM_SPARSE_BUDGET={value!r}: not a sparse budget"), text
        assert "DIRECTKV_VLLM_SPARSE_BUDGET takes a fraction of the pages" in text and "\n" not in text


def test_reading_a_budget_imports_no_torch():
    code = ("import os, sys; os.environ['DIRECTKV_VLLM_SPARSE_BUDGET'] = '1/8'; import directkv_cute.env as e; "
            "e.check_all(); assert e.vllm_sparse_budget().fraction == 0.125; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- the summaries the stores keep -------------------------------------------------------------
def _want(pool, block, rows):
    """(Hkv, 2, d) float32: the sum and the sum of squares of the first ``rows`` K rows of
    ``pool``'s page ``block`` (zeros for none)."""
    k = pool[block, :, 0, :rows].double()  # (Hkv, rows, d)
    return torch.stack((k.sum(1), (k * k).sum(1)), dim=1).float()


def _check_summaries(summ, host, hbm, filled, mirrored):
    """Each host page's summary is its written rows' sums; each mirror's is its block's, from the
    mirror's own rows."""
    assert summ.host.dtype == summ.hbm.dtype == torch.float32
    for b, n in enumerate(filled):
        torch.testing.assert_close(summ.host[b, 0], _want(host, b, n), rtol=1e-5, atol=1e-4)
    for b, slot in mirrored.items():
        torch.testing.assert_close(summ.hbm[slot, 0], _want(hbm, slot, filled[b]), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(summ.hbm[slot, 0], summ.host[b, 0], rtol=0, atol=0)


@pytest.mark.parametrize("seed", [0, 1])
def test_store_kv_keeps_the_summaries_of_host_pages_and_mirrors(seed):
    """Random steps as vLLM makes them over a small tier (``HbmMirrors``): requests start on
    blocks from a free list (reused blocks hold an earlier request's rows), some on another
    request's full blocks (prefix caching: never written again), grow by prompt chunks and
    decode tokens, with padding tokens, and end. After every step each page's summary is the
    sums of the rows its current use wrote, its mirror's the same."""
    rng = np.random.default_rng(seed)
    NB, P, Hkv, d, slots = 24, 16, 2, 8, 5
    host = torch.randn(NB, Hkv, 2, P, d) * 5  # what earlier uses left
    hbm = torch.randn(slots, Hkv, 2, P, d) * 5
    summ = StoreSummaries(NB, slots, Hkv, d, P, torch.float32, "cpu")
    mirrors = HbmMirrors(slots)
    free = [int(b) for b in rng.permutation(np.arange(1, NB))]
    filled = [0] * NB  # rows each block's current use has written
    reqs = []  # [blocks, length]
    cached = []  # full blocks of ended requests, kept for prefix sharing (never on the free list)
    for step in range(40):
        if len(reqs) < 3 and len(free) > 4:
            shared = list(cached[: rng.integers(1, len(cached) + 1)]) if cached and rng.random() < 0.5 else []
            reqs.append([shared, len(shared) * P])
        tokens = []  # (request, position)
        for r in list(reqs):
            q = 1 if r[1] and rng.random() < 0.6 else int(rng.integers(2, 40))
            while -(-(r[1] + q) // P) > len(r[0]) and free:
                r[0].append(free.pop(0))
            q = min(q, len(r[0]) * P - r[1])
            tokens += [(r, r[1] + i) for i in range(q)]
            r[1] += q
        slots_map = np.array([r[0][pos // P] * P + pos % P for r, pos in tokens] + [-1] * 3, np.int64)
        dest = slot_destinations(slots_map, P, NB)
        table_blocks = np.array([b for r in reqs for b in r[0]], np.int64)
        m = mirrors.step(table_blocks, dest.pages, dest.offsets)
        index = dest.mirrored(m).store_index(Hkv, P).to("cpu")
        key, value = torch.randn(len(slots_map), Hkv, d), torch.randn(len(slots_map), Hkv, d)
        store_kv(host, key, value, index, hbm if index.num_mirrored else None, summ)
        for page, off in zip(dest.pages, dest.offsets):
            filled[page] = max(filled[page] if off else 0, off + 1)
        _check_summaries(summ, host, hbm, filled, {b: s for b, s in mirrors.mirrored.items() if filled[b]})
        if reqs and (rng.random() < 0.3 or not free):  # a request ends: its full blocks are cached, the rest freed
            r = reqs.pop(int(rng.integers(len(reqs))))
            in_use = {b for x in reqs for b in x[0]}
            for j, b in enumerate(r[0]):
                if b in in_use or b in cached or b in free:
                    continue
                if (j + 1) * P <= r[1]:
                    cached.append(b)
                else:
                    free.append(b)
            while len(cached) > 4:  # the cache evicts its oldest block
                b = cached.pop(0)
                if b not in in_use:
                    free.append(b)
    assert max(filled) == P and sum(1 for n in filled if n) > 10


def test_graph_decode_stores_keep_the_summaries_with_padding_tokens():
    """``GraphDecode``'s fixed-size store (padding tokens write the first token's rows again) and
    its dummy step of padding only (block 0, vLLM's null block), over a tier of every block:
    host and HBM summaries both equal the rows' sums, each token counted once."""
    rng = np.random.default_rng(3)
    NB, P, Hkv, d, W = 40, 16, 2, 8, 12
    real, padded = [16, 1, 17, 150], 3
    table, _, _ = _vllm_step(rng, NB, P, [n + 4 for n in real], padded, W)
    b = len(real) + padded
    host = torch.randn(NB, Hkv, 2, P, d) * 5
    hbm = host.clone()
    summ = StoreSummaries(NB, NB, Hkv, d, P, torch.bfloat16, "cpu")
    host, hbm = host.bfloat16(), hbm.bfloat16()
    g = GraphDecode(8, W, Hkv, P, "cpu")
    filled = [0] * NB
    index = g.fill(torch.zeros(8, W, dtype=torch.int32), torch.zeros(8, dtype=torch.int32),
                   torch.full((8,), -1, dtype=torch.int64), b, b, 1)  # a capture's dummy step
    store_kv(host, torch.randn(b, Hkv, d), torch.randn(b, Hkv, d), index, hbm, summ)
    filled[0] = 1
    for r, n in enumerate(real):  # each request's history but its last token, one position a step
        for pos in range(n - 1):
            blk = table[r, pos // P]
            filled[blk] = pos % P + 1
        pos = np.arange(n - 1)
        host[table[r][pos // P], :, 0, pos % P] = torch.randn(n - 1, Hkv, d).bfloat16()
        hbm[table[r][pos // P]] = host[table[r][pos // P]]
        for blk in set(table[r][pos // P].tolist()):  # written before: their summaries as a store keeps them
            summ.host[blk, 0] = _want(host, blk, filled[blk])
            summ.hbm[blk, 0] = summ.host[blk, 0]
    for step in range(5):  # decode steps crossing into fresh blocks (requests at 16 and 1 tokens)
        lens = np.zeros(b + 3, np.int32)
        slots = np.full(b + 5, -1, np.int64)
        for r, n in enumerate(real):
            pos = n - 1 + step
            lens[r] = pos + 1
            slots[r] = table[r, pos // P] * P + pos % P
            filled[table[r, pos // P]] = pos % P + 1
        index = g.fill(torch.from_numpy(table), torch.from_numpy(lens), torch.from_numpy(slots), b, b,
                       int(lens.max()))
        store_kv(host, torch.randn(b, Hkv, d).bfloat16(), torch.randn(b, Hkv, d).bfloat16(), index, hbm, summ)
        _check_summaries(summ, host, hbm, filled, {blk: blk for blk in range(NB) if filled[blk]})


def test_prompt_steps_over_every_block_keep_the_summaries():
    """``every_block_step``'s stores (padding tokens write the first token's rows again), two
    chunks of one prompt and a fresh prompt: the second chunk merges into the page the first
    started, fresh pages are emptied first."""
    rng = np.random.default_rng(4)
    NB, P, Hkv, d, W = 32, 16, 2, 8, 10
    host = torch.randn(NB, Hkv, 2, P, d) * 5
    hbm = host.clone()
    summ = StoreSummaries(NB, NB, Hkv, d, P, torch.float32, "cpu")
    table, lens, starts, slots = _mixed_step(rng, NB, P, [(0, 20), (0, 37)], W, pad_tokens=3)
    filled = [0] * NB
    for (ctx, q), end in (((0, 20), 20), ((20, 25), 45)):  # request 0 in two chunks; request 1 at once
        reqs = [(ctx, q), (0, 37)] if ctx == 0 else [(ctx, q)]
        pos = [np.arange(c, c + n) for c, n in reqs]
        s = np.concatenate([table[r, p // P].astype(np.int64) * P + p % P for r, p in enumerate(pos)] + [[-1] * 3])
        shape = step_shape(np.cumsum([0] + [n for _, n in reqs]), [c + n for c, n in reqs], len(reqs))
        tables, index = every_block_step(torch.from_numpy(table), torch.from_numpy(s), shape, len(s), Hkv, P)
        store_kv(host, torch.randn(len(s), Hkv, d), torch.randn(len(s), Hkv, d), index, hbm, summ)
        for r, p in enumerate(pos):
            for x in p:
                filled[table[r, x // P]] = x % P + 1
        _check_summaries(summ, host, hbm, filled, {blk: blk for blk in range(NB) if filled[blk]})


def test_store_kv_refuses_summaries_of_other_pools():
    summ = StoreSummaries(3, 0, 1, 8, 16, torch.float32, "cpu")
    index = slot_destinations(np.array([3]), 16, 4).store_index(1, 16)
    with pytest.raises(ValueError, match="summaries hold 3 host"):
        store_kv(torch.zeros(4, 1, 2, 16, 8), torch.randn(1, 1, 8), torch.randn(1, 1, 8), index, None, summ)


# ---- decode under the budget -------------------------------------------------------------------
def _independent_summaries(host, hbm, filled_host, filled_hbm):
    """The pages' written K rows read from the pools (the selection's reference works from
    these): ``host_k[block, 0]`` / ``hbm_k[slot, 0]`` (Hkv, rows, d)."""
    def one(pool, filled):
        return {(b, 0): pool[b, :, 0, :n].double() for b, n in enumerate(filled)}
    return SimpleNamespace(host_k=one(host, filled_host), hbm_k=one(hbm, filled_hbm))


def _selected_dense(q, table, n, pool_of, chosen, P, scale):
    """float64 attention of q (Hq, d) over the rows of the pages ``chosen`` (positions in the
    row's table) of a sequence of length ``n``: every row of each page, its newest page's tail."""
    ks, vs = [], []
    for j in chosen:
        pool, page = pool_of(int(table[j]))
        rows = n - j * P if j == -(-n // P) - 1 else P
        ks.append(pool[page, :, 0, :rows].transpose(0, 1))
        vs.append(pool[page, :, 1, :rows].transpose(0, 1))
    return _dense(q, torch.cat(ks), torch.cat(vs), scale)


def _history(layer_host, layer_hbm, summ, table_blocks, lens, mirrors_of, keys, values, P):
    """Each request's first n - 1 tokens stored through ``store_kv`` (one prompt step)."""
    slots = np.concatenate([table_blocks[r][np.arange(n - 1) // P] * P + np.arange(n - 1) % P
                            for r, n in enumerate(lens)]).astype(np.int64)
    dest = slot_destinations(slots, P, layer_host.shape[0])
    dest = dest.mirrored(mirrors_of(dest)) if mirrors_of is not None else dest
    index = dest.store_index(layer_host.shape[1], P).to("cpu")
    k = torch.cat([x[: n - 1] for x, n in zip(keys, lens)])
    v = torch.cat([x[: n - 1] for x, n in zip(values, lens)])
    store_kv(layer_host, k, v, index, layer_hbm if dest.hbm_at.size else None, summ)


def test_an_eager_decode_step_under_a_budget_reads_exactly_the_selected_pages():
    """Two layers over a small dynamic tier (some pages read from mirrors): history and the
    step's token stored through ``store_kv`` into pools and summaries, the step planned once
    under ``pages=4`` (as ``build`` plans it), each layer run over its pools: every row equals
    float64 attention over the pages ``_reference_selection`` picks from summaries recomputed
    here from the pools."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    L, NB, Hkv, Hq, P, d, slots = 2, 40, 2, 8, 16, 32, 6
    lens = [200, 37, 131]
    blocks = rng.permutation(np.arange(1, NB))
    table_blocks, at = [], 0
    for n in lens:
        k = -(-n // P)
        table_blocks.append(blocks[at:at + k])
        at += k
    budget = SparseBudget(pages=4)
    host = [torch.zeros(NB, Hkv, 2, P, d) for _ in range(L)]
    hbm = [torch.zeros(slots, Hkv, 2, P, d) for _ in range(L)]
    summ = [StoreSummaries(NB, slots, Hkv, d, P, torch.float32, "cpu") for _ in range(L)]
    views = [PoolView(host[i].unsqueeze(1), hbm[i].unsqueeze(1), summaries=summ[i]) for i in range(L)]
    keys = [[torch.randn(n, Hkv, d) * torch.rand(n, 1, 1) * 3 for n in lens] for _ in range(L)]
    values = [[torch.randn(n, Hkv, d) for n in lens] for _ in range(L)]
    mirrors = HbmMirrors(slots)
    hist = slot_destinations(np.concatenate([table_blocks[r][np.arange(n - 1) // P] * P + np.arange(n - 1) % P
                                             for r, n in enumerate(lens)]).astype(np.int64), P, NB)
    m = mirrors.step(np.concatenate(table_blocks), hist.pages, hist.offsets)
    for layer in range(L):
        _history(host[layer], hbm[layer], summ[layer], table_blocks, lens, lambda dest: m, keys[layer],
                 values[layer], P)
    # the decode step: one token per request, one padding token
    slots_map = np.array([table_blocks[r][(n - 1) // P] * P + (n - 1) % P for r, n in enumerate(lens)] + [-1])
    dest = slot_destinations(slots_map, P, NB)
    width = max(len(t) for t in table_blocks)
    bt = np.zeros((len(lens), width), np.int64)
    for r, t in enumerate(table_blocks):
        bt[r, :len(t)] = t
    table = page_table(bt, lens, P, NB)
    step_mirrors = mirrors.step(table, dest.pages, dest.offsets)
    mirror_table(table, step_mirrors)
    assert (table < 0).any() and (table >= 0).any()  # both tiers read
    index = dest.mirrored(step_mirrors).store_index(Hkv, P).to("cpu")
    tables = tables_from_host(table, lens, "cpu")._replace(back_to_back=True)
    dk = DirectKVAttention(views[0])
    plan = dk.plan(tables=tables, q_lens=(1,) * len(lens), num_q_heads=Hq, max_seq_len=max(lens), sparse=budget)
    assert plan.route == "sparse_decode" and plan.detail.pages == 4
    scale = 1 / math.sqrt(d)
    filled_host = [0] * NB
    for r, n in enumerate(lens):
        for pos in range(n):
            filled_host[table_blocks[r][pos // P]] = pos % P + 1
    slot_of = dict(mirrors.mirrored)
    filled_hbm = [0] * slots
    for blk, s in slot_of.items():
        filled_hbm[s] = filled_host[blk]
    for layer in range(L):
        pad = torch.randn(1, Hkv, d)
        new_k = torch.cat([keys[layer][r][n - 1:n] for r, n in enumerate(lens)] + [pad])
        new_v = torch.cat([values[layer][r][n - 1:n] for r, n in enumerate(lens)] + [pad])
        store_kv(host[layer], new_k, new_v, index, hbm[layer] if index.num_mirrored else None, summ[layer])
        q = torch.randn(len(lens), Hq, d)
        out = dk.run(q, 0, softmax_scale=scale, pools=views[layer])
        ref = _independent_summaries(host[layer], hbm[layer], filled_host, filled_hbm)
        want_sel = _reference_selection(q, table, lens, ref, 0, P, 4, budget.sink_pages, budget.recent_pages)
        assert any(len(c) < -(-n // P) for c, n in zip(want_sel, lens))  # some row reads fewer pages

        def pool_of(e, layer=layer):
            return (host[layer], e) if e >= 0 else (hbm[layer], -e - 1)

        for r, n in enumerate(lens):
            want = _selected_dense(q[r], table[r], n, pool_of, want_sel[r], P, scale)
            torch.testing.assert_close(out[r].double(), want, atol=1e-5, rtol=1e-5)
    # a step with prompt rows under the same budget stays exact
    mixed = dk.plan(tables=tables, q_lens=(1, 3, 1), num_q_heads=Hq, max_seq_len=max(lens), sparse=budget)
    assert mixed.route != "sparse_decode"


def test_graph_decode_plans_under_a_budget_select_inside_the_step():
    """The graph decode plan (``_graph_attention``'s, H200 facts, capturing) under a fraction
    budget: its page count comes from the buffers' width (``max_model_len``), its selection and
    inner decode run per layer over the buffers' tables, whatever the step's lengths; rows read
    exactly the pages the reference picks, from the mirrors (host pools poisoned)."""
    torch.manual_seed(2)
    rng = np.random.default_rng(2)
    NB, Hkv, Hq, P, d, W = 60, 2, 8, 16, 64, 24
    real, padded = [300, 40, 170], 2
    b = len(real) + padded
    table, _, _ = _vllm_step(rng, NB, P, [n + 2 for n in real], padded, W)
    budget = SparseBudget(fraction=1 / 4)  # 6 of the 24 pages max_model_len takes
    bf16 = torch.bfloat16  # what the H200 plans take
    host = torch.full((NB, Hkv, 2, P, d), float("nan"), dtype=bf16)
    hbm = torch.zeros(NB, Hkv, 2, P, d, dtype=bf16)
    summ = StoreSummaries(NB, NB, Hkv, d, P, bf16, "cpu")
    view = PoolView(host.unsqueeze(1), hbm.unsqueeze(1), summaries=summ)
    g = GraphDecode(8, W, Hkv, P, "cpu")
    dk = DirectKVAttention(view)
    info = DeviceInfo("NVIDIA H200", sms=132, total_memory=141 * 2**30, capturing=True)
    plan = dk.plan(tables=KernelTables(*g.tables(b)), q_lens=(1,) * b, num_q_heads=Hq, max_seq_len=W * P,
                   cascade=False, device_info=info, sparse=budget)
    assert plan.route == "sparse_decode" and plan.detail.pages == budget.budget_pages(W) == 6
    assert plan.detail.inner.route == "decode" and plan.detail.inner.staging is None
    keys = [(torch.randn(n + 2, Hkv, d) * torch.rand(n + 2, 1, 1) * 3).to(bf16) for n in real]
    values = [torch.randn(n + 2, Hkv, d).to(bf16) for n in real]
    hist = np.concatenate([table[r][np.arange(n - 1) // P].astype(np.int64) * P + np.arange(n - 1) % P
                           for r, n in enumerate(real)])
    dest = slot_destinations(hist, P, NB).mirrored(EVERY_BLOCK)
    store_kv(host, torch.cat([k[: n - 1] for k, n in zip(keys, real)]), torch.cat([v[: n - 1] for v, n in
             zip(values, real)]), dest.store_index(Hkv, P).to("cpu"), hbm, summ)
    scale = 1 / math.sqrt(d)
    filled = [0] * NB
    for step in range(2):
        cur = [n + step for n in real]
        lens = np.zeros(b, np.int32)
        lens[: len(real)] = cur
        slots = np.full(b, -1, np.int64)
        for r, n in enumerate(cur):
            slots[r] = table[r, (n - 1) // P] * P + (n - 1) % P
        index = g.fill(torch.from_numpy(table), torch.from_numpy(lens), torch.from_numpy(slots), b, b, max(cur))
        pad = torch.randn(padded, Hkv, d).to(bf16)
        store_kv(host, torch.cat([k[n - 1:n] for k, n in zip(keys, cur)] + [pad]),
                 torch.cat([v[n - 1:n] for v, n in zip(values, cur)] + [pad]), index, hbm, summ)
        host.fill_(float("nan"))
        for r, n in enumerate(cur):
            for pos in range(n):
                filled[table[r, pos // P]] = pos % P + 1
        q = torch.randn(b, Hq, d).to(bf16)
        out = torch.full_like(q, float("nan"))
        dk.run(q, 0, out, softmax_scale=scale, pools=view)
        assert dk.current is plan
        ref = _independent_summaries(hbm, hbm, [0] * NB, filled)
        enc = -table[: len(real)].astype(np.int64) - 1
        want_sel = _reference_selection(q[: len(real)], enc, cur, ref, 0, P, 6, budget.sink_pages,
                                        budget.recent_pages)
        assert len(want_sel[0]) == 6 and len(want_sel[1]) == -(-cur[1] // P)  # sparse; within the budget: exact
        for r, n in enumerate(cur):
            want = _selected_dense(q[r], enc[r], n, lambda e: (hbm, -e - 1), want_sel[r], P, scale)
            torch.testing.assert_close(out[r].double(), want, atol=1e-2, rtol=1e-2)  # bf16 output
        assert torch.isfinite(out[len(real):]).all()  # padded requests read the null block's mirror


# ---- warm-up -----------------------------------------------------------------------------------
def test_the_warmup_lists_the_sparse_plans_inner_kernels():
    """With a budget, a long decode step's plan is the sparse route, and the warm-up lists its
    inner decode kernel (for the budget's context, not the whole one)."""
    NB, Hkv, P, d = 4608, 8, 64, 128
    summ = SimpleNamespace(host=torch.empty(NB, 1, Hkv, 2, d), hbm=torch.empty(0, 1, Hkv, 2, d))
    pools = PoolView(torch.empty(NB, 1, Hkv, 2, P, d, dtype=torch.bfloat16),
                     torch.empty(0, 1, Hkv, 2, P, d, dtype=torch.bfloat16), summaries=summ)
    steps = warmup_steps(max_num_seqs=4, max_num_batched_tokens=2048, max_model_len=131072, page_size=P,
                         num_blocks=NB)
    budget = SparseBudget(fraction=1 / 8)
    args = dict(num_q_heads=32, dtype=torch.bfloat16, device="cpu", device_info=H200_FACTS)
    kernels = warmup_kernels(pools, steps, sparse=budget, **args)
    plan = plan_attention(CallShape.example([131072] * 4, num_layers=1).replace(sparse=budget), H200_FACTS, H200,
                          DefaultConfigs())
    assert plan.route == "sparse_decode"
    inner = plan_kernels(plan, torch.bfloat16)
    assert inner == plan_kernels(plan.detail.inner, torch.bfloat16) and inner
    for fn, fargs in inner:
        assert (fn.__name__, *fargs) in kernels
    with pytest.raises(ValueError, match="page summaries"):  # a budget needs the pools' summaries
        warmup_kernels(PoolView(pools.host_pool, pools.hbm_pool), steps, sparse=budget, **args)


# ---- the builder (vLLM installed) --------------------------------------------------------------
def _builder(monkeypatch, NB=24, Hkv=2, Hq=8, P=16, d=64, layers=2, tier_gb=None, dtype=torch.float32):
    """A ``DirectKVMetadataBuilder`` over CPU tensors standing in for the pinned KV (``pool_view``
    without its pinned-memory check), with vLLM's config and forward context as plain objects;
    the graph decode plans are made for an H200's facts (run here by the CPU reference)."""
    pytest.importorskip("vllm")
    from directkv_cute.vllm import backend

    monkeypatch.setattr(backend, "pool_view", lambda kv, name, hbm, log=None, summaries=None: PoolView(
        kv.unsqueeze(1), hbm.unsqueeze(1), write_log=log, summaries=summaries))
    monkeypatch.setattr(backend.DeviceInfo, "current", classmethod(lambda cls, device=None, cache=None: H200_FACTS))
    if tier_gb is None:
        monkeypatch.delenv(env.VLLM_HBM_GB, raising=False)
    else:
        monkeypatch.setenv(env.VLLM_HBM_GB, tier_gb)
    names = [f"layers.{i}.attn" for i in range(layers)]
    impl = backend.DirectKVImpl(Hq, d, 1 / math.sqrt(d), Hkv)
    context = {n: SimpleNamespace(kv_cache=torch.zeros(NB, Hkv, 2, P, d, dtype=dtype), impl=impl, layer_name=n,
                                  kv_sharing_target_layer_name=None) for n in names}
    config = SimpleNamespace(
        model_config=SimpleNamespace(get_num_attention_heads=lambda parallel: Hq, max_model_len=NB * P,
                                     dtype=torch.float32),
        parallel_config=None, speculative_config=None,
        cache_config=SimpleNamespace(kv_cache_memory_bytes=NB * Hkv * 2 * P * d * dtype.itemsize * layers),
        compilation_config=SimpleNamespace(static_forward_context=context),
        scheduler_config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=64))
    spec = SimpleNamespace(block_size=P, num_kv_heads=Hkv, head_size=d)
    return backend.DirectKVMetadataBuilder(spec, names, config, torch.device("cpu")), context, impl


def test_the_builder_keeps_summaries_only_under_a_budget(monkeypatch):
    monkeypatch.delenv(env.VLLM_SPARSE_BUDGET, raising=False)
    builder, _, _ = _builder(monkeypatch)
    assert all(v.summaries is None for v in builder._layer_views().values())
    monkeypatch.setenv(env.VLLM_SPARSE_BUDGET, "4p")
    builder, _, _ = _builder(monkeypatch, tier_gb="1e-4", dtype=torch.bfloat16)  # a few mirrors per layer
    views = builder._layer_views()
    slots = next(iter(views.values())).hbm_pool.shape[0]
    assert slots > 0
    for v in views.values():
        assert isinstance(v.summaries, StoreSummaries)
        assert v.summaries.host.shape == (24, 1, 2, 2, 64) and v.summaries.hbm.shape == (slots, 1, 2, 2, 64)
        assert torch.isinf(v.summaries.host).all()
    assert len({id(v.summaries) for v in views.values()}) == 2  # one per layer that owns its KV
    monkeypatch.setenv(env.VLLM_SPARSE_BUDGET, "1/0")
    with pytest.raises(env.EnvironmentVariableError, match="DIRECTKV_VLLM_SPARSE_BUDGET"):
        _builder(monkeypatch)


@pytest.mark.parametrize("tier_gb", [None, "1"])  # host only; a tier of every block (graph decode buffers)
def test_a_decode_step_through_build_and_forward_reads_the_selected_pages(monkeypatch, tier_gb):
    """The builder's whole path on CPU pools: a prompt step (exact) then a decode step under
    ``pages=3`` through ``build`` and ``DirectKVImpl.forward`` per layer; the decode rows equal
    float64 attention over the pages the reference picks from summaries recomputed here."""
    monkeypatch.setenv(env.VLLM_SPARSE_BUDGET, "3p")
    torch.manual_seed(5)
    NB, Hkv, Hq, P, d = 24, 2, 8, 16, 64
    # host only: the CPU's plans (float32); every block mirrored: the graph plans, for an H200 (bf16)
    dtype, tol = (torch.float32, 1e-5) if tier_gb is None else (torch.bfloat16, 1e-2)
    builder, context, impl = _builder(monkeypatch, NB, Hkv, Hq, P, d, tier_gb=tier_gb, dtype=dtype)
    lens = [90, 50]
    blocks = np.array([[3, 7, 11, 2, 9, 14, 0], [5, 1, 20, 8, 0, 0, 0]], np.int32)
    scale = 1 / math.sqrt(d)
    keys = {n: [(torch.randn(x + 1, Hkv, d) * torch.rand(x + 1, 1, 1) * 3).to(dtype) for x in lens] for n in context}
    values = {n: [torch.randn(x + 1, Hkv, d).to(dtype) for x in lens] for n in context}

    def metadata(ctx, q):
        starts = np.cumsum([0] + q)
        seq = torch.tensor([c + n for c, n in zip(ctx, q)], dtype=torch.int32)
        slots = np.concatenate([blocks[r][np.arange(c, c + n) // P].astype(np.int64) * P + np.arange(c, c + n) % P
                                for r, (c, n) in enumerate(zip(ctx, q))])
        return SimpleNamespace(causal=True, num_reqs=2, num_actual_tokens=len(slots), seq_lens=seq,
                               seq_lens_cpu_upper_bound=seq, query_start_loc_cpu=torch.from_numpy(starts),
                               slot_mapping=torch.from_numpy(slots), block_table_tensor=torch.from_numpy(blocks))

    def forward(md, ctx, q):
        outs = {}
        for name, layer in context.items():
            k = torch.cat([keys[name][r][c:c + n] for r, (c, n) in enumerate(zip(ctx, q))])
            v = torch.cat([values[name][r][c:c + n] for r, (c, n) in enumerate(zip(ctx, q))])
            query = torch.randn(k.shape[0], Hq, d).to(dtype)
            out = impl.forward(layer, query, k, v, layer.kv_cache, md, torch.empty_like(query))
            outs[name] = (query, out)
        return outs

    prompt = builder.build(0, metadata([0, 0], lens))
    assert prompt.attention.current.route != "sparse_decode"
    forward(prompt, [0, 0], lens)
    md = builder.build(0, metadata(lens, [1, 1]))
    assert md.attention.current.route == "sparse_decode"
    assert (md.attention is builder._graph_plans.get(2)) == (tier_gb is not None)  # the graph decode plan
    for name, (query, out) in forward(md, lens, [1, 1]).items():
        kv = context[name].kv_cache
        views = builder._layer_views()[name]
        cur = [x + 1 for x in lens]
        filled = [0] * NB
        for r, n in enumerate(cur):
            for pos in range(n):
                filled[blocks[r][pos // P]] = pos % P + 1
        ref = _independent_summaries(kv, kv, filled, [])
        torch.testing.assert_close(views.summaries.host.double(), ref.host, rtol=0, atol=0)
        if tier_gb:  # every block mirrored at its own index
            torch.testing.assert_close(views.summaries.hbm.double(), ref.host, rtol=0, atol=0)
        table = page_table(blocks, cur, P, NB)
        sel = _reference_selection(query, table, cur, ref, 0, P, 3, 1, 2)
        assert all(len(s) == 3 for s in sel)
        for r, n in enumerate(cur):
            want = _selected_dense(query[r], table[r], n, lambda e: (kv, e), sel[r], P, scale)
            torch.testing.assert_close(out[r].double(), want, atol=tol, rtol=tol)
