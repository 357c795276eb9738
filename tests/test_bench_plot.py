"""``python -m bench plot``: PNG plots of a saved results JSON (for runs made where matplotlib is
not installed), and a clear exit 2 when it cannot plot."""

from __future__ import annotations

import json

import pytest

from bench.__main__ import main
from bench.common import Ceilings, Shape, make_record, new_results, write_json

CEIL = Ceilings(host_read_gbps=50.0, hbm_read_gbps=4000.0, memcpy_h2d_gbps=54.0)
HEADER = {"gpu": "NVIDIA H200", "gpu_key": "NVIDIA_H200", "date": "2026-11-30", "versions": {"torch": "x"}}


def _doc(measured: bool = True) -> dict:
    doc = new_results("all", HEADER, CEIL)
    for ctx in (8192, 32768):
        for bench, batch, q in (("decode", 1, 1), ("prefill", 1, 512), ("prefill", 1, 2048)):
            shape = Shape(bench, batch, ctx, q, 32, 8, 128, "bfloat16")
            for method, ms in (("ours", 3.0), ("swap", 3.3), ("zero_copy", 9.0), ("hbm", 0.2)):
                doc["records"].append(make_record(shape, method, ms if measured else None, CEIL,
                                                  host_bytes=shape.kv_bytes).to_dict())
            if bench == "decode":  # the hybrid plot: ours with half the pages in HBM
                half = shape.kv_bytes // 2
                doc["records"].append(make_record(shape, "ours", 1.6 if measured else None, CEIL, host_bytes=half,
                                                  hbm_bytes=half, hbm_fraction=0.5).to_dict())
    return doc


def test_plot_writes_the_decode_and_prefill_pngs(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = write_json(tmp_path / "run.json", _doc())
    assert main(["plot", "--results", str(path), "--out-dir", str(tmp_path)]) == 0
    names = sorted(p.name for p in tmp_path.glob("*.png"))
    assert names == ["run-decode-gbps.png", "run-decode-hybrid.png", "run-prefill.png"]
    for p in tmp_path.glob("*.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 1000
    assert capsys.readouterr().out.count(".png") == 3
    # another prefix
    assert main(["plot", "--results", str(path), "--prefix", str(tmp_path / "x")]) == 0
    assert (tmp_path / "x-prefill.png").exists()


def test_plot_refuses_what_it_cannot_plot(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["plot", "--results", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text(json.dumps({"records": []}))
    assert main(["plot", "--results", str(tmp_path / "bad.json")]) == 2
    assert "not a results document" in capsys.readouterr().err
    path = write_json(tmp_path / "run.json", _doc())
    import bench.plots

    monkeypatch.setattr(bench.plots, "_pyplot", lambda: None)
    assert main(["plot", "--results", str(path)]) == 2
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert not list(tmp_path.rglob("*.png")) and not (tmp_path / "bench-results").exists()


def test_plot_refuses_a_run_without_measurements(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    path = write_json(tmp_path / "run.json", _doc(measured=False))
    assert main(["plot", "--results", str(path)]) == 2
    assert "no measured decode or prefill records" in capsys.readouterr().err
    assert not list(tmp_path.rglob("*.png")) and not (tmp_path / "bench-results").exists()
