"""CPU tests of the staged Q-tiled path's host side: the staging plan, the piece size, the cost
model, the config's legality and compile key."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from directkv_cute.config import ConfigError, QTiledConfig, q_tiles
from directkv_cute.machine import H200, DeviceInfo
from directkv_cute.plan import LINK_STAGE_MARGIN, causal_flops, may_stage, partial_bytes
from directkv_cute.stage_plan import MAX_PIECES, choose_staged, piece_pages_for, plan_staging


def _encode(tier_hbm: bool, page: int) -> int:
    return -page - 1 if tier_hbm else page


@st.composite
def batches(draw):
    page = draw(st.sampled_from([16, 64, 128]))
    lens = draw(st.lists(st.integers(1, 40 * page), min_size=1, max_size=5))
    n_pages = [math.ceil(n / page) for n in lens]
    width = max(n_pages) + draw(st.integers(0, 3))
    # A shuffled pool of host and HBM page ids, some runs consecutive, some not.
    host_ids = draw(st.permutations(range(sum(n_pages) + 8)))
    table = np.zeros((len(lens), width), dtype=np.int32)
    k = 0
    for b, n in enumerate(n_pages):
        consecutive = draw(st.booleans())
        start = draw(st.integers(0, 1000))
        for j in range(n):
            hbm = draw(st.booleans()) if draw(st.integers(0, 3)) == 0 else False
            pid = (start + j) if consecutive else host_ids[k]
            table[b, j] = _encode(hbm, pid)
            k += 1
        table[b, n:] = table[b, n - 1]
    pp = draw(st.integers(1, 12))
    return table, lens, page, pp


@settings(max_examples=60, deadline=None)
@given(batches(), st.sampled_from([0, 3]))
def test_plan_copies_every_page_once_to_its_staged_slot(case, hbm_layers):
    """Each distinct page the batch reads is copied once, no later than the piece that first needs
    it; with ``hbm_layers`` the pages already in HBM are not copied, their entries index the HBM
    pool's one-layer view (page * L)."""
    table, lens, page, pp = case
    plan = plan_staging(table, lens, page, pp, hbm_layers)
    n_pages = [math.ceil(n / page) for n in lens]
    used = {int(table[b, j]) for b, n in enumerate(n_pages) for j in range(n)}
    if hbm_layers:
        used = {e for e in used if e >= 0}
    assert plan.pages == len(used), "each distinct page is copied once"
    hbm_read = any(table[b, j] < 0 for b, n in enumerate(n_pages) for j in range(n))
    assert plan.reads_in_place == (bool(hbm_layers) and hbm_read)
    assert len(plan.pieces) == math.ceil(max(n_pages) / pp)
    # Replay the copies: staging slot -> (tier, source page).
    landed = {}
    for p, runs in enumerate(plan.pieces):
        for r in runs:
            assert r.count >= 1
            for i in range(r.count):
                assert r.dst + i not in landed, "a staging page written twice"
                landed[r.dst + i] = (r.hbm, r.src + i, p)
    assert sorted(landed) == list(range(plan.pages))
    for b, n in enumerate(n_pages):
        for j in range(n):
            e = int(plan.table[b, j])
            if hbm_layers and table[b, j] < 0:
                assert e == (-int(table[b, j]) - 1) * hbm_layers, "an HBM page read in place"
                continue
            assert e < 0, "staged entries are HBM entries"
            slot = -e - 1
            hbm, src, piece = landed[slot]
            assert _encode(hbm, src) == table[b, j]
            assert piece <= j // pp, "a page copied after the piece the kernel waits for"
        # Past the sequence's pages the last entry repeats (a valid page).
        assert (plan.table[b, n:] == plan.table[b, n - 1]).all()
    assert plan.host_pages == sum(1 for e in used if e >= 0)


def test_plan_copies_pages_that_forks_share_once():
    """Sixteen forks of one 40-page prompt with 3 own pages each: the prompt's pages are copied
    once, in the piece each is first needed, and every fork's entries point at them."""
    prompt = np.arange(100, 140, dtype=np.int32)
    table = np.stack([np.concatenate([prompt, np.arange(1000 + 3 * i, 1003 + 3 * i, dtype=np.int32)])
                      for i in range(16)])
    plan = plan_staging(table, [43 * 64] * 16, 64, 8)
    assert plan.pages == 40 + 16 * 3 and plan.host_pages == 40 + 16 * 3
    assert (plan.table[:, :40] == plan.table[0, :40]).all()
    assert len({int(e) for e in plan.table[:, 40:].reshape(-1)}) == 16 * 3
    copied = [r for piece in plan.pieces[:5] for r in piece if 100 <= r.src < 140]
    assert sum(r.count for r in copied) == 40


def test_plan_merges_consecutive_pages_into_one_copy():
    table = np.array([[5, 6, 7, 8, -1, -2, 20, 21]], dtype=np.int32)
    plan = plan_staging(table, [8 * 64], 64, 8)
    runs = plan.pieces[0]
    assert [(r.hbm, r.src, r.dst, r.count) for r in runs] == [(False, 5, 0, 4), (False, 20, 4, 2), (True, 0, 6, 2)]


def _staged_sources(plan, table, seq_lens, page_size):
    """Per (row, logical page) of a sequence, the (tier, page) its staged entry's data came from."""
    came = {}
    for piece in plan.pieces:
        for r in piece:
            for k in range(r.count):
                came[r.dst + k] = (r.hbm, r.src + k)
    out = {}
    for b, n in enumerate(seq_lens):
        for j in range(-(-n // page_size)):
            out[b, j] = came[-int(plan.table[b, j]) - 1]
    return out


@pytest.mark.parametrize("order", ["descending", "shuffled", "descending runs"])
def test_pages_handed_out_in_any_order_are_copied_in_few_runs(order):
    """Pages a sequence holds descending (an engine that frees blocks last to first), shuffled,
    or as descending runs of ascending pages: a piece's pages are copied in page order, so the
    copies are the piece's maximal runs of consecutive pages, and every logical page still finds
    its own page's data through the staged table."""
    rng = np.random.default_rng(7)
    pages = np.arange(300, 300 + 96, dtype=np.int32)
    if order == "descending":
        row = pages[::-1]
    elif order == "shuffled":
        row = rng.permutation(pages)
    else:
        row = np.concatenate([pages[i:i + 8] for i in range(88, -1, -8)])
    table = np.stack([row, np.arange(1000, 1096, dtype=np.int32)[::-1]])
    lens = [96 * 64, 90 * 64]
    plan = plan_staging(table, lens, 64, 32)
    for p, piece in enumerate(plan.pieces):
        want = 0
        for r in range(2):
            got = np.sort(table[r, p * 32:min((p + 1) * 32, -(-lens[r] // 64))])
            want += 1 + int((np.diff(got) != 1).sum())
        assert len(piece) == want and all(not r.hbm for r in piece)
    assert plan.copy_calls[0] == sum(len(piece) for piece in plan.pieces) <= 2 * 3 * (1 if order != "shuffled" else 32)
    assert _staged_sources(plan, table, lens, 64) == {(b, j): (False, int(table[b, j]))
                                                      for b in range(2) for j in range(-(-lens[b] // 64))}


def test_hbm_pages_read_in_place_through_a_one_layer_view_of_the_pool():
    """``hbm_in_place(pool, layer)``: its page ``page * L`` is ``pool[page, layer]`` (the entries
    ``plan_staging(..., hbm_layers=L)`` writes), and it ends where the pool does; a pool whose
    ``page * L`` overflows int32 is copied instead (``CallShape.in_place_layers``)."""
    import torch

    from directkv_cute.planner import CallShape
    from directkv_cute.staging import hbm_in_place

    def in_place_layers(pool):
        shape = CallShape.example([128], num_layers=pool.shape[1])
        return shape.replace(hbm_pages=pool.shape[0]).in_place_layers

    pool = torch.randn(5, 3, 2, 2, 4, 8)  # (pages, L, Hkv, 2, P, d)
    for layer in range(3):
        view = hbm_in_place(pool, layer)
        assert view.shape == (5 * 3 - layer, 1, 2, 2, 4, 8) and view.data_ptr() >= pool.data_ptr()
        for page in range(5):
            assert torch.equal(view[page * 3, 0], pool[page, layer])
    assert in_place_layers(pool) == 3
    with pytest.raises(ValueError, match="layer 3 of an HBM pool"):
        hbm_in_place(pool, 3)
    with pytest.raises(ValueError, match="0 pages"):  # a cache without HBM pages has none to read
        hbm_in_place(pool[:0], 0)
    # a call over host pages only keeps its source: nothing is read in place
    assert not plan_staging(np.array([[4, 5]], dtype=np.int32), [128], 64, 1, hbm_layers=3).reads_in_place
    big = torch.empty(2**27, 32, 1, device="meta")
    assert in_place_layers(big) == 0
    with pytest.raises(ValueError, match="overflows int32"):
        plan_staging(np.array([[0, -(2**27)]], dtype=np.int32), [128], 64, 1, hbm_layers=32)


def test_plan_rejects_bad_input():
    table = np.zeros((2, 4), dtype=np.int32)
    with pytest.raises(ValueError, match="does not match"):
        plan_staging(table, [64], 64, 2)
    with pytest.raises(ValueError, match="do not fit"):
        plan_staging(table, [64, 5 * 64], 64, 2)
    with pytest.raises(ValueError, match="piece_pages"):
        plan_staging(table, [64, 64], 64, 0)


@pytest.mark.parametrize("max_pages,page,tile,want", [(512, 64, 128, 0), (3, 64, 128, 0), (10000, 16, 128, 0),
                                                      (512, 128, 64, 0), (512, 64, 128, 5)])
def test_piece_pages_cover_whole_tiles_and_bound_the_flags(max_pages, page, tile, want):
    pp = piece_pages_for(max_pages, page, tile, want)
    assert (pp * page) % tile == 0
    assert math.ceil(max_pages / pp) <= MAX_PIECES
    if want:
        assert pp >= want


def test_causal_flops_match_a_direct_count():
    lens, q_lens, hq, d = [100, 37], [10, 37], 4, 8
    pairs = sum(n - q + j + 1 for n, q in zip(lens, q_lens) for j in range(q))
    assert causal_flops(lens, q_lens, hq, d) == 4 * hq * d * pairs


def test_cost_model_stages_compute_bound_chunks_and_long_link_bound_reads():
    kv = 2 * 32768 * 8 * 128 * 2  # 32k tokens, one layer
    decode = choose_staged(H200, kv, 0, causal_flops([32768], [1], 32, 128), partial_bytes(1, 32, 128))
    # Decode over 32k: the copy engine's edge over SM reads of host memory (measured 3-7%).
    assert decode.staged and decode.staged_ms < LINK_STAGE_MARGIN * decode.in_place_ms
    assert may_stage(H200, kv, causal_flops([32768], [1], 32, 128))
    # With a quarter of its pages in HBM the same read stays in place (the streaming kernel
    # overlaps the HBM pages; staging would copy them first).
    assert not may_stage(H200, kv, causal_flops([32768], [1], 32, 128), kv // 3)
    assert may_stage(H200, kv, causal_flops([32768], [1], 32, 128), kv // 256, 2)  # a window page or two
    # A chunk's own pages mirrored in HBM (one run per sequence): left to choose_staged, which
    # models their one device-to-device copy per sequence.
    chunk, token = causal_flops([8192], [512], 32, 128), 2 * 8 * 128 * 2
    assert not may_stage(H200, 7680 * token, chunk, 512 * token, 2, chunk_q=512)
    assert may_stage(H200, 7680 * token, chunk, 512 * token, 2, chunk_q=512, window=True)
    # Many short sequences: one copy call per sequence and piece eats the edge (measured: batch
    # 64 over 1k staged 22% slower, batch 16 over 16k 3% faster).
    many_short = 64 * 2 * 1024 * 8 * 128 * 2
    assert not may_stage(H200, many_short, causal_flops([1024] * 64, [1] * 64, 32, 128), 0, 64 * 8)
    long16 = 16 * 2 * 16384 * 8 * 128 * 2
    assert may_stage(H200, long16, causal_flops([16384] * 16, [1] * 16, 32, 128), 0, 16 * 16)
    assert not choose_staged(H200, many_short, 0, causal_flops([1024] * 64, [1] * 64, 32, 128),
                             partial_bytes(64, 32, 128), host_calls=64 * 8).staged
    # Over 4k the staged call's overhead eats the edge: read in place, decided before planning.
    short = 2 * 4096 * 8 * 128 * 2
    assert not may_stage(H200, short, causal_flops([4096], [1], 32, 128))
    assert not choose_staged(H200, short, 0, causal_flops([4096], [1], 32, 128), partial_bytes(1, 32, 128)).staged
    link_bound = choose_staged(H200, kv, 0, causal_flops([32768], [512], 32, 128), partial_bytes(512, 32, 128))
    assert link_bound.staged  # q 512 over 32k: the compute hides under the copy
    kv8 = kv // 4
    short_chunk = choose_staged(H200, kv8, 0, causal_flops([8192], [512], 32, 128), partial_bytes(512, 32, 128))
    assert not short_chunk.staged  # over 8k the first split's copy and the overhead eat the edge
    long_prefill = choose_staged(H200, kv, 0, causal_flops([32768], [8192], 32, 128), partial_bytes(8192, 32, 128))
    assert long_prefill.staged and long_prefill.staged_ms < long_prefill.in_place_ms
    # Never below the copy it needs, nor below its compute.
    assert long_prefill.staged_ms >= kv / 54.8e6
    assert long_prefill.splits > 1  # the copy is long enough to be worth splitting
    # A chunk whose splits have more CTAs than SMs (8k q2048: 512 per split over 132): the CTAs
    # that find no SM run their share of the last split after the copy, so more splits shorten
    # that tail; the splits fold in the kernel, so only the last one's fold follows the copy
    # (link-bound: the others' run under it) and 8 splits beat 4 and 2. Without that wait, splits
    # add nothing past the first one's exposed copy.
    def q2048(splits, **kw):
        return choose_staged(H200, kv8, 0, causal_flops([8192], [2048], 32, 128), partial_bytes(2048, 32, 128),
                             splits=splits, host_calls=8, pieces=8, **kw).staged_ms

    est = [q2048(s, split_ctas=512, sms=132) for s in (2, 4, 8)]
    assert est[0] > est[1] > est[2]
    assert q2048(8) == pytest.approx(q2048(4), abs=0.01)
    fixed = choose_staged(H200, kv, 0, causal_flops([32768], [8192], 32, 128), partial_bytes(8192, 32, 128), splits=8)
    assert fixed.splits == 8


def test_folded_splits_cost_one_fold_after_the_copy():
    """``staged_ms``: the first split's copy is exposed, then max(the rest of the copy, the
    compute), the other splits' folds counted in the compute and only the last one's after."""
    from directkv_cute.plan import staged_ms

    fold_bytes = 0.01 * H200.partial_gbps * 1e6  # 0.01 ms a fold
    oh = H200.stage_overhead_ms
    assert staged_ms(H200, 1.0, 0.4, fold_bytes, 1) == pytest.approx(1.4 + oh)  # one split: no fold, no overlap
    assert staged_ms(H200, 1.0, 0.4, fold_bytes, 4) == pytest.approx(1.0 + 0.01 + oh)  # link-bound: folds under the copy
    assert staged_ms(H200, 0.2, 1.0, fold_bytes, 4) == pytest.approx(0.05 + 1.03 + 0.01 + oh)  # compute-bound: they add
    # CTAs beyond the SMs (half of each split's) run the last split's share after the copy
    assert staged_ms(H200, 1.0, 0.4, fold_bytes, 4, waiting=0.5) == pytest.approx(1.0 + 0.5 * 0.43 / 4 + 0.01 + oh)


def test_q_tiled_config_legality():
    assert QTiledConfig().is_legal(128, 64)
    assert QTiledConfig(tile_n=64, stages=4).is_legal(64, 16)
    with pytest.raises(ConfigError, match="tile_n"):
        QTiledConfig(tile_n=32).check(128, 64)
    with pytest.raises(ConfigError, match="SMEM"):
        QTiledConfig(tile_n=128, stages=4).check(128, 64)
    assert QTiledConfig.from_dict({"tile_n": 64}).tile_n == 64
    with pytest.raises(ConfigError, match="unknown"):
        QTiledConfig.from_dict({"chunk_tiles": 2})


def test_q_tiled_config_dicts_drop_the_staging_keys_left_to_the_planner():
    """Dicts of configs that held staging fields (tuned profiles: all 0, the planner's choice)
    still load; a staging value that asks for something is refused, naming the StagingRequest."""
    import dataclasses

    from directkv_cute.config import STAGING_KEYS
    from directkv_cute.planner import StagingRequest

    assert STAGING_KEYS == tuple(f.name for f in dataclasses.fields(StagingRequest))
    old = {"tile_n": 64, "stages": 4, "carveout": 100, "piece_pages": 0, "splits": 0, "order": 0, "pingpong": 1,
           "cluster": 2, "copy_order": 0}
    assert QTiledConfig.from_dict(old) == QTiledConfig(tile_n=64, stages=4)
    assert QTiledConfig.from_dict(old).to_dict() == {"tile_n": 64, "stages": 4, "carveout": 100, "pingpong": 1,
                                                     "cluster": 2}
    for key, value in (("piece_pages", 4), ("splits", 2), ("order", 2), ("copy_order", 1), ("splits", False)):
        with pytest.raises(ConfigError, match=f"no staging fields.*{key}.*StagingRequest"):
            QTiledConfig.from_dict({**old, key: value})
    assert q_tiles(8192, 4) == 256 and q_tiles(33, 4) == 2 and q_tiles(1, 128) == 1


def test_q_tiled_compile_key_changes_with_every_code_input():
    import torch

    from directkv_cute.kernels.jit import q_tiled_key

    base = q_tiled_key(QTiledConfig(), torch.bfloat16, 128, 64, 4, True)
    for other in (q_tiled_key(QTiledConfig(stages=3, tile_n=64), torch.bfloat16, 128, 64, 4, True),
                  q_tiled_key(QTiledConfig(), torch.bfloat16, 128, 64, 4, False),
                  q_tiled_key(QTiledConfig(), torch.float16, 128, 64, 4, True),
                  q_tiled_key(QTiledConfig(), torch.bfloat16, 128, 64, 8, True)):
        assert other != base


@pytest.mark.parametrize("max_tiles,piece_tiles,want", [(256, 16, 0), (256, 16, 3), (5, 16, 0), (1000, 7, 4),
                                                        (64, 1, 1)])
def test_q_tiled_splits_are_whole_pieces_covering_every_tile(max_tiles, piece_tiles, want):
    from directkv_cute.stage_plan import STAGED_SPLITS, q_tiled_splits

    splits, per = q_tiled_splits(max_tiles, piece_tiles, want)
    assert per % piece_tiles == 0
    assert (splits - 1) * per < max_tiles <= splits * per
    assert 1 <= splits <= (want or STAGED_SPLITS)


@pytest.mark.parametrize("cfg,dtype,d,page,group,wait_ready,split_out", [
    (QTiledConfig(), "bfloat16", 128, 64, 4, True, True),
    pytest.param(QTiledConfig(), "bfloat16", 128, 64, 4, False, False, marks=pytest.mark.full),
    (QTiledConfig(tile_n=64, stages=4, pingpong=0), "float16", 64, 16, 16, True, False),
])
def test_q_tiled_kernel_compiles_for_hopper(monkeypatch, cfg, dtype, d, page, group, wait_ready, split_out):
    """The Q-tiled kernel compiles for sm_90a without a GPU (CI compiles every kernel)."""
    import torch

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setenv("DIRECTKV_DISK_CACHE", "0")
    from directkv_cute.kernels import jit

    fn = jit.compile_q_tiled(cfg, getattr(torch, dtype), d, page, group, wait_ready, split_out)
    assert fn is not None
    assert jit.compile_q_tiled(cfg, getattr(torch, dtype), d, page, group, wait_ready, split_out) is fn


def test_order_legality():
    from directkv_cute.planner import StagingRequest

    assert StagingRequest(order=2, splits=1).one_split
    with pytest.raises(ConfigError, match="one split"):
        StagingRequest(order=2, splits=4)
    with pytest.raises(ConfigError, match="order 3"):
        StagingRequest(order=3)


def test_release_staging_counts_and_frees_the_buffers(monkeypatch):
    """With a stand-in stager holding CPU buffers in both slots: the bytes are counted, freed
    once, then 0."""
    import threading

    import torch

    from directkv_cute import staging

    class Fake:
        device = torch.device("cpu")
        lock = threading.Lock()
        buffer = torch.empty(10, 4, dtype=torch.bfloat16)
        buffer1 = torch.empty(3, 4, dtype=torch.bfloat16)  # the second slot
        scale_buffer = None  # a Stager's FP8 scales, none here

    monkeypatch.setattr(staging, "_STAGERS", {("cpu", 0): Fake()})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    assert staging.staging_bytes() == 104
    assert staging.release_staging() == 104
    assert staging.staging_bytes() == 0 and staging.release_staging() == 0


def test_staging_buffer_grows_by_a_quarter_only_for_its_own_kind(monkeypatch):
    """The staging buffer grows by a quarter when a call needs more pages of the same kind, and is
    made anew at the pages asked for on a dtype or page-shape change: calls over a bf16 and an FP8
    cache that alternate keep it at their own sizes (it once grew 1.25x per switch, to an OOM)."""
    import torch

    from directkv_cute import staging

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    st = object.__new__(staging.Stager)
    st.device = torch.device("cpu")
    st.buffer = None
    monkeypatch.setattr(torch, "empty", lambda shape, dtype, device: torch.zeros(shape, dtype=dtype))
    shape = (2, 2, 4, 8)
    for _ in range(20):
        assert st._buffer("buffer", 10, shape, torch.bfloat16).shape[0] == 10
        assert st.buffer.shape[0] == 10
        assert st._buffer("buffer", 7, shape, torch.float8_e4m3fn).shape[0] == 7
        assert st.buffer.shape[0] == 7 and st.buffer.dtype == torch.float8_e4m3fn
    assert st._buffer("buffer", 7, (2, 2, 4, 16), torch.float8_e4m3fn).shape[0] == 7
    assert st.buffer.shape[0] == 7 and st.buffer.shape[2:] == (2, 2, 4, 16)
    st._buffer("buffer", 8, (2, 2, 4, 16), torch.float8_e4m3fn)
    assert st.buffer.shape[0] == 8  # max(8, 1.25 x 7 = 8)
    st._buffer("buffer", 9, (2, 2, 4, 16), torch.float8_e4m3fn)
    assert st.buffer.shape[0] == 10  # a quarter more than 8
    held = st.buffer
    assert st._buffer("buffer", 3, (2, 2, 4, 16), torch.float8_e4m3fn).shape[0] == 3 and st.buffer is held


def test_a_batch_sharing_a_prompt_stages_once_or_runs_the_cascade_as_measured():
    """``python -m bench prefix`` rows (one layer, 32k shared prompt, 32/8 heads, page 64): one
    staged call (each distinct page copied once) against the cascade, the faster one chosen."""
    from directkv_cute.plan import cascade_ms, stage_instead_of_cascade

    page = 2 * 8 * 64 * 128 * 2

    def row(batch, own, calls):
        prefix_pages, own_pages = 512, own // 64 + (1 if own else 1)
        unique = (prefix_pages + batch * own_pages) * page
        naive = batch * (prefix_pages + own_pages) * page
        ctx = [32768 + own + 1] * batch
        staged = choose_staged(H200, unique, 0, causal_flops(ctx, [1] * batch, 32, 128), partial_bytes(batch, 32, 128),
                               host_calls=calls, in_place_bytes=naive, kv_read_bytes=naive)
        return stage_instead_of_cascade(H200, unique, 2, staged), staged.staged_ms, cascade_ms(H200, unique, 2)

    # batch 16, 8k own: staged 12.63 ms measured vs the cascade's 13.30
    assert row(16, 8192, 16 * 4 + 13)[0]
    # batch 64, nothing own: the staged kernel's reads of every sequence's pages bind (3.79 vs 2.97)
    assert not row(64, 0, 16)[0]
    # batch 64, 1k own: staged 9.04 vs the cascade's 8.21
    assert not row(64, 1024, 64 * 2 + 16)[0]
    assert stage_instead_of_cascade(H200, 1, 1, None) is False


def test_head_major_model_is_a_two_stage_pipeline_of_heads():
    from directkv_cute.plan import head_major_ms

    STAGE_OVERHEAD_MS = H200.stage_overhead_ms

    # compute-bound: the first head's copy, then every head's compute
    assert head_major_ms(H200, 8.0, 16.0, 8) == pytest.approx(1.0 + 16.0 + STAGE_OVERHEAD_MS)
    # link-bound: the whole copy, then the last head's compute
    assert head_major_ms(H200, 16.0, 8.0, 8) == pytest.approx(16.0 + 1.0 + STAGE_OVERHEAD_MS)
    assert head_major_ms(H200, 8.0, 16.0, 1) == pytest.approx(24.0 + STAGE_OVERHEAD_MS)  # one head: serial


def test_cost_model_copies_compute_bound_chunks_head_by_head():
    kv = 2 * 32768 * 8 * 128 * 2
    flops = causal_flops([32768], [8192], 32, 128)
    parts = partial_bytes(8192, 32, 128)
    split = choose_staged(H200, kv, 0, flops, parts, host_calls=16)
    heads = choose_staged(H200, kv, 0, flops, parts, host_calls=16, heads=8, head_calls=8 * 4)
    assert not split.by_head and heads.by_head and heads.splits == 1
    assert heads.staged_ms < split.staged_ms  # no partials, 1/8 of the copy exposed
    # a link-bound decode read gains nothing from it: the whole copy is exposed either way
    dec = choose_staged(H200, kv, 0, causal_flops([32768], [1], 32, 128), partial_bytes(1, 32, 128), host_calls=16,
                        heads=8, head_calls=8 * 4)
    assert not dec.by_head
    # a fixed split count leaves the order alone
    assert not choose_staged(H200, kv, 0, flops, parts, splits=4, heads=8, head_calls=32).by_head


def test_copy_order_legality():
    from directkv_cute.planner import StagingRequest

    assert StagingRequest(copy_order=2, splits=1).one_split and StagingRequest(copy_order=2, order=2).one_split
    assert not StagingRequest(copy_order=1, splits=4).one_split
    with pytest.raises(ConfigError, match="one split"):
        StagingRequest(copy_order=2, splits=4)
    with pytest.raises(ConfigError, match="copy_order 3"):
        StagingRequest(copy_order=3)
    with pytest.raises(ConfigError, match="splits must be >= 0"):
        StagingRequest(splits=-1)


def _fake_stager(monkeypatch, plan_pages: int, buf_shape, events: list):
    """A Stager whose CUDA calls are host memmoves (recorded in ``events``) over CPU tensors."""
    import ctypes
    from types import SimpleNamespace

    import cuda.bindings.driver as drv
    import cuda.bindings.runtime as rt
    import torch

    from directkv_cute import staging

    def memcpy2d(dst, dpitch, src, spitch, width, height, kind, stream):
        assert width <= dpitch and width <= spitch
        for i in range(height):
            ctypes.memmove(dst + i * dpitch, src + i * spitch, width)
        events.append(("copy", stream, dst, width, height))
        return (0,)

    def write_value(stream, ptr, value, flags):
        slot, flag = divmod((int(ptr) - st.flag_sets.data_ptr()) // 4, staging.MAX_FLAGS)
        events.append(("flag", flag, value, slot, stream))
        return (0,)

    st = object.__new__(staging.Stager)
    st.device = torch.device("cpu")
    st.stream = SimpleNamespace(cuda_stream=1, wait_stream=lambda other: events.append(("wait", "current")),
                                wait_event=lambda ev: events.append(("wait", ev)))
    st.flag_sets = torch.zeros(staging.SLOTS, staging.MAX_FLAGS, dtype=torch.int32)
    st.flag_stream = SimpleNamespace(cuda_stream=2, wait_event=lambda ev: events.append(("flag wait", ev)))
    st.landed = SimpleNamespace(record=lambda stream: events.append(("landed", stream.cuda_stream)))
    st.ready = SimpleNamespace(record=lambda stream: events.append(("ready", stream.cuda_stream)))
    st.total_memory = 2**40
    st.buffer = torch.full((plan_pages, 1, *buf_shape), float("nan"), dtype=torch.bfloat16)
    st.buffer1 = torch.full((plan_pages, 1, *buf_shape), float("nan"), dtype=torch.bfloat16)
    st.scale_buffer = None
    st.epoch = 0
    st.slot = 0
    st.freed = [None] * staging.SLOTS
    st.fresh = False
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(rt, "cudaMemcpy2DAsync", memcpy2d)
    monkeypatch.setattr(drv, "cuStreamWriteValue32", write_value)
    monkeypatch.setattr(drv, "CUstream", lambda s: s)
    monkeypatch.setattr(drv, "CUdeviceptr", lambda p: p)
    return st


def _two_sequences(P: int, pages: int):
    rng = np.random.default_rng(7)
    lens = [P * 9 + 3, P * 5]
    table = np.full((2, 10), 0, dtype=np.int32)
    ids = rng.permutation(pages)
    table[0, :10] = ids[:10]
    table[0, 4] = -3  # an HBM page: copied on the current stream
    table[1, :5] = ids[10:15]
    table[1, 5:] = table[1, 4]
    return lens, table


@pytest.mark.parametrize("by_head,per_copy", [(False, 1), (True, 1), (True, 3)])
def test_stager_copies_every_page_and_marks_each_flag_after_its_copies(monkeypatch, by_head, per_copy):
    """Stager.stage with the CUDA calls stood in by host memmoves: the buffer holds exactly the
    layer's K/V of every staged page, and every flag is written after all copies of its piece
    (of its head, staged head by head), heads in order."""
    from types import SimpleNamespace

    import torch

    pages, layers, hkv, P, d, layer = 40, 3, 4, 16, 8, 1
    host = torch.randn(pages, layers, hkv, 2, P, d).to(torch.bfloat16)
    hbm = torch.randn(6, layers, hkv, 2, P, d).to(torch.bfloat16)
    lens, table = _two_sequences(P, pages)
    plan = plan_staging(table, lens, P, 2)
    cache = SimpleNamespace(host_pool_cuda=None, host_pool=host, hbm_pool=hbm)
    page_w = hkv * 2 * P * d * 2
    head_w = page_w // hkv
    events = []
    st = _fake_stager(monkeypatch, plan.pages, (hkv, 2, P, d), events)
    from directkv_cute import staging

    monkeypatch.setattr(staging, "HEADS_PER_COPY", per_copy)
    buf, flags, epoch = st.stage(cache, layer, plan, by_head=by_head)
    assert epoch == 1
    for b, n in enumerate(lens):
        for j in range(math.ceil(n / P)):
            e, s = int(table[b, j]), int(plan.table[b, j])
            want = hbm[-e - 1, layer] if e < 0 else host[e, layer]
            assert torch.equal(buf[-s - 1, 0], want), (b, j)
    n_p = len(plan.pieces)
    flag_events = [ev for ev in events if ev[0] == "flag"]
    order = [ev[1] for ev in flag_events]
    assert sorted(order) == list(range(n_p * (hkv if by_head else 1)))
    if by_head:  # the groups of heads land in order
        groups = [f // n_p // per_copy for f in order]
        assert groups == sorted(groups)
    else:
        assert order == sorted(order)
    assert all(ev[2] == epoch for ev in flag_events)
    # every host copy of (head, piece) precedes its flag; host copies move one head's block
    # when staged head by head, HBM pages (current stream) whole pages
    for pos, ev in enumerate(events):
        if ev[0] != "copy":
            continue
        off = ev[2] - buf.data_ptr()
        page, head = off // page_w, off % page_w // head_w
        if not by_head or ev[1] != 1:
            assert ev[3] == page_w
        else:  # a group of per_copy heads (the last one may be smaller)
            assert head % per_copy == 0 and ev[3] == min(per_copy, hkv - head) * head_w
        if ev[1] != 1:
            continue
        piece = next(p for p, runs in enumerate(plan.pieces) for r in runs if not r.hbm and r.dst == page)
        for h in range(head, head + ev[3] // head_w) if by_head else (None,):
            flag = h * n_p + piece if by_head else piece
            later = [i for i, f in enumerate(events) if f[0] == "flag" and f[1] == flag]
            assert later and later[0] > pos


def test_hbm_runs_per_sequence_tells_a_window_from_spread_pages():
    from directkv_cute.stage_plan import hbm_runs_per_sequence

    table = np.array([[3, 4, 5, -1, -2, -7],   # a window at the end of its 5 pages (-7 is past them)
                      [-3, 8, -4, 9, -5, -6],  # spread: three runs
                      [1, 2, 6, 7, 10, 11]])   # all on the host
    assert hbm_runs_per_sequence(table, [5, 6, 6]) == 3
    assert hbm_runs_per_sequence(table[[0, 2]], [5, 6]) == 1
    assert hbm_runs_per_sequence(table[[2]], [6]) == 0
    assert hbm_runs_per_sequence(table[[0]], [3]) == 0  # the window lies past the pages read


def _fp8_pools(pages, layers, hkv, P, d):
    """Host and HBM FP8 pools with their scales, and the cache attributes stage_fp8 reads."""
    from types import SimpleNamespace

    import torch

    host = torch.randn(pages, layers, hkv, 2, P, d).to(torch.float8_e4m3fn)
    hbm = torch.randn(6, layers, hkv, 2, P, d).to(torch.float8_e4m3fn)
    host_s = torch.rand(pages, layers, hkv, 2, P)
    hbm_s = torch.rand(6, layers, hkv, 2, P)
    return SimpleNamespace(host_pool_cuda=None, host_pool=host, hbm_pool=hbm, host_scales_cuda=None,
                           host_scales=host_s, hbm_scales=hbm_s)


def _record_events(monkeypatch, events: list):
    """torch.cuda.Event stood in: each record appends ("event", its stream) to ``events``."""
    import torch

    class Event:
        def record(self, stream):
            events.append(("event", stream.cuda_stream))

    monkeypatch.setattr(torch.cuda, "Event", Event)


def _assert_fp8_staged(raw, sc, cache, table, plan, lens, P, layer):
    """Every page of the call, FP8 block and scale rows, landed at its staging slot."""
    import torch

    for b, n in enumerate(lens):
        for j in range(math.ceil(n / P)):
            e, s = int(table[b, j]), int(plan.table[b, j])
            if e < 0:
                src, src_s = cache.hbm_pool[-e - 1], cache.hbm_scales[-e - 1]
            else:
                src, src_s = cache.host_pool[e], cache.host_scales[e]
            assert torch.equal(raw[-s - 1, 0].view(torch.uint8), src[layer].view(torch.uint8)), (b, j)
            assert torch.equal(sc[-s - 1, 0], src_s[layer]), (b, j)


def test_stager_copies_fp8_pages_and_scales_piece_by_piece(monkeypatch):
    """stage_fp8: every staged page's FP8 block and its scale rows (host and HBM tiers) land at the
    page's staging slot; HBM pages on the current stream first; on the side stream each piece's
    page copies, then its scale copies, then its event, piece after piece."""
    import torch

    pages, layers, hkv, P, d, layer = 40, 3, 4, 16, 8, 2
    cache = _fp8_pools(pages, layers, hkv, P, d)
    lens, table = _two_sequences(P, pages)
    plan = plan_staging(table, lens, P, 3)
    events = []
    st = _fake_stager(monkeypatch, plan.pages, (hkv, 2, P, d), events)
    st.buffer = None
    _record_events(monkeypatch, events)
    raw, sc, landed = st.stage_fp8(cache, layer, plan)
    assert raw.shape == (plan.pages, 1, hkv, 2, P, d) and raw.dtype == torch.float8_e4m3fn
    assert sc.shape == (plan.pages, 1, hkv, 2, P) and sc.dtype == torch.float32
    assert len(landed) == len(plan.pieces)
    _assert_fp8_staged(raw, sc, cache, table, plan, lens, P, layer)
    # HBM pages (and their scales) first, on the current stream (0); then the side stream (1)
    assert events[0] == ("wait", "current")  # FP8 copies follow the current stream's work
    events = [ev for ev in events if ev[0] != "wait"]
    streams = [ev[1] for ev in events]
    first_side = streams.index(1)
    assert set(streams[:first_side]) == {0} and set(streams[first_side:]) == {1}
    side = events[first_side:]
    page_base, scale_base = raw.data_ptr(), sc.data_ptr()
    for runs in plan.pieces:
        host_runs = [r for r in runs if not r.hbm]
        n = 2 * len(host_runs)
        piece, side = side[:n + 1], side[n + 1:]
        assert piece[-1][0] == "event"
        kinds = ["page" if page_base <= ev[2] < page_base + raw.nbytes else "scale" for ev in piece[:-1]]
        assert kinds == ["page"] * len(host_runs) + ["scale"] * len(host_runs)
    assert side == []


def test_head_groups_span_a_full_rate_copy_row():
    from directkv_cute.stage_plan import MIN_COPY_ROW, head_groups

    assert head_groups(8, 16384) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]  # FP8, page 64, d 128
    assert head_groups(8, 32768) == [range(h, h + 1) for h in range(8)]  # bf16, page 64, d 128
    assert head_groups(8, 4096) == [range(0, 8)]  # FP8, page 16: one group, the whole page
    assert head_groups(5, 16384) == [range(0, 2), range(2, 4), range(4, 5)]
    for heads in (1, 3, 8, 64):
        for hb in (512, 4096, 16384, 65536):
            groups = head_groups(heads, hb)
            assert [h for g in groups for h in g] == list(range(heads))
            assert all(len(g) * hb >= MIN_COPY_ROW for g in groups[:-1])
            assert all(len(g) == 1 or (len(g) - 1) * hb < MIN_COPY_ROW for g in groups)


def test_stager_copies_fp8_pages_by_head_group_after_every_scale(monkeypatch):
    """stage_fp8 by head groups (a one-piece plan): every staged page's FP8 block and scale rows land at
    the page's slot; on the side stream all scale copies first, then per head group one strided
    copy per host run of exactly that group's bytes, then that group's event; a plan of several
    pieces is refused before anything is queued."""
    from directkv_cute import stage_plan

    pages, layers, hkv, P, d, layer = 40, 3, 5, 16, 8, 1
    head_bytes = 2 * P * d
    monkeypatch.setattr(stage_plan, "MIN_COPY_ROW", 2 * head_bytes)  # groups of two heads: [0, 2), [2, 4), [4, 5)
    cache = _fp8_pools(pages, layers, hkv, P, d)
    lens, table = _two_sequences(P, pages)
    events = []
    st = _fake_stager(monkeypatch, 1, (hkv, 2, P, d), events)
    st.buffer = None
    _record_events(monkeypatch, events)
    with pytest.raises(ValueError, match="one-piece plan"):
        st.stage_fp8(cache, layer, plan_staging(table, lens, P, 3), stage_plan.head_groups(hkv, head_bytes))
    assert events == []
    plan = plan_staging(table, lens, P, 10)
    assert len(plan.pieces) == 1
    groups = stage_plan.head_groups(hkv, head_bytes)
    raw, sc, landed = st.stage_fp8(cache, layer, plan, groups)
    assert [len(g) for g in groups] == [2, 2, 1] and len(landed) == len(groups)
    _assert_fp8_staged(raw, sc, cache, table, plan, lens, P, layer)
    side = [ev for ev in events if ev[1] == 1]
    host_runs = [r for r in plan.pieces[0] if not r.hbm]
    scale_copies, side = side[:len(host_runs)], side[len(host_runs):]
    assert all(sc.data_ptr() <= ev[2] < sc.data_ptr() + sc.nbytes for ev in scale_copies)
    for g in groups:
        copies, side = side[:len(host_runs) + 1], side[len(host_runs) + 1:]
        assert copies[-1][0] == "event"
        for ev, r in zip(copies[:-1], host_runs):
            assert ev[0] == "copy" and ev[3] == len(g) * head_bytes and ev[4] == r.count
            assert ev[2] == raw.data_ptr() + r.dst * hkv * head_bytes + g.start * head_bytes
    assert side == []


def test_one_wave_and_chunk_tail_models():
    from directkv_cute.plan import chunk_tail_ms, one_wave_ms

    STAGE_OVERHEAD_MS = H200.stage_overhead_ms

    # link-bound: the copy, then the last piece's compute; compute-bound: the first piece, then it all
    assert one_wave_ms(H200, 10.0, 2.0, 2) == pytest.approx(11.0 + STAGE_OVERHEAD_MS)
    assert one_wave_ms(H200, 2.0, 10.0, 2) == pytest.approx(11.0 + STAGE_OVERHEAD_MS)
    assert chunk_tail_ms(H200, 0) == 0.0 and chunk_tail_ms(H200, 64) < chunk_tail_ms(H200, 512)
    assert chunk_tail_ms(H200, 64) == pytest.approx(0.033, abs=0.005)  # measured 0.026-0.028 at 8k/16k q64
    assert chunk_tail_ms(H200, 512) == pytest.approx(0.09, abs=0.005)  # measured 0.09-0.10 at 8k/16k q512
    assert H200.chunk_tail_ms > 0
    kv8 = 2 * 8192 * 8 * 128 * 2
    flops = causal_flops([8192], [512], 32, 128)
    # in place at the link plus the chunk tail, 8k q512 may stage; the streaming kernel's may not
    assert may_stage(H200, kv8, flops, 0, 2, chunk_q=512) and not may_stage(H200, kv8, flops, 0, 2)
    parts = partial_bytes(512, 32, 128)
    wave = choose_staged(H200, kv8, 0, flops, parts, host_calls=16, pieces=16, chunk_q=512, wave_calls=2)
    assert wave.staged and wave.coarse and wave.splits == 1
    # without the one-wave option (more CTAs than SMs) the same call keeps the splits' estimate
    split = choose_staged(H200, kv8, 0, flops, parts, host_calls=16, pieces=16, chunk_q=512)
    assert not split.coarse and split.staged_ms > wave.staged_ms
    # every ready flag costs the copy something
    assert choose_staged(H200, kv8, 0, flops, parts, host_calls=16, pieces=64, chunk_q=512).staged_ms > split.staged_ms


def test_copy_rates_bench_refuses_without_cuda(monkeypatch):
    import torch

    from bench import copy_rates

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs CUDA"):
        copy_rates.main([])


@pytest.mark.parametrize("max_tiles,piece_tiles,want,ready,expect", [
    (64, 8, 8, 48, (8, 8, 6)),  # 8k q2048 at page 64: 6 history splits, the window's 2 first
    (256, 30, 8, 240, (9, 30, 8)),  # 32k q2048 over pieces of 60 pages: the window one split
    (256, 14, 2, 252, (3, 126, 2)),  # 32k q512: two history splits and the window's four tiles
    (64, 8, 1, 48, (1, 64, 0)),  # one split (head by head, lightest first): kept
    (64, 8, 8, 64, (8, 8, 0)),  # nothing ready before the kernel: as without
    (64, 8, 8, 0, (8, 8, 0)),
])
def test_q_tiled_splits_give_the_ready_tiles_splits_that_launch_first(max_tiles, piece_tiles, want, ready, expect):
    from directkv_cute.stage_plan import q_tiled_splits, ready_split

    splits, per = q_tiled_splits(max_tiles, piece_tiles, want, ready)
    first = ready_split(ready // piece_tiles, piece_tiles, per, splits) if ready else 0
    assert (splits, per, first) == expect
    assert per % piece_tiles == 0 and (splits - 1) * per < max_tiles <= splits * per
    if first:  # the splits from `first` on read only ready tiles; the one before it does not
        assert first * per >= ready > (first - 1) * per


def test_window_piece_pages_give_the_window_pieces_of_its_own():
    from directkv_cute.stage_plan import window_piece_pages

    assert window_piece_pages(64, 480, 512, 2) == 60  # 32k q2048 at page 64
    assert window_piece_pages(16, 96, 128, 2) == 16  # 8k q2048: already whole pieces
    assert window_piece_pages(64, 1016, 1024, 2) == 64  # no even divisor within [32, 128]: kept
    assert window_piece_pages(64, 0, 512, 2) == 64 and window_piece_pages(64, 512, 512, 2) == 64
    assert window_piece_pages(8, 90, 128, 1) == 9
    assert window_piece_pages(8, 90, 128, 1, min_pages=10) == 10  # at least min_pages (the flag limit)
    assert window_piece_pages(8, 90, 128, 2) == 6  # whole tiles only (6 and 10 tie: the smaller)


def test_plan_knows_the_pieces_that_read_only_pages_already_in_hbm():
    """``StagePlan.ready_from``: the first piece from which every piece reads only HBM entries,
    counting every sequence's reads (a page shared with a piece copied earlier is still a host
    page of the later piece)."""
    t = np.array([[0, 1, 2, 3, 4, 5, -1, -2],
                  [0, 1, 2, 2, 2, 2, 2, 2]], dtype=np.int32)  # the second shares the first three
    plan = plan_staging(t, [8 * 16, 3 * 16], 16, 2)
    assert (len(plan.pieces), plan.ready_from) == (4, 3)
    assert plan_staging(t, [8 * 16, 3 * 16], 16, 3).ready_from == 2  # pieces [0,3) [3,6) [6,8)
    t2 = t.copy()
    t2[1] = [6, 7, 8, 9, 10, 11, 12, 0]  # the second reads host page 0 in the last piece
    assert plan_staging(t2, [128, 128], 16, 2).ready_from == 4
    assert plan_staging(np.where(t >= 0, -t - 1, t), [128, 48], 16, 2).ready_from == 0  # every page in HBM
    assert plan_staging(t[:1].clip(0), [128], 16, 2).ready_from == 4  # none


def test_stager_flags_the_ready_pieces_before_any_host_copy(monkeypatch):
    """A window (a step's pages mirrored in HBM) staged: the flags of the pieces that read only
    HBM pages are written before the first host copy, every other flag after its piece's copies;
    none on the current stream."""
    from types import SimpleNamespace

    import torch

    pages, layers, hkv, P, d, layer = 20, 2, 2, 16, 8, 0
    host = torch.randn(pages, layers, hkv, 2, P, d).to(torch.bfloat16)
    hbm = torch.randn(6, layers, hkv, 2, P, d).to(torch.bfloat16)
    table = np.array([[3, 4, 5, 6, 7, 8, -1, -2, -3, -4]], dtype=np.int32)
    plan = plan_staging(table, [10 * P], P, 2)
    assert (len(plan.pieces), plan.ready_from) == (5, 3)
    cache = SimpleNamespace(host_pool_cuda=None, host_pool=host, hbm_pool=hbm)
    events = []
    st = _fake_stager(monkeypatch, plan.pages, (hkv, 2, P, d), events)
    buf, _, epoch = st.stage(cache, layer, plan)
    host_copies = [i for i, ev in enumerate(events) if ev[0] == "copy" and ev[1] == 1]
    flags = {ev[1]: i for i, ev in enumerate(events) if ev[0] == "flag"}
    assert sorted(flags) == list(range(5))
    assert flags[3] < host_copies[0] and flags[4] < host_copies[0]
    assert flags[0] > host_copies[0] and flags[2] > host_copies[-1]
    # Every flag on the flag stream (2): the ready pieces' after it waited for an event the current
    # stream (0) recorded, each copied piece's after it waited for an event the side stream (1)
    # recorded behind the piece's copies.
    assert [events[flags[p]][4] for p in range(5)] == [2, 2, 2, 2, 2]
    assert events[flags[3] - 2:flags[3]] == [("ready", 0), ("flag wait", st.ready)] and flags[4] == flags[3] + 1
    for p in range(3):
        at = flags[p]
        assert events[at - 2:at] == [("landed", 1), ("flag wait", st.landed)]
        assert max(i for i in host_copies if i < at) < at - 2
    for j in range(10):
        e, s = int(table[0, j]), int(plan.table[0, j])
        assert torch.equal(buf[-s - 1, 0], hbm[-e - 1, layer] if e < 0 else host[e, layer]), j


def test_head_groups_may_start_with_a_smaller_group():
    from directkv_cute.stage_plan import MIN_COPY_ROW, head_groups

    hb = MIN_COPY_ROW // 2  # two heads per group
    assert head_groups(8, hb) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert head_groups(8, hb, first=1) == [range(0, 1), range(1, 3), range(3, 5), range(5, 7), range(7, 8)]
    assert head_groups(1, hb, first=1) == [range(0, 1)] and head_groups(3, hb, first=5) == [range(0, 3)]


def test_fp8_chunks_copy_a_single_head_first_only_where_compute_outlasts_the_copy():
    """q8192 (compute longer than the 16-bit copy): one head, then pairs; q2048 and q512: pairs."""
    from directkv_cute.stage_plan import fp8_head_groups

    for n, q, first in ((8192, 8192, 1), (32768, 8192, 1), (131072, 8192, 1), (32768, 2048, 2), (8192, 512, 2)):
        groups = fp8_head_groups(H200, 8, 64, 128, 1, [n], [q], 32)
        assert len(groups[0]) == first and sorted(h for g in groups for h in g) == list(range(8)), (n, q)
        assert all(len(g) == 2 for g in groups[1:-1])



def test_ready_page_is_one_past_every_sequences_last_host_page():
    from directkv_cute.stage_plan import ready_page

    t = np.array([[0, 1, 2, -1, -2], [5, 6, -3, -3, -3]], dtype=np.int32)
    assert ready_page(t, [5, 2]) == 3  # the second sequence's pages past its length do not count
    assert ready_page(t, [2, 2]) == 2
    assert ready_page(np.array([[-1, -2]], dtype=np.int32), [2]) == 0  # every page in HBM
    assert ready_page(np.array([[0, 1]], dtype=np.int32), [2]) == 2  # none


@settings(max_examples=60, deadline=None)
@given(batches(), st.lists(st.one_of(st.none(), st.lists(st.integers(0, 1100), max_size=6)), max_size=5))
def test_piece_waits_name_each_write_at_the_first_piece_copying_its_pages(case, writes):
    """Against a direct scan: a recorded write is waited for before the first piece whose host
    copies read one of its pages (any host copy for a write of unknown pages), once, never for
    pages the call does not copy from the host."""
    from directkv_cute.staging import piece_waits

    table, lens, page, pp = case
    plan = plan_staging(table, lens, page, pp)
    writes = [None if w is None else np.asarray(w, dtype=np.int64) for w in writes]
    got = piece_waits(plan, writes)
    assert len(got) == len(plan.pieces)
    want = [[] for _ in plan.pieces]
    for i, pages in enumerate(writes):
        for p, runs in enumerate(plan.pieces):
            copied = {r.src + j for r in runs if not r.hbm for j in range(r.count)}
            if copied and (pages is None or copied & set(pages.tolist())):
                want[p].append(i)
                break
    assert got == want


def test_token_slots_name_the_host_pages_they_write(randn):
    """``TokenSlots.host_pages``: the distinct host pages of a batch write, mirrored pages' host
    pages included, HBM pages not."""
    from directkv_cute.cache import PagedKVCache

    cache = PagedKVCache(2, 2, 64, 16, num_host_pages=20, num_hbm_pages=6, num_window_pages=4, device="cpu")
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.append(a, randn(40, 2, 2, 64), randn(40, 2, 2, 64))  # host pages 0-2
    cache.extend(b, 20, "hbm")
    start = cache.extend(a, 30)  # tokens 40-69: pages 2-4, page 2 shared with the history
    cache.mirror(a, start, 30)
    slots = cache.token_slots([a, b], [start, 0], [30, 20])
    host = [e for e in cache.page_table(a)[2:5]]
    assert slots.host_pages.tolist() == sorted(host)
    with pytest.raises(IndexError, match="outside"):
        cache.note_host_write([20])
    cache.note_host_write(slots)  # a CPU cache records nothing (no staged calls there)
    assert cache.host_writes() == []


def test_host_writes_get_an_event_at_the_next_staged_call_and_drop_when_done(monkeypatch):
    """The record of host writes on a CUDA cache (its events faked): writes enqueued on the
    current stream get one event at the next ``host_writes``; finished ones are dropped; past
    ``MAX_HOST_WRITES`` they merge into one whose stream waits for the others' events."""
    import torch

    from directkv_cute import cache as C

    class Event:
        made = []

        def __init__(self):
            self.done = False
            Event.made.append(self)

        def record(self, stream=None):
            self.stream = stream

        def query(self):
            return self.done

    class Stream:
        waited = []

        def wait_event(self, ev):
            Stream.waited.append(ev)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    cache = C.PagedKVCache(1, 1, 64, 16, num_host_pages=8, device="cpu")
    monkeypatch.setattr(cache, "device", torch.device("cuda", 0))
    cache.note_host_write([3, 1, 3])
    cache.note_host_write(None)
    own = Event()
    cache._wrote_host(np.array([5]), own)  # a write on another stream, with its own event
    got = cache.host_writes()
    assert [p if p is None else p.tolist() for _, p in got] == [[1, 3], None, [5]]
    assert got[0][0] is got[1][0] and got[2][0] is own
    got[0][0].done = True
    assert [p.tolist() for _, p in cache.host_writes()] == [[5]]
    own.done = True
    assert cache.host_writes() == []
    pending = Event()
    cache._wrote_host(np.array([7]), pending)
    for i in range(C.MAX_HOST_WRITES):
        cache.note_host_write([i % 8])
    (ev, pages), = [(e, p) for e, p in cache._host_writes]
    assert ev is None and pages.tolist() == list(range(8)) and Stream.waited[-1] is pending


def test_stager_copies_ahead_into_the_other_slot_after_the_writes_to_its_pages(monkeypatch):
    """Over a cache that records its host writes, a staged call takes the other buffer and flag
    set, waits for the last kernel over that slot instead of the current stream, and waits for
    each recorded write right before the first copy of a page it wrote (a write to pages it does
    not copy is not waited for); a call not planned to copy ahead waits for the current stream."""
    from types import SimpleNamespace

    import torch

    from directkv_cute import staging

    pages, layers, hkv, P, d, layer = 40, 3, 4, 16, 8, 1
    host = torch.randn(pages, layers, hkv, 2, P, d).to(torch.bfloat16)
    hbm = torch.randn(6, layers, hkv, 2, P, d).to(torch.bfloat16)
    lens, table = _two_sequences(P, pages)
    plan = plan_staging(table, lens, P, 2)
    host_pieces = [p for p, runs in enumerate(plan.pieces) if any(not r.hbm for r in runs)]
    late = next(r for r in plan.pieces[host_pieces[-1]] if not r.hbm).src  # a page of the last host piece
    writes = [("w-late", np.array([late])), ("w-other", np.array([pages + 5]))]
    cache = SimpleNamespace(host_pool_cuda=None, host_pool=host, hbm_pool=hbm, host_writes=lambda: writes)
    events = []
    st = _fake_stager(monkeypatch, plan.pages, (hkv, 2, P, d), events)
    st.freed = ["k0", "k1"]
    buf, flags, epoch = st.stage(cache, layer, plan, ahead=True)
    assert st.slot == 1 and buf.data_ptr() == st.buffer1.data_ptr() and flags.data_ptr() == st.flag_sets[1].data_ptr()
    for b, n in enumerate(lens):
        for j in range(math.ceil(n / P)):
            e, s = int(table[b, j]), int(plan.table[b, j])
            assert torch.equal(buf[-s - 1, 0], hbm[-e - 1, layer] if e < 0 else host[e, layer]), (b, j)
    waits = [ev[1] for ev in events if ev[0] == "wait"]
    assert waits == ["k1", "w-late"]  # the slot's last kernel, then the one write to a copied page
    at = events.index(("wait", "w-late"))
    copies = [i for i, ev in enumerate(events) if ev[0] == "copy" and ev[1] == 1]
    first_late = min(i for i in copies if (events[i][2] - buf.data_ptr()) // (hkv * 2 * P * d * 2)
                     in {r.dst + j for r in plan.pieces[host_pieces[-1]] if not r.hbm for j in range(r.count)})
    assert max(i for i in copies if i < first_late) < at < first_late
    assert all(ev[3] == 1 for ev in events if ev[0] == "flag")
    events.clear()
    plain = SimpleNamespace(host_pool_cuda=None, host_pool=host, hbm_pool=hbm)
    st.stage(plain, layer, plan)
    assert st.slot == 1 and [ev[1] for ev in events if ev[0] == "wait"] == ["current"]
    events.clear()
    st.fresh = True  # memory new to the side stream (a buffer just allocated): the current stream first
    st.stage(cache, layer, plan, ahead=True)
    assert st.slot == 0 and [ev[1] for ev in events if ev[0] == "wait"] == ["current", "w-late"] and not st.fresh


def test_copy_calls_count_the_runs_of_each_tier_and_copies_ahead_needs_a_record_the_overlap_and_two_buffers(
        monkeypatch):
    from types import SimpleNamespace

    import torch

    from directkv_cute.planner import CallShape, DefaultConfigs, plan_attention

    # host pages 0-2, then 7, then two HBM pages, in two pieces of 3 pages
    table = np.array([[0, 1, 2, 7, -1, -2]], dtype=np.int32)
    plan = plan_staging(table, [6 * 16], 16, 3)
    assert plan.copy_calls == (2, 1) and plan.host_pages == 4
    assert sum(len(p) for p in plan.pieces) == 3
    # Whether a step's staged copies may run ahead: the cache records its host writes and the
    # overlap is on (DeviceInfo.current); a plan copies ahead where two buffers fit the cap too.
    monkeypatch.delenv("DIRECTKV_STAGE_OVERLAP", raising=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    from directkv_cute import machine

    monkeypatch.setattr(machine, "_properties", lambda index: ("G", 132, 8 * 2**30))
    recording, bare = SimpleNamespace(host_writes=lambda: []), SimpleNamespace()
    assert DeviceInfo.current("cuda:0", recording).copies_ahead
    assert not DeviceInfo.current("cuda:0", bare).copies_ahead
    monkeypatch.setenv("DIRECTKV_STAGE_OVERLAP", "0")
    assert not DeviceInfo.current("cuda:0", recording).copies_ahead
    shape = CallShape.example([32768], [1])  # 512 pages of 256 KiB: 128 MiB a buffer
    buffer = 512 * shape.layer_page_bytes()
    for cap, ahead in ((2 * buffer, True), (2 * buffer - 1, False)):
        facts = DeviceInfo("G", 132, 8 * 2**30, copies_ahead=True, staging_cap=cap)
        got = plan_attention(shape, facts, H200, DefaultConfigs())
        assert got.route == "q_tiled_staged" and got.detail.copy_ahead == ahead


def test_a_pool_view_with_a_write_log_copies_ahead_after_the_writes_it_records(monkeypatch):
    """An engine's per-layer pools (``runner.PoolView``) with a ``HostWriteLog``: the GPU's facts
    over it allow copies ahead (without a log they do not); a layer's recorded store gets an event
    at the next staged call; ``restart`` (once per step) leaves one write of any page behind the
    step's event, which drops once done. A CPU log records nothing."""
    import torch

    from directkv_cute import machine
    from directkv_cute.cache import HostWriteLog
    from directkv_cute.runner import PoolView

    class Event:
        def __init__(self):
            self.done = False

        def record(self, stream=None):
            pass

        def query(self):
            return self.done

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(machine, "_properties", lambda index: ("G", 132, 8 * 2**30))
    monkeypatch.delenv("DIRECTKV_STAGE_OVERLAP", raising=False)
    host = torch.zeros(16, 1, 2, 2, 16, 64)
    log = HostWriteLog(torch.device("cuda", 0))
    view, bare = PoolView(host, host[:0], write_log=log), PoolView(host, host[:0])
    assert DeviceInfo.current("cuda:0", view).copies_ahead and not DeviceInfo.current("cuda:0", bare).copies_ahead
    assert bare.host_writes is None and view.host_writes() == []
    log.record(np.array([9, 4]))  # a layer's store of the step's pages
    (ev, pages), = view.host_writes()
    assert isinstance(ev, Event) and pages.tolist() == [9, 4]
    step = Event()
    log.restart(step)
    assert view.host_writes() == [(step, None)]
    step.done = True
    assert view.host_writes() == []
    cpu = HostWriteLog(torch.device("cpu"))
    cpu.record(np.array([1]))
    cpu.restart(step)
    assert cpu.entries == []
