"""CPU tests of the streaming kernel over FP8 pages: its legality, its config adaptation, its
compile for sm_90a (what the PTX must hold) and its compile key."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from directkv_cute import fp8
from directkv_cute.config import DecodeConfig, default_decode_config
from directkv_cute.kernels import jit, specs

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
full = pytest.mark.full


def test_smem_rule_counts_the_fp8_ring_the_operands_and_q():
    cfg = DecodeConfig(tile_n=64, stages=7, consumer_wgs=1)
    # ring 7 x (2 x 64 x 128 + 2 x 64 x 4), operands 2 x 64 x 128 x 2, Q 64 x 128 x 2, 2 KB
    assert fp8.decode_smem_bytes(cfg, 128) == 7 * (16384 + 512) + 32768 + 16384 + 2048
    assert not fp8.decode_problems(cfg, 128, 64)
    big = DecodeConfig(tile_n=128, stages=6, consumer_wgs=2, carveout=100)
    assert any("FP8 pages: needs" in p for p in fp8.decode_problems(big, 128, 64))
    low = DecodeConfig(tile_n=64, stages=7, carveout=40)
    assert any("carveout budget" in p for p in fp8.decode_problems(low, 128, 64))
    assert fp8.decode_problems(cfg, 128, 64, torch.bfloat16)[0].startswith("kv_dtype must be")
    assert any("page_size" in p for p in fp8.decode_problems(cfg, 128, 48))


@pytest.mark.parametrize("rows, page", [(4, 64), (8, 16), (128, 64), (40, 16)])
def test_decode_config_deepens_the_ring_within_the_same_smem(rows, page):
    base = default_decode_config(128, rows, page)
    cfg = fp8.decode_config(base, 128, page)
    assert not fp8.decode_problems(cfg, 128, page)
    assert cfg.stages >= base.stages
    assert fp8.decode_smem_bytes(cfg, 128, page) <= base.smem_bytes(128) or cfg.stages == base.stages
    assert dataclasses.replace(cfg, stages=base.stages, max_inflight=base.max_inflight) == base
    # A limit on tiles in flight stays below the ring depth.
    c = fp8.decode_config(dataclasses.replace(base, max_inflight=1, link_credits=8), 128, page)
    assert c.max_inflight == 1 and c.link_credits == 8


def test_the_spec_and_its_key():
    spec = specs.get("decode_fp8")
    assert spec.compile_fn is jit.compile_decode_fp8 and spec.tuned and spec.max_rows == specs.STREAM_MAX_ROWS
    assert spec.launches == ("decode_fp8", "combine")
    cfg = DecodeConfig(tile_n=64, stages=7)
    k1 = jit.decode_fp8_key(cfg, torch.bfloat16, E4M3, 128, 64, 4, True)
    assert k1 == jit.decode_fp8_key(dataclasses.replace(cfg, num_splits=5, ctas_per_sm=3), torch.bfloat16, E4M3,
                                    128, 64, 4, True)  # launch fields share the kernel
    for other in (jit.decode_fp8_key(cfg, torch.bfloat16, E5M2, 128, 64, 4, True),
                  jit.decode_fp8_key(dataclasses.replace(cfg, stages=8), torch.bfloat16, E4M3, 128, 64, 4, True),
                  jit.decode_fp8_key(cfg, torch.float16, E4M3, 128, 64, 4, True),
                  jit.decode_fp8_key(cfg, torch.bfloat16, E4M3, 128, 64, 4, False)):
        assert other != k1


def test_compile_refuses_what_the_kernel_cannot_run():
    cfg = DecodeConfig(tile_n=64, stages=7)
    with pytest.raises(ValueError, match="dtype must be bfloat16 or float16"):
        jit.compile_decode_fp8(cfg, torch.float32, E4M3, 128, 64, 4)
    with pytest.raises(ValueError, match="kv_dtype must be"):
        jit.compile_decode_fp8(cfg, torch.bfloat16, torch.bfloat16, 128, 64, 4)
    with pytest.raises(ValueError, match="rows exceed"):
        jit.compile_decode_fp8(cfg, torch.bfloat16, E4M3, 128, 64, 4, max_q_len=17)
    with pytest.raises(ValueError, match="FP8 pages: needs"):
        jit.compile_decode_fp8(DecodeConfig(tile_n=128, stages=6, consumer_wgs=2, carveout=100), torch.bfloat16,
                               E4M3, 128, 64, 4)


@pytest.fixture()
def keep_ptx(tmp_path, monkeypatch):
    import cutlass.cute as cute

    real = cute.compile
    monkeypatch.setattr(cute, "compile", lambda *a, **kw: real(*a, options=f"--keep-ptx --dump-dir={tmp_path}", **kw))
    monkeypatch.setenv("DIRECTKV_DISK_CACHE", "0")
    jit.clear_memory_cache()
    yield
    jit.clear_memory_cache()


COMPILE = [
    # dtype, kv dtype, d, page, group, rows of q, split_out, config (None: the default adapted)
    (torch.bfloat16, E4M3, 128, 64, 4, 1, True, None),
    (torch.float16, E5M2, 64, 16, 8, 2, False, None),
]
COMPILE_FULL = [
    (torch.bfloat16, E4M3, 128, 16, 4, 32, True, None),
    (torch.bfloat16, E5M2, 128, 64, 4, 1, True, DecodeConfig(tile_n=128, stages=3, carveout=100)),
    (torch.bfloat16, E4M3, 128, 64, 4, 1, True, DecodeConfig(tile_n=32, stages=6, max_inflight=1, link_credits=8)),
    (torch.float16, E4M3, 64, 128, 1, 1, True, None),
]


@pytest.mark.compile
@pytest.mark.parametrize("dtype, kv_dtype, d, page, group, q_len, split_out, cfg",
                         [*COMPILE, *(pytest.param(*c, marks=full) for c in COMPILE_FULL)])
def test_the_kernel_compiles_for_sm90a(keep_ptx, dtype, kv_dtype, d, page, group, q_len, split_out, cfg):
    if cfg is None:
        cfg = fp8.decode_config(default_decode_config(d, group * q_len, page), d, page)
    fn = jit.compile_decode_fp8(cfg, dtype, kv_dtype, d, page, group, q_len, split_out)
    ptx = fn.__ptx__
    fmt = {E4M3: "e4m3", E5M2: "e5m2"}[kv_dtype]
    name = {torch.bfloat16: "bf16", torch.float16: "f16"}[dtype]
    n_cons = 128 * cfg.consumer_wgs
    steps = cfg.tile_n * d // 8 // n_cons  # 8-element pieces per thread and tile, for K and for V
    # FP8 -> f16 pairs (exact), the scale in fp32, one rounding to the q dtype per pair.
    assert ptx.count(f"cvt.rn.f16x2.{fmt}x2") == 2 * steps * 4
    if dtype is torch.bfloat16:
        assert ptx.count("cvt.rn.bf16x2.f32") >= 2 * steps * 4
    # 8 FP8 bytes in and one 16-byte store out per piece; one fp32 scale per piece.
    assert ptx.count("ld.shared.v2.b32") == 2 * steps
    # TMA: K and V boxes (3-d pool view) and their scale boxes (2-d scale view), in the three
    # places a box can come from (past the end, host, HBM), per copy of a tile.
    copies = cfg.tile_n // min(page, cfg.tile_n)
    assert ptx.count("cp.async.bulk.tensor.3d") == 6 * copies
    assert ptx.count("cp.async.bulk.tensor.2d") == 6 * copies
    assert f"wgmma.mma_async.sync.aligned.m64n{cfg.tile_n}k16.f32.{name}.{name}" in ptx
    assert jit.compile_decode_fp8(cfg, dtype, kv_dtype, d, page, group, q_len, split_out) is fn  # cached
