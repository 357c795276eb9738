"""The GPU-free host-traffic check: it passes on the real plan and catches broken schedules."""

from __future__ import annotations

import pytest

import directkv_cute.plan as plan
from bench.check import ROWS, CheckError, default_targets, run_check
from bench.traffic import (TrafficCase, check_case, default_cases, expected_bytes, format_traffic_table,
                           run_traffic_check)


def test_real_plan_reads_every_host_byte_once():
    results = run_traffic_check()
    assert len(results) > 500
    failed = [r for r in results if not r.ok]
    assert not failed, failed[0].problems
    table = format_traffic_table(results)
    assert table.splitlines()[-1] == f"traffic check: {len(results)}/{len(results)} cases pass"
    assert "page" in table.splitlines()[0] and "FAIL" not in table


def test_grid_covers_the_interesting_cases():
    cases = default_cases()
    assert {c.page_size for c in cases} == {16, 32, 64, 128}
    assert {c.tile_n for c in cases} >= {16, 32, 64, 128, 256}
    assert any(c.tile_n < c.page_size for c in cases) and any(c.tile_n > c.page_size for c in cases)
    assert any(c.num_splits > 64 for c in cases)  # more splits than tiles: empty CTAs
    assert {c.hbm_fraction for c in cases} >= {0.0, 0.5, 1.0}
    assert any(n % c.page_size for c in cases for n in c.seq_lens)  # ragged lengths


def test_expected_bytes_by_hand():
    row = 2 * 128 * 2 * 2  # K and V, d=128, bf16, 2 KV heads
    # 100 tokens, page 64 (2 pages), tile 16: read to 112 -> 64 + 48 tokens
    assert expected_bytes(TrafficCase((100,), 64, 16, 1)) == (112 * row, 0)
    # tile 256 > page: capped at the 2 allocated pages = 128 tokens
    assert expected_bytes(TrafficCase((100,), 64, 256, 1)) == (128 * row, 0)
    # second page in HBM ("recent", half the pages)
    assert expected_bytes(TrafficCase((100,), 64, 16, 1, hbm_fraction=0.5, placement="recent")) == \
        (64 * row, 48 * row)


def _broken(monkeypatch, fn):
    monkeypatch.setattr(plan, "split_range", fn)
    return [r for r in run_traffic_check() if not r.ok]


def test_overlapping_splits_fail(monkeypatch):
    orig = plan.split_range

    def overlap(n_tiles, num_splits, split):
        start, stop = orig(n_tiles, num_splits, split)
        return start, min(n_tiles, stop + 1)  # every split also reads its neighbour's first tile

    failed = _broken(monkeypatch, overlap)
    assert failed
    problems = " ".join(p for r in failed for p in r.problems)
    assert "read by more than one CTA" in problems and "read twice" in problems
    assert any(r.host_bytes > r.expected_host for r in failed)
    assert "FAIL" in format_traffic_table(failed)


def test_gaps_fail(monkeypatch):
    orig = plan.split_range

    def gap(n_tiles, num_splits, split):
        start, stop = orig(n_tiles, num_splits, split)
        return start, max(start, stop - 1) if split == 0 else stop  # split 0 drops its last tile

    failed = _broken(monkeypatch, gap)
    assert failed and any("never read" in p for r in failed for p in r.problems)


def test_double_counted_bytes_fail(monkeypatch):
    orig = plan.decode_traffic

    def double(*args, **kwargs):
        host, hbm = orig(*args, **kwargs)
        return 2 * host, hbm

    monkeypatch.setattr(plan, "decode_traffic", double)
    res = check_case(TrafficCase((300, 17), 16, 64, 3))
    assert not res.ok and "host bytes" in res.problems[0]


def test_check_command_exit_status(monkeypatch, tmp_path, capsys):
    assert run_check(profiles=False, compile=False, traffic=True, progress=False) == 0
    assert "PASS  traffic" in capsys.readouterr().out
    orig = plan.split_range
    monkeypatch.setattr(plan, "split_range", lambda n, s, i: (orig(n, s, i)[0], min(n, orig(n, s, i)[1] + 1)))
    assert run_check(profiles=False, compile=False, traffic=True, progress=False) == 1
    assert "FAIL  traffic" in capsys.readouterr().out


def test_check_profiles_part(tmp_path, capsys):
    assert run_check(profiles=True, compile=False, traffic=False, profile_dir=tmp_path, progress=False) == 0
    assert "no profiles" in capsys.readouterr().out
    (tmp_path / "NVIDIA_H200.yaml").write_text("schema_version: 1\nentries: [oops\n")
    assert run_check(profiles=True, compile=False, traffic=False, profile_dir=tmp_path, progress=False) == 1
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.full
def test_compile_part_fails_clearly_without_the_kernel(monkeypatch, capsys):
    import bench.check as check

    def missing():
        raise CheckError("the decode kernel cannot be compiled: directkv_cute.kernels.decode: ImportError: x")

    monkeypatch.setattr(check, "resolve_compiler", missing)
    assert run_check(profiles=False, compile=True, traffic=False, progress=False, q_tiled=False) == 1
    assert "cannot be compiled" in capsys.readouterr().out


def test_portfolio_compile_targets_are_the_tuners_portfolio():
    from bench.check import portfolio_targets
    from directkv_cute.tuning.space import get_space

    targets = portfolio_targets()
    assert targets and all(t.multi_token and t.source == "portfolio" for t in targets)
    assert [t.cfg for t in targets] == get_space("multi_token").portfolio(None)
    for t in targets:
        assert t.cfg.is_legal(t.head_dim, t.page_size), t.label


def test_default_compile_targets_are_legal():
    targets = default_targets(("bfloat16", "float16"))
    prefill = 2 * 2  # head dims x GQA 4 / 8 (one multi-token default for every row count)
    assert len([t for t in targets if t.dtype == "bfloat16"]) == 2 * len(ROWS) * 4 + prefill
    assert len([t for t in targets if t.dtype == "float16"]) == 2 * 2 + prefill
    assert {(t.cfg.tile_n, t.cfg.max_inflight, t.cfg.link_credits > 0)
            for t in targets if t.multi_token} == {(64, 1, True)}
    for t in targets:
        assert t.cfg.is_legal(t.head_dim, t.page_size), t.label
        assert t.group * t.max_q_len <= t.cfg.rows and t.cfg.rows % t.group == 0


def test_multi_token_split_counts_are_in_the_grid():
    """The multi-token kernel's split counts (one chunk per CTA, and a wave of CTAs walking
    several chunks) are checked by CI; the single-chunk count never hands a CTA more tiles than
    its ring, the walking count never more CTAs than one wave."""
    from bench.traffic import SEQ_SETS, default_cases, multi_token_splits_for
    from directkv_cute.plan import split_range

    grid = {(c.seq_lens, c.page_size, c.tile_n, c.num_splits) for c in default_cases()}
    for lens in SEQ_SETS:
        for stages, chunk in ((2, 0), (6, 0), (6, 3)):
            splits = multi_token_splits_for(lens, 64, 64, stages, chunk)
            assert (tuple(lens), 64, 64, splits) in grid
            if chunk == 0:
                for n in lens:
                    tiles = -(-n // 64)
                    assert all(b - a <= stages for a, b in (split_range(tiles, splits, s) for s in range(splits)))
            else:
                assert splits * len(lens) * 2 <= max(132, len(lens) * 2)

def test_split_summary_never_cuts_a_number():
    from bench.traffic import split_summary

    assert split_summary({4, 1, 2}) == "1,2,4"
    many = set(range(1, 66, 5))
    text = split_summary(many)
    assert text == "1..61 (13 counts)"
    assert len(split_summary(set(range(1, 200)))) <= 28


def test_steps_through_the_window_read_only_the_history_from_the_host():
    from bench.traffic import run_step_traffic_check

    results = run_step_traffic_check()
    assert results and all(r.ok for r in results), [r.problems for r in results if not r.ok][:3]
    assert all(r.host_bytes == r.expected_host and r.hbm_bytes > 0 for r in results)
    assert "cases pass" in format_traffic_table(results)


def test_step_traffic_check_fails_without_mirrors(monkeypatch):
    from bench.traffic import check_step_case, default_step_cases
    from directkv_cute.cache import PagedKVCache

    monkeypatch.setattr(PagedKVCache, "mirror", lambda self, sid, start, n: 0)
    r = check_step_case(default_step_cases()[0])
    assert not r.ok and "host bytes" in r.problems[0] and r.host_bytes > r.expected_host
