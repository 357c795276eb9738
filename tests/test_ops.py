"""The op's CPU-side behaviour: the CPU path, the torch.library registration, kernel dispatch and
input validation (GPU launches are covered by tests/test_attention_gpu.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import directkv_cute as dk
from directkv_cute import ops, runner
from directkv_cute.config import DecodeConfig, multi_token_splits
from directkv_cute.machine import H200, DeviceInfo, stream_capturing
from directkv_cute.planner import CallShape, DefaultConfigs, plan_attention
from directkv_cute.validate import check_q_lens


@pytest.fixture
def cache_and_q(randn):
    cache = dk.PagedKVCache(2, 2, 64, 16, num_host_pages=40, num_hbm_pages=12, dtype=torch.bfloat16, device="cpu")
    ids = []
    for n in (70, 5, 33):
        sid = cache.add_sequence()
        cache.append(sid, randn(n, 2, 2, 64), randn(n, 2, 2, 64))
        ids.append(sid)
    cache.set_hbm_fraction(ids[0], 0.5, "strided")
    q = randn(1 + 5 + 4, 8, 64)
    return cache, ids, q, [1, 5, 4]


def test_cpu_path_is_the_reference(cache_and_q):
    cache, ids, q, q_lens = cache_and_q
    out = torch.full_like(q, float("nan"))
    o, lse = dk.paged_attention(q, cache, 1, ids, q_lens, out=out, return_lse=True)
    ro, rl = dk.paged_attention_ref(q, cache, 1, ids, q_lens)
    assert o.data_ptr() == out.data_ptr()
    assert torch.equal(o, ro) and torch.equal(lse, rl)
    # and the reference itself agrees with the independent float64 dense one
    ks, vs = zip(*(cache.read(s, 1) for s in ids))
    do, dl = dk.dense_attention_ref(q, ks, vs, q_lens, None)
    assert ((o.double() - do).norm() / do.norm()) < 1e-2
    assert torch.allclose(lse.double(), dl, atol=1e-3)


def test_torch_library_op_matches_and_passes_opcheck(cache_and_q):
    cache, ids, q, q_lens = cache_and_q
    t = cache.kernel_tables(ids)
    o, lse = torch.ops.directkv_cute.paged_attention(q, cache.host_pool, cache.hbm_pool, t.page_table, t.seq_lens, 0,
                                                       q_lens)
    ro, rl = dk.paged_attention_ref(q, cache, 0, ids, q_lens)
    assert torch.equal(o, ro) and torch.equal(lse, rl)
    torch.library.opcheck(ops.attention_op, (q, cache.host_pool, cache.hbm_pool, t.page_table, t.seq_lens, 0, q_lens))


def test_fake_tensor_shapes(cache_and_q):
    from torch._subclasses.fake_tensor import FakeTensorMode

    cache, ids, q, q_lens = cache_and_q
    t = cache.kernel_tables(ids)
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(x) for x in (q, cache.host_pool, cache.hbm_pool, t.page_table, t.seq_lens)]
        o, lse = torch.ops.directkv_cute.paged_attention(*args, 0, q_lens)
    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == q.shape[:2] and lse.dtype == torch.float32


@pytest.mark.parametrize(
    "group,q_len,cfg,kernel",
    [
        (4, 1, DecodeConfig(), "decode"),
        (8, 8, DecodeConfig(), "decode"),  # 64 rows: one consumer warpgroup
        (8, 9, DecodeConfig(), "multi_token"),  # 72 rows do not fit one warpgroup's 64
        (8, 16, DecodeConfig(consumer_wgs=2), "decode"),
        (4, 2048, DecodeConfig(consumer_wgs=2, carveout=100), "multi_token"),
        (5, 12, DecodeConfig(), "decode"),  # group 5: 60 of the 64 rows used
        (5, 13, DecodeConfig(), "multi_token"),
        (4, 1, DecodeConfig(consumer_wgs=2, stages=7, carveout=100, q_regs=1), "multi_token"),  # q_regs: multi-token
        (4, 1, DecodeConfig(consumer_wgs=2, carveout=100, ctas_per_sm=1, q_cluster=2), "multi_token"),  # so is q_cluster
    ],
)
def test_explicit_config_dispatch(group, q_len, cfg, kernel):
    shape = CallShape.example([4096], [q_len], num_q_heads=group, num_kv_heads=1, page_size=64, tier="hbm")
    plan = plan_attention(shape, DeviceInfo("H", 132, 140 * 2**30), H200, DefaultConfigs(), cfg)
    assert plan.config is cfg and plan.kernel == kernel and plan.route == kernel


def test_multi_token_splits_one_chunk_per_cta_without_chunk_tiles():
    cfg = DecodeConfig(tile_n=64, stages=6, consumer_wgs=2, carveout=100)
    for ctx in (1, 63, 64, 65, 384, 385, 32768 + 512, 131072):
        splits = multi_token_splits(cfg, ctx)
        tiles = -(-ctx // 64)
        assert -(-tiles // splits) <= cfg.stages  # the largest split is one chunk
        assert splits == 1 or -(-tiles // (splits - 1)) > cfg.stages  # and no fewer splits would do


@pytest.mark.parametrize("batch,hkv", [(1, 8), (2, 8), (1, 1), (16, 8), (40, 8)])
def test_multi_token_splits_walking_chunks_fill_one_wave(batch, hkv):
    cfg = DecodeConfig(tile_n=64, stages=6, consumer_wgs=2, carveout=100, chunk_tiles=3)
    assert cfg.resident_ctas(128) == 1
    for ctx in (64, 1000, 32768, 131072):
        splits = multi_token_splits(cfg, ctx, batch, hkv, 132)
        chunks = -(-(-(-ctx // 64)) // 3)
        assert 1 <= splits <= chunks
        ctas = splits * batch * hkv
        assert ctas <= max(132, batch * hkv)  # never a second, partial wave
        if splits < chunks:
            assert (splits + 1) * batch * hkv > 132  # and no more CTAs would fit the wave
    assert multi_token_splits(dataclasses.replace(cfg, num_splits=5), 32768, batch, hkv) == 5


@pytest.mark.parametrize(
    "q_lens,total,msg",
    [([1, 1], 3, "sum"), ([2], 2, "entries"), ([0, 2, 1], 3, ">= 1")],
)
def test_q_lens_validation(q_lens, total, msg):
    with pytest.raises(ValueError, match=msg):
        _offsets(q_lens, 3 if len(q_lens) == 3 else 2, total)


def _offsets(q_lens, batch, total_q):
    """The op's path to the query offsets: validate q_lens, then the cached device copy."""
    lens = check_q_lens(q_lens, batch, total_q)
    return runner.cu_seqlens(lens, "cpu", stream_capturing()), max(lens)


def test_query_offsets_are_cached_per_q_lens(monkeypatch):
    """Query offsets: cumulative sums, the longest q_len, one device tensor per distinct q_lens
    (decode's ones included; reused, so a repeated shape skips the copy); past the cap new q_lens
    are still right but not kept."""
    monkeypatch.setattr(runner, "_CU_Q", {})
    cu, mx = _offsets([3, 1, 4], 3, 8)
    assert cu.tolist() == [0, 3, 4, 8] and cu.dtype == torch.int32 and mx == 4
    again, _ = _offsets(torch.tensor([3, 1, 4]), 3, 8)
    assert again is cu
    other, mx = _offsets([4, 1, 3], 3, 8)
    assert other.tolist() == [0, 4, 5, 8] and other is not cu and mx == 4
    # decode (no q_lens): one query per sequence, the same cache as q_lens of ones
    ones, mx = _offsets(None, 3, 3)
    assert ones.tolist() == [0, 1, 2, 3] and mx == 1 and _offsets([1, 1, 1], 3, 3)[0] is ones
    monkeypatch.setattr(runner, "_CU_Q_CAP", len(runner._CU_Q))  # full
    past, _ = _offsets([2, 2], 2, 4)
    assert past.tolist() == [0, 2, 4] and len(runner._CU_Q) == runner._CU_Q_CAP
    assert _offsets([2, 2], 2, 4)[0] is not past
    # inside a CUDA graph capture only q_lens already seen can be used (no host copy is captured)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert _offsets([3, 1, 4], 3, 8)[0] is cu
    with pytest.raises(RuntimeError, match="first seen inside CUDA graph capture"):
        _offsets([1, 1, 6], 3, 8)


def test_tables_entry_needs_cuda(cache_and_q):
    cache, ids, q, _ = cache_and_q
    with pytest.raises(ValueError, match="CUDA"):
        dk.paged_attention_tables(q[:3], cache, 0, cache.kernel_tables(ids))


def test_bad_inputs_fail_before_anything_runs(cache_and_q):
    cache, ids, q, q_lens = cache_and_q
    with pytest.raises(TypeError):
        dk.paged_attention(q.half(), cache, 0, ids, q_lens)
    with pytest.raises(IndexError):
        dk.paged_attention(q, cache, 2, ids, q_lens)
    with pytest.raises(ValueError):
        dk.paged_attention(q, cache, 0, ids, [1, 5, 3])
    with pytest.raises(ValueError, match="head_dim"):
        dk.paged_attention(q[:, :, :32].contiguous(), cache, 0, ids, q_lens)
    with pytest.raises(ValueError, match="multiple"):
        dk.paged_attention(q[:, :5].contiguous(), cache, 0, ids, q_lens)  # Hq 5, Hkv 2


def test_multi_token_chunk_and_occupancy_rules():
    from directkv_cute.config import ConfigError

    with pytest.raises(ConfigError, match="chunk_tiles"):
        DecodeConfig(stages=4, chunk_tiles=4).check(128)
    for bad in (-1, 4):
        with pytest.raises(ConfigError, match="max_inflight"):
            DecodeConfig(stages=4, max_inflight=bad).check(128)
    DecodeConfig(stages=4, max_inflight=3).check(128)
    # link admission needs one tile in flight per CTA; edge chunks fit in a chunk
    for bad in (-1, 1 << 21):
        with pytest.raises(ConfigError, match="link_credits"):
            DecodeConfig(stages=4, max_inflight=1, link_credits=bad).check(128)
    for f in (0, 2):
        with pytest.raises(ConfigError, match="needs max_inflight 1"):
            DecodeConfig(stages=4, max_inflight=f, link_credits=8).check(128)
    DecodeConfig(stages=4, max_inflight=1, link_credits=8).check(128)
    with pytest.raises(ConfigError, match="edge_tiles"):
        DecodeConfig(stages=4, chunk_tiles=2, edge_tiles=3).check(128)
    with pytest.raises(ConfigError, match="edge_tiles"):
        DecodeConfig(stages=4, edge_tiles=-1).check(128)
    DecodeConfig(stages=4, chunk_tiles=0, edge_tiles=4).check(128)  # chunk 0 = the whole ring
    # Q in registers frees the Q tile's SMEM: a seventh 64-token stage fits beside two warpgroups
    with pytest.raises(ConfigError, match="q_regs"):
        DecodeConfig(q_regs=2).check(128)
    seven = DecodeConfig(tile_n=64, stages=7, consumer_wgs=2, carveout=100, ctas_per_sm=1, chunk_tiles=5)
    assert not seven.is_legal(128) and dataclasses.replace(seven, q_regs=1).is_legal(128)
    assert seven.smem_bytes(128) - dataclasses.replace(seven, q_regs=1).smem_bytes(128) == 128 * 128 * 2
    # profiles written before the field existed still load (it defaults to no limit)
    assert DecodeConfig.from_dict({"tile_n": 64, "stages": 4}).max_inflight == 0
    assert DecodeConfig(stages=4, chunk_tiles=0).chunk == 4 and DecodeConfig(stages=4, chunk_tiles=3).chunk == 3
    two = DecodeConfig(tile_n=64, stages=3, consumer_wgs=1, carveout=100, ctas_per_sm=2)
    assert two.multi_token_occupancy(128) == 2  # 2 x (96 KB ring + 16 KB Q + 1 KB + 1 KB reserved) = 228 KB
    assert dataclasses.replace(two, consumer_wgs=2).multi_token_occupancy(128) == 1
    assert dataclasses.replace(two, stages=4).multi_token_occupancy(128) == 1
    assert dataclasses.replace(two, carveout=90).multi_token_occupancy(128) == 1
    # the default: Q in registers, a ring of seven 64-token tiles in chunks of four up to
    # MULTI_TOKEN_CHUNK4_ROWS query rows and of six above, admitted to the link one tile at a time
    from directkv_cute.config import MULTI_TOKEN_CHUNK4_ROWS, MULTI_TOKEN_LINK_CREDITS, default_multi_token_config

    d128 = default_multi_token_config(128)
    assert (d128.tile_n, d128.stages, d128.chunk_tiles, d128.consumer_wgs, d128.q_regs) == (64, 7, 4, 2, 1)
    assert d128.max_inflight == 1 and d128.link_credits == MULTI_TOKEN_LINK_CREDITS > 0
    assert default_multi_token_config(128, MULTI_TOKEN_CHUNK4_ROWS).chunk_tiles == 4
    assert default_multi_token_config(128, MULTI_TOKEN_CHUNK4_ROWS + 1).chunk_tiles == 6
    # clusters of two from MULTI_TOKEN_CLUSTER_ROWS to MULTI_TOKEN_CHUNK4_ROWS rows, without link credits
    # below MULTI_TOKEN_STAGGER_ROWS and staggered under MULTI_TOKEN_STAGGER_CREDITS from there
    from directkv_cute.config import (MULTI_TOKEN_CLUSTER_ROWS, MULTI_TOKEN_STAGGER, MULTI_TOKEN_STAGGER_CREDITS,
                                      MULTI_TOKEN_STAGGER_ROWS)

    assert MULTI_TOKEN_CLUSTER_ROWS < MULTI_TOKEN_STAGGER_ROWS <= MULTI_TOKEN_CHUNK4_ROWS
    for rows, cluster, stagger in ((MULTI_TOKEN_CLUSTER_ROWS - 1, 0, 0), (MULTI_TOKEN_CLUSTER_ROWS, 2, 0),
                                   (MULTI_TOKEN_STAGGER_ROWS - 1, 2, 0), (MULTI_TOKEN_STAGGER_ROWS, 2, MULTI_TOKEN_STAGGER),
                                   (MULTI_TOKEN_CHUNK4_ROWS, 2, MULTI_TOKEN_STAGGER), (MULTI_TOKEN_CHUNK4_ROWS + 1, 0, 0),
                                   (None, 0, 0)):
        cfg = default_multi_token_config(128, rows)
        assert cfg.q_cluster == cluster and cfg.stagger == stagger, rows
        credits = (MULTI_TOKEN_STAGGER_CREDITS if stagger else 0) if cluster else MULTI_TOKEN_LINK_CREDITS
        assert cfg.link_credits == credits and cfg.max_inflight == 1, rows
    for rows in (256, 2048, 8192, 65536):
        for d in (64, 128):
            assert default_multi_token_config(d, rows).is_legal(d)


@pytest.mark.parametrize("chunk,edge", [(1, 0), (2, 0), (5, 0), (2, 1), (2, 2), (5, 1), (5, 2), (3, 3)])
def test_chunk_bounds_partition_the_split(chunk, edge):
    """The multi-token kernel's chunks over a split: contiguous, covering every tile once, none
    longer than a chunk (the ring must hold it), and with edge chunks the first and the last
    no longer than ``edge``; a split without tiles still makes one empty pass."""
    from directkv_cute.config import chunk_bounds

    assert chunk_bounds(0, chunk, edge) == [(0, 0)]
    for n in range(1, 40):
        b = chunk_bounds(n, chunk, edge)
        assert b[0][0] == 0 and b[-1][1] == n
        assert all(prev[1] == nxt[0] for prev, nxt in zip(b, b[1:]))
        assert all(0 < end - begin <= chunk for begin, end in b), b
        if edge:
            assert b[0][1] - b[0][0] == min(edge, n) and b[-1][1] - b[-1][0] <= edge, b
            assert len(b) == (1 if n <= edge else 2 + -(-max(0, n - 2 * edge) // chunk)), b
        else:
            assert len(b) == -(-n // chunk)
    assert chunk_bounds(8, 5, 1) == [(0, 1), (1, 6), (6, 7), (7, 8)]
    assert chunk_bounds(16, 2, 1)[:2] == [(0, 1), (1, 3)] and chunk_bounds(16, 2, 1)[-1] == (15, 16)


def test_stagger_config_rules():
    """stagger: 0 (off) or 2..chunk groups, not together with edge chunks; it exists only in the
    multi-token kernel."""
    from directkv_cute.config import ConfigError

    base = dict(tile_n=64, stages=7, consumer_wgs=2, carveout=100, ctas_per_sm=1, chunk_tiles=4, q_regs=1)
    for g in (0, 2, 3, 4):
        DecodeConfig(**base, stagger=g).check(128)
    for g, what in ((1, "stagger 1"), (5, "stagger 5"), (-2, "stagger -2")):
        with pytest.raises(ConfigError, match=what):
            DecodeConfig(**base, stagger=g).check(128)
    with pytest.raises(ConfigError, match="replaces edge chunks"):
        DecodeConfig(**base, stagger=2, edge_tiles=1).check(128)
    DecodeConfig(tile_n=64, stages=4, chunk_tiles=0, stagger=4).check(128)  # chunk 0 = the whole ring
    assert DecodeConfig(**base, stagger=2).multi_token_only == ("q_regs", "stagger")


def _walk(cfg, n_tiles, n_mine):
    """The kernel's walk of one warpgroup, in order: (round, block, begin, end, release target
    after the pass), with the release rule of ``DecodeAttention``: after block m of round j free
    what neither block m + 1 of round j nor block 0 of round j + 1 needs; at a round's end free
    what round j + 1 does not need."""
    from directkv_cute.config import chunk_bounds, pass_bounds, stagger_first, stagger_rounds

    if cfg.stagger:
        rounds = stagger_rounds(n_tiles, cfg.chunk, cfg.stagger)
        bounds = lambda j, m: pass_bounds(j, n_tiles, cfg.chunk, cfg.stages,  # noqa: E731
                                          stagger_first(cfg.chunk, cfg.stagger, m, n_mine))
    else:
        chunks = chunk_bounds(n_tiles, cfg.chunk, cfg.edge_tiles)
        rounds, bounds = len(chunks), (lambda j, m: chunks[j])  # noqa: E731
    round_begin = lambda j: bounds(j, 0)[0] if j < rounds else n_tiles  # noqa: E731
    out = []
    for j in range(rounds):
        for m in range(n_mine):
            b, e = bounds(j, m)
            nxt = round_begin(j + 1)
            if cfg.stagger and m + 1 < n_mine:
                nxt = min(nxt, bounds(j, m + 1)[0])
            elif not cfg.stagger:
                nxt = bounds(j, 0)[0] if m + 1 < n_mine else nxt
            out.append((j, m, b, e, nxt))
        out.append((j, None, None, None, round_begin(j + 1)))
    return out


@pytest.mark.parametrize("chunk,stages,stagger", [(4, 7, 4), (4, 7, 2), (4, 7, 3), (3, 4, 3), (2, 2, 2), (5, 7, 2),
                                                  (6, 7, 6), (4, 7, 0), (3, 6, 0)])
def test_staggered_walk_covers_frees_in_order_and_cannot_deadlock(chunk, stages, stagger):
    """Every block's passes cover its split once, in order, none longer than the ring; the first
    pass of a block in group g holds ceil(chunk (g + 1) / stagger) tiles. A warpgroup never
    frees a tile a later pass of its own still reads, frees in ring order, and warpgroups with
    different block counts sharing one ring (a slot refills once all of them freed it) always
    finish: a simulation of the producer and the warpgroups over every split length."""
    from directkv_cute.config import block_passes

    cfg = DecodeConfig(tile_n=32, stages=stages, carveout=100, chunk_tiles=chunk if chunk < stages else 0,
                       stagger=stagger)
    assert cfg.chunk == chunk and cfg.is_legal(128)
    for n in range(0, 41):
        for n_mine in (1, 3, 8, 32):
            for m in range(n_mine):
                p = block_passes(cfg, n, m, n_mine)
                assert p[0][0] == 0 and p[-1][1] == n and all(a[1] == b[0] for a, b in zip(p, p[1:])), (n, m, p)
                assert all(0 < e - b <= stages for b, e in p[1:]) and p[0][1] - p[0][0] <= chunk, p
                if stagger:
                    assert p[0][1] == min(n, -(-chunk * (m * stagger // n_mine + 1) // stagger)), p
            walk = _walk(cfg, n, n_mine)
            freed = 0
            for j, m, b, e, nxt in walk:
                if m is not None:
                    assert b >= freed or e <= b, (n, walk)  # a pass reads no freed tile
                assert nxt >= freed, (n, walk)  # frees in ring order
                freed = max(freed, nxt)
            assert freed == n
        # Warpgroups with 0, 1, 5 and 8 blocks on one ring of `stages` slots.
        lanes = [_walk(cfg, n, k) for k in (0, 1, 5, 8)]
        pos, waited, freed, loaded = [0] * 4, [0] * 4, [0] * 4, 0
        while any(p < len(w) for p, w in zip(pos, lanes)):
            loaded = min(n, min(freed) + stages)  # the producer refills every slot all have freed
            moved = False
            for i, w in enumerate(lanes):
                while pos[i] < len(w):
                    j, m, b, e, nxt = w[pos[i]]
                    # A pass waits for its own tiles and then frees without waiting (only tiles
                    # it has waited for); a round's end waits for what it frees.
                    need = e if m is not None else nxt
                    if need > loaded:
                        break
                    waited[i] = max(waited[i], need)
                    assert nxt <= waited[i], (n, pos, w[pos[i]])
                    freed[i] = max(freed[i], nxt)
                    pos[i] += 1
                    moved = True
            assert moved, f"deadlock: n={n} positions {pos} freed {freed} loaded {loaded}"
        assert freed == [n] * 4


def test_staggered_walk_costs_passes_only_where_the_remainder_is_not_absorbed():
    """At 16 tiles per split in chunks of four over a ring of seven, the four groups' blocks make
    5, 4, 4 and 4 passes (the remainders of the second and third group join their last pass),
    against 4 each unstaggered."""
    from directkv_cute.config import block_passes

    cfg = DecodeConfig(tile_n=64, stages=7, chunk_tiles=4, stagger=4)
    got = [block_passes(cfg, 16, m, 32) for m in (0, 8, 16, 24)]
    assert got == [[(0, 1), (1, 5), (5, 9), (9, 13), (13, 16)], [(0, 2), (2, 6), (6, 10), (10, 16)],
                   [(0, 3), (3, 7), (7, 11), (11, 16)], [(0, 4), (4, 8), (8, 12), (12, 16)]]
    assert block_passes(dataclasses.replace(cfg, stagger=0), 16, 0, 32) == [(0, 4), (4, 8), (8, 12), (12, 16)]


def test_cluster_config_rules_and_splits():
    """q_cluster: 0, 2 or 4 CTAs; one CTA per SM; with link_credits (rank 0 admits each tile for
    the cluster) under the same one-tile-in-flight rule; and the automatic split count leaves room
    for the whole cluster."""
    from directkv_cute.config import ConfigError

    base = DecodeConfig(tile_n=64, stages=7, consumer_wgs=2, carveout=100, ctas_per_sm=1, chunk_tiles=4, q_regs=1)
    assert dataclasses.replace(base, q_cluster=2).is_legal(128, 64)
    assert dataclasses.replace(base, q_cluster=2).cluster == 2 and base.cluster == 1
    assert DecodeConfig().multi_token_only == () and base.multi_token_only == ("q_regs",)
    assert dataclasses.replace(base, q_cluster=2).multi_token_only == ("q_regs", "q_cluster")
    for bad, why in ((3, "q_cluster"), (8, "q_cluster")):
        with pytest.raises(ConfigError, match=why):
            dataclasses.replace(base, q_cluster=bad).check(128, 64)
    # four CTAs over 64-token tiles of 64-token pages: the kernel halves the boxes (4 of 32 rows)
    for page in (16, 32, 64, 128):
        assert dataclasses.replace(base, q_cluster=4).is_legal(128, page)
    for c in (2, 4):
        assert dataclasses.replace(base, q_cluster=c, max_inflight=1, link_credits=16).is_legal(128, 64)
        assert "needs max_inflight 1" in " ".join(dataclasses.replace(base, q_cluster=c, link_credits=16).problems(128))
    two = DecodeConfig(tile_n=64, stages=3, consumer_wgs=1, carveout=100, ctas_per_sm=2, chunk_tiles=2, q_cluster=2)
    assert two.multi_token_occupancy(128) == 2 and "one CTA per SM" in " ".join(two.problems(128, 64))
    # 8k tokens, 8 KV heads, 132 SMs: 16 splits per head alone, 8 clusters of two
    assert multi_token_splits(base, 8192, 1, 8, 132, 128) == 16
    assert multi_token_splits(dataclasses.replace(base, q_cluster=2), 8192, 1, 8, 132, 128) == 8


def test_stale_tables_are_refused_before_any_work(randn):
    from directkv_cute.cache import StaleTablesError

    cache = dk.PagedKVCache(1, 2, 64, 16, num_host_pages=8, device="cpu")
    a, b = cache.add_sequence(), cache.add_sequence()
    for s in (a, b):
        cache.append(s, randn(20, 1, 2, 64), randn(20, 1, 2, 64))
    tables = cache.kernel_tables([a])
    cache.free(b)  # its pages may now be handed to another sequence
    with pytest.raises(StaleTablesError, match="stale"):
        dk.paged_attention_tables(randn(1, 4, 64), cache, 0, tables)


def test_fp8_decode_takes_the_decode_entry_adapted_without_a_warning_where_it_has_none(recwarn):
    """No decode_fp8 entry in the shipped H200 profile: the op uses its decode entry, adapted to
    FP8 stages, and says nothing about the missing FP8 entry."""
    from directkv_cute import fp8
    from directkv_cute.cache import PagedKVCache
    from directkv_cute.planner import ProfileConfigs, fp8_decode_config

    shape = CallShape.example([131072], [1], num_q_heads=32, num_kv_heads=8, page_dtype=torch.float8_e4m3fn)
    configs = ProfileConfigs("NVIDIA H200")
    cfg = fp8_decode_config(configs, shape, 4, 1, 131072, 1)
    decode, source = configs.get("decode", shape, 4, 1, 131072, 1)
    assert source == "exact" and cfg == fp8.decode_config(decode, 128, 64)
    assert not fp8.decode_problems(cfg, 128, 64)
    assert not [w for w in recwarn if "decode_fp8" in str(w.message)]
