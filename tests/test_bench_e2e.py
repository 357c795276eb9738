"""The end-to-end bench (``python -m bench e2e``): rows, physics, targets, table, JSON, and a CPU
smoke run of the whole thing on the tiny preset."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from bench import e2e  # noqa: E402

GiB = 1 << 30
TOKEN_BYTES = 131072  # llama3-8b, bf16: 2 x 32 layers x 8 heads x 128 x 2 bytes
CEIL = {"host_read_gbps": 50.0, "hbm_read_gbps": 4000.0, "memcpy_h2d_gbps": 45.0}


def _row(method, ctx, batch, ms=None, prefill=None, status="ok", peak=None, role="measured", **kw):
    return e2e.new_row(preset="llama3-8b", method=method, context=ctx, batch=batch, dtype="bfloat16", status=status,
                       decode_ms=ms, prefill_s=prefill, peak_gpu_bytes=peak, role=role, **kw)


def _synthetic_rows():
    return [
        _row("dynamic", 4096, 1, 25.0, 0.3, role="non-attention"),
        _row("dynamic", 32768, 1, 72.0, 3.0, peak=int(22.6 * GiB)),
        _row("hf-offloaded", 32768, 1, 545.0, 9.0, peak=int(18.8 * GiB), base_gpu_bytes=int(15 * GiB)),
        _row("ours[host]", 32768, 1, 105.0, 3.5, peak=int(16.5 * GiB)),
        _row("ours[hbm]", 32768, 1, 90.0, 3.4, peak=int(19.0 * GiB), label="ours[hbm=3.80GiB]"),
        _row("dynamic", 131072, 1, 56.0, 30.0, peak=int(45.6 * GiB)),
        _row("hf-offloaded", 131072, 1, 2867.0, 60.0, peak=int(30.1 * GiB), base_gpu_bytes=int(15 * GiB)),
        _row("ours[host]", 131072, 1, 450.0, 42.0, peak=int(17.0 * GiB)),  # misses physics and prefill
        _row("ours[hbm]", 131072, 1, 500.0, 41.0, peak=int(31.0 * GiB)),  # slower than host: a miss
        _row("dynamic", 131072, 8, status="skipped", error="cannot fit: weights + KV > GPU"),
        _row("ours[host]", 131072, 8, status="OOM", error="OutOfMemoryError: CUDA out of memory"),
    ]


def test_parse_methods():
    ms = e2e.parse_methods("ours[hbm],ours[host],hf-offloaded,dynamic")
    assert [m.name for m in ms] == ["dynamic", "hf-offloaded", "ours[host]", "ours[hbm]"]
    (m,) = e2e.parse_methods("ours[hbm=8GiB]")
    assert m.base == "ours" and m.tier == "hbm" and m.budget == 8 * GiB and m.label() == "ours[hbm=8.00GiB]"
    assert e2e.parse_methods("ours")[0].name == "ours[host]"
    assert e2e.Method("ours", "hbm").label(int(15.5 * GiB)) == "ours[hbm=15.5GiB]"
    for bad in ("", "flash", "ours[hbm=lots]", "dynamic,dynamic"):
        with pytest.raises(ValueError):
            e2e.parse_methods(bad)


def test_sparse_methods_parse_name_and_order_after_the_exact_ones():
    ms = e2e.parse_methods("ours[fp8,sparse=1/8],ours[sparse=256p],ours[host],ours[fp8]")
    assert [m.name for m in ms] == ["ours[host]", "ours[fp8]", "ours[sparse=256p]", "ours[fp8,sparse=1/8]"]
    assert ms[3].kv_dtype == "fp8" and ms[3].sparse == "1/8" and ms[2].kv_dtype is None
    (m,) = e2e.parse_methods("ours[hbm,sparse=1/8]")
    assert m.tier == "hbm" and m.sparse == "1/8" and m.kv_dtype is None and m.name == "ours[hbm,sparse=1/8]"
    assert m.label(8 * GiB) == "ours[hbm=8.00GiB,sparse=1/8]"
    for bad in ("ours[sparse=2]", "ours[sparse=]", "ours[fp8,sparse=eighth]", "ours[sparse=1/8],ours[sparse=1/8]"):
        with pytest.raises(ValueError):
            e2e.parse_methods(bad)
    assert e2e.sparse_tokens("1/8", 131072, 64) == 256 * 64
    assert e2e.sparse_tokens("1/8", 100, 64) == 100  # 2 pages: fewer than sink + recent, every token


def test_sparse_targets_against_the_exact_step_of_the_same_pages():
    rows = [_row("ours[host]", 131072, 1, 320.0, 11.0), _row("ours[sparse=1/8]", 131072, 1, 60.0, 11.0),
            _row("ours[fp8]", 131072, 1, 170.0, 11.0), _row("ours[fp8,sparse=1/8]", 131072, 1, 40.0, 11.0),
            _row("ours[host]", 32768, 1, 100.0, 3.0), _row("ours[sparse=1/8]", 32768, 1, 60.0, 3.0)]
    got = {(t["target"], t["context"]): t for t in e2e.evaluate_targets(rows, preset="llama3-70b")}
    assert got[("ours[sparse=1/8] decode <= 0.2 x ours[host]", 131072)]["ok"] is True
    assert got[("ours[fp8,sparse=1/8] decode <= 0.2 x ours[fp8]", 131072)]["ok"] is False  # 40 > 34 ms
    assert got[("ours[fp8,sparse=1/8] decode >= 8 token/s per sequence", 131072)]["ok"] is True  # 25 token/s
    assert not any(k[1] == 32768 and "sparse" in k[0] for k in got)  # the target is for long contexts


def test_kv_bytes_and_mean_attended():
    from directkv_cute.presets import preset_config

    assert e2e.kv_token_bytes(preset_config("llama3-8b"), torch.bfloat16) == TOKEN_BYTES
    assert e2e.kv_token_bytes(preset_config("llama3-70b"), torch.bfloat16) == 327680
    assert e2e.kv_token_bytes(preset_config("tiny"), torch.float32) == 2 * 2 * 2 * 64 * 4
    # steps 3..18 (warm-up 2, 16 timed) attend over context + 3 .. context + 18 tokens
    assert e2e.mean_attended(32768, 2, 16) == 32768 + (3 + 18) / 2


def test_physics_rows_and_targets():
    rows = _synthetic_rows()
    phys = e2e.physics_rows(rows, CEIL, preset="llama3-8b", dtype="bfloat16", token_bytes=TOKEN_BYTES, warmup=2,
                            timed=16, physics_context=4096)
    by_ctx = {(r["context"], r["batch"]): r for r in phys}
    assert set(by_ctx) == {(32768, 1), (131072, 1)}  # no batch-8 non-attention row: no batch-8 physics
    p32 = by_ctx[(32768, 1)]
    kv = int(1 * (32768 + 10.5) * TOKEN_BYTES)
    assert p32["kv_bytes_per_step"] == kv and p32["status"] == "computed" and p32["role"] == "computed"
    assert p32["decode_ms"] == pytest.approx(kv / 50e9 * 1e3 + 25.0)  # ~85.9 + 25 ms
    assert e2e.validate_row(p32) == []
    targets = e2e.evaluate_targets(rows + phys, preset="llama3-8b")
    got = {(t["target"], t["context"]): t for t in targets}
    t = got[("ours[host] <= 1.15 x physics", 32768)]
    assert t["ok"] is True and t["limit"] == pytest.approx(1.15 * p32["decode_ms"])
    assert got[("ours[host] <= 1.15 x physics", 131072)]["ok"] is False
    s32 = got[("ours[host] speedup over hf-offloaded >= 5x", 32768)]
    assert s32["value"] == pytest.approx(545 / 105) and s32["ok"] is True
    s128 = got[("ours[host] speedup over hf-offloaded >= 7x", 131072)]
    assert s128["value"] == pytest.approx(2867 / 450) and s128["ok"] is False
    assert got[("ours[host] peak GPU memory < hf-offloaded", 32768)]["ok"] is True
    assert got[("ours[hbm] faster than ours[host]", 32768)]["ok"] is True
    assert got[("ours[hbm] faster than ours[host]", 131072)]["ok"] is False
    assert got[("ours[host] prefill <= 1.3 x dynamic", 32768)]["ok"] is True
    assert got[("ours[host] prefill <= 1.3 x dynamic", 131072)]["ok"] is False
    assert not any(t["batch"] == 8 for t in targets)  # nothing measured there
    assert not any("token/s" in t["target"] for t in targets)  # the 70B target only for llama3-70b
    t70 = e2e.evaluate_targets([_row("ours[host]", 131072, 1, 870.0, 110.0)], preset="llama3-70b")
    assert [t["ok"] for t in t70 if "token/s" in t["target"]] == [True]
    t70 = e2e.evaluate_targets([_row("ours[host]", 131072, 1, 1100.0, 110.0)], preset="llama3-70b")
    assert [t["ok"] for t in t70 if "token/s" in t["target"]] == [False]


def test_offloaded_budget_is_its_peak_beyond_what_was_allocated_before():
    rows = _synthetic_rows()
    assert e2e._offloaded_budget(rows, 32768, 1) == int(18.8 * GiB) - int(15 * GiB)
    assert e2e._offloaded_budget(rows, 131072, 8) is None


def _doc(rows, targets):
    return {"schema": e2e.E2E_SCHEMA, "bench": "e2e",
            "header": {"gpu": "NVIDIA H200", "gpu_key": "NVIDIA_H200", "date": "2026-12-01",
                       "versions": {"transformers": "5.17.0"}, "dtype": "bfloat16"},
            "ceilings": CEIL, "args": {"preset": "llama3-8b"}, "rows": rows, "targets": targets, "passed": True}


def test_table_and_json(tmp_path):
    rows = _synthetic_rows()
    rows += e2e.physics_rows(rows, CEIL, preset="llama3-8b", dtype="bfloat16", token_bytes=TOKEN_BYTES, warmup=2,
                             timed=16, physics_context=4096)
    doc = _doc(rows, e2e.evaluate_targets(rows, preset="llama3-8b"))
    assert e2e.validate_doc(doc) == []
    text = e2e.format_table(doc)
    lines = text.splitlines()
    assert "host read 50.0 GB/s" in lines[1]
    header = lines[2].split()
    assert header[:4] == ["method", "B", "ctx", "status"]
    ours32 = next(line for line in lines if line.startswith("ours[host]") and " 32k " in line)
    assert "105.0" in ours32 and "5.2x" in ours32  # 545 / 105 vs hf-offloaded
    assert any(line.startswith("ours[hbm=3.80GiB]") for line in lines)
    assert any("OOM" in line and "out of memory" in line for line in lines)
    assert any("skipped" in line and "cannot fit" in line for line in lines)
    assert any(line.startswith("physics") for line in lines)
    assert "targets:" in text and "MET " in text and "MISS" in text
    # JSON round trip (what the run writes)
    from bench.common import write_json

    path = write_json(tmp_path / "e2e.json", doc)
    assert e2e.validate_doc(json.loads(path.read_text())) == []


def test_validate_catches_broken_rows():
    good = _row("ours[host]", 32768, 1, 100.0, 3.0)
    assert e2e.validate_row(good) == []
    assert good["tokens_per_s"] == pytest.approx(10.0)
    assert e2e.validate_row(good | {"tokens_per_s": 11.0})
    assert e2e.validate_row(good | {"status": "fine"})
    assert e2e.validate_row(good | {"decode_ms": float("nan")})
    assert e2e.validate_row({k: v for k, v in good.items() if k != "label"})
    assert e2e.validate_row(_row("dynamic", 32768, 1, None, status="ok"))
    with pytest.raises(KeyError):
        e2e.new_row(method="x", context=1, batch=1, bogus=1)
    doc = _doc([good], [])
    assert e2e.validate_doc(doc) == []
    assert e2e.validate_doc(doc | {"schema": "directkv-bench/1"})
    assert e2e.validate_doc({k: v for k, v in doc.items() if k != "targets"})


def test_predict_skip():
    kw = dict(weights=int(15 * GiB), gpu_total=int(140 * GiB), host_avail=int(120 * GiB), budget=None)
    kv_b8_128k = 8 * (131072 + 19) * TOKEN_BYTES  # 128 GiB
    for m in e2e.parse_methods(e2e.DEFAULT_METHODS):
        why = e2e.predict_skip(m, batch=8, kv_bytes=kv_b8_128k, **kw)
        assert why and "cannot fit" in why, m.name
        assert e2e.predict_skip(m, batch=1, kv_bytes=kv_b8_128k, **kw) is None  # batch 1 is always attempted
    kv_b8_32k = 8 * (32768 + 19) * TOKEN_BYTES  # 32 GiB
    assert all(e2e.predict_skip(m, batch=8, kv_bytes=kv_b8_32k, **kw) is None
               for m in e2e.parse_methods(e2e.DEFAULT_METHODS))
    # the HBM tier takes its budget off the host's share
    hbm = e2e.Method("ours", "hbm")
    assert e2e.predict_skip(hbm, batch=8, kv_bytes=int(125 * GiB), **(kw | {"budget": int(10 * GiB)})) is None
    assert e2e.predict_skip(e2e.Method("ours"), batch=8, kv_bytes=int(125 * GiB), **kw)


def test_estimate_row_s():
    rows = [_row("ours[host]", 32768, 1, 100.0, 3.0, wall_s=20.0), _row("dynamic", 32768, 1, 70.0, 3.0, wall_s=10.0)]
    assert e2e.estimate_row_s(rows, "ours[host]", 32768, 8) == pytest.approx(160.0)  # batch 1 x 8
    assert e2e.estimate_row_s(rows, "ours[host]", 131072, 1) == pytest.approx(20.0 * 4 ** 1.5)
    assert e2e.estimate_row_s(rows, "hf-offloaded", 32768, 8) is None
    assert e2e.estimate_row_s(rows, "ours[host]", 16384, 1) is None  # nothing smaller measured


def test_time_budget_skips_rows_estimated_to_overrun():
    runner = _runner("ours[host],dynamic", batches=[1, 2], time_budget_s=1e6)
    doc = {"rows": [e2e.new_row(preset="tiny", method="dynamic", context=48, batch=1, status="ok", decode_ms=1.0,
                                wall_s=6e5)]}
    runner.opts.methods = e2e.parse_methods("dynamic")
    runner.opts.contexts = []
    e2e.run_rows(runner, doc, lambda: None)  # nothing to run: no rows added
    assert len(doc["rows"]) == 1
    runner.opts.contexts, runner.opts.batches = [48], [2]
    e2e.run_rows(runner, doc, lambda: None)
    (row,) = doc["rows"][1:]
    assert row["status"] == "skipped" and "estimated" in row["error"] and row["batch"] == 2


def test_agree_tokens():
    a = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    assert e2e.agree_tokens(a, a) == 4
    b = a.clone()
    b[1, 2] = 0
    assert e2e.agree_tokens(a, b) == 2
    assert e2e.agree_tokens(a, b[:, :1]) == 1


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    rows = _synthetic_rows()
    rows += e2e.physics_rows(rows, CEIL, preset="llama3-8b", dtype="bfloat16", token_bytes=TOKEN_BYTES, warmup=2,
                             timed=16, physics_context=4096)
    path = e2e.plot_e2e(_doc(rows, []), tmp_path / "e2e.png")
    assert path is not None and path.stat().st_size > 10_000
    assert e2e.plot_e2e(_doc([], []), tmp_path / "none.png") is None


def test_help_works_without_a_gpu():
    root = Path(__file__).resolve().parents[1]
    # bench is not installed: run from the checkout's root, which also goes first on PYTHONPATH
    # (the current folder is not on the path under PYTHONSAFEPATH)
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, "-m", "bench", "e2e", "--help"], capture_output=True, text=True, cwd=root,
                         timeout=120, env=dict(os.environ, PYTHONPATH=path))
    assert out.returncode == 0, out.stderr
    for opt in ("--preset", "--contexts", "--batches", "--methods", "--new-tokens", "--offloaded-tokens",
                "--prefill-chunk", "--hbm-budget", "--quick", "--out-dir"):
        assert opt in out.stdout



def test_top_level_help_lists_e2e(capsys):
    """The same parser in-process (the entry point itself runs above)."""
    from bench.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "e2e" in capsys.readouterr().out


def test_shallow_model_shares_the_weights():
    from directkv_cute.presets import build_random_model

    model = build_random_model("tiny", torch.float32, "cpu", seed=0, num_hidden_layers=3)
    view = e2e.shallow_model(model, 1)
    assert view.config.num_hidden_layers == 1 and len(view.model.layers) == 1
    assert view.model.layers[0] is model.model.layers[0] and view.lm_head is model.lm_head
    assert view.model.embed_tokens.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.config.num_hidden_layers == 3
    ids = torch.randint(0, 1024, (1, 16))
    with torch.no_grad():
        assert view(ids).logits.shape == (1, 16, 1024)


def _runner(methods="ours[host],dynamic", **kw):
    from directkv_cute.presets import build_random_model

    opts = e2e.Options(preset="tiny", device="cpu", dtype=torch.float32, contexts=[48], batches=[1],
                       methods=e2e.parse_methods(methods), new_tokens=2, warmup_tokens=1, offloaded_tokens=1,
                       prefill_chunk=16, page_size=16, physics_context=0, hbm_budget=None, time_budget_s=None,
                       skip=True, seed=0, progress=False)
    for k, v in kw.items():
        setattr(opts, k, v)
    return e2e.Runner(build_random_model("tiny", torch.float32, "cpu", seed=0), opts)


def test_an_oom_is_recorded_and_the_run_goes_on(monkeypatch):
    runner = _runner()
    real = runner._generate
    calls = []

    def fake(model, method, *a, **k):
        calls.append(method.name)
        if method.base == "dynamic":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real(model, method, *a, **k)

    monkeypatch.setattr(runner, "_generate", fake)
    doc = {"rows": []}
    e2e.run_rows(runner, doc, lambda: None)
    by = {r["method"]: r for r in doc["rows"]}
    assert by["dynamic"]["status"] == "OOM" and "Tried to allocate" in by["dynamic"]["error"]
    assert by["dynamic"]["decode_ms"] is None
    assert by["ours[host]"]["status"] == "ok" and by["ours[host]"]["decode_ms"] > 0
    assert by["ours[host]"]["agree_tokens"] is None  # no dynamic tokens to compare with
    assert calls == ["dynamic", "ours[host]", "ours[host]"]  # ours: warm-up on the one-layer view, then timed
    assert all(e2e.validate_row(r) == [] for r in doc["rows"])


def test_cpu_rows_skip_what_cannot_run():
    runner = _runner("hf-offloaded,ours[hbm]")
    doc = {"rows": []}
    e2e.run_rows(runner, doc, lambda: None)
    by = {r["method"]: r for r in doc["rows"]}
    assert by["hf-offloaded"]["status"] == "skipped" and "CUDA" in by["hf-offloaded"]["error"]
    assert by["ours[hbm]"]["status"] == "skipped" and "--hbm-budget" in by["ours[hbm]"]["error"]
    runner = _runner("ours[hbm=64KiB]")
    doc = {"rows": []}
    e2e.run_rows(runner, doc, lambda: None)
    (row,) = doc["rows"]
    assert row["status"] == "ok" and row["hbm_budget"] == 65536 and row["label"] == "ours[hbm=64.0KiB]"
    assert row["hbm_kv_bytes"] > 0 and row["host_kv_bytes"] > 0


def test_a_sparse_row_runs_the_sparse_route_and_reads_fewer_bytes():
    runner = _runner("ours[host],ours[sparse=2p]", contexts=[96])
    doc = {"rows": []}
    e2e.run_rows(runner, doc, lambda: None)
    by = {r["method"]: r for r in doc["rows"]}
    assert by["ours[sparse=2p]"]["status"] == "ok", by["ours[sparse=2p]"]["error"]
    # 3 pages of 16 tokens a step (2, raised to sink + recent) against the ~98 tokens the exact rows attend over
    assert by["ours[sparse=2p]"]["kv_bytes_per_step"] * 2 < by["ours[host]"]["kv_bytes_per_step"]
    runner = _runner("ours[sparse=2p],ours[hbm,sparse=2p]", contexts=[96], hbm_budget=64 * 1024)
    doc = {"rows": []}
    e2e.run_rows(runner, doc, lambda: None)
    by = {r["method"]: r for r in doc["rows"]}
    row = by["ours[hbm,sparse=2p]"]
    assert row["status"] == "ok" and row["hbm_budget"] == 64 * 1024 and row["hbm_kv_bytes"] > 0, row["error"]
    assert row["label"] == "ours[hbm=64.0KiB,sparse=2p]"


def test_cpu_smoke_run(tmp_path, capsys):
    from bench.__main__ import main

    rc = main(["e2e", "--device", "cpu", "--out-dir", str(tmp_path), "--no-progress", "--no-plot"])
    assert rc == 0
    (path,) = tmp_path.glob("*-e2e-tiny.json")
    doc = json.loads(path.read_text())
    assert e2e.validate_doc(doc) == [], e2e.validate_doc(doc)
    assert doc["header"]["versions"]["transformers"] and doc["ceilings"]["host_read_gbps"] > 0
    rows = {(r["method"], r["context"], r["role"]): r for r in doc["rows"]}
    assert rows[("dynamic", 64, "non-attention")]["status"] == "ok"
    dyn, ours = rows[("dynamic", 128, "measured")], rows[("ours[host]", 128, "measured")]
    assert dyn["status"] == ours["status"] == "ok"
    assert ours["timed_tokens"] == 2 and len(ours["step_ms"]) == 2 and ours["prefill_s"] > 0
    assert ours["host_kv_bytes"] > 0 and ours["hbm_kv_bytes"] == 0
    assert ours["agree_tokens"] == 4  # float32 on the CPU: the same greedy tokens as DynamicCache
    assert dyn["host_kv_bytes"] == 0 and dyn["hbm_kv_bytes"] == (128 + 3) * doc["kv_token_bytes"]
    # a CPU run's timings mean nothing: no physics rows (KV at the host ceiling), no targets
    assert ("physics", 128, "computed") not in rows and doc["targets"] == []
    text = path.with_suffix(".txt").read_text()
    assert text.startswith("== e2e tiny") and "ceilings" not in text and "targets" not in text
    out = capsys.readouterr().out
    assert "ours[host]" in out and "ceilings" not in out and "MET" not in out


def test_finish_doc_on_a_gpu_adds_physics_rows_and_targets():
    """What a GPU run adds to the measured rows (the CPU smoke run adds neither): the physics row
    from the non-attention time and the host ceiling, then the targets."""
    opts = e2e.Options(preset="llama3-8b", device="cuda", dtype=torch.bfloat16, contexts=[32768], batches=[1],
                       methods=[], new_tokens=2, warmup_tokens=1, offloaded_tokens=1, prefill_chunk=64, page_size=64,
                       physics_context=4096, hbm_budget=None, time_budget_s=None, skip=True, seed=0, progress=False)
    rows = [e2e.new_row(preset="llama3-8b", method="dynamic", role="non-attention", context=4096, batch=1,
                        status="ok", decode_ms=20.0),
            e2e.new_row(preset="llama3-8b", method="ours[host]", context=32768, batch=1, status="ok", decode_ms=30.0,
                        prefill_s=1.0)]
    doc = e2e.finish_doc(_doc(rows, []), opts, token_bytes=1000)
    phys = next(r for r in doc["rows"] if r["method"] == "physics")
    kv = 32768 + 1 + 1.5
    assert phys["decode_ms"] == pytest.approx(kv * 1000 / (CEIL["host_read_gbps"] * 1e9) * 1e3 + 20.0)
    assert any(t["target"].startswith("ours[host] <= 1.15") for t in doc["targets"])
    assert e2e.finish_doc(_doc(rows, []), dataclasses.replace(opts, device="cpu"), 1000)["targets"] == []


@pytest.mark.gpu
def test_gpu_smoke_run(tmp_path):
    from bench.__main__ import main

    rc = main(["e2e", "--device", "cuda", "--preset", "tiny", "--contexts", "2048", "--batches", "1,2",
               "--new-tokens", "4", "--offloaded-tokens", "2", "--physics-context", "512", "--prefill-chunk", "512",
               "--out-dir", str(tmp_path), "--no-progress", "--no-plot"])
    assert rc == 0
    (path,) = tmp_path.glob("*-e2e-tiny.json")
    doc = json.loads(path.read_text())
    assert e2e.validate_doc(doc) == []
    ok = {r["method"] for r in doc["rows"] if r["status"] == "ok" and r["role"] == "measured"}
    assert ok == {"dynamic", "hf-offloaded", "ours[host]", "ours[hbm]"}
