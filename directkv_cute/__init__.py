"""directkv-cute: zero-copy attention over a paged KV cache in pinned host memory.

Public API:
    PagedKVCache            the whole-model paged KV cache (pinned host tier + optional HBM tier)
    paged_attention         attention of new query tokens over their cached history
    paged_attention_tables  the same with page tables built once (per step / CUDA graphs)
    DecodeConfig            kernel knobs (tile, stages, splits, SMEM carveout, warpgroups)
    paged_attention_ref     the float32 reference (also the CPU path)
"""

from importlib import import_module
from importlib.util import find_spec as _find_spec

from directkv_cute.config import ConfigError, DecodeConfig, default_decode_config, default_prefill_config

__version__ = "0.1.0"

# torch-backed pieces load on first use, so that `directkv_cute.config` and
# `directkv_cute.tuning` stay importable without torch (the tuner's CLI, CI tools).
_LAZY = {
    "CacheCapacityError": "directkv_cute.cache",
    "KernelTables": "directkv_cute.cache",
    "PagedKVCache": "directkv_cute.cache",
    "paged_attention": "directkv_cute.ops",
    "paged_attention_tables": "directkv_cute.ops",
    "dense_attention_ref": "directkv_cute.reference",
    "paged_attention_ref": "directkv_cute.reference",
}


if _find_spec("torch") is not None:
    # The op registers torch.ops.directkv_cute.paged_attention at import: make it exist as soon
    # as the package does (the kernels themselves still load on first use).
    import_module("directkv_cute.ops")


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'directkv_cute' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value

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
