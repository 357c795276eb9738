"""The fused K/V projection + RoPE + store op (``directkv_cute.kv_proj``) on the CPU: its reference
against independent computations (transformers' own linear + apply_rotary_pos_emb, a hand-written
float64 version), stores landing in exactly the right page rows and nowhere else, every
validation error, the config's legality, and the kernel compiling for sm_90a (a representative
part; the rest of the matrix is marked ``full``)."""

from __future__ import annotations

import re

import dataclasses

import pytest
import torch

from directkv_cute import kv_proj as K
from directkv_cute.cache import PagedKVCache
from directkv_cute.config import ConfigError
from directkv_cute.kernels import jit, specs

HKV, D = 2, 128  # small model shapes for the CPU tests (the kernel's are Hkv 8)
full = pytest.mark.full


def _inputs(randn, tokens, hidden=256, hkv=HKV, dtype=torch.bfloat16, bias=True):
    """x, w_k, w_v, b_k, b_v, cos, sin: random, scaled like a model's (unit-variance outputs)."""
    scale = hidden ** -0.5
    x = randn(tokens, hidden, dtype=dtype)
    w_k = (randn(hkv * D, hidden) * scale).to(dtype)
    w_v = (randn(hkv * D, hidden) * scale).to(dtype)
    b_k = randn(hkv * D, dtype=dtype) if bias else None
    b_v = randn(hkv * D, dtype=dtype) if bias else None
    cos, sin = _rope_tables(torch.arange(tokens) * 7 + 3, dtype)
    return x, w_k, w_v, b_k, b_v, cos, sin


def _rope_tables(positions, dtype, base=500000.0):
    """(T, d) cos and sin of the NeoX layout (the frequencies repeated over both halves)."""
    inv = 1.0 / base ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    freqs = positions.double()[:, None] * inv[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _mant_bits(dtype) -> int:
    return {torch.bfloat16: 7, torch.float16: 10}[dtype]


def ulp(t: torch.Tensor) -> torch.Tensor:
    """One ulp of ``t``'s dtype at |t|, as float64."""
    m = _mant_bits(t.dtype)
    tiny = torch.finfo(t.dtype).tiny
    a = t.double().abs().clamp_min(tiny)
    return torch.exp2(torch.floor(torch.log2(a)) - m)


def _hand_fp64(x, w_k, w_v, b_k, b_v, cos, sin, hkv=HKV):
    """K (after RoPE) and V computed in float64 with an explicit rounding to the model dtype
    wherever transformers rounds: independent of the reference's code (other summation order,
    no torch elementwise ops in the model dtype)."""
    dt = x.dtype
    r = lambda t: t.to(dt).double()  # noqa: E731
    xd = x.double()

    def linear(w, b):
        y = (xd[:, None, :] * w.double()[None, :, :]).sum(-1)  # (T, Hkv d)
        if b is not None:
            y = y + b.double()
        return r(y).view(x.shape[0], hkv, D)

    k, v = linear(w_k, b_k), linear(w_v, b_v)
    c, s = cos.double()[:, None, :], sin.double()[:, None, :]
    h = D // 2
    lo, hi = k[..., :h], k[..., h:]
    out_lo = r(r(lo * c[..., :h]) - r(hi * s[..., :h]))
    out_hi = r(r(hi * c[..., h:]) + r(lo * s[..., h:]))
    return torch.cat((out_lo, out_hi), -1).to(dt), v.to(dt)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
def test_reference_equals_a_hand_written_float64_version(randn, dtype, bias):
    args = _inputs(randn, 23, dtype=dtype, bias=bias)
    k, v = K.project_reference(*args, HKV, D)
    k2, v2 = _hand_fp64(*args)
    assert k.dtype == v.dtype == dtype and k.shape == v.shape == (23, HKV, D)
    assert torch.equal(k, k2) and torch.equal(v, v2)
    assert not torch.isnan(k).any() and k.abs().max() > 0.5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
def test_reference_matches_transformers(randn, dtype, bias):
    """transformers' own math on transformers' own cos/sin: its apply_rotary_pos_emb on the
    reference's linear output is bit-equal to the reference's K; its F.linear with fp32
    accumulation (as on the GPU; done in float32 here, since some CPU builds accumulate fp16
    matmuls in fp16) differs from the float64 dot products by at most one ulp plus the fp32
    summation's error bound (hidden x 2^-24 x the sum of |terms|: outputs near zero)."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    tokens, hidden = 19, 256
    x, w_k, w_v, b_k, b_v, _, _ = _inputs(randn, tokens, hidden, dtype=dtype, bias=bias)
    config = LlamaConfig(hidden_size=hidden, num_attention_heads=hidden // D, num_key_value_heads=HKV, head_dim=D,
                         rope_theta=500000.0, max_position_embeddings=4096)
    rope = llama.LlamaRotaryEmbedding(config=config)
    position_ids = torch.arange(100, 100 + tokens)[None]
    cos, sin = rope(x[None], position_ids)  # (1, T, d) in x's dtype
    assert cos.dtype == dtype and cos.shape == (1, tokens, D)
    k, v = K.project_reference(x, w_k, w_v, b_k, b_v, cos[0], sin[0], HKV, D)

    # The linear output alone: cos 1, sin 0 leave it as it is (k * 1 + 0).
    lin_k, _ = K.project_reference(x, w_k, w_v, b_k, b_v, torch.ones_like(cos[0]), torch.zeros_like(sin[0]), HKV, D)
    q = torch.zeros(1, 1, tokens, D, dtype=dtype)
    _, k_hf = llama.apply_rotary_pos_emb(q, lin_k.transpose(0, 1)[None], cos, sin)  # (1, Hkv, T, d)
    assert torch.equal(k_hf[0].transpose(0, 1), k)

    for w, b, ours in ((w_k, b_k, lin_k), (w_v, b_v, v)):
        theirs = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
        theirs = theirs.to(dtype).view(tokens, HKV, D)
        terms = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
        bound = ulp(ours) + hidden * 2.0**-24 * terms.view(tokens, HKV, D)
        gap = (theirs.double() - ours.double()).abs()
        assert (gap <= bound).all(), (gap - bound).max()
        assert (gap <= ulp(ours)).float().mean() > 0.99  # the bound's slack is for a few near zero


def _poisoned_pool(pages, layers, page_size, dtype=torch.bfloat16, hkv=HKV):
    return torch.full((pages, layers, hkv, 2, page_size, D), float("nan"), dtype=dtype)


def _check_stores(pool, layer, slots, k, v):
    """Every token with a slot >= 0 has its K and V rows there; every other element is still NaN."""
    P = pool.shape[4]
    written = torch.zeros(pool.shape[:5], dtype=torch.bool)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        page, row = divmod(s, P)
        assert torch.equal(pool[page, layer, :, 0, row], k[t]), (t, s)
        assert torch.equal(pool[page, layer, :, 1, row], v[t]), (t, s)
        written[page, layer, :, :, row] = True
    assert torch.isnan(pool[~written]).all()


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("dtype, bias", [(torch.bfloat16, True), (torch.float16, False)])
def test_stores_land_in_their_rows_and_nowhere_else(randn, gen, page_size, dtype, bias):
    """Ragged runs across page boundaries in random (non-contiguous) pages, tokens skipped in one
    destination or the other, both pools and the dense outputs at once."""
    tokens, layers, layer = 53, 3, 1
    args = _inputs(randn, tokens, dtype=dtype, bias=bias)
    host = _poisoned_pool(11, layers, page_size, dtype)
    hbm = _poisoned_pool(7, layers, page_size, dtype)
    # Host: a run starting mid-page, crossing into pages in a random order; some tokens skipped.
    order = torch.randperm(11, generator=gen)
    pos = torch.arange(tokens) + page_size - 5
    host_slots = order[pos // page_size] * page_size + pos % page_size
    host_slots[torch.tensor([0, 9, 30])] = -1
    # HBM: only the last 20 tokens (a window), in two pages of its own order.
    hbm_slots = torch.full((tokens,), -1, dtype=torch.int64)
    tail = torch.arange(20)
    hbm_slots[-20:] = torch.tensor([6, 2])[(tail + 3) // page_size % 2] * page_size + (tail + 3) % page_size
    out_k = torch.full((tokens, HKV, D), float("nan"), dtype=dtype)
    out_v = torch.full_like(out_k, float("nan"))
    got = K.kv_project(*args[:5], cos=args[5], sin=args[6], layer=layer, host=(host, host_slots),
                       hbm=(hbm, hbm_slots), out_k=out_k, out_v=out_v)
    k, v = K.project_reference(*args, HKV, D)
    assert got[0] is out_k and torch.equal(out_k, k) and torch.equal(out_v, v)
    _check_stores(host, layer, host_slots, k, v)
    _check_stores(hbm, layer, hbm_slots, k, v)


def test_page_and_row_form_equals_the_slot_form(randn):
    args = _inputs(randn, 20, bias=False)
    page = torch.tensor([3, 1, 0, 2])[torch.arange(20) // 5]
    page[::4] = -1
    row = torch.arange(20) * 7 % 16
    a, b = _poisoned_pool(4, 2, 16), _poisoned_pool(4, 2, 16)
    K.kv_project(*args[:5], cos=args[5], sin=args[6], layer=1, host=(a, page, row))
    slots = torch.where(page >= 0, page * 16 + row, -1)
    K.kv_project_reference(*args[:5], cos=args[5], sin=args[6], layer=1, host=(b, slots))
    assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    k, v = K.project_reference(*args, HKV, D)
    _check_stores(a, 1, slots, k, v)


def test_a_cache_step_through_its_token_slots(randn):
    """Integration with PagedKVCache: the tokens of two sequences (one partly in HBM) written
    through ``cache_destinations`` read back with ``cache.read`` as the reference's K and V."""
    cache = PagedKVCache(num_layers=2, num_kv_heads=HKV, head_dim=D, page_size=16, num_host_pages=8,
                         num_hbm_pages=4, device="cpu")
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.extend(a, 21)
    cache.extend(b, 5, tier="hbm")
    cache.extend(b, 30)
    starts, counts = [3, 2], [18, 33]
    slots = cache.token_slots([a, b], starts, counts)
    args = _inputs(randn, sum(counts), bias=True)
    K.kv_project(*args[:5], cos=args[5], sin=args[6], layer=1, **K.cache_destinations(cache, slots))
    k, v = K.project_reference(*args, HKV, D)
    ka, va = cache.read(a, 1, 3, 21)
    kb, vb = cache.read(b, 1, 2, 35)
    assert torch.equal(torch.cat((ka, kb)), k) and torch.equal(torch.cat((va, vb)), v)


def test_a_step_with_hbm_window_mirrors_writes_both_copies(randn):
    """A step whose host pages have HBM window mirrors (``PagedKVCache.mirror``): one call writes
    each token to its host page and to the mirror, exactly as ``write_slots`` does, and a
    sequence with pages in the HBM tier (never mirrored) joins the same HBM slot list."""
    def build():
        cache = PagedKVCache(num_layers=2, num_kv_heads=HKV, head_dim=D, page_size=16, num_host_pages=8,
                             num_hbm_pages=3, device="cpu", num_window_pages=4)
        cache.host_pool.fill_(float("nan"))
        cache.hbm_pool.fill_(float("nan"))
        a, b = cache.add_sequence(), cache.add_sequence()
        cache.extend(a, 40)
        cache.extend(b, 20, tier="hbm")
        cache.mirror(a, 10, 30)
        return cache, cache.token_slots([a, b], [10, 0], [30, 20])

    args = _inputs(randn, 50, bias=False)
    ours, slots = build()
    dest = K.cache_destinations(ours, slots)
    assert set(dest) == {"host", "hbm"} and int((dest["hbm"][1] >= 0).sum()) == 50
    K.kv_project(*args[:5], cos=args[5], sin=args[6], layer=1, **dest)
    theirs, slots2 = build()
    k, v = K.project_reference(*args, HKV, D)
    theirs.write_slots(slots2, 1, k, v)
    for pool in ("host_pool", "hbm_pool"):
        assert torch.equal(getattr(ours, pool).nan_to_num(9.0), getattr(theirs, pool).nan_to_num(9.0)), pool


def test_no_tokens_is_a_no_op(randn):
    args = _inputs(randn, 0, bias=False)
    pool = _poisoned_pool(2, 1, 16)
    assert K.kv_project(*args[:5], cos=args[5], sin=args[6], host=(pool, torch.zeros(0, dtype=torch.int64))) == (
        None, None)
    assert torch.isnan(pool).all()


# ---- validation ------------------------------------------------------------------------------


def _good(randn, tokens=6):
    x, w_k, w_v, b_k, b_v, cos, sin = _inputs(randn, tokens, bias=True)
    pool = _poisoned_pool(2, 2, 16)
    slots = torch.arange(tokens, dtype=torch.int64) + 4
    return dict(x=x, w_k=w_k, w_v=w_v, b_k=b_k, b_v=b_v, cos=cos, sin=sin, layer=1, host=(pool, slots))


BAD = [
    ("x", lambda a: a["x"].float(), TypeError, "x has dtype torch.float32"),
    ("x", lambda a: a["x"][None], ValueError, r"x has shape \(1, 6, 256\), expected \(T, hidden\)"),
    ("x", lambda a: a["x"].t().contiguous().t(), ValueError, "x must be contiguous"),
    ("x", lambda a: [1, 2], TypeError, "x must be a torch.Tensor"),
    ("w_k", lambda a: a["w_k"][:, :128], ValueError, r"w_k has shape \(256, 128\), expected \(kv_heads \* head_dim, 256\)"),
    ("w_k", lambda a: a["w_k"].half(), TypeError, "w_k has dtype torch.float16, x has torch.bfloat16"),
    ("w_v", lambda a: a["w_v"][:128], ValueError, r"w_v has shape \(128, 256\), expected w_k's shape"),
    ("w_v", lambda a: a["w_v"].t().contiguous().t(), ValueError, "w_v must be contiguous"),
    ("b_k", lambda a: None, ValueError, "give both b_k and b_v, or neither"),
    ("b_v", lambda a: a["b_v"][:10], ValueError, r"b_v has shape \(10,\), expected \(kv_heads \* head_dim,\)"),
    ("cos", lambda a: a["cos"][:5], ValueError, r"cos has shape \(5, 128\), expected \(T, head_dim\)"),
    ("cos", lambda a: a["cos"][:, :127], ValueError, "head_dim\\) must be even"),
    ("sin", lambda a: a["sin"].float(), TypeError, "sin has dtype torch.float32"),
    ("sin", lambda a: a["sin"][None].expand(2, -1, -1), ValueError, r"sin has shape \(2, 6, 128\)"),
    ("layer", lambda a: 2, ValueError, "layer 2 is outside the pools' 2 layers"),
    ("layer", lambda a: True, TypeError, "layer must be an int"),
    ("host", lambda a: a["host"][0], TypeError, r"host must be \(pool, slots\) or \(pool, page_idx, row\)"),
    ("host", lambda a: (a["host"][0].half(), a["host"][1]), TypeError, "host pool has dtype torch.float16"),
    ("host", lambda a: (a["host"][0][:, :, :1], a["host"][1]), ValueError,
     r"host pool has shape \(2, 2, 1, 2, 16, 128\), expected \(pages, layers, 2, 2, page_size, 128\)"),
    ("host", lambda a: (a["host"][0][:, :, :, :, :8], a["host"][1]), ValueError, "host pool page size 8 must be one of"),
    ("host", lambda a: (a["host"][0][:0], a["host"][1]), ValueError, "host pool has no pages"),
    ("host", lambda a: (a["host"][0].transpose(0, 1).contiguous().transpose(0, 1), a["host"][1]), ValueError,
     "host pool must be contiguous"),
    ("host", lambda a: (a["host"][0], a["host"][1].int()), TypeError, "host slots must be int64"),
    ("host", lambda a: (a["host"][0], a["host"][1][:3]), ValueError, r"host slots has shape \(3,\), expected \(T,\)"),
    ("host", lambda a: (a["host"][0], a["host"][1] + 27), ValueError,
     r"host slots\[1\] = 32 is outside \[-1, 32\) \(2 pages of 16; -1 skips the token\)"),
    ("host", lambda a: (a["host"][0], a["host"][1] - 9), ValueError, r"host slots\[0\] = -5 is outside"),
    ("host", lambda a: (a["host"][0], a["host"][1] * 0 + 3), ValueError, "host slots name a cache row twice"),
    ("host", lambda a: (a["host"][0], torch.tensor([0, 1, -1, 3, 4, 2]), torch.zeros(6, dtype=torch.int64)),
     ValueError, r"host page_idx\[3\] = 3 is outside \[-1, 2\)"),
    ("host", lambda a: (a["host"][0], torch.zeros(6, dtype=torch.int64), torch.arange(6) + 12), ValueError,
     r"host row\[4\] = 16 is outside the page's rows \[0, 16\)"),
    ("hbm", lambda a: (_poisoned_pool(2, 3, 16), a["host"][1]), ValueError,
     "host pool .* and hbm pool .* differ past the page count"),
    ("out_k", lambda a: torch.zeros(6, HKV, D, dtype=torch.bfloat16), ValueError, "give both out_k and out_v"),
]


@pytest.mark.parametrize("name, mutate, exc, match", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
@pytest.mark.parametrize("fn", [K.kv_project, K.kv_project_reference], ids=["op", "reference"])
def test_every_validation_error(randn, fn, name, mutate, exc, match):
    args = _good(randn)
    args[name] = mutate(args)
    host = args["host"][0]
    with pytest.raises(exc, match=match):
        fn(**args)
    assert torch.isnan(host).all()  # nothing was written


def test_more_validation_errors(randn):
    args = _good(randn)
    with pytest.raises(ValueError, match="nothing to write: give host=, hbm= or out_k/out_v"):
        K.kv_project(**{**args, "host": None})
    out = torch.zeros(6, HKV, D, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out_k and out_v are the same memory"):
        K.kv_project(**args, out_k=out, out_v=out)
    with pytest.raises(ValueError, match=r"out_v has shape \(6, 2, 64\), expected \(T, kv_heads, head_dim\)"):
        K.kv_project(**args, out_k=out, out_v=out[..., :64].contiguous())
    with pytest.raises(ValueError, match=r"cos has shape \(6, 96\)"):
        K.kv_project(**{**args, "cos": args["cos"][:, :96].contiguous()})
    # Unchecked slots are still never written outside the page they name.
    pool, slots = args["host"]
    K.kv_project(**{**args, "host": (pool, slots[:1].expand(6) * 0, torch.arange(6) + 13)}, check_slots=False)
    k, v = K.project_reference(args["x"], args["w_k"], args["w_v"], args["b_k"], args["b_v"], args["cos"], args["sin"],
                               HKV, D)
    _check_stores(pool, 1, torch.tensor([13, 14, 15, -1, -1, -1]), k, v)


def test_the_cpu_op_takes_the_1_t_d_rotary_tables(randn):
    args = _good(randn)
    pool = args["host"][0]
    K.kv_project(**{**args, "cos": args["cos"][None], "sin": args["sin"][None]})
    k, v = K.project_reference(args["x"], args["w_k"], args["w_v"], args["b_k"], args["b_v"], args["cos"], args["sin"],
                               HKV, D)
    _check_stores(pool, 1, args["host"][1], k, v)


# ---- config ----------------------------------------------------------------------------------


def test_the_defaults_are_legal_for_every_supported_shape():
    for tokens in (1, 64, 65, 8192):
        cfg = K.default_kv_proj_config(tokens)
        for hidden in (4096, 8192):
            for page in (16, 64):
                assert cfg.problems(128, page, 2, hidden) == [], (tokens, hidden, page)
    assert K.default_kv_proj_config(64).tile_m == 64 and K.default_kv_proj_config(65).tile_m == 128


@pytest.mark.parametrize("cfg, args, message", [
    (K.KVProjConfig(), (64,), "head_dim 64: the kernel's N tile is one head of 128 columns"),
    (K.KVProjConfig(), (128, 16, 4), "4-byte elements"),
    (K.KVProjConfig(), (128, 8), "page_size 8 must be one of"),
    (K.KVProjConfig(), (128, 16, 2, 4000), "hidden 4000 must be a positive multiple of 64"),
    (K.KVProjConfig(tile_m=96), (), "tile_m 96 must be 64 or 128"),
    (K.KVProjConfig(consumer_wgs=3), (), "consumer_wgs 3 must be 1 or 2"),
    (K.KVProjConfig(tile_m=64, consumer_wgs=2, ctas_per_sm=1), (), "tile_m 64 over 2 warpgroups"),
    (K.KVProjConfig(ctas_per_sm=3), (), "ctas_per_sm 3 must be 1 or 2"),
    (K.KVProjConfig(consumer_wgs=2), (), "ctas_per_sm 2 needs consumer_wgs 1"),
    (K.KVProjConfig(stages=1), (), "stages 1 must be >= 2"),
    (K.KVProjConfig(splits=-1), (), "splits -1 must be >= 0"),
    (K.KVProjConfig(splits=65), (128, 16, 2, 4096), "splits 65 exceed the 64 blocks of hidden 4096"),
    (K.KVProjConfig(tile_m=128, stages=2), (), "the ring (65536 B) is smaller than the fp32 staging tile (69632 B)"),
    (K.KVProjConfig(tile_m=128, stages=4), (), "2 CTAs x 133120 B of SMEM exceed the 233472 B of an SM"),
    (K.KVProjConfig(tile_m=128, stages=8, ctas_per_sm=1), (), "263168 B of SMEM exceed the 232448 B of a block"),
])
def test_config_rules(cfg, args, message):
    problems = cfg.problems(*args)
    assert any(message in p for p in problems), problems
    with pytest.raises(ConfigError):
        cfg.check(*args)
    assert not cfg.is_legal(*args)


def test_config_round_trips_and_auto_splits():
    cfg = K.KVProjConfig(tile_m=64, stages=5, ctas_per_sm=1, splits=4)
    assert K.KVProjConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="unknown KVProjConfig fields"):
        K.KVProjConfig.from_dict({"tile_n": 64})
    # Decode: 16 tiles on 132 SMs -> 8 splits (8 blocks each at hidden 4096); many tiles -> 1.
    assert K.auto_splits(16, 64, 132) == 8 and K.auto_splits(16, 128, 132) == 8
    assert K.auto_splits(64, 64, 132) == 2 and K.auto_splits(128, 64, 132) == 1 and K.auto_splits(1024, 64, 132) == 1
    assert K.auto_splits(16, 4, 132) == 1  # a small hidden size is not split below 8 blocks


# ---- the registry and the compile ------------------------------------------------------------


def test_the_spec_and_its_key():
    spec = specs.get("kv_proj")
    assert spec.config_class is K.KVProjConfig and spec.compile_fn is jit.compile_kv_proj
    assert spec.key_fn is jit.kv_proj_key and spec.launch_fn is K.launch_kv_proj and not spec.tuned
    names = [f.name for f in dataclasses.fields(K.KVProjConfig)]
    assert sorted([*spec.codegen_fields, *(f for f, _ in spec.launch_fields)]) == sorted(names)
    base = K.default_kv_proj_config(1)
    key = lambda cfg, **kw: jit.kv_proj_key(cfg, torch.bfloat16, 4096, 8, 128, 64, True, True, True, False)  # noqa: E731
    assert key(dataclasses.replace(base, splits=5)) == key(base)
    for field in spec.codegen_fields:
        changed = dataclasses.replace(base, **{field: {"tile_m": 128, "consumer_wgs": 2, "stages": 3,
                                                       "ctas_per_sm": 1}[field]})
        assert key(changed) != key(base), field
    other = jit.kv_proj_key(base, torch.float16, 4096, 8, 128, 64, True, True, True, False)
    assert other != key(base)
    assert spec.problems(base, 128, 64) == base.problems(128, 64)


def test_compile_refuses_bad_requests():
    cfg = K.default_kv_proj_config(1)
    with pytest.raises(ConfigError, match="head_dim 64"):
        jit.compile_kv_proj(cfg, torch.bfloat16, 4096, 8, 64, 64, True, True, False, False)
    with pytest.raises(TypeError, match="dtype must be bfloat16 or float16"):
        jit.compile_kv_proj(cfg, torch.float32, 4096, 8, 128, 64, True, True, False, False)
    with pytest.raises(ValueError, match="must store somewhere"):
        jit.compile_kv_proj(cfg, torch.bfloat16, 4096, 8, 128, 0, True, False, False, False)
    with pytest.raises(ValueError, match="a pool needs its page size"):
        jit.compile_kv_proj(cfg, torch.bfloat16, 4096, 8, 128, 0, True, True, False, False)


@pytest.fixture
def keep_ptx(tmp_path, monkeypatch):
    """``cute.compile`` keeps each kernel's PTX (``fn.__ptx__``); a fresh compile cache."""
    import cutlass.cute as cute

    real = cute.compile
    monkeypatch.setattr(cute, "compile", lambda *a, **kw: real(*a, options=f"--keep-ptx --dump-dir={tmp_path}", **kw))
    monkeypatch.setenv("DIRECTKV_CACHE_DIR", str(tmp_path / "kc"))
    jit.clear_memory_cache()
    yield
    jit.clear_memory_cache()


COMPILE = [
    # (dtype, hidden, page, bias, host, hbm, out, tokens the default config is for)
    (torch.bfloat16, 4096, 64, True, True, True, False, 1),
    (torch.float16, 8192, 16, False, True, False, True, 8192),
]
COMPILE_FULL = [
    (dt, hidden, page, bias, True, hbm, False, tokens)
    for dt in (torch.bfloat16, torch.float16) for hidden in (4096, 8192) for page in (16, 64)
    for bias in (True, False) for hbm in (True, False) for tokens in (1, 8192)
]
COMPILE_FULL = [c for c in COMPILE_FULL if c not in COMPILE] + [
    (torch.bfloat16, 4096, 0, False, False, False, True, 1), (torch.bfloat16, 4096, 64, True, False, True, False, 512)]


@pytest.mark.compile
@pytest.mark.parametrize("dtype, hidden, page, bias, host, hbm, out, tokens", [
    *COMPILE, *(pytest.param(*c, marks=full) for c in COMPILE_FULL)])
def test_the_kernel_compiles_for_sm90a(keep_ptx, dtype, hidden, page, bias, host, hbm, out, tokens):
    cfg = K.default_kv_proj_config(tokens)
    fn = jit.compile_kv_proj(cfg, dtype, hidden, 8, 128, page, bias, host, hbm, out)
    ptx = fn.__ptx__
    rows = cfg.tile_m // cfg.consumer_wgs
    name = {torch.bfloat16: "bf16", torch.float16: "f16"}[dtype]
    # WGMMA over one head (N = 128) per 16 hidden columns, TMA loads of X and both W.
    assert ptx.count(f"wgmma.mma_async.sync.aligned.m64n128k16.f32.{name}.{name}") == rows // 64 * 4
    assert ptx.count("cp.async.bulk.tensor.2d") == 3
    assert f".minnctapersm {cfg.ctas_per_sm}" in ptx and "setmaxnreg.inc" in ptx
    # Split-K: one acq_rel atomic per CTA on the tile counter.
    assert ptx.count("atom.global.acq_rel.add") == 1  # .gpu is the default scope
    # 16-byte stores of two row pieces per destination and step, in the K and the V epilogue,
    # plus the split partial; no store narrower than 16 bytes besides the counter reset.
    dests = int(host) + int(hbm) + int(out)
    steps = cfg.tile_m * 8 // (128 * cfg.consumer_wgs)
    partial = rows // 4  # a thread's rows x 128 / 128 fp32 accumulators, 4 a store
    assert ptx.count("st.global.v4.b32") == 2 * 2 * dests * steps + partial
    assert ptx.count("st.global.b32") == 1 and "st.global.b16" not in ptx and "st.global.v2" not in ptx
    # RoPE rounds each product to the model dtype as torch does: 4 x 8 explicitly rounded fp32
    # products per step, and no model-dtype multiply (ptxas may fuse one without a rounding
    # modifier into an FMA with the following add).
    assert ptx.count("mul.rn.f32") == 4 * 8 * steps
    assert not re.search(rf"\b(mul|fma)(\.[a-z]+)*\.{name}(x2)?\b", ptx)
    assert jit.compile_kv_proj(cfg, dtype, hidden, 8, 128, page, bias, host, hbm, out) is fn  # cached
