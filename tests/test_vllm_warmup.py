"""The vLLM backend's kernel warm-up: the steps a server may make (``step.warmup_steps``), the
kernels their plans launch (``step.warmup_kernels`` through ``runner.plan_kernels``, the same
choice the run path makes), and the builder's registration with vLLM's CuTe DSL warm-up."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from directkv_cute import runner
from directkv_cute.machine import H200, DeviceInfo
from directkv_cute.planner import CallShape, DefaultConfigs, plan_attention
from directkv_cute.routes import dequant_args
from directkv_cute.runner import PoolView, plan_kernels
from directkv_cute.vllm.step import warmup_kernels, warmup_mirrors, warmup_steps

H200_FACTS = DeviceInfo("NVIDIA H200", sms=132, total_memory=141 * 2**30)
MEMOS = {runner.compiled_decode, runner.compiled_fp8, runner.compiled_q_tiled, runner.compiled_combine,
         runner.compiled_dequant}


def _steps(**kw):
    args = dict(max_num_seqs=256, max_num_batched_tokens=16384, max_model_len=131072, page_size=64,
                num_blocks=10**6) | kw
    return warmup_steps(**args)


def test_steps_cover_decode_batches_chunks_and_mixed_steps():
    steps = _steps()
    decodes = [s for s in steps if set(s[1]) == {1}]
    assert sorted({len(s[0]) for s in decodes}) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert sorted({s[0][0] for s in decodes}) == [1024, 4096, 16384, 65536, 131072]
    chunks = [s for s in steps if len(s[1]) == 1 and s[1][0] > 1]
    assert sorted({s[1][0] for s in chunks}) == [16, 128, 512, 2048, 16384]
    assert all(s[0][0] >= s[1][0] for s in chunks)
    mixed = [s for s in steps if len(s[1]) > 1 and max(s[1]) > 1]
    assert mixed and all(sum(q) == 16384 and q[-1] == 16384 - (len(q) - 1) for _, q in mixed)
    for seq_lens, q_lens in steps:
        assert len(seq_lens) == len(q_lens) and all(s >= q >= 1 for s, q in zip(seq_lens, q_lens))


def test_steps_stay_within_the_server_limits():
    steps = _steps(max_num_seqs=5, max_num_batched_tokens=128, max_model_len=1024, page_size=16, num_blocks=260)
    assert max(len(s) for s, _ in steps) == 4 and max(max(s) for s, _ in steps) == 1024
    assert max(max(q) for _, q in steps) == 128
    assert all(sum(-(-n // 16) for n in s) <= 260 for s, _ in steps)
    assert ((1024,) * 4, (1,) * 4) in steps  # 256 pages
    assert ((1024,) * 4 + (128,), (1,) * 4 + (124,)) not in steps  # 264 pages
    assert ((1024,) * 2 + (128,), (1,) * 2 + (126,)) in steps


@pytest.mark.parametrize("bad, error", [(dict(max_num_seqs=0), ValueError), (dict(page_size=True), TypeError),
                                        (dict(num_blocks=1.5), TypeError), (dict(max_model_len=-4), ValueError)])
def test_steps_refuse_bad_limits(bad, error):
    with pytest.raises(error, match=next(iter(bad))):
        _steps(**bad)


def test_plan_kernels_names_the_run_paths_choice():
    """For plans of every 16-bit route the H200 planner makes, the listed kernels are the run
    path's memoized compile calls, the in-place kernel exactly as ``in_place_kernel`` picks it."""
    routes = set()
    for seq_lens, q_lens, tier in (([4096], [1], "host"), ([131072] * 4, [1] * 4, "host"), ([32768], [2048], "host"),
                                   ([32768], [2048], "hbm"), ([8192], [64], "host"), ([1024] * 8, [16] * 8, "host")):
        plan = plan_attention(CallShape.example(seq_lens, q_lens, tier=tier), H200_FACTS, H200, DefaultConfigs())
        routes.add(plan.route)
        kernels = plan_kernels(plan, torch.bfloat16)
        assert kernels and all(fn in MEMOS for fn, _ in kernels)
        if plan.route in ("decode", "multi_token"):
            assert runner.in_place_kernel(plan, torch.bfloat16, compile_now=False) == kernels[0]
            assert (runner.compiled_combine in [fn for fn, _ in kernels]) == (plan.detail.splits > 1 or
                                                                              plan.kernel == "multi_token")
        if plan.route.startswith("q_tiled"):
            assert kernels == [(runner.compiled_q_tiled, plan.route.q_tiled_args(plan, torch.bfloat16))]
    assert {"decode", "multi_token", "q_tiled_staged", "q_tiled_hbm"} <= routes, routes


def test_plan_kernels_of_fp8_routes_name_the_run_paths_choice():
    """FP8 pages: the FP8 decode kernel (and the combine) in place or in two pieces; the
    dequantization kernel with the inner plan's kernels, or with the Q-tiled kernel of the
    head-group launches, whose arguments are the run path's (no ready flags, no fold)."""
    routes = {}
    for seq_lens, q_lens in (([4096], [1]), ([131072], [1]), ([32768], [2048]), ([8192], [64])):
        plan = plan_attention(CallShape.example(seq_lens, q_lens, page_dtype=torch.float8_e4m3fn), H200_FACTS, H200,
                              DefaultConfigs())
        routes[plan.route] = kernels = plan_kernels(plan, torch.bfloat16)
        assert kernels and all(fn in MEMOS for fn, _ in kernels)
        if plan.route in ("fp8_dequantized", "fp8_by_head"):
            assert (runner.compiled_dequant, dequant_args(plan, torch.bfloat16)) in kernels
        if plan.route == "fp8_dequantized":
            assert kernels[1:] == plan_kernels(plan.detail.inner, torch.bfloat16)
        if plan.route == "fp8_by_head":
            (fn, args), = [k for k in kernels if k[0] is runner.compiled_q_tiled]
            assert args == plan.route.q_tiled_args(plan, torch.bfloat16) and args[-2:] == (False, False)
        if plan.route.startswith("decode_fp8"):
            assert kernels[0] == runner.in_place_kernel(plan, torch.bfloat16, True, compile_now=False)
    assert {"decode_fp8", "decode_fp8_two_piece", "fp8_by_head", "fp8_dequantized"} <= set(routes), set(routes)


def test_warmup_kernels_of_a_llama_8b_server_on_an_h200():
    """The steps of a server with 36 GiB of host KV (4608 blocks of 64 tokens) plan into a few
    distinct kernels: decode, multi-token and staged Q-tiled ones, each listed once."""
    pools = PoolView(torch.zeros(4608, 1, 8, 2, 64, 128, dtype=torch.bfloat16),
                     torch.zeros(0, 1, 8, 2, 64, 128, dtype=torch.bfloat16))
    steps = _steps(max_num_seqs=1024, max_model_len=131089, num_blocks=4608)
    kernels = warmup_kernels(pools, steps, num_q_heads=32, dtype=torch.bfloat16, device="cpu",
                             device_info=H200_FACTS)
    names = [key[0] for key in kernels]
    assert {"compiled_decode", "compiled_q_tiled", "compiled_combine"} <= set(names)
    assert 3 <= len(kernels) <= 24 and len(set(kernels)) == len(kernels)
    for key, (fn, args) in kernels.items():
        assert key == (fn.__name__, *args) and fn in MEMOS
        hash(key)  # vLLM deduplicates its warm-up units by key


def test_the_builder_registers_for_vllms_warmup():
    pytest.importorskip("vllm")
    from vllm.model_executor.warmup import cutedsl_warmup

    from directkv_cute.vllm.backend import DirectKVMetadataBuilder

    spec = SimpleNamespace(block_size=64, num_kv_heads=8, head_size=128)
    config = SimpleNamespace(model_config=SimpleNamespace(get_num_attention_heads=lambda parallel: 32),
                             parallel_config=None, speculative_config=None)
    builder = DirectKVMetadataBuilder(spec, ["layers.0.attn"], config, torch.device("cpu"))
    assert builder in set(cutedsl_warmup._CUTEDSL_WARMUP_PROVIDERS)
    assert callable(builder.get_cutedsl_warmup_compile_units)


def test_every_warmup_unit_compiles_for_hopper(tmp_path, monkeypatch):
    """The units vLLM's warm-up calls compile here too (sm_90a, no GPU needed), and a launch's
    later lookup of the same kernel is the memo's."""
    import functools

    monkeypatch.setenv("DIRECTKV_CACHE_DIR", str(tmp_path))
    pools = PoolView(torch.zeros(64, 1, 2, 2, 16, 64, dtype=torch.bfloat16),
                     torch.zeros(0, 1, 2, 2, 16, 64, dtype=torch.bfloat16))
    steps = warmup_steps(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=1024, page_size=16, num_blocks=64)
    kernels = warmup_kernels(pools, steps, num_q_heads=8, dtype=torch.bfloat16, device="cpu", device_info=H200_FACTS)
    assert len(kernels) >= 3
    for fn, args in kernels.values():
        assert callable(functools.partial(fn, *args)())
    for fn, args in kernels.values():
        before = fn.cache_info().hits
        fn(*args)
        assert fn.cache_info().hits == before + 1


def test_warmup_with_an_hbm_tier_lists_the_kernels_of_mirrored_pages():
    """With an HBM tier a step's blocks may be read from their mirrors, and the planner routes
    those calls differently (a prompt chunk over HBM pages runs the Q-tiled kernel in HBM). The
    warm-up lists every kernel of the host layouts and every kernel of each step planned over
    pages all in HBM (tables encoded by ``CallShape.example``, not by the warm-up's mirrors)."""
    from directkv_cute.attention import DirectKVAttention
    from directkv_cute.runner import tables_from_host

    host = torch.empty(7040, 1, 8, 2, 64, 128, dtype=torch.bfloat16)  # 55 GiB of Llama-3-8B blocks
    no_tier = PoolView(host, torch.empty(0, 1, 8, 2, 64, 128, dtype=torch.bfloat16))
    tier = PoolView(host, torch.empty(4979, 1, 8, 2, 64, 128, dtype=torch.bfloat16))  # 38.9 GiB of mirrors
    steps = _steps(max_num_seqs=1024, max_model_len=131089, num_blocks=7040)
    args = dict(num_q_heads=32, dtype=torch.bfloat16, device="cpu", device_info=H200_FACTS)
    host_only, with_tier = warmup_kernels(no_tier, steps, **args), warmup_kernels(tier, steps, **args)
    assert set(host_only) <= set(with_tier)
    routes = set()
    for seq_lens, q_lens in steps:
        shape = CallShape.example(seq_lens, q_lens, tier="hbm", num_layers=1)
        if -shape.host_table.min() > 4979:
            continue  # more pages than the tier holds
        tables = tables_from_host(shape.host_table, seq_lens, "cpu")._replace(back_to_back=True)
        plan = DirectKVAttention(tier).plan(tables=tables, q_lens=q_lens, num_q_heads=32, max_seq_len=max(seq_lens),
                                            device_info=H200_FACTS)
        routes.add(plan.route)
        for fn, fargs in plan_kernels(plan, torch.bfloat16):
            assert (fn.__name__, *fargs) in with_tier, (seq_lens[:2], q_lens[:2], plan.route)
    assert "q_tiled_hbm" in routes and "decode" in routes


def test_warmup_mirrors_are_the_tiers_layouts_that_fit():
    blocks = np.array([[0, 1, 2, 3], [4, 5, 0, 0]])
    full, half = warmup_mirrors(blocks, [4, 2], slots=6)
    assert full == {0: 0, 1: 1, 2: 2, 3: 3, 4: 4, 5: 5}
    assert half == {0: 0, 1: 1, 4: 2}  # each sequence's first half, slots from 0
    assert warmup_mirrors(blocks, [4, 2], slots=3) == [half]
    assert warmup_mirrors(blocks, [4, 2], slots=0) == []
