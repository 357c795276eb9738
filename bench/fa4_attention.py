"""FlashAttention-4 as a transformers attention function: ``attn_implementation="directkv_fa4"``,
the attention of the end-to-end bench's FA4 peers (``bench.e2e``: ``fa4`` over a DynamicCache,
``hf-offloaded+fa4`` over transformers' offloaded cache).

Importing this module registers the name with transformers' ``AttentionInterface`` (the attention)
and ``AttentionMaskInterface`` (the mask: None for a plain causal call, else the 2-D padding
mask, which the attention refuses). It imports without flash-attn-4; FA4 itself
(``flash_attn.cute.flash_attn_func``) is loaded on the first attention call, and
``bench.peers.unavailable`` says why it cannot run here.

The attention takes transformers' layouts, query ``(B, Hq, S, d)`` and key / value
``(B, Hkv, L, d)`` (the cache's full K/V after this step's update), hands FA4 views of them as
``(B, S, H, d)`` (transposes, no copies: the last dim stays unit-stride), with ``causal=True``
(FA's causal mask is bottom-right aligned: query i of S sits at key position L - S + i, right for
chunked prefill and decode) and ``softmax_scale=scaling``; GQA is FA4's own (Hq a multiple of
Hkv). It returns ``(out (B, S, Hq, d), None)``.

Refused (``Fa4AttentionUnsupported``, naming the feature): a padding mask (a 2-D mask that is
not all ones, e.g. a left-padded batch), a 4-D mask that is not the plain bottom-right causal
one, any other mask object, dropout > 0, sliding windows, soft-capping, attention sinks,
non-causal (bidirectional) attention, other mask patterns (packed sequences, or/and mask
functions), and more queries than keys.
"""

from __future__ import annotations

import torch

ATTN_IMPLEMENTATION = "directkv_fa4"


class Fa4AttentionUnsupported(NotImplementedError):
    """The call needs an attention feature this FA4 wrapper does not implement."""


_FA4 = None  # flash_attn.cute.flash_attn_func once loaded


def unavailable(device: str = "cuda") -> str | None:
    """Why FA4 cannot run here, or None (``bench.peers.unavailable``)."""
    from bench.peers import unavailable as peers_unavailable

    return peers_unavailable(device)


def _flash_attn_func():
    """FA4's ``flash_attn_func`` (loaded once; a clear error where FA4 cannot run). Tests replace
    this with a reference implementation of the same call."""
    global _FA4
    if _FA4 is None:
        why = unavailable("cuda")
        if why:
            raise RuntimeError(f"attn_implementation={ATTN_IMPLEMENTATION!r}: {why}")
        from flash_attn.cute import flash_attn_func

        _FA4 = flash_attn_func
    return _FA4


def _refuse(feature: str) -> None:
    raise Fa4AttentionUnsupported(f"attn_implementation={ATTN_IMPLEMENTATION!r} (FlashAttention-4, causal, no "
                                  f"padding) does not support {feature}")


def is_plain_causal(mask: torch.Tensor, q_len: int, kv_len: int) -> bool:
    """Whether a 4-D mask ``(B|1, H|1, q_len, kv_len)`` is exactly the bottom-right causal mask
    (bool: True where attended; float: 0 where attended, a large negative elsewhere)."""
    if mask.dim() != 4 or mask.shape[-2:] != (q_len, kv_len):
        return False
    if mask.dtype == torch.bool:
        allowed = mask
    else:
        if mask.dtype.is_floating_point:
            blocked = mask < -1e4
            if not bool(((mask == 0) | blocked).all()):
                return False
        allowed = mask == 0
    rows = torch.arange(q_len, device=mask.device).view(q_len, 1)
    cols = torch.arange(kv_len, device=mask.device).view(1, kv_len)
    want = cols <= rows + (kv_len - q_len)
    return bool((allowed == want).all())


def fa4_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The ``attn_implementation="directkv_fa4"`` attention function: (out (B, S, Hq, d), None)."""
    if dropout:
        _refuse(f"attention dropout ({dropout}; inference only)")
    for feature in ("sliding_window", "softcap", "s_aux", "sinks"):
        if kwargs.get(feature) is not None:
            _refuse(f"{feature}={kwargs[feature]!r}")
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        _refuse("non-causal (bidirectional) attention")
    q_len, kv_len = query.shape[2], key.shape[2]
    if q_len > kv_len:
        _refuse(f"more queries ({q_len}) than keys ({kv_len})")
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor):
            _refuse(f"a {type(attention_mask).__name__} attention mask")
        if attention_mask.dim() == 2:
            # fa4_mask returns a 2-D mask only where it is not all ones over the keys
            if attention_mask.shape[-1] != kv_len or not bool(attention_mask.all()):
                _refuse("a padding mask (a 2-D attention mask with zeros, e.g. a left-padded batch)")
        elif not is_plain_causal(attention_mask, q_len, kv_len):
            _refuse(f"a {attention_mask.dim()}-D attention mask other than the plain causal one "
                    "(padding or a custom pattern)")
    if query.shape[1] % key.shape[1]:
        _refuse(f"{query.shape[1]} query heads over {key.shape[1]} KV heads (not a multiple)")
    fa = _flash_attn_func()
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, S|L, H, d) views
    from bench.peers import _out

    out = _out(fa(q, k, v, softmax_scale=scaling, causal=True))
    return out, None


def fa4_mask(batch_size=None, q_length=None, kv_length=None, attention_mask=None, mask_function=None, **kwargs):
    """The mask function registered with the attention: None for a plain causal call (no mask,
    or a 2-D mask of ones over the keys), else the 2-D mask (which the attention refuses).
    Other mask patterns (sliding windows, packed sequences, or/and mask functions) are refused."""
    from transformers.masking_utils import causal_mask_function

    if mask_function is not None and mask_function is not causal_mask_function:
        _refuse(f"the mask pattern {getattr(mask_function, '__name__', mask_function)!r} (only plain causal)")
    from directkv_cute.hf import directkv_mask

    mask = directkv_mask(attention_mask=attention_mask, kv_length=kv_length)  # the 2-D mask as bool
    if (mask is not None and mask.dim() == 2 and (kv_length is None or mask.shape[1] == kv_length)
            and bool(mask.all())):
        return None
    return mask


def register() -> None:
    """Register ``attn_implementation="directkv_fa4"`` with transformers (done at import)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, fa4_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, fa4_mask)


register()

__all__ = ["ATTN_IMPLEMENTATION", "Fa4AttentionUnsupported", "fa4_attention", "fa4_mask", "is_plain_causal",
           "register", "unavailable"]
