"""``python -m bench soak`` without a GPU or vLLM (CPU tests): the command line and its refusals,
the request mix, the readers of /metrics, /proc and the server log, the HTTP client (streams cut
off or reset, whole answers, clients that give up, errors) against a fake OpenAI server, the
judgement on synthetic samples, and whole soaks against the fake server in its own process group."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

import bench.common as bc
import bench.serve as bserve
import bench.soak as bs
from bench.__main__ import main
from bench.common import GiB, MiB

SMOL_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 30,
               "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
               "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}


@pytest.fixture
def model_folder(tmp_path) -> Path:
    folder = tmp_path / "smol"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(SMOL_CONFIG))
    return folder


@pytest.fixture
def host_100g(monkeypatch):
    monkeypatch.setattr(bs, "available_host_bytes", lambda: 100 * GiB)


def _refused(argv, capsys) -> str:
    assert main(["soak", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    return err


# ---- command line ----------------------------------------------------------------------------
@pytest.mark.parametrize("argv,words", [
    (["--num-requests", "9"], "--num-requests must be >= 10"),
    (["--num-requests", "1e3"], "--num-requests takes an integer"),
    (["--concurrency", "0"], "--concurrency must be >= 1"),
    (["--concurrency", "four"], "--concurrency takes an integer"),
    (["--seed", "0.5"], "--seed takes an integer"),
    (["--max-model-len", "256"], "--max-model-len must be >= 512"),
    (["--hbm-gb", "-1"], "--hbm-gb must be >= 0"),
    (["--hbm-gb", "nan"], "--hbm-gb takes a finite number"),
    (["--kv-gib", "0"], "--kv-gib must be > 0"),
    (["--kv-gib", "101"], "--kv-gib 101 is more than the host memory available (100.0 GiB)"),
    (["--abort-fraction", "0.6"], "--abort-fraction must be <= 0.5"),
    (["--sample-every", "0"], "--sample-every must be >= 1"),
    (["--rss-slack-mib", "-5"], "--rss-slack-mib must be >= 0"),
    (["--startup-timeout-s", "0"], "--startup-timeout-s must be > 0"),
    (["--request-timeout-s", "inf"], "--request-timeout-s takes a finite number"),
    (["--server-args=--port 9000"], "--server-args must not set --port"),
    (["--server-args=--attention-backend=FLASH_ATTN"], "--server-args must not set --attention-backend"),
    (["--server-args=--enforce-eager --kv-cache-memory-bytes 8G"],
     "must not set --kv-cache-memory-bytes: give --kv-gib"),
    (["--server-args=--x 'unclosed"], "--server-args:"),
    (["--model", "/no/such/folder"], "--model /no/such/folder: no config.json there"),
])
def test_bad_options_are_one_line_and_exit_2_before_anything(argv, words, host_100g, cwd, capsys):
    err = _refused(argv, capsys)
    assert err.startswith("bench soak: ") and words in err, err
    assert list(cwd.iterdir()) == []


def test_without_a_gpu_it_refuses_and_writes_nothing(monkeypatch, cwd, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = _refused([], capsys)
    assert err.startswith(bc.NO_GPU) and "bench soak needs CUDA" in err
    assert list(cwd.iterdir()) == []


def test_an_out_dir_that_is_a_file_is_refused(cwd, capsys):
    (cwd / "f").write_text("")
    assert "--out-dir f is a file" in _refused(["--out-dir", "f"], capsys)


def test_without_vllm_or_the_plugin_it_names_the_fix(monkeypatch):
    import importlib.util

    import directkv_cute.vllm as dv

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(SystemExit, match="bench soak: vLLM is not importable"):
        bs.check_runnable()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    monkeypatch.setattr(dv, "plugin_installed", lambda: False)
    with pytest.raises(SystemExit, match="bench soak: the directkv plugin is not installed"):
        bs.check_runnable()


def _ns(*argv):
    from bench.__main__ import build_parser

    return build_parser().parse_args(["soak", *argv])


def test_options_and_the_model_resolve_to_the_server_command(model_folder):
    opts = bs.resolve_options(_ns("--model", str(model_folder), "--concurrency", "8", "--hbm-gb", "0.5",
                                  "--server-args=--enforce-eager"), host_avail=100 * GiB)
    model = bs.resolve_model(opts, host_avail=100 * GiB)
    token_bytes = 30 * 2 * 3 * 64 * 2
    assert model["info"]["kv_token_bytes"] == token_bytes and model["workload"] == "smol"
    assert model["kv_gib"] == 1.0 and model["kv_why"] == "8 x 4096 tokens"  # 0.7 GiB, whole GiB
    cmd = bs.server_command(opts, model["model"], 8123, model["kv_gib"], python="py")
    assert cmd[:4] == ["py", "-m", "vllm.entrypoints.cli.main", "serve"] and cmd[4] == str(model_folder)
    flag = lambda name: cmd[cmd.index(name) + 1]  # noqa: E731
    assert flag("--attention-backend") == "CUSTOM" and flag("--kv-cache-memory-bytes") == str(GiB)
    assert flag("--max-num-seqs") == "8" and flag("--max-model-len") == "4096" and flag("--port") == "8123"
    assert cmd[-1] == "--enforce-eager"
    assert bs.server_env_changes(opts) == {"DIRECTKV_VLLM_HBM_GB": "0.5"}
    big = bs.resolve_model(bs.resolve_options(_ns("--model", str(model_folder), "--concurrency", "4096")),
                           host_avail=40 * GiB)
    assert big["kv_gib"] == 20.0 and "capped at half of 40 GiB" in big["kv_why"]


@pytest.mark.parametrize("argv,words", [
    (["--max-model-len", "9000"], "beyond the model's max_position_embeddings (8192)"),
    (["--kv-gib", "0.05"], "holds less than one sequence of --max-model-len"),
])
def test_what_the_model_cannot_do_is_refused(argv, words, model_folder):
    opts = bs.resolve_options(_ns("--model", str(model_folder), *argv), host_avail=100 * GiB)
    with pytest.raises(SystemExit, match=words.replace("(", r"\(").replace(")", r"\)")):
        bs.resolve_model(opts, host_avail=100 * GiB)


# ---- the request mix -------------------------------------------------------------------------
def test_the_request_mix_is_deterministic_and_mixed():
    mix = bs.request_mix(1000, 7, vocab=49152, max_model_len=4096)
    assert mix == bs.request_mix(1000, 7, vocab=49152, max_model_len=4096)
    assert mix != bs.request_mix(1000, 8, vocab=49152, max_model_len=4096)
    kinds = Counter(r["kind"] for r in mix)
    assert 20 <= kinds["cut"] <= 85 and kinds["plain"] > 350 and kinds["stream"] > 350, kinds
    bounds = bs.prompt_bucket_bounds(4096)
    assert bounds == [(4, 64), (64, 512), (512, 1536), (1536, 3072)]
    in_bucket = Counter(next(i for i, (lo, hi) in enumerate(bounds) if r["prompt_len"] <= hi) for r in mix)
    assert all(in_bucket[i] >= 30 for i in range(4)), in_bucket
    plain = [r["max_tokens"] for r in mix if r["kind"] != "cut"]
    assert min(plain) <= 4 and sum(m > 128 for m in plain) >= 100 and max(plain) > 400
    for r in mix:
        assert len(r["prompt"]) == r["prompt_len"] and r["prompt_len"] + r["max_tokens"] < 4096
        assert all(bs.TOKEN_LO <= t < 49152 for t in r["prompt"])
        if r["kind"] == "cut":
            assert 1 <= r["cut_after"] <= bs.MAX_CUT and r["max_tokens"] >= 4 * r["cut_after"]
        else:
            assert r["cut_after"] is None and not r["abrupt"] and r["max_tokens"] >= 1
    cut = [r for r in mix if r["kind"] == "cut"]
    assert 0 < sum(r["abrupt"] for r in cut) < len(cut)  # some closed, some reset
    shared = [r for r in mix if r["shared"] is not None]
    assert 120 <= len(shared) <= 280 and {r["shared"] for r in shared} == set(range(bs.NUM_PREFIXES))
    for k in range(bs.NUM_PREFIXES):  # the requests of one prefix share its tokens exactly
        group = [r["prompt"] for r in shared if r["shared"] == k]
        common = os.path.commonprefix(group)
        assert len(common) >= 4096 // 32 and all(len(p) > len(common) for p in group)
    summary = bs.mix_summary(mix)
    assert summary["kinds"] == {k: kinds[k] for k in ("plain", "stream", "cut")} and summary["requests"] == 1000
    assert summary["prompt_tokens"]["max"] <= 3072 and summary["shared_prefix"] == len(shared)


def test_a_short_model_length_still_leaves_room_for_every_output():
    mix = bs.request_mix(300, 1, vocab=1000, max_model_len=512, abort_fraction=0.5)
    assert all(r["prompt_len"] + r["max_tokens"] < 512 and r["max_tokens"] >= 1 for r in mix)
    assert all(500 <= t < 1000 for r in mix for t in r["prompt"])  # ids clear of the low end, within the vocabulary


# ---- readers ---------------------------------------------------------------------------------
METRICS_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="/tmp/models/smol \\"q\\""} 0.0
vllm:num_requests_waiting{engine="0",model_name="/tmp/models/smol"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="/tmp/models/smol"} 0.0
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="/tmp/models/smol"} 7.0
vllm:num_preemptions_created{engine="0",model_name="/tmp/models/smol"} 1.76e+09
vllm:prefix_cache_queries_total{engine="0",model_name="/tmp/models/smol"} 4000.0
vllm:prefix_cache_hits_total{engine="0",model_name="/tmp/models/smol"} 1024.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="/tmp/models/smol"} 2.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="/tmp/models/smol"} 40.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="/tmp/models/smol"} 0.0
vllm:generation_tokens_total{engine="0",model_name="/tmp/models/smol"} 1234.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="/tmp/models/smol"} 42.0
vllm:weird NaN
"""


def test_metrics_are_read_by_name_and_label():
    samples = bs.parse_samples(METRICS_TEXT)
    assert ("vllm:num_requests_running", {"engine": "0", "model_name": '/tmp/models/smol "q"'}, 0.0) in samples
    assert bs.metric(samples, "vllm:num_preemptions") == 7.0  # _total, not _created
    assert bs.metric(samples, "vllm:request_success") == 42.0
    assert bs.metric(samples, "vllm:request_success", finished_reason="length") == 40.0
    assert bs.metric(samples, "vllm:request_success", finished_reason="error") is None
    assert bs.metric(samples, "vllm:weird") is None  # not finite
    snap = bs.metrics_snapshot(METRICS_TEXT)
    assert snap == {"kv_cache_usage": 0.0, "running": 0.0, "waiting": 0.0, "preemptions": 7.0, "prefix_queries": 4000.0,
                    "prefix_hits": 1024.0, "generation_tokens": 1234.0, "prompt_tokens": None}
    assert bs.is_idle(snap)
    assert not bs.is_idle(snap | {"kv_cache_usage": 0.01}) and not bs.is_idle(snap | {"running": 1.0})
    assert not bs.is_idle(None) and not bs.is_idle(snap | {"kv_cache_usage": None})


def test_wait_idle_polls_until_idle_or_gives_up():
    readings = iter([None, {"running": 1, "waiting": 0, "kv_cache_usage": 0.2},
                     {"running": 0, "waiting": 0, "kv_cache_usage": 0.0}])
    idle, m, _ = bs.wait_idle("u", 5.0, poll_s=0.0, read=lambda url: next(readings))
    assert idle and m["kv_cache_usage"] == 0.0
    busy = {"running": 0, "waiting": 0, "kv_cache_usage": 0.5}
    idle, m, waited = bs.wait_idle("u", 0.05, poll_s=0.01, read=lambda url: busy)
    assert not idle and m is busy and waited >= 0.05


STATUS_TEXT = """\
Name:\tVLLM::EngineCor
State:\tS (sleeping)
VmPeak:\t 9000000 kB
VmLck:\t       4 kB
VmPin:\t    1024 kB
VmHWM:\t 5000000 kB
VmRSS:\t 4194304 kB
RssAnon:\t 3000000 kB
Threads:\t60
"""
MAPS_TEXT = """\
7f0000000000-7f0000200000 rw-s 00000000 00:05 12 /dev/nvidiactl
7f0000200000-7f0000300000 rw-s 00000000 00:05 13 /dev/nvidia0
7f0000300000-7f0100300000 rw-s 00000000 00:05 14 /dev/nvidia-uvm
7f0200000000-7f0200100000 rw-p 00000000 00:00 0
7f0300000000-7f0300001000 r--p 00000000 08:01 99 /usr/lib/libnvidia-ml.so.1
"""


def test_proc_readers():
    status = bs.parse_status(STATUS_TEXT)
    assert status["VmRSS"] == 4 * GiB and status["VmPin"] == MiB and status["VmLck"] == 4096
    assert "Threads" not in status and "State" not in status
    assert bs.driver_mapped_bytes(MAPS_TEXT) == 2 * MiB + MiB  # nvidiactl and nvidia0, not uvm or the library
    assert bs.host_used_bytes("MemTotal: 1000 kB\nMemFree: 10 kB\nMemAvailable: 600 kB\n") == 400 * 1024
    assert bs.host_used_bytes("MemTotal: 1000 kB\n") is None


LOG_TEXT = """\
(APIServer pid=1) INFO 12-07 10:00:00 [api_server.py:1] vLLM API server version 0.26.0
(EngineCore_DP0 pid=2) INFO 12-07 10:00:09 [memory.py:90] DirectKV: 30 KV tensors, 3 GiB of pinned host memory
(APIServer pid=1) INFO 12-07 10:01:00 [logger.py:1] Aborted request cmpl-1.
(APIServer pid=1) INFO 12-07 10:01:00 [logger.py:1] an ERRORS word and TERROR are no errors
(EngineCore_DP0 pid=2) ERROR 12-07 10:02:00 [core.py:1] EngineCore encountered a fatal error.
Traceback (most recent call last):
  File "x.py", line 1, in <module>
"""


def test_log_readers():
    errors = bs.log_errors(LOG_TEXT)
    assert errors["count"] == 2 and "EngineCore encountered a fatal error" in errors["first"][0]
    assert errors["first"][1] == "Traceback (most recent call last):"
    assert bs.log_errors("INFO all fine\n") == {"count": 0, "first": []}
    assert bs.pinned_log_gib(LOG_TEXT) == 3.0 and bs.pinned_log_gib("INFO nothing") is None
    assert bs.pinned_log_gib("DirectKV: 30 KV tensors, 0.138 GiB of pinned host memory") == 0.138


# ---- the judgement ---------------------------------------------------------------------------
OPTS = {"rss_slack_mib": 256.0, "pinned_slack_mib": 128.0}


def _sample(rss=8 * GiB, host=20 * GiB, pinned=0, driver=64 * MiB, kv=0.0, running=0):
    return {"rss_bytes": rss, "host_used_bytes": host, "pinned_bytes": pinned, "driver_mapped_bytes": driver,
            "metrics": {"kv_cache_usage": kv, "running": running, "waiting": 0, "preemptions": 3.0}}


def _run(**changes) -> dict:
    run = {"counts": {"ok": 950, "cut": 50, "error": 0}, "errors": [], "warm": _sample(), "end": _sample(),
           "log_errors": {"count": 0, "first": []}, "stop": {"group_gone": True, "killed": False, "stop_s": 4.2}}
    return run | changes


def _verdict(run) -> dict[str, str]:
    return {c["name"]: c["status"] for c in bs.judge(run, OPTS)}


def test_a_clean_run_passes_every_check():
    verdict = _verdict(_run())
    assert verdict == dict.fromkeys(["requests", "kv_cache_idle", "rss_growth", "host_used_growth", "pinned_growth",
                                     "driver_mapped_growth", "log_errors", "stopped"], "PASS")


@pytest.mark.parametrize("changes,failed", [
    ({"counts": {"ok": 949, "cut": 50, "error": 1}, "errors": ["request 5: HTTP 500"]}, "requests"),
    ({"counts": {"ok": 0, "cut": 0, "error": 0}}, "requests"),
    ({"end": _sample(kv=0.01)}, "kv_cache_idle"),
    ({"end": _sample(running=1)}, "kv_cache_idle"),
    ({"end": _sample() | {"metrics": None}}, "kv_cache_idle"),
    ({"end": _sample(rss=8 * GiB + 300 * MiB)}, "rss_growth"),  # the bound: max(256 MiB, 2% of 8 GiB = 164 MiB)
    ({"end": _sample(host=20 * GiB + 500 * MiB)}, "host_used_growth"),  # 2% of 20 GiB = 410 MiB
    ({"end": _sample(pinned=129 * MiB)}, "pinned_growth"),
    ({"end": _sample(driver=64 * MiB + 129 * MiB)}, "driver_mapped_growth"),
    ({"end": _sample(rss=None)}, "rss_growth"),  # not measured is no pass
    ({"log_errors": {"count": 1, "first": ["ERROR x"]}}, "log_errors"),
    ({"stop": {"group_gone": True, "killed": True, "stop_s": 75.0}}, "stopped"),
    ({"stop": {"group_gone": False, "killed": True, "stop_s": 75.0}}, "stopped"),
])
def test_each_fault_fails_its_own_check(changes, failed):
    verdict = _verdict(_run(**changes))
    assert [name for name, status in verdict.items() if status == "FAIL"] == [failed], verdict


def test_growth_within_the_bounds_passes():
    warm = _sample(rss=20 * GiB)
    end = _sample(rss=20 * GiB + 400 * MiB, host=20 * GiB + 256 * MiB, pinned=128 * MiB, driver=192 * MiB)
    assert set(_verdict(_run(warm=warm, end=end)).values()) == {"PASS"}  # 2% of 20 GiB = 410 MiB
    assert bs.rss_bound(GiB, 256) == 256 * MiB and bs.rss_bound(100 * GiB, 256) == int(0.02 * 100 * GiB)
    shrunk = _sample(rss=4 * GiB, host=10 * GiB, driver=0)
    assert set(_verdict(_run(end=shrunk)).values()) == {"PASS"}


# ---- the client against a fake server --------------------------------------------------------
FAKE_SERVER = r"""
import http.server, json, os, signal, sys, threading, time
port = int(sys.argv[sys.argv.index("--port") + 1])
lock, state = threading.Lock(), {"running": 0, "cut": 0}
if os.environ.get("FAKE_ERROR"):
    print("(APIServer pid=1) ERROR 12-07 10:00:00 [fake.py:1] something broke", flush=True)
print("(EngineCore_DP0 pid=2) INFO DirectKV: 30 KV tensors, 1 GiB of pinned host memory", flush=True)
signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
STEP_S = 0.0002


class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def reply(self, code, body, kind="application/json"):
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/health":
            return self.reply(200, b"")
        with lock:
            r, cut = state["running"], state["cut"]
        labels = '{engine="0",model_name="m"}'
        self.reply(200, (f"vllm:num_requests_running{labels} {r}.0\nvllm:num_requests_waiting{labels} 0.0\n"
                         f"vllm:kv_cache_usage_perc{labels} {r / 100}\nvllm:num_preemptions_total{labels} 0.0\n"
                         f"fake:cut_total{labels} {cut}.0\n").encode(), "text/plain")

    def chunk(self, data):
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt, n = req["prompt"], int(req["max_tokens"])
        if not isinstance(prompt, list):
            return self.reply(400, b'{"error": {"message": "prompt must be token ids here"}}')
        with lock:
            state["running"] += 1
        try:
            ids = [(sum(prompt) + k) % 1000 for k in range(n)]
            if not req.get("stream"):
                time.sleep(n * STEP_S * 5)
                choice = {"index": 0, "text": "".join(f"t{i} " for i in ids), "finish_reason": "length",
                          "token_ids": ids, "logprobs": None}
                return self.reply(200, json.dumps({"choices": [choice], "usage": {"completion_tokens": n}}).encode())
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for k, i in enumerate(ids):
                time.sleep(STEP_S)
                if prompt == [1] and k == 2:
                    self.chunk(b'data: {"error": {"message": "boom", "code": 500}}\n\n')
                    break
                c = {"index": 0, "text": f"t{i} ", "token_ids": [i],
                     "finish_reason": "length" if k == n - 1 else None}
                if req.get("logprobs"):
                    c["logprobs"] = {"tokens": [f"t{i} "], "token_logprobs": [-0.5], "top_logprobs": [{f"t{i} ": -0.5}]}
                self.chunk(b"data: " + json.dumps({"choices": [c]}).encode() + b"\n\n")
            else:
                self.chunk(b"data: [DONE]\n\n")
            self.chunk(b"")
        except (BrokenPipeError, ConnectionResetError):
            with lock:
                state["cut"] += 1
        finally:
            with lock:
                state["running"] -= 1


http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


REAL_LAUNCH = bserve.launch  # the tests below replace bench.serve.launch with these fakes


def _launch_fake(cmd, env, log, tmp_path):
    script = tmp_path / "fake_openai.py"
    script.write_text(FAKE_SERVER)
    port = cmd[cmd.index("--port") + 1]
    return REAL_LAUNCH([sys.executable, str(script), "--port", port], env, log)


@pytest.fixture
def fake(tmp_path):
    """A fake OpenAI server in its own process group: (base URL, its Popen)."""
    port = bserve.free_port()
    proc = _launch_fake(["--port", str(port)], dict(os.environ), tmp_path / "fake.log", tmp_path)
    url = f"http://127.0.0.1:{port}"
    state, _ = bserve.wait_healthy(proc, url, timeout_s=30, poll_s=0.05)
    assert state == "ok", (tmp_path / "fake.log").read_text()
    yield url, proc
    bserve.stop_group(proc, timeout_s=5)


def _cut_count(url) -> float:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics") as r:
        return bs.metric(bs.parse_samples(r.read().decode()), "fake:cut")


def test_the_client_streams_cuts_resets_gives_up_and_reports_errors(fake):
    url, _ = fake
    body = lambda prompt, n, **kw: bs.completion_body("m", prompt, n, **kw)  # noqa: E731
    whole = bs.send_completion(url, body([5, 6], 40))
    assert whole["status"] == "ok" and whole["tokens"] == 40 and whole["finish_reason"] == "length"
    assert whole["token_ids"] == [(11 + k) % 1000 for k in range(40)] and whole["text"].startswith("t11 t12 ")
    seen = []
    streamed = bs.send_completion(url, body([5, 6], 40, stream=True, logprobs=2), progress=seen.append)
    assert streamed["status"] == "ok" and streamed["token_ids"] == whole["token_ids"]
    assert streamed["text"] == whole["text"] and seen == list(range(1, 41))
    assert streamed["logprobs"]["tokens"][:2] == ["t11 ", "t12 "] and len(streamed["logprobs"]["top_logprobs"]) == 40
    assert 0 < streamed["ttft_s"] <= streamed["latency_s"]
    cuts = []
    for reset in (False, True):
        cut = bs.send_completion(url, body([7], 5000, stream=True), cut_after=3, reset=reset,
                                 on_cut=lambda: cuts.append(reset))
        assert cut["status"] == "cut" and 3 <= cut["tokens"] < 5000 and cut["finish_reason"] is None
    assert cuts == [False, True]
    assert _wait(lambda: _cut_count(url) == 2)  # the server saw both connections go, and stopped writing
    gave_up = bs.send_completion(url, body([8], 2000), give_up_s=0.2)
    assert gave_up["status"] == "cut" and gave_up["tokens"] == 0 and gave_up["latency_s"] < 1.5
    bad = bs.send_completion(url, body("text", 4))
    assert bad["status"] == "error" and bad["http"] == 400 and "token ids" in bad["error"]
    event = bs.send_completion(url, body([1], 10, stream=True))
    assert event["status"] == "error" and "boom" in event["error"] and event["tokens"] == 2
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    refused = bs.send_completion(closed, body([5], 4))
    assert refused["status"] == "error" and "ConnectionRefusedError" in refused["error"]
    broken = bs.send_completion(url, body([9], 5000, stream=True), cut_after=1, on_cut=lambda: 1 / 0)
    assert broken["status"] == "cut" and "ZeroDivisionError" in broken["error"]  # the close went on


def _wait(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_outcomes():
    asked = {"max_tokens": 16, "cut_after": None}
    ok = {"status": "ok", "tokens": 16, "error": None}
    assert bs.outcome(asked, ok) == ("ok", None)
    assert bs.outcome(asked, ok | {"tokens": 15})[0] == "error"
    assert bs.outcome(asked, {"status": "error", "tokens": 0, "error": "HTTP 500: x"}) == ("error", "HTTP 500: x")
    cut = {"max_tokens": 300, "cut_after": 4}
    assert bs.outcome(cut, {"status": "cut", "tokens": 4, "error": None}) == ("cut", None)
    assert bs.outcome(cut, ok | {"tokens": 300})[0] == "error"  # it ended before the client cut it


def test_sample_group_reads_every_process_of_the_group(fake):
    url, proc = fake
    s = bs.sample_group(proc.pid)
    assert s["processes"] == 1 and s["per_process"][0]["pid"] == proc.pid
    assert s["rss_bytes"] > 5 * MiB and s["pinned_bytes"] is not None and s["driver_mapped_bytes"] == 0
    assert 0 < s["host_used_bytes"]
    nobody = bs.sample_group(2**22 + 12345)  # a group with no process
    assert nobody["processes"] == 0 and nobody["rss_bytes"] is None and nobody["per_process"] == []


# ---- whole soaks against the fake server -----------------------------------------------------
def _soak_opts(**more) -> dict:
    opts = bs.resolve_options(_ns("--num-requests", "40", "--concurrency", "4", "--max-model-len", "512",
                                  "--sample-every", "8", "--abort-fraction", "0.2"))
    return opts | {"idle_timeout_s": 10.0} | more


def test_a_soak_against_the_fake_server(fake):
    url, proc = fake
    lines = []
    run = bs.soak(_soak_opts(), base_url=url, model="m", vocab=49152, pgid=proc.pid, echo=lines.append)
    assert run["counts"]["error"] == 0 and run["counts"]["cut"] == run["mix"]["kinds"]["cut"] > 0, run["errors"]
    assert run["counts"]["ok"] + run["counts"]["cut"] == 40 and [r["i"] for r in run["requests"]] == list(range(40))
    phases = [s["phase"] for s in run["samples"]]
    assert phases[0] == "warm" and phases[-1] == "end" and phases.count("load") == 4  # after 12, 20, 28, 36
    assert [s["done"] for s in run["samples"]] == [4, 12, 20, 28, 36, 40]
    assert run["warm"]["idle"] and run["end"]["idle"] and run["end"]["metrics"]["kv_cache_usage"] == 0
    assert all(s["rss_bytes"] > 0 for s in run["samples"])
    run |= {"log_errors": {"count": 0, "first": []}, "stop": bserve.stop_group(proc, timeout_s=5)}
    assert {c["name"]: c["status"] for c in bs.judge(run, _soak_opts())}["stopped"] == "PASS"
    assert any(line.startswith("-- warm-up: 4 requests") for line in lines)


def _fake_run(monkeypatch, tmp_path, model_folder, *, error: bool):
    """``python -m bench soak`` end to end with the GPU, vLLM and the server faked."""
    monkeypatch.setattr(bc, "require_gpu", lambda *a, **k: "cuda")
    monkeypatch.setattr(bc, "env_info", lambda device: {"gpu": "NVIDIA H100 80GB HBM3", "gpu_key": "NVIDIA_H100",
                                                        "date": "2026-12-07", "versions": {}})
    monkeypatch.setattr(bs, "check_runnable", lambda: None)
    monkeypatch.setattr(bserve, "launch", lambda cmd, env, log: _launch_fake(cmd, env, log, tmp_path))
    if error:
        monkeypatch.setenv("FAKE_ERROR", "1")
    argv = ["soak", "--model", str(model_folder), "--num-requests", "20", "--concurrency", "4", "--max-model-len",
            "512", "--sample-every", "5", "--kv-gib", "0.5"]
    return main(argv)


def test_the_whole_command_over_a_fake_server_writes_its_files(monkeypatch, tmp_path, model_folder, cwd, capsys):
    assert _fake_run(monkeypatch, tmp_path, model_folder, error=False) == 0
    out = capsys.readouterr().out
    stem = cwd / "bench-results" / "NVIDIA_H100-2026-12-07-soak-smol"
    doc = json.loads(stem.with_suffix(".json").read_text())
    assert doc["schema"] == "directkv-bench-soak/1" and doc["passed"] is True
    assert doc["server"]["status"] == "ok" and doc["server"]["kv_pinned_gib"] == 1.0
    assert doc["server"]["env"] == {"DIRECTKV_VLLM_HBM_GB": "0.0"} and "--attention-backend" in doc["server"]["command"]
    assert doc["server"]["stop"]["group_gone"] and len(doc["requests"]) == 20 and doc["mix"]["requests"] == 20
    assert doc["args"]["kv_gib"] == 0.5 and doc["args"]["workload"] == "smol"
    assert [c["status"] for c in doc["checks"]] == ["PASS"] * 8
    text = stem.with_suffix(".txt").read_text()
    assert text.startswith("== bench soak: smol on NVIDIA H100 80GB HBM3 2026-12-07") and "passed: True" in text
    assert (cwd / "bench-results" / (stem.name + "-raw") / "server.log").is_file()
    assert "PASS  kv_cache_idle" in out and "bench-results/NVIDIA_H100-2026-12-07-soak-smol.json" in out


def test_an_error_in_the_server_log_fails_the_soak(monkeypatch, tmp_path, model_folder, cwd, capsys):
    assert _fake_run(monkeypatch, tmp_path, model_folder, error=True) == 1
    doc = json.loads((cwd / "bench-results" / "NVIDIA_H100-2026-12-07-soak-smol.json").read_text())
    failed = [c for c in doc["checks"] if c["status"] == "FAIL"]
    assert [c["name"] for c in failed] == ["log_errors"] and "something broke" in failed[0]["why"]
    assert "FAIL  log_errors" in capsys.readouterr().out


def test_a_server_that_dies_at_startup_fails_with_its_last_line(monkeypatch, tmp_path, model_folder, cwd, capsys):
    def dying(cmd, env, log):
        return REAL_LAUNCH([sys.executable, "-c", "print('MemoryError: the KV cache needs 9 bytes'); exit(1)"],
                           env, log)

    monkeypatch.setattr(bc, "require_gpu", lambda *a, **k: "cuda")
    monkeypatch.setattr(bc, "env_info", lambda device: {"gpu": "G", "gpu_key": "G", "date": "2026-12-07",
                                                        "versions": {}})
    monkeypatch.setattr(bs, "check_runnable", lambda: None)
    monkeypatch.setattr(bserve, "launch", dying)
    assert main(["soak", "--model", str(model_folder), "--kv-gib", "0.5", "--startup-timeout-s", "30"]) == 1
    doc = json.loads((cwd / "bench-results" / "G-2026-12-07-soak-smol.json").read_text())
    assert doc["server"]["status"] == "error" and "exited with status 1 during startup" in doc["server"]["error"]
    assert "the KV cache needs 9 bytes" in doc["server"]["error"] and doc["passed"] is False
    assert [c["name"] for c in doc["checks"]] == ["server"]
