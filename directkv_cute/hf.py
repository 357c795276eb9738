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
sequence grows by and in which tier, the page tables and the store slots -- and every layer then
stores its new K/V straight into their pages (GPU stores into pinned host memory, no staging
buffer) and runs ``paged_attention_tables`` over the sequences' whole history (a long prefill
chunk whose attention is compute-bound is staged into HBM by the op, see ``directkv_cute.ops``).
Query rows of pad tokens get zeros.

Placement: host only by default. With ``hbm_budget`` (bytes) an HBM tier holds each sequence's
first ``sink_pages`` pages and its most recent pages, an equal share of the budget per sequence;
when a sequence outgrows its share its oldest non-sink HBM page moves to host memory, so every
byte crosses the link once, as in the host-only cache.

``get_seq_length()`` counts the token columns processed (pads included), as transformers'
``DynamicCache`` does: generate slices its inputs and the attention mask by it. Each sequence's
real length is ``cache.seq_lengths()``.

Not supported (refused with an error naming the feature): sliding-window or chunked attention
layers, linear-attention layers, attention logit soft-capping, attention sinks, cross-attention /
encoder-decoder models, MLA, head dims other than 64 / 128 on a GPU, training. ``crop`` (assisted
decoding) raises; beam search and ``num_return_sequences`` fork sequences (shared full pages).
``torch.compile`` / CUDA graphs of a whole step are not possible: each step plans its pages and
tables on the host (a device-to-host read of the padding counts, growing page tables).
"""

from __future__ import annotations

import inspect
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

try:
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache, CacheLayerMixin
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("directkv_cute.hf needs transformers: pip install 'directkv-cute[hf]'") from exc

from directkv_cute.cache import CacheCapacityError, PagedKVCache, TokenSlots, page_bytes
from directkv_cute.fp8 import fp8_dtype, is_fp8
from directkv_cute.tp import gpu_numa_node, model_shard, on_node

ATTN_IMPLEMENTATION = "directkv"
KERNEL_HEAD_DIMS = (64, 128)
MAX_GQA_GROUP = 64

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CacheCapacityError",
    "DirectKVCache",
    "ModelSpec",
    "UnsupportedModelError",
    "cache_kwargs",
    "directkv_attention",
    "fuse_kv_projection",
    "model_spec",
    "plan_growth",
    "register",
    "unfuse_kv_projection",
]


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


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    if get is None:
        return config
    try:
        return get(decoder=True)
    except TypeError:  # older signature
        return get()


def model_spec(config) -> ModelSpec:
    """The model's attention shape, or ``UnsupportedModelError`` naming what the kernels cannot do."""
    config = _text_config(config)
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


# ---- placement (plain Python, testable on a CPU) ---------------------------------------------
def _hbm_targets(num_pages: int, quota: int, sink_pages: int) -> set[int]:
    """Logical pages a sequence of ``num_pages`` pages keeps in HBM under ``quota`` pages:
    the first sink pages, then the most recent ones."""
    sinks = min(sink_pages, quota, num_pages)
    recent = quota - sinks
    return set(range(sinks)) | set(range(max(sinks, num_pages - recent), num_pages))


@dataclass(frozen=True)
class Growth:
    """How one sequence grows in a step: pages to demote first, then ``extend`` runs."""

    demote: tuple[int, ...]  # logical pages moving HBM -> host
    runs: tuple[tuple[str, int], ...]  # (tier, tokens) extends, in order


def plan_growth(length: int, hbm_pages: Sequence[int], n: int, page_size: int, quota: int,
                sink_pages: int) -> Growth:
    """Plan for a sequence of ``length`` tokens whose logical pages ``hbm_pages`` are in HBM to
    grow by ``n`` tokens under an HBM ``quota`` (pages): the old HBM pages that fall out of the
    sink + recent window are demoted, and the new pages are allocated in runs by tier."""
    old = -(-length // page_size)
    new = -(-(length + n) // page_size)
    target = _hbm_targets(new, quota, sink_pages) if quota > 0 else set()
    demote = tuple(sorted(lp for lp in hbm_pages if lp not in target))
    runs: list[tuple[str, int]] = []
    at = length
    lp = old
    while lp < new:
        tier = "hbm" if lp in target else "host"
        end = lp
        while end < new and (("hbm" if end in target else "host") == tier):
            end += 1
        stop = min(end * page_size, length + n)
        runs.append((tier, stop - at))
        at, lp = stop, end
    if at < length + n:  # the tokens fit the partial last page
        runs.append(("host", length + n - at))
    return Growth(demote, tuple(runs))


# ---- the transformers cache ------------------------------------------------------------------
class _Handoff(threading.local):
    """``update`` -> attention function hand-off within one thread (one layer at a time)."""

    pending: tuple | None = None


_HANDOFF = _Handoff()


@dataclass
class _Step:
    """One forward step, planned by its first layer and reused by the others."""

    batch: int
    q_len: int
    rows: list[int]  # batch rows with at least one real new token
    q_lens: list[int]  # their real new tokens
    tok_idx: torch.Tensor | None  # int64 (total,) rows of (B * S) that are real, None when all are
    slots: object  # TokenSlots of the real tokens, row by row
    tables: object | None  # KernelTables of `rows`
    max_seq_len: int
    undo: list[tuple[int, int]]  # (seq_id, length before the step)
    processed_before: int
    cascade: object = None  # cascade.PreparedCascade when `rows` share pages (forks), else None
    write_idx: torch.Tensor | None = None  # int64: the real tokens stored (merged rows store once), None: all
    defer_host: bool = False  # mirrored pages reach their host pages by the copy engine (write_slots)
    fused_dest: dict | None = None  # kv_project's destinations of the step's slots (fused layers)


class DirectKVLayer(CacheLayerMixin):
    """One decoder layer's view of the shared ``DirectKVCache`` (transformers keeps a list)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: "DirectKVCache", layer_idx: int):
        super().__init__()
        self._owner = owner
        self.layer_idx = layer_idx
        self.is_initialized = True
        self.device = owner.device

    def lazy_initialization(self, key_states, value_states) -> None:
        return None

    def update(self, key_states, value_states, *args, **kwargs):
        return self._owner.update(key_states, value_states, self.layer_idx)

    def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):  # older API: cache_position
            query_length = query_length.shape[0]
        return self._owner.processed + int(query_length), 0

    def get_seq_length(self) -> int:
        return self._owner.processed

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:
        return -1

    def reset(self) -> None:
        self._owner.reset()

    def crop(self, tokens_to_remove: int) -> None:
        self._owner.crop(tokens_to_remove)

    def reorder_cache(self, beam_idx) -> None:
        self._owner.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._owner.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices) -> None:
        self._owner.batch_select_indices(indices)


class DirectKVCache(Cache):
    """A transformers ``Cache`` whose K/V live in one ``PagedKVCache`` (pinned host pages, and
    an optional HBM tier), attended by the DirectKV kernels in place.

    Args:
        model: a transformers model (its config, dtype and device are used) or a config.
        max_tokens: tokens of K/V the cache can hold over all its sequences (prompt + generated,
            summed over the batch, pads excluded); the host tier is sized for them.
        max_batch_size: most sequences at once (each may leave one partial page).
            Under tensor parallelism (a model loaded with ``tp_plan``) each rank's cache holds its
            own KV heads (``directkv_cute.tp``): ``max_tokens`` and ``hbm_budget`` are per rank.
        page_size: tokens per page (16, 32, 64, 128).
        hbm_budget: bytes of GPU memory for the HBM tier (0: host only).
        sink_pages: pages at the start of each sequence kept in HBM when there is a budget.
        dtype, device: default to the model's (device "cpu" runs the float32 reference path).
        share_prompts: batch rows whose tokens are identical so far (``num_return_sequences``,
            the beams of one prompt) hold one sequence: its K/V are stored once, and when the
            rows diverge each new branch forks it (full pages shared, read once per step by
            ``cascade_attention``). In the first step, a row whose prompt begins with whole
            pages of an earlier row's (a shared system prompt or document) forks that row at
            them. Rows are compared by their first layer's new K and V, bit for bit.
        window_tokens: new tokens over the batch per step whose pages get an HBM mirror
            (``PagedKVCache.mirror``): each layer writes its new K/V to the host page and the
            mirror, and the attention reads the step's own tokens from HBM, so a host page's
            bytes cross the link once, into host memory, and are read back only in later steps.
            The window holds ``ceil(window_tokens / page_size) + 2 * max_batch_size`` pages (a
            partial page and a boundary page per sequence); a step larger than the window
            mirrors its first pages. 0: no window (every new token is read back from the host).
        kv_dtype: the dtype of the K/V pages: None or "auto" (the model's dtype), "fp8" (=
            ``torch.float8_e4m3fn``) or "e5m2" (``torch.float8_e5m2``), or a torch dtype. FP8 pages
            hold the K/V quantized with per-token scales (``directkv_cute.fp8``) and the model
            computes in its own dtype; half the bytes of bf16 per token over the link (on a GPU:
            decode reads FP8 pages in place, ``kernels/decode_fp8.py``; prefill chunks dequantize
            the pages they read once into HBM, group by group of KV heads as their copy lands).
    """

    def __init__(self, model, *, max_tokens: int, max_batch_size: int = 1, page_size: int = 64,
                 hbm_budget: int = 0, sink_pages: int = 1, dtype: torch.dtype | None = None,
                 device: str | torch.device | None = None, share_prompts: bool = True,
                 window_tokens: int = 8192, kv_dtype: str | torch.dtype | None = None):
        config = getattr(model, "config", model)
        self.spec = model_spec(config)
        # Tensor parallel (transformers' tp_plan under torchrun): this rank's heads only.
        self.shard = model_shard(model, self.spec.num_q_heads, self.spec.num_kv_heads) \
            if hasattr(model, "config") else None
        if self.shard is not None:
            self.spec = ModelSpec(self.spec.num_layers, len(self.shard.q_heads), len(self.shard.kv_heads),
                                  self.spec.head_dim)
        if dtype is None:
            dtype = getattr(model, "dtype", None) or getattr(_text_config(config), "dtype", None) or torch.bfloat16
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        if device is None:
            device = getattr(model, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(device)
        for name, value, low in (("max_tokens", max_tokens, 1), ("max_batch_size", max_batch_size, 1),
                                 ("hbm_budget", hbm_budget, 0), ("sink_pages", sink_pages, 0),
                                 ("window_tokens", window_tokens, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if device.type == "cuda" and self.spec.head_dim not in KERNEL_HEAD_DIMS:
            raise UnsupportedModelError(
                f"head_dim {self.spec.head_dim}: the DirectKV kernels support {KERNEL_HEAD_DIMS}")
        page_dtype = resolve_kv_dtype(kv_dtype, dtype)
        if is_fp8(page_dtype) and device.type == "cuda" and dtype not in (torch.bfloat16, torch.float16):
            raise UnsupportedModelError(
                f"kv_dtype {page_dtype} on {device} with a {dtype} model: the GPU kernels compute in bfloat16 or "
                "float16 (load the model in one of those)")
        hbm_pages = hbm_budget // page_bytes(self.spec.num_layers, self.spec.num_kv_heads, page_size,
                                             self.spec.head_dim, page_dtype)
        # The host tier alone holds max_tokens: a short sequence leaves part of its HBM share unused.
        host_pages = math.ceil(max_tokens / page_size) + max_batch_size
        window_pages = math.ceil(window_tokens / page_size) + 2 * max_batch_size if window_tokens else 0
        # The pinned pool on the NUMA node nearest the GPU (pages land where they are first touched).
        with on_node(gpu_numa_node(device) if device.type == "cuda" else None):
            self.kv = PagedKVCache(self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim, page_size,
                                   num_host_pages=host_pages, num_hbm_pages=hbm_pages, dtype=page_dtype,
                                   device=device, num_window_pages=window_pages,
                                   compute_dtype=dtype if is_fp8(page_dtype) else None)
        self.device = self.kv.device
        self.dtype = dtype
        self.kv_dtype = page_dtype
        self.sink_pages = sink_pages
        self.share_prompts = bool(share_prompts)
        self.processed = 0
        self._seqs: list[int] = []
        self._step: _Step | None = None
        self._checked_modules: set[int] = set()
        super().__init__(layers=[DirectKVLayer(self, i) for i in range(self.spec.num_layers)])

    # ---- transformers Cache API ----------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if not 0 <= layer_idx < self.spec.num_layers:
            raise IndexError(f"layer {layer_idx} out of range for a cache of {self.spec.num_layers} layers")
        if layer_idx == 0:
            self._step = None
        _HANDOFF.pending = (self, layer_idx, key_states)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.processed

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        return self.layers[0].get_mask_sizes(query_length)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    @property
    def batch_size(self) -> int:
        return len(self._seqs) if self._seqs else -1

    def reset(self) -> None:
        for sid in dict.fromkeys(self._seqs):
            self.kv.free(sid)
        self._seqs = []
        self.processed = 0
        self._step = None

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("DirectKVCache.crop (assisted / speculative decoding in generate) is not supported")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select([i for i in range(len(self._seqs)) for _ in range(int(repeats))])

    def batch_select_indices(self, indices) -> None:
        self._select(_as_index_list(indices))

    def reorder_cache(self, beam_idx) -> None:
        self._select(_as_index_list(beam_idx))

    # ---- our API -------------------------------------------------------------------------
    @property
    def seq_ids(self) -> list[int]:
        """The PagedKVCache sequence of each batch row."""
        return list(self._seqs)

    def seq_lengths(self) -> list[int]:
        """Real tokens (pads excluded) cached for each batch row."""
        return [self.kv.seq_len(s) for s in self._seqs]

    def host_bytes(self) -> int:
        """Bytes of K/V held in host pages (pinned)."""
        return (self.kv.num_pages("host") - self.kv.free_pages("host")) * self.kv.page_bytes

    def hbm_bytes(self) -> int:
        return (self.kv.num_pages("hbm") - self.kv.free_pages("hbm")) * self.kv.page_bytes

    def check_request(self, lengths: Sequence[int], max_new_tokens: int) -> None:
        """Raise ``CacheCapacityError`` now if the batch rows, with ``lengths`` more real prompt
        tokens and ``max_new_tokens`` generated tokens each, would not fit (call before ``generate``)."""
        ps = self.kv.page_size
        rows = self._seqs or [None] * len(lengths)
        if len(rows) != len(lengths):
            raise ValueError(f"{len(lengths)} prompts for a cache holding {len(rows)} sequences")
        need = 0
        for sid, n in zip(rows, lengths):
            have = 0 if sid is None else self.kv.seq_len(sid)
            held = 0 if sid is None else len(self.kv.page_table(sid))
            need += -(-(have + int(n) + int(max_new_tokens)) // ps) - held
        free = self.kv.free_pages("host") + self.kv.free_pages("hbm")
        if need > free:
            raise CacheCapacityError(
                f"{len(lengths)} sequences of up to {max(lengths)} prompt tokens + {max_new_tokens} new tokens need "
                f"{need} more pages of {ps} tokens, {free} are free (raise max_tokens)")

    def close(self) -> None:
        self.kv.close()

    # ---- the step ------------------------------------------------------------------------
    def _select(self, rows: list[int]) -> None:
        """Batch rows become ``self._seqs[rows[i]]``; a row used again is forked (full pages
        shared), rows never used are freed. Capacity for the forks is checked first."""
        if not self._seqs:
            return
        if any(not 0 <= r < len(self._seqs) for r in rows):
            raise IndexError(f"batch rows {rows} out of range for a batch of {len(self._seqs)}")
        seen: set[int] = set()
        forks = []
        for r in rows:
            if r in seen:
                forks.append(self._seqs[r])
            seen.add(r)
        self._check_forks(forks, "forking")
        used: set[int] = set()
        new = []
        for r in rows:
            new.append(self._seqs[r] if r not in used else self.kv.fork(self._seqs[r]))
            used.add(r)
        kept = set(new)
        for sid in dict.fromkeys(self._seqs):  # merged rows hold one sequence: free it once, if no row keeps it
            if sid not in kept:
                self.kv.free(sid)
        self._seqs = new
        self._step = None

    def _hbm_quota(self) -> int:
        return self.kv.num_pages("hbm") // max(1, len(set(self._seqs)))

    def _plan(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask) -> _Step:
        batch, hq, q_len, d = query.shape
        if self._seqs and batch != len(self._seqs):
            raise ValueError(f"a batch of {batch} rows for a cache holding {len(self._seqs)} sequences "
                             "(one DirectKVCache per batch; reset() it for a new one)")
        valid = _valid_tokens(attention_mask, batch, q_len)  # bool (B, S) or None
        counts = [q_len] * batch if valid is None else valid.sum(dim=1).tolist()
        share = self.share_prompts and batch > 1
        prefixes: dict[int, tuple[int, int]] = {}  # first step: row -> (earlier row, shared tokens)
        groups_of: dict[int, list[int]] = {}
        if not self._seqs:
            groups = _identical_rows(key, value, valid, list(range(batch))) if share else [[b] for b in range(batch)]
            if share and len(groups) > 1:
                prefixes = _shared_prefixes(key, value, valid, [g[0] for g in groups], self.kv.page_size)
            self._seqs = [-1] * batch
            for g in groups:
                groups_of[g[0]] = g
                if g[0] not in prefixes:  # the others fork an earlier row once it is extended
                    sid = self.kv.add_sequence()
                    for b in g:
                        self._seqs[b] = sid
        elif share and len(set(self._seqs)) < batch:
            self._split(key, value, valid)
        uniq = [sid for sid in dict.fromkeys(self._seqs) if sid >= 0]  # each sequence once, in row order
        first = {}
        for b, sid in enumerate(self._seqs):
            if sid >= 0:
                first.setdefault(sid, b)
        for sid in uniq:  # last step's full pages are current on the host: read there from now on
            self.kv.release_mirrors(sid)
        plans = self._growth([counts[first[sid]] for sid in uniq], uniq)
        undo = [(sid, self.kv.seq_len(sid)) for sid in uniq]
        before = dict(undo)
        skip: dict[int, int] = {}  # sequence -> leading tokens of this step it shares (not stored)
        try:
            for sid, growth in zip(uniq, plans):
                if growth.demote:
                    self.kv.move_pages(sid, growth.demote, "host")
                for tier, n in growth.runs:
                    self.kv.extend(sid, n, tier)
            rows = [b for b in range(batch) if counts[b]]
            # One row per sequence stores its new tokens. Their slots are taken before any prompt
            # prefix is forked, so the forks share the pages these writes fill (no copy-on-write).
            writers = [b for b in rows if self._seqs[b] >= 0 and first[self._seqs[b]] == b]
            spans = ([self._seqs[b] for b in writers], [before[self._seqs[b]] for b in writers],
                     [int(counts[b]) for b in writers])
            for sid, start, n in zip(*spans):
                self.kv.mirror(sid, start, n)
            entries = [(*self.kv.token_entries(*spans), self.kv.mirror_entries(*spans))]
            for b in sorted(prefixes):  # rows sharing an earlier row's prompt prefix: fork it there
                a, m = prefixes[b]
                child = self.kv.fork(self._seqs[a], m)
                undo.append((child, 0))
                before[child], skip[child] = m, m
                for r in groups_of[b]:
                    self._seqs[r] = child
                first[child] = b
                hbm = [lp for lp, e in enumerate(self.kv.page_table(child)) if e < 0]
                growth = plan_growth(m, hbm, int(counts[b]) - m, self.kv.page_size, self._hbm_quota(),
                                     self.sink_pages)
                if growth.demote:
                    self.kv.move_pages(child, growth.demote, "host")
                for tier, n in growth.runs:
                    self.kv.extend(child, n, tier)
                if counts[b] > m:  # its tokens after the shared prefix, taken before any later fork of it
                    span = ([child], [m], [int(counts[b]) - m])
                    self.kv.mirror(child, m, int(counts[b]) - m)
                    entries.append((*self.kv.token_entries(*span), self.kv.mirror_entries(*span)))
                    writers.append(b)
            slots = TokenSlots.build(*(np.concatenate([e[i] for e in entries]) for i in range(2)), self.kv.device,
                                     np.concatenate([e[2] for e in entries]))
            tables = self.kv.kernel_tables([self._seqs[b] for b in rows], back_to_back=True) if rows else None
        except BaseException:
            for sid, length in undo:
                self.kv.truncate(sid, length)
            raise
        q_lens = [int(counts[b]) for b in rows]
        tok_idx = None
        if valid is not None and sum(counts) != batch * q_len:
            tok_idx = valid.reshape(-1).nonzero().squeeze(1).to(query.device)  # (total,) row-major
        write_idx = None
        if len(writers) < len(rows) or skip:  # the stored tokens among the real tokens of `rows`
            cu = [0]
            for n in q_lens:
                cu.append(cu[-1] + n)
            pos = {b: i for i, b in enumerate(rows)}
            write_idx = torch.tensor([t for b in writers
                                      for t in range(cu[pos[b]] + skip.get(self._seqs[b], 0), cu[pos[b] + 1])],
                                     dtype=torch.long).to(query.device)
        # A chunk of at least a page per sequence: its mirrored pages are copied to the host by the
        # copy engine, off the layer's path (a decode step's few rows are stored directly). Not
        # when prompts were forked in this step: the forks read the shared pages from the host.
        defer = not prefixes and max(q_lens, default=0) >= self.kv.page_size
        step = _Step(batch, q_len, rows, q_lens, tok_idx, slots, tables,
                     max((self.kv.seq_len(self._seqs[b]) for b in rows), default=0), undo, self.processed,
                     self._cascade(tables, q_lens, hq, query.device) if len(rows) > 1 else None, write_idx,
                     defer)
        self.processed += q_len
        return step

    def _split(self, key: torch.Tensor, value: torch.Tensor, valid) -> None:
        """Rows that share a sequence but whose new tokens differ now get their own: each group
        of rows that still agree forks the sequence (its state before this step), capacity
        checked for all the forks first."""
        by_sid: dict[int, list[int]] = {}
        for b, sid in enumerate(self._seqs):
            by_sid.setdefault(sid, []).append(b)
        splits = []
        for sid, rows in by_sid.items():
            if len(rows) > 1:
                groups = _identical_rows(key, value, valid, rows)
                splits += [(sid, g) for g in groups if rows[0] not in g]
        self._check_forks([sid for sid, _ in splits], "rows that diverged forking")
        for sid, g in splits:
            child = self.kv.fork(sid)
            for b in g:
                self._seqs[b] = child

    def _check_forks(self, sids: list[int], what: str) -> None:
        """``CacheCapacityError`` unless the free pages cover a fork of each of ``sids`` (a fork
        copies the partial last page), before any is made."""
        need: dict[str, int] = {}
        for sid in sids:
            if self.kv.seq_len(sid) % self.kv.page_size:
                tier = "hbm" if self.kv.page_table(sid)[-1] < 0 else "host"
                need[tier] = need.get(tier, 0) + 1
        for tier, n in need.items():
            if n > self.kv.free_pages(tier):
                raise CacheCapacityError(f"{what} {n} sequences needs {n} free {tier} pages, "
                                         f"{self.kv.free_pages(tier)} free; the cache is unchanged")

    def _cascade(self, tables, q_lens, num_q_heads: int, device):
        """The step's cascade (shared pages read once for all their sharers: forks made by
        ``batch_repeat_interleave``, beam search or ``fork``), or None when nothing is shared."""
        from directkv_cute.cascade import plan_cascade, prepare_cascade

        plan = plan_cascade(tables.host_table, tables.host_seq_lens, q_lens, self.kv.page_size)
        return prepare_cascade(self.kv, tables, plan, num_q_heads, device) if plan.shared else None

    def _growth(self, counts: Sequence[int], sids: Sequence[int]) -> list[Growth]:
        """Every sequence's growth for this step, with the step's capacity checked as a whole
        before anything changes."""
        quota = self._hbm_quota()
        lengths = [self.kv.seq_len(sid) for sid in sids]
        plans = []
        for sid, length, n in zip(sids, lengths, counts):
            hbm = [lp for lp, e in enumerate(self.kv.page_table(sid)) if e < 0]
            plans.append(plan_growth(length, hbm, int(n), self.kv.page_size, quota, self.sink_pages))
        need = self._needs(plans, lengths)
        if need["hbm"] > self.kv.free_pages("hbm"):  # shared pages can crowd the tier: spill to host
            plans = [Growth(g.demote, tuple(("host", m) for _, m in g.runs)) for g in plans]
            need = self._needs(plans, lengths)
        if need["host"] > self.kv.free_pages("host"):
            raise CacheCapacityError(
                f"this step adds {sum(counts)} tokens over {len(counts)} sequences and needs {need['host']} host "
                f"pages, {self.kv.free_pages('host')} free (raise max_tokens); the cache is unchanged")
        return plans

    def _needs(self, plans: list[Growth], lengths: list[int]) -> dict[str, int]:
        """Net new pages per tier of a step's plans (demotions free HBM pages, take host ones)."""
        ps = self.kv.page_size
        need = {"host": 0, "hbm": 0}
        for g, length in zip(plans, lengths):
            need["host"] += len(g.demote)
            need["hbm"] -= len(g.demote)
            for tier, m in g.runs:
                need[tier] += -(-(length + m) // ps) - -(-length // ps)
                length += m
        return need

    def attend(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
               scaling: float | None, layer_idx: int) -> torch.Tensor:
        """One layer of the step: store its new K/V, attend over the history; (B, S, Hq, d)."""
        if id(module) not in self._checked_modules:
            _check_module(module, self.spec)
            self._checked_modules.add(id(module))
        _check_qkv(query, key, value, self)
        batch, hq, q_len, d = query.shape
        if layer_idx == 0 or self._step is None:
            if layer_idx != 0:
                raise RuntimeError(f"layer {layer_idx} ran before layer 0 in this step")
            self._step = self._plan(query, key, value, attention_mask)
        step = self._step
        if (batch, q_len) != (step.batch, step.q_len):
            raise RuntimeError(f"layer {layer_idx} has {batch}x{q_len} tokens, the step {step.batch}x{step.q_len}")
        try:
            return self._attend_layer(step, query, key, value, scaling, layer_idx)
        except BaseException:
            self._rollback(step)
            raise

    def attend_fused(self, module, query: torch.Tensor, hidden_states: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, attention_mask, scaling: float | None, layer_idx: int) -> torch.Tensor:
        """One layer of the step with the K/V projection fused (``fuse_kv_projection``): query
        (B, Hq, S, d) after RoPE, the layer's input ``hidden_states`` (B, S, hidden) and the
        rotary ``cos``/``sin`` (B, S, d); ``kv_project`` computes K and V, applies RoPE and stores
        them into their pages (the step's window mirrors, the host copy by the copy engine) in one
        kernel, then the attention runs as in ``attend``; (B, S, Hq, d)."""
        from directkv_cute.kv_proj import cache_destinations, kv_project

        if id(module) not in self._checked_modules:
            _check_module(module, self.spec)
            self._checked_modules.add(id(module))
        batch, hq, q_len, d = query.shape
        if hidden_states.shape[:2] != (batch, q_len):
            raise ValueError(f"hidden_states {tuple(hidden_states.shape)} do not match query {tuple(query.shape)}")
        w_k, w_v = module.k_proj.weight, module.v_proj.weight
        b_k, b_v = module.k_proj.bias, module.v_proj.bias
        x = hidden_states.reshape(batch * q_len, -1)  # (B * S, hidden)
        planning = layer_idx == 0 or self._step is None
        # kv_project stores bf16/fp16 rows only, so FP8 pages take its dense K/V and quantize them
        # as ``attend`` stores them; and sharing is found from the first layer's K/V
        # (share_prompts), so that layer too projects densely and stores the unfused way.
        if self.kv.fp8 or (planning and self.share_prompts and batch > 1):
            kd = torch.empty(batch * q_len, self.spec.num_kv_heads, d, dtype=query.dtype, device=query.device)
            vd = torch.empty_like(kd)
            kv_project(x.contiguous(), w_k, w_v, b_k, b_v, cos=cos.reshape(-1, d).contiguous(),
                       sin=sin.reshape(-1, d).contiguous(), out_k=kd, out_v=vd, check_slots=False)
            key = kd.view(batch, q_len, -1, d).transpose(1, 2)  # (B, Hkv, S, d)
            value = vd.view(batch, q_len, -1, d).transpose(1, 2)
            return self.attend(module, query, key, value, attention_mask, scaling, layer_idx)
        if planning:
            if layer_idx != 0:
                raise RuntimeError(f"layer {layer_idx} ran before layer 0 in this step")
            _check_query(query, self)
            self._step = self._plan(query, None, None, attention_mask)
        step = self._step
        if (batch, q_len) != (step.batch, step.q_len):
            raise RuntimeError(f"layer {layer_idx} has {batch}x{q_len} tokens, the step {step.batch}x{step.q_len}")
        try:
            if not step.rows:
                return query.new_zeros(batch, q_len, hq, d)
            sel = step.tok_idx
            if step.write_idx is not None:
                sel = step.write_idx if sel is None else sel[step.write_idx]
            c, s_ = cos.reshape(-1, d), sin.reshape(-1, d)
            if sel is not None:
                x, c, s_ = x[sel], c[sel], s_[sel]
            if step.fused_dest is None:
                step.fused_dest = cache_destinations(self.kv, step.slots, step.defer_host)
            kv_project(x.contiguous(), w_k, w_v, b_k, b_v, cos=c.contiguous(), sin=s_.contiguous(), layer=layer_idx,
                       check_slots=False, **step.fused_dest)
            self.kv.note_host_write(step.slots)  # staged calls copy these host pages after the kernel
            if step.defer_host:
                self.kv.copy_mirrors_to_host(step.slots, layer_idx)
            q = query.transpose(1, 2).reshape(batch * q_len, hq, d)  # (B * S, Hq, d)
            if step.tok_idx is not None:
                q = q[step.tok_idx]
            return self._attention(step, q, scaling, layer_idx, query)
        except BaseException:
            self._rollback(step)
            raise

    def _rollback(self, step: _Step) -> None:
        for sid, length in step.undo:
            if self.kv.seq_len(sid) > length:
                self.kv.truncate(sid, length)
        self.processed = step.processed_before
        self._step = None

    def _attend_layer(self, step: _Step, query, key, value, scaling, layer_idx: int) -> torch.Tensor:
        batch, hq, q_len, d = query.shape
        hkv = key.shape[1]
        q = query.transpose(1, 2).reshape(batch * q_len, hq, d)  # (B * S, Hq, d)
        k = key.transpose(1, 2).reshape(batch * q_len, hkv, d)  # (B * S, Hkv, d)
        v = value.transpose(1, 2).reshape(batch * q_len, hkv, d)  # (B * S, Hkv, d)
        if step.tok_idx is not None:
            q, k, v = q[step.tok_idx], k[step.tok_idx], v[step.tok_idx]
        if not step.rows:
            return query.new_zeros(batch, q_len, hq, d)
        if step.write_idx is None:
            self.kv.write_slots(step.slots, layer_idx, k, v, defer_host=step.defer_host)
        else:
            self.kv.write_slots(step.slots, layer_idx, k.index_select(0, step.write_idx),
                                v.index_select(0, step.write_idx), defer_host=step.defer_host)
        return self._attention(step, q, scaling, layer_idx, query)

    def _attention(self, step: _Step, q: torch.Tensor, scaling, layer_idx: int, query) -> torch.Tensor:
        """The step's attention of one layer over every row's whole history, its new tokens
        stored: q (total real tokens, Hq, d); (B, S, Hq, d) with zeros for pad rows."""
        batch, hq, q_len, d = query.shape
        q = q.contiguous()
        if step.cascade is not None:
            from directkv_cute.cascade import cascade_attention

            o = cascade_attention(q, self.kv, layer_idx, [self._seqs[b] for b in step.rows], step.q_lens, scaling,
                                  tables=step.tables, prepared=step.cascade)
        elif q.is_cuda:
            from directkv_cute.ops import paged_attention_tables

            o = paged_attention_tables(q, self.kv, layer_idx, step.tables, step.q_lens, scaling,
                                       max_seq_len=step.max_seq_len)  # (total, Hq, d)
        else:
            from directkv_cute.reference import cache_scales, tables_attention_ref

            o, _ = tables_attention_ref(q, self.kv.device_pool("host"), self.kv.device_pool("hbm"),
                                        step.tables.page_table, step.tables.seq_lens, layer_idx, step.q_lens,
                                        scaling, **cache_scales(self.kv))
        if step.tok_idx is None:
            return o.view(batch, q_len, hq, d)
        out = query.new_zeros(batch * q_len, hq, d)
        out[step.tok_idx] = o
        return out.view(batch, q_len, hq, d)


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


def _as_index_list(indices) -> list[int]:
    if isinstance(indices, torch.Tensor):
        if indices.dtype == torch.bool:
            indices = indices.nonzero().squeeze(1)
        return [int(i) for i in indices.tolist()]
    return [int(i) for i in indices]


def _valid_tokens(attention_mask, batch: int, q_len: int) -> torch.Tensor | None:
    """bool (B, S): which of the step's new tokens are real, from the 2-D padding mask."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        shape = getattr(attention_mask, "shape", type(attention_mask).__name__)
        raise ValueError(f"DirectKV attention takes the 2-D padding mask (batch, tokens), got {shape}; "
                         "load the model with attn_implementation='directkv' so transformers builds that mask")
    if attention_mask.shape[0] != batch or attention_mask.shape[1] < q_len:
        raise ValueError(f"padding mask of shape {tuple(attention_mask.shape)} for {batch} rows x {q_len} new tokens")
    return attention_mask[:, -q_len:].to(torch.bool)


def _identical_rows(key: torch.Tensor, value: torch.Tensor, valid, rows: list[int]) -> list[list[int]]:
    """``rows`` grouped by equality of their new tokens: padding mask, first layer's K and V (B,
    Hkv, S, d), bit for bit. Groups in order of their first row; ``rows[0]`` leads the first."""
    k = key[rows].reshape(len(rows), -1)
    v = value[rows].reshape(len(rows), -1)
    sig = torch.stack([k.float().sum(1), v.float().sum(1), k.float().abs().sum(1)], 1)
    if valid is not None:
        sig = torch.cat([sig, valid[rows].float().to(sig.device)], 1)
    sig = sig.tolist()
    groups: list[list[int]] = []
    for i, b in enumerate(rows):
        for g in groups:
            j = rows.index(g[0])
            if sig[i] == sig[j] and torch.equal(k[i], k[j]) and torch.equal(v[i], v[j]) \
                    and (valid is None or torch.equal(valid[b], valid[g[0]])):
                g.append(b)
                break
        else:
            groups.append([b])
    return groups


def _shared_prefixes(key: torch.Tensor, value: torch.Tensor, valid, rows: list[int], page_size: int):
    """{row: (earlier row, tokens)}: rows of the first step whose real tokens begin with at least
    one page of another row's (same first-layer K and V, bit for bit), each paired with the
    earlier row it shares the most whole pages with. A random projection of each token's K and V
    finds the candidates; the shared part is then compared exactly."""
    n_rows, hkv, s, d = key.shape
    g = torch.Generator(device="cpu").manual_seed(0)
    w = torch.randn(d, generator=g, dtype=torch.float64).to(key.device)
    sig = ((key[rows].double() @ w).sum(1) + 3.0 * (value[rows].double() @ w).sum(1)).cpu()  # (R, S)
    real = [torch.arange(s) if valid is None else valid[b].nonzero().squeeze(1).cpu() for b in rows]
    toks = [sig[i, real[i]].numpy() for i in range(len(rows))]
    out: dict[int, tuple[int, int]] = {}
    for i in range(1, len(rows)):
        best_j, best = -1, 0
        for j in range(i):
            n = min(len(toks[i]), len(toks[j]))
            diff = np.flatnonzero(toks[i][:n] != toks[j][:n])
            c = int(diff[0]) if diff.size else n
            if c // page_size * page_size > best:
                best_j, best = j, c // page_size * page_size
        if best >= page_size:
            a, b = rows[best_j], rows[i]
            ia, ib = real[best_j][:best].to(key.device), real[i][:best].to(key.device)
            if torch.equal(key[a][:, ia], key[b][:, ib]) and torch.equal(value[a][:, ia], value[b][:, ib]):
                out[b] = (a, best)
    return out


def _check_module(module, spec: ModelSpec) -> None:
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


def _check_query(query, cache: DirectKVCache) -> None:
    spec = cache.spec
    if query.dim() != 4 or query.shape[1] != spec.num_q_heads or query.shape[3] != spec.head_dim:
        raise ValueError(f"query {tuple(query.shape)} does not match the cache's {spec.num_q_heads} query heads, "
                         f"head_dim {spec.head_dim} (expected (B, Hq, S, d))")
    if query.dtype != cache.dtype:
        raise TypeError(f"the model runs in {query.dtype}, the cache holds {cache.dtype} "
                        "(build the cache with the model's dtype)")
    if query.device != cache.device:
        raise ValueError(f"the model runs on {query.device}, the cache is on {cache.device}")


def _check_qkv(query, key, value, cache: DirectKVCache) -> None:
    spec = cache.spec
    if query.dim() != 4 or key.dim() != 4 or key.shape != value.shape:
        raise ValueError(f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}: "
                         "expected (B, H, S, d) tensors")
    if query.shape[1] != spec.num_q_heads or key.shape[1] != spec.num_kv_heads or query.shape[3] != spec.head_dim:
        raise ValueError(f"query {tuple(query.shape)} / key {tuple(key.shape)} do not match the cache's "
                         f"{spec.num_q_heads} query heads, {spec.num_kv_heads} KV heads, head_dim {spec.head_dim}")
    if key.shape[0] != query.shape[0] or key.shape[2] != query.shape[2]:
        raise ValueError(f"key {tuple(key.shape)} holds other tokens than query {tuple(query.shape)} "
                         "(DirectKVCache.update returns the step's new tokens)")
    if query.dtype != cache.dtype or key.dtype != cache.dtype:
        raise TypeError(f"the model runs in {query.dtype}, the cache holds {cache.dtype} "
                        "(build the cache with the model's dtype)")
    if query.device != cache.device:
        raise ValueError(f"the model runs on {query.device}, the cache is on {cache.device}")


# ---- the fused K/V projection ----------------------------------------------------------------
# Attention modules whose forward is q/k/v projections, transformers' apply_rotary_pos_emb (NeoX
# rotate_half layout) on q and k from the model's position_embeddings, the cache update, the
# attention and o_proj, with no norm on q or k: their K/V can come from ``kv_project``.
FUSABLE_ATTENTION = ("LlamaAttention", "MistralAttention", "Qwen2Attention")


def _fusable(module) -> bool:
    return any(c.__name__ in FUSABLE_ATTENTION for c in type(module).__mro__)


def _check_fusable(module) -> None:
    from directkv_cute.kv_proj import HEAD_DIM, SUPPORTED_DTYPES

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
    import types

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


# ---- transformers registration ---------------------------------------------------------------
def directkv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The ``attn_implementation="directkv"`` attention function: (out (B, S, Hq, d), None)."""
    pending, _HANDOFF.pending = _HANDOFF.pending, None
    if pending is None or pending[2] is not key:
        raise RuntimeError("attn_implementation='directkv' needs a directkv_cute.hf.DirectKVCache as the "
                           "model's cache (generate(..., past_key_values=cache))")
    cache, layer_idx, _ = pending
    if getattr(module, "layer_idx", layer_idx) != layer_idx:
        raise RuntimeError(f"attention of layer {module.layer_idx} after the cache update of layer {layer_idx}")
    if dropout:
        raise UnsupportedModelError("attention dropout is not supported (inference only)")
    for feature in ("sliding_window", "softcap", "s_aux", "sinks"):
        if kwargs.get(feature) is not None:
            raise UnsupportedModelError(f"attention with {feature}={kwargs[feature]!r} is not supported by DirectKV")
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


register()
