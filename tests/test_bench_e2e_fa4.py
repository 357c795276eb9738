"""FlashAttention-4 as a peer of the end-to-end bench (``fa4``, ``hf-offloaded+fa4``): method
parsing, the rows where FA4 cannot run, and ``bench.fa4_attention``'s layouts, GQA, scaling and
refusals on the CPU with the FA4 call replaced by a torch reference of it. The GPU test (real FA4)
compares greedy tokens and logits with DynamicCache + SDPA on a tiny random Llama."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

from bench import e2e, fa4_attention  # noqa: E402
from test_bench_e2e import _runner  # noqa: E402


# ---- a reference of FA4's call ---------------------------------------------------------------
def reference_fa4(q, k, v, softmax_scale=None, causal=False):
    """FA4's ``flash_attn_func`` contract in plain torch: q (B, S, Hq, d), k / v (B, L, Hkv, d),
    query heads h read KV head h // (Hq / Hkv), ``causal`` bottom-right aligned (query i attends
    keys j <= i + L - S). Returns (out (B, S, Hq, d), lse) like FA4."""
    b, s, hq, d = q.shape
    bk, length, hkv, dk = k.shape
    assert (bk, dk) == (b, d) and v.shape == k.shape and hq % hkv == 0
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1  # FA4 needs unit-stride rows
    assert causal is True
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    out = torch.empty_like(q)
    lse = torch.empty(b, hq, s, dtype=torch.float32)
    for h in range(hq):
        kh, vh = k[:, :, h // group].double(), v[:, :, h // group].double()  # (B, L, d)
        scores = torch.einsum("bsd,bld->bsl", q[:, :, h].double(), kh) * scale
        for i in range(s):
            scores[:, i, i + length - s + 1:] = -math.inf
        lse[:, h] = torch.logsumexp(scores, -1).float()
        out[:, :, h] = torch.einsum("bsl,bld->bsd", torch.softmax(scores, -1), vh).to(q.dtype)
    return out, lse


class _Calls(list):
    """The keyword arguments of each call of the reference; ``shapes``: (q, k) shapes of each."""

    def __init__(self):
        super().__init__()
        self.shapes = []


@pytest.fixture
def reference(monkeypatch):
    calls = _Calls()

    def fa(q, k, v, **kw):
        calls.append(kw)
        calls.shapes.append((tuple(q.shape), tuple(k.shape)))
        return reference_fa4(q, k, v, **kw)

    monkeypatch.setattr(fa4_attention, "_flash_attn_func", lambda: fa)
    return calls


class _Module:
    is_causal = True


def _bottom_right_mask(s, length):
    i = torch.arange(s).view(s, 1)
    j = torch.arange(length).view(1, length)
    return j <= i + (length - s)


# ---- methods ---------------------------------------------------------------------------------
def test_parse_fa4_methods():
    ms = e2e.parse_methods("ours[host],hf-offloaded+fa4,fa4,hf-offloaded,dynamic")
    assert [m.name for m in ms] == ["dynamic", "fa4", "hf-offloaded", "hf-offloaded+fa4", "ours[host]"]
    by = {m.name: m for m in ms}
    assert by["fa4"].base == "dynamic" and by["fa4"].attn == "fa4" and by["fa4"].label() == "fa4"
    assert by["hf-offloaded+fa4"].base == "hf-offloaded" and by["hf-offloaded+fa4"].attn == "fa4"
    assert by["dynamic"].attn == by["hf-offloaded"].attn == "sdpa"
    assert tuple(m.name for m in e2e.parse_methods(",".join(e2e.FA4_METHODS))) == e2e.FA4_METHODS
    for bad in ("fa4,fa4", "flash", "fa4[hbm]", "dynamic+fa4"):
        with pytest.raises(ValueError):
            e2e.parse_methods(bad)
    # not in the default set
    assert not any(m.attn == "fa4" for m in e2e.parse_methods(e2e.DEFAULT_METHODS))
    assert e2e._attn_implementation(by["fa4"]) == fa4_attention.ATTN_IMPLEMENTATION == "directkv_fa4"
    assert e2e._attn_implementation(by["dynamic"]) == "sdpa"


def test_fa4_attention_is_registered_with_transformers():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    assert AttentionInterface()["directkv_fa4"] is fa4_attention.fa4_attention
    assert ALL_MASK_ATTENTION_FUNCTIONS["directkv_fa4"] is fa4_attention.fa4_mask


def test_fa4_is_unavailable_on_the_cpu_with_the_reason():
    from bench.peers import unavailable

    assert fa4_attention.unavailable("cpu") == unavailable("cpu") == "FA4 needs CUDA"
    assert e2e.fa4_unavailable(e2e.Method("dynamic", attn="fa4"), "cpu") == "FA4 needs CUDA"
    assert e2e.fa4_unavailable(e2e.Method("dynamic"), "cpu") is None




def test_cpu_rows_list_fa4_as_skipped_with_the_reason():
    runner = _runner("dynamic,fa4,hf-offloaded+fa4")
    doc = {"rows": []}
    e2e.run_rows(runner, doc, lambda: None)
    by = {r["method"]: r for r in doc["rows"]}
    assert by["dynamic"]["status"] == "ok"
    for name in e2e.FA4_METHODS:
        assert by[name]["status"] == "skipped", by[name]
        assert by[name]["error"] == "FA4 unavailable: FA4 needs CUDA"
        assert by[name]["decode_ms"] is None
    assert all(e2e.validate_row(r) == [] for r in doc["rows"])
    text = e2e.format_table({"rows": doc["rows"], "targets": e2e.evaluate_targets(doc["rows"], preset="tiny"),
                             "ceilings": {"host_read_gbps": 1.0, "hbm_read_gbps": 1.0, "memcpy_h2d_gbps": 1.0},
                             "header": {"gpu": "cpu", "date": "today", "versions": {}}, "args": {"preset": "tiny"}})
    assert sum("FA4 needs CUDA" in line for line in text.splitlines()) == 2


def test_cpu_smoke_run_lists_fa4_as_skipped(tmp_path):
    from bench.__main__ import main

    rc = main(["e2e", "--device", "cpu", "--methods", "dynamic,fa4", "--physics-context", "0", "--out-dir",
               str(tmp_path), "--no-progress", "--no-plot"])
    assert rc == 0
    import json

    (path,) = tmp_path.glob("*-e2e-tiny.json")
    doc = json.loads(path.read_text())
    assert e2e.validate_doc(doc) == []
    fa4 = next(r for r in doc["rows"] if r["method"] == "fa4")
    assert fa4["status"] == "skipped" and "FA4 needs CUDA" in fa4["error"]


def test_rows_run_fa4_through_the_reference_and_agree_with_dynamic(monkeypatch, reference):
    """The bench's whole FA4 path on the CPU (float32, the tiny preset, chunked prefill + decode)
    with FA4's call replaced by the reference: the same greedy tokens as DynamicCache + SDPA."""
    monkeypatch.setattr(e2e, "fa4_unavailable", lambda method, device: None)
    runner = _runner("dynamic,fa4")
    doc = {"rows": []}
    e2e.run_rows(runner, doc, lambda: None)
    by = {r["method"]: r for r in doc["rows"]}
    assert by["fa4"]["status"] == "ok", by["fa4"]
    assert by["fa4"]["agree_tokens"] == 4  # 1 + 1 warm-up + 2 timed tokens
    assert by["fa4"]["hbm_kv_bytes"] == by["dynamic"]["hbm_kv_bytes"] > 0
    assert reference and all(k == {"softmax_scale": 0.125, "causal": True} for k in reference)
    assert runner.model.config._attn_implementation == "directkv_fa4"


# ---- the attention function ------------------------------------------------------------------
@pytest.mark.parametrize("q_len,kv_len", [(1, 37), (5, 37), (16, 16), (24, 40)])
@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 4)])
def test_fa4_attention_matches_sdpa_with_a_bottom_right_mask(reference, q_len, kv_len, hq, hkv):
    g = torch.Generator().manual_seed(q_len * 100 + kv_len + hq)
    b, d = 2, 16
    q = torch.randn(b, hq, q_len, d, generator=g)
    k = torch.randn(b, hkv, kv_len, d, generator=g)
    v = torch.randn(b, hkv, kv_len, d, generator=g)
    scaling = 0.37  # not 1/sqrt(d): the scale must be passed through
    out, weights = fa4_attention.fa4_attention(_Module(), q, k, v, None, scaling=scaling, dropout=0.0)
    assert weights is None and out.shape == (b, q_len, hq, d)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=_bottom_right_mask(q_len, kv_len), scale=scaling, enable_gqa=True)
    torch.testing.assert_close(out, want.transpose(1, 2), rtol=1e-5, atol=1e-5)
    assert reference == [{"softmax_scale": scaling, "causal": True}]
    # a plain causal 4-D mask (bool or additive) is accepted and gives the same
    mask = _bottom_right_mask(q_len, kv_len).view(1, 1, q_len, kv_len)
    add = torch.zeros(b, 1, q_len, kv_len).masked_fill(~mask, torch.finfo(torch.float32).min)
    for m in (mask.expand(b, 1, q_len, kv_len), add):
        again, _ = fa4_attention.fa4_attention(_Module(), q, k, v, m, scaling=scaling)
        torch.testing.assert_close(again, out)


def test_fa4_attention_default_scale_is_fa4s(reference):
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    out, _ = fa4_attention.fa4_attention(_Module(), q, k, v, None)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=_bottom_right_mask(3, 9),
                                                            enable_gqa=True)
    torch.testing.assert_close(out, want.transpose(1, 2), rtol=1e-5, atol=1e-5)
    assert reference == [{"softmax_scale": None, "causal": True}]


def test_fa4_attention_refuses_padding_and_other_features(reference):
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    refused = fa4_attention.Fa4AttentionUnsupported
    pad2d = torch.ones(2, 9, dtype=torch.bool)
    pad2d[1, :2] = False  # a left-padded row
    with pytest.raises(refused, match="padding mask"):
        fa4_attention.fa4_attention(_Module(), q, k, v, pad2d)
    pad4d = _bottom_right_mask(3, 9).view(1, 1, 3, 9).repeat(2, 1, 1, 1)
    pad4d[1, :, :, :2] = False
    with pytest.raises(refused, match="4-D attention mask"):
        fa4_attention.fa4_attention(_Module(), q, k, v, pad4d)
    with pytest.raises(refused, match="4-D attention mask"):  # top-left causal is not FA's
        fa4_attention.fa4_attention(_Module(), q, k, v, torch.ones(3, 9, dtype=torch.bool).tril().view(1, 1, 3, 9))
    with pytest.raises(refused, match="dropout"):
        fa4_attention.fa4_attention(_Module(), q, k, v, None, dropout=0.1)
    with pytest.raises(refused, match="sliding_window"):
        fa4_attention.fa4_attention(_Module(), q, k, v, None, sliding_window=4)
    with pytest.raises(refused, match="softcap"):
        fa4_attention.fa4_attention(_Module(), q, k, v, None, softcap=30.0)
    bidir = _Module()
    bidir.is_causal = False
    with pytest.raises(refused, match="non-causal"):
        fa4_attention.fa4_attention(bidir, q, k, v, None)
    with pytest.raises(refused, match="more queries"):
        fa4_attention.fa4_attention(_Module(), k.repeat(1, 2, 1, 1), q, q, None)
    assert reference == []  # FA4 was never called
    # the 2-D mask of ones over the keys is plain causal
    out, _ = fa4_attention.fa4_attention(_Module(), q, k, v, torch.ones(2, 9, dtype=torch.bool))
    assert out.shape == (2, 3, 4, 8) and len(reference) == 1


def test_fa4_mask_is_none_without_padding():
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

    ones = torch.ones(2, 12, dtype=torch.long)
    assert fa4_attention.fa4_mask(2, 4, 12, attention_mask=ones, mask_function=causal_mask_function) is None
    assert fa4_attention.fa4_mask(2, 4, 10, attention_mask=ones, mask_function=causal_mask_function) is None
    assert fa4_attention.fa4_mask(2, 4, 12, attention_mask=None, mask_function=causal_mask_function) is None
    pad = ones.clone()
    pad[0, 0] = 0
    got = fa4_attention.fa4_mask(2, 4, 12, attention_mask=pad, mask_function=causal_mask_function)
    assert got.dtype == torch.bool and got.shape == (2, 12) and not got[0, 0]
    with pytest.raises(fa4_attention.Fa4AttentionUnsupported, match="mask pattern"):
        fa4_attention.fa4_mask(2, 4, 12, attention_mask=ones, mask_function=sliding_window_causal_mask_function(4))


def test_a_left_padded_batch_is_refused_through_the_model(reference):
    """A whole model forward with attn_implementation="directkv_fa4": a left-padded batch raises
    (naming the padding mask); the same batch without padding matches SDPA."""
    from directkv_cute.presets import build_random_model

    model = build_random_model("tiny", torch.float32, "cpu", seed=0, attn_implementation="sdpa")
    ids = torch.randint(0, 1024, (2, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        model.set_attn_implementation(fa4_attention.ATTN_IMPLEMENTATION)
        got = model(ids, attention_mask=mask).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        mask[1, :3] = 0
        with pytest.raises(fa4_attention.Fa4AttentionUnsupported, match="padding mask"):
            model(ids, attention_mask=mask)


# ---- GPU: real FA4 ---------------------------------------------------------------------------
def _need_fa4():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    why = fa4_attention.unavailable("cuda")
    if why:
        pytest.skip(why)


def _greedy_runs(model, ids, methods):
    """name -> (new tokens (B, 8), logits per step) of ``generate`` (greedy, chunked prefill of 256)
    for each (name, attn_implementation, cache_implementation)."""
    mask = torch.ones_like(ids)
    runs = {}
    for name, impl, cache in methods:
        model.set_attn_implementation(impl)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                                 prefill_chunk_size=256, cache_implementation=cache, output_logits=True,
                                 return_dict_in_generate=True)
        runs[name] = (out.sequences[:, ids.shape[1]:].cpu(), [t.float().cpu() for t in out.logits])
    return runs


def _check_runs(runs, rtol):
    ref_tokens, ref_logits = runs.pop("dynamic")
    assert ref_tokens.shape == (2, 8) and len(ref_logits) == 8
    for name, (tokens, logits) in runs.items():
        assert torch.equal(tokens, ref_tokens), (name, tokens, ref_tokens)
        for a, b in zip(logits, ref_logits):
            err = (a - b).abs().max().item()
            assert err <= rtol * b.abs().max().item(), (name, err, b.abs().max().item())


def test_the_gpu_tests_greedy_comparison_runs_on_the_cpu_reference(reference):
    """The GPU test's own comparison on the CPU (float32, the tiny preset, FA4's call replaced by the
    reference; the offloaded cache needs CUDA): so the test code itself is exercised here."""
    from directkv_cute.generate import random_prompt
    from directkv_cute.presets import build_random_model

    model = build_random_model("tiny", torch.float32, "cpu", seed=0, head_dim=128)
    ids = random_prompt(2, 300, model.config.vocab_size, seed=3)
    runs = _greedy_runs(model, ids, (("dynamic", "sdpa", None), ("fa4", "directkv_fa4", None)))
    _check_runs(runs, 1e-4)
    # 2 layers x (2 prefill chunks + 7 decode steps), FA4's layouts (B, S, H, d)
    assert len(reference) == 2 * 9 and all(k["causal"] for k in reference)
    assert sorted(set(reference.shapes)) == sorted(
        {((2, 256, 8, 128), (2, 256, 2, 128)), ((2, 44, 8, 128), (2, 300, 2, 128))}  # chunks: 256 + 44
        | {((2, 1, 8, 128), (2, 300 + i, 2, 128)) for i in range(1, 8)})


@pytest.mark.gpu
def test_gpu_fa4_generates_the_tokens_of_dynamic_sdpa():
    """8 greedy tokens after a chunked prefill (q_len < kv_len, then decode) on the tiny random
    Llama with head_dim 128 (GQA 4, bf16): fa4 and hf-offloaded+fa4 give dynamic's (SDPA) tokens,
    logits close."""
    _need_fa4()
    from directkv_cute.generate import random_prompt
    from directkv_cute.presets import build_random_model

    model = build_random_model("tiny", torch.bfloat16, "cuda", seed=0, head_dim=128)
    ids = random_prompt(2, 700, model.config.vocab_size, seed=3).cuda()
    runs = _greedy_runs(model, ids, (("dynamic", "sdpa", None), ("fa4", "directkv_fa4", None),
                                     ("hf-offloaded+fa4", "directkv_fa4", "offloaded")))
    _check_runs(runs, 3e-2)


@pytest.mark.gpu
def test_gpu_e2e_bench_runs_the_fa4_methods(tmp_path):
    _need_fa4()
    import json

    from bench.__main__ import main

    rc = main(["e2e", "--device", "cuda", "--preset", "tiny", "--contexts", "2048", "--batches", "1",
               "--methods", "dynamic,fa4,hf-offloaded,hf-offloaded+fa4,ours[host]", "--new-tokens", "4",
               "--offloaded-tokens", "2", "--physics-context", "512", "--prefill-chunk", "512",
               "--out-dir", str(tmp_path), "--no-progress", "--no-plot"])
    assert rc == 0
    (path,) = tmp_path.glob("*-e2e-tiny.json")
    doc = json.loads(path.read_text())
    assert e2e.validate_doc(doc) == []
    ok = {r["method"]: r for r in doc["rows"] if r["status"] == "ok" and r["role"] == "measured"}
    assert set(ok) == {"dynamic", "fa4", "hf-offloaded", "hf-offloaded+fa4", "ours[host]"}
    assert ok["fa4"]["hbm_kv_bytes"] > 0 and ok["hf-offloaded+fa4"]["host_kv_bytes"] > 0
    assert any(t["target"].endswith("(swap + FA4)") for t in doc["targets"])


def test_targets_report_the_speedup_over_swap_plus_fa4():
    def row(method, ms):
        return e2e.new_row(preset="llama3-8b", method=method, context=32768, batch=1, dtype="bfloat16", status="ok",
                           decode_ms=ms, prefill_s=3.0)

    rows = [row("ours[host]", 100.0), row("hf-offloaded+fa4", 450.0), row("fa4", 60.0)]
    (t,) = [t for t in e2e.evaluate_targets(rows, preset="llama3-8b") if "fa4" in t["target"]]
    assert t["target"] == "ours[host] speedup over hf-offloaded+fa4 (swap + FA4)"
    assert t["value"] == pytest.approx(4.5) and t["limit"] is None and t["ok"] is None
