"""The planner's decisions over a fixed set of calls are the recorded ones (tests/data/plan_decisions.json).

A safety net for changes to the planner's code that must not change what it decides: every case
(a call shape, the GPU's facts, the machine model, the tuned configs, an explicit config or
staging request, the environment) is planned twice, once with the shipped H200 profile
(``profiles/NVIDIA_H200.yaml``) as the only profile there is and once with no profile at all, and
each plan's canonical summary must equal the recorded one: the route, the kernel and its config,
the split counts, the Q-tiled layout, the staging plan (pages, pieces, copies, digests of its runs
and table), copies ahead, the FP8 parts and head groups, the inner plan, the cascade (spans and
every pass's plan), the plan a CUDA graph capture runs instead, the cost model's verdict (floats
rounded), the reasons, and ``plan.explain()``; or the error the call is refused with.

Nothing outside the repository reaches it: every ``DIRECTKV_*`` variable is cleared (a case sets
the ones it is about), the profile folders (``DIRECTKV_PROFILE_DIR``, the user folder, the
bundled one) are empty temporary folders but for the one copy of the shipped profile, and paths
in messages are written relative to them.

A change of decisions that is meant (a re-tuned profile, a new rule of the planner) is recorded
again with

    python tests/test_plan_decisions.py --write

and the diff of the JSON file reviewed; ``python tests/test_plan_decisions.py`` (no argument)
prints the cases whose decisions differ from the file, as the test does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import hashlib
import json
import math
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "plan_decisions.json"
SHIPPED_PROFILE = ROOT / "profiles" / "NVIDIA_H200.yaml"
MODES = ("shipped_profile", "no_profile")
FORMAT = 1
SHOWN_CASES = 5  # differing cases a failure shows in full
SHOWN_LINES = 40  # differing fields shown per case

# ---- the inputs -------------------------------------------------------------------------------
GIB = 2**30
GPUS = {  # name, SMs, memory
    "H200": ("NVIDIA H200", 132, 140 * GIB),
    "H100": ("NVIDIA H100 80GB HBM3", 132, 80 * GIB),
    "untuned": ("Test GPU without a profile", 132, 140 * GIB),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _ints(v, batch: int) -> list[int]:
    return [int(v)] * batch if isinstance(v, int) else [int(x) for x in v]


def _forks_shape(spec: dict):
    """``batch`` sequences forked from one prompt of ``prompt`` tokens, each with ``own`` tokens
    of its own plus the step's (``q`` query tokens, at least one own page each)."""
    from directkv_cute.planner import CallShape

    f = spec["forks"]
    batch, prompt, own, q = f["batch"], f.get("prompt", 32768), f.get("own", 0), f.get("q", 1)
    page = spec.get("page", 64)
    prompt_pages = prompt // page
    own_tokens = own + q
    own_pages = math.ceil(own_tokens / page)
    table = np.zeros((batch, prompt_pages + own_pages), dtype=np.int32)
    table[:, :prompt_pages] = np.arange(prompt_pages)
    for b in range(batch):
        table[b, prompt_pages:] = prompt_pages + b * own_pages + np.arange(own_pages)
    if f.get("hbm_prompt"):
        table[:, :prompt_pages] = -table[:, :prompt_pages] - 1
    dtype = DTYPES[spec.get("dtype", "bf16")]
    compute = torch.bfloat16 if dtype.itemsize == 1 else dtype
    groups = spec.get("groups")
    return CallShape(table, (prompt + own_tokens,) * batch, (q,) * batch, spec.get("hq", 32), spec.get("hkv", 8),
                     spec.get("d", 128), page, dtype, compute, spec.get("layers", 32),
                     prompt_pages + batch * own_pages, table.shape[1], back_to_back=spec.get("b2b", False),
                     cascade=spec.get("cascade", True),
                     groups=None if groups is None else tuple(tuple(g) for g in groups))


def _cache(c: dict):
    """(a small CPU ``PagedKVCache`` with pages reserved, none written; its sequences' ids; their
    query lengths)."""
    import directkv_cute as dk

    page, hkv, d = c.get("page", 16), c.get("hkv", 2), c.get("d", 64)
    cache = dk.PagedKVCache(c.get("layers", 2), hkv, d, page, num_host_pages=c["host_pages"],
                            num_hbm_pages=c.get("hbm_pages", 0), dtype=DTYPES[c.get("dtype", "bf16")], device="cpu")
    ids = []
    for parts in c["seqs"]:  # [[tier, tokens], ...] extended in order
        sid = cache.add_sequence()
        for tier, n in parts:
            cache.extend(sid, n, tier)
        ids.append(sid)
    for fork in c.get("forks", []):  # [parent index, tokens of its own]
        kid = cache.fork(ids[fork[0]])
        cache.extend(kid, fork[1], "host")
        ids.append(kid)
    for i, frac in c.get("hbm_fraction", []):
        cache.set_hbm_fraction(ids[i], frac, "strided")
    return cache, ids, _ints(c.get("q", 1), len(ids))


def _cache_shape(spec: dict):
    """A call over a cache (``_cache``), summarised by ``CallShape.of`` from ``kernel_tables``:
    how a caller's cache reaches the planner."""
    from directkv_cute.planner import CallShape

    c = spec["cache"]
    cache, ids, q = _cache(c)
    tables = cache.kernel_tables(ids, back_to_back=c.get("b2b", False))
    return CallShape.of(cache, tables, q, c.get("hq", 8), max_seq_len=c.get("max_seq_len"),
                        cascade=c.get("cascade", False), groups=c.get("groups"))


def _api_plan(case: dict, device):
    """The plan ``DirectKVAttention.plan(seq_ids, ...)`` makes for a call over a cache (``_cache``):
    tables marked back to back, the cascade where it pays, the machine model and configs its own
    (the profile's) unless the case names others."""
    import directkv_cute as dk
    from directkv_cute.planner import StagingRequest

    c = case["shape"]["api"]
    cache, ids, q = _cache(c)
    machine = None if case.get("machine", "profile") == "profile" else build_machine(case["machine"], device)
    configs = None if case.get("configs", "profile") == "profile" else build_configs(case["configs"], device)
    staging = StagingRequest(**case["staging"]) if "staging" in case else None
    attn = dk.DirectKVAttention(cache, machine=machine, configs=configs)
    return attn.plan(ids, q_lens=q, num_q_heads=c.get("hq", 8), max_seq_len=c.get("max_seq_len"),
                     config=build_config(case.get("config")), staging=staging, cascade=c.get("cascade", True),
                     groups=c.get("groups"), device_info=device)


def build_shape(spec: dict):
    from directkv_cute.planner import CallShape

    if "forks" in spec:
        return _forks_shape(spec)
    if "cache" in spec:
        return _cache_shape(spec)
    batch = spec.get("batch", 1)
    lens = _ints(spec["lens"], batch)
    q = _ints(spec.get("q", 1), len(lens))
    dtype = DTYPES[spec.get("dtype", "bf16")]
    compute = DTYPES[spec["compute"]] if "compute" in spec else None
    s = CallShape.example(lens, q, num_q_heads=spec.get("hq", 32), num_kv_heads=spec.get("hkv", 8),
                          head_dim=spec.get("d", 128), page_size=spec.get("page", 64), tier=spec.get("tier", "host"),
                          page_dtype=dtype, compute_dtype=compute, num_layers=spec.get("layers", 32),
                          back_to_back=spec.get("b2b", False), max_seq_len=spec.get("max_seq_len"))
    table = s.host_table.copy()
    n_pages = [math.ceil(n / s.page_size) for n in lens]
    if spec.get("hbm_every"):  # every k-th page of each sequence in HBM
        k = spec["hbm_every"]
        for b, n in enumerate(n_pages):
            live = table[b, :n]
            live[::k] = np.where(live[::k] >= 0, -live[::k] - 1, live[::k])
    if spec.get("descending"):  # each sequence's pages handed out last to first
        for b, n in enumerate(n_pages):
            table[b, :n] = table[b, :n][::-1].copy()
    changes = {"host_table": table}
    if spec.get("cascade"):
        changes["cascade"] = True
    if "groups" in spec:
        changes["groups"] = tuple(tuple(g) for g in spec["groups"])
    if "hbm_pages" in spec:
        changes["hbm_pages"] = spec["hbm_pages"]
    if "sparse" in spec:
        from directkv_cute.sparse import SparseBudget

        changes["sparse"] = SparseBudget(**spec["sparse"])
    s = s.replace(**changes)
    if spec.get("bare"):  # the dispatcher's op: device tables only
        s = s.replace(host_table=None)
    return s


def build_device(spec: dict):
    from directkv_cute.machine import DeviceInfo

    if spec.get("gpu") == "cpu":
        return DeviceInfo.for_cpu()
    name, sms, memory = GPUS[spec.get("gpu", "H200")]
    return DeviceInfo(name, sms, memory, capturing=spec.get("capturing", False),
                      copies_ahead=spec.get("copies_ahead", True),
                      staging_cap=int(spec.get("staging_cap_mib", 0) * 2**20),
                      workspace_cap=float(spec.get("workspace_cap_bytes", 0.0)))


def build_machine(name: str, device):
    from directkv_cute.machine import CONSERVATIVE, H200
    from directkv_cute.tuning.lookup import machine_for

    if name == "H200":
        return H200
    if name == "conservative" or device.cpu:
        return CONSERVATIVE
    return machine_for(device.name)  # the profile's machine model, else the conservative default


def build_configs(name: str, device):
    from directkv_cute.planner import DefaultConfigs, ProfileConfigs

    return DefaultConfigs() if name == "default" else ProfileConfigs(device.name)


def build_config(spec):
    from directkv_cute.config import DecodeConfig, QTiledConfig

    if spec is None:
        return None
    (kind, fields), = spec.items()
    return (DecodeConfig if kind == "decode" else QTiledConfig)(**fields)


def plan_case(case: dict):
    """(the call's shape, its plan) of one case in the current environment; what refuses it raises."""
    from directkv_cute.cascade import plan_cascade
    from directkv_cute.planner import StagingRequest, plan_attention

    device = build_device(case.get("device", {}))
    if "api" in case["shape"]:
        plan = _api_plan(case, device)
        return plan.shape, plan
    shape = build_shape(case["shape"])
    machine = build_machine(case.get("machine", "profile"), device)
    configs = build_configs(case.get("configs", "profile"), device)
    staging = StagingRequest(**case["staging"]) if "staging" in case else None
    cascade_plan = None
    if "cascade_plan" in case:
        cascade_plan = plan_cascade(shape.host_table, shape.seq_lens, shape.q_lens, shape.page_size,
                                    groups=shape.groups, **case["cascade_plan"])
    return shape, plan_attention(shape, device, machine, configs, build_config(case.get("config")),
                                 staging=staging, cascade_plan=cascade_plan)


# ---- the cases --------------------------------------------------------------------------------
DECODE = [(1, 1024, 1), (1, 4096, 1), (1, 16384, 1), (1, 32768, 1), (1, 131072, 1), (1, 262144, 1), (4, 32768, 1),
          (16, 4096, 1), (16, 32768, 1), (64, 4096, 1), (64, 32768, 1), (64, 131072, 1)]
MULTI = [(1, 8192, 4), (1, 8192, 16), (1, 32768, 64), (4, 16384, 64), (16, 32768, 64)]
CHUNK = [(1, 2048, 2048), (1, 8192, 512), (1, 8192, 2048), (1, 8192, 8192), (1, 32768, 512), (1, 32768, 2048),
         (1, 32768, 8192), (1, 131072, 2048), (1, 131072, 8192), (1, 262144, 8192), (2, 65536, 4096),
         (8, 16384, 512)]
SOME = [(1, 4096, 1), (1, 32768, 1), (16, 32768, 1), (1, 8192, 64), (1, 8192, 512), (1, 32768, 2048),
        (1, 32768, 8192), (4, 16384, 64)]
FEW = [(1, 32768, 1), (1, 8192, 64), (1, 8192, 512), (1, 32768, 2048)]
# One of each kind of call (decode short/long/batched, windows, chunks, prefill, FP8), for the
# device, machine and configs variants.
REPRESENTATIVE = [
    dict(lens=4096), dict(lens=32768), dict(lens=32768, batch=16), dict(lens=8192, q=64), dict(lens=8192, q=512),
    dict(lens=32768, q=2048), dict(lens=32768, q=8192), dict(lens=32768, q=2048, tier="window"),
    dict(lens=32768, q=2048, tier="hbm"), dict(lens=32768, dtype="e4m3"), dict(lens=32768, q=4, dtype="e4m3"),
    dict(lens=8192, q=2048, dtype="e4m3"), dict(lens=8192, q=64, dtype="e4m3")]
GEOMETRIES = [dict(hq=8, hkv=8), dict(hq=16, hkv=8), dict(hq=28, hkv=4), dict(hq=64, hkv=8), dict(hq=96, hkv=8),
              dict(hq=32, hkv=2), dict(hq=64, hkv=4), dict(hq=72, hkv=1), dict(hq=8, hkv=1)]


def _call(batch, lens, q, **kw) -> dict:
    out = {"lens": lens, "q": q}
    if batch != 1:
        out["batch"] = batch
    out.update(kw)
    return out


def cases() -> list[dict]:
    """Every case: {"shape": ..., "device": ..., "machine": ..., "configs": ..., "config": ...,
    "staging": ..., "cascade_plan": ..., "env": ...} (defaults left out: the H200's facts with
    copies ahead, the profile's machine model and configs, no explicit config, no variable set)."""
    out: list[dict] = []

    def add(shape, **kw):
        out.append({"shape": shape, **kw})

    # The default geometry (Llama-8B-like: 32/8 heads, d 128, pages of 64 bf16) over the tiers.
    for batch, lens, q in DECODE + MULTI + CHUNK:
        for tier in ("host", "hbm", "window"):
            add(_call(batch, lens, q, tier=tier))
    for batch, lens, q in MULTI + CHUNK + [(1, 32768, 1), (16, 32768, 1)]:  # a step's layers, back to back
        for tier in ("host", "window"):
            add(_call(batch, lens, q, tier=tier, b2b=True))
    # GQA groups 1..72, KV heads 1..8.
    for geometry in GEOMETRIES:
        for batch, lens, q in SOME:
            add(_call(batch, lens, q, **geometry))
        for batch, lens, q in FEW:
            add(_call(batch, lens, q, tier="hbm", **geometry))
    # Page sizes, head dims, 16-bit dtypes, layer counts.
    for page in (16, 32, 128):
        for batch, lens, q in SOME:
            add(_call(batch, lens, q, page=page))
    for batch, lens, q in FEW:
        add(_call(batch, lens, q, page=16, tier="hbm"))
        add(_call(batch, lens, q, page=16, hq=28, hkv=4))
        add(_call(batch, lens, q, d=64, tier="hbm"))
        add(_call(batch, lens, q, dtype="fp16"))
        add(_call(batch, lens, q, layers=1))
    for batch, lens, q in SOME:
        add(_call(batch, lens, q, d=64))
    # FP8 pages.
    for batch, lens, q in [(1, 4096, 1), (1, 32768, 1), (4, 32768, 1), (16, 32768, 1), (1, 131072, 1), (64, 4096, 1),
                           (1, 32768, 4), (1, 32768, 16), (1, 8192, 64), (1, 8192, 512), (1, 8192, 2048),
                           (1, 32768, 2048), (1, 32768, 8192), (4, 16384, 64)]:
        for tier in ("host", "hbm", "window"):
            add(_call(batch, lens, q, dtype="e4m3", tier=tier))
    for batch, lens, q in FEW:
        add(_call(batch, lens, q, dtype="e5m2"))
        add(_call(batch, lens, q, dtype="e4m3", compute="fp16"))
        add(_call(batch, lens, q, dtype="e4m3", d=64))
        add(_call(batch, lens, q, dtype="e4m3", page=16, hq=64, hkv=8))
    add(dict(lens=[20000, 9000], q=[2048, 1000], page=16, dtype="e4m3"))
    add(dict(lens=[32768, 30000], q=[1, 1], dtype="e4m3"))
    add(dict(lens=[40000, 3000], q=[512, 16], dtype="e4m3"), device=dict(staging_cap_mib=200))
    # Uneven batches, mixed tiers, pages held in odd orders, hints.
    for lens, q in [([32768, 5000], [64, 7]), ([40000, 3000], [512, 16]), ([20000, 9000], [2048, 1000]),
                    ([100, 50000, 7000, 1], [1, 1, 1, 1]), ([32768, 32768], [1, 2048]), ([8192, 3000], [8192, 100]),
                    ([65536, 1024, 1024, 1024], [2048, 64, 64, 64])]:
        add(dict(lens=lens, q=q))
        add(dict(lens=lens, q=q, tier="window", b2b=True))
    for k in (2, 4, 16):
        for batch, lens, q in [(1, 32768, 1), (16, 32768, 1), (1, 32768, 2048), (1, 131072, 1)]:
            add(_call(batch, lens, q, hbm_every=k))
    for batch, lens, q in [(1, 65536, 1), (4, 32768, 1), (1, 32768, 2048)]:
        add(_call(batch, lens, q, descending=True, b2b=True, max_seq_len=lens))
        add(_call(batch, lens, q, b2b=True, max_seq_len=lens))
    for batch, lens, q in [(1, 32768, 1), (16, 4096, 1), (1, 8192, 64)]:
        add(_call(batch, lens, q, max_seq_len=131072))
        add(_call(batch, lens, q, max_seq_len=2048))
    for batch, lens, q in [(1, 32768, 2048), (1, 8192, 2048), (16, 32768, 1)]:  # page x layers overflows int32
        add(_call(batch, lens, q, tier="window", hbm_pages=2**26))
        add(_call(batch, lens, q, hbm_every=4, hbm_pages=2**26))
    for shape in (dict(lens=32768), dict(lens=32768, q=8192), dict(lens=32768, dtype="e4m3"),
                  dict(lens=8192, q=2048, dtype="e4m3"), dict(lens=32768, q=64, tier="hbm")):
        add({**shape, "bare": True})
    # The GPU's facts: capture, copies ahead, other GPUs, caps (given, and from the environment).
    for shape in REPRESENTATIVE:
        add(shape, device=dict(capturing=True, copies_ahead=False))
        add(shape, device=dict(gpu="H100"))
        add(shape, device=dict(gpu="untuned"), machine="H200", configs="default")
        add(shape, configs="default")
        add(shape, machine="conservative")
        add(shape, machine="H200")  # the H200's rates whatever the profile
    for shape in REPRESENTATIVE[:9]:
        add({**shape, "b2b": True}, device=dict(copies_ahead=False))
        add({**shape, "b2b": True}, device=dict(gpu="H100"))
    for shape in (dict(lens=32768, q=2048), dict(lens=32768, q=2048, cascade=True), dict(lens=4096, dtype="e4m3")):
        add(shape, device=dict(gpu="cpu"))
    for shape in (dict(lens=32768), dict(lens=32768, q=8192), dict(lens=32768, dtype="e4m3"),
                  dict(lens=8192, q=2048, dtype="e4m3"), dict(lens=32768, q=2048, tier="window", b2b=True)):
        add(shape, device=dict(staging_cap_mib=1))
        add(shape, device=dict(staging_cap_mib=10))
        add(shape, env={"DIRECTKV_MAX_STAGING_GB": "0.05"})
    for shape in (dict(lens=32768, q=64, tier="hbm"), dict(lens=32768, q=8192), dict(lens=131072, q=64, batch=16)):
        add(shape, device=dict(workspace_cap_bytes=1.0))
        add(shape, env={"DIRECTKV_MAX_WORKSPACE_GB": "0.001"})
    add(dict(lens=32768, q=2048), env={"DIRECTKV_MAX_STAGING_GB": "0", "DIRECTKV_STAGE_OVERLAP": "0",
                                        "DIRECTKV_DISK_CACHE": "0"})
    for mode in ("1", "exact"):
        for shape in (dict(lens=32768), dict(lens=32768, q=2048), dict(lens=32768, q=2048, tier="hbm"),
                      dict(lens=4096, batch=4), dict(lens=8192, q=64, hq=8, hkv=8)):
            add(shape, env={"DIRECTKV_REQUIRE_PROFILE": mode})
    # Explicit configs and staging requests.
    decode_configs = [{}, dict(tile_n=64, stages=4), dict(num_splits=4), dict(tile_n=32, stages=2, num_splits=32,
                                                                              ctas_per_sm=4, carveout=100),
                      dict(tile_n=64, stages=7, q_regs=1, consumer_wgs=2, carveout=100),
                      dict(tile_n=64, stages=4, consumer_wgs=2, chunk_tiles=2, max_inflight=2)]
    for fields in decode_configs:
        for shape in (dict(lens=32768), dict(lens=32768, q=8192), dict(lens=8192, q=64),
                      dict(lens=32768, batch=16, tier="hbm"), dict(lens=32768, dtype="e4m3"),
                      dict(lens=8192, q=2048, dtype="e4m3")):
            add(shape, config={"decode": fields})
    q_tiled_configs = [{}, dict(tile_n=64, stages=4), dict(cluster=1), dict(pingpong=0, carveout=80)]
    for fields in q_tiled_configs:
        for shape in (dict(lens=32768), dict(lens=32768, tier="hbm"), dict(lens=32768, q=64, tier="hbm"),
                      dict(lens=8192, q=64), dict(lens=32768, q=2048, tier="window"), dict(lens=8192, q=2048,
                                                                                           dtype="e4m3")):
            add(shape, config={"q_tiled": fields})
    for shape, device in ((dict(lens=32768, q=8192), dict(capturing=True)), (dict(lens=32768, q=8192, bare=True), {}),
                          (dict(lens=32768, q=8192), dict(staging_cap_mib=10)), (dict(lens=8192, q=64, hq=72, hkv=1),
                                                                                   {})):
        add(shape, device=device, config={"q_tiled": {}})
    requests = [dict(copy_order=1), dict(copy_order=2), dict(order=2), dict(order=2, copy_order=2),
                dict(splits=3, piece_pages=4), dict(piece_pages=4), dict(splits=2), dict(splits=16),
                dict(piece_pages=64, splits=1)]
    for req in requests:
        for shape in (dict(lens=32768, q=8192), dict(lens=[32768, 5000], q=[64, 7]), dict(lens=8192, q=8192),
                      dict(lens=[8192, 3000], q=[8192, 100]), dict(lens=8192, q=512),
                      dict(lens=32768, q=2048, tier="window", b2b=True)):
            add(shape, config={"q_tiled": {}}, staging=req)
    add(dict(lens=8192, q=8192, tier="hbm"), config={"q_tiled": {}}, staging=dict(order=2))
    add(dict(lens=8192, q=2048, dtype="e4m3"), config={"q_tiled": {}}, staging=dict(order=2))
    add(dict(lens=32768, q=2048), config={"decode": {}}, staging=dict(splits=2))  # refused: not Q-tiled
    add(dict(lens=32768, q=8192), config={"decode": dict(tile_n=64, stages=6, consumer_wgs=2)})  # over the SMEM
    # Shared prompts: the cascade, or one staged call of the batch.
    for batch, own, q in [(64, 0, 1), (16, 8192, 1), (4, 0, 1), (4, 1024, 1), (2, 64, 1), (16, 0, 4), (128, 0, 1),
                          (8, 512, 64), (32, 0, 1), (256, 0, 1)]:
        add({"forks": dict(batch=batch, own=own, q=q)})
    for forks, extra in [(dict(batch=8, prompt=4096), {}), (dict(batch=8, prompt=1024, own=4096), {}),
                         (dict(batch=16, hbm_prompt=True), {}), (dict(batch=64, prompt=8192, own=64), {}),
                         (dict(batch=4, prompt=128), {}), (dict(batch=16), dict(dtype="e4m3")),
                         (dict(batch=16, q=16), dict(hq=64, hkv=8)), (dict(batch=8), dict(page=16)),
                         (dict(batch=8), dict(groups=[[0, 1, 2, 3], [4, 5, 6, 7]])),
                         (dict(batch=8), dict(groups=[[0], [1], [2, 3, 4, 5, 6, 7]])),
                         (dict(batch=16), dict(cascade=False)), (dict(batch=16, own=4096), dict(b2b=True))]:
        add({"forks": forks, **extra})
    for device in (dict(capturing=True, copies_ahead=False), dict(gpu="H100"), dict(gpu="cpu"),
                   dict(staging_cap_mib=16)):
        add({"forks": dict(batch=64)}, device=device)
        add({"forks": dict(batch=16, own=8192)}, device=device)
    add({"forks": dict(batch=16, own=8192)}, configs="default")
    add({"forks": dict(batch=16, own=8192)}, machine="conservative")
    add({"forks": dict(batch=16, own=8192)}, machine="H200")
    add({"forks": dict(batch=64)}, machine="H200")
    add({"forks": dict(batch=16)}, config={"decode": {}})
    add({"forks": dict(batch=4, prompt=128)}, cascade_plan=dict(min_shared_tokens=1))
    add({"forks": dict(batch=16, own=1024)}, cascade_plan=dict(min_shared_tokens=1024))
    # Calls over a cache, summarised by CallShape.of.
    small = dict(host_pages=60, hbm_pages=12, seqs=[[["host", 70]], [["host", 5]], [["host", 33]]],
                 hbm_fraction=[[0, 0.5]], q=[1, 5, 4])
    long = dict(page=64, layers=1, host_pages=300, hbm_pages=40,
                seqs=[[["host", 8192], ["hbm", 2048]], [["host", 4096]]], q=[1, 1])
    prompt = dict(page=64, layers=1, host_pages=600, seqs=[[["host", 16384]]], forks=[[0, 3]] * 4, q=[1] * 5)
    for cache in (small, dict(small, q=[1, 1, 1]), long, dict(long, q=[2048, 64], b2b=True),
                  dict(long, max_seq_len=65536), dict(long, hq=16, dtype="e4m3"), dict(prompt, cascade=True),
                  dict(prompt, cascade=True, groups=[[0, 1], [2, 3, 4]]), dict(prompt, cascade=False)):
        for device in ({}, dict(gpu="cpu")):
            add({"cache": cache}, device=device, machine="H200", configs="default")
    # The same through the public API: DirectKVAttention.plan(seq_ids, ...).
    big = dict(page=64, layers=1, host_pages=1200, hbm_pages=40, seqs=[[["host", 32768]], [["host", 8192], ["hbm", 2048]]],
               q=[1, 1])
    for api, kw in [(small, {}), (big, {}), (dict(big, q=[2048, 64]), {}), (dict(big, q=[8192, 1]), {}),
                    (dict(big, dtype="e4m3"), {}), (dict(big, dtype="e4m3", q=[2048, 64]), {}),
                    (dict(big, max_seq_len=131072), {}), (prompt, {}), (dict(prompt, cascade=False), {}),
                    (dict(prompt, groups=[[0, 1], [2, 3, 4]]), {}), (big, dict(machine="H200", configs="default")),
                    (dict(big, q=[2048, 64]), dict(config={"q_tiled": {}}, staging=dict(splits=2))),
                    (big, dict(config={"decode": dict(tile_n=64, stages=4)})), (big, dict(device=dict(gpu="cpu"))),
                    (dict(big, q=[2048, 64]), dict(device=dict(capturing=True, copies_ahead=False))),
                    (big, dict(device=dict(gpu="H100")))]:
        add({"api": api}, **kw)
    # Decode rows under a sparse budget (prefill rows and budgets covering every page: exact).
    for budget in (dict(fraction=1 / 8), dict(pages=16, sink_pages=0, recent_pages=1), dict(fraction=1)):
        for shape in (dict(lens=131072), dict(lens=131072, tier="hbm"), dict(lens=[131072, 4096], batch=2),
                      dict(lens=32768, batch=16, tier="window"), dict(lens=512), dict(lens=131072, q=2048),
                      dict(lens=131072, dtype="e4m3"), dict(lens=131072, q=4), dict(lens=32768, hq=64, hkv=8)):
            add(dict(shape, sparse=budget))
        for device in (dict(capturing=True, copies_ahead=False), dict(gpu="cpu"), dict(gpu="H100")):
            add(dict(lens=131072, sparse=budget), device=device)
    add(dict(lens=131072, sparse=dict(fraction=1 / 8)), config={"decode": dict(tile_n=64, stages=4)})
    return out


def case_id(case: dict) -> str:
    """A case's name: its inputs, compact and in one line."""
    s = case["shape"]
    if "forks" in s:
        head = "forks " + " ".join(f"{k}={v}" for k, v in s["forks"].items())
        rest = {k: v for k, v in s.items() if k != "forks"}
    elif "cache" in s or "api" in s:
        (kind, spec), = s.items()
        head = f"{kind} " + json.dumps(spec, separators=(",", ":"))
        rest = {}
    else:
        lens, q = s["lens"], s.get("q", 1)
        head = f"b{s.get('batch', 1)} L{lens} q{q}" if isinstance(lens, int) else f"L{lens} q{q}"
        head = head.replace(" ", "") if not isinstance(lens, int) else head
        rest = {k: v for k, v in s.items() if k not in ("lens", "q", "batch")}
    parts = [head] + [f"{k}={v}".replace(" ", "") for k, v in rest.items()]
    for key in ("device", "machine", "configs", "config", "staging", "cascade_plan", "env"):
        if key in case:
            parts.append(f"{key}={json.dumps(case[key], separators=(',', ':'), sort_keys=True)}")
    return " ".join(parts)


# ---- the summary of a plan --------------------------------------------------------------------
def _num(x: float) -> float:
    """A float without its last bits: 6 significant digits."""
    return float(f"{x:.6g}")


def _digest(*arrays) -> str:
    """A short hash of integer arrays' shapes and values (whatever their integer dtype)."""
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(np.asarray(a), dtype=np.int64)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def _config(cfg):
    if cfg is None:
        return None
    return {"type": type(cfg).__name__, **dataclasses.asdict(cfg)}


def _dtype(dt) -> str:
    return str(dt).removeprefix("torch.")


def _shape(s) -> dict | None:
    if s is None:
        return None
    return _compact({"batch": s.batch, "seq_lens": list(s.seq_lens), "q_lens": list(s.q_lens), "heads": [s.num_q_heads,
            s.num_kv_heads], "head_dim": s.head_dim, "page_size": s.page_size, "page_dtype": _dtype(s.page_dtype),
            "compute_dtype": _dtype(s.compute_dtype), "num_layers": s.num_layers, "hbm_pages": s.hbm_pages,
            "width": s.width, "max_seq_len": s.max_seq_len, "back_to_back": s.back_to_back, "cascade": s.cascade,
            "groups": None if s.groups is None else [list(g) for g in s.groups],
            "host_table": None if s.host_table is None else _digest(s.host_table)})


def _staging(sp) -> dict | None:
    if sp is None:
        return None
    runs = [[(int(r.hbm), r.src, r.dst, r.count) for r in piece] for piece in sp.pieces]
    return {"pages": sp.pages, "host_pages": sp.host_pages, "piece_pages": sp.piece_pages, "pieces": len(sp.pieces),
            "ready_from": sp.ready_from, "reads_in_place": sp.reads_in_place, "copy_calls": list(sp.copy_calls),
            "runs_per_piece": [len(p) for p in runs],
            "runs": hashlib.sha256(json.dumps(runs).encode()).hexdigest()[:16], "table": _digest(sp.table)}


def _cascade(cp) -> dict | None:
    if cp is None:
        return None
    return {"spans": [[list(s.rows), s.page_lo, s.page_hi] for s in cp.spans], "own_lo": list(cp.own_lo),
            "seq_lens": list(cp.seq_lens), "q_lens": list(cp.q_lens), "page_size": cp.page_size,
            "host_pages_naive": cp.host_pages_naive, "host_pages_read": cp.host_pages_read}


def _compact(d: dict) -> dict:
    """``d`` without its empty fields (None, [])."""
    return {k: v for k, v in d.items() if v is not None and v != []}


def summarize(plan, call: dict | None = None, top: bool = True) -> dict | None:
    """The canonical, JSON-serialisable summary of a plan: every decision in it, no identity, floats
    rounded, empty fields left out; a plan's shape equal to ``call`` (the summary of the call's
    shape: the case's, or the pass's) as "call"; ``top``: with ``explain()``, whose text holds the
    nested plans' too."""
    if plan is None:
        return None
    shape = _shape(plan.shape)
    if call is None:
        call = shape
    c = plan.choice
    # The route's own fields (``plan.detail``), each recorded under its name; a field the route
    # does not have is recorded as its value for a plan without it (1 split, no copy ahead).
    d = plan.detail
    layout = getattr(d, "layout", None)
    out = _compact({
        "route": str(plan.route), "kernel": plan.kernel, "config": _config(plan.config),
        "splits": getattr(d, "splits", 1),
        "layout": None if layout is None else dataclasses.asdict(layout),
        "staging": _staging(plan.staging), "copy_ahead": getattr(d, "copy_ahead", False),
        "fp8_parts": [{"splits": p.splits, "lens": [int(n) for n in p.lens], "table": _digest(p.table)}
                      for p in getattr(d, "parts", ())],
        "head_groups": [[g.start, g.stop] for g in getattr(d, "head_groups", ())],
        "choice": None if c is None else {"in_place_ms": _num(c.in_place_ms), "staged_ms": _num(c.staged_ms),
                                          "staged": c.staged, "splits": c.splits, "by_head": c.by_head,
                                          "coarse": c.coarse, "pipelined": c.pipelined},
        "why": list(plan.why), "machine": plan.machine, "shape": "call" if shape == call else shape,
        "inner": summarize(getattr(d, "inner", None), top=False), "cascade": _cascade(getattr(d, "cascade", None)),
        "passes": [_compact({"rows": None if p.rows is None else list(p.rows), "n_pseudo": p.n_pseudo, "g2": p.g2,
                             "shape": _shape(p.shape), "plan": summarize(p.plan, _shape(p.shape), False)})
                   for p in getattr(d, "passes", ())],
        "capture": summarize(plan.capture, shape, False),
        "sparse": None if getattr(d, "budget", None) is None else {"budget": str(d.budget), "pages": d.pages},
    })
    if top:
        out["explain"] = plan.explain().splitlines()
    return out


def _error(e: BaseException, tmp: Path) -> dict:
    text = str(e).splitlines()[0] if str(e) else ""
    for path, name in ((tmp, "<profiles>"), (ROOT, "<repo>")):
        text = text.replace(str(path.resolve()), name).replace(str(path), name)
    return {"error": type(e).__name__, "message": text}


def decide(case: dict, tmp: Path) -> dict:
    """The summary of one case's plan, or of the error that refuses it."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in case.get("env", {}).items():
            mp.setenv(name, value)
        try:
            shape, plan = plan_case(case)
            return summarize(plan, _shape(shape))
        except (ValueError, TypeError) as e:  # PlanError, ConfigError, ProfileMissError: refusals
            return _error(e, tmp)


@contextlib.contextmanager
def isolated(mode: str):
    """An environment of its own: no DIRECTKV_* variable set, every profile folder an empty
    temporary one, but for a copy of the shipped H200 profile in the bundled one with ``mode``
    "shipped_profile"; the profile lookup's caches cleared on the way in and out. Yields the
    temporary folder."""
    from directkv_cute import attention
    from directkv_cute import env as envvars
    from directkv_cute.tuning import lookup, profiles

    with tempfile.TemporaryDirectory(prefix="plan-decisions-") as tmp, pytest.MonkeyPatch.context() as mp, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the lookup's and the machine model's warnings: not decisions
        tmp = Path(tmp)
        for d in ("env", "xdg", "home", "bundled", "cache"):
            (tmp / d).mkdir()
        if mode == "shipped_profile":
            shutil.copyfile(SHIPPED_PROFILE, tmp / "bundled" / SHIPPED_PROFILE.name)
        for name in envvars.VARIABLES:
            mp.delenv(name, raising=False)
        mp.setenv(envvars.PROFILE_DIR, str(tmp / "env"))
        mp.setenv(envvars.CACHE_DIR, str(tmp / "cache"))
        mp.setenv("XDG_CONFIG_HOME", str(tmp / "xdg"))
        mp.setenv("HOME", str(tmp / "home"))
        mp.setattr(profiles, "bundled_profile_dir", lambda: tmp / "bundled")
        mp.setattr(attention, "_RECENT", None)  # DirectKVAttention's plans by value: none from before
        lookup.clear_cache()
        try:
            yield tmp
        finally:
            lookup.clear_cache()


def compute(mode: str, case_list=None) -> dict[str, dict]:
    """{case id: decision summary} of every case, planned with ``mode``'s profiles."""
    case_list = cases() if case_list is None else case_list
    with isolated(mode) as tmp:
        return {case_id(c): decide(c, tmp) for c in case_list}


def record() -> dict:
    case_list = cases()
    ids = [case_id(c) for c in case_list]
    assert len(set(ids)) == len(ids), [i for i in ids if ids.count(i) > 1][:5]
    got = {mode: compute(mode, case_list) for mode in MODES}
    return {"format": FORMAT,
            "about": "the planner's decisions per case; python tests/test_plan_decisions.py --write records them",
            "cases": [{"id": i, "input": c, **{mode: got[mode][i] for mode in MODES}}
                      for i, c in zip(ids, case_list)]}


def load() -> dict:
    return json.loads(DATA.read_text())


def dumps(data: dict) -> str:
    """The file's text: JSON, a line per case's id, input and decision per mode (a change shows in
    a diff as the lines of the cases it changes)."""
    def one(x) -> str:
        return json.dumps(x, separators=(",", ":"))

    cases = ",\n".join(" {" + ",\n  ".join(f"{one(k)}: {one(v)}" for k, v in c.items()) + "}" for c in data["cases"])
    head = ",\n".join(f" {one(k)}: {one(v)}" for k, v in data.items() if k != "cases")
    return "{\n" + head + ',\n "cases": [\n' + cases + "\n ]\n}\n"


def write() -> None:
    DATA.parent.mkdir(parents=True, exist_ok=True)
    data = record()
    text = dumps(data)
    assert json.loads(text) == json.loads(json.dumps(data))
    DATA.write_text(text)


# ---- comparison -------------------------------------------------------------------------------
def differences(old, new, path: str = "") -> list[str]:
    """Readable lines for each field that differs between two summaries."""
    if isinstance(old, dict) and isinstance(new, dict) and old.get("type", "") == new.get("type", ""):
        out = []
        for k in list(old) + [k for k in new if k not in old]:
            sub = f"{path}.{k}" if path else k
            if k not in new:
                out.append(f"  {sub}: recorded {json.dumps(old[k])}, now absent")
            elif k not in old:
                out.append(f"  {sub}: not recorded, now {json.dumps(new[k])}")
            elif k == "explain" and old[k] != new[k]:
                out.append(f"  {sub}:")
                out += [f"    {line}" for line in difflib.unified_diff(old[k], new[k], "recorded", "now", lineterm="")]
            else:
                out += differences(old[k], new[k], sub)
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new) and \
            any(isinstance(x, (dict, list)) for x in old):
        return [line for i, (a, b) in enumerate(zip(old, new)) for line in differences(a, b, f"{path}[{i}]")]
    if old != new:
        return [f"  {path}: recorded {json.dumps(old)}, now {json.dumps(new)}"]
    return []


def report(mode: str, recorded: dict[str, dict], got: dict[str, dict]) -> str:
    """'' where the decisions equal the recorded ones, else what differs (the first cases in full)."""
    lines = []
    missing, extra = [i for i in recorded if i not in got], [i for i in got if i not in recorded]
    if missing or extra:
        lines.append(f"the cases are not the recorded ones: {len(missing)} recorded case(s) not planned now "
                     f"{missing[:3]}, {len(extra)} new {extra[:3]}")
    changed = [i for i in recorded if i in got and recorded[i] != got[i]]
    if changed:
        lines.append(f"{len(changed)} of {len(recorded)} cases ({mode}) decide otherwise than recorded; the first "
                     f"{min(len(changed), SHOWN_CASES)}:")
        for i in changed[:SHOWN_CASES]:
            diff = differences(recorded[i], got[i])
            lines.append(f"\n[{mode}] {i}")
            lines += diff[:SHOWN_LINES] + ([f"  ... {len(diff) - SHOWN_LINES} more"] if len(diff) > SHOWN_LINES
                                           else [])
        rest = changed[SHOWN_CASES:]
        if rest:
            lines.append(f"\nand {len(rest)} more: " + "; ".join(rest[:20]) + (" ..." if len(rest) > 20 else ""))
    if lines:
        lines.append("\nA change meant (a re-tuned profile, a new planner rule)? Record it: "
                     "python tests/test_plan_decisions.py --write, and review the diff of " + DATA.name)
    return "\n".join(lines)


# ---- the tests --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def recorded() -> dict:
    assert DATA.is_file(), f"{DATA} is missing: python tests/test_plan_decisions.py --write"
    data = load()
    assert data["format"] == FORMAT
    return data


def test_the_cases_are_the_recorded_ones(recorded):
    """The case list is the recorded one: no case dropped, none added, none changed, without
    recording the decisions again."""
    now = [{"id": case_id(c), "input": c} for c in cases()]
    before = [{"id": c["id"], "input": c["input"]} for c in recorded["cases"]]
    assert len(now) >= 300
    assert [c["id"] for c in now] == [c["id"] for c in before], \
        report("cases", {c["id"]: c["input"] for c in before}, {c["id"]: c["input"] for c in now})
    assert now == before


@pytest.mark.parametrize("mode", MODES)
def test_the_planner_decides_as_recorded(recorded, mode):
    got = compute(mode)
    want = {c["id"]: c[mode] for c in recorded["cases"]}
    problems = report(mode, want, got)
    if problems:
        pytest.fail(problems, pytrace=False)


def test_the_recorded_decisions_cover_every_route_and_refusal(recorded):
    """The cases reach every route of ``planner.ROUTES``, with and without the profile, nested
    plans included, and the refusals (so that a change to any of them shows here)."""
    from directkv_cute.planner import ROUTES

    def routes(d):
        if d is None:
            return set()
        if "error" in d:
            return {"refused"}
        return {d["route"]} | routes(d.get("inner")) | routes(d.get("capture")) | \
            set().union(*(routes(p["plan"]) for p in d.get("passes", [])))

    for mode in MODES:
        seen = set().union(*(routes(c[mode]) for c in recorded["cases"]))
        assert seen == set(ROUTES) | {"refused"}, (mode, sorted((set(ROUTES) | {"refused"}) - seen))
    # the profile steers decisions: the two modes differ for some cases, agree for most
    differ = sum(c["shipped_profile"] != c["no_profile"] for c in recorded["cases"])
    assert 0 < differ < len(recorded["cases"])


def main(argv) -> int:
    if argv == ["--write"]:
        write()
        data = load()
        print(f"wrote {len(data['cases'])} cases x {len(MODES)} profile modes to {DATA}")
        return 0
    if argv:
        print(__doc__)
        return 2
    data = load()
    problems = [report(mode, {c["id"]: c[mode] for c in data["cases"]}, compute(mode)) for mode in MODES]
    problems = [p for p in problems if p]
    print("\n\n".join(problems) if problems else f"{len(data['cases'])} cases: every decision as recorded")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
