"""The shared-prefix bench (``python -m bench prefix``): rows, FA4's shared-page layout, a failed
check marking its row FAIL, the targets and table on a synthetic run, and a CPU smoke run of the
whole thing (cascade and per-sequence through the reference)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from bench import prefix
from bench.common import Ceilings, validate_results
from bench.harness import BenchOptions

CEIL = Ceilings(host_read_gbps=50.0, hbm_read_gbps=4000.0, memcpy_h2d_gbps=54.0)
HEADER = {"gpu": "NVIDIA H200", "gpu_key": "NVIDIA_H200", "date": "2026-12-02", "versions": {"torch": "x"}}
FAST = dict(device="cpu", page_size=16, warmup=1, reps=1, max_rep_s=0.01, min_sample_ms=0.01, peers=False)
TINY = prefix.PrefixRow(3, 256, 20, 2, 4, 2, 32, "float32")


def _doc():
    from bench.common import new_results

    doc = new_results(prefix.BENCH, HEADER, CEIL, args={"prompt": 256})
    doc["rows"], doc["targets"] = [], []
    return doc


def test_rows_are_the_grid_cheapest_first_with_the_control_last():
    rows = prefix.rows_for(prompt=32768, batches=[4, 16, 64], own_tokens=[0, 1024, 8192], q_lens=[1, 16],
                           heads=(32, 8), head_dim=128, dtype="bfloat16", control=True, control_batch=16)
    assert len(rows) == 19 and len({r.shape for r in rows}) == 19
    *shared, control = rows
    assert all(r.shared for r in shared) and not control.shared and control.shape.bench == prefix.CONTROL_BENCH
    cost = [r.dense_bytes * r.q_len for r in shared]
    assert cost == sorted(cost)
    r = next(r for r in shared if (r.batch, r.own, r.q_len) == (16, 1024, 1))
    assert r.context == 32768 + 1024 + 1 and r.shape.bench == prefix.BENCH
    assert r.unique_tokens() == 32768 + 16 * 1025
    # the shared own-0 decode row and the control row differ only in bench: their records never mix
    own0 = next(r for r in shared if (r.batch, r.own, r.q_len) == (16, 0, 1))
    assert own0.context == control.context and own0.shape.label == control.shape.label
    assert own0.shape != control.shape
    # the cache holds every page a row needs
    assert prefix._pages_needed(r, 64) >= math.ceil(32768 / 64) + 16 * math.ceil(1025 / 64)


def _bench(row=TINY):
    return prefix.PrefixBench(row, BenchOptions(**FAST), CEIL, _doc())


def test_the_cache_shares_the_prompt_and_fa4s_pools_hold_each_page_once():
    b = _bench()
    try:
        b._build_inputs()
        b._plan()
        s, page = b.shape, b.opts.page_size
        plan = b.plan
        assert plan.shared and [sp.rows for sp in plan.spans] == [(0, 1, 2)]
        assert plan.host_pages_read == 256 // page + 3 * math.ceil(22 / page)
        assert plan.host_pages_naive == 3 * math.ceil(s.context / page)
        floor = b.records[0]
        assert floor.method == "floor" and floor.host_bytes == plan.host_pages_read * b.page_bytes
        # FA4's layout: one pool page per unique page, the sharing kept in its page table, and the
        # pools + table give back every sequence's dense K and V
        fa = b._fa4_inputs()
        table = fa.page_table.numpy()
        assert fa.host.cpu.shape[1] == plan.host_pages_read == len(np.unique(table))
        assert (table[0, :256 // page] == table[2, :256 // page]).all()
        kv = b.inputs.kv_dev[0]
        for seq in range(s.batch):
            for i in (0, 1):
                got = fa.host.cpu[i][torch.from_numpy(table[seq].astype(np.int64))]  # (pages, P, Hkv, d)
                got = got.reshape(-1, s.hkv, s.head_dim)[: s.context]
                assert torch.equal(got, kv[i, seq].permute(1, 0, 2))
        assert torch.equal(fa.dense, kv.permute(0, 1, 3, 2, 4))
        assert fa.seqused_k.tolist() == [s.context] * 3 and fa.cu_seqlens_q.tolist() == [0, 2, 4, 6]
        fa.host.close()
    finally:
        b._release_all()


def test_a_wrong_output_fails_its_check_and_marks_the_row(monkeypatch):
    import directkv_cute.ops as ops

    real = ops.cascade_attention

    def broken(*a, **k):
        out = real(*a, **k)
        out[-1] += 1.0  # the last sequence's last query row
        return out

    monkeypatch.setattr(ops, "cascade_attention", broken)
    b = _bench()
    records = [r.to_dict() for r in b.run()]
    doc = b.doc
    doc["records"].extend(records)
    assert not doc["passed"]
    failed = [(c["method"], c["hbm_fraction"]) for c in doc["checks"] if not c["ok"]]
    assert failed == [(prefix.CASCADE, 0.0), (prefix.CASCADE, 1.0)]
    by = {(r["method"], r["hbm_fraction"]): r for r in records}
    assert by[(prefix.CASCADE, 0.0)]["ms"] is None and by[(prefix.PER_SEQ, 0.0)]["ms"] > 0
    summary = prefix.row_summary(TINY, records, doc, b.summary)
    assert summary["status"] == "FAIL" and summary["speedup_cascade_vs_per_seq"] is None
    doc["rows"].append(summary | {"token_bytes": TINY.shape.token_bytes})
    table = prefix.format_table(doc)
    assert any(line.startswith(prefix.CASCADE) and "FAIL" in line for line in table.splitlines())
    assert "CHECK FAILED: ours[cascade]" in table


def _synthetic_row(batch, own, q_len, cascade_ms, per_seq_ms, hbm_ms, shared=True, prompt=32768):
    """A row summary as ``run_prefix`` writes it, with the numbers the targets read."""
    row = prefix.PrefixRow(batch, prompt, own, q_len, 32, 8, 128, "bfloat16", shared=shared)
    tb = row.shape.token_bytes
    unique = row.unique_tokens() * tb
    floor_ms = unique / (CEIL.host_read_gbps * 1e9) * 1e3
    tokens = batch * row.context

    def m(ms):
        return {"ms": ms, "host_mb": 0.0, "hbm_fraction": 0.0, "kv_tokens_per_s": tokens / (ms * 1e-3)}

    methods = {"floor": m(floor_ms), prefix.CASCADE: m(cascade_ms), prefix.PER_SEQ: m(per_seq_ms),
               f"{prefix.CASCADE}@hbm": m(hbm_ms)}
    return {"row": row.label, "key": "k", "shape_label": row.shape.label, "bench": row.shape.bench,
            "batch": batch, "prompt": prompt, "own": own, "q_len": q_len, "context": row.context,
            "shared_prompt": shared, "attended_tokens": tokens, "status": "ok", "unique_bytes": unique,
            "naive_bytes": tokens * tb, "token_bytes": tb, "methods": methods,
            "speedup_cascade_vs_per_seq": per_seq_ms / cascade_ms}, floor_ms


def test_targets():
    doc = _doc()
    b16, floor16 = _synthetic_row(16, 1024, 1, 2.9, 26.0, 0.5)  # 9x, link-bound, at 1.0x floor
    b64, floor64 = _synthetic_row(64, 8192, 16, 60.0, 200.0, 80.0)  # compute-bound: no floor target
    b16_8k, _ = _synthetic_row(16, 8192, 1, 20.0, 60.0, 1.0)
    ctl, _ = _synthetic_row(16, 0, 1, 42.5, 42.0, 0.5, shared=False)
    doc["rows"] = [b16, b64, b16_8k, ctl]
    got = {}
    for t in prefix.evaluate_targets(doc):
        got.setdefault(t["target"], {})[t["row"]] = t
    speed = got["ours[cascade] >= 8x faster than ours[per-seq]"]
    assert list(speed) == [b16["row"]] and speed[b16["row"]]["ok"] is True
    assert speed[b16["row"]]["value"] == pytest.approx(26.0 / 2.9)
    link = got["link-bound: ours[cascade] <= 1.15 x floor"]
    assert link[b16["row"]]["value"] == pytest.approx(2.9 / floor16)
    assert link[b16["row"]]["ok"] is (2.9 / floor16 <= 1.15)
    assert link[b64["row"]]["ok"] is None and "not link-bound" in link[b64["row"]]["detail"]
    assert link[b16_8k["row"]]["ok"] is False  # 20 ms against a ~11 ms floor
    tps = got["attended KV tokens/s >= 4 x the link's KV tokens/s"]
    assert set(tps) == {b16["row"], b16_8k["row"]}  # batch 16 only
    link_tps = 50e9 / 4096
    assert tps[b16["row"]]["value"] == pytest.approx(16 * (32768 + 1025) / 2.9e-3 / link_tps)
    assert tps[b16["row"]]["ok"] is True and tps[b16_8k["row"]]["ok"] is False
    assert "at the floor" in tps[b16_8k["row"]]["detail"]
    ctl_t = got["no sharing: ours[cascade] no slower than ours[per-seq] (<= 1.03x)"][ctl["row"]]
    assert ctl_t["ok"] is True and ctl_t["value"] == pytest.approx(42.5 / 42.0)
    doc["targets"] = prefix.evaluate_targets(doc)
    text = prefix.format_table(doc)
    assert "MET  ours[cascade] >= 8x" in text and "MISS link-bound" in text and "targets:" in text
    # a row that crashed before it was planned is left out, not a KeyError
    doc["rows"].append({"row": "x", "methods": {}})
    assert len(prefix.evaluate_targets(doc)) == len(doc["targets"])


def test_help_and_registration(capsys):
    from bench.__main__ import COMMANDS, main

    assert COMMANDS["prefix"] is prefix.cmd_prefix
    with pytest.raises(SystemExit) as e:
        main(["prefix", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for opt in ("--prompt", "--batches", "--own-tokens", "--q-lens", "--time-budget-s", "--no-peers", "--device",
                "--no-control", "--no-hbm"):
        assert opt in out


def test_import_touches_no_gpu():
    import os
    import subprocess
    import sys
    from pathlib import Path

    # bench is not installed: the checkout's root first on the child's path, from any folder
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    code = "import bench.prefix, torch; assert not torch.cuda.is_initialized(); print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_cpu_smoke_run(tmp_path, capsys):
    from bench.__main__ import main

    rc = main(["prefix", "--device", "cpu", "--out-dir", str(tmp_path), "--no-progress"])
    assert rc == 0
    (path,) = tmp_path.glob("*-prefix.json")
    doc = json.loads(path.read_text())
    assert validate_results(doc) == [], validate_results(doc)
    assert doc["passed"] and doc["bench"] == "prefix" and not doc["missing"]
    rows = {(r["own"], r["q_len"], r["shared_prompt"]): r for r in doc["rows"]}
    assert set(rows) == {(0, 1, True), (40, 1, True), (0, 4, True), (40, 4, True), (0, 1, False)}
    expect = {"floor", prefix.CASCADE, prefix.PER_SEQ, prefix.OP, "hbm", "zero_copy", "swap", f"{prefix.CASCADE}@hbm",
              f"{prefix.PER_SEQ}@hbm"}
    for key, r in rows.items():
        assert r["status"] == "ok" and r["batch"] == 4
        assert set(r["methods"]) == expect, r["methods"].keys()
        assert all(v["ms"] and v["ms"] > 0 for v in r["methods"].values())
        assert r["plan_ms"] > 0 and r["attended_tokens"] == 4 * r["context"]
        assert r["speedup_cascade_vs_per_seq"] > 0
        m = r["methods"][prefix.CASCADE]
        assert m["kv_tokens_per_s"] == pytest.approx(r["attended_tokens"] / (m["ms"] * 1e-3))
    shared = rows[(40, 1, True)]
    assert shared["spans"] == 1 and shared["host_pages_read"] < shared["host_pages_naive"]
    assert rows[(0, 1, False)]["spans"] == 0
    assert rows[(0, 1, False)]["host_pages_read"] == rows[(0, 1, False)]["host_pages_naive"]
    recs = [r for r in doc["records"] if r["method"] == prefix.CASCADE and r["hbm_fraction"] == 0.0]
    assert {r["bench"] for r in recs} == {prefix.BENCH, prefix.CONTROL_BENCH}
    assert all(r["host_bytes"] > 0 and r["hbm_bytes"] == 0 for r in recs)
    assert doc["notes"]["peers"] == "FA4 needs CUDA" and len(doc["notes"]["plan_ms"]) == 5
    assert rows[(40, 4, True)]["prepare_ms"] > 0 and rows[(0, 1, False)]["prepare_ms"] == 0.0  # nothing to prepare
    assert doc["targets"] == []  # a CPU run's timings mean nothing: no targets
    assert all(c["ok"] for c in doc["checks"]) and len(doc["checks"]) >= 5 * 7
    text = path.with_suffix(".txt").read_text()
    assert text.startswith("== prefix on cpu") and "KV tok/s" in text
    out = capsys.readouterr().out
    assert "ours[cascade]" in out
    for t in (text, out):
        assert "targets:" not in t and "ceilings" not in t and "MET" not in t and "MISS" not in t
