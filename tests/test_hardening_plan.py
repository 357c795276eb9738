"""Refusals of the plan / run API (``DirectKVAttention``) a hostile or careless caller meets on
the CPU path: a plan run over pages another sequence owns since, pools with fewer pages than the
plan reads, arguments of the wrong type or value, softmax scales whose scores overflow, and a plan
memo that would ignore the environment. Each refusal is one line, raised before anything is
written, a TypeError for a wrong type and a ValueError for a wrong value, naming the argument."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import directkv_cute as dk
from directkv_cute import attention as attention_mod
from directkv_cute.cache import KernelTables, PagedKVCache, StaleTablesError
from directkv_cute.env import EnvironmentVariableError
from directkv_cute.machine import DeviceInfo
from directkv_cute.runner import PoolView

L, H, HQ, D, P = 2, 2, 4, 64, 16


def make(host: int = 12, hbm: int = 4, window: int = 4) -> PagedKVCache:
    return PagedKVCache(L, H, D, P, host, hbm, dtype=torch.bfloat16, device="cpu", num_window_pages=window)


def kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, L, H, D, generator=g).to(torch.bfloat16),
            torch.randn(n, L, H, D, generator=g).to(torch.bfloat16))


def queries(n: int, seed: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, HQ, D, generator=g).to(torch.bfloat16)


def one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    return msg


# ---- 1. a plan is refused once a page it reads changed owner ---------------------------------------
def _free(cache, a):
    cache.free(a)


def _truncate(cache, a):
    cache.truncate(a, P)  # a's second page goes back to the free list


def _move(cache, a):
    cache.move_pages(a, [0], "hbm")  # a's first host page goes back to the free list


def _release_mirrors(cache, a):
    cache.release_mirrors(a, keep_partial=False)  # the plan reads the mirror: it goes back to the window


@pytest.mark.parametrize("change", [_free, _truncate, _move, _release_mirrors], ids=lambda f: f.__name__[1:])
def test_run_refuses_a_plan_whose_pages_changed_owner(change):
    cache = make()
    a = cache.add_sequence()
    cache.append(a, *kv(2 * P, 0))
    if change is _release_mirrors:
        assert cache.mirror(a, 0, 2 * P) == 2
    attn = dk.DirectKVAttention(cache)
    attn.plan([a], num_q_heads=HQ)
    q = queries(1)
    before = attn.run(q, 0).clone()
    change(cache, a)
    other = cache.add_sequence()
    cache.append(other, *kv(3 * P, 1))  # takes the pages (and window pages) given back
    out = torch.full_like(q, 3.0)
    with pytest.raises(StaleTablesError, match="plan again") as exc:
        attn.run(q, 0, out)
    assert "plan" in one_line(exc)
    assert isinstance(exc.value, ValueError)
    assert torch.equal(out, torch.full_like(q, 3.0))  # nothing written
    if change is not _free:  # planned again over the sequence as it is now, the run goes through
        attn.plan([a], num_q_heads=HQ)
        attn.run(q, 0)
    del before


def test_a_plan_survives_changes_that_move_no_page_it_reads():
    cache = make()
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.append(a, *kv(2 * P, 0))
    cache.append(b, *kv(P, 1))
    attn = dk.DirectKVAttention(cache)
    attn.plan([a], num_q_heads=HQ)
    q = queries(1)
    ref = attn.run(q, 1)
    c = cache.add_sequence()
    cache.append(c, *kv(P + 3, 2))  # new pages from the free list: no owner changes
    cache.append(b, *kv(4, 3))
    assert torch.equal(attn.run(q, 1), ref)


def test_plans_over_tables_the_cache_does_not_track_are_not_checked():
    cache = make()
    a = cache.add_sequence()
    cache.append(a, *kv(2 * P, 0))
    t = cache.kernel_tables([a])
    # A pool view (the vLLM path: vLLM owns the bookkeeping) over the same pools, tables with
    # generation -1: nothing to compare, the run reads what the tables name.
    view = PoolView(cache.host_pool, cache.hbm_pool)
    attn = dk.DirectKVAttention(view)
    attn.plan(tables=KernelTables(t.page_table, t.seq_lens, host_seq_lens=t.host_seq_lens, host_table=t.host_table),
              num_q_heads=HQ)
    cache.free(a)
    attn.run(queries(1), 0)
    # A plan over the cache run over pools given per call: the pools' owner keeps their pages.
    b = cache.add_sequence()
    cache.append(b, *kv(P, 1))
    attn = dk.DirectKVAttention(cache)
    attn.plan([b], num_q_heads=HQ)
    cache.move_pages(b, [0], "hbm")
    attn.run(queries(1), 0, pools=view)


# ---- 2. pools with fewer pages than the plan reads --------------------------------------------------
def test_run_refuses_pools_without_the_host_pages_the_plan_reads():
    cache = make()
    filler, a = cache.add_sequence(), cache.add_sequence()
    cache.append(filler, *kv(4 * P, 0))
    cache.append(a, *kv(2 * P, 1))  # host pages 4 and 5
    attn = dk.DirectKVAttention(cache)
    attn.plan([a], num_q_heads=HQ)
    q = queries(1)
    out = torch.full_like(q, 3.0)
    small = PoolView(cache.host_pool[:5], cache.hbm_pool)
    with pytest.raises(ValueError, match="pools") as exc:
        attn.run(q, 0, out, pools=small)
    assert "host page 5" in one_line(exc) and "5 host pages" in str(exc.value)
    assert torch.equal(out, torch.full_like(q, 3.0))
    ok = PoolView(cache.host_pool[:6], cache.hbm_pool)  # exactly the pages read
    assert torch.equal(attn.run(q, 0, pools=ok), attn.run(q, 0))


def test_run_refuses_pools_without_the_hbm_pages_the_plan_reads():
    cache = make()
    a = cache.add_sequence()
    cache.append(a, *kv(3 * P, 0))
    cache.move_pages(a, [0, 1, 2], "hbm")  # HBM pages 0, 1, 2
    attn = dk.DirectKVAttention(cache)
    attn.plan([a], num_q_heads=HQ)
    q = queries(1)
    for hbm in (cache.hbm_pool[:2], cache.hbm_pool[:0]):
        with pytest.raises(ValueError, match="pools") as exc:
            attn.run(q, 0, pools=PoolView(cache.host_pool, hbm))
        assert "HBM page 2" in one_line(exc)
    attn.run(q, 0, pools=PoolView(cache.host_pool[:1], cache.hbm_pool[:3]))


def test_the_window_pages_of_a_plan_count_as_hbm_pages():
    cache = make(hbm=2, window=4)
    a = cache.add_sequence()
    cache.append(a, *kv(P, 0))
    cache.mirror(a, 0, P)  # window page 0 is HBM pool page 2
    attn = dk.DirectKVAttention(cache)
    attn.plan([a], num_q_heads=HQ)
    with pytest.raises(ValueError, match="HBM page 2"):
        attn.run(queries(1), 0, pools=PoolView(cache.host_pool, cache.hbm_pool[:2]))


# ---- 3. arguments that must name themselves -----------------------------------------------------------
@pytest.fixture
def planned():
    cache = make()
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.append(a, *kv(2 * P, 0))
    cache.append(b, *kv(P + 1, 1))
    return cache, [a, b]


def test_run_refuses_a_q_that_is_not_a_tensor(planned):
    cache, ids = planned
    attn = dk.DirectKVAttention(cache)
    attn.plan(ids, num_q_heads=HQ)
    for q in (np.zeros((2, HQ, D), np.float32), [[0.0]], None):
        with pytest.raises(TypeError, match="^q must be a torch.Tensor") as exc:
            attn.run(q, 0)
        one_line(exc)


@pytest.mark.parametrize("kw, error, name", [
    (dict(cascade="yes"), TypeError, "cascade"),
    (dict(cascade=1), TypeError, "cascade"),
    (dict(cascade=None), TypeError, "cascade"),
    (dict(device_info="NVIDIA H200"), TypeError, "device_info"),
    (dict(device_info={"name": "cpu"}), TypeError, "device_info"),
    (dict(groups="yes"), TypeError, "groups"),
    (dict(groups=[0, 1]), TypeError, "groups"),
    (dict(groups=[[0], "1"]), TypeError, "groups"),
    (dict(groups=[[0, 1.0]]), TypeError, "groups"),
    (dict(groups=[[0, 2]]), ValueError, "groups"),
    (dict(groups=[[0, 1], [1]]), ValueError, "groups"),
    (dict(max_seq_len=float("nan")), TypeError, "max_seq_len"),
    (dict(max_seq_len=100.0), TypeError, "max_seq_len"),
    (dict(max_seq_len="100"), TypeError, "max_seq_len"),
    (dict(max_seq_len=True), TypeError, "max_seq_len"),
    (dict(max_seq_len=-1), ValueError, "max_seq_len"),
    (dict(max_seq_len=0), ValueError, "max_seq_len"),
])
def test_plan_names_a_bad_argument(planned, kw, error, name):
    cache, ids = planned
    attn = dk.DirectKVAttention(cache)
    with pytest.raises(error, match=name) as exc:
        attn.plan(ids, num_q_heads=HQ, **kw)
    assert type(exc.value) is error or issubclass(type(exc.value), error)
    one_line(exc)
    assert attn.current is None  # nothing planned


def test_plan_takes_the_arguments_it_documents(planned):
    cache, ids = planned
    attn = dk.DirectKVAttention(cache)
    for kw in (dict(cascade=False), dict(cascade=np.bool_(True)), dict(groups=[[0, 1]]), dict(groups=((0,), (1,))),
               dict(groups=[[np.int64(1)], [0]]), dict(max_seq_len=np.int64(40)), dict(max_seq_len=4096),
               dict(device_info=DeviceInfo.for_cpu())):
        attn.plan(ids, num_q_heads=HQ, **kw)
        attn.run(queries(2), 0)


# ---- 4. softmax scales whose scores cannot be represented ----------------------------------------------
@pytest.mark.parametrize("scale, error", [
    (1e38, ValueError), (1e5, ValueError), (-0.125, ValueError), (0.0, ValueError), (-1e38, ValueError),
    (float("nan"), ValueError), (float("inf"), ValueError), (True, TypeError), ("0.125", TypeError),
    (torch.tensor(0.125), TypeError),
])
def test_softmax_scale_outside_its_range_is_refused_in_plan_and_run(planned, scale, error):
    cache, ids = planned
    attn = dk.DirectKVAttention(cache)
    with pytest.raises(error, match="softmax_scale") as exc:
        attn.plan(ids, num_q_heads=HQ, softmax_scale=scale)
    one_line(exc)
    attn.plan(ids, num_q_heads=HQ)
    q, out = queries(2), torch.full((2, HQ, D), 3.0, dtype=torch.bfloat16)
    with pytest.raises(error, match="softmax_scale") as exc:
        attn.run(q, 0, out, softmax_scale=scale)
    one_line(exc)
    assert torch.equal(out, torch.full_like(out, 3.0))
    with pytest.raises(error, match="softmax_scale"):
        dk.paged_attention(q, cache, 0, ids, softmax_scale=scale)


def test_the_softmax_scale_range_message_gives_the_range(planned):
    cache, ids = planned
    with pytest.raises(ValueError, match=r"\(0, 10000") as exc:
        dk.DirectKVAttention(cache).plan(ids, num_q_heads=HQ, softmax_scale=1e38)
    one_line(exc)


def test_scales_inside_the_range_run_and_stay_finite(planned):
    cache, ids = planned
    attn = dk.DirectKVAttention(cache)
    attn.plan(ids, num_q_heads=HQ)
    for scale in (1e-6, 1 / math.sqrt(D), 1.0, 1e4, np.float32(0.125)):
        o = attn.run(queries(2), 0, softmax_scale=scale)
        assert torch.isfinite(o.float()).all()


# ---- 5. the plan memo keys on the environment the planner reads --------------------------------------
H200 = DeviceInfo("NVIDIA H200", sms=132, total_memory=141 * 2**30)


def _plan_gpu(cache, ids):
    """A GPU plan (H200's profile) of a CPU cache: the profile lookup runs, the memo is used."""
    return dk.DirectKVAttention(cache).plan(ids, q_lens=[1, 1], num_q_heads=HQ, device_info=H200, cascade=False)


@pytest.mark.filterwarnings("ignore:.*no tuned:UserWarning")
def test_the_plan_memo_obeys_a_change_of_require_profile(planned, monkeypatch):
    cache, ids = planned
    monkeypatch.setattr(attention_mod, "_RECENT", None)
    monkeypatch.delenv("DIRECTKV_REQUIRE_PROFILE", raising=False)
    _plan_gpu(cache, ids)
    monkeypatch.setenv("DIRECTKV_REQUIRE_PROFILE", "yes please")
    with pytest.raises(EnvironmentVariableError, match="DIRECTKV_REQUIRE_PROFILE") as exc:
        _plan_gpu(cache, ids)
    one_line(exc)
    # "exact": the memoized shape gets what a shape planned for the first time gets
    monkeypatch.setenv("DIRECTKV_REQUIRE_PROFILE", "exact")
    try:
        fresh = ("plan", _plan_gpu(cache, ids))
    except ValueError as e:
        fresh = ("error", type(e))
    monkeypatch.setattr(attention_mod, "_RECENT", None)
    try:
        first = ("plan", _plan_gpu(cache, ids))
    except ValueError as e:
        first = ("error", type(e))
    assert fresh[0] == first[0] and (fresh[0] == "plan" or fresh[1] is first[1])
    assert fresh[0] == "error", "this shape has no exact H200 profile entry: exact must refuse it"
    monkeypatch.delenv("DIRECTKV_REQUIRE_PROFILE")
    _plan_gpu(cache, ids)  # unset again: planned as before
