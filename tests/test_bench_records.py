"""CPU tests of the benchmark records, result files, ceilings math, timing and tables, plus a
CPU smoke run of the whole per-shape harness (with a stand-in op, and with the real cache)."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from bench import decode, prefill
from bench.common import (GB, RECORD_FIELDS, Ceilings, Shape, Timer, add_check, format_table, lead_ms, load_json,
                          make_record, merge_results, new_results, record_key, results_path, time_calls,
                          validate_record, validate_results, write_json)
from bench.harness import BenchOptions, OursApi, footprint, num_sets, run_shapes, skip_reason
from bench.placement import hbm_page_order, hbm_pages, page_mask, tier_tokens

CEIL = Ceilings(host_read_gbps=50.0, hbm_read_gbps=4000.0, memcpy_h2d_gbps=54.0)
HEADER = {"gpu": "NVIDIA H200", "gpu_key": "NVIDIA_H200", "date": "2026-11-29", "versions": {"torch": "x"}}
SHAPE = Shape("decode", 4, 32768, 1, 32, 8, 128, "bfloat16")


def test_shape_bytes():
    assert SHAPE.group == 4
    assert SHAPE.token_bytes == 2 * 8 * 128 * 2
    assert SHAPE.kv_bytes == 4 * 32768 * 4096
    big = Shape("decode", 64, 131072, 1, 32, 8, 128, "bfloat16")
    assert big.kv_bytes == 32 * 2**30  # the brief's 32 GiB per layer


def test_record_has_exactly_the_fields():
    rec = make_record(SHAPE, "ours", 2.0, CEIL, host_bytes=SHAPE.kv_bytes).to_dict()
    assert tuple(rec) == RECORD_FIELDS
    assert validate_record(rec) == []


def test_gbps_and_fraction_of_ceiling():
    kv = SHAPE.kv_bytes
    ideal = kv / (50.0 * GB) * 1e3
    rec = make_record(SHAPE, "ours", 2 * ideal, CEIL, host_bytes=kv)
    assert rec.gbps == pytest.approx(25.0)
    assert rec.frac_of_ceiling == pytest.approx(0.5)
    # hybrid: the ideal is the slower tier, max(host / host ceiling, hbm / hbm ceiling)
    host, hbm = kv // 4, 3 * kv // 4
    expect = max(host / (50.0 * GB), hbm / (4000.0 * GB)) * 1e3
    assert CEIL.ideal_ms(host, hbm) == pytest.approx(expect)
    rec = make_record(SHAPE, "ours", expect, CEIL, host_bytes=host, hbm_bytes=hbm, hbm_fraction=0.75)
    assert rec.frac_of_ceiling == pytest.approx(1.0)
    assert rec.gbps == pytest.approx((host + hbm) / (expect * 1e-3) / GB)
    # HBM only: bounded by the HBM ceiling
    assert CEIL.ideal_ms(0, 4 * GB) == pytest.approx(1.0)


def test_missing_record_has_no_speed():
    rec = make_record(SHAPE, "ours", None, CEIL, host_bytes=SHAPE.kv_bytes).to_dict()
    assert rec["ms"] is None and rec["gbps"] is None and rec["frac_of_ceiling"] is None
    assert validate_record(rec) == []


def test_record_key_names_shape_and_method():
    a = make_record(SHAPE, "ours", 1.0, CEIL, host_bytes=1, hbm_fraction=0.25).to_dict()
    b = make_record(SHAPE, "ours", 9.0, CEIL, host_bytes=1, hbm_fraction=0.5).to_dict()
    assert record_key(a) != record_key(b)
    assert record_key(a) == "decode/ours/B4/ctx32768/q1/32x8/d128/bfloat16/hbm0.25"


def _doc():
    doc = new_results("decode", HEADER, CEIL, args={"preset": "quick"})
    for method, ms in (("zero_copy", 3.0), ("ours", 2.7), ("hbm", 0.1)):
        doc["records"].append(make_record(SHAPE, method, ms, CEIL, host_bytes=SHAPE.kv_bytes).to_dict())
    return doc


def test_results_file_round_trip_and_schema(tmp_path):
    doc = _doc()
    add_check(doc, SHAPE, "ours", True, rel_err=1e-3, against="fp32 anchor")
    path = write_json(results_path(tmp_path, HEADER, "decode"), doc)
    assert path.name == "NVIDIA_H200-2026-11-29-decode.json"
    assert not list(tmp_path.glob("*.tmp"))
    back = load_json(path)
    assert back == doc
    assert validate_results(back) == []
    assert back["passed"] is True


@pytest.mark.parametrize("breakage, expect", [
    (lambda d: d.pop("ceilings"), "missing top-level field 'ceilings'"),
    (lambda d: d["header"].pop("date"), "header lacks 'date'"),
    (lambda d: d["ceilings"].update(host_read_gbps=0), "ceiling 'host_read_gbps'"),
    (lambda d: d["records"][0].update(extra=1), "fields differ"),
    (lambda d: d["records"][0].pop("gbps"), "fields differ"),
    (lambda d: d["records"][0].update(gbps=1.0), "gbps 1.0 != bytes/time"),
    (lambda d: d["records"][0].update(batch=-1), "batch must be"),
    (lambda d: d["records"][0].update(ms=float("nan")), "ms must be"),
])
def test_schema_catches_broken_documents(breakage, expect):
    doc = _doc()
    breakage(doc)
    problems = validate_results(doc)
    assert any(expect in p for p in problems), problems


def test_failed_check_fails_the_run_and_merge_keeps_it():
    a, b = _doc(), _doc()
    add_check(b, SHAPE, "ours", False, rel_err=0.5, against="fp32 anchor")
    assert a["passed"] and not b["passed"]
    merged = merge_results("all", [a, b])
    assert merged["passed"] is False
    assert len(merged["records"]) == 6 and len(merged["checks"]) == 1
    assert validate_results(merged) == []


def test_table_printing():
    doc = _doc()
    doc["records"].append(make_record(SHAPE, "ours", None, CEIL, host_bytes=1, hbm_fraction=0.5).to_dict())
    text = format_table(doc["records"], CEIL, {"decode/B4/ctx32768/q1/32x8/d128/bfloat16|zero_copy": "fold/flash"})
    lines = text.splitlines()
    assert lines[0].startswith("ceilings: host read 50.0 GB/s")
    for col in ("method", "shape", "ms", "GB/s", "%host", "%ideal", "staging"):
        assert col in lines[1]
    assert "zero_copy[fold/flash]" in text and "missing" in text
    assert "B4 ctx32k q1 32/8 d128" in text
    ours = next(line for line in lines if line.startswith("ours ") and "missing" not in line)
    assert f"{SHAPE.kv_bytes / 2.7e-3 / GB:.1f}" in ours
    # a CPU smoke run's table (no ceilings): no ceilings line, no ceiling rows, no percentages
    doc["records"].append(make_record(SHAPE, "floor", 1.0, CEIL, host_bytes=SHAPE.kv_bytes).to_dict())
    cpu = format_table(doc["records"], None).splitlines()
    assert cpu[0].split()[:2] == ["method", "shape"] and not any(line.startswith("floor") for line in cpu)
    cpu_ours = next(line for line in cpu if line.startswith("ours ") and "missing" not in line)
    assert cpu_ours.split()[-4:-2] == ["-", "-"]  # %host, %ideal


def test_time_calls_rotates_and_takes_the_median():
    counts = [0, 0, 0]

    def make(i):
        def call():
            counts[i] += 1
        return call

    t = time_calls([make(i) for i in range(3)], Timer("cpu"), warmup=1, reps=5, min_sample_ms=0.01, max_total_s=1.0)
    assert t.inner % 3 == 0 and len(t.samples) == 5
    assert t.ms == sorted(t.samples)[2]
    assert abs(counts[0] - counts[1]) <= 2 and abs(counts[1] - counts[2]) <= 1


def test_time_calls_limits_slow_methods():
    import time as _t

    t = time_calls([lambda: _t.sleep(0.02)], Timer("cpu"), warmup=1, reps=50, max_total_s=0.05)
    assert len(t.samples) <= 3 and t.ms >= 20.0


def test_lead_covers_the_hosts_enqueue_of_a_sample():
    assert lead_ms(0.15, 3) == pytest.approx(1.5 * 0.45 + 0.5)
    assert lead_ms(0.0, 10) == 0.5
    assert lead_ms(5.0, 256) == 200.0  # capped
    with pytest.raises(ValueError):
        lead_ms(-1.0, 1)
    with pytest.raises(ValueError):
        lead_ms(0.1, 0)


def test_time_calls_starts_each_sample_behind_a_lead_for_its_host_path():
    """The timer gets a lead that covers the host path of every call in the sample: a call
    whose host path takes 2 ms asks for at least 2 ms per call of the sample."""
    import time as _t

    class Recording(Timer):
        def __init__(self):
            super().__init__("cpu")
            self.leads = []

        def measure(self, work, lead_ms=0.0):
            self.leads.append(lead_ms)
            return super().measure(work, lead_ms)

    timer = Recording()
    t = time_calls([lambda: _t.sleep(0.002)], timer, warmup=1, reps=2, min_sample_ms=5.0, max_total_s=1.0)
    assert t.inner >= 2 and len(timer.leads) == 1 + len(t.samples)
    assert timer.leads[0] >= 1.5 * 2.0 and all(lead >= 1.5 * 2.0 * t.inner for lead in timer.leads[1:])


@pytest.mark.gpu
def test_time_calls_charges_device_time_not_the_hosts_launch_latency():
    """A call with 1 ms of host path and a few µs of GPU work times at its GPU work: the lead
    lets the host enqueue the sample before the start event. Without it a sample would be
    host-bound at >= 1 ms per call."""
    import time as _t

    import torch

    x = torch.empty(1 << 20, device="cuda")

    def call():
        _t.sleep(0.001)
        x.fill_(1.0)

    t = time_calls([call], Timer("cuda"), warmup=1, reps=3, min_sample_ms=0.05, max_total_s=1.0)
    assert t.inner >= 2 and t.ms < 0.2, t


def test_presets():
    full = decode.shapes("full")
    assert len(full) == 4 * 6 * 2
    assert {(s.hq, s.hkv) for s in full} == {(32, 8), (64, 8)}
    assert all(s.q_len == 1 and s.head_dim == 128 and s.dtype == "bfloat16" for s in full)
    assert [s.kv_bytes for s in full] == sorted(s.kv_bytes for s in full)
    quick = decode.shapes("quick")
    assert 4 <= len(quick) < len(full)
    custom = decode.shapes("quick", batches=[2], contexts=[100, 200], heads=[(4, 2)])
    assert [(s.batch, s.context, s.hq) for s in custom] == [(2, 100, 4), (2, 200, 4)]
    pf = prefill.shapes("full")
    assert len(pf) == 5 * 5 and {s.q_len for s in pf} == {16, 64, 512, 2048, 8192}
    assert all(s.q_len <= s.context for s in pf)


def test_skip_and_footprint():
    opts = BenchOptions(device="cpu", hbm_fractions=(0.0, 0.75), max_gb=16)
    big = Shape("decode", 64, 131072, 1, 32, 8, 128, "bfloat16")
    assert "--max-gb" in skip_reason(big, opts)
    assert num_sets(big, opts) == 1
    host, gpu = footprint(big, opts)
    assert host == big.kv_bytes and gpu == 2 * big.kv_bytes
    small = Shape("decode", 1, 4096, 1, 32, 8, 128, "bfloat16")
    assert num_sets(small, opts) == 8  # 16 MiB per set: rotate through 128 MiB
    assert skip_reason(Shape("prefill", 1, 100, 200, 4, 2, 64, "bfloat16"), opts).startswith("q_len")


def test_placements_are_nested_and_exact():
    for placement in ("spread", "recent", "oldest"):
        order = hbm_page_order(37, placement)
        assert sorted(order) == list(range(37))
        prev = set()
        for f in (0.0, 0.25, 0.5, 0.75, 1.0):
            cur = hbm_pages(37, f, placement)
            assert len(cur) == math.floor(f * 37 + 0.5) and prev <= cur
            prev = cur
    spread = hbm_pages(100, 0.25, "spread")
    assert all(any(p in spread for p in range(q, q + 10)) for q in range(0, 100, 10))  # spread out
    assert hbm_pages(10, 0.3, "recent") == {7, 8, 9}
    assert tier_tokens(100, 16, {6}) == (96, 4)  # last page holds tokens 96..99
    assert page_mask(40, 16, 1.0, "spread") == [True, True, True]


# ---- CPU smoke runs of the harness ---------------------------------------------------------
class FakeTables:
    def __init__(self, page_table, seq_lens):
        self.page_table, self.seq_lens = page_table, seq_lens


class FakeCache:
    """The part of the PagedKVCache contract the benchmark uses, on a CPU."""

    def __init__(self, num_layers, num_kv_heads, head_dim, page_size, num_host_pages, num_hbm_pages=0,
                 dtype=torch.bfloat16, device="cpu"):
        shape = (num_layers, num_kv_heads, 2, page_size, head_dim)
        self.page_size = page_size
        self.host_pool = torch.zeros((num_host_pages, *shape), dtype=dtype)
        self.hbm_pool = torch.zeros((num_hbm_pages, *shape), dtype=dtype)
        self.host_pool_cuda = None
        self.free = {"host": list(range(num_host_pages))[::-1], "hbm": list(range(num_hbm_pages))[::-1]}
        self.seqs = {}

    def add_sequence(self):
        self.seqs[len(self.seqs)] = ([], 0)
        return len(self.seqs) - 1

    def extend(self, sid, n):
        pages, length = self.seqs[sid]
        need = -(-(length + n) // self.page_size) - len(pages)
        self.seqs[sid] = (pages + [self.free["host"].pop() for _ in range(need)], length + n)
        return length

    def move_pages(self, sid, logical_pages, tier):
        pages, _ = self.seqs[sid]
        for lp in logical_pages:
            e = pages[lp]
            if tier == "hbm" and e >= 0:
                new = self.free["hbm"].pop()
                self.hbm_pool[new] = self.host_pool[e]
                self.free["host"].append(e)
                pages[lp] = -new - 1
            elif tier == "host" and e < 0:
                new = self.free["host"].pop()
                self.host_pool[new] = self.hbm_pool[-e - 1]
                self.free["hbm"].append(-e - 1)
                pages[lp] = new

    def kernel_tables(self, ids):
        width = max(len(self.seqs[i][0]) for i in ids)
        rows = [self.seqs[i][0] + [self.seqs[i][0][-1]] * (width - len(self.seqs[i][0])) for i in ids]
        return FakeTables(torch.tensor(rows, dtype=torch.int32), torch.tensor([self.seqs[i][1] for i in ids]))

    def dense(self, sid, layer=0):
        pages, n = self.seqs[sid]
        blocks = [self.host_pool[e, layer] if e >= 0 else self.hbm_pool[-e - 1, layer] for e in pages]
        kv = torch.cat(blocks, dim=2)[:, :, :n]  # (Hkv, 2, n, d)
        return kv[:, 0], kv[:, 1]


def fake_attention(q, cache, tables, seq_ids, q_lens, config, out):
    """Straightforward float32 attention over the fake cache's pages."""
    q_lens = q_lens or [1] * len(seq_ids)
    row = 0
    for sid, ql in zip(seq_ids, q_lens):
        k, v = cache.dense(sid)
        hkv, n = k.shape[0], k.shape[1]
        qs = q[row:row + ql].float().transpose(0, 1)  # (Hq, ql, d)
        g = qs.shape[0] // hkv
        kk, vv = k.float().repeat_interleave(g, 0), v.float().repeat_interleave(g, 0)
        logits = qs @ kk.transpose(1, 2) / math.sqrt(q.shape[-1])
        pos = torch.arange(n - ql, n)[:, None]
        logits.masked_fill_(torch.arange(n)[None, :] > pos, float("-inf"))
        out[row:row + ql] = (torch.softmax(logits, -1) @ vv).transpose(0, 1).to(out.dtype)
        row += ql
    return out


def _loader(run):
    return lambda device: OursApi(cache_cls=FakeCache, run=run, missing_errors=(NotImplementedError, ValueError))


FAST = dict(device="cpu", page_size=16, warmup=1, reps=2, max_rep_s=0.02, min_sample_ms=0.01,
            rotate_bytes=1, max_sets=2)


def _run(tmp_path, shapes, opts, loader):
    doc = new_results(shapes[0].bench, HEADER, CEIL)
    return run_shapes(shapes, opts, CEIL, doc, tmp_path / "r.json", progress=False, ours_loader=loader)


def test_harness_smoke_decode_with_hybrid_fractions(tmp_path, capsys):
    shape = Shape("decode", 2, 100, 1, 4, 2, 64, "bfloat16")  # ragged: 100 = 6 pages of 16 + 4
    opts = BenchOptions(hbm_fractions=(0.0, 0.5), **FAST)
    doc = _run(tmp_path, [shape], opts, _loader(fake_attention))
    assert doc["passed"], [c for c in doc["checks"] if not c["ok"]]
    assert validate_results(doc) == []
    methods = [(r["method"], r["hbm_fraction"]) for r in doc["records"]]
    assert methods == [("floor", 0.0), ("host_read", 0.0), ("hbm_read", 1.0), ("hbm", 1.0), ("zero_copy", 0.0),
                       ("swap", 0.0), ("ours", 0.0), ("ours", 0.5)]
    assert all(r["ms"] is not None and r["ms"] > 0 for r in doc["records"])
    ours = {r["hbm_fraction"]: r for r in doc["records"] if r["method"] == "ours"}
    assert ours[0.0]["host_bytes"] == shape.kv_bytes and ours[0.0]["hbm_bytes"] == 0
    assert ours[0.5]["host_bytes"] + ours[0.5]["hbm_bytes"] == shape.kv_bytes and ours[0.5]["hbm_bytes"] > 0
    swap = next(r for r in doc["records"] if r["method"] == "swap")
    assert swap["staging_bytes"] == shape.kv_bytes
    assert {c["method"] for c in doc["checks"]} == {"hbm", "zero_copy", "swap", "ours"}
    assert load_json(tmp_path / "r.json") == doc
    assert "zero_copy[" in capsys.readouterr().out


def test_harness_marks_missing_and_keeps_baselines(tmp_path):
    def refuse(q, cache, tables, seq_ids, q_lens, config, out):
        raise NotImplementedError("no multi-token kernel yet")

    shape = Shape("prefill", 1, 64, 16, 4, 2, 64, "bfloat16")
    doc = _run(tmp_path, [shape], BenchOptions(**FAST), _loader(refuse))
    assert doc["passed"]
    ours = [r for r in doc["records"] if r["method"] == "ours"]
    assert len(ours) == 1 and ours[0]["ms"] is None
    assert doc["missing"][0]["reason"].startswith("NotImplementedError")
    assert all(r["ms"] is not None for r in doc["records"] if r["method"] != "ours")


def test_harness_never_times_a_wrong_kernel(tmp_path):
    def wrong(q, cache, tables, seq_ids, q_lens, config, out):
        fake_attention(q, cache, tables, seq_ids, q_lens, config, out)
        out[0, 0, 0] += 1.0
        return out

    def unwritten(q, cache, tables, seq_ids, q_lens, config, out):
        fake_attention(q, cache, tables, seq_ids, q_lens, config, out)
        out[-1] = float("nan")  # as if the last rows were never written (poisoned output)
        return out

    shape = Shape("decode", 2, 40, 1, 4, 2, 64, "bfloat16")
    for op in (wrong, unwritten):
        doc = _run(tmp_path, [shape], BenchOptions(**FAST), _loader(op))
        assert not doc["passed"]
        ours = next(r for r in doc["records"] if r["method"] == "ours")
        assert ours["ms"] is None
        bad = [c for c in doc["checks"] if not c["ok"]]
        assert [c["method"] for c in bad] == ["ours"]


def test_harness_with_the_real_cache_and_reference(tmp_path):
    """The benchmark's page filling and placement agree with the project's cache and reference."""
    from bench.harness import load_ours

    load_ours("cpu")  # the real cache, reference and op must import
    shape = Shape("decode", 2, 70, 1, 4, 2, 64, "bfloat16")
    doc = _run(tmp_path, [shape], BenchOptions(hbm_fractions=(0.0, 0.5), **FAST), load_ours)
    assert doc["passed"], [c for c in doc["checks"] if not c["ok"]]
    assert not doc["missing"], doc["missing"]
    assert all(r["ms"] is not None for r in doc["records"])


def test_window_method_reads_the_query_pages_from_the_window(tmp_path):
    """--window: ours[window] runs the real op with the query tokens' pages mirrored in HBM (checked
    against the anchor like every method), counts only the history's full pages as host bytes, and
    leaves no mirror behind."""
    from bench.harness import load_ours

    real = load_ours("cpu")
    seen = []

    def run(q, cache, tables, seq_ids, q_lens, config, out):
        seen.append(int((tables.host_table < 0).sum()))
        return real.run(q, cache, tables, seq_ids, q_lens, config, out)

    api = OursApi(cache_cls=real.cache_cls, run=run, missing_errors=real.missing_errors)
    shape = Shape("prefill", 2, 100, 40, 4, 2, 64, "bfloat16")  # history 60: 3 full pages of 16 + 12
    doc = _run(tmp_path, [shape], BenchOptions(window=True, **FAST), lambda device: api)
    assert doc["passed"], [c for c in doc["checks"] if not c["ok"]]
    recs = {r["method"]: r for r in doc["records"]}
    assert recs["ours[window]"]["ms"] > 0
    tok = shape.token_bytes
    assert recs["ours[window]"]["host_bytes"] == 2 * 48 * tok and recs["ours"]["host_bytes"] == 2 * 100 * tok
    assert recs["ours[window]"]["hbm_bytes"] == 2 * 52 * tok
    assert 0 in seen and max(seen) == 2 * 4  # pages 3..6 of each sequence from the window
    doc = _run(tmp_path, [Shape("decode", 2, 100, 1, 4, 2, 64, "bfloat16")], BenchOptions(window=True, **FAST),
               lambda device: api)
    assert "ours[window]" not in {r["method"] for r in doc["records"]}  # decode: one token, nothing to mirror


@pytest.mark.gpu
def test_gpu_smoke_run(tmp_path):
    """On a GPU: ceilings, UVA aliases, CUDA-event timing and every method on two tiny shapes."""
    from bench.ceilings import measure_ceilings
    from bench.harness import load_ours

    ceilings, details = measure_ceilings("cuda", host_bytes=64 << 20, hbm_bytes=256 << 20)
    assert 0 < ceilings.host_read_gbps < ceilings.hbm_read_gbps
    opts = BenchOptions(device="cuda", page_size=16, hbm_fractions=(0.0, 0.5), warmup=1, reps=2,
                        max_rep_s=0.05, max_sets=2)
    shapes = [Shape("decode", 2, 1000, 1, 8, 2, 128, "bfloat16"), Shape("prefill", 1, 500, 16, 8, 2, 128, "bfloat16")]
    doc = new_results("all", HEADER, ceilings, ceiling_details=details)
    run_shapes(shapes, opts, ceilings, doc, tmp_path / "r.json", progress=False, ours_loader=load_ours)
    assert doc["passed"], [c for c in doc["checks"] if not c["ok"]]
    assert validate_results(doc) == []
    assert all(r["ms"] is not None for r in doc["records"] if r["method"] != "ours")


def test_harness_compares_configs_in_one_run(tmp_path, capsys):
    """--compare-configs: each config is its own checked and timed method ours[...] next to ours;
    a config the op refuses for the shape is listed missing without failing the run, and a config
    that computes wrong numbers fails it."""
    from bench.harness import config_method

    seen = []

    def op(q, cache, tables, seq_ids, q_lens, config, out):
        seen.append(config)
        if config is not None and config.stages == 12:
            raise ValueError("needs more SMEM than the GPU has")  # the op's own refusal
        fake_attention(q, cache, tables, seq_ids, q_lens, config, out)
        if config is not None and config.tile_n == 32:
            out[0, 0, 0] += 1.0  # a broken variant
        return out

    good, refused, broken = {"tile_n": 64, "stages": 3}, {"tile_n": 64, "stages": 12}, {"tile_n": 32}
    shape = Shape("prefill", 1, 64, 16, 4, 2, 64, "bfloat16")
    opts = BenchOptions(compare_configs=(good, refused), **FAST)
    doc = _run(tmp_path, [shape], opts, _loader(op))
    assert doc["passed"], [c for c in doc["checks"] if not c["ok"]]
    recs = {r["method"]: r for r in doc["records"]}
    assert config_method(good) == "ours[tile_n=64,stages=3]"
    assert recs["ours"]["ms"] > 0 and recs[config_method(good)]["ms"] > 0
    assert recs[config_method(refused)]["ms"] is None
    assert [m["method"] for m in doc["missing"]] == [config_method(refused)]
    assert {c.stages for c in seen if c is not None} == {3, 12} and None in seen
    assert validate_results(doc) == []
    assert "ours[tile_n=64,stages=3]" in capsys.readouterr().out

    doc = _run(tmp_path, [shape], BenchOptions(compare_configs=(broken,), **FAST), _loader(op))
    assert not doc["passed"]
    assert [c["method"] for c in doc["checks"] if not c["ok"]] == [config_method(broken)]
    assert next(r for r in doc["records"] if r["method"] == config_method(broken))["ms"] is None


def test_compare_configs_argument():
    """--compare-configs parses a JSON list of configs into BenchOptions; a bad one is refused
    by argparse before anything runs."""
    from bench.__main__ import build_parser
    from bench.suite import bench_options

    p = build_parser()
    ns = p.parse_args(["prefill", "--compare-configs", '[{"tile_n": 32, "stages": 12}, {"chunk_tiles": 2}]'])
    opts = bench_options(ns, "prefill", "cpu", {})
    assert opts.compare_configs == ({"tile_n": 32, "stages": 12}, {"chunk_tiles": 2})
    assert bench_options(p.parse_args(["prefill"]), "prefill", "cpu", {}).compare_configs == ()
    for bad in ('{"tile_n": 32}', '[{"tiles": 32}]', "[1]", "not json"):
        with pytest.raises(SystemExit):
            p.parse_args(["prefill", "--compare-configs", bad])


def test_benches_refuse_to_run_without_a_gpu_unless_asked(monkeypatch, capsys):
    import torch

    from bench.__main__ import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["all", "--quick"]) == 2
    assert "--device cpu" in capsys.readouterr().err


def test_cpu_runs_are_sized_for_a_cpu():
    import argparse

    from bench import suite

    ns = argparse.Namespace(heads=None, contexts=None, head_dim=128, dtype="bfloat16", preset="full", batches=None,
                            q_lens=None)
    for bench in ("decode", "prefill"):
        full = suite.bench_shapes(ns, bench, "cuda")
        small = suite.bench_shapes(ns, bench, "cpu")
        assert small and len(small) < len(full)
        assert all(s.context <= suite.CPU_MAX_CONTEXT and s.q_len <= suite.CPU_MAX_Q_LEN
                   and s.batch <= suite.CPU_MAX_BATCH for s in small)


def test_compute_ab_names_configs_by_their_changes_from_the_default():
    from bench.compute_ab import config_name
    from directkv_cute.config import QTiledConfig

    assert config_name(QTiledConfig()) == "{}"
    assert config_name(QTiledConfig(cluster=1, stages=2)) == '{"stages": 2, "cluster": 1}'


def test_skipped_methods_are_listed_missing_and_not_run(tmp_path):
    """--skip-methods: the named slow baseline is recorded as missing (with the reason), never
    called; every other method still runs and is checked."""
    from bench.harness import load_ours

    shape = Shape("prefill", 1, 70, 16, 4, 2, 64, "bfloat16")
    doc = _run(tmp_path, [shape], BenchOptions(skip_methods=("zero_copy",), **FAST), load_ours)
    recs = {r["method"]: r for r in doc["records"]}
    assert recs["zero_copy"]["ms"] is None and recs["hbm"]["ms"] > 0 and recs["ours"]["ms"] > 0
    assert any(m["method"] == "zero_copy" and "skip" in m["reason"] for m in doc["missing"])
    assert doc["passed"]


def test_skip_methods_takes_only_the_slow_baselines():
    from bench.suite import _skippable

    assert _skippable("zero_copy,fa4[zero_copy_paged]") == ("zero_copy", "fa4[zero_copy_paged]")
    with pytest.raises(argparse.ArgumentTypeError, match="cannot skip"):
        _skippable("ours")


def test_step_host_pages_are_the_pages_of_each_sequences_last_tokens():
    """The pages the bench records as just written before a timed call: the host pages holding
    each sequence's last q_len tokens (one token without q_lens), HBM pages left out."""
    from bench.harness import step_host_pages
    from directkv_cute.cache import PagedKVCache

    cache = PagedKVCache(1, 2, 64, 16, num_host_pages=20, num_hbm_pages=4, device="cpu", dtype=torch.float32)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.append(a, torch.randn(100, 1, 2, 64), torch.randn(100, 1, 2, 64))  # pages 0-6, last one partial
    cache.append(b, torch.randn(40, 1, 2, 64), torch.randn(40, 1, 2, 64))
    cache.move_pages(b, [2], "hbm")  # b's last page (tokens 32-39) in HBM
    ta, tb = cache.page_table(a), cache.page_table(b)
    assert step_host_pages(cache, [a], [20]) == sorted(ta[5:7])  # tokens 80-99
    assert step_host_pages(cache, [a, b], None) == [ta[6]]  # b's last token is in HBM
    assert step_host_pages(cache, [a, b], [1, 10]) == sorted([ta[6], tb[1]])  # b: tokens 30-39


def test_layers_time_runs_of_calls_over_tables_marked_back_to_back(tmp_path, monkeypatch):
    """--layers N: every method's samples hold at least N calls back to back, and ours' tables
    are marked back to back (a model step's layers); without it ours' tables are not marked."""
    counts, marks = [], []
    real = FakeCache.kernel_tables

    def kernel_tables(self, ids, back_to_back=False):
        marks.append(back_to_back)
        return real(self, ids)

    monkeypatch.setattr(FakeCache, "kernel_tables", kernel_tables)
    t = time_calls([lambda: counts.append(1)], Timer("cpu"), warmup=1, reps=2, min_sample_ms=1e-6,
                   max_total_s=1.0, min_inner=5)
    assert t.inner == 5 and len(counts) >= 1 + 1 + 2 * 5
    shape = Shape("prefill", 1, 64, 16, 4, 2, 64, "bfloat16")
    for layers, want in ((3, True), (1, False)):
        marks.clear()
        opts = BenchOptions(**FAST, layers=layers)
        assert opts.timing()["min_inner"] == layers
        doc = _run(tmp_path, [shape], opts, _loader(fake_attention))
        assert doc["passed"], [c for c in doc["checks"] if not c["ok"]]
        assert (True in marks) == want  # ours' tables (the peers' own tables are never marked)
