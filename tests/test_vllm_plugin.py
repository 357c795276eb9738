"""The vLLM backend's host-side parts, without vLLM: a step's shape from vLLM's CPU metadata,
block table -> page table, slot_mapping -> (page, offset), the per-layer K/V store, sizing, and
one whole step (store, plan once, run per layer) on CPU pools in the backend's layout against a
dense causal attention computed here."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from directkv_cute.vllm.step import (
    check_geometry,
    check_host_bytes,
    host_blocks,
    kv_bytes_per_block,
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
    ([0, 1], [3], -1, "num_reqs must be an int >= 0"),
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
    packed = torch.from_numpy(np.stack([dest.pages, dest.offsets, dest.rows]))
    store_kv(kv, key, value, packed, dest.dense)
    assert torch.equal(kv[2, :, 0, 5], key[0]) and torch.equal(kv[2, :, 1, 5], value[0])
    assert torch.equal(kv[0, :, 0, 15], key[2]) and torch.equal(kv[0, :, 1, 15], value[2])
    assert int((kv != 0).sum()) == 2 * 2 * Hkv * d  # nothing else written


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
    with pytest.raises(ValueError, match="host_bytes must be an int >= 1"):
        host_blocks(0, 32, 8, 128, 16)
    with pytest.raises(MemoryError, match=r"needs 3221225472 bytes \(3 GiB\) of pinned host memory, the host has "
                                          r"1073741824 bytes \(1 GiB\) available; lower --kv-cache-memory-bytes"):
        check_host_bytes(3 * 2**30, 2**30)
    check_host_bytes(3 * 2**30, None)  # unknown availability: pinning itself decides


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
    packed = torch.from_numpy(np.stack([dest.pages, dest.offsets] + ([] if dest.dense else [dest.rows])))
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
        store_kv(pools[layer], new_k, new_v, packed, dest.dense)
        q = torch.randn(shape.num_tokens, Hq, d)
        out = dk.run(q, 0, softmax_scale=scale, pools=views[layer])
        at = 0
        for b, (qn, c) in enumerate(zip(shape.q_lens, shape.context_lens)):
            want = _dense_causal(q[at:at + qn], keys[layer][b], values[layer][b], c, scale)
            torch.testing.assert_close(out[at:at + qn].double(), want, atol=1e-5, rtol=1e-5)
            at += qn


def test_run_refuses_pools_of_another_geometry():
    from directkv_cute.attention import DirectKVAttention
    from directkv_cute.runner import PoolView, tables_from_host

    a = torch.zeros(4, 1, 2, 2, 16, 64)
    b = torch.zeros(4, 1, 1, 2, 16, 64)
    dk = DirectKVAttention(PoolView(a, a[:0]))
    dk.plan(tables=tables_from_host(np.array([[0]], np.int32), [3], "cpu"), num_q_heads=2)
    with pytest.raises(ValueError, match="pools of another geometry than the cache's: .*num_kv_heads 1 vs 2"):
        dk.run(torch.zeros(1, 2, 64), 0, pools=PoolView(b, b[:0]))


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
