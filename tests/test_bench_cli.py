"""The rules every bench command shares (CPU tests): files go under ``--out-dir`` (default
./bench-results under the current directory, never the source tree), a bad ``--out-dir`` is one
line on stderr and exit status 2 before any work, and without a GPU every GPU bench refuses with
exit status 2 (writing nothing) unless ``--device cpu`` asks for its smoke run, which prints no
ceilings and no targets."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import bench
from bench.__main__ import build_parser, main
from bench.common import DEFAULT_OUT_DIR, NO_GPU, checked_out_dir, exit_status, require_gpu

SOURCE_RESULTS = Path(bench.__file__).resolve().parent / "results"
TINY_DECODE = ["--batches", "2", "--contexts", "200", "--heads", "4/2", "--head-dim", "64", "--page-size", "16",
               "--no-progress"]
TINY_PREFIX = ["--prompt", "64", "--batches", "2", "--own-tokens", "0", "--q-lens", "1", "--no-control", "--no-hbm",
               "--no-progress"]
TINY_KVPROJ = ["--tokens", "1,5", "--hidden", "256", "--no-progress"]
TINY_FP8 = ["--contexts", "128", "--q-len", "4", "--trials", "1", "--no-e2e"]

# Every GPU bench subcommand, as a user would start it on a machine without a GPU.
GPU_COMMANDS = {
    "decode": ["decode", "--quick"], "prefill": ["prefill"], "all": ["all"], "prefix": ["prefix"],
    "kvproj": ["kvproj"], "e2e": ["e2e"], "e2e-quick": ["e2e", "--quick"],
    "regress": ["regress"], "refresh": ["refresh"],  # without --results: a fresh run
    "timeline": ["timeline", "--context", "4096", "--json"], "breakdown": ["breakdown", "--context", "4096", "--json"],
    "vllm": ["vllm"], "vllm-smoke": ["vllm", "--smoke"],
}
GPU_ONLY = {"timeline", "breakdown", "vllm", "vllm-smoke"}
# Subcommands that write files, and what a run of each needs (none of them runs here).
WRITERS = ("decode", "prefill", "all", "prefix", "kvproj", "e2e", "fp8-accuracy", "timeline", "breakdown", "plot",
           "regress", "refresh", "vllm")


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _source_results() -> list[str]:
    return _files(SOURCE_RESULTS) if SOURCE_RESULTS.exists() else []


# ---- the GPU rule ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(GPU_COMMANDS))
def test_every_gpu_bench_refuses_without_a_gpu(name, no_gpu, cwd, capsys):
    before = _source_results()
    assert main(GPU_COMMANDS[name]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(NO_GPU) and err.count("\n") == 1, err
    if name in GPU_ONLY:
        assert "no CPU run" in err and "--device cpu" not in err
    else:
        assert "Pass --device cpu for a smoke run" in err
    assert "ceiling" not in out and "MET" not in out
    assert _files(cwd) == [] and _source_results() == before  # nothing written


@pytest.mark.parametrize("name", sorted(set(GPU_COMMANDS) - GPU_ONLY - {"e2e-quick"}))
def test_asking_for_cuda_without_a_gpu_is_refused_alike(name, no_gpu, cwd, capsys):
    assert main(GPU_COMMANDS[name] + ["--device", "cuda"]) == 2
    assert capsys.readouterr().err.startswith(NO_GPU)
    assert _files(cwd) == []


@pytest.mark.parametrize("module,argv", [("compute_ab", ["8192x512", "[{}]"]), ("copy_rates", [])])
def test_the_module_benches_follow_the_same_rule(module, argv, no_gpu, cwd, capsys):
    import importlib

    mod = importlib.import_module(f"bench.{module}")
    assert exit_status(mod.main, argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(NO_GPU) and f"python -m bench.{module} needs CUDA" in err
    assert _files(cwd) == []


def test_require_gpu(no_gpu):
    assert require_gpu("cpu", command="bench x") == "cpu"
    for requested in ("auto", "cuda"):
        with pytest.raises(SystemExit) as e:
            require_gpu(requested, command="bench x")
        assert e.value.code == 2 and str(e.value).startswith(NO_GPU)
    with pytest.raises(SystemExit, match="bench y has no CPU run"):
        require_gpu("cpu", command="bench y", cpu_run=False)


def test_require_gpu_with_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert require_gpu("auto", command="bench x") == require_gpu("cuda", command="bench x") == "cuda"
    assert require_gpu(command="bench y", cpu_run=False) == "cuda"


# ---- CPU smoke runs: the default out-dir, no ceilings, no targets ------------------------------
@pytest.mark.parametrize("argv", [["decode"] + TINY_DECODE, ["prefix"] + TINY_PREFIX, ["kvproj"] + TINY_KVPROJ],
                         ids=["decode", "prefix", "kvproj"])
def test_a_cpu_run_writes_under_bench_results_and_prints_no_ceilings_or_targets(argv, no_gpu, cwd, capsys):
    before = _source_results()
    assert main(argv + ["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    files = _files(cwd)
    assert files and all(f == DEFAULT_OUT_DIR or f.startswith(DEFAULT_OUT_DIR + "/") for f in files), files
    written = [cwd / f for f in files if f.endswith((".json", ".txt"))]
    assert {p.suffix for p in written} == {".json", ".txt"} and not any(f.endswith(".png") for f in files)
    assert _source_results() == before
    for text in [out] + [p.read_text() for p in written if p.suffix == ".txt"]:
        for word in ("ceiling", "HBM read", "host read", "MET", "MISS", "target", "host_read", "hbm_read"):
            assert word not in text, (word, text)
        assert not any(line.startswith("floor ") for line in text.splitlines())
    doc = json.loads(next(p for p in written if p.suffix == ".json").read_text())
    assert doc["header"]["device"] == "cpu" and not doc.get("targets")


def test_the_e2e_cpu_run_has_no_physics_rows_or_targets(no_gpu, cwd, capsys):
    assert main(["e2e", "--device", "cpu", "--methods", "ours[host]", "--physics-context", "0", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "ceiling" not in out and "HBM read" not in out and "MET" not in out and "targets" not in out
    (path,) = (cwd / DEFAULT_OUT_DIR).glob("*-e2e-tiny.json")
    doc = json.loads(path.read_text())
    assert doc["targets"] == [] and not any(r["method"] == "physics" for r in doc["rows"])
    assert not list((cwd / DEFAULT_OUT_DIR).glob("*.png"))


def test_fp8_accuracy_needs_no_gpu_and_writes_its_plain_name(no_gpu, cwd, capsys):
    before = _source_results()
    assert main(["fp8-accuracy"] + TINY_FP8) == 0
    assert _files(cwd) == [DEFAULT_OUT_DIR, f"{DEFAULT_OUT_DIR}/cpu-fp8-accuracy.json",
                           f"{DEFAULT_OUT_DIR}/cpu-fp8-accuracy.txt"]
    assert _source_results() == before
    assert main(["fp8-accuracy", "--name", "../elsewhere"] + TINY_FP8) == 2
    assert "plain file name" in capsys.readouterr().err


# ---- --out-dir -------------------------------------------------------------------------------
def test_every_writer_takes_out_dir_with_one_default(capsys):
    parser = build_parser()
    for name in WRITERS:
        required = ["--results", "run.json"] if name == "plot" else []
        assert parser.parse_args([name] + required).out_dir == DEFAULT_OUT_DIR, name
        assert parser.parse_args([name, "--out-dir", "elsewhere"] + required).out_dir == "elsewhere"
        with pytest.raises(SystemExit):
            parser.parse_args([name, "--help"])
        assert "--out-dir" in capsys.readouterr().out
    assert DEFAULT_OUT_DIR == "bench-results" and not Path(DEFAULT_OUT_DIR).is_absolute()


def _unwritable(tmp_path: Path) -> Path:
    d = tmp_path / "locked"
    d.mkdir()
    d.chmod(0o500)
    if not os.access(d, os.W_OK):
        return d / "out"
    if not os.access("/proc/self", os.W_OK):  # root writes anywhere a mode allows; /proc it cannot
        return Path("/proc/self/out")
    pytest.skip("no unwritable directory here")


@pytest.mark.parametrize("case", ["file", "under-file", "unwritable"])
@pytest.mark.parametrize("argv", [["decode", "--device", "cpu"] + TINY_DECODE, ["prefix", "--device", "cpu"],
                                  ["kvproj", "--device", "cpu"], ["e2e", "--device", "cpu"],
                                  ["fp8-accuracy"] + TINY_FP8],
                         ids=["decode", "prefix", "kvproj", "e2e", "fp8-accuracy"])
def test_a_bad_out_dir_is_refused_before_any_work(argv, case, cwd, capsys):
    (cwd / "a-file").write_text("x")
    target = {"file": cwd / "a-file", "under-file": cwd / "a-file" / "sub"}.get(case) or _unwritable(cwd.parent)
    assert main(argv + ["--out-dir", str(target)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and f"--out-dir {target}" in err, err
    assert _files(cwd) == ["a-file"]


def test_plot_writes_under_out_dir_not_next_to_its_input(tmp_path, cwd, capsys):
    pytest.importorskip("matplotlib")
    from test_bench_plot import _doc

    from bench.common import write_json

    src = write_json(tmp_path / "in" / "run.json", _doc())
    assert main(["plot", "--results", str(src)]) == 0
    assert sorted(p.name for p in (cwd / DEFAULT_OUT_DIR).glob("*.png")) == [
        "run-decode-gbps.png", "run-decode-hybrid.png", "run-prefill.png"]
    assert not list(src.parent.glob("*.png"))
    (cwd / "a-file").write_text("x")
    assert main(["plot", "--results", str(src), "--out-dir", "a-file"]) == 2
    assert "--out-dir a-file is a file" in capsys.readouterr().err


def test_checked_out_dir_creates_nothing(tmp_path):
    target = tmp_path / "a" / "b"
    assert checked_out_dir(target) == target and not (tmp_path / "a").exists()


def test_decode_sparse_rows_are_checked_against_the_selected_pages(no_gpu, cwd, capsys, monkeypatch):
    """``--sparse-budgets``: ours[sparse=B] (checked against float32 attention over the pages the
    selection chose, host bytes those pages') and select[B] per budget; a decode that ignored the
    budget would attend every page and fail that check; a bad budget is one line, exit 2."""
    argv = ["decode", "--device", "cpu", "--batches", "2", "--contexts", "512", "--heads", "4/2", "--head-dim",
            "64", "--page-size", "16", "--hbm-fractions", "0", "--no-progress", "--sparse-budgets", "1/4,6p"]
    assert main(argv) == 0
    doc = json.loads(next(cwd.rglob("*.json")).read_text())
    recs = {r["method"]: r for r in doc["records"]}
    token_bytes = 2 * 2 * 64 * 2  # K and V, 2 KV heads, d 64, bf16
    assert recs["ours[sparse=1/4]"]["host_bytes"] == 2 * 8 * 16 * token_bytes  # 8 of 32 pages per row
    assert recs["ours[sparse=6p]"]["host_bytes"] == 2 * 6 * 16 * token_bytes
    assert all(recs[m]["ms"] for m in ("ours[sparse=1/4]", "select[1/4]", "ours[sparse=6p]", "select[6p]"))
    checks = [c for c in doc["checks"] if c["method"].startswith("ours[sparse")]
    assert len(checks) == 2 and all(c["ok"] for c in checks)

    from directkv_cute.attention import DirectKVAttention
    plan = DirectKVAttention.plan
    monkeypatch.setattr(DirectKVAttention, "plan", lambda self, *a, sparse=None, **k: plan(self, *a, **k))
    for p in cwd.rglob("*.json"):
        p.unlink()
    assert main(argv) == 1  # every page attended: not the selected pages' attention
    doc = json.loads(next(cwd.rglob("*.json")).read_text())
    assert not any(c["ok"] for c in doc["checks"] if c["method"].startswith("ours[sparse"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(argv[:-1] + ["1/0"])
    assert e.value.code == 2 and "sparse budget" in capsys.readouterr().err
