"""The vLLM backend's host-side parts, without vLLM: a step's shape from vLLM's CPU metadata,
block table -> page table, slot_mapping -> (page, offset), the per-layer K/V store, sizing, the
HBM tier's mirror policy (by hand and against a shadow model over random steps), and whole steps
(store, plan once, run per layer) on CPU pools in the backend's layout, with and without HBM
mirrors, against a dense causal attention computed here."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from directkv_cute.cache.pages import encode_page
from directkv_cute.vllm.step import (
    HbmMirrors,
    check_geometry,
    check_hbm_tier,
    check_host_bytes,
    hbm_pages,
    host_blocks,
    kv_bytes_per_block,
    mirror_table,
    page_table,
    slot_destinations,
    step_shape,
    store_kv,
)

ROOT = Path(__file__).resolve().parents[1]


# ---- the step's shape ----------------------------------------------------------------------------
def test_step_shape_of_a_mixed_ragged_batch():
    # Requests: a decode (1 token, length 10), a 4-token prompt, a decode at length 33, and a
    # padded request with no tokens; entries past num_reqs are vLLM's padding and are ignored.
    s = step_shape(np.array([0, 1, 5, 6, 6, 6], np.int32), np.array([10, 4, 33, 0, 0], np.int32), 4)
    assert s.rows == (0, 1, 2)
    assert s.q_lens == (1, 4, 1)
    assert s.seq_lens == (10, 4, 33)
    assert s.context_lens == (9, 0, 32)
    assert (s.num_decodes, s.num_prefills, s.num_tokens, s.max_seq_len) == (2, 1, 6, 33)


def test_step_shape_of_a_chunked_prefill():
    # The second chunk of a 300-token prompt (chunks of 256): 44 query rows over 300 tokens.
    s = step_shape([0, 44], [300], 1)
    assert (s.q_lens, s.context_lens, s.num_prefills) == ((44,), (256,), 1)


@pytest.mark.parametrize("starts, lens, n, match", [
    ([1, 2], [3], 1, "must start at 0"),
    ([0, 3, 2], [5, 5], 2, "decreases at request 1"),
    ([0, 4], [3], 1, "request 0 has 4 query tokens but length 3"),
    ([0, 1], [3], 2, "query_start_loc has 2 entries, 2 requests need 3"),
    ([0, 1, 2], [3], 2, "seq_lens has 1 entries for 2 requests"),
    ([0.0, 1.0], [3], 1, "1-D integer array"),
    ([0, 1], [3], -1, "num_reqs must be >= 0, got -1"),
])
def test_step_shape_refusals(starts, lens, n, match):
    with pytest.raises(ValueError, match=match):
        step_shape(starts, lens, n)


# ---- block table -> page table -------------------------------------------------------------------
def test_page_table_takes_each_rows_pages_and_repeats_the_last():
    blocks = np.array([[7, 3, 9, 0], [2, 5, 0, 0], [4, 0, 0, 0]], np.int32)
    table = page_table(blocks, [33, 17, 16], page_size=16, num_blocks=10)
    # 33 tokens: 3 pages; 17: 2; 16: 1 -- past them, the row's last page.
    assert table.dtype == np.int32
    assert table.tolist() == [[7, 3, 9], [2, 5, 5], [4, 4, 4]]


def test_page_table_with_64_token_pages():
    table = page_table(np.array([[1, 2, 3], [6, 8, 8]], np.int64), [129, 64], page_size=64, num_blocks=9)
    assert table.tolist() == [[1, 2, 3], [6, 6, 6]]


@pytest.mark.parametrize("blocks, lens, match", [
    ([[1, 2]], [40], "needs 3 blocks of 16 tokens, its block table row holds 2"),
    ([[1, 12]], [20], "block 1 has id 12, outside the cache's 10 blocks"),
    ([[-1, 1]], [5], "block 0 has id -1"),
    ([[1, 2]], [0], "lengths must be >= 1"),
    ([[1, 2], [3, 4]], [5], "2 rows for 1 sequences"),
])
def test_page_table_refusals(blocks, lens, match):
    with pytest.raises(ValueError, match=match):
        page_table(np.array(blocks), lens, page_size=16, num_blocks=10)


# ---- slot_mapping -> destinations ----------------------------------------------------------------
def test_slot_destinations_skip_padding_tokens():
    d = slot_destinations(np.array([35, 36, -1, 160, -1]), page_size=16, num_blocks=20)
    assert d.rows.tolist() == [0, 1, 3]
    assert d.pages.tolist() == [2, 2, 10]
    assert d.offsets.tolist() == [3, 4, 0]
    assert not d.dense


def test_slot_destinations_dense():
    d = slot_destinations(np.array([64, 65, 127]), page_size=64, num_blocks=2)
    assert d.dense and d.rows.tolist() == [0, 1, 2]
    assert d.pages.tolist() == [1, 1, 1] and d.offsets.tolist() == [0, 1, 63]


def test_slot_destinations_refusals():
    with pytest.raises(ValueError, match="slot 320 of token 1 is past the cache's 20 blocks of 16 tokens"):
        slot_destinations([0, 320], page_size=16, num_blocks=20)
    with pytest.raises(ValueError, match="page_size must be one of"):
        slot_destinations([0], page_size=24, num_blocks=20)


def test_slots_and_page_table_agree_on_every_token():
    """vLLM's slot of token position p of a request is block_table[p // P] * P + p % P; the page
    table row names the same page at p // P."""
    P, blocks = 16, np.array([[5, 1, 7], [2, 9, 9]])
    lens = [40, 20]
    table = page_table(blocks, lens, P, num_blocks=10)
    for b, n in enumerate(lens):
        pos = np.arange(n)
        d = slot_destinations(blocks[b][pos // P] * P + pos % P, P, 10)
        assert (d.pages == table[b][pos // P]).all() and (d.offsets == pos % P).all()


# ---- the K/V store -------------------------------------------------------------------------------
def test_store_kv_puts_rows_at_their_page_and_offset():
    NB, Hkv, P, d = 4, 2, 16, 8
    kv = torch.zeros(NB, Hkv, 2, P, d)
    key = torch.randn(3, Hkv, d)
    value = torch.randn(3, Hkv, d)
    dest = slot_destinations([2 * P + 5, -1, 0 * P + 15], P, NB)
    index = dest.store_index(Hkv, P)
    assert index.tokens.tolist() == [0, 2] and index.span == 3 and index.num_mirrored == 0
    store_kv(kv, key, value, index.to("cpu"))
    assert torch.equal(kv[2, :, 0, 5], key[0]) and torch.equal(kv[2, :, 1, 5], value[0])
    assert torch.equal(kv[0, :, 0, 15], key[2]) and torch.equal(kv[0, :, 1, 15], value[2])
    assert int((kv != 0).sum()) == 2 * 2 * Hkv * d  # nothing else written
    wide = torch.zeros(NB, Hkv, 2, P, d, dtype=torch.float64)  # pages of another dtype: rows are cast
    store_kv(wide, key, value, dest.store_index(Hkv, P).to("cpu"))
    assert torch.equal(wide[2, :, 0, 5], key[0].double()) and torch.equal(wide[0, :, 1, 15], value[2].double())


# ---- sizing --------------------------------------------------------------------------------------
def test_sizing_by_hand():
    # A Llama-3-8B-like model: 32 layers, 8 KV heads of 128, bf16, blocks of 16 tokens:
    # 32 * 8 * 2 * 16 * 128 * 2 bytes = 2 MiB per block; 64 GiB hold 32768 blocks (524288 tokens).
    assert kv_bytes_per_block(32, 8, 128, 16, "bfloat16") == 2 * 2**20
    assert host_blocks(64 * 2**30, 32, 8, 128, 16) == 32768
    assert host_blocks(2 * 2**20 + 5, 32, 8, 128, 16) == 1


def test_sizing_refusals():
    with pytest.raises(ValueError, match="hold no block: one block of 16 tokens over 32 layers costs 2097152 bytes"):
        host_blocks(2**20, 32, 8, 128, 16)
    with pytest.raises(ValueError, match="stores"):
        kv_bytes_per_block(32, 8, 128, 16, "fp8")
    with pytest.raises(ValueError, match="host_bytes must be >= 1, got 0"):
        host_blocks(0, 32, 8, 128, 16)
    with pytest.raises(MemoryError, match=r"needs 3221225472 bytes \(3 GiB\) of pinned host memory, the host has "
                                          r"1073741824 bytes \(1 GiB\) available; lower --kv-cache-memory-bytes"):
        check_host_bytes(3 * 2**30, 2**30)
    check_host_bytes(3 * 2**30, None)  # unknown availability: pinning itself decides


def test_an_hbm_tier_beyond_the_gpus_available_memory_is_refused():
    tier = hbm_pages(40 * 2**30, 32, 8, 128, 64) * 32 * kv_bytes_per_block(1, 8, 128, 64)  # what the pools take
    assert tier == 40 * 2**30  # 5120 mirror pages of 256 KiB per layer
    with pytest.raises(MemoryError, match=r"the HBM tier needs 42949672960 bytes \(40 GiB\) of GPU memory, the GPU "
                                          r"has 32212254720 bytes \(30 GiB\) available after vLLM's own; lower "
                                          r"DIRECTKV_VLLM_HBM_GB"):
        check_hbm_tier(tier, 30 * 2**30)
    check_hbm_tier(tier, tier)  # exactly fits
    check_hbm_tier(tier, None)  # no GPU to ask


def test_geometry_refusals():
    check_geometry(128, 16)
    check_geometry(64, 64)
    with pytest.raises(ValueError, match="head_dim 96"):
        check_geometry(96, 16)
    with pytest.raises(ValueError, match="block_size 8"):
        check_geometry(128, 8)


# ---- one step end to end on CPU pools ------------------------------------------------------------
def _dense_causal(q, k, v, ctx, scale):
    """float64 attention of q (n, Hq, d) at positions ctx..ctx+n-1 over k, v (L, Hkv, d)."""
    n, hq, _ = q.shape
    g = hq // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1).double(), v.repeat_interleave(g, 1).double()
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    pos = torch.arange(n)[:, None] + ctx
    s = s.masked_fill(torch.arange(k.shape[0])[None, :] > pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)


def _assert_layer_matches_dense(dk, pools, shape, keys, values, scale):
    """One layer of the planned step run over ``pools`` (the layer's ``PoolView``) on fresh
    queries equals ``_dense_causal`` over the layer's whole sequences ``keys`` / ``values``."""
    d = keys[0].shape[-1]
    q = torch.randn(shape.num_tokens, dk.current.shape.num_q_heads, d)
    out = dk.run(q, 0, softmax_scale=scale, pools=pools)
    at = 0
    for b, (qn, c) in enumerate(zip(shape.q_lens, shape.context_lens)):
        want = _dense_causal(q[at:at + qn], keys[b], values[b], c, scale)
        torch.testing.assert_close(out[at:at + qn].double(), want, atol=1e-5, rtol=1e-5)
        at += qn


def test_a_step_stores_plans_once_and_runs_per_layer_pool():
    """Two layers, each its own pool in the backend's layout; a decode, a chunked prefill and a
    fresh prompt, pages scattered as vLLM's allocator may; history written first, then the
    step's tokens through their slots; one plan, each layer run over its own pool."""
    from directkv_cute.attention import DirectKVAttention
    from directkv_cute.runner import PoolView, tables_from_host

    torch.manual_seed(0)
    L, NB, Hkv, Hq, P, d = 2, 12, 2, 4, 16, 64
    pools = [torch.zeros(NB, Hkv, 2, P, d) for _ in range(L)]
    blocks = np.array([[3, 7, 0, 0], [10, 1, 4, 0], [5, 0, 0, 0]])  # vLLM's block table rows
    starts, lens = np.array([0, 1, 21, 30]), np.array([18, 40, 9])  # q_lens 1, 20, 9
    shape = step_shape(starts, lens, 3)
    keys = [[torch.randn(n, Hkv, d) for n in lens] for _ in range(L)]
    values = [[torch.randn(n, Hkv, d) for n in lens] for _ in range(L)]
    # The step's slots (vLLM's slot_mapping), with one padding token at the end.
    slots = np.concatenate([blocks[b][np.arange(c, n) // P] * P + np.arange(c, n) % P
                            for b, (c, n) in enumerate(zip(shape.context_lens, shape.seq_lens))] + [[-1]])
    dest = slot_destinations(slots, P, NB)
    index = dest.store_index(Hkv, P).to("cpu")
    for layer in range(L):
        for b, (c, n) in enumerate(zip(shape.context_lens, shape.seq_lens)):  # the cached history
            pos = np.arange(c)
            pools[layer][blocks[b][pos // P], :, 0, pos % P] = keys[layer][b][:c]
            pools[layer][blocks[b][pos // P], :, 1, pos % P] = values[layer][b][:c]
    table = page_table(blocks, shape.seq_lens, P, NB)
    tables = tables_from_host(table, shape.seq_lens, "cpu")._replace(back_to_back=True)
    views = [PoolView(p.unsqueeze(1), p.unsqueeze(1)[:0]) for p in pools]
    dk = DirectKVAttention(views[0])
    dk.plan(tables=tables, q_lens=shape.q_lens, num_q_heads=Hq, cascade=False)
    scale = 1 / math.sqrt(d)
    for layer in range(L):
        new_k = torch.cat([keys[layer][b][c:] for b, c in enumerate(shape.context_lens)] + [torch.zeros(1, Hkv, d)])
        new_v = torch.cat([values[layer][b][c:] for b, c in enumerate(shape.context_lens)] + [torch.zeros(1, Hkv, d)])
        store_kv(pools[layer], new_k, new_v, index)
        _assert_layer_matches_dense(dk, views[layer], shape, keys[layer], values[layer], scale)


def test_run_refuses_pools_of_another_geometry():
    from directkv_cute.attention import DirectKVAttention
    from directkv_cute.runner import PoolView, tables_from_host

    a = torch.zeros(4, 1, 2, 2, 16, 64)
    b = torch.zeros(4, 1, 1, 2, 16, 64)
    dk = DirectKVAttention(PoolView(a, a[:0]))
    dk.plan(tables=tables_from_host(np.array([[0]], np.int32), [3], "cpu"), num_q_heads=2)
    with pytest.raises(ValueError, match="pools of another geometry than the cache's: .*num_kv_heads 1 vs 2"):
        dk.run(torch.zeros(1, 2, 64), 0, pools=PoolView(b, b[:0]))


# ---- the HBM tier: sizing ------------------------------------------------------------------------
def test_hbm_pages_from_the_budget():
    # 2 MiB a block over 32 layers (Llama-3-8B-like, blocks of 16): 4 GiB hold 2048 mirrors per layer.
    assert hbm_pages(4 * 2**30, 32, 8, 128, 16) == 2048
    assert hbm_pages(4 * 2**30 + 2**20, 32, 8, 128, 16) == 2048  # whole blocks only
    assert hbm_pages(2**20, 32, 8, 128, 16) == 0  # less than one block: no tier
    assert hbm_pages(0, 32, 8, 128, 16) == 0
    with pytest.raises(ValueError, match="budget_bytes must be >= 0, got -1"):
        hbm_pages(-1, 32, 8, 128, 16)
    with pytest.raises(ValueError, match="num_layers must be >= 1, got 0"):
        hbm_pages(2**30, 0, 8, 128, 16)


# ---- the HBM tier: the mirror policy by hand --------------------------------------------------------
def _step(m: HbmMirrors, table, stores):
    """One policy step over ``table`` (block ids) and ``stores`` ((block, offset) pairs)."""
    pages = np.array([b for b, _ in stores], np.int64)
    offsets = np.array([o for _, o in stores], np.int64)
    return m.step(np.array(table, np.int64), pages, offsets)


def test_only_fresh_blocks_get_mirrors_while_slots_are_free():
    m = HbmMirrors(2)
    # Block 4 is read with a row stored at offset 3 (not fresh); 9 and 2 start this step.
    got = _step(m, [4, 9, 2], [(4, 3), (9, 0), (9, 1), (2, 0)])
    assert got == {9: 0, 2: 1}
    # No free slot and every mirrored block is in the step: the fresh block 6 stays on the host.
    assert _step(m, [9, 2, 6], [(9, 2), (6, 0)]) == {9: 0, 2: 1}
    assert m.mirrored == {9: 0, 2: 1}


def test_a_slot_is_taken_back_from_the_block_seen_least_recently():
    m = HbmMirrors(3)
    assert _step(m, [1, 2, 3], [(1, 0), (2, 0), (3, 0)]) == {1: 0, 2: 1, 3: 2}
    assert _step(m, [2], [(2, 1)]) == {2: 1}  # 1 and 3 absent; 2 seen now
    assert _step(m, [3], [(3, 1)]) == {3: 2}  # 1 is now the least recently seen
    # Two fresh blocks, no free slot: 1's slot first, then 2's (3 is in the step and keeps its own).
    assert _step(m, [3, 7, 8], [(7, 0), (8, 0)]) == {3: 2, 7: 0, 8: 1}
    assert m.mirrored == {3: 2, 7: 0, 8: 1}
    # A block that lost its mirror is read from the host: named by the table, not mapped.
    assert _step(m, [1, 3], []) == {3: 2}


def test_a_reused_block_keeps_its_mirror_and_a_block_stored_into_is_never_taken():
    m = HbmMirrors(1)
    assert _step(m, [5], [(5, 0)]) == {5: 0}
    # vLLM frees block 5 and gives it to another request, which writes it from offset 0 again.
    assert _step(m, [5], [(5, 0), (5, 1)]) == {5: 0}
    # Block 5 is only stored into (a request without query rows in the table is impossible, but
    # a store is enough): the fresh block 6 cannot take its slot.
    assert _step(m, [6], [(5, 2), (6, 0)]) == {5: 0}


def test_no_slots_no_mirrors_and_bad_input():
    assert _step(HbmMirrors(0), [1], [(1, 0)]) == {}
    with pytest.raises(ValueError, match="slots must be >= 0, got -1"):
        HbmMirrors(-1)
    with pytest.raises(TypeError, match="slots must be an int, got bool"):
        HbmMirrors(True)
    with pytest.raises(ValueError, match="1-D of one length"):
        HbmMirrors(2).step([1], [1, 2], [0])


# ---- the HBM tier: the policy against a shadow model over random steps ----------------------------------
class _Shadow:
    """vLLM's side, simplified: requests own blocks (allocated as they grow, freed when they end,
    reused by later requests in any order; a new request may share another's full prefix blocks,
    as prefix caching does), a step appends tokens to some running requests. Each token's K/V is
    a unique number; ``host[b]`` / ``hbm[s]`` hold what the stores wrote (0: never written)."""

    P, NB = 4, 14

    def __init__(self, slots: int):
        self.policy = HbmMirrors(slots)
        self.slots = slots
        self.host = np.zeros((self.NB, self.P), np.int64)
        self.hbm = np.zeros((max(slots, 1), self.P), np.int64)
        self.free = list(range(self.NB))
        self.refs = [0] * self.NB
        self.reqs: dict[int, dict] = {}  # id -> {"blocks": [...], "tokens": [...]}
        self.written: dict[int, set] = {b: set() for b in range(self.NB)}  # offsets of each block's current use
        self.next_value, self.next_req = 1, 0

    def _alloc(self, data) -> int | None:
        if not self.free:
            return None
        b = self.free.pop(data.draw(st.integers(0, len(self.free) - 1), label="which free block"))
        self.refs[b], self.written[b] = 1, set()
        return b

    def start(self, data) -> None:
        rid, self.next_req = self.next_req, self.next_req + 1
        blocks, tokens = [], []
        donors = [r for r in self.reqs.values() if len(r["tokens"]) >= self.P]
        if donors and data.draw(st.booleans(), label="share a prefix"):
            donor = donors[data.draw(st.integers(0, len(donors) - 1))]
            k = data.draw(st.integers(1, len(donor["tokens"]) // self.P))
            blocks, tokens = donor["blocks"][:k], donor["tokens"][: k * self.P]
            for b in blocks:
                self.refs[b] += 1
        self.reqs[rid] = {"blocks": list(blocks), "tokens": list(tokens)}

    def end(self, rid: int) -> None:
        for b in self.reqs.pop(rid)["blocks"]:
            self.refs[b] -= 1
            if not self.refs[b]:
                self.free.append(b)

    def step(self, data) -> None:
        if data.draw(st.booleans(), label="start a request") or not self.reqs:
            self.start(data)
        if len(self.reqs) > 1 and data.draw(st.booleans(), label="end a request"):
            self.end(data.draw(st.sampled_from(sorted(self.reqs))))
        running = sorted(self.reqs)
        chosen = data.draw(st.lists(st.sampled_from(running), min_size=1, unique=True), label="scheduled")
        table, stores, values = [], [], []
        for rid in chosen:
            r = self.reqs[rid]
            for _ in range(data.draw(st.integers(1, 6), label="new tokens")):
                pos = len(r["tokens"])
                if pos % self.P == 0 and pos // self.P == len(r["blocks"]):
                    b = self._alloc(data)
                    if b is None:
                        break
                    r["blocks"].append(b)
                stores.append((r["blocks"][pos // self.P], pos % self.P))
                values.append(self.next_value)
                r["tokens"].append(self.next_value)
                self.next_value += 1
            table += r["blocks"][: -(-len(r["tokens"]) // self.P)]
        before = self.policy.mirrored
        pages = np.array([b for b, _ in stores], np.int64)
        offsets = np.array([o for _, o in stores], np.int64)
        got = self.policy.step(np.array(table, np.int64), pages, offsets)
        self.check(got, before, set(table) | set(pages.tolist()), stores, values, chosen)

    def check(self, got, before, present, stores, values, chosen) -> None:
        after = self.policy.mirrored
        # The step's mapping: its blocks' mirrors, in range, one block per slot.
        assert set(got) <= present and got == {b: s for b, s in after.items() if b in present}
        assert all(0 <= s < self.slots for s in after.values())
        assert len(set(after.values())) == len(after)
        # Blocks of the step keep their mirrors; a new mirror is made only by an offset-0 store.
        assert all(after.get(b) == s for b, s in before.items() if b in present)
        fresh = {b for b, o in stores if o == 0}
        assert all(b in fresh for b, s in after.items() if before.get(b) != s)
        # A fresh block left on the host: every slot holds a block of this step.
        if fresh - set(after):
            assert len(after) == self.slots and set(after) <= present
        # The stores: host pages always, mirrors of mirrored blocks too (write-through).
        for (b, o), v in zip(stores, values):
            self.host[b, o] = v
            self.written[b].add(o)
            if b in got:
                self.hbm[got[b], o] = v
        # Every mirror equals its host page in every row of the block's current use.
        for b, s in after.items():
            rows = sorted(self.written[b])
            assert (self.hbm[s, rows] == self.host[b, rows]).all(), (b, s)
        # What attention reads through the step's table: each request's own tokens.
        for rid in chosen:
            r = self.reqs[rid]
            for pos, want in enumerate(r["tokens"]):
                b, o = r["blocks"][pos // self.P], pos % self.P
                read = self.hbm[got[b], o] if b in got else self.host[b, o]
                assert read == want, (rid, pos, b, b in got)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(slots=st.integers(0, 5), data=st.data())
def test_the_mirror_policy_against_a_shadow_model(slots, data):
    shadow = _Shadow(slots)
    for _ in range(data.draw(st.integers(1, 30), label="steps")):
        shadow.step(data)


# ---- the HBM tier: tables and stores ----------------------------------------------------------------
def test_page_table_names_mirrored_blocks_by_their_hbm_pages():
    blocks = np.array([[7, 3, 9, 0], [2, 5, 0, 0], [4, 0, 0, 0]], np.int32)
    table = mirror_table(page_table(blocks, [33, 17, 16], page_size=16, num_blocks=10), {3: 0, 5: 4, 4: 2, 8: 1})
    h = lambda slot: encode_page("hbm", slot)  # noqa: E731
    # 3 -> HBM page 0, 5 -> 4 (also in the repeated tail), 4 -> 2; block 8 is not in the table.
    assert table.tolist() == [[7, h(0), 9], [2, h(4), h(4)], [h(2), h(2), h(2)]]
    assert table.dtype == np.int32
    assert mirror_table(page_table(blocks, [33, 17, 16], 16, 10), {}).tolist() == [[7, 3, 9], [2, 5, 5], [4, 4, 4]]


def _pools(NB=6, H=3, Hkv=2, P=16, d=8):
    return torch.zeros(NB, Hkv, 2, P, d), torch.zeros(H, Hkv, 2, P, d)


@pytest.mark.parametrize("padding", [False, True])
def test_stores_go_to_the_host_and_to_the_mirrors_of_mirrored_blocks(padding):
    P, Hkv, d = 16, 2, 8
    host, hbm = _pools()
    slots = [2 * P + 5, 4 * P + 0, 4 * P + 1, 1 * P + 15] + ([-1] if padding else [])
    key, value = torch.randn(len(slots), Hkv, d), torch.randn(len(slots), Hkv, d)
    dest = slot_destinations(slots, P, 6).mirrored({4: 2, 1: 0, 3: 1})  # block 3 is stored into by nobody
    assert dest.dense is not padding
    assert dest.hbm_at.tolist() == [1, 2, 3] and dest.hbm_slots.tolist() == [2, 2, 0]
    index = dest.store_index(Hkv, P)
    assert len(index.host_rows) == 4 * Hkv * 2 and index.num_mirrored == 3 and len(index.hbm_rows) == 3 * Hkv * 2
    assert (index.tokens is None) is not padding and index.hbm_tokens.tolist() == [1, 2, 3]
    index = index.to("cpu")
    store_kv(host, key, value, index, hbm)
    for i, (page, off, slot) in enumerate([(2, 5, None), (4, 0, 2), (4, 1, 2), (1, 15, 0)]):
        assert torch.equal(host[page, :, 0, off], key[i]) and torch.equal(host[page, :, 1, off], value[i])
        if slot is not None:
            assert torch.equal(hbm[slot, :, 0, off], key[i]) and torch.equal(hbm[slot, :, 1, off], value[i])
    assert int((host != 0).sum()) == 4 * 2 * Hkv * d and int((hbm != 0).sum()) == 3 * 2 * Hkv * d
    with pytest.raises(ValueError, match="3 K/V rows go to HBM mirrors, but no HBM pool was given"):
        store_kv(host, key, value, index, None)


def test_store_index_rows_by_hand():
    # pool (pages, Hkv=2, 2, P, d) viewed as (-1, d): row ((page * 2 + h) * 2 + c) * P + offset
    dense = slot_destinations([64, 65, 127], 64, 2).mirrored(None).store_index(2, 64)
    assert dense.tokens is None and dense.span == 3 and dense.num_mirrored == 0
    assert dense.host_rows.tolist() == [256, 320, 384, 448, 257, 321, 385, 449, 319, 383, 447, 511]
    sparse = slot_destinations([35, -1, 160], 16, 20).mirrored({10: 1}).store_index(1, 16)
    assert sparse.tokens.tolist() == [0, 2] and sparse.span == 3  # token 1 is padding
    assert sparse.host_rows.tolist() == [67, 83, 320, 336]  # page 2 offset 3; page 10 offset 0
    assert sparse.hbm_rows.tolist() == [32, 48] and sparse.hbm_tokens.tolist() == [2]  # mirror slot 1
    moved = sparse.to("cpu")
    assert moved.host_rows.dtype == torch.int64 and moved.tokens.tolist() == [0, 2]
    assert moved.hbm_rows.tolist() == [32, 48] and moved.hbm_tokens.tolist() == [2] and moved.span == 3


def test_store_kv_refuses_a_pool_of_another_layout():
    host = torch.zeros(4, 2, 2, 16, 8)
    index = slot_destinations([3], 16, 4).store_index(2, 16).to("cpu")
    key = value = torch.randn(1, 2, 8)
    with pytest.raises(ValueError, match="contiguous"):
        store_kv(host.transpose(1, 2), key, value, index)


def test_a_step_over_mirrored_and_host_blocks_matches_dense_attention():
    """Two layers, each with its host pool and its HBM pool of 4 mirror pages, one mapping for
    both. Step A stores every request's history through the policy: the first four blocks whose
    offset 0 is written get mirrors (a request that then ends holds one). Step B: a decode, a
    chunked prefill and a fresh prompt; the ended request's slot goes to the block whose offset 0
    the prefill writes; the rest stay on the host. Host pages of mirrored blocks are then spoiled
    with NaN: attention must read those blocks from HBM, and match dense attention."""
    from directkv_cute.attention import DirectKVAttention
    from directkv_cute.runner import PoolView, tables_from_host

    torch.manual_seed(2)
    L, NB, H, Hkv, Hq, P, d = 2, 12, 4, 2, 4, 16, 64
    host = [torch.zeros(NB, Hkv, 2, P, d) for _ in range(L)]
    hbm = [torch.zeros(H, Hkv, 2, P, d) for _ in range(L)]
    mirrors = HbmMirrors(H)
    blocks = np.array([[3, 7, 0, 0], [10, 1, 4, 0], [5, 0, 0, 0]])
    lens, ctx = np.array([18, 40, 9]), np.array([17, 20, 0])
    keys = [[torch.randn(n, Hkv, d) for n in lens] for _ in range(L)]
    values = [[torch.randn(n, Hkv, d) for n in lens] for _ in range(L)]
    gone_k, gone_v = [torch.randn(5, Hkv, d) for _ in range(L)], [torch.randn(5, Hkv, d) for _ in range(L)]

    def slots_of(b, lo, hi):
        pos = np.arange(lo, hi)
        return blocks[b][pos // P] * P + pos % P

    def store(slots, new_k, new_v, table):
        dest = slot_destinations(slots, P, NB)
        got = mirrors.step(table, dest.pages, dest.offsets)
        dest = dest.mirrored(got)
        index = dest.store_index(Hkv, P).to("cpu")
        for layer in range(L):
            store_kv(host[layer], new_k[layer], new_v[layer], index, hbm[layer])
        return got

    # Step A: the ended request (5 tokens in block 8) first, then the histories of requests 0 and 1.
    slots_a = np.concatenate([8 * P + np.arange(5), slots_of(0, 0, 17), slots_of(1, 0, 20)])
    table_a = np.array([8, 3, 7, 10, 1])
    cat = lambda parts: [torch.cat(p) for p in parts]  # noqa: E731
    got_a = store(slots_a, cat([[gone_k[i], keys[i][0][:17], keys[i][1][:20]] for i in range(L)]),
                  cat([[gone_v[i], values[i][0][:17], values[i][1][:20]] for i in range(L)]), table_a)
    assert got_a == {8: 0, 3: 1, 7: 2, 10: 3}  # block 1 (offset 0 at position 16) found no free slot

    # Step B.
    shape = step_shape(np.array([0, 1, 21, 30]), lens, 3)
    ids = page_table(blocks, shape.seq_lens, P, NB)
    slots_b = np.concatenate([slots_of(b, c, n) for b, (c, n) in enumerate(zip(ctx, lens))] + [[-1]])
    new_k = cat([[keys[i][b][c:] for b, c in enumerate(ctx)] + [torch.zeros(1, Hkv, d)] for i in range(L)])
    new_v = cat([[values[i][b][c:] for b, c in enumerate(ctx)] + [torch.zeros(1, Hkv, d)] for i in range(L)])
    got_b = store(slots_b, new_k, new_v, ids)
    assert got_b == {3: 1, 7: 2, 10: 3, 4: 0}  # 8 was absent: its slot went to 4; 1 and 5 stay on the host
    table = mirror_table(page_table(blocks, shape.seq_lens, P, NB), got_b)
    assert (table < 0).sum() == 5  # 3, 7, 10, 4 and the repeat of 7 past request 0's pages
    for layer in range(L):
        for b, s in got_b.items():
            host[layer][b] = float("nan")  # read from HBM only
    tables = tables_from_host(table, shape.seq_lens, "cpu")._replace(back_to_back=True)
    views = [PoolView(host[i].unsqueeze(1), hbm[i].unsqueeze(1)) for i in range(L)]
    dk = DirectKVAttention(views[0])
    dk.plan(tables=tables, q_lens=shape.q_lens, num_q_heads=Hq, cascade=False)
    scale = 1 / math.sqrt(d)
    for layer in range(L):  # an HBM pool of H pages passes the geometry check
        _assert_layer_matches_dense(dk, views[layer], shape, keys[layer], values[layer], scale)


# ---- packaging -----------------------------------------------------------------------------------
def test_the_entry_point_names_register():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {"directkv": "directkv_cute.vllm:register"}
    assert project["optional-dependencies"]["vllm"] == ["vllm==0.26.0"]


def test_the_subpackage_imports_without_vllm():
    code = ("import sys, directkv_cute.vllm, directkv_cute.vllm.step; "
            "assert callable(directkv_cute.vllm.register); assert 'vllm' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ---- against vLLM itself, where it is installed (its import needs no GPU) ---------------------
def _params(fn) -> list[str]:
    import inspect

    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind is not p.VAR_KEYWORD]


def test_register_resolves_custom_to_the_backend_and_matches_vllm_signatures():
    pytest.importorskip("vllm")
    from vllm.v1.attention import backend as vb
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    import directkv_cute.vllm as plugin
    from directkv_cute.vllm import backend as ours

    plugin.register()
    plugin.register()  # idempotent
    assert AttentionBackendEnum.CUSTOM.get_class() is ours.DirectKVBackend
    for cls in (ours.DirectKVBackend, ours.DirectKVImpl, ours.DirectKVMetadataBuilder):
        assert not getattr(cls, "__abstractmethods__", None), cls
    # vLLM's attention layer passes these positionally, then keyword extras (sinks).
    assert _params(ours.DirectKVImpl.__init__)[:len(_params(vb.AttentionImpl.__init__))] == \
        _params(vb.AttentionImpl.__init__)
    assert _params(ours.DirectKVImpl.forward) == _params(vb.AttentionImpl.forward)
    assert _params(ours.DirectKVMetadataBuilder.__init__) == _params(vb.AttentionMetadataBuilder.__init__)
    assert _params(ours.DirectKVMetadataBuilder.build) == _params(vb.AttentionMetadataBuilder.build)
    shape = ours.DirectKVBackend.get_kv_cache_shape(10, 16, 8, 128)
    assert shape == (10, 8, 2, 16, 128)
    assert ours.DirectKVBackend.get_kv_cache_block_dim(16, 8, 128) == 0


def test_vllm_gives_the_backend_its_tuned_page_size_unless_told(monkeypatch):
    """vLLM's block size is the page size: without --block-size vLLM asks the backend and gets
    the tuned one (DEFAULT_PAGE_SIZE); a --block-size the kernels read is kept."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.config.cache import CacheConfig
    from vllm.platforms.interface import Platform

    from directkv_cute.config import DEFAULT_PAGE_SIZE
    from directkv_cute.vllm.backend import DirectKVBackend

    assert DEFAULT_PAGE_SIZE != CacheConfig.DEFAULT_BLOCK_SIZE
    monkeypatch.setattr(Platform, "_find_non_ssm_backend", classmethod(lambda cls, cfg: DirectKVBackend))
    for given, want in ((None, DEFAULT_PAGE_SIZE), (32, 32), (16, 16)):
        cache = CacheConfig() if given is None else CacheConfig(block_size=given)
        cfg = SimpleNamespace(cache_config=cache, model_config=SimpleNamespace(is_hybrid=False))
        Platform.update_block_size_for_backend(cfg)
        assert cache.block_size == want, (given, cache.block_size)


def test_register_wraps_the_v2_runner_kv_allocation_once():
    pytest.importorskip("vllm")
    import vllm.v1.worker.gpu.attn_utils as attn_utils
    import vllm.v1.worker.gpu.model_runner as model_runner

    import directkv_cute.vllm as plugin

    plugin.register()
    wrapped = model_runner.init_kv_cache
    assert getattr(wrapped, "directkv", False)
    plugin.register()
    assert model_runner.init_kv_cache is wrapped  # not wrapped twice
    assert _params(wrapped.__wrapped__) == _params(attn_utils.init_kv_cache)
    assert _params(attn_utils._allocate_kv_cache) == ["kv_cache_config", "shared_layers", "device"]


def test_a_kv_cache_beyond_host_memory_is_refused_where_vllm_builds_its_config(monkeypatch):
    """The host check runs inside ``EngineArgs.create_engine_config`` (the process that parses
    vLLM's arguments, before any engine starts): one line naming the bytes of every GPU of the
    host; other backends and a config without the size pass."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    import directkv_cute.vllm as plugin
    from directkv_cute.vllm import memory

    plugin.register()
    wrapped = EngineArgs.create_engine_config
    assert getattr(wrapped, "directkv", False)
    plugin.register()
    assert EngineArgs.create_engine_config is wrapped  # not wrapped twice

    def config(backend, per_gpu, world=1, nnodes=1):
        return SimpleNamespace(attention_config=SimpleNamespace(backend=backend),
                               cache_config=SimpleNamespace(kv_cache_memory_bytes=per_gpu),
                               parallel_config=SimpleNamespace(world_size=world, nnodes=nnodes))

    custom = AttentionBackendEnum.CUSTOM
    with pytest.raises(MemoryError) as e:
        memory.check_config_host_bytes(config(custom, 40 * 2**30, world=2), 64 * 2**30)
    assert "\n" not in str(e.value) and "of 2 GPUs needs 85899345920 bytes" in str(e.value)
    memory.check_config_host_bytes(config(custom, 40 * 2**30, world=2, nnodes=2), 64 * 2**30)  # one per host
    memory.check_config_host_bytes(config(custom, 40 * 2**30), 64 * 2**30)
    memory.check_config_host_bytes(config(AttentionBackendEnum.FLASH_ATTN, 2**50), 2**30)  # not ours
    memory.check_config_host_bytes(config(custom, None), 2**30)  # no size: the allocation refuses it
    memory.check_config_host_bytes(config(custom, 2**50), None)  # availability unknown
    # the wrapper refuses what vLLM's own config builder returned
    monkeypatch.setattr(memory, "available_host_bytes", lambda: 2**30)
    with pytest.raises(MemoryError, match="lower --kv-cache-memory-bytes"):
        _refusing_wrapper(memory, lambda self: config(custom, 2**31))(None)


def _refusing_wrapper(memory, original):
    """``install_host_check``'s wrapper around ``original`` (a stand-in for vLLM's builder)."""
    import types

    from vllm.engine import arg_utils

    fake = types.SimpleNamespace(create_engine_config=original)
    real = arg_utils.EngineArgs
    try:
        arg_utils.EngineArgs = fake
        memory.install_host_check()
        return fake.create_engine_config
    finally:
        arg_utils.EngineArgs = real


def test_the_backends_log_lines_go_where_vllm_logs(monkeypatch):
    pytest.importorskip("vllm")
    import logging

    import directkv_cute.vllm as plugin

    ours, theirs = logging.getLogger("directkv_cute"), logging.getLogger("vllm")
    monkeypatch.setattr(ours, "handlers", [])
    monkeypatch.setattr(ours, "level", logging.NOTSET)
    handler = logging.Handler(logging.INFO)
    monkeypatch.setattr(theirs, "handlers", [handler])
    monkeypatch.setattr(theirs, "level", logging.INFO)
    plugin.log_like_vllm()
    assert ours.handlers == [handler] and ours.getEffectiveLevel() == logging.INFO
    plugin.log_like_vllm()
    assert ours.handlers == [handler]  # once


def test_blocks_shared_by_prefix_caching_are_planned_once_for_their_sharers():
    """Eight requests whose block tables share 300 prefix blocks (vLLM's prefix caching gives
    them one block id) and own 2 each: on an H200 the step is planned as the cascade, reading
    the shared span once (316 host pages instead of 2416); on a CPU the same tables give the
    dense result."""
    from directkv_cute.attention import DirectKVAttention
    from directkv_cute.machine import DeviceInfo
    from directkv_cute.runner import PoolView, tables_from_host

    NB, Hkv, Hq, P, d, B = 320, 8, 32, 16, 128, 8
    pool = torch.zeros(NB, Hkv, 2, P, d, dtype=torch.bfloat16)
    view = PoolView(pool.unsqueeze(1), pool.unsqueeze(1)[:0])
    blocks = np.array([list(range(300)) + [300 + 2 * b, 301 + 2 * b] for b in range(B)])
    lens = [302 * P - 3] * B
    table = page_table(blocks, lens, P, NB)
    tables = tables_from_host(table, lens, "cpu")._replace(back_to_back=True)
    h200 = DeviceInfo("NVIDIA H200", 132, 143 * 2**30)
    plan = DirectKVAttention(view).plan(tables=tables, q_lens=[1] * B, num_q_heads=Hq, device_info=h200)
    assert plan.route == "cascade"
    assert "316 host pages read instead of 2416" in plan.explain()
    alone = DirectKVAttention(view).plan(tables=tables, q_lens=[1] * B, num_q_heads=Hq, device_info=h200,
                                         cascade=False)
    assert alone.route != "cascade"


def test_a_step_over_shared_blocks_matches_dense_attention_on_the_cpu():
    from directkv_cute.attention import DirectKVAttention
    from directkv_cute.runner import PoolView, tables_from_host

    torch.manual_seed(1)
    NB, Hkv, Hq, P, d = 12, 2, 4, 16, 64
    pool = torch.randn(NB, Hkv, 2, P, d)
    view = PoolView(pool.unsqueeze(1), pool.unsqueeze(1)[:0])
    blocks = np.array([[4, 9, 2], [4, 9, 7], [4, 9, 11]])  # two shared prefix blocks, one own block each
    lens = np.array([40, 35, 48])
    q_lens = (1, 3, 1)
    tables = tables_from_host(page_table(blocks, lens, P, NB), lens, "cpu")._replace(back_to_back=True)
    dk = DirectKVAttention(view)
    dk.plan(tables=tables, q_lens=q_lens, num_q_heads=Hq)
    q = torch.randn(sum(q_lens), Hq, d)
    scale = 1 / math.sqrt(d)
    out = dk.run(q, 0, softmax_scale=scale)
    at = 0
    for b, (qn, n) in enumerate(zip(q_lens, lens)):
        pos = np.arange(n)
        k = pool[blocks[b][pos // P], :, 0, pos % P]
        v = pool[blocks[b][pos // P], :, 1, pos % P]
        want = _dense_causal(q[at:at + qn], k, v, n - qn, scale)
        torch.testing.assert_close(out[at:at + qn].double(), want, atol=1e-5, rtol=1e-5)
        at += qn


def test_available_gpu_bytes_is_unknown_off_a_gpu():
    pytest.importorskip("vllm")
    from directkv_cute.vllm.backend import available_gpu_bytes

    assert available_gpu_bytes("cpu") is None  # the tier check then leaves the allocation to decide


def test_each_rank_pins_its_kv_on_the_numa_node_nearest_its_gpu(monkeypatch):
    """``memory.allocate`` (each vLLM rank's process, one GPU each) pins the backend's KV tensors
    with the thread bound to the NUMA node of its GPU (``tp.gpu_numa_node``): pages are placed
    where pinning first touches them."""
    import contextlib
    from types import SimpleNamespace

    from directkv_cute.vllm import memory

    bound = []

    @contextlib.contextmanager
    def on_node(node):
        bound.append(node)
        yield
        bound.pop()

    made = []
    monkeypatch.setattr(memory, "gpu_numa_node", lambda device: 1 if str(device) == "cuda:1" else 0)
    monkeypatch.setattr(memory, "on_node", on_node)
    monkeypatch.setattr(memory, "pinned_tensor", lambda n, device: made.append((n, list(bound))) or torch.zeros(n, dtype=torch.int8))
    monkeypatch.setattr(memory, "available_host_bytes", lambda: 2**30)
    tensors = [SimpleNamespace(size=4096, shared_by=["a"], block_stride=0),
               SimpleNamespace(size=8192, shared_by=["b"], block_stride=0)]
    config = SimpleNamespace(kv_cache_tensors=tensors, kv_cache_groups=[SimpleNamespace(layer_names=["a", "b"])])
    raw = memory.allocate(config, {}, "cuda:1", {"a", "b"}, 12288)
    assert made == [(4096, [1]), (8192, [1])]  # each pinned on node 1, the node of cuda:1
    assert set(raw) == {"a", "b"} and bound == []
    made.clear()
    memory.allocate(config, {}, "cuda:0", {"a", "b"}, 12288)
    assert [nodes for _, nodes in made] == [[0], [0]]
