"""CPU tests of ``bench breakdown``: the summary of profiler activities and the CLI without a GPU
(the GPU run itself is ``python -m bench breakdown``)."""

from __future__ import annotations

import pytest

from bench.__main__ import main
from bench.breakdown import format_breakdown, summarize_events


def _two_calls():
    # per call: a copy, the attention kernel, the combine; gaps 1.5 / 1.0 / 2.0 us; calls 800 us apart
    evs = []
    for c in range(2):
        t0 = c * 800.0
        evs += [(t0, t0 + 0.8, "Memcpy HtoD"), (t0 + 2.3, t0 + 720.3, "attention"), (t0 + 721.3, t0 + 740.3, "combine")]
    return evs


def test_summary_counts_durations_and_gaps():
    res = summarize_events(list(reversed(_two_calls())), calls=2)  # any order in
    acts = {a["name"]: a for a in res["activities"]}
    assert [a["name"] for a in res["activities"]] == ["Memcpy HtoD", "attention", "combine"]
    assert acts["attention"]["count"] == 2 and acts["attention"]["per_call"] == 1.0
    assert acts["attention"]["median_us"] == pytest.approx(718.0)
    assert acts["attention"]["gap_before_median_us"] == pytest.approx(1.5)
    assert acts["combine"]["gap_before_median_us"] == pytest.approx(1.0)
    # the copy's first run has no predecessor; its second follows the first call's combine
    assert acts["Memcpy HtoD"]["gap_before_median_us"] == pytest.approx(800.0 - 740.3)
    assert res["span_us_per_call"] == pytest.approx((800.0 + 740.3) / 2)


def test_overlapping_activities_leave_no_negative_gap():
    res = summarize_events([(0.0, 100.0, "a"), (10.0, 20.0, "b"), (30.0, 40.0, "c"), (105.0, 110.0, "d")], calls=1)
    gaps = {a["name"]: a["gap_before_median_us"] for a in res["activities"]}
    assert gaps == {"a": None, "b": 0.0, "c": 0.0, "d": pytest.approx(5.0)}  # d waits for a, the longest


def test_empty_and_bad_input():
    assert summarize_events([], calls=3) == {"calls": 3, "span_us_per_call": 0.0, "activities": []}
    with pytest.raises(ValueError, match="calls"):
        summarize_events(_two_calls(), calls=0)


def test_format_lists_every_activity():
    res = {"config": None, "op_us": 751.2, "timed_calls": 20, **summarize_events(_two_calls(), calls=2)}
    text = format_breakdown(res)
    assert "op 751.2 us per call" in text and "GPU span 770.1 us" in text
    for name in ("Memcpy HtoD", "attention", "combine"):
        assert name in text
    assert "718.0" in text and "19.0" in text


def test_cli_needs_a_gpu(capsys, monkeypatch):
    from bench.common import NO_GPU

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert main(["breakdown", "--context", "4096", "--q-len", "64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(NO_GPU) and "bench breakdown needs CUDA (it has no CPU run)" in err


def test_last_call_lists_the_final_calls_activities_from_its_start():
    last = summarize_events(_two_calls(), calls=2)["last_call"]
    assert [e["name"] for e in last] == ["Memcpy HtoD", "attention", "combine"]
    assert last[0]["start_us"] == 0.0 and last[1]["start_us"] == pytest.approx(2.3)
    assert last[2]["end_us"] == pytest.approx(740.3)
    assert summarize_events(_two_calls()[:5], calls=2)["last_call"] == []  # calls launched different work
    assert "the last call" in format_breakdown({"config": None, "op_us": 1.0, "timed_calls": 1,
                                                **summarize_events(_two_calls(), calls=2)})


def test_timeline_refuses_what_it_cannot_stamp(capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert main(["timeline", "--kv-dtype", "fp8"]) == 2
    assert main(["timeline", "--config", '{"kernel": "q_tiled"}']) == 2
    assert "16-bit pages" in capsys.readouterr().err


def test_window_option_reaches_the_shape_spec(monkeypatch):
    """``--window`` (the query tokens' pages mirrored in HBM) is part of the spec the GPU run
    (breakdown or timeline) builds its shape from; without it the shape has none."""
    import argparse

    from bench import breakdown

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    p = argparse.ArgumentParser()
    breakdown.add_shape_arguments(p, 8192, "the default")
    assert breakdown.shape_spec(p.parse_args(["--q-len", "2048", "--window"]), "breakdown")["window"] is True
    assert breakdown.shape_spec(p.parse_args([]), "breakdown")["window"] is False
