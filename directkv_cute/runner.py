"""The runner: executes an ``AttentionPlan`` (``directkv_cute.planner``) on the GPU.

``bind(plan, tables, device, capturing)`` makes a plan's device side once (the query offsets, then
what its route needs: staged page tables, the cascade's tables and row indices; the kernel a
CUDA graph capture runs instead, compiled now); ``run(plan, bound, q, cache, layer)`` launches it,
per layer. Both go through the plan's route (``directkv_cute.routes``), which holds what each way
of running a call does; here is what every route shares: the compiled kernels (memoized), the
query offsets, the pool views and tables the launches read, and the two rules above any route:
a CPU cache runs the float32 reference, and a plan that copies pages per call runs its capture
plan inside a CUDA graph capture. It decides nothing: every choice is the plan's. With
``routes`` and ``staging.Stager`` it is the only code that touches streams and events.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch

from directkv_cute.cache.tables import KernelTables
from directkv_cute.config import DecodeConfig, QTiledConfig
from directkv_cute.kernels import jit, launch
from directkv_cute.kernels.trace import current_trace
from directkv_cute.machine import stream_capturing
from directkv_cute.plan_types import AttentionPlan


# ---- compiled kernels (jit keys on the target arch too; these memos keep the key off the call path)
@functools.lru_cache(maxsize=1024)
def compiled_decode(cfg: DecodeConfig, dtype, head_dim, page_size, group, max_q_len, split_out, multi_token,
                    trace=None):
    return jit.compile_decode(cfg, dtype, head_dim, page_size, group, max_q_len, split_out=split_out,
                              multi_token=multi_token, trace=trace)


@functools.lru_cache(maxsize=256)
def compiled_fp8(cfg: DecodeConfig, dtype, kv_dtype, head_dim, page_size, group, max_q_len, split_out):
    return jit.compile_decode_fp8(cfg, dtype, kv_dtype, head_dim, page_size, group, max_q_len, split_out)


@functools.lru_cache(maxsize=256)
def compiled_q_tiled(cfg: QTiledConfig, dtype, head_dim, page_size, group, wait_ready, fold):
    return jit.compile_q_tiled(cfg, dtype, head_dim, page_size, group, wait_ready, fold)


@functools.lru_cache(maxsize=64)
def compiled_combine(head_dim, dtype):
    return jit.compile_combine(head_dim, dtype)


@functools.lru_cache(maxsize=64)
def compiled_dequant(kv_dtype, dtype, head_dim, page_size):
    return jit.compile_dequant(kv_dtype, dtype, head_dim, page_size)


def in_place_partials(plan, parts=None) -> bool:
    """Whether an in-place launch writes split partials (merged by the combine kernel)."""
    return plan.detail.splits > 1 or plan.kernel == "multi_token" or parts is not None


def in_place_kernel(plan, dtype, partials=None, compile_now=True):
    """The compiled kernel of an in-place plan (``partials``: it writes split partials); with
    ``compile_now`` False, the (compile function, arguments) that give it."""
    shape, cfg = plan.shape, plan.config
    multi_token = plan.kernel == "multi_token"
    if partials is None:
        partials = in_place_partials(plan)
    if plan.kernel == "decode_fp8":
        fn, args = compiled_fp8, (cfg, dtype, shape.page_dtype, shape.head_dim, shape.page_size, shape.group,
                                  shape.max_q_len, partials)
    else:
        fn, args = compiled_decode, (cfg, dtype, shape.head_dim, shape.page_size, shape.group, shape.max_q_len,
                                     partials, multi_token, current_trace() if multi_token else None)
    return fn(*args) if compile_now else (fn, args)


# ---- device state ----------------------------------------------------------------------------
# Device copies of the query offsets per distinct q_lens (decode: one per batch size): a repeated
# shape skips the per-call host-to-device copy, and a captured CUDA graph keeps reading a live
# tensor. Entries are never evicted (a graph may hold one); past the cap, new q_lens are copied
# per call (and cannot be captured).
_CU_Q: dict = {}
_CU_Q_CAP = 4096


def cu_seqlens(q_lens: tuple[int, ...], device, capturing: bool) -> torch.Tensor:
    """cu_q int32 (B + 1,) on device from validated per-sequence query lengths; ``capturing``: the
    current stream is capturing a CUDA graph (``machine.stream_capturing``)."""
    key = (q_lens, str(device))
    cu_q = _CU_Q.get(key)
    if cu_q is None:
        if capturing:
            # A copy from pageable host memory cannot be captured, and a tensor allocated inside
            # the capture would belong to the graph's private pool.
            raise RuntimeError(
                f"paged_attention: q_lens {list(q_lens[:8])}{'...' if len(q_lens) > 8 else ''} first seen inside "
                "CUDA graph capture; call once outside capture with the same q_lens first (their device copy is kept)")
        cu_q = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32).to(device, non_blocking=True)
        if len(_CU_Q) < _CU_Q_CAP:
            _CU_Q[key] = cu_q
    return cu_q


class PoolView:
    """The few cache attributes the kernels read, rebuilt from pool tensors (a staging buffer, the
    dispatcher's op, an engine's per-layer KV tensors).

    write_log: the ``cache.HostWriteLog`` of the host writes to ``host_pool`` that its owner
    records (``record`` after each write it enqueues): staged calls over the view then copy ahead
    of the current stream, each host page after the writes recorded for it (``host_writes``, as a
    ``PagedKVCache``'s). None: nothing is recorded, so every staged copy waits for the current
    stream's work so far.

    summaries: the pools' page summaries (``host`` and ``hbm`` tensors, as ``cache.summaries``
    lays them out) that a sparse plan's selection reads (``routes.SparseDecode``); None: none
    kept, and a sparse plan over the view is refused."""

    def __init__(self, host_pool: torch.Tensor, hbm_pool: torch.Tensor, compute_dtype: torch.dtype | None = None,
                 host_scales: torch.Tensor | None = None, hbm_scales: torch.Tensor | None = None,
                 write_log=None, summaries=None):
        _, self.num_layers, self.num_kv_heads, _, self.page_size, self.head_dim = host_pool.shape
        self.host_pool = self.host_pool_cuda = host_pool
        self.hbm_pool = hbm_pool
        self.host_scales = self.host_scales_cuda = host_scales
        self.hbm_scales = hbm_scales
        self.dtype = host_pool.dtype
        self.compute_dtype = compute_dtype or host_pool.dtype
        self.write_log = write_log
        self.summaries = summaries

    @property
    def host_writes(self):
        """What ``DeviceInfo.current`` and ``Stager.stage`` ask a cache for: the write log's
        ``pending`` (as ``PagedKVCache.host_writes``), None without a log."""
        return None if self.write_log is None else self.write_log.pending

    def device_pool(self, tier: str) -> torch.Tensor:
        """The tier's pool as the reference reads it (a CPU view runs the reference)."""
        return self.host_pool if tier == "host" else self.hbm_pool


def tables_from_host(table: np.ndarray, lens, device, like=None):
    """KernelTables over a host table and lengths, one host-to-device copy (``like``: the cache id
    and generation of the tables they were cut from)."""
    table = np.ascontiguousarray(table, dtype=np.int32)
    packed = np.concatenate([table.ravel(), np.asarray(lens, dtype=np.int32)])
    dev = torch.from_numpy(packed).to(device, non_blocking=True)
    n = table.size
    return KernelTables(dev[:n].view(table.shape), dev[n:], getattr(like, "cache_id", 0),
                        getattr(like, "generation", -1), tuple(int(x) for x in lens), table)


@dataclass
class Bound:
    """A plan's device side, made once (``bind``) and reused by every layer that runs it."""

    tables: object  # KernelTables of the call
    cu_q: torch.Tensor | None
    staged_table: torch.Tensor | None = None  # plan.staging.table on the device
    parts: tuple = ()  # decode_fp8_two_piece: (page_table, seq_lens) per part
    inner: "Bound | None" = None  # fp8_dequantized, cascade_staged, sparse_decode: the inner plan's
    selector: object = None  # sparse_decode: the sparse.PageSelector whose table the inner plan reads
    passes: tuple = ()  # cascade: (row indices on the device or None, Bound) per pass
    capture: "Bound | None" = None


@dataclass(frozen=True)
class Call:
    """One launch of a plan: the queries, the pools, the layer, the softmax scale, the output to
    write (None: a new tensor), and whether the current stream is capturing a CUDA graph (read
    once per call, ``machine.stream_capturing``)."""

    q: torch.Tensor
    cache: object
    layer: int
    scale: float
    out: torch.Tensor | None = None
    capturing: bool = False
    sparse_hooks: tuple = ()  # objects whose ``selected`` sparse decode runs call (sparse.SparseStats, RecallCounts)

    def replace(self, **changes) -> "Call":
        return dataclasses.replace(self, **changes)


# ---- binding and running ---------------------------------------------------------------------
def bind(plan: AttentionPlan, tables, device, capturing: bool, staged: dict | None = None) -> Bound:
    """The device side of ``plan`` over ``tables`` (see ``Bound``); ``capturing``: the current
    stream is capturing a CUDA graph (nothing may be allocated or copied from pageable memory then).
    ``staged``: device copies of the plan's staged page table already made, by (device, stream),
    filled here (a plan made again for the same shape reuses them: no copy from pageable memory
    per call)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    b = Bound(tables, cu_seqlens(tuple(plan.shape.q_lens), device, capturing) if cuda else None)
    plan.route.bind(plan, b, device, capturing, staged)
    if plan.capture is not None and cuda:
        # What a CUDA graph capture of this call runs: its kernel compiled and the link counters
        # allocated now, outside any capture.
        b.capture = Bound(tables, b.cu_q)
        launch.link_counters(device, capturing)
        in_place_kernel(plan.capture, plan.shape.compute_dtype)
    return b


def run(plan: AttentionPlan, bound: Bound, q: torch.Tensor, cache, layer: int, softmax_scale=None, out=None,
        return_lse: bool = False, sparse_hooks=()):
    """Launch ``plan`` for ``layer`` (validated arguments); returns out, and the LSE with
    ``return_lse``. ``sparse_hooks``: what a sparse decode run tells its selection
    (``Call.sparse_hooks``)."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[2])
    o, lse = run_call(plan, bound, Call(q, cache, layer, scale, out, q.is_cuda and stream_capturing(), tuple(sparse_hooks)))
    return (o, lse) if return_lse else o


def run_call(plan: AttentionPlan, bound: Bound, call: Call):
    """(out, lse) of ``plan`` for ``call``: the route's reference on a CPU, the plan's capture plan
    where the stream captures a CUDA graph and the plan copies pages planned per call, else the
    route's launches."""
    if not call.q.is_cuda:
        return plan.route.reference(plan, bound, call)
    if plan.staging is not None and call.capturing:
        if plan.capture is None:  # planned outside the capture, with nothing that reads in place
            raise RuntimeError(f"paged_attention: the {plan.route} plan copies pages planned per call and cannot be "
                               "captured in a CUDA graph; plan inside the capture (decode-sized calls can be captured)")
        plan, bound = plan.capture, bound.capture  # a capture reads in place: no copies planned per call
    return plan.route.run(plan, bound, call)


def plan_kernels(plan: AttentionPlan, dtype) -> list[tuple]:
    """The compiled kernels ``run`` launches for ``plan`` with queries of ``dtype``, as
    (memoized compile function, its arguments): calling each compiles it now (or loads it from
    the disk cache), so that no launch of the plan compiles. A serving engine calls them at
    startup for the steps it may plan (``directkv_cute.vllm``'s warm-up)."""
    return plan.route.kernels(plan, dtype)
