"""A ``vllm serve`` process for the GPU tests, and a real HTTP client of its OpenAI completions API.

    with served(model_dir, "CUSTOM", env={...}, args=[...]) as server:
        outputs = complete(server.url, model_dir, prompts, concurrency=8)
    server.log()  # what it printed

The server runs in its own process group (stopped with SIGTERM, then SIGKILL), on a free local
port; its output goes to a log file whose tail is shown when it fails to start."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Server:
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status


@contextlib.contextmanager
def served(model_dir, backend: str, *, env: dict | None = None, args=(), log_dir=None, startup_s: float = 600):
    """``vllm serve model_dir --attention-backend backend *args`` on localhost; yields a ``Server``."""
    port = free_port()
    log_path = Path(log_dir or "/tmp") / f"vllm-serve-{backend}-{port}.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir), "--host", "127.0.0.1",
           "--port", str(port), "--attention-backend", backend, "--dtype", "bfloat16", "--seed", "0", *args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, **(env or {})),
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if _get(url + "/health") == 200:
                    break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve not healthy after {startup_s} s:\n{log_path.read_text()[-4000:]}")
            time.sleep(1.0)
        yield Server(url, log_path)
    finally:
        stop(proc)


def stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM to the server's process group, SIGKILL after ``timeout`` seconds."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def complete(url: str, model: str, prompts: list[str], *, max_tokens: int = 32, concurrency: int = 8) -> list[dict]:
    """Greedy completions of ``prompts`` over HTTP, ``concurrency`` requests in flight: each
    {"text", "tokens", "logprobs"} (the chosen tokens and their logprobs)."""

    def one(prompt: str) -> dict:
        body = json.dumps({"model": str(model), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                           "logprobs": 1, "seed": 0}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            choice = json.loads(r.read())["choices"][0]
        lp = choice["logprobs"]
        return {"text": choice["text"], "tokens": lp["tokens"], "logprobs": lp["token_logprobs"]}

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, prompts))
