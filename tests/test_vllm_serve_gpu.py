"""``vllm serve`` of a real trained model (SmolLM2-135M-Instruct, ``directkv_cute.hf.realmodel``)
with the DirectKV backend against vLLM's own FLASH_ATTN, through the OpenAI completions API over
HTTP: the same 32 prompts (English text of ragged lengths up to ~2.5k tokens, half of them sharing
a long preamble so that prefix caching hands out shared blocks), 8 requests in flight, greedy.
Each DirectKV server (host only; an HBM tier that mirrors every block, so decode runs in full CUDA
graphs; a small tier whose mirrors come and go) must agree with the reference on at least 30 of
32 completions, and give the tokens both chose logprobs within bf16 tolerance. A completion
agrees when its text is the reference's, or when it first leaves the reference's tokens at a
near-tie of the reference (its top two within ``TIE``: there either token is a correct greedy
choice, and bf16 attention over 30 layers may take the other), as ``vllm_engine.compare_generations``
rules for the tiny model."""

from __future__ import annotations

import statistics

import numpy as np
import pytest

from vllm_server import complete, served, smollm2_dir

pytestmark = pytest.mark.gpu

NUM_PROMPTS = 32
AGREE = 30  # of 32 completions: the reference's text, or a first divergence at a near-tie
TIE = 0.25  # the reference's top two closer than this (natural log): either is a greedy pick
LOGPROB_MAX = 0.25  # |logprob difference| of a token both chose, before any divergence
LOGPROB_MEDIAN = 0.03
COMMON = ["--max-model-len", "4096", "--max-num-seqs", "16", "--max-num-batched-tokens", "1024",
          "--enable-prefix-caching"]
OURS = [*COMMON, "--kv-cache-memory-bytes", "1G"]

PREAMBLE = (
    "The river town of Alder Ford grew up around a mill that ground wheat for three valleys. Each spring the "
    "snow melted in the hills, the water rose, and the miller opened the sluice so that the wheel turned "
    "faster. Children counted the boats that passed under the stone bridge, and the teacher at the small "
    "school used the river to explain how water moves faster in a narrow channel than in a wide one. ")
QUESTIONS = (
    "What did the mill in the town grind?", "Why did the water rise each spring?",
    "Who explained how the river moved?", "Write one sentence about the stone bridge.",
    "What is the capital of France?", "Name three colors of the rainbow.", "What is two plus three?",
    "Give a short greeting to a new student.", "Why do rivers flow downhill?", "What is a mill used for?",
    "Write a haiku about snow.", "List two animals that live near rivers.", "What season comes after winter?",
    "Explain what a bridge is in one sentence.", "What do children learn at school?", "How many days are in a week?",
)


def _prompts() -> list[str]:
    """Half: a long shared preamble (the town's story, ~1.4k tokens) then a question; half: the
    story's first sentences, as many as a ragged length asks, then a question."""
    rng = np.random.default_rng(0)
    sentences = PREAMBLE.split(". ")
    out = []
    for i in range(NUM_PROMPTS):
        question = QUESTIONS[i % len(QUESTIONS)]
        if i % 2 == 0:
            context = PREAMBLE * 16
        else:
            context = ". ".join(sentences[: int(rng.integers(1, len(sentences)))] * int(rng.integers(1, 12))) + ". "
        out.append(f"{context}\nQuestion: {question}\nAnswer:")
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return smollm2_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    with served(model_dir, "FLASH_ATTN", args=[*COMMON, "--gpu-memory-utilization", "0.3"],
                log_dir=tmp_path_factory.mktemp("logs")) as server:
        return complete(server.url, model_dir, _prompts())


def _agree(ours: list[dict], ref: list[dict]) -> None:
    """At least ``AGREE`` completions agree (the same text, or a first divergence at a near-tie
    of the reference), and the logprobs of the tokens both chose are within tolerance."""
    same = agree = 0
    diffs, ties = [], []
    for a, b in zip(ours, ref):
        if a["text"] == b["text"]:
            same += 1
        ok = True
        for step, (ta, tb, la, lb) in enumerate(zip(a["tokens"], b["tokens"], a["logprobs"], b["logprobs"])):
            if ta != tb:
                top = b["top"][step] or {}
                margin = lb - top.get(ta, float("-inf"))
                ties.append(round(margin, 3))
                ok = margin < TIE
                break
            diffs.append(abs(la - lb))
        agree += ok
    print(f"same text {same}/{len(ref)}, agreeing {agree}/{len(ref)} (reference margins where they part: {ties}); "
          f"logprob diffs over {len(diffs)} tokens: max {max(diffs):.4f}, median {statistics.median(diffs):.5f}")
    assert agree >= AGREE, f"only {agree} of {len(ref)} completions agree with the reference's"
    assert max(diffs) <= LOGPROB_MAX and statistics.median(diffs) <= LOGPROB_MEDIAN
    assert len(diffs) >= NUM_PROMPTS * 8  # most tokens compared


def test_host_only_matches_flash_attn(model_dir, reference, tmp_path):
    with served(model_dir, "CUSTOM", args=OURS, log_dir=tmp_path) as server:
        ours = complete(server.url, model_dir, _prompts())
    _agree(ours, reference)


def test_a_tier_of_every_block_decodes_in_full_cuda_graphs_and_matches(model_dir, reference, tmp_path):
    from directkv_cute.env import VLLM_HBM_GB

    with served(model_dir, "CUSTOM", args=OURS, env={VLLM_HBM_GB: "1"}, log_dir=tmp_path) as server:
        ours = complete(server.url, model_dir, _prompts())
    log = server.log()
    assert "Capturing CUDA graphs (FULL)" in log, log[-3000:]  # vLLM captured whole decode steps
    _agree(ours, reference)


def test_a_small_tier_matches(model_dir, reference, tmp_path):
    """A tier of 64 blocks (64 tokens each, 30 layers x 3 KV heads x 64 x 2 x 2 bytes = 1.4 MiB a
    block): mirrors are taken back and given out while the 32 requests run."""
    from directkv_cute.env import VLLM_HBM_GB

    with served(model_dir, "CUSTOM", args=OURS, env={VLLM_HBM_GB: repr(64 * 1474560 / 2**30)},
                log_dir=tmp_path) as server:
        ours = complete(server.url, model_dir, _prompts())
    _agree(ours, reference)
