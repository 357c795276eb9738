"""The documents besides the README (docs/*.md, bench/README.md, tuning/README.md): every snippet
runs as pasted (README.md's own python blocks: tests/test_readme.py).

* Every ```python block runs on the CPU, each in a fresh namespace in an empty current directory,
  unless it is a fragment: a block whose last non-blank line before the opening fence is an HTML
  comment starting with ``fragment``, saying why it does not run as pasted, e.g.
  ``<!-- fragment: the script tp_generate.py, run by the torchrun line below -->``. A fragment must
  still parse, and a fragment that stands for a script is run as that script by a test here.
  Marking a block a fragment is for what cannot run in-process on a CPU at all.
* Every shell block (```bash, ```sh, ```shell, ```console, or a fence with no language) of these
  documents and of README.md has no ``<word>`` placeholder outside quotes and comments: a shell
  reads ``<model>`` as a redirect from a file named ``model``; write ``/path/to/model``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "bench" / "README.md", ROOT / "tuning" / "README.md"]
SHELL_LANGS = {"bash", "sh", "shell", "console", ""}
FENCE = re.compile(r"^```([\w+-]*)[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
FRAGMENT = re.compile(r"<!--\s*fragment\b.*?-->\s*\Z", re.S)


def _blocks(path: Path) -> list[tuple[str, str, bool, int]]:
    """(language, code, is_fragment, line) of each fenced block of ``path``, in order."""
    text = path.read_text()
    out = []
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip()
        comment_start = before.rfind("<!--")
        fragment = comment_start >= 0 and bool(FRAGMENT.match(before[comment_start:]))
        out.append((m.group(1).lower(), m.group(2), fragment, text.count("\n", 0, m.start()) + 1))
    return out


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


PYTHON = [(path, code, line) for path in DOCS for lang, code, fragment, line in _blocks(path)
          if lang == "python" and not fragment]
FRAGMENTS = [(path, code, line) for path in DOCS for lang, code, fragment, line in _blocks(path)
             if lang == "python" and fragment]


def _run(code: str, where: str) -> dict:
    scope: dict = {"__name__": "__docs__"}
    exec(compile(code, where, "exec"), scope)
    return scope


def _block(name: str, needle: str) -> str:
    """The python block of ``name`` (a path under the repository) that contains ``needle``."""
    found = [code for lang, code, _, _ in _blocks(ROOT / name) if lang == "python" and needle in code]
    assert len(found) == 1, f"{name}: {len(found)} python blocks contain {needle!r}"
    return found[0]


@pytest.mark.parametrize("path,code,line", PYTHON, ids=[f"{_name(p)}:{n}" for p, _, n in PYTHON])
def test_python_block_runs_as_pasted(path, code, line, cwd):
    _run(code, f"{_name(path)} line {line}")


@pytest.mark.parametrize("path,code,line", FRAGMENTS, ids=[f"{_name(p)}:{n}" for p, _, n in FRAGMENTS])
def test_fragment_parses(path, code, line):
    compile(code, f"{_name(path)} line {line}", "exec")


def test_the_documents_have_blocks_to_check():
    # The discovery above finds the blocks (a changed fence style would silently test nothing).
    assert len(PYTHON) >= 1 and len(FRAGMENTS) >= 1
    assert any(lang == "bash" for path in DOCS for lang, *_ in _blocks(path))
    for path in [*DOCS, ROOT / "README.md"]:  # an indented fence (in a list) would escape the checks
        assert not re.search(r"^[ \t]+```", path.read_text(), re.M), _name(path)


def _unquoted(line: str) -> str:
    """``line`` without its quoted strings and its comment (a ``#`` that starts a word)."""
    out, quote, prev = [], None, " "
    i = 0
    while i < len(line):
        ch = line[i]
        if quote:
            if ch == "\\" and quote == '"':
                i += 1
            elif ch == quote:
                quote = None
        elif ch == "\\":
            out.append(line[i:i + 2])
            i += 1
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and prev.isspace():
            break
        else:
            out.append(ch)
        prev = ch
        i += 1
    return "".join(out)


def test_unquoted_helper():
    assert _unquoted('a "<b>" \'<c>\' <d> # <e>') == "a   <d> "
    assert _unquoted("x#y <z>") == "x#y <z>"


SHELL = [(path, code, line) for path in [*DOCS, ROOT / "README.md"] for lang, code, _, line in _blocks(path)
         if lang in SHELL_LANGS]


@pytest.mark.parametrize("path,code,line", SHELL, ids=[f"{_name(p)}:{n}" for p, _, n in SHELL])
def test_shell_block_has_no_placeholder_a_shell_reads_as_a_redirect(path, code, line):
    bad = [text for text in code.splitlines() if re.search(r"<[A-Za-z_][^<>\s]*>", _unquoted(text))]
    assert not bad, f"{_name(path)} block at line {line}: <placeholder> outside quotes: {bad}"


def test_no_document_runs_a_script_the_package_does_not_ship():
    # Every `torchrun ... X.py` or `python X.py` of a shell block names a shipped file or a script
    # a fragment of the same document writes out (its first line: `# X.py: ...`).
    for path in [*DOCS, ROOT / "README.md"]:
        blocks = _blocks(path)
        written = {m.group(1) for lang, code, _, _ in blocks if lang == "python"
                   for m in [re.match(r"#\s*([\w./-]+\.py)\b", code)] if m}
        for lang, code, _, line in blocks:
            if lang not in SHELL_LANGS:
                continue
            for script in re.findall(r"(?:torchrun|python3?)\b[^#\n]*?\s([\w./-]+\.py)\b", code):
                assert script in written or (ROOT / script).is_file(), \
                    f"{_name(path)} block at line {line} runs {script}, which is neither shipped nor written out"


def test_fp8_block_stores_fp8_pages_within_the_format_bound():
    scope = _run(_block("docs/FP8.md", "kv_dtype=\"fp8\""), "docs/FP8.md")
    cache, pages = scope["cache"], scope["pages"]
    assert cache.kv_dtype == torch.float8_e4m3fn and cache.kv.fp8 and cache.dtype == torch.float32
    assert pages.fp8 and pages.seq_len(scope["s"]) == 100
    k, v, k0, v0 = scope["k"], scope["v"], scope["k0"], scope["v0"]
    assert k0.shape == v0.shape == (100, 2, 64) and k0.dtype == torch.bfloat16
    for got, want in ((k0, k[:, 0]), (v0, v[:, 0])):
        # e4m3: within 2^-4 of each value's magnitude (normal range) plus one bf16 rounding, or
        # within 2^-10 of the row's scale below it (the scale: the row's amax / 448)
        want = want.double()
        scale = want.abs().amax(-1, keepdim=True) / 448
        err = (got.double() - want).abs()
        assert (err <= want.abs() * (2 ** -4 + 2 ** -8) + scale * 2 ** -9).all()


def _tiny_model_dir(tmp_path: Path) -> Path:
    """A tiny random Llama with a word-level tokenizer, saved as a transformers folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<unk>", "</s>"] + [f"w{i}" for i in range(254)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=16, eos_token_id=1,
                         bos_token_id=None, pad_token_id=None, max_position_embeddings=1024)
    path = tmp_path / "tiny"
    LlamaForCausalLM(config).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.full  # the representative run of tp_plan="auto" under torchrun: tests/test_tp.py
def test_serving_tp_script_runs_under_torchrun_on_two_cpu_ranks(tmp_path):
    pytest.importorskip("accelerate")  # transformers needs it for tp_plan
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    from directkv_cute.hf import cache_kwargs

    script = _block("docs/SERVING.md", "tp_plan=\"auto\"")
    assert script.startswith("# tp_generate.py:")
    (tmp_path / "tp_generate.py").write_text(script)
    shell = next(code for lang, code, _, _ in _blocks(ROOT / "docs" / "SERVING.md")
                 if lang == "bash" and "tp_generate.py" in code)
    args = shell.split("#", 1)[0].split()
    assert args[:4] == ["torchrun", "--nproc-per-node", "2", "tp_generate.py"] and len(args) == 6
    model_dir, prompt = _tiny_model_dir(tmp_path), "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12"
    # The command as written, the model path and the prompt replaced (torchrun: python -m torch.distributed.run).
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(29500 + (os.getpid() + 500) % 1000), "tp_generate.py",
                          str(model_dir), prompt], capture_output=True, text=True, timeout=300, env=env,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    # The same greedy generation in one process, transformers' own cache and attention.
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False,
                             pad_token_id=1, **cache_kwargs(model, DynamicCache(config=model.config)))
    want = tokenizer.decode(ref[0, ids.shape[1]:], skip_special_tokens=True)
    assert want and res.stdout.strip().splitlines()[-1] == want
