"""directkv-cute: zero-copy attention over a paged KV cache in pinned host memory.

Public API:
    PagedKVCache            the whole-model paged KV cache (pinned host tier + optional HBM tier)
    paged_attention         attention of new query tokens over their cached history
    paged_attention_tables  the same with page tables built once (per step / CUDA graphs)
    cascade_attention       the same reading the pages forked sequences share once per batch
    DirectKVAttention       plan once per model step (an AttentionPlan, printable), run per layer
    kv_project              fused K/V projection + RoPE + store of new tokens into host/HBM pages
    DecodeConfig            kernel knobs (tile, stages, splits, SMEM carveout, warpgroups)
    StagingRequest          an explicit Q-tiled call's staging (pieces, KV splits, launch/copy order)
    SparseBudget            opt-in: decode rows read only their best pages (page summaries' bound)
    paged_attention_ref     the float32 reference (also the CPU path)
"""

from importlib import import_module
import os as _os
import sys as _sys

# A source checkout imported without the install's mapping (no install, or an editable install by
# an older setuptools that ignores package-dir): `tuning/` and `profiles/` sit beside this folder,
# not in it. The package's path then also names the checkout's root, so that
# `directkv_cute.tuning` and `directkv_cute.profiles` are those folders, as in an install.
_here = _os.path.dirname(_os.path.abspath(__file__))
_root = _os.path.dirname(_here)
if not _os.path.isdir(_os.path.join(_here, "tuning")) and _os.path.isfile(_os.path.join(_root, "tuning", "__init__.py")):
    __path__.append(_root)

from directkv_cute.config import ConfigError, DecodeConfig, default_decode_config, default_multi_token_config
from directkv_cute.version import __version__

# torch-backed pieces load on first use, so that `directkv_cute.config` and
# `directkv_cute.tuning` stay importable without torch (the tuner's CLI, CI tools).
_LAZY = {
    "CacheCapacityError": "directkv_cute.cache",
    "KernelTables": "directkv_cute.cache",
    "PagedKVCache": "directkv_cute.cache",
    "paged_attention": "directkv_cute.ops",
    "paged_attention_tables": "directkv_cute.ops",
    "cascade_attention": "directkv_cute.ops",
    "DirectKVAttention": "directkv_cute.attention",
    "AttentionPlan": "directkv_cute.plan_types",
    "StagingRequest": "directkv_cute.plan_types",
    "SparseBudget": "directkv_cute.sparse_budget",
    "DeviceInfo": "directkv_cute.machine",
    "plan_cascade": "directkv_cute.cascade",
    "dense_attention_ref": "directkv_cute.reference",
    "paged_attention_ref": "directkv_cute.reference",
    "KVProjConfig": "directkv_cute.kv_proj",
    "kv_project": "directkv_cute.kv_proj",
    "kv_project_reference": "directkv_cute.kv_proj",
}


if "torch" in _sys.modules:
    # With torch loaded, torch.ops.directkv_cute.paged_attention exists as soon as the package
    # does (the kernels still load on first use). Without it the package stays torch-free, so that
    # `directkv_cute.tuning` and `directkv_cute.config` import light; the op then registers on
    # first use of any torch-backed name.
    import_module("directkv_cute.ops")


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'directkv_cute' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value

__all__ = [
    "AttentionPlan",
    "CacheCapacityError",
    "ConfigError",
    "DecodeConfig",
    "DeviceInfo",
    "DirectKVAttention",
    "KVProjConfig",
    "KernelTables",
    "PagedKVCache",
    "SparseBudget",
    "StagingRequest",
    "__version__",
    "cascade_attention",
    "default_decode_config",
    "default_multi_token_config",
    "dense_attention_ref",
    "kv_project",
    "kv_project_reference",
    "paged_attention",
    "paged_attention_ref",
    "paged_attention_tables",
    "plan_cascade",
]
