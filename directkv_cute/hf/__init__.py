"""Hugging Face transformers integration: a ``transformers.Cache`` over one ``PagedKVCache`` and
an attention function registered as ``attn_implementation="directkv"``.

    import directkv_cute.hf as dkhf                       # registers "directkv"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda",
                                                 attn_implementation="directkv")
    cache = dkhf.DirectKVCache(model, max_tokens=batch * (prompt + new_tokens))
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)

How a forward step runs. transformers calls, per decoder layer, ``cache.update(k, v, layer)``
(after RoPE) and then the attention function with the layer's queries and what ``update``
returned. ``update`` only hands the new K/V to the attention function (it cannot see the padding
mask); the attention function of the first layer plans the step once -- which of the new tokens
are real (left padding from the 2-D attention mask never enters the cache), how many pages each
sequence grows by and in which tier, the page tables, the store slots and the attention plan
(``DirectKVAttention.plan``: the kernel, whether a long prefill chunk is staged into HBM, the
cascade over pages that forked sequences share) -- and every layer then stores its new K/V
straight into their pages (GPU stores into pinned host memory, no staging buffer) and runs that
plan over the sequences' whole history (``DirectKVAttention.run``). Query rows of pad tokens get
zeros.

Placement: host only by default. With ``hbm_budget`` (bytes) an HBM tier holds each sequence's
first ``sink_pages`` pages and its most recent pages, an equal share of the budget per sequence;
when a sequence outgrows its share its oldest non-sink HBM page moves to host memory, so every
byte crosses the link once, as in the host-only cache.

A step is all or nothing: its capacity is checked before anything changes, and a refusal or an
error at any layer rolls it back, so a retry generates what a fresh cache generates. A cache
serves the model it was built for (another layer count, KV heads or head_dim is refused at the
first layer) and one generation at a time: the thread of its first step owns it until
``reset()``; another thread's steps are refused with a RuntimeError while the owner lives.

``get_seq_length()`` counts the token columns processed (pads included), as transformers'
``DynamicCache`` does: generate slices its inputs and the attention mask by it. Each sequence's
real length is ``cache.seq_lengths()``.

Not supported (refused with an error naming the feature): sliding-window or chunked attention
layers, linear-attention layers, attention logit soft-capping, attention sinks, cross-attention /
encoder-decoder models, MLA, head dims other than 64 / 128 on a GPU, training. ``crop`` (assisted
decoding) raises; beam search and ``num_return_sequences`` fork sequences (shared full pages).
``torch.compile`` / CUDA graphs of a whole step are not possible: each step plans its pages and
tables on the host (a device-to-host read of the padding counts, growing page tables).

Modules: ``hf.cache`` (the transformers adapter: the Cache API), ``hf.step`` (a step over the
batch's sequences, which runs each layer: store, fused store, attend), ``hf.step_plan`` (its
host decisions as plain functions), ``hf.fused`` (the fused K/V projection), ``hf.model`` (model
checks and refusals), ``hf.attention`` (the registration).
"""

from directkv_cute.cache import CacheCapacityError
from directkv_cute.hf.attention import ATTN_IMPLEMENTATION, directkv_attention, directkv_mask, register
from directkv_cute.hf.cache import DirectKVCache, DirectKVLayer
from directkv_cute.hf.fused import FUSABLE_ATTENTION, fuse_kv_projection, unfuse_kv_projection
from directkv_cute.hf.model import (
    KERNEL_HEAD_DIMS,
    MAX_GQA_GROUP,
    ModelSpec,
    UnsupportedModelError,
    cache_kwargs,
    model_spec,
    resolve_kv_dtype,
)
from directkv_cute.hf.step_plan import Growth, plan_growth

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CacheCapacityError",
    "DirectKVCache",
    "DirectKVLayer",
    "FUSABLE_ATTENTION",
    "Growth",
    "KERNEL_HEAD_DIMS",
    "MAX_GQA_GROUP",
    "ModelSpec",
    "UnsupportedModelError",
    "cache_kwargs",
    "directkv_attention",
    "directkv_mask",
    "fuse_kv_projection",
    "model_spec",
    "plan_growth",
    "register",
    "resolve_kv_dtype",
    "unfuse_kv_projection",
]

register()
