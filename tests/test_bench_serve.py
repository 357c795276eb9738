"""``python -m bench serve`` without a GPU or vLLM (CPU tests): the command line and its refusals,
the sweep and the host sizes, the server command and environment per engine, the client command,
parsing a recorded ``vllm bench serve`` result (keys of vLLM 0.26's ``vllm/benchmarks/serve.py``)
and a ``/metrics`` text, the ratios and the link floor, the table and the files, stopping a process
group, and whole engines against fake servers (one dies at startup, one answers) and a fake client."""

from __future__ import annotations

import json
import re
import os
import sys
import time
from pathlib import Path

import pytest
import torch

import bench.serve as bs
from bench.__main__ import build_parser, main
from bench.common import GiB

TOKEN_BYTES_8B = 32 * 2 * 8 * 128 * 2  # 131072


@pytest.fixture
def fake_gpu(monkeypatch):
    """A machine that claims a GPU: any GPU work raises instead of the refusal the tests expect."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bs, "available_host_bytes", lambda: 100 * GiB)


def _opts(*argv, host_avail=100 * GiB) -> dict:
    return bs.resolve_options(build_parser().parse_args(["serve", *argv]), host_avail=host_avail)


def _refused(argv, capsys) -> str:
    assert main(["serve"] + argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    return err


def _smol_config(**more) -> dict:
    """SmolLM2-135M's config.json fields the bench reads."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 30,
            "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
            "max_position_embeddings": 8192, "torch_dtype": "bfloat16"} | more


# ---- command line ----------------------------------------------------------------------------
@pytest.mark.parametrize("argv,words", [
    (["--engines", "hbm,swap"], "unknown engine 'swap'"),
    (["--engines", "hbm=3"], "unknown engine 'hbm=3'"),
    (["--engines", "directkv-hbm"], "unknown engine 'directkv-hbm'"),
    (["--engines", "directkv-hbm=-1"], "directkv-hbm= takes GiB"),
    (["--engines", "directkv-hbm=lots"], "directkv-hbm= takes GiB"),
    (["--engines", "hbm,HBM"], "--engines names hbm twice"),
    (["--engines", " , "], "--engines is empty"),
    (["--input-lens", "32x"], "--input-lens takes token counts"),
    (["--input-lens", "0"], "--input-lens must be >= 1 token"),
    (["--output-len", "64"], "--output-len must be >= 128"),
    (["--concurrency", "0"], "--concurrency takes positive integers"),
    (["--concurrency", "1,2.5"], "--concurrency takes positive integers"),
    (["--concurrency", "1", "--request-rates", "1"], "--concurrency or --request-rates, not both"),
    (["--request-rates", "0"], "--request-rates takes positive finite"),
    (["--request-rates", "inf"], "--request-rates takes positive finite"),
    (["--num-prompts", "0"], "--num-prompts takes N or Kx"),
    (["--num-prompts=-2x"], "--num-prompts takes N or Kx"),
    (["--num-prompts", "2x", "--request-rates", "0.5"], "give a number of prompts for --request-rates"),
    (["--gpu-memory-utilization", "0"], "(0, 1]"),
    (["--gpu-memory-utilization", "1.5"], "(0, 1]"),
    (["--slo-tpot-ms", "-1"], "--slo-tpot-ms must be >= 0"),
    (["--startup-timeout-s", "0"], "--startup-timeout-s must be > 0"),
    (["--time-budget-s", "-5"], "--time-budget-s must be > 0"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
    (["--server-args", "--x 'unclosed"], "--server-args:"),
    (["--directkv-gib", "0"], "--directkv-gib must be > 0"),
    (["--directkv-gib", "101"], "--directkv-gib 101 is more than the host memory available (100.0 GiB)"),
    (["--directkv-gib", "2"], "less than one sequence of max_model_len (4.16 GiB)"),
    (["--offload-gib", "nan"], "--offload-gib must be > 0"),
    (["--preset", "gpt5"], "unknown preset 'gpt5'"),
    (["--model", "/nowhere/model"], "--model /nowhere/model: no config.json there"),
    (["--model", "/nowhere", "--preset", "tiny"], "--model PATH or --preset NAME, not both"),
    (["--tokenizer", "/nowhere/tok"], "--tokenizer /nowhere/tok does not exist"),
    (["--device", "cpu"], "bench serve has no CPU run"),
])
def test_bad_values_are_one_line_and_exit_2_before_anything(argv, words, fake_gpu, cwd, capsys):
    err = _refused(argv, capsys)
    assert words in err and (err.startswith("bench serve") or "no CPU run" in err)
    assert list(cwd.iterdir()) == []


def test_an_out_dir_that_is_a_file_is_refused(fake_gpu, cwd, capsys):
    (cwd / "f").write_text("")
    assert "--out-dir f is a file" in _refused(["--out-dir", "f"], capsys)
    assert [p.name for p in cwd.iterdir()] == ["f"]


def test_without_a_gpu_it_refuses(monkeypatch, cwd, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = _refused([], capsys)
    assert err.startswith("no CUDA GPU here") and "bench serve needs CUDA" in err
    assert list(cwd.iterdir()) == []


def test_without_vllm_or_the_plugin_it_names_the_fix(fake_gpu, monkeypatch, cwd, capsys):
    import importlib.util

    import directkv_cute.vllm as plugin

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    err = _refused(["--engines", "hbm"], capsys)
    assert "vLLM is not importable" in err and "pip install" in err
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    monkeypatch.setattr(plugin, "plugin_installed", lambda: False)
    err = _refused(["--engines", "hbm,directkv-hbm=4"], capsys)
    assert "entry point `directkv`" in err and f"{sys.executable} -m pip install -e ." in err
    assert list(cwd.iterdir()) == []


def test_the_directkv_engines_refuse_the_v1_model_runner(fake_gpu, monkeypatch, cwd, capsys):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert "V2 model runner" in _refused(["--engines", "directkv"], capsys)
    assert _opts("--engines", "hbm,offload")["engines"][0].name == "hbm"  # only directkv needs it


def test_defaults_the_sweep_and_the_host_sizes():
    opts = _opts()
    assert [e.name for e in opts["engines"]] == ["hbm", "offload", "directkv"]
    assert opts["input_lens"] == [32768] and opts["output_len"] == 256 and opts["concurrency"] == [1, 2, 4]
    assert opts["max_model_len"] == 32768 + 256 + 1024 and opts["preset"] == "llama3-8b"
    assert opts["model_info"]["kv_token_bytes"] == TOKEN_BYTES_8B and opts["workload"] == "llama3-8b"
    assert [(p["concurrency"], p["num_prompts"], p["seed"]) for p in opts["points"]] == [(1, 8, 0), (2, 8, 1),
                                                                                        (4, 16, 2)]
    # 4 in flight x 34048 tokens x 128 KiB = 16.6 GiB -> 17 GiB, for directkv and the offload buffer
    assert opts["directkv_gib"] == opts["offload_gib"] == 17.0
    assert opts["host_why"]["directkv_gib"] == "4 x 34048 tokens"
    assert (opts["slo_ttft_ms"], opts["slo_tpot_ms"], opts["time_budget_s"]) == (30000.0, 100.0, None)
    capped = _opts(host_avail=20 * GiB)  # half of 20 GiB
    assert capped["directkv_gib"] == 10.0 and "capped at 50% of 20 GiB" in capped["host_why"]["directkv_gib"]


def test_lists_tiers_rates_and_prompts():
    opts = _opts("--engines", "directkv-hbm=all, hbm, directkv-hbm=2.5", "--input-lens", "64k,32768,64k",
                 "--concurrency", "4,1", "--num-prompts", "1x", "--seed", "10")
    assert [(e.name, e.kind, e.hbm_gib) for e in opts["engines"]] == [
        ("directkv-hbm=all", "directkv-hbm", 34.0), ("hbm", "hbm", None), ("directkv-hbm=2.5", "directkv-hbm", 2.5)]
    # all: 4 x ceil((65536 + 256 + 1024) / 64) = 4 x 1044 blocks x 8 MiB = 32.6 GiB -> 33 + 1
    assert [(p["input_len"], p["concurrency"], p["num_prompts"], p["seed"]) for p in opts["points"]] == [
        (65536, 1, 1, 10), (65536, 4, 4, 11), (32768, 1, 1, 12), (32768, 4, 4, 13)]
    rates = _opts("--request-rates", "0.5,0.1", "--engines", "hbm")
    assert rates["concurrency"] is None and [(p["request_rate"], p["num_prompts"]) for p in rates["points"]] == [
        (0.1, 16), (0.5, 16)]
    # a rate point's prompts may all be in flight: 16 x 34048 x 128 KiB = 66.5 GiB, capped at half of 100 GiB
    assert rates["directkv_gib"] == 50.0 and "capped" in rates["host_why"]["directkv_gib"]
    fixed = _opts("--num-prompts", "3", "--concurrency", "8")
    assert fixed["points"][0]["num_prompts"] == 3 and fixed["directkv_gib"] == 13.0  # 3 in flight, not 8


def test_a_local_model_folder(tmp_path):
    folder = tmp_path / "SmolLM2-135M"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(_smol_config()))
    opts = _opts("--model", str(folder), "--input-lens", "16k", "--engines", "hbm,directkv")
    info = opts["model_info"]
    assert (info["head_dim"], info["num_key_value_heads"], info["kv_token_bytes"]) == (64, 3, 30 * 2 * 3 * 64 * 2)
    assert opts["workload"] == "SmolLM2-135M" and opts["preset"] is None and opts["long_model_len"]
    cmd = bs.server_command(opts["engines"][1], opts, model=opts["model"], port=9, tokenizer=None)
    assert "--load-format" not in cmd and "--tokenizer" not in cmd and cmd[4] == str(folder.resolve())
    env = bs.server_env(opts["engines"][0], opts, base={"PATH": "/bin"})
    assert env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] == "1"  # 16k + 320 > 8192 positions: timing only
    short = _opts("--model", str(folder), "--input-lens", "4096", "--engines", "hbm")
    assert not short["long_model_len"] and "VLLM_ALLOW_LONG_MAX_MODEL_LEN" not in bs.server_env(
        short["engines"][0], short, base={})
    assert bs.model_info({"text_config": _smol_config(head_dim=128)})["head_dim"] == 128
    with pytest.raises(bs.UsageError, match="lacks 'num_hidden_layers'"):
        bs.model_info({"hidden_size": 8})


# ---- commands and environments ----------------------------------------------------------------
def test_server_commands_per_engine():
    opts = _opts("--engines", "hbm,offload,directkv,directkv-hbm=20,directkv-sparse=1/8", "--gpu-memory-utilization", "0.5",
                 "--offload-gib", "12", "--directkv-gib", "40",
                 "--server-args", "--block-size 64 --max-num-batched-tokens 4096")
    cmds = {e.name: bs.server_command(e, opts, model="/m", port=8123, tokenizer=None, python="PY")
            for e in opts["engines"]}
    common = ["PY", "-m", "vllm.entrypoints.cli.main", "serve", "/m", "--host", "127.0.0.1", "--port", "8123",
              "--max-model-len", "34048", "--gpu-memory-utilization", "0.5", "--dtype", "bfloat16", "--seed", "0",
              "--generation-config", "vllm", "--disable-uvicorn-access-log", "--load-format", "dummy"]
    extra = ["--block-size", "64", "--max-num-batched-tokens", "4096"]
    assert cmds["hbm"] == common + extra
    assert cmds["offload"] == common + ["--kv-offloading-size", "12", "--kv-offloading-backend", "native"] + extra
    dkv = ["--attention-backend", "CUSTOM", "--kv-cache-memory-bytes", str(40 * GiB)]
    assert cmds["directkv"] == cmds["directkv-hbm=20"] == cmds["directkv-sparse=1/8"] == common + dkv + extra
    base = {"PATH": "/bin", "DIRECTKV_VLLM_HBM_GB": "7", "DIRECTKV_VLLM_SPARSE_BUDGET": "1/4"}
    envs = {e.name: bs.server_env(e, opts, base=base) for e in opts["engines"]}
    assert "DIRECTKV_VLLM_HBM_GB" not in envs["hbm"] and "DIRECTKV_VLLM_HBM_GB" not in envs["offload"]
    assert envs["directkv"]["DIRECTKV_VLLM_HBM_GB"] == "0.0"
    assert envs["directkv-hbm=20"]["DIRECTKV_VLLM_HBM_GB"] == "20.0"
    # the budget only where the engine names one; the caller's own is never passed on
    assert envs["directkv-sparse=1/8"]["DIRECTKV_VLLM_SPARSE_BUDGET"] == "1/8"
    assert envs["directkv-sparse=1/8"]["DIRECTKV_VLLM_HBM_GB"] == "0.0"
    assert all("DIRECTKV_VLLM_SPARSE_BUDGET" not in envs[n] for n in ("hbm", "offload", "directkv", "directkv-hbm=20"))
    assert all(env["PATH"] == "/bin" for env in envs.values()) and base["DIRECTKV_VLLM_HBM_GB"] == "7"
    opts = _opts("--engines", "hbm", "--no-prefix-caching", "--enforce-eager", "--max-num-seqs", "8")
    cmd = bs.server_command(opts["engines"][0], opts, model="/m", port=1, tokenizer="/tok")
    assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    tail = cmd[cmd.index("--disable-uvicorn-access-log") + 1:]
    assert tail == ["--load-format", "dummy", "--tokenizer", "/tok", "--no-enable-prefix-caching", "--enforce-eager",
                    "--max-num-seqs", "8"]


@pytest.mark.parametrize("text, needle", [
    ("directkv-sparse", "unknown engine"), ("directkv-sparse=2", "directkv-sparse=2"),
    ("directkv-sparse=eighth", "directkv-sparse=eighth"), ("directkv-sparse=1/8,directkv-sparse=1/8", "twice"),
])
def test_a_bad_sparse_engine_is_one_line(text, needle):
    with pytest.raises(bs.UsageError, match=needle):
        bs.parse_engines(text)


def test_the_default_server_env_keeps_hf_offline_and_this_tree_first(monkeypatch):
    monkeypatch.setenv("DIRECTKV_VLLM_HBM_GB", "3")
    opts = _opts("--engines", "hbm,directkv")
    env = bs.server_env(opts["engines"][0], opts)
    assert env["HF_HUB_OFFLINE"] == "1" and "DIRECTKV_VLLM_HBM_GB" not in env
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(Path(bs.__file__).resolve().parents[1])


def test_the_client_command():
    opts = _opts("--concurrency", "4", "--slo-ttft-ms", "20000", "--slo-tpot-ms", "0")
    cmd = bs.client_command(opts["points"][0], opts, model="/m", tokenizer="/t", port=8123, result_dir="/r",
                            result_file="f.json", label="hbm", python="PY")
    assert cmd == ["PY", "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "vllm", "--base-url",
                   "http://127.0.0.1:8123", "--endpoint", "/v1/completions", "--model", "/m", "--tokenizer", "/t",
                   "--dataset-name", "random", "--random-input-len", "32768", "--random-output-len", "256",
                   "--random-range-ratio", "0.0", "--ignore-eos", "--num-prompts", "16", "--max-concurrency", "4",
                   "--temperature", "0", "--seed", "0", "--goodput", "ttft:20000", "--percentile-metrics",
                   "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--save-result", "--save-detailed",
                   "--result-dir", "/r", "--result-filename", "f.json", "--disable-tqdm", "--label", "hbm"]
    rates = _opts("--request-rates", "0.25", "--num-prompts", "5", "--slo-ttft-ms", "0", "--slo-tpot-ms", "0")
    cmd = bs.client_command(rates["points"][0], rates, model="/m", tokenizer="/m", port=1, result_dir="/r",
                            result_file="f.json", label="x")
    assert cmd[cmd.index("--num-prompts") + 1] == "5" and cmd[cmd.index("--request-rate") + 1] == "0.25"
    assert "--max-concurrency" not in cmd and "--goodput" not in cmd
    assert bs.point_label(rates["points"][0]) == "i32768-o256-r0.25" and bs.file_safe("directkv-hbm=2.5") == \
        "directkv-hbm_2.5"


def test_the_client_and_server_flags_parse_in_vllm_where_it_imports():
    """Where vLLM is importable, its own parsers take both command lines and map the server's
    flags to the engine arguments each engine means (no engine starts)."""
    pytest.importorskip("vllm")
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    opts = _opts("--concurrency", "2", "--engines", "hbm,offload,directkv,directkv-hbm=3", "--offload-gib", "9")
    cmd = bs.client_command(opts["points"][0], opts, model="/m", tokenizer="/m", port=1, result_dir="/r",
                            result_file="f.json", label="x")
    p = FlexibleArgumentParser()
    add_cli_args(p)
    args = p.parse_args(cmd[5:])
    assert (args.random_input_len, args.max_concurrency, args.goodput) == (32768, 2, ["ttft:30000", "tpot:100"])
    assert (args.save_result, args.save_detailed, args.ignore_eos, args.dataset_name) == (True, True, True, "random")
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.openai.cli_args import make_arg_parser

    try:
        serve = make_arg_parser(FlexibleArgumentParser())
    except RuntimeError as e:  # vLLM finds no device it knows here
        pytest.skip(f"vLLM's serve parser needs a device here: {e}")
    for engine in opts["engines"]:
        args = serve.parse_args(bs.server_command(engine, opts, model="/m", port=8123, tokenizer=None)[4:])
        args.model = args.model_tag
        ea = AsyncEngineArgs.from_cli_args(args)
        assert (ea.model, ea.max_model_len, ea.load_format, args.port) == ("/m", 34048, "dummy", 8123)
        assert ea.kv_offloading_size == (9.0 if engine.kind == "offload" else None)
        direct = engine.kind.startswith("directkv")
        assert ea.kv_cache_memory_bytes == (int(opts["directkv_gib"] * GiB) if direct else None)
        backend = getattr(ea, "attention_backend", None)
        assert (getattr(backend, "name", backend) == "CUSTOM") == direct


def test_the_generated_tokenizer_round_trips(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    folder = bs.write_word_tokenizer(tmp_path / "tok", 1000)
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert tok.vocab_size == 1000 and tok.all_special_ids == [] and tok.num_special_tokens_to_add() == 0
    ids = [5, 999, 0, 17, 17, 3]
    text = tok.decode(ids)
    assert text == "t5 t999 t0 t17 t17 t3" and tok(text, add_special_tokens=False).input_ids == ids


# ---- what the client and the server report -----------------------------------------------------
def client_result(concurrency: int = 1, num_prompts: int = 8, *, tpot: float = 85.0, ttft: float = 2400.0,
                  failed: int = 0, output_len: int = 256) -> dict:
    """A result as ``vllm bench serve --save-result --save-detailed`` (vLLM 0.26) writes it:
    its setup keys, the benchmark's result dict and per-metric mean / median / std / p50 / p99."""
    done = num_prompts - failed
    e2el = ttft + tpot * (output_len - 1)
    duration = e2el * num_prompts / concurrency / 1e3
    doc = {"date": "20261204-101112", "endpoint_type": "vllm", "backend": "vllm", "label": "hbm",
           "model_id": "/tmp/directkv-serve-x/llama3-8b", "tokenizer_id": "/tmp/directkv-serve-x/llama3-8b",
           "num_prompts": num_prompts, "request_rate": "inf", "burstiness": 1.0, "max_concurrency": concurrency,
           "duration": duration, "completed": done, "failed": failed, "total_input_tokens": 32768 * done,
           "total_output_tokens": output_len * done, "request_throughput": done / duration,
           "request_goodput": done / duration if tpot <= 100 else 0.0,
           "output_throughput": output_len * done / duration,
           "total_token_throughput": (32768 + output_len) * done / duration,
           "input_lens": [32768] * num_prompts, "output_lens": [output_len] * done + [0] * failed,
           "ttfts": [ttft / 1e3] * done + [0.0] * failed,
           "itls": [[tpot / 1e3] * (output_len - 1)] * done + [[]] * failed,
           "start_times": [1000.0 + i for i in range(num_prompts)], "generated_texts": ["t1 t2"] * num_prompts,
           "errors": [""] * done + ["Traceback (most recent call last):\n  ...\naiohttp.ClientPayloadError: "
                                    "Response payload is not completed"] * failed,
           "max_output_tokens_per_s": 1e3 / tpot * concurrency * 1.1, "max_concurrent_requests": concurrency,
           "rtfx": 0.0}
    for m, mean in (("ttft", ttft), ("tpot", tpot), ("itl", tpot), ("e2el", e2el)):
        doc |= {f"mean_{m}_ms": mean, f"median_{m}_ms": mean * 0.99, f"std_{m}_ms": mean * 0.01,
                f"p50_{m}_ms": mean * 0.99, f"p99_{m}_ms": mean * 1.2}
    return doc


def test_parse_a_recorded_client_result():
    row = bs.parse_client_result(client_result(concurrency=4, num_prompts=16, tpot=350.0, ttft=9000.0))
    assert row["status"] == "ok" and row.get("error") is None
    assert (row["completed"], row["failed"], row["max_concurrent_requests"]) == (16, 0, 4)
    assert row["tpot_p50_ms"] == pytest.approx(346.5) and row["tpot_p99_ms"] == pytest.approx(420.0)
    assert row["ttft_mean_ms"] == 9000.0 and row["e2el_p50_ms"] == pytest.approx(0.99 * (9000 + 350 * 255))
    assert row["output_throughput"] == pytest.approx(16 * 256 / row["duration_s"]) and row["request_goodput"] == 0.0
    assert set(row) <= set(bs.ROW_FIELDS)
    partial = bs.parse_client_result(client_result(failed=3))
    assert partial["status"] == "partial" and partial["error"].startswith("3 of 8 requests failed: aiohttp.")
    none_done = client_result(failed=8)
    none_done.pop("errors")  # without --save-detailed
    got = bs.parse_client_result(none_done)
    assert got["status"] == "error" and got["error"] == "8 of 8 requests failed"
    old = {k: v for k, v in client_result().items() if not k.startswith("p50_")}  # p50 not asked: the median
    assert bs.parse_client_result(old)["ttft_p50_ms"] == pytest.approx(2376.0)
    with pytest.raises(ValueError, match="no 'completed'"):
        bs.parse_client_result({"duration": 1.0})


METRICS_TEXT = """\
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="/tmp/m"} 7.0
# HELP vllm:num_preemptions_created Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_created gauge
vllm:num_preemptions_created{engine="0",model_name="/tmp/m"} 1.733e+09
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="/tmp/m"} 262144.0
vllm:prefix_cache_hits_total{engine="0",model_name="/tmp/m"} 64.0
vllm:num_requests_running{engine="0",model_name="/tmp/m"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="/tmp/m"} 0.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="/tmp/m"} 8.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="/tmp/m"} 190.5
python_gc_objects_collected_total{generation="0"} 12345.0
weird line without a value
"""


def test_parse_metrics_and_counter_rise():
    before = bs.parse_metrics(METRICS_TEXT)
    assert before["vllm:num_preemptions"] == 7.0 and before["vllm:prefix_cache_hits"] == 64.0
    assert "vllm:num_preemptions_created" not in before and before["vllm:e2e_request_latency_seconds_sum"] == 190.5
    second = 'vllm:num_preemptions_total{engine="1",model_name="/tmp/m"} 3.0\n'
    two_engines = METRICS_TEXT.replace("7.0\n", "12.0\n" + second)
    after = bs.parse_metrics(two_engines)
    assert after["vllm:num_preemptions"] == 15.0  # summed over engines
    assert bs.counter_rise(before, after, bs.PREEMPTIONS) == 8
    assert bs.counter_rise(before, after, bs.PREFIX_HITS) == 0
    assert bs.counter_rise(None, after, bs.PREEMPTIONS) is None
    assert bs.counter_rise(before, {}, bs.PREEMPTIONS) is None
    assert bs.counter_rise({}, after, bs.PREEMPTIONS) == 15  # a counter not yet exported started at 0


def test_kv_log_lines():
    log = """\
(EngineCore pid=123) INFO 12-04 10:00:01 [gpu_worker.py:561] Available KV cache memory: 38.91 GiB
(EngineCore pid=123) INFO 12-04 10:00:02 [kv_cache_utils.py:2177] GPU KV cache size: 318,720 tokens
(EngineCore pid=123) INFO 12-04 10:00:02 [kv_cache_utils.py:2179] Maximum concurrency for 33,088 tokens per request: 9.63x
(EngineCore pid=123) INFO 12-04 10:00:03 [kv_cache_utils.py:2177] GPU KV cache size: 1 tokens
"""
    got = bs.kv_log_lines(log)
    assert (got["gpu_kv_cache_tokens"], got["max_concurrency"], got["available_kv_cache_gib"]) == (318720, 9.63, 38.91)
    assert len(got["lines"]) == 3 and bs.kv_log_lines("nothing") == {"lines": []}


# ---- ratios, floors, table, files ------------------------------------------------------------
def _row(engine, c, **parsed):
    return bs.new_row(engine=engine, input_len=32768, output_len=256, concurrency=c,
                      num_prompts=None if c is None else max(4 * c, 8), seed=0, **parsed)


def _doc(rows, engines, h2d=50.0):
    return {"schema": bs.SERVE_SCHEMA, "bench": "serve",
            "header": {"gpu": "NVIDIA H100 80GB HBM3", "gpu_key": "NVIDIA_H100_80GB_HBM3", "date": "2026-12-05",
                       "versions": {"vllm": "0.26.0"}},
            "ceilings": None if h2d is None else {"memcpy_h2d_gbps": h2d, "host_read_gbps": 48.0,
                                                  "hbm_read_gbps": 3000.0},
            "args": {"workload": "llama3-8b", "gpu_memory_utilization": 0.9, "max_model_len": 34048,
                     "slo_ttft_ms": 30000.0, "slo_tpot_ms": 100.0},
            "model": {"kv_token_bytes": TOKEN_BYTES_8B}, "engines": engines, "passed": True, "rows": rows}


def _engines():
    return {"hbm": {"name": "hbm", "kind": "hbm", "status": "ok", "error": None, "flags": [], "env": {},
                    "gpu_bytes_after_start": int(71.5 * GiB), "kv_log": {"gpu_kv_cache_tokens": 402560},
                    "startup_s": 96.0},
            "directkv": {"name": "directkv", "kind": "directkv", "status": "ok", "error": None,
                         "flags": ["--attention-backend", "CUSTOM", "--kv-cache-memory-bytes", str(17 * GiB)],
                         "env": {"DIRECTKV_VLLM_HBM_GB": "0.0"}, "gpu_bytes_after_start": 24 * GiB, "startup_s": 101.0},
            "directkv-hbm=18": {"name": "directkv-hbm=18", "kind": "directkv-hbm", "status": "error",
                                "error": "server exited with status 1 during startup: RuntimeError: no HBM",
                                "flags": [], "env": {"DIRECTKV_VLLM_HBM_GB": "18.0"}}}


def test_ratios_floors_and_passed():
    rows = [_row("hbm", 1, **bs.parse_client_result(client_result(1, tpot=7.0, ttft=2400.0))),
            _row("hbm", 4, **bs.parse_client_result(client_result(4, 16, tpot=9.0, ttft=2600.0))),
            _row("directkv", 1, **bs.parse_client_result(client_result(1, tpot=85.0, ttft=2500.0))),
            _row("directkv", 4, **bs.parse_client_result(client_result(4, 16, tpot=350.0, ttft=9000.0))),
            _row("directkv-hbm=18", None, status="error", error="server exited")]
    doc = bs.finish(_doc(rows, _engines()))
    hbm1, hbm4, d1, d4, err = doc["rows"]
    assert hbm1["tpot_p50_vs_hbm"] == pytest.approx(1.0) and d1["tpot_p50_vs_hbm"] == pytest.approx(85 / 7)
    assert d4["ttft_p50_vs_hbm"] == pytest.approx(9000 / 2600) and err["tpot_p50_vs_hbm"] is None
    # C4 at 32k + 256 / 2 tokens of 128 KiB: 4 x 32896 x 131072 B = 17.25 GB at 50 GB/s = 344.94 ms
    assert d4["kv_bytes_per_step"] == 4 * 32896 * TOKEN_BYTES_8B
    assert d4["floor_tpot_ms"] == pytest.approx(4 * 32896 * TOKEN_BYTES_8B / 50e9 * 1e3)
    assert d4["pct_floor"] == pytest.approx(100 * d4["floor_tpot_ms"] / (350 * 0.99))
    assert hbm1["floor_tpot_ms"] is None and err["floor_tpot_ms"] is None  # the floor is directkv host-only's
    assert doc["passed"] is False  # an engine failed
    assert bs.floor_tpot_ms(1, 32768, 256, TOKEN_BYTES_8B, 50.0) == (32896 * TOKEN_BYTES_8B,
                                                                      pytest.approx(86.2357, rel=1e-5))
    no_ceil = bs.finish(_doc([dict(r) for r in rows], _engines(), h2d=None))
    assert all(r["floor_tpot_ms"] is None for r in no_ceil["rows"])
    assert bs.finish(_doc(rows[:4], {k: v for k, v in _engines().items() if v["status"] == "ok"}))["passed"]


def test_the_table_and_the_files(tmp_path, capsys):
    from bench.common import write_json, write_run_files

    rows = [_row("hbm", 1, **bs.parse_client_result(client_result(1, tpot=7.0))),
            _row("directkv", 1, **bs.parse_client_result(client_result(1, tpot=85.0))),
            _row("directkv", 4, **bs.parse_client_result(client_result(4, 16, tpot=350.0, failed=2))),
            _row("directkv-hbm=18", None, status="error", error="server exited with status 1 during startup")]
    rows.append(_row("directkv", 8, status="skipped", note="--time-budget-s 300 spent"))
    doc = bs.finish(_doc(rows, _engines()))
    text = bs.format_table(doc)
    lines = text.splitlines()
    assert lines[0].startswith("== vllm 0.26.0 serve: llama3-8b on NVIDIA H100 80GB HBM3 2026-12-05")
    assert "--gpu-memory-utilization 0.9 for every engine" in lines[0]
    assert "TTFT <= 30000 ms, TPOT <= 100 ms" in lines[1] and "memcpy H2D 50.0 GB/s" in lines[2]
    assert any(line.startswith("hbm: vLLM defaults; GPU 71.5 GiB after start; KV blocks hold 402560 tokens")
               for line in lines)
    assert any("DIRECTKV_VLLM_HBM_GB=0.0" in line and "GPU 24.0 GiB" in line for line in lines)
    assert any(line.startswith("directkv-hbm=18:") and "error: server exited" in line for line in lines)
    table = lines[lines.index(next(line for line in lines if line.startswith("engine "))):]
    body = [line for line in table[2:]]
    assert [line.split()[0] for line in body] == ["hbm", "directkv", "directkv", "directkv", "directkv-hbm=18"]
    d1 = body[1].split()
    assert d1[1:6] == ["32k", "256", "C1", "8", "ok"] and "12.14" in d1  # TPOT / hbm = 85 / 7
    assert "partial" in body[2] and "14/2" in body[2] and "2 of 16 requests failed" in body[2]
    assert "skipped" in body[3] and "--time-budget-s 300 spent" in body[3]
    header = {"gpu_key": "NVIDIA_H100_80GB_HBM3", "date": "2026-12-05"}
    path = write_json(tmp_path / "NVIDIA_H100_80GB_HBM3-2026-12-05-serve-llama3-8b.json", doc)
    files = write_run_files(path, doc, text, tmp_path, header, "serve-llama3-8b", bs.plot_serve)
    assert [f.name for f in files[:2]] == ["NVIDIA_H100_80GB_HBM3-2026-12-05-serve-llama3-8b.json",
                                           "NVIDIA_H100_80GB_HBM3-2026-12-05-serve-llama3-8b.txt"]
    back = json.loads(path.read_text())
    assert back["schema"] == "directkv-bench-serve/1" and all(set(r) == set(bs.ROW_FIELDS) for r in back["rows"])
    assert (tmp_path / files[1].name).read_text() == text + "\n"
    if len(files) == 3:  # matplotlib installed
        assert files[2].suffix == ".png" and files[2].stat().st_size > 0
    capsys.readouterr()


# ---- processes -------------------------------------------------------------------------------
SLEEPER = """\
import os, signal, subprocess, sys, time
if sys.argv[1] == "graceful":
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
else:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # same process group
print("ready", child.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("mode", ["graceful", "stubborn"])
def test_stop_group_ends_the_whole_group(mode, tmp_path):
    log = tmp_path / "sleeper.log"
    proc = bs.launch([sys.executable, "-c", SLEEPER, mode], dict(os.environ), log)
    deadline = time.monotonic() + 10
    while "ready" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.02)
    child = int(log.read_text().split()[1])
    assert os.getpgid(proc.pid) == proc.pid and os.getpgid(child) == proc.pid
    assert sorted(bs.group_members(proc.pid)) == sorted([proc.pid, child])
    got = bs.stop_group(proc, timeout_s=0.5 if mode == "stubborn" else 10.0, poll_s=0.02)
    assert got["group_gone"] and bs.group_members(proc.pid) == [] and proc.returncode is not None
    assert got["signal"] == "SIGTERM" and got["killed"] == (mode == "stubborn")
    if mode == "graceful":
        assert got["stop_s"] < 5 and proc.returncode == 0
    try:  # the grandchild is gone, or a zombie its new parent has not reaped yet
        state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        state = "gone"
    assert state in ("gone", "Z", "X")
    assert bs.stop_group(proc, timeout_s=1.0)["killed"] is False  # already gone: nothing to do


FAKE_SERVER = """\
import http.server, os, signal, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
reads = [0]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/health":
            body = b""
        elif self.path.startswith("/metrics"):
            reads[0] += 1
            body = ("# TYPE vllm:num_preemptions_total counter\\n"
                    f'vllm:num_preemptions_total{{engine="0"}} {2 * reads[0]}.0\\n'
                    f'vllm:prefix_cache_hits_total{{engine="0"}} 0.0\\n').encode()
        else:
            self.send_response(404); self.end_headers(); return
        self.send_response(200); self.end_headers(); self.wfile.write(body)
    def do_POST(self):
        n = int(self.headers.get("Content-Length", 0)); self.rfile.read(n)
        self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *a):
        pass
signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
print("INFO [kv_cache_utils.py:2177] GPU KV cache size: 402,560 tokens", flush=True)
http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""
DYING_SERVER = "import sys; print('RuntimeError: the DirectKV backend refuses this GPU', flush=True); sys.exit(3)"


def _fakes(tmp_path, *, client_sleep_s: float = 0.0, server=None):
    """A launcher of fake servers (``server(cmd)`` picks the script: by default the directkv
    engines' servers die at startup, the others answer /health and /metrics) and a fake client
    writing a recorded result; the lists of what they were given."""
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    launched, clients = [], []
    pick = server or (lambda cmd: DYING_SERVER if "--attention-backend" in cmd else None)

    def launch(cmd, env, log):
        launched.append((cmd, env))
        code = pick(cmd)
        port = cmd[cmd.index("--port") + 1]
        argv = [sys.executable, "-c", code] if code else [sys.executable, str(script), "--port", port]
        return bs.launch(argv, env, log)

    def client(cmd, env, log_path, *, timeout_s, tick):
        clients.append(cmd)
        tick()
        time.sleep(client_sleep_s)
        c = int(cmd[cmd.index("--max-concurrency") + 1])
        tpot = {"hbm": 7.0, "offload": 14.0}.get(cmd[cmd.index("--label") + 1], 80.0)
        out = Path(cmd[cmd.index("--result-dir") + 1]) / cmd[cmd.index("--result-filename") + 1]
        out.write_text(json.dumps(client_result(c, int(cmd[cmd.index("--num-prompts") + 1]), tpot=tpot)))
        Path(log_path).write_text("Serving Benchmark Result\n")
        return {"returncode": 0, "timed_out": False, "wall_s": 0.01}

    return launch, client, launched, clients


def _engine_run(tmp_path, engines: str, *more, client_sleep_s: float = 0.0, server=None):
    """``run_engines`` over ``_fakes``."""
    launch, client, launched, clients = _fakes(tmp_path, client_sleep_s=client_sleep_s, server=server)
    opts = _opts("--engines", engines, "--concurrency", "1,4", "--num-prompts", "1x", *more)
    raw = tmp_path / "raw"
    raw.mkdir(exist_ok=True)
    lines, writes = [], []
    ctx = bs.Context(raw_dir=raw, model=str(tmp_path / "model"), tokenizer=str(tmp_path / "model"),
                     base_env=dict(os.environ), launch=launch, client=client, gpu_used=lambda: None,
                     host_avail=lambda: 100 * GiB, echo=lines.append, health_poll_s=0.05, release_poll_s=0.01)
    doc = _doc([], {})
    bs.run_engines(opts, ctx, doc, lambda: writes.append(len(doc["rows"])))
    return doc, launched, clients, lines, writes


def test_the_whole_command_over_fake_servers_writes_its_files(fake_gpu, monkeypatch, cwd, tmp_path, capsys):
    """``python -m bench serve`` end to end with the GPU, vLLM and its processes faked: the preset's
    folder (config.json and the generated tokenizer) is what the servers get, a dead engine makes
    exit status 1, and the JSON, table, PNG and raw files land under --out-dir."""
    import bench.common as bc

    launch, client, launched, clients = _fakes(tmp_path)
    seen = {}

    class FakeContext(bs.Context):
        def __init__(self, **kw):
            seen["model"] = Path(kw["model"])
            seen["files"] = sorted(p.name for p in seen["model"].iterdir())
            super().__init__(**kw | {"launch": launch, "client": client, "health_poll_s": 0.05,
                                     "release_poll_s": 0.01})

    monkeypatch.setattr(bs, "Context", FakeContext)
    monkeypatch.setattr(bs, "check_runnable", lambda opts: None)
    monkeypatch.setattr(bc, "env_info", lambda device: {"gpu": "NVIDIA H100 80GB HBM3", "gpu_key": "NVIDIA_H100",
                                                        "date": "2026-12-05", "versions": {}})
    argv = ["serve", "--preset", "tiny", "--engines", "hbm,directkv", "--input-lens", "1024", "--output-len", "128",
            "--concurrency", "1,2", "--num-prompts", "1x", "--no-ceilings", "--no-warmup"]
    assert main(argv) == 1  # the directkv server died
    out = capsys.readouterr().out
    assert seen["files"] == ["config.json", "tokenizer.json", "tokenizer_config.json"]
    assert not seen["model"].exists()  # a temporary folder
    assert launched[0][0][4] == str(seen["model"]) and "--tokenizer" not in launched[0][0]
    assert clients[0][clients[0].index("--tokenizer") + 1] == str(seen["model"])
    stem = cwd / "bench-results" / "NVIDIA_H100-2026-12-05-serve-tiny"
    doc = json.loads(stem.with_suffix(".json").read_text())
    assert doc["schema"] == "directkv-bench-serve/1" and doc["args"]["max_model_len"] == 1024 + 128 + 1024
    assert doc["model"]["kv_token_bytes"] == 2 * 2 * 2 * 64 * 2 and doc["ceilings"] is None
    assert [(r["engine"], r["concurrency"], r["status"]) for r in doc["rows"]] == [
        ("hbm", 1, "ok"), ("hbm", 2, "ok"), ("directkv", None, "error")]
    assert doc["engines"]["directkv"]["status"] == "error" and doc["passed"] is False
    # vLLM's version where it is installed, "?" where not
    assert re.match(r"== vllm \S+ serve: tiny on NVIDIA H100 80GB HBM3", stem.with_suffix(".txt").read_text())
    raw = sorted(p.name for p in (cwd / "bench-results" / (stem.name + "-raw")).iterdir())
    assert raw == ["directkv.server.log", "hbm-i1024-o128-c1.client.log", "hbm-i1024-o128-c1.json",
                   "hbm-i1024-o128-c2.client.log", "hbm-i1024-o128-c2.json", "hbm.server.log"]
    assert "bench-results/NVIDIA_H100-2026-12-05-serve-tiny.json" in out
    assert ("tiny.png" in out) == (bc.pyplot() is not None)  # matplotlib installed


def test_a_server_that_dies_at_startup_is_an_error_entry_and_the_run_goes_on(tmp_path):
    doc, launched, clients, lines, writes = _engine_run(tmp_path, "directkv,hbm,offload", "--no-warmup")
    assert [c[c.index("serve") + 1] for c, _ in launched] == [str(tmp_path / "model")] * 3
    assert launched[0][1]["DIRECTKV_VLLM_HBM_GB"] == "0.0" and "DIRECTKV_VLLM_HBM_GB" not in launched[1][1]
    dead = doc["engines"]["directkv"]
    assert dead["status"] == "error" and dead["error"].startswith("server exited with status 3 during startup")
    assert "the DirectKV backend refuses this GPU" in dead["error"] and dead["log_tail"]
    assert dead["stop"]["group_gone"] and dead["flags"][:2] == ["--attention-backend", "CUSTOM"]
    assert (tmp_path / "raw" / "directkv.server.log").read_text().startswith("RuntimeError")
    hbm = doc["engines"]["hbm"]
    assert hbm["status"] == "ok" and hbm["kv_log"]["gpu_kv_cache_tokens"] == 402560 and hbm["flags"] == []
    assert hbm["stop"] == hbm["stop"] | {"signal": "SIGTERM", "killed": False, "group_gone": True}
    assert len(clients) == 4  # hbm and offload, C1 and C4; none for the dead engine
    assert [c[c.index("--seed") + 1] for c in clients] == ["0", "1", "0", "1"]  # the same prompts per point
    by = {(r["engine"], r["concurrency"]): r for r in doc["rows"]}
    assert by[("directkv", None)]["status"] == "error"
    assert by[("hbm", 4)]["status"] == "ok" and by[("hbm", 4)]["preemptions"] == 2  # /metrics read before and after
    assert by[("offload", 1)]["tpot_p50_vs_hbm"] == pytest.approx(2.0)
    assert by[("hbm", 1)]["client_file"].endswith("hbm-i32768-o256-c1.json")
    assert doc["passed"] is False and writes and max(writes) == 5
    assert any("healthy after" in line for line in lines) and any("stopped (SIGTERM" in line for line in lines)


def test_warm_up_a_time_budget_and_a_server_that_never_answers(tmp_path):
    doc, launched, clients, lines, _ = _engine_run(tmp_path, "hbm", "--time-budget-s", "0.25", client_sleep_s=0.4)
    assert doc["engines"]["hbm"]["status"] == "ok" and "warmup_error" not in doc["engines"]["hbm"]
    rows = sorted(doc["rows"], key=lambda r: r["concurrency"])
    assert [r["status"] for r in rows] == ["ok", "skipped"] and "--time-budget-s 0.25 spent" in rows[1]["note"]
    assert len(clients) == 1
    never = "import time; print('loading weights', flush=True); time.sleep(60)"
    doc, *_ = _engine_run(tmp_path, "hbm", "--startup-timeout-s", "0.3", server=lambda cmd: never)
    entry = doc["engines"]["hbm"]
    assert entry["status"] == "error" and entry["error"].startswith("server not healthy after 0.3 s: loading weights")
    assert entry["stop"]["group_gone"] and entry["stop"]["signal"] == "SIGTERM"


def test_run_client_stops_a_client_past_its_timeout(tmp_path):
    t0 = time.monotonic()
    ticks = []
    got = bs.run_client([sys.executable, "-c", "import time; time.sleep(30)"], dict(os.environ), tmp_path / "c.log",
                        timeout_s=0.3, tick=lambda: ticks.append(1), poll_s=0.05)
    assert got["timed_out"] and time.monotonic() - t0 < 10 and ticks
    done = bs.run_client([sys.executable, "-c", "print('ok')"], dict(os.environ), tmp_path / "d.log", timeout_s=30)
    assert done == done | {"returncode": 0, "timed_out": False} and (tmp_path / "d.log").read_text() == "ok\n"


def test_wait_released():
    used = iter([30 * GiB, 20 * GiB, 10 * GiB + GiB // 2])
    got = bs.wait_released(lambda: next(used), 10 * GiB, timeout_s=5, poll_s=0.001)
    assert got["released"] is True and got["gpu_used_bytes"] == 10 * GiB + GiB // 2
    stuck = bs.wait_released(lambda: 30 * GiB, 10 * GiB, timeout_s=0.05, poll_s=0.01)
    assert stuck["released"] is False and stuck["wait_s"] >= 0.05
    assert bs.wait_released(lambda: None, None, timeout_s=1)["released"] is None
