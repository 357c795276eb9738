"""The attention op over the paged host KV cache, planned and run in one call.

``paged_attention`` and ``paged_attention_tables`` validate their arguments, plan the call
(``DirectKVAttention.plan``: the planner picks the kernel, its config and any staging) and run it;
``cascade_attention`` does the same reading the pages a batch's sequences share once per batch.
A model step whose layers share one batch plans once with ``DirectKVAttention`` and runs per
layer instead. On a CPU-only machine the call runs the float32 reference.
``torch.ops.directkv_cute.paged_attention`` is the same on plain tensors, for torch.compile and
other dispatcher users.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from directkv_cute.attention import DirectKVAttention
from directkv_cute.cache.tables import KernelTables, check_kernel_tables
from directkv_cute.cascade import CascadePlan
from directkv_cute.config import DecodeConfig, QTiledConfig
from directkv_cute.fp8 import is_fp8
from directkv_cute.plan_types import StagingRequest
from directkv_cute.reference import paged_attention_ref, tables_attention_ref
from directkv_cute.runner import PoolView
from directkv_cute.sparse_budget import SparseBudget
from directkv_cute.validate import check_attention, check_seq_ids


def paged_attention(q: torch.Tensor, cache, layer: int, seq_ids: Sequence[int], q_lens=None,
                    softmax_scale: float | None = None, *, config: DecodeConfig | QTiledConfig | None = None,
                    staging: StagingRequest | None = None, out: torch.Tensor | None = None,
                    return_lse: bool = False, sparse: SparseBudget | None = None):
    """Attention of new query tokens over their sequences' whole cached history.

    q: (total_q, Hq, d), packed by sequence (``q_lens[i]`` rows for ``seq_ids[i]``, default 1).
    The new tokens' K/V must already be in the cache; query j of a sequence of length L and
    q_len Q sits at position L - Q + j and attends causally to keys [0, L - Q + j].
    Returns out (total_q, Hq, d) in q's dtype, and the natural-log LSE (total_q, Hq) fp32 when
    ``return_lse``. ``config``: an explicit DecodeConfig or QTiledConfig (default: the planner's
    choice); ``staging``: with a QTiledConfig, a ``StagingRequest`` for its staged launch.
    ``sparse``: a ``sparse.SparseBudget``: decode rows attend only their best pages (the cache needs
    ``summaries=True``; ``DirectKVAttention.plan``); multi-token rows stay exact. None: exact.
    """
    seq_ids = check_seq_ids(seq_ids)
    lengths = [cache.seq_len(s) for s in seq_ids]  # unknown ids raise here
    layer, q_lens = check_attention(q, cache, layer, batch=len(seq_ids), q_lens=q_lens, out=out, config=config,
                                    softmax_scale=softmax_scale, seq_lens=lengths, cuda=q.is_cuda)
    if sparse is not None:  # the selection runs on any device; the plan routes decode rows to it
        return _plan_and_run(q, cache, layer, cache.kernel_tables(seq_ids), q_lens, softmax_scale, config, staging,
                             out, return_lse, max(lengths), sparse)
    if not q.is_cuda:
        o, lse = paged_attention_ref(q, cache, layer, seq_ids, q_lens, softmax_scale)
        if out is not None:
            out.copy_(o)
            o = out
        return (o, lse) if return_lse else o
    return _plan_and_run(q, cache, layer, cache.kernel_tables(seq_ids), q_lens, softmax_scale, config, staging,
                         out, return_lse, max(lengths))


def paged_attention_tables(q: torch.Tensor, cache, layer: int, tables, q_lens=None,
                           softmax_scale: float | None = None, *, config: DecodeConfig | QTiledConfig | None = None,
                           staging: StagingRequest | None = None, out: torch.Tensor | None = None,
                           return_lse: bool = False, max_seq_len: int | None = None,
                           sparse: SparseBudget | None = None):
    """``paged_attention`` with page tables built once (``cache.kernel_tables``) and reused,
    e.g. inside a CUDA graph. ``max_seq_len`` (the longest sequence, if the caller knows it) only
    steers the decode split count and the profile bucket; without it the page table's width
    stands in. The call is planned anew each time: a step's layers plan once with
    ``DirectKVAttention``."""
    # ---- validation (before anything is written; messages are only built on failure) -------
    check_kernel_tables(tables, cache)  # KernelTables of this cache, no page freed or moved since
    page_table, seq_lens = tables.page_table, tables.seq_lens
    layer, q_lens = check_attention(q, cache, layer, batch=page_table.shape[0] if page_table.dim() == 2 else -1,
                                    q_lens=q_lens, out=out, config=config, softmax_scale=softmax_scale,
                                    seq_lens=getattr(tables, "host_seq_lens", None), cuda=True)
    if not (page_table.is_cuda and page_table.dtype == torch.int32 and page_table.dim() == 2):
        raise ValueError("tables.page_table must be a (B, max_pages) int32 CUDA tensor")
    if not (seq_lens.is_cuda and seq_lens.dtype == torch.int32):
        raise ValueError("tables.seq_lens must be an int32 CUDA tensor")
    if page_table.device != q.device:
        raise ValueError(f"tables on {page_table.device}, q on {q.device}")
    batch, max_pages = page_table.shape
    if batch < 1 or seq_lens.shape != (batch,):
        raise ValueError("seq_lens must have one entry per page-table row")
    return _plan_and_run(q, cache, layer, tables, q_lens, softmax_scale, config, staging, out, return_lse,
                         max_seq_len, sparse)


def _plan_and_run(q, cache, layer, tables, q_lens, softmax_scale, config, staging, out, return_lse, max_seq_len,
                  sparse=None):
    dk = DirectKVAttention(cache)
    dk.plan(tables=tables, q_lens=q_lens, num_q_heads=q.shape[1], softmax_scale=softmax_scale,
            max_seq_len=max_seq_len, return_lse=return_lse, config=config, staging=staging, cascade=False, q=q,
            sparse=sparse)
    return dk.run(q, layer, out)


# ---- shared pages: the cascade ----------------------------------------------------------------
@dataclass
class PreparedCascade:
    """A batch's cascade planned once (``prepare_cascade``) and run by every layer of a step."""

    plan: CascadePlan
    attention: object  # the DirectKVAttention holding the planned call


def prepare_cascade(cache, tables, plan: CascadePlan, num_q_heads: int, device=None) -> PreparedCascade:
    """The planned cascade of ``plan`` over ``tables`` (reuse it across the layers of a step)."""
    dk = DirectKVAttention(cache)
    dk.plan(tables=tables, q_lens=plan.q_lens, num_q_heads=num_q_heads, return_lse=True, cascade=plan)
    return PreparedCascade(plan, dk)


def cascade_attention(q, cache, layer: int, seq_ids: Sequence[int], q_lens=None,
                      softmax_scale: float | None = None, *, tables=None, plan: CascadePlan | None = None,
                      groups=None, prepared: PreparedCascade | None = None, out=None,
                      return_lse: bool = False):
    """``paged_attention`` that reads the pages a batch's sequences share once per batch.

    q: (total_q, Hq, d) packed by sequence (``q_lens[i]`` rows each, default 1). ``tables``: the
    batch's ``cache.kernel_tables(seq_ids)`` if already built; ``plan``: a ``plan_cascade`` of
    them (built here otherwise); ``prepared``: its ``prepare_cascade`` (reuse tables, plan and
    prepared across the layers of a step); ``groups``: an explicit prefix grouping (rows that may
    share). Without shared pages this is ``paged_attention``. Planned and run by
    ``DirectKVAttention``.
    Returns out (total_q, Hq, d) in q's dtype, and with ``return_lse`` the float32 LSE."""
    seq_ids = check_seq_ids(seq_ids)
    if tables is None:
        tables = cache.kernel_tables(seq_ids)
    if len(tables.host_seq_lens) != len(seq_ids):
        raise ValueError(f"tables hold {len(tables.host_seq_lens)} sequences, seq_ids {len(seq_ids)}")
    if prepared is not None:
        plan = prepared.plan
    if plan is not None:
        lens = tuple(q_lens) if q_lens is not None else (1,) * len(seq_ids)
        if plan.q_lens != lens or plan.seq_lens != tuple(tables.host_seq_lens) or plan.page_size != cache.page_size:
            raise ValueError("the cascade plan was made for other sequence lengths, q_lens or page size")
    if prepared is not None and prepared.attention.tables is tables:
        dk = prepared.attention
        dk.check(tables, q_lens)
    else:
        dk = DirectKVAttention(cache)
        dk.plan(tables=tables, q_lens=q_lens, num_q_heads=q.shape[1] if q.dim() == 3 else 0,
                softmax_scale=softmax_scale, return_lse=True, cascade=plan if plan is not None else True,
                groups=groups, q=q)
    o, lse = dk.run(q, layer, out=out, softmax_scale=softmax_scale)
    return (o, lse) if return_lse else o


# ---- torch.library registration --------------------------------------------------------------
@torch.library.custom_op("directkv_cute::paged_attention", mutates_args=())
def attention_op(q: torch.Tensor, host_pool: torch.Tensor, hbm_pool: torch.Tensor, page_table: torch.Tensor,
                 seq_lens: torch.Tensor, layer: int, q_lens: list[int] | None = None,
                 softmax_scale: float | None = None, config: list[int] | None = None,
                 max_seq_len: int | None = None, host_scales: torch.Tensor | None = None,
                 hbm_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.directkv_cute.paged_attention``: the op on plain tensors, returning (out, lse).

    host_pool is ``cache.host_pool_cuda`` on a GPU (the UVA alias of the pinned pool) or
    ``cache.host_pool`` on a CPU; hbm_pool is ``cache.hbm_pool``; page_table / seq_lens come from
    ``cache.kernel_tables``; config lists the DecodeConfig fields in order (None: profile lookup).
    FP8 pools come with their scale pools (``cache.device_scales``) and take q's dtype for compute
    (the q dtype: bf16 or fp16 on a GPU).
    Direct Python calls of ``paged_attention_tables`` skip the dispatcher's overhead; this entry
    is for torch.compile'd models and other dispatcher users.
    """
    compute = q.dtype if is_fp8(host_pool.dtype) else None
    if q.is_cuda:
        cfg = DecodeConfig(*config) if config else None
        if compute is not None and host_scales is None:
            raise ValueError("FP8 pools need their scale pools (host_scales, hbm_scales: cache.device_scales)")
        view = PoolView(host_pool, hbm_pool, compute, host_scales, hbm_scales)
        out, lse = paged_attention_tables(q, view, layer, KernelTables(page_table, seq_lens),
                                          q_lens, softmax_scale, config=cfg, return_lse=True, max_seq_len=max_seq_len)
        return out, lse
    view = PoolView(host_pool, hbm_pool, compute)
    if page_table.dtype != torch.int32 or page_table.dim() != 2 or seq_lens.dtype != torch.int32 \
            or seq_lens.shape != (page_table.shape[0],):
        raise ValueError("page_table must be (B, max_pages) int32 and seq_lens (B,) int32 (cache.kernel_tables)")
    layer, lens = check_attention(q, view, layer, batch=page_table.shape[0], q_lens=q_lens,
                                  config=DecodeConfig(*config) if config else None, softmax_scale=softmax_scale,
                                  seq_lens=seq_lens.tolist(), cuda=False)
    return tables_attention_ref(q, host_pool, hbm_pool, page_table, seq_lens, layer, list(lens), softmax_scale,
                                host_scales=host_scales, hbm_scales=hbm_scales)


@attention_op.register_fake
def _attention_op_fake(q, host_pool, hbm_pool, page_table, seq_lens, layer, q_lens=None, softmax_scale=None,
                       config=None, max_seq_len=None, host_scales=None, hbm_scales=None):
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)
