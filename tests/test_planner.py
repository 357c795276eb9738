"""CPU tests of the plan-once / run-per-layer API (``DirectKVAttention``), the plan as a value,
the cascade's planning, and the machine model in the profile."""

from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np
import pytest
import torch

import directkv_cute as dk
from directkv_cute.machine import CONSERVATIVE, H200, DeviceInfo, MachineModel
from directkv_cute.planner import ROUTES, CallShape, DefaultConfigs, ProfileConfigs, plan_attention
from directkv_cute.sparse import SparseBudget
from directkv_cute.tuning import profiles as P

FACTS = DeviceInfo("Test GPU without a profile", 132, 140 * 2**30, copies_ahead=True)


@pytest.fixture
def cache(randn):
    c = dk.PagedKVCache(3, 2, 64, 16, num_host_pages=60, num_hbm_pages=12, dtype=torch.bfloat16, device="cpu")
    ids = []
    for n in (70, 5, 33):
        sid = c.add_sequence()
        c.append(sid, randn(n, 3, 2, 64), randn(n, 3, 2, 64))
        ids.append(sid)
    c.set_hbm_fraction(ids[0], 0.5, "strided")
    return c, ids


def test_plan_once_run_every_layer_matches_the_reference(cache, randn):
    c, ids = cache
    attn = dk.DirectKVAttention(c)
    plan = attn.plan(ids, q_lens=[1, 5, 4], num_q_heads=8, return_lse=True)
    assert attn.current is plan and plan.route == "reference" and "reference" in plan.explain()
    q = randn(10, 8, 64)
    for layer in range(3):
        out = torch.empty_like(q)
        o, lse = attn.run(q, layer, out)
        ro, rl = dk.paged_attention_ref(q, c, layer, ids, [1, 5, 4])
        assert o is out and torch.equal(o, ro) and torch.equal(lse, rl)
    o2 = attn.run(q, 1, softmax_scale=0.5)[0]
    assert torch.equal(o2, dk.paged_attention_ref(q, c, 1, ids, [1, 5, 4], 0.5)[0])


def test_plan_and_run_refuse_bad_input_before_any_work(cache, randn):
    c, ids = cache
    attn = dk.DirectKVAttention(c)
    with pytest.raises(RuntimeError, match="before plan"):
        attn.run(randn(3, 8, 64), 0)
    with pytest.raises(ValueError, match="exactly one"):
        attn.plan(num_q_heads=8)
    with pytest.raises(ValueError, match="num_q_heads"):
        attn.plan(ids, num_q_heads=7)
    with pytest.raises(ValueError, match="exceeds its sequence's length"):
        attn.plan(ids, q_lens=[1, 6, 1], num_q_heads=8)
    with pytest.raises(ValueError, match="softmax_scale"):
        attn.plan(ids, num_q_heads=8, softmax_scale=float("nan"))
    attn.plan(ids, num_q_heads=8)
    with pytest.raises(ValueError, match="heads"):
        attn.run(randn(3, 4, 64), 0)
    with pytest.raises(IndexError, match="layer 3"):
        attn.run(randn(3, 8, 64), 3)
    with pytest.raises(ValueError, match="rows"):
        attn.run(randn(4, 8, 64), 0)


def test_a_shared_prefix_plans_the_cascade_and_runs_it_like_the_reference(randn):
    c = dk.PagedKVCache(1, 2, 64, 16, num_host_pages=200, num_hbm_pages=0, dtype=torch.bfloat16, device="cpu")
    root = c.add_sequence()
    c.append(root, randn(640, 1, 2, 64), randn(640, 1, 2, 64))
    kids = [c.fork(root) for _ in range(3)]
    for k in kids:
        c.append(k, randn(3, 1, 2, 64), randn(3, 1, 2, 64))
    attn = dk.DirectKVAttention(c)
    plan = attn.plan(kids, q_lens=[3, 3, 3], num_q_heads=8, return_lse=True)
    tree = plan.detail.cascade
    assert plan.route == "cascade" and len(plan.detail.passes) == 1 + len(tree.spans)
    assert tree.host_pages_read < tree.host_pages_naive and "shared span" in plan.explain()
    q = randn(9, 8, 64)
    o, lse = attn.run(q, 0)
    ro, rl = dk.paged_attention_ref(q, c, 0, kids, [3, 3, 3])
    assert torch.allclose(o.float(), ro.float(), atol=2e-2) and torch.allclose(lse, rl, atol=1e-3)
    flat = attn.plan(kids, q_lens=[3, 3, 3], num_q_heads=8, cascade=False)
    assert flat.route == "reference"


def test_a_batch_sharing_a_long_prompt_on_a_gpu_is_planned_as_a_cascade_or_one_staged_call():
    """64 forks of a 32k prompt, nothing own: the staged kernel's reads of every sequence's pages
    bind, so the cascade; 16 forks with 8k of their own: one staged call of the batch."""
    from test_architecture_routing import forks

    p = plan_attention(forks(64, 0), FACTS, H200, DefaultConfigs())
    span = p.detail.passes[1]
    assert p.route == "cascade" and span.n_pseudo == 2 and span.plan.route == "q_tiled_staged"
    p = plan_attention(forks(16, 8192), FACTS, H200, DefaultConfigs())
    assert p.route == "cascade_staged" and p.detail.inner.route == "q_tiled_staged"


def test_every_route_is_reached_and_named_once():
    assert len(set(ROUTES)) == len(ROUTES)
    seen = set()
    shapes = [([4096], [1], "host", False), ([8192], [64], "host", False), ([32768], [2048], "hbm", False),
              ([32768], [2048], "host", False), ([4096], [1], "host", True), ([32768], [1], "host", True),
              ([32768], [4], "host", True), ([8192], [2048], "host", True), ([8192], [64], "host", True)]
    for lens, q, tier, fp8 in shapes:
        s = CallShape.example(lens, q, tier=tier, page_dtype=torch.float8_e4m3fn if fp8 else None)
        seen.add(plan_attention(s, FACTS, H200, DefaultConfigs()).route)
    sparse = CallShape.example([32768]).replace(sparse=SparseBudget(fraction=1 / 8))
    seen.add(plan_attention(sparse, FACTS, H200, DefaultConfigs()).route)
    seen |= {"cascade", "cascade_staged", "reference"}  # planned in the tests above
    assert seen == set(ROUTES)


def _sub_plans(plan):
    yield plan
    for sub in (plan.capture, getattr(plan.detail, "inner", None),
                *(p.plan for p in getattr(plan.detail, "passes", ()))):
        if sub is not None:
            yield from _sub_plans(sub)


def test_every_plan_and_fallback_knows_its_call():
    """The runner compiles and launches from ``plan.shape``: the plan, its capture fallback, an
    inner plan and every cascade pass carry the shape of the call they run."""
    shapes = [CallShape.example(lens, q, tier=tier, page_dtype=torch.float8_e4m3fn if fp8 else None)
              for lens, q, tier, fp8 in [([4096], [1], "host", False), ([8192], [64], "host", False),
                                         ([32768], [2048], "hbm", False), ([32768], [2048], "host", False),
                                         ([32768], [1], "host", False), ([4096], [1], "host", True),
                                         ([32768], [1], "host", True), ([32768], [4], "host", True),
                                         ([8192], [2048], "host", True), ([8192], [64], "host", True)]]
    shapes.append(CallShape.example([32768]).replace(sparse=SparseBudget(fraction=1 / 8)))
    checked = 0
    for shape in shapes:
        for sub in _sub_plans(plan_attention(shape, FACTS, H200, DefaultConfigs())):
            assert sub.shape is not None and sub.machine, (sub.route, shape.seq_lens, shape.q_lens)
            checked += 1
    assert checked > len(shapes)  # some plans carry fallbacks or inner plans


def test_a_plan_made_again_for_the_same_values_is_the_same_plan(monkeypatch):
    """Through the API, a shape planned again (another layer's call) reuses the plan: by the
    values of the shape, never by an object's identity."""
    from directkv_cute import attention

    monkeypatch.setattr(attention, "_RECENT", None)
    made = []
    real = attention.plan_attention
    monkeypatch.setattr(attention, "plan_attention", lambda *a, **k: made.append(1) or real(*a, **k))
    configs = ProfileConfigs(FACTS.name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, _ = attention._planned(CallShape.example([32768], [2048]), FACTS, H200, configs, None, None)
        b, _ = attention._planned(CallShape.example([32768], [2048]), FACTS, H200, configs, None, None)
        assert a is b and len(made) == 1
        other = CallShape.example([32768], [2048], tier="window")
        c, _ = attention._planned(other, FACTS, H200, configs, None, None)
        assert c is not a and len(made) == 2
        attention._planned(CallShape.example([32768], [2048]), dataclasses.replace(FACTS, capturing=True), H200,
                           configs, None, None)
        assert len(made) == 3
        # an explicit staging request is part of the values: another request, another plan
        from directkv_cute.config import QTiledConfig
        from directkv_cute.planner import StagingRequest

        shape = CallShape.example([32768], [2048])
        d, _ = attention._planned(shape, FACTS, H200, configs, QTiledConfig(), None)
        e, _ = attention._planned(shape, FACTS, H200, configs, QTiledConfig(), None, StagingRequest(piece_pages=4))
        f, _ = attention._planned(shape, FACTS, H200, configs, QTiledConfig(), None, StagingRequest(piece_pages=4))
        assert len(made) == 5 and e is f and e != d and e.staging.piece_pages != d.staging.piece_pages


def test_the_machine_section_of_a_profile_is_checked_and_kept(tmp_path):
    doc = P.Profile(metadata=P.make_metadata({"gpu_name": "G", "sm_count": 132, "smem_optin_bytes": 232448,
                                              "compute_capability": "9.0"},
                                             objective="gpu"), machine=H200.to_dict())
    back = P.parse_profile(doc.to_yaml())
    assert MachineModel.from_dict("G", back.machine) == dataclasses.replace(H200, name="G")
    bad = doc.to_yaml().replace("link_gbps: 51.0", "link_gbps: -1")
    with pytest.raises(P.ProfileError, match="machine.*positive"):
        P.parse_profile(bad)
    with pytest.raises(P.ProfileError, match="machine.*missing"):
        P.parse_profile(doc.to_yaml().replace("flag_ms: 0.0015, ", ""))
    # a save over a profile keeps its machine model
    path = tmp_path / "G.yaml"
    P.save_profile(doc, path)
    P.save_profile(dataclasses.replace(doc, machine=None), path)
    assert P.load_profile(path).machine == H200.to_dict()


def test_the_conservative_model_only_drops_the_copy_engines_edge():
    assert CONSERVATIVE.memcpy_gbps == CONSERVATIVE.link_gbps
    assert dataclasses.replace(CONSERVATIVE, memcpy_gbps=H200.memcpy_gbps, name=H200.name) == H200


def test_cpu_facts_plan_the_reference():
    p = plan_attention(CallShape.example([32768], [2048]), DeviceInfo.for_cpu(), CONSERVATIVE, DefaultConfigs())
    assert p.route == "reference" and p.staging is None
    assert math.isfinite(DeviceInfo.for_cpu().workspace_cap)


@pytest.mark.parametrize("ahead", [False, True])
def test_a_decode_over_pages_held_descending_is_planned_as_over_ascending_ones(ahead):
    """A long decode whose pages an engine handed out last to first (vLLM frees a request's
    blocks in reverse): the staged copy still takes one call per piece, so the H200's plan is
    the same route and cost as over ascending pages, with the staged table following the pages."""
    facts = DeviceInfo("NVIDIA H200", 132, 141 * 2**30, copies_ahead=ahead)
    up = CallShape.example([65536], [1], back_to_back=True, max_seq_len=65536)
    down = up.replace(host_table=up.host_table[:, ::-1].copy())
    plans = [plan_attention(s, facts, H200, DefaultConfigs()) for s in (up, down)]
    assert [p.route for p in plans] == ["q_tiled_staged"] * 2
    assert plans[0].staging.copy_calls == plans[1].staging.copy_calls == (16, 0)
    assert plans[0].explain() == plans[1].explain() and plans[0].choice == plans[1].choice
    sources = {}  # staging page -> host page, from the copies
    for piece in plans[1].staging.pieces:
        for r in piece:
            sources.update({r.dst + k: r.src + k for k in range(r.count)})
    assert [sources[-int(e) - 1] for e in plans[1].staging.table[0]] == down.host_table[0].tolist()
