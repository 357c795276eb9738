"""The transformers adapter over one ``PagedKVCache``: ``DirectKVCache`` (a ``transformers.Cache``)
and the per-layer view transformers keeps a list of, ``DirectKVLayer``. The adapter holds what
transformers asks of a cache (the Cache API, batch reordering, lengths), the hand-off from
``update`` to the attention function, and a step's rules (one thread, layers in order, rollback);
the step runs each layer (``hf.step.Step``).

``update`` only hands a layer's new K/V to the attention function (it cannot see the padding
mask); the attention function of the first layer plans the step once (``step.BatchSequences``,
the attention included: ``DirectKVAttention.plan``) and every layer then runs in that step
(``Step.run``: its new K/V stored into their pages, that plan run over the whole history;
``Step.run_fused`` for a layer whose K/V projection is fused). Pad tokens never enter the cache;
their query rows get zeros.

A step is all or nothing: its capacity is checked before anything changes, and a refusal or an
error at any layer rolls it back (``abort_step``), so a retry generates what a fresh cache would.
A cache serves one generation at a time: the thread that runs its first step owns it until
``reset()``, and a step (or reset, reorder) from another live thread is refused at once.
"""

from __future__ import annotations

import numbers
import threading
import weakref
from collections.abc import Sequence

import torch

try:
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("directkv_cute.hf needs transformers: pip install 'directkv-cute[hf]'") from exc

from directkv_cute.cache import CacheCapacityError, PagedKVCache, page_bytes
from directkv_cute.config import DEFAULT_PAGE_SIZE, SUPPORTED_PAGE_SIZES
from directkv_cute.fp8 import is_fp8
from directkv_cute.hf.model import (
    KERNEL_HEAD_DIMS,
    ModelSpec,
    UnsupportedModelError,
    check_module,
    check_qkv,
    check_query,
    model_spec,
    resolve_kv_dtype,
    text_config,
)
from directkv_cute.hf.step import BatchSequences, KVProjection, Step
from directkv_cute.hf.step_plan import WINDOW_TOKENS, as_count, as_index_list, cache_pages
from directkv_cute.sparse import SparseBudget, SparseStats
from directkv_cute.tp import gpu_numa_node, model_shard, on_node


class _Handoff(threading.local):
    """``update`` -> attention function hand-off within one thread (one layer at a time), and
    the cache of the thread's last update (a refusal before the hand-off rolls its step back)."""

    pending: tuple | None = None
    last = None  # weakref.ref of the DirectKVCache of the thread's last update


HANDOFF = _Handoff()


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
        sparse: a ``directkv_cute.SparseBudget``: decode steps read only each row's best pages,
            chosen per layer from page summaries the cache keeps (``PagedKVCache(...,
            summaries=True)``); prompt steps stay exact. None (default): exact.
        sparse_stats: with ``sparse``, measure the attention mass each decode step's selected
            pages hold of the exact attention (``sparse_stats.mass``, ``directkv_cute.sparse``);
            it reads every key of each row per layer: for measurements, not for speed.

    The cache serves the model it was built for (a model with another layer count, KV heads or
    head_dim is refused at its first layer) and one generation at a time: the first step's thread
    owns it until ``reset()``; another thread's steps are refused with a RuntimeError while the
    owner lives.
    """

    def __init__(self, model, *, max_tokens: int, max_batch_size: int = 1, page_size: int = DEFAULT_PAGE_SIZE,
                 hbm_budget: int = 0, sink_pages: int = 1, dtype: torch.dtype | None = None,
                 device: str | torch.device | None = None, share_prompts: bool = True,
                 window_tokens: int = WINDOW_TOKENS, kv_dtype: str | torch.dtype | None = None,
                 sparse: SparseBudget | None = None, sparse_stats: bool = False):
        config = getattr(model, "config", model)
        self.spec = model_spec(config)
        # Tensor parallel (transformers' tp_plan under torchrun): this rank's heads only.
        self.shard = model_shard(model, self.spec.num_q_heads, self.spec.num_kv_heads) \
            if hasattr(model, "config") else None
        if self.shard is not None:
            self.spec = ModelSpec(self.spec.num_layers, len(self.shard.q_heads), len(self.shard.kv_heads),
                                  self.spec.head_dim)
        if dtype is None:
            dtype = getattr(model, "dtype", None) or getattr(text_config(config), "dtype", None) or torch.bfloat16
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        if device is None:
            device = getattr(model, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(device)
        for name, value, low in (("max_tokens", max_tokens, 1), ("max_batch_size", max_batch_size, 1),
                                 ("hbm_budget", hbm_budget, 0), ("sink_pages", sink_pages, 0),
                                 ("window_tokens", window_tokens, 0), ("page_size", page_size, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if page_size not in SUPPORTED_PAGE_SIZES:
            raise ValueError(f"page_size must be one of {SUPPORTED_PAGE_SIZES}, got {page_size}")
        if device.type == "cuda" and self.spec.head_dim not in KERNEL_HEAD_DIMS:
            raise UnsupportedModelError(
                f"head_dim {self.spec.head_dim}: the DirectKV kernels support {KERNEL_HEAD_DIMS}")
        if sparse is not None and not isinstance(sparse, SparseBudget):
            raise TypeError(f"sparse must be a directkv_cute.SparseBudget or None, got {type(sparse).__name__}")
        if not isinstance(sparse_stats, bool):
            raise TypeError(f"sparse_stats must be a bool, got {type(sparse_stats).__name__}")
        page_dtype = resolve_kv_dtype(kv_dtype, dtype)
        if is_fp8(page_dtype) and device.type == "cuda" and dtype not in (torch.bfloat16, torch.float16):
            raise UnsupportedModelError(
                f"kv_dtype {page_dtype} on {device} with a {dtype} model: the GPU kernels compute in bfloat16 or "
                "float16 (load the model in one of those)")
        pages = cache_pages(max_tokens, max_batch_size, page_size, page_bytes(
            self.spec.num_layers, self.spec.num_kv_heads, page_size, self.spec.head_dim, page_dtype), hbm_budget,
            window_tokens)
        host_pages, hbm_pages, window_pages = pages.host, pages.hbm, pages.window
        # The pinned pool on the NUMA node nearest the GPU (pages land where they are first touched).
        with on_node(gpu_numa_node(device) if device.type == "cuda" else None):
            self.kv = PagedKVCache(self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim, page_size,
                                   num_host_pages=host_pages, num_hbm_pages=hbm_pages, dtype=page_dtype,
                                   device=device, num_window_pages=window_pages,
                                   compute_dtype=dtype if is_fp8(page_dtype) else None,
                                   summaries=sparse is not None)
        self.device = self.kv.device
        self.dtype = dtype
        self.kv_dtype = page_dtype
        self.sink_pages = sink_pages
        self.share_prompts = bool(share_prompts)
        self.processed = 0
        self.sparse = sparse
        self._batch = BatchSequences(self.kv, sink_pages, self.share_prompts, sparse)
        # The attention mass of the selected pages, measured where asked (None: not measured).
        self.sparse_stats = SparseStats() if sparse_stats and sparse is not None else None
        if self.sparse_stats is not None:
            self._batch.attention.sparse_hooks.append(self.sparse_stats)
        self._step: Step | None = None  # the step in flight, or the last one
        self._checked_configs: set[int] = set()
        # The thread whose generation the cache serves (None: free until the next step). A step
        # from another live thread is refused before it touches anything.
        self._owner_thread: threading.Thread | None = None
        self._owner_lock = threading.Lock()
        super().__init__(layers=[DirectKVLayer(self, i) for i in range(self.spec.num_layers)])

    @property
    def _seqs(self) -> list[int]:
        """The sequence of each batch row (``BatchSequences.seqs``)."""
        return self._batch.seqs

    # ---- transformers Cache API ----------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        self._enter()
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, numbers.Integral):
            self.abort_step()
            raise TypeError(f"layer_idx must be an int, got {type(layer_idx).__name__}")
        if layer_idx >= self.spec.num_layers:
            # Layers 0 .. num_layers - 1 of this forward ran and stored the step: undo it.
            if self._step is not None:
                self._rollback(self._step)
            raise IndexError(f"layer {layer_idx} out of range for a cache of {self.spec.num_layers} layers "
                             "(a model with more layers than the cache was built for?); the step was rolled back")
        if layer_idx < 0:
            self.abort_step()
            raise IndexError(f"layer {layer_idx} out of range for a cache of {self.spec.num_layers} layers")
        HANDOFF.pending = (self, layer_idx, key_states)
        HANDOFF.last = weakref.ref(self)
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
        """Free every sequence; the cache is then free for the next generation, on any thread."""
        self._enter()
        self._batch.reset()
        self.processed = 0
        if self.sparse_stats is not None:
            self.sparse_stats.reset()
        self._step = None
        with self._owner_lock:
            self._owner_thread = None

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("DirectKVCache.crop (assisted / speculative decoding in generate) is not supported")

    def batch_repeat_interleave(self, repeats: int) -> None:
        repeats = as_count(repeats, "repeats", 1)
        self._select([i for i in range(len(self._seqs)) for _ in range(repeats)])

    def batch_select_indices(self, indices) -> None:
        self._select(as_index_list(indices))

    def reorder_cache(self, beam_idx) -> None:
        self._select(as_index_list(beam_idx))

    # ---- our API -------------------------------------------------------------------------
    @property
    def last_plan(self):
        """The ``AttentionPlan`` every layer of the latest step ran (``explain()`` says which route
        and why, with a sparse budget's pages); None before the first step."""
        return self._batch.attention.current

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
        if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence):
            raise TypeError(f"lengths must be a sequence of ints, got {type(lengths).__name__}")
        lengths = [as_count(n, "every prompt length") for n in lengths]
        max_new_tokens = as_count(max_new_tokens, "max_new_tokens")
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
        """Batch rows become ``self._seqs[rows[i]]`` (``BatchSequences.select``)."""
        self._enter()
        if self._step is not None and not self._step.complete(self.spec.num_layers):
            raise RuntimeError("batch rows reordered in the middle of a step")
        if self._seqs:
            self._batch.select(rows)
            self._step = None

    def _check_module(self, module) -> None:
        check_module(module)  # every call: a module may be put in training mode between steps

    def _check_model(self, module) -> None:
        """Refuse a model whose shape differs from the cache's, from its attention module's
        config (once per config): fewer layers than the cache (its last layers would silently
        never be stored); KV heads and head_dim unless tensor parallel (the cache then holds the
        rank's heads). A config with more layers is let through: a view of a model that runs
        some of its layers shares their modules, and a layer past the cache's is refused at its
        ``update`` with the step rolled back."""
        config = getattr(module, "config", None)
        if config is None or id(config) in self._checked_configs:
            return
        try:
            spec = model_spec(config)
        except (AttributeError, TypeError):  # not a decoder config: the per-layer checks still hold
            return
        theirs = [("layers", spec.num_layers, self.spec.num_layers)] if spec.num_layers < self.spec.num_layers else []
        if self.shard is None:
            theirs += [("KV heads", spec.num_kv_heads, self.spec.num_kv_heads),
                       ("head_dim", spec.head_dim, self.spec.head_dim)]
        wrong = [f"{what} {got} (the cache: {want})" for what, got, want in theirs if got != want]
        if wrong:
            raise UnsupportedModelError(f"this DirectKVCache was built for another model: the model has "
                                        f"{', '.join(wrong)}; build one for this model")
        self._checked_configs.add(id(config))

    # ---- one generation at a time, one step at a time -----------------------------------
    def _enter(self) -> None:
        """Refuse a call from a thread other than the one whose generation the cache serves
        (while that thread lives); otherwise the calling thread owns the cache from now on."""
        me = threading.current_thread()
        with self._owner_lock:
            owner = self._owner_thread
            if owner is not None and owner is not me and owner.is_alive():
                raise RuntimeError(
                    f"this DirectKVCache serves a generation of thread {owner.name!r}: one cache serves one "
                    "generation at a time (use one cache per concurrent generate, or reset() it from that "
                    "thread when its generation is done)")
            self._owner_thread = me

    def abort_step(self) -> None:
        """Roll back the step in flight, if one is (a refusal or an error part-way through it):
        its sequences back at their lengths before it, ``get_seq_length()`` too."""
        self._enter()
        step = self._step
        if step is not None and not step.complete(self.spec.num_layers):
            self._rollback(step)

    def abort_own_step(self) -> None:
        """``abort_step`` when the calling thread owns the cache; otherwise nothing (a refusal
        on the way must not turn into another thread's error)."""
        if self._owner_thread is threading.current_thread():
            self.abort_step()

    def _run_layer(self, module, layer_idx: int, run):
        """One layer of the step under the step's rules: the owner's thread only; at layer 0 the
        model's shape is checked and the last step must have run every layer; any refusal or
        error rolls the whole step back, whatever the layer."""
        self._enter()
        try:
            if layer_idx == 0:
                last = self._step
                if last is not None and not last.complete(self.spec.num_layers):
                    self._rollback(last)
                    raise RuntimeError(
                        f"the last step stopped after {last.layers_done} of {self.spec.num_layers} layers (an error "
                        "outside the attention, or a model with fewer layers than the cache); it was rolled back: "
                        "run the forward again")
                self._step = None
                self._check_model(module)
            self._check_module(module)
            out = run()
        except BaseException:
            self.abort_step()
            raise
        self._step.layers_done += 1
        return out

    def step_for(self, query: torch.Tensor, key, value, attention_mask, layer_idx: int) -> Step:
        """The step a layer runs in: planned by layer 0 (``key``/``value`` None when the layer
        projects its K/V itself), reused by the others, in layer order."""
        batch, _, q_len, _ = query.shape
        if layer_idx == 0:
            self._step = self._batch.plan(query, key, value, attention_mask, self.processed)
            self.processed += q_len
        step = self._step
        if step is None or step.layers_done != layer_idx:
            raise RuntimeError(f"layer {layer_idx} ran out of order: the step has run "
                               f"{0 if step is None else step.layers_done} layers")
        if (batch, q_len) != (step.batch, step.q_len):
            raise RuntimeError(f"layer {layer_idx} has {batch}x{q_len} tokens, the step {step.batch}x{step.q_len}")
        return step

    def attend(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
               scaling: float | None, layer_idx: int) -> torch.Tensor:
        """One layer of the step (``Step.run``): store its new K/V, attend over the history;
        (B, S, Hq, d)."""
        return self._run_layer(module, layer_idx, lambda: self._layer(query, key, value, attention_mask, scaling,
                                                                      layer_idx))

    def attend_fused(self, module, query: torch.Tensor, hidden_states: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, attention_mask, scaling: float | None, layer_idx: int) -> torch.Tensor:
        """One layer of the step with the K/V projection fused (``fuse_kv_projection``): query (B,
        Hq, S, d) after RoPE, the layer's input ``hidden_states`` (B, S, hidden) and the rotary
        ``cos``/``sin`` (B, S, d); ``kv_project`` computes K and V, applies RoPE and stores them
        into their pages (the step's window mirrors, the host copy by the copy engine) in one
        kernel (``Step.run_fused``), then the attention runs as in ``attend``; (B, S, Hq, d)."""
        return self._run_layer(module, layer_idx, lambda: self._fused_layer(module, query, hidden_states, cos, sin,
                                                                            attention_mask, scaling, layer_idx))

    def _layer(self, query, key, value, attention_mask, scaling, layer_idx: int) -> torch.Tensor:
        check_qkv(query, key, value, self.spec, self.dtype, self.device)
        step = self.step_for(query, key, value, attention_mask, layer_idx)
        return step.run(query, key, value, scaling, layer_idx)

    def _fused_layer(self, module, query, hidden_states, cos, sin, attention_mask, scaling,
                     layer_idx: int) -> torch.Tensor:
        projection = KVProjection.of(module, hidden_states, cos, sin, query)
        batch = query.shape[0]
        # kv_project stores bf16/fp16 rows only, so FP8 pages take its dense K/V and quantize them
        # as ``attend`` stores them; and sharing is found from the first layer's K/V
        # (share_prompts), so that layer too projects densely and stores the unfused way.
        if self.kv.fp8 or (layer_idx == 0 and self.share_prompts and batch > 1):
            key, value = projection.dense(query, self.spec.num_kv_heads)
            return self._layer(query, key, value, attention_mask, scaling, layer_idx)
        if layer_idx == 0:
            check_query(query, self.spec, self.dtype, self.device)
        step = self.step_for(query, None, None, attention_mask, layer_idx)
        return step.run_fused(query, projection, scaling, layer_idx)

    def _rollback(self, step: Step) -> None:
        self._batch.rollback(step)
        self.processed = step.processed_before
        self._step = None
