"""CPU tests of the op's routing of multi-token calls to the Q-tiled kernel (directly over HBM
pages, or over host pages staged into HBM), with the GPU's properties stood in."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from directkv_cute import ops
from directkv_cute.cache import KernelTables
from directkv_cute.config import QTiledConfig


@pytest.fixture(autouse=True)
def h200(monkeypatch):
    monkeypatch.setattr(ops, "_num_sms", lambda index: 132)
    monkeypatch.setattr(ops, "_total_memory", lambda index: 140 * 2**30)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


def _call(lens, q_lens, hbm=False, hq=32, hkv=8, d=128, page=64, host_table=True):
    n_pages = [math.ceil(n / page) for n in lens]
    width = max(n_pages)
    table = np.zeros((len(lens), width), dtype=np.int32)
    k = 0
    for b, n in enumerate(n_pages):
        ids = np.arange(k, k + n)
        table[b, :n] = -ids - 1 if hbm else ids
        table[b, n:] = table[b, n - 1]
        k += n
    tables = KernelTables(torch.from_numpy(table), torch.tensor(lens, dtype=torch.int32), 0, -1, tuple(lens),
                          table if host_table else None)
    cache = SimpleNamespace(page_size=page, num_kv_heads=hkv)
    q = torch.empty(sum(q_lens), hq, d, dtype=torch.bfloat16, device="meta")
    return q, cache, tables, tuple(q_lens), hq // hkv


def test_short_link_bound_reads_stay_in_place_without_a_plan(monkeypatch):
    monkeypatch.setattr(ops, "plan_staging", lambda *a, **k: pytest.fail("planned a short link-bound call"))
    for lens, q_lens in (([4096], [1]), ([8192], [64]), ([2000] * 4, [1] * 4), ([8192], [512])):
        assert ops._q_tiled_route(*_call(lens, q_lens), None) is None


def test_long_link_bound_reads_are_staged_decode_included():
    """Decode and short chunks over 32k of host KV: the copy engine outruns the SMs' reads of host
    memory (measured 3-7% on decode at 32k/128k), so they are staged too."""
    for lens, q_lens in (([32768], [1]), ([32768] * 16, [1] * 16), ([32768], [64])):
        cfg, plan = ops._q_tiled_route(*_call(lens, q_lens), None)
        assert plan is not None and plan.host_pages == sum(lens) // 64 and cfg.order == 1


def test_decode_over_hbm_pages_keeps_the_streaming_kernel():
    assert ops._q_tiled_route(*_call([32768] * 32, [1] * 32, hbm=True), None) is None
    cfg, plan = ops._q_tiled_route(*_call([32768], [1], hbm=True), QTiledConfig())
    assert plan is None  # an explicit config still runs it


def test_compute_bound_chunks_are_staged_with_the_models_splits():
    cfg, plan = ops._q_tiled_route(*_call([32768], [8192]), None)
    assert plan is not None and plan.host_pages == 512 and cfg.splits > 1 and cfg.order == 1
    assert (plan.table < 0).all(), "the kernel reads the staging buffer as HBM pages"


def test_all_hbm_takes_the_q_tiled_kernel_only_with_a_wave_of_tiles():
    assert ops._q_tiled_route(*_call([32768], [64], hbm=True), None) is None  # 2 x 8 CTAs
    cfg, plan = ops._q_tiled_route(*_call([32768], [2048], hbm=True), None)  # 64 x 8 CTAs
    assert plan is None and cfg == QTiledConfig()
    cfg, plan = ops._q_tiled_route(*_call([32768], [64], hbm=True), QTiledConfig(tile_n=64, stages=4))
    assert plan is None and cfg.tile_n == 64  # an explicit config always runs it


def test_explicit_config_refusals_name_the_reason(monkeypatch):
    with pytest.raises(ValueError, match="kernel_tables"):
        ops._q_tiled_route(*_call([4096], [4096], host_table=False), QTiledConfig())
    monkeypatch.setenv("DIRECTKV_MAX_STAGING_GB", "0.01")
    with pytest.raises(ValueError, match="DIRECTKV_MAX_STAGING_GB"):
        ops._q_tiled_route(*_call([32768], [8192]), QTiledConfig())
    # Without a config the same call reads in place instead.
    assert ops._q_tiled_route(*_call([32768], [8192]), None) is None
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(ValueError, match="CUDA graph"):
        ops._q_tiled_route(*_call([32768], [8192]), QTiledConfig())
    assert ops._q_tiled_route(*_call([32768], [8192]), None) is None


def test_explicit_order_and_splits_are_kept():
    cfg, plan = ops._q_tiled_route(*_call([8192], [8192]), QTiledConfig(order=2))
    assert cfg.order == 2 and cfg.splits == 1
    cfg, plan = ops._q_tiled_route(*_call([8192, 3000], [8192, 100]), QTiledConfig(splits=3, piece_pages=4))
    assert cfg.splits == 3 and plan.piece_pages == 4 and plan.pages == 128 + 47
