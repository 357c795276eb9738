"""``python -m bench vllm`` without a GPU or an engine (CPU tests): the command line and its
refusals, batch sizing and the host KV sizes, the floor, the model's config.json, the timing
reducer, the worker protocol (a fake worker's result, a failing and a hanging worker), the
engine's arguments per method (checked against vLLM's EngineArgs where vLLM is importable), the
engine entry and the directkv backend check from fakes, and the table built from a result."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import bench.vllm as bv
from bench.__main__ import main
from bench.common import GiB

TOKEN_BYTES_8B = 32 * 2 * 8 * 128 * 2  # layers x K/V x KV heads x head dim x bf16 = 131072


@pytest.fixture
def fake_gpu(monkeypatch):
    """A machine that claims a GPU it does not have: any GPU work (the header, the ceilings) raises
    instead of the one-line refusal the tests expect."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bv, "available_host_bytes", lambda: 100 * GiB)


def _refused(argv, capsys) -> str:
    assert main(["vllm"] + argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    return err


# ---- command line ----------------------------------------------------------------------------
@pytest.mark.parametrize("argv,words", [
    (["--contexts", "0"], "context must be >= 1"),
    (["--contexts", "32k"], "--contexts takes integers"),
    (["--batches", "0"], "positive integers or 'max'"),
    (["--batches", "1,most"], "positive integers or 'max'"),
    (["--batches", "2.5"], "positive integers or 'max'"),
    (["--offload-gib", "-1"], "--offload-gib must be >= 0"),
    (["--offload-gib", "101"], "more than the host memory available (100.0 GiB)"),
    (["--directkv-gib", "0"], "--directkv-gib must be > 0"),
    (["--directkv-gib", "-2"], "--directkv-gib must be > 0"),
    (["--directkv-gib", "nan"], "--directkv-gib must be > 0"),
    (["--directkv-gib", "101"], "--directkv-gib 101 is more than the host memory available (100.0 GiB)"),
    (["--directkv-gib", "8"], "less than one sequence of the longest length (16.00 GiB)"),
    (["--gpu-memory-utilization", "0"], "(0, 1]"),
    (["--gpu-memory-utilization", "1.2"], "(0, 1]"),
    (["--new-tokens", "0"], "--new-tokens must be >= 1"),
    (["--methods", "hbm,swap"], "unknown method 'swap'; use offload, directkv, hbm"),
    (["--preset", "gpt5"], "unknown preset 'gpt5'"),
    (["--worker-timeout-s", "0"], "--worker-timeout-s must be > 0"),
    (["--device", "cpu"], "bench vllm has no CPU run"),
    (["--directkv-hbm-gib", "-1"], "--directkv-hbm-gib takes GiB (a finite number >= 0) or 'auto', got '-1'"),
    (["--directkv-hbm-gib", "inf"], "--directkv-hbm-gib takes GiB"),
    (["--directkv-hbm-gib", "half"], "--directkv-hbm-gib takes GiB"),
    (["--methods", "directkv,hbm", "--directkv-hbm-gib", "auto"], "add offload to --methods"),
])
def test_bad_values_are_one_line_and_exit_2_before_gpu_work(argv, words, fake_gpu, cwd, capsys):
    assert words in _refused(argv, capsys)
    assert list(cwd.iterdir()) == []


def test_without_a_gpu_it_refuses(monkeypatch, cwd, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = _refused([], capsys)
    assert err.startswith("no CUDA GPU here") and "bench vllm needs CUDA" in err
    assert list(cwd.iterdir()) == []


def test_without_vllm_it_names_the_fix_before_gpu_work(fake_gpu, monkeypatch, cwd, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    err = _refused(["--smoke"], capsys)
    assert "pip install" in err and "PYTHONPATH" in err


def test_options_and_smoke_defaults(fake_gpu):
    from bench.__main__ import build_parser

    parse = build_parser().parse_args
    opts = bv.resolve_options(parse(["vllm"]), host_avail=100 * GiB)
    assert opts["contexts"] == [32768, 65536, 131072] and opts["batches"] == ["1", "max"]
    assert opts["methods"] == ["offload", "directkv", "hbm"] and opts["offload_gib"] is None
    assert opts["directkv_gib"] is None
    assert opts["gpu_memory_utilization"] == 0.90 and opts["max_model_len"] == 131072 + 33
    smoke = bv.resolve_options(parse(["vllm", "--smoke"]), host_avail=None)
    assert (smoke["preset"], smoke["contexts"], smoke["batches"]) == ("tiny", [2048], ["1", "2"])
    assert smoke["offload_gib"] == bv.SMOKE_OFFLOAD_GIB and smoke["max_model_len"] == 2048 + 9
    mixed = bv.resolve_options(parse(["vllm", "--batches", "max, 4,max", "--methods", "vllm[hbm]",
                                      "--contexts", "1000", "--short-context", "0"]), host_avail=None)
    assert mixed["batches"] == ["max", "4"] and mixed["methods"] == ["hbm"] and mixed["max_model_len"] == 1033
    named = bv.resolve_options(parse(["vllm", "--methods", "vllm+directkv[host],hbm", "--directkv-gib", "16.5"]),
                               host_avail=100 * GiB)
    assert named["methods"] == ["directkv", "hbm"] and named["directkv_gib"] == 16.5


def test_directkv_refuses_the_v1_model_runner(fake_gpu, monkeypatch, cwd, capsys):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert "V2 model runner" in _refused(["--methods", "directkv"], capsys)
    assert list(cwd.iterdir()) == []
    from bench.__main__ import build_parser

    ns = build_parser().parse_args(["vllm", "--methods", "hbm"])
    assert bv.resolve_options(ns, host_avail=None)["methods"] == ["hbm"]  # only directkv needs it
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    ns = build_parser().parse_args(["vllm", "--methods", "directkv"])
    assert bv.resolve_options(ns, host_avail=None)["methods"] == ["directkv"]


# ---- batch sizing and the offload buffer ------------------------------------------------------
def test_max_batch_counts_whole_blocks_and_caps_at_max_num_seqs():
    # 1000 blocks of 16; a sequence of 1000 + 33 tokens takes ceil(1033 / 16) = 65 blocks -> 15 fit.
    assert bv.max_batch(16000, 1000, 33, 16, None) == 15
    assert bv.max_batch(16000 + 15, 1000, 33, 16, 256) == 15  # a partial block holds nothing
    assert bv.max_batch(16000, 1000, 33, 16, 8) == 8
    assert bv.max_batch(16000, 20000, 33, 16, 256) == 0
    assert bv.max_batch(65 * 16 * 2, 1007, 33, 16, 256) == 2  # 1040 tokens: exactly 65 blocks


def test_resolve_batches_sizes_max_and_drops_repeats():
    assert bv.resolve_batches(["1", "max"], 16000, 1000, 33, 16, 256) == [("1", 1), ("max", 15)]
    assert bv.resolve_batches(["1", "max"], 1100, 1000, 33, 16, 256) == [("1", 1)]  # max == 1
    assert bv.resolve_batches(["max", "3"], 100, 1000, 33, 16, 256) == [("max", 0), ("3", 3)]


def test_default_offload_buffer():
    kw = dict(token_bytes=TOKEN_BYTES_8B, contexts=[32768, 131072], seq_extra=33, hbm_kv_bytes=100 * GiB)
    # batch max: as much again as the GPU blocks hold
    assert bv.default_host_gib("offload", batches=["1", "max"], host_avail=None, **kw)[0] == 100.0
    # B8 at 128k: 8 x 131105 x 128 KiB = 128.03 GiB, 28.03 beyond the GPU blocks -> 29 GiB
    gib, why = bv.default_host_gib("offload", batches=["1", "8"], host_avail=None, **kw)
    assert gib == 29.0 and "B8" in why
    assert bv.default_host_gib("offload", batches=["1"], host_avail=None, **kw)[0] == 1.0  # fits: the minimum
    gib, why = bv.default_host_gib("offload", batches=["max"], host_avail=120 * GiB, **kw)
    assert gib == 60.0 and "capped" in why  # at most half the available host memory


def test_default_directkv_host_kv():
    kw = dict(token_bytes=TOKEN_BYTES_8B, contexts=[32768, 131072], seq_extra=33, hbm_kv_bytes=100 * GiB)
    # every block in host memory: B8 at 128k whole, 8 x 131105 x 128 KiB = 128.03 GiB -> 129 GiB
    gib, why = bv.default_host_gib("directkv", batches=["1", "8"], host_avail=None, **kw)
    assert gib == 129.0 and why == "B8 at 128k"
    # B1 alone: one sequence, 131105 x 128 KiB = 16.0032 GiB -> 17 GiB (vLLM needs at least one)
    assert bv.default_host_gib("directkv", batches=["1"], host_avail=None, **kw)[0] == 17.0
    assert bv.default_host_gib("directkv", batches=["max"], host_avail=None, **kw)[0] == 17.0 + 83  # as hbm's
    # max and a larger integer batch: the larger rule wins; capped like the offload buffer
    assert bv.default_host_gib("directkv", batches=["8", "max"], host_avail=None, **kw)[0] == 129.0
    gib, why = bv.default_host_gib("directkv", batches=["8", "max"], host_avail=200 * GiB, **kw)
    assert gib == 100.0 and "capped at 50% of 200 GiB" in why
    with pytest.raises(ValueError):
        bv.default_host_gib("hbm", batches=["1"], host_avail=None, **kw)


# ---- the model -------------------------------------------------------------------------------
def test_config_json_has_the_llama3_8b_shape(tmp_path):
    folder = bv.write_model_dir(tmp_path / "m", "llama3-8b", 131072 + 33)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["intermediate_size"], cfg["vocab_size"]) == (32, 4096, 32, 8, 128, 14336, 128256)
    assert cfg["rope_theta"] == 500000.0 and cfg["rope_scaling"]["rope_type"] == "llama3"
    assert cfg["max_position_embeddings"] == 131072 + 33 and cfg["torch_dtype"] == "bfloat16"
    assert cfg["eos_token_id"] is None
    small = json.loads((bv.write_model_dir(tmp_path / "s", "llama3-8b", 4096) / "config.json").read_text())
    assert small["max_position_embeddings"] == 131072  # never below the model's own
    assert bv.kv_token_bytes(bv.model_shape("llama3-8b")) == TOKEN_BYTES_8B


def test_config_json_loads_in_transformers_with_the_same_shape(tmp_path):
    transformers = pytest.importorskip("transformers")
    folder = bv.write_model_dir(tmp_path / "m", "qwen2.5-7b", 200000)
    cfg = transformers.AutoConfig.from_pretrained(str(folder))
    assert type(cfg).__name__ == "Qwen2Config" and cfg.max_position_embeddings == 200000
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers) == (4, 128, 28)
    llama = transformers.AutoConfig.from_pretrained(str(bv.write_model_dir(tmp_path / "l", "llama3-8b", 10)))
    assert llama.rope_parameters["rope_type"] == "llama3" and llama.rope_parameters["rope_theta"] == 500000.0


@pytest.mark.parametrize("preset", ["tiny", "qwen2.5-7b"])
def test_weight_bytes_match_the_built_model(preset):
    pytest.importorskip("transformers")
    from directkv_cute.presets import preset_config

    with torch.device("meta"):
        import transformers

        model = transformers.AutoModelForCausalLM.from_config(preset_config(preset))
    params = sum(p.numel() for p in model.parameters())
    assert bv.weight_bytes(bv.model_shape(preset)) == 2 * params


# ---- the floor -------------------------------------------------------------------------------
def test_floor_against_a_hand_computation():
    shape = bv.model_shape("llama3-8b")
    kv = bv.kv_bytes_per_step(2, 32768, shape)
    assert kv == 2 * 32768 * 32 * 2 * 8 * 128 * 2 == 8 * GiB
    # 8 GiB = 8.589934592 GB at 50 GB/s = 171.79869184 ms, plus 6.5 ms of non-attention time
    assert bv.floor_ms(kv, 50.0, 6.5) == pytest.approx(178.29869184, rel=1e-12)
    assert bv.floor_ms(kv, 50.0, None) == pytest.approx(171.79869184, rel=1e-12)


# ---- timing ----------------------------------------------------------------------------------
def test_reduce_timing_of_a_synthetic_batch():
    submit = {"a": 0.0, "b": 0.1}
    # a: first token at 1.0, then one per step at 1.1 .. 1.5 (6 tokens); b: first at 1.2, then
    # 1.3 .. 1.7 (6 tokens). Steps 1.3, 1.4, 1.5 decode both.
    events = [(1.0, "a", 1), (1.1, "a", 2), (1.2, "a", 3), (1.2, "b", 1), (1.3, "a", 4), (1.3, "b", 2),
              (1.4, "a", 5), (1.4, "b", 3), (1.5, "a", 6), (1.5, "b", 4), (1.6, "b", 5), (1.7, "b", 6)]
    r = bv.reduce_timing(submit, list(reversed(events)))  # order does not matter
    assert r["ttft_ms"] == pytest.approx(1050.0) and r["ttft_max_ms"] == pytest.approx(1100.0)
    assert r["decode_ms"] == pytest.approx(100.0)  # both: 0.5 s over 5 tokens
    assert r["step_ms"] == pytest.approx(100.0)  # decode steps 1.1 .. 1.7, 0.1 s apart
    # all decoding from 1.2 (b's first) to 1.5 (a's last): steps 1.3, 1.4, 1.5 -> 6 tokens in 0.3 s
    assert r["tokens_per_s"] == pytest.approx(20.0) and r["all_decoding"] is True
    assert r["peak_concurrent"] == 2 and r["requests"] == 2


def test_reduce_timing_of_one_request_and_of_requests_never_together():
    one = bv.reduce_timing({"x": 10.0}, [(10.5, "x", 1), (10.52, "x", 2), (10.54, "x", 3), (10.56, "x", 4)])
    assert one["ttft_ms"] == one["ttft_max_ms"] == pytest.approx(500.0)
    assert one["decode_ms"] == pytest.approx(20.0) and one["tokens_per_s"] == pytest.approx(50.0)
    assert one["peak_concurrent"] == 1 and one["step_ms"] == pytest.approx(20.0)
    # one stalled step: the mean per token (decode_ms) takes it in full, the median step does not
    stall = bv.reduce_timing({"x": 0.0}, [(1.0, "x", 1), (1.01, "x", 2), (1.02, "x", 3), (1.33, "x", 4), (1.34, "x", 5)])
    assert stall["decode_ms"] == pytest.approx(85.0) and stall["step_ms"] == pytest.approx(10.0)
    # b starts after a finished (a preempted-for-capacity batch): never all decoding at once
    apart = bv.reduce_timing({"a": 0.0, "b": 0.0}, [(1.0, "a", 1), (2.0, "a", 3), (3.0, "b", 1), (3.5, "b", 2)])
    assert apart["all_decoding"] is False and apart["peak_concurrent"] == 1
    assert apart["tokens_per_s"] == pytest.approx(3 / 2.5)  # 3 decode tokens from 1.0 to 3.5
    assert apart["decode_ms"] == pytest.approx(500.0)  # median of 500 and 500
    assert apart["step_ms"] == pytest.approx(1500.0)  # decode tokens at 2.0 and 3.5 only
    with pytest.raises(ValueError, match="produced no token"):
        bv.reduce_timing({"a": 0.0, "b": 0.0}, [(1.0, "a", 1)])


class _PrefixCachingEngine:
    """A stand-in for vLLM's engine over a clock that advances one step at a time: a prompt
    not seen before takes ``prefill_steps`` steps to its first token, one seen in an earlier
    request (its blocks cached) one step; at most ``chunks`` prompts prefill at once, then one
    token per step per request."""

    def __init__(self, prefill_steps=4, chunks=1):
        self.now, self.prefill_steps, self.chunks = 0.0, prefill_steps, chunks
        self.cached, self.live, self.asked = set(), {}, []

    def clock(self):
        return self.now

    def add_request(self, rid, prompt, params):
        ids = tuple(prompt["prompt_token_ids"])
        self.asked.append((rid, params))
        self.live[rid] = {"ids": ids, "left": 1 if ids in self.cached else self.prefill_steps, "n": 0,
                          "max": params}

    def has_unfinished_requests(self):
        return bool(self.live)

    def step(self):
        self.now += 1.0
        outs, prefilling = [], 0
        for rid, r in list(self.live.items()):
            if r["left"] > 0:
                if prefilling == self.chunks:
                    continue
                prefilling += 1
                r["left"] -= 1
                if r["left"]:
                    continue
            r["n"] += 1
            outs.append(SimpleNamespace(request_id=rid, outputs=[SimpleNamespace(token_ids=[0] * r["n"])]))
            if r["n"] == r["max"]:
                self.cached.add(r["ids"])
                del self.live[rid]
        return outs


def test_a_row_measures_prefill_in_one_pass_and_decode_of_the_cached_prompts_in_another(monkeypatch):
    """Three prompts that prefill one after another: pass 1's TTFT is their prefill; pass 2
    finds them cached and decodes all three together from its second step, so the decode time
    per token is one step and all three decode at once."""
    from bench import vllm_worker as w

    engine = _PrefixCachingEngine(prefill_steps=4, chunks=1)
    monkeypatch.setattr(w.time, "perf_counter", engine.clock)
    mem = SimpleNamespace(sample=lambda *a: None)
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    r = w.measure(engine, prompts, 9, lambda n: n, mem, "t")
    assert [p for _, p in engine.asked] == [1, 1, 1, 9, 9, 9]
    assert r["ttft_ms"] == pytest.approx(8000.0) and r["ttft_max_ms"] == pytest.approx(12000.0)  # steps 4, 8, 12
    assert r["resume_ms"] == pytest.approx(2000.0)  # pass 2 (from step 12): first tokens at steps 13, 14, 15
    assert r["decode_ms"] == pytest.approx(1000.0) and r["all_decoding"] is True
    assert r["peak_concurrent"] == 3 and r["requests"] == 3
    assert r["tokens_per_s"] == pytest.approx(3.0)


# ---- workers ---------------------------------------------------------------------------------
def _spec(tmp_path, method="hbm") -> dict:
    return {"method": method, "out": str(tmp_path / f"{method}.json")}


def _recorded_results() -> list[dict]:
    """What the two workers write on a GPU (numbers made up, shapes real)."""
    common = dict(new_tokens=32, requests=None, all_decoding=True, wall_s=9.0)
    hbm = {"method": "hbm", "status": "ok", "error": None, "vllm_version": "0.26.0",
           "engine": {"gpu_kv_tokens": 800000, "block_size": 16, "staging_bytes": 800000 * TOKEN_BYTES_8B},
           "rows": [
               dict(method="vllm[hbm]", role="measured", context=32768, batch=1, batch_spec="1", status="ok",
                    ttft_ms=2500.0, ttft_max_ms=2500.0, decode_ms=9.0, tokens_per_s=111.0, peak_concurrent=1,
                    gpu_bytes=120 * GiB, staging_bytes=100 * GiB, host_bytes=0, **common),
               dict(method="vllm[hbm]", role="measured", context=32768, batch=24, batch_spec="max", status="ok",
                    ttft_ms=30000.0, ttft_max_ms=60000.0, decode_ms=40.0, tokens_per_s=600.0, peak_concurrent=24,
                    gpu_bytes=120 * GiB, staging_bytes=100 * GiB, host_bytes=0, **common),
               dict(method="vllm[hbm]", role="non-attention", context=1024, batch=1, batch_spec="1", status="ok",
                    decode_ms=6.5, **common),
               dict(method="vllm[hbm]", role="non-attention", context=1024, batch=24, batch_spec="24", status="ok",
                    decode_ms=7.5, **common)]}
    off = {"method": "offload", "status": "ok", "error": None, "vllm_version": "0.26.0", "engine": {},
           "rows": [dict(method="vllm[offload]", role="measured", context=32768, batch=48, batch_spec="max",
                         status="ok", ttft_ms=70000.0, ttft_max_ms=140000.0, decode_ms=45.0, tokens_per_s=530.0,
                         peak_concurrent=24, gpu_bytes=121 * GiB, staging_bytes=100 * GiB, host_bytes=100 * GiB,
                         **common)]}
    return [off, hbm]


def _doc() -> dict:
    return {"schema": bv.VLLM_SCHEMA, "bench": "vllm",
            "header": {"gpu": "NVIDIA H200", "gpu_key": "NVIDIA_H200", "date": "2030-01-01", "versions": {}},
            "ceilings": {"memcpy_h2d_gbps": 50.0, "host_read_gbps": 45.0, "hbm_read_gbps": 4000.0},
            "args": {"preset": "llama3-8b"}, "model": bv.model_shape("llama3-8b"), "engines": {}, "passed": True,
            "rows": []}


def _writer(results: list[dict]) -> list[str]:
    """A fake worker command: writes the recorded result of the spec's method to the spec's out."""
    code = ("import json, sys; spec = json.load(open(sys.argv[-1])); print('engine up'); "
            "json.dump(json.loads(sys.argv[1])[spec['method']], open(spec['out'], 'w'))")
    return [sys.executable, "-c", code, json.dumps({r["method"]: r for r in results})]


def test_a_recorded_worker_result_through_the_parent(tmp_path, capsys):
    recorded = _recorded_results()
    cmd = _writer(recorded)
    results = [bv.run_worker(_spec(tmp_path, m), command=cmd, timeout_s=60, echo=False, env={})
               for m in ("offload", "hbm")]
    assert [r["status"] for r in results] == ["ok", "ok"] and results[0]["log_tail"] == ["engine up"]
    doc = bv.collect(_doc(), results)
    assert doc["passed"] and doc["header"]["versions"]["vllm"] == "0.26.0"
    assert set(doc["engines"]) == {"vllm[hbm]", "vllm[offload]"}
    assert all(set(r) == set(bv.ROW_FIELDS) for r in doc["rows"])
    rows = {(r["method"], r["role"], r["batch"]): r for r in doc["rows"]}
    b1 = rows[("vllm[hbm]", "measured", 1)]
    # 32768 x 128 KiB = 4 GiB at 50 GB/s = 85.89934592 ms + 6.5 ms at the short context
    assert b1["kv_bytes_per_step"] == 4 * GiB and b1["non_attention_ms"] == 6.5
    assert b1["floor_ms"] == pytest.approx(92.39934592)
    b24 = rows[("vllm[hbm]", "measured", 24)]
    assert b24["floor_ms"] == pytest.approx(24 * 85.89934592 + 7.5)
    off = rows[("vllm[offload]", "measured", 48)]  # no short row at B48: the link alone, noted
    assert off["non_attention_ms"] is None and off["floor_ms"] == pytest.approx(48 * 85.89934592)
    assert "no short row" in off["note"]
    assert rows[("vllm[hbm]", "non-attention", 1)]["floor_ms"] is None
    text = bv.format_table(doc)
    lines = text.splitlines()
    assert "memcpy H2D 50.0 GB/s" in lines[1]
    header = next(line for line in lines if line.startswith("method"))
    for col in ("TTFT ms", "ms/tok/seq", "tok/s", "peak conc.", "GPU GiB", "staging GiB", "host GiB", "floor ms",
                "%floor", "target"):
        assert col in header
    row24 = next(line for line in lines if line.startswith("vllm[hbm]") and " 24  " in line and "32k" in line)
    assert "30000 / 60000" in row24 and "40.00" in row24 and "batch max" in row24
    assert f"{24 * 85.89934592 + 7.5:.2f}" in row24 and f"{100 * (24 * 85.89934592 + 7.5) / 40:.0f}" in row24
    row48 = next(line for line in lines if line.startswith("vllm[offload]"))
    assert " 48 " in row48 and "100.0" in row48  # host GiB
    json.dumps(doc)  # the document is plain JSON


def test_a_failing_worker_is_an_error_entry(tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('loading'); print('CUDA out of memory', file=sys.stderr); "
                                 "sys.exit(1)"]
    res = bv.run_worker(_spec(tmp_path, "offload"), command=cmd, timeout_s=60, echo=False, env={})
    assert res["status"] == "error" and res["returncode"] == 1 and res["rows"] == []
    assert "status 1" in res["error"] and "CUDA out of memory" in res["error"]
    recorded = _recorded_results()[1]
    doc = bv.collect(_doc(), [res, recorded | {"returncode": 0}])
    assert not doc["passed"] and doc["engines"]["vllm[offload]"]["status"] == "error"
    (err_row,) = [r for r in doc["rows"] if r["method"] == "vllm[offload]"]
    assert err_row["status"] == "error" and "CUDA out of memory" in err_row["error"]
    assert any(r["method"] == "vllm[hbm]" and r["status"] == "ok" for r in doc["rows"])  # the other still ran
    text = bv.format_table(doc)
    assert "vllm[offload]: error: worker exited with status 1" in text


def test_a_hanging_worker_times_out_and_keeps_the_rows_it_wrote(tmp_path):
    spec = _spec(tmp_path, "hbm")
    row = dict(method="vllm[hbm]", role="measured", context=8, batch=1, batch_spec="1", status="ok", decode_ms=1.0)
    code = ("import json, sys, time, subprocess; spec = json.load(open(sys.argv[-1])); "
            f"json.dump({{'method': 'hbm', 'status': 'ok', 'error': None, 'rows': [{row!r}]}}, "
            "open(spec['out'], 'w')); "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); print('stuck', flush=True); "
            "time.sleep(60)")
    t0 = time.monotonic()
    res = bv.run_worker(spec, command=[sys.executable, "-c", code], timeout_s=2,
                        echo=False, env={})
    assert time.monotonic() - t0 < 20  # the grandchild holding the pipe is killed too
    assert res["status"] == "timeout" and "timed out after 2 s" in res["error"] and "stuck" in res["error"]
    assert len(res["rows"]) == 1
    doc = bv.collect(_doc(), [res])
    assert not doc["passed"] and doc["engines"]["vllm[hbm]"]["status"] == "timeout"


def test_the_real_worker_without_vllm_names_the_fix(tmp_path):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    res = bv.run_worker(_spec(tmp_path, "hbm") | {"method": "hbm"}, timeout_s=120, echo=False)
    assert res["returncode"] == 2 and res["status"] == "error"
    assert "pip install" in res["error"] and "PYTHONPATH" in res["error"]


def _worker_spec(method: str, host_gib=None) -> dict:
    return {"method": method, "model_dir": "m", "max_model_len": 2057, "gpu_memory_utilization": 0.9, "seed": 0,
            "enforce_eager": False, "host_gib": host_gib, "token_bytes": TOKEN_BYTES_8B}


def test_the_worker_engine_arguments():
    from bench.vllm_worker import engine_kwargs

    kw = engine_kwargs(_worker_spec("offload", 3))
    assert kw["kv_offloading_size"] == 3.0 and kw["kv_offloading_backend"] == "native"
    assert kw["load_format"] == "dummy" and kw["skip_tokenizer_init"] and kw["generation_config"] == "vllm"
    assert kw["dtype"] == "bfloat16" and kw["max_model_len"] == 2057
    assert "attention_backend" not in kw and "kv_cache_memory_bytes" not in kw
    hbm = engine_kwargs(_worker_spec("hbm"))
    assert not {"kv_offloading_size", "attention_backend", "kv_cache_memory_bytes"} & set(hbm)
    dkv = engine_kwargs(_worker_spec("directkv", 16.5))
    assert dkv["attention_backend"] == "CUSTOM" and dkv["kv_cache_memory_bytes"] == int(16.5 * GiB)
    assert "kv_offloading_size" not in dkv
    assert {k: v for k, v in dkv.items() if k not in ("attention_backend", "kv_cache_memory_bytes")} == hbm


def test_the_worker_spec_carries_each_method_its_own_host_kv(tmp_path, fake_gpu):
    from bench.__main__ import build_parser

    opts = bv.resolve_options(build_parser().parse_args(["vllm", "--smoke"]), host_avail=None)
    host = {"offload": 1.0, "directkv": 2.0}
    specs = {m: bv.worker_spec(m, opts, model_dir=tmp_path, out=tmp_path / f"{m}.json", host_gib=host,
                               short_batches=[1]) for m in bv.METHODS}
    assert {m: sp["host_gib"] for m, sp in specs.items()} == {"offload": 1.0, "directkv": 2.0, "hbm": None}
    assert specs["directkv"]["short_context"] == 0 and specs["hbm"]["short_context"] == 256
    assert specs["directkv"]["name"] == "vllm+directkv[host]"


@pytest.mark.parametrize("method,host_gib", [("hbm", None), ("offload", 3.0), ("directkv", 16.5)])
def test_vllm_accepts_the_engine_arguments(method, host_gib):
    """Every keyword the worker passes is a field of vLLM's EngineArgs (what ``vllm.LLM`` builds)."""
    pytest.importorskip("vllm")
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    from bench.vllm_worker import engine_kwargs

    kw = engine_kwargs(_worker_spec(method, host_gib))
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert set(kw) <= fields, set(kw) - fields
    args = EngineArgs(**kw)  # builds the dataclass only: no config, no engine
    if method == "directkv":
        assert args.kv_cache_memory_bytes == int(16.5 * GiB) and args.attention_backend == "CUSTOM"
        from vllm.config.attention import AttentionConfig

        assert AttentionConfig.validate_backend_before(args.attention_backend).name == "CUSTOM"


def _fake_engine(num_blocks: int, block: int = 16, kv_tokens=None, backend=None, kv_bytes=None, v2=True):
    from types import SimpleNamespace as NS

    cache = NS(block_size=block, num_gpu_blocks=num_blocks, kv_cache_size_tokens=kv_tokens,
               kv_cache_memory_bytes=kv_bytes)
    return NS(vllm_config=NS(cache_config=cache, scheduler_config=NS(max_num_seqs=256),
                             kv_transfer_config=None, attention_config=NS(backend=backend),
                             use_v2_model_runner=v2))


def test_engine_entry_of_each_method():
    from enum import Enum

    from bench.vllm_worker import engine_entry

    hbm = engine_entry(_fake_engine(50000, kv_tokens=800000), _worker_spec("hbm"))
    assert (hbm["gpu_kv_tokens"], hbm["host_kv_tokens"], hbm["capacity_tokens"]) == (800000, 0, 800000)
    assert hbm["staging_bytes"] == 800000 * TOKEN_BYTES_8B and hbm["host_bytes"] == 0
    assert "attention_config_backend" not in hbm
    off = engine_entry(_fake_engine(50000, kv_tokens=800000), _worker_spec("offload", 2))
    assert off["host_bytes"] == 2 * GiB and off["host_kv_tokens"] == 2 * GiB // TOKEN_BYTES_8B == 16384
    assert off["capacity_tokens"] == 800000 + 16384 and off["staging_bytes"] == hbm["staging_bytes"]
    # directkv: 64 GiB of host KV = 32768 blocks of 16 tokens (2 MiB a block); vLLM calls them GPU blocks
    backend = Enum("AttentionBackendEnum", "FLASH_ATTN CUSTOM").CUSTOM
    dkv = engine_entry(_fake_engine(32768, kv_tokens=524288, backend=backend, kv_bytes=64 * GiB),
                       _worker_spec("directkv", 64))
    assert (dkv["gpu_kv_tokens"], dkv["host_kv_tokens"], dkv["capacity_tokens"]) == (0, 524288, 524288)
    assert dkv["staging_bytes"] == 0 and dkv["host_bytes"] == 64 * GiB
    assert dkv["attention_backend_requested"] == "CUSTOM" and dkv["attention_config_backend"] == "CUSTOM"
    assert dkv["kv_cache_memory_bytes"] == 64 * GiB and dkv["use_v2_model_runner"] is True
    json.dumps(dkv)  # plain values for the result document
    assert bv.max_batch(dkv["capacity_tokens"], 32768, 33, 16, 256) == 15  # 2051 blocks a sequence


def test_the_backend_verdict():
    from bench.vllm_worker import backend_verdict

    path = "directkv_cute.vllm.backend.DirectKVBackend"
    good = {"backends": [path], "layers": 32, "kv_pinned_host_layers": 32, "model_runner": "x"}
    assert backend_verdict([good], path) is None
    assert "no engine worker" in backend_verdict([], path)
    other = good | {"backends": ["vllm.v1.attention.backends.flash_attn.FlashAttentionBackend"]}
    assert "FlashAttentionBackend" in backend_verdict([good, other], path)
    assert "31 of 32 layers" in backend_verdict([good | {"kv_pinned_host_layers": 31}], path)


def test_the_backend_probe_on_a_fake_worker(monkeypatch):
    """``backend_probe`` as it runs in the engine's process, over vLLM's own layer lookup."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace as NS

    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    import directkv_cute.vllm.memory as memory
    from bench.vllm_worker import backend_probe, backend_verdict
    from directkv_cute.vllm import BACKEND_PATH
    from directkv_cute.vllm.backend import DirectKVBackend

    class Layer(AttentionLayerBase):
        def __init__(self, kv):
            self.kv_cache = kv

        def get_attn_backend(self):
            return DirectKVBackend

        def get_kv_cache_spec(self, vllm_config):
            return None

    kv = [torch.zeros(64, dtype=torch.int8) for _ in range(3)]
    monkeypatch.setattr(memory, "_RANGES", sorted((t.data_ptr(), t.numel()) for t in kv[:2]))
    layers = {f"model.layers.{i}.self_attn.attn": Layer(t) for i, t in enumerate(kv)} | {"lm_head": object()}
    worker = NS(vllm_config=NS(compilation_config=NS(static_forward_context=layers)), model_runner=NS())
    probe = backend_probe(worker)
    assert probe["backends"] == [BACKEND_PATH] and probe["layers"] == 3
    assert probe["kv_pinned_host_layers"] == 2 and probe["model_runner"].endswith("SimpleNamespace")
    json.dumps(probe)
    assert "2 of 3 layers" in backend_verdict([probe], BACKEND_PATH)


def _directkv_result() -> dict:
    """What the directkv worker writes on a GPU (numbers made up, shapes real): 64 GiB of host KV."""
    common = dict(new_tokens=32, requests=None, all_decoding=True, wall_s=9.0, staging_bytes=0,
                  host_bytes=64 * GiB)
    return {"method": "directkv", "status": "ok", "error": None, "vllm_version": "0.26.0",
            "engine": {"gpu_kv_tokens": 0, "host_kv_tokens": 524288, "capacity_tokens": 524288,
                       "staging_bytes": 0, "host_bytes": 64 * GiB, "attention_backend_requested": "CUSTOM",
                       "attention_config_backend": "CUSTOM", "backend_verified": True},
            "rows": [dict(method="vllm+directkv[host]", role="measured", context=32768, batch=1, batch_spec="1",
                          status="ok", ttft_ms=3000.0, ttft_max_ms=3000.0, decode_ms=95.0, tokens_per_s=10.5,
                          peak_concurrent=1, gpu_bytes=20 * GiB, **common),
                     dict(method="vllm+directkv[host]", role="measured", context=32768, batch=15,
                          batch_spec="max", status="ok", ttft_ms=40000.0, ttft_max_ms=80000.0, decode_ms=1400.0,
                          tokens_per_s=10.7, peak_concurrent=15, gpu_bytes=21 * GiB, **common)]}


def test_a_recorded_directkv_worker_through_the_parent(tmp_path):
    recorded = [_directkv_result()] + _recorded_results()[1:]  # directkv, then hbm and its short rows
    cmd = _writer(recorded)
    results = [bv.run_worker(_spec(tmp_path, m), command=cmd, timeout_s=60, echo=False, env={})
               for m in ("directkv", "hbm")]
    doc = bv.collect(_doc(), results)
    assert doc["passed"] and set(doc["engines"]) == {"vllm+directkv[host]", "vllm[hbm]"}
    assert doc["engines"]["vllm+directkv[host]"]["backend_verified"] is True
    assert all(set(r) == set(bv.ROW_FIELDS) for r in doc["rows"])
    rows = {(r["method"], r["batch"]): r for r in doc["rows"] if r["role"] == "measured"}
    b1 = rows[("vllm+directkv[host]", 1)]
    # 4 GiB at 50 GB/s = 85.89934592 ms + 6.5 ms (hbm's short row at B1) = 92.39934592 ms; 95 ms measured
    assert b1["floor_ms"] == pytest.approx(92.39934592) and b1["pct_floor"] == pytest.approx(9239.934592 / 95)
    assert b1["target_pct"] == 95.0 and b1["target_met"] is True
    b15 = rows[("vllm+directkv[host]", 15)]  # no short row at B15: the link alone, no verdict
    assert b15["floor_ms"] == pytest.approx(15 * 85.89934592) and b15["target_met"] is None
    hbm1 = rows[("vllm[hbm]", 1)]
    assert hbm1["target_pct"] is None and hbm1["pct_floor"] == pytest.approx(100 * 92.39934592 / 9.0)
    text = bv.format_table(doc)
    lines = text.splitlines()
    assert "target: vllm+directkv[host] at >= 95% of its floor" in lines[1]
    dkv = [line for line in lines if line.startswith("vllm+directkv[host]")]
    assert len(dkv) == 2
    assert " 97 " in dkv[0] and ">=95% MET" in dkv[0] and " 64.0 " in dkv[0] and " 0.0 " in dkv[0]
    assert ">=95% ?" in dkv[1] and "batch max" in dkv[1]
    assert not any(">=95%" in line for line in lines if line.startswith("vllm[hbm]"))
    order = [line.split()[0] for line in lines[3:]]
    assert order.index("vllm+directkv[host]") > order.index("vllm[hbm]")  # hbm's measured rows first
    doc["header"]["versions"]["vllm"] = "0.26.0"
    assert json.loads(json.dumps(doc))["rows"] == doc["rows"]
    png = bv.plot_vllm(doc, tmp_path / "v.png")
    assert png is None or png.stat().st_size > 0


# ---- directkv's HBM tier ---------------------------------------------------------------------
def test_the_directkv_hbm_option(fake_gpu):
    from bench.__main__ import build_parser

    parse = build_parser().parse_args
    assert bv.resolve_options(parse(["vllm"]), host_avail=None)["directkv_hbm_gib"] == [0.0]
    for text, want in (("12.5", [12.5]), ("AUTO", ["auto"]), (" 0 ", [0.0]), ("0, auto", [0.0, "auto"]),
                       ("20,0", [20.0, 0.0])):
        opts = bv.resolve_options(parse(["vllm", "--directkv-hbm-gib", text]), host_avail=None)
        assert opts["directkv_hbm_gib"] == want
    # auto without directkv asks nothing of offload
    opts = bv.resolve_options(parse(["vllm", "--methods", "hbm", "--directkv-hbm-gib", "auto"]), host_avail=None)
    assert opts["methods"] == ["hbm"]
    assert bv.method_name("directkv") == "vllm+directkv[host]"
    assert bv.method_name("directkv", 12.5) == "vllm+directkv[hbm 12.5 GiB]"
    assert bv.method_name("offload", 12.5) == "vllm[offload]"
    assert bv.method_of("vllm+directkv[hbm 12.5 GiB]") == "directkv" and bv.method_of("vllm[hbm]") == "hbm"
    assert bv.method_of("other") is None


@pytest.mark.parametrize("text,why", [("", "is empty"), (" , ", "is empty"), ("0,0.0", "names a tier twice"),
                                      ("auto,AUTO", "names a tier twice"), ("0,-1", "finite number >= 0")])
def test_a_bad_directkv_hbm_list_is_one_line(text, why, fake_gpu):
    from bench.__main__ import build_parser

    with pytest.raises(bv.UsageError, match=why) as e:
        bv.resolve_options(build_parser().parse_args(["vllm", "--directkv-hbm-gib", text]), host_avail=None)
    assert "\n" not in str(e.value)


def _run_over_recorded_workers(opts, tmp_path, monkeypatch):
    """``run_methods`` over workers that succeed at once (offload's engine reports 3 GiB of GPU
    KV): the specs they were given, and the document."""
    seen = []

    def fake_run_worker(spec, **kw):
        seen.append(spec)
        engine = {"staging_bytes": 3 * GiB} if spec["method"] == "offload" else {}
        return {"method": spec["method"], "name": spec["name"], "status": "ok", "error": None, "engine": engine,
                "rows": []}

    monkeypatch.setattr(bv, "run_worker", fake_run_worker)
    doc = {"header": {"versions": {}}, "model": bv.model_shape("tiny"), "ceilings": {"memcpy_h2d_gbps": 50.0},
           "engines": {}, "rows": []}
    bv.run_methods(opts, work_dir=tmp_path, host_gib={"offload": 1.0, "directkv": 1.0}, write=lambda: None, doc=doc)
    return seen, doc


def test_a_list_of_tiers_runs_one_directkv_engine_each(tmp_path, fake_gpu, monkeypatch):
    """``--directkv-hbm-gib 0,auto``: directkv host-only, then with offload's GPU KV bytes, each
    in its own worker with its own spec file and name, beside offload and hbm."""
    from bench.__main__ import build_parser

    opts = bv.resolve_options(build_parser().parse_args(
        ["vllm", "--smoke", "--directkv-hbm-gib", "0,auto"]), host_avail=None)
    seen, doc = _run_over_recorded_workers(opts, tmp_path, monkeypatch)
    assert [(s["method"], s["hbm_gib"]) for s in seen] == [("offload", 0.0), ("directkv", 0.0), ("directkv", 3.0),
                                                           ("hbm", 0.0)]
    assert len({s["out"] for s in seen}) == 4
    assert list(doc["engines"]) == ["vllm[offload]", "vllm+directkv[host]", "vllm+directkv[hbm 3 GiB]", "vllm[hbm]"]


def test_auto_takes_the_offload_engines_gpu_kv_bytes():
    offload = {"method": "offload", "status": "ok", "engine": {"staging_bytes": 58 * GiB + GiB // 2}}
    assert bv.auto_hbm_gib([offload]) == 58.5
    for results in ([], [{"method": "offload", "status": "error", "engine": {}}],
                    [{"method": "hbm", "engine": {"staging_bytes": GiB}}]):
        with pytest.raises(ValueError, match="vllm\\[offload\\] reported no GPU KV bytes") as e:
            bv.auto_hbm_gib(results)
        assert "\n" not in str(e.value)


def test_the_worker_spec_and_engine_entry_of_the_hbm_tier(tmp_path, fake_gpu):
    from enum import Enum

    from bench.__main__ import build_parser
    from bench.vllm_worker import engine_entry

    opts = bv.resolve_options(build_parser().parse_args(["vllm"]), host_avail=None)
    spec = bv.worker_spec("directkv", opts, model_dir=tmp_path, out=tmp_path / "d.json", host_gib={"directkv": 64.0},
                          short_batches=[], hbm_gib=4.0)
    assert spec["name"] == "vllm+directkv[hbm 4 GiB]" and spec["hbm_gib"] == 4.0 and spec["kv_layout"] == [32, 8, 128]
    other = bv.worker_spec("offload", opts, model_dir=tmp_path, out=tmp_path / "o.json", host_gib={"offload": 1.0},
                           short_batches=[], hbm_gib=4.0)
    assert other["hbm_gib"] == 0.0 and other["name"] == "vllm[offload]"
    # 4 GiB over 32 layers of 2 MiB blocks: 2048 mirrors, 2048 x 16 tokens x 128 KiB = 4 GiB in HBM
    backend = Enum("AttentionBackendEnum", "CUSTOM").CUSTOM
    engine = _fake_engine(32768, backend=backend, kv_bytes=64 * GiB)
    entry = engine_entry(engine, spec | {"token_bytes": TOKEN_BYTES_8B})
    assert entry["hbm_mirror_blocks"] == 2048 and entry["staging_bytes"] == 4 * GiB and entry["hbm_gib"] == 4.0
    assert entry["capacity_tokens"] == 524288  # mirrors are copies: no more blocks


def test_auto_runs_directkv_with_the_offload_engines_hbm(tmp_path, fake_gpu, monkeypatch):
    """run_methods over recorded workers: offload first, then directkv with auto; the directkv
    worker's spec carries offload's GPU KV bytes and its name; without an offload engine, an
    error entry of one line and the other methods still run."""
    from bench.__main__ import build_parser

    opts = bv.resolve_options(build_parser().parse_args(
        ["vllm", "--smoke", "--methods", "offload,directkv", "--directkv-hbm-gib", "auto", "--short-context", "0"]),
        host_avail=None)
    seen, doc = _run_over_recorded_workers(opts, tmp_path, monkeypatch)
    assert [s["method"] for s in seen] == ["offload", "directkv"]
    assert seen[1]["hbm_gib"] == 3.0 and seen[1]["name"] == "vllm+directkv[hbm 3 GiB]"
    assert set(doc["engines"]) == {"vllm[offload]", "vllm+directkv[hbm 3 GiB]"}

    def failing_offload(spec, **kw):
        seen.append(spec)
        return {"method": spec["method"], "status": "error", "error": "engine did not start", "engine": {}, "rows": []}

    seen.clear()
    monkeypatch.setattr(bv, "run_worker", failing_offload)
    doc["engines"], doc["rows"] = {}, []
    results = bv.run_methods(opts, work_dir=tmp_path, host_gib={"offload": 1.0, "directkv": 1.0}, write=lambda: None,
                             doc=doc)
    assert [s["method"] for s in seen] == ["offload"]  # no directkv worker started
    err = results[1]
    assert err["status"] == "error" and "auto: vllm[offload] reported no GPU KV bytes" in err["error"]
    assert doc["engines"]["vllm+directkv[hbm auto]"]["status"] == "error" and not doc["passed"]


def test_an_hbm_tier_row_in_the_table_has_no_target(tmp_path):
    result = _directkv_result()
    name = bv.method_name("directkv", 4.0)
    result = result | {"name": name, "rows": [r | {"method": name} for r in result["rows"]]}
    doc = bv.collect(_doc(), [result] + _recorded_results()[:1])
    rows = [r for r in doc["rows"] if r["method"] == name]
    assert rows and all(r["target_pct"] is None and r["floor_ms"] is not None for r in rows)
    lines = bv.format_table(doc).splitlines()
    tier = [line for line in lines if line.startswith(name)]
    assert len(tier) == 2 and not any(">=95%" in line for line in tier)


def test_the_directkv_worker_refuses_without_the_plugins_entry_point(tmp_path, monkeypatch, capsys):
    """A source tree on PYTHONPATH has no entry point, so vLLM would find no CUSTOM backend: the
    worker says so before starting an engine (and before importing vLLM)."""
    import directkv_cute.vllm as plugin
    from bench import vllm_worker

    monkeypatch.setattr(plugin, "plugin_installed", lambda: False)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(_spec(tmp_path, "directkv") | {"hbm_gib": 0}))
    assert vllm_worker.main([str(spec)]) == 2
    got = json.loads((tmp_path / "directkv.json").read_text())
    assert got["status"] == "error" and got["error"] == bv.PLUGIN_MISSING
    assert "entry point" in capsys.readouterr().err
    # The fix names the interpreter the workers run under: a `pip` on PATH may install elsewhere.
    assert f"{sys.executable} -m pip install -e ." in got["error"]


def test_the_installed_package_carries_the_plugins_entry_point():
    from importlib.metadata import PackageNotFoundError, distribution

    from directkv_cute.vllm import plugin_installed

    try:
        distribution("directkv-cute")
    except PackageNotFoundError:
        pytest.skip("the package is not installed (a bare source tree)")
    assert plugin_installed()
