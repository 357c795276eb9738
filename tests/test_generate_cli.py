"""``directkv-generate`` and the random-weight presets, on the CPU reference path."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from directkv_cute import generate as gen  # noqa: E402
from directkv_cute import hf as dkhf  # noqa: E402
from directkv_cute.presets import PRESETS, build_random_model, preset_config, weight_bytes  # noqa: E402

SMALL = dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             intermediate_size=256, vocab_size=512)


def _reference_tokens(model, ids, mask, new_tokens):
    """Greedy tokens from transformers' DynamicCache + SDPA for the same model and prompt."""
    from transformers import DynamicCache

    model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                             **dkhf.cache_kwargs(model, DynamicCache(config=model.config)))
    return out[:, ids.shape[1]:]


@pytest.mark.parametrize("chunk", [16, 0])
def test_cli_tiny_matches_dynamic_cache(tmp_path, capsys, chunk):
    out = tmp_path / "run.json"
    rc = gen.main(["--preset", "tiny", "--context", "64", "--max-new-tokens", "8", "--batch", "2", "--device", "cpu",
                   "--prefill-chunk", str(chunk), "--no-progress", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "time to first token" in text and "ms/token" in text and "host memory" in text
    d = json.loads(out.read_text())
    ids = gen.random_prompt(2, 64, PRESETS["tiny"][1]["vocab_size"], seed=0)
    assert d["prompt_ids"] == ids.tolist()
    model = build_random_model("tiny", torch.float32, "cpu", seed=0)
    ref = _reference_tokens(model, ids, torch.ones_like(ids), 8)
    assert d["tokens"] == ref.tolist()
    # the comparison has power: another prompt gives other tokens
    other = ids.clone()
    other[:, :32] = gen.random_prompt(2, 32, 1024, seed=5)
    assert _reference_tokens(model, other, torch.ones_like(other), 8).tolist() != d["tokens"]
    assert d["prefill_forwards"] == (4 if chunk else 1)
    assert d["decode_steps"] == 7 and len(d["step_ms"]) == 7
    assert d["ttft_s"] > 0 and d["decode_ms_per_token"] > 0 and d["decode_tokens_per_s"] > 0
    assert d["seq_lengths"] == [64 + 7, 64 + 7]  # the last token is never fed back
    assert d["host_kv_bytes"] > 0 and d["hbm_kv_bytes"] == 0 and d["peak_gpu_bytes"] is None
    assert d["dtype"] == "float32" and d["versions"]["transformers"]


def _tiny_model_folder(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "hello world a b c d e f g the quick brown fox jumps over lazy dog".split()
    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2} | {w: i + 3 for i, w in enumerate(words)}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")
    folder = tmp_path / "model"
    model = build_random_model("tiny", torch.float32, "cpu", seed=1, vocab_size=64)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder, model, tok


def test_cli_model_folder_with_text_prompts(tmp_path, capsys):
    folder, model, tok = _tiny_model_folder(tmp_path)
    out = tmp_path / "run.json"
    prompts = ["the quick brown fox jumps over the lazy dog", "hello world"]
    rc = gen.main(["--model", str(folder), "--prompt", prompts[0], "--prompt", prompts[1], "--max-new-tokens", "6",
                   "--device", "cpu", "--no-progress", "--json", str(out)])
    assert rc == 0
    d = json.loads(out.read_text())
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    ref = _reference_tokens(model, enc["input_ids"], enc["attention_mask"], 6)
    assert d["tokens"] == ref.tolist()
    assert d["prompt_lens"] == [9, 2]  # left padding never enters the cache
    assert d["seq_lengths"] == [9 + 5, 2 + 5]
    assert d["text"] == tok.batch_decode(ref, skip_special_tokens=True)
    assert "[1] " in capsys.readouterr().out
    # one prompt for 10**9 rows: sized (and refused) before the rows are copied
    with pytest.raises(SystemExit) as e:
        gen.main(["--model", str(folder), "--prompt", "hello world", "--batch", str(10**9), "--device", "cpu"])
    assert e.value.code == 2
    assert f"{10**9} x (2 + 32) tokens need" in capsys.readouterr().err


@pytest.mark.parametrize("text,expect", [
    ("0", 0), ("123", 123), ("8GiB", 8 << 30), ("8gib", 8 << 30), ("512MiB", 512 << 20), ("1.5G", 3 << 29),
    ("4GB", 4 * 10**9), ("64k", 64 << 10), (" 2 TiB ", 2 << 40), (17, 17),
])
def test_parse_size(text, expect):
    assert gen.parse_size(text) == expect


@pytest.mark.parametrize("text", ["", "abc", "8XB", "-1", "1.5", "GiB", "8 Gi B"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        gen.parse_size(text)


def _usage_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        gen.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_unknown_preset_is_a_usage_error(capsys):
    err = _usage_error(["--preset", "llama9-1t", "--device", "cpu"], capsys)
    assert "unknown preset 'llama9-1t'" in err and "tiny" in err and "llama3-70b" in err
    with pytest.raises(ValueError, match="unknown preset"):
        preset_config("llama9-1t")


def test_fp32_refused_on_cuda_before_touching_a_gpu(capsys):
    err = _usage_error(["--preset", "tiny", "--device", "cuda", "--dtype", "fp32"], capsys)
    assert "fp32" in err and "CPU" in err
    err = _usage_error(["--preset", "tiny", "--device", "cuda:0", "--dtype", "fp32"], capsys)
    assert "fp32" in err


def test_other_usage_errors(capsys):
    assert "tokenizer" in _usage_error(["--preset", "tiny", "--prompt", "hi", "--device", "cpu"], capsys)
    assert "--hbm-budget" in _usage_error(["--preset", "tiny", "--hbm-budget", "lots", "--device", "cpu"], capsys)
    assert "not allowed with" in _usage_error(["--preset", "tiny", "--model", "x"], capsys)
    assert "--context" in _usage_error(["--preset", "tiny", "--context", "0", "--device", "cpu"], capsys)
    if not torch.cuda.is_available():
        assert "is_available" in _usage_error(["--preset", "tiny", "--device", "cuda"], capsys)


def test_cache_kwargs_follows_the_forward_signature():
    class New:
        def forward(self, input_ids=None, cache=None):
            pass

    class Old:
        def forward(self, input_ids=None, past_key_values=None):
            pass

    c = object()
    assert dkhf.cache_kwargs(New(), c) == {"cache": c}
    assert dkhf.cache_kwargs(Old(), c) == {"past_key_values": c}
    import inspect

    model = build_random_model("tiny", torch.float32, "cpu", seed=0)
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    assert list(dkhf.cache_kwargs(model, c)) == [key]
    assert list(gen.dtype_kwargs(torch.bfloat16)) in (["dtype"], ["torch_dtype"])


@pytest.mark.parametrize("preset,overrides", [("tiny", {}), ("llama3-8b", SMALL), ("qwen2.5-7b", SMALL)])
def test_build_random_model_is_deterministic_and_matches_a_reference(preset, overrides):
    from transformers import AutoModelForCausalLM

    a = build_random_model(preset, torch.float32, "cpu", seed=3, **overrides)
    b = build_random_model(preset, torch.float32, "cpu", seed=3, **overrides)
    c = build_random_model(preset, torch.float32, "cpu", seed=4, **overrides)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])
    assert not a.training and a.config._attn_implementation == "sdpa"
    for name, p in a.named_parameters():
        assert not p.requires_grad
        if name.endswith("bias"):
            assert torch.all(p == 0), name
        elif p.dim() == 1:
            assert torch.all(p == 1), name
        else:
            assert 0.015 < p.std().item() < 0.025 and abs(p.mean().item()) < 2e-3, name
    if preset == "qwen2.5-7b":
        assert any(n.endswith("q_proj.bias") for n, _ in a.named_parameters())
    # a normally constructed model with the same weights: the same buffers and logits
    ref = AutoModelForCausalLM.from_config(preset_config(preset, **overrides), attn_implementation="sdpa").eval()
    ref.load_state_dict(sa)
    for (n1, b1), (n2, b2) in zip(a.named_buffers(), ref.named_buffers()):
        assert n1 == n2 and b1.dtype == b2.dtype and torch.equal(b1, b2), n1
    assert a.model.rotary_emb.attention_scaling == ref.model.rotary_emb.attention_scaling
    ids = gen.random_prompt(2, 96, a.config.vocab_size, seed=1)
    with torch.no_grad():
        assert torch.equal(a(ids).logits, ref(ids).logits)


def test_build_random_model_dtype_and_weight_bytes():
    m = build_random_model("tiny", torch.bfloat16, "cpu", seed=0)
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    assert m.model.rotary_emb.inv_freq.dtype == torch.float32  # as transformers keeps it
    params = sum(p.numel() for p in m.parameters())
    assert weight_bytes(m) == 2 * params + sum(b.numel() * 4 for b in m.buffers())


def test_presets_have_the_real_shapes():
    from directkv_cute.hf import model_spec

    want = {"llama3-8b": (32, 32, 8, 128, 4096, 14336, 128256), "llama3-70b": (80, 64, 8, 128, 8192, 28672, 128256),
            "qwen2.5-7b": (28, 28, 4, 128, 3584, 18944, 152064), "tiny": (2, 8, 2, 64, 256, 512, 1024),
            "qwen2.5-72b": (80, 64, 8, 128, 8192, 29568, 152064), "mistral-large": (88, 96, 8, 128, 12288, 28672, 32768)}
    assert set(want) == set(PRESETS)
    for name, (layers, hq, hkv, d, hidden, inter, vocab) in want.items():
        cfg = preset_config(name)
        assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) == (layers, hq, hkv, d, hidden, inter, vocab)
        assert cfg.eos_token_id is None  # random weights: generation never stops early
        spec = model_spec(cfg)  # DirectKV accepts every preset
        assert (spec.num_layers, spec.num_q_heads, spec.num_kv_heads, spec.head_dim) == (layers, hq, hkv, d)
    rope = preset_config("llama3-8b").rope_parameters
    assert rope["rope_type"] == "llama3" and rope["rope_theta"] == 500000.0 and rope["factor"] == 8.0
    assert rope["low_freq_factor"] == 1.0 and rope["high_freq_factor"] == 4.0
    assert rope["original_max_position_embeddings"] == 8192
    assert preset_config("llama3-8b").max_position_embeddings == 131072
    assert preset_config("llama3-8b").rms_norm_eps == 1e-5
    q = preset_config("qwen2.5-7b")
    assert q.rope_parameters["rope_theta"] == 1e6 and not q.use_sliding_window and q.sliding_window is None
    assert q.max_position_embeddings == 131072
    assert preset_config("tiny", num_hidden_layers=4).num_hidden_layers == 4


@pytest.mark.gpu
def test_cli_tiny_on_gpu(tmp_path):
    out = tmp_path / "run.json"
    assert gen.main(["--preset", "tiny", "--context", "512", "--max-new-tokens", "8", "--batch", "2",
                     "--no-progress", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["device"].startswith("cuda") and d["peak_gpu_bytes"] > 0 and d["host_kv_bytes"] > 0
