"""A ``vllm serve`` process for the GPU tests, and a real HTTP client of its OpenAI completions API.

    with served(model_dir, "CUSTOM", env={...}, args=[...]) as server:
        outputs = complete(server.url, model_dir, prompts, concurrency=8)
        cut = stream(server.url, model_dir, prompt, max_tokens=512, cut_after=8)  # closes mid-decode
        idle, m, _ = wait_idle(server.url, timeout_s=30)   # m["kv_cache_usage"] == 0 when idle
    server.log()  # what it printed

The server runs in its own process group on a free local port, started, waited for and stopped
by ``python -m bench serve``'s own functions (``bench.serve``); its output goes to a log file
whose tail is shown when it fails to start. ``server.proc`` is the group's leader (the API
server), for tests that signal it themselves. The streaming client, the /metrics reader and the
idle wait are ``python -m bench soak``'s (``bench.soak``)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from bench.serve import free_port, launch, stop_group, vllm_cli, wait_healthy
from bench.soak import completion_body, metric, parse_samples, read_metrics, send_completion, wait_idle

__all__ = ["Server", "served", "start", "complete", "stream", "metrics", "metric", "read_metrics", "wait_idle",
           "wait_until", "smollm2_dir"]


@dataclass
class Server:
    url: str
    log_path: Path
    proc: subprocess.Popen | None = None
    startup_s: float | None = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_size(self) -> int:
        """The log's length now: ``log()[offset:]`` is what the server printed since."""
        return len(self.log())


def start(model_dir, backend: str, *, env: dict | None = None, args=(), log_dir=None) -> Server:
    """Launch ``vllm serve model_dir --attention-backend backend *args`` on localhost without
    waiting for it; the caller stops ``server.proc`` (``bench.serve.stop_group``)."""
    port = free_port()
    log_path = Path(log_dir or "/tmp") / f"vllm-serve-{backend}-{port}.log"
    cmd = vllm_cli() + ["serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--attention-backend",
                        backend, "--dtype", "bfloat16", "--seed", "0", *args]
    proc = launch(cmd, dict(os.environ, **(env or {})), log_path)
    return Server(f"http://127.0.0.1:{port}", log_path, proc)


@contextlib.contextmanager
def served(model_dir, backend: str, *, env: dict | None = None, args=(), log_dir=None, startup_s: float = 600):
    """``vllm serve model_dir --attention-backend backend *args`` on localhost; yields a ``Server``
    once it answers /health, and stops its whole process group on the way out (nothing to do
    when a test stopped it already)."""
    server = start(model_dir, backend, env=env, args=args, log_dir=log_dir)
    try:
        state, waited = wait_healthy(server.proc, server.url, timeout_s=startup_s)
        if state != "ok":
            raise RuntimeError(f"vllm serve {state} after {waited:.0f} s:\n{server.log()[-4000:]}")
        server.startup_s = waited
        yield server
    finally:
        stop_group(server.proc, timeout_s=60)


def complete(url: str, model: str, prompts: list[str], *, max_tokens: int = 32, concurrency: int = 8,
             extra: dict | None = None) -> list[dict]:
    """Greedy completions of ``prompts`` over HTTP, ``concurrency`` requests in flight: each
    {"text", "tokens", "logprobs", "top", "token_ids"}: ``max_tokens`` chosen tokens (past an end
    of text too), their logprobs, each step's two most likely tokens with their logprobs, and
    their ids. ``extra`` adds request fields (``cache_salt``: a prefix cache of its own)."""

    def one(prompt: str) -> dict:
        body = json.dumps({"model": str(model), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                           "logprobs": 2, "seed": 0, "ignore_eos": True, "return_token_ids": True,
                           **(extra or {})}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            choice = json.loads(r.read())["choices"][0]
        lp = choice["logprobs"]
        return {"text": choice["text"], "tokens": lp["tokens"], "logprobs": lp["token_logprobs"],
                "top": lp["top_logprobs"], "token_ids": choice.get("token_ids")}

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, prompts))


def stream(url: str, model: str, prompt, *, max_tokens: int, cut_after: int | None = None, reset: bool = False,
           give_up_s: float | None = None, timeout_s: float = 600.0, progress=None, on_cut=None, **extra) -> dict:
    """One greedy completion of exactly ``max_tokens`` tokens streamed over its own connection,
    which the client closes once ``cut_after`` tokens are in (``reset``: a TCP reset; ``on_cut()``
    runs just before), or when nothing arrives for ``give_up_s``; ``progress(tokens so far)`` runs
    as tokens arrive; ``extra`` adds request fields (``cache_salt``, ``logprobs``; ``stream=False``
    asks for a whole answer). ``bench.soak.send_completion``'s result: status "ok", "cut" or
    "error", the text, token ids, finish reason, logprobs."""
    body = completion_body(model, prompt, max_tokens, stream=extra.pop("stream", True), **extra)
    return send_completion(url, body, cut_after=cut_after, give_up_s=give_up_s, reset=reset, timeout_s=timeout_s,
                           progress=progress, on_cut=on_cut)


def metrics(url: str) -> list[tuple[str, dict, float]]:
    """Every sample of the server's /metrics: [(name, labels, value)] (``metric`` sums them)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return parse_samples(r.read().decode("utf-8", "replace"))


def wait_until(predicate, timeout_s: float, poll_s: float = 0.05) -> bool:
    """Poll ``predicate()`` until it is true or ``timeout_s`` passes; its last value."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            return bool(predicate())
        time.sleep(poll_s)
    return True


def smollm2_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct as a local folder for ``vllm serve`` (``directkv_cute.hf.realmodel``),
    or a skip: no torch, no vLLM, no CUDA GPU, or no model here."""
    import pytest

    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from directkv_cute.hf.realmodel import smollm2_folder

    try:
        return smollm2_folder(tmp_path_factory.mktemp("models"))
    except (FileNotFoundError, ValueError) as e:
        pytest.skip(f"no SmolLM2 model here: {e}")
