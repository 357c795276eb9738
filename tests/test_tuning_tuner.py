"""The Optuna search loop on the modelled objective: determinism, resume, failures, profile output."""

import collections

import optuna
import pytest

from directkv_cute.config import DecodeConfig
from directkv_cute.tuning import lookup as L
from directkv_cute.tuning import profiles as P
from directkv_cute.tuning.objectives import HardwareModel, ModelledObjective
from directkv_cute.tuning.space import DecodeSpace, Param, TuneShape, get_space, register_space
from directkv_cute.tuning.tuner import BucketResult, TuneOptions, Tuner, TunerAbort, format_results

SHAPE = TuneShape(32, 8, 128, batch=4, context=16384)
SPACE = get_space("decode")


class Counting:
    """Wraps an objective; counts search measurements (reps=None) per config key."""

    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name
        self.search = collections.Counter()
        self.rebench = collections.Counter()
        self.reps = getattr(inner, "reps", 10)

    def environment(self):
        return self.inner.environment()

    def __call__(self, cfg, shape, reps=None):
        (self.rebench if reps else self.search)[SPACE.config_key(cfg)] += 1
        return self.inner(cfg, shape, reps=reps)


def opts(**kw):
    base = dict(n_trials=12, seed=3, progress=False, n_startup_trials=6)
    base.update(kw)
    return TuneOptions(**base)


def measured_trials(study):
    return [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("kind") == "measured"]


def test_model_objective_is_deterministic_and_sane():
    m = ModelledObjective(seed=1)
    cfg = SPACE.default_for(SHAPE)
    a, b = m(cfg, SHAPE), m(cfg, SHAPE)
    assert a == b and a["ok"] and a["p50_us"] > 0 and a["reps"] == 10
    assert m(cfg, SHAPE, reps=30)["reps"] == 30
    ideal = SHAPE.kv_bytes() / (m.hw.link_gbps * 1e3)
    assert m.model_us(cfg, SHAPE) >= ideal  # never faster than the link
    one_cta = DecodeConfig(num_splits=1, stages=2, tile_n=32)
    batch1 = TuneShape(32, 8, 128, batch=1, context=32768)
    assert m.model_us(one_cta, batch1) > 2 * m.model_us(SPACE.default_for(batch1), batch1)  # splits matter
    bad = m(DecodeConfig(tile_n=128, stages=8), SHAPE)
    assert not bad["ok"] and "per-block" in bad["err"]
    assert ModelledObjective(seed=2)(cfg, SHAPE)["p50_us"] != a["p50_us"]


def test_same_seed_same_result():
    runs = []
    for _ in range(2):
        t = Tuner("decode", ModelledObjective(seed=0), options=opts())
        r = t.tune_bucket(SHAPE)
        study = optuna.load_study(study_name=r.study_name, storage=t.storage)
        seq = [t_.user_attrs.get("config") for t_ in study.get_trials(deepcopy=False)]
        runs.append((r.config, r.p50_us, seq))
    assert runs[0] == runs[1]
    r = runs[0]
    assert r[0] is not None and SPACE.is_legal(r[0], SHAPE)


def test_first_trial_is_the_heuristic_default_and_result_is_sane():
    t = Tuner("decode", ModelledObjective(seed=0), options=opts())
    r = t.tune_bucket(SHAPE)
    study = optuna.load_study(study_name=r.study_name, storage=t.storage)
    first = study.get_trials(deepcopy=False)[0]
    assert first.user_attrs["config"] == SPACE.default_for(SHAPE).to_dict()
    assert r.mode == "tpe" and r.status in ("tuned", "default")
    assert r.trials == 12 and len(measured_trials(study)) == 12
    assert r.default_p50_us is not None and r.p50_us <= r.default_p50_us * 1.01
    best_search = min(t_.value for t_ in measured_trials(study))
    assert r.p50_us <= 1.5 * best_search
    table = format_results([r])
    assert "speedup" in table and str(SHAPE.context) in table


PREFILL_SHAPE = TuneShape(32, 8, 128, batch=1, context=32768, q_len=512)


def _multi_token_space(monkeypatch, sampled_multi_token_legality):
    """The multi_token space, its legality report drawn from a sample of its points: the tuner only
    counts the legal configs and their launches there (over the whole space: 2 x 35 s a tune);
    the sample keeps the count far above the exhaustive threshold, so the search is the same TPE."""
    space = get_space("multi_token")
    monkeypatch.setattr(space, "legality", sampled_multi_token_legality)
    assert space.legality(PREFILL_SHAPE).legal_count > 10 * TuneOptions().exhaustive_threshold
    return space


def test_multi_token_search_starts_with_default_then_portfolio(monkeypatch, sampled_multi_token_legality):
    """The multi-token tuner measures the heuristic default first and then the space's portfolio
    of configs that did well before, in order, skipping any illegal for the shape and the one
    that is the default (measured once, first)."""
    space = _multi_token_space(monkeypatch, sampled_multi_token_legality)
    shape = PREFILL_SHAPE
    default = space.default_for(shape)
    legal = [c for c in space.portfolio(shape) if space.is_legal(c, shape)]
    assert default in legal  # the portfolio lists the q_regs chunk-4 default too
    portfolio = [c for c in legal if c != default]
    assert len(portfolio) >= 3 and all(space.in_space(c) for c in portfolio)
    t = Tuner("multi_token", ModelledObjective(seed=0, kernel="multi_token"), options=opts(n_trials=len(portfolio) + 3))
    r = t.tune_bucket(shape)
    study = optuna.load_study(study_name=r.study_name, storage=t.storage)
    first = [tr.user_attrs["config"] for tr in study.get_trials(deepcopy=False)[:1 + len(portfolio)]]
    assert first == [space.default_for(shape).to_dict()] + [c.to_dict() for c in portfolio]


def test_a_tune_shorter_than_its_seeds_says_which_go_unmeasured(caplog, monkeypatch, sampled_multi_token_legality):
    """Seeds count against --trials: a 3-trial multi_token tune measures the default and the first
    two portfolio picks, and warns that the rest of the seeds go unmeasured."""
    import logging

    space = _multi_token_space(monkeypatch, sampled_multi_token_legality)
    shape = PREFILL_SHAPE
    legal = {space.config_key(c) for c in [space.default_for(shape), *space.portfolio(shape)] if space.is_legal(c, shape)}
    with caplog.at_level(logging.WARNING):
        r = Tuner("multi_token", ModelledObjective(seed=0, kernel="multi_token"), options=opts(n_trials=3)).tune_bucket(shape)
    assert r.trials == 3
    msg = [rec.getMessage() for rec in caplog.records if "will not be measured" in rec.getMessage()]
    assert msg and f"{len(legal)} seed configs" in msg[0] and f"the last {len(legal) - 3} seeds" in msg[0]
    # enough trials for every seed: no warning
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        Tuner("multi_token", ModelledObjective(seed=0, kernel="multi_token"), options=opts(n_trials=len(legal) + 2)).tune_bucket(shape)
    assert not [rec for rec in caplog.records if "will not be measured" in rec.getMessage()]


def test_resume_continues_without_rerunning(tmp_path):
    journal = tmp_path / "tune.journal"
    obj = Counting(ModelledObjective(seed=0))
    r1 = Tuner("decode", obj, storage=journal, options=opts(n_trials=8)).tune_bucket(SHAPE)
    assert r1.trials == 8 and sum(obj.search.values()) == 8
    # same target again: the study is finished, nothing is measured
    obj.search.clear()
    obj.rebench.clear()
    r1b = Tuner("decode", obj, storage=journal, options=opts(n_trials=8)).tune_bucket(SHAPE)
    assert r1b.status == "cached" and not obj.search and not obj.rebench
    assert r1b.config == r1.config
    # resume to 2N: N more distinct configs, none measured twice across both runs
    obj2 = Counting(ModelledObjective(seed=0))
    t2 = Tuner("decode", obj2, storage=journal, options=opts(n_trials=16))
    r2 = t2.tune_bucket(SHAPE)
    assert r2.trials == 16 and sum(obj2.search.values()) == 8
    study = optuna.load_study(study_name=r2.study_name, storage=t2.storage)
    keys = [SPACE.config_key(DecodeConfig.from_dict(t.user_attrs["config"])) for t in measured_trials(study)]
    assert len(keys) == 16 and len(set(keys)) == 16
    launches = {SPACE.launch_key(DecodeConfig.from_dict(t.user_attrs["config"]), SHAPE) for t in measured_trials(study)}
    assert len(launches) == 16  # launch-equivalent configs are not re-measured either
    assert max(obj2.search.values()) == 1
    assert not set(obj2.search) & {k for k in keys[:8]}


def test_failures_are_recorded_and_never_rerun():
    def fail(cfg, shape):
        if cfg.tile_n == 32:
            raise RuntimeError("compile failed: tile 32 unsupported")
        if cfg.carveout == 100:
            return {"ok": False, "err": "launch failed: carveout 100"}
        return None

    class Flaky(ModelledObjective):
        def __call__(self, cfg, shape, reps=None):
            out = fail(cfg, shape)
            if out is not None:
                return out
            return super().__call__(cfg, shape, reps)

    obj = Counting(Flaky(seed=0))
    t = Tuner("decode", obj, options=opts(n_trials=30, n_startup_trials=15, seed=5))
    r = t.tune_bucket(SHAPE)
    study = optuna.load_study(study_name=r.study_name, storage=t.storage)
    failed = [x for x in study.get_trials(deepcopy=False) if x.user_attrs.get("kind") == "failed"]
    assert failed and r.failures == len(failed)
    for x in failed:
        assert x.state == optuna.trial.TrialState.PRUNED
        assert "compile failed" in x.user_attrs["error"] or "carveout 100" in x.user_attrs["error"]
        assert x.user_attrs["error"].startswith(("RuntimeError: compile failed", "launch failed"))
    assert max(obj.search.values()) == 1
    assert r.config.tile_n != 32 and r.config.carveout != 100
    again = [x for x in study.get_trials(deepcopy=False) if x.user_attrs.get("kind") == "failed_before"]
    for x in again:
        assert x.state == optuna.trial.TrialState.PRUNED


def test_illegal_points_are_pruned_with_reasons():
    t = Tuner("decode", ModelledObjective(seed=0), options=opts(n_trials=10))
    r = t.tune_bucket(SHAPE)
    study = optuna.load_study(study_name=r.study_name, storage=t.storage)
    illegal = [x for x in study.get_trials(deepcopy=False) if x.user_attrs.get("kind") == "illegal"]
    for x in illegal:
        assert x.state == optuna.trial.TrialState.PRUNED and x.user_attrs["problems"]


def test_all_failing_stops_early():
    obj = ModelledObjective(seed=0, fail=lambda cfg, shape: "GQA group must divide the rows")
    r = Tuner("decode", obj, options=opts(n_trials=40, max_consecutive_failures=5)).tune_bucket(SHAPE)
    assert r.status == "failed" and r.config is None and r.trials == 5
    assert "GQA group must divide" in r.err


def test_fatal_failure_aborts_and_resume_skips_it(tmp_path):
    journal = tmp_path / "j.journal"
    calls = []

    class Fatal(ModelledObjective):
        def __call__(self, cfg, shape, reps=None):
            calls.append(cfg)
            if len(calls) == 3:
                return {"ok": False, "fatal": True, "err": "CUDA error: an illegal memory access"}
            return super().__call__(cfg, shape, reps)

    with pytest.raises(TunerAbort, match="illegal memory access"):
        Tuner("decode", Fatal(seed=0), storage=journal, options=opts(n_trials=8)).tune_bucket(SHAPE)
    bad = calls[2]
    obj = Counting(ModelledObjective(seed=0))
    r = Tuner("decode", obj, storage=journal, options=opts(n_trials=8)).tune_bucket(SHAPE)
    assert r.trials == 8 and r.failures == 1
    assert SPACE.config_key(bad) not in obj.search and sum(obj.search.values()) == 8 - 3


def test_crashed_running_trial_is_recorded_on_resume(tmp_path):
    journal = tmp_path / "j.journal"
    t = Tuner("decode", ModelledObjective(seed=0), storage=journal, options=opts(n_trials=4))
    r = t.tune_bucket(SHAPE)
    # simulate a process killed while measuring: a RUNNING trial with its config recorded
    study = optuna.load_study(study_name=r.study_name, storage=t.storage)
    crashed_cfg = DecodeConfig(tile_n=64, stages=3, num_splits=2, ctas_per_sm=1, carveout=90)
    trial = study.ask()
    trial.set_user_attr("config", crashed_cfg.to_dict())
    trial.set_user_attr("kind", "running")
    obj = Counting(ModelledObjective(seed=0))
    t2 = Tuner("decode", obj, storage=journal, options=opts(n_trials=10))
    r2 = t2.tune_bucket(SHAPE)
    assert SPACE.config_key(crashed_cfg) not in obj.search
    study = optuna.load_study(study_name=r2.study_name, storage=t2.storage)
    assert study.get_trials(deepcopy=False)[trial.number].state == optuna.trial.TrialState.FAIL
    assert r2.failures == 1


def test_exhaustive_search_on_a_small_space_finds_the_model_optimum():
    class SmallSpace(DecodeSpace):
        kernel = "decode-small-test"
        params = (
            Param("tile_n", (32, 64)),
            Param("stages", (2, 3, 4)),
            Param("num_splits", (0, 1, 4)),
            Param("ctas_per_sm", (2,)),
            Param("carveout", (80, 100)),
        )

    register_space(SmallSpace(), replace=True)
    try:
        obj = Counting(ModelledObjective(seed=0, noise=0.0, kernel="decode-small-test"))
        t = Tuner("decode-small-test", obj, options=opts(n_trials=3, exhaustive_threshold=64))
        shape = TuneShape(32, 8, 128, batch=1, context=32768)
        r = t.tune_bucket(shape)
        assert r.mode == "exhaustive"
        legal = t.space.legal_configs(shape)
        assert r.trials == t.space.launch_classes(shape)  # every distinct launch measured once
        best = min(obj.inner.model_us(c, shape) for c in legal)
        assert r.p50_us == pytest.approx(best)
        assert max(obj.search.values()) == 1
    finally:
        from directkv_cute.tuning import space as space_mod

        space_mod._SPACES.pop("decode-small-test", None)


def test_profile_written_and_served_by_the_lookup(tmp_path, monkeypatch):
    hw = HardwareModel(gpu_name="Modelled Test GPU")
    out = tmp_path / "profiles"
    shapes = [TuneShape(64, 8, 128, batch=1, context=4096), TuneShape(64, 8, 128, batch=16, context=4096)]
    t = Tuner("decode", ModelledObjective(hw, seed=0), options=opts(n_trials=6), output_dir=out)
    results = t.tune(shapes)
    assert [r.status in ("tuned", "default") for r in results] == [True, True]
    path = out / "Modelled_Test_GPU.yaml"
    prof = P.load_profile(path)
    assert prof.metadata["objective"] == "model" and prof.metadata["gpu_name"] == "Modelled Test GPU"
    assert {r["kernel_hash"] for _, _, r in prof.records()} == {P.current_kernel_hash("decode")} and len(prof) == 2
    assert not prof.stale()
    rec = prof.get(("decode", "bf16", 128, 8, 64), (16, 4096, 1))
    assert rec["trials"] == 6 and rec["config"] == results[1].config.to_dict()
    assert rec["default_p50_us"] == pytest.approx(results[1].default_p50_us, abs=1e-3)

    monkeypatch.setenv(P.PROFILE_DIR_ENV, str(out))
    monkeypatch.delenv(L.REQUIRE_ENV, raising=False)
    L.clear_cache()
    try:
        cfg, source = L.select_config("decode", gpu_name="Modelled Test GPU", kernel_hash=P.current_kernel_hash("decode"),
                                      dtype="bf16", head_dim=128, group=8, page_size=64, batch=16, context=4096,
                                      q_len=1, rows=8)
        assert (cfg, source) == (results[1].config, "exact")
    finally:
        L.clear_cache()

    # a second run seeds its search with the profile's config and merges into the file
    t2 = Tuner("decode", ModelledObjective(hw, seed=1), options=opts(n_trials=4, seed=1), output_dir=out)
    t2.tune([TuneShape(64, 8, 128, batch=4, context=4096)])
    assert len(P.load_profile(path)) == 3


def test_time_budget_skips_buckets():
    shapes = [TuneShape(32, 8, 128, batch=b, context=4096) for b in (1, 4, 16)]
    t = Tuner("decode", ModelledObjective(seed=0), options=opts(n_trials=5, time_budget_s=1e-9))
    results = t.tune(shapes)
    assert all(isinstance(r, BucketResult) for r in results)
    assert [r.status for r in results] == ["skipped"] * 3
    assert "skipped" in format_results(results)


def test_q_tiled_search_starts_with_default_then_portfolio_and_finds_the_models_best():
    """The q_tiled tuner measures QTiledConfig() first, then the space's portfolio (one CTA per
    query tile, 64-token tiles), then TPE; searched exhaustively on the model it finds the model's
    optimum."""
    from directkv_cute.config import QTiledConfig
    from directkv_cute.tuning.objectives import QTiledModel

    space = get_space("q_tiled")
    shape = TuneShape(32, 8, 128, batch=1, context=32768, q_len=2048)
    model = ModelledObjective(seed=0, kernel="q_tiled", q_tiled=QTiledModel(pingpong_sync_us=0.5))
    t = Tuner("q_tiled", model, options=opts(n_trials=5, exhaustive_threshold=0))
    r = t.tune_bucket(shape)
    study = optuna.load_study(study_name=r.study_name, storage=t.storage)
    first = [tr.user_attrs["config"] for tr in study.get_trials(deepcopy=False)[:3]]
    assert first == [QTiledConfig().to_dict(), QTiledConfig(cluster=1).to_dict(),
                     QTiledConfig(tile_n=64, stages=4).to_dict()]
    assert r.mode == "tpe" and r.trials == 5 and r.status in ("tuned", "default") and r.speedup >= 1.0

    full = Tuner("q_tiled", model, options=opts()).tune_bucket(shape)
    legal = space.legal_configs(shape)
    assert full.mode == "exhaustive" and full.trials == len(legal)
    best = min(model.model_us(c, shape) for c in legal)
    assert model.model_us(full.config, shape) <= best * 1.05
    assert full.config.pingpong == 0 and "pg0" in format_results([full], kernel="q_tiled")


def test_the_q_tiled_model_is_a_documented_roofline():
    """The model's time is at least the FLOPs at the tensor-core rate of every SM, grows with the
    context and the query rows, and shows each knob's mechanism (tile overhead, ring depth,
    pingpong, cluster) deterministically."""
    from directkv_cute.config import QTiledConfig

    m = ModelledObjective(seed=0, kernel="q_tiled")
    shape = TuneShape(32, 8, 128, batch=1, context=32768, q_len=8192)
    t = m.model_us(QTiledConfig(), shape)
    keys = sum(shape.context - shape.q_len + j + 1 for j in range(shape.q_len))
    flops = 4 * shape.num_q_heads * shape.head_dim * keys
    assert t >= flops / (m.hw.sm_count * m.hw.sm_tflops * 1e6)
    assert t == m.model_us(QTiledConfig(), shape) and m(QTiledConfig(), shape) == m(QTiledConfig(), shape)
    assert m.model_us(QTiledConfig(), TuneShape(32, 8, 128, 1, 131072, 8192)) > 3 * t
    assert m.model_us(QTiledConfig(), TuneShape(96, 8, 128, 1, 32768, 8192)) > 2.5 * t
    assert m.model_us(QTiledConfig(pingpong=0), shape) > t
    assert m.model_us(QTiledConfig(tile_n=64, stages=4), shape) > t  # twice the per-tile overhead
    slow_loads = ModelledObjective(seed=0, kernel="q_tiled", q_tiled=m.q_tiled.__class__(load_latency_us=8.0))
    assert slow_loads.model_us(QTiledConfig(stages=2), shape) > slow_loads.model_us(QTiledConfig(), shape)  # ring depth
    slow_feed = ModelledObjective(seed=0, kernel="q_tiled", q_tiled=m.q_tiled.__class__(sm_feed_gbps=20.0))
    assert slow_feed.model_us(QTiledConfig(cluster=1), shape) > slow_feed.model_us(QTiledConfig(), shape)
    assert m.model_us(QTiledConfig(carveout=100), shape) == m.model_us(QTiledConfig(tile_n=128, stages=3), shape)
    bad = m(QTiledConfig(stages=4), shape)
    assert not bad["ok"] and "per-block" in bad["err"]


def test_precompile_compiles_what_the_run_measures_first_once_per_class(monkeypatch):
    """Tuner.precompile: per compile class (dtype, head dim, GQA group, page size) the first
    n_trials legal seeds of a TPE bucket, every legal config of an exhaustive one; each once."""
    from directkv_cute.config import QTiledConfig

    space = get_space("q_tiled")
    calls = []
    monkeypatch.setattr(space, "compile_for", lambda cfg, shape: calls.append((cfg, shape.class_key)))
    shapes = [TuneShape(32, 8, 128, 1, c, q) for c in (8192, 32768) for q in (512, 2048)]
    shapes.append(TuneShape(64, 8, 128, 1, 8192, 512, page_size=16))
    t = Tuner("q_tiled", ModelledObjective(seed=0, kernel="q_tiled"), options=opts(n_trials=2, exhaustive_threshold=0))
    n, fails = t.precompile(shapes, 1)
    assert (n, fails) == (4, [])
    assert calls == [(QTiledConfig(), ("bf16", 128, 4, 64)), (QTiledConfig(cluster=1), ("bf16", 128, 4, 64)),
                     (QTiledConfig(), ("bf16", 128, 8, 16)), (QTiledConfig(cluster=1), ("bf16", 128, 8, 16))]
    calls.clear()
    t = Tuner("q_tiled", ModelledObjective(seed=0, kernel="q_tiled"), options=opts())  # exhaustive: 104 legal
    assert t.precompile(shapes[:2], 1) == (len(space.legal_configs(shapes[0])), [])
    assert len(calls) == len(set(calls)) == len(space.legal_configs(shapes[0]))


def test_precompile_in_worker_processes_reports_failures(monkeypatch):
    """With jobs > 1 the compiles run in spawned processes; a config that does not compile is
    reported (its trial fails later as usual), the others are not."""
    from directkv_cute.config import QTiledConfig

    shape = TuneShape(32, 8, 128, 1, 8192, 512)
    t = Tuner("q_tiled", ModelledObjective(seed=0, kernel="q_tiled"), options=opts())
    monkeypatch.setattr(t, "precompile_plan", lambda shapes: [(QTiledConfig(tile_n=32), shape),
                                                              (QTiledConfig(stages=4), shape)])
    n, fails = t.precompile([shape], 2)
    assert n == 2 and len(fails) == 2
    assert "tile_n 32 must be 64 or 128" in fails[0] and "per-block limit" in fails[1] and "q_len=512" in fails[0]
    assert "no compile hook" not in " ".join(fails)
