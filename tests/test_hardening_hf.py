"""Refusals of the transformers integration a hostile caller meets on the CPU path: a step that
fails part-way is undone whatever the layer, a capacity refusal leaves the cache exactly as it
was, a cache serves one generation at a time, and a cache built for another model is refused.
Each refusal is a clear error raised before anything is stored (or with the step rolled back),
and a retry generates what a fresh cache generates."""

from __future__ import annotations

import threading

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList  # noqa: E402

import directkv_cute.hf as dkhf  # noqa: E402
from directkv_cute.cache import CacheCapacityError  # noqa: E402

VOCAB = 256


def llama(layers=2, hkv=2, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=hkv, head_dim=16, max_position_embeddings=1024)
    return LlamaForCausalLM(cfg).eval().float()


def prompts(lens, seed=1):
    g = torch.Generator().manual_seed(seed)
    width = max(lens)
    ids = torch.randint(1, VOCAB, (len(lens), width), generator=g)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lens):
        mask[b, width - n:] = 1
        ids[b, : width - n] = 0
    return ids, mask


def cache_for(model, **kw):
    return dkhf.DirectKVCache(model, device="cpu", **{"page_size": 16, "max_tokens": 256, "max_batch_size": 2,
                                                      **kw})


def generate(model, cache, ids, mask, **kw):
    model.set_attn_implementation("directkv" if isinstance(cache, dkhf.DirectKVCache) else "sdpa")
    try:
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, pad_token_id=0, do_sample=False,
                                  **dkhf.cache_kwargs(model, cache), **kw)
    finally:
        model.set_attn_implementation("sdpa")


def forward(model, cache, ids, mask):
    model.set_attn_implementation("directkv")
    try:
        with torch.no_grad():
            return model(ids, attention_mask=mask, **dkhf.cache_kwargs(model, cache))
    finally:
        model.set_attn_implementation("sdpa")


def looks(cache):
    """Everything a step may change: the rows' sequences and lengths, the processed columns and
    the page book (tables, refcounts, free lists, mirrors, free window pages)."""
    return cache.seq_ids, cache.seq_lengths(), cache.get_seq_length(), cache.kv.state()


def holds(cache):
    """What a rolled-back step must restore: the rows' sequences and lengths, the processed
    columns, every page table and refcount and the set of free pages per tier (a rollback hands
    the step's pages back, in another order than a fresh cache holds them)."""
    state = cache.kv.state()
    return (cache.seq_ids, cache.seq_lengths(), cache.get_seq_length(), state.page_tables, state.refcounts,
            {tier: sorted(free) for tier, free in state.free_lists.items()})


# ---- a step that fails part-way is undone, whatever the layer --------------------------------
@pytest.mark.parametrize("when", ["prefill", "decode"])
def test_a_module_in_training_mode_at_layer_1_leaves_the_cache_as_it_was(when):
    model = llama(layers=3)
    ids, mask = prompts([20, 13])
    kw = dict(max_new_tokens=6)
    fresh = generate(model, cache_for(model), ids, mask, **kw)
    cache = cache_for(model)
    if when == "decode":
        out = generate(model, cache, ids, mask, max_new_tokens=2)
        ids, mask = out, torch.cat([mask, torch.ones(2, 2, dtype=mask.dtype)], 1)
        fresh = generate(model, cache_for(model), ids, mask, **kw)
        cache = cache_for(model)
        generate(model, cache, ids[:, :-1], mask[:, :-1], max_new_tokens=1)
    before = holds(cache)
    model.model.layers[1].self_attn.train()
    with pytest.raises(dkhf.UnsupportedModelError, match="inference only"):
        generate(model, cache, ids, mask, **kw)
    assert holds(cache) == before
    model.eval()
    assert torch.equal(generate(model, cache, ids, mask, **kw), fresh)


def test_a_model_with_more_layers_than_the_cache_stores_nothing():
    """Refused at the first layer past the cache's, with what the earlier layers stored undone."""
    small, big = llama(layers=2), llama(layers=3)
    ids, mask = prompts([12, 9])
    cache = cache_for(small)
    with pytest.raises(IndexError, match="rolled back"):
        generate(big, cache, ids, mask, max_new_tokens=3)
    assert holds(cache) == holds(cache_for(small)) and looks(cache)[:3] == ([], [], 0)
    assert torch.equal(generate(small, cache, ids, mask, max_new_tokens=4),
                       generate(small, cache_for(small), ids, mask, max_new_tokens=4))


def test_an_out_of_range_layer_rolls_back_what_earlier_layers_stored(monkeypatch):
    """Without the model check (a module without a config) the refusal comes at layer 2's update,
    after layers 0 and 1 stored the step: the step is undone."""
    small, big = llama(layers=2), llama(layers=3)
    monkeypatch.setattr(dkhf.DirectKVCache, "_check_model", lambda self, module: None, raising=False)
    ids, mask = prompts([12, 9])
    cache = cache_for(small)
    with pytest.raises(IndexError, match="rolled back"):
        generate(big, cache, ids, mask, max_new_tokens=3)
    assert holds(cache) == holds(cache_for(small))


def test_a_model_with_fewer_layers_than_the_cache_is_refused():
    small, big = llama(layers=2), llama(layers=3)
    ids, mask = prompts([12, 9])
    cache = cache_for(big)
    with pytest.raises(dkhf.UnsupportedModelError, match="layers 2 .the cache: 3."):
        generate(small, cache, ids, mask, max_new_tokens=3)
    assert looks(cache) == ([], [], 0, cache_for(big).kv.state())


def test_a_step_that_did_not_run_every_layer_is_rolled_back_at_the_next(monkeypatch):
    small, big = llama(layers=2), llama(layers=3)
    monkeypatch.setattr(dkhf.DirectKVCache, "_check_model", lambda self, module: None, raising=False)
    ids, mask = prompts([12, 9])
    cache = cache_for(big)
    forward(small, cache, ids, mask)  # two of the cache's three layers
    with pytest.raises(RuntimeError, match="stopped after 2 of 3 layers"):
        forward(small, cache, ids, mask)
    assert holds(cache) == holds(cache_for(big))


# ---- a capacity refusal changes nothing --------------------------------------------------------
def test_a_step_refused_for_capacity_keeps_mirrors_and_window_pages():
    model = llama()
    ids, mask = prompts([31])
    cache = cache_for(model, max_tokens=16, max_batch_size=1, window_tokens=64)  # 2 host pages
    out = generate(model, cache, ids, mask, max_new_tokens=2)  # 32 tokens: both pages full
    assert cache.seq_lengths() == [32] and cache.kv.mirrored_pages(cache.seq_ids[0])
    before = looks(cache)
    with pytest.raises(CacheCapacityError, match="unchanged"):
        forward(model, cache, out[:, -1:], torch.ones(1, 33, dtype=torch.long))
    assert looks(cache) == before


def test_rows_that_diverge_without_room_to_fork_and_grow_change_nothing():
    model = llama()
    ids, mask = prompts([24])
    ids, mask = ids.repeat(2, 1), mask.repeat(2, 1)
    cache = cache_for(model, max_tokens=32, max_batch_size=2)  # 4 host pages; the prompt holds 2
    forward(model, cache, ids, mask)
    assert len(set(cache.seq_ids)) == 1  # identical rows: one sequence
    before = looks(cache)
    g = torch.Generator().manual_seed(5)
    nxt = torch.randint(1, VOCAB, (2, 9), generator=g)  # the rows diverge: a fork (1 page) + 2 new pages
    with pytest.raises(CacheCapacityError, match="unchanged"):
        forward(model, cache, nxt, torch.ones(2, 33, dtype=torch.long))
    assert looks(cache) == before


# ---- one generation at a time ----------------------------------------------------------------
class _Pause(LogitsProcessor):
    """At its second call, lets the other thread run and waits for it to finish."""

    def __init__(self, mid: threading.Event, done: threading.Event) -> None:
        self.mid, self.done, self.calls = mid, done, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == 2:
            self.mid.set()
            assert self.done.wait(120), "the other generate never returned"
        return scores


def test_a_second_concurrent_generate_is_refused_and_the_first_is_unharmed():
    model = llama()
    ids_a, mask_a = prompts([20, 14], seed=3)
    ids_b, mask_b = prompts([17, 11], seed=4)
    kw = dict(max_new_tokens=6)
    fresh_a = generate(model, cache_for(model), ids_a, mask_a, **kw)
    cache = cache_for(model)
    mid, done = threading.Event(), threading.Event()
    got: dict[str, object] = {}
    model.set_attn_implementation("directkv")

    def first():
        try:
            with torch.no_grad():
                got["a"] = model.generate(ids_a, attention_mask=mask_a, pad_token_id=0, do_sample=False,
                                          logits_processor=LogitsProcessorList([_Pause(mid, done)]),
                                          **dkhf.cache_kwargs(model, cache), **kw)
        except BaseException as exc:  # noqa: BLE001 - reported below
            got["a"] = exc
            mid.set()

    def second():
        assert mid.wait(120)
        try:
            with torch.no_grad():
                got["b"] = model.generate(ids_b, attention_mask=mask_b, pad_token_id=0, do_sample=False,
                                          **dkhf.cache_kwargs(model, cache), **kw)
        except BaseException as exc:  # noqa: BLE001 - checked below
            got["b"] = exc
        finally:
            done.set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    finally:
        model.set_attn_implementation("sdpa")
    assert isinstance(got["b"], RuntimeError) and "one generation at a time" in str(got["b"])
    assert isinstance(got["a"], torch.Tensor) and torch.equal(got["a"], fresh_a)
    # Once the owner resets it, the cache serves another thread.
    cache.reset()
    out: dict[str, object] = {}
    t = threading.Thread(target=lambda: out.setdefault("b", generate(model, cache, ids_b, mask_b, **kw)))
    t.start()
    t.join(300)
    assert torch.equal(out["b"], generate(model, cache_for(model), ids_b, mask_b, **kw))


def test_a_step_from_another_thread_while_one_is_in_flight_is_refused():
    model = llama()
    ids, mask = prompts([12])
    cache = cache_for(model, max_batch_size=1)
    generate(model, cache, ids, mask, max_new_tokens=2)
    before = looks(cache)
    errors = []

    def intruder():
        try:
            cache.update(torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16), 0)
        except RuntimeError as exc:
            errors.append(exc)
        for call in (cache.reset, lambda: cache.reorder_cache([0])):
            try:
                call()
            except RuntimeError as exc:
                errors.append(exc)

    t = threading.Thread(target=intruder)
    t.start()
    t.join(60)
    assert len(errors) == 3 and all("one generation at a time" in str(e) for e in errors)
    assert looks(cache) == before


def test_an_attention_call_without_its_cache_update_at_layer_1_rolls_the_step_back(monkeypatch):
    model = llama(layers=3)
    ids, mask = prompts([14, 10])
    cache = cache_for(model)
    real = dkhf.DirectKVCache.update

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = real(self, key_states, value_states, layer_idx, *args, **kwargs)
        return (k.clone() if layer_idx == 1 else k), v  # not what the hand-off holds

    monkeypatch.setattr(dkhf.DirectKVCache, "update", update)
    with pytest.raises(RuntimeError, match="DirectKVCache"):
        generate(model, cache, ids, mask, max_new_tokens=3)
    assert holds(cache) == holds(cache_for(model))


def test_a_page_size_of_zero_is_a_value_error():
    with pytest.raises(ValueError, match="page_size"):
        cache_for(llama(), page_size=0)


def test_a_cache_for_other_kv_heads_is_refused_before_anything_is_stored():
    ids, mask = prompts([12, 9])
    cache = cache_for(llama(hkv=2))
    before = looks(cache)
    with pytest.raises(dkhf.UnsupportedModelError, match="KV heads 1 .the cache: 2."):
        generate(llama(hkv=1), cache, ids, mask, max_new_tokens=2)
    assert looks(cache) == before


@pytest.mark.parametrize("call", [
    lambda c: c.reorder_cache([1.7, 0]),
    lambda c: c.batch_select_indices(torch.tensor([0.5, 1.0])),
    lambda c: c.reorder_cache(["1", "0"]),
    lambda c: c.batch_repeat_interleave(2.5),
    lambda c: c.check_request([1.5, 2], 3),
    lambda c: c.check_request([1, 2], 3.5),
], ids=["reorder-float", "select-float-tensor", "reorder-str", "repeat-float", "request-float", "request-new-float"])
def test_non_integer_batch_indices_and_counts_are_refused_not_truncated(call):
    model = llama()
    ids, mask = prompts([12, 9])
    cache = cache_for(model)
    generate(model, cache, ids, mask, max_new_tokens=2)
    before = looks(cache)
    with pytest.raises(TypeError, match="int"):
        call(cache)
    assert looks(cache) == before


def test_a_refusal_in_one_thread_never_touches_a_cache_another_thread_owns():
    from transformers import DynamicCache

    model = llama()
    ids, mask = prompts([12])
    cache = cache_for(model, max_batch_size=1)
    generate(model, cache, ids, mask, max_new_tokens=2)  # this thread's last update was to `cache`
    cache.reset()
    owned, leave = threading.Event(), threading.Event()

    def other():
        generate(model, cache, ids, mask, max_new_tokens=2)
        owned.set()
        leave.wait(60)

    t = threading.Thread(target=other)
    t.start()
    try:
        assert owned.wait(120)
        before = looks(cache)
        model.set_attn_implementation("directkv")
        with pytest.raises(RuntimeError, match="needs a directkv_cute.hf.DirectKVCache"), torch.no_grad():
            model(ids, attention_mask=mask, **dkhf.cache_kwargs(model, DynamicCache(config=model.config)))
        assert looks(cache) == before
    finally:
        model.set_attn_implementation("sdpa")
        leave.set()
        t.join(60)


@pytest.mark.parametrize("share", [True, False], ids=["shared-prompts", "separate"])
def test_a_fused_step_refused_at_layer_1_leaves_the_cache_as_it_was(share):
    torch.manual_seed(7)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=256, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=128, max_position_embeddings=1024)
    model = LlamaForCausalLM(cfg).eval().to(torch.bfloat16)
    dkhf.fuse_kv_projection(model)
    ids, mask = prompts([20, 13])
    kw = dict(max_new_tokens=4)

    def fresh_cache():
        return cache_for(model, dtype=torch.bfloat16, share_prompts=share)

    try:
        fresh = generate(model, fresh_cache(), ids, mask, **kw)
        cache = fresh_cache()
        generate(model, cache, ids[:, :-2], mask[:, :-2], max_new_tokens=1)
        before = holds(cache)
        model.model.layers[1].self_attn.train()
        with pytest.raises(dkhf.UnsupportedModelError, match="inference only"):
            generate(model, cache, ids, mask, **kw)
        assert holds(cache) == before
        model.eval()
        cache.reset()
        assert torch.equal(generate(model, cache, ids, mask, **kw), fresh)
    finally:
        dkhf.unfuse_kv_projection(model)


def test_beam_search_with_a_full_hbm_tier_forks_into_host_pages():
    """Each sequence's share of the HBM tier holds its recent pages, the partial last one
    included, so the tier is full when beams fork: the copies of the partial pages go to host
    pages instead of refusing the reorder."""
    from transformers import DynamicCache

    from directkv_cute.cache import page_bytes

    model = llama()
    ids, mask = prompts([40, 27])
    kw = dict(max_new_tokens=8, num_beams=3)
    ref = generate(model, DynamicCache(config=model.config), ids, mask, **kw)
    one = page_bytes(2, 2, 16, 16, torch.float32)
    cache = cache_for(model, max_batch_size=6, hbm_budget=4 * one, sink_pages=1)
    assert torch.equal(generate(model, cache, ids, mask, **kw), ref)
