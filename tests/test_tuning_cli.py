"""directkv-tune through main(argv): --dry-run, a modelled run, resume, show, check, lookup."""

import json
import sys

import pytest
import yaml

from directkv_cute.tuning import cli
from directkv_cute.tuning import lookup as L
from directkv_cute.tuning import profiles as P

MODEL_GPU_FILE = "Modelled_H200_PCIe5.yaml"


@pytest.fixture(autouse=True)
def isolated(monkeypatch, tmp_path):
    monkeypatch.setenv(cli.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(P.PROFILE_DIR_ENV, str(tmp_path / "envprofiles"))
    monkeypatch.delenv(L.REQUIRE_ENV, raising=False)
    L.clear_cache()
    yield
    L.clear_cache()


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def model_run(capsys, out_dir, *extra):
    return run(capsys, "run", "--objective", "model", "--shape", "64,8,128,1,4096,1", "--shape", "64,8,128,16,4096,1",
               "--trials", "5", "--output", str(out_dir), "-q", *extra)


def test_dry_run_preset(capsys):
    rc, out, _ = run(capsys, "--preset", "llama3-8b", "--dry-run")  # 'run' is the default subcommand
    assert rc == 0
    assert "space hash" in out and "tile_n" in out and "consumer_wgs = 1 if group*q_len <= 64" in out
    assert "2048 legal of 4032" in out and "SMEM over the carveout budget" in out
    assert "16 bucket(s)" in out and "131072" in out and "nothing was run" in out


def test_dry_run_shapes_and_dedupe(capsys):
    rc, out, _ = run(capsys, "run", "--dry-run", "--preset", "llama3-70b", "--preset", "qwen2.5-72b",
                     "--shape", "64,8,128,2,1000,1", "--contexts", "4096", "--batches", "1,4")
    assert rc == 0 and "3 bucket(s)" in out and "1000" in out


def test_dry_run_multi_token_kernel(capsys):
    rc, out, _ = run(capsys, "run", "--dry-run", "--kernel", "multi_token", "--preset", "llama3-8b", "--q-lens", "64,256",
                     "--batches", "1", "--contexts", "32768")
    assert rc == 0 and "kernel multi_token" in out and "2571912 points" in out and "2 bucket(s)" in out


def test_prefill_is_a_deprecated_alias_of_multi_token(capsys):
    """--kernel prefill (the multi-token kernel's old name) still works, says so, and --help
    names it as deprecated."""
    rc, out, err = run(capsys, "run", "--dry-run", "--kernel", "prefill", "--preset", "llama3-8b", "--q-lens", "64",
                       "--batches", "1", "--contexts", "32768")
    assert rc == 0 and "kernel multi_token" in out and "--kernel prefill is deprecated" in err
    with pytest.raises(SystemExit):
        run(capsys, "run", "--help")
    assert "'prefill' is a deprecated alias of multi_token" in " ".join(capsys.readouterr().out.split())


def test_bad_arguments(capsys):
    assert run(capsys, "run", "--dry-run")[0] == 2
    rc, _, err = run(capsys, "run", "--dry-run", "--preset", "gpt-5")
    assert rc == 2 and "unknown preset" in err
    with pytest.raises(SystemExit):
        cli.main(["run", "--shape", "64,8,128,1,4096"])  # five numbers
    with pytest.raises(SystemExit):
        cli.main(["run", "--shape", "60,8,128,1,4096,1"])  # 60 heads over 8 KV heads


def test_model_run_writes_profile_show_and_check(capsys, tmp_path, monkeypatch):
    out_dir = tmp_path / "profiles"
    rc, out, _ = model_run(capsys, out_dir)
    assert rc == 0, out
    assert "tuned us" in out and "default us" in out and "speedup" in out
    path = out_dir / MODEL_GPU_FILE
    assert f"profile: {path}" in out
    prof = P.load_profile(path)
    assert len(prof) == 2 and prof.metadata["objective"] == "model"
    assert {bk for _, bk, _ in prof.records()} == {(1, 4096, 1), (16, 4096, 1)}

    rc, out, _ = run(capsys, "show", "--dir", str(out_dir))
    assert rc == 0 and "Modelled H200 PCIe5" in out and "decode" in out and "default us" in out
    rc, out, _ = run(capsys, "show", "--dir", str(out_dir), "--format", "json")
    doc = json.loads(out)[str(path)]
    assert doc["schema_version"] == 3 and len(doc["entries"][0]["buckets"]) == 2
    rc, out, _ = run(capsys, "show", str(path), "--format", "yaml")
    assert yaml.safe_load(out)[str(path)]["metadata"]["gpu_name"] == "Modelled H200 PCIe5"

    rc, out, _ = run(capsys, "check", "--dir", str(out_dir))
    assert rc == 0 and out.startswith("OK") and "2 bucket(s)" in out

    with pytest.warns(P.ProfileWarning, match="no profile file"):
        rc, out, _ = run(capsys, "lookup", "--gpu", "Modelled H200 PCIe5", "--shape", "64,8,128,16,4096,1")
    assert rc == 0 and "source:  default" in out  # not in the lookup's folders
    L.clear_cache()
    monkeypatch.setenv(P.PROFILE_DIR_ENV, str(out_dir))
    rc, out, _ = run(capsys, "lookup", "--gpu", "Modelled H200 PCIe5", "--shape", "64,8,128,16,4096,1")
    assert rc == 0 and "source:  exact" in out
    rc, out, _ = run(capsys, "lookup", "--gpu", "Modelled H200 PCIe5", "--shape", "64,8,128,12,5000,1")
    assert rc == 0 and "source:  nearest" in out and "batch=16 context=4096" in out


def test_model_run_without_output_writes_nothing(capsys, tmp_path):
    rc, out, _ = run(capsys, "run", "--objective", "model", "--shape", "32,8,128,1,4096,1", "--trials", "3", "-q")
    assert rc == 0 and "not written" in out
    assert not list(tmp_path.rglob("*.yaml"))


def test_resume_continues_the_journal(capsys, tmp_path):
    out_dir = tmp_path / "profiles"
    journal = tmp_path / "cache" / "tune" / "tune-Modelled_H200_PCIe5-decode-model.journal"
    rc, out, _ = model_run(capsys, out_dir)
    assert rc == 0 and journal.exists()
    rc, out, _ = model_run(capsys, out_dir, "--trials", "8", "--resume")
    assert rc == 0
    prof = P.load_profile(out_dir / MODEL_GPU_FILE)
    assert {r["trials"] for _, _, r in prof.records()} == {8}
    # a run without --resume starts a fresh journal and keeps the old one aside
    rc, _, err = model_run(capsys, out_dir)
    assert rc == 0 and journal.with_suffix(".journal.prev").exists() and "--resume" in err
    # an explicit --storage journal is continued
    store = tmp_path / "mine.journal"
    assert model_run(capsys, out_dir, "--storage", str(store))[0] == 0
    assert model_run(capsys, out_dir, "--storage", str(store), "--trials", "7")[0] == 0
    prof = P.load_profile(out_dir / MODEL_GPU_FILE)
    assert {r["trials"] for _, _, r in prof.records()} == {7}


def test_check_reports_bad_files(capsys, tmp_path):
    out_dir = tmp_path / "profiles"
    assert model_run(capsys, out_dir)[0] == 0
    (out_dir / "Broken.yaml").write_text("schema_version: 1\nmetadata: [")
    rc, out, _ = run(capsys, "check", "--dir", str(out_dir))
    assert rc == 1 and "INVALID" in out and "Broken.yaml" in out and "corrupt YAML" in out
    assert f"OK      {out_dir / MODEL_GPU_FILE}" in out
    # a file whose name does not match its GPU
    (out_dir / "Broken.yaml").unlink()
    (out_dir / "NVIDIA_H200.yaml").write_text((out_dir / MODEL_GPU_FILE).read_text())
    rc, out, _ = run(capsys, "check", "--dir", str(out_dir))
    assert rc == 1 and "does not match gpu_name" in out
    # show still prints valid files and reports the bad one
    (out_dir / "NVIDIA_H200.yaml").write_text("nope: [")
    rc, out, err = run(capsys, "show", "--dir", str(out_dir))
    assert rc == 1 and "Modelled H200 PCIe5" in out and "corrupt" in err


def _check_after_editing(capsys, tmp_path, edit):
    """``check`` of a model-run profile whose first entry ``edit(entry)`` changed: (rc, out)."""
    out_dir = tmp_path / "profiles"
    assert model_run(capsys, out_dir)[0] == 0
    path = out_dir / MODEL_GPU_FILE
    doc = yaml.safe_load(path.read_text())
    edit(doc["entries"][0])
    path.write_text(P.dump_yaml(doc))
    rc, out, _ = run(capsys, "check", "--dir", str(out_dir))
    return rc, out


def test_check_illegal_entry(capsys, tmp_path):
    rc, out = _check_after_editing(capsys, tmp_path, lambda e: e["buckets"][0]["config"].update(tile_n=128, stages=8))
    assert rc == 1 and "ILLEGAL" in out and "per-block limit" in out


def test_check_lists_stale_entries_and_fails_only_on_invalid_ones(capsys, tmp_path, monkeypatch):
    out_dir = tmp_path / "profiles"
    assert model_run(capsys, out_dir)[0] == 0
    path = out_dir / MODEL_GPU_FILE
    doc = yaml.safe_load(path.read_text())
    doc["entries"][0]["buckets"][0]["kernel_hash"] = "0" * 64
    path.write_text(P.dump_yaml(doc))
    rc, out, _ = run(capsys, "check", "--dir", str(out_dir))
    assert rc == 0 and out.startswith("OK") and "1 stale" in out, out
    stale = [ln for ln in out.splitlines() if ln.startswith("  stale")]
    assert len(stale) == 2 and "(1, 4096, 1)" in stale[0] and "000000000000" in stale[0]
    assert "directkv-tune run --kernel decode" in stale[1]
    # the same stale entry, illegal under the current rules: a failure
    import directkv_cute.config as C

    monkeypatch.setattr(C, "SUPPORTED_PAGE_SIZES", (16, 32))
    rc, out, _ = run(capsys, "check", "--dir", str(out_dir))
    assert rc == 1 and "ILLEGAL" in out and "page_size 64 not in" in out and "1 stale" in out


def test_check_notes_a_schema_1_file(capsys, tmp_path):
    out_dir = tmp_path / "profiles"
    assert model_run(capsys, out_dir)[0] == 0
    path = out_dir / MODEL_GPU_FILE
    doc = yaml.safe_load(path.read_text())
    doc["schema_version"] = 1
    doc["metadata"]["kernel_hash"] = "1" * 64  # a hash over every file in kernels/, as schema 1 had
    for b in doc["entries"][0]["buckets"]:
        b.pop("kernel_hash")
    path.write_text(P.dump_yaml(doc))
    rc, out, _ = run(capsys, "check", "--dir", str(out_dir))
    assert rc == 0 and "schema 1 file" in out and "2 stale" in out


def test_check_compile_missing_module(capsys, tmp_path, monkeypatch):
    out_dir = tmp_path / "profiles"
    assert model_run(capsys, out_dir)[0] == 0
    monkeypatch.setitem(sys.modules, "directkv_cute.kernels.jit", None)  # as if the file did not exist
    rc, out, _ = run(capsys, "check", "--dir", str(out_dir), "--compile")
    assert rc == 1
    assert "directkv_cute.kernels.jit does not exist" in out


def test_check_compile_calls_compile_decode_per_entry(capsys, tmp_path, monkeypatch):
    out_dir = tmp_path / "profiles"
    assert model_run(capsys, out_dir)[0] == 0
    calls = []

    def fake_compile(cfg, dtype, head_dim, page_size, group, max_q_len):
        calls.append((cfg, str(dtype), head_dim, page_size, group, max_q_len))
        if len(calls) == 2:
            raise RuntimeError("ptxas: too many resources")

    monkeypatch.setattr(cli, "_resolve_compile", lambda: (fake_compile, ""))
    rc, out, _ = run(capsys, "check", "--dir", str(out_dir), "--compile")
    assert rc == 1 and "COMPILE FAILED" in out and "too many resources" in out
    assert len(calls) == 2
    assert all(c[1:] == ("torch.bfloat16", 128, 64, 8, 1) for c in calls)


def test_show_and_check_empty_dir(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    rc, out, _ = run(capsys, "show", "--dir", str(tmp_path / "empty"))
    assert rc == 0 and "no profiles found" in out
    rc, out, _ = run(capsys, "check", "--dir", str(tmp_path / "empty"))
    assert rc == 0 and "no profiles found" in out
    # a folder that does not exist is an error (tests/test_tuning_hardening.py)
    assert run(capsys, "show", "--dir", str(tmp_path / "none"))[0] == 2


def test_presets_listing(capsys):
    rc, out, _ = run(capsys, "presets")
    assert rc == 0
    for name in ("llama3-8b", "llama3-70b", "qwen2.5-72b", "mistral-large", "qwen2.5-7b"):
        assert name in out
    assert "12288" in out and "Mistral-Large-Instruct-2407" in out and "Qwen/Qwen2.5-7B" in out
    assert "--kernel q_tiled: every preset with batches 1, contexts 8192,32768,131072, q_lens 512,2048,8192" in out


def test_gpu_objective_needs_a_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    rc, _, err = run(capsys, "run", "--shape", "32,8,128,1,4096,1", "--trials", "2", "-q")
    assert rc == 2 and "needs a CUDA GPU" in err


# ---- the Q-tiled kernel ------------------------------------------------------------------------


def test_dry_run_q_tiled_takes_its_own_buckets(capsys):
    rc, out, _ = run(capsys, "run", "--dry-run", "--kernel", "q_tiled", "--preset", "llama3-8b", "--preset", "qwen2.5-7b",
                     "--page-size", "16")
    assert rc == 0 and "kernel q_tiled" in out and "72 points" in out and "cluster" in out and "pingpong" in out
    assert "18 bucket(s)" in out and "52 legal of 72" in out and "page=16" in out
    assert "fixed: no field (the planner picks the staging pieces" in out
    # q_len 1 buckets are decode steps: left out, said so
    rc, out, err = run(capsys, "run", "--dry-run", "--kernel", "q_tiled", "--preset", "llama3-70b", "--q-lens", "1,512",
                       "--contexts", "32768")
    assert rc == 0 and "1 bucket(s)" in out and "left out 1 bucket(s) with q_len 1" in err and "--kernel decode" in err


def test_q_tiled_model_run_check_and_lookup(capsys, tmp_path, monkeypatch):
    """directkv-tune run --kernel q_tiled --objective model writes q_tiled entries; check validates
    them (and compiles each in the three variants the op launches), lookup serves them."""
    out_dir = tmp_path / "profiles"
    rc, out, _ = run(capsys, "run", "--kernel", "q_tiled", "--preset", "llama3-8b", "--objective", "model",
                     "--contexts", "8192,32768", "--q-lens", "512,2048", "--trials", "3", "--exhaustive-threshold", "0",
                     "--output", str(out_dir), "-q")
    assert rc == 0, out
    assert "4 bucket(s) of q_tiled" in out and "cl2" in out
    prof = P.load_profile(out_dir / MODEL_GPU_FILE)
    assert {ck for ck, _, _ in prof.records()} == {("q_tiled", "bf16", 128, 4, 64)}
    assert {bk for _, bk, _ in prof.records()} == {(1, c, q) for c in (8192, 32768) for q in (512, 2048)}
    assert {r["trials"] for _, _, r in prof.records()} == {3} and not prof.stale()

    rc, out, _ = run(capsys, "check", "--dir", str(out_dir))
    assert rc == 0 and out.startswith("OK") and "4 bucket(s)" in out
    from directkv_cute.kernels import jit

    calls = []
    monkeypatch.setattr(cli, "_resolve_compile", lambda: (lambda *a, **k: pytest.fail("compile_decode"), ""))
    monkeypatch.setattr(jit, "compile_q_tiled", lambda cfg, dtype, d, page, group, wr, so: calls.append(
        (type(cfg).__name__, str(dtype), d, page, group, wr, so)))
    rc, out, _ = run(capsys, "check", "--dir", str(out_dir), "--compile")
    assert rc == 0 and "4 compiled" in out
    assert len(calls) == 12 and {c[:5] for c in calls} == {("QTiledConfig", "torch.bfloat16", 128, 64, 4)}
    assert {c[5:] for c in calls} == {(False, False), (True, True), (True, False)}

    monkeypatch.setenv(P.PROFILE_DIR_ENV, str(out_dir))
    L.clear_cache()
    rc, out, _ = run(capsys, "lookup", "--gpu", "Modelled H200 PCIe5", "--kernel", "q_tiled",
                     "--shape", "32,8,128,1,32768,2048")
    assert rc == 0 and "kernel:  q_tiled (the op runs it for multi-token calls" in out and "source:  exact" in out
    rc, out, _ = run(capsys, "lookup", "--gpu", "Modelled H200 PCIe5", "--kernel", "q_tiled",
                     "--shape", "32,8,128,1,100000,4096")
    assert rc == 0 and "source:  nearest" in out and "context=32768 q_len=2048" in out


def test_check_refuses_a_foreign_q_tiled_entry(capsys, tmp_path):
    """A q_tiled entry holding another kernel's config (decode fields) is INVALID, with the fields."""
    rc, out = _check_after_editing(capsys, tmp_path, lambda e: e.update(kernel="q_tiled"))
    assert rc == 1 and "INVALID" in out and "unknown QTiledConfig fields" in out and "num_splits" in out
    # an illegal q_tiled config (a ring beyond SMEM) is ILLEGAL, named
    def illegal(entry):
        entry.update(kernel="q_tiled", buckets=entry["buckets"][:1])
        entry["buckets"][0]["config"] = {"tile_n": 128, "stages": 4}

    rc, out = _check_after_editing(capsys, tmp_path / "illegal", illegal)
    assert rc == 1 and "ILLEGAL" in out and "q_tiled" in out and "per-block limit" in out


def test_bench_check_compiles_and_validates_q_tiled_profile_entries(capsys, tmp_path, monkeypatch):
    """``python -m bench check`` (b2): the q_tiled entries of the shipped profiles compile in every
    variant the op launches, next to the default (an entry that is the default is compiled once);
    (a): an entry the kernel cannot run fails the profile part."""
    import dataclasses
    import re
    from pathlib import Path

    import bench.check as check
    from directkv_cute.config import QTiledConfig

    prof = P.Profile(metadata={"gpu_name": "X", "tune_version": P.TUNE_VERSION})
    rec = lambda cfg: {"config": cfg.to_dict(), "p50_us": 1.0, "trials": 1, "kernel_hash": "a" * 64}  # noqa: E731
    tuned = QTiledConfig(tile_n=64, stages=2)
    prof.set(("q_tiled", "bf16", 128, 4, 64), (1, 32768, 2048), rec(tuned))
    prof.set(("q_tiled", "bf16", 128, 4, 64), (1, 8192, 512), rec(QTiledConfig()))  # the default's kernels
    prof.set(("q_tiled", "bf16", 128, 7, 16), (1, 8192, 512), rec(tuned))
    loaded = [(Path("NVIDIA_H200.yaml"), prof)]
    assert check.profile_legality_problems(prof) == []
    targets = check.q_tiled_targets(loaded)
    n_default = sum(t[-1] == "default" for t in targets)
    assert len(targets) == n_default + 3 * 5  # each entry's 3 variants, and its 2 staged ones without the cluster
    calls = []

    def fake(cfg, dtype, d, page, group, wait_ready, fold):
        calls.append((cfg, d, page, group, wait_ready, fold))
        if group == 7 and wait_ready and fold:
            raise RuntimeError("ptxas: boom\nsecond line")

    monkeypatch.setattr(check, "resolve_q_tiled", lambda: fake)
    n, problems = check.compile_q_tiled_targets(False, loaded)
    assert n == len(calls) == len(set(calls)) == n_default + 2 * 5  # the default entry's kernels once
    assert {c[1:] for c in calls if c[0] == tuned} == {(128, 64, 4, wr, so) for wr, so in check.Q_TILED_VARIANTS} | {
        (128, 16, 7, wr, so) for wr, so in check.Q_TILED_VARIANTS}
    one_tile = dataclasses.replace(tuned, cluster=1)
    assert {c[1:] for c in calls if c[0] == one_tile} == {(128, p, g, True, so) for p, g in ((64, 4), (16, 7))
                                                          for so in (True, False)}
    assert problems == [f"q_tiled bfloat16 d128 page16 group7 wait_ready=True fold=True (NVIDIA_H200.yaml) "
                        f"{cfg}: RuntimeError: ptxas: boom" for cfg in (tuned, one_tile)]

    # through run_check: the part's line counts the entries
    monkeypatch.setattr(check, "load_shipped_profiles", lambda d=None: ([], loaded, []))
    monkeypatch.setattr(check, "compile_targets", lambda targets, progress=True: ([], []))
    calls.clear()
    assert check.run_check(traffic=False, progress=False, fp8=False) == 1
    out = capsys.readouterr().out
    assert re.search(rf"== \(b2\) Q-tiled kernel, the op's default config and 3 profile entries: {n} kernels", out)
    # a q_tiled entry the kernel cannot run fails the profile part
    prof.set(("q_tiled", "bf16", 128, 4, 64), (1, 131072, 8192), rec(dataclasses.replace(tuned, stages=4, tile_n=128)))
    problems = check.profile_legality_problems(prof)
    assert len(problems) == 1 and "('q_tiled', 'bf16', 128, 4, 64) (1, 131072, 8192)" in problems[0]
