"""The ``attn_implementation="directkv"`` registration with transformers: the attention function
(it takes over from ``DirectKVCache.update`` and runs ``DirectKVCache.attend``) and the mask
function (the 2-D padding mask as is; causality is the kernels' own)."""

from __future__ import annotations

import torch

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("directkv_cute.hf needs transformers: pip install 'directkv-cute[hf]'") from exc

from directkv_cute.hf.cache import HANDOFF
from directkv_cute.hf.model import UnsupportedModelError

ATTN_IMPLEMENTATION = "directkv"


def directkv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The ``attn_implementation="directkv"`` attention function: (out (B, S, Hq, d), None)."""
    pending, HANDOFF.pending = HANDOFF.pending, None
    if pending is None or pending[2] is not key:
        last = HANDOFF.last() if HANDOFF.last is not None else None
        if last is not None:  # a layer that skipped the cache update: undo what the step stored
            last.abort_own_step()
        raise RuntimeError("attn_implementation='directkv' needs a directkv_cute.hf.DirectKVCache as the "
                           "model's cache (generate(..., past_key_values=cache))")
    cache, layer_idx, _ = pending
    try:  # a refusal at any layer rolls back the step earlier layers stored
        if getattr(module, "layer_idx", layer_idx) != layer_idx:
            raise RuntimeError(f"attention of layer {module.layer_idx} after the cache update of layer {layer_idx}")
        if dropout:
            raise UnsupportedModelError("attention dropout is not supported (inference only)")
        for feature in ("sliding_window", "softcap", "s_aux", "sinks"):
            if kwargs.get(feature) is not None:
                raise UnsupportedModelError(f"attention with {feature}={kwargs[feature]!r} is not supported by "
                                            "DirectKV")
    except BaseException:
        cache.abort_own_step()
        raise
    return cache.attend(module, query, key, value, attention_mask, scaling, layer_idx), None


def directkv_mask(batch_size=None, q_length=None, kv_length=None, attention_mask=None, **kwargs):
    """The mask function registered with the attention: the 2-D padding mask (B, kv_length) as
    bool, or None when the model was called without one. Causality is the kernels' own."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        return attention_mask
    if kv_length is not None and attention_mask.shape[1] > kv_length:
        attention_mask = attention_mask[:, -kv_length:]
    return attention_mask.to(torch.bool)


def register() -> None:
    """Register ``attn_implementation="directkv"`` with transformers (done at import)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, directkv_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, directkv_mask)
