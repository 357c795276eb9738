"""CPU tests of the regression comparison and the baseline refresh (two JSON dicts in)."""

from __future__ import annotations

import copy

import pytest

from bench.__main__ import main
from bench.common import GB, Ceilings, Shape, add_check, load_json, make_record, new_results, write_json
from bench.regress import (RefreshRefused, compare, format_report, is_regression, refresh_baseline,
                           tracked_ratios)

CEIL = Ceilings(host_read_gbps=50.0, hbm_read_gbps=4000.0, memcpy_h2d_gbps=54.0)
HEADER = {"gpu": "NVIDIA H200", "gpu_key": "NVIDIA_H200", "date": "2026-11-29", "versions": {}}
SHAPES = [Shape("decode", 1, 32768, 1, 32, 8, 128, "bfloat16"), Shape("decode", 16, 32768, 1, 32, 8, 128, "bfloat16"),
          Shape("prefill", 1, 32768, 512, 32, 8, 128, "bfloat16")]


def _ideal(shape: Shape) -> float:
    return shape.kv_bytes / (CEIL.host_read_gbps * GB) * 1e3


def make_run(frac: float = 0.98, zero_copy_x: float = 1.05, scale: dict | None = None) -> dict:
    """A results document: per shape ours at ideal / frac (``scale`` multiplies ours' time on
    the chosen shape indices) and zero_copy ``zero_copy_x`` times that (30x more on prefill)."""
    doc = new_results("all", HEADER, CEIL, args={"preset": "quick", "benches": ["decode", "prefill"]})
    for i, s in enumerate(SHAPES):
        ideal = _ideal(s)
        ours_ms = ideal / frac * (scale or {}).get(i, 1.0)
        zc_ms = ideal / frac * zero_copy_x * (30.0 if s.bench == "prefill" else 1.0)
        doc["records"].append(make_record(s, "zero_copy", zc_ms, CEIL, host_bytes=s.kv_bytes).to_dict())
        doc["records"].append(make_record(s, "ours", ours_ms, CEIL, host_bytes=s.kv_bytes).to_dict())
        add_check(doc, s, "ours", True, rel_err=1e-3, against="fp32 anchor")
    return doc


def test_tracked_ratios():
    ratios = tracked_ratios(make_run(frac=0.98, zero_copy_x=1.05))
    assert len(ratios) == 3
    r = ratios["decode/ours/B1/ctx32768/q1/32x8/d128/bfloat16/hbm0.00"]
    assert r["frac_of_ceiling"] == pytest.approx(0.98)
    assert r["speedup_vs_zero_copy"] == pytest.approx(1.05)
    assert ratios["prefill/ours/B1/ctx32768/q512/32x8/d128/bfloat16/hbm0.00"]["speedup_vs_zero_copy"] == \
        pytest.approx(31.5)


@pytest.mark.parametrize("base", [0.1, 0.5, 0.98, 1.0, 1.05, 31.5, 400.0])
def test_a_five_percent_drop_is_caught_and_one_percent_is_not(base):
    assert is_regression(base, base * 0.95)
    assert not is_regression(base, base * 0.99)
    assert not is_regression(base, base * 1.5)


@pytest.mark.parametrize("shape_index", [0, 1, 2])
def test_five_percent_slower_ours_fails(shape_index):
    base = make_run()
    fresh = make_run(scale={shape_index: 1 / 0.95})  # ours 5.3% slower: every ratio drops 5%
    report = compare(base, fresh)
    assert not report.ok
    assert len(report.regressions) == 3
    assert {r.ratio for r in report.regressions} == {"frac_of_ceiling", "speedup_vs_zero_copy", "frac_of_memcpy"}
    text = format_report(report)
    assert "REGRESSED" in text and text.splitlines()[-1].startswith("FAIL")


def test_faster_zero_copy_alone_regresses_the_speedup():
    report = compare(make_run(zero_copy_x=1.05), make_run(zero_copy_x=1.05 * 0.94))
    assert [r.ratio for r in report.regressions] == ["speedup_vs_zero_copy"] * 3


def test_noise_within_tolerance_passes():
    base = make_run()
    fresh = make_run(frac=0.98 * 0.985, zero_copy_x=1.05 * 1.01)
    fresh["header"]["date"] = "2026-12-01"
    report = compare(base, fresh)
    assert report.ok, format_report(report)
    assert "PASS" in format_report(report).splitlines()[-1]


def test_improvements_pass_and_are_reported():
    report = compare(make_run(frac=0.80), make_run(frac=0.98))
    assert report.ok
    assert any(r.status == "improved" for r in report.rows)


def test_missing_records_are_reported_and_fail():
    base, fresh = make_run(), make_run()
    fresh["records"] = [r for r in fresh["records"] if not (r["method"] == "ours" and r["batch"] == 16)]
    report = compare(base, fresh)
    assert not report.ok
    assert {r.key for r in report.missing} == {"decode/ours/B16/ctx32768/q1/32x8/d128/bfloat16/hbm0.00"}
    assert "MISSING" in format_report(report)
    assert compare(base, fresh, allow_missing=True).ok


def test_unmeasured_ours_counts_as_missing():
    base, fresh = make_run(), make_run()
    rec = next(r for r in fresh["records"] if r["method"] == "ours" and r["bench"] == "prefill")
    rec.update(ms=None, gbps=None, frac_of_ceiling=None)
    report = compare(base, fresh)
    assert len(report.missing) == 3 and not report.ok


def test_new_records_do_not_fail():
    base, fresh = make_run(), make_run()
    base["records"] = base["records"][:4]
    report = compare(base, fresh)
    assert report.ok and sum(r.status == "new" for r in report.rows) == 3


def test_a_fresh_run_with_failed_checks_fails():
    base, fresh = make_run(), make_run()
    add_check(fresh, SHAPES[0], "ours", False, rel_err=0.3, against="fp32 anchor")
    report = compare(base, fresh)
    assert not report.ok and any("correctness" in p for p in report.problems)


def test_another_gpu_is_not_comparable():
    fresh = make_run()
    fresh["header"]["gpu_key"] = "NVIDIA_H100"
    assert not compare(make_run(), fresh).ok


def test_refresh_refuses_a_failing_run(tmp_path):
    doc = make_run()
    add_check(doc, SHAPES[1], "zero_copy", False, rel_err=1.0, against="fp32 anchor")
    with pytest.raises(RefreshRefused, match="correctness"):
        refresh_baseline(doc, tmp_path)
    assert not list(tmp_path.iterdir())
    nothing = make_run()
    nothing["records"] = [r for r in nothing["records"] if r["method"] != "ours"]
    with pytest.raises(RefreshRefused, match="no measured"):
        refresh_baseline(nothing, tmp_path)


def test_refresh_writes_a_passing_run(tmp_path):
    path = refresh_baseline(make_run(), tmp_path, source="run.json")
    assert path == tmp_path / "NVIDIA_H200.json"
    assert load_json(path)["baseline_source"] == "run.json"
    assert compare(load_json(path), make_run()).ok


def test_cli_refresh_and_regress(tmp_path, capsys):
    good, bad, slow = make_run(), make_run(), make_run(scale={1: 1.06})
    add_check(bad, SHAPES[0], "ours", False, rel_err=0.2, against="fp32 anchor")
    files = {name: write_json(tmp_path / f"{name}.json", doc) for name, doc in
             (("good", good), ("bad", bad), ("slow", slow))}
    bdir = tmp_path / "baselines"
    assert main(["refresh", "--results", str(files["bad"]), "--baseline-dir", str(bdir)]) == 1
    assert "refresh refused" in capsys.readouterr().err
    assert main(["refresh", "--results", str(files["good"]), "--baseline-dir", str(bdir)]) == 0
    assert main(["regress", "--results", str(files["good"]), "--baseline-dir", str(bdir)]) == 0
    assert main(["regress", "--results", str(files["slow"]), "--baseline-dir", str(bdir)]) == 1
    out = capsys.readouterr().out
    assert "REGRESSED" in out and "B16" in out
    assert main(["regress", "--results", str(files["good"]), "--baseline-dir", str(tmp_path / "none")]) == 2


def test_compare_does_not_modify_its_inputs():
    base, fresh = make_run(), make_run(scale={0: 1.2})
    before = copy.deepcopy((base, fresh))
    compare(base, fresh)
    assert (base, fresh) == before


def test_sub_millisecond_records_report_drops_as_noisy():
    """Below min_ms (host launch cost dominates) a drop is shown but does not gate; with the gate
    lowered it fails again, so the flag cannot hide a real regression on larger shapes."""
    small = Shape("decode", 1, 1024, 1, 32, 8, 128, "bfloat16")  # ideal ~0.02 ms
    base, fresh = make_run(), make_run()
    for doc, slow in ((base, 1.0), (fresh, 1 / 0.8)):
        ms = _ideal(small) / 0.9 * slow
        doc["records"].append(make_record(small, "zero_copy", ms * 1.2 / slow, CEIL, host_bytes=small.kv_bytes).to_dict())
        doc["records"].append(make_record(small, "ours", ms, CEIL, host_bytes=small.kv_bytes).to_dict())
        add_check(doc, small, "ours", True, rel_err=1e-3, against="fp32 anchor")
    report = compare(base, fresh)
    assert report.ok and {r.status for r in report.rows if "ctx1024" in r.key} == {"noisy"}
    assert "noisy" in format_report(report)
    strict = compare(base, fresh, min_ms=0.0)
    assert not strict.ok and all("ctx1024" in r.key for r in strict.regressions)


def test_multi_run_baseline_uses_medians_and_spread(tmp_path):
    """Two baseline runs whose first shape differs by 8%: that ratio's tolerance widens to its
    spread, the steady shapes keep the 3% gate, and the stored value is the median."""
    a, b = make_run(), make_run(scale={0: 1 / 0.92})
    path = refresh_baseline(a, tmp_path, source="a, b", more_runs=[b])
    base = load_json(path)
    assert base["baseline_runs"] == 2
    key0 = "decode/ours/B1/ctx32768/q1/32x8/d128/bfloat16/hbm0.00"
    assert base["spread"][key0]["frac_of_ceiling"] == pytest.approx(0.08 / 0.96, rel=1e-6)
    assert base["tracked"][key0]["frac_of_ceiling"] == pytest.approx(0.98 * 0.96)
    # 5% below the median on the noisy shape: within its spread
    assert compare(base, make_run(scale={0: 1 / (0.96 * 0.95)})).ok
    # 5% down on a steady shape: still caught
    report = compare(base, make_run(scale={1: 1 / 0.95}))
    assert not report.ok and all("B16" in r.key for r in report.regressions)


def test_multi_run_refresh_refuses_a_failing_or_foreign_run(tmp_path):
    bad = make_run()
    add_check(bad, SHAPES[0], "ours", False, rel_err=1.0, against="fp32 anchor")
    with pytest.raises(RefreshRefused):
        refresh_baseline(make_run(), tmp_path, more_runs=[bad])
    other = make_run()
    other["header"] = dict(other["header"], gpu_key="NVIDIA_H100")
    with pytest.raises(RefreshRefused):
        refresh_baseline(make_run(), tmp_path, more_runs=[other])


def test_memcpy_ratio_gates_ours_when_the_other_ratios_are_noisy(tmp_path):
    """Two baseline runs where the SM-read ceiling and zero-copy moved (not ours): those ratios get
    wide tolerances, but a 5% slower kernel is still caught through frac_of_memcpy."""
    a = make_run()
    b = make_run(frac=0.98, zero_copy_x=0.9)  # zero-copy 14% faster on that machine, ours unchanged
    base = load_json(refresh_baseline(a, tmp_path, more_runs=[b]))
    assert compare(base, a).ok and compare(base, b).ok
    report = compare(base, make_run(scale={1: 1 / 0.95}))
    flagged = {r.ratio for r in report.regressions}
    assert "frac_of_memcpy" in flagged and "speedup_vs_zero_copy" not in flagged


def test_regress_replays_separately_made_runs_each_with_its_own_arguments(tmp_path, monkeypatch, capsys):
    """A baseline merged from a decode run and a prefill run made with different options (here
    ``hbm_fractions``) keeps each run's arguments, and ``bench regress`` replays each bench with
    its own (replaying only the first run's bench would leave every prefill record missing)."""
    import argparse

    import bench.__main__ as cli
    from bench.common import merge_results

    full = make_run()

    def part(bench, fractions):
        doc = new_results(bench, HEADER, CEIL, args={"preset": "quick", "hbm_fractions": fractions,
                                                     "benches": [bench]})
        doc["records"] = [r for r in full["records"] if r["bench"] == bench]
        doc["checks"] = [c for c in full["checks"] if c["bench"] == bench]
        return doc

    decode, prefill = part("decode", None), part("prefill", [0.0, 1.0])
    merged = merge_results("all", [decode, prefill])
    assert merged["args"]["benches"] == ["decode", "prefill"]
    assert merged["args"]["per_bench"]["prefill"]["hbm_fractions"] == [0.0, 1.0]
    assert merged["args"]["per_bench"]["decode"]["hbm_fractions"] is None
    # merging a merged run again keeps the per-bench arguments
    again = merge_results("all", [merged])
    assert again["args"]["per_bench"] == merged["args"]["per_bench"]
    bdir = tmp_path / "baselines"
    assert main(["refresh", "--results", str(write_json(tmp_path / "m.json", merged)), "--baseline-dir", str(bdir)]) == 0

    calls = []

    def fake_fresh_run(ns: argparse.Namespace, benches):
        calls.append((list(benches), ns.hbm_fractions))
        return {"decode": decode, "prefill": prefill}[benches[0]]

    monkeypatch.setattr(cli, "_fresh_run", fake_fresh_run)
    monkeypatch.setattr("bench.common.env_info", lambda device: {"gpu_key": "NVIDIA_H200"})
    assert main(["regress", "--baseline-dir", str(bdir), "--device", "cpu"]) == 0
    assert calls == [(["decode"], None), (["prefill"], [0.0, 1.0])]
    assert " 0 MISSING" in capsys.readouterr().out
    # the old replay (the first run's arguments for every bench) would have missed the prefill records
    calls.clear()
    baseline = load_json(bdir / "NVIDIA_H200.json")
    del baseline["args"]["per_bench"]
    write_json(bdir / "NVIDIA_H200.json", baseline)
    main(["regress", "--baseline-dir", str(bdir), "--device", "cpu"])
    assert calls == [(["decode", "prefill"], None)]


def test_fa4_limit_ratio_tracks_ours_against_max_of_floor_and_fa4():
    """frac_of_fa4_limit = max(floor, fa4[hbm]) / ours where the run has FA4; a drop of ours
    against it regresses, and runs without FA4 have no such row."""
    from bench.regress import tracked_ratios

    shape = Shape("prefill", 1, 32768, 8192, 32, 8, 128, "bfloat16")

    def run(ours_ms):
        doc = make_run()
        for method, ms in (("floor", 2.6), ("fa4[hbm]", 5.5), ("ours", ours_ms)):
            doc["records"].append(make_record(shape, method, ms, CEIL, host_bytes=shape.kv_bytes).to_dict())
        add_check(doc, shape, "ours", True, rel_err=1e-3, against="fp32 anchor")
        return doc

    base, slow = run(6.6), run(7.2)
    key = next(k for k in tracked_ratios(base) if "ctx32768/q8192" in k)
    assert tracked_ratios(base)[key]["frac_of_fa4_limit"] == pytest.approx(5.5 / 6.6)
    report = compare(base, slow)
    assert not report.ok and [r.ratio for r in report.regressions if "q8192" in r.key].count("frac_of_fa4_limit") == 1
    plain = make_run()
    assert all(r.ratio != "frac_of_fa4_limit" for r in compare(plain, plain).rows)
