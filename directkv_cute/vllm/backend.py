"""DirectKV as a vLLM attention backend (vLLM 0.26, V2 model runner): KV blocks in pinned host
memory, read in place by the DirectKV kernels (or staged to HBM where the planner says it pays).

* ``DirectKVBackend``: registered as ``AttentionBackendEnum.CUSTOM`` (``register``); its KV cache
  shape per layer is ``(num_blocks, num_kv_heads, 2, block_size, head_size)``, contiguous, so that
  ``kv_cache.unsqueeze(1)`` is exactly a one-layer DirectKV pool ``(pages, 1, Hkv, 2, P, d)`` and
  a vLLM block id is a host page index. ``memory.install`` puts those tensors in pinned host memory.
* ``DirectKVMetadataBuilder.build``, once per step: the step's shape from vLLM's CPU metadata,
  the page table from the block table, the K/V destinations from ``slot_mapping``, the HBM
  tier's mirrors (``step.HbmMirrors``) and the step's plan (``DirectKVAttention.plan``: the
  planner decides the kernel and any staging, once for every layer).
* ``DirectKVImpl.forward``, per layer: stores the layer's new K/V rows into their host pages
  (GPU stores through the mapped address, as ``PagedKVCache.write_slots`` does) and into the
  mirrors of mirrored blocks, records that write in the layer's write log, then runs the step's
  plan over the layer's own pools. The log lets a staged layer copy its history ahead of the
  current stream (while the layers before it still run), waiting only for the stores to the
  pages it copies; the build restarts the logs once per step.

The HBM tier (``DIRECTKV_VLLM_HBM_GB``, GiB over all layers; unset or 0: none): each layer gets
an HBM pool of ``step.hbm_pages`` pages, allocated zero-filled at vLLM's warm-up (or the group's
first step), after ``step.check_hbm_tier`` against the GPU's available memory; blocks
whose first row is written while a page is free (or can be taken back from a block absent from
the step) get a copy there, written through by every store, and the page table names the copy
(``encode_page("hbm", slot)``), so attention reads those blocks from HBM instead of the link.

A tier at least as large as the host pool (``step.mirrors_every_block``) mirrors every block at its
own index (``step.EVERY_BLOCK``): nothing about the mirrors is decided per step and attention
reads only HBM. Then the backend declares ``AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE``, and
vLLM captures its decode steps whole in full CUDA graphs (``FULL_AND_PIECEWISE``, vLLM's default):
a decode step's page table, lengths and store rows are written on the device into persistent
buffers (``step.GraphDecode``) from vLLM's own device tensors, nothing is read back to the host,
and the plan (the in-place decode kernel and its splits) is made once per batch size for the
longest context. Prompt and mixed steps run as before, between piecewise graphs. Without such a
tier (host only, or a smaller tier) decode reads the link, where the copy engine's staging, which
a graph cannot hold, beats reading in place: attention stays outside CUDA graphs
(``AttentionCGSupport.NEVER``), planned on the host per step.

A sparse budget (``DIRECTKV_VLLM_SPARSE_BUDGET``; unset: exact) gives each layer's pools page
summaries (``cache.summaries.StoreSummaries``: per block and KV head the sum and sum of squares
of its K rows, on the GPU, kept by every store), and the builder plans decode rows under it
(``sparse=``): each layer's decode rows read only their best pages (``routes.SparseDecode``),
in eager steps and in the decode plans of the full CUDA graphs alike. Prompt and multi-token
rows stay exact.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)

from directkv_cute import env
from directkv_cute.attention import DirectKVAttention
from directkv_cute.cache import HostWriteLog, KernelTables
from directkv_cute.cache.summaries import StoreSummaries
from directkv_cute.config import DEFAULT_PAGE_SIZE, SUPPORTED_HEAD_DIMS, SUPPORTED_PAGE_SIZES
from directkv_cute.machine import DeviceInfo
from directkv_cute.runner import PoolView, plan_kernels, tables_from_host
from directkv_cute.vllm.memory import is_pinned_host
from directkv_cute.vllm.step import (
    EVERY_BLOCK,
    GraphDecode,
    HbmMirrors,
    StoreIndex,
    check_geometry,
    check_hbm_tier,
    every_block_step,
    hbm_pages,
    mirror_table,
    mirrors_every_block,
    page_table,
    slot_destinations,
    step_shape,
    store_kv,
    warmup_kernels,
    warmup_steps,
)

log = logging.getLogger(__name__)

KV_CACHE_DTYPES = ("auto", "bfloat16", "float16")


class DirectKVBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes: ClassVar[list] = list(KV_CACHE_DTYPES)
    forward_includes_kv_cache_update: bool = True  # forward stores the K/V: it has the step's slots

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # vLLM looks the layer's backend up as AttentionBackendEnum[get_name()]

    @staticmethod
    def get_impl_cls():
        return DirectKVImpl

    @staticmethod
    def get_builder_cls():
        return DirectKVMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes():
        return list(SUPPORTED_PAGE_SIZES)

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        # vLLM asks this only when --block-size is not given: the page size the shipped profiles
        # are tuned for (vLLM's own default, 16, has no tuned entries and 4x the pages per token)
        return DEFAULT_PAGE_SIZE

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(SUPPORTED_HEAD_DIMS)

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        check_geometry(head_size, block_size)
        if cache_dtype_str not in KV_CACHE_DTYPES:
            raise ValueError(f"kv cache dtype {cache_dtype_str!r}: the DirectKV backend stores {KV_CACHE_DTYPES}")
        return (num_blocks, num_kv_heads, 2, block_size, head_size)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        # Memory order is the logical order; with a layers dimension, layers first, so vLLM never
        # plans a cross-layer packed layout (``indexes_kv_by_block_stride`` is False).
        return tuple(range(6 if include_num_layers_dimension else 5))

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return capability.major == 9  # the kernels are sm_90a (Hopper)


@dataclass
class DirectKVMetadata:
    """One step's attention, shared by every layer of the group.

    num_actual_tokens: vLLM's token count of the step (query rows, padding included).
    num_query_rows:    the packed query rows attention computes (``q[:num_query_rows]``).
    attention:         the planned ``DirectKVAttention`` (None: no request has query rows).
    store:             where each layer stores the step's K/V rows (``step.StoreIndex`` on the
                       device: host pool rows, HBM pool rows of mirrored blocks), None: no row.
    views:             {layer name: its ``PoolView`` (host pool, HBM pool)}, the builder's.
    stored_pages:      int64 (k,) the host pages the stores write (each once): each layer's
                       store is recorded in its view's write log, and the staged copies of the
                       layer, which run ahead of the current stream, copy those pages after it.
                       None: nothing is recorded (a decode step over ``step.GraphDecode``'s
                       buffers, which a CUDA graph may replay; nothing is ever staged there).
    """

    num_actual_tokens: int
    num_query_rows: int
    attention: object
    store: StoreIndex | None
    views: dict
    stored_pages: np.ndarray | None


class DirectKVMetadataBuilder(AttentionMetadataBuilder[DirectKVMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    reorder_batch_threshold: ClassVar[int | None] = None  # mixed batches run as one plan

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.page_size = kv_cache_spec.block_size  # the kernel block size: our page size
        self.num_kv_heads = kv_cache_spec.num_kv_heads
        self.head_dim = kv_cache_spec.head_size
        check_geometry(self.head_dim, self.page_size)
        self.num_q_heads = vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config)
        if vllm_config.speculative_config is not None:
            raise ValueError("the DirectKV backend plans from exact sequence lengths on the host; speculative "
                             "decoding makes them upper bounds: run without --speculative-config")
        self._views = None  # {layer name: PoolView over its host KV and its HBM pool}, at the first build
        self._mirrors = None  # the HBM tier's policy (None: no tier; EVERY_BLOCK: every block at its index)
        self._write_logs = []  # one per layer that owns its KV: its host writes (HostWriteLog)
        self._graph = None  # GraphDecode: decode steps' device buffers (only where the tier mirrors every block)
        self._graph_plans = {}  # batch size -> DirectKVAttention planned over the GraphDecode buffers
        # the budget decode rows are planned under (None: exact); read once, so that the pools'
        # summaries and every plan agree, and a bad value stops startup here
        self._sparse = env.vllm_sparse_budget()
        # vLLM compiles the units of registered providers before serving (kernel_warmup)
        from vllm.model_executor.warmup.cutedsl_warmup import register_cutedsl_warmup_provider

        register_cutedsl_warmup_provider(self)

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        """Full CUDA graphs of decode steps where the HBM tier mirrors every block (attention then
        reads HBM, and each step's launches matter); never otherwise (decode reads the link, and
        its copy-engine staging is planned per step)."""
        if mirrors_every_block(env.vllm_hbm_bytes(), vllm_config.cache_config.kv_cache_memory_bytes):
            return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        return cls._cudagraph_support

    def _layer_views(self) -> dict:
        """{layer name: ``PoolView``} of the group's layers, made at the first build: each layer's
        host KV and its HBM pool of ``hbm_pages`` pages (a layer that shares another's KV shares
        its HBM pool too), sized from ``DIRECTKV_VLLM_HBM_GB`` over every layer of this backend
        that owns its KV; with a sparse budget, the pools' page summaries (``StoreSummaries``,
        shared the same way)."""
        if self._views is not None:
            return self._views
        context = self.vllm_config.compilation_config.static_forward_context
        first = context[self.layer_names[0]].kv_cache
        budget = env.vllm_hbm_bytes()
        every = mirrors_every_block(budget, self.vllm_config.cache_config.kv_cache_memory_bytes)
        slots = 0
        if budget:
            owners = [layer for layer in context.values() if isinstance(getattr(layer, "impl", None), DirectKVImpl)
                      and getattr(layer, "kv_sharing_target_layer_name", None) is None]
            dtype = str(first.dtype).removeprefix("torch.")
            slots = first.shape[0] if every else \
                hbm_pages(budget, len(owners), self.num_kv_heads, self.head_dim, self.page_size, dtype)
            if every:
                log.info("DirectKV: an HBM tier that mirrors all %d blocks over %d layers, %.3g GiB; decode steps run "
                         "in full CUDA graphs", slots, len(owners), slots * len(owners) * first[0].nbytes / 2**30)
            elif slots:
                log.info("DirectKV: an HBM tier of %d block mirrors per layer over %d layers, %.3g GiB",
                         slots, len(owners), slots * len(owners) * first[0].nbytes / 2**30)
            else:
                log.warning("DirectKV: %s=%.3g GiB holds no block: one block over the %d layers takes %d bytes; "
                            "every block is read from host memory", env.VLLM_HBM_GB, budget / 2**30, len(owners),
                            len(owners) * first[0].nbytes)
        # each layer's KV owner: itself, or the layer whose KV it shares
        owner_of = {n: getattr(context[n], "kv_sharing_target_layer_name", None) or n for n in self.layer_names}
        if slots:  # refused before any of it is allocated (at vLLM's warm-up, before serving)
            check_hbm_tier(len(set(owner_of.values())) * slots * first[0].nbytes, available_gpu_bytes(self.device))
        self._mirrors = EVERY_BLOCK if every else HbmMirrors(slots) if slots else None
        hbm: dict = {}
        logs: dict = {}  # a layer that shares another's KV reads the writes that layer records
        summaries: dict = {}
        views = {}
        for name, owner in owner_of.items():
            layer = context[name]
            if owner not in hbm:
                hbm[owner] = torch.zeros((slots, *first.shape[1:]), dtype=first.dtype, device=self.device)
                # every block mirrored: attention never reads the host, so nothing is staged and no
                # host write needs recording
                logs[owner] = None if every else HostWriteLog(torch.device(self.device))
                summaries[owner] = None if self._sparse is None else StoreSummaries(
                    first.shape[0], slots, self.num_kv_heads, self.head_dim, self.page_size, first.dtype, self.device)
            views[name] = pool_view(layer.kv_cache, name, hbm[owner], logs[owner], summaries[owner])
        if self._sparse is not None:
            log.info("DirectKV: decode reads under a sparse budget of %s; page summaries of %.3g GiB on the GPU over "
                     "%d layers", self._sparse, sum(x.nbytes for x in summaries.values()) / 2**30, len(summaries))
        self._views, self._write_logs = views, [w for w in logs.values() if w is not None]
        return views

    def get_cutedsl_warmup_compile_units(self) -> list:
        """vLLM's warm-up before serving: every kernel the plans of this server's steps launch
        (``step.warmup_steps``: decode batches, prompt chunks and mixed steps within its
        ``max_num_seqs``, token budget, ``max_model_len`` and KV blocks), compiled (or loaded
        from the kernel disk cache) once, so that no request waits for a compile."""
        from vllm.model_executor.warmup.cutedsl_warmup import CuTeDSLCompileUnit

        config = self.vllm_config
        pools = self._layer_views()[self.layer_names[0]]  # a KV cache or tier the backend refuses stops startup here
        try:
            steps = warmup_steps(max_num_seqs=config.scheduler_config.max_num_seqs,
                                 max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
                                 max_model_len=config.model_config.max_model_len, page_size=self.page_size,
                                 num_blocks=pools.host_pool.shape[0])
            kernels = warmup_kernels(pools, steps, num_q_heads=self.num_q_heads, dtype=config.model_config.dtype,
                                     device=self.device, sparse=self._sparse)
            if self._mirrors is EVERY_BLOCK:  # the decode plans of every batch size a graph may capture
                kernels |= {(fn.__name__, *args): (fn, args) for b in range(1, config.scheduler_config.max_num_seqs + 1)
                            for fn, args in plan_kernels(self._graph_attention(b).current, config.model_config.dtype)}
        except Exception as e:  # the server still runs: the kernels compile at their first step instead
            log.warning("DirectKV: no kernel warm-up (%s: %s); kernels compile when a step first needs them",
                        type(e).__name__, e)
            return []
        log.info("DirectKV: %d kernels to compile or load for %d step shapes", len(kernels), len(steps))
        return [CuTeDSLCompileUnit(f"directkv {fn.__name__.strip('_')}", key, functools.partial(fn, *args))
                for key, (fn, args) in kernels.items()]

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> DirectKVMetadata:
        m = common_attn_metadata
        if m.causal is not True:
            raise ValueError("the DirectKV backend computes causal attention only")
        views = self._layer_views()
        pools = views[self.layer_names[0]]  # the plans' geometry: every layer of the group has its shape
        num_blocks = pools.host_pool.shape[0]
        seq = m.seq_lens_cpu_upper_bound
        seq = (m.seq_lens[: m.num_reqs].cpu() if seq is None else seq).numpy()
        shape = step_shape(m.query_start_loc_cpu.numpy(), seq, m.num_reqs)
        if self._mirrors is EVERY_BLOCK:
            if shape.rows and not shape.num_prefills and m.num_actual_tokens == m.num_reqs:
                return self._graph_step(m, shape, views)
            return self._every_block_step(m, shape, views)
        # The slots and the block table on the host: one wait for the GPU's queued work per step
        # (the planner reads the page table; padding tokens, slot -1, are never stored).
        slots = m.slot_mapping[: m.num_actual_tokens].cpu().numpy()
        dest = slot_destinations(slots, self.page_size, num_blocks)
        self._restart_write_logs()
        table = None
        if shape.rows:
            width = min(-(-shape.max_seq_len // self.page_size), m.block_table_tensor.shape[1])
            blocks = m.block_table_tensor[: m.num_reqs, :width].cpu().numpy()[list(shape.rows)]
            table = page_table(blocks, shape.seq_lens, self.page_size, num_blocks)
        if self._mirrors is not None:  # the step's mirrors: its table and its stores name them
            mirrors = self._mirrors.step(table if table is not None else (), dest.pages, dest.offsets)
            dest = dest.mirrored(mirrors)
            if table is not None:
                mirror_table(table, mirrors)
        store = dest.store_index(self.num_kv_heads, self.page_size).to(self.device) if len(dest.rows) else None
        stored = np.unique(dest.pages)
        if table is None:
            return DirectKVMetadata(m.num_actual_tokens, 0, None, store, views, stored)
        tables = tables_from_host(table, shape.seq_lens, self.device)._replace(back_to_back=True)
        attention = DirectKVAttention(pools)
        # Blocks that prefix caching shares (one block id in several rows) are read once for all
        # their sharers where the planner finds that pays (the cascade).
        plan = attention.plan(tables=tables, q_lens=shape.q_lens, num_q_heads=self.num_q_heads,
                              max_seq_len=shape.max_seq_len, sparse=self._sparse)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("DirectKV step: %d decodes, %d prefills\n%s", shape.num_decodes, shape.num_prefills,
                      plan.explain())
        return DirectKVMetadata(m.num_actual_tokens, shape.num_tokens, attention, store, views, stored)

    def _every_block_step(self, m: CommonAttentionMetadata, shape, views) -> DirectKVMetadata:
        """A step with prompt rows (or padding only) over a tier that mirrors every block: its
        tables and stores made on the device from vLLM's (``step.every_block_step``), its plan from
        the host shape, reading HBM only; nothing read back. Blocks that prefix caching shares
        are read per sharer (no cascade: that needs the table on the host, and HBM reads of a
        shared prefix are cheap)."""
        tables, store = every_block_step(m.block_table_tensor[: m.num_reqs], m.slot_mapping, shape,
                                         m.num_actual_tokens, self.num_kv_heads, self.page_size)
        if tables is None:
            return DirectKVMetadata(m.num_actual_tokens, 0, None, store, views, None)
        attention = DirectKVAttention(views[self.layer_names[0]])
        plan = attention.plan(tables=tables, q_lens=shape.q_lens, num_q_heads=self.num_q_heads,
                              max_seq_len=shape.max_seq_len, cascade=False, sparse=self._sparse)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("DirectKV step: %d decodes, %d prefills\n%s", shape.num_decodes, shape.num_prefills,
                      plan.explain())
        return DirectKVMetadata(m.num_actual_tokens, shape.num_tokens, attention, store, views, None)

    def _graph_step(self, m: CommonAttentionMetadata, shape, views) -> DirectKVMetadata:
        """A decode step over a tier that mirrors every block: ``GraphDecode``'s buffers filled on
        the device and the plan of its batch size (padded requests included), the same whether
        vLLM replays a captured graph or runs the step eagerly."""
        store = self._decode_buffers().fill(m.block_table_tensor, m.seq_lens, m.slot_mapping, m.num_reqs, m.num_actual_tokens,
                                 shape.max_seq_len)
        return DirectKVMetadata(m.num_actual_tokens, m.num_reqs, self._graph_attention(m.num_reqs), store, views, None)

    def _decode_buffers(self) -> GraphDecode:
        """``GraphDecode``'s buffers, made once: as many requests as the scheduler runs, as many
        blocks per request as ``max_model_len`` takes (vLLM's block table width)."""
        if self._graph is None:
            self._graph = GraphDecode(self.vllm_config.scheduler_config.max_num_seqs,
                                      -(-self.vllm_config.model_config.max_model_len // self.page_size),
                                      self.num_kv_heads, self.page_size, self.device)
        return self._graph

    def _graph_attention(self, batch: int):
        """The ``DirectKVAttention`` planned once for decode steps of ``batch`` requests over
        ``GraphDecode``'s buffers: in place (as a CUDA graph capture plans: nothing staged), split
        for the longest context the server admits, so that one capture serves every step. Under a
        sparse budget its page count comes from that context (the buffers' width), and the
        selection (static shapes, into buffers bound now) runs inside the graph."""
        attention = self._graph_plans.get(batch)
        if attention is not None:
            return attention
        views = self._layer_views()
        attention = DirectKVAttention(views[self.layer_names[0]])
        info = DeviceInfo.current(self.device)
        info = DeviceInfo(info.name, info.sms, info.total_memory, capturing=True)
        attention.plan(tables=KernelTables(*self._decode_buffers().tables(batch)), q_lens=(1,) * batch,
                       num_q_heads=self.num_q_heads, max_seq_len=self.vllm_config.model_config.max_model_len,
                       cascade=False, device_info=info, sparse=self._sparse)
        self._graph_plans[batch] = attention
        return attention

    def _restart_write_logs(self) -> None:
        """Every host write of the steps before this one was enqueued before now: one event on the
        current stream stands for them in each layer's write log (``HostWriteLog.restart``); each
        layer's store adds the step's own pages (``DirectKVImpl.forward``)."""
        if torch.device(self.device).type != "cuda":
            return
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        for write_log in self._write_logs:
            write_log.restart(done)


def available_gpu_bytes(device) -> int | None:
    """GPU memory an allocation on ``device`` can take now: the driver's free bytes plus what
    torch's caching allocator holds unused; None off a GPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def pool_view(kv_cache: torch.Tensor, name: str, hbm: torch.Tensor, write_log=None, summaries=None):
    """The one-layer DirectKV pools over a layer's vLLM KV tensor and its HBM pool ``hbm`` (the
    KV tensor's layout with its own page count; 0 pages without an HBM tier), with the record of
    the host writes to that tensor (``write_log``, a ``cache.HostWriteLog``; None: none kept)
    and the pools' page summaries (``summaries``, a ``StoreSummaries``; None: none kept).
    The KV tensor is refused unless it is in pinned host memory and laid out as
    ``get_kv_cache_shape`` says."""
    if not kv_cache.is_cuda or not is_pinned_host(kv_cache):
        raise ValueError(f"the KV cache of {name} is not in DirectKV's pinned host memory: the backend needs vLLM's "
                         "V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1) and the directkv plugin loaded")
    if kv_cache.dim() != 5 or kv_cache.shape[2] != 2 or not kv_cache.is_contiguous():
        raise ValueError(f"the KV cache of {name} has shape {tuple(kv_cache.shape)} strides {kv_cache.stride()}, "
                         "expected a contiguous (blocks, kv_heads, 2, block_size, head_size)")
    host = kv_cache.unsqueeze(1)  # (pages, 1, Hkv, 2, P, d)
    return PoolView(host, hbm.unsqueeze(1), write_log=write_log, summaries=summaries)


class DirectKVImpl(AttentionImpl[DirectKVMetadata]):
    can_return_lse_for_decode: bool = False  # so vLLM refuses decode context parallelism
    supports_dcp: bool = False

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes=None, sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks: torch.Tensor | None = None) -> None:
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        refused = [what for what, bad in (
            ("ALiBi", alibi_slopes is not None), ("sliding-window attention", sliding_window is not None),
            ("logits soft cap", bool(logits_soft_cap)), (f"attention type {attn_type}", attn_type != AttentionType.DECODER),
            ("attention sinks", sinks is not None), (f"kv cache dtype {kv_cache_dtype}", kv_cache_dtype not in KV_CACHE_DTYPES),
            (f"head size {head_size}", head_size not in SUPPORTED_HEAD_DIMS),
            (f"{num_heads} query heads over {num_kv_heads} KV heads", num_heads % num_kv_heads)) if bad]
        if refused:
            raise ValueError(f"the DirectKV backend does not support {', '.join(refused)}")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads, self.kv_cache_dtype = num_kv_heads, kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: DirectKVMetadata, output: torch.Tensor, output_scale=None,
                output_block_scale=None) -> torch.Tensor:
        """query (tokens, Hq, d), key / value (tokens, Hkv, d), output (tokens, Hq, d) written."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("the DirectKV backend does not fuse output quantization")
        if attn_metadata is None:  # vLLM's memory profiling run: no KV cache yet
            return output.fill_(0)
        md = attn_metadata
        name = getattr(layer, "layer_name", None)
        pools = md.views.get(name)
        if pools is None:
            raise ValueError(f"attention layer {name!r} is not in the DirectKV group the step was built for")
        if md.store is not None and self.kv_sharing_target_layer_name is None and key is not None:
            store_kv(kv_cache, key, value, md.store, pools.hbm_pool[:, 0] if md.store.num_mirrored else None,
                     pools.summaries)
            if pools.write_log is not None and md.stored_pages is not None:
                pools.write_log.record(md.stored_pages)  # staged copies of these pages follow the store
        n = md.num_query_rows
        if md.attention is None:
            return output.zero_()
        q = query[:n]
        if not q.is_contiguous():
            q = q.contiguous()
        md.attention.run(q, 0, output[:n], softmax_scale=self.scale, pools=pools)
        if output.shape[0] > n:
            output[n:].zero_()  # padding rows
        return output

