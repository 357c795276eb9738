"""The fused K/V projection: ``fuse_kv_projection`` gives attention modules a forward whose K and
V come from ``kv_project`` -- one kernel per layer for the K/V projection, RoPE and the store of
the new K/V into their pages. The forward hands the layer's inputs to
``DirectKVCache.attend_fused``; the step runs the layer (``hf.step.Step.run_fused``)."""

from __future__ import annotations

import types

import torch

from directkv_cute.hf.cache import DirectKVCache
from directkv_cute.hf.model import UnsupportedModelError
from directkv_cute.kv_proj import HEAD_DIM, SUPPORTED_DTYPES

# Attention modules whose forward is q/k/v projections, transformers' apply_rotary_pos_emb (NeoX
# rotate_half layout) on q and k from the model's position_embeddings, the cache update, the
# attention and o_proj, with no norm on q or k: their K/V can come from ``kv_project``.
FUSABLE_ATTENTION = ("LlamaAttention", "MistralAttention", "Qwen2Attention")


def _fusable(module) -> bool:
    return any(c.__name__ in FUSABLE_ATTENTION for c in type(module).__mro__)


def _check_fusable(module) -> None:
    name = type(module).__name__
    for part in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if not isinstance(getattr(module, part, None), torch.nn.Linear):
            raise UnsupportedModelError(f"{name}: no {part} linear layer; the fused K/V projection needs one")
    for norm in ("q_norm", "k_norm"):
        if getattr(module, norm, None) is not None:
            raise UnsupportedModelError(f"{name}: {norm} (a norm on q/k before RoPE) is not supported by the fused "
                                        "K/V projection; run the model unfused")
    if module.head_dim != HEAD_DIM:
        raise UnsupportedModelError(f"{name}: head_dim {module.head_dim}; the fused K/V projection supports {HEAD_DIM}")
    dtype = module.k_proj.weight.dtype
    if dtype not in SUPPORTED_DTYPES:
        raise UnsupportedModelError(f"{name}: weights in {dtype}; the fused K/V projection supports {SUPPORTED_DTYPES}")
    if getattr(module, "sliding_window", None):
        raise UnsupportedModelError(f"{name}: sliding-window attention ({module.sliding_window}) is not supported")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _fused_forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    """The forward ``fuse_kv_projection`` gives an attention module: with a ``DirectKVCache``
    (``past_key_values=``, or ``cache=`` in newer transformers), q_proj and RoPE on q as
    transformers does them, K/V by ``DirectKVCache.attend_fused``, o_proj; with any other cache,
    the module's own forward."""
    cache = kwargs.get("past_key_values")
    if cache is None:
        cache = kwargs.get("cache")
    if not isinstance(cache, DirectKVCache) or position_embeddings is None:
        return self._directkv_unfused_forward(hidden_states, position_embeddings=position_embeddings,
                                              attention_mask=attention_mask, **kwargs)
    batch, q_len, _ = hidden_states.shape
    d = self.head_dim
    q = self.q_proj(hidden_states).view(batch, q_len, -1, d).transpose(1, 2)  # (B, Hq, S, d)
    cos, sin = position_embeddings  # (B, S, d) each
    q = (q * cos.unsqueeze(1)) + (_rotate_half(q) * sin.unsqueeze(1))
    o = cache.attend_fused(self, q, hidden_states, cos, sin, attention_mask, self.scaling, self.layer_idx)
    return self.o_proj(o.reshape(batch, q_len, -1)), None


def fuse_kv_projection(model) -> int:
    """Give every attention module of ``model`` (Llama, Mistral, Qwen2 and their subclasses) a
    forward that, with a ``DirectKVCache``, computes K and V with ``kv_project``: one kernel per
    layer for the K/V projection, RoPE and the store of the new K/V into their pages (the HBM
    window; the host copy by the copy engine), so the new tokens never cross the link but once,
    into host memory. With any other cache the module's own forward runs. Checked before any
    module changes (``UnsupportedModelError`` naming the feature: q/k norms, head_dim other than
    128, weights not bf16/fp16, sliding windows, no supported attention module). Idempotent;
    ``unfuse_kv_projection`` undoes it. Returns the number of modules fused."""
    modules = [m for m in model.modules() if _fusable(m)]
    if not modules:
        raise UnsupportedModelError(f"{type(model).__name__}: no attention module the fused K/V projection supports "
                                    f"({', '.join(FUSABLE_ATTENTION)})")
    for m in modules:
        _check_fusable(m)
    for m in modules:
        if "_directkv_unfused_forward" not in m.__dict__:
            m._directkv_unfused_forward = m.forward
            m.forward = types.MethodType(_fused_forward, m)
    return len(modules)


def unfuse_kv_projection(model) -> int:
    """Restore the forwards ``fuse_kv_projection`` replaced; returns how many."""
    n = 0
    for m in model.modules():
        if "_directkv_unfused_forward" in m.__dict__:
            m.forward = m.__dict__.pop("_directkv_unfused_forward")
            n += 1
    return n
