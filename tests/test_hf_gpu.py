"""The Hugging Face integration on the GPU kernels: a bf16 Llama-shaped model (head dim 128, GQA 4)
decoded teacher-forced for 200+ steps after a chunked, left-padded prefill. Every step's logits are
compared with the float32 model's (DynamicCache + SDPA), against the error of transformers' own
bf16 DynamicCache + SDPA on the same tokens, host-only and hybrid."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import directkv_cute.hf as dkhf  # noqa: E402

pytestmark = pytest.mark.gpu

STEPS = 200
CHUNK = 512


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=2048, hidden_size=2048, intermediate_size=4096, num_hidden_layers=4,
                      num_attention_heads=16, num_key_value_heads=4, head_dim=128, max_position_embeddings=8192,
                      rope_theta=500000.0)
    with torch.device("cuda"):
        m = LlamaForCausalLM(cfg)
    return m.to(torch.bfloat16).eval()


def _prompts(lens, vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    width = max(lens)
    ids = torch.randint(1, vocab, (len(lens), width), generator=g)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lens):
        mask[b, width - n:] = 1
    return ids.cuda(), mask.cuda()


@torch.no_grad()
def _run(model, cache, impl, ids, mask, tokens=None):
    """Chunked prefill, then STEPS decode steps; feeds ``tokens`` (teacher forcing) or its own
    greedy picks. Returns (logits per step (STEPS + 1, B, V) fp32, tokens fed (B, STEPS))."""
    model.set_attn_implementation(impl)
    kw = dkhf.cache_kwargs(model, cache)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    width = ids.shape[1]
    for c0 in range(0, width, CHUNK):
        c1 = min(width, c0 + CHUNK)
        out = model(ids[:, c0:c1], attention_mask=mask[:, :c1], position_ids=pos[:, c0:c1], use_cache=True, **kw)
    logits = [out.logits[:, -1].float()]
    fed = []
    last_pos = pos[:, -1:]
    for i in range(STEPS):
        nxt = logits[-1].argmax(-1, keepdim=True) if tokens is None else tokens[:, i : i + 1]
        fed.append(nxt)
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        last_pos = last_pos + 1
        out = model(nxt, attention_mask=mask, position_ids=last_pos, use_cache=True, **kw)
        logits.append(out.logits[:, -1].float())
    model.set_attn_implementation("sdpa")
    return torch.stack(logits), torch.cat(fed, dim=1)


@pytest.fixture(scope="module")
def reference(model):
    """Greedy tokens and logits of the float32 model (DynamicCache + SDPA), and the bf16
    DynamicCache + SDPA logits on the same tokens: the error any bf16 attention starts from."""
    import copy

    from transformers import DynamicCache

    lens = [1500, 903, 130]
    ids, mask = _prompts(lens, model.config.vocab_size)
    fp32 = copy.deepcopy(model).float()
    ref_logits, tokens = _run(fp32, DynamicCache(config=fp32.config), "sdpa", ids, mask)
    del fp32
    torch.cuda.empty_cache()
    bf16_logits, _ = _run(model, DynamicCache(config=model.config), "sdpa", ids, mask, tokens)
    return lens, ids, mask, ref_logits, tokens, bf16_logits


def _errors(logits, ref):
    rel = ((logits - ref).norm(dim=-1) / ref.norm(dim=-1)).max(dim=1).values  # (STEPS + 1,) worst row
    agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    return rel, agree


@pytest.mark.parametrize("hbm_pages,fused", [(0, False), (24, False), (0, True)], ids=["host", "hybrid", "fused"])
def test_logits_agree_with_dynamic_cache_over_200_steps(model, reference, hbm_pages, fused, capsys):
    """Host-only, hybrid, and with the fused K/V projection kernel (fuse_kv_projection)."""
    if fused:
        dkhf.fuse_kv_projection(model)
    try:
        _logits_agree(model, reference, hbm_pages, capsys)
    finally:
        dkhf.unfuse_kv_projection(model)


def _logits_agree(model, reference, hbm_pages, capsys):
    lens, ids, mask, ref_logits, tokens, bf16_logits = reference
    spec = dkhf.model_spec(model.config)
    page_bytes = 2 * spec.num_layers * spec.num_kv_heads * 64 * spec.head_dim * 2
    cache = dkhf.DirectKVCache(model, max_tokens=sum(lens) + 3 * (STEPS + 1), max_batch_size=3, page_size=64,
                               hbm_budget=hbm_pages * page_bytes)
    ours, _ = _run(model, cache, "directkv", ids, mask, tokens)
    assert torch.isfinite(ours).all()
    rel, agree = _errors(ours, ref_logits)
    rel_sdpa, agree_sdpa = _errors(bf16_logits, ref_logits)
    rel_pair, agree_pair = _errors(ours, bf16_logits)
    with capsys.disabled():
        print(f"\n[hf gpu, {hbm_pages} HBM pages] vs the fp32 model over {STEPS + 1} steps x {len(lens)} rows: "
              f"ours rel. error max {rel.max():.2e} median {rel.median():.2e}, greedy agreement {agree:.4f}; "
              f"bf16 DynamicCache+SDPA max {rel_sdpa.max():.2e} median {rel_sdpa.median():.2e}, agreement "
              f"{agree_sdpa:.4f}; ours vs bf16 SDPA max {rel_pair.max():.2e}, agreement {agree_pair:.4f}")
    assert rel.max() <= 2 * rel_sdpa.max() + 1e-3
    assert rel.median() <= 2 * rel_sdpa.median() + 1e-3
    assert agree >= agree_sdpa - 0.02
    assert cache.seq_lengths() == [n + STEPS for n in lens]
    quota = hbm_pages // len(lens)
    assert cache.hbm_bytes() == sum(min(quota, -(-n // 64)) for n in cache.seq_lengths()) * page_bytes
    cache.reset()
    model.set_attn_implementation("directkv")
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                         prefill_chunk_size=CHUNK, **dkhf.cache_kwargs(model, cache))
    model.set_attn_implementation("sdpa")
    assert out.shape == (3, ids.shape[1] + 8)
    assert cache.seq_lengths() == [n + 7 for n in lens]


def test_forks_of_one_prompt_agree_with_dynamic_cache_through_the_cascade(model, capsys):
    """Four rows of one 1500-token prompt are stored once; teacher-forced different tokens fork
    them at the first step, and every later step is planned over the shared prompt (the cascade,
    or one staged call of the batch where the planner finds that faster). Logits are compared as
    above, against the float32 model and bf16 SDPA on the same tokens."""
    import copy

    from transformers import DynamicCache

    from directkv_cute.attention import DirectKVAttention

    one, m1 = _prompts([1500], model.config.vocab_size, seed=5)
    ids, mask = one.repeat(4, 1), m1.repeat(4, 1)
    g = torch.Generator().manual_seed(6)
    tokens = torch.randint(1, model.config.vocab_size, (4, STEPS), generator=g).cuda()
    fp32 = copy.deepcopy(model).float()
    ref_logits, _ = _run(fp32, DynamicCache(config=fp32.config), "sdpa", ids, mask, tokens)
    del fp32
    torch.cuda.empty_cache()
    bf16_logits, _ = _run(model, DynamicCache(config=model.config), "sdpa", ids, mask, tokens)
    plans = []
    real = DirectKVAttention.plan

    def recording(self, *args, **kwargs):
        plans.append(real(self, *args, **kwargs))
        return plans[-1]

    DirectKVAttention.plan = recording
    try:
        cache = dkhf.DirectKVCache(model, max_tokens=4 * (1500 + STEPS + 1), max_batch_size=4, page_size=64)
        ours, _ = _run(model, cache, "directkv", ids, mask, tokens)
    finally:
        DirectKVAttention.plan = real
    shared = [p for p in plans if getattr(p.detail, "cascade", None) is not None and p.detail.cascade.shared]
    rel, agree = _errors(ours, ref_logits)
    rel_sdpa, agree_sdpa = _errors(bf16_logits, ref_logits)
    with capsys.disabled():
        print(f"\n[hf gpu, 4 forks of one prompt] ours rel. error max {rel.max():.2e} median {rel.median():.2e}, "
              f"agreement {agree:.4f}; bf16 SDPA max {rel_sdpa.max():.2e}, agreement {agree_sdpa:.4f}; "
              f"{len(shared)} of {len(plans)} step plans over shared pages "
              f"({sorted({p.route for p in shared})})")
    assert rel.max() <= 2 * rel_sdpa.max() + 1e-3
    assert rel.median() <= 2 * rel_sdpa.median() + 1e-3
    assert agree >= agree_sdpa - 0.02
    assert len(set(cache.seq_ids)) == 4 and len(shared) >= STEPS - 1
    used = cache.kv.num_pages("host") - cache.kv.free_pages("host")
    assert used <= 1500 // 64 + 4 * (-(-(1500 % 64 + STEPS) // 64)), used


def test_fp8_kv_pages_stay_close_to_bf16_kv_pages_over_200_steps(model, reference, capsys):
    """DirectKVCache(kv_dtype="fp8") on the GPU (the FP8 decode kernel; the prefill chunks through
    the dequantized path), teacher-forced on the float32 model's tokens: its logits against the
    same integration with bf16 pages. The budget is the format's: e4m3 rounds each K/V element
    within 2^-4 (the CPU test of the same comparison measured a logit error of 4e-2 of the largest
    logit); the greedy picks may differ where two logits are that close."""
    lens, ids, mask, ref_logits, tokens, _ = reference
    runs = {}
    for kv in (None, "fp8"):
        cache = dkhf.DirectKVCache(model, max_tokens=sum(lens) + 3 * (STEPS + 1), max_batch_size=3, page_size=64,
                                   kv_dtype=kv)
        runs[kv], _ = _run(model, cache, "directkv", ids, mask, tokens)
        assert cache.kv.dtype is (torch.float8_e4m3fn if kv else torch.bfloat16)
        cache.close()
    assert torch.isfinite(runs["fp8"]).all()
    rel = ((runs["fp8"] - runs[None]).abs().amax(-1) / runs[None].abs().amax(-1)).max().item()
    agree = (runs["fp8"].argmax(-1) == runs[None].argmax(-1)).float().mean().item()
    agree_ref = (runs["fp8"].argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
    with capsys.disabled():
        print(f"\n[hf gpu, fp8 pages] vs bf16 pages over {STEPS + 1} steps x {len(lens)} rows: logit error max "
              f"{rel:.2e} of the largest logit, greedy agreement {agree:.4f} (with the fp32 model {agree_ref:.4f})")
    assert rel < 0.1, rel
    assert agree >= 0.8, agree
