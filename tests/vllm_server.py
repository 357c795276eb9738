"""A ``vllm serve`` process for the GPU tests, and a real HTTP client of its OpenAI completions API.

    with served(model_dir, "CUSTOM", env={...}, args=[...]) as server:
        outputs = complete(server.url, model_dir, prompts, concurrency=8)
    server.log()  # what it printed

The server runs in its own process group on a free local port, started, waited for and stopped
by ``python -m bench serve``'s own functions (``bench.serve``); its output goes to a log file
whose tail is shown when it fails to start."""

from __future__ import annotations

import contextlib
import json
import os
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from bench.serve import free_port, launch, stop_group, vllm_cli, wait_healthy


@dataclass
class Server:
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text()


@contextlib.contextmanager
def served(model_dir, backend: str, *, env: dict | None = None, args=(), log_dir=None, startup_s: float = 600):
    """``vllm serve model_dir --attention-backend backend *args`` on localhost; yields a ``Server``."""
    port = free_port()
    log_path = Path(log_dir or "/tmp") / f"vllm-serve-{backend}-{port}.log"
    cmd = vllm_cli() + ["serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--attention-backend",
                        backend, "--dtype", "bfloat16", "--seed", "0", *args]
    proc = launch(cmd, dict(os.environ, **(env or {})), log_path)
    server = Server(f"http://127.0.0.1:{port}", log_path)
    try:
        state, waited = wait_healthy(proc, server.url, timeout_s=startup_s)
        if state != "ok":
            raise RuntimeError(f"vllm serve {state} after {waited:.0f} s:\n{server.log()[-4000:]}")
        yield server
    finally:
        stop_group(proc, timeout_s=60)


def complete(url: str, model: str, prompts: list[str], *, max_tokens: int = 32, concurrency: int = 8) -> list[dict]:
    """Greedy completions of ``prompts`` over HTTP, ``concurrency`` requests in flight: each
    {"text", "tokens", "logprobs", "top"}: ``max_tokens`` chosen tokens (past an end of text too),
    their logprobs, and each step's two most likely tokens with their logprobs."""

    def one(prompt: str) -> dict:
        body = json.dumps({"model": str(model), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                           "logprobs": 2, "seed": 0, "ignore_eos": True}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            choice = json.loads(r.read())["choices"][0]
        lp = choice["logprobs"]
        return {"text": choice["text"], "tokens": lp["tokens"], "logprobs": lp["token_logprobs"],
                "top": lp["top_logprobs"]}

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, prompts))
