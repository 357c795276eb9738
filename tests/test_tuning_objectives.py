"""GpuObjective's harness logic on the CPU, against contract-shaped fakes of the cache, the
reference and the op (the real ones need a GPU; this checks setup, table rotation,
poisoning, the numerics gate, failure classification and timing bookkeeping)."""

import math
import sys
import types
from typing import NamedTuple

import pytest
import torch

from directkv_cute.config import DecodeConfig
from directkv_cute.tuning.objectives import GpuObjective
from directkv_cute.tuning.space import TuneShape, get_space


class KernelTables(NamedTuple):
    page_table: torch.Tensor
    seq_lens: torch.Tensor


class FakeCache:
    """The subset of the contract's PagedKVCache the harness uses (CPU pool)."""

    built = 0

    def __init__(self, num_layers, num_kv_heads, head_dim, page_size, num_host_pages, num_hbm_pages=0,
                 dtype=torch.bfloat16, device="cuda"):
        FakeCache.built += 1
        assert num_hbm_pages == 0 and device == "cpu"
        self.page_size = page_size
        self.host_pool = torch.zeros((num_host_pages, num_layers, num_kv_heads, 2, page_size, head_dim), dtype=dtype)
        self.host_pool_cuda = None
        self._free = list(range(num_host_pages))
        self._seqs = {}

    def add_sequence(self):
        sid = len(self._seqs)
        self._seqs[sid] = [[], 0]
        return sid

    def extend(self, sid, n):
        pages, length = self._seqs[sid]
        need = math.ceil((length + n) / self.page_size) - len(pages)
        if need > len(self._free):
            raise RuntimeError("out of host pages")
        pages += [self._free.pop(0) for _ in range(need)]
        self._seqs[sid][1] = length + n
        return length

    def kernel_tables(self, seq_ids):
        maxp = max(len(self._seqs[s][0]) for s in seq_ids)
        rows = [self._seqs[s][0] + [self._seqs[s][0][-1]] * (maxp - len(self._seqs[s][0])) for s in seq_ids]
        return KernelTables(torch.tensor(rows, dtype=torch.int32),
                            torch.tensor([self._seqs[s][1] for s in seq_ids], dtype=torch.int32))


def attention(q, cache, layer, tables, q_lens=None, softmax_scale=None):
    """float32 paged attention over tables (the fakes' reference and op)."""
    pool = cache.host_pool
    n_seq = tables.page_table.shape[0]
    q_lens = [1] * n_seq if q_lens is None else list(q_lens)
    hq, d = q.shape[1], q.shape[2]
    hkv = pool.shape[2]
    scale = softmax_scale or d ** -0.5
    out = torch.empty(q.shape, dtype=torch.float32)
    row = 0
    for b in range(n_seq):
        n = int(tables.seq_lens[b])
        pages = tables.page_table[b, : math.ceil(n / cache.page_size)].long()
        kv = pool[pages, layer].float()  # (p, hkv, 2, ps, d)
        k = kv[:, :, 0].permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :n]
        v = kv[:, :, 1].permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :n]
        ql = q_lens[b]
        qb = q[row:row + ql].float()  # (ql, hq, d)
        kh = k.repeat_interleave(hq // hkv, dim=0)  # (hq, n, d)
        vh = v.repeat_interleave(hq // hkv, dim=0)
        s = torch.einsum("qhd,hnd->hqn", qb, kh) * scale
        pos = torch.arange(n)
        mask = pos[None, :] > (n - ql + torch.arange(ql))[:, None]
        s = s.masked_fill(mask[None], float("-inf"))
        out[row:row + ql] = torch.einsum("hqn,hnd->qhd", s.softmax(-1), vh)
        row += ql
    return out


def fake_ref(q, cache, layer, seq_ids, q_lens=None, softmax_scale=None):
    out = attention(q, cache, layer, cache.kernel_tables(seq_ids), q_lens, softmax_scale)
    return out.to(q.dtype), torch.zeros(q.shape[:2])


def good_op(q, cache, layer, tables, q_lens=None, softmax_scale=None, *, config=None, out=None, return_lse=False):
    assert isinstance(config, DecodeConfig)
    res = attention(q, cache, layer, tables, q_lens, softmax_scale).to(q.dtype)
    if out is None:
        return res
    out.copy_(res)
    return out


@pytest.fixture
def fakes(monkeypatch):
    cache_mod = types.ModuleType("directkv_cute.cache")
    cache_mod.PagedKVCache = FakeCache
    ref_mod = types.ModuleType("directkv_cute.reference")
    ref_mod.paged_attention_ref = fake_ref
    monkeypatch.setitem(sys.modules, "directkv_cute.cache", cache_mod)
    monkeypatch.setitem(sys.modules, "directkv_cute.reference", ref_mod)
    FakeCache.built = 0
    return cache_mod


SHAPE = TuneShape(8, 2, 64, batch=3, context=100, page_size=16)
CFG = get_space("decode").default_for(SHAPE)


def objective(op=good_op, **kw):
    kw.setdefault("max_layers", 2)
    kw.setdefault("target_ms", 1.0)
    kw.setdefault("max_reps", 5)
    return GpuObjective(device="cpu", op=op, **kw)


def test_measures_and_reuses_the_cache_across_groups(fakes):
    obj = objective()
    env = obj.environment()
    assert env["gpu_name"].startswith("CPU") and env["sm_count"] > 0
    res = obj(CFG, SHAPE)
    assert res["ok"], res
    assert res["p50_us"] > 0 and 3 <= res["reps"] <= 5
    assert obj(CFG, SHAPE, reps=7)["reps"] == 7
    st = obj._setup
    assert st.layers == 2 and st.distinct == 3 and st.check_rows == [0, 2]
    assert float(st.cache.host_pool.float().abs().sum()) > 0  # random data, not zeros
    # another GQA group (more query heads), same KV geometry: same cache, new inputs
    wider = TuneShape(16, 2, 64, batch=3, context=100, page_size=16)
    assert obj(CFG, wider)["ok"] and FakeCache.built == 1
    assert obj._setup.qs[0].shape == (3, 16, 64)
    assert obj(CFG, TuneShape(8, 2, 64, batch=2, context=100, page_size=16))["ok"] and FakeCache.built == 2


def test_q_len_above_one(fakes):
    shape = TuneShape(8, 2, 64, batch=2, context=70, q_len=3, page_size=16)
    cfg = get_space("decode").default_for(shape)
    res = objective()(cfg, shape)
    assert res["ok"], res


def test_rotated_tables_when_host_memory_is_short(fakes):
    page_bytes = 2 * 2 * 16 * 64 * 2  # hkv x (K, V) x page x d x bf16, one layer
    seq_bytes = math.ceil(100 / 16) * page_bytes
    obj = objective(max_host_bytes=seq_bytes * 2, max_layers=1)  # room for 2 distinct sequences of 3
    res = obj(CFG, SHAPE)
    assert res["ok"], res
    st = obj._setup
    assert st.distinct == 2 and st.tables.page_table.shape[0] == 3
    pt = st.tables.page_table
    assert sorted(pt[2].tolist()) == sorted(pt[0].tolist()) and pt[2].tolist() != pt[0].tolist()
    assert st.tables.seq_lens.tolist() == [100, 100, 100]


def test_wrong_results_fail_the_numerics_gate(fakes):
    def off(q, cache, layer, tables, q_lens=None, softmax_scale=None, *, config=None, out=None, return_lse=False):
        res = good_op(q, cache, layer, tables, q_lens, softmax_scale, config=config, out=out)
        return res.add_(0.5)

    res = objective(op=off)(CFG, SHAPE)
    assert not res["ok"] and "relative error" in res["err"] and not res.get("fatal")


def test_unwritten_rows_are_caught_by_the_poison(fakes):
    def lazy(q, cache, layer, tables, q_lens=None, softmax_scale=None, *, config=None, out=None, return_lse=False):
        res = attention(q, cache, layer, tables, q_lens, softmax_scale).to(q.dtype)
        out[:-1].copy_(res[:-1])  # forgets the last sequence
        return out

    res = objective(op=lazy)(CFG, SHAPE)
    assert not res["ok"] and "non-finite" in res["err"]


def test_op_errors_are_failures_not_fatal(fakes):
    def boom(*a, **k):
        raise ValueError("GQA group 12 must divide 64")

    res = objective(op=boom)(CFG, SHAPE)
    assert res == {"ok": False, "err": "ValueError: GQA group 12 must divide 64"}
    illegal = objective()(DecodeConfig(tile_n=128, stages=8), TuneShape(8, 2, 128, 1, 100, page_size=16))
    assert not illegal["ok"] and illegal["err"].startswith("illegal")


def test_setup_failure_is_fatal(fakes, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("cudaHostRegister failed")

    monkeypatch.setattr(fakes, "PagedKVCache", broken)
    res = objective()(CFG, SHAPE)
    assert not res["ok"] and res["fatal"] and "cudaHostRegister failed" in res["err"]


def test_no_gpu_no_cuda_objective():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        GpuObjective(op=good_op)


def test_the_fp8_kernel_objective_builds_fp8_pages_and_checks_against_the_reference():
    """kernel="decode_fp8": the objective's cache holds e4m3 pages (random bytes of either sign,
    never NaN) with a scale per row, and a correct op over them passes its check (the real cache
    and reference on the CPU)."""
    from directkv_cute.reference import tables_attention_ref

    def fp8_op(q, cache, layer, tables, q_lens=None, softmax_scale=None, *, config=None, out=None,
               return_lse=False):
        assert isinstance(config, DecodeConfig)
        res, _ = tables_attention_ref(q, cache.host_pool, cache.hbm_pool, tables.page_table, tables.seq_lens, layer,
                                      list(q_lens) if q_lens else None, softmax_scale,
                                      host_scales=cache.host_scales, hbm_scales=cache.hbm_scales)
        out.copy_(res)
        return out

    space = get_space("decode_fp8")
    shape = TuneShape(8, 2, 128, batch=2, context=200, page_size=16)
    cfg = space.default_for(shape)
    assert space.is_legal(cfg, shape)
    obj = objective(fp8_op, kernel="decode_fp8")
    res = obj(cfg, shape)
    assert res["ok"], res
    cache = obj._setup.cache
    assert cache.dtype is torch.float8_e4m3fn and cache.compute_dtype is torch.bfloat16
    raw = cache.host_pool.view(torch.uint8)
    assert not torch.isnan(cache.host_pool.float()).any() and (raw >= 0x80).any() and (raw < 0x80).any()
    assert bool((cache.host_scales > 0).all())
    obj.close()


def test_the_q_tiled_objective_puts_every_page_in_hbm_and_forces_the_config():
    """kernel="q_tiled": the objective's cache holds every page in the HBM tier (the kernel reads
    HBM; staged host calls run it over copied pages), the tables the op gets carry their host copy
    (the route reads it), the config given is passed as is, and a correct op passes the check
    (the real cache and reference on the CPU); a wrong one fails it."""
    from directkv_cute.config import QTiledConfig
    from directkv_cute.reference import tables_attention_ref

    seen = []

    def q_tiled_op(q, cache, layer, tables, q_lens=None, softmax_scale=None, *, config=None, out=None,
                   return_lse=False):
        assert isinstance(config, QTiledConfig)
        assert bool((tables.page_table < 0).all()) and (tables.host_table < 0).all()
        assert tables.host_table.shape == tuple(tables.page_table.shape)
        assert tables.host_seq_lens == tuple(tables.seq_lens.tolist())
        seen.append(config)
        res, _ = tables_attention_ref(q, cache.host_pool, cache.hbm_pool, tables.page_table, tables.seq_lens, layer,
                                      list(q_lens) if q_lens else None, softmax_scale)
        out.copy_(res)
        return out

    space = get_space("q_tiled")
    shape = TuneShape(8, 2, 64, batch=3, context=200, q_len=96, page_size=16)
    cfg = QTiledConfig(tile_n=64, stages=2)
    assert space.is_legal(cfg, shape)
    page_bytes = 2 * 2 * 16 * 64 * 2  # hkv x (K, V) x page x d x bf16, one layer
    obj = objective(q_tiled_op, kernel="q_tiled", max_layers=1, max_hbm_bytes=2 * math.ceil(200 / 16) * page_bytes)
    res = obj(cfg, shape)
    assert res["ok"], res
    assert seen and all(c == cfg for c in seen)
    st = obj._setup
    cache = st.cache
    assert st.distinct == 2 and cache.num_pages("hbm") == 2 * math.ceil(200 / 16)  # two sequences fit, three rows
    assert all(cache.page_counts(s) == {"host": 0, "hbm": math.ceil(200 / 16)} for s in st.seq_ids)
    assert float(cache.hbm_pool.float().abs().sum()) > 0 and st.tables.page_table.shape[0] == 3
    assert not get_space("q_tiled").problems(cfg, shape)
    bad = objective(lambda *a, **k: q_tiled_op(*a, **k).add_(0.5), kernel="q_tiled")(cfg, shape)
    assert not bad["ok"] and "relative error" in bad["err"]
    illegal = obj(QTiledConfig(tile_n=32), shape)
    assert not illegal["ok"] and "tile_n 32 must be 64 or 128" in illegal["err"]
    obj.close()
