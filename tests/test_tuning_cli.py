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


def test_check_illegal_entry(capsys, tmp_path):
    out_dir = tmp_path / "profiles"
    assert model_run(capsys, out_dir)[0] == 0
    path = out_dir / MODEL_GPU_FILE
    doc = yaml.safe_load(path.read_text())
    doc["entries"][0]["buckets"][0]["config"].update(tile_n=128, stages=8)
    path.write_text(P.dump_yaml(doc))
    rc, out, _ = run(capsys, "check", "--dir", str(out_dir))
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
    assert run(capsys, "show", "--dir", str(tmp_path / "none"))[0] == 1


def test_presets_listing(capsys):
    rc, out, _ = run(capsys, "presets")
    assert rc == 0
    for name in ("llama3-8b", "llama3-70b", "qwen2.5-72b", "mistral-large"):
        assert name in out
    assert "12288" in out and "Mistral-Large-Instruct-2407" in out


def test_gpu_objective_needs_a_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    rc, _, err = run(capsys, "run", "--shape", "32,8,128,1,4096,1", "--trials", "2", "-q")
    assert rc == 2 and "needs a CUDA GPU" in err
