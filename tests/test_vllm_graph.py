"""Decode steps of the vLLM backend over an HBM tier that mirrors every block (``EVERY_BLOCK``):
``step.GraphDecode`` fills its persistent buffers on the device from vLLM's block table, lengths
and slot mapping (here CPU tensors stand in for the device), and one plan per batch size reads
them. Checked against the host path (``page_table`` + ``mirror_table``, ``slot_destinations``)
and against float64 dense attention, with padded requests, padding tokens and poisoned host
pages (attention must read HBM only)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from directkv_cute.vllm.step import (
    EVERY_BLOCK,
    GraphDecode,
    HbmMirrors,
    check_page_size,
    mirror_slots,
    mirror_table,
    mirrors_every_block,
    page_table,
    slot_destinations,
    store_kv,
)


def test_the_tier_mirrors_every_block_only_when_it_holds_the_host_pool():
    assert mirrors_every_block(64 * 2**30, 64 * 2**30)
    assert mirrors_every_block(65 * 2**30, 64 * 2**30)
    assert not mirrors_every_block(64 * 2**30 - 1, 64 * 2**30)
    assert not mirrors_every_block(0, 64 * 2**30)  # no tier
    assert not mirrors_every_block(2**30, None)  # no host size given: never assumed


def test_every_block_is_its_own_mirror():
    ids = np.array([[3, 0, 9], [9, 9, 9]])
    assert EVERY_BLOCK.step(ids, np.array([9]), np.array([4])) is EVERY_BLOCK  # a policy that keeps them all
    np.testing.assert_array_equal(mirror_slots(ids, EVERY_BLOCK), ids)
    np.testing.assert_array_equal(mirror_table(ids.copy(), EVERY_BLOCK), -ids - 1)
    dest = slot_destinations(np.array([17, -1, 3]), 16, 4).mirrored(EVERY_BLOCK)
    np.testing.assert_array_equal(dest.hbm_slots, dest.pages)


def test_one_page_size_check_for_tables_slots_and_buffers():
    for bad in (0, 24, -16, 16.0, True, "16"):
        for call in (lambda: check_page_size(bad), lambda: page_table(np.zeros((1, 2), np.int64), [3], bad, 4),
                     lambda: slot_destinations([1], bad, 4), lambda: GraphDecode(2, 2, 1, bad, "cpu")):
            with pytest.raises(ValueError, match="page_size must be one of"):
                call()
    assert check_page_size(np.int64(64)) == 64


def _vllm_step(rng, num_blocks, page_size, real_lens, padded, width):
    """A decode step as vLLM's V2 runner hands it over: the block table (padded rows zeroed), the
    lengths (0 for padded requests) and the slot mapping (-1 for padding tokens), each request's
    blocks distinct and drawn from 1..num_blocks-1 (block 0 is vLLM's null block)."""
    n = len(real_lens)
    b = n + padded
    table = np.zeros((b + 3, width), np.int32)  # vLLM's buffer has more rows than the step
    ids = rng.permutation(np.arange(1, num_blocks))
    at = 0
    for r, length in enumerate(real_lens):
        k = -(-length // page_size)
        table[r, :k] = ids[at:at + k]
        at += k
    lens = np.zeros(b + 3, np.int32)
    lens[:n] = real_lens
    slots = np.full(b + 5, -1, np.int64)
    for r, length in enumerate(real_lens):
        pos = length - 1
        slots[r] = table[r, pos // page_size] * page_size + pos % page_size
    return table, lens, slots


@pytest.mark.parametrize("padded", [0, 3])
def test_fill_names_the_same_pages_and_rows_as_the_host_path(padded):
    rng = np.random.default_rng(padded)
    NB, P, Hkv, d, W = 40, 16, 2, 8, 12
    real = [37, 1, 16, 17, 150]
    table, lens, slots = _vllm_step(rng, NB, P, real, padded, W)
    b = len(real) + padded
    g = GraphDecode(8, W, Hkv, P, "cpu")
    g.page_table.fill_(12345)  # stale rows of an earlier step
    index = g.fill(torch.from_numpy(table), torch.from_numpy(lens), torch.from_numpy(slots), b, b, max(real))
    pt, sl = g.tables(b)
    want = mirror_table(page_table(table[:len(real)], real, P, NB), EVERY_BLOCK)
    for r, length in enumerate(real):
        k = -(-length // P)
        np.testing.assert_array_equal(pt[r, :k].numpy(), want[r, :k])
    np.testing.assert_array_equal(sl.numpy(), np.maximum(lens[:b], 1))
    assert (pt[len(real):, 0] == -1).all()  # a padded request reads the null block's mirror
    # The stores: the same pools as the host path's StoreIndex, padding tokens included.
    key, value = torch.randn(b, Hkv, d), torch.randn(b, Hkv, d)
    host, hbm = torch.randn(NB, Hkv, 2, P, d), None
    hbm = host.clone()
    want_host, want_hbm = host.clone(), hbm.clone()
    store_kv(host, key, value, index, hbm)
    ref = slot_destinations(slots[:b], P, NB).mirrored(EVERY_BLOCK).store_index(Hkv, P).to("cpu")
    store_kv(want_host, key, value, ref, want_hbm)
    torch.testing.assert_close(host, want_host, rtol=0, atol=0)
    torch.testing.assert_close(hbm, want_hbm, rtol=0, atol=0)


def test_a_dummy_step_of_padding_only_writes_the_null_block():
    """vLLM captures a graph over a dummy step: every slot -1. Its stores go to block 0 only."""
    NB, P, Hkv, d, b = 6, 16, 1, 8, 4
    g = GraphDecode(4, 3, Hkv, P, "cpu")
    index = g.fill(torch.zeros(4, 3, dtype=torch.int32), torch.zeros(4, dtype=torch.int32),
                   torch.full((4,), -1, dtype=torch.int64), b, b, 1)
    host = torch.zeros(NB, Hkv, 2, P, d)
    store_kv(host, torch.ones(b, Hkv, d), torch.ones(b, Hkv, d), index, host.clone())
    assert host[1:].abs().sum() == 0 and host[0].abs().sum() > 0


def test_fill_refuses_what_is_not_a_decode_step():
    g = GraphDecode(4, 3, 1, 16, "cpu")
    bt, lens, slots = torch.zeros(8, 3, dtype=torch.int32), torch.ones(8, dtype=torch.int32), torch.zeros(8).long()
    with pytest.raises(ValueError, match="one token per request, at most 4"):
        g.fill(bt, lens, slots, 5, 5, 16)
    with pytest.raises(ValueError, match="one token per request"):
        g.fill(bt, lens, slots, 2, 3, 16)
    with pytest.raises(ValueError, match="block_table must be int32"):
        g.fill(bt.long(), lens, slots, 2, 2, 16)


def _dense(q, k, v, scale):
    """float64 attention of one query row q (Hq, d) over all of k, v (L, Hkv, d)."""
    g = q.shape[0] // k.shape[1]
    s = torch.einsum("hd,khd->hk", q.double(), k.repeat_interleave(g, 1).double()) * scale
    return torch.einsum("hk,khd->hd", s.softmax(-1), v.repeat_interleave(g, 1).double())


def _graph_attention(views, g, batch, num_q_heads, max_model_len):
    """What ``DirectKVMetadataBuilder._graph_attention`` plans on an H200 (run here by the CPU's
    float32 reference over the same tables)."""
    from directkv_cute.attention import DirectKVAttention
    from directkv_cute.cache import KernelTables
    from directkv_cute.machine import DeviceInfo

    dk = DirectKVAttention(views[0])
    info = DeviceInfo("NVIDIA H200", sms=132, total_memory=141 * 2**30, capturing=True)
    dk.plan(tables=KernelTables(*g.tables(batch)), q_lens=(1,) * batch, num_q_heads=num_q_heads,
            max_seq_len=max_model_len, cascade=False, device_info=info)
    return dk


def test_decode_steps_over_the_buffers_match_dense_attention_reading_hbm_only():
    """Two layers, host pools poisoned with NaN (every block is read from its mirror), two steps
    of different lengths through one plan (made once for the batch size, as a captured graph
    replays it), with padded requests at the end of the batch."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    from directkv_cute.runner import PoolView

    L, NB, Hkv, Hq, P, d, W = 2, 48, 2, 8, 16, 64, 16
    real, padded = [33, 1, 70], 2
    b = len(real) + padded
    table, lens, _ = _vllm_step(rng, NB, P, [n + 5 for n in real], padded, W)  # room for 5 more tokens
    bf16 = torch.bfloat16
    host = [torch.full((NB, Hkv, 2, P, d), float("nan"), dtype=bf16) for _ in range(L)]
    hbm = [torch.zeros(NB, Hkv, 2, P, d, dtype=bf16) for _ in range(L)]
    keys = [[torch.randn(n + 5, Hkv, d).to(bf16) for n in real] for _ in range(L)]
    values = [[torch.randn(n + 5, Hkv, d).to(bf16) for n in real] for _ in range(L)]
    for layer in range(L):  # the history, written through to the mirrors
        for r, n in enumerate(real):
            pos = np.arange(n - 1)
            hbm[layer][table[r][pos // P], :, 0, pos % P] = keys[layer][r][: n - 1]
            hbm[layer][table[r][pos // P], :, 1, pos % P] = values[layer][r][: n - 1]
    views = [PoolView(host[i].unsqueeze(1), hbm[i].unsqueeze(1)) for i in range(L)]
    g = GraphDecode(8, W, Hkv, P, "cpu")
    dk = _graph_attention(views, g, b, Hq, W * P)
    assert dk.current.route == "decode" and dk.current.staging is None
    plan = dk.current
    scale = 1 / math.sqrt(d)
    for step in range(2):  # the step at length n, then at n + 1: the same plan reads both
        cur = [n + step for n in real]
        step_lens = np.zeros(b, np.int32)
        step_lens[: len(real)] = cur
        slots = np.full(b, -1, np.int64)
        for r, n in enumerate(cur):
            slots[r] = table[r, (n - 1) // P] * P + (n - 1) % P
        index = g.fill(torch.from_numpy(table), torch.from_numpy(step_lens), torch.from_numpy(slots), b, b, max(cur))
        for layer in range(L):
            pad = torch.randn(padded, Hkv, d).to(bf16)
            new_k = torch.cat([keys[layer][r][n - 1:n] for r, n in enumerate(cur)] + [pad])
            new_v = torch.cat([values[layer][r][n - 1:n] for r, n in enumerate(cur)] + [pad])
            store_kv(host[layer], new_k, new_v, index, hbm[layer])
            host[layer].fill_(float("nan"))
            q = torch.randn(b, Hq, d).to(bf16)
            out = torch.full_like(q, float("nan"))
            dk.run(q, 0, out, softmax_scale=scale, pools=views[layer])
            assert dk.current is plan
            for r, n in enumerate(cur):
                want = _dense(q[r], keys[layer][r][:n], values[layer][r][:n], scale)
                torch.testing.assert_close(out[r].double(), want, atol=1e-2, rtol=1e-2)  # bf16 output
            assert torch.isfinite(out[len(real):]).all()  # padded requests read the null block's mirror


def test_the_dynamic_policy_is_kept_for_a_smaller_tier():
    m = HbmMirrors(2)
    assert m.step(np.array([5, 6, 7]), np.array([5, 6, 7]), np.array([0, 0, 0])) == {5: 0, 6: 1}


@pytest.mark.parametrize("tier_gb, want", [("8", "UNIFORM_SINGLE_TOKEN_DECODE"), ("9", "UNIFORM_SINGLE_TOKEN_DECODE"),
                                           ("7.5", "NEVER"), ("0", "NEVER"), (None, "NEVER")])
def test_the_backend_asks_for_full_decode_graphs_only_over_a_tier_of_every_block(monkeypatch, tier_gb, want):
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.v1.attention.backend import AttentionCGSupport

    from directkv_cute.env import vllm_hbm_bytes
    from directkv_cute.vllm.backend import DirectKVMetadataBuilder

    monkeypatch.setenv("DIRECTKV_VLLM_HBM_GB", "8")
    host = vllm_hbm_bytes()  # a host pool as large as an 8 GB tier
    if tier_gb is None:
        monkeypatch.delenv("DIRECTKV_VLLM_HBM_GB")
    else:
        monkeypatch.setenv("DIRECTKV_VLLM_HBM_GB", tier_gb)
    config = SimpleNamespace(cache_config=SimpleNamespace(kv_cache_memory_bytes=host))
    assert DirectKVMetadataBuilder.get_cudagraph_support(config, None) is getattr(AttentionCGSupport, want)


def test_a_policy_over_a_huge_tier_costs_nothing_before_its_size_is_checked():
    """A units mistake in DIRECTKV_VLLM_HBM_GB (1e9 GiB) reaches the policy as ~1e14 slots: it
    must not allocate per slot (the size check that refuses it comes right after)."""
    import time

    t = time.perf_counter()
    m = HbmMirrors(10**14)
    assert time.perf_counter() - t < 0.1
    assert m.step(np.array([4, 2]), np.array([4, 2]), np.array([0, 0])) == {4: 0, 2: 1}


@pytest.mark.parametrize("case", ["head_dim", "heads", "value", "span", "host_row", "mirror_row", "hbm_pages"])
def test_store_kv_refuses_before_writing_anything(case):
    """A store that cannot be right raises one line and leaves both pools as they were."""
    from directkv_cute.vllm.step import StoreIndex

    NB, Hkv, P, d = 4, 2, 16, 8
    host, hbm = torch.randn(NB, Hkv, 2, P, d), torch.randn(2, Hkv, 2, P, d)
    dest = slot_destinations(np.array([3, 20, -1]), P, NB).mirrored({0: 1})
    index = dest.store_index(Hkv, P)
    key, value = torch.randn(3, Hkv, d), torch.randn(3, Hkv, d)
    pool = hbm
    if case == "head_dim":
        key, value = torch.randn(3, Hkv, d + 1), torch.randn(3, Hkv, d + 1)
    elif case == "heads":
        key, value = torch.randn(3, Hkv + 1, d), torch.randn(3, Hkv + 1, d)
    elif case == "value":
        value = torch.randn(3, Hkv, d // 2)
    elif case == "span":
        key, value = key[:1], value[:1]
    elif case == "host_row":
        index = slot_destinations(np.array([3, 20, -1]), P, NB + 4).mirrored({0: 1}).store_index(Hkv, P)
        host = host[: NB - 3]
    elif case == "mirror_row":
        index = slot_destinations(np.array([3, 20, -1]), P, NB).mirrored({0: 5}).store_index(Hkv, P)
    elif case == "hbm_pages":
        pool = torch.randn(2, Hkv, 2, P * 2, d)
    before = host.clone(), pool.clone()
    with pytest.raises(ValueError) as e:
        store_kv(host, key, value, index, pool)
    assert "\n" not in str(e.value)
    assert torch.equal(host, before[0]) and torch.equal(pool, before[1])
    assert isinstance(index, StoreIndex)


def _mixed_step(rng, num_blocks, page_size, reqs, width, pad_tokens):
    """A step with prompt rows as vLLM's V2 runner hands it over: ``reqs`` (context, q_len) per
    request (q_len 0: a padded request, table row and length 0), the block table, the lengths,
    ``query_start_loc`` and the slot mapping of the step's tokens (``pad_tokens`` padding tokens
    at -1 after them). Each request's blocks are distinct, drawn from 1..num_blocks-1."""
    table = np.zeros((len(reqs) + 2, width), np.int32)
    lens = np.zeros(len(reqs) + 2, np.int64)
    ids = rng.permutation(np.arange(1, num_blocks))
    starts, slots, at = [0], [], 0
    for r, (ctx, q) in enumerate(reqs):
        if q:
            n = ctx + q
            k = -(-n // page_size)
            table[r, :k] = ids[at:at + k]
            at += k
            lens[r] = n
            pos = np.arange(ctx, n)
            slots += list(table[r, pos // page_size].astype(np.int64) * page_size + pos % page_size)
        starts.append(starts[-1] + q)
    return table, lens, np.array(starts), np.array(slots + [-1] * pad_tokens, np.int64)


def test_a_prompt_step_over_every_block_names_the_host_paths_pages_and_rows():
    """``every_block_step``'s device tables and store index against the host path's
    (``page_table`` + ``mirror_table``, ``slot_destinations(...).mirrored(EVERY_BLOCK)``), with a
    padded request in the middle and padding tokens at the end."""
    from directkv_cute.vllm.step import every_block_step, step_shape

    rng = np.random.default_rng(7)
    NB, P, Hkv, d, W = 64, 16, 2, 8, 20
    reqs = [(40, 1), (0, 33), (7, 0), (100, 17), (15, 1)]
    table, lens, starts, slots = _mixed_step(rng, NB, P, reqs, W, pad_tokens=3)
    shape = step_shape(starts, lens, len(reqs))
    n_tok = len(slots)
    tables, index = every_block_step(torch.from_numpy(table), torch.from_numpy(slots), shape, n_tok, Hkv, P)
    assert tables.hbm_only and tables.back_to_back and tables.host_table is None
    assert tables.host_seq_lens == shape.seq_lens == (41, 33, 117, 16)
    rows = list(shape.rows)
    want = mirror_table(page_table(table[rows], shape.seq_lens, P, NB), EVERY_BLOCK)
    for b, n in enumerate(shape.seq_lens):
        k = -(-n // P)
        np.testing.assert_array_equal(tables.page_table[b, :k].numpy(), want[b, :k])
    np.testing.assert_array_equal(tables.seq_lens.numpy(), shape.seq_lens)
    key, value = torch.randn(n_tok, Hkv, d), torch.randn(n_tok, Hkv, d)
    host = torch.randn(NB, Hkv, 2, P, d)
    hbm = host.clone()
    want_host, want_hbm = host.clone(), hbm.clone()
    store_kv(host, key, value, index, hbm)
    ref = slot_destinations(slots, P, NB).mirrored(EVERY_BLOCK).store_index(Hkv, P).to("cpu")
    store_kv(want_host, key, value, ref, want_hbm)
    torch.testing.assert_close(host, want_host, rtol=0, atol=0)
    torch.testing.assert_close(hbm, want_hbm, rtol=0, atol=0)
    # a step of padding tokens only: no tables, a store into the null block
    none, pad = every_block_step(torch.from_numpy(table), torch.full((4,), -1), step_shape([0, 0], [0], 1), 4, Hkv, P)
    assert none is None and pad.span == 4


def test_a_prompt_step_over_every_block_is_planned_as_hbm_reads_without_its_host_table():
    """The planner routes device-only tables marked ``hbm_only`` as it routes the same call with
    an all-HBM host table (the Q-tiled kernel over HBM for a prompt chunk that fills a wave), and
    without the mark falls back to the kernels that need no host table."""
    from directkv_cute.cache import KernelTables
    from directkv_cute.machine import H200, DeviceInfo
    from directkv_cute.planner import CallShape, ProfileConfigs, plan_attention

    info = DeviceInfo("NVIDIA H200", sms=132, total_memory=141 * 2**30)
    configs = ProfileConfigs("NVIDIA H200")
    seq_lens, q_lens = (8192, 4096, 40), (2048, 2048, 1)
    known = CallShape.example(seq_lens, q_lens, tier="hbm")
    width = known.width
    device_tables = KernelTables(torch.zeros(3, width, dtype=torch.int32), torch.zeros(3, dtype=torch.int32),
                                 host_seq_lens=seq_lens, hbm_only=True)

    class Pools:  # the pools' public geometry, as CallShape.of reads it
        num_kv_heads, head_dim, page_size, dtype, num_layers = 8, 128, 64, torch.bfloat16, 32
        hbm_pool = torch.empty(known.hbm_pages, 0)

    marked = CallShape.of(Pools, device_tables, q_lens, 32)
    bare = CallShape.of(Pools, device_tables._replace(hbm_only=False), q_lens, 32)
    a, b = (plan_attention(s, info, H200, configs) for s in (known, marked))
    assert a.route == b.route == "q_tiled_hbm"
    assert (a.config, a.detail.layout) == (b.config, b.detail.layout)
    assert plan_attention(bare, info, H200, configs).route == "multi_token"
    # a host table wins over the mark: its pages say where they are
    assert CallShape.of(Pools, device_tables._replace(host_table=known.host_table), q_lens, 32).hbm_only is False


def test_a_prompt_step_over_every_block_matches_dense_causal_attention_reading_hbm_only():
    """The whole eager step on the CPU: tables and stores from ``every_block_step``, a plan over
    them, two layers whose host pools are NaN (every block is read from its mirror), a decode, a
    prompt chunk after cached context and a first chunk, against float64 causal attention."""
    from directkv_cute.attention import DirectKVAttention
    from directkv_cute.runner import PoolView
    from directkv_cute.vllm.step import every_block_step, step_shape

    torch.manual_seed(1)
    rng = np.random.default_rng(1)
    L, NB, Hkv, Hq, P, d, W = 2, 40, 2, 4, 16, 64, 12
    reqs = [(50, 1), (30, 20), (0, 37)]
    table, lens, starts, slots = _mixed_step(rng, NB, P, reqs, W, pad_tokens=2)
    shape = step_shape(starts, lens, len(reqs))
    tables, index = every_block_step(torch.from_numpy(table), torch.from_numpy(slots), shape, len(slots), Hkv, P)
    bf16 = torch.bfloat16
    host = [torch.full((NB, Hkv, 2, P, d), float("nan"), dtype=bf16) for _ in range(L)]
    hbm = [torch.zeros(NB, Hkv, 2, P, d, dtype=bf16) for _ in range(L)]
    views = [PoolView(host[i].unsqueeze(1), hbm[i].unsqueeze(1)) for i in range(L)]
    dk = DirectKVAttention(views[0])
    dk.plan(tables=tables, q_lens=shape.q_lens, num_q_heads=Hq, max_seq_len=shape.max_seq_len, cascade=False)
    scale = 1 / math.sqrt(d)
    for layer in range(L):
        ks = [torch.randn(c + q, Hkv, d).to(bf16) for c, q in reqs]
        vs = [torch.randn(c + q, Hkv, d).to(bf16) for c, q in reqs]
        for r, (c, q) in enumerate(reqs):  # the cached context, written through before the step
            pos = np.arange(c)
            hbm[layer][table[r][pos // P], :, 0, pos % P] = ks[r][:c]
            hbm[layer][table[r][pos // P], :, 1, pos % P] = vs[r][:c]
        pad = torch.randn(2, Hkv, d).to(bf16)
        new_k = torch.cat([ks[r][c:] for r, (c, q) in enumerate(reqs)] + [pad])
        new_v = torch.cat([vs[r][c:] for r, (c, q) in enumerate(reqs)] + [pad])
        store_kv(host[layer], new_k, new_v, index, hbm[layer])
        host[layer].fill_(float("nan"))
        q = torch.randn(shape.num_tokens, Hq, d).to(bf16)
        out = torch.full_like(q, float("nan"))
        dk.run(q, 0, out, softmax_scale=scale, pools=views[layer])
        at = 0
        for r, (c, n) in enumerate(reqs):
            for j in range(n):
                want = _dense(q[at + j], ks[r][: c + j + 1], vs[r][: c + j + 1], scale)
                torch.testing.assert_close(out[at + j].double(), want, atol=1e-2, rtol=1e-2)
            at += n
