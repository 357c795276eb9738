"""CPU tests of the op's routing of multi-token calls to the Q-tiled kernel (directly over HBM
pages, or over host pages staged into HBM), with the GPU's properties stood in, and of its
config: an explicit QTiledConfig, else the tuned profile's q_tiled entry, else QTiledConfig()."""

from __future__ import annotations

import dataclasses
import math
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from directkv_cute import ops
from directkv_cute.cache import KernelTables
from directkv_cute.config import QTiledConfig
from directkv_cute.plan import LINK_PIECES
from directkv_cute.staging import HEAD_PIECES, MAX_FLAGS
from directkv_cute.tuning import lookup as L
from directkv_cute.tuning import profiles as P

GPU = "Test GPU without a profile"  # the routing tests see the default config, whatever is shipped


@pytest.fixture(autouse=True)
def h200(monkeypatch, tmp_path):
    monkeypatch.setattr(ops, "_num_sms", lambda index: 132)
    monkeypatch.setattr(ops, "_total_memory", lambda index: 140 * 2**30)
    monkeypatch.setattr(ops, "_gpu_name", lambda index: GPU)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setenv(P.PROFILE_DIR_ENV, str(tmp_path / "profiles"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv(L.REQUIRE_ENV, raising=False)
    L.clear_cache()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="directkv-cute: no tuned q_tiled config", category=P.ProfileWarning)
        yield
    L.clear_cache()


def _call(lens, q_lens, hbm=False, hq=32, hkv=8, d=128, page=64, host_table=True, window=False, marked=False):
    n_pages = [math.ceil(n / page) for n in lens]
    width = max(n_pages)
    table = np.zeros((len(lens), width), dtype=np.int32)
    k = 0
    for b, n in enumerate(n_pages):
        ids = np.arange(k, k + n)
        table[b, :n] = -ids - 1 if hbm else ids
        if window:  # the step's own pages mirrored in HBM
            own = (lens[b] - q_lens[b]) // page
            table[b, own:n] = -np.arange(k, k + n - own) - 1
        table[b, n:] = table[b, n - 1]
        k += n
    tables = KernelTables(torch.from_numpy(table), torch.tensor(lens, dtype=torch.int32), 0, -1, tuple(lens),
                          table if host_table else None, marked)
    cache = SimpleNamespace(page_size=page, num_kv_heads=hkv, head_dim=d, dtype=torch.bfloat16,
                            host_writes=lambda: [],
                            hbm_pool=torch.empty(max(k, 1), 32, hkv, 2, page, d, dtype=torch.bfloat16, device="meta"))
    q = torch.empty(sum(q_lens), hq, d, dtype=torch.bfloat16, device="meta")
    return q, cache, tables, tuple(q_lens), hq // hkv


def test_short_link_bound_reads_stay_in_place_without_a_plan(monkeypatch):
    monkeypatch.setattr(ops, "plan_staging", lambda *a, **k: pytest.fail("planned a short link-bound call"))
    for lens, q_lens in (([4096], [1]), ([8192], [64]), ([2000] * 4, [1] * 4), ([8192], [16])):
        assert ops._q_tiled_route(*_call(lens, q_lens), None) is None


def test_a_link_bound_chunk_in_one_wave_is_staged_in_one_split_of_two_pieces():
    """8k q512 over host pages: its 128 CTAs fit one wave; in place the chunk kernel runs 0.09 ms
    past the link (measured 0.745 ms), staged in one split of two pieces 0.676 ms."""
    cfg, plan = ops._q_tiled_route(*_call([8192], [512]), None)
    assert (cfg.splits, cfg.copy_order, len(plan.pieces)) == (1, 1, LINK_PIECES)
    # more CTAs than SMs (q 512 over 16 sequences): not one wave, so the model's splits
    cfg, plan = ops._q_tiled_route(*_call([32768] * 16, [64] * 16), None)
    assert cfg.splits > 1 and len(plan.pieces) > LINK_PIECES
    # an explicit piece size is kept
    cfg, plan = ops._q_tiled_route(*_call([8192], [512]), QTiledConfig(piece_pages=4))
    assert plan.piece_pages == 4


def test_long_link_bound_reads_are_staged_decode_included():
    """Decode and short chunks over 32k of host KV: the copy engine outruns the SMs' reads of host
    memory (measured 3-7% on decode at 32k/128k), so they are staged too."""
    for lens, q_lens in (([32768], [1]), ([32768] * 16, [1] * 16), ([32768], [64])):
        cfg, plan = ops._q_tiled_route(*_call(lens, q_lens), None)
        assert plan is not None and plan.host_pages == sum(lens) // 64 and cfg.order == 1
        # one query tile per sequence and KV head (32 tokens of a GQA group of 4): no cluster,
        # whose other CTA would hold no rows
        assert cfg.cluster == (1 if max(q_lens) <= 32 else 2)


def test_clusters_run_from_two_query_tiles_on():
    assert QTiledConfig().cluster == 2
    for q, want in ((32, 1), (33, 2), (2048, 2)):
        cfg, _ = ops._q_tiled_route(*_call([32768], [q]), None)
        assert cfg.cluster == want, q
    cfg, _ = ops._q_tiled_route(*_call([32768], [1]), QTiledConfig())
    assert cfg.cluster == 2  # an explicit config is run as given


def test_decode_over_hbm_pages_keeps_the_streaming_kernel():
    assert ops._q_tiled_route(*_call([32768] * 32, [1] * 32, hbm=True), None) is None
    cfg, plan = ops._q_tiled_route(*_call([32768], [1], hbm=True), QTiledConfig())
    assert plan is None  # an explicit config still runs it


def test_compute_bound_chunks_are_staged_head_by_head():
    """A compute-bound chunk over 32k of host KV: copied head by head, one split (only the first
    head's copy exposed, no partials), in a few pieces per head."""
    cfg, plan = ops._q_tiled_route(*_call([32768], [8192]), None)
    assert plan is not None and plan.host_pages == 512 and cfg.order == 1
    assert cfg.copy_order == 2 and cfg.splits == 1
    assert len(plan.pieces) == HEAD_PIECES and len(plan.pieces) * 8 <= MAX_FLAGS
    assert (plan.table < 0).all(), "the kernel reads the staging buffer as HBM pages"


def test_copy_order_one_keeps_the_models_splits():
    cfg, plan = ops._q_tiled_route(*_call([32768], [8192]), QTiledConfig(copy_order=1))
    assert cfg.copy_order == 1 and cfg.splits > 1 and len(plan.pieces) == 16


def test_copy_order_two_runs_one_split_even_where_the_model_would_not():
    # q 64 over 32k is link-bound: the model keeps the pieces of all heads together.
    cfg, _ = ops._q_tiled_route(*_call([32768], [64]), None)
    assert cfg.copy_order == 1
    cfg, plan = ops._q_tiled_route(*_call([32768, 5000], [64, 7]), QTiledConfig(copy_order=2))
    assert cfg.copy_order == 2 and cfg.splits == 1 and plan.host_pages == 512 + 79
    cfg, _ = ops._q_tiled_route(*_call([8192], [8192]), QTiledConfig(copy_order=2, order=2))
    assert (cfg.copy_order, cfg.order, cfg.splits) == (2, 2, 1)


def test_all_hbm_takes_the_q_tiled_kernel_only_with_a_wave_of_tiles():
    assert ops._q_tiled_route(*_call([32768], [64], hbm=True), None) is None  # 2 x 8 CTAs
    cfg, plan = ops._q_tiled_route(*_call([32768], [2048], hbm=True), None)  # 64 x 8 CTAs
    assert plan is None and cfg == QTiledConfig()
    cfg, plan = ops._q_tiled_route(*_call([32768], [64], hbm=True), QTiledConfig(tile_n=64, stages=4))
    assert plan is None and cfg.tile_n == 64  # an explicit config always runs it


def test_explicit_config_refusals_name_the_reason(monkeypatch):
    with pytest.raises(ValueError, match="kernel_tables"):
        ops._q_tiled_route(*_call([4096], [4096], host_table=False), QTiledConfig())
    monkeypatch.setenv("DIRECTKV_MAX_STAGING_GB", "0.01")
    with pytest.raises(ValueError, match="DIRECTKV_MAX_STAGING_GB"):
        ops._q_tiled_route(*_call([32768], [8192]), QTiledConfig())
    # Without a config the same call reads in place instead.
    assert ops._q_tiled_route(*_call([32768], [8192]), None) is None
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(ValueError, match="CUDA graph"):
        ops._q_tiled_route(*_call([32768], [8192]), QTiledConfig())
    assert ops._q_tiled_route(*_call([32768], [8192]), None) is None


def test_explicit_order_and_splits_are_kept():
    cfg, plan = ops._q_tiled_route(*_call([8192], [8192]), QTiledConfig(order=2))
    assert cfg.order == 2 and cfg.splits == 1
    cfg, plan = ops._q_tiled_route(*_call([8192, 3000], [8192, 100]), QTiledConfig(splits=3, piece_pages=4))
    assert cfg.splits == 3 and plan.piece_pages == 4 and plan.pages == 128 + 47


# ---- the config of an automatic call: the tuned profile's q_tiled entry ----------------------------

MODEL_GPU = "Modelled H200 PCIe5"  # the CPU model objective's GPU name
Q_CLASS = ("q_tiled", "bf16", 128, 4, 64)


def _tune_on_the_model(out_dir, shapes, **opts):
    """Tune the q_tiled kernel on the CPU cost model with a slow pingpong handshake (0.5 us per
    tile: issuing without turns wins), writing the profile into ``out_dir``."""
    from directkv_cute.tuning.objectives import ModelledObjective, QTiledModel
    from directkv_cute.tuning.tuner import TuneOptions, Tuner

    measure = ModelledObjective(seed=0, kernel="q_tiled", q_tiled=QTiledModel(pingpong_sync_us=0.5))
    options = TuneOptions(**{"n_trials": 8, "seed": 0, "progress": False, **opts})
    return Tuner("q_tiled", measure, output_dir=out_dir, options=options).tune(shapes)


def test_a_model_tuned_profile_is_what_the_op_runs(tmp_path, monkeypatch):
    """End to end on the CPU: the tuner writes q_tiled entries, and the op's automatic calls run
    them (exact and nearest bucket, all-HBM and staged); an explicit config still wins."""
    from directkv_cute.tuning.space import TuneShape

    monkeypatch.setattr(ops, "_gpu_name", lambda index: MODEL_GPU)
    shapes = [TuneShape(32, 8, 128, 1, 32768, q) for q in (2048, 8192)]
    results = _tune_on_the_model(tmp_path / "profiles", shapes)
    assert [r.status for r in results] == ["tuned", "tuned"]
    prof = P.load_profile(tmp_path / "profiles" / "Modelled_H200_PCIe5.yaml")
    entries = {bk: QTiledConfig.from_dict(rec["config"]) for ck, bk, rec in prof.records() if ck == Q_CLASS}
    assert set(entries) == {(1, 32768, 2048), (1, 32768, 8192)} and not prof.stale()
    tuned = entries[1, 32768, 2048]
    assert tuned != QTiledConfig() and (tuned.piece_pages, tuned.splits, tuned.order) == (0, 0, 0)
    assert tuned.pingpong == 0  # the model's slow handshake favours issuing without turns

    L.clear_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an exact, current entry: no warning
        cfg, plan = ops._q_tiled_route(*_call([32768], [2048], hbm=True), None)
    assert plan is None and cfg == tuned
    # over host pages, staged: the entry's kernel, the launch fields from the op's cost model
    cfg, plan = ops._q_tiled_route(*_call([32768], [8192]), None)
    assert plan is not None and cfg.splits >= 1 and cfg.order == 1
    assert dataclasses.replace(cfg, splits=0, order=0, copy_order=0) == entries[1, 32768, 8192]
    # the nearest bucket: q_len 3000 is nearer 2048 than 8192 in log2, context 20000 has one bucket
    cfg, plan = ops._q_tiled_route(*_call([20000], [3000], hbm=True), None)
    assert plan is None and cfg == tuned
    # another class (page 16, GQA 8) is not borrowed: the default
    cfg, _ = ops._q_tiled_route(*_call([32768], [2048], hbm=True, page=16), None)
    assert cfg == QTiledConfig()
    cfg, _ = ops._q_tiled_route(*_call([32768], [2048], hbm=True, hq=64), None)
    assert cfg == QTiledConfig()
    # an explicit config wins over the profile, launch fields included
    mine = QTiledConfig(tile_n=64, stages=4)
    assert ops._q_tiled_route(*_call([32768], [2048], hbm=True), mine) == (mine, None)
    cfg, plan = ops._q_tiled_route(*_call([32768], [8192]), QTiledConfig(order=2))
    assert cfg == QTiledConfig(order=2, splits=1, copy_order=2) and plan is not None


def test_a_missing_entry_warns_only_for_calls_the_kernel_may_run_as_a_chunk(tmp_path):
    """Without a q_tiled entry the default runs, and the miss is said once, for a multi-token call;
    decode-sized calls (staged long reads) and calls the kernel does not take say nothing."""
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        cfg, plan = ops._q_tiled_route(*_call([32768], [1]), None)  # staged decode: quiet
        assert plan is not None and dataclasses.replace(cfg, order=0, splits=0, copy_order=0) == QTiledConfig(cluster=1)
        assert ops._q_tiled_route(*_call([32768], [64], hbm=True), None) is None  # 16 CTAs: not looked up
        assert ops._q_tiled_route(*_call([4096], [1]), None) is None  # short decode in place
        for _ in range(2):
            cfg, plan = ops._q_tiled_route(*_call([32768], [2048], hbm=True), None)
            assert (cfg, plan) == (QTiledConfig(), None)
    msgs = [str(x.message) for x in w if issubclass(x.category, P.ProfileWarning)]
    assert len(msgs) == 1, msgs
    assert "no tuned q_tiled config" in msgs[0] and "--kernel q_tiled" in msgs[0] and "q_len=2048" in msgs[0]


def test_a_foreign_q_tiled_entry_is_refused_and_the_default_runs(tmp_path, monkeypatch):
    """A q_tiled entry with another kernel's config (decode fields) makes the file invalid: the
    lookup says why (the unknown fields) and the op runs the default."""
    from directkv_cute.config import DecodeConfig

    d = tmp_path / "profiles"
    prof = P.Profile(metadata=P.make_metadata({"gpu_name": GPU, "sm_count": 132, "smem_optin_bytes": 232448},
                                              objective="gpu"))
    prof.set(Q_CLASS, (1, 32768, 2048), {"config": DecodeConfig().to_dict(), "p50_us": 1.0, "trials": 1,
                                          "kernel_hash": P.current_kernel_hash("q_tiled")})
    d.mkdir()
    (d / P.profile_filename(GPU)).write_text(prof.to_yaml())
    with pytest.warns(P.ProfileWarning, match=r"unknown QTiledConfig fields: \[.*'consumer_wgs'"):
        cfg, plan = ops._q_tiled_route(*_call([32768], [2048], hbm=True), None)
    assert (cfg, plan) == (QTiledConfig(), None)


# ---- decode over FP8 pages: staged when the copy engine beats reading in place ---------------------


def _fp8_call(lens, q_lens, hbm=False):
    q, cache, tables, q_lens, group = _call(lens, q_lens, hbm=hbm)
    cache.host_pool = torch.empty(1, dtype=torch.float8_e4m3fn)
    return q, cache, tables, q_lens


def test_long_fp8_decode_is_staged_short_and_hybrid_reads_are_not(monkeypatch):
    plan = ops._fp8_stage_plan(*_fp8_call([32768], [1]))
    # one query token: two pieces, the last FP8_TAIL_SHARE of the pages apart (the first launch
    # reads the first while the copy engine moves the second)
    assert plan is not None and plan.host_pages == 512 and (plan.table < 0).all()
    assert len(plan.pieces) == 2 and plan.piece_pages == 512 - 512 // 16
    plan = ops._fp8_stage_plan(*_fp8_call([32768] * 4, [1] * 4))
    assert plan is not None and plan.host_pages == 4 * 512 and len(plan.pieces) == 2
    # several query tokens (a causal window inside the last piece): one piece, one launch
    plan = ops._fp8_stage_plan(*_fp8_call([32768], [4]))
    assert plan is not None and len(plan.pieces) == 1
    # 4k: the staged call's overhead eats the copy engine's edge
    assert ops._fp8_stage_plan(*_fp8_call([4096], [1])) is None
    # every page in HBM: nothing to copy
    assert ops._fp8_stage_plan(*_fp8_call([32768], [1], hbm=True)) is None
    # without the host table (the dispatcher's bare tables), or inside a capture: in place
    q, cache, tables, q_lens = _fp8_call([32768], [1])
    assert ops._fp8_stage_plan(q, cache, SimpleNamespace(), q_lens) is None
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert ops._fp8_stage_plan(q, cache, tables, q_lens) is None


def test_two_piece_fp8_decode_splits_every_sequence_at_the_same_page():
    """split_staged_table: the two launches' tables and lengths put every page of every sequence
    in exactly one part, in order; a sequence shorter than the first part has an empty second."""
    rng = np.random.default_rng(3)
    P, width, pages_a = 16, 12, 9
    lens = [P * 12, P * 9, 5, P * 10 + 3]
    table = rng.integers(-100, -1, size=(len(lens), width)).astype(np.int32)
    (ta, la), (tb, lb) = ops.split_staged_table(table, lens, pages_a, P)
    assert ta.shape == (4, pages_a) and tb.shape == (4, width - pages_a)
    assert ta.flags.c_contiguous and tb.flags.c_contiguous and la.dtype == lb.dtype == np.int32
    assert la.tolist() == [P * 9, P * 9, 5, P * 9] and lb.tolist() == [P * 3, 0, 0, P + 3]
    assert (np.concatenate([ta, tb], axis=1) == table).all()


def test_fp8_decode_plans_once_per_tables(monkeypatch):
    calls = []
    real = ops._plan_fp8_staging
    monkeypatch.setattr(ops, "_plan_fp8_staging", lambda *a: calls.append(1) or real(*a))
    args = _fp8_call([32768], [1])
    first = ops._fp8_stage_plan(*args)
    assert first is not None and all(ops._fp8_stage_plan(*args) is first for _ in range(7)) and len(calls) == 1
    assert ops._fp8_stage_plan(*_fp8_call([32768], [1])) is not first and len(calls) == 2  # new tables


def test_fp8_staging_over_the_cap_reads_in_place(monkeypatch):
    monkeypatch.setenv("DIRECTKV_MAX_STAGING_GB", "0.01")
    assert ops._fp8_stage_plan(*_fp8_call([32768], [1])) is None


def test_the_layers_of_a_step_plan_their_route_once(monkeypatch):
    """_q_tiled_route memoizes per KernelTables object: the same tables (a step's layers) reuse the
    plan; new tables, another staging cap, a cleared profile lookup or a capture plan again."""
    calls = []
    real = ops._plan_route
    monkeypatch.setattr(ops, "_plan_route", lambda *a: calls.append(1) or real(*a))
    q, cache, tables, q_lens, group = _call([32768], [2048])
    first = ops._q_tiled_route(q, cache, tables, q_lens, group, None)
    assert first is not None and first[1] is not None  # staged
    for _ in range(31):
        assert ops._q_tiled_route(q, cache, tables, q_lens, group, None) is first
    assert len(calls) == 1
    def same(route):
        return route[0] == first[0] and route[1].pieces == first[1].pieces and (route[1].table == first[1].table).all()

    again = _call([32768], [2048])  # equal contents, a new step's tables
    assert same(ops._q_tiled_route(*again, None)) and len(calls) == 2
    assert ops._q_tiled_route(q, cache, tables, q_lens, group, QTiledConfig(splits=2))[0].splits == 2
    assert len(calls) == 3  # another config, another route
    monkeypatch.setenv("DIRECTKV_MAX_STAGING_GB", "0.01")
    assert ops._q_tiled_route(q, cache, tables, q_lens, group, None) is None and len(calls) == 4
    monkeypatch.delenv("DIRECTKV_MAX_STAGING_GB")
    L.clear_cache()
    assert same(ops._q_tiled_route(q, cache, tables, q_lens, group, None)) and len(calls) == 5
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert ops._q_tiled_route(q, cache, tables, q_lens, group, None) is None and len(calls) == 6
    assert ops._q_tiled_route(q, cache, tables, q_lens, group, None) is None and len(calls) == 7


def test_two_piece_fp8_decode_launches_each_part_after_its_copy_into_one_combine(monkeypatch):
    """_run_fp8_parts over stand-ins of the launches: the kernel runs once per piece, after that
    piece's event, over that piece's pages and lengths, into its own slice of the partials; one
    combine merges every split of both."""
    from directkv_cute.config import DecodeConfig
    from directkv_cute.kernels import launch
    from directkv_cute.staging import plan_staging

    log = []

    class Stream:
        def wait_event(self, event):
            log.append(("wait", event))

    def decode(fn, q, o, lse, cache, layer, page_table, seq_lens, cu_q, splits, scale, counters):
        assert o.shape[0] == lse.shape[0] == splits
        log.append(("decode", o.data_ptr(), splits, page_table.clone(), seq_lens.clone()))

    def combine(fn, o_part, lse_part, out, lse, splits):
        log.append(("combine", o_part.data_ptr(), o_part.shape[0], splits))

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(launch, "launch_decode", decode)
    monkeypatch.setattr(launch, "launch_combine", combine)
    monkeypatch.setattr(ops, "_compiled_combine", lambda d, dtype: None)
    P, lens = 16, (16 * 40, 16 * 3 + 5)
    host_table = np.arange(2 * 40, dtype=np.int32).reshape(2, 40)
    plan = plan_staging(host_table, lens, P, 36)
    q = torch.zeros(2, 8, 32)
    view = SimpleNamespace(page_size=P, num_kv_heads=2)
    out, lse = ops._run_fp8_parts(None, DecodeConfig(), q, view, plan, lens, None, ["first", "second"], None, None,
                                  None, True)
    assert out.shape == q.shape and lse.shape == (2, 8)
    kinds = [e[0] for e in log]
    assert kinds == ["wait", "decode", "wait", "decode", "combine"]
    assert log[0][1] == "first" and log[2][1] == "second"
    (_, ptr_a, s_a, table_a, lens_a), (_, ptr_b, s_b, table_b, lens_b) = log[1], log[3]
    assert lens_a.tolist() == [16 * 36, 16 * 3 + 5] and lens_b.tolist() == [16 * 4, 0]
    assert (torch.cat([table_a, table_b], 1).numpy() == plan.table).all()
    _, ptr_all, n_all, splits_all = log[4]
    assert ptr_a == ptr_all and ptr_b == ptr_all + s_a * 2 * 8 * 32 * 4 and n_all == splits_all == s_a + s_b


def test_fp8_chunks_run_head_by_head_where_16_bit_pages_in_hbm_would_run_the_q_tiled_kernel():
    """Over FP8 pages a multi-token call runs head by head (``_fp8_by_head``) exactly where the
    same call over 16-bit pages all in HBM runs the Q-tiled kernel: an explicit QTiledConfig, or
    query tiles filling a wave; not with an explicit DecodeConfig, short windows or decode."""
    from directkv_cute.config import DecodeConfig

    for lens, q_lens in (([8192], [2048]), ([32768], [512]), ([4000, 3000], [300, 300]), ([8192], [64]),
                         ([8192], [1]), ([9000] * 3, [100, 90, 80]), ([5000], [263]), ([5000], [264])):
        q, cache, tables, ql, group = _call(lens, q_lens, hbm=True)
        fp8_cache = SimpleNamespace(page_size=64, num_kv_heads=8, head_dim=128, dtype=torch.float8_e4m3fn,
                                    compute_dtype=torch.bfloat16)
        over_hbm = ops._plan_route(q, cache, tables, ql, group, None)
        got = ops._fp8_head_config(q, fp8_cache, tuple(lens), ql, None)
        assert (got is not None) == (over_hbm is not None), (lens, q_lens)
        if got is not None:
            assert got == over_hbm[0]
    q, cache, tables, ql, group = _call([8192], [16], hbm=True)
    explicit = QTiledConfig(tile_n=64, stages=3)
    assert ops._fp8_head_config(q, fp8_cache, (8192,), ql, explicit) is explicit
    assert ops._fp8_head_config(q, fp8_cache, (8192,), (2048,), DecodeConfig()) is None


def test_fp8_chunk_over_the_staging_cap_is_refused_before_anything_is_staged(monkeypatch):
    """A multi-token call over FP8 pages has no in-place path: one whose staged FP8 pages, scales
    and dequantized copy exceed the staging cap raises a clear error before any copy is queued."""
    monkeypatch.setenv("DIRECTKV_MAX_STAGING_GB", "0.2")
    monkeypatch.setattr(ops, "stager", lambda *a: pytest.fail("staged before the cap check"))
    q, _, tables, ql, _ = _call([40000, 3000], [512, 16])
    cache = SimpleNamespace(page_size=64, num_kv_heads=8, head_dim=128, dtype=torch.float8_e4m3fn,
                            compute_dtype=torch.bfloat16, host_pool=torch.empty(0, dtype=torch.float8_e4m3fn))
    # 625 + 47 pages x (8 heads x 2 x 64 rows x (128 x (1 + 2) bytes + 4)) = 0.25 GiB
    with pytest.raises(ValueError, match=r"672 pages \(0\.25 GiB.*0\.20 GiB cap \(DIRECTKV_MAX_STAGING_GB\)"):
        ops._dequantized(q, cache, 0, tables, ql, None, None, None, False, 40000)


@pytest.mark.parametrize("P, sizes", [(64, [2, 2, 2, 2]), (16, [8])])
def test_fp8_chunk_launch_order_per_head_group(monkeypatch, P, sizes):
    """``_fp8_by_head`` with the GPU stood in: for each head group in copy order, the urgent
    stream waits for that group's copy event, then dequantizes exactly that group; the group's
    attention launch runs on a stream (round-robin) that first waits for the event recorded after
    that dequantization, over the group's heads only; the current stream waits for every stream
    before ``finish``. A missing wait, a wrong group or a skipped head fails it."""
    import contextlib

    from directkv_cute import staging
    from directkv_cute.kernels import launch as L

    log = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_event(self, ev):
            log.append(("wait", self.name, ev.tag))

        def wait_stream(self, other):
            log.append(("wait_stream", self.name, other.name))

    current = [Stream("cur")]

    class Event:
        def __init__(self, tag=None):
            self.tag = tag

        def record(self, stream):
            self.tag = f"deq-done@{len([x for x in log if x[0] == 'dequant'])}"
            log.append(("record", stream.name, self.tag))

    @contextlib.contextmanager
    def on(stream):
        saved, current[0] = current[0], stream
        yield
        current[0] = saved

    hkv, d = 8, 128
    urgent = Stream("urgent")
    aux = [Stream(f"aux{i}") for i in range(3)]

    class FakeStager:
        lock = contextlib.nullcontext()

        def stage_fp8(self, cache, layer, plan, groups=None):
            assert groups == staging.head_groups(hkv, 2 * P * d) and len(plan.pieces) == 1
            raw = torch.zeros(plan.pages, 1, hkv, 2, P, d, dtype=torch.float8_e4m3fn)
            return raw, torch.zeros(raw.shape[:-1]), [Event(f"landed{i}") for i in range(len(groups))]

        def streams(self, n):
            return [current[0], *aux[:n - 1]]

        def urgent_stream(self):
            return urgent

        def finish(self):
            log.append(("finish",))

    monkeypatch.setattr(ops, "stager", lambda device, stream: FakeStager())
    monkeypatch.setattr(ops, "_compiled_q_tiled", lambda *a: "attn")
    monkeypatch.setattr(ops, "_compiled_dequant", lambda *a: "deq")
    monkeypatch.setattr(L, "link_counters", lambda device: None)
    monkeypatch.setattr(L, "launch_dequant", lambda fn, raw, sc, buf, heads: log.append(("dequant", current[0].name,
                                                                                        heads)))
    monkeypatch.setattr(L, "launch_q_tiled", lambda *a, heads, **k: log.append(("attn", current[0].name, heads)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    q, _, tables, ql, _ = _call([20000, 9000], [2048, 1000], page=P)
    q = torch.zeros(q.shape, dtype=q.dtype)
    lens = (20000, 9000)
    plan = ops.plan_staging(tables.host_table, lens, P, math.ceil(20000 / P))
    cache = SimpleNamespace(page_size=P, num_kv_heads=hkv, dtype=torch.float8_e4m3fn,
                            host_pool=torch.empty(0, dtype=torch.float8_e4m3fn))
    ops._fp8_by_head(q, cache, 0, plan, tables, lens, ql, None, QTiledConfig(), None, False)

    groups = staging.head_groups(hkv, 2 * P * d)
    assert [len(g) for g in groups] == sizes
    streams = ["cur", "aux0", "aux1", "aux2"][:len(groups)]
    at = 0
    for i, g in enumerate(groups):
        want = [("wait", "urgent", f"landed{i}"), ("dequant", "urgent", g), ("record", "urgent", f"deq-done@{i + 1}"),
                ("wait", streams[i % len(streams)], f"deq-done@{i + 1}"), ("attn", streams[i % len(streams)], g)]
        assert log[at:at + 5] == want, (i, log[at:at + 5])
        at += 5
    joins = [("wait_stream", "cur", s) for s in (*streams[1:], "urgent")]
    assert log[at:] == [*joins, ("finish",)]


def test_fp8_chunk_plans_its_staging_once_per_kernel_tables(monkeypatch):
    """The layers of a step share one KernelTables: an FP8 chunk's staging plan is made for the
    first layer's call and reused by the next (here each call then stops at the staging cap)."""
    monkeypatch.setenv("DIRECTKV_MAX_STAGING_GB", "0.01")
    made = []
    real = ops.plan_staging
    monkeypatch.setattr(ops, "plan_staging", lambda *a: made.append(a[3]) or real(*a))
    q, _, tables, ql, _ = _call([40000, 3000], [512, 16])
    cache = SimpleNamespace(page_size=64, num_kv_heads=8, head_dim=128, dtype=torch.float8_e4m3fn,
                            compute_dtype=torch.bfloat16, host_pool=torch.empty(0, dtype=torch.float8_e4m3fn))
    for layer in range(3):
        with pytest.raises(ValueError, match="672 pages"):
            ops._dequantized(q, cache, layer, tables, ql, None, None, None, False, 40000)
    assert made == [625]  # one plan, of one piece: the longest sequence's pages


@pytest.mark.parametrize("lens,q_lens,P,first", [([8192], [2048], 64, 6), ([32768], [2048], 64, 15),
                                                ([16384, 9000], [2048, 1000], 16, 7)])
def test_a_window_chunk_launches_its_ready_splits_first(monkeypatch, lens, q_lens, P, first):
    """A chunk whose own pages are mirrored in HBM (a model step's window; in a ragged batch the
    longest history ends last), staged: its pieces end where every sequence's window has begun,
    the pieces after are ready at the start, and the one launch starts at the first split that
    reads only them (its z ranks fold in that order), every split before it reading history;
    without a window the splits run in order. Every split runs exactly once, folded in the kernel
    into buffers shaped as the call's (no partial slots, no combine)."""
    import contextlib

    from directkv_cute.kernels import launch as L
    from directkv_cute.plan import q_tiled_splits

    log, hosts = [], []

    class FakeStager:
        lock = contextlib.nullcontext()

        def stage(self, cache, layer, plan, by_head=False):
            return torch.empty(0), torch.empty(0), 1

        def finish(self):
            log.append(("finish",))

        def fold_turns(self, count):
            return torch.zeros(count, dtype=torch.int32)

    def launch(fn, q_, o, lse, host, buf, L_, layer, hkv, table, seq_lens, cu_q, flags, n_qt, splits, split_tiles,
               epoch, piece_tiles, scale, ascending=False, flag_stride=0, heads=None, split_first=0, fold=None):
        acc, acc_lse, turns = fold
        assert acc.shape == o.shape == q_.shape and acc_lse.shape == lse.shape and acc.dtype == torch.float32
        assert turns.numel() == L.fold_turn_count(len(lens), hkv, n_qt) and not turns.any()
        log.append(("attn", fn, [(split_first + r) % splits for r in range(splits)], split_tiles, piece_tiles))
        hosts.append(host)

    monkeypatch.setattr(ops, "stager", lambda device, stream: FakeStager())
    monkeypatch.setattr(ops, "_compiled_q_tiled", lambda *a: ("attn", *a[5:]))
    monkeypatch.setattr(L, "launch_q_tiled", launch)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    for window in (True, False):
        log.clear()
        q, cache, tables, ql, group = _call(lens, q_lens, page=P)
        hist = max((n - m) // P for n, m in zip(lens, q_lens))  # the partial page before a step is mirrored too
        if window:
            for b, (n, m) in enumerate(zip(lens, q_lens)):
                row = tables.host_table[b]
                row[(n - m) // P:] = -(np.arange((n - m) // P, row.size) + 1000 * (b + 1)) - 1
        cfg, plan = ops._q_tiled_route(q, cache, tables, ql, group, None)
        assert cfg.splits > 1 and cfg.copy_order == 1
        cache = SimpleNamespace(page_size=P, num_kv_heads=8, host_pool_cuda=None,
                                host_pool=torch.empty(0, dtype=q.dtype), num_layers=32,
                                hbm_pool=torch.empty(5, 32, 8, 2, P, 128, dtype=q.dtype, device="meta"))
        ops._launch_q_tiled(torch.zeros(q.shape, dtype=q.dtype), cache, 3, tables, ql, None, max(ql), None, None,
                            False, cfg, plan)
        (a1, done) = log
        assert a1[1] == ("attn", True, True) and done == ("finish",)  # staged (wait_ready), folding
        runs, split_tiles, piece_tiles = a1[2:]
        splits = len(runs)
        ready_tiles = plan.ready_from * piece_tiles
        assert (splits, split_tiles) == q_tiled_splits(math.ceil(max(lens) / 128), piece_tiles, cfg.splits,
                                                       ready_tiles)
        assert sorted(runs) == list(range(splits))
        if not window:  # host pages only: the launch's other source stays the host pool
            assert plan.ready_from == len(plan.pieces) and runs == list(range(splits))
            assert not plan.reads_in_place and hosts[-1] is cache.host_pool
            continue
        # The window's pages are read where they are: their entries index the HBM pool's layer 3 as
        # one-layer pages (page * L), the launch's stand-in source that view of the pool.
        assert plan.reads_in_place and hosts[-1].shape == (5 * 32 - 3, 1, 8, 2, P, 128)
        for b, (n, m) in enumerate(zip(lens, q_lens)):
            own = np.arange((n - m) // P, math.ceil(n / P))
            assert (plan.table[b, own] == (own + 1000 * (b + 1)) * 32).all()
            assert (plan.table[b, :own[0]] < 0).all()
        assert plan.ready_from * plan.piece_pages == hist  # pieces end where the windows have all begun
        assert runs == list(range(first, splits)) + list(range(first))  # the ready splits first, then the history
        assert (first - 1) * split_tiles < ready_tiles <= first * split_tiles


def test_launch_q_tiled_checks_split_and_fold_arguments():
    """The launch refuses a first split outside the splits, a head-by-head copy over several
    splits or some heads, several splits without fold buffers (or one with them), and fold
    buffers that are not an fp32 accumulator shaped as q, an fp32 LSE shaped as lse and enough
    turn counters, before the kernel is called; valid arguments reach it (12 pointers: the fold's
    three after the ready flags, stand-ins that are never read without a fold)."""
    pytest.importorskip("cutlass")
    from directkv_cute.kernels import launch as L

    calls = []
    fn = lambda *a: calls.append(a)  # noqa: E731
    total_q, hq, hkv, d, n_qt = 96, 32, 8, 128, 3
    q = torch.zeros(total_q, hq, d, dtype=torch.bfloat16)
    out, lse = torch.zeros_like(q), torch.zeros(total_q, hq)
    pool = torch.zeros(4, 1, hkv, 2, 64, d, dtype=torch.bfloat16)
    table, lens, cu_q = torch.zeros(1, 4, dtype=torch.int32), torch.tensor([256], dtype=torch.int32), \
        torch.tensor([0, total_q], dtype=torch.int32)
    ready = torch.zeros(8, dtype=torch.int32)
    acc, acc_lse = torch.zeros(q.shape), torch.zeros(total_q, hq)
    turns = torch.zeros(L.fold_turn_count(1, hkv, n_qt), dtype=torch.int32)
    base = (fn, q, out, lse, pool, pool, 1, 0, hkv, table, lens, cu_q, ready, n_qt)
    four = (*base, 4, 1, 1, 1, 1.0)
    one = (*base, 1, 4, 1, 4, 1.0)
    fold = (acc, acc_lse, turns)
    bad = [(four, dict(split_first=4, fold=fold)), (four, dict(fold=fold, flag_stride=4)), (four, {}),
           (one, dict(fold=fold)), (one, dict(flag_stride=1, heads=range(2))),
           (four, dict(fold=(acc.to(torch.bfloat16), acc_lse, turns))), (four, dict(fold=(acc[:-1], acc_lse, turns))),
           (four, dict(fold=(acc, acc_lse[:-1], turns))), (four, dict(fold=(acc, acc_lse, turns[:-1])))]
    for args, kw in bad:
        with pytest.raises(ValueError):
            L.launch_q_tiled(*args, **kw)
    assert not calls
    monkey_stream = pytest.MonkeyPatch()
    monkey_stream.setattr(L, "_stream", lambda: None)
    try:
        L.launch_q_tiled(*four, fold=fold, split_first=2)
        L.launch_q_tiled(*one, flag_stride=1)
    finally:
        monkey_stream.undo()
    assert len(calls) == 2 and all(len(c) == 12 + 18 + 2 for c in calls)
    where = lambda c: [(p._pointer, str(p.dtype)) for p in c[9:12]]  # noqa: E731
    assert where(calls[0]) == [(acc.data_ptr(), "Float32"), (acc_lse.data_ptr(), "Float32"),
                               (turns.data_ptr(), "Int32")]
    assert where(calls[1]) == [(lse.data_ptr(), "Float32"), (lse.data_ptr(), "Float32"), (ready.data_ptr(), "Int32")]


@pytest.mark.parametrize("ctx,q_len,splits,pieces,copy_order", [
    (8192, 2048, 8, 8, 1), (16384, 2048, 8, 8, 1), (32768, 2048, 16, 16, 1), (131072, 2048, 16, 16, 1),
    (131072, 8192, 1, 4, 2), (131072, 4096, 1, 4, 2), (8192, 4096, 8, 8, 1)])
def test_long_link_bound_chunks_take_16_folded_splits_and_compute_bound_ones_stay_head_by_head(
        ctx, q_len, splits, pieces, copy_order):
    """From 32k keys a link-bound chunk with more CTAs than SMs is staged in 16 pieces and 16
    folded splits (``link_bound_staging``; measured faster at 32k and 128k q2048, slower at 8k);
    the 16-split choice is not offered to compute-bound chunks, which keep the head-by-head copy
    (measured faster at 128k q8192)."""
    q, cache, tables, ql, group = _call([ctx], [q_len])
    cfg, plan = ops._q_tiled_route(q, cache, tables, ql, group, None)
    assert (cfg.splits, len(plan.pieces), cfg.copy_order) == (splits, pieces, copy_order)


def _busy(monkeypatch, busy=True):
    from directkv_cute import staging

    monkeypatch.setattr(staging, "busy", lambda device, stream: busy)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)


def test_marked_tables_behind_a_running_staged_call_plan_copies_ahead(monkeypatch):
    """8k q2048 with the step's window (measured 2026-12-03, 32 calls back to back: 0.471 ms
    planned so, 0.621 paced, 0.474 with the history in one piece and one split): over tables
    marked back to back, while a staged call still runs, the history is two pieces and the kernel
    three splits, the window's first; unmarked tables, an idle stager, a cache without a record of
    its host writes, or the overlap switched off keep the paced plan."""
    _busy(monkeypatch)
    cfg, plan = ops._q_tiled_route(*_call([8192], [2048], window=True, marked=True), None)
    assert (cfg.splits, cfg.copy_order, cfg.order, len(plan.pieces), plan.ready_from) == (2, 1, 1, 3, 2)
    assert plan.piece_pages == 48  # the history's 96 pages in two, then the step's 32 in the window
    paced = ops._q_tiled_route(*_call([8192], [2048], window=True), None)
    assert paced[0].splits > 1 and len(paced[1].pieces) > 2
    q, cache, tables, q_lens, group = _call([8192], [2048], window=True, marked=True)
    for why in ("idle", "no record", "overlap off"):
        c = cache
        if why == "idle":
            _busy(monkeypatch, False)
        elif why == "no record":
            c = SimpleNamespace(**{k: v for k, v in vars(cache).items() if k != "host_writes"})
        else:
            monkeypatch.setenv("DIRECTKV_STAGE_OVERLAP", "0")
        got = ops._q_tiled_route(q, c, tables, q_lens, group, None)
        assert got[0].splits == paced[0].splits and got[1].pieces == paced[1].pieces, why
        _busy(monkeypatch)
        monkeypatch.delenv("DIRECTKV_STAGE_OVERLAP", raising=False)
    # both plans of one step's tables are kept: busy and idle calls alternate without replanning
    # (the idle plan of these tables was made above; the busy one is made once here)
    calls = []
    real = ops._plan_route
    monkeypatch.setattr(ops, "_plan_route", lambda *a: calls.append(a[-1]) or real(*a))
    for busy in (True, False, True, False):
        _busy(monkeypatch, busy)
        assert ops._q_tiled_route(q, cache, tables, q_lens, group, None)[0].splits == (2 if busy else paced[0].splits)
    assert calls == [True]


def test_copies_ahead_end_a_piece_where_the_steps_own_pages_begin(monkeypatch):
    """Ragged, host only: the step's own pages were just written, so their copy waits for the
    previous kernel; the history of every sequence ends before the piece that holds them (the
    first page holding any sequence's new tokens, on a whole KV tile)."""
    _busy(monkeypatch)
    lens, q_lens, page = [6000, 3100], [2000, 700], 64
    cfg, plan = ops._q_tiled_route(*_call(lens, q_lens, marked=True), None)
    assert cfg.splits == 1 and plan.piece_pages == 36  # min(62, 37) pages, rounded down to 2-page tiles
    own_first = [(n - ql) // page for n, ql in zip(lens, q_lens)]
    table = _call(lens, q_lens)[2].host_table
    for p, piece in enumerate(plan.pieces):
        for r in piece:
            for src in range(r.src, r.src + r.count):
                b, lp = np.argwhere(table == src)[0]
                assert (lp >= own_first[b]) <= (p >= 1), (p, b, lp)


@pytest.mark.parametrize("lens, q_lens", [([8192], [8192]), ([16384], [8192])])
def test_copies_ahead_keep_the_paced_plan_where_the_steps_own_pages_would_stall_it(monkeypatch, lens, q_lens):
    """A first chunk (every page on the host, the step's own just written): planned ahead, the
    copy of its own pages would wait for the previous kernel and stall the kernel (16k q8192:
    measured 2.82 ms planned ahead vs 2.38 paced), so the paced plan stays."""
    _busy(monkeypatch)
    got = ops._q_tiled_route(*_call(lens, q_lens, marked=True), None)
    paced = ops._q_tiled_route(*_call(lens, q_lens), None)
    assert got[0] == paced[0] and got[1].pieces == paced[1].pieces


def test_copies_ahead_split_long_histories_so_the_runs_last_kernel_ends_soon_after_its_copy(monkeypatch):
    """The run's last kernel is exposed after its copy lands (its tail, ``plan.pipelined_tail_ms``):
    planned ahead, a history is copied in as many pieces as it has splits, the window's split
    launched first (measured 2026-12-03, 32 calls back to back: 32k q2048 with the window 2.311
    ms in 4 history pieces vs 2.335 in one; 128k q2048 9.61 in 8 vs 9.63 paced in 16)."""
    _busy(monkeypatch)
    for lens, q_lens, least in (([32768], [2048], 4), ([131072], [2048], 8)):
        cfg, plan = ops._q_tiled_route(*_call(lens, q_lens, window=True, marked=True), None)
        own = (lens[0] - q_lens[0]) // 64
        assert cfg.splits >= least and plan.ready_from * plan.piece_pages == own, (lens, cfg, plan.piece_pages)
        assert len(plan.pieces) == plan.ready_from + 1  # the history's pieces, then the window's


def test_pipelined_cost_model():
    """max(copy, kernel + the wait for the step's own pages) + the tail's share; a kernel's splits
    past the first cost their folds, and too few CTAs for the SMs stretch it."""
    from directkv_cute import plan as pl

    assert pl.kernel_ms(1.0, 0.0, 1, 132, 132) == 1.0
    assert pl.kernel_ms(1.0, 0.0, 1, 66, 132) == 2.0 and pl.kernel_ms(1.0, 0.0, 2, 66, 132) == 2.0 * 0.5 + 0.0
    assert pl.kernel_ms(1.0, 2.2e6, 3) == pytest.approx(1.0 + 2 * 1e-3)
    over = pl.STAGE_OVERHEAD_MS
    assert pl.pipelined_ms(2.0, 1.0, 0.0, 1) == pytest.approx(2.0 + over)
    assert pl.pipelined_ms(2.0, 1.0, 0.0, 1, wait_ms=1.5) == pytest.approx(2.5 + over)
    assert pl.pipelined_ms(2.0, 1.6, 0.0, 1, tail_ms=1.6) == pytest.approx(2.0 + 1.6 / pl.RUN_CALLS + over)
    # each split's share of the causal work: 8 keys, 4 new rows (seeing 5..8 keys), splits of 4 keys
    assert pl.split_work([8], [4], 2, 2, 2) == pytest.approx([16 / 26, 10 / 26])
    assert pl.split_work([8, 4], [4, 4], 2, 2, 2) == pytest.approx([(16 + 10) / 36, 10 / 36])
    # the run's last kernel after its copy: one split waits for the whole copy, then all its work;
    # two pieces: the first split's work runs under the second piece's copy; a ready split (the
    # step's window, launched first) runs under the copy, and the history split folds after it
    assert pl.pipelined_tail_ms(1.0, 1.0, 0.1, [1.0], [1.0]) == pytest.approx(1.0)
    assert pl.pipelined_tail_ms(1.0, 1.0, 0.1, [0.5, 0.5], [0.5, 1.0]) == pytest.approx(0.6)
    assert pl.pipelined_tail_ms(1.0, 1.0, 0.1, [0.2, 0.8], [None, 1.0]) == pytest.approx(0.9)
    assert pl.pipelined_tail_ms(1.0, 2.0, 0.0, [0.9, 0.1], [0.5, 1.0]) == pytest.approx(1.5)  # the first split's
    assert pl.pipelined_tail_ms(1.0, 1.0, 0.0, [0.5], [1.0], busy=0.5) == pytest.approx(1.0)  # half the SMs
    # a paced candidate wins where the whole kernel's tail costs more than the pipelined plan saves
    paced, piped = (16, 16, 0, 16, None), (1, 1, 0, 2, ([1.0], [1.0]))
    big = int(9.4e-3 * pl.MEMCPY_GBPS * 1e9)  # a 9.4 ms copy, the kernel 6 ms
    flops = 6.0e-3 * pl.Q_TILED_TFLOPS * 1e12
    choice, best = pl.choose_pipelined(big, 0, flops, 1e5, [piped, paced])
    assert best == 1 and choice.splits == 16 and choice.pipelined
    small = int(0.47e-3 * pl.MEMCPY_GBPS * 1e9)  # 8k q2048's history and kernel: the pipeline wins
    choice, best = pl.choose_pipelined(small, 0, 0.374e-3 * pl.Q_TILED_TFLOPS * 1e12, 67.6e6,
                                       [(1, 1, 0, 2, ([1.0], [1.0])), (8, 8, 0, 8, None)])
    assert best == 0 and choice.staged
    with pytest.raises(ValueError, match="at least one candidate"):
        pl.choose_pipelined(small, 0, 1.0, 0.0, [])
