"""directkv-cute: zero-copy attention over a paged KV cache in pinned host memory.

Public API:
    PagedKVCache            the whole-model paged KV cache (pinned host tier + optional HBM tier)
    paged_attention         attention of new query tokens over their cached history
    paged_attention_tables  the same with page tables built once (per step / CUDA graphs)
    DecodeConfig            kernel knobs (tile, stages, splits, SMEM carveout, warpgroups)
    paged_attention_ref     the float32 reference (also the CPU path)
"""

from directkv_cute.cache import CacheCapacityError, KernelTables, PagedKVCache
from directkv_cute.config import ConfigError, DecodeConfig, default_decode_config, default_prefill_config
from directkv_cute.ops import paged_attention, paged_attention_tables
from directkv_cute.reference import dense_attention_ref, paged_attention_ref

__version__ = "0.1.0"

__all__ = [
    "CacheCapacityError",
    "ConfigError",
    "DecodeConfig",
    "KernelTables",
    "PagedKVCache",
    "__version__",
    "default_decode_config",
    "default_prefill_config",
    "dense_attention_ref",
    "paged_attention",
    "paged_attention_ref",
    "paged_attention_tables",
]
