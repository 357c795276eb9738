"""The Hugging Face integration on the CPU reference path: generate with DirectKVCache against
transformers' own DynamicCache + SDPA, chunked prefill, padding, placement, capacity and the
refusal of attention features the kernels do not implement."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

import directkv_cute.hf as dkhf  # noqa: E402
from directkv_cute.cache import CacheCapacityError  # noqa: E402
from directkv_cute.hf.step import Step  # noqa: E402

VOCAB = 512


def _llama(layers=2, hq=8, hkv=2, head_dim=16, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hq * head_dim, intermediate_size=256, num_hidden_layers=layers,
                      num_attention_heads=hq, num_key_value_heads=hkv, head_dim=head_dim,
                      max_position_embeddings=4096)
    return LlamaForCausalLM(cfg).eval().float()


def _qwen2(seed=1, hidden=96, layers=3, hq=6, hkv=2, inter=192):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=hq, num_key_value_heads=hkv, max_position_embeddings=4096,
                      use_sliding_window=False)
    return Qwen2ForCausalLM(cfg).eval().float()


def _mistral(seed=12):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=1, head_dim=16, sliding_window=None,
                        max_position_embeddings=4096)
    return MistralForCausalLM(cfg).eval().float()


def _prompts(batch_lens, seed=2):
    """Left-padded random prompts: ids (B, T) and the 0/1 attention mask."""
    g = torch.Generator().manual_seed(seed)
    width = max(batch_lens)
    ids = torch.randint(1, VOCAB, (len(batch_lens), width), generator=g)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(batch_lens):
        mask[b, width - n:] = 1
        ids[b, : width - n] = 0
    return ids, mask


def _generate(model, cache, ids, mask, **kw):
    impl = "directkv" if isinstance(cache, dkhf.DirectKVCache) else "sdpa"
    model.set_attn_implementation(impl)
    try:
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, pad_token_id=0, **dkhf.cache_kwargs(model, cache), **kw)
    finally:
        model.set_attn_implementation("sdpa")


def _ours(model, max_tokens=600, batch=3, **kw):
    return dkhf.DirectKVCache(model, max_tokens=max_tokens, max_batch_size=batch, device="cpu",
                              **{"page_size": 16, **kw})


@pytest.mark.parametrize("make", [_llama, _qwen2, _mistral], ids=["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("chunk", [None, 16])
def test_greedy_tokens_equal_dynamic_cache(make, chunk):
    model = make()
    lens = [40, 33, 9]
    ids, mask = _prompts(lens)
    kw = dict(max_new_tokens=52, do_sample=False, prefill_chunk_size=chunk)
    ref = _generate(model, DynamicCache(config=model.config), ids, mask, **kw)
    cache = _ours(model)
    out = _generate(model, cache, ids, mask, **kw)
    assert out.shape == ref.shape == (3, 40 + 52)
    assert torch.equal(out, ref)
    # pads never enter the cache: real prompt tokens + the new ones that were fed back
    assert cache.seq_lengths() == [n + 51 for n in lens]
    assert cache.get_seq_length() == 40 + 51
    for sid, n in zip(cache.seq_ids, cache.seq_lengths()):
        assert len(cache.kv.page_table(sid)) == -(-n // 16)
    used = sum(-(-n // 16) for n in cache.seq_lengths())
    assert cache.kv.num_pages("host") - cache.kv.free_pages("host") == used


def test_sampling_and_multiple_return_sequences_equal_dynamic_cache():
    model = _llama(seed=3)
    ids, mask = _prompts([20, 12])
    kw = dict(max_new_tokens=20, do_sample=True, top_k=0, temperature=1.0, num_return_sequences=2)
    torch.manual_seed(7)
    ref = _generate(model, DynamicCache(config=model.config), ids, mask, **kw)
    torch.manual_seed(7)
    cache = _ours(model, batch=4)
    out = _generate(model, cache, ids, mask, **kw)
    assert out.shape == (4, 40) and torch.equal(out, ref)
    assert len(cache.seq_ids) == 4


def test_beam_search_reorders_by_forking():
    model = _llama(seed=4)
    ids, mask = _prompts([24, 17])
    kw = dict(max_new_tokens=12, do_sample=False, num_beams=3, early_stopping=False)
    ref = _generate(model, DynamicCache(config=model.config), ids, mask, **kw)
    cache = _ours(model, batch=6, max_tokens=1200)
    out = _generate(model, cache, ids, mask, **kw)
    assert torch.equal(out, ref)


def test_bf16_logits_agree_with_dynamic_cache():
    model = _llama(layers=3, head_dim=32, seed=5).to(torch.bfloat16)
    ids, mask = _prompts([70, 50, 3])
    kw = dict(max_new_tokens=30, do_sample=False, output_logits=True, return_dict_in_generate=True)
    ref = _generate(model, DynamicCache(config=model.config), ids, mask, **kw)
    out = _generate(model, _ours(model, dtype=torch.bfloat16), ids, mask, **kw)
    # compare the steps before the first token that differs (bf16 ties may diverge later)
    same = (out.sequences == ref.sequences).all(dim=0)[70:]
    steps = int(same.long().cumprod(0).sum())
    assert steps >= 10
    for a, b in zip(out.logits[:steps], ref.logits[:steps]):
        rel = (a.float() - b.float()).norm() / b.float().norm()
        assert rel < 2e-2 and torch.isfinite(a).all()


def test_hbm_budget_keeps_sinks_and_recent_pages_in_hbm():
    model = _llama(seed=6)
    ids, mask = _prompts([60, 41, 30])
    kw = dict(max_new_tokens=40, do_sample=False, prefill_chunk_size=24)
    ref = _generate(model, DynamicCache(config=model.config), ids, mask, **kw)
    spec = dkhf.model_spec(model.config)
    page_bytes = 2 * spec.num_layers * spec.num_kv_heads * 16 * spec.head_dim * 4
    cache = _ours(model, hbm_budget=12 * page_bytes, sink_pages=1)
    out = _generate(model, cache, ids, mask, **kw)
    assert torch.equal(out, ref)
    quota = 12 // 3
    for sid in cache.seq_ids:
        table = cache.kv.page_table(sid)
        in_hbm = [lp for lp, e in enumerate(table) if e < 0]
        assert in_hbm == [0, *range(len(table) - (quota - 1), len(table))]
    assert cache.hbm_bytes() == 12 * page_bytes and cache.host_bytes() > 0


def test_overflow_raises_before_anything_is_written():
    model = _llama(seed=8)
    ids, mask = _prompts([40, 30, 20])
    cache = _ours(model, max_tokens=40)  # 3 + 3 pages of 16 tokens; the prompts need 7
    with pytest.raises(CacheCapacityError):
        cache.check_request([40, 30, 20], 10)
    before = cache.kv.state()
    with pytest.raises(CacheCapacityError, match="unchanged"):
        _generate(model, cache, ids, mask, max_new_tokens=5, do_sample=False)
    state = cache.kv.state()
    assert state.free_lists == before.free_lists and all(n == 0 for n in state.seq_lens.values())
    assert cache.get_seq_length() == 0


def test_failed_layer_rolls_the_step_back(monkeypatch):
    model = _llama(layers=3, seed=9)
    ids, mask = _prompts([20, 11])
    cache = _ours(model, batch=2)
    _generate(model, cache, ids, mask, max_new_tokens=3, do_sample=False)
    lengths, processed, state = cache.seq_lengths(), cache.get_seq_length(), cache.kv.state()
    real = Step.run

    def boom(self, query, key, value, scaling, layer_idx):
        if layer_idx == 2:
            raise RuntimeError("injected")
        return real(self, query, key, value, scaling, layer_idx)

    monkeypatch.setattr(Step, "run", boom)
    model.set_attn_implementation("directkv")
    nxt = torch.randint(1, VOCAB, (2, 5))
    full_mask = torch.ones(2, processed + 5, dtype=torch.long)
    full_mask[1, : 20 - 11] = 0
    with pytest.raises(RuntimeError, match="injected"), torch.no_grad():
        model(nxt, attention_mask=full_mask, **dkhf.cache_kwargs(model, cache))
    assert cache.seq_lengths() == lengths and cache.get_seq_length() == processed
    assert cache.kv.state() == state


def test_attention_without_directkv_cache_is_refused():
    model = _llama(seed=10)
    model.set_attn_implementation("directkv")
    ids, mask = _prompts([8])
    with pytest.raises(RuntimeError, match="DirectKVCache"), torch.no_grad():
        model(ids, attention_mask=mask, **dkhf.cache_kwargs(model, DynamicCache(config=model.config)))


def test_cache_dtype_must_match_the_model():
    model = _llama(seed=11)
    cache = dkhf.DirectKVCache(model, max_tokens=64, device="cpu", dtype=torch.bfloat16, page_size=16)
    ids, mask = _prompts([8])
    with pytest.raises(TypeError, match="float32"):
        _generate(model, cache, ids, mask, max_new_tokens=2)


def _config(kind: str):
    from transformers import AutoConfig

    base = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2)
    if kind == "mistral-sliding":
        return AutoConfig.for_model("mistral", sliding_window=4096, **base)
    if kind == "qwen2-sliding":
        return AutoConfig.for_model("qwen2", use_sliding_window=True, sliding_window=128, max_window_layers=1, **base)
    if kind == "gemma2":
        return AutoConfig.for_model("gemma2", head_dim=16, **base)
    if kind == "t5":
        return AutoConfig.for_model("t5", vocab_size=64, d_model=64, num_layers=2, num_heads=4)
    if kind == "deepseek_v3":
        return AutoConfig.for_model("deepseek_v3", **base)
    if kind == "gpt_oss":
        return AutoConfig.for_model("gpt_oss", head_dim=16, **base)
    if kind == "odd-group":
        return LlamaConfig(num_attention_heads=6, num_key_value_heads=4, hidden_size=96, num_hidden_layers=2)
    raise AssertionError(kind)


@pytest.mark.parametrize("kind, words", [
    ("mistral-sliding", "sliding"), ("qwen2-sliding", "sliding"), ("gemma2", "sliding|soft-capping"),
    ("t5", "cross-attention"), ("deepseek_v3", "latent"), ("gpt_oss", "sliding|sinks"), ("odd-group", "GQA"),
])
def test_unsupported_models_are_refused_at_construction(kind, words):
    try:
        config = _config(kind)
    except (ValueError, KeyError) as exc:  # a model type this transformers does not know
        pytest.skip(f"{kind}: {exc}")
    with pytest.raises(dkhf.UnsupportedModelError, match=words):
        dkhf.DirectKVCache(config, max_tokens=64, device="cpu")


def test_head_dim_outside_the_kernels_is_refused_for_cuda():
    config = LlamaConfig(num_attention_heads=4, num_key_value_heads=2, hidden_size=384, head_dim=96,
                         num_hidden_layers=2)
    with pytest.raises(dkhf.UnsupportedModelError, match="head_dim 96"):
        dkhf.DirectKVCache(config, max_tokens=64, device="cuda", dtype=torch.bfloat16)
    assert dkhf.model_spec(config).head_dim == 96  # the CPU reference path takes it


def test_supported_shapes():
    spec = dkhf.model_spec(_llama(hq=8, hkv=8).config)
    assert (spec.num_q_heads, spec.num_kv_heads, spec.group) == (8, 8, 1)
    q = dkhf.model_spec(Qwen2Config(hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
                                     num_hidden_layers=28, use_sliding_window=False))
    assert (q.num_layers, q.group, q.head_dim) == (28, 7, 128)


# ---- placement planning ----------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(length=st.integers(0, 400), n=st.integers(0, 300), ps=st.sampled_from([16, 32, 64]),
       quota=st.integers(0, 12), sinks=st.integers(0, 3), data=st.data())
def test_plan_growth_properties(length, n, ps, quota, sinks, data):
    old = -(-length // ps)
    hbm = sorted(data.draw(st.sets(st.integers(0, max(old - 1, 0)), max_size=old)) if old else [])
    g = dkhf.plan_growth(length, hbm, n, ps, quota, sinks)
    assert sum(m for _, m in g.runs) == n and all(m > 0 for _, m in g.runs)
    new = -(-(length + n) // ps)
    target = set(range(min(sinks, quota, new)))
    target |= set(range(max(min(sinks, quota, new), new - (quota - min(sinks, quota, new))), new))
    if quota == 0:
        target = set()
    assert set(g.demote) == {lp for lp in hbm if lp not in target}
    # replay the runs: each new page's tier is where the target says
    at, pages = length, old
    for tier, m in g.runs:
        end = -(-(at + m) // ps)
        for lp in range(pages, end):
            assert (tier == "hbm") == (lp in target)
        at, pages = at + m, end
    assert pages == new
    assert len(target) <= max(quota, 0)


def _pages_added(lengths, plans, ps):
    """Independent count: new pages per tier, replaying each plan page by page."""
    need = {"host": 0, "hbm": 0}
    for length, g in zip(lengths, plans):
        need["host"] += len(g.demote)
        need["hbm"] -= len(g.demote)
        pages = -(-length // ps)
        for tier, m in g.runs:
            length += m
            while pages < -(-length // ps):
                need[tier] += 1
                pages += 1
    return need


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(0, 200), min_size=1, max_size=4), data=st.data(),
       ps=st.sampled_from([16, 32]), quota=st.integers(0, 8), host_free=st.integers(0, 40),
       hbm_free=st.integers(0, 12))
def test_a_step_grows_within_its_free_pages_or_changes_nothing(lengths, data, ps, quota, host_free, hbm_free):
    """The step's growth as a whole: HBM pages while the tier has them, else every new page on the
    host; a host tier too small is refused before any plan is returned."""
    from directkv_cute.hf.step_plan import plan_step_growth

    counts = [data.draw(st.integers(0, 100)) for _ in lengths]
    hbm = [sorted(data.draw(st.sets(st.integers(0, max(-(-n // ps) - 1, 0)), max_size=-(-n // ps))))
           if n else [] for n in lengths]
    free = {"host": host_free, "hbm": hbm_free}
    wanted = [dkhf.plan_growth(n, h, c, ps, quota, 1) for n, h, c in zip(lengths, hbm, counts)]
    spill = _pages_added(lengths, wanted, ps)["hbm"] > hbm_free
    if spill:
        wanted = [dkhf.Growth(g.demote, tuple(("host", m) for _, m in g.runs)) for g in wanted]
    need = _pages_added(lengths, wanted, ps)
    if need["host"] > host_free:
        with pytest.raises(CacheCapacityError, match="raise max_tokens"):
            plan_step_growth(lengths, hbm, counts, ps, quota, 1, free)
        return
    plans = plan_step_growth(lengths, hbm, counts, ps, quota, 1, free)
    assert plans == wanted
    assert need["hbm"] <= hbm_free


def test_stored_tokens_skip_merged_rows_and_shared_prefixes():
    from directkv_cute.hf.step_plan import stored_tokens

    # rows 0, 2, 3 with 4, 3, 5 real tokens; row 2 repeats row 0 (stores nothing), row 3 shares
    # its first 2 tokens with an earlier row's prompt
    assert stored_tokens([0, 2, 3], [4, 3, 5], [0, 3], {3: 2}) == [0, 1, 2, 3, 9, 10, 11]
    assert stored_tokens([1], [3], [1], {}) == [0, 1, 2]


def test_identical_rows_and_shared_prefixes_on_cpu_tensors():
    from directkv_cute.hf.step_plan import identical_rows, shared_prefixes, valid_tokens

    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(4, 2, 40, 8, generator=g), torch.randn(4, 2, 40, 8, generator=g)
    k[2], v[2] = k[0], v[0]  # row 2 repeats row 0
    k[3, :, :32], v[3, :, :32] = k[1, :, :32], v[1, :, :32]  # row 3 starts with two pages of row 1
    k[3, 0, 33] += 1.0
    assert identical_rows(k, v, None, [0, 1, 2, 3]) == [[0, 2], [1], [3]]
    assert shared_prefixes(k, v, None, [0, 1, 3], 16) == {3: (1, 32)}
    mask = torch.ones(4, 40, dtype=torch.long)
    mask[2, :1] = 0  # the same tokens, one of them padding: no longer the same row
    valid = valid_tokens(mask, 4, 40)
    assert identical_rows(k, v, valid, [0, 1, 2, 3]) == [[0], [1], [2], [3]]
    assert shared_prefixes(k, v, None, [0, 1, 3], 64) == {}  # no whole page of 64 in common


def test_beams_over_a_long_prompt_read_it_once_through_the_cascade(monkeypatch):
    """Beams fork the prompt's pages; from the first reorder on, the decode steps are planned as a
    cascade (the shared prompt read once for all beams), every layer runs its step's plan, and
    the tokens equal transformers' own."""
    from directkv_cute.attention import DirectKVAttention

    plans = []
    real = DirectKVAttention.run

    def recording(self, q, layer, *args, **kwargs):
        plans.append((self.current, layer))
        return real(self, q, layer, *args, **kwargs)

    monkeypatch.setattr(DirectKVAttention, "run", recording)
    model = _llama(seed=9)
    ids, mask = _prompts([300, 283])
    kw = dict(max_new_tokens=8, do_sample=False, num_beams=3, early_stopping=False)
    ref = _generate(model, DynamicCache(config=model.config), ids, mask, **kw)
    cache = _ours(model, batch=6, max_tokens=4000)
    out = _generate(model, cache, ids, mask, **kw)
    assert torch.equal(out, ref)
    layers = model.config.num_hidden_layers
    assert len(plans) % layers == 0
    steps = [plans[i:i + layers] for i in range(0, len(plans), layers)]
    assert all(len({id(p) for p, _ in step}) == 1 and [l for _, l in step] == list(range(layers))
               for step in steps)  # one plan per step, run by every layer in order
    cascades = [step[0][0] for step in steps if step[0][0].route == "cascade"]
    assert cascades and all(p.detail.cascade.shared for p in cascades)
    assert max(len(s.rows) for p in cascades for s in p.detail.cascade.spans) >= 3


def test_return_sequences_store_the_prompt_once_and_fork_when_they_diverge():
    model = _llama(seed=10)
    ids, mask = _prompts([300])
    kw = dict(max_new_tokens=10, do_sample=True, top_k=0, temperature=1.0, num_return_sequences=4)
    torch.manual_seed(3)
    ref = _generate(model, DynamicCache(config=model.config), ids, mask, **kw)
    torch.manual_seed(3)
    cache = _ours(model, batch=4, max_tokens=4000)
    out = _generate(model, cache, ids, mask, **kw)
    assert torch.equal(out, ref)
    assert len(set(cache.seq_ids)) == 4, "sampled rows diverged into their own sequences"
    # The prompt's 18 full pages are held once; each row adds its partial page and new tokens.
    used = cache.kv.num_pages("host") - cache.kv.free_pages("host")
    assert used <= 18 + 4 * 2, used
    tables = cache.kv.kernel_tables(cache.seq_ids)
    assert (tables.host_table[:, :18] == tables.host_table[0, :18]).all()


def test_identical_rows_stay_one_sequence_under_greedy_decoding():
    model = _llama(seed=11)
    one, m1 = _prompts([45])
    ids, mask = one.repeat(3, 1), m1.repeat(3, 1)
    kw = dict(max_new_tokens=12, do_sample=False)
    ref = _generate(model, DynamicCache(config=model.config), ids, mask, **kw)
    cache = _ours(model)
    out = _generate(model, cache, ids, mask, **kw)
    assert torch.equal(out, ref)
    assert len(set(cache.seq_ids)) == 1 and cache.seq_lengths() == [45 + 11] * 3
    assert cache.kv.num_pages("host") - cache.kv.free_pages("host") == -(-(45 + 11) // 16)
    off = _ours(model, share_prompts=False)
    assert torch.equal(_generate(model, off, ids, mask, **kw), ref)
    assert len(set(off.seq_ids)) == 3
    cache.reset()
    assert cache.kv.free_pages("host") == cache.kv.num_pages("host")


def test_prompts_sharing_a_prefix_share_its_pages():
    """Three left-padded prompts: rows 1 and 2 begin with row 0's first 40 tokens, row 2 with row
    1's first 70. Whole pages of those prefixes are stored once (row 1 forks row 0 at 32 tokens,
    row 2 forks row 1 at 64) and the tokens equal transformers' own cache."""
    model = _llama(seed=13)
    g = torch.Generator().manual_seed(4)
    base = torch.randint(1, VOCAB, (90,), generator=g)
    p0 = base[:50]
    p1 = torch.cat([base[:40], torch.randint(1, VOCAB, (45,), generator=g)])
    p2 = torch.cat([p1[:70], torch.randint(1, VOCAB, (20,), generator=g)])
    lens = [len(p0), len(p1), len(p2)]
    width = max(lens)
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate((p0, p1, p2)):
        ids[b, width - len(p):] = p
        mask[b, width - len(p):] = 1
    kw = dict(max_new_tokens=10, do_sample=False)
    ref = _generate(model, DynamicCache(config=model.config), ids, mask, **kw)
    cache = _ours(model)
    out = _generate(model, cache, ids, mask, **kw)
    assert torch.equal(out, ref)
    t = cache.kv.kernel_tables(cache.seq_ids).host_table
    assert (t[1, :2] == t[0, :2]).all() and t[1, 2] != t[0, 2], "row 1 holds row 0's first 2 pages"
    assert (t[2, :4] == t[1, :4]).all() and t[2, 4] != t[1, 4], "row 2 holds row 1's first 4 pages"
    used = cache.kv.num_pages("host") - cache.kv.free_pages("host")
    assert used == sum(-(-(n + 9) // 16) for n in lens) - 2 - 4
    off = _ours(model, share_prompts=False)
    assert torch.equal(_generate(model, off, ids, mask, **kw), ref)
    assert off.kv.num_pages("host") - off.kv.free_pages("host") == sum(-(-(n + 9) // 16) for n in lens)


@pytest.mark.parametrize("seed", range(4))
def test_random_prompt_trees_generate_like_dynamic_cache(seed):
    """Random batches of prompts that copy random prefixes of earlier ones (sometimes a whole
    duplicate), left padded, chunked prefill or not, greedy or sampled: tokens equal."""
    import random

    r = random.Random(200 + seed)
    g = torch.Generator().manual_seed(200 + seed)
    model = _llama(seed=23)
    base = torch.randint(1, VOCAB, (120,), generator=g)
    prompts: list[torch.Tensor] = []
    for _ in range(r.choice([2, 3, 4])):
        src = prompts[r.randrange(len(prompts))] if prompts and r.random() < 0.7 else base
        k = r.randint(0, min(len(src), 100))
        prompts.append(torch.cat([src[:k], torch.randint(1, VOCAB, (r.randint(1, 40),), generator=g)]))
    if seed % 2:
        prompts.append(prompts[0].clone())
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = p
        mask[b, width - len(p):] = 1
    kw = dict(max_new_tokens=6, prefill_chunk_size=[None, 32, 48, 32][seed],
              **({"do_sample": True, "top_k": 0, "temperature": 1.0} if seed >= 2 else {"do_sample": False}))
    torch.manual_seed(5)
    ref = _generate(model, DynamicCache(config=model.config), ids, mask, **kw)
    torch.manual_seed(5)
    cache = _ours(model, batch=len(prompts), max_tokens=3000)
    assert torch.equal(_generate(model, cache, ids, mask, **kw), ref)


@pytest.mark.parametrize("window", [0, 16, 8192], ids=["no-window", "tiny-window", "window"])
def test_window_steps_read_new_tokens_from_hbm_and_generate_like_dynamic_cache(monkeypatch, window):
    """Each step's pages are mirrored in HBM: the attention reads the history's full pages from
    the host and everything newer (this step's tokens, the partial page they extend) from the
    window; a window too small for a step mirrors what fits; the tokens never change."""
    model = _llama(seed=21)
    lens = [70, 41, 16]
    ids, mask = _prompts(lens)
    kw = dict(max_new_tokens=20, do_sample=False, prefill_chunk_size=32)
    ref = _generate(model, DynamicCache(config=model.config), ids, mask, **kw)
    cache = _ours(model, window_tokens=window)
    seen, marks = [], []
    real = Step.run

    def watch(self, query, key, value, scaling, layer_idx):
        marks.append(self.tables)
        if layer_idx == 0:
            before = dict(self.undo.lengths)  # sequences the step made were empty
            seen.append((self.tables.host_table.copy(), list(self.tables.host_seq_lens),
                         [before.get(sid, 0) for sid in self.seq_ids]))
        return real(self, query, key, value, scaling, layer_idx)

    monkeypatch.setattr(Step, "run", watch)
    out = _generate(model, cache, ids, mask, **kw)
    assert torch.equal(out, ref)
    P = 16
    assert seen
    assert all(t.back_to_back for t in marks)  # a step's layers: staged chunks may plan copies ahead
    for table, seq_lens, hist in seen:
        for row, n, h in zip(table, seq_lens, hist):
            pages = -(-n // P)
            from_host = [p for p in range(pages) if row[p] >= 0]
            if window >= 8192:  # every page of the step in the window: only full history pages on the host
                assert from_host == list(range(h // P))
            elif window == 0:
                assert from_host == list(range(pages))
            else:
                assert set(range(h // P)) <= set(from_host)
    if window:
        assert any(row[p] < 0 for table, _, _ in seen for row in table for p in range(len(row)))
    assert cache.kv.free_window_pages() + sum(len(cache.kv.mirrored_pages(s)) for s in set(cache.seq_ids)) \
        == cache.kv.num_window_pages


def _fused_model(make, **kw):
    model = make(**kw).to(torch.bfloat16)
    assert dkhf.fuse_kv_projection(model) == model.config.num_hidden_layers
    return model


def _llama128(seed=31):
    return _llama(layers=2, hq=4, hkv=2, head_dim=128, seed=seed)


def _qwen2_128(seed=32):
    return _qwen2(seed, hidden=512, layers=2, hq=4, hkv=1, inter=256)  # head_dim 128


@pytest.mark.parametrize("make", [_llama128, _qwen2_128], ids=["llama", "qwen2-bias"])
@pytest.mark.parametrize("chunk", [None, 32])
def test_fused_kv_projection_generates_like_transformers(make, chunk):
    """fuse_kv_projection: K/V from kv_project (the reference on the CPU: float64 dot products,
    rounded like transformers) stored into the pages and the window; greedy tokens and logits
    agree with transformers' own DynamicCache + SDPA and with the unfused DirectKV path, over
    ragged left-padded prompts, chunked or not (Qwen2: k/v biases)."""
    model = make().to(torch.bfloat16)
    ids, mask = _prompts([70, 41, 9], seed=8)
    kw = dict(max_new_tokens=24, do_sample=False, output_logits=True, return_dict_in_generate=True,
              prefill_chunk_size=chunk)
    ref = _generate(model, DynamicCache(config=model.config), ids, mask, **kw)
    plain = _generate(model, _ours(model, dtype=torch.bfloat16), ids, mask, **kw)
    dkhf.fuse_kv_projection(model)
    try:
        cache = _ours(model, dtype=torch.bfloat16)
        fused = _generate(model, cache, ids, mask, **kw)
        again = _generate(model, DynamicCache(config=model.config), ids, mask, **kw)  # other caches: unfused
    finally:
        assert dkhf.unfuse_kv_projection(model) == 2
    assert torch.equal(again.sequences, ref.sequences)
    for other in (ref, plain):
        same = (fused.sequences == other.sequences).all(dim=0)[70:]
        steps = int(same.long().cumprod(0).sum())
        assert steps >= 10
        for a, b in zip(fused.logits[:steps], other.logits[:steps]):
            rel = (a.float() - b.float()).norm() / b.float().norm()
            assert rel < 2e-2 and torch.isfinite(a).all()
    assert cache.seq_lengths() == [n + 23 for n in (70, 41, 9)]


def test_fused_kv_projection_stores_what_the_unfused_path_stores():
    """One prefill step, fused against unfused: the host pages hold the same K/V (within one
    bf16 ulp of transformers' own projection + RoPE, the dot products being summed differently)."""
    model = _llama128(seed=33).to(torch.bfloat16)
    ids, mask = _prompts([40, 23], seed=9)
    kw = dict(max_new_tokens=1, do_sample=False)
    a = _ours(model, dtype=torch.bfloat16, window_tokens=0)
    _generate(model, a, ids, mask, **kw)
    dkhf.fuse_kv_projection(model)
    try:
        b = _ours(model, dtype=torch.bfloat16, window_tokens=0)
        _generate(model, b, ids, mask, **kw)
    finally:
        dkhf.unfuse_kv_projection(model)
    for sa, sb, n in zip(a.seq_ids, b.seq_ids, (40, 23)):
        ka, va = a.kv.read(sa, None)
        kb, vb = b.kv.read(sb, None)
        assert ka.shape == kb.shape == (n, 2, 2, 128)
        torch.testing.assert_close(kb.float(), ka.float(), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(vb.float(), va.float(), rtol=1e-2, atol=1e-2)
        assert (kb == ka).float().mean() > 0.9 and (vb == va).float().mean() > 0.9


def test_fuse_kv_projection_refuses_what_it_cannot_fuse():
    with pytest.raises(dkhf.UnsupportedModelError, match="head_dim 16"):
        dkhf.fuse_kv_projection(_llama().to(torch.bfloat16))
    with pytest.raises(dkhf.UnsupportedModelError, match="float32"):
        dkhf.fuse_kv_projection(_llama128())
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=128)
    with pytest.raises(dkhf.UnsupportedModelError, match="no attention module"):  # its own attention class
        dkhf.fuse_kv_projection(Qwen3ForCausalLM(cfg).to(torch.bfloat16))
    normed = _llama128().to(torch.bfloat16)
    normed.model.layers[1].self_attn.k_norm = torch.nn.Identity()  # a norm on k before RoPE
    with pytest.raises(dkhf.UnsupportedModelError, match="k_norm"):
        dkhf.fuse_kv_projection(normed)
    assert not any("_directkv_unfused_forward" in m.__dict__ for m in normed.modules())  # nothing changed
    with pytest.raises(dkhf.UnsupportedModelError, match="no attention module"):
        dkhf.fuse_kv_projection(torch.nn.Linear(4, 4))
    model = _llama128().to(torch.bfloat16)
    assert dkhf.fuse_kv_projection(model) == dkhf.fuse_kv_projection(model) == 2  # idempotent
    assert dkhf.unfuse_kv_projection(model) == 2 and dkhf.unfuse_kv_projection(model) == 0


@pytest.mark.parametrize("max_tokens,batch,page,budget_pages,window", [
    (1000, 1, 16, 0, 8192), (4097, 3, 64, 5, 0), (64, 2, 32, 2, 100), (1, 1, 128, 0, 1)])
def test_cache_pages_is_what_the_cache_allocates(max_tokens, batch, page, budget_pages, window):
    """``directkv-generate`` sizes a request with ``cache_pages`` before the model loads: it must
    be exactly what DirectKVCache then allocates (host, HBM tier and window pages)."""
    from directkv_cute.cache import page_bytes
    from directkv_cute.hf.step_plan import cache_pages

    model = _llama()
    spec = dkhf.model_spec(model.config)
    one = page_bytes(spec.num_layers, spec.num_kv_heads, page, spec.head_dim, torch.float32)
    budget = budget_pages * one + one // 2  # a partial page of budget buys no page
    cache = dkhf.DirectKVCache(model, max_tokens=max_tokens, max_batch_size=batch, page_size=page,
                               hbm_budget=budget, window_tokens=window, device="cpu")
    want = cache_pages(max_tokens, batch, page, one, budget, window)
    assert (cache.kv.num_pages("host"), cache.kv.num_pages("hbm"), cache.kv.num_window_pages) == \
        (want.host, want.hbm, want.window)
    assert want.hbm == budget_pages and want.host >= -(-max_tokens // page)
