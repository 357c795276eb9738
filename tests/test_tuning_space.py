"""Search space, static legality filter, space hash, registry and model presets (CPU only)."""

import dataclasses
import hashlib
import json
import subprocess
import sys

import pytest

from directkv_cute.config import SM90_SMEM_PER_BLOCK_OPTIN, DecodeConfig
from directkv_cute.tuning import presets
from directkv_cute.tuning.space import DecodeSpace, KernelSpace, Param, TuneShape, get_space, kernels, register_space, \
    torch_dtype

SHAPE = TuneShape(num_q_heads=64, num_kv_heads=8, head_dim=128, batch=4, context=16384)


def test_shape_fields():
    assert SHAPE.group == 8 and SHAPE.rows == 8 and SHAPE.elem_bytes == 2
    assert SHAPE.bucket == (4, 16384, 1)
    assert SHAPE.class_key == ("bf16", 128, 8, 64)
    assert SHAPE.kv_bytes() == 2 * 4 * 16384 * 8 * 128 * 2
    assert TuneShape(8, 8, 64, 1, 10, dtype="torch.float16").dtype == "fp16"
    with pytest.raises(ValueError):
        TuneShape(12, 8, 128, 1, 4096)  # heads not a multiple
    with pytest.raises(ValueError):
        TuneShape(8, 8, 128, 0, 4096)
    with pytest.raises(ValueError):
        TuneShape(8, 8, 128, 1, 4096, dtype="fp8")


def test_legality_partitions_the_space_with_reasons():
    space = get_space("decode")
    rep = space.legality(SHAPE)
    assert rep.total == space.cardinality() == 3 * 7 * 8 * 4 * 6
    assert len(rep.legal) + len(rep.illegal) == rep.total
    assert 0 < rep.legal_count < rep.total
    for cfg in rep.legal:
        assert cfg.is_legal(128, 64) and cfg.consumer_wgs == 1
        assert cfg.smem_bytes(128) <= SM90_SMEM_PER_BLOCK_OPTIN and cfg.resident_ctas(128) >= 1
    for cfg, reasons in rep.illegal:
        assert reasons and not cfg.is_legal(128, 64)
    counts = rep.reason_counts()
    assert counts["SMEM over the per-block opt-in limit"] > 0
    assert counts["SMEM over the carveout budget"] > 0


def test_specific_configs_excluded_for_the_right_reason():
    space = get_space("decode")
    too_big = DecodeConfig(tile_n=128, stages=8, consumer_wgs=1)
    assert any("per-block limit" in r for r in space.problems(too_big, SHAPE))
    # 5 stages of 64-token tiles fit the opt-in limit but not alpha = 50 % of the SM's SMEM
    over_alpha = DecodeConfig(tile_n=64, stages=5, carveout=50, consumer_wgs=1)
    assert any("carveout budget" in r for r in space.problems(over_alpha, SHAPE))
    assert space.problems(DecodeConfig(tile_n=64, stages=5, carveout=80, consumer_wgs=1), SHAPE) == []
    odd_page = TuneShape(64, 8, 128, 1, 4096, page_size=48)
    assert any("page_size 48" in r for r in space.problems(DecodeConfig(), odd_page))
    assert space.legality(odd_page).legal_count == 0
    # consumer warpgroups follow the query rows
    wrong_wgs = DecodeConfig(consumer_wgs=2)
    assert any("consumer_wgs" in r for r in space.problems(wrong_wgs, SHAPE))


def test_consumer_wgs_fixed_by_rows():
    space = get_space("decode")
    spec = TuneShape(64, 8, 128, 1, 4096, q_len=16)  # 8 x 16 = 128 rows -> two warpgroups
    legal = space.legal_configs(spec)
    assert legal and {c.consumer_wgs for c in legal} == {2}
    too_many = TuneShape(64, 8, 128, 1, 4096, q_len=32)  # 256 rows
    rep = space.legality(too_many)
    assert rep.legal_count == 0
    assert any("exceed the 128 rows" in r for _c, rs in rep.illegal for r in rs)


def test_default_config_is_legal_and_in_space():
    space = get_space("decode")
    for q_len in (1, 8):
        shape = TuneShape(32, 8, 128, 1, 4096, q_len=q_len)
        d = space.default_for(shape)
        assert space.is_legal(d, shape) and space.in_space(d)


def test_launch_key_merges_equivalent_split_choices():
    space = get_space("decode")
    shape = TuneShape(64, 8, 128, 1, 4096)
    auto = DecodeConfig(num_splits=0, ctas_per_sm=2)
    fixed = DecodeConfig(num_splits=auto.splits_for(1, 8, 4096, 132), ctas_per_sm=4)
    assert space.launch_key(auto, shape, 132) == space.launch_key(fixed, shape, 132)
    assert space.launch_key(auto, shape, 132) != space.launch_key(DecodeConfig(num_splits=1), shape, 132)
    assert space.config_key(auto) != space.config_key(fixed)
    assert space.launch_classes(shape) < space.legality(shape).legal_count


def test_space_hash_is_stable_and_tracks_the_space():
    space = get_space("decode")
    h = space.space_hash()
    assert h == space.space_hash() == DecodeSpace().space_hash()
    blob = json.dumps(space.describe(), sort_keys=True, separators=(",", ":"))
    assert h == hashlib.sha256(blob.encode()).hexdigest()

    class Narrow(DecodeSpace):
        params = (Param("tile_n", (64,)),) + DecodeSpace.params[1:]

    assert Narrow().space_hash() != h
    # same hash in another process (no dependence on dict order, ids, hash seeds)
    code = "from directkv_cute.tuning.space import space_hash; print(space_hash('decode'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == h


PREFILL_SHAPE = TuneShape(64, 8, 128, batch=1, context=4096, q_len=64)  # 512 rows: the multi-token kernel
PREFILL_POINTS = 3 * 7 * 7 * 6 * 3 * 2 * 3 * 3 * 3 * 2 * 3 * 3


def _check_multi_token_legality(space, rep):
    """What the multi_token space's static filter must keep and drop, over the legal configs of
    ``rep`` (every point of the space, or a uniform sample of it)."""
    assert 0 < rep.legal_count < rep.total
    assert {(c.num_splits, c.ctas_per_sm) for c in rep.legal} == {(0, 1), (0, 2)}
    # two CTAs per SM only where they fit: one consumer warpgroup and SMEM for both
    assert all(c.consumer_wgs == 1 and c.multi_token_occupancy(128) == 2 for c in rep.legal if c.ctas_per_sm == 2)
    assert all(c.chunk_tiles < c.stages for c in rep.legal)
    assert {c.chunk_tiles for c in rep.legal} == {0, 1, 2, 3, 4, 5, 6}
    assert {c.consumer_wgs for c in rep.legal} == {1, 2, 3}
    assert all(c.tile_n <= 64 for c in rep.legal if c.consumer_wgs == 3)
    assert {c.max_inflight for c in rep.legal} == {0, 1, 2} and all(c.max_inflight < c.stages for c in rep.legal)
    # link admission only with one tile in flight per CTA; edge chunks no longer than a chunk
    assert {c.link_credits for c in rep.legal} == {0, 8, 16}
    assert all(c.max_inflight == 1 for c in rep.legal if c.link_credits)
    assert {c.edge_tiles for c in rep.legal} == {0, 1, 2} and all(c.edge_tiles <= c.chunk for c in rep.legal)
    # Q in registers opens rings that do not fit beside a Q tile
    assert any(c.q_regs and c.stages == 7 and c.tile_n == 64 and c.consumer_wgs == 2 for c in rep.legal)
    assert not any(not c.q_regs and c.stages == 7 and c.tile_n == 64 and c.consumer_wgs == 2 for c in rep.legal)
    # clusters sharing each tile: only at one CTA per SM
    assert {c.q_cluster for c in rep.legal} == {0, 2, 4}
    assert all(c.multi_token_occupancy(128) == 1 for c in rep.legal if c.q_cluster)
    assert {c.link_credits for c in rep.legal if c.q_cluster} == {0, 8, 16}  # rank 0 admits for the cluster
    # staggered chunk boundaries: up to one group per chunk tile, never with edge chunks
    assert {c.stagger for c in rep.legal} == {0, 2, 4}
    assert all(c.stagger <= c.chunk and not c.edge_tiles for c in rep.legal if c.stagger)


def test_multi_token_space(sampled_multi_token_legality):
    """The filter over a uniform sample of the space (the whole space: test_multi_token_space_whole)."""
    space = get_space("multi_token")
    assert space.cardinality() == PREFILL_POINTS
    rep = sampled_multi_token_legality(PREFILL_SHAPE)
    assert rep.total == 100_000 and rep.legal_count > 1000
    _check_multi_token_legality(space, rep)
    d = space.default_for(PREFILL_SHAPE)
    assert space.is_legal(d, PREFILL_SHAPE) and space.in_space(d) and d.consumer_wgs == 2
    assert get_space("decode").legality(PREFILL_SHAPE).legal_count == 0  # too many rows for one CTA
    assert space.space_hash() != get_space("decode").space_hash()


@pytest.mark.full
def test_multi_token_space_whole():
    """The filter over every point of the space (2.6 M: ~40 s)."""
    space = get_space("multi_token")
    rep = space.legality(PREFILL_SHAPE)
    assert rep.total == PREFILL_POINTS
    _check_multi_token_legality(space, rep)


def test_registry_accepts_a_second_kernel():
    class PrefillSpace(DecodeSpace):
        kernel = "prefill-test"

    sp = register_space(PrefillSpace())
    try:
        assert get_space("prefill-test") is sp
        with pytest.raises(ValueError):
            register_space(PrefillSpace())
        register_space(PrefillSpace(), replace=True)
    finally:
        from directkv_cute.tuning import space as space_mod

        space_mod._SPACES.pop("prefill-test", None)
    with pytest.raises(KeyError, match="no search space"):
        get_space("nope")
    with pytest.raises(ValueError):
        register_space(KernelSpace())


def test_presets_match_public_configs():
    p = presets.PRESETS
    assert set(p) == {"llama3-8b", "llama3-70b", "qwen2.5-72b", "mistral-large", "qwen2.5-7b", "tiny"}
    assert (p["llama3-8b"].num_q_heads, p["llama3-8b"].num_kv_heads, p["llama3-8b"].head_dim,
            p["llama3-8b"].hidden_size, p["llama3-8b"].num_layers) == (32, 8, 128, 4096, 32)
    assert (p["llama3-70b"].num_q_heads, p["llama3-70b"].num_kv_heads, p["llama3-70b"].hidden_size,
            p["llama3-70b"].num_layers) == (64, 8, 8192, 80)
    assert (p["qwen2.5-72b"].num_q_heads, p["qwen2.5-72b"].num_kv_heads, p["qwen2.5-72b"].hidden_size,
            p["qwen2.5-72b"].num_layers) == (64, 8, 8192, 80)
    m = p["mistral-large"]
    assert (m.num_q_heads, m.num_kv_heads, m.head_dim, m.hidden_size, m.num_layers) == (96, 8, 128, 12288, 88)
    q = p["qwen2.5-7b"]
    assert (q.num_q_heads, q.num_kv_heads, q.head_dim, q.hidden_size, q.num_layers) == (28, 4, 128, 3584, 28)
    assert q.group == 7
    for preset in p.values():
        assert preset.page_size == 64 and preset.dtype == "bf16"
        shapes = preset.shapes()
        assert len(shapes) == 16
        assert {s.batch for s in shapes} == {1, 4, 16, 64}
        assert {s.context for s in shapes} == {4096, 16384, 32768, 131072}
        assert {s.q_len for s in shapes} == {1}


def test_preset_names_and_dedupe():
    assert presets.get_preset("Llama-3-8B").name == "llama3-8b"
    assert presets.get_preset("Mistral-Large-Instruct-2407").name == "mistral-large"
    assert presets.get_preset("QWEN2.5-72B").name == "qwen2.5-72b"
    assert presets.get_preset("Qwen2.5-7B-Instruct").name == "qwen2.5-7b"
    with pytest.raises(KeyError, match="unknown preset"):
        presets.get_preset("gpt-5")
    both = presets.resolve_presets(["llama3-70b", "qwen2.5-72b"])
    shapes = presets.unique_shapes(s for pr in both for s in pr.shapes())
    assert len(shapes) == 16  # identical attention geometry
    assert len(presets.resolve_presets(["all"])) == 5
    custom = presets.get_preset("llama3-8b").shapes(batches=[2], contexts=[1000, 2000], page_size=16, dtype="fp16")
    assert [(s.batch, s.context, s.page_size, s.dtype) for s in custom] == [(2, 1000, 16, "fp16"), (2, 2000, 16, "fp16")]


@pytest.mark.parametrize("q_len", [64, 512, 2048, 8192])
def test_multi_token_defaults_lie_in_the_space(q_len):
    space = get_space("multi_token")
    shape = TuneShape(32, 8, 128, batch=1, context=32768, q_len=q_len)
    d = space.default_for(shape)
    assert space.in_space(d) and space.is_legal(d, shape)


def test_multi_token_launch_key_merges_only_unresolved_occupancy():
    """Two multi_token configs run the same launch when they differ only in a ctas_per_sm that resolves
    to the same occupancy; any other field (including ones added later) separates them."""
    import dataclasses

    space = get_space("multi_token")
    shape = TuneShape(32, 8, 128, batch=1, context=32768, q_len=512)
    wide = DecodeConfig(tile_n=64, stages=6, consumer_wgs=2, carveout=100, ctas_per_sm=1, chunk_tiles=5)
    assert space.launch_key(wide, shape) == space.launch_key(dataclasses.replace(wide, ctas_per_sm=2), shape)
    two = DecodeConfig(tile_n=64, stages=3, consumer_wgs=1, carveout=100, ctas_per_sm=1)
    assert space.launch_key(two, shape) != space.launch_key(dataclasses.replace(two, ctas_per_sm=2), shape)
    for field, value in (("chunk_tiles", 4), ("max_inflight", 1), ("edge_tiles", 1), ("carveout", 90)):
        assert space.launch_key(wide, shape) != space.launch_key(dataclasses.replace(wide, **{field: value}), shape)


def test_the_fp8_decode_space_is_the_decode_space_under_the_fp8_smem_rule():
    from directkv_cute import fp8

    space, dec = get_space("decode_fp8"), get_space("decode")
    assert "decode_fp8" in kernels() and space.kernel == "decode_fp8"
    shape = TuneShape(32, 8, 128, batch=1, context=131072, page_size=64)
    legal = space.legal_configs(shape)
    assert legal and all(not fp8.decode_problems(c, 128, 64) for c in legal)
    # deeper rings than bf16 pages allow: FP8 stages are half the bytes
    assert max(c.stages for c in legal) > max(c.stages for c in dec.legal_configs(shape))
    assert space.default_for(shape) == fp8.decode_config(dec.default_for(shape), 128, 64)
    for s in (shape, TuneShape(64, 8, 128, batch=4, context=32768, page_size=16)):
        picks = space.portfolio(s)
        assert picks and all(space.is_legal(c, s) for c in picks)
    too_deep = dataclasses.replace(space.default_for(shape), tile_n=128, stages=12, carveout=100)
    assert any("FP8 pages: needs" in p for p in space.problems(too_deep, shape))


# ---- the Q-tiled kernel ------------------------------------------------------------------------

Q_SHAPE = TuneShape(32, 8, 128, batch=1, context=32768, q_len=2048)


@pytest.mark.parametrize("head_dim, page_size, group", [(128, 64, 4), (128, 16, 7), (64, 64, 8), (128, 128, 12)])
def test_q_tiled_space_is_the_specs_legality_over_the_codegen_fields(head_dim, page_size, group):
    """Every point of the q_tiled space is judged by the kernel's spec (the config's rules and its
    GQA group), the legal ones are distinct kernels (distinct compile keys), and the space tunes
    every field of the config, each of which generates code (staging is the planner's)."""
    from directkv_cute.config import QTiledConfig
    from directkv_cute.kernels import jit, specs

    space = get_space("q_tiled")
    assert space.kernel == space.source_kernel == "q_tiled" and space.config_cls is QTiledConfig
    spec = specs.get("q_tiled")
    fields = [f.name for f in dataclasses.fields(QTiledConfig)]
    assert sorted(p.name for p in space.params) == sorted(spec.codegen_fields) == sorted(fields)
    assert spec.launch_fields == () and space.fixed(TuneShape(32, 8, 128, 1, 8192, 512)) == {}
    shape = TuneShape(group * 8, 8, head_dim, batch=1, context=8192, q_len=512, page_size=page_size)
    rep = space.legality(shape)
    assert rep.total == space.cardinality() == 2 * 3 * 3 * 2 * 2
    assert 0 < rep.legal_count <= rep.total and (rep.legal_count < rep.total) == (head_dim == 128)
    for cfg in rep.legal:
        assert spec.problems(cfg, head_dim, page_size, group=group) == []
        assert space.in_space(cfg)
    for cfg, reasons in rep.illegal:
        assert reasons == spec.problems(cfg, head_dim, page_size, group=group) and reasons
    keys = {jit.q_tiled_key(c, torch_dtype(shape.dtype), head_dim, page_size, group, False) for c in rep.legal}
    assert len(keys) == rep.legal_count
    assert space.launch_classes(shape) == rep.legal_count
    # both pingpong modes and both cluster sizes at both tile sizes are searched
    assert {(c.tile_n, c.pingpong, c.cluster) for c in rep.legal} == {
        (t, p, cl) for t in (64, 128) for p in (0, 1) for cl in (1, 2)}


def test_q_tiled_space_excludes_what_smem_cannot_hold():
    from directkv_cute.config import QTiledConfig

    space = get_space("q_tiled")
    rep = space.legality(Q_SHAPE)
    assert not any(c.tile_n == 128 and c.stages == 4 for c in rep.legal)  # 4 x 64 KB + Q: over 227 KB
    assert any(c.tile_n == 128 and c.stages == 3 and c.carveout == 100 for c in rep.legal)
    assert not any(c.tile_n == 128 and c.stages == 3 and c.carveout < 100 for c in rep.legal)
    assert {c.stages for c in rep.legal if c.tile_n == 64} == {2, 3, 4}
    assert rep.reason_counts()["SMEM over the per-block opt-in limit"] > 0
    wide = TuneShape(129 * 2, 2, 128, batch=1, context=8192, q_len=512)  # GQA group 129
    assert space.legality(wide).legal_count == 0
    assert any("GQA group 129" in r for r in space.problems(QTiledConfig(), wide))


def test_q_tiled_default_portfolio_and_hash():
    from directkv_cute.config import QTiledConfig

    space = get_space("q_tiled")
    for shape in (Q_SHAPE, TuneShape(28, 4, 128, batch=1, context=131072, q_len=8192, page_size=16),
                  TuneShape(96, 8, 128, batch=1, context=8192, q_len=512)):
        d = space.default_for(shape)
        assert d == QTiledConfig() and space.is_legal(d, shape) and space.in_space(d)
        picks = space.portfolio(shape)
        assert picks[:3] == [QTiledConfig(), QTiledConfig(cluster=1), QTiledConfig(tile_n=64, stages=4)]
        assert all(space.is_legal(c, shape) and space.in_space(c) for c in picks)
    assert space.static_problems(QTiledConfig(), head_dim=128, page_size=64, rows=4 * 8192) == []
    assert space.static_problems(QTiledConfig(stages=4), head_dim=128, page_size=64, rows=8)
    hashes = {get_space(k).space_hash() for k in kernels()}
    assert "q_tiled" in kernels() and len(hashes) == len(kernels())


def test_q_tiled_buckets_are_prefill_chunks():
    shapes = presets.get_preset("llama3-8b").shapes(kernel="q_tiled")
    assert {s.bucket for s in shapes} == {(1, c, q) for c in (8192, 32768, 131072) for q in (512, 2048, 8192)}
    assert all(s.q_len <= s.context for s in shapes)
    # bucket lists given win, each on its own
    mine = presets.get_preset("llama3-8b").shapes(kernel="q_tiled", contexts=[16384], page_size=16)
    assert {s.bucket for s in mine} == {(1, 16384, q) for q in (512, 2048, 8192)} and {s.page_size for s in mine} == {16}
    assert {s.q_len for s in presets.get_preset("llama3-8b").shapes(kernel="decode")} == {1}


def test_each_spaces_compile_hook_is_the_ops_compile(monkeypatch):
    """compile_for (the tuner's precompile) builds the kernel the GPU objective's launch runs: the
    streaming kernel with split partials when the H200 launch splits, the multi-token kernel, the
    FP8 kernel over e4m3 pages, the Q-tiled kernel over HBM pages (no ready flags, one split)."""
    import torch

    from directkv_cute.config import QTiledConfig
    from directkv_cute.kernels import jit

    calls = []
    rec = lambda name: lambda *a, **k: calls.append((name, a, k))  # noqa: E731
    for name in ("compile_decode", "compile_multi_token", "compile_decode_fp8", "compile_q_tiled"):
        monkeypatch.setattr(jit, name, rec(name))
    one = TuneShape(32, 8, 128, batch=64, context=4096)  # 64 x 8 CTAs fill the SMs: one split
    dec = get_space("decode").default_for(one)
    get_space("decode").compile_for(dec, one)
    get_space("decode").compile_for(dec, TuneShape(32, 8, 128, batch=1, context=32768, q_len=4))
    mt = TuneShape(32, 8, 128, batch=1, context=32768, q_len=512, page_size=16)
    get_space("multi_token").compile_for(get_space("multi_token").default_for(mt), mt)
    get_space("decode_fp8").compile_for(get_space("decode_fp8").default_for(one), one)
    get_space("q_tiled").compile_for(QTiledConfig(tile_n=64, stages=2), TuneShape(28, 4, 128, 1, 8192, 512, page_size=16))
    assert [c[0] for c in calls] == ["compile_decode", "compile_decode", "compile_multi_token", "compile_decode_fp8",
                                     "compile_q_tiled"]
    assert calls[0][1][1:] == (torch.bfloat16, 128, 64, 4, 1) and calls[0][2] == {"split_out": False}
    assert calls[1][1][5] == 4 and calls[1][2] == {"split_out": True}
    assert calls[2][1][1:] == (torch.bfloat16, 128, 16, 4)
    assert calls[3][1][1:] == (torch.bfloat16, torch.float8_e4m3fn, 128, 64, 4, 1, False)
    assert calls[4][1] == (QTiledConfig(tile_n=64, stages=2), torch.bfloat16, 128, 16, 7, False, False)
