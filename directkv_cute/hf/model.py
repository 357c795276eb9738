"""What the integration needs to know about a model, and what it refuses: ``ModelSpec`` (the
attention shape), ``model_spec`` (the refusals of attention features the kernels do not
implement), the per-call checks of attention modules and their tensors, the page dtype of a
``kv_dtype`` argument, and the keyword a model's forward takes its cache under."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from directkv_cute.fp8 import fp8_dtype, is_fp8

KERNEL_HEAD_DIMS = (64, 128)
MAX_GQA_GROUP = 64


class UnsupportedModelError(ValueError):
    """The model uses an attention feature the DirectKV kernels do not implement."""


@dataclass(frozen=True)
class ModelSpec:
    """The attention shape of a decoder: what the cache and the kernels need to know."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads


def text_config(config):
    """The decoder's config of a (possibly multimodal) model config."""
    get = getattr(config, "get_text_config", None)
    if get is None:
        return config
    try:
        return get(decoder=True)
    except TypeError:  # older signature
        return get()


def model_spec(config) -> ModelSpec:
    """The model's attention shape, or ``UnsupportedModelError`` naming what the kernels cannot do."""
    config = text_config(config)
    name = getattr(config, "model_type", type(config).__name__)

    def refuse(feature: str) -> None:
        raise UnsupportedModelError(f"{name}: {feature} is not supported by DirectKV attention")

    if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False):
        refuse("cross-attention (an encoder-decoder model)")
    if not getattr(config, "is_causal", True):
        refuse("bidirectional (non-causal) attention")
    if getattr(config, "kv_lora_rank", None) or getattr(config, "q_lora_rank", None):
        refuse(f"multi-head latent attention (kv_lora_rank={getattr(config, 'kv_lora_rank', None)})")
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        other = sorted({t for t in layer_types if t != "full_attention"})
        if other:
            refuse(f"layer types {other} (only full attention layers)")
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) and not layer_types:
        refuse(f"sliding-window attention (sliding_window={window})")
    if getattr(config, "attention_chunk_size", None):
        refuse(f"chunked attention (attention_chunk_size={config.attention_chunk_size})")
    if getattr(config, "attn_logit_softcapping", None):
        refuse(f"attention logit soft-capping (attn_logit_softcapping={config.attn_logit_softcapping})")
    if getattr(config, "use_sinks", False) or name in ("gpt_oss",):
        refuse("attention sinks")
    hq = getattr(config, "num_attention_heads", None)
    layers = getattr(config, "num_hidden_layers", None)
    if not hq or not layers:
        refuse("a config without num_attention_heads / num_hidden_layers")
    hkv = getattr(config, "num_key_value_heads", None) or hq
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // hq
    if hq % hkv:
        refuse(f"{hq} query heads over {hkv} KV heads (not a whole GQA group)")
    if hq // hkv > MAX_GQA_GROUP:
        refuse(f"a GQA group of {hq // hkv} query heads per KV head (at most {MAX_GQA_GROUP})")
    if head_dim % 8:
        refuse(f"head_dim {head_dim} (a multiple of 8 is needed)")
    return ModelSpec(int(layers), int(hq), int(hkv), int(head_dim))


def resolve_kv_dtype(kv_dtype, dtype: torch.dtype) -> torch.dtype:
    """The page dtype of ``DirectKVCache(kv_dtype=...)`` for a model computing in ``dtype``."""
    if kv_dtype is None or kv_dtype == "auto":
        return dtype
    if isinstance(kv_dtype, str):
        key = kv_dtype.lower().removeprefix("torch.")
        named = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
                 "fp32": torch.float32, "float32": torch.float32}
        if key in named:
            kv_dtype = named[key]
        else:
            try:
                kv_dtype = fp8_dtype(key)
            except ValueError:
                raise ValueError(f"kv_dtype must be None, 'auto', 'fp8', 'e5m2', 'bf16', 'fp16' or a torch dtype, "
                                 f"got {kv_dtype!r}") from None
    if not isinstance(kv_dtype, torch.dtype):
        raise TypeError(f"kv_dtype must be a str or a torch.dtype, got {type(kv_dtype).__name__}")
    if is_fp8(kv_dtype):
        return kv_dtype
    if kv_dtype != dtype:
        raise ValueError(f"kv_dtype {kv_dtype} differs from the model's {dtype}: pages hold the model's dtype, or FP8 "
                         "(kv_dtype='fp8')")
    return kv_dtype


def cache_kwargs(model, cache) -> dict:
    """The keyword under which ``model.forward`` / ``generate`` take a cache: ``cache`` in
    transformers >= 5.24, ``past_key_values`` before (still accepted there, with a warning)."""
    forward = getattr(model, "forward", model)
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        params = {}
    return {"cache" if "cache" in params else "past_key_values": cache}


def check_module(module) -> None:
    """Refuse an attention module the kernels cannot run (training, sinks, sliding window, ...)."""
    name = type(module).__name__
    if getattr(module, "training", False):
        raise UnsupportedModelError(f"{name}: DirectKV attention is inference only (call model.eval())")
    if getattr(module, "sinks", None) is not None:
        raise UnsupportedModelError(f"{name}: attention sinks are not supported by DirectKV attention")
    if getattr(module, "sliding_window", None):
        raise UnsupportedModelError(f"{name}: sliding-window attention ({module.sliding_window}) is not supported")
    if not getattr(module, "is_causal", True):
        raise UnsupportedModelError(f"{name}: non-causal attention is not supported by DirectKV attention")
    if getattr(module, "is_cross_attention", False):
        raise UnsupportedModelError(f"{name}: cross-attention is not supported by DirectKV attention")


def _check_runs_in(query, dtype: torch.dtype, device: torch.device, *others) -> None:
    if query.dtype != dtype or any(t.dtype != dtype for t in others):
        raise TypeError(f"the model runs in {query.dtype}, the cache holds {dtype} "
                        "(build the cache with the model's dtype)")
    if query.device != device:
        raise ValueError(f"the model runs on {query.device}, the cache is on {device}")


def check_query(query, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> None:
    """A layer's query (B, Hq, S, d) against the cache's shape, dtype and device."""
    if query.dim() != 4 or query.shape[1] != spec.num_q_heads or query.shape[3] != spec.head_dim:
        raise ValueError(f"query {tuple(query.shape)} does not match the cache's {spec.num_q_heads} query heads, "
                         f"head_dim {spec.head_dim} (expected (B, Hq, S, d))")
    _check_runs_in(query, dtype, device)


def check_qkv(query, key, value, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> None:
    """A layer's query and new K/V (B, H, S, d) against the cache's shape, dtype and device."""
    if query.dim() != 4 or key.dim() != 4 or key.shape != value.shape:
        raise ValueError(f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}: "
                         "expected (B, H, S, d) tensors")
    if query.shape[1] != spec.num_q_heads or key.shape[1] != spec.num_kv_heads or query.shape[3] != spec.head_dim:
        raise ValueError(f"query {tuple(query.shape)} / key {tuple(key.shape)} do not match the cache's "
                         f"{spec.num_q_heads} query heads, {spec.num_kv_heads} KV heads, head_dim {spec.head_dim}")
    if key.shape[0] != query.shape[0] or key.shape[2] != query.shape[2]:
        raise ValueError(f"key {tuple(key.shape)} holds other tokens than query {tuple(query.shape)} "
                         "(DirectKVCache.update returns the step's new tokens)")
    _check_runs_in(query, dtype, device, key)
