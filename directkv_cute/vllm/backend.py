"""DirectKV as a vLLM attention backend (vLLM 0.26, V2 model runner): KV blocks in pinned host
memory, read in place by the DirectKV kernels (or staged to HBM where the planner says it pays).

* ``DirectKVBackend``: registered as ``AttentionBackendEnum.CUSTOM`` (``register``); its KV cache
  shape per layer is ``(num_blocks, num_kv_heads, 2, block_size, head_size)``, contiguous, so that
  ``kv_cache.unsqueeze(1)`` is exactly a one-layer DirectKV pool ``(pages, 1, Hkv, 2, P, d)`` and
  a vLLM block id is a host page index. ``memory.install`` puts those tensors in pinned host memory.
* ``DirectKVMetadataBuilder.build``, once per step: the step's shape from vLLM's CPU metadata,
  the page table from the block table, the K/V destinations from ``slot_mapping``
  (``step.py``), and the step's plan (``DirectKVAttention.plan``: the planner decides the kernel
  and any staging, once for every layer).
* ``DirectKVImpl.forward``, per layer: stores the layer's new K/V rows into their host pages
  (GPU stores through the mapped address, as ``PagedKVCache.write_slots`` does), then runs the
  step's plan over the layer's own pool.

Attention runs outside CUDA graphs (``AttentionCGSupport.NEVER``): a plan is made on the host per
step, so vLLM captures the rest of the model piecewise and runs attention between the graphs.
"""

from __future__ import annotations

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

from directkv_cute.config import SUPPORTED_HEAD_DIMS, SUPPORTED_PAGE_SIZES
from directkv_cute.vllm.step import check_geometry, page_table, slot_destinations, step_shape, store_kv

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
    dest:              int64 (2 or 3, m) on the device: the stored rows' pages, offsets and, unless
                       ``dense``, the token rows they come from.
    dense:             the stored rows are tokens ``0..m-1``.
    """

    num_actual_tokens: int
    num_query_rows: int
    attention: object
    dest: torch.Tensor | None
    dense: bool


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
        self._pools = None  # the first layer's pool view: the plans' geometry

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        return cls._cudagraph_support

    def _plan_pools(self):
        """A ``PoolView`` of the group's first layer (every layer of the group has its shape)."""
        if self._pools is None:
            layer = self.vllm_config.compilation_config.static_forward_context[self.layer_names[0]]
            self._pools = pool_view(layer.kv_cache, self.layer_names[0])
        return self._pools

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> DirectKVMetadata:
        from directkv_cute.attention import DirectKVAttention
        from directkv_cute.runner import tables_from_host

        m = common_attn_metadata
        if m.causal is not True:
            raise ValueError("the DirectKV backend computes causal attention only")
        pools = self._plan_pools()
        num_blocks = pools.host_pool.shape[0]
        seq = m.seq_lens_cpu_upper_bound
        seq = (m.seq_lens[: m.num_reqs].cpu() if seq is None else seq).numpy()
        shape = step_shape(m.query_start_loc_cpu.numpy(), seq, m.num_reqs)
        # The slots and the block table on the host: one wait for the GPU's queued work per step
        # (the planner reads the page table; padding tokens, slot -1, are never stored).
        slots = m.slot_mapping[: m.num_actual_tokens].cpu().numpy()
        dest = slot_destinations(slots, self.page_size, num_blocks)
        parts = [dest.pages, dest.offsets] + ([] if dest.dense else [dest.rows])
        dest_dev = torch.from_numpy(np.stack(parts)).to(self.device, non_blocking=True) if len(dest.rows) else None
        if not shape.rows:
            return DirectKVMetadata(m.num_actual_tokens, 0, None, dest_dev, dest.dense)
        width = min(-(-shape.max_seq_len // self.page_size), m.block_table_tensor.shape[1])
        blocks = m.block_table_tensor[: m.num_reqs, :width].cpu().numpy()[list(shape.rows)]
        table = page_table(blocks, shape.seq_lens, self.page_size, num_blocks)
        tables = tables_from_host(table, shape.seq_lens, self.device)._replace(back_to_back=True)
        attention = DirectKVAttention(pools)
        # Blocks that prefix caching shares (one block id in several rows) are read once for all
        # their sharers where the planner finds that pays (the cascade).
        plan = attention.plan(tables=tables, q_lens=shape.q_lens, num_q_heads=self.num_q_heads,
                              max_seq_len=shape.max_seq_len)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("DirectKV step: %d decodes, %d prefills\n%s", shape.num_decodes, shape.num_prefills,
                      plan.explain())
        return DirectKVMetadata(m.num_actual_tokens, shape.num_tokens, attention, dest_dev, dest.dense)


def pool_view(kv_cache: torch.Tensor, name: str):
    """The one-layer DirectKV pool over a layer's vLLM KV tensor (refused unless it is in pinned
    host memory and laid out as ``get_kv_cache_shape`` says)."""
    from directkv_cute.runner import PoolView
    from directkv_cute.vllm.memory import is_pinned_host

    if not kv_cache.is_cuda or not is_pinned_host(kv_cache):
        raise ValueError(f"the KV cache of {name} is not in DirectKV's pinned host memory: the backend needs vLLM's "
                         "V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1) and the directkv plugin loaded")
    if kv_cache.dim() != 5 or kv_cache.shape[2] != 2 or not kv_cache.is_contiguous():
        raise ValueError(f"the KV cache of {name} has shape {tuple(kv_cache.shape)} strides {kv_cache.stride()}, "
                         "expected a contiguous (blocks, kv_heads, 2, block_size, head_size)")
    host = kv_cache.unsqueeze(1)  # (pages, 1, Hkv, 2, P, d)
    return PoolView(host, host.new_empty((0, *host.shape[1:])))


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
        self._views: dict = {}  # KV tensor address -> its PoolView

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: DirectKVMetadata, output: torch.Tensor, output_scale=None,
                output_block_scale=None) -> torch.Tensor:
        """query (tokens, Hq, d), key / value (tokens, Hkv, d), output (tokens, Hq, d) written."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("the DirectKV backend does not fuse output quantization")
        if attn_metadata is None:  # vLLM's memory profiling run: no KV cache yet
            return output.fill_(0)
        md = attn_metadata
        pools = self._views.get(kv_cache.data_ptr())
        if pools is None:
            pools = self._views[kv_cache.data_ptr()] = pool_view(kv_cache, getattr(layer, "layer_name", "a layer"))
        if md.dest is not None and self.kv_sharing_target_layer_name is None and key is not None:
            store_kv(kv_cache, key, value, md.dest, md.dense)
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

