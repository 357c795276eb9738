"""CPU tests of the planner's routing (``planner.plan_attention``) over call shapes and GPU facts
(``machine.DeviceInfo``) stated as values: which kernel runs, staged or in place, and why; the
Q-tiled config (an explicit QTiledConfig, else the tuned profile's q_tiled entry, else the
default); and the runner's launches of the staged routes, with the GPU's launches stood in."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from directkv_cute import routes, runner
from directkv_cute.config import ConfigError, DecodeConfig, QTiledConfig
from directkv_cute.machine import H200, DeviceInfo
from directkv_cute.planner import CallShape, PlanError, ProfileConfigs, StagingRequest, plan_attention
from directkv_cute.stage_plan import (FP8_TAIL_SHARE, HEAD_PIECES, LINK_PIECES, MAX_FLAGS, fp8_head_groups,
                                      split_staged_table)
from directkv_cute.tuning import lookup as L
from directkv_cute.tuning import profiles as P

GPU = "Test GPU without a profile"  # the routing tests see the default configs, whatever is shipped
H200_FACTS = DeviceInfo(GPU, sms=132, total_memory=140 * 2**30, copies_ahead=True)
E4M3 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def no_profile(monkeypatch, tmp_path):
    monkeypatch.setenv(P.PROFILE_DIR_ENV, str(tmp_path / "profiles"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv(L.REQUIRE_ENV, raising=False)
    L.clear_cache()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="directkv-cute: no tuned", category=P.ProfileWarning)
        yield
    L.clear_cache()


def shape(lens, q_lens, tier="host", hq=32, hkv=8, page=64, fp8=False, marked=False):
    return CallShape.example(lens, q_lens, num_q_heads=hq, num_kv_heads=hkv, page_size=page, tier=tier,
                             page_dtype=E4M3 if fp8 else None, back_to_back=marked)


def plan(s, config=None, device=H200_FACTS, gpu=GPU, **staging):
    """The plan of ``s``; keyword arguments: a StagingRequest with ``config`` (a QTiledConfig)."""
    return plan_attention(s, device, H200, ProfileConfigs(gpu), config,
                          staging=StagingRequest(**staging) if staging else None)


# ---- the routing table: shape -> route, and how the staged ones are staged -------------------------
# (name, call, route, (splits, pieces, copy head by head) of a staged Q-tiled route, why)
ROUTES = [
    ("decode-4k", dict(lens=[4096], q_lens=[1]), "decode", None,
     "a short link-bound read: the copy's overhead eats the copy engine's edge"),
    ("window-8k-q16", dict(lens=[8192], q_lens=[16]), "decode", None, "short link-bound read"),
    ("decode-batch4-2k", dict(lens=[2000] * 4, q_lens=[1] * 4), "decode", None, "short link-bound reads"),
    ("chunk-8k-q64", dict(lens=[8192], q_lens=[64]), "multi_token", None, "short link-bound chunk"),
    ("decode-32k", dict(lens=[32768], q_lens=[1]), "q_tiled_staged", (2, 16, False),
     "long link-bound read: the copy engine outruns the SMs' reads of host memory"),
    ("decode-batch16-32k", dict(lens=[32768] * 16, q_lens=[1] * 16), "q_tiled_staged", None, "long link-bound reads"),
    ("chunk-8k-q512", dict(lens=[8192], q_lens=[512]), "q_tiled_staged", (1, LINK_PIECES, False),
     "its 128 CTAs fit one wave: one split of two pieces (0.676 ms vs 0.745 in place)"),
    ("chunk-batch16-32k-q64", dict(lens=[32768] * 16, q_lens=[64] * 16), "q_tiled_staged", None,
     "more CTAs than SMs: the model's splits"),
    ("prefill-32k-q8192", dict(lens=[32768], q_lens=[8192]), "q_tiled_staged", (1, HEAD_PIECES, True),
     "compute-bound: copied head by head, one split"),
    ("prefill-128k-q8192", dict(lens=[131072], q_lens=[8192]), "q_tiled_staged", (1, 4, True),
     "compute-bound: head by head (16 splits measured slower)"),
    ("chunk-8k-q2048", dict(lens=[8192], q_lens=[2048]), "q_tiled_staged", (8, 8, False),
     "link-bound chunk whose compute trails the copy: 8 pieces"),
    ("chunk-32k-q2048", dict(lens=[32768], q_lens=[2048]), "q_tiled_staged", (16, 16, False),
     "from 32k keys: 16 pieces in 16 folded splits"),
    ("chunk-128k-q2048", dict(lens=[131072], q_lens=[2048]), "q_tiled_staged", (16, 16, False), "16 folded splits"),
    ("chunk-16k-q2048", dict(lens=[16384], q_lens=[2048]), "q_tiled_staged", (8, 8, False), "below 32k: 8"),
    ("chunk-8k-q4096", dict(lens=[8192], q_lens=[4096]), "q_tiled_staged", (8, 8, False), ""),
    ("prefill-128k-q4096", dict(lens=[131072], q_lens=[4096]), "q_tiled_staged", (1, 4, True), ""),
    ("hbm-chunk-32k-q2048", dict(lens=[32768], q_lens=[2048], tier="hbm"), "q_tiled_hbm", None,
     "every page in HBM and the query tiles fill a wave"),
    ("hbm-chunk-32k-q64", dict(lens=[32768], q_lens=[64], tier="hbm"), "multi_token", None,
     "every page in HBM but 16 CTAs: the split chunk kernel"),
    ("hbm-decode-batch32-32k", dict(lens=[32768] * 32, q_lens=[1] * 32, tier="hbm"), "decode", None,
     "decode keeps the streaming kernel"),
    ("fp8-decode-4k", dict(lens=[4096], q_lens=[1], fp8=True), "decode_fp8", None, "short read in place"),
    ("fp8-decode-32k", dict(lens=[32768], q_lens=[1], fp8=True), "decode_fp8_two_piece", None,
     "one query token: two pieces, the first launch under the second's copy"),
    ("fp8-window-32k-q4", dict(lens=[32768], q_lens=[4], fp8=True), "decode_fp8_staged", None, "one piece"),
    ("fp8-decode-hbm-32k", dict(lens=[32768], q_lens=[1], fp8=True, tier="hbm"), "decode_fp8", None,
     "nothing on the host to copy"),
    ("fp8-chunk-8k-q2048", dict(lens=[8192], q_lens=[2048], fp8=True), "fp8_by_head", None,
     "FP8 chunk filling a wave: by head groups"),
    ("fp8-chunk-8k-q64", dict(lens=[8192], q_lens=[64], fp8=True), "fp8_dequantized", None,
     "FP8 chunk of few tiles: dequantized, then the chunk kernel"),
]


@pytest.mark.parametrize("name, call, route, staged, why", ROUTES, ids=[r[0] for r in ROUTES])
def test_the_routing_table(name, call, route, staged, why):
    p = plan(shape(**call))
    assert p.route == route, p.explain()
    if route == "q_tiled_staged":
        assert p.staging is not None and p.detail.layout is not None
        assert p.staging.host_pages == sum(math.ceil(n / 64) for n in call["lens"])
        if staged is not None:
            assert (p.detail.layout.splits, len(p.staging.pieces), p.detail.layout.by_head) == staged, p.explain()
    if route in ("decode", "multi_token", "q_tiled_hbm", "decode_fp8"):
        assert p.staging is None
    assert p.route in p.explain() and (p.kernel or "-") in p.explain()


def test_plans_are_values_made_without_the_gpu(monkeypatch):
    """The planner asks no GPU: it runs with every torch.cuda query failing, and the same shape and
    facts give equal plans (layer 0 and layer 1 of a step plan alike)."""
    for name in ("is_current_stream_capturing", "current_stream", "get_device_properties", "current_device",
                 "is_available", "get_device_name"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: pytest.fail("the planner asked the GPU"))
    for call in (dict(lens=[32768], q_lens=[2048], marked=True), dict(lens=[8192], q_lens=[2048], tier="window",
                                                                      marked=True)):
        a, b = plan(shape(**call)), plan(shape(**call))
        assert a == b and repr(a) == repr(b) and a.explain() == b.explain()
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.route = "decode"


def test_the_staged_decode_reads_the_buffer_as_hbm_pages():
    p = plan(shape([32768], [8192]))
    assert (p.staging.table < 0).all(), "the kernel reads the staging buffer as HBM pages"
    assert len(p.staging.pieces) * 8 <= MAX_FLAGS
    # a capture of the same call reads in place: its plan is part of this one
    assert p.capture is not None and p.capture.route == "multi_token"


def test_clusters_run_from_two_query_tiles_on():
    assert QTiledConfig().cluster == 2
    for q, want in ((32, 1), (33, 2), (2048, 2)):
        assert plan(shape([32768], [q])).config.cluster == want, q
    assert plan(shape([32768], [1]), QTiledConfig()).config.cluster == 2  # an explicit config runs as given


def test_an_explicit_config_always_runs_its_kernel():
    p = plan(shape([32768], [1], tier="hbm"), QTiledConfig())
    assert p.route == "q_tiled_hbm"
    p = plan(shape([32768], [64], tier="hbm"), QTiledConfig(tile_n=64, stages=4))
    assert p.route == "q_tiled_hbm" and p.config.tile_n == 64
    p = plan(shape([32768], [8192]), DecodeConfig(tile_n=64, stages=4))
    assert p.route == "multi_token" and p.staging is None  # an explicit DecodeConfig reads in place
    p = plan(shape([32768], [8192]), DecodeConfig(tile_n=64, stages=7, q_regs=1, consumer_wgs=2, carveout=100,
                                                  ctas_per_sm=1))
    assert p.route == "multi_token"


def test_copy_orders_and_explicit_staging_requests_are_kept():
    p = plan(shape([32768], [8192]), QTiledConfig(), copy_order=1)
    assert not p.detail.layout.by_head and p.detail.layout.splits > 1 and len(p.staging.pieces) == 16
    # q 64 over 32k is link-bound: the model keeps the pieces of all heads together
    assert not plan(shape([32768], [64])).detail.layout.by_head
    p = plan(shape([32768, 5000], [64, 7]), QTiledConfig(), copy_order=2)
    assert p.detail.layout.by_head and p.detail.layout.splits == 1 and p.staging.host_pages == 512 + 79
    p = plan(shape([8192], [8192]), QTiledConfig(), copy_order=2, order=2)
    assert p.detail.layout.by_head and p.detail.layout.ascending and p.detail.layout.splits == 1
    p = plan(shape([8192], [8192]), QTiledConfig(), order=2)
    assert p.detail.layout.ascending and p.detail.layout.splits == 1
    p = plan(shape([8192, 3000], [8192, 100]), QTiledConfig(), splits=3, piece_pages=4)
    assert p.detail.layout.splits == 3 and p.staging.piece_pages == 4 and p.staging.pages == 128 + 47
    assert "StagingRequest(piece_pages=4, splits=3" in p.explain()
    assert plan(shape([8192], [512]), QTiledConfig(), piece_pages=4).staging.piece_pages == 4
    # an all-automatic request is no request: the same plan as none
    assert plan(shape([32768], [2048]), QTiledConfig(), **{"order": 0}) == plan(shape([32768], [2048]), QTiledConfig())
    # the lightest-first order holds over pages all in HBM too (one split there)
    assert plan(shape([8192], [8192], tier="hbm"), QTiledConfig(), order=2).detail.layout.ascending


def test_staging_requests_are_checked_and_go_with_a_q_tiled_config():
    with pytest.raises(ConfigError, match="copy_order 2 .* runs one split"):
        StagingRequest(copy_order=2, splits=4)
    with pytest.raises(ConfigError, match="order 3"):
        StagingRequest(order=3)
    with pytest.raises(ConfigError, match="piece_pages must be >= 0"):
        StagingRequest(piece_pages=-1)
    with pytest.raises(TypeError, match="splits must be an int"):
        StagingRequest(splits=2.0)
    assert StagingRequest(order=2, splits=1).one_split and StagingRequest().automatic
    for config in (None, DecodeConfig()):  # staging belongs to the Q-tiled kernel's launch
        with pytest.raises(PlanError, match="needs an explicit QTiledConfig"):
            plan(shape([32768], [2048]), config, piece_pages=4)
    with pytest.raises(TypeError, match="StagingRequest"):
        plan_attention(shape([32768], [2048]), H200_FACTS, H200, ProfileConfigs(GPU), QTiledConfig(),
                       staging={"piece_pages": 4})


def test_explicit_config_refusals_name_the_reason():
    bare = shape([4096], [4096]).replace(host_table=None)
    with pytest.raises(PlanError, match="kernel_tables"):
        plan(bare, QTiledConfig())
    small = dataclasses.replace(H200_FACTS, staging_cap=int(0.01 * 2**30))
    with pytest.raises(PlanError, match="DIRECTKV_MAX_STAGING_GB"):
        plan(shape([32768], [8192]), QTiledConfig(), small)
    assert plan(shape([32768], [8192]), None, small).route == "multi_token"  # without a config: in place
    capturing = dataclasses.replace(H200_FACTS, capturing=True)
    with pytest.raises(PlanError, match="CUDA graph"):
        plan(shape([32768], [8192]), QTiledConfig(), capturing)
    assert plan(shape([32768], [8192]), None, capturing).route == "multi_token"
    assert plan(bare).route == "multi_token"  # bare tables: in place


def test_the_staging_cap_and_the_workspace_cap_come_from_the_device_facts(monkeypatch):
    monkeypatch.setenv("DIRECTKV_MAX_STAGING_GB", "0.5")
    monkeypatch.setenv("DIRECTKV_MAX_WORKSPACE_GB", "2")
    facts = DeviceInfo(GPU, 132, 140 * 2**30)
    assert facts.staging_cap == 2**29 and facts.workspace_cap == 2 * 2**30
    monkeypatch.delenv("DIRECTKV_MAX_STAGING_GB")
    monkeypatch.delenv("DIRECTKV_MAX_WORKSPACE_GB")
    assert DeviceInfo(GPU, 132, 2**33).staging_cap == 2**30 and DeviceInfo(GPU, 132, 2**33).workspace_cap == 2**31
    tight = dataclasses.replace(H200_FACTS, workspace_cap=1.0)
    with pytest.raises(ValueError, match="DIRECTKV_MAX_WORKSPACE_GB"):
        plan(shape([32768], [64], tier="hbm"), None, tight)


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


def test_a_model_tuned_profile_is_what_the_planner_runs(tmp_path, monkeypatch):
    """End to end on the CPU: the tuner writes q_tiled entries, and the planner's automatic calls
    run them (exact and nearest bucket, all-HBM and staged); an explicit config still wins."""
    from directkv_cute.tuning.space import TuneShape

    shapes = [TuneShape(32, 8, 128, 1, 32768, q) for q in (2048, 8192)]
    results = _tune_on_the_model(tmp_path / "profiles", shapes)
    assert [r.status for r in results] == ["tuned", "tuned"]
    prof = P.load_profile(tmp_path / "profiles" / "Modelled_H200_PCIe5.yaml")
    entries = {bk: QTiledConfig.from_dict(rec["config"]) for ck, bk, rec in prof.records() if ck == Q_CLASS}
    assert set(entries) == {(1, 32768, 2048), (1, 32768, 8192)} and not prof.stale()
    tuned = entries[1, 32768, 2048]
    assert tuned != QTiledConfig()
    assert tuned.pingpong == 0  # the model's slow handshake favours issuing without turns

    L.clear_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an exact, current entry: no warning
        p = plan(shape([32768], [2048], tier="hbm"), gpu=MODEL_GPU)
    assert p.route == "q_tiled_hbm" and p.config == tuned
    # over host pages, staged: the entry's kernel, the launch fields the planner's
    p = plan(shape([32768], [8192]), gpu=MODEL_GPU)
    assert p.route == "q_tiled_staged" and p.config == entries[1, 32768, 8192]
    # the nearest bucket: q_len 3000 is nearer 2048 than 8192 in log2, context 20000 has one bucket
    assert plan(shape([20000], [3000], tier="hbm"), gpu=MODEL_GPU).config == tuned
    # another class (page 16, GQA 8) is not borrowed: the default
    assert plan(shape([32768], [2048], tier="hbm", page=16), gpu=MODEL_GPU).config == QTiledConfig()
    assert plan(shape([32768], [2048], tier="hbm", hq=64), gpu=MODEL_GPU).config == QTiledConfig()
    mine = QTiledConfig(tile_n=64, stages=4)
    assert plan(shape([32768], [2048], tier="hbm"), mine, gpu=MODEL_GPU).config == mine


def test_a_missing_entry_warns_only_for_calls_the_kernel_may_run_as_a_chunk():
    """Without a q_tiled entry the default runs, and the miss is said once, for a multi-token call;
    decode-sized calls (staged long reads) and calls the kernel does not take say nothing."""
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        p = plan(shape([32768], [1]))  # staged decode: quiet
        assert p.route == "q_tiled_staged" and p.config == QTiledConfig(cluster=1)
        assert plan(shape([32768], [64], tier="hbm")).route == "multi_token"  # 16 CTAs: not looked up
        assert plan(shape([4096], [1])).route == "decode"
        for _ in range(2):
            p = plan(shape([32768], [2048], tier="hbm"))
            assert p.route == "q_tiled_hbm" and p.config == QTiledConfig()
    msgs = [str(x.message) for x in w if issubclass(x.category, P.ProfileWarning) and "q_tiled" in str(x.message)]
    assert len(msgs) == 1, msgs
    assert "no tuned q_tiled config" in msgs[0] and "--kernel q_tiled" in msgs[0] and "q_len=2048" in msgs[0]


def test_a_foreign_q_tiled_entry_is_refused_and_the_default_runs(tmp_path):
    """A q_tiled entry with another kernel's config (decode fields) makes the file invalid: the
    lookup says why (the unknown fields) and the default runs."""
    d = tmp_path / "profiles"
    prof = P.Profile(metadata=P.make_metadata({"gpu_name": GPU, "sm_count": 132, "smem_optin_bytes": 232448},
                                              objective="gpu"))
    prof.set(Q_CLASS, (1, 32768, 2048), {"config": DecodeConfig().to_dict(), "p50_us": 1.0, "trials": 1,
                                          "kernel_hash": P.current_kernel_hash("q_tiled")})
    d.mkdir()
    (d / P.profile_filename(GPU)).write_text(prof.to_yaml())
    with pytest.warns(P.ProfileWarning, match=r"unknown QTiledConfig fields: \[.*'consumer_wgs'"):
        p = plan(shape([32768], [2048], tier="hbm"))
    assert p.route == "q_tiled_hbm" and p.config == QTiledConfig()


# ---- FP8 pages ------------------------------------------------------------------------------------
def test_fp8_decode_staging():
    p = plan(shape([32768], [1], fp8=True))
    # one query token: two pieces, the last FP8_TAIL_SHARE of the pages apart
    sp = p.staging
    assert p.route == "decode_fp8_two_piece" and sp.host_pages == 512 and (sp.table < 0).all()
    assert len(sp.pieces) == 2 and sp.piece_pages == 512 - int(512 * FP8_TAIL_SHARE)
    assert p.detail.splits == sum(part.splits for part in p.detail.parts) and p.capture.route == "decode_fp8"
    p = plan(shape([32768] * 4, [1] * 4, fp8=True))
    assert p.staging.host_pages == 4 * 512 and len(p.staging.pieces) == 2
    assert plan(shape([32768], [1], fp8=True).replace(host_table=None)).route == "decode_fp8"  # bare tables
    assert plan(shape([32768], [1], fp8=True), None, dataclasses.replace(H200_FACTS, capturing=True)).route \
        == "decode_fp8"
    assert plan(shape([32768], [1], fp8=True), None, dataclasses.replace(H200_FACTS, staging_cap=2**20)).route \
        == "decode_fp8"  # over the cap: in place
    assert plan(shape([32768], [1], fp8=True), DecodeConfig()).route == "decode_fp8"  # explicit: in place


def test_two_piece_fp8_decode_splits_every_sequence_at_the_same_page():
    """split_staged_table: the two launches' tables and lengths put every page of every sequence
    in exactly one part, in order; a sequence shorter than the first part has an empty second."""
    rng = np.random.default_rng(3)
    page, width, pages_a = 16, 12, 9
    lens = [page * 12, page * 9, 5, page * 10 + 3]
    table = rng.integers(-100, -1, size=(len(lens), width)).astype(np.int32)
    (ta, la), (tb, lb) = split_staged_table(table, lens, pages_a, page)
    assert ta.shape == (4, pages_a) and tb.shape == (4, width - pages_a)
    assert ta.flags.c_contiguous and tb.flags.c_contiguous and la.dtype == lb.dtype == np.int32
    assert la.tolist() == [page * 9, page * 9, 5, page * 9] and lb.tolist() == [page * 3, 0, 0, page + 3]
    assert (np.concatenate([ta, tb], axis=1) == table).all()


def test_fp8_chunks_run_head_by_head_where_16_bit_pages_in_hbm_would_run_the_q_tiled_kernel():
    """Over FP8 pages a multi-token call runs by head groups exactly where the same call over
    16-bit pages all in HBM runs the Q-tiled kernel (with the same config); else it is dequantized
    whole and the 16-bit plan runs over the buffer."""
    for lens, q_lens in (([8192], [2048]), ([32768], [512]), ([4000, 3000], [300, 300]), ([8192], [64]),
                         ([9000] * 3, [100, 90, 80]), ([5000], [263]), ([5000], [264])):
        over_hbm = plan(shape(lens, q_lens, tier="hbm"))
        got = plan(shape(lens, q_lens, fp8=True))
        assert (got.route == "fp8_by_head") == (over_hbm.route == "q_tiled_hbm"), (lens, q_lens)
        if got.route == "fp8_by_head":
            assert got.config == over_hbm.config
            assert list(got.detail.head_groups) == fp8_head_groups(H200, 8, 64, 128, 1, lens, q_lens, 32)
        else:
            assert got.route == "fp8_dequantized" and got.detail.inner.route == "multi_token"
            assert (got.detail.inner.staging is None and got.staging.pages ==
                    sum(math.ceil(n / 64) for n in lens))
    explicit = QTiledConfig(tile_n=64, stages=3)
    assert plan(shape([8192], [16], fp8=True), explicit).config is explicit
    p = plan(shape([8192], [2048], fp8=True), DecodeConfig(tile_n=64, stages=7, q_regs=1, consumer_wgs=2,
                                                           carveout=100, ctas_per_sm=1))
    assert p.route == "fp8_dequantized" and p.detail.inner.route == "multi_token"


def test_fp8_chunk_over_the_staging_cap_is_refused_before_anything_is_staged():
    """A multi-token call over FP8 pages has no in-place path: one whose staged FP8 pages, scales
    and dequantized copy exceed the staging cap is refused by the planner, before any copy."""
    small = dataclasses.replace(H200_FACTS, staging_cap=int(0.2 * 2**30))
    # 625 + 47 pages x (8 heads x 2 x 64 rows x (128 x (1 + 2) bytes + 4)) = 0.25 GiB
    with pytest.raises(PlanError, match=r"672 pages \(0\.25 GiB.*0\.20 GiB cap \(DIRECTKV_MAX_STAGING_GB\)"):
        plan(shape([40000, 3000], [512, 16], fp8=True), None, small)
    with pytest.raises(PlanError, match="CUDA graph"):
        plan(shape([8192], [512], fp8=True), None, dataclasses.replace(H200_FACTS, capturing=True))


# ---- copies ahead: a step's back-to-back calls ------------------------------------------------------
def test_marked_tables_plan_copies_ahead_where_the_device_lets_them():
    """8k q2048 with the step's window (32 calls back to back: 0.471 ms planned so, 0.621 paced):
    over tables marked back to back, where copies may run ahead, the history is two pieces and the
    kernel two splits, the window's first; unmarked tables, or a step whose copies may not run
    ahead (a cache without a record of its host writes, the overlap off), keep the
    paced plan."""
    p = plan(shape([8192], [2048], tier="window", marked=True))
    lo = p.detail.layout
    assert (lo.splits, lo.by_head, len(p.staging.pieces), p.staging.ready_from) == (3, False, 3, 2)
    assert p.staging.piece_pages == 48 and p.choice.pipelined and p.detail.copy_ahead
    paced = plan(shape([8192], [2048], tier="window"))
    assert paced.detail.layout.splits > 1 and len(paced.staging.pieces) > 2 and not paced.choice.pipelined
    behind = plan(shape([8192], [2048], tier="window", marked=True), None,
                  dataclasses.replace(H200_FACTS, copies_ahead=False))
    assert behind.detail.layout == paced.detail.layout and behind.staging.pieces == paced.staging.pieces
    assert not behind.detail.copy_ahead


def test_copies_ahead_end_a_piece_where_the_steps_own_pages_begin():
    """Ragged, host only: the step's own pages were just written, so their copy waits for the
    previous kernel; the history of every sequence ends before the piece that holds them."""
    lens, q_lens, page = [6000, 3100], [2000, 700], 64
    p = plan(shape(lens, q_lens, marked=True))
    assert p.detail.layout.splits == 1 and p.staging.piece_pages == 36
    own_first = [(n - ql) // page for n, ql in zip(lens, q_lens)]
    table = shape(lens, q_lens).host_table
    for i, piece in enumerate(p.staging.pieces):
        for r in piece:
            for src in range(r.src, r.src + r.count):
                b, lp = np.argwhere(table == src)[0]
                assert (lp >= own_first[b]) <= (i >= 1), (i, b, lp)


@pytest.mark.parametrize("lens, q_lens", [([8192], [8192]), ([16384], [8192])])
def test_copies_ahead_keep_the_paced_plan_where_the_steps_own_pages_would_stall_it(lens, q_lens):
    """A first chunk (every page on the host, the step's own just written): planned ahead, the
    copy of its own pages would stall the kernel (16k q8192: 2.82 ms planned ahead vs 2.38 paced)."""
    got, paced = plan(shape(lens, q_lens, marked=True)), plan(shape(lens, q_lens))
    assert got.detail.layout == paced.detail.layout and got.staging.pieces == paced.staging.pieces


def test_copies_ahead_split_long_histories_so_the_runs_last_kernel_ends_soon_after_its_copy():
    """Planned ahead, a history is copied in as many pieces as it has splits, the window's split
    launched first (32 calls back to back: 32k q2048 with the window 2.311 ms in 4 history pieces
    vs 2.335 in one; 128k q2048 9.61 in 8 vs 9.63 paced in 16)."""
    for lens, q_lens, least in (([32768], [2048], 4), ([131072], [2048], 8)):
        p = plan(shape(lens, q_lens, tier="window", marked=True))
        own = (lens[0] - q_lens[0]) // 64
        assert p.detail.layout.splits >= least and p.staging.ready_from * p.staging.piece_pages == own
        assert len(p.staging.pieces) == p.staging.ready_from + 1  # the history's pieces, then the window's


def test_pipelined_cost_model():
    """max(copy, kernel + the wait for the step's own pages) + the tail's share; a kernel's splits
    past the first cost their folds, and too few CTAs for the SMs stretch it."""
    from directkv_cute import plan as pl
    from directkv_cute import stage_plan

    m = H200
    assert pl.kernel_ms(m, 1.0, 0.0, 1, 132, 132) == 1.0
    assert pl.kernel_ms(m, 1.0, 0.0, 1, 66, 132) == 2.0 and pl.kernel_ms(m, 1.0, 0.0, 2, 66, 132) == 1.0
    assert pl.kernel_ms(m, 1.0, 2.2e6, 3) == pytest.approx(1.0 + 2 * 1e-3)
    over = m.stage_overhead_ms
    assert pl.pipelined_ms(m, 2.0, 1.0, 0.0, 1) == pytest.approx(2.0 + over)
    assert pl.pipelined_ms(m, 2.0, 1.0, 0.0, 1, wait_ms=1.5) == pytest.approx(2.5 + over)
    assert pl.pipelined_ms(m, 2.0, 1.6, 0.0, 1, tail_ms=1.6) == pytest.approx(2.0 + 1.6 / pl.RUN_CALLS + over)
    assert pl.split_work([8], [4], 2, 2, 2) == pytest.approx([16 / 26, 10 / 26])
    assert pl.split_work([8, 4], [4, 4], 2, 2, 2) == pytest.approx([(16 + 10) / 36, 10 / 36])
    assert pl.pipelined_tail_ms(1.0, 1.0, 0.1, [1.0], [1.0]) == pytest.approx(1.0)
    assert pl.pipelined_tail_ms(1.0, 1.0, 0.1, [0.5, 0.5], [0.5, 1.0]) == pytest.approx(0.6)
    assert pl.pipelined_tail_ms(1.0, 1.0, 0.1, [0.2, 0.8], [None, 1.0]) == pytest.approx(0.9)
    assert pl.pipelined_tail_ms(1.0, 2.0, 0.0, [0.9, 0.1], [0.5, 1.0]) == pytest.approx(1.5)
    assert pl.pipelined_tail_ms(1.0, 1.0, 0.0, [0.5], [1.0], busy=0.5) == pytest.approx(1.0)
    paced, piped = (16, 16, 0, 16, None), (1, 1, 0, 2, ([1.0], [1.0]))
    big = int(9.4e-3 * m.memcpy_gbps * 1e9)  # a 9.4 ms copy, the kernel 6 ms
    flops = 6.0e-3 * m.q_tiled_tflops * 1e12
    choice, best = stage_plan.choose_pipelined(m, big, 0, flops, 1e5, [piped, paced])
    assert best == 1 and choice.splits == 16 and choice.pipelined
    small = int(0.47e-3 * m.memcpy_gbps * 1e9)  # 8k q2048's history and kernel: the pipeline wins
    choice, best = stage_plan.choose_pipelined(m, small, 0, 0.374e-3 * m.q_tiled_tflops * 1e12, 67.6e6,
                                       [(1, 1, 0, 2, ([1.0], [1.0])), (8, 8, 0, 8, None)])
    assert best == 0 and choice.staged
    with pytest.raises(ValueError, match="at least one candidate"):
        stage_plan.choose_pipelined(m, small, 0, 1.0, 0.0, [])


def test_an_unknown_gpu_gets_a_conservative_machine_model_and_one_warning():
    """No machine model in the profile: one warning naming the file, and a model with no copy
    engine edge, under which link-bound calls read in place and compute-bound ones still stage."""
    name = "Unknown GPU for the machine model"
    with pytest.warns(P.ProfileWarning, match="no machine model for Unknown GPU"):
        m = L.machine_for(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert L.machine_for(name) == m  # said once
    assert m.memcpy_gbps == m.link_gbps and m != H200
    facts = dataclasses.replace(H200_FACTS, name=name)
    assert plan_attention(shape([32768], [1]), facts, m, ProfileConfigs(name)).route == "decode"
    assert plan_attention(shape([32768], [8192]), facts, m, ProfileConfigs(name)).route == "q_tiled_staged"


def test_the_shipped_h200_profile_carries_todays_rates():
    from directkv_cute.tuning.lookup import machine_model

    L.clear_cache()
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(P.PROFILE_DIR_ENV)
        assert machine_model("NVIDIA H200") == H200


# ---- the runner's launches of the staged routes, the GPU stood in --------------------------------
class _Stream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_event(self, ev):
        self.log.append(("wait", self.name, getattr(ev, "tag", ev)))

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))


def test_two_piece_fp8_decode_launches_each_part_after_its_copy_into_one_combine(monkeypatch):
    """The runner over a two-piece FP8 decode plan: the kernel runs once per piece, after that
    piece's event, over that piece's pages and lengths, into its own slice of the partials; one
    combine merges every split of both."""
    from directkv_cute.kernels import launch

    log = []

    class FakeStager:
        lock = contextlib.nullcontext()

        def stage_fp8(self, cache, layer, sp, groups=None):
            raw = torch.empty(sp.pages, 1, 8, 2, 64, 128, dtype=E4M3, device="meta")
            return raw, torch.empty(raw.shape[:-1], device="meta"), ["first", "second"]

        def finish(self):
            log.append(("finish",))

    def decode(fn, q, o, lse, cache, layer, page_table, seq_lens, cu_q, splits, scale, counters):
        assert o.shape[0] == lse.shape[0] == splits
        log.append(("decode", o.data_ptr(), splits, page_table.clone(), seq_lens.clone()))

    def combine(fn, o_part, lse_part, out, lse, splits):
        log.append(("combine", o_part.data_ptr(), o_part.shape[0], splits))

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream("cur", log))
    monkeypatch.setattr(routes, "stager", lambda device, stream: FakeStager())
    monkeypatch.setattr(runner, "compiled_fp8", lambda *a: "fp8")
    monkeypatch.setattr(routes, "compiled_combine", lambda d, dtype: None)
    monkeypatch.setattr(launch, "launch_decode", decode)
    monkeypatch.setattr(launch, "launch_combine", combine)
    monkeypatch.setattr(launch, "link_counters", lambda device, capturing: None)
    lens = (32768, 5000)
    p = plan(shape(list(lens), [1, 1], fp8=True))
    assert p.route == "decode_fp8_two_piece"
    parts = tuple((torch.from_numpy(pt.table), torch.from_numpy(pt.lens)) for pt in p.detail.parts)
    bound = runner.Bound(SimpleNamespace(seq_lens=torch.tensor(lens)), None, parts=parts)
    q = torch.zeros(2, 32, 128, dtype=torch.bfloat16)
    out, lse = p.route.run(p, bound, runner.Call(q, None, 0, 1.0))
    assert out.shape == q.shape and lse.shape == (2, 32)
    assert [e[0] for e in log] == ["wait", "decode", "wait", "decode", "combine", "finish"]
    assert log[0][2] == "first" and log[2][2] == "second"
    (_, ptr_a, s_a, table_a, lens_a), (_, ptr_b, s_b, table_b, lens_b) = log[1], log[3]
    pp = p.staging.piece_pages
    assert lens_a.tolist() == [64 * pp, 5000] and lens_b.tolist() == [32768 - 64 * pp, 0]
    assert (torch.cat([table_a, table_b], 1).numpy() == p.staging.table).all()
    _, ptr_all, n_all, splits_all = log[4]
    assert ptr_a == ptr_all and ptr_b == ptr_all + s_a * 2 * 32 * 128 * 4 and n_all == splits_all == s_a + s_b


@pytest.mark.parametrize("page, sizes", [(64, [2, 2, 2, 2]), (16, [8])])
def test_fp8_chunk_launch_order_per_head_group(monkeypatch, page, sizes):
    """The runner over an fp8_by_head plan: for each head group in copy order, the urgent stream
    waits for that group's copy event, then dequantizes exactly that group; the group's attention
    launch runs on a stream (round-robin) that first waits for the event recorded after that
    dequantization, over the group's heads only; the current stream waits for every stream before
    ``finish``. A missing wait, a wrong group or a skipped head fails it."""
    from directkv_cute import stage_plan
    from directkv_cute.kernels import launch as L_

    log = []
    current = [_Stream("cur", log)]

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
    urgent = _Stream("urgent", log)
    aux = [_Stream(f"aux{i}", log) for i in range(3)]

    class FakeStager:
        lock = contextlib.nullcontext()

        def stage_fp8(self, cache, layer, sp, groups=None):
            assert groups == stage_plan.head_groups(hkv, 2 * page * d) and len(sp.pieces) == 1
            raw = torch.zeros(sp.pages, 1, hkv, 2, page, d, dtype=E4M3, device="meta")
            return raw, torch.zeros(raw.shape[:-1], device="meta"), [Event(f"landed{i}") for i in range(len(groups))]

        def streams(self, n):
            return [current[0], *aux[:n - 1]]

        def urgent_stream(self):
            return urgent

        def finish(self):
            log.append(("finish",))

    monkeypatch.setattr(routes, "stager", lambda device, stream: FakeStager())
    monkeypatch.setattr(routes, "compiled_q_tiled", lambda *a: "attn")
    monkeypatch.setattr(routes, "compiled_dequant", lambda *a: "deq")
    monkeypatch.setattr(L_, "link_counters", lambda device, capturing: None)
    monkeypatch.setattr(L_, "launch_dequant", lambda fn, raw, sc, buf, heads: log.append(("dequant", current[0].name,
                                                                                          heads)))
    monkeypatch.setattr(L_, "launch_q_tiled", lambda *a, heads, **k: log.append(("attn", current[0].name, heads)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    p = plan(shape([20000, 9000], [2048, 1000], page=page, fp8=True))
    assert p.route == "fp8_by_head"
    groups = stage_plan.head_groups(hkv, 2 * page * d)
    p = dataclasses.replace(p, detail=dataclasses.replace(p.detail, head_groups=tuple(groups)))  # the grouping asserted
    q = torch.zeros(3048, 32, d, dtype=torch.bfloat16)
    bound = runner.Bound(SimpleNamespace(seq_lens=None), None, staged_table=None)
    p.route.run(p, bound, runner.Call(q, None, 0, 1.0))
    assert [len(g) for g in groups] == sizes
    streams = ["cur", "aux0", "aux1", "aux2"][:len(groups)]
    at = 0
    for i, g in enumerate(groups):
        want = [("wait", "urgent", f"landed{i}"), ("dequant", "urgent", g), ("record", "urgent", f"deq-done@{i + 1}"),
                ("wait", streams[i % len(streams)], f"deq-done@{i + 1}"), ("attn", streams[i % len(streams)], g)]
        assert log[at:at + 5] == want, (i, log[at:at + 5])
        at += 5
    assert log[at:] == [*[("wait_stream", "cur", s) for s in (*streams[1:], "urgent")], ("finish",)]


@pytest.mark.parametrize("lens,q_lens,page,first", [([8192], [2048], 64, 6), ([32768], [2048], 64, 15),
                                                   ([16384, 9000], [2048, 1000], 16, 7)])
def test_a_window_chunk_launches_its_ready_splits_first(monkeypatch, lens, q_lens, page, first):
    """A chunk whose own pages are mirrored in HBM (a model step's window), staged: its pieces end
    where every sequence's window has begun, the pieces after are ready at the start, and the one
    launch starts at the first split that reads only them, every split before it reading history;
    without a window the splits run in order. Every split runs exactly once, folded in the kernel
    into buffers shaped as the call's (no partial slots, no combine)."""
    from directkv_cute.kernels import launch as L_
    from directkv_cute.stage_plan import q_tiled_splits

    log, hosts = [], []

    class FakeStager:
        lock = contextlib.nullcontext()

        def stage(self, cache, layer, sp, by_head=False, ahead=False):
            return torch.empty(0), torch.empty(0), 1

        def finish(self):
            log.append(("finish",))

        def fold_turns(self, count):
            return torch.zeros(count, dtype=torch.int32)

    def launch(fn, q_, o, lse, host, buf, L, layer, hkv, table, seq_lens, cu_q, flags, n_qt, splits, split_tiles,
               epoch, piece_tiles, scale, ascending=False, flag_stride=0, heads=None, split_first=0, fold=None):
        acc, acc_lse, turns = fold
        assert acc.shape == o.shape == q_.shape and acc_lse.shape == lse.shape and acc.dtype == torch.float32
        assert turns.numel() == L_.fold_turn_count(len(lens), hkv, n_qt) and not turns.any()
        log.append(("attn", fn, [(split_first + r) % splits for r in range(splits)], split_tiles, piece_tiles))
        hosts.append(host)

    monkeypatch.setattr(routes, "stager", lambda device, stream: FakeStager())
    monkeypatch.setattr(routes, "compiled_q_tiled", lambda *a: ("attn", *a[5:]))
    monkeypatch.setattr(L_, "launch_q_tiled", launch)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    for window in (True, False):
        log.clear()
        s = shape(lens, q_lens, page=page)
        hist = max((n - m) // page for n, m in zip(lens, q_lens))
        if window:
            table = s.host_table.copy()
            for b, (n, m) in enumerate(zip(lens, q_lens)):
                table[b, (n - m) // page:] = -(np.arange((n - m) // page, table.shape[1]) + 1000 * (b + 1)) - 1
            s = s.replace(host_table=table)
        p = plan(s)
        assert p.route == "q_tiled_staged" and p.detail.layout.splits > 1 and not p.detail.layout.by_head
        cache = SimpleNamespace(host_pool_cuda=None, host_pool=torch.empty(0, dtype=torch.bfloat16), num_layers=32,
                                hbm_pool=torch.empty(5, 32, 8, 2, page, 128, dtype=torch.bfloat16, device="meta"))
        q = torch.zeros(sum(q_lens), 32, 128, dtype=torch.bfloat16)
        p.route.run(p, runner.Bound(SimpleNamespace(seq_lens=None), None), runner.Call(q, cache, 3, 1.0))
        (a1, done) = log
        assert a1[1] == ("attn", True, True) and done == ("finish",)  # staged (wait_ready), folding
        runs, split_tiles, piece_tiles = a1[2:]
        splits, sp = len(runs), p.staging
        ready_tiles = sp.ready_from * piece_tiles
        assert (splits, split_tiles) == q_tiled_splits(math.ceil(max(lens) / 128), piece_tiles, splits, ready_tiles)
        assert sorted(runs) == list(range(splits))
        if not window:  # host pages only: the launch's other source stays the host pool
            assert sp.ready_from == len(sp.pieces) and runs == list(range(splits))
            assert not sp.reads_in_place and hosts[-1] is cache.host_pool
            continue
        assert sp.reads_in_place and hosts[-1].shape == (5 * 32 - 3, 1, 8, 2, page, 128)
        for b, (n, m) in enumerate(zip(lens, q_lens)):
            own = np.arange((n - m) // page, math.ceil(n / page))
            assert (sp.table[b, own] == (own + 1000 * (b + 1)) * 32).all()
            assert (sp.table[b, :own[0]] < 0).all()
        assert sp.ready_from * sp.piece_pages == hist  # pieces end where the windows have all begun
        assert runs == list(range(first, splits)) + list(range(first))  # the ready splits first
        assert (first - 1) * split_tiles < ready_tiles <= first * split_tiles


def test_launch_q_tiled_checks_split_and_fold_arguments():
    """The launch refuses a first split outside the splits, a head-by-head copy over several
    splits or some heads, several splits without fold buffers (or one with them), and fold
    buffers that are not an fp32 accumulator shaped as q, an fp32 LSE shaped as lse and enough
    turn counters, before the kernel is called; valid arguments reach it (12 pointers: the fold's
    three after the ready flags, stand-ins that are never read without a fold)."""
    pytest.importorskip("cutlass")
    from directkv_cute.kernels import launch as L_

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
    turns = torch.zeros(L_.fold_turn_count(1, hkv, n_qt), dtype=torch.int32)
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
            L_.launch_q_tiled(*args, **kw)
    assert not calls
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(L_, "_stream", lambda: None)
        L_.launch_q_tiled(*four, fold=fold, split_first=2)
        L_.launch_q_tiled(*one, flag_stride=1)
    assert len(calls) == 2 and all(len(c) == 12 + 18 + 2 for c in calls)
    where = lambda c: [(p._pointer, str(p.dtype)) for p in c[9:12]]  # noqa: E731
    assert where(calls[0]) == [(acc.data_ptr(), "Float32"), (acc_lse.data_ptr(), "Float32"),
                               (turns.data_ptr(), "Int32")]
    assert where(calls[1]) == [(lse.data_ptr(), "Float32"), (lse.data_ptr(), "Float32"), (ready.data_ptr(), "Int32")]
