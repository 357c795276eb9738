"""The README: every ```python block runs as written (each in a fresh namespace, on a CPU the
float32 reference path) and computes what it says, checked against an independent reference;
the README stays a reference page (<= 250 lines, one numbers table whose files exist)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _text() -> str:
    return README.read_text()


def _python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", _text(), re.S | re.M)


def _run(index: int) -> dict:
    """Execute the README's ``index``-th python block exactly as written, in a fresh namespace."""
    scope: dict = {"__name__": "__readme__"}
    exec(compile(_python_blocks()[index], f"README.md python block {index}", "exec"), scope)
    return scope


def _attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float64 attention of q (n, Hq, d) over k/v (L, Hkv, d); the n queries are the last n of
    the L positions, causal among themselves; GQA groups of Hq / Hkv consecutive query heads."""
    n, hq, d = q.shape
    length, hkv, _ = k.shape
    group = hq // hkv
    qf, kf, vf = (t.double().cpu() for t in (q, k, v))
    kf, vf = kf.repeat_interleave(group, dim=1), vf.repeat_interleave(group, dim=1)  # (L, Hq, d)
    scores = torch.einsum("qhd,khd->hqk", qf, kf) / math.sqrt(d)
    pos = torch.arange(length - n, length).unsqueeze(1)  # (n, 1): each query's position
    scores = scores.masked_fill(torch.arange(length).unsqueeze(0) > pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vf)


def test_every_python_block_has_a_check():
    # One test below per block, in order: a new block needs its own check.
    assert len(_python_blocks()) == 4


def test_transformers_block_generates_as_sdpa_does():
    scope = _run(0)
    out, cache, model, prompt = scope["out"], scope["cache"], scope["model"], scope["prompt"]
    batch, prompt_len, new_tokens = scope["batch"], scope["prompt_len"], scope["new_tokens"]
    assert out.shape == (batch, prompt_len + new_tokens)
    assert torch.equal(out[:, :prompt_len], prompt)
    # The cache holds every token but the last generated one (never fed back).
    assert cache.seq_lengths() == [prompt_len + new_tokens - 1] * batch
    # Independent reference: the same weights with transformers' SDPA and its own cache.
    model.set_attn_implementation("sdpa")
    ref = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref)


def test_op_block_matches_attention_over_the_stored_pages():
    scope = _run(1)
    cache, a, b = scope["cache"], scope["a"], scope["b"]
    out, out2, q, q2 = scope["out"], scope["out2"], scope["q"], scope["q2"]
    assert cache.seq_len(a) == 1000 and cache.seq_len(b) == 700
    assert out.shape == (1, 32, 128) and out2.shape == (513, 32, 128)
    assert torch.isfinite(out.float()).all() and torch.isfinite(out2.float()).all()
    ka, va = cache.read(a, 0)
    kb, vb = cache.read(b, 0)
    tol = dict(atol=2e-2, rtol=2e-2)  # bf16 output
    torch.testing.assert_close(out.double().cpu(), _attention_ref(q, ka, va), **tol)
    torch.testing.assert_close(out2[:1].double().cpu(), _attention_ref(q2[:1], ka, va), **tol)
    torch.testing.assert_close(out2[1:].double().cpu(), _attention_ref(q2[1:], kb, vb), **tol)
    if torch.cuda.is_available():
        torch.testing.assert_close(scope["out3"], out2, atol=0, rtol=0)


def test_cascade_block_shares_pages_and_matches_attention():
    scope = _run(2)
    cache, forks, q = scope["cache"], scope["forks"], scope["q"]
    shared, plain = scope["shared"], scope["plain"]
    assert cache.fp8 and all(cache.seq_len(s) == 256 + 8 for s in forks)
    # The prompt's 16 full pages are held once; each fork adds one page of its own.
    assert cache.free_pages() == 64 - 16 - len(forks)
    assert shared.shape == plain.shape == (4, 8, 64) and torch.isfinite(shared.float()).all()
    for i, s in enumerate(forks):
        k, v = cache.read(s, 0)  # the dequantized pages
        ref = _attention_ref(q[i:i + 1], k, v)
        torch.testing.assert_close(shared[i:i + 1].double().cpu(), ref, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(plain[i:i + 1].double().cpu(), ref, atol=2e-2, rtol=2e-2)


def test_readme_is_a_reference_page():
    text = _text()
    assert len(text.splitlines()) <= 250
    numbers = [line for line in text.splitlines() if re.match(r"#+ .*\bnumbers\b", line, re.I)]
    assert numbers == ["## Numbers"]
    section = text.split("\n## Numbers\n", 1)[1].split("\n## ", 1)[0]
    assert sum(1 for line in section.splitlines() if re.match(r"\|\s*-", line)) == 1  # one table


def test_numbers_table_files_are_the_committed_results():
    text = _text()
    section = text.split("\n## Numbers\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| what")]
    cells = [row.rstrip().rstrip("|").rsplit("|", 1)[1] for row in rows]  # each row's files: its last cell
    cited = {name for cell in cells for name in re.findall(r"`([^`]+)\.\*`", cell)}
    assert all(re.findall(r"`([^`]+)\.\*`", cell) for cell in cells), cells
    results = ROOT / "bench" / "results"
    stems = {p.name.split(".")[0] for p in results.iterdir()}
    assert cited == stems  # every row's file exists, and every committed result is cited
    for row in rows:  # each row: a command, a date, the GPU (or CPU)
        assert re.search(r"\| 20\d\d-\d\d-\d\d, (H200|H100|CPU) \|", row), row



def test_plan_block_runs_every_layer_and_explains_a_gpu_plan(capsys):
    scope = _run(3)
    cache, attn, plan, outs, a = scope["cache"], scope["attn"], scope["plan"], scope["outs"], scope["a"]
    assert attn.current is plan and plan.shape.q_lens == (100,) and plan.shape.seq_lens == (600,)
    if not torch.cuda.is_available():
        assert plan.route == "reference"
    # each layer's output against a float64 attention over that layer's stored pages
    assert len(outs) == 2
    for layer, out in enumerate(outs):
        k, v = cache.read(a, layer)
        ref = _attention_ref(scope["qs"][layer], k, v)
        assert out.shape == (100, 32, 128)
        assert ((out.double().cpu() - ref).norm() / ref.norm()).item() < 2e-2
    # the H200 plan printed for a 32k prompt chunk of 2048 tokens is staged, and says why
    printed = capsys.readouterr().out
    assert "route q_tiled_staged" in printed and "compute-bound" in printed and "cost model" in printed
