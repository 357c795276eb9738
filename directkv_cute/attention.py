"""``DirectKVAttention``: plan once per model step, run per layer.

    dk = DirectKVAttention(cache)
    plan = dk.plan(seq_ids, q_lens=q_lens, num_q_heads=32)   # once per step: an AttentionPlan
    print(plan.explain())                                     # which kernel runs, and why
    for layer in range(L):
        ...                                                   # store the layer's new K/V first
        o = dk.run(q, layer)                                  # (total_q, Hq, d)

``plan`` summarises the step's page tables on the host, asks the GPU for its facts once
(``machine.DeviceInfo``), and calls the pure planner (``planner.plan_attention``) with the GPU's
machine model and tuned configs; then it makes the plan's device side (``runner.bind``). ``run``
validates q and launches the plan (``runner.run``). On a CPU cache ``run`` is the float32
reference. ``paged_attention``, ``paged_attention_tables`` and ``cascade_attention`` are this,
planned and run in one call.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import numbers
import os

import numpy as np
import torch

from directkv_cute import env
from directkv_cute.cache.tables import KernelTables, StaleTablesError, check_kernel_tables
from directkv_cute.cascade import CascadePlan
from directkv_cute.config import DecodeConfig, QTiledConfig
from directkv_cute.fp8 import is_fp8
from directkv_cute.kernels.specs import config_kernel, op_kernel
from directkv_cute.machine import CONSERVATIVE, DeviceInfo, MachineModel, stream_capturing
from directkv_cute.plan_types import AttentionPlan, CallShape, ProfileConfigs, StagingRequest
from directkv_cute.planner import plan_attention
from directkv_cute.runner import bind, run
from directkv_cute.sparse import SparseBudget
from directkv_cute.tuning.lookup import cache_epoch, machine_for
from directkv_cute.validate import (check_attention, check_config, check_groups, check_max_seq_len, check_q_lens,
                                    check_seq_ids, check_softmax_scale)


class DirectKVAttention:
    """Attention over ``cache`` (a ``PagedKVCache``): ``plan`` once per step, ``run`` per layer.

    ``machine`` / ``configs``: stand-ins for the GPU's machine model (``tuning.lookup.machine_for``)
    and tuned configs (``plan_types.ProfileConfigs``); ``device_info`` in ``plan``: for the GPU's
    facts.
    The plan made last is ``self.current`` (None before the first ``plan``)."""

    def __init__(self, cache, *, machine: MachineModel | None = None, configs=None):
        self.cache = cache
        self.machine = machine
        self.configs = configs
        self.current: AttentionPlan | None = None
        self.tables = None
        self._bound = None
        self._scale = None
        self._return_lse = False
        # The cache's page generation the plan's tables were built at (-1: not checked: tables the
        # cache does not track, as a pool view's), and the largest host and HBM page index the
        # plan reads (None: no host table; -1: none of that tier), for ``run``'s integer checks.
        self._generation = -1
        self._pages: tuple[int, int] | None = None
        # What sparse decode runs tell their selection (``selected(call, page_table, seq_lens,
        # sel_table)``): sparse.SparseStats (the attention mass, a measurement), sparse.RecallCounts.
        self.sparse_hooks: list = []

    # ---- planning ----------------------------------------------------------------------------
    def plan(self, seq_ids=None, *, tables=None, q_lens=None, num_q_heads: int, softmax_scale: float | None = None,
             max_seq_len: int | None = None, return_lse: bool = False, config=None,
             staging: StagingRequest | None = None, cascade=True, groups=None,
             device_info: DeviceInfo | None = None, q: torch.Tensor | None = None,
             sparse: SparseBudget | None = None) -> AttentionPlan:
        """Plan the attention of one step (every layer runs this plan) and return it.

        seq_ids:       the batch's sequences (the tables are built here, marked back to back: a
                       step's layers), or
        tables:        ``cache.kernel_tables(...)`` built by the caller (exactly one of the two).
        q_lens:        new query tokens per sequence (default one each); their K/V must be in the
                       cache before ``run`` (query j of a sequence of length L and q_len Q attends
                       causally to keys [0, L - Q + j]).
        num_q_heads:   Hq (a multiple of the cache's KV heads).
        softmax_scale: default 1 / sqrt(head_dim); a real number in (0, 1e4]
                       (``validate.MAX_SOFTMAX_SCALE``).
        max_seq_len:   the longest sequence, if known (a positive int): only steers the decode split
                       count and the profile bucket (default: the page table's width).
        return_lse:    ``run`` returns (out, lse) instead of out.
        config:        an explicit DecodeConfig or QTiledConfig (default: the planner's choice).
        staging:       with a QTiledConfig, a ``StagingRequest`` for its staged launch (pieces,
                       KV splits, launch and copy order; default: the planner's choice).
        cascade:       read the pages that sequences share once per batch (the cascade), where
                       that pays; False: per sequence. A ``cascade.CascadePlan`` may be given.
        groups:        the rows that may share (default: any): disjoint lists of row indices.
        device_info:   a ``machine.DeviceInfo`` to plan for (default: the device's own).
        q:             a tensor on the device the plan runs on (default: the tables' device).
        sparse:        a ``sparse.SparseBudget``: decode rows read only their best pages, chosen
                       per layer from the cache's page summaries (``PagedKVCache(...,
                       summaries=True)``); multi-token rows stay exact. None: exact.

        ``run`` refuses the plan (``StaleTablesError``: plan again) once any of the cache's pages
        changed owner since it was made (a sequence freed, truncated, pages moved, mirrors
        released), for tables the cache tracks (``kernel_tables``).
        """
        cache = self.cache
        if (seq_ids is None) == (tables is None):
            raise ValueError("plan needs seq_ids or tables (exactly one)")
        if tables is None:
            seq_ids = check_seq_ids(seq_ids)
            batch = len(seq_ids)
        else:
            check_kernel_tables(tables, cache)  # KernelTables of this cache, no page freed or moved since
            batch = tables.page_table.shape[0]
        if isinstance(num_q_heads, bool) or not isinstance(num_q_heads, numbers.Integral) or num_q_heads < 1 \
                or num_q_heads % cache.num_kv_heads:
            raise ValueError(f"num_q_heads {num_q_heads!r} must be a positive multiple of the cache's "
                             f"{cache.num_kv_heads} KV heads")
        check_softmax_scale(softmax_scale)
        max_seq_len = check_max_seq_len(max_seq_len)
        if isinstance(cascade, (bool, np.bool_)):
            cascade = bool(cascade)
        elif not isinstance(cascade, CascadePlan):
            raise TypeError(f"cascade must be a bool or a cascade.CascadePlan, got {type(cascade).__name__}")
        groups = check_groups(groups, batch)
        if device_info is not None and not isinstance(device_info, DeviceInfo):
            raise TypeError(f"device_info must be a machine.DeviceInfo or None, got {type(device_info).__name__}")
        if q is not None and not isinstance(q, torch.Tensor):
            raise TypeError(f"q must be a torch.Tensor or None, got {type(q).__name__}")
        if sparse is not None:
            if not isinstance(sparse, SparseBudget):
                raise TypeError(f"sparse must be a sparse.SparseBudget or None, got {type(sparse).__name__}")
            if getattr(cache, "summaries", None) is None:
                raise ValueError("sparse reads need the cache's page summaries: PagedKVCache(..., summaries=True)")
        if tables is None:
            tables = cache.kernel_tables(seq_ids, back_to_back=True)
        seq_lens = getattr(tables, "host_seq_lens", None)
        lens = check_q_lens(q_lens, batch, None, seq_lens)  # q comes per layer: run checks its rows
        if config is not None:
            if not isinstance(config, (DecodeConfig, QTiledConfig)):
                raise TypeError(f"config must be a DecodeConfig or a QTiledConfig, got {type(config).__name__}")
            if not (is_fp8(cache.dtype) and isinstance(config, DecodeConfig)):
                check_config(config, cache.head_dim, cache.page_size)
        if staging is not None and not isinstance(staging, StagingRequest):
            raise TypeError(f"staging must be a StagingRequest, got {type(staging).__name__}")
        device = tables.page_table.device if q is None else q.device
        if device_info is None:
            device_info = DeviceInfo.for_cpu() if device.type != "cuda" else DeviceInfo.current(device, cache)
            capturing = device_info.capturing
        else:  # facts the caller plans for (a capture's, say): the stream's own state binds the plan
            capturing = device.type == "cuda" and stream_capturing()
        machine = self.machine
        if machine is None:
            machine = CONSERVATIVE if device_info.cpu else machine_for(device_info.name)
        configs = self.configs if self.configs is not None else ProfileConfigs(device_info.name)
        cascade_plan = cascade if not isinstance(cascade, bool) else None
        shape = CallShape.of(cache, tables, lens, num_q_heads, max_seq_len=max_seq_len,
                             cascade=bool(cascade) and config is None, groups=groups, sparse=sparse)
        if shape.host_table is None and _needs_host_table(shape, config):
            tables = _with_host_table(tables)  # the dispatcher's bare tables: read back once
            shape = CallShape.of(cache, tables, lens, num_q_heads, max_seq_len=max_seq_len, sparse=sparse)
        plan, staged = _planned(shape, device_info, machine, configs, config, cascade_plan, staging)
        bound = bind(plan, tables, device, capturing, staged)
        generation = getattr(tables, "generation", -1)
        tracked = generation >= 0 and getattr(cache, "check_tables", None) is not None
        self._bound, self.current, self.tables = bound, plan, tables
        self._scale, self._return_lse = softmax_scale, return_lse
        self._generation = generation if tracked else -1
        self._pages = _pages_read(tables)
        return plan

    def check(self, tables, q_lens) -> None:
        """That a reuse of the current plan is for these tables and query lengths."""
        if self.current is None or tables is not self.tables or \
                tuple(q_lens if q_lens is not None else (1,) * len(self.current.shape.q_lens)) != \
                tuple(self.current.shape.q_lens):
            raise ValueError("the prepared plan was made for other tables or q_lens")

    # ---- running -----------------------------------------------------------------------------
    def run(self, q: torch.Tensor, layer: int, out: torch.Tensor | None = None, *, softmax_scale=None, pools=None):
        """Attention of q (total_q, Hq, d), packed by sequence, for ``layer`` under the current plan;
        returns out (total_q, Hq, d) in q's dtype, and the natural-log LSE (total_q, Hq) fp32 with
        the plan's ``return_lse``. ``out``: written in place. ``softmax_scale``: instead of the
        plan's (a real number in (0, 1e4]). ``pools``: pools of the cache's geometry to read instead
        of the cache's own (``runner.PoolView``; a model whose layers each own a pool, as in vLLM,
        plans once over one layer's and runs each layer over its own); their owner keeps the pages
        the plan names valid (no page generation is compared). Where the plan knows its host table,
        pools with fewer pages than it reads are refused (a ValueError); where it does not (tables
        built on the device only, as a captured decode step's), the pools must hold every page the
        tables name: nothing checks it.

        Without ``pools``, a plan over tables the cache tracks is refused (``StaleTablesError``:
        plan again) once any of the cache's pages changed owner since it was made. These checks are
        integer comparisons: nothing is read from the device."""
        plan = self.current
        if plan is None:
            raise RuntimeError("DirectKVAttention.run before plan")
        if not isinstance(q, torch.Tensor):
            raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
        shape = plan.shape
        layer, _ = check_attention(q, self.cache, layer, batch=shape.batch, q_lens=shape.q_lens, out=out,
                                   softmax_scale=softmax_scale, cuda=q.is_cuda)
        if q.shape[1] != shape.num_q_heads:
            raise ValueError(f"q has {q.shape[1]} heads, the plan was made for {shape.num_q_heads}")
        if q.device != self.tables.page_table.device:
            raise ValueError(f"tables on {self.tables.page_table.device}, q on {q.device}")
        if pools is None:
            if self._generation >= 0 and self.cache.page_generation != self._generation:
                raise StaleTablesError("stale plan: pages its tables name were freed, moved or copied since it was "
                                       "made (they may belong to another sequence now); nothing was run: plan again")
        else:
            geometry = ("num_layers", "num_kv_heads", "head_dim", "page_size", "dtype")
            if any(getattr(pools, a) != getattr(self.cache, a) for a in geometry):
                raise ValueError("pools of another geometry than the cache's: " + ", ".join(
                    f"{a} {getattr(pools, a)} vs {getattr(self.cache, a)}" for a in geometry))
            if self._pages is not None:
                _check_pool_pages(pools, self._pages)
        scale = self._scale if softmax_scale is None else softmax_scale
        return run(plan, self._bound, q, self.cache if pools is None else pools, layer, scale, out,
                   self._return_lse, self.sparse_hooks)


# The latest plans by value: calls that plan the same shape again (the layers of a step through
# ``paged_attention_tables``, a benchmark's repeated call) reuse the plan and its staged page
# table on the device instead of planning anew. Keyed by the shape's contents (the host table's
# digest), never by an object's identity.
_RECENT: "collections.OrderedDict" = None
_RECENT_KEPT = 8


def _planned(shape: CallShape, device_info, machine, configs, config, cascade_plan, staging=None):
    """(plan, the device copies of its staged tables made so far: a dict to fill) of a shape."""
    global _RECENT
    if shape.host_table is None or cascade_plan is not None or type(configs) is not ProfileConfigs:
        return plan_attention(shape, device_info, machine, configs, config, staging=staging,
                              cascade_plan=cascade_plan), {}
    table = np.ascontiguousarray(shape.host_table)
    key = (hashlib.blake2b(table.tobytes(), digest_size=16).digest(), table.shape,
           *(getattr(shape, f.name) for f in dataclasses.fields(shape) if f.name != "host_table"),
           config, staging, device_info, machine, configs.gpu_name, *_environment(device_info))
    if _RECENT is None:
        _RECENT = collections.OrderedDict()
    hit = _RECENT.get(key)
    if hit is not None:
        _RECENT.move_to_end(key)
        return hit
    got = (plan_attention(shape, device_info, machine, configs, config, staging=staging), {})
    _RECENT[key] = got
    while len(_RECENT) > _RECENT_KEPT:
        _RECENT.popitem(last=False)
    return got


def _environment(device_info) -> tuple:
    """The environment a plan depends on beyond its arguments, for its memo key; read (and
    parsed: a bad value raises ``env.EnvironmentVariableError`` here, before any memo lookup) on
    every plan. The profile lookup's inputs: the profiles read (``DIRECTKV_PROFILE_DIR``, the user
    folder under ``XDG_CONFIG_HOME`` or ``HOME``, the lookup's epoch, which moves when a profile
    is written) and ``DIRECTKV_REQUIRE_PROFILE`` (a GPU plan's refusal of an untuned launch; a CPU
    plan runs the reference and looks nothing up). ``DIRECTKV_MAX_STAGING_GB``,
    ``DIRECTKV_MAX_WORKSPACE_GB`` and ``DIRECTKV_STAGE_OVERLAP`` reach the planner through
    ``DeviceInfo`` (its caps and ``copies_ahead``), which is part of the key."""
    require = None if device_info.cpu else env.require_profile()
    return (require, tuple(str(p) for p in env.profile_dirs()), os.environ.get("XDG_CONFIG_HOME"),
            os.environ.get("HOME"), cache_epoch())


def _pages_read(tables) -> tuple[int, int] | None:
    """(the largest host page index, the largest HBM page index) the host table of ``tables``
    names (-1: none of that tier); None without a host table. Once per plan, on the host."""
    host = getattr(tables, "host_table", None)
    if host is None:
        return None
    table = np.asarray(host)
    if table.size == 0:
        return (-1, -1)
    hi, lo = int(table.max()), int(table.min())
    return (hi if hi >= 0 else -1, -lo - 1 if lo < 0 else -1)


def _check_pool_pages(pools, pages: tuple[int, int]) -> None:
    """A ValueError unless ``pools`` hold the host and HBM pages (and their FP8 scales) that
    ``pages`` (``_pages_read``) says the plan reads: integer comparisons."""
    for tier, index, names in (("host", pages[0], ("host_pool", "host_scales")),
                               ("HBM", pages[1], ("hbm_pool", "hbm_scales"))):
        if index < 0:
            continue
        for name in names:
            pool = getattr(pools, name, None)
            if pool is None and name.endswith("_scales"):
                continue
            n = 0 if pool is None else pool.shape[0]
            if index >= n:
                raise ValueError(f"pools.{name} has {n} {tier} pages but the plan reads {tier} page {index}: "
                                 "pools that hold every page of the plan's tables are needed; nothing was run")


def _needs_host_table(shape: CallShape, config) -> bool:
    """Whether a call over bare device tables must read its host table back: FP8 pages of a call
    the 16-bit kernels run over dequantized pages."""
    if not shape.fp8:
        return False
    if isinstance(config, QTiledConfig):
        return True
    kernel = config_kernel(config, shape.group, shape.max_q_len) if isinstance(config, DecodeConfig) \
        else op_kernel(shape.group, shape.max_q_len)
    return kernel != "decode"


def _with_host_table(tables):
    """``tables`` with their host table and lengths read back from the device (once)."""
    return KernelTables(tables.page_table, tables.seq_lens, getattr(tables, "cache_id", 0),
                        getattr(tables, "generation", -1), tuple(tables.seq_lens.tolist()),
                        tables.page_table.cpu().numpy())
