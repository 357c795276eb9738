"""``directkv-generate`` refuses what a user can get wrong: one line on stderr, exit status 2, no
traceback, nothing written, and (except for running out of memory) before any model loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("transformers")

from directkv_cute import generate as gen  # noqa: E402

TINY = ["--preset", "tiny", "--device", "cpu", "--no-progress"]


def _refused(argv, capsys, tmp_path, *, json_arg=True) -> str:
    """Run the command expecting a usage error; return its one-line message."""
    out = tmp_path / "out" / "run.json"
    with pytest.raises(SystemExit) as e:
        gen.main(list(argv) + (["--json", str(out)] if json_arg else []))
    assert e.value.code == 2
    cap = capsys.readouterr()
    assert cap.err.startswith("directkv-generate: error: ") and cap.err.endswith("\n")
    assert cap.err.count("\n") == 1, cap.err  # one line: no usage block, no traceback
    assert cap.out == ""  # refused before the model loads (it prints a line when it has)
    assert not (tmp_path / "out").exists()  # nothing written
    return cap.err


def _no_model_built(monkeypatch):
    """Any model construction fails the test: refusals come before it."""
    import directkv_cute.presets as presets

    def boom(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr(presets, "build_random_model", boom)


def test_help_describes_every_option(capsys):
    p = gen.build_parser()
    for action in p._actions:
        assert action.help and len(action.help) > 10, action.option_strings
    with pytest.raises(SystemExit) as e:
        gen.main(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "CPU only" not in text
    for words in ("pinned host memory", "Hugging Face model folder", "nothing is downloaded", "FP8 GPU kernels",
                  "float8_e4m3fn", "--hbm-budget", "max_position_embeddings", "exit status 2", "tiny",
                  "llama3-70b", "decode progress bars"):
        assert words in text, words


def test_sizes_that_are_not_numbers(capsys, tmp_path, monkeypatch):
    _no_model_built(monkeypatch)
    assert "'1e400' is not a finite size" in _refused(TINY + ["--hbm-budget", "1e400"], capsys, tmp_path)
    assert "--hbm-budget" in _refused(TINY + ["--hbm-budget", "lots"], capsys, tmp_path)
    assert "invalid int value" in _refused(TINY + ["--context", "1e3"], capsys, tmp_path)


def test_hbm_budget_beyond_memory(capsys, tmp_path, monkeypatch):
    _no_model_built(monkeypatch)
    err = _refused(TINY + ["--hbm-budget", "100TB"], capsys, tmp_path)
    assert "--hbm-budget 100TB (90.95 TiB) is more than this machine's memory" in err


@pytest.mark.parametrize("extra,words", [
    (["--max-new-tokens", "131000"], "the prompt (512 tokens) + --max-new-tokens 131000 = 131512 tokens"),
    (["--context", "131072", "--max-new-tokens", "1"], "= 131073 tokens"),
    (["--context", str(10**30)], f"the prompt ({10**30} tokens)"),
    (["--max-new-tokens", str(10**30)], f"--max-new-tokens {10**30}"),
])
def test_request_beyond_max_position_embeddings(capsys, tmp_path, monkeypatch, extra, words):
    _no_model_built(monkeypatch)
    err = _refused(TINY + extra, capsys, tmp_path)
    assert words in err and "beyond the model's max_position_embeddings 131072" in err


def test_kv_cache_beyond_host_memory(capsys, tmp_path, monkeypatch):
    _no_model_built(monkeypatch)
    # 10**8 rows of 1032 tokens: 17 pages each + 1, 131072 bytes a page (2 layers, 2 KV heads, 64 x fp32)
    err = _refused(TINY + ["--context", "1000", "--batch", str(10**8)], capsys, tmp_path)
    need = (10**8 * 1032 // 64 + 10**8) * 131072
    assert f"{10**8} x (1000 + 32) tokens need" in err and "of host memory on the CPU" in err
    window = (8192 // 64 + 2 * 10**8) * 131072  # DirectKVCache's write window, in CPU memory on the CPU
    params = 2 * 1024 * 256 + 2 * (256 * 512 * 2 + 256 * 128 * 2 + 3 * 256 * 512 + 2 * 256) + 256
    weights = 4 * params + 2 * 4 * 32  # fp32, and the rotary inv_freq / original_inv_freq buffers
    assert f"({need + window + weights} bytes)" in err
    # a preset whose weights alone exceed the memory
    memory = gen.host_memory()
    if memory is not None and memory < 250 << 30:
        assert "weights 262.83 GiB" in _refused(["--preset", "llama3-70b", "--device", "cpu", "--context", "64"],
                                               capsys, tmp_path)


def test_page_counts_beyond_int32(capsys, tmp_path, monkeypatch):
    _no_model_built(monkeypatch)
    err = _refused(TINY + ["--context", "1000", "--batch", str(10**17)], capsys, tmp_path)
    assert "needs more than 2147483647 pages of 64 tokens (int32 page ids)" in err


@pytest.mark.parametrize("extra,words", [
    (["--context", "0"], "--context must be >= 1, got 0"),
    (["--batch", "-2"], "--batch must be >= 1, got -2"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--prefill-chunk", "-1"], "--prefill-chunk must be >= 0"),
    (["--sink-pages", "-1"], "--sink-pages must be >= 0"),
    (["--page-size", "48"], "invalid choice: 48"),
    (["--prompt", "hi"], "--prompt needs a tokenizer"),
])
def test_counts_out_of_range(capsys, tmp_path, monkeypatch, extra, words):
    _no_model_built(monkeypatch)
    assert words in _refused(TINY + extra, capsys, tmp_path)


@pytest.mark.parametrize("seed", [str(10**23), "-1", str(2**64)])
def test_seeds_out_of_range(capsys, tmp_path, monkeypatch, seed):
    _no_model_built(monkeypatch)
    assert f"--seed must be in [0, {2**64 - 1}] (2**64 - 1), got {seed}" in _refused(TINY + ["--seed", seed],
                                                                                   capsys, tmp_path)


@pytest.mark.parametrize("extra,words", [
    (["--temperature", "-1"], "--temperature must be a finite number > 0, got -1.0"),
    (["--temperature", "0"], "--temperature must be a finite number > 0, got 0.0"),
    (["--temperature", "inf"], "--temperature must be a finite number > 0, got inf"),
    (["--top-k", "-3"], "--top-k must be >= 0, got -3"),
    (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    (["--top-p", "nan"], "--top-p must be in (0, 1], got nan"),
])
def test_sampling_options_out_of_range(capsys, tmp_path, monkeypatch, extra, words):
    _no_model_built(monkeypatch)
    assert words in _refused(TINY + ["--sample"] + extra, capsys, tmp_path)


def test_devices_that_do_not_exist(capsys, tmp_path, monkeypatch):
    _no_model_built(monkeypatch)
    argv = ["--preset", "tiny", "--no-progress"]
    assert "--device cpu:99: the CPU has no device index" in _refused(argv + ["--device", "cpu:99"], capsys, tmp_path)
    assert "only cuda, cuda:N and cpu" in _refused(argv + ["--device", "meta"], capsys, tmp_path)
    assert "--device 'gpu0'" in _refused(argv + ["--device", "gpu0"], capsys, tmp_path)
    # a machine with one GPU: cuda:3 is refused before anything touches it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    err = _refused(argv + ["--device", "cuda:3"], capsys, tmp_path)
    assert "--device cuda:3: this machine has 1 CUDA device (cuda:0)" in err


def test_gpu_memory_checked_before_the_model_loads(capsys, tmp_path, monkeypatch):
    """On a GPU (one with 80 GiB, 8 GiB of it free, as torch.cuda reports it): a budget beyond
    the GPU, weights plus the HBM tier beyond its free memory, pinned KV beyond the machine."""
    _no_model_built(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (8 << 30, 80 << 30))
    gpu = ["--device", "cuda", "--no-progress"]
    err = _refused(["--preset", "tiny", "--hbm-budget", "100TB"] + gpu, capsys, tmp_path)
    assert "--hbm-budget 100TB (90.95 TiB) is more than the memory of cuda (80.00 GiB)" in err
    err = _refused(["--preset", "llama3-8b", "--context", "64"] + gpu, capsys, tmp_path)
    weights = 2 * 8_030_261_248 + 2 * 4 * 64  # bf16 parameters of Llama 3 8B, fp32 rotary buffers
    assert f"the weights ({gen.format_bytes(weights)}) and the cache's HBM tier and window" in err
    assert "cuda has 8.00 GiB free" in err
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 << 30, 80 << 30))
    memory = gen.host_memory()
    if memory is not None and memory < 1 << 40:
        err = _refused(["--preset", "llama3-8b", "--context", "131000", "--batch", "64"] + gpu, capsys, tmp_path)
        # 64 rows of 131032 tokens in pages of 64, a partial page per row; 32 layers x 8 KV heads x K/V x
        # 64 tokens x 128 x bf16 a page
        host = (64 * 131032 // 64 + 64) * (32 * 8 * 2 * 64 * 128 * 2)
        assert f"a KV cache for 64 x (131000 + 32) tokens needs 1.00 TiB ({host} bytes) of pinned host memory" in err


def test_model_paths_that_are_not_model_folders(capsys, tmp_path):
    argv = ["--context", "8", "--device", "cpu", "--no-progress"]
    err = _refused(["--model", str(tmp_path / "nope")] + argv, capsys, tmp_path)
    assert "nope: no such folder" in err
    (tmp_path / "file").write_text("x")
    assert "file: not a folder" in _refused(["--model", str(tmp_path / "file")] + argv, capsys, tmp_path)
    folder = tmp_path / "folder"
    folder.mkdir()
    assert "no config.json, not a Hugging Face model folder" in _refused(["--model", str(folder)] + argv, capsys,
                                                                        tmp_path)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    assert "no weight files" in _refused(["--model", str(folder)] + argv, capsys, tmp_path)
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "config.json").write_text("{not json")
    assert "cannot read config.json" in _refused(["--model", str(folder)] + argv, capsys, tmp_path)
    # a real config with a weights file that is not one: refused when transformers reads it
    from directkv_cute.presets import preset_config

    preset_config("tiny").save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(SystemExit) as e:
        gen.main(["--model", str(folder), "--json", str(tmp_path / "out" / "run.json")] + argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"directkv-generate: error: --model {folder}: cannot load the model: ")
    assert err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_json_paths_that_cannot_be_written(capsys, tmp_path, monkeypatch):
    _no_model_built(monkeypatch)
    folder = tmp_path / "results"
    folder.mkdir()
    err = _refused(TINY + ["--json", str(folder)], capsys, tmp_path, json_arg=False)
    assert list(folder.iterdir()) == []
    assert "is a folder (give a file name)" in err
    (tmp_path / "afile").write_text("x")
    err = _refused(TINY + ["--json", str(tmp_path / "afile" / "sub" / "run.json")], capsys, tmp_path,
                   json_arg=False)
    assert f"{tmp_path / 'afile'} is a file, not a folder" in err
    assert (tmp_path / "afile").read_text() == "x"
    # a read-only folder: chmod for a user; root writes anywhere but in /proc
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        target = locked / "run.json"
    elif os.path.isdir("/proc/self"):
        target = "/proc/directkv-generate-test.json"
    else:
        pytest.skip("no read-only folder to try")
    err = _refused(TINY + ["--json", str(target)], capsys, tmp_path, json_arg=False)
    assert f"--json {target}: cannot write in" in err
    assert not os.path.exists(target)


_CAPPED = textwrap.dedent("""
    import resource, sys
    import transformers, directkv_cute.hf
    from directkv_cute import generate
    vm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize:")) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + (600 << 20), resource.RLIM_INFINITY))
    sys.exit(generate.main(sys.argv[1:]))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/status")
@pytest.mark.parametrize("extra,words", [
    # the KV cache asks for 1 GiB: 8 x 65568 tokens in (8 * 65568 / 64 + 8) pages of 131072 bytes
    (["--context", "65536", "--batch", "8"],
     "out of memory allocating the KV cache (1.00 GiB of host memory, 18.00 MiB on cpu): cannot allocate and pin "
     "1075314688 bytes"),
    # the cache fits (128 MiB); one prefill forward over 65536 tokens does not
    (["--context", "65536", "--prefill-chunk", "0", "--max-new-tokens", "2"],
     "out of memory while generating (1 x 65536 prompt tokens, prefill chunk 65536; a smaller --prefill-chunk or "
     "--batch needs less): "),
])
def test_allocation_failure_is_one_line(tmp_path, extra, words):
    """Real allocation failures: the process's address space is capped 600 MiB above what it
    uses once imported."""
    out = tmp_path / "run.json"
    r = subprocess.run([sys.executable, "-c", _CAPPED, *TINY, *extra, "--json", str(out)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("directkv-generate: error: " + words), r.stderr
    assert "allocate" in r.stderr  # the allocator's own words, with the bytes it asked for
    assert not out.exists()


def test_json_is_replaced_whole(tmp_path, capsys):
    out = tmp_path / "sub" / "run.json"
    argv = TINY + ["--context", "16", "--max-new-tokens", "2"]
    assert gen.main(argv + ["--json", str(out)]) == 0
    first = json.loads(out.read_text())
    assert gen.main(argv + ["--seed", "1", "--json", str(out)]) == 0
    second = json.loads(out.read_text())
    assert first["seed"] == 0 and second["seed"] == 1 and first["prompt_ids"] != second["prompt_ids"]
    assert [p.name for p in out.parent.iterdir()] == ["run.json"]  # no temporary file left
    assert capsys.readouterr().err == ""


def test_progress_bars(capsys):
    """The prefill and decode bars: off when stderr is not a terminal (as under pytest), on with
    --progress, counting the prompt tokens and the new tokens."""
    argv = ["--preset", "tiny", "--device", "cpu", "--context", "40", "--max-new-tokens", "5", "--prefill-chunk", "16"]
    assert gen.main(argv) == 0
    assert capsys.readouterr().err == ""
    assert gen.main(argv + ["--progress"]) == 0
    err = capsys.readouterr().err
    assert "prefill: 100%" in err and "40/40" in err
    assert "decode: 100%" in err and "5/5" in err


def test_json_record_kept_when_its_folder_goes_away(tmp_path, capsys, monkeypatch):
    """The folder checked at the start is replaced by a file during the run: the record is kept
    in the temporary folder, named in one line on stderr, exit status 1."""
    folder = tmp_path / "results"
    folder.mkdir()
    real = gen.timed_generate

    def generate_then_break_the_folder(*args, **kwargs):
        res = real(*args, **kwargs)
        folder.rmdir()
        folder.write_text("now a file")
        return res

    monkeypatch.setattr(gen, "timed_generate", generate_then_break_the_folder)
    rc = gen.main(TINY + ["--context", "16", "--max-new-tokens", "3", "--json", str(folder / "run.json")])
    assert rc == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"directkv-generate: cannot write --json {folder / 'run.json'} (")
    spare = err.rstrip().rsplit(" ", 1)[1]
    try:
        record = json.loads(open(spare).read())
        assert len(record["tokens"][0]) == 3 and record["max_new_tokens"] == 3
    finally:
        os.unlink(spare)
