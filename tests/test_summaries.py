"""Page summaries (``PagedKVCache(..., summaries=True)``, ``cache/summaries.py``) on CPU caches:
after every write path and page operation, each page's summary equals the sum and sum of squares
recomputed from the pools' K rows of that page over the rows its sequences have written (an independent
reference, below), for both tiers, the window mirrors, FP8 pages, GQA and 16-bit dtypes; pages
handed out and not written are empty; a cache without summaries allocates none."""

from __future__ import annotations

import math
import random

import pytest
import torch

from directkv_cute import kv_proj
from directkv_cute.cache import PagedKVCache, decode_page, encode_page
from directkv_cute.cache.pages import PageBook
from directkv_cute.cache.summaries import SQUARES, SUM, PageSummaries, page_moments
from directkv_cute.sparse import SparseBudget

P = 16


def make(layers=2, hkv=2, d=8, host=24, hbm=8, window=4, dtype=torch.bfloat16, compute_dtype=None, **kw):
    return PagedKVCache(layers, hkv, d, P, host, hbm, dtype=dtype, device="cpu", num_window_pages=window,
                        compute_dtype=compute_dtype, summaries=True, **kw)


class Data:
    """Random K/V in the cache's compute dtype, each draw with its own offset and spread, so that
    the extremes of a page come from different writes."""

    def __init__(self, cache: PagedKVCache, seed: int) -> None:
        self.cache, self.g = cache, torch.Generator().manual_seed(seed)

    def kv(self, *lead: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cache
        shape = (*lead, c.num_kv_heads, c.head_dim)
        scale, shift = 0.5 + 3 * torch.rand((), generator=self.g), torch.randn((), generator=self.g)
        k = torch.randn(shape, generator=self.g) * scale + shift
        v = torch.randn(shape, generator=self.g)
        return k.to(c.compute_dtype), v.to(c.compute_dtype)

    def append(self, sid: int, n: int, tier: str = "host") -> None:
        self.cache.append(sid, *self.kv(n, self.cache.num_layers), tier=tier)

    def write(self, sid: int, start: int, n: int, chunks: int = 1) -> None:
        """Every layer of tokens [start, start + n) (allocated), in ``chunks`` pieces written last
        piece first (a page's first write then lands past its row 0)."""
        bounds = [start + n * i // chunks for i in range(chunks + 1)]
        for a, b in reversed(list(zip(bounds, bounds[1:]))):
            for layer in range(self.cache.num_layers):
                self.cache.write(sid, layer, a, *self.kv(b - a))

    def prompt(self, sid: int, n: int, tier: str = "host", chunks: int = 2) -> None:
        start = self.cache.extend(sid, n, tier)
        self.write(sid, start, n, chunks)


def k_rows(cache: PagedKVCache, entry: int, rows: int) -> torch.Tensor:
    """K rows [0, rows) of a page as the summaries take them: (L, Hkv, rows, d) in float32; FP8:
    the stored bytes times their scales."""
    tier, i = decode_page(entry)
    k = cache.device_pool(tier)[i, :, :, 0, :rows]
    if not cache.fp8:
        return k.float()
    return k.float() * cache.device_scales(tier)[i, :, :, 0, :rows, None].float()


def assert_sums(got: torch.Tensor, k: torch.Tensor, what=()) -> None:
    """``got`` (..., 2, d) holds the sum and the sum of squares of ``k`` (..., rows, d) over its rows."""
    k = k.double()
    torch.testing.assert_close(got[..., SUM, :].double(), k.sum(-2), rtol=1e-5, atol=1e-4, msg=lambda m: f"{what} {m}")
    torch.testing.assert_close(got[..., SQUARES, :].double(), (k * k).sum(-2), rtol=1e-5, atol=1e-4,
                               msg=lambda m: f"{what} {m}")


def summary(cache: PagedKVCache, entry: int) -> torch.Tensor:
    tier, i = decode_page(entry)
    return cache.summaries.pool(tier)[i]


def check(cache: PagedKVCache, unwritten: dict[int, int] | None = None, rewritten: tuple = ()) -> int:
    """Every page of every live sequence (and its window mirror) against the sum and sum of
    squares of its rows below the sequence's length (``unwritten``: sequence -> first token not
    written, for sequences extended past what they wrote; ``rewritten``: pages some of whose rows
    were written twice, whose sum of squares counts both writes: at least its rows'). Returns the
    pages checked."""
    s = cache.summaries
    assert s.dtype == torch.float32 and s.host.dtype == s.hbm.dtype == torch.float32
    checked = 0
    for sid in cache.seq_ids:
        n = (unwritten or {}).get(sid, cache.seq_len(sid))
        mirrors = cache.mirrored_pages(sid)
        for lp, entry in enumerate(cache.page_table(sid)):
            rows = min(P, n - lp * P)
            targets = [entry] + ([encode_page("hbm", mirrors[lp])] if lp in mirrors else [])
            for e in targets:
                got = summary(cache, e)
                if rows <= 0:
                    assert (got == 0).all(), (sid, lp)
                    continue
                k = k_rows(cache, e, rows)  # each copy from its own pool: the mirror's data too
                if e in rewritten:
                    assert (got[..., SQUARES, :] >= (k * k).sum(dim=2) * (1 - 1e-5) - 1e-4).all(), (sid, lp, e)
                    continue
                assert_sums(got, k, (sid, lp, e))
                checked += 1
    return checked


def estimate(q: torch.Tensor, rows: torch.Tensor, scale: float) -> torch.Tensor:
    """The estimated logit of a page for a query ``q`` (d,) from the page's K rows ``rows``
    (..., n, d) in float64: ``scale * q . mean + scale**2 / 2 * q**2 . var`` (population
    variance), the test's own."""
    rows, q = rows.double(), q.double()
    mean, var = rows.mean(-2), rows.var(-2, unbiased=False)
    return scale * (mean @ q) + scale**2 / 2 * (var @ (q * q))


# ---- the write paths ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, hkv, group", [(torch.bfloat16, 2, 4), (torch.float16, 1, 8), (torch.bfloat16, 4, 1)],
                         ids=["bf16-gqa4", "fp16-mqa", "bf16-mha"])
def test_appends_prompt_writes_and_decode_across_pages(dtype, hkv, group):
    """Ragged appends, prompts written layer by layer in pieces, then decode appends of one token
    that cross page boundaries; every query head of a KV head's group gets the same estimated
    logit per full page from the summaries (``sparse.page_scores``' ingredients) as from the
    page's rows."""
    cache = make(layers=3, hkv=hkv, dtype=dtype)
    data = Data(cache, seed=1)
    seqs = [cache.add_sequence() for _ in range(3)]
    for sid, n in zip(seqs, (1, 17, 40)):
        data.append(sid, n)
    check(cache)
    p = cache.add_sequence()
    data.prompt(p, 37, chunks=3)
    seqs.append(p)
    assert check(cache) == sum(-(-cache.seq_len(s) // P) for s in seqs) > 0
    for _ in range(20):
        for sid in seqs:
            data.append(sid, 1)
    check(cache)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(group * hkv, cache.head_dim, generator=g)  # one decode row's query heads
    scale = cache.head_dim ** -0.5
    full = 0
    for sid in seqs:
        k, _ = cache.read(sid, None)  # (n, L, Hkv, d)
        for lp, entry in enumerate(cache.page_table(sid)[: cache.seq_len(sid) // P]):
            rows = k[lp * P:(lp + 1) * P]  # (P, L, Hkv, d)
            moments = page_moments(summary(cache, entry), P)  # (L, Hkv, 2, d)
            mean, var = moments[..., SUM, :], moments[..., SQUARES, :]
            for h in range(group * hkv):
                kvh = h // group
                got = scale * (mean[:, kvh] @ q[h]) + scale**2 / 2 * (var[:, kvh] @ (q[h] * q[h]))  # (L,)
                want = estimate(q[h], rows[:, :, kvh].transpose(0, 1), scale)  # (L,)
                torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
                full += 1
    assert full > 0


def test_fork_and_divergent_appends_copy_on_write():
    """A fork shares full pages (their summaries shared) and copies the partial last page (its
    summary copied); divergent appends leave each sequence's pages summarizing its own rows; a
    write into a shared page gives the writer a copy (summary included) whose summary then counts both
    its old and new rows, while the other sharer's page stays exact; a fork at a prefix shares
    only those pages."""
    cache = make()
    data = Data(cache, seed=3)
    a = cache.add_sequence()
    data.append(a, 40)
    b = cache.fork(a)
    assert cache.page_table(a)[:2] == cache.page_table(b)[:2] and cache.page_table(a)[2] != cache.page_table(b)[2]
    check(cache)
    data.append(a, 13)
    data.append(b, 30)
    check(cache)
    shared = cache.page_table(b)[0]
    data.write(b, 3, 5)  # into a page b shares with a: b gets its own copy first
    copy = cache.page_table(b)[0]
    assert copy != shared == cache.page_table(a)[0]
    check(cache, rewritten=(copy,))
    c = cache.fork(b, 32)
    data.append(c, 20)
    data.append(b, 1)
    check(cache, rewritten=(copy,))


def test_truncate_recomputes_the_partial_last_page():
    """Rows past a truncation no longer count: the new last page's summary equals its remaining
    rows' sums exactly (the removed rows held the extremes), also where the page was shared
    (copied first) or mirrored; appends after it merge from there."""
    cache = make()
    data = Data(cache, seed=4)
    a = cache.add_sequence()
    data.append(a, 20)
    k, v = data.kv(4, cache.num_layers)
    cache.append(a, k * 0 + 1000, v)  # extremes in rows 4..7 of page 1 (tokens 20..23)
    cache.append(a, k * 0 - 1000, v)  # and rows 8..11
    cache.truncate(a, 20)
    assert summary(cache, cache.page_table(a)[1]).abs().max() < 1000
    check(cache)
    data.append(a, 30)
    b = cache.fork(a, 48)
    cache.truncate(b, 37)  # the shared page 2 becomes b's partial last page: copied, then recomputed
    assert cache.page_table(b)[2] != cache.page_table(a)[2]
    check(cache)
    cache.truncate(a, 32)  # on a page boundary: the kept pages are full
    check(cache)
    assert cache.mirror(b, 30, 7) == 2
    cache.truncate(b, 35)  # the mirrored last page: host page and mirror recomputed alike
    check(cache)
    data.append(b, 9)
    data.append(a, 3)
    check(cache)


def test_freed_pages_reused_start_empty():
    """Pages a new sequence gets back from a freed one start empty, whatever row its first write
    lands in; pages extended and not yet written are empty (zero sums)."""
    cache = make(host=6, hbm=0, window=0)
    data = Data(cache, seed=5)
    a = cache.add_sequence()
    data.append(a, 6 * P)
    pages = set(cache.page_table(a))
    cache.free(a)
    b = cache.add_sequence()
    cache.extend(b, 5 * P - 3)
    assert set(cache.page_table(b)) <= pages
    check(cache, unwritten={b: 0})
    for entry in cache.page_table(b):
        assert (summary(cache, entry) == 0).all()
    data.write(b, 20, 30, chunks=3)  # tokens 40..49 first, then 30..39, 20..29: pages 1 and 2 begin mid-page
    data.write(b, 0, 20)
    data.write(b, 50, 5 * P - 3 - 50)
    check(cache)


def test_hbm_tier_fraction_and_moves():
    """Pages placed in the HBM tier by ``extend``, ``set_hbm_fraction`` (both placements) and
    ``move_pages`` carry their summaries, for every sharer of a moved page."""
    cache = make(host=20, hbm=12)
    data = Data(cache, seed=6)
    a = cache.add_sequence()
    data.append(a, 50, tier="hbm")
    data.append(a, 30)
    b = cache.fork(a)
    check(cache)
    cache.set_hbm_fraction(a, 0.5, "strided")
    check(cache)
    cache.set_hbm_fraction(a, 0.25, "recent")
    check(cache)
    cache.move_pages(b, [0, 1, 4], "hbm")
    cache.move_pages(a, [2, 3], "host")
    assert any(e < 0 for e in cache.page_table(a)) and any(e >= 0 for e in cache.page_table(a))
    check(cache)
    data.append(a, 21)
    data.append(b, 5, tier="hbm")
    check(cache)


@pytest.mark.parametrize("defer", [False, True])
def test_window_mirrors_and_batched_slots(defer):
    """A batch stored through ``token_slots`` / ``write_slots`` into host pages, HBM pages and
    window mirrors (the copy engine's copy-back or not): the mirror's summary is its host page's,
    and the entries of ``kernel_tables`` (which name the mirrors) index the right summaries."""
    cache = make(layers=3)
    data = Data(cache, seed=7)
    a, b, c = (cache.add_sequence() for _ in range(3))
    data.append(a, 21)
    data.append(b, 5, tier="hbm")
    start = cache.extend(a, 40)
    cache.extend(b, 30, tier="hbm")
    cache.extend(c, 19)
    assert cache.mirror(a, start, 40) == 3 and cache.mirror(c, 0, 19) == 1  # a's page 1 copied, the rest fresh
    slots = cache.token_slots([a, b, c], [start, 5, 0], [40, 30, 19])
    assert slots.mirrored
    for layer in range(cache.num_layers):
        cache.write_slots(slots, layer, *data.kv(slots.total), defer_host=defer)
    check(cache)
    tables = cache.kernel_tables([a, b, c])
    for row, sid in zip(tables.host_table, (a, b, c)):
        k, _ = cache.read(sid, None)
        for lp in range(-(-cache.seq_len(sid) // P)):
            got = summary(cache, int(row[lp]))
            rows = k[lp * P:(lp + 1) * P]  # (rows, L, Hkv, d)
            assert_sums(got, rows.movedim(0, 2), (sid, lp))
    assert (tables.host_table < 0).any()
    cache.release_mirrors(a)
    data.append(a, 3)
    check(cache)


@pytest.mark.parametrize("dtype, compute", [(torch.float8_e4m3fn, torch.bfloat16), (torch.float8_e5m2, torch.float16)],
                         ids=["e4m3-bf16", "e5m2-fp16"])
def test_fp8_pages_summarize_the_dequantized_k(dtype, compute):
    """FP8 pages: float32 summaries of the stored bytes times their token scales, through
    appends, slot stores with mirrors, forks, moves and truncation."""
    cache = make(dtype=dtype, compute_dtype=compute)
    assert cache.summaries.dtype == torch.float32
    data = Data(cache, seed=8)
    a = cache.add_sequence()
    data.append(a, 35)
    data.prompt(a, 20, tier="hbm")
    start = cache.extend(a, 25)
    cache.mirror(a, start, 25)
    slots = cache.token_slots([a], [start], [25])
    for layer in range(cache.num_layers):
        cache.write_slots(slots, layer, *data.kv(25), defer_host=True)
    check(cache)
    b = cache.fork(a)
    cache.move_pages(b, [0, 4], "hbm")
    cache.truncate(a, 70)
    data.append(b, 11)
    check(cache)
    k, _ = cache.read(a, None)  # the dequantized values the kernels use, in the compute dtype
    first = summary(cache, cache.page_table(a)[0])
    rows = k[:P].float()  # rounded to the compute dtype: half an ulp of each row's value apart
    assert ((first[..., SUM, :] - rows.sum(0)).abs() <= 2**-7 * rows.abs().sum(0) + 1e-6).all()


def test_fused_projection_refresh():
    """``kv_project`` (the torch reference on the CPU) storing into ``write_destinations``, with
    and without ``defer_host``, then ``refresh_summaries``: the rows it stored are merged (host
    pages read back, mirrored and HBM tokens read from HBM)."""
    for defer in (False, True):
        cache = make(layers=2, hkv=2, d=16, dtype=torch.bfloat16)
        data = Data(cache, seed=9)
        a, b = cache.add_sequence(), cache.add_sequence()
        data.append(a, 10)
        start = cache.extend(a, 50)
        cache.extend(b, 20, tier="hbm")
        cache.mirror(a, 40, 20)
        slots = cache.token_slots([a, b], [start, 0], [50, 20])
        g = torch.Generator().manual_seed(10)
        hidden, hd = 32, cache.num_kv_heads * cache.head_dim
        x = torch.randn(slots.total, hidden, generator=g).bfloat16()
        cos, sin = torch.randn(2, slots.total, cache.head_dim, generator=g).bfloat16()
        for layer in range(cache.num_layers):
            w_k = (torch.randn(hd, hidden, generator=g) * (layer + 1)).bfloat16()
            w_v = torch.randn(hd, hidden, generator=g).bfloat16()
            kv_proj.kv_project(x, w_k, w_v, cos=cos, sin=sin, layer=layer,
                               **cache.write_destinations(slots, defer))
            before = cache.summaries.host.clone()
            cache.refresh_summaries(slots, layer)
            assert not torch.equal(before, cache.summaries.host)
            if defer:
                cache.copy_mirrors_to_host(slots, layer)
        check(cache)


def test_fused_generation_keeps_summaries():
    """The transformers integration with the fused projection (``Step.store_fused``: ``kv_project``
    then ``refresh_summaries``): after a chunked prefill of ragged prompts and decode steps
    through the window (host pages, mirrors, the copy engine's copy-back), every page's summary
    is right."""
    transformers = pytest.importorskip("transformers")
    import directkv_cute.hf as dkhf  # transformers only where this test runs

    torch.manual_seed(11)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                                   max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(cfg).eval().to(torch.bfloat16)
    ids = torch.randint(1, 128, (2, 37))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    assert dkhf.fuse_kv_projection(model) == 2
    try:  # a budget of every page: summaries kept, decode exact
        cache = dkhf.DirectKVCache(model, max_tokens=64, max_batch_size=2, device="cpu", page_size=P,
                                   dtype=torch.bfloat16, window_tokens=32, share_prompts=False,
                                   sparse=SparseBudget(fraction=1.0))
        model.set_attn_implementation("directkv")
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, pad_token_id=0, max_new_tokens=6, do_sample=False,
                           prefill_chunk_size=16, **dkhf.cache_kwargs(model, cache))
    finally:
        model.set_attn_implementation("sdpa")
        dkhf.unfuse_kv_projection(model)
    assert cache.kv.summaries is not None and cache.seq_lengths() == [42, 33]
    assert check(cache.kv) == 3 + 3 + 2  # every page, and the mirrors of the two partial last pages


def test_random_operations_keep_every_summary():
    """A seeded random mix of every operation, checked after each."""
    rng = random.Random(12)
    cache = make(layers=2, hkv=2, host=40, hbm=16, window=6)
    data = Data(cache, seed=13)
    live: list[int] = []
    for step in range(120):
        op = rng.choice(["add", "append", "append", "decode", "prompt", "fork", "fork_prefix", "truncate", "free",
                         "move", "fraction", "slots", "mirror_release"])
        try:
            if op == "add" or not live:
                live.append(cache.add_sequence())
                data.append(live[-1], rng.randint(1, 40), tier=rng.choice(["host", "hbm"]))
                continue
            sid = rng.choice(live)
            n = cache.seq_len(sid)
            if op == "append":
                data.append(sid, rng.randint(1, 30), tier=rng.choice(["host", "hbm"]))
            elif op == "decode":
                data.append(sid, 1)
            elif op == "prompt":
                data.prompt(sid, rng.randint(1, 40), chunks=rng.randint(1, 3))
            elif op == "fork":
                live.append(cache.fork(sid))
            elif op == "fork_prefix" and n >= P:
                live.append(cache.fork(sid, P * rng.randint(1, n // P)))
            elif op == "truncate":
                cache.truncate(sid, rng.randint(0, n))
            elif op == "free":
                cache.free(sid)
                live.remove(sid)
            elif op == "move" and n:
                pages = rng.sample(range(-(-n // P)), rng.randint(1, -(-n // P)))
                cache.move_pages(sid, pages, rng.choice(["host", "hbm"]))
            elif op == "fraction" and n:
                cache.set_hbm_fraction(sid, rng.random(), rng.choice(["recent", "strided"]))
            elif op == "slots":
                m = rng.randint(1, 30)
                start = cache.extend(sid, m)
                cache.mirror(sid, start, m)
                slots = cache.token_slots([sid], [start], [m])
                for layer in range(cache.num_layers):
                    cache.write_slots(slots, layer, *data.kv(m), defer_host=rng.random() < 0.5)
            elif op == "mirror_release":
                cache.release_mirrors(sid, keep_partial=rng.random() < 0.5)
        except ValueError as exc:  # CacheCapacityError: the cache is unchanged
            assert "cannot" in str(exc) or "pages" in str(exc), exc
        check(cache)


# ---- bytes, and a cache without summaries ------------------------------------------------------------


@pytest.mark.parametrize("dtype, share", [(torch.bfloat16, 2), (torch.float16, 2), (torch.float8_e4m3fn, 4)])
def test_bytes_are_two_page_size_ths_of_the_kv(dtype, share):
    """``2 * d`` float32 per (page, layer, KV head) against ``2 * P * d`` elements of K/V: 2/P of
    16-bit pages, 4/P of FP8 pages; both tiers and the window covered, empty."""
    cache = make(layers=3, hkv=2, d=64, host=10, hbm=3, window=2, dtype=dtype)
    s = cache.summaries
    assert s.bytes_per_page * P == share * cache.page_data_bytes
    assert s.host.shape == (10, 3, 2, 2, 64) and s.hbm.shape == (5, 3, 2, 2, 64)
    assert s.nbytes == 15 * s.bytes_per_page
    assert s.host.device == s.hbm.device == cache.device
    for t in (s.host, s.hbm):
        assert (t == 0).all()


def test_off_allocates_and_computes_nothing():
    """``summaries=False`` (the default): no summaries, the page book without the summaries' hooks,
    and ``refresh_summaries`` does nothing."""
    cache = PagedKVCache(2, 2, 8, P, 8, 2, dtype=torch.bfloat16, device="cpu", num_window_pages=2)
    assert cache.summaries is None
    book = cache._book
    assert book.fresh_pages is PageBook.__init__.__defaults__[-1]
    assert book.copy_page == cache._pools.copy_page
    a = cache.add_sequence()
    cache.append(a, torch.randn(20, 2, 2, 8).bfloat16(), torch.randn(20, 2, 2, 8).bfloat16())
    cache.mirror(a, 16, 4)
    slots = cache.token_slots([a], [16], [4])
    cache.refresh_summaries(slots, 0)
    assert not any(isinstance(v, PageSummaries) or (isinstance(v, torch.Tensor) and v.shape[-2:] == (2, 8)
                                                     and v.dim() == 5) for v in vars(cache).values())
    with pytest.raises(TypeError, match="summaries must be a bool"):
        PagedKVCache(2, 2, 8, P, 8, dtype=torch.bfloat16, device="cpu", summaries=1)
