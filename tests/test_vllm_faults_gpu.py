"""Faults while ``vllm serve`` runs the DirectKV backend on a real model (SmolLM2-135M-Instruct,
``directkv_cute.hf.realmodel``), through its OpenAI API over HTTP.

**Faults** (``TestFaults``, one server for all of them): 96 blocks of 64 tokens of host KV
(6,144 tokens, 1.4 MiB a block) and an HBM tier of 32 block mirrors, so that mirrors are taken
back and given out while the cases run and blocks are read from both tiers; max_model_len 2048,
16 sequences, prompt chunks of 1024 tokens, prefix caching. Before any fault the server answers
a fixed probe set (six prompts of 13-1,278 tokens, 24 greedy tokens each, one request at a time,
each with a prefix cache of its own through ``cache_salt``, so that every run computes the same
steps) twice, with the same tokens, and the references of the cases below. The cases:

* streams the client closes mid-decode, one and then twelve at once: vLLM aborts them (none ends
  as ``length``, and the server generated a small part of the tokens they asked for);
* clients that vanish: eight streams reset (TCP RST) mid-decode, four clients that give up on a
  whole answer after half a second;
* preemption: eight requests of ~650 + 320 tokens at once need 128 blocks of the 95 vLLM hands
  out, so vLLM preempts and recomputes (``vllm:num_preemptions`` rises); every request still
  returns its 320 tokens, in agreement with the same requests run two at a time (the same tokens,
  or a first difference where the reference's top two are within ``TIE``);
* prefix-cache eviction while sharers decode: four requests share a ~710-token prefix (the later
  three hit its blocks); while they decode, distinct prompts cycle the free blocks, evicting a
  cached marker prompt; the sharers agree with their references (each run alone); then more
  distinct prompts evict the shared prefix itself, and a sharer sent again computes it afresh in
  reused blocks, with exactly its reference's tokens.

After each case the server is idle with ``vllm:kv_cache_usage_perc`` 0 (every block free: vLLM
counts a cached block nobody holds as free), the probe set's tokens equal those before any fault,
and the server's log since the case began holds no ``ERROR`` and no traceback. The HBM tier has
no free list to check: its pages are mirrors of blocks, each taken back from a block absent from
the step, so the tier cannot leak pages; the probes read from it after every case.

**Shutdown** (``TestShutdown``): a server holding most of the host's available memory as pinned
KV (60% of MemAvailable, at most 64 GiB, whole blocks; MemAvailable must drop by at least 80% of
that while it runs), with a stream in flight, gets SIGTERM at its API server alone (``kill
PID``); a second server of the same configuration then starts at once and becomes healthy (it
pins as much again, which the plugin refuses beyond MemAvailable: the first one's pinned memory
was freed), and gets SIGINT at its whole process group (what Ctrl-C in a terminal does). Each
stops within ``STOP_S`` with every process of its group gone, and MemAvailable comes back to
within ``RELEASE_SLACK`` (or 5% of the pinned KV, if larger) of what it was before it started.

**Host memory exhausted** (``TestHostMemoryExhausted``): ``--kv-cache-memory-bytes`` of MemTotal +
16 GiB makes the server exit with a non-zero status within ``REFUSE_S``, its log holding the
plugin's one-line refusal (``step.check_host_bytes``: the bytes asked, which must be the whole
``--kv-cache-memory-bytes``, the bytes available, the option to lower). The refusal is raised
where vLLM builds its config from the arguments (``memory.install_host_check``), in the process
that parses them: before any engine starts or loads the model. vLLM's command line prints the
exception as it prints its own configuration errors (with a traceback); its message is the one
line.

Time expected on one H100: about 90 s to start the fault server (torch.compile, CUDA graphs, the
kernel warm-up), 60 s of references and cases; two eager servers of 64 GiB of pinned KV, about
2 x 60 s; the refused start, about 40 s. Each engine runs in its own process.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from bench.serve import group_members, kv_log_lines, model_info, stop_group, wait_healthy
from bench.soak import completion_body, log_errors, parse_status, pinned_log_gib, send_completion
from vllm_server import complete, metric, metrics, served, smollm2_dir, start, stream, wait_idle, wait_until

pytestmark = pytest.mark.gpu

BLOCK = 64  # tokens per block: the backend's page size (its default)
KV_BLOCKS = 96  # the fault server's host KV, in blocks (vLLM keeps one as its null block)
TIER_BLOCKS = 32  # its HBM tier, in block mirrors
MAX_MODEL_LEN = 2048
FAULT_ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "16", "--max-num-batched-tokens", "1024",
              "--enable-prefix-caching", "--gpu-memory-utilization", "0.3"]
PROBE_TOKENS = 24
IDLE_S = 30.0  # the server must be idle this soon after a case
TIE = 0.25  # the reference's top two closer than this (natural log): either is a greedy pick
LONG = 1024  # tokens a cut request asks for: far more than it lives to see
PREEMPT_REQUESTS, PREEMPT_TOKENS = 8, 320
SHARERS, SHARER_TOKENS = 4, 600
FLOOD_PROMPTS, FLOOD_TOKENS = 16, 640  # distinct prompts of 10 blocks each
STOP_S = 60.0  # a signalled server's whole group must be gone this soon
START_AFTER_S = 15.0  # the second server starts once MemAvailable is back, which must take no longer
RELEASE_SLACK = 2 << 30  # MemAvailable back within this much (or 5% of the pinned KV) after a stop
BIG_KV_FRACTION, BIG_KV_CAP = 0.6, 64 << 30
REFUSE_S = 180.0
REFUSAL = re.compile(r"the KV cache needs (\d+) bytes \([\d.e+-]+ GiB\) of pinned host memory, the host has (\d+) "
                     r"bytes \([\d.e+-]+ GiB\) available; lower --kv-cache-memory-bytes")  # step._refuse_beyond

PARA_A = ("The river town of Alder Ford grew up around a mill that ground wheat for three valleys. Each spring the "
          "snow melted in the hills, the water rose, and the miller opened the sluice so that the wheel turned "
          "faster. Children counted the boats that passed under the stone bridge, and the teacher at the small "
          "school used the river to explain how water moves faster in a narrow channel than in a wide one. ")
PARA_B = ("On the cliff above the harbour stood a lighthouse kept by a woman named Mara. Every evening she climbed "
          "the spiral stairs, trimmed the wick and polished the great lens until it shone. Fishing boats steered by "
          "its beam through the rocks at the harbour mouth, and in winter storms she kept the light burning all "
          "night while the wind shook the windows of the lamp room. ")
QUESTIONS = ("What did the mill in the town grind?", "Why did the water rise each spring?",
             "Who kept the light burning?", "Write one sentence about the stone bridge.",
             "What did Mara polish every evening?", "Name two things the children counted.",
             "Why did the boats need the lighthouse?", "What happened in winter storms?")


def _ask(context: str, question: str) -> str:
    return f"{context}\nQuestion: {question}\nAnswer:"


PROBES = [_ask("", "What is the capital of France?"), _ask(PARA_A, QUESTIONS[0]), _ask(PARA_B * 3, QUESTIONS[2]),
          _ask(PARA_A * 6, QUESTIONS[1]), _ask(PARA_B * 10, QUESTIONS[6]), _ask((PARA_A + PARA_B) * 8, QUESTIONS[5])]
PREEMPT_PROMPTS = [_ask(PARA_A * 4 + PARA_B * 4, q) for q in QUESTIONS[:PREEMPT_REQUESTS]]  # ~650 tokens each
SHARED_PREFIX = PARA_B * 5 + PARA_A * 4  # ~710 tokens in common: 11 whole blocks shared
SHARER_PROMPTS = [_ask(SHARED_PREFIX, q) for q in QUESTIONS[:SHARERS]]
SHARED_BLOCKS_MIN = 10


def _salt(what: str) -> str:
    return f"{what}-{uuid.uuid4().hex}"


def _ids(seed: int, n: int, vocab: int) -> list[int]:
    """A prompt of ``n`` token ids from 1000 up (clear of the special tokens), distinct per seed."""
    rng = random.Random(seed)
    return [rng.randrange(1000, vocab) for _ in range(n)]


def _block_bytes(model_dir) -> int:
    return BLOCK * model_info(json.loads((model_dir / "config.json").read_text()))["kv_token_bytes"]


def _vocab(model_dir) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def _meminfo() -> dict[str, int]:
    with open("/proc/meminfo") as f:
        return parse_status(f.read())


def _count(samples, name: str, **labels) -> float:
    return metric(samples, name, **labels) or 0.0


def _tokens(result: dict) -> list:
    """The chosen tokens of a ``complete`` item or a ``stream`` result: ids where the server sent
    them, else their strings."""
    return result.get("token_ids") or _logprobs(result)[0]


def _logprobs(result: dict) -> tuple[list, list, list]:
    """(token strings, their logprobs, each step's top two) of a ``complete`` item or a ``stream`` result."""
    if "top" in result:
        return result["tokens"], result["logprobs"], result["top"]
    lp = result.get("logprobs") or {}
    return lp.get("tokens", []), lp.get("token_logprobs", []), lp.get("top_logprobs", [])


def _agree(ours: dict, ref: dict) -> str | None:
    """None when ``ours`` has the reference's tokens or first leaves them at a near-tie of the
    reference (its top two within TIE: either is a greedy pick in bf16); else why not."""
    a_tok, _, _ = _logprobs(ours)
    b_tok, b_lp, b_top = _logprobs(ref)
    if len(a_tok) != len(b_tok):
        return f"{len(a_tok)} tokens against the reference's {len(b_tok)}"
    for step, (ta, tb) in enumerate(zip(a_tok, b_tok)):
        if ta != tb:
            margin = b_lp[step] - (b_top[step] or {}).get(ta, float("-inf"))
            return None if margin < TIE else (f"token {step}: {ta!r} where the reference chose {tb!r} by a margin of "
                                              f"{margin:.3f}")
    return None


def _probe(server, model_dir) -> list[dict]:
    """The probe set, one request at a time, each with a prefix cache of its own (no prefix-cache
    hit, on another probe or on an earlier run: every run computes the same steps)."""
    return _each(server, model_dir, PROBES, max_tokens=PROBE_TOKENS, concurrency=1, what="probe")


def _each(server, model_dir, prompts, *, max_tokens: int, concurrency: int, what: str) -> list[dict]:
    """Greedy completions with logprobs, each with a prefix cache of its own, ``concurrency`` at a time."""
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda p: complete(server.url, model_dir, [p], max_tokens=max_tokens, concurrency=1,
                                                extra={"cache_salt": _salt(what)})[0], prompts))


def _recovered(server, model_dir, before: dict, offset: int) -> None:
    """The server is idle with every block free, answers the probe set as before any fault, is
    idle again after it, and logged no error since ``offset``."""
    idle, m, waited = wait_idle(server.url, IDLE_S)
    assert idle, f"not idle {waited:.0f} s after the case: {m}"
    after = _probe(server, model_dir)
    differ = [(i, _tokens(b), _tokens(a)) for i, (a, b) in enumerate(zip(after, before["probes"]))
              if _tokens(a) != _tokens(b)]
    assert not differ, "probes answered differently than before any fault (index, before, after): " + "; ".join(
        f"{i}: {b} -> {a}" for i, b, a in differ)
    idle, m, _ = wait_idle(server.url, IDLE_S)
    assert idle, f"not idle after the probes: {m}"
    errors = log_errors(server.log()[offset:])
    assert errors["count"] == 0, "the server logged errors:\n" + "\n".join(errors["first"])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return smollm2_dir(tmp_path_factory)


class TestFaults:
    @pytest.fixture(scope="class")
    def server(self, model_dir, tmp_path_factory):
        from directkv_cute.env import VLLM_HBM_GB

        block = _block_bytes(model_dir)
        args = [*FAULT_ARGS, "--kv-cache-memory-bytes", str(KV_BLOCKS * block)]
        env = {VLLM_HBM_GB: repr(TIER_BLOCKS * block / 2**30)}
        with served(model_dir, "CUSTOM", env=env, args=args, log_dir=tmp_path_factory.mktemp("faults")) as server:
            print(f"fault server healthy after {server.startup_s:.0f} s; {kv_log_lines(server.log())['lines']}")
            yield server

    @pytest.fixture(scope="class")
    def before(self, server, model_dir):
        """What the server answers before any fault: the probes (twice: the same tokens, or the
        comparisons below mean nothing), the preemption and sharer references."""
        probes = _probe(server, model_dir)
        again = _probe(server, model_dir)
        assert [_tokens(a) for a in again] == [_tokens(p) for p in probes], "the probe set is not reproducible"
        assert all(len(_tokens(p)) == PROBE_TOKENS for p in probes)
        preempt = _each(server, model_dir, PREEMPT_PROMPTS, max_tokens=PREEMPT_TOKENS, concurrency=2, what="ref")
        sharers = _each(server, model_dir, SHARER_PROMPTS, max_tokens=SHARER_TOKENS, concurrency=1, what="ref")
        idle, m, _ = wait_idle(server.url, IDLE_S)
        assert idle, f"not idle before any fault: {m}"
        return {"probes": probes, "preempt": preempt, "sharers": sharers}

    def test_streams_closed_mid_decode_are_aborted(self, server, model_dir, before):
        offset, m0 = server.log_size(), metrics(server.url)
        one = stream(server.url, model_dir, _ask(PARA_A * 2, QUESTIONS[3]), max_tokens=LONG, cut_after=8,
                     cache_salt=_salt("cut"))
        assert one["status"] == "cut" and one["tokens"] >= 8, one
        # twelve at once: each waits for its own count of tokens, then all connections close together
        barrier = threading.Barrier(12)
        cuts = list(range(1, 25, 2))

        def cut(k: int) -> dict:
            return stream(server.url, model_dir, _ask(PARA_B * (1 + k % 3), QUESTIONS[k % 8]), max_tokens=LONG,
                          cut_after=k, on_cut=lambda: barrier.wait(timeout=120), cache_salt=_salt("cut"))

        with ThreadPoolExecutor(len(cuts)) as pool:
            many = list(pool.map(cut, cuts))
        assert all(r["status"] == "cut" and r["tokens"] >= k for r, k in zip(many, cuts)), many
        idle, m, waited = wait_idle(server.url, IDLE_S)
        assert idle, f"not idle {waited:.0f} s after the streams closed: {m}"
        m1 = metrics(server.url)
        finished = _count(m1, "vllm:request_success", finished_reason="length") - _count(
            m0, "vllm:request_success", finished_reason="length")
        generated = _count(m1, "vllm:generation_tokens") - _count(m0, "vllm:generation_tokens")
        assert finished == 0, f"{finished:.0f} of the closed streams ran to their end"
        assert generated < 13 * LONG / 4, f"{generated:.0f} tokens generated for streams cut within 24 tokens"
        _recovered(server, model_dir, before, offset)

    def test_clients_that_vanish_mid_stream_are_aborted(self, server, model_dir, before):
        offset, m0 = server.log_size(), metrics(server.url)
        resets = [(k, _ask(PARA_A * (1 + k % 4), QUESTIONS[k % 8])) for k in range(2, 26, 3)]  # eight streams
        whole = [_ask(PARA_B, q) for q in QUESTIONS[:4]]  # four whole answers nobody waits for

        def reset(item) -> dict:
            k, prompt = item
            return stream(server.url, model_dir, prompt, max_tokens=LONG, cut_after=k, reset=True,
                          cache_salt=_salt("reset"))

        def give_up(prompt: str) -> dict:
            return stream(server.url, model_dir, prompt, max_tokens=MAX_MODEL_LEN - 256, give_up_s=0.5,
                          stream=False, cache_salt=_salt("give-up"))

        with ThreadPoolExecutor(12) as pool:
            r_futures = [pool.submit(reset, item) for item in resets]
            g_futures = [pool.submit(give_up, p) for p in whole]
            got_resets, got_whole = [f.result() for f in r_futures], [f.result() for f in g_futures]
        assert all(r["status"] == "cut" and r["tokens"] >= k for r, (k, _) in zip(got_resets, resets)), got_resets
        assert all(r["status"] == "cut" for r in got_whole), got_whole  # nothing came back within half a second
        idle, m, waited = wait_idle(server.url, IDLE_S)
        assert idle, f"not idle {waited:.0f} s after the clients left: {m}"
        m1 = metrics(server.url)
        finished = _count(m1, "vllm:request_success", finished_reason="length") - _count(
            m0, "vllm:request_success", finished_reason="length")
        assert finished == 0, f"{finished:.0f} requests of clients that left ran to their end"
        _recovered(server, model_dir, before, offset)

    def test_preemption_under_memory_pressure(self, server, model_dir, before):
        offset, m0 = server.log_size(), metrics(server.url)
        ours = _each(server, model_dir, PREEMPT_PROMPTS, max_tokens=PREEMPT_TOKENS, concurrency=PREEMPT_REQUESTS,
                     what="preempt")
        m1 = metrics(server.url)
        preempted = _count(m1, "vllm:num_preemptions") - _count(m0, "vllm:num_preemptions")
        assert preempted >= 1, "no preemption: the case did not put the KV cache under pressure"
        assert all(len(_tokens(o)) == PREEMPT_TOKENS for o in ours)
        disagree = [(i, why) for i, (o, r) in enumerate(zip(ours, before["preempt"])) if (why := _agree(o, r))]
        assert not disagree, f"after {preempted:.0f} preemptions, requests differ from their references: {disagree}"
        print(f"{preempted:.0f} preemptions; {sum(_tokens(o) == _tokens(r) for o, r in zip(ours, before['preempt']))}"
              f" of {PREEMPT_REQUESTS} outputs identical to the reference")
        _recovered(server, model_dir, before, offset)

    def test_prefix_cache_eviction_while_sharers_decode(self, server, model_dir, before):
        offset = server.log_size()
        vocab = _vocab(model_dir)
        hits = lambda: _count(metrics(server.url), "vllm:prefix_cache_hits")  # noqa: E731

        def one(prompt, max_tokens: int = 1, **extra) -> dict:
            return send_completion(server.url, completion_body(model_dir, prompt, max_tokens, **extra))

        # a marker prompt, cached: a second request hits its blocks
        marker, marker_salt = _ids(1, FLOOD_TOKENS + 10, vocab), _salt("marker")
        assert one(marker, cache_salt=marker_salt)["status"] == "ok"
        h0 = hits()
        assert one(marker, cache_salt=marker_salt)["status"] == "ok"
        assert hits() - h0 >= (FLOOD_TOKENS // BLOCK - 1) * BLOCK, "the marker was not cached"

        # four sharers of one prefix: the first computes it, the other three hit its blocks
        shared_salt = _salt("sharers")
        started = [threading.Event() for _ in range(SHARERS)]
        pool = ThreadPoolExecutor(SHARERS)

        def sharer(i: int):
            return pool.submit(stream, server.url, model_dir, SHARER_PROMPTS[i], max_tokens=SHARER_TOKENS, logprobs=2,
                               cache_salt=shared_salt, progress=lambda n, e=started[i]: n and e.set())

        h1 = hits()
        futures = [sharer(0)]
        assert started[0].wait(60), "the first sharer produced no token"
        futures += [sharer(i) for i in range(1, SHARERS)]
        assert all(e.wait(60) for e in started), "a sharer produced no token"
        shared_hits = hits() - h1
        assert shared_hits >= (SHARERS - 1) * SHARED_BLOCKS_MIN * BLOCK, f"the sharers hit {shared_hits:.0f} tokens"

        # while they decode, distinct prompts cycle the free blocks (two at a time, so that the
        # sharers keep their blocks), and the marker is evicted
        with ThreadPoolExecutor(2) as flood:
            flooded = list(flood.map(lambda s: one(_ids(100 + s, FLOOD_TOKENS, vocab), 4, cache_salt=_salt("flood")),
                                     range(FLOOD_PROMPTS)))
        decoding = sum(not f.done() for f in futures)
        assert all(f["status"] == "ok" for f in flooded), [f["error"] for f in flooded if f["status"] != "ok"]
        h2 = hits()
        assert one(marker, cache_salt=marker_salt)["status"] == "ok"
        assert hits() - h2 == 0, "the marker's blocks survived the flood: nothing was evicted"
        assert decoding == SHARERS, (f"only {decoding} of {SHARERS} sharers were still decoding when the flood ended: "
                                     "raise SHARER_TOKENS")
        results = [f.result() for f in futures]
        pool.shutdown()
        assert all(r["status"] == "ok" and r["tokens"] == SHARER_TOKENS for r in results), results
        disagree = [(i, why) for i, (r, ref) in enumerate(zip(results, before["sharers"])) if (why := _agree(r, ref))]
        assert not disagree, f"sharers differ from their references: {disagree}"

        # the shared prefix itself evicted, then computed afresh in reused blocks
        with ThreadPoolExecutor(4) as flood:
            assert all(r["status"] == "ok" for r in flood.map(
                lambda s: one(_ids(200 + s, FLOOD_TOKENS, vocab), 4, cache_salt=_salt("flood")), range(FLOOD_PROMPTS)))
        h3 = hits()
        again = stream(server.url, model_dir, SHARER_PROMPTS[0], max_tokens=64, cache_salt=shared_salt)
        assert hits() - h3 == 0, "the shared prefix survived the second flood"
        assert again["status"] == "ok" and _tokens(again) == _tokens(before["sharers"][0])[:64], (
            f"the prefix computed again in reused blocks gives other tokens: {_tokens(again)} vs "
            f"{_tokens(before['sharers'][0])[:64]}")
        _recovered(server, model_dir, before, offset)


def _mem_available() -> int:
    return _meminfo()["MemAvailable"]


def _serve_then_signal(model_dir, args, log_dir, sig: signal.Signals, *, group: bool) -> dict:
    """Serve, start a stream, signal the API server (``group``: its whole process group), and
    measure: how long until every process of the group is gone, the pinned KV the plugin
    reported, MemAvailable before, while serving, and once the memory came back."""
    avail0 = _mem_available()
    out = {"signal": sig.name, "avail_before": avail0}
    with served(model_dir, "CUSTOM", args=args, log_dir=log_dir) as server:
        proc = server.proc
        out["startup_s"], out["pinned_gib"] = server.startup_s, pinned_log_gib(server.log())
        out["avail_serving"] = _mem_available()
        with ThreadPoolExecutor(1) as pool:
            flowing = threading.Event()
            pending = pool.submit(stream, server.url, model_dir, _ask(PARA_A, QUESTIONS[0]),
                                  max_tokens=MAX_MODEL_LEN - 256, progress=lambda n: n and flowing.set())
            assert flowing.wait(60), "the stream before the signal produced no token"
            t0 = time.monotonic()
            if group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
            out["gone"] = wait_until(lambda: proc.poll() is not None and not group_members(proc.pid), STOP_S, 0.1)
            out["stop_s"] = time.monotonic() - t0
            out["returncode"] = proc.poll()
            out["stream"] = pending.result(timeout=60)["status"]
    return out


class TestShutdown:
    def test_sigterm_and_ctrl_c_stop_the_server_and_free_its_pinned_memory(self, model_dir, tmp_path):
        block = _block_bytes(model_dir)
        avail = _mem_available()
        size = min(int(BIG_KV_FRACTION * avail), BIG_KV_CAP) // block * block
        if size < (4 << 30):
            pytest.skip(f"{avail / 2**30:.1f} GiB of host memory available: too little for a large pinned KV")
        slack = max(RELEASE_SLACK, size // 20)
        args = ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "4", "--max-num-batched-tokens", "1024",
                "--enforce-eager", "--gpu-memory-utilization", "0.3", "--kv-cache-memory-bytes", str(size)]
        print(f"pinned KV {size / 2**30:.1f} GiB of {avail / 2**30:.1f} GiB available: "
              + ("two do not fit" if 2 * size > avail else "two would fit (capped): MemAvailable tells the release"))
        runs = []
        # SIGTERM to the API server alone, then at once a second server of the same configuration
        # (``served`` fails unless it becomes healthy, which it cannot if the first one's pinned
        # KV is still held: the plugin refuses a size beyond MemAvailable), then Ctrl-C to it
        for sig, group, release_s in ((signal.SIGTERM, False, START_AFTER_S), (signal.SIGINT, True, 60.0)):
            log_dir = tmp_path / sig.name
            log_dir.mkdir()
            run = _serve_then_signal(model_dir, args, log_dir, sig, group=group)
            t0 = time.monotonic()
            run["released"] = wait_until(lambda: _mem_available() >= run["avail_before"] - slack, release_s, 0.2)
            run["release_s"], run["avail_after"] = time.monotonic() - t0, _mem_available()
            print({k: v for k, v in run.items()})
            runs.append(run)
            assert run["avail_before"] - run["avail_serving"] >= 0.8 * size, f"the KV was not pinned: {run}"
            assert run["gone"] and run["stop_s"] <= STOP_S, f"{sig.name} did not stop the server's group: {run}"
            assert run["released"], f"MemAvailable did not come back after {sig.name}: {run}"
        assert runs[1]["startup_s"] is not None  # the second server was healthy


class TestHostMemoryExhausted:
    @pytest.fixture(scope="class")
    def refused(self, model_dir, tmp_path_factory):
        """A server asked for more KV than the host has: what it did within REFUSE_S."""
        block = _block_bytes(model_dir)
        size = -(-(_meminfo()["MemTotal"] + (16 << 30)) // block) * block
        args = ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "4", "--enforce-eager",
                "--gpu-memory-utilization", "0.3", "--kv-cache-memory-bytes", str(size)]
        server = start(model_dir, "CUSTOM", args=args, log_dir=tmp_path_factory.mktemp("refused"))
        try:
            state, waited = wait_healthy(server.proc, server.url, timeout_s=REFUSE_S)
        finally:
            stop = stop_group(server.proc, timeout_s=30)
        return {"state": state, "waited": waited, "returncode": server.proc.returncode, "size": size,
                "log": server.log(), "stop": stop}

    def test_a_kv_size_beyond_host_memory_is_refused_in_one_line(self, refused):
        log = refused["log"]
        assert refused["state"] == "died" and refused["returncode"] not in (0, None), (
            f"the server {refused['state']} after {refused['waited']:.0f} s:\n{log[-3000:]}")
        found = REFUSAL.findall(log)
        assert found, f"no refusal in the log:\n{log[-3000:]}"
        assert int(found[0][0]) == refused["size"]  # the KV tensors hold exactly --kv-cache-memory-bytes
        print(f"refused after {refused['waited']:.0f} s: {REFUSAL.search(log).group(0)}")

    def test_the_refusal_comes_before_any_engine_starts(self, refused):
        log = refused["log"]
        refusal = REFUSAL.search(log)
        assert refusal, "no refusal in the log"
        for started in ("Model loading took", "EngineCore", "Loading weights"):
            at = log.find(started)
            assert at < 0 or at > refusal.start(), f"{started!r} before the refusal:\n{log[-3000:]}"
        line = log[log.rfind("\n", 0, refusal.start()) + 1:].split("\n", 1)[0]
        assert line.startswith("MemoryError: "), f"the refusal is not the exception's one line: {line!r}"
